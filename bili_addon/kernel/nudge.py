"""When the context fills up: a reminder to fold, and the last safety valve before the window.

Both are remembered per ref once applied, so a message that carried a nudge or a truncation keeps
the very same bytes on every later turn (the prefix cache never sees them change).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection
from dataclasses import dataclass

from bili_addon.kernel import rewrite
from bili_addon.kernel.fold import Block, FoldConfig, View, anchors, coverage
from bili_addon.kernel.tags import format_tokens
from bili_addon.wire.base import TOOL_RESULT


@dataclass
class NudgeConfig:
    # A fold rewrites the prompt cache from its position on (the summary and every later message are
    # written again); it pays off once the reads it saves on later turns outweigh that rewrite.  So the
    # reminder follows how much *foldable* work has piled up, not how full the window is
    # (scripts/bench_session.py measures the trade-off).
    batch_tokens: int = 12_000  # foldable tokens (outside the protected zone) that call for a fold
    regrowth_tokens: int = 10_000  # an unanswered reminder is repeated after the context grew this much
    distil_tokens: int = 5_000  # summaries on the wire (with strays between them) that call for distilling
    # ... alongside a fold reminder: the fold rewrites the cache after its start anyway, so distilling
    # the pile before it adds little more than the pile's own bytes (scripts/bench_session.py)
    distil_along_tokens: int = 1_500
    pressure: float = 0.75  # from this share of the window on: a reminder every turn while anything is foldable
    truncate_at: float = 0.95  # emergency truncation of old tool outputs from this share on
    truncate_min_tokens: int = 1000
    keep_chars: int = 2000  # head and tail kept of a truncated output


def compressible(view: View, blocks: list[Block], cfg: FoldConfig,
                 cov: dict[str, Block] | None = None) -> list[tuple[str, str, int, int]]:
    """``(start ref, end ref, items, tokens)`` runs of unfolded items outside the protected zone.
    ``cov``: ``coverage(blocks)``, when the caller has it."""
    if cov is None:
        cov = coverage(blocks)
    if not cov:  # nothing folded (no summary stands anywhere): the loop below, an item at a time
        return _runs_unfolded(view, view.protected_order(cfg))
    protected = view.protected(cfg)
    stops = anchors(view, blocks)  # a range never takes a block's summary in: that would re-fold it
    # a run is the items (with a part not folded) between protected items and summaries; it counts
    # its items and the parts of them not folded (the view's running figures against the coverage)
    u = view.unfolded(cov)
    held, tokens = u.held, u.tokens
    out = []
    begin = 0
    for stop in [*sorted(protected | stops.keys()), len(view.items)]:
        if stop > begin:
            n = held[stop] - held[begin]
            if n:
                out.append((u.first[u.first_held(begin)], u.last[u.last_held(stop)], n, tokens[stop] - tokens[begin]))
        begin = max(begin, stop + 1)
    return out


def _runs_unfolded(view: View, protected: list[int]) -> list[tuple[str, str, int, int]]:
    """:func:`compressible` where no block is active: the runs are the stretches between protected
    items (``protected``: ascending, ``View.protected_order``), each part of them counts (the view's
    running sums: it runs on every request).  A run's first and last items with parts are where its
    count of them steps (as Unfolded.first_held and last_held find them)."""
    out = []
    items = view.items
    tokens, filled, _peak = view.sums()
    begin = 0
    for stop in (*protected, len(items)):  # (after every protected position: each past ``begin``)
        if stop > begin:
            n = filled[stop] - filled[begin]  # the items with parts
            if n:
                # (mostly the run's own first and last items: no search)
                first = begin if items[begin].parts else bisect_right(filled, filled[begin], begin) - 1
                last = stop - 1 if items[stop - 1].parts else bisect_left(filled, filled[stop], 0, stop) - 1
                out.append((items[first].parts[0].ref, items[last].parts[-1].ref, n, tokens[stop] - tokens[begin]))
        begin = stop + 1
    return out


def distillable(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, along: bool = False,
                ranges: list[tuple[str, str, int, int]] | None = None,
                cov: dict[str, Block] | None = None) -> tuple[str, str, int, int] | None:
    """``(first block, last block, blocks, tokens)``: the pile of summaries worth distilling into
    one, or None.  The pile is every active block whose summary stands on the wire (whatever its
    tier), in wire order, with the stray messages left between them (user turns that were protected
    when their neighbours were folded), up to the first range that can be folded on its own.  It is
    read on every request, and grows by a summary with every fold.

    Distilling rewrites the cache from the pile's first summary on.  On its own, that is nearly the
    whole conversation, so it waits for ``distil_tokens``.  ``along``: offered with a fold, which
    rewrites everything after its own start anyway (and, on Anthropic, the head before it: the
    breakpoint on the last summary moves), so what distilling adds is little more than the pile's
    own bytes: it pays from ``distil_along_tokens``.  ``ranges``: the foldable ranges, when known;
    ``cov``: ``coverage(blocks)``, when known."""
    active = [b for b in blocks if b.active]
    if len(active) < 2:
        return None  # no pile (read on every request: nothing of the view is needed to say so)
    placed = {b.id: k for k, b in anchors(view, active).items()}
    if ranges is None:
        ranges = [r for r in compressible(view, blocks, fold_cfg, cov) if r[3] * 4 >= fold_cfg.min_compress_chars]
    stop = min((view.pos[r[0]] for r in ranges), default=len(view.items))  # that range is a fold of its own
    run = sorted((b for b in active if b.id in placed and placed[b.id] < stop), key=lambda b: placed[b.id])
    if len(run) < 2:
        return None
    if cov is None:
        cov = coverage(active)  # (the same as the blocks': inactive blocks cover nothing)
    protected = view.protected(fold_cfg)
    lo = placed[run[0].id]
    pos = view.pos
    hi = min(stop - 1, max(pos[r] for b in run for r in b.coverage if r in pos))
    strays = sum(p.tokens for k in range(lo, hi + 1) if k not in protected
                 for p in view.items[k].parts if p.ref not in cov)
    tokens = sum(b.summary_tokens for b in run) + strays
    if tokens < (cfg.distil_along_tokens if along else cfg.distil_tokens):
        return None
    return run[0].id, run[-1].id, len(run), tokens


def decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
           last_nudge_at: int, cov: dict[str, Block] | None = None) -> str | None:
    """The reminder for this turn, or None.  ``used``: the input tokens the last answer reported;
    ``last_nudge_at``: ``used`` when the last reminder was given (lowered when the context shrank);
    ``cov``: ``coverage(blocks)``, when the caller has it."""
    urgent = window > 0 and used >= cfg.pressure * window
    if not urgent and last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
        # whatever could be folded, nothing is asked again before the context grew: the ranges are
        # not looked for (the turns after a reminder or a fold stop here).  The view's figures
        # against the coverage are kept running, for the next view to extend
        if cov:
            view.unfolded(cov)
        return None
    if cov is None:
        cov = coverage(blocks)
    least = fold_cfg.min_compress_chars
    ranges = [r for r in compressible(view, blocks, fold_cfg, cov) if r[3] * 4 >= least]
    # (no blocks, no pile: a conversation's first turns ask distillable nothing)
    distil = distillable(view, blocks, fold_cfg, cfg, ranges=ranges, cov=cov) if blocks else None
    if not ranges and not distil:
        return None
    pending = 0
    for r in ranges:
        pending += r[3]
    if not urgent and pending < cfg.batch_tokens and not distil:
        return None
    if blocks and not distil and (urgent or pending >= cfg.batch_tokens):
        distil = distillable(view, blocks, fold_cfg, cfg, along=True, ranges=ranges, cov=cov)
    if len(ranges) > 5:
        listed = sorted(ranges, key=_by_tokens)[:5]
        listed.sort(key=_by_start)
    else:  # (every range listed: by start, the ranges of one start in the order of their tokens)
        listed = sorted(ranges, key=_by_start_tokens) if len(ranges) > 1 else ranges
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


def _by_tokens(r: tuple) -> int:
    return -r[3]


def _by_start(r: tuple) -> int:
    return int(r[0][1:])


def _by_start_tokens(r: tuple) -> tuple[int, int]:
    """The order of :func:`_by_tokens` then (stably) :func:`_by_start`, in one sort."""
    return int(r[0][1:]), -r[3]


def truncations(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int,
                window: int, cov: dict[str, Block] | None = None, known: Collection[str] = ()) -> dict[str, str]:
    """Emergency: the biggest old tool outputs, cut to head and tail until the context fits again.
    ``cov``: ``coverage(blocks)``, when the caller has it; ``known``: the outputs cut before (``used``
    is the size with them cut: they are no candidates, or the cuts chosen again would be taken for
    enough, and nothing more cut as the context grows).  Only outputs the model has answered since
    (before its newest item) are cut: the newest batch of parallel results it has not read yet
    stays whole, however far it reaches past the recent zone."""
    if not rewrite.window_forces(used, window, cfg.truncate_at):  # the rewrite decision's window rule, at 95%
        return {}
    if view.sums().peak < cfg.truncate_min_tokens:
        return {}  # no part is big enough to be cut
    if cov is None:
        cov = coverage(blocks)
    protected = view.protected(fold_cfg)
    target = 0.9 * cfg.truncate_at * window
    items = view.items
    answered = next((k for k in range(len(items) - 1, -1, -1) if any(p.role == "assistant" for p in items[k].parts)), 0)
    parts = [
        p for k, it in enumerate(items[:answered]) if k not in protected
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
