"""The agent's own compaction starts a new epoch of the session, and folding goes on.

Fixtures: the compacted histories of tests/compactions.py (built from each agent's documented
shape).  Every case folds early turns first, then the agent compacts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import churn as C
import compactions as X
from bili_addon.kernel import compaction, nudge
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

SID = "compact"
H = {"x-acp-session": SID}
SUMMARY = "Fold summary covering the early turns: modules one to five were read and their values noted."
REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)", re.M)
SECTION = b"[Compressed conversation section "


def make_engine(backend) -> Engine:
    return Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))


class Agent:
    """Sends a history through the engine the way the addon does, and reports usage like a provider."""

    def __init__(self, engine: Engine, lane: str, sid: str = SID):
        self.engine, self.lane, self.sid = engine, lane, sid
        self.last = None

    def send(self, conv: list[dict]):
        raw = C.body(self.lane, conv)
        res = self.engine.process(raw, LANES[self.lane], {"x-acp-session": self.sid}, render=True)
        out = res.body if res.body is not None else raw
        self.engine.store.record_usage(self.sid, self.lane, (len(out) // 4, 0, 0, 10))
        self.last = res
        return res, out


def fold_early(agent: Agent, ts, build, first=1, last=5):
    res, out = agent.send(build(ts, C.Scheme()))
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs[f"Turn {first}: please"[:14]], "endId": refs[f"Reply Turn {last}: "[:14]],
                         "summary": SUMMARY}]}
    agent.engine.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(agent.lane, "cfold", "compress", args)
    res, folded = agent.send(build(ts, C.Scheme(), pair))
    assert SECTION + b"b1" in folded and b"file-2-row-" not in folded
    return pair, refs


def folded_and_on(backend, lane: str, build, n: int):
    """``n`` turns, the early ones folded, and one turn more sent: the engine, the agent, the turns, the
    compress call's pair and the refs of the first request."""
    engine = make_engine(backend)
    agent = Agent(engine, lane)
    ts = C.turns(n)
    pair, refs = fold_early(agent, ts, build)
    ts.append(C.Turn(n, f"Turn {n}: next.", f"Reply Turn {n}.", tool=False))
    agent.send(build(ts, C.Scheme(), pair))
    return engine, agent, ts, pair, refs


def reminder_ranges(out: bytes) -> list[tuple[str, str]]:
    text = "\n".join(C.strings(json.loads(out)))
    if "[bili] " not in text:
        return []
    return [(m.group(1), m.group(2)) for m in REMINDER.finditer(text[text.rindex("[bili] "):])]


def grow_until_folded(agent: Agent, build, start: int, turns: int = 90):
    """The agent goes on after its compaction; the scripted model answers bili's reminder with one
    compress call.  Returns (the turn of the first reminder, the pending tokens on the turn before
    it, the body carrying the new fold) or None values."""
    s = agent.engine.sessions[SID]
    ts: list[C.Turn] = []
    extra: list[dict] = []
    before = 0
    reminded = None
    for t in range(start, start + turns):
        ts.append(C.Turn(t, f"Turn {t}: please analyze module {t}. {C.FILLER}", f"Reply Turn {t}: module {t} ok.",
                         tool=True))
        res, out = agent.send(build(ts, C.Scheme(), extra))
        if reminded is not None:
            return reminded, before, out
        ranges = reminder_ranges(out)
        if ranges:
            reminded = t
            args = {"content": [{"startId": a, "endId": b, "summary": f"{SUMMARY} ({a}..{b})"} for a, b in ranges]}
            cid = f"cnew{t}"
            agent.engine.record_calls(SID, [(cid, "compress", json.dumps(args))])
            extra = extra + C.proxy_call(agent.lane, cid, "compress", args)
            continue
        before = sum(r[3] for r in nudge.compressible(s.last_view, s.blocks, agent.engine.fold_cfg))
    return reminded, before, None


