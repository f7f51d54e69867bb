"""Rendering and assembly of one pass: the bytes each conversation item of a request leaves with.

:func:`render_items` applies the per-item transforms (tags and the reminders they carry, restored
proxy calls and their real results, truncations, id hygiene) to the items a pass did not reuse;
:func:`assemble` then lays out the conversation the wire sees (covered items leave, block summaries
stand where their ranges began, reminders of their own follow their items);
:func:`snapshot_join` and :func:`snapshot_render` serve the folded prefix from the session's own
transcript (``bili_snapshot_render``).  Nothing here knows the engine: the store and the two fold
questions it answers (:class:`WireFolds`) are passed in.
"""

from __future__ import annotations

import logging
from itertools import accumulate, islice
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct

from bili_addon import printable
from bili_addon.kernel import fold, reconcile, tags
from bili_addon.kernel.fold import Block, PartView, View, ViewItem
from bili_addon.kernel.kept import MISSING, Kept
from bili_addon.kernel.state import ItemInfo, Resolved, Session, TurnResult
from bili_addon.kernel.tools import ProxyTools, call_key, replays
from bili_addon.wire import Lane, hygiene
from bili_addon.wire.base import (REASONING, TEXT, TOOL_CALL, TOOL_RESULT, Core, LaneDefaults, decode_any, encode, patch_decoded,
                                  patch_many)

if TYPE_CHECKING:
    from bili_addon.store import Store

log = logging.getLogger("bili")

PROSE_ROLES = ("user", "assistant")


class WireFolds(Protocol):
    """What :func:`assemble` asks of the engine: the blocks as the wire shows them
    (kernel/pending.py), the compress calls that no longer say anything (kernel/tools.py), and the
    fold settings (the positions a fold never takes)."""

    fold_cfg: fold.FoldConfig

    def wire_blocks(self, s: Session) -> tuple[list[Block], list[Block]]: ...

    def spent_calls(self, s: Session, view: View, keep_failed: int = 2,
                    blocks: list[Block] | None = None) -> set[str]: ...


def render_items(s: Session, lane: Lane, raws: list, infos: list[ItemInfo], start: int, q: int,
                 resolved: list[list[Resolved]], rendered: list[bytes], changed_cum: list[int],
                 tagged_cum: list[int], top: dict, origin: str, active: bool = True, objs: list | None = None,
                 strict: bool | None = None, showing=None) -> None:
    """Per-item transforms of the items from ``start + q`` on: tags (with any reminder they
    carry), restored proxy calls and their real results, truncations, id hygiene.  ``objs``: the
    items this pass decoded (None where it did not), consumed by their tags' patching.  ``strict``:
    :func:`strict_repair`'s verdict, when the caller has it.  ``showing()``: the blocks the request
    shows (``ProxyTools.call_edits``)."""
    last = len(infos) - 1
    nudges = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "suffix"}
    strict_chat = strict_repair(s, lane.name, top, origin) if strict is None else strict
    call_edits = bool(s.calls or s.flags.get("truncated"))
    # (Responses: a replayed proxy id to drop; none in these items, they render as the other lanes' do)
    responses = lane.name == "responses" and lane.proxy_ids(
        [info.raw for info in infos[start + q:start + len(resolved)]],
        objs[start + q:start + len(resolved)] if objs is not None else None)
    if not (call_edits or responses or strict_chat):
        _render_prose(lane, infos, start, q, resolved, rendered, changed_cum, tagged_cum, active, nudges, objs)
        return
    idless: dict[str, list[str]] = {}
    called: dict[str, bool] = {}  # (ProxyTools.call_edits)
    firsts: dict[str, str] | None = None

    def first_call(cid: str) -> str | None:
        """The ref of the first call part with id ``cid`` in the request that replays the call recorded
        under it (read once, when asked)."""
        nonlocal firsts
        if firsts is None:
            firsts = {}
            for parts in resolved:
                for r in parts:
                    cid_ = r.core.tool_call_id
                    if r.core.ctype == TOOL_CALL and cid_ and cid_ not in firsts:
                        call = s.calls.get(cid_)
                        if call is not None and replays(r.core, call):
                            firsts[cid_] = r.entry.ref
        return firsts.get(cid)
    if q and s.calls:  # (the rendered items' ids whose latest call part is in the reused prefix: called)
        _called_before(s, resolved, q, called, first_call)
    if q and lane.name == "gemini":  # id-less calls answered further on: pair from the start
        for parts in resolved[:q]:
            for r in parts:
                if r.core.ctype == TOOL_CALL and not r.core.tool_call_id and r.core.tool_name:
                    idless.setdefault(r.core.tool_name, []).append(
                        call_key("", r.core.tool_name, r.core.text))
                elif r.core.ctype == TOOL_RESULT and idless.get(r.core.tool_name):
                    if not (r.core.tool_call_id and r.core.tool_call_id in s.calls):
                        idless[r.core.tool_name].pop(0)
    for k in range(q, len(resolved)):
        i = start + k
        info = infos[i]
        src = info.raw  # the item's bytes (infos[i] was looked up by exactly these)
        edits, tagged = _item_edits(resolved[k], active, i != last, nudges)
        more = []
        if call_edits:
            more += ProxyTools.call_edits(s, lane, info, resolved[k], idless, called, first_call, showing)
        if responses and b'"msg-proxy-' in src:
            more += hygiene.proxy_id_edits("responses", info.obj)
        if strict_chat and b'"tool_calls"' in src:
            more += hygiene.strict_chat_edits(info.obj)
        if more:
            edits += more
        out = _patch(lane, src, objs[i] if objs is not None and not more else None, edits) if edits else src
        changed_cum.append(changed_cum[-1] + (out != src))
        rendered.append(out)
        tagged_cum.append(tagged_cum[-1] + tagged)


