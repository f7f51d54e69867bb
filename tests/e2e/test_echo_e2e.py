"""The response side in fold mode: a model that imitates the ``<acp ...>mNNNNN</acp>`` tags it is
shown must not hand them to the agent.  The fake is told (``x-fake-reply``) to answer with a tag
echo in front of its prose, streamed in 7-character pieces so the tag is split across events; the
client must see the prose without the echo, in every lane, streamed or not.  Tool-call arguments
that happen to contain tag-like text are data and must arrive unchanged."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from websockets.sync.client import connect as ws_connect

from .support import anthropic_client, openai_client, request, sse_events

pytestmark = pytest.mark.e2e

ECHO = '<acp tokens="12" type="text">m00003</acp>\nSure, here is the plan.'
CLEAN = "Sure, here is the plan."
TOOL_ARGS = json.dumps({"note": '<acp tokens="1" type="text">m00001</acp>\nkeep me', "n": 1})


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold", bili_refuse_websocket="false")


def fake_headers(sid: str, *, tool: bool = False) -> dict[str, str]:
    h = {"x-session-id": sid, "x-fake-reply": urllib.parse.quote(ECHO)}
    if tool:
        h["x-fake-tool"] = urllib.parse.quote("save_note:" + TOOL_ARGS)
    return h


def upstream_said_the_echo(fake, sid: str) -> None:
    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.status == 200 and b"m00003" in rec.response


def test_anthropic_json(fake, proxy, sid):
    client, _ = anthropic_client(proxy.url)
    msg = client.messages.create(
        model="claude-fake-1", max_tokens=64, messages=[{"role": "user", "content": "Plan it."}],
        extra_headers=fake_headers(sid, tool=True),
    )
    upstream_said_the_echo(fake, sid)
    assert msg.content[0].text == CLEAN
    assert msg.content[1].type == "tool_use" and msg.content[1].input == json.loads(TOOL_ARGS)


def test_anthropic_sse(fake, proxy, sid):
    client, tee = anthropic_client(proxy.url)
    with client.messages.stream(
        model="claude-fake-1", max_tokens=64, messages=[{"role": "user", "content": "Plan it."}],
        extra_headers=fake_headers(sid, tool=True),
    ) as stream:
        final = stream.get_final_message()
    upstream_said_the_echo(fake, sid)
    assert final.content[0].text == CLEAN
    assert final.content[1].input == json.loads(TOOL_ARGS)
    names = [e for e, _ in sse_events(tee.last.response_body)]
    assert names[0] == "message_start" and names[-1] == "message_stop"


def test_chat_json(fake, proxy, sid):
    client, _ = openai_client(proxy.url + "/v1")
    out = client.chat.completions.create(
        model="gpt-fake-1", messages=[{"role": "user", "content": "Plan it."}], extra_headers=fake_headers(sid, tool=True)
    )
    upstream_said_the_echo(fake, sid)
    assert out.choices[0].message.content == CLEAN
    assert out.choices[0].message.tool_calls[0].function.arguments == TOOL_ARGS


def test_chat_sse(fake, proxy, sid):
    client, tee = openai_client(proxy.url + "/v1")
    stream = client.chat.completions.create(
        model="gpt-fake-1", messages=[{"role": "user", "content": "Plan it."}], stream=True,
        extra_headers=fake_headers(sid, tool=True),
    )
    text, args = "", ""
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        text += d.content or ""
        for call in d.tool_calls or []:
            args += call.function.arguments or ""
    upstream_said_the_echo(fake, sid)
    assert text == CLEAN
    assert args == TOOL_ARGS
    assert sse_events(tee.last.response_body)[-1] == ("", "[DONE]")


def test_responses_json(fake, proxy, sid):
    client, _ = openai_client(proxy.url + "/v1")
    out = client.responses.create(
        model="gpt-fake-1", input=[{"role": "user", "content": "Plan it."}], extra_headers=fake_headers(sid, tool=True)
    )
    upstream_said_the_echo(fake, sid)
    assert out.output_text == CLEAN
    assert out.output[1].arguments == TOOL_ARGS


def test_responses_sse(fake, proxy, sid):
    client, _ = openai_client(proxy.url + "/v1")
    events = list(client.responses.create(
        model="gpt-fake-1", input=[{"role": "user", "content": "Plan it."}], stream=True,
        extra_headers=fake_headers(sid, tool=True),
    ))
    upstream_said_the_echo(fake, sid)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CLEAN
    assert [e.text for e in events if e.type == "response.output_text.done"] == [CLEAN]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == TOOL_ARGS
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == CLEAN and done.response.output[1].arguments == TOOL_ARGS


def test_responses_websocket(fake, proxy, sid):
    frame = {"type": "response.create", "model": "gpt-fake-1", "input": [{"role": "user", "content": "Plan it."}]}
    events = []
    with ws_connect(
        f"ws://127.0.0.1:{proxy.port}/v1/responses", additional_headers=fake_headers(sid, tool=True), proxy=None
    ) as ws:
        ws.send(json.dumps(frame))
        while True:
            events.append(json.loads(ws.recv(timeout=30)))
            if events[-1]["type"] in ("response.completed", "error"):
                break
    rec = fake.last(lambda r: r.transport == "ws" and r.header("x-session-id") == sid)
    assert b"m00003" in rec.response
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == CLEAN
    done = events[-1]
    assert done["type"] == "response.completed"
    assert done["response"]["output"][0]["content"][0]["text"] == CLEAN
    assert done["response"]["output"][1]["arguments"] == TOOL_ARGS


GEMINI_PATHS = {
    "json": "generateContent",
    "sse": "streamGenerateContent?alt=sse",
    "json-array": "streamGenerateContent",  # the REST default: one JSON array of chunks
}

@pytest.mark.parametrize("kind", list(GEMINI_PATHS))
def test_gemini(fake, proxy, sid, kind):
    path = "/v1beta/models/gemini-x:" + GEMINI_PATHS[kind]
    body = json.dumps({"contents": [{"role": "user", "parts": [{"text": "Plan it, Gemini."}]}]}).encode()
    reply = request(proxy.url + path, body, headers={"content-type": "application/json", **fake_headers(sid, tool=True)})
    assert reply.status == 200, reply.body
    upstream_said_the_echo(fake, sid)
    chunks = {
        "json": lambda: [reply.json()],
        "sse": lambda: [json.loads(d) for _, d in sse_events(reply.body)],
        "json-array": lambda: reply.json(),
    }[kind]()
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert "".join(p.get("text", "") for p in parts) == CLEAN
    assert [p["functionCall"]["args"] for p in parts if "functionCall" in p] == [json.loads(TOOL_ARGS)]


@pytest.mark.parametrize("how", ["gzip-members", "zstd-frames", "gzip-label"])
def test_anthropic_sse_compressed_as_servers_in_the_wild_do(fake, proxy, sid, how):
    """A stream compressed event by event (a gzip member or zstd frame each), or labelled gzip and
    sent plain: the agent gets the whole answer, cleaned.  A decoder that raised on these dropped
    the connection (mitmproxy calls the stream outside its addon guard)."""
    client, tee = anthropic_client(proxy.url)
    with client.messages.stream(
        model="claude-fake-1", max_tokens=64, messages=[{"role": "user", "content": "Plan it."}],
        extra_headers={**fake_headers(sid, tool=True), "x-fake-stream-encoding": how},
    ) as stream:
        final = stream.get_final_message()
    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.response_encoding in ("gzip", "zstd") and b"m00003" in rec.response
    assert final.content[0].text == CLEAN
    assert final.content[1].input == json.loads(TOOL_ARGS)
    names = [e for e, _ in sse_events(tee.last.response_body)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
