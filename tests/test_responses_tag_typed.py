"""#11: the Responses lane tags a first turn's prose in the items' bytes (``ResponsesLane.tag_typed``),
and render_items sends a Responses conversation with no replayed proxy id (``msg-proxy-``) through
the prose pass (render._render_prose) that the other lanes take, where ``tag_typed`` is asked.
Nothing else changes: the same items, the same bytes out.

Proof: (1) ``tag_typed`` against the patching path (render._patch with the item's typed struct,
as the prose pass calls it, and wire.base.patch_many): items of odd texts (escapes, unicode,
empty and blank, our tags and their escaped bytes, ``"content":`` and a part's head as text),
several parts, the roles, members in other orders, members the struct does not read before and
after ``content``, nested and repeated keys, spaces, other JSON writers; the bench's Responses
conversation; the agents' captured Responses bodies (Codex's over HTTP and WebSocket, and the
other agents'): either the same bytes or nothing, and the shapes Codex and the bench write
tagged in the bytes.  (2) Whole Engine runs, as the code is and with render_items as it was (kept
below) and no ``tag_typed``: the bench's first turns and follow-ups, odd conversations (with
proxy ids and without), the captures replayed: the same bytes out, results and stored rows.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import sys
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import render, turn
from bili_addon.kernel.render import _item_edits, _patch, _render_prose
from bili_addon.kernel.tools import ProxyTools, call_key
from bili_addon.wire import LANES, hygiene
from bili_addon.wire.base import TOOL_CALL, TOOL_RESULT, patch_many
from bili_addon.wire.responses import ResponsesLane

from tests.oracle_runs import run_both
from tests.test_followup_steps import Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

LANE = LANES["responses"]
TAG = '<acp tokens="12" type="text">m00007</acp>\n'
TAGS = [TAG, '<acp tokens="1.2K" type="text">m12345</acp>\n', '<acp tokens="3" type="text">x-9</acp>\n']
ODD = [
    "", " ", "\n\t ", "plain words", 'say "hi" \\ back\tslash\n\r\b\f', "café \u2028 \u2029 \U0001F600 \x01\x1f\x7f",
    TAG + "already tagged", "ends with a tag " + TAG, '<acp tokens=\\"12\\" type=\\"text\\">', "\u0000nul",
    '{"type":"input_text","text":"', ',"content":"x', '"content":[{"type":"input_text","text":"', "}]}", "x" * 3000,
]


# ---- the oracle: render_items as it was (every Responses item through the general loop) --------------

def old_render_items(s, lane, raws, infos, start, q, resolved, rendered, changed_cum, tagged_cum, top, origin,
                     active=True, objs=None, strict=None, showing=None) -> None:  # (strict: the engine's verdict, made again below)
    last = len(infos) - 1
    nudges = {ref: n["text"] for ref, n in s.flags.get("nudges", {}).items() if n.get("how") == "suffix"}
    model = top.get("model") if isinstance(top.get("model"), str) else ""
    strict_chat = lane.name == "chat" and (s.flags.get("strict_reasoning") or hygiene.strict_by_name(origin, model))
    call_edits = bool(s.calls or s.flags.get("truncated"))
    responses = lane.name == "responses"
    if not (call_edits or responses or strict_chat):
        _render_prose(lane, infos, start, q, resolved, rendered, changed_cum, tagged_cum, active, nudges, objs)
        return
    idless: dict[str, list[str]] = {}
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
        src = info.raw
        edits, tagged = _item_edits(resolved[k], active, i != last, nudges)
        more = []
        if call_edits:
            more += ProxyTools.call_edits(s, lane, info, resolved[k], idless, showing=showing)
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


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(turn, "render_items", old_render_items)
    mp.delattr(ResponsesLane, "tag_typed")


# ---- (1) tag_typed against the patching path -----------------------------------------------------------

def _escaped(tag: str) -> bytes:
    return msgspec.json.encode(tag)[1:-1]


def _text_paths(item) -> list[tuple[tuple, str]]:
    content = item.get("content")
    if isinstance(content, str):
        return [(("content",), content)]
    return [(("content", j, "text"), p["text"]) for j, p in enumerate(content or [])
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str)]


def check(raw: bytes, path: tuple, text: str, struct=None, tag: str = TAG) -> bytes | None:
    """tag_typed's bytes for the item ``raw`` (read by the lane into its typed struct): the patching
    path's, or None.  None also when asked with another text."""
    if struct is None:
        got = LANE.array_cores(b"[" + raw + b"]")
        if got is None:
            return None  # (not read typed: tag_typed is never asked)
        struct = got[1][0]
    kept = copy.deepcopy(struct)
    general = _patch(LANE, raw, copy.deepcopy(struct), [(path, tag + text)])
    assert general == patch_many(raw, [(path, tag + text)])
    out = LANE.tag_typed(raw, struct, path, _escaped(tag), text)
    if out is not None:
        assert out == general, (raw, path)
    assert struct == kept  # (the struct is left as it was)
    assert LANE.tag_typed(raw, struct, path, _escaped(tag), text + "x") is None
    return out


