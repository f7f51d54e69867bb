"""The identity-proof matrix end to end: the churn conversations of ``tests/churn.py`` through a real
``mitmdump --mode reverse`` with the bili addon, answered by the scripted fake model.

Each test is one client session under a fixed ``x-acp-session``: an old history of twelve turns
(built by ``churn.BUILD`` under some churn scheme), then the live exchange the test drives turn by
turn.  On the first live turn the scripted model calls ``compress`` on turns 1-5, reading the refs
from the tags of the body it received; the client stores the answer as it came, answers the tool
it does not know with its usual error, and goes on.  Every assertion is on what the fake upstream
RECEIVED (or, for the proxy's own answers, on what the client got back).

Proxies (one per configuration, shared by the module): the layer on; the layer off
(``bili_fold_reconcile=false``, the control); snapshot render on; snapshot render with the layer off.
Three addon bugs found while writing these tests were fixed: coverage re-counted after a large
re-anchoring, images re-anchored by guess, and stale cache breakpoints in the snapshot render.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .fake_upstream import Recorded, proxy_call, say
from .support import Mitmdump, Reply, request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the churn builders
import churn as C

pytestmark = pytest.mark.e2e

LANES = ["anthropic", "chat", "responses", "gemini"]
PATHS = {
    "anthropic": "/v1/messages",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "gemini": "/v1beta/models/gemini-x:generateContent",
}
SUMMARY = "Identity-proof fold summary covering the early turns: modules were read, values noted."
SUMMARY_HEAD = b"[Compressed conversation section b1"
FOLD_PROMPT = "Please fold what you no longer need before we go on."
UNKNOWN = {  # each lane's agent error for a tool it does not know
    "anthropic": "<tool_use_error>Error: No such tool available: {name}</tool_use_error>",
    "chat": "Tool {name} not found",
    "responses": "unsupported call: {name}",
    "gemini": "unknown tool",
}
PLAIN = C.Scheme()  # the history as the host first wrote it
CHURNED = C.Scheme(ids="alt_", spaced=True, strings=True, cache_at=-2)


# -- what a covered original looks like on the wire ------------------------------------------------

def originals(turns) -> list[str]:
    """Text only the originals of ``turns`` carry: prose, tool calls and their outputs."""
    out = []
    for t in turns:
        out += [f"Turn {t}: please analyze module {t}.", f"Reply Turn {t}: module {t} reviewed."]
        if t % 2 == 0:
            out += [f"file-{t}-row-", f"cat mod{t}.py"]
    return out


COVERED = originals(range(1, 6))  # the fold: turns 1-5
KEPT = originals(range(6, 12))


def flat(raw: bytes) -> str:
    """Every string of a JSON body, whitespace-normalised (a re-wrapped line still matches)."""
    return "\x00".join(" ".join(x.split()) for x in C.strings(json.loads(raw)))


def present(raw: bytes, needles) -> list[str]:
    text = flat(raw)
    return [n for n in needles if n in text]


def assert_folded(raw: bytes, covered=COVERED, kept=KEPT) -> None:
    """b1 stands once, none of its originals is on the wire, the turns after it are."""
    assert raw.count(SUMMARY_HEAD) == 1, "b1's summary should stand exactly once"
    assert not present(raw, covered), f"covered originals on the wire: {present(raw, covered)}"
    assert present(raw, kept) == kept, "the turns after the fold stay"


# -- the scripted model ---------------------------------------------------------------------------

def fold_args(first: int, last: int):
    """The compress a model would write: the refs it was shown for turn ``first``'s question and
    turn ``last``'s reply, read from the tags of the body the fake received."""

    def args(body: Any) -> dict:
        refs = C.refs_by_text(json.dumps(body).encode())
        return {"content": [{"startId": refs[f"Turn {first}: please"[:14]],
                             "endId": refs[f"Reply Turn {last}: "[:14]], "summary": SUMMARY}]}

    return args


def script(fake, key: str, first: int = 1, last: int = 5, fold: bool = True):
    """Turn 1 folds ``first``..``last`` (unless not ``fold``); every other turn is a short answer."""
    acts = [proxy_call("compress", fold_args(first, last), prose="Folding the early turns now.") if fold
            else say("Answer 1: noted, going on.")]
    acts += [say(f"Answer {n}: noted, going on.") for n in range(2, 40)]
    return fake.script(key, acts)


