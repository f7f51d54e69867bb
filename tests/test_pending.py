"""Deferred materialization (kernel/pending.py): a compress is made at once; its range stays on the
wire until a cold moment, the window or the cost model says so, and then leaves in one rewrite."""

from __future__ import annotations

import json
import re

from bili_addon.kernel import compaction, pending
from bili_addon.kernel.fold import POINTER, FoldConfig
from bili_addon.kernel.turn import Engine
from tests.test_fold import (
    ANTH,
    agent_answers_unknown,
    assert_valid_anthropic,
    body,
    conversation,
    refs_in,
    roundtrip_call,
)

SID = "held-1"
H = {"x-acp-session": SID}
SECTION = "[Compressed conversation section "
SUMMARY_AT = re.compile(r"\[Compressed conversation section b\d")


def steps_on_wire(out: dict) -> set[int]:
    """The scripted steps whose tool calls are on the wire."""
    return {int(b["id"].removeprefix("toolu_")) for m in out["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_use" and b["id"].removeprefix("toolu_").isdigit()}


def make(store) -> Engine:
    e = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000), materialize="cost")
    e.t = 1000.0
    e.now = lambda: e.t
    return e


def send(e: Engine, msgs: list[dict], gap: float = 10.0):
    e.t += gap
    res = e.process(body(msgs), ANTH, H, render=True)
    return res, json.loads(res.body) if res.body is not None else None


def ask(e: Engine, msgs: list[dict], refs: dict, first: str, last: str, cid: str, tool="compress") -> list[dict]:
    start = next(r for r, t in refs.items() if t.startswith(first))
    end = next(r for r, t in refs.items() if t.startswith(last))
    args = {"content": [{"startId": start, "endId": end, "topic": f"{first}..{last}",
                         "summary": f"{first} to {last}: modules read, nothing unusual, values noted."}]}
    roundtrip_call(e, SID, tool, args, cid)
    return agent_answers_unknown(msgs, tool, args, cid)


def call(e: Engine, msgs: list[dict], tool: str, args: dict, cid: str) -> tuple[list[dict], str]:
    roundtrip_call(e, SID, tool, args, cid)
    msgs = agent_answers_unknown(msgs, tool, args, cid)
    _, out = send(e, msgs)
    return msgs, out["messages"][-1]["content"][0]["content"]


def go_on(msgs: list[dict], n: int) -> list[dict]:
    return msgs + [{"role": "assistant", "content": f"Noted {n}."}, {"role": "user", "content": f"go on {n}"}]


def cc_sender(e: Engine):
    """Sends Claude Code-shaped bodies ``gap`` seconds apart; the provider reports the reads the
    clock predicted (so the clock's history is what a real one would be)."""
    from tests.test_lifetime import cc_body

    def send_cc(msgs: list[dict], gap: float = 10.0):
        e.t += gap
        res = e.process(cc_body(msgs), ANTH, H, render=True)
        e.clocks.report(SID, read=e.clocks.stats(SID)["turns"][-1]["predicted_read"])
        return res, json.loads(res.body)
    return send_cc


def held_fold(e: Engine, steps: int = 8):
    msgs = conversation(steps)
    _, first = send(e, msgs)
    msgs = ask(e, msgs, refs_in(first), "Step 0:", "Step 2:", "c1")
    res, out = send(e, msgs)
    return msgs, res, out


