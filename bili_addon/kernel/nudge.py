"""When the context fills up: a reminder to fold, and the last safety valve before the window.

Both are remembered per ref once applied, so a message that carried a nudge or a truncation keeps
the very same bytes on every later turn (the prefix cache never sees them change).
"""

from __future__ import annotations

from dataclasses import dataclass

from bili_addon.kernel.fold import Block, FoldConfig, View, coverage
from bili_addon.kernel.tags import format_tokens
from bili_addon.wire.base import TOOL_RESULT


@dataclass
class NudgeConfig:
    threshold: float = 0.5  # share of the window from which reminders start
    pressure: float = 0.75  # from here on, a reminder every turn while something can be folded
    growth: float = 0.1  # below pressure: a new reminder only after this share of the window was added
    min_growth_tokens: int = 20_000
    truncate_at: float = 0.95  # emergency truncation of old tool outputs from this share on
    truncate_min_tokens: int = 1000
    keep_chars: int = 2000  # head and tail kept of a truncated output


def compressible(view: View, blocks: list[Block], cfg: FoldConfig) -> list[tuple[str, str, int, int]]:
    """``(start ref, end ref, items, tokens)`` runs of unfolded items outside the protected zone."""
    cov = coverage(blocks)
    protected = view.protected(cfg)
    runs: list[list[int]] = [[]]
    for k, it in enumerate(view.items):
        if it.parts and k not in protected and not all(r in cov for r in it.refs):
            runs[-1].append(k)
        elif runs[-1]:
            runs.append([])
    out = []
    for run in runs:
        refs = [r for k in run for r in view.items[k].refs if r not in cov]
        if refs:
            tokens = sum(p.tokens for k in run for p in view.items[k].parts if p.ref not in cov)
            out.append((refs[0], refs[-1], len(run), tokens))
    return out


def decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
           last_nudge_at: int) -> str | None:
    """The reminder for this turn, or None. ``used``: the input tokens the last answer reported."""
    if window <= 0 or used < cfg.threshold * window:
        return None
    ranges = [r for r in compressible(view, blocks, fold_cfg) if r[3] * 4 >= fold_cfg.min_compress_chars]
    if not ranges:
        return None
    grew = used - last_nudge_at >= max(cfg.min_growth_tokens, cfg.growth * window)
    if used < cfg.pressure * window and last_nudge_at and not grew:
        return None
    listed = sorted(ranges, key=lambda r: -r[3])[:5]
    listed.sort(key=lambda r: int(r[0][1:]))
    lines = [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in listed]
    urgent = used >= cfg.pressure * window
    head = (
        "[bili] The context is nearly full: fold consumed work now, oldest first."
        if urgent
        else "[bili] The context is filling up. If these ranges hold work you no longer need verbatim, fold them:"
    )
    return "\n".join([
        head,
        *lines,
        "Call compress once with one entry per range (startId, endId, summary). Keep paths, names, values, "
        "errors, decisions and open tasks in the summaries.",
    ])


def truncations(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int,
                window: int) -> dict[str, str]:
    """Emergency: the biggest old tool outputs, cut to head and tail until the context fits again."""
    if window <= 0 or used < cfg.truncate_at * window:
        return {}
    cov = coverage(blocks)
    protected = view.protected(fold_cfg)
    target = 0.9 * cfg.truncate_at * window
    parts = [
        p for k, it in enumerate(view.items) if k not in protected
        for p in it.parts
        if p.ctype == TOOL_RESULT and p.ref not in cov and p.tokens >= cfg.truncate_min_tokens
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