def test_claude_code_compaction_starts_an_epoch_and_folding_goes_on(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    pair, refs = fold_early(agent, ts, C.anthropic)
    # the compaction request: the whole (folded) history and Claude Code's summarisation prompt
    ask = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}
    res, out = agent.send(C.anthropic(ts, C.Scheme(), pair + [ask]))
    assert res.epoch == 0 and SECTION + b"b1" in out
    # the first request of the new history: the summary alone
    res, out = agent.send(X.claude_code_alone())
    assert res.epoch == 2 and res.drift != "collapse"
    s = engine.sessions[SID]
    assert not s.copy.latched
    b1 = next(b for b in s.blocks if b.id == "b1")
    assert b1.retired and not b1.active
    assert [e["epoch"] for e in s.flags["epochs"]] == [2]
    assert s.flags["epochs"][0]["agent"] == "claude-code" and s.flags["epochs"][0]["retired_blocks"] == ["b1"]
    assert not re.search(rb"\[Compressed conversation section b\d", out)

    # the old blocks answer decompress and search_context
    _, text = engine.plugin_tool(SID, "decompress", {"blockId": "b1"})
    assert "file-2-row-" in text and "Turn 3: please" in text
    _, text = engine.plugin_tool(SID, "decompress", {"blockId": refs["Turn 3: please"]})
    assert text.startswith("b1 ")
    _, text = engine.plugin_tool(SID, "search_context", {"query": "file-3-row-7"})
    assert "(inside b1)" in text
    _, text = engine.plugin_tool(SID, "acp_status", {})
    assert "1 from before the agent's compaction" in text

    # folding restarts on the new history, as soon as the reminder threshold is reached
    reminded, before, out = grow_until_folded(agent, lambda t, sc, extra: X.claude_code(t, sc, extra=extra), 20)
    assert reminded is not None, "bili reminded the model to fold in the new epoch"
    assert before < engine.nudge_cfg.batch_tokens  # at the first crossing, not later
    assert out is not None and SECTION + b"b2" in out
    assert len(engine.sessions[SID].flags["epochs"]) == 1  # the same epoch all along


def test_without_recognition_the_same_compaction_pauses_folding_then_starts_over(backend, monkeypatch):
    """The control: with no shapes recognised, the compacted history is a total collapse, which pauses
    folding; it no longer does for good (coverage.RETIRE_AFTER): the old epoch's folds retire as a
    recognised compaction's do, only a few requests later, and the new history is folded."""
    monkeypatch.setattr(compaction, "SHAPES", ())
    engine, agent, ts, pair, _ = folded_and_on(backend, "anthropic", C.anthropic, 14)
    res, _ = agent.send(X.claude_code(C.turns(20)[15:20]))
    assert res.drift == "collapse" and res.epoch == 0
    _, _, out = grow_until_folded(agent, lambda t, sc, extra: X.claude_code(C.turns(20)[15:20] + t, sc, extra=extra),
                                  20, turns=60)
    assert out is not None and SECTION + b"b2" in out
    s = engine.sessions[SID]
    assert s.flags["drift"]["restarted"] == 1 and all(b.retired for b in s.blocks if b.id == "b1")


def test_codex_compaction_keeps_the_refs_of_the_surviving_user_messages(backend):
    engine, agent, ts, pair, refs = folded_and_on(backend, "responses", C.responses, 14)
    after = [C.Turn(15, "Turn 15: carry on.", "Reply Turn 15: carrying on.", tool=True)]
    res, out = agent.send(X.codex(ts, after))
    assert res.epoch == 2 and res.drift != "collapse"
    ep = engine.sessions[SID].flags["epochs"][0]
    assert ep["agent"] == "codex" and ep["kept"] > 0 and ep["gone"] > 0
    now = C.refs_by_text(out)
    for t in (0, 2, 3, 9):  # folded in epoch 1 (2, 3) or not (0, 9): the same ref either way
        key = f"Turn {t}: please"[:14]
        assert now[key] == refs[key]
    assert b"file-2-row-" not in out  # the agent dropped the tool work itself
    assert not re.search(rb"\[Compressed conversation section b\d", out)
    # and the next turn is a steady pass of the new epoch
    after.append(C.Turn(16, "Turn 16: more.", "Reply Turn 16.", tool=True))
    res, _ = agent.send(X.codex(ts, after))
    assert res.epoch == 0 and res.drift == ""


