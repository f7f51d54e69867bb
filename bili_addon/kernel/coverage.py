"""Fold coverage under churn, turn by turn: the engine's side of :mod:`~bili_addon.kernel.reconcile`.

:func:`check` re-anchors covered refs that went missing from a pass and records the verdict (and
the copy) in the store; :func:`roll_copy` makes a steady pass the canonical copy the next drift is
checked against; :func:`count` keeps the session's drift counters.  The store and the session
registry are passed in; the copy is written through the registry (``Sessions.save_copy``: with the
turn's staged commit when it has one).
"""

from __future__ import annotations

import dataclasses
import logging
from itertools import chain, compress, islice, repeat
from itertools import count as _naturals
from operator import attrgetter, eq, not_
from typing import TYPE_CHECKING

from bili_addon import printable
from bili_addon.kernel import fold, reconcile
from bili_addon.kernel.fold import View
from bili_addon.kernel.state import Resolved, Session, TurnResult
from bili_addon.wire.base import TOOL_CALL

if TYPE_CHECKING:
    from bili_addon.kernel.registry import Sessions
    from bili_addon.store import Store

log = logging.getLogger("bili")
# a pause a collapse latched ends after this many passes in a row that still match no fold: the folds the
# history lacks retire and folding starts over on the history as it is (a marathon session must not go
# on unfolded for good because its host rewound past a compaction or rebuilt its history in a way no
# channel verifies; the retired blocks stay decompressible and searchable)
RETIRE_AFTER = 3
# passes a parked conversation (_start_over) is waited for: a subagent's run is shorter; the parked copy is
# written with the session's copy on every turn, so it goes (its blocks stay retired) when none came back
PARKED_PASSES = 128
# passes in a row on a branch the host rewound to, after which the branch is the conversation: what it
# does not hold whole of the first branch's folds is parked with the first branch's copy (back whole, they
# stand again), and the copy is the branch's (every pass on a branch was a reconcile of the whole history,
# with a warning in the log, for as long as the branch lasted)
ADOPT_AFTER = 8


def check(store: Store, sessions: Sessions, s: Session, view: View, resolved: list[list[Resolved]],
          result: TurnResult) -> reconcile.Outcome | None:
    """Re-anchor covered refs that went missing, and classify what cannot be verified."""
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS:
        # side requests (titles, probes) never touch the copy; a block whose range they hold only in part
        # is not rendered for them (a short history rewound into a folded range: its summary tells of
        # turns this branch does not have)
        part = _in_part(view, s.blocks)
        return reconcile.Outcome(snoozed=part) if part else None
    sid = s.row.id
    if s.copy.parked:
        _unpark(sessions, s, view, lambda refs: store.originals(sid, refs), resolved)
    out = _steady(view, s.blocks, s.copy)
    if out is None:  # a covered part went missing: the channels of kernel/reconcile.py
        out = reconcile.reconcile(view, s.blocks, s.copy, lambda refs: store.originals(sid, refs), _fresh(resolved))
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
    if s.copy.truncated:  # (each turn after the truncation too: the blocks it cut not at their start)
        out.snoozed |= reconcile.not_a_tail(s.blocks, view.pos, set(s.copy.truncated))
    if out.drifted:
        how = ", ".join(f"{n} by {k}" for k, n in out.by.items()) or "none"
        msg = (f"[bili] session={printable(sid)} fold coverage: {out.missing} covered part(s) missing; re-anchored "
               f"{len(out.claims)} ({how}); {len(out.unmatched)} re-enter unfolded")
        if out.suspects:
            msg += f"; {out.suspects} suspected host-rewritten tool-call id(s), not claimed"
        log.warning("%s; verdict: %s", msg, out.verdict or "none")
        count(sessions, s, out)
    s.copy.paused = s.copy.paused + 1 if s.copy.latched else 0
    if s.copy.paused >= RETIRE_AFTER:
        if out.verdict == "drift":
            # the conversation is back with a drift of its own that lasts (a covered part edited or
            # cleared before the odd request that latched the pause): its folds held in part, as they
            # did before that request, and hold again; nothing retires
            s.copy.latched, s.copy.paused, s.copy.witness = False, 0, []
            log.warning("[bili] session=%s: the history matches the folds in part again (%d covered part(s) "
                        "missing); folding resumes", printable(sid), out.missing)
        else:
            out = _start_over(sessions, s, view, out.missing)
    s.copy.branched = s.copy.branched + 1 if out.verdict == "rewound" else 0
    if s.copy.branched >= ADOPT_AFTER:
        out = _start_over(sessions, s, view, out.missing, adopt=True)
    if s.copy.truncated and out.verdict in ("restarted", "adopted"):  # (the blocks a truncation cut not at their start)
        out.snoozed |= reconcile.not_a_tail(s.blocks, view.pos, set(s.copy.truncated))
    if out.verdict == "collapse" and not was_latched:
        log.error("[bili] session=%s: the re-sent history no longer matches any fold (%d covered parts "
                  "missing, none verifiable); folding is paused and requests pass through unchanged "
                  "until the history aligns again", printable(sid), out.missing)
    if out.verdict == "recovered":
        log.warning("[bili] session=%s: the history aligns with the folds again; folding resumes", printable(sid))
    if s.copy.branch and out.verdict != "rewound":
        _one_per_message(sessions, s, out.snoozed)  # (back from a branch: what was folded on it over the same messages)
    result.drift = out.verdict
    if out.verdict == "rewound":
        s.copy.branch = [r.msg_id for ps in resolved for r in ps]
    if out.drifted or was_latched:
        sessions.save_copy(s)  # (with the turn's staged commit: one write)
    return out


