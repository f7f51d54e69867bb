#!/usr/bin/env python3
"""Where a turn's time goes: the kernel's steps timed one by one, each against the floor.

``bench_overhead.py`` measures whole turns against the floor (``msgspec.json.decode`` +
``msgspec.json.encode`` of the same body); this script splits the same turns into the steps of
``Engine.process`` and prints each step's CPU time (``time.process_time_ns``, median over the runs)
and its share of the floor, for a new conversation's first turn in a running proxy and for a
follow-up turn (one message appended), and for Anthropic bodies a follow-up of a session whose first
half the model folded (one ``compress`` call: the long sessions bili is for), on SQLite and, with ``--postgresql``, on PostgreSQL (there
the store's calls are shown on their own: their CPU time is the client's side of each round trip).

Each step is wrapped in a timer for the run (two clock reads, ~0.6 us per call here, ~40 calls a
turn: they land in "the rest of the turn", and the whole turn reads that much above
``bench_overhead.py``'s).  Steps nest (an indented step is part of the one above it); "the rest of
the turn" is the whole turn less its top-level steps, per turn.

    python scripts/bench_phases.py                      # Anthropic 100 and 1,000 msgs, Chat 1,000
    python scripts/bench_phases.py --postgresql auto    # also on a throw-away PostgreSQL server
    python scripts/bench_phases.py --lane chat --msgs 100 --reps 200
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_overhead as bo  # noqa: E402  (the same conversations, engine and store as the overhead bench)
from bili_addon import store as store_mod  # noqa: E402
from bili_addon.kernel import cache, fresh, lineage, pressure, registry, state, turn  # noqa: E402
from bili_addon.wire import base  # noqa: E402

CLOCK = time.process_time_ns

# (label, depth, owner, attribute): the steps of Engine._process in the order they run; an owner is a
# class, a module, or a string naming an attribute of the Case (``lane``) for an instance's method.
# ``depth`` > 0: part of the step above it.
STEPS = [
    ("split the body (wire.Body)", 0, base.Body, "__init__"),
    ("the request's session (session_from_request)", 0, turn, "session_from_request"),
    ("the previous pass (Engine._memo_for)", 0, turn.Engine, "_memo_for"),
    ("what the previous pass shares (common_prefix)", 0, turn.coverage, "common_prefix"),
    ("read the items (ItemCache.get_many)", 0, state.ItemCache, "get_many"),
    ("decode and cores (lane.array_cores)", 1, "lane", "array_cores"),
    ("content hashes and parts (_new_parts)", 1, state.ItemCache, "_new_parts"),
    ("a new session's fork key (Lineage.head)", 0, lineage.Lineage, "head"),
    ("load the session (Sessions.load)", 0, registry.Sessions, "load"),
    ("refs, rows and view (fresh.first_pass)", 0, fresh, "first_pass"),
    ("refs and rows (Engine._resolve)", 0, turn.Engine, "_resolve"),
    ("view items (turn._view_items)", 0, turn, "_view_items"),
    ("host-vouched ids (envelope.pins)", 0, turn.envelope, "pins"),
    ("lineage hooks (Engine._lineage)", 0, turn.Engine, "_lineage"),
    ("the view (fold.View)", 0, turn, "View"),
    ("the agent's compaction (Engine._compaction)", 0, turn.Engine, "_compaction"),
    ("bili shows itself (pressure.is_active)", 0, pressure, "is_active"),
    ("fold coverage under churn (coverage.check)", 0, turn.coverage, "check"),
    ("the canonical copy (coverage.roll_copy)", 0, turn.coverage, "roll_copy"),
    ("reminder and lifetime (pressure.apply)", 0, pressure, "apply"),
    ("store the turn (Engine._commit)", 0, turn.Engine, "_commit"),
    ("write the staged commit (Sessions.flush)", 0, registry.Sessions, "flush"),
    ("held folds (Engine._land)", 0, turn.Engine, "_land"),
    ("render the items (render_items)", 0, turn, "render_items"),
    ("strict providers' inserts (strict_inserts)", 0, turn, "strict_inserts"),
    ("assemble (render.assemble)", 0, turn, "assemble"),
    ("tool names (lane.tool_names)", 0, "lane", "tool_names"),
    ("inject tools and prompt (lane.inject)", 0, "lane", "inject"),
    ("cache lifetimes on the parts (upgrade_lifetime)", 0, pressure, "upgrade_lifetime"),
    ("encode the body (Body.encode)", 0, base.Body, "encode"),
    ("remember the pass (Sessions.remember)", 0, registry.Sessions, "remember"),
    ("the cache clock notes the send (Clocks.sent)", 0, cache.Clocks, "sent"),
]
# the store's calls, shown under the step that makes them (PostgreSQL's are round trips; a commit is
# written by Engine._commit, or staged there and written by Sessions.flush: shown under the flush)
STORE_STEPS = [
    ("lock and read (store.hold)", "load the session (Sessions.load)", "hold"),
    ("the store's commit (store.commit_turn)", "write the staged commit (Sessions.flush)", "commit_turn"),
    ("release the lock (store.release)", None, "release"),
]
TOTAL = "whole turn (Engine.process)"
WRITE = "after the request: its store write (write_pending)"
SETTLE = "after the answer: lineage (settle)"


class Timers:
    """Per-label CPU nanoseconds of the turn being measured, and the medians over the turns."""

    def __init__(self):
        self.cur: dict[str, int] = {}
        self.runs: dict[str, list[int]] = {}

    def wrap(self, label: str, fn):
        cur = self.cur

        def timed(*args, **kw):
            t = CLOCK()
            try:
                return fn(*args, **kw)
            finally:
                cur[label] = cur.get(label, 0) + CLOCK() - t

        return timed

    def keep(self) -> None:
        for label, ns in self.cur.items():
            self.runs.setdefault(label, []).append(ns)
        self.cur.clear()

    def median_us(self, label: str, n: int) -> float | None:
        """The median over ``n`` turns (a turn that did not call the step counts as 0)."""
        got = self.runs.get(label)
        if not got:
            return None
        return statistics.median(got + [0] * (n - len(got))) / 1000


@contextmanager
def instrumented(timers: Timers, case: bo.Case, store_cls):
    """Every step wrapped for the run, unwrapped after it."""
    undo = []
    missing = object()

    def patch(owner, attr: str, label: str) -> None:
        own = vars(owner).get(attr, missing)  # what the owner itself holds (an instance: usually nothing)
        if isinstance(own, staticmethod):
            setattr(owner, attr, staticmethod(timers.wrap(label, own.__func__)))
        else:
            setattr(owner, attr, timers.wrap(label, getattr(owner, attr)))
        undo.append((owner, attr, own))

    for label, _depth, owner, attr in STEPS:
        patch(case.lane if owner == "lane" else owner, attr, label)
    for label, _parent, attr in STORE_STEPS:
        if hasattr(store_cls, attr):
            patch(store_cls, attr, label)
    patch(turn.Engine, "process", TOTAL)
    patch(lineage.Lineage, "flush", SETTLE)
    try:
        yield
    finally:
        for owner, attr, own in reversed(undo):
            if own is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


def floor_ns(raw: bytes) -> int:
    gc.collect()
    t = CLOCK()
    msgspec.json.encode(msgspec.json.decode(raw))
    return CLOCK() - t


def measure(case: bo.Case, reps: int, follow: bool | str, store_cls) -> tuple[Timers, float]:
    """The steps of ``reps`` turns (first turns of new conversations, or follow-ups of one; "folded":
    follow-ups of one whose first half the model folded), and the median floor (us)."""
    timers, floors = Timers(), []
    with tempfile.TemporaryDirectory(prefix="bili-phases-") as d:
        eng = bo.running_engine(d, case)
        msgs = list(case.msgs)
        headers = {"x-acp-session": f"bench-phases-{time.time_ns()}"}
        if follow == "folded":
            msgs = bo.fold_half(eng, case, msgs, headers)
        elif follow:
            eng.process(case.body(msgs), case.lane, headers, render=True)
            bo.after(eng)
        with instrumented(timers, case, store_cls):
            for i in range(reps):
                if follow:
                    msgs.append(case.new(i))
                    raw = case.body(msgs)
                else:
                    raw = case.unique_body()
                    headers = {"x-acp-session": f"bench-phases-{time.time_ns()}"}
                    eng.items.forget()  # a new conversation: none of its items parsed before
                floors.append(floor_ns(raw))
                gc.collect()
                eng.process(raw, case.lane, headers, render=True)
                # the turn's store write, right after its request leaves (write-behind, as the proxy
                # does): timed on its own, its steps kept out of the turn's
                turn_steps = dict(timers.cur)
                t = CLOCK()
                eng.write_pending()
                timers.cur.clear()
                timers.cur.update(turn_steps)
                timers.cur[WRITE] = CLOCK() - t
                eng.lineage.flush()  # after the answer, as the proxy does
                timers.keep()
        eng.store.close()
    return timers, statistics.median(floors) / 1000


def report(case: bo.Case, backend: str, reps: int, store_cls) -> None:
    cols = [measure(case, reps, False, store_cls), measure(case, reps, True, store_cls)]
    if case.lane_name == "anthropic":  # (the bench's fold is written for Anthropic bodies)
        cols.append(measure(case, reps, "folded", store_cls))
    print(f"\n{case.lane_name}, {case.n:,} messages, {backend}: floor {cols[0][1]:.0f} us; "
          f"CPU us per turn (median of {reps}) and x floor")
    print(f"  {'step':<52}" + "".join(f"{h:>18}" for h in ("first turn", "follow-up", "folded follow-up")[:len(cols)]))
    rows = []
    for label, depth, _owner, _attr in STEPS:
        rows.append((label, depth))
        for slabel, parent, _a in STORE_STEPS:
            if parent == label:
                rows.append((slabel, depth + 1))
    rows.append((STORE_STEPS[-1][0], 0))

    def cell(t: Timers, label: str, floor: float) -> str:
        us = t.median_us(label, reps)
        return f"{'':>18}" if us is None else f"{us:>10.0f} {us / floor:>5.2f}x "

    top = [label for label, depth, *_ in STEPS if depth == 0] + [STORE_STEPS[-1][0]]
    for label, depth in rows:
        cells = "".join(cell(t, label, floor) for t, floor in cols)
        if cells.strip():
            print(f"  {'  ' * depth + label:<52}{cells}")

    def rest(t: Timers) -> float:
        # per turn, then the median (the steps' medians need not add up)
        n = len(t.runs.get(TOTAL, []))
        diffs = [t.runs[TOTAL][i] - sum(t.runs[k][i] for k in top if k in t.runs and len(t.runs[k]) == n)
                 for i in range(n)]
        return statistics.median(diffs) / 1000

    print(f"  {'the rest of the turn':<52}" + "".join(f"{rest(t):>10.0f} {rest(t) / floor:>5.2f}x " for t, floor in cols))
    for label in (TOTAL, WRITE, SETTLE):
        print(f"  {label:<52}" + "".join(cell(t, label, floor) for t, floor in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lane", choices=("anthropic", "chat", "responses"), help="one lane only")
    ap.add_argument("--msgs", type=int, help="one size only")
    ap.add_argument("--reps", type=int, default=0, help="turns per measurement (default: 200 at 100 "
                    "messages, 40 at 1,000, 6 at 10,000)")
    ap.add_argument("--postgresql", metavar="URL|auto",
                    help="also on a PostgreSQL store (auto: a throw-away server, as the tests start)")
    args = ap.parse_args()
    plan = [("anthropic", 100), ("anthropic", 1000), ("chat", 1000)]
    if args.lane or args.msgs:
        plan = [(args.lane or "anthropic", args.msgs or 1000)]
    backends: list[tuple[str, str, type]] = [("sqlite", "", store_mod.Store)]
    server = None
    if args.postgresql:
        from bili_addon.store_pg import PgStore

        url, server = bo.postgresql(args.postgresql)
        backends.append(("postgresql", url, PgStore))
    print(f"bili-addon: a turn's steps, CPU time; python {sys.version.split()[0]}, msgspec {msgspec.__version__}")
    try:
        for lane, n in plan:
            case = bo.Case(lane, n)
            reps = args.reps or (200 if n <= 100 else 40 if n <= 1000 else 6)
            for backend, url, store_cls in backends:
                bo.STORE_URL = url
                report(case, backend, reps, store_cls)
    finally:
        bo.STORE_URL = ""
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
