"""The agent's own compaction: a new epoch of the same session, recognised from the history's shape.

Agents replace their history on purpose when it grows long (Claude Code's auto-compact and
``/compact``, codex's compact task, pi's and omp's compaction entries, opencode's summary message,
hermes's context compression): the next request carries the agent's summary where the covered
messages were.  To the fold-coverage layer that looks like a total collapse (every covered part
missing, nothing verifiable), which pauses folding until the history aligns again, and it never
does.  A compaction is recognised instead, and only on evidence specific to it:

1. a part carrying one of the agents' own summary markers stands at the head of the history (the
   leading run of non-assistant items, or the first ``HEAD_ITEMS`` items),
2. that marker is new: not the marker of an earlier epoch, and not in the previous steady pass,
3. the previous pass was replaced: at least a quarter of its parts are gone (for a session without
   a stored pass: the marker's ref was minted by this very request).

Churn (re-serialisation), truncation of the oldest slice and a foreign history carry no new marker
at their head, so they keep the verdicts of :mod:`~bili_addon.kernel.reconcile`.

A new epoch keeps the ledger (refs are never reused; messages that survived keep theirs) and
retires the active blocks: they leave the wire but stay decompressible and searchable.  Folding
starts again at once on the new history; reminders count from the new base, and usage reported
for the old history is not taken for the new one's.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from bili_addon import printable
from bili_addon.kernel import tags
from bili_addon.kernel.fold import Block, PartView, View
from bili_addon.kernel.reconcile import Copy
from bili_addon.kernel.state import Session, TurnResult
from bili_addon.wire.base import OTHER, TEXT

if TYPE_CHECKING:
    from bili_addon.kernel.registry import Sessions
    from bili_addon.store import Store

log = logging.getLogger("bili")

HEAD_ITEMS = 8  # the summary stands within the first items (after what the agent keeps of the start) ...
# ... or anywhere in the leading run of non-assistant items (codex keeps the user's turns first, up to
# ~20K tokens of them: a long thread of short prompts put its summary past a cap of 256 items)
MAX_HEAD = 20_000
GONE_SHARE = 0.25  # the share of the previous pass that must have disappeared

# -- the agents' shapes ------------------------------------------------------------------------

CLAUDE_CODE = "This session is being continued from a previous conversation that ran out of context"
CODEX = ("Another language model started to solve this problem and produced a summary of its thinking "
         "process.")
# codex-rs/core/templates/compact/summary_prefix.md, whole (the summary follows after a newline)
CODEX_PREFIX_FULL = (CODEX + " You also have access to the state of the tools that were used by that language "
                     "model. Use this to build on the work that has already been done and avoid duplicating work. "
                     "Here is the summary produced by the other language model, use the information in this "
                     "summary to  assist with your own analysis:")
PI = "The conversation history before this point was compacted into the following summary:"
HERMES = ("[CONTEXT COMPACTION", "[CONTEXT SUMMARY]:")
HERMES_MERGED = "[END OF PRIOR CONTEXT — COMPACTION SUMMARY BELOW]"
OPENCODE = "What did we do so far?"
CODEX_ITEMS = ("compaction", "compaction_summary")  # remote compaction (/responses/compact)


@dataclass(frozen=True)
class Shape:
    """One agent's compaction summary as it appears in a request."""

    agent: str
    lanes: tuple[str, ...]  # the lanes the agent sends it on
    match: Callable[[PartView, int], bool]  # (part, view position) -> is the summary


def _starts(prefixes: str | tuple[str, ...], roles: tuple[str, ...] = ("user",)):
    def match(p: PartView, _k: int) -> bool:
        return p.ctype == TEXT and p.role in roles and p.text[:512].lstrip().startswith(prefixes)
    return match


def _hermes(p: PartView, k: int) -> bool:
    if p.ctype != TEXT or p.role not in ("user", "assistant"):
        return False
    return p.text[:512].lstrip().startswith(HERMES) or HERMES_MERGED in p.text


def _opencode(p: PartView, k: int) -> bool:
    # the compaction request's user turn, kept as the head of the new history: only there
    return k == 0 and p.ctype == TEXT and p.role == "user" and p.text.strip() == OPENCODE


def _codex_item(p: PartView, _k: int) -> bool:
    if p.ctype != OTHER or '"compaction' not in p.text[:400]:
        return False
    try:
        obj = json.loads(p.text)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("type") in CODEX_ITEMS


