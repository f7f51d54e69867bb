"""The proxy tools: recorded from the model's answer, executed once on the next request, their real
result put in place of the agent's "unknown tool" error on this and every later turn.

An executed ``compress`` call shows, in place of each summary that stands in the conversation as its
block, a pointer to that block (:func:`shown_args`): the summary is on the wire once, where its range
was, instead of twice until the call itself is folded (read on every request, written with every
fold).  The store keeps the call as the model made it."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from bili_addon import printable, private
from bili_addon.kernel import coverage, fold, pending, surfaces, tags
from bili_addon.kernel.fold import View
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import Call, ItemInfo, Session, TurnResult
from bili_addon.store import StaleSession
from bili_addon.wire import Lane
from bili_addon.wire.base import TOOL_CALL, TOOL_RESULT, idless_call_key

log = logging.getLogger("bili")

if TYPE_CHECKING:
    from bili_addon.kernel.calibration import Calibration
    from bili_addon.kernel.cache import Clocks
    from bili_addon.kernel.fold import FoldConfig
    from bili_addon.kernel.native import NativeCalls
    from bili_addon.kernel.nudge import NudgeConfig
    from bili_addon.kernel.registry import Sessions
    from bili_addon.store import Store


@functools.lru_cache(maxsize=4096)
def call_key(tool_call_id: str, tool_name: str, args: str = "") -> str:
    """Calls are keyed by their id; a call without one (Gemini) by its name and arguments (hashed:
    cached, since every Gemini request pairs the id-less calls of its whole history again)."""
    if tool_call_id:
        return tool_call_id
    return idless_call_key(tool_name, args) if tool_name else ""


def replays(core, call: Call) -> bool:
    """Whether a call part of the history is the agent's replay of the recorded proxy call ``call``
    under its id: bili's tool under its name as the host re-sends an unknown tool's call (as it came,
    ``_compress`` (omp), ``mcp__..__compress``; its arguments the same JSON, whatever their spacing or
    key order), or opencode's ``invalid`` call naming it (its arguments gone).  A provider that
    numbers its calls per answer (``call_0``) gives the id again to the agent's own later calls: those
    are not it, nor is another call of bili's tool the store never recorded under that id."""
    name = core.tool_name
    if name == "invalid":
        try:
            doc = json.loads(core.text)
        except ValueError:
            return False
        return isinstance(doc, dict) and doc.get("tool") == call.name
    if name != call.name and name.lstrip("_") != call.name and name.rsplit("__", 1)[-1] != call.name:
        return False
    if core.text == call.args:
        return True
    try:
        return json.loads(core.text or "{}") == json.loads(call.args or "{}")
    except ValueError:
        return False


def paired(s: Session, parts, idless: dict[str, list[str]], called: dict[str, bool] | None, first_call,
           nth: dict[str, int]):
    """The call and result parts of one item (``parts``: ``(core, ref)`` pairs, in order) that stand
    for a recorded proxy call, as ``(core, ref, key, target, call)``: ``call`` the executed call the part
    is shown as (the call as the model made it, or its real result in place of the agent's error), or
    None for a part of the agent's own with a key (an output the emergency truncation may have cut).
    ``idless``: per tool name, the keys of the calls without ids seen so far, which results without a
    matching id pair with, in order (carried from item to item).  ``first_call(id)``: the ref of the
    first call part with that id in the request; a recorded call is that one, since a provider that
    numbers its calls per answer (``call_0``) gives an id again, to the agent's own later calls, which
    are left as they are, with their results (``called``: per id, whether its latest call part seen
    so far was the recorded one).  ``nth``: id-less results of one tool in this item, which one each is."""
    for core, ref in parts:
        if core.ctype not in (TOOL_CALL, TOOL_RESULT):
            continue
        if core.ctype == TOOL_CALL:
            key = call_key(core.tool_call_id, core.tool_name, core.text)
            if not core.tool_call_id and key:
                idless.setdefault(core.tool_name, []).append(key)
            target = key
        else:
            # a result is edited under its own key; it answers the call with its id, or the
            # oldest unanswered id-less call of its tool (agents may invent ids for those)
            key = core.tool_call_id or (f"name:{core.tool_name}" if core.tool_name else "")
            if key and not core.tool_call_id:
                nth[key] = nth.get(key, -1) + 1
            target = key if key in s.calls else None
            if target is None and idless.get(core.tool_name):
                target = idless[core.tool_name].pop(0)
        if not key:
            continue
        call = s.calls.get(target) if target else None
        if call is None:
            yield core, ref, key, target, None
            continue
        if call.result is None:
            continue
        cid = core.tool_call_id
        if core.ctype == TOOL_CALL and cid and not replays(core, call):
            if called is not None:
                called[cid] = False  # (its result too is the agent's own)
            continue
        if cid and called is not None:
            if core.ctype == TOOL_CALL:
                called[cid] = first_call is None or first_call(cid) in (None, ref)
            if called.get(cid) is False:
                continue  # the id given again, to another call: the agent's own
        yield core, ref, key, target, call