def _writings(item) -> list[bytes]:
    """The item as msgspec writes it, and as other JSON writers do (spaces, ASCII escapes)."""
    return [msgspec.json.encode(item), json.dumps(item).encode(), json.dumps(item, ensure_ascii=False).encode(),
            json.dumps(item, separators=(",", ":")).encode(),
            json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode(), json.dumps(item, indent=1).encode()]


def _parts(rng: random.Random, text: str) -> list:
    kind = rng.choice(["input_text", "output_text", "text"])
    parts = [{"type": kind, "text": text}]
    for _ in range(rng.choice([0, 0, 1, 2])):
        other = rng.random()
        if other < 0.4:
            parts.insert(rng.choice([0, len(parts)]), {"type": kind, "text": rng.choice(ODD)})
        elif other < 0.6:
            parts.insert(rng.choice([0, len(parts)]), {"type": "input_image", "image_url": "data:image/png;base64,aGk="})
        elif other < 0.7:
            parts.insert(rng.choice([0, len(parts)]), {"type": "input_image", "file_id": "file-1"})
        else:
            parts.insert(rng.choice([0, len(parts)]), {"type": "refusal", "refusal": rng.choice(ODD)})
    if rng.random() < 0.15:
        parts[rng.randrange(len(parts))]["annotations"] = []  # (a member _Part does not read)
    if rng.random() < 0.1:
        p = parts[rng.randrange(len(parts))]
        parts[parts.index(p)] = dict(reversed(list(p.items())))  # (its members in another order)
    return parts


MEMBERS = ["type", "id", "role", "content"]


def _items(rng: random.Random) -> list[dict]:
    """Messages of odd texts: the roles, string content or parts, members in every order, members
    the struct does not read (before and after ``content``), nested ``content`` keys, ids of other
    types."""
    items = []
    for text in ODD:
        for order in itertools.permutations(MEMBERS):
            for _ in range(2):
                values = {"type": rng.choice(["message", "message", None]), "id": rng.choice(
                              [f"msg_{rng.randint(0, 999)}", None, 7, {"content": "x"}, [{"content": [1]}], "msg-proxy-1"]),
                          "role": rng.choice(["user", "assistant", "developer", "system"]),
                          "content": text if rng.random() < 0.3 else _parts(rng, text)}
                keep = [k for k in order if k in ("role", "content") or rng.random() < 0.7]
                item = {k: values[k] for k in keep}
                if rng.random() < 0.3:
                    extra = rng.choice([("status", "completed"), ("internal_chat_message_metadata_passthrough",
                                        {"turn_id": "t", "create_time": 1796213335.1423838, "content": ["a"]}),
                                        ("phase", None), ("content_x", 1)])
                    at = rng.randint(0, len(item))
                    pairs = list(item.items())
                    pairs.insert(at, extra)
                    item = dict(pairs)
                items.append(item)
    return items


