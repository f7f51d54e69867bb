"""Identity under churn: folds that survive re-serialisation, and never a wrong join.

The identity-proof matrix on all four lanes (a fold settles; id-scheme and serialisation churn
keeps coverage on the FIRST post-churn body; a mid-history edit honestly re-enters; with the layer
off the same churn re-bills), then the doctrine cases.
"""

from __future__ import annotations

import json

import pytest

import churn as C
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.wire import LANES

SID = "churn"
H = {"x-acp-session": SID}
SUMMARY = "Identity-proof fold summary covering the early turns: modules were read, values noted."
LANE_NAMES = ["anthropic", "chat", "responses", "gemini"]


def make_engine(backend, **kw) -> Engine:
    return Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=2000), **kw)


def send(engine, lane, conv) -> bytes:
    res = engine.process(C.body(lane, conv), LANES[lane], H, render=True)
    return res.body if res.body is not None else C.body(lane, conv)


def fold_early_turns(engine, lane, ts, sc, first=1, last=5):
    """Turns ``first``..``last`` folded into b1 by a model-made compress; returns the compress pair
    as the agent stores it, and the largest unfolded body seen."""
    out = send(engine, lane, C.BUILD[lane](ts, sc))
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs[f"Turn {first}: please"[:14]], "endId": refs[f"Reply Turn {last}: "[:14]],
                         "summary": SUMMARY}]}
    engine.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(lane, "cfold", "compress", args)
    folded = send(engine, lane, C.BUILD[lane](ts, sc, pair))
    assert b"[Compressed conversation section b1" in folded, "the fold settled"
    assert b"file-2-row-" not in folded
    return pair, len(out)


@pytest.mark.parametrize("lane", LANE_NAMES)
def test_churn_keeps_coverage_and_an_edit_re_enters(backend, lane):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, unfolded = fold_early_turns(engine, lane, ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    steady = send(engine, lane, C.BUILD[lane](ts, C.Scheme(), pair))
    assert b"file-2-row-" not in steady

    churned = C.Scheme(ids="alt_", spaced=True, strings=True, cache_at=-2)
    ts.append(C.Turn(13, "Turn 13: after the host re-serialised everything.", "Reply Turn 13.", tool=False))
    first = send(engine, lane, C.BUILD[lane](ts, churned, pair))
    assert b"[Compressed conversation section b1" in first
    assert b"file-2-row-" not in first and b"file-4-row-" not in first
    assert b"file-6-row-" in first  # outside the fold: still there
    assert len(first) < unfolded

    ts.append(C.Turn(14, "Turn 14: one more.", "Reply Turn 14.", tool=False))
    ts[2].user = ts[2].user.replace("Turn 2:", "Turn 2 [IDENTITY-PROOF-EDIT]:")
    edited = send(engine, lane, C.BUILD[lane](ts, churned, pair))
    assert b"[Compressed conversation section b1" in edited
    assert b"IDENTITY-PROOF-EDIT" in edited  # the edited original honestly re-enters
    assert b"file-4-row-" not in edited


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_control_without_the_layer_the_churn_re_bills(backend, lane):
    engine = make_engine(backend, reconcile=False)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, lane, ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    send(engine, lane, C.BUILD[lane](ts, C.Scheme(), pair))
    ts.append(C.Turn(13, "Turn 13: churned.", "Reply Turn 13.", tool=False))
    first = send(engine, lane, C.BUILD[lane](ts, C.Scheme(ids="alt_", spaced=True), pair))
    assert b"file-2-row-" in first


def test_cross_wire_swap_keeps_coverage(backend):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, unfolded = fold_early_turns(engine, "anthropic", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    send(engine, "anthropic", C.BUILD["anthropic"](ts, C.Scheme(), pair))
    # the same conversation continued on Chat Completions, tool ids re-minted, arguments re-encoded
    ts.append(C.Turn(13, "Turn 13: on another wire now.", "Reply Turn 13.", tool=False))
    chat_pair = C.proxy_call("chat", "cfold", "compress", json.loads(
        json.dumps({"content": [{"startId": "m00001", "endId": "m00002", "summary": SUMMARY}]})))
    first = send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(ids="alt_", spaced=True), chat_pair))
    assert b"[Compressed conversation section b1" in first
    assert b"file-2-row-" not in first and b"file-4-row-" not in first
    assert b"file-6-row-" in first


