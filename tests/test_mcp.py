"""Native tools: the ``/__bili/plugin/...`` endpoints and the ``bili mcp`` stdio server.

Unit tests drive the addon with mitmproxy's test helpers (no sockets); the end-to-end tests start a
real mitmdump and a real ``python -m bili_addon.mcp`` and speak JSON-RPC to it over pipes.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from bili_addon import __version__, cli, mcp
from bili_addon.kernel.prompts import TOOLS
from bili_addon.shell import Bili

REPO = Path(__file__).resolve().parents[1]
ADDON = REPO / "bili_addon" / "addon.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"
TOOL_NAMES = [t["name"] for t in TOOLS]
_ENV_DROP = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "bili_proxy", "bili_conversation_id", "bili_token",
             "bili_data_dir"}


def anthropic_body(*texts: str, tools: list[dict] | None = None) -> bytes:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]
    if tools is None:
        tools = [{"name": "Bash", "description": "Run a shell command.",
                  "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    return json.dumps({"model": "claude-test", "max_tokens": 16, "tools": tools, "messages": messages}).encode()


def flow(path: str, content: bytes = b"", *, method: str = "POST", peer: str = "127.0.0.1",
         headers: dict | None = None) -> tflow.HTTPFlow:
    """A request from ``peer``: to the model's host, or a ``/__bili/`` one to the proxy's own address."""
    admin = path.startswith("/__bili/")
    host = "127.0.0.1" if admin else "api.anthropic.com"
    h = http.Headers(host=f"{host}:8080" if admin else host, content_type="application/json", **(headers or {}))
    req = tutils.treq(method=method.encode(), path=path.encode(), host=host, port=8080 if admin else 443,
                      scheme=b"http" if admin else b"https", headers=h, content=content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = (peer, 1)
    return f


def model_request(bili: Bili, sid: str, *texts: str, tools: list[dict] | None = None) -> dict:
    f = flow("/v1/messages", anthropic_body(*texts, tools=tools), headers={"x_acp_session": sid})
    bili.request(f)
    assert f.response is None  # a model request goes upstream
    return json.loads(f.request.content)


def call_tool(bili: Bili, payload, *, peer: str = "127.0.0.1", raw: bytes | None = None) -> tuple[int, dict]:
    body = raw if raw is not None else json.dumps(payload).encode()
    f = flow("/__bili/plugin/tool", body, peer=peer, headers={"x-bili-token": bili.token or ""})
    bili.request(f)
    assert f.response is not None
    assert f.response.headers["content-type"] == "application/json"
    return f.response.status_code, json.loads(f.response.content)


# -- the admin endpoints ---------------------------------------------------------------------------
def test_acp_status_through_the_endpoint(bili):
    model_request(bili, "conv-1", "Please look at the build scripts.")
    status, doc = call_tool(bili, {"conversationId": "conv-1", "tool": "acp_status", "args": {}})
    assert status == 200, doc
    assert doc["ok"] is True and doc["tool"] == "acp_status" and doc["conversationId"] == "conv-1"
    assert doc["result"].startswith("Context:")
    # the session now counts as having bili's tools natively
    [entry] = bili.stats()["sessions"]
    assert entry["flags"].get("native_tools") is True


def model_answer(bili: Bili, sid: str, *texts: str, calls: list[tuple[str, dict]] = ()) -> None:
    """A model request of conversation ``sid`` and its (JSON) answer, which calls ``calls``: (tool
    name as the agent has it, arguments)."""
    f = flow("/v1/messages", anthropic_body(*texts), headers={"x_acp_session": sid})
    bili.request(f)
    content = [{"type": "text", "text": "Let me check."}] + [
        {"type": "tool_use", "id": f"toolu_{sid}_{i}", "name": name, "input": args} for i, (name, args) in enumerate(calls)]
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "content": content, "stop_reason": "tool_use",
              "usage": {"input_tokens": 10, "output_tokens": 5}}
    f.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=json.dumps(answer).encode())
    bili.responseheaders(f)
    bili.response(f)


def test_null_conversation_is_the_one_whose_answer_made_the_call(bili):
    """``bili mcp`` started without a conversation (as the agents' MCP settings start it): the call
    runs in the conversation whose answer made it, never in whichever went through the proxy last
    (another agent's, as often as not: its refs are valid there too)."""
    model_answer(bili, "older", "first conversation", calls=[("mcp__bili__acp_status", {})])
    model_answer(bili, "newer", "second conversation")
    status, doc = call_tool(bili, {"conversationId": None, "tool": "acp_status"})
    assert status == 200 and doc["conversationId"] == "older"
    # run once: the same call again was made by no answer
    status, doc = call_tool(bili, {"conversationId": None, "tool": "acp_status"})
    assert status == 404 and "--conversation" in doc["error"]
    # the arguments decide, whatever their order or spacing
    model_answer(bili, "newer", "second conversation", "a reply", "go on",
                 calls=[("bili_search_context", {"query": "build scripts", "limit": 3})])
    status, doc = call_tool(bili, {"tool": "search_context", "args": {"limit": 3, "query": "build scripts"}})
    assert status == 200 and doc["conversationId"] == "newer" and isinstance(doc["result"], str)
    # two conversations made the very same call: which one asks cannot be told
    model_answer(bili, "older", "first conversation", "ok", "status?", calls=[("mcp__bili__acp_status", {})])
    model_answer(bili, "newer", "second conversation", "ok", "status?", calls=[("mcp__bili__acp_status", {})])
    status, doc = call_tool(bili, {"tool": "acp_status"})
    assert status == 404 and "2 conversations" in doc["error"]
    # a named conversation needs no answer
    status, doc = call_tool(bili, {"conversationId": "older", "tool": "acp_status"})
    assert status == 200 and doc["conversationId"] == "older"


def declined(sid: str, text: str, call_id: str, tool: str = "mcp__bili__acp_status") -> bytes:
    """The agent's next request after its answer called ``tool`` (``call_id``) and the user declined it:
    the call and its error result in the history, the call never run."""
    msgs = [{"role": "user", "content": text},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": call_id, "name": tool, "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "is_error": True,
                                          "content": "The user doesn't want to proceed with this tool use."},
                                         {"type": "text", "text": "no status, go on"}]}]
    return json.dumps({"model": "claude-test", "max_tokens": 16, "messages": msgs}).encode()


