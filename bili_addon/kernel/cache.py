"""The providers' prompt caches, modelled: what a request reads, writes and pays, and when it expires.

Pure code (no store, no engine).  One model per lane family, on each provider's documented rules:

- **Anthropic** (Messages): explicit ``cache_control`` breakpoints, at most 4 per request.  A request
  writes an entry for the prefix ending at each breakpoint (tools, then system, then messages, block
  by block) and reads the longest entry found at a breakpoint or at one of the ~20 block boundaries
  before it (the lookback).  An entry lives 5 minutes (or 1 hour with ``"ttl": "1h"``) from its last
  write or read: a hit refreshes it.  Writes bill 1.25x the input price (2x for 1 hour), reads 0.1x,
  the rest 1x.  One request may mix both lifetimes when every 1-hour breakpoint comes before every
  5-minute one (:func:`ordered`); it then pays reads up to its longest hit (A), 1-hour writes from
  there to its last 1-hour breakpoint (B) and 5-minute writes from there to its last breakpoint (C):
  each written segment is billed at the lifetime of the breakpoint that ends it.  A prefix shorter
  than the model's minimum (1024 tokens; 2048 or 4096 on some models: :data:`_ANTH_4096`) is never cached.
  A message's string content matches the one text block it is shorthand for (Claude Code sends a
  user's text as a block list while it carries the last breakpoint, as a string after).
  ``cache_control`` itself is not part of what is matched (it moves every turn).
- **OpenAI** (Chat, Responses): automatic prefix caching of prompts from 1024 tokens on, in steps of
  128 tokens; an entry lives ~5 minutes of idle (24 hours with ``prompt_cache_retention: "24h"``).
  No write premium; reads bill 0.5x to 0.1x depending on the model family.  The prefix is that of
  the prompt the provider builds (instructions, tools, conversation: :func:`_prompt`), not of the
  body's JSON, whose agents put the tools last; Gemini's likewise.
- **Gemini**: implicit prefix caching from 1024 tokens (Flash) or 4096 (Pro); reads bill 0.1x
  (2.5 and 3) or 0.25x (older), the built-in price table's rate where it has the model
  (:func:`bili_addon.prices.read_share`: one source for the clock and the money); no write premium.
  Its lifetime is not documented: modelled as 5 minutes idle.  The model is in the request's URL,
  not its body: the session's model is given with each request (:meth:`Clocks.sent`).

Token counts are estimated as bytes / 4 (the same estimate the rest of the kernel uses).  Costs are
in *input-token units* (1.0 = one uncached input token of the model); absolute prices live elsewhere.

:class:`Clock` is one session's cache: fed with the bodies it sends and their times, it predicts each
request's bill; what the provider reports is compared with it, and what the reports teach (a shorter
lifetime, no cache at all, a larger minimum) is learned by :mod:`bili_addon.kernel.calibration` and
applied here (:meth:`Clock.apply`).
"""

from __future__ import annotations

import hashlib
import re
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Callable

import msgspec
from msgspec import UNSET, UnsetType

from bili_addon import prices
from bili_addon.wire.base import common_prefix_bytes

BYTES_PER_TOKEN = 4
MINUTES = 60.0


@dataclass(frozen=True)
class Rules:
    """One provider family's cache rules (for one model)."""

    family: str  # anthropic | openai | gemini
    read: float  # multiplier of a cached read
    write: float = 1.0  # multiplier of a cache write (default lifetime)
    write_long: float = 1.0  # multiplier of a cache write with the long lifetime (Anthropic 1 h)
    ttl: float = 5 * MINUTES  # default lifetime, refreshed on a hit
    ttl_long: float = 60 * MINUTES
    min_tokens: int = 1024  # shorter prefixes are never cached
    step: int = 1  # cached lengths are multiples of this (OpenAI 128 tokens)
    max_breakpoints: int = 4
    lookback: int = 20  # block boundaries checked before a breakpoint


# Anthropic's minimum cacheable prompt length, as its prompt-caching page tables it: 4096 tokens for
# Opus 4.6, Opus 4.5 and Haiku 4.5; 2048 for Haiku 3.5 and 3; 1024 for the rest (Sonnet 4.6, 4.5, 4 and
# 3.7, Opus 4.1 and 4).  Model ids spell versions with a dash or (through routers) a dot.
_ANTH_4096 = re.compile(r"(?:opus-4[-.][56]|haiku-4[-.]5)(?![0-9])")


def anthropic_rules(model: str = "") -> Rules:
    m = model.lower()
    minimum = 1024
    if _ANTH_4096.search(m):
        minimum = 4096
    elif "haiku" in m:
        minimum = 2048
    return Rules("anthropic", read=0.1, write=1.25, write_long=2.0, min_tokens=minimum)


def openai_rules(model: str = "") -> Rules:
    m = model.lower()
    if m.startswith(("gpt-4o", "o1")):
        read = 0.5
    elif m.startswith(("gpt-4.1", "o3", "o4")):
        read = 0.25
    else:  # gpt-5 family (codex) and unknown: the current discount
        read = 0.1
    return Rules("openai", read=read, min_tokens=1024, step=128, ttl_long=24 * 60 * MINUTES)


def gemini_rules(model: str = "") -> Rules:
    m = model.lower()
    read = prices.read_share(m) or (0.25 if re.search(r"gemini-(1\.|2\.0)", m) else 0.1)
    minimum = 4096 if "pro" in m else 1024
    return Rules("gemini", read=read, min_tokens=minimum, step=128)  # granularity undocumented: as OpenAI


def rules_for(lane: str, model: str = "") -> Rules:
    if lane == "anthropic":
        return anthropic_rules(model)
    if lane == "gemini":
        return gemini_rules(model)
    return openai_rules(model)  # chat, responses


@dataclass
class Bill:
    """What one request costs, by kind of input token."""

    input: int = 0  # uncached
    read: int = 0
    write: int = 0  # default lifetime
    write_long: int = 0  # long lifetime (Anthropic 1 h)

    @property
    def total(self) -> int:
        return self.input + self.read + self.write + self.write_long

    def cost(self, r: Rules) -> float:
        return self.input + r.read * self.read + r.write * self.write + r.write_long * self.write_long

    def __iadd__(self, o: "Bill") -> "Bill":
        self.input += o.input
        self.read += o.read
        self.write += o.write
        self.write_long += o.write_long
        return self


