"""A fake model provider for the end-to-end tests, listening on 127.0.0.1 only.

One ``ThreadingHTTPServer`` serves the provider HTTP APIs (Anthropic Messages, OpenAI Chat
Completions and Responses, Gemini ``generateContent``); a WebSocket upgrade arriving on the same
port is handed to a ``websockets`` sync server (Responses over WebSocket), which also listens on
its own second port.  Every request and every WebSocket frame from a client is recorded with its
raw bytes, its decoded bytes and its headers, so a test can assert on exactly what the proxy sent.

It is picky the way the real APIs are: bodies must be JSON, conversation roles must alternate,
tool results must answer a tool call the model made.  A violation is answered with a 400 error in
the provider's own error shape, which the official SDKs raise as ``BadRequestError``.

The model always says :data:`REPLY_TEXT` unless the request (or the WebSocket handshake) carries
``x-fake-reply`` (percent-encoded text, streamed in 7-character pieces) and/or ``x-fake-tool``
(percent-encoded ``name:{json arguments}``, one tool call after the prose).  JSON answers are
gzip-compressed when the client accepts gzip, as the real APIs do.

Scripted mode: a test registers a :class:`Script` (``fake.script(key, [say(...), tool(...),
proxy_call(...)])``) and sends ``x-fake-script: <key>`` (plus ``x-fake-turn: N`` to pick the act);
the act's arguments may be computed from the request body as received, so a scripted model can
pick refs from the tags it is shown.  Scripted requests are validated exactly as the real APIs
validate them (``api_exact``: merged consecutive turns, complete call/result pairing).

Paced streams: ``fake.gate(key)`` and ``x-fake-gate: <key>`` make the fake write each SSE event
only when the test releases it, so a test can see where a streamed event is held.

Encoded streams: ``x-fake-stream-encoding`` sends an SSE answer compressed the ways servers in the
wild do: ``gzip-members`` (one gzip member per event), ``zstd-frames`` (one zstd frame per event),
``gzip-label`` (labelled gzip, sent plain).
"""

from __future__ import annotations

import gzip
import io
import json
import socket
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

import brotli
import zstandard
from websockets.sync.server import ServerConnection
from websockets.sync.server import serve as ws_serve

REPLY_TEXT = "Hello from the fake upstream."
REPLY_CHUNKS = ("Hello", " from the", " fake upstream.")


# -- what was received ---------------------------------------------------------------------------


@dataclass
class Recorded:
    seq: int
    transport: str  # "http" or "ws"
    method: str  # "WS" for a WebSocket frame
    path: str  # with the query string
    headers: list[tuple[str, str]]
    raw: bytes  # the body as it arrived (still content-encoded)
    body: bytes  # the body after content-encoding was undone
    content_encoding: str
    json: Any = None  # the parsed body, None when it is not JSON
    status: int = 0
    response: bytes = b""  # the entity body as sent (or the WS frames, newline-joined)
    response_encoding: str = ""  # its content-encoding, when the fake compressed it
    error: str = ""  # why the request was refused, if it was
    # Responses: the whole conversation the model saw (a previous_response_id chain expanded), and
    # the id of the response it answered with
    conversation: Any = None
    response_id: str = ""

    def header(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return default

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]


class BadRequest(Exception):
    pass


# -- content-encoding ------------------------------------------------------------------------------


def _zstd_decode(data: bytes) -> bytes:
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
        return reader.read()


