"""Folds on a branch: a conversation whose host went back to an earlier point (a rewind cutting
through a folded range, kernel/reconcile.py).  The blocks the request does not render there are not
a native (MCP) call's to take in, nor the reminder's to offer, as for a call made on the wire; the
first native fold gives the conversation the canonical copy a rewind is told against; and the
branch's own folds keep their refs when a pass resolves it from scratch (a restart; a title request
no longer takes the conversation's previous pass)."""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

ANTH = LANES["anthropic"]
SID = {"x-claude-code-session-id": "6a1d2c3b-4e5f-4a6b-8c7d-9e0f1a2b3c4d"}
TOOLS = [{"name": "Read", "input_schema": {"type": "object"}}] + [
    {"name": f"mcp__bili__{n}", "input_schema": {"type": "object"}} for n in ("compress", "decompress")]
SUM = "Read the modules one at a time; each holds rows of its own and nothing needs a change. " * 2


def reads(tag: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "assistant", "content": [{"type": "text", "text": f"reading {tag}{i}"},
                                                  {"type": "tool_use", "id": f"tu_{tag}{i}", "name": "Read",
                                                   "input": {"f": f"{tag}{i}"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu_{tag}{i}",
                                              "content": f"FILE {tag}{i}\n" + f"row of {tag}{i}\n" * 400}]}]
    return out


def said(text: str, reply: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}, {"role": "user", "content": reply}]


class Agent:
    def __init__(self, tmp_path):
        self.eng = Engine(Store(tmp_path / "d"), window=200_000, activate="always", materialize="now")

    def send(self, msgs: list[dict]):
        raw = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "tools": TOOLS, "messages": msgs}).encode()
        res = self.eng.process(raw, ANTH, SID, render=True)
        return (res.body or raw), self.eng.sessions.get(res.session), res

    def compress(self, s, start: str, end: str) -> str:
        return self.eng.plugin_tool(s.row.id, "compress", {"content": [{"startId": start, "endId": end, "summary": SUM}]})[1]


def first_ref(s, k: int) -> str:
    return s.last_view.items[k].parts[0].ref


def last_ref(s, k: int) -> str:
    return s.last_view.items[k].parts[-1].ref


def rewound_with_c_folded(agent: Agent, turn_between: bool = True):
    """A's reads folded (b1), a rewind to the middle of them (b1 not rendered there), C's reads
    folded on the new branch (b2): the session and the size of its request with C folded."""
    head = [{"role": "user", "content": "Task: read the A modules."}]
    a = reads("A", 10)
    _, s, _ = agent.send(head + a + said("All read.", "ok"))
    assert agent.compress(s, first_ref(s, 1), last_ref(s, 20)).startswith("Compressed")
    if turn_between:
        agent.send(head + a + said("All read.", "ok") + said("Folded.", "fine"))
    branch = head + a[:10] + said("Half of A read.", "Actually, read the C modules now.")
    cur = branch + reads("C", 10) + said("C read.", "go on")
    _, s, res = agent.send(cur)
    assert res.drift == "rewound" and not s.copy.latched
    k = len(branch)
    assert "b2" in agent.compress(s, first_ref(s, k), last_ref(s, k + 19))
    cur += said("Noted.", "next")
    sent, s, res = agent.send(cur)
    assert b"FILE C3" not in sent  # C's reads are folded on this branch
    return s, cur, len(sent)


def test_a_native_distil_leaves_out_a_block_the_branch_does_not_show(tmp_path):
    agent = Agent(tmp_path)
    s, cur, size = rewound_with_c_folded(agent)
    assert s.last_snoozed == {"b1"}
    out = agent.compress(s, "b1", "b2")  # the model distils the summaries it is offered
    made = [b for b in s.blocks if b.active and b.tier == 2]
    assert made and "b1" not in made[0].consumed, out
    sent, s, _ = agent.send(cur + said("Yes.", "and?"))
    assert b"FILE C3" not in sent and len(sent) < size + 2_000  # C's fold stands (it came back whole before)


def test_the_reminder_offers_no_distil_over_a_block_the_branch_does_not_show(tmp_path):
    agent = Agent(tmp_path)
    s, cur, _ = rewound_with_c_folded(agent)
    cfg = agent.eng.nudge_cfg
    cfg.distil_tokens = cfg.distil_along_tokens = 10  # (any pile of two summaries is worth distilling)
    sent, s, _ = agent.send(cur + said("Yes.", "and?") + reads("D", 12) + said("D read.", "more"))
    text = json.dumps(json.loads(sent)["messages"])
    assert "[bili]" in text  # a reminder is given (D's reads can be folded)
    assert "b1\\u2013" not in text and "b1–" not in text  # not a pile starting at a summary not shown here


def test_a_rewind_right_after_the_first_native_fold_is_told_as_one(tmp_path):
    """The first fold made natively, between two requests, and the next request already a rewind into
    its range: told against the pass the fold was made on (not a collapse that pauses folding for the
    rest of the branch), and the new branch's own folds stand."""
    agent = Agent(tmp_path)
    s, cur, size = rewound_with_c_folded(agent, turn_between=False)
    assert not s.copy.latched and size < 8_000 * 4


