"""Folding on every lane, tiers, spent compress calls, nudges and emergency truncation."""

from __future__ import annotations

import json
import re

import pytest
from churn import strings

from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.turn import Engine
from bili_addon.stream import ResponseRewriter
from bili_addon.wire import LANES

TAG = re.compile(r'^<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n(.*)', re.DOTALL)
H = {"x-acp-session": "lanes"}
ROW = " ".join(f"row-{i}" for i in range(200))


def summary(n: int) -> str:
    return f"Summary {n}: modules were read, nothing to change, the parser lives in src/parse.py."


class Chat:
    lane = LANES["chat"]

    def __init__(self):
        self.msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "audit please"}]

    def step(self, t):
        self.msgs += [
            {"role": "assistant", "content": f"Step {t}.", "tool_calls": [
                {"id": f"c{t}", "type": "function", "function": {"name": "sh", "arguments": f'{{"t":{t}}}'}}]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": f"file-{t} {ROW}"},
        ]

    def proxy_call(self, cid, name, args):
        self.msgs += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": f"Tool {name} not found"},
        ]

    def body(self):
        return json.dumps({"model": "gpt-x", "messages": self.msgs,
                           "tools": [{"type": "function", "function": {"name": "sh", "parameters": {}}}]}).encode()

    @staticmethod
    def check(out):
        msgs = out["messages"]
        assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("agent\n\n---\n\n# Context folding")
        open_calls = set()
        for m in msgs:
            if m["role"] == "tool":
                assert m["tool_call_id"] in open_calls
                open_calls.discard(m["tool_call_id"])
            else:
                assert not open_calls, "a tool call without its result"
            for c in m.get("tool_calls") or []:
                open_calls.add(c["id"])
        return msgs[-1]["content"]


class Responses:
    lane = LANES["responses"]

    def __init__(self):
        self.items = [{"type": "message", "role": "developer", "content": "agent"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "audit"}]}]

    def step(self, t):
        self.items += [
            {"type": "reasoning", "id": f"rs_{t}", "summary": [], "encrypted_content": f"enc{t}"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {t}."}]},
            {"type": "function_call", "id": f"fc_{t}", "call_id": f"c{t}", "name": "sh", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"c{t}", "output": f"file-{t} {ROW}"},
        ]

    def proxy_call(self, cid, name, args):
        self.items += [
            {"type": "function_call", "call_id": cid, "name": name, "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": cid, "output": f"unsupported call: {name}"},
        ]

    def body(self):
        return json.dumps({"model": "gpt-5", "input": self.items,
                           "tools": [{"type": "function", "name": "sh", "parameters": {}}]}).encode()

    @staticmethod
    def check(out):
        items = out["input"]
        calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
        outs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
        assert calls == outs
        for k, i in enumerate(items):
            if i.get("type") == "reasoning":
                assert items[k + 1].get("type") != "message" or items[k + 1]["role"] == "assistant"
        return items[-1]["output"]


class Gemini:
    lane = LANES["gemini"]

    def __init__(self):
        self.contents = [{"role": "user", "parts": [{"text": "audit"}]}]

    def step(self, t):
        self.contents += [
            {"role": "model", "parts": [{"text": f"Step {t}."}, {"functionCall": {"id": f"c{t}", "name": "sh", "args": {}}}]},
            {"role": "user", "parts": [{"functionResponse": {"id": f"c{t}", "name": "sh",
                                                             "response": {"out": f"file-{t} {ROW}"}}}]},
        ]

    def proxy_call(self, cid, name, args):
        self.contents += [
            {"role": "model", "parts": [{"functionCall": {"id": cid, "name": name, "args": args}}]},
            {"role": "user", "parts": [{"functionResponse": {"id": cid, "name": name, "response": {"error": "unknown"}}}]},
        ]

    def body(self):
        return json.dumps({"contents": self.contents, "systemInstruction": {"parts": [{"text": "agent"}]},
                           "tools": [{"functionDeclarations": [{"name": "sh"}]}]}).encode()

    @staticmethod
    def check(out):
        names = [d["name"] for t in out["tools"] for d in t["functionDeclarations"]]
        assert names == ["sh", "compress", "decompress", "search_context", "acp_status"]
        ids_call = {p["functionCall"]["id"] for c in out["contents"] for p in c["parts"] if "functionCall" in p}
        ids_resp = {p["functionResponse"]["id"] for c in out["contents"] for p in c["parts"] if "functionResponse" in p}
        assert ids_call == ids_resp
        return out["contents"][-1]["parts"][0]["functionResponse"]["response"]["content"]


@pytest.fixture
def engine(backend):
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    yield e
    e.store.close()


def refs_of(out: bytes) -> dict[str, str]:
    """The first words of each tagged prose text -> its ref."""
    return {m.group(2)[:7]: m.group(1) for s in strings(json.loads(out)) if (m := TAG.match(s))}


@pytest.mark.parametrize("conv_cls", [Chat, Responses, Gemini])
def test_compress_round_on_every_lane(engine, conv_cls):
    conv = conv_cls()
    for t in range(8):
        conv.step(t)
    refs = refs_of(engine.process(conv.body(), conv.lane, H, render=True).body)
    args = {"content": [{"startId": refs["Step 1."], "endId": refs["Step 4."], "summary": summary(1)}]}
    cid = "call_fold"
    key = cid
    engine.record_calls("lanes", [(key, "compress", json.dumps(args))])
    conv.proxy_call(cid, "compress", args)
    res = engine.process(conv.body(), conv.lane, H, render=True)
    text = res.body.decode()
    assert res.executed == ["compress"]
    assert "[Compressed conversation section b1" in text
    for t in range(1, 5):
        assert f"file-{t} row" not in text
    for t in (0, 5, 6, 7):
        assert f"file-{t} row" in text
    result = conv.check(json.loads(res.body))
    assert result.startswith("Compressed m") and "→ b1" in result
    assert engine.process(conv.body(), conv.lane, H, render=True).body == res.body


def fold_two_ranges(engine, call_id: str) -> tuple[Chat, dict]:
    """Twelve steps, then one compress call folding steps 0-2 and 3-5 (b1, b2): the conversation
    and the upstream body that carries the fold."""
    conv = Chat()
    for t in range(12):
        conv.step(t)
    refs = refs_of(engine.process(conv.body(), conv.lane, H, render=True).body)
    args = {"content": [{"startId": refs["Step 0."], "endId": refs["Step 2."], "summary": summary(1)},
                        {"startId": refs["Step 3."], "endId": refs["Step 5."], "summary": summary(2)}]}
    engine.record_calls("lanes", [(call_id, "compress", json.dumps(args))])
    conv.proxy_call(call_id, "compress", args)
    return conv, json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)


