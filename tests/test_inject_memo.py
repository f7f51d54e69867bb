"""The lanes' tool names and injection replay what they wrote for inputs they saw before
(wire/base.py: Memo, memo_tool_names, memo_inject).  Every test compares the memoised
``tool_names`` / ``inject`` with the lane's own code (``_tool_names`` / ``_inject``) on fresh
bodies: the same result, the same outgoing bytes, the same top-level key order, the same items,
the same exception, on the first sight of the inputs and on every repeat (hits), after other
inputs came between (misses, evictions), over the bench's conversations, the captured agents'
bodies and hand-made shapes."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel.prompts import SYSTEM_PROMPT, TOOLS
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES, anthropic, base, chat, gemini, responses
from bili_addon.wire.base import (
    PROMPT_SEPARATOR,
    Body,
    append_to_text_value,
    append_tools,
    decode_any,
    decode_obj,
    encode,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)
from wirecases import captured_bodies, capture_files  # noqa: E402

MODULES = {"anthropic": anthropic, "chat": chat, "responses": responses, "gemini": gemini}


# -- the injection as it was before the memo (the oracle, verbatim) ------------------------------


def _legacy_anthropic(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
                      names: list[str]) -> bool:
    if not names:
        return False
    shaped = [{"_name": t["name"], "name": t["name"], "description": t["description"],
               "input_schema": t["parameters"]} for t in tools]
    changed = append_tools(body, "tools", names, shaped) if tools else False
    system = body.top.get("system")
    if system is None:
        body.set("system", prompt)
        return True
    new = append_to_text_value(system, prompt, {"type": "text", "text": prompt})
    if new is not None:
        body.top["system"] = new
        changed = True
    return changed


def _legacy_chat(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
                 names: list[str]) -> bool:
    if not names:
        return False
    shaped = [{"_name": t["name"], "type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["parameters"]}} for t in tools]
    if tools:
        append_tools(body, "tools", names, shaped)
    if start > 0:  # the agent's leading system message gets the prompt at its end
        obj = decode_obj(items[start - 1])  # the other parts keep their bytes
        raw = obj.get("content")
        new = append_to_text_value(raw, prompt, {"type": "text", "text": prompt}) if raw is not None else None
        if new is not None:
            obj["content"] = new
            items[start - 1] = encode(obj)
            return True
    items.insert(start, encode({"role": "system", "content": prompt}))
    return True


def _legacy_responses(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
                      names: list[str]) -> bool:
    if not names:
        return False
    shaped = [{"_name": t["name"], "type": "function", "name": t["name"], "description": t["description"],
               "parameters": t["parameters"]} for t in tools]
    changed = append_tools(body, "tools", names, shaped) if tools else False
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        body.set("instructions", instructions + PROMPT_SEPARATOR + prompt)
        return True
    if body.array:  # after the agent's own leading developer/system items
        items.insert(start, encode({"type": "message", "role": "developer",
                                    "content": [{"type": "input_text", "text": prompt}]}))
        return True
    return changed


def _legacy_gemini(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
                   names: list[str]) -> bool:
    if not names:
        return False
    decls = [{"name": t["name"], "description": t["description"], "parameters": t["parameters"]}
             for t in tools if t["name"] not in names]
    if decls:
        append_tools(body, "tools", [], [{"_name": "", "functionDeclarations": decls}])
    system = body.get("systemInstruction")
    if not isinstance(system, dict):
        system = {"parts": []}
    parts = system.get("parts") if isinstance(system.get("parts"), list) else []
    system["parts"] = [*parts, {"text": prompt}]
    body.set("systemInstruction", system)
    return True


LEGACY = {"anthropic": _legacy_anthropic, "chat": _legacy_chat, "responses": _legacy_responses,
          "gemini": _legacy_gemini}


def clear() -> None:
    for m in MODULES.values():
        m._NAMES.clear()
        m._TOOLS.clear()
        m._PROMPT.clear()


@pytest.fixture(autouse=True)
def _cold():
    clear()
    yield
    clear()


def system_run(lane, body: Body) -> int:
    start = 0
    for item in body.items:
        if not lane.is_system_item(decode_any(item)):
            break
        start += 1
    return start


def outcome(lane, raw: bytes, start: int | None, tools, prompt, names_of, memo: bool | str):
    """What one injection leaves: the names read, the result (or the exception), the body sent,
    its top-level keys, the items.  ``memo``: True the lane's tool_names and inject, False its own
    code without the memo, "legacy" the injection as it was before the memo."""
    body = Body(raw, lane.conv_key)
    items = [bytes(i) for i in body.items]
    if start is None:
        start = system_run(lane, body)
    try:
        names = (lane.tool_names if memo is True else lane._tool_names)(body)
    except Exception as e:  # noqa: BLE001  (the same exception is the same outcome)
        return ("names raised", type(e), str(e))
    names_used = names_of(names)
    try:
        inject = LEGACY[lane.name] if memo == "legacy" else lane.inject if memo is True else lane._inject
        got = inject(body, items, start, tools, prompt, names_used)
    except Exception as e:  # noqa: BLE001
        got = ("raised", type(e), str(e))
    top = {k: bytes(v) for k, v in body.top.items() if k != lane.conv_key}
    return (names, got, list(body.top), top, [bytes(i) for i in items], body.encode(items))


NAMES_OF = {
    "read": lambda names: names or [],
    "none": lambda names: [],
    "bili's": lambda names: [*(names or []), "compress", "search_context"],
    "only bili's": lambda names: ["decompress"],
    "native": lambda names: [*(names or []), "mcp__bili__compress"],
}
TOOL_SETS = {
    "bili": lambda: list(TOOLS),
    "none": lambda: [],
    "two": lambda: list(TOOLS[:2]),
}


def check(lane, raw: bytes, starts=(None,), prompts=(SYSTEM_PROMPT,), names_modes=tuple(NAMES_OF),
          tool_sets=tuple(TOOL_SETS), repeats: int = 3) -> int:
    """Memoised against the lane's own code for each combination, each ``repeats`` times (the
    first a miss for a new input, the others hits), the body read from a new copy of the bytes
    every time; returns how many combinations were checked."""
    n = 0
    for start in starts:
        for prompt in prompts:
            for mode in names_modes:
                for ts in tool_sets:
                    want = outcome(lane, raw, start, TOOL_SETS[ts](), prompt, NAMES_OF[mode], memo="legacy")
                    assert outcome(lane, raw, start, TOOL_SETS[ts](), prompt, NAMES_OF[mode], memo="legacy") == want
                    for _ in range(repeats):
                        got = outcome(lane, bytes(bytearray(raw)), start, TOOL_SETS[ts](), prompt, NAMES_OF[mode],
                                      memo=True)
                        assert got == want, (lane.name, start, mode, ts)
                    n += 1
    return n


# -- the bench's conversations -----------------------------------------------------------------


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("n", [1, 2, 100])
def test_bench_conversations(lane, n):
    case = bench_overhead.Case(lane, n)
    msgs = list(case.msgs)
    raws = [case.body(msgs), case.body(msgs + [case.new(0)]), case.body(msgs + [case.new(0), case.new(1)])]
    for raw in raws:
        check(case.lane, raw, starts=(None, 0, 1, 2))
    for raw in raws:  # again: warm from every body before
        check(case.lane, raw, repeats=2)


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_bench_changed_inputs(lane):
    """Each thing the injection reads changed in turn: never the previous value."""
    case = bench_overhead.Case(lane, 20)
    top = dict(case.top)
    msgs = list(case.msgs)
    variants = [case.body(msgs)]
    tools = copy.deepcopy(top["tools"])
    (tools[0].get("function") or tools[0])["description"] += "!"
    variants.append(msgspec.json.encode({**top, "messages": msgs, "tools": tools}))
    variants.append(msgspec.json.encode({**top, "messages": msgs, "tools": top["tools"][:-1]}))
    if lane == "anthropic":
        variants.append(msgspec.json.encode({**top, "messages": msgs, "system": top["system"] + "."}))
        variants.append(msgspec.json.encode({**top, "messages": msgs, "system": [{"type": "text", "text": "x"}]}))
        variants.append(msgspec.json.encode({k: v for k, v in {**top, "messages": msgs}.items() if k != "system"}))
    else:
        sys_msg = dict(msgs[0])
        sys_msg["content"] = sys_msg["content"] + "."
        variants.append(case.body([sys_msg, *msgs[1:]]))
        variants.append(case.body([{**sys_msg, "content": [{"type": "text", "text": "y"}]}, *msgs[1:]]))
        variants.append(case.body(msgs[1:]))  # no system message: the prompt is an item of its own
    variants.append(msgspec.json.encode({**top, "messages": msgs, "tools": []}))
    variants.append(msgspec.json.encode({k: v for k, v in {**top, "messages": msgs}.items() if k != "tools"}))
    variants.append(msgspec.json.encode({**top, "messages": msgs, "tools": {"not": "an array"}}))
    for _ in range(2):
        for raw in variants:  # each one a miss after the one before, then a hit the second time round
            check(case.lane, raw, starts=(None, 0))
    for raw in variants[::-1]:
        check(case.lane, raw, prompts=(SYSTEM_PROMPT, "another prompt"), names_modes=("read",), repeats=2)


def test_eviction():
    """More inputs than a memo keeps, round and round: evicted entries recomputed, nothing mixed up."""
    case = bench_overhead.Case("anthropic", 3)
    raws = [msgspec.json.encode({**case.top, "messages": case.msgs, "system": f"system {i}"}) for i in range(12)]
    for _ in range(3):
        for raw in raws:
            check(case.lane, raw, names_modes=("read",), tool_sets=("bili",), repeats=1)
    assert len(anthropic._PROMPT.entries) == anthropic._PROMPT.size
    assert len(anthropic._TOOLS.entries) == 1 and len(anthropic._NAMES.entries) == 1  # (one tools array)


def counting(monkeypatch, lane) -> dict:
    calls = {"_tool_names": 0, "_inject_tools": 0, "_inject_prompt": 0}
    for name in calls:
        own = getattr(lane, name)

        def counted(*a, _own=own, _name=name):
            calls[_name] += 1
            return _own(*a)

        monkeypatch.setattr(lane, name, staticmethod(counted))
    return calls


def test_a_hit_runs_nothing(monkeypatch):
    """A repeat is served by the memo (the lane's own code runs once), with the bytes it would give."""
    case = bench_overhead.Case("anthropic", 10)
    raw = case.body(case.msgs)
    lane = anthropic.AnthropicLane
    want = outcome(lane, raw, None, list(TOOLS), SYSTEM_PROMPT, NAMES_OF["read"], memo="legacy")
    calls = counting(monkeypatch, lane)
    for _ in range(4):
        assert outcome(lane, bytes(bytearray(raw)), None, list(TOOLS), SYSTEM_PROMPT, NAMES_OF["read"],
                       memo=True) == want
    assert calls == {"_tool_names": 1, "_inject_tools": 1, "_inject_prompt": 1}


def test_a_system_of_its_own_every_request(monkeypatch):
    """Claude Code's system starts with a billing block that changes every request: the prompt's
    half runs every time, the tools' half (the same tools) is replayed."""
    case = bench_overhead.Case("anthropic", 10)
    lane = anthropic.AnthropicLane
    raws = []
    for i in range(12):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.fbe; cch={i:05x};"},
                  {"type": "text", "text": "You are a Claude agent."}]
        raws.append(msgspec.json.encode({**case.top, "messages": case.msgs, "system": system}))
    wants = [outcome(lane, raw, None, list(TOOLS), SYSTEM_PROMPT, NAMES_OF["read"], memo="legacy") for raw in raws]
    calls = counting(monkeypatch, lane)
    for raw, want in zip(raws, wants):
        assert outcome(lane, raw, None, list(TOOLS), SYSTEM_PROMPT, NAMES_OF["read"], memo=True) == want
    assert calls == {"_tool_names": 1, "_inject_tools": 1, "_inject_prompt": 12}


