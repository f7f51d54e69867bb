"""The real agents, non-interactively, through ``bili <agent>`` against the scripted model.

Each run: the launcher starts the proxy (intercepting only model hosts; a test-only addon routes
them to the scripted model on loopback), the agent runs the script of :mod:`.scripted_model`
(three real shell calls, ``compress`` on an old range, one more shell call, the answer), and the
launcher exits with the agent's code.  Asserted for every agent:

- exit code 0 and the scripted answer on stdout, with no ref tag anywhere in the agent's output;
- the real tool ran (its output came back to the model);
- upstream, the agent's unknown-tool result for ``compress`` was replaced by the real result;
- the request carrying that result, and the one after it, carry the fold (summary in, the folded
  listing out);
- no process is left behind (the proxy's pid, the agent's pid, the launcher's process group);
- the agent's configuration files are byte-identical, mtimes included.

Claude Code, codex and hermes run once more with early fold reminders (``bili_remind_at=1500``), one
agent per lane: the reminder sits right after the tool results of the newest turn, and survives the
agent's replays of its own history byte for byte until a fold takes the output it followed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from churn import strings

from .conftest import PINS, Run, agent_bin_dir, alive, base_env, free_port, run_launcher, snapshot
from .scripted_model import COMPRESS_STAGE, ECHO, FINAL, ScriptedModel, call_id, results_of, tagged

pytestmark = pytest.mark.acceptance

PROMPT = "List the rows step by step as your tools allow, then report."
SUMMARY_MARK = "SUMMARY-MARK-91c2"
AGENT_ERRORS = ("No such tool", "not found", "unsupported call", "does not exist", "invalid", "unavailable")


def _report(run: Run, model: ScriptedModel) -> str:
    reqs = "\n".join(f"  {r.seq} {r.method} {r.host}{r.path} -> {r.status} lane={r.lane} "
                     f"stage={r.action.stage if r.action else '-'}" for r in model.seen)
    return (f"exit {run.rc} after {run.seconds:.1f}s\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-4000:]}"
            f"\n--- scripted model saw\n{reqs}\n--- proxy log (tail)\n" + "\n".join(run.proxy_log.splitlines()[-60:]))


def assert_scripted_run(run: Run, model: ScriptedModel, lane: str, config_before: dict, config_paths: list[Path],
                        mcp: bool = False) -> None:
    info = _report(run, model)
    assert run.rc == 0, info
    assert FINAL in run.stdout, info
    for stream in (run.stdout, run.stderr):
        assert "<acp" not in stream and "</acp>" not in stream, "a ref tag reached the agent's output\n" + info

    reqs = {s: model.by_stage(s) for s in range(1, COMPRESS_STAGE + 3)}
    for s, got in reqs.items():
        assert got, f"the script never reached stage {s}\n{info}"
        assert all(r.lane == lane for r in got), info
    assert "compress" in json.dumps(reqs[COMPRESS_STAGE][-1].json.get("tools")), "compress was not offered upstream"

    # the real tool ran: its output came back
    first = results_of(lane, reqs[2][-1].json)
    assert "alpha-row-001" in first.get(call_id(lane, 1), ""), f"no shell output in {first}\n{info}"

    # the compress result: the real one replaced the agent's unknown-tool error
    carrying = reqs[COMPRESS_STAGE + 1][-1]
    result = results_of(lane, carrying.json).get(call_id(lane, COMPRESS_STAGE), "")
    # (through MCP the agent itself gets the real result, and may wrap it: hermes marks it untrusted)
    assert ("Compressed " in result) if mcp else result.startswith("Compressed "), \
        f"upstream compress result: {result!r}\n{info}"
    assert "→ b1" in result, result
    assert not any(e in result for e in AGENT_ERRORS), result

    # the fold: in the request carrying the result and in the one after it
    for r in (carrying, reqs[COMPRESS_STAGE + 2][-1]):
        text = r.body.decode()
        assert "[Compressed conversation section b1 · " in text, f"request {r.seq} has no fold\n{info}"
        assert SUMMARY_MARK in text, f"request {r.seq} lacks the summary"
        assert "alpha-row-" not in text, f"request {r.seq} still carries the folded listing"
        assert "gamma-row-001" in text, "an unfolded listing went missing"
    before = reqs[COMPRESS_STAGE][-1].body.decode()
    assert "alpha-row-" in before and "[Compressed conversation section b1 · " not in before

    # nothing left behind
    assert run.proxy_pid is not None, info
    assert not alive(run.proxy_pid), f"the proxy (pid {run.proxy_pid}) is still running"
    assert run.agent_pid is not None and not alive(run.agent_pid), f"the agent (pid {run.agent_pid}) is still running"
    assert not run.leftovers, f"processes left in the launcher's group: {run.leftovers}"
    assert "stopped the proxy" in run.stderr, info

    # the agent's configuration: read, never written
    assert snapshot(config_paths) == config_before, "a configuration file changed"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def git_init(cwd: Path) -> None:
    subprocess.run(["git", "init", "-q", str(cwd)], check=True, capture_output=True)


@pytest.fixture
def work(tmp_path):
    home = tmp_path / "home"
    cwd = tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    (cwd / "README.md").write_text("A scratch project for the acceptance run.\n")
    return tmp_path, home, cwd


@pytest.mark.parametrize("remind", [False, True], ids=["plain", "reminders"])
def test_claude_code(model, work, remind):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["claude"], tmp)
    cfg = [_write(home / ".claude" / "settings.json", json.dumps({"env": {"BILI_TEST_MARK": "1"}}, indent=2) + "\n")]
    before = snapshot(cfg)
    env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-bili-acceptance")
    run = run_launcher("claude", ["-p", PROMPT, "--allowedTools", "Bash"], env=env, cwd=cwd, model=model, work=tmp,
                       launcher_args=REMIND if remind else ())
    assert_scripted_run(run, model, "anthropic", before, cfg)
    if remind:
        assert_reminders(run, model, "anthropic")
    # first-party host: system[0] is the billing block, still first upstream
    loop = model.by_stage(COMPRESS_STAGE + 1)[-1].json
    assert loop["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert all(r.host.startswith("api.anthropic.com") for r in model.model_requests())


REMIND = ["--set", "bili_remind_at=1500"]  # early reminders: the listings are ~1.2K tokens each
# codex's built-in provider keeps its WebSocket through bili (tests/acceptance/test_codex_websocket.py);
# this script picks its compress range from the ref tags on the model's own earlier prose, which a
# chained turn never shows (the provider holds the answers as the model wrote them), so codex runs
# it on the HTTP fallback the option forces (426, then the full history every turn)
HTTP_FALLBACK = ["--set", "bili_refuse_websocket=true"]
CONV_KEY = {"anthropic": "messages", "chat": "messages", "responses": "input"}


def assert_reminders(run: Run, model: ScriptedModel, lane: str) -> None:
    """A fold reminder reached the model on the newest turn, right after the tool results; every
    later request carries it again, byte for byte (the agent replays its own history, the addon
    puts the reminder back), until a fold takes the tool output it was given after."""
    reqs = [r for r in model.model_requests() if r.json.get("tools")]

    def notes(r) -> list[str]:
        return [t for t in strings(r.json[CONV_KEY[lane]]) if t.startswith("[bili] ~")]

    first = next((k for k, r in enumerate(reqs) if notes(r)), None)
    assert first is not None, "no reminder reached the model\n" + _report(run, model)
    [note] = notes(reqs[first])
    conv = reqs[first].json[CONV_KEY[lane]]
    last, before = json.dumps(conv[-1]), json.dumps(conv[-2])
    if lane == "anthropic":  # inside the user turn, after its tool results (as Claude Code adds its own)
        assert '"tool_result"' in last and note in strings(conv[-1]["content"][-1]), last[:300]
    elif lane == "chat":  # a user message of its own after the tool message
        assert conv[-1] == {"role": "user", "content": note} and '"role": "tool"' in before, (before[:200], last[:300])
    else:  # a user input item of its own after the function call's output
        assert conv[-1]["role"] == "user" and note in strings(conv[-1]) and '"function_call_output"' in before, (
            before[:200], last[:300])
    output = last if lane == "anthropic" else before
    [listing] = [f"{w}-row-001" for w in ("alpha", "beta", "gamma", "delta") if f"{w}-row-001" in output]
    for later in reqs[first + 1:]:
        count = sum(t == note for t in strings(later.json[CONV_KEY[lane]]))
        if later.action.stage <= COMPRESS_STAGE:
            assert count == 1, f"request {later.seq} lost the reminder\n" + _report(run, model)
        else:  # the fold (of the first two listings) took it along with its output, or it stays
            assert count == (1 if listing in later.body.decode() else 0), (later.seq, listing)
    assert "[bili] ~" not in run.stdout


def test_claude_code_first_party_observe(model, work):
    """--first-party observe: Claude Code's api.anthropic.com bodies reach the model as the agent sent them."""
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["claude"], tmp)
    env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-bili-acceptance")
    run = run_launcher("claude", ["-p", PROMPT, "--allowedTools", "Bash"], env=env, cwd=cwd, model=model, work=tmp,
                       launcher_args=["--first-party", "observe"])
    info = _report(run, model)
    assert run.rc == 0 and FINAL in run.stdout, info
    loop = [r for r in model.seen if r.lane == "anthropic"]
    assert len(loop) >= COMPRESS_STAGE + 1, info
    for r in loop:
        # no tag rendered by the proxy; the only tags are the model's own imitations, which observe
        # mode does not filter out of the answers either (so Claude Code stored and re-sent them)
        assert all(s.startswith(ECHO) for s in strings(r.json) if s.startswith("<acp ")), f"request {r.seq} was changed"
        assert "Context folding" not in r.body.decode(), f"request {r.seq} got bili's prompt"
        assert "compress" not in {t.get("name") for t in r.json.get("tools") or []}
        assert r.json["system"][0]["text"].startswith("x-anthropic-billing-header:")
    # the scripted model called compress anyway: Claude Code itself answered that it has no such tool
    unknown = results_of("anthropic", model.by_stage(COMPRESS_STAGE + 1)[-1].json)[call_id("anthropic", COMPRESS_STAGE)]
    assert "No such tool" in unknown
    assert "[bili] session=" in run.proxy_log  # still recorded in the ledger
    assert run.proxy_pid is not None and not alive(run.proxy_pid) and not run.leftovers