def test_model_switch_merging_reasoning_and_placeholdering_images(backend):
    engine = make_engine(backend)
    ts = C.turns(12, reasoning=True, images=True)
    pair, unfolded = fold_early_turns(engine, "chat", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    ts.append(C.Turn(13, "Turn 13: on a model without images or thinking.", "Reply Turn 13.", tool=False))
    switched = C.Scheme(merge_reasoning=True, placeholder_images=True)
    first = send(engine, "chat", C.BUILD["chat"](ts, switched, pair))
    assert b"[Compressed conversation section b1" in first
    assert b"file-2-row-" not in first
    assert b"scratch-2-final" not in first  # covered thinking never re-enters
    assert b"scratch-8-final" in first and b"image omitted" in first
    assert len(first) < unfolded


def test_a_systematic_re_stamp_is_never_claimed(backend):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, "chat", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next.", "Reply Turn 12.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    stamped = send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(ids="alt_", suffix=" [stamped]"), pair))
    # every prose text changed: nothing verifies, so the originals re-enter (or the turn passes
    # through untouched); a summary standing in for different words would be a wrong join
    text = stamped.decode()
    assert "Turn 2: please analyze module 2" in text
    assert engine.sessions[SID].flags.get("drift", {}).get("claims", 0) == 0


def test_benign_truncation_snoozes_the_block(backend):
    engine = make_engine(backend)
    ts = C.turns(14)
    pair, _ = fold_early_turns(engine, "chat", ts, C.Scheme(), first=1, last=4)
    ts.append(C.Turn(14, "Turn 14: next.", "Reply Turn 14.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    # the host drops its oldest slice (turns 0-5, the folded range among them)
    kept = ts[6:] + [C.Turn(15, "Turn 15: after truncation.", "Reply Turn 15.", tool=False)]
    res = engine.process(C.body("chat", C.BUILD["chat"](kept, C.Scheme(), pair)), LANES["chat"], H, render=True)
    assert res.drift == "truncated"
    out = res.body or b""
    assert b"[Compressed conversation section b1" not in out  # snoozed, not rendered out of place
    b1 = engine.sessions[SID].blocks[0]
    assert b1.active  # nothing deleted


def test_a_foreign_conversation_under_the_same_id_is_drift_and_gets_no_summary(backend):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, "chat", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next.", "Reply Turn 12.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    other = [C.Turn(t, f"Other topic {t}: tell me about birds. {C.FILLER}", f"Birds {t}.", tool=t % 3 == 0)
             for t in range(12)]
    raw = C.body("chat", C.BUILD["chat"](other, C.Scheme(ids="x_")))
    res = engine.process(raw, LANES["chat"], H, render=True)
    assert res.drift in ("drift", "collapse") and res.drift != "truncated"
    assert b"[Compressed conversation section" not in (res.body or raw)


def test_total_collapse_pauses_passes_through_and_recovers(backend):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, "chat", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next.", "Reply Turn 12.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    stamped = C.body("chat", C.BUILD["chat"](ts, C.Scheme(ids="zz_", suffix=" §"), pair))
    res = engine.process(stamped, LANES["chat"], H, render=True)
    assert res.drift == "collapse" and res.body is None  # byte-exact pass-through
    again = engine.process(stamped, LANES["chat"], H, render=True)
    assert again.body is None
    blocks = engine.sessions[SID].blocks
    assert blocks and blocks[0].active  # nothing was deleted
    # the agent sends the true history again: folding resumes by itself
    ts.append(C.Turn(13, "Turn 13: back to normal.", "Reply Turn 13.", tool=False))
    res = engine.process(C.body("chat", C.BUILD["chat"](ts, C.Scheme(), pair)), LANES["chat"], H, render=True)
    assert res.drift == "recovered"
    assert b"[Compressed conversation section b1" in res.body and b"file-2-row-" not in res.body


def test_a_re_sent_copy_of_folded_text_is_a_new_instance(backend):
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, "chat", ts, C.Scheme())
    ts.append(C.Turn(12, "Turn 12: next.", "Reply Turn 12.", tool=False))
    send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    # the host drops its oldest slice; later the user sends, word for word, a folded message
    kept = ts[7:]
    send(engine, "chat", C.BUILD["chat"](kept, C.Scheme(), pair))
    repeat = C.Turn(13, ts[3].user, "Reply again.", tool=False)
    appended = C.BUILD["chat"](kept, C.Scheme(), pair) + C.BUILD["chat"]([repeat], C.Scheme())[1:]
    out = send(engine, "chat", appended)
    assert ts[3].user[:40].encode() in out  # a new instance: not swallowed by the fold it resembles
    # while the echo of a folded original that is still there stays folded
    full = send(engine, "chat", C.BUILD["chat"](ts, C.Scheme(), pair))
    assert b"file-2-row-" not in full


def test_image_identity_is_per_payload(backend):
    engine = make_engine(backend)
    ts = C.turns(4, images=True)
    a = json.loads(send(engine, "chat", C.BUILD["chat"](ts, C.Scheme())))
    ts_changed = C.turns(4, images=True)
    conv = C.BUILD["chat"](ts_changed, C.Scheme())
    users = [m for m in conv if m["role"] == "user"]
    users[1]["content"][1]["image_url"]["url"] = "data:image/png;base64,QUJD"  # one image replaced
    res = engine.process(C.body("chat", conv), LANES["chat"], H, render=True)
    assert res.refs_new == 1  # only that image was re-minted; its siblings kept their refs
    b = json.loads(res.body)
    assert a["messages"][1] == b["messages"][1]  # a sibling image's message: the same ref, the same bytes


# -- the msgid envelope ------------------------------------------------------------------------

def test_vouched_ids_win_over_content_churn_and_never_leave(backend):
    engine = make_engine(backend)
    ts = C.turns(6)
    conv = C.BUILD["chat"](ts, C.Scheme())
    ids = [f"host-{i}" for i in range(len(conv))]
    raw = json.loads(C.body("chat", conv))
    raw["biliMsgIds"] = ids
    first = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
    assert b"biliMsgIds" not in first.body
    refs = C.refs_by_text(first.body)
    # the host re-encodes everything (new tool ids, re-serialised arguments): the ids still hold
    churned = json.loads(C.body("chat", C.BUILD["chat"](ts, C.Scheme(ids="alt_", spaced=True))))
    churned["biliMsgIds"] = ids
    res = engine.process(json.dumps(churned).encode(), LANES["chat"], H, render=True)
    assert C.refs_by_text(res.body) == refs
    assert res.refs_new == 0


def test_a_vouched_id_keeps_its_refs_only_while_its_words_are_the_same(backend):
    """A vouched id pinned its refs on its message's shape alone: the words a user edited under it kept
    the old ref (a folded message's edit never reached the model), an id a host re-used for another
    message of the same shape gave two messages one ref, and a resync kept every such binding."""
    engine = make_engine(backend)

    def send(msgs, ids, resync=False):
        raw = {"model": "gpt-x", "messages": msgs, "biliMsgIds": {"ids": ids, "resync": True} if resync else ids}
        res = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
        assert res.status == 0, res.error
        return [(C.TAG.match(m["content"]).group(1), C.TAG.sub("", m["content"], count=1))
                for m in json.loads(res.body)["messages"] if C.TAG.match(m.get("content") or "")]

    u1, a1, u2 = ({"role": "user", "content": "alpha question about parsing"},
                  {"role": "assistant", "content": "beta answer"}, {"role": "user", "content": "ok go on"})
    first = send([u1, a1, u2], ["a", "b", "c"])
    assert send([u1, a1, u2], ["a2", "b", "c"]) == first  # (the host re-minted the first id: the same words)
    later = send([u1, a1, u2, {"role": "assistant", "content": "done"},
                  {"role": "user", "content": "zeta: a completely different request"}], ["a2", "b", "c", "d", "a"])
    assert len({r for r, _ in later}) == len(later)  # "a" names other words now: another ref
    edited = send([u1, a1, {"role": "user", "content": "ok go on, but use the v2 schema"}], ["a2", "b", "c"])
    assert edited[:2] == first[:2] and edited[2][0] not in {r for r, _ in first}
    again = send([u1, a1, u2], ["x", "y", "z"], resync=True)  # re-claimed: content identity, bound anew
    assert again == first


def test_a_vouched_history_sent_again_makes_no_words(backend, monkeypatch):
    """Words (canonical texts: every tool output normalised) are made for what a turn binds and for what
    changed bytes, never for a history sent again as it was (every id's item, every turn)."""
    from bili_addon.kernel import envelope

    engine = make_engine(backend)
    conv = C.BUILD["chat"](C.turns(6), C.Scheme())
    raw = json.loads(C.body("chat", conv))
    raw["biliMsgIds"] = [f"host-{i}" for i in range(len(conv))]
    made = []
    real = envelope.words_of
    monkeypatch.setattr(envelope, "words_of", lambda parts: made.append(1) or real(parts))
    first = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True).body
    assert made
    made.clear()
    assert engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True).body == first and not made
    churned = json.loads(C.body("chat", C.BUILD["chat"](C.turns(6), C.Scheme(ids="alt_", spaced=True))))
    churned["biliMsgIds"] = raw["biliMsgIds"]
    again = engine.process(json.dumps(churned).encode(), LANES["chat"], H, render=True)
    assert again.refs_new == 0 and made  # (re-serialised: its words compared, the same)
    made.clear()
    assert engine.process(json.dumps(churned).encode(), LANES["chat"], H, render=True).refs_new == 0 and not made


