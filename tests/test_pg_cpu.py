"""The client's CPU of a turn on PostgreSQL (bili_addon/store_pg.py): the turn's hold and commit prepared
on the lock connection when it opens (sent as they were when a prepare is refused), and the lineage
parts after the answer sent as one JSON text through libpq (not three text arrays adapted by psycopg).
What is read, stored and raised is as before: the same state, rows and errors, a lost or emptied
connection recovered by the next turn."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("psycopg")

from bili_addon.store import LedgerRow, SessionBusy, SessionRow, StaleSession, StoreError, ref_names  # noqa: E402

# the statement save_lineage_parts sent before (psycopg's text arrays), as it was
OLD_SAVE_PARTS = ("WITH gone AS (DELETE FROM lineage_parts WHERE session_id=%(s)s AND seq>=%(end)s) "
                  "INSERT INTO lineage_parts(session_id, seq, ref, chash, fp) "
                  "SELECT %(s)s, %(keep)s + u.i - 1, u.r, u.h, u.f FROM unnest(%(r)s::text[], %(h)s::text[], "
                  "%(f)s::text[]) WITH ORDINALITY AS u(r, h, f, i) "
                  "ON CONFLICT(session_id, seq) DO UPDATE SET ref=excluded.ref, chash=excluded.chash, fp=excluded.fp")

# texts a JSON document or an array literal could get wrong
ODD = ["", " ", "NULL", "null", '"', '\\', '\\"', "{", "}", "{a,b}", ",", "'", "é", "😀", "中文", "\t\n\r", "\x01",
       "\u2028", "a\\u0041", "[1]", '{"k": 1}', "x" * 5000]


def pg(url, tmp_path, **kw):
    from bili_addon.store_pg import PgStore

    return PgStore(url, str(tmp_path), **kw)


def other(url):
    import psycopg

    return psycopg.connect(url, autocommit=True)


def parts_of(url, sid):
    with other(url) as c:
        return c.execute("SELECT seq, ref, chash, fp FROM lineage_parts WHERE session_id=%s ORDER BY seq",
                         (sid,)).fetchall()


def old_save(url, sid, keep, rows):
    with other(url) as c:
        c.execute(OLD_SAVE_PARTS, {"s": sid, "end": keep + len(rows), "keep": keep, "r": [r[0] for r in rows],
                                   "h": [r[1] for r in rows], "f": [r[2] for r in rows]})


def odd_rows(n: int, salt: str = "") -> list[tuple[str, str, str]]:
    return [(f"m{i:05d}{salt}", ODD[i % len(ODD)] + salt, ODD[(i * 7 + 3) % len(ODD)]) for i in range(n)]


@pytest.mark.parametrize("pooled", [False, True])
def test_lineage_parts_store_what_the_text_arrays_stored(pg_url, tmp_path, pooled):
    """The same rows as the statement of text arrays, for odd texts, a replaced tail, a longer and a
    shorter one (the lock connection's path, and a pooled one inside a transaction)."""
    s = pg(pg_url, tmp_path)
    try:
        steps = [(0, odd_rows(60)), (10, odd_rows(30, "b")), (25, odd_rows(3, "c")), (40, []), (2, odd_rows(1, "d")),
                 (0, [])]
        for i, sid in enumerate(["", "s", "sé😀", "'; --"]):
            for keep, rows in steps[i:] + steps[:i]:
                if pooled:
                    with s._tx():
                        s.save_lineage_parts(sid, keep, rows)
                else:
                    s.save_lineage_parts(sid, keep, rows)
                old_save(pg_url, "old:" + sid, keep, rows)
                got = parts_of(pg_url, sid)
                assert got == parts_of(pg_url, "old:" + sid)
                assert s.lineage_parts(sid) == [r[1:] for r in got]
    finally:
        s.close()


def test_lineage_parts_in_a_latin1_client_encoding(pg_url, tmp_path):
    s = pg(pg_url + ("&" if "?" in pg_url else "?") + "client_encoding=LATIN1", tmp_path)
    try:
        assert s._lock_enc != "utf-8"
        rows = [("m00001", "é", "ä\\\"{,}"), ("m00002", "", "NULL"), ("m00003", "ß" * 100, "\t")]
        s.save_lineage_parts("lé", 0, rows)
        old_save(pg_url, "old", 0, rows)
        assert [r[1:] for r in parts_of(pg_url, "lé")] == [r[1:] for r in parts_of(pg_url, "old")] == rows
    finally:
        s.close()


def prepared(s) -> set[str]:
    return {r[0] for r in s._lock_conn.execute("SELECT name FROM pg_prepared_statements").fetchall()}


def turns(s, sid: str, n: int, start: int = 0) -> list:
    """``n`` turns of a session (hold, reads, commit with release; ``start`` turns of it before), what
    each read and returned."""
    seen = []
    for t in range(start, start + n):
        s.hold(sid, ("fp-" + sid, "anthropic") if t == 0 else None)
        v = s.version(sid)
        seen.append((v, s.family(sid), s.last_usage(sid), s.lineage_candidates("fp-" + sid, "anthropic")))
        first = 1 + 3 * t
        rows = [LedgerRow(f"id{t}-{i}", f"h{t}-{i}é", r, "user", "text", 10 + i)
                for i, r in enumerate(ref_names(first, 3))]
        row = SessionRow(sid, "agent", "anthropic", 1.0, 1.0, t + 1, first + 2, first + 3, flags='{"t": %d}' % t)
        seen.append(s.commit_turn(row, rows, (t, f"tail{t}"), expect=v, fresh=True, copy=f"copy{t}",
                                  release=t % 2 == 0))
        s.release()
    return seen


def test_the_turns_statements_are_prepared_and_answer_as_sent_ones(pg_url, tmp_path, monkeypatch):
    s = pg(pg_url, tmp_path)
    try:
        assert s._lock_prep and prepared(s) >= {"bili_hold", "bili_commit", "bili_save_parts", "bili_commit_release"}
        a = turns(s, "prep", 8)
        s.save_lineage_parts("prep", 0, [("m00001", "c", "fp-prep")])
        monkeypatch.setattr(s, "_lock_prep", False)  # the statements sent as they are
        b = turns(s, "sent", 8)
        s.save_lineage_parts("sent", 0, [("m00001", "c", "fp-sent")])
        assert [x for x in a] == [x for x in b]
        assert s.ledger("prep") == [LedgerRow(r.msg_id, r.content_hash, r.ref, r.role, r.ctype, r.tokens)
                                    for r in s.ledger("sent")]
        assert (s.copy("prep"), s.session("prep").flags, s.session("prep").version) == \
               (s.copy("sent"), s.session("sent").flags, s.session("sent").version)
        assert s.lineage_candidates("fp-prep", "anthropic") == ["prep"]
    finally:
        s.close()


def test_refused_prepares_send_the_statements_as_they_are(pg_url, tmp_path, monkeypatch):
    from bili_addon import store_pg

    monkeypatch.setattr(store_pg, "_PREPARED", ((b"bili_hold", b"SELECT no_such_function($1, $2, $3)"),
                                                *store_pg._PREPARED[1:]))
    s = pg(pg_url, tmp_path)
    try:
        assert not s._lock_prep and s._lock_proc
        assert turns(s, "np", 3)[-1] == 3
    finally:
        s.close()


def test_the_prepared_statements_come_again_with_a_new_lock_connection(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        turns(s, "a", 1)
        with other(pg_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (s._lock_conn.info.backend_pid,))
            time.sleep(0.2)
        with pytest.raises(StoreError) as e:
            s.hold("a")
        assert e.value.kind == "unreachable" and s._lock_conn is None and not s._lock_prep
        assert turns(s, "a", 2, 1)[-1] == 3
        assert s._lock_prep and prepared(s) >= {"bili_hold", "bili_commit", "bili_save_parts", "bili_commit_release"}
        # statements gone from the connection (no path of bili's does this): that turn is a store error
        # (it passes through), the next one has them again
        s._lock_conn.execute("DEALLOCATE ALL")
        with pytest.raises(StoreError):
            s.hold("a")
        assert s._lock_conn is None
        assert turns(s, "a", 1, 3)[-1] == 4 and s._lock_prep
    finally:
        s.close()


def test_refusals_raise_as_before(pg_url, tmp_path):
    """A stale version (StaleSession, the lock kept), a session another instance holds (SessionBusy),
    through the prepared statements."""
    a = pg(pg_url, tmp_path)
    b = pg(pg_url, tmp_path, lock_wait=0.2)
    try:
        assert a._lock_prep and b._lock_prep
        turns(a, "st", 1)
        a.hold("st")
        row = SessionRow("st", "agent", "anthropic", 1.0, 1.0, 2, 4, 5)
        with pytest.raises(StaleSession) as e:
            a.commit_turn(row, [], expect=0, release=True)
        assert "(version 1, this process had 0)" in str(e.value) and "st" in a._held
        with pytest.raises(SessionBusy):
            b.hold("st")
        a.release(wait=True)
        b.hold("st")
        assert b.version("st") == 1
        b.release()
    finally:
        a.close()
        b.close()
