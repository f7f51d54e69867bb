"""scripts/bench_phases.py times the kernel's steps by wrapping them for a run: every step it names
must exist (a renamed step would silently drop out of the table), be called by the turns it says
call it, and be put back unchanged afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402
import bench_phases  # noqa: E402

from bili_addon.store import Store  # noqa: E402


def _owners(case):
    return [(case.lane if owner == "lane" else owner, attr) for _l, _d, owner, attr in bench_phases.STEPS]


def test_every_step_exists_is_timed_and_is_put_back():
    case = bench_overhead.Case("anthropic", 30)
    before = [(o, a, vars(o).get(a), getattr(o, a)) for o, a in _owners(case)]
    assert all(fn is not None for *_x, fn in before), "a step the bench names no longer exists"
    first, floor = bench_phases.measure(case, 3, False, Store)
    follow, _ = bench_phases.measure(case, 3, True, Store)
    assert floor > 0
    for timers, steps in ((first, ("read the items (ItemCache.get_many)", "refs, rows and view (fresh.first_pass)",
                                   "store the turn (Engine._commit)", "render the items (render_items)")),
                          (follow, ("refs and rows (Engine._resolve)", "store the turn (Engine._commit)"))):
        assert len(timers.runs[bench_phases.TOTAL]) == 3
        for label in steps:
            assert timers.median_us(label, 3) > 0, label
        # the steps inside a turn take less than the whole turn
        assert timers.median_us("split the body (wire.Body)", 3) < timers.median_us(bench_phases.TOTAL, 3)
    after = [(o, a, vars(o).get(a), getattr(o, a)) for o, a in _owners(case)]
    assert [(o, a, own) for o, a, own, _fn in after] == [(o, a, own) for o, a, own, _fn in before]
    assert "array_cores" not in vars(case.lane)  # the lane's class method shows again


def test_the_overhead_benchs_trip_clock_counts_postgresqls_calls_only(backend, tmp_path):
    """bench_overhead.TripClock: the follow-up target is 2x the floor plus the round trips (issue #11);
    the clock counts the CPU in a PostgreSQL store's hold, commit and release, nothing on SQLite, and
    leaves the store as it was."""
    from bili_addon.kernel.turn import Engine

    store = backend()
    case = bench_overhead.Case("anthropic", 30)
    eng = Engine(store)
    headers = {"x-acp-session": "trip-clock"}
    msgs = list(case.msgs)
    eng.process(case.body(msgs), case.lane, headers, render=True)
    clock = bench_overhead.TripClock(store)
    before = dict(vars(store))
    spent = 0.0
    for i in range(3):
        msgs.append(case.new(i))
        with clock:
            eng.process(case.body(msgs), case.lane, headers, render=True)
        spent += clock.take()
        assert clock.spent == 0.0
    assert vars(store).keys() == before.keys()  # (the wrappers gone: the class's methods again)
    if backend.kind == "postgresql":
        assert spent > 0
    else:
        assert spent == 0.0