def test_a_live_id_re_used_for_another_message_is_refused_unless_resync(backend):
    engine = make_engine(backend)
    conv = C.BUILD["chat"](C.turns(2), C.Scheme())
    ids = [f"host-{i}" for i in range(len(conv))]
    raw = json.loads(C.body("chat", conv))
    raw["biliMsgIds"] = ids
    engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
    swapped = list(ids)
    swapped[1], swapped[2] = swapped[2], swapped[1]  # a user message's id now names an assistant message
    raw["biliMsgIds"] = swapped
    res = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
    assert res.status == 400 and "already bound" in res.error
    raw["biliMsgIds"] = {"ids": swapped, "resync": True}
    res = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
    assert res.status == 0 and res.body is not None and b"biliMsgIds" not in res.body


@pytest.mark.parametrize("bad", [["a", "b"], "not-a-list", None])
def test_an_unusable_set_is_dropped_whole(backend, bad):
    engine = make_engine(backend)
    conv = C.BUILD["chat"](C.turns(2), C.Scheme())
    raw = json.loads(C.body("chat", conv))
    raw["biliMsgIds"] = bad if bad is not None else ["dup"] * len(conv)
    res = engine.process(json.dumps(raw).encode(), LANES["chat"], H, render=True)
    assert res.status == 0 and any("message ids ignored" in n for n in res.notes)
    assert b"biliMsgIds" not in res.body
    assert engine.sessions[SID].flags.get("envelope") is None  # nothing claimed


