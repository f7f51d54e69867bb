"""``/__bili/...``: answered by the addon itself, never forwarded, loopback clients only; every
endpoint but health also needs the install's admin token (:mod:`bili_addon.private`): loopback is
any local user, not this one."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from mitmproxy import ctx, http

from bili_addon import __version__, page, printable, private
from bili_addon.certs import CA_CERT, cert_with
from bili_addon.kernel.prompts import TOOLS
from bili_addon.store import StoreError
from bili_addon.transparent import SUBNET as NAMESPACES

if TYPE_CHECKING:
    from bili_addon.keeper import Keeper
    from bili_addon.meter import Meter
    from bili_addon.kernel.turn import Engine

log = logging.getLogger("bili")

PREFIX = "/__bili/"
TOOL_ENDPOINT = PREFIX + "plugin/tool"
MANIFEST_ENDPOINT = PREFIX + "plugin/manifest"
MAX_BODY = 1 << 20  # a tool call's JSON body; a compress with long summaries stays far below
PLUGIN_TOOLS = tuple(t["name"] for t in TOOLS)
INTERCEPT_ENDPOINT = PREFIX + "intercept"
_OWN_NAMES = ("localhost", "bili.proxy")  # (and this machine's name: _own_host)
_HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class Host(Protocol):
    """What the endpoints need from the addon that serves them (:class:`bili_addon.shell.Bili`)."""

    mode: str
    token: str | None  # the install's admin token, None while it cannot be written
    token_error: str | None  # why there is none
    data_dir: str
    keeper: Keeper
    meter: Meter  # the per-turn figures and the price table (the page, stats?session=)

    def load_token(self) -> str | None: ...

    def store_status(self) -> dict: ...

    def stats(self, eng: Engine | None = None, only: str | None = None) -> dict: ...

    def session_turns(self, eng: Engine, sid: str) -> dict | None: ...


def is_admin(flow: http.HTTPFlow) -> bool:
    return flow.request.path.startswith(PREFIX)


def _address(sock: tuple | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not sock:
        return None
    try:
        addr = ipaddress.ip_address(sock[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr


def _loopback(flow: http.HTTPFlow) -> bool:
    """A client on this machine: on loopback, or a program ``--transparent=netns`` runs (its
    namespace reaches the proxy's port at the host end, DNAT'd to 127.0.0.1: the client has an
    address of bili's namespace subnet and the connection's local end is loopback, which only bili's
    own veth ends route to, with ``route_localnet``)."""
    addr = _address(flow.client_conn.peername)
    if addr is None:
        return False
    if addr.is_loopback:
        return True
    local = _address(flow.client_conn.sockname)
    return addr in NAMESPACES and local is not None and local.is_loopback


def _own_host(flow: http.HTTPFlow) -> bool:
    """Is the request addressed to the proxy itself: a loopback address, ``localhost``, this machine's
    name, ``bili.proxy`` (the name the README gives for asking through the proxy), or the host end of
    bili's namespace (``--transparent=netns``)?  Not a web page's own host: a page the browser loaded
    through this proxy (bili as the system proxy), or one whose name a DNS rebinding points at
    127.0.0.1, asks ``/__bili/...`` on its own origin and could read the answer.  A reverse proxy's
    requests reach the addon with its target's host (mitmproxy rewrites it first): not checked."""
    mode = getattr(flow.client_conn.proxy_mode, "type_name", "regular")
    if mode == "reverse":
        return True
    host = flow.request.host.lower().rstrip(".")
    if host in _OWN_NAMES or host.endswith(".localhost") or host == _machine_name():
        return True
    addr = _address((host.strip("[]"),))
    return addr is not None and (addr.is_loopback or addr in NAMESPACES)


def _machine_name() -> str:
    try:
        return socket.gethostname().lower().rstrip(".")
    except OSError:
        return "localhost"


def _json(status: int, payload: object) -> http.Response:
    return http.Response.make(
        status, msgspec.json.format(msgspec.json.encode(payload)), {"content-type": "application/json"}
    )


def _fail(status: int, error: str) -> http.Response:
    return _json(status, {"ok": False, "error": error})