# -- lane items the client writes --------------------------------------------------------------------

def user_item(lane: str, text: str) -> dict:
    if lane == "anthropic":
        return {"role": "user", "content": [{"type": "text", "text": text}]}
    if lane == "chat":
        return {"role": "user", "content": text}
    if lane == "responses":
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {"role": "user", "parts": [{"text": text}]}


@dataclass
class Call:
    id: str
    name: str
    args: str


def answer_items(lane: str, resp: Any) -> tuple[list[dict], Call | None]:
    """The model's answer as the agent stores it (from the JSON the client got), and its call."""
    call = None
    if lane == "anthropic":
        blocks = []
        for b in resp["content"]:
            if b["type"] == "text":
                blocks.append({"type": "text", "text": b["text"]})
            elif b["type"] == "tool_use":
                blocks.append({"type": "tool_use", "id": b["id"], "name": b["name"], "input": b["input"]})
                call = Call(b["id"], b["name"], json.dumps(b["input"]))
        return [{"role": "assistant", "content": blocks}], call
    if lane == "chat":
        m = resp["choices"][0]["message"]
        item: dict = {"role": "assistant", "content": m.get("content")}
        if m.get("tool_calls"):
            c = m["tool_calls"][0]
            item["tool_calls"] = [{"id": c["id"], "type": "function",
                                   "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}]
            call = Call(c["id"], c["function"]["name"], c["function"]["arguments"])
        return [item], call
    if lane == "responses":
        items = []
        for it in resp["output"]:
            if it["type"] == "message":
                text = "".join(p["text"] for p in it["content"] if p["type"] == "output_text")
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
            elif it["type"] == "function_call":
                items.append({"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                              "arguments": it["arguments"]})
                call = Call(it["call_id"], it["name"], it["arguments"])
        return items, call
    parts = resp["candidates"][0]["content"]["parts"]
    for p in parts:
        if "functionCall" in p:
            fc = p["functionCall"]
            call = Call(fc.get("id", ""), fc["name"], json.dumps(fc.get("args", {})))
    return [{"role": "model", "parts": parts}], call


def unknown_items(lane: str, call: Call) -> list[dict]:
    """The agent's answer to a tool it does not know (the proxy's)."""
    err = UNKNOWN[lane].format(name=call.name)
    if lane == "anthropic":
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                              "content": err}]}]
    if lane == "chat":
        return [{"role": "tool", "tool_call_id": call.id, "content": err}]
    if lane == "responses":
        return [{"type": "function_call_output", "call_id": call.id, "output": err}]
    return [{"role": "user", "parts": [{"functionResponse": {"name": call.name, "response": {"error": err}}}]}]


# -- one client session ---------------------------------------------------------------------------------

@dataclass
class Sent:
    raw: bytes  # what the client sent
    reply: Reply  # what the client got back
    rec: Recorded | None  # what the upstream received (None: nothing reached it)

    @property
    def up(self) -> bytes:
        assert self.rec is not None, f"nothing reached the upstream (the client got {self.reply.status})"
        assert self.rec.status == 200, f"the fake refused the body: {self.rec.error or self.rec.response[:300]!r}"
        return self.rec.body


