"""A turn's last write carries the session's unlock (bili_addon/store_pg.py ``commit_turn(release=True)``):
one statement on the lock connection (a procedure of its own: the commit, COMMIT, the unlock).  The
commit's own transaction ends before the unlock runs (another instance that gets the lock sees the turn), the lock
is free when the turn returns (release has nothing left to send), the round trip counts once, and a
write of the session after it (a path the turn did not foresee) takes the lock again first: its
version check refuses it when another instance's turn came in between."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("psycopg")

from bili_addon.kernel import turn  # noqa: E402
from bili_addon.kernel.fold import FoldConfig  # noqa: E402
from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.store import SessionBusy, StaleSession, Store  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)
from test_pg_trips import _same, _stored, held_keys, other, pg, refs, row  # noqa: E402


def free(c, key: int) -> bool:
    """Whether another connection gets the lock at once (and lets it go again)."""
    got = c.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
    if got:
        c.execute("SELECT pg_advisory_unlock(%s)", (key,))
    return got


def soon_free(c, key: int, timeout: float = 5.0) -> bool:
    """:func:`free` within ``timeout`` (an unlock sent without waiting for its answer: the server lets
    the lock go when it reads it, a moment later under load)."""
    import time

    end = time.monotonic() + timeout
    while not free(c, key):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


# -- the store ------------------------------------------------------------------------------------------
def test_a_commit_with_release_lets_the_lock_go_in_its_round_trip(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        with other(pg_url) as c:
            for i in range(1, 21):
                s.hold("r", ("fp", "anthropic") if i == 1 else None)
                pid = s._lock_conn.info.backend_pid
                assert held_keys(c, pid) == {PgStore.lock_key("r")}
                before = s.round_trips
                rows = refs(1, i)
                kw = dict(fresh=True) if i == 1 else dict(minted=[(rows[0].ref, rows[0].content_hash)])
                assert s.commit_turn(row("r", i + 1), rows, expect=i - 1, release=True, **kw) == i
                assert s.round_trips - before == 1  # the pipeline counts once
                # free at once: the unlock's answer was read with the commit's
                assert not s._held and not s._unlocking and held_keys(c, pid) == set()
                assert free(c, PgStore.lock_key("r"))
                assert c.execute("SELECT version FROM sessions WHERE id='r'").fetchone()[0] == i
                s.release()
                assert s.round_trips - before == 1  # nothing left to send
                assert s._lock_conn.info.backend_pid == pid  # (the same connection)
    finally:
        s.close()


def test_the_commit_ends_before_the_unlock_runs(pg_url, tmp_path):
    """Another instance waiting for the lock reads, once it has it, the turn the commit wrote."""
    from bili_addon.store_pg import PgStore

    key = PgStore.lock_key("o")
    s = pg(pg_url, tmp_path)
    try:
        with other(pg_url) as c:
            for i in range(1, 31):
                s.hold("o")
                seen = []

                def wait_then_read():
                    c.execute("SELECT pg_advisory_lock(%s)", (key,))  # waits for s's unlock
                    seen.append(c.execute("SELECT version FROM sessions WHERE id='o'").fetchone())
                    c.execute("SELECT pg_advisory_unlock(%s)", (key,))

                t = threading.Thread(target=wait_then_read)
                t.start()
                # (the other connection is waiting on the lock, or about to)
                c_pid = c.info.backend_pid
                with other(pg_url) as w:
                    for _ in range(200):
                        if w.execute("SELECT count(*) FROM pg_locks WHERE pid=%s AND NOT granted",
                                     (c_pid,)).fetchone()[0]:
                            break
                        threading.Event().wait(0.005)
                rows = refs(1, i)
                kw = dict(fresh=True) if i == 1 else dict(minted=[(rows[0].ref, rows[0].content_hash)])
                assert s.commit_turn(row("o", i + 1), rows, expect=i - 1, release=True, **kw) == i
                t.join(10)
                assert seen == [(i,)]
                s.release()
    finally:
        s.close()


def test_a_refused_commit_with_release_keeps_the_lock(pg_url, tmp_path):
    """Refused before its COMMIT: nothing written, the lock kept for the turn computed again (as a
    commit without the release), which then lets it go with its own commit."""
    from bili_addon.store_pg import PgStore

    a, b = pg(pg_url, tmp_path), pg(pg_url, tmp_path)
    try:
        a.hold("st")
        b.commit_turn(row("st"), refs(1), expect=0, fresh=True)  # written meanwhile (no lock taken)
        with pytest.raises(StaleSession) as e:
            a.commit_turn(row("st"), refs(1), expect=0, fresh=True, release=True)
        assert "(version 1, this process had 0)" in str(e.value)
        with other(pg_url) as c:
            pid = a._lock_conn.info.backend_pid  # (kept: a refusal is no broken connection)
            assert a._held == {"st"} and held_keys(c, pid) == {PgStore.lock_key("st")}
            assert a.version("st") == 1  # (read again: the refusal dropped what hold read)
            assert a.commit_turn(row("st", 3), refs(1, 2), expect=1, minted=[("m00002", "h2")], release=True) == 2
            assert not a._held and free(c, PgStore.lock_key("st"))
        a.release()
    finally:
        a.close()
        b.close()


def test_a_commit_with_release_on_a_lost_connection_is_a_store_error(pg_url, tmp_path):
    from bili_addon.store import StoreError

    s = pg(pg_url, tmp_path)
    try:
        s.hold("lost")
        pid = s._lock_conn.info.backend_pid
        with other(pg_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
            threading.Event().wait(0.2)
        with pytest.raises(StoreError) as e:
            s.commit_turn(row("lost"), refs(1), expect=0, fresh=True, release=True)
        assert e.value.kind == "unreachable" and not isinstance(e.value, StaleSession)
        assert s._lock_conn is None and not s._held
        s.release()
        s.hold("lost")  # a new connection
        assert s._lock_conn.info.backend_pid != pid
        s.release(wait=True)
    finally:
        s.close()


def test_release_is_ignored_where_the_commit_does_not_go_on_the_lock_connection(pg_url, tmp_path):
    """Not held (a pooled connection's commit), or more than one session held: the unlock stays release's."""
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        assert s.commit_turn(row("n"), refs(1), expect=0, fresh=True, release=True) == 1
        s.hold("n")
        s.hold("m")
        assert s.commit_turn(row("n", 3), refs(1, 2), expect=1, minted=[("m00002", "h2")], release=True) == 2
        with other(pg_url) as c:
            assert held_keys(c, s._lock_conn.info.backend_pid) == {PgStore.lock_key("n"), PgStore.lock_key("m")}
            s.release(wait=True)
            assert held_keys(c, s._lock_conn.info.backend_pid) == set()
    finally:
        s.close()


# -- a write after the commit let the lock go -------------------------------------------------------------
def _let_go(s, sid: str = "late") -> int:
    s.hold(sid)
    v = s.commit_turn(row(sid, flags='{"a": 1}'), refs(1), expect=0, fresh=True, release=True)
    assert not s._held and sid in s._let_go
    return v


def test_a_late_write_takes_the_lock_again(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        with other(pg_url) as c:
            for write in ("set_flags", "save_copy", "commit_turn"):
                sid = f"late-{write}"
                v = _let_go(s, sid)
                before = s.round_trips
                if write == "set_flags":
                    v2 = s.set_flags(row(sid, flags='{"a": 2}'), expect=v)
                elif write == "save_copy":
                    v2 = s.save_copy(sid, '{"ids": []}', expect=v)
                else:
                    v2 = s.commit_turn(row(sid, 3), refs(1, 2), expect=v, minted=[("m00002", "h2")])
                assert v2 == v + 1
                # held again for it (one round trip: the lock and its read), until release
                assert s._held == {sid} and not s._let_go
                assert held_keys(c, s._lock_conn.info.backend_pid) == {PgStore.lock_key(sid)}
                s.release(wait=True)
                assert free(c, PgStore.lock_key(sid)) and s.round_trips - before >= 3
        assert json.loads(s.session("late-set_flags").flags) == {"a": 2}
        assert s.copy("late-save_copy") == '{"ids": []}'
    finally:
        s.close()


def test_a_late_write_after_another_instances_turn_is_refused(pg_url, tmp_path):
    """The version check: another instance took the lock and committed between the unlock and the
    late write; the late write holds the lock again, then its version is refused (the turn is
    computed again), and nothing of it is written."""
    a, b = pg(pg_url, tmp_path), pg(pg_url, tmp_path)
    try:
        v = _let_go(a)
        b.hold("late")
        assert b.version("late") == v
        assert b.set_flags(row("late", flags='{"b": 1}'), expect=v) == v + 1
        b.release(wait=True)
        with pytest.raises(StaleSession):
            a.set_flags(row("late", flags='{"a": 2}'), expect=v)
        assert json.loads(a.session("late").flags) == {"b": 1}
        assert a._held == {"late"}  # (the turn computed again reads the version moved: it reloads)
        a.release()
    finally:
        a.close()
        b.close()


def test_a_late_write_while_another_instance_holds_the_session_waits_then_is_busy(pg_url, tmp_path):
    a, b = pg(pg_url, tmp_path, lock_wait=0.2), pg(pg_url, tmp_path)
    try:
        v = _let_go(a)
        b.hold("late")
        with pytest.raises(SessionBusy):
            a.set_flags(row("late", flags='{"a": 2}'), expect=v)
        assert json.loads(a.session("late").flags) == {"a": 1}
        b.release(wait=True)
        assert a.set_flags(row("late", flags='{"a": 2}'), expect=v) == v + 1  # (its next try)
        a.release()
    finally:
        a.close()
        b.close()


# -- the engine -----------------------------------------------------------------------------------------
def releases(monkeypatch, store) -> list:
    """The ``release`` argument of each of the store's ``commit_turn`` calls from now on, in order."""
    released: list = []
    real = store.commit_turn
    monkeypatch.setattr(store, "commit_turn",
                        lambda *a, **kw: (released.append(kw.get("release")), real(*a, **kw))[1])
    return released


def _engine(store) -> Engine:
    eng = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000))
    eng.lineage.defer = True
    return eng


