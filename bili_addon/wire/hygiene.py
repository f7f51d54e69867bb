"""Wire hygiene that is not about identity: proxy ids, strict reasoning echo.

Both work on one request's conversation items (their parsed objects) and return edits; the
caller applies them with :func:`bili_addon.wire.base.patch`.  Provider-minted ids (``rs_``,
``fc_``, ``msg_``, call ids) and thinking signatures are never altered here.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from bili_addon.wire.base import DELETE, Path, encode

PROXY_ID_PREFIX = "msg-proxy-"
MAX_ID_LEN = 64

_STRICT_HINT = re.compile(r"reasoning[_ ](content|text)|reasoning_content", re.IGNORECASE)
_STRICT_ORIGIN = re.compile(r"deepseek", re.IGNORECASE)


def proxy_id_edits(lane: str, obj: Any) -> list[tuple[Path, Any]]:
    """Replayed ``msg-proxy-*`` ids are ours, not the provider's: the item keeps its content, loses the id."""
    if lane != "responses" or not isinstance(obj, dict):
        return []
    item_id = obj.get("id")
    if not isinstance(item_id, str):
        return []
    if item_id.startswith(PROXY_ID_PREFIX) and obj.get("type", "message") == "message":
        return [(("id",), DELETE)]
    if item_id.startswith(PROXY_ID_PREFIX) and len(item_id) > MAX_ID_LEN:
        return [(("id",), "msg-fix-" + hashlib.sha256(item_id.encode()).hexdigest()[:16])]
    return []


def is_strict_hint(text: str) -> bool:
    """An upstream 400 that asks for reasoning to be passed back (DeepSeek-class gateways)."""
    return bool(_STRICT_HINT.search(text))


def strict_by_name(origin: str, model: str) -> bool:
    return bool(_STRICT_ORIGIN.search(origin) or _STRICT_ORIGIN.search(model))


def strict_chat_edits(obj: Any) -> list[tuple[Path, Any]]:
    """Chat: an assistant tool-call message without ``reasoning_content`` gets an empty one."""
    if (
        isinstance(obj, dict)
        and obj.get("role") == "assistant"
        and obj.get("tool_calls")
        and not isinstance(obj.get("reasoning_content"), str)
    ):
        return [(("reasoning_content",), "")]
    return []


_RUN_TYPES = {
    "reasoning", "function_call", "custom_tool_call", "function_call_output", "custom_tool_call_output",
}
_CALL_TYPES = {"function_call", "custom_tool_call"}
EMPTY_REASONING = encode({"type": "reasoning", "summary": [{"type": "summary_text", "text": ""}]})


def strict_responses_inserts(objs: list[Any]) -> list[int]:
    """Responses: indexes where an empty reasoning item must be inserted.

    Only when the input carries reasoning at all; a maximal assistant run (reasoning, calls,
    call outputs, assistant messages) that has a call but no reasoning gets one at its start.
    """
    if not any(isinstance(o, dict) and o.get("type") == "reasoning" for o in objs):
        return []
    inserts: list[int] = []
    i = 0
    while i < len(objs):
        if not _in_run(objs[i]):
            i += 1
            continue
        start = i
        has_call = has_reasoning = False
        while i < len(objs) and _in_run(objs[i]):
            kind = objs[i].get("type")
            has_call |= kind in _CALL_TYPES
            has_reasoning |= kind == "reasoning"
            i += 1
        if has_call and not has_reasoning:
            inserts.append(start)
    return inserts


def _in_run(o: Any) -> bool:
    if not isinstance(o, dict):
        return False
    kind = o.get("type")
    return (isinstance(kind, str) and kind in _RUN_TYPES) or (kind in (None, "message") and o.get("role") == "assistant")
