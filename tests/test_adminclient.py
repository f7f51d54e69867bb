"""The one admin client: addressing, token header, JSON answers and unreachable proxies."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bili_addon import adminclient, private
from tests.e2e.support import free_port


def test_split_addresses():
    assert adminclient.split("http://127.0.0.1:8080") == ("127.0.0.1", 8080, "")
    assert adminclient.split("127.0.0.1:9") == ("127.0.0.1", 9, "")
    assert adminclient.split("http://[::1]:8080/gw/") == ("::1", 8080, "/gw")
    with pytest.raises(adminclient.Unreachable, match="not an http://"):
        adminclient.split("https://127.0.0.1:8080")


@pytest.fixture
def server():
    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self):
            n = int(self.headers.get("content-length") or 0)
            seen.append((self.command, self.path, self.headers.get(private.TOKEN_HEADER), self.rfile.read(n)))
            challenge = self.headers.get(private.CHALLENGE_HEADER)
            if self.path.endswith("/__bili/health") and challenge:  # (a proxy that holds the token "t0k")
                body, status = json.dumps({"ok": True, "proof": private.proof(KNOWN, challenge)}).encode(), 200
            elif self.path.endswith("/text"):
                body, status = b"plain words", 502
            else:
                body, status = json.dumps({"ok": False, "error": "nope"}).encode(), 403
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", seen
    srv.shutdown()
    srv.server_close()


def test_call_sends_token_and_json_and_reads_errors(server):
    address, seen = server
    got = adminclient.call(address + "/gw", "/__bili/x", method="POST", body={"a": 1}, token="t0k")
    assert (got.status, got.doc, got.error) == (403, {"ok": False, "error": "nope"}, "nope")
    assert seen[-1] == ("POST", "/gw/__bili/x", "t0k", b'{"a": 1}')
    got = adminclient.call(address, "/__bili/text")
    assert (got.status, got.doc, got.error) == (502, None, "plain words")
    assert seen[-1][:3] == ("GET", "/__bili/text", None)
    got = adminclient.call(address, "/__bili/y", proxy_form=True)
    assert seen[-1][1] == f"{address}/__bili/y"


KNOWN = "t0k"


def test_the_token_goes_only_to_a_listener_that_proves_it_holds_it(server):
    """``bili stats``, ``bili page`` and ``bili mcp`` sent the admin token to whatever listened on the
    port (another local user's program while bili was down, reading every conversation with it)."""
    address, seen = server
    with pytest.raises(adminclient.NotOurs):
        adminclient.call(address, "/__bili/stats", token="another-install's-token")
    assert all(tok is None for _m, _p, tok, _b in seen)  # (only the challenge went)
    assert adminclient.call(address, "/__bili/stats", token=KNOWN).status == 403
    assert seen[-1][2] == KNOWN


def test_unreachable_says_refused():
    with pytest.raises(adminclient.Unreachable) as e:
        adminclient.call(f"127.0.0.1:{free_port()}", "/__bili/health", timeout=2)
    assert e.value.refused
