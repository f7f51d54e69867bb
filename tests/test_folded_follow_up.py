"""A follow-up turn of a folded session costs its new items, not the whole conversation: the plan of
what leaves the wire (fold.plan), its assembly (render.assemble), and the reminder and truncation
decisions (pressure.apply, kernel/nudge.py) were made cheaper without changing a single decision.

The functions as they were are kept below as oracles.  Proof: (1) the new functions against them
over random views (reasoning runs, tool pairs, nested and adjacent blocks, hidden calls, snoozed
blocks); (2) whole Engine runs, once as they are and once with the oracles patched in, over the
bench's folded conversations, folds of every kind (adjacent, nested, distilled, held), reminders
given as a suffix and as an item of their own, truncations, and the captures: the same bytes out,
the same flags, the same blocks and token figures on every turn.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Iterable

import pytest

from bili_addon.kernel import fold, nudge, pressure, render, rewrite, turn
from bili_addon.kernel.compaction import asks_for_summary
from bili_addon.kernel.fold import Block, FoldConfig, PartView, Plan, Sums, View, ViewItem
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.pressure import PressureHost
from bili_addon.kernel.render import WireFolds
from bili_addon.kernel.state import Resolved, Session, TurnResult
from bili_addon.kernel.tags import format_tokens, ref_of
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import Lane
from bili_addon.wire.base import REASONING, TEXT, TOOL_CALL, TOOL_RESULT

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_fold import ANTH, agent_answers_unknown, body, filler, refs_in, roundtrip_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402

# ---- oracle: kernel/fold.py (View, plan, anchors, coverage) as they were
class OldView:
    def __init__(self, items: list[ViewItem], sums: Sums | None = None, prev=None):
        """``sums``: :meth:`sums`, when the caller has them (a conversation's first pass); ``prev``:
        (the new View's argument; the oracle computes from the start)."""
        self.items = items
        self.first_free = False  # the first user turn is the agent's compaction summary: foldable
        # what the turn's decisions read of the view, computed once and only when read (the view's
        # items never change once it is made): the refs' positions, the first and last user turns,
        # the token figures
        self._pos: dict[str, int] | None = None
        self._first_user = self._last_user = fold._UNKNOWN
        self._sums = sums

    @property
    def pos(self) -> dict[str, int]:
        """Each ref's position in ``items`` (its first)."""
        if self._pos is None:
            pos: dict[str, int] = {}
            setdefault = pos.setdefault
            for k, it in enumerate(self.items):
                for p in it.parts:
                    setdefault(p.ref, k)
            self._pos = pos
        return self._pos

    def first_user(self) -> int | None:
        if self._first_user is fold._UNKNOWN:
            self._first_user = next((k for k, it in enumerate(self.items) if fold._user_turn(it.parts)), None)
        return self._first_user

    def last_user(self) -> int | None:
        if self._last_user is fold._UNKNOWN:
            items = self.items
            self._last_user = next((k for k in range(len(items) - 1, -1, -1) if fold._user_turn(items[k].parts)), None)
        return self._last_user

    def sums(self) -> Sums:
        if self._sums is None:
            tokens, filled = [0], [0]
            total = count = peak = 0
            for it in self.items:
                parts = it.parts
                if parts:
                    count += 1
                    for p in parts:
                        n = p.tokens
                        total += n
                        if n > peak:
                            peak = n
                tokens.append(total)
                filled.append(count)
            self._sums = fold.Sums(tokens, filled, peak)
        return self._sums

    def protected(self, cfg: FoldConfig) -> set[int]:
        """Positions never folded: the first user turn, the recent zone and the newest user turn."""
        keep: set[int] = set()
        parts = 0
        for k in range(len(self.items) - 1, -1, -1):
            if parts >= cfg.recent_parts:
                break
            keep.add(k)
            parts += len(self.items[k].parts)
        for k in (None if self.first_free else self.first_user(), self.last_user()):
            if k is not None:
                keep.add(k)
        return keep



def old_coverage(blocks: Iterable[Block]) -> dict[str, Block]:
    out: dict[str, Block] = {}
    for b in blocks:
        if b.active:
            for r in b.coverage:
                out.setdefault(r, b)
    return out


def old_anchors(view: View, blocks: Iterable[Block]) -> dict[int, Block]:
    """View position -> the active block whose summary stands there (its first covered item)."""
    out: dict[int, Block] = {}
    for b in blocks:
        if b.active:
            where = [view.pos[r] for r in b.coverage if r in view.pos]
            if where:
                out.setdefault(min(where), b)
    return out


def old_plan(view: View, blocks: list[Block], hidden: set[str] = frozenset(), snoozed: set[str] = frozenset(),
             protected=()) -> Plan:
    """``hidden``: refs that leave the wire without a summary (consumed compress calls);
    ``snoozed``: blocks not rendered (their range truncated away, or a rewind left it): what they
    cover stays; ``protected``: positions whose covered items stay."""
    cov = old_coverage([b for b in blocks if b.id not in snoozed])
    items = view.items
    drop = {k for k, it in enumerate(items) if it.parts and all(r in cov or r in hidden for r in it.refs)}
    first = None if view.first_free else view.first_user()
    if first is not None:
        drop.discard(first)
    drop -= {k for k in protected if any(r in cov for r in items[k].refs)}
    # never leave a tool call without its result (or the reverse), nor reasoning without its turn
    changed = True
    while changed:
        changed = False
        kept_calls = set().union(*(items[k].calls for k in range(len(items)) if k not in drop))
        kept_results = set().union(*(items[k].results for k in range(len(items)) if k not in drop))
        for k in sorted(drop):
            if items[k].calls & kept_results or items[k].results & kept_calls:
                drop.discard(k)
                changed = True
        for k, it in enumerate(items):
            if not it.reasoning_only:
                continue
            # a reasoning run shares the fate of the turn it precedes
            j = k
            while j < len(items) and items[j].reasoning_only:
                j += 1
            group = range(k, min(j + 1, len(items)))
            if any(x in drop for x in group) and any(x not in drop for x in group):
                drop.difference_update(group)
                changed = True
    # each block's summary stands at the first dropped item holding one of its refs (one pass over
    # the dropped items, not one per block)
    live = sorted((b for b in blocks if b.active and b.id not in snoozed), key=lambda b: b.number)
    holders: dict[str, list[int]] = {}
    for i, b in enumerate(live):
        for r in b.coverage:
            holders.setdefault(r, []).append(i)
    first: dict[int, int] = {}
    for k in drop:
        for p in items[k].parts:
            for i in holders.get(p.ref, ()):
                if k < first.get(i, len(items)):
                    first[i] = k
    inserts: dict[int, list[Block]] = {}
    rendered: list[Block] = []
    for i, b in enumerate(live):
        # a block none of whose parts is on the wire is not rendered: whether the host dropped
        # them or this is not the conversation it was made in cannot be told apart from here,
        # and a summary in the wrong conversation is the one failure that must never happen
        if i in first:
            inserts.setdefault(first[i], []).append(b)
            rendered.append(b)
    return fold.Plan(drop, inserts, rendered)


# ---- oracle: kernel/nudge.py (compressible, distillable, decide, truncations) as they were
def old_compressible(view: View, blocks: list[Block], cfg: FoldConfig) -> list[tuple[str, str, int, int]]:
    """``(start ref, end ref, items, tokens)`` runs of unfolded items outside the protected zone."""
    cov = old_coverage(blocks)
    protected = view.protected(cfg)
    if not cov:  # nothing folded (no summary stands anywhere): the loop below, an item at a time
        return nudge._runs_unfolded(view, sorted(protected))  # (it takes them ascending)
    stops = old_anchors(view, blocks)  # a range never takes a block's summary in: that would re-fold it
    runs: list[list[int]] = [[]]
    for k, it in enumerate(view.items):
        if k in protected or k in stops:
            if runs[-1]:
                runs.append([])
        elif it.parts and (not cov or not all(p.ref in cov for p in it.parts)):
            runs[-1].append(k)
    out = []
    for run in runs:
        refs, tokens = [], 0
        for k in run:
            for p in view.items[k].parts:
                if p.ref not in cov:
                    refs.append(p.ref)
                    tokens += p.tokens
        if refs:
            out.append((refs[0], refs[-1], len(run), tokens))
    return out


def old_distillable(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, along: bool = False,
                ranges: list[tuple[str, str, int, int]] | None = None) -> tuple[str, str, int, int] | None:
    """``(first block, last block, blocks, tokens)``: the pile of summaries worth distilling into
    one, or None.  The pile is every active block whose summary stands on the wire (whatever its
    tier), in wire order, with the stray messages left between them (user turns that were protected
    when their neighbours were folded), up to the first range that can be folded on its own.  It is
    read on every request, and grows by a summary with every fold.

    Distilling rewrites the cache from the pile's first summary on.  On its own, that is nearly the
    whole conversation, so it waits for ``distil_tokens``.  ``along``: offered with a fold, which
    rewrites everything after its own start anyway (and, on Anthropic, the head before it: the
    breakpoint on the last summary moves), so what distilling adds is little more than the pile's
    own bytes: it pays from ``distil_along_tokens``.  ``ranges``: the foldable ranges, when known."""
    active = [b for b in blocks if b.active]
    if len(active) < 2:
        return None  # no pile (read on every request: nothing of the view is needed to say so)
    placed = {b.id: k for k, b in old_anchors(view, active).items()}
    if ranges is None:
        ranges = [r for r in old_compressible(view, blocks, fold_cfg) if r[3] * 4 >= fold_cfg.min_compress_chars]
    stop = min((view.pos[r[0]] for r in ranges), default=len(view.items))  # that range is a fold of its own
    run = sorted((b for b in active if b.id in placed and placed[b.id] < stop), key=lambda b: placed[b.id])
    if len(run) < 2:
        return None
    cov = old_coverage(active)
    protected = view.protected(fold_cfg)
    lo = placed[run[0].id]
    hi = min(stop - 1, max(view.pos[r] for b in run for r in b.coverage if r in view.pos))
    strays = sum(p.tokens for k in range(lo, hi + 1) if k not in protected
                 for p in view.items[k].parts if p.ref not in cov)
    tokens = sum(b.summary_tokens for b in run) + strays
    if tokens < (cfg.distil_along_tokens if along else cfg.distil_tokens):
        return None
    return run[0].id, run[-1].id, len(run), tokens


def old_decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
           last_nudge_at: int) -> str | None:
    """The reminder for this turn, or None.  ``used``: the input tokens the last answer reported;
    ``last_nudge_at``: ``used`` when the last reminder was given (lowered when the context shrank)."""
    ranges = [r for r in old_compressible(view, blocks, fold_cfg) if r[3] * 4 >= fold_cfg.min_compress_chars]
    distil = old_distillable(view, blocks, fold_cfg, cfg, ranges=ranges)
    if not ranges and not distil:
        return None
    pending = sum(r[3] for r in ranges)
    urgent = window > 0 and used >= cfg.pressure * window
    if not urgent:
        if pending < cfg.batch_tokens and not distil:
            return None
        if last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
            return None
    if not distil and (urgent or pending >= cfg.batch_tokens):
        distil = old_distillable(view, blocks, fold_cfg, cfg, along=True, ranges=ranges)
    listed = sorted(ranges, key=lambda r: -r[3])[:5]
    listed.sort(key=lambda r: int(r[0][1:]))
    lines = [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in listed]
    if distil:  # the pile stands before every range: oldest first, as the wire has them
        first, last, n, t = distil
        lines.insert(0, f"  {first}–{last}  {n} summaries  ~{format_tokens(t)} tokens (distil them into one)")
    if urgent:
        head = "[bili] The context is nearly full: fold consumed work now, oldest first."
    elif pending >= cfg.batch_tokens:
        head = f"[bili] ~{format_tokens(pending)} tokens of older work can be folded; fold what you no longer need verbatim:"
    else:
        head = "[bili] The summaries have piled up. Fold them into one denser summary:"
    return "\n".join([
        head,
        *lines,
        "One compress call, one entry per range, alongside your next step if you like.",
    ])


def old_truncations(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int,
                window: int, known=()) -> dict[str, str]:
    """Emergency: the biggest old tool outputs, cut to head and tail until the context fits again
    (those the model has answered since, not cut before)."""
    if not rewrite.window_forces(used, window, cfg.truncate_at):  # the rewrite decision's window rule, at 95%
        return {}
    if view.sums().peak < cfg.truncate_min_tokens:
        return {}  # no part is big enough to be cut
    cov = old_coverage(blocks)
    protected = view.protected(fold_cfg)
    target = 0.9 * cfg.truncate_at * window
    answered = max((k for k, it in enumerate(view.items) if any(p.role == "assistant" for p in it.parts)), default=0)
    parts = [
        p for k, it in enumerate(view.items) if k not in protected and k < answered
        for p in it.parts
        if p.ctype == TOOL_RESULT and p.ref not in cov and p.ref not in known and p.tokens >= cfg.truncate_min_tokens
        and len(p.text) > 2 * cfg.keep_chars + 200
    ]
    parts.sort(key=lambda p: -p.tokens)
    out: dict[str, str] = {}
    saved = 0
    for p in parts:
        if used - saved <= target:
            break
        cut = p.text[: cfg.keep_chars] + (
            f"\n\n[... ~{format_tokens(p.tokens)} tokens of this tool output were cut by bili to keep the "
            f"conversation within the context window ...]\n\n"
        ) + p.text[-cfg.keep_chars :]
        out[p.ref] = cut
        saved += p.tokens - len(cut) // 4
    return out
# ---- oracle: kernel/pressure.py apply as it was
def old_apply(host: PressureHost, s: Session, view: View, resolved: list[list[Resolved]], new: bool = False,
              snoozed=()) -> None:
    """Nudge and emergency truncation, decided from the usage the last answer reported.  ``new``:
    the store had no row of the session when this turn loaded it, so no answer of it is recorded
    (usage is recorded for a stored session only): nothing to read."""
    if not view.items:
        return
    last = None if new else host.reported_usage(s)
    # the size the provider reported for the last request; without one (a Chat stream without
    # include_usage), the conversation's own estimate
    if last:
        used = last[0]
    elif not s.blocks:  # nothing folded: every part counts
        used = view.sums().tokens[-1]
    else:
        cov = old_coverage(s.blocks)
        used = ((sum(p.tokens for it in view.items for p in it.parts if p.ref not in cov) if cov
                 else view.sums().tokens[-1])
                + sum(b.summary_tokens for b in s.blocks if b.active))
    known = s.flags.get("truncated", {})
    if not last and known:  # (the estimate counts the outputs cut before as cut)
        cov = old_coverage(s.blocks)
        used -= sum(p.tokens - len(known[p.ref]) // 4 for it in view.items for p in it.parts
                    if p.ref in known and p.ref not in cov)
    window = host.window_for(s)
    if used < int(s.flags.get("last_nudge_at", 0)):
        # a fold (or the host's own compaction) shrank the context: growth counts from here
        host.set_flag(s.row.id, "last_nudge_at", used)
    cfg = host.nudge_cfg
    if used < min(cfg.batch_tokens, cfg.distil_tokens, cfg.pressure * window, cfg.truncate_at * window):
        return  # not even the whole context would be worth a fold, and the window is far
    nudges = dict(s.flags.get("nudges", {}))
    newest = resolved[-1]
    if newest and not any(r.entry.ref in nudges for r in newest) and not asks_for_summary(view):
        text = old_decide(view, s.blocks, host.fold_cfg, host.nudge_cfg, used, window,
                            int(s.flags.get("last_nudge_at", 0)))
        if text:
            prose = [r for r in newest if r.core.role == "user" and r.core.ctype == TEXT and r.core.path
                     and r.core.text.strip()]
            if prose or not any(r.core.role == "assistant" for r in newest):  # (never into a prefill)
                ref = (prose[-1] if prose else newest[-1]).entry.ref
                nudges[ref] = {"text": text, "how": "suffix" if prose else "item"}
                host.sessions.set_flags(s.row.id, {"nudges": nudges, "last_nudge_at": used})  # one write
    cut = old_truncations(view, s.blocks, host.fold_cfg, host.nudge_cfg, used, window, known)
    if cut:
        host.set_flag(s.row.id, "truncated", {**cut, **known})


# ---- oracle: kernel/render.py assemble as it was
def old_assemble(folds: WireFolds, s: Session, lane: Lane, items_out: list[bytes], start: int, view: View,
             result: TurnResult, snoozed: set[str], pre: dict) -> bool:
    """Covered items leave the wire; each active block's summary stands where its range began;
    a reminder that needs an item of its own follows the item it was given after."""
    unfolded = sum(it.tokens for it in view.items) if s.blocks else 0
    s.unfolded_tokens = s.sent_tokens = unfolded
    blocks, calls = folds.wire_blocks(s)  # held folds are not on the wire yet (kernel/pending.py)
    hidden = folds.spent_calls(s, view, blocks=calls) if s.calls else set()
    active = any(b.active for b in blocks)
    plan = old_plan(view, blocks, hidden, snoozed) if hidden or active else fold.Plan(set(), {}, [])
    after = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "item"}
    nudge_at = render._holding(view, after) if after else set()
    if not plan.drop and not plan.inserts and not nudge_at and not pre:
        return False
    out: list[bytes] = items_out[:start]
    ours: dict[int, str] = {}  # positions in ``out`` of the items the addon added, with their text
    items = view.items
    # the view's items are the conversation's from ``start`` on: only those where something
    # happens are looked at, the runs between them copied as they are
    marks = sorted(k for k in {*plan.drop, *plan.inserts, *nudge_at, *(i - start for i in pre)}
                   if 0 <= k < len(items))
    if items and (items[0].index != start or items[-1].index != start + len(items) - 1):
        marks = range(len(items))  # (not laid out so: each item on its own)
    at = 0
    for k in marks:
        it = items[k]
        out.extend(items_out[start + at:start + k])
        at = k + 1
        out.extend(pre.get(it.index, ()))
        for b in plan.inserts.get(k, ()):
            ours[len(out)] = b.text()
            out.append(lane.summary_item(ours[len(out)]))
        if k in plan.drop:
            continue
        item, notes = items_out[it.index], []
        if k in nudge_at:  # a reminder goes into the item it was given to, or right after it
            for text in (after[r] for r in it.refs if r in after):
                merged = lane.note_in_item(item, text)
                if merged is None:
                    ours[len(out) + 1 + len(notes)] = text
                    notes.append(lane.summary_item(text))
                else:
                    item = merged
        out.append(item)
        out.extend(notes)
    out.extend(items_out[start + at:])
    items_out[:] = render.alternate(lane, out, start, ours) if ours else out
    result.folded_items = len(plan.drop)
    s.sent_tokens = (unfolded - sum(view.items[k].tokens for k in plan.drop)
                     + sum(count_tokens(b.text()) for b in plan.rendered))
    return True




