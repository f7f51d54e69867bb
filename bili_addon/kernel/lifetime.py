"""The lifetime of a session's Anthropic cache entries: 5 minutes (the default), 1 hour on the
stable head only, or 1 hour on every breakpoint.

A 1-hour entry is written at 2x instead of 1.25x and read at the same 0.1x.  Anthropic lets one
request mix both, as long as every 1-hour breakpoint comes before every 5-minute one (tools, then
system, then messages); it bills the tokens up to the last 1-hour breakpoint written at 2x, the rest
up to the last breakpoint at 1.25x.  Three choices follow:

- ``5m``: every breakpoint as the agent set it.  A pause over 5 minutes rewrites the whole context.
- ``head``: 1 hour on the *stable head* (the agent's breakpoints in tools and system, and messages up
  to bili's breakpoint on the last fold summary, kernel/breakpoints.py), 5 minutes on the agent's
  breakpoints after it (the live tail: Claude Code's last message).  The head is written rarely
  (once, then only a new summary at each fold), so its 2x premium is small, while a pause of 5 to 60
  minutes rewrites only the live tail.
- ``1h``: every breakpoint asks for 1 hour.  A pause under an hour rewrites nothing, but every
  turn's new tokens cost 0.75x more.

:func:`choose` weighs the three on the session's own gap history and sizes; the switch is made only
at a cold moment (the cache has expired: the request is written in full anyway), and a session only
ever moves towards longer lifetimes (5m -> head -> 1h: once it has 1-hour entries it keeps them).
:func:`apply` rewrites a body for the choice: it only adds ``"ttl": "1h"`` to breakpoints that are
there (never adding, moving or dropping one); an agent that asks for lifetimes itself is left alone.
bili never sends requests of its own to keep a cache warm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from bili_addon.kernel.breakpoints import SUMMARY_MARK

# bili's summary as the engine writes it: a text block that opens with the header (not a message quoting it)
_SUMMARY_BLOCK = b'"text":"' + SUMMARY_MARK
from bili_addon.kernel.cache import Rules, anthropic_rules, anthropic_segments

FLAG = "ttl"  # the session flag: Choice.to_flag()
MIN_GAPS = 8  # the gap history a decision needs

FIVE, HEAD, HOUR = "5m", "head", "1h"
ORDER = (FIVE, HEAD, HOUR)  # a session moves only to the right

_EPHEMERAL = re.compile(rb'("cache_control"\s*:\s*\{\s*"type"\s*:\s*"ephemeral"\s*)\}')
# every breakpoint's key (an escaped mention in a text is no key: its quotes are escaped); one the plain
# pattern above does not match (Claude Code's ``{"type":"ephemeral","scope":"global"}`` on its default
# host) keeps its lifetime, and so does every breakpoint after it in cache order (_one_hour)
_KEY = re.compile(rb'"cache_control"\s*:')
_CC = b'"cache_control"'
_objs = msgspec.json.Decoder(dict[str, msgspec.Raw])
_list = msgspec.json.Decoder(list[msgspec.Raw])
_enc = msgspec.json.Encoder()


@dataclass
class Choice:
    choice: str  # "5m" | "head" | "1h"
    cost_5m: float  # expected cost per request, input-token units
    cost_1h: float
    gaps: int
    cost_head: float | None = None  # None: the request has no head breakpoint to keep
    head: int = 0  # the head's tokens (up to its last breakpoint)

    def to_flag(self) -> dict:
        out = {"choice": self.choice, "cost_5m": round(self.cost_5m, 1), "cost_1h": round(self.cost_1h, 1),
               "gaps": self.gaps}
        if self.cost_head is not None:
            out["cost_head"] = round(self.cost_head, 1)
            out["head"] = self.head
        return out


def choose(gaps: list[float], context: int, new_per_turn: int, rules: Rules, *, head: int = 0,
           head_growth: float = 0.0, rest: float | None = None, leaving: int = 0) -> Choice | None:
    """Which lifetime costs less over requests like the ones seen: ``gaps`` between requests (s),
    ``context`` the cached prefix a request reads, ``new_per_turn`` what a request writes on top,
    ``head`` the tokens up to the head's last breakpoint (0: no head breakpoint), ``head_growth``
    what the head grows by per request (fold summaries), ``rest`` the requests left, over which the
    switch (the prefix written once at 2x instead of 1.25x) is spread (None: not counted),
    ``leaving`` the tokens a fold asked for with this very request will take off the wire.

    The switch writes the whole context now, but a range about to be folded leaves the wire with the
    next request or so: the later requests read and rewrite only what survives it, ``S = C - leaving``
    (never less than the head, which a fold never takes).  Per request, with ``w``/``W``/``r`` the
    5-minute write, 1-hour write and read multipliers and ``m5``/``m60`` the shares of gaps over 5
    minutes / over 1 hour::

        5m:   m5 (w - r) S + w n
        1h:   m60 (W - r) S + W n + (W - w) C / rest
        head: m5 (w - r) (S - H) + m60 (W - r) H + w n + (W - w) g + (W - w) H / rest
    """
    if len(gaps) < MIN_GAPS or context <= 0:
        return None
    n = len(gaps)
    w, big, r = rules.write, rules.write_long, rules.read
    m5 = sum(1 for g in gaps if g > rules.ttl) / n
    m60 = sum(1 for g in gaps if g > rules.ttl_long) / n
    spread = 1.0 / rest if rest else 0.0
    head = min(head, context)
    stays = max(head, context - max(0, leaving))
    cost_5m = m5 * (w - r) * stays + w * new_per_turn
    cost_1h = m60 * (big - r) * stays + big * new_per_turn + (big - w) * context * spread
    cost_head = None
    if head > 0:
        cost_head = (m5 * (w - r) * (stays - head) + m60 * (big - r) * head + w * new_per_turn
                     + (big - w) * head_growth + (big - w) * head * spread)
    costs = [(cost_5m, 0, FIVE), (cost_1h, 2, HOUR)] + ([(cost_head, 1, HEAD)] if cost_head is not None else [])
    best = min(costs)[2]  # a tie goes to the shorter lifetime
    return Choice(best, cost_5m, cost_1h, n, cost_head, head if cost_head is not None else 0)


def keep(previous: str | None, pick: str) -> str:
    """The choice in force after ``pick``: a session never goes back to shorter lifetimes."""
    if previous in ORDER and ORDER.index(previous) > ORDER.index(pick):
        return previous
    return pick


def upgrade(body: bytes) -> bytes | None:
    """The body with every plain ephemeral breakpoint asking for 1 hour; None when it has none, or
    when the agent already asks for lifetimes (mixing would break the provider's ordering rule)."""
    if b'"ttl"' in body or _CC not in body:
        return None
    out, n = _EPHEMERAL.subn(_HOUR, body)
    if n == body.count(_CC):  # (every mention of the key is a plain breakpoint: no other shape)
        return out if n else None
    # a breakpoint of another shape: 1 hour on the plain ones before it in cache order only (tools,
    # system, messages), wherever the body writes those keys
    try:
        top = _objs.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    n = 0
    for key in ("tools", "system", "messages"):
        raw = top.get(key)
        if raw is not None and _CC in bytes(raw):
            out, k, stop = _one_hour(bytes(raw))
            if k:
                top[key], n = msgspec.Raw(out), n + k
            if stop:
                break
    return _enc.encode(top) if n else None


_HOUR = rb'\1,"ttl":"1h"}'


def _one_hour(raw: bytes) -> tuple[bytes, int, bool]:
    """``raw`` with 1 hour on its plain ephemeral breakpoints, how many, and whether a breakpoint of
    another shape stopped it: the provider refuses a 1-hour breakpoint after a 5-minute one, so the
    breakpoints from the first such one on (here, and in what follows it in cache order) keep theirs."""
    out, n = _EPHEMERAL.subn(_HOUR, raw)
    if n == raw.count(_CC):  # (a plain breakpoint is a mention of the key: n never exceeds the count)
        return out, n, False
    pieces, at, n, stop = [], 0, 0, False
    for key in _KEY.finditer(raw):
        m = _EPHEMERAL.match(raw, key.start())
        if m is None:
            stop = True
            break
        pieces += [raw[at:m.end() - 1], b',"ttl":"1h"}']
        at, n = m.end(), n + 1
    pieces.append(raw[at:])
    return b"".join(pieces), n, stop


def upgrade_head(body: bytes) -> bytes | None:
    """The body with 1 hour on the breakpoints of its stable head: every one in ``tools`` and
    ``system``, and in ``messages`` every one up to the last fold summary that carries one (bili's
    head breakpoint), the conversation's last message excepted; the breakpoints after it keep 5
    minutes.  The upgraded breakpoints are a prefix of all of them in cache order, so every 1-hour
    entry precedes every 5-minute one.  None when there is nothing to upgrade, or when the agent
    asks for lifetimes itself."""
    if b'"ttl"' in body or _CC not in body:
        return None
    try:
        top = _objs.decode(body)
        n = 0
        stop = False
        for key in ("tools", "system"):
            raw = top.get(key)
            if raw is not None and _CC in bytes(raw) and not stop:
                out, k, stop = _one_hour(bytes(raw))
                if k:
                    top[key], n = msgspec.Raw(out), n + k
        msgs = top.get("messages")
        if msgs is not None and bytes(msgs)[:1] == b"[" and SUMMARY_MARK in bytes(msgs) and not stop:
            items = [bytes(i) for i in _list.decode(msgs)]
            last = next((i for i in range(len(items) - 2, -1, -1)
                         if _SUMMARY_BLOCK in items[i] and _CC in items[i]), None)
            k = 0
            for i in range(last + 1 if last is not None else 0):
                if _CC in items[i]:
                    items[i], ki, stop = _one_hour(items[i])
                    k += ki
                    if stop:
                        break
            if k:
                top["messages"], n = msgspec.Raw(b"[" + b",".join(items) + b"]"), n + k
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return _enc.encode(top) if n else None


def apply(body: bytes, choice: str | None) -> bytes | None:
    """The body as ``choice`` sends it (None: unchanged)."""
    if choice == HOUR:
        return upgrade(body)
    if choice == HEAD:
        return upgrade_head(body)
    return None


_TTL, _MARK, _HAS_CC, _STOP = 1, 2, 4, 8  # (_STOP, of tools or system: a breakpoint of another shape, _one_hour)
_SEEN_MAX = 32 << 20  # bytes of items whose facts are kept
_seen: dict[int, tuple[bytes, int]] = {}  # id(item) -> (the item, kept alive so its id is its own; its facts)
_seen_bytes = 0
_tops: dict[str, tuple[bytes, bytes, int, int]] = {}  # "tools"/"system" -> (bytes, with 1 hour, breakpoints, facts)


def _facts(item: bytes) -> int:
    """What :func:`apply_parts` asks of an item, once per item object: a turn's items are mostly
    the very objects of the previous pass (kernel/turn.py keeps them), so a turn scans its new ones."""
    global _seen_bytes
    hit = _seen.get(id(item))
    if hit is not None and hit[0] is item:
        return hit[1]
    f = (_TTL if b'"ttl"' in item else 0) | (_MARK if _SUMMARY_BLOCK in item else 0) | (_HAS_CC if _CC in item else 0)
    if _seen_bytes > _SEEN_MAX:
        _seen.clear()
        _seen_bytes = 0
    _seen[id(item)] = (item, f)
    _seen_bytes += len(item)
    return f


def _top(key: str, raw: bytes) -> tuple[bytes, int, int]:
    """``raw`` (the value of ``tools`` or ``system``) with 1 hour on its breakpoints, how many, and
    its facts; the last one of each key is kept (it is the same request after request)."""
    hit = _tops.get(key)
    if hit is not None and hit[0] == raw:
        return hit[1], hit[2], hit[3]
    f = (_TTL if b'"ttl"' in raw else 0) | (_HAS_CC if _CC in raw else 0)
    out, k, stop = _one_hour(raw) if f == _HAS_CC else (raw, 0, False)
    if stop:
        f |= _STOP
    _tops[key] = (raw, out, k, f)
    return out, k, f


def apply_parts(top: dict[str, msgspec.Raw], key: str, items: list[bytes] | None) -> tuple[bool, bool]:
    """:func:`upgrade_head` on a body bili holds in parts, in place: ``top`` its top-level values
    and ``items`` its conversation array (None: the array is ``top[key]`` as it is, or not an
    array); the body is ``top`` encoded with the array ``b"[" + b",".join(items) + b"]"``.  The same
    breakpoints get their hour without the body being parsed again: the engine holds the parts
    (kernel/pressure.py), and what an item holds is known from the previous turn when it is the same
    item.  Returns whether it changed something, and whether ``items`` among it."""
    if "ttl" in top:
        return False, False
    heads: dict[str, tuple[bytes, int, int]] = {}
    for k, v in top.items():
        if items is not None and k == key:
            continue
        if k in ("tools", "system"):
            out, n, f = _top(k, bytes(v))
            heads[k] = (out, n, f)
        else:
            f = _TTL if b'"ttl"' in bytes(v) else 0
        if f & _TTL:
            return False, False  # the agent asks for lifetimes itself
    facts = [_facts(i) for i in items] if items else []
    if any(f & _TTL for f in facts):
        return False, False
    n = m = 0
    stop = False
    for k in ("tools", "system"):  # (in cache order: a breakpoint of another shape stops the hours there)
        if k in heads and not stop:
            out, ki, f = heads[k]
            if ki:
                top[k], n = msgspec.Raw(out), n + ki
            stop = bool(f & _STOP)
    if facts and not stop:
        last = next((i for i in range(len(facts) - 2, -1, -1) if facts[i] & _MARK and facts[i] & _HAS_CC), None)
        for i in range(last + 1 if last is not None else 0):
            if facts[i] & _HAS_CC:
                items[i], ki, stop = _one_hour(items[i])
                m += ki
                if stop:
                    break
    return n + m > 0, m > 0


def head_tokens(body: bytes) -> int:
    """The tokens up to the last 1-hour breakpoint of ``body`` (as :func:`upgrade_head` made it)."""
    rules = anthropic_rules()
    try:
        segs = anthropic_segments(body, rules)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    cum, head = 0, 0
    for s in segs:
        cum += s.tokens
        if s.ttl is not None and s.ttl > rules.ttl:
            head = cum
    return head
