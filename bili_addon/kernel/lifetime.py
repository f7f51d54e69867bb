"""The lifetime of a session's Anthropic cache entries: 5 minutes (the default) or 1 hour.

A 1-hour entry is written at 2x instead of 1.25x and read at the same 0.1x.  It pays where the
session's pauses keep outliving 5 minutes: each such pause costs a full rewrite of the context with
5-minute entries, and none (under an hour) with 1-hour ones; every turn's new tokens cost 0.75x more.
:func:`choose` weighs the two on the session's own gap history and sizes; the switch is made only at
a cold moment (the cache has expired: the request is written in full anyway), and once a session has
1-hour entries it keeps them.  :func:`upgrade` asks for the 1-hour lifetime on every breakpoint the
agent set (never adding, moving or dropping one); an agent that asks for lifetimes itself is left
alone.  bili never sends requests of its own to keep a cache warm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bili_addon.kernel.cache import Rules

FLAG = "ttl"  # the session flag: {"choice": "5m"|"1h", "cost_5m": ..., "cost_1h": ..., "gaps": n}
MIN_GAPS = 8  # the gap history a decision needs

_EPHEMERAL = re.compile(rb'("cache_control"\s*:\s*\{\s*"type"\s*:\s*"ephemeral"\s*)\}')


@dataclass
class Choice:
    choice: str  # "5m" | "1h"
    cost_5m: float  # expected cost per request, input-token units
    cost_1h: float
    gaps: int

    def to_flag(self) -> dict:
        return {"choice": self.choice, "cost_5m": round(self.cost_5m, 1), "cost_1h": round(self.cost_1h, 1),
                "gaps": self.gaps}


def choose(gaps: list[float], context: int, new_per_turn: int, rules: Rules) -> Choice | None:
    """Which lifetime costs less over requests like the ones seen: ``gaps`` between requests (s),
    ``context`` the cached prefix a request reads, ``new_per_turn`` what a request writes on top."""
    if len(gaps) < MIN_GAPS or context <= 0:
        return None
    n = len(gaps)
    miss_5m = sum(1 for g in gaps if g > rules.ttl)
    miss_1h = sum(1 for g in gaps if g > rules.ttl_long)
    cost_5m = (miss_5m * (rules.write - rules.read) * context + n * rules.write * new_per_turn) / n
    cost_1h = (miss_1h * (rules.write_long - rules.read) * context + n * rules.write_long * new_per_turn) / n
    return Choice("1h" if cost_1h < cost_5m else "5m", cost_5m, cost_1h, n)


def upgrade(body: bytes) -> bytes | None:
    """The body with every plain ephemeral breakpoint asking for 1 hour; None when it has none, or
    when the agent already asks for lifetimes (mixing would break the provider's ordering rule)."""
    if b'"ttl"' in body or b'"cache_control"' not in body:
        return None
    out, n = _EPHEMERAL.subn(rb'\1,"ttl":"1h"}', body)
    return out if n else None