# -- (1) the functions against the oracles, over random views ------------------------------------

def random_view(rng: random.Random, n: int) -> tuple[View, list[Block], set[str]]:
    items: list[ViewItem] = []
    refs: list[str] = []
    next_ref = 1
    open_calls: list[str] = []
    for k in range(n):
        parts = []
        kind = rng.random()
        if kind < 0.05:
            pass  # an item without parts
        elif kind < 0.2:
            for _ in range(rng.randint(1, 2)):
                parts.append(("assistant", REASONING, "", ""))
        elif kind < 0.45:
            cid = f"call{k}"
            open_calls.append(cid)
            parts.append(("assistant", TEXT, "", "")) if rng.random() < 0.5 else None
            parts.append(("assistant", TOOL_CALL, "Bash", cid))
        elif kind < 0.7 and open_calls:
            cid = open_calls.pop(rng.randrange(len(open_calls))) if rng.random() < 0.8 else f"stray{k}"
            parts.append(("tool", TOOL_RESULT, "Bash", cid))
            if rng.random() < 0.2:
                parts.append(("user", TEXT, "", ""))
        else:
            parts.append((rng.choice(["user", "assistant"]), TEXT, "", ""))
        views = []
        for role, ctype, name, cid in parts:
            ref = ref_of(next_ref) if not refs or rng.random() > 0.03 else rng.choice(refs)  # (a ref seen twice)
            next_ref += 1
            refs.append(ref)
            size = rng.choice([5, 50, 400, 1500, 3000])
            views.append(PartView(ref, role, ctype, name, cid, f"{ref} " + "x" * (size * 4), size))
        items.append(ViewItem(100 + k, views))
    view = View(items)
    view.first_free = rng.random() < 0.2
    blocks = []
    uniq = list(dict.fromkeys(refs))
    for b in range(rng.randint(0, 5)):
        if not uniq:
            break
        i = rng.randrange(len(uniq))
        j = min(len(uniq), i + rng.randint(1, max(1, len(uniq) // 2)))
        covered = uniq[i:j] + ([f"m9{b}999"] if rng.random() < 0.2 else [])  # (a ref not on the wire)
        blk = Block(id=f"b{b + 1}", tier=1, summary=f"summary {b} " * rng.randint(1, 60), topic="t",
                    covered=covered, direct=list(covered), consumed=[], start_ref=covered[0], end_ref=covered[-1])
        blk.active = rng.random() < 0.8
        if rng.random() < 0.1 and uniq:
            blk.claimed = {covered[0]: rng.choice(uniq)}
        blocks.append(blk)
    rng.shuffle(blocks)
    hidden = set(rng.sample(uniq, min(len(uniq), rng.randint(0, 3)))) if rng.random() < 0.3 else set()
    return view, blocks, hidden


def same_plan(a: fold.Plan, b: fold.Plan) -> bool:
    return (a.drop == b.drop and {k: [x.id for x in v] for k, v in a.inserts.items()}
            == {k: [x.id for x in v] for k, v in b.inserts.items()}
            and list(a.inserts) == list(b.inserts) and [x.id for x in a.rendered] == [x.id for x in b.rendered])


@pytest.mark.parametrize("seed", range(300))
def test_the_decisions_are_the_oracles_over_random_views(seed):
    rng = random.Random(seed)
    view, blocks, hidden = random_view(rng, rng.choice([0, 1, 3, 10, 40, 120]))
    snoozed = {b.id for b in blocks if rng.random() < 0.2}
    assert same_plan(fold.plan(view, blocks, hidden, snoozed), old_plan(view, blocks, hidden, snoozed))
    assert same_plan(fold.plan(view, blocks), old_plan(view, blocks))
    protected = view.protected(FoldConfig(recent_parts=rng.choice([1, 4, 8])))
    assert same_plan(fold.plan(view, blocks, hidden, snoozed, protected),
                     old_plan(view, blocks, hidden, snoozed, protected))
    assert fold.anchors(view, blocks) == old_anchors(view, blocks)
    assert [(r, id(b)) for r, b in fold.coverage(blocks).items()] == [(r, id(b)) for r, b in old_coverage(blocks).items()]
    fcfg = FoldConfig(min_compress_chars=rng.choice([200, 2000, 5000]), recent_parts=rng.choice([1, 4, 8]))
    ncfg = NudgeConfig(batch_tokens=rng.choice([500, 3000, 12000]), distil_tokens=rng.choice([100, 5000]),
                       distil_along_tokens=rng.choice([50, 1500]), truncate_min_tokens=rng.choice([300, 1000]),
                       keep_chars=rng.choice([100, 2000]))
    cov = fold.coverage(blocks)
    assert nudge.compressible(view, blocks, fcfg) == old_compressible(view, blocks, fcfg)
    assert nudge.compressible(view, blocks, fcfg, cov) == old_compressible(view, blocks, fcfg)
    for along in (False, True):
        assert (nudge.distillable(view, blocks, fcfg, ncfg, along)
                == nudge.distillable(view, blocks, fcfg, ncfg, along, cov=cov)
                == old_distillable(view, blocks, fcfg, ncfg, along))
    total = sum(it.tokens for it in view.items)
    for used in (0, total // 3, total, total * 2):
        for window in (0, max(1, total), max(1, total * 3), 1_000_000):
            for last in (0, used // 2, max(0, used - 20_000)):
                assert (nudge.decide(view, blocks, fcfg, ncfg, used, window, last)
                        == nudge.decide(view, blocks, fcfg, ncfg, used, window, last, cov)
                        == old_decide(view, blocks, fcfg, ncfg, used, window, last))
            assert (nudge.truncations(view, blocks, fcfg, ncfg, used, window)
                    == nudge.truncations(view, blocks, fcfg, ncfg, used, window, cov)
                    == old_truncations(view, blocks, fcfg, ncfg, used, window))
    assert view.unfolded(cov).tokens[-1] == sum(p.tokens for it in view.items for p in it.parts if p.ref not in cov)


def same_figures(v: View, items: list[ViewItem], cov: dict | None = None) -> None:
    o = OldView(list(items))
    assert list(v.pos.items()) == list(o.pos.items())  # (in the same order too)
    assert v.sums() == o.sums()
    assert v.first_user() == o.first_user() and v.last_user() == o.last_user()
    if cov is not None:
        u = v.unfolded(cov)
        held, tokens, first, last = [0], [0], [], []
        for it in items:
            mine = [p for p in it.parts if p.ref not in cov]
            held.append(held[-1] + bool(mine))
            tokens.append(tokens[-1] + sum(p.tokens for p in mine))
            first.append(mine[0].ref if mine else None)
            last.append(mine[-1].ref if mine else None)
        assert (u.held, u.tokens, u.first, u.last) == (held, tokens, first, last)
        assert v.unfolded(dict(cov)) is u  # (kept for the same coverage)
        for b in range(len(items)):
            for e in range(b + 1, len(items) + 1):
                if held[e] > held[b]:
                    assert u.first_held(b) == next(k for k in range(b, e) if held[k + 1] > held[k])
                    assert u.last_held(e) == next(k for k in range(e - 1, b - 1, -1) if held[k + 1] > held[k])


@pytest.mark.parametrize("seed", range(200))
def test_a_views_figures_extend_the_previous_views_as_a_pass_from_the_start_gives_them(seed):
    """View.pos and View.sums of a view made after another of the same conversation extend that
    view's over the items the two share (the same objects): the same figures (and order) as one
    pass over the whole, whatever was shared, dropped, rebuilt equal, or changed in place since."""
    rng = random.Random(seed)
    base, blocks, _hidden = random_view(rng, rng.choice([1, 2, 5, 30, 80]))
    covs = [fold.coverage(blocks), {}, fold.coverage(blocks[:1])]
    others, _b, _h = random_view(random.Random(seed + 1000), 20)
    items = list(base.items)
    spare = list(others.items)
    last = None
    for _ in range(rng.randint(1, 6)):
        v = View(items, prev=last)
        which = rng.random()
        if which < 0.4:
            v.pos
        elif which < 0.8:
            v.sums()
        else:
            v.pos, v.sums()
        if rng.random() < 0.7:
            v.unfolded(rng.choice(covs))
        if rng.random() < 0.2:
            same_figures(v, items, rng.choice(covs))
        change = rng.random()
        if change < 0.1 and items:  # the list the previous view was made of changes in place
            items[rng.randrange(len(items))] = rng.choice(spare)
            nxt = items
        elif change < 0.2 and items:  # its last item made again (an equal object, not the same)
            last = items[-1]
            nxt = items[:-1] + [ViewItem(last.index, list(last.parts), last.sig)]
        else:
            keep = rng.randint(0, len(items))
            nxt = items[:keep] + rng.sample(spare, rng.randint(0, 4))
        if rng.random() < 0.1:
            View(list(spare), prev=v)  # a view of other items made from it (it is no one's previous view then)
        items = nxt if nxt is not items else items
        v2 = View(items, prev=v)
        if rng.random() < 0.5:
            same_figures(v2, items, rng.choice(covs))
        else:  # (in the other order)
            o = OldView(list(items))
            assert v2.sums() == o.sums() and list(v2.pos.items()) == list(o.pos.items())
        last = v2
        if not items:
            items = list(base.items)


@pytest.mark.parametrize("seed", range(300))
def test_a_follow_ups_plan_is_the_oracles_whether_made_again_or_not(seed):
    """fold.plan of a view made after another of the same conversation (the previous plan taken
    when nothing new can change it): the oracle's, turn after turn, as the conversation grows, its
    last item is made again, it goes back, the blocks change, calls are hidden, blocks snoozed."""
    rng = random.Random(seed)
    whole, blocks, hidden = random_view(rng, rng.choice([6, 20, 60]))
    pool = whole.items
    end = rng.randint(1, len(pool))
    items = pool[:end]
    snoozed: set[str] = set()
    zone = rng.choice([0, 0, 1, 4, 8])
    v = None
    for _ in range(rng.randint(2, 10)):
        v = View(items, prev=v)
        v.first_free = rng.random() < 0.1
        # (the positions a fold never takes, as the engine gives them: a zone of its own size, here)
        protected = v.protected(FoldConfig(recent_parts=zone)) if zone else ()
        for bs in (blocks, [b for b in blocks if rng.random() < 0.7]) if rng.random() < 0.3 else (blocks,):
            assert same_plan(fold.plan(v, bs, hidden, snoozed, protected),
                             old_plan(v, bs, hidden, snoozed, protected)), seed
        move = rng.random()
        if move < 0.6:  # the conversation grows
            end = min(len(pool), end + rng.randint(0, 4))
            items = items + pool[len(items):end] if len(items) <= end else items[:end]
        elif move < 0.75 and items:  # its last item made again (equal, not the same object)
            last = items[-1]
            items = items[:-1] + [ViewItem(last.index, list(last.parts), last.sig)]
        elif move < 0.85:  # it goes back
            end = rng.randint(0, len(items))
            items = items[:end]
        elif move < 0.92:  # the blocks change
            if blocks:
                rng.choice(blocks).active ^= True
        else:
            hidden = set(rng.sample([p.ref for it in pool for p in it.parts], 1)) if rng.random() < 0.5 else set()
            snoozed = {b.id for b in blocks if rng.random() < 0.2}
        if not items:
            items = pool[:1]


# -- (2) whole Engine runs: as they are, and with the oracles patched in --------------------------

def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(turn, "View", OldView)
    mp.setattr(turn, "assemble", old_assemble)
    mp.setattr(pressure, "apply", old_apply)
    mp.setattr(fold, "plan", old_plan)
    mp.setattr(fold, "anchors", old_anchors)
    mp.setattr(fold, "coverage", old_coverage)
    mp.setattr(nudge, "anchors", old_anchors)
    mp.setattr(nudge, "coverage", old_coverage)
    for name in ("compressible", "distillable", "decide", "truncations"):
        mp.setattr(nudge, name, globals()[f"old_{name}"])


class Trace:
    """What a run shows: every turn's bytes out and result, and the session's state after it."""

    def __init__(self, e: Engine):
        self.e = e
        self.turns: list = []

    def send(self, raw: bytes, sid: str, lane=ANTH, headers: dict | None = None):
        res = self.e.process(raw, lane, headers or {"x-acp-session": sid}, render=True)
        self.e.lineage.flush()
        s = self.e.sessions.get(res.session) if res.session else None
        self.turns.append((
            res.body, res.folded_items, list(res.executed), res.tagged, res.landed, res.active,
            None if s is None else (
                json.dumps(s.flags, sort_keys=True, default=str), s.sent_tokens, s.unfolded_tokens,
                [(b.id, b.tier, b.active, b.retired, b.covered, b.direct, b.consumed, b.claimed, b.folded_tokens)
                 for b in s.blocks]),
        ))
        return res


def both(tmp_path: Path, scenario) -> None:
    """``scenario(make_engine, trace_of)`` run as the code is and with the oracles: the same traces."""
    same_runs(tmp_path, scenario, patch_oracles, Trace, "turn")


@pytest.mark.parametrize("n", [30, 100, 300])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, n):
    case = bench_overhead.Case("anthropic", n)
    news = [case.new(i) for i in range(6)]  # (drawn once: the generator moves on with each)

    def scenario(make):
        t = make(fold_cfg=FoldConfig(min_compress_chars=2000))
        sid = "bench-folded"
        msgs = bench_overhead.fold_half(t.e, case, list(case.msgs), {"x-acp-session": sid})
        for i in range(6):
            msgs.append(news[i])
            t.e.t += 10
            t.send(case.body(msgs), sid)
        return t.turns

    both(tmp_path, scenario)


def big(tag: str, n: int) -> str:
    return filler(tag, n)


def long_conversation(steps: int, big_every: int = 0) -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": "Please audit the repository."}]
    for t in range(steps):
        content = [{"type": "text", "text": f"Step {t}: reading module {t}."}]
        if t % 5 == 3:
            content.insert(0, {"type": "thinking", "thinking": f"think {t}", "signature": "sig"})
        content.append({"type": "tool_use", "id": f"toolu_{t}", "name": "Bash", "input": {"cmd": f"cat mod{t}.py"}})
        msgs.append({"role": "assistant", "content": content})
        size = 9000 if big_every and t % big_every == 0 else 1200
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                                  "content": big(f"file-{t}", size)}]})
        if t % 4 == 1:
            msgs.append({"role": "assistant", "content": f"Module {t} read."})
            msgs.append({"role": "user", "content": f"go on after {t}"})
    return msgs


