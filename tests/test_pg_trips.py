"""A turn's round trips to PostgreSQL, lean on the client (bili_addon/store_pg.py): the session's lock
key computed by the server (the same number as ``PgStore.lock_key``), hold and commit through libpq's
blocking call, a held session's commit on the lock connection (not a pooled one), the unlock's answer
read with libpq's calls.  What a turn sends, refuses and stores is as before: the same bytes, refs
and rows as the SQLite store's, StaleSession on a concurrent change, a lost connection a store error."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("psycopg")

from bili_addon.kernel.fold import FoldConfig  # noqa: E402
from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.store import LedgerRow, SessionBusy, SessionRow, StaleSession, Store, StoreError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

IDS = ["", "a", "bench-overhead-1733380000000000000", "sé", "é😀中" * 30, "x" * 3000, "'; SELECT 1; --", "\\n\t"]


def pg(url, tmp_path, **kw):
    from bili_addon.store_pg import PgStore

    return PgStore(url, str(tmp_path), **kw)


def other(url):
    import psycopg

    c = psycopg.connect(url, autocommit=True)
    c.execute("SET lock_timeout = 5000")
    return c


def held_keys(conn, pid: int) -> set[int]:
    """The session-level advisory locks a backend holds, as the signed 64-bit keys they were taken by."""
    rows = conn.execute("SELECT classid::bigint, objid::bigint FROM pg_locks WHERE locktype='advisory' "
                        "AND objsubid=1 AND pid=%s AND granted", (pid,)).fetchall()
    return {int.from_bytes(((hi << 32) | lo).to_bytes(8, "big"), "big", signed=True) for hi, lo in rows}


def row(sid: str, next_ref: int = 2, **kw) -> SessionRow:
    return SessionRow(sid, "agent", "anthropic", 1.0, 1.0, 1, next_ref - 1, next_ref, **kw)


def refs(n: int, first: int = 1) -> list[LedgerRow]:
    from bili_addon.store import ref_names

    return [LedgerRow(f"m{first + i}é", f"h{first + i:030d}", r, "user", "text", 10 + i)
            for i, r in enumerate(ref_names(first, n))]


# -- the lock key ------------------------------------------------------------------------------------
def test_the_servers_lock_key_is_the_clients(pg_url, tmp_path):
    """The key hold takes is the server's SHA-256 of the id: the number lock_key gives (an older
    instance's key, and prune's), for any id."""
    from bili_addon.store_pg import _KEY_SQL, PgStore

    rnd = random.Random(11)
    alphabet = "abcXYZ019-_:/ .'\"\\\téäöü€中😀\u2028"
    ids = IDS + ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 90))) for _ in range(1500)]
    with other(pg_url) as c:
        got = c.execute(f"SELECT array_agg({_KEY_SQL.format('i')} ORDER BY n) FROM unnest(%s::text[]) "
                        "WITH ORDINALITY AS u(i, n)", (ids,)).fetchone()[0]
        assert got == [PgStore.lock_key(i) for i in ids]
        s = pg(pg_url, tmp_path)
        try:
            for sid in IDS:
                s.hold(sid)
                assert held_keys(c, s._lock_conn.info.backend_pid) == {PgStore.lock_key(sid)}
                s.release(wait=True)
                assert held_keys(c, s._lock_conn.info.backend_pid) == set()
        finally:
            s.close()


def test_a_session_locked_by_its_client_key_is_busy(pg_url, tmp_path):
    """An instance that takes the lock by lock_key (an older bili, prune) and one that lets the server
    compute it exclude each other."""
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path, lock_wait=0.2)
    try:
        with other(pg_url) as c:
            c.execute("SELECT pg_advisory_lock(%s)", (PgStore.lock_key("sé"),))
            with pytest.raises(SessionBusy):
                s.hold("sé")
            c.execute("SELECT pg_advisory_unlock_all()")
            s.hold("sé")
            assert not c.execute("SELECT pg_try_advisory_lock(%s)", (PgStore.lock_key("sé"),)).fetchone()[0]
            s.release(wait=True)
            assert c.execute("SELECT pg_try_advisory_lock(%s)", (PgStore.lock_key("sé"),)).fetchone()[0]
    finally:
        s.close()


# -- the commit on the lock connection ----------------------------------------------------------------
def test_a_held_sessions_commit_goes_on_the_lock_connection(pg_url, tmp_path, monkeypatch):
    s = pg(pg_url, tmp_path)
    try:
        s.hold("c1", ("fp", "anthropic"))
        pooled = []
        real = s.pool.connection
        monkeypatch.setattr(s.pool, "connection", lambda *a, **k: pooled.append(1) or real(*a, **k))
        before = s.round_trips
        v = s.commit_turn(row("c1", 4), refs(3), (3, "tail"), expect=0, fresh=True)
        assert (v, s.round_trips - before, pooled) == (1, 1, [])
        assert s.version("c1") == 1  # (what hold read, moved by the commit)
        s.release()
        v = s.commit_turn(row("c1", 5), refs(1, 4), expect=1, minted=[("m00004", "h000000000000000000000000000000")])
        assert v == 2 and pooled  # not held: a pooled connection's
        t = pg(pg_url, tmp_path)
        try:
            assert sorted(r.ref for r in t.ledger("c1")) == ["m00001", "m00002", "m00003", "m00004"]
            assert t.session("c1").next_ref == 5 and t.version("c1") == 2
        finally:
            t.close()
    finally:
        s.close()


def test_a_commit_on_the_lock_connection_refuses_a_stale_version_and_keeps_the_lock(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    a, b = pg(pg_url, tmp_path), pg(pg_url, tmp_path)
    try:
        a.hold("st")
        b.commit_turn(row("st"), refs(1), expect=0, fresh=True)  # written meanwhile (no lock taken)
        with pytest.raises(StaleSession) as e:
            a.commit_turn(row("st"), refs(1), expect=0, fresh=True)
        assert e.value.session_id == "st" and "(version 1, this process had 0)" in str(e.value)
        with other(pg_url) as c:  # the lock is still a's, its connection still the same
            assert held_keys(c, a._lock_conn.info.backend_pid) == {PgStore.lock_key("st")}
            a.release(wait=True)
            assert c.execute("SELECT pg_try_advisory_lock(%s)", (PgStore.lock_key("st"),)).fetchone()[0]
        a.hold("st")  # reloaded: the turn computed again from version 1 commits
        assert a.version("st") == 1
        assert a.commit_turn(row("st", 3), refs(1, 2), expect=1, minted=[("m00002", "h2")]) == 2
        a.release()
    finally:
        a.close()
        b.close()


def test_a_commit_waits_for_a_row_another_transaction_holds(pg_url, tmp_path):
    """The commit on the lock connection waits for the session's row as a pooled one did (within the
    lock wait: a row of a held session is held only by an answer's short bookkeeping)."""
    s = pg(pg_url, tmp_path)
    try:
        s.commit_turn(row("rw"), refs(1), expect=0, fresh=True)
        s.hold("rw")
        c = other(pg_url)
        c.execute("BEGIN")
        c.execute("SELECT 1 FROM sessions WHERE id='rw' FOR UPDATE")
        other_commits = threading.Timer(0.3, lambda: c.execute("COMMIT"))
        other_commits.start()
        t = time.monotonic()
        assert s.commit_turn(row("rw", 3), refs(1, 2), expect=1, minted=[("m00002", "h2")]) == 2
        assert time.monotonic() - t >= 0.25
        s.release()
        other_commits.join()  # (its COMMIT's answer read before the connection closes)
        c.close()
    finally:
        s.close()