def test_a_turn_lets_its_lock_go_with_its_commit(pg_url, tmp_path, monkeypatch):
    """First turns and follow-ups of the bench's conversation: two round trips a turn (the lock and
    its read, the commit and the unlock), the lock free when process returns, release sending nothing."""
    from bili_addon.store_pg import PgStore

    case = bench_overhead.Case("anthropic", 100, seed=5)
    eng = _engine(pg(pg_url, tmp_path))
    s = eng.store
    released = releases(monkeypatch, s)
    try:
        with other(pg_url) as c:
            msgs, h = list(case.msgs), {"x-acp-session": "lets-go"}
            for i in range(6):
                raw = case.unique_body() if i < 2 else case.body(msgs)
                hh = {"x-acp-session": f"first-{i}"} if i < 2 else h
                before = s.round_trips
                res = eng.process(raw, case.lane, hh, render=True)
                assert res.session and released[-1] is True
                assert s.round_trips - before == 2 and not s._held and not s._unlocking
                assert free(c, PgStore.lock_key(res.session))
                eng.lineage.flush()
                if i >= 2:
                    msgs.append(case.new(i))
    finally:
        s.close()


def _late_flag(monkeypatch, then=None):
    """Every turn writes a flag after its commit, which it said was its last write (a path the turn
    did not foresee); ``then`` runs right before the first such write."""
    monkeypatch.setattr(turn, "_writes_after", lambda *a: False)
    real = Engine._land
    first = [then] if then is not None else []

    def land(self, s, view, result, repeat=False):
        real(self, s, view, result, repeat)
        if first:
            first.pop()()
        self.set_flag(s.row.id, "late_probe", s.row.requests)

    monkeypatch.setattr(Engine, "_land", land)