def test_the_fold_is_made_at_once_and_its_range_leaves_at_the_cold_moment(backend):
    e = make(backend())
    msgs, res, out = held_fold(e)
    text = json.dumps(out)
    result = out["messages"][-1]["content"][0]["content"]
    assert res.executed == ["compress"] and "→ b1" in result and pending.SENTENCE in result
    assert res.landed == 0 and not SUMMARY_AT.search(text)  # held: the range is still on the wire, as sent
    assert steps_on_wire(out) == set(range(8)) and "file-1-row-" in text
    assert "cold" in res.marker
    s = e.sessions[SID]
    assert [b.id for b in s.blocks if b.active] == ["b1"] and s.flags[pending.FLAG]["blocks"] == ["b1"]

    # decompress and search answer from the stored block before it lands
    msgs, got = call(e, msgs, "decompress", {"blockId": "b1"}, "c2")
    assert got.startswith("b1 (tier 1) replaced original messages") and "file-1-row-3" in got
    msgs, got = call(e, msgs, "search_context", {"query": "file-2-row-7"}, "c3")
    assert "(inside b1)" in got
    _, got = e.plugin_tool(SID, "acp_status", {})
    assert "b1  tier 1" in got and "(held: the originals stay visible" in got

    # warm requests: nothing moves; each extends the previous byte for byte
    prev = e.process(body(msgs), ANTH, H, render=True).body
    for n in range(3):
        msgs = go_on(msgs, n)
        res, out = send(e, msgs)
        assert res.landed == 0 and not SUMMARY_AT.search(json.dumps(out))
        assert res.body.startswith(prev[: prev.rindex(b"]}")])
        prev = res.body

    # the 5-minute entry expires: the next request is written in full anyway, and the range leaves
    msgs = go_on(msgs, 9)
    res, out = send(e, msgs, gap=301)
    text = json.dumps(out)
    assert res.landed == 1 and SECTION + "b1" in text
    assert steps_on_wire(out) == {3, 4, 5, 6, 7}
    assert_valid_anthropic(out)
    assert not e.sessions[SID].flags[pending.FLAG]
    # and it stays landed, byte-stable
    msgs = go_on(msgs, 10)
    res2, _ = send(e, msgs)
    assert res2.landed == 0 and res2.body.startswith(res.body[: res.body.rindex(b"]}")])
    e.store.close()


def test_a_held_folds_call_keeps_its_summary_until_the_fold_lands(backend):
    """While a fold is held its summary stands nowhere else: the call keeps it.  It points at the
    block from the request that lands it, which rewrites from the range's start, before the call."""
    e = make(backend())
    msgs, res, out = held_fold(e)
    said = "Step 0: to Step 2:: modules read, nothing unusual, values noted."
    text = json.dumps(out)
    assert res.landed == 0 and text.count(said) == 1
    assert out["messages"][-2]["content"][0]["input"]["content"][0]["summary"] == said
    msgs = go_on(msgs, 1)
    res, out = send(e, msgs, gap=301)
    text = json.dumps(out)
    assert res.landed == 1 and SECTION + "b1" in text and text.count(said) == 1
    call = next(b for m in out["messages"] if isinstance(m["content"], list) for b in m["content"]
                if b.get("type") == "tool_use" and b["id"] == "c1")
    assert call["input"]["content"][0]["summary"] == POINTER.format(id="b1")
    msgs = go_on(msgs, 2)
    res2, _ = send(e, msgs)
    assert res2.body.startswith(res.body[: res.body.rindex(b"]}")])
    e.store.close()


def test_held_folds_land_together_in_one_rewrite(backend):
    e = make(backend())
    msgs, res, out = held_fold(e, steps=14)
    msgs = ask(e, msgs, refs_in(out), "Step 3:", "Step 5:", "c4")
    res, out = send(e, msgs)
    assert res.executed == ["compress"] and res.landed == 0 and not SUMMARY_AT.search(json.dumps(out))
    assert e.sessions[SID].flags[pending.FLAG]["blocks"] == ["b1", "b2"]
    msgs = go_on(msgs, 1)
    res, out = send(e, msgs, gap=400)
    text = json.dumps(out)
    assert res.landed == 2 and SECTION + "b1" in text and SECTION + "b2" in text
    assert steps_on_wire(out) == set(range(6, 14))
    assert_valid_anthropic(out)
    e.store.close()


def test_a_second_fold_that_makes_the_batch_pay_lands_both(backend):
    """Alone, the first fold does not pay for its rewrite over a young session; with the second one
    the saved reads do, and both leave the wire in the request that executes the second."""
    e = make(backend())
    msgs, res, out = held_fold(e)
    msgs = ask(e, msgs, refs_in(out), "Step 3:", "Step 5:", "c4")
    res, out = send(e, msgs)
    result = out["messages"][-1]["content"][0]["content"]
    assert res.executed == ["compress"] and res.landed == 2 and pending.SENTENCE not in result
    assert steps_on_wire(out) == {6, 7} and SECTION + "b2" in json.dumps(out)
    assert_valid_anthropic(out)
    e.store.close()


