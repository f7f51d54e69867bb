"""Server-side chains (Responses ``previous_response_id``): deltas in, folds out.

An agent that chains its turns on the provider (omp's built-in OpenAI transport with ``store: true``,
codex over its WebSocket with ``store: false``) sends only the new items of each turn plus the id of
the response they follow.  bili keeps its own transcript of such sessions: for every response that
came back, the conversation as of that response, twice:

- the **agent's view** (``A``): what the agent believes the conversation is (its own input items,
  as it sent them, and the outputs that came back) -- the kernel's ledger and folds work on it;
- the **provider's view** (``U``): what the provider's chain holds under that id (the input items
  bili sent, tagged and folded, and the same outputs).

A request that continues a chain is rebuilt into a full body (``A(prev)`` + its new items, no
``previous_response_id``) for the normal pass; :meth:`Turn.outgoing` then compares the pass's
rendered input with ``U(prev)``: when the history already sent is unchanged (the provider's outputs
count as unchanged when they differ only by bili's own tag), the rendered delta goes up with the
agent's ``previous_response_id`` (the agent's own bytes when nothing changed); otherwise (a fold
landed, a truncation, activation) the whole rendered input goes up without one, and the provider's
new response id (which the agent sees) starts the provider's chain afresh.  A chain the transcript
cannot rebuild (it began before bili, or the store lost it) passes through observed; nothing is
guessed.

Each view is stored as ``keep`` items of a base response's view, then items of its own, then the
outputs: one row per response (table ``chains``), written when its answer completed, so a restart
finds every chain again.  ``store: false`` responses live on one upstream connection only: a delta
goes up on them only from the connection that made them, and only for the newest response there.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bili_addon import printable
from bili_addon.kernel import envelope, tags
from bili_addon.kernel.state import clean_replayed_prose

log = logging.getLogger("bili")

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_dec_top = msgspec.json.Decoder(dict[str, msgspec.Raw])
_dec_items = msgspec.json.Decoder(list[msgspec.Raw])
CACHE = 32  # rebuilt conversations kept in memory (response id -> both views; their items shared)
SESSIONS = 256  # sessions whose newest response's views are kept (the base of their next full-history row)
PREV = "previous_response_id"
ENVELOPE = envelope.FIELD


class Link(msgspec.Struct, gc=False):
    """One stored response: both views as ``base[:keep] + items + output``."""

    id: str
    session: str
    conn: str  # the connection key it was made on ('' for HTTP)
    stored: bool  # made with ``store`` not false: the provider keeps it for any connection
    agent_base: str  # '' none
    agent_keep: int
    agent: list[bytes]
    sent_base: str
    sent_keep: int
    sent: list[bytes] | None  # None: the same items as ``agent`` over the same base
    output: list[bytes]
    created: float = 0.0
    owner: str = ""  # who may chain on it: the host and credential it was made with (:func:`owner_of`)


@dataclass
class Views:
    """A response's conversation: the agent's items, the provider's items, and which of the
    provider's items are outputs (compared tolerantly: bili's tag may be added to them)."""

    agent: list[bytes]
    sent: list[bytes]
    outputs: frozenset[int]
    owner: str = ""  # the owner of the response they are the views of (checked when its row is not read)
    conn: str = ""  # its connection ('' HTTP)


@dataclass
class Turn:
    """One request of a Responses conversation, from :meth:`Chains.begin` to :meth:`Chains.record`.

    ``body`` is what the kernel's normal pass gets (the full conversation, no
    ``previous_response_id``); ``known`` is False when the agent continues a chain the transcript
    cannot rebuild (the caller then forwards the agent's bytes, observed only)."""

    raw: bytes
    body: bytes
    prev: str
    known: bool
    conn: str
    stored: bool
    agent_items: list[bytes]
    base: Views | None = None  # the views of ``prev``
    chainable: bool = False  # a delta on ``prev`` is valid upstream from this connection
    session: str = ""
    sent_prev: str = ""  # what went up: the previous_response_id bili sent ('' none) ...
    sent_items: list[bytes] | None = None  # ... and the input items it sent (None: not decided)
    mode: str = ""  # "delta" | "full" | "passthrough" | "observed" (for logs and tests)
    full_sent: bytes | None = None  # the whole conversation as the provider holds it after this request
    response_id: str = ""
    output: list[bytes] = field(default_factory=list)
    _items_done: dict[int, bytes] = field(default_factory=dict)
    finished: bool = False
    failed: bool = False
    owner: str = ""  # the host and credential of the request (:func:`owner_of`)

    # -- the way up ------------------------------------------------------------------------------
    def outgoing(self, rendered: bytes | None, *, rewrite: bool = True) -> bytes | None:
        """The bytes to send upstream, given the normal pass's output for :attr:`body` (None: the
        pass left ``body`` unchanged).  Returns None when the agent's own bytes go up unchanged.
        ``rewrite=False`` (observe mode): the agent's bytes always go up as they came."""
        if not self.prev:  # the agent sent its whole conversation: nothing to decide
            self.mode = "full"
            self.sent_items = _input_items(rendered if rendered is not None else self.raw)
            return rendered
        if not self.known:  # the pass ran on the agent's body as it came
            self.mode = "passthrough"
            return rendered
        if not rewrite:
            self.mode, self.sent_prev, self.sent_items = "observed", self.prev, list(self.agent_items)
            top = _dec_top.decode(self.raw)
            if top.pop(ENVELOPE, None) is None:
                return None
            return _enc.encode(top)  # only bili's own envelope removed
        full = self.full_sent = rendered if rendered is not None else self.body
        top = _dec_top.decode(full)
        items = _input_items(full)
        base = self.base
        assert base is not None
        n = len(base.sent)
        if self.chainable and len(items) >= n and all(
            _same(items[i], base.sent[i], i in base.outputs) for i in range(n)
        ):
            delta = items[n:]
            self.mode, self.sent_prev, self.sent_items = "delta", self.prev, delta
            agent_top = _dec_top.decode(self.raw)
            if delta == self.agent_items and all(
                bytes(agent_top.get(k, b"")) == bytes(v) for k, v in top.items() if k != "input"
            ) and len(top) + 1 == len(agent_top):
                return None  # the agent's own bytes, byte for byte
            out: dict[str, msgspec.Raw] = {}
            for k, v in agent_top.items():  # the agent's key order; the pass's values (bili's envelope goes)
                if k == "input":
                    out[k] = msgspec.Raw(b"[" + b",".join(delta) + b"]")
                elif k == PREV:
                    out[k] = v
                elif k in top:
                    out[k] = top[k]
            out.setdefault("input", msgspec.Raw(b"[" + b",".join(delta) + b"]"))
            for k, v in top.items():  # keys the pass added
                if k not in out:
                    out[k] = v
            return _enc.encode(out)
        self.mode, self.sent_prev, self.sent_items = "full", "", items
        return full

    def prompt(self) -> bytes | None:
        """The whole prompt the provider reads for this turn (None: the bytes that went up are it):
        :attr:`full_sent`, or, when the agent's delta went up on its chain (observe mode, fail
        open), the chain's history as the provider holds it plus that delta."""
        if self.full_sent is not None:
            return self.full_sent
        if not self.sent_prev or self.base is None or self.sent_items is None:
            return None
        top = _dec_top.decode(self.body)
        top["input"] = msgspec.Raw(_pack(self.base.sent + self.sent_items))
        return _enc.encode(top)

    def forwarded(self) -> None:
        """The pass failed and the agent's bytes went up unchanged (fail open)."""
        self.sent_prev, self.sent_items = self.prev, list(self.agent_items)
        self.mode = self.mode or "failopen"

    # -- the way back ----------------------------------------------------------------------------
    def observe(self, obj: Any) -> None:
        """One decoded event of the answer (an SSE ``data`` object or a WebSocket frame) or the
        whole JSON answer, as the provider sent it (before any rewriting)."""
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if obj.get("object") == "response" and "output" in obj:  # a whole (non-streamed) answer
            self._final(obj)
            return
        if not isinstance(kind, str) or not kind.startswith(("response.", "error")):
            return
        if kind in ("response.created", "response.in_progress"):
            r = obj.get("response")
            if isinstance(r, dict) and isinstance(r.get("id"), str):
                self.response_id = r["id"]
        elif kind == "response.output_item.done":
            i, item = obj.get("output_index"), obj.get("item")
            if isinstance(i, int) and isinstance(item, dict):
                self._items_done[i] = _enc.encode(item)
        elif kind in ("response.completed", "response.incomplete"):
            r = obj.get("response")
            if isinstance(r, dict):
                self._final(r)
        elif kind in ("response.failed", "error"):
            self.failed = True

    def _final(self, r: dict) -> None:
        if isinstance(r.get("id"), str):
            self.response_id = r["id"]
        if r.get("status") not in (None, "completed", "incomplete") or r.get("error"):
            self.failed = True  # failed, cancelled, or not done yet (background): nothing to chain on
        out = r.get("output")
        if isinstance(out, list) and out:
            self.output = [_enc.encode(x) for x in out]
        else:  # some servers stream the items only
            self.output = [self._items_done[i] for i in sorted(self._items_done)]
        self.finished = True


class Chains:
    """The transcript of server-side chains over a store (see the module's docstring)."""

    def __init__(self, store: Any):
        self.store = store
        self._views: OrderedDict[str, Views] = OrderedDict()
        # session -> its newest response id and views (full-history bases: kept apart from the
        # cache, which more live sessions than it holds would empty before each one's next turn)
        self._last_of_session: OrderedDict[str, tuple[str, Views]] = OrderedDict()
        self._last_on_conn: dict[str, str] = {}  # connection -> its newest response id (store: false)

    # -- a request ------------------------------------------------------------------------------
    def begin(self, raw: bytes, conn: str = "", owner: str = "") -> Turn | None:
        """A Responses request body as the agent sent it, its connection key (the WebSocket's; ''
        for HTTP) and its owner (:func:`owner_of`).  None: not a body this handles (not a JSON
        object).  A chain made by another owner is not rebuilt: the provider scopes response ids to
        the host and credential, and so does the transcript (one store may serve a whole team)."""
        try:
            top = _dec_top.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        prev_raw = top.get(PREV)
        prev = _dec.decode(prev_raw) if prev_raw is not None else None
        stored = _dec.decode(top["store"]) is not False if "store" in top else True
        agent_items = _input_items(raw, top)
        conversation = top.get("conversation")
        if conversation is not None and bytes(conversation).strip() != b"null":
            # the Conversations API: the server appends each request's items to the conversation it
            # keeps, so a body holds only its new items (as a chain's delta does), and whatever bili
            # added would be appended to it again on every turn: passed through, observed
            return Turn(raw, raw, prev if isinstance(prev, str) else "", False, conn, stored, agent_items, owner=owner)
        if not isinstance(prev, str) or not prev:
            return Turn(raw, raw, "", True, conn, stored, agent_items, owner=owner)
        link = self._link(prev)
        if link is not None and link.owner != owner and not (conn and link.conn == conn):
            log.warning("[bili] chain %s was made with another host or credential: passed through observed",
                        printable(prev))
            return Turn(raw, raw, prev, False, conn, stored, agent_items, owner=owner)
        base = self.views(prev)
        if base is None or (link is None and base.owner != owner and not (conn and base.conn == conn)):
            # (unknown; or views kept in memory whose row was not read: their owner checked as the row's)
            return Turn(raw, raw, prev, False, conn, stored, agent_items, owner=owner)
        chainable = link is not None and (
            link.stored or (bool(conn) and link.conn == conn and self._last_on_conn.get(conn) == prev)
        )
        full: dict[str, msgspec.Raw] = {}
        for k, v in top.items():
            if k in (PREV, ENVELOPE):  # vouched ids name the delta's items only: not used for the whole
                continue
            full[k] = msgspec.Raw(b"[" + b",".join(base.agent + agent_items) + b"]") if k == "input" else v
        if "input" not in full:
            full["input"] = msgspec.Raw(b"[" + b",".join(base.agent) + b"]")
        return Turn(raw, _enc.encode(full), prev, True, conn, stored, agent_items, base, chainable, owner=owner)

    # -- its answer -----------------------------------------------------------------------------
    def record(self, turn: Turn, session: str = "") -> bool:
        """Store the turn's response (after its answer completed).  False when there is nothing to
        keep: no id, a failed answer, an unknown chain, or ``store: false`` without a connection."""
        if not turn.finished or turn.failed or not turn.response_id or not turn.known or turn.sent_items is None:
            return False
        if not turn.stored and not turn.conn:
            return False  # nothing can chain on it
        session = session or turn.session
        output = [_normal_output(o, turn.stored) for o in turn.output]
        if turn.prev:
            assert turn.base is not None
            a_base, a_keep, agent = turn.prev, len(turn.base.agent), turn.agent_items
            a_full = turn.base.agent + agent
        else:
            a_base, a_keep, agent, a_full = self._compress(session, turn.agent_items, "agent")
        if turn.sent_prev:
            assert turn.base is not None
            s_base, s_keep, sent = turn.sent_prev, len(turn.base.sent), turn.sent_items
            s_full = turn.base.sent + sent
            s_outputs = set(turn.base.outputs)
        else:
            s_base, s_keep, sent, s_full = self._compress(session, turn.sent_items, "sent")
            s_outputs = set(self._outputs_of(session, s_base, s_keep))
        same = sent == agent and s_base == a_base and s_keep == a_keep
        link = Link(turn.response_id, session, turn.conn, turn.stored, a_base, a_keep, agent,
                    s_base, s_keep, None if same else sent, output, owner=turn.owner)
        had = self._link(turn.response_id)
        if had is None and not self.store.save_chain(_row(link)):
            # another process wrote this id meanwhile: the same response, or a second conversation
            had = self._link(turn.response_id) or Link(turn.response_id, "", "", False, turn.response_id, 0, [],
                                                       turn.response_id, 0, None, [])
        if had is not None:  # an id is written once: given again, it names two conversations
            if had.agent_base != had.id and _row(had)[:-1] == _row(link)[:-1]:
                return True  # the same response recorded again
            self._ambiguous(turn.response_id)
            return False
        n = len(s_full)
        views = Views(a_full + output, s_full + output, frozenset(s_outputs | set(range(n, n + len(output)))),
                      turn.owner, turn.conn)
        self._remember(turn.response_id, views)
        if session:
            self._last_of_session[session] = (turn.response_id, views)
            self._last_of_session.move_to_end(session)
            while len(self._last_of_session) > SESSIONS:
                self._last_of_session.popitem(last=False)
        if turn.conn:
            self._last_on_conn[turn.conn] = turn.response_id
        return True

    def _ambiguous(self, rid: str) -> None:
        """``rid`` was given to two different responses (a server that numbers them): it is
        stored as a tombstone (its own base: :meth:`views` finds a cycle), so no delta on it, in any
        process, is rebuilt with either conversation; they pass through observed."""
        log.warning("[bili] chain %s: the server gave this response id twice; chains on it pass observed",
                    printable(rid))
        self._views.pop(rid, None)
        for session in [k for k, (r, _v) in self._last_of_session.items() if r == rid]:
            del self._last_of_session[session]  # its next row is not based on the tombstone
        self.store.save_chain(_row(Link(rid, "", "", False, rid, 0, [], rid, 0, None, [])), replace=True)

    def forget(self, sessions=(), ids=()) -> None:
        """Retention removed these sessions' rows, or these rows: nothing here may stand for them
        (a next row based on a removed one could not be rebuilt)."""
        gone = set(ids)
        for s in sessions:
            self._last_of_session.pop(s, None)
        for s in [k for k, (r, _v) in self._last_of_session.items() if r in gone]:
            del self._last_of_session[s]
        for rid in gone:
            self._views.pop(rid, None)
        for c in [c for c, r in self._last_on_conn.items() if r in gone]:
            del self._last_on_conn[c]

    def end(self, conn: str) -> None:
        """The connection ``conn`` closed: nothing can chain on its ``store: false`` responses any more."""
        self._last_on_conn.pop(conn, None)

    # -- the transcript -------------------------------------------------------------------------
    def views(self, rid: str) -> Views | None:
        """Both views of the conversation as of response ``rid``; None when it cannot be rebuilt."""
        got = self._views.get(rid)
        if got is not None:
            self._views.move_to_end(rid)
            return got
        # build the bases first (iteratively: chains get long; a cycle or a gap: unknown)
        built: dict[str, Views] = {}
        links: dict[str, Link] = {}
        stack = [rid]
        while stack:
            cur = stack[-1]
            if cur in built or cur in self._views:
                stack.pop()
                continue
            link = links.get(cur)
            if link is None:
                link = self._link(cur)
                if link is None:
                    return None
                links[cur] = link
                todo = [b for b in (link.agent_base, link.sent_base)
                        if b and b not in built and b not in self._views]
                if any(b in links for b in todo):
                    return None  # a cycle
                if todo:
                    stack.extend(dict.fromkeys(todo))
                    continue
            v = self._build(link, built)
            if v is None:
                return None
            built[cur] = v
            stack.pop()
        got = built.get(rid)
        if got is not None:
            self._remember(rid, got)
        return got

    def _build(self, link: Link, built: dict[str, Views]) -> Views | None:
        a = self._base_items(link.agent_base, link.agent_keep, "agent", built)
        s = self._base_items(link.sent_base, link.sent_keep, "sent", built)
        if a is None or s is None:
            return None
        sent = link.agent if link.sent is None else link.sent
        s_items, s_outs = s
        n = len(s_items) + len(sent)
        return Views(a[0] + link.agent + link.output, s_items + sent + link.output,
                     frozenset(s_outs | set(range(n, n + len(link.output)))), link.owner, link.conn)

    def _base_items(self, base: str, keep: int, view: str,
                    built: dict[str, Views]) -> tuple[list[bytes], set[int]] | None:
        if not base:
            return ([], set()) if keep == 0 else None
        v = built.get(base) or self._views.get(base)
        if v is None:
            return None
        items = v.agent if view == "agent" else v.sent
        if keep > len(items):
            return None
        outs = {i for i in v.outputs if i < keep} if view == "sent" else set()
        return items[:keep], outs

    def _outputs_of(self, session: str, base: str, keep: int) -> set[int]:
        last = self._last_of_session.get(session) if session and base else None
        v = last[1] if last is not None and last[0] == base else None
        return {i for i in v.outputs if i < keep} if v is not None else set()

    def _compress(self, session: str, items: list[bytes], view: str
                  ) -> tuple[str, int, list[bytes], list[bytes]]:
        """A whole input stored as the longest prefix it shares with the session's newest response
        (``base, keep, own items``), and the whole list sharing that response's item objects."""
        got = self._last_of_session.get(session) if session else None
        if got is None:
            return "", 0, items, items
        last, v = got
        have = v.agent if view == "agent" else v.sent
        k = 0
        n = min(len(have), len(items))
        while k < n and have[k] == items[k]:
            k += 1
        return (last, k, items[k:], have[:k] + items[k:]) if k else ("", 0, items, items)

    def _link(self, rid: str) -> Link | None:
        try:
            row = self.store.chain(rid)
            return None if row is None else _link_of(row)
        except Exception as e:  # unreadable: the chain is unknown (observed), never guessed
            log.warning("[bili] chain %s: transcript unreadable (%s)", printable(rid), printable(e))
            return None

    def _remember(self, rid: str, v: Views) -> None:
        self._views[rid] = v
        self._views.move_to_end(rid)
        while len(self._views) > CACHE:
            self._views.popitem(last=False)


# -- helpers -------------------------------------------------------------------------------------

def _pack(items: list[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def _unpack(blob: bytes) -> list[bytes]:
    return [bytes(x) for x in _dec_items.decode(blob)]


def _row(link: Link) -> tuple:
    """The store's row (``store.CHAIN_COLS`` order)."""
    return (link.id, link.session, link.conn, int(link.stored), link.agent_base, link.agent_keep, _pack(link.agent),
            link.sent_base, link.sent_keep, None if link.sent is None else _pack(link.sent), _pack(link.output),
            link.owner, link.created or time.time())


def _link_of(row: tuple) -> Link:
    (rid, session, conn, stored, a_base, a_keep, agent, s_base, s_keep, sent, output, owner, created) = row
    return Link(rid, session, conn, bool(stored), a_base, int(a_keep), _unpack(agent), s_base, int(s_keep),
                None if sent is None else _unpack(sent), _unpack(output), float(created), owner or "")


# the headers that carry a provider credential, in the order they are looked for
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")


def owner_of(host: str, headers: Any) -> str:
    """Who a chain belongs to: a digest of the host and the first credential header (never the
    credential itself).  Providers scope response ids to the credential's account, so a
    transcript shared by a team's instances must too: a response id learned from someone else
    rebuilds nothing."""
    cred = ""
    for name in CREDENTIAL_HEADERS:
        value = headers.get(name) if headers is not None else None
        if value:
            cred = f"{name}:{value}"
            break
    return hashlib.sha256(f"bili-chain-owner\0{host.lower()}\0{cred}".encode()).hexdigest()[:32]


def _input_items(raw: bytes, top: dict[str, msgspec.Raw] | None = None) -> list[bytes]:
    """The ``input`` of a Responses body as item bytes (a string input is one user message)."""
    top = _dec_top.decode(raw) if top is None else top
    inp = top.get("input")
    if inp is None:
        return []
    b = bytes(inp)
    if b[:1] == b"[":
        return [bytes(x) for x in _dec_items.decode(b)]
    if b[:1] == b'"':
        return [_enc.encode({"type": "message", "role": "user", "content": _dec.decode(b)})]
    return []


def _normal_output(item: bytes, stored: bool) -> bytes:
    """An output item as it goes back in as input: without its provider id where the provider
    keeps no items (``store: false``), else as it came."""
    if stored:
        return item
    try:
        obj = _dec.decode(item)
    except msgspec.DecodeError:
        return item
    if isinstance(obj, dict) and "id" in obj:
        obj.pop("id")
        return _enc.encode(obj)
    return item


def _same(rendered: bytes, held: bytes, output: bool) -> bool:
    """Whether the provider's chain still holds what the pass rendered: the same bytes, or, for an
    item the provider produced, the same content once bili's own tag (and the replayed-prose
    cleaning the kernel applies to it) is taken off."""
    if rendered == held:
        return True
    if not output:
        return False
    try:
        a, b = _dec.decode(rendered), _dec.decode(held)
    except msgspec.DecodeError:
        return False
    return _untagged(a) == _untagged(b)


def _untagged(obj: Any) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get("content"), list):
        return obj
    parts = []
    for p in obj["content"]:
        if isinstance(p, dict) and isinstance(p.get("text"), str):
            split = tags.split_own_tag(p["text"])
            text = split[1] if split else p["text"]
            p = dict(p, text=clean_replayed_prose(text))
        parts.append(p)
    return dict(obj, content=parts)