@pytest.mark.parametrize("lane,n", [("anthropic", 60), ("chat", 40)])
def test_a_turn_that_writes_after_its_last_write_is_sqlites(pg_url, tmp_path, monkeypatch, lane, n):
    """A write the turn did not foresee after the commit that let the lock go: the lock is taken again
    for it, and the turns' bytes, results and rows are those of the SQLite store (which has no lock)."""
    from bili_addon.store_pg import PgStore

    _late_flag(monkeypatch)
    case = bench_overhead.Case(lane, n, seed=7)
    a, b = _engine(pg(pg_url, tmp_path / "pg")), _engine(Store(str(tmp_path / "sqlite")))
    try:
        with other(pg_url) as c:
            for k in range(2):
                sid = _same(a, b, case.unique_body(), case.lane, {"x-acp-session": f"first-{k}"})
                assert soon_free(c, PgStore.lock_key(sid)) and not a.store._held and not a.store._let_go
            trips = []
            real = a.process

            def counted(*args, **kw):
                before = a.store.round_trips
                try:
                    return real(*args, **kw)
                finally:
                    trips.append(a.store.round_trips - before)

            a.process = counted
            msgs, h = list(case.msgs), {"x-acp-session": "follow"}
            for i in range(3):
                sid = _same(a, b, case.body(msgs), case.lane, h)
                # hold, commit and unlock, hold again, the flag, the unlock
                assert trips[-1] == 5
                assert soon_free(c, PgStore.lock_key(sid))  # (release sends its unlock, not waited for)
                msgs.append(case.new(i))
            assert json.loads(a.store.session("follow").flags)["late_probe"] == 3
    finally:
        a.store.close()
        b.store.close()


