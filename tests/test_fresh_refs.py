"""Schema 10 (#11): a conversation's first turn writes its refs once, on both backends.

A first turn (``commit_turn(..., fresh=True)``: every ledger row gives its ref, in row order) keeps
its refs as its ``ledger_turns`` row's: its ``refs_turns`` row says so (``FRESH_GIVEN``) instead of
repeating ~1,500 hashes.  Everything that reads the refs reads the same as from the explicit form:
the ``refs`` view, a fork's adoption (which rewrites the rows), another process loading the session,
``bili store migrate``; the refs are still the store's next numbers (a stale or out-of-order claim is
refused, the family's counter counts), and a store of schema 9 migrates and reads both forms.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from bili_addon.kernel.turn import Engine
from bili_addon.store import FRESH_GIVEN, SCHEMA_VERSION, LedgerRow, SessionRow, StaleSession, StoreError
from bili_addon.stores import TABLES, copy_store, open_store
from bili_addon.wire import LANES

ANTH = LANES["anthropic"]


def rows_for(n: int, first: int = 1, salt: str = "") -> list[LedgerRow]:
    """Ledger rows as a first pass makes them: real content hashes, ``h_`` ids, consecutive refs."""
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{salt}{i}".encode()).hexdigest()
        out.append(LedgerRow("h_" + h[:16] + ("_1" if i % 7 == 3 else ""), h, f"m{first + i:05d}",
                             ("user", "assistant", "tool")[i % 3], ("text", "tool-call", "tool-result")[i % 3], i))
    return out


def raw(s):
    return (s.db.execute if s.backend == "sqlite" else s._q), ("?" if s.backend == "sqlite" else "%s")


def refs_of(s, sid: str) -> list[tuple[str, str]]:
    q, ph = raw(s)
    return sorted(tuple(r) for r in q(f"SELECT ref, content_hash FROM refs WHERE session_id={ph}", (sid,)))


def test_a_fresh_turn_keeps_its_refs_once_and_reads_them_back(backend):
    s = backend()
    rows = rows_for(1500)
    v = s.commit_turn(SessionRow("new", "agent", "anthropic", 0.0, 0.0, 1, 1000, 1501), rows, (3, "tail"),
                      expect=0, fresh=True)
    assert v == 1
    q, ph = raw(s)
    given = [tuple(r) for r in q(f"SELECT seq, n, given FROM refs_turns WHERE session_id={ph}", ("new",))]
    assert given == [(1, 1500, FRESH_GIVEN)]  # not the 1,500 hashes again
    # every ref names the hash of its row, read through the view, the ledger and a second process
    assert refs_of(s, "new") == sorted((r.ref, r.content_hash) for r in rows)
    assert s.ledger("new") == sorted(rows, key=lambda r: (r.msg_id, r.content_hash))
    assert s.ref_count("new") == 1500 and s.session("new").next_ref == 1501
    other = backend()
    row, ledger, *_ = other.session_state("new")
    assert row.version == 1 and {r.ref: r.content_hash for r in ledger} == {r.ref: r.content_hash for r in rows}
    # the next turn goes on from the counter the fresh one left
    nxt = LedgerRow("h_next", "ab" * 32, "m01501", "user", "text", 1)
    with pytest.raises(StaleSession):  # a ref given already
        other.commit_turn(SessionRow("new", "", "", 0.0, 0.0, 2, 1001, 1502), [nxt], expect=1,
                          minted=[("m01500", nxt.content_hash)])
    assert other.commit_turn(SessionRow("new", "", "", 0.0, 0.0, 2, 1001, 1502), [nxt], expect=1,
                             minted=[("m01501", nxt.content_hash)]) == 2
    assert refs_of(other, "new") == sorted([(r.ref, r.content_hash) for r in rows] + [("m01501", "ab" * 32)])


def test_a_fresh_turns_refs_must_be_the_stores_next_numbers(backend):
    s = backend()
    row = SessionRow("f", "", "", 0.0, 0.0, 1, 3, 4)
    gap = rows_for(3)
    gap[2] = LedgerRow(gap[2].msg_id, gap[2].content_hash, "m00004", "tool", "tool-result", 1)
    with pytest.raises(StoreError):  # m00001, m00002, m00004: not consecutive: nothing written
        s.commit_turn(SessionRow("f", "", "", 0.0, 0.0, 1, 3, 5), gap, expect=0, fresh=True)
    twice = rows_for(3)
    twice[1] = LedgerRow(twice[1].msg_id, twice[1].content_hash, "m00001", "user", "text", 1)
    with pytest.raises(StoreError):  # a ref twice in one turn
        s.commit_turn(row, twice, expect=0, fresh=True)
    with pytest.raises(StoreError):  # fresh: the rows' refs are the turn's; no second list
        s.commit_turn(row, rows_for(3), expect=0, fresh=True, minted=[("m00001", "x")])
    with pytest.raises(StaleSession):  # consecutive, but not from the store's counter
        s.commit_turn(SessionRow("f", "", "", 0.0, 0.0, 1, 3, 5), rows_for(3, first=2), expect=0, fresh=True)
    with pytest.raises(StaleSession):  # the counter it claims to leave is not first + n
        s.commit_turn(SessionRow("f", "", "", 0.0, 0.0, 1, 3, 9), rows_for(3), expect=0, fresh=True)
    assert s.version("f") == 0 and s.ledger("f") == [] and refs_of(s, "f") == []
    assert s.commit_turn(row, rows_for(3), expect=0, fresh=True) == 1
    with pytest.raises(StaleSession):  # computed from a version that moved (another process wrote)
        s.commit_turn(SessionRow("f", "", "", 0.0, 0.0, 1, 3, 7), rows_for(3, first=4, salt="b"), expect=0, fresh=True)
    assert len(refs_of(s, "f")) == 3


def test_a_fresh_turn_in_a_family_counts_from_the_familys_counter(backend):
    s = backend()
    s.commit_turn(SessionRow("parent", "", "anthropic", 0.0, 0.0, 1, 5, 6), rows_for(5, salt="p"), expect=0, fresh=True)
    # a child adopted before its first rows (another instance recognised it as a fork)
    v = s.adopt(SessionRow("child", "", "anthropic", 0.0, 0.0, 0, 0, 1), "parent", "parent", 2, [], [], [], [],
                expect=0)
    with pytest.raises(StaleSession):  # its own counter says 1, but the family gave m00001..m00005
        s.commit_turn(SessionRow("child", "", "anthropic", 0.0, 0.0, 1, 2, 3), rows_for(2, salt="c"), expect=v,
                      fresh=True)
    assert s.commit_turn(SessionRow("child", "", "anthropic", 0.0, 0.0, 1, 2, 8), rows_for(2, first=6, salt="c"),
                         expect=v, fresh=True) == v + 1
    assert [r for r, _h in refs_of(s, "child")] == ["m00006", "m00007"]


def _adoption(s, fresh: bool, overlap: bool):
    """A child whose first turn was written fresh (or, the same refs, explicitly) is adopted: its
    rows whose keys the parent's take go, a retired row takes a new ref (``overlap``: the inherited
    refs are among those the child gave, else none is)."""
    own = rows_for(6, salt="own")
    kw = {"fresh": True} if fresh else {"minted": [(r.ref, r.content_hash) for r in own]}
    s.commit_turn(SessionRow("kid", "", "anthropic", 0.0, 0.0, 1, 6, 7), own, expect=0, **kw)
    a, b = ("m00001", "m00002") if overlap else ("m00008", "m00009")
    inherited = [LedgerRow(own[0].msg_id, own[0].content_hash, a, "user", "text", 1),
                 LedgerRow("h_parent", "cd" * 32, b, "user", "text", 1)]
    retired = [(own[1].msg_id, own[1].content_hash, "m00007" if overlap else "m00010")]
    s.adopt(SessionRow("kid", "", "anthropic", 0.0, 0.0, 1, 6, 8), "dad", "dad", 2, inherited, [], [], [], retired,
            expect=1)
    return [(r.msg_id, r.content_hash, r.ref) for r in s.ledger("kid")], refs_of(s, "kid")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_fork_adopting_a_fresh_write_reads_as_the_explicit_form_would(backend, overlap):
    fresh, explicit = _adoption(backend(), True, overlap), _adoption(backend("explicit"), False, overlap)
    assert fresh == explicit
    ledger, refs = fresh
    own = rows_for(6, salt="own")
    assert (("m00007" if overlap else "m00010"), own[1].content_hash) in refs  # the retired row's new ref
    if overlap:
        assert dict(refs)["m00001"] == own[0].content_hash
        assert dict(refs)["m00002"] == "cd" * 32  # the parent's text now, not the child's first turn's
    else:  # the refs the child's first turn gave still name what they named
        assert [(r, h) for r, h in refs if r <= "m00006"] == [(r.ref, r.content_hash) for r in own]
    assert len(dict(refs)) == len(refs)  # a ref names one text


def test_a_first_turn_through_the_engine_reloads_to_the_same_refs(backend):
    msgs = [{"role": "user", "content": f"step {i}: look at file_{i}.py"} if i % 2 == 0 else
            {"role": "assistant", "content": [{"type": "text", "text": f"Reading {i}."},
                                              {"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {"p": i}}]}
            for i in range(40)] + [{"role": "user", "content": "and on"}]
    msgs[1:1] = [{"role": "assistant", "content": "again"}, {"role": "user", "content": "step 0: look at file_0.py"}]
    body = lambda m: __import__("json").dumps({"model": "claude-sonnet-4-5", "messages": m}).encode()  # noqa: E731
    a = Engine(backend())
    a.lineage.defer = True
    first = a.process(body(msgs), ANTH, {"x-acp-session": "e"}, render=True)
    assert first.refs_new > 40
    q, ph = raw(a.store)
    assert [tuple(r) for r in q(f"SELECT given FROM refs_turns WHERE session_id={ph}", ("e",))] == [(FRESH_GIVEN,)]
    s = a.sessions["e"]
    assert refs_of(a.store, "e") == sorted(s.owners.items())  # what the engine holds, read back
    b = Engine(backend())  # another process: the session loaded from the store
    nxt = msgs + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    ra = a.process(body(nxt), ANTH, {"x-acp-session": "e"}, render=True)
    rb = b.process(body(nxt), ANTH, {"x-acp-session": "e"}, render=False)
    assert b.sessions["e"].owners == a.sessions["e"].owners and b.sessions["e"].refs == a.sessions["e"].refs
    assert ra.refs_new == 2 and rb.refs_new == 0 and rb.refs_known == ra.refs_known + 2


def test_migrate_round_trip_keeps_fresh_writes(backend, tmp_path, pg_url):
    src = backend()
    src.commit_turn(SessionRow("m", "", "anthropic", 0.0, 0.0, 1, 40, 41), rows_for(40), expect=0, fresh=True)
    src.commit_turn(SessionRow("m", "", "anthropic", 0.0, 0.0, 2, 41, 42), rows_for(1, first=41, salt="x"), expect=1,
                    minted=[("m00041", rows_for(1, salt="x")[0].content_hash)])
    other = open_store(pg_url if src.backend == "sqlite" else "", str(tmp_path / "other"))
    try:
        copy_store(src, other)
        for t, (cols, key) in TABLES.items():
            assert other.dump(t, cols, key) == src.dump(t, cols, key), t
        assert refs_of(other, "m") == refs_of(src, "m") and len(refs_of(src, "m")) == 41
        assert other.ledger("m") == src.ledger("m")
    finally:
        other.close()


def _to_schema_9(s) -> None:
    """The store as bili of schema 9 left it: the refs view of one form, PostgreSQL's functions of
    schema 7 (the commit parsing JSON) and 6 (the lock without the candidates)."""
    from bili_addon.store import _VIEWS

    old_view = ("CREATE VIEW refs AS SELECT t.session_id AS session_id, json_extract(j.value, '$[0]') AS ref, "
                "json_extract(j.value, '$[1]') AS content_hash FROM refs_turns t, json_each(t.given) j")
    if s.backend == "sqlite":
        assert "refs AS" in _VIEWS
        s.db.execute("DROP VIEW refs")
        s.db.execute(old_view)
        s.db.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
    else:
        from bili_addon.store_pg import _MIGRATIONS

        s._q("CREATE OR REPLACE VIEW refs AS SELECT t.session_id, e->>0 AS ref, e->>1 AS content_hash "
             "FROM refs_turns t, json_array_elements(t.given::json) AS e")
        s._q("DROP FUNCTION bili_commit_turn")
        s._q("DROP FUNCTION bili_hold")
        with s.pool.connection() as conn:  # (no parameters: their % are PL/pgSQL's)
            conn.execute(_MIGRATIONS[6][1])  # bili_hold(key, id)
            conn.execute(_MIGRATIONS[7][-1])  # bili_commit_turn(..., JSON, JSON, ...)
        s._q("UPDATE meta SET value='9' WHERE key='schema_version'")
    s.close()


def test_a_schema_9_store_migrates_and_reads_both_forms(backend):
    s = backend()
    old = rows_for(20, salt="old")  # a first turn as schema 9 wrote it: its refs repeated
    s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 1, 20, 21), old, expect=0,
                  minted=[(r.ref, r.content_hash) for r in old])
    _to_schema_9(s)
    s = backend()
    assert s.schema_version() == SCHEMA_VERSION >= 10
    s.hold("new", ("fp", "anthropic"))  # the lock's read of schema 10 (PostgreSQL: one function)
    assert s.lineage_candidates("fp", "anthropic") == []
    s.commit_turn(SessionRow("new", "", "anthropic", 0.0, 0.0, 1, 20, 21), rows_for(20, salt="new"), expect=0,
                  fresh=True)
    s.release()
    assert refs_of(s, "old") == sorted((r.ref, r.content_hash) for r in old)
    assert refs_of(s, "new") == sorted((r.ref, r.content_hash) for r in rows_for(20, salt="new"))
    q, ph = raw(s)
    assert [r[0] for r in q(f"SELECT given FROM refs_turns WHERE session_id={ph}", ("new",))] == [FRESH_GIVEN]
    # the old session goes on
    nxt = rows_for(1, first=21, salt="more")
    assert s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 2, 21, 22), nxt, expect=1,
                         minted=[("m00021", nxt[0].content_hash)]) == 2
    s.close()
    again = backend()  # opened again: nothing to migrate
    assert again.schema_version() == SCHEMA_VERSION and len(refs_of(again, "old")) == 21


def test_the_wal_is_checkpointed_off_the_writers_path(tmp_path):
    """SQLite: a commit never runs the WAL's checkpoint below the backstop (it cost 10-60 ms of the
    commit that crossed SQLite's threshold); the store's own thread does, the WAL stays bounded and
    every turn is there when the store is opened again."""
    from bili_addon.store import WAL_BACKSTOP_PAGES, WAL_CHECKPOINT_PAGES, Store

    s = Store(tmp_path)
    assert s.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WAL_BACKSTOP_PAGES
    rows = rows_for(1500)
    wal = tmp_path / "bili.sqlite3-wal"
    page = s.db.execute("PRAGMA page_size").fetchone()[0]
    for i in range(60):  # ~3,000 pages of turns (~50 each)
        s.commit_turn(SessionRow(f"w{i}", "", "anthropic", 0.0, 0.0, 1, 1500, 1501), rows, expect=0, fresh=True)
        # the writer never waits for a checkpoint: the WAL stays within the backstop
        assert wal.stat().st_size < WAL_BACKSTOP_PAGES * (page + 24)
    cp = s._checkpointer
    assert cp.thread is not None and cp.thread.name == "bili-store-checkpoint"
    for _ in range(500):  # (a loaded machine may schedule the thread late)
        if cp.runs:
            break
        time.sleep(0.01)
    assert cp.runs >= 1
    # once the WAL has been copied, small commits wake no checkpoint (the WAL file is cut back when
    # a write starts it over; grown once and left, it made one, fsyncs and all, after every commit)
    settled, last = 0, -1
    while settled < 20:  # the thread idle for 0.2 s
        settled = settled + 1 if cp.runs == last and not cp.event.is_set() else 0
        last = cp.runs
        time.sleep(0.01)
    small = rows_for(3)
    for i in range(40):
        s.commit_turn(SessionRow(f"x{i}", "", "anthropic", 0.0, 0.0, 1, 3, 4), small, expect=0, fresh=True)
    assert cp.runs - last <= 2
    s.close()
    assert not cp.thread.is_alive()
    again = Store(tmp_path)
    assert len(again.sessions()) == 100 and again.ref_count("w59") == 1500
    assert refs_of(again, "w0") == sorted((r.ref, r.content_hash) for r in rows)
    assert WAL_CHECKPOINT_PAGES < WAL_BACKSTOP_PAGES
    again.close()
