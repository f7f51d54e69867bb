"""The fake upstream itself, without a proxy: it must be as picky as the real APIs, or the
end-to-end tests could not notice a request the proxy broke."""

from __future__ import annotations

import gzip
import json

import pytest
import zstandard
from websockets.sync.client import connect as ws_connect

from .fake_upstream import REPLY_TEXT
from .support import request

pytestmark = pytest.mark.e2e


def post(fake, path: str, body, **headers: str):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(fake.url + path, raw, headers={"content-type": "application/json", **headers})


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}

BAD = [
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [U, U]}, "alternate"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [A]}, "first message"),
    ("/v1/messages", {"model": "m", "messages": [U]}, "max_tokens"),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 5, "messages": [
            U, A, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
        "tool_use_id",
    ),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 5, "messages": [
            U, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, U]},
        "without `tool_result`",
    ),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "non-empty"),
    ("/v1/chat/completions", {"model": "m", "messages": [U, {"role": "tool", "tool_call_id": "c1", "content": "x"}]}, "tool_calls"),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [U, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
        "arguments",
    ),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [U, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, U]},
        "c1",
    ),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "c9"),
    ("/v1beta/models/g:generateContent", {"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "role"),
    ("/v1beta/models/g:generateContent", {"contents": []}, "contents"),
]


@pytest.mark.parametrize("path,body,needle", BAD, ids=[f"{p.rsplit('/', 1)[-1]}-{n}" for p, _, n in BAD])
def test_invalid_requests_get_a_provider_shaped_400(fake, path, body, needle):
    reply = post(fake, path, body)
    assert reply.status == 400
    err = reply.json()["error"]
    assert needle in err["message"]


def test_valid_requests_and_encodings_are_accepted(fake):
    body = {"model": "m", "max_tokens": 5, "messages": [U]}
    raw = json.dumps(body).encode()
    for enc, packed in (("gzip", gzip.compress(raw)), ("zstd", zstandard.ZstdCompressor().compress(raw))):
        reply = post(fake, "/v1/messages", packed, **{"content-encoding": enc, "x-case": enc})
        assert reply.status == 200 and reply.json()["content"][0]["text"] == REPLY_TEXT
        rec = fake.last(lambda r: r.header("x-case") == enc)
        assert rec.raw == packed and rec.body == raw and rec.json == body and rec.content_encoding == enc
    assert post(fake, "/v1/messages", b"\x00garbage", **{"content-encoding": "gzip"}).status == 400
    assert post(fake, "/v1/messages", b"{not json").status == 400
    assert request(fake.url + "/v1/models").json()["data"][0]["id"] == "fake-model"
    assert post(fake, "/api/anything", b"{}").json()["echo"]["path"] == "/api/anything"


@pytest.mark.parametrize("which", ["same-port", "ws-port"])
def test_websocket_on_both_ports(fake, which):
    port = fake.port if which == "same-port" else fake.ws_port
    with ws_connect(f"ws://127.0.0.1:{port}/v1/responses", proxy=None, additional_headers={"x-case": which}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": [U]}))
        while (event := json.loads(ws.recv(timeout=10)))["type"] != "response.completed":
            pass
        ws.send(json.dumps({"type": "response.create", "model": "m",
                            "input": [{"type": "function_call_output", "call_id": "nope", "output": ""}]}))
        assert json.loads(ws.recv(timeout=10))["type"] == "error"
    assert event["response"]["output"][0]["content"][0]["text"] == REPLY_TEXT
    recs = fake.find(lambda r: r.transport == "ws" and r.header("x-case") == which)
    assert [r.status for r in recs] == [200, 400]


def _ws_create(ws, **frame) -> dict:
    ws.send(json.dumps({"type": "response.create", "model": "m", **frame}))
    while (event := json.loads(ws.recv(timeout=10)))["type"] not in ("response.completed", "error"):
        pass
    return event


def test_websocket_chains_live_on_their_connection_unless_stored(fake):
    url = f"ws://127.0.0.1:{fake.ws_port}/v1/responses"
    with ws_connect(url, proxy=None, additional_headers={"x-case": "chains"}) as ws:
        first = _ws_create(ws, input=[U], store=False)["response"]
        nxt = _ws_create(ws, previous_response_id=first["id"], input=[{"role": "user", "content": "and?"}], store=False)
        assert nxt["type"] == "response.completed"
        kept = _ws_create(ws, input=[U], store=True)["response"]
        unknown = _ws_create(ws, previous_response_id="resp_never_made", input=[U])
        assert unknown["type"] == "error" and "not found" in unknown["error"]["message"]
    with ws_connect(url, proxy=None, additional_headers={"x-case": "chains"}) as ws:
        # another connection: the store: false chain is gone, the stored one is not
        gone = _ws_create(ws, previous_response_id=nxt["response"]["id"], input=[U])
        assert gone["type"] == "error" and "not found" in gone["error"]["message"]
        assert _ws_create(ws, previous_response_id=kept["id"], input=[U])["type"] == "response.completed"
    recs = fake.find(lambda r: r.transport == "ws" and r.header("x-case") == "chains")
    assert [r.status for r in recs] == [200, 200, 200, 400, 400, 200]
    # the conversation the fake answered: the chain (input + output) plus the frame's items
    second = recs[1].conversation
    assert second[0] == U and second[1]["role"] == "assistant" and second[1]["content"][0]["text"] == REPLY_TEXT
    assert second[2] == {"role": "user", "content": "and?"}