def test_blocks_distil_into_a_higher_tier_and_spent_calls_leave(engine):
    conv, out = fold_two_ranges(engine, "k1")
    text = json.dumps(out)
    assert "section b1" in text and "section b2" in text
    distil = {"content": [{"startId": "b1", "endId": "b2", "summary": summary(3), "topic": "modules 0-5"}]}
    engine.record_calls("lanes", [("k2", "compress", json.dumps(distil))])
    conv.proxy_call("k2", "compress", distil)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    text = json.dumps(out["messages"])
    assert "section b3" in text and "modules 0-5" in text
    assert "section b1" not in text and "section b2" not in text
    assert "(tier 2, absorbing b1, b2)" in out["messages"][-1]["content"]
    # the first compress call made b1 and b2, both now distilled: its call and result are gone
    assert not any(c["id"] == "k1" for m in out["messages"] for c in (m.get("tool_calls") or []))
    Chat.check(out)
    engine.record_calls("lanes", [("k3", "decompress", json.dumps({"blockId": "b3"}))])
    conv.proxy_call("k3", "decompress", {"blockId": "b3"})
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    one_up = out["messages"][-1]["content"]
    assert one_up.startswith("b3 (tier 2) replaced the 2 block(s) it distilled")
    assert "section b1" in one_up and "file-0 row" not in one_up
    engine.record_calls("lanes", [("k4", "decompress", json.dumps({"blockId": "b3", "full": True}))])
    conv.proxy_call("k4", "decompress", {"blockId": "b3", "full": True})
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert "file-0 row-0 row-1" in out["messages"][-1]["content"]


def test_acp_status_reports_blocks_and_ranges(engine):
    conv = Chat()
    for t in range(10):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    engine.record_calls("lanes", [("s1", "acp_status", "{}")])
    conv.proxy_call("s1", "acp_status", {})
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    status = out["messages"][-1]["content"]
    assert status.startswith("Context: ~") and "Blocks: 0 active of 0." in status
    assert re.search(r"Compressible ranges \(oldest first\):\n  m\d{5}–m\d{5}  \d+ messages", status)


def usage(engine, sid, tokens):
    engine.store.record_usage(sid, "chat", (tokens, 0, 0, 10))


