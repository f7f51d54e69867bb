"""A scripted model provider on 127.0.0.1 for the acceptance tests (Anthropic Messages, Chat
Completions and Responses, streamed or not).

Every conversation follows one script, decided from the request itself (so retries and side
requests do not derail it): the model

1. runs the agent's shell tool four times (``alpha``, ``beta``, ``gamma``, ``delta`` listings; the
   newest messages are never folded, so there has to be some history),
2. calls ``compress`` on the range from its first step's prose to its second's, using the refs the
   proxy rendered in front of them,
3. runs the shell tool once more (``epsilon``),
4. answers with :data:`FINAL`.

Every piece of prose starts with an imitation of a ref tag, which the proxy must strip before the
agent sees it.  A request without tools (a title or summary side request) gets a short JSON text.
Every other path answers 404, which the agents tolerate.  All requests are recorded.

Responses over WebSocket (codex's default transport) is spoken too, with the chains of the real API:
each connection keeps the conversations of its responses (``store: false``), a ``response.create``
with ``previous_response_id`` continues one of them (an id this connection never answered gets
``previous_response_not_found``), and the script decides on the whole conversation so rebuilt.  A
frame's record keeps the frame as sent (``Seen.frame``); ``Seen.json`` is the conversation answered.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from websockets.sync.server import ServerConnection

from tests.e2e.fake_upstream import is_websocket_upgrade
from websockets.sync.server import serve as ws_serve

FINAL = "All five listings are done. FINAL-ANSWER-7f3a"
SIDE_TEXT = '{"title": "Scripted run"}'
ECHO = '<acp tokens="7" type="text">m00001</acp>\n'  # what a model copying the tags would write
WORDS = {1: "alpha", 2: "beta", 3: "gamma", 4: "delta", 6: "epsilon"}
COMPRESS_STAGE = 5
SUMMARY = ("Steps 1 and 2 listed the alpha and beta rows (80 each, numbered 001-080); nothing in them "
           "needs follow-up. SUMMARY-MARK-91c2")
SHELL_NAMES = ("Bash", "bash", "_bash", "exec_command", "terminal", "mcp__terminal", "shell", "mcp__bash")
TAG_RE = re.compile(r'^<acp tokens="[^"]*" type="text">(m\d{5})</acp>\n')
CALL_RE = re.compile(r"bili_s(\d)")


def command_for(stage: int) -> str:
    word = WORDS[stage]
    return f"seq -f '{word}-row-%03g the quick brown fox jumps over the lazy dog' 1 80"


def prose_for(stage: int) -> str:
    return f"Step {stage}: listing the {WORDS.get(stage, 'range')} rows." if stage != COMPRESS_STAGE else \
        f"Step {stage}: folding the first two listings."


@dataclass
class Action:
    kind: str  # "tool" or "text"
    stage: int = 0
    text: str = ""
    tool: str = ""
    args: dict = field(default_factory=dict)


@dataclass
class Seen:
    seq: int
    method: str
    path: str
    host: str
    headers: dict[str, str]
    body: bytes
    json: Any = None
    lane: str = ""
    action: Action | None = None
    status: int = 0
    transport: str = "http"  # or "ws": a response.create frame
    frame: Any = None  # ws: the frame as it came (``json`` is the conversation rebuilt from its chain)
    conversation_id: int = 0  # ws: which connection (1, 2, ...)
    conversation: Any = None  # Responses: the whole input the model saw (a previous_response_id chain expanded)


# -- reading a request -----------------------------------------------------------------------------
def lane_of(method: str, path: str) -> str:
    p = path.split("?", 1)[0].rstrip("/")
    if method != "POST":
        return ""
    if p.endswith("/messages"):
        return "anthropic"
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/responses"):
        return "responses"
    return ""


def tools_of(lane: str, body: dict) -> dict[str, dict]:
    """Tool name -> its JSON schema."""
    out = {}
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if lane == "anthropic":
            out[t.get("name", "")] = t.get("input_schema") or {}
        elif lane == "chat":
            fn = t.get("function") or {}
            out[fn.get("name", "")] = fn.get("parameters") or {}
        else:
            out[t.get("name", "")] = t.get("parameters") or {}
    out.pop("", None)
    return out


def results_of(lane: str, body: dict) -> dict[str, str]:
    """Tool results in the request: call id -> text."""
    out: dict[str, str] = {}
    if lane == "anthropic":
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            for b in content if isinstance(content, list) else []:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    c = b.get("content")
                    if isinstance(c, list):
                        c = "\n".join(x.get("text", "") for x in c if isinstance(x, dict))
                    out[str(b.get("tool_use_id"))] = c if isinstance(c, str) else json.dumps(c)
    elif lane == "chat":
        for m in body.get("messages") or []:
            if isinstance(m, dict) and m.get("role") == "tool":
                c = m.get("content")
                if isinstance(c, list):
                    c = "\n".join(x.get("text", "") for x in c if isinstance(x, dict))
                out[str(m.get("tool_call_id"))] = c if isinstance(c, str) else json.dumps(c)
    else:
        items = body.get("input")
        for it in items if isinstance(items, list) else []:
            if isinstance(it, dict) and it.get("type") == "function_call_output":
                c = it.get("output")
                out[str(it.get("call_id"))] = c if isinstance(c, str) else json.dumps(c)
    return out


def tagged(obj: Any) -> dict[str, str]:
    """text after the tag -> ref, for every tagged string in the body."""
    out: dict[str, str] = {}
    for v in strings(obj):
        m = TAG_RE.match(v)
        if m:
            out.setdefault(v[m.end():], m.group(1))
    return out


def strings(v: Any):
    """Every string in a decoded JSON value, depth first."""
    if isinstance(v, dict):
        for x in v.values():
            yield from strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from strings(x)
    elif isinstance(v, str):
        yield v


def stage_of(lane: str, body: dict) -> int:
    done = [int(m.group(1)) for cid in results_of(lane, body) if (m := CALL_RE.search(cid))]
    return max(done, default=0)


def shell_args(schema: dict, command: str) -> dict:
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    key = "command" if "command" in props else "cmd" if "cmd" in props else next(iter(props), "command")
    if (props.get(key) or {}).get("type") == "array":
        args[key] = ["bash", "-lc", command]
    else:
        args[key] = command
    for name in schema.get("required") or []:
        if name not in args:
            args[name] = "list the rows" if (props.get(name) or {}).get("type", "string") == "string" else None
    return {k: v for k, v in args.items() if v is not None}


REMINDER_RANGE = re.compile(r"^  (m\d{5})–(m\d{5})  \d+ messages  ~", re.M)


def offered(body: Any) -> tuple[str, str] | None:
    """The first range bili's newest fold reminder offers, if the model was shown one."""
    notes = [v[v.index("[bili] ~"):] for v in strings(body) if "[bili] ~" in v]
    found = REMINDER_RANGE.findall(notes[-1]) if notes else []
    return found[0] if found else None


