"""Operating a PostgreSQL store: the addon picks it from bili_store, health names the backend and
its round trip, bili doctor checks it, and an unreachable database fails open with the reason."""

from __future__ import annotations

import argparse
import json

import pytest
from mitmproxy.test import tflow

from bili_addon.launch import doctor_checks
from bili_addon.store import SCHEMA_VERSION
from bili_addon.stores import open_store, store_spec

DEAD = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"


def health(bili) -> dict:
    f = tflow.tflow()
    f.request.path = "/__bili/health"
    f.request.host = "127.0.0.1"
    assert bili.request(f) is None
    return json.loads(f.response.content)


def test_bili_store_picks_postgresql_and_health_names_it(bili, pg_url):
    bili.tctx.configure(bili, bili_store=pg_url)
    assert bili.engine is not None and bili.engine.store.backend == "postgresql"
    h = health(bili)
    assert h["store"] is True and h["store_backend"] == "postgresql"
    assert h["store_at"].startswith("postgresql://postgres@127.0.0.1:")
    bili.keeper.probe()  # not running: no worker, no figure (health never waits on the store)
    assert "store_latency_ms" not in h


def test_an_unreachable_database_fails_open_with_the_reason(bili):
    bili.tctx.configure(bili, bili_store=DEAD)
    h = health(bili)
    assert h["store"] is False and h["store_backend"] == "postgresql"
    assert "cannot open the store at postgresql://nobody@127.0.0.1:1/none" in h["store_error"]
    assert h["store_hint"]


def test_the_environment_names_the_store_when_the_option_does_not():
    assert store_spec("", {"BILI_STORE": " postgresql://a@b/c "}) == "postgresql://a@b/c"
    assert store_spec("postgresql://x@y/z", {"BILI_STORE": "postgresql://a@b/c"}) == "postgresql://x@y/z"
    assert store_spec("", {}) == ""


def test_a_password_never_shows(pg_url, tmp_path):
    s = open_store(pg_url.replace("postgres@", "postgres:secret@"), str(tmp_path))
    try:
        assert "secret" not in s.where and ":***@" in s.where
    finally:
        s.close()


def test_doctor_checks_the_shared_store(pg_url, tmp_path):
    args = argparse.Namespace(confdir=str(tmp_path / "conf"), data_dir=str(tmp_path / "data"), port=1, store=pg_url)
    store = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["store"]
    assert store.ok and f"schema version {SCHEMA_VERSION}" in store.detail and "round trip" in store.detail
    args.store = DEAD
    store = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["store"]
    assert not store.ok and "cannot open the store" in store.detail


def test_a_schema_2_store_gets_the_wire_table_on_open_and_keeps_its_sessions(backend):
    """A store written by the bili before the wire table (schema 2) is brought to schema 3 when opened:
    the wire table appears, the sessions are untouched (their versions too: no cached copy goes stale)."""
    from bili_addon.store import LedgerRow, SessionRow, WireTurn

    s = backend()
    v = s.commit_turn(SessionRow("old", "", "", 0.0, 0.0, 1, 1, 2), [LedgerRow("h", "aa", "m00001", "user", "text", 1)],
                      expect=0, minted=[("m00001", "aa")])
    raw = s.db.execute if s.backend == "sqlite" else s._q
    raw("DROP TABLE wire")
    raw("UPDATE meta SET value='2' WHERE key='schema_version'")
    s.close()
    s = backend()
    assert s.schema_version() == SCHEMA_VERSION  # the newest (3 brought the wire table)
    assert s.version("old") == v and [r.ref for r in s.ledger("old")] == ["m00001"]
    assert s.wire("old") == [] and s.wire_totals("old") == (0, None, 0, 0, [])
    assert s.record_wire("old", WireTurn(0, 0, 1, "m", 10, 8, None, 0, 0, [], 8, 0, 0, 1)) == 1


