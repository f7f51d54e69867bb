"""The mitmproxy addon shell, driven with mitmproxy's own test helpers (no sockets)."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from bili_addon.shell import Bili

ANTH_BODY = json.dumps(
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]}
).encode()


def model_flow(content: bytes, path: str = "/v1/messages", headers: dict | None = None, peer="127.0.0.1",
               host: str | None = None):
    """A request from ``peer``: to the model's host, or a ``/__bili/`` one to the proxy's own address
    (``host``: another)."""
    admin = path.startswith("/__bili/")
    host = host or ("127.0.0.1" if admin else "api.anthropic.com")
    h = http.Headers(host=host if not admin else f"{host}:8080", content_type="application/json", **(headers or {}))
    req = tutils.treq(method=b"POST", path=path.encode(), host=host, port=8080 if admin else 443,
                      scheme=b"http" if admin else b"https", headers=h, content=content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = (peer, 50000)
    return f


def session_headers(sid="s1"):
    return {"x_acp_session": sid}


def test_fold_mode_tags_the_prose(bili):
    f = model_flow(ANTH_BODY, headers=session_headers())
    bili.request(f)
    sent = json.loads(f.request.content)
    assert sent["messages"][0]["content"] == '<acp tokens="3" type="text">m00001</acp>\nhello there'


def test_observe_records_and_forwards_unchanged(bili):
    bili.tctx.configure(bili, bili_mode="observe")
    f = model_flow(ANTH_BODY, headers=session_headers())
    bili.request(f)
    assert f.request.raw_content == ANTH_BODY
    stats = bili.stats()["sessions"]
    assert [(s["id"], s["refs"], s["requests"]) for s in stats] == [("s1", 1, 1)]


def test_passthrough_records_nothing(bili):
    bili.tctx.configure(bili, bili_mode="passthrough")
    f = model_flow(ANTH_BODY, headers=session_headers())
    bili.request(f)
    assert f.request.raw_content == ANTH_BODY
    assert bili.stats()["sessions"] == []


@pytest.mark.parametrize(
    "path,content",
    [
        ("/v1/messages", b'{"model": "m", "messages": [ {"role": "user", "content": "x"'),  # truncated JSON
        ("/v1/messages", b'["not", "an", "object"]'),
        ("/v1/messages", b'{"messages": "not a list"}'),
        ("/v1/messages/count_tokens", ANTH_BODY),
        ("/api/event_logging/batch", ANTH_BODY),
    ],
)
def test_unparseable_or_non_model_bodies_pass_untouched(bili, path, content):
    f = model_flow(content, path=path, headers=session_headers())
    bili.request(f)
    assert f.request.raw_content == content


def test_internal_error_fails_open_and_says_why(bili, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(bili.engine, "process", boom)
    f = model_flow(ANTH_BODY, headers=session_headers())
    with caplog.at_level(logging.ERROR, logger="bili"):
        bili.request(f)
    assert f.request.raw_content == ANTH_BODY
    assert "kaboom" in caplog.text and "forwarding unchanged" in caplog.text


def test_gzip_body_is_decoded_tagged_and_re_encoded(bili):
    f = model_flow(gzip.compress(ANTH_BODY), headers={**session_headers(), "content_encoding": "gzip"})
    bili.request(f)
    assert f.request.headers["content-encoding"] == "gzip"
    sent = json.loads(gzip.decompress(f.request.raw_content))
    assert sent["messages"][0]["content"].startswith('<acp tokens="3" type="text">m00001</acp>\n')


def test_undecodable_encoding_passes_untouched(bili):
    junk = b"\x1f\x8bnot really gzip"
    f = model_flow(junk, headers={**session_headers(), "content_encoding": "gzip"})
    bili.request(f)
    assert f.request.raw_content == junk and f.request.headers["content-encoding"] == "gzip"


def test_store_that_cannot_open_logs_once_and_passes_through(tmp_path, caplog):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    addon = Bili()
    with taddons.context(addon) as tctx, caplog.at_level(logging.WARNING, logger="bili"):
        tctx.configure(addon, bili_data_dir=str(blocker))
        f = model_flow(ANTH_BODY, headers=session_headers())
        addon.request(f)
        assert f.request.raw_content == ANTH_BODY
        assert caplog.text.count("cannot open the store") == 1
        # warnings, not errors: mitmdump quits on an error logged during start-up (the admin token
        # cannot be written in that data dir either)
        assert {r.levelname for r in caplog.records} == {"WARNING"}
        h = model_flow(b"", path="/__bili/health")
        h.request.method = "GET"
        addon.request(h)
        health = json.loads(h.response.content)
        assert health["store"] is False and "cannot open the store" in health["store_error"]
        assert health["store_hint"] and addon.keeper.counts["forwarded_unchanged"] == 1


def test_admin_health_and_stats(bili):
    bili.request(model_flow(ANTH_BODY, headers=session_headers("sess-a")))
    h = model_flow(b"", path="/__bili/health")
    h.request.method = "GET"
    bili.request(h)
    assert h.response.status_code == 200
    health = json.loads(h.response.content)
    assert health["ok"] is True and health["version"]
    assert health["authenticated"] is False  # health is open; it says whether the token was right
    token = (tmp_data(bili) / "admin-token").read_text().strip()
    s = model_flow(b"", path="/__bili/stats", headers={"x-bili-token": token})
    s.request.method = "GET"
    bili.request(s)
    [entry] = json.loads(s.response.content)["sessions"]
    assert entry["id"] == "sess-a" and entry["lane"] == "anthropic" and entry["refs"] == 1
    assert entry["messages"] == 1 and entry["requests"] == 1
    n = model_flow(b"", path="/__bili/nope", headers={"authorization": f"Bearer {token}"})
    n.request.method = "GET"
    bili.request(n)
    assert n.response.status_code == 404


def tmp_data(bili):
    from pathlib import Path

    return Path(bili.data_dir)


@pytest.mark.parametrize("headers", [{}, {"x-bili-token": "wrong"}, {"authorization": "Bearer wrong"},
                                     {"authorization": "Basic x"}])
@pytest.mark.parametrize("path", ["/__bili/stats", "/__bili/plugin/manifest", "/__bili/plugin/tool", "/__bili/nope"])
def test_admin_needs_the_token(bili, path, headers):
    """Loopback is any local user: without this install's token every endpoint but health is 403."""
    bili.request(model_flow(ANTH_BODY, headers=session_headers("sess-secret")))
    f = model_flow(b'{"tool": "search_context", "args": {"query": "hello"}}', path=path, headers=headers)
    f.request.method = "GET" if "plugin/tool" not in path else "POST"
    bili.request(f)
    assert f.response.status_code == 403
    assert b"sess-secret" not in f.response.content and b"hello" not in f.response.content
    assert b"admin token" in f.response.content


