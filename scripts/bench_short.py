#!/usr/bin/env python3
"""Short sessions with the addon and without it, on the providers' cache rules: does a short session
cost more through bili?

``bench_session.py``'s Claude-Code-like agent (seeded: ~13K tokens of tools and system prompt, tool
outputs of 2-20 KB) runs sessions of a few requests, each twice: the agent alone, and through the
engine as shipped (lazy activation, folds held until they pay).  Each run is billed by the cache model
(``kernel/cache.py``: Anthropic's breakpoints and lifetimes, OpenAI's prefix) and the table prints, per
session length and pause pattern, the cost with the addon as a multiple of the agent alone's, and the
request on which bili activated (its tools, prompt and tags arrived), if it did.

Pause patterns: ``none`` (requests 8 s apart, a tool loop), ``6min`` (every other gap 6 minutes: the
5-minute entries expire), ``61min`` (every other gap 61 minutes: the 1-hour ones too).

    python scripts/bench_short.py                  # lengths 2..40, seed 1
    python scripts/bench_short.py --seed 2 --lengths 10 15 20
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_session as B  # noqa: E402

GAPS = {"none": (8.0, 8.0), "6min": (8.0, 361.0), "61min": (8.0, 3661.0)}


def times(n: int, pauses: str) -> list[float]:
    """When each of ``n`` requests leaves: the pattern's two gaps in turn."""
    short, long = GAPS[pauses]
    out, at = [], 0.0
    for k in range(n):
        if k:
            at += long if k % 2 == 0 else short
        out.append(at)
    return out


def one(seed: int, n: int, pauses: str) -> tuple[float, float, float, float, int | None]:
    """``(Anthropic alone, with, OpenAI alone, with, the request bili activated on or None)``."""
    env = B.Script(seed).environment()
    script = B.Script(seed)
    first, steps = script.session(n)
    at = times(n, pauses)
    alone = B.run_without(env, first, steps, script, times=at)
    bili = B.run_with(env, first, steps, script, seed, times=at)
    # (the first request billed otherwise: bili's tools, prompt and tags arrived with it)
    active = next((k for k, (x, y) in enumerate(zip(alone.anth_bills, bili.anth_bills)) if x != y), None)
    return alone.anth_cost, bili.anth_cost, alone.oai_cost, bili.oai_cost, active


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2, 3, 5, 10, 12, 15, 20, 25, 30, 40])
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)
    print(f"short sessions, seed {args.seed}: the cost with bili as a multiple of the agent alone's "
          "(input-token units on kernel/cache.py's rules)\n")
    print(f"{'requests':>8}  {'pauses':<6}  {'Anthropic':>10}  {'OpenAI':>8}  {'bili active from':>16}")
    for pauses in GAPS:
        for n in args.lengths:
            a0, a1, o0, o1, active = one(args.seed, n, pauses)
            print(f"{n:>8}  {pauses:<6}  {a1 / a0:>9.3f}x  {o1 / o0:>7.3f}x  "
                  f"{'request ' + str(active) if active is not None else 'never':>16}")
        print()


if __name__ == "__main__":
    main()