def test_the_header_form_is_removed_before_the_request_leaves(tmp_path):
    from mitmproxy import http
    from mitmproxy.test import taddons, tflow, tutils

    from bili_addon.shell import Bili

    conv = C.BUILD["chat"](C.turns(2), C.Scheme())
    addon = Bili()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, bili_data_dir=str(tmp_path))
        req = tutils.treq(method=b"POST", path=b"/v1/chat/completions", host="api.openai.com", port=443,
                          scheme=b"https", content=C.body("chat", conv),
                          headers=http.Headers(host="api.openai.com", content_type="application/json",
                                               x_acp_session="hdr", x_bili_msg_ids=json.dumps(
                                                   [f"h{i}" for i in range(len(conv))])))
        f = tflow.tflow(req=req)
        addon.request(f)
        assert "x-bili-msg-ids" not in f.request.headers
        assert f.response is None
        assert addon.engine.sessions["hdr"].flags.get("envelope")
    addon.done()


# -- snapshot render ---------------------------------------------------------------------------

def run_session(engine, lane, churn_at=None):
    """A fold, steady turns, and (optionally) a churned re-serialisation; the bodies sent."""
    ts = C.turns(12)
    bodies = []
    out = send(engine, lane, C.BUILD[lane](ts, C.Scheme()))
    bodies.append(out)
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "], "summary": SUMMARY}]}
    engine.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(lane, "cfold", "compress", args)
    for t in range(12, 16):
        sc = C.Scheme(ids="alt_", spaced=True) if churn_at is not None and t >= churn_at else C.Scheme()
        bodies.append(send(engine, lane, C.BUILD[lane](ts, sc, pair)))
        ts.append(C.Turn(t, f"Turn {t}: more.", f"Reply Turn {t}.", tool=False))
    return bodies


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_snapshot_render_is_byte_identical_on_an_undisturbed_session(backend, lane):
    normal = run_session(make_engine(lambda: backend("n")), lane)
    snap = run_session(make_engine(lambda: backend("s"), snapshot=True), lane)
    assert normal == snap
    assert b"[Compressed conversation section b1" in snap[-1]


