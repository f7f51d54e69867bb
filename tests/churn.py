"""A conversation written in any lane, under any id scheme and serialisation: the churn hosts do."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field

FILLER = " ".join(f"word{i}" for i in range(120))
TAG = re.compile(r'^<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n(.*)', re.DOTALL)
PLACEHOLDER = "\n(image omitted: model does not support images)"


@dataclass
class Scheme:
    ids: str = "call_"  # tool-call id prefix (hosts re-mint them)
    spaced: bool = False  # arguments re-serialised with keys reversed and spaces
    strings: bool = False  # single text contents as strings rather than one-part arrays
    cache_at: int = -1  # Anthropic: the message carrying cache_control (-1: the last)
    merge_reasoning: bool = False  # model switch: reasoning inlined into the text
    placeholder_images: bool = False  # model switch: images replaced by a placeholder line
    suffix: str = ""  # a systematic re-stamp of every prose text


@dataclass
class Turn:
    t: int
    user: str
    reply: str
    tool: bool
    reasoning: str = ""
    image: bool = False
    extra: dict = field(default_factory=dict)


def turns(n: int, *, reasoning: bool = False, images: bool = False) -> list[Turn]:
    out = []
    for t in range(n):
        out.append(Turn(
            t, f"Turn {t}: please analyze module {t}. {FILLER}", f"Reply Turn {t}: module {t} reviewed.",
            tool=t % 2 == 0, reasoning=f"thinking about it scratch-{t}-final" if reasoning else "",
            image=images,
        ))
    return out


def args_of(t: int, spaced: bool) -> str:
    d = {"cmd": f"cat mod{t}.py", "lines": 400}
    if spaced:
        return "{ " + " , ".join(f'"{k}" : {json.dumps(v)}' for k, v in reversed(d.items())) + " }"
    return json.dumps(d, separators=(",", ":"))


def output_of(t: int) -> str:
    return "\n".join(f"file-{t}-row-{i}: value {i * t}" for i in range(60))


def image_b64(t: int) -> str:
    return base64.b64encode(hashlib.sha256(f"img{t}".encode()).digest() * 4).decode()


# -- lanes -------------------------------------------------------------------------------------

def anthropic(ts: list[Turn], sc: Scheme, extra: list[dict] = ()) -> list[dict]:
    msgs: list[dict] = []
    for tr in ts:
        user_text = tr.user + sc.suffix
        if tr.image and sc.placeholder_images:
            user_text += PLACEHOLDER
        content: list[dict] = [{"type": "text", "text": user_text}]
        if tr.image and not sc.placeholder_images:
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                        "data": image_b64(tr.t)}})
        msgs.append({"role": "user", "content": content})
        blocks: list[dict] = []
        reply = tr.reply + sc.suffix
        if tr.reasoning and not sc.merge_reasoning:
            blocks.append({"type": "thinking", "thinking": tr.reasoning, "signature": f"sig{tr.t}"})
        elif tr.reasoning:
            reply = tr.reasoning + "\n" + reply
        blocks.append({"type": "text", "text": reply})
        if tr.tool:
            blocks.append({"type": "tool_use", "id": f"{sc.ids}{tr.t}", "name": "Bash",
                           "input": json.loads(args_of(tr.t, sc.spaced)) if not sc.spaced
                           else dict(reversed(list(json.loads(args_of(tr.t, False)).items())))})
        msgs.append({"role": "assistant", "content": blocks})
        if tr.tool:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"{sc.ids}{tr.t}",
                                                      "content": output_of(tr.t)}]})
    msgs += list(extra)
    for m in msgs:
        c = m["content"]
        if sc.strings and isinstance(c, list) and len(c) == 1 and c[0].get("type") == "text":
            m["content"] = c[0]["text"]
    target = msgs[sc.cache_at] if msgs else None
    if target is not None and isinstance(target["content"], list):
        target["content"][-1] = {**target["content"][-1], "cache_control": {"type": "ephemeral"}}
    return msgs


def chat(ts: list[Turn], sc: Scheme, extra: list[dict] = ()) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": "You are an agent."}]
    for tr in ts:
        text = tr.user + sc.suffix
        if tr.image and sc.placeholder_images:
            msgs.append({"role": "user", "content": text + PLACEHOLDER})
        elif tr.image:
            msgs.append({"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image_b64(tr.t)}}]})
        else:
            msgs.append({"role": "user", "content": text if sc.strings else [{"type": "text", "text": text}]})
        m: dict = {"role": "assistant", "content": tr.reply + sc.suffix}
        if tr.reasoning and not sc.merge_reasoning:
            m["reasoning_content"] = tr.reasoning
        elif tr.reasoning:
            m["content"] = tr.reasoning + "\n" + m["content"]
        if tr.tool:
            m["tool_calls"] = [{"id": f"{sc.ids}{tr.t}", "type": "function",
                                "function": {"name": "Bash", "arguments": args_of(tr.t, sc.spaced)}}]
        msgs.append(m)
        if tr.tool:
            msgs.append({"role": "tool", "tool_call_id": f"{sc.ids}{tr.t}", "content": output_of(tr.t)})
    return msgs + list(extra)


def responses(ts: list[Turn], sc: Scheme, extra: list[dict] = ()) -> list[dict]:
    items: list[dict] = [{"type": "message", "role": "developer", "content": "You are an agent."}]
    for tr in ts:
        text = tr.user + sc.suffix
        items.append({"type": "message", "role": "user",
                      "content": text if sc.strings else [{"type": "input_text", "text": text}]})
        items.append({"type": "message", "role": "assistant", "id": f"{sc.ids}msg{tr.t}",
                      "content": [{"type": "output_text", "text": tr.reply + sc.suffix}]})
        if tr.tool:
            items.append({"type": "function_call", "id": f"fc_{sc.ids}{tr.t}", "call_id": f"{sc.ids}{tr.t}",
                          "name": "Bash", "arguments": args_of(tr.t, sc.spaced)})
            items.append({"type": "function_call_output", "call_id": f"{sc.ids}{tr.t}", "output": output_of(tr.t)})
    return items + list(extra)


def gemini(ts: list[Turn], sc: Scheme, extra: list[dict] = ()) -> list[dict]:
    contents: list[dict] = []
    for tr in ts:
        contents.append({"role": "user", "parts": [{"text": tr.user + sc.suffix}]})
        parts: list[dict] = [{"text": tr.reply + sc.suffix}]
        if tr.tool:
            args = json.loads(args_of(tr.t, False))
            if sc.spaced:
                args = dict(reversed(list(args.items())))
            parts.append({"functionCall": {"id": f"{sc.ids}{tr.t}", "name": "Bash", "args": args}})
        contents.append({"role": "model", "parts": parts})
        if tr.tool:
            contents.append({"role": "user", "parts": [{"functionResponse": {
                "id": f"{sc.ids}{tr.t}", "name": "Bash", "response": {"output": output_of(tr.t)}}}]})
    return contents + list(extra)


def body(lane: str, conv: list[dict]) -> bytes:
    if lane == "anthropic":
        return json.dumps({"model": "claude-x", "max_tokens": 100, "system": "You are an agent.",
                           "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "messages": conv}).encode()
    if lane == "chat":
        return json.dumps({"model": "gpt-x", "messages": conv,
                           "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}]}).encode()
    if lane == "responses":
        return json.dumps({"model": "gpt-5", "input": conv,
                           "tools": [{"type": "function", "name": "bash", "parameters": {}}]}).encode()
    return json.dumps({"contents": conv, "tools": [{"functionDeclarations": [{"name": "bash"}]}]}).encode()


BUILD = {"anthropic": anthropic, "chat": chat, "responses": responses, "gemini": gemini}


def proxy_call(lane: str, cid: str, name: str, args: dict) -> list[dict]:
    """The proxy tool call as the agent stores it, and its unknown-tool error."""
    a = json.dumps(args)
    if lane == "anthropic":
        return [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "is_error": True,
                                              "content": f"No such tool available: {name}"}]}]
    if lane == "chat":
        return [{"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": a}}]},
            {"role": "tool", "tool_call_id": cid, "content": f"Tool {name} not found"}]
    if lane == "responses":
        return [{"type": "function_call", "call_id": cid, "name": name, "arguments": a},
                {"type": "function_call_output", "call_id": cid, "output": f"unsupported call: {name}"}]
    return [{"role": "model", "parts": [{"functionCall": {"id": cid, "name": name, "args": args}}]},
            {"role": "user", "parts": [{"functionResponse": {"id": cid, "name": name, "response": {"error": "no"}}}]}]


def strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from strings(x)


def refs_by_text(out: bytes) -> dict[str, str]:
    """The first 14 characters of each tagged prose text -> its ref."""
    return {m.group(2)[:14]: m.group(1) for s in strings(json.loads(out)) if (m := TAG.match(s))}
