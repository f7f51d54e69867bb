"""One request body through the kernel: identity, ledger, tags.

``Engine.process`` takes the decoded body bytes of a model request and returns the bytes to send
upstream (or None when they are unchanged).  It never mutates the caller's input; the store write
of a turn happens before any rendered ref leaves, so a ref the model sees is always persisted.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec

from bili_addon.kernel import tags
from bili_addon.kernel.identity import InstanceCounter, count_tokens, digest
from bili_addon.kernel.sessions import (
    MIN_CANONICAL_BYTES,
    PrefixAffinity,
    agent_of,
    canonical_item,
    chain,
    new_anonymous_id,
    session_from_request,
)
from bili_addon.store import LedgerRow, SessionRow, Store
from bili_addon.wire import Lane
from bili_addon.wire.base import TEXT, Body, Core, decode_any, patch_many

log = logging.getLogger("bili")

PROSE_ROLES = ("user", "assistant")
_SMALL_TOP_KEYS = ("session_id", "metadata", "prompt_cache_key")


class Part(msgspec.Struct, gc=False):
    """A core with its identity digest computed once per distinct item bytes."""

    core: Core
    base: str  # h_ + 16 hex
    chash: str  # full sha256 hex of the seed


class ItemInfo(msgspec.Struct, gc=False):
    is_system: bool
    parts: list[Part]
    canon: bytes | None = None  # lazily computed canonical form (anonymous sessions only)
    obj: Any = None


class ItemCache:
    """Parsed items by their exact bytes: a follow-up turn never re-parses or re-hashes old history."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.size = 0
        self.items: OrderedDict[tuple[str, bytes], ItemInfo] = OrderedDict()

    def get(self, lane: Lane, raw: bytes) -> ItemInfo:
        key = (lane.name, raw)
        info = self.items.get(key)
        if info is not None:
            self.items.move_to_end(key)
            return info
        obj = decode_any(raw)
        parts = []
        for core in lane.item_cores(obj):
            base, chash = digest(core)
            parts.append(Part(core, base, chash))
        info = ItemInfo(lane.is_system_item(obj), parts, obj=obj)
        self.items[key] = info
        self.size += len(raw)
        while self.size > self.max_bytes and self.items:
            (_, old), _info = self.items.popitem(last=False)
            self.size -= len(old)
        return info


@dataclass
class Entry:
    ref: str
    tokens: int


@dataclass
class Session:
    row: SessionRow
    refs: dict[tuple[str, str], Entry] = field(default_factory=dict)
    render_cache: dict[bytes, tuple[tuple, bytes]] = field(default_factory=dict)
    known_refs: dict[str, tuple[str, str]] = field(default_factory=dict)  # ref -> (msg_id, chash)


@dataclass
class TurnResult:
    body: bytes | None
    session: str = ""
    lane: str = ""
    messages: int = 0
    refs_new: int = 0
    refs_known: int = 0
    tagged: int = 0
    note: str = ""


