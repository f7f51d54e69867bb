#!/usr/bin/env python3
"""What the shared-store rules (#19) cost per turn, side by side.

Two processes may share one store, so every turn (a) reads the session's version to notice that
another process advanced it, and (b) writes through version-checked transactions that allocate its
new refs in the store (``refs`` primary key).  The alternative design, a lock on the data dir held
by the first process, needs neither.  This prints, for a follow-up turn (one message appended to a
conversation of 100 and 1,000 messages, wall time, median):

* ``unchecked``: the same Engine over a store whose version read and checks are no-ops (what a
  single process behind a data-dir lock would pay),
* ``shared``: the real store (version read + checked, allocating writes),
* ``alternating``: two Engines (two processes) on one store taking the turns in turn, so every turn
  reloads the session the other one advanced (the price paid only when a conversation really
  moves between processes).

    python scripts/bench_shared_store.py            # the full run
    python scripts/bench_shared_store.py --quick    # fewer turns
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import Case  # noqa: E402

from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.store import Store  # noqa: E402

HEADERS = {"x-acp-session": "bench-shared"}


class UncheckedStore(Store):
    """The store without the cross-process rules: no version read, no check, no allocation check."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._versions: dict[str, int] = {}

    def version(self, session_id: str) -> int:
        return self._versions.get(session_id, 0)

    def _advance(self, session_id: str, expect: int) -> int:
        self._versions[session_id] = expect + 1
        return expect + 1

    def _allocate(self, session_id, minted, next_ref) -> None:
        return None


def run(case: Case, turns: int, engines: list[Engine]) -> float:
    """Median ms of a follow-up turn; the engines take the turns in turn."""
    msgs = list(case.msgs)
    engines[0].process(case.body(msgs), case.lane, HEADERS, render=True)
    for e in engines[1:]:  # every engine has seen the conversation once (warm caches)
        e.process(case.body(msgs), case.lane, HEADERS, render=True)
    samples = []
    for i in range(turns):
        msgs.append(case.new(i))
        raw = case.body(msgs)
        eng = engines[i % len(engines)]
        t = time.perf_counter()
        eng.process(raw, case.lane, HEADERS, render=True)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    turns = 15 if args.quick else 41
    print(f"follow-up turn, ms (median of {turns} turns, wall time)")
    head = f"{'lane':<10}{'msgs':>7}{'unchecked':>11}{'shared':>9}{'x':>7}{'alternating':>13}{'x':>7}"
    print(head)
    print("-" * len(head))
    for n in (100, 1000):
        case = Case("anthropic", n)
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2, \
                tempfile.TemporaryDirectory() as d3:
            base = run(case, turns, [Engine(UncheckedStore(d1))])
            shared = run(case, turns, [Engine(Store(d2))])
            alt = run(case, turns, [Engine(Store(d3)), Engine(Store(d3))])
        print(f"{'anthropic':<10}{n:>7,}{base:>11.2f}{shared:>9.2f}{shared / base:>6.2f}x{alt:>13.2f}"
              f"{alt / base:>6.2f}x")
    print()
    print("unchecked: no version read or check (a single process behind a data-dir lock);")
    print("shared: the real store, any number of processes; alternating: two engines on one store")
    print("taking turns, each turn reloading the session the other advanced.")


if __name__ == "__main__":
    main()