def reminder_cfg(engine, batch=2000, regrowth=1000, distil=10_000):
    engine.nudge_cfg = NudgeConfig(batch_tokens=batch, regrowth_tokens=regrowth, distil_tokens=distil)


def test_nudge_lands_on_the_newest_user_turn_and_stays(engine):
    reminder_cfg(engine)
    conv = Chat()
    for t in range(4):
        conv.step(t)
    conv.msgs.append({"role": "user", "content": "look around"})
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert "[bili]" not in out["messages"][-1]["content"]  # too little to be worth a fold
    conv.msgs.append({"role": "assistant", "content": "ok"})
    for t in range(4, 10):
        conv.step(t)
    conv.msgs.append({"role": "user", "content": "what next?"})
    usage(engine, "lanes", 4_000)
    first = engine.process(conv.body(), conv.lane, H, render=True).body
    last = json.loads(first)["messages"][-1]["content"]
    assert re.search(r"what next\?\n\n\[bili\] ~[\d.]+K tokens of older work can be folded", last)
    assert re.search(r"\n  m\d{5}–m\d{5}  \d+ messages  ~", last) and "Compressible" not in last
    # later turns keep the same bytes for that message, and nothing else gets a reminder
    conv.msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "continue"}]
    usage(engine, "lanes", 4_100)
    later = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)["messages"]
    assert later[-3]["content"] == last
    assert "[bili]" not in later[-1]["content"]


def test_reminders_follow_the_foldable_work_not_the_window(engine):
    """A fold pays for the cache rewrite it causes once enough older work has piled up; how full
    the window is does not matter until the pressure band."""
    reminder_cfg(engine, batch=3000)
    engine.window = 1_000_000
    conv = Chat()
    for t in range(6):  # ~2K foldable tokens: not worth a fold
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 600_000)  # well into the window, below the pressure band
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert not any("[bili]" in json.dumps(m) for m in out["messages"][1:])
    for t in range(6, 16):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 5_000)  # a small share of the window, but ~4K foldable tokens
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert out["messages"][-1]["content"].startswith("[bili] ~")
    # the pressure band reminds whatever the amount
    small = Chat()
    for t in range(6):
        small.step(t)
    h = {"x-acp-session": "small"}
    engine.process(small.body(), small.lane, h, render=True)
    engine.store.record_usage("small", "chat", (800_000, 0, 0, 10))
    out = json.loads(engine.process(small.body(), small.lane, h, render=True).body)
    assert out["messages"][-1]["content"].startswith("[bili] The context is nearly full")


def test_after_a_fold_reminders_count_growth_from_the_smaller_context(engine):
    reminder_cfg(engine, batch=2000, regrowth=1500)
    conv = Chat()
    for t in range(10):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 40_000)
    out = engine.process(conv.body(), conv.lane, H, render=True).body
    note = json.loads(out)["messages"][-1]["content"]
    start, end = re.search(r"(m\d{5})–(m\d{5})", note).groups()
    args = {"content": [{"startId": start, "endId": end, "summary": summary(1)}]}
    engine.record_calls("lanes", [("f1", "compress", json.dumps(args))])
    conv.proxy_call("f1", "compress", args)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert "section b1" in json.dumps(out["messages"])
    usage(engine, "lanes", 3_000)  # the fold shrank the context far below where the reminder was given
    for t in range(10, 22):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 7_000)  # grew again, still far below 40K: a new reminder all the same
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    again = out["messages"][-1]["content"]
    assert again.startswith("[bili] ~")
    Chat.check(out)

    def reminders(msgs):
        return [m["content"][:40] for m in msgs if isinstance(m["content"], str) and m["content"].startswith("[bili]")]

    assert len(reminders(out["messages"])) == 2
    # folding the range the second reminder offers takes the first reminder along with the
    # message it followed
    start, end = re.search(r"(m\d{5})–(m\d{5})", again).groups()
    args = {"content": [{"startId": start, "endId": end, "summary": summary(2)}]}
    engine.record_calls("lanes", [("f2", "compress", json.dumps(args))])
    conv.proxy_call("f2", "compress", args)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert "section b2" in json.dumps(out["messages"]) and "file-9 row" not in json.dumps(out["messages"])
    assert reminders(out["messages"]) == [again[:40]]
    Chat.check(out)


