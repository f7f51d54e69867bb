"""Message identity: content-hash ids, instance suffixes, token figures.

``h_`` + 16 hex of SHA-256 over ``role|contentType|toolCallId|toolName|text``; media cores add a
sixth slot with their payload so one changed image re-mints only itself.  Position is never part
of identity: duplicates are told apart by ``_1``, ``_2`` suffixes counted within one pass.
"""

from __future__ import annotations

import hashlib
import math
import re

from bili_addon.wire.base import Core

_sha256 = sha256 = hashlib.sha256
_CJK = re.compile("[\u4e00-\u9fff\u3040-\u30ff\uac00-\ud7af]")


def seed(core: Core) -> str:
    s = f"{core.role}|{core.ctype}|{core.tool_call_id}|{core.tool_name}|{core.text}"
    if core.media:
        s += "|" + core.media
    return s


def digest(core: Core) -> tuple[str, str]:
    """``(base id, content hash)``: the id is ``h_`` + the first 16 hex of the content hash, which
    the ledger keeps in full beside it as the safety belt against a wrong join (inlined in
    :meth:`ItemCache.get_many <bili_addon.kernel.state.ItemCache.get_many>`: change both together)."""
    s = f"{core.role}|{core.ctype}|{core.tool_call_id}|{core.tool_name}|{core.text}"  # seed(core), inlined
    if core.media:
        s += "|" + core.media
    h = _sha256(s.encode("utf-8", "surrogatepass")).hexdigest()
    return "h_" + h[:16], h


class InstanceCounter:
    """First occurrence keeps the bare id, the n-th repeat in the same pass gets ``_n``."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, base: str) -> str:
        n = self.seen.get(base, 0)
        self.seen[base] = n + 1
        return base if n == 0 else f"{base}_{n}"


def js_len(text: str) -> int:
    """UTF-16 code units, the length the original system counted in."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def count_tokens(text: str) -> int:
    """A cheap, deterministic token estimate: CJK characters count one each, the rest ~4 chars."""
    if not text:
        return 0
    if text.isascii():  # the common case: no CJK, and UTF-16 length == len
        return -(-len(text) // 4)
    cjk = len(_CJK.findall(text))
    return cjk + math.ceil((js_len(text) - cjk) / 4)
