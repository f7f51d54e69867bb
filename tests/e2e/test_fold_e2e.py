"""Folding end to end: a scripted model calls ``compress`` through a real ``mitmdump --mode
reverse`` with the bili addon, on all four lanes.

Each session is an agent loop (``support.Agent``): the agent sends its history, stores the
model's answer as the real agents do, runs its own ``Bash`` tool (a ~1.6 KB output whose lines
carry unique ``file-<turn>-row-<i>`` markers) and answers a tool it does not know (the proxy's)
with its usual error.  The fake upstream checks every scripted request the way the real API
does, so a folded body that breaks call/result pairing or roles fails its turn with a 400.

The main script: turns 1-7 read modules; turn 8 folds turns 1-4; 9-10 read on; 11 decompresses
b1; 12 searches the folded originals; 13 asks for the status; 14 ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from churn import strings

from bili_addon.kernel.fold import POINTER

from .fake_upstream import Act, proxy_call, say, tool
from .support import AGENTS, Agent, Call, assert_only_tags_added, assert_prefix_stable, request, strip_tags

pytestmark = pytest.mark.e2e

LANES = ["anthropic", "chat", "responses", "gemini"]
TASK = "Please audit this repository module by module and report anything suspicious."
PROMPT_HEAD = "# Context folding (bili)"
PROXY_TOOL_NAMES = ["compress", "decompress", "search_context", "acp_status"]
TURNS = 14
COMPRESS_TURN = 8
FOLDED = (1, 2, 3, 4)  # the turns whose tool output the first fold removes
KEPT = (5, 6, 7)


def summary(n: int, what: str) -> str:
    return (f"Summary {n}: {what} were read: plain data classes, nothing to fix; src/mod3.py defines "
            "load_config(path), which the CLI calls at start-up.")


def summary_head(block: str) -> str:
    return f"[Compressed conversation section {block} · "


def marker_re(block: str) -> re.Pattern:
    return re.compile(rf"^\[bili\] compressed (m\d{{5}})–(m\d{{5}}) → {block}, ~[0-9.]+K? tokens saved\n")


def bash_output(turn: int) -> str:
    """What the agent's Bash prints on ``turn``: ~1.6 KB, every line marked with its turn."""
    return "\n".join(f"file-{turn}-row-{i}: value={(turn * 7919 + i * 104729) % 1000003:07d} ok" for i in range(50))


def run_bash(call: Call, turn: int) -> str:
    return bash_output(turn)


def ref_of(body: Any, prefix: str) -> str:
    """The ref the addon showed the model for the prose starting with ``prefix``."""
    refs = {t.ref for t in strip_tags(body)[1] if t.text.startswith(prefix)}
    assert len(refs) == 1, f"expected one tagged prose starting with {prefix!r}, found {refs}"
    return refs.pop()


def fold(first: int, last: int, n: int):
    """The compress arguments a model would write: the refs it was shown for turns first..last."""
    def args(body: Any) -> dict:
        return {"content": [{"startId": ref_of(body, f"Turn {first}:"), "endId": ref_of(body, f"Turn {last}:"),
                             "topic": f"modules {first}-{last}", "summary": summary(n, f"modules {first}-{last}")}]}
    return args


def reading(t: int) -> Act:
    return tool("Bash", {"command": f"cat src/mod{t}.py"}, prose=f"Turn {t}: reading module {t}.")


def session_script() -> list[Act]:
    acts: list[Act] = []
    for t in range(1, TURNS + 1):
        if t == COMPRESS_TURN:
            acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {t}: modules 1 to 4 are done, folding."))
        elif t == 11:
            acts.append(proxy_call("decompress", {"blockId": "b1"}, prose=f"Turn {t}: what did b1 hold again?"))
        elif t == 12:
            acts.append(proxy_call("search_context", {"query": "file-3-row-7"}, prose=f"Turn {t}: where is row 7?"))
        elif t == 13:
            acts.append(proxy_call("acp_status", {}, prose=f"Turn {t}: how full is the context?"))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: the audit is complete, nothing suspicious."))
        else:
            acts.append(reading(t))
    return acts


