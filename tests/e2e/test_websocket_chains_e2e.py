"""Responses over WebSocket through a real mitmdump, against the fake upstream's chains: each
connection keeps its own responses (``store: false``), stored ones (``store: true``) outlive it, and
a ``previous_response_id`` the upstream does not know is refused (``previous_response_not_found``).

bili never sends an id the upstream connection did not make: a delta goes up on the agent's own
chain of the same connection; anywhere else the whole conversation (rebuilt from bili's
transcript, from its store after a restart) goes up without one.  A chain bili never saw passes
through byte for byte (nothing is guessed), and the upstream's refusal reaches the agent."""

from __future__ import annotations

import json

import pytest
from websockets.sync.client import connect as ws_connect

from .fake_upstream import REPLY_TEXT
from .support import openai_client

pytestmark = pytest.mark.e2e

MODEL = "gpt-fake-ws"
TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def turn(ws, frame: dict) -> dict:
    """One ``response.create``; returns the final event (``response.completed`` or ``error``)."""
    ws.send(json.dumps(frame))
    while (event := json.loads(ws.recv(timeout=30)))["type"] not in ("response.completed", "error"):
        pass
    return event


def frame(items: list, prev: str | None = None, store: bool = False) -> dict:
    f = {"type": "response.create", "model": MODEL, "stream": True, "store": store, "input": items, "tools": TOOLS}
    if prev:
        f["previous_response_id"] = prev
    return f


def connect(proxy, sid: str):
    return ws_connect(f"ws://127.0.0.1:{proxy.port}/v1/responses", additional_headers={"session_id": sid},
                      proxy=None, compression=None)


def upstream(fake, sid: str):
    return fake.find(lambda r: r.transport == "ws" and r.header("session_id") == sid)


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold")


def test_deltas_ride_the_connection_s_own_chain(fake, proxy, sid):
    u1, u2, u3 = "Over the socket: list the files.", "Now the tests.", "And the docs."
    with connect(proxy, sid) as ws:
        first = turn(ws, frame([user(u1)]))
        second = turn(ws, frame([user(u2)], prev=first["response"]["id"]))
        third = turn(ws, frame([user(u3)], prev=second["response"]["id"]))
    assert third["type"] == "response.completed", third
    assert third["response"]["output"][0]["content"][0]["text"] == REPLY_TEXT
    recs = upstream(fake, sid)
    assert [r.status for r in recs] == [200, 200, 200]
    assert "previous_response_id" not in recs[0].json
    for rec, prev, text in ((recs[1], first, u2), (recs[2], second, u3)):
        # the delta went up on the agent's chain: only the new item, tagged
        assert rec.json["previous_response_id"] == prev["response"]["id"]
        assert len(rec.json["input"]) == 1 and rec.json["input"][0]["content"][0]["text"].endswith(text)
    # the conversation the upstream answered is the whole one, once each
    said = [p["text"] for it in recs[2].conversation for p in it.get("content") or [] if "text" in p]
    assert [s.split("\n", 1)[-1] for s in said if not s.startswith("# Context folding")] == [u1, REPLY_TEXT, u2,
                                                                                             REPLY_TEXT, u3]
    assert sum(s.startswith("# Context folding") for s in said) == 1  # bili's prompt is in the chain once
    assert "chained turn on" in proxy.log() and "delta forwarded" in proxy.log()


def test_a_store_false_chain_on_another_connection_goes_up_whole(fake, proxy, sid):
    u1, u2 = "First connection: hello.", "Second connection: go on."
    with connect(proxy, sid) as ws:
        first = turn(ws, frame([user(u1)]))
    with connect(proxy, sid) as ws:  # the agent's next turn on a new connection, chained on the old one
        second = turn(ws, frame([user(u2)], prev=first["response"]["id"]))
    assert second["type"] == "response.completed", second
    rec = upstream(fake, sid)[-1]
    assert rec.status == 200 and "previous_response_id" not in rec.json
    text = json.dumps(rec.json["input"])
    assert u1 in text and REPLY_TEXT in text and u2 in text
    # a store: false output goes back without its provider id (the provider keeps no items)
    assert all("id" not in it for it in rec.json["input"] if it.get("role") == "assistant")


def test_a_chain_bili_never_saw_passes_byte_for_byte_and_the_refusal_reaches_the_agent(fake, proxy, sid):
    raw = json.dumps(frame([user("Continue where we were.")], prev="resp_made_before_bili"))
    with connect(proxy, sid) as ws:
        ws.send(raw)
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error" and "not found" in event["error"]["message"]
    [rec] = upstream(fake, sid)
    assert rec.body == raw.encode()
    assert "chain unknown to the transcript: passed through observed" in proxy.log()


@pytest.mark.parametrize("store", [False, True], ids=["store-false", "store-true"])
def test_after_a_restart_the_transcript_comes_from_the_store(fake, make_proxy, sid, store):
    """The proxy restarts between two turns; the agent reconnects and continues its chain.  The
    new proxy rebuilds the conversation from the transcript in its store: a ``store: false`` chain
    (gone with the old connection) goes up whole, a stored one as the agent's delta."""
    proxy = make_proxy("reverse", "fold")
    u1, u2 = "Before the restart: read the config.", "After the restart: now change it."
    with connect(proxy, sid) as ws:
        first = turn(ws, frame([user(u1)], store=store))
    proxy.restart()
    with connect(proxy, sid) as ws:
        second = turn(ws, frame([user(u2)], prev=first["response"]["id"], store=store))
    assert second["type"] == "response.completed", second
    rec = upstream(fake, sid)[-1]
    assert rec.status == 200
    if store:
        assert rec.json["previous_response_id"] == first["response"]["id"] and len(rec.json["input"]) == 1
    else:
        assert "previous_response_id" not in rec.json
        text = json.dumps(rec.json["input"])
        assert u1 in text and REPLY_TEXT in text and u2 in text
    after = proxy.log().rsplit("==== start #2", 1)[-1]
    assert "chain unknown" not in after
    assert ("delta forwarded" if store else "whole input sent without previous_response_id") in after


def test_the_openai_sdk_chains_its_turns_over_the_socket(fake, proxy, sid):
    """The official SDK's Responses WebSocket (``client.responses.connect``): two turns, the second
    chained by ``previous_response_id``, both answered; the delta went up on the SDK's chain."""
    client, _ = openai_client(proxy.url + "/v1")
    u1, u2 = "SDK socket: name the build tool.", "SDK socket: and its config file?"
    done = []
    with client.responses.connect(extra_headers={"session_id": sid}) as conn:
        for text in (u1, u2):
            conn.response.create(model=MODEL, input=[{"role": "user", "content": text}], store=False, tools=TOOLS,
                                 **({"previous_response_id": done[-1].response.id} if done else {}))
            for event in conn:
                if event.type in ("response.completed", "error"):
                    break
            assert event.type == "response.completed", event
            done.append(event)
    assert done[-1].response.output_text == REPLY_TEXT
    first, second = upstream(fake, sid)
    assert second.status == 200 and second.json["previous_response_id"] == done[0].response.id
    assert len(second.json["input"]) == 1 and second.json["input"][0]["content"].endswith(u2)