class Session:
    """A client of one lane: twelve old turns (``ts``), then the live exchange in ``tail``."""

    def __init__(self, fake, proxy: Mitmdump, lane: str, sid: str, ts=None, *, key: str | None = None,
                 first: int = 1, last: int = 5, reasoning: bool = False, images: bool = False,
                 fold: bool = True):
        self.fake, self.proxy, self.lane, self.sid = fake, proxy, lane, sid
        self.key = key or sid
        self.ts = ts if ts is not None else C.turns(12, reasoning=reasoning, images=images)
        # a conversation of its own: the same words and call ids under another id would be a fork
        # of an earlier test's session (kernel/lineage.py), as it is with real agents
        self.ts[0] = dataclasses.replace(self.ts[0], user=f"{self.ts[0].user} (conversation {sid})")
        self.tail: list[dict] = []
        self.turn = 0
        self.calls: list[Call] = []
        self.covered, self.kept = originals(range(first, last + 1)), originals(range(last + 1, len(self.ts)))
        script(fake, self.key, first, last, fold)

    def conv(self, sc: C.Scheme = PLAIN, ts=None, extra=()) -> list[dict]:
        return C.BUILD[self.lane](self.ts if ts is None else ts, sc, copy.deepcopy(self.tail + list(extra)))

    def body(self, prompt: str, sc: C.Scheme = PLAIN, ts=None, ids=None) -> bytes:
        """The request body; ``ids(n)`` gives the ``biliMsgIds`` value for ``n`` items (the envelope)."""
        conv = self.conv(sc, ts, [user_item(self.lane, prompt)])
        raw = C.body(self.lane, conv)
        if ids is None:
            return raw
        doc = json.loads(raw)
        doc["biliMsgIds"] = ids(len(conv))
        return json.dumps(doc).encode()

    def post(self, raw: bytes, headers: dict[str, str] | None = None) -> Sent:
        """One request through the proxy; the record of what reached the upstream, if anything did."""
        self.turn += 1
        case = uuid.uuid4().hex
        h = {"content-type": "application/json", "accept-encoding": "identity", "x-acp-session": self.sid,
             "x-fake-script": self.key, "x-fake-turn": str(self.turn), "x-case": case, **(headers or {})}
        reply = request(self.proxy.url + PATHS[self.lane], raw, headers=h)
        recs = self.fake.find(lambda r: r.header("x-case") == case)
        if reply.status != 200 or not recs:
            self.turn -= 1  # the model never saw it: the same act answers the next try
        return Sent(raw, reply, recs[-1] if recs else None)

    def send(self, prompt: str, sc: C.Scheme = PLAIN, ts=None, *, store: bool = True,
             headers: dict[str, str] | None = None, ids=None) -> Sent:
        """The user says ``prompt`` (the history built under ``sc``); the answer is stored as the
        agent stores it, a proxy tool call answered with the agent's error."""
        sent = self.post(self.body(prompt, sc, ts, ids), headers)
        assert sent.reply.status == 200, sent.reply.body[:400]
        if store:
            items, call = answer_items(self.lane, sent.reply.json())
            self.tail += [user_item(self.lane, prompt), *items]
            if call is not None:
                self.calls.append(call)
                self.tail += unknown_items(self.lane, call)
        return sent

    def fold(self) -> tuple[Sent, Sent]:
        """The fold turn (the model calls compress) and the next one (the fold settles)."""
        asked = self.send(FOLD_PROMPT)
        assert self.calls and self.calls[-1].name == "compress", asked.reply.body[:400]
        assert present(asked.up, self.covered) == self.covered, "before the fold everything is on the wire"
        settled = self.send("Thanks. Now go on with the next module.")
        assert_folded(settled.up, self.covered, self.kept)
        return asked, settled

    def drift(self) -> dict:
        s = self.proxy.session(self.sid)
        assert s is not None, f"the proxy knows no session {self.sid}"
        return s["flags"].get("drift", {})


# -- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy(make_proxy) -> Mitmdump:
    return make_proxy("reverse", "fold")


@pytest.fixture(scope="module")
def control(make_proxy) -> Mitmdump:
    """The same proxy with the churn layer off."""
    return make_proxy("reverse", "fold", bili_fold_reconcile="false")


@pytest.fixture(scope="module")
def snap_proxy(make_proxy) -> Mitmdump:
    return make_proxy("reverse", "fold", bili_snapshot_render="true")


@pytest.fixture(scope="module")
def snap_only(make_proxy) -> Mitmdump:
    """Snapshot render with the churn layer off: the transcript alone has to hold the fold."""
    return make_proxy("reverse", "fold", bili_snapshot_render="true", bili_fold_reconcile="false")


# -- the matrix -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lane", LANES)
def test_churn_keeps_coverage_and_an_edit_re_enters(fake, proxy, sid, lane):
    s = Session(fake, proxy, lane, sid)
    asked, _ = s.fold()
    unfolded = len(asked.up)
    assert_folded(s.send("Steady: module 13, please.").up)

    # the host re-serialises everything: tool ids re-minted, arguments re-encoded, string contents,
    # cache_control moved
    first = s.send("Module 14, after the host re-serialised its history.", CHURNED)
    assert_folded(first.up)  # the FIRST post-churn body already
    assert len(first.up) < unfolded
    assert b"alt_0" in first.up, "the churn itself reached the upstream (outside the fold)"
    drift = s.drift()
    assert drift.get("claims", 0) >= 4 and drift.get("transformed") == 1, drift
    assert_folded(s.send("Module 15, on the re-serialised history.", CHURNED).up)  # and the turn after it

    # a mid-history edit of a covered original: it honestly re-enters, the rest stays folded
    s.ts[2].user = s.ts[2].user.replace("Turn 2:", "Turn 2 [IDENTITY-PROOF-EDIT]:")
    edited = s.send("Module 16, after an edit of an old message.", CHURNED).up
    assert SUMMARY_HEAD in edited
    assert b"Turn 2 [IDENTITY-PROOF-EDIT]: please analyze module 2." in edited
    assert not present(edited, ["file-4-row-", "Turn 3: please analyze module 3."])


