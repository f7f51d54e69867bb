"""What bili did to each model request, in figures a person reads: the per-request log line, and the
per-turn rows behind ``bili stats`` and the page (the store's ``wire`` table).

The request side notes what the agent sent and what bili sent (whole bodies, in tokens as the
kernel estimates them) and predicts the cache-read share: the leading parts of the request (tools,
system prompt, conversation items, in the order a provider's prompt cache reads them) that are the
same as in the session's previous request.  The answer brings the provider's usage; then one row
is written and one line logged::

    bili claude 3fe7b19e t42 anthropic: 181.2K -> 46.1K tok (-75%), cache read 93% (reported 92%),
    3 blocks, $0.041 (saved $0.12)

"saved" prices the tokens bili took off as cache reads, and what it added where the turn paid the
most for its tokens (:func:`bili_addon.prices.without_bili`): a lower bound.  A model without a price
shows tokens only.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any

import msgspec

from bili_addon import prices
from bili_addon.kernel.identity import count_tokens
from bili_addon.store import WireTurn

KEEP = 1024  # sessions whose last request's part digests are kept for the prediction


# the order a provider's prompt cache reads a request in (tools, then the system prompt, then the
# conversation), whatever order the JSON keys come in
CACHE_ORDER = ("tools", "system", "instructions", "systemInstruction", "messages", "input", "contents")
CONVERSATION = ("messages", "input", "contents")


def cache_chunks(body: bytes) -> list[tuple[bytes, int]]:
    """``(digest, length)`` of the parts of a request a prompt cache reads, in the order it reads
    them: the tools, the system prompt, then each conversation item (the body as one part when it
    is not a JSON object).  Digests, not bytes: kept per session, they stay small."""
    try:
        doc = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return [(hashlib.sha256(body).digest(), len(body))]
    out: list[tuple[bytes, int]] = []
    for k in CACHE_ORDER:
        if k not in doc:
            continue
        raw = bytes(doc[k])
        items = None
        if k in CONVERSATION:
            try:
                items = msgspec.json.decode(raw, type=list[msgspec.Raw])
            except (msgspec.DecodeError, msgspec.ValidationError):
                items = None
        for part in ([bytes(x) for x in items] if items is not None else [raw]):
            out.append((hashlib.sha256(k.encode() + b"\0" + part).digest(), len(part)))
    return out


def estimate(body: bytes) -> int:
    """A whole request body in tokens, by the kernel's estimate (the same for what the agent sent and
    what bili sent, so the two compare; tools and system prompt included, as the provider counts)."""
    if body.isascii():
        return -(-len(body) // 4)
    return count_tokens(body.decode("utf-8", "replace"))


class Meter:
    """Kept by the addon; used on the store's worker thread only."""

    def __init__(self, table: prices.Table | None = None):
        self.table = table or prices.default()
        self._last: OrderedDict[str, list[tuple[bytes, int]]] = OrderedDict()

    def predict(self, session: str, sent: bytes, side: bool = False) -> float | None:
        """The share of ``sent`` a prefix cache can read: its leading parts (tools, system prompt,
        conversation items) that the session's previous request had the same (None: the session's
        first request here).  Whole parts only, as a cache breakpoint ends a part.  ``side``: a side
        request's (kernel/reconcile.py), whose parts the conversation's next request is not compared with."""
        chunks = cache_chunks(sent)
        if side:
            prev = self._last.get(session)
        else:
            prev = self._last.pop(session, None)
            self._last[session] = chunks
        while len(self._last) > KEEP:
            self._last.popitem(last=False)
        total = sum(n for _, n in chunks)
        if prev is None or not total:
            return None
        same = 0
        for a, b in zip(prev, chunks):
            if a != b:
                break
            same += b[1]
        return round(same / total, 4)

    def request(self, session: Any, raw: bytes, sent: bytes, model: str = "") -> dict[str, Any]:
        """The request's figures for its flow record (``session``: the kernel's live Session; ``raw``:
        the agent's body, ``sent``: what goes upstream; ``model``: the request's, else the session's: a
        side request names its own).  ``predicted`` is filled in with the answer
        (:meth:`predict`, on the worker after the answer: it parses and hashes the whole body, work
        kept off the request's path)."""
        agent = estimate(raw)
        return {"agent": session.row.agent, "model": model or session.model, "turn": session.row.requests,
                "agent_tokens": agent, "sent_tokens": agent if sent == raw else estimate(sent),
                "predicted": None}

    @staticmethod
    def row(record: dict[str, Any], usage: Any) -> WireTurn:
        """``usage``: the answer's (stream/lanes.py ``Usage``); its writes' 1-hour part as the provider
        reported it, or as the engine derived it from what was sent (kernel/tools.py)."""
        long = getattr(usage, "cache_write_1h", None)
        return WireTurn(0, time.time(), int(record.get("turn") or 0), str(record.get("model") or ""),
                        int(record.get("agent_tokens") or 0), int(record.get("sent_tokens") or 0),
                        record.get("predicted"), int(record.get("blocks") or 0), int(record.get("folded") or 0),
                        list(record.get("executed") or []), usage.input, usage.cache_read, usage.cache_write,
                        usage.output, min(int(long or 0), usage.cache_write),
                        str(getattr(usage, "split", "") or "") if usage.cache_write else "")

    def line(self, session: str, lane: str, agent: str, w: WireTurn) -> str:
        return line(session, lane, agent, w, self.table)


