"""#11, a conversation's first turn: its per-message work cut without changing a byte (fresh.first_pass
takes the flat lists ItemCache.get_many made of the pass's parts instead of making them again:
ItemCache.first_flat; its entries are made with its rows, after the request).  The oracles are the functions as they were before (kept below, patched in),
compared with the code as it is: whole Engine runs (tests/oracle_runs.py) over the bench's
conversations (first turns, forks, follow-ups, folded follow-ups, urgent reminders, truncations)
and the captures (BILI_CAPTURES): the same bytes out, the same results, flags, ledgers and lineage;
and unit by unit (first_pass's refs, view items and sums, get_many's items and cache)."""

from __future__ import annotations

import sys
from collections import Counter
from itertools import accumulate, islice, repeat
from pathlib import Path

import msgspec
import pytest

from bili_addon.wire import Lane

from bili_addon.kernel import fresh
from bili_addon.kernel.fold import PartView, Sums, ViewItem
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import (TEXT, Core, Entry, ItemCache, ItemInfo, Part, Resolved, Session, _chashes,
                                     _MARKER, clean_replayed_prose, decode_any, hash_parts)
from bili_addon.kernel.fresh import Rows, _numbered
from bili_addon.store import MAX_REF, LedgerRow, ref_names
from bili_addon.wire import LANES

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_first_fixed import Trace, benchs_turns, conversation, folds_of_every_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


# -- the oracles: the functions as they were --------------------------------------------------------

class OldItemCache(ItemCache):
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
                if flat:
                    parts = self._new_parts(flat, lazy=True)  # (hashed when first read: fresh.py)
                    lists = [parts[a:b] for a, b in zip([0, *ends], ends)]  # (no slice object made)
                else:
                    lists = [[] for _raw in braws]
                out = list(map(ItemInfo, braws, got[3] if len(got) > 3 else repeat(False), lists))
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

    @staticmethod
    def _new_parts(flat: list[Core], lazy: bool = False) -> list[Part]:
        """The :class:`Part` of every core in ``flat`` (changed in place where assistant prose is
        cleaned), each with its digest (:func:`_chashes`).  ``lazy``: the digests are left for when they
        are first read (:func:`hash_parts`; a conversation's first pass needs none before its
        request goes)."""
        dirty = [False] * len(flat)
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