class Engine:
    """The kernel side of the addon: sessions, ledger and tags over a :class:`Store`."""

    def __init__(self, store: Store, max_sessions: int = 256):
        self.store = store
        self.items = ItemCache()
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = max_sessions
        self.affinity = PrefixAffinity(store.affinity())

    # -- sessions ------------------------------------------------------------------------------
    def _session(self, sid: str, agent: str, lane: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            row = self.store.session(sid)
            if row is None:
                now = time.time()
                row = SessionRow(sid, agent, lane, now, now, 0, 0, 1)
            s = Session(row)
            for r in self.store.ledger(sid):
                s.refs[(r.msg_id, r.content_hash)] = Entry(r.ref, r.tokens)
                s.known_refs[r.ref] = (r.msg_id, r.content_hash)
            self.sessions[sid] = s
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sid)
        return s

    # -- the turn ------------------------------------------------------------------------------
    def process(self, raw: bytes, lane: Lane, headers: Mapping[str, str], *, render: bool) -> TurnResult:
        body = Body(raw, lane.conv_key)
        top_small = {k: body.get(k) for k in _SMALL_TOP_KEYS if k in body.top}
        infos = [self.items.get(lane, bytes(it)) for it in body.items]

        # the leading system run is environment, not conversation
        start = 0
        while start < len(infos) and infos[start].is_system:
            start += 1

        chain_hashes: list[str] | None = None
        ident = session_from_request(headers, top_small)
        if ident is not None:
            sid, source = ident
        else:
            canon = []
            for info in infos[start:]:
                if info.canon is None:
                    info.canon = canonical_item(info.obj)
                canon.append(info.canon)
            has_user = any(p.core.role == "user" for info in infos[start:] for p in info.parts)
            if not has_user or sum(len(c) for c in canon) < MIN_CANONICAL_BYTES:
                return TurnResult(None, lane=lane.name, messages=len(infos), note="no conversation identity")
            chain_hashes = chain(canon)
            sid = self.affinity.match(chain_hashes) or new_anonymous_id(chain_hashes[-1], len(chain_hashes))
            source = "prefix"

        s = self._session(sid, agent_of(headers), lane.name)
        counter = InstanceCounter()
        new_rows: list[LedgerRow] = []
        next_ref = s.row.next_ref
        known = 0
        # per item: the (core, entry, clean text) of each part, for rendering
        resolved: list[list[tuple[Core, Entry, str]]] = []
        for info in infos[start:]:
            out = []
            for part in info.parts:
                core, base, chash, clean = part.core, part.base, part.chash, part.core.text
                if core.ctype == TEXT and clean.startswith("<acp "):
                    core, base, chash, clean = self._strip_own_tag(s, part)
                msg_id = counter(base)
                entry = s.refs.get((msg_id, chash))
                if entry is None:
                    entry = Entry(tags.ref_of(next_ref), count_tokens(clean))
                    next_ref += 1
                    new_rows.append(LedgerRow(msg_id, chash, entry.ref, core.role, core.ctype, entry.tokens))
                    s.refs[(msg_id, chash)] = entry
                    s.known_refs[entry.ref] = (msg_id, chash)
                else:
                    known += 1
                out.append((core, entry, clean))
            resolved.append(out)

        row = s.row
        row.agent, row.lane = agent_of(headers), lane.name
        row.requests += 1
        row.messages = len(infos) - start
        row.next_ref = next_ref
        tail = (len(chain_hashes), chain_hashes[-1]) if chain_hashes else None
        try:
            self.store.commit_turn(row, new_rows, tail)
        except Exception:
            # nothing of this turn may be shown: forget the refs it minted
            for r in new_rows:
                s.refs.pop((r.msg_id, r.content_hash), None)
                s.known_refs.pop(r.ref, None)
            row.requests -= 1
            row.next_ref -= len(new_rows)
            self.sessions.pop(sid, None)
            raise
        if tail:
            self.affinity.note(sid, *tail)

        result = TurnResult(
            None, session=sid, lane=lane.name, messages=len(infos) - start,
            refs_new=len(new_rows), refs_known=known, note=source,
        )
        if not render:
            return result

        items_out: list[bytes] = [bytes(it) for it in body.items]
        changed = False
        cache: dict[bytes, tuple[tuple, bytes]] = {}
        last = len(infos) - 1
        for k, parts in enumerate(resolved):
            i = start + k
            edits = []
            for core, entry, clean in parts:
                if _taggable(core, clean, prefill=(i == last and core.role == "assistant")):
                    edits.append((core.path, tags.render(entry.ref, entry.tokens, core.ctype, clean)))
                elif clean != core.text and core.path:
                    edits.append((core.path, clean))
            if not edits:
                continue
            src = items_out[i]
            sig = tuple(edits)
            hit = s.render_cache.get(src)
            if hit is not None and hit[0] == sig:
                out = hit[1]
            else:
                out = patch_many(src, edits)
            cache[src] = (sig, out)
            result.tagged += sum(1 for _p, text in edits if text.startswith("<acp "))
            if out != src:
                items_out[i] = out
                changed = True
        s.render_cache = cache
        if changed:
            result.body = body.encode(items_out)
        return result

    def _strip_own_tag(self, s: Session, part: Part) -> tuple[Core, str, str, str]:
        """Remove the message's own stale tag (idempotent); a foreign tag is content and stays."""
        split = tags.split_own_tag(part.core.text)
        if split is None:
            return part.core, part.base, part.chash, part.core.text
        ref, rest = split
        stripped = msgspec.structs.replace(part.core, text=rest)
        base, chash = digest(stripped)
        owner = s.known_refs.get(ref)
        if owner is not None and owner[1] == chash:
            return stripped, base, chash, rest
        return part.core, part.base, part.chash, part.core.text


def _taggable(core: Core, clean: str, *, prefill: bool) -> bool:
    return (
        core.ctype == TEXT
        and core.role in PROSE_ROLES
        and bool(core.path)
        and not prefill
        and bool(clean.strip())
    )
