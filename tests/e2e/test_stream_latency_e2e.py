"""Streaming latency through a real ``mitmdump --mode reverse`` with the bili addon, fold mode.

The fake upstream writes each SSE event only when the test releases it (``fake.gate``), and the
test reads the client's side of the stream in between.  Nothing depends on timing: a read that
never completes fails on the client's read timeout, a guard only.

- prose the echo filter has no reason to hold: every event reaches the client before the fake
  is even allowed to send the next one;
- prose ending in what may become a tag (``<a``): its event is held, but by one event at most,
  and the text the client gets is the text the model wrote.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Iterator

import pytest

from bili_addon.stream.echo import EchoFilter

from .support import httpx2

pytestmark = pytest.mark.e2e

PLAIN = "The quick brown fox jumps over the lazy dog, twice."
HELD = "Hmm, <acorn> is a tree, not a tag."  # the first 7-character piece ends in "<a"
TOOLS = {
    "anthropic": [{"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}}],
    "chat": [{"type": "function", "function": {"name": "Bash", "description": "Run a command.",
                                               "parameters": {"type": "object"}}}],
    "responses": [{"type": "function", "name": "Bash", "description": "Run a command.",
                   "parameters": {"type": "object"}}],
}


def pieces(text: str) -> list[str]:
    """How the fake streams ``text``: 7-character pieces."""
    return [text[i : i + 7] for i in range(0, len(text), 7)]


def held_after(text: str) -> list[bool]:
    """For each piece: whether the addon's echo filter holds something back after it."""
    f = EchoFilter()
    out = []
    for p in pieces(text):
        f.feed(p)
        out.append(bool(f.buf))
    return out


def request_for(lane: str, sid: str, text: str) -> tuple[str, dict, dict]:
    headers = {"content-type": "application/json", "x-fake-reply": urllib.parse.quote(text)}
    question = "Tell me about foxes, at some length please."
    if lane == "anthropic":
        body = {"model": "claude-fake-1", "max_tokens": 256, "stream": True, "tools": TOOLS[lane],
                "messages": [{"role": "user", "content": question}]}
        return "/v1/messages", body, {**headers, "x-claude-code-session-id": sid}
    if lane == "chat":
        body = {"model": "gpt-fake-1", "stream": True, "tools": TOOLS[lane],
                "messages": [{"role": "user", "content": question}]}
        return "/v1/chat/completions", body, {**headers, "x-session-id": sid}
    body = {"model": "gpt-fake-1", "stream": True, "tools": TOOLS[lane],
            "input": [{"role": "user", "content": question}]}
    return "/v1/responses", body, {**headers, "session_id": sid}


class Events:
    """The client's side of an SSE stream, read event by event as far as asked."""

    def __init__(self, chunks: Iterator[bytes]):
        self.chunks = chunks
        self.buf = b""
        self.events: list[bytes] = []
        self.ended = False

    def read_until(self, n: int) -> None:
        while len(self.events) < n:
            try:
                chunk = next(self.chunks)  # blocks; the client's read timeout is the failure guard
            except StopIteration:
                self.ended = True
                raise AssertionError(f"the stream ended after {len(self.events)} events, expected {n}") from None
            self.buf += chunk
            while b"\n\n" in self.buf:
                ev, self.buf = self.buf.split(b"\n\n", 1)
                self.events.append(ev + b"\n\n")

    def read_to_end(self) -> None:
        for chunk in self.chunks:
            self.buf += chunk
        self.ended = True
        assert not self.buf.strip(b"\r\n") or self.buf.endswith(b"\n\n")
        self.events += [e + b"\n\n" for e in self.buf.split(b"\n\n") if e.strip()]
        self.buf = b""


def prose_of(lane: str, events: list[bytes]) -> str:
    out = []
    for ev in events:
        m = re.search(rb"^data: ?(.*)$", ev, re.M)
        if not m or m.group(1).strip() == b"[DONE]":
            continue
        obj = json.loads(m.group(1))
        kind = obj.get("type")
        if lane == "anthropic" and kind == "content_block_delta" and obj["delta"].get("type") == "text_delta":
            out.append(obj["delta"]["text"])
        elif lane == "chat" and obj.get("choices"):
            out.append(obj["choices"][0]["delta"].get("content") or "")
        elif lane == "responses" and kind == "response.output_text.delta":
            out.append(obj["delta"])
    return "".join(out)


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold")


@pytest.fixture(scope="module")
def client():
    c = httpx2.Client(trust_env=False, timeout=httpx2.Timeout(15.0))
    yield c
    c.close()


def run_paced(fake, proxy, client, sid: str, lane: str, text: str, must_have, folded: bool = True) -> list[bytes]:
    """Stream one answer event by event; after releasing event ``i`` the client must hold
    ``must_have(i)`` events before event ``i + 1`` may be sent.  Returns the client's events.
    ``folded``: the proxy folds (tools injected); else it sent the body on as the client wrote it."""
    gate = fake.gate(sid)
    path, body, headers = request_for(lane, sid, text)
    headers["x-fake-gate"] = sid
    with client.stream("POST", proxy.url + path, content=json.dumps(body).encode(), headers=headers) as resp:
        assert resp.status_code == 200
        assert gate.ready.wait(15), "the fake never got the request"
        n = len(gate.events)
        got = Events(resp.iter_raw())
        for i in range(n):
            gate.release(i)
            got.read_until(must_have(i))
            if i + 1 < n:
                assert not gate.sent[i + 1].is_set()  # the fake really had not sent the next one yet
        got.read_to_end()
    assert not gate.aborted
    assert len(got.events) == n, "the proxy neither invents nor drops events"
    rec = fake.last(lambda r: r.header("x-fake-gate") == sid)
    if folded:
        assert rec.status == 200 and rec.json.get("tools") != body["tools"]  # a fold-mode model request (tools injected)
    else:
        assert rec.status == 200 and rec.json == body
    return got.events


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_each_event_reaches_the_client_before_the_next_is_sent(fake, proxy, client, sid, lane):
    assert not any(held_after(PLAIN)), "the test's prose must give the echo filter nothing to hold"
    events = run_paced(fake, proxy, client, sid, lane, PLAIN, must_have=lambda i: i + 1)
    assert prose_of(lane, events) == PLAIN
    rec = fake.last(lambda r: r.header("x-fake-gate") == sid)
    assert b"".join(events) == rec.response  # nothing to clean: the bytes pass unchanged


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_a_held_event_is_late_by_one_event_at_most(fake, proxy, client, sid, lane):
    held = held_after(HELD)
    assert held[0] and not any(held[1:]), "the first piece must end in a possible tag start, the rest not"
    events = run_paced(fake, proxy, client, sid, lane, HELD, must_have=lambda i: i)
    assert prose_of(lane, events) == HELD


@pytest.fixture(scope="module")
def passthrough_proxy(make_proxy):
    return make_proxy("reverse", "passthrough")


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_a_stream_bili_leaves_alone_reaches_the_client_event_by_event(fake, passthrough_proxy, client, sid, lane):
    """Passthrough (as any request bili passes on unchanged): no state for the flow, and mitmproxy
    held the whole answer until its end, where without the proxy the agent reads it as it comes."""
    events = run_paced(fake, passthrough_proxy, client, sid, lane, PLAIN, must_have=lambda i: i + 1, folded=False)
    rec = fake.last(lambda r: r.header("x-fake-gate") == sid)
    assert b"".join(events) == rec.response
