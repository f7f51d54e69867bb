"""Folding through the kernel: a compress call made by the model, executed on the next request."""

from __future__ import annotations

import json
import re

import pytest

from bili_addon.kernel.fold import POINTER, FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.stream import ResponseRewriter
from bili_addon.wire import LANES

ANTH = LANES["anthropic"]
H = {"x-acp-session": "fold-1"}
TAG = re.compile(r'<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n')
TOOLS = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]


def filler(tag: str, n: int = 1200) -> str:
    return f"{tag}: " + " ".join(f"{tag}-row-{i}" for i in range(n // 10))


def conversation(turns: int) -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": "Please audit the repository."}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {t}: reading module {t}."},
            {"type": "tool_use", "id": f"toolu_{t}", "name": "Bash", "input": {"cmd": f"cat mod{t}.py"}},
        ]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": filler(f"file-{t}")},
        ]})
    return msgs


def body(msgs: list[dict]) -> bytes:
    return json.dumps({"model": "claude-x", "max_tokens": 100, "system": "You are an agent.",
                       "tools": TOOLS, "messages": msgs}).encode()


def refs_in(payload: dict) -> dict[str, str]:
    """ref -> the text it tags, from a tagged upstream body."""
    out = {}
    for m in payload["messages"]:
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        for block in content:
            if block.get("type") == "text":
                t = TAG.match(block["text"])
                if t:
                    out[t.group(1)] = block["text"][t.end():]
    return out


def assert_valid_anthropic(payload: dict) -> None:
    msgs = payload["messages"]
    assert msgs[0]["role"] == "user"
    for i, m in enumerate(msgs):
        blocks = m["content"] if isinstance(m["content"], list) else []
        uses = {b["id"] for b in blocks if b.get("type") == "tool_use"}
        if uses:
            nxt = msgs[i + 1]["content"] if i + 1 < len(msgs) else []
            got = {b["tool_use_id"] for b in nxt if isinstance(b, dict) and b.get("type") == "tool_result"}
            assert uses <= got, f"tool_use without result at message {i}"
        results = {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"}
        if results:
            prev = msgs[i - 1]["content"] if i else []
            got = {b["id"] for b in prev if isinstance(b, dict) and b.get("type") == "tool_use"}
            assert results <= got, f"tool_result without its call at message {i}"


def model_calls(tool: str, args: dict, call_id: str) -> dict:
    """The model's (non-streamed) answer calling a proxy tool."""
    return {"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "tool_use", "id": call_id, "name": tool, "input": args}],
            "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5}}


def agent_answers_unknown(msgs: list[dict], tool: str, args: dict, call_id: str) -> list[dict]:
    """What Claude Code sends next: the call as stored, and its unknown-tool error."""
    return msgs + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": tool, "input": args}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "is_error": True,
                                      "content": f"<tool_use_error>Error: No such tool available: {tool}</tool_use_error>"}]},
    ]


@pytest.fixture
def engine(backend):
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    yield e
    e.store.close()


def roundtrip_call(engine, sid, tool, args, call_id):
    rw = ResponseRewriter("anthropic")
    rw.json_body(json.dumps(model_calls(tool, args, call_id)).encode())
    engine.record_calls(sid, rw.calls)


def fold_steps_1_to_4(engine, sid: str = "fold-1") -> list[dict]:
    """Eight steps of a conversation through ``engine``, steps 1-4 folded by a compress the agent
    answered "unknown tool" (the fold runs on the request after); returns the agent's messages."""
    msgs = conversation(8)
    refs = refs_in(json.loads(engine.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4",
                         "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(engine, sid, "compress", args, "toolu_c1")
    msgs = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    assert engine.process(body(msgs), ANTH, H, render=True).executed == ["compress"]
    return msgs


def test_tools_and_prompt_are_injected_after_the_agents_own(engine):
    out = json.loads(engine.process(body(conversation(1)), ANTH, H, render=True).body)
    assert [t["name"] for t in out["tools"]] == ["Bash", "compress", "decompress", "search_context", "acp_status"]
    assert out["system"].startswith("You are an agent.\n\n---\n\n# Context folding")
    again = engine.process(body(conversation(1)), ANTH, H, render=True).body
    assert json.loads(again)["tools"] == out["tools"]


def test_side_requests_without_tools_get_no_injection(engine):
    raw = json.dumps({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "title please"}]})
    out = json.loads(engine.process(raw.encode(), ANTH, H, render=True).body)
    assert "tools" not in out and "system" not in out


