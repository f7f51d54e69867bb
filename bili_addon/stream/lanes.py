"""The way back, per lane: echo-filtered prose, untouched tool calls, usage.

One ``*Response`` object lives for one upstream response.  ``event(obj)`` takes one decoded event
(an SSE ``data`` payload or a WebSocket frame) and returns the events to send instead.  Prose goes
through an :class:`EchoFilter` per block; when a filter holds text back, the event that produced
it is held too (one event of latency at most) so the released text can still be merged into it
when the block ends: no event is ever invented or dropped, and every aggregate (``*.done``,
``response.completed``) equals the concatenation of the deltas the client actually received.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from bili_addon import printable
from bili_addon.kernel.native import bili_tool
from bili_addon.kernel.prompts import TOOL_NAMES
from bili_addon.stream.echo import EchoFilter, strip_echoes
from bili_addon.wire.base import compact_json
from bili_addon.wire.gemini import function_call_key

log = logging.getLogger("bili")

Event = dict[str, Any]
KEEP = object()  # "send the original bytes of this event"


class Slot:
    """Where one event keeps its prose: a container and a key."""

    __slots__ = ("container", "key")

    def __init__(self, container: dict, key: str):
        self.container, self.key = container, key

    def get(self) -> str:
        return self.container[self.key]

    def set(self, text: str) -> None:
        self.container[self.key] = text


@dataclass
class Usage:
    input: int = 0  # all prompt tokens, cached or not
    cache_read: int = 0
    cache_write: int = 0
    output: int = 0
    seen: bool = False
    # the part of cache_write made for 1 hour (Anthropic's ``usage.cache_creation.ephemeral_1h_input_tokens``);
    # None: the provider did not say (kernel/tools.py fills it in from what was sent, ``split``: "sent")
    cache_write_1h: int | None = None
    split: str = ""  # "reported" (the provider's split) | "sent" (from the request's breakpoints) | ""
    # the provider gave a figure of its cache reads (0 included): without one, ``cache_read`` is 0 for
    # the money, but it is no evidence of a miss for the cache model (kernel/calibration.py)
    cache_known: bool = False

    @property
    def cache_share(self) -> float | None:
        return self.cache_read / self.input if self.input else None

    def read_openai(self, u: Any, inp: str, details: str, out: str) -> None:
        """OpenAI's usage shapes: input counts every prompt token, cached ones in the details."""
        if not isinstance(u, dict):
            return
        self.seen = True
        self.input = _int(u.get(inp))
        det = u.get(details)
        if isinstance(det, dict) and "cached_tokens" in det:
            self.cache_read, self.cache_known = _int(det.get("cached_tokens")), True
        elif "prompt_cache_hit_tokens" in u:  # (DeepSeek's field, beside no details)
            self.cache_read, self.cache_known = _int(u.get("prompt_cache_hit_tokens")), True
        else:
            self.cache_read = 0
        self.output = _int(u.get(out))


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _list(v: Any) -> list:
    """A value that should be an array, or nothing (an upstream may send anything)."""
    return v if isinstance(v, list) else []


def _hashable(v: Any) -> Any:
    """A block key from the upstream's own fields (an index, an item id), usable as a dict key
    whatever JSON it is."""
    try:
        hash(v)
    except TypeError:
        return compact_json(v)
    return v


class _Block:
    """Echo filter state of one prose block, plus the event it may be holding."""

    __slots__ = ("filter", "held", "text_of", "emitted")

    def __init__(self) -> None:
        self.filter = EchoFilter()
        self.held: Event | None = None
        self.text_of: Slot | None = None  # where the held event keeps its prose
        self.emitted = ""