def _one_per_message(sessions: Sessions, s: Session, snoozed: set[str]) -> None:
    """Back from a branch the host had rewound to: a fold made there over messages of a block the branch
    did not render (fold.compress leaves such a block out) stands beside it now, over the same messages.
    The newer one retires (still decompressible and searchable): one summary per message."""
    seen: set[str] = set()
    over = []
    for b in sorted((b for b in s.blocks if b.active and b.id not in snoozed), key=lambda b: b.number):
        if seen.isdisjoint(b.coverage):  # (its refs and those its verified claims moved them to)
            seen.update(b.coverage)
        else:
            over.append(b)
    if not over:
        return
    for b in over:
        b.active = False
        b.retired = True
    sessions.save_blocks(s, over)
    log.warning("[bili] session=%s: back from a branch, %d block(s) folded there over messages an older block "
                "covers retire (%s)", printable(s.row.id), len(over), ", ".join(b.id for b in over))


def _fresh(resolved: list[list[Resolved]]) -> set[str]:
    """The refs a pass gave new instances of covered words (reconcile's ``fresh``)."""
    return {r.entry.ref for ps in resolved for r in ps if r.incs > 1}


def _with_gone(present: dict[str, int], truncated) -> dict[str, int]:
    """``present`` with the refs a host truncated away counted in (gone, not missing: as a steady pass of
    the copy that holds them as truncated takes them)."""
    return {**present, **dict.fromkeys(truncated, -1)} if truncated else present


def _tally(sessions: Sessions, s: Session, key: str) -> None:
    """One more ``key`` in the session's drift counters (the flag ``drift``: /__bili/stats)."""
    counts = dict(s.flags.get("drift", {}))
    counts[key] = counts.get(key, 0) + 1
    sessions.set_flag(s.row.id, "drift", counts)


def _whole(b: fold.Block, present: dict[str, int]) -> bool:
    """Whether every message ``b`` covers is here (under its own ref, or one a verified claim moved it to)."""
    claimed = b.claimed
    return all(r in present or claimed.get(r) in present for r in b.covered)


def _parked(copy: reconcile.Copy, blocks: list[fold.Block], trial: bool = False) -> dict:
    """What ending a pause (or taking a parked history back) puts aside: ``copy``'s fields and the ids
    of the ``blocks`` it retires (nothing when it retires none: nothing to stand again).  ``trial``:
    the conversation's own blocks, put aside by a pause's end, which may come back as its passes held
    them (:func:`_holds`); blocks another history made, or a branch's adoption parked, come back whole
    only.  An entry a later one replaces is kept beside it (``earlier``, one): two subagents in a row."""
    if not blocks:
        return dict(copy.parked)  # (what was parked before waits on)
    # ("branch": the conversation was on a branch rewound from that copy: back on it, "rewound" is its own)
    out = {"copy": {k: v for k, v in copy.__dict__.items() if k != "parked"}, "blocks": [b.id for b in blocks],
           "branch": trial and bool(copy.branch), "trial": trial}
    # (one entry beside the newest: the oldest, the conversation others' turns interrupted first: subagents
    # in a row each put the one before aside, and the one that comes back is the one they began in)
    newest = {k: v for k, v in copy.parked.items() if k != "earlier"}
    older = copy.parked.get("earlier") or {}
    # (and a conversation's own entry before another history's, which a take-back parked: it came back once)
    keep = newest if newest.get("trial") and not older.get("trial") else older or newest
    if keep:
        out["earlier"] = keep
    return out