def test_a_native_call_the_agent_answered_without_running_it_is_no_ones(bili):
    """A call the user declined (or the agent may not run) is answered with an error and never reaches
    ``bili mcp``: once a request carries its answer, the same call from another conversation (whose
    answer this proxy did not read: another instance's, or no proxy's) is no longer taken for it."""
    model_answer(bili, "conv-A", "audit the payments service", calls=[("mcp__bili__acp_status", {})])
    f = flow("/v1/messages", declined("conv-A", "audit the payments service", "toolu_conv-A_0"),
             headers={"x_acp_session": "conv-A"})
    bili.request(f)
    status, doc = call_tool(bili, {"conversationId": None, "tool": "acp_status", "args": {}})
    assert status == 404 and "conv-A" not in json.dumps(doc), doc


def test_a_call_made_again_after_a_declined_one_keeps_its_own_id(bili):
    """The same call made again in the conversation, run this time: it is that call (its id, which a
    fold keeps for a fork's inheritance), not the declined one before it."""
    eng = bili.engine
    model_answer(bili, "conv-B", "audit the payments service", calls=[("mcp__bili__acp_status", {})])
    eng.native.note("conv-B", "mcp__bili__acp_status", {}, "toolu_ran")  # (a later answer, the same call)
    assert eng.native.take("acp_status", {}) == ("conv-B", "toolu_ran")


