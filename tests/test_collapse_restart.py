"""A pause a collapse latched (the history matches no fold: kernel/reconcile.py) ends after
``coverage.RETIRE_AFTER`` passes in a row: the folds the history lacks retire (still decompressible
and searchable), the ones it holds whole stay, and folding starts over on the history as it is.  A
marathon session whose host went back past its compaction, or rebuilt its history past every
channel's verification, went on unfolded for good."""

from __future__ import annotations

import json

from bili_addon.kernel import coverage
from test_native_branches import ANTH, SID, TOOLS, Agent, first_ref, last_ref, reads, said


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


def _folded_a(agent: Agent) -> list[dict]:
    msgs = [{"role": "user", "content": "Task: read the A modules."}] + reads("A", 10) + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    assert agent.compress(s, first_ref(s, 1), last_ref(s, 20)).startswith("Compressed")
    msgs += said("Folded.", "Now explore the B modules with an agent.")
    sent, s, _ = agent.send(msgs)
    assert b"FILE A3" not in sent
    return msgs


def test_the_conversation_back_whole_takes_its_folds_back_after_another_ones_turns(tmp_path):
    """A Claude Code subagent whose requests name no agent id (an older version) sends its own
    conversation under its parent's id: the pause ends while it runs (its turns get folding of their
    own), and when the parent's history comes back whole its folds stand again, as they were."""
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    verdicts = []
    for k in range(8):
        sub += reads(f"B{k}_", 1)
        _, s, res = agent.send(sub)
        if len(sub) >= 10:
            verdicts.append(res.drift)
    assert verdicts[:3] == ["collapse", "collapse", "restarted"]
    msgs += said("Spawning.", "Agent report: B has 8 modules.")
    sent, s, res = agent.send(msgs)
    assert b"FILE A3" not in sent and next(b for b in s.blocks if b.id == "b1").active
    assert s.flags["drift"]["unparked"] == 1 and not s.copy.latched
    sent, s, res = agent.send(msgs + said("Noted.", "go on"))
    assert res.drift == "" and b"FILE A3" not in sent


def test_a_claude_code_subagent_naming_its_agent_is_a_session_of_its_own(tmp_path):
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    eng = agent.eng
    sub = [{"role": "user", "content": "Find every B module and report."}]
    system = [{"type": "text", "text": "You are an agent for Claude Code, Anthropic's official CLI for Claude."}]
    headers = {**SID, "x-claude-code-agent-id": "agent-7f3e"}
    for k in range(6):
        sub += reads(f"B{k}_", 1)
        raw = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "system": system, "tools": TOOLS,
                          "messages": sub}).encode()
        res = eng.process(raw, ANTH, headers, render=True)
        assert res.session == SID["x-claude-code-session-id"] + "|sub:agent-7f3e" and not res.drift
    sent, s, res = agent.send(msgs + said("Spawning.", "Agent report: B has 6 modules."))
    assert res.drift == "" and b"FILE A3" not in sent and "drift" not in s.flags
    # the main agent's own requests stay its conversation's, headers or not
    main = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]
    raw = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "system": main, "tools": TOOLS,
                      "messages": msgs + said("Yes.", "more")}).encode()
    assert eng.process(raw, ANTH, headers, render=True).session == SID["x-claude-code-session-id"]


def test_a_lasting_drift_then_one_odd_request_is_a_pause_not_a_start_over(tmp_path):
    """Drift passes (a covered tool result the host rewrote in place) do not count toward ending a
    pause: one odd request after them is a pause, and the conversation back with its drift holds its
    folds as it did before the odd request (nothing retires)."""
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    cleared = [dict(m) for m in msgs]
    cleared[6] = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_A2",
                                               "content": "FILE A2 (the host rewrote this result)"}]}
    for k in range(coverage.RETIRE_AFTER + 1):
        cleared += said(f"step {k}", f"go {k}")
        _, s, res = agent.send(cleared)
        assert res.drift == "drift"
    other = [{"role": "user", "content": "Task: read the C modules."}] + reads("C", 12) + said("C", "go")
    _, s, res = agent.send(other)
    assert res.drift == "collapse"
    for k in range(coverage.RETIRE_AFTER):
        cleared += said(f"back {k}", f"again {k}")
        sent, s, res = agent.send(cleared)
    assert not s.copy.latched and not any(b.retired for b in s.blocks) and b"FILE A5" not in sent


