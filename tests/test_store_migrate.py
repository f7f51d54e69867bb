"""``bili store migrate``: a store with folds copied SQLite -> PostgreSQL -> SQLite comes back row for
row, and a conversation goes on from the copy exactly as from the original."""

from __future__ import annotations

import json


from bili_addon import cli
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import FRESH_GIVEN, CalibrationRow, Store, WireTurn
from bili_addon.stores import TABLES, open_store
from test_fold import ANTH, H, body, fold_steps_1_to_4


def folded_store(path) -> tuple[Engine, list[dict]]:
    """A SQLite store holding a conversation with a fold, a decompress, usage and a transcript."""
    e = Engine(Store(path), fold_cfg=FoldConfig(min_compress_chars=2000))
    e.snapshot = True  # the transcript table fills too
    msgs = fold_steps_1_to_4(e)
    e.store.record_usage("fold-1", "anthropic", (1000, 800, 100, 50))
    for i, (model, predicted, executed) in enumerate([("claude-sonnet-4-5", None, []),
                                                       ("claude-sonnet-4-5", 0.8125, ["compress"]),
                                                       ("claude-opus-4-1", 0.5, ["compress", "decompress"])]):
        e.store.record_wire("fold-1", WireTurn(0, 1_700_000_000.25 + i, i + 1, model, 9000 + i, 3000 - i, predicted,
                                               i, 4 * i, executed, 3000 - i, 800 * i, 100, 50 + i))
    for n, (gap, age, write) in enumerate([(None, None, 1200), (30.5, 30.5, None)]):  # the cache model's calibration
        e.store.record_calibration("fold-1", CalibrationRow(0, 1_700_000_000.5 + n, "api.anthropic.com", "anthropic",
                                                            "anthropic", gap, age, 3000, 2000 * n, 1000, 3100,
                                                            1900 * n, write))
    # server-side chains (kernel/chains.py): a base response and one chained on it (blobs, a NULL view)
    e.store.save_chain(("resp_base", "fold-1", "", 1, "", 0, b'[{"role":"user"}]', "", 0, None, b'[{"x":1}]', "own3r", 1.5))
    e.store.save_chain(("resp_next", "fold-1", "ws-1", 0, "resp_base", 2, b"[]", "resp_base", 2, b'[{"t":"\xc3\xa9"}]',
                        b"[]", "", 2.5))
    msgs = msgs + [{"role": "assistant", "content": "Audit continues."}, {"role": "user", "content": "go on"}]
    e.process(body(msgs), ANTH, H, render=True)
    return e, msgs


def dump_all(store) -> dict[str, list[tuple]]:
    return {t: store.dump(t, cols, key) for t, (cols, key) in TABLES.items()}


def test_a_store_with_folds_round_trips_sqlite_postgresql_sqlite_unchanged(tmp_path, pg_url, capsys):
    e, msgs = folded_store(tmp_path / "a")
    before = dump_all(e.store)
    for table in ("sessions", "ledger_turns", "refs_turns", "blocks", "originals", "calls", "turns", "copies", "transcript",
                  "wire", "calibration", "chains"):
        assert before[table], f"the fixture should fill {table}"
    # a first turn's refs as its ledger row's (schema 10) and a later turn's written out, both copied
    assert {r[3] == FRESH_GIVEN for r in before["refs_turns"]} == {True, False}
    wire_before = (e.store.wire("fold-1"), e.store.wire_totals("fold-1"))
    assert len(wire_before[0]) == 3
    e.store.close()

    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) == 0
    assert "verified equal" in capsys.readouterr().out
    pg = open_store(pg_url, str(tmp_path))
    assert (pg.wire("fold-1"), pg.wire_totals("fold-1")) == wire_before  # the meter and stats read the same
    pg.close()
    assert cli.main(["store", "migrate", "--from", pg_url, "--to", str(tmp_path / "b")]) == 0

    back = Store(tmp_path / "b")
    assert dump_all(back) == before
    back.close()

    # the conversation goes on from the PostgreSQL copy exactly as from the original
    nxt = msgs + [{"role": "assistant", "content": "More audit."}, {"role": "user", "content": "and on"}]
    a = Engine(Store(tmp_path / "a"), fold_cfg=FoldConfig(min_compress_chars=2000))
    p = Engine(open_store(pg_url, str(tmp_path)), fold_cfg=FoldConfig(min_compress_chars=2000))
    a.snapshot = p.snapshot = True
    ra, rp = a.process(body(nxt), ANTH, H, render=True), p.process(body(nxt), ANTH, H, render=True)
    assert ra.body is not None and ra.body == rp.body and b"load_config()" in rp.body
    a.store.close()
    p.store.close()


def test_migrate_refuses_a_target_that_holds_conversations(tmp_path, pg_url, capsys):
    e, _ = folded_store(tmp_path / "a")
    e.store.close()
    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) == 0
    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) == 1
    assert "already holds conversations" in capsys.readouterr().err


