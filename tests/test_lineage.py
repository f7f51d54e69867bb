"""Lineage through the kernel: forks keep their parent's folds, results and refs (#15); id-less
sessions keep their session when their history goes back to an earlier point (#20)."""

from __future__ import annotations

import json
import time

import pytest
from test_fold import TAG, agent_answers_unknown, body, conversation, filler, refs_in, roundtrip_call

from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.reconcile import SIDE_REQUEST_MAX_ITEMS
from bili_addon.kernel.turn import Engine
from bili_addon.store import archived_record
from bili_addon.wire import LANES

ANTH = LANES["anthropic"]
P = {"x-claude-code-session-id": "parent"}
F = {"x-claude-code-session-id": "fork"}
SUMMARY = "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."


@pytest.fixture
def engine(backend):
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    yield e
    e.store.close()


def ref_for(payload: dict, prefix: str) -> str:
    return next(r for r, t in refs_in(payload).items() if t.startswith(prefix))


def send(engine, msgs, headers) -> dict:
    res = engine.process(body(msgs), ANTH, headers, render=True)
    assert res.status == 0
    return json.loads(res.body if res.body is not None else body(msgs))


def fold(engine, sid, headers, msgs, first, last, call_id, summary=SUMMARY):
    """The model folds steps first..last (by the refs it was shown); returns the history after the
    request that ran the compress call, and that request's upstream body."""
    shown = send(engine, msgs, headers)
    args = {"content": [{"startId": ref_for(shown, f"Step {first}:"), "endId": ref_for(shown, f"Step {last}:"),
                         "topic": f"steps {first}-{last}", "summary": summary}]}
    roundtrip_call(engine, sid, "compress", args, call_id)
    msgs = agent_answers_unknown(msgs, "compress", args, call_id)
    res = engine.process(body(msgs), ANTH, headers, render=True)
    assert res.executed == ["compress"], res.notes
    return msgs, json.loads(res.body)


def has_block(payload, block: str) -> bool:
    """The block's summary stands in the body (the system prompt only names the format)."""
    return f"[Compressed conversation section {block} \\u00b7 " in json.dumps(payload)


def more(msgs, text):
    return msgs + [{"role": "assistant", "content": f"Noted: {text}."}, {"role": "user", "content": text}]


def result_of(payload: dict, call_id: str) -> str:
    for m in payload["messages"]:
        for b in m["content"] if isinstance(m["content"], list) else []:
            if b.get("type") == "tool_result" and b.get("tool_use_id") == call_id:
                return b["content"] if isinstance(b["content"], str) else json.dumps(b["content"])
    raise LookupError(call_id)


def folded_parent(engine):
    msgs, _ = fold(engine, "parent", P, conversation(8), 1, 4, "toolu_c1")
    msgs = more(msgs, "go on")
    return msgs, send(engine, msgs, P)


def test_a_fork_after_a_fold_keeps_the_fold_the_result_and_the_refs(engine):
    msgs, last = folded_parent(engine)
    fork = more(msgs, "continue in the fork")
    res = engine.process(body(fork), ANTH, F, render=True)
    out = json.loads(res.body)
    text = json.dumps(out)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    assert has_block(out, "b1") and "load_config()" in text
    for t in range(1, 5):
        assert f"file-{t}-row-" not in text, f"step {t} is folded in the parent, so in the fork"
    assert result_of(out, "toolu_c1") == result_of(last, "toolu_c1")
    assert result_of(out, "toolu_c1").startswith("Compressed m")
    # the parent's refs for the parent's messages, and the same bytes for everything they share
    parent_refs, fork_refs = refs_in(last), refs_in(out)
    for ref, t in parent_refs.items():
        assert fork_refs.get(ref) == t
    assert out["messages"][: len(last["messages"])] == last["messages"]
    new = set(fork_refs) - set(parent_refs)
    assert new and min(new) > max(parent_refs)
    assert res.refs_known >= len(parent_refs)

    # decompress and search reach the inherited block and its originals
    roundtrip_call(engine, "fork", "decompress", {"blockId": "b1"}, "toolu_f1")
    fork = agent_answers_unknown(fork, "decompress", {"blockId": "b1"}, "toolu_f1")
    got = result_of(send(engine, fork, F), "toolu_f1")
    assert got.startswith("b1 (tier 1) replaced original messages")
    for t in range(1, 5):
        assert json.dumps(conversation(8)[2 + 2 * t]["content"][0]["content"])[1:-1] in json.dumps(got)
    roundtrip_call(engine, "fork", "search_context", {"query": "file-2-row-7"}, "toolu_f2")
    fork = agent_answers_unknown(fork, "search_context", {"query": "file-2-row-7"}, "toolu_f2")
    assert "(inside b1)" in result_of(send(engine, fork, F), "toolu_f2")
    # the parent's own decompress says the same, byte for byte
    roundtrip_call(engine, "parent", "decompress", {"blockId": "b1"}, "toolu_p1")
    pmsgs = agent_answers_unknown(msgs, "decompress", {"blockId": "b1"}, "toolu_p1")
    assert result_of(send(engine, pmsgs, P), "toolu_p1") == got

    fam = engine.lineage.family_of("fork")
    assert fam == {"root": "parent", "parent": "parent", "fork_at": fam["fork_at"], "children": []}
    assert fam["fork_at"] == sum(len(m["content"]) if isinstance(m["content"], list) else 1 for m in msgs)
    assert engine.lineage.family_of("parent")["children"] == ["fork"]


