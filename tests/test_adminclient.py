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
            if self.path.endswith("/text"):
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


def test_unreachable_says_refused():
    with pytest.raises(adminclient.Unreachable) as e:
        adminclient.call(f"127.0.0.1:{free_port()}", "/__bili/health", timeout=2)
    assert e.value.refused