def decide(lane: str, body: dict, chained: bool = False) -> Action:
    """``chained``: the conversation came as a server-side chain, where the model's own earlier prose
    carries no ref tag (bili cannot tag what the provider holds): it folds what bili's reminder offers."""
    tools = tools_of(lane, body)
    shell = next((n for n in SHELL_NAMES if n in tools), None)
    if shell is None:
        return Action("text", text=SIDE_TEXT)
    stage = stage_of(lane, body) + 1
    if stage == COMPRESS_STAGE:
        refs = tagged(body)
        start = next((r for t, r in refs.items() if t.startswith(prose_for(1))), "m00001")
        end = next((r for t, r in refs.items() if t.startswith(prose_for(2))), "m00002")
        if chained and offered(body):
            start, end = offered(body)
        # the agent's own copy when bili's tools come through MCP (mcp__bili__compress, bili_compress)
        name = next((n for n in tools if "bili" in n and n.endswith("compress")), "compress")
        return Action("tool", stage, prose_for(stage), name,
                      {"content": [{"startId": start, "endId": end, "topic": "first listings", "summary": SUMMARY}]})
    if stage in WORDS:
        return Action("tool", stage, prose_for(stage), shell, shell_args(tools[shell], command_for(stage)))
    return Action("text", stage, FINAL)


# -- writing an answer ------------------------------------------------------------------------------
def _sse(events: list[tuple[str | None, dict]]) -> bytes:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {json.dumps(data)}\n\n")
    return "".join(out).encode()


def _pieces(text: str, n: int = 9) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)] or [""]


def call_id(lane: str, stage: int) -> str:
    return f"toolu_bili_s{stage}" if lane == "anthropic" else f"call_bili_s{stage}"