def test_the_window_forces_the_landing(backend):
    e = make(backend())
    msgs, res, out = held_fold(e)
    assert res.landed == 0
    e.window = 1000  # the prompt now stands past the pressure share of the window
    res, out = send(e, go_on(msgs, 1))
    assert res.landed == 1 and SECTION + "b1" in json.dumps(out)
    e.store.close()


def test_the_cost_model_lands_it_once_the_session_shows_it_lasts(backend):
    """No cold moment at all: a fold that does not pay over a young session's expected rest pays
    once the session has lasted long enough (the reads it saves outweigh the rewrite)."""
    e = make(backend())
    msgs, res, _ = held_fold(e)
    assert res.landed == 0
    landed_at = None
    for n in range(80):
        msgs = go_on(msgs, n)
        res, out = send(e, msgs)
        if res.landed:
            landed_at = n
            break
    assert landed_at is not None and landed_at > 2
    assert SECTION + "b1" in json.dumps(out) and steps_on_wire(out) == {3, 4, 5, 6, 7}
    e.store.close()


def test_held_state_survives_a_restart_and_another_instance(backend):
    e = make(backend())
    msgs, res, _ = held_fold(e)
    assert res.landed == 0
    e.store.close()
    other = make(backend())  # a restarted proxy, or a second instance on the same store
    other.t = e.t
    msgs = go_on(msgs, 1)
    res, out = send(other, msgs)
    assert res.landed == 0 and not SUMMARY_AT.search(json.dumps(out)) and steps_on_wire(out) == set(range(8))
    msgs = go_on(msgs, 2)
    res, out = send(other, msgs, gap=400)  # its clock has seen a request: now it knows the cache is cold
    assert res.landed == 1 and SECTION + "b1" in json.dumps(out)
    other.store.close()


def test_materialize_now_lands_with_the_executing_request(backend):
    e = make(backend())
    e.materialize = "now"
    msgs = conversation(8)
    _, first = send(e, msgs)
    msgs = ask(e, msgs, refs_in(first), "Step 0:", "Step 2:", "c1")
    res, out = send(e, msgs)
    result = out["messages"][-1]["content"][0]["content"]
    assert pending.SENTENCE not in result and SECTION + "b1" in json.dumps(out)
    assert not e.sessions[SID].flags.get(pending.FLAG)
    e.store.close()


def test_a_compaction_retires_a_held_fold(backend):
    e = make(backend())
    msgs, res, _ = held_fold(e)
    assert res.landed == 0
    msgs = go_on(msgs, 1)
    send(e, msgs)
    summary = compaction.CLAUDE_CODE + ". The conversation is summarized below: modules 0-7 were audited."
    new = [{"role": "user", "content": summary}, {"role": "assistant", "content": "Continuing."},
           {"role": "user", "content": "Audit module 8."}]
    res, out = send(e, new)
    assert res.epoch == 2
    s = e.sessions[SID]
    assert s.blocks[0].retired and not s.flags.get(pending.FLAG)
    assert not SUMMARY_AT.search(json.dumps(out))
    _, text = e.plugin_tool(SID, "decompress", {"blockId": "b1"})
    assert "file-1-row-" in text
    e.store.close()


def test_a_fork_holds_what_its_parent_held(backend):
    """A fork (another session id over the same verified history) inherits the held block and the
    holding: the shared history keeps the parent's bytes; each lands on its own."""
    e = make(backend())
    msgs, res, parent_out = held_fold(e)
    assert res.landed == 0
    fork = go_on(msgs, 1)
    e.t += 10
    res = e.process(body(fork), ANTH, {"x-acp-session": "fork-1"}, render=True)
    out = json.loads(res.body)
    assert any("a fork of " + SID in n for n in res.notes), res.notes
    assert res.landed == 0 and not SUMMARY_AT.search(json.dumps(out)) and steps_on_wire(out) == set(range(8))
    assert out["messages"][: len(parent_out["messages"])] == parent_out["messages"]
    assert e.sessions["fork-1"].flags[pending.FLAG]["blocks"] == ["b1"]
    e.t += 400  # the fork's own cold moment lands its copy
    res = e.process(body(go_on(fork, 2)), ANTH, {"x-acp-session": "fork-1"}, render=True)
    assert res.landed == 1 and SECTION + "b1" in res.body.decode()
    assert e.sessions[SID].flags[pending.FLAG]["blocks"] == ["b1"]  # the parent's is its own
    e.store.close()


