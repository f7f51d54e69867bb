"""#11, the first turn's input side made cheaper (ItemCache.get_many and what it calls, the
lanes' array_cores, fresh.first_pass) with exactly the same results.

The code as it was is kept verbatim below (source text, run in a copy of its module's globals) and
run side by side with the new: over the bench's conversations (both lanes, several sizes and
seeds), the captures, and generated items (unicode, lone surrogates, every block kind, duplicates,
system items, marker lines and tag echoes in assistant prose): the same ItemInfos, parts, cores
(every field), typed structs, cache contents and order and size; the same refs, ledger rows, view,
sums and instance counts; and whole Engine runs with the old code patched in: the same bytes out,
the same refs, the same ledger.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import fresh, state
from bili_addon.kernel.state import ItemCache, Session, hash_parts
from bili_addon.kernel.turn import Engine
from bili_addon.store import MAX_REF, SessionRow, Store
from bili_addon.wire import LANES, anthropic, chat
from bili_addon.wire.base import IMAGE, OTHER, REASONING, TEXT, TOOL_CALL, TOOL_RESULT, Body, Core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

# -- the code as it was (verbatim) --------------------------------------------------------------

OLD_ITEM_CACHE = r'''class ItemCache:
    """Parsed items by their exact bytes: a follow-up turn never re-parses or re-hashes old history."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.size = 0
        self.items: OrderedDict[tuple[str, bytes], ItemInfo] = OrderedDict()

    def _grown(self, size: int) -> None:
        """``size`` bytes of items added: the oldest go while the cache is over its limit."""
        self.size += size
        while self.size > self.max_bytes and self.items:
            (_, old), _info = self.items.popitem(last=False)
            self.size -= len(old)

    def forget(self) -> None:
        """Drop every parsed item (the next pass parses its items anew)."""
        self.items.clear()
        self.size = 0

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
        info = ItemInfo(raw, lane.is_system_item(obj), parts)
        self.items[key] = info
        self._grown(len(raw))
        return info

    def get_many(self, lane: Lane, raws, objs: list | None = None, whole=None) -> list[ItemInfo]:
        """:meth:`get` of each of ``raws`` (``bytes`` or ``msgspec.Raw``), in one pass: a
        conversation's first pass parses every item, and the per-call work of :meth:`get` (and of
        :func:`~bili_addon.kernel.identity.digest`, inlined here: the same seed, the same hash) was
        a fifth of that pass (bench_overhead.py).  The items are read in one loop, then the new
        parts are cleaned, hashed and made in C-level loops over flat lists (comprehensions and
        ``map``), not one Python step per part.  ``objs``: gets each item as decoded here (None
        for one found in the cache, the lane's typed struct for one its ``array_cores`` read), for
        the pass's rendering to patch (wire.base.patch_decoded, the lane's ``patch_typed``).
        ``whole``: the array ``raws`` were split from, decoded in one call when the first item is
        new, or at the first new item when at least half of them are new (a new conversation whose
        first items other conversations share, a system prompt: not parsed item by item)."""
        name, items = lane.name, self.items
        found, move = items.get, items.move_to_end
        cores_of, is_system, decode = lane.item_cores, lane.is_system_item, decode_any
        out: list[ItemInfo] = []
        add = out.append
        size = 0
        decoded = typed = structs = systems = None
        array_cores = getattr(lane, "array_cores", None)
        flat: list[Core] = []  # the cores of the new items, in order
        extend = flat.extend
        made: list[tuple[ItemInfo, int]] = []  # each new item and where its cores end in ``flat``
        new: dict[bytes, ItemInfo] = {}  # an item repeated in ``raws`` is the same item
        wide = tried = False  # whether to decode ``whole`` at the first new item (not only the first item)
        if whole is not None and array_cores is not None and raws:
            # a conversation's first pass, every item new and none twice: the loop below in C-level
            # steps (the same ItemInfos, cores, objs, cache order and size): the lane reads the cores
            # of all the items into one list, the parts are made of it, each item's are a slice
            braws = list(map(bytes, raws))
            keys = list(zip(repeat(name), braws))
            cached = list(map(items.__contains__, keys))
            if not any(cached) and len(set(braws)) == len(braws):
                got = array_cores(whole, flat=True)  # (the cores of them all, where each item's end)
                if got is not None and len(got[1]) == len(raws):
                    flat, ends = got[0], got[1]
                    if objs is not None:
                        objs.extend(got[2])
                    if flat:
                        parts = self._new_parts(flat)
                        lists = [parts[a:b] for a, b in zip([0, *ends], ends)]  # (no slice object made)
                    else:
                        lists = [[] for _raw in braws]
                    out = list(map(ItemInfo, braws, got[3] if len(got) > 3 else repeat(False), lists))
                    if flat:
                        items.update(zip(keys, out))
                    self._grown(sum(map(len, braws)))
                    return out
                array_cores = None  # (read them one by one below, the array decoded once)
            wide = cached.count(False) * 2 >= len(cached)
        for i, r in enumerate(raws):
            raw = bytes(r)
            key = (name, raw)
            info = found(key)
            if info is not None:
                move(key)
                add(info)
                if objs is not None:
                    objs.append(None)
                continue
            info = new.get(raw)
            if info is not None:
                add(info)
                if objs is not None:
                    objs.append(None)
                continue
            if whole is not None and (i == 0 or wide) and not tried:
                tried = True
                got = array_cores(whole) if array_cores is not None else None
                if got is not None and len(got[0]) == len(raws):
                    typed, structs = got[0], got[1]
                    systems = got[2] if len(got) > 2 else None
                if typed is None:
                    decoded = decode(whole)
                    if not isinstance(decoded, list) or len(decoded) != len(raws):
                        decoded = None
            if typed is not None:  # the lane read the array into its cores (and which items are system items)
                if objs is not None:
                    objs.append(structs[i])  # (a typed struct: the lane's patch_typed patches it)
                extend(typed[i])
                info = new[raw] = ItemInfo(raw, systems[i] if systems is not None else False, [])
                made.append((info, len(flat)))
                add(info)
                size += len(raw)
                continue
            obj = decoded[i] if decoded is not None else decode(raw)
            if objs is not None:
                objs.append(obj)
            extend(cores_of(obj))
            info = new[raw] = ItemInfo(raw, is_system(obj), [])
            made.append((info, len(flat)))
            add(info)
            size += len(raw)
        if flat:
            self._parts(flat, made)
            for (info, _end) in made:
                items[(name, info.raw)] = info
        if size:
            self._grown(size)
        return out

    @staticmethod
    def _parts(flat: list[Core], made: list[tuple[ItemInfo, int]]) -> None:
        """The :class:`Part` of every core in ``flat`` (:meth:`_new_parts`), dealt out to the items
        of ``made`` (each new item and where its cores end in ``flat``)."""
        parts = ItemCache._new_parts(flat)
        begin = 0
        for info, end in made:
            info.parts = parts[begin:end]
            begin = end

    @staticmethod
    def _new_parts(flat: list[Core]) -> list[Part]:
        """The :class:`Part` of every core in ``flat`` (changed in place where assistant prose is
        cleaned), identity.digest of each inlined."""
        dirty = [False] * len(flat)
        # clean_replayed_prose changes only a text that starts with a marker line (MARKER_LINE) or
        # holds an angle bracket (every echo shape has one): the others are not passed to it
        for j in [j for j, c in enumerate(flat) if c.ctype == TEXT and c.role == "assistant"
                  and ("<" in c.text or c.text.startswith(_MARKER))]:
            core = flat[j]
            clean = clean_replayed_prose(core.text)
            if clean != core.text:
                flat[j], dirty[j] = msgspec.structs.replace(core, text=clean), True
        h = sha256
        # identity.digest, inlined (the same seed, the same hash); encoded strictly first (the
        # same bytes for every text without a lone surrogate, and a cheaper call), else as digest
        try:
            hashes = [h((f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}|{c.media}" if c.media else
                         f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}").encode()).hexdigest() for c in flat]
        except UnicodeEncodeError:
            hashes = [h((f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}|{c.media}" if c.media else
                         f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}").encode("utf-8", "surrogatepass")
                        ).hexdigest() for c in flat]
        return list(map(Part, flat, ["h_" + x[:16] for x in hashes], hashes, dirty))
