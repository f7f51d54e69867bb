"""A turn asks PostgreSQL for its session's lock before it reads the request, and takes the answer
when it needs the session (bili_addon/store_pg.py ``hold_soon``, kernel/turn.py ``Engine._soon``): the
round trip (the database's work of a new session's hold, its fork candidates with it) goes on while the
turn reads the request, not after.  What a turn sends, stores and refuses is what it was when it asked
at that point: the same bytes, rows and round trips, the fork key read from the first items alone, a
session held elsewhere busy, and a turn that ends before it holds its session leaves nothing held."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel.lineage import Lineage
from bili_addon.kernel.state import ItemCache, head_cores
from bili_addon.kernel.turn import _system_run
from bili_addon.store import SessionBusy, Store, StoreError
from bili_addon.wire import LANES

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)
from oracle_runs import capture_turns  # noqa: E402


# -- the fork key from the first items (no database) ----------------------------------------------------
def _key_both_ways(tmp_path, lane_name: str, raws: list[bytes], sid: str = "s"):
    """``(what head_of says from the first items, what head says of the pass's items)``."""
    lane = LANES[lane_name]
    store = Store(str(tmp_path / "k"))
    try:
        lineage = Lineage(store)
        head = head_cores(lane, raws)  # (None: the first items do not say; False below)
        early = False if head is None else lineage.head_of(sid, *head, lane.name)
        # (as a first pass reads them: the array in one decode, the lane's typed structs where they hold it)
        infos = ItemCache().get_many(lane, [msgspec.Raw(r) for r in raws], [], b"[" + b",".join(raws) + b"]")
        return early, lineage.head(sid, infos[_system_run(infos):], lane.name)
    finally:
        store.close()


def _items(body: bytes, lane_name: str) -> list[bytes]:
    return [msgspec.json.encode(x) for x in msgspec.json.decode(body)[LANES[lane_name].conv_key]]


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_the_fork_key_read_from_the_first_items_is_the_passes(tmp_path, lane):
    case = bench_overhead.Case(lane, 40, seed=5)
    raws = _items(case.unique_body(), lane)
    early, full = _key_both_ways(tmp_path, lane, raws)
    assert full is not None and early == full


def test_the_fork_key_of_the_captures_is_the_passes(tmp_path):
    seen = 0
    for lane, _headers, body in capture_turns():
        raws = _items(body, lane)
        early, full = _key_both_ways(tmp_path, lane, raws)
        assert early in (full, False), (lane, body[:200])
        seen += full is not None
    assert seen > 5  # (conversations with an answer: their key was read and compared)


def test_the_fork_key_of_odd_openings(tmp_path):
    """System items before the conversation, an opening answer whose prose carries a replayed tag
    (cleaned as the pass cleans it), no answer at all, and an answer only after the items read early."""
    sys_first = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Rules."},
                 {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    early, full = _key_both_ways(tmp_path, "chat", [msgspec.json.encode(m) for m in sys_first])
    assert full is not None and early == full
    tagged = [{"role": "assistant", "content": '<acp tokens="3" type="text">m00001</acp>\nI looked.'},
              {"role": "user", "content": "And?"}]
    early, full = _key_both_ways(tmp_path, "anthropic", [msgspec.json.encode(m) for m in tagged])
    assert full is not None and early == full
    unanswered = [{"role": "user", "content": f"note {i}"} for i in range(5)]
    assert _key_both_ways(tmp_path, "anthropic", [msgspec.json.encode(m) for m in unanswered]) == (None, None)
    late = [{"role": "user", "content": f"note {i}"} for i in range(12)] + [{"role": "assistant", "content": "ok"}]
    early, full = _key_both_ways(tmp_path, "anthropic", [msgspec.json.encode(m) for m in late])
    assert early is False and full is not None  # (not said early: the turn asks when it has read them)


# -- on PostgreSQL ------------------------------------------------------------------------------------
pytest.importorskip("psycopg")

from test_pg_release import free, soon_free  # noqa: E402
from test_pg_trips import _engine, _stored, other, pg  # noqa: E402


def _turns(pg_url, tmp_path, n: int, seed: int, **kw):
    """A PostgreSQL store, an engine on it, and the bench's conversation of ``n`` messages."""
    store = pg(pg_url, tmp_path, **kw)
    return store, _engine(store), bench_overhead.Case("anthropic", n, seed=seed)


def _no_early(store):
    """The store as a turn meets it when it does not ask early (the turn asks as it did before)."""
    store.hold_soon = None  # (an instance attribute: the engine looks it up per turn)
    return store


def test_a_turns_lock_is_asked_before_its_request_is_read_and_taken_after(pg_url, tmp_path, monkeypatch):
    from bili_addon.store_pg import PgStore

    store = pg(pg_url, tmp_path)
    eng = _engine(store)
    events: list = []
    soon, answer, get_many = PgStore.hold_soon, PgStore._answer_of, ItemCache.get_many
    monkeypatch.setattr(PgStore, "hold_soon", lambda self, sid, c=None: (events.append(("asked", sid, c)),
                                                                        soon(self, sid, c))[1])
    monkeypatch.setattr(PgStore, "_answer_of", lambda self, conn: (events.append("answered"), answer(self, conn))[1])
    monkeypatch.setattr(ItemCache, "get_many", lambda self, *a, **k: (events.append("read"), get_many(self, *a, **k))[1])
    case = bench_overhead.Case("anthropic", 30, seed=2)
    raw = case.unique_body()
    try:
        res = eng.process(raw, case.lane, {"x-acp-session": "early"}, render=True)
        assert res.refs_new > 0
        assert events[:3] == [("asked", "early", events[0][2]), "read", "answered"], events
        infos = get_many(ItemCache(), case.lane, [msgspec.Raw(r) for r in _items(raw, "anthropic")])
        assert events[0][2] == Lineage(store).head("early", infos, "anthropic") is not None  # (its fork key)
        events.clear()
        eng.write_pending()
        eng.process(case.body(case.msgs[:10]), case.lane, {"x-acp-session": "early"}, render=True)
        assert events[0] == ("asked", "early", None) and "answered" in events  # (a session it knows: no key)
    finally:
        store.close()


def _both(pg_url, pg_server, tmp_path):
    """Two engines on stores of their own: one asks for its lock early, the other when it needs it."""
    return (_engine(pg(pg_url, tmp_path / "a")), _engine(_no_early(pg(pg_server.fresh(), tmp_path / "b"))))


def test_early_holds_give_what_holds_gave(pg_url, pg_server, tmp_path):
    """The bench's conversations and a fork of one of them (its candidates read with the early hold):
    the same outgoing bytes, results, stored rows and round trips as turns that ask for the lock when
    they need it."""
    from test_pg_trips import _same

    a, b = _both(pg_url, pg_server, tmp_path)
    try:
        for lane, n in (("anthropic", 60), ("chat", 40), ("responses", 40)):
            case = bench_overhead.Case(lane, n, seed=9)
            msgs = list(case.msgs)
            h = {"x-acp-session": f"conv-{lane}"}
            for i in range(3):
                _same(a, b, case.body(msgs), case.lane, h)
                msgs.append(case.new(i))
            trips = (a.store.round_trips, b.store.round_trips)
            ra = a.process(case.body(msgs[:30]), case.lane, {"x-acp-session": f"fork-{lane}"}, render=True)
            rb = b.process(case.body(msgs[:30]), case.lane, {"x-acp-session": f"fork-{lane}"}, render=True)
            assert (ra.body, ra.notes, ra.refs_new, ra.refs_known) == (rb.body, rb.notes, rb.refs_new, rb.refs_known)
            assert any(n.startswith("a fork of conv-") for n in ra.notes), ra.notes  # (its candidates read)
            for e in (a, b):
                e.lineage.flush()
            assert _stored(a.store, f"fork-{lane}") == _stored(b.store, f"fork-{lane}")
            assert a.store.round_trips - trips[0] == b.store.round_trips - trips[1]
    finally:
        a.store.close()
        b.store.close()


def test_early_holds_of_the_captures_give_what_holds_gave(pg_url, pg_server, tmp_path):
    from test_pg_trips import _same

    turns = capture_turns()  # (skipped where there are none: the bench's conversations above run anyway)
    a, b = _both(pg_url, pg_server, tmp_path)
    try:
        for lane, headers, body in turns:
            _same(a, b, body, LANES[lane], headers)
    finally:
        a.store.close()
        b.store.close()


def test_a_session_held_elsewhere_is_busy_and_its_early_hold_keeps_nothing(pg_url, tmp_path):
    from bili_addon.store_pg import PgStore

    store, eng, case = _turns(pg_url, tmp_path, 20, 4, lock_wait=0.2)
    raw = case.unique_body()
    try:
        with other(pg_url) as c:
            c.execute("SELECT pg_advisory_lock(%s)", (PgStore.lock_key("busy"),))
            with pytest.raises(SessionBusy):
                eng.process(raw, case.lane, {"x-acp-session": "busy"}, render=True)
            assert not store._held and store._soon is None
            c.execute("SELECT pg_advisory_unlock_all()")
            res = eng.process(raw, case.lane, {"x-acp-session": "busy"}, render=True)
            assert res.refs_new > 0 and res.body
            eng.write_pending()
            assert soon_free(c, PgStore.lock_key("busy"))
            assert store.session_state("busy")[0] is not None
    finally:
        store.close()


def test_a_turn_that_ends_before_it_holds_its_session_lets_the_early_hold_go(pg_url, tmp_path, monkeypatch):
    from bili_addon.store_pg import PgStore

    store, eng, case = _turns(pg_url, tmp_path, 20, 6)
    raw = case.unique_body()

    def broken(*a, **k):
        raise RuntimeError("read failed")
    try:
        eng.process(bench_overhead.Case("anthropic", 8, seed=1).unique_body(), case.lane, {"x-acp-session": "w"},
                    render=True)
        eng.write_pending()
        pid = store._lock_conn.info.backend_pid
        with other(pg_url) as c:
            with monkeypatch.context() as m:
                m.setattr(eng.items, "get_many", broken)
                with pytest.raises(RuntimeError):
                    eng.process(raw, case.lane, {"x-acp-session": "ends"}, render=True)
            assert store._soon is None and not store._held
            assert store._lock_conn.info.backend_pid == pid  # (the connection goes on: nothing to open again)
            assert soon_free(c, PgStore.lock_key("ends"))  # (asked, granted, then let go)
            assert store.session_state("ends")[0] is None  # nothing of it written
            res = eng.process(raw, case.lane, {"x-acp-session": "ends"}, render=True)  # the connection goes on
            assert res.refs_new > 0
            eng.write_pending()
            assert store.session_state("ends")[0] is not None
    finally:
        store.close()


def test_an_early_hold_on_a_lost_connection_is_a_store_error_then_a_new_one(pg_url, tmp_path):
    store, eng, case = _turns(pg_url, tmp_path, 20, 8)
    try:
        eng.process(case.unique_body(), case.lane, {"x-acp-session": "lost-0"}, render=True)
        eng.write_pending()
        store.release(wait=True)
        pid = store._lock_conn.info.backend_pid
        with other(pg_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
        raw = case.unique_body()
        with pytest.raises(StoreError) as e:
            eng.process(raw, case.lane, {"x-acp-session": "lost-1"}, render=True)
        assert e.value.kind == "unreachable" and store._soon is None
        res = eng.process(raw, case.lane, {"x-acp-session": "lost-1"}, render=True)
        assert res.refs_new > 0
        eng.write_pending()
        assert store.session_state("lost-1")[0] is not None
    finally:
        store.close()


# -- what review found (session 24) ----------------------------------------------------------------------
def _connects(monkeypatch) -> list:
    import psycopg

    opened: list = []
    real = psycopg.connect
    monkeypatch.setattr(psycopg, "connect", lambda *a, **k: (opened.append(1), real(*a, **k))[1])
    return opened


def test_a_lock_connection_to_open_is_opened_by_the_hold_once(pg_url, tmp_path, monkeypatch):
    """A turn whose lock connection went (its unlock could not be sent) while the database does not
    answer tries it once, as before (each try is a connect timeout on the worker)."""
    import socket

    store, eng, case = _turns(pg_url, tmp_path, 12, 3)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))  # (bound, not listening: the connection is refused at once)
        try:
            eng.process(case.unique_body(), case.lane, {"x-acp-session": "c0"}, render=True)
            eng.write_pending()
            store.release(wait=True)
            store._drop_lock_conn()
            store.url = f"postgresql://u@127.0.0.1:{hole.getsockname()[1]}/db"
            opened = _connects(monkeypatch)
            with pytest.raises(StoreError):
                eng.process(case.unique_body(), case.lane, {"x-acp-session": "c1"}, render=True)
            assert len(opened) == 1
        finally:
            store.close()


def test_a_big_opening_is_left_to_the_pass_and_the_fork_key_is_computed_once(pg_url, tmp_path, monkeypatch):
    from bili_addon.kernel import lineage
    from bili_addon.kernel.state import HEAD_BYTES
    from bili_addon.store_pg import PgStore

    store = pg(pg_url, tmp_path)
    eng = _engine(store)
    asked: list = []
    soon = PgStore.hold_soon
    monkeypatch.setattr(PgStore, "hold_soon", lambda self, sid, c=None: (asked.append(sid), soon(self, sid, c))[1])
    prints: list = []
    fingerprint = lineage.fingerprint
    monkeypatch.setattr(lineage, "fingerprint", lambda core: (prints.append(1), fingerprint(core))[1])
    answer = {"role": "assistant", "content": "Read."}
    try:
        big = [{"role": "user", "content": "x" * (HEAD_BYTES + 1)}, answer, {"role": "user", "content": "Next?"}]
        res = eng.process(json.dumps({"model": "m", "messages": big}).encode(), LANES["anthropic"],
                          {"x-acp-session": "big"}, render=True)
        assert res.refs_new == 3 and asked == []  # (the hold asked when the pass needs it, as before)
        eng.write_pending()
        eng.lineage.flush()  # (its record stored: no other conversation's opening read below)
        small = [{"role": "user", "content": "Look at the parser, please."}, answer, {"role": "user", "content": "Next?"}]
        prints.clear()
        eng.process(json.dumps({"model": "m", "messages": small}).encode(), LANES["anthropic"],
                    {"x-acp-session": "small"}, render=True)
        assert asked == ["small"] and len(prints) == 1  # (early, and its fingerprint not computed again)
    finally:
        store.close()


def test_the_lineage_on_the_lock_connection_reads_the_early_holds_answer_first(pg_url, tmp_path):
    store = pg(pg_url, tmp_path)
    try:
        store.hold("warm")
        store.release(wait=True)
        store.hold_soon("S")
        store.save_lineage_parts("T", 0, [("m00001", "c" * 64, "f" * 32)])
        store.hold("S")  # (its answer was read when the lineage went: the session is held)
        assert "S" in store._held and store._soon is None
        assert store.lineage_parts("T") == [("m00001", "c" * 64, "f" * 32)]
        store.release(wait=True)
    finally:
        store.close()


def test_a_turn_ended_before_its_session_was_granted_does_not_wait_for_it(pg_url, tmp_path):
    """The early hold of a session another instance holds is still waiting when the turn's release
    comes: the statement is cancelled (not waited out for ``lock_wait``), the connection stays, and
    nothing of it is left in the lock's queue (the other instance's unlock frees the lock)."""
    from bili_addon.store_pg import PgStore

    store = pg(pg_url, tmp_path, lock_wait=30)
    try:
        store.hold("warm")
        store.release(wait=True)
        pid = store._lock_conn.info.backend_pid
        key = PgStore.lock_key("taken")
        with other(pg_url) as c:
            c.execute("SELECT pg_advisory_lock(%s)", (key,))
            store.hold_soon("taken")
            store.release(wait=True)
            assert store._soon is None and not store._held and store._lock_conn.info.backend_pid == pid
            waiting = c.execute("SELECT count(*) FROM pg_locks WHERE locktype='advisory' AND NOT granted").fetchone()[0]
            assert waiting == 0
            c.execute("SELECT pg_advisory_unlock_all()")
            assert free(c, key)  # (no backend of ours queued for it: the lock is free)
        store.hold("taken")
        assert "taken" in store._held and store._lock_conn.info.backend_pid == pid
        store.release(wait=True)
    finally:
        store.close()


def test_a_session_id_the_connection_cannot_carry_does_not_reopen_it(pg_url, tmp_path, monkeypatch):
    store, eng, case = _turns(pg_url, tmp_path, 12, 3)
    sid = b"sess-\xff".decode("utf-8", "surrogateescape")  # (a header's byte that is not UTF-8)
    try:
        eng.process(case.unique_body(), case.lane, {"x-acp-session": "ok"}, render=True)
        eng.write_pending()
        opened = _connects(monkeypatch)
        for _ in range(3):
            with pytest.raises(UnicodeError):
                eng.process(case.unique_body(), case.lane, {"x-acp-session": sid}, render=True)
        assert opened == []
    finally:
        store.close()