def test_a_lock_connection_lost_before_the_commit_is_a_store_error(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        s.hold("lost")
        pid = s._lock_conn.info.backend_pid
        with other(pg_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
            with pytest.raises(StoreError) as e:
                s.commit_turn(row("lost"), refs(1), expect=0, fresh=True)
            assert e.value.kind == "unreachable" and not isinstance(e.value, StaleSession)
            assert s._lock_conn is None  # dropped: the next hold opens another
            s.release()
            s.hold("lost")
            assert s._lock_conn.info.backend_pid != pid
            assert held_keys(c, s._lock_conn.info.backend_pid) == {PgStore.lock_key("lost")}
            assert s.version("lost") in (0, 1)  # (whether the server ran it before it went is its own)
            s.release(wait=True)
    finally:
        s.close()


def test_a_hold_on_a_lost_connection_is_a_store_error_then_a_new_one(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        s.hold("h0")
        s.release(wait=True)
        pid = s._lock_conn.info.backend_pid
        with other(pg_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
        with pytest.raises(StoreError) as e:
            s.hold("h1")
        assert e.value.kind == "unreachable" and s._lock_conn is None
        s.hold("h1")
        assert s.version("h1") == 0
        s.release()
    finally:
        s.close()


def test_the_lineage_after_the_answer_goes_on_the_lock_connection(pg_url, tmp_path, monkeypatch):
    """A turn's lineage, stored after the answer: one statement on the lock connection (its unlock's
    answer read first), none on a pooled one; a lost lock connection is a store error, then a new one."""
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        s.hold("ln")
        s.release()
        pooled = []
        real = s.pool.connection
        monkeypatch.setattr(s.pool, "connection", lambda *a, **k: pooled.append(1) or real(*a, **k))
        before = s.round_trips
        s.save_lineage_parts("ln", 0, [("m00001", "c1", "f1"), ("m00002", "c2", "f2")])
        assert (s.round_trips - before, pooled, s._unlocking) == (1, [], False)
        with other(pg_url) as c:
            assert held_keys(c, s._lock_conn.info.backend_pid) == set()
            assert c.execute("SELECT pg_try_advisory_lock(%s)", (PgStore.lock_key("ln"),)).fetchone()[0]
            c.execute("SELECT pg_terminate_backend(%s)", (s._lock_conn.info.backend_pid,))
            time.sleep(0.2)
        with pytest.raises(StoreError) as e:
            s.save_lineage_parts("ln", 1, [("m00003", "c3", "f3")])
        assert e.value.kind == "unreachable" and s._lock_conn is None
        s.save_lineage_parts("ln", 1, [("m00003", "c3", "f3")])
        assert s.lineage_parts("ln") == [("m00001", "c1", "f1"), ("m00003", "c3", "f3")]
    finally:
        s.close()


def test_a_latin1_client_encoding(pg_url, tmp_path):
    """The lock connection's encoding is read once, when it opens: parameters and documents are sent
    in it, the lock key is still the id's UTF-8 bytes' hash."""
    from bili_addon.store_pg import PgStore

    url = pg_url + ("&" if "?" in pg_url else "?") + "client_encoding=LATIN1"
    s = pg(url, tmp_path)
    try:
        assert s._lock_enc == s._lock_conn.info.encoding != "utf-8"
        s.hold("sé", ("fé", "anthropic"))
        with other(pg_url) as c:
            assert held_keys(c, s._lock_conn.info.backend_pid) == {PgStore.lock_key("sé")}
        rows = refs(3)
        assert s.commit_turn(row("sé", 4, flags='{"ä": 1}'), rows, (3, "tailé"), expect=0, fresh=True) == 1
        s.release()
        t = pg(pg_url, tmp_path)
        try:
            assert t.ledger("sé") == rows and json.loads(t.session("sé").flags) == {"ä": 1}
        finally:
            t.close()
    finally:
        s.close()


def test_the_unlocks_answer_read_before_and_after_it_came(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        with other(pg_url) as c:
            for pause in (0.0, 0.05):
                s.hold("u")
                pid = s._lock_conn.info.backend_pid
                s.release()
                time.sleep(pause)
                s._unlocked()  # at once (its answer likely still on its way: waited for), or later (read)
                assert not s._unlocking and s._lock_conn.info.backend_pid == pid
                assert c.execute("SELECT pg_try_advisory_lock(%s)", (PgStore.lock_key("u"),)).fetchone()[0]
                c.execute("SELECT pg_advisory_unlock_all()")
            s.hold("u")
            s.release(wait=True)
            assert not s._unlocking and held_keys(c, s._lock_conn.info.backend_pid) == set()
    finally:
        s.close()


def test_a_prune_right_after_a_turn_reads_the_turns_unlock_first(pg_url, tmp_path, monkeypatch):
    """A turn lets its session go without waiting for the answer (release); a prune on the same
    instance right after it (retention, on the same worker) reads that answer before it tries the
    session's lock, so it never finds its own instance's lock still held."""
    s = pg(pg_url, tmp_path)
    try:
        s.commit_turn(row("p"), refs(1), expect=0, fresh=True)
        sql = "UPDATE sessions SET last_seen = %s WHERE id = %s"
        with other(pg_url) as c:
            c.execute(sql, (1.0, "p"))
        for _ in range(20):
            s.hold("p")
            s.release()
            assert s._unlocking
            got = s.prune(["p"], before=1e9, dry_run=True)  # (a dry run takes no lock: nothing to read first)
            assert got is not None
            assert s._unlocking
            read = []
            real = s._unlocked
            monkeypatch.setattr(s, "_unlocked", lambda: (read.append(1), real())[1])
            # a prune that is not a dry run: the unlock's answer read before its try of the lock
            monkeypatch.setattr(s, "_tx", lambda: (_ for _ in ()).throw(RuntimeError("stop here")))
            with pytest.raises(RuntimeError, match="stop here"):
                s.prune(["p"], before=1e9)
            assert read == [1] and not s._unlocking
            monkeypatch.undo()
        assert s.prune(["p"], before=1e9) is not None  # (and it prunes: the lock was free)
    finally:
        s.close()


# -- the same turns, the same bytes and rows ------------------------------------------------------------
def _stored(store, sid: str):
    row_, ledger, blocks, calls, copy = store.session_state(sid)
    if row_ is None:
        return None
    flags = json.loads(row_.flags or "{}")
    for e in flags.get("epochs", []):
        e.pop("at", None)
    blocks = [{k: v for k, v in json.loads(x).items() if k != "created"} for x in blocks]  # (the clock's)
    return (row_.agent, row_.lane, row_.requests, row_.messages, row_.next_ref, flags, ledger,
            sorted(blocks, key=lambda x: x["id"]),
            sorted(map(tuple, calls)), copy, store.lineage_parts(sid), store.ref_count(sid), store.version(sid))


def _engine(store) -> Engine:
    eng = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000))
    eng.lineage.defer = True
    return eng


def _same(a: Engine, b: Engine, raw: bytes, lane, headers) -> str | None:
    ra, rb = (e.process(raw, lane, headers, render=True) for e in (a, b))
    assert (ra.body, ra.session, ra.refs_new, ra.refs_known, ra.tagged, ra.reused, ra.notes, ra.executed) == (
        rb.body, rb.session, rb.refs_new, rb.refs_known, rb.tagged, rb.reused, rb.notes, rb.executed)
    for e in (a, b):
        e.lineage.flush()
    if ra.session:
        assert _stored(a.store, ra.session) == _stored(b.store, ra.session)
    return ra.session


@pytest.mark.parametrize("lane,n", [("anthropic", 100), ("chat", 60)])
def test_the_benchs_conversations_on_postgresql_are_sqlites(pg_url, tmp_path, lane, n):
    """First turns, follow-ups and (Anthropic) a folded session's follow-ups: the same outgoing bytes,
    results and stored rows on both backends."""
    case = bench_overhead.Case(lane, n, seed=3)
    a, b = _engine(pg(pg_url, tmp_path / "pg")), _engine(Store(str(tmp_path / "sqlite")))
    try:
        for k in range(3):  # first turns of new conversations
            _same(a, b, case.unique_body(), case.lane, {"x-acp-session": f"first-{k}"})
        msgs, h = list(case.msgs), {"x-acp-session": "follow"}
        for i in range(4):
            _same(a, b, case.body(msgs), case.lane, h)
            msgs.append(case.new(i))
        if lane == "anthropic":
            h = {"x-acp-session": "folded"}
            fm = bench_overhead.fold_half(a, case, list(case.msgs), h)
            assert bench_overhead.fold_half(b, case, list(case.msgs), h) == fm
            assert _stored(a.store, "folded") == _stored(b.store, "folded")
            for i in range(3):
                fm.append(case.new(i))
                _same(a, b, case.body(fm), case.lane, h)
    finally:
        a.store.close()
        b.store.close()


def test_the_captures_on_postgresql_are_sqlites(pg_url, tmp_path):
    """Every captured agent's requests, in order, then again, as they came and under one session id
    each: the same bytes, results and stored rows on both backends."""
    from wirecases import capture_files, captured_bodies

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    a, b = _engine(pg(pg_url, tmp_path / "pg")), _engine(Store(str(tmp_path / "sqlite")))
    try:
        for k, path in enumerate(files):
            caps = captured_bodies(path)
            for headers in (None, {"x-acp-session": f"cap-{k}"}):
                for c in caps + caps:
                    _same(a, b, c.raw, c.lane, c.headers if headers is None else {**c.headers, **headers})
    finally:
        a.store.close()
        b.store.close()