def test_piled_up_summaries_are_offered_for_distilling(engine):
    reminder_cfg(engine, batch=50_000, distil=40)
    conv, _ = fold_two_ranges(engine, "f1")
    conv.step(12)
    usage(engine, "lanes", 5_000)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    note = out["messages"][-1]["content"]
    assert note.startswith("[bili] The summaries have piled up")
    assert re.search(r"\n  b1–b2  2 summaries  ~\d+ tokens \(distil them into one\)", note)
    # what is foldable goes along: the distil rewrites the cache from b1 on anyway
    assert re.search(r"\n  m\d{5}–m\d{5}  \d+ messages  ~", note)
    # acp_status says the same
    engine.record_calls("lanes", [("st", "acp_status", "{}")])
    conv.proxy_call("st", "acp_status", {})
    status = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)["messages"][-1]["content"]
    assert "Summaries worth distilling into one: b1–b2  2 summaries" in status
    assert re.search(r"Compressible ranges \(oldest first\):\n  m\d{5}–m\d{5}  \d+ messages", status)


def test_a_fold_reminder_offers_the_pile_along_and_one_call_distils_it_with_the_fold(engine):
    """A fold rewrites the cache after its start anyway: the summaries before it are offered for
    distilling in the same reminder from a small pile (distil_along_tokens), far below the size
    that calls for a distil on its own; one compress call does both."""
    conv, _ = fold_two_ranges(engine, "f1")
    for t in range(12, 20):
        conv.step(t)
    engine.nudge_cfg = NudgeConfig(batch_tokens=2000, regrowth_tokens=1000, distil_tokens=10_000,
                                   distil_along_tokens=10_000)
    usage(engine, "lanes", 8_000)
    alone = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)["messages"][-1]["content"]
    assert alone.startswith("[bili] ~") and "distil" not in alone  # a pile below the threshold: the fold alone
    # the model lets it pass; the next reminder, with the pile's threshold lowered, offers the pile along
    conv.msgs += [{"role": "assistant", "content": "Going on."}, {"role": "user", "content": "continue"}]
    conv.step(20)
    engine.nudge_cfg = NudgeConfig(batch_tokens=2000, regrowth_tokens=1000, distil_tokens=10_000,
                                   distil_along_tokens=30)
    usage(engine, "lanes", 9_500)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    note = out["messages"][-1]["content"]
    lines = note.splitlines()
    assert lines[0].startswith("[bili] ~")
    assert re.match(r"  b1–b2  2 summaries  ~\d+ tokens \(distil them into one\)$", lines[1])  # oldest first
    start, end = re.match(r"  (m\d{5})–(m\d{5})  \d+ messages", lines[2]).groups()
    args = {"content": [{"startId": "b1", "endId": "b2", "summary": summary(3)},
                        {"startId": start, "endId": end, "summary": summary(4)}]}
    engine.record_calls("lanes", [("f2", "compress", json.dumps(args))])
    conv.proxy_call("f2", "compress", args)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    result = out["messages"][-1]["content"]
    assert "→ b3 (tier 2, absorbing b1, b2)" in result and "→ b4 (tier 1)" in result
    text = json.dumps(out["messages"])
    assert "section b1" not in text and "section b2" not in text
    assert text.index("section b3") < text.index("section b4")
    Chat.check(out)


def test_nudge_after_a_tool_result_is_its_own_user_item(engine):
    engine.window = 100_000
    conv = Chat()
    for t in range(10):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 90_000)  # pressure
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert out["messages"][-1]["role"] == "user"
    assert out["messages"][-1]["content"].startswith("[bili] The context is nearly full")
    assert out["messages"][-2]["role"] == "tool"


def test_emergency_truncation_cuts_old_outputs_and_keeps_them_cut(engine):
    engine.window = 100_000
    conv = Chat()
    for t in range(10):
        conv.step(t)
        conv.msgs[-1]["content"] = f"file-{t} " + "x" * 12_000 + " END"
    engine.process(conv.body(), conv.lane, H, render=True)
    usage(engine, "lanes", 97_000)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    tools = [m["content"] for m in out["messages"] if m["role"] == "tool"]
    cut = [c for c in tools if "were cut by bili" in c]
    assert cut and all(c.startswith("file-") and c.endswith(" END") for c in cut)
    assert "were cut by bili" not in tools[-1]  # the newest output is in the protected zone
    usage(engine, "lanes", 40_000)  # context shrank: what was cut stays cut, byte for byte
    again = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert [m["content"] for m in again["messages"] if m["role"] == "tool"] == tools


