"""The page at ``/__bili/``: bili's sessions, one session's chart, blocks, search and turn table.

Who may see it: loopback clients (checked by :mod:`bili_addon.admin` first).  The page itself (one
HTML resource, the same for everyone, no data in it) is answered to any of them; its data only to a
request with the install's admin token (header, as every admin endpoint) or a page token in the
header ``x-bili-page``.  A browser gets a page token without ever seeing the admin token: ``bili
page`` asks ``POST /__bili/page/code`` (with the token) for a one-time code valid for a minute and
prints ``/__bili/#code=...``; the page's script takes the code out of the address bar, trades it
once at ``POST /__bili/page/sign-in`` for a token, keeps that in the tab's ``sessionStorage`` and
sends it with each of its requests.  Not a cookie: a browser sends a cookie to every port of the
host (RFC 6265, section 8.5), so another local user's server on 127.0.0.1 would receive it;
``sessionStorage`` belongs to one origin, port included.  Codes and tokens live in this process
only: a restarted proxy needs ``bili page`` again.

Everything the page shows is read-only: expanding a block renders what ``decompress`` would answer
(without ``toFile``) and the search box runs ``search_context``, both on the session's stored
originals; nothing changes on the wire.  No request header is ever stored, so no API key can be
shown.  The HTML (``page.html``, a package resource) has no external assets: its charts are SVG
drawn by a small inline script from the JSON endpoints, which it polls every two seconds; its
Content-Security-Policy runs that script alone (by its hash).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable

import msgspec
from mitmproxy import http

from bili_addon import meter
from bili_addon.kernel import surfaces
from bili_addon.kernel.calibration import row_dict

if TYPE_CHECKING:
    from bili_addon.admin import Host as Bili  # the addon, as the admin endpoints see it
    from bili_addon.kernel.turn import Engine

PREFIX = "/__bili/"
CODE_PATH = PREFIX + "page/code"
SIGN_IN_PATH = PREFIX + "page/sign-in"
TOKEN_HEADER = "x-bili-page"
CODE_TTL = 60.0
TOKEN_TTL = 12 * 3600.0
MAX_CODES = 64
MAX_SIGN_IN = 1024  # the sign-in's JSON body: a code of 32 characters


def code_id(code: str) -> str:
    """A code's name that does not redeem it: what ``bili page --open`` asks about while it waits."""
    return hashlib.sha256(code.encode()).hexdigest()[:16]


@dataclass
class PageAuth:
    codes: dict[str, float] = field(default_factory=dict)  # one-time code -> expiry
    tokens: dict[str, float] = field(default_factory=dict)  # page token -> expiry

    def new_code(self) -> str:
        now = time.monotonic()
        self.codes = {c: t for c, t in self.codes.items() if t > now}
        while len(self.codes) >= MAX_CODES:
            self.codes.pop(next(iter(self.codes)))
        code = secrets.token_urlsafe(24)
        self.codes[code] = now + CODE_TTL
        return code

    def pending(self, cid: str) -> bool:
        """Is the code named ``cid`` (:func:`code_id`) still to be used, and in time?"""
        now = time.monotonic()
        return any(t > now and secrets.compare_digest(code_id(c), cid) for c, t in self.codes.items())

    def exchange(self, code: str) -> str | None:
        """A fresh page token for a valid code (used up)."""
        expiry = self.codes.pop(code, None) if code else None
        if expiry is None or expiry < time.monotonic():
            return None
        now = time.monotonic()
        self.tokens = {c: t for c, t in self.tokens.items() if t > now}
        value = secrets.token_urlsafe(32)
        self.tokens[value] = now + TOKEN_TTL
        return value

    def token_ok(self, flow: http.HTTPFlow) -> bool:
        value = flow.request.headers.get(TOKEN_HEADER, "").strip()
        if not value:
            return False
        for known, expiry in self.tokens.items():
            if secrets.compare_digest(value.encode(), known.encode()):
                return expiry > time.monotonic()
        return False


def auth(bili: Bili) -> PageAuth:
    """The page's sign-ins, kept by the addon instance (in memory only)."""
    pa = getattr(bili, "_page_auth", None)
    if pa is None:
        pa = PageAuth()
        bili._page_auth = pa  # type: ignore[attr-defined]
    return pa


def readable(path: str, method: str) -> bool:
    """What a page token opens: the page's read-only data, never the tool endpoint nor the codes."""
    return method in ("GET", "HEAD") and (
        path == PREFIX + "stats" or (path.startswith(PREFIX + "page/") and path != CODE_PATH))


def _json(status: int, payload: object) -> http.Response:
    return http.Response.make(status, msgspec.json.encode(payload),
                              {"content-type": "application/json", "cache-control": "no-store",
                               "x-content-type-options": "nosniff"})


def _fail(status: int, error: str) -> http.Response:
    return _json(status, {"ok": False, "error": error})


@functools.cache
def html() -> bytes:
    return resources.files(__package__).joinpath("page.html").read_bytes()


@functools.cache
def headers() -> dict[str, str]:
    """The page's headers: nothing from anywhere else, no framing, and of scripts its own inline one
    alone, named by its hash (the page token is in the tab's storage: an injected script would read it)."""
    script = re.search(rb"<script>(.*?)</script>", html(), re.S)
    if script is None:
        raise RuntimeError("page.html has no inline script")
    digest = base64.b64encode(hashlib.sha256(script.group(1)).digest()).decode()
    return {
        "content-type": "text/html; charset=utf-8",
        "cache-control": "no-store",
        "content-security-policy": f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
                                   "img-src data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                   "form-action 'none'",
        "referrer-policy": "no-referrer",
        "x-content-type-options": "nosniff",
        "cross-origin-resource-policy": "same-origin",
    }


