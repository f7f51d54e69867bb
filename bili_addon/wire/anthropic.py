"""Anthropic Messages (``/v1/messages``): ``messages[]`` items with string or block-array content."""

from __future__ import annotations

from typing import Any, Union

import msgspec
from msgspec.structs import astuple

from bili_addon.wire.base import (
    by_item,
    DELETE,
    IMAGE,
    OTHER,
    REASONING,
    TEXT,
    TOOL_CALL,
    TOOL_RESULT,
    Body,
    Core,
    LaneDefaults,
    Memo,
    append_part,
    append_to_text_value,
    append_tools,
    compact_json,
    decode_any,
    encode,
    memo_prompt,
    memo_tool_names,
    memo_tools,
    patch_many,
    tool_names,
)
from bili_addon.wire.media import payload_of_source


_NAMES = Memo()  # tools bytes -> their names (base.memo_tool_names)
_TOOLS = Memo()  # the tools half of inject: what it read -> what it wrote (base.memo_tools)
_PROMPT = Memo()  # the prompt half (base.memo_prompt)


class AnthropicLane(LaneDefaults):
    name = "anthropic"
    conv_key = "messages"

    @staticmethod
    def is_system_item(obj: Any) -> bool:
        # Anthropic keeps its system prompt in the top-level ``system``; ``role: "system"`` entries
        # inside ``messages[]`` (Claude Code's mid-conversation system) are conversation content.
        return False

    @staticmethod
    def item_cores(obj: Any) -> list[Core]:
        if not isinstance(obj, dict):
            return [Core("user", OTHER, compact_json(obj))]
        role = obj.get("role") if isinstance(obj.get("role"), str) else "user"
        content = obj.get("content")
        if isinstance(content, str):
            return [Core(role, TEXT, content, path=("content",))]
        if not isinstance(content, list):
            return [Core(role, OTHER, compact_json(content))]
        out: list[Core] = []
        add = out.append
        for j, block in enumerate(content):
            # the two commonest blocks read here, as _block_core reads them (it runs for every part)
            if type(block) is dict:
                kind = block.get("type")
                if kind == "text":
                    text = block.get("text")
                    if isinstance(text, str):
                        add(Core(role, TEXT, text, path=("content", j, "text")))
                        continue
                elif kind == "tool_result":
                    text, media = _result_text(block.get("content"))
                    add(Core("tool", TOOL_RESULT, text, tool_call_id=str(block.get("tool_use_id") or ""), media=media))
                    continue
            add(_block_core(role, j, block))
        return out

    @staticmethod
    def array_cores(array: Any, flat: bool = False) -> tuple[list, ...] | None:
        """:meth:`item_cores` of every item of the conversation array ``array`` (its raw bytes),
        decoded in one call into typed structs (:class:`_Msg`) instead of dicts: a conversation's
        first pass reads every item.  ``(cores of each item, the structs)`` (the structs are for
        :meth:`patch_typed`); None when an item or block has a shape those structs do not hold
        (another block type, a field of another type): the caller reads the items one by one with
        :meth:`item_cores`, which gives the same cores for the shapes held here.  ``flat``:
        ``(the cores of every item in one list, where each item's cores end in it, the structs)``
        instead (ItemCache.get_many: no list per item to make and join again)."""
        return by_item(_flat_cores(array), flat)

    @staticmethod
    def patch_typed(raw: bytes, msg: Any, edits: list) -> bytes | None:
        return patch_typed(raw, msg, edits)

    @staticmethod
    def tag_typed(raw: bytes, msg: Any, path: tuple, tag: bytes, text: str) -> bytes | None:
        """What :meth:`patch_typed` makes of ``raw`` with one edit, the text at ``path`` (which
        is ``text``) with a tag put before it (``tag``: the tag's JSON-escaped bytes), made
        without the new text or a second encode: ``raw`` with ``tag`` put where the text starts
        in it.  When ``raw`` is exactly ``msg``'s encoding, the text's escaped bytes are in it as
        they are in the new encoding, after the same bytes (escaping is per character: the
        tag's bytes then the text's are the new text's); where they start is known when ``raw``
        starts with the message's role and then the string content, or a first block that is
        the text (its ``type`` then its ``text``), or when only blocks of scalar values precede
        the text block (:func:`_tag_typed_rare`).  None otherwise (the caller patches the item
        the general way)."""
        role = msg.role
        heads = _HEADS.get(role) if type(role) is str else None
        head = heads.get(path) if heads is not None else None
        if head is None:
            return _tag_typed_rare(raw, msg, path, tag, text)
        if raw.startswith(head) and _enc_msg.encode(msg) == raw:
            now = msg.content if len(path) == 1 else msg.content[0].text  # (its encoding's head: there)
            if now is text or now == text:
                return head + tag + raw[len(head):]  # (``raw`` starts with ``head``)
        return None

    # -- folding and proxy tools ---------------------------------------------------------------
    @staticmethod
    def summary_item(text: str) -> bytes:
        return encode({"role": "user", "content": [{"type": "text", "text": text}]})

    @staticmethod
    def note_in_item(raw: bytes, text: str) -> bytes | None:
        """Prose after the tool results of a user turn, the way the agents add their own reminders."""
        return append_part(raw, "content", {"type": "text", "text": text})

    @staticmethod
    def tool_names(body: Body) -> list[str] | None:
        """Names of the request's tools: the names read before when the tools are those bytes again."""
        return memo_tool_names(_NAMES, body.top.get("tools"), lambda: AnthropicLane._tool_names(body))

    @staticmethod
    def _tool_names(body: Body) -> list[str] | None:
        raw = body.top.get("tools")
        if raw is not None and bytes(raw)[:1] == b"[":
            try:  # the names alone read (descriptions and schemas skipped, not made into dicts)
                return [t.name for t in _dec_named.decode(raw) if isinstance(t.name, str)]
            except msgspec.ValidationError:
                pass  # a tool that is no object: read as the general reader does
        return tool_names(raw, lambda t: t.get("name") if isinstance(t, dict)
                          and isinstance(t.get("name"), str) else None)  # a name that is no string names nothing

    @staticmethod
    def inject(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
               names: list[str]) -> bool:
        """Bili's tools after the agent's, the prompt after its system (none: the prompt is the system): each half (:meth:`_inject_tools`, :meth:`_inject_prompt`)
        replayed when its inputs are the ones it saw before (wire.base.memo_tools, memo_prompt)."""
        if not names:
            return False
        changed = memo_tools(_TOOLS, body, tools, names, lambda: AnthropicLane._inject_tools(body, tools, names))
        return memo_prompt(_PROMPT, body, items, start, prompt, (body.top.get("system"),),
                           lambda: AnthropicLane._inject_prompt(body, prompt)) or changed

    @staticmethod
    def _inject_tools(body: Body, tools: list[dict], names: list[str]) -> bool:
        shaped = [{"_name": t["name"], "name": t["name"], "description": t["description"],
                   "input_schema": t["parameters"]} for t in tools]
        return append_tools(body, "tools", names, shaped) if tools else False

    @staticmethod
    def _inject_prompt(body: Body, prompt: str) -> bool:
        system = body.top.get("system")
        if system is None:
            body.set("system", prompt)
            return True
        new = append_to_text_value(system, prompt, {"type": "text", "text": prompt})
        if new is not None:
            body.top["system"] = new
            return True
        return False

    @staticmethod
    def transplant_hints(row: bytes, client: bytes) -> bytes:
        """A stored rendering of a message with the agent's *current* ``cache_control`` breakpoints
        (the agent moves them every turn; old ones must not pile up past the provider's limit)."""
        if b'"cache_control"' not in row and b'"cache_control"' not in client:
            return row
        now = {j: b["cache_control"] for j, b in enumerate(_blocks(decode_any(client))) if "cache_control" in b}
        blocks = _blocks(decode_any(row))
        edits = []
        for j, block in enumerate(blocks):
            if j in now:
                if block.get("cache_control") != now[j]:
                    edits.append((("content", j, "cache_control"), now[j]))
            elif "cache_control" in block:
                edits.append((("content", j, "cache_control"), DELETE))
        return patch_many(row, edits) if edits else row

    @staticmethod
    def result_edits(obj: Any, call_id: str, text: str, nth: int | None = None, keep_error: bool = False) -> list:
        """The result of call ``call_id`` made ``text``: a proxy call's real result in place of the
        agent's "unknown tool" error (its ``is_error`` goes), or (``keep_error``) the agent's own
        output cut short, which stays the error it was."""
        edits: list = []
        for j, block in enumerate(_blocks(obj)):
            if block.get("type") == "tool_result" and block.get("tool_use_id") == call_id:
                if block.get("content") != text:
                    edits.append((("content", j, "content"), text))
                if "is_error" in block and not keep_error:
                    edits.append((("content", j, "is_error"), DELETE))
        return edits

    @staticmethod
    def call_edits(obj: Any, call_id: str, name: str, args: str) -> list:
        """Restore a call the agent altered (renamed, re-serialised) to the model's own form."""
        args = _parse_args(args)
        edits: list = []
        for j, block in enumerate(_blocks(obj)):
            if block.get("type") == "tool_use" and block.get("id") == call_id:
                if block.get("name") != name:
                    edits.append((("content", j, "name"), name))
                if block.get("input") != args:
                    edits.append((("content", j, "input"), args))
        return edits


