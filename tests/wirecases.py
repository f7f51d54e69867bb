"""Shared helpers for the wire tests: captured bodies, hypothesis body generators, the render checker.

Every generated item comes with its *expected* cores (role, ctype, path, text), written from the
wire formats' documentation rather than from the lane code, so the tests check the lanes against
an independent oracle.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

from bili_addon.kernel.turn import clean_replayed_prose
from bili_addon.wire import LANES, detect_lane
from bili_addon.wire.base import IMAGE, OTHER, REASONING, TEXT, TOOL_CALL, TOOL_RESULT, Body, compact_json

def _captures_dir() -> str:
    """The agents' captured requests: ``$BILI_CAPTURES``, else ``shared/captures`` beside the
    checkout (where CI lays it)."""
    env = os.environ.get("BILI_CAPTURES")
    if env:
        return env
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "captures")
    return os.path.normpath(beside)


CAPTURES = _captures_dir()
TAG_RE = re.compile(r'<acp tokens="[^"<>]*" type="text">m\d{5}</acp>\n')


# -- captured bodies ---------------------------------------------------------------------------


@dataclass
class Captured:
    name: str  # "<capture dir>#<n>"
    lane: Any
    raw: bytes
    headers: dict[str, str]


def capture_files() -> list[str]:
    return sorted(glob.glob(os.path.join(CAPTURES, "**", "flows.mitm"), recursive=True))


def captured_bodies(path: str) -> list[Captured]:
    """Model-request bodies of one capture file, in flow order (HTTP bodies and Codex WS frames)."""
    from mitmproxy.io import FlowReader

    out: list[Captured] = []
    name = os.path.relpath(os.path.dirname(path), CAPTURES)
    with open(path, "rb") as fh:
        for flow in FlowReader(fh).stream():
            req = getattr(flow, "request", None)
            if req is None:
                continue
            headers = {k.lower(): v for k, v in req.headers.items()}
            lane = detect_lane(req.method, req.path)
            if lane is not None:
                raw = req.get_content()
                if raw:
                    out.append(Captured(f"{name}#{len(out)}", lane, raw, headers))
            ws = getattr(flow, "websocket", None)
            for msg in ws.messages if ws is not None else ():
                if msg.from_client and msg.is_text and b'"response.create"' in msg.content:
                    out.append(Captured(f"{name}#{len(out)}", LANES["responses"], msg.content, headers))
    return out


# -- the render checker ------------------------------------------------------------------------


Expect = tuple[bool, str]  # (a tag is prefixed, the text after it)


def expected_text(role: str, text: str, *, prefill: bool) -> Expect | None:
    """What the kernel writes at a prose path: a tag plus the (cleaned) text, the cleaned text, or nothing.

    Replayed assistant prose is cleaned of the addon's markers and of tag echoes first (see
    :func:`bili_addon.kernel.turn.clean_replayed_prose`); user prose is tagged as sent.
    """
    clean = clean_replayed_prose(text) if role == "assistant" else text
    if role in ("user", "assistant") and not prefill and clean.strip():
        return True, clean
    if clean != text:
        return False, clean
    return None


_SAMPLE_TAG = '<acp tokens="1" type="text">m00001</acp>\n'


def replay_stable(raw: bytes, lane: Any) -> bool:
    """Whether re-sending our rendered body must be a no-op: every assistant prose text survives
    its ingress cleaning unchanged once tagged (echo cleaning eats the newlines after a tag, and
    is not idempotent on some tag fragments)."""
    body = Body(raw, lane.conv_key)
    for it in body.items:
        for c in lane.item_cores(msgspec.json.decode(bytes(it))):
            if c.ctype == TEXT and c.role == "assistant" and c.path:
                clean = clean_replayed_prose(c.text)
                if clean_replayed_prose(clean) != clean or clean_replayed_prose(_SAMPLE_TAG + clean) != clean:
                    return False
    return True


def tagged_paths(raw: bytes, lane: Any) -> dict[int, dict[tuple, Expect]]:
    """Per item index, what the kernel must write at each prose path, derived from the lane's cores.

    Mirrors the kernel: only items after the leading system run; assistant text in the final item
    is a prefill and never tagged.
    """
    body = Body(raw, lane.conv_key)
    objs = [msgspec.json.decode(bytes(it)) for it in body.items]
    start = 0
    while start < len(objs) and lane.is_system_item(objs[start]):
        start += 1
    last = len(objs) - 1
    out: dict[int, dict[tuple, Expect]] = {}
    for i in range(start, len(objs)):
        for c in lane.item_cores(objs[i]):
            if c.ctype != TEXT or not c.path:
                continue
            want = expected_text(c.role, c.text, prefill=i == last and c.role == "assistant")
            if want is not None:
                out.setdefault(i, {})[tuple(c.path)] = want
    return out


def _raw_kind(raw: bytes) -> str:
    return raw.lstrip()[:1].decode("latin-1")


def compare_raw(a: bytes, b: bytes, allowed: dict[tuple, Expect], here: tuple, seen: set) -> None:
    """``b`` equals ``a`` except strings at ``allowed`` paths, which must read as expected there.

    Containers on a patched path may be re-encoded (whitespace), but every leaf off the patched
    paths must keep its exact bytes.
    """
    if here in allowed:
        new = msgspec.json.decode(b)
        assert isinstance(new, str), (here, new)
        tagged, text = allowed[here]
        if tagged:
            m = TAG_RE.match(new)
            assert m is not None, f"no tag at {here}: {new[:80]!r}"
            new = new[m.end() :]
        assert new == text, f"text changed at {here}: {new[:80]!r} != {text[:80]!r}"
        seen.add(here)
        return
    if a == b:
        return
    kind = _raw_kind(a)
    assert kind == _raw_kind(b) and kind in "{[", f"bytes changed off a prose path at {here}: {a[:60]!r} -> {b[:60]!r}"
    if kind == "{":
        da = msgspec.json.decode(a, type=dict[str, msgspec.Raw])
        db = msgspec.json.decode(b, type=dict[str, msgspec.Raw])
        assert list(da) == list(db), f"keys changed at {here}"
        for k in da:
            compare_raw(bytes(da[k]), bytes(db[k]), allowed, here + (k,), seen)
    else:
        la = msgspec.json.decode(a, type=list[msgspec.Raw])
        lb = msgspec.json.decode(b, type=list[msgspec.Raw])
        assert len(la) == len(lb), f"length changed at {here}"
        for j, (x, y) in enumerate(zip(la, lb)):
            compare_raw(bytes(x), bytes(y), allowed, here + (j,), seen)


def check_rendered(raw: bytes, out: bytes | None, lane: Any, expected: dict[int, dict[tuple, Expect]]) -> None:
    """The rendered body is valid JSON that differs from ``raw`` only at the expected prose paths."""
    if out is None:
        assert not expected, f"nothing rendered, expected edits at {expected}"
        return
    msgspec.json.decode(out)  # valid JSON
    a, b = Body(raw, lane.conv_key), Body(out, lane.conv_key)
    assert list(a.top) == list(b.top)
    for k in a.top:
        if k != lane.conv_key:
            assert bytes(a.top[k]) == bytes(b.top[k]), f"top-level {k} changed"
    assert len(a.items) == len(b.items)
    for i, (x, y) in enumerate(zip(a.items, b.items)):
        allowed = expected.get(i, {})
        seen: set = set()
        compare_raw(bytes(x), bytes(y), allowed, (), seen)
        assert seen == set(allowed), f"item {i}: tagged {sorted(seen)} expected {sorted(allowed)}"


# -- generated bodies --------------------------------------------------------------------------


@dataclass
class Want:
    """One expected core: role, ctype, path (None = no path) and, when known, its text."""

    role: str
    ctype: str
    path: tuple | None = None
    text: str | None = None


@dataclass
class Item:
    obj: Any
    wants: list[Want]
    system: bool = False  # a lane system item (Chat/Responses system or developer message)


@dataclass
class GenBody:
    lane: Any
    raw: bytes
    items: list[Item] = field(default_factory=list)


_SPICE = ["😀", "𝄞", "中文", "한국어", "\u2028", "\x00", '"', "\\", "</acp>", "<acp ", "\n", " ", "\t", "é", "\U0010fffd"]
_FOREIGN_TAG = '<acp tokens="3" type="text">m99999</acp>\n'  # a ref no small session mints

prose = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
    st.lists(st.sampled_from(["fix", "the", "bug", "😀", "中文", "in", "file.py", "\n"]), min_size=1, max_size=8).map(" ".join),
    st.lists(st.one_of(st.sampled_from(_SPICE), st.text(max_size=4)), max_size=6).map("".join),
    st.sampled_from(["", "   ", "hello", "Run the shell command: echo hi"]),
    st.text(max_size=8).map(lambda s: _FOREIGN_TAG + s),
)
ident = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=10)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**9), 10**9),
    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
b64 = st.binary(min_size=1, max_size=24).map(lambda b: base64.b64encode(b).decode())
cache_control = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}])


@st.composite
def extras(draw, *, cache: bool = False) -> dict:
    """Unknown extra fields (``x_*``) and, optionally, a cache_control marker."""
    out = draw(st.dictionaries(ident.map(lambda k: "x_" + k), json_values, max_size=2))
    if cache and draw(st.booleans()):
        out["cache_control"] = draw(cache_control)
    return out


def _with(draw, base: dict, *, cache: bool = False) -> dict:
    extra = draw(extras(cache=cache))
    merged = dict(base)
    for k, v in extra.items():
        merged.setdefault(k, v)
    keys = list(merged)
    order = draw(st.permutations(keys))
    return {k: merged[k] for k in order}


# Anthropic ------------------------------------------------------------------------------------


@st.composite
def anthropic_block(draw, role: str, j: int) -> tuple[dict, Want]:
    kind = draw(st.sampled_from(["text", "text", "image", "tool_use", "tool_result", "thinking", "document"]))
    if kind == "text":
        t = draw(prose)
        return _with(draw, {"type": "text", "text": t}, cache=True), Want(role, TEXT, ("content", j, "text"), t)
    if kind == "image":
        src = {"type": "base64", "media_type": "image/png", "data": draw(b64)}
        return _with(draw, {"type": "image", "source": src}, cache=True), Want(role, IMAGE, None, "[image]")
    if kind == "tool_use":
        args = draw(st.dictionaries(ident, json_values, max_size=3))
        block = {"type": "tool_use", "id": "toolu_" + draw(ident), "name": draw(ident), "input": args}
        return _with(draw, block), Want("assistant", TOOL_CALL, None, compact_json(args))
    if kind == "tool_result":
        out = draw(prose)
        block = {"type": "tool_result", "tool_use_id": "toolu_" + draw(ident), "content": out}
        return _with(draw, block, cache=True), Want("tool", TOOL_RESULT, None, out)
    if kind == "thinking":
        t = draw(prose)
        block = {"type": "thinking", "thinking": t, "signature": draw(b64)}
        return _with(draw, block), Want("assistant", REASONING, None, t)
    block = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": draw(prose)}}
    return block, Want(role, OTHER, None, compact_json(block))


@st.composite
def anthropic_item(draw) -> Item:
    role = draw(st.sampled_from(["user", "assistant", "user", "system"]))
    if draw(st.booleans()):
        t = draw(prose)
        return Item(_with(draw, {"role": role, "content": t}), [Want(role, TEXT, ("content",), t)])
    n = draw(st.integers(0, 4))
    pairs = [draw(anthropic_block(role, j)) for j in range(n)]
    obj = _with(draw, {"role": role, "content": [p[0] for p in pairs]})
    return Item(obj, [p[1] for p in pairs])


# Chat Completions -----------------------------------------------------------------------------


def _data_url(data: str) -> str:
    return "data:image/png;base64," + data


@st.composite
def chat_text_parts(draw, role: str, *, images: bool) -> tuple[list, list[Want]]:
    parts, wants = [], []
    for j in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["text", "text", "image_url", "input_audio"] if images else ["text"]))
        if kind == "text":
            t = draw(prose)
            parts.append(_with(draw, {"type": "text", "text": t}, cache=True))
            wants.append(Want(role, TEXT, ("content", j, "text"), t))
        elif kind == "image_url":
            url = draw(st.one_of(b64.map(_data_url), ident.map(lambda s: "https://img.example/" + s)))
            iu = draw(st.sampled_from([{"url": url}, {"url": url, "detail": "high"}]))
            parts.append({"type": "image_url", "image_url": iu})
            wants.append(Want(role, IMAGE, None, "[image]"))
        else:
            part = {"type": "input_audio", "input_audio": {"data": draw(b64), "format": "wav"}}
            parts.append(part)
            wants.append(Want(role, OTHER, None, compact_json(part)))
    return parts, wants


@st.composite
def chat_content(draw, role: str, *, images: bool = True) -> tuple[Any, list[Want]]:
    if draw(st.booleans()):
        t = draw(prose)
        return t, [Want(role, TEXT, ("content",), t)]
    return draw(chat_text_parts(role, images=images))


@st.composite
def chat_item(draw) -> Item:
    role = draw(st.sampled_from(["system", "developer", "user", "user", "user", "assistant", "assistant", "tool"]))
    if role in ("system", "developer"):
        content, wants = draw(chat_content("system", images=False))
        return Item(_with(draw, {"role": role, "content": content}), wants, system=True)
    if role == "user":
        content, wants = draw(chat_content("user"))
        return Item(_with(draw, {"role": "user", "content": content}), wants)
    if role == "tool":
        out = draw(prose)
        obj = {"role": "tool", "tool_call_id": "call_" + draw(ident), "content": out}
        if draw(st.booleans()):
            obj["name"] = draw(ident)  # hermes sends it sometimes; never part of identity
        return Item(_with(draw, obj), [Want("tool", TOOL_RESULT, None, out)])
    obj: dict = {"role": "assistant"}
    wants: list[Want] = []
    reasoning = draw(st.one_of(st.none(), prose))
    if reasoning is not None:
        obj["reasoning_content"] = reasoning
        if reasoning:
            wants.append(Want("assistant", REASONING, None, reasoning))
    calls = []
    for _ in range(draw(st.integers(0, 2))):
        args = draw(st.one_of(st.dictionaries(ident, json_values, max_size=2).map(json.dumps), st.just("{}"), prose))
        calls.append({"id": "call_" + draw(ident), "type": "function", "function": {"name": draw(ident), "arguments": args}})
    kind = draw(st.sampled_from(["string", "parts", "null", "empty"]))
    if kind == "null":
        obj["content"] = None
    elif kind == "empty":
        obj["content"] = ""
        if not calls and not wants:
            wants.append(Want("assistant", TEXT, ("content",), ""))
    else:
        content, cw = draw(chat_content("assistant", images=False)) if kind == "string" else (
            draw(chat_text_parts("assistant", images=False))
        )
        obj["content"] = content
        if content == "" and (calls or wants):
            cw = []  # "" beside a tool call or reasoning means "no text"
        wants.extend(cw)
    if calls:
        obj["tool_calls"] = calls
        wants.extend(Want("assistant", TOOL_CALL, None, c["function"]["arguments"]) for c in calls)
    return Item(_with(draw, obj), wants)


# Responses ------------------------------------------------------------------------------------

_RESP_ROLE = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@st.composite
def responses_item(draw) -> Item:
    kind = draw(st.sampled_from([
        "message", "message", "message", "message", "message", "function_call", "function_call_output", "reasoning",
        "custom_tool_call", "custom_tool_call_output", "web_search_call", "item_reference",
    ]))
    vid = draw(st.one_of(st.none(), ident))  # a volatile provider id, sometimes absent
    if kind == "message":
        wire_role = draw(st.sampled_from(["user", "user", "user", "assistant", "assistant", "system", "developer"]))
        role = _RESP_ROLE[wire_role]
        if draw(st.booleans()):
            t = draw(prose)
            content, wants = t, [Want(role, TEXT, ("content",), t)]
        else:
            content, wants = [], []
            for j in range(draw(st.integers(0, 3))):
                pk = draw(st.sampled_from(["text", "text", "input_image", "file_image", "refusal", "input_file"]))
                if pk == "text":
                    t = draw(prose)
                    ptype = "output_text" if wire_role == "assistant" else "input_text"
                    part = {"type": ptype, "text": t}
                    if ptype == "output_text" and draw(st.booleans()):
                        part["annotations"] = []
                    content.append(part)
                    wants.append(Want(role, TEXT, ("content", j, "text"), t))
                elif pk == "input_image":
                    content.append({"type": "input_image", "image_url": _data_url(draw(b64)), "detail": "auto"})
                    wants.append(Want(role, IMAGE, None, "[image]"))
                elif pk == "file_image":
                    content.append({"type": "input_image", "file_id": "file-" + draw(ident)})
                    wants.append(Want(role, IMAGE, None, "[image]"))
                elif pk == "refusal":
                    t = draw(prose)
                    content.append({"type": "refusal", "refusal": t})
                    wants.append(Want(role, TEXT, None, t))
                else:
                    part = {"type": "input_file", "file_id": "file-" + draw(ident)}
                    content.append(part)
                    wants.append(Want(role, OTHER, None, compact_json(part)))
        obj: dict = {"role": wire_role, "content": content}
        if draw(st.booleans()):
            obj["type"] = "message"
            if vid:
                obj["id"] = "msg_" + vid
            if wire_role == "assistant" and draw(st.booleans()):
                obj["status"] = "completed"
        return Item(_with(draw, obj), wants, system=wire_role in ("system", "developer"))
    call_id = "call_" + draw(ident)
    if kind in ("function_call", "custom_tool_call"):
        payload = draw(st.one_of(st.dictionaries(ident, json_values, max_size=2).map(json.dumps), prose))
        key = "arguments" if kind == "function_call" else "input"
        obj = {"type": kind, "call_id": call_id, "name": draw(ident), key: payload}
        if vid:
            obj["id"] = "fc_" + vid
        return Item(_with(draw, obj), [Want("assistant", TOOL_CALL, None, payload)])
    if kind.endswith("_output"):
        if draw(st.booleans()):
            output = draw(prose)
            text = output
        else:
            texts = draw(st.lists(prose, max_size=3))
            output = [{"type": "input_text", "text": t} for t in texts]
            text = "\n".join(texts)
        obj = {"type": kind, "call_id": call_id, "output": output}
        return Item(_with(draw, obj), [Want("tool", TOOL_RESULT, None, text)])
    if kind == "reasoning":
        summary = draw(st.lists(prose, max_size=2))
        content = draw(st.one_of(st.none(), st.lists(prose, max_size=2)))
        obj = {"type": "reasoning", "summary": [{"type": "summary_text", "text": s} for s in summary]}
        if content is not None:
            obj["content"] = [{"type": "reasoning_text", "text": s} for s in content]
        obj["encrypted_content"] = draw(b64)
        if vid:
            obj["id"] = "rs_" + vid
        if content:
            text = "\n".join(content)
        elif summary:
            text = "\n".join(summary)
        else:
            text = obj["id"] if vid else None  # the whole-item fallback is checked loosely
        return Item(_with(draw, obj), [Want("assistant", REASONING, None, text)])
    if kind == "web_search_call":
        obj = {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": draw(prose)}}
        if vid:
            obj["id"] = "ws_" + vid
        return Item(_with(draw, obj), [Want("assistant", OTHER, None, None)])
    obj = {"type": "item_reference", "id": "msg_" + (vid or "x")}
    return Item(obj, [Want("user", OTHER, None, compact_json(obj))])


# Gemini ---------------------------------------------------------------------------------------


@st.composite
def gemini_item(draw) -> Item:
    wire_role = draw(st.sampled_from(["user", "model"]))
    role = "assistant" if wire_role == "model" else "user"
    parts, wants = [], []
    for j in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "text", "text", "thought", "call", "response", "inline", "file", "code"]))
        if kind == "text":
            t = draw(prose)
            part = {"text": t}
            if draw(st.booleans()):
                part["thoughtSignature"] = draw(b64)
            parts.append(part)
            wants.append(Want(role, TEXT, ("parts", j, "text"), t))
        elif kind == "thought":
            t = draw(prose)
            parts.append({"text": t, "thought": True, "thoughtSignature": draw(b64)})
            wants.append(Want("assistant", REASONING, None, t))
        elif kind == "call":
            args = draw(st.dictionaries(ident, json_values, max_size=3))
            call = {"name": draw(ident), "args": args}
            if draw(st.booleans()):
                call["id"] = draw(ident)
            part = {"functionCall": call}
            if draw(st.booleans()):
                part["thoughtSignature"] = draw(b64)
            parts.append(part)
            wants.append(Want("assistant", TOOL_CALL, None, compact_json(args)))
        elif kind == "response":
            resp = draw(st.dictionaries(ident, json_values, max_size=3))
            parts.append({"functionResponse": {"name": draw(ident), "response": resp}})
            wants.append(Want("tool", TOOL_RESULT, None, compact_json(resp)))
        elif kind == "inline":
            parts.append({"inlineData": {"mimeType": "image/png", "data": draw(b64)}})
            wants.append(Want(role, IMAGE, None, "[image]"))
        elif kind == "file":
            parts.append({"fileData": {"mimeType": "image/png", "fileUri": "gs://b/" + draw(ident)}})
            wants.append(Want(role, IMAGE, None, "[image]"))
        else:
            part = {"executableCode": {"language": "PYTHON", "code": draw(prose)}}
            parts.append(part)
            wants.append(Want(role, OTHER, None, compact_json(part)))
    return Item(_with(draw, {"role": wire_role, "parts": parts}), wants)


ITEMS = {"anthropic": anthropic_item, "chat": chat_item, "responses": responses_item, "gemini": gemini_item}
_TOP = {
    "anthropic": {"model": "claude-x", "max_tokens": 1024, "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]},
    "chat": {"model": "gpt-x", "stream": True, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "responses": {"model": "gpt-x", "instructions": "be brief", "store": False, "include": ["reasoning.encrypted_content"]},
    "gemini": {"systemInstruction": {"parts": [{"text": "sys"}]}, "generationConfig": {"temperature": 0.2}},
}


def _dump(draw, value: Any) -> bytes:
    """JSON text in one of several client styles (compact, spaced, ASCII-escaped, indented)."""
    style = draw(st.sampled_from(["compact", "spaced", "ascii", "indent"]))
    if style == "compact":
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    if style == "spaced":
        return json.dumps(value, ensure_ascii=False).encode()
    if style == "ascii":
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False, indent=1).encode()


@st.composite
def bodies(draw, lane_name: str) -> GenBody:
    """A whole request body: compact top level (as the kernel re-emits it), items in mixed styles."""
    lane = LANES[lane_name]
    items = draw(st.lists(ITEMS[lane_name](), min_size=1, max_size=7))
    top = dict(_TOP[lane_name])
    for k, v in draw(extras()).items():
        top.setdefault(k, v)
    fields = [(k, _dump(draw, v)) for k, v in top.items()]
    conv = b"[" + b",".join(_dump(draw, it.obj) for it in items) + b"]"
    fields.insert(draw(st.integers(0, len(fields))), (lane.conv_key, conv))
    raw = b"{" + b",".join(json.dumps(k).encode() + b":" + v for k, v in fields) + b"}"
    return GenBody(lane, raw, items)


def oracle_tagged(gen: GenBody) -> dict[int, dict[tuple, Expect]]:
    """What the kernel must write at each prose path, from the generator's own expectations."""
    start = 0
    while start < len(gen.items) and gen.items[start].system:
        start += 1
    last = len(gen.items) - 1
    out: dict[int, dict[tuple, Expect]] = {}
    for i in range(start, len(gen.items)):
        for w in gen.items[i].wants:
            if w.ctype != TEXT or w.path is None:
                continue
            want = expected_text(w.role, w.text, prefill=i == last and w.role == "assistant")
            if want is not None:
                out.setdefault(i, {})[w.path] = want
    return out
