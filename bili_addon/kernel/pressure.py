"""What the context's size decides each turn: activation, reminders and truncation, cache lifetime.

:func:`is_active` asks whether bili shows itself in this request (kernel/activation.py);
:func:`apply` records the reminder (nudge) and the emergency truncations the usage calls for
(kernel/nudge.py); :func:`upgrade_lifetime` gives an Anthropic body 1-hour cache entries (on its stable head, or
everywhere) where the session chose them (kernel/lifetime.py).  What they use of the engine is :class:`PressureHost`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from bili_addon import printable
from bili_addon.kernel import activation, fold, lifetime, nudge, rewrite
from bili_addon.kernel.compaction import asks_for_summary
from bili_addon.kernel.fold import View
from bili_addon.kernel.state import Resolved, Session
from bili_addon.wire.base import TEXT, Body

if TYPE_CHECKING:
    from collections.abc import Collection

    from bili_addon.kernel.cache import Clocks
    from bili_addon.kernel.fold import FoldConfig
    from bili_addon.kernel.nudge import NudgeConfig
    from bili_addon.kernel.registry import Sessions

log = logging.getLogger("bili")


class PressureHost(Protocol):
    """What these decisions need of the engine."""

    activate: str
    fold_cfg: FoldConfig
    nudge_cfg: NudgeConfig
    clocks: Clocks
    sessions: Sessions
    now: Callable[[], float]

    def window_for(self, s: Session) -> int: ...

    def set_flag(self, sid: str, key: str, value: Any) -> bool: ...

    def reported_usage(self, s: Session) -> tuple[int, int, int, int] | None: ...


def is_active(host: PressureHost, s: Session, view: View) -> bool:
    """Whether bili shows itself in this request (tools, prompt, tags); see kernel/activation.py."""
    if host.activate == "always" or s.flags.get(activation.FLAG):
        return True
    why = activation.decide(s, view, host.fold_cfg, host.nudge_cfg, host.window_for(s),
                            lambda: host.clocks.cold(s.row.id, host.now()))
    if why:
        host.set_flag(s.row.id, activation.FLAG, why)
        log.info("[bili] session=%s: active from now on (%s)", printable(s.row.id), why)
    return bool(why)


def apply(host: PressureHost, s: Session, view: View, resolved: list[list[Resolved]], new: bool = False,
          snoozed: Collection[str] = ()) -> None:
    """Nudge and emergency truncation, decided from the usage the last answer reported.  ``new``:
    the store had no row of the session when this turn loaded it, so no answer of it is recorded
    (usage is recorded for a stored session only): nothing to read.  ``snoozed``: the blocks this
    request does not render (kernel/reconcile.py), which the reminder offers nothing of."""
    if not view.items:
        return
    last = None if new else host.reported_usage(s)
    # the size the provider reported for the last request; without one (a Chat stream without
    # include_usage), the conversation's own estimate
    blocks = s.blocks
    cov = fold.coverage(blocks) if blocks else {}  # (read by the reminder and the truncations too)
    known = s.flags.get("truncated", {})
    # the cuts made since the last report (an SDK's retry, an overflow's: no answer came between): the
    # report still counts those outputs whole
    since = s.flags.get("truncated_on") or {}
    if last:
        used = last[0]
        if since.get("report") == list(last):
            pos = view.pos
            used -= sum(t for ref, t in since.get("saved", {}).items() if ref in pos and ref not in cov)
    else:
        if not blocks:  # nothing folded: every part counts
            used = view.sums().tokens[-1]
        else:
            # (the tokens of the parts no block holds)
            used = ((view.unfolded(cov).tokens[-1] if cov else view.sums().tokens[-1])
                    + sum(b.summary_tokens for b in blocks if b.active))
        if known:  # (the outputs cut before go as cut: the estimate counts them so, as a report would)
            pos = view.pos
            used -= sum(p.tokens - len(known[p.ref]) // 4 for it in view.items for p in it.parts
                        if p.ref in known and p.ref in pos and p.ref not in cov)
    window = host.window_for(s)
    flags = s.flags
    at = flags.get("last_nudge_at", 0)
    if used < int(at):
        # a fold (or the host's own compaction) shrank the context: growth counts from here
        host.set_flag(s.row.id, "last_nudge_at", used)
        at = flags.get("last_nudge_at", 0)
    cfg = host.nudge_cfg
    if used < min(cfg.batch_tokens, cfg.distil_tokens, cfg.pressure * window, cfg.truncate_at * window):
        return  # not even the whole context would be worth a fold, and the window is far
    nudges = dict(flags.get("nudges", {}))
    newest = resolved[-1]
    if newest and not (nudges and _given(newest, nudges)):
        if snoozed:  # (a distil over a block this branch does not show would absorb it: its summary never stood)
            shown = [b for b in blocks if b.id not in snoozed]
            text = nudge.decide(view, shown, host.fold_cfg, cfg, used, window, int(at), fold.coverage(shown))
        else:
            text = nudge.decide(view, blocks, host.fold_cfg, cfg, used, window, int(at), cov)
        if text and not asks_for_summary(view):  # (asked only when there is a reminder to give)
            prose = None
            for r in reversed(newest):  # (the last of the user's prose parts, else the last part)
                core = r.core
                if core.role == "user" and core.ctype == TEXT and core.path and core.text.strip():
                    prose = r
                    break
            # (an item of its own after the newest item, unless that is the assistant's: a prefill,
            # which the reminder would join or break; the next user turn has it then)
            if prose is not None or not any(r.core.role == "assistant" for r in newest):
                nudges[(newest[-1] if prose is None else prose).entry.ref] = {
                    "text": text, "how": "item" if prose is None else "suffix"}
                host.sessions.set_flags(s.row.id, {"nudges": nudges, "last_nudge_at": used})  # one write
    cut = nudge.truncations(view, blocks, host.fold_cfg, cfg, used, window, cov, known)
    if cut:
        flags_now: dict = {"truncated": {**cut, **known}}
        if last:
            tokens = {p.ref: p.tokens for it in view.items for p in it.parts if p.ref in cut}
            saved = {ref: tokens[ref] - len(text) // 4 for ref, text in cut.items() if ref in tokens}
            if since.get("report") == list(last):
                saved = {**since.get("saved", {}), **saved}
            flags_now["truncated_on"] = {"report": list(last), "saved": saved}
        host.sessions.set_flags(s.row.id, flags_now)  # (one write)


def reminding(s: Session, resolved: list[list[Resolved]]) -> bool:
    """Whether this request carries a fold reminder (given with its newest item: now, or when the
    same history went before)."""
    nudges = s.flags.get("nudges")
    return bool(nudges and resolved and resolved[-1] and _given(resolved[-1], nudges))


def _given(newest: list[Resolved], nudges: dict) -> bool:
    """Whether a part of the newest item carries a reminder already."""
    for r in newest:
        if r.entry.ref in nudges:
            return True
    return False


def upgrade_lifetime(host: PressureHost, s: Session, body: Body, items: list[bytes], raw: bytes,
                     changed: bool, folding: View | None = None) -> bytes | None:
    """The body to send with the cache lifetimes the session chose (kernel/lifetime.py): 1 hour on
    the stable head, or on every breakpoint; decided (again) at a cold moment only.  ``body`` and
    ``items`` are the request as the engine holds it at the end of a turn (``changed``: it is
    re-encoded; else ``raw`` goes as the agent sent it).  The head's hour is set on those parts, not
    on the finished body parsed again (kernel/lifetime.py ``apply_parts``).  Returns the bytes to
    send; None: the lifetimes change nothing (the turn's own bytes go).  ``folding``: the view, when
    the request carries a fold reminder: the work it asks to fold leaves the wire soon, so the choice
    weighs the later requests on what survives it (a switch to 1 hour would write the range at 2x
    for nothing)."""
    sid = s.row.id
    flag = s.flags.get(lifetime.FLAG) or {}
    chosen = flag.get("choice")
    now = host.now()
    if chosen != lifetime.HOUR and host.clocks.cold(sid, now):  # decided at a cold moment only
        h = host.clocks.history(sid)
        if h and h[0].family == "anthropic":
            gaps = h[1] + [now - host.clocks.last[sid]]  # the pause that made it cold counts too
            headed = lifetime.upgrade_head(body.encode(items) if changed else raw)
            growth = sum(b.summary_tokens for b in s.blocks) / max(1, s.row.requests)
            leaving = _foldable(host, s, folding) if folding is not None else 0
            pick = lifetime.choose(gaps, h[2], h[3], h[0], head=lifetime.head_tokens(headed) if headed else 0,
                                   head_growth=growth, rest=max(rewrite.MIN_REST, s.row.requests), leaving=leaving)
            if pick is not None:
                flag = pick.to_flag()
                chosen = flag["choice"] = lifetime.keep(chosen, pick.choice)
                if chosen != pick.choice:
                    flag["cheapest"] = pick.choice  # kept: a session never goes back to shorter lifetimes
                host.set_flag(sid, lifetime.FLAG, flag)
    if chosen == lifetime.HOUR:  # one pass over the bytes that leave (the agent's own when unchanged)
        sent = body.encode(items) if changed else raw
        return lifetime.upgrade(sent) or (sent if changed else None)
    if chosen != lifetime.HEAD:
        return None
    anything, in_items = lifetime.apply_parts(body.top, body.key, items if body.array else None)
    if not anything:
        return None
    return body.encode(items if changed or in_items else None)


def _foldable(host: PressureHost, s: Session, view: View) -> int:
    """The tokens a reminder asks to fold: the ranges worth a fold (as the reminder counts them)."""
    least = host.fold_cfg.min_compress_chars
    return sum(r[3] for r in nudge.compressible(view, s.blocks, host.fold_cfg) if r[3] * 4 >= least)


__all__ = ["PressureHost", "apply", "is_active", "reminding", "upgrade_lifetime"]