def test_codex_remote_compaction_item(backend):
    engine, agent, ts, pair, _ = folded_and_on(backend, "responses", C.responses, 14)
    res, _ = agent.send(X.codex(ts, [C.Turn(15, "Turn 15: on.", "Reply 15.", tool=True)], remote=True))
    assert res.epoch == 2
    assert engine.sessions[SID].flags["epochs"][0]["agent"] == "codex"


@pytest.mark.parametrize("shape", ["pi", "hermes", "opencode"])
def test_other_agents_shapes(backend, shape):
    lane = "anthropic" if shape == "opencode" else "chat"
    build = C.anthropic if lane == "anthropic" else C.chat
    engine, agent, ts, pair, _ = folded_and_on(backend, lane, build, 16)
    more = [C.Turn(17, "Turn 17: after.", "Reply Turn 17.", tool=True)]
    conv = {"pi": lambda: X.pi(ts[13:] + more), "hermes": lambda: X.hermes(ts[:1], ts[14:] + more),
            "opencode": lambda: X.opencode(more)}[shape]()
    res, out = agent.send(conv)
    assert res.epoch == 2 and res.drift != "collapse"
    assert not re.search(rb"\[Compressed conversation section b\d", out)
    assert engine.sessions[SID].flags["epochs"][0]["agent"] == shape


