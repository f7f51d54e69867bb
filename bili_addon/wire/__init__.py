"""Wire codecs, one module per provider lane.

Every lane maps one item of its conversation array to a list of :class:`~bili_addon.wire.base.Core`
parts and says which leading items are system content.  The bytes are never rebuilt from cores:
the pipeline patches prose in place (see :mod:`bili_addon.wire.base`), so everything a lane does
not understand survives byte for byte.
"""

from __future__ import annotations

from typing import Any, Protocol

from bili_addon.wire.anthropic import AnthropicLane
from bili_addon.wire.base import Body, Core
from bili_addon.wire.chat import ChatLane
from bili_addon.wire.gemini import GeminiLane
from bili_addon.wire.responses import ResponsesLane


class Lane(Protocol):
    name: str
    conv_key: str

    def is_system_item(self, obj: Any) -> bool: ...

    def item_cores(self, obj: Any) -> list[Core]: ...

    # what folding and the proxy tools need
    def summary_item(self, text: str) -> bytes: ...

    def note_in_item(self, raw: bytes, text: str) -> bytes | None:
        """A user-side item with ``text`` added as a part of its own, or None where the lane has
        no place for prose in it (a chat ``tool`` message, a Responses output item, a Gemini
        function response content)."""
        ...

    def join_user(self, raw: bytes, text: str, *, before: bool) -> bytes | None:
        """``raw`` with ``text`` joined to it (in front, or after it) when the lane needs user and
        assistant turns to alternate and ``raw`` is a user message that can take prose; else None
        (the text stays an item of its own)."""
        ...

    def tool_names(self, body: Body) -> list[str] | None: ...

    def inject(self, body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
               names: list[str]) -> bool:
        """Append ``tools`` (those not in ``names``, the request's own tool names) and ``prompt``;
        a request without tools (a side request) is left alone."""
        ...

    def result_edits(self, obj: Any, call_id: str, text: str, nth: int | None = None,
                     keep_error: bool = False) -> list: ...

    def call_edits(self, obj: Any, call_id: str, name: str, args: str) -> list: ...

    def transplant_hints(self, row: bytes, client: bytes) -> bytes: ...


LANES: dict[str, Lane] = {
    lane.name: lane for lane in (AnthropicLane(), ChatLane(), ResponsesLane(), GeminiLane())
}


def detect_lane(method: str, path: str) -> Lane | None:
    """Which model lane a request belongs to, from its method and path (query ignored)."""
    if method != "POST":
        return None
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/messages") and not p.endswith("/count_tokens"):
        return LANES.get("anthropic")
    if p.endswith("/chat/completions"):
        return LANES.get("chat")
    if p.endswith("/responses"):
        return LANES.get("responses")
    if ":generateContent" in p or ":streamGenerateContent" in p:
        return LANES.get("gemini")
    return None


def is_responses_websocket(path: str) -> bool:
    return path.split("?", 1)[0].rstrip("/").endswith("/responses")
