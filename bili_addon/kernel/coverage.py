"""Fold coverage under churn, turn by turn: the engine's side of :mod:`~bili_addon.kernel.reconcile`.

:func:`check` re-anchors covered refs that went missing from a pass and records the verdict (and
the copy) in the store; :func:`roll_copy` makes a steady pass the canonical copy the next drift is
checked against; :func:`count` keeps the session's drift counters.  The store and the session
registry are passed in; the copy is written through the registry (``Sessions.save_copy``: with the
turn's staged commit when it has one).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bili_addon.kernel import fold, reconcile
from bili_addon.kernel.fold import View
from bili_addon.kernel.state import Resolved, Session, TurnResult

if TYPE_CHECKING:
    from bili_addon.kernel.registry import Sessions
    from bili_addon.store import Store

log = logging.getLogger("bili")


def check(store: Store, sessions: Sessions, s: Session, view: View, resolved: list[list[Resolved]],
          result: TurnResult) -> reconcile.Outcome | None:
    """Re-anchor covered refs that went missing, and classify what cannot be verified."""
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS:
        return None  # side requests (titles, probes) never touch the copy
    sid = s.row.id
    fresh = {r.entry.ref for ps in resolved for r in ps if r.incs > 1}
    out = reconcile.reconcile(view, s.blocks, s.copy, lambda refs: store.originals(sid, refs), fresh)
    if out.claims:
        by_block: dict[str, list[str]] = {}
        owner = fold.coverage(s.blocks)
        for old, new in out.claims.items():
            b = owner[old]
            if b.claimed.get(old) != new:
                b.claimed[old] = new
                by_block.setdefault(b.id, []).append(new)
        sessions.save_blocks(s, [b for b in s.blocks if b.id in by_block])
    was_latched = s.copy.latched
    reconcile.verdict(out, view, s.blocks, s.copy, lambda refs: store.originals(sid, refs))
    if out.drifted:
        how = ", ".join(f"{n} by {k}" for k, n in out.by.items()) or "none"
        msg = (f"[bili] session={sid} fold coverage: {out.missing} covered part(s) missing; re-anchored "
               f"{len(out.claims)} ({how}); {len(out.unmatched)} re-enter unfolded")
        if out.suspects:
            msg += f"; {out.suspects} suspected host-rewritten tool-call id(s), not claimed"
        log.warning("%s; verdict: %s", msg, out.verdict or "none")
        count(sessions, s, out)
    if out.verdict == "collapse" and not was_latched:
        log.error("[bili] session=%s: the re-sent history no longer matches any fold (%d covered parts "
                  "missing, none verifiable); folding is paused and requests pass through unchanged "
                  "until the history aligns again", sid, out.missing)
    if out.verdict == "recovered":
        log.warning("[bili] session=%s: the history aligns with the folds again; folding resumes", sid)
    result.drift = out.verdict
    if out.drifted or was_latched:
        sessions.save_copy(s)  # (with the turn's staged commit: one write)
    return out


def roll_copy(sessions: Sessions, s: Session, view: View, resolved: list[list[Resolved]],
              drift: reconcile.Outcome | None) -> None:
    """A steady (or fully verified) pass becomes the canonical copy the next drift is checked
    against; its ids tell the next pass an echo of folded content from a new instance of it."""
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS or s.copy.latched:
        return
    if drift is not None and drift.unmatched and drift.verdict != "truncated":
        return
    copy = s.copy
    parts = [p for it in view.items for p in it.parts]
    refs = [p.ref for p in parts]
    # fingerprints are per content, so the shared head keeps its own
    same = min(common_prefix(refs, copy.refs), len(copy.fps))
    copy.fps = copy.fps[:same] + [reconcile.fingerprint(p) for p in parts[same:]]
    copy.refs = refs
    copy.items = [k for k, it in enumerate(view.items) for _p in it.parts]
    copy.ids = [r.msg_id for ps in resolved for r in ps]
    sessions.save_copy(s)  # with the turn's staged commit (one write), or at once


def count(sessions: Sessions, s: Session, out: reconcile.Outcome) -> None:
    """The session's running drift counters (the flag ``drift``)."""
    counts = dict(s.flags.get("drift", {}))
    counts["passes"] = counts.get("passes", 0) + 1
    counts["claims"] = counts.get("claims", 0) + len(out.claims)
    for how, n in out.by.items():
        counts[f"by {how}"] = counts.get(f"by {how}", 0) + n
    counts["unmatched"] = counts.get("unmatched", 0) + len(out.unmatched)
    counts["suspects"] = counts.get("suspects", 0) + out.suspects
    if out.verdict:
        counts[out.verdict] = counts.get(out.verdict, 0) + 1
    sessions.set_flag(s.row.id, "drift", counts)


def common_prefix(a: list, b: list) -> int:
    """How many leading elements ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["check", "count", "roll_copy"]
