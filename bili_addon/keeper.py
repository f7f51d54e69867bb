"""The store's keeper: the engine and its SQLite store run on one worker thread, never on
mitmproxy's event loop, and a store that cannot be opened or written never stops the proxy.

While the store is unusable (cannot be opened, disk full, read-only, locked by another process)
every request is forwarded unchanged at once, the cause is logged once as a warning in plain words
with a hint, ``/__bili/health`` says ``"store": false`` with the reason, and the store is tried
again on the requests that follow (after a short pause) until it works: bili then resumes by
itself.  A write that could not be made is counted in the stats, never retried blindly: the turn
it belonged to went out unchanged, and the next turn records what the store is missing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from bili_addon import printable
from bili_addon.store import SessionBusy, StaleSession, StoreError

if TYPE_CHECKING:
    from bili_addon.kernel.turn import Engine

log = logging.getLogger("bili")

T = TypeVar("T")

RETRY_LOCKED = 1.0  # seconds before a locked store is tried again (requests meanwhile pass at once)
RETRY_BROKEN = 2.0  # ... a full, read-only or unopenable one
TURN, DROPPED = "forwarded_unchanged", "writes_dropped"  # the counters of work the store could not take


class Keeper:
    """Owns the engine: opens it, runs every piece of work that touches it on one worker thread
    (in order), notices store failures, reopens the store when it may work again."""

    def __init__(self, make_engine: Callable[[str], "Engine"]):
        self.make_engine = make_engine
        self.data_dir = ""
        self.engine: Engine | None = None
        self.error: StoreError | None = None  # why the store is not usable now (None: it is)
        self.since = 0.0
        self.retry_at = 0.0
        self.counts = {"forwarded_unchanged": 0, "writes_dropped": 0, "stale_retries_exhausted": 0, "resumed": 0,
                       "session_busy": 0}
        self._writes_at_error = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()  # serialises the inline path (tests, start-up) with the worker
        self.latency_ms: float | None = None  # the store's last measured round trip (health shows it)
        self._probing = False
        self._stopping = False  # (stop: the queued jobs run; maintenance among them is skipped)

    # -- state -----------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self.engine is not None and self.error is None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "data_dir": self.data_dir, **self.counts}
        eng = self.engine
        if eng is not None:
            out.update(backend=eng.store.backend, where=eng.store.where, latency_ms=self.latency_ms)
        if self.error is not None:
            out.update(reason=str(self.error), cause=self.error.kind, hint=self.error.hint,
                       since=round(self.since, 3))
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """From now on work runs on the worker thread (mitmproxy is running)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bili-store")

    def stop(self, last: Callable[["Engine"], Any] | None = None) -> None:
        """Stop the worker; ``last``: work to run on the engine before its store closes."""
        pool, self._pool = self._pool, None
        if pool is not None:
            # what is queued runs, in order (an answer's bookkeeping, a turn's write): only maintenance
            # (work that loses nothing: count None) is skipped, which a queued job learns here
            self._stopping = True
            pool.shutdown(wait=True)
            self._stopping = False
        eng = self.engine
        if eng is not None and ((last is not None and self.ok) or eng.pending):
            self.run(last or _write_pending, DROPPED)  # (a turn's write left for after its request first)
        self._close()

    def open(self, data_dir: str) -> None:
        """(Re)open the store at ``data_dir``; a failure is a warning and the proxy serves on."""
        if self._pool is not None:
            self._pool.submit(self._open, data_dir)
        else:
            with self._lock:
                self._open(data_dir)

    def _close(self) -> None:
        eng, self.engine = self.engine, None
        if eng is not None:
            eng.store.close()

    def _open(self, data_dir: str) -> None:
        if self.engine is not None and self.engine.pending:  # (a turn's write whose request left: before the store goes)
            self._run(_write_pending, DROPPED)
        self._close()
        self.data_dir, self.error = data_dir, None
        try:
            self.engine = self._make(data_dir)
        except StoreError as e:
            self._down(e)
            return
        log.info("[bili] store at %s (%s)", self.engine.store.where, self.engine.store.backend)

    def _make(self, data_dir: str) -> "Engine":
        try:
            return self.make_engine(data_dir)
        except StoreError:
            raise
        except Exception as e:  # a bug must not stop the proxy either: it serves without the store
            log.warning("[bili] opening the store at %s failed", data_dir, exc_info=True)
            raise StoreError(f"cannot open the store at {data_dir}: internal error ({type(e).__name__}: {e})") from e

    # -- running work ----------------------------------------------------------------------------
    @property
    def offloading(self) -> bool:
        return self._pool is not None

    def run(self, fn: Callable[["Engine"], T], count: str | None = TURN, *, queued: bool = False) -> T | None:
        """Run ``fn(engine)`` here and now (on the worker, or inline outside mitmproxy's loop).
        None when the store is unusable or failed; ``count`` names the counter that says so (a turn
        forwarded unchanged, an answer's bookkeeping dropped).  A turn that left its store write for
        after its request (``Engine.write_behind``) has it written by a job of its own on the worker
        (inline: right after; ``queued``: the caller queues that job, :meth:`call`), and before any
        other work of the engine in any case."""
        with self._lock:
            out = self._run(fn, count)
            eng = self.engine
            if eng is not None and eng.pending and not queued:
                if self._pool is not None:
                    self._write_later()
                else:
                    self._run(_write_pending, DROPPED)
            return out

    def _write_later(self) -> None:
        pool = self._pool
        if pool is not None:
            pool.submit(self._logged, _write_pending, DROPPED)

    def _run(self, fn: Callable[["Engine"], T], count: str | None) -> T | None:
        with self._lock:
            eng = self._usable()
            if eng is None:
                self._count(count)
                return None
            try:
                try:
                    eng.write_pending()  # a turn's write left for after its request: before anything else
                    out = fn(eng)
                finally:
                    if not eng.pending:  # (a turn's write waiting for its job holds its session until then)
                        eng.store.release()  # the sessions this work held (another instance's turn may wait)
            except SessionBusy as e:  # another instance works on the session: this request passes
                self.counts["session_busy"] += 1
                self._count(count)
                log.warning("[bili] %s; %s", printable(e), "forwarding unchanged" if count == TURN else "not recorded")
                return None
            except StaleSession as e:  # another process kept changing the session: this one passes
                self.counts["stale_retries_exhausted"] += 1
                self._count(count)
                log.warning("[bili] %s; %s", printable(e), "forwarding unchanged" if count == TURN else "not recorded")
                return None
            except StoreError as e:
                self._count(count)
                self._down(e)
                return None
            except Exception as e:  # fail open: nothing of ours may fail the agent's turn
                self._count(count)
                log.exception("[bili] internal error: %s; %s", printable(e),
                              "forwarding unchanged" if count == TURN else "not recorded")
                return None
            self._up(eng)
            return out

    def _count(self, name: str | None) -> None:
        if name:
            self.counts[name] += 1

    async def call(self, fn: Callable[["Engine"], T], count: str | None = TURN) -> T | None:
        """``run`` on the worker thread, awaited from the event loop (which never waits on SQLite).
        A turn's store write left for after its request is queued once the caller has had the
        result and the loop has run on (mitmproxy sends the request as its hook returns: the write
        follows it onto the worker, not the other way round)."""
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: self.run(fn, count, queued=True))
        finally:
            eng = self.engine
            if eng is not None and eng.pending:
                loop.call_soon(self._write_later)

    def submit(self, fn: Callable[["Engine"], Any], count: str | None = DROPPED) -> Future | None:
        """Run bookkeeping on the worker without waiting for it (inline outside mitmproxy); ``count``:
        the counter that says it could not run (None: maintenance, nothing lost)."""
        if self._pool is None:
            self.run(fn, count)
            return None
        return self._pool.submit(self._logged, fn, count)

    def _logged(self, fn: Callable[["Engine"], Any], count: str | None = DROPPED) -> None:
        if count is None and self._stopping:  # maintenance while the proxy stops: left for its next start
            return
        try:
            self.run(fn, count)
        except Exception as e:  # nothing may escape a fire-and-forget job unseen
            log.exception("[bili] background store work failed: %s", printable(e))

    def probe(self) -> None:
        """Measure the store's round trip on the worker, without waiting (health reads the figure)."""
        if self._pool is None or self._probing or not self.ok:
            return
        self._probing = True

        def ping() -> None:
            try:
                with self._lock:
                    eng = self.engine
                    if eng is not None and self.error is None:
                        self.latency_ms = round(eng.store.ping() * 1000, 3)
            except Exception as e:  # a failing store shows in the turns' path; health just has no figure
                log.debug("[bili] store ping failed: %s", e)
            finally:
                self._probing = False
        self._pool.submit(ping)

    # -- failure and recovery --------------------------------------------------------------------
    def _usable(self) -> "Engine | None":
        if self.error is not None and not (self.engine is not None and self.engine.pending):
            # (a turn's write whose request left is tried whatever the pause: it holds its session)
            if time.monotonic() < self.retry_at:
                return None
            self.retry_at = time.monotonic() + self._pause(self.error)  # one attempt per pause
            if self.engine is None:
                try:
                    self.engine = self._make(self.data_dir)
                except StoreError as e:
                    self._down(e)
                    return None
        return self.engine

    @staticmethod
    def _pause(e: StoreError) -> float:
        return RETRY_LOCKED if e.kind == "locked" else RETRY_BROKEN

    def _down(self, e: StoreError) -> None:
        """The store failed: say why (once per cause), pass requests through, try again later."""
        fresh = self.error is None or self.error.kind != e.kind
        if self.error is None:
            self.since = time.time()
        self.error = e
        self.retry_at = time.monotonic() + self._pause(e)
        if e.kind != "locked":
            self._close()  # reopened on the next attempt: nothing cached outlives a broken store
            self._writes_at_error = 0
        elif self.engine is not None:
            self._writes_at_error = self.engine.store.writes
        if fresh:
            hint = f" ({e.hint})" if e.hint else ""
            log.warning("[bili] %s; requests pass through unchanged until it works again%s", printable(e), hint)
        else:
            log.debug("[bili] still unusable: %s", printable(e))

    def _up(self, eng: "Engine") -> None:
        """Work succeeded; once the store has taken a write again it is usable again."""
        if self.error is not None and eng.store.writes > self._writes_at_error:
            log.warning("[bili] the store at %s is usable again (it was: %s); storing resumes", eng.store.where,
                        self.error.kind)
            self.error = None
            self.counts["resumed"] += 1
        elif self.error is None:
            self._writes_at_error = eng.store.writes


def _write_pending(eng: "Engine") -> None:
    eng.write_pending()  # (run writes it before any work: this job makes it happen at once)


__all__ = ["Keeper"]
