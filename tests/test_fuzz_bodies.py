"""Hostile bodies on the four lanes, through the addon's request hook.

Well-formed generated bodies (``wirecases``) get tools, a message-id envelope or a
``previous_response_id`` now and then, and then up to four of their values (anywhere: a role, a
tool name, a content part, the conversation array itself) replaced by arbitrary JSON.  Whatever
comes in:

* no exception reaches the fail-open handler (a body the lanes cannot read is "not understood",
  logged at info, never an internal error);
* in observe mode, and in fold mode when the body has no conversation items, no session, or cannot
  be read, the body goes upstream byte for byte;
* when fold mode changes a body, it is a JSON object whose top-level values other than the
  conversation and the slots bili injects into are byte-identical, and whose conversation has the
  same number of items, or one more on the lanes whose prompt is an item of its own (Chat without
  a system message, Responses without string instructions), and that item is bili's prompt.
"""

from __future__ import annotations

import copy
import json
import logging
import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow, tutils

import wirecases as wc
from bili_addon.kernel.envelope import FIELD
from bili_addon.wire import LANES

FUZZ_SETTINGS = settings(  # BILI_FUZZ_EXAMPLES=2000 for a longer hunt
    max_examples=int(os.environ.get("BILI_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
LANE_NAMES = ["anthropic", "responses", "chat", "gemini"]
PATHS = {
    "anthropic": "/v1/messages",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "gemini": "/v1beta/models/gemini-x:generateContent",
}
TOOLS = {
    "anthropic": [{"name": "Bash", "description": "Run", "input_schema": {"type": "object"}}],
    "chat": [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}],
    "responses": [{"type": "function", "name": "Bash", "parameters": {"type": "object"}}],
    "gemini": [{"functionDeclarations": [{"name": "Bash", "parameters": {"type": "object"}}]}],
}
# where bili may write on purpose: its tools, its prompt, and the envelope it removes
INJECT_SLOTS = {"tools", "system", "instructions", "systemInstruction", FIELD}
PROMPT_HEAD = "# Context folding (bili)"

hostile_values = st.one_of(
    wc.json_values,
    st.sampled_from([True, False, None, 0, -1, 1.5, "", "user", "assistant", "tool", "system", "message",
                     "text", "tool_use", "tool_result", "function_call", "function_call_output", "reasoning",
                     [], {}, [True], [None], [{}], {"a": True}, {"role": {"a": 1}}, {"type": ["text"]},
                     {"type": "text", "text": True}, {"name": True}, {"name": ["x"]}, {"role": ["user"]},
                     [{"type": "text", "text": "hi"}], {"parts": 5}, {"functionDeclarations": 7}]),
)


def _paths(obj, here=()):
    yield here
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, here + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, here + (i,))


def _set(obj, path, value):
    if not path:
        return value
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


@st.composite
def hostile_bodies(draw, lane_name: str) -> bytes:
    obj = json.loads(draw(wc.bodies(lane_name)).raw)
    conv = obj[LANES[lane_name].conv_key]
    if draw(st.booleans()):
        obj["tools"] = copy.deepcopy(TOOLS[lane_name])
    if draw(st.integers(0, 5)) == 0:
        tag = draw(st.integers(0, 1 << 30))
        obj[FIELD] = [f"id-{tag}-{i}" for i in range(len(conv))]
    if lane_name == "responses" and draw(st.integers(0, 5)) == 0:
        obj["previous_response_id"] = "resp_1"
    # the small top-level fields identity reads, and the slots bili injects into, with anything in them
    top_keys = st.sampled_from(["session_id", "metadata", "prompt_cache_key", "model", "previous_response_id",
                                "system", "instructions", "systemInstruction", "tools", "stream"])
    top_values = st.one_of(hostile_values, st.sampled_from(["fuzz-body-session", {"session_id": "fuzz-meta"},
                                                            {"user_id": '{"session_id": 5}'}]))
    obj.update(copy.deepcopy(draw(st.dictionaries(top_keys, top_values, max_size=2))))
    for _ in range(draw(st.integers(0, 4))):
        paths = list(_paths(obj))
        where = paths[draw(st.integers(0, len(paths) - 1))]
        obj = _set(obj, where, copy.deepcopy(draw(hostile_values)))
    if not isinstance(obj, dict) and draw(st.booleans()):
        return draw(st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": [}']))
    return json.dumps(obj, ensure_ascii=draw(st.booleans())).encode()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records():
    h = Records()
    log = logging.getLogger("bili")
    log.addHandler(h)
    yield h
    log.removeHandler(h)


def _send(bili, lane_name: str, raw: bytes, sid: str | None, extra: dict | None = None) -> http.HTTPFlow:
    headers = http.Headers(host="api.example.com", content_type="application/json", **(extra or {}))
    if sid:
        headers["x-acp-session"] = sid
    req = tutils.treq(method=b"POST", path=PATHS[lane_name].encode(), host="api.example.com", port=443,
                      scheme=b"https", headers=headers, content=raw)
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 50000)
    bili.request(f)
    return f


def _no_internal_error(records: Records, raw: bytes) -> None:
    bad = [r for r in records.records if r.exc_info or "internal error" in r.getMessage()]
    records.records.clear()
    assert not bad, f"{bad[0].getMessage()}\nbody: {raw[:2000]!r}"


def _top(raw: bytes) -> dict[str, msgspec.Raw] | None:
    try:
        return msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _is_prompt_item(lane_name: str, item) -> bool:
    if not isinstance(item, dict) or item.get("role") not in ("system", "developer"):
        return False
    return PROMPT_HEAD in json.dumps(item.get("content"), ensure_ascii=False)


def _check_fold(lane_name: str, raw: bytes, out: bytes) -> None:
    if out == raw:
        return
    before, after = _top(raw), _top(out)
    assert before is not None and after is not None, f"a body bili changed must stay a JSON object: {out[:500]!r}"
    key = LANES[lane_name].conv_key
    for k in set(before) | set(after):
        if k in INJECT_SLOTS or k == key:
            continue
        assert k in before and k in after and bytes(before[k]) == bytes(after[k]), f"top-level {k!r} changed"
    assert set(after) - set(before) <= INJECT_SLOTS - {FIELD}, set(after) - set(before)
    assert FIELD not in after, "the envelope never goes upstream"
    conv_in = msgspec.json.decode(before[key]) if key in before else None
    conv_out = msgspec.json.decode(after[key]) if key in after else None
    if not isinstance(conv_in, list) or not conv_in:
        assert key not in after or bytes(after[key]) == bytes(before[key]), "no conversation: nothing added to it"
        return
    assert isinstance(conv_out, list)
    if len(conv_out) == len(conv_in):
        return
    assert len(conv_out) == len(conv_in) + 1 and lane_name in ("chat", "responses"), (len(conv_in), len(conv_out))
    extra = [i for i, it in enumerate(conv_out) if _is_prompt_item(lane_name, it)]
    assert extra, "the one item bili added is its prompt"


@pytest.mark.parametrize("lane_name", LANE_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_hostile_bodies_in_fold_mode(bili, records, lane_name, data):
    raw = data.draw(hostile_bodies(lane_name), label="body")
    sid = data.draw(st.sampled_from([None, "fuzz-a", "fuzz-b"]), label="session")
    extra = data.draw(st.sampled_from([{}, {}, {"x_bili_msg_ids": "[1, 2"}, {"x_bili_msg_ids": '["a"]'},
                                       {"x_bili_msg_ids": '{"ids": 5}', "x_bili_msg_ids_resync": "yes"},
                                       {"session_id": " "}, {"x_codex_turn_metadata": "{not json"}]), label="headers")
    f = _send(bili, lane_name, raw, sid, extra)
    _no_internal_error(records, raw)
    if f.response is not None:  # only a message-id envelope bili cannot honour is answered (400), by design
        assert f.response.status_code == 400 and b"bili_message_ids" in f.response.content
        assert FIELD.encode() in raw or "x_bili_msg_ids" in extra
        return
    out = f.request.raw_content
    _check_fold(lane_name, raw, out)
    top = _top(raw)
    conv = top.get(LANES[lane_name].conv_key) if top is not None else None
    if top is None or conv is None or bytes(conv) in (b"[]", b"null") or bytes(conv)[:1] != b"[":
        if top is None or FIELD not in top:
            assert out == raw, "a body without a conversation array goes upstream byte for byte"


@pytest.mark.parametrize("lane_name", LANE_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_hostile_bodies_in_observe_mode_are_byte_identical(bili, records, lane_name, data):
    bili.tctx.configure(bili, bili_mode="observe")
    raw = data.draw(hostile_bodies(lane_name), label="body")
    sid = data.draw(st.sampled_from([None, "fuzz-o"]), label="session")
    f = _send(bili, lane_name, raw, sid)
    _no_internal_error(records, raw)
    out = f.request.raw_content
    top = _top(raw)
    if f.response is not None:  # a message-id envelope bili cannot honour is refused (400), by design
        assert f.response.status_code == 400 and top is not None and FIELD in top
    elif top is not None and FIELD in top:  # the envelope is bili's own: removed, the rest byte-exact
        after = _top(out)
        assert after is not None and FIELD not in after
        assert {k: bytes(v) for k, v in after.items()} == {k: bytes(v) for k, v in top.items() if k != FIELD}
    else:
        assert out == raw


def test_the_issue_bodies():
    """The three bodies of the report, as regressions (the hypothesis tests find their kind)."""
    from bili_addon.kernel.turn import Engine
    from bili_addon.store import Store
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        e = Engine(Store(d))
        h = {"x-acp-session": "issue"}
        # Anthropic: a tool whose name is a bool ("argument of type 'bool' is not iterable")
        raw = json.dumps({"model": "m", "tools": [{"name": True, "input_schema": {}}],
                          "messages": [{"role": "user", "content": "hi"}]}).encode()
        e.process(raw, LANES["anthropic"], h, render=True)
        # Responses: a role that is an object ("unhashable type: 'dict'")
        raw = json.dumps({"model": "m", "input": [{"type": "message", "role": {"a": 1}, "content": "hi"},
                                                  {"role": "user", "content": "there"}]}).encode()
        e.process(raw, LANES["responses"], {"x-acp-session": "issue-r"}, render=True)
        # Responses: an empty input with tools went upstream with one (prompt) item
        raw = json.dumps({"model": "m", "input": [], "tools": TOOLS["responses"]}).encode()
        res = e.process(raw, LANES["responses"], {"x-acp-session": "issue-e"}, render=True)
        assert res.body is None
        e.store.close()


# -- the way back: hostile answers ---------------------------------------------------------------

_T = '<acp tokens="3" type="text">m00001</acp>\nhi'
ANSWERS = {  # a non-streamed answer, and the events of a streamed one, per lane
    "anthropic": (
        {"id": "msg_1", "type": "message", "role": "assistant", "content": [
            {"type": "text", "text": _T}, {"type": "tool_use", "id": "t1", "name": "compress", "input": {}}],
         "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 3}},
        [{"type": "message_start", "message": {"usage": {"input_tokens": 3}}},
         {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
         {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "<acp tok"}},
         {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": _T}},
         {"type": "content_block_stop", "index": 0},
         {"type": "content_block_start", "index": 1,
          "content_block": {"type": "tool_use", "id": "t", "name": "compress", "input": {}}},
         {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
         {"type": "content_block_stop", "index": 1},
         {"type": "message_delta", "usage": {"output_tokens": 3}}, {"type": "message_stop"}],
    ),
    "chat": (
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": _T, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "compress", "arguments": "{}"}}]}}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}},
        [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "<acp"}}]},
         {"choices": [{"index": 0, "delta": {"content": _T}}]},
         {"choices": [{"index": 0, "delta": {"tool_calls": [
             {"index": 0, "id": "c", "function": {"name": "compress", "arguments": "{"}}]}}]},
         {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                       "finish_reason": "tool_calls"}]},
         {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}],
    ),
    "responses": (
        {"id": "r", "output": [{"type": "message", "id": "m", "role": "assistant", "content": [
            {"type": "output_text", "text": _T}]}, {"type": "function_call", "call_id": "c1", "name": "decompress",
                                                   "arguments": "{}"}],
         "usage": {"input_tokens": 5, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 1}}},
        [{"type": "response.created", "response": {"id": "r"}},
         {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, "delta": "<acp"},
         {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, "delta": _T},
         {"type": "response.output_text.done", "item_id": "m", "output_index": 0, "content_index": 0,
          "text": "<acp" + _T},
         {"type": "response.output_item.done",
          "item": {"type": "function_call", "call_id": "c", "name": "compress", "arguments": "{}"}},
         {"type": "response.completed", "response": {"output": [
             {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "<acp" + _T}]}],
             "usage": {"input_tokens": 3, "output_tokens": 1}}}],
    ),
    "gemini": (
        {"candidates": [{"content": {"role": "model", "parts": [
            {"text": _T}, {"functionCall": {"name": "compress", "args": {}}}]}}],
         "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 1}},
        [{"candidates": [{"content": {"role": "model", "parts": [{"text": "<acp"}]}}]},
         {"candidates": [{"content": {"role": "model", "parts": [
             {"text": _T}, {"functionCall": {"name": "compress", "args": {}}}]}, "finishReason": "STOP"}],
          "usageMetadata": {"promptTokenCount": 3}}],
    ),
}