def old_first_pass(s: Session, infos: list[ItemInfo], counter: Counter,
               first_index: int) -> tuple[list[list[Resolved]], Rows, list[ViewItem], Sums] | None:
    """``(resolved, new ledger rows, view items, sums)`` of a pass whose every part is new (see
    :func:`applies`); ``sums``: what the :class:`~bili_addon.kernel.fold.View` of the items
    computes (``View(items, sums)``).  None when the refs would run past the last one (the general
    path says so).  The rows are made when they are written (:class:`Rows`): then the parts are
    hashed (state.hash_parts), numbered in ``counter``, staged in ``s.refs`` as ``_resolve``
    stages them, and the resolved parts get their ``msg_id`` and ``base``.

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
    texts = [c.text for c in cores]
    roles = [c.role for c in cores]
    ctypes = [c.ctype for c in cores]
    # identity.count_tokens (its ASCII case inlined)
    tokens = [-(-len(t) // 4) if t.isascii() else count_tokens(t) for t in texts]
    entries = list(map(Entry, names, tokens))
    flat = list(map(Resolved, cores, entries, [p.dirty for p in parts], repeat(None), repeat(None)))

    def rows() -> list[LedgerRow]:
        hash_parts(parts)
        bases = [p.h_base for p in parts]
        chashes = [p.h_chash for p in parts]
        if not counter:
            counter.update(bases)  # (C-level count)
            if len(counter) == total:  # no base twice: every msg_id is its base
                msg_ids = bases
            else:
                counter.clear()
                msg_ids = _numbered(bases, counter)
        else:
            msg_ids = _numbered(bases, counter)
        s.refs.update(zip(zip(msg_ids, chashes), entries))  # staged: forgotten again if the commit fails
        for r, msg_id, base in zip(flat, msg_ids, bases):
            r.msg_id, r.base = msg_id, base
        return list(map(LedgerRow, msg_ids, chashes, names, roles, ctypes, tokens))

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
    return resolved, Rows(total, rows), views, sums



def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(ItemCache, "get_many", OldItemCache.get_many)
    mp.setattr(ItemCache, "_new_parts", OldItemCache.__dict__["_new_parts"])
    mp.setattr(fresh, "first_pass", lambda s, infos, counter, first_index, flat=None:
               old_first_pass(s, infos, counter, first_index))  # (the old one made its lists itself)


# -- (1) unit by unit: the first pass's refs, view and sums, with and without get_many's lists -------------

def bodies(lane: str, n: int) -> list[bytes]:
    case = bench_overhead.Case(lane, n)
    return [case.body(conversation(case, i, big)) for i, big in ((0, False), (1, True))]


def first_of(raw: bytes, lane, old: bool, cut: int = 0):
    """A fresh session's first pass of ``raw``: ``(resolved, rows, views, sums, infos)``; ``cut``:
    the pass over the items from there on (a system run before them)."""
    from bili_addon.wire.base import Body
    from bili_addon.store import SessionRow

    b = Body(raw, lane.conv_key)
    cache = OldItemCache() if old else ItemCache()
    infos = cache.get_many(lane, b.items, [], b.top[lane.conv_key], [])
    s = Session(SessionRow(id="x", agent="", lane=lane.name, created=0.0, last_seen=0.0, requests=0, messages=0,
                           next_ref=1))
    counter = Counter()
    got = (old_first_pass(s, infos[cut:], counter, cut) if old else
           fresh.first_pass(s, infos[cut:], counter, cut, flat=cache.first_flat(infos[cut:])))
    resolved, rows, views, sums = got
    return ([[msgspec.structs.asdict(r) for r in rs] for rs in resolved], rows.get(), views, sums,
            [[msgspec.structs.asdict(r) for r in rs] for rs in resolved], dict(s.refs), counter)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [3, 12, 100, 400])
def test_first_pass_is_the_oracles(lane, n):
    """The same resolved parts (msg_ids and bases once the rows are made), rows, view items, sums,
    staged refs and instance counts, from the start and from after a system run."""
    L = LANES[lane]
    for raw in bodies(lane, n):
        for cut in (0, 1, 2):
            assert first_of(raw, L, False, cut) == first_of(raw, L, True, cut)


def test_first_flat_is_taken_only_for_its_own_items():
    """The lists of the last first pass are given for its items (or its last ones), once; for
    any other items (equal ones included), none."""
    L = LANES["anthropic"]
    raw = bodies("anthropic", 12)[0]
    from bili_addon.wire.base import Body

    b = Body(raw, "messages")
    c = ItemCache()
    infos = c.get_many(L, b.items, [], b.top["messages"], [])
    twins = c.get_many(L, b.items, [], b.top["messages"], [])  # (equal items, other objects)
    assert twins == infos and c.first_flat(infos) is None and c.first_flat(twins) is None
    for cut in (0, 1, 5, len(infos)):
        c = ItemCache()
        got = c.get_many(L, b.items, [], b.top["messages"], [])
        flat = c.first_flat(got[cut:])
        parts = [p for info in got[cut:] for p in info.parts]
        assert flat is not None and flat[0] == parts and all(map(lambda a, b: a is b, flat[0], parts))
        assert flat[1] == [p.core for p in parts] and flat[2] == [p.dirty for p in parts]
        assert flat[3] == list(accumulate(len(info.parts) for info in got[cut:]))
        assert c.first_flat(got[cut:]) is None  # (taken)
    c = ItemCache()
    got = c.get_many(L, b.items, [], b.top["messages"], [])
    assert c.first_flat(got[:3]) is None and c.first_flat(got) is None  # (not its last items: none, and gone)
    c = ItemCache()
    got = c.get_many(L, b.items, [], b.top["messages"], [])
    assert c.first_flat(got + got[:1]) is None


def test_a_pass_of_items_without_parts():
    """(Items that read to no cores: the lists are empty, every item counted as one without parts.)"""
    L = LANES["anthropic"]
    raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": []},
                                                          {"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": []}]})
    assert first_of(raw, L, False) == first_of(raw, L, True)
    raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": []}] * 3})
    assert first_of(raw, L, False) == first_of(raw, L, True)


# -- (2) whole Engine runs: as they are, and with the oracles patched in -------------------------------

def both(tmp_path: Path, scenario) -> None:
    same_runs(tmp_path, scenario, patch_oracles, Trace)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 25_000, 6_000])
@pytest.mark.parametrize("big", [False, True])
def test_the_benchs_first_turns_forks_and_follow_ups_are_the_oracles(tmp_path, lane, n, window, big):
    """New conversations' first turns (one while another waits for its answer), a fork of one (its
    history under a new id: adopted), follow-ups, the same body again under a new id; windows that
    make the reminder urgent and cut tool outputs."""
    both(tmp_path, benchs_turns(lane, n, window, big, again=True))


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("window", [0, 30_000, 12_000])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, "now"))


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old


def test_the_captures_first_turns_are_the_oracles(tmp_path):
    """Every captured request as a new conversation's first turn (its own session), on the engine."""
    from tests.oracle_runs import capture_turns

    turns = capture_turns()

    def scenario(make):
        t = make()
        for i, (lane, _headers, raw) in enumerate(turns):
            t.send(raw, f"cap{i}", LANES[lane])
        return [t.turns, t.stored()]

    both(tmp_path, scenario)


def test_a_first_turn_takes_the_lists_get_many_made(tmp_path, monkeypatch):
    """(The runs above go the new way: a first turn's first_pass takes get_many's lists.)"""
    from bili_addon.kernel.turn import Engine
    from bili_addon.store import Store

    seen = []
    real = ItemCache.first_flat
    monkeypatch.setattr(ItemCache, "first_flat", lambda self, infos: seen.append(real(self, infos)) or seen[-1])
    for lane in ("anthropic", "chat", "responses"):
        case = bench_overhead.Case(lane, 100)
        e = Engine(Store(tmp_path / f"{lane}.db"))
        e.process(case.body(conversation(case, 0)), LANES[lane], {"x-acp-session": lane}, render=True)
        e.store.close()
    assert len(seen) == 3 and all(got is not None for got in seen)