def test_snapshot_render_keeps_the_fold_through_churn_from_its_own_transcript(backend):
    bodies = run_session(make_engine(backend, snapshot=True, reconcile=False), "chat", churn_at=14)
    first_churned = bodies[3]
    assert b"[Compressed conversation section b1" in first_churned
    assert b"file-2-row-" not in first_churned
    # the prefix went out as the transcript has it: the pre-churn bytes, ids included
    assert b'"alt_0"' not in first_churned.split(b"[Compressed")[0]


def test_snapshot_render_sends_the_reasoning_of_the_answer_the_agent_has(backend):
    """The transcript's join took a reasoning item by its role alone: after the agent asked a turn again (a
    new answer, new reasoning), the old answer's reasoning (its id, its encrypted content) went up in front
    of the new answer."""
    engine = make_engine(backend, snapshot=True)
    ts = C.turns(12)
    refs = C.refs_by_text(send(engine, "responses", C.BUILD["responses"](ts, C.Scheme())))
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "], "summary": "S" * 120}]}
    engine.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    base = C.BUILD["responses"](ts, C.Scheme(), C.proxy_call("responses", "cfold", "compress", args))
    assert b"[Compressed conversation section b1" in send(engine, "responses", base)
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Which module is slowest?"}]}
    more = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks, go on"}]}

    def answer(tag):
        return [{"type": "reasoning", "id": f"rs_{tag}", "summary": [], "encrypted_content": f"ENC-{tag}"},
                {"type": "message", "id": f"msg_{tag}", "role": "assistant",
                 "content": [{"type": "output_text", "text": f"Answer {tag}: module 3."}]}]

    send(engine, "responses", base + [ask, *answer("A"), more])
    out = send(engine, "responses", base + [ask, *answer("B"), more])  # the agent asked again: a new answer
    assert b"ENC-B" in out and b"ENC-A" not in out and b"rs_A" not in out


