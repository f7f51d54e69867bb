"""Deferred materialization: a fold is made at once, its range leaves the wire when that pays.

A ``compress`` call is executed as soon as a request carries it: its blocks are stored (searchable
and decompressible at once) and the model reads its real result.  Taking the range off the wire is
another matter: it rewrites the prompt cache from the range's first byte on.  So the blocks of a
fold are *held* (not rendered: the originals stay on the wire, byte for byte) until the one rewrite
decision (:mod:`~bili_addon.kernel.rewrite`) says to land them: at the next cold moment, when the
window forces it, or when the reads saved outweigh the rewrite.  Everything held lands together, in
one rewrite.  The tool result tells the model, in one sentence, that the range will be replaced.

What is held is a session flag (``pending``), persisted with the session's version like any other
(restarts, several instances): ``blocks``, the ids of active blocks not on the wire yet, and
``wire``, the ids of blocks a held block absorbed (a held distillation) whose summaries stay on the
wire until it lands.  A retired block (the agent compacted: a new epoch) is never on the wire; a fork
inherits the flag with the blocks (kernel/lineage.py): what the parent held, the child holds, so the
history they share keeps its bytes (ids of blocks the child did not inherit mean nothing to it).  ``bili_materialize=now`` lands every fold at once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from bili_addon import prices, printable
from bili_addon.kernel import cache, fold, rewrite
from bili_addon.kernel.fold import Block, View
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import Session, TurnResult

if TYPE_CHECKING:
    from bili_addon.kernel.nudge import NudgeConfig
    from bili_addon.kernel.registry import Sessions

log = logging.getLogger("bili")

FLAG = "pending"
MODES = ("cost", "now")
SENTENCE = ("The originals stay visible until the prompt cache goes cold (or the context fills); the summaries "
            "replace them then.")


def held(s: Session) -> tuple[set[str], set[str]]:
    """``(blocks held off the wire, inactive blocks still on it)``."""
    p = s.flags.get(FLAG) or {}
    return set(p.get("blocks", ())), set(p.get("wire", ()))


def on_wire(blocks: list[Block], hold: set[str], keep: set[str]) -> list[Block]:
    """The blocks as the wire shows them: copies whose ``active`` says whether the summary stands there."""
    if not hold and not keep:
        return blocks
    out = []
    for b in blocks:
        on = not b.retired and ((b.active and b.id not in hold) or (not b.active and b.id in keep))
        out.append(b if on == b.active else dataclasses.replace(b, active=on))
    return out


def after_fold(hold: set[str], keep: set[str], made: list[Block], gone: list[Block]) -> tuple[set[str], set[str]]:
    """What is held once the blocks ``made`` are held too (``gone``: the blocks they absorbed)."""
    hold, keep = set(hold), set(keep)
    for b in gone:
        if b.id in hold:
            hold.discard(b.id)  # it never reached the wire
        else:
            keep.add(b.id)  # its summary stays until what absorbed it lands
    hold.update(b.id for b in made)
    return hold, keep


def measure(view: View, now: list[Block], landed: list[Block], hidden_now: set[str] = frozenset(),
            hidden_landed: set[str] = frozenset()) -> rewrite.Change:
    """What landing changes: the tokens it takes off every request and what the request writes from
    the first changed item on."""
    a = fold.plan(view, now, hidden_now)
    b = fold.plan(view, landed, hidden_landed)
    items = view.items

    def sent(p: fold.Plan) -> int:
        return (sum(it.tokens for k, it in enumerate(items) if k not in p.drop)
                + sum(count_tokens(x.text()) for x in p.rendered))

    ids = lambda p, k: [x.id for x in p.inserts.get(k, ())]  # noqa: E731
    first = next((k for k in range(len(items))
                  if (k in a.drop) != (k in b.drop) or ids(a, k) != ids(b, k)), len(items))
    tail = (sum(it.tokens for k, it in enumerate(items) if k >= first and k not in b.drop)
            + sum(count_tokens(x.text()) for k, xs in b.inserts.items() if k >= first for x in xs))
    # the head ends with the last summary on the wire now: a change before it, or of it, reaches in
    last = max((k for k, xs in a.inserts.items() if xs), default=-1)
    head = first < last or (first == last and ids(a, first) != ids(b, first))
    return rewrite.Change(sent(a) - sent(b), tail, head)


class DeferHost(Protocol):
    """What :class:`Deferred` needs of the engine it is mixed into."""

    sessions: Sessions
    clocks: cache.Clocks
    nudge_cfg: NudgeConfig
    materialize: str
    now: Callable[[], float]

    def window_for(self, s: Session) -> int: ...

    def reported_usage(self, s: Session) -> tuple[int, int, int, int] | None: ...

    def spent_calls(self, s: Session, view: View, keep_failed: int = 2,
                    blocks: list[Block] | None = None) -> set[str]: ...

    def _moment(self, s: Session, head: bool = False) -> rewrite.Moment: ...

    def _weigh(self, s: Session, view: View, hold: set[str], keep: set[str]) -> rewrite.Decision: ...


class Deferred:
    """Mixed into the :class:`Engine`: holding folds and landing them.  What it uses of the engine
    is :class:`DeferHost`."""

    def wire_blocks(self: DeferHost, s: Session) -> tuple[list[Block], list[Block]]:
        """The session's blocks as the wire shows them (held ones inactive), and as the compress
        calls on the wire see them (a held block is not spent; one it absorbed is not yet)."""
        if not s.flags.get(FLAG):
            return s.blocks, s.blocks
        hold, keep = held(s)
        return on_wire(s.blocks, hold, keep), on_wire(s.blocks, set(), keep)

    def defer_fold(self: DeferHost, s: Session, made: list[Block], gone: list[Block],
                   view: View) -> dict[str, Any] | None:
        """What is held once the fold that made ``made`` (already in ``s.blocks``) is: the ``pending``
        flag to store with it (``land``: everything held leaves the wire with this request), or None
        (``bili_materialize=now``)."""
        if self.materialize == "now" or not made:
            return None
        before = s.flags.get(FLAG) or {}
        hold, keep = after_fold(*held(s), made, gone)
        d = self._weigh(s, view, hold, keep)
        # ``since``: the request of the oldest fold still held (a fold held across requests had its call
        # rendered with its whole summary: landing it renders the calls anew; a newer fold made with the
        # landing request said nothing of the older ones)
        since = before["since"] if before.get("blocks") and "since" in before else s.row.requests
        return {"blocks": sorted(hold), "wire": sorted(keep), "since": since, "land": d.now,
                "last": d.to_flag()}

    def _land(self: DeferHost, s: Session, view: View, result: TurnResult, repeat: bool = False) -> None:
        """Land everything held when the decision says so (one rewrite).  ``repeat``: the request is the
        previous one's history again (a retry): what was held then stays held (the decision counts the
        session's requests, and a retry would tip it: the same history sent with other bytes)."""
        if not s.flags.get(FLAG):
            return
        hold, keep = held(s)
        landing = [b.id for b in s.blocks if b.id in hold and b.active and not b.retired]
        if not landing:  # what was held was retired (a new epoch) or absorbed: nothing waits any more
            self.sessions.set_flag(s.row.id, FLAG, {})
            return
        flag = s.flags[FLAG]
        if repeat and not flag.get("land") and self.materialize != "now":
            return
        if self.materialize == "now" or flag.get("land"):  # decided when the fold was made
            d = rewrite.Decision(True, "now" if self.materialize == "now" else (flag.get("last") or {}).get("why", "pays"))
        else:
            d = self._weigh(s, view, hold, keep)
        if not d.now:
            return
        self.sessions.set_flag(s.row.id, FLAG, {})
        result.landed = len(landing)
        if not (flag.get("land") and flag.get("since") == s.row.requests):
            s.version += 1  # held across requests: the calls that made them render anew (kernel/tools.py)
        log.info("[bili] session=%s: held fold(s) %s land in one rewrite (%s)", printable(s.row.id), ", ".join(landing),
                 d.why)

    def _weigh(self: DeferHost, s: Session, view: View, hold: set[str], keep: set[str]) -> rewrite.Decision:
        wire = on_wire(s.blocks, hold, keep)
        calls = on_wire(s.blocks, set(), keep)
        change = measure(view, wire, s.blocks, self.spent_calls(s, view, blocks=calls) if s.calls else set(),
                         self.spent_calls(s, view) if s.calls else set())
        return rewrite.decide(change, self._moment(s, change.head))

    def _moment(self: DeferHost, s: Session, head: bool = False) -> rewrite.Moment:
        """``head``: the change reaches into the stable head (a distil of summaries on the wire)."""
        sid = s.row.id
        now = self.now()
        # a fold's range mostly starts after the last summary, where the head's 1-hour entries end (when
        # the session keeps them, kernel/lifetime.py): once the live tail's entries have expired it
        # rewrites nothing that is not written anyway. A change of the head (distilling summaries)
        # rewrites those too: free only once they have expired as well
        cold = self.clocks.cold(sid, now, tail=not head)
        h = self.clocks.history(sid)
        rules = h[0] if h else cache.rules_for(s.row.lane, s.model)
        clk = self.clocks.by_session.get(sid)
        # (a pause longer than the live tail's lifetime is the free moment the horizon counts on)
        if clk is None:
            ttl = 0.0
        elif head:
            ttl = clk.cache.ttl_cap or 0.0
        else:
            ttl = clk.cache.tail_ttl()
        last = self.reported_usage(s)
        used = last[0] if last else s.sent_tokens
        return rewrite.Moment(rules, cold, used, self.window_for(s), self.nudge_cfg.pressure, s.row.requests,
                              tuple(h[1][-100:]) if h else (), ttl, prices.long_factor(s.model))


__all__ = ["DeferHost", "Deferred", "FLAG", "MODES", "SENTENCE", "after_fold", "held", "measure", "on_wire"]
