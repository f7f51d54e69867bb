"""Helpers for the end-to-end tests: the mitmdump subprocess, SDK clients that keep the bytes they
exchanged, raw HTTP, and tag inspection of what the upstream received."""

from __future__ import annotations

import json
import os
import re
import shutil
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
import pytest

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


def need_root_and_nft() -> None:
    """Skip unless --transparent=netns works here (Linux, root, nftables: installed with apt-get when
    missing, as the browser tests install chromium)."""
    from bili_addon import transparent

    if not sys.platform.startswith("linux"):
        pytest.skip("transparent interception is Linux only")
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, veth pairs and nftables rules")
    if transparent.which("nft") is None:
        if not shutil.which("apt-get"):
            pytest.skip("nft (nftables) is not installed and there is no apt-get to install it")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "nftables"]):
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if r.returncode != 0 and cmd[1] == "install":
                pytest.skip(f"cannot install nftables ({r.stderr.strip()[-300:]})")
    netns = {m.name: m for m in transparent.support()}["netns"]
    if not netns.ok:
        pytest.skip(f"--transparent=netns does not work here: {netns.why}")


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
        # the e2e tests exercise what bili does once a session is active; lazy activation is pinned
        # explicitly where it is what a test is about (options={"bili_activate": "lazy"})
        self.options = {"bili_activate": "always", "bili_materialize": "now", **(options or {})}
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
    @property
    def bili_data_dir(self) -> Path:
        """The data dir the addon is given (``bili_data_dir``)."""
        return self.data_dir

    @property
    def token(self) -> str | None:
        """The install's admin token (the addon writes it into its data dir at start)."""
        try:
            return (self.bili_data_dir / "admin-token").read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def admin(self, path: str, method: str = "GET", timeout: float = 10, *, token: bool = True,
              body: bytes | None = None) -> tuple[int, Any]:
        """``token=False``: without the admin token (only health answers then)."""
        headers = {"x-bili-token": self.token or ""} if token else {}
        if self.kind == "reverse":
            resp = request(self.url + path, body, method=method, headers=headers, timeout=timeout)
        else:
            resp = request("http://bili.proxy" + path, body, method=method, headers=headers, proxy=self.url,
                           timeout=timeout)
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


# -- byte positions in a JSON body -----------------------------------------------------------------------

_JSON_WS = re.compile(r"[ \t\n\r]*")


def top_level_spans(raw: bytes) -> dict[str, tuple[int, int]]:
    """``{key: (start, end)}``: the byte span of each top-level value of a JSON object body
    (``raw[start:end]`` is the value's text; for an array ``raw[end - 1:end] == b"]"``)."""
    s = raw.decode()
    dec = json.JSONDecoder()
    i = _JSON_WS.match(s, 0).end()
    assert s[i] == "{", "not a JSON object"
    i += 1
    spans: dict[str, tuple[int, int]] = {}
    while True:
        i = _JSON_WS.match(s, i).end()
        if s[i] == "}":
            return spans
        key, i = json.decoder.scanstring(s, i + 1)
        i = _JSON_WS.match(s, i).end()
        assert s[i] == ":"
        i = _JSON_WS.match(s, i + 1).end()
        _, end = dec.raw_decode(s, i)
        spans[key] = (len(s[:i].encode()), len(s[:end].encode()))
        i = _JSON_WS.match(s, end).end()
        if s[i] == ",":
            i += 1


def common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assert_prefix_stable(prev: bytes, nxt: bytes, conv_key: str) -> None:
    """``nxt`` repeats ``prev`` byte for byte up to the end of ``prev``'s conversation array (its
    closing bracket excepted): everything the provider cached for ``prev`` is a prefix of ``nxt``."""
    start, end = top_level_spans(prev)[conv_key]
    lcp = common_prefix(prev, nxt)
    assert lcp >= end - 1, (
        f"the next body leaves the previous one at byte {lcp}, before the end of its {conv_key} array "
        f"(byte {end - 1}, the array starts at {start}):\n  prev: {prev[max(0, lcp - 120):lcp + 120]!r}\n"
        f"  next: {nxt[max(0, lcp - 120):lcp + 120]!r}"
    )


