"""Forks and rewinds end to end, through a real ``mitmdump --mode reverse`` with the bili addon.

A scripted conversation folds (turn 8 compresses turns 1-4, turn 9 carries the fold), then the
agent forks it the way Claude Code (``--resume <id> --fork-session``) and codex (``exec fork``)
do: the whole stored history goes out again under a new conversation id.  The fork's first
request must carry the parent's fold, the parent's compress result and the parent's refs, byte
for byte; afterwards each conversation folds on its own.  An agent without a session id (hermes,
pi) that drops a turn keeps its session.
"""

from __future__ import annotations

import copy

import pytest

from .fake_upstream import Act, proxy_call, say
from .support import AGENTS, Agent, assert_prefix_stable, tags_by_text
from .test_fold_e2e import (
    COMPRESS_TURN,
    TASK,
    Turns,
    assert_folded,
    bash_output,
    fold,
    reading,
    run_bash,
    summary_head,
)

pytestmark = pytest.mark.e2e

FORK_LANES = ["anthropic", "responses"]  # Claude Code's and codex's shapes: the agents that fork


def parent_script() -> list[Act]:
    acts = [reading(t) for t in range(1, 8)]
    acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {COMPRESS_TURN}: modules 1 to 4 are done, folding."))
    acts += [reading(9), reading(10), reading(11)]
    acts.append(proxy_call("compress", fold(5, 9, 2), prose="Turn 12: the parent folds modules 5 to 9."))
    acts += [reading(13), say("Turn 14: done.")]
    return acts


def fork_script() -> list[Act]:
    acts: list[Act] = [say(f"unused turn {t}") for t in range(1, 11)]  # the parent answered these
    acts.append(proxy_call("decompress", {"blockId": "b1"}, prose="Turn 11: what did b1 hold again?"))
    acts.append(proxy_call("compress", fold(5, 9, 2), prose="Turn 12: the fork folds modules 5 to 9."))
    acts += [reading(13), say("Turn 14: done.")]
    return acts


def agent(lane: str, proxy, sid: str, script: str) -> Agent:
    return AGENTS[lane](proxy.url, sid, script, TASK, stream=True)


def fork_of(parent: Agent, proxy, sid: str, script: str) -> Agent:
    """What the agent's fork command does: a new conversation id with the stored history."""
    child = agent(parent.lane, proxy, sid, script)
    child.history = copy.deepcopy(parent.history)
    return child


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def proxy(make_proxy, request):
    """Once per store backend (on PostgreSQL an answer's lineage goes with its records, one statement)."""
    if request.param == "postgresql":
        return make_proxy("reverse", "fold", bili_store=request.getfixturevalue("pg_server").fresh())
    return make_proxy("reverse", "fold")


@pytest.mark.parametrize("lane", FORK_LANES)
def test_a_fork_keeps_the_fold_and_then_goes_its_own_way(fake, proxy, sid, lane):
    fake.script(sid, parent_script())
    fake.script(f"{sid}-fork", fork_script(), id_prefix="f")
    parent = agent(lane, proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, 11):
        parent.step(t, run_bash)
    p10 = up[10]
    assert_folded(p10.body)

    # -- the fork's first request: the parent's fold, result and refs, byte for byte
    child = fork_of(parent, proxy, f"{sid}-fork", f"{sid}-fork")
    fup = Turns(fake, f"{sid}-fork")
    child.step(11, run_bash)
    f11 = fup[11]
    assert_folded(f11.body)
    assert f11.body.decode().count(summary_head("b1")) == 1
    compress_call = parent.answers[COMPRESS_TURN].call
    p_holder, p_result = parent.result_of(p10.json, compress_call)
    f_holder, f_result = child.result_of(f11.json, compress_call)
    assert f_result == p_result and f_result.startswith("Compressed m") and f_holder == p_holder
    assert parent.unknown_error.format(name="compress") not in f11.body.decode()
    p_refs, f_refs = tags_by_text(p10.json), tags_by_text(f11.json)
    assert p_refs and all(f_refs.get(text) == ref for text, ref in p_refs.items())
    assert_prefix_stable(p10.body, f11.body, parent.conv_key)  # the provider's cache holds for the fork
    new = set(f_refs.values()) - set(p_refs.values())
    assert new and min(new) > max(p_refs.values())
    family = proxy.session(f"{sid}-fork")["lineage"]
    assert family["parent"] == sid and family["root"] == sid
    assert f"{sid}-fork" in proxy.session(sid)["lineage"]["children"]

    # -- decompress of the parent's block in the fork: the original bytes
    child.step(12, run_bash)
    f12 = fup[12]
    _, result = child.result_of(f12.json, child.answers[11].call)
    assert result.startswith("b1 (tier 1) replaced original messages"), result[:200]
    for t in (1, 2, 3, 4):
        assert bash_output(t) in result

    # -- the fork folds modules 5-9: the parent's next request is what it was
    child.step(13, run_bash)
    f13 = fup[13]
    text = f13.body.decode()  # (the decompress result above holds modules 1-4 again)
    assert text.count(summary_head("b2")) == 1 and text.count(summary_head("b1")) == 1, child.result_of(f13.json, child.answers[12].call)[1]
    assert all(f"file-{t}-row-" not in text for t in (5, 6, 7, 9)) and "file-10-row-" in text
    parent.resend(10)
    assert up.all(10)[-1].body == p10.body
    parent.step(11, run_bash)
    p11 = up[11]
    assert_folded(p11.body, kept=(5, 6, 7, 9, 10))  # the fork's b2 is not the parent's
    assert summary_head("b2") not in p11.body.decode()
    assert_prefix_stable(p10.body, p11.body, parent.conv_key)

    # -- ... and the other way round: the parent folds 5-9 itself; the fork's request is unchanged
    parent.step(12, run_bash)
    parent.step(13, run_bash)
    assert_folded(up[13].body, folded=(1, 2, 3, 4, 5, 6, 7, 9), kept=(10, 11), blocks=("b1", "b2"))
    child.resend(13)
    assert fup.all(13)[-1].body == f13.body
    # no ref is given twice in the family: a ref both show names the same words in both
    named: dict[str, str] = {}
    for body in (up[13].json, f13.json):
        for text, ref in tags_by_text(body).items():
            assert named.setdefault(ref, text) == text, ref


