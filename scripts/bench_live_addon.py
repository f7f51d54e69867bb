"""A mitmproxy addon script for scripts/bench_live.py, loaded beside bili (``-s``): each
``Engine.process`` of the running proxy is timed on the thread that runs it (``time.thread_time_ns``),
with the floor (``msgspec.json.decode`` + ``msgspec.json.encode`` of the same body) measured on that
thread right before it, as bench_overhead.py measures it; and the CPU of a PostgreSQL store's
``hold`` (its one round trip on a turn's path).  One JSON line per turn to ``$BILI_BENCH_LIVE_LOG``:
``{"floor": ns, "turn": ns, "hold": ns}``.  Nothing else of the proxy changes."""

from __future__ import annotations

import json
import os
import threading
import time

import msgspec

from bili_addon.kernel import turn as _turn

_LOG = open(os.environ["BILI_BENCH_LIVE_LOG"], "a", buffering=1)
_process = _turn.Engine.process
_local = threading.local()


def process(self, raw, lane, headers, *args, **kw):
    t0 = time.thread_time_ns()
    msgspec.json.encode(msgspec.json.decode(raw))
    t1 = time.thread_time_ns()
    _local.hold = 0
    try:
        return _process(self, raw, lane, headers, *args, **kw)
    finally:
        t2 = time.thread_time_ns()
        _LOG.write(json.dumps({"floor": t1 - t0, "turn": t2 - t1, "hold": _local.hold}) + "\n")


_turn.Engine.process = process

try:
    from bili_addon import store_pg as _store_pg
except ImportError:  # (no psycopg: a SQLite proxy)
    _store_pg = None
if _store_pg is not None:
    _hold = _store_pg.PgStore.hold

    def hold(self, *args, **kw):
        t = time.thread_time_ns()
        try:
            return _hold(self, *args, **kw)
        finally:
            _local.hold = getattr(_local, "hold", 0) + time.thread_time_ns() - t

    _store_pg.PgStore.hold = hold

addons: list = []