# -- scripted agents: an agent loop against the scripted fake model ------------------------------------

PROXY_TOOLS = ("compress", "decompress", "search_context", "acp_status")
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "The shell command to run."}},
    "required": ["command"],
}
AGENT_SYSTEM = "You are a coding agent. Audit the repository module by module with the Bash tool."


@dataclass
class Call:
    id: str  # "" where the lane has no call ids (Gemini)
    name: str
    args: str  # the arguments as the model sent them (JSON text)


@dataclass
class Answer:
    text: str  # the prose the client was shown
    call: Call | None
    items: list[Any]  # what the agent appends to its history for this answer


class Agent:
    """A client of one lane running an agent loop: it sends its history, stores the answer as the
    real agents do, runs its own tool (``Bash``) and answers a tool it does not know with that
    agent's usual error.  Every request carries the script headers of the fake's scripted model."""

    lane = ""
    conv_key = ""
    model = ""
    unknown_error = ""  # the agent's error text for a tool it does not know

    def __init__(self, base_url: str, sid: str, script: str, task: str, *, stream: bool = True):
        self.base_url, self.sid, self.script, self.stream = base_url, sid, script, stream
        self.history: list[Any] = self.initial(task)
        self.sent: dict[int, list[Any]] = {}  # turn -> the history that turn sent
        self.answers: dict[int, Answer] = {}
        self.connect()

    # -- per lane ----------------------------------------------------------------------------------
    def connect(self) -> None:
        """(Re)create the HTTP clients, e.g. after the proxy restarted."""

    def initial(self, task: str) -> list[Any]:
        raise NotImplementedError

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        raise NotImplementedError

    def result_items(self, call: Call, output: str) -> list[Any]:
        raise NotImplementedError

    def unknown_items(self, call: Call) -> list[Any]:
        raise NotImplementedError

    def title_request(self, headers: dict[str, str]) -> Any:
        """A side request without tools (title generation); returns what the client sent."""
        raise NotImplementedError

    def result_of(self, body: Any, call: Call) -> tuple[Any, str]:
        """The item of ``body`` holding ``call``'s result, and the result text."""
        raise NotImplementedError

    def call_args_of(self, body: Any, call: Call) -> str:
        """The arguments of ``call`` as ``body`` carries them (JSON text)."""
        raise NotImplementedError

    @staticmethod
    def tool_names(body: Any) -> list[str]:
        raise NotImplementedError

    # -- the loop ----------------------------------------------------------------------------------
    def headers(self, turn: int) -> dict[str, str]:
        return {"x-fake-script": self.script, "x-fake-turn": str(turn)}

    def step(self, turn: int, run_tool: Any) -> Answer:
        """One request of the loop: send, store the answer, answer its tool call."""
        self.sent[turn] = list(self.history)
        ans = self.send(self.sent[turn], self.headers(turn))
        self.answers[turn] = ans
        self.history += ans.items
        if ans.call is not None:
            if ans.call.name in PROXY_TOOLS:
                self.history += self.unknown_items(ans.call)
            else:
                self.history += self.result_items(ans.call, run_tool(ans.call, turn))
        return ans

    def resend(self, turn: int) -> Answer:
        """The request of ``turn`` again, exactly (a retry); the history is left as it is."""
        return self.send(self.sent[turn], self.headers(turn))

    def conv(self, body: Any) -> list[Any]:
        return body[self.conv_key]


