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

from bili_addon.wire.base import Body, patch

MAX_BREAKPOINTS = 4
SUMMARY_MARK = b"[Compressed conversation section "
_SUMMARY_TEXT = SUMMARY_MARK.decode()
MARKABLE = frozenset({"text", "tool_result", "image", "document"})  # the blocks a breakpoint may be put on
CACHE_CONTROL = {"type": "ephemeral"}
_CC, _TTL = b'"cache_control"', b'"ttl"'


def agent_marks(raw: bytes, body: Body, infos: list, prev: list[tuple[int, int]] | None,
                shared: int) -> tuple[tuple[int, int], list[tuple[int, int]] | None]:
    """How often the request's body mentions ``"cache_control"`` and ``"ttl"`` (``raw.count`` of
    each), and the running counts over its conversation items (the next turn's ``prev``).  A compact
    body (``Body.compact``: where its array lies) is its members and its items, with only JSON
    punctuation between them, which neither word holds: the counts add up over the body around the
    array and over each item, and the items the previous pass shared (``infos``: the items, each's
    bytes its ``raw``; the first ``shared`` are the previous pass's, ``prev`` its running counts) are
    not read again (a folded session's every turn asks; the whole body of 1,000 messages took ~0.5 ms
    to count).  Any other body is counted whole."""
    if body.compact is None:
        return (raw.count(_CC), raw.count(_TTL)), None
    at, end = body.compact  # (the array: from its ``[`` to past its ``]``)
    cc = raw.count(_CC, 0, at) + raw.count(_CC, end)
    ttl = raw.count(_TTL, 0, at) + raw.count(_TTL, end)
    run = prev[: shared + 1] if prev is not None and shared < len(prev) else [(0, 0)]
    c, t = run[-1]
    for info in infos[len(run) - 1:]:
        item = info.raw
        c += item.count(_CC)
        t += item.count(_TTL)
        run.append((c, t))
    return (cc + c, ttl + t), run


def mark_head(lane: str, items: list[bytes], start: int, raw: bytes, counts: tuple[int, int] | None = None) -> bool:
    """Put a breakpoint on the last block of the last summary item in ``items`` (conversation items
    from ``start`` on, the last excepted: the agent marks that one); True when it did.  ``counts``:
    :func:`agent_marks`' of ``raw`` (else ``raw`` is counted here)."""
    if lane != "anthropic":
        return False
    used, ttl = counts if counts is not None else (raw.count(_CC), None)
    if not 0 < used < MAX_BREAKPOINTS or (ttl if ttl is not None else _TTL in raw):
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
        # bili's summary: a user turn's text block of its own that opens with the header (the model's
        # thinking or prose quoting it, a tool's output of a log, are not: the mark would go on a block
        # that takes none, a thinking block, or on a later message than the folded head)
        if obj.get("role") != "user" or not any(
                isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                and b["text"].startswith(_SUMMARY_TEXT) for b in content):
            continue
        if content[-1].get("type") not in MARKABLE:
            return False
        if any(isinstance(b, dict) and "cache_control" in b for b in content):
            return False  # the agent's own already
        items[i] = patch(item, ("content", len(content) - 1, "cache_control"), CACHE_CONTROL)
        return True
    return False