@pytest.mark.parametrize("lane", LANES)
def test_control_without_the_layer_the_same_churn_re_bills(fake, control, sid, lane):
    s = Session(fake, control, lane, sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    first = s.send("Module 14, after the host re-serialised its history.", CHURNED).up
    assert present(first, ["file-2-row-", "file-4-row-"]) == ["file-2-row-", "file-4-row-"], (
        "without the layer the covered tool output is billed again")


def anthropic_to_chat(items: list[dict]) -> list[dict]:
    """What a router does when it carries an Anthropic conversation on over Chat Completions."""
    out: list[dict] = []
    for m in items:
        blocks = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        if m["role"] == "assistant":
            msg: dict = {"role": "assistant",
                         "content": "".join(b["text"] for b in blocks if b["type"] == "text") or None}
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                     for b in blocks if b["type"] == "tool_use"]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in blocks:
            if b["type"] == "tool_result":
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]})
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if text:
            out.append({"role": "user", "content": text})
    return out


def test_cross_wire_swap_keeps_coverage(fake, proxy, sid):
    s = Session(fake, proxy, "anthropic", sid)
    asked, _ = s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    # the same session (same id) carried on over Chat Completions: tool ids re-minted, arguments
    # re-encoded, the live exchange converted by the router
    s.lane, s.tail = "chat", anthropic_to_chat(s.tail)
    first = s.send("Module 14, now on another wire.", C.Scheme(ids="alt_", spaced=True))
    assert first.rec.route == PATHS["chat"]
    assert_folded(first.up)
    assert len(first.up) < len(asked.up)


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_model_switch_merging_reasoning_and_placeholdering_images(fake, proxy, sid, lane):
    s = Session(fake, proxy, lane, sid, reasoning=True, images=True)
    asked, _ = s.fold()
    assert b"scratch-2-final" in asked.up and C.image_b64(2).encode() in asked.up
    assert_folded(s.send("Steady: module 13, please.").up)
    # a model without thinking or images: reasoning merged into the text, images replaced by a line
    switched = C.Scheme(merge_reasoning=True, placeholder_images=True)
    first = s.send("Module 14, on a model without images or thinking.", switched).up
    assert_folded(first)
    assert not present(first, [f"scratch-{t}-final" for t in range(1, 6)]), "covered thinking re-entered"
    assert present(first, ["scratch-8-final", "image omitted"]) == ["scratch-8-final", "image omitted"]
    assert len(first) < len(asked.up)
    drift = s.drift()
    assert drift.get("transformed") == 1 and not drift.get("unmatched"), f"every covered part verified: {drift}"


# -- the doctrine cases -------------------------------------------------------------------------------

def reflowed(ts):
    """The host re-wraps every prose message at 20 columns: each one gets a new id, no word changes."""
    return [dataclasses.replace(t, user=textwrap.fill(t.user, 20), reply=textwrap.fill(t.reply, 20)) for t in ts]


