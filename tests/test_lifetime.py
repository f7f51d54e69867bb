"""The cache lifetime decision (kernel/lifetime.py): 5 minutes or 1 hour, from the session's gaps."""

from __future__ import annotations

import json

import msgspec

import pytest

from bili_addon.kernel import cache, lifetime
from bili_addon.kernel.cache import anthropic_rules
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from tests.test_fold import agent_answers_unknown, conversation, filler, refs_in, roundtrip_call

R = anthropic_rules("claude-sonnet-4-5")


def test_choose_hand_worked():
    # a tool loop: every gap seconds long; 5m never misses, 1h only costs more per write
    loop = lifetime.choose([5.0] * 10, context=50_000, new_per_turn=2_000, rules=R)
    assert loop.choice == "5m" and loop.cost_5m == 1.25 * 2_000 and loop.cost_1h == 2.0 * 2_000
    assert loop.cost_head is None  # no head breakpoint: no third choice
    # every other gap a 10-minute pause: 5m rewrites the context 5 times in 10 requests, head only
    # the 30K after the 20K head; 1h nothing
    pauses = lifetime.choose([5.0, 600.0] * 5, context=50_000, new_per_turn=2_000, rules=R, head=20_000)
    assert pauses.cost_5m == pytest.approx(0.5 * 1.15 * 50_000 + 1.25 * 2_000)  # 31,250
    assert pauses.cost_head == pytest.approx(0.5 * 1.15 * 30_000 + 1.25 * 2_000)  # 19,750
    assert pauses.cost_1h == 2.0 * 2_000
    assert pauses.choice == "1h"
    # one pause in 20: the head pays, counting its growth (100 a request) and the switch (the head
    # written once at 2x instead of 1.25x, spread over 40 requests)
    rare = lifetime.choose([5.0] * 19 + [600.0], context=50_000, new_per_turn=2_000, rules=R, head=20_000,
                           head_growth=100, rest=40)
    assert rare.cost_5m == pytest.approx(0.05 * 1.15 * 50_000 + 1.25 * 2_000)  # 5,375
    assert rare.cost_1h == pytest.approx(2.0 * 2_000 + 0.75 * 50_000 / 40)  # 4,937.5
    assert rare.cost_head == pytest.approx(0.05 * 1.15 * 30_000 + 1.25 * 2_000 + 0.75 * 100 + 0.75 * 20_000 / 40)
    assert rare.choice == "head" and rare.to_flag()["head"] == 20_000  # 4,675
    # pauses over an hour: neither keeps it, and 1-hour writes cost more
    long = lifetime.choose([5.0] * 9 + [4000.0], context=50_000, new_per_turn=2_000, rules=R, head=20_000)
    assert long.cost_head == pytest.approx(0.1 * 1.15 * 30_000 + 0.1 * 1.9 * 20_000 + 1.25 * 2_000)  # 9,750
    assert long.cost_1h == pytest.approx(0.1 * 1.9 * 50_000 + 2.0 * 2_000)  # 13,500
    assert long.choice == "5m"  # 8,250
    assert lifetime.choose([600.0] * 3, context=50_000, new_per_turn=2_000, rules=R) is None  # too few gaps


def test_a_session_only_moves_to_longer_lifetimes(tmp_path):
    assert lifetime.keep(None, "head") == "head" and lifetime.keep("5m", "1h") == "1h"
    assert lifetime.keep("head", "5m") == "head" and lifetime.keep("1h", "head") == "1h"
    assert lifetime.keep("head", "1h") == "1h"
    # a session that keeps its head for an hour, then pauses for over an hour: 5 minutes would be
    # cheapest now, and the stats say so, but the head keeps its hour
    eng = Engine(Store(tmp_path / "data"), activate="always")
    t = {"now": 0.0}
    eng.now = lambda: t["now"]
    h = {"x-claude-code-session-id": "keep"}
    eng.process(_body(0), LANES["anthropic"], h, render=True)
    eng.set_flag("keep", "ttl", {"choice": "head"})
    for n in range(1, 12):
        t["now"] += 5.0 if n < 11 else 4_000.0
        res = eng.process(_body(n), LANES["anthropic"], h, render=True)
    flag = eng.sessions["keep"].flags["ttl"]
    assert flag["choice"] == "head" and flag["cheapest"] == "5m" and flag["gaps"] == 11
    assert res.body.count(b'"ttl":"1h"') == 1  # the system's breakpoint; the last message's keeps 5 minutes
    eng.store.close()


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


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


