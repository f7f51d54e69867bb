"""Which conversation a native tool call came from (``bili mcp`` started without a conversation).

An agent that has bili's tools natively (its MCP server: ``mcp__bili__compress``, opencode's
``bili_compress``) runs them through ``POST /__bili/plugin/tool``, which names no conversation unless
the server was started with one.  The call itself went through the proxy first: the model made it in
an answer bili read on its way to the agent, before the agent could run it.  The answer's reader
notes each such call with its conversation (:meth:`NativeCalls.note`, on the event loop), and the
plugin call takes the conversation whose answer made exactly that call (:meth:`NativeCalls.take`,
on the store's worker): the same tool with the same arguments, not run yet; and the call's own id,
which a fold made by it keeps as its block's (a fork inherits the fold only when its history holds
that call, as for a fold made on the wire: kernel/lineage.py).  Two conversations
that made the same call, or none that did, is no answer: the call is refused, never guessed (the
most recent conversation was another agent's as often as not, and its refs are valid there too).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec

from bili_addon.kernel.prompts import TOOL_NAMES

KEEP_SECONDS = 600.0  # a noted call not run within this is forgotten
MAX_CALLS = 512

_enc = msgspec.json.Encoder(order="sorted")
_dec = msgspec.json.Decoder()


def bili_tool(name: Any) -> str | None:
    """The bili tool a native tool name stands for (``mcp__bili__compress`` -> ``compress``), else None."""
    if not isinstance(name, str) or "bili" not in name.lower():
        return None
    for tool in TOOL_NAMES:
        if name.endswith(tool) and len(name) > len(tool) and not name[-len(tool) - 1].isalnum():
            return tool
    return None


def canonical(args: Any) -> bytes | None:
    """Arguments as one text, whatever their key order or spacing (a JSON text is read first)."""
    try:
        if isinstance(args, (str, bytes)):
            args = _dec.decode(args) if args else {}
        return _enc.encode({} if args is None else args)
    except (msgspec.DecodeError, TypeError, ValueError):
        return None


class NativeCalls:
    """The native calls answers made, not run yet: ``(tool, arguments)`` -> the conversations."""

    def __init__(self, clock=time.monotonic):
        self._calls: deque[tuple[float, str, str, bytes, str]] = deque()  # (when, session, tool, arguments, id)
        self._lock = threading.Lock()
        self._clock = clock

    def note(self, sid: str, name: Any, args: Any, call_id: str = "") -> None:
        tool, text = bili_tool(name), canonical(args)
        if not sid or tool is None or text is None:
            return
        with self._lock:
            self._expire()
            self._calls.append((self._clock(), sid, tool, text, call_id))
            while len(self._calls) > MAX_CALLS:
                self._calls.popleft()

    def take(self, tool: str, args: Any) -> tuple[str, str]:
        """``(the conversation whose answer made this call, the call's id)``; the call is then no
        longer waiting.  LookupError when none did, or more than one did."""
        text = canonical(args)
        with self._lock:
            self._expire()
            found = [c for c in self._calls if c[2] == tool and c[3] == text]
            sids = {c[1] for c in found}
            if len(sids) == 1:  # (the newest: an older one the agent answered without running it is gone by now)
                self._calls.remove(found[-1])
                return found[-1][1], found[-1][4]
        if not sids:
            raise LookupError(f"no conversation through this proxy made this {tool} call; start `bili mcp` "
                              "with --conversation ID (or $BILI_CONVERSATION_ID) to name the conversation")
        raise LookupError(f"{len(sids)} conversations made this same {tool} call; start `bili mcp` with "
                          "--conversation ID (or $BILI_CONVERSATION_ID) to name the conversation")

    def answered(self, sid: str, ids) -> None:
        """A request of ``sid`` carries the results of its calls with these ``ids``: the agent is done
        with them, run or not (a call the user declined, or one the agent may not run, is answered
        without running).  Their notes go: such a note would take another conversation's same call
        (one whose answer this proxy did not read), or give a later run of the same call this one's id
        (a fork would then inherit a fold made after it split, kernel/lineage.py)."""
        if not self._calls:
            return
        with self._lock:
            mine = {c[4] for c in self._calls if c[1] == sid and c[4]}
            if not mine:
                return
            done = mine.intersection(ids)
            if done:
                self._calls = deque(c for c in self._calls if not (c[1] == sid and c[4] in done))

    def waiting(self, sid: str) -> bool:
        """Whether a call of ``sid`` with an id is noted (the engine then reads its request's results).
        Read under the lock: the event loop notes calls while the store's worker runs turns."""
        if not self._calls:
            return False
        with self._lock:
            return any(c[1] == sid and c[4] for c in self._calls)

    def _expire(self) -> None:
        limit = self._clock() - KEEP_SECONDS
        calls = self._calls
        while calls and calls[0][0] < limit:
            calls.popleft()


__all__ = ["NativeCalls", "bili_tool", "canonical"]