@pytest.mark.parametrize("seed", range(3))
def test_odd_items_are_the_patching_path_s_or_nothing(seed):
    rng = random.Random(seed)
    placed = set()
    for item in _items(rng):
        for raw in _writings(item):
            for path, text in _text_paths(item):
                out = check(raw, path, text, tag=rng.choice(TAGS))
                if out is not None:
                    placed.add((len(path), path[1] if len(path) > 1 else 0, next(iter(item))))
    # string content and parts (the first and after others), whatever member comes first
    assert {(1, 0, "role"), (1, 0, "type"), (3, 0, "type"), (3, 1, "type"), (3, 2, "type"), (3, 0, "id"),
            (3, 0, "role"), (3, 0, "content")} <= placed


def test_codex_and_bench_shapes_are_placed():
    """The shapes Codex (custom provider, built-in provider with its metadata after ``content``) and
    the bench write: tagged in the bytes."""
    for text in ODD:
        for item in [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "content": [{"type": "output_text", "text": text}]},
            {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": text}]},
            {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": text}],
             "internal_chat_message_metadata_passthrough": {"turn_id": "01a2", "create_time": 1796213335.1423838,
                                                            "content_item_kinds": ["user.text"]}},
            {"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "first"}, {"type": "input_text", "text": text}]},
            {"role": "user", "content": text},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}], "status": "completed"},
        ]:
            for path, t in _text_paths(item):
                assert check(msgspec.json.encode(item), path, t) is not None, item


def _odd_bytes() -> list[tuple[bytes, tuple, str]]:
    """Bytes a check of the text's place alone would get wrong: keys twice (the decode keeps the
    last), escapes msgspec does not write, spaces in the members patching re-encodes (and in values
    it keeps), a ``content`` key inside another member, the text's part not the one at the path."""
    h = b'{"type":"message","role":"user",'
    p = b'{"type":"input_text","text":"abc"}'
    return [
        (h + b'"content":"first","content":"abc"}', ("content",), "abc"),
        (h + b'"content":"abc","content":"abc"}', ("content",), "abc"),
        (h + b'"content":[' + p + b'],"content":[' + p + b']}', ("content", 0, "text"), "abc"),
        (b'{"type":"message","role":"user","role":"user","content":[' + p + b']}', ("content", 0, "text"), "abc"),
        (h + b'"content":[' + p + b'],"role":"user"}', ("content", 0, "text"), "abc"),
        (b'{"type":"message","id":"a","role":"user","content":[' + p + b'],"id":"b"}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"abc","text":"abc"}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","type":"input_text","text":"abc"}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":"\\u0041BC"}', ("content",), "ABC"),
        (h + b'"content":"a\\/b"}', ("content",), "a/b"),
        (h + b'"content":"a\\u000ab"}', ("content",), "a\nb"),
        (h + b'"content":[{"type":"input_text","text":"\\u0041BC"}]}', ("content", 0, "text"), "ABC"),
        (b'{"type":"message","\\u0072ole":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","role":"user","\\u0063ontent":"x","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","role":"user", "content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","role":"user" ,"content":"abc"}', ("content",), "abc"),
        (b'{ "type":"message","role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type" :"message","role":"user","content":"abc"}', ("content",), "abc"),
        (h + b'"content" :"abc"}', ("content",), "abc"),
        (h + b'"content": "abc"}', ("content",), "abc"),
        (h + b'"content":"abc" }', ("content",), "abc"),
        (h + b'"content":"abc", "status":"x"}', ("content",), "abc"),
        (h + b'"content":"abc","status" :"x"}', ("content",), "abc"),
        (h + b'"content":"abc","status":"x" }', ("content",), "abc"),
        (h + b'"content":"abc","meta":{"a": [1, 2]}}', ("content",), "abc"),  # (spaces inside a value: kept)
        (b'{"type":"message","id":{"a": 1},"role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","id":{"content":"abc"},"role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","id":[1,{"x":2,"content":3}],"role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","id":"a\\",\\"content\\":","role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"type":"message","a\\",\\"content":1,"role":"user","content":"abc"}', ("content",), "abc"),
        (h + b'"content":[ ' + p + b']}', ("content", 0, "text"), "abc"),
        (h + b'"content":[' + p + b' ]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"x"} ,' + p + b']}', ("content", 1, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"x"}, ' + p + b']}', ("content", 1, "text"), "abc"),
        (h + b'"content":[{"type": "input_text","text":"abc"}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text", "text":"abc"}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"abc" }]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"text":"abc","type":"input_text"}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"abc","annotations":[]}]}', ("content", 0, "text"), "abc"),
        (h + b'"content":[{"type":"input_image","image_url":"u"},' + p + b']}', ("content", 1, "text"), "abc"),
        (h + b'"content":[{"type":"input_image","image_url":"u", "detail":"auto"},' + p + b']}', ("content", 1, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"abc"},' + p + b']}', ("content", 1, "text"), "abc"),
        (h + b'"content":[{"type":"input_text","text":"abc"},' + p + b']}', ("content", 0, "text"), "abc"),
        (b'{"content":"abc","role":"user","type":"message"}', ("content",), "abc"),
        (b'{"content":"abc"  ,"role":"user"}', ("content",), "abc"),
        (b' {"role":"user","content":"abc"}', ("content",), "abc"),
        (b'{"role":"user","content":"abc"} ', ("content",), "abc"),
    ]