def test_snapshot_render_falls_back_when_nothing_links(backend):
    a, b = make_engine(lambda: backend("a")), make_engine(lambda: backend("b"), snapshot=True)
    for e in (a, b):
        run_session(e, "chat")
    other = [C.Turn(t, f"Entirely new {t}. {C.FILLER}", f"New {t}.", tool=False) for t in range(11)]
    raw = C.body("chat", C.BUILD["chat"](other, C.Scheme()))
    ra = a.process(raw, LANES["chat"], H, render=True)
    rb = b.process(raw, LANES["chat"], H, render=True)
    assert ra.body == rb.body


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_a_distil_of_re_anchored_blocks_keeps_their_claims(backend, lane):
    """b1's messages churned (re-minted tool-call ids): its claims hold the refs they have now.
    A distil that absorbs b1 took those refs into its own ``covered`` beside the originals, with no
    claim: every original ref then counted as a folded part missing from the wire, on every turn of
    an unchanged history (drift), and from ten of them the session latched and the whole history
    went back upstream.  The new block carries the claims."""
    engine = make_engine(backend)
    ts = C.turns(24)
    pair, _ = fold_early_turns(engine, lane, ts, C.Scheme(), 1, 12)
    churned = C.Scheme(ids="alt_")
    out = send(engine, lane, C.BUILD[lane](ts, churned, pair))
    assert b"file-2-row-" not in out and engine.sessions[SID].blocks[0].claimed  # re-anchored
    refs = C.refs_by_text(out)
    a2 = {"content": [{"startId": refs["Turn 13: please"[:14]], "endId": refs["Reply Turn 15: "[:14]],
                       "summary": SUMMARY + " (13-15)"}]}
    engine.record_calls(SID, [("cf2", "compress", json.dumps(a2))])
    pair2 = C.proxy_call(lane, "cf2", "compress", a2)
    send(engine, lane, C.BUILD[lane](ts, churned, pair + pair2))
    a3 = {"content": [{"startId": "b1", "endId": "b2",
                       "summary": "Distilled: turns 1-15, modules read, values noted, nothing left open."}]}
    engine.record_calls(SID, [("cf3", "compress", json.dumps(a3))])
    pair3 = C.proxy_call(lane, "cf3", "compress", a3)
    send(engine, lane, C.BUILD[lane](ts, churned, pair + pair2 + pair3))
    b3 = next(b for b in engine.sessions[SID].blocks if b.id == "b3")
    assert b3.active
    for t in range(24, 28):
        ts.append(C.Turn(t, f"Turn {t}: steady.", f"Reply Turn {t}.", tool=False))
        res = engine.process(C.body(lane, C.BUILD[lane](ts, churned, pair + pair2 + pair3)), LANES[lane], H,
                             render=True)
        out = res.body
        assert not res.drift, res.drift
        assert not engine.sessions[SID].copy.latched
        assert b"section b3" in out and b"file-2-row-" not in out and b"file-14-row-" not in out