def decode_body(raw: bytes, encoding: str) -> bytes:
    """Undo a request's content-encoding (the header may list several, applied in order)."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    data = raw
    for coding in reversed(codings):
        if coding == "identity":
            continue
        try:
            if coding in ("gzip", "x-gzip"):
                data = gzip.decompress(data)
            elif coding == "deflate":
                data = zlib.decompress(data)
            elif coding == "br":
                data = brotli.decompress(data)
            elif coding == "zstd":
                data = _zstd_decode(data)
            else:
                raise BadRequest(f"unsupported content-encoding {coding!r}")
        except BadRequest:
            raise
        except Exception as e:  # corrupt stream
            raise BadRequest(f"cannot decode {coding} body: {e}") from None
    return data


# -- request validation (what the real APIs would refuse) -----------------------------------------


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise BadRequest(msg)


def check_anthropic(body: Any, *, api_exact: bool = False) -> None:
    """The Messages API's rules.  By default consecutive turns of one role are refused outright
    (the old API's rule, and the safe one for Anthropic-compatible backends); with ``api_exact``
    they are merged into one turn first, as the current API does, and pairing is then checked on
    the merged turns, including that a turn answering tool calls starts with its tool results."""
    _need(isinstance(body, dict), "body must be a JSON object")
    _need(isinstance(body.get("model"), str) and body["model"], "model: field required")
    _need(isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0, "max_tokens: field required")
    system = body.get("system")
    if system is not None:
        _need(
            isinstance(system, str)
            or isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system),
            "system: must be a string or a list of text blocks",
        )
    msgs = body.get("messages")
    _need(isinstance(msgs, list) and msgs, "messages: at least one message is required")
    # each message on its own: role, content, block shapes
    turns: list[tuple[int, str, list[tuple[str, dict]]]] = []  # (first message index, role, [(where, block)])
    for i, m in enumerate(msgs):
        _need(isinstance(m, dict), f"messages.{i}: must be an object")
        role = m.get("role")
        _need(role in ("user", "assistant", "system"), f"messages.{i}.role: unexpected role {role!r}")
        content = m.get("content")
        _need(isinstance(content, (str, list)), f"messages.{i}.content: must be a string or a list")
        if role == "system":
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        located = []
        for j, b in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            _need(isinstance(b, dict) and isinstance(b.get("type"), str), f"{where}: block must have a type")
            kind = b["type"]
            if kind == "text":
                _need(isinstance(b.get("text"), str), f"{where}.text: must be a string")
                if isinstance(content, list):
                    _need(b["text"] != "", f"{where}: text content blocks must be non-empty")
            elif kind == "tool_use":
                _need(role == "assistant", f"{where}: tool_use blocks belong to assistant messages")
                _need(isinstance(b.get("id"), str) and b["id"], f"{where}.id: field required")
                _need(isinstance(b.get("name"), str) and b["name"], f"{where}.name: field required")
                _need(isinstance(b.get("input"), dict), f"{where}.input: must be an object")
            elif kind == "tool_result":
                _need(role == "user", f"{where}: tool_result blocks belong to user messages")
            located.append((where, b))
        if not turns:
            _need(role == "user", "messages.0: the first message must use the user role")
        elif turns[-1][1] == role:
            _need(api_exact, f"messages.{i}: roles must alternate between user and assistant")
            turns[-1][2].extend(located)
            continue
        turns.append((i, role, located))
    # pairing, turn by turn
    open_tool_uses: set[str] = set()
    for i, role, located in turns:
        answered: set[str] = set()
        seen_other = False
        for where, b in located:
            if b["type"] == "tool_result":
                tid = b.get("tool_use_id")
                _need(
                    tid in open_tool_uses,
                    f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {tid}. Each `tool_result` "
                    "block must have a corresponding `tool_use` block in the previous message.",
                )
                if api_exact:
                    _need(not seen_other, f"{where}: `tool_result` blocks must come first in the content, before "
                                          "any other block of the message answering the tool calls")
                answered.add(tid)
            else:
                seen_other = True
        if open_tool_uses:
            missing = open_tool_uses - answered
            _need(
                not missing,
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{', '.join(sorted(missing))}",
            )
        open_tool_uses = {b["id"] for _w, b in located if b["type"] == "tool_use"} if role == "assistant" else set()


def check_chat(body: Any, *, api_exact: bool = False) -> None:
    _need(isinstance(body, dict), "body must be a JSON object")
    _need(isinstance(body.get("model"), str) and body["model"], "you must provide a model parameter")
    msgs = body.get("messages")
    _need(isinstance(msgs, list) and msgs, "messages: must be a non-empty array")
    open_calls: set[str] = set()
    for i, m in enumerate(msgs):
        _need(isinstance(m, dict), f"messages[{i}]: must be an object")
        role = m.get("role")
        _need(role in ("system", "developer", "user", "assistant", "tool"), f"messages[{i}].role: invalid {role!r}")
        if role == "tool":
            tid = m.get("tool_call_id")
            _need(
                tid in open_calls,
                f"messages[{i}]: messages with role 'tool' must be a response to a preceeding message with "
                f"'tool_calls' (unknown tool_call_id {tid!r})",
            )
            open_calls.discard(tid)
            _need(isinstance(m.get("content"), (str, list)), f"messages[{i}].content: required")
            continue
        _need(not open_calls, _chat_unanswered(open_calls))
        content = m.get("content")
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            _need(isinstance(calls, list), f"messages[{i}].tool_calls: must be an array")
            for k, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{k}]"
                _need(isinstance(c, dict) and isinstance(c.get("id"), str), f"{where}.id: required")
                _need(c.get("type") == "function", f"{where}.type: must be 'function'")
                fn = c.get("function")
                _need(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{where}.function.name: required")
                _need(isinstance(fn.get("arguments"), str), f"{where}.function.arguments: must be a string")
                open_calls.add(c["id"])
            _need(content is None or isinstance(content, (str, list)), f"messages[{i}].content: invalid")
        else:
            _need(isinstance(content, (str, list)), f"messages[{i}].content: required")
        if isinstance(content, list):
            for k, p in enumerate(content):
                _need(isinstance(p, dict) and isinstance(p.get("type"), str), f"messages[{i}].content[{k}]: type required")
                if p["type"] == "text":
                    _need(isinstance(p.get("text"), str), f"messages[{i}].content[{k}].text: required")
    if api_exact:
        _need(not open_calls, _chat_unanswered(open_calls))
    if str(body.get("model")).startswith("deepseek-reasoner"):
        # DeepSeek's reasoner refuses two user (or two assistant) messages in a row
        turns = [(i, m.get("role")) for i, m in enumerate(msgs) if m.get("role") in ("user", "assistant", "tool")]
        for (i, a), (j, b) in zip(turns, turns[1:]):
            _need(
                not (a == b and a in ("user", "assistant")),
                f"deepseek-reasoner does not support successive user or assistant messages (messages[{i}] and "
                f"messages[{j}] in your input). You should interleave the user/assistant messages in the message "
                "sequence.",
            )


def _chat_unanswered(open_calls: set[str]) -> str:
    return (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(sorted(open_calls))}"
    )


def check_responses(body: Any, *, api_exact: bool = False) -> None:
    _need(isinstance(body, dict), "body must be a JSON object")
    _need(isinstance(body.get("model"), str) and body["model"], "model: required")
    inp = body.get("input")
    if isinstance(inp, str):
        return
    _need(isinstance(inp, list), "input: must be a string or an array")
    calls: set[str] = set()
    outputs: set[str] = set()
    for i, item in enumerate(inp):
        _need(isinstance(item, dict), f"input[{i}]: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            _need(item.get("role") in ("user", "assistant", "system", "developer"), f"input[{i}].role: invalid")
            content = item.get("content")
            _need(isinstance(content, (str, list)), f"input[{i}].content: required")
            if isinstance(content, list):
                for k, p in enumerate(content):
                    _need(isinstance(p, dict) and isinstance(p.get("type"), str), f"input[{i}].content[{k}]: type")
                    if p["type"] in ("input_text", "output_text"):
                        _need(isinstance(p.get("text"), str), f"input[{i}].content[{k}].text: required")
        elif kind == "function_call":
            _need(isinstance(item.get("call_id"), str), f"input[{i}].call_id: required")
            _need(isinstance(item.get("name"), str), f"input[{i}].name: required")
            _need(isinstance(item.get("arguments"), str), f"input[{i}].arguments: must be a string")
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            cid = item.get("call_id")
            _need(
                cid in calls or bool(body.get("previous_response_id")),
                f"No tool call found for function call output with call_id {cid}.",
            )
            outputs.add(cid)
    if api_exact and not body.get("previous_response_id"):
        missing = sorted(calls - outputs)
        _need(not missing, f"No tool output found for function call {', '.join(missing)}.")


def check_gemini(body: Any, *, api_exact: bool = False) -> None:
    """``api_exact`` adds the turn rules of the real API: a function response turn comes right
    after the function call turn it answers, with one response per call and nothing else; a
    function call turn comes right after a user turn or a function response turn."""
    _need(isinstance(body, dict), "body must be a JSON object")
    contents = body.get("contents")
    _need(isinstance(contents, list) and contents, "contents is not specified")
    called: set[str] = set()
    prev: tuple[str, list[str]] | None = None  # (role, function call names) of the previous content
    for i, c in enumerate(contents):
        _need(isinstance(c, dict), f"contents[{i}]: must be an object")
        role = c.get("role", "user")
        _need(role in ("user", "model"), f"contents[{i}].role: Please use a valid role: user, model.")
        parts = c.get("parts")
        _need(isinstance(parts, list) and parts, f"contents[{i}].parts: must not be empty")
        calls: list[str] = []
        responses: list[str] = []
        for k, p in enumerate(parts):
            _need(isinstance(p, dict) and p, f"contents[{i}].parts[{k}]: must be a non-empty object")
            if "text" in p:
                _need(isinstance(p["text"], str), f"contents[{i}].parts[{k}].text: must be a string")
            if "functionCall" in p:
                called.add(str(p["functionCall"].get("name")))
                calls.append(str(p["functionCall"].get("name")))
            if "functionResponse" in p:
                name = str(p["functionResponse"].get("name"))
                _need(name in called, f"contents[{i}].parts[{k}]: functionResponse {name!r} without a functionCall")
                responses.append(name)
        if api_exact and responses:
            # the API splits turns on the function response content: prose beside the responses
            # breaks that and is refused (measured on gemini-3.x; the error text misleads)
            _need(
                all("functionResponse" in p for p in parts),
                f"contents[{i}]: Requests ending with a model turn are not supported.",
            )
            _need(
                prev is not None and prev[0] == "model" and bool(prev[1]),
                f"contents[{i}]: Please ensure that function response turn comes immediately after a function "
                "call turn.",
            )
            assert prev is not None
            _need(
                sorted(responses) == sorted(prev[1]),
                f"contents[{i}]: Please ensure that the number of function response parts is equal to the number of "
                "function call parts of the function call turn.",
            )
        if api_exact and calls:
            _need(
                prev is not None and prev[0] == "user",
                f"contents[{i}]: Please ensure that function call turn comes immediately after a user turn or after "
                "a function response turn.",
            )
        prev = (role, calls)


# -- provider-shaped answers ----------------------------------------------------------------------


def _j(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass(frozen=True)
class Reply:
    """What the fake model says: prose (streamed in ``chunks``) and optionally one tool call whose
    JSON arguments are streamed in ``tool_chunks``."""

    text: str = REPLY_TEXT
    chunks: tuple[str, ...] = REPLY_CHUNKS
    tool_name: str = ""
    tool_args: str = ""  # JSON text of the arguments
    call_id: str = ""  # the tool call's id; by default derived from the request's sequence number
    input_tokens: int = 12  # the prompt size the answer reports (a scripted model can report the real one)
    # (read, write) of a script with a prompt cache (Anthropic usage); (read, write, written for 1 hour):
    # the usage splits the writes by lifetime as Anthropic does (``cache_creation``)
    cache: tuple[int, ...] | None = None

    @property
    def has_text(self) -> bool:
        """A tool call may come without prose; then the answer has no text part at all."""
        return bool(self.text) or not self.tool_name

    def tool_id(self, prefix: str, seq: int) -> str:
        return self.call_id or f"{prefix}{seq:06d}"

    @property
    def tool_chunks(self) -> list[str]:
        return [self.tool_args[i : i + 9] for i in range(0, len(self.tool_args), 9)] or [""]

    @classmethod
    def from_headers(cls, headers: Any) -> "Reply":
        """``x-fake-reply`` (percent-encoded text) and ``x-fake-tool`` (percent-encoded
        ``name:{json args}``) let a test choose what the model answers."""
        text, chunks = REPLY_TEXT, REPLY_CHUNKS
        if headers.get("x-fake-reply") is not None:
            text = urllib.parse.unquote(headers["x-fake-reply"])
            chunks = tuple(text[i : i + 7] for i in range(0, len(text), 7)) or ("",)
        name = args = ""
        if headers.get("x-fake-tool"):
            name, _, args = urllib.parse.unquote(headers["x-fake-tool"]).partition(":")
        return cls(text, chunks, name, args)


DEFAULT_REPLY = Reply()


def anthropic_usage(reply: Reply, output: int) -> dict:
    if reply.cache is None:  # (the real API names its cache figures, 0 when it read and wrote none)
        return {"input_tokens": reply.input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                "output_tokens": output}
    read, write = reply.cache[:2]
    usage = {"input_tokens": max(0, reply.input_tokens - read - write), "cache_read_input_tokens": read,
             "cache_creation_input_tokens": write, "output_tokens": output}
    if len(reply.cache) > 2:
        usage["cache_creation"] = {"ephemeral_5m_input_tokens": write - reply.cache[2],
                                   "ephemeral_1h_input_tokens": reply.cache[2]}
    return usage


def anthropic_message(seq: int, model: str, reply: Reply = DEFAULT_REPLY, *, streaming_start: bool = False) -> dict:
    content: list[dict] = [{"type": "text", "text": reply.text}] if reply.has_text else []
    if reply.tool_name:
        content.append({
            "type": "tool_use", "id": reply.tool_id("toolu_fake", seq), "name": reply.tool_name,
            "input": json.loads(reply.tool_args),
        })
    return {
        "id": f"msg_fake{seq:06d}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if streaming_start else content,
        "stop_reason": None if streaming_start else ("tool_use" if reply.tool_name else "end_turn"),
        "stop_sequence": None,
        "usage": anthropic_usage(reply, 1 if streaming_start else 7),
    }


def anthropic_sse(seq: int, model: str, reply: Reply = DEFAULT_REPLY) -> list[bytes]:
    events: list[tuple[str, dict]] = [
        ("message_start", {"type": "message_start", "message": anthropic_message(seq, model, reply, streaming_start=True)}),
    ]
    tool_index = 0
    if reply.has_text:
        events += [
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"}),
        ]
        for chunk in reply.chunks:
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": chunk}})
            )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        tool_index = 1
    if reply.tool_name:
        events.append((
            "content_block_start",
            {"type": "content_block_start", "index": tool_index, "content_block": {
                "type": "tool_use", "id": reply.tool_id("toolu_fake", seq), "name": reply.tool_name, "input": {}}},
        ))
        for part in reply.tool_chunks:
            events.append((
                "content_block_delta",
                {"type": "content_block_delta", "index": tool_index,
                 "delta": {"type": "input_json_delta", "partial_json": part}},
            ))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": tool_index}))
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use" if reply.tool_name else "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 7},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return [f"event: {name}\ndata: {_j(data)}\n\n".encode() for name, data in events]


def _chat_tool_call(seq: int, reply: Reply, arguments: str) -> dict:
    return {"id": reply.tool_id("call_fake", seq), "type": "function",
            "function": {"name": reply.tool_name, "arguments": arguments}}


def chat_completion(seq: int, model: str, reply: Reply = DEFAULT_REPLY) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.has_text else None, "refusal": None}
    if reply.tool_name:
        message["tool_calls"] = [_chat_tool_call(seq, reply, reply.tool_args)]
    return {
        "id": f"chatcmpl-fake{seq:06d}",
        "object": "chat.completion",
        "created": 1_700_000_000 + seq,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if reply.tool_name else "stop",
            }
        ],
        "usage": {"prompt_tokens": reply.input_tokens, "completion_tokens": 7,
                  "total_tokens": reply.input_tokens + 7, "prompt_tokens_details": {"cached_tokens": 0}},
        "system_fingerprint": "fp_fake",
    }


def chat_sse(seq: int, model: str, reply: Reply = DEFAULT_REPLY) -> list[bytes]:
    def chunk(delta: dict, finish: str | None) -> dict:
        return {
            "id": f"chatcmpl-fake{seq:06d}",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000 + seq,
            "model": model,
            "system_fingerprint": "fp_fake",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    chunks = [chunk({"role": "assistant", "content": "" if reply.has_text else None}, None)]
    if reply.has_text:
        chunks += [chunk({"content": c}, None) for c in reply.chunks]
    if reply.tool_name:
        for i, part in enumerate(reply.tool_chunks):
            call = _chat_tool_call(seq, reply, part) if i == 0 else {"function": {"arguments": part}}
            chunks.append(chunk({"tool_calls": [{"index": 0, **call}]}, None))
    chunks.append(chunk({}, "tool_calls" if reply.tool_name else "stop"))
    return [f"data: {_j(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


def responses_output(seq: int, reply: Reply) -> list[dict]:
    out: list[dict] = []
    if reply.has_text:
        out.append({
            "type": "message",
            "id": f"msg_fake{seq:06d}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": reply.text, "annotations": [], "logprobs": []}],
        })
    if reply.tool_name:
        out.append({
            "type": "function_call",
            "id": f"fc_fake{seq:06d}",
            "call_id": reply.tool_id("call_fake", seq),
            "name": reply.tool_name,
            "arguments": reply.tool_args,
            "status": "completed",
        })
    return out


def responses_object(seq: int, model: str, reply: Reply = DEFAULT_REPLY, *, done: bool = True) -> dict:
    return {
        "id": f"resp_fake{seq:06d}",
        "object": "response",
        "created_at": 1_700_000_000 + seq,
        "status": "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": model,
        "output": responses_output(seq, reply) if done else [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": (
            {
                "input_tokens": reply.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 7,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": reply.input_tokens + 7,
            }
            if done
            else None
        ),
        "metadata": {},
    }


def responses_events(seq: int, model: str, reply: Reply = DEFAULT_REPLY) -> list[dict]:
    item_id = f"msg_fake{seq:06d}"
    final = responses_output(seq, reply)
    in_progress_item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
    events: list[dict] = [
        {"type": "response.created", "response": responses_object(seq, model, reply, done=False)},
        {"type": "response.in_progress", "response": responses_object(seq, model, reply, done=False)},
    ]
    if reply.has_text:
        events += _responses_text_events(item_id, in_progress_item, final[0], reply)
    if reply.tool_name:
        call, at = final[-1], len(final) - 1
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": dict(call, arguments="", status="in_progress")})
        for part in reply.tool_chunks:
            events.append({"type": "response.function_call_arguments.delta", "item_id": call["id"],
                           "output_index": at, "delta": part})
        events.append({"type": "response.function_call_arguments.done", "item_id": call["id"], "output_index": at,
                       "arguments": reply.tool_args})
        events.append({"type": "response.output_item.done", "output_index": at, "item": call})
    events.append({"type": "response.completed", "response": responses_object(seq, model, reply)})
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return events


def _responses_text_events(item_id: str, in_progress_item: dict, final: dict, reply: Reply) -> list[dict]:
    events: list[dict] = [
        {"type": "response.output_item.added", "output_index": 0, "item": in_progress_item},
        {
            "type": "response.content_part.added",
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
    ]
    for c in reply.chunks:
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": c,
                "logprobs": [],
            }
        )
    events += [
        {
            "type": "response.output_text.done",
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
            "text": reply.text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": reply.text, "annotations": []},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": final},
    ]
    return events


def responses_sse(seq: int, model: str, reply: Reply = DEFAULT_REPLY) -> list[bytes]:
    return [f"event: {e['type']}\ndata: {_j(e)}\n\n".encode() for e in responses_events(seq, model, reply)]


def gemini_chunk(text: str | None, model: str, finish: bool, tool: tuple[str, str] | None = None,
                 prompt_tokens: int = 12) -> dict:
    parts: list[dict] = [{"text": text}] if text is not None else []
    if tool:
        parts.append({"functionCall": {"name": tool[0], "args": json.loads(tool[1])}})
    cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        cand["finishReason"] = "STOP"
    return {
        "candidates": [cand],
        "usageMetadata": {"promptTokenCount": prompt_tokens, "candidatesTokenCount": 7,
                          "totalTokenCount": prompt_tokens + 7},
        "modelVersion": model,
    }


# -- scripted mode: a model that follows a per-conversation script ----------------------------------

SCRIPT_HEADER = "x-fake-script"  # which registered script answers this request
TURN_HEADER = "x-fake-turn"  # which of its acts (1-based); without it, the next one in order
GATE_HEADER = "x-fake-gate"  # which registered gate paces this streamed answer


@dataclass(frozen=True)
class Act:
    """What the scripted model does on one turn: some prose, then at most one tool call.

    ``args`` is the call's arguments, or a callable that gets the request body as the fake
    received it (tags and all) and returns them, so a script can pick refs from the tags.
    """

    prose: str = ""
    tool: str = ""
    args: Any = None


def say(prose: str) -> Act:
    """The model answers with prose only."""
    return Act(prose)


def tool(name: str, args: Any, prose: str = "") -> Act:
    """The model calls one of the client's own tools (prose first, when given)."""
    return Act(prose, name, args)


def proxy_call(name: str, args_fn: Any, prose: str = "") -> Act:
    """The model calls a proxy tool (compress, decompress, ...); ``args_fn(body)`` or a plain value."""
    return Act(prose, name, args_fn)


class Script:
    """The acts of one scripted conversation, and what the fake answered with them.

    Call ids are derived from the turn number (``toolu_<prefix>NNN`` / ``call_<prefix>NNN``), so the
    same script run twice produces the same answers byte for byte, and a retried turn gets the
    same answer as the first try.
    """

    def __init__(self, acts: Iterable[Act], id_prefix: str = "s", real_usage: bool = False,
                 cache: Callable[[bytes], tuple[int, ...]] | None = None):
        self.acts = list(acts)
        self.id_prefix = id_prefix
        self.real_usage = real_usage  # report the prompt's size (~ JSON bytes / 4) as the real APIs do
        # the prompt cache the script's provider keeps: (read, write) for a request body (Anthropic usage)
        self.cache = cache
        self._next = 1
        self._lock = threading.Lock()
        self.answered: list[tuple[int, Reply]] = []  # (turn, what the model said), in order

    def _turn(self, headers: Any) -> int:
        with self._lock:
            raw = headers.get(TURN_HEADER)
            turn = int(raw) if raw else self._next
            self._next = turn + 1
            return turn

    def reply(self, headers: Any, body: Any, lane: str) -> Reply:
        turn = self._turn(headers)
        if not 1 <= turn <= len(self.acts):
            raise ScriptError(f"the script has no act for turn {turn} (it has {len(self.acts)})")
        act = self.acts[turn - 1]
        name = args = call_id = ""
        if act.tool:
            value = act.args(body) if callable(act.args) else act.args
            args = _j({} if value is None else value)
            name = act.tool
            call_id = f"{'toolu' if lane == 'anthropic' else 'call'}_{self.id_prefix}{turn:03d}"
        chunks = tuple(act.prose[i : i + 7] for i in range(0, len(act.prose), 7)) or ("",)
        raw = _j(body)
        reply = Reply(act.prose, chunks, name, args, call_id, len(raw) // 4 if self.real_usage else 12,
                      self.cache(raw.encode()) if self.cache is not None and lane == "anthropic" else None)
        with self._lock:
            self.answered.append((turn, reply))
        return reply


class ScriptError(Exception):
    pass


class Gate:
    """Paces one streamed answer: the fake writes event ``i`` only once the test has called
    :meth:`release` for it (a failure guard aborts the response after ``timeout`` seconds)."""

    def __init__(self, timeout: float = 20.0):
        self.timeout = timeout
        self.ready = threading.Event()  # set once the events to send are known
        self.events: list[bytes] = []
        self._release: list[threading.Event] = []
        self.sent: list[threading.Event] = []
        self.aborted = False

    def prepare(self, events: list[bytes]) -> None:
        self.events = list(events)
        self._release = [threading.Event() for _ in events]
        self.sent = [threading.Event() for _ in events]
        self.ready.set()

    def release(self, i: int) -> None:
        self._release[i].set()

    def released(self, i: int) -> bool:
        return self._release[i].is_set()

    def wait_release(self, i: int) -> bool:
        ok = self._release[i].wait(self.timeout)
        if not ok:
            self.aborted = True
        return ok


# -- the HTTP side --------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_HTTPServer"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        fake = self.server.fake
        raw = self._read_body()
        encoding = self.headers.get("content-encoding", "")
        rec = fake._new_record(
            "http", self.command, self.path, list(self.headers.items()), raw, encoding
        )
        try:
            status, ctype, chunks = self._answer(rec)
        except BadRequest as e:
            rec.error = str(e)
            status, ctype, chunks = 400, "application/json", [_j(self._error_shape(rec, str(e))).encode()]
        except Exception as e:  # a broken script: a 500 the test sees, with the reason recorded
            rec.error = f"fake upstream failure: {type(e).__name__}: {e}"
            status, ctype, chunks = 500, "application/json", [_j(self._error_shape(rec, rec.error)).encode()]
        encoding = ""
        if ctype == "application/json" and _accepts_gzip(self.headers.get("accept-encoding", "")):
            # like the real APIs: a JSON answer is compressed when the client allows it
            chunks, encoding = [gzip.compress(b"".join(chunks), mtime=0)], "gzip"
        rec.status = status
        rec.response = b"".join(chunks)
        if ctype == "text/event-stream" and self.headers.get("x-fake-stream-encoding"):
            chunks, encoding = _encode_stream(self.headers["x-fake-stream-encoding"], chunks)
        rec.response_encoding = encoding
        gate = fake.gate_of(self.headers) if ctype == "text/event-stream" else None
        if gate is not None:
            gate.prepare(chunks)
        fake._commit(rec)
        self._send(status, ctype, chunks, encoding, gate)

    def _error_shape(self, rec: Recorded, msg: str) -> dict:
        p = rec.route
        if p.endswith("/messages") or "/messages/" in p:
            return {"type": "error", "error": {"type": "invalid_request_error", "message": msg}}
        if ":generateContent" in p or ":streamGenerateContent" in p:
            return {"error": {"code": 400, "message": msg, "status": "INVALID_ARGUMENT"}}
        return {"error": {"message": msg, "type": "invalid_request_error", "param": None, "code": None}}

    def _send(self, status: int, ctype: str, chunks: list[bytes], encoding: str = "", gate: Gate | None = None) -> None:
        streaming = ctype == "text/event-stream"
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("x-fake-upstream", "1")
        if encoding:
            self.send_header("content-encoding", encoding)
        if streaming:
            self.send_header("cache-control", "no-cache")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            for i, c in enumerate(chunks):
                if gate is not None and not gate.wait_release(i):
                    self.close_connection = True  # the test never released it: cut the stream
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
                self.wfile.flush()
                if gate is not None:
                    gate.sent[i].set()
            self.wfile.write(b"0\r\n\r\n")
        else:
            body = b"".join(chunks)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        self.wfile.flush()

    def _answer(self, rec: Recorded) -> tuple[int, str, list[bytes]]:
        p = rec.route
        query = rec.path.split("?", 1)[1] if "?" in rec.path else ""
        script = self.server.fake.script_of(self.headers)
        exact = script is not None  # a scripted conversation is checked exactly as the real API would

        def answer(lane: str, body: Any = None) -> Reply:
            """What the model says, once the request passed validation (``body``: what it sees)."""
            if script is None:
                return Reply.from_headers(self.headers)
            return script.reply(self.headers, rec.json if body is None else body, lane)
        if rec.method == "GET" and p.endswith("/models"):
            listing = {
                "object": "list",
                "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}],
                "has_more": False,
                "first_id": "fake-model",
                "last_id": "fake-model",
            }
            return 200, "application/json", [_j(listing).encode()]
        if rec.method != "POST":
            return 200, "application/json", [_j({"echo": {"method": rec.method, "path": rec.path}}).encode()]
        if p.endswith("/messages/count_tokens"):
            body = self._json(rec)
            _need(isinstance(body, dict) and isinstance(body.get("messages"), list), "messages: field required")
            return 200, "application/json", [_j({"input_tokens": 42}).encode()]
        if p.endswith("/v1/messages"):
            body = self._json(rec)
            check_anthropic(body, api_exact=exact)
            reply = answer("anthropic")
            if body.get("stream"):
                return 200, "text/event-stream", anthropic_sse(rec.seq, body["model"], reply)
            return 200, "application/json", [_j(anthropic_message(rec.seq, body["model"], reply)).encode()]
        if p.endswith("/chat/completions"):
            body = self._json(rec)
            check_chat(body, api_exact=exact)
            reply = answer("chat")
            if body.get("stream"):
                return 200, "text/event-stream", chat_sse(rec.seq, body["model"], reply)
            return 200, "application/json", [_j(chat_completion(rec.seq, body["model"], reply)).encode()]
        if p.endswith("/responses"):
            body = self._json(rec)
            fake = self.server.fake
            full = fake.chains.expand(body, None) if isinstance(body, dict) else body
            check_responses(full, api_exact=exact)
            rec.conversation = _input_list(full.get("input"))
            reply = answer("responses", full)
            rec.response_id = f"resp_fake{rec.seq:06d}"
            fake.chains.save(rec.response_id, full, responses_output(rec.seq, reply), None)
            if body.get("stream"):
                return 200, "text/event-stream", responses_sse(rec.seq, body["model"], reply)
            return 200, "application/json", [_j(responses_object(rec.seq, body["model"], reply)).encode()]
        if ":generateContent" in p or ":streamGenerateContent" in p:
            body = self._json(rec)
            check_gemini(body, api_exact=exact)
            reply = answer("gemini")
            model = p.rsplit("/", 1)[-1].split(":", 1)[0]
            tool = (reply.tool_name, reply.tool_args) if reply.tool_name else None
            if ":generateContent" in p:
                text = reply.text if reply.has_text else None
                return 200, "application/json", [_j(gemini_chunk(text, model, True, tool, reply.input_tokens)).encode()]
            texts: list[str | None] = list(reply.chunks) if reply.has_text else [None]
            last = len(texts) - 1
            pieces = [gemini_chunk(c, model, i == last, tool if i == last else None, reply.input_tokens)
                      for i, c in enumerate(texts)]
            if "alt=sse" in query:
                return 200, "text/event-stream", [f"data: {_j(x)}\r\n\r\n".encode() for x in pieces]
            return 200, "application/json", [("[" + ",\r\n".join(_j(x) for x in pieces) + "]").encode()]
        # anything else: an echo, so non-model traffic can be checked too
        return 200, "application/json", [_j({"echo": {"method": rec.method, "path": rec.path, "bytes": len(rec.body)}}).encode()]

    @staticmethod
    def _json(rec: Recorded) -> Any:
        if rec.error:
            raise BadRequest(rec.error)
        if rec.json is None:
            raise BadRequest("There was an error parsing the body: the request body is not valid JSON")
        return rec.json


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: a proxy's burst of connections (32 clients starting at
    # once) overflowed it, and each dropped connect waited a SYN retransmission (1 s) in the timings
    request_queue_size = 128
    fake: "FakeUpstream"

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        # a WebSocket upgrade on this port goes to the websockets server, everything else is HTTP
        if is_websocket_upgrade(request):
            self.fake._ws_server.handler(request, client_address)
            return
        super().process_request_thread(request, client_address)


def _encode_stream(how: str, chunks: list[bytes]) -> tuple[list[bytes], str]:
    """An SSE answer's chunks as ``x-fake-stream-encoding`` asks (see the module's docstring)."""
    if how == "gzip-members":
        return [gzip.compress(c, mtime=0) for c in chunks], "gzip"
    if how == "zstd-frames":
        try:
            from compression import zstd  # Python 3.14
        except ImportError:
            from backports import zstd
        return [zstd.compress(c) for c in chunks], "zstd"
    if how == "gzip-label":
        return chunks, "gzip"
    raise BadRequest(f"unknown x-fake-stream-encoding {how!r}")


def _accepts_gzip(accept: str) -> bool:
    for item in accept.lower().split(","):
        name, _, params = item.strip().partition(";")
        if name.strip() in ("gzip", "*") and params.replace(" ", "") not in ("q=0", "q=0.0"):
            return True
    return False


def is_websocket_upgrade(sock: socket.socket) -> bool:
    """Peek (without consuming) at the request head of a fresh connection."""
    deadline = time.monotonic() + 5
    seen = b""
    sock.settimeout(5)
    try:
        while b"\r\n\r\n" not in seen and len(seen) < 65536 and time.monotonic() < deadline:
            data = sock.recv(65536, socket.MSG_PEEK)
            if not data:
                return False
            if len(data) == len(seen):
                time.sleep(0.005)
            seen = data
    except OSError:
        return False
    finally:
        sock.settimeout(None)
    head = seen.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip() == "upgrade" and "websocket" in value:
            return True
    return False


# -- server-side chains (Responses previous_response_id) --------------------------------------------


class ProviderChains:
    """``previous_response_id`` the way OpenAI keeps it: a response made with ``store`` not false is
    kept for any later request; a ``store: false`` one lives only on the WebSocket connection that
    made it, and only while it is that connection's newest.  An id it does not hold is refused with
    400 ``previous_response_not_found`` (as the API does)."""

    def __init__(self) -> None:
        self.stored: dict[str, list] = {}
        self.lock = threading.Lock()
        self.seen_prev: list[str] = []  # every previous_response_id a request carried, in order

    def expand(self, body: dict, local: dict | None) -> dict:
        """The body with its chain put in front of its input (no previous_response_id left)."""
        prev = body.get("previous_response_id")
        if prev is None:
            return body
        with self.lock:
            self.seen_prev.append(prev)
            conv = local["conv"] if local is not None and local.get("id") == prev else self.stored.get(prev)
        if conv is None:
            raise BadRequest(f"Previous response with id '{prev}' not found.")
        full = {k: v for k, v in body.items() if k != "previous_response_id"}
        full["input"] = list(conv) + _input_list(body.get("input"))
        return full

    def save(self, rid: str, full: dict, output: list, local: dict | None) -> None:
        conv = _input_list(full.get("input")) + output
        with self.lock:
            if full.get("store", True) is not False:
                self.stored[rid] = conv
        if local is not None:
            local.clear()
            local.update(id=rid, conv=conv)


def _input_list(inp: Any) -> list:
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    return list(inp) if isinstance(inp, list) else []


# -- the server -------------------------------------------------------------------------------------


@dataclass
class FakeUpstream:
    host: str = "127.0.0.1"
    _records: list[Recorded] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: int = 0
    _scripts: dict[str, Script] = field(default_factory=dict)
    _gates: dict[str, Gate] = field(default_factory=dict)
    chains: ProviderChains = field(default_factory=ProviderChains)

    def start(self) -> "FakeUpstream":
        if self.host not in ("127.0.0.1", "localhost"):
            raise ValueError("the fake upstream listens on loopback only")
        self._ws_server = ws_serve(self._ws_session, "127.0.0.1", 0, compression=None)
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, name="fake-http", daemon=True),
            threading.Thread(target=self._ws_server.serve_forever, name="fake-ws", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._ws_server.shutdown()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "FakeUpstream":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def ws_port(self) -> int:
        return self._ws_server.socket.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- scripts and gates -----------------------------------------------------------------------
    def script(self, key: str, acts: Iterable[Act], id_prefix: str = "s", real_usage: bool = False,
               cache: Callable[[bytes], tuple[int, ...]] | None = None) -> Script:
        """Register a scripted model for requests carrying ``x-fake-script: <key>``."""
        s = Script(acts, id_prefix, real_usage, cache)
        with self._lock:
            self._scripts[key] = s
        return s

    def script_of(self, headers: Any) -> Script | None:
        key = headers.get(SCRIPT_HEADER)
        if not key:
            return None
        with self._lock:
            s = self._scripts.get(key)
        if s is None:
            raise ScriptError(f"no script registered as {key!r}")
        return s

    def gate(self, key: str, timeout: float = 20.0) -> Gate:
        """Register a gate pacing the streamed answer to the request carrying ``x-fake-gate: <key>``."""
        g = Gate(timeout)
        with self._lock:
            self._gates[key] = g
        return g

    def gate_of(self, headers: Any) -> Gate | None:
        key = headers.get(GATE_HEADER)
        if not key:
            return None
        with self._lock:
            return self._gates.get(key)

    # -- records -------------------------------------------------------------------------------
    def _new_record(
        self, transport: str, method: str, path: str, headers: list[tuple[str, str]], raw: bytes, encoding: str
    ) -> Recorded:
        with self._lock:
            self._seq += 1
            seq = self._seq
        rec = Recorded(seq, transport, method, path, headers, raw, raw, encoding)
        try:
            rec.body = decode_body(raw, encoding) if encoding else raw
        except BadRequest as e:
            rec.error = str(e)
            return rec
        if rec.body:
            try:
                rec.json = json.loads(rec.body)
            except ValueError:
                rec.json = None
        return rec

    def _commit(self, rec: Recorded) -> None:
        with self._lock:
            self._records.append(rec)

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._records)

    def find(self, pred: Callable[[Recorded], bool]) -> list[Recorded]:
        return [r for r in self.requests if pred(r)]

    def last(self, pred: Callable[[Recorded], bool] = lambda r: True) -> Recorded:
        hits = self.find(pred)
        if not hits:
            raise LookupError("the fake upstream received no matching request")
        return hits[-1]

    def wait_for(self, pred: Callable[[Recorded], bool], timeout: float = 10.0) -> Recorded:
        deadline = time.monotonic() + timeout
        while True:
            hits = self.find(pred)
            if hits:
                return hits[-1]
            if time.monotonic() > deadline:
                raise TimeoutError("the fake upstream received no matching request in time")
            time.sleep(0.02)

    # -- the WebSocket side (Responses over WebSocket) -----------------------------------------
    def _ws_session(self, conn: ServerConnection) -> None:
        req = conn.request
        path = req.path if req is not None else "/"
        headers = list(req.headers.raw_items()) if req is not None else []
        local: dict = {}  # this connection's store: false chain
        for frame in conn:
            if isinstance(frame, str):
                raw = frame.encode()
            else:
                raw = bytes(frame)
            rec = self._new_record("ws", "WS", path, headers, raw, "")
            out = list(self._ws_answer(rec, Reply.from_headers(req.headers) if req is not None else DEFAULT_REPLY,
                                       local, req.headers if req is not None else {}))
            rec.status = 200 if not rec.error else 400
            rec.response = b"\n".join(x.encode() for x in out)
            self._commit(rec)
            _send_burst(conn, out)

    def _ws_answer(self, rec: Recorded, reply: Reply, local: dict | None = None, headers: Any = None) -> Iterable[str]:
        body = rec.json
        try:
            _need(path_is_responses(rec.route), f"no WebSocket API at {rec.route}")
            _need(isinstance(body, dict), "frame is not a JSON object")
            _need(body.get("type") == "response.create", f"unsupported event type {body.get('type')!r}")
            full = self.chains.expand(body, local)
            script = self.script_of(headers) if headers else None
            check_responses(full, api_exact=script is not None)
            rec.conversation = _input_list(full.get("input"))
            if script is not None:
                reply = script.reply(headers, full, "responses")
            rec.response_id = f"resp_fake{rec.seq:06d}"
            self.chains.save(rec.response_id, full, responses_output(rec.seq, reply), local)
        except BadRequest as e:
            rec.error = str(e)
            yield _j({"type": "error", "status": 400, "error": {"type": "invalid_request_error", "message": str(e)}})
            return
        for e in responses_events(rec.seq, body["model"], reply):
            yield _j(e)


def _send_burst(conn: ServerConnection, frames: list[str]) -> None:
    """Send one answer's frames in a single write, as a busy server's socket buffer would deliver
    them, so the proxy reads several frames at once (the demanding case for frame rewriting)."""
    send_context = getattr(conn, "send_context", None)
    if send_context is None:  # another websockets version: frame by frame
        for x in frames:
            conn.send(x)
        return
    with send_context():
        for x in frames:
            conn.protocol.send_text(x.encode())


def path_is_responses(path: str) -> bool:
    return path.rstrip("/").endswith("/responses")


if __name__ == "__main__":  # a manual look: python tests/e2e/fake_upstream.py
    with FakeUpstream() as fake:
        print(f"fake upstream at {fake.url} (ws also on {fake.ws_port}); Ctrl-C to stop")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
