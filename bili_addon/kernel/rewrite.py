"""One decision for every change to bytes already sent: now, or pending until it pays.

A prompt cache is a prefix cache: changing a byte that an earlier request sent (bringing bili's
tools in, a fold's summary standing in for its range, a distillation, an emergency cut) makes the
provider write everything from that byte on again, where the same request would otherwise have read
it.  What the change buys is a shorter prompt on every later request.  :func:`decide` weighs the two
on the provider's prices (:class:`~bili_addon.kernel.cache.Rules`):

- **cold**: the session's cache has expired (the clock says so): the request is written in full
  anyway, so the rewrite costs nothing extra; do it now, with everything else that waits;
- **window**: the prompt is near the window (the nudge's pressure share): do it now, whatever it costs;
- **pays**: the reads it saves over the requests it would otherwise wait for outweigh the rewrite:
  ``read * saved * horizon >= (write - read) * tail``, where ``tail`` is what the request writes
  from the first changed byte on (after the change) and ``horizon`` the expected number of requests
  until the change would be free anyway (the next cold moment, from the session's gap history) or
  the session ends (estimated, as the only evidence there is, by the requests it has had so far);
- a model with a long-context price (:data:`bili_addon.prices.LONG_PROMPT`: over 200K prompt tokens every
  token of the request costs ``long`` times as much) weighs each side at its price: a fold that brings
  the prompt under the line saves the premium on every later request, and a rewrite over the line
  costs it;
- otherwise it stays **pending**, and the next change is weighed together with it (one rewrite from
  the earliest changed byte, the savings added up): changes are batched.

Pure code: no store, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from bili_addon.kernel.cache import Rules
from bili_addon.prices import LONG_PROMPT

MIN_REST = 8  # requests a session is assumed to have left, however young it is
MAX_HORIZON = 1000

NOW_REASONS = ("cold", "window", "pays")


@dataclass(frozen=True)
class Change:
    """A rewrite of what was sent, as the cache sees it (token estimates)."""

    saved: int  # tokens fewer on every later request (negative: the change adds tokens)
    tail: int  # tokens the request writes from the first changed byte on, once the change is made
    head: bool = False  # it changes the stable head too (a summary on the wire: kernel/lifetime.py keeps
    # that part for an hour where the session's pauses ask for it, so the tail's expiry does not make it free)


@dataclass(frozen=True)
class Moment:
    """Where the session stands when a request leaves."""

    rules: Rules
    cold: bool  # the cache has expired: the request is written in full anyway
    used: int  # the prompt's size as last reported (or estimated)
    window: int  # 0: unknown
    pressure: float  # the share of the window from which the window forces changes in
    requests: int  # requests the session has had
    gaps: tuple[float, ...] = ()  # seconds between its recent requests
    ttl: float = 0.0  # the cache's lifetime as the clock knows it (0: the rules' default)
    long: float = 1.0  # what a request over LONG_PROMPT pays per token, as a multiple (the model's tier: 2.0; none: 1)


@dataclass(frozen=True)
class Decision:
    now: bool
    why: str  # cold | window | pays | pending
    benefit: float = 0.0  # input-token units the change saves over the horizon
    cost: float = 0.0  # input-token units its rewrite costs now

    def to_flag(self) -> dict:
        return {"why": self.why, "benefit": round(self.benefit, 1), "cost": round(self.cost, 1)}


def window_forces(used: int, window: int, pressure: float) -> bool:
    return window > 0 and used >= pressure * window


def horizon(m: Moment) -> float:
    """The expected number of requests until a change left pending would be free (a cold moment)
    or the session is over: ``E[min(Geometric(p), rest)]``, ``p`` the share of the session's gaps
    that outlived the cache's lifetime, ``rest`` its expected remaining requests."""
    rest = min(MAX_HORIZON, max(MIN_REST, m.requests))
    if not m.gaps:
        return float(rest)
    ttl = m.ttl or m.rules.ttl
    p = sum(1 for g in m.gaps if g > ttl) / len(m.gaps)
    if p <= 0:
        return float(rest)
    if p >= 1:
        return 1.0
    return (1 - (1 - p) ** rest) / p


def cost_of(change: Change, rules: Rules) -> float:
    """What making the change costs now, beyond what the request would cost without it."""
    return max(0.0, (rules.write - rules.read) * change.tail)


def decide(change: Change, m: Moment) -> Decision:
    """Whether ``change`` (all that waits, taken together) is made with this request."""
    if m.cold:
        return Decision(True, "cold")
    if window_forces(m.used, m.window, m.pressure):
        return Decision(True, "window")
    after = m.used - change.saved  # (the prompt once the change is made)
    at_now = m.long if m.used > LONG_PROMPT else 1.0
    at_after = m.long if after > LONG_PROMPT else 1.0
    cost = cost_of(change, m.rules) * at_after
    benefit = m.rules.read * (m.used * at_now - after * at_after) * horizon(m)
    if change.saved > 0 and benefit >= cost:
        return Decision(True, "pays", benefit, cost)
    return Decision(False, "pending", benefit, cost)


__all__ = ["Change", "Decision", "MIN_REST", "Moment", "NOW_REASONS", "cost_of", "decide", "horizon",
           "window_forces"]
