"""Folding: blocks that stand in for consumed ranges, written by the model itself.

The unit of folding is the wire *item* (a message / input item / content): a block covers the
refs of every part of the items in its range, and an item leaves the wire only when all its refs
are covered and nothing it pairs with stays behind.  Block summaries are rendered as one user
item at the position of the first item they replace, so everything before it keeps its bytes.
"""

from __future__ import annotations

import json
import re
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Collection, Iterable, NamedTuple

import msgspec

from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.kept import Kept
from bili_addon.kernel.prompts import summary_header
from bili_addon.kernel.tags import format_tokens, index_of, ref_of
from bili_addon.wire.base import REASONING, TEXT, TOOL_CALL, TOOL_RESULT

_BLOCK_RE = re.compile(r"^b(\d{1,9})$")
# what an executed compress call shows in place of a summary that stands in the conversation as its
# block (kernel/tools.py): never a summary itself
POINTER_MARK = "[bili:"
POINTER = POINTER_MARK + " this summary stands in the conversation as {id}]"


@dataclass
class FoldConfig:
    min_compress_chars: int = 5000  # a batch folding less than this is refused
    min_summary_chars: int = 50
    max_summary_chars: int = 20000
    # the items holding the newest parts (and the newest user turn) are never folded; parts, not
    # items, so the zone is the same on lanes that batch parts into messages and lanes that do not.
    # Small on purpose: every fold rewrites the cache from its position on (bench_session.py)
    recent_parts: int = 4
    pair_scan: int = 20


@dataclass
class Block:
    id: str
    tier: int
    summary: str
    topic: str
    covered: list[str]  # refs this block hides, in conversation order
    direct: list[str]  # refs it folded itself (not through a consumed block)
    consumed: list[str]  # block ids it absorbed
    start_ref: str
    end_ref: str
    call_id: str = ""
    folded_tokens: int = 0
    active: bool = True
    created: float = field(default_factory=time.time)
    # covered ref -> the ref its message has now, where churn re-minted it and the claim was verified
    claimed: dict[str, str] = field(default_factory=dict)
    retired: bool = False  # its epoch ended (the agent compacted): off the wire, still decompressible

    @property
    def coverage(self) -> list[str]:
        return self.covered + list(self.claimed.values()) if self.claimed else self.covered

    @property
    def number(self) -> int:
        return int(self.id[1:])

    def text(self) -> str:
        first, last = (self.covered[0], self.covered[-1]) if self.covered else (self.start_ref, self.end_ref)
        return summary_header(self.id, first, last, self.topic) + "\n" + self.summary.strip()

    @property
    def summary_tokens(self) -> int:
        return tokens_of(self.summary)


_TOKENS_OF = Kept(1 << 22)  # text -> count_tokens(text): summaries, read on every turn (sized by characters)


def tokens_of(text: str) -> int:
    """``count_tokens(text)``, kept for the texts read turn after turn (summaries and what stands
    for them on the wire: a summary's header is not ASCII, and counting it is a regex pass)."""
    n = _TOKENS_OF.get(text, None)
    if n is None:
        n = count_tokens(text)
        _TOKENS_OF.put(text, n, len(text))
    return n


# one per part per turn: msgspec Structs build ~3x faster than dataclasses
_TOKENS = attrgetter("tokens")
_PARTS = attrgetter("parts")
_UNKNOWN = object()  # (a View's user turns, not looked for yet)


def _user_turn(parts: list[PartView]) -> bool:
    """:attr:`ViewItem.user_turn` of an item's parts (a plain loop: read for many items per turn)."""
    for p in parts:
        if p.role == "user" and p.ctype == TEXT:
            return True
    return False


class PartView(msgspec.Struct, gc=False):
    ref: str
    role: str
    ctype: str
    tool_name: str
    tool_call_id: str
    text: str
    tokens: int


class ViewItem(msgspec.Struct, gc=False):
    """One conversation item as the kernel sees it: its parts' refs and pairing keys.  (Never in
    a reference cycle: its parts are PartViews; untracked by the cyclic collector, it is made
    faster, and the collector never walks a conversation's items.)"""

    index: int  # position in the request's conversation array
    parts: list[PartView]
    sig: str = ""  # canonical signature (snapshot render), computed once per item

    @property
    def refs(self) -> list[str]:
        return [p.ref for p in self.parts]

    @property
    def calls(self) -> set[str]:
        return {p.tool_call_id for p in self.parts if p.ctype == TOOL_CALL and p.tool_call_id}

    @property
    def results(self) -> set[str]:
        return {p.tool_call_id for p in self.parts if p.ctype == TOOL_RESULT and p.tool_call_id}

    @property
    def user_turn(self) -> bool:
        return _user_turn(self.parts)

    @property
    def reasoning_only(self) -> bool:
        return bool(self.parts) and all(p.ctype == REASONING for p in self.parts)

    @property
    def tokens(self) -> int:
        return sum(map(_TOKENS, self.parts))


class Sums(NamedTuple):
    """What the turn's decisions read of a view's token figures (:meth:`View.sums`)."""

    tokens: list[int]  # at ``k``: the tokens of every part of ``items[:k]`` (folded or not); len(items) + 1
    filled: list[int]  # at ``k``: how many of ``items[:k]`` have parts
    peak: int  # the most tokens of one part (0: none)