def _render_prose(lane: Lane, infos: list[ItemInfo], start: int, q: int, resolved: list[list[Resolved]],
                  rendered: list[bytes], changed_cum: list[int], tagged_cum: list[int], active: bool,
                  nudges: dict[str, str], objs: list | None) -> None:
    """:func:`render_items` where the only edits are the parts' own (tags, truncations): only
    the parts with a text path are looked at, one by one; the rest of the items go as they came.
    An item whose one edit is its tag (the commonest: a conversation's prose) is tagged by its
    lane in its bytes (``tag_typed``) when the pass decoded it into the lane's typed struct."""
    end = len(resolved)
    outs = [info.raw for info in infos[start + q:start + end]]  # the items' bytes (infos were looked up by them)
    changed = [0] * (end - q)
    tagged = [0] * (end - q)
    last = len(infos) - 1 - start  # (the last item: an assistant's text there is a prefill)
    tag_typed = getattr(lane, "tag_typed", None) if objs is not None else None
    format_tokens, formatted = tags.format_tokens, tags._FORMATTED  # (its cache: a count seen before, one lookup)
    for k in range(q, end):
        parts = resolved[k]
        if len(parts) == 1:  # (the commonest item: one part)
            r = parts[0]
            core = r.core
            if not core.path:
                continue
            edits = None
        elif len(parts) == 2:  # (the next commonest: an assistant's prose and its tool call)
            r, other = parts
            core = r.core
            if not core.path:
                r = other
                core = r.core
                if not core.path:
                    continue
                edits = None
            elif other.core.path:  # both parts to edit
                edits, count = _item_edits(parts, active, k != last, nudges)
            else:
                edits = None
        else:
            with_path = [r for r in parts if r.core.path]
            if not with_path:
                continue
            if len(with_path) > 1:  # more parts of this item to edit
                edits, count = _item_edits(parts, active, k != last, nudges)
            else:
                r = with_path[0]
                core = r.core
                edits = None
        if edits is None:  # the one part of the item with a path: ``r``
            text = core.text
            # (taggable(core, k != last), inline: it runs for every such part)
            if (active and core.ctype == TEXT and text and (core.role == "user" or (core.role == "assistant" and k != last))
                    and not text.isspace()):
                entry = r.entry
                ref = entry.ref
                tokens = formatted.get(entry.tokens) or format_tokens(entry.tokens)
                if tag_typed is not None and not r.dirty and not (nudges and nudges.get(ref)):
                    obj = objs[start + k]
                    if isinstance(obj, Struct):
                        # the tag's JSON-escaped bytes (a token count's and an alphanumeric
                        # ref's characters escape to themselves)
                        tag = (f'<acp tokens=\\"{tokens}\\" type=\\"text\\">{ref}</acp>\\n'.encode() if ref.isalnum()
                               else encode(f'<acp tokens="{tokens}" type="{TEXT}">{ref}</acp>\n')[1:-1])
                        out = tag_typed(outs[k - q], obj, core.path, tag, text)
                        if out is not None:
                            outs[k - q] = out
                            changed[k - q] = tagged[k - q] = 1
                            continue
                edits, count = [_tag_edit(core, tokens, ref, nudges.get(ref) if nudges else None)], 1
            elif r.dirty:
                edits, count = [(core.path, text)], 0
            else:
                continue
        if edits:
            src = outs[k - q]
            out = outs[k - q] = _patch(lane, src, objs[start + k] if objs is not None else None, edits)
            changed[k - q] = out != src
            tagged[k - q] = count
    rendered += outs
    changed_cum += islice(accumulate(changed, initial=changed_cum[-1]), 1, None)
    tagged_cum += islice(accumulate(tagged, initial=tagged_cum[-1]), 1, None)


