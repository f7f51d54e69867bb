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

from bili_addon.kernel import fresh, nudge, render
from bili_addon.kernel.fold import FoldConfig, PartView, View, ViewItem
from bili_addon.kernel.state import ItemCache, hash_parts
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES, base
from bili_addon.wire.anthropic import AnthropicLane
from bili_addon.wire.chat import ChatLane
from bili_addon.wire.base import DELETE, Body, patch_decoded, patch_many

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


def conversation(lane: str, n: int, ascii_json: bool, agent_order: bool = False) -> list[bytes]:
    case = bench_overhead.Case(lane, n, seed=3)
    msgs = list(case.msgs)
    msgs[1 if lane == "chat" else 0] = {"role": "user", "content": "Grüße, «naïve» café: ünïcödé text. " * 3}
    if lane == "chat" and agent_order:  # user prose as text parts (pi, omp), results with their tool's name (hermes)
        msgs = [{"role": "user", "content": [{"type": "text", "text": m["content"]}]} if m["role"] == "user" else
                {"role": "tool", "name": "Bash", **{k: v for k, v in m.items() if k != "role"}} if m["role"] == "tool"
                else m for m in msgs]
    rest = {k: v for k, v in case.top.items() if k not in ("model", "messages")}
    if agent_order:  # the conversation right after the model, the other members after it (as Claude Code writes them)
        def top(m):
            return {"model": case.top["model"], "messages": m, **rest, "metadata": {"user_id": "u"}, "stream": True}
    else:
        def top(m):
            return {"model": case.top["model"], **rest, "messages": m}
    enc = (lambda m: json.dumps(top(m)).encode()) if ascii_json else (lambda m: msgspec.json.encode(top(m)))
    return [enc(msgs), enc(msgs + [case.new(0)])]


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("ascii_json", [False, True], ids=["compact", "python-json"])
@pytest.mark.parametrize("agent_order", [False, True], ids=["messages-last", "messages-second"])
def test_the_first_pass_gives_what_the_general_path_gives(tmp_path, monkeypatch, lane, ascii_json, agent_order):
    bodies = conversation(lane, 120, ascii_json, agent_order)
    if not ascii_json:
        b = Body(bodies[0], "messages")
        assert base._split_compact(bodies[0]) is not None  # (the one-scan split reads it)
        assert LANES[lane].array_cores(b.top["messages"]) is not None  # (and the typed structs its items)
    fast = run(tmp_path, "fast", lane, bodies)
    _general_path(monkeypatch)
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


def hashed(infos: list) -> list:
    """``infos`` with every part's digest computed (a first pass's are computed when first read)."""
    hash_parts([p for info in infos for p in info.parts])
    return infos


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
    # (Anthropic's items read into typed structs: the same values; their parts hashed when first read)
    assert hashed(ItemCache().get_many(lane, raws, objs, whole)) == want and list(map(msgspec.to_builtins, objs)) == want_objs
    objs = []
    assert ItemCache().get_many(lane, raws, objs, b"[1,2]") == want and objs == want_objs  # not these items
    for cached in (1, 30):  # items the cache holds are read again with the others: the same values
        cache = ItemCache()
        cache.get_many(lane, raws[:cached])
        objs = []
        assert hashed(cache.get_many(lane, raws, objs, whole)) == want
        assert list(map(msgspec.to_builtins, objs)) == want_objs and type(objs[0]) is not dict
        assert [k[1] for k in cache.items] == raws and all(k[1] is v.raw for k, v in cache.items.items())
        assert cache.size == sum(map(len, raws))
    chat = LANES["chat"]  # Chat's items read into its typed structs too (a system item among them)
    msgs = bench_overhead.Case("chat", 40, seed=9).msgs
    raws = [msgspec.json.encode(m) for m in msgs]
    want_objs = []
    want = ItemCache().get_many(chat, raws, want_objs)
    assert want[0].is_system and not any(info.is_system for info in want[1:])
    objs = []
    assert hashed(ItemCache().get_many(chat, raws, objs, b"[" + b",".join(raws) + b"]")) == want
    assert list(map(msgspec.to_builtins, objs)) == want_objs
    raws[3] = msgspec.json.encode(dict(msgs[3], key="a key the structs do not hold"))  # the whole array as dicts
    want_objs = []
    want = ItemCache().get_many(chat, raws, want_objs)
    objs = []
    assert ItemCache().get_many(chat, raws, objs, b"[" + b",".join(raws) + b"]") == want and objs == want_objs


