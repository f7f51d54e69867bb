"""Lazy activation: a session carries nothing of bili until folding is about to pay.

Tools, the compression prompt and the ``<acp>`` tags cost every request they ride on (about 1K
tokens, written once and read on every turn), and most agent sessions are short: they never get to a
fold.  So a session starts *inactive*: the ledger records every message (as in observe mode) and the
body is forwarded as the agent sent it (wire hygiene aside).  It becomes active, for good (the tools
never flicker: that would rewrite the cache each time), at the first of:

- a fold exists already (a native MCP compress, or a call the model made anyway);
- the foldable work passes the reminder threshold (``bili_remind_at``): the reminder goes out in the
  very request that brings the tools;
- the window is filling (the nudge's pressure share);
- a cold moment: the session's cache has expired (the clock says so), so the next request is
  written in full anyway, and there is already half a threshold of foldable work.

Bringing the tools in rewrites the whole prompt, so this is a rewrite like any other
(:mod:`~bili_addon.kernel.rewrite`): its cold and window rules are that module's; its "pays" rule is
the reminder threshold, since the tools pay only through the folds they make possible.

``bili_activate=always`` restores injection from the first turn.
"""

from __future__ import annotations

from typing import Callable

from bili_addon.kernel import nudge, rewrite
from bili_addon.kernel.fold import FoldConfig, View
from bili_addon.kernel.state import Session

MODES = ("lazy", "always")
FLAG = "active"  # the session flag: why it became active


def decide(s: Session, view: View, fold_cfg: FoldConfig, cfg: nudge.NudgeConfig, window: int,
           cold: Callable[[], bool]) -> str | None:
    """Why the (inactive) session becomes active with this request, or None (it stays inactive).
    ``cold``: whether the session's cache has expired (asked only when it matters)."""
    if s.blocks or any(c.result is not None for c in s.calls.values()):
        return "folds"
    total = sum(it.tokens for it in view.items)
    if rewrite.window_forces(total, window, cfg.pressure):  # the rewrite decision's window rule
        return "pressure"
    threshold = cfg.batch_tokens
    floor = threshold // 2
    if total < floor:
        return None  # cheap: not even the whole conversation is that much
    pending = sum(r[3] for r in nudge.compressible(view, s.blocks, fold_cfg)
                  if r[3] * 4 >= fold_cfg.min_compress_chars)
    if pending >= threshold:
        return "threshold"
    if pending >= floor and cold():
        return "cold"
    return None