def _parse_args(args: str) -> Any:
    try:
        return decode_any(args)
    except ValueError:
        return {}


def _blocks(obj: Any) -> list[dict]:
    content = obj.get("content") if isinstance(obj, dict) else None
    if not isinstance(content, list):
        return []
    return [b if isinstance(b, dict) else {} for b in content]


def _block_core(role: str, j: int, block: Any) -> Core:
    if not isinstance(block, dict):
        return Core(role, OTHER, compact_json(block))
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return Core(role, TEXT, block["text"], path=("content", j, "text"))
    if kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
        args = block.get("input")
        return Core(
            "assistant",
            TOOL_CALL,
            compact_json({} if args is None else args),
            tool_name=str(block.get("name") or ""),
            tool_call_id=str(block.get("id") or ""),
        )
    if kind == "tool_result" or (isinstance(kind, str) and kind.endswith("_tool_result")):
        text, media = _result_text(block.get("content"))
        return Core(
            "tool",
            TOOL_RESULT,
            text,
            tool_call_id=str(block.get("tool_use_id") or ""),
            media=media,
        )
    if kind == "thinking":
        return Core("assistant", REASONING, str(block.get("thinking") or ""))
    if kind == "redacted_thinking":
        return Core("assistant", REASONING, str(block.get("data") or ""))
    if kind == "image":
        return Core(role, IMAGE, "[image]", media=payload_of_source(block.get("source")))
    return Core(role, OTHER, compact_json(block))