def folds_of_every_kind(make, window: int = 0, materialize: str = "now", snapshot: bool = False,
                        batch: int = 12_000) -> list:
    t = make(fold_cfg=FoldConfig(min_compress_chars=1500), window=window, materialize=materialize,
             snapshot=snapshot)
    t.e.nudge_cfg = NudgeConfig(batch_tokens=batch, distil_tokens=600, distil_along_tokens=200)
    sid = "fold-1"
    msgs = long_conversation(24, big_every=7)
    n = 0

    def step(msgs, gap=10.0):
        t.e.t += gap
        return t.send(body(msgs), sid)

    def compress(msgs, entries, gap=10.0):
        nonlocal n
        res = step(msgs, gap)
        refs = refs_in(json.loads(res.body)) if res.body else {}

        def ref(x):
            if x.startswith("b"):
                return x
            return next(r for r, text in refs.items() if text.startswith(f"Step {x}:"))
        args = {"content": [{"startId": ref(a), "endId": ref(b), "topic": f"{a}-{b}",
                             "summary": f"Steps {a} to {b}: modules read, values noted, nothing unusual here."}
                            for a, b in entries]}
        n += 1
        cid = f"toolu_c{n}"
        roundtrip_call(t.e, sid, "compress", args, cid)
        msgs = agent_answers_unknown(msgs, "compress", args, cid)
        step(msgs)
        return msgs

    def follow(msgs, k, prose: bool, gap=10.0):
        if prose:
            msgs = msgs + [{"role": "assistant", "content": f"Noted {k}."}, {"role": "user", "content": f"go on {k}"}]
        else:  # the newest item holds no user prose: a reminder goes in an item of its own
            msgs = msgs + [
                {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_f{k}", "name": "Bash",
                                                   "input": {"cmd": f"ls {k}"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_f{k}",
                                              "content": big(f"more-{k}", 3000)}]}]
        step(msgs, gap)
        return msgs

    msgs = compress(msgs, [("1", "3")])  # b1
    msgs = follow(msgs, 0, True)
    msgs = compress(msgs, [("4", "6"), ("8", "9")])  # b2, b3: adjacent and apart
    msgs = follow(msgs, 1, False)
    msgs = follow(msgs, 2, True, gap=400)  # (a cold moment: held folds land)
    msgs = compress(msgs, [("b1", "b2")])  # distilled: b4 absorbs b1 and b2
    msgs = follow(msgs, 3, False)
    msgs = compress(msgs, [("10", "12")])
    msgs = compress(msgs, [("b4", "b5")])  # nested: b6 absorbs b4 and b5 (b3 between them)
    for k in range(4, 10):
        msgs = follow(msgs, k, k % 2 == 0, gap=400 if k == 6 else 10.0)
    return t.turns