def _item_edits(parts: list[Resolved], active: bool, prose: bool, nudges: dict[str, str]) -> tuple[list, int]:
    """The edits of an item's own parts (tags, each with any reminder it carries; truncations)
    and how many are tags.  ``prose``: an assistant's text is prose (not the last item's, a
    prefill)."""
    edits = []
    tagged = 0
    for r in parts:
        core = r.core
        if active and taggable(core, prose):
            entry = r.entry
            edits.append(_tag_edit(core, tags.format_tokens(entry.tokens), entry.ref,
                                   nudges.get(entry.ref) if nudges else None))
            tagged += 1
        elif r.dirty and core.path:
            edits.append((core.path, core.text))
    return edits, tagged


def _tag_edit(core: Core, tokens: str, ref: str, suffix: str | None = None) -> tuple:
    """The edit that tags ``core``'s text (with the reminder ``suffix`` after it)."""
    text = f'<acp tokens="{tokens}" type="{TEXT}">{ref}</acp>\n{core.text}'
    return core.path, text + "\n\n" + suffix if suffix else text


def _patch(lane: Lane, src: bytes, obj, edits: list) -> bytes:
    """``src`` with ``edits``: from ``obj`` (what ``src`` decoded into, if the pass decoded it)
    when that proves to be the same bytes, else by patching the bytes."""
    if isinstance(obj, Struct):  # read by the lane into a typed struct (ItemCache.get_many)
        out = lane.patch_typed(src, obj, edits)
        if out is None:
            out = patch_decoded(src, decode_any(src), edits)
    else:
        out = patch_decoded(src, obj, edits) if obj is not None else None
    return out if out is not None else patch_many(src, edits)


