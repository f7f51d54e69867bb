"""Google Gemini (``:generateContent`` / ``:streamGenerateContent``): ``contents[]`` items of ``parts``.

The system prompt lives in the top-level ``systemInstruction``, so no item is system content.
Part keys are read in both spellings the REST API accepts (``functionCall`` / ``function_call``).
A part's ``thoughtSignature`` is never part of a core; patching touches only ``text``.
"""

from __future__ import annotations

from typing import Any

from bili_addon.wire.base import (
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
    append_tools,
    compact_json,
    decode_any,
    encode,
    idless_call_key,
    memo_prompt,
    memo_tool_names,
    memo_tools,
)
from bili_addon.wire.media import payload_of_data

_ROLES = {"user": "user", "model": "assistant", "assistant": "assistant", "system": "system"}


_NAMES = Memo()  # tools bytes -> their names (base.memo_tool_names)
_TOOLS = Memo()  # the tools half of inject: what it read -> what it wrote (base.memo_tools)
_PROMPT = Memo()  # the prompt half (base.memo_prompt)


class GeminiLane(LaneDefaults):
    name = "gemini"
    conv_key = "contents"

    @staticmethod
    def is_system_item(obj: Any) -> bool:
        return False

    @staticmethod
    def item_cores(obj: Any) -> list[Core]:
        if not isinstance(obj, dict):
            return [Core("user", OTHER, compact_json(obj))]
        # a missing role is the user (single-turn requests); the legacy "function" role carries results
        role = obj.get("role")
        role = _ROLES.get(role, "user") if isinstance(role, str) else "user"
        parts = obj.get("parts")
        if not isinstance(parts, list):
            return [Core(role, OTHER, compact_json(parts))]
        return [_part_core(role, j, part) for j, part in enumerate(parts)]

    # -- folding and proxy tools ---------------------------------------------------------------
    @staticmethod
    def summary_item(text: str) -> bytes:
        return encode({"role": "user", "parts": [{"text": text}]})

    # note_in_item stays None: the API splits turns on a function response content and refuses
    # prose beside the responses; a content of its own is fine (consecutive user contents merge)

    @staticmethod
    def tool_names(body: Body) -> list[str] | None:
        """Names of the request's tools: the names read before when the tools are those bytes again."""
        return memo_tool_names(_NAMES, body.top.get("tools"), lambda: GeminiLane._tool_names(body))

    @staticmethod
    def _tool_names(body: Body) -> list[str] | None:
        raw = body.top.get("tools")
        if raw is None or bytes(raw)[:1] != b"[":
            return None
        names: list[str] = []
        for t in decode_any(raw) or []:
            decls = (t.get("functionDeclarations") or t.get("function_declarations") or []) if isinstance(t, dict) else []
            if not isinstance(decls, list):
                continue
            names.extend(d.get("name") for d in decls if isinstance(d, dict) and isinstance(d.get("name"), str))
        return names

    @staticmethod
    def inject(body: Body, items: list[bytes], start: int, tools: list[dict], prompt: str,
               names: list[str]) -> bool:
        """Bili's tools (the ones the agent lacks) in a declaration group of their own, the prompt as
        the last part of the system instruction: each half (:meth:`_inject_tools`, :meth:`_inject_prompt`)
        replayed when its inputs are the ones it saw before (wire.base.memo_tools, memo_prompt)."""
        if not names:
            return False
        changed = memo_tools(_TOOLS, body, tools, names, lambda: GeminiLane._inject_tools(body, tools, names))
        return memo_prompt(_PROMPT, body, items, start, prompt, (body.top.get("systemInstruction"),
                                                                    body.top.get("system_instruction")),
                           lambda: GeminiLane._inject_prompt(body, prompt)) or changed

    @staticmethod
    def _inject_tools(body: Body, tools: list[dict], names: list[str]) -> bool:
        decls = [{"name": t["name"], "description": t["description"], "parameters": t["parameters"]}
                 for t in tools if t["name"] not in names]
        return append_tools(body, "tools", [], [{"_name": "", "functionDeclarations": decls}]) if decls else False

    @staticmethod
    def _inject_prompt(body: Body, prompt: str) -> bool:
        # (the member as the agent spells it: both spellings are one field, and a body with both is refused)
        key = "system_instruction" if "systemInstruction" not in body.top and "system_instruction" in body.top \
            else "systemInstruction"
        system = body.get(key)
        if not isinstance(system, dict):
            system = {"parts": []}
        parts = system.get("parts") if isinstance(system.get("parts"), list) else []
        system["parts"] = [*parts, {"text": prompt}]
        body.set(key, system)
        return True

    @staticmethod
    def result_edits(obj: Any, call_id: str, text: str, nth: int | None = None, keep_error: bool = False) -> list:
        """``nth``: only the nth response with that key in the item (id-less responses of one tool,
        ``name:TOOL``, each answering a call of its own)."""
        edits: list = []
        n = -1
        for j, part in enumerate(_parts(obj)):
            key = "functionResponse" if "functionResponse" in part else "function_response"
            fr = part.get(key)
            if isinstance(fr, dict) and _response_key(fr) == call_id:
                n += 1
                if nth is not None and n != nth:
                    continue
                want = {"content": text}
                if fr.get("response") != want:
                    edits.append((("parts", j, key, "response"), want))
        return edits

    @staticmethod
    def call_edits(obj: Any, call_id: str, name: str, args: str) -> list:
        try:
            parsed = decode_any(args)
        except ValueError:
            parsed = {}
        edits: list = []
        for j, part in enumerate(_parts(obj)):
            key = "functionCall" if "functionCall" in part else "function_call"
            fc = part.get(key)
            if isinstance(fc, dict) and function_call_key(fc) == call_id and fc.get("args") != parsed:
                edits.append((("parts", j, key, "args"), parsed))
        return edits