class LaneResponse:
    lane = ""

    def __init__(self, marker: str = "") -> None:
        self.blocks: dict[Any, _Block] = {}
        self.usage = Usage()
        self.echoes: list[str] = []  # the tag echoes taken out of the model's prose, in order
        self.marker = marker  # a visibility line put before the first prose of the answer
        self.calls: list[tuple[str, str, str]] = []  # proxy tool calls: (call key, name, arguments)
        self._partial: dict[Any, list[str]] = {}
        # False where an event cannot be held back (WebSocket frames pass one at a time): each event
        # then carries what the filter releases, and the block's end returns the rest (``self.rest``)
        self.hold_events = True
        self.rest = ""
        self.finished = False  # the answer's final event came (a stream that has one: Responses)
        # bili's tool names the agent's own tools have (not offered then: a call of one is the agent's)
        self.shadowed: tuple[str, ...] = ()
        # called with (name, arguments, call id) for a call of one of bili's tools under the agent's
        # own name for it (its MCP server's: ``mcp__bili__compress``), when its arguments are whole
        self.on_native: Callable[[str, Any, str], None] | None = None

    @property
    def stripped(self) -> int:
        """How many tag echoes were taken out of the model's prose."""
        return len(self.echoes)

    def _call(self, key: str, name: Any, args: Any) -> None:
        if isinstance(name, str) and name in TOOL_NAMES and key and name not in self.shadowed:
            if not isinstance(args, str):
                args = compact_json({} if args is None else args)
            self.calls.append((key, name, args))
        elif self.on_native is not None and bili_tool(name) is not None:
            # one of bili's tools the agent has natively (MCP): which conversation asked for it is
            # known here, before the agent runs it (kernel/native.py)
            try:
                self.on_native(name, args, key)
            except Exception as e:  # (never the answer's failure)
                log.warning("[bili] a native tool call could not be noted (%s)", printable(e))

    # the generic hold-and-merge machinery ------------------------------------------------------
    def _prose(self, key: Any, ev: Event, slot: Slot) -> list:
        """Feed one prose delta; returns the events to send now (a previously held one first)."""
        b = self.blocks.get(key)
        if b is None:  # one filter per block, made once
            b = self.blocks[key] = _Block()
        original = slot.get()
        text = original
        if self.marker:
            text, self.marker = self.marker + "\n" + text, ""
        out_text = b.filter.feed(text)
        out: list = []
        if b.held is not None:
            out.append(b.held)
            b.held = None
        b.emitted += out_text
        if out_text != original:
            slot.set(out_text)
        if b.filter.buf and self.hold_events:
            b.held, b.text_of = ev, slot
        else:
            out.append(ev if out_text != original else KEEP)
        return out

    def _close(self, key: Any) -> list:
        """End of a block: merge what the filter still holds into the held event and send it."""
        b = self.blocks.get(key)
        if b is None:
            return []
        rest = b.filter.flush()
        self.echoes += b.filter.removed
        b.filter.removed = []
        out: list = []
        if b.held is not None:
            if rest:
                assert b.text_of is not None
                b.text_of.set(b.text_of.get() + rest)
                b.emitted += rest
            out.append(b.held)
            b.held = None
        elif rest:
            b.emitted += rest
            self.rest = rest
        return out

    def _prose_spots(self, ev: Event, spots: list[tuple[Any, Slot]], finishing: list, touched: list = ()) -> list:
        """One event with prose in ``spots`` (block key, where the text is), some blocks finishing.
        A single spot may be held back; several in one event (n > 1 choices) are filtered whole.
        ``touched``: the blocks the event belongs to (a choice's, a candidate's): one of them whose
        prose is held and that this event carries none of (a tool call's chunk) ends its prose run
        first, so the held event goes out before it, not after (Gemini rebuilds its parts in the
        order they come)."""
        early = [e for k in touched if k not in finishing and not any(k == key for key, _slot in spots)
                 and (b := self.blocks.get(k)) is not None and b.held is not None
                 for e in self._close(k)] if touched and self.blocks else []
        out = self._spots(ev, spots, finishing)
        return early + out if early else out

    def _spots(self, ev: Event, spots: list[tuple[Any, Slot]], finishing: list) -> list:
        if len(spots) == 1:
            out = self._prose(spots[0][0], ev, spots[0][1])
        elif spots:
            changed = False
            held = []  # (a block's event held back before this one goes first: its text comes first)
            for key, slot in spots:
                b = self.blocks.get(key)
                if b is None:  # one filter per block, made once
                    b = self.blocks[key] = _Block()
                elif b.held is not None:
                    held.append(b.held)
                    b.held = None
                text = slot.get()
                t = b.filter.feed(text) + b.filter.flush()
                self.echoes += b.filter.removed
                b.filter.removed = []
                if t != text:
                    slot.set(t)
                    changed = True
            out = [*held, ev if changed else KEEP]
        else:
            out = [KEEP]
        return self._close_around(finishing, ev, out) if finishing else out

    def _close_around(self, keys: list, ev: Event, out: list) -> list:
        """Close blocks at a finishing event: older held events go first, this one last."""
        closes = [e for k in keys for e in self._close(k)]
        return [e for e in closes if e is not ev] + out + [e for e in closes if e is ev]

    def _clean(self, container: dict, key: str) -> bool:
        """Clean one whole prose value (a non-streamed answer); the marker goes before the first."""
        v = container.get(key)
        if not isinstance(v, str):
            return False
        c = strip_echoes(v, removed=self.echoes)
        if self.marker:
            c, self.marker = self.marker + "\n" + c, ""
        if c != v:
            container[key] = c
            return True
        return False

    def close_all(self) -> list:
        out: list = []
        for key in list(self.blocks):
            out.extend(self._close(key))
        for call_id, name, args in self._partial.values():
            self._call(call_id, name, args or "{}")
        self._partial.clear()
        return out

    def event(self, ev: Event) -> list:
        raise NotImplementedError

    def body(self, obj: Any) -> bool:
        """Clean a non-streamed JSON response in place; True when something changed."""
        raise NotImplementedError


