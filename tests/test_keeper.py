"""The store's keeper: work off the event loop, failures that never stop the proxy, recovery."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading

import pytest

from bili_addon import keeper as keeper_mod
from bili_addon.keeper import Keeper
from bili_addon.store import StoreError
from test_shell import ANTH_BODY, model_flow, session_headers


def health_flow():
    h = model_flow(b"", path="/__bili/health")
    h.request.method = "GET"
    return h


def test_a_turn_runs_on_the_worker_and_health_never_waits_for_it(bili):
    async def main():
        bili.running()  # mitmproxy is running: work goes to the store's worker thread
        gate, entered = threading.Event(), threading.Event()

        def blocker(eng):
            entered.set()
            gate.wait(10)

        busy = bili.keeper.call(blocker, None)  # the worker is busy (a store that waits on a lock)
        await asyncio.to_thread(entered.wait, 10)
        f = model_flow(ANTH_BODY, headers=session_headers())
        pending = bili.request(f)
        assert inspect.isawaitable(pending)
        h = health_flow()
        assert bili.request(h) is None  # answered at once, while the worker is still busy
        assert json.loads(h.response.content)["store"] is True
        assert f.request.content == ANTH_BODY  # the turn waits for the worker, not the loop
        gate.set()
        await busy
        await pending
        assert json.loads(f.request.content)["messages"][0]["content"].startswith("<acp ")

    asyncio.run(main())
    bili.keeper.stop()


def test_a_store_that_fails_is_retried_after_a_pause_and_recovers(tmp_path, monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(keeper_mod.time, "monotonic", lambda: clock[0])
    attempts = []
    real = []

    def make(data_dir):
        attempts.append(data_dir)
        if len(attempts) < 3:
            raise StoreError("cannot open the store at X: the disk is full (full)", "disk full", "free some space")
        from bili_addon.kernel.turn import Engine
        from bili_addon.store import Store
        real.append(Engine(Store(tmp_path)))
        return real[-1]

    k = Keeper(make)
    with caplog.at_level(logging.INFO, logger="bili"):
        k.open(str(tmp_path))
        assert not k.ok and k.status()["cause"] == "disk full" and k.status()["hint"] == "free some space"
        # within the pause: nothing is tried, the work is counted as forwarded unchanged
        assert k.run(lambda eng: "done") is None and len(attempts) == 1
        clock[0] += keeper_mod.RETRY_BROKEN
        assert k.run(lambda eng: "done") is None and len(attempts) == 2  # tried again: still full
        clock[0] += keeper_mod.RETRY_BROKEN
        # the store opens; it is usable again once it has taken a write
        assert k.run(lambda eng: eng.store.set_flags(eng.session("s").row, expect=0)) == 1
        assert k.ok and k.counts["forwarded_unchanged"] == 2 and k.counts["resumed"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    # the cause once (not once per attempt), then the recovery; never an error
    assert [("disk is full" in r.getMessage(), "usable again" in r.getMessage()) for r in warnings] == [
        (True, False), (False, True)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    k.stop()


def test_an_internal_error_in_work_fails_open_and_is_counted(bili, caplog):
    with caplog.at_level(logging.ERROR, logger="bili"):
        assert bili.keeper.run(lambda eng: 1 / 0) is None
    assert bili.keeper.counts["forwarded_unchanged"] == 1 and bili.keeper.ok
    assert "internal error" in caplog.text


@pytest.mark.parametrize("behind", [False, True], ids=["write-first", "write-behind"])
@pytest.mark.parametrize("kind", ["locked", "read-only"])
def test_a_failed_turn_write_goes_out_unchanged_and_health_says_why(bili, monkeypatch, kind, behind):
    """Written before its request goes, a turn whose write fails goes out unchanged; written behind
    it (the proxy's way), the request has gone with its refs: the failure drops what the engine
    holds of the session (its next turn reads the store again), is counted, and health says why."""
    def boom(*a, **k):
        raise StoreError(f"cannot write the store at X: {kind}", kind, "a hint")

    assert bili.engine.write_behind and bili.engine.store.exclusive  # (the proxy's engine)
    bili.engine.write_behind = behind
    monkeypatch.setattr(bili.engine.store, "commit_turn", boom)
    f = model_flow(ANTH_BODY, headers=session_headers())
    bili.request(f)
    if behind:
        assert f.request.content != ANTH_BODY and b"<acp " in f.request.content
        assert bili.keeper.counts["writes_dropped"] == 1 and bili.keeper.counts["forwarded_unchanged"] == 0
        assert not bili.keeper.ok or bili.engine is None or "s1" not in bili.engine.sessions
        # the next request finds the store down: it goes out unchanged
        g = model_flow(ANTH_BODY, headers=session_headers())
        bili.request(g)
        assert g.request.content == ANTH_BODY
    else:
        assert f.request.content == ANTH_BODY
    h = health_flow()
    bili.request(h)
    doc = json.loads(h.response.content)
    assert doc["store"] is False and doc["store_cause"] == kind and doc["store_hint"] == "a hint"
    # a locked store keeps its engine (the lock passes); a broken one is reopened on a later try
    assert (bili.engine is not None) == (kind == "locked")


class _Store:
    backend, where, writes = "fake", "memory", 0

    def __init__(self, log: list):
        self.log = log

    def close(self):
        self.log.append("closed")

    def release(self):
        pass


class _Engine:
    def __init__(self, log: list):
        self.store, self.log, self.pending = _Store(log), log, False

    def write_pending(self):
        if self.pending:
            self.pending = False
            self.log.append("turn written")


def test_stopping_runs_the_queued_bookkeeping_and_skips_maintenance():
    """An answer's bookkeeping queued behind a busy worker when the proxy stops (an answer that ended
    at Ctrl-C: its proxy calls recorded, its chain) is written before the store closes; it used to be
    cancelled, not even counted.  A queued retention pass (it loses nothing) is left for the next start."""
    log: list = []
    k = Keeper(lambda d: _Engine(log))
    k.open("d")
    k.start()
    busy, go = threading.Event(), threading.Event()
    k.submit(lambda eng: (busy.set(), go.wait(5)))
    busy.wait(5)
    k.submit(lambda eng: log.append("maintenance"), None)
    k.submit(lambda eng: log.append("answer recorded"))
    threading.Timer(0.05, go.set).start()  # (the worker's first job ends while stop waits)
    k.stop(last=lambda eng: log.append("last"))
    assert log == ["answer recorded", "last", "closed"]
    assert k.counts["writes_dropped"] == 0


def test_reopening_the_store_writes_the_turn_left_for_after_its_request_first():
    """The data directory (or the store URL) changed while a turn's write waited for the worker (its
    request had left with its refs): the write goes into the store it was made for, before it closes."""
    log: list = []
    k = Keeper(lambda d: _Engine(log))
    k.open("a")
    k.engine.pending = True
    k.open("b")
    assert log == ["turn written", "closed"] and k.data_dir == "b" and k.ok