def authenticated(flow: http.HTTPFlow, bili: Host) -> bool:
    """Does the request carry the install's admin token?  A mismatch re-reads the token file once
    (another bili process may have created it first)."""
    presented = private.presented_token(flow.request.headers)
    if not presented:
        return False
    if private.token_matches(presented, bili.token):
        return True
    fresh = private.read_token(bili.data_dir) if bili.data_dir else None
    if fresh is None and bili.token is None:
        fresh = bili.load_token()
    if fresh is not None and fresh != bili.token:
        bili.token = fresh
        return private.token_matches(presented, fresh)
    return False


def handle(flow: http.HTTPFlow, bili: Host):
    """Answers the request; returns an awaitable when the answer needs the store (its work runs on
    the store's worker thread: health never waits on it).  An internal error answers 500: a
    ``/__bili/`` request is never forwarded (mitmproxy sends on a request whose hook raised, to the
    host it names, with its token)."""
    try:
        pending = _handle(flow, bili)
    except Exception as e:
        _internal(flow, e)
        return None
    if pending is None:
        return None

    async def guarded() -> None:
        try:
            await pending
        except Exception as e:
            _internal(flow, e)

    return guarded()


def _internal(flow: http.HTTPFlow, e: Exception) -> None:
    log.exception("[bili] %s %s: internal error (%s)", printable(flow.request.method),
                  printable(flow.request.path.split("?", 1)[0]), printable(e))
    flow.response = _fail(500, f"internal error in the bili proxy ({type(e).__name__}); see the proxy's log")


def _handle(flow: http.HTTPFlow, bili: Host):
    if not _loopback(flow):
        flow.response = _fail(403, "bili admin endpoints are loopback-only")
        return None
    if not _own_host(flow):  # (answered here, never forwarded: a client's token never leaves for that host)
        flow.response = _fail(403, "bili admin endpoints answer on the proxy's own address (127.0.0.1), "
                                   "not on another host's")
        log.warning("[bili] refused %s %s for the host %s: not the proxy's own address", printable(flow.request.method),
                    printable(flow.request.path.split("?", 1)[0]), printable(flow.request.host))
        return None
    path = flow.request.path.split("?", 1)[0]
    method = flow.request.method
    if path == PREFIX + "health" and method in ("GET", "HEAD"):
        challenge = flow.request.headers.get(private.CHALLENGE_HEADER, "")
        token = bili.token or (bili.load_token() if challenge else None)
        proof = {"proof": private.proof(token, challenge)} if challenge and token and len(challenge) <= 128 else {}
        flow.response = _json(200, {"ok": True, "version": __version__, "mode": bili.mode, **bili.store_status(),
                                    "authenticated": authenticated(flow, bili), **proof,
                                    **({"token_error": bili.token_error} if bili.token is None and bili.token_error
                                       else {}),
                                    # the proxy's listeners: a launcher re-using it checks for the one it needs
                                    "modes": list(getattr(ctx.options, "mode", None) or []), **signing_ca()})
    elif page.the_page(flow, path, method):  # its data needs a token; the page itself holds none
        return None
    elif page.sign_in(flow, bili, path):  # POST /__bili/page/sign-in: the one-time code of `bili page`
        return None
    elif not (authenticated(flow, bili) or (page.readable(path, method) and page.auth(bili).token_ok(flow))):
        flow.response = _fail(403, f"bili admin endpoints need this install's admin token: send the header "
                                   f"{private.TOKEN_HEADER} with the content of the file {private.TOKEN_FILE} "
                                   "in bili's data directory (a browser: open the URL `bili page` prints)")
        log.warning("[bili] refused %s %s: no valid admin token", printable(method), printable(path))
    elif path == PREFIX + "stats" and method == "GET":
        sid = flow.request.query.get("session")
        if sid:
            return _with_store(flow, bili, lambda eng: _session(bili, eng, sid),
                               lambda: _fail(503, "the bili store is not available; see the proxy's log"))
        # (without the store's worker, nothing of the store: the event loop never reads it, and while the
        # keeper is paused the store is not to be used at all)
        return _with_store(flow, bili, lambda eng: _json(200, bili.stats(eng)),
                           lambda: _json(200, {"sessions": [], "store": False, "store_status": bili.keeper.status()}))
    elif path == PREFIX or path.startswith(PREFIX + "page/"):
        return page.handle(flow, bili, path, _with_store)
    elif path == MANIFEST_ENDPOINT and method in ("GET", "HEAD"):
        flow.response = _json(200, {"ok": True, "tools": list(TOOLS), "toolEndpoint": TOOL_ENDPOINT})
    elif path == TOOL_ENDPOINT and method == "POST":
        call = _parse_call(flow.request)
        if isinstance(call, http.Response):
            flow.response = call
            return None
        return _with_store(flow, bili, lambda eng: plugin_tool(eng, *call),
                           lambda: _fail(503, "the bili store is not available; see the proxy's log"))
    elif path == INTERCEPT_ENDPOINT and method == "POST":
        flow.response = intercept_hosts(flow.request)
    else:
        flow.response = _fail(404, f"no such bili endpoint: {method} {path}")
    return None


