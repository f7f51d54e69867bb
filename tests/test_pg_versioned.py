"""A session's versioned writes after its turn on PostgreSQL in one statement (store_pg.PgStore._versioned):
a proxy call recorded (``record_calls``), a fold landed (``commit_fold``: its blocks, originals and the
calls' results) and the canonical copy saved (``save_copy``).  Each was a transaction of four or more
round trips on the proxy's store worker.  The version check, the claim of a call's result (written
once) and the rows are as the transaction made them, and as the SQLite store's."""

from __future__ import annotations

import pytest

pytest.importorskip("psycopg")

from bili_addon.store import LedgerRow, SessionRow, StaleSession, Store  # noqa: E402


def pg(url, tmp_path):
    from bili_addon.store_pg import PgStore

    return PgStore(url, str(tmp_path))


def session(s, sid: str) -> int:
    return s.commit_turn(SessionRow(sid, "a", "anthropic", 1.0, 1.0, 1, 1, 2),
                         [LedgerRow("h", "aa", "m00001", "user", "text", 1)], expect=0, minted=[("m00001", "aa")])


ORIGINALS = [("m00001", "user", "text", "", "", "hello é 😀", 3), ("m00002", "assistant", "tool_call", "Bash", "call_1",
                                                                  '{"command": "ls"}', 5),
             ("m00003", "user", "tool_result", "Bash", "call_1", "", 0)]


def script(s) -> list:
    """A session's writes after its turns: calls, a fold with their results, copies; returns what
    each write returned."""
    v = session(s, "x")
    out = [v]
    v = s.record_calls("x", [("k1", "compress", '{"a": 1}'), ("k2", "search_context", "{}")], expect=v)
    out.append(v)
    v = s.record_calls("x", [("k1", "compress", "again: not written")], expect=v)  # known: nothing new
    out.append(v)
    v = s.commit_fold("x", [("b1", '{"id": "b1"}', True), ("b2", '{"id": "b2"}', False)], ORIGINALS,
                      [("k1", "folded b1"), ("k9", "no such call")], expect=v)
    out.append(v)
    v = s.commit_fold("x", [("b1", '{"id": "b1", "n": 2}', False)], ORIGINALS[:1], [("k1", "a second result"),
                                                                                    ("k2", "found")], expect=v)
    out.append(v)
    v = s.save_copy("x", '{"copy": 1}', expect=v)
    v = s.save_copy("x", '{"copy": 2}', expect=v)
    out.append(v)
    return out


def state(s) -> tuple:
    return (s.version("x"), s.blocks("x"), s.originals("x"), [c[:4] for c in s.calls("x")], s.copy("x"))


def test_the_writes_leave_what_the_transactions_and_the_sqlite_store_left(pg_url, tmp_path, pg_server, monkeypatch):
    from bili_addon.store_pg import PgStore

    one = pg(pg_url, tmp_path)
    lite = Store(tmp_path / "lite")
    try:
        got = script(one)
        assert got == script(lite)
        assert state(one) == state(lite)
        calls = {c[0]: c[3] for c in one.calls("x")}
        assert calls == {"k1": "folded b1", "k2": "found"}  # a result is written once
        # the transactions (as before this statement): the same again
        monkeypatch.setattr(PgStore, "_versioned", lambda *a, **kw: None)
        old = pg(pg_server.fresh(), tmp_path)
        try:
            assert script(old) == got and state(old) == state(one)
        finally:
            old.close()
    finally:
        one.close()
        lite.close()


def test_each_write_is_one_round_trip(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        v = session(s, "x")
        for write in (lambda v: s.record_calls("x", [("k1", "compress", "{}")], expect=v),
                      lambda v: s.commit_fold("x", [("b1", "{}", True)], ORIGINALS, [("k1", "done")], expect=v),
                      lambda v: s.save_copy("x", "{}", expect=v)):
            before = s.round_trips
            v = write(v)
            assert s.round_trips - before == 1
    finally:
        s.close()


@pytest.mark.parametrize("write", ["record_calls", "commit_fold", "save_copy"])
def test_a_version_that_moved_is_refused_and_nothing_is_written(pg_url, tmp_path, write):
    s, other = pg(pg_url, tmp_path), pg(pg_url, tmp_path)
    try:
        v = session(s, "x")
        other.save_copy("x", "{\"theirs\": 1}", expect=v)  # another instance's write
        args = {"record_calls": ([("k1", "compress", "{}")],), "commit_fold": ([("b1", "{}", True)], ORIGINALS, []),
                "save_copy": ("{\"mine\": 1}",)}[write]
        with pytest.raises(StaleSession):
            getattr(s, write)("x", *args, expect=v)
        assert s.version("x") == v + 1
        assert s.calls("x") == [] and s.blocks("x") == [] and s.originals("x") == []
        assert s.copy("x") == "{\"theirs\": 1}"
    finally:
        s.close()
        other.close()


def test_more_values_than_one_statement_takes_go_by_the_transaction(pg_url, tmp_path, monkeypatch):
    from bili_addon import store_pg

    s = pg(pg_url, tmp_path)
    try:
        v = session(s, "x")
        many = [(f"m{i:05d}", "user", "text", "", "", f"text {i}", i) for i in range(400)]
        monkeypatch.setattr(store_pg, "_MAX_PARAMS", 1000)
        before = s.round_trips
        v = s.commit_fold("x", [("b1", "{}", True)], many, [], expect=v)
        assert s.round_trips - before > 2  # (the transaction)
        assert len(s.originals("x")) == 400 and s.version("x") == v
    finally:
        s.close()


def test_a_new_session_goes_by_the_transaction(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        assert s.record_calls("new", [("k1", "compress", "{}")], expect=0) == 1
        assert s.save_copy("new2", "{}", expect=0) == 1
        assert [c[0] for c in s.calls("new")] == ["k1"] and s.copy("new2") == "{}"
    finally:
        s.close()


def test_a_block_or_a_call_twice_in_one_fold_goes_by_the_transaction(pg_url, tmp_path):
    """(One statement's upsert touches a row once; the transaction's statements run one after the
    other: the last body of a block stands, the first result of a call.)"""
    s = pg(pg_url, tmp_path)
    lite = Store(tmp_path / "lite")
    try:
        for st in (s, lite):
            v = session(st, "x")
            v = st.record_calls("x", [("k1", "compress", "{}")], expect=v)
            st.commit_fold("x", [("b1", '{"n": 1}', True), ("b1", '{"n": 2}', False)], ORIGINALS,
                           [("k1", "first"), ("k1", "second")], expect=v)
        assert state(s) == state(lite)
        assert s.blocks("x") == ['{"n": 2}'] and [c[3] for c in s.calls("x")] == ["first"]
    finally:
        s.close()
        lite.close()
