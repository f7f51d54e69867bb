"""``bili replay``: captured flows through the addon's kernel, offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mitmproxy import http, io
from mitmproxy.test import tflow, tutils

from bili_addon import cli, replay

from wirecases import CAPTURES as _CAPTURES  # the one place that finds them ($BILI_CAPTURES)

CAPTURES = Path(_CAPTURES)
needs_captures = pytest.mark.skipif(not CAPTURES.is_dir(), reason=f"no captured flows at {CAPTURES} "
                                                                  "(set $BILI_CAPTURES)")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # these tests replay the fold path: bili shows itself from the first request (--activate always)
    return subprocess.run([sys.executable, "-m", "bili_addon.cli", "replay", "--activate", "always", "--materialize", "now", *args],
                          capture_output=True, text=True, timeout=300)


@needs_captures
def test_replay_over_every_capture_prints_a_table_per_file():
    r = run_cli(str(CAPTURES))
    assert r.returncode == 0, r.stderr
    files = sorted(CAPTURES.rglob("*.mitm"))
    assert len(files) >= 20
    for f in files:
        assert f"{f}: " in r.stdout, f
    assert r.stdout.count("turn  lane") >= len(files)
    assert "error:" not in r.stdout
    header = next(line for line in r.stdout.splitlines() if "turn  lane" in line).split()
    assert header[:4] == ["turn", "lane", "via", "msgs"] and "~tokens" in header


@needs_captures
def test_replay_json_per_session_and_turn():
    r = run_cli("--json", str(CAPTURES))
    assert r.returncode == 0, r.stderr
    docs = {Path(d["path"]).parent.name: d for d in json.loads(r.stdout)}
    for name, d in docs.items():
        assert not d["errors"], (name, d["errors"])
        assert d["turns"], name
        for t in d["turns"]:
            assert t["tokens_in"] == t["bytes_in"] // 4 and t["tokens_out"] == t["bytes_out"] // 4
    # Claude Code's first-party host: every request carries the billing block, kept first and exact
    fp = docs["claude_fwd"]["turns"]
    assert [t["turn"] for t in fp] == [1, 2, 3] and len({t["session"] for t in fp}) == 1
    assert all(t["first_party"] and t["first_block_kept"] and t["changed"] for t in fp)
    assert not any(t["first_party"] for t in docs["claude_rev"]["turns"])  # a custom base URL is not first-party
    # codex's WebSocket frames are replayed as live: a delta on a chain is rebuilt from the transcript
    # of the answers before it (the whole conversation for the ledger) and goes up as a delta
    ws = docs["codex_fwd"]["turns"]
    assert {t["via"] for t in ws} == {"ws"}
    assert ws[-1]["note"] == "chained: the delta on the provider's chain"
    assert ws[-1]["messages"] > ws[-2]["messages"] and ws[-1]["refs_known"] == ws[-2]["refs_new"]
    assert {t["via"] for t in docs["codex_fwd_blk"]["turns"]} == {"http"}
    # the unknown-tool runs: the recorded answer calls compress, the next request runs it
    for name in ("omp_unk", "hermes_unk"):
        turns = docs[name]["turns"]
        assert any("compress" in t["called"] for t in turns), name
        assert any(t["executed"] == ["compress"] for t in turns), name
    # a compress that folded nothing says why, in the words the model read
    idle = [t for d in docs.values() for t in d["turns"] if "compress" in t["executed"] and not t["blocks"]]
    assert idle and all(t["reason"] for t in idle)
    assert all(not t["reason"] for d in docs.values() for t in d["turns"] if "compress" not in t["executed"])
    # turn N+1 of a session knows the refs of turn N
    t1, t2 = docs["codex_rev"]["turns"]
    assert t1["refs_new"] > 0 and t2["refs_known"] >= t1["refs_new"] and t2["turn"] == 2


@needs_captures
def test_replayed_bodies_show_the_real_tool_result(tmp_path):
    path = CAPTURES / "omp" / "omp_unk" / "flows.mitm"
    rep = replay.replay_file(path, activate="always", materialize="now")
    ran = [t for t in rep.turns if t.executed == ["compress"]]
    assert ran
    for t in ran:
        body = t.body.decode()
        assert "Tool compress not found" not in body  # the agent's error, replaced upstream
        assert "not compressed" in body or "Compressed " in body
    # deterministic: the same bytes on every replay (usable as a regression fixture)
    assert [t.body for t in replay.replay_file(path, activate="always", materialize="now").turns] == [t.body for t in rep.turns]


@needs_captures
def test_first_party_observe_leaves_bodies_unchanged(tmp_path):
    rep = replay.replay_file(CAPTURES / "claude-code" / "claude_fwd" / "flows.mitm", first_party="observe", activate="always", materialize="now")
    assert rep.turns and all(not t.changed and t.bytes_in == t.bytes_out for t in rep.turns)
    rev = replay.replay_file(CAPTURES / "claude-code" / "claude_rev" / "flows.mitm", first_party="observe", activate="always", materialize="now")
    assert all(t.changed for t in rev.turns)  # only first-party traffic is left alone


@needs_captures
def test_bodies_are_written_for_bug_reports(tmp_path):
    r = run_cli("--bodies", str(tmp_path / "out"), str(CAPTURES / "codex" / "codex_rev" / "flows.mitm"))
    assert r.returncode == 0, r.stderr
    written = sorted((tmp_path / "out").iterdir())
    assert len(written) == 2
    assert all(json.loads(p.read_bytes())["model"] for p in written)


# -- a synthetic capture: a fold made and carried ------------------------------------------------------
def _filler(tag: str) -> str:
    return f"{tag}: " + " ".join(f"{tag}-row-{i}" for i in range(400))


def _conversation(turns: int) -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": "Please audit the repository."}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {t}: reading module {t}."},
            {"type": "tool_use", "id": f"toolu_{t}", "name": "Bash", "input": {"cmd": f"cat mod{t}.py"}}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                                  "content": _filler(f"file-{t}")}]})
    return msgs


def _flow(msgs: list[dict], answer: dict) -> http.HTTPFlow:
    body = json.dumps({"model": "claude-x", "max_tokens": 100, "system": "You are an agent.",
                       "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
                       "messages": msgs}).encode()
    req = tutils.treq(method=b"POST", path=b"/v1/messages", host="api.anthropic.com", port=443, scheme=b"https",
                      headers=http.Headers(host="api.anthropic.com", content_type="application/json",
                                           x_acp_session="replay-fold"), content=body)
    resp = tutils.tresp(status_code=200, headers=http.Headers(content_type="application/json"),
                        content=json.dumps(answer).encode())
    return tflow.tflow(req=req, resp=resp)


def _answer(content: list[dict]) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": content,
            "stop_reason": "tool_use", "usage": {"input_tokens": 1000, "output_tokens": 5}}


def test_a_recorded_compress_call_folds_the_next_request(tmp_path):
    msgs = _conversation(8)
    # refs as the kernel assigns them: m00001 the question, then per step its prose, call and result
    args = {"content": [{"startId": "m00002", "endId": "m00008", "topic": "modules 0-2",
                         "summary": "Modules 0 to 2 were read; nothing unusual, mod1.py holds the parser."}]}
    call = {"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}
    after = msgs + [{"role": "assistant", "content": [call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "is_error": True,
                                                  "content": "Error: No such tool available: compress"}]}]
    path = tmp_path / "flows.mitm"
    with open(path, "wb") as f:
        w = io.FlowWriter(f)
        w.add(_flow(msgs, _answer([call])))
        w.add(_flow(after, _answer([{"type": "text", "text": "Done."}])))
    rep = replay.replay_file(path, activate="always", materialize="now")
    first, second = rep.turns
    assert first.called == ["compress"] and first.blocks == 0
    assert second.executed == ["compress"] and second.blocks == 1 and second.folded > 0
    assert second.bytes_out < second.bytes_in  # the fold made the request smaller
    sent = json.loads(second.body)
    assert "No such tool" not in json.dumps(sent) and "[Compressed conversation section b1" in json.dumps(sent)
    assert "file-1-row-3" not in json.dumps(sent)
    rows = [ln.split() for ln in replay.table(rep) if ln.startswith("    2 ")]
    assert len(rows) == 1 and rows[0][:3] == ["2", "anthropic", "http"]
    assert rows[0][7:10] == ["1", str(second.folded), "compress"]  # blocks, folded, ran
    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "replay", "--activate", "always", "--materialize", "now", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "(answer calls compress)" in out.stdout


def test_a_compress_that_folds_nothing_shows_the_reason_the_model_got(tmp_path):
    msgs = _conversation(8)
    args = {"content": [{"startId": "m00002", "endId": "m00008", "topic": "modules 0-2",
                         "summary": "Modules 0 to 2 were read; nothing unusual, mod1.py holds the parser."}]}
    call = {"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}
    after = msgs + [{"role": "assistant", "content": [call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "is_error": True,
                                                  "content": "Error: No such tool available: compress"}]}]
    path = tmp_path / "flows.mitm"
    with open(path, "wb") as f:
        w = io.FlowWriter(f)
        w.add(_flow(msgs, _answer([call])))
        w.add(_flow(after, _answer([{"type": "text", "text": "Done."}])))
    rep = replay.replay_file(path, min_compress_chars=10**6, activate="always", materialize="now")  # every range is too small
    second = rep.turns[1]
    assert second.executed == ["compress"] and second.blocks == 0
    assert "m00002–m00008 not compressed: too small to be worth a fold" in second.reason
    assert "minimum 1000000" in second.reason
    assert second.reason in json.loads(second.body)["messages"][-1]["content"][0]["content"]  # what the model got
    row = next(ln for ln in replay.table(rep) if ln.startswith("    2 "))
    assert row.endswith(second.reason)
    header = next(ln for ln in replay.table(rep) if "turn  lane" in ln)
    assert header.split()[-1] == "reason"
    assert not rep.turns[0].reason
    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "replay", "--activate", "always", "--materialize", "now", "--json", "--min-compress-chars",
                          "1000000", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "too small to be worth a fold" in json.loads(out.stdout)[0]["turns"][1]["reason"]


def test_unreadable_input_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.mitm"
    bad.write_bytes(b"this is not a flow file")
    args = cli.build_parser().parse_args(["replay", str(bad)])
    assert replay.run(args) == 1
    assert "cannot read" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert replay.run(cli.build_parser().parse_args(["replay", str(empty)])) == 1


@needs_captures
def test_replay_cost_of_the_captured_agents(tmp_path):
    """``bili replay --cost``: per session the input billed under the provider's cache model with and
    without the addon.  The captured sessions are short: with lazy activation they cost what they cost
    without it (target: total <= x1.02, no session over x1.05); injecting from the first request costs more."""
    from bili_addon.replay_cost import session_costs

    reports = [replay.replay_file(p) for p in replay.find_flow_files([str(CAPTURES)])]  # lazy, the default
    costs = session_costs(reports)
    assert len(costs) >= 30 and {c.lane for c in costs} == {"anthropic", "chat", "responses"}
    total = sum(c.with_addon for c in costs) / sum(c.without for c in costs)
    assert total <= 1.02 and max(c.ratio for c in costs) <= 1.05
    files = replay.find_flow_files([str(CAPTURES)])
    always = session_costs([replay.replay_file(p, activate="always", materialize="now") for p in files])
    assert sum(c.with_addon for c in always) > sum(c.without for c in always)  # the injection is billed
    assert any(c.bill_without.read for c in costs) and any(c.bill_without.write for c in costs)
    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "replay", "--cost", str(CAPTURES / "pi")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("total: 3 sessions")
    assert "x1.000" in out.stdout.splitlines()[-1]


def test_chained_responses_over_http_replay_as_live(tmp_path):
    """omp's own OpenAI transport sends ``previous_response_id`` over HTTP (``store: true``): live, every
    Responses body goes through the chains transcript (a delta stays the delta on the provider's
    chain); the replay took the delta for a whole conversation over HTTP, adding bili's instructions
    and tags to it, so its bytes were not what the proxy had sent."""
    path = CAPTURES / "omp" / "omp_fwd" / "flows.mitm"
    if not path.exists():
        pytest.skip("no captures (set BILI_CAPTURES)")
    rep = replay.replay_file(path, activate="always", materialize="now")
    chained = [t for t in rep.turns if t.lane == "responses" and t.via == "http" and json.loads(t.raw).get("previous_response_id")]
    assert chained
    for t in chained:
        assert t.note.startswith("chained: the delta"), t.note
        sent, raw = json.loads(t.body), json.loads(t.raw)
        assert len(sent["input"]) == len(raw["input"]) and sent.get("previous_response_id") == raw["previous_response_id"]


# -- an error answer teaches the replay what it teaches the proxy -------------------------------------
_STRICT_BODY = json.dumps({"model": "some-model", "messages": [
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                          "function": {"name": "shell", "arguments": "{\"cmd\": \"ls\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"}]}).encode()


def _chat_flow(status: int, answer: dict, at: float) -> http.HTTPFlow:
    req = tutils.treq(method=b"POST", path=b"/v1/chat/completions", host="gw.example.com", port=443, scheme=b"https",
                      headers=http.Headers(host="gw.example.com", content_type="application/json", x_acp_session="err-1"),
                      content=_STRICT_BODY)
    req.timestamp_start = at
    f = tflow.tflow(req=req)
    f.response = tutils.tresp(status_code=status, headers=http.Headers(content_type="application/json"),
                              content=json.dumps(answer).encode())
    return f


def _error_flows() -> list[http.HTTPFlow]:
    """A context-too-long 413 (the window it states), a 400 asking for ``reasoning_content``, an answer."""
    ok = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 50, "completion_tokens": 2}}
    return [_chat_flow(413, {"error": {"message": "prompt is too long: 250000 tokens > 180000 maximum"}}, 1000.0),
            _chat_flow(400, {"error": {"message": "The reasoning_content in the thinking mode must be passed back "
                                                  "to the API."}}, 1001.0),
            _chat_flow(200, ok, 1002.0), _chat_flow(200, ok, 1003.0)]


def test_an_error_answer_teaches_the_replay_as_it_teaches_the_proxy(bili, tmp_path):
    """Live, an error answer sets what the session's next bodies are rendered with (the window an
    overflow states, reasoning passed back); the replay skipped every non-2xx answer, so its bodies
    after one were not what the proxy sent.  Both learn it in kernel/errors.py now."""
    live = []
    for f in _error_flows():
        resp, f.response = f.response, None
        bili.request(f)
        live.append(f.request.content)
        f.response = resp
        bili.responseheaders(f)
        bili.response(f)
    live_flags = bili.stats()["sessions"][0]["flags"]
    assert live_flags["strict_reasoning"] is True and live_flags["learned_windows"] == {"some-model": 180_000}
    assert b"reasoning_content" not in live[1] and b"reasoning_content" in live[2]

    path = tmp_path / "errors.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        for f in _error_flows():
            w.add(f)
    assert [t.body for t in replay.replay_file(path, activate="always", materialize="now").turns] == live
    rep = replay.Replayer(tmp_path / "store", activate="always", materialize="now")
    report = replay.FileReport(str(path))
    with open(path, "rb") as fh:
        rep.run(report, io.FlowReader(fh).stream())
    flags = rep.engine.sessions.get(report.turns[0].session).flags
    assert {k: flags.get(k) for k in ("strict_reasoning", "learned_windows")} == {
        k: live_flags[k] for k in ("strict_reasoning", "learned_windows")}
    rep.close()


# -- a chained Responses turn is billed on its whole chain -----------------------------------------------
def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _responses_flow(body: bytes, answer: dict, at: float) -> http.HTTPFlow:
    req = tutils.treq(method=b"POST", path=b"/v1/responses", host="api.openai.com", port=443, scheme=b"https",
                      headers=http.Headers(host="api.openai.com", content_type="application/json",
                                           x_acp_session="chain-cost"), content=body)
    req.timestamp_start = at
    f = tflow.tflow(req=req)
    f.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=_compact(answer))
    return f


def test_replay_cost_bills_a_chained_turn_on_its_whole_chain(tmp_path):
    """A turn with ``previous_response_id`` sends only its new items; the provider reads (and bills) the
    whole chain, mostly from its cache.  ``--cost`` billed the delta alone, with no read (the live clock
    and meter bill the chain); now the rebuilt chain, against a figure made by hand."""
    from bili_addon.replay_cost import session_costs

    u1 = _compact({"role": "user", "content": [{"type": "input_text", "text": "audit " + "x" * 6000}]})
    out = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "Audited.", "annotations": []}]}
    u2 = _compact({"role": "user", "content": [{"type": "input_text", "text": "and now the tests"}]})
    head = b'{"model":"gpt-5","input":[' + u1
    body1 = head + b'],"store":true}'
    body2 = b'{"model":"gpt-5","previous_response_id":"resp_1","input":[' + u2 + b'],"store":true}'
    answer = {"object": "response", "id": "resp_1", "status": "completed", "output": [out],
              "usage": {"input_tokens": 1600, "output_tokens": 3}}
    path = tmp_path / "chain.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        w.add(_responses_flow(body1, answer, 1000.0))
        w.add(_responses_flow(body2, dict(answer, id="resp_2"), 1010.0))
    t1, t2 = replay.replay_file(path).turns  # lazy: bili sends the agent's bytes
    assert t2.note.startswith("chained: the delta") and t2.body == body2
    whole = head + b"," + _compact(out) + b"," + u2 + b'],"store":true}'
    assert t2.prompt == t2.prompt_sent == whole

    # by hand: OpenAI caches prefixes from 1024 tokens (4096 bytes at 4 a token) in steps of 128 (512
    # bytes) of the prompt it builds (here the items alone: no instructions, no tools; model and store
    # are no prompt); the chain shares turn 1's item; gpt-5 reads at 0.1
    read = len(u1) // 512 * 128
    first, second = len(u1) // 4, len(u1 + b"," + _compact(out) + b"," + u2) // 4
    sc = session_costs([replay.replay_file(path)])[0]
    assert (sc.bill_without.input, sc.bill_without.read) == (first + second - read, read)
    assert sc.without == pytest.approx(first + second - read + 0.1 * read) and sc.with_addon == sc.without

    # bili's side (the whole folded chain, what the live clock bills) against the agent's
    t1, t2 = replay.replay_file(path, activate="always", materialize="now").turns
    assert t2.prompt == whole and t2.prompt_sent != whole and len(t2.prompt_sent) > len(t2.body)
    sc = session_costs([replay.replay_file(path, activate="always", materialize="now")])[0]
    opening, closing = b'{"model":"gpt-5","input":[', b'],"store":true}'  # (no prompt: the items are)
    assert all(b.startswith(opening) and b.endswith(closing) for b in (t1.body, t2.prompt_sent))
    assert sc.bill_with.total == (len(t1.body) - len(opening + closing)) // 4 + \
        (len(t2.prompt_sent) - len(opening + closing)) // 4


# -- a Gemini session's cache is its URL's model's --------------------------------------------------------
def _gemini_flow(contents: list[dict], at: float) -> http.HTTPFlow:
    req = tutils.treq(method=b"POST", path=b"/v1beta/models/gemini-2.5-pro:generateContent",
                      host="generativelanguage.googleapis.com", port=443, scheme=b"https",
                      headers=http.Headers(host="generativelanguage.googleapis.com", content_type="application/json",
                                           x_acp_session="gem-1"), content=_compact({"contents": contents}))
    req.timestamp_start = at
    f = tflow.tflow(req=req)
    f.response = tutils.tresp(headers=http.Headers(content_type="application/json"), content=_compact({
        "candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]}}],
        "usageMetadata": {"promptTokenCount": 2600, "candidatesTokenCount": 1}}))
    return f


def test_a_gemini_sessions_cache_is_its_urls_model(tmp_path):
    """A Gemini body names no model: the live clock and ``--cost`` made the session's cache model for
    the model '' (1024-token minimum, reads at a quarter), not gemini-2.5-pro's (4096, a tenth)."""
    from bili_addon import prices
    from bili_addon.replay_cost import session_costs

    first = [{"role": "user", "parts": [{"text": "word " * 2500}]}]  # ~3100 tokens: under Pro's minimum
    path = tmp_path / "gemini.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        w.add(_gemini_flow(first, 1000.0))
        w.add(_gemini_flow(first + [{"role": "model", "parts": [{"text": "ok"}]},
                                    {"role": "user", "parts": [{"text": "more"}]}], 1010.0))
    p = prices.BUILTIN["gemini-2.5-pro"]
    rep = replay.Replayer(tmp_path / "store")  # the engine the proxy runs: its clock
    report = replay.FileReport(str(path))
    with open(path, "rb") as fh:
        rep.run(report, io.FlowReader(fh).stream())
    rules = rep.engine.clocks.history(report.turns[0].session)[0]
    assert (rules.min_tokens, rules.read) == (4096, pytest.approx(p.cache_read / p.input))
    rep.close()
    assert [t.model for t in report.turns] == ["gemini-2.5-pro"] * 2
    sc = session_costs([replay.replay_file(path)])[0]
    assert sc.model == "gemini-2.5-pro" and sc.bill_without.read == 0 and sc.without == sc.bill_without.input