@pytest.mark.parametrize("remind", [False, True], ids=["plain", "reminders"])
def test_codex(model, work, remind):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["codex"], tmp)
    cfg = [_write(home / ".codex" / "config.toml", 'model = "gpt-5.1-codex"\n')]
    before = snapshot(cfg)
    env = base_env(home, bins, CODEX_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))
    run = run_launcher("codex", ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT],
                       env=env, cwd=cwd, model=model, work=tmp,
                       launcher_args=[*HTTP_FALLBACK, *(REMIND if remind else ())])
    assert_scripted_run(run, model, "responses", before, cfg)
    if remind:
        assert_reminders(run, model, "responses")
    # asked to (bili_refuse_websocket), the proxy refused the WebSocket (426) and it never reached
    # the model; codex fell back to HTTP POST with its full history every turn
    assert "refused a WebSocket upgrade" in run.proxy_log, _report(run, model)
    assert not any("upgrade" in {k.lower() for k in r.headers} for r in model.seen)
    for r in model.model_requests():
        assert r.method == "POST" and r.path.split("?")[0].endswith("/responses")
        assert "previous_response_id" not in r.json
        assert PROMPT in r.body.decode(), "a request without the full history"


def test_pi(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["pi"], tmp)
    models = {"providers": {"scripted": {
        "baseUrl": "https://llm.pi.bili-test.invalid/v1", "api": "openai-completions", "apiKey": "sk-fake-pi",
        "models": [{"id": "gpt-scripted", "contextWindow": 200000, "maxTokens": 8000}]}}}
    cfg = [_write(home / ".pi" / "agent" / "models.json", json.dumps(models, indent=2) + "\n")]
    before = snapshot(cfg)
    env = base_env(home, bins)
    run = run_launcher("pi", ["-p", "--model", "scripted/gpt-scripted", PROMPT], env=env, cwd=cwd, model=model, work=tmp)
    assert_scripted_run(run, model, "chat", before, cfg)
    # the custom base URL's host was read from models.json and intercepted
    assert all(r.host.startswith("llm.pi.bili-test.invalid") for r in model.model_requests())