def tokens(n: int | float) -> str:
    """``181.2K``, ``1.3M``, ``950``."""
    n = float(n)
    if abs(n) >= 999_950:
        return f"{n / 1e6:.1f}M"
    if abs(n) >= 1000:
        return f"{n / 1e3:.1f}K"
    return f"{n:.0f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def turn_money(w: WireTurn, table: prices.Table | None = None) -> tuple[float | None, float | None]:
    """``(cost, saved)`` of one turn in US dollars; ``(None, None)`` when the model has no price."""
    t = table or prices.default()
    c = t.cost(w.model, w.input_tokens, w.cache_read, w.cache_write, w.output_tokens, cache_write_1h=w.cache_write_1h)
    if c is None:
        return None, None
    without = prices.without_bili(w.model, w.input_tokens, w.cache_read, w.cache_write, w.output_tokens,
                                  w.agent_tokens - w.sent_tokens, cache_write_1h=w.cache_write_1h, table=t)
    return c.total, without.total - c.total


def line(session: str, lane: str, agent: str, w: WireTurn, table: prices.Table | None = None) -> str:
    change = f" ({(w.sent_tokens - w.agent_tokens) / w.agent_tokens:+.0%})" if w.agent_tokens else ""
    reported = w.cache_read / w.input_tokens if w.input_tokens else None
    out = (f"bili {agent or '?'} {session[:8]} t{w.request} {lane}: {tokens(w.agent_tokens)} -> "
           f"{tokens(w.sent_tokens)} tok{change}, cache read {pct(w.predicted)} (reported {pct(reported)}), "
           f"{w.blocks} block{'s' if w.blocks != 1 else ''}")
    if w.cache_write_1h:  # written at the 1-hour rate (2x input, not 1.25x): said, as the cost counts it
        out += f", cache write {tokens(w.cache_write)} ({tokens(w.cache_write_1h)} for 1 h)"
    cost, saved = turn_money(w, table)
    if cost is not None:
        out += f", {prices.money(cost)} (saved {prices.money(saved)})"
    return out


def turn_dict(w: WireTurn, table: prices.Table | None = None) -> dict[str, Any]:
    """One turn for ``/__bili/stats?session=``, the page and ``bili stats --session``."""
    cost, saved = turn_money(w, table)
    return {"n": w.n, "ts": round(w.ts, 3), "request": w.request, "model": w.model,
            "agent_tokens": w.agent_tokens, "sent_tokens": w.sent_tokens, "predicted": w.predicted,
            "blocks": w.blocks, "folded": w.folded, "executed": w.executed, "input_tokens": w.input_tokens,
            "cache_read": w.cache_read, "cache_write": w.cache_write, "output_tokens": w.output_tokens,
            # the writes' 1-hour part (priced at 2x input, the rest at 1.25x) and who split them: "reported"
            # by the provider, "sent" from the request's breakpoints (the provider did not say), "" (no split)
            "cache_write_1h": w.cache_write_1h, "write_split": w.write_split, "side": w.side,
            "uncached": max(0, w.input_tokens - w.cache_read - w.cache_write),
            "reported": round(w.cache_read / w.input_tokens, 4) if w.input_tokens else None,
            "cost": _usd(cost), "saved": _usd(saved)}


