"""Gemini's calls carry no id (and gemini-cli gives each response one it makes up): what keeps a call
and its response together on the wire is their order.  A fold that took a step's call but not its
protected response, a spent compress call that left without its response (or the reverse), made a body
Gemini refuses ("function response turn comes immediately after a function call turn") on every turn of
the session after it.  A response pairs with the oldest call of its tool not answered yet, as the edits
of the calls pair them."""

from __future__ import annotations

import json
import re

import pytest

from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.stream import ResponseRewriter
from bili_addon.wire import LANES

LANE = LANES["gemini"]
H = {"x-acp-session": "gem"}
ROW = " ".join(f"row-{i}" for i in range(200))
TAG = re.compile(r'^<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n(.*)', re.DOTALL)


def body(contents) -> bytes:
    return json.dumps({"contents": contents, "systemInstruction": {"parts": [{"text": "agent"}]},
                       "tools": [{"functionDeclarations": [{"name": "sh"}]}]}).encode()


def refs_of(out: bytes) -> dict[str, str]:
    got = {}
    for c in json.loads(out)["contents"]:
        for p in c["parts"]:
            m = TAG.match(p.get("text", ""))
            if m:
                got[m.group(2)[:7]] = m.group(1)
    return got


def answer(eng: Engine, parts: list[dict]) -> None:
    """The model's answer through the response rewriter: its proxy calls recorded."""
    rw = ResponseRewriter("gemini")
    rw.json_body(json.dumps({"candidates": [{"content": {"role": "model", "parts": parts},
                                             "finishReason": "STOP"}]}).encode())
    eng.record_calls("gem", rw.calls)


def unpaired(contents: list[dict]) -> list[str]:
    """Gemini's rule: a content of responses follows a model content with as many calls, and one with calls
    is followed by their responses."""
    problems = []
    for i, c in enumerate(contents):
        calls = sum("functionCall" in p for p in c["parts"])
        resps = sum("functionResponse" in p for p in c["parts"])
        before = contents[i - 1] if i else None
        if resps and (before is None or before["role"] != "model" or
                      sum("functionCall" in p for p in before["parts"]) != resps):
            problems.append(f"content {i}: {resps} response(s) after no such calls")
        after = contents[i + 1] if i + 1 < len(contents) else None
        if calls and after is not None and sum("functionResponse" in p for p in after["parts"]) != calls:
            problems.append(f"content {i}: {calls} call(s) without their responses")
    return problems


def response(name: str, out: dict, rid: str | None) -> dict:
    return {"functionResponse": ({"id": rid} if rid else {}) | {"name": name, "response": out}}


@pytest.mark.parametrize("ids", ["none", "made up"])
def test_a_fold_up_to_the_recent_zone_keeps_each_call_with_its_response(tmp_path, ids):
    eng = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000))
    c = [{"role": "user", "parts": [{"text": "audit"}]}]
    for t in range(12):
        c += [{"role": "model", "parts": [{"text": f"Step {t}."}, {"functionCall": {"name": "sh", "args": {"t": t}}}]},
              {"role": "user", "parts": [response("sh", {"output": f"file-{t} {ROW}"}, f"sh-{t}" if ids != "none" else None)]}]
    refs = refs_of(eng.process(body(c), LANE, H, render=True).body)
    args = {"content": [{"startId": refs["Step 1."], "endId": refs["Step 11"],
                         "summary": "Steps 1-11 read files; nothing to change, the parser is in src/parse.py."}]}
    parts = [{"text": "Folding the old steps."}, {"functionCall": {"name": "compress", "args": args}}]
    answer(eng, parts)
    c += [{"role": "model", "parts": parts},
          {"role": "user", "parts": [response("compress", {"error": "Tool \"compress\" not found in registry."},
                                              "compress-1" if ids != "none" else None)]}]
    res = eng.process(body(c), LANE, H, render=True)
    assert res.executed == ["compress"] and not unpaired(json.loads(res.body)["contents"])
    c += [{"role": "model", "parts": [{"text": "Done folding."}]}, {"role": "user", "parts": [{"text": "go on"}]}]
    out = eng.process(body(c), LANE, H, render=True).body
    assert b"Steps 1-11 read files" in out and not unpaired(json.loads(out)["contents"])


