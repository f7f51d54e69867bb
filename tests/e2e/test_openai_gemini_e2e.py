"""OpenAI Chat Completions, Responses (HTTP and WebSocket) and Gemini through a real
``mitmdump --mode reverse`` with the bili addon in fold mode."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from .fake_upstream import REPLY_TEXT
from .support import (
    assert_headers_forwarded,
    assert_only_tags_added,
    openai_client,
    request,
    sse_events,
    strip_tags,
)

pytestmark = pytest.mark.e2e

MODEL = "gpt-fake-1"


def increasing(refs: list[str]) -> bool:
    return refs == sorted(set(refs))


# -- Chat Completions -------------------------------------------------------------------------------

CHAT_ARGS = '{"path": ".",  "all": true, "glob": "*.py"}'


def chat_history(u1: str, u2: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": u1},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_ls_1", "type": "function", "function": {"name": "list_files", "arguments": CHAT_ARGS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_ls_1", "content": "a.py\nb.py"},
        {"role": "assistant", "content": "There are two files: a.py and b.py."},
        {"role": "user", "content": [{"type": "text", "text": u2}]},
    ]


def test_chat_non_streaming_tags_prose_and_keeps_tool_calls_byte_exact(fake, reverse_proxy, sid):
    client, tee = openai_client(reverse_proxy.url + "/v1")
    u1, u2 = "List the Python files in this repository.", "Open a.py and explain it."
    out = client.chat.completions.create(
        model=MODEL, messages=chat_history(u1, u2), temperature=0, extra_headers={"x-session-id": sid}
    )
    assert out.choices[0].message.content == REPLY_TEXT

    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.route == "/v1/chat/completions" and rec.status == 200
    sent = tee.last.request_json
    tags = assert_only_tags_added(rec.json, sent)
    assert [t.text for t in tags] == [u1, "There are two files: a.py and b.py.", u2]
    assert tags[0].ref == "m00001" and increasing([t.ref for t in tags])
    assert rec.json["messages"][0] == sent["messages"][0]  # system prompt untouched
    assert rec.json["messages"][2] == sent["messages"][2] and rec.json["messages"][3] == sent["messages"][3]
    assert rec.json["messages"][2]["tool_calls"][0]["function"]["arguments"] == CHAT_ARGS
    encoded_args = json.dumps(CHAT_ARGS).encode()
    assert encoded_args in tee.last.request_body and encoded_args in rec.raw
    assert_headers_forwarded(rec, tee.last.request_headers)
    assert tee.last.response_body == rec.response


def test_chat_streaming_second_turn_reuses_refs(fake, reverse_proxy, sid):
    client, tee = openai_client(reverse_proxy.url + "/v1")
    u1, u2 = "List the Python files in this repository.", "Open a.py and explain it."
    history = chat_history(u1, u2)

    def run(messages) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, extra_headers={"x-session-id": sid}
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert run(history) == REPLY_TEXT
    first = fake.last(lambda r: r.header("x-session-id") == sid)
    assert tee.last.response_body == first.response
    assert sse_events(first.response)[-1] == ("", "[DONE]")
    tags1 = assert_only_tags_added(first.json, tee.last.request_json)

    u3 = "Thanks. Now add a docstring."
    assert run(history + [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": u3}]) == REPLY_TEXT
    second = fake.last(lambda r: r.header("x-session-id") == sid)
    tags2 = assert_only_tags_added(second.json, tee.last.request_json)
    assert [(t.text, t.ref) for t in tags2[: len(tags1)]] == [(t.text, t.ref) for t in tags1]
    new = tags2[len(tags1):]
    assert [t.text for t in new] == [REPLY_TEXT, u3]
    assert increasing([t.ref for t in tags2])
    assert second.json["messages"][: len(history)] == first.json["messages"]
    assert tee.last.response_body == second.response


# -- Responses over HTTP ----------------------------------------------------------------------------

RESP_ARGS = '{"path":"main.py", "lines": [1,  20]}'


def responses_input(u1: str, u2: str) -> list[dict]:
    return [
        {"role": "user", "content": u1},
        {"type": "function_call", "call_id": "call_rf_1", "name": "read_file", "arguments": RESP_ARGS},
        {"type": "function_call_output", "call_id": "call_rf_1", "output": "print(1)\n"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The file prints 1."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": u2}]},
    ]


def _check_responses_body(rec, tee, u1: str, u2: str) -> list:
    sent = tee.last.request_json
    tags = assert_only_tags_added(rec.json, sent)
    assert [t.text for t in tags] == [u1, "The file prints 1.", u2]
    assert tags[0].ref == "m00001" and increasing([t.ref for t in tags])
    assert rec.json["instructions"] == sent["instructions"]
    assert rec.json["input"][1] == sent["input"][1] and rec.json["input"][2] == sent["input"][2]
    assert rec.json["input"][1]["arguments"] == RESP_ARGS
    encoded_args = json.dumps(RESP_ARGS).encode()
    assert encoded_args in tee.last.request_body and encoded_args in rec.raw
    return tags


def test_responses_non_streaming(fake, reverse_proxy, sid):
    client, tee = openai_client(reverse_proxy.url + "/v1")
    u1, u2 = "Find the bug in main.py please.", "Fix it with the smallest change."
    out = client.responses.create(
        model=MODEL, instructions="Be brief.", input=responses_input(u1, u2), prompt_cache_key=sid
    )
    assert out.output_text == REPLY_TEXT
    rec = fake.last(lambda r: isinstance(r.json, dict) and r.json.get("prompt_cache_key") == sid)
    assert rec.route == "/v1/responses" and rec.status == 200
    _check_responses_body(rec, tee, u1, u2)
    assert tee.last.response_body == rec.response
    assert reverse_proxy.session(sid) is not None


def test_responses_streaming(fake, reverse_proxy, sid):
    client, tee = openai_client(reverse_proxy.url + "/v1")
    u1, u2 = "Find the bug in util.py please.", "Fix it and explain the fix."
    stream = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=responses_input(u1, u2),
        stream=True,
        extra_headers={"session_id": sid},
    )
    events = list(stream)
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY_TEXT

    rec = fake.last(lambda r: r.header("session_id") == sid)
    _check_responses_body(rec, tee, u1, u2)
    assert tee.last.response_body == rec.response
    names = [e for e, _ in sse_events(rec.response)]
    assert names[0] == "response.created" and "response.output_item.done" in names


# -- Responses over WebSocket -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws_proxy(reverse_proxy):
    """Fold mode lets WebSocket upgrades through (the default; ``bili_refuse_websocket`` refuses them)."""
    return reverse_proxy


def test_fold_mode_refuses_responses_websocket_when_asked(fake, make_proxy, sid):
    proxy = make_proxy("reverse", "fold", bili_refuse_websocket="true")
    with pytest.raises(InvalidStatus) as e:
        with ws_connect(
            f"ws://127.0.0.1:{proxy.port}/v1/responses", additional_headers={"session_id": sid}, proxy=None
        ):
            pass
    assert e.value.response.status_code == 426
    assert "error" in json.loads(e.value.response.body)
    assert not fake.find(lambda r: r.header("session_id") == sid)


def _ws_turn(ws, frame: dict) -> list[str]:
    ws.send(json.dumps(frame))
    got = []
    while True:
        msg = ws.recv(timeout=30)
        got.append(msg)
        if json.loads(msg)["type"] in ("response.completed", "error"):
            return got


def test_responses_websocket_frames_are_tagged(fake, ws_proxy, sid):
    u1, u2 = "Over the socket: what does this repo do?", "And how do I run its tests?"
    frame1 = {"type": "response.create", "model": MODEL, "instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": u1}]},
    ]}
    frame2 = dict(frame1, input=frame1["input"] + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": REPLY_TEXT}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": u2}]},
    ])
    with ws_connect(
        f"ws://127.0.0.1:{ws_proxy.port}/v1/responses", additional_headers={"session_id": sid}, proxy=None
    ) as ws:
        got1 = _ws_turn(ws, frame1)
        got2 = _ws_turn(ws, frame2)

    first, second = fake.find(lambda r: r.transport == "ws" and r.header("session_id") == sid)
    assert first.route == "/v1/responses"
    tags1 = assert_only_tags_added(first.json, frame1)
    assert [(t.text, t.ref) for t in tags1] == [(u1, "m00001")]
    tags2 = assert_only_tags_added(second.json, frame2)
    assert [t.text for t in tags2] == [u1, REPLY_TEXT, u2]
    assert tags2[0].ref == "m00001" and increasing([t.ref for t in tags2])
    # the server's frames reach the client unchanged
    assert "\n".join(got1).encode() == first.response
    assert "\n".join(got2).encode() == second.response
    assert json.loads(got2[-1])["type"] == "response.completed"


def test_responses_websocket_with_the_openai_sdk(fake, ws_proxy, sid):
    client, _ = openai_client(ws_proxy.url + "/v1")
    u1 = "SDK socket: summarise the README in one line."
    with client.responses.connect(extra_headers={"session_id": sid}) as conn:
        conn.response.create(model=MODEL, input=[{"role": "user", "content": u1}])
        for event in conn:
            if event.type in ("response.completed", "error"):
                break
    assert event.type == "response.completed"
    assert event.response.output_text == REPLY_TEXT
    rec = fake.last(lambda r: r.transport == "ws" and r.header("session_id") == sid)
    _, tags = strip_tags(rec.json)
    assert [(t.text, t.ref) for t in tags] == [(u1, "m00001")]


# -- Gemini -----------------------------------------------------------------------------------------


def gemini_body(u1: str, u2: str) -> dict:
    return {
        "systemInstruction": {"parts": [{"text": "You are a helpful assistant."}]},
        "contents": [
            {"role": "user", "parts": [{"text": u1}]},
            {"role": "model", "parts": [{"functionCall": {"name": "get_time", "args": {"tz": "UTC", "fmt": "%H:%M"}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "get_time", "response": {"time": "12:00"}}}]},
            {"role": "model", "parts": [{"text": "It is noon in UTC."}]},
            {"role": "user", "parts": [{"text": u2}]},
        ],
        "generationConfig": {"temperature": 0, "maxOutputTokens": 64},
    }


def test_gemini_generate_content(fake, reverse_proxy, sid):
    u1, u2 = "What time is it in UTC right now?", "And in Tokyo?"
    body = gemini_body(u1, u2)
    raw = json.dumps(body).encode()
    reply = request(
        reverse_proxy.url + "/v1beta/models/gemini-x:generateContent",
        raw,
        headers={"content-type": "application/json", "x-goog-api-key": "fake", "x-session-id": sid},
    )
    assert reply.status == 200, reply.body
    assert reply.json()["candidates"][0]["content"]["parts"][0]["text"] == REPLY_TEXT

    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.route == "/v1beta/models/gemini-x:generateContent"
    tags = assert_only_tags_added(rec.json, body)
    assert [t.text for t in tags] == [u1, "It is noon in UTC.", u2]
    assert [t.path for t in tags] == [
        ("contents", 0, "parts", 0, "text"),
        ("contents", 3, "parts", 0, "text"),
        ("contents", 4, "parts", 0, "text"),
    ]
    assert tags[0].ref == "m00001" and increasing([t.ref for t in tags])
    assert rec.json["systemInstruction"] == body["systemInstruction"]
    assert reply.body == rec.response


def test_gemini_stream_generate_content_sse(fake, reverse_proxy, sid):
    u1 = "Write a haiku about proxies, streamed."
    body = {"contents": [{"role": "user", "parts": [{"text": u1}]}]}
    reply = request(
        reverse_proxy.url + "/v1beta/models/gemini-x:streamGenerateContent?alt=sse",
        json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": sid},
    )
    assert reply.status == 200, reply.body
    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.path == "/v1beta/models/gemini-x:streamGenerateContent?alt=sse"
    tags = assert_only_tags_added(rec.json, body)
    assert [(t.text, t.ref) for t in tags] == [(u1, "m00001")]
    assert reply.body == rec.response
    texts = [json.loads(d)["candidates"][0]["content"]["parts"][0]["text"] for _, d in sse_events(reply.body)]
    assert "".join(texts) == REPLY_TEXT