def test_a_side_request_between_leaves_the_first_native_fold_its_conversations_copy(tmp_path):
    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules."}]
    a = reads("A", 10)
    _, s, _ = agent.send(head + a + said("All read.", "ok"))
    title = [{"role": "user", "content": "Generate a short title for this session: Task: read the A modules."}]
    _, s, res = agent.send(title)
    assert res.side
    assert agent.compress(s, first_ref(s, 1), last_ref(s, 20)).startswith("Compressed")
    assert len(s.copy.refs) == sum(len(it.parts) for it in s.last_view.items) > 20  # the conversation's pass


@pytest.mark.parametrize("between", ["title", "restart"])
def test_a_branchs_folds_keep_their_refs_when_it_is_resolved_from_scratch(tmp_path, between):
    """On a rewound branch the canonical copy stays the first branch's (so it can come back); a pass
    that resolves the branch from scratch (a title request took the conversation's previous pass; a
    restart) took the branch's folded messages for new instances of their words, gave them new refs,
    and the branch's fold was lost: its range back on the wire whole."""
    agent = Agent(tmp_path)
    s, cur, size = rewound_with_c_folded(agent)
    refs = [p.ref for it in s.last_view.items for p in it.parts]
    if between == "title":
        _, _, res = agent.send([{"role": "user", "content": "Generate a short title for this session: Task"}])
        assert res.side
    else:
        agent.eng.store.close()
        agent.eng = Engine(Store(tmp_path / "d"), window=200_000, activate="always", materialize="now")
    sent, s, res = agent.send(cur + said("Yes.", "and?"))
    assert [p.ref for it in s.last_view.items for p in it.parts][:len(refs)] == refs
    assert b"FILE C3" not in sent and len(sent) < size + 2_000


def test_a_side_request_leaves_the_conversations_previous_pass(tmp_path):
    agent = Agent(tmp_path)
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", 10) + said("All read.", "ok")
    agent.send(msgs)
    _, _, res = agent.send([{"role": "user", "content": "Generate a short title for this session: Task"}])
    assert res.side
    _, _, res = agent.send(msgs + said("Done.", "next"))
    assert res.reused >= len(msgs) - 1  # (the turn before read from its pass, as without the title: not from scratch)


def test_a_branch_that_lasts_is_the_conversation_and_the_first_branch_back_whole_stands_again(tmp_path):
    """After ``ADOPT_AFTER`` passes on a rewound branch the branch is the copy (no reconcile of the whole
    history, no warning, on every later pass); the first branch's fold it did not hold whole is parked
    and stands again when the agent goes back to that branch."""
    from bili_addon.kernel import coverage

    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules."}]
    a = reads("A", 10)
    first = head + a + said("All read.", "ok")
    _, s, _ = agent.send(first)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    first += said("Folded.", "fine")
    agent.send(first)
    cur = head + a[:10] + said("Half of A read.", "Actually, read the C modules now.") + reads("C", 10)
    verdicts = []
    for k in range(coverage.ADOPT_AFTER + 2):
        cur += said(f"C step {k}.", f"go {k}")
        _, s, res = agent.send(cur)
        verdicts.append(res.drift)
    assert verdicts == ["rewound"] * (coverage.ADOPT_AFTER - 1) + ["adopted", "", ""]
    b1 = next(b for b in s.blocks if b.id == "b1")
    assert b1.retired and s.copy.parked["blocks"] == ["b1"]
    sent, s, res = agent.send(first + said("Back on the first branch.", "go on"))
    assert b"FILE A3" not in sent and b1.active and s.flags["drift"]["unparked"] == 1


def test_a_distil_a_lasting_branch_cuts_through_gives_back_the_blocks_it_holds_whole(tmp_path):
    """A rewind into a distil's range (b3 absorbed b1 and b2; the branch holds b1's range whole, half
    of b2's): once the branch is the conversation, b1 stands again for A's reads (it was lost with the
    distil), and back on the first branch b3 stands again, b1 absorbed again."""
    from bili_addon.kernel import coverage

    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules, then the B modules."}]
    a, b = reads("A", 10), reads("B", 10)
    first = head + a + said("A read.", "now B") + b + said("B read.", "ok")
    _, s, _ = agent.send(first)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    agent.compress(s, first_ref(s, 23), last_ref(s, 42))
    first += said("Folded.", "fine")
    _, s, _ = agent.send(first)
    assert "b3" in agent.compress(s, "b1", "b2")
    first += said("Distilled.", "good")
    agent.send(first)
    cur = head + a + said("A read.", "now B") + b[:10] + said("Half of B read.", "Actually, stop and read C.")
    for k in range(coverage.ADOPT_AFTER):
        cur += said(f"C step {k}.", f"go {k}")
        sent, s, res = agent.send(cur)
    assert res.drift == "adopted"
    by_id = {x.id: x for x in s.blocks}
    assert by_id["b1"].active and by_id["b3"].retired and not by_id["b2"].active
    sent, s, res = agent.send(cur + said("more", "on"))
    assert res.drift == "" and b"FILE A3" not in sent and b"FILE B2" in sent
    first += said("Back.", "on")
    for k in range(3):  # (and it stays so: b1 absorbed again, not parked to swap back on the next pass)
        first += said(f"on {k}", f"more {k}")
        sent, s, res = agent.send(first)
        assert by_id["b3"].active and not by_id["b1"].active and not by_id["b1"].retired
        assert b"FILE A3" not in sent and b"FILE B7" not in sent and s.flags["drift"]["unparked"] == 1
