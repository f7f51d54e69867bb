"""Test-only mitmproxy addon: send every intercepted request to the fake upstream.

In forward (regular) mode the clients talk to their real hosts (``https://api.anthropic.com``,
``https://api.openai.com``) through the proxy; this addon re-targets each request to
``http://<test_route>`` after the TLS interception, keeping the original ``Host`` header so the
fake can see which provider the client meant.  Load it *after* the bili addon so the admin
endpoints it answers are never re-routed, and run mitmdump with ``connection_strategy=lazy`` so no
upstream connection to the real host is attempted before this hook has run.
"""

from __future__ import annotations

from mitmproxy import ctx, http


class TestRoute:
    def load(self, loader) -> None:
        loader.add_option("test_route", str, "", "HOST:PORT every proxied request is re-targeted to (tests only).")

    def request(self, flow: http.HTTPFlow) -> None:
        target = ctx.options.test_route
        if not target or flow.response is not None:
            return
        host, _, port = target.rpartition(":")
        original_host = flow.request.host_header
        flow.request.scheme = "http"
        flow.request.host = host
        flow.request.port = int(port)
        if original_host:
            flow.request.host_header = original_host


addons = [TestRoute()]