_signing: tuple[tuple, dict] | None = None  # (what it was read from, the answer)


def signing_ca() -> dict:
    """The CA this proxy signs with, for health: its certificate's SHA-256 (``ca_sha256``) and, when the
    confdir holds it as mitmproxy writes it, that file (``ca_cert``).  A launcher re-using the proxy
    gives its agent this CA, not the one of its own confdir (another checkout's ``certs/``, a user's
    ``~/.mitmproxy``): every request of the agent failed TLS.  Empty when it cannot be told."""
    global _signing
    try:
        ca = ctx.master.addons.get("tlsconfig").certstore.default_ca
        fingerprint = ca.fingerprint().hex()
        path = Path(ctx.options.confdir).expanduser() / CA_CERT
    except (AttributeError, TypeError, ValueError):  # (no TLS layer: a test context)
        return {}
    try:
        key: tuple = (fingerprint, str(path), path.stat().st_mtime_ns)
    except OSError:
        key = (fingerprint, str(path), None)
    if _signing is None or _signing[0] != key:
        out = {"ca_sha256": fingerprint}
        if key[2] is not None and cert_with(path, fingerprint) is not None:
            out["ca_cert"] = str(path.resolve())
        _signing = (key, out)
    return dict(_signing[1])


def _session(bili: Host, eng: Engine, sid: str) -> http.Response:
    """``/__bili/stats?session=ID``: the session's entry of the stats and its answered turns."""
    turns = bili.session_turns(eng, sid)
    if turns is None:
        return _fail(404, f"no session {sid!r}")
    entry = next((s for s in bili.stats(eng, sid)["sessions"] if s["id"] == sid), {})
    return _json(200, {"ok": True, "session": entry, "turns": turns["turns"],
                       "calibration": turns.get("calibration", [])})


def _with_store(flow: http.HTTPFlow, bili: Host, answer, without):
    """``answer(engine)`` as the response, run where the store is used; ``without()`` when the
    store is unusable.  A handler that fails answers 500 (the keeper's None means the store only)."""
    keeper = bili.keeper

    def guarded(eng: Engine) -> http.Response:
        try:
            return answer(eng)
        except StoreError:
            raise
        except Exception as e:
            log.exception("[bili] admin %s failed: %s", printable(flow.request.path.split("?", 1)[0]), printable(e))
            return _fail(500, f"internal error: {type(e).__name__}: {e}")

    if not keeper.offloading:
        flow.response = keeper.run(guarded, None) or without()
        return None

    async def later() -> None:
        flow.response = await keeper.call(guarded, None) or without()

    return later()


# -- POST /__bili/plugin/tool ------------------------------------------------------------------------
def _parse_call(req: http.Request) -> tuple[str | None, str, dict[str, Any]] | http.Response:
    """``(conversation id or None, tool, args)`` from the body, or the error response."""
    declared = req.headers.get("content-length", "")
    if (declared.isdigit() and int(declared) > MAX_BODY) or len(req.raw_content or b"") > MAX_BODY:
        return _fail(413, f"request body over {MAX_BODY} bytes")
    try:
        raw = req.get_content(strict=True) or b""
    except ValueError as e:
        return _fail(400, f"cannot decode the request body: {e}")
    if len(raw) > MAX_BODY:
        return _fail(413, f"request body over {MAX_BODY} bytes")
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        return _fail(400, f"the body is not valid JSON: {e}")
    if not isinstance(doc, dict):
        return _fail(400, "the body must be a JSON object: {\"conversationId\", \"tool\", \"args\"}")
    tool = doc.get("tool")
    if not isinstance(tool, str) or not tool:
        return _fail(400, "missing \"tool\" (one of " + ", ".join(PLUGIN_TOOLS) + ")")
    if tool not in PLUGIN_TOOLS:
        return _fail(400, f"unknown tool {tool!r} (one of " + ", ".join(PLUGIN_TOOLS) + ")")
    sid = doc.get("conversationId")
    if sid is not None and not isinstance(sid, str):
        return _fail(400, "\"conversationId\" must be a string or null")
    args = doc.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _fail(400, "\"args\" must be a JSON object")
    return sid or None, tool, args


