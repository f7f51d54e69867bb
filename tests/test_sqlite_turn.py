"""SQLite: a turn's commit checks and writes the session's row in one statement (branch sqlite-turn).

``Store.commit_turn`` used to read the session's state (``_TURN_STATE``), check it in Python, then
upsert the row; it now updates (or, for a new session, inserts) the row with the checks in the
statement's WHERE, and falls back to the read only when no row was written.  These tests hold the
new commit to the old one (kept here as :func:`reference_commit_turn`, verbatim but for its name)
over random sequences of turns, stale ones and ref races included, and check the multi-process
guarantee across two Store objects on one file.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from bili_addon import store as store_mod
from bili_addon.store import (
    FRESH_GIVEN,
    LedgerRow,
    SessionRow,
    StaleSession,
    Store,
    StoreError,
    _json,
    contiguous,
    fresh_first,
)


def reference_commit_turn(self: Store, row, new_refs, chain=None, *, expect, minted=(), fresh=False, copy=None):
    """Store.commit_turn as it was before (read, check, upsert)."""
    now = store_mod.time.time()
    fresh = fresh and bool(new_refs)
    if fresh and minted:
        raise StoreError("a fresh turn's refs are its rows' (minted must be left out)")
    k = len(new_refs) if fresh else len(minted)
    claimed = (fresh_first(new_refs) if fresh else contiguous(minted)) if k else 0
    with self._tx():
        version, counter, family = self.db.execute(self._TURN_STATE, (row.id,)).fetchone()
        found = version if version is not None else 0
        if found != expect:
            raise StaleSession(row.id, expect, found)
        version = expect + 1
        if k:
            first = counter if counter is not None else 1
            if family:
                first = max(first, family)
            if first + k != row.next_ref or claimed != first:
                raise StaleSession(row.id, row.next_ref - k, first)
            self.db.execute("INSERT INTO refs_turns(session_id, seq, n, given) VALUES(?,?,?,?)",
                            (row.id, version, k, FRESH_GIVEN if fresh else _json.encode(minted).decode()))
        self.db.execute(
            "INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, "
            "version) VALUES(?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, "
            "lane=excluded.lane, last_seen=excluded.last_seen, requests=excluded.requests, "
            "messages=excluded.messages, next_ref=excluded.next_ref, flags=excluded.flags, "
            "version=excluded.version",
            (row.id, row.agent, row.lane, now, now, row.requests, row.messages, row.next_ref,
             row.flags, version),
        )
        if new_refs:
            self.db.execute("INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(?,?,?,?,?)",
                            (row.id, version, now, len(new_refs), _json.encode(new_refs).decode()))
        if chain is not None:
            self.db.execute(
                "INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(?,?,?,?) "
                "ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail, "
                "last_seen=excluded.last_seen",
                (row.id, chain[0], chain[1], now),
            )
        if copy is not None:
            self.db.execute("INSERT OR REPLACE INTO copies(session_id, doc) VALUES(?,?)", (row.id, copy))
    return version


TABLES = ("sessions", "ledger_turns", "refs_turns", "affinity", "copies", "lineage", "meta")


def dump(s: Store) -> dict[str, list[tuple]]:
    return {t: s.db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in TABLES}


def rows(first: int, n: int, salt: str) -> list[LedgerRow]:
    return [LedgerRow(f"msg-{salt}-{i}", f"h{salt}{i:04d}", f"m{first + i:05d}", "user", "text", 3 + i)
            for i in range(n)]


class Clock:
    """A time.time both stores see alike (the rows keep their times)."""

    def __init__(self):
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def test_the_one_statement_commit_writes_and_refuses_as_the_read_check_write_did(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(store_mod, "time", SimpleNamespace(time=clock, perf_counter=time.perf_counter))
    new, ref = Store(tmp_path / "new"), Store(tmp_path / "ref")
    rnd = random.Random(11)
    sids = ["a", "b", "c", "d", "e"]
    for s in (new, ref):  # a family (c's and d's counters are shared) and a schema-1 row at version 0
        s.db.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES('c','','c',0,1)")
        s.db.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES('d','c','c',2,1)")
        s.db.execute("INSERT INTO sessions(id, created, last_seen, next_ref, version) VALUES('e', 1, 1, 4, 0)")
    # what a process holds of each session: (version, next_ref, requests)
    held = {sid: (0, 4 if sid == "e" else 1, 0) for sid in sids}
    outcomes = {"ok": 0, "stale": 0, "refs": 0, "read": 0}
    read = []
    new.db.set_trace_callback(lambda sql: read.append(sql) if sql.startswith("SELECT s.version") else None)
    for step in range(600):
        sid = rnd.choice(sids)
        version, nxt, requests = held[sid]
        expect = version + rnd.choice((0, 0, 0, 0, 1, -1))
        fresh = rnd.random() < 0.2
        n = rnd.choice((0, 1, 1, 2, 5))
        start = nxt + rnd.choice((0, 0, 0, 0, 0, 1, -1))
        new_rows = rows(start, n, f"{step}")
        minted = [] if fresh else [(r.ref, r.content_hash) for r in new_rows][: rnd.choice((n, n, n - 1 if n else 0))]
        k = n if fresh and n else len(minted)
        row = SessionRow(sid, rnd.choice(("", "agent")), "anthropic", 0.0, 0.0, requests + 1, 10 + step,
                         nxt + k + rnd.choice((0, 0, 0, 0, 0, 1)), '{"x": %d}' % step)
        chain = (step, f"tail{step}") if rnd.random() < 0.3 else None
        copy = f'{{"copy": {step}}}' if rnd.random() < 0.3 else None
        got = []
        for s, commit in ((new, Store.commit_turn), (ref, reference_commit_turn)):
            t = clock.t
            try:
                got.append(("ok", commit(s, row, new_rows, chain, expect=expect, minted=minted, fresh=fresh,
                                         copy=copy)))
            except StoreError as e:
                got.append((type(e).__name__, str(e)))
            clock.t = t  # (the second store sees the same times)
        clock()
        outcomes["read"] += bool(read)
        if got[0][0] == "ok" and not (expect == 0 and sid in "cde"):
            # checked by the statement that wrote the row: nothing read first (but for a row at version
            # 0 the insert found, and a new session in a family: its first ref may be the family's)
            assert not read, step
        read.clear()
        assert got[0] == got[1], (step, got)
        assert dump(new) == dump(ref), step
        assert not new.db.in_transaction
        if got[0][0] == "ok":
            outcomes["ok"] += 1
            held[sid] = (got[0][1], row.next_ref, row.requests)
        else:
            outcomes["stale"] += got[0][0] == "StaleSession"
            outcomes["refs"] += got[0][0] == "StaleSession" and expect == version
        if rnd.random() < 0.05:  # another process advanced a family member's counter
            other = rnd.choice(("c", "d"))
            for s in (new, ref):
                s.db.execute("UPDATE sessions SET next_ref=next_ref+3 WHERE id=?", (other,))
    # both ways taken, many times; a refused turn (stale, or its refs given already) read why
    assert outcomes["ok"] > 150 and outcomes["stale"] > 150 and outcomes["refs"] > 30, outcomes
    assert outcomes["read"] >= outcomes["stale"]
    new.close()
    ref.close()


def test_another_process_change_is_caught_before_anything_of_the_turn_is_written(tmp_path):
    """Two Store objects on one file (two processes): the one whose copy is older gets StaleSession
    and writes nothing; so does a turn that gives refs the other gave meanwhile."""
    a, b = Store(tmp_path), Store(tmp_path)
    v = a.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 1, 2, 3), rows(1, 2, "x"), expect=0, fresh=True)
    assert b.version("s") == v == 1
    # both computed a follow-up from version 1, each giving ref m00003
    a_rows, b_rows = rows(3, 1, "a"), rows(3, 1, "b")
    assert a.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 2, 3, 4), a_rows, expect=1,
                         minted=[("m00003", a_rows[0].content_hash)]) == 2
    assert a.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 2, 3, 4), [], expect=2) == 3  # no refs
    before = dump(b)
    with pytest.raises(StaleSession) as e:
        b.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 2, 3, 4), b_rows, expect=1,
                      minted=[("m00003", b_rows[0].content_hash)], copy='{"b": 1}')
    assert "version 3" in str(e.value) and "this process had 1" in str(e.value)
    assert dump(b) == before and not b.db.in_transaction
    # a new session both made at once: the second one's first turn is refused
    a.commit_turn(SessionRow("n", "", "anthropic", 0.0, 0.0, 1, 1, 2), rows(1, 1, "na"), expect=0, fresh=True)
    with pytest.raises(StaleSession):
        b.commit_turn(SessionRow("n", "", "anthropic", 0.0, 0.0, 1, 1, 2), rows(1, 1, "nb"), expect=0, fresh=True)
    assert [r.content_hash for r in b.ledger("n")] == [rows(1, 1, "na")[0].content_hash]
    # the same version but a counter another family member moved: the refs are given already
    for s in (a,):
        s.db.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES('s','','s',0,1)")
        s.db.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES('t','s','s',1,1)")
        s.db.execute("INSERT INTO sessions(id, created, last_seen, next_ref, version) VALUES('t', 1, 1, 9, 1)")
    before = dump(b)
    with pytest.raises(StaleSession) as e:
        b.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 3, 4, 5), rows(4, 1, "c"), expect=3,
                      minted=[("m00004", rows(4, 1, "c")[0].content_hash)])
    assert "version 9" in str(e.value)  # (the message names the first free ref where the version goes)
    assert dump(b) == before
    # from the family's next number, the turn goes in
    assert b.commit_turn(SessionRow("s", "", "anthropic", 0.0, 0.0, 3, 4, 10), rows(9, 1, "c"), expect=3,
                         minted=[("m00009", rows(9, 1, "c")[0].content_hash)]) == 4
    assert a.version("s") == 4 and a.session("s").next_ref == 10
    a.close()
    b.close()


def test_a_legacy_row_at_version_0_takes_its_first_turn(tmp_path):
    """A session row of a schema-1 store (version 0, made before versions): the insert finds it,
    the read-check-write path writes the turn as before."""
    s = Store(tmp_path)
    s.db.execute("INSERT INTO sessions(id, agent, created, last_seen, next_ref, version) "
                 "VALUES('old', 'x', 5, 5, 1, 0)")
    assert s.commit_turn(SessionRow("old", "y", "chat", 0.0, 0.0, 1, 1, 2), rows(1, 1, "o"), expect=0,
                         fresh=True) == 1
    r = s.session("old")
    assert (r.agent, r.lane, r.created, r.next_ref, r.version) == ("y", "chat", 5, 2, 1)
    s.close()


def test_a_turn_pokes_the_checkpointer_by_the_pages_it_may_have_written(tmp_path, monkeypatch):
    """The WAL's size is looked at once commits that say their size may have added POKE_PAGES pages
    (a write that does not say looks every time)."""
    s = Store(tmp_path)
    cp = s._checkpointer
    stats = []
    real = store_mod.os.stat
    monkeypatch.setattr(store_mod.os, "stat", lambda p, *a, **k: (stats.append(p), real(p, *a, **k))[1])
    for i in range(40):
        s.commit_turn(SessionRow(f"p{i}", "", "anthropic", 0.0, 0.0, 1, 1, 2), rows(1, 1, f"{i}"), expect=0,
                      fresh=True)
    looks = stats.count(cp.wal)
    assert 0 < looks < 20  # a small turn says ~20 pages: one look in ~6
    stats.clear()
    s.set_flags(SessionRow("p0", "", "anthropic", 0.0, 0.0, 1, 1, 2), expect=1)
    assert stats.count(cp.wal) == 1 and cp.owed == 0
    s.close()