def test_folds_after_the_fork_stay_in_their_own_session(engine):
    msgs, last = folded_parent(engine)
    parent_bytes = engine.process(body(msgs), ANTH, P, render=True).body
    fork = more(msgs, "continue in the fork")
    send(engine, fork, F)
    # the fork folds steps 5-6: the parent's next request is what it was
    fork, out = fold(engine, "fork", F, more(fork, "fold more"), 5, 6, "toolu_f9", "Steps 5 and 6: the fork read both modules and found nothing to change.")
    assert has_block(out, "b2") and "file-5-row-" not in json.dumps(out)
    assert engine.process(body(msgs), ANTH, P, render=True).body == parent_bytes
    pnext = send(engine, more(msgs, "parent goes on"), P)
    assert not has_block(pnext, "b2") and "file-5-row-" in json.dumps(pnext)
    fork_bytes = engine.process(body(fork), ANTH, F, render=True).body
    # ... and the other way round
    pm, pout = fold(engine, "parent", P, more(msgs, "parent folds"), 5, 7, "toolu_p9", "Steps 5 to 7, read in the parent: plain data classes, nothing to fix.")
    assert "file-7-row-" not in json.dumps(pout)
    assert engine.process(body(fork), ANTH, F, render=True).body == fork_bytes
    # no ref names two messages anywhere in the family
    owners: dict[str, str] = {}
    for sid in ("parent", "fork"):
        for r in engine.store.ledger(sid):
            assert owners.setdefault(r.ref, r.content_hash) == r.content_hash, r.ref


def test_a_fork_from_before_the_fold_inherits_refs_but_not_the_fold(engine):
    first = send(engine, conversation(8), P)  # the refs the parent showed before it folded
    folded_parent(engine)
    early = conversation(8) + [{"role": "assistant", "content": "Let me look at something else."},
                               {"role": "user", "content": "branch from here"}]
    out = send(engine, early, F)
    text = json.dumps(out)
    assert not has_block(out, "b1") and "file-2-row-" in text
    assert out["messages"][:-2] == first["messages"]
    assert engine.sessions["fork"].blocks == [] and engine.sessions["fork"].calls == {}
    assert engine.lineage.family_of("fork")["parent"] == "parent"


def test_a_fork_that_re_serialises_its_history_is_verified_as_churn_is(engine):
    base = conversation(8)
    base[11]["content"][1]["input"] = {"cmd": "cat mod5.py", "timeout": 5}
    msgs, _ = fold(engine, "parent", P, base, 1, 4, "toolu_c1")
    msgs = more(msgs, "go on")
    last = send(engine, msgs, P)
    fork = json.loads(json.dumps(msgs))
    fork[11]["content"][1]["input"] = {"timeout": 5, "cmd": "cat mod5.py"}  # keys in another order
    fork[13]["content"][0]["text"] += "\n"  # a layout change in the prose
    out = send(engine, more(fork, "continue"), F)
    assert has_block(out, "b1") and "file-2-row-" not in json.dumps(out)
    assert result_of(out, "toolu_c1") == result_of(last, "toolu_c1")
    assert ref_for(out, "Step 6:") == ref_for(last, "Step 6:") and ref_for(out, "Step 7:") == ref_for(last, "Step 7:")
    # a call id the parent never had ends the verified history: nothing after it is inherited
    other = json.loads(json.dumps(msgs))
    other[13]["content"][1]["id"] = other[14]["content"][0]["tool_use_id"] = "toolu_other"
    out = send(engine, more(other, "continue"), {"x-claude-code-session-id": "fork2"})
    assert not has_block(out, "b1") and "file-2-row-" in json.dumps(out)
    assert ref_for(out, "Step 5:") == ref_for(last, "Step 5:")
    assert ref_for(out, "Step 7:") != ref_for(last, "Step 7:")