def test_a_native_fold_whose_write_failed_is_not_on_the_wire(bili, tmp_path):
    """A compress whose store write fails (another process holds SQLite's write lock past its wait)
    answers that it did not run: its fold is then neither stored nor sent, before or after a restart."""
    import sqlite3

    bili.tctx.configure(bili, bili_min_compress_chars=0)
    texts = [f"message {i}: " + "details about the build " * 10 for i in range(10)]
    model_request(bili, "conv-w", *texts)
    summary = "SUMMARY-XYZ: explored the build scripts; nothing to change in bootstrap or the test wrappers."
    other = sqlite3.connect(bili.engine.store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        status, doc = call_tool(bili, {"conversationId": "conv-w", "tool": "compress",
                                       "args": {"content": [{"startId": "m00002", "endId": "m00004",
                                                             "summary": summary}]}})
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert status == 503, doc
    sent = json.dumps(model_request(bili, "conv-w", *texts, "next question"))
    assert summary not in sent and "message 3:" in sent


def test_compress_through_the_endpoint_folds_the_next_request(bili):
    bili.tctx.configure(bili, bili_min_compress_chars=0)
    texts = [f"message {i}: " + "details about the build " * 10 for i in range(10)]
    model_request(bili, "conv-fold", *texts)
    summary = "Explored the build scripts; nothing to change in bootstrap or test wrappers."
    status, doc = call_tool(bili, {
        "conversationId": "conv-fold", "tool": "compress",
        "args": {"content": [{"startId": "m00002", "endId": "m00004", "summary": summary, "topic": "build"}]},
    })
    assert status == 200, doc
    assert "b1" in doc["result"], doc["result"]
    sent = model_request(bili, "conv-fold", *texts, "next question")
    contents = [json.dumps(m["content"]) for m in sent["messages"]]
    assert any("[Compressed conversation section b1" in c and summary in c for c in contents)
    assert not any("message 2:" in c for c in contents)


def test_native_tools_on_the_wire_turn_off_injection(bili):
    tools = [{"name": "mcp__bili__compress", "description": "x", "input_schema": {"type": "object"}}]
    sent = model_request(bili, "conv-native", "hello there, native", tools=tools)
    assert [t["name"] for t in sent["tools"]] == ["mcp__bili__compress"]
    assert "Context folding (bili)" in json.dumps(sent["system"])  # the instructions still go in
    plain = model_request(bili, "conv-wire", "hello there, wire")
    assert [t["name"] for t in plain["tools"]] == ["Bash", *TOOL_NAMES]


@pytest.mark.parametrize("payload,fragment", [
    ({"conversationId": "conv-1", "tool": "rm_rf", "args": {}}, "unknown tool"),
    ({"conversationId": "conv-1", "args": {}}, "missing"),
    ({"conversationId": "conv-1", "tool": "acp_status", "args": []}, "args"),
    ({"conversationId": 7, "tool": "acp_status"}, "conversationId"),
    (["acp_status"], "object"),
])
def test_bad_calls_are_400(bili, payload, fragment):
    model_request(bili, "conv-1", "hello there")
    status, doc = call_tool(bili, payload)
    assert status == 400 and doc["ok"] is False and fragment in doc["error"]


def test_bad_json_is_400(bili):
    status, doc = call_tool(bili, None, raw=b'{"tool": "acp_status", ')
    assert status == 400 and doc["ok"] is False and "JSON" in doc["error"]


def test_unknown_conversation_is_404(bili):
    model_request(bili, "conv-1", "hello there")
    status, doc = call_tool(bili, {"conversationId": "no-such-conv", "tool": "acp_status", "args": {}})
    assert status == 404 and doc["ok"] is False and "no-such-conv" in doc["error"]


def test_no_conversation_yet_is_404(bili):
    status, doc = call_tool(bili, {"conversationId": None, "tool": "acp_status", "args": {}})
    assert status == 404 and "no conversation" in doc["error"]


@pytest.mark.parametrize("peer", ["10.1.2.3", "2001:db8::1"])
def test_non_loopback_is_403(bili, peer):
    model_request(bili, "conv-1", "hello there")
    status, doc = call_tool(bili, {"conversationId": "conv-1", "tool": "acp_status"}, peer=peer)
    assert status == 403 and doc["ok"] is False
    m = flow("/__bili/plugin/manifest", method="GET", peer=peer, headers={"x-bili-token": bili.token})
    bili.request(m)
    assert m.response.status_code == 403


def test_oversized_body_is_413(bili):
    big = json.dumps({"tool": "search_context", "args": {"query": "x" * (1 << 20)}}).encode()
    status, doc = call_tool(bili, None, raw=big)
    assert status == 413 and doc["ok"] is False


def test_no_store_is_503(tmp_path):
    (tmp_path / "data" / "bili.sqlite3").mkdir(parents=True)  # the store cannot open, the token can be written
    addon = Bili()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, bili_data_dir=str(tmp_path / "data"))
        assert addon.engine is None and addon.token
        status, doc = call_tool(addon, {"conversationId": None, "tool": "acp_status", "args": {}})
    assert status == 503 and doc["ok"] is False