def anthropic_answer(seq: int, model: str, a: Action, stream: bool, prompt: int = 100) -> tuple[str, bytes]:
    text = ECHO + a.text
    content: list[dict] = [{"type": "text", "text": text}]
    if a.kind == "tool":
        content.append({"type": "tool_use", "id": call_id("anthropic", a.stage), "name": a.tool, "input": a.args})
    stop = "tool_use" if a.kind == "tool" else "end_turn"
    usage = {"input_tokens": prompt, "output_tokens": 20, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    msg = {"id": f"msg_scripted{seq:05d}", "type": "message", "role": "assistant", "model": model,
           "content": content, "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not stream:
        return "application/json", json.dumps(msg).encode()
    start = dict(msg, content=[], stop_reason=None, usage=dict(usage, output_tokens=1))
    ev: list[tuple[str | None, dict]] = [("message_start", {"type": "message_start", "message": start})]
    ev.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}))
    for p in _pieces(text):
        ev.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": p}}))
    ev.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    if a.kind == "tool":
        ev.append(("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": call_id("anthropic", a.stage), "name": a.tool, "input": {}}}))
        for p in _pieces(json.dumps(a.args), 40):
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": 1,
                                               "delta": {"type": "input_json_delta", "partial_json": p}}))
        ev.append(("content_block_stop", {"type": "content_block_stop", "index": 1}))
    ev.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                 "usage": {"output_tokens": 20}}))
    ev.append(("message_stop", {"type": "message_stop"}))
    return "text/event-stream", _sse(ev)


def chat_answer(seq: int, model: str, a: Action, stream: bool, prompt: int = 100) -> tuple[str, bytes]:
    text = ECHO + a.text
    finish = "tool_calls" if a.kind == "tool" else "stop"
    call = {"id": call_id("chat", a.stage), "type": "function",
            "function": {"name": a.tool, "arguments": json.dumps(a.args)}}
    usage = {"prompt_tokens": prompt, "completion_tokens": 20, "total_tokens": prompt + 20}
    base = {"id": f"chatcmpl-scripted{seq:05d}", "created": 1_700_000_000 + seq, "model": model}
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if a.kind == "tool":
            message["tool_calls"] = [call]
        return "application/json", json.dumps(dict(base, object="chat.completion", usage=usage, choices=[
            {"index": 0, "message": message, "finish_reason": finish}])).encode()

    def chunk(delta: dict, fin: str | None = None) -> tuple[None, dict]:
        return None, dict(base, object="chat.completion.chunk",
                          choices=[{"index": 0, "delta": delta, "finish_reason": fin}])

    ev = [chunk({"role": "assistant", "content": ""})]
    ev += [chunk({"content": p}) for p in _pieces(text)]
    if a.kind == "tool":
        ev.append(chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                         "function": {"name": a.tool, "arguments": ""}}]}))
        ev += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in _pieces(json.dumps(a.args), 40)]
    ev.append(chunk({}, finish))
    ev.append((None, dict(base, object="chat.completion.chunk", choices=[], usage=usage)))
    return "text/event-stream", _sse(ev) + b"data: [DONE]\n\n"