def test_a_second_compaction_is_a_third_epoch(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    fold_early(agent, ts, C.anthropic)
    agent.send(X.claude_code_alone())
    _, _, out = grow_until_folded(agent, lambda t, sc, extra: X.claude_code(t, sc, extra=extra), 20)
    assert SECTION + b"b2" in out
    res, out = agent.send(X.claude_code_alone("Second summary: modules 20 to 60 analysed, all values recorded."))
    assert res.epoch == 3
    s = engine.sessions[SID]
    assert [e["epoch"] for e in s.flags["epochs"]] == [2, 3]
    assert all(b.retired and not b.active for b in s.blocks)
    _, text = engine.plugin_tool(SID, "decompress", {"blockId": "b1"})
    assert "file-2-row-" in text


def test_a_quoted_marker_later_in_the_history_is_not_a_compaction(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    pair, _ = fold_early(agent, ts, C.anthropic)
    ts.append(C.Turn(14, X.claude_code_summary(), "Reply Turn 14: that is a Claude Code message.", tool=False))
    res, out = agent.send(C.anthropic(ts, C.Scheme(), pair))
    assert res.epoch == 0 and SECTION + b"b1" in out


def test_a_marker_at_the_head_with_the_old_history_still_there_is_not_a_compaction(backend):
    engine, agent, ts, pair, _ = folded_and_on(backend, "anthropic", C.anthropic, 14)
    conv = C.anthropic(ts, C.Scheme(), pair)
    conv[0] = {**conv[0], "content": [{"type": "text", "text": X.claude_code_summary()}] + conv[0]["content"]}
    res, out = agent.send(conv)
    assert res.epoch == 0 and SECTION + b"b1" in out


def test_a_foreign_history_after_an_epoch_still_pauses(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    fold_early(agent, ts, C.anthropic)
    agent.send(X.claude_code_alone())
    _, _, out = grow_until_folded(agent, lambda t, sc, extra: X.claude_code(t, sc, extra=extra), 20)
    assert SECTION + b"b2" in out
    other = [C.Turn(t, f"Other topic {t}: tell me about birds. {C.FILLER}", f"Birds {t}.", tool=t % 3 == 0)
             for t in range(14)]
    res, out = agent.send(C.anthropic(other, C.Scheme(ids="x_")))
    assert res.epoch == 0 and res.drift in ("drift", "collapse")
    assert not re.search(rb"\[Compressed conversation section b\d", out)


def test_a_truncated_oldest_slice_in_the_new_epoch_still_snoozes(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    fold_early(agent, ts, C.anthropic)
    agent.send(X.claude_code_alone())
    build = lambda t, sc, extra: X.claude_code(t, sc, extra=extra)  # noqa: E731
    reminded, _, out = grow_until_folded(agent, build, 20)
    s = engine.sessions[SID]
    b2 = next(b for b in s.blocks if b.id == "b2")
    # the host drops its oldest slice: the summary head and everything b2 covers
    covered_turns = sorted({int(m) for m in re.findall(r"Turn (\d+): please", json.dumps(
        engine.store.originals(SID, b2.covered)))})
    kept = [C.Turn(t, f"Turn {t}: please analyze module {t}. {C.FILLER}", f"Reply Turn {t}: module {t} ok.",
                   tool=True) for t in range(covered_turns[-1] + 1, reminded + 8)]
    res, out = agent.send(C.anthropic(kept, C.Scheme()))
    assert res.epoch == 0 and res.drift == "truncated"
    assert SECTION + b"b2" not in out and b2.active


# -- the real Claude Code ----------------------------------------------------------------------

CAPTURE = json.loads((Path(__file__).parent / "captures"
                      / "claude-code-2.1.197-autocompact.json").read_text())


def claude_body(messages: list[dict]) -> bytes:
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
                       "system": [{"type": "text", "text": "You are Claude Code."}],
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                       "messages": messages}).encode()


def test_real_claude_code_auto_compactions(backend):
    """Requests captured from Claude Code 2.1.197's own auto-compactions (two of them)."""
    engine = make_engine(backend)
    lane = LANES["anthropic"]
    hc = {"x-claude-code-session-id": "cc-real", "user-agent": "claude-cli/2.1.197 (external, sdk-cli)"}
    before, after1, after1b, before2, after2, after2b = (r["messages"] for r in CAPTURE["requests"])

    def send(messages):
        res = engine.process(claude_body(messages), lane, hc, render=True)
        out = res.body if res.body is not None else claude_body(messages)
        engine.store.record_usage("cc-real", "anthropic", (len(out) // 4, 0, 0, 20))
        return res, out

    _, out = send(before)
    refs = C.refs_by_text(out)
    ctx = next(r for t, r in refs.items() if t.startswith("<system-remind"))
    step2 = next(r for t, r in refs.items() if t.startswith("Step 2: readin"))
    step9 = next(r for t, r in refs.items() if t.startswith("Step 9: readin"))
    args = {"content": [{"startId": step2, "endId": step9,
                         "summary": "Listings 2 to 9 were read and checked; every row in order, nothing to follow up."}]}
    engine.record_calls("cc-real", [("toolu_fold1", "compress", json.dumps(args))])
    pair = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_fold1", "name": "compress",
                                               "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_fold1", "is_error": True,
                                          "content": "<tool_use_error>Error: No such tool available: compress"
                                                     "</tool_use_error>"}]}]
    res, out = send(before + pair)
    assert SECTION + b"b1" in out and b"listing-5-row-" not in out
    # the compaction request: that history, Claude Code's prompt joined to its last user message
    ask = [*before, *pair[:1], {**pair[1], "content": pair[1]["content"] + [CAPTURE["compaction_prompt"]]}]
    res, out = send(ask)
    assert res.epoch == 0 and SECTION + b"b1" in out

    res, out = send(after1)
    assert res.epoch == 2 and res.drift != "collapse"
    s = engine.sessions["cc-real"]
    assert s.flags["epochs"][-1]["agent"] == "claude-code" and s.flags["epochs"][-1]["retired_blocks"] == ["b1"]
    assert C.refs_by_text(out)["<system-remind"] == ctx  # the context block survived: its ref too
    res, out = send(after1b)
    assert res.epoch == 0 and res.drift == ""
    res, out = send(before2)  # many turns later, the same epoch
    assert res.epoch == 0 and not s.copy.latched
    res, out = send(after2)
    assert res.epoch == 3 and [e["epoch"] for e in s.flags["epochs"]] == [2, 3]
    res, out = send(after2b)
    assert res.epoch == 0
    _, text = engine.plugin_tool("cc-real", "decompress", {"blockId": "b1"})
    assert "listing-5-row-" in text