def steps_with_results(n: int = 10) -> list[dict]:
    """An Anthropic history: the user's request, then ``n`` steps of prose and a tool call with its result."""
    msgs = [{"role": "user", "content": "audit please"}]
    for t in range(n):
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": f"Step {t}."},
                                                   {"type": "tool_use", "id": f"t{t}", "name": "sh", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{t}",
                                               "content": f"file-{t} {ROW}"}]}]
    return msgs


def test_on_anthropic_a_reminder_after_tool_results_joins_their_user_turn(engine):
    """The way Claude Code adds its own reminders: a text block after the tool_result blocks, so
    the conversation keeps alternating user and assistant turns."""
    reminder_cfg(engine)
    lane = LANES["anthropic"]
    msgs = steps_with_results()

    def body():
        return json.dumps({"model": "claude-x", "max_tokens": 9, "messages": msgs,
                           "tools": [{"name": "sh", "input_schema": {"type": "object"}}]}).encode()

    engine.process(body(), lane, H, render=True)
    usage(engine, "lanes", 5_000)
    first = json.loads(engine.process(body(), lane, H, render=True).body)["messages"]
    assert len(first) == len(msgs)
    last = first[-1]["content"]
    assert [b["type"] for b in last] == ["tool_result", "text"] and last[1]["text"].startswith("[bili] ~")
    assert last[0] == msgs[-1]["content"][0]
    # the next turn: the agent replays that message as it sent it; the reminder is there again, unchanged
    msgs += [{"role": "assistant", "content": [{"type": "text", "text": "Going on."}]},
             {"role": "user", "content": "and now?"}]
    usage(engine, "lanes", 5_100)
    later = json.loads(engine.process(body(), lane, H, render=True).body)["messages"]
    assert later[len(first) - 1]["content"] == last
    roles = [m["role"] for m in later]
    assert all(a != b for a, b in zip(roles, roles[1:])) and len(later) == len(msgs)


def test_without_reported_usage_the_conversations_own_size_decides(engine):
    """A Chat stream without include_usage reports nothing; the reminder still comes."""
    reminder_cfg(engine)
    conv = Chat()
    for t in range(10):
        conv.step(t)
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    assert out["messages"][-1]["content"].startswith("[bili] ~")
    assert engine.store.usage("lanes").last is None


def test_on_chat_summaries_join_the_user_turn_so_roles_alternate(engine):
    """Two blocks in a row after the task: both join the task's user message (strict providers
    refuse successive user messages); everything else keeps its bytes."""
    _, out = fold_two_ranges(engine, "j1")
    msgs = out["messages"]
    roles = [m["role"] for m in msgs if m["role"] != "tool"]
    assert all(not (a == b == "user") for a, b in zip(roles, roles[1:])), roles
    task = msgs[1]["content"]
    assert task.index("audit please") < task.index("section b1") < task.index("section b2")
    assert task.endswith(summary(2)) and msgs[2]["role"] == "assistant" and "Step 6." in msgs[2]["content"]
    Chat.check(out)


def test_chat_join_user_keeps_the_other_parts_byte_exact():
    lane = LANES["chat"]
    raw = b'{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}'
    joined = lane.join_user(raw, "S", before=False)
    assert joined == (b'{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":'
                      b'{"url":"x"}},{"type":"text","text":"S"}]}')
    assert lane.join_user(b'{"role":"user","content":"q"}', "S", before=True) == b'{"role":"user","content":"S\\n\\nq"}'
    assert lane.join_user(b'{"role":"assistant","content":"a"}', "S", before=False) is None
    assert lane.join_user(b'{"role":"tool","tool_call_id":"c","content":"r"}', "S", before=False) is None
    assert LANES["anthropic"].join_user(b'{"role":"user","content":"q"}', "S", before=False) is None


def test_gemini_call_without_id_or_args_runs_and_gets_its_result(engine):
    """gemini-cli style: the model's acp_status call has neither id nor args; the response path
    records it, the next request finds it, runs it and puts the real result in its response."""
    conv = Gemini()
    for t in range(3):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    answer = {"candidates": [{"content": {"role": "model", "parts": [{"functionCall": {"name": "acp_status"}}]},
                              "finishReason": "STOP"}]}
    rw = ResponseRewriter("gemini")
    rw.json_body(json.dumps(answer).encode())
    engine.record_calls("lanes", rw.calls)
    conv.contents += [
        {"role": "model", "parts": [{"functionCall": {"name": "acp_status"}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "acp_status",
                                                         "response": {"error": "Tool acp_status not found"}}}]},
    ]
    res = engine.process(conv.body(), conv.lane, H, render=True)
    assert res.executed == ["acp_status"]
    response = json.loads(res.body)["contents"][-1]["parts"][0]["functionResponse"]["response"]
    assert response["content"].startswith("Context: ~")


