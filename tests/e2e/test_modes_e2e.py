"""``bili_mode=passthrough`` (byte-exact, records nothing) and ``bili_mode=observe`` (records refs and
stats, forwards the bytes unchanged), each through its own real mitmdump."""

from __future__ import annotations

import gzip
import json

import pytest
from websockets.sync.client import connect as ws_connect

from .fake_upstream import REPLY_TEXT
from .support import anthropic_client, assert_headers_forwarded, openai_client, strip_tags
from .support import request as http_request

pytestmark = pytest.mark.e2e

# valid JSON, deliberately formatted the way no encoder would: any re-encoding shows
ODD = (
    b'{ "model" :  "claude-fake-1" ,\n  "max_tokens":16,   "system" : "Be \\u0062rief.",\n'
    b'  "messages" : [ { "role" : "user" , "content" : "An oddly   formatted   question?" } ,\n'
    b'{"role":"assistant","content":[ {"type":"text","text":"An answer."} ]},\t'
    b'{"role":"user","content":"And a follow-up \\u00e9t\\u00e9 question."} ] }'
)


@pytest.fixture(scope="module")
def passthrough(make_proxy):
    return make_proxy("reverse", "passthrough")


@pytest.fixture(scope="module")
def observe(make_proxy):
    return make_proxy("reverse", "observe")


def _post(proxy, sid: str, body: bytes, **headers: str):
    return http_request(
        proxy.url + "/v1/messages",
        body,
        headers={"content-type": "application/json", "x-claude-code-session-id": sid, **headers},
    )


def _of(sid: str):
    return lambda r: r.header("x-claude-code-session-id") == sid


# -- passthrough ------------------------------------------------------------------------------------


def test_passthrough_is_byte_exact_and_records_nothing(fake, passthrough, sid):
    assert passthrough.health()["mode"] == "passthrough"
    reply = _post(passthrough, sid, ODD)
    assert reply.status == 200, reply.body
    rec = fake.last(_of(sid))
    assert rec.raw == ODD
    assert reply.body == rec.response

    # compressed: the very same compressed bytes
    packed = gzip.compress(ODD, mtime=0)
    _post(passthrough, sid, packed, **{"content-encoding": "gzip"})
    rec = fake.last(_of(sid))
    assert rec.raw == packed and rec.header("content-encoding") == "gzip"

    # an SDK request: body and headers as the client sent them, answer as the upstream sent it
    client, tee = anthropic_client(passthrough.url)
    with client.messages.stream(
        model="claude-fake-1",
        max_tokens=16,
        messages=[{"role": "user", "content": "Passthrough streaming question."}],
        extra_headers={"x-claude-code-session-id": sid},
    ) as stream:
        assert stream.get_final_text() == REPLY_TEXT
    rec = fake.last(_of(sid))
    assert rec.raw == tee.last.request_body
    assert_headers_forwarded(rec, tee.last.request_headers, ignore=("host",))
    assert tee.last.response_body == rec.response

    assert passthrough.stats()["sessions"] == []
    assert passthrough.bili_lines() == []


def test_passthrough_websocket_frames_are_unchanged(fake, passthrough, sid):
    frame = json.dumps({"type": "response.create", "model": "gpt-fake-1",
                        "input": [{"role": "user", "content": "Passthrough socket question."}]})
    with ws_connect(f"ws://127.0.0.1:{passthrough.port}/v1/responses", additional_headers={"session_id": sid},
                    proxy=None) as ws:
        ws.send(frame)
        while json.loads(ws.recv(timeout=30))["type"] != "response.completed":
            pass
    rec = fake.last(lambda r: r.transport == "ws" and r.header("session_id") == sid)
    assert rec.raw == frame.encode()
    assert passthrough.stats()["sessions"] == []


# -- observe ----------------------------------------------------------------------------------------


def test_observe_records_refs_but_forwards_unchanged_bytes(fake, observe, sid):
    assert observe.health()["mode"] == "observe"
    reply = _post(observe, sid, ODD)
    assert reply.status == 200, reply.body
    rec = fake.last(_of(sid))
    assert rec.raw == ODD
    assert reply.body == rec.response

    s = observe.session(sid)
    assert s is not None
    assert (s["lane"], s["requests"], s["messages"], s["refs"]) == ("anthropic", 1, 3, 3)
    (line,) = observe.wait_bili_lines(1, session=sid)
    assert (line.group(3), line.group(4), line.group(5), line.group(6)) == ("3", "3", "0", "0")  # tagged=0

    # the next turn: the old messages are known, only the new ones are minted, bytes still unchanged
    turn2 = json.loads(ODD)
    turn2["messages"] += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": "One more."}]
    raw2 = json.dumps(turn2, indent=1).encode()
    _post(observe, sid, raw2)
    assert fake.last(_of(sid)).raw == raw2
    s = observe.session(sid)
    assert (s["requests"], s["messages"], s["refs"]) == (2, 5, 5)
    lines = observe.wait_bili_lines(2, session=sid)
    assert (lines[1].group(4), lines[1].group(5)) == ("2", "3")


def test_observe_with_the_sdks_and_the_websocket(fake, observe, sid):
    client, tee = openai_client(observe.url + "/v1")
    stream = client.chat.completions.create(
        model="gpt-fake-1",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Observe me, do not touch."}],
        stream=True,
        extra_headers={"x-session-id": sid},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == REPLY_TEXT
    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.raw == tee.last.request_body
    assert tee.last.response_body == rec.response
    assert observe.session(sid)["refs"] == 1

    frame = json.dumps({"type": "response.create", "model": "gpt-fake-1",
                        "input": [{"role": "user", "content": "Observed socket question."}]})
    with ws_connect(f"ws://127.0.0.1:{observe.port}/v1/responses", additional_headers={"session_id": sid + "-ws"},
                    proxy=None) as ws:
        ws.send(frame)
        while json.loads(ws.recv(timeout=30))["type"] != "response.completed":
            pass
    rec = fake.last(lambda r: r.transport == "ws" and r.header("session_id") == sid + "-ws")
    assert rec.raw == frame.encode()
    assert not strip_tags(rec.json)[1]
    s = observe.session(sid + "-ws")
    assert s is not None and (s["lane"], s["refs"]) == ("responses", 1)


@pytest.mark.parametrize("mode", ["passthrough", "observe"])
def test_compressed_answers_reach_the_client_as_sent(fake, request, sid, mode):
    """The fake gzips JSON answers when the client accepts gzip; outside fold mode the addon leaves
    the client's accept-encoding alone, and the compressed bytes come back unchanged."""
    proxy = request.getfixturevalue(mode)
    client, tee = anthropic_client(proxy.url)
    msg = client.messages.create(
        model="claude-fake-1",
        max_tokens=16,
        messages=[{"role": "user", "content": f"A compressed answer please ({mode})."}],
        extra_headers={"x-claude-code-session-id": sid},
    )
    assert msg.content[0].text == REPLY_TEXT
    rec = fake.last(_of(sid))
    assert rec.raw == tee.last.request_body
    assert rec.header("accept-encoding") == tee.last.request_headers["accept-encoding"]
    assert rec.response_encoding == "gzip"
    assert tee.last.response_body == rec.response
