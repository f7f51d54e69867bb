#!/usr/bin/env python3
"""The kernel's cost inside a running proxy: bench_overhead.py's turns sent through a real mitmdump.

bench_overhead.py times ``Engine.process`` in a process of its own (the collector run before each
turn).  This script runs the proxy as users run it, ``mitmdump -s bili_addon/addon.py`` in reverse
mode in front of the test suite's fake upstream on 127.0.0.1, with ``scripts/bench_live_addon.py``
loaded beside bili: each turn is timed on the thread that runs it (the proxy's store worker), the
floor (``msgspec.json.decode`` + ``msgspec.json.encode`` of the same body) measured on that thread
right before it, and a PostgreSQL store's hold (the turn's one round trip on its path) apart.
Bodies go as the bench makes them (its synthetic conversations, HTTP POSTs), a little apart (an
agent's turns are seconds apart: ``--gap``), first turns (a new conversation each) and follow-ups
(one conversation, a message longer each turn).  The proxy's first turns (its lazily built
things) are left out.

    python scripts/bench_live.py                      # SQLite, 100 and 1,000 messages
    python scripts/bench_live.py --postgresql auto    # also a throw-away PostgreSQL server
    python scripts/bench_live.py --quick              # 100 messages, fewer turns

Needs the test extras (``scripts/bootstrap --test``).  Prints per store and size: the turns, the
floor and turn CPU ms (medians), the median of the per-turn ratios, and the hold's CPU; with a
PostgreSQL store, a bare round trip's CPU after the same gap, for reference (the machine's share of
the hold).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]

import bench_overhead  # noqa: E402
import httpx  # noqa: E402

from tests.e2e.fake_upstream import SCRIPT_HEADER, FakeUpstream, say  # noqa: E402
from tests.e2e.support import Mitmdump  # noqa: E402

ADDON = REPO / "scripts" / "bench_live_addon.py"
HEADERS = {"content-type": "application/json", "x-api-key": "bench", "anthropic-version": "2023-06-01"}
WARM = 2  # the proxy's first turns, left out


def answerable(msgs: list[dict]) -> list[dict]:
    """The bench's conversation as the API takes it: its first tool result answers a call the
    conversation does not show (it opens mid-task), so that call is put before it, as the assistant's."""
    out: list[dict] = []
    for m in msgs:
        content = m.get("content")
        if m["role"] == "user" and isinstance(content, list) and (not out or out[-1]["role"] == "user"):
            ids = [b["tool_use_id"] for b in content if b.get("type") == "tool_result"]
            if ids:
                out.append({"role": "assistant", "content": [
                    {"type": "tool_use", "id": i, "name": "Bash", "input": {"command": "true"}} for i in ids]})
        out.append(m)
    return out


class Case(bench_overhead.Case):
    """bench_overhead.py's conversation, answerable (:func:`answerable`)."""

    def __init__(self, n: int):
        super().__init__("anthropic", n)
        self.msgs = answerable(self.msgs)


class Timed(Mitmdump):
    """The suite's mitmdump with the timing addon beside bili."""

    def command(self) -> list[str]:
        return [*super().command(), "-s", str(ADDON)]


def turns(fake: FakeUpstream, proxy: Timed, log: Path, case: Case, n: int, gap: float,
          tag: str) -> dict:
    """``n`` first turns (each a new conversation), then ``n`` follow-ups of one conversation, through
    the proxy; the timings the addon logged, per kind.  The fake answers as a scripted model (checked
    as the real API checks: a user's turns in a row are one turn, as the bench's conversations have
    them)."""
    def sent() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    fake.script(tag, [say("ok")] * (WARM + 2 * n + 1))
    out = {}
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        def post(body: bytes, sid: str) -> None:
            r = c.post("/v1/messages", content=body, headers={**HEADERS, "x-acp-session": sid, SCRIPT_HEADER: tag})
            if r.status_code != 200:
                raise SystemExit(f"the proxy answered {r.status_code}: {r.text[:300]}")
            time.sleep(gap)

        for k in range(WARM):
            post(case.unique_body(), f"{tag}-warm-{k}-{time.time_ns()}")
        before = sent()
        for k in range(n):
            post(case.unique_body(), f"{tag}-first-{k}-{time.time_ns()}")
        out["first"] = (before, sent())
        msgs = list(case.msgs)
        sid = f"{tag}-follow-{time.time_ns()}"
        post(case.body(msgs), sid)  # (its history, processed before)
        before = sent()
        for k in range(n):
            msgs.append(case.new(k))
            post(case.body(msgs), sid)
        out["follow-up"] = (before, sent())
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {kind: rows[a:b] for kind, (a, b) in out.items()}


