"""Anthropic Messages through a real ``mitmdump --mode reverse`` with the bili addon, fold mode.

Every test looks at both ends: what the fake upstream received (tags in front of prose, nothing
else changed) and what the client got back (the upstream's answer, byte for byte).
"""

from __future__ import annotations

import gzip
import json

import anthropic
import brotli
import pytest
import zstandard

from .fake_upstream import REPLY_TEXT
from .support import (
    anthropic_client,
    assert_headers_forwarded,
    assert_only_tags_added,
    expected_tokens,
    request,
    sse_events,
    strip_tags,
    tags_by_text,
)

pytestmark = pytest.mark.e2e

MODEL = "claude-fake-1"


def hdr(sid: str) -> dict[str, str]:
    return {"x-claude-code-session-id": sid}


def of_session(sid: str):
    return lambda r: r.header("x-claude-code-session-id") == sid


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def tagged(text: str, ref: str) -> str:
    return f'<acp tokens="{expected_tokens(text)}" type="text">{ref}</acp>\n{text}'


def test_sdk_non_streaming_tags_the_user_text_and_returns_the_upstream_answer(fake, reverse_proxy, sid):
    client, tee = anthropic_client(reverse_proxy.url)
    text = "Please review the diff I am about to paste and look for races."
    msg = client.messages.create(
        model=MODEL,
        max_tokens=256,
        system="You are a careful reviewer.",
        messages=[user(text)],
        metadata={"user_id": "someone"},
        extra_headers=hdr(sid),
    )
    assert msg.content[0].text == REPLY_TEXT

    rec = fake.last(of_session(sid))
    assert rec.route == "/v1/messages" and rec.status == 200
    sent = tee.last.request_json
    tags = assert_only_tags_added(rec.json, sent)
    assert [(t.path, t.ref) for t in tags] == [(("messages", 0, "content"), "m00001")]
    assert rec.json["messages"][0]["content"] == tagged(text, "m00001")
    # system prompt, metadata, model, max_tokens: exactly what the client sent
    assert {k: v for k, v in rec.json.items() if k != "messages"} == {k: v for k, v in sent.items() if k != "messages"}
    assert_headers_forwarded(rec, tee.last.request_headers)
    assert int(rec.header("content-length")) == len(rec.raw)
    # the client got the upstream's bytes
    assert tee.last.status == 200
    assert tee.last.response_body == rec.response