def _start_over(sessions: Sessions, s: Session, view: View, missing: int, adopt: bool = False) -> reconcile.Outcome:
    """End a pause that outlasted :data:`RETIRE_AFTER` passes: every active block some of whose
    messages this history lacks retires from the wire (as at the agent's compaction: still
    decompressible and searchable), the blocks it holds whole stay (each of their refs is here: what
    a steady pass verifies), and the canonical copy starts again from this pass.  The copy and the
    blocks it retires are parked: should the conversation they stand for come back whole (a Claude
    Code subagent's turns under its conversation's id latched the pause), :func:`_unpark` puts them
    back.  ``adopt``: a branch the host rewound to lasted :data:`ADOPT_AFTER` passes (no pause)."""
    present = _with_gone(view.pos, s.copy.truncated)
    gone = [b for b in s.blocks if b.active and not _whole(b, present)]
    for b in gone:
        b.active = False
        b.retired = True
    back = _stand_in(s.blocks, gone, present)
    if gone:
        sessions.save_blocks(s, gone + back)
    # (the truncated refs of the blocks that stay are still gone: as the copy had them)
    s.copy = reconcile.Copy(parked=_parked(s.copy, gone, trial=not adopt), truncated=list(s.copy.truncated))
    verdict = "adopted" if adopt else "restarted"
    _tally(sessions, s, verdict)
    if adopt:
        log.warning("[bili] session=%s: the branch the agent went back to lasted %d requests: it is the "
                    "conversation now; %d block(s) of the first branch it does not hold whole are parked (%s; they "
                    "stand again if that branch comes back whole)", printable(s.row.id), ADOPT_AFTER, len(gone),
                    ", ".join(b.id for b in gone) or "none")
    else:
        log.warning("[bili] session=%s: the history matched no fold for %d requests (%d covered part(s) missing); "
                    "%d block(s) retire from the wire (%s; still decompressible and searchable) and folding "
                    "resumes on the history as it is", printable(s.row.id), RETIRE_AFTER, missing, len(gone),
                    ", ".join(b.id for b in gone) or "none")
    kept = [b for b in s.blocks if b.active]
    return reconcile.Outcome(covered=len({r for b in kept for r in b.covered}), verdict=verdict)


def _stand_in(blocks: list[fold.Block], gone: list[fold.Block], present: dict[str, int]) -> list[fold.Block]:
    """The blocks that retiring ``gone`` brings back: those a retired distil absorbed (at any depth)
    that this history holds whole stand again for their messages (a branch rewound into a distil's
    range holds its first blocks whole, and their folds were lost with it).  Changed in place."""
    by_id = {b.id: b for b in blocks}
    todo = [c for b in gone for c in b.consumed]
    out = []
    while todo:
        b = by_id.get(todo.pop())
        if b is None or b.active or b.retired:
            continue
        if _whole(b, present):
            b.active = True
            out.append(b)
        else:
            todo += b.consumed
    return out


def _unpark(sessions: Sessions, s: Session, view: View, originals, resolved: list[list[Resolved]]) -> None:
    """The conversation whose folds were put aside is back when this pass holds them as its own passes
    did: every one whole (what a steady pass verifies), or, for the conversation's own blocks a pause's
    end put aside (``trial``), most of their messages here as a pass that, checked against their copy, is
    no collapse (a drift of its own that lasts: a covered tool result cleared in place), nor a rewind from
    it unless the conversation was on such a branch then.  They stand again, the copy they were checked
    against is the copy again; of the blocks made since, those this pass lacks are put aside in their
    place (the other history's) and those over their messages retire (one summary per message)."""
    parked = s.copy.parked
    for entry, rest in ((parked, parked.get("earlier") or {}),
                        (parked.get("earlier") or {}, {k: v for k, v in parked.items() if k != "earlier"})):
        if entry and _take_back(sessions, s, view, entry, rest, originals, resolved):
            # (and the entry that stays, should this pass hold it too: what it put aside settles now)
            left = s.copy.parked
            if left:
                _take_back(sessions, s, view, left, left.get("earlier") or {}, originals, resolved)
            return
    if not any(b.retired and not b.active and b.id in set(parked.get("blocks") or ()) for b in s.blocks):
        s.copy.parked = dict(parked.get("earlier") or {})  # (they are gone: a compaction, a fork's adoption)
        return
    parked["waited"] = parked.get("waited", 0) + 1
    if parked["waited"] >= PARKED_PASSES:
        s.copy.parked = {}


