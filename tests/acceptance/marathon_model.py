"""A scripted model for marathon sessions of the real agents (loopback only): shell steps of a chosen
size, a summary for the agent's own compaction request, one ``compress`` call for each bili reminder
(optionally only after the agent's first compaction), and Anthropic's "prompt is too long" above a
limit.  Its usage reports the request body's size / 4 as input tokens, as the real APIs report the
prompt's size.  Used by tests/acceptance/test_compaction_agents.py and
scripts/bench_agent_compaction.py."""

from __future__ import annotations

import json
import re

from .scripted_model import (
    SHELL_NAMES,
    Action,
    ScriptedModel,
    anthropic_answer,
    lane_of,
    responses_answer,
    shell_args,
    tools_of,
)

COMPACT_ASKS = ("Your task is to create a detailed summary of the",  # Claude Code
                "CONTEXT CHECKPOINT COMPACTION",  # codex
                "The messages above are a conversation to summarize",  # pi
                "You are a context summarization assistant")  # pi (its system prompt, turn-prefix summaries too)
REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)", re.M)
TASK = "Work through the numbered listings step by step with your shell tool until the model says done."


def _text(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content if isinstance(content, list) else []:
        if isinstance(b, dict):
            if b.get("type") in ("text", "input_text", "output_text"):
                out.append(b.get("text", ""))
            elif b.get("type") == "tool_result":
                out.append(_text(b.get("content")))
    return "\n".join(out)


def _conversation(lane: str, body: dict) -> tuple[list[str], str]:
    """(the text of each conversation item, the newest user turn's text incl. tool results)."""
    if lane == "anthropic":
        msgs = body.get("messages") or []
        texts = [_text(m.get("content")) for m in msgs]
        return texts, texts[-1] if texts else ""
    items = [it for it in body.get("input") or [] if isinstance(it, dict)]
    texts = [_text(it.get("content")) if it.get("type", "message") == "message" else str(it.get("output", ""))
             for it in items]
    tail = []
    for it, t in zip(reversed(items), reversed(texts)):
        if it.get("role") == "assistant" or it.get("type") == "function_call":
            break
        tail.append(t)
    return texts, "\n".join(reversed(tail))


class MarathonModel(ScriptedModel):
    """Shell steps, a summary for the agent's compaction request, compress for bili's reminders."""

    def __init__(self, steps: int, output_kb: int, late: bool = False, overflow_at: int = 0,
                 folds_before: int = -1):
        super().__init__()
        self.overflow_at = overflow_at  # refuse larger prompts as Anthropic does ("prompt is too long")
        self.steps, self.output_kb = steps, output_kb
        # reminders answered before the agent's first compaction (-1: all; late: none)
        self.folds_before = 0 if late else folds_before
        self.compacted = False
        self.step = 0
        self.log: list[dict] = []  # one entry per model request: kind, reported tokens, head of the history

    def answer(self, rec):
        rec.lane = lane = lane_of(rec.method, rec.path)
        if lane not in ("anthropic", "responses"):
            if rec.path.split("?")[0].rstrip("/").endswith("/models") and rec.method == "GET":
                return 200, "application/json", b'{"object": "list", "data": [], "has_more": false}'
            return 404, "application/json", b'{"error": {"type": "not_found", "message": "scripted"}}'
        try:
            rec.json = body = json.loads(rec.body)
        except ValueError:
            return 400, "application/json", b'{"error": {"type": "invalid_request_error", "message": "not JSON"}}'
        texts, last = _conversation(lane, body)
        head = "\n".join(texts)[:200]
        prompt = len(rec.body) // 4
        tools = tools_of(lane, body)
        shell = next((n for n in SHELL_NAMES if n in tools), None)
        if self.overflow_at and prompt > self.overflow_at and lane == "anthropic":
            self.log.append({"kind": "overflow", "prompt": prompt, "items": len(texts), "head": head, "seq": rec.seq,
                             "step": self.step})
            return 400, "application/json", json.dumps({"type": "error", "error": {
                "type": "invalid_request_error",
                "message": f"prompt is too long: {prompt} tokens > {self.overflow_at} maximum"}}).encode()
        whole = rec.body.decode("utf-8", "replace")
        if any(a in last for a in COMPACT_ASKS) or (shell is None and any(a in whole for a in COMPACT_ASKS)):
            kind = "compaction"
            self.compacted = True
            summary = ("<analysis>scripted</analysis>\n<summary>\n1. Primary Request and Intent: work through the "
                       f"numbered listings. 2. Progress: {self.step} steps done, every listing read and checked. "
                       "3. Pending: continue with the next listing.\n" + "Detail line of the summary. " * 150
                       + "\n</summary>")
            action = Action("text", 0, summary)
        elif shell is None:
            kind, action = "side", Action("text", 0, '{"title": "Marathon"}')
        else:
            ranges = REMINDER.findall(last[last.rindex("[bili] "):]) if "[bili] " in last else []
            if ranges and "compress" in tools and (self.compacted or self.folds_before != 0):
                if not self.compacted and self.folds_before > 0:
                    self.folds_before -= 1
                kind = "compress"
                args = {"content": [{"startId": a, "endId": b, "topic": "listings",
                                     "summary": f"Listings {a}..{b} were read and checked; all rows in order, "
                                                "nothing to follow up."} for a, b, _n, _k in ranges]}
                action = Action("tool", 900 + len(self.log), "Folding the older listings.", "compress", args)
            elif self.step < self.steps:
                self.step += 1
                kind = "step"
                lines = self.output_kb * 1024 // 64
                cmd = f"seq -f 'listing-{self.step}-row-%05g the quick brown fox jumps over the lazy dog' 1 {lines}"
                action = Action("tool", self.step, f"Step {self.step}: reading listing {self.step}.", shell,
                                shell_args(tools[shell], cmd))
            else:
                kind, action = "final", Action("text", 0, "All listings are done. MARATHON-DONE")
        self.log.append({"kind": kind, "prompt": prompt, "items": len(texts), "head": head, "seq": rec.seq,
                         "step": self.step})
        rec.action = action
        model = body.get("model") or "scripted"
        if lane == "responses":
            ctype, out = responses_answer(rec.seq, model, action, bool(body.get("stream")), prompt)
            return 200, ctype, out
        ctype, out = anthropic_answer(rec.seq, model, action, bool(body.get("stream")), prompt)
        # the final usage event carries the input figures too, as Anthropic's does
        out = out.replace(b'"usage": {"output_tokens": 20}}',
                          b'"usage": {"input_tokens": %d, "cache_creation_input_tokens": 0, '
                          b'"cache_read_input_tokens": 0, "output_tokens": 20}}' % prompt)
        return 200, ctype, out