def make_agent(lane: str, proxy, sid: str, script: str, *, stream: bool | None = None) -> Agent:
    kw: dict[str, Any] = {"stream": lane != "gemini" if stream is None else stream}
    if lane == "chat":
        kw["alter_calls"] = True  # this host re-serializes the call arguments it stores
    return AGENTS[lane](proxy.url, sid, script, TASK, **kw)


class Turns:
    """The upstream records of one scripted session, by turn."""

    def __init__(self, fake, script: str):
        self.fake, self.script = fake, script

    def all(self, turn: int):
        return self.fake.find(
            lambda r: r.header("x-fake-script") == self.script and r.header("x-fake-turn") == str(turn))

    def __getitem__(self, turn: int):
        recs = self.all(turn)
        assert recs, f"turn {turn} never reached the upstream"
        rec = recs[-1]
        assert rec.status == 200, f"turn {turn}: the fake refused the body: {rec.error or rec.response[:300]!r}"
        return rec


def item_index(agent: Agent, body: Any, needle: str) -> list[int]:
    return [k for k, it in enumerate(agent.conv(body)) if needle in json.dumps(it, ensure_ascii=False)]


def ran(fake, proxy, sid: str, tool_name: str) -> int:
    """How many requests of ``sid`` ran ``tool_name``, from mitmdump's log.  Another process writes
    it: first wait for the line of every request of ``sid`` the upstream has seen."""
    proxy.wait_bili_lines(len(fake.find(session_of(sid))), session=sid)
    return sum(1 for ln in proxy.log().splitlines() if f"session={sid} " in ln and f"ran={tool_name}" in ln)


def model_args(script, turn: int) -> str:
    """The arguments of the call the model made on ``turn``, exactly as it sent them."""
    return [r for t, r in script.answered if t == turn][0].tool_args


def pointed(args: str, block: str) -> dict:
    """A compress call's arguments as the wire shows them once its block stands in the conversation:
    the summary points at the block (kernel/tools.py)."""
    out = json.loads(args)
    out["content"][0]["summary"] = POINTER.format(id=block)
    return out


def assert_folded(raw: bytes, folded=FOLDED, kept=KEPT, blocks=("b1",)) -> None:
    """The fold is on the wire: the folded turns' output is gone, the later output is there, and
    each block's summary stands once."""
    text = raw.decode()
    for t in folded:
        assert f"file-{t}-row-" not in text, f"turn {t}'s tool output should be folded away"
    for t in kept:
        assert f"file-{t}-row-" in text, f"turn {t}'s tool output must stay"
    for b in blocks:
        assert text.count(summary_head(b)) == 1, f"{b}'s summary should stand exactly once"


def session_of(sid: str):
    return lambda r: sid in (r.header("x-claude-code-session-id"), r.header("x-session-id"), r.header("session_id"))


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold")