EPH = {"type": "ephemeral"}


def _folded_body(agent_bps: tuple[int, ...] = ()) -> bytes:
    """Claude Code's shape after a fold: two breakpoints in system, bili's on the summary (message 2),
    the agent's on the last message; ``agent_bps``: messages where the agent set more."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Audit the repo."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "On it."}]},
            {"role": "user", "content": [{"type": "text", "text": "[Compressed conversation section b1 · read 1-4]",
                                          "cache_control": EPH}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading 5."}]},
            {"role": "user", "content": [{"type": "text", "text": "module 5"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading 6."}]},
            {"role": "user", "content": [{"type": "text", "text": "module 6", "cache_control": EPH}]}]
    for i in agent_bps:
        msgs[i]["content"][-1]["cache_control"] = EPH
    return _compact({"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": msgs,
                     "system": [{"type": "text", "text": "a", "cache_control": EPH},
                                {"type": "text", "text": "b", "cache_control": EPH}],
                     "tools": [{"name": "shell", "input_schema": {}}]})


def _ttls(body: bytes) -> list[str | None]:
    """The lifetime each breakpoint asks for, in cache order (tools, system, messages)."""
    doc = json.loads(body)
    blocks = list(doc.get("tools", [])) + list(doc["system"])
    for m in doc["messages"]:
        blocks += m["content"] if isinstance(m["content"], list) else []
    return [b["cache_control"].get("ttl", "5m") for b in blocks if "cache_control" in b]


def test_upgrade_head_one_hour_up_to_the_summary_five_minutes_after():
    body = _folded_body()
    out = lifetime.upgrade_head(body)
    assert _ttls(out) == ["1h", "1h", "1h", "5m"]  # system, system, bili's on the summary; the last message
    assert out.replace(b',"ttl":"1h"', b"") == body  # nothing else moved, nothing added or dropped
    assert cache.ordered(cache.anthropic_segments(out))
    assert lifetime.head_tokens(out) == sum(s.tokens for s in cache.anthropic_segments(out)[:6])  # tools..summary
    assert lifetime.upgrade_head(out) is None  # asks for lifetimes already
    assert lifetime.apply(body, "head") == out and lifetime.apply(body, "5m") is None
    assert _ttls(lifetime.apply(body, "1h")) == ["1h"] * 4


def test_the_head_ends_at_bilis_summary_not_at_a_later_message_quoting_it():
    """A later message the agent marked that quotes the summary's header (a tool's output of a log, the
    model's own words) was taken for the head's end: its breakpoint, and every one before it, got an hour."""
    doc = json.loads(_folded_body(agent_bps=(4,)))
    doc["messages"][4]["content"] = [{"type": "tool_result", "tool_use_id": "t", "cache_control": EPH,
                                      "content": "grep: [Compressed conversation section b1 · read 1-4]"}]
    body = _compact(doc)
    out = lifetime.upgrade_head(body)
    assert _ttls(out) == ["1h", "1h", "1h", "5m", "5m"]
    top = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    items = [bytes(i) for i in msgspec.json.decode(top["messages"], type=list[msgspec.Raw])]
    assert lifetime.apply_parts(top, "messages", items) == (True, True)
    assert [b"1h" in i for i in items] == [False, False, True, False, False, False, False]


def test_upgrade_head_keeps_the_ordering_rule_whatever_the_agent_marked():
    # an agent breakpoint before the summary is part of the head; one after it (not the last
    # message) stays 5 minutes with the last one: every 1-hour breakpoint precedes every 5-minute one
    out = lifetime.upgrade_head(_folded_body(agent_bps=(0, 4)))
    assert _ttls(out) == ["1h", "1h", "1h", "1h", "5m", "5m"]
    assert cache.ordered(cache.anthropic_segments(out))
    # no summary yet (no fold): the system's breakpoints only
    doc = json.loads(_folded_body())
    doc["messages"][2]["content"] = [{"type": "text", "text": "Read 1-4: fine."}]
    plain = lifetime.upgrade_head(_compact(doc))
    assert _ttls(plain) == ["1h", "1h", "5m"] and cache.ordered(cache.anthropic_segments(plain))
    # a summary that is the last message: the agent's last breakpoint, never the head's
    doc = json.loads(_folded_body())
    doc["messages"] = doc["messages"][:3]
    assert _ttls(lifetime.upgrade_head(_compact(doc))) == ["1h", "1h", "5m"]
    # breakpoints only on messages and no summary: nothing to upgrade; an agent asking for lifetimes
    doc["system"] = "plain"
    assert lifetime.upgrade_head(_compact(doc)) is None
    assert lifetime.upgrade_head(_folded_body().replace(b'"ephemeral"}', b'"ephemeral","ttl":"5m"}', 1)) is None


def _body(n: int, size: int = 10) -> bytes:
    def text(t: str) -> list[dict]:
        return [{"type": "text", "text": t}]

    msgs = [{"role": "user", "content": text("Start.")}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": text(f"Answer {i}. " + "x" * size)},
                 {"role": "user", "content": text(f"Question {i}.")}]
    msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
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
        res = eng.process(_body(n, 2_000), LANES["anthropic"], h, render=True)
        agreed = eng.clocks.stats("pauses")["turns"][-1]["predicted_read"]
        eng.clocks.report("pauses", read=agreed)  # the answer came; the provider read what the model says
        sent.append(res.body)
    flag = eng.sessions["pauses"].flags["ttl"]
    # no fold, no summary: the head is the system prompt, and the growing conversation after it
    # would be written again after every pause
    assert flag["choice"] == "1h" and flag["cost_1h"] < flag["cost_head"] < flag["cost_5m"]
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
    t["now"] += 4_000  # a cold moment: decided (the pause that made it cold counts), and 5 minutes it
    res = eng.process(_body(12), LANES["anthropic"], h, render=True)  # stays: no entry outlives that pause
    assert eng.sessions["loop"].flags["ttl"]["choice"] == "5m" and b'"ttl"' not in res.body
    eng.store.close()


def cc_body(msgs: list[dict]) -> bytes:
    """Claude Code's shape: a ~12K-token system in two blocks with a breakpoint each, one on the last
    block of the last message."""
    msgs = [dict(m) for m in msgs]
    last = msgs[-1]
    blocks = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    msgs[-1] = {**last, "content": blocks[:-1] + [{**blocks[-1], "cache_control": EPH}]}
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100,
                       "system": [{"type": "text", "text": "You are Claude Code. " * 1200, "cache_control": EPH},
                                  {"type": "text", "text": "Be careful. " * 2000, "cache_control": EPH}],
                       "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
                       "messages": msgs}).encode()


def _step(msgs: list[dict], t: int) -> list[dict]:
    return msgs + [
        {"role": "assistant", "content": [{"type": "text", "text": f"Step {t}: reading module {t}."},
                                          {"type": "tool_use", "id": f"toolu_{t}", "name": "Bash",
                                           "input": {"cmd": f"cat mod{t}.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                      "content": filler(f"file-{t}")}]}]


def test_a_folding_session_that_pauses_now_and_then_keeps_its_head_for_an_hour(tmp_path):
    """After a fold the live tail is small and the head (system + summary) large: a pause rewrites
    only the tail with 1-hour entries on the head, and every turn's new tokens stay at 1.25x."""
    eng = Engine(Store(tmp_path / "data"), activate="always")
    t = {"now": 0.0}
    eng.now = lambda: t["now"]
    sid, h = "head-1", {"x-claude-code-session-id": "head-1"}

    def send(msgs: list[dict], gap: float) -> bytes:
        t["now"] += gap
        body = eng.process(cc_body(msgs), LANES["anthropic"], h, render=True).body
        eng.clocks.report(sid, read=eng.clocks.stats(sid)["turns"][-1]["predicted_read"])
        return body

    msgs = conversation(8)
    refs = refs_in(json.loads(send(msgs, 1.0)))
    start = next(r for r, x in refs.items() if x.startswith("Step 1:"))
    end = next(r for r, x in refs.items() if x.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4",
                         "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(eng, sid, "compress", args, "toolu_c1")
    msgs = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    sent = [send(msgs, 5.0)]
    assert b"[Compressed conversation section b1" in sent[0]
    for k in range(9, 40):
        msgs = _step(msgs, k)
        sent.append(send(msgs, 600.0 if k in (28, 36) else 5.0))  # a human pauses ten minutes, twice
    flag = eng.sessions[sid].flags["ttl"]
    assert flag["choice"] == "head" and flag["cost_head"] < min(flag["cost_5m"], flag["cost_1h"]), flag
    first = next(i for i, b in enumerate(sent) if b'"ttl"' in b)
    assert first == 28 - 8  # decided with the first pause (a cold moment), not before
    for prev, body in zip(sent[first:], sent[first + 1:]):
        # 1 hour on the system's two breakpoints and bili's on the summary, 5 minutes on the last message
        assert _ttls(body) == ["1h", "1h", "1h", "5m"]
        assert cache.ordered(cache.anthropic_segments(body))
        # byte-stable: everything the previous request sent is the prefix of the next (as the cache
        # matches it, the agent's moving breakpoint aside)
        a, b = cache.anthropic_segments(prev), cache.anthropic_segments(body)
        assert [s.key for s in a] == [s.key for s in b[:len(a)]]
    again = eng.process(cc_body(msgs), LANES["anthropic"], h, render=True).body  # the same history again
    assert again == sent[-1]
    assert "cheapest" not in flag
    # the clock bills the pause after the switch as the model says: the head read, the tail written
    turns = eng.clocks.by_session[sid].turns
    pause = turns[-4].predicted  # k = 36
    assert pause.read == flag["head"]  # no fold since the decision: the same head
    assert pause.write_long == 0 and pause.input == 0  # the tail written again, at 1.25x
    eng.store.close()


def test_choose_weighs_the_later_requests_on_what_survives_a_fold_asked_for():
    """A reminder goes out with the very request that would switch: the range it asks to fold leaves
    the wire with the next request or so.  The switch still writes the whole context (at 2x on 1h,
    on the head only with ``head``), but what the later requests read, or write again after a
    pause, is what survives the fold (the head at least)."""
    gaps = [8.0, 361.0] * 4  # every other request after a pause past 5 minutes
    whole = lifetime.choose(gaps, context=30_000, new_per_turn=1_750, rules=R, head=13_000, rest=9)
    assert whole.choice == "1h"  # the whole context written at 2x: 22.5K more than at 1.25x
    folding = lifetime.choose(gaps, context=30_000, new_per_turn=1_750, rules=R, head=13_000, rest=9,
                              leaving=15_000)
    assert folding.cost_5m == pytest.approx(0.5 * 1.15 * 15_000 + 1.25 * 1_750)
    assert folding.cost_1h == pytest.approx(2.0 * 1_750 + 0.75 * 30_000 / 9)  # the switch on all of it
    assert folding.cost_head == pytest.approx(0.5 * 1.15 * 2_000 + 1.25 * 1_750 + 0.75 * 13_000 / 9)
    assert folding.choice == "head"  # 1 hour on the head only: its premium, not the range's
    # a fold never takes the head: what survives is never less
    assert lifetime.choose(gaps, context=30_000, new_per_turn=1_750, rules=R, head=13_000, rest=9,
                           leaving=50_000).cost_head == folding.cost_head - 0.5 * 1.15 * 2_000


def test_a_reminder_at_the_cold_moment_keeps_the_switch_off_the_range_it_asks_to_fold(tmp_path):
    """The session pauses every other request and its work piles up: at the first cold moment with
    gaps enough, a reminder rides on the request.  1 hour everywhere would write the whole context at
    2x, the range the reminder asks to fold with it; what survives the fold is mostly the head, so
    the head takes the hour."""
    eng = Engine(Store(tmp_path / "data"), activate="always")
    eng.nudge_cfg.batch_tokens = 1_000
    eng.nudge_cfg.regrowth_tokens = 0  # (a reminder on every request past the threshold: the model never folds)
    t = {"now": 0.0}
    eng.now = lambda: t["now"]
    sid, h = "remind", {"x-claude-code-session-id": "remind"}
    for n in range(12):
        t["now"] += 5.0 if n % 2 else 600.0
        res = eng.process(_body(n, 8_000), LANES["anthropic"], h, render=True)
        eng.clocks.report(sid, read=eng.clocks.stats(sid)["turns"][-1]["predicted_read"])
        if b'"ttl"' in res.body:
            break
    assert b"[bili]" in res.body  # the reminder rode on the request that switched
    flag = eng.sessions[sid].flags["ttl"]
    assert flag["choice"] == "head", flag
    assert _ttls(res.body) == ["1h", "5m"]  # the system's breakpoint; the last message's keeps 5 minutes
    eng.store.close()