class Unfolded(NamedTuple):
    """A view's items against a coverage (:meth:`View.unfolded`): the parts no block holds."""

    refs: frozenset[str]  # the coverage's refs
    held: list[int]  # at ``k``: how many of ``items[:k]`` have a part not covered; len(items) + 1
    tokens: list[int]  # at ``k``: the tokens of the parts of ``items[:k]`` not covered; len(items) + 1
    first: list[str | None]  # at ``k``: the first ref of ``items[k]`` not covered (None: none)
    last: list[str | None]  # ... and its last
    of: list[ViewItem]  # the items they were computed from

    def first_held(self, begin: int) -> int:
        """The first item from ``begin`` on with a part not covered (there must be one)."""
        return bisect_right(self.held, self.held[begin], begin) - 1

    def last_held(self, end: int) -> int:
        """The last item before ``end`` with a part not covered (there must be one)."""
        return bisect_left(self.held, self.held[end], 0, end) - 1


def _shared(a: list, b: list) -> int:
    """How many of the first items of ``a`` and ``b`` are equal: mostly the same objects (compared
    by address, not read), else items made again of the same parts (a follow-up's figures depend
    on its items' values only).  Lists compared in C: the whole head at once, and where it differs,
    halves of it until the first item that differs."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class View:
    def __init__(self, items: list[ViewItem], sums: Sums | None = None, prev: View | None = None):
        """``sums``: :meth:`sums`, when the caller has them (a conversation's first pass).  ``prev``:
        the view of the same conversation's previous request (its session's ``last_view``): this
        view's figures and plan extend that one's over the items the two share (the same objects),
        the turn costs its new items; anything else is computed from the start."""
        self.items = items
        self.first_free = False  # the first user turn is the agent's compaction summary: foldable
        # what the turn's decisions read of the view, computed once and only when read (the view's
        # items never change once it is made): the refs' positions, the first and last user turns,
        # the token figures
        self._pos: dict[str, int] | None = None
        self._first_user = self._last_user = _UNKNOWN
        self._sums = sums
        self._peaks: list[int] | None = None  # (with the sums: the most tokens of one part of ``items[:k]``)
        # what those figures were computed from (the items then), and the previous view (``prev``),
        # whose figures a follow-up's extend over the items the two share (the same objects), not
        # computed again for the whole conversation
        self._pos_of: list[ViewItem] | None = None
        self._sums_of: list[ViewItem] | None = None
        self._of: list[ViewItem] | None = None  # (one copy of the items for all of them: _snapshot)
        self._m: tuple[list, list, int] | None = None  # (the last _shared_with: what, with which, how many)
        self._unfolded: Unfolded | None = None
        self._plans: list[_PlanMemo] = []  # (the plans made of it, newest first: plan)
        self._parts: list[int] | None = None  # (with the sums: how many parts ``items[:k]`` have)
        self._user_of: list[ViewItem] | None = None  # (what last_user was found in)
        # what other modules keep of this view for the next one (compaction's head, the copy's ids)
        self.memo: dict[str, Any] = {}
        self._prev = prev
        if prev is not None:
            prev._prev = None  # (never a chain of views: only the last one is kept)

    @property
    def pos(self) -> dict[str, int]:
        """Each ref's position in ``items`` (its first)."""
        if self._pos is None:
            items = self._snapshot()
            prev = self._prev
            m = self._shared_with(prev._pos_of) if prev is not None and prev._pos_of is not None else 0
            if m:
                # the previous view's positions, less the refs first seen after the shared items
                # (they were added last: what stays is in the order a pass from the start gives)
                pos = prev._pos.copy()
                for it in prev._pos_of[m:]:
                    for p in it.parts:
                        if pos.get(p.ref, -1) >= m:
                            del pos[p.ref]
            else:
                pos = {}
            setdefault = pos.setdefault
            for k in range(m, len(items)):
                for p in items[k].parts:
                    setdefault(p.ref, k)
            self._pos_of = items
            self._pos = pos
        return self._pos

    def _snapshot(self) -> list[ViewItem]:
        """The items as the figures are computed from them: one copy, made again only when the
        items were changed since."""
        of, items = self._of, self.items
        if of is None or len(of) != len(items) or of != items:  # (the same objects: compared by identity)
            of = self._of = list(items)
        return of

    def _shared_with(self, of: list[ViewItem]) -> int:
        """How many of this view's first items are ``of``'s (asked once per copy)."""
        mine = self._snapshot()
        got = self._m
        if got is not None and got[0] is of and got[1] is mine:
            return got[2]
        m = _shared(of, mine)
        self._m = (of, mine, m)
        return m

    def first_user(self) -> int | None:
        if self._first_user is _UNKNOWN:
            found = None
            for k, it in enumerate(self.items):  # (a loop, not next() over a generator: mostly the first item)
                if _user_turn(it.parts):
                    found = k
                    break
            self._first_user = found
        return self._first_user

    def last_user(self) -> int | None:
        """The newest user turn.  A follow-up looks at its new items only when the previous view's
        is among the items the two share (agents' turns are mostly tool results: the newest user
        turn lies far back, and the same one turn after turn)."""
        if self._last_user is _UNKNOWN:
            items = self._snapshot()
            lo, found = 0, None
            prev = self._prev
            if prev is not None and prev._user_of is not None:
                m = self._shared_with(prev._user_of)
                last = prev._last_user
                if m and (last is None or last < m):  # (None: no user turn in any of its items)
                    lo, found = m, last
            for k in range(len(items) - 1, lo - 1, -1):  # (_user_turn, inlined: read item after item)
                for p in items[k].parts:
                    if p.role == "user" and p.ctype == TEXT:
                        found = k
                        break
                else:
                    continue
                break
            self._last_user = found
            self._user_of = items
        return self._last_user

    def sums(self) -> Sums:
        if self._sums is None:
            items = self._snapshot()
            prev = self._prev
            m = (self._shared_with(prev._sums_of) if prev is not None and prev._sums_of is not None
                 and prev._peaks is not None else 0)
            if m:  # the previous view's figures over the items the two share
                tokens, filled, peaks = prev._sums.tokens[:m + 1], prev._sums.filled[:m + 1], prev._peaks[:m + 1]
                counts = prev._parts[:m + 1]
                total, count, peak, many = tokens[-1], filled[-1], peaks[-1], counts[-1]
            else:
                tokens, filled, peaks, counts = [0], [0], [0], [0]
                total = count = peak = many = 0
            for k in range(m, len(items)):
                parts = items[k].parts
                if parts:
                    count += 1
                    many += len(parts)
                    for p in parts:
                        n = p.tokens
                        total += n
                        if n > peak:
                            peak = n
                tokens.append(total)
                filled.append(count)
                peaks.append(peak)
                counts.append(many)
            self._sums = Sums(tokens, filled, peak)
            self._peaks = peaks
            self._parts = counts
            self._sums_of = items
        return self._sums

    def part_counts(self) -> list[int]:
        """At ``k``: how many parts ``items[:k]`` have (with the sums: a follow-up's extend the
        previous view's); len(items) + 1."""
        self.sums()
        items = self._snapshot()
        if self._parts is None or self._sums_of is not items:  # (sums given by the caller)
            counts, n = [0], 0
            for it in items:
                n += len(it.parts)
                counts.append(n)
            return counts
        return self._parts

    def part_count(self) -> int:
        """How many parts the items have."""
        self.sums()
        items = self._snapshot()
        if self._parts is None or self._sums_of is not items:  # (sums given by the caller)
            return sum(map(len, map(_PARTS, items)))
        return self._parts[-1]

    def unfolded(self, cov: dict[str, Any]) -> Unfolded:
        """The items against the coverage ``cov`` (ref -> block): what of them no block holds, as
        running figures (:class:`Unfolded`).  Kept for the coverage it was last asked for; a follow-up
        extends the previous view's over the items they share, when the coverage is the same."""
        u = self._unfolded
        if u is not None and u.refs == cov.keys():
            return u
        items = self._snapshot()
        prev = self._prev
        pu = prev._unfolded if prev is not None else None
        if pu is not None and pu.refs == cov.keys():  # (the same refs: the previous view's set of them)
            refs = pu.refs
            m = self._shared_with(pu.of)
        else:
            refs = frozenset(cov)
            m = 0
        if m:
            held, tokens, first, last = pu.held[:m + 1], pu.tokens[:m + 1], pu.first[:m], pu.last[:m]
            count, total = held[-1], tokens[-1]
        else:
            held, tokens, first, last = [0], [0], [], []
            count = total = 0
        for k in range(m, len(items)):
            a = b = None
            for p in items[k].parts:
                r = p.ref
                if r not in refs:
                    if a is None:
                        a = r
                    b = r
                    total += p.tokens
            if a is not None:
                count += 1
            held.append(count)
            tokens.append(total)
            first.append(a)
            last.append(b)
        u = self._unfolded = Unfolded(refs, held, tokens, first, last, items)
        return u

    def protected(self, cfg: FoldConfig) -> set[int]:
        """Positions never folded: the first user turn, the recent zone and the newest user turn."""
        return set(self.protected_order(cfg))

    def protected_order(self, cfg: FoldConfig) -> list[int]:
        """:meth:`protected`, ascending (the reminder's runs stop at them: no set made and sorted).
        The recent zone is the newest items back to the one that brings their parts to
        ``cfg.recent_parts``; before it, the first user turn (unless it is the agent's summary:
        ``first_free``) and the newest user turn, each when it lies before that zone."""
        items = self.items
        n = k = len(items)
        parts, least = 0, cfg.recent_parts
        while k and parts < least:
            k -= 1
            parts += len(items[k].parts)
        first = None if self.first_free else self.first_user()
        last = self.last_user()
        out = [first] if first is not None and first < k else []
        if last is not None and last < k and last != first:  # (the newest user turn is never before the first)
            out.append(last)
        out += range(k, n)
        return out