def _result_text(content: Any) -> tuple[str, str]:
    """Text of a tool result (parts joined by newlines) and the payload slot of any images in it."""
    if content is None:
        return "", ""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return compact_json(content), ""
    texts: list[str] = []
    media: list[str] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text") or ""))
        elif isinstance(part, dict) and part.get("type") == "image":
            texts.append("[image]")
            media.append(payload_of_source(part.get("source")))
        else:
            texts.append(compact_json(part))
    return "\n".join(texts), ",".join(media)


# The commonest shapes of a message, as typed structs (AnthropicLane.array_cores): each reads what
# item_cores/_block_core read of its kind, a field of another type fails the decode (the caller
# then reads the item as a dict), other keys are skipped.  The keys agents send are fields, in the
# order they send them, absent ones UNSET: such a struct encodes back to its item's exact bytes when
# those are msgspec's compact JSON, which is what lets patch_typed prove it (anything the struct
# skipped or reordered makes that comparison fail).
_UNSET = msgspec.UNSET


class _Text(msgspec.Struct, tag_field="type", tag="text", gc=False):
    text: str
    cache_control: Any = _UNSET


class _ToolUse(msgspec.Struct, tag_field="type", tag="tool_use", gc=False):
    id: Any = _UNSET
    name: Any = _UNSET
    input: Any = _UNSET
    cache_control: Any = _UNSET


