"""Tool results a host cleared in place (Claude Code's clearing of old tool results, its
"microcompact": every result but the last five becomes ``[Old tool result content cleared]``, or a
``<persisted-output>`` note naming the file it saved the result to; the placeholder texts are the
ones in Claude Code 2.1.197's own code).  A folded result so cleared is the same message: the fold
over it stands (kernel/reconcile.py's "cleared" channel).  Before, ten or more cleared covered
results were a collapse: folding paused, and three requests later the folds over them retired."""

from __future__ import annotations

import json

from bili_addon.kernel import coverage
from bili_addon.kernel.reconcile import cleared
from test_native_branches import Agent, first_ref, last_ref, reads, said

CLEARED = "[Old tool result content cleared]"


def persisted(call_id: str) -> str:
    return (f"<persisted-output>Tool result saved to: /home/u/.claude/projects/p/tool-results/{call_id}.txt\n\n"
            "Use Read to view</persisted-output>")


def folded(agent: Agent, n: int = 15) -> list[dict]:
    """A's reads, the first ten of them folded (b1), and four of B's after: the history sent."""
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", n) + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    assert agent.compress(s, first_ref(s, 1), last_ref(s, 20)).startswith("Compressed")
    msgs += said("Folded.", "fine") + reads("B", 4)
    sent, s, res = agent.send(msgs)
    assert b"FILE A3" not in sent and b"FILE A12" in sent and not res.drift
    return msgs


def clear(msgs: list[dict], keep: int = 2, text=lambda cid: CLEARED) -> list[dict]:
    """``msgs`` with every tool result but the last ``keep`` cleared, as Claude Code clears them."""
    ids = [m["content"][0]["tool_use_id"] for m in msgs if _result(m)]
    gone = set(ids[:len(ids) - keep])
    return [{"role": "user", "content": [{**m["content"][0], "content": text(m["content"][0]["tool_use_id"])}]}
            if _result(m) and m["content"][0]["tool_use_id"] in gone else m for m in msgs]


def _result(m: dict) -> bool:
    return m["role"] == "user" and isinstance(m["content"], list) and m["content"][0].get("type") == "tool_result"


