"""Retention (schema 8, bili_addon/retention.py): trimming rows nothing reads any more, pruning whole
idle sessions (families only as a whole), on SQLite and PostgreSQL, with live sessions untouched."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time

import pytest
from test_fold import ANTH, H, agent_answers_unknown, body, conversation, refs_in, roundtrip_call
from test_lineage import F, folded_parent, more

from bili_addon import cli, retention
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import HANGING, SCHEMA_VERSION, CalibrationRow, SessionRow, Store, WireTurn
from bili_addon.stores import TABLES, open_store

DAY = retention.DAY


def sql(store, q: str, params=()) -> list[tuple]:
    """A raw statement on either backend (``?`` placeholders)."""
    if store.backend == "sqlite":
        return store.db.execute(q, params).fetchall()
    return store._q(q.replace("?", "%s"), params)


def age(store, sid: str, days: float) -> None:
    sql(store, "UPDATE sessions SET last_seen=? WHERE id=?", (time.time() - days * DAY, sid))


def rows_of(store, sid: str) -> dict[str, int]:
    out = {t: sql(store, f"SELECT COUNT(*) FROM {t} WHERE session_id=?", (sid,))[0][0] for t in (*HANGING, "chains")}
    return {t: int(n) for t, n in out.items() if n}


def engine_on(store) -> Engine:
    e = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000))
    e.snapshot = True  # the transcript table fills too
    return e


def folded(e: Engine, sid: str = "fold-1", headers=H) -> tuple[list[dict], dict[str, str]]:
    """A conversation with a fold (its originals, call, blocks), usage, wire and calibration rows."""
    msgs = conversation(8)
    if sid != "fold-1":  # a conversation of its own (the same history would make it fold-1's fork)
        msgs = json.loads(json.dumps(msgs).replace("toolu_", f"toolu_{sid}_").replace("Please audit", f"{sid}: audit"))
    refs = refs_in(json.loads(e.process(body(msgs), ANTH, headers, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4",
                         "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(e, sid, "compress", args, f"toolu_c_{sid}")
    msgs = agent_answers_unknown(msgs, "compress", args, f"toolu_c_{sid}")
    assert e.process(body(msgs), ANTH, headers, render=True).executed == ["compress"]
    msgs = more(msgs, "Audit continues.")
    res = e.process(body(msgs), ANTH, headers, render=True)  # a render of the folded prefix: the transcript
    for i in range(3):
        e.store.record_usage(sid, "anthropic", (1000 + i, 800, 100, 50))
    e.store.record_wire(sid, WireTurn(0, time.time(), 1, "claude-x", 9000, 3000, None, 1, 4, ["compress"],
                                      3000, 800, 100, 50))
    e.store.record_calibration(sid, CalibrationRow(0, time.time(), "api.anthropic.com", "anthropic", "anthropic",
                                                   None, None, 3000, 0, 1000, 3100, 0, 1200))
    e.store.save_chain((f"resp_{sid}", sid, "", 1, "", 0, b"[]", "", 0, None, b"[]", "", time.time()))
    return msgs, refs_in(json.loads(res.body))


def max_ref(payload_refs) -> int:
    return max(int(r[1:]) for r in payload_refs)


# -- pruning whole sessions ---------------------------------------------------------------------------

def test_an_idle_session_is_pruned_to_a_tombstone_and_comes_back_cold_without_reusing_a_ref(backend):
    e = engine_on(backend())
    msgs, refs = folded(e)
    folded(e, "live-1", {"x-acp-session": "live-1"})
    had = rows_of(e.store, "fold-1")
    for t in ("ledger_turns", "refs_turns", "blocks", "originals", "calls", "turns", "copies", "transcript", "wire",
              "calibration", "chains", "lineage_parts"):
        assert had.get(t), f"the fixture should fill {t}"
    row = e.store.session("fold-1")
    age(e.store, "fold-1", 40)
    live_before = rows_of(e.store, "live-1")

    dry = retention.prune(e.store, 30 * DAY, dry_run=True)
    assert dry.removed == [["fold-1"]] and dry.rows == {"sessions": 1, **had}
    assert rows_of(e.store, "fold-1") == had  # a dry run removes nothing

    rep = retention.prune(e.store, 30 * DAY)
    assert rep.removed == [["fold-1"]] and rep.rows == dry.rows
    assert rows_of(e.store, "fold-1") == {}
    assert rows_of(e.store, "live-1") == live_before  # the live session keeps every row
    tomb = e.store.session("fold-1")  # the tombstone: its counter, a new version, hidden from the listings
    assert tomb.next_ref == row.next_ref and tomb.version == row.version + 1
    assert [r.id for r in e.store.sessions()] == ["live-1"]
    assert retention.prune(e.store, 30 * DAY).removed == []  # nothing twice

    # the conversation comes back (a restart, and the same engine): cold, every ref a new one
    for eng in (engine_on(backend()), e):
        nxt = more(msgs, f"back after a month ({id(eng)})")
        out = json.loads(eng.process(body(nxt), ANTH, H, render=True).body)
        got = refs_in(out)
        assert got and min(int(r[1:]) for r in got) >= row.next_ref, "a ref given before the prune was given again"
        assert not re.search(r"\[Compressed conversation section \S+ \\u00b7 ", json.dumps(out))  # no fold comes back
    assert "fold-1" in [r.id for r in e.store.sessions()]  # seen again: listed again


def test_a_pruned_store_keeps_serving_a_live_session(backend):
    e = engine_on(backend())
    folded(e, "old-1", {"x-acp-session": "old-1"})
    msgs, refs = folded(e)
    age(e.store, "old-1", 45)
    next_ref = e.store.session("fold-1").next_ref
    assert retention.prune(e.store, 30 * DAY).removed == [["old-1"]]
    retention.forget(e, ["old-1"])
    # decompress and search still answer from the live session's rows
    blocks = [json.loads(b) for b in e.store.blocks("fold-1")]
    assert "(inside b1): file-3: file-3-row-0" in e.plugin_tool("fold-1", "search_context", {"query": "file-3-row-7"})[1]
    assert "Step 2:" in e.plugin_tool("fold-1", "decompress", {"blockId": blocks[0]["id"]})[1]
    # refs go on from the counter, none given twice
    out = json.loads(e.process(body(more(msgs, "and on")), ANTH, H, render=True).body)
    new = set(refs_in(out)) - set(refs)
    assert new and min(int(r[1:]) for r in new) >= next_ref


def test_a_family_is_pruned_only_as_a_whole_and_forks_still_resolve(backend):
    e = engine_on(backend())
    msgs, _ = folded_parent(e)
    res = e.process(body(more(msgs, "continue in the fork")), ANTH, F, render=True)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    e.store.record_usage("parent", "anthropic", (1, 1, 1, 1))
    fam_next = e.store.family("fork")[3]
    age(e.store, "parent", 40)  # the parent is idle, its fork is not: nothing goes
    assert retention.prune(e.store, 30 * DAY).removed == []
    assert rows_of(e.store, "parent")
    # a new fork of the (idle) parent still resolves against its rows
    res = e.process(body(more(msgs, "a second fork")), ANTH, {"x-claude-code-session-id": "fork2"}, render=True)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    for sid in ("parent", "fork", "fork2"):
        age(e.store, sid, 40)
    rep = retention.prune(e.store, 30 * DAY)
    assert sorted(rep.removed[0]) == ["fork", "fork2", "parent"] and len(rep.removed) == 1
    assert rep.rows["lineage"] == 3
    top = max(e.store.session(s).next_ref for s in ("parent", "fork", "fork2"))
    assert top >= fam_next
    for sid in ("parent", "fork", "fork2"):  # each keeps the family's counter: no ref of the family again
        assert e.store.session(sid).next_ref == top and rows_of(e.store, sid) == {}
        assert e.store.family(sid) is None


def test_a_session_seen_after_the_cutoff_is_left_alone(backend):
    s = backend()
    e = engine_on(s)
    folded(e)
    age(s, "fold-1", 40)
    before = time.time() - 30 * DAY
    fams = retention.idle_families(s, before)
    assert fams == [["fold-1"]]
    sql(s, "UPDATE sessions SET last_seen=? WHERE id=?", (time.time(), "fold-1"))  # a turn meanwhile
    assert s.prune(fams[0], before) is None
    assert rows_of(s, "fold-1")


def test_an_instance_never_prunes_a_session_another_instance_serves(backend):
    """(SQLite: the two stores stand for two processes; their session locks are open-file locks,
    which exclude each other within one process too: locks.py)"""
    a, b = backend(), backend()
    e = engine_on(a)
    msgs, _ = folded(e)
    age(a, "fold-1", 40)
    a.hold("fold-1")  # instance a is serving the session (its turn's lock)
    rep = retention.prune(b, 30 * DAY)
    assert rep.removed == [] and rep.skipped == [["fold-1"]] and rows_of(b, "fold-1")
    a.release(wait=True)  # the unlock answered: a try of the lock from b's connection gets it
    assert retention.prune(b, 30 * DAY).removed == [["fold-1"]]
    first = b.session("fold-1").next_ref
    # instance a had the session cached: its next turn finds the version moved and reloads it
    out = e.process(body(more(msgs, "next")), ANTH, H, render=True)
    assert out.status == 0 and min(int(r[1:]) for r in refs_in(json.loads(out.body))) >= first


# -- trimming dead rows --------------------------------------------------------------------------------

def chain(rid, base="", created=0.0, stored=1, session="s"):
    return (rid, session, "" if stored else "ws-1", stored, base, 1 if base else 0, b"[]", base, 1 if base else 0,
            None, b"[]", "", created)


def test_trim_removes_only_rows_nothing_reads(backend):
    s = backend()
    now = time.time()
    old, older = now - 31 * DAY, now - 40 * DAY
    for row in (chain("r_root", "", older), chain("r_mid", "r_root", old), chain("r_live", "r_mid", now),  # a live chain
                chain("r_leaf", "r_root", old),  # an abandoned branch, older than the provider keeps it
                chain("r_young", "", now - 10 * DAY),  # the provider still has it
                chain("r_ws", "", now - 2 * DAY, stored=0), chain("r_ws_new", "", now - 3600, stored=0),
                ("r_tomb", "", "", 0, "r_tomb", 0, b"[]", "r_tomb", 0, None, b"[]", "", older)):  # a tombstone
        s.save_chain(row)
    s.commit_turn(SessionRow("u", "", "anthropic", now, now, 1, 1, 1), [], expect=0)
    for i in range(5):
        s.record_usage("u", "anthropic", (100 + i, 10, 1, 5))
    last = s.last_usage("u")
    totals = s.usage("u")
    rows, dead, after = retention.trim(s, now=now)
    assert sorted(dead) == ["r_leaf", "r_tomb", "r_ws"] and rows == {"turns": 4, "chains": 3} and after == ""
    assert s.last_usage("u") == last and s.usage("u") == totals  # what is read stays
    for rid in ("r_root", "r_mid", "r_live", "r_young", "r_ws_new"):
        assert s.chain(rid) is not None
    assert retention.trim(s, now=now)[0] == {}
    # a bounded pass: one row of each kind at a time, going on where it stopped
    assert retention.trim(s, now=now + 20 * DAY, limit=2)[2] != ""


def test_chains_drop_what_a_trim_removed_from_memory(backend):
    e = engine_on(backend())
    e.chains._last_of_session["s"] = ("r_gone", None)
    e.chains._last_on_conn["ws"] = "r_gone"
    retention.forget(e, chain_ids=["r_gone"])
    assert "s" not in e.chains._last_of_session and "ws" not in e.chains._last_on_conn


# -- schema 8 ------------------------------------------------------------------------------------------

def test_a_schema_7_store_gains_the_retention_schema(backend):
    s = backend()
    engine_on(s).process(body(conversation(2)), ANTH, H, render=True)
    sql(s, "DROP INDEX chains_agent_base")
    sql(s, "DROP INDEX chains_sent_base")
    sql(s, "ALTER TABLE sessions DROP COLUMN pruned")
    sql(s, "UPDATE meta SET value='7' WHERE key='schema_version'")
    s.close()
    again = backend()
    assert again.schema_version() == SCHEMA_VERSION >= 8
    cols, _key = TABLES["sessions"]
    assert again.dump("sessions", cols, ("id",))[0][-1] == 0  # pruned: never
    assert [r.id for r in again.sessions()] == ["fold-1"]
    names = {r[0] for r in sql(again, "SELECT name FROM sqlite_master WHERE type='index'" if again.backend == "sqlite"
                              else "SELECT indexname FROM pg_indexes")}
    assert {"chains_agent_base", "chains_sent_base"} <= names


# -- the command line ----------------------------------------------------------------------------------

def test_cli_prune_dry_run_then_prune(tmp_path, capsys):
    e = engine_on(Store(tmp_path))
    folded(e)
    folded(e, "live-1", {"x-acp-session": "live-1"})
    age(e.store, "fold-1", 40)
    had = rows_of(e.store, "fold-1")
    e.store.close()
    args = ["store", "prune", "--older-than", "30d", "--data-dir", str(tmp_path)]
    assert cli.main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove 1 conversation(s)" in out and "fold-1" in out and "live-1" not in out
    assert rows_of(Store(tmp_path), "fold-1") == had
    assert cli.main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sessions"] == ["fold-1"] and doc["rows"]["originals"] == had["originals"] and not doc["dry_run"]
    s = Store(tmp_path)
    assert rows_of(s, "fold-1") == {} and rows_of(s, "live-1")
    assert s.db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    assert cli.main(args) == 0 and "removed 0 conversation(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["store", "prune", "--older-than", "soon", "--data-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "is not an age" in capsys.readouterr().err


def test_cli_prune_on_postgresql(tmp_path, pg_url, capsys):
    e = engine_on(open_store(pg_url, str(tmp_path)))
    folded(e)
    age(e.store, "fold-1", 40)
    e.store.close()
    assert cli.main(["store", "prune", "--older-than", "4w", "--store", pg_url, "--dry-run"]) == 0
    assert "would remove 1 conversation(s)" in capsys.readouterr().out
    assert cli.main(["store", "prune", "--older-than", "4w", "--store", pg_url]) == 0
    assert "removed 1 conversation(s)" in capsys.readouterr().out
    s = open_store(pg_url, str(tmp_path))
    assert rows_of(s, "fold-1") == {} and s.session("fold-1").next_ref > 1
    s.close()


def test_parse_age():
    assert retention.parse_age("30d") == 30 * DAY and retention.parse_age("12h") == 12 * 3600
    assert retention.parse_age("2w") == 14 * DAY and retention.parse_age("7") == 7 * DAY
    with pytest.raises(ValueError):
        retention.parse_age("-3d")


# -- where it runs -------------------------------------------------------------------------------------

def test_trimming_runs_on_the_stores_worker_never_inside_a_turns_or_answers_work(bili, monkeypatch):
    from test_shell import ANTH_BODY, model_flow, session_headers

    calls: list[tuple[str, list[str]]] = []
    real = retention.trim

    def spy(store, **kw):
        calls.append((threading.current_thread().name, [f.function for f in inspect.stack()]))
        return real(store, **kw)

    monkeypatch.setattr(retention, "trim", spy)
    monkeypatch.setattr(retention, "EVERY_TURNS", 1)

    async def main():
        bili.running()  # the start-up pass is submitted to the worker
        f = model_flow(ANTH_BODY, headers=session_headers())
        await bili.request(f)
        f.response = __import__("mitmproxy.http", fromlist=["Response"]).Response.make(
            200, json.dumps({"id": "m", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "ok"}],
                             "usage": {"input_tokens": 10, "output_tokens": 2}}).encode(),
            {"content-type": "application/json"})
        pending = bili.response(f)
        if pending is not None:
            await pending
        await asyncio.get_running_loop().run_in_executor(bili.keeper._pool, lambda: None)  # the queue drains

    asyncio.run(main())
    bili.keeper.stop()
    assert len(calls) >= 2, "a start-up pass and one after the answer"
    for thread, stack in calls:
        assert thread.startswith("bili-store")
        assert not {"request", "response", "_account", "_process", "process"} & set(stack), stack


def test_bili_retention_sets_the_days_and_0_keeps_sessions_forever(bili):
    eng = bili.engine
    e = engine_on(eng.store)
    folded(e)
    age(eng.store, "fold-1", 40)
    for i in range(3):
        eng.store.record_usage("fold-1", "anthropic", (1, 1, 1, 1))
    bili.tctx.configure(bili, bili_retention=0)
    assert bili.retention.days == 0
    out = bili.retention.run(eng)
    assert "pruned" not in out and out["trimmed"]["turns"] >= 3 and rows_of(eng.store, "fold-1")  # trimmed, kept
    bili.tctx.configure(bili, bili_retention=35)
    assert bili.retention.run(eng)["pruned"] == 1 and rows_of(eng.store, "fold-1") == {}
    stats = bili.stats(eng)["retention"]
    assert stats["days"] == 35 and stats["passes"] == 2 and stats["last"]["pruned"] == 1


def test_a_fork_made_while_a_prune_runs_keeps_its_family_whole(backend):
    """The pruner lists the idle families, then prunes each in a transaction of its own: a fork of an
    idle parent made in between left the parent pruned alone (its lineage row gone, the fork's still
    naming it; its counter below the family's), and the parent, back later, gave refs its fork had
    given to other texts.  The prune now finds the family grown and leaves it; an adoption finds a
    parent pruned meanwhile and is computed again."""
    from test_fold import ANTH, body
    from test_lineage import F, folded_parent, more

    a = engine_on(backend())  # the proxy
    msgs, _ = folded_parent(a)
    age(a.store, "parent", 40)
    pruner = backend()  # `bili store prune`, another process
    before = time.time() - 30 * DAY
    fams = retention.idle_families(pruner, before)
    assert fams == [["parent"]]
    res = a.process(body(more(msgs, "continue in the fork")), ANTH, F, render=True)  # the user forks it meanwhile
    assert any("a fork of parent" in n for n in res.notes)
    assert pruner.prune(fams[0], before) is None  # the family grew: left whole
    assert {r[0] for r in sql(pruner, "SELECT session_id FROM lineage")} == {"parent", "fork"}
    # and the other order: the parent pruned first, then a fork's adoption (its history read before)
    c = engine_on(backend())
    age(c.store, "fork", 40)
    age(c.store, "parent", 40)
    fams = retention.idle_families(pruner, before)
    assert sorted(map(sorted, fams)) == [["fork", "parent"]]
    assert pruner.prune(fams[0], before) is not None
    from bili_addon.store import StaleSession, SessionRow
    with pytest.raises(StaleSession):
        c.store.adopt(SessionRow("late", "", "anthropic", 0.0, 0.0, 0, 0, 1), "parent", "parent", 0, [], [], [], [],
                      expect=0)


@pytest.mark.parametrize("argv", [["prune", "--older-than", "30d", "--dry-run"], ["info"], ["migrate", "--to", "X"]])
def test_a_store_command_on_a_data_dir_without_a_store_says_so_and_makes_none(tmp_path, capsys, argv):
    """A mistyped --data-dir: the store was made there, empty, and a dry run, a listing or a copy
    read from nothing ("nothing to prune"); a dry run wrote a store, its lock file and its schema."""
    from bili_addon import cli

    typo = tmp_path / "no-such-dir"
    argv = [a if a != "X" else str(tmp_path / "target") for a in argv]
    assert cli.main(["store", *argv[:1], "--data-dir", str(typo), *argv[1:]]) == 1
    err = capsys.readouterr().err
    assert "no bili store in" in err and str(typo) in err
    assert not typo.exists() and not (tmp_path / "target").exists()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_dry_run_on_an_older_store_leaves_it_as_it_is(tmp_path, capsys, request, kind):
    """Opening a store migrates an older one: a dry run did, and so wrote to it."""
    import sqlite3

    from bili_addon import cli
    from bili_addon.store import Store
    from bili_addon.stores import open_store

    if kind == "sqlite":
        Store(str(tmp_path)).close()
        db = sqlite3.connect(tmp_path / "bili.sqlite3")
        db.execute("UPDATE meta SET value='10' WHERE key='schema_version'")
        db.commit()
        db.close()
        where = ["--data-dir", str(tmp_path)]
        schema = lambda: sqlite3.connect(tmp_path / "bili.sqlite3").execute(  # noqa: E731
            "SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    else:
        import psycopg

        url = request.getfixturevalue("pg_url")
        open_store(url, str(tmp_path)).close()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("UPDATE meta SET value='10' WHERE key='schema_version'")
        where = ["--store", url]

        def schema():
            with psycopg.connect(url, autocommit=True) as c:
                return c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    assert cli.main(["store", "prune", "--older-than", "30d", "--dry-run", *where]) == 1
    assert "a dry run does not migrate it" in capsys.readouterr().err
    assert schema() == "10"
