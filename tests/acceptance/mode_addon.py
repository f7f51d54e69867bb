"""Test-only mitmproxy addon: log the listener (proxy mode) and the client of every request, so a
test can tell a request that came by the transparent redirect from one sent to the proxy port."""

from __future__ import annotations

import logging

from mitmproxy import http


class ModeLog:
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        peer = flow.client_conn.peername
        logging.info("[test-mode] mode=%s peer=%s host=%s path=%s", flow.client_conn.proxy_mode.full_spec,
                     peer[0] if peer else "-", flow.request.host_header or flow.request.host,
                     flow.request.path.split("?", 1)[0])


addons = [ModeLog()]
