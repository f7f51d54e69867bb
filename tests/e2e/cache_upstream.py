"""A fake provider whose prompt cache keeps entries for a set time (or keeps none), on 127.0.0.1,
for the calibration tests.  Time is the test's :class:`FileClock` (shared with the proxy through a
file: the cache model and the fake agree on "now" without sleeping).

Anthropic Messages (``/v1/messages``, plain and streamed) and OpenAI Chat (``/v1/chat/completions``)
answer one short text, with usage computed as a provider with that cache would report it: a request
reads from the cache only when the previous request of the same conversation (same system prompt, or
first message) came less than ``ttl`` seconds earlier; it then reads the previous request's prompt
and writes the rest; otherwise it writes (Anthropic) or reads nothing.  Tokens: bytes / 4."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class FileClock:
    """The test's time, written to a file the proxy's test clock addon reads."""

    def __init__(self, path: Path, start: float = 1_800_000_000.0):
        self.path = Path(path)
        self.set(start)

    def set(self, t: float) -> None:
        self.t = t
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(repr(t))
        os.replace(tmp, self.path)

    def advance(self, seconds: float) -> float:
        self.set(self.t + seconds)
        return self.t

    def now(self) -> float:
        return self.t


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        doc = json.loads(body)
        path = self.path.split("?", 1)[0]
        if path.endswith("/v1/messages"):
            key = json.dumps(doc.get("system"), sort_keys=True)
        else:
            key = json.dumps((doc.get("messages") or [None])[0], sort_keys=True)
        read, write = self.server.fake.usage(hashlib.sha256(key.encode()).hexdigest(), len(body) // 4)
        total = len(body) // 4
        if path.endswith("/v1/messages"):
            usage = {"input_tokens": total - read - write, "cache_read_input_tokens": read,
                     "cache_creation_input_tokens": write, "output_tokens": 5}
            msg = {"id": "msg_cache", "type": "message", "role": "assistant", "model": doc.get("model", "m"),
                   "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": usage}
            if doc.get("stream"):
                start = {**msg, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
                events = [("message_start", {"type": "message_start", "message": start}),
                          ("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}}),
                          ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": "ok"}}),
                          ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                          ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                                "stop_sequence": None},
                                             "usage": {"output_tokens": 5}}),
                          ("message_stop", {"type": "message_stop"})]
                self._send("text/event-stream",
                           b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events))
                return
            self._send("application/json", json.dumps(msg).encode())
            return
        if path.endswith("/chat/completions"):
            usage = {"prompt_tokens": total, "completion_tokens": 5, "total_tokens": total + 5,
                     "prompt_tokens_details": {"cached_tokens": read}}
            self._send("application/json", json.dumps({
                "id": "chatcmpl-cache", "object": "chat.completion", "created": 0, "model": doc.get("model", "m"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": usage}).encode())
            return
        self.send_error(404)

    def _send(self, ctype: str, data: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: "CacheUpstream"


class CacheUpstream:
    """``ttl``: seconds an entry lives after its last use (None: the provider keeps no cache)."""

    def __init__(self, clock: FileClock, ttl: float | None):
        self.clock, self.ttl = clock, ttl
        self.entries: dict[str, tuple[float, int]] = {}  # conversation -> (last use, prompt tokens)
        self.reports: list[tuple[float, int, int]] = []  # (time, read, write) per request
        self._lock = threading.Lock()

    def usage(self, key: str, tokens: int) -> tuple[int, int]:
        now = self.clock.now()
        with self._lock:
            prev = self.entries.get(key)
            hit = self.ttl is not None and prev is not None and now - prev[0] < self.ttl
            read = min(prev[1], tokens) if hit else 0
            write = (tokens - read) if self.ttl is not None else 0
            if self.ttl is not None:
                self.entries[key] = (now, tokens)
            self.reports.append((now, read, write))
        return read, write

    def __enter__(self) -> "CacheUpstream":
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="cache-upstream", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]