def test_token_and_data_dir_are_private(tmp_path):
    """The token file is 0600 and the data dir 0700 whatever the umask; the token survives a restart."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        first, second = Bili(), Bili()
        for addon in (first, second):
            with taddons.context(addon) as tctx:
                tctx.configure(addon, bili_data_dir=str(tmp_path / "data"))
            addon.done()
    finally:
        os.umask(old)
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "admin-token").stat().st_mode) == 0o600
    assert stat.S_IMODE((data / "bili.sqlite3").stat().st_mode) == 0o600
    assert first.token and first.token == second.token == (data / "admin-token").read_text().strip()


@pytest.mark.parametrize("peer", ["10.1.2.3", "192.168.0.7", "2001:db8::1"])
def test_admin_refuses_non_loopback_clients(bili, peer):
    f = model_flow(b"", path="/__bili/stats", peer=peer)
    f.request.method = "GET"
    bili.request(f)
    assert f.response.status_code == 403


@pytest.mark.parametrize("host", ["evil.example", "api.anthropic.com", "127.0.0.1.evil.example", "10.0.0.5",
                                  "192.168.0.7"])
@pytest.mark.parametrize("path", ["/__bili/health", "/__bili/stats", "/__bili/"])
def test_admin_answers_only_for_the_proxys_own_address(bili, host, path):
    """A page the browser loaded through the proxy (bili as the system proxy), or one whose name a DNS
    rebinding points at 127.0.0.1, asks /__bili/ on its own origin, from a loopback client: it gets
    nothing of bili's (no version, no store, no proof), and the request goes nowhere."""
    f = model_flow(b"", path=path, host=host, headers={"x-bili-challenge": "c" * 32,
                                                       "x-bili-token": bili.token or ""})
    f.request.method = "GET"
    bili.request(f)
    assert f.response is not None and f.response.status_code == 403
    body = json.loads(f.response.content)
    assert set(body) == {"ok", "error"} and "own address" in body["error"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "LocalHost.", "bili.localhost",
                                  "bili.proxy", "::1", "10.231.0.1"])