@pytest.mark.parametrize("lane", FORK_LANES)
def test_conversations_that_only_open_alike_stay_apart(fake, proxy, sid, lane):
    fake.script(sid, parent_script())
    parent = agent(lane, proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, 10):
        parent.step(t, run_bash)
    assert_folded(up[9].body)
    # another task started the same way: the same system prompt and first message
    other_acts = [reading(t) for t in range(1, 4)]
    other_acts[0] = say("Turn 1: where should I start?")
    fake.script(f"{sid}-other", other_acts + [say("Turn 4: done.")], id_prefix="o")
    other = agent(lane, proxy, f"{sid}-other", f"{sid}-other")
    oup = Turns(fake, f"{sid}-other")
    other.step(1, run_bash)
    other.history += other.initial("Start with the README, please.")
    other.step(2, run_bash)
    o2 = oup[2]
    assert summary_head("b1") not in o2.body.decode()
    refs = sorted(tags_by_text(o2.json).values())
    assert refs[0] == "m00001" and len(refs) == len(set(refs))
    assert set(refs) <= {f"m{i:05d}" for i in range(1, 10)}, refs  # its own counter, from 1
    s = proxy.session(f"{sid}-other")
    assert "lineage" not in s and s["fold"]["blocks_total"] == 0


def test_an_idless_agent_that_drops_a_turn_keeps_its_session(fake, proxy, sid):
    """Like hermes or pi on the Chat lane: no session id, matched by the history itself."""
    fake.script(sid, parent_script())
    task = f"{TASK} ({sid})"  # a history of its own
    a = AGENTS["chat"](proxy.url, "", sid, task, stream=True)
    up = Turns(fake, sid)
    lines = len(proxy.bili_lines())
    for t in range(1, 11):
        a.step(t, run_bash)
    assert_folded(up[10].body)
    sessions = {m.group(1) for m in proxy.wait_bili_lines(lines + 10)[lines:]}
    assert len(sessions) == 1
    # the agent drops turn 9's answer and goes on from turn 9's request with a new user message
    a.history = list(a.sent[9]) + [{"role": "user", "content": "Skip module 9; continue with the next one."}]
    a.step(11, run_bash)
    u11 = up[11]
    assert_folded(u11.body, kept=(5, 6, 7))
    _, result = a.result_of(u11.json, a.answers[COMPRESS_TURN].call)
    assert result.startswith("Compressed m")
    before = tags_by_text(up[9].json)
    after = tags_by_text(u11.json)
    assert before and all(after.get(text) == ref for text, ref in before.items())
    # and back to the first branch
    u10 = up[10].body
    a.resend(10)
    assert up.all(10)[-1].body == u10
    got = {m.group(1) for m in proxy.wait_bili_lines(lines + 12)[lines:]}
    assert got == sessions, got
    assert all(m.group(2) == "chat" for m in proxy.bili_lines()[lines:])