def test_unexpected_failure_is_500_and_logged(bili, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(bili.engine, "plugin_tool", boom)
    with caplog.at_level(logging.ERROR, logger="bili"):
        status, doc = call_tool(bili, {"conversationId": None, "tool": "acp_status", "args": {}})
    assert status == 500 and doc["ok"] is False and "kaboom" in doc["error"]
    assert "kaboom" in caplog.text


def test_manifest(bili):
    f = flow("/__bili/plugin/manifest", method="GET", headers={"x-bili-token": bili.token})
    bili.request(f)
    assert f.response.status_code == 200
    doc = json.loads(f.response.content)
    assert doc["ok"] is True and doc["toolEndpoint"] == "/__bili/plugin/tool"
    assert doc["tools"] == [dict(t) for t in TOOLS]
    wrong = flow("/__bili/plugin/tool", method="GET", headers={"x-bili-token": bili.token})
    bili.request(wrong)
    assert wrong.response.status_code == 404


# -- the MCP protocol, in process -------------------------------------------------------------------
def rpc(server: mcp.Server, method: str, params: dict | None = None, mid: int | str = 1):
    msg = {"jsonrpc": "2.0", "id": mid, "method": method}
    if params is not None:
        msg["params"] = params
    return server.handle_line(json.dumps(msg))


@pytest.mark.parametrize("asked,answered", [
    ("2024-11-05", "2024-11-05"), ("2025-03-26", "2025-03-26"), ("2025-06-18", "2025-06-18"),
    ("1999-01-01", "2025-06-18"), (None, "2025-06-18"),
])
def test_initialize_negotiates_the_version(asked, answered):
    reply = rpc(mcp.Server(), "initialize", {"protocolVersion": asked, "capabilities": {},
                                              "clientInfo": {"name": "t", "version": "0"}})
    res = reply["result"]
    assert reply["id"] == 1 and reply["jsonrpc"] == "2.0"
    assert res["protocolVersion"] == answered
    assert res["capabilities"] == {"tools": {}}
    assert res["serverInfo"] == {"name": "bili", "version": __version__}


def test_protocol_basics_in_process():
    s = mcp.Server()
    assert s.handle_line('{"jsonrpc": "2.0", "method": "notifications/initialized"}') is None
    assert rpc(s, "ping", mid="p")["result"] == {}
    tools = rpc(s, "tools/list")["result"]["tools"]
    assert [t["name"] for t in tools] == TOOL_NAMES
    assert all(t["inputSchema"] == src["parameters"] for t, src in zip(tools, TOOLS))
    assert rpc(s, "resources/list")["error"]["code"] == -32601
    assert s.handle_line("{not json")["error"]["code"] == -32700
    assert s.handle_line("{not json")["id"] is None
    assert rpc(s, "tools/call", {"name": "rm_rf", "arguments": {}})["error"]["code"] == -32602
    assert s.handle_line('{"jsonrpc": "2.0", "id": 3}')["error"]["code"] == -32600


def test_malformed_lines_are_answered_and_the_server_goes_on():
    """A lone surrogate in an echoed id (not UTF-8) and a line nested past the parser's depth ended
    the server (the agent's MCP tools then gone); each is an error reply, the next line answered."""
    import io

    lines = ['{"jsonrpc": "2.0", "id": "\\ud800", "method": "ping"}', "[" * 100_000 + "]" * 100_000,
             '{"jsonrpc": "2.0", "id": 7, "method": "ping"}']
    out = io.BytesIO()
    assert mcp.serve(mcp.Server(), io.BytesIO("\n".join(lines).encode() + b"\n"), out) == 0
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert replies[0]["id"] == "\ud800" and replies[0]["result"] == {}
    assert replies[1]["error"]["code"] == -32700
    assert replies[2] == {"jsonrpc": "2.0", "id": 7, "result": {}}


def test_cli_registers_mcp():
    assert "mcp" in cli.COMMANDS
    args = cli.build_parser().parse_args(["mcp", "--proxy", "http://127.0.0.1:1", "--conversation", "c"])
    assert (args.command, args.proxy, args.conversation) == ("mcp", "http://127.0.0.1:1", "c")


# -- end to end: mitmdump + python -m bili_addon.mcp ---------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in _ENV_DROP}
    env.update(extra)
    return env


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, payload: bytes | None = None, timeout: float = 10,
              headers: dict | None = None) -> tuple[int, dict]:
    headers = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=payload, headers=headers)
    try:
        with DIRECT.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"raw": body.decode("utf-8", "replace")}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    if not MITMDUMP.exists():
        pytest.skip(f"mitmdump not found next to the interpreter ({MITMDUMP})")
    work = tmp_path_factory.mktemp("mcp-e2e")
    port = free_port()
    log_path = work / "mitmdump.log"
    cmd = [str(MITMDUMP), "-s", str(ADDON), "--listen-host", "127.0.0.1", "--listen-port", str(port),
           "--mode", "reverse:http://127.0.0.1:9", "--set", "connection_strategy=lazy",
           "--set", f"bili_data_dir={work / 'data'}", "--set", f"confdir={work / 'conf'}"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=clean_env(PYTHONUNBUFFERED="1"), cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mitmdump exited:\n{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if http_json(url + "/__bili/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mitmdump did not answer:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield url, work / "data"
    finally:
        stop(proc)


class McpClient:
    """``python -m bili_addon.mcp`` as a subprocess: one JSON-RPC message per line, bounded waits."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bili_addon.mcp", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env if env is not None else clean_env(), cwd=cwd,
        )
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        self.next_id = 0

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 30) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no reply from bili mcp in {timeout}s; stderr: {b''.join(self.stderr)!r}")
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        return json.loads(line)

    def request(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        msg = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        reply = self.read()
        assert reply["id"] == self.next_id and reply["jsonrpc"] == "2.0"
        return reply

    def handshake(self) -> dict:
        reply = self.request("initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                                            "clientInfo": {"name": "pytest", "version": "1"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return reply["result"]

    def call(self, name: str, arguments: dict | None = None) -> dict:
        return self.request("tools/call", {"name": name, "arguments": arguments or {}})["result"]

    def close(self) -> int:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF: the server exits on its own
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise


@pytest.fixture
def mcp_client():
    started: list[McpClient] = []

    def start(*args: str, **kw) -> McpClient:
        c = McpClient(*args, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait(timeout=10)


@pytest.mark.e2e
def test_mcp_server_against_a_real_proxy(proxy, mcp_client, tmp_path):
    proxy, data = proxy
    c = mcp_client("--proxy", proxy, "--data-dir", str(data), cwd=tmp_path)
    init = c.handshake()
    assert init["protocolVersion"] == "2025-03-26"
    assert init["serverInfo"] == {"name": "bili", "version": __version__}
    tools = c.request("tools/list")["result"]["tools"]
    assert [t["name"] for t in tools] == TOOL_NAMES and len(tools) == 4
    assert c.request("ping")["result"] == {}
    assert c.request("no/such/method")["error"]["code"] == -32601
    c.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 99}})
    c.proc.stdin.write(b"this is not json\n")
    c.proc.stdin.flush()
    assert c.read()["error"]["code"] == -32700

    # nothing went through the proxy yet: the endpoint's 404, relayed as a tool error
    res = c.call("acp_status")
    assert res["isError"] is True
    assert "no conversation" in res["content"][0]["text"]

    # a model request records its conversation before the (dead) upstream is dialled
    status, _ = http_json(proxy + "/v1/messages", anthropic_body("hello through the proxy"), timeout=30,
                          headers={"x-acp-session": "e2e-conv"})
    assert status >= 500  # the upstream at 127.0.0.1:9 is down; the ledger has the session anyway
    res = c.call("acp_status")  # no answer made this call: no conversation to run it in
    assert res["isError"] is True and "--conversation" in res["content"][0]["text"]
    assert c.close() == 0
    c = mcp_client("--proxy", proxy, "--data-dir", str(data), "--conversation", "e2e-conv", cwd=tmp_path)
    c.handshake()
    res = c.call("acp_status")
    assert res["isError"] is False, res
    assert res["content"][0]["type"] == "text" and res["content"][0]["text"].startswith("Context:")
    assert c.close() == 0

    status, stats = http_json(proxy + "/__bili/stats")
    assert status == 403 and "sessions" not in stats  # the admin token is needed, loopback or not
    token = (data / "admin-token").read_text().strip()
    status, stats = http_json(proxy + "/__bili/stats", headers={"x-bili-token": token})
    [entry] = stats["sessions"]
    assert entry["id"] == "e2e-conv" and entry["flags"].get("native_tools") is True


@pytest.mark.e2e
def test_mcp_server_with_an_unknown_conversation(proxy, mcp_client, tmp_path):
    proxy, data = proxy
    # the token through $BILI_DATA_DIR (what the launcher sets with --data-dir)
    c = mcp_client("--proxy", proxy, "--conversation", "conv-that-never-was", cwd=tmp_path,
                   env=clean_env(BILI_DATA_DIR=str(data)))
    c.handshake()
    res = c.call("search_context", {"query": "anything"})
    assert res["isError"] is True and "conv-that-never-was" in res["content"][0]["text"]
    assert c.close() == 0


@pytest.mark.e2e
def test_mcp_server_with_the_proxy_down(mcp_client, tmp_path):
    port = free_port()  # bound and released: nothing listens there
    # the address comes from $BILI_PROXY when --proxy is not given
    c = mcp_client(env=clean_env(BILI_PROXY=f"http://127.0.0.1:{port}"), cwd=tmp_path)
    c.handshake()
    assert len(c.request("tools/list")["result"]["tools"]) == 4  # served without the proxy
    res = c.call("acp_status")
    assert res["isError"] is True
    text = res["content"][0]["text"]
    assert "not reachable" in text and f"127.0.0.1:{port}" in text
    assert c.close() == 0


@pytest.mark.e2e
def test_mcp_server_without_the_token_is_refused(proxy, mcp_client, tmp_path):
    """A client without this install's token (another user's bili mcp, or a wrong --data-dir) is
    refused with 403, and the model is told why."""
    proxy, _data = proxy
    c = mcp_client("--proxy", proxy, "--data-dir", str(tmp_path / "elsewhere"), cwd=tmp_path)
    c.handshake()
    res = c.call("search_context", {"query": "hello"})
    assert res["isError"] is True
    text = res["content"][0]["text"]
    assert "refused" in text and "admin token" in text and "--data-dir" in text
    assert c.close() == 0


def test_a_streamed_call_is_known_once_its_block_has_passed(bili):
    """An agent runs a tool once the answer's block that calls it has reached it: the proxy read that
    block on its way, so the call's conversation is known before the agent can ask (the rest of the
    answer not come yet)."""
    f = flow("/v1/messages", anthropic_body("please fold"), headers={"x_acp_session": "streamed"})
    bili.request(f)
    model_request(bili, "other", "another agent's conversation")
    f.response = tutils.tresp(headers=http.Headers(content_type="text/event-stream"), content=None)
    bili.responseheaders(f)
    events = [
        ("message_start", {"type": "message_start", "message": {"id": "msg_1", "role": "assistant", "content": [],
                                                                 "usage": {"input_tokens": 9, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_s1", "name": "mcp__bili__search_context", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "input_json_delta", "partial_json": '{"query": "bui'}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "input_json_delta", "partial_json": 'ld"}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ]
    sent = b"".join(b"".join(f.response.stream(f"event: {name}\ndata: {json.dumps(ev)}\n\n".encode()))
                    for name, ev in events[:-1])
    status, _doc = call_tool(bili, {"tool": "search_context", "args": {"query": "build"}})
    assert status == 404  # (the block has not ended: its arguments are not whole yet)
    sent += b"".join(f.response.stream(f"event: content_block_stop\ndata: {json.dumps(events[-1][1])}\n\n".encode()))
    assert b"content_block_stop" in sent
    status, doc = call_tool(bili, {"tool": "search_context", "args": {"query": "build"}})
    assert status == 200 and doc["conversationId"] == "streamed"


def test_native_tool_names_and_the_register():
    from bili_addon.kernel.native import NativeCalls, bili_tool

    assert [bili_tool(n) for n in ("mcp__bili__compress", "bili_decompress", "mcp_bili_search_context",
                                   "bili.acp_status", "compress", "mcp__other__compress", "bilicompress",
                                   "mcp__bili__my_compress_x", None)] == [
        "compress", "decompress", "search_context", "acp_status", None, None, None, None, None]
    now = [0.0]
    reg = NativeCalls(clock=lambda: now[0])
    reg.note("a", "mcp__bili__decompress", '{"id": "b1"}')
    reg.note("b", "mcp__bili__decompress", {"id": "b2"})
    reg.note("", "mcp__bili__decompress", {"id": "b3"})  # (no conversation: nothing to note)
    assert reg.take("decompress", {"id": "b2"}) == ("b", "")
    with pytest.raises(LookupError):
        reg.take("decompress", {"id": "b3"})
    now[0] = 601.0  # a call the agent never ran is forgotten
    with pytest.raises(LookupError):
        reg.take("decompress", {"id": "b1"})


def test_the_noted_calls_are_read_under_their_lock():
    """The event loop notes native calls while the store's worker asks, on every turn, whether its
    session has one waiting: a read without the lock met the deque changing under it ('deque mutated
    during iteration') and the turn went upstream unchanged."""
    import collections

    from bili_addon.kernel.native import NativeCalls

    calls = NativeCalls()
    calls.note("other", "mcp__bili__acp_status", {}, "toolu_1")
    held: list[bool] = []

    class Watched(collections.deque):
        def __iter__(self):
            free = calls._lock.acquire(blocking=False)
            if free:
                calls._lock.release()
            held.append(not free)
            return super().__iter__()

    calls._calls = Watched(calls._calls)
    assert calls.waiting("mine") is False and calls.waiting("other") is True
    assert held and all(held)