# the last few coverages made: (the blocks (the same objects), their active flags, each active one's
# coverage, the coverage); a turn asks for its session's several times (the engine, the plan, the
# reminder)
_COVERAGES: list[tuple[list[Block], list[bool], list[list[str] | None], dict[str, Block]]] = []
_COVERAGES_MAX = 4


def coverage(blocks: Iterable[Block]) -> dict[str, Block]:
    """Each ref an active block holds -> the first such block.  (The same dict again while the
    blocks, their active flags and their coverage are the same: callers only read it; one that
    adds to it works on a copy, or every later turn's plan sees its additions.)"""
    blocks = list(blocks)
    n = len(blocks)
    for i, (bs, actives, covs, out) in enumerate(_COVERAGES):
        if len(bs) != n:
            continue
        for b, was, active, cov in zip(blocks, bs, actives, covs):
            if b is not was or b.active != active or (cov is not None and b.coverage != cov):
                break
        else:
            if i:
                _COVERAGES.insert(0, _COVERAGES.pop(i))
            return out
    out = _coverage(blocks)
    _COVERAGES.insert(0, (blocks, [b.active for b in blocks], [list(b.coverage) if b.active else None for b in blocks],
                          out))
    del _COVERAGES[_COVERAGES_MAX:]
    return out