REWIND_SUMMARY = ("Turns 1-5: modules 1-5 analysed. In turn 5 we DELETED mod5.py and rewrote the config "
                  "(the user later regretted it).")


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_a_rewind_past_a_fold_leaves_its_summary_out_until_the_branch_comes_back(backend, lane):
    """b1 folds turns 1-5; the user rewinds to turn 3 and goes another way (the same session).  b1's
    summary stood in place of turns 1-3 and told the model of turns 4-5, which this branch does not
    have (its verdict was drift: nothing done).  A rewind is told now (the history is the copy's up
    to a point, then another): the blocks that covered messages past that point are not rendered on
    this branch, turn after turn, and are again when the agent returns to the first branch."""
    engine = make_engine(backend)
    ts = C.turns(12)
    out = send(engine, lane, C.BUILD[lane](ts, C.Scheme()))
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "],
                         "summary": REWIND_SUMMARY}]}
    engine.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(lane, "cfold", "compress", args)
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    first_branch = C.BUILD[lane](ts, C.Scheme(), pair)
    assert b"DELETED mod5.py" in send(engine, lane, first_branch)
    rew = ts[:4] + [C.Turn(20, "Turn 20: a different path after the rewind.", "Reply Turn 20.", tool=False),
                    C.Turn(21, "Turn 21: and more on it.", "Reply Turn 21.", tool=False)]
    for extra in range(3):
        res = engine.process(C.body(lane, C.BUILD[lane](rew, C.Scheme())), LANES[lane], H, render=True)
        out = res.body or C.body(lane, C.BUILD[lane](rew, C.Scheme()))
        assert res.drift == "rewound"
        assert b"DELETED mod5.py" not in out and b"Compressed conversation section b1" not in out
        assert b"Turn 2: please" in out and b"Turn 3: please" in out  # (on the wire, as they are)
        rew.append(C.Turn(22 + extra, f"Turn {22 + extra}: still on the new branch.", "ok", tool=False))
    back = send(engine, lane, first_branch)
    assert b"DELETED mod5.py" in back and b"Turn 2: please" not in back


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_a_retried_prompt_a_fold_covers_stays_on_the_wire(backend, lane):
    """After a rewind to turn 3 the user sends turn 4's prompt again, word for word: its ref is the
    folded one (the same words, the same instance), so b1's summary took the place of the user's
    newest message.  An item a fold never takes (the newest user turn, the recent zone) stays on the
    wire whatever covers it."""
    engine = make_engine(backend)
    ts = C.turns(12)
    pair, _ = fold_early_turns(engine, lane, ts, C.Scheme(), 1, 5)
    ts.append(C.Turn(12, "Turn 12: next question.", "Reply Turn 12.", tool=False))
    send(engine, lane, C.BUILD[lane](ts, C.Scheme(), pair))
    conv = C.BUILD[lane](ts[:4], C.Scheme())
    if lane == "anthropic":
        conv[-1]["content"][-1].pop("cache_control", None)
    conv.append({"role": "user", "content": [{"type": "text", "text": ts[4].user}]})
    out = json.loads(send(engine, lane, conv))
    assert ts[4].user[:30] in json.dumps(out["messages"][-1])


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_words_said_again_keep_their_place_when_the_folded_copy_is_truncated_away(backend, lane):
    """The user said the same words in turn 2 (folded into b1) and in turn 9 (not folded).  The host
    then dropped its oldest slice, turn 2 with it: turn 9's copy became the first instance of those
    words in the request and took the folded copy's ref; b1's summary stood in its place and the
    message was gone, turn after turn.  A truncation leaves a block's newest messages: a block whose
    message here comes before one of its messages the truncation took is not rendered."""
    engine = make_engine(backend)
    ts = C.turns(12)
    dup = "Please continue. " + C.FILLER
    ts[2].user = ts[9].user = dup
    pair, _ = fold_early_turns(engine, lane, ts, C.Scheme(), 1, 5)
    ts.append(C.Turn(12, "Turn 12: next.", "Reply Turn 12.", tool=False))
    assert send(engine, lane, C.BUILD[lane](ts, C.Scheme(), pair)).count(b"Please continue.") == 1
    kept = ts[6:] + [C.Turn(13, "Turn 13: after the truncation.", "Reply Turn 13.", tool=False)]
    for extra in range(3):
        out = send(engine, lane, C.BUILD[lane](kept, C.Scheme(), pair))
        assert out.count(b"Please continue.") == 1, extra
        kept.append(C.Turn(14 + extra, f"Turn {14 + extra}: steady.", "ok", tool=False))


