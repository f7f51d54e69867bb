"""Forward (regular) proxy mode: the SDKs keep their real default base URLs
(``https://api.anthropic.com``, ``https://api.openai.com/v1``), go through the proxy with TLS
interception by the mitmproxy CA, and the test route addon sends the decrypted requests to the fake.
Nothing leaves 127.0.0.1: the proxy never connects to the real hosts (``connection_strategy=lazy``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from websockets.sync.client import connect as ws_connect

from .fake_upstream import REPLY_TEXT
from .support import (
    anthropic_client,
    assert_headers_forwarded,
    assert_only_tags_added,
    clean_env,
    openai_client,
    request,
    strip_tags,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def no_base_url_env(monkeypatch):
    for name in ("ANTHROPIC_BASE_URL", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def test_anthropic_sdk_with_its_default_base_url(fake, forward_proxy, sid, no_base_url_env):
    client, tee = anthropic_client(None, proxy=forward_proxy.url, verify=forward_proxy.ssl_context())
    assert str(client.base_url).rstrip("/") == "https://api.anthropic.com"
    text = "Through the forward proxy: what is TLS interception?"
    msg = client.messages.create(
        model="claude-fake-1",
        max_tokens=32,
        messages=[{"role": "user", "content": text}],
        extra_headers={"x-claude-code-session-id": sid},
    )
    assert msg.content[0].text == REPLY_TEXT
    assert tee.last.url == "https://api.anthropic.com/v1/messages"

    rec = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    assert rec.header("host") == "api.anthropic.com"
    assert rec.route == "/v1/messages"
    tags = assert_only_tags_added(rec.json, tee.last.request_json)
    assert [(t.text, t.ref) for t in tags] == [(text, "m00001")]
    assert_headers_forwarded(rec, tee.last.request_headers)
    assert tee.last.response_body == rec.response


def test_openai_sdk_with_its_default_base_url(fake, forward_proxy, sid, no_base_url_env):
    client, tee = openai_client(None, proxy=forward_proxy.url, verify=forward_proxy.ssl_context())
    assert str(client.base_url).rstrip("/") == "https://api.openai.com/v1"
    u1 = "Forward chat: name three HTTP methods."
    stream = client.chat.completions.create(
        model="gpt-fake-1",
        messages=[{"role": "user", "content": u1}],
        stream=True,
        extra_headers={"x-session-id": sid},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == REPLY_TEXT
    rec = fake.last(lambda r: r.header("x-session-id") == sid)
    assert rec.header("host") == "api.openai.com" and rec.route == "/v1/chat/completions"
    assert [(t.text, t.ref) for t in assert_only_tags_added(rec.json, tee.last.request_json)] == [(u1, "m00001")]
    assert tee.last.response_body == rec.response

    u2 = "Forward responses: and three status codes?"
    out = client.responses.create(
        model="gpt-fake-1", input=[{"role": "user", "content": u2}], extra_headers={"x-session-id": sid + "-r"}
    )
    assert out.output_text == REPLY_TEXT
    rec = fake.last(lambda r: r.header("x-session-id") == sid + "-r")
    assert rec.header("host") == "api.openai.com" and rec.route == "/v1/responses"
    assert [(t.text, t.ref) for t in assert_only_tags_added(rec.json, tee.last.request_json)] == [(u2, "m00001")]


CHILD = textwrap.dedent(
    """
    import json, sys
    import anthropic, openai
    sid = sys.argv[1]
    a = anthropic.Anthropic(api_key="sk-fake", max_retries=0)
    m = a.messages.create(model="claude-fake-1", max_tokens=16, extra_headers={"x-claude-code-session-id": sid},
                          messages=[{"role": "user", "content": "Configured by environment variables only."}])
    o = openai.OpenAI(api_key="sk-fake", max_retries=0)
    r = o.responses.create(model="gpt-fake-1", extra_headers={"session_id": sid + "-o"},
                           input=[{"role": "user", "content": "Also configured by the environment."}])
    print(json.dumps({"anthropic": m.content[0].text, "openai": r.output_text,
                      "bases": [str(a.base_url), str(o.base_url)]}))
    """
)


def test_sdks_configured_only_by_https_proxy_and_ssl_cert_file(fake, forward_proxy, sid):
    """How a user points an unmodified Python agent at the proxy: two environment variables."""
    env = clean_env(HTTPS_PROXY=forward_proxy.url, SSL_CERT_FILE=str(forward_proxy.ca_file))
    env.pop("SSL_CERT_DIR", None)
    env.pop("ANTHROPIC_API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, sid], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["anthropic"] == out["openai"] == REPLY_TEXT
    assert [b.rstrip("/") for b in out["bases"]] == ["https://api.anthropic.com", "https://api.openai.com/v1"]

    a = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    assert a.header("host") == "api.anthropic.com" and a.route == "/v1/messages"
    assert [(t.text, t.ref) for t in assert_only_tags_added(a.json, _untagged(a.json))] == [
        ("Configured by environment variables only.", "m00001")
    ]
    o = fake.last(lambda r: r.header("session_id") == sid + "-o")
    assert o.header("host") == "api.openai.com" and o.route == "/v1/responses"
    assert [(t.text, t.ref) for t in assert_only_tags_added(o.json, _untagged(o.json))] == [
        ("Also configured by the environment.", "m00001")
    ]
    assert len(forward_proxy.wait_bili_lines(1, session=sid)) == 1
    assert len(forward_proxy.wait_bili_lines(1, session=sid + "-o")) == 1


def _untagged(obj):
    return strip_tags(obj)[0]


def _raw_get(proxy_url: str, path: str, host: str) -> bytes:
    """``GET path`` in origin form on the proxy's own port with ``Host: host``: what a browser sends
    for a page whose name resolves to 127.0.0.1."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(proxy_url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{u.port}\r\nConnection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_admin_endpoints_through_the_forward_proxy(fake, forward_proxy):
    health = forward_proxy.health()  # GET http://bili.proxy/__bili/health via the proxy
    assert health["ok"] is True and health["version"]
    status, body = forward_proxy.admin("/__bili/does-not-exist")
    assert status == 404 and "error" in body
    # another host's /__bili/ (a web page's own origin, bili as the system proxy): refused, nothing of
    # bili's in the answer, and nothing forwarded
    reply = request("http://anything.example/__bili/health", proxy=forward_proxy.url)
    assert reply.status == 403 and set(reply.json()) == {"ok", "error"}
    # a DNS rebinding: the proxy's own port, the page's name in Host
    raw = _raw_get(forward_proxy.url, "/__bili/health", "rebound.example")
    assert raw.startswith(b"HTTP/1.1 403") and b"version" not in raw
    assert _raw_get(forward_proxy.url, "/__bili/health", "localhost").startswith(b"HTTP/1.1 200")
    stats = forward_proxy.stats()
    assert stats["store"] is True and isinstance(stats["sessions"], list)
    assert not fake.find(lambda r: r.route.startswith("/__bili/"))