def test_a_branch_rewound_from_the_copy_ends_a_pause(tmp_path):
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    other = [{"role": "user", "content": "Task: read the B modules."}] + reads("B", 12) + said("B", "go")
    _, s, res = agent.send(other)
    assert res.drift == "collapse" and s.copy.latched
    cur = msgs[:11] + said("Half of A read.", "Actually, read the C modules now.") + reads("C", 10) + said("C.", "go")
    _, s, res = agent.send(cur)
    assert res.drift == "rewound" and not s.copy.latched
    assert "b2" in agent.compress(s, first_ref(s, 13), last_ref(s, 32))
    sent, s, res = agent.send(cur + said("x", "y"))
    assert b"FILE C3" not in sent


def test_a_parked_conversation_is_waited_for_a_while_only(tmp_path, monkeypatch):
    """The parked copy is written with the session's copy on every turn: it goes once the conversation
    has not come back for ``PARKED_PASSES`` passes (its blocks stay retired, decompressible)."""
    monkeypatch.setattr(coverage, "PARKED_PASSES", 4)
    agent = Agent(tmp_path)
    _folded_a(agent)
    sub = [{"role": "user", "content": "Task: read the B modules."}] + reads("B", 5)
    seen = []
    for k in range(coverage.RETIRE_AFTER + 4):
        sub += said(f"B step {k}.", f"go on {k}")
        _, s, res = agent.send(sub)
        seen.append(bool(s.copy.parked))
    assert seen == [False] * (coverage.RETIRE_AFTER - 1) + [True] * 4 + [False]
    assert next(b for b in s.blocks if b.id == "b1").retired


def test_back_whole_a_parked_block_puts_aside_a_later_fold_over_its_messages(tmp_path):
    """A fold made on the other history over messages the two share: when the parked block stands
    again, that fold is put aside in its place (one summary per message)."""
    agent = Agent(tmp_path)
    hist_a = _folded_a(agent)
    hist_x = _other_history(agent, hist_a)
    _, s, _ = agent.send(hist_x)
    assert "b2" in agent.compress(s, first_ref(s, 1), last_ref(s, 10))
    agent.send(hist_x + said("x folded", "ok"))
    hist_a += said("Back.", "again")
    for k in range(3):  # (and it stays so: b2, whole here, retires for good rather than wait its turn to swap)
        hist_a += said(f"on {k}", f"more {k}")
        sent, s, res = agent.send(hist_a)
        assert {b.id for b in s.blocks if b.active} == {"b1"} and "b2" not in s.copy.parked.get("blocks", ())
        assert json.loads(sent)["messages"][1]["content"][0]["text"].startswith("[Compressed conversation section b1")
    assert s.flags["drift"]["unparked"] == 1


def test_a_parked_copy_is_waited_for_only_with_blocks_to_give_back(tmp_path):
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    for k in range(8):
        sub += reads(f"B{k}_", 1)
        _, s, res = agent.send(sub)
    msgs += said("Spawning.", "Agent report: B has 8 modules.")
    _, s, res = agent.send(msgs)
    assert s.flags["drift"]["unparked"] == 1
    assert s.copy.parked == {} and "parked" not in s.copy.to_json()  # (the subagent's copy: nothing of it to wait for)


def test_a_copy_without_the_later_fields_reads_in_an_older_bili_and_a_later_ones_fields_are_ignored():
    from bili_addon.kernel.reconcile import Copy

    doc = Copy(refs=["m00001"], fps=["f"], items=[0], ids=["h"], truncated=["m00009"], latched=True).to_json()
    assert not any(k in doc for k in ('"branch"', '"paused"', '"branched"', '"parked"'))
    later = json.loads(doc) | {"some_later_field": 1}
    back = Copy.from_json(json.dumps(later))
    assert (back.refs, back.truncated, back.latched) == (["m00001"], ["m00009"], True)


