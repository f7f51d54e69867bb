"""Helpers for the end-to-end tests: the mitmdump subprocess, SDK clients that keep the bytes they
exchanged, raw HTTP, and tag inspection of what the upstream received."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai

try:  # the SDKs' HTTP library: httpx2 in current releases, httpx in older ones (same API)
    import httpx2
except ImportError:  # pragma: no cover
    import httpx as httpx2  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ADDON = REPO / "bili_addon" / "addon.py"
ROUTE_ADDON = HERE / "route_addon.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"

# the tag the addon renders in front of prose, toward the model
TAG_RE = re.compile(r'^<acp tokens="([^"<>]*)" type="([^"<>]*)">(m\d{5})</acp>\n')
# group 1 session, 2 lane, 3 msgs, 4 refs new, 5 refs known, 6 tagged
BILI_LINE = re.compile(r"\[bili\] session=(\S+) lane=(\S+) msgs=(\d+) refs new=(\d+) known=(\d+) tagged=(\d+)")

_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ws_proxy", "wss_proxy"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without proxy settings or provider base-URL overrides."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.lower() not in _PROXY_VARS and not k.endswith("_BASE_URL")
    }
    env.update(extra)
    return env


# -- the proxy under test ----------------------------------------------------------------------------


class Mitmdump:
    """A real ``mitmdump -s bili_addon/addon.py`` subprocess on 127.0.0.1.

    ``kind="reverse"``: ``--mode reverse:<fake>``; clients use :attr:`url` as their base URL.
    ``kind="forward"``: regular proxy mode plus the test route addon; clients use :attr:`url` as
    their proxy and trust :attr:`ca_file`.
    """

    def __init__(
        self,
        workdir: Path,
        upstream_port: int,
        *,
        kind: str = "reverse",
        bili_mode: str = "fold",
        options: dict[str, str] | None = None,
    ):
        assert kind in ("reverse", "forward")
        self.options = dict(options or {})
        self.workdir = workdir
        self.kind = kind
        self.bili_mode = bili_mode
        self.upstream_port = upstream_port
        self.confdir = workdir / "conf"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "mitmdump.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [
            str(MITMDUMP),
            "--listen-host", "127.0.0.1",
            "--listen-port", str(self.port),
            "-s", str(ADDON),
            "--set", f"confdir={self.confdir}",
            "--set", f"bili_data_dir={self.data_dir}",
            "--set", f"bili_mode={self.bili_mode}",
        ]
        for name, value in self.options.items():
            cmd += ["--set", f"{name}={value}"]
        if self.kind == "reverse":
            cmd += ["--mode", f"reverse:http://127.0.0.1:{self.upstream_port}"]
        else:
            cmd += [
                "-s", str(ROUTE_ADDON),
                "--set", f"test_route=127.0.0.1:{self.upstream_port}",
                "--set", "connection_strategy=lazy",
            ]
        return cmd

    def start(self, timeout: float = 30.0) -> "Mitmdump":
        assert self.proc is None, "already running"
        self.confdir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"==== start #{self.starts}: {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=clean_env(PYTHONUNBUFFERED="1"),
            cwd=self.workdir,
        )
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"mitmdump exited during start-up:\n{self.log_tail()}")
            try:
                status, body = self.admin("/__bili/health", timeout=2)
                if status == 200 and body.get("ok") and (self.kind == "reverse" or self.ca_file.exists()):
                    return
            except (OSError, ValueError) as e:
                last_err = e
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mitmdump did not answer /__bili/health in {timeout}s ({last_err}):\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)

    def restart(self) -> "Mitmdump":
        """Stop and start again on the same port with the same data dir and confdir."""
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- addresses -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    # -- admin ---------------------------------------------------------------------------------
    def admin(self, path: str, method: str = "GET", timeout: float = 10) -> tuple[int, Any]:
        if self.kind == "reverse":
            resp = request(self.url + path, method=method, timeout=timeout)
        else:
            resp = request("http://bili.proxy" + path, method=method, proxy=self.url, timeout=timeout)
        return resp.status, json.loads(resp.body) if resp.body else None

    def health(self) -> dict:
        status, body = self.admin("/__bili/health")
        assert status == 200, body
        return body

    def stats(self) -> dict:
        status, body = self.admin("/__bili/stats")
        assert status == 200, body
        return body

    def session(self, sid: str) -> dict | None:
        for s in self.stats()["sessions"]:
            if s["id"] == sid:
                return s
        return None

    # -- the log -------------------------------------------------------------------------------
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def bili_lines(self, session: str | None = None) -> list[re.Match]:
        out = []
        for line in self.log().splitlines():
            m = BILI_LINE.search(line)
            if m and (session is None or m.group(1) == session):
                out.append(m)
        return out

    def wait_bili_lines(self, count: int, session: str | None = None, timeout: float = 10) -> list[re.Match]:
        """The log is written by another process: wait until ``count`` lines are there (or return what is)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.bili_lines(session)
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)