def test_sdk_streaming_passes_the_event_stream_through_unchanged(fake, reverse_proxy, sid):
    client, tee = anthropic_client(reverse_proxy.url)
    text = "Stream me a short answer about SQLite WAL mode."
    with client.messages.stream(model=MODEL, max_tokens=128, messages=[user(text)], extra_headers=hdr(sid)) as stream:
        final = stream.get_final_text()
    assert final == REPLY_TEXT

    rec = fake.last(of_session(sid))
    sent = tee.last.request_json
    assert sent["stream"] is True
    tags = assert_only_tags_added(rec.json, sent)
    assert [t.ref for t in tags] == ["m00001"]
    assert rec.json["messages"][0]["content"] == tagged(text, "m00001")
    # the SSE body is byte-identical, event by event
    assert tee.last.response_body == rec.response
    names = [e for e, _ in sse_events(tee.last.response_body)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(names)


def test_second_turn_reuses_refs_and_mints_new_ones(fake, reverse_proxy, sid):
    client, tee = anthropic_client(reverse_proxy.url)
    u1 = "Summarise the design document in three bullet points."
    u2 = "Now turn the second bullet into a checklist."
    r1 = client.messages.create(model=MODEL, max_tokens=64, messages=[user(u1)], extra_headers=hdr(sid))
    a1 = r1.content[0].text
    client.messages.create(
        model=MODEL, max_tokens=64, messages=[user(u1), assistant(a1), user(u2)], extra_headers=hdr(sid)
    )

    first, second = fake.find(of_session(sid))
    assert tags_by_text(first.json) == {u1: "m00001"}
    tags = assert_only_tags_added(second.json, tee.last.request_json)
    assert [(t.text, t.ref) for t in tags] == [(u1, "m00001"), (a1, "m00002"), (u2, "m00003")]
    # the history item is rendered exactly as in turn 1 (prompt-cache friendly)
    assert second.json["messages"][0] == first.json["messages"][0]

    lines = reverse_proxy.wait_bili_lines(2, session=sid)
    assert [(m.group(3), m.group(4), m.group(5)) for m in lines] == [("1", "1", "0"), ("3", "2", "1")]


def test_tool_use_history_is_forwarded_byte_for_byte(fake, reverse_proxy, sid):
    # hand-written bytes: odd spacing inside the tool blocks must survive exactly
    tool_use = b'{"type": "tool_use", "id": "toolu_01A", "name": "read_file", "input": {"path": "config.toml",   "limit": 20}}'
    tool_result = b'{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "[server]\\nport = 8080"}'
    raw = (
        b'{"model": "' + MODEL.encode() + b'", "max_tokens": 64, "messages": ['
        b'{"role": "user", "content": [{"type": "text", "text": "What is in config.toml?"}]},'
        b'{"role": "assistant", "content": [{"type": "text", "text": "Let me read it."}, ' + tool_use + b"]},"
        b'{"role": "user", "content": [' + tool_result + b', {"type": "text", "text": "Is the port right?"}]}'
        b"]}"
    )
    reply = request(reverse_proxy.url + "/v1/messages", raw, headers={"content-type": "application/json", **hdr(sid)})
    assert reply.status == 200, reply.body

    rec = fake.last(of_session(sid))
    assert tool_use in rec.raw and tool_result in rec.raw
    tags = assert_only_tags_added(rec.json, json.loads(raw))
    assert [t.text for t in tags] == ["What is in config.toml?", "Let me read it.", "Is the port right?"]
    refs = [t.ref for t in tags]
    assert refs[0] == "m00001" and refs == sorted(set(refs))
    assert reply.body == rec.response


def test_the_fake_is_as_picky_as_the_real_api(fake, reverse_proxy, sid):
    """A broken history stays broken: the proxy neither hides nor causes a 400."""
    client, _ = anthropic_client(reverse_proxy.url)
    bad = [
        user("Run the tests."),
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "ok"}]},
    ]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=16, messages=bad, extra_headers=hdr(sid))
    assert "toolu_nope" in str(e.value)
    assert fake.last(of_session(sid)).status == 400


@pytest.mark.parametrize(
    "encoding",
    ["gzip", "zstd", "br"],
)
def test_compressed_request_bodies_are_decoded_tagged_and_re_encoded(fake, reverse_proxy, sid, encoding):
    text = f"Explain the {encoding} framing format in one paragraph."
    body = json.dumps({"model": MODEL, "max_tokens": 64, "messages": [user(text)]}).encode()
    compress = {
        "gzip": gzip.compress,
        "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
        "br": brotli.compress,
    }[encoding]
    reply = request(
        reverse_proxy.url + "/v1/messages",
        compress(body),
        headers={"content-type": "application/json", "content-encoding": encoding, **hdr(sid)},
    )
    assert reply.status == 200, reply.body

    rec = fake.last(of_session(sid))
    assert rec.header("content-encoding") == encoding
    assert rec.raw != rec.body  # still compressed on the wire
    assert int(rec.header("content-length")) == len(rec.raw)
    tags = assert_only_tags_added(rec.json, json.loads(body))
    assert [(t.text, t.ref) for t in tags] == [(text, "m00001")]