def _coverage(blocks: list[Block]) -> dict[str, Block]:
    out: dict[str, Block] | None = None
    for b in blocks:
        if b.active:
            if out is None:
                out = dict.fromkeys(b.coverage, b)  # (the first: all of its refs)
            else:
                setdefault = out.setdefault
                for r in b.coverage:
                    setdefault(r, b)
    return {} if out is None else out


def anchors(view: View, blocks: Iterable[Block]) -> dict[int, Block]:
    """View position -> the active block whose summary stands there (its first covered item)."""
    out: dict[int, Block] = {}
    pos = view.pos
    for b in blocks:
        if b.active:
            where = [pos[r] for r in b.coverage if r in pos]
            if where:
                out.setdefault(min(where), b)
    return out


# -- rendering ---------------------------------------------------------------------------------


@dataclass
class Plan:
    drop: set[int]  # view positions that leave the wire
    inserts: dict[int, list[Block]]  # view position -> blocks whose summary goes before it
    rendered: list[Block]
    runs: dict[int, int] | None = None  # ``drop`` in runs, when known (:func:`_runs`; read only)


class _PlanMemo(NamedTuple):
    """A plan's inputs and what it found, for the next view of the conversation (:func:`plan`)."""

    cov: dict[str, Block]  # the coverage (its refs)
    hidden: frozenset[str]
    first: int | None  # the first user turn (never dropped)
    shape: list[tuple[str, list[str]]]  # the blocks that can stand, in order: id and coverage
    drop: frozenset[int]
    firsts: dict[int, int]  # a block's index in ``shape`` -> where its summary stands
    ids: frozenset[str]  # the tool-call ids of the items every part of which is covered (or hidden)
    last: int  # the last of those items (-1: none)
    of: list[ViewItem]  # the view's items
    runs: dict[int, int]  # ``drop`` in runs (:func:`_runs`)
    kept: frozenset[int] = frozenset()  # covered items kept on the wire because they were protected
    counted: bool = False  # ``ids`` holds keys of calls without ids (pair_keys): paired by their order


def plan(view: View, blocks: list[Block], hidden: set[str] = frozenset(), snoozed: set[str] = frozenset(),
         protected: Collection[int] = ()) -> Plan:
    """``hidden``: refs that leave the wire without a summary (consumed compress calls);
    ``snoozed``: blocks whose whole range the host truncated away (not rendered, kept);
    ``protected``: positions a fold never takes (:meth:`View.protected`: the recent zone and the
    newest user turn): an item there whose refs a block covers stays on the wire.  compress never
    folds them, so a covered ref there is not the message the block was made of: the user said the
    same words again after the host dropped or rewound the copy that was folded (the ledger's
    instance numbers follow the request), and the summary would stand in place of the user's newest
    message.  Keeping it costs its tokens at worst.

    A follow-up's plan is the previous view's when nothing the turn added can change it (the
    same blocks and coverage, no new item covered, none pairing with a covered one, no
    reasoning run across the end of what the two views share): the turn costs its new items."""
    # (a snoozed block holds nothing here: what it covers that is on the wire stays there, never
    # dropped with no summary standing for it)
    cov = coverage([b for b in blocks if b.id not in snoozed] if snoozed else blocks)
    live = sorted((b for b in blocks if b.active and b.id not in snoozed), key=lambda b: b.number)
    first = None if view.first_free else view.first_user()
    shape = [(b.id, b.coverage) for b in live]
    hidden = frozenset(hidden)
    protected = frozenset(protected)
    memo = _plan_again(view, cov, hidden, first, shape, protected)
    if memo is None:
        drop, firsts, ids, last, kept = _plan(view._snapshot(), cov, hidden, first, live, protected)
        memo = _PlanMemo(cov, hidden, first, [(bid, list(refs)) for bid, refs in shape], frozenset(drop), firsts,
                         ids, last, view._snapshot(), _runs(drop), frozenset(kept), any(k[:1] == "\0" for k in ids))
    else:
        memo = _PlanMemo(cov, *memo[1:8], view._snapshot(), memo.runs, memo.kept, memo.counted)
    view._plans = [memo, *view._plans[:2]]
    inserts: dict[int, list[Block]] = {}
    rendered: list[Block] = []
    for i, b in enumerate(live):
        # a block none of whose parts is on the wire is not rendered: whether the host dropped
        # them or this is not the conversation it was made in cannot be told apart from here,
        # and a summary in the wrong conversation is the one failure that must never happen
        if i in memo.firsts:
            inserts.setdefault(memo.firsts[i], []).append(b)
            rendered.append(b)
    return Plan(set(memo.drop), inserts, rendered, memo.runs)


