"""The sessions this process holds: each loaded from the store once, cached, written back through it.

:class:`Sessions` is a read-only mapping ``session id -> Session`` of what is cached (least recently
used first; at most ``max_sessions``), plus the previous pass of each session
(:class:`~bili_addon.kernel.state.Memo`, as many as ``MEMO_BYTES`` of conversation hold).  The store is the truth: a session
another process changed is reloaded (``load(..., fresh=True)``), and one whose write the store
refused is forgotten.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from bili_addon.kernel import reconcile
from bili_addon.kernel.activation import FLAG as ACTIVE
from bili_addon.kernel.fold import Block
from bili_addon.kernel.state import Call, Entry, Memo, Session, flags_json as _FLAGS_JSON
from bili_addon.store import SessionRow, Store

# the previous passes kept: by the bytes of their conversations (a pass holds its request's items and
# their rendering, ~2-3x those bytes), at most one per cached session.  Counted by passes (32 before),
# a proxy serving more conversations than that in turn lost every pass before its next turn: each
# follow-up cost a conversation's whole pass again (~3x more at 1,000 messages; bench_overhead.py).
MEMO_BYTES = 256 << 20
# flags that change how old items render (activation: tags appear on every prose part)
RENDER_FLAGS = ("truncated", "strict_reasoning", ACTIVE)


def stages(s: Session, tail, render: bool, lineage) -> bool:
    """Whether a turn's commit may wait until its reminder is decided (:meth:`Sessions.stage`), so the
    flags and the canonical copy it writes go in the same write: any pass (a conversation's first
    or a follow-up, folded or not) of a session where nothing but flags and its copy is written
    between the commit and the flush before rendering, or where what else is written flushes first
    (blocks: a claim of fold coverage, a new epoch retiring folds: :meth:`Sessions.save_blocks`).  No
    call waiting to land (its folds and result are writes: that turn is as many writes either way),
    not paused (that turn passes through unrendered), a render (not
    observe), no prefix chain (an id-less session notes its points), the lineage kept back until
    the answer with nothing of the session held back yet (a record writes what a pass without an
    answer kept back).  A host's envelope binds flags only."""
    return (tail is None and render and lineage.defer and not s.copy.latched
            and s.row.id not in lineage.pending and all(c.result is not None for c in s.calls.values()))