def snapshot_join(store: Store, s: Session, items: list[ViewItem]):
    """Where the agent's verbatim tail takes over from the session's own transcript: items
    whose canonical signature matches the transcript row at their position take the row's
    refs (and, when rendered, its bytes).  ``(join, rows, view items)`` or None (any doubt)."""
    try:
        if s.transcript is None:
            s.transcript = store.transcript(s.row.id)
    except Exception as e:  # the store cannot be read: the normal path
        log.warning("[bili] session=%s: transcript unreadable (%s); normal render", printable(s.row.id), printable(e))
        return None
    rows = s.transcript
    j = 0
    # (a reasoning part's signature is its role alone: its row is its only while its ref, of its content, is
    # the row's; another answer's reasoning after a retried turn is not the row's, nor its encrypted content)
    while (j < min(len(rows), len(items)) and rows[j][0] == sig(items[j]) and len(rows[j][1]) == len(items[j].parts)
           and all(p.ctype != REASONING or p.ref == r for p, r in zip(items[j].parts, rows[j][1]))):
        j += 1
    while j > 0:  # never split a tool call from its result
        calls = {p.tool_call_id for it in items[:j] for p in it.parts if p.ctype == TOOL_CALL and p.tool_call_id}
        if not calls & {p.tool_call_id for it in items[j:] for p in it.parts if p.ctype == TOOL_RESULT}:
            break
        j -= 1
    if j == 0:  # nothing links: this turn renders normally, and its items start the transcript anew
        return (0, rows, items)
    joined = [
        ViewItem(it.index, [PartView(ref, p.role, p.ctype, p.tool_name, p.tool_call_id, p.text, p.tokens)
                            for ref, p in zip(rows[k][1], it.parts)], it.sig)
        for k, it in enumerate(items[:j])
    ]
    return (j, rows, joined + items[j:])


def snapshot_render(store: Store, s: Session, snap, lane: Lane, raws: list, items_out: list[bytes],
                    start: int, view: View) -> bool:
    """Rows up to the join are sent as the transcript has them, with the agent's current
    transport hints (cache breakpoints move every turn); the transcript takes this pass's tail as
    its new rows."""
    j, rows, _joined = snap
    changed = False
    for k in range(j):
        row = lane.transplant_hints(rows[k][2], bytes(raws[start + k]))
        if items_out[start + k] != row:
            items_out[start + k] = row
            changed = True
    tail = [(sig(it), [p.ref for p in it.parts], items_out[it.index]) for it in view.items[j:]]
    s.stored = store.save_transcript(s.row.id, j, tail, expect=s.stored)
    s.transcript = rows[:j] + tail
    return changed


def strict_repair(s: Session, lane: str, top: dict, origin: str) -> bool:
    """Whether this request's Chat items get the strict reasoning repair (the session learned its provider
    wants it, or the provider and model say so by name)."""
    if lane != "chat":
        return False
    model = top.get("model") if isinstance(top.get("model"), str) else ""
    return bool(s.flags.get("strict_reasoning") or hygiene.strict_by_name(origin, model))


def strict_inserts(s: Session, lane: str, infos: list[ItemInfo], top: dict, origin: str) -> dict:
    if lane != "responses":
        return {}
    model = top.get("model") if isinstance(top.get("model"), str) else ""
    if not (s.flags.get("strict_reasoning") or hygiene.strict_by_name(origin, model)):
        return {}
    at = hygiene.strict_responses_inserts([info.obj for info in infos])
    return {i: [hygiene.EMPTY_REASONING] for i in at}