class AnthropicAgent(Agent):
    """Like Claude Code: the answer stored as content blocks, tool_result with is_error for an unknown tool."""

    lane, conv_key, model = "anthropic", "messages", "claude-fake-1"
    unknown_error = "<tool_use_error>Error: No such tool available: {name}</tool_use_error>"
    tools = [{"name": "Bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA}]

    def connect(self) -> None:
        self.client, self.tee = anthropic_client(self.base_url)

    def initial(self, task: str) -> list[Any]:
        return [{"role": "user", "content": task}]

    system: Any = AGENT_SYSTEM

    def outgoing(self, history: list[Any]) -> list[Any]:
        """The messages as this agent sends them (a subclass may set breakpoints)."""
        return history

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        h = {"x-claude-code-session-id": self.sid, **headers}
        args = dict(model=self.model, max_tokens=1024, system=self.system, tools=self.tools,
                    messages=self.outgoing(history), extra_headers=h)
        if self.stream:
            with self.client.messages.stream(**args) as s:
                msg = s.get_final_message()
        else:
            msg = self.client.messages.create(**args)
        blocks: list[dict] = []
        call = None
        for b in msg.content:
            if b.type == "text":
                blocks.append({"type": "text", "text": b.text})
            elif b.type == "tool_use":
                blocks.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
                call = Call(b.id, b.name, json.dumps(b.input))
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        return Answer(text, call, [{"role": "assistant", "content": blocks}])

    def result_items(self, call: Call, output: str) -> list[Any]:
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": output}]}]

    def unknown_items(self, call: Call) -> list[Any]:
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                              "content": self.unknown_error.format(name=call.name)}]}]

    def title_request(self, headers: dict[str, str]) -> Any:
        self.client.messages.create(
            model=self.model, max_tokens=32, system="Write a five-word title for this conversation.",
            messages=[self.history[0]], extra_headers={"x-claude-code-session-id": self.sid, **headers},
        )
        return self.tee.last.request_json

    def result_of(self, body: Any, call: Call) -> tuple[Any, str]:
        for m in body["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b.get("type") == "tool_result" and b.get("tool_use_id") == call.id:
                    c = b["content"]
                    return b, c if isinstance(c, str) else "".join(x.get("text", "") for x in c)
        raise LookupError(f"no result of {call.id} in the body")

    def call_args_of(self, body: Any, call: Call) -> str:
        for m in body["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b.get("type") == "tool_use" and b.get("id") == call.id:
                    return json.dumps(b["input"], separators=(",", ":"))
        raise LookupError(f"no call {call.id} in the body")

    @staticmethod
    def tool_names(body: Any) -> list[str]:
        return [t["name"] for t in body.get("tools", [])]


class ChatAgent(Agent):
    """Like an OpenAI-compatible agent (pi, opencode): ``role: tool`` results.  With ``alter_calls``
    it stores tool-call arguments re-serialized (as some hosts do), not as the model sent them."""

    lane, conv_key, model = "chat", "messages", "gpt-fake-1"
    unknown_error = "Tool {name} not found"
    tools = [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command.",
                                               "parameters": BASH_SCHEMA}}]

    def __init__(self, *a: Any, alter_calls: bool = False, **kw: Any):
        self.alter_calls = alter_calls
        super().__init__(*a, **kw)

    def connect(self) -> None:
        self.client, self.tee = openai_client(self.base_url + "/v1")

    def initial(self, task: str) -> list[Any]:
        return [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}]

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        h = {"x-session-id": self.sid, **headers}
        text, calls = "", {}
        if self.stream:
            for chunk in self.client.chat.completions.create(
                model=self.model, messages=history, tools=self.tools, stream=True, extra_headers=h
            ):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                text += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    if tc.function is not None:
                        c["name"] = tc.function.name or c["name"]
                        c["arguments"] += tc.function.arguments or ""
        else:
            out = self.client.chat.completions.create(model=self.model, messages=history, tools=self.tools,
                                                      extra_headers=h)
            m = out.choices[0].message
            text = m.content or ""
            for k, tc in enumerate(m.tool_calls or []):
                calls[k] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
        item: dict[str, Any] = {"role": "assistant", "content": text or None}
        call = None
        if calls:
            c = calls[min(calls)]
            call = Call(c["id"], c["name"], c["arguments"])
            stored = json.dumps(json.loads(c["arguments"]), indent=1) if self.alter_calls else c["arguments"]
            item["tool_calls"] = [{"id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": stored}}]
        return Answer(text, call, [item])

    def result_items(self, call: Call, output: str) -> list[Any]:
        return [{"role": "tool", "tool_call_id": call.id, "content": output}]

    def unknown_items(self, call: Call) -> list[Any]:
        return [{"role": "tool", "tool_call_id": call.id, "content": self.unknown_error.format(name=call.name)}]

    def title_request(self, headers: dict[str, str]) -> Any:
        self.client.chat.completions.create(
            model=self.model, extra_headers={"x-session-id": self.sid, **headers},
            messages=[{"role": "system", "content": "Write a five-word title for this conversation."}, self.history[1]],
        )
        return self.tee.last.request_json

    def result_of(self, body: Any, call: Call) -> tuple[Any, str]:
        for m in body["messages"]:
            if m.get("role") == "tool" and m.get("tool_call_id") == call.id:
                return m, m["content"]
        raise LookupError(f"no result of {call.id} in the body")

    def call_args_of(self, body: Any, call: Call) -> str:
        for m in body["messages"]:
            for c in m.get("tool_calls") or []:
                if c["id"] == call.id:
                    return c["function"]["arguments"]
        raise LookupError(f"no call {call.id} in the body")

    @staticmethod
    def tool_names(body: Any) -> list[str]:
        return [t["function"]["name"] for t in body.get("tools", [])]



