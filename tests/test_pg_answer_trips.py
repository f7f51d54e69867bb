"""An answer's bookkeeping on PostgreSQL in one round trip per record (bili_addon/store_pg.py): the
usage (the session's totals and its turn's row), the wire figures and the cache observation.  Each
was a transaction of its own (BEGIN, one or two statements, COMMIT: four round trips), on the
proxy's one store worker, after every answer.  The rows and numbers are the same as before and as
the SQLite store's; a number taken by another instance meanwhile is numbered again under the lock,
as every instance (of this version or an older one) numbers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("psycopg")

from bili_addon.store import CalibrationRow, LedgerRow, SessionRow, WireTurn  # noqa: E402


def pg(url, tmp_path):
    from bili_addon.store_pg import PgStore

    return PgStore(url, str(tmp_path))


def wire_row(k: int) -> WireTurn:
    return WireTurn(0, 1000.0 + k, k, "claude-x", 100 + k, 90, None, 0, 0, ["compress"] if k % 2 else [], 90, 3, 4, 1)


def cal_row(k: int) -> CalibrationRow:
    return CalibrationRow(0, 1.0 + k, "api.example", "anthropic", "anthropic", 2.5, 10.0, 100 + k, 80, 20, 100, 80 + k,
                          None if k % 2 else 20)


def session(s, sid: str) -> int:
    return s.commit_turn(SessionRow(sid, "a", "anthropic", 1.0, 1.0, 1, 1, 2),
                         [LedgerRow("h", "aa", "m00001", "user", "text", 1)], expect=0, minted=[("m00001", "aa")])


def test_each_record_of_an_answer_is_one_round_trip(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        session(s, "x")
        for call, expect in ((lambda: s.record_usage("x", "anthropic", (10, 5, 2, 1)), None),
                             (lambda: s.record_wire("x", wire_row(0)), 1),
                             (lambda: s.record_calibration("x", cal_row(0)), 1),
                             (lambda: s.record_wire("x", wire_row(1)), 2)):
            before = s.round_trips
            assert call() == expect
            assert s.round_trips - before == 1
    finally:
        s.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "answer"])
def test_the_records_read_back_as_the_sqlite_store_reads_them(pg_url, tmp_path, batched):
    """The same answers recorded in both stores, each record on its own (three round trips) or made
    inside ``answer()`` (one; the SQLite store's ``answer()`` changes nothing): the same usage totals
    and turns, wire rows and observations, numbered alike."""
    from contextlib import nullcontext

    from bili_addon.store import Store

    s = pg(pg_url, tmp_path)
    store = Store(tmp_path / "lite")
    try:
        for st in (s, store):
            session(st, "x")
            for k in range(5):
                before = getattr(st, "round_trips", 0)
                with st.answer() if batched else nullcontext():
                    st.record_usage("x", "anthropic" if k % 2 else "chat", (100 * k, 50 * k, k, 7))
                    st.record_calibration("x", cal_row(k))
                    assert st.record_wire("x", wire_row(k)) == k + 1
                if st is s:
                    assert s.round_trips - before == (1 if batched else 3)
            with st.answer() if batched else nullcontext():  # an answer without wire figures
                st.record_usage("x", "anthropic", (1, 2, 3, 4))
                st.record_calibration("x", cal_row(9))
            st.record_usage("nobody", "anthropic", (1, 1, 1, 1))  # no session row: nothing recorded
        assert s.last_usage("x") == store.last_usage("x") == (1, 2, 3, 4)
        assert s.last_usage("nobody") is store.last_usage("nobody") is None
        assert s.usage("x") == store.usage("x") and s.usage("x").turns == 6
        assert s.wire("x") == store.wire("x") and [w.n for w in s.wire("x")] == [1, 2, 3, 4, 5]
        assert s.calibration("x") == store.calibration("x") and [r.n for r in s.calibration("x")] == [1, 2, 3, 4, 5, 6]
        assert s.calibration_totals("x") == store.calibration_totals("x")
        assert s.wire_totals("x") == store.wire_totals("x")
    finally:
        s.close()
        store.close()


def test_a_number_taken_meanwhile_is_given_again_under_the_lock(pg_url, tmp_path):
    """Another instance's row, inserted but not yet committed when the one statement read the
    session's numbers: the statement waits for it, inserts nothing, and the row is numbered after
    it under the lock (two statements of a transaction: four round trips more)."""
    import psycopg

    s = pg(pg_url, tmp_path)
    other = psycopg.connect(pg_url)
    try:
        for table, record, row in (("wire", s.record_wire, wire_row(0)),
                                   ("calibration", s.record_calibration, cal_row(0))):
            sid = f"race-{table}"
            cols = ("n, ts, request, model, agent_tokens, sent_tokens, blocks, folded, executed, input_tokens, "
                    "cache_read, cache_write, output_tokens") if table == "wire" else (
                "n, ts, host, family, lane, predicted_input, predicted_read, predicted_write, reported_read")
            vals = "1, 0, 0, 'm', 1, 1, 0, 0, '', 1, 1, 1, 1" if table == "wire" else "1, 0, '', '', '', 1, 1, 1, 1"
            other.execute(f"INSERT INTO {table}(session_id, {cols}) VALUES(%s, {vals})", (sid,))  # open transaction
            got: list = []
            before = s.round_trips
            t = threading.Thread(target=lambda: got.append(record(sid, row)))
            t.start()
            time.sleep(0.3)  # (the statement is waiting for the other transaction's row; not a timing assertion)
            assert not got
            other.commit()
            t.join(10)
            assert got == [2]
            assert s.round_trips - before == 5
            ns = [r[0] for r in s._q(f"SELECT n FROM {table} WHERE session_id=%s ORDER BY n", (sid,))]
            assert ns == [1, 2]
    finally:
        other.close()
        s.close()


@pytest.mark.parametrize("table", ["wire", "calibration"])
def test_answers_recorded_at_once_by_several_instances_are_numbered_once_each(backend, table):
    """Four instances (four openings of one store, each used by its own thread) recording answers of
    one session at the same time: every row gets its own number, 1..N, and nothing is lost."""
    instances, each = [backend() for _ in range(4)], 12

    def answer(k: int) -> list[int]:
        st = instances[k]
        if table == "wire":
            return [st.record_wire("busy", wire_row(k * each + i)) for i in range(each)]
        return [st.record_calibration("busy", cal_row(k * each + i)) for i in range(each)]

    with ThreadPoolExecutor(len(instances)) as pool:
        given = [n for ns in pool.map(answer, range(len(instances))) for n in ns]
    total = len(instances) * each
    assert sorted(given) == list(range(1, total + 1))
    reader = backend()
    if table == "wire":
        rows = reader.wire("busy")
        assert [w.n for w in rows] == list(range(1, total + 1))
        assert sorted(w.request for w in rows) == list(range(total))
    else:
        rows = reader.calibration("busy")
        assert [r.n for r in rows] == list(range(1, total + 1))
        assert sorted(r.predicted_input for r in rows) == [100 + k for k in range(total)]


def test_usage_recorded_at_once_by_several_instances_counts_every_answer(backend):
    """The totals' update numbers the turn: answers of one session recorded at once through four
    instances are each counted once, and each has its turn's row."""
    instances, each = [backend() for _ in range(4)], 10
    session(instances[0], "u")

    def answer(k: int) -> None:
        for i in range(each):
            instances[k].record_usage("u", "anthropic", (1, 2, 3, 4))

    with ThreadPoolExecutor(len(instances)) as pool:
        list(pool.map(answer, range(len(instances))))
    reader = backend()
    totals = reader.usage("u")
    n = len(instances) * each
    assert (totals.turns, totals.input_tokens, totals.cache_read, totals.cache_write, totals.output_tokens) == (
        n, n, 2 * n, 3 * n, 4 * n)
    assert reader.last_usage("u") == (1, 2, 3, 4)
    rows = (reader.db.execute if reader.backend == "sqlite" else reader._q)(
        "SELECT n, input_tokens, cache_read, cache_write, output_tokens FROM turns WHERE session_id='u' ORDER BY n")
    rows = [tuple(r) for r in rows]
    assert rows == [(n, 1, 2, 3, 4) for n in range(1, len(instances) * each + 1)]


# -- one answer's records as one statement (PgStore.answer) -----------------------------------------------
def test_anything_else_sent_inside_an_answer_goes_after_what_was_queued(pg_url, tmp_path):
    """A read (or another write) inside ``answer()`` sees the records queued before it: they go first."""
    s = pg(pg_url, tmp_path)
    try:
        session(s, "x")
        s.hold("x")  # (its read answers last_usage until this instance writes)
        assert s.last_usage("x") is None
        with s.answer():
            s.record_usage("x", "anthropic", (10, 5, 2, 1))
            assert s.last_usage("x") == (10, 5, 2, 1)  # the queue went before the read
            s.record_calibration("x", cal_row(0))
            assert [r.n for r in s.calibration("x")] == [1]
            s.record_calibration("x", cal_row(1))  # two of a kind: the first goes before the second is queued
            s.record_calibration("x", cal_row(2))
        assert [r.n for r in s.calibration("x")] == [1, 2, 3]
        s.release()
    finally:
        s.close()


def test_what_was_queued_goes_even_when_the_work_after_it_fails(pg_url, tmp_path):
    s = pg(pg_url, tmp_path)
    try:
        session(s, "x")
        with pytest.raises(RuntimeError):
            with s.answer():
                s.record_usage("x", "anthropic", (10, 5, 2, 1))
                raise RuntimeError("the meter failed")
        assert s.last_usage("x") == (10, 5, 2, 1)
    finally:
        s.close()


def test_a_number_taken_meanwhile_inside_an_answer_is_given_again_under_the_lock(pg_url, tmp_path):
    import psycopg

    s = pg(pg_url, tmp_path)
    other = psycopg.connect(pg_url)
    try:
        session(s, "x")
        other.execute("INSERT INTO wire(session_id, n, ts, request, model, agent_tokens, sent_tokens, blocks, folded, "
                      "executed, input_tokens, cache_read, cache_write, output_tokens) "
                      "VALUES('x', 1, 0, 0, 'm', 1, 1, 0, 0, '', 1, 1, 1, 1)")  # open transaction
        got: list = []

        def answer():
            with s.answer():
                s.record_usage("x", "anthropic", (10, 5, 2, 1))
                s.record_calibration("x", cal_row(0))
                got.append(s.record_wire("x", wire_row(0)))

        t = threading.Thread(target=answer)
        t.start()
        time.sleep(0.3)  # (the statement waits for the other transaction's row; not a timing assertion)
        assert not got
        other.commit()
        t.join(10)
        assert got == [2]
        assert [w.n for w in s.wire("x")] == [1, 2]
        assert [r.n for r in s.calibration("x")] == [1] and s.last_usage("x") == (10, 5, 2, 1)
    finally:
        other.close()
        s.close()


def test_an_answers_lineage_goes_with_its_records(pg_url, tmp_path):
    """The lineage its request kept back (``save_lineage_parts``, made inside ``answer()``) is part of
    the answer's one statement, and the store has the parts as the statement of its own leaves them."""
    s, alone = pg(pg_url, tmp_path), None
    try:
        session(s, "x")
        parts = [(f"m{i:05d}", f"h{i}", f"fp{i}é") for i in range(1, 6)]
        before = s.round_trips
        with s.answer():
            s.save_lineage_parts("x", 0, parts)
            s.record_usage("x", "anthropic", (10, 5, 2, 1))
            assert s.record_wire("x", wire_row(0)) == 1
        assert s.round_trips - before == 1
        with s.answer():  # the next turn replaces the parts from the third on
            s.save_lineage_parts("x", 2, parts[2:3])
        got = s.lineage_parts("x")
        from bili_addon.store_pg import PgStore

        alone = PgStore(pg_url, str(tmp_path))
        alone.save_lineage_parts("y", 0, parts)
        alone.save_lineage_parts("y", 2, parts[2:3])
        assert [tuple(r) for r in got] == [tuple(r) for r in alone.lineage_parts("y")] == [*parts[:2], parts[2]]
    finally:
        s.close()
        if alone is not None:
            alone.close()
