"""A side request (Claude Code's title or suggestion request: one message, a small model, the session's
own id) is answered between two turns of its conversation.  Its usage is counted (money), but it is
not the conversation's size: the next turn's pressure (reminders, the emergency cut near the window)
reads the conversation's last answer, and native tool calls resolve against the conversation's view."""

from __future__ import annotations

import json

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from test_mcp import call_tool, flow

SID = {"x-claude-code-session-id": "b2670633-5d88-45a2-b16c-2e73cf531229"}
READ = [{"name": "Read", "input_schema": {"type": "object"}}]


def conversation(tail: str) -> bytes:
    msgs = [{"role": "user", "content": "Read all modules."}]
    for i in range(19):
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {"f": i}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": f"OUT {i}\n" + ("data %d\n" % i) * 5000}]}]
    msgs += [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": tail}]
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs, "tools": READ}).encode()


TITLE = json.dumps({"model": "claude-haiku-4-5-20251001", "max_tokens": 32, "tools": READ, "messages": [
    {"role": "user", "content": "Generate a short title for this session: Read all modules."}]}).encode()


def turn(bili, body: bytes, input_tokens: int, **headers: str) -> bytes:
    """One request through the addon and its JSON answer reporting ``input_tokens``: what went up."""
    f = flow("/v1/messages", body, headers={**SID, **headers})
    bili.request(f)
    sent = f.request.content
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "Done."}],
              "stop_reason": "end_turn", "usage": {"input_tokens": input_tokens, "output_tokens": 5,
                                                    "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
    f.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=json.dumps(answer).encode())
    bili.responseheaders(f)
    bili.response(f)
    return sent


@pytest.mark.parametrize("side", [False, True])
def test_a_side_requests_usage_is_not_the_conversations_size(bili, side):
    turn(bili, conversation("go on"), 192_000)  # the conversation at 96% of a 200K window
    if side:
        title = turn(bili, TITLE, 420)
        # (nothing of the conversation's pressure: no reminder given to it)
        assert "[bili]" not in json.dumps(json.loads(title)["messages"])
    sent = turn(bili, conversation("next"), 193_000)
    assert sent.count(b"were cut by bili") == 3  # the emergency cut, with or without the side request between
    sid = next(iter(bili.engine.sessions))
    usage = bili.engine.store.usage(sid)
    assert usage.turns == (3 if side else 2) and usage.input_tokens == 192_000 + 193_000 + (420 if side else 0)


def test_a_native_call_after_a_side_request_resolves_against_the_conversation(bili):
    bili.tctx.configure(bili, bili_min_compress_chars=0)
    turn(bili, conversation("go on"), 1_000)
    turn(bili, TITLE, 420)
    sid = next(iter(bili.engine.sessions))
    status, doc = call_tool(bili, {"conversationId": sid, "tool": "compress", "args": {"content": [
        {"startId": "m00002", "endId": "m00009", "summary": "Read modules 0 to 3: each prints its data lines; "
                                                             "nothing to change in them."}]}})
    assert status == 200 and "b1" in doc["result"], doc


def test_both_stores_count_a_side_answer_in_the_totals_only(backend):
    from bili_addon.kernel.turn import Engine
    from bili_addon.wire import LANES

    store = backend()
    Engine(store).process(conversation("go on"), LANES["anthropic"], {"x-acp-session": "s"}, render=True)
    store.release()
    store.record_usage("s", "anthropic", (1000, 0, 0, 5))
    store.record_usage("s", "anthropic", (40, 0, 0, 2), last=False)
    usage = store.usage("s")
    assert (usage.turns, usage.input_tokens, usage.output_tokens) == (2, 1040, 7)
    assert store.last_usage("s") == (1000, 0, 0, 5)
    assert (usage.last, usage.last_n) == ((1000, 0, 0, 5), 1)  # (the second answer was not the conversation's)
    assert store.usage("nobody") == type(usage)(0, 0, 0, 0, 0, None)


def branch(n: int, tag: str) -> bytes:
    """The conversation rewound to its first message, read again on a new branch: ``n`` tool rounds."""
    msgs = [{"role": "user", "content": "Read all modules."}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"{tag}{i}", "name": "Read", "input": {"f": i}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"{tag}{i}",
                                               "content": f"OUT {tag}{i}\n" + ("data %s%d\n" % (tag, i)) * 5000}]}]
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs, "tools": READ}).encode()


