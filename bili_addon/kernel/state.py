"""The kernel's records: parsed items (shared by content), sessions, and one turn's outcome."""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import islice, repeat
from operator import is_
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bili_addon.kernel.fold import Block, View, ViewItem
from bili_addon.kernel.identity import digest, sha256
from bili_addon.kernel.reconcile import Copy
from bili_addon.store import SessionRow
from bili_addon.stream.echo import strip_echoes
from bili_addon.wire import Lane
from bili_addon.wire.base import TEXT, Core, decode_any

# a session's flags as its row stores them: ``json.dumps(flags, sort_keys=True)`` (which makes a new
# encoder on every call, ~3 us of ~9: made once here, the same bytes; the registry and lineage use it)
flags_json = json.JSONEncoder(sort_keys=True).encode

# the one-line visibility marker the addon may add to a response (kernel/tools.py: "[bili] compressed m00002–m00019,
# ~1.5K tokens saved"); stripped when replayed: that line's shape only (the model's own "[bili] ..." line, a quote of
# bili's log, is its prose)
MARKER_LINE = re.compile(r"^\[bili\] compressed m\d{4,}[^\n]*→ b\d+[^\n]*(?:\n|$)")
_MARKER = "[bili] "  # how every text MARKER_LINE matches begins


def clean_replayed_prose(text: str) -> str:
    """What the host replays of the model's prose, minus our markers and the model's tag echoes
    (with the blank lines they drag along)."""
    while MARKER_LINE.match(text):
        text = MARKER_LINE.sub("", text, count=1)
    return strip_echoes(text)


class Part(msgspec.Struct, gc=False):
    """A core (prose already cleaned) with its identity digest, computed once per distinct item
    bytes: when the part is made, or (a conversation's first pass: :func:`hash_parts`, after its
    request has gone, kernel/fresh.py) when first read."""

    core: Core
    h_base: str | None  # h_ + 16 hex (None: not computed yet; read ``base``)
    h_chash: str | None  # full sha256 hex of the seed (None: not computed yet; read ``chash``)
    dirty: bool  # the wire text differs from core.text (cleaned at ingress)

    @property
    def base(self) -> str:
        base = self.h_base
        if base is None:
            base, self.h_chash = digest(self.core)
            self.h_base = base
        return base

    @property
    def chash(self) -> str:
        chash = self.h_chash
        if chash is None:
            self.h_base, chash = digest(self.core)
            self.h_chash = chash
        return chash

    def __eq__(self, other: object) -> bool:  # (a part not hashed yet equals its hashed twin)
        if type(other) is not Part:
            return NotImplemented
        return (self.core == other.core and self.dirty == other.dirty and self.chash == other.chash
                and self.base == other.base)


def _chashes(cores: list[Core]) -> list[str]:
    """identity.digest's content hash of each core, in one C-level loop (inlined: the same seed,
    the same hash; encoded strictly first, which gives the same bytes for every text without a
    lone surrogate and is a cheaper call, else as digest encodes)."""
    h = sha256
    try:
        return [h((f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}|{c.media}" if c.media else
                   f"{c.role}|{c.ctype}|{c.tool_call_id}|{c.tool_name}|{c.text}").encode()).hexdigest() for c in cores]
    except UnicodeEncodeError:
        return [digest(c)[1] for c in cores]


def hash_parts(parts: list[Part]) -> None:
    """The identity digest of every part of ``parts`` that has none yet (:func:`_chashes`)."""
    todo = [p for p in parts if p.h_chash is None]
    if todo:
        for p, x in zip(todo, _chashes([p.core for p in todo])):
            p.h_base, p.h_chash = "h_" + x[:16], x


class ItemInfo(msgspec.Struct, gc=False):
    raw: bytes
    is_system: bool
    parts: list[Part]
    canon: bytes | None = None  # canonical form, computed for anonymous sessions only

    @property
    def obj(self) -> Any:
        """The decoded item (decoded again on demand: only rare paths need it)."""
        return decode_any(self.raw)


HEAD_BYTES = 64 << 10  # what head_cores reads at most (a first message with a screenshot: left to the pass)


