"""One request body through the kernel: identity, ledger, tags, folds, hygiene.

``Engine.process`` takes the decoded body bytes of a model request and returns the bytes to send
upstream (or None when they are unchanged).  It never mutates the caller's input; the store write
of a turn happens before any rendered ref leaves, or, with write-behind (the proxy's), right after
its request leaves, under the session's lock, before anything else of the engine runs (a ref the
model sees is in the store before any other turn, of any session, is computed; a write that fails
there drops the session from memory and its next turn gives the same history the same refs).

Agents re-send the whole conversation every turn.  The previous pass of each session is kept (a
:class:`~bili_addon.kernel.state.Memo`), and the items a request shares with it byte for byte are
not parsed, hashed, resolved or rendered again: a turn costs its new suffix plus a memcmp.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from typing import Any, Mapping

import msgspec

from bili_addon import printable
from bili_addon.kernel import (breakpoints, cache, coverage, envelope, fold, fresh, lifetime, nudge, pending, pressure,
                               reconcile, registry, tags)
from bili_addon.kernel.calibration import Calibration
from bili_addon.kernel.chains import Chains
from bili_addon.kernel.compaction import Epochs
from bili_addon.kernel.fold import FoldConfig, PartView, View, ViewItem
from bili_addon.kernel.fresh import Rows
from bili_addon.kernel.identity import count_tokens, digest
from bili_addon.kernel.lineage import Lineage
from bili_addon.kernel.pending import Deferred
from bili_addon.kernel.prompts import SYSTEM_PROMPT, TOOL_NAMES, TOOLS
from bili_addon.kernel.registry import Sessions
from bili_addon.kernel.render import (assemble, render_items, snapshot_join, snapshot_render, strict_inserts,
                                      strict_repair)
from bili_addon.kernel.sessions import (
    MIN_CANONICAL_BYTES,
    PrefixAffinity,
    agent_of,
    canonical_item,
    claude_agent,
    claude_subagent,
    chain,
    session_from_request,
)
from bili_addon.kernel.state import (
    Entry,
    ItemCache,
    ItemInfo,
    Memo,
    Part,
    Resolved,
    Session,
    TurnResult,
    clean_replayed_prose,
    hash_parts,
    head_cores,
)
from bili_addon.kernel.native import NativeCalls
from bili_addon.kernel.tools import ProxyTools, shown_blocks
from bili_addon.kernel.windows import PATH_MODEL, context_window, variant, window_key
from bili_addon.store import LedgerRow, SessionRow, StaleSession, Store, StoreError
from bili_addon.wire import Lane
from bili_addon.wire.base import TEXT, TOOL_RESULT, Core, Splits

log = logging.getLogger("bili")

_NO_TOP: dict = {}  # (session_from_request with the headers alone)
_HEAD_KEY = 512  # the bytes of a body that key its layout when no header names its conversation
_SMALL_TOP_KEYS = ("session_id", "metadata", "prompt_cache_key", "model", "previous_response_id")
STALE_RETRIES = 2  # a turn computed from a session another process changed meanwhile is computed again

__all__ = ["Engine", "TurnResult", "clean_replayed_prose"]


class Engine(ProxyTools, Epochs, Deferred):
    """The kernel side of the addon: sessions, ledger, tags and folds over a :class:`Store`."""

    def __init__(self, store: Store, max_sessions: int = 256, fold_cfg: FoldConfig | None = None,
                 inject: bool = True, window: int = 0, reconcile: bool = True, snapshot: bool = False,
                 activate: str = "always", materialize: str = "now"):
        self.store = store
        self.items = ItemCache()
        self.splits = Splits()  # recent bodies' layouts: a follow-up's body read from its predecessor's
        self.sessions = Sessions(store, max_sessions)  # cached sessions and previous passes (kernel/registry.py)
        self.affinity = PrefixAffinity(store.affinity())
        self.lineage = Lineage(store)  # forks and id-less rewinds (kernel/lineage.py)
        self.chains = Chains(store)  # server-side chains: the shell's way in (kernel/chains.py)
        self.native = NativeCalls()  # which conversation made a native (MCP) tool call (kernel/native.py)
        self.fold_cfg = fold_cfg or FoldConfig()
        self.nudge_cfg = nudge.NudgeConfig()
        self.inject = inject
        self.window = window  # 0: from the model table
        self.reconcile = reconcile  # re-anchor fold coverage under churn (off: a control for tests)
        self.snapshot = snapshot  # render the folded prefix from the session's own transcript
        self._turn_sid: str | None = None  # the session of the turn being computed
        self.activate = activate  # lazy: nothing injected until folding is about to pay (kernel/activation.py)
        self.materialize = materialize  # cost: folds land when it pays (kernel/pending.py); now: at once
        self.clocks = cache.Clocks(max_sessions)  # each session's provider cache, as the model predicts it
        self.calibration = Calibration(store, self.clocks)  # ... against the provider's reports
        self.now = time.time  # when a request leaves (replay: the recorded time)
        # write-behind: a turn whose store write is its last leaves it staged; the request goes at
        # once and :meth:`write_pending` writes it next (the shell's keeper does before any other work
        # of the engine; a store that holds its sessions across processes only: ``store.exclusive``)
        self.write_behind = False
        self._pending = False  # a turn's write is staged past its request (write_pending writes it)
        self._later: list = []  # a turn's bookkeeping that waits for its request to go (the item cache's record)

    # -- sessions: kernel/registry.py; these two are the way in for the shell, the admin endpoints
    # -- and the tests (and, until they are next edited, for _process and kernel/pressure.py)
    def session(self, sid: str, agent: str = "", lane: str = "", *, fresh: bool = False,
                candidates: tuple[str, str] | None = None) -> Session:
        """:meth:`Sessions.load <bili_addon.kernel.registry.Sessions.load>`."""
        return self.sessions.load(sid, agent, lane, fresh=fresh, candidates=candidates)

    def set_flag(self, sid: str, key: str, value: Any) -> bool:
        """:meth:`Sessions.set_flag <bili_addon.kernel.registry.Sessions.set_flag>`."""
        return self.sessions.set_flag(sid, key, value)

    def window_for(self, s: Session) -> int:
        """The session's context window: learned from the provider's overflow error for its model (and
        the window its request asks for, kernel/windows.py), else the option's, else the table's."""
        key = window_key(s)
        learned = s.flags.get("learned_windows", {}).get(key)
        return int(learned) if learned else (self.window or context_window(key))

    # -- the turn ------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether a turn's store write waits for :meth:`write_pending` (write-behind)."""
        return self._pending

    def write_pending(self) -> None:
        """Write the store write a turn left staged when its request went (write-behind), and let its
        session's lock go with it (one round trip on PostgreSQL).  The turn's refs left with its
        request, each given by the session's lock in this process alone (``store.exclusive``), in
        order from the store's counter: a write that fails here (the store failed) drops what this
        process holds of the session, as a failed turn does, and the next turn computes it again
        from the store, where the same history gets the same refs.  Raises what the store raised."""
        if not self._pending:
            return
        self._pending = False
        sid = next(iter(self.sessions.staged), None)
        try:
            self.sessions.flush(last=True)
        except BaseException as e:
            self._unstage()
            log.warning("[bili] session=%s: the store write of its turn failed after its request left (%s: %s); "
                        "the session is read again from the store on its next turn", printable(sid), type(e).__name__,
                        printable(e))
            raise
        finally:
            self.store.release()
            self._run_later()

    def _run_later(self) -> None:
        later, self._later = self._later, []
        try:
            for fn in later:
                fn()
        finally:
            self.sessions.release()  # (the sessions and passes the caches let go: freed after the request)

    def process(
        self, raw: bytes, lane: Lane, headers: Mapping[str, str], *, render: bool, origin: str = ""
    ) -> TurnResult:
        self.write_pending()  # (a previous turn's write first: the keeper's work does it before)
        # a turn allocates many small objects and frees them all; the cyclic collector would only
        # walk the (acyclic) conversation again and again
        enabled = gc.isenabled()
        gc.disable()
        behind = False
        try:
            for attempt in range(STALE_RETRIES + 1):
                self._turn_sid = None
                try:
                    res = self._process(raw, lane, headers, render=render, origin=origin)
                    if res.session and not res.status and not res.side:
                        # noted only; billed off the request's path (with the session's model: a Gemini
                        # body names none, its URL does); a side request reads and refreshes nothing of
                        # the conversation's cache (another model, another prefix)
                        self.clocks.sent(res.session, lane.name, raw if res.body is None else res.body, self.now(),
                                         origin.lower(), res.model)
                    # write-behind: the staged write (the turn's last, _process left it) goes after the request
                    behind = self.write_behind and bool(self.sessions.staged)
                    return res
                except StaleSession as e:
                    # another process advanced the session while this turn was computed: nothing
                    # of it left (the store refused it); compute it again from the store's state
                    self._unstage()
                    self.sessions.forget(e.session_id)
                    if attempt == STALE_RETRIES:
                        raise
                except StoreError:
                    if self._turn_sid is not None:  # what this process holds may differ from the store
                        self.sessions.forget(self._turn_sid)
                    raise
            raise AssertionError("unreachable")
        finally:
            if behind:
                self._pending = True  # its lock is held until then
            else:
                self._unstage()  # a turn that failed before its staged commit was written: nothing of it kept
                self.store.release()  # the session's lock (another instance's turn of it may wait)
                self._run_later()
            if enabled:
                gc.enable()

    def _process(self, raw: bytes, lane: Lane, headers: Mapping[str, str], *, render: bool,
                 origin: str) -> TurnResult:
        # the conversation's id when its headers carry it (they are read first): the key of its
        # previous body's layout; else the body's first bytes are
        ident = session_from_request(headers, _NO_TOP)
        agent_id = claude_agent(headers) if ident is not None and lane.name == "anthropic" else ""
        body = self.splits.body(raw, lane.conv_key, (lane.name, ident[0], agent_id) if ident is not None else
                                (lane.name, raw[:_HEAD_KEY]))
        top = {k: body.get(k) for k in _SMALL_TOP_KEYS if k in body.top}
        raws = body.items
        if ident is None:
            ident = session_from_request(headers, top)
        elif agent_id:  # a Claude Code subagent's conversation is a session of its own (proxy.md 7.3)
            sub = claude_subagent(agent_id, body.get("system"))
            if sub is not None:
                ident = (ident[0] + sub, "claude-subagent")
        if ident is not None:
            self._soon(ident[0], lane, raws)
        memo = self._memo_for(ident[0] if ident else None, lane, raws)
        shared = body.shared  # (the items the body was read from and how many it shares: no compare again)
        k = ((shared[1] if shared is not None and shared[0].items is memo.raws else coverage.common_prefix(memo.raws, raws))
             if memo is not None else 0)
        # the very history of the previous pass again (an SDK's retry after a timeout or a 529)
        repeat = memo is not None and k == len(raws) == len(memo.raws)
        if memo is not None:
            k = min(k, len(memo.raws) - 1)  # the previous last item may have been an untagged prefill
            if k <= memo.start:
                k = 0
        shares = memo if k else None  # (its first k items are these: whatever becomes of ``memo`` below)
        objs: list = [None] * k  # the items parsed in this pass, as decoded (render_items patches them)
        # (freed after the request: a first pass's decoded items, a struct per message and per block, took
        # ~25 us to free when the turn returned, ~1.5% of a first turn of 100 messages)
        self._later.append(objs.clear)
        infos = (memo.infos[:k] if k else []) + self.items.get_many(
            lane, raws[k:], objs, body.top[lane.conv_key] if not k and raws else None, self._later)
        start = memo.start if k else _system_run(infos)

        if ident is not None:
            sid, source, tail, hashes = ident[0], ident[1], None, None
        else:
            hashes = self._chain(infos, start, memo, k)
            if hashes is None:
                res = TurnResult(None, lane=lane.name, messages=len(infos), source="no conversation identity")
                if body.top.pop(envelope.FIELD, None) is not None:  # the envelope is ours: never forwarded
                    res.body = body.encode(None)
                return res
            if self.affinity.match(hashes) is None:  # another process may have seen this conversation
                for row in self.store.affinity_of(hashes):
                    self.affinity.note(*row)
            sid, known = self.lineage.locate(self.affinity, hashes, infos[start:])
            source, tail = "prefix", (len(hashes), hashes[-1])
        agent = agent_of(headers)
        self._turn_sid = sid
        cached = self.sessions.get(sid)
        s = self.session(sid, agent, lane.name, fresh=True,  # a session new here: its fork check's read with its lock
                         candidates=self.lineage.head(sid, infos[start:], lane.name) if cached is None and ident else None)
        if s is not cached:
            memo = None  # (re)loaded: nothing of a previous pass is known to match the store
        new = s.unstored and s is not cached  # the store had no row of it: nothing of it recorded
        forked = self._lineage("before_turn", s, infos, start) if ident is not None else None
        was = (s.model, s.variant)  # (the conversation's, should this be a side request)
        if isinstance(top.get("model"), str):
            s.model = top["model"]
        elif headers.get(PATH_MODEL):  # (Gemini: the model in the URL's path, as the shell read it)
            s.model = headers[PATH_MODEL]
        s.variant = variant(headers) if lane.name == "anthropic" else ""
        # conversation items whose session work (refs, view, rendering) is reused as it is
        q = k - start if memo is not None and k and memo.sid == sid and memo.version == s.version else 0
        result = TurnResult(None, session=sid, lane=lane.name, messages=len(infos) - start, source=source)
        # (the request's: a side request's is not kept as the session's)
        result.model, result.variant = s.model, s.variant
        if forked:
            result.notes.append(forked)

        env, pinned, stripped = envelope.pins(s, body, headers, infos, start, result)
        if result.status:
            return result
        if env is not None:
            q = 0  # a vouched set decides every item's ref anew
        cov = fold.coverage(s.blocks) if s.blocks else {}
        counter = _prefix_counter(memo, q)
        vouched = env.ids[start:] if env is not None else None
        # a conversation's first pass: every part new, refs, rows and view in one loop (kernel/fresh.py)
        first = None
        if fresh.applies(s, cov, q, pinned, vouched):
            conv = infos[start:]  # (with the lists the item read made of their parts: ItemCache.first_flat)
            first = fresh.first_pass(s, conv, counter, start, flat=self.items.first_flat(conv))
        if first is not None:
            resolved_tail, new_rows, view_tail, sums = first
        else:
            resolved_tail, new_rows = self._resolve(s, infos[start + q:], counter, cov, q, pinned, vouched,
                                                    memo.resolved[:q] if q else ())
            view_tail = None
        resolved = (memo.resolved[:q] if q else []) + resolved_tail
        minted = s.row.next_ref
        result.refs_known = n_parts = sum(map(len, resolved))

        # staged: written with the flags the turn learns below (one write), by the flush before
        # anything else of the session is written or sent; in memory it is done either way
        self._commit(s, agent, lane.name, len(infos) - start, new_rows, tail, fresh=first is not None,
                     stage=registry.stages(s, tail, render, self.lineage))
        result.refs_new = s.row.next_ref - minted
        result.refs_known -= result.refs_new
        if env is not None:
            envelope.bind(self.sessions, s, env, infos, start, resolved, pinned)
        if tail:
            self.affinity.note(sid, *tail)
            self._lineage("note_points", sid, hashes, known)
        if isinstance(top.get("previous_response_id"), str) and top["previous_response_id"]:
            if self.set_flag(sid, "delta_history", True):
                result.notes.append(
                    "the agent continues a server-side chain (previous_response_id) the proxy's transcript "
                    "does not hold: its turns pass observed until the agent sends its whole history"
                )

        view_items = ((memo.view_items[:q] if q else [])
                      + (view_tail if view_tail is not None else _view_items(resolved_tail, start + q)))
        snap = snapshot_join(self.store, s, view_items) if self.snapshot and s.blocks and render else None
        # (a follow-up's view extends the figures and plan of the session's previous one: fold.View)
        view = (View(snap[2]) if snap else View(view_items, sums) if first is not None
                else View(view_items, prev=s.last_view))
        self._compaction(s, lane.name, view, minted, result)  # the agent's own compaction: a new epoch
        if not tail:  # (once the compaction is known: a new epoch's history is recorded anew)
            self._lineage("record", s, infos, start, resolved, q, n_parts, result.epoch)
        # a side request (a title, a probe) leaves the conversation's view as its last: native calls
        # resolve against it, and the next turn's view extends it
        kept = s.last_view
        if kept is not None:
            before, kept_opening = len(kept.items), _opening(kept)
        else:  # (a restart: the canonical copy's)
            before, kept_opening = (s.copy.items[-1] + 1, s.copy.refs[0]) if s.copy.items else (0, None)
        opening = _opening(view)
        result.side = not result.epoch and reconcile.side_request(
            len(view.items), before, opening is not None and opening == kept_opening)
        if not result.side:
            s.last_view, s.last_resolved = view, resolved
        else:  # (its model and window are not the conversation's: the next turn's, acp_status's)
            s.model, s.variant = was
        if self.native.waiting(sid):  # (a native call the agent answered without running it: its note goes)
            self.native.answered(sid, [p.tool_call_id for it in view.items for p in it.parts
                                       if p.ctype == TOOL_RESULT and p.tool_call_id])
        drift = (coverage.check(self.store, self.sessions, s, view, resolved, result)
                 if s.blocks and self.reconcile else None)
        snoozed = drift.snoozed if drift is not None else set()
        if not result.side:
            s.last_snoozed = frozenset(snoozed)
        if s.copy.latched or not render:
            # observe mode, or a total collapse: nothing verifies the folds against this history,
            # so it passes through as it came until the agent sends a history that aligns again
            self.sessions.flush(last=True)  # (a staged turn the coverage check latched: its commit is still written)
            if not result.side:  # (a side request's pass is not the conversation's previous one)
                self._remember(lane, sid, s, raws, infos, start, hashes, resolved, view_items, counter, None, len(raw))
            if stripped:  # the envelope is ours: it never reaches the provider
                result.body = body.encode(None)
            return result

        version = s.version
        if s.calls:
            if any(c.result is None for c in s.calls.values()):
                self.sessions.flush()  # (registry.stages stages no such turn: a call landing writes)
            self._run_calls(s, view, q, result, frozenset(snoozed))
        if s.blocks and self.reconcile:
            coverage.roll_copy(self.sessions, s, view, resolved, drift)  # (with the staged commit)
        active = result.active = pressure.is_active(self, s, view)
        if self.inject and active and not result.side:  # (a side request's size says nothing of the conversation's)
            pressure.apply(self, s, view, resolved, new, snoozed)
        names = None  # the request's tool names (read here: whether the native-tools flag follows the flush)
        if self.inject and active and len(raws) > start:
            try:
                names = lane.tool_names(body) or []
            except Exception:  # (read again below, failing there as it would)
                names = None
        # the turn's staged commit, before anything else is written or sent (the turn's last write of the
        # session unless something below may write: then its lock stays until release); with
        # write-behind, a last write stays staged and goes after the request (write_pending)
        last = not _writes_after(self, s, lane.name, snap, active, names, len(raws) > start)
        # (a family's refs come from its counter, which the session's lock does not hold: a fork on another
        # proxy may give the same numbers meanwhile, refused only at the commit; its turn is written
        # before its request goes, and computed again on a refusal, never sent with refs of another text)
        if not (last and self.write_behind and self.store.exclusive and not s.family):
            self.sessions.flush(last=last)
        self._land(s, view, result, repeat and q > 0)  # held folds leave the wire when it pays (kernel/pending.py)
        strict = strict_repair(s, lane.name, top, origin)
        if s.version != version or (memo is not None and memo.rendered is None) or strict != s.strict:
            q = 0  # this turn changed how old items render (a truncation, a learned flag, a switch to or
            # from a model whose provider wants the reasoning repair), or the previous pass rendered nothing
            # (observe mode)
        s.strict = strict
        result.reused = q
        if q:
            rendered = memo.rendered[: start + q]
            changed_cum = memo.changed_cum[: start + q + 1]
            tagged_cum = memo.tagged_cum[: start + q + 1]
        else:
            rendered = [bytes(r) for r in raws[:start]]
            changed_cum, tagged_cum = [0] * (start + 1), [0] * (start + 1)
        render_items(s, lane, raws, infos, start, q, resolved, rendered, changed_cum, tagged_cum, top, origin, active,
                     objs, strict, lambda: shown_blocks(s, view, snoozed))
        result.tagged = tagged_cum[-1]
        if not result.side:  # (a side request's pass is not the conversation's previous one: the next turn's is)
            self._remember(lane, sid, s, raws, infos, start, hashes, resolved, view_items, counter,
                           (rendered, changed_cum, tagged_cum), len(raw))

        items_out = list(rendered)
        changed = changed_cum[-1] > 0 or stripped
        if snap:
            changed |= snapshot_render(self.store, s, snap, lane, raws, items_out, start, view)
        pre = strict_inserts(s, lane.name, infos, top, origin)
        changed |= assemble(self, s, lane, items_out, start, view, result, snoozed, pre)
        # (the conversation's figures, made by now: the first pass's, or the previous view's extended)
        result.sent_tokens = s.sent_tokens or (view.sums().tokens[-1] if view.items else 0)
        if active and s.blocks:  # the agent's free cache breakpoint, at the end of the folded head
            counts, run = breakpoints.agent_marks(raw, body, infos, shares.marks if shares is not None else None, k)
            now = self.sessions.memos.get(sid)
            if now is not None and now.infos is infos:  # (this pass's memo: the next turn counts its new items only)
                now.marks = run
            changed |= breakpoints.mark_head(lane.name, items_out, start, raw, counts)
        if self.inject and active and len(raws) > start:  # no conversation (``input: []``): nothing to add tools to
            if names is None:
                names = lane.tool_names(body) or []
            native = _natively(names)
            result.shadowed = tuple(n for n in TOOL_NAMES if n in names)  # (not offered: the agent's own)
            if native and self.set_flag(sid, "native_tools", True):
                result.notes.append("the agent has bili's tools natively (MCP): wire injection is off for it")
            changed |= lane.inject(body, items_out, start, [] if native else list(TOOLS), SYSTEM_PROMPT, names)
        if active and lane.name == "anthropic":  # the cache lifetimes the session chose, set on the parts
            # (a reminder in this request: what it asks to fold leaves the wire soon)
            folding = view if self.inject and not result.side and pressure.reminding(s, resolved) else None
            result.body = pressure.upgrade_lifetime(self, s, body, items_out, raw, changed, folding)
            if result.body is not None:
                return result
        if changed:
            result.body = body.encode(items_out)
        return result

    # -- identity ------------------------------------------------------------------------------
    def _soon(self, sid: str, lane: Lane, raws: list) -> None:
        """The session's lock asked of the store now, with what :meth:`session` will ask it to read
        with it (a new session's fork key, from its first items: ``state.head_cores``), its answer
        taken when the turn holds the session (a store whose lock is a round trip: PostgreSQL's
        ``hold_soon``): the round trip goes on while the turn reads the request.  Nothing is asked
        when the first items do not tell the fork key (the turn asks as it would)."""
        hold_soon = getattr(self.store, "hold_soon", None)
        if hold_soon is None:
            return
        candidates = None
        if self.sessions.get(sid) is None:
            head = head_cores(lane, raws)
            if head is None:
                return
            candidates = self.lineage.head_of(sid, *head, lane.name)
        hold_soon(sid, candidates)

    def _memo_for(self, sid: str | None, lane: Lane, raws: list) -> Memo | None:
        if sid is not None:
            memo = self.sessions.memos.get(sid)
            return memo if memo is not None and memo.lane == lane.name else None
        # anonymous: the session is not known yet; the memo sharing the longest head is the candidate
        best, best_k = None, 0
        for memo in reversed(self.sessions.memos.values()):
            if memo.lane != lane.name or memo.chain is None or not memo.raws or not raws:
                continue
            if memo.raws[0] != raws[0]:
                continue
            k = coverage.common_prefix(memo.raws, raws)
            if k > best_k:
                best, best_k = memo, k
        return best

    def _chain(self, infos: list[ItemInfo], start: int, memo: Memo | None, k: int) -> list[str] | None:
        """The prefix-hash chain of an anonymous history (None: no usable signal)."""
        conv = infos[start:]
        if not any(p.core.role == "user" for info in conv for p in info.parts):
            return None
        reuse = k - start if memo is not None and memo.chain is not None and k > start else 0
        canon = []
        for info in conv[reuse:]:
            if info.canon is None:
                info.canon = canonical_item(info.obj)
            canon.append(info.canon)
        if not reuse and sum(len(c) for c in canon) < MIN_CANONICAL_BYTES:
            return None
        head = memo.chain[:reuse] if reuse else []
        return head + chain(canon, prev=bytes.fromhex(head[-1]) if head else b"")

    def _lineage(self, hook: str, *args):
        """A lineage hook; its failure costs the family, never the turn."""
        try:
            return getattr(self.lineage, hook)(*args)
        except Exception as e:
            log.warning("[bili] lineage %s failed (%s: %s); the session goes on on its own", hook, type(e).__name__,
                        printable(e))
            return None

    # -- ledger --------------------------------------------------------------------------------
    def _resolve(self, s: Session, infos: list[ItemInfo], counter: Counter, cov: dict, reused: int,
                 pinned: dict[int, list[Entry]] | None = None, vouched: list[str] | None = None,
                 prior: list[list[Resolved]] | tuple = ()) -> tuple[list[list[Resolved]], list[LedgerRow]]:
        """Attach a ref to every part: known by ``(msg_id, content_hash)``, else the next free one.

        A part appended after everything the previous pass had, whose id is covered by a fold but
        was not in that pass, is a new instance of the same words (the user said it again), not the
        folded original: it gets a fresh suffix.  Old content the host sends again further up (a
        truncation undone) is an echo and stays folded.  Where the pass is the canonical copy's at a
        place, a part takes the copy's instance there (:func:`_anchored_ids`); ``prior``: the parts of
        the ``reused`` items before ``infos``, as the previous pass resolved them.
        """
        hash_parts([p for info in infos for p in info.parts])  # (a first pass's parts are hashed when first read)
        new_rows: list[LedgerRow] = []
        next_ref = s.row.next_ref
        prev_ids = None
        appended_from = 0
        anchors = None
        if cov and s.copy.ids:
            prev_ids, prev_bases = _id_sets(s)
            if s.copy.branch:  # (on a rewound branch: its own newest pass's ids too)
                prev_ids = prev_ids | set(s.copy.branch)
                prev_bases = prev_bases | {i[:18] for i in s.copy.branch}
            appended_from = next((k + 1 for k in range(len(infos) - 1, -1, -1)
                                  if any(p.base in prev_bases for p in infos[k].parts)), 0)
            # (the copy's items not all reused as they were: its last one, the previous pass's, may have been a
            # prefill the agent completed, which is counted on from the reused ones as it was)
            if not s.copy.items or reused < s.copy.items[-1]:
                before = [r.base for ps in prior for r in ps]
                got = _anchored_ids(s.copy.ids, before + [p.base for info in infos for p in info.parts])
                anchors = got[len(before):] if got is not None else None
        out_all: list[list[Resolved]] = []
        refs, refs_get, counter_get = s.refs, s.refs.get, counter.get
        add_row, ref_of = new_rows.append, tags.ref_of
        at = -1  # (the part's place in the pass: its anchor)
        for k_item, info in enumerate(infos):
            out = []
            appended = k_item >= appended_from
            pins = pinned.get(k_item) if pinned else None
            for j, part in enumerate(info.parts):
                at += 1
                core, base, chash, dirty = part.core, part.base, part.chash, part.dirty
                if core.ctype == TEXT and core.role != "assistant" and core.text.startswith("<acp "):
                    core, base, chash, dirty = self._strip_own_tag(s, part)
                anchor = anchors[at] if anchors is not None and base == part.base else None
                if anchor is not None:  # the copy's instance at this place (the same words): its id
                    msg_id = anchor
                    n = int(anchor[19:]) if len(anchor) > 18 else 0
                    if counter_get(base, 0) <= n:
                        counter[base] = n + 1
                else:
                    n = counter_get(base, 0)
                    counter[base] = n + 1
                    msg_id = base if n == 0 else f"{base}_{n}"
                incs = 1
                entry = refs_get((msg_id, chash))
                if (entry is not None and prev_ids is not None and appended and entry.ref in cov
                        and msg_id not in prev_ids):
                    while True:  # a new instance: the next suffix that is neither live nor folded
                        n = counter[base]
                        counter[base] = n + 1
                        incs += 1
                        msg_id = f"{base}_{n}"
                        entry = refs_get((msg_id, chash))
                        if entry is None or (entry.ref not in cov and msg_id not in prev_ids):
                            break
                if pins is not None:
                    # the host vouches this message's id: its ref wins over content churn (the
                    # content key keeps whatever it already named; the vouched key names this ref)
                    if entry is None:
                        add_row(LedgerRow(msg_id, chash, pins[j].ref, core.role, core.ctype, pins[j].tokens))
                        refs[(msg_id, chash)] = pins[j]
                    entry = pins[j]
                elif entry is None:
                    entry = Entry(ref_of(next_ref), count_tokens(core.text))
                    next_ref += 1
                    add_row(LedgerRow(msg_id, chash, entry.ref, core.role, core.ctype, entry.tokens))
                    refs[(msg_id, chash)] = entry  # staged: forgotten again if the commit fails
                if vouched is not None:
                    key = (f"{vouched[reused + k_item]}#{j}", chash)
                    if key not in refs:
                        add_row(LedgerRow(key[0], chash, entry.ref, core.role, core.ctype, entry.tokens))
                        refs[key] = entry
                out.append(Resolved(core, entry, dirty, msg_id, base, incs))
            out_all.append(out)
        return out_all, new_rows

    def _unstage(self) -> None:
        """Drop what this process holds of a session whose staged commit was not written (its
        lineage record included: it may name refs the store never gave)."""
        for sid in self.sessions.unstage():
            self.lineage.forget(sid)  # as a restart would (registry.stages: nothing of it was pending before the turn)

    def _commit(self, s: Session, agent: str, lane: str, messages: int, new_rows: list[LedgerRow] | Rows,
                tail, fresh: bool = False, stage: bool = False) -> None:
        """``fresh``: every row gives its ref for the first time (kernel/fresh.py: ``new_rows`` are
        then made when they are written, their parts hashed then).  ``stage``: the session is as
        written at once in memory, its write waits for ``Sessions.flush`` (its row written as it is
        then: with the flags learned meanwhile); a write that fails then, or a turn that fails
        before it, drops the session from this process (``Engine._unstage``); the copy saved before
        the flush goes in it (``Sessions.save_copy``)."""
        row = s.row
        if fresh:  # every ref once, in order
            k = len(new_rows)
        else:
            minted: dict[str, str] = {}
            for r in new_rows:
                if r.ref not in s.owners:
                    minted.setdefault(r.ref, r.content_hash)
            given = list(minted.items())
            k = len(given)
        staged = SessionRow(
            row.id, agent, lane, row.created, row.last_seen, row.requests + 1, messages,
            row.next_ref + k, row.flags,
        )

        def write(copy: str | None = None, release: bool = False) -> None:
            rows = new_rows.get() if isinstance(new_rows, Rows) else new_rows
            if fresh:
                s.owners.update([(r.ref, r.content_hash) for r in rows])
            try:
                # fresh: the store keeps the rows' refs as the turn's without a second copy (schema 10);
                # copy: the canonical copy saved meanwhile (Sessions.save_copy), in the same write (schema 11);
                # release: the turn's last write of the session (Sessions.flush(last=True)): its lock goes with it
                s.stored = (self.store.commit_turn(staged, rows, tail, expect=s.stored, fresh=True, copy=copy,
                                                   release=release)
                            if fresh else self.store.commit_turn(staged, rows, tail, expect=s.stored,
                                                                 minted=given, copy=copy, release=release))
            except Exception:
                for r in rows:  # nothing of this turn is kept
                    s.refs.pop((r.msg_id, r.content_hash), None)
                self.sessions.memos.pop(row.id, None)
                raise

        if stage:
            self.sessions.stage(row.id, write)
        else:
            write()
        s.row = staged
        if not fresh:
            for r in new_rows:
                s.owners.setdefault(r.ref, r.content_hash)

    def _strip_own_tag(self, s: Session, part: Part) -> tuple[Core, str, str, bool]:
        """Remove the message's own stale tag (idempotent); a foreign tag is content and stays."""
        split = tags.split_own_tag(part.core.text)
        if split is not None:
            ref, rest = split
            stripped = msgspec.structs.replace(part.core, text=rest)
            base, chash = digest(stripped)
            # (a text the ledger holds as it is was taken so when first seen, its ref unknown then: the
            # words the user wrote, a tag among them; taken so again, whatever this process knows since)
            if s.owners.get(ref) == chash and (part.base, part.chash) not in s.refs:
                return stripped, base, chash, True
        return part.core, part.base, part.chash, part.dirty

    def _remember(self, lane: Lane, sid: str, s: Session, raws, infos, start, hashes, resolved, view_items,
                  counter: Counter, rendered, size: int = 0) -> None:
        if rendered is None:
            # only identity work was done (observe mode, a paused fold): refs and view are reusable,
            # rendered bytes are not
            rendered_items, changed_cum, tagged_cum = None, [0], [0]
        else:
            rendered_items, changed_cum, tagged_cum = rendered
        version = s.version
        self.sessions.remember(Memo(lane.name, sid, version, raws, infos, start, hashes, resolved, view_items,
                                    rendered_items, changed_cum, tagged_cum, counter, size))