def the_page(flow: http.HTTPFlow, path: str, method: str) -> bool:
    """``GET /__bili/``: the page, to any loopback client (a navigation carries no header; the page
    holds nothing but its code).  True: answered."""
    if path != PREFIX or method not in ("GET", "HEAD"):
        return False
    flow.response = http.Response.make(200, html(), headers())
    return True


def sign_in(flow: http.HTTPFlow, bili: Bili, path: str) -> bool:
    """``POST /__bili/page/sign-in`` with ``{"code": ...}``: trade a one-time code for a page token
    (True: answered)."""
    if path != SIGN_IN_PATH or flow.request.method != "POST":
        return False
    raw = flow.request.raw_content or b""
    try:
        doc = msgspec.json.decode(raw) if len(raw) <= MAX_SIGN_IN else None
    except msgspec.DecodeError:
        doc = None
    code = doc.get("code") if isinstance(doc, dict) else None
    value = auth(bili).exchange(code) if isinstance(code, str) else None
    if value is None:
        flow.response = _fail(403, "this sign-in link is used up or expired: run `bili page` again")
        return True
    flow.response = _json(200, {"ok": True, "token": value, "ttl": int(TOKEN_TTL)})
    return True


def handle(flow: http.HTTPFlow, bili: Bili, path: str, with_store: Callable) -> Any:
    """An authenticated request for the page's data (see :func:`bili_addon.admin.handle`)."""
    q = flow.request.query
    if path == CODE_PATH and flow.request.method == "POST":
        code = auth(bili).new_code()
        flow.response = _json(200, {"ok": True, "code": code, "id": code_id(code), "ttl": int(CODE_TTL)})
        return None
    if path == CODE_PATH and flow.request.method == "GET":  # `bili page --open` waits for its code to be used
        flow.response = _json(200, {"ok": True, "pending": auth(bili).pending(q.get("id", ""))})
        return None
    if flow.request.method not in ("GET", "HEAD"):
        flow.response = _fail(405, f"{path} is read-only")
        return None
    sid = q.get("session", "")
    if not sid:
        flow.response = _fail(400, "missing ?session=ID")
        return None
    unavailable = lambda: _fail(503, "the bili store is not available; see the proxy's log")  # noqa: E731
    if path == PREFIX + "page/session":
        return with_store(flow, bili, lambda eng: session(bili, eng, sid), unavailable)
    if path == PREFIX + "page/block":
        block = q.get("id", "")
        return with_store(flow, bili, lambda eng: expand(eng, sid, block), unavailable)
    if path == PREFIX + "page/search":
        query = q.get("q", "")
        return with_store(flow, bili, lambda eng: search(eng, sid, query), unavailable)
    flow.response = _fail(404, f"no such bili endpoint: GET {path}")
    return None


# -- the data (on the store's worker thread) ------------------------------------------------------------
def _live(eng: Engine, sid: str):
    """The session as this process holds it, else read from the store; never its lock (a page that
    reads kept another instance's turn of it waiting, until that turn went by unchanged)."""
    if eng.store.session(sid) is None and sid not in eng.sessions:
        return None
    return eng.session(sid)


def session(bili: Bili, eng: Engine, sid: str) -> http.Response:
    """One session: its stats entry, its answered turns, its blocks, its window."""
    s = _live(eng, sid)
    if s is None:
        return _fail(404, f"no session {sid!r}")
    entry = next((e for e in bili.stats(eng, sid)["sessions"] if e["id"] == sid), {"id": sid})
    turns = [meter.turn_dict(w, bili.meter.table) for w in eng.store.wire(sid)]
    try:
        window = eng.window_for(s)
    except Exception:  # the window is decoration; the page works without it
        window = 0
    blocks = [{"id": b.id, "tier": b.tier, "topic": b.topic, "summary": b.summary, "first": b.start_ref,
               "last": b.end_ref, "refs": len(b.covered), "covered": b.covered, "consumed": b.consumed,
               "folded_tokens": b.folded_tokens, "active": b.active, "retired": b.retired,
               "created": round(b.created, 3)} for b in s.blocks]
    calibration = [row_dict(r) for r in eng.store.calibration(sid, 50)]  # the cache model vs the provider
    return _json(200, {"ok": True, "session": entry, "turns": turns, "blocks": blocks, "window": window,
                       "calibration": calibration})


def expand(eng: Engine, sid: str, block: str) -> http.Response:
    """What ``decompress`` answers for a block (never written to a file), and its originals."""
    s = _live(eng, sid)
    if s is None:
        return _fail(404, f"no session {sid!r}")
    b = next((x for x in s.blocks if x.id == block), None)
    if b is None:
        return _fail(404, f"no block {block!r} in session {sid!r}")
    text = surfaces.decompress({"blockId": block}, s.blocks, lambda refs: eng.store.originals(sid, refs))
    originals = [{"ref": r[0], "role": r[1], "ctype": r[2], "tool": r[3], "text": r[5], "tokens": r[6]}
                 for r in eng.store.originals(sid, b.covered)]
    return _json(200, {"ok": True, "block": block, "text": text, "originals": originals})


def search(eng: Engine, sid: str, query: str) -> http.Response:
    """``search_context`` over the session's folded parts, as the model would get it."""
    s = _live(eng, sid)
    if s is None:
        return _fail(404, f"no session {sid!r}")
    text = surfaces.search_context({"query": query, "limit": 10}, s.blocks,
                                   lambda refs: eng.store.originals(sid, refs))
    return _json(200, {"ok": True, "query": query, "text": text})


__all__ = ["PageAuth", "auth", "code_id", "handle", "readable", "sign_in", "the_page"]