def test_a_schema_3_postgresql_store_gets_the_one_statement_commit(pg_url, tmp_path):
    """Schema 6 (PostgreSQL only): the turn's commit is one function call; a store of schema 3 gets
    the function when opened and its sessions go on where they were."""
    from bili_addon.store import LedgerRow, SessionRow, StaleSession
    from bili_addon.store_pg import PgStore

    s = PgStore(pg_url, str(tmp_path))
    v = s.commit_turn(SessionRow("s3", "", "", 0.0, 0.0, 1, 1, 2), [LedgerRow("h", "aa", "m00001", "user", "text", 1)],
                      expect=0, minted=[("m00001", "aa")])
    s._q("DROP FUNCTION bili_commit_turn")
    s._q("DROP FUNCTION bili_hold")
    s._q("UPDATE meta SET value='3' WHERE key='schema_version'")
    s.close()
    s = PgStore(pg_url, str(tmp_path))
    try:
        assert s.schema_version() == SCHEMA_VERSION
        s.hold("s3")
        assert s.version("s3") == v  # read with the lock (bili_hold)
        s.release()
        row = SessionRow("s3", "", "", 0.0, 0.0, 2, 2, 3)
        with pytest.raises(StaleSession):  # the version it was computed from moved
            s.commit_turn(row, [LedgerRow("h2", "bb", "m00002", "user", "text", 1)], expect=v - 1,
                          minted=[("m00002", "bb")])
        with pytest.raises(StaleSession):  # a counter that is not the store's (another instance gave refs)
            s.commit_turn(SessionRow("s3", "", "", 0.0, 0.0, 2, 2, 4), [LedgerRow("h2", "bb", "m00003", "user", "text", 1)],
                          expect=v, minted=[("m00003", "bb")])
        assert s.version("s3") == v and [r.ref for r in s.ledger("s3")] == ["m00001"]  # nothing of them kept
        assert s.commit_turn(row, [LedgerRow("h2", "bb", "m00002", "user", "text", 1)], expect=v,
                             minted=[("m00002", "bb")], chain=(2, "tail")) == v + 1
        assert sorted(r.ref for r in s.ledger("s3")) == ["m00001", "m00002"]
        assert s.session("s3").next_ref == 3 and ("s3", 2, "tail") in s.affinity()
    finally:
        s.close()


# -- per-session serialisation across instances ---------------------------------------------------
def test_an_answer_is_recorded_whoever_holds_its_session(pg_url, tmp_path):
    """The turn numbers' lock is not the session's: an instance records an answer of a session it
    holds itself (no wait on its own lock) or that another instance is working on."""
    from bili_addon.store import WireTurn
    from bili_addon.store_pg import PgStore

    a, b = PgStore(pg_url, str(tmp_path), lock_wait=0.2), PgStore(pg_url, str(tmp_path), lock_wait=0.2)
    w = WireTurn(0, 0, 1, "m", 10, 8, None, 0, 0, [], 8, 0, 0, 1)
    try:
        a.hold("x")
        assert a.record_wire("x", w) == 1
        assert b.record_wire("x", w) == 2
        assert [t.n for t in b.wire("x")] == [1, 2]
    finally:
        a.close()
        b.close()


def test_a_session_is_worked_on_by_one_instance_at_a_time(pg_url, tmp_path):
    from bili_addon.store import SessionBusy
    from bili_addon.store_pg import PgStore

    a, b = PgStore(pg_url, str(tmp_path), lock_wait=0.2), PgStore(pg_url, str(tmp_path), lock_wait=0.2)
    try:
        a.hold("x")
        a.hold("x")  # held already: nothing more
        with pytest.raises(SessionBusy, match="busy in another instance"):
            b.hold("x")
        b.hold("y")  # other sessions go on
        a.release()
        b.hold("x")
        b.release()
        a.hold("x")
    finally:
        a.close()
        b.close()


def test_a_turn_whose_session_stays_busy_passes_through_unchanged_and_the_next_one_is_tagged(pg_url, tmp_path):
    from bili_addon.keeper import Keeper
    from bili_addon.kernel.turn import Engine
    from bili_addon.store_pg import PgStore
    from bili_addon.wire import LANES

    raw = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode()
    keeper = Keeper(lambda d: Engine(PgStore(pg_url, d, lock_wait=0.2)))
    keeper.open(str(tmp_path))
    other = PgStore(pg_url, str(tmp_path))
    try:
        other.hold("busy")
        turn = lambda eng: eng.process(raw, LANES["anthropic"], {"x-acp-session": "busy"}, render=True)  # noqa: E731
        assert keeper.run(turn) is None
        assert keeper.counts["session_busy"] == 1 and keeper.counts["forwarded_unchanged"] == 1 and keeper.ok
        other.release()
        res = keeper.run(turn)
        assert res is not None and res.body is not None and b"<acp " in res.body
        other.hold("busy")  # the keeper let go of the lock when the turn was done
    finally:
        other.close()
        keeper.stop()


