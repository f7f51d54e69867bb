"""OpenAI Chat Completions (``/chat/completions``): ``messages[]`` items with string or part-array content."""

from __future__ import annotations

from typing import Any

import msgspec

from bili_addon.wire.base import (
    by_item,
    IMAGE,
    OTHER,
    REASONING,
    TEXT,
    TOOL_CALL,
    TOOL_RESULT,
    Body,
    CodecError,
    Core,
    LaneDefaults,
    Memo,
    append_to_text_value,
    append_tools,
    compact_json,
    content_cores,
    decode_any,
    decode_list,
    decode_obj,
    encode,
    memo_prompt,
    memo_tool_names,
    memo_tools,
    tool_names,
)
from bili_addon.wire.media import payload_of_url

_SYSTEM_ROLES = ("system", "developer")


_NAMES = Memo()  # tools bytes -> their names (base.memo_tool_names)
_TOOLS = Memo()  # the tools half of inject: what it read -> what it wrote (base.memo_tools)
_PROMPT = Memo()  # the prompt half (base.memo_prompt)


class ChatLane(LaneDefaults):
    name = "chat"
    conv_key = "messages"

    @staticmethod
    def is_system_item(obj: Any) -> bool:
        return isinstance(obj, dict) and obj.get("role") in _SYSTEM_ROLES

    @staticmethod
    def item_cores(obj: Any) -> list[Core]:
        if not isinstance(obj, dict):
            return [Core("user", OTHER, compact_json(obj))]
        role = obj.get("role")
        if role == "user":
            return content_cores("user", obj.get("content"), _part_core)
        if role in _SYSTEM_ROLES:
            return content_cores("system", obj.get("content"), _part_core)
        if role == "assistant":
            return _assistant_cores(obj)
        if role == "tool":
            return [Core("tool", TOOL_RESULT, _result_text(obj.get("content")), tool_call_id=_str(obj.get("tool_call_id")))]
        if role == "function":  # legacy function-calling result
            return [Core("tool", TOOL_RESULT, _result_text(obj.get("content")), tool_name=_str(obj.get("name")))]
        return [Core("user", OTHER, compact_json(obj))]

    @staticmethod
    def array_cores(array: Any, flat: bool = False) -> tuple[list, ...] | None:
        """:meth:`item_cores` of every item of the conversation array ``array`` (its raw bytes),
        decoded in one call into typed structs (one per role, :data:`_ChatMsg`) instead of dicts,
        as Anthropic's lane does: ``(cores of each item, the structs, whether each is a system
        item)``.  The structs hold the plain shapes only (string or null content, function calls
        with their arguments as sent); any other key or type fails the decode, and the caller reads
        the items one by one with :meth:`item_cores`, which gives the same cores for these shapes.
        ``flat``: ``(the cores of every item in one list, where each item's cores end in it, the
        structs, whether each is a system item)`` instead (ItemCache.get_many)."""
        return by_item(_flat_cores(array), flat)

    @staticmethod
    def patch_typed(raw: bytes, msg: Any, edits: list) -> bytes | None:
        """What wire.base.patch_many makes of ``raw`` with ``edits`` (new prose of a string
        ``content``), computed from ``msg``, the struct array_cores read ``raw`` into (changed in
        place), when ``raw`` is exactly its encoding (msgspec's compact JSON: every key held, in
        order); None otherwise (the caller patches the bytes)."""
        if _enc_chat.encode(msg) != raw or type(msg.content) is not str:
            return None
        for path, value in edits:
            if type(value) is not str or len(path) != 1 or path[0] != "content":
                return None
            msg.content = value
        return _enc_chat.encode(msg)

    @staticmethod
    def tag_typed(raw: bytes, msg: Any, path: tuple, tag: bytes, text: str) -> bytes | None:
        """What :meth:`patch_typed` makes of ``raw`` with one edit, the string ``content`` (which
        is ``text``) with a tag put before it (``tag``: the tag's JSON-escaped bytes), made
        without the new text or a second encode: ``raw`` with ``tag`` put where the text starts
        in it.  When ``raw`` is exactly ``msg``'s encoding and starts with its role and then its
        content (the message's first field), the text's escaped bytes follow those, as they
        follow them in the new encoding after the tag's (escaping is per character).  None
        otherwise."""
        now = msg.content
        if type(now) is not str or not (path is _CONTENT_PATH or path == _CONTENT_PATH) or not (now is text or now == text):
            return None
        head = _CONTENT_HEADS.get(type(msg))
        if head is None:
            try:  # the message with its content alone, empty: up to its content's text
                probe = _enc_chat.encode(type(msg)(content=""))
            except (TypeError, ValueError):
                return None
            if not probe.endswith(b',"content":""}'):
                return None
            head = _CONTENT_HEADS[type(msg)] = probe[:-2]
        if not raw.startswith(head) or _enc_chat.encode(msg) != raw:
            return None
        return head + tag + raw[len(head):]  # (``raw`` starts with ``head``)

    # -- folding and proxy tools ---------------------------------------------------------------
    @staticmethod
    def summary_item(text: str) -> bytes:
        return encode({"role": "user", "content": text})

    @staticmethod
    def join_user(raw: bytes, text: str, *, before: bool) -> bytes | None:
        """Strict providers refuse two user messages in a row (DeepSeek: "does not support
        successive user or assistant messages") and some take only string content: a summary
        joins its user neighbour, as text with a blank line (or a text part of its own)."""
        try:
            obj = decode_obj(raw)
        except (CodecError, msgspec.DecodeError):
            return None
        if obj.get("role") is None or decode_any(obj["role"]) != "user" or "content" not in obj:
            return None
        head = bytes(obj["content"])[:1]
        if head == b'"':
            content = decode_any(obj["content"])
            joined: Any = text + "\n\n" + content if before else content + "\n\n" + text
        elif head == b"[":
            part = msgspec.Raw(encode({"type": "text", "text": text}))
            parts = decode_list(obj["content"])  # the other parts stay byte-exact
            joined = [part, *parts] if before else [*parts, part]
        else:
            return None
        obj["content"] = msgspec.Raw(encode(joined))
        return encode(obj)

    @staticmethod
    def tool_names(body: Body) -> list[str] | None:
        """Names of the request's tools: the names read before when the tools are those bytes again."""
        return memo_tool_names(_NAMES, body.top.get("tools"), lambda: ChatLane._tool_names(body))

    @staticmethod
    def _tool_names(body: Body) -> list[str] | None:
        raw = body.top.get("tools")
        if raw is not None and bytes(raw)[:1] == b"[":
            try:  # the names alone read (descriptions and schemas skipped, not made into dicts)
                return [t.function.name for t in _dec_named.decode(raw)
                        if t.function is not None and isinstance(t.function.name, str)]
            except msgspec.ValidationError:
                pass  # a tool (or its function) that is no object: read as the general reader does

        def name_of(t: Any) -> Any:
            fn = t.get("function") if isinstance(t, dict) else None
            return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None

        return tool_names(raw, name_of)

    @staticmethod
    def inject(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
               names: list[str]) -> bool:
        """Bili's tools after the agent's, the prompt at the end of its leading system message (or a
        system message of its own): each half (:meth:`_inject_tools`, :meth:`_inject_prompt`)
        replayed when its inputs are the ones it saw before (wire.base.memo_tools, memo_prompt)."""
        if not names:
            return False
        changed = memo_tools(_TOOLS, body, tools, names, lambda: ChatLane._inject_tools(body, tools, names))
        return memo_prompt(_PROMPT, body, items, start, prompt, (),
                           lambda: ChatLane._inject_prompt(items, start, prompt), reads_item=True,
                           inserts=True) or changed

    @staticmethod
    def _inject_tools(body: Body, tools: list[dict], names: list[str]) -> bool:
        shaped = [{"_name": t["name"], "type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["parameters"]}} for t in tools]
        return append_tools(body, "tools", names, shaped) if tools else False

    @staticmethod
    def _inject_prompt(items: list[bytes], start: int, prompt: str) -> bool:
        if start > 0:  # the agent's leading system message gets the prompt at its end
            obj = decode_obj(items[start - 1])  # the other parts keep their bytes
            raw = obj.get("content")
            new = append_to_text_value(raw, prompt, {"type": "text", "text": prompt}) if raw is not None else None
            if new is not None:
                obj["content"] = new
                items[start - 1] = encode(obj)
                return True
        items.insert(start, encode({"role": "system", "content": prompt}))
        return True

    @staticmethod
    def result_edits(obj: Any, call_id: str, text: str, nth: int | None = None, keep_error: bool = False) -> list:
        if isinstance(obj, dict) and obj.get("role") == "tool" and obj.get("tool_call_id") == call_id:
            return [] if obj.get("content") == text else [(("content",), text)]
        return []

    @staticmethod
    def call_edits(obj: Any, call_id: str, name: str, args: Any) -> list:
        calls = obj.get("tool_calls") if isinstance(obj, dict) else None
        edits: list = []
        for k, call in enumerate(calls if isinstance(calls, list) else []):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and call.get("id") == call_id:
                if fn.get("name") != name:
                    edits.append((("tool_calls", k, "function", "name"), name))
                if fn.get("arguments") != args:
                    edits.append((("tool_calls", k, "function", "arguments"), args))
        return edits


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""



def _part_core(role: str, j: int, part: Any) -> Core:
    if not isinstance(part, dict):
        return Core(role, OTHER, compact_json(part))
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return Core(role, TEXT, part["text"], path=("content", j, "text"))
    if kind == "image_url":
        return Core(role, IMAGE, "[image]", media=_image_slot(part.get("image_url")))
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return Core(role, TEXT, part["refusal"])  # the model's own refusal: identity only, never tagged
    return Core(role, OTHER, compact_json(part))


def _image_slot(image_url: Any) -> str:
    # ``{"url": ..., "detail": ...}``; some clients send the URL string directly
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    return payload_of_url(url) if isinstance(url, str) else ""


def _assistant_cores(obj: dict) -> list[Core]:
    out: list[Core] = []
    reasoning = obj.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = obj.get("reasoning")  # OpenRouter-style plain string
    if isinstance(reasoning, str) and reasoning:
        out.append(Core("assistant", REASONING, reasoning))

    calls = obj.get("tool_calls")
    legacy = obj.get("function_call")
    content = obj.get("content")
    # ``""`` and ``null`` both mean "no text" beside a tool call; clients differ in which they send
    if not (content == "" and (calls or legacy or out)):
        out.extend(content_cores("assistant", content, _part_core))
    refusal = obj.get("refusal")
    if isinstance(refusal, str) and refusal:
        out.append(Core("assistant", TEXT, refusal))

    if isinstance(calls, list):
        out.extend(_call_core(c) for c in calls)
    elif calls is not None:
        out.append(Core("assistant", OTHER, compact_json(calls)))
    if isinstance(legacy, dict):
        out.append(_function_core(legacy, ""))
    elif legacy is not None:
        out.append(Core("assistant", OTHER, compact_json(legacy)))
    return out


def _call_core(call: Any) -> Core:
    if not isinstance(call, dict):
        return Core("assistant", OTHER, compact_json(call))
    call_id = _str(call.get("id"))
    fn = call.get("function")
    if isinstance(fn, dict):
        return _function_core(fn, call_id)
    custom = call.get("custom")  # custom (free-form) tools: {"name", "input"}
    if isinstance(custom, dict):
        return Core("assistant", TOOL_CALL, _arg_text(custom.get("input")), tool_name=_str(custom.get("name")), tool_call_id=call_id)
    return Core("assistant", OTHER, compact_json(call))


def _function_core(fn: dict, call_id: str) -> Core:
    return Core("assistant", TOOL_CALL, _arg_text(fn.get("arguments")), tool_name=_str(fn.get("name")), tool_call_id=call_id)


def _arg_text(args: Any) -> str:
    """Arguments exactly as sent when they are a string (the usual case), else their compact JSON."""
    if isinstance(args, str):
        return args
    return "" if args is None else compact_json(args)


def _result_text(content: Any) -> str:
    """A tool message's output: a string as is, text parts joined by newlines, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return compact_json(content)
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            texts.append(compact_json(part))
    return "\n".join(texts)


# The plainest shapes of a message, as typed structs (ChatLane.array_cores), one per role (the
# ``role`` key, which agents write first, tags them): string or null content or an array of text
# and image parts (pi, omp), a tool call's function with its arguments as sent, a tool result's
# ``name`` (hermes).  Any other key fails the decode (forbid_unknown_fields: reasoning, refusal,
# names, other parts read item by item); the keys agents send are fields in the order they send
# them, absent ones UNSET, so a struct encodes back to its item's exact bytes when those are
# msgspec's compact JSON (what ChatLane.patch_typed checks).
_UNSET = msgspec.UNSET


class _TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True, gc=False):
    text: str
    cache_control: Any = _UNSET


class _ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True, gc=False):
    image_url: Any = _UNSET


_Text = str | None | msgspec.UnsetType
_Content = str | None | list[_TextPart | _ImagePart] | msgspec.UnsetType


class _Fn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    name: Any = _UNSET
    arguments: Any = _UNSET


class _Call(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: Any = _UNSET
    type: Any = _UNSET
    function: _Fn | msgspec.UnsetType = _UNSET  # (a call without one: array_cores reads nothing typed)


class _User(msgspec.Struct, tag_field="role", tag="user", forbid_unknown_fields=True, gc=False):
    content: _Content = _UNSET


class _System(msgspec.Struct, tag_field="role", tag="system", forbid_unknown_fields=True, gc=False):
    content: _Content = _UNSET


class _Developer(msgspec.Struct, tag_field="role", tag="developer", forbid_unknown_fields=True, gc=False):
    content: _Content = _UNSET


class _Assistant(msgspec.Struct, tag_field="role", tag="assistant", forbid_unknown_fields=True, gc=False):
    content: _Content = _UNSET
    tool_calls: list[_Call] | None | msgspec.UnsetType = _UNSET


class _Tool(msgspec.Struct, tag_field="role", tag="tool", forbid_unknown_fields=True, gc=False):
    tool_call_id: Any = _UNSET
    content: _Text = _UNSET
    name: Any = _UNSET  # (item_cores does not read it)


_N_PATHS = 64
_TEXT_PATHS = [("content", j, "text") for j in range(_N_PATHS)]  # one tuple per index, shared by every core


def _parts_cores(role: str, parts: list) -> list[Core]:
    """The cores of a typed content array, as content_cores reads its parts (_part_core)."""
    out = []
    for j, p in enumerate(parts):
        if type(p) is _TextPart:
            out.append(Core(role, TEXT, p.text, "", "", "", 0, _TEXT_PATHS[j] if j < _N_PATHS else ("content", j, "text")))
        else:
            out.append(Core(role, IMAGE, "[image]", media=_image_slot(None if p.image_url is _UNSET else p.image_url)))
    return out


_dec_chat = msgspec.json.Decoder(list[_User | _System | _Developer | _Assistant | _Tool])
_CONTENT_PATH = ("content",)  # the path of every string content array_cores reads (one tuple shared)
_CONTENT_HEADS: dict[type, bytes] = {}  # (ChatLane.tag_typed)
_enc_chat = msgspec.json.Encoder()


def _flat_cores(array: Any) -> tuple[list[Core], list[int], list, list[bool]] | None:
    """ChatLane.array_cores, flat: the cores of all the items in one list (one loop over every
    item, one step each to note where its cores end)."""
    try:
        msgs = _dec_chat.decode(array)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    cores: list[Core] = []
    add = cores.append
    ends: list[int] = []
    end = ends.append
    unset = _UNSET
    path = _CONTENT_PATH
    for m in msgs:
        t = type(m)
        content = m.content
        if t is _Tool:
            cid = m.tool_call_id
            add(Core("tool", TOOL_RESULT, "" if content is None or content is unset else content, "",
                     cid if type(cid) is str else ""))
        elif t is _Assistant:
            calls = m.tool_calls
            if type(content) is list:
                cores += _parts_cores("assistant", content)
            elif not (content is None or content is unset or (content == "" and calls)):
                add(Core("assistant", TEXT, content, "", "", "", 0, path))
            if calls is not unset and calls is not None:
                for c in calls:
                    fn = c.function
                    if fn is unset:
                        return None  # (item_cores reads such a call as other content)
                    args, name, cid = fn.arguments, fn.name, c.id
                    add(Core("assistant", TOOL_CALL, args if type(args) is str else _arg_text(
                        None if args is unset else args), name if type(name) is str else "",
                        cid if type(cid) is str else ""))
        else:
            role = "user" if t is _User else "system"
            if type(content) is list:
                cores += _parts_cores(role, content)
            elif not (content is None or content is unset):
                add(Core(role, TEXT, content, "", "", "", 0, path))
        end(len(cores))
    return cores, ends, msgs, [type(m) is _System or type(m) is _Developer for m in msgs]


class _NamedFn(msgspec.Struct, gc=False):
    name: Any = None


class _NamedTool(msgspec.Struct, gc=False):
    """A tool as :meth:`ChatLane.tool_names` reads it: its function's name (a string names it)."""

    function: _NamedFn | None = None


_dec_named = msgspec.json.Decoder(list[_NamedTool])