def test_compress_folds_the_range_on_the_next_request(engine):
    msgs = conversation(8)
    first = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    refs = refs_in(first)
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4",
                         "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(engine, "fold-1", "compress", args, "toolu_c1")

    nxt = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    res = engine.process(body(nxt), ANTH, H, render=True)
    out = json.loads(res.body)
    text = json.dumps(out)
    assert res.executed == ["compress"]
    assert "[Compressed conversation section b1" in text and "load_config()" in text
    for t in range(1, 5):
        assert f"file-{t}-row-" not in text, f"module {t} should be folded"
    for t in (0, 5, 6, 7):
        assert f"file-{t}-row-" in text
    # the agent's unknown-tool error was replaced by the real result
    last = out["messages"][-1]["content"][0]
    assert last["content"].startswith("Compressed m") and "→ b1" in last["content"]
    assert "is_error" not in last
    assert_valid_anthropic(out)
    assert res.marker.startswith("[bili] compressed ") and "→ b1" in res.marker

    # the same request again (a retry): nothing runs twice, the bytes are identical
    again = engine.process(body(nxt), ANTH, H, render=True)
    assert again.executed == [] and again.body == res.body


def test_fold_prefix_is_byte_stable_and_survives_a_restart(backend):
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs = conversation(8)
    refs = refs_in(json.loads(e.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 0:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 3:"))
    args = {"content": [{"startId": start, "endId": end, "summary": "Modules 0-3 read; all of them are fine, nothing to change there."}]}
    roundtrip_call(e, "fold-1", "compress", args, "toolu_c1")
    nxt = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    n1 = e.process(body(nxt), ANTH, H, render=True).body
    later = nxt + [{"role": "assistant", "content": "Audit continues."}, {"role": "user", "content": "go on"}]
    n2 = e.process(body(later), ANTH, H, render=True).body
    # turn N+1 extends turn N byte for byte up to the end of turn N's conversation
    assert n2.startswith(n1[: n1.index(b'"messages":') + len(b'"messages":')])
    head = n1[: n1.rindex(b"]}")]
    assert n2.startswith(head)
    e.store.close()
    e2 = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    assert e2.process(body(later), ANTH, H, render=True).body == n2


def test_decompress_returns_the_originals(engine):
    msgs = conversation(6)
    refs = refs_in(json.loads(engine.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 0:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 2:"))
    args = {"content": [{"startId": start, "endId": end, "summary": "Modules 0-2 were read and found fine; mod1.py holds the parser."}]}
    roundtrip_call(engine, "fold-1", "compress", args, "c1")
    msgs = agent_answers_unknown(msgs, "compress", args, "c1")
    engine.process(body(msgs), ANTH, H, render=True)
    roundtrip_call(engine, "fold-1", "decompress", {"blockId": "b1"}, "c2")
    msgs = agent_answers_unknown(msgs, "decompress", {"blockId": "b1"}, "c2")
    out = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    result = out["messages"][-1]["content"][0]["content"]
    assert result.startswith("b1 (tier 1) replaced original messages")
    assert "file-1-row-3" in result and "cat mod2.py" in result
    roundtrip_call(engine, "fold-1", "search_context", {"query": "file-2-row-7"}, "c3")
    msgs = agent_answers_unknown(msgs, "search_context", {"query": "file-2-row-7"}, "c3")
    out = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    assert "(inside b1)" in out["messages"][-1]["content"][0]["content"]


@pytest.mark.parametrize(
    "args,needle",
    [
        ({"content": [{"startId": "m09999", "endId": "m00002", "summary": "x" * 60}]}, "not in the visible"),
        ({"content": [{"startId": "m00002", "endId": "m00003", "summary": "x" * 60}]}, "too small"),
        ({"content": [{"startId": "m00002", "endId": "m00020", "summary": "short"}]}, "too short"),
        ({"content": [{"startId": "q1", "endId": "m00003", "summary": "x" * 60}]}, "neither a ref"),
        ({"nothing": True}, "Nothing compressed"),
    ],
)
def test_refused_compress_explains_why_and_folds_nothing(engine, args, needle):
    msgs = conversation(8)
    engine.process(body(msgs), ANTH, H, render=True)
    roundtrip_call(engine, "fold-1", "compress", args, "bad")
    out = json.loads(engine.process(body(agent_answers_unknown(msgs, "compress", args, "bad")), ANTH, H,
                                    render=True).body)
    assert needle in out["messages"][-1]["content"][0]["content"]
    assert "[Compressed conversation section" not in json.dumps(out["messages"])


def test_a_call_the_addon_never_saw_is_left_alone(engine):
    msgs = agent_answers_unknown(conversation(3), "compress", {"content": []}, "toolu_unknown")
    out = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    assert out["messages"][-1]["content"][0]["is_error"] is True


def test_renamed_and_rewritten_calls_are_restored(engine):
    """opencode re-sends the call as its own ``invalid`` tool; the model's call comes back."""
    msgs = conversation(6)
    refs = refs_in(json.loads(engine.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 0:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 2:"))
    args = {"content": [{"startId": start, "endId": end, "summary": "Modules 0-2 were read and found fine; mod1.py holds the parser."}]}
    roundtrip_call(engine, "fold-1", "compress", args, "toolu_oc")
    stored = msgs + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_oc", "name": "invalid",
                                           "input": {"tool": "compress", "error": "unavailable tool"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_oc",
                                      "content": "The arguments provided to the tool are invalid"}]},
    ]
    out = json.loads(engine.process(body(stored), ANTH, H, render=True).body)
    call = out["messages"][-2]["content"][0]
    shown = {"content": [{**args["content"][0], "summary": POINTER.format(id="b1")}]}  # b1 stands in the conversation
    assert call["name"] == "compress" and call["input"] == shown
    assert out["messages"][-1]["content"][0]["content"].startswith("Compressed ")


def fold_steps(engine, msgs: list[dict], entries: list[tuple[str, str, str]], call_id: str) -> tuple[dict, list]:
    """The model folds ``(first step, last step, summary)`` ranges in one compress call; the agent's
    next request carries it.  ``(the upstream body, the messages sent)``."""
    refs = refs_in(json.loads(engine.process(body(msgs), ANTH, H, render=True).body))
    ref = lambda step: next(r for r, t in refs.items() if t.startswith(f"Step {step}:"))  # noqa: E731
    args = {"content": [{"startId": ref(a), "endId": ref(b), "topic": f"steps {a}-{b}", "summary": text}
                        for a, b, text in entries]}
    roundtrip_call(engine, "fold-1", "compress", args, call_id)
    msgs = agent_answers_unknown(msgs, "compress", args, call_id)
    return json.loads(engine.process(body(msgs), ANTH, H, render=True).body), msgs


def test_a_folded_summary_goes_upstream_once_and_the_call_points_at_its_block(engine):
    """The summary stands where its range was; the call that made it shows a pointer to the block
    instead of a second copy (read on every request until the call is folded in turn).  The store
    keeps the call as the model made it, and the bytes stay the same on later turns."""
    said = "Read modules 1 to 4: nothing unusual; mod3.py defines load_config(path) for the CLI."
    out, msgs = fold_steps(engine, conversation(8), [(1, 4, said)], "toolu_c1")
    text = json.dumps(out)
    assert "[Compressed conversation section b1" in text and text.count(said) == 1
    call = out["messages"][-2]["content"][0]
    assert call["name"] == "compress"
    assert call["input"]["content"][0]["summary"] == POINTER.format(id="b1") == \
        "[bili: this summary stands in the conversation as b1]"
    assert {k: v for k, v in call["input"]["content"][0].items() if k != "summary"} == \
        {k: v for k, v in msgs[-2]["content"][0]["input"]["content"][0].items() if k != "summary"}
    assert said in engine.sessions["fold-1"].calls["toolu_c1"].args  # the model's own words, kept
    assert_valid_anthropic(out)
    prev = engine.process(body(msgs), ANTH, H, render=True).body
    more = msgs + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "go on"}]
    nxt = engine.process(body(more), ANTH, H, render=True).body
    assert nxt.startswith(prev[: prev.rindex(b"]}")]) and nxt.count(said.encode()) == 1


def test_a_refused_range_keeps_its_summary_in_the_call(engine):
    """Only a summary that stands in the conversation is pointed at: a range the call could not
    fold keeps its words in the call, the one place the model can read them."""
    kept, refused = "Steps 1 to 4 read the modules; mod3.py defines load_config(path).", "y" * 60
    out, _ = fold_steps(engine, conversation(8), [(1, 4, kept), (5, 5, refused)], "toolu_c2")
    entries = out["messages"][-2]["content"][0]["input"]["content"]
    assert [e["summary"] for e in entries] == [POINTER.format(id="b1"), refused]
    assert "too small" in out["messages"][-1]["content"][0]["content"]
    assert json.dumps(out).count(kept) == 1


def test_a_pointer_is_not_a_summary(engine):
    """A model that copied a pointer from its earlier call gets told to write the summary."""
    out, msgs = fold_steps(engine, conversation(12), [(1, 4, "Steps 1 to 4 read the modules; nothing to fix there.")],
                           "toolu_c3")
    msgs = msgs + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "go on"}]
    out, _ = fold_steps(engine, msgs, [(6, 9, POINTER.format(id="b1"))], "toolu_c4")
    result = out["messages"][-1]["content"][0]["content"]
    assert "pointer" in result and "→ b2" not in result
    assert out["messages"][-2]["content"][0]["input"]["content"][0]["summary"] == POINTER.format(id="b1")