def test_the_lock_of_an_instance_killed_mid_turn_is_freed(pg_url, tmp_path):
    import signal
    import subprocess
    import sys

    from bili_addon.store_pg import PgStore

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom bili_addon.store_pg import PgStore\n"
        f"s = PgStore({pg_url!r}, {str(tmp_path)!r})\ns.hold('s1')\nprint('held', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        b = PgStore(pg_url, str(tmp_path), lock_wait=0.2)
        from bili_addon.store import SessionBusy

        with pytest.raises(SessionBusy):
            b.hold("s1")
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        b.lock_wait = 10.0  # the server notices the closed connection and drops its locks
        b._drop_lock_conn()
        b.hold("s1")
        b.close()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_bili_run_store_sets_bili_store_once(tmp_path, monkeypatch, capsys):
    from bili_addon import cli

    seen: list[list[str]] = []
    envs: list = []
    monkeypatch.setattr(cli, "_serve", lambda cmd, target, ready, env=None: seen.append(list(cmd)) or envs.append(env) or 0)
    monkeypatch.setattr(cli, "port_in_use", lambda host, port: False)
    ca = ["--confdir", str(tmp_path / "ca")]
    url = "postgresql://bili@db.internal/bili"
    assert cli.main(["run", *ca, "--store", url, "--", "--set", f"bili_store={url}"]) == 0
    sets = [seen[-1][i + 1] for i, a in enumerate(seen[-1]) if a == "--set"]
    assert [s for s in sets if s.startswith("bili_store=")] == [f"bili_store={url}"]
    # --store alone: to mitmdump through $BILI_STORE, never in its arguments (a password there is every
    # local user's to read in the process list)
    secret = "postgresql://bili:s3cret@db.internal/bili"
    assert cli.main(["run", *ca, "--store", secret]) == 0
    assert not any("s3cret" in a for a in seen[-1]) and envs[-1]["BILI_STORE"] == secret
    n = len(seen)
    assert cli.main(["run", *ca, "--store", url, "--", "--set", "bili_store=postgresql://other/db"]) == 2
    assert len(seen) == n and "--store" in capsys.readouterr().err


def test_a_follow_up_turn_on_postgresql_takes_two_round_trips(pg_url, tmp_path, monkeypatch):
    """Issue #11's "a few round trips": the session's lock and its state (version, family, last
    usage) in one statement, the turn's commit in one statement and the lock's release with it (one
    pipeline: the turn's last write carries the unlock, tests/test_pg_release.py); the lineage of
    the turn is stored after the answer, in one statement more."""
    import psycopg

    from bili_addon import store_pg
    from bili_addon.kernel.turn import Engine
    from bili_addon.store_pg import PgStore
    from bili_addon.wire import LANES

    store = PgStore(pg_url, str(tmp_path))
    eng = Engine(store)
    eng.lineage.defer = True
    msgs = [{"role": "user", "content": "Look at the parser."},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading it."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"p": "a"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "def parse(): ..."}]}]
    turn = lambda: eng.process(json.dumps({"model": "m", "messages": msgs}).encode(), LANES["anthropic"],  # noqa: E731
                               {"x-acp-session": "rt"}, render=True)
    sent: list[str] = []
    execute = psycopg.Connection.execute
    monkeypatch.setattr(psycopg.Connection, "execute", lambda self, q, *a, **k: sent.append(str(q)) or execute(self, q, *a, **k))
    call = PgStore._call  # the turn's two statements, sent through libpq as they are
    monkeypatch.setattr(PgStore, "_call", lambda self, c, q, p: sent.append(q.decode()) or call(self, c, q, p))
    soon = PgStore.hold_soon  # (the hold's: sent before the turn reads the request, its answer read after)

    def hold_soon(self, sid, candidates=None):
        soon(self, sid, candidates)
        if self._soon is not None:
            sent.append(store_pg._HOLD.decode())
    monkeypatch.setattr(PgStore, "hold_soon", hold_soon)
    try:
        turn()
        eng.lineage.flush()
        msgs.append({"role": "assistant", "content": "It splits on commas."})
        msgs.append({"role": "user", "content": "Now fix the quoting."})
        before, sent[:] = store.round_trips, []
        res = turn()
        assert res.refs_new == 2 and res.refs_known == 4
        assert store.round_trips - before == 2, sent
        assert [q.split("(")[0] for q in sent] == ["SELECT json_build_array", "CALL pg_temp.bili_commit_release"], sent
        assert "FROM bili_hold(" in sent[0]
        assert not store._unlocking and not store._held  # the unlock went with the commit
        with psycopg.connect(pg_url, autocommit=True) as other:  # ... and another instance gets the lock
            other.execute("SET lock_timeout = 5000")
            other.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("rt"),))
            other.execute("SELECT pg_advisory_unlock_all()")
        before = store.round_trips
        eng.lineage.flush()  # after the answer
        assert store.round_trips - before == 1 and len(store.lineage_parts("rt")) == 6
    finally:
        store.close()