def test_opencode(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["opencode"], tmp)
    git_init(cwd)
    conf = {"$schema": "https://opencode.ai/config.json",
            "provider": {"anthropic": {"options": {"baseURL": "https://anthropic.oc.bili-test.invalid/v1",
                                                   "apiKey": "sk-ant-fake-opencode"}}},
            "model": "anthropic/claude-sonnet-4-5"}
    cfg = [_write(cwd / "opencode.json", json.dumps(conf, indent=2) + "\n")]
    before = snapshot(cfg)
    env = base_env(home, bins)
    run = run_launcher("opencode", ["run", PROMPT], env=env, cwd=cwd, model=model, work=tmp)
    assert_scripted_run(run, model, "anthropic", before, cfg)
    assert all(r.host.startswith("anthropic.oc.bili-test.invalid") for r in model.model_requests())


def test_omp(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["omp"], tmp)
    git_init(cwd)
    cfg = [_write(home / ".omp" / "agent" / "models.yml", "providers: {}\n")]
    before = snapshot(cfg)
    env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-omp")
    run = run_launcher("omp", ["-p", "--model", "anthropic/claude-sonnet-4-5", PROMPT], env=env, cwd=cwd,
                       model=model, work=tmp)
    assert_scripted_run(run, model, "anthropic", before, cfg)
    # the built-in anthropic transport only goes through the proxy with PI_PROXY, which bili sets
    assert all(r.host.startswith("api.anthropic.com") for r in model.model_requests())


