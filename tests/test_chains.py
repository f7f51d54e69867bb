"""Server-side chains (kernel/chains.py): the transcript of ``previous_response_id`` sessions, the
delta-or-full decision, and its way through the addon's hooks."""

from __future__ import annotations

import json
import re

import pytest
from mitmproxy.test import tflow, tutils

from bili_addon.kernel import tags
from bili_addon.kernel.chains import Chains

MODEL = "gpt-fake-1"


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said(rid: str, text: str) -> dict:
    return {"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call(rid: str, cid: str) -> dict:
    return {"type": "function_call", "id": f"fc_{rid}", "call_id": cid, "name": "Bash",
            "arguments": '{"command":"ls"}', "status": "completed"}


def result(cid: str, out: str) -> dict:
    return {"type": "function_call_output", "call_id": cid, "output": out}


def req(items, prev: str | None = None, **top) -> bytes:
    body = {"model": MODEL, "input": items, **top}
    if prev:
        body["previous_response_id"] = prev
    return enc(body)  # compact, as the tests' stand-ins for the pass re-encode


def answer(rid: str, output: list) -> dict:
    return {"id": rid, "object": "response", "status": "completed", "output": output}


def enc(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def items_of(body: bytes) -> list:
    return json.loads(body)["input"]


def turn(chains: Chains, raw: bytes, rid: str, output: list, conn: str = "", rendered=None, session="s1"):
    """One turn through the transcript: begin, the pass's output, the answer, record."""
    t = chains.begin(raw, conn)
    out = t.outgoing(rendered(t.body) if rendered else None)
    t.observe(answer(rid, output))
    t.session = session
    assert chains.record(t)
    return t, out


@pytest.fixture
def chains(backend):
    c = Chains(backend())
    c.make_store = backend
    return c


def test_a_delta_on_a_known_chain_is_rebuilt_and_goes_up_as_the_agent_sent_it(chains):
    t1, out1 = turn(chains, req([user("task")], store=True), "r1", [said("r1", "looking"), call("r1", "c1")])
    assert t1.mode == "full" and out1 is None
    raw2 = req([result("c1", "file.txt")], "r1", store=True)
    t2 = chains.begin(raw2)
    assert t2.known and t2.prev == "r1"
    full = json.loads(t2.body)
    assert "previous_response_id" not in full and full["store"] is True
    assert full["input"] == [user("task"), said("r1", "looking"), call("r1", "c1"), result("c1", "file.txt")]
    assert t2.outgoing(None) is None, "nothing changed: the agent's own bytes go up"
    assert t2.mode == "delta" and t2.sent_prev == "r1"


def test_a_changed_history_goes_up_whole_without_previous_response_id(chains):
    turn(chains, req([user("task")]), "r1", [said("r1", "looking"), call("r1", "c1")])
    raw2 = req([result("c1", "file.txt")], "r1")
    t2 = chains.begin(raw2)

    def fold(body: bytes) -> bytes:  # the pass replaced the first item (a fold's summary)
        b = json.loads(body)
        b["input"][0] = user("[Compressed conversation section b1]")
        return enc(b)

    out = t2.outgoing(fold(t2.body))
    assert t2.mode == "full" and t2.sent_prev == ""
    sent = json.loads(out)
    assert "previous_response_id" not in sent
    assert sent["input"][0] == user("[Compressed conversation section b1]") and len(sent["input"]) == 4
    t2.observe(answer("r2", [said("r2", "done")]))
    t2.session = "s1"
    assert chains.record(t2)
    # the next delta chains onto the new response: the provider's chain now holds the folded input
    raw3 = req([user("next")], "r2")
    t3 = chains.begin(raw3)
    assert json.loads(t3.body)["input"][0] == user("task"), "the pass gets the agent's own history"
    assert t3.outgoing(fold(t3.body)) is None and t3.mode == "delta", "the fold holds: the agent's delta goes up"
    assert t3.sent_prev == "r2"


def test_the_pass_own_tag_on_a_provider_output_keeps_the_delta(chains):
    turn(chains, req([user("task")]), "r1", [said("r1", "looking")])
    raw2 = req([user("more")], "r1")
    t2 = chains.begin(raw2)

    def tag_all(body: bytes) -> bytes:
        b = json.loads(body)
        for it in b["input"]:
            for p in it.get("content", []):
                p["text"] = tags.render("m00001", 3, "text", p["text"])
        return enc(b)

    # the agent's own item (sent before) tagged anew: changed history
    assert chains.begin(raw2).outgoing(tag_all(chains.begin(raw2).body)) is not None
    t = chains.begin(raw2)
    t.outgoing(tag_all(t.body))
    assert t.mode == "full"
    # only the provider's output and the new item tagged: the chain still holds the same content
    def tag_output(body: bytes) -> bytes:
        b = json.loads(body)
        for it in b["input"][1:]:
            for p in it["content"]:
                p["text"] = tags.render("m00002", 3, "text", p["text"])
        return enc(b)

    out = t2.outgoing(tag_output(t2.body))
    assert t2.mode == "delta"
    sent = json.loads(out)
    assert sent["previous_response_id"] == "r1"
    assert [p["text"] for it in sent["input"] for p in it["content"]] == [tags.render("m00002", 3, "text", "more")]


def test_an_unknown_chain_passes_through(chains):
    raw = req([user("hi")], "resp_before_bili")
    t = chains.begin(raw)
    assert not t.known and t.body == raw
    assert t.outgoing(None) is None and t.mode == "passthrough"
    t.observe(answer("r9", [said("r9", "x")]))
    assert not chains.record(t), "a response on an unknown chain cannot be rebuilt either"
    assert not chains.begin(req([user("again")], "r9")).known


def test_the_transcript_survives_a_restart(chains):
    turn(chains, req([user("task")]), "r1", [said("r1", "a"), call("r1", "c1")])
    turn(chains, req([result("c1", "out")], "r1"), "r2", [said("r2", "b")])
    t3 = chains.begin(req([user("three")], "r2"))
    again = Chains(chains.make_store())  # another process over the same store
    t3b = again.begin(req([user("three")], "r2"))
    assert t3b.known and t3b.body == t3.body
    assert t3b.outgoing(None) is None and t3b.mode == "delta"


def test_store_false_chains_only_on_their_connection_and_its_newest_response(chains):
    turn(chains, req([user("task")], store=False), "r1", [said("r1", "a")], conn="ws1")
    t = chains.begin(req([user("b")], "r1", store=False), "ws1")
    assert t.known and t.chainable
    t.outgoing(None)
    assert t.mode == "delta"
    # another connection: the provider does not have r1 there
    t = chains.begin(req([user("b")], "r1", store=False), "ws2")
    assert t.known and not t.chainable
    assert t.outgoing(None) is not None and t.mode == "full"
    assert "previous_response_id" not in json.loads(t.outgoing(None))
    # the output goes back in without its provider id (nothing is stored upstream)
    assert json.loads(t.body)["input"][1] == {k: v for k, v in said("r1", "a").items() if k != "id"}
    # a newer response on ws1: r1 is no longer the connection's newest
    turn(chains, req([user("b")], "r1", store=False), "r2", [said("r2", "c")], conn="ws1")
    stale = chains.begin(req([user("c")], "r1", store=False), "ws1")
    stale.outgoing(None)
    assert stale.mode == "full"
    # over HTTP a store: false response cannot be chained on at all: nothing is kept for it
    t = chains.begin(req([user("x")], store=False))
    t.outgoing(None)
    t.observe(answer("r3", [said("r3", "y")]))
    assert not chains.record(t)


def test_observe_mode_forwards_the_agent_s_bytes_even_where_fold_mode_would_send_everything(chains):
    turn(chains, req([user("task")], store=False), "r1", [said("r1", "a")], conn="ws1")
    raw = req([user("b")], "r1", store=False)
    t = chains.begin(raw, "ws2")  # not chainable from here: fold mode would send the whole input
    assert t.outgoing(t.body, rewrite=False) is None and t.mode == "observed"
    t.observe(answer("r2", [said("r2", "c")]))
    t.session = "s1"
    assert chains.record(t)
    assert [json.loads(x) for x in chains.views("r2").sent][-2:] == [user("b"), {k: v for k, v in said("r2", "c").items() if k != "id"}]


def test_full_history_agents_are_stored_as_deltas_of_their_last_turn(chains):
    """An agent that re-sends everything (store defaults to true): each row keeps only what is new."""
    h = [user("task")]
    turn(chains, req(h), "r1", [said("r1", "a")])
    h += [said("r1", "a"), user("two")]
    turn(chains, req(h), "r2", [said("r2", "b")])
    row = chains.store.chain("r2")
    cols = dict(zip(("id", "session_id", "conn", "stored", "agent_base", "agent_keep", "agent"), row))
    assert cols["agent_base"] == "r1" and cols["agent_keep"] == 2
    assert json.loads(cols["agent"]) == [user("two")]
    # and it rebuilds, also in another process
    again = Chains(chains.make_store())
    assert [json.loads(x) for x in again.views("r2").agent] == h + [said("r2", "b")]


def test_a_failed_or_unfinished_answer_is_not_recorded(chains):
    t = chains.begin(req([user("task")]))
    t.outgoing(None)
    t.observe({"type": "response.created", "response": {"id": "r1"}})
    assert not chains.record(t), "no final event yet"
    t.observe({"type": "response.failed", "response": {"id": "r1", "status": "failed"}})
    assert not chains.record(t)
    t = chains.begin(req([user("task")], background=True))
    t.outgoing(None)
    t.observe({"id": "r2", "object": "response", "status": "queued", "output": []})
    assert not chains.record(t), "a background answer still to come holds nothing yet"


def test_streamed_events_give_the_output_even_when_the_final_event_carries_none(chains):
    t = chains.begin(req([user("task")]))
    t.outgoing(None)
    t.observe({"type": "response.created", "response": {"id": "r1", "output": []}})
    t.observe({"type": "response.output_item.done", "output_index": 1, "item": call("r1", "c1")})
    t.observe({"type": "response.output_item.done", "output_index": 0, "item": said("r1", "a")})
    t.observe({"type": "response.completed", "response": {"id": "r1", "status": "completed", "output": []}})
    t.session = "s"
    assert chains.record(t)
    assert [json.loads(x) for x in chains.views("r1").agent] == [user("task"), said("r1", "a"), call("r1", "c1")]


def test_a_string_input_is_one_user_message(chains):
    turn(chains, req("hello"), "r1", [said("r1", "hi")])
    t = chains.begin(req("again", "r1"))
    assert [it["role"] for it in json.loads(t.body)["input"]] == ["user", "assistant", "user"]


# -- through the addon's hooks --------------------------------------------------------------------


def flow_for(raw: bytes):
    f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/responses", host="api.openai.com", port=443,
                                    scheme=b"https", content=raw,
                                    headers=((b"content-type", b"application/json"), (b"session_id", b"chain-1"))))
    return f