def assemble(folds: WireFolds, s: Session, lane: Lane, items_out: list[bytes], start: int, view: View,
             result: TurnResult, snoozed: set[str], pre: dict) -> bool:
    """Covered items leave the wire; each active block's summary stands where its range began;
    a reminder that needs an item of its own follows the item it was given after."""
    unfolded = view.sums().tokens[-1] if s.blocks else 0  # (every part's tokens)
    s.unfolded_tokens = s.sent_tokens = unfolded
    blocks, calls = folds.wire_blocks(s)  # held folds are not on the wire yet (kernel/pending.py)
    hidden = folds.spent_calls(s, view, blocks=calls) if s.calls else set()
    active = False
    for b in blocks:
        if b.active:
            active = True
            break
    plan = fold.plan(view, blocks, hidden, snoozed, view.protected(folds.fold_cfg)) if hidden or active else _NO_PLAN
    after = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "item"}
    nudge_at = _holding(view, after) if after else set()
    drop = plan.drop
    if not drop and not plan.inserts and not nudge_at and not pre:
        return False
    out: list[bytes] = items_out[:start]
    ours: dict[int, str] = {}  # positions in ``out`` of the items the addon added, with their text
    items = view.items
    # the dropped items in runs: the first of each -> one past its run's last (the plan's, when it
    # has them: a follow-up's plan is mostly the previous one's)
    runs = plan.runs if plan.runs is not None else fold._runs(drop)
    # the view's items are the conversation's from ``start`` on: only those where something
    # happens are looked at, the runs between them copied as they are, and each run of dropped
    # items left out as a whole (its items where something stands looked at on their own)
    if items and (items[0].index != start or items[-1].index != start + len(items) - 1):
        marks = range(len(items))  # (not laid out so: each item on its own)
        skip: dict[int, int] = {}
    else:
        marks = {*runs, *plan.inserts, *nudge_at}
        if pre:
            marks.update([i - start for i in pre])
        # (the positions of the view's items, mostly: the others are left out)
        marks = sorted(marks) if not marks or (min(marks) >= 0 and max(marks) < len(items)) else \
            sorted(k for k in marks if 0 <= k < len(items))
        skip = runs
    at = 0
    texts: dict[int, str] = {}  # (each summary's text, made once: by its block, which lives meanwhile)
    for k in marks:
        it = items[k]
        if at < k:
            out.extend(items_out[start + at:start + k])
        if at <= k:
            at = skip.get(k, k + 1)
        if k not in drop:  # (the repair's inserts before an item that stays: none for one a fold took)
            out.extend(pre.get(it.index, ()))
        for b in plan.inserts.get(k, ()):
            ours[len(out)] = texts[id(b)] = b.text()
            out.append(lane.summary_item(ours[len(out)]))
        if k in drop:
            continue
        item, notes = items_out[it.index], []
        if k in nudge_at:  # a reminder goes into the item it was given to, or right after it
            for text in (after[r] for r in it.refs if r in after):
                merged = _note_in_item(lane.note_in_item, item, text)
                if merged is None:
                    ours[len(out) + 1 + len(notes)] = text
                    notes.append(lane.summary_item(text))
                else:
                    item = merged
        out.append(item)
        out.extend(notes)
    out.extend(items_out[start + at:])
    items_out[:] = alternate(lane, out, start, ours) if ours else out
    result.folded_items = len(drop)
    tokens = view.sums().tokens
    rendered = plan.rendered
    s.sent_tokens = (unfolded - sum(tokens[e] - tokens[k] for k, e in runs.items())
                     + sum(fold.tokens_of(texts[id(b)] if id(b) in texts else b.text()) for b in rendered)
                     if runs or rendered else unfolded)  # (nothing left out, nothing stands for it)
    return True



def _called_before(s: Session, resolved: list[list[Resolved]], q: int, called: dict[str, bool], first_call) -> None:
    """``called`` (tools.paired's) as a pass from the start would leave it after the first ``q`` items,
    for the recorded ids the items after them carry: whether the latest call part with the id among
    those first items is the recorded call (a provider that numbers its calls per answer gives
    ``call_0`` again: the agent's own call there, and the recorded one after it, answered by the
    item rendered again)."""
    ids = {r.core.tool_call_id for parts in resolved[q:] for r in parts
           if r.core.tool_call_id and r.core.ctype in (TOOL_CALL, TOOL_RESULT) and r.core.tool_call_id in s.calls}
    for parts in reversed(resolved[:q]):
        if not ids:
            return
        for r in reversed(parts):
            cid = r.core.tool_call_id
            if r.core.ctype != TOOL_CALL or cid not in ids:
                continue
            ids.discard(cid)
            call = s.calls[cid]
            if call.result is None:
                continue  # (paired leaves such a part alone)
            called[cid] = replays(r.core, call) and first_call(cid) in (None, r.entry.ref)

_NO_JOIN = LaneDefaults.join_user  # (the lanes whose API takes user turns in a row: it joins nothing)
_NO_PLAN = fold.Plan(frozenset(), {}, [], {})  # (nothing dropped, nothing inserted: never changed by assemble)

# a reminder given as an item goes into that item again on every turn after (the same bytes: the
# previous pass's rendering of it) with the same text: the lane's merge is kept, (the lane's
# function, item, text) -> the merged item (None: it stands after it), 4 MB of items at most
_NOTES = Kept(1 << 22)