def test_changed_tool_schema_is_a_miss():
    """A tool dict changed in place (same objects, other content) is never served the old bytes."""
    case = bench_overhead.Case("chat", 5)
    raw = case.body(case.msgs)
    tools = copy.deepcopy(list(TOOLS))
    lane = chat.ChatLane
    a = outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo=True)
    tools[0]["description"] = "changed"
    b = outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo=True)
    assert a != b
    assert b == outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo="legacy")
    tools[1]["parameters"]["properties"]["full"] = {"type": "integer"}
    assert outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo=True) == \
        outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo="legacy")
    # a value equal in Python but another JSON (True == 1): another key
    tools[2]["parameters"]["properties"]["limit"]["minimum"] = True
    assert outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo=True) == \
        outcome(lane, raw, None, tools, SYSTEM_PROMPT, NAMES_OF["read"], memo="legacy")


def test_names_are_new_lists():
    """The names come back as a new list every time: a caller changing one changes no later turn."""
    case = bench_overhead.Case("anthropic", 3)
    raw = case.body(case.msgs)
    lane = LANES["anthropic"]
    first = lane.tool_names(Body(raw, "messages"))
    first.append("compress")
    again = lane.tool_names(Body(raw, "messages"))
    assert again == lane._tool_names(Body(raw, "messages")) and "compress" not in again
    again.clear()
    assert lane.tool_names(Body(raw, "messages")) == lane._tool_names(Body(raw, "messages"))