def shown_results(s: Session, view: View) -> dict[str, str]:
    """The result parts of ``view`` the model is shown an executed call's result in (in place of the
    agent's "unknown tool" error), paired as rendering pairs them (:func:`paired`): ref -> that result.
    What a fold keeps of such a part, for decompress and search to give what the model saw."""
    if not s.calls:
        return {}
    firsts: dict[str, str] = {}
    for it in view.items:
        for p in it.parts:
            cid = p.tool_call_id
            if p.ctype == TOOL_CALL and cid and cid not in firsts:
                call = s.calls.get(cid)
                if call is not None and replays(p, call):
                    firsts[cid] = p.ref
    idless: dict[str, list[str]] = {}
    called: dict[str, bool] = {}
    out: dict[str, str] = {}
    for it in view.items:
        for core, ref, _key, _target, call in paired(s, [(p, p.ref) for p in it.parts], idless, called,
                                                     firsts.get, {}):
            if call is not None and core.ctype == TOOL_RESULT:
                out[ref] = call.result
    return out


def export_dir(data_dir: Path, sid: str) -> Path:
    """The session's export folder, ``<data dir>/exports/<session>``, created 0700.  Its name is made
    from the session id (safe characters and a hash); a folder that resolves outside the data dir (a
    link someone put there) is refused with OSError."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "_", sid)[:48].strip("_") or "session"
    folder = data_dir / private.EXPORTS / f"{safe}-{hashlib.sha256(sid.encode()).hexdigest()[:8]}"
    private.private_dir(data_dir)
    for d in (folder.parent, folder):
        if os.path.islink(d):
            raise OSError(f"{d} is a link; bili writes only inside its data directory")
        private.private_dir(d)
    real, root = os.path.realpath(folder), os.path.realpath(data_dir)
    if os.path.commonpath([real, root]) != root:
        raise OSError(f"{folder} leads outside bili's data directory")
    return folder


class ToolHost(Protocol):
    """What the proxy tools need of the engine they are mixed into (and their own entry points,
    which call each other)."""

    store: Store
    sessions: Sessions
    fold_cfg: FoldConfig
    nudge_cfg: NudgeConfig
    clocks: Clocks
    calibration: Calibration
    native: NativeCalls

    def window_for(self, s: Session) -> int: ...

    def record_calls(self, sid: str, calls: list[tuple[str, str, str]]) -> None: ...

    def run_tool(self, s: Session, name: str, args: Any, view: View | None, call_id: str = "",
                 snoozed: frozenset[str] = frozenset()) -> str: ...

    def defer_fold(self, s: Session, made: list, gone: list, view: View) -> dict | None: ...


def written_for_an_hour(turn: Any, write: int, choice: str | None) -> int:
    """The part of a reported cache write made for 1 hour, when the provider did not split it: as
    the request asked (the cache model read its breakpoints' lifetimes: its predicted 1-hour share of
    the writes), or, without a prediction of writes, the session's lifetime choice ("1h": all)."""
    bill = getattr(turn, "predicted", None)
    if bill is not None and bill.write + bill.write_long > 0:
        return round(write * bill.write_long / (bill.write + bill.write_long))
    return write if choice == "1h" else 0