def _mutate(data, value, times: int):
    value = copy.deepcopy(value)
    for _ in range(times):
        paths = list(_paths(value))[1:]
        where = paths[data.draw(st.integers(0, len(paths) - 1))]
        value = _set(value, where, copy.deepcopy(data.draw(hostile_values)))
    return value


@pytest.mark.parametrize("lane_name", LANE_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_hostile_answers_never_raise(records, lane_name, data):
    """A JSON answer, SSE events or (Responses) WebSocket frames with arbitrary values where the
    lane expects arrays, indexes and ids: read, cleaned where possible, never an exception."""
    from bili_addon.stream import ResponseRewriter

    body, events = ANSWERS[lane_name]
    n = data.draw(st.integers(1, 4), label="mutations")
    rw = ResponseRewriter(lane_name, True, data.draw(st.sampled_from(["", "[bili] compressed m1–m2 → b1"])))
    out = rw.json_body(json.dumps(_mutate(data, body, n)).encode())
    assert out is None or isinstance(msgspec.json.decode(out), (dict, list))
    events = _mutate(data, events, n)
    ws = lane_name == "responses" and data.draw(st.booleans(), label="websocket")
    rw = ResponseRewriter(lane_name, True)
    for ev in events:
        raw = json.dumps(ev).encode()
        if ws:
            rw.ws_frame(raw)
        else:
            rw.sse_event(b"data: " + raw + b"\n\n")
    if not ws:
        rw.sse_finish()
        assert not rw.broken, [r.getMessage() for r in records.records]
    rw.calls, rw.usage  # noqa: B018


def test_a_stream_passes_unchanged_after_an_internal_error(records, monkeypatch):
    """Fail open on the way back too: the held event is released, the rest passes as it came."""
    from bili_addon.stream import ResponseRewriter

    rw = ResponseRewriter("anthropic", True)
    _body, events = ANSWERS["anthropic"]
    raws = [b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events]
    out = rw.sse_event(raws[0]) + rw.sse_event(raws[1]) + rw.sse_event(raws[2])  # "<acp tok" is held
    assert len(out) == 2

    def boom(ev):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(rw.lane, "event", boom)
    out += rw.sse_event(raws[3])
    assert rw.broken and len(out) == 4 and out[3] == raws[3]  # the held one released, then this one unchanged
    assert json.loads(out[2].split(b"data: ", 1)[1]) == events[2]
    rest = [b for r in raws[4:] for b in rw.sse_event(r)] + rw.sse_finish()
    assert rest == raws[4:]
    assert any("kaboom" in r.getMessage() for r in records.records)