def _note_in_item(note_in_item, item: bytes, text: str) -> bytes | None:
    """``note_in_item(item, text)``, kept for the next turn."""
    if type(item) is not bytes or type(text) is not str:  # (bytes: never changed in place)
        return note_in_item(item, text)
    key = (note_in_item, item, text)
    got = _NOTES.get(key)
    if got is not MISSING:
        return got
    merged = note_in_item(item, text)
    _NOTES.put(key, merged, len(item) + len(text) + (len(merged) if merged is not None else 0))
    return merged


def _holding(view: View, refs: dict) -> set[int]:
    """The positions of the view's items that hold a part of one of ``refs``.  A follow-up's are the
    previous view's among the items the two share (for the same refs), and its new items' own."""
    if not isinstance(view, View):
        return _holding_all(view, refs)
    items = view._snapshot()
    prev = view._prev
    got = prev.memo.get("holding") if prev is not None else None
    if got is not None and got[0] == refs.keys():
        m = view._shared_with(got[2])
        out = {k for k in got[1] if k < m}
        out.update(k for k in range(m, len(items)) for p in items[k].parts if p.ref in refs)
    else:
        out = _holding_all(view, refs)
    view.memo["holding"] = (frozenset(refs), frozenset(out), items)
    return out


def _holding_all(view: View, refs: dict) -> set[int]:
    """:func:`_holding` from the start."""
    if isinstance(view, View) and view._pos is None:
        # no ref's position known yet (a conversation's first pass): the parts are read for these
        # refs alone (a third to a half of the time of making every ref's position, which nothing
        # else of the turn asks for then)
        return {k for k, it in enumerate(view.items) for p in it.parts if p.ref in refs}
    items, pos = view.items, view.pos
    if len(pos) == (view.part_count() if isinstance(view, View) else sum(len(it.parts) for it in items)):
        # each ref in one part: where View found it
        found = {pos[r]: r for r in refs if r in pos}
        if all(r in items[k].refs for k, r in found.items()):
            return set(found)
    return {k for k, it in enumerate(items) for p in it.parts if p.ref in refs}


def alternate(lane: Lane, out: list[bytes], start: int, ours: dict[int, str]) -> list[bytes]:
    """Where the lane needs user and assistant turns to alternate, an item the addon added joins
    the user message before it (or else the one after it) instead of standing as a second user
    turn in a row.  Only the items the addon added are looked at, the runs between them copied
    as they are.  A lane whose API takes user turns in a row joins nothing: ``out`` as it is."""
    if lane.join_user is _NO_JOIN:
        return out
    res = out[:start]
    at = start  # ``out`` up to here is in ``res`` (an item the join below changes comes later)
    for i in sorted(ours):
        if i < at or i >= len(out):
            continue  # (not in the conversation)
        res += out[at:i]
        at = i + 1
        text = ours[i]
        if text is not None:
            joined = lane.join_user(res[-1], text, before=False) if len(res) > start else None
            if joined is not None:
                res[-1] = joined
                continue
            if i + 1 < len(out) and i + 1 not in ours:
                joined = lane.join_user(out[i + 1], text, before=True)
                if joined is not None:
                    out[i + 1] = joined
                    continue
        res.append(out[i])
    res += out[at:]
    return res


def sig(item: ViewItem) -> str:
    if not item.sig:
        item.sig = ",".join(reconcile.fingerprint(p) for p in item.parts)
    return item.sig


def taggable(core: Core, prose: bool) -> bool:
    """A part that gets a tag: text with a path in its item, not blank, the user's or the
    assistant's (``prose``: not the last item's, a prefill)."""
    return bool(core.ctype == TEXT and core.path and (core.role == "user" or (core.role == "assistant" and prose))
                and core.text and not core.text.isspace())


__all__ = ["PROSE_ROLES", "WireFolds", "alternate", "assemble", "render_items", "sig", "snapshot_join",
           "snapshot_render", "strict_inserts", "taggable"]