def test_an_id_given_again_to_the_agents_own_call_leaves_that_call_alone(engine):
    """A provider that numbers its calls per answer (``call_0``) gives an executed proxy call's id
    again, to a later call of the agent's own tool: that call went upstream renamed to ``compress``
    with compress's arguments, and its real output replaced by compress's result."""
    conv = Chat()
    for t in range(8):
        conv.step(t)
    refs = refs_of(engine.process(conv.body(), conv.lane, H, render=True).body)
    args = {"content": [{"startId": refs["Step 0."], "endId": refs["Step 2."], "summary": summary(1)}]}
    engine.record_calls("lanes", [("call_0", "compress", json.dumps(args))])
    conv.proxy_call("call_0", "compress", args)
    res = engine.process(conv.body(), conv.lane, H, render=True)
    assert res.executed == ["compress"]
    conv.msgs += [{"role": "assistant", "content": "Now listing.", "tool_calls": [
                      {"id": "call_0", "type": "function", "function": {"name": "sh", "arguments": '{"cmd":"ls"}'}}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "README.md  setup.py  src/"}]
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)["messages"]
    assert out[-2]["tool_calls"][0]["function"] == {"name": "sh", "arguments": '{"cmd":"ls"}'}
    assert out[-1]["content"] == "README.md  setup.py  src/"
    # the proxy call itself still shows its real result
    mine = next(m for m in out if m.get("role") == "tool" and m["content"].startswith("Compressed "))
    assert mine["tool_call_id"] == "call_0"


def test_gemini_spent_idless_calls_leave_with_their_responses(engine):
    """Failed compress calls beyond the newest two leave the wire; Gemini's have no ids, and their
    functionResponses stayed behind: user turns in a row answering nothing (a request Gemini
    refuses)."""
    from bili_addon.stream import ResponseRewriter

    conv = Gemini()
    for t in range(8):
        conv.step(t)
    engine.process(conv.body(), conv.lane, H, render=True)
    for n in range(4):
        parts = [{"functionCall": {"name": "compress", "args": {"content": [
            {"startId": f"m9999{n}", "endId": "m99999", "summary": "x" * 60}]}}}]
        rw = ResponseRewriter("gemini")
        rw.json_body(json.dumps({"candidates": [{"content": {"role": "model", "parts": parts},
                                                 "finishReason": "STOP"}]}).encode())
        engine.record_calls("lanes", rw.calls)
        conv.contents += [{"role": "model", "parts": parts},
                          {"role": "user", "parts": [{"functionResponse": {"name": "compress",
                                                                           "response": {"error": "unknown"}}}]}]
        res = engine.process(conv.body(), conv.lane, H, render=True)
    out = json.loads(res.body)["contents"]
    calls = [p for c in out for p in c["parts"] if p.get("functionCall", {}).get("name") == "compress"]
    answers = [p for c in out for p in c["parts"] if p.get("functionResponse", {}).get("name") == "compress"]
    assert len(calls) == len(answers) == 2
    roles = [c["role"] for c in out]
    assert all(a != b for a, b in zip(roles, roles[1:])), roles  # no two turns of one role in a row