def _general_path(monkeypatch) -> None:
    """Every shortcut of a first pass off (the general path the tests compare it with)."""
    monkeypatch.setattr(fresh, "applies", lambda *a: False)  # the general path: _resolve, _view_items
    monkeypatch.setattr(render, "patch_decoded", lambda *a: None)  # ... and patching per path
    monkeypatch.setattr(AnthropicLane, "array_cores", None)  # ... items read one by one, as dicts
    monkeypatch.setattr(ChatLane, "array_cores", None)
    monkeypatch.setattr(LANES["chat"], "tag_typed", staticmethod(lambda *a: None))  # ... tags patched, not put in bytes
    monkeypatch.setattr(base, "_split_compact", lambda raw, key="messages": None)  # ... the body split in two scans
    monkeypatch.setattr(base.Split, "derive", lambda self, raw: None)  # ... every body split whole
    monkeypatch.setattr(nudge, "_runs_unfolded", _runs_reference)  # ... the reminder's runs part by part


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_a_new_conversation_sharing_first_items_gives_what_the_general_path_gives(tmp_path, monkeypatch, lane):
    """A new conversation whose first item another conversation served before (Chat's system
    prompt, the same first prompt): its pass finds that item in the cache and reads the array
    typed at its first new item; the same bytes upstream, refs and ledgers as the general path."""
    case = bench_overhead.Case(lane, 80, seed=4)
    def changed(v):  # every text of an item changed
        if isinstance(v, dict):
            return {k: "B " + x if k in ("content", "text") and isinstance(x, str) else changed(x) for k, x in v.items()}
        return [changed(x) for x in v] if isinstance(v, list) else v

    first = case.body(case.msgs)
    other = case.body(case.msgs[:1] + [changed(m) for m in case.msgs[1:]])

    def go(name):
        e = Engine(Store(tmp_path / name))
        outs = []
        for i, raw in enumerate((first, other)):
            r = e.process(raw, LANES[lane], {"x-acp-session": f"c{i}"}, render=True)
            outs.append((r.body, r.refs_new, r.refs_known, r.tagged))
        ledgers = [e.store.ledger("c0"), e.store.ledger("c1")]
        e.store.close()
        return outs, ledgers

    cls, reads = type(LANES[lane]), []
    read = cls.array_cores
    monkeypatch.setattr(cls, "array_cores", staticmethod(lambda array, flat=False: reads.append(flat) or read(array, flat)))
    fast = go("fast")
    assert reads == [True, True]  # (the second pass read the array typed too, the item it found cached with it)
    _general_path(monkeypatch)
    assert fast == go("general")
    assert fast[0][1][0] is not None and fast[0][1][3] > 0


# Anthropic items of every shape the typed structs hold, and of shapes they do not (read one by one)
_TEXT = {"type": "text", "text": "hi there"}
_SHAPES = [
    {"role": "user", "content": "plain"},
    {"role": 7, "content": "a role that is not a string"},
    {"role": "user"},
    {"role": "user", "content": None},
    {"role": "assistant", "content": [_TEXT, {"type": "tool_use", "id": "t1", "name": "Read", "input": {"a": 1.5}}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": 5, "name": None, "input": None}]},
    {"role": "assistant", "content": [{"type": "tool_use"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out", "is_error": True,
                                  "cache_control": {"type": "ephemeral"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "text", "text": "a"}, {"type": "image", "source": {"type": "base64", "data": "AAAA"}}, 3]}]},
    {"role": "user", "content": [{"tool_use_id": "t2", "type": "tool_result"}, dict(_TEXT, cache_control={"type": "x"})]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                      {"type": "redacted_thinking", "data": "zzz"}, {"type": "thinking"}]},
    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]},
    {"role": "assistant", "content": "[bili] folded\n<acp tokens=\"3\" type=\"text\">m00001</acp>hi"},
    {"role": "user", "content": [_TEXT, {"type": "text", "text": "x", "citations": []}]},  # a key not held
]
_OTHER_SHAPES = [  # shapes the structs do not hold: the array is read item by item
    {"role": "user", "content": [{"type": "document", "source": {}}]},
    {"role": "user", "content": [{"type": "text", "text": 5}]},
    {"role": "user", "content": ["a string block"]},
    {"role": "user", "content": {"type": "text", "text": "an object"}},
    {"role": "user", "content": [{"type": "web_search_tool_result", "content": []}]},
    "not an object",
]