# -- the prompt as the cache sees it -----------------------------------------------------------------

@dataclass
class Segment:
    """One cacheable unit: an Anthropic content block (or tool definition, or system block)."""

    tokens: int
    ttl: float | None = None  # a breakpoint on it: the lifetime it asks for; None: no breakpoint
    key: bytes = b""  # digest of the prefix ending here (filled by :func:`chain`)


def chain(segments: list[Segment], blobs: list[bytes]) -> list[Segment]:
    h = hashlib.blake2b(digest_size=16)
    for seg, blob in zip(segments, blobs, strict=True):
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
        seg.key = h.copy().digest()
    return segments


class _Msg(msgspec.Struct):
    role: str = ""
    content: msgspec.Raw = msgspec.Raw(b"null")


class _Body(msgspec.Struct):
    tools: list[msgspec.Raw] = []
    system: msgspec.Raw = msgspec.Raw(b"null")
    messages: list[_Msg] = []


_raws = msgspec.json.Decoder(list[msgspec.Raw])
_CC = b'"cache_control"'


def ordered(segs: list[Segment]) -> bool:
    """Anthropic's rule for mixed lifetimes: no breakpoint asks for a longer lifetime than one
    before it (a 1-hour entry must precede every 5-minute one; the API refuses the request else)."""
    ttls = [s.ttl for s in segs if s.ttl is not None]
    return all(a >= b for a, b in zip(ttls, ttls[1:]))


