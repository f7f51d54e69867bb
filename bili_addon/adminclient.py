"""One small HTTP client for bili's own admin endpoints (``/__bili/...``).

``bili stats``, ``bili page``, ``bili mcp`` and the launcher all talk to a running proxy. They share
this: the proxy is always dialled directly (whatever ``HTTP(S)_PROXY`` the caller runs with), the
admin token goes in its header, and the answer comes back as status + parsed JSON, or as
:class:`Unreachable` with the reason when nothing usable answered.
"""

from __future__ import annotations

import hmac
import http.client
import json
import secrets
import urllib.parse
from dataclasses import dataclass
from typing import Any

from . import private


class Unreachable(Exception):
    """Nothing answered HTTP at that address (refused, timed out, reset)."""

    def __init__(self, reason: str, *, refused: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


@dataclass
class Answer:
    status: int
    raw: bytes
    doc: Any = None  # the parsed JSON body, or None when it is not JSON

    @property
    def error(self) -> str:
        """The proxy's ``error`` text, or the start of the body."""
        if isinstance(self.doc, dict) and isinstance(self.doc.get("error"), str):
            return self.doc["error"]
        return self.raw[:200].decode("utf-8", "replace")


def call(address: str, path: str, *, method: str = "GET", body: Any = None, token: str | None = None,
         timeout: float = 10.0, proxy_form: bool = False, limit: int | None = None,
         headers: dict[str, str] | None = None) -> Answer:
    """``method path`` at the proxy ``address`` (``http://host:port`` or ``host:port``).

    ``body`` is sent as JSON (``b""`` for a POST without one). ``proxy_form`` asks in the absolute
    form a forward proxy expects (``GET http://host:port/path``) rather than the origin form; a
    mitmproxy in regular mode answers both for its own endpoints.  With ``token``, the listener
    proves first that it holds the token (its answer to a challenge on ``/__bili/health``,
    :func:`private.proof`): the token never goes to whatever else listens on the port (another
    local user's program while bili is down); :class:`NotOurs` when it cannot."""
    if token:
        _prove(address, token, timeout, proxy_form)
    host, port, prefix = split(address)
    path = prefix + path
    headers = {"accept": "application/json", "connection": "close", **(headers or {})}
    if token:
        headers[private.TOKEN_HEADER] = token
    data = None
    if body is not None or method == "POST":
        data = b"" if body is None else json.dumps(body).encode()
        headers["content-type"] = "application/json"
    shown = f"[{host}]" if ":" in host else host
    target = f"http://{shown}:{port}{path}" if proxy_form else path
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, target, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(limit) if limit else resp.read()
    except ConnectionRefusedError as e:
        raise Unreachable(f"connection refused ({e.strerror or e})", refused=True) from None
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    return Answer(resp.status, raw, doc)


class NotOurs(Unreachable):
    """Something answered at that address, but not this install's bili proxy (it could not prove it
    holds the admin token): the token was not sent."""


def _prove(address: str, token: str, timeout: float, proxy_form: bool) -> None:
    challenge = secrets.token_hex(16)
    got = call(address, "/__bili/health", timeout=timeout, proxy_form=proxy_form, limit=65536,
               headers={private.CHALLENGE_HEADER: challenge})
    shown = got.doc.get("proof") if isinstance(got.doc, dict) else None
    if not (isinstance(shown, str) and hmac.compare_digest(shown, private.proof(token, challenge))):
        raise NotOurs(f"what listens at {address} is not this install's bili proxy (it could not prove it "
                      "holds the admin token; the token was not sent to it)")


def split(address: str) -> tuple[str, int, str]:
    """``http://host:port[/prefix]`` / ``host:port`` / ``[v6]:port`` -> (host, port, prefix); port 80
    when absent."""
    parsed = urllib.parse.urlsplit(address if "//" in address else "//" + address)
    if parsed.scheme not in ("", "http"):
        raise Unreachable(f"{address!r} is not an http:// address of a bili proxy")
    try:
        port = parsed.port or 80
    except ValueError:
        raise Unreachable(f"{address!r} has no valid port") from None
    return parsed.hostname or "127.0.0.1", port, parsed.path.rstrip("/")