def bare_round_trip(url: str, gap: float, n: int) -> tuple[float, float]:
    """A statement's round trip alone, for reference: ``SELECT 1`` on a connection of its own to the
    same server, the client's CPU (median, us) after ``gap`` seconds idle (as the turns are sent) and
    back to back.  What a round trip costs this machine whatever the statement (the hold's column
    beside it is the turn's own)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        pg = conn.pgconn

        def once() -> int:
            t = time.thread_time_ns()
            pg.exec_params(b"SELECT 1", [])
            return time.thread_time_ns() - t

        once()
        idle = []
        for _ in range(n):
            time.sleep(gap)
            idle.append(once())
        hot = [once() for _ in range(n)]
    return statistics.median(idle) / 1e3, statistics.median(hot) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 messages only, 9 turns of each kind")
    ap.add_argument("--msgs", type=int, action="append", help="a conversation size (default 100 and 1,000)")
    ap.add_argument("--postgresql", metavar="URL|auto", help="also a PostgreSQL store (auto: a throw-away server)")
    ap.add_argument("--turns", type=int, help="turns of each kind per store and size (default 25; --quick: 9)")
    ap.add_argument("--gap", type=float, default=0.1, help="seconds between two requests (default 0.1)")
    args = ap.parse_args()
    sizes = args.msgs or ([100] if args.quick else [100, 1000])
    n = args.turns or (9 if args.quick else 25)
    url, server = bench_overhead.postgresql(args.postgresql) if args.postgresql else (None, None)
    stores = [("sqlite", None)] + ([("pg", url)] if url else [])
    fake = FakeUpstream().start()
    print(f"bili-addon in a running mitmdump: Engine.process on its thread vs msgspec decode+encode of the "
          f"same body (CPU time, median); python {sys.version.split()[0]}")
    print()
    head = f"{'store':<7}{'msgs':>7}{'turn':>11}{'n':>5}{'floor ms':>10}{'turn ms':>9}{'x floor':>9}{'hold us':>9}"
    print(head)
    print("-" * len(head))
    try:
        for size in sizes:
            case = Case(size)
            for store, store_url in stores:
                with tempfile.TemporaryDirectory(prefix="bili-bench-live-") as d:
                    log = Path(d) / "turns.jsonl"
                    os.environ["BILI_BENCH_LIVE_LOG"] = str(log)
                    proxy = Timed(Path(d), fake.port, options={"bili_store": store_url} if store_url else {})
                    proxy.start()
                    try:
                        got = turns(fake, proxy, log, case, n, args.gap, f"{store}-{size}")
                    finally:
                        proxy.stop()
                for kind, rows in got.items():
                    ratio = statistics.median(r["turn"] / r["floor"] for r in rows)
                    hold = f"{statistics.median(r['hold'] for r in rows) / 1e3:>9.0f}" if store_url else f"{'':>9}"
                    print(f"{store:<7}{size:>7,}{kind:>11}{len(rows):>5}"
                          f"{statistics.median(r['floor'] for r in rows) / 1e6:>10.2f}"
                          f"{statistics.median(r['turn'] for r in rows) / 1e6:>9.2f}{ratio:>8.2f}x{hold}", flush=True)
        if url:
            idle, hot = bare_round_trip(url, args.gap, n)
            print(f"\nfor reference, a bare round trip to the same server (SELECT 1, its own connection): "
                  f"client CPU {idle:.0f} us after {args.gap:g} s idle, {hot:.0f} us back to back")
    finally:
        fake.stop()
        if server is not None:
            server.stop()
    print()
    print("turn: Engine.process in the proxy (bili_activate=always, as bench_overhead.py); first: a new")
    print("  conversation each; follow-up: one conversation, a message longer each turn; floor: decode +")
    print("  encode of the same body on the same thread right before it; x floor: the median of the per-turn")
    print("  ratios; hold us: a PostgreSQL turn's lock-and-read round trip, the client's CPU (median); a bare")
    print("  round trip: what any round trip costs the client on this machine after the same idle gap.")


if __name__ == "__main__":
    main()