def answered(bili, f, rid: str, output: list) -> None:
    f.response = tutils.tresp(status_code=200, content=enc(answer(rid, output)),
                              headers=((b"content-type", b"application/json"),))
    bili.responseheaders(f)
    bili.response(f)


TOOLS = [{"type": "function", "name": "Bash", "description": "Run.", "parameters": {"type": "object"}}]


def test_the_addon_chains_deltas_and_keeps_the_agent_s_ids(bili):
    f1 = flow_for(req([user("task")], store=True, tools=TOOLS))
    bili.request(f1)
    sent1 = json.loads(f1.request.content)
    assert "compress" in [t["name"] for t in sent1["tools"]]
    answered(bili, f1, "r1", [said("r1", "looking"), call("r1", "c1")])
    raw2 = req([result("c1", "file.txt")], "r1", store=True, tools=TOOLS)
    f2 = flow_for(raw2)
    bili.request(f2)
    sent2 = json.loads(f2.request.content)
    assert sent2["previous_response_id"] == "r1", "nothing changed in the sent history: the delta goes up"
    assert sent2["input"] == [result("c1", "file.txt")]
    assert sent2["tools"] == sent1["tools"]
    answered(bili, f2, "r2", [said("r2", "done")])
    assert json.loads(f2.response.content)["id"] == "r2", "the agent sees the provider's id"
    # a delta on a chain bili never saw: forwarded as it came
    raw3 = req([user("hi")], "resp_elsewhere", store=True, tools=TOOLS)
    f3 = flow_for(raw3)
    bili.request(f3)
    assert f3.request.content == raw3


