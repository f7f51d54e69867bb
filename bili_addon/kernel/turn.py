"""One request body through the kernel: identity, ledger, tags, hygiene.

``Engine.process`` takes the decoded body bytes of a model request and returns the bytes to send
upstream (or None when they are unchanged).  It never mutates the caller's input; the store write
of a turn happens before any rendered ref leaves, so a ref the model sees is always persisted.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec

from bili_addon.kernel import fold, nudge, surfaces, tags
from bili_addon.kernel.fold import Block, FoldConfig, PartView, View, ViewItem
from bili_addon.kernel.identity import InstanceCounter, count_tokens, digest
from bili_addon.kernel.prompts import SYSTEM_PROMPT, TOOLS
from bili_addon.kernel.windows import context_window
from bili_addon.kernel.sessions import (
    MIN_CANONICAL_BYTES,
    PrefixAffinity,
    agent_of,
    canonical_item,
    chain,
    session_from_request,
)
from bili_addon.store import LedgerRow, SessionRow, Store
from bili_addon.stream.echo import strip_echoes
from bili_addon.wire import Lane, hygiene
from bili_addon.wire.base import TEXT, TOOL_CALL, TOOL_RESULT, Body, Core, decode_any, patch_many

log = logging.getLogger("bili")

PROSE_ROLES = ("user", "assistant")
_SMALL_TOP_KEYS = ("session_id", "metadata", "prompt_cache_key", "model", "previous_response_id")
# the one-line visibility markers the addon may add to a response; stripped when replayed
MARKER_LINE = re.compile(r"^\[bili\] [^\n]*(?:\n|$)")


def clean_replayed_prose(text: str) -> str:
    """What the host replays of the model's prose, minus our markers and the model's tag echoes
    (with the blank lines they drag along)."""
    while MARKER_LINE.match(text):
        text = MARKER_LINE.sub("", text, count=1)
    return strip_echoes(text)


class Part(msgspec.Struct, gc=False):
    """A core (prose already cleaned) with its identity digest, computed once per distinct item bytes."""

    core: Core
    base: str  # h_ + 16 hex
    chash: str  # full sha256 hex of the seed
    dirty: bool  # the wire text differs from core.text (cleaned at ingress)


class ItemInfo(msgspec.Struct, gc=False):
    is_system: bool
    parts: list[Part]
    obj: Any
    canon: bytes | None = None  # canonical form, computed for anonymous sessions only


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
            dirty = False
            if core.role == "assistant" and core.ctype == TEXT:
                clean = clean_replayed_prose(core.text)
                if clean != core.text:
                    core, dirty = msgspec.structs.replace(core, text=clean), True
            base, chash = digest(core)
            parts.append(Part(core, base, chash, dirty))
        info = ItemInfo(lane.is_system_item(obj), parts, obj)
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
class Call:
    """A proxy tool call the model made; ``result`` stays None until it is executed, exactly once."""

    name: str
    args: str
    result: str | None = None


@dataclass
class Session:
    row: SessionRow
    refs: dict[tuple[str, str], Entry] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # ref -> content hash
    render_cache: dict[bytes, tuple[tuple, bytes]] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)
    calls: dict[str, Call] = field(default_factory=dict)
    model: str = ""
    last_view: View | None = None  # the conversation as the last request showed it
    sent_tokens: int = 0  # the last request, as sent
    unfolded_tokens: int = 0  # the last request, had nothing been folded


@dataclass
class TurnResult:
    body: bytes | None
    session: str = ""
    lane: str = ""
    messages: int = 0
    refs_new: int = 0
    refs_known: int = 0
    tagged: int = 0
    source: str = ""
    notes: list[str] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)  # proxy tools run for this request
    marker: str = ""  # the visibility line for this request's answer
    folded_items: int = 0


@dataclass
class _Resolved:
    core: Core
    entry: Entry
    dirty: bool


class Engine:
    """The kernel side of the addon: sessions, ledger and tags over a :class:`Store`."""

    def __init__(self, store: Store, max_sessions: int = 256, fold_cfg: FoldConfig | None = None,
                 inject: bool = True, window: int = 0):
        self.store = store
        self.items = ItemCache()
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = max_sessions
        self.affinity = PrefixAffinity(store.affinity())
        self.fold_cfg = fold_cfg or FoldConfig()
        self.nudge_cfg = nudge.NudgeConfig()
        self.inject = inject
        self.window = window  # 0: from the model table

    # -- sessions ------------------------------------------------------------------------------
    def session(self, sid: str, agent: str = "", lane: str = "") -> Session:
        s = self.sessions.get(sid)
        if s is not None:
            self.sessions.move_to_end(sid)
            return s
        row = self.store.session(sid)
        if row is None:
            now = time.time()
            row = SessionRow(sid, agent, lane, now, now, 0, 0, 1)
        s = Session(row, flags=json.loads(row.flags or "{}"))
        for r in self.store.ledger(sid):
            s.refs[(r.msg_id, r.content_hash)] = Entry(r.ref, r.tokens)
            s.owners[r.ref] = r.content_hash
        s.blocks = [Block(**json.loads(doc)) for doc in self.store.blocks(sid)]
        s.blocks.sort(key=lambda b: b.number)
        s.calls = {k: Call(n, a, r) for k, n, a, r in self.store.calls(sid)}
        self.sessions[sid] = s
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return s

    def set_flag(self, sid: str, key: str, value: Any) -> bool:
        """Persist a learned per-session fact; True when it changed."""
        s = self.session(sid)
        if s.flags.get(key) == value:
            return False
        s.flags[key] = value
        s.row.flags = json.dumps(s.flags, sort_keys=True)
        self.store.set_flags(s.row)
        return True

    def _identify(self, headers: Mapping[str, str], top: dict, infos: list[ItemInfo], start: int):
        ident = session_from_request(headers, top)
        if ident is not None:
            return ident[0], ident[1], None
        canon = []
        for info in infos[start:]:
            if info.canon is None:
                info.canon = canonical_item(info.obj)
            canon.append(info.canon)
        has_user = any(p.core.role == "user" for info in infos[start:] for p in info.parts)
        if not has_user or sum(len(c) for c in canon) < MIN_CANONICAL_BYTES:
            return None, "no conversation identity", None
        hashes = chain(canon)
        sid = self.affinity.resolve(hashes)
        return sid, "prefix", (len(hashes), hashes[-1])

    # -- the turn ------------------------------------------------------------------------------
    def process(
        self, raw: bytes, lane: Lane, headers: Mapping[str, str], *, render: bool, origin: str = ""
    ) -> TurnResult:
        body = Body(raw, lane.conv_key)
        top = {k: body.get(k) for k in _SMALL_TOP_KEYS if k in body.top}
        infos = [self.items.get(lane, bytes(it)) for it in body.items]
        start = 0  # the leading system run is environment, not conversation
        while start < len(infos) and infos[start].is_system:
            start += 1

        sid, source, tail = self._identify(headers, top, infos, start)
        if sid is None:
            return TurnResult(None, lane=lane.name, messages=len(infos), source=source)
        agent = agent_of(headers)
        s = self.session(sid, agent, lane.name)
        if isinstance(top.get("model"), str):
            s.model = top["model"]
        result = TurnResult(None, session=sid, lane=lane.name, messages=len(infos) - start, source=source)

        resolved, new_rows = self._resolve(s, infos[start:])
        result.refs_new, result.refs_known = len(new_rows), sum(map(len, resolved)) - len(new_rows)
        self._commit(s, agent, lane.name, len(infos) - start, new_rows, tail)
        if tail:
            self.affinity.note(sid, *tail)
        if isinstance(top.get("previous_response_id"), str) and top["previous_response_id"]:
            if self.set_flag(sid, "delta_history", True):
                result.notes.append(
                    "the agent sends only new items plus previous_response_id: the proxy cannot see "
                    "this session's history, so nothing of it will ever be folded"
                )
        if not render:
            return result

        view = _view(resolved, start)
        s.last_view = view
        if s.calls:
            self._run_calls(s, view, result)
        if self.inject:
            self._pressure(s, view, resolved)
        items_out = [bytes(it) for it in body.items]
        changed = self._render(s, items_out, infos, start, resolved, result)
        changed |= self._substitute_calls(s, lane, items_out, infos, view)
        changed |= self._hygiene(s, lane.name, items_out, infos, top, origin, result)
        changed |= self._assemble(s, lane, items_out, start, view, result)
        if self.inject:
            names = lane.tool_names(body) or []
            native = any("bili" in n and n.endswith("compress") for n in names)
            if native and self.set_flag(sid, "native_tools", True):
                result.notes.append("the agent has bili's tools natively (MCP): wire injection is off for it")
            changed |= lane.inject(body, items_out, start, [] if native else list(TOOLS), SYSTEM_PROMPT)
        if changed:
            result.body = body.encode(items_out)
        return result

    # -- proxy tools ---------------------------------------------------------------------------
    def record_calls(self, sid: str, calls: list[tuple[str, str, str]]) -> None:
        """Proxy tool calls seen in an answer; each runs once, when the next request carries it."""
        s = self.session(sid)
        fresh = [c for c in calls if c[0] not in s.calls]
        if fresh:
            self.store.record_calls(sid, fresh)
            for key, name, args in fresh:
                s.calls[key] = Call(name, args)

    def run_tool(self, s: Session, name: str, args: Any, view: View | None, call_id: str = "") -> str:
        """Execute one proxy tool against the conversation as this request shows it."""
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return f"{name}: the arguments are not valid JSON."
        view = view or View([])
        sid = s.row.id
        if name == "compress":
            out = fold.compress(args, view, s.blocks, self.fold_cfg, call_id)
            if out.blocks:
                s.blocks.extend(out.blocks)
                changed = out.blocks + out.deactivated
                self.store.commit_fold(
                    sid,
                    [(b.id, json.dumps(b.__dict__), b.active) for b in changed],
                    [(p.ref, p.role, p.ctype, p.tool_name, p.tool_call_id, p.text, p.tokens) for p in out.originals],
                    [],
                )
            return out.text
        originals = lambda refs: self.store.originals(sid, refs)  # noqa: E731
        if name == "decompress":
            return surfaces.decompress(args, s.blocks, originals)
        if name == "search_context":
            return surfaces.search_context(args, s.blocks, originals)
        if name == "acp_status":
            usage = self.store.usage(sid).last
            window = self.window_for(s)
            return surfaces.status(view, s.blocks, self.fold_cfg, (usage[0], window) if usage else None)
        return f"Unknown bili tool {name!r}."

    def plugin_tool(self, sid: str | None, tool: str, args: Any) -> tuple[str, str]:
        """A tool called natively (MCP) rather than on the wire: ``(session id, result)``.

        Without a session id the most recently active session is used.  Ranges resolve against the
        conversation as its last request showed it; a fold shows from the next request on.
        """
        if not sid:
            rows = self.store.sessions()
            if not rows:
                raise LookupError("no conversation has gone through the proxy yet")
            sid = rows[0].id
        elif self.store.session(sid) is None and sid not in self.sessions:
            raise LookupError(f"unknown conversation {sid!r}")
        s = self.session(sid)
        return sid, self.run_tool(s, tool, args, s.last_view)

    def window_for(self, s: Session) -> int:
        learned = s.flags.get("learned_windows", {}).get(s.model)
        return int(learned) if learned else (self.window or context_window(s.model))

    def _run_calls(self, s: Session, view: View, result: TurnResult) -> None:
        done: list[tuple[str, str]] = []
        for it in view.items:
            for p in it.parts:
                if p.ctype != TOOL_CALL:
                    continue
                key = p.tool_call_id or f"name:{p.tool_name}"
                call = s.calls.get(key)
                if call is None or call.result is not None:
                    continue
                before = {b.id for b in s.blocks}
                call.result = self.run_tool(s, call.name, call.args, view, key)
                done.append((key, call.result))
                result.executed.append(call.name)
                made = [b for b in s.blocks if b.id not in before]
                if made:
                    saved = sum(b.folded_tokens - b.summary_tokens for b in made)
                    spans = ", ".join(f"{b.covered[0]}–{b.covered[-1]} → {b.id}" for b in made)
                    result.marker = f"[bili] compressed {spans}, ~{tags.format_tokens(max(0, saved))} tokens saved"
        if done:
            self.store.commit_fold(s.row.id, [], [], done)

    def _substitute_calls(self, s: Session, lane: Lane, items_out: list[bytes], infos: list[ItemInfo],
                          view: View) -> bool:
        """Executed calls: the call as the model made it, the real result in place of the agent's error."""
        changed = False
        cut = s.flags.get("truncated", {})
        for it in view.items:
            for p in it.parts:
                key = p.tool_call_id or (f"name:{p.tool_name}" if p.tool_name else "")
                call = s.calls.get(key)
                if call is None and p.ref in cut and p.ctype == TOOL_RESULT and key:
                    edits = lane.result_edits(infos[it.index].obj, key, cut[p.ref])
                    if edits:
                        items_out[it.index] = patch_many(items_out[it.index], edits)
                        changed = True
                    continue
                if call is None or call.result is None:
                    continue
                obj = infos[it.index].obj
                if p.ctype == TOOL_CALL:
                    edits = lane.call_edits(obj, key, call.name, call.args)
                elif p.ctype == TOOL_RESULT:
                    edits = lane.result_edits(obj, key, call.result)
                else:
                    continue
                if edits:
                    items_out[it.index] = patch_many(items_out[it.index], edits)
                    changed = True
        return changed

    def _pressure(self, s: Session, view: View, resolved: list[list[_Resolved]]) -> None:
        """Nudge and emergency truncation, decided from the usage the last answer reported."""
        last = self.store.usage(s.row.id).last
        if not last or not view.items:
            return
        used, window = last[0], self.window_for(s)
        nudges = dict(s.flags.get("nudges", {}))
        newest = resolved[-1]
        if newest and not any(r.entry.ref in nudges for r in newest):
            text = nudge.decide(view, s.blocks, self.fold_cfg, self.nudge_cfg, used, window,
                                int(s.flags.get("last_nudge_at", 0)))
            if text:
                prose = [r for r in newest if r.core.role == "user" and r.core.ctype == TEXT and r.core.path
                         and r.core.text.strip()]
                ref = (prose[-1] if prose else newest[-1]).entry.ref
                nudges[ref] = {"text": text, "how": "suffix" if prose else "item"}
                self.set_flag(s.row.id, "nudges", nudges)
                self.set_flag(s.row.id, "last_nudge_at", used)
        cut = nudge.truncations(view, s.blocks, self.fold_cfg, self.nudge_cfg, used, window)
        known = s.flags.get("truncated", {})
        if any(ref not in known for ref in cut):
            self.set_flag(s.row.id, "truncated", {**cut, **known})

    @staticmethod
    def _spent_calls(s: Session, view: View, keep_failed: int = 2) -> set[str]:
        """Refs of compress calls (and their results) that no longer say anything: their blocks
        were all distilled into later ones, or they failed and newer failures exist."""
        failed, spent = [], []
        for key, call in s.calls.items():
            if call.name != "compress" or call.result is None:
                continue
            made = [b for b in s.blocks if b.call_id == key]
            if not made:
                failed.append(key)
            elif not any(b.active for b in made):
                spent.append(key)
        spent += failed[: max(0, len(failed) - keep_failed)]
        if not spent:
            return set()
        keys = set(spent)
        return {p.ref for it in view.items for p in it.parts if (p.tool_call_id or "") in keys}

    def _assemble(self, s: Session, lane: Lane, items_out: list[bytes], start: int, view: View,
                  result: TurnResult) -> bool:
        """Covered items leave the wire; each active block's summary stands where its range began;
        a reminder that needs an item of its own follows the item it was given after."""
        unfolded = sum(it.tokens for it in view.items)
        s.unfolded_tokens = s.sent_tokens = unfolded
        hidden = self._spent_calls(s, view)
        plan = (fold.plan(view, s.blocks, hidden) if hidden or any(b.active for b in s.blocks)
                else fold.Plan(set(), {}, []))
        after = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "item"}
        nudge_at = {k for k, it in enumerate(view.items) if after and set(it.refs) & after.keys()}
        if not plan.drop and not plan.inserts and not nudge_at:
            return False
        out: list[bytes] = items_out[:start]
        for k, it in enumerate(view.items):
            for b in plan.inserts.get(k, ()):
                out.append(lane.summary_item(b.text()))
            if k not in plan.drop:
                out.append(items_out[it.index])
            if k in nudge_at:
                out.extend(lane.summary_item(after[r]) for r in it.refs if r in after)
        out.extend(items_out[start + len(view.items):])
        items_out[:] = out
        result.folded_items = len(plan.drop)
        s.sent_tokens = (unfolded - sum(view.items[k].tokens for k in plan.drop)
                         + sum(count_tokens(b.text()) for b in plan.rendered))
        return True

    def _resolve(self, s: Session, infos: list[ItemInfo]) -> tuple[list[list[_Resolved]], list[LedgerRow]]:
        """Attach a ref to every part: known by ``(msg_id, content_hash)``, else the next free one."""
        counter = InstanceCounter()
        new_rows: list[LedgerRow] = []
        next_ref = s.row.next_ref
        resolved: list[list[_Resolved]] = []
        for info in infos:
            out = []
            for part in info.parts:
                core, base, chash, dirty = part.core, part.base, part.chash, part.dirty
                if core.ctype == TEXT and core.role != "assistant" and core.text.startswith("<acp "):
                    core, base, chash, dirty = self._strip_own_tag(s, part)
                msg_id = counter(base)
                entry = s.refs.get((msg_id, chash))
                if entry is None:
                    entry = Entry(tags.ref_of(next_ref), count_tokens(core.text))
                    next_ref += 1
                    new_rows.append(LedgerRow(msg_id, chash, entry.ref, core.role, core.ctype, entry.tokens))
                out.append(_Resolved(core, entry, dirty))
            resolved.append(out)
        return resolved, new_rows

    def _commit(self, s: Session, agent: str, lane: str, messages: int, new_rows: list[LedgerRow], tail) -> None:
        row = s.row
        staged = SessionRow(
            row.id, agent, lane, row.created, row.last_seen, row.requests + 1, messages,
            row.next_ref + len(new_rows), row.flags,
        )
        self.store.commit_turn(staged, new_rows, tail)  # raises: nothing of this turn is kept
        s.row = staged
        for r in new_rows:
            s.refs[(r.msg_id, r.content_hash)] = Entry(r.ref, r.tokens)
            s.owners[r.ref] = r.content_hash

    def _strip_own_tag(self, s: Session, part: Part) -> tuple[Core, str, str, bool]:
        """Remove the message's own stale tag (idempotent); a foreign tag is content and stays."""
        split = tags.split_own_tag(part.core.text)
        if split is not None:
            ref, rest = split
            stripped = msgspec.structs.replace(part.core, text=rest)
            base, chash = digest(stripped)
            if s.owners.get(ref) == chash:
                return stripped, base, chash, True
        return part.core, part.base, part.chash, part.dirty

    def _render(self, s: Session, items_out: list[bytes], infos: list[ItemInfo], start: int,
                resolved: list[list[_Resolved]], result: TurnResult) -> bool:
        changed = False
        cache: dict[bytes, tuple[tuple, bytes]] = {}
        last = len(infos) - 1
        nudges = {ref: n for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "suffix"}
        for k, parts in enumerate(resolved):
            i = start + k
            edits = []
            for r in parts:
                core = r.core
                prefill = i == last and core.role == "assistant"
                suffix = nudges.get(r.entry.ref, {}).get("text") if nudges else None
                if _taggable(core, prefill=prefill):
                    text = tags.render(r.entry.ref, r.entry.tokens, core.ctype, core.text)
                    edits.append((core.path, text + "\n\n" + suffix if suffix else text))
                elif r.dirty and core.path:
                    edits.append((core.path, core.text))
            if not edits:
                continue
            src = items_out[i]
            sig = tuple(edits)
            hit = s.render_cache.get(src)
            out = hit[1] if hit is not None and hit[0] == sig else patch_many(src, edits)
            cache[src] = (sig, out)
            result.tagged += sum(1 for _p, text in edits if text.startswith("<acp "))
            if out != src:
                items_out[i] = out
                changed = True
        s.render_cache = cache
        return changed

    def _hygiene(self, s: Session, lane: str, items_out: list[bytes], infos: list[ItemInfo],
                 top: dict, origin: str, result: TurnResult) -> bool:
        changed = False
        for i, info in enumerate(infos):
            edits = hygiene.proxy_id_edits(lane, info.obj)
            if edits:
                items_out[i] = patch_many(items_out[i], edits)
                changed = True
        model = top.get("model") if isinstance(top.get("model"), str) else ""
        if not (s.flags.get("strict_reasoning") or hygiene.strict_by_name(origin, model)):
            return changed
        if lane == "chat":
            for i, info in enumerate(infos):
                edits = hygiene.strict_chat_edits(info.obj)
                if edits:
                    items_out[i] = patch_many(items_out[i], edits)
                    changed = True
        elif lane == "responses":
            inserts = hygiene.strict_responses_inserts([info.obj for info in infos])
            for i in reversed(inserts):
                items_out.insert(i, hygiene.EMPTY_REASONING)
            changed |= bool(inserts)
        return changed


def _view(resolved: list[list[_Resolved]], start: int) -> View:
    return View([
        ViewItem(start + k, [
            PartView(r.entry.ref, r.core.role, r.core.ctype, r.core.tool_name, r.core.tool_call_id, r.core.text,
                     r.entry.tokens)
            for r in parts
        ])
        for k, parts in enumerate(resolved)
    ])


def _taggable(core: Core, *, prefill: bool) -> bool:
    return (
        core.ctype == TEXT
        and core.role in PROSE_ROLES
        and bool(core.path)
        and not prefill
        and bool(core.text.strip())
    )
