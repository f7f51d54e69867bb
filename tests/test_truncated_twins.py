"""A host that drops its oldest turns after a fold, in a conversation whose short turns repeat ("Done.",
"continue"): identical parts are told apart by their instance number, which the request counts.  With
the oldest instances gone, the count named the folded instances: the live twins after them took their
refs, and the block's summary took their place on the wire (the agent's own turns lost).  A part takes
the instance the session's canonical copy has at its place, and a ref the copy has is never claimed for
a covered message that went missing."""

from __future__ import annotations

import json
import re

import pytest

from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

H = {"x-acp-session": "twins"}
CHAT = LANES["chat"]
ROW = " ".join(f"row-{i}" for i in range(200))
TAG = re.compile(r'^<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n')


def step(t: int) -> list[dict]:
    return [{"role": "assistant", "content": f"Step {t}.", "tool_calls": [
                {"id": f"c{t}", "type": "function", "function": {"name": "sh", "arguments": f'{{"t":{t}}}'}}]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": f"file-{t} {ROW}"},
            {"role": "assistant", "content": "Done."}, {"role": "user", "content": "continue"}]


def body(msgs: list[dict]) -> bytes:
    return json.dumps({"model": "gpt-x", "messages": [{"role": "system", "content": "agent"}, *msgs],
                       "tools": [{"type": "function", "function": {"name": "sh", "parameters": {}}}]}).encode()


def tagged(out: bytes) -> list[tuple[str, str]]:
    """(ref, text) of every tagged message of an upstream body, in order."""
    got = []
    for m in json.loads(out)["messages"]:
        c = m.get("content")
        t = TAG.match(c) if isinstance(c, str) else None
        if t:
            got.append((t.group(1), c[t.end():]))
    return got


@pytest.mark.parametrize("keep_first", [True, False])
def test_the_live_twins_of_dropped_turns_keep_their_refs_and_their_place(tmp_path, keep_first):
    eng = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000), activate="always")
    msgs = [{"role": "user", "content": "audit please"}]
    for t in range(10):
        msgs += step(t)
    first = tagged(eng.process(body(msgs), CHAT, H, render=True).body)
    ref = {text: r for r, text in reversed(first)}  # (each text's first ref)
    args = {"content": [{"startId": ref["Step 0."], "endId": ref["Step 3."],
                         "summary": "Steps 0 to 3 read files f0..f3; nothing to change there."}]}
    eng.record_calls("twins", [("f1", "compress", json.dumps(args))])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "f1", "type": "function", "function": {"name": "compress", "arguments": json.dumps(args)}}]},
             {"role": "tool", "tool_call_id": "f1", "content": "Tool compress not found"}]
    folded = eng.process(body(msgs), CHAT, H, render=True)
    assert folded.executed == ["compress"]
    live = [(r, t) for r, t in tagged(folded.body) if t in ("Done.", "continue")]  # (the unfolded twins)
    assert len(live) == 14

    cut = msgs[:1] + msgs[9:] if keep_first else msgs[9:]  # the host drops steps 0 and 1
    for e in (eng, Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000), activate="always")):
        res = e.process(body(cut), CHAT, H, render=True)  # (the second time: a restarted proxy)
        assert res.drift in ("truncated", ""), res.drift
        out = res.body
        assert [(r, t) for r, t in tagged(out) if t in ("Done.", "continue")] == live  # on the wire, as they were
        assert b"Steps 0 to 3 read files" in out  # (the block stands for its messages still here)
        assert all(f"file-{t} row".encode() in out for t in range(4, 10))
    eng.store.close()


def test_an_agents_own_call_under_a_recorded_calls_id_stays_its_own(tmp_path):
    """A provider that numbers its calls per answer gives ``call_0`` to every call.  The compress call
    recorded under it was restored only at the first call part with that id, taken to be it: once the
    host dropped its oldest turns (the compress call among them), the agent's own ``sh`` call became
    ``compress`` with the fold's arguments, and its output the fold's result.  A recorded call is the
    part that replays it (bili's tool, the same arguments)."""
    def step(t: int) -> list[dict]:
        return [{"role": "assistant", "content": f"Step {t}.", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "sh", "arguments": f'{{"t":{t}}}'}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": f"file-{t} {ROW}"}]

    eng = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000), activate="always")
    msgs = [{"role": "user", "content": "audit please"}]
    for t in range(8):
        msgs += step(t)
    ref = {text: r for r, text in tagged(eng.process(body(msgs), CHAT, H, render=True).body)}
    args = {"content": [{"startId": ref["Step 1."], "endId": ref["Step 4."],
                         "summary": "Steps 1 to 4 read modules mod1..mod4; the parser in src/parse.py is fine."}]}
    eng.record_calls("twins", [("call_0", "compress", json.dumps(args))])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "compress", "arguments": json.dumps(args)}}]},
             {"role": "tool", "tool_call_id": "call_0", "content": "Tool compress not found"}]
    res = eng.process(body(msgs), CHAT, H, render=True)
    assert res.executed == ["compress"]
    out = json.loads(res.body)["messages"]
    assert out[-1]["content"].startswith("Compressed ")  # (its result in place of the agent's error)
    assert [c["function"]["name"] for m in out if m.get("tool_calls") for c in m["tool_calls"]][-1] == "compress"
    for t in range(8, 12):
        msgs += step(t)
    eng.process(body(msgs), CHAT, H, render=True)
    cut = msgs[:1] + msgs[1 + 2 * 8 + 2:]  # the host drops everything up to the compress call
    res = eng.process(body(cut), CHAT, H, render=True)
    out = json.loads(res.body if res.body is not None else body(cut))["messages"]
    calls = [c["function"] for m in out if m.get("tool_calls") for c in m["tool_calls"]]
    assert [c["name"] for c in calls] == ["sh"] * 4 and [c["arguments"] for c in calls] == [f'{{"t":{t}}}' for t in range(8, 12)]
    assert [m["content"].split(" ")[0] for m in out if m["role"] == "tool"] == [f"file-{t}" for t in range(8, 12)]
    eng.store.close()