class _ToolResult(msgspec.Struct, tag_field="type", tag="tool_result", gc=False):
    tool_use_id: Any = _UNSET
    content: Any = _UNSET
    is_error: Any = _UNSET
    cache_control: Any = _UNSET


class _Thinking(msgspec.Struct, tag_field="type", tag="thinking", gc=False):
    thinking: Any = _UNSET
    signature: Any = _UNSET


class _Redacted(msgspec.Struct, tag_field="type", tag="redacted_thinking", gc=False):
    data: Any = _UNSET


class _Image(msgspec.Struct, tag_field="type", tag="image", gc=False):
    source: Any = _UNSET
    cache_control: Any = _UNSET


class _Msg(msgspec.Struct, gc=False):
    role: Any = _UNSET
    content: Union[str, list[Union[_Text, _ToolUse, _ToolResult, _Thinking, _Redacted, _Image]], None, msgspec.UnsetType] = _UNSET


_dec_msgs = msgspec.json.Decoder(list[_Msg])
_enc_msg = msgspec.json.Encoder()
# the paths of text blocks, one tuple each shared by every core at that index (array_cores)
_CONTENT_PATH = ("content",)
_N_PATHS = 64
_TEXT_PATHS = [("content", j, "text") for j in range(_N_PATHS)]


def _flat_cores(array: Any) -> tuple[list[Core], list[int], list[_Msg]] | None:
    """AnthropicLane.array_cores, flat: the cores of all the items in one list (one loop over
    every block of every item, one step per item to note where its cores end)."""
    try:
        msgs = _dec_msgs.decode(array)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    cores: list[Core] = []
    add = cores.append
    ends: list[int] = []
    end = ends.append
    unset = _UNSET
    paths, encode_json = _TEXT_PATHS, _enc_msg.encode
    for m in msgs:
        role = m.role
        if type(role) is not str:
            role = "user"
        content = m.content
        if type(content) is str:
            add(Core(role, TEXT, content, "", "", "", 0, _CONTENT_PATH))
        elif content is None or content is unset:  # (as item_cores reads a missing or null content)
            add(Core(role, OTHER, "null"))
        else:
            j = 0
            for b in content:
                t = type(b)
                if t is _Text:
                    add(Core(role, TEXT, b.text, "", "", "", 0, paths[j] if j < _N_PATHS else ("content", j, "text")))
                elif t is _ToolResult:
                    c, tid = b.content, b.tool_use_id
                    if type(tid) is not str:
                        tid = str(tid or "")
                    if type(c) is str:
                        add(Core("tool", TOOL_RESULT, c, "", tid))
                    else:
                        text, media = _result_text(None if c is unset else c)
                        add(Core("tool", TOOL_RESULT, text, "", tid, media))
                elif t is _ToolUse:
                    args, name, cid = b.input, b.name, b.id
                    if type(name) is not str:
                        name = str(name or "")
                    if type(cid) is not str:
                        cid = str(cid or "")
                    add(Core("assistant", TOOL_CALL, encode_json({} if args is None or args is unset else args).decode(),
                             name, cid))
                elif t is _Thinking:
                    add(Core("assistant", REASONING, str(b.thinking or "")))
                elif t is _Redacted:
                    add(Core("assistant", REASONING, str(b.data or "")))
                else:  # _Image
                    add(Core(role, IMAGE, "[image]", media=payload_of_source(None if b.source is unset else b.source)))
                j += 1
        end(len(cores))
    return cores, ends, msgs