def test_gemini_two_idless_calls_of_one_tool_get_each_its_own_result(engine):
    """Two decompress calls without ids in one answer: their responses, in one user turn, both got
    the last call's result (every response of the tool was rewritten with each result in turn)."""
    from bili_addon.stream import ResponseRewriter

    conv = Gemini()
    for t in range(12):
        conv.step(t)
    refs = refs_of(engine.process(conv.body(), conv.lane, H, render=True).body)
    args = {"content": [{"startId": refs["Step 0."], "endId": refs["Step 2."], "summary": "FIRST: " + summary(1)},
                        {"startId": refs["Step 3."], "endId": refs["Step 5."], "summary": "SECOND: " + summary(2)}]}
    engine.record_calls("lanes", [("call_fold", "compress", json.dumps(args))])
    conv.proxy_call("call_fold", "compress", args)
    engine.process(conv.body(), conv.lane, H, render=True)
    parts = [{"functionCall": {"name": "decompress", "args": {"blockId": b}}} for b in ("b1", "b2")]
    rw = ResponseRewriter("gemini")
    rw.json_body(json.dumps({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP"}]}).encode())
    engine.record_calls("lanes", rw.calls)
    conv.contents += [{"role": "model", "parts": parts},
                      {"role": "user", "parts": [{"functionResponse": {"name": "decompress",
                                                                       "response": {"error": "unknown tool"}}}] * 2}]
    res = engine.process(conv.body(), conv.lane, H, render=True)
    assert res.executed == ["decompress", "decompress"]
    got = [p["functionResponse"]["response"]["content"] for p in json.loads(res.body)["contents"][-1]["parts"]]
    assert got[0].startswith("b1 ") and got[1].startswith("b2 ")


def test_an_error_cut_short_stays_an_error(engine):
    """Anthropic: the emergency truncation of the agent's own failed output (a failing test run) went
    through the edit that gives a proxy call its real result, which takes ``is_error`` off: the model
    was told the failed command had succeeded."""
    engine.window = 100_000
    lane = LANES["anthropic"]
    fail = "FAILED tests/test_x.py::test_y\n" + "Traceback line ...\n" * 1500 + "=== 37 failed, 2 passed ==="
    msgs = [{"role": "user", "content": "Run the tests."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_t", "name": "Bash",
                                               "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_t", "is_error": True,
                                          "content": fail}]}]
    for i in range(6):
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": f"step {i}"}]},
                 {"role": "user", "content": f"ok {i}"}]

    def body():
        return json.dumps({"model": "claude-x", "max_tokens": 9, "messages": msgs}).encode()

    engine.process(body(), lane, H, render=True)
    usage(engine, "lanes", 97_000)
    block = json.loads(engine.process(body(), lane, H, render=True).body)["messages"][2]["content"][0]
    assert "were cut by bili" in block["content"] and block["is_error"] is True


def test_gemini_cuts_the_one_response_it_chose(engine):
    """Gemini: two id-less calls of one tool and their responses in one content; the truncation of the
    big one was written into every response of that tool, the small one's replaced by the big one's
    head and tail (another call's result)."""
    engine.window = 100_000
    lane = LANES["gemini"]
    big = "BIG FILE a.py HEAD\n" + "def a(): return 1\n" * 3000 + "BIG FILE a.py TAIL"
    small = "small file b.py: x = 2"
    c = [{"role": "user", "parts": [{"text": "Start the task."}]},
         {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": {"path": "a.py"}}},
                                     {"functionCall": {"name": "read_file", "args": {"path": "b.py"}}}]},
         {"role": "user", "parts": [{"functionResponse": {"name": "read_file", "response": {"output": big}}},
                                    {"functionResponse": {"name": "read_file", "response": {"output": small}}}]}]
    for i in range(6):
        c += [{"role": "model", "parts": [{"text": f"step {i}"}]}, {"role": "user", "parts": [{"text": f"ok {i}"}]}]

    def body():
        return json.dumps({"contents": c}).encode()

    engine.process(body(), lane, H, render=True)
    usage(engine, "lanes", 97_000)
    parts = json.loads(engine.process(body(), lane, H, render=True).body)["contents"][2]["parts"]
    first, second = (json.dumps(p["functionResponse"]["response"]) for p in parts)
    assert "were cut by bili" in first and "BIG FILE a.py HEAD" in first
    assert second == json.dumps({"output": small})


def _reads(n: int, tail: str = "go on") -> bytes:
    """A session of ``n`` reads of ~9K tokens each, then the model's "ok" and the user's ``tail``."""
    msgs = [{"role": "user", "content": "Start."}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {"f": i}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": f"OUT {i}\n" + ("data %d\n" % i) * 5000}]}]
    msgs += [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": tail}]
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs}).encode()


def test_a_second_emergency_cut_cuts_more(engine):
    """The reported size counts the outputs cut before as cut, but their parts in the view hold their
    whole text: the next emergency (the context grown past 95% again) chose the same outputs, took
    their savings for enough and cut nothing more; the window then overflowed."""
    lane, body = LANES["anthropic"], _reads

    engine.process(body(19, "go on"), lane, H, render=True)
    usage(engine, "lanes", 192_000)  # 96% of 200K
    engine.process(body(19, "next"), lane, H, render=True)
    first = dict(engine.sessions["lanes"].flags["truncated"])
    usage(engine, "lanes", 193_000)  # past 95% again, the cuts counted as cut
    engine.process(body(21, "more"), lane, H, render=True)
    assert set(engine.sessions["lanes"].flags["truncated"]) - set(first)