def test_back_after_its_own_truncation_the_parked_conversation_stands_again(tmp_path):
    """The conversation's host had dropped its oldest slice (part of b1's range: the copy holds those
    refs as truncated, and b1 stood for the rest); back after another conversation's turns, b1 is
    taken back as the steady pass of that copy takes it."""
    agent = Agent(tmp_path)
    msgs = _folded_a(agent) + reads("K", 6) + said("K read.", "go")
    agent.send(msgs)
    cut = msgs[:1] + msgs[7:21] + msgs[21:] + said("t", "u")  # the host drops A0..A2
    _, s, res = agent.send(cut)
    assert res.drift == "truncated"
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    for k in range(8):
        sub += reads(f"B{k}_", 1)
        agent.send(sub)
    sent, s, res = agent.send(cut + said("Back.", "again"))
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A5" not in sent


def test_back_with_a_drift_of_its_own_the_parked_conversation_stands_again(tmp_path):
    """The conversation held its fold in part before another conversation's turns parked it (a covered
    tool result the host rewrote in place: a lasting drift): back as it was, checked against its copy
    it is no collapse, and its fold stands again (it waited for a wholeness it never had)."""
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    cleared = [dict(m) for m in msgs]
    cleared[6] = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_A2",
                                               "content": "FILE A2 (the host rewrote this result)"}]}
    sent, s, res = agent.send(cleared)
    assert res.drift == "drift" and b"FILE A5" not in sent
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    for k in range(8):
        sub += reads(f"B{k}_", 1)
        agent.send(sub)
    assert next(b for b in agent.eng.sessions.get(s.row.id).blocks if b.id == "b1").retired
    sent, s, res = agent.send(cleared + said("Back.", "again"))
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A5" not in sent
    assert s.flags["drift"]["unparked"] == 1


def test_a_subagents_turns_never_take_the_parked_parent_back(tmp_path):
    agent = Agent(tmp_path)
    _folded_a(agent)
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    for k in range(12):
        sub += reads(f"B{k}_", 1)
        _, s, res = agent.send(sub)
    assert next(b for b in s.blocks if b.id == "b1").retired and "unparked" not in s.flags["drift"]


def _other_history(agent: Agent, hist_a: list[dict], first: dict | None = None) -> list[dict]:
    """A history of another opening (``first``) holding half of A's reads, whose turns end the pause (b1
    parked)."""
    first = first or {"role": "user", "content": "Continue the task: read the A modules (resumed)."}
    hist_x = [first] + hist_a[1:11] + reads("X", 6)
    for k in range(coverage.RETIRE_AFTER):
        hist_x += said(f"x {k}", f"go {k}")
        _, s, res = agent.send(hist_x)
    assert res.drift == "restarted" and s.copy.parked["blocks"] == ["b1"]
    return hist_x