CODEX_CAPTURE = json.loads((Path(__file__).parent / "captures"
                            / "codex-0.171.0-autocompact.json").read_text())


def codex_body(items: list[dict], tools: bool = True) -> bytes:
    return json.dumps({"model": "gpt-5.1-codex", "stream": True, "instructions": "You are codex.",
                       "input": items, "store": False,
                       "tools": [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
                       if tools else []}).encode()


def test_real_codex_auto_compactions(backend):
    """Requests captured from codex 0.171.0's own (local) auto-compactions: its old user messages
    survive, and keep their refs."""
    engine = make_engine(backend)
    lane = LANES["responses"]
    hc = {"session_id": "cx-real", "originator": "codex_exec"}
    before, after1, after1b, before2, after2, after2b = (r["input"] for r in CODEX_CAPTURE["requests"])

    def send(items, tools=True):
        res = engine.process(codex_body(items, tools), lane, hc, render=True)
        out = res.body if res.body is not None else codex_body(items, tools)
        engine.store.record_usage("cx-real", "responses", (len(out) // 4, 0, 0, 20))
        return res, out

    _, out = send(before)
    refs = C.refs_by_text(out)
    task = refs["Work through t"]
    step2 = next(r for t, r in refs.items() if t.startswith("Step 2: readin"))
    step9 = next(r for t, r in refs.items() if t.startswith("Step 9: readin"))
    args = {"content": [{"startId": step2, "endId": step9,
                         "summary": "Listings 2 to 9 were read and checked; every row in order, nothing to follow up."}]}
    engine.record_calls("cx-real", [("call_fold1", "compress", json.dumps(args))])
    pair = [{"type": "function_call", "call_id": "call_fold1", "name": "compress", "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": "call_fold1", "output": "unsupported call: compress"}]
    res, out = send(before + pair)
    assert SECTION + b"b1" in out and b"listing-5-row-" not in out
    res, out = send(before + pair + CODEX_CAPTURE["compaction_items"], tools=False)  # the compaction request
    assert res.epoch == 0 and SECTION + b"b1" in out

    res, out = send(after1)
    assert res.epoch == 2 and res.drift != "collapse"
    s = engine.sessions["cx-real"]
    ep = s.flags["epochs"][-1]
    assert ep["agent"] == "codex" and ep["retired_blocks"] == ["b1"] and ep["kept"] > 0
    assert C.refs_by_text(out)["Work through t"] == task  # the user's message survived: its ref too
    res, out = send(after1b)
    assert res.epoch == 0 and res.drift == ""
    res, out = send(before2)
    assert res.epoch == 0 and not s.copy.latched
    res, out = send(after2)
    assert res.epoch == 3 and [e["epoch"] for e in s.flags["epochs"]] == [2, 3]
    assert C.refs_by_text(out)["Work through t"] == task
    _, text = engine.plugin_tool("cx-real", "search_context", {"query": "listing-5-row-00007"})
    assert "(inside b1)" in text


def test_the_summary_alone_may_be_folded_but_not_with_the_agents_context(backend):
    engine = make_engine(backend)
    agent = Agent(engine, "anthropic")
    ts = C.turns(14)
    fold_early(agent, ts, C.anthropic)
    agent.send(X.claude_code_alone())
    s = engine.sessions[SID]
    marker = s.flags["epochs"][-1]["marker"]
    more = [m for k in range(4) for m in ({"role": "assistant", "content": [{"type": "text", "text": f"Going on {k}."}]},
                                            {"role": "user", "content": [{"type": "text", "text": f"Next {k}."}]})]
    agent.send(X.claude_code_alone() + more)
    assert s.last_view.first_free and marker not in [r for k in s.last_view.protected(engine.fold_cfg)
                                                     for r in s.last_view.items[k].refs]
    # Claude Code 2.1.197's shape: its context block shares the message: the turn stays protected
    ctx = {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the "
                                   "following context:\n# claudeMd\nAlways run the tests.\n</system-reminder>\n"}
    head = X.claude_code_alone()[0]
    agent.send([{**head, "content": [ctx] + head["content"]}] + more)
    assert s.flags["epochs"][-1]["marker"] == marker  # the same summary: the same epoch
    assert not s.last_view.first_free and 0 in s.last_view.protected(engine.fold_cfg)


PI_CAPTURE = json.loads((Path(__file__).parent / "captures"
                         / "pi-0.73.1-overflow-compact.json").read_text())


def test_real_pi_compaction_keeps_the_refs_of_the_kept_suffix(backend):
    """pi 0.73.1 compacted on an overflow: the summary heads the history, the newest messages are
    kept after it, with their refs.  (pi sends no conversation id on this lane: see the next test.)"""
    engine = make_engine(backend)
    lane = LANES["anthropic"]
    hp = {"x-acp-session": "pi-real"}
    before, after, after_b = (r["messages"] for r in PI_CAPTURE["requests"])

    def send(messages, headers=hp):
        res = engine.process(claude_body(messages), lane, headers, render=True)
        return res, res.body if res.body is not None else claude_body(messages)

    _, out = send(before[:-8])  # an earlier request of the same turn
    refs = C.refs_by_text(out)
    step2 = next(r for t, r in refs.items() if t.startswith("Step 2: readin"))
    step9 = next(r for t, r in refs.items() if t.startswith("Step 9: readin"))
    args = {"content": [{"startId": step2, "endId": step9,
                         "summary": "Listings 2 to 9 were read and checked; every row in order, nothing to follow up."}]}
    engine.record_calls("pi-real", [("toolu_fold1", "compress", json.dumps(args))])
    pair = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_fold1", "name": "compress",
                                               "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_fold1", "is_error": True,
                                          "content": "Tool compress not found"}]}]
    res, out = send(before[:-8] + pair)
    assert SECTION + b"b1" in out
    _, out = send(before[:-8] + pair + before[-8:])
    kept = C.refs_by_text(out)

    res, out = send(after)
    assert res.epoch == 2 and res.drift != "collapse"
    ep = engine.sessions["pi-real"].flags["epochs"][-1]
    assert ep["agent"] == "pi" and ep["retired_blocks"] == ["b1"] and ep["kept"] > 0
    now = C.refs_by_text(out)
    survivors = [t for t in now if t.startswith("Step ") and t in kept]
    assert survivors and all(now[t] == kept[t] for t in survivors)
    res, _ = send(after_b)
    assert res.epoch == 0 and res.drift == ""