def test_with_the_head_kept_for_an_hour_a_held_fold_lands_when_the_tail_expires(backend, caplog):
    """A session that keeps 1-hour entries on its stable head (kernel/lifetime.py) is never wholly
    cold after a 10-minute pause, but its live tail is: the fold's range lies there, so it lands."""
    e = make(backend())
    send_cc = cc_sender(e)

    msgs = conversation(8)
    send_cc(msgs)
    e.set_flag(SID, "ttl", {"choice": "head"})  # as the lifetime decision would at a cold moment:
    msgs = go_on(msgs, 0)
    _, first = send_cc(msgs, gap=400)  # the head's 1-hour entries are written with the next cold request
    msgs = ask(e, msgs, refs_in(first), "Step 0:", "Step 2:", "c1")
    res, out = send_cc(msgs)
    assert res.executed == ["compress"] and res.landed == 0 and not SUMMARY_AT.search(json.dumps(out))
    hour = {"type": "ephemeral", "ttl": "1h"}
    assert [b["cache_control"] for b in out["system"] if "cache_control" in b] == [hour] * 2
    msgs = go_on(msgs, 1)
    res, _ = send_cc(msgs)
    assert res.landed == 0  # warm: held
    later = e.t + 600
    assert not e.clocks.cold(SID, later) and e.clocks.cold(SID, later, tail=True)  # the head lives on
    msgs = go_on(msgs, 2)
    with caplog.at_level("INFO", logger="bili"):
        res, out = send_cc(msgs, gap=600)
    assert res.landed == 1 and SECTION + "b1" in json.dumps(out)
    assert f"session={SID}: held fold(s) b1 land in one rewrite (cold)" in caplog.text
    summary = next(m for m in out["messages"] if SECTION + "b1" in json.dumps(m))
    assert summary["content"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}  # bili's, on the head
    assert out["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}  # the agent's: 5 minutes
    assert_valid_anthropic(out)
    e.store.close()


def test_with_the_head_kept_for_an_hour_a_held_distil_waits_for_the_head_to_expire(backend):
    """Distilling summaries rewrites the stable head (its 1-hour entries end at the last summary): the
    tail's expiry does not make that free, so it waits until the head's hour is over too."""
    e = make(backend())
    send_cc = cc_sender(e)

    msgs = conversation(12)
    send_cc(msgs)
    e.set_flag(SID, "ttl", {"choice": "head"})
    msgs = go_on(msgs, 0)
    _, out = send_cc(msgs, gap=400)
    for n, (first, last) in enumerate([("Step 0:", "Step 2:"), ("Step 3:", "Step 5:")], start=1):
        msgs = ask(e, msgs, refs_in(out), first, last, f"c{n}")
        res, out = send_cc(msgs)
        assert res.executed == ["compress"] and res.landed == 0  # warm: held
        msgs = go_on(msgs, n)
        res, out = send_cc(msgs, gap=600)  # the tail's entries expired: the fold lands
        assert res.landed == 1 and SECTION + f"b{n}" in json.dumps(out)
    args = {"content": [{"startId": "b1", "endId": "b2", "topic": "steps 0-5",
                         "summary": "Steps 0 to 5: modules read, nothing unusual, values noted."}]}
    roundtrip_call(e, SID, "compress", args, "c3")
    msgs = agent_answers_unknown(msgs, "compress", args, "c3")
    res, out = send_cc(msgs)
    assert res.executed == ["compress"] and res.landed == 0
    assert SECTION + "b1" in json.dumps(out) and SECTION + "b3" not in json.dumps(out)  # held
    later = e.t + 600
    assert not e.clocks.cold(SID, later) and e.clocks.cold(SID, later, tail=True)
    msgs = go_on(msgs, 3)
    res, out = send_cc(msgs, gap=600)  # only the tail expired: the distil would rewrite the head's hour
    assert res.landed == 0 and SECTION + "b1" in json.dumps(out) and SECTION + "b3" not in json.dumps(out)
    msgs = go_on(msgs, 4)
    res, out = send_cc(msgs, gap=3700)  # the head's hour is over too: written in full anyway, it lands
    text = json.dumps(out)
    assert res.landed == 1 and SECTION + "b3" in text and SECTION + "b1" not in text
    assert_valid_anthropic(out)
    e.store.close()


def test_a_range_that_ends_inside_a_held_fold_is_refused_not_stretched_over_it(backend):
    """A held fold's messages stay on the wire, tagged: the model may compress a range that starts
    before the fold and ends inside it.  Taking the held block in made the new summary stand for
    the block's messages past the range's end (steps 4 and 5 under "steps 0 to 3").  Refused, with
    where to end it; a range that takes the block in whole still does."""
    e = make(backend())
    msgs = conversation(10)
    _, first = send(e, msgs)
    msgs = ask(e, msgs, refs_in(first), "Step 2:", "Step 5:", "c1")
    res, out = send(e, msgs)
    assert res.executed == ["compress"] and pending.held(e.sessions.get(SID))[0]  # b1 held, its steps on the wire
    refs = refs_in(out)
    msgs = ask(e, msgs, refs, "Step 0:", "Step 3:", "c2")
    res, out = send(e, msgs)
    said = out["messages"][-1]["content"][0]["content"]
    assert "not compressed" in said and "part of b1" in said
    s = e.sessions.get(SID)
    assert [b.id for b in s.blocks if b.active] == ["b1"]
    msgs = ask(e, msgs, refs, "Step 0:", "Step 6:", "c3")  # (all of b1 in it)
    res, out = send(e, msgs)
    assert out["messages"][-1]["content"][0]["content"].startswith("Compressed ")
    b2 = next(b for b in e.sessions.get(SID).blocks if b.active)
    assert b2.consumed == ["b1"]


def test_a_held_fold_landing_with_a_newer_one_shows_its_pointer_from_then_on(backend):
    """b1 held across requests (its call c1 rendered with its whole summary); the request that runs a
    second compress lands both (a cold moment here): the calls were rendered anew only when the
    newest fold was held across requests (``since`` was its request), so c1 kept its whole summary
    beside b1's own on the wire, until some other change re-rendered it (a restart: at once)."""
    e = make(backend())
    msgs, res, out = held_fold(e, steps=14)
    msgs = go_on(msgs, 0)
    res, out = send(e, msgs)
    assert res.landed == 0
    msgs = ask(e, msgs, refs_in(out), "Step 3:", "Step 5:", "c4")
    res, out = send(e, msgs, gap=400)
    assert res.landed == 2

    def c1(payload: dict) -> str:
        return next(b for m in payload["messages"] if isinstance(m["content"], list) for b in m["content"]
                    if b.get("type") == "tool_use" and b["id"] == "c1")["input"]["content"][0]["summary"]

    assert c1(out) == POINTER.format(id="b1")
    msgs = go_on(msgs, 1)
    res, out = send(e, msgs)
    assert c1(out) == POINTER.format(id="b1")
    e.store.close()


def test_a_retry_of_the_same_history_keeps_what_was_held(backend, monkeypatch):
    """An SDK retries a request (a timeout, a 529): the same history again.  The landing decision counts
    the session's requests (the horizon), and the retry is one more: a held fold landed on the retry
    and not on the first attempt, one history sent with two bodies.  A retry keeps what was held."""
    e = make(backend())
    msgs, res, out = held_fold(e)
    assert res.landed == 0
    msgs = go_on(msgs, 0)
    first, out1 = send(e, msgs)
    assert first.landed == 0
    # from here every decision would land (as the retry's one more request tipped it)
    monkeypatch.setattr(type(e), "_weigh", lambda self, s, view, hold, keep: pending.rewrite.Decision(True, "pays"))
    again, out2 = send(e, msgs, gap=2.0)
    assert again.landed == 0 and out2 == out1
    later, _ = send(e, go_on(msgs, 1))
    assert later.landed == 1
    e.store.close()
