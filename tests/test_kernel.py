"""Kernel unit tests: identity, refs, tags, the turn pipeline over the store."""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel import tags
from bili_addon.kernel.identity import InstanceCounter, count_tokens, digest
from bili_addon.kernel.turn import Engine
from bili_addon.store import StoreError
from bili_addon.wire import LANES
from bili_addon.wire.base import Core

ANTH = LANES["anthropic"]
SID = {"x-acp-session": "test-session"}


def body(*messages, **top) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 10, **top, "messages": list(messages)}).encode()


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@pytest.fixture
def engine(backend):
    e = Engine(backend())
    yield e
    e.store.close()


def sent(result, raw):
    return json.loads(result.body if result.body is not None else raw)


# -- identity ----------------------------------------------------------------------------------


def test_content_hash_vectors_match_the_reference_system():
    assert digest(Core("user", "text", "hello"))[0] == "h_2708c80e9ecf5970"
    assert digest(Core("tool", "tool-result", "ok", tool_call_id="t1"))[0] == "h_37d1926dd3241271"
    call = Core("assistant", "tool-call", '{"cmd":"ls"}', tool_call_id="t1", tool_name="Bash")
    assert digest(call)[0] == "h_7e830d38e7bd1202"


def test_media_payload_separates_images_but_not_text():
    a = Core("user", "image", "[image]", media="sha256:aa")
    b = Core("user", "image", "[image]", media="sha256:bb")
    assert digest(a)[0] != digest(b)[0]
    assert digest(a)[0] == "h_c62e0f8d456b87ee"  # the sixth slot, as persisted ledgers have it
    # text cores never carry the slot, so their ids are the plain five-slot hash
    assert digest(Core("user", "text", "[image]"))[0] == "h_88b5433245c4751e"


def test_instance_suffixes_count_duplicates_within_a_pass():
    c = InstanceCounter()
    assert [c("h_x"), c("h_y"), c("h_x"), c("h_x")] == ["h_x", "h_y", "h_x_1", "h_x_2"]


@pytest.mark.parametrize(
    "text,n",
    [("hello world", 3), ("function test_fn() {}", 6), ("你好世界", 4), ("hello 你好 world 世界", 8), ("", 0)],
)
def test_token_estimate(text, n):
    assert count_tokens(text) == n


def test_token_figures_render_like_the_reference():
    for _ in range(2):  # computed, then from the cache: the same figures
        assert [tags.format_tokens(t) for t in (999, 1000, 1250, 2149, 10000, 12500)] == [
            "999", "1.0K", "1.3K", "2.1K", "10K", "13K",
        ]
    assert tags.render("m00007", 1250, "text", "hi") == '<acp tokens="1.3K" type="text">m00007</acp>\nhi'


def test_ref_bounds():
    assert tags.ref_of(1) == "m00001"
    assert tags.index_of(" M00012 ") == 12
    assert tags.index_of("m999999") is None
    with pytest.raises(ValueError):
        tags.ref_of(100000)


# -- the turn pipeline -------------------------------------------------------------------------


def test_prose_is_tagged_and_everything_else_is_pristine(engine):
    raw = body(
        user("list the files"),
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "plan", "signature": "sig=="},
                {"type": "text", "text": "Running ls."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"cmd": "ls"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}]},
        user("thanks"),
        system=[{"type": "text", "text": "You are helpful."}],
    )
    res = engine.process(raw, ANTH, SID, render=True)
    out = sent(res, raw)
    msgs = out["messages"]
    assert msgs[0]["content"] == '<acp tokens="4" type="text">m00001</acp>\nlist the files'
    thinking, text, call = msgs[1]["content"]
    assert thinking == {"type": "thinking", "thinking": "plan", "signature": "sig=="}
    assert text["text"] == '<acp tokens="3" type="text">m00003</acp>\nRunning ls.'
    assert call == {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"cmd": "ls"}}
    assert msgs[2]["content"][0]["content"] == "a.py"
    assert msgs[3]["content"].startswith('<acp tokens="2" type="text">m00006</acp>\n')
    assert out["system"] == [{"type": "text", "text": "You are helpful."}]
    # every message got a ref, in order: user, thinking, text, call, result, user
    assert (res.refs_new, res.refs_known, res.tagged) == (6, 0, 3)


def test_untouched_bytes_stay_byte_exact(engine):
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"hi there"},'
        b'{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"x","input":{"b": 1.50, "a":[ ]}}]},'
        b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}],"zz":1e21}'
    )
    res = engine.process(raw, ANTH, SID, render=True)
    assert res.body.endswith(b',"zz":1e21}')
    # the tool call item is re-emitted with its original (odd) spacing untouched
    assert b'{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"x","input":{"b": 1.50, "a":[ ]}}]}' in res.body


