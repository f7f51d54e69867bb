"""Server-side chains end to end: an agent on the official ``openai`` SDK that chains its turns on
the provider (``store: true`` + ``previous_response_id``, only the new items each turn, as omp's
built-in OpenAI transport does), through a real ``mitmdump --mode reverse`` with the bili addon.

The fake upstream keeps chains the way OpenAI does (``fake_upstream.ProviderChains``): it refuses a
``previous_response_id`` it did not issue with 400, and the scripted model sees the whole chain.
The session reads modules with ``Bash``; a reminder offers the old work; the model folds it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .fake_upstream import proxy_call, say, tool
from .support import AGENT_SYSTEM, Answer, ResponsesAgent, request, responses_answer, strip_tags
from .test_fold_e2e import REMIND_AT, fold_what_was_offered, reminders_in, run_bash, summary_head

pytestmark = pytest.mark.e2e

TASK = "Please audit this repository module by module and report anything suspicious."


class ChainedAgent(ResponsesAgent):
    """Sends its whole history once, then only what is new since the answer it chains on."""

    def __init__(self, *a: Any, **kw: Any):
        self.prev: str | None = None
        self.upto = 0  # how much of the history the provider's chain holds
        self.ids: dict[int, str] = {}  # turn -> the response id the agent was given
        self.deltas: dict[int, list] = {}
        self._turn = 0
        super().__init__(*a, **kw)

    def step(self, turn: int, run_tool: Any) -> Answer:
        self._turn = turn
        return super().step(turn, run_tool)

    def send(self, history: list[Any], headers: dict[str, str]) -> Answer:
        delta = history[self.upto:] if self.prev else history
        self.deltas[self._turn] = delta
        args: dict[str, Any] = dict(model=self.model, instructions=AGENT_SYSTEM, input=delta, tools=self.tools,
                                    store=True, extra_headers={"session_id": self.sid, **headers})
        if self.prev:
            args["previous_response_id"] = self.prev
        text, output, rid = "", [], ""
        for ev in self.client.responses.create(stream=True, **args):
            if ev.type == "response.output_text.delta":
                text += ev.delta
            elif ev.type == "response.completed":
                output, rid = ev.response.output, ev.response.id
        answer = responses_answer(text, output)
        self.prev, self.ids[self._turn] = rid, rid
        self.upto = len(history) + len(answer.items)
        return answer


def reading(t: int):
    return tool("Bash", {"command": f"cat src/mod{t}.py"}, prose=f"Turn {t}: reading module {t}.")


class Upstream:
    def __init__(self, fake, script: str):
        self.fake, self.script = fake, script

    def __getitem__(self, turn: int):
        recs = self.fake.find(lambda r: r.header("x-fake-script") == self.script and r.header("x-fake-turn") == str(turn))
        assert recs, f"turn {turn} never reached the upstream"
        rec = recs[-1]
        assert rec.status == 200, f"turn {turn}: refused: {rec.error or rec.response[:300]!r}"
        return rec


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold", bili_remind_at=str(REMIND_AT))


FOLD_TURN = 8  # the model calls compress; the fold lands on the next request


def test_a_chained_session_folds_and_sends_deltas_otherwise(fake, proxy, sid):
    acts = [reading(t) for t in range(1, FOLD_TURN)]
    acts.append(proxy_call("compress", fold_what_was_offered, prose=f"Turn {FOLD_TURN}: folding what was offered."))
    acts += [reading(t) for t in range(FOLD_TURN + 1, 12)] + [say("Turn 12: the audit is complete.")]
    fake.script(sid, acts, real_usage=True)
    agent = ChainedAgent(proxy.url, sid, sid, TASK)
    up = Upstream(fake, sid)
    issued: list[str] = []  # the response ids the upstream gave, in order

    def check(t: int, *, full: bool) -> Any:
        rec = up[t]
        body = rec.json
        if full:
            assert "previous_response_id" not in body, f"turn {t}: the whole input should go up"
        else:
            assert body.get("previous_response_id") == agent.ids[t - 1], f"turn {t}: the agent's delta should go up"
            # the agent's new items, as it sent them (bili's tags and reminders aside)
            sent = strip_tags(body["input"])[0]
            assert [it for it in sent if "[bili] ~" not in json.dumps(it)] == agent.deltas[t]
        # bili only chains on what came back, and the agent is given the provider's own ids
        assert body.get("previous_response_id") in (None, *issued)
        assert agent.ids[t] == rec.response_id
        issued.append(rec.response_id)
        return rec

    # -- turns 1..8: the first request is whole; later ones are the agent's deltas on the chain
    agent.step(1, run_bash)
    check(1, full=True)
    for t in range(2, FOLD_TURN + 1):
        agent.step(t, run_bash)
        check(t, full=False)
    reminded = [t for t in range(1, FOLD_TURN + 1) if reminders_in(up[t].conversation)]
    assert reminded, "the reminder reached the model through the chain"
    assert agent.answers[FOLD_TURN].call.name == "compress"
    before = json.dumps(up[FOLD_TURN].conversation)
    assert "file-1-row-" in before and "file-6-row-" in before

    # -- turn 9: the fold lands: the whole folded input goes up, without previous_response_id
    agent.step(FOLD_TURN + 1, run_bash)
    rec = check(FOLD_TURN + 1, full=True)
    text = rec.body.decode()
    assert summary_head("b1") in text and "file-1-row-" not in text
    result = [it for it in rec.json["input"] if it.get("type") == "function_call_output"
              and it["call_id"] == agent.answers[FOLD_TURN].call.id]
    assert result and result[0]["output"].startswith("Compressed m"), result

    # -- turn 10: the agent chains on the response to the folded input; the model's view stays folded
    agent.step(FOLD_TURN + 2, run_bash)
    rec10 = check(FOLD_TURN + 2, full=False)
    seen = json.dumps(rec10.conversation, ensure_ascii=False)
    assert summary_head("b1") in seen and "file-1-row-" not in seen and "file-9-row-" in seen

    # -- a restart of the proxy: the transcript comes from the store, the chain goes on as deltas
    proxy.restart()
    agent.connect()
    agent.step(FOLD_TURN + 3, run_bash)
    rec11 = check(FOLD_TURN + 3, full=False)
    seen = json.dumps(rec11.conversation, ensure_ascii=False)
    assert summary_head("b1") in seen and "file-1-row-" not in seen and "file-10-row-" in seen
    agent.step(FOLD_TURN + 4, run_bash)
    check(FOLD_TURN + 4, full=False)
    assert agent.answers[FOLD_TURN + 4].text == "Turn 12: the audit is complete."
    # the upstream refused nothing: every previous_response_id it was sent, it had issued
    assert all(r.status == 200 for r in fake.find(lambda r: r.header("x-fake-script") == sid))
    assert set(fake.chains.seen_prev) >= {agent.ids[t] for t in range(1, FOLD_TURN)}


def test_a_chain_bili_never_saw_passes_through_until_the_agent_sends_everything(fake, proxy, sid):
    """The chain began before bili: its deltas go up as they came, observed; folding resumes with
    the agent's next whole history."""
    fake.script(sid, [reading(1), reading(2), reading(3), say("done")])
    direct = ChainedAgent(fake.url, sid, sid, TASK)  # turn 1 straight to the provider
    direct.step(1, run_bash)
    agent = ChainedAgent(proxy.url, sid, sid, TASK)
    agent.history, agent.prev, agent.upto, agent.ids = direct.history, direct.prev, direct.upto, dict(direct.ids)
    agent.step(2, run_bash)
    up = Upstream(fake, sid)
    body = up[2].json
    assert body["previous_response_id"] == direct.ids[1]
    assert body["input"] == agent.deltas[2] and not strip_tags(body)[1], "passed through, no tags"
    assert [t["name"] for t in body["tools"]] == ["Bash"], "no proxy tools on an unknown chain"
    agent.step(3, run_bash)  # chains on a response of the unknown chain: unknown too
    assert up[3].json["previous_response_id"] == agent.ids[2] and not strip_tags(up[3].json)[1]
    # the agent sends its whole history again (a new invocation): bili sees everything, folds resume
    agent.prev = None
    agent.step(4, run_bash)
    body = up[4].json
    assert "previous_response_id" not in body and strip_tags(body)[1], "tagged again"
    assert "compress" in [t["name"] for t in body["tools"]]