def test_store_info_names_the_backend(tmp_path, pg_url, capsys):
    assert cli.main(["store", "info", "--store", pg_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "postgresql" and doc["schema_version"] >= 2 and doc["conversations"] == 0
    assert cli.main(["store", "info", "--store", "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"]) == 1
    assert "cannot open the store" in capsys.readouterr().err


def test_a_store_migrated_from_schema_6_round_trips_too(tmp_path, pg_url, capsys):
    """A schema-6 SQLite store (one ledger row per part) is migrated when opened, then copied to
    PostgreSQL and back unchanged: every ledger row and ref the old tables held is there."""
    from legacy import rows_of, to_schema_6

    e, msgs = folded_store(tmp_path / "a")
    rows = rows_of(e.store)
    to_schema_6(e.store)
    s = Store(tmp_path / "a")  # migrated to 7
    before = dump_all(s)
    assert rows_of(s) == rows and len(before["ledger_turns"]) >= 2
    s.close()
    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) == 0
    assert cli.main(["store", "migrate", "--from", pg_url, "--to", str(tmp_path / "b")]) == 0
    assert "verified equal" in capsys.readouterr().out
    back = Store(tmp_path / "b")
    assert dump_all(back) == before and rows_of(back) == rows
    back.close()


def test_a_migration_that_fails_midway_leaves_the_target_empty_to_run_again(tmp_path, pg_url, monkeypatch, capsys):
    """Each table is copied in a transaction of its own: a failure part way left the tables before it
    in the target, and the same command was then refused ("already holds conversations")."""
    from bili_addon.store import StoreError
    from bili_addon.store_pg import PgStore

    e, _ = folded_store(tmp_path / "a")
    want = dump_all(e.store)
    e.store.close()
    real = PgStore.load
    tables = list(TABLES)

    def failing(self, table, cols, rows):
        if table == tables[3]:
            raise StoreError("cannot write the store: the database server's disk is full", "disk full")
        return real(self, table, cols, rows)

    monkeypatch.setattr(PgStore, "load", failing)
    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) != 0
    monkeypatch.setattr(PgStore, "load", real)
    target = open_store(pg_url, str(tmp_path / "x"))
    assert target.is_empty() and all(not rows for rows in dump_all(target).values())
    target.close()
    assert cli.main(["store", "migrate", "--from", str(tmp_path / "a"), "--to", pg_url]) == 0
    target = open_store(pg_url, str(tmp_path / "x"))
    assert dump_all(target) == want
    target.close()


def test_texts_with_a_nul_character_are_stored_and_migrated_as_they_came(backend, tmp_path, pg_url, capsys):
    """A folded tool output of a binary file holds NUL characters, which a PostgreSQL text cannot: its
    fold's write failed there (the store taken down for every conversation, the same call failing again
    on each turn of its own), and such a SQLite store could not be migrated.  The texts a session keeps
    as they came (originals, a call's arguments and result) come back as they went, on both stores, and
    a text that merely looks like PostgreSQL's stored form of one is no exception."""
    from bili_addon.store import LedgerRow, SessionRow

    mark = "\ufffebili-json:"
    texts = ["binary \x00 output\x00", mark + '"not json', "plain"]
    store = backend()
    v = store.commit_turn(SessionRow("s1", "a", "anthropic", 1.0, 1.0, 1, 1, 4),
                          [LedgerRow(f"id{i}", f"h{i}", f"m0000{i + 1}", "tool", "tool_result", 3)
                           for i in range(3)], expect=0, fresh=True)
    v = store.record_calls("s1", [("k1", "decompress", '{"ids": "\x00"}')], expect=v)
    originals = [(f"m0000{i + 1}", "tool", "tool_result", "shell", f"call_{i}", t, 3) for i, t in enumerate(texts)]
    store.commit_fold("s1", [("b1", '{"x":1}', True)], originals, [("k1", "found: \x00" + texts[1])], expect=v)
    calls = [("k1", "decompress", '{"ids": "\x00"}', "found: \x00" + texts[1])]
    again = backend()  # (read anew, as another instance would)
    assert again.originals("s1") == sorted(originals) and again.calls("s1") == calls
    assert again.session_state("s1")[3] == calls
    if store.backend != "sqlite":
        return
    store.close()
    again.close()
    sqlite_dir = tmp_path  # (the backend fixture's SQLite store)
    before = dump_all(open_store("", str(sqlite_dir)))
    assert cli.main(["store", "migrate", "--from", str(sqlite_dir), "--to", pg_url]) == 0
    assert cli.main(["store", "migrate", "--from", pg_url, "--to", str(tmp_path / "back")]) == 0
    assert "verified equal" in capsys.readouterr().out
    assert dump_all(open_store("", str(tmp_path / "back"))) == before