def plugin_tool(engine: Engine, sid: str | None, tool: str, args: dict[str, Any]) -> http.Response:
    """Run one bili tool called natively (an MCP server, a plugin) instead of on the wire."""
    try:
        resolved, result = engine.plugin_tool(sid, tool, args)
    except LookupError as e:
        return _fail(404, str(e.args[0]) if e.args else "unknown conversation")
    except StoreError as e:
        log.warning("[bili] plugin tool %s: %s", tool, printable(e))
        return _fail(503, f"the bili store failed: {e}")
    except Exception as e:
        log.exception("[bili] plugin tool %s on %s failed: %s", tool, printable(sid or "the latest conversation"),
                      printable(e))
        return _fail(500, f"internal error running {tool}: {type(e).__name__}: {e}")
    try:
        if engine.set_flag(resolved, "native_tools", True):
            log.info("[bili] session=%s: the agent calls bili's tools natively (plugin endpoint)", printable(resolved))
    except StoreError as e:  # the tool ran; the flag is informational
        log.warning("[bili] session=%s: cannot record the native_tools flag: %s", printable(resolved), printable(e))
    log.info("[bili] session=%s: plugin tool %s ran", printable(resolved), tool)
    return _json(200, {"ok": True, "tool": tool, "conversationId": resolved, "result": result})


# -- POST /__bili/intercept ---------------------------------------------------------------------------
def intercept_hosts(req: http.Request) -> http.Response:
    """``{"hosts": ["host[:port]", ...]}``: decrypt these hosts too, from the next connection on (a
    launcher re-using this proxy asks for its agent's custom model hosts).  A proxy that decrypts
    everything (no ``allow_hosts``) has nothing to add.  Answers the hosts added and those already in."""
    try:
        doc = msgspec.json.decode(req.get_content(strict=True) or b"")
    except (ValueError, msgspec.DecodeError) as e:
        return _fail(400, f"the body is not valid JSON: {e}")
    hosts = doc.get("hosts") if isinstance(doc, dict) else None
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts) or len(hosts) > 256:
        return _fail(400, 'expected {"hosts": ["host[:port]", ...]}')
    wanted: list[tuple[str, int]] = []
    for h in hosts:
        name, _, port = h.strip().lower().rpartition(":") if ":" in h else (h.strip().lower(), "", "443")
        if not _HOST_RE.match(name) or not port.isdigit() or not 0 < int(port) < 65536:
            return _fail(400, f"not a host[:port]: {h!r}")
        wanted.append((name, int(port)))
    current = list(ctx.options.allow_hosts)
    if not current:
        return _json(200, {"ok": True, "all": True, "added": [], "present": [f"{h}:{p}" for h, p in wanted]})
    patterns = [re.compile(p, re.IGNORECASE) for p in current]
    missing = [(h, p) for h, p in dict.fromkeys(wanted) if not any(x.search(f"{h}:{p}") for x in patterns)]
    if missing:
        alts = "|".join(f"{re.escape(h)}:{p}" for h, p in missing)
        ctx.options.update(allow_hosts=[*current, f"^(?:{alts})$"])
        log.info("[bili] now decrypting %s too (asked by a launcher)", ", ".join(f"{h}:{p}" for h, p in missing))
    return _json(200, {"ok": True, "all": False, "added": [f"{h}:{p}" for h, p in missing],
                       "present": [f"{h}:{p}" for h, p in wanted if (h, p) not in missing]})