def test_odd_bytes_are_the_patching_path_s_or_nothing():
    placed = 0
    for raw, path, text in _odd_bytes():
        out = check(raw, path, text)
        placed += out is not None
        if out is not None:
            top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
            assert msgspec.json.encode(top) == raw  # (placed: its members as patching writes them)
    assert placed >= 7  # (members and values patching keeps as they are: spaces inside values, nested keys)
    # a path that is not the text's, a struct that is not this item's
    raw = b'{"type":"message","role":"user","content":[{"type":"input_text","text":"abc"}]}'
    struct = LANE.array_cores(b"[" + raw + b"]")[1][0]
    for path in (("content",), ("content", 1, "text"), ("content", -1, "text"), ("content", "0", "text")):
        assert LANE.tag_typed(raw, struct, path, _escaped(TAG), "abc") is None
    other = LANE.array_cores(b'[{"type":"message","role":"user","content":[{"type":"input_text","text":"abd"}]}]')[1][0]
    assert LANE.tag_typed(raw, other, ("content", 0, "text"), _escaped(TAG), "abd") is None


@pytest.mark.parametrize("n", [100, 1000])
def test_the_benchs_items_are_placed(n):
    case = bench_overhead.Case("responses", n)
    raws = [msgspec.json.encode(m) for m in case.msgs]
    structs = LANE.array_cores(b"[" + b",".join(raws) + b"]")[1]
    placed = 0
    for item, raw, struct in zip(case.msgs, raws, structs):
        for path, text in _text_paths(item):
            assert check(raw, path, text, struct) is not None
            placed += 1
    assert placed > n // 20


def _captured_inputs():
    from wirecases import capture_files, captured_bodies
    out = []
    for f in capture_files():
        for c in captured_bodies(f):
            if c.lane.name != "responses":
                continue
            top = msgspec.json.decode(c.raw, type=dict[str, msgspec.Raw])
            if "input" in top and bytes(top["input"])[:1] == b"[":
                out.append((c.name, bytes(top["input"])))
    return out


def test_the_captured_bodies_are_the_patching_path_s():
    inputs = _captured_inputs()
    if not inputs:
        pytest.skip("no captures here (BILI_CAPTURES)")
    placed = {}
    for name, array in inputs:
        raws = [bytes(r) for r in msgspec.json.decode(array, type=list[msgspec.Raw])]
        got = LANE.array_cores(array)
        items = msgspec.json.decode(array)
        for k, (item, raw) in enumerate(zip(items, raws)):
            if not isinstance(item, dict):
                continue
            for path, text in _text_paths(item):
                for struct in ([got[1][k]] if got is not None else []) + [None]:
                    out = check(raw, path, text, struct)
                    if name.startswith("codex/"):
                        placed[name] = placed.get(name, 0) + (out is not None)
                        assert out is not None, (name, k)  # Codex's messages: all placed
    assert len(placed) >= 4 and all(placed.values())