def test_typed_anthropic_items_give_the_cores_item_cores_gives():
    lane = LANES["anthropic"]
    raws = [msgspec.json.encode(m) for m in _SHAPES]
    got = lane.array_cores(b"[" + b",".join(raws) + b"]")
    assert got is not None
    cores, structs = got
    assert cores == [lane.item_cores(msgspec.json.decode(r)) for r in raws]
    for other in _OTHER_SHAPES:
        assert lane.array_cores(msgspec.json.encode(_SHAPES[:3] + [other])) is None
    for shapes in (_SHAPES, _SHAPES + _OTHER_SHAPES):  # and get_many gives what one-by-one parsing gives
        raws = [msgspec.json.encode(m) for m in shapes]
        one = ItemCache()
        assert ItemCache().get_many(lane, raws, [], b"[" + b",".join(raws) + b"]") == [one.get(lane, r) for r in raws]


def test_get_many_all_new_is_the_item_loop():
    """A first pass's items, all new and none twice, are read in C-level steps (get_many's fast
    path): the same infos, objs, cache keys and order and size as item by item; an item cached
    already or repeated takes the item loop, the array decoded once all the same."""
    lane = LANES["anthropic"]
    raws = [msgspec.json.encode(m) for m in _SHAPES]
    whole = b"[" + b",".join(raws) + b"]"
    fast, objs = ItemCache(), []
    infos = fast.get_many(lane, [msgspec.Raw(r) for r in raws], objs, whole)
    slow = ItemCache()
    assert infos == [slow.get(lane, r) for r in raws]
    assert list(fast.items) == list(slow.items) and fast.size == slow.size
    assert objs == lane.array_cores(whole)[1]
    assert all(type(info.raw) is bytes for info in infos)
    for shape in (raws[:2] + raws[:1], raws):  # repeated; and all cached after the first item
        cache = ItemCache()
        cache.get(lane, shape[-1])
        seen = cache.get_many(lane, shape, objs := [], b"[" + b",".join(shape) + b"]")
        assert seen == [ItemCache().get(lane, r) for r in shape]
        assert len(objs) == len(shape) and list(cache.items) == sorted(set(cache.items), key=list(cache.items).index)
    assert ItemCache(max_bytes=len(raws[-1])).get_many(lane, raws, [], whole) == infos


def test_patch_typed_is_patch_many_or_nothing():
    """A tag patched from an item's typed struct is what patch_many makes of its bytes, whenever
    the struct proves them msgspec's own (every key held, in order); else nothing."""
    lane = LANES["anthropic"]
    tag = '<acp tokens="1" type="text">m00001</acp>\n'
    made = 0
    for item in _SHAPES:
        content = item.get("content")
        paths = [("content",)] if isinstance(content, str) else [
            ("content", j, "text") for j, b in enumerate(content or []) if b.get("type") == "text"]
        if not paths:
            continue
        edits = [(p, tag + str(k)) for k, p in enumerate(paths)]
        for raw in (msgspec.json.encode(item), json.dumps(item).encode()):
            structs = lane.array_cores(b"[" + raw + b"]")[1]
            out = lane.patch_typed(raw, structs[0], edits)
            if out is not None:
                made += 1
                assert out == patch_many(raw, edits)
            elif raw == msgspec.json.encode(item) and "citations" not in raw.decode() and item["role"] != 7:
                assert b'"type"' in raw and raw.index(b'"type"') > raw.index(b'"tool_use_id"')  # a key out of order
    assert made >= 4
    raw = msgspec.json.encode(_SHAPES[4])
    for edits in ([(("content", 1, "text"), "x")], [(("content", 0, "cache_control"), DELETE)],
                  [(("content", 0, "text"), 5)], [(("role",), "x")], [(("content", 9, "text"), "x")]):
        assert lane.patch_typed(raw, lane.array_cores(b"[" + raw + b"]")[1][0], edits) is None


