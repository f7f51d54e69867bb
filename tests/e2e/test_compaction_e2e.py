"""Marathon sessions end to end: the agent's own compaction in the middle of a 60-turn session,
through a real ``mitmdump --mode reverse`` with the bili addon; folding goes on after it.

The agent loop of ``support.Agent`` (Claude Code's shape on the Messages lane, codex's on
Responses).  Turns 1-24 read modules, turn 10 folds turns 1-6 (b1).  Turn 25 is the agent's
compaction request (its summarisation prompt after the whole history); the model answers with the
summary and the agent replaces its history the way it does for real (tests/compactions.py):
Claude Code with one user message that starts "This session is being continued ...", codex with
the old user messages and its summary prefix.  Turns 26-58 read on, turn 45 folds turns 27-38
(b2, in the new epoch), turn 59 decompresses b1 (a block of the old epoch), turn 60 ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from bili_addon.kernel import compaction as K

from .fake_upstream import Act, proxy_call, say
from .support import AGENTS
from .test_fold_e2e import Turns, bash_output, fold, reading, run_bash, session_of, summary_head

pytestmark = pytest.mark.e2e

TURNS = 60
COMPACT_TURN = 25
TASK = "Please audit this repository module by module and report anything suspicious."
SUMMARY = ("Primary request: audit the repository module by module. Modules 1 to 24 were read; modules 1-6 "
           "hold plain data classes; nothing suspicious so far. Next: module 26 onwards.")
ASK = "Your task is to create a detailed summary of the conversation so far."


def script() -> list[Act]:
    acts: list[Act] = []
    for t in range(1, TURNS + 1):
        if t == 10:
            acts.append(proxy_call("compress", fold(1, 6, 1), prose=f"Turn {t}: modules 1 to 6 are done, folding."))
        elif t == COMPACT_TURN:
            acts.append(say(SUMMARY))
        elif t == 45:
            acts.append(proxy_call("compress", fold(27, 38, 2), prose=f"Turn {t}: modules 27 to 38 are done."))
        elif t == 59:
            acts.append(proxy_call("decompress", {"blockId": "b1"}, prose=f"Turn {t}: what did b1 hold again?"))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: the audit is complete, nothing suspicious."))
        else:
            acts.append(reading(t))
    return acts


def ask_for_summary(agent) -> None:
    """The compaction request: the summarisation prompt joins the last user turn (Claude Code) or
    follows as a user message (codex)."""
    if agent.lane == "anthropic":
        last = agent.history[-1]
        agent.history[-1] = {**last, "content": list(last["content"]) + [{"type": "text", "text": ASK}]}
    else:
        agent.history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]})


def compact(agent, summary: str) -> None:
    """The agent replaces its history with its compacted form."""
    if agent.lane == "anthropic":
        text = (f"{K.CLAUDE_CODE}. The conversation is summarized below:\n{summary}\n\nPlease continue the "
                "conversation from where we left it off without asking the user any further questions.")
        agent.history = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    else:
        users = [it for it in agent.history if it.get("type") == "message" and it.get("role") == "user"
                 and it["content"][0]["text"] != ASK]
        note = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": K.CODEX_PREFIX_FULL + "\n" + summary}]}
        agent.history = users + [note]


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold")


@pytest.mark.parametrize("lane", ["anthropic", "responses"])
def test_a_compaction_in_the_middle_of_a_60_turn_session_folds_before_and_after(fake, proxy, sid, lane):
    fake.script(sid, script(), real_usage=True)
    agent = AGENTS[lane](proxy.url, sid, sid, TASK, stream=True)
    up = Turns(fake, sid)

    for t in range(1, COMPACT_TURN):
        agent.step(t, run_bash)
        up[t]
    before = up[11].body.decode()  # folded before the compaction
    assert before.count(summary_head("b1")) == 1
    assert all(f"file-{t}-row-" not in before for t in range(1, 7)) and "file-7-row-" in before

    ask_for_summary(agent)
    agent.step(COMPACT_TURN, run_bash)
    assert up[COMPACT_TURN].body.decode().count(summary_head("b1")) == 1  # the agent summarises the folded view
    compact(agent, SUMMARY)

    for t in range(COMPACT_TURN + 1, TURNS + 1):
        agent.step(t, run_bash)
        up[t]
    first = up[COMPACT_TURN + 1].body.decode()
    assert summary_head("b1") not in first  # the old epoch's block left the wire
    assert K.CLAUDE_CODE[:40] in first or K.CODEX[:40] in first

    after = up[46].body.decode()  # folded after the compaction
    assert after.count(summary_head("b2")) == 1 and summary_head("b1") not in after
    assert all(f"file-{t}-row-" not in after for t in range(27, 39))
    assert "file-39-row-" in after and "file-26-row-" in after
    assert json.dumps(SUMMARY)[1:40] in after  # the agent's summary stays: the fold took turns 27-38

    last = up[TURNS].body.decode()  # the old epoch's block still answers decompress
    assert "b1 (tier 1) replaced original messages" in last and json.dumps(bash_output(3))[1:40] in last

    proxy.wait_bili_lines(len(fake.find(session_of(sid))), session=sid)
    log = proxy.log()
    assert re.search(rf"session={re.escape(sid)}: the agent compacted its history \((claude-code|codex) summary", log)
    assert f"session={sid}: the re-sent history no longer matches any fold" not in log
    stats = proxy.session(sid)
    assert stats["fold"]["epoch"] == 2 and stats["fold"]["blocks_retired"] == 1
    assert stats["fold"]["epochs"][0]["retired_blocks"] == ["b1"]
    assert stats["fold"]["blocks"] == 1 and not stats["fold"]["paused"]