def test_conversations_sharing_only_their_opening_stay_apart(engine):
    folded_parent(engine)
    other = {"x-claude-code-session-id": "other"}
    send(engine, conversation(0), other)  # the same first message
    mine = conversation(0) + [{"role": "assistant", "content": "I will start with the README."},
                              {"role": "user", "content": "fine, go ahead"}]
    out = send(engine, mine, other)
    s = engine.sessions["other"]
    assert engine.lineage.family_of("other") is None
    assert s.blocks == [] and s.calls == {} and "other" in engine.lineage.checked
    assert sorted(refs_in(out)) == ["m00001", "m00002", "m00003"]
    # even where the model's first reply was word for word the parent's
    twin = {"x-claude-code-session-id": "twin"}
    same = conversation(1)[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_twin", "content": "denied"},
        {"type": "text", "text": "do not run commands, just read"}]}]
    same[1] = {"role": "assistant", "content": [same[1]["content"][0],
                                                {**same[1]["content"][1], "id": "toolu_twin"}]}
    send(engine, same, twin)
    assert engine.lineage.family_of("twin") is None and engine.sessions["twin"].blocks == []


def test_a_session_that_grew_its_own_history_is_no_fork_even_where_it_matches(engine):
    """A deterministic model gives the same answers, call ids included, to two conversations
    started alike; the second grew its history request by request, so it is its own."""
    msgs, _ = folded_parent(engine)
    twin = {"x-claude-code-session-id": "twin"}
    for n in (0, 2, 4):
        send(engine, conversation(n), twin)
    assert engine.lineage.family_of("twin") is None and "twin" in engine.lineage.checked
    # a fork may send a side request of other words (a title) before its first turn
    title = {"x-claude-code-session-id": "titled"}
    ask = json.dumps({"model": "m", "max_tokens": 20, "messages": [
        {"role": "user", "content": "Write a title for: Please audit the repository."}]}).encode()
    assert TAG.match(json.loads(engine.process(ask, ANTH, title, render=True).body)["messages"][0]["content"]).group(1) == "m00001"
    out = send(engine, more(msgs, "continue"), title)
    assert has_block(out, "b1") and engine.lineage.family_of("titled")["parent"] == "parent"
    assert ref_for(out, "Please audit") == "m00001"  # the parent's ref for the parent's message
    # the title's own m00001 was given anew: a ref names one message in the session
    again = TAG.match(json.loads(engine.process(ask, ANTH, title, render=True).body)["messages"][0]["content"])
    assert again.group(1) != "m00001"
    owners: dict[str, str] = {}
    for r in engine.store.ledger("titled"):
        assert owners.setdefault(r.ref, r.content_hash) == r.content_hash, r.ref


def native_call(msgs: list[dict], call_id: str, args: dict) -> list[dict]:
    """The history with the agent's call of bili's compress through its MCP server, and its result."""
    return msgs + [{"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "mcp__bili__compress",
                                                      "input": args}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                 "content": "Compressed ... -> b1"}]}]


