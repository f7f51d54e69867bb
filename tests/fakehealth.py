"""A listener on 127.0.0.1 that answers every GET with one JSON document, as a bili proxy's
``/__bili/health`` does (the launcher's tests: another bili on a port, something posing as one)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def health_server(doc: dict, seen: list[dict] | None = None) -> Iterator[int]:
    """Its port, while the ``with`` lasts; ``seen``: each request's headers, appended."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            if seen is not None:
                seen.append(dict(self.headers))
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