def test_a_range_that_reaches_into_a_block_does_not_refold_it(engine):
    """A user turn protected while its neighbours were folded stays between blocks; a later range
    from it onwards folds it without absorbing the block that stands before it (kernel.md §5.4:
    only blocks whose summary stands inside the range are consumed), so the cache keeps that block."""
    steps = conversation(10)
    msgs = steps[:9] + [{"role": "user", "content": "Task 2: now the parser."}] + steps[9:]
    refs = {text[:7]: ref for ref, text in refs_in(json.loads(engine.process(body(msgs), ANTH, H,
                                                                              render=True).body)).items()}
    args = {"content": [{"startId": refs["Step 0:"], "endId": refs["Step 6:"], "summary": "Modules 0-6 read. " * 5}]}
    roundtrip_call(engine, "fold-1", "compress", args, "c1")
    msgs = agent_answers_unknown(msgs, "compress", args, "c1")
    out = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    result = out["messages"][-1]["content"][0]["content"]
    assert "→ b1" in result and "(1 protected message(s) left out)" in result  # Task 2, the newest user turn
    texts = [json.dumps(m) for m in out["messages"]]
    b1 = next(i for i, t in enumerate(texts) if "section b1" in t)
    assert "Task 2: now the parser." in texts[b1 + 1]
    msgs = msgs + [{"role": "assistant", "content": "Parser done."}, {"role": "user", "content": "Task 3: docs."}]
    before = engine.process(body(msgs), ANTH, H, render=True).body
    args = {"content": [{"startId": refs["Task 2:"], "endId": refs["Step 8:"], "summary": "Task 2 parser work. " * 5}]}
    roundtrip_call(engine, "fold-1", "compress", args, "c2")
    msgs = agent_answers_unknown(msgs, "compress", args, "c2")
    after = engine.process(body(msgs), ANTH, H, render=True).body
    out = json.loads(after)
    result = out["messages"][-1]["content"][0]["content"]
    assert "→ b2 (tier 1)" in result and "absorbing" not in result
    text = json.dumps(out["messages"])
    assert "section b1" in text and "section b2" in text and "Task 2: now the parser." not in text
    assert_valid_anthropic(out)
    # everything up to and including b1's summary kept its bytes
    cut = before.rindex(b'{"role"', 0, before.index(b"Task 2: now the parser."))
    assert after[:cut] == before[:cut] and b"section b1" in before[:cut]