def test_a_fold_made_after_a_rewind_stands_turn_after_turn(backend):
    """After a rewind into b1's range, b1 is not rendered and its message still here is on the wire as
    it is; the model then folds a range over it.  The new block took b1 in, with b1's messages this
    branch does not have: it stood on the turn that made it, and from the next (the identical request
    too) the rewind left it out as well: the model's fold undone, the bytes of one history changing."""
    row = " ".join(f"row-{i}" for i in range(200))

    def step(t):
        return [{"role": "assistant", "content": f"Step {t}.", "tool_calls": [
                    {"id": f"c{t}", "type": "function", "function": {"name": "sh", "arguments": f'{{"t":{t}}}'}}]},
                {"role": "tool", "tool_call_id": f"c{t}", "content": f"file-{t} {row}"}]

    def call(cid, args):
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "compress", "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": cid, "content": "Tool compress not found"}]

    engine = Engine(backend(), fold_cfg=FoldConfig(min_compress_chars=300))
    lane = LANES["chat"]

    def send(msgs):
        return engine.process(json.dumps({"model": "gpt-4.1", "messages": msgs}).encode(), lane, H, render=True)

    head = [{"role": "system", "content": "agent"}, {"role": "user", "content": "audit please"}]
    msgs = head + [x for t in range(6) for x in step(t)] + [{"role": "user", "content": "go on"}]
    r = C.refs_by_text(send(msgs).body)
    a1 = {"content": [{"startId": r["Step 1."], "endId": r["Step 2."],
                       "summary": "S1: modules 1-2 read; nothing unusual, mod2.py defines load_config() at line 40."}]}
    engine.record_calls(SID, [("k1", "compress", json.dumps(a1))])
    msgs += call("k1", a1)
    assert send(msgs).executed == ["compress"]
    msgs = head + [x for t in range(2) for x in step(t)] + [{"role": "user", "content": "try another way"}]
    msgs += [x for t in range(10, 16) for x in step(t)] + [{"role": "user", "content": "continue"}]
    r = C.refs_by_text(send(msgs).body)
    a2 = {"content": [{"startId": r["Step 1."], "endId": r["Step 11."],
                       "summary": "S2: modules 1 and 10-11 read; nothing unusual, mod11.py defines parse_args()."}]}
    engine.record_calls(SID, [("k2", "compress", json.dumps(a2))])
    msgs += call("k2", a2)
    first = send(msgs)
    assert first.executed == ["compress"] and b"section b2" in first.body
    assert send(msgs).body == first.body
    later = send(msgs + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]).body
    assert b"section b2" in later and b"file-11 row-0" not in later


def test_a_truncation_that_aligns_the_history_again_ends_a_pause_at_once():
    """A collapse paused folding; the next history is the copy with its oldest slice dropped (a
    truncation, the copy's order at its head): that request went up untouched (still paused), and
    the identical next one was rewritten (the pass before had ended the pause): two bodies."""
    from bili_addon.kernel import reconcile
    from bili_addon.kernel.fold import Block, PartView, View, ViewItem

    def item(k):
        return ViewItem(k, [PartView(f"m{k + 1:05d}", "user" if k % 2 == 0 else "assistant", "text", "", "",
                                     f"message number {k} says something of its own", 12)])

    old = [item(k) for k in range(30)]
    block = Block("b1", 1, "summary " * 10, "", ["m00001", "m00002"], ["m00001", "m00002"], [], "m00001", "m00002")
    copy = reconcile.Copy(refs=[p.ref for it in old for p in it.parts],
                          fps=[reconcile.fingerprint(p) for it in old for p in it.parts],
                          items=list(range(30)), latched=True)
    view = View(old[4:])  # the oldest four items dropped
    out = reconcile.Outcome(missing=2, covered=2, unmatched=["m00001", "m00002"])
    reconcile.verdict(out, view, [block], copy, lambda refs: [(r, "", "", "", 0, "gone text") for r in refs])
    assert out.verdict == "truncated" and not copy.latched