@pytest.mark.parametrize("remind", [False, True], ids=["plain", "reminders"])
def test_hermes(model, work, remind):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["hermes"], tmp)
    conf = ("model:\n  provider: custom:scripted\n  default: gpt-scripted\n"
            "providers:\n  scripted:\n    base_url: https://llm.hermes.bili-test.invalid/v1\n"
            "    api_key: sk-fake-hermes\n    api_mode: chat_completions\n    default_model: gpt-scripted\n")
    cfg = [_write(home / ".hermes" / "config.yaml", conf)]
    before = snapshot(cfg)
    env = base_env(home, bins)
    run = run_launcher("hermes", ["-z", PROMPT, "--provider", "scripted", "-m", "gpt-scripted"], env=env, cwd=cwd,
                       model=model, work=tmp, launcher_args=REMIND if remind else ())
    assert_scripted_run(run, model, "chat", before, cfg)
    if remind:
        assert_reminders(run, model, "chat")
    assert all(r.host.startswith("llm.hermes.bili-test.invalid") for r in model.model_requests())


# -- the MCP variant: bili's tools as the agent's own (bili mcp), the proxy still in the path ------------
MCP_SERVER = [sys.executable, "-m", "bili_addon.cli", "mcp"]


def assert_mcp_tools(model: ScriptedModel, lane: str, name: str) -> None:
    """The model saw bili's compress once, as the agent's MCP tool, and called it by that name."""
    from .scripted_model import tools_of

    req = model.by_stage(COMPRESS_STAGE)[-1]
    names = set(tools_of(lane, req.json))
    assert name in names and "compress" not in names, sorted(names)
    assert req.action.tool == name