_CHAT_SHAPES = [
    {"role": "system", "content": "sys"},
    {"role": "developer", "content": "dev"},
    {"role": "user", "content": "hi \" there"},
    {"role": "user", "content": None},
    {"role": "user"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": "{\"a\":1}"}}]},
    {"role": "assistant", "content": "", "tool_calls": []},
    {"role": "assistant", "content": "", "tool_calls": None},
    {"role": "assistant", "content": None, "tool_calls": [{"id": 5, "function": {"name": None, "arguments": {"b": [1, 2.5]}}},
                                                          {"function": {}}]},
    {"role": "assistant", "content": "text and a call", "tool_calls": [{"id": "c2", "function": {"arguments": None}}]},
    {"role": "assistant", "content": "prose"},
    {"role": "tool", "tool_call_id": "c1", "content": "out"},
    {"role": "tool", "content": None},
    {"role": "tool", "tool_call_id": 3},
    {"content": "late role", "role": "user"},
    {"role": "user", "content": [{"type": "text", "text": "a part"}]},  # parts (pi, omp)
    {"role": "user", "content": [{"type": "text", "text": "[bili] x\n<acp>m00001</acp>", "cache_control": {"type": "ephemeral"}},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                                 {"type": "image_url", "image_url": "http://x/y.png"}, {"type": "image_url"},
                                 {"image_url": {"url": 5}, "type": "image_url"}, {"type": "text", "text": ""}]},
    {"role": "user", "content": []},
    {"role": "system", "content": [{"type": "text", "text": "sys part"}]},
    {"role": "developer", "content": [{"type": "text", "text": "dev part"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "prose part"}], "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]},
    {"role": "assistant", "content": [], "tool_calls": None},
    {"role": "tool", "name": "terminal", "content": "out", "tool_call_id": "c1"},  # a result's name (hermes)
    {"role": "tool", "tool_call_id": "c1", "name": None},
]
_CHAT_OTHER = [  # shapes Chat's structs do not hold: the array is read item by item
    {"role": "user", "content": [{"type": "text", "text": 5}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": [{"type": "text", "text": "x", "other": 1}]},
    {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
    {"role": "user", "content": ["a string part"]},
    {"role": "user", "content": [{"text": "no type"}]},
    {"role": "user", "content": {"type": "text", "text": "an object"}},
    {"role": "user", "content": "x", "name": "bob"},
    {"role": "assistant", "content": "x", "reasoning_content": "r"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "custom": {"name": "n", "input": "i"}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": None}]},
    {"role": "assistant", "content": None, "tool_calls": "calls"},
    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
    {"role": "assistant", "content": "x", "refusal": "no"},
    {"role": "function", "name": "f", "content": "r"},
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "t"}]},
    {"role": 7, "content": "x"},
    {"content": "no role"},
    "not an object",
]


def test_typed_chat_items_give_the_cores_item_cores_gives():
    lane = LANES["chat"]
    got = lane.array_cores(msgspec.json.encode(_CHAT_SHAPES))
    assert got is not None
    assert got[0] == [lane.item_cores(m) for m in _CHAT_SHAPES]
    assert got[2] == [lane.is_system_item(m) for m in _CHAT_SHAPES] and got[2][:3] == [True, True, False]
    for other in _CHAT_OTHER:
        assert lane.array_cores(msgspec.json.encode(_CHAT_SHAPES[:3] + [other])) is None
    for shapes in (_CHAT_SHAPES, _CHAT_SHAPES + _CHAT_OTHER):  # and get_many gives what one-by-one parsing gives
        raws = [msgspec.json.encode(m) for m in shapes]
        one = ItemCache()
        assert ItemCache().get_many(lane, raws, [], b"[" + b",".join(raws) + b"]") == [one.get(lane, r) for r in raws]


def test_chat_patch_typed_is_patch_many_or_nothing():
    """A tag patched from a Chat item's typed struct is what patch_many makes of its bytes,
    whenever the struct proves them msgspec's own; else nothing."""
    lane = LANES["chat"]
    tag = '<acp tokens="1" type="text">m00001</acp>\n'
    made = 0
    for item in _CHAT_SHAPES:
        if not isinstance(item.get("content"), str):
            continue
        edits = [(("content",), tag + item["content"])]
        for raw in (msgspec.json.encode(item), json.dumps(item).encode()):
            struct = lane.array_cores(b"[" + raw + b"]")[1][0]
            out = lane.patch_typed(raw, struct, edits)
            if out is not None:
                made += 1
                assert out == patch_many(raw, edits)
            else:
                fields = ["role", *(f for f in type(struct).__struct_fields__ if f in item)]
                assert raw != msgspec.json.encode(item) or list(item) != fields  # (keys in another order)
    assert made >= 6
    raw = msgspec.json.encode(_CHAT_SHAPES[2])
    for edits in ([(("content",), 5)], [(("role",), "x")], [(("content", 0, "text"), "x")]):
        assert lane.patch_typed(raw, lane.array_cores(b"[" + raw + b"]")[1][0], edits) is None


@pytest.mark.parametrize("body", [
    b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}],"stream":true}',
    b'{"messages":[],"model":"m"}',
    b'{"messages":[]}',
    b'{"model":"m","max_tokens":5,"tools":[{"name":"x"}],"system":"s","messages":[1,{"a":[2]}]}',
    b'{"model":"m","messages":[1, 2]}',  # a space in the array
    b'{"model":"m", "messages":[1]}',  # ... between members
    b'{"model":"m","messages":[1]} ',  # ... after the object
    b'{"model":"m","model":"n","messages":[1]}',  # a repeated key
    b'{"mod\\u0065l":"m","messages":[1]}',  # a key written with an escape
    b'{"model":"m","messages":[1],"other":{"model":1}}',  # a key it does not hold
    b'{"metadata":{"model":"x"},"model":"m","messages":[1]}',  # a key found first where it does not stand
    b'{"model":"m","messages":"not an array"}',
    b'{"model":"m"}',
])
def test_the_one_scan_split_is_the_general_split_or_nothing(body):
    general = Body.__new__(Body)
    general.top = base._dec_raw_obj.decode(body)
    conv = general.top.get("messages")
    items = base._dec_raw_list.decode(conv) if conv is not None and bytes(conv)[:1] == b"[" else None
    got = base._split_compact(body)
    if got is not None:
        top, its, span = got
        assert bytes(body[span[0]:span[1]]) == bytes(general.top["messages"])  # (where the array lies)
        assert list(top) == list(general.top) and all(bytes(top[k]) == bytes(general.top[k]) for k in top)
        assert [bytes(x) for x in its] == [bytes(x) for x in items]
    else:
        assert body != msgspec.json.encode(msgspec.json.decode(body)) or items is None or b"other" in body or (
            b"metadata" in body)
    b = Body(body, "messages")  # and Body says the same either way, and writes the body back
    assert list(b.top) == list(general.top)
    if b.array:
        assert b.encode(list(map(bytes, b.items))) == msgspec.json.encode(
            {**general.top, "messages": msgspec.Raw(b"[" + b",".join(map(bytes, items)) + b"]")})
    else:
        assert b.encode(None) == msgspec.json.encode(general.top)


