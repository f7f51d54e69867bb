"""OpenAI Responses (``/responses``, also the Codex WebSocket ``response.create``): typed ``input[]`` items.

Provider item ids (``msg_``, ``rs_``, ``fc_`` ...) are never part of a core: clients drop or
regenerate them (``store: false``), and the same message must keep its identity.  Tool calls are
keyed by ``call_id``.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from bili_addon.wire.base import (
    by_item,
    IMAGE,
    OTHER,
    PROMPT_SEPARATOR,
    REASONING,
    TEXT,
    TOOL_CALL,
    TOOL_RESULT,
    Body,
    Core,
    LaneDefaults,
    Memo,
    append_tools,
    compact_json,
    content_cores,
    encode,
    memo_prompt,
    memo_tool_names,
    memo_tools,
    tool_names,
)
from bili_addon.wire.hygiene import PROXY_ID_PREFIX
from bili_addon.wire.media import payload_of_url

_SYSTEM_ROLES = ("system", "developer")
_MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# free-form tool calls: which field holds the call's payload
_CALL_PAYLOAD = ("arguments", "input", "action", "operation")


_NAMES = Memo()  # tools bytes -> their names (base.memo_tool_names)
_TOOLS = Memo()  # the tools half of inject: what it read -> what it wrote (base.memo_tools)
_PROMPT = Memo()  # the prompt half (base.memo_prompt)


class ResponsesLane(LaneDefaults):
    name = "responses"
    conv_key = "input"

    @staticmethod
    def is_system_item(obj: Any) -> bool:
        return _is_message(obj) and obj.get("role") in _SYSTEM_ROLES

    @staticmethod
    def item_cores(obj: Any) -> list[Core]:
        if not isinstance(obj, dict):
            return [Core("user", OTHER, compact_json(obj))]
        kind = obj.get("type")
        if _is_message(obj):
            role = _MESSAGE_ROLES.get(_str(obj.get("role")))  # a role that is no string is no message
            if role is None:
                return [Core("user", OTHER, _json_without_id(obj))]
            return content_cores(role, obj.get("content"), _part_core)
        if kind == "reasoning":
            return [Core("assistant", REASONING, _reasoning_text(obj))]
        if kind == "function_call":
            return [_call(obj, _str(obj.get("name")), obj.get("arguments"))]
        if kind == "custom_tool_call":
            return [_call(obj, _str(obj.get("name")), obj.get("input"))]
        if kind == "item_reference":
            return [Core("user", OTHER, compact_json(obj))]  # the id is all there is
        if isinstance(kind, str) and isinstance(obj.get("call_id"), str):
            if kind.endswith("_output") and "output" in obj:
                text, media = _output_text(obj["output"])
                return [Core("tool", TOOL_RESULT, text, tool_call_id=obj["call_id"], media=media)]
            if kind.endswith("_call"):
                for key in _CALL_PAYLOAD:
                    if key in obj:
                        # local_shell_call -> "local_shell", computer_call -> "computer", ...
                        return [_call(obj, _str(obj.get("name")) or kind[: -len("_call")], obj[key])]
        return [Core(_opaque_role(kind), OTHER, _json_without_id(obj))]

    @staticmethod
    def array_cores(array: Any, flat: bool = False) -> tuple[list, ...] | None:
        """:meth:`item_cores` (and :meth:`is_system_item`) of every item of the conversation array
        ``array`` (its raw bytes), decoded in one call into typed structs (:class:`_Item`) instead
        of dicts, as the Anthropic and Chat lanes do: ``(cores of each item, the structs, whether
        each is a system item)``.  Codex's commonest items only (a message of text parts or a
        string, reasoning with its text or id, a function or custom tool call, a tool output);
        None for any other item, part or field type (the caller reads the items one by one with
        :meth:`item_cores`, which gives the same cores for the shapes held here).  The structs
        hold only what the cores need: rendering patches such an item from its bytes
        (:meth:`patch_typed`).  ``flat``: ``(the cores of every item in one list, where each
        item's cores end in it, the structs, whether each is a system item)`` instead
        (ItemCache.get_many)."""
        return by_item(_flat_cores(array), flat)

    @staticmethod
    def patch_typed(raw: bytes, obj: Any, edits: list) -> bytes | None:
        """None: an :meth:`array_cores` struct holds only what the cores read, not the item (the
        caller patches the item from its bytes decoded, as for an item read one by one)."""
        return None

    @staticmethod
    def tag_typed(raw: bytes, obj: Any, path: tuple, tag: bytes, text: str) -> bytes | None:
        """What patching ``raw`` (wire.base.patch_many) makes of it with one edit, the text at
        ``path`` (which is ``text``) with a tag put before it (``tag``: the tag's JSON-escaped
        bytes), made without the new text or a re-encode: ``raw`` with ``tag`` put where the text
        starts in it.  Patching re-encodes the item's object, its ``content`` array and the
        text's part around values it keeps byte for byte; when those re-encode to what they are
        (written compactly, keys escaped as msgspec escapes them, none twice) and the text is
        written as msgspec writes it, the new bytes are the old with the tag's bytes before the
        text's (escaping is per character).  An :meth:`array_cores` struct (``obj``) does not
        hold the item's other members (Codex's ``id`` before ``role``, its metadata after
        ``content``), so that is proven on the bytes (:func:`_tag_at`).  None when it is not (the
        caller patches the item the general way)."""
        try:
            return _tag_at(raw, obj, path, text, tag)
        except (msgspec.DecodeError, msgspec.ValidationError, msgspec.EncodeError):
            return None

    @staticmethod
    def proxy_ids(raws: list[bytes], objs: list | None) -> bool:
        """Whether any of the items ``raws`` (``objs``: each as this pass decoded it, None where it
        did not) may carry a replayed proxy id (hygiene.proxy_id_edits): one read into its typed
        struct whose ``id`` is one (the id the item decodes to: the last, as a dict keeps it), any
        other whose bytes hold ``"msg-proxy-``.  (A first pass reads a whole conversation typed:
        its ids looked at, not its bytes searched.)"""
        if objs is None:
            return any(b'"msg-proxy-' in raw for raw in raws)
        for raw, obj in zip(raws, objs):
            if type(obj) is _Item:
                rid = obj.id
                if type(rid) is str and rid.startswith(PROXY_ID_PREFIX):
                    return True
            elif b'"msg-proxy-' in raw:
                return True
        return False

    # -- folding and proxy tools ---------------------------------------------------------------
    @staticmethod
    def summary_item(text: str) -> bytes:
        return encode({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})

    @staticmethod
    def tool_names(body: Body) -> list[str] | None:
        """Names of the request's tools (:meth:`_tool_names`): the names read before when the tools are those
        bytes again."""
        return memo_tool_names(_NAMES, body.top.get("tools"), lambda: ResponsesLane._tool_names(body))

    @staticmethod
    def _tool_names(body: Body) -> list[str] | None:
        """Names of the request's tools; a namespace's tools (codex nests MCP servers' tools as
        ``{"type": "namespace", "name": "mcp__bili", "tools": [...]}``) as ``<namespace>__<tool>``."""
        names = tool_names(body.top.get("tools"), lambda t: t if isinstance(t, dict) else None)
        if names is None:
            return None
        return [n for t in names for n in _names_in(t)]

    @staticmethod
    def inject(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
               names: list[str]) -> bool:
        """Bili's tools after the agent's, the prompt after its instructions (or an item of its own): each half (:meth:`_inject_tools`, :meth:`_inject_prompt`)
        replayed when its inputs are the ones it saw before (wire.base.memo_tools, memo_prompt)."""
        if not names:
            return False
        changed = memo_tools(_TOOLS, body, tools, names, lambda: ResponsesLane._inject_tools(body, tools, names))
        return memo_prompt(_PROMPT, body, items, start, prompt, (body.top.get("instructions"),),
                           lambda: ResponsesLane._inject_prompt(body, items, start, prompt), inserts=True) or changed

    @staticmethod
    def _inject_tools(body: Body, tools: list[dict], names: list[str]) -> bool:
        shaped = [{"_name": t["name"], "type": "function", "name": t["name"], "description": t["description"],
                   "parameters": t["parameters"]} for t in tools]
        return append_tools(body, "tools", names, shaped) if tools else False

    @staticmethod
    def _inject_prompt(body: Body, items: list[bytes], start: int, prompt: str) -> bool:
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            body.set("instructions", instructions + PROMPT_SEPARATOR + prompt)
            return True
        if body.array:  # after the agent's own leading developer/system items
            items.insert(start, encode({"type": "message", "role": "developer",
                                        "content": [{"type": "input_text", "text": prompt}]}))
            return True
        return False

    @staticmethod
    def result_edits(obj: Any, call_id: str, text: str, nth: int | None = None, keep_error: bool = False) -> list:
        if (
            isinstance(obj, dict)
            and obj.get("type") in ("function_call_output", "custom_tool_call_output")
            and obj.get("call_id") == call_id
        ):
            return [] if obj.get("output") == text else [(("output",), text)]
        return []

    @staticmethod
    def call_edits(obj: Any, call_id: str, name: str, args: str) -> list:
        if not (isinstance(obj, dict) and obj.get("type") == "function_call" and obj.get("call_id") == call_id):
            return []
        edits: list = []
        if obj.get("name") != name:
            edits.append((("name",), name))
        if obj.get("arguments") != args:
            edits.append((("arguments",), args))
        return edits


def _names_in(tool: dict) -> list[str]:
    name = tool.get("name")
    if not isinstance(name, str):
        return []
    inner = tool.get("tools") if tool.get("type") == "namespace" else None
    if not isinstance(inner, list):  # (a namespace whose tools are not a list names none)
        inner = []
    nested = [f"{name}__{t['name']}" for t in inner if isinstance(t, dict) and isinstance(t.get("name"), str)]
    return [name, *nested]


def _opaque_role(kind: Any) -> str:
    """Who produced an item we carry opaquely: ``*_call`` the model, ``*_output`` a tool."""
    if isinstance(kind, str):
        if kind.endswith("_call"):
            return "assistant"
        if kind.endswith("_output"):
            return "tool"
    return "user"


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _is_message(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    kind = obj.get("type")
    return kind == "message" or (kind is None and "role" in obj and "content" in obj)


def _json_without_id(obj: dict) -> str:
    """Compact JSON of an opaque item minus its provider id (which clients may drop or regenerate)."""
    return compact_json({k: v for k, v in obj.items() if k != "id"})



def _part_core(role: str, j: int, part: Any) -> Core:
    if not isinstance(part, dict):
        return Core(role, OTHER, compact_json(part))
    kind = part.get("type")
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return Core(role, TEXT, part["text"], path=("content", j, "text"))
    if kind == "input_image":
        return Core(role, IMAGE, "[image]", media=_image_slot(part))
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return Core(role, TEXT, part["refusal"])  # identity only, never tagged
    return Core(role, OTHER, compact_json(part))


def _image_slot(part: dict) -> str:
    url = part.get("image_url")
    if isinstance(url, dict):  # tolerate the Chat-style {"url": ...}
        url = url.get("url")
    if isinstance(url, str) and url:
        return payload_of_url(url)
    file_id = part.get("file_id")
    if isinstance(file_id, str) and file_id:
        return "file:" + file_id
    return ""


def _call(obj: dict, name: str, payload: Any) -> Core:
    if isinstance(payload, str):
        text = payload  # arguments exactly as sent
    else:
        text = "" if payload is None else compact_json(payload)
    return Core("assistant", TOOL_CALL, text, tool_name=name, tool_call_id=_str(obj.get("call_id")))


def _output_text(output: Any) -> tuple[str, str]:
    """Text of a tool output (parts joined by newlines) and the payload slots of any images in it."""
    if output is None:
        return "", ""
    if isinstance(output, str):
        return output, ""
    parts = output if isinstance(output, list) else [output]
    if not isinstance(output, list) and not _is_image_part(output):
        return compact_json(output), ""
    texts: list[str] = []
    media: list[str] = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif _is_image_part(part):
            texts.append("[image]")
            media.append(_image_slot(part))
        else:
            texts.append(compact_json(part))
    return "\n".join(texts), ",".join(media)


def _is_image_part(part: Any) -> bool:
    # computer_call_output carries a single {"type": "computer_screenshot", "image_url": ...}
    return isinstance(part, dict) and part.get("type") in ("input_image", "computer_screenshot")


def _reasoning_text(obj: dict) -> str:
    """The reasoning's own text, else its summaries, else its id, else the whole item."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = obj.get(key)
        if isinstance(parts, list):
            texts = [
                p["text"]
                for p in parts
                if isinstance(p, dict) and p.get("type") == part_type and isinstance(p.get("text"), str)
            ]
            if texts:
                return "\n".join(texts)
    rid = obj.get("id")
    if isinstance(rid, str) and rid:
        return rid
    return compact_json(obj)