# -- omp's built-in OpenAI transport, as captured (store: true, turn 2 = previous_response_id + output) ---

from pathlib import Path  # noqa: E402

from mitmproxy import io  # noqa: E402
from wirecases import CAPTURES  # noqa: E402

OMP_FWD = Path(CAPTURES) / "omp" / "omp_fwd" / "flows.mitm"


def replay(bili, recorded):
    """One recorded flow through the addon's hooks: its request, then its answer as it streamed."""
    f = tflow.tflow(req=recorded.request.copy())
    bili.request(f)
    f.response = recorded.response.copy()
    content = f.response.content
    bili.responseheaders(f)
    if f.response.stream:
        out = b"".join(b"".join(f.response.stream(content[i:i + 97])) for i in range(0, len(content), 97))
        f.response.content = out + b"".join(f.response.stream(b""))
        f.response.stream = False
    bili.response(f)
    return f


@pytest.mark.skipif(not OMP_FWD.is_file(), reason=f"no captured omp flows at {OMP_FWD} (set $BILI_CAPTURES)")
def test_omp_s_captured_chain_is_rebuilt_and_its_delta_forwarded(bili):
    with OMP_FWD.open("rb") as fh:
        flows = [fl for fl in io.FlowReader(fh).stream() if fl.request.path.endswith("/responses")]
    first, second = flows
    agent_delta = json.loads(second.request.content)
    assert agent_delta["previous_response_id"] and agent_delta["store"] is True
    replay(bili, first)
    f2 = replay(bili, second)
    sent = json.loads(f2.request.content)
    assert sent["previous_response_id"] == agent_delta["previous_response_id"], "the delta goes up on the chain"
    assert sent["input"] == agent_delta["input"]
    assert "compress" in [t["name"] for t in sent["tools"]]
    # the pass saw the whole conversation: turn 1's input, its answer (reasoning, call) and the output
    views = bili.engine.chains.views(agent_delta["previous_response_id"])
    kinds = [json.loads(x).get("type", "message") for x in views.agent]
    first_input = json.loads(first.request.content)["input"]
    assert kinds == [it.get("type", "message") for it in first_input] + ["reasoning", "function_call"]
    s = bili.engine.sessions.get(agent_delta["prompt_cache_key"])
    assert s is not None and not s.flags.get("delta_history"), "the history is visible: nothing to warn about"
    # the second answer chains on too
    second_id = re.findall(rb'"id": ?"(resp_[^"]+)"', second.response.content)[-1].decode()
    assert second_id != agent_delta["previous_response_id"] and bili.engine.chains.views(second_id) is not None


