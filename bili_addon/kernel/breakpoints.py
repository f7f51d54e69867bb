"""The free cache breakpoint (Anthropic): where the agent leaves one of its four free, bili puts it
at the end of the folded head.

Anthropic reads a cached prefix only at a ``cache_control`` breakpoint (or up to ~20 blocks before
one).  Claude Code sets three: two in ``system``, one on the last message.  After a fold, the prefix
before the fold point (the first user turn, the summaries of earlier folds) has no entry of its own,
so the fold request writes it again.  A breakpoint on the last summary keeps an entry there: the next
fold reads the head and writes only what follows it.  It stays at the same place until the next fold
(byte stability), it is added only where the agent set breakpoints of its own (an agent that sets none
has not asked for caching) and uses fewer than four, never where the agent asks for lifetimes (a
5-minute entry may not precede a 1-hour one), and none of the agent's breakpoints is moved or dropped.
"""

from __future__ import annotations

import msgspec

from bili_addon.wire.base import patch

MAX_BREAKPOINTS = 4
SUMMARY_MARK = b"[Compressed conversation section "
CACHE_CONTROL = {"type": "ephemeral"}


def mark_head(lane: str, items: list[bytes], start: int, raw: bytes) -> bool:
    """Put a breakpoint on the last block of the last summary item in ``items`` (conversation items
    from ``start`` on, the last excepted: the agent marks that one); True when it did."""
    if lane != "anthropic":
        return False
    used = raw.count(b'"cache_control"')
    if not 0 < used < MAX_BREAKPOINTS or b'"ttl"' in raw:
        return False
    for i in range(len(items) - 2, start - 1, -1):
        item = items[i]
        if SUMMARY_MARK not in item:
            continue
        try:
            obj = msgspec.json.decode(item)
        except msgspec.DecodeError:
            return False
        content = obj.get("content") if isinstance(obj, dict) else None
        if not isinstance(content, list) or not content or not isinstance(content[-1], dict):
            return False
        if any(isinstance(b, dict) and "cache_control" in b for b in content):
            return False  # the agent's own already
        items[i] = patch(item, ("content", len(content) - 1, "cache_control"), CACHE_CONTROL)
        return True
    return False