def test_a_retry_before_the_next_answer_cuts_nothing_more(engine):
    """An SDK's retry of the same request (a 529, a timeout): no answer came, so the last report still
    counts the outputs the first attempt cut as whole, and each retry cut one more (other bytes for the
    same history, more of the agent's outputs lost than the emergency needed).  Cuts made since the last
    report count as cut until a newer one; a newer one past 95% again still cuts more."""
    lane, body = LANES["anthropic"], _reads

    engine.process(body(19), lane, H, render=True)
    usage(engine, "lanes", 192_000)  # 96% of 200K
    sent = [engine.process(body(19), lane, H, render=True).body for _ in range(3)]
    cut = sent[0].count(b"were cut by bili")
    assert 0 < cut < 19 and sent[1] == sent[0] == sent[2]
    usage(engine, "lanes", 192_500)  # the answer to the cut request: still past 95%
    assert engine.process(body(19), lane, H, render=True).body.count(b"were cut by bili") > cut


def test_the_newest_batch_of_results_is_never_cut(engine):
    """Chat: each result an item of its own, the recent zone 4 parts: the model's newest answer made
    five calls, and the first results of that batch (not read by the model yet) were cut."""
    lane = LANES["chat"]

    def body(batch: bool) -> bytes:
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Read the five modules."}]
        for i in range(3):
            msgs += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"old_{i}", "type": "function",
                      "function": {"name": "read", "arguments": json.dumps({"old": i})}}]},
                     {"role": "tool", "tool_call_id": f"old_{i}", "content": f"OLD {i}\n" + ("x%d = 1\n" % i) * 1500},
                     {"role": "assistant", "content": f"step {i}"}, {"role": "user", "content": f"ok {i}"}]
        if batch:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"f": i})}}
                for i in range(5)]})
            msgs += [{"role": "tool", "tool_call_id": f"call_{i}", "content": f"MODULE {i}\n" + ("def f%d(): pass\n" % i) * 1800}
                     for i in range(5)]
        return json.dumps({"model": "gpt-4o", "messages": msgs}).encode()

    engine.process(body(False), lane, H, render=True)
    usage(engine, "lanes", 122_000)  # 95.3% of gpt-4o's 128K
    msgs = json.loads(engine.process(body(True), lane, H, render=True).body)["messages"]
    cut = {m["tool_call_id"] for m in msgs if m.get("role") == "tool" and "were cut by bili" in (m.get("content") or "")}
    assert cut and all(c.startswith("old_") for c in cut)


def test_no_reminder_goes_into_an_assistants_prefill(engine):
    """A request that ends with the assistant's prefill (the model continues it): a reminder given as an
    item of its own after the newest item was joined into the prefill (Anthropic's list content)."""
    reminder_cfg(engine)
    lane = LANES["anthropic"]
    msgs = steps_with_results() + [{"role": "assistant", "content": [{"type": "text", "text": '{"answer":'}]}]

    def body():
        return json.dumps({"model": "claude-x", "max_tokens": 9, "messages": msgs,
                           "tools": [{"name": "sh", "input_schema": {"type": "object"}}]}).encode()

    engine.process(body(), lane, H, render=True)
    usage(engine, "lanes", 5_000)
    last = json.loads(engine.process(body(), lane, H, render=True).body)["messages"][-1]
    assert last["role"] == "assistant" and [b["text"] for b in last["content"]] == ['{"answer":']


def test_decompress_of_a_ref_inside_a_distil_gives_its_own_originals(engine):
    """A message's ref names that message: decompress of a ref a distil holds gives the originals of
    the innermost block that holds it, not the distil's blocks' summaries (a second call's worth)."""
    conv, out = fold_two_ranges(engine, "k1")
    distil = {"content": [{"startId": "b1", "endId": "b2", "summary": summary(3), "topic": "modules 0-5"}]}
    engine.record_calls("lanes", [("k2", "compress", json.dumps(distil))])
    conv.proxy_call("k2", "compress", distil)
    engine.process(conv.body(), conv.lane, H, render=True)
    s = engine.sessions["lanes"]
    b1 = next(b for b in s.blocks if b.id == "b1")
    ref = next(r for r in b1.covered if any("file-0 row" in row[5] for row in engine.store.originals("lanes", [r])))
    engine.record_calls("lanes", [("k3", "decompress", json.dumps({"blockId": ref}))])
    conv.proxy_call("k3", "decompress", {"blockId": ref})
    out = json.loads(engine.process(conv.body(), conv.lane, H, render=True).body)
    text = out["messages"][-1]["content"]
    assert text.startswith("b1 (tier 1) replaced original messages") and "file-0 row-0 row-1" in text