def test_admin_answers_for_the_proxys_own_names(bili, host):
    f = model_flow(b"", path="/__bili/health", host=host)
    f.request.method = "GET"
    bili.request(f)
    assert f.response.status_code == 200 and json.loads(f.response.content)["ok"] is True


def test_a_reverse_proxys_admin_requests_carry_its_targets_host(bili):
    """mitmproxy gives the addon a reverse proxy's requests with the target's host: not checked there."""
    from mitmproxy.proxy.mode_specs import ProxyMode

    f = model_flow(b"", path="/__bili/health", host="api.anthropic.com")
    f.client_conn.proxy_mode = ProxyMode.parse("reverse:https://api.anthropic.com")
    f.request.method = "GET"
    bili.request(f)
    assert f.response.status_code == 200


def test_admin_accepts_ipv6_and_mapped_loopback(bili):
    for peer in ("::1", "::ffff:127.0.0.1"):
        f = model_flow(b"", path="/__bili/health", peer=peer)
        f.request.method = "GET"
        bili.request(f)
        assert f.response.status_code == 200


def test_admin_accepts_a_transparent_namespace_at_the_dnatd_loopback_port(bili):
    """``--transparent=netns``: ``bili mcp`` in the namespace reaches the proxy's port at the host end,
    DNAT'd to 127.0.0.1 (the client keeps its namespace address, the local end is loopback)."""
    for peer, sock, status in (("10.231.7.30", ("127.0.0.1", 8787), 200),  # bili's namespace, DNAT'd
                               ("10.231.7.30", ("10.231.7.29", 8787), 403),  # not through the DNAT to loopback
                               ("10.232.7.30", ("127.0.0.1", 8787), 403),  # not bili's namespace subnet
                               ("10.231.7.30", ("", 0), 403)):
        f = model_flow(b"", path="/__bili/health", peer=peer)
        f.client_conn.sockname = sock
        f.request.method = "GET"
        bili.request(f)
        assert f.response.status_code == status, (peer, sock)
    f = model_flow(b"", path="/__bili/stats", peer="10.231.7.30")
    f.client_conn.sockname = ("127.0.0.1", 8787)
    f.request.method = "GET"
    bili.request(f)
    assert f.response.status_code == 403 and b"admin token" in f.response.content  # the token is still needed


def test_responses_websocket_frame_is_tagged(bili):
    f = tflow.twebsocketflow()
    f.request.path = "/v1/responses"
    f.request.headers["session_id"] = "ws-1"
    frame = json.dumps(
        {"type": "response.create", "model": "m",
         "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi ws"}]}]}
    ).encode()
    f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, True, frame))
    bili.websocket_message(f)
    sent = json.loads(f.websocket.messages[-1].content)
    assert sent["type"] == "response.create"
    assert sent["input"][0]["content"][0]["text"].startswith('<acp tokens="2" type="text">m00001</acp>\n')
    server = WebSocketMessage(Opcode.TEXT, False, b'{"type":"response.created"}')
    f.websocket.messages.append(server)
    bili.websocket_message(f)
    assert f.websocket.messages[-1].content == b'{"type":"response.created"}'


