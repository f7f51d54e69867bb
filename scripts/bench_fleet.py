#!/usr/bin/env python3
"""A team gateway under load: 1, 2 and 4 mitmdump instances on one PostgreSQL store.

32 agent sessions (official ``anthropic`` SDK clients, one thread each) run concurrently against
the test suite's fake upstream (a scripted model: tool loops with ~1.6 KB outputs, a fold, a
decompress, a search).  Each turn of a session goes to the next instance round robin.  Printed
side by side per instance count: requests per second, p50/p99 latency of a request through the
proxy, and the same for one SQLite instance (the reference).  Then the proof: the upstream
received, for every session and turn, the same bytes from the fleet as from the one SQLite
instance.

Needs the test extras (``scripts/bootstrap --test``) and PostgreSQL server binaries (or a URL):

    python scripts/bench_fleet.py                   # 32 sessions x 12 turns, 1/2/4 instances
    python scripts/bench_fleet.py --quick           # 8 sessions, 1/2 instances
    python scripts/bench_fleet.py --route sticky    # a session stays on one instance
    python scripts/bench_fleet.py --postgresql URL  # a server of your own (its database must be empty)
    python scripts/bench_fleet.py --postgresql auto # a throw-away server (the default)

Latency here is the client's wall time for one request through the proxy to the fake upstream and
back; the fake answers at once, so it is mostly the proxy's (and this 2-core machine is shared by
the clients, the fake, the instances and PostgreSQL: read the ratios, not the absolute figures).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from pgserver import PgServer  # noqa: E402

from bili_addon.stores import is_url  # noqa: E402

from tests.e2e.fake_upstream import FakeUpstream  # noqa: E402
from tests.e2e.support import AnthropicAgent, Mitmdump  # noqa: E402
from tests.e2e.test_fleet_e2e import TURNS, script  # noqa: E402
from tests.e2e.test_fold_e2e import TASK, Turns, run_bash  # noqa: E402


ROUTE = "round-robin"


def route(procs: list[Mitmdump], k: int, t: int) -> Mitmdump:
    """round-robin: each turn to the next instance; sticky: a session stays on one instance."""
    return procs[(k + t) % len(procs)] if ROUTE == "round-robin" else procs[k % len(procs)]


def run(fake, procs: list[Mitmdump], sessions: int, tag: str) -> tuple[float, list[float]]:
    """Every session's turns, concurrently; returns the wall seconds and each request's latency.

    Each session's SDK clients, one per instance (a client's kept-alive connection to each, as
    through a balancer that spreads requests), are made before the clock starts: making one costs
    the client process ~20 ms of CPU (its TLS context), which is the bench's, not the proxy's (a
    new client per switch of instance used to halve the round-robin rows' throughput)."""
    lat: list[float] = []

    def agent_of(k: int) -> tuple[AnthropicAgent, dict]:
        fake.script(f"{tag}-{k}", script())
        agent = AnthropicAgent(route(procs, k, 1).url, f"bench-{tag}-{k}", f"{tag}-{k}", TASK, stream=k % 2 == 0)
        clients = {agent.base_url: (agent.client, agent.tee)}
        for p in procs:
            if p.url not in clients:
                agent.base_url = p.url
                agent.connect()
                clients[p.url] = (agent.client, agent.tee)
        return agent, clients

    def one(k: int, agent: AnthropicAgent, clients: dict) -> None:
        for t in range(1, TURNS + 1):
            agent.base_url = route(procs, k, t).url
            agent.client, agent.tee = clients[agent.base_url]
            t0 = time.perf_counter()
            agent.step(t, run_bash)
            lat.append(time.perf_counter() - t0)

    agents = [agent_of(k) for k in range(sessions)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        for f in [pool.submit(one, k, *agents[k]) for k in range(sessions)]:
            f.result()
    return time.perf_counter() - t0, lat


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 sessions; 1 and 2 instances")
    ap.add_argument("--sessions", type=int, default=0)
    ap.add_argument("--postgresql", metavar="URL|auto",
                    help="use this database instead of a throw-away server (auto, the default)")
    ap.add_argument("--route", choices=("round-robin", "sticky"), default="round-robin",
                    help="round-robin: every turn to the next instance (the worst case: each turn reloads the "
                         "session another instance advanced); sticky: a session stays on one instance")
    args = ap.parse_args()
    global ROUTE
    ROUTE = args.route
    sessions = args.sessions or (8 if args.quick else 32)
    counts = [1, 2] if args.quick else [1, 2, 4]

    server = None
    if args.postgresql and args.postgresql != "auto":
        if not is_url(args.postgresql):  # (else each instance would open a SQLite store in a directory of that name)
            ap.error(f"--postgresql takes a postgresql:// URL or auto, not {args.postgresql!r}")
        urls = iter(lambda: args.postgresql, None)
    else:
        server = PgServer().start()
        urls = iter(server.fresh, None)
    fake = FakeUpstream().start()
    work = Path(tempfile.mkdtemp(prefix="bili-fleet-"))
    started: list[Mitmdump] = []
    keep = False  # the work dir, when a fleet's bytes differed (its logs say why)

    def instances(n: int, **options: str) -> list[Mitmdump]:
        procs = [Mitmdump(work / f"{uuid.uuid4().hex[:6]}", fake.port, options=options) for _ in range(n)]
        for p in procs:
            p.workdir.mkdir(parents=True)
            started.append(p.start())
        return procs

    print(f"bili-addon fleet: {sessions} concurrent sessions x {TURNS} turns (fold, decompress, search), "
          f"routed {ROUTE} over the instances; python {sys.version.split()[0]}")
    print()
    head = f"{'store':<12}{'instances':>10}{'requests':>10}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'same bytes':>12}"
    print(head)
    print("-" * len(head))
    try:
        single = instances(1)
        wall, lat = run(fake, single, sessions, "lite")
        print(f"{'sqlite':<12}{1:>10}{len(lat):>10}{len(lat) / wall:>8.1f}{pct(lat, 50):>9.1f}{pct(lat, 99):>9.1f}"
              f"{'reference':>12}", flush=True)
        for p in single:
            p.stop()
        for n in counts:
            procs = instances(n, bili_store=next(urls))
            tag = f"pg{n}"
            wall, lat = run(fake, procs, sessions, tag)
            differ = [(k, t) for k in range(sessions) for t in range(1, TURNS + 1)
                      if Turns(fake, f"{tag}-{k}")[t].raw != Turns(fake, f"lite-{k}")[t].raw]
            print(f"{'postgresql':<12}{n:>10}{len(lat):>10}{len(lat) / wall:>8.1f}{pct(lat, 50):>9.1f}"
                  f"{pct(lat, 99):>9.1f}{'NO' if differ else 'yes':>12}", flush=True)
            if differ:  # (where to look: the instances' logs are in the work dir, kept when this happens)
                keep = True
                print(f"    {len(differ)} of {sessions * TURNS} turns differ, first session {differ[0][0]} turn "
                      f"{differ[0][1]}; the instances' logs: {work}", flush=True)
            for p in procs:
                p.stop()
    finally:
        for p in started:
            p.stop()
        fake.stop()
        if server is not None:
            server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)  # (the instances' stores and logs: ~150 MB a run)
    print()
    print("req/s: requests of all sessions / wall time of the run; p50/p99: one request's wall time at the")
    print("client (through the proxy to the fake upstream and back); same bytes: every session's every turn")
    print("reached the upstream byte for byte as through the one SQLite instance.")


if __name__ == "__main__":
    main()