def test_the_protected_zone_is_the_newest_parts(engine):
    msgs = conversation(6)
    refs = {text[:7]: ref for ref, text in refs_in(json.loads(engine.process(body(msgs), ANTH, H,
                                                                              render=True).body)).items()}
    # when the call runs, the newest four parts are its own call and error, step 5's result, and
    # step 5's prose and call
    args = {"content": [{"startId": refs["Step 5:"], "endId": refs["Step 5:"], "summary": "x" * 60}]}
    roundtrip_call(engine, "fold-1", "compress", args, "p1")
    msgs = agent_answers_unknown(msgs, "compress", args, "p1")
    out = json.loads(engine.process(body(msgs), ANTH, H, render=True).body)
    result = out["messages"][-1]["content"][0]["content"]
    assert "not compressed" in result and "the newest 4 message parts" in result


def test_a_compress_whose_turn_is_computed_again_runs_once(engine, monkeypatch):
    """Another process writes the session between the fold and the end of the turn: the turn is
    computed again from the store, which already has the fold and its result."""
    from bili_addon.store import StaleSession

    msgs = conversation(8)
    refs = refs_in(json.loads(engine.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "summary": "Modules 1-4 were read and found fine; nothing to change in any of them."}]}
    roundtrip_call(engine, "fold-1", "compress", args, "toolu_c1")
    real = engine.store.commit_fold
    raced = []

    def racing(sid, blocks, originals, results, *, expect):
        if not blocks and results and not raced:  # the turn's last fold write: another process got there first
            raced.append(1)
            raise StaleSession(sid, expect, expect + 1)
        return real(sid, blocks, originals, results, expect=expect)

    monkeypatch.setattr(engine.store, "commit_fold", racing)
    res = engine.process(body(agent_answers_unknown(msgs, "compress", args, "toolu_c1")), ANTH, H, render=True)
    assert raced and res.executed == []  # the retry found the call already run
    out = json.loads(res.body)
    last = out["messages"][-1]["content"][0]
    assert last["content"].startswith("Compressed m") and "→ b1" in last["content"]
    assert len(engine.store.blocks("fold-1")) == 1