def test_follow_up_turn_reuses_refs_and_same_history_gives_same_bytes(engine):
    t1 = body(user("first question"))
    r1 = engine.process(t1, ANTH, SID, render=True)
    t2 = body(user("first question"), assistant("an answer"), user("second question"))
    r2 = engine.process(t2, ANTH, SID, render=True)
    m = sent(r2, t2)["messages"]
    assert m[0]["content"] == sent(r1, t1)["messages"][0]["content"]
    assert "m00001" in m[0]["content"] and "m00002" in m[1]["content"][0]["text"]
    assert "m00003" in m[2]["content"]
    assert (r2.refs_new, r2.refs_known) == (2, 1)
    r2b = engine.process(t2, ANTH, SID, render=True)
    assert r2b.body == r2.body  # byte stability turn over turn
    assert r2b.refs_new == 0


def test_refs_are_never_reused_after_a_message_disappears(engine):
    engine.process(body(user("one"), assistant("two"), user("three")), ANTH, SID, render=True)
    res = engine.process(body(user("one"), assistant("other"), user("four")), ANTH, SID, render=True)
    m = sent(res, None)["messages"]
    assert "m00001" in m[0]["content"]
    assert "m00004" in m[1]["content"][0]["text"] and "m00005" in m[2]["content"]


def test_duplicates_get_their_own_refs(engine):
    raw = body(user("ok"), assistant("sure"), user("ok"))
    m = sent(engine.process(raw, ANTH, SID, render=True), raw)["messages"]
    assert "m00001" in m[0]["content"] and "m00003" in m[2]["content"]


