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
    from bili_addon.kernel.turn import Engine

log = logging.getLogger("bili")

READ_BYTES = 65536  # of an error answer: a provider's error states what it is early
UNSTATED_SHARE = 0.9  # of a refused request's size (bili's estimate): the window an error without a number teaches


def learn_from_error(eng: Engine, sid: str, status: int, body: bytes) -> None:
    """An answer of ``status`` (an error or not) with ``body`` (as received, decoded of its
    content-encoding), for session ``sid``."""
    if status < 400:
        return
    text = body[:READ_BYTES].decode("utf-8", "replace")
    if is_overflow(status, text):
        s = eng.session(sid, fresh=True)
        window = learned_window(status, text)
        # (the refused request's size: as sent, when a fold changed it; else its conversation's)
        size = s.sent_tokens or (s.last_view.sums().tokens[-1] if s.last_view is not None and s.last_view.items else 0)
        if window is None and size:
            # an error that states no number (OpenAI's "Your input exceeds the context window"): the
            # request it refused held at least the window; a little less than its size, never more than
            # the window the session had (each such refusal lowers it: the cut and the reminders come
            # earlier, never later)
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