def patch_typed(raw: bytes, msg: _Msg, edits: list) -> bytes | None:
    """What wire.base.patch_many makes of ``raw`` with ``edits`` (new prose at a text path),
    computed from ``msg``, the struct array_cores read ``raw`` into (changed in place), when ``raw``
    is exactly its encoding: then it is msgspec's compact JSON of the item (the struct holds every
    key, in order), and re-encoding the struct with the new values is what patching re-encodes.
    None otherwise (the caller patches the bytes)."""
    if _enc_msg.encode(msg) != raw:
        return None
    content = msg.content
    for path, value in edits:
        if type(value) is not str:
            return None
        if len(path) == 1 and path[0] == "content" and type(content) is str:
            msg.content = content = value
        elif (len(path) == 3 and path[0] == "content" and path[2] == "text" and type(content) is list
              and type(path[1]) is int and 0 <= path[1] < len(content) and type(content[path[1]]) is _Text):
            content[path[1]].text = value
        else:
            return None
    return _enc_msg.encode(msg)


def _heads(head: bytes) -> dict[tuple, bytes]:
    """The bytes an item's encoding starts with up to the text of its string content and up to
    the text of its first block, by their paths (``head``: up to the ``content`` value)."""
    return {("content",): head + b'"', ("content", 0, "text"): head + b"[" + _TEXT_BLOCK}


def _tag_typed_rare(raw: bytes, msg: _Msg, path: tuple, tag: bytes, text: str) -> bytes | None:
    """AnthropicLane.tag_typed's other cases: a role not seen yet, no role, a text block after
    others."""
    role, content = msg.role, msg.content
    if type(role) is str:
        if role not in _HEADS:
            if len(_HEADS) >= 64:
                return None
            _HEADS[role] = _heads(b'{"role":' + _enc_msg.encode(role) + b',"content":')
            return AnthropicLane.tag_typed(raw, msg, path, tag, text)
        head = _HEADS[role][("content",)][:-1]
    elif role is _UNSET:
        head = _NO_ROLE[("content",)][:-1]
        if path in _NO_ROLE:
            if not raw.startswith(_NO_ROLE[path]) or _enc_msg.encode(msg) != raw:
                return None
            if (content if len(path) == 1 else content[0].text) != text:  # (its encoding's head: there)
                return None
            n = len(_NO_ROLE[path])
            return raw[:n] + tag + raw[n:]
    else:
        return None
    if not (len(path) == 3 and path[0] == "content" and path[2] == "text" and type(content) is list):
        return None
    j = path[1]
    if type(j) is not int or not 0 < j < len(content) or type(content[j]) is not _Text or content[j].text != text:
        return None
    for block in content[:j]:  # their encodings hold no ``{"`` but where each starts
        if type(block) is _Text or not _SCALARS.issuperset(map(type, astuple(block))):
            return None
    head += b"["
    if not raw.startswith(head) or _enc_msg.encode(msg) != raw:
        return None
    # the first text block's start is the j-th block's (neither the head nor an encoded string holds
    # one): the tag put after it, ``raw`` copied once (a tool result before it is most of its bytes)
    out = raw.replace(_TEXT_BLOCK, _TEXT_BLOCK + tag, 1)
    return out if len(out) > len(raw) else None  # (not found: nothing put in; a tag is never empty)


_TEXT_BLOCK = b'{"type":"text","text":"'
_HEADS: dict[str, dict[tuple, bytes]] = {}  # by role
_NO_ROLE = _heads(b'{"content":')
_SCALARS = frozenset((str, int, float, bool, type(None), msgspec.UnsetType))


class _Named(msgspec.Struct, gc=False):
    """A tool as :meth:`AnthropicLane.tool_names` reads it: its name (any value; a string names it)."""

    name: Any = None


_dec_named = msgspec.json.Decoder(list[_Named])
