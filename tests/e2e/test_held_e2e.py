"""Held folds end to end (``bili_materialize=cost``, the default), through a real ``mitmdump --mode
reverse`` on the Anthropic lane: the model's ``compress`` is executed with the next request (its real
result, with the sentence saying the range will be replaced; decompress and search answer from the
block at once), the range stays on the wire, byte for byte, while rewriting the cache would not pay,
and leaves in one rewrite when the window forces it; from then on it stays folded."""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel.pending import SENTENCE

from .fake_upstream import proxy_call
from .support import assert_prefix_stable
from .test_fold_e2e import Turns, fold, make_agent, ran, reading, run_bash, say, summary_head

pytestmark = pytest.mark.e2e

COMPRESS_TURN = 8
TURNS = 24
FOLDED = (1, 2, 3, 4)


def script() -> list:
    acts = []
    for t in range(1, TURNS + 1):
        if t == COMPRESS_TURN:
            acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {t}: modules 1 to 4 are done, folding."))
        elif t == 10:
            acts.append(proxy_call("decompress", {"blockId": "b1"}, prose=f"Turn {t}: what did b1 hold again?"))
        elif t == 11:
            acts.append(proxy_call("search_context", {"query": "file-3-row-7"}, prose=f"Turn {t}: where is row 7?"))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: done."))
        else:
            acts.append(reading(t))
    return acts


@pytest.fixture(scope="module")
def held_proxy(make_proxy):
    # a small window, so that the growing session reaches its pressure share within the script
    return make_proxy("reverse", "fold", bili_materialize="cost", bili_context_window="14000")


def on_wire(body: bytes) -> set[int]:
    """The turns whose Bash call (and so its output) is on the wire (the decompress and search
    results quote folded output too, so the text alone does not tell)."""
    ids = {b["id"] for m in json.loads(body)["messages"] if isinstance(m["content"], list)
           for b in m["content"] if b.get("type") == "tool_use"}
    return {t for t in range(1, TURNS + 1) if f"toolu_s{t:03d}" in ids}


def test_a_held_fold_stays_until_the_window_forces_it_then_leaves_in_one_rewrite(fake, held_proxy, sid):
    fake.script(sid, script(), real_usage=True)
    agent = make_agent("anthropic", held_proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, COMPRESS_TURN + 2):
        agent.step(t, run_bash)
    assert ran(fake, held_proxy, sid, "compress") == 1
    rec = up[COMPRESS_TURN + 1]
    holder, result = agent.result_of(rec.json, agent.answers[COMPRESS_TURN].call)
    assert "→ b1" in result and SENTENCE in result, result
    assert set(FOLDED) <= on_wire(rec.body) and summary_head("b1") not in rec.body.decode()
    held = held_proxy.session(sid)["held"]  # /__bili/stats shows what waits, and why
    assert held["blocks"] == ["b1"] and held["decision"]["why"] == "pending"
    assert held["decision"]["cost"] > held["decision"]["benefit"] > 0

    prev, landed_at = rec.body, None
    for t in range(COMPRESS_TURN + 2, TURNS + 1):
        agent.step(t, run_bash)
        body = up[t].body
        if landed_at is None and summary_head("b1") not in body.decode():
            assert set(FOLDED) <= on_wire(body), f"turn {t}: the range is on the wire until it lands"
            assert_prefix_stable(prev, body, agent.conv_key)  # held: nothing of what was sent moves
            if t == 11:  # decompress (asked on turn 10) answered from the held block
                _, got = agent.result_of(up[t].json, agent.answers[10].call)
                assert got.startswith("b1 (tier 1) replaced original messages") and "file-2-row-" in got
            if t == 12:
                _, got = agent.result_of(up[t].json, agent.answers[11].call)
                assert "(inside b1)" in got and "file-3-row-7" in got
        elif landed_at is None:
            landed_at = t  # one rewrite: every folded turn leaves at once, the summary stands once
            assert body.decode().count(summary_head("b1")) == 1
            gone = on_wire(body)
            assert not gone & {1, 2, 3, 4} and {5, 6, 7} <= gone, gone
        else:
            assert body.decode().count(summary_head("b1")) == 1
            assert_prefix_stable(prev, body, agent.conv_key)  # landed, it stays
        prev = body
    assert landed_at is not None and landed_at > 12, "the window forced the landing within the script"
    assert ran(fake, held_proxy, sid, "compress") == 1
    held_proxy.wait_bili_lines(len(fake.find(lambda r: r.header("x-claude-code-session-id") == sid)), session=sid)
    assert f"session={sid}: held fold(s) b1 land in one rewrite (window)" in held_proxy.log()
    assert held_proxy.session(sid)["held"] is None