# -- helpers -----------------------------------------------------------------------------------

def _writes_after(eng: Engine, s: Session, lane: str, snap, active: bool, names: list[str] | None,
                  conversation: bool) -> bool:
    """Whether a turn may write its session after the flush before rendering (then that flush is not
    its last write): held folds landing (``Engine._land``), the transcript (``snapshot_render``), the
    native-tools flag, a cache lifetime chosen at a cold moment (``pressure.upgrade_lifetime``; cold
    a second later counts: the turn's clock moves on).  ``names``: the tool names read before the
    flush (None: unread).  A write it does not foresee stays correct: the store takes the session's
    lock again first (PgStore._again)."""
    flags = s.flags
    if flags.get(pending.FLAG) or snap:
        return True
    unset = flags.get("native_tools") != True  # noqa: E712 (as set_flag compares: a flag to write)
    if (eng.inject and active and conversation and unset
            and (names is None or _natively(names))):
        return True
    try:
        return bool(active and lane == "anthropic" and (flags.get(lifetime.FLAG) or {}).get("choice") != lifetime.HOUR
                    and eng.clocks.cold(s.row.id, eng.now() + 1.0))
    except Exception:  # (whatever fails here fails below as it would)
        return True


def _natively(names: list[str]) -> bool:
    """Whether the agent's own tools include bili's (its MCP server: ``mcp__bili__compress``, ...)."""
    for n in names:  # (a loop, not any() over a generator: read twice a turn)
        if "bili" in n and n.endswith("compress"):
            return True
    return False


