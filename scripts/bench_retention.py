#!/usr/bin/env python3
"""What retention (bili_addon/retention.py) costs and what it gives back, side by side.

A SQLite store with many conversations (each: a conversation of --messages messages and --turns
follow-up turns, with their usage rows), half of them not seen for 40 days.  Prints:

* a follow-up turn of a live conversation (median, wall time): what a request pays;
* one background pass (trim + prune of at most 20 families + giving freed pages back), which runs
  on the store's worker between turns: what a request queued behind it may wait, at most;
* the store's size before, after the passes, and after ``bili store prune``'s VACUUM.

    python scripts/bench_retention.py            # 40 conversations
    python scripts/bench_retention.py --quick    # 10
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

from bili_addon import retention  # noqa: E402
from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.retention import Maintainer  # noqa: E402
from bili_addon.store import Store  # noqa: E402


class _Keeper:  # what Maintainer needs of the proxy's keeper here: nothing is submitted
    offloading = False


def fill(eng: Engine, case: Case, sid: str, turns: int) -> list[float]:
    """A conversation of its own (its first message says whose); returns its follow-up turns' times."""
    msgs = list(case.msgs)
    first = next(i for i, m in enumerate(msgs) if m["role"] != "system")
    msgs[first] = {**msgs[first], "content": f"[{sid}] {msgs[first]['content']}"}
    h = {"x-acp-session": sid}
    eng.process(case.body(msgs), case.lane, h, render=True)
    out = []
    for i in range(turns):
        msgs.append(case.new(i))
        raw = case.body(msgs)
        t = time.perf_counter()
        eng.process(raw, case.lane, h, render=True)
        out.append(time.perf_counter() - t)
        eng.store.record_usage(sid, case.lane_name, (1000 + i, 800, 100, 50))
    return out


def pages(store: Store) -> tuple[int, int]:
    """Bytes of the database's pages in use and free (the WAL aside: it is checkpointed by SQLite)."""
    size = store.db.execute("PRAGMA page_size").fetchone()[0]
    count = store.db.execute("PRAGMA page_count").fetchone()[0]
    free = store.db.execute("PRAGMA freelist_count").fetchone()[0]
    return (count - free) * size, free * size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--turns", type=int, default=20)
    args = ap.parse_args()
    n = 10 if args.quick else 40
    case = Case("anthropic", args.messages)
    with tempfile.TemporaryDirectory() as d:
        eng = Engine(Store(d))
        turn = []
        for k in range(n):
            turn += fill(eng, case, f"bench-{k}", args.turns)
        store = eng.store
        old = time.time() - 40 * retention.DAY
        store.db.executemany("UPDATE sessions SET last_seen=? WHERE id=?", [(old, f"bench-{k}") for k in range(0, n, 2)])
        size0 = pages(store)
        m = Maintainer(_Keeper())
        passes = []
        while True:
            t = time.perf_counter()
            out = m.run(eng)
            passes.append((time.perf_counter() - t, out))
            if not out.get("pruned") and not out["trimmed"]:
                break
        size1 = pages(store)
        store.reclaim()  # what bili store prune does at the end
        size2 = pages(store)
    t_turn = statistics.median(turn) * 1000
    print(f"{n} conversations of {args.messages} messages + {args.turns} follow-up turns each, "
          f"{n // 2} not seen for 40 days (SQLite)")
    print(f"{'':<42}{'ms':>9}{'x turn':>9}")
    print(f"{'follow-up turn (median)':<42}{t_turn:>9.2f}{1:>8.2f}x")
    for i, (dt, out) in enumerate(passes):
        what = f"pass {i + 1}: pruned {out.get('pruned', 0)}, trimmed {sum(out['trimmed'].values())} rows"
        print(f"{what:<42}{dt * 1000:>9.2f}{dt * 1000 / t_turn:>8.2f}x")
    print("store (pages of the database, MB: in use / free):")
    for name, (used, free) in (("before", size0), ("after the passes", size1), ("after VACUUM", size2)):
        print(f"  {name:<40}{used / 1e6:>7.2f} / {free / 1e6:.2f}")


if __name__ == "__main__":
    main()