# Codex's commonest items as one typed struct (ResponsesLane.array_cores): every key item_cores
# reads of them is a field (absent ones UNSET, as ``obj.get`` reads them None), other keys are
# skipped; a field of another type fails the decode (the caller then reads the items as dicts).
_UNSET = msgspec.UNSET


class _Part(msgspec.Struct, gc=False):
    type: Any = _UNSET
    text: Any = _UNSET
    image_url: Any = _UNSET
    file_id: Any = _UNSET
    refusal: Any = _UNSET


class _Item(msgspec.Struct, gc=False):
    type: Any = _UNSET
    role: Any = _UNSET
    content: Union[str, list[_Part], None, msgspec.UnsetType] = _UNSET
    summary: Union[list[_Part], None, msgspec.UnsetType] = _UNSET
    id: Any = _UNSET
    call_id: Any = _UNSET
    name: Any = _UNSET
    arguments: Any = _UNSET
    input: Any = _UNSET
    output: Any = _UNSET


_dec_items = msgspec.json.Decoder(list[_Item])
_CONTENT_PATH = ("content",)
_N_PATHS = 64
_TEXT_PATHS = [("content", j, "text") for j in range(_N_PATHS)]


def _flat_cores(array: Any) -> tuple[list[Core], list[int], list, list[bool]] | None:
    """ResponsesLane.array_cores, flat: the cores of all the items in one list, where each item's
    end, the structs, which are system items; None for an item item_cores reads otherwise."""
    try:
        items = _dec_items.decode(array)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    cores: list[Core] = []
    add = cores.append
    ends: list[int] = []
    end = ends.append
    systems: list[bool] = []
    system = systems.append
    unset, roles, text_parts, paths = _UNSET, _MESSAGE_ROLES, _TEXT_PARTS, _TEXT_PATHS
    for it in items:
        kind = it.type
        if kind == "message" or ((kind is None or kind is unset) and it.role is not unset and it.content is not unset):
            role = it.role
            role = roles.get(role) if type(role) is str else None
            if role is None:
                return None  # (an opaque item: its JSON)
            content = it.content
            if type(content) is str:
                add(Core(role, TEXT, content, "", "", "", 0, _CONTENT_PATH))
            elif type(content) is list:
                j = 0
                for p in content:
                    pk, text = p.type, p.text
                    if type(text) is str and pk in text_parts:
                        add(Core(role, TEXT, text, "", "", "", 0, paths[j] if j < _N_PATHS else ("content", j, "text")))
                    elif pk == "input_image":
                        add(Core(role, IMAGE, "[image]", media=_part_slot(p)))
                    elif pk == "refusal" and type(p.refusal) is str:
                        add(Core(role, TEXT, p.refusal))
                    else:
                        return None  # (an opaque part: its JSON)
                    j += 1
            system(it.role in _SYSTEM_ROLES)
            end(len(cores))
            continue
        system(False)
        if kind == "reasoning":
            text = None
            for parts, part_type in ((it.content, "reasoning_text"), (it.summary, "summary_text")):
                if type(parts) is list:
                    texts = [p.text for p in parts if p.type == part_type and type(p.text) is str]
                    if texts:
                        text = "\n".join(texts)
                        break
            if text is None:
                rid = it.id
                if type(rid) is not str or not rid:
                    return None  # (the whole item's JSON)
                text = rid
            add(Core("assistant", REASONING, text))
        elif kind == "function_call" or kind == "custom_tool_call":
            payload = it.arguments if kind == "function_call" else it.input
            if type(payload) is not str:
                payload = "" if payload is None or payload is unset else compact_json(payload)
            name, cid = it.name, it.call_id
            add(Core("assistant", TOOL_CALL, payload, name if type(name) is str else "",
                     cid if type(cid) is str else ""))
        elif type(kind) is str and kind.endswith("_output") and type(it.call_id) is str and it.output is not unset:
            output = it.output
            if type(output) is str:
                add(Core("tool", TOOL_RESULT, output, "", it.call_id))
            else:
                text, media = _output_text(output)
                add(Core("tool", TOOL_RESULT, text, "", it.call_id, media))
        else:
            return None  # (another kind: read as item_cores reads it)
        end(len(cores))
    return cores, ends, items, systems