def test_claude_code_mcp(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["claude"], tmp)
    mcp = _write(cwd / "bili-mcp.json", json.dumps({"mcpServers": {"bili": {"command": MCP_SERVER[0],
                                                                            "args": MCP_SERVER[1:]}}}))
    before = snapshot([mcp])
    # first-party Claude Code defers MCP tools behind its ToolSearch tool; list them up front
    env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-bili-acceptance", ENABLE_TOOL_SEARCH="false")
    run = run_launcher("claude", ["-p", PROMPT, "--mcp-config", str(mcp), "--allowedTools", "Bash,mcp__bili__compress"],
                       env=env, cwd=cwd, model=model, work=tmp)
    assert_scripted_run(run, model, "anthropic", before, [mcp], mcp=True)
    assert_mcp_tools(model, "anthropic", "mcp__bili__compress")


def test_codex_mcp(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["codex"], tmp)
    args = ", ".join(json.dumps(a) for a in MCP_SERVER[1:])
    cfg = [_write(home / ".codex" / "config.toml", f'model = "gpt-5.1-codex"\n\n[mcp_servers.bili]\n'
                                                   f'command = {json.dumps(MCP_SERVER[0])}\nargs = [{args}]\n')]
    before = snapshot(cfg)
    env = base_env(home, bins, CODEX_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))
    run = run_launcher("codex", ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT],
                       env=env, cwd=cwd, model=model, work=tmp, launcher_args=HTTP_FALLBACK)
    assert_scripted_run(run, model, "responses", before, cfg)
    tools = model.by_stage(COMPRESS_STAGE)[-1].json["tools"]
    spaces = {t.get("name"): [x.get("name") for x in t.get("tools", [])] for t in tools if t.get("type") == "namespace"}
    assert "compress" in spaces.get("mcp__bili", []), spaces  # codex offers bili mcp's tools, namespaced
    # codex nests MCP tools in {"type": "namespace", "name": "mcp__bili", "tools": [...]}: the proxy
    # sees them as native and injects no copies of its own
    assert not any(t.get("name") == "compress" for t in tools), [t.get("name") for t in tools]


def test_opencode_mcp(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["opencode"], tmp)
    git_init(cwd)
    conf = {"$schema": "https://opencode.ai/config.json",
            "provider": {"anthropic": {"options": {"baseURL": "https://anthropic.oc.bili-test.invalid/v1",
                                                   "apiKey": "sk-ant-fake-opencode"}}},
            "model": "anthropic/claude-sonnet-4-5",
            "mcp": {"bili": {"type": "local", "command": MCP_SERVER}}}
    cfg = [_write(cwd / "opencode.json", json.dumps(conf, indent=2) + "\n")]
    before = snapshot(cfg)
    run = run_launcher("opencode", ["run", PROMPT], env=base_env(home, bins), cwd=cwd, model=model, work=tmp)
    assert_scripted_run(run, model, "anthropic", before, cfg, mcp=True)
    assert_mcp_tools(model, "anthropic", "bili_compress")


