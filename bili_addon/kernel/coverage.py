"""Fold coverage under churn, turn by turn: the engine's side of :mod:`~bili_addon.kernel.reconcile`.

:func:`check` re-anchors covered refs that went missing from a pass and records the verdict (and
the copy) in the store; :func:`roll_copy` makes a steady pass the canonical copy the next drift is
checked against; :func:`count` keeps the session's drift counters.  The store and the session
registry are passed in; the copy is written through the registry (``Sessions.save_copy``: with the
turn's staged commit when it has one).
"""

from __future__ import annotations

import logging
from itertools import chain, compress, islice
from itertools import count as _naturals
from operator import attrgetter, eq, not_
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
    out = _steady(view, s.blocks, s.copy)
    if out is None:  # a covered part went missing: the channels of kernel/reconcile.py
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


def _steady(view: View, blocks: list[fold.Block], copy: reconcile.Copy) -> reconcile.Outcome | None:
    """:func:`reconcile.reconcile <bili_addon.kernel.reconcile.reconcile>`'s outcome when no covered
    part is missing (the steady turn: nothing to claim), or None when one is.  The view's positions
    hold every ref of the pass (``View.pos``: extended from the previous view's, not a set of the
    pass built again), and what reconcile changes of the copy then (the truncated refs the host
    sends again) is changed the same."""
    present = view.pos
    active = [b for b in blocks if b.active]
    has = present.__contains__
    now_of: dict[str, str] | None = None
    gone: set[str] | None = None
    for b in active:
        if all(map(has, b.covered)):
            continue
        if now_of is None:  # (the ref a covered message has now: reconcile's ``now_of``)
            now_of = {}
            for c in active:
                now_of.update(c.claimed)
            gone = set(copy.truncated)
        get = now_of.get
        for r in b.covered:
            if r not in present and get(r) not in present and r not in gone:
                return None
    if copy.truncated:  # what the host truncated and now sends again is simply present
        copy.truncated = [r for r in copy.truncated if r not in present]
    covered = (len(set(active[0].covered)) if len(active) == 1
               else len(set().union(*(b.covered for b in active))))
    return reconcile.Outcome(covered=covered)


_PARTS = attrgetter("parts")
_MSG_ID = attrgetter("msg_id")


def _ids(view: View, resolved: list[list[Resolved]]) -> list[str]:
    """The pass's ledger ids in order (a new list): the previous view's, extended over the items
    the two passes share (the same lists of parts), are kept with the view for the next one."""
    prev = view._prev
    got = prev.memo.get("ids") if prev is not None else None
    of = list(resolved)
    m = fold._shared(got[0], of) if got is not None else 0
    if m:
        offsets = got[1][:m + 1]
        at = offsets[-1]
        ids = got[2][:at]
    else:
        offsets, ids, at = [0], [], 0
    for parts in islice(of, m, None):
        ids += map(_MSG_ID, parts)
        at += len(parts)
        offsets.append(at)
    view.memo["ids"] = (of, offsets, ids)
    return ids[:]


def roll_copy(sessions: Sessions, s: Session, view: View, resolved: list[list[Resolved]],
              drift: reconcile.Outcome | None) -> None:
    """A steady (or fully verified) pass becomes the canonical copy the next drift is checked
    against; its ids tell the next pass an echo of folded content from a new instance of it."""
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS or s.copy.latched:
        return
    if drift is not None and drift.unmatched and drift.verdict != "truncated":
        return
    copy = s.copy
    if not isinstance(view, View):  # (a view of another kind: from the start)
        parts = [p for it in view.items for p in it.parts]
        refs = [p.ref for p in parts]
        same = min(common_prefix(refs, copy.refs), len(copy.fps))
        copy.fps = copy.fps[:same] + [reconcile.fingerprint(p) for p in parts[same:]]
        copy.refs = refs
        copy.items = [k for k, it in enumerate(view.items) for _p in it.parts]
        copy.ids = [r.msg_id for ps in resolved for r in ps]
        sessions.save_copy(s)
        return
    # the view's refs and their items as the previous view's extended (View.flat), the pass's ids
    # likewise: a follow-up looks at its new parts
    flat = view.flat()
    refs = flat.refs
    # fingerprints are per content, so the shared head keeps its own
    same = min(common_prefix(refs, copy.refs), len(copy.fps))
    fps = copy.fps[:same]
    if same < len(refs):
        k = flat.items[same]  # the item of the first part whose fingerprint is not kept
        parts = islice(chain.from_iterable(map(_PARTS, islice(view._snapshot(), k, None))), same - flat.offsets[k], None)
        fps += map(reconcile.fingerprint, parts)
    copy.fps = fps
    copy.refs = refs[:]  # (copies: the view keeps its own for the next view's)
    copy.items = flat.items[:]
    copy.ids = _ids(view, resolved)
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
    """How many leading elements ``a`` and ``b`` share (compared with ``==``, up to the first that
    differs: one pass in C, read on every turn for the items and the copy's refs)."""
    return next(compress(_naturals(), map(not_, map(eq, a, b))), min(len(a), len(b)))


__all__ = ["check", "count", "roll_copy"]