class ProxyTools:
    """Mixed into the :class:`Engine`; what it uses of it is :class:`ToolHost`."""

    def record_calls(self: ToolHost, sid: str, calls: list[tuple[str, str, str]]) -> None:
        """Proxy tool calls seen in an answer; each runs once, when the next request carries it."""
        for attempt in range(2):
            s = self.sessions.load(sid, fresh=True)
            seen: set[str] = set()  # (an id twice in one answer: its first call, as the store keeps it)
            fresh = [c for c in calls if c[0] not in s.calls and not (c[0] in seen or seen.add(c[0]))]
            if not fresh:
                return
            try:
                s.stored = self.store.record_calls(sid, fresh, expect=s.stored)
            except StaleSession:  # another process wrote the session meanwhile: reload, record again
                self.sessions.forget(sid)
                if attempt:
                    raise
                continue
            for key, name, args in fresh:
                s.calls[key] = Call(name, args)
            return

    def record_answer(self: ToolHost, sid: str, lane: str, rw: Any, side: bool = False) -> list[str]:
        """What one model answer leaves behind (``rw``: its ResponseRewriter, once the answer is
        complete): the proxy tool calls it made, when they reached the agent through the addon,
        and the usage it reported (``side``: the answer of a side request, ``TurnResult.side``: its
        usage counts in the totals, not as the conversation's size).  Returns the names of the calls
        recorded."""
        called = []
        if rw.calls and rw.rewrite:
            self.record_calls(sid, rw.calls)
            called = [name for _k, name, _a in rw.calls]
        u = rw.usage
        if u.seen:
            self.store.record_usage(sid, lane, (u.input, u.cache_read, u.cache_write, u.output), last=not side)
        if side:  # (its request was not noted on the conversation's cache clock: kernel/turn.py)
            return called
        # the cache model bills the request now (off its path); the reported usage calibrates it
        # (an answer without a figure of its cache reads is billed, but teaches the cache model nothing)
        known = u.seen and u.cache_known
        turn = self.clocks.report(sid, u.cache_read if known else None, u.cache_write if known else None,
                                  u.input if known else None)
        if u.seen and u.cache_write and u.split != "reported":  # the meter prices each lifetime at its rate
            s = self.sessions.get(sid)
            u.cache_write_1h = written_for_an_hour(turn, u.cache_write, (s.flags.get("ttl") or {}).get("choice")
                                                   if s is not None else None)
            u.split = "sent"
        try:
            self.calibration.observe(sid, lane, turn)
        except Exception as e:  # the answer is accounted for all the same
            log.warning("[bili] session=%s: cache calibration failed (%s: %s)", printable(sid), type(e).__name__,
                        printable(e))
        return called

    def run_tool(self: ToolHost, s: Session, name: str, args: Any, view: View | None, call_id: str = "",
                 snoozed: frozenset[str] = frozenset()) -> str:
        """Execute one proxy tool against the conversation as this request shows it (``snoozed``: the
        blocks not rendered on it: kernel/reconcile.py)."""
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return f"{name}: the arguments are not valid JSON."
        view = view or View([])
        sid = s.row.id
        if name == "compress":
            out = fold.compress(args, view, s.blocks, self.fold_cfg, call_id, snoozed)
            text = out.text
            if out.blocks:
                s.blocks.extend(out.blocks)
                held = self.defer_fold(s, out.blocks, out.deactivated, view)  # kernel/pending.py
                if held is not None and not held["land"]:
                    text += " " + pending.SENTENCE
                # (a result part the model is shown an executed call's result in: that result is its original)
                shown = shown_results(s, view) if s.calls else {}
                originals = [msgspec.structs.replace(p, text=shown[p.ref], tokens=count_tokens(shown[p.ref]))
                             if p.ref in shown else p for p in out.originals]
                self.sessions.save_blocks(s, out.blocks + out.deactivated, originals,
                                          [(call_id, text)] if call_id in s.calls else [])
                if held is not None:  # stored after the blocks: a failure in between lands them
                    self.sessions.set_flag(sid, pending.FLAG, held)
            return text
        originals = lambda refs: self.store.originals(sid, refs)  # noqa: E731
        if name == "decompress":
            return surfaces.decompress(args, s.blocks, originals,
                                       lambda: export_dir(Path(self.store.path).parent, sid))
        if name == "search_context":
            return surfaces.search_context(args, s.blocks, originals)
        if name == "acp_status":
            usage = self.store.last_usage(sid)
            window = self.window_for(s)
            return surfaces.status(view, s.blocks, self.fold_cfg, (usage[0], window) if usage else None,
                                   self.nudge_cfg, pending.held(s)[0])
        return f"Unknown bili tool {name!r}."

    def plugin_tool(self: ToolHost, sid: str | None, tool: str, args: Any) -> tuple[str, str]:
        """A tool called natively (MCP) rather than on the wire: ``(session id, result)``.

        Without a session id, the conversation whose answer made this very call (kernel/native.py);
        LookupError when no conversation did, or more than one.  Ranges resolve against the
        conversation as its last request showed it; a fold shows from the next request on.
        """
        call_id = ""  # (a fold keeps its call's id: the native call's, when the answer that made it is known)
        if not sid:
            sid, call_id = self.native.take(tool, args)
        elif self.store.session(sid) is None and sid not in self.sessions:
            raise LookupError(f"unknown conversation {sid!r}")
        s = self.sessions.load(sid, fresh=True)
        try:
            first = not s.blocks
            out = self.run_tool(s, tool, args, s.last_view, call_id, s.last_snoozed)
            if first and s.blocks and s.last_view is not None and s.last_resolved is not None:
                # the conversation's first fold, made between two requests: the pass it was made on becomes
                # the canonical copy (a request rolls it only once the session has blocks), so a rewind
                # into the range right after is told as one, not taken for a collapse that pauses folding
                coverage.roll_copy(self.sessions, s, s.last_view, s.last_resolved, None)
            return sid, out
        except BaseException:
            # what the call changed of the cached session may not be stored (a fold's blocks added before
            # their write failed): the next turn reads the session from the store, as a failed turn does
            self.sessions.forget(sid)
            raise

    def _run_calls(self: ToolHost, s: Session, view: View, first: int, result: TurnResult,
                   snoozed: frozenset[str] = frozenset()) -> None:
        """Execute the recorded calls this request carries (from view item ``first`` on)."""
        done: list[tuple[str, str]] = []
        for it in view.items[first:]:
            for p in it.parts:
                if p.ctype != TOOL_CALL:
                    continue
                key = call_key(p.tool_call_id, p.tool_name, p.text)
                call = s.calls.get(key)
                if call is None or call.result is not None:
                    continue
                before = {b.id for b in s.blocks}
                call.result = self.run_tool(s, call.name, call.args, view, key, snoozed)
                done.append((key, call.result))
                result.executed.append(call.name)
                made = [b for b in s.blocks if b.id not in before]
                if call.name == "compress":  # the ranges it refused, in the words the model reads
                    refused = [ln for ln in call.result.splitlines() if not made or "not compressed" in ln]
                    result.declined += [ln.strip() for ln in refused if ln.strip()]
                if made:
                    saved = sum(b.folded_tokens - b.summary_tokens for b in made)
                    spans = ", ".join(f"{b.covered[0]}–{b.covered[-1]} → {b.id}" for b in made)
                    result.marker = f"[bili] compressed {spans}, ~{tags.format_tokens(max(0, saved))} tokens saved"
                    if any(b.id in pending.held(s)[0] for b in made) and not s.flags[pending.FLAG]["land"]:
                        result.marker += " (the range leaves when the prompt cache is cold)"
        if done:
            s.stored = self.store.commit_fold(s.row.id, [], [], done, expect=s.stored)

    @staticmethod
    def call_edits(s: Session, lane: Lane, info: ItemInfo, refs_parts, idless: dict[str, list[str]],
                   called: dict[str, bool] | None = None, first_call=None, showing=None) -> list:
        """Edits for one item: executed calls as the model made them, real results for the agent's
        errors, emergency-truncated tool outputs.  ``idless``, ``called``, ``first_call``: as
        :func:`paired` takes them, carried from item to item of the request.  ``showing()``: the ids of the
        blocks the request shows (:func:`shown_blocks` of its view), asked when a compress call is edited."""
        cut = s.flags.get("truncated", {})
        edits: list = []
        obj = None
        shown: set[str] | None = None
        nth: dict[str, int] = {}
        for core, ref, key, target, call in paired(s, [(p.core, p.entry.ref) for p in refs_parts], idless, called,
                                                   first_call, nth):
            if call is None:
                if core.ctype == TOOL_RESULT and ref in cut:  # the agent's own output, cut short
                    obj = obj if obj is not None else info.obj
                    # (an id-less one: its own response, not every one of its tool's; an error stays one)
                    edits += lane.result_edits(obj, key, cut[ref], nth=nth.get(key) if key.startswith("name:")
                                               else None, keep_error=True)
                continue
            obj = obj if obj is not None else info.obj
            if core.ctype == TOOL_CALL:
                args = call.args
                if call.name == "compress":
                    if shown is None:
                        shown = showing() if showing is not None else shown_blocks(s)
                    args = shown_args(s, target, args, shown)
                edits += lane.call_edits(obj, key, call.name, args)
            elif key.startswith("name:"):  # (id-less: Gemini's) its own response, not every one of its tool
                edits += lane.result_edits(obj, key, call.result, nth=nth[key])
            else:
                edits += lane.result_edits(obj, key, call.result)
        return edits

    @staticmethod
    def spent_calls(s: Session, view: View, keep_failed: int = 2, blocks: list | None = None) -> set[str]:
        """Refs of compress calls (and their results) that no longer say anything: their blocks
        were all distilled into later ones, or they failed and newer failures exist.  ``blocks``:
        the blocks as the wire shows them (default: the session's)."""
        failed, spent = [], []
        blocks = s.blocks if blocks is None else blocks
        for key, call in s.calls.items():
            if call.name != "compress" or call.result is None:
                continue
            made = [b for b in blocks if b.call_id == key]
            if not made:
                failed.append(key)
            elif not any(b.active for b in made):
                spent.append(key)
        spent += failed[: max(0, len(failed) - keep_failed)]
        if not spent:
            return set()
        keys = set(spent)
        out: set[str] = set()
        # a result leaves with the call it answers, never stays behind alone: the call of its id, or (no id,
        # or one the agent made up: gemini-cli's) the oldest call of its tool not answered yet, as the fold's
        # plan pairs them (fold.pair_keys)
        paired = fold.pair_keys(view.items)
        recorded: dict[str, str] = {}  # a call's pairing key -> its key among the session's calls
        for k, it in enumerate(view.items):
            for j, p in enumerate(it.parts):
                if p.ctype != TOOL_CALL and p.ctype != TOOL_RESULT:
                    continue
                pk = (paired.get((k, j)) if paired is not None else None) or p.tool_call_id
                if p.ctype == TOOL_CALL:
                    key = call_key(p.tool_call_id, p.tool_name, p.text)
                    if pk:
                        recorded[pk] = key
                    if key in keys:
                        out.add(p.ref)
                elif pk and recorded.get(pk, pk) in keys:
                    out.add(p.ref)
        return out


