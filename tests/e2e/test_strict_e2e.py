"""Wire hygiene through real mitmdump: a strict reasoning-echo upstream (DeepSeek-class) is satisfied
from the turn after its 400, a non-strict one sees unchanged bytes, and replayed ``msg-proxy-*`` ids
never reach any upstream."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .support import Mitmdump, request

pytestmark = pytest.mark.e2e

CHAT_OK = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]}


class Strict:
    """A Chat Completions upstream on loopback that, when ``strict``, refuses an assistant tool-call
    message without ``reasoning_content`` the way DeepSeek's thinking mode does."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.bodies: list[bytes] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.bodies.append(raw)
                msgs = json.loads(raw).get("messages", [])
                missing = [m for m in msgs if m.get("role") == "assistant" and m.get("tool_calls")
                           and not isinstance(m.get("reasoning_content"), str)]
                if outer.strict and missing:
                    status, body = 400, {"error": {"message": "The reasoning_content in the thinking mode must "
                                                              "be passed back to the API.", "type": "invalid_request"}}
                else:
                    status, body = 200, CHAT_OK
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def run(strict: bool, tmp_path):
    up = Strict(strict)
    proxy = Mitmdump(tmp_path, up.port, kind="reverse").start()
    return up, proxy


HISTORY = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "List the files, please."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\":\"ls\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"},
]


def send(proxy, sid, model="gpt-x"):
    body = json.dumps({"model": model, "messages": HISTORY}).encode()
    return request(proxy.url + "/v1/chat/completions", body,
                   headers={"content-type": "application/json", "x-acp-session": sid})


def test_a_strict_upstream_is_satisfied_from_the_next_turn(tmp_path):
    up, proxy = run(True, tmp_path)
    try:
        first = send(proxy, "strict-1")
        assert first.status == 400  # the proxy does not hide the upstream's refusal
        second = send(proxy, "strict-1")
        assert second.status == 200, second.body
        sent = json.loads(up.bodies[-1])["messages"]
        assert sent[2]["reasoning_content"] == "" and sent[2]["tool_calls"] == HISTORY[2]["tool_calls"]
        assert proxy.session("strict-1")["flags"]["strict_reasoning"] is True
        proxy.restart()  # the learned flag persists with the session
        assert send(proxy, "strict-1").status == 200
    finally:
        proxy.stop()
        up.stop()


def test_a_deepseek_model_is_repaired_before_any_refusal(tmp_path):
    up, proxy = run(True, tmp_path)
    try:
        assert send(proxy, "strict-2", model="deepseek-reasoner").status == 200
    finally:
        proxy.stop()
        up.stop()


def test_a_lenient_upstream_sees_no_repair(tmp_path):
    up, proxy = run(False, tmp_path)
    try:
        for _ in range(2):
            assert send(proxy, "lenient-1").status == 200
        for raw in up.bodies:
            assert b"reasoning_content" not in raw
    finally:
        proxy.stop()
        up.stop()


def test_replayed_proxy_ids_never_reach_the_upstream(tmp_path):
    up = Strict(False)
    proxy = Mitmdump(tmp_path, up.port, kind="reverse").start()
    try:
        items = [
            {"type": "message", "role": "user", "content": "hello"},
            {"type": "message", "id": "msg-proxy-1764600000-0", "role": "assistant",
             "content": [{"type": "output_text", "text": "[bili] compressed m00002–m00009 → b1\nHi."}]},
            {"type": "reasoning", "id": "rs_keep", "summary": [], "encrypted_content": "enc"},
            {"type": "message", "id": "msg_keep", "role": "assistant",
             "content": [{"type": "output_text", "text": "Provider item."}]},
            {"type": "message", "role": "user", "content": "again"},
        ]
        body = json.dumps({"model": "gpt-5", "input": items}).encode()
        reply = request(proxy.url + "/v1/responses", body,
                        headers={"content-type": "application/json", "x-acp-session": "ids-1"})
        assert reply.status == 200
        sent = up.bodies[-1]
        assert b"msg-proxy-" not in sent and b"[bili] compressed" not in sent
        assert b'"rs_keep"' in sent and b'"msg_keep"' in sent and b'"enc"' in sent
    finally:
        proxy.stop()
        up.stop()