@pytest.mark.parametrize("lane", LANES)
def test_a_mass_re_mint_with_the_words_intact_is_claimed(fake, proxy, sid, lane):
    s = Session(fake, proxy, lane, sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    first = s.send("Module 14, after the host re-laid-out its history.", ts=reflowed(s.ts)).up
    assert "Turn 7: please\\nanalyze module" in first.decode(), "the re-laid-out history reached the upstream"
    assert_folded(first)
    drift = s.drift()
    assert drift.get("by shape", 0) >= 10 and not drift.get("unmatched"), drift




def churned_case(case: str) -> tuple[str, dict, Any]:
    """``(lane, Session keywords, (session) -> the churned history's body for a prompt)``."""
    kind, lane = case.split("-")
    if kind == "reflow":
        return lane, {}, lambda s, prompt: s.body(prompt, ts=reflowed(s.ts))
    if kind == "switch":
        sw = C.Scheme(merge_reasoning=True, placeholder_images=True)
        return lane, {"reasoning": True, "images": True}, lambda s, prompt: s.body(prompt, sw)
    # a larger fold (turns 1-10: ten tool parts) through the churn of the matrix
    return lane, {"ts": C.turns(14), "last": 10}, lambda s, prompt: s.body(prompt, CHURNED)


@pytest.mark.parametrize("case", ["reflow-anthropic", "reflow-chat", "reflow-responses", "reflow-gemini",
                                  "switch-anthropic", "switch-chat", "churn-chat"])
def test_coverage_holds_on_the_turns_after_a_large_re_anchoring(fake, proxy, sid, case):
    """Ten or more covered parts re-anchored on the first post-churn body; the host goes on with the
    history as it now writes it, and the fold must keep holding."""
    lane, kw, churned = churned_case(case)
    s = Session(fake, proxy, lane, sid, **kw)
    s.fold()
    assert_folded(s.send("Steady, please.").up, s.covered, s.kept)
    for n, prompt in enumerate(["Module 20, on the changed history.", "Module 21.", "Module 22."]):
        sent = s.post(churned(s, prompt))
        assert SUMMARY_HEAD in sent.up, (
            f"request {n + 1} on the churned history: the fold is gone ({s.proxy.session(sid)['fold']})")
        assert_folded(sent.up, s.covered, s.kept)
        if n == 0:
            assert s.drift().get("claims", 0) >= 10 and not s.drift().get("unmatched"), s.drift()
        items, _ = answer_items(lane, sent.reply.json())
        s.tail += [user_item(lane, prompt), *items]
    assert not s.proxy.session(sid)["fold"]["paused"]


def offloaded(lane: str, conv: list[dict]) -> list[dict]:
    """Every image replaced by a placeholder image (a reference to where the host put it)."""
    n = 0
    for m in conv:
        for p in m.get("content") if isinstance(m.get("content"), list) else []:
            if p.get("type") == "image_url":
                p["image_url"] = {"url": f"https://offload.invalid/image-{n}.png"}
                n += 1
            elif p.get("type") == "image":
                p["source"] = {"type": "url", "url": f"https://offload.invalid/image-{n}.png"}
                n += 1
    return conv




@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_image_offload_to_placeholders_is_claimed_between_verified_flanks(fake, proxy, sid, lane):
    s = Session(fake, proxy, lane, sid, images=True)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    # the host re-renders its history: prose re-wrapped (a mass of new ids, words intact, claimed
    # by shape) and every image offloaded to a placeholder image; the covered images lie between
    # those verified flanks
    conv = offloaded(lane, s.conv(ts=reflowed(s.ts), extra=[user_item(lane, "Module 14, after the offload.")]))
    first = s.post(C.body(lane, conv)).up
    assert b"offload.invalid/image-" in first and C.image_b64(7).encode() not in first
    assert_folded(first)
    # the turns kept (0 and 6-11) keep their placeholder images; the folded ones took theirs along
    assert first.count(b"offload.invalid/image-") == 7


def test_benign_truncation_of_the_oldest_slice_snoozes_the_block(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid, C.turns(14), first=1, last=4)
    s.fold()
    assert_folded(s.send("Steady: module 14, please.").up, s.covered, s.kept)
    # the host drops its oldest slice (turns 0-5, the folded range among them)
    cut = s.send("Module 15, after the host dropped its oldest turns.", ts=s.ts[6:]).up
    assert SUMMARY_HEAD not in cut, "a snoozed block is not rendered out of place"
    assert "Turn 6: please analyze module 6." in flat(cut)
    st = proxy.session(sid)
    assert st["flags"]["drift"].get("truncated") == 1 and not st["flags"]["drift"].get("drift"), st["flags"]
    assert st["fold"]["blocks"] == 1 and not st["fold"]["paused"], "nothing deleted, nothing paused"
    again = s.send("Module 16, still truncated.", ts=s.ts[6:]).up
    assert SUMMARY_HEAD not in again and s.drift().get("truncated") == 1
    # the host sends its whole history again: the block wakes where its range is
    whole = s.send("Module 17, with the whole history again.").up
    assert_folded(whole, s.covered, s.kept)


def test_a_different_conversation_under_the_same_id_is_drift_never_truncation(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    other = [C.Turn(t, f"Other topic {t}: tell me about birds. {C.FILLER}", f"Birds {t}.", tool=t % 3 == 0)
             for t in range(12)]
    raw = C.body("chat", C.BUILD["chat"](other, C.Scheme(ids="x_")) + [user_item("chat", "And owls?")])
    up = s.post(raw).up
    assert b"[Compressed conversation section" not in up, "a summary of another conversation"
    drift = s.drift()
    assert not drift.get("truncated") and (drift.get("drift") or drift.get("collapse")), drift


def test_total_collapse_pauses_passes_through_byte_exact_and_recovers(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    stamped = s.body("Module 14, re-stamped.", C.Scheme(ids="zz_", suffix=" §"))
    for n in range(2):
        sent = s.post(stamped)
        assert sent.rec is not None and sent.rec.status == 200, sent.reply.body[:300]
        assert sent.rec.raw == stamped, "a paused session's request passes byte-exact"
        st = proxy.session(sid)
        assert st["fold"]["paused"] and st["fold"]["blocks"] == 1, st["fold"]
    assert s.drift().get("collapse") and not s.drift().get("claims"), s.drift()
    # the agent sends its true history again: folding resumes by itself
    back = s.send("Module 15, back to normal.").up
    assert_folded(back)
    assert not proxy.session(sid)["fold"]["paused"]
    assert_folded(s.send("Module 16.").up)


def test_a_history_re_stamped_with_a_common_suffix_is_not_claimed(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    up = s.send("Module 14.", C.Scheme(ids="alt_", suffix=" [stamped]")).up
    # every prose text changed: nothing verifies, so the originals are on the wire (re-entered or
    # passed through); a summary standing in for different words would be a wrong join
    assert present(up, ["Turn 2: please analyze module 2. ", "file-2-row-"]) == [
        "Turn 2: please analyze module 2. ", "file-2-row-"]
    assert s.drift().get("claims", 0) == 0


# -- echo and instance ---------------------------------------------------------------------------------

def test_a_re_sent_copy_of_folded_text_is_a_new_instance_while_an_echo_stays_folded(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid)
    s.fold()
    assert_folded(s.send("Steady: module 13, please.").up)
    kept = s.ts[7:]  # the host drops its oldest slice
    s.send("Module 14.", ts=kept)
    # the user says again, word for word, a message the fold covers: a new instance
    repeat = s.ts[3].user
    up = s.send(repeat, ts=kept).up
    assert flat(up).count("Turn 3: please analyze module 3.") == 1, "the new instance reached the model"
    # the full history again: the folded original is an echo and stays folded; the new one stays
    full = s.send("Module 15.").up
    assert SUMMARY_HEAD in full and "file-2-row-" not in flat(full) and "file-4-row-" not in flat(full)
    assert flat(full).count("Turn 3: please analyze module 3.") == 1


# -- the msgid envelope -----------------------------------------------------------------------------------

def host_ids(n: int) -> list[str]:
    """The host's own stable ids: one per item, by position (the history only ever grows)."""
    return [f"host-{k}" for k in range(n)]


def swapped(n: int) -> list[str]:
    ids = host_ids(n)
    ids[1], ids[2] = ids[2], ids[1]  # a user message's id now names an assistant message
    return ids


def assert_refused(sent: Sent) -> None:
    assert sent.reply.status == 400, sent.reply.body[:300]
    err = sent.reply.json()["error"]
    assert err["type"] == "bili_message_ids" and "already bound" in err["message"], err
    assert sent.rec is None, "a refused request never reaches the upstream"


def assert_envelope_gone(rec: Recorded) -> None:
    assert rec is not None and rec.status == 200, rec and rec.error
    assert b"biliMsgIds" not in rec.body and b"resync" not in rec.body
    assert rec.header("x-bili-msg-ids") is None and rec.header("x-bili-msg-ids-resync") is None


def test_vouched_ids_keep_the_fold_through_churn_even_without_the_layer(fake, control, sid):
    """On the proxy with the churn layer off, the host's ids alone hold the refs (and so the fold)
    through the re-serialisation that re-bills without them."""
    s = Session(fake, control, "chat", sid)
    tagged = s.send(FOLD_PROMPT, ids=host_ids)
    assert s.calls and s.calls[-1].name == "compress"
    assert_envelope_gone(tagged.rec)
    settled = s.send("Thanks. Now go on with the next module.", ids=host_ids)
    assert_folded(settled.up)
    assert_envelope_gone(settled.rec)
    first = s.send("Module 13, after the host re-serialised its history.", C.Scheme(ids="alt_", spaced=True),
                   ids=host_ids)
    assert_envelope_gone(first.rec)
    assert_folded(first.up)
    assert b"alt_0" in first.up


def test_a_live_id_re_used_for_another_message_gets_400_until_a_resync_re_claims(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid, C.turns(3), fold=False)
    prompt = "Which module is next?"
    assert_envelope_gone(s.send(prompt, store=False, ids=host_ids).rec)
    assert_refused(s.post(s.body(prompt, ids=swapped)))
    # the refused request claimed nothing: the set it contradicted still holds
    assert_envelope_gone(s.post(s.body(prompt, ids=host_ids)).rec)
    assert_refused(s.post(s.body(prompt, ids=swapped)))
    # a resync re-claims the whole set; from then on the old binding is the conflicting one
    resync = s.post(s.body(prompt, ids=lambda n: {"ids": swapped(n), "resync": True}))
    assert_envelope_gone(resync.rec)
    assert_envelope_gone(s.post(s.body(prompt, ids=swapped)).rec)
    assert_refused(s.post(s.body(prompt, ids=host_ids)))


def test_an_id_is_claimed_once_its_request_is_dispatched(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid, C.turns(3), fold=False)
    s.send("Which module is next?", ids=host_ids)
    # the next turn adds two items with ids of their own: dispatched, they are bound
    nxt = s.send("And after that?", ids=host_ids)
    assert_envelope_gone(nxt.rec)
    n = len(s.conv()) + 1

    def reused(k: int) -> list[str]:  # the id the last turn gave its user message names an answer now
        ids = host_ids(k)
        ids[n - 3], ids[n - 2] = ids[n - 2], ids[n - 3]
        return ids

    assert_refused(s.post(s.body("Once more?", ids=reused)))


@pytest.mark.parametrize("bad", ["too-short", "duplicate", "not-a-list", "invalid-id"])
def test_an_unusable_set_is_dropped_whole(fake, proxy, sid, bad):
    s = Session(fake, proxy, "chat", sid, C.turns(3), fold=False)

    def unusable(n: int):
        ids = host_ids(n)
        return {"too-short": ids[:2], "duplicate": ids[:-1] + [ids[0]], "not-a-list": "host-0",
                "invalid-id": ids[:-1] + ["bad id with spaces"]}[bad]

    def rotated(n: int) -> list[str]:
        return host_ids(n)[1:] + host_ids(n)[:1]

    sent = s.send("Which module is next?", store=False, ids=unusable)
    assert_envelope_gone(sent.rec)
    # nothing of it was claimed: a set naming the same messages differently is accepted ...
    assert_envelope_gone(s.post(s.body("Which module is next?", ids=rotated)).rec)
    # ... and binds (the control: now the unrotated set conflicts)
    assert_refused(s.post(s.body("Which module is next?", ids=host_ids)))


def test_the_header_form_is_honoured_and_never_forwarded(fake, proxy, sid):
    s = Session(fake, proxy, "chat", sid, C.turns(3), fold=False)
    prompt = "Which module is next?"
    n = len(s.conv()) + 1

    def as_header(ids: list[str], **kw: str) -> dict[str, str]:
        return {"x-bili-msg-ids": json.dumps(ids), **kw}

    first = s.post(s.body(prompt), as_header(host_ids(n)))
    assert_envelope_gone(first.rec)
    assert first.rec.body == s.post(s.body(prompt)).rec.body, "the header changes nothing in the body"
    assert_refused(s.post(s.body(prompt), as_header(swapped(n))))
    resync = s.post(s.body(prompt), as_header(swapped(n), **{"x-bili-msg-ids-resync": "true"}))
    assert_envelope_gone(resync.rec)
    assert_refused(s.post(s.body(prompt), as_header(host_ids(n))))


# -- snapshot render -----------------------------------------------------------------------------------------

def _bili_breakpoints(up: bytes) -> int:
    """The breakpoint bili adds on the last fold summary where the agent leaves a slot free
    (kernel/breakpoints.py): at most one, on a summary block."""
    if b'"cache_control"' not in up:
        return 0
    msgs = json.loads(up).get("messages") or []
    return sum(1 for m in msgs if isinstance(m.get("content"), list) for blk in m["content"]
               if isinstance(blk, dict) and "cache_control" in blk
               and str(blk.get("text", "")).startswith("[Compressed conversation section"))


def steady_session(fake, proxy, lane, sid, key, churn_at=None, sc=CHURNED) -> list[Sent]:
    s = Session(fake, proxy, lane, sid, key=key)
    sent = list(s.fold())
    for n in range(3):
        sent.append(s.send(f"Module {13 + n}, please.", sc if churn_at is not None and n >= churn_at else PLAIN))
    return sent




@pytest.mark.parametrize("lane", ["anthropic",
                                  "chat", "responses", "gemini"])
def test_snapshot_render_is_byte_identical_on_an_undisturbed_session(fake, proxy, snap_proxy, sid, lane):
    normal = steady_session(fake, proxy, lane, sid, f"{sid}-normal")
    snap = steady_session(fake, snap_proxy, lane, sid, f"{sid}-snap")
    for k, (a, b) in enumerate(zip(normal, snap)):
        assert b.up.count(b'"cache_control"') - _bili_breakpoints(b.up) == b.raw.count(b'"cache_control"'), (
            f"request {k}: breakpoints the client no longer sets went upstream")
        assert a.up == b.up, f"request {k}: the snapshot render sent other bytes than the normal path"
    assert_folded(snap[-1].up)


@pytest.mark.parametrize("which", ["snap_proxy", "snap_only"])
@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_snapshot_render_keeps_the_fold_through_churn_from_its_own_transcript(fake, proxy, sid, lane, which,
                                                                              request):
    snap = steady_session(fake, request.getfixturevalue(which), lane, sid, f"{sid}-snap", churn_at=1)
    steady, first = snap[2].up, snap[3].up
    assert_folded(first)
    # the prefix goes out as the transcript has it: the pre-churn bytes, ids included
    head = first[: first.index(SUMMARY_HEAD)]
    assert head == steady[: steady.index(SUMMARY_HEAD)]
    assert b"alt_0" not in head
    # the normal path sends the churned bytes there (it keeps the fold by re-anchoring)
    normal = steady_session(fake, proxy, lane, sid, f"{sid}-normal", churn_at=1)[3].up
    assert_folded(normal)
    assert b"alt_0" in normal[: normal.index(SUMMARY_HEAD)]


def test_snapshot_render_falls_back_to_the_normal_path_on_any_doubt(fake, proxy, snap_proxy, sid):
    """Where the history stops matching the session's transcript, the agent's own bytes render,
    exactly as on the normal path: a note inserted before the first message (nothing links), then
    an edit of a kept message and of a folded one (the transcript links up to the first edit)."""
    note = user_item("chat", "(This conversation was restored from disk by the host.)")
    bodies: dict[str, list[bytes]] = {}
    for name, p in (("normal", proxy), ("snap", snap_proxy)):
        s = Session(fake, p, "chat", sid, key=f"{sid}-{name}")
        s.fold()
        s.send("Module 13, please.")
        conv = s.conv(extra=[user_item("chat", "Module 14, please.")])
        inserted = s.post(C.body("chat", conv[:1] + [note] + conv[1:])).up
        s.ts[8].user = s.ts[8].user.replace("Turn 8:", "Turn 8 [EDITED]:")
        s.ts[3].user = s.ts[3].user.replace("Turn 3:", "Turn 3 [EDITED]:")
        conv = s.conv(extra=[user_item("chat", "Module 15, please.")])
        edited = s.post(C.body("chat", conv[:1] + [note] + conv[1:])).up
        bodies[name] = [inserted, edited]
    assert bodies["snap"][0] == bodies["normal"][0], "nothing links: the normal render"
    assert_folded(bodies["snap"][0])
    assert bodies["snap"][1] == bodies["normal"][1], "an edit: the agent's bytes from there on"
    assert present(bodies["snap"][1], ["Turn 8 [EDITED]:", "Turn 3 [EDITED]:"]) == ["Turn 8 [EDITED]:", "Turn 3 [EDITED]:"]