def _runs(drop: Iterable[int]) -> dict[int, int]:
    """The dropped positions in runs: the first of each -> one past its run's last."""
    runs: dict[int, int] = {}
    head = prev = -2
    for k in sorted(drop):
        if k != prev + 1:
            head = k
        runs[head] = k + 1
        prev = k
    return runs


def _plan_again(view: View, cov: dict[str, Block], hidden: frozenset[str], first: int | None,
                shape: list, protected: frozenset[int] = frozenset()) -> _PlanMemo | None:
    """The previous view's plan, when it is this one's too (else None)."""
    prev = view._prev
    if prev is None:
        return None
    for memo in prev._plans:
        if (memo.first == first and memo.hidden == hidden and memo.shape == shape
                and (memo.cov is cov or memo.cov.keys() == cov.keys())):
            break
    else:
        return None
    if memo.kept and not memo.kept <= protected:
        return None  # an item kept only for being protected then is not now
    if protected and not protected.isdisjoint(memo.drop):
        return None  # (a shorter conversation: its protected items among those that left)
    items = view._snapshot()
    m = view._shared_with(memo.of)
    if (first is not None and first >= m) or memo.last >= m:
        return None  # the first user turn, or an item that could leave, not among the shared items
    if m and items[m - 1].reasoning_only:
        return None  # a reasoning run shares the fate of the item after it
    ids, counted = memo.ids, memo.counted  # (counted: calls without ids that could leave, paired by their order)
    for it in (*memo.of[m:], *items[m:]):  # the items after the shared ones, in either view
        parts = it.parts
        if not parts:
            continue
        whole = True
        for p in parts:
            r = p.ref
            if r not in cov and r not in hidden:
                whole = False
            cid = p.tool_call_id
            if (p.ctype == TOOL_CALL or p.ctype == TOOL_RESULT) and (counted or (cid and cid in ids)):
                return None  # it pairs with an item that could leave
        if whole:
            return None  # it could leave itself
    return memo


def _plan(items: list[ViewItem], cov: dict[str, Block], hidden: frozenset[str], first: int | None,
          live: list[Block], protected: frozenset[int] = frozenset()
          ) -> tuple[set[int], dict[int, int], frozenset[str], int, set[int]]:
    """The items that leave, where each block of ``live`` stands (its index -> the position), the
    tool-call ids and the last of the items that could leave, and the covered items kept because
    they are protected (:func:`plan`)."""
    n = len(items)
    keys = pair_keys(items)  # (calls without ids: what pairs them with their results)
    # one pass over the items: those every part of which is covered (or hidden), the tool-call ids
    # of the items holding any, and the runs of reasoning-only items (each shares the fate of the
    # turn it precedes: the run and the item after it form a group)
    drop: set[int] = set()
    tooled: list[int] = []  # the items with a call or a result (with an id)
    groups: list[range] = []
    run = -1  # where the current run of reasoning-only items began
    for k in range(n):
        parts = items[k].parts
        if not parts:
            if run >= 0:
                groups.append(range(run, min(k + 1, n)))
                run = -1
            continue
        whole = reasoning = True
        tool = False
        for p in parts:
            if whole:
                r = p.ref
                if r not in cov and r not in hidden:
                    whole = False
            ct = p.ctype
            if ct != REASONING:
                reasoning = False
                if (ct == TOOL_CALL or ct == TOOL_RESULT) and (p.tool_call_id or keys is not None):
                    tool = True
        if whole:
            drop.add(k)
        if tool:
            tooled.append(k)
        if reasoning:
            if run < 0:
                run = k
        elif run >= 0:
            groups.append(range(run, k + 1))
            run = -1
    if run >= 0:
        groups.append(range(run, n))
    if first is not None:
        drop.discard(first)
    kept: set[int] = set()
    for k in protected.intersection(drop):  # (a spent call there still leaves: it is hidden, not covered)
        if any(p.ref in cov for p in items[k].parts):
            drop.discard(k)
            kept.add(k)
    last = max(drop, default=-1)
    ids = frozenset(key for k in drop.intersection(tooled) for key in _tool_keys(items, k, keys))
    # never leave a tool call without its result (or the reverse), nor reasoning without its turn
    changed = bool(drop)
    while changed:
        changed = False
        kept_calls: set[str] = set()
        kept_results: set[str] = set()
        for k in tooled:
            if k not in drop:
                for j, p in enumerate(items[k].parts):
                    cid = (keys.get((k, j)) if keys is not None else None) or p.tool_call_id
                    if cid:
                        ct = p.ctype
                        if ct == TOOL_CALL:
                            kept_calls.add(cid)
                        elif ct == TOOL_RESULT:
                            kept_results.add(cid)
        if kept_calls or kept_results:
            for k in sorted(drop.intersection(tooled)):
                for j, p in enumerate(items[k].parts):
                    cid = (keys.get((k, j)) if keys is not None else None) or p.tool_call_id
                    if cid and ((p.ctype == TOOL_CALL and cid in kept_results)
                                or (p.ctype == TOOL_RESULT and cid in kept_calls)):
                        drop.discard(k)
                        changed = True
                        break
        for group in groups:
            if any(x in drop for x in group) and any(x not in drop for x in group):
                drop.difference_update(group)
                changed = True
    # each block's summary stands at the first dropped item holding one of its refs (the dropped
    # items in order, until each block has found its first: mostly the first of its range)
    firsts: dict[int, int] = {}
    if live and drop:
        sets = [set(b.coverage) for b in live] if len(live) <= 8 else None
        holders: dict[str, list[int]] = {}
        if sets is None:
            for i, b in enumerate(live):
                for r in b.coverage:
                    holders.setdefault(r, []).append(i)
        for k in sorted(drop):
            for p in items[k].parts:
                r = p.ref
                if sets is not None:
                    for i, refs in enumerate(sets):
                        if r in refs and i not in firsts:
                            firsts[i] = k
                else:
                    for i in holders.get(r, ()):
                        if i not in firsts:
                            firsts[i] = k
            if len(firsts) == len(live):
                break
    return drop, firsts, ids, last, kept


