"""``bili replay --cost``: what each replayed session is billed under the provider's cache rules,
with the addon (the bodies it would send) and without it (the agent's own bodies).

Each session's requests go, in their recorded order and at their recorded times, through two
:class:`~bili_addon.kernel.cache.Clock` s of its lane's provider model: one fed the agent's original
bodies, one the bodies the addon sends.  Costs are in input-token units of the model (an uncached
input token = 1; cache reads and writes at the provider's multipliers; a request over the long-context
line of a model with such a price, every one of its tokens at that price's multiple:
:func:`bili_addon.prices.long_factor`); the answers' output tokens are the same either way and are
left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from bili_addon.kernel.cache import Bill, Clock, model_of
from bili_addon.prices import LONG_PROMPT, long_factor


@dataclass
class SessionCost:
    label: str
    lane: str
    model: str
    requests: int = 0
    without: float = 0.0
    with_addon: float = 0.0
    bill_without: Bill = field(default_factory=Bill)
    bill_with: Bill = field(default_factory=Bill)

    @property
    def ratio(self) -> float:
        return self.with_addon / self.without if self.without else 1.0


def session_costs(reports: Iterable) -> list[SessionCost]:
    """Per session (of every report's turns): the billed cost without and with the addon."""
    out: list[SessionCost] = []
    for report in reports:
        clocks: dict[str, tuple[SessionCost, Clock, Clock, float]] = {}
        for t in report.turns:
            if t.lane in ("anthropic", "chat", "responses", "gemini"):
                # a chained turn is billed on its whole chain (the provider reads it all), not its delta
                raw, body = t.prompt or t.raw or t.body, t.prompt_sent or t.body
                got = clocks.get(t.session)
                if got is None:
                    model = t.model or model_of(raw)  # (the session's: a Gemini body names none)
                    sc = SessionCost(f"{report.path} {t.session[:12]}", t.lane, model)
                    got = clocks[t.session] = (sc, Clock(t.lane, model), Clock(t.lane, model), long_factor(model))
                    out.append(sc)
                sc, orig, sent, long = got
                try:
                    a = orig.send(raw, t.at)
                    b = sent.send(body, t.at)
                except Exception:  # a body the cache model cannot read (not JSON): both as plain input
                    a = Bill(input=len(raw) // 4)
                    b = Bill(input=len(body) // 4)
                sc.requests += 1
                sc.bill_without += a
                sc.bill_with += b
                # (the agent's requests went out as recorded: one over the line asked for the window it needs)
                sc.without += a.cost(orig.rules) * (long if a.total > LONG_PROMPT else 1.0)
                sc.with_addon += b.cost(sent.rules) * (long if b.total > LONG_PROMPT else 1.0)
    return out


def cost_table(costs: list[SessionCost]) -> list[str]:
    rows = [("session", "lane", "model", "reqs", "without", "with bili", "ratio", "reads w/o→with", "writes w/o→with")]
    for c in costs:
        rows.append((c.label, c.lane, c.model or "-", str(c.requests), f"{c.without:,.0f}", f"{c.with_addon:,.0f}",
                     f"x{c.ratio:.3f}", f"{c.bill_without.read:,}→{c.bill_with.read:,}",
                     f"{c.bill_without.write + c.bill_without.write_long:,}→{c.bill_with.write + c.bill_with.write_long:,}"))
    total_without = sum(c.without for c in costs)
    total_with = sum(c.with_addon for c in costs)
    worst = max(costs, key=lambda c: c.ratio, default=None)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    ratio = total_with / total_without if total_without else 1.0
    lines.append(f"total: {len(costs)} sessions, without {total_without:,.0f}, with bili {total_with:,.0f} "
                 f"(input-token units): x{ratio:.3f}"
                 + (f"; worst x{worst.ratio:.3f} ({worst.label})" if worst else ""))
    return lines