def test_hermes_mcp(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["hermes"], tmp)
    port = free_port()
    # hermes starts MCP servers with a filtered environment (no BILI_PROXY, no BILI_DATA_DIR): name the
    # proxy and its data dir (where its admin token is) in the args
    args = [*MCP_SERVER[1:], "--proxy", f"http://127.0.0.1:{port}", "--data-dir", str(tmp / "data")]
    conf = ("model:\n  provider: custom:scripted\n  default: gpt-scripted\n"
            "providers:\n  scripted:\n    base_url: https://llm.hermes.bili-test.invalid/v1\n"
            "    api_key: sk-fake-hermes\n    api_mode: chat_completions\n    default_model: gpt-scripted\n"
            f"mcp_servers:\n  bili:\n    command: {json.dumps(MCP_SERVER[0])}\n    args: {json.dumps(args)}\n")
    cfg = [_write(home / ".hermes" / "config.yaml", conf)]
    before = snapshot(cfg)
    run = run_launcher("hermes", ["-z", PROMPT, "--provider", "scripted", "-m", "gpt-scripted"], env=base_env(home, bins),
                       cwd=cwd, model=model, work=tmp, port=port)
    assert_scripted_run(run, model, "chat", before, cfg, mcp=True)
    assert_mcp_tools(model, "chat", "mcp__bili__compress")


# -- forks (#15): the agent's own fork command, after a fold --------------------------------------
def _header(rec, name: str) -> str | None:
    return next((v for k, v in rec.headers.items() if k.lower() == name), None)


def run_fork(model, first: Run, fork_cmd, lane: str, header: str) -> None:
    """``fork_cmd(parent_id)`` runs the agent's fork of the conversation ``first`` ran.  The fork's
    first request carries the parent's fold, the parent's compress result byte for byte and the
    parent's refs; the proxy logs it as a fork of the parent."""
    assert first.rc == 0 and FINAL in first.stdout, _report(first, model)
    parent_last = model.by_stage(COMPRESS_STAGE + 2)[-1]  # the final turn: the fold, the result, the refs
    parent_id = _header(parent_last, header)
    assert parent_id, f"no {header} header"
    n = len(model.seen)
    fork = fork_cmd(parent_id)
    info = _report(fork, model)
    assert fork.rc == 0, info
    mine = [r for r in model.seen[n:] if r.action is not None and r.action.stage == COMPRESS_STAGE + 2]
    assert mine, info
    child = mine[0]
    child_id = _header(child, header)
    assert child_id and child_id != parent_id, "the fork kept the parent's conversation id"
    text = child.body.decode()
    assert "[Compressed conversation section b1 · " in text and SUMMARY_MARK in text, info
    assert "alpha-row-" not in text and "gamma-row-001" in text
    cid = call_id(lane, COMPRESS_STAGE)
    result = results_of(lane, child.json).get(cid, "")
    assert result.startswith("Compressed ") and result == results_of(lane, parent_last.json)[cid]
    parent_refs, child_refs = tagged(parent_last.json), tagged(child.json)
    assert parent_refs and all(child_refs.get(t) == r for t, r in parent_refs.items()), (parent_refs, child_refs)
    assert f"session={child_id}: a fork of {parent_id}" in fork.proxy_log, fork.proxy_log[-3000:]


def test_claude_code_fork_keeps_the_fold(model, work):
    """``claude -p --resume <id> --fork-session``: a new conversation id with the stored history."""
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["claude"], tmp)
    env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-bili-acceptance")
    first = run_launcher("claude", ["-p", PROMPT, "--allowedTools", "Bash"], env=env, cwd=cwd, model=model, work=tmp)
    run_fork(model, first, lambda pid: run_launcher(
        "claude", ["-p", "--resume", pid, "--fork-session", "Now say it once more.", "--allowedTools", "Bash"],
        env=env, cwd=cwd, model=model, work=tmp), "anthropic", "x-claude-code-session-id")


def test_codex_fork_keeps_the_fold(model, work):
    """``codex exec fork <id>``: a new session with the stored history."""
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["codex"], tmp)
    _write(home / ".codex" / "config.toml", 'model = "gpt-5.1-codex"\n')
    env = base_env(home, bins, CODEX_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))
    flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    first = run_launcher("codex", ["exec", *flags, PROMPT], env=env, cwd=cwd, model=model, work=tmp,
                         launcher_args=HTTP_FALLBACK)
    run_fork(model, first, lambda pid: run_launcher(
        "codex", ["exec", *flags, "fork", pid, "Now say it once more."], env=env, cwd=cwd, model=model, work=tmp,
        launcher_args=HTTP_FALLBACK), "responses", "session-id")