def _system_run(infos: list[ItemInfo]) -> int:
    start = 0  # the leading system run is environment, not conversation
    while start < len(infos) and infos[start].is_system:
        start += 1
    return start


def _anchored_ids(ids: list[str], bases: list[str]) -> list[str | None] | None:
    """The ledger id each part of a pass takes from the session's canonical copy (``ids``: the copy's,
    in order), where the pass is the copy at that place: the parts the two begin with, and the copy's
    rest after a run of it the host dropped (its oldest turns, or those after its first: a rolling
    window), each verified by its words (its base).  A word said several times is told apart by its
    instance number, counted in the pass: with instances dropped before it, the count named another
    instance (a folded one, whose summary then took the place of the live words).  None: nothing of
    the pass is anchored."""
    n = len(ids)
    copy_bases = [i[:18] for i in ids]
    a = 0
    for a, (x, y) in enumerate(zip(bases, copy_bases)):  # (the two begin alike up to ``a``)
        if x != y:
            break
    else:
        a = min(len(bases), n)
    out: list[str | None] = list(ids[:a]) + [None] * (len(bases) - a)
    if a < n and a < len(bases):
        first = bases[a]
        for d in range(a + 1, n - 1):  # (at least two parts of the copy's rest: never one word's chance)
            if copy_bases[d] == first and bases[a:a + n - d] == copy_bases[d:]:
                out[a:a + n - d] = ids[d:]
                break
    return out if any(x is not None for x in out) else None


