"""#11: a conversation's first pass takes shortcuts (kernel/fresh.py, ItemCache.get_many,
wire.base.patch_decoded); each gives exactly what the general path gives: the same bytes upstream,
the same refs, the same ledger."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import fresh, render
from bili_addon.kernel.state import ItemCache
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from bili_addon.wire.base import DELETE, patch_decoded, patch_many

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


def run(tmp_path, name: str, lane: str, bodies: list[bytes]) -> tuple[list, list]:
    e = Engine(Store(tmp_path / name))
    outs = []
    for raw in bodies:
        r = e.process(raw, LANES[lane], {"x-acp-session": "fp"}, render=True)
        outs.append((r.body, r.refs_new, r.refs_known, r.tagged))
    ledger = e.store.ledger("fp")
    e.store.close()
    return outs, ledger


def conversation(lane: str, n: int, ascii_json: bool) -> list[bytes]:
    case = bench_overhead.Case(lane, n, seed=3)
    msgs = list(case.msgs)
    msgs[1 if lane == "chat" else 0] = {"role": "user", "content": "Grüße, «naïve» café: ünïcödé text. " * 3}
    enc = (lambda m: json.dumps({**case.top, "messages": m}).encode()) if ascii_json else case.body
    return [enc(msgs), enc(msgs + [case.new(0)])]


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("ascii_json", [False, True], ids=["compact", "python-json"])
def test_the_first_pass_gives_what_the_general_path_gives(tmp_path, monkeypatch, lane, ascii_json):
    bodies = conversation(lane, 120, ascii_json)
    fast = run(tmp_path, "fast", lane, bodies)
    monkeypatch.setattr(fresh, "applies", lambda *a: False)  # the general path: _resolve, _view_items
    monkeypatch.setattr(render, "patch_decoded", lambda *a: None)  # ... and patching per path
    general = run(tmp_path, "general", lane, bodies)
    assert fast == general
    assert fast[0][0][0] is not None and fast[0][0][3] > 0  # tagged, changed


def test_get_many_parses_as_get_does():
    lane = LANES["anthropic"]
    case = bench_overhead.Case("anthropic", 60, seed=5)
    raws = [msgspec.json.encode(m) for m in case.msgs] + [b'{"role":"assistant","content":"[bili] folded\\nhi"}']
    objs: list = []
    many = ItemCache().get_many(lane, raws + raws[:3], objs)
    one = ItemCache()
    assert many == [one.get(lane, r) for r in raws + raws[:3]]
    assert objs[:len(raws)] == [msgspec.json.decode(r) for r in raws] and objs[len(raws):] == [None] * 3


def test_patch_decoded_is_patch_many_or_nothing():
    rnd = random.Random(11)
    text = {"type": "text", "text": "hello"}
    items = [
        {"role": "user", "content": "plain"},
        {"role": "assistant", "content": [text, {"type": "tool_use", "id": "t1", "name": "Read", "input": {"a": 1.5}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}, dict(text)]},
    ]
    tag = '<acp tokens="1" type="text">m00001</acp>\n'
    for item in items:
        paths = [("content",)] if isinstance(item["content"], str) else [
            ("content", j, "text") for j, b in enumerate(item["content"]) if "text" in b]
        edits = [(p, tag + str(rnd.random())) for p in paths]
        canonical = msgspec.json.encode(item)
        assert patch_decoded(canonical, msgspec.json.decode(canonical), edits) == patch_many(canonical, edits)
        for other in (json.dumps(item).encode(), json.dumps(item, indent=1).encode()):  # not msgspec's bytes
            assert patch_decoded(other, msgspec.json.decode(other), edits) is None
    canonical = msgspec.json.encode(items[1])
    for edits in ([(("content", 0, "cache_control"), DELETE)], [(("content", 5, "text"), "x")],
                  [(("content", 0, "missing"), "x")], [(("role", 0), "x")]):
        assert patch_decoded(canonical, msgspec.json.decode(canonical), edits) is None  # patch_many's own cases


def test_get_many_decodes_the_whole_array_as_each_item():
    """A pass whose first item is new decodes the conversation's array in one call: the same
    values, item for item; an array that is not the items' (or items found in the cache) changes
    nothing of what is returned."""
    lane = LANES["anthropic"]
    case = bench_overhead.Case("anthropic", 40, seed=9)
    raws = [msgspec.json.encode(m) for m in case.msgs]
    whole = b"[" + b",".join(raws) + b"]"
    want_objs: list = []
    want = ItemCache().get_many(lane, raws, want_objs)
    objs: list = []
    assert ItemCache().get_many(lane, raws, objs, whole) == want and objs == want_objs
    objs = []
    assert ItemCache().get_many(lane, raws, objs, b"[1,2]") == want and objs == want_objs  # not these items
    cache = ItemCache()
    cache.get_many(lane, raws[:1])
    objs = []
    assert cache.get_many(lane, raws, objs, whole) == want and objs == [None] + want_objs[1:]


@pytest.mark.parametrize("answered", [True, False], ids=["answered", "unanswered"])
def test_a_first_record_kept_back_is_the_record_made_at_once(tmp_path, answered):
    """A session's first lineage record, every part new, is listed only after the answer
    (Lineage.defer): what the store holds then is what an immediate record stores, and a next
    turn that comes before the answer finds it complete."""
    bodies = conversation("anthropic", 60, False)
    bodies.append(conversation("anthropic", 60, False)[1][:-2] + b',{"role":"user","content":"more"}]}')

    def lineage(name: str, defer: bool):
        e = Engine(Store(tmp_path / name))
        e.lineage.defer = defer
        outs = []
        for i, raw in enumerate(bodies):
            r = e.process(raw, LANES["anthropic"], {"x-acp-session": "fp"}, render=True)
            outs.append((r.body, r.refs_new, r.refs_known))
            if i == 0 and defer:
                assert "fp" in e.lineage.pending and e.store.lineage_parts("fp") == []
            if answered or i == len(bodies) - 1:
                e.lineage.flush()
        parts, record = e.store.lineage_parts("fp"), list(e.lineage.records["fp"])
        e.store.close()
        return outs, parts, record

    now, later = lineage("now", False), lineage("later", True)
    assert later == now
    assert len(now[1]) > 60 and all(fp for _ref, _chash, fp in now[1])


def test_ref_names_are_ref_of_at_every_number_whatever_the_threads():
    """The refs a first pass gives and the store checks come from one list formatted once per
    process: the name at each number is tags.ref_of's, even when threads grow the list at once."""
    import threading

    from bili_addon import store as store_mod
    from bili_addon.kernel import tags

    store_mod._REF_NAMES.clear()
    got: dict[int, list[str]] = {}

    def worker(i: int) -> None:
        got[i] = store_mod.ref_names(1 + 37 * i, 3000 + 101 * i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, names in got.items():
        assert names == [tags.ref_of(n) for n in range(1 + 37 * i, 1 + 37 * i + 3000 + 101 * i)]
    assert store_mod._REF_NAMES == [f"m{n:05d}" for n in range(len(store_mod._REF_NAMES))]
    assert store_mod.ref_names(99998, 2) == ["m99998", "m99999"]
    assert store_mod.ref_names(99999, 2) == ["m99999", "m100000"]  # past the last: formatted, not kept
    assert len(store_mod._REF_NAMES) <= 100000


def test_a_new_session_reads_no_family_and_no_record_and_a_known_one_does(tmp_path):
    """A session the store had no row of has no family and no lineage record (both are written
    after its first commit): its first turn does not read them; the next turn does again."""
    e = Engine(Store(tmp_path / "s"))
    reads: list[str] = []
    for name in ("family", "lineage_parts"):
        orig = getattr(e.store, name)
        setattr(e.store, name, lambda sid, _o=orig, _n=name: reads.append(_n) or _o(sid))
    bodies = conversation("anthropic", 30, False)
    e.process(bodies[0], LANES["anthropic"], {"x-acp-session": "new"}, render=True)
    assert reads == []
    e.sessions.forget("new")  # loaded again from the store: a row now
    e.process(bodies[1], LANES["anthropic"], {"x-acp-session": "new"}, render=True)
    assert "family" in reads
    e.store.close()