def test_real_pi_without_a_conversation_id_starts_a_new_session(backend):
    engine = make_engine(backend)
    lane = LANES["anthropic"]
    before, after, _ = (r["messages"] for r in PI_CAPTURE["requests"])
    first = engine.process(claude_body(before), lane, {}, render=True)
    second = engine.process(claude_body(after), lane, {}, render=True)
    assert first.session and second.session and first.session != second.session
    assert second.epoch == 0 and second.drift == ""


def test_no_reminder_goes_into_the_agents_own_summary_request(tmp_path):
    engine = make_engine(lambda: Store(tmp_path))
    agent = Agent(engine, "anthropic")
    ts = C.turns(60)
    _, out = agent.send(C.anthropic(ts, C.Scheme()) + [{"role": "user", "content": [{"type": "text", "text": "Turn 60: go on."}]}])
    assert reminder_ranges(out), "the control: this history gets a reminder"
    engine2 = make_engine(lambda: Store(tmp_path / "other"))
    agent2 = Agent(engine2, "anthropic")
    ask = {"role": "user", "content": [{"type": "text", "text": "Turn 60: go on."}, CAPTURE["compaction_prompt"]]}
    _, out = agent.send(C.anthropic(ts, C.Scheme()) + [{**ask, "content": ask["content"][:1]}])
    assert reminder_ranges(out), "the control: a newest user turn gets a reminder"
    _, out = agent2.send(C.anthropic(ts, C.Scheme()) + [ask])
    assert not reminder_ranges(out) and "[bili] " not in json.dumps(json.loads(out)["messages"])