def test_a_block_is_inherited_only_where_all_it_covers_is_verified(engine):
    msgs = conversation(8)
    shown = send(engine, msgs, P)
    args = {"content": [{"startId": ref_for(shown, "Step 1:"), "endId": ref_for(shown, "Step 4:"), "summary": SUMMARY}]}
    # natively (MCP): the parent's answer made the call (the proxy read it), and bili mcp runs it
    engine.native.note("parent", "mcp__bili__compress", args, "toolu_native")
    assert engine.plugin_tool(None, "compress", args)[0] == "parent"
    assert engine.sessions["parent"].blocks[0].call_id == "toolu_native"  # (the block keeps its call)
    before = msgs
    msgs = more(native_call(msgs, "toolu_native", args), "go on")
    assert has_block(send(engine, msgs, P), "b1")
    # a fork whose step 3 output differs: the verified history ends before it, the block stays home
    bad = json.loads(json.dumps(msgs))
    bad[8]["content"][0]["content"] += " (edited)"
    out = send(engine, more(bad, "fork"), F)
    assert not has_block(out, "b1") and engine.sessions["fork"].blocks == []
    assert engine.lineage.family_of("fork")["parent"] == "parent"
    # the same history exactly: the block comes along
    out = send(engine, more(msgs, "fork"), {"x-claude-code-session-id": "fork2"})
    assert has_block(out, "b1")
    # a fork of the history before the native call (the parent folded after they parted): it was
    # inherited (a native fold had no call to look for), with a summary the parent's model wrote later
    out = send(engine, more(before, "fork before the fold"), {"x-claude-code-session-id": "fork3"})
    assert engine.lineage.family_of("fork3")["parent"] == "parent"
    assert not has_block(out, "b1") and engine.sessions["fork3"].blocks == []


def test_a_native_fold_of_no_known_call_stays_with_its_session(engine):
    """bili mcp with a conversation named runs a call whose answer it does not know: its fold may
    have been made after a fork's history parted from this one, so no fork takes it."""
    msgs = conversation(8)
    shown = send(engine, msgs, P)
    args = {"content": [{"startId": ref_for(shown, "Step 1:"), "endId": ref_for(shown, "Step 4:"), "summary": SUMMARY}]}
    engine.plugin_tool("parent", "compress", args)
    msgs = more(msgs, "go on")
    assert has_block(send(engine, msgs, P), "b1")
    out = send(engine, more(msgs, "fork"), F)
    assert engine.lineage.family_of("fork")["parent"] == "parent" and not has_block(out, "b1")


def test_a_fork_survives_a_restart(backend):
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs, last = folded_parent(e)
    e.store.close()
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    fork = more(msgs, "continue in the fork")
    first = e.process(body(fork), ANTH, F, render=True).body
    assert has_block(json.loads(first), "b1")
    e.store.close()
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    assert e.process(body(fork), ANTH, F, render=True).body == first
    assert e.lineage.family_of("fork")["parent"] == "parent"
    e.store.close()


# -- id-less sessions (#20) -----------------------------------------------------------------------

def chat(n: int, branch: str = "", calls: bool = False) -> list[dict]:
    """``n`` messages, user and assistant in turn; ``calls``: each assistant message a tool call under
    a provider's id, each user message after one its result."""
    out = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"{role} message {i}{branch}: " + "words " * 8
        if calls and role == "assistant":
            out.append({"role": role, "content": [{"type": "text", "text": text},
                                                  {"type": "tool_use", "id": f"toolu_{i}{branch}", "name": "Read",
                                                   "input": {"path": f"f{i}.py"}}]})
        elif calls and i:
            out.append({"role": role, "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i - 1}{branch}",
                                                   "content": f"contents {i}"}, {"type": "text", "text": text}]})
        else:
            out.append({"role": role, "content": text})
    return out


def tags(payload: dict) -> dict[str, str]:
    out = {}
    for m in payload["messages"]:
        texts = [m["content"]] if isinstance(m["content"], str) else [
            b["text"] for b in m["content"] if b.get("type") == "text"]
        for text in texts:
            t = TAG.match(text)
            if t:
                out[text[t.end():]] = t.group(1)
    return out


def test_an_idless_rewind_keeps_its_session_and_refs(engine, backend):
    seen = []
    for n in (1, 3, 5):
        res = engine.process(body(chat(n, calls=True)), ANTH, {}, render=True)
        seen.append((res.session, tags(json.loads(res.body))))
    sid = seen[0][0]
    assert {s for s, _ in seen} == {sid}
    refs = seen[-1][1]
    rewind = chat(3, calls=True) + [{"role": "assistant", "content": "a different reply " * 4},
                                    {"role": "user", "content": "ok"}]
    res = engine.process(body(rewind), ANTH, {}, render=True)
    assert res.session == sid and res.source == "prefix"
    got = tags(json.loads(res.body))
    for text, ref in got.items():
        if text in refs:
            assert refs[text] == ref
    assert len(set(got.values()) & set(refs.values())) == 3
    # back to the first branch: still the same session, the same refs
    res = engine.process(body(chat(7, calls=True)), ANTH, {}, render=True)
    assert res.session == sid
    got = tags(json.loads(res.body))
    assert all(got[t] == r for t, r in refs.items())
    # after a restart, too
    engine.store.close()
    e2 = Engine(backend())
    assert e2.process(body(rewind[:4]), ANTH, {}, render=True).session == sid