@pytest.mark.parametrize("lane", LANES)
def test_a_scripted_fold_through_mitmdump(fake, proxy, sid, lane):
    script = fake.script(sid, session_script())
    agent = make_agent(lane, proxy, sid, sid)
    up = Turns(fake, sid)

    # -- turns 1..8: the proxy tools and the prompt are offered; turn 8's answer calls compress
    for t in range(1, COMPRESS_TURN + 1):
        agent.step(t, run_bash)
        up[t]
    assert agent.tool_names(up[1].json) == ["Bash", *PROXY_TOOL_NAMES]
    assert PROMPT_HEAD in up[1].body.decode()
    compress_call = agent.answers[COMPRESS_TURN].call
    assert compress_call is not None and compress_call.name == "compress"
    before = up[COMPRESS_TURN]
    for t in FOLDED + KEPT:
        assert f"file-{t}-row-" in before.body.decode()
    range_start = item_index(agent, before.json, "Turn 1: reading module 1.")
    assert len(range_start) == 1

    # -- a side request of the same session (a title), while the call is pending: no tools, no
    #    prompt, nothing run
    sent = agent.title_request({"x-case": "title"})
    title = fake.last(lambda r: r.header("x-case") == "title" and session_of(sid)(r))
    assert title.status == 200
    assert "tools" not in title.json and PROMPT_HEAD not in title.body.decode()
    assert_only_tags_added(title.json, sent)
    assert ran(fake, proxy, sid, "compress") == 0, "nothing runs before the agent's next request carries the call"

    # -- turn 9: the call runs, once; the fold is on the wire; the client sees the marker
    ans9 = agent.step(COMPRESS_TURN + 1, run_bash)
    rec9 = up[COMPRESS_TURN + 1]
    body9 = rec9.json
    assert_folded(rec9.body)
    assert json.dumps(summary(1, "modules 1-4"))[1:-1] in rec9.body.decode()
    where = item_index(agent, body9, summary_head("b1"))
    if lane == "chat":  # user and assistant turns alternate: the summary joins the user turn before it
        assert where == [range_start[0] - 1] and TASK in json.dumps(agent.conv(body9)[where[0]])
    else:
        assert where == range_start, "the summary stands where the range began"
    # the real result in place of the agent's error, and the call as the model made it, but for its
    # summary: a pointer to b1, which stands in the conversation (the summary goes upstream once)
    holder, result = agent.result_of(body9, compress_call)
    assert result.startswith("Compressed m") and "→ b1" in result, result
    assert agent.unknown_error.format(name="compress") not in rec9.body.decode()
    if lane == "anthropic":
        assert "is_error" not in holder
    if lane == "chat":  # the host stored re-serialized arguments; the model's own arguments go upstream
        assert json.dumps(model_args(script, COMPRESS_TURN)) not in json.dumps(agent.sent[COMPRESS_TURN + 1])
    assert json.loads(agent.call_args_of(body9, compress_call)) == pointed(model_args(script, COMPRESS_TURN), "b1")
    assert rec9.body.decode().count(json.dumps(summary(1, "modules 1-4"))[1:-1]) == 1
    # the prose that stays keeps the refs the model was shown before
    for t in KEPT:
        assert ref_of(body9, f"Turn {t}:") == ref_of(before.json, f"Turn {t}:")
    m = marker_re("b1").match(ans9.text)
    assert m, f"the answer should start with the [bili] marker line: {ans9.text!r}"
    assert m.group(1) == ref_of(before.json, "Turn 1:")
    assert ans9.text[m.end():] == f"Turn {COMPRESS_TURN + 1}: reading module {COMPRESS_TURN + 1}."
    assert ran(fake, proxy, sid, "compress") == 1

    # -- the same request again (a retry): nothing runs twice, the upstream gets the same bytes
    agent.resend(COMPRESS_TURN + 1)
    retried = up.all(COMPRESS_TURN + 1)
    assert len(retried) == 2 and retried[1].status == 200
    assert retried[1].body == rec9.body
    assert ran(fake, proxy, sid, "compress") == 1

    # -- turn 10: the fold stays, and the body extends turn 9's byte for byte
    agent.step(10, run_bash)
    rec10 = up[10]
    assert_folded(rec10.body)
    assert_prefix_stable(rec9.body, rec10.body, agent.conv_key)
    assert "[bili] compressed" not in rec10.body.decode(), "the marker is for the client; the model never sees it"

    # -- a restart with the same data dir: retries give the same bytes, the fold holds
    proxy.restart()
    agent.connect()
    agent.resend(COMPRESS_TURN + 1)
    assert up.all(COMPRESS_TURN + 1)[-1].body == rec9.body
    agent.resend(10)
    assert up.all(10)[-1].body == rec10.body
    agent.step(11, run_bash)  # the model calls decompress b1
    rec11 = up[11]
    assert_folded(rec11.body)
    assert_prefix_stable(rec10.body, rec11.body, agent.conv_key)
    assert ran(fake, proxy, sid, "compress") == 1

    # -- turn 12: the decompress result shows the originals
    agent.step(12, run_bash)
    rec12 = up[12]
    _, result = agent.result_of(rec12.json, agent.answers[11].call)
    assert result.startswith("b1 (tier 1) replaced original messages"), result[:200]
    assert "file-2-row-" in result and "file-4-row-49" in result
    assert agent.unknown_error.format(name="decompress") not in rec12.body.decode()
    assert_prefix_stable(rec11.body, rec12.body, agent.conv_key)

    # -- turn 13: search_context finds text inside the folded originals
    agent.step(13, run_bash)
    rec13 = up[13]
    _, result = agent.result_of(rec13.json, agent.answers[12].call)
    assert "(inside b1)" in result and "file-3-row-7" in result, result[:400]
    assert_prefix_stable(rec12.body, rec13.body, agent.conv_key)

    # -- turn 14: acp_status reports the block
    agent.step(14, run_bash)
    rec14 = up[14]
    _, result = agent.result_of(rec14.json, agent.answers[13].call)
    assert "b1" in result, result[:400]
    assert rec14.body.decode().count(summary_head("b1")) == 1
    assert_prefix_stable(rec13.body, rec14.body, agent.conv_key)
    for name in ("decompress", "search_context", "acp_status"):
        assert ran(fake, proxy, sid, name) == 1, name