def test_opencode_fork_keeps_the_fold(model, work):
    """``opencode run --continue --fork``: the last session forked into a new one."""
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["opencode"], tmp)
    git_init(cwd)
    conf = {"$schema": "https://opencode.ai/config.json",
            "provider": {"anthropic": {"options": {"baseURL": "https://anthropic.oc.bili-test.invalid/v1",
                                                   "apiKey": "sk-ant-fake-opencode"}}},
            "model": "anthropic/claude-sonnet-4-5"}
    _write(cwd / "opencode.json", json.dumps(conf, indent=2) + "\n")
    env = base_env(home, bins)
    first = run_launcher("opencode", ["run", PROMPT], env=env, cwd=cwd, model=model, work=tmp)
    run_fork(model, first, lambda _pid: run_launcher(
        "opencode", ["run", "--continue", "--fork", "Now say it once more."], env=env, cwd=cwd, model=model,
        work=tmp), "anthropic", "x-session-affinity")


def test_pi_fork_and_return_keep_the_idless_session(model, work):
    """pi's Chat lane carries no conversation id (#20): ``pi --fork`` continues the folded history,
    and going back to the original session afterwards (an earlier point of the same history) keeps
    the session, its fold, its compress result and its refs."""
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["pi"], tmp)
    models = {"providers": {"scripted": {
        "baseUrl": "https://llm.pi.bili-test.invalid/v1", "api": "openai-completions", "apiKey": "sk-fake-pi",
        "models": [{"id": "gpt-scripted", "contextWindow": 200000, "maxTokens": 8000}]}}}
    _write(home / ".pi" / "agent" / "models.json", json.dumps(models, indent=2) + "\n")
    env = base_env(home, bins)
    sessions = tmp / "pi-sessions"
    base = ["--session-dir", str(sessions), "--model", "scripted/gpt-scripted"]
    first = run_launcher("pi", [*base, "-p", PROMPT], env=env, cwd=cwd, model=model, work=tmp)
    assert first.rc == 0 and FINAL in first.stdout, _report(first, model)
    files = sorted(sessions.rglob("*.jsonl"))
    assert len(files) == 1, files
    parent_last = model.by_stage(COMPRESS_STAGE + 2)[-1]
    runs = []
    for args in (["--fork", str(files[0]), "-p", "Now say it once more."],
                 ["--session", str(files[0]), "-p", "And once again, in the original session."]):
        n = len(model.seen)
        run = run_launcher("pi", [*base, *args], env=env, cwd=cwd, model=model, work=tmp)
        assert run.rc == 0, _report(run, model)
        got = [r for r in model.seen[n:] if r.action is not None and r.action.stage == COMPRESS_STAGE + 2]
        assert got, _report(run, model)
        runs.append((run, got[0]))
    cid = call_id("chat", COMPRESS_STAGE)
    parent_refs = tagged(parent_last.json)
    for run, req in runs:
        text = req.body.decode()
        assert "[Compressed conversation section b1 · " in text and SUMMARY_MARK in text, _report(run, model)
        assert "alpha-row-" not in text
        assert results_of("chat", req.json).get(cid) == results_of("chat", parent_last.json)[cid]
        refs = tagged(req.json)
        assert all(refs.get(t) == r for t, r in parent_refs.items()), (parent_refs, refs)
    # the original session's request goes back to a point before the fork's turn: the same session
    sids = [set(re.findall(r"\[bili\] session=(\S+) lane=chat", run.proxy_log)) for run in (first, *[r for r, _ in runs])]
    assert len(sids[0]) == 1 and all(s == sids[0] for s in sids), sids