def _take_back(sessions: Sessions, s: Session, view: View, entry: dict, rest: dict, originals,
               resolved: list[list[Resolved]]) -> bool:
    """:func:`_unpark` of one parked entry (``rest``: what stays parked beside it); whether it was."""
    ids = set(entry.get("blocks") or ())
    back = [b for b in s.blocks if b.id in ids and b.retired and not b.active]
    if not back:
        return False
    present = _with_gone(view.pos, entry.get("copy", {}).get("truncated") or ())  # (as that copy had them)
    whole = all(_whole(b, present) for b in back)
    if not whole and not (entry.get("trial") and _holds(view, s.blocks, back, entry, originals, resolved)):
        return False
    try:
        restored = reconcile.Copy(**entry["copy"])
    except (KeyError, TypeError):
        return False
    by_id = {b.id: b for b in s.blocks}
    # the blocks that stood in for a returning distil (at any depth: _stand_in) are its own again
    absorbed = []
    todo = [c for b in back for c in b.consumed]
    while todo:
        b = by_id.get(todo.pop())
        if b is not None and not b.retired:
            if b.active:
                b.active = False
                absorbed.append(b)
            todo += b.consumed
    theirs = {r for b in back for r in b.coverage}  # (with the refs their claims moved messages to)
    others = [b for b in s.blocks if b.active and b.id not in ids]
    lacking = [b for b in others if not _whole(b, present)]  # the other history's: parked
    over = [b for b in others if b not in lacking and not theirs.isdisjoint(b.coverage)]  # retire for good
    for b in back:
        b.retired = False
        b.active = True
    for b in lacking + over:
        b.active = False
        b.retired = True
    restored.latched, restored.paused, restored.streak, restored.witness = False, 0, 0, []
    left = s.copy
    left.parked = rest
    restored.parked = _parked(left, lacking)
    s.copy = restored
    sessions.save_blocks(s, back + absorbed + lacking + over)
    _tally(sessions, s, "unparked")
    log.warning("[bili] session=%s: the conversation whose folds were put aside is back (%s); %d block(s) stand "
                "again (%s)%s", printable(s.row.id), "whole" if whole else "as its passes held them", len(back),
                ", ".join(b.id for b in back),
                f", {len(lacking) + len(over)} put aside ({', '.join(b.id for b in lacking + over)})"
                if lacking or over else "")
    return True


OPENING_PARTS = 64  # the parts a history's opening stretch is looked for in (_opens_as)


def _opens_as(view: View, refs: list[str]) -> bool:
    """Whether ``view`` opens as the pass ``refs`` did, or as a later point of it (the host cut its oldest
    messages): its parts are that pass's, ref for ref, from its first part through its first tool call
    (a provider's id: the conversation's own work; a shared context block or system prompt is no history)."""
    if not refs:
        return False
    at = None
    k = 0
    for it in view.items:
        for p in it.parts:
            if k >= OPENING_PARTS:
                return False
            if at is None:
                try:
                    at = refs.index(p.ref)
                except ValueError:
                    return False
            if at + k >= len(refs) or refs[at + k] != p.ref:
                return False
            if p.ctype == TOOL_CALL and p.tool_call_id:
                return True
            k += 1
    return False