def test_a_schema_3_store_gets_the_chains_table_on_open(backend):
    """A store of the bili before server-side chains (schema 3) gets the chains table when opened."""
    from bili_addon.store import SCHEMA_VERSION

    s = backend()
    raw = s.db.execute if s.backend == "sqlite" else s._q
    raw("DROP TABLE chains")
    raw("UPDATE meta SET value='3' WHERE key='schema_version'")
    s.close()
    c = Chains(backend())
    assert c.store.schema_version() == SCHEMA_VERSION
    turn(c, req([user("task")]), "r1", [said("r1", "a")])
    assert Chains(backend()).begin(req([user("b")], "r1")).known


def test_before_activation_a_chained_delta_goes_up_byte_for_byte(bili):
    bili.tctx.configure(bili, bili_activate="lazy")
    f1 = flow_for(req([user("task")], store=True, tools=TOOLS))
    raw1 = f1.request.content
    bili.request(f1)
    assert f1.request.content == raw1
    answered(bili, f1, "r1", [said("r1", "looking"), call("r1", "c1")])
    raw2 = json.dumps({"model": MODEL, "previous_response_id": "r1", "input": [result("c1", "x")],
                       "store": True, "tools": TOOLS}, indent=1).encode()  # the agent's own spacing
    f2 = flow_for(raw2)
    bili.request(f2)
    assert f2.request.content == raw2
    answered(bili, f2, "r2", [said("r2", "done")])
    v = bili.engine.chains.views("r2")
    assert len(v.agent) == 5 and v.agent == v.sent, "what the provider holds is what the agent thinks"