def test_what_the_lock_read_answers_until_the_session_is_let_go(pg_url, tmp_path):
    """The version, family and last usage read with the session's lock answer this instance until it
    writes or lets go; then the store is read again."""
    from bili_addon.store import LedgerRow, SessionRow
    from bili_addon.store_pg import PgStore

    a, b = PgStore(pg_url, str(tmp_path)), PgStore(pg_url, str(tmp_path))
    try:
        v = a.commit_turn(SessionRow("x", "", "", 0.0, 0.0, 1, 1, 2), [LedgerRow("h", "aa", "m00001", "user", "text", 1)],
                          expect=0, minted=[("m00001", "aa")])
        a.hold("x")
        assert (a.version("x"), a.family("x"), a.last_usage("x")) == (v, None, None)
        b.record_usage("x", "anthropic", (10, 5, 2, 1))  # an answer's bookkeeping (no lock)
        assert a.last_usage("x") is None  # as read with the lock
        v2 = a.set_flags(SessionRow("x", "", "", 0.0, 0.0, 1, 1, 2, '{"k": 1}'), expect=v)
        assert v2 == v + 1 and a.version("x") == v2  # its own write moves what it holds
        a.release()
        a.hold("x")
        assert a.last_usage("x") == (10, 5, 2, 1) and a.version("x") == v2
        a.release()
    finally:
        a.close()
        b.close()


def test_a_schema_3_store_of_either_backend_gets_calibration_and_chains(backend):
    """A store written before calibration (4), chains (5) and the PostgreSQL functions (6) is brought
    to the newest schema when opened: both tables appear and take rows, its sessions are untouched."""
    from bili_addon.store import CHAIN_COLS, CalibrationRow, LedgerRow, SessionRow

    s = backend()
    v = s.commit_turn(SessionRow("old3", "", "", 0.0, 0.0, 1, 1, 2), [LedgerRow("h", "aa", "m00001", "user", "text", 1)],
                      expect=0, minted=[("m00001", "aa")])
    raw = s.db.execute if s.backend == "sqlite" else s._q
    raw("DROP TABLE calibration")
    raw("DROP TABLE chains")
    if s.backend != "sqlite":
        raw("DROP FUNCTION bili_commit_turn")
        raw("DROP FUNCTION bili_hold")
    raw("UPDATE meta SET value='3' WHERE key='schema_version'")
    s.close()
    s = backend()
    try:
        assert s.schema_version() == SCHEMA_VERSION >= 7
        assert s.version("old3") == v and [r.ref for r in s.ledger("old3")] == ["m00001"]
        assert s.record_calibration("old3", CalibrationRow(0, 1.0, "h", "anthropic", "anthropic", None, None,
                                                           10, 0, 10, 10, 0, 10)) == 1
        row = dict(zip(CHAIN_COLS, ("resp_1", "old3", "", 1, "", 0, b"[]", "", 0, None, b"[]", "o1", 1.0)))
        s.save_chain(tuple(row[c] for c in CHAIN_COLS))
        assert s.chain("resp_1") == tuple(row[c] for c in CHAIN_COLS)
        s.hold("old3")
        assert s.version("old3") == v
        s.release()
    finally:
        s.close()