def test_a_rewind_to_a_short_history_is_the_conversation_not_a_side_request(bili):
    """The user rewinds a long conversation to its first message (Claude Code's /rewind): the new
    branch's turns open as the conversation does and are its turns, short as they are; their usage is
    the conversation's size, and the first longer turn is judged by it, not by the usage before."""
    turn(bili, conversation("go on"), 192_000)  # near the window
    for n in range(5):  # 1, 3, 5, 7, 9 items
        turn(bili, branch(n, "r"), 9_000 * n + 100)
    sid = next(iter(bili.engine.sessions))
    assert bili.engine.store.last_usage(sid) == (36_100, 0, 0, 5)
    sent = turn(bili, branch(5, "r"), 45_100)  # 11 items, ~45K tokens
    assert sent.count(b"were cut by bili") == 0


def test_a_side_requests_model_and_window_are_not_the_conversations(bili):
    """A haiku title request between two turns of a 1M-window conversation: the conversation's window and
    model stay its own (acp_status told the model "window 200K, 150% used")."""
    beta = {"anthropic-beta": "context-1m-2025-08-07"}
    turn(bili, conversation("go on"), 300_000, **beta)
    turn(bili, TITLE, 420)
    eng = bili.engine
    s = eng.sessions.get(next(iter(eng.sessions)))
    assert s.model == "claude-sonnet-4-5" and eng.window_for(s) == 1_000_000
    status, doc = call_tool(bili, {"conversationId": s.row.id, "tool": "acp_status", "args": {}})
    assert status == 200 and "150%" not in doc["result"] and "30%" in doc["result"], doc


def test_a_conversation_after_a_title_request_as_short_as_it_is_the_conversation(bili):
    """Claude Code and opencode send a title request at the start, as short as the conversation's first
    turn and on another model: whichever comes first, the conversation's turn is its turn (its view is
    the one native calls resolve against, its usage its size), not a side request."""
    bili.tctx.configure(bili, bili_min_compress_chars=0)
    turn(bili, TITLE, 120)
    first = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "tools": READ, "messages": [
        {"role": "user", "content": "Read all modules, then tell me what each does. " * 40}]}).encode()
    turn(bili, first, 900)
    sid = next(iter(bili.engine.sessions))
    assert bili.engine.store.last_usage(sid) == (900, 0, 0, 5)
    assert len(bili.engine.sessions.get(sid).last_view.items) == 1
    assert "Read all modules" in json.dumps([p.text for it in bili.engine.sessions.get(sid).last_view.items
                                             for p in it.parts])


def test_a_side_request_is_not_the_conversations_last_request_to_its_cache(bili):
    """Its cache clock (the lifetime choice, held folds, the predicted share): a side request reads and
    refreshes nothing of the conversation's cache, and the next turn is compared with the turn before."""
    eng = bili.engine
    turn(bili, conversation("go on"), 30_000)
    sid = next(iter(eng.sessions))
    last = eng.clocks.last.get(sid)
    turn(bili, TITLE, 420)
    assert eng.clocks.last.get(sid) == last
    assert eng.store.wire(sid)[-1].model == "claude-haiku-4-5-20251001"  # (priced at its own model)
    f = flow("/v1/messages", conversation("next"), headers=SID)
    bili.request(f)
    assert bili.meter.predict(sid, f.request.content) > 0.9  # (the turn before's parts, not the title's)


def test_the_figures_now_are_the_conversations_last_turn_not_a_title_requests(bili):
    """``bili stats``, ``/__bili/stats`` and the page read a session's "now" (tokens as the agent sent
    them and as bili did, its model, the predicted cache share) from its last answered turn: a title
    request answered after the conversation's turn is counted (money) and listed, but is not it."""
    from bili_addon import meter

    eng = bili.engine
    turn(bili, conversation("go on"), 30_000)
    sid = next(iter(eng.sessions))
    conv = eng.store.wire(sid)[-1]
    turn(bili, TITLE, 420)
    rows = eng.store.wire(sid)
    assert [w.side for w in rows] == [False, True]
    now = meter.totals(eng.store, sid)
    assert now["model"] == "claude-sonnet-4-5" and now["turns"] == 2
    assert (now["agent_now"], now["sent_now"]) == (conv.agent_tokens, conv.sent_tokens) and now["agent_now"] > 50_000
    assert meter.summary(rows)["agent_now"] == conv.agent_tokens
    assert [t["side"] for t in bili.session_turns(eng, sid)["turns"]] == [False, True]
    listed = next(e for e in bili.stats(eng)["sessions"] if e["id"] == sid)
    assert listed["wire"]["model"] == "claude-sonnet-4-5", listed