def responses_output(seq: int, a: Action) -> list[dict]:
    message = {"type": "message", "id": f"msg_scripted{seq:05d}", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": ECHO + a.text, "annotations": []}]}
    output = [message]
    if a.kind == "tool":
        output.append({"type": "function_call", "id": f"fc_scripted{seq:05d}", "call_id": call_id("responses", a.stage),
                       "name": a.tool, "arguments": json.dumps(a.args), "status": "completed"})
    return output


def responses_answer(seq: int, model: str, a: Action, stream: bool, prompt: int = 100) -> tuple[str, bytes]:
    text = ECHO + a.text
    msg_id, fc_id = f"msg_scripted{seq:05d}", f"fc_scripted{seq:05d}"
    output = responses_output(seq, a)
    message = output[0]
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 20,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + 20}

    def resp(done: bool) -> dict:
        return {"id": f"resp_scripted{seq:05d}", "object": "response", "created_at": 1_700_000_000 + seq,
                "status": "completed" if done else "in_progress", "model": model,
                "output": output if done else [], "usage": usage if done else None, "error": None,
                "incomplete_details": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}

    if not stream:
        return "application/json", json.dumps(resp(True)).encode()
    ev: list[dict] = [{"type": "response.created", "response": resp(False)},
                      {"type": "response.in_progress", "response": resp(False)},
                      {"type": "response.output_item.added", "output_index": 0,
                       "item": dict(message, status="in_progress", content=[])},
                      {"type": "response.content_part.added", "item_id": msg_id, "output_index": 0, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}]
    ev += [{"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0, "content_index": 0,
            "delta": p} for p in _pieces(text)]
    ev += [{"type": "response.output_text.done", "item_id": msg_id, "output_index": 0, "content_index": 0, "text": text},
           {"type": "response.content_part.done", "item_id": msg_id, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": text, "annotations": []}},
           {"type": "response.output_item.done", "output_index": 0, "item": message}]
    if a.kind == "tool":
        fc = output[1]
        ev.append({"type": "response.output_item.added", "output_index": 1, "item": dict(fc, arguments="", status="in_progress")})
        ev += [{"type": "response.function_call_arguments.delta", "item_id": fc_id, "output_index": 1, "delta": p}
               for p in _pieces(fc["arguments"], 40)]
        ev.append({"type": "response.function_call_arguments.done", "item_id": fc_id, "output_index": 1,
                   "arguments": fc["arguments"]})
        ev.append({"type": "response.output_item.done", "output_index": 1, "item": fc})
    ev.append({"type": "response.completed", "response": resp(True)})
    for n, e in enumerate(ev):
        e["sequence_number"] = n
    return "text/event-stream", _sse([(e["type"], e) for e in ev])


ANSWERS = {"anthropic": anthropic_answer, "chat": chat_answer, "responses": responses_answer}


# -- the server --------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        model = self.server.model
        raw = self._body()
        enc = self.headers.get("content-encoding", "")
        if raw and enc and enc.lower() != "identity":
            from mitmproxy.net import encoding

            raw = encoding.decode(raw, enc)
        rec = model.record(self.command, self.path, self.headers.get("host", ""), dict(self.headers.items()), raw)
        status, ctype, body = model.answer(rec)
        rec.status = status
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    model: "ScriptedModel"

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        # a WebSocket upgrade goes to the websockets handler, everything else is HTTP
        if is_websocket_upgrade(request):
            try:
                self.model.ws_server.handler(request, client_address)
            finally:
                self.shutdown_request(request)
            return
        super().process_request_thread(request, client_address)


def sse_events(body: bytes) -> list[dict]:
    """The JSON events of an SSE body (as written by ``_sse``)."""
    out = []
    for block in body.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


def _ws_error(message: str, code: str | None = None) -> dict:
    err: dict[str, Any] = {"type": "invalid_request_error", "message": message}
    if code:
        err.update(code=code, param="previous_response_id")
    return {"type": "error", "status": 400, "error": err}


class ScriptedModel:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None
        self.chains: dict[str, list] = {}  # response id -> the conversation as of it (store: true)

    def start(self) -> "ScriptedModel":
        self.ws_connections = 0
        self.ws_server = ws_serve(self._ws_session, "127.0.0.1", 0, compression=None)  # its own port stays idle
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.model = self
        self.thread = threading.Thread(target=self.server.serve_forever, name="scripted-model", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
            self.ws_server.socket.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.server_address[1]

    def record(self, method: str, path: str, host: str, headers: dict[str, str], body: bytes) -> Seen:
        with self.lock:
            rec = Seen(len(self.seen) + 1, method, path, host, headers, body)
            self.seen.append(rec)
        return rec

    def answer(self, rec: Seen) -> tuple[int, str, bytes]:
        rec.lane = lane_of(rec.method, rec.path)
        if rec.headers.get("Upgrade", rec.headers.get("upgrade", "")).lower() == "websocket":
            return 404, "application/json", b'{"error": "no WebSocket here"}'
        if not rec.lane:
            if rec.path.split("?")[0].rstrip("/").endswith("/models") and rec.method == "GET":
                return 200, "application/json", b'{"object": "list", "data": [], "has_more": false}'
            return 404, "application/json", json.dumps({"error": {"type": "not_found", "message": "scripted model: "
                                                                  f"no {rec.method} {rec.path}"}}).encode()
        try:
            rec.json = json.loads(rec.body)
        except ValueError:
            return 400, "application/json", b'{"error": {"type": "invalid_request_error", "message": "not JSON"}}'
        body = rec.json
        if rec.lane == "responses" and isinstance(body, dict):  # server-side chains, as OpenAI keeps them
            prev = body.get("previous_response_id")
            with self.lock:
                held = self.chains.get(prev) if prev else []
            if held is None:
                return 400, "application/json", json.dumps({"error": {
                    "type": "invalid_request_error", "param": "previous_response_id",
                    "code": "previous_response_not_found",
                    "message": f"Previous response with id '{prev}' not found."}}).encode()
            inp = body.get("input")
            inp = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
            body = {k: v for k, v in body.items() if k != "previous_response_id"}
            body["input"] = rec.conversation = held + inp
        action = rec.action = decide(rec.lane, body, chained=bool(rec.json.get("previous_response_id")))
        if rec.lane == "responses" and isinstance(body, dict) and body.get("store", True) is not False:
            with self.lock:
                self.chains[f"resp_scripted{rec.seq:05d}"] = body["input"] + responses_output(rec.seq, action)
        model = rec.json.get("model") or "scripted"
        # the usage reports the prompt's size (~ bytes / 4), as the real APIs do
        prompt = len(json.dumps(body)) if rec.conversation is not None else len(rec.body)  # a chain: all of it
        ctype, body = ANSWERS[rec.lane](rec.seq, model, action, bool(rec.json.get("stream")), prompt // 4)
        return 200, ctype, body

    # -- Responses over WebSocket ------------------------------------------------------------------
    def _ws_session(self, conn: ServerConnection) -> None:
        req = conn.request
        path = req.path if req is not None else "/v1/responses"
        # the handshake's headers but its own (a frame is recorded like a POST of its conversation)
        headers = {k: v for k, v in (req.headers.raw_items() if req is not None else [])
                   if k.lower() not in ("upgrade", "connection") and not k.lower().startswith("sec-websocket")}
        with self.lock:
            self.ws_connections += 1
            number = self.ws_connections
        chains: dict[str, list] = {}  # this connection's responses: id -> the conversation incl. the output
        for frame in conn:
            raw = frame.encode() if isinstance(frame, str) else bytes(frame)
            for event in self.ws_answer(number, path, headers, raw, chains):
                conn.send(json.dumps(event))

    def ws_answer(self, number: int, path: str, headers: dict[str, str], raw: bytes,
                  chains: dict[str, list]) -> list[dict]:
        """The events answering one client frame; a ``response.create`` is recorded as a POST of the
        whole conversation it continues (so the script and the assertions read it like HTTP)."""
        try:
            frame = json.loads(raw)
        except ValueError:
            frame = None
        if not isinstance(frame, dict) or frame.get("type") != "response.create":
            return [_ws_error("unsupported frame")]
        prev = frame.get("previous_response_id")
        if prev is not None and prev not in chains:
            rec = self.record("WS", path, headers.get("host", headers.get("Host", "")), headers, raw)
            rec.transport, rec.frame, rec.conversation_id, rec.status = "ws", frame, number, 400
            return [_ws_error(f"Previous response with id '{prev}' not found.", "previous_response_not_found")]
        items = frame.get("input")
        items = items if isinstance(items, list) else [{"role": "user", "content": items}] if items else []
        body = {k: v for k, v in frame.items() if k not in ("type", "previous_response_id", "generate")}
        body["input"] = (chains[prev] if prev else []) + items
        host = headers.get("host", headers.get("Host", ""))
        rec = self.record("POST", path, host, headers, json.dumps(body).encode())
        rec.transport, rec.frame, rec.conversation_id = "ws", frame, number
        if frame.get("generate") is False:  # codex's warm-up: a response with no output
            rec.lane, rec.json, rec.status = "responses", body, 200
            done = {"id": f"resp_scripted{rec.seq:05d}", "object": "response", "status": "completed",
                    "model": body.get("model"), "output": [], "usage": {
                        "input_tokens": len(rec.body) // 4, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": len(rec.body) // 4}}
            chains[done["id"]] = body["input"]
            return [{"type": "response.created", "response": dict(done, status="in_progress", usage=None)},
                    {"type": "response.completed", "response": done}]
        body["stream"] = True
        rec.body = json.dumps(body).encode()
        status, _ctype, out = self.answer(rec)
        rec.status = status
        if status != 200:
            return [_ws_error(out.decode(errors="replace"))]
        events = sse_events(out)
        done = events[-1]["response"]
        chains[done["id"]] = body["input"] + done["output"]
        return events

    # -- for the assertions ----------------------------------------------------------------------
    def model_requests(self) -> list[Seen]:
        return [r for r in self.seen if r.lane and r.action is not None and r.action.stage]

    def by_stage(self, stage: int) -> list[Seen]:
        """The requests answered at ``stage`` (the request that *carries* the results of stage - 1)."""
        return [r for r in self.model_requests() if r.action.stage == stage]
