"""The response path: SSE reassembly, the tag-echo filter, per-lane event rewriting, usage."""

from __future__ import annotations

import logging
from typing import Any, Callable

import msgspec

from bili_addon import printable
from bili_addon.stream.lanes import KEEP, RESPONSES, LaneResponse, Usage
from bili_addon.stream.sse import Decoder, SSEEvent, SSEStream

log = logging.getLogger("bili")

__all__ = ["ResponseRewriter", "Usage", "Decoder", "SSEStream"]

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


class ResponseRewriter:
    """Per response: turns SSE events, WebSocket frames or a JSON body into their cleaned form.

    With ``rewrite=False`` (observe mode) it only reads usage; every byte passes unchanged.
    """

    def __init__(self, lane: str, rewrite: bool = True, marker: str = ""):
        self.lane: LaneResponse = RESPONSES[lane](marker if rewrite else "")
        self.rewrite = rewrite
        self._events: dict[int, SSEEvent] = {}
        self.broken = False  # an internal error: the rest of the stream passes as it comes
        # sees every decoded event (or the whole JSON answer) as the upstream sent it, before any
        # rewriting (server-side chains: kernel/chains.py); its failure is logged, never the answer's
        self.tap: Callable[[Any], None] | None = None

    def _tap(self, obj: Any) -> None:
        if self.tap is not None:
            try:
                self.tap(obj)
            except Exception as e:
                log.exception("[bili] %s answer: tap failed (%s); answer unaffected", self.lane.lane, printable(e))
                self.tap = None

    @property
    def usage(self) -> Usage:
        return self.lane.usage

    @property
    def stripped(self) -> int:
        return self.lane.stripped

    @property
    def echoes(self) -> list[str]:
        """The tag echoes taken out of the model's prose, in order."""
        return self.lane.echoes

    @property
    def finished(self) -> bool:
        """The answer's final event went through (completed, incomplete or done)."""
        return self.lane.finished

    @property
    def calls(self) -> list[tuple[str, str, str]]:
        """Proxy tool calls the model made in this answer: (call key, name, arguments)."""
        return self.lane.calls

    # -- SSE -----------------------------------------------------------------------------------
    def sse_event(self, raw: bytes) -> list[bytes]:
        """The events to send for one SSE event.  Fail open: after an internal error the events
        held back so far are released and the rest of the stream passes unchanged (nothing else
        would catch it: the agent's answer would break)."""
        if self.broken:
            return [raw]
        try:
            return self._sse_event(raw)
        except Exception as e:
            log.exception("[bili] %s stream: internal error (%s); the rest of the answer passes unchanged",
                          self.lane.lane, printable(e))
            self.broken = True
            return [*self._release(), raw]

    def _release(self) -> list[bytes]:
        """After an internal error: the events held back, with the text their filters still hold
        put back as it came."""
        try:
            held = []
            for b in self.lane.blocks.values():
                if b.held is not None:
                    if b.filter.buf and b.text_of is not None:
                        b.text_of.set(b.text_of.get() + b.filter.buf)
                    held.append(b.held)
                    b.held = None
            return self._serialize(held) if self.rewrite else []
        except Exception:
            return []

    def _sse_event(self, raw: bytes) -> list[bytes]:
        ev = SSEEvent(raw)
        data = ev.data
        if data is None:
            return [raw]
        if data.strip() == b"[DONE]":
            return [*self._serialize(self.lane.close_all()), raw] if self.rewrite else [raw]
        try:
            obj = _dec.decode(data)
        except msgspec.DecodeError:
            return [raw]
        if not isinstance(obj, dict):
            return [raw]
        self._tap(obj)
        outs = self.lane.event(obj)
        if not self.rewrite:
            return [raw]
        self._events[id(obj)] = ev
        result = []
        for o in outs:
            if o is KEEP:
                result.append(raw)
            else:
                result.extend(self._serialize([o]))
        return result

    def sse_finish(self) -> list[bytes]:
        """The stream ended: release anything still held (a stream cut mid-block)."""
        if self.broken:
            return []
        try:
            outs = self.lane.close_all()
            return self._serialize(outs) if self.rewrite else []
        except Exception as e:
            log.exception("[bili] %s stream: internal error at its end (%s)", self.lane.lane, printable(e))
            self.broken = True
            return []

    def _serialize(self, outs: list) -> list[bytes]:
        result = []
        for o in outs:
            ev = self._events.pop(id(o), None)
            data = _enc.encode(o)
            result.append(ev.with_data(data) if ev is not None else b"data: " + data + b"\n\n")
        return result

    def stream(self, decoder: Decoder | None = None) -> SSEStream:
        return SSEStream(self.sse_event, self.sse_finish, decoder)

    # -- WebSocket frames (one event each) -------------------------------------------------------
    def ws_frame(self, raw: bytes) -> bytes | None:
        """The frame to send instead of ``raw`` (None: send it unchanged).

        A WebSocket frame cannot be held back or split, so events pass one for one: the filter
        carries a possible tag start to the next frame instead of holding the frame.
        """
        try:
            obj = _dec.decode(raw)
        except msgspec.DecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        self._tap(obj)
        self.lane.hold_events = False
        outs = self.lane.event(obj)
        if not self.rewrite or outs == [KEEP]:
            return None
        assert len(outs) == 1, "without holding, one event in is one event out"
        return raw if outs[0] is KEEP else _enc.encode(outs[0])

    # -- a whole JSON body -----------------------------------------------------------------------
    def json_body(self, content: bytes) -> bytes | None:
        try:
            obj: Any = _dec.decode(content)
        except msgspec.DecodeError:
            return None
        self._tap(obj)
        changed = self.lane.body(obj)
        return _enc.encode(obj) if changed and self.rewrite else None