def responses_answer(text: str, output: list[Any]) -> Answer:
    """The agent's side of a Responses answer: its history items and the call to run, if any."""
    items: list[Any] = []
    call = None
    if text:
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
    for it in output:
        if it.type == "function_call":
            call = Call(it.call_id, it.name, it.arguments)
            items.append({"type": "function_call", "call_id": it.call_id, "name": it.name, "arguments": it.arguments})
    return Answer(text, call, items)

class ResponsesAgent(Agent):
    """Like codex over HTTP: output items stored as input items, ``function_call_output`` results."""

    lane, conv_key, model = "responses", "input", "gpt-fake-1"
    unknown_error = "unsupported call: {name}"
    tools = [{"type": "function", "name": "Bash", "description": "Run a shell command.", "parameters": BASH_SCHEMA}]

    def connect(self) -> None:
        self.client, self.tee = openai_client(self.base_url + "/v1")

    def initial(self, task: str) -> list[Any]:
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]}]

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        h = {"session_id": self.sid, **headers}
        args = dict(model=self.model, instructions=AGENT_SYSTEM, input=history, tools=self.tools, extra_headers=h)
        if self.stream:
            text, output = "", []
            for ev in self.client.responses.create(stream=True, **args):
                if ev.type == "response.output_text.delta":
                    text += ev.delta
                elif ev.type == "response.completed":
                    output = ev.response.output
        else:
            resp = self.client.responses.create(**args)
            text, output = resp.output_text, resp.output
        return responses_answer(text, output)

    def result_items(self, call: Call, output: str) -> list[Any]:
        return [{"type": "function_call_output", "call_id": call.id, "output": output}]

    def unknown_items(self, call: Call) -> list[Any]:
        return [{"type": "function_call_output", "call_id": call.id,
                 "output": self.unknown_error.format(name=call.name)}]

    def title_request(self, headers: dict[str, str]) -> Any:
        self.client.responses.create(
            model=self.model, instructions="Write a five-word title for this conversation.",
            input=[self.history[0]], extra_headers={"session_id": self.sid, **headers},
        )
        return self.tee.last.request_json

    def result_of(self, body: Any, call: Call) -> tuple[Any, str]:
        for it in body["input"]:
            if it.get("type") == "function_call_output" and it.get("call_id") == call.id:
                return it, it["output"]
        raise LookupError(f"no result of {call.id} in the body")

    def call_args_of(self, body: Any, call: Call) -> str:
        for it in body["input"]:
            if it.get("type") == "function_call" and it.get("call_id") == call.id:
                return it["arguments"]
        raise LookupError(f"no call {call.id} in the body")

    @staticmethod
    def tool_names(body: Any) -> list[str]:
        return [t["name"] for t in body.get("tools", [])]