def _sent_results(sent: bytes) -> dict[str, str]:
    return {b["tool_use_id"]: b["content"] for m in json.loads(sent)["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"}


def test_a_fold_stands_over_results_the_host_cleared(tmp_path):
    agent = Agent(tmp_path)
    msgs = clear(folded(agent))
    for k in range(coverage.RETIRE_AFTER + 2):
        msgs += said(f"step {k}", f"go {k}")
        sent, s, res = agent.send(msgs)
        assert res.drift == ("transformed" if k == 0 else ""), (k, res.drift)
        b1 = next(b for b in s.blocks if b.id == "b1")
        assert b1.active and not b1.retired and not s.copy.latched
        results = _sent_results(sent)
        # the folded results stay folded (their placeholders too); the others go as the host sent them
        assert "tu_A3" not in results and "tu_A9" not in results
        assert results["tu_A12"] == CLEARED and "FILE B3" in results["tu_B3"]
        assert "Read the modules one at a time" in sent.decode()  # (the summary)
    assert s.flags.get("drift", {}).get("restarted", 0) == 0
    # decompress gives the results as they were, not the placeholders
    assert "FILE A3" in agent.eng.plugin_tool(s.row.id, "decompress", {"id": "b1"})[1]


def test_results_saved_to_a_file_are_cleared_results(tmp_path):
    agent = Agent(tmp_path)
    msgs = clear(folded(agent), text=persisted) + said("Saved.", "go on")
    sent, s, res = agent.send(msgs)
    assert res.drift == "transformed" and not s.copy.latched
    assert "tu_A3" not in _sent_results(sent) and "<persisted-output>" in _sent_results(sent)["tu_A12"]
    assert cleared(persisted("tu_A3")) and cleared(CLEARED)
    assert not cleared("[Old tool result content cleared] and more") and not cleared("<persisted-output>half")


def test_the_fold_over_cleared_results_stands_after_a_restart(tmp_path):
    agent = Agent(tmp_path)
    msgs = clear(folded(agent)) + said("Cleared.", "go on")
    agent.send(msgs)
    again = Agent(tmp_path)  # a new proxy on the same store
    msgs += said("Restarted.", "next")
    sent, s, res = again.send(msgs)
    assert res.drift in ("", "transformed") and not s.copy.latched
    assert "tu_A3" not in _sent_results(sent) and next(b for b in s.blocks if b.id == "b1").active


def test_a_cleared_result_whose_call_changed_is_not_claimed(tmp_path):
    """The host re-minted the calls' ids as it cleared their results: nothing verifies the cleared
    results are the folded ones (their call is not the copy's): no claim by this channel."""
    agent = Agent(tmp_path)
    msgs = clear(folded(agent))
    minted = json.loads(json.dumps(msgs).replace('"tu_A', '"tu_X'))
    sent, s, res = agent.send(minted + said("Minted.", "go on"))
    assert res.drift in ("drift", "collapse") and "tu_X3" in _sent_results(sent)


def test_a_cleared_result_named_twice_or_moved_is_not_claimed(tmp_path):
    agent = Agent(tmp_path)
    msgs = clear(folded(agent))
    # the id of A3's call also names another result (a per-answer id given twice): which is A3's is not known
    twice = msgs + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_A3", "content": CLEARED}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Twice."}]},
                    {"role": "user", "content": "go on"}]
    sent, s, res = agent.send(twice)
    kinds = [(m["role"], b.get("type")) for m in json.loads(sent)["messages"] if isinstance(m["content"], list)
             for b in m["content"] if "tu_A3" in (b.get("id"), b.get("tool_use_id"))]
    assert kinds == [("assistant", "tool_use"), ("user", "tool_result"), ("user", "tool_result")]
    assert res.drift == "drift" and "tu_A4" not in _sent_results(sent)  # (the others: claimed, folded)

    agent = Agent(tmp_path / "moved")
    msgs = clear(folded(agent))
    # A3's cleared result no longer right after its call: no claim for it
    k = next(i for i, m in enumerate(msgs) if _result(m) and m["content"][0]["tool_use_id"] == "tu_A3")
    moved = msgs[:k] + [{"role": "user", "content": "an aside"},
                        {"role": "assistant", "content": [{"type": "text", "text": "noted"}]}] + msgs[k:]
    sent, s, res = agent.send(moved + said("Moved.", "go on"))
    assert "tu_A3" in _sent_results(sent)


def test_a_result_changed_to_other_words_is_not_a_cleared_one(tmp_path):
    agent = Agent(tmp_path)
    msgs = clear(folded(agent), text=lambda cid: f"FILE {cid} rewritten by the host")
    sent, s, res = agent.send(msgs + said("Rewritten.", "go on"))
    assert res.drift == "collapse" and "tu_A3" in _sent_results(sent)


def test_opencode_pruned_outputs_in_a_chat_conversation(tmp_path):
    """opencode (1.18.33) sends a tool output it pruned as ``[Old tool result content cleared]`` (a
    Chat Completions ``tool`` message): the fold over it stands the same."""
    from bili_addon.kernel.turn import Engine
    from bili_addon.store import Store
    from bili_addon.wire import LANES

    eng = Engine(Store(tmp_path / "d"), window=200_000, activate="always", materialize="now")
    headers = {"x-acp-session": "opencode-pruned"}

    def reads_chat(n: int) -> list[dict]:
        out = []
        for i in range(n):
            out += [{"role": "assistant", "content": f"reading A{i}",
                     "tool_calls": [{"id": f"call_{i:04d}", "type": "function",
                                     "function": {"name": "read", "arguments": json.dumps({"f": f"A{i}"})}}]},
                    {"role": "tool", "tool_call_id": f"call_{i:04d}", "content": f"FILE A{i}\n" + f"row {i}\n" * 400}]
        return out

    def send(msgs):
        raw = json.dumps({"model": "gpt-4.1", "messages": msgs}).encode()
        res = eng.process(raw, LANES["chat"], headers, render=True)
        return res.body or raw, eng.sessions.get(res.session), res

    msgs = [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "Read the A modules."}]
    msgs += reads_chat(12) + [{"role": "assistant", "content": "All read."}, {"role": "user", "content": "ok"}]
    _, s, _ = send(msgs)
    got = eng.plugin_tool(s.row.id, "compress", {"content": [
        {"startId": first_ref(s, 1), "endId": last_ref(s, 16), "summary": "Read A0-A7; nothing to change. " * 3}]})[1]
    assert got.startswith("Compressed"), got
    sent, s, _ = send(msgs + [{"role": "assistant", "content": "Folded."}, {"role": "user", "content": "go"}])
    assert b"FILE A3" not in sent
    pruned = [{**m, "content": CLEARED} if m["role"] == "tool" and m["tool_call_id"] < "call_0010" else m for m in msgs]
    pruned += [{"role": "assistant", "content": "Folded."}, {"role": "user", "content": "go"},
               {"role": "assistant", "content": "Pruned."}, {"role": "user", "content": "next"}]
    for _ in range(coverage.RETIRE_AFTER + 1):
        pruned += [{"role": "assistant", "content": "More."}, {"role": "user", "content": "again"}]
        sent, s, res = send(pruned)
        assert not s.copy.latched and next(b for b in s.blocks if b.id == "b1").active, res.drift
    tools = {m["tool_call_id"]: m["content"] for m in json.loads(sent)["messages"] if m["role"] == "tool"}
    assert "call_0003" not in tools and tools["call_0009"] == CLEARED and "FILE A11" in tools["call_0011"]