def test_idless_conversations_sharing_a_stock_opening_exchange_stay_apart(engine):
    """A harness that opens every conversation with the same exchange (aider: the repository map,
    then a stock "Ok" reply): that shared user message and reply are no history in common.  The
    second conversation joined the first (the earlier point at the reply was taken for verified), and
    its model could search the first one's folded content.  A rewind without a tool call in the
    shared history is a new session, as a fork without one is none."""
    pre = [{"role": "user", "content": "Here are summaries of files in my repository; treat them as read-only."},
           {"role": "assistant", "content": "Ok, I won't try and edit those files without asking first."}]
    x = engine.process(body(pre + chat(5, "-x")), ANTH, {}, render=True).session
    y = engine.process(body(pre + [{"role": "user", "content": "Y: write a haiku about autumn, please."}]),
                       ANTH, {}, render=True).session
    assert x != y
    # a plain rewind (no tool call before the point it goes back to) starts a session of its own too
    rewind = chat(3, "-x") + [{"role": "assistant", "content": "another reply " * 4}, {"role": "user", "content": "ok"}]
    assert engine.process(body(pre + rewind), ANTH, {}, render=True).session not in (x, y)


def test_idless_conversations_sharing_only_their_opening_stay_apart(engine):
    a = engine.process(body(chat(5)), ANTH, {}, render=True).session
    b1 = engine.process(body(chat(1)), ANTH, {}, render=True).session
    b = engine.process(body(chat(1) + chat(3, "-b")[1:]), ANTH, {}, render=True).session
    assert b1 == b != a


def test_two_proxies_on_one_store_share_the_family_counter(backend):
    """A fork made by another proxy on the same store: this one's parent still never gives a ref
    the fork gave."""
    one = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    two = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs, last = folded_parent(one)
    fork = send(two, more(msgs, "continue in the fork"), F)
    assert two.lineage.family_of("fork")["parent"] == "parent"
    fork_new = set(refs_in(fork)) - set(refs_in(last))
    parent_new = set(refs_in(send(one, more(msgs, "the parent goes on"), P))) - set(refs_in(last))
    assert fork_new and parent_new and not fork_new & parent_new
    assert min(parent_new) > max(fork_new)
    assert one.lineage.family_of("parent")["root"] == "parent"
    one.store.close()
    two.store.close()


# -- lineage stored after the answer (the proxy's way: Lineage.defer) ------------------------------

def test_a_deferred_record_is_the_same_record_stored_after_the_answer(backend):
    """The proxy fingerprints a pass's new parts after the answer (off the request's path): until
    then they wait in memory; once flushed the store holds exactly what an immediate record holds,
    and a fork made through another proxy on the same store is verified against it."""
    now = Engine(backend("immediate"), fold_cfg=FoldConfig(min_compress_chars=2000))  # a store of its own
    msgs, last = folded_parent(now)
    want = now.store.lineage_parts("parent")

    one = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    one.lineage.defer = True
    msgs2, last2 = folded_parent(one)
    assert last2 == last  # the wire does not depend on when lineage is stored
    k, kept = one.lineage.pending["parent"]  # the last pass's new parts wait for its answer
    assert kept and len(one.store.lineage_parts("parent")) == k < len(want)
    one.lineage.flush("parent")  # the answer came
    assert one.store.lineage_parts("parent") == want and not one.lineage.pending
    assert all(fp for _ref, _chash, fp in want)

    two = Engine(one.store, fold_cfg=FoldConfig(min_compress_chars=2000))  # another proxy, the same store
    out = send(two, more(msgs2, "continue in the fork"), F)
    assert has_block(out, "b1") and two.lineage.family_of("fork")["parent"] == "parent"


def test_a_fork_through_the_same_proxy_before_the_answer_is_settled(engine):
    """What this process kept back is stored before it compares a new session with the others."""
    engine.lineage.defer = True
    msgs, last = folded_parent(engine)
    assert "parent" in engine.lineage.pending
    res = engine.process(body(more(msgs, "continue in the fork")), ANTH, F, render=True)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    assert has_block(json.loads(res.body), "b1") and not engine.lineage.pending.get("parent")