def test_activation_resends_the_history_once_then_deltas_again(bili):
    """Lazy activation tags the history bili already sent untagged: that turn goes up whole, the
    next ones are deltas on the response to it."""
    bili.tctx.configure(bili, bili_activate="lazy", bili_remind_at=300)
    f = flow_for(req([user("task: read every module")], store=True, tools=TOOLS))
    bili.request(f)
    answered(bili, f, "r1", [said("r1", "reading 1"), call("r1", "c1")])
    modes = []
    for n in range(2, 12):
        out = "\n".join(f"module {n} line {i}: some content here" for i in range(40))
        f = flow_for(req([result(f"c{n - 1}", out)], f"r{n - 1}", store=True, tools=TOOLS))
        bili.request(f)
        sent = json.loads(f.request.content)
        modes.append("delta" if "previous_response_id" in sent else "full")
        active = "compress" in [t["name"] for t in sent["tools"]]
        assert active == ("full" in modes), "the whole history goes up exactly when bili shows itself"
        answered(bili, f, f"r{n}", [said(f"r{n}", f"reading {n}"), call(f"r{n}", f"c{n}")])
    assert "full" in modes, modes
    first = modes.index("full")
    assert modes[:first] == ["delta"] * first and first > 0, modes
    assert modes[first + 1:] == ["delta"] * (len(modes) - first - 1), modes


def test_a_delta_without_input_stays_one(chains):
    turn(chains, req([user("task")]), "r1", [said("r1", "a")])
    raw = enc({"model": MODEL, "previous_response_id": "r1", "tools": []})
    t = chains.begin(raw)
    assert len(items_of(t.body)) == 2
    b = json.loads(t.body)
    b["tools"] = TOOLS  # the pass added something at the top
    sent = json.loads(t.outgoing(enc(b)))
    assert t.mode == "delta" and sent["input"] == [] and sent["previous_response_id"] == "r1"


def test_a_response_id_given_twice_is_never_rebuilt_with_the_other_conversation_s_content(chains):
    """A server that numbers its responses (a local one restarted, a test double) gives the same id to
    two conversations.  The transcript must not rebuild one conversation's delta with the other's
    history (in this process or after a restart, on either backend): the id becomes unknown, and a
    delta on it passes through observed (a cold cache at worst, never the wrong content)."""
    turn(chains, req([user("first conversation: the secret plan")], store=True), "resp_1",
         [said("resp_1", "noted")], session="conv-a")
    t = chains.begin(req([user("second conversation: the weather")], store=True))
    t.outgoing(None)
    t.observe(answer("resp_1", [said("resp_1", "sunny")]))
    t.session = "conv-b"
    assert not chains.record(t)  # not kept: the id names two conversations now
    for c in (chains, Chains(chains.make_store())):  # this process, and one started afresh
        t = c.begin(req([user("and then?")], "resp_1", store=True))
        assert t is not None
        assert b"secret plan" not in t.body and b"the weather" not in t.body
        assert not t.known


def test_full_history_rows_stay_deltas_with_more_live_sessions_than_the_cache_and_after_a_restart(chains):
    """The row of a full-history turn is its session's previous response plus what is new, however
    many sessions run at once (more than the rebuilt-views cache holds): never the whole conversation
    again (the table would grow with the square of each session's length).  After a restart, one
    whole row per session, then deltas again."""
    from bili_addon.kernel.chains import CACHE

    sessions = [f"s{i}" for i in range(CACHE + 3)]
    hist = {s: [user(f"task of {s} " + "x" * 200)] for s in sessions}
    for n in range(4):
        if n == 2:  # a restart: the transcript is read back from the store
            chains = Chains(chains.make_store())
        for s in sessions:  # round robin: each session's last response has left the cache meanwhile
            rid = f"{s}-r{n}"
            turn(chains, req(hist[s]), rid, [said(rid, f"answer {n}")], session=s)
            hist[s] = hist[s] + [said(rid, f"answer {n}"), user(f"next {n}")]
            if n in (1, 3):
                row = dict(zip(("id", "session_id", "conn", "stored", "agent_base", "agent_keep", "agent"),
                               chains.store.chain(rid)))
                assert row["agent_base"] == f"{s}-r{n - 1}", (n, s)
                assert b"x" * 200 not in row["agent"]  # the first message is not stored again