def test_opencodes_second_compaction_is_a_third_epoch(backend):
    """opencode's summary turn is its question, the same words every time ("What did we do so far?"):
    its ref was the first epoch's marker, so the second compaction was not seen (the epoch's blocks
    stayed live, drift was logged every turn).  The answer after the question, new each time, marks it."""
    engine, agent, ts, pair, _ = folded_and_on(backend, "anthropic", C.anthropic, 16)
    more = [C.Turn(17, "Turn 17: after.", "Reply Turn 17.", tool=True)]
    res, _ = agent.send(X.opencode(more))
    assert res.epoch == 2
    _, _, out = grow_until_folded(agent, lambda t, sc, extra: X.opencode(more + t, sc, extra=extra), 20)
    assert out is not None and SECTION + b"b2" in out
    second = "Second summary: modules 20 to 60 analysed, every value recorded, nothing unusual."
    after = [C.Turn(200, "Turn 200: after the second compaction.", "Reply 200.", tool=True)]
    res, _ = agent.send(X.opencode(after, summary=second))
    s = engine.sessions[SID]
    assert res.epoch == 3 and [e["epoch"] for e in s.flags["epochs"]] == [2, 3]
    assert next(b for b in s.blocks if b.id == "b2").retired
    for t in range(201, 204):
        after.append(C.Turn(t, f"Turn {t}: more.", f"Reply {t}.", tool=True))
        res, _ = agent.send(X.opencode(after, summary=second))
        assert res.epoch == 0 and not res.drift


def test_a_codex_compaction_that_keeps_hundreds_of_user_turns_is_seen(backend):
    """codex keeps the user's turns first (up to ~20K tokens of them), then its summary: a long thread
    of short prompts put the summary past the 256 items the head was read to, the compaction was not
    seen, and the old epoch's block stood in place of user turns codex had kept on purpose."""
    engine = make_engine(backend)
    agent = Agent(engine, "responses")
    ts = C.turns(14)
    ts += [C.Turn(t, f"Turn {t}: go on.", f"Reply Turn {t}: done.", tool=False) for t in range(14, 314)]
    pair, _ = fold_early(agent, ts, C.responses)
    agent.send(C.responses(ts, C.Scheme(), pair))
    after = [C.Turn(1000, "Turn 1000: carry on.", "Reply Turn 1000: carrying on.", tool=True)]
    res, out = agent.send(X.codex(ts, after))
    assert res.epoch == 2 and SECTION + b"b1" not in out


def test_a_fork_after_a_compaction_renders_the_shared_history_as_its_parent(backend):
    """pi's compaction summary is the new history's first user turn, foldable as any old prose (the
    epoch says so); the model folded from it on.  A fork made then inherited the fold but not the epoch:
    the summary was its protected first user turn, on the wire beside the fold's summary, and the
    fork's first request differed from its parent's rendering of the same history at its first item."""
    engine = make_engine(backend)
    agents = {sid: Agent(engine, "chat", sid) for sid in ("parent", "fork")}

    def send(conv, sid):
        res, out = agents[sid].send(conv)
        return res, json.loads(out)

    ts = C.turns(14)
    send(C.chat(ts, C.Scheme()), "parent")
    ts.append(C.Turn(14, "Turn 14: next.", "Reply Turn 14.", tool=False))
    send(C.chat(ts, C.Scheme()), "parent")
    after = C.turns(24)[14:20]
    res, out = send(X.pi(after), "parent")  # pi compacts: its summary heads the new history
    assert res.epoch == 2
    refs = C.refs_by_text(json.dumps(out).encode())
    args = {"content": [{"startId": next(r for t, r in refs.items() if t.startswith("The conversati")),
                         "endId": refs["Reply Turn 17: "[:14]],
                         "summary": "Modules up to 17 reviewed: all values noted, nothing open, no changes needed."}]}
    engine.record_calls("parent", [("c1", "compress", json.dumps(args))])
    conv = X.pi(after, extra=C.proxy_call("chat", "c1", "compress", args))
    res, parent = send(conv, "parent")
    assert res.executed == ["compress"] and "was compacted into the following" not in json.dumps(parent)
    res, fork = send(conv + [{"role": "assistant", "content": "Forking here."},
                             {"role": "user", "content": "continue in the fork"}], "fork")
    assert any("a fork of parent" in n for n in res.notes)
    assert fork["messages"][:len(parent["messages"])] == parent["messages"]
    assert engine.sessions["fork"].flags["epochs"][-1]["marker"] == engine.sessions["parent"].flags["epochs"][-1]["marker"]