def shown_blocks(s: Session, view: View | None = None, snoozed: Collection[str] = ()) -> set[str]:
    """Ids of the blocks the wire shows: those whose summary stands on it (held folds aside,
    kernel/pending.py), and those absorbed, at any depth, by one that does.  With ``view``, the
    request's: a block stands on it only where some of its messages are (fold.plan renders no other:
    a host that dropped its head dropped the range, and the summary with it), and not ``snoozed``."""
    hold, keep = pending.held(s)
    by_id = {b.id: b for b in s.blocks}
    todo = [b.id for b in pending.on_wire(s.blocks, hold, keep) if b.active and b.id not in snoozed]
    if view is not None:
        pos = view.pos
        todo = [bid for bid in todo if any(ref in pos for ref in by_id[bid].coverage)]
    out: set[str] = set()
    while todo:
        bid = todo.pop()
        if bid not in out and bid in by_id:
            out.add(bid)
            todo += by_id[bid].consumed
    return out


def shown_args(s: Session, key: str, args: str, shown: set[str]) -> str:
    """The arguments of the executed compress call ``key`` as the wire shows them: an entry whose
    summary made a block the wire shows carries :data:`fold.POINTER` to it instead.  That changes
    the call's bytes once, when its blocks reach the wire, and a fold rewrites the cache from its
    range's start, before the call, then anyway.  ``args`` unchanged when nothing points."""
    made = {(b.start_ref, b.end_ref, b.summary): b.id for b in s.blocks if b.call_id == key and b.id in shown}
    if not made:
        return args
    try:
        obj = json.loads(args)
    except ValueError:
        return args
    content = obj.get("content") if isinstance(obj, dict) else None
    entries = content if isinstance(content, list) else [obj] if isinstance(obj, dict) else []
    points = False
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            continue
        start = e.get("startId") or e.get("startRef") or e.get("messageId")
        end = e.get("endId") or e.get("endRef") or e.get("messageId")
        summary = e.get("summary")
        if not (isinstance(start, str) and isinstance(end, str) and isinstance(summary, str)):
            continue
        bid = made.get((start.strip(), end.strip(), summary))
        if bid is not None:
            entries[i] = {**e, "summary": fold.POINTER.format(id=bid)}
            points = True
    if not points:
        return args
    return json.dumps({**obj, "content": entries} if isinstance(content, list) else entries[0], ensure_ascii=False)


__all__ = ["ProxyTools", "ToolHost", "call_key", "shown_args", "shown_blocks"]