def two_folds_script() -> list[Act]:
    acts = [reading(t) for t in range(1, 8)]
    acts.append(proxy_call("compress", fold(1, 4, 1), prose="Turn 8: modules 1 to 4 are done, folding them."))
    acts += [reading(t) for t in range(9, 12)]
    acts.append(proxy_call("compress", fold(5, 9, 2), prose="Turn 12: modules 5 to 9 are done too, folding them."))
    acts.append(reading(13))
    acts.append(say("Turn 14: done."))
    return acts


@pytest.mark.parametrize("lane", LANES)
def test_a_second_compress_of_the_session_runs_too(fake, proxy, sid, lane):
    script = fake.script(sid, two_folds_script())
    agent = make_agent(lane, proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, 14):
        agent.step(t, run_bash)
        up[t]
    second = agent.answers[12].call
    rec13 = up[13]
    _, result = agent.result_of(rec13.json, second)
    assert result.startswith("Compressed m") and "→ b2" in result, result
    assert json.loads(agent.call_args_of(rec13.json, second)) == pointed(model_args(script, 12), "b2")
    assert_folded(rec13.body, folded=(1, 2, 3, 4, 5, 6, 7, 9), kept=(10, 11), blocks=("b1", "b2"))
    assert marker_re("b2").match(agent.answers[13].text), agent.answers[13].text
    assert ran(fake, proxy, sid, "compress") == 2
    agent.step(14, run_bash)
    assert_prefix_stable(rec13.body, up[14].body, agent.conv_key)


@pytest.fixture(scope="module")
def twin_proxies(make_proxy):
    """Two proxies with fresh data dirs of their own."""
    return make_proxy("reverse", "fold"), make_proxy("reverse", "fold")


def replay(fake, proxy, lane: str, sid: str, script: str, stream: bool) -> tuple[Agent, list[bytes]]:
    fake.script(script, session_script())
    agent = make_agent(lane, proxy, sid, script, stream=stream)
    up = Turns(fake, script)
    bodies = []
    for t in range(1, TURNS + 1):
        agent.step(t, run_bash)
        bodies.append(up[t].body)
    return agent, bodies