def test_a_reminder_of_the_old_epoch_does_not_come_back_on_a_kept_message(tmp_path):
    """codex keeps the user's own messages in its compacted history: one that carried a reminder (its
    ranges in the old history) carries none in the new epoch, whose history has none of those ranges."""
    eng = Engine(Store(str(tmp_path)), activate="always", materialize="now")
    lane, headers = LANES["responses"], {"session_id": "cx"}
    dev = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base instructions"}]}

    def user(t):
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]}

    def send(items):
        raw = json.dumps({"model": "gpt-5.1-codex", "input": items,
                          "tools": [{"type": "function", "name": "sh", "parameters": {}}]}).encode()
        res = eng.process(raw, lane, headers, render=True)
        return (res.body or raw).decode(), res

    items = [dev, user("Audit every module please.")]
    for i in range(20):
        items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {i}."}]},
                  {"type": "function_call", "call_id": f"c{i}", "name": "sh", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"OUT {i}\n" + ("row %d\n" % i) * 800}]
    send(items)
    eng.store.record_usage("cx", "responses", (60_000, 0, 0, 10))
    items.append(user("Now check the parser too."))
    out, _ = send(items)
    assert "older work can be folded" in out  # the reminder, on that user message
    eng.store.record_usage("cx", "responses", (61_000, 0, 0, 10))
    send(items + [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
                  user("You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary.")])
    eng.store.record_usage("cx", "responses", (62_000, 0, 0, 10))
    new = [dev, user("Audit every module please."), user("Now check the parser too."),
           user(compaction.CODEX_PREFIX_FULL + "\nSummary: modules 0-19 audited; parser next."), user("continue")]
    out, res = send(new)
    assert res.epoch == 2
    assert "older work can be folded" not in out and "m00058" not in out
    eng.store.close()


def test_a_fork_of_a_turn_before_codexs_compaction_keeps_its_fold(backend):
    """codex's compacted history (its initial context, the user's own messages, the summary) is longer
    than a side request: from the compaction's own request on, the parent's lineage record was the
    new history's, and a fork of an earlier turn (codex's fork, a backtrack) shared no tool call with
    it: it inherited nothing, its folded outputs back on the wire.  The old epoch's record is kept."""
    engine, agent, ts, pair, _ = folded_and_on(backend, "responses", C.responses, 14)
    before = C.responses(ts, C.Scheme(), pair)
    after = [C.Turn(1000, "Turn 1000: carry on.", "Reply Turn 1000: carrying on.", tool=True)]
    res, out = agent.send(X.codex(ts, after))
    assert res.epoch == 2 and SECTION + b"b1" not in out
    agent.send(X.codex(ts, after + [C.Turn(1001, "Turn 1001: more.", "Reply Turn 1001: more.", tool=True)]))
    fork = Agent(engine, "responses", "fork")
    res, out = fork.send(before + [{"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": "continue in the fork"}]}])
    assert any(f"a fork of {SID}" in n for n in res.notes), res.notes
    assert SECTION + b"b1" in out and b"file-2-row-" not in out
    assert [(b.id, b.active) for b in engine.sessions["fork"].blocks] == [("b1", True)]