def _id_sets(s: Session) -> tuple[set[str], set[str]]:
    """The ledger ids of the session's canonical copy and their bases, as sets.  A folded session's
    every turn reads them (~1,500 ids at 1,000 messages: ~0.17 ms to build); a turn's copy is the
    previous one's ids and the new items' (coverage.roll_copy), so the sets of the previous copy are
    extended by what follows the ids they were built from (kept as a list of their own), and built
    again when the copy is not such an extension."""
    ids = s.copy.ids
    got = s.id_sets
    if got is not None:
        seen, id_set, bases = got
        n = len(seen)
        if len(ids) >= n and ids[:n] == seen:
            if len(ids) > n:
                more = ids[n:]
                id_set.update(more)
                bases.update([i[:18] for i in more])
                seen += more
            return id_set, bases
    s.id_sets = (list(ids), set(ids), {i[:18] for i in ids})
    return s.id_sets[1], s.id_sets[2]


def _prefix_counter(memo: Memo | None, q: int) -> Counter:
    """Instance counts of base ids over the first ``q`` conversation items of the previous pass."""
    # (made as ``Counter()`` and ``Counter(memo.bases)`` make them, the same items in the same order,
    # without their Python-level __init__ and update: every turn makes one)
    counts = _new_counter(Counter)
    if memo is None or q == 0:
        return counts
    _dict_update(counts, memo.bases)
    for parts in memo.resolved[q:]:
        for r in parts:
            counts[r.base] -= r.incs
    return counts


_new_counter = dict.__new__
_dict_update = dict.update


def _opening(view: View) -> str | None:
    """The ref of a view's first part (its conversation's opening message), None for none."""
    for it in view.items:
        if it.parts:
            return it.parts[0].ref
    return None


def _view_items(resolved: list[list[Resolved]], first_index: int) -> list[ViewItem]:
    out = []
    for k, parts in enumerate(resolved, first_index):
        views = []
        for r in parts:
            core, entry = r.core, r.entry
            views.append(PartView(entry.ref, core.role, core.ctype, core.tool_name, core.tool_call_id, core.text,
                                  entry.tokens))
        out.append(ViewItem(k, views))
    return out