def test_body_encode_is_the_top_object_with_the_new_array():
    raw = b'{"model":"m","messages":[{"a":1},{"b":2}],"stream":true}'
    for split in (True, False):
        b = Body(raw, "messages") if split else Body(json.dumps(json.loads(raw)).encode(), "messages")
        items = [b'{"x":1}', b"[]", b'"s"']
        want = msgspec.json.encode({**b.top, "messages": msgspec.Raw(b"[" + b",".join(items) + b"]")})
        assert b.encode(items) == want and bytes(b.top["messages"]) == b'[{"x":1},[],"s"]'
        assert b.encode([]) == msgspec.json.encode({**b.top, "messages": msgspec.Raw(b"[]")})
        assert bytes(b.top["messages"]) == b"[]"
        assert b.encode([b'{"y":2}']) == msgspec.json.encode({**b.top, "messages": msgspec.Raw(b'[{"y":2}]')})
        assert bytes(b.top["messages"]) == b'[{"y":2}]'


def _runs_reference(view: View, protected: set[int]) -> list[tuple[str, str, int, int]]:
    """nudge.compressible's loop where nothing is folded, part by part (as it was)."""
    runs: list[list[int]] = [[]]
    for k, it in enumerate(view.items):
        if k in protected:
            if runs[-1]:
                runs.append([])
        elif it.parts:
            runs[-1].append(k)
    out = []
    for run in runs:
        refs, tokens = [], 0
        for k in run:
            for p in view.items[k].parts:
                refs.append(p.ref)
                tokens += p.tokens
        if refs:
            out.append((refs[0], refs[-1], len(run), tokens))
    return out