def test_responses_websocket_through_the_forward_proxy(fake, make_proxy, sid):
    proxy = make_proxy("forward", "fold", bili_refuse_websocket="false")
    u1 = "Codex-style socket through HTTPS_PROXY: hello."
    frame = {"type": "response.create", "model": "gpt-fake-1", "input": [{"role": "user", "content": u1}]}
    with ws_connect(
        "wss://api.openai.com/v1/responses",
        proxy=proxy.url,
        ssl=proxy.ssl_context(),
        additional_headers={"session_id": sid},
    ) as ws:
        ws.send(json.dumps(frame))
        while json.loads(last := ws.recv(timeout=30))["type"] not in ("response.completed", "error"):
            pass
    assert json.loads(last)["type"] == "response.completed"
    rec = fake.last(lambda r: r.transport == "ws" and r.header("session_id") == sid)
    assert rec.header("host") == "api.openai.com"
    assert [(t.text, t.ref) for t in assert_only_tags_added(rec.json, frame)] == [(u1, "m00001")]


def test_http2_client_through_the_forward_proxy(fake, forward_proxy, sid, no_base_url_env):
    """An agent whose TLS negotiates h2 with the proxy (the proxy talks HTTP/1.1 to the fake)."""
    client, tee = anthropic_client(None, proxy=forward_proxy.url, verify=forward_proxy.ssl_context(), http2=True)
    text = "Over HTTP/2: is the body still tagged?"
    raw = client.messages.with_raw_response.create(
        model="claude-fake-1", max_tokens=16, messages=[{"role": "user", "content": text}],
        extra_headers={"x-claude-code-session-id": sid},
    )
    assert raw.http_response.http_version == "HTTP/2"
    assert raw.parse().content[0].text == REPLY_TEXT
    rec = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    assert rec.header("host") == "api.anthropic.com"
    assert [(t.text, t.ref) for t in assert_only_tags_added(rec.json, tee.last.request_json)] == [(text, "m00001")]
    assert tee.last.response_body == rec.response