def _usd(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def totals(store: Any, sid: str, table: prices.Table | None = None) -> dict[str, Any]:
    """:func:`summary` from the store's sums (``Store.wire_totals``), without reading every turn:
    cost is linear in the tokens on each side of a long-context price's line, so per-model sums on
    each side price the same as turn by turn."""
    n, last, peak_a, peak_s, models = store.wire_totals(sid)
    out = summary([last] if last else [], table)
    if not n:
        return out
    t = table or prices.default()
    inp = sum(m[1] for m in models)
    out.update(turns=n, agent_peak=peak_a, sent_peak=peak_s,
               reported=round(sum(m[2] for m in models) / inp, 4) if inp else None,
               cost=None, saved=None, priced=False)
    costs = [(t.cost(m, i, r, w, o, cache_write_1h=h, long=bool(lw)),
              prices.without_bili_sums(m, i, r, w, o, removed, (lx, sx, px, rx), cache_write_1h=h, table=t,
                                       over=bool(lo) and prices.may_go_long(m, t)))
             for m, i, r, w, o, _d, h, _rep, _sent, removed, lx, sx, px, rx, lw, lo in models]
    out.update(writes(models))
    if all(c is not None for c, _ in costs):
        out.update(cost=_usd(sum(c.total for c, _ in costs)),
                   saved=_usd(sum(wo.total - c.total for c, wo in costs)), priced=True)
    return out


def writes(models: list[tuple]) -> dict[str, Any]:
    """The cache writes of a session's turns (``Store.wire_totals``'s per-model sums): in all, their
    1-hour part, and who split them (tokens): the provider's report, what bili sent (the provider did
    not say: the request's breakpoints), or nobody (turns recorded before schema 9: priced at 5 minutes)."""
    total = sum(m[3] for m in models)
    reported, sent = sum(m[7] for m in models), sum(m[8] for m in models)
    return {"cache_write": total, "cache_write_1h": sum(m[6] for m in models),
            "write_split": {"reported": reported, "sent": sent, "none": max(0, total - reported - sent)}}


def summary(turns: list[WireTurn], table: prices.Table | None = None) -> dict[str, Any]:
    """A session's figures over its answered turns: now (the last turn) and peak tokens, as the agent
    sent them and as bili did; cache-read shares; money (None when a turn's model has no price)."""
    # now: the conversation's last turn (a side request's only when the session has nothing else)
    last = next((w for w in reversed(turns) if not w.side), turns[-1]) if turns else None
    out: dict[str, Any] = {"turns": len(turns), "model": last.model if last else "",
                           "agent_now": 0, "sent_now": 0, "agent_peak": 0, "sent_peak": 0,
                           "predicted": None, "reported": None, "cost": None, "saved": None, "priced": False,
                           **writes([])}
    if last is None:
        return out
    inp = sum(w.input_tokens for w in turns)
    out.update(agent_now=last.agent_tokens, sent_now=last.sent_tokens,
               agent_peak=max(w.agent_tokens for w in turns), sent_peak=max(w.sent_tokens for w in turns),
               predicted=last.predicted,
               reported=round(sum(w.cache_read for w in turns) / inp, 4) if inp else None)
    out.update(writes([(w.model, 0, 0, w.cache_write, 0, 0, w.cache_write_1h,
                        w.cache_write if w.write_split == "reported" else 0,
                        w.cache_write if w.write_split == "sent" else 0) for w in turns]))
    money = [turn_money(w, table) for w in turns]
    if all(c is not None for c, _ in money):
        out.update(cost=_usd(sum(c for c, _ in money)), saved=_usd(sum(s for _, s in money)), priced=True)
    return out


__all__ = ["Meter", "cache_chunks", "estimate", "totals", "line", "pct", "summary", "tokens", "turn_dict", "turn_money",
           "writes"]
