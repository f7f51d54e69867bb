"""The mitmproxy addon: options, hooks, fail-open.  The work happens in :mod:`bili_addon.kernel`."""

from __future__ import annotations

import logging
import time

import msgspec
from mitmproxy import ctx, http

from bili_addon import admin
from bili_addon.kernel.turn import Engine, TurnResult
from bili_addon.store import Store, StoreError, default_data_dir
from bili_addon.wire import LANES, Lane, detect_lane, is_responses_websocket

log = logging.getLogger("bili")

MODES = ("fold", "observe", "passthrough")


class Bili:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.store_ok = False
        self.mode = "fold"
        self._data_dir = ""

    # -- options -------------------------------------------------------------------------------
    def load(self, loader) -> None:
        loader.add_option("bili_data_dir", str, "", "Where the store lives (default: the XDG data dir).")
        loader.add_option(
            "bili_mode", str, "fold",
            "fold: everything; observe: ledger and stats, body forwarded unchanged; "
            "passthrough: byte-exact forwarding, nothing recorded.",
            choices=MODES,
        )

    def configure(self, updated: set[str]) -> None:
        if "bili_mode" in updated:
            self.mode = ctx.options.bili_mode
        if "bili_data_dir" in updated or self.engine is None and not self._data_dir:
            self._open_store(ctx.options.bili_data_dir or str(default_data_dir()))

    def _open_store(self, data_dir: str) -> None:
        if self.engine is not None:
            self.engine.store.close()
        self.engine, self.store_ok, self._data_dir = None, False, data_dir
        try:
            self.engine = Engine(Store(data_dir))
            self.store_ok = True
            log.info("[bili] store at %s, mode %s", self.engine.store.path, self.mode)
        except StoreError as e:
            log.error("[bili] %s; requests pass through unchanged", e)

    def done(self) -> None:
        if self.engine is not None:
            self.engine.store.close()

    # -- hooks ---------------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow) -> None:
        if admin.is_admin(flow):
            admin.handle(flow, self)
            return
        if self.mode == "passthrough" or self.engine is None:
            return
        lane = detect_lane(flow.request.method, flow.request.path)
        if lane is None:
            return
        self._rewrite_request(flow, lane)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if self.mode == "passthrough" or self.engine is None or flow.websocket is None:
            return
        msg = flow.websocket.messages[-1]
        if not msg.from_client or not msg.is_text or not is_responses_websocket(flow.request.path):
            return
        raw = msg.content
        if b'"response.create"' not in raw:
            return
        out = self._process(raw, LANES["responses"], flow.request.headers, where="ws")
        if out is not None:
            msg.content = out

    # -- the body ------------------------------------------------------------------------------
    def _rewrite_request(self, flow: http.HTTPFlow, lane: Lane) -> None:
        try:
            raw = flow.request.get_content(strict=True)
        except ValueError as e:
            log.warning("[bili] %s: cannot decode request body (%s); forwarding unchanged", flow.request.path, e)
            return
        if not raw:
            return
        out = self._process(raw, lane, flow.request.headers, where="http")
        if out is not None:
            flow.request.content = out  # re-encoded with the request's own content-encoding

    def _process(self, raw: bytes, lane: Lane, headers, where: str) -> bytes | None:
        assert self.engine is not None
        t0 = time.perf_counter()
        res: TurnResult | None = None
        try:
            res = self.engine.process(raw, lane, headers, render=self.mode == "fold")
        except (msgspec.DecodeError, ValueError) as e:
            log.info("[bili] %s %s: body not understood (%s); forwarding unchanged", lane.name, where, e)
            return None
        except StoreError as e:
            log.error("[bili] %s; forwarding unchanged", e)
            return None
        except Exception as e:  # fail open: the agent's turn never fails because of us
            log.exception("[bili] internal error on %s %s: %s; forwarding unchanged", lane.name, where, e)
            return None
        ms = (time.perf_counter() - t0) * 1000
        out = res.body
        if not res.session:
            log.info("[bili] lane=%s %s msgs=%d: %s; forwarding unchanged", lane.name, where, res.messages, res.note)
            return None
        log.info(
            "[bili] session=%s lane=%s msgs=%d refs new=%d known=%d tagged=%d bytes in=%d out=%d addon=%.1fms",
            res.session, lane.name, res.messages, res.refs_new, res.refs_known, res.tagged,
            len(raw), len(out) if out is not None else len(raw), ms,
        )
        return out

    # -- admin ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        if self.engine is None:
            return {"sessions": [], "store": False}
        store = self.engine.store
        return {
            "sessions": [
                {
                    "id": r.id, "agent": r.agent, "lane": r.lane, "requests": r.requests,
                    "messages": r.messages, "refs": store.ref_count(r.id), "last_seen": r.last_seen,
                }
                for r in store.sessions()
            ],
            "store": True,
        }