ALL_LANES = ("anthropic", "chat", "responses", "gemini")
SHAPES = (
    Shape("claude-code", ("anthropic",), _starts(CLAUDE_CODE)),
    Shape("codex", ("responses",), _starts(CODEX)),
    Shape("codex", ("responses",), _codex_item),
    Shape("pi", ALL_LANES, _starts(PI)),  # omp shares pi's compaction
    Shape("hermes", ("anthropic", "chat", "responses"), _hermes),
    Shape("opencode", ALL_LANES, _opencode),
)


# the agents' requests for their own summary: no fold reminder goes into those (a model that folded
# instead of summarising would fail the agent's compaction: Claude Code rejects tool calls there)
SUMMARY_ASKS = (
    "Your task is to create a detailed summary of the",  # Claude Code (/compact and auto-compact)
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",  # Claude Code 2.x, joined to the last user turn
    "CONTEXT CHECKPOINT COMPACTION",  # codex
    "The messages above are a conversation to summarize",  # pi, omp
)


def asks_for_summary(view: View) -> bool:
    """The newest user turn is the agent's request for a summary of the conversation (its compaction)."""
    last = view.last_user()
    if last is None:
        return False
    return any(p.ctype == TEXT and any(a in p.text for a in SUMMARY_ASKS) for p in view.items[last].parts)


@dataclass
class Found:
    agent: str
    marker: str  # the ref of the summary part
    at: int  # its position in the view
    gone: int  # parts of the previous pass that are not in this one
    kept: int  # parts of the previous pass that survived


def marker_in_head(lane: str, view: View) -> tuple[str, PartView, int] | None:
    """The first compaction summary at the head of ``view``: ``(agent, part, position)``.  What it
    found is kept with the view, with how many of its first items it read: the next view of the
    conversation that shares those items (the same objects) finds the same (a follow-up's head is
    the previous request's)."""
    memo = isinstance(view, View)  # (a view of fold.View's kind keeps it)
    items = view._snapshot() if memo else view.items
    prev = view._prev if memo else None
    got = prev.memo.get("head") if prev is not None else None
    if got is not None and got[0] == lane and got[1] and view._shared_with(got[3]) >= got[1]:
        view.memo["head"] = (*got[:3], items)
        if got[2] is None:
            return None
        agent, k, j = got[2]
        return agent, items[k].parts[j], k  # (this view's part: an equal one)
    shapes = [s for s in SHAPES if lane in s.lanes]
    assistant_seen = False
    found, read = None, 0  # (read: the items the answer depends on; 0: all of them, the head goes on)
    for k, it in enumerate(items):
        if k >= MAX_HEAD or (k >= HEAD_ITEMS and assistant_seen):
            read = k
            break
        for j, p in enumerate(it.parts):
            for s in shapes:
                if s.match(p, k):
                    found, read = (s.agent, k, j), k + 1
                    break
            if found is not None:
                break
        if found is not None:
            break
        assistant_seen = assistant_seen or any(p.role == "assistant" for p in it.parts)
    if memo:
        view.memo["head"] = (lane, read, found, items)
    if found is None:
        return None
    agent, k, j = found
    return agent, items[k].parts[j], k


def detect(lane: str, view: View, previous: list[str], known: set[str], minted_from: int) -> Found | None:
    """A compaction, on the evidence above, or None.  ``previous``: the refs of the previous steady
    pass (empty when none is stored); ``known``: markers of earlier epochs; ``minted_from``: the
    first ref index this request minted."""
    hit = marker_in_head(lane, view)
    if hit is None:
        return None
    agent, part, k = hit
    if part.ref in known:
        # opencode's marker is its question, the same words every time ("What did we do so far?"): a
        # second compaction's is known; its summary, the answer right after it, is new
        part = _answer_after(view, k) if agent == "opencode" else None
        if part is None or part.ref in known:
            return None
    if previous:
        if part.ref in previous:
            return None
        kept = sum(1 for r in previous if r in view.pos)
        gone = len(previous) - kept
        if gone < GONE_SHARE * len(previous):
            return None
        return Found(agent, part.ref, k, gone, kept)
    index = tags.index_of(part.ref)
    if index is None or index < minted_from:
        return None
    return Found(agent, part.ref, k, 0, 0)