# -- compress ----------------------------------------------------------------------------------


@dataclass
class Range:
    start: str
    end: str
    summary: str
    topic: str = ""


def parse_ranges(args: Any) -> list[Range]:
    """Lenient: ``content`` as a list (or JSON string) of ranges, or one flat range."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return []
    if not isinstance(args, dict):
        return []
    content = args.get("content")
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            content = None
    entries = content if isinstance(content, list) else [args]
    out = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        start = e.get("startId") or e.get("startRef") or e.get("messageId")
        end = e.get("endId") or e.get("endRef") or e.get("messageId")
        summary = e.get("summary")
        if isinstance(start, str) and isinstance(end, str) and isinstance(summary, str):
            topic = e.get("topic") if isinstance(e.get("topic"), str) else args.get("topic")
            out.append(Range(start.strip(), end.strip(), summary, topic if isinstance(topic, str) else ""))
    return out


class CompressError(ValueError):
    pass


@dataclass
class CompressOutcome:
    text: str
    blocks: list[Block]  # new blocks
    deactivated: list[Block]  # blocks consumed by the new ones
    originals: list[PartView]  # parts newly folded, to keep for decompress and search


def _norm_ref(s: str) -> str | None:
    i = index_of(s)
    return ref_of(i) if i is not None else None


def _block_id(s: str) -> str | None:
    m = _BLOCK_RE.match(s.strip().lower())
    return f"b{int(m.group(1))}" if m and int(m.group(1)) >= 1 else None


def _in_order(direct: list[str], absorbed: list[Block], order: dict[str, int],
              claimed: dict[str, str]) -> list[str]:
    """A new block's covered refs in conversation order: those the request holds (an absorbed block's
    under the ref a verified claim moved them to) where it holds them, and each one it does not hold
    (the host truncated it away, or a rewind left it) just before the next of its own block's refs the
    request holds, in its block's order (after its block's last one held, where none follows).  Sorted
    after everything instead, the oldest slice a truncation took ended the list, and the block was
    taken for one that is not a tail of its range (reconcile.not_a_tail): never rendered again."""
    key: dict[str, tuple] = {r: (order.get(r, 1 << 30), 1, 0) for r in direct}
    for b in absorbed:
        refs = b.covered
        after = 1 << 30
        for i in range(len(refs) - 1, -1, -1):
            r = refs[i]
            at = order.get(claimed.get(r, r))
            if at is not None:
                after = at
                key.setdefault(r, (at, 1, 0))
            else:
                key.setdefault(r, (after, 0, i))
    if any(k[0] == 1 << 30 for k in key.values()):  # none held after them: after the block's last one held
        for b in absorbed:
            last = -1
            for i, r in enumerate(b.covered):
                at = order.get(claimed.get(r, r))
                if at is not None:
                    last = at
                elif key[r][0] == 1 << 30 and last >= 0:
                    key[r] = (last, 2, i)
    return sorted(key, key=lambda r: (*key[r], r))


def compress(args: Any, view: View, blocks: list[Block], cfg: FoldConfig, call_id: str = "",
             snoozed: frozenset[str] = frozenset()) -> CompressOutcome:
    ranges = parse_ranges(args)
    if not ranges:
        return CompressOutcome(
            'Nothing compressed: expected {"content": [{"startId": "m00012", "endId": "m00040", "summary": "..."}]}.',
            [], [], [],
        )
    by_id = {b.id: b for b in blocks}
    protected = view.protected(cfg)
    lines: list[str] = []
    made: list[Block] = []
    gone: list[Block] = []
    originals: list[PartView] = []
    taken: set[int] = set()
    next_no = max((b.number for b in blocks), default=0) + 1
    for r in ranges:
        label = f"{r.start}–{r.end}"
        try:
            s, e, block_bounded = _resolve(r, view, by_id)
            s, e = _pair_closure(view, s, e, cfg.pair_scan)
            positions = [k for k in range(s, e + 1) if k not in protected]
            skipped = (e - s + 1) - len(positions)
            if set(positions) & taken:
                raise CompressError("overlaps an earlier range of this call; keep ranges disjoint")
            if not positions:
                raise CompressError("it lies entirely in the protected zone (the first request, the newest "
                                    f"{cfg.recent_parts} message parts and the newest user turn); choose older messages")
            # (a block not rendered on this request, kernel/reconcile.py: its messages here were shown
            # as they are, and a range over them folds them; taking the block in would carry its
            # messages this history does not have, and the new block would never stand again)
            live = [b for b in blocks if b.active and b not in gone and b.id not in snoozed]
            cov = coverage(live)
            # the blocks whose summary stands inside the range; a block that only reaches into it
            # (its summary stands earlier) keeps its messages, and they are not folded again
            nested = [b for k, b in sorted(anchors(view, live).items()) if s <= k <= e]
            if block_bounded and nested:
                # distilling: every summary standing in the range goes into the new one (bN..bM
                # replaces everything from bN to bM), a tier above the highest it absorbs
                tier = min(3, max(b.tier for b in nested) + 1)
                absorbed = nested
            else:
                tier = 1
                absorbed = [b for b in nested if b.tier == 1]
            _whole(view, absorbed, s, e)
            parts = [p for k in positions for p in view.items[k].parts]
            direct = [p for p in parts if p.ref not in cov]
            if not direct and not absorbed:
                raise CompressError("everything in it is already folded")
            if not direct and not block_bounded:
                ids = ", ".join(b.id for b in absorbed)
                raise CompressError(f"it holds nothing new: it is all inside {ids}; to distil those, use the "
                                    f"block ids as startId/endId")
            chars = sum(len(p.text) for p in direct)
            if not block_bounded and chars < cfg.min_compress_chars:
                raise CompressError(f"too small to be worth a fold ({chars} characters, minimum "
                                    f"{cfg.min_compress_chars}); include more consumed messages")
            summary = r.summary.strip()
            if not summary:
                raise CompressError("the summary is empty")
            if summary.startswith(POINTER_MARK):
                raise CompressError("its summary is bili's pointer to an earlier one; write what this range holds")
            if len(summary) < cfg.min_summary_chars:
                raise CompressError(f"the summary is too short ({len(summary)} characters, minimum "
                                    f"{cfg.min_summary_chars}); it must stand in for the range on its own")
            if len(summary) > cfg.max_summary_chars:
                raise CompressError(f"the summary is too long ({len(summary)} characters, maximum "
                                    f"{cfg.max_summary_chars}); keep paths, decisions, errors and values, drop noise")
            order = {ref: i for i, ref in enumerate(view.pos)}
            # an absorbed block's refs as it holds them: its messages' own refs, with the refs churn
            # re-minted them to (its claims, verified) carried over, not taken for refs of its own
            # (the new block would then miss every original ref on every turn: drift, then a collapse)
            claimed = {old: new for b in absorbed for old, new in b.claimed.items()}
            covered = _in_order([p.ref for p in direct], absorbed, order, claimed)
            folded = sum(p.tokens for p in direct) + sum(b.summary_tokens for b in absorbed)
            block = Block(
                id=f"b{next_no}", tier=tier, summary=r.summary, topic=r.topic, covered=covered,
                direct=[p.ref for p in direct], consumed=[b.id for b in absorbed],
                start_ref=r.start, end_ref=r.end, call_id=call_id, folded_tokens=folded, claimed=claimed,
            )
            next_no += 1
            for b in absorbed:
                b.active = False
                gone.append(b)
            made.append(block)
            originals.extend(direct)
            taken.update(range(s, e + 1))
            span = f"{covered[0]}–{covered[-1]}"
            note = f" ({skipped} protected message(s) left out)" if skipped else ""
            absorbed_note = f", absorbing {', '.join(b.id for b in absorbed)}" if absorbed else ""
            lines.append(f"Compressed {span} → {block.id} (tier {tier}{absorbed_note}): ~{format_tokens(folded)} "
                         f"tokens folded into ~{format_tokens(block.summary_tokens)}{note}.")
        except CompressError as err:
            lines.append(f"Range {label} not compressed: {err}.")
    if made:
        ids = ", ".join(b.id for b in made)
        lines.append(f"The summaries stand in place of the originals; decompress {ids} shows them.")
    return CompressOutcome("\n".join(lines), made, gone, originals)


def _whole(view: View, absorbed: list[Block], s: int, e: int) -> None:
    """A block the range takes in must lie in it whole: a held block's messages are still on the wire
    (kernel/pending.py), tagged, so a range may end inside one, and taking the block in would put
    the new summary in place of messages past the range's end."""
    if not absorbed:
        return
    for b in absorbed:
        shown = [view.pos[ref] for ref in b.coverage if ref in view.pos]
        if shown and (min(shown) < s or max(shown) > e):
            raise CompressError(f"it takes in part of {b.id} ({b.covered[0]}–{b.covered[-1]}, folded already): "
                                f"end it at {b.covered[-1]} or later, or before {b.covered[0]}")