# -- raw HTTP ----------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    url: str,
    body: bytes | None = None,
    *,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    proxy: str | None = None,
    timeout: float = 30,
) -> Reply:
    """One request with urllib (no environment proxies; ``proxy`` for http:// URLs only)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy} if proxy else {}))
    req = urllib.request.Request(url, data=body, method=method or ("POST" if body is not None else "GET"))
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with opener.open(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


# -- SDK clients that keep their bytes -------------------------------------------------------------------


@dataclass
class Exchange:
    method: str
    url: str
    request_headers: dict[str, str]
    request_body: bytes
    status: int = 0
    response_body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)

    @property
    def request_json(self) -> Any:
        return json.loads(self.request_body)


class _TeeStream(httpx2.SyncByteStream):
    def __init__(self, inner: Any, ex: Exchange):
        self.inner, self.ex = inner, ex

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.ex.chunks.append(chunk)
            self.ex.response_body = b"".join(self.ex.chunks)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class Tee(httpx2.BaseTransport):
    """A transport wrapper keeping the exact request body and (transfer-decoded) response body."""

    def __init__(self, inner: httpx2.BaseTransport):
        self.inner = inner
        self.exchanges: list[Exchange] = []

    def handle_request(self, req: httpx2.Request) -> httpx2.Response:
        ex = Exchange(req.method, str(req.url), dict(req.headers), req.read())
        self.exchanges.append(ex)
        resp = self.inner.handle_request(req)
        ex.status = resp.status_code
        resp.stream = _TeeStream(resp.stream, ex)
        return resp

    def close(self) -> None:
        self.inner.close()

    @property
    def last(self) -> Exchange:
        return self.exchanges[-1]


def http_client(
    *, proxy: str | None = None, verify: ssl.SSLContext | bool = True, http2: bool = False
) -> tuple[httpx2.Client, Tee]:
    """An httpx2 client for the SDKs: no environment proxies, the given proxy and trust, and a Tee."""
    tee = Tee(httpx2.HTTPTransport(trust_env=False, proxy=proxy, verify=verify, http2=http2))
    return httpx2.Client(transport=tee, timeout=30, trust_env=False), tee


def anthropic_client(base_url: str | None, **kw: Any) -> tuple[anthropic.Anthropic, Tee]:
    hc, tee = http_client(**kw)
    args: dict[str, Any] = {"api_key": "sk-fake", "http_client": hc, "max_retries": 0}
    if base_url is not None:
        args["base_url"] = base_url
    return anthropic.Anthropic(**args), tee


def openai_client(base_url: str | None, **kw: Any) -> tuple[openai.OpenAI, Tee]:
    hc, tee = http_client(**kw)
    args: dict[str, Any] = {"api_key": "sk-fake", "http_client": hc, "max_retries": 0}
    if base_url is not None:
        args["base_url"] = base_url
    return openai.OpenAI(**args), tee


# -- tags ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tag:
    path: tuple
    ref: str
    tokens: str
    kind: str
    text: str  # the text after the tag


def strip_tags(obj: Any, path: tuple = ()) -> tuple[Any, list[Tag]]:
    """``obj`` with every leading tag removed from every string, and the tags found (in order)."""
    found: list[Tag] = []

    def walk(v: Any, p: tuple) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, p + (k,)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, p + (i,)) for i, x in enumerate(v)]
        if isinstance(v, str):
            m = TAG_RE.match(v)
            if m:
                rest = v[m.end():]
                found.append(Tag(p, m.group(3), m.group(1), m.group(2), rest))
                return rest
        return v

    return walk(obj, path), found


def tags_by_text(obj: Any) -> dict[str, str]:
    """``{text after the tag: ref}`` for every tagged string in ``obj``."""
    return {t.text: t.ref for t in strip_tags(obj)[1]}


def get_path(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def sse_events(raw: bytes) -> list[tuple[str, str]]:
    """``(event, data)`` of each event in an SSE body (``event`` is '' when absent)."""
    out = []
    for block in re.split(rb"\r?\n\r?\n", raw):
        if not block.strip():
            continue
        ev, data = "", []
        for line in block.decode().splitlines():
            if line.startswith("event:"):
                ev = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        out.append((ev, "\n".join(data)))
    return out


def expected_tokens(text: str) -> str:
    """The token figure the addon announces for ``text`` (its own estimate, formatted)."""
    from bili_addon.kernel.identity import count_tokens
    from bili_addon.kernel.tags import format_tokens

    return format_tokens(count_tokens(text))


def assert_only_tags_added(upstream: Any, sent: Any) -> list[Tag]:
    """What the upstream got equals what the client sent once the leading tags are removed; every
    tag is a text tag whose token figure matches its text.  Returns the tags, in document order."""
    assert not strip_tags(sent)[1], "the client itself sent tags"
    clean, found = strip_tags(upstream)
    assert clean == sent
    for t in found:
        assert t.kind == "text", t
        assert t.tokens == expected_tokens(t.text), t
    return found


# host: rewritten by reverse mode; content-length: the body grew; accept-encoding: in fold mode the
# addon asks for an uncompressed answer so it can filter the response stream
HEADERS_THE_PROXY_MAY_CHANGE = ("host", "content-length", "accept-encoding")


def assert_headers_forwarded(rec: Any, client_headers: dict[str, str], ignore: tuple[str, ...] = HEADERS_THE_PROXY_MAY_CHANGE) -> None:
    """Every header the client sent reaches the upstream with its value (except ``ignore``)."""
    for k, v in client_headers.items():
        if k.lower() in ignore:
            continue
        assert rec.header(k) == v, f"header {k}: client sent {v!r}, upstream got {rec.header(k)!r}"
