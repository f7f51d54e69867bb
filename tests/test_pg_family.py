"""A family's sessions (a conversation and its forks) give refs from one counter: a ref names one
text in the whole family.  Two instances committing turns of a parent and its fork at the same time
must not both give the same numbers: SQLite's one writer reads the family's counter inside its
write (the second commit is refused, StaleSession); PostgreSQL's ``bili_commit_turn`` takes the
family's lock before it reads the counter (schema 12).  Before it, each read the other's counter as
it was under READ COMMITTED, and both stored ``m00004``, for two texts."""

from __future__ import annotations

import threading
import time

import pytest

from bili_addon.store import LedgerRow, SessionRow, StaleSession, ref_names


def row(sid: str, next_ref: int, requests: int = 1) -> SessionRow:
    return SessionRow(sid, "agent", "anthropic", 1.0, 1.0, requests, next_ref - 1, next_ref)


def refs(n: int, first: int, tag: str) -> list[LedgerRow]:
    return [LedgerRow(f"{tag}{first + i}", f"{tag}{first + i:031d}"[-32:], r, "user", "text", 10)
            for i, r in enumerate(ref_names(first, n))]


def family(s) -> None:
    """P with m00001..m00003, and C forked from it after them: the family's next ref is m00004."""
    p = refs(3, 1, "p")
    assert s.commit_turn(row("P", 4), p, expect=0, fresh=True) == 1
    assert s.adopt(row("C", 4, 0), "P", "P", 3, p, [], [], [], expect=0) == 1
    assert s.family("C")[3] == 4 and s.family("P")[3] == 4


def turn(s, sid: str, tag: str):
    """Each session's turn gives m00004, as both computed it from the family's counter."""
    mine = refs(1, 4, tag)
    return s.commit_turn(row(sid, 5, 2), mine, expect=1, minted=[(r.ref, r.content_hash) for r in mine])


def given_twice(s) -> list[str]:
    seen: dict[str, set[str]] = {}
    for sid in ("P", "C"):
        for r in s.ledger(sid):
            seen.setdefault(r.ref, set()).add(r.content_hash)
    return [ref for ref, texts in seen.items() if len(texts) > 1]


def test_one_family_never_gives_one_ref_to_two_texts(backend):
    s = backend()
    family(s)
    assert turn(s, "P", "pp") == 2
    with pytest.raises(StaleSession):
        turn(s, "C", "cc")
    assert not given_twice(s)


def test_two_instances_committing_a_parent_and_its_fork_at_once(pg_url, tmp_path):
    """The parent's commit is held up after it took the family's lock (a row its ledger insert waits
    for: in life any wait); the fork's commit, on another instance, waits for that lock, then finds
    the counter moved and is refused (its turn is computed again), as on SQLite."""
    import psycopg

    from bili_addon.store_pg import PgStore

    a = PgStore(pg_url, str(tmp_path / "a"), lock_wait=10)
    b = PgStore(pg_url, str(tmp_path / "b"), lock_wait=10)
    ext = psycopg.connect(pg_url)
    try:
        family(a)
        ext.execute("INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES('P', 2, 0, 0, '[]')")
        got: dict[str, object] = {}

        def run(s, sid, tag):
            try:
                got[sid] = turn(s, sid, tag)
            except Exception as e:  # (the assertion below names it)
                got[sid] = e

        tp = threading.Thread(target=run, args=(a, "P", "pp"))
        tp.start()
        time.sleep(0.5)  # P's commit now waits on the row, holding the family's lock
        tc = threading.Thread(target=run, args=(b, "C", "cc"))
        tc.start()
        time.sleep(0.5)  # C's commit waits for the family's lock
        assert "C" not in got
        ext.rollback()  # P's commit goes on
        tp.join(20)
        tc.join(20)
        assert got["P"] == 2
        assert isinstance(got["C"], StaleSession), got["C"]
        assert not given_twice(a)
    finally:
        ext.close()
        a.close()
        b.close()


def test_a_fork_recognised_late_gives_its_own_rows_numbers_no_one_took_meanwhile(backend):
    """A session that gave refs before it was recognised as a fork gives those rows new numbers from
    the family's counter (``retired``), as it read it before the adoption's write: a parent's commit
    in between may have given the same numbers.  Refused then (the turn is computed again)."""
    s = backend()
    p = refs(3, 1, "p")
    assert s.commit_turn(row("P", 4), p, expect=0, fresh=True) == 1
    own = refs(1, 1, "own")  # C's own first row, on its own counter: m00001, which P's m00001 takes
    assert s.commit_turn(row("C", 2), own, expect=0, fresh=True) == 1
    assert s.session("P").next_ref == 4  # what the adoption numbers the retired row from: m00004
    assert turn(s, "P", "pp") == 2  # P gives m00004 meanwhile
    retired = [(own[0].msg_id, own[0].content_hash, "m00004")]
    with pytest.raises(StaleSession):
        s.adopt(row("C", 5, 1), "P", "P", 3, p, [], [], [], retired, expect=1)
    # computed again from the counter as it is now: m00005
    assert s.adopt(row("C", 6, 1), "P", "P", 3, p, [], [], [], [(own[0].msg_id, own[0].content_hash, "m00005")],
                   expect=1) == 2
    assert not given_twice(s)