def _part_slot(part: _Part) -> str:
    """_image_slot of a typed part."""
    url = part.image_url
    if isinstance(url, dict):  # tolerate the Chat-style {"url": ...}
        url = url.get("url")
    if isinstance(url, str) and url:
        return payload_of_url(url)
    file_id = part.file_id
    if isinstance(file_id, str) and file_id:
        return "file:" + file_id
    return ""


_enc = msgspec.json.Encoder()
_dec_members = msgspec.json.Decoder(dict[str, msgspec.Raw])  # an object's members, their values as they are
_CONTENT_KEY = b'"content":'


def _tag_at(raw: bytes, it: _Item, path: tuple, text: str, tag: bytes) -> bytes | None:
    """ResponsesLane.tag_typed: ``raw`` with ``tag`` where the text at ``path`` starts, when
    ``raw`` is, around that text, what patching writes (below); else None.

    ``raw`` is read as three runs: the members before ``content`` (from ``{`` to the first
    ``,"content":``), the ``content`` value, the members after it.  The first run closed with
    ``}`` must decode (so that ``,`` is the item's own: ``content`` is its member, not a nested
    one's) and re-encode to itself, as must the last run opened with ``{``: then the item is
    written compactly, its keys as msgspec writes them, none twice (a key twice re-encodes
    once), and patching re-encodes it to itself but for ``content``.  The ``content`` value must
    be msgspec's encoding of the struct's (every part holds only the members ``_Part`` reads, in
    its order): then patching re-encodes the array and the part to themselves but for the text,
    whose bytes are msgspec's encoding of ``text``."""
    content = it.content
    if len(path) == 1:  # ("content",): the content is the text
        if type(content) is not str or not (content is text or content == text):
            return None
        value = _enc.encode(content)
    else:  # ("content", j, "text"): a text part's
        j = path[1]
        if type(content) is not list or type(j) is not int or not 0 <= j < len(content):
            return None
        part = content[j]
        now = part.text
        if not (now is text or now == text) or type(part.type) is not str:
            return None
        value = _enc.encode(content)
    at = raw.find(_CONTENT_KEY)
    if at == 1:
        if raw[0] != 0x7B:  # "{"
            return None
        before = None
    elif at > 1 and raw[at - 1] == 0x2C:  # ","
        head = raw[:at - 1] + b"}"
        before = _dec_members.decode(head)
        if "content" in before or _enc.encode(before) != head:
            return None
    else:
        return None
    start = at + len(_CONTENT_KEY)
    if not raw.startswith(value, start):  # (an array or a string: where its bytes end, it ends)
        return None
    rest = raw[start + len(value):]
    if rest != b"}":  # members after ``content``
        if rest[:1] != b",":
            return None
        tail = b"{" + rest[1:]
        after = _dec_members.decode(tail)
        if "content" in after or _enc.encode(after) != tail or (before is not None and not after.keys().isdisjoint(before)):
            return None
    at = start + 1  # (after the string's ``"`` or the array's ``[``)
    if len(path) > 1:  # after the parts before it and their commas, and the part's ``{"type":...,"text":"``
        if j:
            at += sum([len(_enc.encode(p)) + 1 for p in content[:j]])
        at += len(_enc.encode(part.type)) + _PART_HEAD
    return raw[:at] + tag + raw[at:]


_PART_HEAD = len(b'{"type":') + len(b',"text":"')  # (a text part's members around its type)
