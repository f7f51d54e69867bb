"""The window a session's pressure (reminders, the emergency cut) is judged against: the model's input
budget, and what a provider's "context too long" refusal teaches, stated or not."""

from __future__ import annotations

import json

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from bili_addon.kernel.windows import context_window, is_overflow, learned_window
from test_mcp import flow


@pytest.mark.parametrize("model", ["gpt-5", "gpt-5.2", "gpt-5-codex", "gpt-5.1-codex-max"])
def test_the_gpt5_family_holds_272k_of_input(model):
    """400K is their input and output together: a request's input may hold 272K (codex's own table)."""
    assert context_window(model) == 272_000


def test_anthropics_input_and_answer_refusal_teaches_the_input_it_allows():
    err = ('{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` '
           'exceed context limit: 188240 + 21333 > 200000, decrease input length or `max_tokens` and try again"}}')
    assert is_overflow(400, err)
    assert learned_window(400, err) == 200_000 - 21_333


def chat_body(n: int) -> bytes:
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Read them all."}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"i": i})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"OUT {i}\n" + ("row %d\n" % i) * 4000}]
    msgs.append({"role": "user", "content": "go on"})
    return json.dumps({"model": "gpt-5.2", "messages": msgs}).encode()


def test_a_refusal_that_states_no_number_teaches_a_window_below_the_refused_request(bili):
    """OpenAI's refusal ("Your input exceeds the context window of this model") states no number: the
    refused request held at least the window, so a little less than its size is learned, and the
    retry of the same history gets the emergency cut the first one lacked."""
    headers = {"x_acp_session": "gpt-long"}
    f = flow("/v1/chat/completions", chat_body(30), headers=headers)
    f.request.host = "api.openai.com"
    bili.request(f)
    sent = json.loads(f.request.content)
    assert not any("were cut by bili" in json.dumps(m) for m in sent["messages"])
    error = {"error": {"message": "Your input exceeds the context window of this model. Please adjust your input "
                                  "and try again.", "type": "invalid_request_error", "code": "context_length_exceeded"}}
    f.response = tutils.tresp(status_code=400, headers=http.Headers(content_type="application/json"),
                              content=json.dumps(error).encode())
    bili.responseheaders(f)
    bili.response(f)
    s = bili.engine.sessions.get("gpt-long")
    learned = s.flags["learned_windows"]["gpt-5.2"]
    assert 0 < learned < 272_000 and learned < s.last_view.sums().tokens[-1]
    again = flow("/v1/chat/completions", chat_body(30), headers=headers)
    again.request.host = "api.openai.com"
    bili.request(again)
    assert "were cut by bili" in again.request.content.decode()


def anthropic_turn(bili, body: bytes, status: int = 200, error: dict | None = None, sid: str = "big") -> bytes:
    f = flow("/v1/messages", body, headers={"x_acp_session": sid})
    bili.request(f)
    sent = f.request.content
    if error is None:
        answer = {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "ok"}],
                  "stop_reason": "end_turn", "usage": {"input_tokens": 1000, "output_tokens": 5,
                                                        "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
        f.response = tutils.tresp(headers=http.Headers(content_type="application/json"),
                                  content=json.dumps(answer).encode())
    else:
        f.response = tutils.tresp(status_code=status, headers=http.Headers(content_type="application/json"),
                                  content=json.dumps(error).encode())
    bili.responseheaders(f)
    bili.response(f)
    return sent


def reads(n: int) -> bytes:
    msgs = [{"role": "user", "content": "Read all modules."}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read", "input": {"f": i}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": f"OUT {i}\n" + ("data %d\n" % i) * 2000}]}]
    msgs.append({"role": "user", "content": [{"type": "text", "text": "and this screenshot"}]})
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs,
                       "tools": [{"name": "Read", "input_schema": {"type": "object"}}]}).encode()


def test_a_413_on_the_request_bytes_teaches_no_window(bili):
    """Anthropic's 413 ``request_too_large`` is its limit on a request's bytes (screenshots, PDFs), not on
    its tokens: the conversation's window stays, and the next request (the image dropped) is not cut."""
    too_large = {"type": "error", "error": {"type": "request_too_large",
                                            "message": "Request exceeds the maximum allowed number of bytes."}}
    anthropic_turn(bili, reads(12), 413, too_large)
    s = bili.engine.sessions.get("big")
    assert not s.flags.get("learned_windows")
    assert b"were cut by bili" not in anthropic_turn(bili, reads(12))


def test_a_side_requests_refusal_teaches_no_window(bili):
    turn_body = reads(12)
    anthropic_turn(bili, turn_body)
    title = json.dumps({"model": "claude-haiku-4-5", "max_tokens": 32, "messages": [
        {"role": "user", "content": "Generate a short title for this session."}]}).encode()
    overflow = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}}
    anthropic_turn(bili, title, 400, overflow)
    assert not bili.engine.sessions.get("big").flags.get("learned_windows")