'''

OLD_FIRST_PASS = r'''def first_pass(s: Session, infos: list[ItemInfo], counter: Counter,
               first_index: int) -> tuple[list[list[Resolved]], list[LedgerRow], list[ViewItem],
                                          Sums] | None:
    """``(resolved, new ledger rows, view items, sums)`` of a pass whose every part is new (see
    :func:`applies`); the rows are staged in ``s.refs`` as ``_resolve`` stages them; ``sums``: what
    the :class:`~bili_addon.kernel.fold.View` of the items computes (``View(items, sums)``).  None
    when the refs would run past the last one (the general path says so).

    Column by column: each field of every part in one comprehension (attribute reads of the
    parts' structs, specialised by the interpreter: faster than ``map(attrgetter)``), the objects
    made by ``map`` over those columns, then the per-item lists cut from the flat ones."""
    next_ref = s.row.next_ref
    parts = [p for info in infos for p in info.parts]
    total = len(parts)
    if next_ref < 1 or next_ref + total - 1 > MAX_REF:
        return None
    names = ref_names(next_ref, total)  # tags.ref_of of each number, in order
    cores = [p.core for p in parts]
    bases = [p.base for p in parts]
    chashes = [p.chash for p in parts]
    if not counter:
        counter.update(bases)  # (C-level count)
        if len(counter) == total:  # no base twice: every msg_id is its base
            msg_ids = bases
        else:
            counter.clear()
            msg_ids = _numbered(bases, counter)
    else:
        msg_ids = _numbered(bases, counter)
    texts = [c.text for c in cores]
    roles = [c.role for c in cores]
    ctypes = [c.ctype for c in cores]
    # identity.count_tokens (its ASCII case inlined)
    tokens = [-(-len(t) // 4) if t.isascii() else count_tokens(t) for t in texts]
    entries = list(map(Entry, names, tokens))
    s.refs.update(zip(zip(msg_ids, chashes), entries))  # staged: forgotten again if the commit fails
    rows = list(map(LedgerRow, msg_ids, chashes, names, roles, ctypes, tokens))
    flat = list(map(Resolved, cores, entries, [p.dirty for p in parts], msg_ids, bases))
    views_flat = list(map(PartView, names, roles, ctypes, [c.tool_name for c in cores],
                          [c.tool_call_id for c in cores], texts, tokens))
    counts = [len(info.parts) for info in infos]
    ends = list(accumulate(counts, initial=0))
    resolved, views = [], []
    add_resolved, add_view = resolved.append, views.append
    for k, begin, end in zip(range(first_index, first_index + len(infos)), ends, islice(ends, 1, None)):
        add_resolved(flat[begin:end])
        add_view(ViewItem(k, views_flat[begin:end]))
    # what the View of these items computes from them (View.sums), from the columns
    cum = list(accumulate(tokens, initial=0))
    sums = Sums(list(map(cum.__getitem__, ends)), list(accumulate(map(bool, counts), initial=0)), max(tokens, default=0))
    return resolved, rows, views, sums


def _numbered(bases: list[str], counter: Counter) -> list[str]:
    """Each base's ``msg_id`` in the pass: its instance number counted in ``counter``."""
    msg_ids = []
    counter_get = counter.get
    for base in bases:
        n = counter_get(base, 0)
        counter[base] = n + 1
        msg_ids.append(base if n == 0 else f"{base}_{n}")
    return msg_ids
'''

OLD_ANTHROPIC = "class AnthropicLane:\n" + r'''    @staticmethod
    def array_cores(array: Any, flat: bool = False) -> tuple[list, ...] | None:
        """:meth:`item_cores` of every item of the conversation array ``array`` (its raw bytes),
        decoded in one call into typed structs (:class:`_Msg`) instead of dicts: a conversation's
        first pass reads every item.  ``(cores of each item, the structs)`` (the structs are for
        :meth:`patch_typed`); None when an item or block has a shape those structs do not hold
        (another block type, a field of another type): the caller reads the items one by one with
        :meth:`item_cores`, which gives the same cores for the shapes held here.  ``flat``:
        ``(the cores of every item in one list, where each item's cores end in it, the structs)``
        instead (ItemCache.get_many: no list per item to make and join again)."""
        got = _flat_cores(array)
        if got is None or flat:
            return got
        cores, ends, msgs = got
        return [cores[a:b] for a, b in zip([0, *ends], ends)], msgs



def _flat_cores(array: Any) -> tuple[list[Core], list[int], list[_Msg]] | None:
    """AnthropicLane.array_cores, flat: the cores of all the items in one list (one loop over
    every block of every item, one step per item to note where its cores end)."""
    try:
        msgs = _dec_msgs.decode(array)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    cores: list[Core] = []
    add = cores.append
    ends: list[int] = []
    end = ends.append
    unset = _UNSET
    paths, encode_json = _TEXT_PATHS, _enc_msg.encode
    for m in msgs:
        role = m.role
        if type(role) is not str:
            role = "user"
        content = m.content
        if type(content) is str:
            add(Core(role, TEXT, content, "", "", "", 0, _CONTENT_PATH))
        elif content is None or content is unset:  # (as item_cores reads a missing or null content)
            add(Core(role, OTHER, "null"))
        else:
            j = 0
            for b in content:
                t = type(b)
                if t is _Text:
                    add(Core(role, TEXT, b.text, "", "", "", 0, paths[j] if j < _N_PATHS else ("content", j, "text")))
                elif t is _ToolResult:
                    c, tid = b.content, b.tool_use_id
                    if type(tid) is not str:
                        tid = str(tid or "")
                    if type(c) is str:
                        add(Core("tool", TOOL_RESULT, c, "", tid))
                    else:
                        text, media = _result_text(None if c is unset else c)
                        add(Core("tool", TOOL_RESULT, text, "", tid, media))
                elif t is _ToolUse:
                    args, name, cid = b.input, b.name, b.id
                    if type(name) is not str:
                        name = str(name or "")
                    if type(cid) is not str:
                        cid = str(cid or "")
                    add(Core("assistant", TOOL_CALL, encode_json({} if args is None or args is unset else args).decode(),
                             name, cid))
                elif t is _Thinking:
                    add(Core("assistant", REASONING, str(b.thinking or "")))
                elif t is _Redacted:
                    add(Core("assistant", REASONING, str(b.data or "")))
                else:  # _Image
                    add(Core(role, IMAGE, "[image]", media=payload_of_source(None if b.source is unset else b.source)))
                j += 1
        end(len(cores))
    return cores, ends, msgs


'''

OLD_CHAT = "class ChatLane:\n" + r'''    @staticmethod
    def array_cores(array: Any, flat: bool = False) -> tuple[list, ...] | None:
        """:meth:`item_cores` of every item of the conversation array ``array`` (its raw bytes),
        decoded in one call into typed structs (one per role, :data:`_ChatMsg`) instead of dicts,
        as Anthropic's lane does: ``(cores of each item, the structs, whether each is a system
        item)``.  The structs hold the plain shapes only (string or null content, function calls
        with their arguments as sent); any other key or type fails the decode, and the caller reads
        the items one by one with :meth:`item_cores`, which gives the same cores for these shapes.
        ``flat``: ``(the cores of every item in one list, where each item's cores end in it, the
        structs, whether each is a system item)`` instead (ItemCache.get_many)."""
        got = _flat_cores(array)
        if got is None or flat:
            return got
        cores, ends, msgs, systems = got
        return [cores[a:b] for a, b in zip([0, *ends], ends)], msgs, systems



def _parts_cores(role: str, parts: list) -> list[Core]:
    """The cores of a typed content array, as content_cores reads its parts (_part_core)."""
    out = []
    for j, p in enumerate(parts):
        if type(p) is _TextPart:
            out.append(Core(role, TEXT, p.text, "", "", "", 0, _TEXT_PATHS[j] if j < _N_PATHS else ("content", j, "text")))
        else:
            out.append(Core(role, IMAGE, "[image]", media=_image_slot(None if p.image_url is _UNSET else p.image_url)))
    return out



def _flat_cores(array: Any) -> tuple[list[Core], list[int], list, list[bool]] | None:
    """ChatLane.array_cores, flat: the cores of all the items in one list (one loop over every
    item, one step each to note where its cores end)."""
    try:
        msgs = _dec_chat.decode(array)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    cores: list[Core] = []
    add = cores.append
    ends: list[int] = []
    end = ends.append
    unset = _UNSET
    path = _CONTENT_PATH
    for m in msgs:
        t = type(m)
        content = m.content
        if t is _Tool:
            cid = m.tool_call_id
            add(Core("tool", TOOL_RESULT, "" if content is None or content is unset else content, "",
                     cid if type(cid) is str else ""))
        elif t is _Assistant:
            calls = m.tool_calls
            if type(content) is list:
                cores += _parts_cores("assistant", content)
            elif not (content is None or content is unset or (content == "" and calls)):
                add(Core("assistant", TEXT, content, "", "", "", 0, path))
            if calls is not unset and calls is not None:
                for c in calls:
                    fn = c.function
                    if fn is unset:
                        return None  # (item_cores reads such a call as other content)
                    args, name, cid = fn.arguments, fn.name, c.id
                    add(Core("assistant", TOOL_CALL, args if type(args) is str else _arg_text(
                        None if args is unset else args), name if type(name) is str else "",
                        cid if type(cid) is str else ""))
        else:
            role = "user" if t is _User else "system"
            if type(content) is list:
                cores += _parts_cores(role, content)
            elif not (content is None or content is unset):
                add(Core(role, TEXT, content, "", "", "", 0, path))
        end(len(cores))
    return cores, ends, msgs, [type(m) is _System or type(m) is _Developer for m in msgs]


'''


def _exec(src: str, module, **gone) -> dict:
    """``src`` run in a copy of ``module``'s globals (``gone``: the globals it had that it no longer has)."""
    ns = {**gone, **vars(module)}
    exec(compile(src, f"<old {module.__name__}>", "exec"), ns)
    return ns


_OLD_STATE = _exec(OLD_ITEM_CACHE, state, OrderedDict=OrderedDict)
OldItemCache = _OLD_STATE["ItemCache"]
old_first_pass = _exec(OLD_FIRST_PASS, fresh)["first_pass"]
old_anthropic_array_cores = _exec(OLD_ANTHROPIC, anthropic)["AnthropicLane"].array_cores
old_chat_array_cores = _exec(OLD_CHAT, chat)["ChatLane"].array_cores
OLD_ARRAY_CORES = {"anthropic": old_anthropic_array_cores, "chat": old_chat_array_cores}


class _OldLane:
    """A lane with its array_cores as it was (everything else the lane's own)."""

    def __init__(self, lane):
        self._lane = lane
        self.array_cores = staticmethod(OLD_ARRAY_CORES[lane.name]).__func__

    def __getattr__(self, name):
        return getattr(self._lane, name)


def _patch_old(mp: pytest.MonkeyPatch) -> None:
    """The old code in place of the new (for whole Engine runs)."""
    for name in ("__init__", "_grown", "forget", "get", "_parts", "_new_parts"):
        mp.setattr(ItemCache, name, OldItemCache.__dict__[name])
    old_get_many = OldItemCache.__dict__["get_many"]

    def get_many(self, lane, raws, objs=None, whole=None, later=None):  # (the old one keeps its record at once)
        return old_get_many(self, lane, raws, objs, whole)

    mp.setattr(ItemCache, "get_many", get_many)
    mp.setattr(fresh, "first_pass", lambda s, infos, counter, first_index, flat=None:
               old_first_pass(s, infos, counter, first_index))  # (the old one made its lists itself)
    mp.setattr(anthropic.AnthropicLane, "array_cores", staticmethod(old_anthropic_array_cores))
    mp.setattr(chat.ChatLane, "array_cores", staticmethod(old_chat_array_cores))


# -- inputs ---------------------------------------------------------------------------------------


def _bench_bodies(lane: str, sizes=(1, 2, 7, 40, 100, 1000), seeds=(7, 3, 11)) -> list[bytes]:
    out = []
    for n in sizes:
        for seed in seeds[:1] if n >= 1000 else seeds:
            case = bench_overhead.Case(lane, n, seed=seed)
            out.append(case.unique_body())
            msgs = list(case.msgs)
            out.append(case.body(msgs + msgs[-3:]))  # items twice (a repeated item is the item read before)
            out.append(json.dumps({**case.top, "messages": msgs}).encode())  # Python's json: not compact
    return out


def _capture_bodies() -> list[tuple[str, bytes]]:
    from wirecases import capture_files, captured_bodies

    out = []
    for path in capture_files():
        out += [(c.lane.name, c.raw) for c in captured_bodies(path) if c.lane.name in ("anthropic", "chat")]
    return out


_PROSE = ["plain words", "Grüße, «naïve» café", "日本語のテキスト", "emoji 😀🎉", "a<b and c>d", "",
          "[bili] folded 3 messages\nthe rest", "[bili] only a marker", "[bili] one\n[bili] two\nthree",
          '<acp tokens="12" type="text">m00001</acp>\nechoed prose', "text <acp>m00002</acp> inline",
          "</acp> lone close", "prose m00003</acp>", "x" * 3000, "tab\tnew\nline \\ quote \" slash /",
          "\u2028\u2029 separators", "<", "[bili]", "[bili]  x"]


def _prose(rng: random.Random) -> str:
    return "".join(rng.choice(_PROSE) for _ in range(rng.randint(1, 3)))


def _anthropic_item(rng: random.Random) -> dict:
    role = rng.choice(["user", "assistant", "assistant", "system", "other"])
    k = rng.random()
    if k < 0.25:
        return {"role": role, "content": _prose(rng)}
    if k < 0.3:
        return rng.choice([{"role": role}, {"role": role, "content": None}, {"content": "no role"},
                           {"role": 3, "content": "odd role"}, {"role": role, "content": 5}])
    blocks = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(["text", "text", "tool_use", "tool_result", "thinking", "redacted", "image", "doc"])
        if kind == "text":
            b = {"type": "text", "text": _prose(rng)}
            if rng.random() < 0.2:
                b["cache_control"] = {"type": "ephemeral"}
        elif kind == "tool_use":
            b = {"type": "tool_use", "id": f"toolu_{rng.randint(0, 5)}", "name": rng.choice(["Bash", "Read", 7, None]),
                 "input": rng.choice([{"command": _prose(rng)}, {}, None, [1, "é"], {"n": 1.5, "b": True}])}
        elif kind == "tool_result":
            b = {"type": "tool_result", "tool_use_id": rng.choice([f"toolu_{rng.randint(0, 5)}", 9, None]),
                 "content": rng.choice([_prose(rng), None, [{"type": "text", "text": _prose(rng)}],
                                        [{"type": "image", "source": {"type": "base64", "data": "aGk="}}, {"type": "text", "text": "t"}],
                                        {"x": 1}])}
            if rng.random() < 0.3:
                b["is_error"] = True
        elif kind == "thinking":
            b = {"type": "thinking", "thinking": _prose(rng), "signature": "sig"}
        elif kind == "redacted":
            b = {"type": "redacted_thinking", "data": "opaque"}
        elif kind == "image":
            b = {"type": "image", "source": rng.choice([{"type": "base64", "media_type": "image/png", "data": "aGVsbG8="},
                                                         {"type": "url", "url": "http://x/y.png"}])}
        else:
            b = {"type": "document", "source": {"type": "text", "data": _prose(rng)}}
        blocks.append(b)
    return {"role": role, "content": blocks}


def _chat_item(rng: random.Random) -> dict:
    role = rng.choice(["user", "assistant", "assistant", "system", "developer", "tool"])
    if role == "tool":
        m = {"role": "tool", "tool_call_id": rng.choice([f"call_{rng.randint(0, 5)}", 3]), "content": _prose(rng)}
        if rng.random() < 0.3:
            m["name"] = "Bash"
        return m
    if role == "assistant" and rng.random() < 0.5:
        m = {"role": "assistant", "content": rng.choice(["", None, _prose(rng)]),
             "tool_calls": [{"id": f"call_{rng.randint(0, 5)}", "type": "function",
                             "function": {"name": rng.choice(["Bash", 4]), "arguments": rng.choice(
                                 ['{"command":"ls"}', {"a": 1}, None, "plain"])}} for _ in range(rng.randint(1, 2))]}
        if rng.random() < 0.1:
            m["reasoning_content"] = _prose(rng)  # (not a typed shape: the items are read one by one)
        return m
    k = rng.random()
    if k < 0.6:
        return {"role": role, "content": _prose(rng)}
    if k < 0.65:
        return {"role": role, "content": None}
    return {"role": role, "content": [rng.choice([{"type": "text", "text": _prose(rng)},
                                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}])
                                      for _ in range(rng.randint(0, 3))]}


def _random_bodies(lane: str, count: int = 60, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    make = _anthropic_item if lane == "anthropic" else _chat_item
    out = []
    for _ in range(count):
        msgs = [make(rng) for _ in range(rng.randint(0, 25))]
        if msgs and rng.random() < 0.3:
            msgs += rng.sample(msgs, min(len(msgs), rng.randint(1, 3)))  # duplicates
        top = {"model": "m", "messages": msgs}
        if lane == "anthropic" and rng.random() < 0.5:
            top["system"] = "you are"
        if rng.random() < 0.3:
            out.append(json.dumps(top, ensure_ascii=rng.random() < 0.5).encode())
        else:
            out.append(msgspec.json.encode(top))
    return out


def _all_bodies(lane: str) -> list[bytes]:
    return (_bench_bodies(lane) + _random_bodies(lane) +
            [raw for name, raw in _capture_bodies() if name == lane])


# -- the parts of the pass ---------------------------------------------------------------------


def _cores(infos) -> list:
    return [[msgspec.structs.astuple(p.core) for p in i.parts] for i in infos]


def _same_get_many(lane, raws, whole, pre: list | None = None) -> None:
    """get_many, new and old, on caches holding ``pre`` first: the same ItemInfos (cores with every
    field), objs, cache entries in order, size."""
    old_lane = _OldLane(lane)
    new_cache, old_cache = ItemCache(), OldItemCache()
    if pre:
        new_cache.get_many(lane, pre)
        old_cache.get_many(old_lane, pre)
    new_objs, old_objs = [], []
    new = new_cache.get_many(lane, raws, new_objs, whole)
    old = old_cache.get_many(old_lane, raws, old_objs, whole)
    lazy = [p for i in new for p in i.parts if p.h_chash is None]  # (a first pass's: hashed when first read)
    assert not lazy or whole is not None
    hash_parts([p for i in new for p in i.parts])
    assert new == old and _cores(new) == _cores(old)
    # an item the cache held, or one twice, is read typed with the others (the old loop left it
    # undecoded: None), and so is one the old loop decoded alone (a dict)
    assert len(new_objs) == len(old_objs)
    for n, o in zip(new_objs, old_objs):
        assert n == o or (o is None or type(o) is dict) and type(n) is not dict
    assert list(new_cache.items.items()) == list(old_cache.items.items())
    assert [k[1] is v.raw for k, v in new_cache.items.items()] == [k[1] is v.raw for k, v in old_cache.items.items()]
    assert new_cache.size == old_cache.size
    # and again on those caches (found items move to the end)
    assert new_cache.get_many(lane, raws[::-1]) == old_cache.get_many(old_lane, raws[::-1])
    assert list(new_cache.items.items()) == list(old_cache.items.items()) and new_cache.size == old_cache.size


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_array_cores_as_before(lane_name):
    lane = LANES[lane_name]
    typed = 0
    for raw in _all_bodies(lane_name):
        try:
            body = Body(raw, "messages")
        except Exception:
            continue
        if not body.array:
            continue
        whole = body.top["messages"]
        for flat in (False, True):
            new, old = lane.array_cores(whole, flat=flat), OLD_ARRAY_CORES[lane_name](whole, flat=flat)
            assert new == old
            if new is not None:
                typed += 1
                cores = new[0] if flat else [c for cs in new[0] for c in cs]
                ocores = old[0] if flat else [c for cs in old[0] for c in cs]
                assert list(map(msgspec.structs.astuple, cores)) == list(map(msgspec.structs.astuple, ocores))
    assert typed > 20


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_get_many_as_before(lane_name):
    lane = LANES[lane_name]
    rng = random.Random(1)
    for raw in _all_bodies(lane_name):
        try:
            body = Body(raw, "messages")
        except Exception:
            continue
        if not body.array:
            continue
        raws, whole = body.items, body.top["messages"]
        _same_get_many(lane, raws, whole)
        _same_get_many(lane, raws, None)
        _same_get_many(lane, list(map(bytes, raws)), whole)
        if raws:
            some = [bytes(r) for r in raws if rng.random() < 0.3]
            _same_get_many(lane, raws, whole, some)  # some of them cached
            _same_get_many(lane, raws, whole, list(map(bytes, raws)))  # all of them


def test_get_many_evicts_as_before():
    lane = LANES["anthropic"]
    body = Body(bench_overhead.Case("anthropic", 40).unique_body(), "messages")
    for limit in (0, 1, 5000, 20000, 10 ** 9):
        new, old = ItemCache(max_bytes=limit), OldItemCache(max_bytes=limit)
        assert new.get_many(lane, body.items, [], body.top["messages"]) == old.get_many(
            _OldLane(lane), body.items, [], body.top["messages"])
        assert list(new.items.items()) == list(old.items.items()) and new.size == old.size


def _odd_cores(rng: random.Random) -> list[Core]:
    """Cores no JSON decoder gives but a core may hold: lone surrogates, media slots, markers."""
    texts = _PROSE + ["a\ud800b", "\udfff", "x\ud83d", "😀\udc00"]
    out = []
    for _ in range(rng.randint(0, 30)):
        role = rng.choice(["user", "assistant", "tool", "system"])
        ctype = rng.choice([TEXT, TEXT, TOOL_CALL, TOOL_RESULT, REASONING, IMAGE, OTHER])
        out.append(Core(role, ctype, rng.choice(texts) + rng.choice(texts), rng.choice(["", "Bash", "n\ud800"]),
                        rng.choice(["", "call_1", "c\udfff"]), rng.choice(["", "", "url:http://x", "b64:\ud800"]),
                        rng.randint(0, 3), rng.choice([(), ("content",), ("content", 0, "text")]), rng.random() < 0.1))
    return out


def test_new_parts_as_before():
    rng = random.Random(5)
    for _ in range(400):
        flat = _odd_cores(rng)
        a, b = list(flat), list(flat)
        new, old = ItemCache._new_parts(a), OldItemCache._new_parts(b)
        assert new == old and a == b
        assert [msgspec.structs.astuple(p.core) for p in new] == [msgspec.structs.astuple(p.core) for p in old]


def _session(next_ref: int = 1) -> Session:
    return Session(SessionRow("s", "agent", "anthropic", 0.0, 0.0, 0, 0, next_ref))


def _same_first_pass(infos, counter: Counter, first_index: int, next_ref: int = 1) -> None:
    s_new, s_old = _session(next_ref), _session(next_ref)
    c_new, c_old = Counter(counter), Counter(counter)
    new = fresh.first_pass(s_new, infos, c_new, first_index)
    old = old_first_pass(s_old, infos, c_old, first_index)
    if new is not None:  # (its rows, and the parts' msg_ids and counts, made when it is written)
        assert not s_new.refs and len(new[1]) == sum(len(i.parts) for i in infos)
        new = (new[0], new[1].get(), new[2], new[3])
    assert new == old
    assert list(s_new.refs.items()) == list(s_old.refs.items())
    assert list(c_new.items()) == list(c_old.items())


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_first_pass_as_before(lane_name):
    lane = LANES[lane_name]
    for raw in _all_bodies(lane_name):
        try:
            body = Body(raw, "messages")
        except Exception:
            continue
        if not body.array:
            continue
        infos = ItemCache().get_many(lane, body.items, [], body.top["messages"])
        for start in {0, 1, len(infos) // 2}:
            part = infos[start:]
            _same_first_pass(part, Counter(), start)
            bases = [p.base for i in part for p in i.parts]
            _same_first_pass(part, Counter(bases[:3]), start)  # an instance counter not empty
            total = len(bases)
            for next_ref in (0, MAX_REF - total + 1, MAX_REF - total + 2, 12345):  # near the last ref
                _same_first_pass(part, Counter(), start, next_ref)


def test_first_pass_as_before_odd_parts():
    """Parts from odd cores (dirty ones, bases twice), items without parts."""
    rng = random.Random(9)
    for _ in range(200):
        flat = _odd_cores(rng)
        flat += rng.sample(flat, min(len(flat), 3))
        parts = ItemCache._new_parts(flat)
        infos, at = [], 0
        while at < len(parts) or rng.random() < 0.3:
            k = rng.randint(0, 4)
            infos.append(state.ItemInfo(b"{}", rng.random() < 0.1, parts[at:at + k]))
            at += k
        _same_first_pass(infos, Counter(), rng.randint(0, 3))
        _same_first_pass(infos, Counter([p.base for p in parts[:2]]), 0)


# -- whole Engine runs -----------------------------------------------------------------------------


def _run(tmp_path, name: str, lane: str, bodies: list[bytes], old: bool) -> list:
    with pytest.MonkeyPatch.context() as mp:
        if old:
            _patch_old(mp)
        e = Engine(Store(tmp_path / f"{name}-{old}.db"))
        try:
            out = []
            for i, raw in enumerate(bodies):
                sid = f"s{i % 3}"
                r = e.process(raw, LANES[lane], {"x-acp-session": sid}, render=True)
                out.append((r.body, r.refs_new, r.refs_known, r.tagged, r.messages, r.source))
            out.append([e.store.ledger(f"s{i}") for i in range(3)])
            out.append([(k, v.parts, v.is_system) for k, v in e.items.items.items()])
            return out
        finally:
            e.store.close()


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_engine_as_before(tmp_path, lane_name):
    bodies = []
    for n in (3, 40, 100):
        case = bench_overhead.Case(lane_name, n, seed=n)
        msgs = list(case.msgs)
        bodies += [case.body(msgs), case.body(msgs + [case.new(0)]), case.unique_body()]
    bodies += _random_bodies(lane_name, 30, seed=4)
    bodies += [raw for name, raw in _capture_bodies() if name == lane_name][:40]
    assert _run(tmp_path, "e", lane_name, bodies, False) == _run(tmp_path, "e", lane_name, bodies, True)


def test_get_as_before():
    """``get`` (the cache is a dict now, an item found again put back last): the same items, order,
    size and evictions as before, each key holding the item's own bytes (not a second copy)."""
    lane = LANES["anthropic"]
    case = bench_overhead.Case("anthropic", 30, seed=2)
    raws = [msgspec.json.encode(m) for m in case.msgs]
    rng = random.Random(3)
    for limit in (0, 3000, 10000, 10 ** 9):
        new, old = ItemCache(max_bytes=limit), OldItemCache(max_bytes=limit)
        for _ in range(300):
            raw = bytes(rng.choice(raws))  # (a copy: equal bytes, another object)
            if rng.random() < 0.3:
                batch = [bytes(r) for r in rng.sample(raws, 4)]
                assert new.get_many(lane, batch) == old.get_many(_OldLane(lane), batch)
            else:
                assert new.get(lane, raw) == old.get(lane, raw)
            assert list(new.items.items()) == list(old.items.items()) and new.size == old.size
            assert all(k[1] is v.raw for k, v in new.items.items())