def test_a_release_whose_answer_never_comes_costs_the_lock_connection_only(pg_url, tmp_path):
    """The unlock release sends is read before the lock connection's next statement; a connection
    that died meanwhile (the server dropped it, and its locks with it) is replaced: the next turn's
    hold works, and another instance was never kept waiting."""
    import psycopg

    from bili_addon.store_pg import PgStore

    store = PgStore(pg_url, str(tmp_path))
    try:
        store.hold("a")
        pid = store._lock_conn.info.backend_pid
        store.release()
        store.hold("b")  # the unlock's answer read first, then the lock of b on the same connection
        assert store._lock_conn.info.backend_pid == pid and not store._unlocking
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))  # the server drops it, b's lock with it
            other.execute("SET lock_timeout = 5000")
            other.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("b"),))
            other.execute("SELECT pg_advisory_unlock_all()")
        store.release()  # sent into a dead connection (or failing at once): no error here
        store.hold("c")  # the missing answer costs the connection: a new one takes c's lock
        assert store._lock_conn.info.backend_pid != pid and store.version("c") == 0
        store.release()
    finally:
        store.close()


@pytest.mark.parametrize("url", [
    "postgresql://bob:s3cret@db/bili", "postgresql://:s3cret@db/bili", "postgresql://db/bili?user=bob&password=s3cret",
    "postgres://db/bili?sslpassword=s3cret&password=s3cret", "host=db password=s3cret dbname=bili",
    "host=db password='s3 cret' dbname=bili",
])
def test_a_store_url_is_shown_without_its_password_in_every_form(url):
    """/__bili/health (no token needed) and every log and error name the store by this."""
    from bili_addon.store_pg import redact

    shown = redact(url)
    assert "s3cret" not in shown and "s3 cret" not in shown and "db" in shown


def test_a_sqlite_store_whose_chains_have_no_owner_gets_the_column(tmp_path):
    """The chains' ``owner`` came without a migration: a store made before it, opened by every bili
    since, was stamped with the newest schema and never given the column; every chain saved there
    failed, and each failure took the store down (the requests then passed through unchanged)."""
    import sqlite3

    from bili_addon.store import DB_NAME, Store

    d = tmp_path / "data"
    Store(d).close()
    db = sqlite3.connect(d / DB_NAME)
    db.execute("ALTER TABLE chains DROP COLUMN owner")  # (as the tables were made then)
    db.commit()
    db.close()
    s = Store(d)
    try:
        assert "owner" in {r[1] for r in s.db.execute("PRAGMA table_info(chains)")}
        assert s.schema_version() == SCHEMA_VERSION
    finally:
        s.close()


def test_a_sqlite_store_of_a_newer_schema_is_refused_as_postgresqls_is(bili, tmp_path, capsys):
    """A SQLite store stamped by a newer bili (a second install, a downgrade) was opened and written
    without a word, while PostgreSQL's was refused: its figures read, its turns written, in a form the
    newer bili may not know.  Refused now, nothing made in it: the proxy passes the agent's requests
    through and says why (health, bili stats), bili store and bili doctor say to upgrade."""
    import sqlite3

    from bili_addon import statscmd, store_cli
    from bili_addon.store import DB_NAME, Store, StoreError
    from test_shell import ANTH_BODY, model_flow, session_headers

    d = tmp_path / "newer"
    Store(d).close()
    db = sqlite3.connect(d / DB_NAME)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.execute("DROP TABLE calibration")  # (a table the newer schema gave up: not made again)
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this bili") as e:
        Store(d)
    assert str(e.value).endswith("upgrade bili") and e.value.hint
    db = sqlite3.connect(d / DB_NAME)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION + 1),)
    assert db.execute("SELECT 1 FROM sqlite_master WHERE name='calibration'").fetchone() is None
    db.close()

    bili.tctx.configure(bili, bili_data_dir=str(d))
    f = model_flow(ANTH_BODY, headers=session_headers())
    bili.request(f)
    assert f.request.content == ANTH_BODY  # fail open
    h = health(bili)
    assert h["store"] is False and "newer than this bili" in h["store_error"] and h["store_hint"]
    assert "store unusable: the store at" in statscmd.sessions_table(bili.stats())
    assert "upgrade bili" in statscmd.sessions_table(bili.stats())

    for argv in (["info", "--store", str(d)], ["prune", "--older-than", "30d", "--store", str(d)],
                 ["prune", "--older-than", "30d", "--dry-run", "--store", str(d)],
                 ["migrate", "--from", str(d), "--to", str(tmp_path / "copy")]):
        p = argparse.ArgumentParser()
        store_cli.configure(p)
        assert store_cli.run(p.parse_args(argv)) == 1, argv
        assert "newer than this bili" in capsys.readouterr().err, argv
    p = argparse.ArgumentParser()
    store_cli.configure(p)
    (tmp_path / "older").mkdir()
    Store(tmp_path / "older").close()
    assert store_cli.run(p.parse_args(["migrate", "--from", str(tmp_path / "older"), "--to", str(d)])) == 1
    assert "newer than this bili" in capsys.readouterr().err  # (nor is it written as a target)

    args = argparse.Namespace(confdir=str(tmp_path / "conf"), data_dir=str(d), port=1, store="")
    store = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["store"]
    assert not store.ok and "newer than this bili" in store.detail and "upgrade bili-addon" in store.detail