def test_replay_cost_prices_a_request_over_the_long_context_line_at_its_multiple():
    """Sonnet 4.5's requests over 200K prompt tokens pay 2x on every token: a session whose agent sent
    ~260K and bili ~120K saves that premium too (``--cost`` left it out: half the saving the meter shows)."""
    from types import SimpleNamespace as NS

    from bili_addon.kernel.cache import Clock
    from bili_addon.replay_cost import session_costs

    def body(n: int) -> bytes:
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": f"m{i} " + "x" * 8000}]}
                for i in range(n)]
        msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 1000, "messages": msgs}).encode()

    turns = [NS(lane="anthropic", session="s1", prompt=None, raw=body(130 + 2 * k), body=body(60 + 2 * k),
                prompt_sent=None, model="claude-sonnet-4-5", at=30.0 * k) for k in range(4)]
    [sc] = session_costs([NS(path="long", turns=turns)])
    orig, sent = Clock("anthropic", "claude-sonnet-4-5"), Clock("anthropic", "claude-sonnet-4-5")
    without = with_ = 0.0
    for t in turns:  # by hand: the same clocks, each bill at 2x where its request is over 200K tokens
        a, b = orig.send(t.raw, t.at), sent.send(t.body, t.at)
        assert a.total > 200_000 > b.total
        without += 2 * a.cost(orig.rules)
        with_ += b.cost(sent.rules)
    assert sc.without == pytest.approx(without) and sc.with_addon == pytest.approx(with_)