def test_cache_control_churn_keeps_the_ref(engine):
    a = body({"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]})
    b = body(user("hello"), assistant("hi"), user("again"))
    engine.process(a, ANTH, SID, render=True)
    m = sent(engine.process(b, ANTH, SID, render=True), b)["messages"]
    assert m[0]["content"].startswith('<acp tokens="2" type="text">m00001</acp>\n')


def test_trailing_assistant_prefill_is_not_tagged(engine):
    raw = body(user("write json"), assistant("{"))
    m = sent(engine.process(raw, ANTH, SID, render=True), raw)["messages"]
    assert m[1]["content"][0]["text"] == "{"


def test_own_stale_tag_is_stripped_before_hashing_and_rendered_once(engine):
    raw = body(user("question"))
    tagged = sent(engine.process(raw, ANTH, SID, render=True), raw)["messages"][0]["content"]
    # a client that replays our tagged bytes: same ref, one tag, no new ledger row
    res = engine.process(body(user(tagged)), ANTH, SID, render=True)
    assert sent(res, None)["messages"][0]["content"] == tagged
    assert (res.refs_new, res.refs_known) == (0, 1)


def test_a_user_quoting_a_tag_of_the_words_that_follow_keeps_them_after_a_restart(backend):
    """The user's message opens with a tag whose ref names the very words after it (pasted from a log of
    bili's): when first seen, that ref was new in the same pass, so the text was taken as written; a
    restarted proxy knew the ref and stripped the tag (the user's words changed, another ref given)."""
    quoted = '<acp tokens="5" type="text">m00001</acp>\nStart.'
    raw = body(user("Start."), assistant("ok"), user(quoted), assistant("done"), user("next"))
    e = Engine(backend())
    first = e.process(raw, ANTH, SID, render=True).body
    assert quoted in sent(e.process(raw, ANTH, SID, render=True), raw)["messages"][2]["content"]
    e.store.close()
    again = Engine(backend())
    assert again.process(raw, ANTH, SID, render=True).body == first
    again.store.close()


def test_foreign_tags_and_look_alikes_are_content(engine):
    engine.process(body(user("alpha"), assistant("beta"), user("gamma")), ANTH, SID, render=True)
    foreign = '<acp tokens="2" type="text">m00002</acp>\nalpha'  # m00002 is not alpha's ref
    raw = body(user(foreign), assistant("ok"), user("[m00003] gamma"))
    res = engine.process(raw, ANTH, SID, render=True)
    m = sent(res, raw)["messages"]
    assert m[0]["content"].endswith("\n" + foreign)
    assert m[2]["content"].endswith("\n[m00003] gamma")
    assert res.refs_new == 3


def test_observe_records_but_does_not_rewrite(engine):
    raw = body(user("hi there"))
    res = engine.process(raw, ANTH, SID, render=False)
    assert res.body is None and res.refs_new == 1
    assert engine.store.ref_count("test-session") == 1


def test_refs_survive_a_restart(backend):
    e1 = Engine(backend())
    e1.process(body(user("persist me"), assistant("ok"), user("next")), ANTH, SID, render=True)
    e1.store.close()
    e2 = Engine(backend())
    raw = body(user("persist me"), assistant("ok"), user("next"), assistant("done"), user("more"))
    res = e2.process(raw, ANTH, SID, render=True)
    m = sent(res, raw)["messages"]
    assert "m00001" in m[0]["content"] and "m00004" in m[3]["content"][0]["text"]
    assert (res.refs_new, res.refs_known) == (2, 3)


def test_a_failed_store_write_shows_no_ref_and_loses_nothing(backend, monkeypatch):
    e = Engine(backend())
    e.process(body(user("kept")), ANTH, SID, render=True)

    def boom(*a, **k):
        raise StoreError("disk full")

    monkeypatch.setattr(e.store, "commit_turn", boom)
    with pytest.raises(StoreError):
        e.process(body(user("kept"), assistant("x"), user("lost")), ANTH, SID, render=True)
    monkeypatch.undo()
    res = e.process(body(user("kept"), assistant("x"), user("lost")), ANTH, SID, render=True)
    m = sent(res, None)["messages"]
    # the refs the failed turn would have minted were never shown, so they are handed out now
    assert "m00001" in m[0]["content"] and "m00002" in m[1]["content"][0]["text"]


def test_sessions_are_separate_ledgers(engine):
    raw = body(user("same text"))
    a = sent(engine.process(body(user("other")), ANTH, {"x-acp-session": "a"}, render=True), None)
    b = sent(engine.process(raw, ANTH, {"x-acp-session": "b"}, render=True), raw)
    assert "m00001" in a["messages"][0]["content"] and "m00001" in b["messages"][0]["content"]


def test_anonymous_conversations_split_by_history_and_reattach(backend):
    e = Engine(backend())
    pre = {"system": "shared preamble"}
    a1 = e.process(body(user("conversation A starts here"), **pre), ANTH, {}, render=True)
    b1 = e.process(body(user("conversation B starts here"), **pre), ANTH, {}, render=True)
    assert a1.session.startswith("pfa-") and a1.session != b1.session
    a2 = e.process(
        body(user("conversation A starts here"), assistant("ok"), user("go on"), **pre), ANTH, {}, render=True
    )
    assert a2.session == a1.session
    e.store.close()
    e2 = Engine(backend())
    a3 = e2.process(
        body(user("conversation A starts here"), assistant("ok"), user("go on"), assistant("k"), user("x"), **pre),
        ANTH, {}, render=True,
    )
    assert a3.session == a1.session and a3.refs_known == 3


@pytest.mark.parametrize("messages", [[], [{"role": "assistant", "content": "only the model spoke"}]])
def test_no_identity_and_no_history_passes_through(engine, messages):
    res = engine.process(body(*messages), ANTH, {}, render=True)
    assert res.body is None and res.session == ""
    assert engine.store.sessions() == []


# -- previous passes of many conversations ---------------------------------------------------------


def test_a_proxy_serving_many_conversations_keeps_each_ones_previous_pass(engine):
    # 40 conversations in turn (more than the 32 passes kept before, when they were counted): each
    # follow-up reuses its conversation's previous pass
    histories = {f"conv-{i}": [user(f"question {i}"), assistant(f"answer {i}")] for i in range(40)}
    for sid, msgs in histories.items():
        engine.process(body(*msgs), ANTH, {"x-acp-session": sid}, render=True)
    for sid, msgs in histories.items():
        msgs.append(user(f"follow-up of {sid}"))
        r = engine.process(body(*msgs), ANTH, {"x-acp-session": sid}, render=True)
        assert r.reused == 1, (sid, r.reused)  # the previous pass's items (its last, a reply, is read again)
        assert (r.refs_new, r.refs_known) == (1, 2)
    assert len(engine.sessions.memos) == 40


def test_previous_passes_are_kept_by_the_bytes_of_their_conversations(engine):
    engine.sessions.memo_bytes = 3000  # room for about three of these conversations
    for i in range(6):
        engine.process(body(user(f"{i} " + "x" * 900)), ANTH, {"x-acp-session": f"c{i}"}, render=True)
    kept = list(engine.sessions.memos)
    assert kept == ["c3", "c4", "c5"]  # the most recent, within the budget
    assert sum(m.size for m in engine.sessions.memos.values()) <= 3000
    engine.sessions.memo_bytes = 10
    engine.process(body(user("6 " + "y" * 900)), ANTH, {"x-acp-session": "c6"}, render=True)
    assert list(engine.sessions.memos) == ["c6"]  # the newest is always kept
    engine.sessions.memo_bytes = 1 << 30
    engine.sessions.max_sessions = 2  # never more than the sessions cached
    for i in range(7, 10):
        engine.process(body(user(f"{i}")), ANTH, {"x-acp-session": f"c{i}"}, render=True)
    assert list(engine.sessions.memos) == ["c8", "c9"]


def test_a_conversation_whose_id_holds_a_nul_never_touches_the_session_before_it(engine):
    """On PostgreSQL, libpq read ``"victim\\u0000other"`` as ``victim``: the other conversation's
    turn locked, read and wrote the victim's ledger (misattribution), and its next turn, read
    through psycopg, stopped the whole store.  Both backends now keep them apart."""
    victim = body(user("the victim's opening"), assistant("noted"), user("go on"), metadata={"session_id": "victim"})
    engine.process(victim, ANTH, {}, render=True)
    engine.write_pending()
    before = [(r.msg_id, r.ref) for r in engine.store.ledger("victim")]
    assert before
    other = [user("another conversation"), assistant("other answer"), user("more of it")]
    for n in (3, 3):  # its first turn, then the same again (as another instance would read it)
        res = engine.process(body(*other[:n], metadata={"session_id": "victim\0other"}), ANTH, {}, render=True)
        engine.write_pending()
        assert res.session != "victim"
    assert [(r.msg_id, r.ref) for r in engine.store.ledger("victim")] == before