# -- the captured agents -------------------------------------------------------------------------


CAPTURED = [c for path in capture_files() for c in captured_bodies(path)]


@pytest.mark.skipif(not CAPTURED, reason="no captures (set BILI_CAPTURES)")
def test_captures():
    n = 0
    for c in CAPTURED:
        n += check(c.lane, c.raw, starts=(None, 0), repeats=2)
    for c in CAPTURED[::-1]:  # warm with every other capture's inputs
        n += check(c.lane, c.raw, names_modes=("read", "bili's"), repeats=2)
    assert n > 100


# -- hand-made shapes ----------------------------------------------------------------------------


def _j(obj) -> bytes:
    return msgspec.json.encode(obj)


USER = {"role": "user", "content": "hi"}
WEIRD = [
    ("anthropic", {"tools": [{"name": "Bash"}], "messages": [USER]}),  # no system: a key added last
    ("anthropic", {"messages": [USER], "system": None, "tools": [{"name": "Bash"}]}),
    ("anthropic", {"messages": [USER], "system": 7, "tools": [{"name": "Bash"}, {"name": 3}, 5]}),
    ("anthropic", {"messages": [USER], "system": [], "tools": [{"name": "compress"}, {"name": "Bash"}]}),
    ("anthropic", {"messages": [USER], "system": "s", "tools": "Bash"}),
    ("anthropic", {"messages": [USER], "system": "s"}),
    ("anthropic", {"system": {"x": 1}, "messages": [USER], "tools": [{"name": "Bash", "x": [1, {"y": 2}]}]}),
    ("anthropic", b'{"model":"m", "system" : "s\\u00e9",\n"tools":[ {"name":"Bash"} ],'
                  b'"messages":[{"role":"user","content":"hi"}]}'),  # (not compact: the general split)
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": "Bash"}}]}),
    ("chat", {"messages": [{"role": "system", "content": "s"}, USER],
              "tools": [{"type": "function", "function": {"name": "Bash"}}, {"function": 3}, 4]}),
    ("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]}, USER],
              "tools": [{"type": "function", "function": {"name": "compress"}}]}),
    ("chat", {"messages": [{"role": "system"}, USER], "tools": [{"type": "function", "function": {"name": "a"}}]}),
    ("chat", {"messages": [{"role": "developer", "content": 5}, USER],
              "tools": [{"type": "function", "function": {"name": "a"}}]}),
    ("chat", {"messages": [[1], USER], "tools": [{"type": "function", "function": {"name": "a"}}]}),
    ("chat", {"messages": [], "tools": [{"type": "function", "function": {"name": "a"}}]}),
    ("responses", {"input": [{"type": "message", "role": "user", "content": "hi"}], "instructions": "be brief",
                   "tools": [{"type": "function", "name": "shell"}]}),
    ("responses", {"input": [{"type": "message", "role": "developer", "content": "d"}, USER],
                   "tools": [{"type": "function", "name": "shell"}, {"type": "namespace", "name": "mcp__bili",
                                                                      "tools": [{"name": "compress"}]}]}),
    ("responses", {"input": "a plain string", "tools": [{"type": "function", "name": "shell"}]}),
    ("responses", {"input": [USER], "tools": [{"type": "namespace", "name": "mcp__x", "tools": 5}]}),
    ("responses", {"input": [USER], "tools": [{"type": "function", "name": "shell"}]}),  # (the same tools)
    ("responses", {"input": "a plain string", "instructions": "i", "tools": [{"type": "function", "name": "shell"}]}),
    ("responses", {"input": [USER], "instructions": None, "tools": [{"type": "custom", "name": "apply_patch"}]}),
    ("responses", {"type": "response.create", "input": [USER], "instructions": ["x"], "tools": [{"name": "s"}]}),
    ("gemini", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                "tools": [{"functionDeclarations": [{"name": "run"}]}]}),
    ("gemini", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                "systemInstruction": {"parts": [{"text": "s"}]},
                "tools": [{"function_declarations": [{"name": "compress"}, {"name": "run"}]}, {"googleSearch": {}}]}),
    ("gemini", {"systemInstruction": "odd", "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                "tools": [{"functionDeclarations": [{"name": "run"}]}]}),
    ("gemini", {"systemInstruction": {"parts": 3, "role": "system"}, "contents": [],
                "tools": [{"functionDeclarations": [{"name": "run"}]}]}),
    ("gemini", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "tools": [{"functionDeclarations": 3}]}),
]