@pytest.mark.parametrize("lane", LANES)
def test_the_same_session_twice_gives_the_same_bytes(fake, twin_proxies, sid, lane):
    """Replayed against two fresh data dirs, the session sends the same bytes upstream, turn by turn
    (here the other way round: JSON answers for Anthropic, Chat and Responses, a stream for Gemini)."""
    stream = lane == "gemini"
    a, b = twin_proxies
    agent, first = replay(fake, a, lane, sid, f"{sid}-a", stream)
    _, second = replay(fake, b, lane, sid, f"{sid}-b", stream)
    for t, (x, y) in enumerate(zip(first, second), start=1):
        assert x == y, f"turn {t}: the two replays sent different bodies upstream"
    assert_folded(first[COMPRESS_TURN])  # turn 9 carries the fold


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_the_marker_reaches_a_non_streamed_answer(fake, proxy, sid, lane):
    fake.script(sid, session_script())
    agent = make_agent(lane, proxy, sid, sid, stream=False)
    up = Turns(fake, sid)
    for t in range(1, COMPRESS_TURN + 2):
        agent.step(t, run_bash)
        up[t]
    assert_folded(up[COMPRESS_TURN + 1].body)
    text = agent.answers[COMPRESS_TURN + 1].text
    m = marker_re("b1").match(text)
    assert m, f"the answer should start with the [bili] marker line: {text!r}"
    assert text[m.end():] == f"Turn {COMPRESS_TURN + 1}: reading module {COMPRESS_TURN + 1}."


def test_gemini_cli_made_up_ids_get_the_real_result(fake, proxy, sid):
    fake.script(sid, session_script())
    agent = AGENTS["gemini"](proxy.url, sid, sid, TASK, stream=False, cli_ids=True)
    up = Turns(fake, sid)
    for t in range(1, COMPRESS_TURN + 2):
        agent.step(t, run_bash)
        up[t]
    rec9 = up[COMPRESS_TURN + 1]
    assert_folded(rec9.body)  # the fold itself happens
    assert marker_re("b1").match(agent.answers[COMPRESS_TURN + 1].text)
    _, result = agent.result_of(rec9.json, agent.answers[COMPRESS_TURN].call)
    assert result.startswith("Compressed m") and "→ b1" in result, result
    assert "not found in registry" not in rec9.body.decode()


def small_fold_script() -> list[Act]:
    acts = [reading(t) for t in range(1, 5)]
    acts.append(proxy_call("compress", fold(1, 1, 1), prose="Turn 5: folding module 1 alone."))
    acts.append(say("Turn 6: fine, leaving it."))
    return acts


@pytest.mark.parametrize("lane", LANES)
def test_a_fold_below_the_minimum_is_refused_with_a_reason(fake, proxy, sid, lane):
    """One ~1.6 KB tool output is under bili_min_compress_chars (5000): the model is told why, and
    nothing leaves the wire."""
    fake.script(sid, small_fold_script())
    agent = make_agent(lane, proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, 7):
        agent.step(t, run_bash)
        up[t]
    rec6 = up[6]
    _, result = agent.result_of(rec6.json, agent.answers[5].call)
    assert "not compressed" in result and "too small" in result and "minimum 5000" in result, result
    assert agent.unknown_error.format(name="compress") not in rec6.body.decode()
    assert summary_head("b1") not in rec6.body.decode()
    for t in range(1, 5):
        assert f"file-{t}-row-" in rec6.body.decode()
    assert not agent.answers[6].text.startswith("[bili]"), "no fold, no marker"
    assert ran(fake, proxy, sid, "compress") == 1
    assert_prefix_stable(up[5].body, rec6.body, agent.conv_key)


@pytest.fixture(scope="module")
def quiet_proxy(make_proxy):
    return make_proxy("reverse", "fold", bili_marker="false")