# -- Anthropic Messages ------------------------------------------------------------------------


class AnthropicResponse(LaneResponse):
    lane = "anthropic"

    def _usage(self, u: Any) -> None:
        if not isinstance(u, dict):
            return
        self.usage.seen = True
        if "input_tokens" in u or "cache_read_input_tokens" in u:
            fresh = _int(u.get("input_tokens"))
            read = _int(u.get("cache_read_input_tokens"))
            write = _int(u.get("cache_creation_input_tokens"))
            if fresh or read or write:
                self.usage.input = fresh + read + write
                self.usage.cache_read, self.usage.cache_write = read, write
                self.usage.cache_known = "cache_read_input_tokens" in u or "cache_creation_input_tokens" in u
        split = u.get("cache_creation")  # the writes by lifetime (message_start's usage, a whole answer's)
        if isinstance(split, dict) and ("ephemeral_1h_input_tokens" in split or "ephemeral_5m_input_tokens" in split):
            self.usage.cache_write_1h = _int(split.get("ephemeral_1h_input_tokens"))
            self.usage.split = "reported"
        if "output_tokens" in u:
            self.usage.output = _int(u.get("output_tokens"))

    def event(self, ev: Event) -> list:
        kind = ev.get("type")
        index = _hashable(ev.get("index"))
        if kind == "content_block_delta":
            d = ev.get("delta")
            if isinstance(d, dict) and d.get("type") == "text_delta" and isinstance(d.get("text"), str):
                return self._prose(index, ev, Slot(d, "text"))
            if isinstance(d, dict) and d.get("type") == "input_json_delta" and index in self._partial:
                self._partial[index][2] += str(d.get("partial_json") or "")
            return [KEEP]
        if kind == "content_block_stop":
            done = self._partial.pop(index, None)
            if done is not None:
                self._call(done[0], done[1], done[2] or "{}")
            return [*self._close(index), KEEP]
        if kind == "message_start":
            msg = ev.get("message")
            if isinstance(msg, dict):
                self._usage(msg.get("usage"))
        elif kind == "message_delta":
            self._usage(ev.get("usage"))
        elif kind == "content_block_start":
            cb = ev.get("content_block")
            if isinstance(cb, dict) and cb.get("type") == "tool_use":
                start = cb.get("input")
                self._partial[index] = [
                    str(cb.get("id") or ""), cb.get("name"), compact_json(start) if start else "",
                ]
            if isinstance(cb, dict) and cb.get("type") == "text" and cb.get("text"):
                if self._clean(cb, "text"):
                    return [ev]
        elif kind == "message_stop":
            return [*self.close_all(), KEEP]
        return [KEEP]

    def body(self, obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        self._usage(obj.get("usage"))
        changed = False
        for block in _list(obj.get("content")):
            if isinstance(block, dict) and block.get("type") == "text":
                changed |= self._clean(block, "text")
            elif isinstance(block, dict) and block.get("type") == "tool_use":
                self._call(str(block.get("id") or ""), block.get("name"), block.get("input"))
        return changed


# -- OpenAI Chat Completions -------------------------------------------------------------------


class ChatResponse(LaneResponse):
    lane = "chat"

    def _usage(self, u: Any) -> None:
        self.usage.read_openai(u, "prompt_tokens", "prompt_tokens_details", "completion_tokens")

    def event(self, ev: Event) -> list:
        self._usage(ev.get("usage"))
        choices = ev.get("choices")
        if not isinstance(choices, list):
            return [KEEP]
        finishing: list = []
        text_choices = []
        touched = []  # the choices a tool call's chunk (which ends their prose run) is of
        for ci, ch in enumerate(choices):
            if not isinstance(ch, dict):
                continue
            d = ch.get("delta")
            if isinstance(d, dict) and (_list(d.get("tool_calls")) or d.get("function_call")):
                touched.append(_hashable(ch.get("index", ci)))
            for tc in _list(d.get("tool_calls") if isinstance(d, dict) else None):
                if isinstance(tc, dict):
                    entry = self._partial.setdefault((ci, _hashable(tc.get("index", 0))), ["", "", ""])
                    fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
                    entry[0] = tc.get("id") or entry[0]
                    entry[1] = fn.get("name") or entry[1]
                    entry[2] += str(fn.get("arguments") or "")
            if isinstance(d, dict) and isinstance(d.get("content"), str) and d["content"]:
                text_choices.append(ci)
            if ch.get("finish_reason"):
                finishing.append(_hashable(ch.get("index", ci)))
        spots = [(_hashable(choices[ci].get("index", ci)), Slot(choices[ci]["delta"], "content")) for ci in text_choices]
        # (an empty delta, a reasoning one, a content filter's annotation: the prose run goes on through it)
        return self._prose_spots(ev, spots, finishing, touched)

    def body(self, obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        self._usage(obj.get("usage"))
        changed = False
        for ch in _list(obj.get("choices")):
            msg = ch.get("message") if isinstance(ch, dict) else None
            if isinstance(msg, dict):
                changed |= self._clean(msg, "content")
                for tc in _list(msg.get("tool_calls")):
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if isinstance(fn, dict):
                        self._call(str(tc.get("id") or ""), fn.get("name"), fn.get("arguments"))
        return changed


# -- OpenAI Responses --------------------------------------------------------------------------


class ResponsesResponse(LaneResponse):
    lane = "responses"

    def _usage(self, u: Any) -> None:
        self.usage.read_openai(u, "input_tokens", "input_tokens_details", "output_tokens")

    @staticmethod
    def _key(ev: Event) -> tuple:
        return _hashable((ev.get("item_id") or ev.get("output_index"), ev.get("content_index", 0)))

    def _final_text(self, key: tuple, text: str) -> str:
        b = self.blocks.get(key)
        return b.emitted if b is not None else strip_echoes(text)

    def _note_call(self, item: Any) -> None:
        if isinstance(item, dict) and item.get("type") == "function_call":
            self._call(str(item.get("call_id") or ""), item.get("name"), item.get("arguments"))

    def _fix_item(self, item: Any) -> bool:
        if not isinstance(item, dict) or item.get("type") != "message":
            return False
        changed = False
        for k, part in enumerate(_list(item.get("content"))):
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                t = self._final_text(_hashable((item.get("id"), k)), part["text"])
                if t != part["text"]:
                    part["text"] = t
                    changed = True
        return changed

    def event(self, ev: Event) -> list:
        kind = ev.get("type")
        if kind == "response.output_text.delta" and isinstance(ev.get("delta"), str):
            return self._prose(self._key(ev), ev, Slot(ev, "delta"))
        if kind == "response.output_text.done" and isinstance(ev.get("text"), str):
            key = self._key(ev)
            self.rest = ""
            out = self._close(key)
            if self.rest:
                # nowhere to merge the held tail: this event becomes the last delta (its aggregates
                # follow in content_part.done / output_item.done / response.completed)
                delta = {k: v for k, v in ev.items() if k != "text"}
                delta["type"], delta["delta"], self.rest = "response.output_text.delta", self.rest, ""
                return [*out, delta]
            t = self._final_text(key, ev["text"])
            if t != ev["text"]:
                ev["text"] = t
                return [*out, ev]
            return [*out, KEEP]
        if kind == "response.content_part.done":
            part = ev.get("part")
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                key = self._key(ev)
                out = self._close(key)
                t = self._final_text(key, part["text"])
                if t != part["text"]:
                    part["text"] = t
                    return [*out, ev]
                return [*out, KEEP]
        if kind == "response.output_item.done":
            self._note_call(ev.get("item"))
            return [ev] if self._fix_item(ev.get("item")) else [KEEP]
        if kind in ("response.completed", "response.incomplete", "response.done"):
            self.finished = True
            out = self.close_all()
            resp = ev.get("response")
            changed = False
            if isinstance(resp, dict):
                self._usage(resp.get("usage"))
                for item in _list(resp.get("output")):
                    changed |= self._fix_item(item)
            return [*out, ev if changed else KEEP]
        return [KEEP]

    def body(self, obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        self._usage(obj.get("usage"))
        changed = False
        for item in _list(obj.get("output")):
            self._note_call(item)
            if isinstance(item, dict) and item.get("type") == "message":
                for part in _list(item.get("content")):
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        changed |= self._clean(part, "text")
        return changed


# -- Gemini ------------------------------------------------------------------------------------


class GeminiResponse(LaneResponse):
    lane = "gemini"

    def _usage(self, u: Any) -> None:
        if not isinstance(u, dict):
            return
        self.usage.seen = True
        # (the prompts of its server-side tools and its thinking are counted apart, billed as input and output)
        self.usage.input = _int(u.get("promptTokenCount")) + _int(u.get("toolUsePromptTokenCount"))
        self.usage.cache_read = _int(u.get("cachedContentTokenCount"))
        self.usage.cache_known = True  # (Gemini names the count only when it read its cache)
        self.usage.output = _int(u.get("candidatesTokenCount")) + _int(u.get("thoughtsTokenCount"))

    def event(self, ev: Event) -> list:
        self._usage(ev.get("usageMetadata"))
        cands = ev.get("candidates")
        if not isinstance(cands, list):
            return [KEEP]
        spots = []
        finishing = []
        touched = []  # the candidates with a part that is not prose (a call, a thought): their prose run ends first
        for ci, c in enumerate(cands):
            content = c.get("content") if isinstance(c, dict) else None
            parts = content.get("parts") if isinstance(content, dict) else None
            other = False
            for pi, p in enumerate(_list(parts)):
                if isinstance(p, dict) and isinstance(p.get("text"), str) and not p.get("thought"):
                    spots.append((ci, pi))
                else:
                    other = True
                self._note_call(p)
            if other:
                touched.append(_hashable(c.get("index", ci)))
            if isinstance(c, dict) and c.get("finishReason"):
                finishing.append(_hashable(c.get("index", ci)))
        return self._prose_spots(
            ev, [(_hashable(cands[ci].get("index", ci)), Slot(cands[ci]["content"]["parts"][pi], "text")) for ci, pi in spots],
            finishing, touched,
        )

    def body(self, obj: Any) -> bool:
        if isinstance(obj, list):
            # a streamGenerateContent answer without alt=sse is one JSON array of chunks: filter it
            # as the stream it is, so an echo split across chunks goes as a whole
            before = [compact_json(x) for x in obj]
            for chunk in obj:
                if isinstance(chunk, dict):
                    self.event(chunk)
            self.close_all()
            return before != [compact_json(x) for x in obj]
        if not isinstance(obj, dict):
            return False
        self._usage(obj.get("usageMetadata"))
        changed = False
        for c in _list(obj.get("candidates")):
            content = c.get("content") if isinstance(c, dict) else None
            for p in _list(content.get("parts") if isinstance(content, dict) else None):
                self._note_call(p)
                if isinstance(p, dict) and not p.get("thought"):
                    changed |= self._clean(p, "text")
        return changed

    def _note_call(self, part: Any) -> None:
        fc = part.get("functionCall") if isinstance(part, dict) else None
        if isinstance(fc, dict):
            self._call(function_call_key(fc), fc.get("name"), fc.get("args"))


RESPONSES: dict[str, type[LaneResponse]] = {
    "anthropic": AnthropicResponse,
    "chat": ChatResponse,
    "responses": ResponsesResponse,
    "gemini": GeminiResponse,
}