def test_the_reminders_runs_where_nothing_is_folded():
    rnd = random.Random(5)
    n = 0
    for _ in range(200):
        items = []
        for k in range(rnd.randint(0, 30)):
            parts = [PartView(f"m{n + j:05d}", rnd.choice(["user", "assistant", "tool"]), rnd.choice(["text", "tool-result"]),
                              "", "", "x", rnd.randint(0, 900)) for j in range(rnd.choice([0, 1, 1, 2, 3]))]
            n += len(parts)
            items.append(ViewItem(k, parts))
        view = View(items)
        protected = view.protected(FoldConfig())
        assert nudge.compressible(view, [], FoldConfig()) == _runs_reference(view, protected)


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


def test_typed_anthropic_items_on_random_shapes():
    """Blocks of random kinds with fields of random types, present or not: where the typed
    structs read the array, their cores are item_cores' cores."""
    rnd = random.Random(17)
    values = [None, 0, 3, 1.5, True, "", "s", "[bili] note\nx", [], [1], {}, {"a": [None]}, [{"type": "text", "text": "t"}]]
    kinds = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"]
    fields = ["text", "id", "name", "input", "tool_use_id", "content", "is_error", "cache_control", "thinking",
              "signature", "data", "source"]
    lane = LANES["anthropic"]
    read = 0
    for _ in range(400):
        items = []
        for _i in range(rnd.randint(1, 4)):
            item: dict = {}
            if rnd.random() < 0.9:
                item["role"] = rnd.choice(["user", "assistant", "system", 5, None])
            c = rnd.random()
            if c < 0.2:
                item["content"] = rnd.choice(values)
            elif c < 0.95:
                blocks = []
                for _b in range(rnd.randint(0, 3)):
                    block = {"type": rnd.choice(kinds)} if rnd.random() < 0.95 else {}
                    for f in rnd.sample(fields, rnd.randint(0, 4)):
                        block[f] = rnd.choice(values)
                    if block.get("type") == "text" and rnd.random() < 0.7:
                        block["text"] = rnd.choice(["hi", "<acp tokens=\"1\">m00001</acp> x", ""])
                    blocks.append(block)
                item["content"] = blocks
            items.append(item)
        raws = [msgspec.json.encode(m) for m in items]
        got = lane.array_cores(b"[" + b",".join(raws) + b"]")
        if got is not None:
            read += 1
            assert got[0] == [lane.item_cores(msgspec.json.decode(r)) for r in raws]
    assert read > 50