@pytest.mark.parametrize("k", range(len(WEIRD)))
def test_hand_made(k):
    lane_name, body = WEIRD[k]
    raw = body if isinstance(body, bytes) else _j(body)
    lane = LANES[lane_name]
    conv = Body(raw, lane.conv_key)
    check(lane, raw, starts=(None, 0, 1, len(conv.items), len(conv.items) + 1, -1),
          prompts=(SYSTEM_PROMPT, "p"))
    for other in WEIRD:  # every other body of the lane in between: misses, then this one's hits again
        if other[0] == lane_name:
            check(lane, other[1] if isinstance(other[1], bytes) else _j(other[1]), names_modes=("read",), repeats=1)
    check(lane, raw, starts=(None, 0), repeats=2)


def test_memo_is_exact_on_raw_views():
    """A key's raw values compare their bytes: a view into a larger buffer, an owned copy, and
    bytes that differ only in whitespace or at the end."""
    memo = base.Memo(2)
    whole = b'xx[1,2]yy'
    view = msgspec.Raw(memoryview(whole)[2:7])
    memo.put((msgspec.Raw(b"[1,2]"),), (), "a")
    assert memo.get((view,)) == "a"
    assert memo.get((msgspec.Raw(b"[1, 2]"),)) is base._MISS
    assert memo.get((msgspec.Raw(b"[1,2] "),)) is base._MISS
    names = ["ab"]
    memo.put((None,), tuple(names), "b")
    assert memo.get((None,), names) == "b"
    assert memo.get((None,), ["".join(["a", "b"])]) is base._MISS  # an equal string, not the same one
    memo.put((True,), (), "c")
    assert [v for *_, v in memo.entries] == ["c", "b"]  # (bounded: the oldest went)


