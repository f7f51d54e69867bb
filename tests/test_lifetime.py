"""The cache lifetime decision (kernel/lifetime.py): 5 minutes or 1 hour, from the session's gaps."""

from __future__ import annotations

import json

from bili_addon.kernel import lifetime
from bili_addon.kernel.cache import anthropic_rules
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

R = anthropic_rules("claude-sonnet-4-5")


def test_choose_hand_worked():
    # a tool loop: every gap seconds long; 5m never misses, 1h only costs more per write
    loop = lifetime.choose([5.0] * 10, context=50_000, new_per_turn=2_000, rules=R)
    assert loop.choice == "5m" and loop.cost_5m == 1.25 * 2_000 and loop.cost_1h == 2.0 * 2_000
    # every other gap a 10-minute pause: 5m rewrites the context 5 times in 10 requests
    pauses = lifetime.choose([5.0, 600.0] * 5, context=50_000, new_per_turn=2_000, rules=R)
    assert pauses.cost_5m == (5 * 1.15 * 50_000 + 10 * 1.25 * 2_000) / 10
    assert pauses.cost_1h == 2.0 * 2_000
    assert pauses.choice == "1h"
    # pauses over an hour: neither keeps it, and 1h writes cost more
    assert lifetime.choose([5.0, 4000.0] * 5, context=50_000, new_per_turn=2_000, rules=R).choice == "5m"
    assert lifetime.choose([600.0] * 3, context=50_000, new_per_turn=2_000, rules=R) is None  # too few gaps


def test_upgrade_every_agent_breakpoint_and_nothing_else():
    body = (b'{"system":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}],'
            b'"messages":[{"role":"user","content":[{"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]}]}')
    out = lifetime.upgrade(body)
    doc = json.loads(out)
    assert doc["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert doc["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert out.replace(b',"ttl":"1h"', b"") == body  # nothing else moved
    assert lifetime.upgrade(out) is None  # the agent (or bili) asks for lifetimes already
    assert lifetime.upgrade(b'{"messages":[]}') is None


def _body(n: int) -> bytes:
    msgs = [{"role": "user", "content": "Start."}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": f"Answer {i}."}, {"role": "user", "content": f"Question {i}."}]
    msgs[-1] = {"role": "user", "content": [{"type": "text", "text": msgs[-1]["content"],
                                             "cache_control": {"type": "ephemeral"}}]}
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 64,
                       "tools": [{"name": "shell", "input_schema": {}}],
                       "system": [{"type": "text", "text": "sys " * 2000, "cache_control": {"type": "ephemeral"}}],
                       "messages": msgs}).encode()


def test_a_session_that_keeps_pausing_switches_to_one_hour_at_a_cold_moment(tmp_path):
    eng = Engine(Store(tmp_path / "data"), activate="always")
    t = {"now": 0.0}
    eng.now = lambda: t["now"]
    h = {"x-claude-code-session-id": "pauses"}
    sent = []
    for n in range(12):
        t["now"] += 5.0 if n % 2 else 600.0  # a human who thinks ten minutes every other turn
        res = eng.process(_body(n), LANES["anthropic"], h, render=True)
        agreed = eng.clocks.stats("pauses")["turns"][-1]["predicted_read"]
        eng.clocks.report("pauses", read=agreed)  # the answer came; the provider read what the model says
        sent.append(res.body)
    flag = eng.sessions["pauses"].flags["ttl"]
    assert flag["choice"] == "1h" and flag["cost_1h"] < flag["cost_5m"]
    first = next(k for k, b in enumerate(sent) if b'"ttl":"1h"' in b)
    assert first >= lifetime.MIN_GAPS and first % 2 == 0  # decided after a pause (a cold moment)
    assert all(b'"ttl":"1h"' in b for b in sent[first:])  # and kept
    assert sent[first].count(b'"ttl":"1h"') == 2  # both of the agent's breakpoints, none added
    eng.store.close()


def test_a_tool_loop_keeps_five_minutes(tmp_path):
    eng = Engine(Store(tmp_path / "data"), activate="always")
    t = {"now": 0.0}
    eng.now = lambda: t["now"]
    h = {"x-claude-code-session-id": "loop"}
    for n in range(12):
        t["now"] += 5.0
        res = eng.process(_body(n), LANES["anthropic"], h, render=True)
        assert b'"ttl"' not in res.body
    t["now"] += 900  # a cold moment: decided, and 5 minutes it stays
    eng.process(_body(12), LANES["anthropic"], h, render=True)
    assert eng.sessions["loop"].flags["ttl"]["choice"] == "5m"
    eng.store.close()