def test_the_fake_refuses_a_previous_response_id_it_never_issued(fake, sid):
    """The fake's chains are as strict as the API's (the guard the tests above rely on)."""
    body = {"model": "gpt-fake-1", "input": "hi", "previous_response_id": "resp_nobody"}
    reply = request(fake.url + "/v1/responses", json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert reply.status == 400 and "resp_nobody" in json.dumps(reply.json())
    body = {"model": "gpt-fake-1", "input": "hi", "store": False}
    rid = request(fake.url + "/v1/responses", json.dumps(body).encode(),
                  headers={"content-type": "application/json"}).json()["id"]
    body = {"model": "gpt-fake-1", "input": "again", "previous_response_id": rid}
    reply = request(fake.url + "/v1/responses", json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert reply.status == 400, "a store: false response is not kept for HTTP"


def test_the_fake_keeps_store_false_chains_on_their_websocket_only(fake, sid):
    from websockets.sync.client import connect as ws_connect

    def create(ws, **body) -> dict:
        ws.send(json.dumps({"type": "response.create", "model": "m", "store": False, **body}))
        while True:
            event = json.loads(ws.recv(timeout=10))
            if event["type"] in ("response.completed", "error"):
                return event

    url = f"ws://127.0.0.1:{fake.ws_port}/v1/responses"
    with ws_connect(url, proxy=None) as one, ws_connect(url, proxy=None) as two:
        first = create(one, input="hi")["response"]["id"]
        second = create(one, input="more", previous_response_id=first)
        assert second["type"] == "response.completed", second
        assert create(two, input="x", previous_response_id=second["response"]["id"])["type"] == "error", \
            "another connection does not have it"
        assert create(one, input="y", previous_response_id=first)["type"] == "error", "only the newest one"
        assert create(one, input="z", previous_response_id=second["response"]["id"])["type"] == "response.completed"
    seen = fake.find(lambda r: r.transport == "ws" and r.response_id)[-1].conversation
    assert [it["content"] for it in seen if it.get("role") == "user"] == ["hi", "more", "z"]
