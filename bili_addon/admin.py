"""``/__bili/...``: answered by the addon itself, never forwarded, loopback clients only."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

import msgspec
from mitmproxy import http

from bili_addon import __version__

if TYPE_CHECKING:
    from bili_addon.shell import Bili

PREFIX = "/__bili/"


def is_admin(flow: http.HTTPFlow) -> bool:
    return flow.request.path.startswith(PREFIX)


def _loopback(flow: http.HTTPFlow) -> bool:
    peer = flow.client_conn.peername
    if not peer:
        return False
    try:
        addr = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _json(status: int, payload: object) -> http.Response:
    return http.Response.make(
        status, msgspec.json.format(msgspec.json.encode(payload)), {"content-type": "application/json"}
    )


def handle(flow: http.HTTPFlow, bili: Bili) -> None:
    if not _loopback(flow):
        flow.response = _json(403, {"error": "bili admin endpoints are loopback-only"})
        return
    path = flow.request.path.split("?", 1)[0]
    if path == PREFIX + "health" and flow.request.method in ("GET", "HEAD"):
        flow.response = _json(200, {"ok": True, "version": __version__, "mode": bili.mode, "store": bili.store_ok})
    elif path == PREFIX + "stats" and flow.request.method == "GET":
        flow.response = _json(200, bili.stats())
    else:
        flow.response = _json(404, {"error": f"no such bili endpoint: {flow.request.method} {path}"})
