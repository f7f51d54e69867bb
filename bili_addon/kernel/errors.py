"""What a provider's error answer teaches a session: its context window (a "context too long" 400 or
413 that states it) and that it wants reasoning passed back (a 400 that asks for
``reasoning_content``).  Both are session flags the next requests are rendered with, so the proxy
and ``bili replay`` learn them here, from the same bytes, or a replay's bodies would differ from
what the proxy sent after such an answer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bili_addon import printable
from bili_addon.kernel.windows import is_overflow, learned_window, window_key
from bili_addon.wire import hygiene

if TYPE_CHECKING:
    from bili_addon.kernel.state import TurnResult
    from bili_addon.kernel.turn import Engine

log = logging.getLogger("bili")

READ_BYTES = 65536  # of an error answer: a provider's error states what it is early
UNSTATED_SHARE = 0.9  # of a refused request's size (bili's estimate): the window an error without a number teaches
MIN_UNSTATED = 4096  # tokens: a refused request smaller than this teaches no window (no model's is that small)


def request_size(res: TurnResult | None) -> int:
    """A request's size in tokens as bili estimates it (what went up), from its turn's result; 0 unknown."""
    return res.sent_tokens if res is not None else 0


def learn_from_error(eng: Engine, sid: str, status: int, body: bytes, size: int = 0, side: bool = False) -> None:
    """An answer of ``status`` (an error or not) with ``body`` (as received, decoded of its
    content-encoding), for session ``sid``; ``size``: the refused request's (:func:`request_size`),
    ``side``: it was a side request (``TurnResult.side``)."""
    if status < 400:
        return
    text = body[:READ_BYTES].decode("utf-8", "replace")
    if is_overflow(status, text):
        s = eng.session(sid, fresh=True)
        window = learned_window(status, text)
        if window is None and status == 400 and not side and size >= MIN_UNSTATED:
            # a 400 that states no number (OpenAI's "Your input exceeds the context window"): the request
            # it refused held at least the window; a little less than its size, never more than the
            # window the session had (each such refusal lowers it: the cut and the reminders come
            # earlier, never later).  Not a 413: Anthropic's ``request_too_large`` is its limit on bytes
            # (screenshots, PDFs), not on tokens
            window = min(eng.window_for(s), int(size * UNSTATED_SHARE))
        if window and s.model:
            learned = dict(s.flags.get("learned_windows", {}))
            learned[window_key(s)] = window
            eng.set_flag(sid, "learned_windows", learned)
        log.warning("[bili] session=%s: the provider says the context is too long (window %s for %s)",
                    printable(sid), window or "unknown", printable(s.model or "this model"))
    if status == 400 and hygiene.is_strict_hint(text):
        eng.session(sid, fresh=True)
        if eng.set_flag(sid, "strict_reasoning", True):
            log.warning("[bili] session=%s: upstream requires reasoning to be passed back; repairing from the next turn",
                        printable(sid))