def _rewound_into_b(agent: Agent, clear_branch: bool):
    """A's reads folded (b1), B's first ten (b2, its summary telling of B8 and B9), and a rewind to after
    B7: a branch that never had B8 and B9.  ``clear_branch``: the host clears the branch's old results
    from its second request on; else the copy holds them cleared and the branch has them whole."""
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", 20) + said("All read.", "ok") \
        + reads("B", 16) + said("B read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    b2 = {"startId": first_ref(s, 43), "endId": last_ref(s, 62),
          "summary": "Read B0 through B9; B8 and B9 define the retry policy (3 tries)."}
    out = agent.eng.plugin_tool(s.row.id, "compress", {"content": [b2]})[1]
    assert "b2" in out
    msgs += said("Folded.", "fine")
    if not clear_branch:
        msgs = clear(msgs, keep=5)
    sent, s, res = agent.send(msgs)
    assert b"FILE B3" not in sent and b"retry policy" in sent
    branch = msgs[:59] + said("B0-B7 read.", "Actually, read C now.") + reads("C", 4)
    return branch


def test_a_rewind_into_a_fold_stays_a_rewind_while_the_host_clears_the_branch(tmp_path):
    """The branch's cleared results stood early in its history: the rewind's point was taken there,
    the pass was a drift, and the fold over B8 and B9 went out on a branch that never had them,
    request after request (a misattribution)."""
    agent = Agent(tmp_path)
    branch = _rewound_into_b(agent, clear_branch=True)
    verdicts = []
    for t in range(10):
        branch = branch + said(f"step {t}", f"go {t}")
        sent, s, res = agent.send(clear(branch, keep=5) if t else branch)
        verdicts.append(res.drift)
        assert b"retry policy" not in sent, (t, res.drift)  # b2's summary stands for nothing on this branch
    assert verdicts[:7] == ["rewound"] * 7 and verdicts[7] == "adopted" and not s.copy.latched


def test_a_rewind_to_results_the_copy_holds_cleared_stays_a_rewind(tmp_path):
    agent = Agent(tmp_path)
    branch = _rewound_into_b(agent, clear_branch=False)  # (the branch: the results whole again)
    for t in range(3):
        branch = branch + said(f"step {t}", f"go {t}")
        sent, s, res = agent.send(branch)
        assert res.drift == "rewound" and b"retry policy" not in sent


def test_a_truncation_and_clearing_in_one_request_is_a_truncation(tmp_path):
    """The host dropped its oldest messages and cleared the results after them in the same request: the
    head after the cut is cleared results, and the truncation was not told (a drift, then a collapse that
    retired a fold)."""
    agent = Agent(tmp_path)
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", 30) + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    agent.compress(s, first_ref(s, 21), last_ref(s, 40))
    msgs += said("Folded.", "fine") + reads("B", 4)
    agent.send(msgs)
    cut = clear([msgs[0]] + msgs[11:])
    verdicts = []
    for k in range(coverage.RETIRE_AFTER + 1):
        cut += said(f"step {k}", f"go {k}")
        sent, s, res = agent.send(cut)
        verdicts.append(res.drift)
        assert "tu_A12" not in _sent_results(sent) and not s.copy.latched, (k, res.drift)
    assert verdicts[0] == "truncated" and not any(b.retired for b in s.blocks)