MALFORMED = [
    pytest.param(b'{"model": "claude-fake-1", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"', id="truncated"),
    pytest.param(b"\xff\xfe not even utf-8", id="binary"),
    pytest.param(b"", id="empty"),
    pytest.param(b'{"model": "claude-fake-1", "messages": {"role": "user", "content": "not an array"}}', id="wrong-shape"),
    pytest.param(b'["not", "an", "object"]', id="array"),
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_bodies_reach_the_upstream_unchanged(fake, reverse_proxy, sid, raw):
    reply = request(reverse_proxy.url + "/v1/messages", raw, headers={"content-type": "application/json", **hdr(sid)})
    rec = fake.last(of_session(sid))
    assert rec.raw == raw
    assert reply.status == rec.status == 400  # the fake refuses it, and that answer comes back
    assert reply.body == rec.response
    # whether a JSON object of the wrong shape opens an (empty) session is the addon's business;
    # nothing is ever tagged in it
    assert all(m.group(6) == "0" for m in reverse_proxy.bili_lines(session=sid))
    if not raw.startswith(b"{"):
        assert reverse_proxy.bili_lines(session=sid) == []
        assert reverse_proxy.session(sid) is None


def test_a_lone_surrogate_escape_does_not_break_the_request(fake, reverse_proxy, sid):
    """JavaScript agents emit ``\\ud83d`` escapes for emoji they cut in half; such a body is valid JSON."""
    raw = (
        b'{"model": "claude-fake-1", "max_tokens": 5, "messages": [{"role": "user", '
        b'"content": "a truncated emoji \\ud83d in a long enough question"}]}'
    )
    reply = request(reverse_proxy.url + "/v1/messages", raw, headers={"content-type": "application/json", **hdr(sid)})
    assert reply.status == 200, reply.body
    rec = fake.last(of_session(sid))
    assert rec.raw == raw or strip_tags(rec.json)[0] == json.loads(raw)


def test_a_body_that_claims_gzip_but_is_not_reaches_the_upstream_unchanged(fake, reverse_proxy, sid):
    raw = json.dumps({"model": MODEL, "max_tokens": 5, "messages": [user("I say gzip but I am plain JSON.")]}).encode()
    reply = request(
        reverse_proxy.url + "/v1/messages",
        raw,
        headers={"content-type": "application/json", "content-encoding": "gzip", **hdr(sid)},
    )
    rec = fake.last(of_session(sid))
    assert rec.raw == raw and rec.header("content-encoding") == "gzip"
    assert reply.status == rec.status == 400 and reply.body == rec.response


def test_non_model_paths_reach_the_upstream_unchanged(fake, reverse_proxy, sid):
    count = b'{"model": "claude-fake-1",  "messages": [{"role": "user", "content": "count me please"}]}'
    events = b'{"events": [ {"event_type": "tengu_started", "event_data": {"text": "hello there world"}} ]}'
    cases = [
        ("POST", "/v1/messages/count_tokens", count),
        ("POST", "/api/event_logging/batch", events),
        ("GET", "/v1/models", None),
        ("GET", "/v1/messages", None),  # not a POST: not a model request
    ]
    for method, path, body in cases:
        headers = {**hdr(sid), "x-case": path}
        if body is not None:
            headers["content-type"] = "application/json"
        reply = request(reverse_proxy.url + path, body, method=method, headers=headers)
        rec = fake.last(lambda r: r.header("x-case") == path and r.header("x-claude-code-session-id") == sid)
        assert rec.method == method and rec.route == path
        assert rec.raw == (body or b"")
        assert reply.status == rec.status == 200
        assert reply.body == rec.response
    assert reverse_proxy.bili_lines(session=sid) == []
    assert reverse_proxy.session(sid) is None


def test_admin_endpoints_and_stats_counts(fake, reverse_proxy, sid):
    health = reverse_proxy.health()
    assert health["ok"] is True and isinstance(health["version"], str) and health["version"]

    status, body = reverse_proxy.admin("/__bili/nope")
    assert status == 404 and "error" in body
    status, body = reverse_proxy.admin("/__bili/stats", method="POST")
    assert status == 404 and "error" in body

    client, _ = anthropic_client(reverse_proxy.url)
    u1, u2 = "First question about caching headers.", "Second question about ETags."
    client.messages.create(model=MODEL, max_tokens=8, messages=[user(u1)], extra_headers=hdr(sid))
    client.messages.create(
        model=MODEL, max_tokens=8, messages=[user(u1), assistant(REPLY_TEXT), user(u2)], extra_headers=hdr(sid)
    )
    s = reverse_proxy.session(sid)
    assert s is not None
    assert (s["lane"], s["requests"], s["messages"], s["refs"]) == ("anthropic", 2, 3, 3)
    assert s["agent"] == "python-sdk"
    # the admin endpoints are answered by the addon, never forwarded
    assert not fake.find(lambda r: r.route.startswith("/__bili/"))


def test_one_log_line_per_model_request(fake, reverse_proxy, sid):
    client, _ = anthropic_client(reverse_proxy.url)
    history: list = []
    for i in range(3):
        history.append(user(f"Message number {i} of the log-line test."))
        client.messages.create(model=MODEL, max_tokens=8, messages=history, extra_headers=hdr(sid))
        history.append(assistant(REPLY_TEXT if i == 0 else f"{REPLY_TEXT} ({i})"))
    # a non-model request in between does not log a model line
    request(reverse_proxy.url + "/v1/models", headers=hdr(sid))
    lines = reverse_proxy.wait_bili_lines(3, session=sid)
    assert len(lines) == 3
    assert [m.group(2) for m in lines] == ["anthropic"] * 3
    assert [int(m.group(3)) for m in lines] == [1, 3, 5]
    assert [int(m.group(4)) for m in lines] == [1, 2, 2]
    assert [int(m.group(5)) for m in lines] == [0, 1, 3]
    assert len(fake.find(of_session(sid))) == 4


def test_clients_own_tags_are_not_doubled(fake, reverse_proxy, sid):
    """A client that echoes back a tagged text (e.g. a replayed upstream body) gets it once, not twice."""
    client, _ = anthropic_client(reverse_proxy.url)
    u1 = "Keep this sentence tagged exactly once."
    client.messages.create(model=MODEL, max_tokens=8, messages=[user(u1)], extra_headers=hdr(sid))
    first = fake.last(of_session(sid))
    replay = first.json["messages"][0]["content"]  # already carries <acp ...>m00001</acp>
    client.messages.create(
        model=MODEL, max_tokens=8, messages=[user(replay), assistant(REPLY_TEXT), user("ok")], extra_headers=hdr(sid)
    )
    second = fake.last(of_session(sid))
    assert second.json["messages"][0]["content"] == replay
    _, tags = strip_tags(second.json)
    assert [t.ref for t in tags] == ["m00001", "m00002", "m00003"]


def test_claude_code_shaped_request(fake, reverse_proxy, sid):
    """``?beta=true``, cache_control breakpoints, a mid-conversation system message, block content and
    an assistant prefill: prose is tagged, cache_control stays on its block, the prefill is left alone."""
    client, tee = anthropic_client(reverse_proxy.url)
    u1, u2 = "Refactor the parser module.", "Go on with the tokenizer."
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Today is Tuesday.</system-reminder>"},
            {"type": "text", "text": u1, "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "Done with the parser."}]},
        {"role": "system", "content": "The user switched branches."},
        {"role": "user", "content": [{"type": "text", "text": u2, "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "{"},  # prefill
    ]
    client.messages.create(
        model=MODEL,
        max_tokens=64,
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        messages=messages,
        extra_headers=hdr(sid),
        extra_query={"beta": "true"},
    )
    rec = fake.last(of_session(sid))
    assert rec.path == "/v1/messages?beta=true"
    tags = assert_only_tags_added(rec.json, tee.last.request_json)
    texts = [t.text for t in tags]
    assert u1 in texts and u2 in texts and "Done with the parser." in texts
    assert "{" not in texts  # the prefill is the start of the model's own answer
    assert rec.json["messages"][4] == {"role": "assistant", "content": "{"}
    assert rec.json["messages"][0]["content"][1]["cache_control"] == {"type": "ephemeral"}
    assert rec.json["system"] == tee.last.request_json["system"]


def test_unicode_text_and_escapes(fake, reverse_proxy, sid):
    text = "Répondez en français 🙂 — 日本語のテキストも。 Tab\there, quote \" and backslash \\ done."
    raw = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [user(text)]}, ensure_ascii=True).encode()
    reply = request(reverse_proxy.url + "/v1/messages", raw, headers={"content-type": "application/json", **hdr(sid)})
    assert reply.status == 200, reply.body
    rec = fake.last(of_session(sid))
    tags = assert_only_tags_added(rec.json, json.loads(raw))
    assert [(t.text, t.ref) for t in tags] == [(text, "m00001")]


def test_chunked_request_body(fake, reverse_proxy, sid):
    import http.client

    text = "This body arrives with transfer-encoding: chunked."
    body = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [user(text)]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", reverse_proxy.port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/messages", body=iter([body[:20], body[20:]]), encode_chunked=True,
            headers={"content-type": "application/json", "transfer-encoding": "chunked", **hdr(sid)},
        )
        resp = conn.getresponse()
        answer = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, answer
    rec = fake.last(of_session(sid))
    assert [(t.text, t.ref) for t in assert_only_tags_added(rec.json, json.loads(body))] == [(text, "m00001")]
    assert answer == rec.response