def test_a_session_found_to_be_nobodys_fork_stays_so_after_a_restart(backend):
    """P was checked once and found to be nobody's fork; C, a copy of P's history going its own way,
    was not recognised (its first request under its id was its opening alone).  After a restart P's
    check ran again (the set of checked sessions lived in memory), and a rewound request does not go
    on from P's own record: P was adopted as C's fork, and the refs its model had been shown for
    turns named other texts.  The verdict is kept in P's row."""
    def step(msgs, i, who):
        cid = f"toolu_{who}{i}"
        return msgs + [
            {"role": "assistant", "content": [{"type": "text", "text": f"{who} step {i}"},
                                              {"type": "tool_use", "id": cid, "name": "Bash", "input": {"cmd": f"ls {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": f"out {who} {i}"}]}]

    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    c_id = {"x-claude-code-session-id": "C"}
    opening = {"role": "user", "content": "Please audit the repository carefully."}
    send(e, [opening], c_id)
    send(e, [{"role": "user", "content": "Write a title for: audit"}], P)  # (P's side request first)
    p = [opening]
    for i in range(3):
        p = step(p, i, "p")
        send(e, p, P)
    send(e, step(p[:5], 9, "c"), c_id)
    for i in range(3, 5):
        p = step(p, i, "p")
        before = refs_in(send(e, p, P))
    e.store.close()
    e = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    res = e.process(body(p[:-2]), ANTH, P, render=True)
    assert not res.notes and e.lineage.family_of("P") is None
    after = refs_in(json.loads(res.body))
    assert after and all(before[ref] == text for ref, text in after.items())
    e.store.close()


def test_two_proxies_keep_idless_conversations_that_share_their_opening_apart(backend):
    """An id-less conversation's new session id is derived from its history; one process found the
    id another conversation had moved on from taken (its points in memory) and took the next fork
    id, but a second process on the same store did not know that conversation and gave its id to
    a new one: another user's conversation joined it (its ledger, blocks and searches)."""
    one, two = Engine(backend()), Engine(backend())
    opening = {"role": "user", "content": "Please audit the repository and list the risky modules."}
    x = [opening, {"role": "assistant", "content": "X: I will start with auth.py; it handles the secrets."},
         {"role": "user", "content": "X: the admin password is hunter2, keep it out of the logs."}]
    sx = one.process(body([opening]), ANTH, {}, render=True).session
    assert one.process(body(x), ANTH, {}, render=True).session == sx
    y = [opening, {"role": "assistant", "content": "Y: sure, where is the code?"}, {"role": "user", "content": "in /srv/y"}]
    sy = two.process(body([opening]), ANTH, {}, render=True).session
    assert sy != sx and two.process(body(y), ANTH, {}, render=True).session == sy
    # and back in the first process, each conversation goes on in its own session
    assert one.process(body(x + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "go on"}]),
                       ANTH, {}, render=True).session == sx
    for e in (one, two):
        e.store.close()


def test_a_fork_inherits_its_folds_as_they_stood_when_it_parted(backend):
    """The parent distils b1 and b2 into b3 after the fork point: the child, whose history holds the
    two compress calls and not the third, has b1 and b2 on its wire, not the parent's later state of
    them (absorbed, inactive: the folded turns came back unfolded)."""
    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs, _ = fold(eng, "parent", P, conversation(12), 1, 4, "toolu_c1")
    msgs, out = fold(eng, "parent", P, more(msgs, "fold more"), 5, 8, "toolu_c2",
                     "Read modules 5 to 8: data classes only; mod7.py defines save_config().")
    assert has_block(out, "b1") and has_block(out, "b2")
    at_fork = msgs
    eng.lineage.flush()
    args = {"content": [{"startId": "b1", "endId": "b2",
                         "summary": "Modules 1 to 8 read: load_config() in mod3.py, save_config() in mod7.py."}]}
    pmsgs = more(msgs, "distil")
    send(eng, pmsgs, P)
    roundtrip_call(eng, "parent", "compress", args, "toolu_c3")
    pmsgs = agent_answers_unknown(pmsgs, "compress", args, "toolu_c3")
    res = eng.process(body(pmsgs), LANES["anthropic"], P, render=True)
    assert has_block(json.loads(res.body), "b3")
    eng.lineage.flush()
    res = eng.process(body(more(at_fork, "continue in the fork")), LANES["anthropic"], F, render=True)
    out = json.loads(res.body)
    assert has_block(out, "b1") and has_block(out, "b2") and not has_block(out, "b3")
    assert "file-2" not in json.dumps(out)  # (the folded outputs stay folded)
    parent = {b.id: b.active for b in eng.sessions.load("parent").blocks}
    assert parent == {"b1": False, "b2": False, "b3": True}  # (the parent's own, as they are)