def _answer_after(view: View, k: int) -> PartView | None:
    """The first prose part of the assistant's item right after item ``k`` (opencode's summary)."""
    items = view.items
    if k + 1 >= len(items):
        return None
    for p in items[k + 1].parts:
        if p.role == "assistant" and p.ctype == TEXT and p.text.strip():
            return p
    return None


# -- epochs of a session -----------------------------------------------------------------------

def epochs(s: Session) -> list[dict]:
    return s.flags.get("epochs", [])


def free_summary(view: View, s: Session) -> None:
    """The current epoch's summary is old prose like any other: when it is the first user turn on
    its own, that turn is not protected from folding.  Sharing its message with anything else (Claude
    Code puts its CLAUDE.md context block first), it stays protected, as the first user turn is."""
    eps = epochs(s)
    if not eps:
        return
    first = view.first_user()
    if first is None:
        return
    marker = eps[-1]["marker"]
    parts = view.items[first].parts
    if any(p.ref == marker for p in parts) and all(p.ref == marker or not p.text.strip() for p in parts):
        view.first_free = True


class EpochHost(Protocol):
    """What :class:`Epochs` needs of the engine it is mixed into (and its own step)."""

    store: Store
    sessions: Sessions

    def _begin_epoch(self, s: Session, found: Found, result: TurnResult) -> None: ...


class Epochs:
    """Mixed into the :class:`Engine`: the hook of a turn, and what a new epoch changes in the
    session.  What it uses of the engine is :class:`EpochHost`."""

    def _compaction(self: EpochHost, s: Session, lane: str, view: View, minted_from: int,
                    result: TurnResult) -> None:
        if s.row.requests > 1:  # a first request has nothing to have compacted
            found = detect(lane, view, s.copy.refs, {e["marker"] for e in epochs(s)}, minted_from)
            if found is not None:
                self._begin_epoch(s, found, result)
        free_summary(view, s)

    def _begin_epoch(self: EpochHost, s: Session, found: Found, result: TurnResult) -> None:
        sid = s.row.id
        retired: list[Block] = [b for b in s.blocks if b.active]
        for b in retired:
            b.active = False
            b.retired = True
        if retired:
            self.sessions.save_blocks(s, retired)
        was_latched = s.copy.latched
        s.copy = Copy()  # the new history is the pass drift is checked against from now on
        self.sessions.save_copy(s)  # (with the turn's staged commit when it has one)
        n = len(epochs(s)) + 2  # the session began in epoch 1
        entry = {
            "epoch": n, "agent": found.agent, "marker": found.marker, "request": s.row.requests,
            "usage_turns": self.store.usage(sid).turns, "retired_blocks": [b.id for b in retired],
            "gone": found.gone, "kept": found.kept, "at": round(time.time(), 3),
        }
        # reminders count from the new base, and the old epoch's go: the new history may keep a message
        # that carried one (codex keeps the user's own messages), which would point at ranges it no longer has
        self.sessions.set_flags(sid, {"epochs": [*epochs(s), entry], "last_nudge_at": 0, "nudges": {}})
        result.epoch = n
        ids = f" ({', '.join(b.id for b in retired)})" if retired else ""
        log.warning(
            "[bili] session=%s: the agent compacted its history (%s summary at %s; %d part(s) of the previous "
            "pass gone, %d kept); epoch %d begins: %d block(s)%s retire from the wire (still decompressible "
            "and searchable), folding goes on", printable(sid), printable(found.agent), printable(found.marker),
            found.gone, found.kept, n,
            len(retired), ids,
        )
        if was_latched:
            log.warning("[bili] session=%s: the pause ends with the new epoch", printable(sid))

    def reported_usage(self: EpochHost, s: Session) -> tuple[int, int, int, int] | None:
        """The last usage the provider reported, unless it was for the history before the current
        epoch (the compaction request itself reports the whole old history)."""
        eps = epochs(s)
        if not eps:
            return self.store.last_usage(s.row.id)
        usage = self.store.usage(s.row.id)  # (the totals and the last usage: one read)
        # (by the last usage's own number: a side request answered since counts in ``turns``, not in ``last``)
        if usage.last is None or usage.last_n <= int(eps[-1].get("usage_turns", 0)):
            return None
        return usage.last


__all__ = ["EpochHost", "Epochs", "Found", "SHAPES", "SUMMARY_ASKS", "Shape", "asks_for_summary", "detect",
           "epochs", "free_summary", "marker_in_head"]