def _proxy_items(rng: random.Random) -> list[bytes]:
    """Items with ``msg-proxy-`` ids and look-alikes: as the id of a message or of another item
    (short and long), twice (the decode keeps the last), an id of another type, in a text only."""
    long = "msg-proxy-" + "x" * 70
    msg = b'{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]'
    return rng.choice([
        [msg + b',"id":"msg-proxy-1"}'],
        [msg + b',"id":"msg_1"}'],
        [b'{"type":"message","id":"msg-proxy-1","role":"user","content":"x","id":"msg_1"}'],
        [b'{"type":"message","id":"msg_1","role":"user","content":"x","id":"msg-proxy-1"}'],
        [b'{"type":"function_call","id":"' + long.encode() + b'","call_id":"c","name":"n","arguments":"{}"}'],
        [b'{"type":"function_call","id":"msg-proxy-2","call_id":"c","name":"n","arguments":"{}"}'],
        [b'{"type":"reasoning","id":"msg-proxy-3","summary":[]}'],
        [b'{"type":"message","id":["msg-proxy-1"],"role":"user","content":"x"}'],
        [b'{"type":"message","id":"msg_1","role":"user","content":"say \\"msg-proxy-1\\""}'],
        [b'{"type":"message","id":"msg-proxy-1","role":"user","content":"x","annotations_x":{"a":1}}'],
        [b'{"type":"item_reference","id":"msg-proxy-1"}'],  # (an item array_cores does not read)
        [b'{"type":"message","role":"user","content":"x"}'],
    ])


@pytest.mark.parametrize("seed", range(200))
def test_proxy_ids_finds_every_item_with_proxy_id_edits(seed):
    """No item the lane says holds no replayed proxy id has edits for one (the general loop's
    hygiene); items not read typed: the bytes searched, as the general loop does."""
    rng = random.Random(seed)
    raws = [r for _ in range(rng.randint(1, 6)) for r in _proxy_items(rng)]
    got = LANE.array_cores(b"[" + b",".join(raws) + b"]")
    objs = got[1] if got is not None else [None if rng.random() < 0.5 else json.loads(r) for r in raws]
    edits = [hygiene.proxy_id_edits("responses", json.loads(r)) for r in raws if b'"msg-proxy-' in r]
    for some in (objs, None):
        says = LANE.proxy_ids(raws, some)
        if any(edits):
            assert says
        if some is None or got is None:
            assert says == any(b'"msg-proxy-' in r for r in raws)


# ---- (2) whole Engine runs: as the code is, and with the oracle patched in --------------------------------

def both(tmp_path, scenario, placed: int = 1) -> list:
    """The scenario's turns as the code is and with the oracle; at least ``placed`` tags put in the
    items' bytes by tag_typed (the code's run)."""
    made = []
    real = ResponsesLane.tag_typed

    def counted(*a):
        out = real(*a)
        made.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ResponsesLane, "tag_typed", staticmethod(counted))
        new, old = run_both(tmp_path, scenario, patch_oracles, Trace)
    assert sum(made) >= placed
    assert len(new) == len(old) and new
    for i, (a, b) in enumerate(zip(new, old)):
        assert a == b, f"turn {i} differs"
    return new