def test_both_stores_keep_which_answered_turn_was_a_side_request(backend):
    from bili_addon.store import WireTurn

    store = backend()

    def row(model: str, tokens: int, side: bool) -> WireTurn:
        return WireTurn(0, 1.0, 1, model, tokens, tokens, 0.5, 0, 0, [], tokens, 0, 0, 5, side=side)

    store.record_wire("s", row("claude-sonnet-4-5", 90_000, False))
    store.record_wire("s", row("claude-haiku-4-5", 400, True))
    n, last, peak_a, _peak_s, models = store.wire_totals("s")
    assert (n, last.model, last.agent_tokens, last.side, peak_a) == (2, "claude-sonnet-4-5", 90_000, False, 90_000)
    assert [w.side for w in backend().wire("s")] == [False, True]  # (read back by another instance too)
    assert sorted(m[0] for m in models) == ["claude-haiku-4-5", "claude-sonnet-4-5"]
    store.record_wire("t", row("claude-haiku-4-5", 400, True))  # a session with nothing but a side request
    assert store.wire_totals("t")[1].model == "claude-haiku-4-5"


def test_a_schema_12_store_gets_the_side_column_and_its_old_turns_are_the_conversations(backend):
    from bili_addon.store import SCHEMA_VERSION, WireTurn

    s = backend()
    s.record_wire("old", WireTurn(0, 1.0, 1, "claude-sonnet-4-5", 9_000, 9_000, None, 0, 0, [], 9_000, 0, 0, 5))
    raw = s.db.execute if s.backend == "sqlite" else s._q
    raw("ALTER TABLE wire DROP COLUMN side")
    raw("UPDATE meta SET value='12' WHERE key='schema_version'")
    s.close()
    s = backend()  # opened again: migrated
    assert s.schema_version() == SCHEMA_VERSION >= 13
    assert [(w.model, w.side) for w in s.wire("old")] == [("claude-sonnet-4-5", False)]
    s.record_wire("old", WireTurn(0, 2.0, 2, "claude-haiku-4-5", 300, 300, None, 0, 0, [], 300, 0, 0, 5, side=True))
    assert s.wire_totals("old")[1].model == "claude-sonnet-4-5"


def test_after_a_compaction_a_side_answer_does_not_make_the_old_historys_usage_the_new_ones(bili):
    """The compaction's own answer reports the whole old history; the new history's first turn brought
    no usage (the agent stopped it), and a title request was answered since: the next turn is measured
    by its own size, not by the old history's usage (the side answer raised the answer count, not the
    conversation's last usage)."""
    from compactions import claude_code_summary

    turn(bili, conversation("go on"), 150_000)
    turn(bili, conversation("Summarise the conversation so far."), 192_000)  # the compaction request

    def compacted(n: int, tail: str) -> bytes:
        msgs = [{"role": "user", "content": claude_code_summary()}]
        for i in range(n):
            msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"n{i}", "name": "Read", "input": {"f": i}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"n{i}",
                                                   "content": f"NEW {i}\n" + ("row %d\n" % i) * 5000}]}]
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": tail}]
        return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs, "tools": READ}).encode()

    bili.request(flow("/v1/messages", compacted(2, "go on"), headers=SID))  # the new history: no answer came
    sid = next(iter(bili.engine.sessions))
    assert bili.engine.store.usage(sid).turns == 2
    turn(bili, TITLE, 420)  # a side request answered
    sent = turn(bili, compacted(3, "next"), 0)
    assert b"were cut by bili" not in sent  # ~30K tokens of a 200K window: nothing to cut
    usage = bili.engine.store.usage(sid)
    assert (usage.turns, usage.last_n, usage.last) == (4, 4, (0, 0, 0, 5))