def test_with_bili_marker_off_the_answer_is_left_alone(fake, quiet_proxy, sid):
    fake.script(sid, session_script())
    agent = make_agent("anthropic", quiet_proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, COMPRESS_TURN + 2):
        agent.step(t, run_bash)
        up[t]
    assert_folded(up[COMPRESS_TURN + 1].body)
    assert agent.answers[COMPRESS_TURN + 1].text == f"Turn {COMPRESS_TURN + 1}: reading module {COMPRESS_TURN + 1}."
    rec = up[COMPRESS_TURN + 1]
    assert agent.tee.last.response_body == rec.response, "nothing to change: the stream passes byte for byte"


# -- the guard itself: a scripted request is refused exactly where the real API refuses it ----------

_TU = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}
_TR = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
_SUMMARY = {"role": "user", "content": [{"type": "text", "text": "[Compressed conversation section b1 · m1–m2]\nx"}]}
_U = {"role": "user", "content": "hi"}
_GC = {"role": "model", "parts": [{"functionCall": {"name": "Bash", "args": {}}}]}
_GR = {"role": "user", "parts": [{"functionResponse": {"name": "Bash", "response": {"output": "ok"}}}]}
_GS = {"role": "user", "parts": [{"text": "[Compressed conversation section b1 · m1–m2]\nx"}]}
_GU = {"role": "user", "parts": [{"text": "hi"}]}

GUARD = [
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": [_U, _SUMMARY, _TU, _TR]}, 200, ""),
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": [_U, _TU, _SUMMARY, _TR]}, 400, "must come first"),
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": [_U, _TU, _SUMMARY]}, 400, "without `tool_result`"),
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": [_U, _TR]}, 400, "tool_use_id"),
    ("/v1beta/models/g:generateContent", {"contents": [_GU, _GS, _GC, _GR]}, 200, ""),
    ("/v1beta/models/g:generateContent", {"contents": [_GU, _GC, _GS, _GR]}, 400, "immediately after a function call"),
    ("/v1beta/models/g:generateContent", {"contents": [_GU, _GC, _GR, _GR]}, 400, "immediately after a function call"),
    ("/v1beta/models/g:generateContent", {"contents": [_GU, _GC, {"role": "user", "parts": [
        *_GR["parts"], {"text": "a note"}]}]}, 400, "ending with a model turn"),
    ("/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": "{}"}]}, 400, "No tool output"),
    ("/v1/chat/completions", {"model": "m", "messages": [_U, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]}]}, 400, "c1"),
    ("/v1/chat/completions", {"model": "deepseek-reasoner", "messages": [_U, _U]}, 400, "successive user"),
    ("/v1/chat/completions", {"model": "gpt-x", "messages": [_U, _U]}, 200, ""),
]


@pytest.mark.parametrize("path,body,status,needle", GUARD, ids=[f"{k}-{s}" for k, (_p, _b, s, _n) in enumerate(GUARD)])
def test_the_scripted_fake_refuses_what_the_real_api_refuses(fake, sid, path, body, status, needle):
    """No proxy here: the fake alone, in its exact mode (summary items of the user role may sit next
    to user turns, as the real APIs merge them; call/result pairing may not break)."""
    fake.script(sid, [say("fine")])
    reply = request(fake.url + path, json.dumps(body).encode(),
                    headers={"content-type": "application/json", "x-fake-script": sid})
    assert reply.status == status, reply.body
    if needle:
        assert needle in json.dumps(reply.json())


# -- reminders: the model folds what the addon offers ---------------------------------------------
REMIND_AT = 1500  # foldable tokens; each turn's Bash output is ~400
REMINDER_RANGE = re.compile(r"^  (m\d{5})–(m\d{5})  \d+ messages  ~", re.M)


def reminders_in(body: Any) -> list[str]:
    return [t for t in strings(body) if "[bili] ~" in t]