def test_an_id_twice_in_one_answer_is_its_first_call_in_memory_as_in_the_store(engine):
    """The store keeps the first of two calls with one id (INSERT OR IGNORE); the session in memory
    kept the second: another instance, or this one after a restart, saw other arguments."""
    engine.process(body(conversation(2)), ANTH, H, render=True)
    engine.record_calls("fold-1", [("toolu_x", "search_context", '{"query":"alpha"}'),
                                   ("toolu_x", "search_context", '{"query":"file-3"}')])
    assert engine.sessions.get("fold-1").calls["toolu_x"].args == '{"query":"alpha"}'
    assert [c for c in engine.store.calls("fold-1") if c[0] == "toolu_x"][0][2] == '{"query":"alpha"}'


def test_a_short_rewind_into_a_fold_leaves_its_summary_out(engine):
    """Steps 1-4 folded, then the user rewinds to step 2 and goes another way: a history of fewer than
    ten items, which the coverage check took for a side request (a title, a probe) and left alone.  The
    summary then stood in place of step 1 and told the model of steps 3-4, which this branch does not
    have.  A side request still moves nothing of the copy, but a block whose range it holds in part is
    not rendered for it; back on the first branch it is."""
    msgs = fold_steps_1_to_4(engine)
    rew = msgs[:7] + [{"role": "user", "content": "Let us take another way from here."}]
    res = engine.process(body(rew), ANTH, H, render=True)
    out = res.body or body(rew)
    assert b"Read modules 1 to 4" not in out and b"Step 1: reading" in out and b"Step 2: reading" in out
    assert not res.drift  # (the copy: untouched)
    assert b"Read modules 1 to 4" in engine.process(body(msgs), ANTH, H, render=True).body
    title = [{"role": "user", "content": msgs[0]["content"]}]  # (a side request of no folded message: as it was)
    assert engine.process(body(title), ANTH, H, render=True).drift == ""