@pytest.mark.parametrize("final", ["response.completed", "response.incomplete"])
def test_a_websocket_answer_is_accounted_once_however_it_ends(bili, final):
    """An answer cut at max_output_tokens ends with response.incomplete: its usage counts too, and
    a final event repeated afterwards counts nothing more."""
    f = tflow.twebsocketflow()
    f.request.path = "/v1/responses"
    f.request.headers["session_id"] = "ws-2"
    frame = json.dumps({"type": "response.create", "model": "m", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi ws"}]}]}).encode()
    f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, True, frame))
    bili.websocket_message(f)
    end = json.dumps({"type": final, "response": {"id": "resp_1", "status": final.split(".")[1], "output": [],
                                                  "usage": {"input_tokens": 321, "output_tokens": 9}}}).encode()
    for _ in range(2):
        f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, False, end))
        bili.websocket_message(f)
    [entry] = bili.stats()["sessions"]
    assert entry["usage"]["turns"] == 1 and entry["usage"]["input_tokens"] == 321


def test_remind_at_sets_when_the_model_is_reminded_to_fold(bili):
    msgs = [{"role": "user", "content": "audit the repository"}]
    for t in range(12):
        msgs += [
            {"role": "assistant", "content": [{"type": "text", "text": f"Reading module {t}."},
                                              {"type": "tool_use", "id": f"toolu_{t}", "name": "Read",
                                               "input": {"path": f"m{t}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                          "content": f"module {t} " + "line of code\n" * 300}]},
        ]
    body = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": msgs,
                       "tools": [{"name": "Read", "input_schema": {"type": "object"}}]}).encode()

    def reminded(sid: str) -> bool:
        bili.request(model_flow(body, headers=session_headers(sid)))
        bili.engine.store.record_usage(sid, "anthropic", (12_000, 0, 0, 10))
        f = model_flow(body, headers=session_headers(sid))
        bili.request(f)
        return "[bili] ~" in json.dumps(json.loads(f.request.content)["messages"][-2:])

    assert not reminded("default")  # ~11K foldable tokens: below the default 15K
    bili.tctx.configure(bili, bili_remind_at=4_000)
    assert reminded("eager")
    bili.tctx.configure(bili, bili_remind_at=0)
    assert not reminded("never")


@pytest.mark.parametrize("offloading", [False, True])
def test_an_admin_request_that_fails_inside_answers_500_and_never_leaves(bili, monkeypatch, offloading):
    """The stats figures raising (any internal bug): mitmproxy only logs a hook's exception and sends
    the request on, to the host it names, with the admin token in its headers.  It is answered 500
    here, on the event loop's path and on the store worker's."""
    import asyncio

    from bili_addon import meter

    bili.request(model_flow(ANTH_BODY, headers=session_headers("sess-a")))

    def broken(*a, **k):
        raise RuntimeError("a bug in the stats figures")

    monkeypatch.setattr(meter, "totals", broken)
    token = (tmp_data(bili) / "admin-token").read_text().strip()
    f = model_flow(b"", path="/__bili/stats", headers={"x-bili-token": token})
    f.request.method = "GET"
    if offloading:
        bili.keeper.start()
        try:
            pending = bili.request(f)
            assert pending is not None
            asyncio.run(pending)
        finally:
            bili.keeper.stop()
    else:
        assert bili.request(f) is None
    assert f.response is not None and f.response.status_code == 500
    assert json.loads(f.response.content)["ok"] is False


@pytest.mark.parametrize("mode", ["fold", "passthrough"])
def test_a_stream_bili_does_not_read_is_streamed_not_held_to_its_end(bili, mode):
    """A body bili passes on unchanged (here: not JSON; or passthrough) keeps no state for its flow:
    its answer's stream went to mitmproxy's default, the whole answer held until its end."""
    bili.tctx.configure(bili, bili_mode=mode)
    f = model_flow(b"{not json", headers=session_headers())
    bili.request(f)
    f.response = tutils.tresp(headers=http.Headers(content_type="text/event-stream"), content=None)
    bili.responseheaders(f)
    assert f.response.stream is True
    # a JSON answer is still left to mitmproxy (read whole in ``response``)
    g = model_flow(b"{not json", headers=session_headers())
    bili.request(g)
    g.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=None)
    bili.responseheaders(g)
    assert g.response.stream is False


ENVELOPED = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}],
                        "biliMsgIds": ["a1"]}).encode()