@pytest.mark.parametrize("window", [0, 60_000, 30_000, 20_000, 12_000])
@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window, materialize):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, materialize))


@pytest.mark.parametrize("batch", [2_000, 200_000])
def test_folds_rendered_from_the_transcript_are_the_oracles(tmp_path, batch):
    both(tmp_path, lambda make: folds_of_every_kind(make, 40_000, "now", snapshot=True, batch=batch))


def test_the_scenarios_do_what_they_say(tmp_path):
    """(The runs above fold, remind in both ways, truncate and hold: else they would prove little.)"""
    with pytest.MonkeyPatch.context():
        d = tmp_path / "x"
        d.mkdir()
        seen = {"suffix": 0, "item": 0, "truncated": 0, "held": 0, "distilled": 0, "folded": 0}
        for window, materialize in ((20_000, "now"), (0, "cost"), (12_000, "now")):
            engines = []

            def make(**kw):
                e = Engine(Store(d / f"{window}{materialize}.db"), **kw)
                e.t = 1000.0
                e.now = lambda e=e: e.t
                engines.append(e)
                return Trace(e)
            turns = folds_of_every_kind(make, window, materialize, batch=2_000)
            s = engines[0].sessions.get("fold-1")
            hows = [n["how"] for n in s.flags.get("nudges", {}).values()]
            seen["suffix"] += hows.count("suffix")
            seen["item"] += hows.count("item")
            seen["truncated"] += len(s.flags.get("truncated", {}))
            seen["held"] += any(t[4] for t in turns)
            seen["distilled"] += any(b.consumed for b in s.blocks)
            seen["folded"] += max(t[1] for t in turns) > 0
            engines[0].store.close()
    assert all(seen.values()), seen


