"""mitmweb / mitmproxy content view "bili": a model request as the model received it, and an answer
with what bili took out of it.

Pick "bili" in the flow's detail (``mitmweb -s bili_addon/addon.py``; the addon registers the
view when it loads).  For a request bili changed it shows, from the flow's record
(:mod:`bili_addon.flowmeta`) and the body that went upstream: the session, what the agent sent and
what bili sent, the refs (``mNNNNN``) each item carries, the folded ranges and the summaries that
stand in for them, what bili injected (its tools, its prompt, results of the proxy tools it ran),
and the conversation item by item.  For an answer: the proxy tools the model called, the tag echoes
stripped from its prose, the usage.  A flow bili did not touch shows its body and says so.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mitmproxy import contentviews
from mitmproxy.contentviews import Metadata

from bili_addon import flowmeta
from bili_addon.kernel.prompts import TOOLS

TAG = re.compile(r'<acp tokens="[^"<>]*" type="[^"<>]*">(m\d{5})</acp>\n?')
SUMMARY = re.compile(r"\[Compressed conversation section (b\d+) · (m\d{5})[–-](m\d{5})")
PROMPT_HEAD = "# Context folding (bili)"
BILI_TOOLS = tuple(t["name"] for t in TOOLS)
CONV_KEYS = ("messages", "input", "contents")
WIDTH = 150


def _leaves(v: Any, out: list[str]) -> None:
    """The text of an item, depth first (strings, and call arguments as JSON)."""
    if isinstance(v, str):
        out.append(v)
    elif isinstance(v, list):
        for x in v:
            _leaves(x, out)
    elif isinstance(v, dict):
        for k, x in v.items():
            if k in ("type", "role", "id", "call_id", "tool_use_id", "cache_control", "signature", "name",
                     "status", "encrypted_content"):
                continue
            if k in ("input", "args") and isinstance(x, dict):
                out.append(json.dumps(x, ensure_ascii=False))
            else:
                _leaves(x, out)


def _parts(item: dict) -> list[dict]:
    for key in ("content", "parts"):
        v = item.get(key)
        if isinstance(v, list):
            return [p for p in v if isinstance(p, dict)]
    return []


def _calls(item: dict) -> list[tuple[str, str]]:
    """``(call id, tool name)`` of the calls an item makes (every lane's shape)."""
    out = []
    if item.get("type") == "function_call":
        out.append((str(item.get("call_id", "")), str(item.get("name", ""))))
    for tc in item.get("tool_calls") or []:
        if isinstance(tc, dict):
            out.append((str(tc.get("id", "")), str((tc.get("function") or {}).get("name", ""))))
    for p in _parts(item):
        if p.get("type") == "tool_use":
            out.append((str(p.get("id", "")), str(p.get("name", ""))))
        elif isinstance(p.get("functionCall"), dict):
            out.append(("", str(p["functionCall"].get("name", ""))))
    return out


def _results(item: dict) -> list[tuple[str, str]]:
    """``(call id, tool name or '')`` of the results an item carries."""
    out = []
    if item.get("type") == "function_call_output":
        out.append((str(item.get("call_id", "")), ""))
    if item.get("role") == "tool":
        out.append((str(item.get("tool_call_id", "")), ""))
    for p in _parts(item):
        if p.get("type") == "tool_result":
            out.append((str(p.get("tool_use_id", "")), ""))
        elif isinstance(p.get("functionResponse"), dict):
            out.append(("", str(p["functionResponse"].get("name", ""))))
    return out


def _role(item: Any) -> str:
    if not isinstance(item, dict):
        return "?"
    role = str(item.get("role") or item.get("type") or "?")
    calls = _calls(item)
    if calls:
        return f"{role} → {', '.join(n for _, n in calls)}"
    if _results(item):
        return f"{role} · tool result"
    return role


def _short(text: str, width: int = WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def conversation_lines(items: list[Any]) -> list[str]:
    out = []
    ours = {cid: name for item in items if isinstance(item, dict) for cid, name in _calls(item)
            if name in BILI_TOOLS and cid}
    for i, item in enumerate(items):
        texts: list[str] = []
        _leaves(item, texts)
        joined = "\n".join(texts)
        refs = TAG.findall(joined)
        plain = TAG.sub("", joined)
        m = SUMMARY.search(plain)
        role = _role(item)
        if m:
            body = plain[plain.find("]", m.end()) + 1:] if "]" in plain[m.end():] else plain[m.end():]
            out.append(f"{i:>4} {role:<22} ◆ bili summary {m.group(1)} (folds {m.group(2)}–{m.group(3)}): "
                       f"{_short(body, WIDTH - 40)}")
            continue
        mark = "[" + ",".join(refs) + "] " if refs else ""
        theirs = [ours.get(cid) or (name if name in BILI_TOOLS else "") for cid, name in
                  (_results(item) if isinstance(item, dict) else [])]
        note = "".join(f" ◇ result of bili's {n}" for n in theirs if n)
        out.append(f"{i:>4} {role:<22} {mark}{_short(plain, WIDTH - len(mark))}{note}")
    return out


def _system_text(doc: dict) -> str:
    parts: list[str] = []
    for key in ("system", "instructions", "systemInstruction"):
        if key in doc:
            _leaves(doc[key], parts)
    if isinstance(doc.get("messages"), list):  # chat: system messages
        for m in doc["messages"]:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                _leaves(m.get("content"), parts)
    return "\n".join(parts)


def _tool_names(doc: dict) -> list[str]:
    names = []
    for t in doc.get("tools") or []:
        if not isinstance(t, dict):
            continue
        name = t.get("name") or (t.get("function") or {}).get("name")
        if name:
            names.append(str(name))
        for fd in t.get("functionDeclarations") or []:
            if isinstance(fd, dict) and fd.get("name"):
                names.append(str(fd["name"]))
    return names


def _decode(data: bytes) -> dict | None:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def request_view(data: bytes, rec: dict[str, Any] | None) -> str:
    doc = _decode(data)
    if rec is None:
        head = "bili did not change this request (no bili record on the flow)."
        return head + ("\n\n" + json.dumps(doc, indent=2, ensure_ascii=False) if doc is not None else "")
    lines = [f"bili · session {rec.get('session')} · {rec.get('lane')} over {rec.get('via', 'http')} · "
             f"{rec.get('mode')} mode{'' if rec.get('rendered') else ' (not rendered: forwarded as the agent sent it)'}"]
    at, st = rec.get("agent_tokens"), rec.get("sent_tokens")
    if at is not None and st is not None:
        change = f" ({(st - at) / at:+.0%})" if at else ""
        pred = rec.get("predicted")
        lines.append(f"agent sent ~{at:,} tokens, bili sent ~{st:,}{change}"
                     + (f"; predicted cache read {pred:.0%}" if isinstance(pred, (int, float)) else ""))
    lines.append(f"messages {rec.get('messages')}, refs new {rec.get('refs_new')} known {rec.get('refs_known')}, "
                 f"tagged {rec.get('tagged')}, active blocks {rec.get('blocks')}, items folded away {rec.get('folded')}")
    if rec.get("executed"):
        lines.append("ran for this request: " + ", ".join(rec["executed"]) + " (its result replaces the agent's "
                     "'unknown tool' answer)")
    if rec.get("answered"):
        lines.append(f"bili answered this request itself with HTTP {rec['answered']}")
    folds = rec.get("folds") or []
    if folds:
        lines.append("folds:")
        lines += [f"  {b}  {first} – {last}" for b, first, last in folds]
    original = _decode(flowmeta.original_request(rec) or b"")
    if doc is not None:
        before_tools = _tool_names(original) if original is not None else [n for n in _tool_names(doc)
                                                                            if n not in BILI_TOOLS]
        injected = [n for n in _tool_names(doc) if n not in before_tools]
        added = []
        if injected:
            added.append("tools " + ", ".join(injected))
        system = _system_text(doc)
        if PROMPT_HEAD in system and (original is None or PROMPT_HEAD not in _system_text(original)):
            added.append(f"its prompt in the system text ({PROMPT_HEAD!r} ...)")
        if added:
            lines.append("injected: " + "; ".join(added))
        conv = next((doc[k] for k in CONV_KEYS if isinstance(doc.get(k), list)), None)
        if conv is not None:
            agent_items = next((len(original[k]) for k in CONV_KEYS if original and isinstance(original.get(k), list)),
                               None)
            lines.append("")
            lines.append(f"── the conversation as the model received it ({len(conv)} items"
                         + (f"; the agent sent {agent_items}" if agent_items is not None else "") + ") ──")
            lines += conversation_lines(conv)
    return "\n".join(lines)


def response_view(data: bytes, rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "bili did not touch this answer (no bili record on the flow)."
    lines = [f"bili · session {rec.get('session')} · {rec.get('lane')}"]
    called = rec.get("called") or []
    if called:
        lines.append("the model called bili's tools (they run when the agent's next request carries them):")
        lines += [f"  {name} {_short(args, WIDTH - 10)}   [{key}]" for key, name, args in called]
    stripped = rec.get("stripped", 0)
    lines.append(f"tag echoes stripped from the model's prose: {stripped}" if stripped
                 else "no tag echoes to strip")
    echoes = rec.get("echoes") or []
    lines += [f"  {_short(e, WIDTH - 2)}" for e in echoes]
    if stripped > len(echoes) and echoes:
        lines.append(f"  (and {stripped - len(echoes)} more)")
    u = rec.get("usage")
    if u:
        share = f" ({u['cache_read'] / u['input']:.0%} read from cache)" if u.get("input") else ""
        long = f" ({u['cache_write_1h']:,} for 1 hour)" if u.get("cache_write_1h") else ""
        lines.append(f"usage: input {u['input']:,}, cache read {u['cache_read']:,}, cache write {u['cache_write']:,}"
                     f"{long}, output {u['output']:,}{share}")
    if data:
        doc = _decode(data)
        lines += ["", "── the answer as the agent received it ──",
                  json.dumps(doc, indent=2, ensure_ascii=False) if doc is not None else data.decode("utf-8", "replace")]
    return "\n".join(lines)


class BiliContentview(contentviews.Contentview):
    name = "bili"
    syntax_highlight = "none"

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        flow = metadata.flow
        rec = flowmeta.read(flow.metadata) if flow is not None else None
        msg = metadata.http_message
        if flow is not None and msg is not None and msg is getattr(flow, "response", None):
            return response_view(data, rec)
        if metadata.websocket_message is not None and flow is not None:
            ws = flowmeta.read_ws(flow.metadata)
            idx = next((i for i, m in enumerate(flow.websocket.messages) if m is metadata.websocket_message), -1)
            return request_view(data, ws.get(idx))
        return request_view(data, rec)

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        return 0  # never chosen automatically: pick "bili" in the flow's detail


view = BiliContentview()


def register() -> None:
    """Make "bili" selectable in mitmproxy's and mitmweb's content views (idempotent)."""
    contentviews.add(view)


__all__ = ["BiliContentview", "register", "request_view", "response_view", "view"]