def fold_what_was_offered(body: Any) -> dict:
    """What a model does with the reminder: one compress call, one entry per range it lists."""
    found = reminders_in(body)
    assert found, "no reminder reached the model: " + json.dumps(body)[:3000]
    note = found[-1]
    ranges = REMINDER_RANGE.findall(note[note.index("[bili] ~"):])
    assert ranges, note
    return {"content": [{"startId": s, "endId": e, "summary": summary(k, f"the work in {s}–{e}")}
                        for k, (s, e) in enumerate(ranges, start=1)]}


@pytest.fixture(scope="module")
def reminding_proxy(make_proxy):
    return make_proxy("reverse", "fold", bili_remind_at=str(REMIND_AT))


@pytest.mark.parametrize("lane", LANES)
def test_the_model_folds_what_the_reminder_offers(fake, reminding_proxy, sid, lane):
    acts = [reading(t) for t in range(1, 8)]
    acts.append(proxy_call("compress", fold_what_was_offered, prose="Turn 8: folding what the proxy offered."))
    acts += [reading(9), say("Turn 10: done.")]
    fake.script(sid, acts, real_usage=True)  # the answers report the prompt's size, as the real APIs do
    agent = make_agent(lane, reminding_proxy, sid, sid)
    up = Turns(fake, sid)
    for t in range(1, 9):
        agent.step(t, run_bash)
    reminded = [t for t in range(1, 9) if reminders_in(up[t].json)]
    assert reminded and reminded[0] > 1, "a reminder comes once enough work can be folded, not before"
    first = up[reminded[0]].json
    [note] = reminders_in(first)
    # on the newest item only: for Anthropic inside the turn that carries the tool results (as
    # Claude Code adds its own reminders), elsewhere an item of its own right after them
    conv = agent.conv(first)
    assert note in list(strings(conv[-1])) and not any(note in list(strings(it)) for it in conv[:-1])
    output = f"file-{reminded[0] - 1}-row-0"  # the tool output the reminder follows
    assert conv[-1].get("role") == "user"
    if lane == "anthropic":
        assert output in json.dumps(conv[-1])
    else:
        assert output in json.dumps(conv[-2]) and "file-" not in json.dumps(conv[-1])
    # the reminder keeps its bytes on later turns, and no second one comes while nothing grew enough
    assert reminded[0] < 8
    assert reminders_in(up[reminded[0] + 1].json) == [note]
    # turn 9: what the reminder offered is folded; pairing and roles still pass the fake's checks
    agent.step(9, run_bash)
    rec9 = up[9]
    _, result = agent.result_of(rec9.json, agent.answers[8].call)
    assert result.startswith("Compressed m") and "→ b1" in result, result
    assert "[Compressed conversation section b1 · " in rec9.body.decode()
    b9 = rec9.body.decode()
    assert "file-1-row-" not in b9 and "file-7-row-" in b9  # turn 8 called compress, not Bash
    agent.step(10, run_bash)
    assert_prefix_stable(rec9.body, up[10].body, agent.conv_key)


def test_a_fold_keeps_turns_alternating_for_deepseek_reasoner(fake, proxy, sid):
    """DeepSeek's reasoner refuses two user messages in a row (the fake does too): the summary of
    a range that starts after the task joins the task's user message."""
    fake.script(sid, session_script())
    agent = make_agent("chat", proxy, sid, sid)
    agent.model = "deepseek-reasoner"
    up = Turns(fake, sid)
    for t in range(1, COMPRESS_TURN + 2):
        agent.step(t, run_bash)
    rec9 = up[COMPRESS_TURN + 1]  # a 400 from the fake fails here
    assert_folded(rec9.body)
    roles = [m["role"] for m in rec9.json["messages"] if m["role"] != "tool"]
    assert all(not (a == b == "user") for a, b in zip(roles, roles[1:])), roles
    agent.step(COMPRESS_TURN + 2, run_bash)
    assert_prefix_stable(rec9.body, up[COMPRESS_TURN + 2].body, agent.conv_key)