@pytest.mark.parametrize("how", ["passthrough", "internal error", "store down"])
def test_a_body_passed_on_unchanged_leaves_without_bilis_own_envelope(bili, monkeypatch, how):
    """A host that vouches its message ids sends ``biliMsgIds`` for bili alone: the engine removes it,
    but a body passed on unchanged kept it, and the provider answers 400 to a field it does not
    know: the agent's turn failed because of bili."""
    from bili_addon.kernel.turn import Engine
    from bili_addon.store import StoreError

    if how == "passthrough":
        bili.tctx.configure(bili, bili_mode="passthrough")
    else:
        def broken(*a, **k):
            raise RuntimeError("a bug") if how == "internal error" else StoreError("the disk is gone", "error")

        monkeypatch.setattr(Engine, "process", broken)
    f = model_flow(ENVELOPED, headers={**session_headers(), "x_bili_msg_ids": '["a1"]'})
    bili.request(f)
    sent = json.loads(f.request.content)
    assert "biliMsgIds" not in sent and "x-bili-msg-ids" not in f.request.headers
    assert sent == {k: v for k, v in json.loads(ENVELOPED).items() if k != "biliMsgIds"}
    # a body without it passes byte for byte
    g = model_flow(ANTH_BODY, headers=session_headers("s2"))
    bili.request(g)
    if how == "passthrough":
        assert g.request.raw_content == ANTH_BODY


def test_a_call_of_the_agents_own_tool_named_like_bilis_is_the_agents(bili):
    """An agent with a tool of its own named ``search_context``: bili does not offer its own then,
    and a call of that name is the agent's.  It was recorded as bili's, run on the next request,
    and the agent's real result replaced by bili's answer."""
    own = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
           {"name": "search_context", "description": "the agent's own code search", "input_schema": {"type": "object"}}]
    req = json.dumps({"model": "m", "max_tokens": 5, "tools": own,
                      "messages": [{"role": "user", "content": "find load_config"}]}).encode()
    f = model_flow(req, headers=session_headers("own-tools"))
    bili.request(f)
    sent = json.loads(f.request.content)
    assert [t["name"] for t in sent["tools"]].count("search_context") == 1  # (the agent's)
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
              "content": [{"type": "tool_use", "id": "toolu_own", "name": "search_context",
                           "input": {"query": "def load_config"}},
                          {"type": "tool_use", "id": "toolu_bili", "name": "acp_status", "input": {}}],
              "usage": {"input_tokens": 10, "output_tokens": 5}}
    f.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=json.dumps(answer).encode())
    bili.responseheaders(f)
    bili.response(f)
    calls = bili.engine.sessions.load("own-tools", fresh=True).calls
    assert "toolu_bili" in calls and "toolu_own" not in calls


def test_a_sessions_window_follows_what_its_request_asks_for(bili):
    """Claude Code asks for Anthropic's 1M-token window with a beta header, the model's name the same:
    bili took such a session for a 200K one, sent 'nearly full' reminders from 150K and cut tool
    outputs from 190K of a window a fifth used.  Gemini names its model in the URL's path: the session
    had no model, so the 200K default.  A window learned from an overflow is kept per window asked."""
    f = model_flow(ANTH_BODY, headers={**session_headers("big"), "anthropic-beta": "context-1m-2025-08-07,x"})
    bili.request(f)
    eng = bili.engine
    s = eng.sessions["big"]
    assert eng.window_for(s) == 1_000_000
    g = model_flow(ANTH_BODY, headers=session_headers("small"))
    bili.request(g)
    assert eng.window_for(eng.sessions["small"]) == 200_000
    # the turns' figures name the window too: a request over 200K tokens could only go with it (prices.may_go_long)
    from bili_addon import flowmeta
    assert f.metadata[flowmeta.KEY]["model"] == "m[1m]" and g.metadata[flowmeta.KEY]["model"] == "m"
    eng.set_flag("big", "learned_windows", {s.model: 180_000})  # (learned on a request without the header)
    assert eng.window_for(s) == 1_000_000
    gem = json.dumps({"contents": [{"role": "user", "parts": [{"text": "hello gemini"}]}]}).encode()
    h = model_flow(gem, path="/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
                   headers=session_headers("gem"))
    bili.request(h)
    assert "x-bili-path-model" not in h.request.headers  # (the engine's copy only: never forwarded)
    s = eng.sessions["gem"]
    assert s.model == "gemini-2.5-pro" and eng.window_for(s) == 1_048_576


