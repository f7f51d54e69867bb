"""A pause a collapse latched (the history matches no fold: kernel/reconcile.py) ends after
``coverage.RETIRE_AFTER`` passes in a row: the folds the history lacks retire (still decompressible
and searchable), the ones it holds whole stay, and folding starts over on the history as it is.  A
marathon session whose host went back past its compaction, or rebuilt its history past every
channel's verification, went on unfolded for good."""

from __future__ import annotations

from bili_addon.kernel import coverage
from test_native_branches import Agent, first_ref, last_ref, reads, said


def test_folding_starts_over_after_a_collapse_that_does_not_end(tmp_path):
    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules."}]
    msgs = head + reads("A", 10) + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    assert agent.compress(s, first_ref(s, 1), last_ref(s, 20)).startswith("Compressed")
    sent, s, _ = agent.send(msgs + said("Folded.", "fine"))
    assert b"FILE A3" not in sent
    # the host goes on with a history none of whose folded messages it holds any more, nor anything the
    # copy can tell a rewind or a truncation by (another first message)
    other = [{"role": "user", "content": "Task: read the B modules."}] + reads("B", 12)
    verdicts = []
    for k in range(coverage.RETIRE_AFTER):
        other += said(f"B step {k}.", f"go on {k}")
        _, s, res = agent.send(other)
        verdicts.append(res.drift)
    assert verdicts == ["collapse"] * (coverage.RETIRE_AFTER - 1) + ["restarted"]
    assert not s.copy.latched and s.flags["drift"]["restarted"] == 1
    b1 = next(b for b in s.blocks if b.id == "b1")
    assert b1.retired and not b1.active
    assert "b1" in agent.eng.plugin_tool(s.row.id, "decompress", {"id": "b1"})[1]  # (still there to read)
    # folding goes on: a fold of the new history stands on the next request
    assert "b2" in agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    sent, s, res = agent.send(other + said("Done.", "next"))
    assert res.drift == "" and b"FILE B3" not in sent and b"FILE B11" in sent


def test_a_collapse_that_ends_before_keeps_every_fold(tmp_path):
    """The host's odd request in between (a history that matches nothing, then the conversation
    again): the pause ends when the history aligns again, and nothing retires."""
    agent = Agent(tmp_path)
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", 10) + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    msgs += said("Folded.", "fine")
    agent.send(msgs)
    other = [{"role": "user", "content": "Task: read the B modules."}] + reads("B", 12)
    for k in range(coverage.RETIRE_AFTER - 1):
        _, s, res = agent.send(other + said(f"B step {k}.", f"go on {k}"))
        assert res.drift == "collapse"
    sent, s, res = agent.send(msgs + said("Back.", "again"))
    assert res.drift == "recovered" and b"FILE A3" not in sent
    assert not any(b.retired for b in s.blocks)
