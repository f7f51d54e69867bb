"""#11, the Responses lane's ``array_cores`` (Codex's items read in one typed decode): exactly what
``item_cores`` and ``is_system_item`` give item by item, or None (the generic path runs).

Checked over the bench's Responses conversations (several sizes and seeds, items repeated, Python's
non-compact JSON), the Codex captures (as sent and re-encoded compactly) and generated items
(unicode, empty and missing content, missing, extra, duplicate and oddly typed fields, ids present
or absent, every role, unknown kinds mixed in); get_many with and without it (the same ItemInfos,
cores, cache), rendering's patch from its structs (the same bytes as from the dicts), and whole
Engine runs with ``array_cores`` removed: the same bytes out, refs, ledger rows, cached items.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import render
from bili_addon.kernel.state import ItemCache
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from bili_addon.wire.base import Body, decode_any
from bili_addon.wire.responses import ResponsesLane

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

LANE = LANES["responses"]

# -- inputs ---------------------------------------------------------------------------------------


def _bench_bodies(sizes=(1, 2, 7, 40, 100, 1000), seeds=(7, 3, 11)) -> list[bytes]:
    out = []
    for n in sizes:
        for seed in seeds[:1] if n >= 1000 else seeds:
            case = bench_overhead.Case("responses", n, seed=seed)
            out.append(case.unique_body())
            msgs = list(case.msgs)
            out.append(case.body(msgs + msgs[-3:]))  # items twice
            out.append(json.dumps({**case.top, "input": msgs}).encode())  # Python's json: not compact
    return out


def _capture_bodies() -> list[bytes]:
    from wirecases import capture_files, captured_bodies

    out = []
    for path in capture_files():
        for c in captured_bodies(path):
            if c.lane.name == "responses":
                out += [c.raw, msgspec.json.encode(msgspec.json.decode(c.raw))]  # as sent, and compact
    return out


_PROSE = ["plain words", "Grüße, «naïve» café", "日本語のテキスト", "emoji 😀🎉", "a<b and c>d", "",
          "[bili] folded 3 messages\nthe rest", '<acp tokens="12" type="text">m00001</acp>\nechoed',
          "x" * 2000, "tab\tnew\nline \\ quote \" slash /", "\u2028\u2029 separators", " ", "LONE pair"]  # (LONE: an escaped surrogate pair in the bytes, _lone)


def _lone(raw: bytes) -> bytes:
    return raw.replace(b"LONE", b"\\ud83d\\ude00")


def _prose(rng: random.Random) -> str:
    return "".join(rng.choice(_PROSE) for _ in range(rng.randint(1, 3)))


def _odd(rng: random.Random):
    return rng.choice([None, 5, 1.5, True, [], {}, ["a", 1], {"k": "v", "n": [1, {"x": None}]}, "", "s"])


def _maybe(rng: random.Random, item: dict, key: str, value, p: float = 0.85) -> None:
    if rng.random() < p:
        item[key] = value


def _part(rng: random.Random, wild: bool) -> object:
    r = rng.random()
    if r < 0.6:
        p = {"type": rng.choice(["input_text", "output_text", "text"]), "text": _prose(rng)}
        if rng.random() < 0.3:
            p["annotations"] = []  # extra keys
        if rng.random() < 0.1:
            p = {"text": p["text"], "type": p["type"]}  # another key order
    elif r < 0.7:
        p = {"type": "input_image", "detail": "auto"}
        _maybe(rng, p, "image_url", rng.choice(["data:image/png;base64,aGk=", "https://x/y.png", "",
                                                 {"url": "https://x/z.png"}, {"url": ""}, None]), 0.7)
        _maybe(rng, p, "file_id", rng.choice(["file-1", "", None]), 0.3)
    elif r < 0.8:
        p = {"type": "refusal", "refusal": _prose(rng)}
    elif wild:
        p = rng.choice([{"type": "input_text", "text": _odd(rng)}, {"type": "input_file", "file_id": "f"},
                        {"text": "no type"}, {"type": "refusal", "refusal": 3}, "a string part", 7, None,
                        {"type": _odd(rng), "text": "t"}])
    else:
        p = {"type": "output_text", "text": _prose(rng)}
    return p


def _item(rng: random.Random, wild: bool) -> dict:
    k = rng.random()
    if k < 0.3:
        it: dict = {}
        if rng.random() < 0.9:
            it["type"] = "message"
        elif wild and rng.random() < 0.5:
            it["type"] = None
        roles = ["user", "assistant", "developer", "system"] + (["tool", "", "User", 5, None] if wild else [])
        it["role"] = rng.choice(roles)
        _maybe(rng, it, "id", f"msg_{rng.randint(0, 99)}", 0.3)
        c = rng.random()
        if c < 0.6:
            it["content"] = [_part(rng, wild) for _ in range(rng.randint(0, 4))]
        elif c < 0.85:
            it["content"] = _prose(rng)
        elif c < 0.92:
            it["content"] = None
        elif wild:
            it["content"] = _odd(rng)
        if "content" not in it and "type" not in it and not wild:
            it["content"] = "restored"  # (no type: a message needs both role and content)
        if rng.random() < 0.2:
            it["status"] = "completed"
        if rng.random() < 0.1:
            it = dict(reversed(list(it.items())))
        return it
    if k < 0.5:
        it = {"type": "reasoning"}
        _maybe(rng, it, "id", rng.choice([f"rs_{rng.randint(0, 99)}", "rs_same"] + (["", 5] if wild else [])))
        _maybe(rng, it, "summary", rng.choice([[], [{"type": "summary_text", "text": _prose(rng)}],
                                               [{"type": "summary_text", "text": "a"}, {"type": "x", "text": "b"},
                                                {"type": "summary_text", "text": "c"}]]
                                              + ([None, "str", [1], [{"type": "summary_text", "text": 3}]] if wild else [])))
        _maybe(rng, it, "content", rng.choice([[{"type": "reasoning_text", "text": _prose(rng)}], [], None]
                                              + (["a str", [{"type": "summary_text", "text": "t"}]] if wild else [])), 0.3)
        _maybe(rng, it, "encrypted_content", "gAAAAB" + "x" * rng.randint(0, 200))
        if "id" not in it and not wild:
            it["id"] = "rs_x"  # (no text and no id: the whole item's JSON, read one by one)
        return it
    if k < 0.75:
        kind = rng.choice(["function_call", "function_call", "custom_tool_call"])
        it = {"type": kind}
        _maybe(rng, it, "id", f"fc_{rng.randint(0, 99)}", 0.6)
        _maybe(rng, it, "call_id", rng.choice([f"call_{rng.randint(0, 99)}", ""] + ([5, None] if wild else [])))
        _maybe(rng, it, "name", rng.choice(["exec_command", "apply_patch", "ünï", ""] + ([3, None] if wild else [])))
        payload = rng.choice([json.dumps({"cmd": _prose(rng)}), _prose(rng), "", None, {"a": [1, "b"]}, [1, 2], 5])
        _maybe(rng, it, "arguments" if kind == "function_call" else "input", payload)
        if rng.random() < 0.2:
            it["status"] = "completed"
        return it
    if k < 0.95:
        kind = rng.choice(["function_call_output", "function_call_output", "custom_tool_call_output"])
        it = {"type": kind}
        _maybe(rng, it, "call_id", rng.choice([f"call_{rng.randint(0, 99)}", ""] + ([5, None] if wild else [])), 0.95 if wild else 1.0)
        out = rng.choice([_prose(rng), _prose(rng), "", None]
                         + ([[{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "https://i"}],
                             {"type": "computer_screenshot", "image_url": "data:image/png;base64,aGk="},
                             {"x": 1}, 5] if wild else []))
        _maybe(rng, it, "output", out, 0.95 if wild else 1.0)
        return it
    if not wild:
        return {"type": "message", "role": "user", "content": _prose(rng)}
    return rng.choice([{"type": "item_reference", "id": "msg_1"}, {"type": "local_shell_call", "call_id": "c",
                       "action": {"cmd": ["ls"]}}, {"type": "web_search_call", "id": "ws"}, {"type": 5},
                       {"type": "x_output", "call_id": 5, "output": "o"}, {"no": "type"}, "a string item", 3, None,
                       [1], {"type": "compaction", "encrypted_content": "e"}])


def _random_bodies(count: int = 200, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        wild = i % 3 == 0
        items = [_item(rng, wild and rng.random() < 0.2) for _ in range(rng.randint(0, 25))]
        if items and rng.random() < 0.3:
            items += rng.sample(items, min(len(items), rng.randint(1, 3)))  # duplicates
        top = {"model": "m", "instructions": "be brief", "input": items}
        if rng.random() < 0.3:
            out.append(_lone(json.dumps(top, ensure_ascii=rng.random() < 0.5).encode()))
        else:
            out.append(_lone(msgspec.json.encode(top)))
    # duplicate keys (the last one counts, as for a dict) and a leading space in the array
    out += [b'{"input":[{"type":"message","type":"reasoning","id":"x"},{"type":"reasoning","id":"a","id":"b"}]}',
            b'{"input":[{"role":"user","content":"a","content":[{"type":"input_text","text":"q","text":"r"}]}]}',
            b'{"input":[{"type":"function_call","call_id":"a","call_id":"b","arguments":"{}","name":"n"}]}',
            b'{"input": [ {"type" : "message", "role":"developer","content":[]} ]}',
            b'{"input":[]}', b'{"input":[{"role":"user"}]}', b'{"input":[{"type":null,"role":"user"}]}',
            b'{"input":[{"type":null,"role":"user","content":null}]}', b'{"input":[{"content":"c"}]}']
    return out


def _all_bodies() -> list[bytes]:
    return _bench_bodies() + _random_bodies() + _capture_bodies()


def _arrays():
    for raw in _all_bodies():
        try:
            body = Body(raw, "input")
        except Exception:
            continue
        if body.array:
            yield body.items, body.top["input"]


def _astuples(cores) -> list:
    return [msgspec.structs.astuple(c) for c in cores]


# -- array_cores against item_cores ---------------------------------------------------------------


def test_array_cores_is_item_cores():
    typed = untyped = 0
    for raws, whole in _arrays():
        objs = [decode_any(r) for r in raws]
        want = [LANE.item_cores(o) for o in objs]
        systems = [LANE.is_system_item(o) for o in objs]
        got = LANE.array_cores(whole)
        flat = LANE.array_cores(whole, flat=True)
        if got is None:
            assert flat is None
            untyped += 1
            continue
        typed += 1
        cores, structs, sys_ = got
        assert len(cores) == len(structs) == len(sys_) == len(raws)
        assert cores == want and [_astuples(c) for c in cores] == [_astuples(c) for c in want]
        assert sys_ == systems
        fcores, ends, fstructs, fsys = flat
        assert _astuples(fcores) == [t for c in want for t in _astuples(c)]
        assert ends == [sum(map(len, want[:i + 1])) for i in range(len(want))]
        assert fsys == systems and len(fstructs) == len(raws)
    assert typed > 150 and untyped > 10  # (both ways taken, many times)


def test_bench_and_clean_items_are_typed():
    """The shapes Codex sends are read typed (not always the generic path)."""
    for raw in _bench_bodies(sizes=(7, 100)) + _random_bodies(60, seed=5)[1::3]:
        body = Body(raw, "input")
        assert LANE.array_cores(body.top["input"]) is not None


def test_items_one_by_one():
    """Each generated item alone: typed exactly as item_cores reads it, or None."""
    rng = random.Random(9)
    typed = 0
    for i in range(6000):
        obj = _item(rng, i % 2 == 0)
        raw = _lone(msgspec.json.encode(obj))
        got = LANE.array_cores(b"[" + raw + b"]")
        if got is not None:
            typed += 1
            want = LANE.item_cores(decode_any(raw))
            assert got[0] == [want] and [_astuples(got[0][0])] == [_astuples(want)]
            assert got[2] == [LANE.is_system_item(decode_any(raw))]
    assert typed > 3000


# -- get_many and rendering's patch ----------------------------------------------------------------


def _get_many(raws, whole, without: bool, pre=None):
    with pytest.MonkeyPatch.context() as mp:
        if without:
            mp.setattr(ResponsesLane, "array_cores", None)
        cache = ItemCache()
        if pre:
            cache.get_many(LANE, pre)
        objs: list = []
        infos = cache.get_many(LANE, raws, objs, whole)
        again = cache.get_many(LANE, raws[::-1])
        return infos, objs, [(k, v.parts, v.is_system) for k, v in cache.items.items()], cache.size, again


def test_get_many_with_and_without():
    rng = random.Random(1)
    for raws, whole in _arrays():
        cases = [(raws, whole, None), (raws, None, None), (list(map(bytes, raws)), whole, None)]
        if raws:
            cases.append((raws, whole, [bytes(r) for r in raws if rng.random() < 0.3]))
        for r, w, pre in cases:
            new, old = _get_many(r, w, False, pre), _get_many(r, w, True, pre)
            assert new[0] == old[0] and [[_astuples([p.core for p in i.parts])] for i in new[0]] == \
                [[_astuples([p.core for p in i.parts])] for i in old[0]]
            assert new[2:] == old[2:]
            assert len(new[1]) == len(old[1]) == len(r)
            for n, o, raw in zip(new[1], old[1], r):
                assert n is None or isinstance(n, msgspec.Struct) or n == o
                assert (n is None) == (o is None) or isinstance(n, msgspec.Struct)
                if isinstance(n, msgspec.Struct):  # (None: an item the old loop found cached or twice, not decoded)
                    assert o is None or o == decode_any(raw)


def test_patch_from_structs_is_patch_from_dicts():
    """render's _patch of an item read typed: the bytes it makes from the item's dict."""
    n = 0
    for raws, whole in _arrays():
        got = LANE.array_cores(whole)
        if got is None:
            continue
        for raw, cores, struct in zip(raws, got[0], got[1]):
            raw = bytes(raw)
            edits = [(c.path, "<acp x>\n" + c.text) for c in cores if c.path]
            if not edits:
                continue
            n += 1
            assert render._patch(LANE, raw, struct, edits) == render._patch(LANE, raw, decode_any(raw), edits)
    assert n > 100


# -- whole Engine runs -----------------------------------------------------------------------------


def _run(tmp_path, name: str, bodies: list[bytes], without: bool) -> list:
    with pytest.MonkeyPatch.context() as mp:
        if without:
            mp.setattr(ResponsesLane, "array_cores", None)
        e = Engine(Store(tmp_path / f"{name}-{without}.db"))
        try:
            out = []
            for i, raw in enumerate(bodies):
                sid = f"s{i % 3}"
                r = e.process(raw, LANE, {"x-acp-session": sid}, render=True)
                out.append((r.body, r.refs_new, r.refs_known, r.tagged, r.messages, r.source))
            out.append([e.store.ledger(f"s{i}") for i in range(3)])
            out.append([(k, v.parts, v.is_system) for k, v in e.items.items.items()])
            return out
        finally:
            e.store.close()


def test_engine_with_and_without(tmp_path):
    bodies = []
    for n in (3, 40, 100, 1000):
        case = bench_overhead.Case("responses", n, seed=n)
        msgs = list(case.msgs)
        bodies += [case.body(msgs), case.body(msgs + [case.new(0)]), case.unique_body()]
    bodies += _random_bodies(40, seed=4)
    bodies += _capture_bodies()[:40]
    new, old = _run(tmp_path, "e", bodies, False), _run(tmp_path, "e", bodies, True)
    assert new == old
    assert any(r[0] for r in new[:-2])  # (something rendered)