def test_a_fork_taken_before_its_parents_compaction_keeps_its_folds_on_the_wire(backend):
    import compactions as X

    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs, _ = fold(eng, "parent", P, conversation(12), 1, 4, "toolu_c1")
    msgs = more(msgs, "go on")
    send(eng, msgs, P)
    eng.lineage.flush()
    at_fork = msgs
    send(eng, msgs + [{"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}], P)
    res = eng.process(body(X.claude_code_alone()), LANES["anthropic"], P, render=True)
    assert res.epoch == 2
    eng.lineage.flush()
    res = eng.process(body(more(at_fork, "continue in the fork")), LANES["anthropic"], F, render=True)
    assert has_block(json.loads(res.body), "b1")
    (b1,) = eng.sessions.load("fork").blocks
    assert b1.active and not b1.retired


# -- forks around the agent's compaction ----------------------------------------------------------

ASK = "Your task is to create a detailed summary of the conversation so far."


def steps(msgs: list[dict], first: int, last: int, size: int = 1200) -> list[dict]:
    """The history with steps ``first``..``last`` after it (a tool call each, and its output of
    ``size`` characters)."""
    for t in range(first, last + 1):
        msgs = msgs + [
            {"role": "assistant", "content": [{"type": "text", "text": f"Step {t}: reading module {t}."},
                                              {"type": "tool_use", "id": f"toolu_{t}", "name": "Bash",
                                               "input": {"cmd": f"cat mod{t}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                          "content": filler(f"file-{t}", size)}]}]
    return msgs


def compacted(agent: str) -> list[dict]:
    """The history an agent sends right after its compaction (the summary, and nothing else yet)."""
    import compactions as X

    if agent == "opencode":
        return X.opencode([])[:2] + [{"role": "user", "content": "go on"}]
    return X.claude_code_alone()


def compact(eng, msgs: list[dict], agent: str) -> list[dict]:
    """The parent asks for its summary, then sends its compacted history: a new epoch begins."""
    send(eng, more(msgs, ASK), P)
    new = compacted(agent)
    res = eng.process(body(new), ANTH, P, render=True)
    assert res.epoch == 2, res.notes
    return new


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("agent", ["claude-code", "opencode"])
def test_a_fork_of_a_point_before_the_compaction_inherits_its_folds_however_long_the_new_history(
        backend, agent, defer):
    """opencode's fork at an earlier message, Claude Code's --resume-session-at with --fork-session: a
    fork of the history before the parent's compaction, made once the new history had grown past a
    side request's length.  The parent's one record was the new epoch's by then, and the fork's
    history shared no tool call with it: the fork inherited nothing, its folded outputs back on
    the wire.  The old epoch's record is kept: the fork has its folds as they stood, and none made
    after it parted (the new epoch's); after a restart too."""
    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    eng.lineage.defer = defer
    msgs, _ = fold(eng, "parent", P, conversation(12), 1, 4, "toolu_c1")
    at_fork = more(msgs, "go on")
    send(eng, at_fork, P)
    new = steps(compact(eng, at_fork, agent), 20, 26)
    send(eng, new, P)
    new, out = fold(eng, "parent", P, more(new, "fold the new steps"), 21, 24, "toolu_c2",
                    "Steps 21 to 24, after the compaction: modules 21 to 24 hold constants only.")
    assert has_block(out, "b2") and len(new) > SIDE_REQUEST_MAX_ITEMS  # (no side request's length)
    res = eng.process(body(more(at_fork, "continue in the fork")), ANTH, F, render=True)
    out = json.loads(res.body)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    assert has_block(out, "b1") and not has_block(out, "b2") and "file-2-row-" not in json.dumps(out)
    assert [(b.id, b.active, b.retired) for b in eng.sessions["fork"].blocks] == [("b1", True, False)]
    assert "epochs" not in eng.sessions["fork"].flags  # (its history holds no summary)
    # the parent's own, as they are: b1 retired by its compaction, b2 on its wire
    assert {b.id: (b.active, b.retired) for b in eng.sessions.load("parent").blocks} == {
        "b1": (False, True), "b2": (True, False)}
    eng.lineage.flush()
    eng.store.close()
    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    out = send(eng, more(at_fork, "another fork, after a restart"), {"x-claude-code-session-id": "fork2"})
    assert has_block(out, "b1") and not has_block(out, "b2")
    assert eng.lineage.family_of("fork2")["root"] == "parent"  # (the first fork has that history too)
    eng.store.close()


@pytest.mark.parametrize("agent", ["claude-code", "opencode"])
def test_a_fork_early_in_the_new_epoch_inherits_the_folds_made_in_it(backend, agent):
    """A fork a few turns after the parent's compaction, the model having folded since: the new
    history was shorter than a side request may be, so the parent's record stayed its old
    history's, and the fork (opening with the summary) matched no one.  A new epoch's first pass
    is recorded as it is: the fork has the new epoch's fold (not the ones the compaction retired:
    their calls are not in its history) and the epoch."""
    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs, _ = fold(eng, "parent", P, conversation(12), 1, 4, "toolu_c1")
    msgs = more(msgs, "go on")
    send(eng, msgs, P)
    new = steps(compact(eng, msgs, agent), 20, 21, size=3000)
    new, out = fold(eng, "parent", P, new, 20, 20, "toolu_c2",
                    "Step 20, after the compaction: module 20 holds constants only, nothing to change.")
    assert has_block(out, "b2") and len(new) < SIDE_REQUEST_MAX_ITEMS
    res = eng.process(body(more(new, "continue in the fork")), ANTH, F, render=True)
    out = json.loads(res.body)
    assert any("a fork of parent" in n for n in res.notes), res.notes
    assert has_block(out, "b2") and not has_block(out, "b1") and "file-20-row-" not in json.dumps(out)
    fork = eng.sessions["fork"]
    assert [(b.id, b.active) for b in fork.blocks] == [("b2", True)]
    assert [e["epoch"] for e in fork.flags["epochs"]] == [2]
    eng.store.close()


def test_a_pruned_session_loses_its_old_epochs_records(backend):
    """The record of an epoch a compaction ended is the session's, kept under a key of its own:
    retention removes it with the session's other rows."""
    eng = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs = more(conversation(8), "go on")
    send(eng, msgs, P)
    compact(eng, msgs, "claude-code")
    old = eng.store.lineage_parts(archived_record("parent", 1))
    assert old and len(old) > len(eng.store.lineage_parts("parent"))
    assert eng.store.prune(["parent"], time.time() + 60, dry_run=True)["lineage_parts"] > len(old)
    assert eng.store.lineage_parts(archived_record("parent", 1)) == old
    eng.store.prune(["parent"], time.time() + 60)
    assert eng.store.lineage_parts(archived_record("parent", 1)) == []
    assert eng.store.lineage_parts("parent") == []
    eng.store.close()


def test_the_nobodys_fork_verdict_is_written_as_the_flags_json_makes_it(engine):
    """(#11) A new session found nobody's fork gets that flag's JSON made once (the flag alone), or
    made whole when it has other flags: the session's row holds what ``flags_json`` writes."""
    from bili_addon.kernel.lineage import OWN
    from bili_addon.kernel.state import flags_json

    opening = {"role": "user", "content": "Please audit the repository carefully."}
    answered = [opening, {"role": "assistant", "content": [{"type": "text", "text": "On it."}]},
                {"role": "user", "content": "Go on."}]
    send(engine, answered, P)
    s = engine.sessions["parent"]
    assert s.flags.get(OWN) is True and s.row.flags == flags_json(s.flags) == json.dumps({OWN: True}, sort_keys=True)
    engine.write_pending()
    assert engine.store.session("parent").flags == flags_json(s.flags)
    # another flag beside it (set before the check ran, as a host's envelope would): the whole JSON
    engine.sessions.load("other", "agent", "anthropic")
    o = engine.sessions["other"]
    o.flags["strict_reasoning"] = True
    engine.lineage.before_turn(o, engine.items.get_many(ANTH, [json.dumps(m).encode() for m in answered]), 0)
    assert o.flags.get(OWN) is True and o.row.flags == flags_json(o.flags)
    assert json.loads(o.row.flags) == {OWN: True, "strict_reasoning": True}