def _resolve(r: Range, view: View, by_id: dict[str, Block]) -> tuple[int, int, bool]:
    ends = []
    block_bounded = False
    for label, raw in (("startId", r.start), ("endId", r.end)):
        ref, bid = _norm_ref(raw), _block_id(raw)
        if ref is not None:
            if ref not in view.pos:
                raise CompressError(f'{label}="{raw}" is not in the visible conversation; use refs shown in the '
                                    f"tags, or run acp_status")
            ends.append((view.pos[ref], view.pos[ref]))
        elif bid is not None:
            b = by_id.get(bid)
            if b is None:
                raise CompressError(f'{label}="{raw}" is not a block of this conversation')
            where = [view.pos[x] for x in b.coverage if x in view.pos]
            if not b.active or not where:
                raise CompressError(f'{label}="{raw}" is not visible any more (consumed by a later block or '
                                    f"gone from the conversation)")
            ends.append((min(where), max(where)))
            block_bounded = True
        else:
            raise CompressError(f'{label}="{raw}" is neither a ref (mNNNNN) nor a block id (bN)')
    s = min(ends[0][0], ends[1][0])
    e = max(ends[0][1], ends[1][1])
    return s, e, block_bounded


def pair_keys(items: list[ViewItem]) -> dict[tuple[int, int], str] | None:
    """What pairs tool calls and results the ids do not (Gemini's: calls without an id, results without
    one or with one the agent made up, as gemini-cli does): ``(item, part)`` -> the key of the call it
    is or answers (its id, or a key of its own for a call without one): a result whose id names no call
    of the request answers the oldest call of its tool not answered yet, as the call edits pair them.
    None when every call and result has an id (the ids pair them)."""
    if not any(not p.tool_call_id and (p.ctype == TOOL_RESULT or (p.ctype == TOOL_CALL and p.tool_name))
               for it in items for p in it.parts):
        return None  # (every call and result has an id: a result naming no call is one the host left alone)
    call_ids = {p.tool_call_id for it in items for p in it.parts if p.ctype == TOOL_CALL and p.tool_call_id}
    out: dict[tuple[int, int], str] = {}
    waiting: dict[str, list[str]] = {}  # per tool, its calls not answered yet, in order
    n = 0
    for k, it in enumerate(items):
        for j, p in enumerate(it.parts):
            if p.ctype == TOOL_CALL and p.tool_name:
                key = p.tool_call_id
                if not key:
                    key = out[(k, j)] = f"\0call {n}"
                    n += 1
                waiting.setdefault(p.tool_name, []).append(key)
            elif p.ctype == TOOL_RESULT:
                if p.tool_call_id in call_ids:
                    queue = waiting.get(p.tool_name)
                    if queue and p.tool_call_id in queue:
                        queue.remove(p.tool_call_id)
                elif waiting.get(p.tool_name):
                    out[(k, j)] = waiting[p.tool_name].pop(0)
    return out