def capture_files() -> list[str]:
    from wirecases import capture_files as files
    return files()


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize, monkeypatch):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old


def test_the_engine_hands_each_view_the_sessions_previous_one(tmp_path, monkeypatch):
    """A folded session's follow-up extends its previous view (Engine passes ``s.last_view`` as
    ``prev``): its plan is taken, not made again, and only the view before it is kept; without a
    previous view the plan is made again."""
    e = Engine(Store(tmp_path / "s"))
    e.lineage.defer = True
    case = bench_overhead.Case("anthropic", 60, seed=4)
    headers = {"x-acp-session": "prev-view"}
    msgs = bench_overhead.fold_half(e, case, list(case.msgs), headers)
    made = []
    real = fold._plan
    monkeypatch.setattr(fold, "_plan", lambda *a: made.append(1) or real(*a))
    for i in range(3):
        msgs.append(case.new(i))
        before = e.sessions["prev-view"].last_view
        e.process(case.body(msgs), case.lane, headers, render=True)
        after = e.sessions["prev-view"].last_view
        assert after is not before and after._prev is before  # (and only one view back is kept)
        assert before._prev is None
    assert made == []  # each plan was the previous view's
    monkeypatch.setattr(turn, "View", lambda items, sums=None, prev=None: View(items, sums))  # no previous view
    msgs.append(case.new(9))
    e.process(case.body(msgs), case.lane, headers, render=True)
    assert made == [1]
    e.store.close()
