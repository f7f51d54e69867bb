"""Which conversation a request belongs to.

The session id is the agent's own conversation id, taken verbatim.  Requests that carry none are
matched by a progressive hash of their normalised history (``PrefixAffinity``), so a replay after a
restart re-attaches and two conversations that share only a preamble never share state.
Environment (system prompt, tools, model) is never part of identity.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterable, Mapping

import blake3
import msgspec

# conversation headers, first non-empty wins
SESSION_HEADERS = (
    "x-acp-session",
    "x-claude-code-session-id",
    "x-session-affinity",
    "x-session-id",
    "x-opencode-session",
    "session-id",
    "session_id",
)

# prompt_cache_key values that are content hashes, not conversation ids (hermes: pck_ + sha256)
_CONTENT_KEYED_CACHE_KEY_PREFIXES = ("pck_",)

MIN_CANONICAL_BYTES = 24
_HEADER_SOURCES = {name: f"header:{name}" for name in SESSION_HEADERS}


def _header(headers: Mapping[str, str], name: str) -> str:
    v = headers.get(name)
    return v.strip() if isinstance(v, str) else ""


def codex_thread(headers: Mapping[str, str]) -> str | None:
    """Codex internal threads (subagents, reviews, ...) get their own state, keyed by thread id."""
    meta = _header(headers, "x-codex-turn-metadata")
    thread = _header(headers, "thread-id")
    if not meta or not thread:
        return None
    try:
        data = json.loads(meta)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    source, tid = data.get("thread_source"), data.get("thread_id")
    if not isinstance(source, str) or source == "user" or tid != thread:
        return None
    return thread


# Claude Code's subagents (its Agent tool) send their own conversations under their parent's session id;
# their requests carry the agent's id (or its parent's) in these headers, and a system prompt not the main
# agent's (which opens with one of these words: its main thread may carry the headers too)
CLAUDE_AGENT_HEADERS = ("x-claude-code-agent-id", "x-claude-code-parent-agent-id")
_CLAUDE_MAIN = ("You are Claude Code", "You are an interactive agent")


def claude_agent(headers: Mapping[str, str]) -> str:
    """The Claude Code agent id a request names (its own, else its parent's), or ''."""
    for name in CLAUDE_AGENT_HEADERS:
        v = _header(headers, name)
        if v and "\0" not in v:
            return v
    return ""


def claude_subagent(agent: str, system: Any) -> str | None:
    """The session key suffix of a Claude Code subagent's request (``agent``: :func:`claude_agent`;
    ``system``: the body's decoded ``system``), or None for the main agent's: a subagent's
    conversation is not its parent's (under the parent's id, its turns would be taken for a
    history that matches none of the parent's folds)."""
    if not agent:
        return None
    texts = [system] if isinstance(system, str) else [
        b.get("text") for b in system if isinstance(b, dict)] if isinstance(system, list) else []
    if any(isinstance(t, str) and t.strip().startswith(_CLAUDE_MAIN) for t in texts):
        return None
    return f"|sub:{agent}"


def session_from_request(headers: Mapping[str, str], top: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(session_id, source)`` from the agent's own ids, or None for an anonymous request.

    ``top`` is the decoded top-level body (only small scalar fields are read).  An id holding a NUL
    character is no id (the next source is read): PostgreSQL cannot store it, and libpq would cut it
    there, so ``"a\\u0000b"`` would have been read and written as session ``a`` (another one's).
    """
    get = headers.get  # (every turn: the headers read as ``_header`` reads them, without a call each)
    if get("x-codex-turn-metadata") is not None:  # (else codex_thread finds no thread)
        thread = codex_thread(headers)
        if thread:
            return thread, "codex-thread"
    for name in SESSION_HEADERS:
        v = get(name)
        if isinstance(v, str):
            v = v.strip()
            if v and "\0" not in v:
                return v, _HEADER_SOURCES[name]
    sid = top.get("session_id")
    if isinstance(sid, str) and sid.strip() and "\0" not in sid:
        return sid.strip(), "body:session_id"
    meta = top.get("metadata")
    if isinstance(meta, dict):
        if isinstance(meta.get("session_id"), str) and meta["session_id"].strip() and "\0" not in meta["session_id"]:
            return meta["session_id"].strip(), "body:metadata.session_id"
        uid = meta.get("user_id")
        if isinstance(uid, str) and uid.startswith("{"):
            try:
                inner = json.loads(uid)
            except ValueError:
                inner = None
            if (isinstance(inner, dict) and isinstance(inner.get("session_id"), str) and inner["session_id"]
                    and "\0" not in inner["session_id"]):
                return inner["session_id"], "body:metadata.user_id"
    pck = top.get("prompt_cache_key")
    if (isinstance(pck, str) and pck.strip() and not pck.startswith(_CONTENT_KEYED_CACHE_KEY_PREFIXES)
            and "\0" not in pck):
        return pck.strip(), "body:prompt_cache_key"
    return None


def agent_of(headers: Mapping[str, str]) -> str:
    """A best-effort label for stats and logs; never used for identity."""
    ua = _header(headers, "user-agent").lower()
    if "claude-cli" in ua or "claude-code" in ua:
        return "claude-code"
    if "codex" in ua:
        return "codex"
    originator = _header(headers, "originator")  # (read once: both checks below ask for it)
    if originator.startswith("codex"):
        return "codex"
    if ua.startswith("opencode") or originator == "opencode":
        return "opencode"
    if ua.startswith("omp/"):
        return "omp"
    if "/python" in ua:
        return "python-sdk"
    if "/js" in ua:
        return "js-sdk"
    return ua.split("/", 1)[0] if ua else "unknown"


# -- anonymous prefix affinity -----------------------------------------------------------------

_canon_enc = msgspec.json.Encoder(order="sorted")
_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def _normalise(v: Any) -> Any:
    if isinstance(v, dict):
        # a tool result's ``name`` is dropped by some hosts on re-send (hermes); the call id pairs it
        drop = ("cache_control", "name") if v.get("role") == "tool" else ("cache_control",)
        out = {k: _normalise(x) for k, x in v.items() if k not in drop}
        if isinstance(out.get("type"), str) and out["type"] in _TEXT_PART_TYPES:
            out["type"] = "text"
        c = out.get("content")
        if isinstance(c, str):
            out["content"] = [{"type": "text", "text": c}]
        return out
    if isinstance(v, list):
        return [_normalise(x) for x in v]
    return v


def canonical_item(obj: Any) -> bytes:
    """Transport hints removed (``cache_control``, a tool result's ``name``), string content == one
    text part, keys sorted."""
    return _canon_enc.encode(_normalise(obj))


def chain(canon_items: Iterable[bytes], prev: bytes = b"") -> list[str]:
    """Progressive hashes: ``h_i = H(h_{i-1} || 0 || canon_i)``; hex digests, one per item
    (``prev``: the digest the chain continues from).  BLAKE3: on the items of real agents' requests
    it beats SHA-256 (``scripts/bench_hash.py``: large tool outputs dominate)."""
    out: list[str] = []
    for c in canon_items:
        prev = blake3.blake3(prev + b"\x00" + c).digest()
        out.append(prev.hex())
    return out


def new_anonymous_id(tail: str, depth: int, fork: int = 0) -> str:
    seed = f"{tail}\x00{depth}" + (f"\x00{fork}" if fork else "")
    return "pfa-" + hashlib.sha256(seed.encode()).hexdigest()[:16]  # short input: SHA-256 is the faster here


class PrefixAffinity:
    """Anonymous conversations by the hash chain of their history.

    Each session remembers the tail hash of its latest request.  A request belongs to the session
    whose remembered tail equals the request's own chain hash at that depth (the deepest wins);
    failing that, to the session one of whose earlier points it continues, where verified
    (:meth:`locate`; the store keeps every point).
    A request that extends nothing known starts a session whose id is derived from its own chain,
    so an identical replay after a restart lands in the same place.
    """

    def __init__(self, rows: Iterable[tuple[str, int, str]] = ()):
        self.by_tail: dict[str, tuple[str, int]] = {}
        self.by_session: dict[str, str] = {}
        for sid, depth, tail in rows:
            self.note(sid, depth, tail)

    def match(self, hashes: list[str]) -> str | None:
        hit = self._tail(hashes)
        return hit[0] if hit is not None else None

    def _tail(self, hashes: list[str]) -> tuple[str, int] | None:
        for depth in range(len(hashes), 0, -1):
            hit = self.by_tail.get(hashes[depth - 1])
            if hit is not None and hit[1] == depth:
                return hit
        return None

    def resolve(self, hashes: list[str]) -> str:
        """The session a history belongs to, or the id of the new one it starts.

        A new id is derived from the history itself, so an identical replay lands in the same
        place; when that id already belongs to a conversation that has moved on (another
        conversation opened with the very same words), the new one takes the next free fork id.
        """
        return self.locate(hashes)[0]

    def locate(self, hashes: list[str], points: Callable[[list[str]], dict] | None = None,
               verified: Callable[[int], bool] | None = None,
               taken: Callable[[str], bool] | None = None) -> tuple[str, int]:
        """``(session, depth of the history it already had)``; depth 0: a new session.

        A request that extends no session's latest tail may go back to an earlier point of one
        (the agent dropped a turn, or returned to another branch): ``points(hashes)`` gives the
        recorded points among the request's chain (``{hash: [(session, depth), ...]}``), and the
        deepest one counts only where ``verified(depth)`` holds, i.e. the shared history says more
        than an opening two conversations may have in common.  ``taken(sid)``: whether a session of
        that id exists where this process did not see it (another process on the store): a new id
        derived from the history is then another conversation's, and the next fork id is taken.
        """
        hit = self._tail(hashes)
        if hit is not None:
            return hit
        if points is not None:
            found = points(hashes)
            for depth in range(len(hashes), 0, -1):
                here = [sid for sid, d in found.get(hashes[depth - 1], ()) if d == depth]
                if here:
                    if verified is not None and not verified(depth):
                        break  # a shallower point shares even less
                    return here[0], depth
        tail, depth = hashes[-1], len(hashes)
        fork = 0
        while True:
            sid = new_anonymous_id(tail, depth, fork)
            known = self.by_session.get(sid)
            if known == tail or (known is None and (taken is None or not taken(sid))):
                return sid, 0
            fork += 1

    def note(self, session_id: str, depth: int, tail: str) -> None:
        old = self.by_session.get(session_id)
        if old is not None and old != tail:
            cur = self.by_tail.get(old)
            if cur is not None and cur[0] == session_id:
                del self.by_tail[old]
        self.by_session[session_id] = tail
        self.by_tail[tail] = (session_id, depth)