# -- whole turns ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_engine_turns(tmp_path, monkeypatch, lane):
    """Whole turns of the bench's conversations (first turns, follow-ups, a second conversation
    with the same tools and system) send the same bytes with the memo as with the lanes' own code."""
    case = bench_overhead.Case(lane, 30)
    msgs = list(case.msgs)
    other = bench_overhead.Case(lane, 30, seed=3)
    turns = [("a", case.body(msgs)), ("a", case.body(msgs + [case.new(0)])),
             ("b", other.body(list(other.msgs))), ("a", case.body(msgs + [case.new(0), case.new(1)])),
             ("b", other.body(list(other.msgs) + [other.new(0)]))]

    def run(d: Path) -> list:
        eng = Engine(Store(str(d)), activate="always")
        eng.lineage.defer = True
        outs = []
        for sid, raw in turns:
            r = eng.process(raw, LANES[lane], {"x-acp-session": sid}, render=True)
            outs.append((r.body, r.tagged))
            eng.lineage.flush()
        return outs

    (tmp_path / "memo").mkdir()
    (tmp_path / "own").mkdir()
    with_memo = run(tmp_path / "memo")
    assert MODULES[lane]._TOOLS.entries and MODULES[lane]._PROMPT.entries
    cls = type(LANES[lane]) if not isinstance(LANES[lane], type) else LANES[lane]
    monkeypatch.setattr(cls, "tool_names", staticmethod(cls._tool_names))
    monkeypatch.setattr(cls, "inject", staticmethod(LEGACY[lane]))
    own = run(tmp_path / "own")
    assert with_memo == own
    assert all(b is not None and b"Context folding (bili)" in b for b, _ in own)
    json.loads(own[0][0])
