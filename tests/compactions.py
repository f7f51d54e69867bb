"""Compacted histories as the agents send them, built from their shapes, for synthetic sessions.

Claude Code's, codex's and pi's shapes were checked against the real agents' own compactions
(``tests/captures/``, recorded with ``scripts/bench_agent_compaction.py``; the tests replay those
too); the other builders follow the agents' source, not a capture:

* Claude Code 2.x (auto-compact and ``/compact``): the new history's first user message holds the
  summary, ``"This session is being continued from a previous conversation that ran out of
  context. ..." + summary`` plus the instruction to go on (2.1.197 puts its ``<system-reminder>``
  context block before it, and keeps the turn in flight after it); the conversation continues.
* codex (``codex-rs/core/src/compact.rs``, ``build_compacted_history``): the initial context
  (developer and environment messages), then the user messages of the old history (the newest
  ~20K tokens of them, verbatim), then one user message ``SUMMARY_PREFIX + "\\n" + summary``.
  With OpenAI's remote compaction the summary is an opaque item ``{"type": "compaction",
  "encrypted_content": ...}`` instead.
* pi and omp: a user message ``"The conversation history before this point was compacted into the
  following summary:\\n\\n<summary>\\n...\\n</summary>"`` at the head, then the kept recent messages.
* hermes (``agent/context_compressor.py``): the first messages kept, then a message starting with
  ``"[CONTEXT COMPACTION — REFERENCE ONLY] ..."``, then the kept tail.
* opencode: ``"What did we do so far?"`` (the compaction request's user turn), the assistant's
  summary, then the conversation goes on.
"""

from __future__ import annotations

import churn as C
from bili_addon.kernel import compaction as K

SUMMARY = ("1. Primary Request and Intent: analyse modules 0-13. 2. Key Technical Concepts: module values, "
           "file rows. 3. Files: mod0.py..mod13.py read with cat. 4. Pending Tasks: continue with the next module.")


def claude_code_summary(summary: str = SUMMARY) -> str:
    return (f"{K.CLAUDE_CODE}. The conversation is summarized below:\n{summary}\n\nPlease continue the "
            "conversation from where we left it off without asking the user any further questions. Continue "
            "with the last task that you were asked to work on.")


def claude_code(after: list[C.Turn], sc: C.Scheme = C.Scheme(), summary: str = SUMMARY,
                extra: list[dict] = ()) -> list[dict]:
    """Claude Code's history after a compaction: the summary heads the first user message."""
    msgs = C.anthropic(after, sc, extra)
    head = {"type": "text", "text": claude_code_summary(summary)}
    if msgs and msgs[0]["role"] == "user" and isinstance(msgs[0]["content"], list):
        msgs[0] = {**msgs[0], "content": [head] + msgs[0]["content"]}
    else:
        msgs.insert(0, {"role": "user", "content": [head]})
    return msgs


def claude_code_alone(summary: str = SUMMARY) -> list[dict]:
    """The first request after an auto-compact in the middle of a task: the summary message only."""
    return [{"role": "user", "content": [{"type": "text", "text": claude_code_summary(summary)}]}]


def codex(before: list[C.Turn], after: list[C.Turn], sc: C.Scheme = C.Scheme(), summary: str = SUMMARY,
          remote: bool = False, extra: list[dict] = ()) -> list[dict]:
    """codex's compacted history: initial context, the old user messages, the summary; then on."""
    items: list[dict] = [{"type": "message", "role": "developer", "content": "You are an agent."}]
    for tr in before:
        items.append({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": tr.user + sc.suffix}]})
    if remote:
        items.append({"type": "compaction", "encrypted_content": "gAAAAB" + "x9" * 400})
    else:
        items.append({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": K.CODEX_PREFIX_FULL + "\n" + summary}]})
    return items + C.responses(after, sc, extra)[1:]


def pi(kept: list[C.Turn], sc: C.Scheme = C.Scheme(), summary: str = SUMMARY, extra: list[dict] = ()) -> list[dict]:
    msgs = C.chat(kept, sc, extra)
    text = f"{K.PI}\n\n<summary>\n{summary}\n</summary>"
    return msgs[:1] + [{"role": "user", "content": text}] + msgs[1:]


def hermes(head: list[C.Turn], tail: list[C.Turn], sc: C.Scheme = C.Scheme(), summary: str = SUMMARY,
           extra: list[dict] = ()) -> list[dict]:
    first = C.chat(head, sc)
    rest = C.chat(tail, sc, extra)[1:]
    note = {"role": "user", "content": "[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted into "
                                       "the summary below. " + summary}
    if first[-1]["role"] == "user":
        note["role"] = "assistant"
    return first + [note] + rest


def opencode(after: list[C.Turn], sc: C.Scheme = C.Scheme(), summary: str = SUMMARY, extra: list[dict] = ()):
    return ([{"role": "user", "content": [{"type": "text", "text": K.OPENCODE}]},
             {"role": "assistant", "content": [{"type": "text", "text": summary}]}]
            + C.anthropic(after, sc, extra))