def head_cores(lane: Lane, raws, limit: int = 8) -> tuple[Core | None, bool] | None:
    """What a conversation's first items say before the pass reads them all (a store's lock sent
    early with its fork key: Engine._soon): ``(the first part's core after the leading system
    items, or None, whether a part of the assistant's is among them)``, each core as the item cache
    reads it (assistant prose cleaned of replayed markers); None when ``limit`` items, or the items
    in :data:`HEAD_BYTES`, hold no assistant's part and more follow (unknown: the pass reads on)."""
    first = None
    system = True  # (the leading system run: not the conversation's)
    size = 0
    for raw in islice(raws, limit):
        size += len(raw)
        if size > HEAD_BYTES:
            return None
        obj = decode_any(raw)
        if system and lane.is_system_item(obj):
            continue
        system = False
        for core in lane.item_cores(obj):
            if first is None:
                if core.role == "assistant" and core.ctype == TEXT:
                    clean = clean_replayed_prose(core.text)
                    if clean != core.text:
                        core = msgspec.structs.replace(core, text=clean)
                first = core
            if core.role == "assistant":
                return first, True
    return (first, False) if len(raws) <= limit else None


class ItemCache:
    """Parsed items by their exact bytes: a follow-up turn never re-parses or re-hashes old history."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.size = 0
        # oldest first (a dict keeps its insertion order; an item found again is put back last):
        # a plain dict, not an OrderedDict, which stores each key twice over (its order as a
        # linked list beside the table) and was twice as slow to fill (a first pass adds every item)
        self.items: dict[tuple[str, bytes], ItemInfo] = {}

    # the last first pass :meth:`get_many` read (its ItemInfos, their parts in one list, the parts'
    # cores and ``dirty``, where each item's parts end) until its first_pass takes it (first_flat) or
    # its record is kept (_keep)
    _flat: tuple | None = None

    def _grown(self, size: int) -> None:
        """``size`` bytes of items added: the oldest go while the cache is over its limit."""
        self.size += size
        if self.size > self.max_bytes and self.items:
            # (the oldest found in one walk from the front, then dropped: a dict's first key
            # is found by skipping the slots of the keys dropped before it)
            size, limit, drop = self.size, self.max_bytes, []
            for key in self.items:
                if size <= limit:
                    break
                drop.append(key)
                size -= len(key[1])
            for key in drop:
                del self.items[key]
            self.size = size

    def forget(self) -> None:
        """Drop every parsed item (the next pass parses its items anew)."""
        self.items.clear()
        self.size = 0

    def get(self, lane: Lane, raw: bytes) -> ItemInfo:
        key = (lane.name, raw)
        info = self.items.pop(key, None)
        if info is not None:
            self.items[(key[0], info.raw)] = info  # the newest now (keyed by the bytes it holds, not a copy)
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

    def get_many(self, lane: Lane, raws, objs: list | None = None, whole=None,
                 later: list | None = None) -> list[ItemInfo]:
        """:meth:`get` of each of ``raws`` (``bytes`` or ``msgspec.Raw``), in one pass: a
        conversation's first pass parses every item, and the per-call work of :meth:`get` (and of
        :func:`~bili_addon.kernel.identity.digest`, inlined here: the same seed, the same hash) was
        a fifth of that pass (bench_overhead.py).  The items are read in one loop, then the new
        parts are cleaned, hashed and made in C-level loops over flat lists (comprehensions and
        ``map``), not one Python step per part.  ``objs``: gets each item as decoded here (None
        for one found in the cache, the lane's typed struct for one its ``array_cores`` read), for
        the pass's rendering to patch (wire.base.patch_decoded, the lane's ``patch_typed``).
        ``whole``: the array ``raws`` were split from (a pass that shares no item with a previous
        one: a conversation's first), decoded in one call, the lane's typed reading of every item
        in order when it has one (any item the cache holds, or one twice, read again: the same
        values), else when the first item is new, or at the first new item when at least half of
        them are new.  ``later``: where to leave the cache's record of items so read, for after the
        request (the bytes of every item hashed for its key, ~0.15x the floor: ``Engine._later``);
        None: at once."""
        name, items = lane.name, self.items
        pop = items.pop
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
            # a conversation's first pass: the loop below in C-level steps (the same ItemInfos,
            # cores, cache order and size; objs typed for every item): the lane reads the cores of
            # all the items into one list, the parts are made of it, each item's are a slice
            got = array_cores(whole, flat=True)  # (the cores of them all, where each item's end)
            if got is not None and len(got[1]) == len(raws):
                braws = list(map(bytes, raws))
                flat, ends = got[0], got[1]
                if objs is not None:
                    objs.extend(got[2])
                dirty: list[bool] = []
                if flat:
                    parts = self._new_parts(flat, lazy=True, dirty=dirty)  # (hashed when first read: fresh.py)
                    lists = [parts[a:b] for a, b in zip([0, *ends], ends)]  # (no slice object made)
                else:
                    parts, lists = [], [[] for _raw in braws]
                out = list(map(ItemInfo, braws, got[3] if len(got) > 3 else repeat(False), lists))
                self._flat = (out, parts, flat, dirty, ends)  # (for the pass's fresh.first_pass: first_flat)
                if later is not None:
                    later.append(lambda: self._keep(name, braws, out))
                else:
                    self._keep(name, braws, out)
                return out
            array_cores = None  # (read them one by one below, the array decoded once)
            keys = [(name, bytes(r)) for r in raws]
            wide = (len(keys) - sum(map(items.__contains__, keys))) * 2 >= len(keys)
        for i, r in enumerate(raws):
            raw = bytes(r)
            key = (name, raw)
            info = pop(key, None)
            if info is not None:
                items[(name, info.raw)] = info  # the newest now (keyed by the bytes it holds, not a copy)
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

    def _keep(self, name: str, braws: list[bytes], out: list[ItemInfo]) -> None:
        """The cache's record of the items of a first pass (:meth:`get_many`), as the item-by-item
        loop leaves it: an item the cache held is kept as it was and made the newest where it comes,
        then the others follow in order (the first of twins), the size grown by their bytes.  (The
        pass's lists for its first_pass go: it has run.)"""
        if self._flat is not None and self._flat[0] is out:
            self._flat = None
        items = self.items
        pop = items.pop
        new: dict[tuple[str, bytes], ItemInfo] = {}
        for key, info in zip(zip(repeat(name), braws), out):
            held = pop(key, None)
            if held is not None:
                items[(name, held.raw)] = held
            elif key not in new:
                new[key] = info
        if any(info.parts for info in new.values()):
            items.update(new)
        self._grown(sum(len(key[1]) for key in new))

    def first_flat(self, infos: list[ItemInfo]) -> tuple[list[Part], list[Core], list[bool], list[int]] | None:
        """The flat lists of ``infos`` as this cache's last first pass (:meth:`get_many`) made them
        (their parts in one list, the parts' cores, their ``dirty``, where each item's parts end in
        them): the lists ``fresh.first_pass`` would make again of them.  When ``infos`` are the items
        of that pass (the same objects: ``get_many`` makes a first pass's ItemInfos anew, and their
        parts are never changed), or its last ones; else None.  Taken once (a later call: None)."""
        got, self._flat = self._flat, None
        if got is None:
            return None
        out, parts, cores, dirty, ends = got
        off = len(out) - len(infos)
        if off < 0 or not all(map(is_, infos, islice(out, off, None) if off else out)):
            return None
        if off:
            base = ends[off - 1]
            return parts[base:], cores[base:], dirty[base:], [e - base for e in islice(ends, off, None)]
        return parts, cores, dirty, ends

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
    def _new_parts(flat: list[Core], lazy: bool = False, dirty: list[bool] | None = None) -> list[Part]:
        """The :class:`Part` of every core in ``flat`` (changed in place where assistant prose is
        cleaned), each with its digest (:func:`_chashes`).  ``lazy``: the digests are left for when they
        are first read (:func:`hash_parts`; a conversation's first pass needs none before its
        request goes).  ``dirty``: an empty list, given each part's ``dirty``."""
        if dirty is None:
            dirty = [False] * len(flat)
        else:
            dirty += [False] * len(flat)
        # clean_replayed_prose changes only a text that starts with a marker line (MARKER_LINE) or
        # holds an angle bracket (every echo shape has one): the others are not passed to it
        for j in [j for j, c in enumerate(flat) if c.ctype == TEXT and c.role == "assistant"
                  and ("<" in c.text or c.text.startswith(_MARKER))]:
            core = flat[j]
            clean = clean_replayed_prose(core.text)
            if clean != core.text:
                flat[j], dirty[j] = msgspec.structs.replace(core, text=clean), True
        if lazy:
            return list(map(Part, flat, repeat(None), repeat(None), dirty))
        hashes = _chashes(flat)
        return list(map(Part, flat, ["h_" + x[:16] for x in hashes], hashes, dirty))


# Entry and Resolved are made per part of every new item: msgspec Structs build ~3x faster than dataclasses
class Entry(msgspec.Struct, gc=False):
    ref: str
    tokens: int


@dataclass
class Call:
    """A proxy tool call the model made; ``result`` stays None until it is executed, exactly once."""

    name: str
    args: str
    result: str | None = None


class Resolved(msgspec.Struct, gc=False):
    core: Core
    entry: Entry
    dirty: bool
    msg_id: str  # (with ``base``: a first pass's are set when its ledger rows are made, fresh.Rows)
    base: str
    incs: int = 1  # instance numbers this part used up (more than one when it was renumbered)


@dataclass
class Memo:
    """What the previous pass of a session computed, so an appended turn costs only its suffix.

    ``rendered`` holds every item after its per-item transforms (tags, restored calls, real tool
    results, id hygiene); it is valid while the session's ``version`` is unchanged.
    """

    lane: str
    sid: str
    version: int
    raws: list[msgspec.Raw]
    infos: list[ItemInfo]
    start: int
    chain: list[str] | None
    resolved: list[list[Resolved]]
    view_items: list[ViewItem]
    rendered: list[bytes] | None  # None: the pass rendered nothing
    changed_cum: list[int]  # changed_cum[i]: rendered items among the first i that differ from the wire
    tagged_cum: list[int]
    bases: Counter  # instance counts of every base id in the pass
    size: int = 0  # the conversation's bytes (what Sessions.remember weighs it by)
    marks: list | None = None  # running counts of the agent's cache marks over raws (breakpoints.agent_marks)


@dataclass
class Session:
    row: SessionRow
    refs: dict[tuple[str, str], Entry] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # ref -> content hash
    flags: dict[str, Any] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)
    calls: dict[str, Call] = field(default_factory=dict)
    copy: Copy = field(default_factory=Copy)  # the canonical copy of the last steady pass
    transcript: list | None = None  # snapshot render: (signature, refs, bytes) per item, loaded lazily
    model: str = ""
    variant: str = ""  # the window the last request asked for beside its model's (kernel/windows.py: "[1m]")
    version: int = 0  # bumped whenever something changes how old items render
    stored: int = 0  # the store's version of the session this copy reflects (another process may advance it)
    # the store had no row of the session when it was loaded, and nothing of it since: no family, no
    # lineage record (written after a first commit, never before); cleared once read (kernel/lineage.py)
    unstored: bool = False
    last_view: View | None = None  # the conversation as the last request showed it
    # the blocks that request did not render (kernel/reconcile.py: a branch rewound into their range): a
    # native call resolved against ``last_view`` must not take them in, as the request's own calls do not
    last_snoozed: frozenset[str] = frozenset()
    last_resolved: list | None = None  # ``last_view``'s parts as that pass resolved them (their ledger ids)
    sent_tokens: int = 0  # the last request, as sent
    unfolded_tokens: int = 0  # the last request, had nothing been folded
    id_sets: tuple | None = None  # the canonical copy's ids as sets (turn._id_sets)
    family: bool = False  # in a family of forks (its refs from the family's counter), as its turn found it
    strict: bool = False  # its last pass rendered its Chat items with the strict reasoning repair


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
    declined: list[str] = field(default_factory=list)  # why a compress run for it folded nothing (as the model read)
    marker: str = ""  # the visibility line for this request's answer
    folded_items: int = 0
    landed: int = 0  # held folds whose ranges left the wire with this request (kernel/pending.py)
    active: bool = True  # bili shows itself in this request (lazy activation): its proxy tools are live
    reused: int = 0  # items whose work came from the previous pass
    drift: str = ""  # the fold-coverage verdict, when covered refs went missing
    epoch: int = 0  # the epoch this request began (the agent compacted its history), else 0
    status: int = 0  # non-zero: answer the client with this status instead of forwarding
    error: str = ""
    shadowed: tuple[str, ...] = ()  # bili's tool names the agent's own tools have: its calls of them are the agent's
    side: bool = False  # a side request (reconcile.side_request): its answer's usage is not the conversation's size
    sent_tokens: int = 0  # what went up, as bili estimates it (its size, should the provider refuse it: kernel/errors.py)
    model: str = ""  # the model the request names (its figures are priced at it)
    variant: str = ""  # the window the request asks for beside its model's ("[1m]": kernel/windows.py)


__all__ = [
    "Call", "Entry", "ItemCache", "ItemInfo", "MARKER_LINE", "Memo", "Part", "Resolved", "Session",
    "TurnResult", "clean_replayed_prose", "hash_parts",
]