def test_a_late_write_after_another_instances_turn_computes_the_turn_again(pg_url, tmp_path, monkeypatch):
    """Another instance's turn of the session lands between the unlock and the late write: the late
    write is refused (StaleSession) and the turn is computed again from the store, as any turn that
    found its session changed; nothing of the other instance's turn is lost."""
    case = bench_overhead.Case("anthropic", 40, seed=9)
    h = {"x-acp-session": "raced"}
    a, b = _engine(pg(pg_url, tmp_path / "a")), _engine(pg(pg_url, tmp_path / "b"))
    try:
        msgs = list(case.msgs)
        a.process(case.body(msgs), case.lane, h, render=True)
        a.lineage.flush()
        msgs.append(case.new(0))

        def other_turn():  # (b's own turn: it finds the lock free, commits, lets it go)
            s = b.sessions.load("raced", fresh=True)
            b.sessions.set_flag("raced", "other_instance", True)
            assert s.flags["other_instance"] is True
            b.store.release(wait=True)

        _late_flag(monkeypatch, other_turn)
        commits = []
        real = a.store.commit_turn
        monkeypatch.setattr(a.store, "commit_turn", lambda *x, **kw: (commits.append(kw["expect"]), real(*x, **kw))[1])
        res = a.process(case.body(msgs), case.lane, h, render=True)
        assert res.session == "raced" and res.body is not None
        assert commits == [1, 3]  # computed again from the other instance's version (its flag: 2)
        flags = json.loads(a.store.session("raced").flags)
        assert flags["other_instance"] is True and "late_probe" in flags
        assert not a.store._held and not a.store._let_go
        stored = _stored(a.store, "raced")
        assert stored == _stored(b.store, "raced")
    finally:
        a.store.close()
        b.store.close()


def test_a_big_commit_with_release(pg_url, tmp_path):
    """A commit bigger than libpq's buffers (a long conversation's first turn): sent in parts, its
    answer and the unlock's read; the rows are stored, the lock free."""
    from bili_addon.store_pg import PgStore

    s = pg(pg_url, tmp_path)
    try:
        rows = refs(6000)
        s.hold("big")
        assert s.commit_turn(row("big", 6001), rows, (3, "t" * 5000), expect=0, fresh=True, release=True) == 1
        with other(pg_url) as c:
            assert free(c, PgStore.lock_key("big"))
        s.release()
        assert sorted(s.ledger("big"), key=lambda r: r.ref) == rows
    finally:
        s.close()


def test_a_database_without_temporary_objects_releases_as_before(pg_url, tmp_path, monkeypatch):
    """No procedure on the lock connection (a database that refuses temporary objects): the commit
    goes alone, release sends the unlock."""
    from bili_addon import store_pg

    monkeypatch.setattr(store_pg, "_COMMIT_RELEASE_PROC", "CREATE PROCEDURE no_such_schema.p() LANGUAGE sql AS $$ $$")
    s = pg(pg_url, tmp_path)
    try:
        assert not s._lock_proc
        s.hold("np")
        assert s.commit_turn(row("np"), refs(1), expect=0, fresh=True, release=True) == 1
        assert s._held == {"np"}
        before = s.round_trips
        s.release(wait=True)
        assert s.round_trips - before == 1
        with other(pg_url) as c:
            assert free(c, s.lock_key("np"))
    finally:
        s.close()


def test_a_turn_that_foresees_its_flag_keeps_the_lock_for_it(pg_url, tmp_path, monkeypatch):
    """An agent with bili's tools natively: its first turn writes the native-tools flag after the
    flush, which the turn foresees (no release with the commit: the flag is written under the lock,
    not after taking it again); its next turn (the flag set) lets the lock go with its commit."""
    from bili_addon.store_pg import PgStore

    case = bench_overhead.Case("anthropic", 30, seed=4)
    eng = _engine(pg(pg_url, tmp_path))
    s = eng.store
    released = releases(monkeypatch, s)

    def with_bili_tools(raw: bytes) -> bytes:
        body = json.loads(raw)
        body["tools"].append({"name": "mcp__bili__compress", "description": "fold", "input_schema": {"type": "object"}})
        return json.dumps(body).encode()

    try:
        msgs, h = list(case.msgs), {"x-acp-session": "native"}
        with other(pg_url) as c:
            for i, (want, trips) in enumerate([(False, 4), (True, 2)]):
                before = s.round_trips
                res = eng.process(with_bili_tools(case.body(msgs)), case.lane, h, render=True)
                assert released[-1] is want and s.round_trips - before == trips, (i, released, s.round_trips - before)
                # (the commit's unlock is done when process returns; release's own is sent, not waited for)
                assert (free(c, PgStore.lock_key("native")) if want else soon_free(c, PgStore.lock_key("native")))
                assert not s._held and not s._let_go
                eng.lineage.flush()
                msgs.append(case.new(i))
        assert json.loads(s.session("native").flags)["native_tools"] is True and res.session == "native"
    finally:
        s.close()