def _general_split(body: bytes):
    top = base._dec_raw_obj.decode(body)
    conv = top.get("messages")
    items = base._dec_raw_list.decode(conv) if conv is not None and bytes(conv)[:1] == b"[" else None
    return [(k, bytes(v)) for k, v in top.items()], None if items is None else [bytes(x) for x in items]


def test_the_one_scan_split_on_members_in_any_order():
    """The one-scan split reads the members in the order they stand (the conversation first, in
    the middle or last, as agents write it): a compact body of known keys is split, and split as
    the general way splits it; a body with a space, an unknown, repeated or escaped key is not."""
    rnd = random.Random(23)
    values = [1, 2.5, "s", 'q"uote', "\\", "k\":", {"model": "x", "messages": [1]}, [{"a": []}], None, True, [], {}]
    split = 0
    for _ in range(400):
        keys = rnd.sample(base._TOP_KEYS, rnd.randint(0, 6))
        members = [(k, rnd.choice(values)) for k in keys]
        msgs = [rnd.choice([{"role": "user", "content": "a,b"}, {"role": "assistant", "content": [{"type": "text", "text": "]}"}]},
                            "s", 3, [], {"messages": []}]) for _i in range(rnd.randint(0, 4))]
        members.insert(rnd.randint(0, len(members)), ("messages", msgs))
        keys = [msgspec.json.encode(k) for k, _v in members]
        vals = [msgspec.json.encode(v) for _k, v in members]
        sep, colon = [b","] * len(members), [b":"] * len(members)
        mutation = rnd.choice(["none", "none", "space", "unknown", "repeat", "escape"])
        i = rnd.randrange(len(members))
        if mutation == "space":  # beside a member, or between two items
            where = rnd.choice(["sep", "colon", "item"])
            if where == "item" and len(msgs) > 1:
                vals[keys.index(b'"messages"')] = b"[" + b", ".join(map(msgspec.json.encode, msgs)) + b"]"
            elif where == "colon":
                colon[i] = b": "
            else:
                sep[i] = b", "
                if i == len(members) - 1:
                    mutation = "none"  # (no comma after the last member)
        elif mutation == "unknown":
            keys.insert(i, b'"unknown"'), vals.insert(i, b"1"), sep.append(b","), colon.append(b":")
        elif mutation == "repeat":
            keys.append(keys[i]), vals.append(vals[i]), sep.append(b","), colon.append(b":")
        elif mutation == "escape":
            k = members[i][0]
            keys[i] = b'"' + k[:1].encode() + b"\\u00" + k[1:2].encode().hex().encode() + k[2:].encode() + b'"'
        last = len(keys) - 1
        body = b"{" + b"".join(k + c + v + (s if j < last else b"")
                               for j, (k, c, v, s) in enumerate(zip(keys, colon, vals, sep))) + b"}"
        got = base._split_compact(body)
        want = _general_split(body)
        if mutation == "none":
            assert got is not None
        elif mutation != "space" or where != "item" or len(msgs) > 1:
            assert got is None
        if got is not None:
            split += 1
            top, items, _span = got
            assert ([(k, bytes(v)) for k, v in top.items()], [bytes(x) for x in items]) == want
        b = Body(body, "messages")  # and Body reads what the general split reads, either way
        assert [(k, bytes(v)) for k, v in b.top.items()] == want[0]
        assert b.array and [bytes(x) for x in b.items] == want[1]
    assert split > 150


def _first_pass_bodies() -> list[tuple[str, bytes]]:
    """Bodies a first pass meets: the bench's conversations (prose with non-ASCII text, items as
    msgspec or Python's json writes them, the members in either order, Chat with text parts and
    named results) and the agents' captured Anthropic and Chat requests."""
    out = [(lane, raw) for lane in ("anthropic", "chat") for ascii_json in (False, True)
           for agent_order in (False, True) for raw in conversation(lane, 90, ascii_json, agent_order)]
    from wirecases import capture_files, captured_bodies  # (the captures, when there are any)

    for path in capture_files():
        out += [(c.lane.name, c.raw) for c in captured_bodies(path) if c.lane.name in ("anthropic", "chat")]
    return out


