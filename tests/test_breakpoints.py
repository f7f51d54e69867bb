"""The free Anthropic cache breakpoint at the end of the folded head (kernel/breakpoints.py)."""

from __future__ import annotations

import json

from bili_addon.kernel import breakpoints
from bili_addon.kernel.cache import Cache, Segment, anthropic_rules, chain
from tests.test_fold import agent_answers_unknown, conversation, refs_in, roundtrip_call
from tests.test_fold import engine as engine  # noqa: F401  (the fixture)
from bili_addon.wire import LANES

ANTH = LANES["anthropic"]
H = {"x-claude-code-session-id": "bp-1"}
EPH = {"type": "ephemeral"}


def cc_body(msgs: list[dict], ttl: str | None = None) -> bytes:
    """Claude Code's shape: two breakpoints in system, one on the last message."""
    cc = {**EPH, "ttl": ttl} if ttl else EPH
    msgs = [dict(m) for m in msgs]
    last = msgs[-1]
    blocks = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    msgs[-1] = {**last, "content": blocks[:-1] + [{**blocks[-1], "cache_control": cc}]}
    return json.dumps({"model": "claude-x", "max_tokens": 100,
                       "system": [{"type": "text", "text": "You are an agent.", "cache_control": cc},
                                  {"type": "text", "text": "Be careful.", "cache_control": cc}],
                       "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
                       "messages": msgs}).encode()


def fold(engine, body_fn):
    msgs = conversation(8)
    first = json.loads(engine.process(body_fn(msgs), ANTH, H, render=True).body)
    refs = refs_in(first)
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4", "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(engine, "bp-1", "compress", args, "toolu_c1")
    nxt = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    return nxt, engine.process(body_fn(nxt), ANTH, H, render=True)


def marked(payload: dict) -> list[int]:
    return [i for i, m in enumerate(payload["messages"]) if isinstance(m["content"], list)
            and any("cache_control" in b for b in m["content"])]


def test_the_summary_gets_the_free_breakpoint_and_keeps_it(engine):  # noqa: F811
    nxt, res = fold(engine, cc_body)
    out = json.loads(res.body)
    at = marked(out)
    assert len(at) == 2 and at[-1] == len(out["messages"]) - 1  # the agent's own stays on the last message
    head = out["messages"][at[0]]
    assert "[Compressed conversation section b1" in json.dumps(head)
    assert res.body.count(b'"cache_control"') == 4
    # the next turn: the same place, the same bytes up to it
    later = nxt + [{"role": "assistant", "content": [{"type": "text", "text": "Going on."}]},
                   {"role": "user", "content": "Next task."}]
    out2 = json.loads(engine.process(cc_body(later), ANTH, H, render=True).body)
    assert marked(out2)[0] == at[0] and out2["messages"][at[0]] == head


def test_no_free_slot_no_breakpoints_or_lifetimes_nothing_added(engine):  # noqa: F811
    def no_cc(msgs):
        return json.dumps({"model": "claude-x", "max_tokens": 100, "system": "s",
                           "tools": [{"name": "Bash", "input_schema": {}}], "messages": msgs}).encode()

    _, res = fold(engine, no_cc)
    assert b'"cache_control"' not in res.body  # an agent that sets none has not asked for caching
    items = [b'{"role":"user","content":[{"type":"text","text":"[Compressed conversation section b1 x"}]}',
             b'{"role":"user","content":"go"}']
    assert not breakpoints.mark_head("anthropic", list(items), 0, b'"cache_control"' * 4)
    assert not breakpoints.mark_head("anthropic", list(items), 0, b'"cache_control" "ttl"')
    assert not breakpoints.mark_head("chat", list(items), 0, b'"cache_control"')
    got = list(items)
    assert breakpoints.mark_head("anthropic", got, 0, b'"cache_control"')
    assert json.loads(got[0])["content"][0]["cache_control"] == EPH and got[1] == items[1]


def test_the_head_breakpoint_is_on_bilis_summary_never_on_a_message_quoting_it():
    """The model's thinking quoting a summary's header (an answer interrupted while it thought: a message
    of a thinking block alone), a tool's output grepping a log: the mark went on the last such message,
    a thinking block (Anthropic refuses the body) or a later message than the folded head."""
    summary = b'{"role":"user","content":[{"type":"text","text":"[Compressed conversation section b1 \\u00b7 x]\\nsum"}]}'
    items = [summary,
             b'{"role":"assistant","content":[{"type":"text","text":"On."},{"type":"tool_use","id":"t1","name":"Bash","input":{}}]}',
             b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"log: [Compressed conversation section b9"}]}',
             b'{"role":"assistant","content":[{"type":"thinking","thinking":"The [Compressed conversation section b1 says","signature":"s"}]}',
             b'{"role":"user","content":[{"type":"text","text":"continue"}]}']
    got = list(items)
    assert breakpoints.mark_head("anthropic", got, 0, b'"cache_control"')
    assert [i for i, it in enumerate(got) if b"cache_control" in it] == [0]
    assert json.loads(got[0])["content"][0]["cache_control"] == EPH and got[1:] == items[1:]


def test_the_head_entry_is_read_by_the_next_fold():
    """Hand-worked: without the head breakpoint a fold after the head writes the head again."""
    r = anthropic_rules("claude-sonnet-4-5")

    def segs(names, sizes, bps):
        return chain([Segment(n, 300.0 if i in bps else None) for i, n in enumerate(sizes)],
                     [x.encode() for x in names])

    # system 2000 | head (summary) 1500 | work 3000 (last message marked)
    c = Cache(r)
    c.send_segments(segs(["sys", "head", "w1"], [2000, 1500, 3000], {0, 1, 2}), now=0)
    # a later turn reads the whole prefix (and refreshes the head entry too)
    c.send_segments(segs(["sys", "head", "w1", "w2"], [2000, 1500, 3000, 500], {0, 1, 3}), now=200)
    # the next fold replaces w1.. by a second summary: the head entry is still warm at 400 s
    bill = c.send_segments(segs(["sys", "head", "s2", "w3"], [2000, 1500, 100, 400], {0, 1, 3}), now=400)
    assert bill.read == 3500 and bill.write == 500
    plain = Cache(r)
    plain.send_segments(segs(["sys", "head", "w1"], [2000, 1500, 3000], {0, 2}), now=0)
    plain.send_segments(segs(["sys", "head", "w1", "w2"], [2000, 1500, 3000, 500], {0, 3}), now=200)
    bill = plain.send_segments(segs(["sys", "head", "s2", "w3"], [2000, 1500, 100, 400], {0, 3}), now=400)
    assert bill.read == 2000 and bill.write == 2000