def test_claude_codes_rewind_into_a_fold_over_cleared_results_is_a_rewind(tmp_path):
    """A rewind (the history up to an earlier prompt and a new prompt) into a fold's range, the copy's old
    results cleared: its one-part head matched a cleared result of the copy and the rewind was read as a
    truncation; the fold cut by it was then kept whole at the branch's adoption and its summary went out
    for turns the branch never had."""
    agent = Agent(tmp_path)
    b1 = "B1SUM: read A0 through A9; A7 defines the retry policy (3 tries)."
    head = [{"role": "user", "content": "Task: read the A modules."}]
    msgs = head + reads("A", 5) + said("A0-A4 read.", "go on") + reads("A", 10)[10:] + said("A5-A9 read.", "go on") \
        + reads("B", 8) + said("B read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.eng.plugin_tool(s.row.id, "compress", {"content": [{"startId": first_ref(s, 1), "endId": last_ref(s, 22),
                                                             "summary": b1}]})
    msgs = clear(msgs + said("Folded.", "fine"), keep=5)
    sent, s, res = agent.send(msgs)
    assert b1.encode() in sent
    branch = msgs[:12] + [{"role": "user", "content": "Actually, read the C modules instead."}]
    verdicts = []
    for t in range(coverage.ADOPT_AFTER + 3):
        sent, s, res = agent.send(branch)
        verdicts.append(res.drift)
        assert b1.encode() not in sent, (t, res.drift)
        branch = branch + reads(f"C{t}_", 1)
    assert verdicts[:coverage.ADOPT_AFTER - 1] == ["rewound"] * (coverage.ADOPT_AFTER - 1)
    assert "adopted" in verdicts and "truncated" not in verdicts


def test_a_subagent_between_does_not_take_the_parents_cleared_results_for_its_head(tmp_path):
    """The parent's copy holds one fan-out of parallel reads, cleared: any head of a subagent that opens
    as the parent does (its turns under the parent's id) matched it and was read as a truncation; the
    parent's folded refs went into the copy's truncated ones and its fold never stood again."""
    agent = Agent(tmp_path)
    b1 = "B1SUM: read A0 through A9, one at a time; A7 defines the retry policy (3 tries)."
    first = {"role": "user", "content": "Task: read the modules."}

    def fanout(n: int) -> list[dict]:
        calls = [{"type": "tool_use", "id": f"tu_F{i}", "name": "Read", "input": {"f": f"F{i}"}} for i in range(n)]
        return [{"role": "assistant", "content": calls},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu_F{i}",
                                              "content": f"FILE F{i}\n" + f"row of F{i}\n" * 300} for i in range(n)]}]

    def clear_ids(msgs: list[dict], ids: set[str]) -> list[dict]:
        def blocks(m: dict) -> list[dict]:
            return [{**b, "content": CLEARED} if b.get("type") == "tool_result" and b["tool_use_id"] in ids else b
                    for b in m["content"]]
        return [{**m, "content": blocks(m)} if m["role"] == "user" and isinstance(m["content"], list) else m
                for m in msgs]

    parent = [first] + fanout(8) + said("Surveyed.", "now read A") + reads("A", 10) + said("A read.", "ok") \
        + reads("B", 6) + said("B read.", "ok")
    _, s, _ = agent.send(parent)
    assert "b1" in agent.eng.plugin_tool(s.row.id, "compress", {"content": [
        {"startId": first_ref(s, 5), "endId": last_ref(s, 24), "summary": b1}]})[1]
    parent = clear_ids(parent + said("Folded.", "fine"), {f"tu_F{i}" for i in range(8)})
    agent.send(parent)
    _, s, res = agent.send([first] + reads("S", 6))  # the subagent
    assert res.drift != "truncated" and not s.copy.truncated
    parent = clear_ids(parent + said("Back.", "go on"), {f"tu_A{i}" for i in range(10)})
    for t in range(4):
        sent, s, res = agent.send(parent)
        assert b1.encode() in sent and b'"tu_A3"' not in sent, (t, res.drift)
        parent = parent + said(f"step {t}", f"go {t}")