class Sessions(Mapping[str, Session]):
    """The cached sessions and their previous passes, over a :class:`Store`."""

    def __init__(self, store: Store, max_sessions: int = 256, memo_bytes: int = MEMO_BYTES):
        self.store = store
        self.max_sessions = max_sessions
        self.memo_bytes = memo_bytes
        self._cache: OrderedDict[str, Session] = OrderedDict()
        self.memos: OrderedDict[str, Memo] = OrderedDict()
        self._memo_size = 0  # of the memos as remember last counted them (a memo popped elsewhere: recounted)
        # a turn's commit held back (:meth:`stage`): the flags the turn learns before :meth:`flush`
        # are written with it, one write instead of two, and so is its canonical copy (``copies``:
        # the document :meth:`save_copy` was given meanwhile)
        self.staged: dict[str, Callable[[str | None, bool], None]] = {}
        self.copies: dict[str, str] = {}
        # the flags :meth:`set_flags` changed while their session's commit was staged: the row (the one
        # that commit writes) and the session's flags, whose JSON goes into it when :meth:`flush` writes it
        self.unwritten: dict[str, tuple[SessionRow, dict[str, Any]]] = {}
        # what the caches let go during a turn (sessions, previous passes), held until the engine's
        # bookkeeping after the turn's request (:meth:`release`): freeing one is freeing a whole
        # conversation's objects (~0.15x the floor for a first turn of 100 messages in a proxy whose
        # cache is full: bench_overhead.py), work the request need not wait for
        self.dropped: list = []

    # -- the mapping of what is cached (no store read) --------------------------------------------
    def __getitem__(self, sid: str) -> Session:
        return self._cache[sid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, sid: object) -> bool:
        return sid in self._cache

    def get(self, sid: str, default: Session | None = None) -> Session | None:  # type: ignore[override]
        return self._cache.get(sid, default)

    # -- loading and forgetting ------------------------------------------------------------------
    def load(self, sid: str, agent: str = "", lane: str = "", *, fresh: bool = False,
             candidates: tuple[str, str] | None = None) -> Session:
        """The session's state, loaded from the store once and cached.  ``fresh``: first check that
        no other process has changed it since (one indexed read); if one has, reload it.
        ``candidates``: what a fork check of it would look up (read with the session's lock)."""
        if fresh:
            self.store.hold(sid, candidates)  # one instance at a time works on a session (a no-op for SQLite)
        s = seen = self._cache.get(sid)
        if s is not None:
            if fresh and self.store.version(sid) != s.stored:
                self.forget(sid)
            else:
                self._cache.move_to_end(sid)
                return s
        row, ledger, blocks, calls, copy = self.store.session_state(sid)  # one consistent state
        if row is None:  # new: nothing of it stored (no flags, ledger, blocks, calls or copy)
            now = time.time()
            s = Session(SessionRow(sid, agent, lane, now, now, 0, 0, 1), unstored=True)
        else:
            s = Session(row, flags=json.loads(row.flags or "{}"), stored=row.version)
            for r in ledger:
                s.refs[(r.msg_id, r.content_hash)] = Entry(r.ref, r.tokens)
                s.owners[r.ref] = r.content_hash
            s.blocks = sorted((Block(**json.loads(doc)) for doc in blocks), key=lambda b: b.number)
            s.calls = {k: Call(n, a, r) for k, n, a, r in calls}
            s.copy = reconcile.Copy.from_json(copy)
        if seen is not None:  # what this process saw of the conversation stays true (refs never change meaning)
            s.model, s.last_view, s.last_snoozed, s.last_resolved, s.sent_tokens, s.unfolded_tokens = (
                seen.model, seen.last_view, seen.last_snoozed, seen.last_resolved, seen.sent_tokens,
                seen.unfolded_tokens)
        self._cache[sid] = s
        while len(self._cache) > self.max_sessions:
            old, gone = self._cache.popitem(last=False)
            self.dropped.append((gone, self.memos.pop(old, None)))
        return s

    def forget(self, sid: str) -> None:
        """Drop the cached state of a session (and its previous pass): the store is the truth."""
        self.dropped.append((self._cache.pop(sid, None), self.memos.pop(sid, None)))

    def remember(self, memo: Memo) -> None:
        """Keep ``memo`` as its session's previous pass: the most recent ones whose conversations
        hold at most ``memo_bytes`` together (always the newest), one per cached session at most."""
        if not memo.size:
            memo.size = sum(map(len, memo.raws))
        memos = self.memos
        old = memos.pop(memo.sid, None)
        memos[memo.sid] = memo
        size = self._memo_size + memo.size - (old.size if old is not None else 0)
        if old is not None:
            self.dropped.append(old)
        if size > self.memo_bytes or len(memos) > self.max_sessions:
            size = sum(m.size for m in memos.values())  # (exact again, whatever was popped meanwhile)
            while len(memos) > 1 and (size > self.memo_bytes or len(memos) > self.max_sessions):
                gone = memos.popitem(last=False)[1]
                size -= gone.size
                self.dropped.append(gone)
        self._memo_size = size

    def release(self) -> None:
        """Free what the caches let go since the last call (:attr:`dropped`)."""
        self.dropped.clear()

    # -- writes ----------------------------------------------------------------------------------
    def stage(self, sid: str, write: Callable[[str | None, bool], None]) -> None:
        """Hold the turn's commit (``write``, given the copy to write with it or None, and whether it is
        the turn's last write: ``store.commit_turn(release=)``) of a session
        until :meth:`flush`: a flag set meanwhile goes into the session's row, which that commit
        writes (its JSON made by the flush: until then ``row.flags`` is the row's as staged), a copy
        saved meanwhile goes with it (:meth:`save_copy`).  Anything else of the
        session is written after a flush (:meth:`save_blocks` flushes first; the engine before a
        call lands), and the flush comes before any ref of the turn leaves (or, the turn's last write
        written behind its request, right after it: ``Engine.write_pending``)."""
        self.staged[sid] = write

    def flush(self, last: bool = False) -> None:
        """Write the staged commits (their flags and copies included).  A write that fails stays
        staged: :meth:`unstage` then drops what this process holds of its session.  ``last``: the turn
        writes nothing of its sessions after these (the last commit lets the sessions' locks go with
        it, in the same round trip on PostgreSQL; a write after it takes the lock again)."""
        while self.staged:
            sid = next(iter(self.staged))
            flagged = self.unwritten.pop(sid, None)
            if flagged is not None:  # the row as set_flags left it, written now (its JSON made once)
                flagged[0].flags = _FLAGS_JSON(flagged[1])
            self.staged[sid](self.copies.get(sid), last and len(self.staged) == 1)
            del self.staged[sid]
            self.copies.pop(sid, None)

    def unstage(self) -> list[str]:
        """A turn failed before its staged commit was written: nothing of it was, so what this
        process holds of its session (staged refs, row, flags, copy) is dropped; the store is the
        truth.  Returns the sessions dropped."""
        dropped = list(self.staged)
        self.staged.clear()
        self.copies.clear()
        self.unwritten.clear()
        for sid in dropped:
            self.forget(sid)
        return dropped

    def set_flag(self, sid: str, key: str, value: Any) -> bool:
        """Persist a learned per-session fact; True when it changed."""
        return self.set_flags(sid, {key: value})

    def set_flags(self, sid: str, values: dict[str, Any]) -> bool:
        """Persist learned per-session facts in one write; True when one changed."""
        s = self._cache.get(sid)
        if s is None:
            s = self.load(sid)
        else:  # (load's own way with a cached session)
            self._cache.move_to_end(sid)
        flags = s.flags
        changed = {k: v for k, v in values.items() if flags.get(k) != v}
        if not changed:
            return False
        flags.update(changed)
        if sid in self.staged:
            # the staged commit writes the row with them: their JSON is made when :meth:`flush` writes
            # it (a turn's reminder, learned before its request goes, is stored after it: write-behind)
            self.unwritten[sid] = (s.row, flags)
        else:
            s.row.flags = _FLAGS_JSON(flags)
            s.stored = self.store.set_flags(s.row, expect=s.stored)
        for k in changed:
            if k in RENDER_FLAGS:
                s.version += 1  # old items render differently now
                break
        return True

    def save_copy(self, s: Session) -> None:
        """Persist the session's canonical copy (``s.copy`` as it is now): with the turn's staged
        commit when there is one (one write), else at once."""
        doc = s.copy.to_json()
        if s.row.id in self.staged:
            self.copies[s.row.id] = doc
        else:
            s.stored = self.store.save_copy(s.row.id, doc, expect=s.stored)

    def save_blocks(self, s: Session, blocks: list[Block], originals=(), results=()) -> None:
        """``results``: ``(call key, result)`` of the call that made the blocks, in the same
        transaction (a turn computed again never runs that call twice).  A staged commit of the
        session is written first."""
        if s.row.id in self.staged:
            self.flush()
        s.stored = self.store.commit_fold(
            s.row.id,
            [(b.id, json.dumps(b.__dict__), b.active) for b in blocks],
            [(p.ref, p.role, p.ctype, p.tool_name, p.tool_call_id, p.text, p.tokens) for p in originals],
            list(results),
            expect=s.stored,
        )


__all__ = ["MEMO_BYTES", "RENDER_FLAGS", "Sessions"]