@pytest.mark.parametrize("n,seed", [(10, 7), (100, 7), (300, 3), (1000, 7)])
def test_the_benchs_first_turns_and_follow_ups(tmp_path, n, seed):
    case = bench_overhead.Case("responses", n, seed)
    news = [case.new(i) for i in range(2)]

    def scenario(make):
        t = make()
        for c in range(2):
            first = copy.deepcopy(case.msgs[0])
            first["content"][0]["text"] = f"[conversation {c}] " + first["content"][0]["text"]
            conv = [first] + case.msgs[1:]
            t.send(case.body(conv), f"bench-first-{c}", LANE)
            for i in range(2):
                conv = conv + [news[i]]
                t.send(case.body(conv), f"bench-first-{c}", LANE)
        return t.turns

    turns = both(tmp_path, scenario, placed=n // 20)
    assert turns[0][0] is not None and turns[0][3] > 0  # rendered, tagged


def _odd_conversation(rng: random.Random, n: int, proxy: str) -> list[dict]:
    """Codex-like items of odd texts and shapes; ``proxy``: "id" (replayed proxy ids), "text" (the
    bytes in texts only) or ""."""
    text = lambda: rng.choice(ODD) + (bench_overhead.Gen(rng.randint(0, 9)).prose(20, 200) if rng.random() < 0.6 else "")
    items: list[dict] = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be " + text()}]},
                         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text() or "start"}]}]
    k = 0
    while len(items) < n:
        k += 1
        items.append({"type": "reasoning", "id": f"rs_{k}", "summary": [{"type": "summary_text", "text": text()}],
                      "encrypted_content": "gAAAA"})
        items.append({"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{k}", "name": "Read",
                      "arguments": json.dumps({"p": text()})})
        items.append({"type": "function_call_output", "call_id": f"call_{k}", "output": text() + "\nout" * rng.randint(1, 50)})
        if rng.random() < 0.5:
            mid = f"msg-proxy-{k}" if proxy == "id" and rng.random() < 0.3 else f"msg_{k}"
            item = {"type": "message", "id": mid, "role": "assistant", "content": _parts(rng, text())}
            if rng.random() < 0.3:
                item = {"type": "message", "role": "assistant", "content": text(), "id": mid}
            items.append(item)
        if rng.random() < 0.3:
            body = text()
            if proxy == "text" and rng.random() < 0.5:
                body += ' "msg-proxy-7" '
            item = {"type": "message", "id": f"msg_u{k}", "role": "user", "content": _parts(rng, body)}
            if rng.random() < 0.3:
                item["internal_chat_message_metadata_passthrough"] = {"turn_id": f"t{k}", "create_time": 1.5 * k}
            if rng.random() < 0.2:
                item = {"role": "user", "content": body}
            items.append(item)
    return items[:n]


@pytest.mark.parametrize("proxy", ["", "id", "text"])
@pytest.mark.parametrize("seed", range(3))
def test_odd_conversations(tmp_path, proxy, seed):
    rng = random.Random(seed)
    items = _odd_conversation(rng, rng.choice([20, 120, 300]), proxy)
    top = {"model": "gpt-5-codex", "instructions": "be brief",
           "tools": [{"type": "function", "name": "Read", "parameters": {}}], "store": False}
    after = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "then " + rng.choice(ODD)}]}
             for _ in range(2)]
    writers = [msgspec.json.encode if rng.random() < 0.85 else (lambda v: json.dumps(v).encode()) for _ in items + after]

    def body(its):
        head = msgspec.json.encode(top)
        return head[:-1] + b',"input":[' + b",".join(w(it) for w, it in zip(writers, its)) + b"]}"

    def scenario(make):
        t = make()
        conv = list(items)
        t.send(body(conv), f"odd-{seed}", LANE)
        for extra in after:
            conv = conv + [extra]
            t.send(body(conv), f"odd-{seed}", LANE)
        return t.turns

    turns = both(tmp_path, scenario, placed=0 if proxy == "id" else 1)  # (proxy ids: the general loop)
    assert turns[0][0] is not None and turns[0][3] > 0


def test_the_captures_replay_as_the_oracle():
    from bili_addon import replay
    from wirecases import capture_files

    files = [f for f in capture_files() if any(k in f for k in ("codex", "_resp", "pi_rev", "_oai", "_unk", "omp_fwd"))]
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    runs, made = [], []
    real = ResponsesLane.tag_typed
    for old in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ResponsesLane, "tag_typed", staticmethod(lambda *a: made.append(real(*a)) or made[-1]))
            if old:
                patch_oracles(mp)
            out = []
            for f in files:
                report = replay.replay_file(Path(f), activate="always", materialize="now", min_compress_chars=200)
                out.append([(t.session, t.flow, t.turn, t.body, t.blocks, t.folded, t.executed) for t in report.turns])
            runs.append(out)
    assert runs[0] == runs[1]
    assert any(t[3] for run in runs[0] for t in run)  # bodies were rendered
    assert any(made)  # ... some tags put in the bytes