def _says_the_parked_words_again(agent: Agent, hist_x: list[dict]) -> None:
    """The other history folds its share (b2), then its model says again the words b1 covers ("reading
    A5".."A9", with reads of its own): b1 stays parked, b2 stands."""
    _, s, _ = agent.send(hist_x)
    agent.compress(s, first_ref(s, 1), last_ref(s, 10))
    hist_x += said("x folded", "ok")
    for n in range(5, 10):
        hist_x += [{"role": "assistant", "content": [{"type": "text", "text": f"reading A{n}"},
                                                     {"type": "tool_use", "id": f"tu_XA{n}", "name": "Read",
                                                      "input": {"f": f"A{n} again"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu_XA{n}",
                                                 "content": f"FILE A{n} (new)\\nrow"}]}]
    for k in range(2):
        hist_x += said(f"Read again {k}.", f"go on {k}")
        _, s, res = agent.send(hist_x)
        assert {b.id for b in s.blocks if b.active} == {"b2"} and "unparked" not in s.flags["drift"]


def test_another_historys_fold_put_aside_never_stands_on_this_one(tmp_path):
    """b2, made on the other history over A0..A4 and its own X0, is put aside when this conversation is
    back; this history holds most of b2's messages, but b2 comes back only whole (it tells of X0)."""
    agent = Agent(tmp_path)
    hist_a = _folded_a(agent)
    hist_x = _other_history(agent, hist_a)
    _, s, _ = agent.send(hist_x)
    assert "b2" in agent.compress(s, first_ref(s, 1), last_ref(s, 12))  # A0..A4 and X0
    agent.send(hist_x + said("x folded", "ok"))
    for k in range(4):
        hist_a += said(f"Back {k}.", f"again {k}")
        sent, s, res = agent.send(hist_a)
        assert {b.id for b in s.blocks if b.active} == {"b1"} and b"X0" not in sent


def test_another_history_saying_some_of_the_parked_words_never_takes_them_back(tmp_path):
    """The other history's model says again words the parked block covers (the ledger gives them its
    refs): most of its messages here, and no collapse against its copy, but the history does not open as
    the conversation did: the parked block stays parked, the other history's own fold stands."""
    agent = Agent(tmp_path)
    hist_a = _folded_a(agent)
    _says_the_parked_words_again(agent, _other_history(agent, hist_a))


def test_two_other_histories_in_a_row_leave_the_first_parked_conversation_its_folds(tmp_path):
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    _explore(agent, "B")  # (it folds its reads: its blocks are parked by the second)
    _explore(agent, "D", fold=False)
    sent, s, res = agent.send(msgs + said("Spawning.", "Agent reports: B has 8 modules, D has 8."))
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A3" not in sent


def _folded_a_and_k(agent: Agent) -> tuple[list[dict], list[dict], list[dict]]:
    """A's reads folded (b1), then K's (b2): the opening, A's reads, the conversation."""
    head = [{"role": "user", "content": "Task: read the A modules."}]
    a = reads("A", 10)
    msgs = head + a + said("All read.", "ok")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    msgs += said("Folded.", "fine") + reads("K", 6) + said("K read.", "go")
    _, s, _ = agent.send(msgs)
    agent.compress(s, first_ref(s, 23), last_ref(s, 34))
    msgs += said("K folded.", "go")
    agent.send(msgs)
    return head, a, msgs


def test_a_lasting_branch_of_a_truncated_conversation_keeps_the_folds_it_holds_as_the_copy_had_them(tmp_path):
    agent = Agent(tmp_path)
    head, a, msgs = _folded_a_and_k(agent)
    cut = head + a[6:] + msgs[21:] + said("t", "u")  # the host drops A0..A2
    _, s, res = agent.send(cut)
    assert res.drift == "truncated"
    branch = cut[:len(head) + 14 + 2 + 4] + said("Some K read.", "Actually, read the C modules now.") + reads("C", 4)
    verdicts = []
    for k in range(coverage.ADOPT_AFTER + 2):
        branch += said(f"C step {k}.", f"go {k}")
        sent, s, res = agent.send(branch)
        verdicts.append(res.drift)
    assert "adopted" in verdicts and verdicts[-1] == ""
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A5" not in sent


CONTEXT = {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
           "context:\n# currentDate\nToday's date is 2026-12-02.\n</system-reminder>"}


def test_a_shared_context_block_is_no_opening_of_the_parked_conversation(tmp_path):
    """Claude Code opens the parent's and a subagent's conversations with the same context block: the
    other history opens as the parked copy did by its first part, but not through its first tool call,
    and never takes the parent's fold back."""
    def opening(task: str) -> list[dict]:
        return [{"role": "user", "content": [CONTEXT, {"type": "text", "text": task}]}]

    agent = Agent(tmp_path)
    hist_a = opening("Task: read the A modules.") + reads("A", 10) + said("All read.", "ok")
    _, s, _ = agent.send(hist_a)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    agent.send(hist_a + said("Folded.", "fine"))
    hist_x = _other_history(agent, hist_a, opening("Continue the task: read the A modules (resumed).")[0])
    _says_the_parked_words_again(agent, hist_x)


def test_a_parked_conversation_whose_host_cut_its_opening_is_taken_back_from_a_later_point(tmp_path):
    agent = Agent(tmp_path)
    head, a, msgs = _folded_a_and_k(agent)
    cut = a[6:] + msgs[21:] + said("t", "u")  # the host drops the opening and A0..A2
    agent.send(cut)
    sub = [{"role": "user", "content": "You are an explore agent: find every B module and report."}]
    for k in range(8):
        sub += reads(f"B{k}_", 1)
        _, s, res = agent.send(sub)
    assert s.copy.parked["blocks"] == ["b1", "b2"]
    back = cut[6:] + said("Spawning.", "Agent report: B has 8 modules.")  # the window rolled on: A3..A5 gone too
    for k in range(3):
        back += said(f"on {k}", f"more {k}")
        sent, s, res = agent.send(back)
    assert next(b for b in s.blocks if b.id == "b2").active and b"FILE K3" not in sent


def test_three_subagents_in_a_row_leave_the_parent_its_folds(tmp_path):
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    for tag in ("B", "D", "E"):
        _explore(agent, tag)
    sent, s, res = agent.send(msgs + said("Spawning.", "Agent reports: B, D and E have 8 modules each."))
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A3" not in sent


def test_back_from_a_branch_one_summary_stands_for_each_message(tmp_path):
    """A fold made on a rewound branch over messages of a block the branch did not render: back on the
    first branch both were active over A0..A4; the newer retires."""
    agent = Agent(tmp_path)
    full = _folded_a(agent)
    branch = full[:11] + said("Half of A read.", "Actually, read the C modules now.") + reads("C", 10) + said("C.", "go")
    _, s, res = agent.send(branch)
    assert res.drift == "rewound" and "b2" in agent.compress(s, first_ref(s, 1), last_ref(s, 10))
    agent.send(branch + said("x", "y"))
    for k in range(2):
        full += said(f"back {k}", f"on A {k}")
        sent, s, res = agent.send(full)
        assert {b.id for b in s.blocks if b.active} == {"b1"}
        assert b"[Compressed conversation section b1" in sent and b"[Compressed conversation section b2" not in sent


def _explore(agent: Agent, tag: str, fold: bool = True) -> None:
    """An older Claude Code's subagent under the parent's id: eight reads, folded after when ``fold``."""
    sub = [{"role": "user", "content": f"You are an explore agent: find every {tag} module and report."}]
    for k in range(8):
        sub += reads(f"{tag}{k}_", 1)
        _, s, _ = agent.send(sub)
    if fold:
        agent.compress(s, first_ref(s, 1), last_ref(s, 12))
        agent.send(sub + said(f"{tag} folded.", "go on"))


def test_the_parents_own_entry_is_kept_before_a_subagents_that_came_back_once(tmp_path):
    """D's fold, parked when the parent took its own back, is the older entry when E and F park in turn:
    the parent's own entry is the one kept beside the newest."""
    agent = Agent(tmp_path)
    msgs = _folded_a(agent)
    _explore(agent, "D")
    msgs += said("D reported.", "go on")
    agent.send(msgs)
    _explore(agent, "E")
    _explore(agent, "F", fold=False)
    sent, s, res = agent.send(msgs + said("Spawning.", "Agent reports: all modules listed."))
    assert next(b for b in s.blocks if b.id == "b1").active and b"FILE A3" not in sent


def test_back_from_a_branch_with_re_minted_ids_one_summary_stands_for_each_message(tmp_path):
    """The host re-minted the tool-call ids on the branch: b1's verified claims moved its messages to new
    refs, and a fold made on the branch over those refs overlaps b1 through its claims."""
    def remint(msgs: list[dict]) -> list[dict]:
        return json.loads(json.dumps(msgs).replace('"tu_', '"toolu_r'))

    agent = Agent(tmp_path)
    head = [{"role": "user", "content": "Task: read the A modules."}]
    a = [m if m["role"] != "assistant" else {**m, "content": [c for c in m["content"] if c["type"] != "text"]}
         for m in reads("A", 10)]
    full = head + a + said("All read.", "ok")
    _, s, _ = agent.send(full)
    agent.compress(s, first_ref(s, 1), last_ref(s, 20))
    full += said("Folded.", "fine") + said("more", "ok")
    agent.send(full)
    branch = remint(head + a[:10]) + said("Half of A read.", "Actually, read the C modules now.") + reads("C", 10)
    branch += said("C read.", "go on")
    _, s, res = agent.send(branch)
    assert "b2" in agent.compress(s, first_ref(s, 1), last_ref(s, 10))
    agent.send(branch + said("x", "y"))
    full = remint(full)
    for k in range(2):
        full += said(f"back {k}", f"on A {k}")
        sent, s, res = agent.send(full)
        assert [b.id for b in s.blocks if b.active] == ["b1"] and b"section b2" not in sent