@pytest.mark.parametrize("stamp", [8, SCHEMA_VERSION])
def test_a_store_whose_stamp_says_more_than_it_holds_gets_what_it_lacks(backend, stamp):
    """A development branch (``ttl``, c59c025) stamped its wire columns schema 8: a store it made has
    them but not retention's ``sessions.pruned`` nor the indexes of the chains' bases.  The steps were
    chosen by the stamp alone (8 done, then stamped with the newest): every list of sessions, every
    retention pass and every fork's adoption failed ("no such column: pruned"), and each took the
    store down.  Stamped 8, or already stamped the newest by such a bili, it gets them when opened,
    on either backend, and its conversations go on."""
    from bili_addon import retention
    from bili_addon.store import LedgerRow, SessionRow

    s = backend()
    v = s.commit_turn(SessionRow("old", "", "", 0.0, 0.0, 1, 1, 2), [LedgerRow("h", "aa", "m00001", "user", "text", 1)],
                      expect=0, minted=[("m00001", "aa")])
    raw = s.db.execute if s.backend == "sqlite" else s._q
    raw("ALTER TABLE sessions DROP COLUMN pruned")  # (as the branch left it: its wire columns stay)
    raw("DROP INDEX chains_agent_base")
    raw("DROP INDEX chains_sent_base")
    if s.backend != "sqlite":  # (the functions of the steps after 8 as well: they are taken again)
        raw("DROP FUNCTION bili_hold")
    raw(f"UPDATE meta SET value='{stamp}' WHERE key='schema_version'")
    s.close()
    s = backend()
    assert s.schema_version() == SCHEMA_VERSION
    raw = s.db.execute if s.backend == "sqlite" else s._q
    if s.backend == "sqlite":
        assert "pruned" in {r[1] for r in raw("PRAGMA table_info(sessions)")}
        assert {"chains_agent_base", "chains_sent_base"} <= {r[0] for r in raw(
            "SELECT name FROM sqlite_master WHERE type='index'")}
    else:
        assert raw("SELECT to_regclass('chains_agent_base') IS NOT NULL AND to_regclass('chains_sent_base') "
                   "IS NOT NULL") == [(True,)]
    assert [r.id for r in s.sessions()] == ["old"] and s.version("old") == v
    assert [sid for sid, _ in s.idle_sessions(1e12)] == ["old"]
    s.hold("old")
    assert s.version("old") == v
    assert s.commit_turn(SessionRow("old", "", "", 0.0, 0.0, 2, 2, 3), [LedgerRow("h2", "bb", "m00002", "user",
                                                                                   "text", 1)],
                         expect=v, minted=[("m00002", "bb")]) == v + 1
    s.release()
    rep = retention.prune(s, 0.0, now=1e12)
    assert rep.removed == [["old"]] and s.ledger("old") == []
    s.close()
    s = backend()  # (healed: nothing taken again)
    assert s.schema_version() == SCHEMA_VERSION and s.sessions() == []


def test_a_postgresql_store_whose_chains_have_no_owner_gets_the_column(pg_url, tmp_path):
    """As SQLite's (above): the PostgreSQL chains table made before its ``owner`` column, stamped with
    every schema since, gets the column when opened; every chain saved there had failed."""
    from bili_addon.store import CHAIN_COLS
    from bili_addon.store_pg import PgStore

    s = PgStore(pg_url, str(tmp_path))
    s._q("ALTER TABLE chains DROP COLUMN owner")
    s.close()
    s = PgStore(pg_url, str(tmp_path))
    try:
        row = dict(zip(CHAIN_COLS, ("resp_1", "s", "", 1, "", 0, b"[]", "", 0, None, b"[]", "o1", 1.0)))
        s.save_chain(tuple(row[c] for c in CHAIN_COLS))
        assert s.chain("resp_1") == tuple(row[c] for c in CHAIN_COLS)
        assert s.schema_version() == SCHEMA_VERSION
    finally:
        s.close()