def _first_pass_is_item_by_item(lane, raw: bytes) -> bool | None:
    """Checks that a first pass's items read in one decode (the lane's flat array_cores, then the
    parts made and hashed in one go) are the items ``get`` reads one by one: the same cores (every
    field, path included), base ids, content hashes, dirty flags and system flags, the same cache
    entries in the same order and the same size, the lane's typed structs as the objs.  Whether
    the lane read the items typed (None: no items)."""
    body = Body(raw, lane.conv_key)
    if not body.array or not body.items:
        return None
    whole = body.top[lane.conv_key]
    got = lane.array_cores(whole)
    flat = lane.array_cores(whole, flat=True)
    if got is None:
        assert flat is None
    else:
        cores, ends = flat[0], flat[1]
        assert [cores[a:b] for a, b in zip([0, *ends], ends)] == got[0] and list(flat[2:]) == list(got[1:])
        assert got[0] == [lane.item_cores(msgspec.json.decode(bytes(r))) for r in body.items]
    fast, objs = ItemCache(), []
    infos = fast.get_many(lane, body.items, objs, whole)
    slow = ItemCache()
    want = [slow.get(lane, bytes(r)) for r in body.items]
    assert infos == want
    assert [[msgspec.structs.astuple(p.core) for p in i.parts] for i in infos] == [
        [msgspec.structs.astuple(p.core) for p in i.parts] for i in want]
    # the items cached in the order they first stand (get moves a repeated one to the end); a pass
    # of items without a part caches none of them, as get_many always did (its size counts them)
    keys = list(dict.fromkeys((lane.name, bytes(r)) for r in body.items))
    assert list(fast.items) == (keys if any(i.parts for i in want) else []) and fast.size == slow.size
    seen: set[bytes] = set()  # read typed, every item has its obj; else an item repeated is the item read before
    want_objs = (list(got[1]) if got is not None else
                 [None if b in seen or seen.add(b) else msgspec.json.decode(b) for b in map(bytes, body.items)])
    assert objs == want_objs
    return got is not None


def test_get_many_first_pass_is_get_item_by_item():
    typed = {"anthropic": 0, "chat": 0}
    for name, raw in _first_pass_bodies():
        typed[name] += bool(_first_pass_is_item_by_item(LANES[name], raw))
    assert typed["anthropic"] >= 8 and typed["chat"] >= 8  # (the bench's, at least, read typed)


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_get_many_first_pass_is_get_item_by_item_fuzzed(lane):
    """The same over generated bodies: every block kind, unknown keys, odd values, any text."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import wirecases

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        gen = data.draw(wirecases.bodies(lane))
        _first_pass_is_item_by_item(gen.lane, gen.raw)

    check()


def test_new_parts_hash_the_seed_digest_hashes():
    """The parts of a pass hash each core's seed as identity.digest does: encoded with lone
    surrogates passed through (a text no JSON decoder gives, but a core may hold), wherever in
    the pass such a text stands, and with the media slot when there is one."""
    from bili_addon.kernel.identity import digest
    from bili_addon.kernel.state import Part
    from bili_addon.wire.base import IMAGE, TEXT, TOOL_RESULT, Core

    plain = [Core("user", TEXT, "héllo 😀", path=("content",)), Core("tool", TOOL_RESULT, "out", "", "t1"),
             Core("user", IMAGE, "[image]", media="url:http://x/y.png"),
             Core("assistant", TEXT, "[bili] compressed m00002–m00009 → b1, ~3K tokens saved\nhi", path=("content", 0, "text"))]
    odd = Core("user", TEXT, "a\ud800b\udfff", path=("content",))
    for flat in (plain, plain + [odd], [odd] + plain, plain[:2] + [odd] + plain[2:]):
        parts = ItemCache._new_parts(list(flat))
        want = []
        for c in flat:
            clean = c
            if c.role == "assistant" and c.ctype == TEXT:
                clean = msgspec.structs.replace(c, text=c.text.split("\n", 1)[1])
            want.append(Part(clean, *digest(clean), clean is not c))
        assert parts == want