def _parts(obj: Any) -> list[dict]:
    parts = obj.get("parts") if isinstance(obj, dict) else None
    return [p if isinstance(p, dict) else {} for p in parts] if isinstance(parts, list) else []


def function_call_key(call: dict) -> str:
    """A ``functionCall``'s key: its id, or without one its name and arguments (the same on the
    response path, which records the call, and on the request path, which finds it again)."""
    cid = call.get("id")
    if isinstance(cid, str) and cid:
        return cid
    return idless_call_key(str(call.get("name") or ""), call.get("args"))


def _response_key(resp: dict) -> str:
    """A ``functionResponse``'s key: its id, or its name (the kernel pairs it with its call)."""
    cid = resp.get("id")
    return cid if isinstance(cid, str) and cid else "name:" + str(resp.get("name") or "")


def _get(part: dict, camel: str, snake: str) -> Any:
    v = part.get(camel)
    return part.get(snake) if v is None else v


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _part_core(role: str, j: int, part: Any) -> Core:
    if not isinstance(part, dict):
        return Core(role, OTHER, compact_json(part))
    text = part.get("text")
    if isinstance(text, str):
        if part.get("thought") is True:
            return Core("assistant", REASONING, text)
        return Core(role, TEXT, text, path=("parts", j, "text"))
    call = _get(part, "functionCall", "function_call")
    if isinstance(call, dict):
        args = call.get("args")
        return Core(
            "assistant",
            TOOL_CALL,
            compact_json({} if args is None else args),
            tool_name=_str(call.get("name")),
            tool_call_id=_str(call.get("id")),
        )
    resp = _get(part, "functionResponse", "function_response")
    if isinstance(resp, dict):
        return Core(
            "tool",
            TOOL_RESULT,
            compact_json(resp.get("response")),
            tool_name=_str(resp.get("name")),
            tool_call_id=_str(resp.get("id")),
        )
    inline = _get(part, "inlineData", "inline_data")
    if isinstance(inline, dict):
        data = inline.get("data")
        return Core(role, IMAGE, "[image]", media=payload_of_data(data) if isinstance(data, str) else "")
    file = _get(part, "fileData", "file_data")
    if isinstance(file, dict):
        uri = _get(file, "fileUri", "file_uri")
        return Core(role, IMAGE, "[image]", media="url:" + uri if isinstance(uri, str) else "")
    return Core(role, OTHER, compact_json(part))