def test_stats_never_read_the_store_on_the_event_loop(bili):
    """While the keeper is paused (another process held SQLite's lock: the engine kept open), the stats'
    fallback ran every session's queries on mitmproxy's event loop, outside the keeper, on the
    connection its worker owns, and said the store was fine."""
    import asyncio
    import threading
    import time

    from bili_addon.store import StoreError

    bili.request(model_flow(ANTH_BODY, headers=session_headers()))
    store = bili.engine.store
    real, threads = store.sessions, []

    def spy(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    store.sessions = spy

    async def main():
        bili.keeper.start()
        bili.keeper.error = StoreError("database is locked", "locked")
        bili.keeper.retry_at = time.monotonic() + 60
        f = model_flow(b"", path="/__bili/stats", headers={"x-bili-token": bili.token})
        f.request.method = "GET"
        await bili.request(f)
        return f

    try:
        f = asyncio.run(main())
    finally:
        bili.keeper.error = None
        bili.keeper.stop()
    doc = json.loads(f.response.content)
    assert f.response.status_code == 200 and doc["store"] is False and doc["sessions"] == []
    assert all(t.startswith("bili-store") for t in threads)


def test_a_replayed_flow_goes_as_it_was_sent(bili):
    """mitmweb's replay (or ``mitmdump -C``) sends again a flow bili rewrote: its request holds what went
    up then, and bili made it again: its prompt twice in the system, and a turn counted again."""
    body = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 10, "system": "You are helpful.",
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                       "messages": [{"role": "user", "content": "Review the code in src/ and list problems."}]}).encode()
    f = model_flow(body, headers=session_headers("replayed"))
    bili.request(f)
    sent = f.request.content
    assert sent.count(b"# Context folding (bili)") == 1
    g = f.copy()
    g.is_replay = "request"
    bili.request(g)
    assert g.request.content == sent
    assert bili.engine.sessions["replayed"].row.requests == 1


def test_what_a_request_names_is_escaped_in_bilis_log(bili, caplog):
    """Any local user reaches the proxy without the token, and its path, host, session header and model
    name went into bili's log lines as they came: an escape sequence rewrote the terminal the proxy
    runs in (its title, a cleared screen), a line break forged a log line of its own."""
    evil = "\x1b]0;PWNED\x07\x1b[2J\r\n[bili] forged"
    shown = "\\x1b]0;PWNED\\x07\\x1b[2J\\x0d\\x0a[bili] forged"
    with caplog.at_level(logging.INFO, logger="bili"):
        no_token = model_flow(b"", path="/__bili/stats" + evil)
        no_token.request.method = "GET"
        bili.request(no_token)
        elsewhere = model_flow(b"", path="/__bili/health" + evil, host="evil.example" + evil)
        elsewhere.request.method = "GET"
        bili.request(elsewhere)
        body = json.dumps({"model": "m" + evil, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        turn = model_flow(body.encode(), headers=session_headers("s" + evil))
        bili.request(turn)
        turn.response = tutils.tresp(status_code=400, content=b'{"error": {"message": "prompt is too long"}}')
        bili.response(turn)
    assert no_token.response.status_code == 403 and elsewhere.response.status_code == 403
    lines = [r.getMessage() for r in caplog.records]
    assert not [m for m in lines if any(c in m for c in "\x1b\x07\r\n")], lines
    said = "\n".join(lines)
    assert f"refused GET /__bili/stats{shown}: no valid admin token" in said
    assert f"refused GET /__bili/health{shown} for the host evil.example{shown}" in said
    assert f"session=s{shown} lane=anthropic" in said
    assert f"session=s{shown}: the provider says the context is too long (window unknown for m{shown})" in said