def test_a_chain_is_rebuilt_only_for_the_host_and_credential_that_made_it(chains):
    """A team's instances share one transcript: a response id learned from someone else's traffic
    rebuilds nothing of theirs (the provider scopes ids to the credential, so does bili)."""
    from bili_addon.kernel.chains import owner_of

    alice = owner_of("api.openai.com", {"authorization": "Bearer sk-alice"})
    bob = owner_of("api.openai.com", {"authorization": "Bearer sk-bob"})
    elsewhere = owner_of("llm.corp.example", {"authorization": "Bearer sk-alice"})
    assert len({alice, bob, elsewhere}) == 3 and "sk-alice" not in alice
    assert owner_of("API.openai.com", {"authorization": "Bearer sk-alice"}) == alice
    t = chains.begin(req([user("alice's secret plan")]), "", alice)
    t.outgoing(None)
    t.observe(answer("r1", [said("r1", "noted")]))
    t.session = "s-alice"
    assert chains.record(t)
    for who in (bob, elsewhere):
        stolen = req([user("what did we say?")], "r1")
        t = Chains(chains.make_store()).begin(stolen, "", who)
        assert not t.known and t.body == stolen, "another owner's delta passes through as sent"
        assert b"secret plan" not in t.body
    again = Chains(chains.make_store()).begin(req([user("go on")], "r1"), "", alice)
    assert again.known and b"secret plan" in again.body
    # a store: false chain on its own WebSocket connection belongs to that connection
    t = chains.begin(req([user("ws task")], store=False), "ws1", alice)
    t.outgoing(None)
    t.observe(answer("r2", [said("r2", "ok")]))
    t.session = "s-ws"
    assert chains.record(t)
    assert chains.begin(req([user("next")], "r2", store=False), "ws1", bob).known


def test_an_id_another_process_writes_meanwhile_is_never_overwritten(chains, monkeypatch):
    """Two instances record one response id for two conversations at the same moment (a server
    that numbers its responses): whichever writes second sees the first row and leaves a tombstone,
    so neither conversation is ever rebuilt into the other's delta."""
    other = Chains(chains.make_store())  # a second instance over the same store
    t_a = chains.begin(req([user("alice's plan")]))
    t_a.outgoing(None)
    t_a.observe(answer("r1", [said("r1", "a")]))
    t_a.session = "sa"
    t_b = other.begin(req([user("bob's plan")]))
    t_b.outgoing(None)
    t_b.observe(answer("r1", [said("r1", "b")]))
    t_b.session = "sb"
    real, looked = other._link, []

    def racing(rid):  # the first instance writes between the second's check and its write
        looked.append(rid)
        if len(looked) == 1:
            assert chains.record(t_a)
            return None
        return real(rid)

    monkeypatch.setattr(other, "_link", racing)
    assert not other.record(t_b)
    for text in ("alice's plan", "bob's plan"):
        t = Chains(chains.make_store()).begin(req([user("go on")], "r1"))
        assert not t.known and text.encode() not in t.body


def test_another_owners_chain_is_never_rebuilt_from_memory_when_its_row_is_not_read(backend):
    """The owner was checked on the chain's row only: when that read failed (a connection reset, a
    locked file) or another instance's retention had removed it, the views kept in memory rebuilt
    the first owner's conversation for another credential's request, and sent it up whole."""
    from bili_addon.kernel.chains import owner_of

    chains = Chains(backend())
    alice = owner_of("api.openai.com", {"authorization": "Bearer sk-alice"})
    bob = owner_of("api.openai.com", {"authorization": "Bearer sk-bob"})
    t = chains.begin(req([user("alice's secret plan")]), "", alice)
    t.outgoing(None)
    t.observe(answer("r1", [said("r1", "noted")]))
    t.session = "s-alice"
    assert chains.record(t)
    real = chains.store.chain

    def unreadable(rid):
        raise RuntimeError("server closed the connection unexpectedly")

    chains.store.chain = unreadable
    try:
        t = chains.begin(req([user("what did we say?")], "r1"), "", bob)
        mine = chains.begin(req([user("and now?")], "r1"), "", alice)
    finally:
        chains.store.chain = real
    out = t.outgoing(None)
    assert not t.known and b"secret plan" not in (out or t.raw)
    assert mine.known  # (its own owner: rebuilt from memory as before)


def test_a_request_on_a_server_side_conversation_passes_through_observed(bili):
    """The Conversations API (``conversation``): the server appends each request's input items to a
    conversation it keeps, so the body holds only the new ones.  bili took it for a whole
    conversation and sent its own developer message and tags with every turn, each appended to
    the server's conversation again."""
    for n, text in enumerate(["task: list the files", "now count them", "and sort them"]):
        raw = req([user(text)], store=True, tools=TOOLS, conversation="conv_abc")
        f = flow_for(raw)
        bili.request(f)
        assert f.request.content == raw  # the agent's bytes, as it sent them
        answered(bili, f, f"r{n}", [said(f"r{n}", f"ok {n}")])