@pytest.mark.parametrize("prose,ids", [(False, "made up"), (True, "none")])
def test_a_spent_compress_call_leaves_with_its_response(tmp_path, prose, ids):
    """Four failed compress calls: the oldest two are spent and leave the wire, each with its response
    (gemini-cli's made-up response ids; the call beside prose, whose content stays)."""
    eng = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000))
    c = [{"role": "user", "parts": [{"text": "audit"}]}]
    for t in range(8):
        c += [{"role": "model", "parts": [{"text": f"Step {t}."}, {"functionCall": {"name": "sh", "args": {"t": t}}}]},
              {"role": "user", "parts": [response("sh", {"output": f"file-{t} {ROW}"},
                                                  f"sh-1700{t}-ab" if ids != "none" else None)]}]
    eng.process(body(c), LANE, H, render=True)
    for n in range(4):
        parts = [{"functionCall": {"name": "compress", "args": {"content": [
            {"startId": f"m9999{n}", "endId": "m99999", "summary": "x" * 60}]}}}]
        if prose:
            parts.insert(0, {"text": f"I will fold the old steps (attempt {n})."})
        answer(eng, parts)
        c += [{"role": "model", "parts": parts},
              {"role": "user", "parts": [response("compress", {"error": "unknown"},
                                                  f"compress-1800{n}-cd" if ids != "none" else None)]},
              {"role": "model", "parts": [{"text": f"Retry {n}."}]}, {"role": "user", "parts": [{"text": f"go {n}"}]}]
        res = eng.process(body(c), LANE, H, render=True)
    out = json.loads(res.body)["contents"]
    assert not unpaired(out)
    calls = sum(p.get("functionCall", {}).get("name") == "compress" for x in out for p in x["parts"])
    resps = sum(p.get("functionResponse", {}).get("name") == "compress" for x in out for p in x["parts"])
    assert calls == resps and calls < 4 + prose * 2


def test_an_agent_that_writes_snake_case_gets_one_system_instruction_and_its_results(tmp_path):
    """The REST API takes both spellings (Google's own examples write ``system_instruction``): bili's prompt
    went into a second member of the other spelling (one field twice: refused), and the edits looked for
    ``functionCall``/``functionResponse`` only, so the model was told its compress call failed while its
    range had left the wire."""
    eng = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000))
    c = [{"role": "user", "parts": [{"text": "audit"}]}]
    for t in range(12):
        c += [{"role": "model", "parts": [{"text": f"Step {t}."}, {"function_call": {"name": "sh", "args": {"t": t}}}]},
              {"role": "user", "parts": [{"function_response": {"name": "sh", "response": {"output": f"file-{t} {ROW}"}}}]}]

    def snake(contents) -> bytes:
        return json.dumps({"contents": contents, "system_instruction": {"parts": [{"text": "agent"}]},
                           "tools": [{"function_declarations": [{"name": "sh"}]}]}).encode()

    out = eng.process(snake(c), LANE, H, render=True).body
    doc = json.loads(out)
    assert "systemInstruction" not in doc and doc["system_instruction"]["parts"][0] == {"text": "agent"}
    assert len(doc["system_instruction"]["parts"]) == 2  # (bili's prompt after the agent's)
    refs = refs_of(out)
    args = {"content": [{"startId": refs["Step 1."], "endId": refs["Step 5."],
                         "summary": "Steps 1-5 read files; nothing to change, the parser is in src/parse.py."}]}
    answer(eng, [{"functionCall": {"name": "compress", "args": args}}])
    c += [{"role": "model", "parts": [{"function_call": {"name": "compress", "args": args}}]},
          {"role": "user", "parts": [{"function_response": {"name": "compress",
                                                            "response": {"error": "Tool compress not found"}}}]}]
    res = eng.process(snake(c), LANE, H, render=True)
    assert res.executed == ["compress"]
    last = json.loads(res.body)["contents"][-1]["parts"][0]["function_response"]["response"]
    assert last["content"].startswith("Compressed ")