def _holds(view: View, blocks: list[fold.Block], back: list[fold.Block], parked: dict, originals,
           resolved: list[list[Resolved]]) -> bool:
    """Whether this pass, which holds most of the ``back`` blocks' messages (some, on a branch), is no collapse when
    checked against their copy with them standing (and the blocks made since that it lacks put aside):
    worked out on copies, nothing of the session changed."""
    if not _opens_as(view, parked.get("copy", {}).get("refs") or []):
        return False  # (another history under the conversation's id: a shared opening is no history)
    present = view.pos
    refs = [r for b in back for r in b.covered]
    here = sum(1 for b in back for r in b.covered if r in present or b.claimed.get(r) in present)
    # (most of them; on a branch, which holds the first branch's folds in part, any of them: the verdict decides)
    if not here or (here * 2 < len(refs) and not parked.get("branch", False)):
        return False
    try:
        copy = reconcile.Copy.from_json(reconcile.Copy(**parked["copy"]).to_json())  # (its own lists)
    except (KeyError, TypeError):
        return False
    ids = {b.id for b in back}
    theirs = {r for b in back for r in b.coverage}
    trial = [dataclasses.replace(b, active=True, retired=False, claimed=dict(b.claimed)) if b.id in ids
             else dataclasses.replace(b, active=False) if b.active and (not _whole(b, present)
                                                                       or not theirs.isdisjoint(b.coverage))
             else b for b in blocks]
    if _steady(view, trial, copy) is not None:
        return True
    out = reconcile.reconcile(view, trial, copy, originals, _fresh(resolved))
    reconcile.verdict(out, view, trial, copy, originals)
    return out.verdict != "collapse" and (out.verdict != "rewound" or parked.get("branch", False))


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


def _in_part(view: View, blocks: list[fold.Block]) -> set[str]:
    """The active blocks of which ``view`` holds some covered messages but not all (a message a
    verified claim moved counts under its new ref)."""
    present = view.pos
    out = set()
    for b in blocks:
        if not b.active:
            continue
        here = [r in present or b.claimed.get(r) in present for r in b.covered]
        if any(here) and not all(here):
            out.add(b.id)
    return out


_PARTS = attrgetter("parts")
_REF = attrgetter("ref")
_MSG_ID = attrgetter("msg_id")


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
        copy.branch = []
        sessions.save_copy(s)
        return
    # a follow-up's refs, items and ids are the previous pass's (when the copy holds that pass's
    # lists as this function gave them: they are replaced, never changed in place) over the items
    # the two views share, and its new items'
    items = view._snapshot()
    counts = view.part_counts()
    of = list(resolved)
    old, got = copy.refs, view._prev.memo.get("copy") if view._prev is not None else None
    if got is not None and old is got[0] and copy.items is got[1] and copy.ids is got[2]:
        m, mr = view._shared_with(got[5]), fold._shared(got[3], of)
    else:
        m = mr = 0
    at = counts[m]
    refs, where = (old[:at], copy.items[:at]) if m else ([], [])
    for k in range(m, len(items)):
        parts = items[k].parts
        if parts:
            refs += map(_REF, parts)
            where += repeat(k, len(parts))
    if mr:
        ends = got[4][:mr + 1]
        ids = copy.ids[:ends[-1]]
    else:
        ends, ids = [0], []
    n = ends[-1]
    for parts in islice(of, mr, None):
        ids += map(_MSG_ID, parts)
        n += len(parts)
        ends.append(n)
    # fingerprints are per content, so the shared head keeps its own
    same = min(_common_from(refs, old, at), len(copy.fps))
    fps = copy.fps[:same]
    if same < len(refs):
        k = where[same]  # the item of the first part whose fingerprint is not kept
        fps += map(reconcile.fingerprint, islice(chain.from_iterable(map(_PARTS, islice(items, k, None))),
                                                 same - counts[k], None))
    copy.fps, copy.refs, copy.items, copy.ids = fps, refs, where, ids
    copy.branch = []  # (the pass is the copy's own again)
    view.memo["copy"] = (refs, where, ids, of, ends, items)
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


def _common_from(a: list, b: list, at: int) -> int:
    """:func:`common_prefix` of ``a`` and ``b`` that share their first ``at`` elements."""
    return at + next(compress(_naturals(), map(not_, map(eq, islice(a, at, None), islice(b, at, None)))),
                     min(len(a), len(b)) - at)


def common_prefix(a: list, b: list) -> int:
    """How many leading elements ``a`` and ``b`` share (compared with ``==``, up to the first that
    differs: one pass in C, read on every turn for the items and the copy's refs)."""
    return next(compress(_naturals(), map(not_, map(eq, a, b))), min(len(a), len(b)))


__all__ = ["check", "count", "roll_copy"]