def _tok(blob: bytes) -> int:
    return max(1, len(blob) // BYTES_PER_TOKEN)


_CC_AFTER = re.compile(rb',\s*"cache_control"\s*:\s*\{[^{}]*\}')
_CC_FIRST = re.compile(rb'"cache_control"\s*:\s*\{[^{}]*\}\s*,\s*')


def _block(raw: bytes, rules: Rules) -> tuple[bytes, float | None]:
    """A block's bytes as the cache matches them (its ``cache_control`` cut out, the rest byte for
    byte) and the lifetime its breakpoint asks for (None: no breakpoint).  Only blocks that mention
    cache_control are parsed."""
    if _CC not in raw:
        return raw, None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw, None
    if not isinstance(obj, dict) or not isinstance(obj.get("cache_control"), dict):
        return raw, None
    ttl = rules.ttl_long if obj["cache_control"].get("ttl") == "1h" else rules.ttl
    stripped, n = _CC_AFTER.subn(b"", raw)
    if not n:
        stripped = _CC_FIRST.sub(b"", raw)
    return stripped, ttl


_BILLING = b"x-anthropic-billing-header:"


def _billing(blk: bytes) -> bool:
    """Whether a system block is Claude Code's billing header (``x-anthropic-billing-header: cc_version=…;
    cc_entrypoint=…; cch=…;``, first-party: its ``cch`` changes on every request): Anthropic's API
    reads it as an attribution header, not as prompt, so it is no part of the cached prefix (first-party
    Claude Code reads its cache turn after turn; providers that cache it as prompt never hit, the
    reason proxies strip it for them).  A block with a breakpoint of its own is left as prompt."""
    if _BILLING not in blk or _CC in blk:
        return False
    try:
        obj = msgspec.json.decode(blk)
    except msgspec.DecodeError:
        return False
    return (isinstance(obj, dict) and obj.get("type") == "text" and isinstance(obj.get("text"), str)
            and obj["text"].startswith(_BILLING.decode()))


def _head_blocks(tools: list[msgspec.Raw], system: bytes, add: Callable[[bytes, bytes], None]) -> None:
    """The tools' and the system's blocks, in cache order (the billing header's left out: :func:`_billing`)."""
    for t in tools:
        add(bytes(t), b"T")
    if system.startswith(b"["):
        for blk in _raws.decode(system):
            blk = bytes(blk)
            if not _billing(blk):
                add(blk, b"S")
    elif system != b"null":
        add(system, b"S")


def _head_key(head: tuple[bytes | None, bytes | None]) -> tuple:
    """What of a body's head (tools, system) its blocks depend on: the system without its billing
    header, whose ``cch`` changes on every request and which is no part of the cached prefix."""
    system = head[1]
    if system is None or _BILLING not in system or not system.startswith(b"["):
        return head
    try:
        blocks = [bytes(b) for b in _raws.decode(system)]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return head
    return (head[0], tuple(b for b in blocks if not _billing(b)))


def _msg_blocks(role: str, content: bytes, add: Callable[[bytes, bytes], None]) -> None:
    """One message's blocks."""
    head = b"M" + role.encode()
    if content.startswith(b"[") and content != b"[]":
        for i, blk in enumerate(_raws.decode(content)):
            add(bytes(blk), head if i == 0 else b"C")
    elif content.startswith(b'"'):  # a string is shorthand for one text block: the same prompt
        add(b'{"type":"text","text":' + content + b"}", head)
    else:
        add(content, head)


def anthropic_segments(body: bytes, rules: Rules | None = None) -> list[Segment]:
    """An Anthropic Messages body as its cacheable blocks, in cache order (tools, system, messages).
    Parsed down to raw blocks only (msgspec.Raw): what is hashed are the blocks' own bytes."""
    rules = rules or anthropic_rules()
    b = msgspec.json.decode(body, type=_Body)
    segs: list[Segment] = []
    blobs: list[bytes] = []

    def add(raw: bytes, head: bytes) -> None:
        blob, ttl = _block(raw, rules)
        blob = head + blob
        segs.append(Segment(_tok(blob), ttl))
        blobs.append(blob)

    _head_blocks(b.tools, bytes(b.system), add)
    for m in b.messages:
        _msg_blocks(m.role, bytes(m.content), add)
    return chain(segs, blobs)


# -- the previous request, kept: a follow-up costs what its new suffix costs ----------------------
#
# A session's next body mostly repeats its previous one byte for byte and appends a few messages.
# Each Cache keeps what it computed for its previous body (with the rules it was computed under)
# and recomputes only what follows the longest prefix the two bodies share: bytes are compared,
# never hashes (an equal prefix gives equal blocks, keys and prefix digests).  Anthropic bodies are
# cut at their top-level ``messages`` array (:func:`_locate`, :func:`_cut`): the members before it
# were read with the previous body, the messages after the last boundary both bodies share and the
# members after the array are read again (a new head, e.g. Claude Code's per-request ``cch`` system
# block, re-chains the kept blocks' bytes: every key changes).  OpenAI and Gemini bodies are cut so
# at their conversation array for their prompt (:func:`_prompt`) and ``prompt_cache_retention``; the
# prompt's prefix digests resume from a hasher state kept every 64 step edges.  Anything unexpected (a body the cut does not read,
# duplicate members that do not agree) takes the full path, whose result and errors are today's.
# The memo is a pure function's cache (body and rules -> blocks/digests): the learned lifetime,
# minimum and no-cache flags apply after it, and a Rules change invalidates it.

_WS = re.compile(rb"[ \t\n\r]*")
_COMMA = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_CLOSE = re.compile(rb"[ \t\n\r]*\]")
_EVERY = 16  # a hasher state is kept at every 16th message boundary (and at the last few)
_LAST = 4


_common = common_prefix_bytes  # (the longest common prefix of two bodies: memcmp in chunks, no copy)


def _top(key: str, **members: Any) -> tuple[type, msgspec.json.Decoder, bytes]:
    """The top-level members read around the array ``key``: that array (its items raw) and
    ``members``; each UNSET where the body has no such member."""
    typ = msgspec.defstruct("_Top_" + key, [(key, list[msgspec.Raw] | UnsetType, UNSET)]
                            + [(k, t if t is Any else t | UnsetType, UNSET) for k, t in members.items()])
    return typ, msgspec.json.Decoder(typ), b'{"' + key.encode() + b'":['


_ANTH_TOP = _top("messages", tools=msgspec.Raw, system=msgspec.Raw)
_KEY_RE: dict[bytes, re.Pattern[bytes]] = {}


def _locate(body: bytes, key: bytes, dec: msgspec.json.Decoder) -> tuple[int, Any] | None:
    """Where the top-level array ``key`` of ``body`` opens (the offset of its ``[``), and the top-level
    members before it (decoded from them with an empty array in its place: only a top-level member
    makes that a whole object).  None: not found among the first few candidates."""
    pat = _KEY_RE.get(key)
    if pat is None:
        pat = _KEY_RE[key] = re.compile(rb'"' + re.escape(key) + rb'"[ \t\n\r]*:[ \t\n\r]*\[')
    for i, mt in enumerate(pat.finditer(body)):
        if i == 4:
            break
        j = mt.start() - 1
        while j >= 0 and body[j] in b" \t\n\r":
            j -= 1
        if j < 0 or body[j] not in b"{,":  # a quote inside a string is escaped: not a member's name
            continue
        ms = mt.end() - 1
        try:
            pre = dec.decode(body[:ms] + b"[]}")
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if getattr(pre, key.decode()) == []:
            return ms, pre
    return None


def _cut(body: bytes, start: int, first: bool, key: str, dec: msgspec.json.Decoder,
         hdr: bytes) -> tuple[list[msgspec.Raw], list[int], Any] | None:
    """The items of the top-level array ``key`` from offset ``start`` on (just after its ``[`` when
    ``first``, else just after an item), their end offsets, and the top-level members after the
    array: read as ``{"key":[`` + the rest of the body.  None where that does not read as the same
    items at the same places (an invalid body, a duplicate member)."""
    comma = False
    p = start
    if not first:
        mt = _COMMA.match(body, start)
        if mt is not None:
            comma, p = True, mt.end()
    s = hdr + body[p:]
    try:
        top = dec.decode(s)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    items = getattr(top, key)
    if items is UNSET or (comma and not items) or (not first and not comma and items):
        return None  # ``[a,]``, ``[a b]``
    pos = len(hdr)
    base = p - pos
    ends: list[int] = []
    for n, raw in enumerate(items):
        if not n:
            pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
        elif s[pos] == 44:  # ``,`` (compact JSON)
            pos += 1
            if s[pos] in b" \t\n\r":
                pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
        else:
            mt = _COMMA.match(s, pos)
            if mt is None:
                return None
            pos = mt.end()
        if not s.startswith(raw, pos):
            return None
        pos += len(raw)
        ends.append(base + pos)
    if _CLOSE.match(s, pos) is None:
        return None
    return items, ends, top


class _AnthMemo:
    """An Anthropic body's blocks, kept for the next body of the session."""

    __slots__ = ("rules", "body", "bounds", "pre", "head", "seg_at", "segs", "blobs", "cum", "bps", "states")

    def __init__(self, rules: Rules, body: bytes, bounds: list[int], pre: Any, head: tuple,
                 seg_at: list[int], segs: list[Segment], blobs: list[bytes], cum: list[int], bps: list[int],
                 states: dict[int, Any]):
        self.rules = rules
        self.body = body
        self.bounds = bounds  # message boundary i: [0] just after ``[``, [i] the end of message i - 1
        self.pre = pre  # the top-level members before the messages
        self.head = head  # the tools' and the system's bytes read (None: no such member), as _head_key keeps them
        self.seg_at = seg_at  # the segments before boundary i
        self.segs = segs
        self.blobs = blobs  # what each segment hashes (its block as the cache matches it)
        self.cum = cum  # tokens up to and with each segment
        self.bps = bps  # every breakpoint's segment index
        self.states = states  # the chain's hasher at some boundaries (0, every 16th, the last few)


_msg_dec = msgspec.json.Decoder(_Msg)
_Result = tuple[list[Segment], list[int], list[int], _AnthMemo]


def _anthropic_memo(memo: Any, body: bytes, rules: Rules) -> _Result | None:
    """:func:`anthropic_segments`, reusing what ``memo`` kept of the previous body for the prefix the
    bodies share; with the cumulated tokens and the breakpoints, and the memo of this body.  None:
    the body does not read so (the caller takes the full path)."""
    m = memo if isinstance(memo, _AnthMemo) and memo.rules == rules else None
    if m is not None:
        k = bisect_right(m.bounds, _common(m.body, body)) - 1
        if k >= 0:
            out = _anth_from(body, rules, m, k, m.pre, m.bounds[0] - 1)
            if out is not None:
                return out
    loc = _locate(body, b"messages", _ANTH_TOP[1])
    if loc is None:
        return None
    return _anth_from(body, rules, None, 0, loc[1], loc[0])


def _anth_from(body: bytes, rules: Rules, m: _AnthMemo | None, k: int, pre: Any, ms: int) -> _Result | None:
    """The body's blocks: those of ``m`` up to its message boundary ``k`` (which this body shares
    byte for byte), then the messages read from there on."""
    got = _cut(body, ms + 1 if m is None else m.bounds[k], k == 0, "messages", _ANTH_TOP[1], _ANTH_TOP[2])
    if got is None:
        return None
    items, ends, tail = got
    tools = tail.tools if tail.tools is not UNSET else pre.tools
    system = tail.system if tail.system is not UNSET else pre.system
    head = (None if tools is UNSET else bytes(tools), None if system is UNSET else bytes(system))
    key = _head_key(head)
    segs: list[Segment] = []
    blobs: list[bytes] = []
    cum: list[int] = []
    bps: list[int] = []
    states: dict[int, Any] = {}
    total = 0
    h = hashlib.blake2b(digest_size=16)
    upd, cp = h.update, h.copy

    def put(blob: bytes, ttl: float | None, n: int) -> None:
        nonlocal total
        upd(len(blob).to_bytes(8, "little"))
        upd(blob)
        if ttl is not None:
            bps.append(len(segs))
        segs.append(Segment(n, ttl, cp().digest()))
        blobs.append(blob)
        total += n
        cum.append(total)

    def add(raw: bytes, hd: bytes) -> None:  # a block read from the body
        blob, ttl = _block(raw, rules)
        blob = hd + blob
        put(blob, ttl, _tok(blob))

    if m is not None and key == m.head:  # the same head: every block up to boundary k is kept
        n0 = m.seg_at[k]
        segs, blobs, cum, bps = m.segs[:n0], m.blobs[:n0], m.cum[:n0], m.bps[:bisect_left(m.bps, n0)]
        seg_at, bounds = m.seg_at[: k + 1], m.bounds[: k + 1]
        r = max(i for i in m.states if i <= k)
        states = {i: st for i, st in m.states.items() if i < r and i % _EVERY == 0}
        states[r] = m.states[r]
        h = m.states[r].copy()  # the chain at k: from the kept state at r, over the kept blocks
        upd, cp = h.update, h.copy
        for blob in m.blobs[m.seg_at[r]:n0]:
            upd(len(blob).to_bytes(8, "little"))
            upd(blob)
        total = cum[-1] if cum else 0
    else:
        try:
            _head_blocks([] if head[0] is None else _raws.decode(head[0]), b"null" if head[1] is None else head[1], add)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        seg_at, bounds = [len(segs)], [ms + 1]
        states[0] = cp()
        if m is not None:  # another head: the kept messages' blocks again, chained after it
            msegs, mblobs, mat = m.segs, m.blobs, m.seg_at
            for j in range(1, k + 1):
                for x in range(mat[j - 1], mat[j]):
                    put(mblobs[x], msegs[x].ttl, msegs[x].tokens)
                seg_at.append(len(segs))
                if j % _EVERY == 0:
                    states[j] = cp()
            bounds = m.bounds[: k + 1]
    states[k] = cp()
    last = k + len(items)
    try:
        for i, raw in enumerate(items, k + 1):
            msg = _msg_dec.decode(raw)
            _msg_blocks(msg.role, bytes(msg.content), add)
            seg_at.append(len(segs))
            if i % _EVERY == 0 or i > last - _LAST:
                states[i] = cp()
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    bounds.extend(ends)
    return segs, cum, bps, _AnthMemo(rules, body, bounds, pre, key, seg_at, segs, blobs, cum, bps, states)


class _PrefixMemo:
    """An OpenAI/Gemini body's prefix digests, kept for the next body of the session."""

    __slots__ = ("rules", "body", "keys", "cps")

    def __init__(self, rules: Rules, body: bytes, keys: list[tuple[bytes, int]], cps: list[tuple[int, Any]]):
        self.rules = rules
        self.body = body
        self.keys = keys  # (digest of the prefix up to each step edge, its tokens)
        self.cps = cps  # (offset, the hasher there): at 0 and every 64th edge


def _prefix_keys(body: bytes, r: Rules, memo: Any = None) -> tuple[list[tuple[bytes, int]], _PrefixMemo]:
    """The digest of every prefix of ``body`` that ends at a step edge (from the minimum on)."""
    step_bytes = max(1, r.step) * BYTES_PER_TOKEN
    first = r.min_tokens * BYTES_PER_TOKEN
    m = memo if isinstance(memo, _PrefixMemo) and memo.rules == r else None
    if m is not None:
        shared = _common(m.body, body)
        j = len(m.cps) - 1
        while m.cps[j][0] > shared:
            j -= 1
        cps = m.cps[: j + 1]
        pos, st = cps[-1]
        h = st.copy()
        keys = m.keys[: (pos - first) // step_bytes + 1] if pos >= first else []
    else:
        h = hashlib.blake2b(digest_size=16)
        pos = 0
        keys = []
        cps = [(0, h.copy())]
    mv = memoryview(body)
    upd, cp = h.update, h.copy
    edge = first + len(keys) * step_bytes
    end = len(body)
    while edge <= end:
        upd(mv[pos:edge])
        pos = edge
        keys.append((cp().digest(), edge // BYTES_PER_TOKEN))
        if len(keys) % 64 == 0:
            cps.append((pos, cp()))
        edge += step_bytes
    return keys, _PrefixMemo(r, body, keys, cps)


# -- the models ------------------------------------------------------------------------------------

@dataclass
class Entry:
    tokens: int
    last: float  # last written or read
    ttl: float


@dataclass
class Cache:
    """One provider cache, as seen by one session: entries by prefix key, with their lifetimes."""

    rules: Rules
    entries: dict[bytes, Entry] = field(default_factory=dict)
    ttl_cap: float | None = None  # a lifetime learned from the provider's reports (shorter than documented)
    disabled: bool = False  # learned: the provider reports no cache at all
    min_floor: int = 0  # learned: the provider caches no prefix shorter than this (above the documented minimum)
    hit_age: float | None = None  # the last request's read: how long its entry had been unused (None: no read)
    tail: float = 0.0  # the lifetime the last request's last breakpoint asked for (its live tail's; 0: none yet)
    memo: bool = field(default=True, compare=False, repr=False)  # bill_request keeps the previous body's blocks
    _memo: Any = field(default=None, compare=False, repr=False)
    _memo_top: Any = field(default=None, compare=False, repr=False)  # OpenAI: where the body's top level was cut

    def _live(self, key: bytes, now: float) -> Entry | None:
        e = self.entries.get(key)
        if e is None:
            return None
        ttl = min(e.ttl, self.ttl_cap) if self.ttl_cap else e.ttl
        if now - e.last > ttl:
            del self.entries[key]
            return None
        return e

    def warm(self, now: float, tail: bool = False) -> bool:
        """Whether any entry is still alive (``tail``: any entry of the live tail's lifetime,
        :meth:`tail_ttl`; the 1-hour entries of a stable head aside)."""
        limit = self._tail_ttl() if tail else 0.0
        return not self.disabled and any((e := self._live(k, now)) is not None
                                         and (not tail or e.ttl <= limit) for k in list(self.entries))

    def _tail_ttl(self) -> float:
        """The live tail's lifetime, as the latest request asked for it: its last breakpoint's (5
        minutes with 1-hour entries on the stable head only; 1 hour when every breakpoint asks for
        it: a 6-minute pause then leaves the tail warm); the rules' default before any request."""
        return max(self.rules.ttl, self.tail)

    def tail_ttl(self) -> float:
        """:meth:`_tail_ttl`, capped by a lifetime learned from the provider's reports."""
        ttl = self._tail_ttl()
        return min(ttl, self.ttl_cap) if self.ttl_cap else ttl

    # Anthropic ---------------------------------------------------------------------------------
    def send_segments(self, segs: list[Segment], now: float) -> Bill:
        return self._send(segs, list(accumulate(s.tokens for s in segs)),
                          [i for i, s in enumerate(segs) if s.ttl is not None], now)

    def _send(self, segs: list[Segment], cum: list[int], bps: list[int], now: float) -> Bill:
        """``cum``: the tokens up to and with each segment; ``bps``: the segments with a breakpoint."""
        r = self.rules
        total = cum[-1] if cum else 0
        bps = bps[: r.max_breakpoints]
        self.hit_age = None
        if self.disabled or not bps:
            return Bill(input=total)
        self.tail = segs[bps[-1]].ttl or r.ttl  # (the shortest: no breakpoint asks for longer than one before it)
        hit, hit_at = 0, -1
        for b in bps:
            for j in range(b, max(-1, b - r.lookback), -1):
                if j <= hit_at:
                    break
                e = self._live(segs[j].key, now)
                if e is not None:
                    if cum[j] > hit:
                        hit, hit_at, self.hit_age = cum[j], j, now - e.last
                    break
        if hit_at >= 0:
            # a hit refreshes the entry, and every entry at a breakpoint of the prefix it read (their
            # content was used too)
            self.entries[segs[hit_at].key].last = now
            for b in bps:
                if b < hit_at:
                    e = self._live(segs[b].key, now)
                    if e is not None:
                        e.last = now
        bill = Bill(read=hit)
        done = hit
        for b in bps:
            if b <= hit_at or cum[b] < max(r.min_tokens, self.min_floor):
                continue
            seg = segs[b]
            e = self._live(seg.key, now)
            if e is None:
                self.entries[seg.key] = Entry(cum[b], now, seg.ttl or r.ttl)
            else:
                e.last, e.ttl = now, max(e.ttl, seg.ttl or r.ttl)
            if cum[b] > done:
                if (seg.ttl or r.ttl) > r.ttl:
                    bill.write_long += cum[b] - done
                else:
                    bill.write += cum[b] - done
                done = cum[b]
        bill.input = total - done
        return bill

    # OpenAI / Gemini: automatic prefix caching ------------------------------------------------
    def send_prefix(self, body: bytes, now: float, ttl: float | None = None) -> Bill:
        r = self.rules
        total = _tok(body)
        self.hit_age = None
        if self.disabled or total < max(r.min_tokens, self.min_floor):
            return Bill(input=total)
        if self.memo and type(body) is bytes:
            keys, self._memo = _prefix_keys(body, r, self._memo)
        else:
            keys = _prefix_keys(body, r)[0]
        if self.min_floor > r.min_tokens:  # learned: shorter prefixes are not cached there
            keys = [k for k in keys if k[1] >= self.min_floor]
        hit = 0
        for key, tokens in reversed(keys):
            e = self._live(key, now)
            if e is not None:
                hit, self.hit_age = tokens, now - e.last
                break
        life = ttl or r.ttl
        self.tail = life
        entries = self.entries
        get = entries.get
        for key, tokens in keys:
            e = get(key)
            if e is None:
                entries[key] = Entry(tokens, now, life)
            else:
                e.last = now
                if life > e.ttl:
                    e.ttl = life
        return Bill(input=total - hit, read=hit)


# -- the prompt as OpenAI and Gemini build it --------------------------------------------------------
#
# OpenAI and Gemini cache the prompt they render from the request, not the request's JSON.  That
# prompt opens with the instructions (Responses' ``instructions``, then the conversation's leading
# system and developer messages; Gemini's ``systemInstruction``), then the tool definitions (OpenAI
# renders them into the system prompt: a prefix hit needs them identical), then the conversation.
# The agents' bodies put ``tools`` (omp's and hermes' ``instructions`` too) after the conversation:
# read in key order, the body's bytes billed the agent's tools uncached on every request, and bili's
# own tools, added on activation, looked like a change at the end where they change all but the
# instructions.  :func:`_prompt` lays a body's members out in the provider's order, each as the bytes
# the body sends (the same members give the same prompt), and the prefix cache runs on that.  The
# members that are no prompt (model, stream, sampling, ``prompt_cache_key``) are left out; a body
# with no conversation member, or no JSON object, is billed as its bytes (today's model, fail open).
# A top-level ``system`` leads too: an Anthropic-shaped body billed under OpenAI's rules
# (bench_session's "OpenAI" figure) keeps its system prompt first.

_HEAD = ("instructions", "system", "systemInstruction", "system_instruction")  # the instructions' members
_CONV = {"openai": ("messages", "input"), "gemini": ("contents",)}  # the conversation's, by family
_LEADS = ("system", "developer")  # roles of the conversation's opening messages that join the instructions
_ARRAYS = ("messages", "input", "contents")
_PROMPT_TOP = {key: _top(key, prompt_cache_retention=Any, tools=msgspec.Raw,
                         **{h: msgspec.Raw for h in _HEAD + tuple(a for a in _ARRAYS if a != key)})
               for key in _ARRAYS}


class _PromptBody(msgspec.Struct):
    """An OpenAI or Gemini body's members that make its prompt, read whole (the full path)."""

    messages: msgspec.Raw | UnsetType = UNSET
    input: msgspec.Raw | UnsetType = UNSET
    contents: msgspec.Raw | UnsetType = UNSET
    instructions: msgspec.Raw | UnsetType = UNSET
    system: msgspec.Raw | UnsetType = UNSET
    systemInstruction: msgspec.Raw | UnsetType = UNSET  # noqa: N815 (Gemini's spelling)
    system_instruction: msgspec.Raw | UnsetType = UNSET
    tools: msgspec.Raw | UnsetType = UNSET
    prompt_cache_retention: Any = None


class _Role(msgspec.Struct):
    role: Any = None


_prompt_dec = msgspec.json.Decoder(_PromptBody)
_role_dec = msgspec.json.Decoder(_Role)
_WS_BYTES = b" \t\n\r"


def _leading(key: str, items: list[msgspec.Raw]) -> int:
    """How many of ``items`` (the conversation's, from some item on) are system or developer messages
    before its first other item (Gemini's ``contents`` have none: its instructions are a member)."""
    if key == "contents":
        return 0
    n = 0
    for raw in items:
        try:
            role = _role_dec.decode(raw).role
        except (msgspec.DecodeError, msgspec.ValidationError):
            break
        if role not in _LEADS:
            break
        n += 1
    return n


def _part(raw: Any) -> bytes:
    """A member's bytes in the prompt (none where the body has no such member, or null)."""
    if raw is UNSET:
        return b""
    blob = bytes(raw)
    return b"" if blob == b"null" else blob


def _lay_out(head: list[bytes], tools: bytes, lead: bytes | memoryview, rest: bytes | memoryview) -> bytes:
    return b"".join((*head, lead, tools, rest))


class _TopMemo:
    """Where an OpenAI or Gemini body's top level was cut (its conversation array), kept for the next body."""

    __slots__ = ("body", "key", "bounds", "pre", "lead")

    def __init__(self, body: bytes, key: str, bounds: list[int], pre: Any, lead: int):
        self.body = body
        self.key = key
        self.bounds = bounds  # the array's boundaries: [0] just after its ``[``, [i] the end of item i - 1
        self.pre = pre  # the top-level members before the array
        self.lead = lead  # its opening system/developer messages (part of the instructions)


def _from_cut(body: bytes, key: str, keys: tuple[str, ...], bounds: list[int], pre: Any, tail: Any,
              lead: int) -> tuple[bytes, Any, _TopMemo] | None:
    """The prompt of a body cut at its conversation array ``key``: the members before it (``pre``) and
    after it (``tail``: a member there is the one that counts), the items' bytes between ``bounds``.
    None where the body has a conversation member ``keys`` reads before this one (the full path's)."""

    def member(name: str) -> Any:
        value = getattr(tail, name)
        return getattr(pre, name) if value is UNSET else value

    if any(member(k) is not UNSET for k in keys[: keys.index(key)]):
        return None
    mv = memoryview(body)  # (the items are copied once, into the prompt)
    prompt = _lay_out([_part(member(h)) for h in _HEAD], _part(member("tools")),
                      mv[bounds[0]:bounds[lead]], mv[bounds[lead]:bounds[-1]])
    return prompt, member("prompt_cache_retention"), _TopMemo(body, key, bounds, pre, lead)


def _prompt(memo: Any, body: bytes, keys: tuple[str, ...]) -> tuple[bytes, Any, _TopMemo | None]:
    """The body's prompt in the provider's order and its ``prompt_cache_retention``, read around its
    conversation array: the members before it as kept in ``memo`` when the bodies share them, the
    array from the last shared item on, and what follows (:func:`_prompt_full` where that does not
    read).  The same bytes as :func:`_prompt_full`'s."""
    if isinstance(memo, _TopMemo) and memo.key in keys:
        _, dec, hdr = _PROMPT_TOP[memo.key]
        k = bisect_right(memo.bounds, _common(memo.body, body)) - 1
        if k >= 0:
            got = _cut(body, memo.bounds[k], k == 0, memo.key, dec, hdr)
            if got is not None:
                items, ends, tail = got
                # the kept items are the old body's: its first other item among them, the opening is the same
                lead = memo.lead if k > memo.lead else k + _leading(memo.key, items)
                out = _from_cut(body, memo.key, keys, memo.bounds[: k + 1] + ends, memo.pre, tail, lead)
                if out is not None:
                    return out
    for key in keys:
        _, dec, hdr = _PROMPT_TOP[key]
        loc = _locate(body, key.encode(), dec)
        if loc is not None:
            got = _cut(body, loc[0] + 1, True, key, dec, hdr)
            if got is not None:
                items, ends, tail = got
                out = _from_cut(body, key, keys, [loc[0] + 1] + ends, loc[1], tail, _leading(key, items))
                if out is not None:
                    return out
    return (*_prompt_full(body, keys), None)


def _prompt_full(body: bytes, keys: tuple[str, ...]) -> tuple[bytes, Any]:
    """:func:`_prompt`, read from the whole body; the body itself where it has no conversation
    member (or is no JSON object), with no retention."""
    try:
        top = _prompt_dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return body, None
    key = next((k for k in keys if getattr(top, k) is not UNSET), None)
    if key is None:
        return body, None
    conv = bytes(getattr(top, key))
    lead, rest = b"", conv
    if conv.startswith(b"["):  # the items' bytes as the body has them, separators and all
        items = _raws.decode(conv)
        pos = 1
        for raw in items[: _leading(key, items)]:
            blob = bytes(raw)
            pos = conv.index(blob, pos) + len(blob)  # (only commas and blanks come before an item)
        end = len(conv.rstrip(_WS_BYTES)[:-1].rstrip(_WS_BYTES))
        lead, rest = conv[1:pos], conv[pos:end]
    return _lay_out([_part(getattr(top, h)) for h in _HEAD], _part(top.tools), lead, rest), top.prompt_cache_retention


def bill_request(cache: Cache, body: bytes, now: float) -> Bill:
    """One request body through its session's cache (an OpenAI or Gemini body as its prompt: :func:`_prompt`)."""
    if cache.rules.family == "anthropic":
        got = _anthropic_memo(cache._memo, body, cache.rules) if cache.memo and type(body) is bytes else None
        if got is None:
            cache._memo = None
            return cache.send_segments(anthropic_segments(body, cache.rules), now)
        segs, cum, bps, cache._memo = got
        return cache._send(segs, cum, bps, now)
    keys = _CONV.get(cache.rules.family, _CONV["openai"])
    if cache.memo and type(body) is bytes:
        prompt, retention, cache._memo_top = _prompt(cache._memo_top, body, keys)
    else:
        prompt, retention = _prompt_full(body, keys)
    ttl = cache.rules.ttl_long if cache.rules.family == "openai" and retention == "24h" else None
    return cache.send_prefix(prompt, now, ttl)


class _Model(msgspec.Struct):
    model: Any = None


def model_of(body: bytes) -> str:
    try:
        m = msgspec.json.decode(body, type=_Model).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return m if isinstance(m, str) else ""


# -- one session's clock ---------------------------------------------------------------------------

@dataclass
class Turn:
    at: float
    predicted: Bill
    reported_read: int | None = None
    reported_write: int | None = None
    gap: float | None = None  # since the session's previous request (None: its first here)
    age: float | None = None  # how long the entry the model expected to read had been unused (None: no read)
    host: str = ""  # where the request went
    reported_input: int | None = None  # every prompt token, as the provider counted them


class Clock:
    """One session's cache over time: what each request is predicted to read, what the provider
    said it read, and what the calibration learned from such reports (:meth:`apply`: a shorter
    lifetime, no cache at all, a larger minimum; see :mod:`bili_addon.kernel.calibration`)."""

    KEEP = 200  # turns kept for the stats

    def __init__(self, lane: str, model: str = "", host: str = ""):
        self.lane = lane
        self.host = host
        self.model = model
        self.cache = Cache(rules_for(lane, model))
        # the caches of the other models the conversation used: a provider caches per model (a switch
        # reads nothing of the old model's entries; a switch back finds its own, if they are still alive)
        self.others: dict[str, Cache] = {}
        self.turns: list[Turn] = []
        self.last: float | None = None
        self.source = ""  # where the applied facts come from: "session" | "host" | "" (documented rules)

    @property
    def rules(self) -> Rules:
        return self.cache.rules

    def send(self, body: bytes, now: float) -> Bill:
        """A request leaves at ``now``: its predicted bill (and the cache updated as the provider would)."""
        if not self.turns and self.lane == "anthropic" and self.rules.min_tokens == 1024:
            model = model_of(body)
            if model:
                self.cache.rules = rules_for(self.lane, model)
                self.model = self.model or model
        bill = bill_request(self.cache, body, now)
        self.turns.append(Turn(now, bill, gap=self.gap(now), age=self.cache.hit_age if bill.read else None,
                               host=self.host))
        del self.turns[: -self.KEEP]
        self.last = now
        return bill

    def switch(self, model: str) -> None:
        """The conversation's next request is another model's: its cache is that model's own (new,
        with what the calibration applied to this session's provider), the old one kept for a switch
        back (without its memo of the previous body: its next body is no follow-up of that one)."""
        old = self.cache
        old._memo = old._memo_top = None
        self.others[self.model] = old
        new = self.others.pop(model, None)
        if new is None:
            new = Cache(rules_for(self.lane, model))
        new.ttl_cap, new.disabled, new.min_floor = old.ttl_cap, old.disabled, old.min_floor
        self.cache, self.model = new, model

    @property
    def ttl(self) -> float:
        """The shortest lifetime an entry of this session has (0: the provider keeps no cache)."""
        if self.cache.disabled:
            return 0.0
        return min(self.cache.ttl_cap, self.rules.ttl) if self.cache.ttl_cap else self.rules.ttl

    def apply(self, ttl: float | None = None, no_cache: bool = False, min_tokens: int | None = None,
              source: str = "") -> None:
        """What the calibration learned of this session's provider (None/False: the documented rule)."""
        self.cache.ttl_cap = ttl
        self.cache.disabled = no_cache
        self.cache.min_floor = min_tokens or 0
        self.source = source if (ttl or no_cache or min_tokens) else ""

    def gap(self, now: float) -> float | None:
        return None if self.last is None else now - self.last

    def memo_bytes(self) -> int:
        """About what the cache's memo of the previous body holds (the body, and its blocks' bytes)."""
        m = self.cache._memo
        return 0 if m is None else 2 * len(m.body)

    def drop_memo(self) -> None:
        self.cache._memo = self.cache._memo_top = None

    def cold(self, now: float, tail: bool = False) -> bool:
        """Whether the session's cache has expired by ``now`` (a rewrite costs nothing extra then).
        ``tail``: whether the entries of the default lifetime have (with 1-hour entries on the stable
        head, kernel/lifetime.py, what follows the head is written again anyway)."""
        return self.last is not None and not self.cache.warm(now, tail)

    def report(self, read: int, write: int | None = None, input: int | None = None) -> Turn | None:
        """The usage the provider reported for the last request sent (what the calibration compares
        with the prediction).  Returns that request's turn."""
        if not self.turns:
            return None
        t = self.turns[-1]
        t.reported_read, t.reported_write, t.reported_input = read, write, input
        return t

    def learned(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.cache.ttl_cap:
            out["ttl"] = round(self.cache.ttl_cap, 1)
        if self.cache.disabled:
            out["no_cache"] = True
        if self.cache.min_floor:
            out["min_tokens"] = self.cache.min_floor
        if out:
            out["source"] = self.source
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Predicted vs reported cache reads per request."""
        return [{"at": t.at, "predicted_read": t.predicted.read, "predicted_write": t.predicted.write
                 + t.predicted.write_long, "reported_read": t.reported_read, "reported_write": t.reported_write}
                for t in self.turns]


class Clocks:
    """The clocks of the sessions one process has seen (in memory: after a restart a session's
    clock starts again, and nothing is cold until it has seen a request).

    A request is only noted when it leaves (its body and time: no work on the request's path); the
    model bills it when the answer's usage arrives, or when a decision or the stats need the clock."""

    MAX_PENDING = 4
    MEMO_BYTES = 128 << 20  # the clocks' memos of their previous bodies, together: the least recently billed go beyond

    def __init__(self, max_sessions: int = 256):
        self.by_session: dict[str, Clock] = {}
        self.pending: dict[str, list[tuple[str, bytes, float, str, str]]] = {}
        self.last: dict[str, float] = {}  # when each session's latest request left
        self.max_sessions = max_sessions
        self.memos: OrderedDict[str, int] = OrderedDict()  # the sessions whose clock keeps a memo: its bytes
        self.memo_total = 0
        # called with each clock made (the calibration applies what its host taught)
        self.on_new: Callable[[str, Clock], None] | None = None

    def sent(self, sid: str, lane: str, body: bytes, now: float, host: str = "", model: str = "") -> None:
        """``model``: the session's (a Gemini body names none: its URL does); else the body's."""
        queue = self.pending.setdefault(sid, [])
        queue.append((lane, body, now, host, model))
        self.last[sid] = now
        if len(queue) > self.MAX_PENDING:  # answers that never came: bill them now
            self._flush(sid)
        # the requests of more sessions than the clocks keep, whose answers never came (an agent closed
        # mid-answer): forgotten, the oldest first, as a clock beyond them is (each held its whole body)
        while len(self.pending) > self.max_sessions:
            old = next(iter(self.pending))
            if old == sid:
                break
            del self.pending[old]

    def _flush(self, sid: str) -> Clock | None:
        for lane, body, now, host, model in self.pending.pop(sid, ()):
            clk = self.by_session.get(sid)
            if clk is None or clk.lane != lane or clk.host != host:
                clk = self.by_session[sid] = Clock(lane, model or model_of(body), host)
                while len(self.by_session) > self.max_sessions:
                    old = next(iter(self.by_session))
                    self.by_session.pop(old)
                    self.pending.pop(old, None)
                    self.last.pop(old, None)
                    self.memo_total -= self.memos.pop(old, 0)
                if self.on_new is not None:
                    self.on_new(sid, clk)
            elif model and clk.model and model != clk.model:  # (a model of the body's own: as sent)
                clk.switch(model)
            try:
                clk.send(body, now)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
                pass  # a body the model cannot read: no prediction for it
            self._kept(sid, clk)
        return self.by_session.get(sid)

    def _kept(self, sid: str, clk: Clock) -> None:
        """Account for the memo ``clk`` keeps now; drop the least recently billed memos beyond the budget."""
        size = clk.memo_bytes()
        self.memo_total += size - self.memos.pop(sid, 0)
        if size:
            self.memos[sid] = size
        while self.memo_total > self.MEMO_BYTES and len(self.memos) > 1:
            victim, vsize = self.memos.popitem(last=False)
            self.memo_total -= vsize
            if (c := self.by_session.get(victim)) is not None:
                c.drop_memo()

    def report(self, sid: str, read: int | None, write: int | None = None, input: int | None = None) -> Turn | None:
        """An answer came (``read``: the cache read it reported; None: it reported no usage).  Returns
        the turn of the request it answered, with its prediction and the report."""
        clk = self._flush(sid)
        if clk is not None and read is not None:
            return clk.report(read, write, input)
        return None

    def cold(self, sid: str, now: float, tail: bool = False) -> bool:
        """Whether the session's cache has expired (``tail``: its entries of the default lifetime)."""
        last = self.last.get(sid)
        if last is None:
            return False
        clk = self.by_session.get(sid)
        if now - last <= (clk.ttl if clk is not None else rules_for("").ttl):
            return False  # the latest request wrote or read an entry that lives this long at least: warm
        clk = self._flush(sid)
        return clk is not None and clk.cold(now, tail)

    def history(self, sid: str) -> tuple[Rules, list[float], int, int] | None:
        """``(rules, gaps between requests, the last request's size, the median of what a request writes
        on top of a warm cache)``.  The rules carry the lifetimes in force: a lifetime learned from the
        provider's reports caps both (the model caps every entry so); None where it keeps no cache."""
        clk = self._flush(sid)
        if clk is None or not clk.turns or clk.cache.disabled:
            return None
        ats = [t.at for t in clk.turns]
        warm = [t for t, prev in zip(clk.turns[1:], ats) if t.at - prev <= clk.ttl] or clk.turns
        writes = sorted(t.predicted.write + t.predicted.write_long + t.predicted.input for t in warm)
        rules = clk.rules
        if clk.cache.ttl_cap:
            rules = replace(rules, ttl=clk.ttl, ttl_long=min(rules.ttl_long, clk.ttl))
        return (rules, [b - a for a, b in zip(ats, ats[1:])], clk.turns[-1].predicted.total,
                writes[len(writes) // 2])

    def stats(self, sid: str) -> dict[str, Any] | None:
        clk = self._flush(sid)
        if clk is None:
            return None
        return {"family": clk.rules.family, "learned": clk.learned(), "turns": clk.rows()[-50:]}