def _tool_keys(items: list[ViewItem], k: int, keys: dict[tuple[int, int], str] | None) -> set[str]:
    """The keys that pair item ``k``'s calls and results (their ids, or :func:`pair_keys`')."""
    if keys is None:
        return items[k].calls | items[k].results
    out = set()
    for j, p in enumerate(items[k].parts):
        if p.ctype == TOOL_CALL or p.ctype == TOOL_RESULT:
            key = keys.get((k, j)) or p.tool_call_id
            if key:
                out.add(key)
    return out


def _tool_work(item: ViewItem) -> bool:
    return bool(item.parts) and all(p.ctype in (TOOL_CALL, TOOL_RESULT) for p in item.parts)


def _pair_closure(view: View, s: int, e: int, scan: int) -> tuple[int, int]:
    """Widen [s, e] so no tool call leaves its result behind, reasoning stays with its turn, and
    a range ending on a step's prose takes that step's tool work along (lanes where calls are
    items of their own, like Responses, would otherwise cut a step in two)."""
    items = view.items
    keys = pair_keys(items)
    for _ in range(3):
        before = (s, e)
        while e + 1 < len(items) and _tool_work(items[e + 1]):
            e += 1
        ids = set().union(*(_tool_keys(items, k, keys) for k in range(s, e + 1)))
        for k in range(e + 1, min(len(items), e + 1 + scan)):
            if _tool_keys(items, k, keys) & ids:
                e = k
        for k in range(s - 1, max(-1, s - 1 - scan), -1):
            if _tool_keys(items, k, keys) & ids:
                s = k
        while s > 0 and items[s - 1].reasoning_only:
            s -= 1
        while e + 1 < len(items) and items[e].reasoning_only:
            e += 1
        if (s, e) == before:
            break
    return s, e