def test_a_text_holding_a_nul_is_refused_before_libpq_cuts_it(pg_url, tmp_path):
    """libpq sends a text parameter up to its first NUL: ``hold("victim\\0x")`` locked and read
    ``victim``, and its commit wrote there.  Refused before anything is sent (the turn passes
    unchanged); no lock taken, the victim untouched, and the connection still serves the next turn."""
    s = pg(pg_url, tmp_path)
    c = other(pg_url)
    try:
        s.hold("victim")
        s.commit_turn(row("victim", 4), refs(3), expect=0, fresh=True, release=True)
        s.release(wait=True)
        before = [(r.msg_id, r.ref) for r in s.ledger("victim")]
        with pytest.raises(ValueError, match="NUL"):
            s.hold("victim\0other")
        assert free(c, s.lock_key("victim"))
        with pytest.raises(ValueError, match="NUL"):
            s.save_lineage_parts("victim\0other", 0, [("m00001", "h", "fp")])
        s.hold("victim")  # the same connection, the next turn
        assert s.version("victim") == 1
        s.release(wait=True)
        assert [(r.msg_id, r.ref) for r in s.ledger("victim")] == before
    finally:
        c.close()
        s.close()


@pytest.mark.parametrize("blocker_sql", [
    "LOCK TABLE turns IN ACCESS EXCLUSIVE MODE",  # (a VACUUM FULL, a LOCK TABLE)
    "ALTER TABLE sessions ADD COLUMN IF NOT EXISTS future BIGINT NOT NULL DEFAULT 0",  # a newer instance's migration
])
def test_a_hold_whose_read_waits_past_the_timeout_lets_its_lock_go(pg_url, tmp_path, blocker_sql):
    """bili_hold takes the session's lock, then reads the session's tables: a read that waits on a
    table's lock past ``lock_wait`` fails the statement (SessionBusy: the turn passes), but the
    session's lock outlived it, and nothing would ever let it go: every other instance found the
    session busy from then on."""
    import psycopg

    from bili_addon.store_pg import PgStore

    a = PgStore(pg_url, str(tmp_path / "a"), lock_wait=0.5)
    b = PgStore(pg_url, str(tmp_path / "b"), lock_wait=0.5)
    c = other(pg_url)
    blocker = psycopg.connect(pg_url)  # (its transaction holds the table's lock until it ends)
    try:
        blocker.execute(blocker_sql)
        with pytest.raises(SessionBusy):
            a.hold("S")
        blocker.rollback()
        a.release(wait=True)  # (the keeper's, after the failed turn: it has nothing to send)
        assert free(c, a.lock_key("S"))
        b.hold("S")  # another instance serves the session
        b.release(wait=True)
        a.hold("S")  # and this one still does, on its connection
        a.release(wait=True)
    finally:
        blocker.close()
        c.close()
        a.close()
        b.close()


def test_a_store_of_a_newer_schema_is_refused_without_leaving_its_pool_open(pg_url, tmp_path):
    """The keeper tries the store again every few seconds while requests come: each refused open
    left its pool (a connection and its threads) behind."""
    import threading

    import psycopg

    from bili_addon.store import StoreError
    from bili_addon.store_pg import PgStore

    PgStore(pg_url, str(tmp_path)).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    threads = threading.active_count()
    kept = []
    for _ in range(3):
        with pytest.raises(StoreError, match="newer") as e:
            PgStore(pg_url, str(tmp_path))
        kept.append(e.value)  # (as the keeper keeps its last error: the store it came from stays reachable)
    assert threading.active_count() == threads
    import time

    with psycopg.connect(pg_url, autocommit=True) as c:
        deadline = time.monotonic() + 10  # (a closed connection's backend leaves a moment later; a leaked one never)
        while True:
            mine = c.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type='client backend' "
                             "AND pid <> pg_backend_pid() AND datname = current_database()").fetchone()[0]
            if mine == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert mine == 0
