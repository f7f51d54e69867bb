"""Distilling after the host truncated its oldest slice: the new block's covered refs keep
conversation order, the truncated ones where their block had them (first), so the block is the tail
of its range as a truncation leaves one (reconcile.not_a_tail) and stands on the wire.  Sorted after
everything, they made it "not a tail": never rendered, and the two folds it absorbed came back whole."""

from __future__ import annotations

from test_native_branches import Agent, first_ref, last_ref, reads, said


def test_a_distil_after_a_truncation_stands(tmp_path):
    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules."}]
    msgs = head + reads("A", 10) + said("A read.", "now B") + reads("B", 10) + said("B read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    agent.compress(s, first_ref(s, 23), last_ref(s, 42))
    msgs += said("Folded.", "fine")
    folded, s, _ = agent.send(msgs)
    cut = head + msgs[9:] + said("ok", "go")  # the host drops A0..A3 (the opening stays)
    sent, s, res = agent.send(cut)
    assert res.drift == "truncated" and len(sent) < len(folded) + 1_000
    b1 = next(b for b in s.blocks if b.id == "b1")
    out = agent.compress(s, "b1", "b2")
    b3 = next(b for b in s.blocks if b.id == "b3")
    assert b3.covered[:len(s.copy.truncated)] == sorted(s.copy.truncated) == b1.covered[:len(s.copy.truncated)]
    assert out.startswith(f"Compressed {b1.covered[0]}–")  # (its range named from its first ref, not a middle one)
    cut += said("Distilled.", "more")
    sent, s, res = agent.send(cut)
    assert not s.last_snoozed and b"FILE A5" not in sent and b"FILE B5" not in sent
    assert len(sent) < len(folded) + 1_000