class GeminiAgent(Agent):
    """Like gemini-cli over plain HTTP (``generateContent``, or ``streamGenerateContent?alt=sse``
    when streaming): the model's content stored as it came, and a ``functionResponse`` with an
    error for a tool it does not know.  Gemini calls carry no ids."""

    lane, conv_key, model = "gemini", "contents", "gemini-fake-1"
    unknown_error = "unknown tool"
    tools = [{"functionDeclarations": [{"name": "Bash", "description": "Run a shell command.",
                                        "parameters": BASH_SCHEMA}]}]

    def __init__(self, *a: Any, cli_ids: bool = False, **kw: Any):
        """``cli_ids``: exactly as gemini-cli answers: the model's call (stored as it came) has no id,
        the agent makes one up (``<name>-<ms>-<hex>``) and puts it on its ``functionResponse``, and an
        unknown tool gets gemini-cli's registry error."""
        self.cli_ids = cli_ids
        self._made_up = 0
        if cli_ids:
            self.unknown_error = 'Tool "{name}" not found in registry.'
        super().__init__(*a, **kw)

    def _response(self, call: Call, response: dict) -> list[Any]:
        fr: dict[str, Any] = {"name": call.name, "response": response}
        if self.cli_ids:
            self._made_up += 1
            fr = {"id": call.id or f"{call.name}-{1733170000000 + self._made_up}-{self._made_up * 7919:x}", **fr}
        return [{"role": "user", "parts": [{"functionResponse": fr}]}]

    def initial(self, task: str) -> list[Any]:
        return [{"role": "user", "parts": [{"text": task}]}]

    def _post(self, body: dict, headers: dict[str, str], *, stream: bool = False) -> Reply:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        reply = request(
            f"{self.base_url}/v1beta/models/{self.model}:{method}",
            json.dumps(body).encode(),
            headers={"content-type": "application/json", "x-goog-api-key": "fake", "x-session-id": self.sid,
                     **headers},
        )
        assert reply.status == 200, reply.body
        return reply

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        body = {"contents": history, "tools": self.tools, "systemInstruction": {"parts": [{"text": AGENT_SYSTEM}]}}
        reply = self._post(body, headers, stream=self.stream)
        if self.stream:  # streamGenerateContent?alt=sse: the text parts of the chunks make one part
            chunks = [json.loads(data) for _e, data in sse_events(reply.body)]
            got = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
            text = "".join(p["text"] for p in got if "text" in p)
            parts = ([{"text": text}] if text else []) + [p for p in got if "text" not in p]
        else:
            parts = reply.json()["candidates"][0]["content"]["parts"]
            text = "".join(p["text"] for p in parts if "text" in p)
        call = None
        for p in parts:
            if "functionCall" in p:
                fc = p["functionCall"]
                call = Call(fc.get("id", ""), fc["name"], json.dumps(fc.get("args", {})))
        return Answer(text, call, [{"role": "model", "parts": parts}])

    def result_items(self, call: Call, output: str) -> list[Any]:
        return self._response(call, {"output": output})

    def unknown_items(self, call: Call) -> list[Any]:
        return self._response(call, {"error": self.unknown_error.format(name=call.name)})

    def title_request(self, headers: dict[str, str]) -> Any:
        body = {"contents": [self.history[0]],
                "systemInstruction": {"parts": [{"text": "Write a five-word title for this conversation."}]}}
        self._post(body, headers)
        return body

    def result_of(self, body: Any, call: Call) -> tuple[Any, str]:
        for c in body["contents"]:
            for p in c["parts"]:
                fr = p.get("functionResponse")
                if fr is not None and fr.get("name") == call.name:
                    r = fr.get("response")
                    text = r.get("content") if isinstance(r, dict) else None
                    return fr, text if isinstance(text, str) else json.dumps(r)
        raise LookupError(f"no result of {call.name} in the body")

    def call_args_of(self, body: Any, call: Call) -> str:
        for c in body["contents"]:
            for p in c["parts"]:
                fc = p.get("functionCall")
                if fc is not None and fc.get("name") == call.name:
                    return json.dumps(fc.get("args", {}), separators=(",", ":"))
        raise LookupError(f"no call {call.name} in the body")

    @staticmethod
    def tool_names(body: Any) -> list[str]:
        return [d["name"] for t in body.get("tools", []) for d in t.get("functionDeclarations", [])]


AGENTS: dict[str, type[Agent]] = {
    "anthropic": AnthropicAgent,
    "chat": ChatAgent,
    "responses": ResponsesAgent,
    "gemini": GeminiAgent,
}
