"""A team gateway (#11): three mitmdump instances on one PostgreSQL store behave as one proxy.

Eight agent sessions run concurrently; each turn of a session goes to the next instance round
robin (so neighbouring turns of a session are served by different processes, interleaved with
the other sessions' turns), with a fold, a decompress and a search.  Half-way, one instance is
killed with SIGKILL and its share goes on through the other two.  The upstream must receive byte
for byte what one SQLite instance sends for the same traffic; every ref names one text; each proxy
call ran exactly once in the fleet; any instance's stats show every session.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import conftest
from .fake_upstream import proxy_call, say
from .support import AnthropicAgent, Mitmdump, strip_tags
from .test_fold_e2e import TASK, Turns, fold, reading, run_bash

pytestmark = pytest.mark.e2e

SESSIONS = 8
TURNS = 12
COMPRESS_TURN = 7  # folds turns 1-4
KILL_AFTER = 6  # the third instance dies after this turn of every session


def script() -> list:
    acts = []
    for t in range(1, TURNS + 1):
        if t == COMPRESS_TURN:
            acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {t}: modules 1 to 4 are done, folding."))
        elif t == 9:
            acts.append(proxy_call("decompress", {"blockId": "b1"}, prose=f"Turn {t}: what did b1 hold again?"))
        elif t == 10:
            acts.append(proxy_call("search_context", {"query": "file-3-row-7"}, prose=f"Turn {t}: where is row 7?"))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: the audit is complete."))
        else:
            acts.append(reading(t))
    return acts


def start(proc: Mitmdump) -> Mitmdump:
    conftest._running.append(proc)
    return proc.start()


def stop(procs: list[Mitmdump]) -> None:
    for p in procs:
        p.stop()
        if p in conftest._running:
            conftest._running.remove(p)


def run_sessions(fake, sids: list[str], prefix: str, route) -> None:
    """Every session's turns, the sessions concurrently; ``route(k, t)`` is the instance of turn t."""
    agents = []
    for k, sid in enumerate(sids):
        fake.script(f"{prefix}-{k}", script())
        agents.append(AnthropicAgent(route(k, 1).url, sid, f"{prefix}-{k}", TASK, stream=k % 2 == 0))

    def turns(k: int, first: int, last: int) -> None:
        agent = agents[k]
        for t in range(first, last + 1):
            proxy = route(k, t)
            if agent.base_url != proxy.url:
                agent.base_url = proxy.url
                agent.connect()
            agent.step(t, run_bash)

    for first, last in ((1, KILL_AFTER), (KILL_AFTER + 1, TURNS)):
        with ThreadPoolExecutor(SESSIONS) as pool:
            for f in [pool.submit(turns, k, first, last) for k in range(SESSIONS)]:
                f.result()
        route.phase_done(last)


class RoundRobin:
    def __init__(self, procs: list[Mitmdump], kill_after: int | None = None):
        self.procs, self.kill_after = procs, kill_after
        self.live = list(procs)

    def __call__(self, k: int, t: int) -> Mitmdump:
        return self.live[(k + t) % len(self.live)]

    def phase_done(self, turn: int) -> None:
        if turn == self.kill_after:
            victim = self.live.pop()
            victim.proc.send_signal(signal.SIGKILL)  # no clean shutdown: whatever it held is lost
            victim.proc.wait(timeout=10)


def test_three_instances_on_one_postgresql_send_what_one_sqlite_instance_sends(fake, pg_url, sid, tmp_path_factory):
    import psycopg

    sids = [f"{sid}-{k}" for k in range(SESSIONS)]
    fleet = [Mitmdump(tmp_path_factory.mktemp(f"fleet-{i}"), fake.port, options={"bili_store": pg_url})
             for i in range(3)]
    single = Mitmdump(tmp_path_factory.mktemp("fleet-sqlite"), fake.port)
    try:
        for p in (*fleet, single):
            start(p)
        health = fleet[0].health()
        assert health["store"] is True and health["store_backend"] == "postgresql", health
        assert "@" in health["store_at"] and single.health()["store_backend"] == "sqlite"

        robin = RoundRobin(fleet, kill_after=KILL_AFTER)
        run_sessions(fake, sids, f"{sid}-pg", robin)
        run_sessions(fake, sids, f"{sid}-lite", RoundRobin([single]))

        for k, s in enumerate(sids):
            pg, lite = Turns(fake, f"{sid}-pg-{k}"), Turns(fake, f"{sid}-lite-{k}")
            names: dict[str, str] = {}
            for t in range(1, TURNS + 1):
                assert pg[t].raw == lite[t].raw, f"session {k} turn {t}: the fleet sent other bytes than one instance"
                for tag in strip_tags(pg[t].json)[1]:
                    assert names.setdefault(tag.ref, tag.text) == tag.text, (k, t, tag.ref)
            assert b"[Compressed conversation section b1" in pg[TURNS].raw

        # each proxy call ran once in the whole fleet (the killed instance's log included)
        logs = [p.log() for p in fleet]
        for s in sids:
            for name in ("compress", "decompress", "search_context"):
                n = sum(f"session={s} " in ln and f"ran={name}" in ln for log in logs for ln in log.splitlines())
                assert n == 1, (s, name, n)
        assert not any("forwarding unchanged" in log or "Traceback" in log for log in logs), fleet[0].log_tail()

        # the store: every ref was given once and names one text
        with psycopg.connect(pg_url) as db:
            twice = db.execute("SELECT session_id, ref FROM ledger GROUP BY 1, 2 "
                               "HAVING COUNT(DISTINCT content_hash) > 1").fetchall()
            given = dict(db.execute("SELECT session_id, COUNT(*) FROM refs GROUP BY 1").fetchall())
            used = dict(db.execute("SELECT session_id, COUNT(DISTINCT ref) FROM ledger GROUP BY 1").fetchall())
        assert twice == [] and set(given) >= set(sids) and all(given[s] == used[s] for s in sids)

        # any instance's stats show the whole fleet
        shown = {r["id"] for r in fleet[1].stats()["sessions"]}
        assert set(sids) <= shown
    finally:
        stop([*fleet, single])
