"""Codex on its own transport: Responses over a WebSocket, through ``bili codex`` in fold mode.

Codex's built-in OpenAI provider opens ``wss://api.openai.com/v1/responses`` and sends one
``response.create`` frame per turn: a warm-up (``generate: false``), then only the new items of each
turn, chained by ``previous_response_id`` to the newest response of the same connection
(``store: false``).  The scripted model (:mod:`.marathon_model`, speaking WebSocket with the chains
of the real API: an id the connection never answered is ``previous_response_not_found``) runs shell
steps and answers bili's fold reminders with ``compress``.  Asserted:

- the upgrade is accepted (no 426) and every model turn goes over the socket (no HTTP fallback);
- a session of 8+ turns folds; the model gets the whole folded input, without
  ``previous_response_id``, exactly on the turns where a fold landed, and the agent's delta on
  every other turn (the first turn of a new connection excepted: its chain lives on the old one;
  with lazy activation, the default, also the turn bili activates on: its tags change the history);
- codex exits 0 with the expected answer, with no ref tag in its output;
- the same across a proxy restart in the middle of the session (codex sits in a tool call while the
  proxy is stopped and started again on the same port and store): codex reconnects and, its chain
  having lived on the old connection, sends its whole history; the new proxy folds it from the
  session in its store, and the turns after it are deltas again.  (A delta continuing a chain made
  before the restart is rebuilt from the transcript in the store: tests/e2e/test_websocket_chains_e2e.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bili_addon.launch import probe, state_dir

from .conftest import PINS, Run, agent_bin_dir, alive, base_env, free_port, run_launcher
from .marathon_model import TASK, MarathonModel

pytestmark = pytest.mark.acceptance

FLAGS = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
OPTS = ["--set", "bili_remind_at=2500"]  # listings of ~3 KB: a reminder every few turns
SUMMARY = "[Compressed conversation section b"


@pytest.fixture
def work(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    return tmp_path, home, cwd


def codex_env(home: Path, bins: Path) -> dict[str, str]:
    """The built-in OpenAI provider (its default transport is the WebSocket)."""
    conf = home / ".codex" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text('model = "gpt-5.1-codex"\n')
    return base_env(home, bins, CODEX_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))


def turns(model: MarathonModel) -> list:
    """The model's WebSocket turns (warm-ups and refused frames excepted), in order."""
    return [r for r in model.seen if r.transport == "ws" and r.action is not None]


def kind_of(model: MarathonModel, rec) -> str:
    return next((e["kind"] for e in model.log if e["seq"] == rec.seq), "-")


def report(run: Run, model: MarathonModel) -> str:
    rows = []
    for r in model.seen:
        f = r.frame if isinstance(r.frame, dict) else {}
        rows.append(f"  {r.seq} {r.transport} {r.method} {r.path} -> {r.status} conn={r.conversation_id} "
                    f"prev={f.get('previous_response_id')} items={len(f.get('input') or [])} "
                    f"warmup={f.get('generate') is False} kind={kind_of(model, r)}")
    return (f"exit {run.rc} after {run.seconds:.1f}s\n--- stdout\n{run.stdout[-1500:]}\n--- stderr\n"
            f"{run.stderr[-2500:]}\n--- model saw\n" + "\n".join(rows) + "\n--- proxy log (bili lines, tail)\n"
            + "\n".join(ln[:300] for ln in run.proxy_log.splitlines() if "WebSocket text message" not in ln)[-6000:])


def compress_ids(model: MarathonModel) -> list[str]:
    """The call ids of the model's compress calls, in order."""
    return [f"call_bili_s{r.action.stage}" for r in turns(model) if r.action.tool == "compress"]


def carries(rec, call_id: str) -> bool:
    return any(isinstance(it, dict) and it.get("type") == "function_call_output" and it.get("call_id") == call_id
               for it in rec.json["input"])


def check_run(run: Run, model: MarathonModel, connections: int, lazy: bool = False) -> tuple[list, list]:
    """The assertions every run shares; returns (the turns, the indices of the turns a fold landed on).
    ``lazy``: lazy activation, whose first active turn (bili's tools, prompt and tags arrive, so the
    history already sent changes) goes up whole too."""
    info = report(run, model)
    assert run.rc == 0, info
    assert "MARATHON-DONE" in run.stdout, info
    # (the scripted model imitates a ref tag in all its prose; before lazy activation the answers are
    # the agent's own business and pass unchanged: then only the final answer, on stdout, is checked)
    for stream in (run.stdout, run.stderr) if not lazy else (run.stdout,):
        assert "<acp" not in stream and "</acp>" not in stream, "a ref tag reached the agent\n" + info
    # the socket was kept: no 426, no fallback to HTTP POST with the full history
    assert "refused a WebSocket upgrade" not in run.proxy_log, info
    assert not [r for r in model.seen if r.transport == "http" and r.lane], info
    got = turns(model)
    assert len(got) >= 8, info
    assert {r.conversation_id for r in got} == set(range(1, connections + 1)), info
    assert all(r.status == 200 for r in model.seen if r.transport == "ws"), info  # no unknown chain went up
    calls = compress_ids(model)
    assert calls, "the model never folded\n" + info
    # the turn a fold landed on: the first to carry the output of a compress call (executed by the
    # proxy: its result, not codex's "unknown tool")
    landed = []
    for cid in calls:
        i = next(i for i, r in enumerate(got) if carries(r, cid))
        out = next(it["output"] for it in got[i].json["input"]
                   if it.get("type") == "function_call_output" and it.get("call_id") == cid)
        assert "compressed" in out.lower() and "unsupported call" not in out, out
        landed.append(i)
    firsts = {next(i for i, r in enumerate(got) if r.conversation_id == c) for c in range(1, connections + 1)}
    active = next(i for i, r in enumerate(got) if any(t.get("name") == "compress" for t in r.frame.get("tools", [])))
    if lazy:
        assert active > 0 and active not in landed and "active from now on" in run.proxy_log, info
        assert got[active].frame.get("previous_response_id") is None, info  # activation re-tags the history
        assert "[bili] " in json.dumps(got[active].frame["input"]), info  # the first reminder rides along
    for i, r in enumerate(got):
        prev = r.frame.get("previous_response_id")
        if lazy and i == active:
            continue
        if i in landed:
            # the whole folded input, no previous_response_id: the provider's chain starts afresh
            assert prev is None, f"turn {i}: a fold landed but a delta went up\n{info}"
            text = json.dumps(r.json["input"])
            assert SUMMARY in text and "listing-1-row-00001" not in text, f"turn {i}: not folded\n{info}"
        elif i not in firsts or i == 0:
            # nothing in the history already sent changed: the agent's delta on its own chain
            assert prev is not None, f"turn {i}: the whole input went up though no fold landed\n{info}"
            assert len(r.frame["input"]) < len(r.json["input"]), f"turn {i}: not a delta\n{info}"
            if i:  # on the newest response of its connection
                assert prev == f"resp_scripted{got[i - 1].seq:05d}", f"turn {i}\n{info}"
    return got, landed


@pytest.mark.parametrize("activate", ["always", "lazy"])
def test_codex_keeps_its_websocket_and_folds(work, activate):
    tmp, home, cwd = work
    model = MarathonModel(steps=10, output_kb=3).start()
    try:
        env = codex_env(home, agent_bin_dir(PINS["codex"], tmp))
        run = run_launcher("codex", [*FLAGS, TASK], env=env, cwd=cwd, model=model, work=tmp,
                           launcher_args=[*OPTS, "--set", f"bili_activate={activate}"])
        got, landed = check_run(run, model, connections=1, lazy=activate == "lazy")
        info = report(run, model)
        # the warm-up went up first on the same connection, and the first turn chained onto it
        warm = [r for r in model.seen if r.transport == "ws" and r.frame.get("generate") is False]
        assert warm and warm[0].seq < got[0].seq, info
        assert got[0].frame.get("previous_response_id") == f"resp_scripted{warm[0].seq:05d}", info
        assert "chained turn on" in run.proxy_log and "delta forwarded on the provider's chain" in run.proxy_log
        whole = len(landed) + (activate == "lazy")
        assert run.proxy_log.count("whole input sent without previous_response_id") == whole, info
        assert run.proxy_pid is not None and not alive(run.proxy_pid) and not run.leftovers
    finally:
        model.stop()


# -- a proxy restart in the middle of the session ----------------------------------------------------


class GatedMarathon(MarathonModel):
    """A marathon whose step ``at`` runs a shell command that waits for a file: the test restarts
    the proxy while codex sits in that tool call, then lets it go on."""

    def __init__(self, *a, at: int, gate_dir: Path, **kw):
        super().__init__(*a, **kw)
        self.at, self.started, self.gate = at, gate_dir / "tool-started", gate_dir / "proxy-restarted"

    def answer(self, rec):
        out = super().answer(rec)
        a = rec.action
        if a is not None and a.kind == "tool" and a.stage == self.at and a.tool != "compress":
            key = next(iter(a.args))
            wait = f"touch {self.started}; while [ ! -e {self.gate} ]; do sleep 0.1; done; "
            cmd = a.args[key]
            a.args[key] = cmd[:-1] + [wait + cmd[-1]] if isinstance(cmd, list) else wait + cmd
            status, ctype, _body = out
            from .scripted_model import responses_answer

            return status, *responses_answer(rec.seq, rec.json.get("model") or "scripted", a, True,
                                             len(rec.body) // 4)
        return out


def restart_proxy(env: dict[str, str], port: int, started: Path, gate: Path, errors: list[str]) -> None:
    """Once codex sits in the gated tool call: stop the launcher's proxy, start the same command on
    the same port (same store), hand it to the launcher (its owner file) and open the gate."""
    try:
        deadline = time.monotonic() + 200
        while not started.exists():
            if time.monotonic() > deadline:
                errors.append("codex never reached the gated step")
                return
            time.sleep(0.1)
        owner = state_dir(env) / f"proxy-{port}.json"
        old = json.loads(owner.read_text())["pid"]
        cmd = Path(f"/proc/{old}/cmdline").read_bytes().split(b"\0")[:-1]
        penv = dict(x.split(b"=", 1) for x in Path(f"/proc/{old}/environ").read_bytes().split(b"\0") if b"=" in x)
        cwd = os.readlink(f"/proc/{old}/cwd")
        os.killpg(old, signal.SIGTERM)
        while alive(old):
            time.sleep(0.05)
        log = open(state_dir(env) / f"proxy-{port}.log", "ab")
        log.write(b"==== restarted by the test\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=penv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        while probe(port).kind != "bili":
            if proc.poll() is not None or time.monotonic() > deadline:
                errors.append(f"the restarted proxy did not come up ({proc.poll()})")
                return
            time.sleep(0.1)
        owner.write_text(json.dumps({"pid": proc.pid, "port": port, "launcher": json.loads(owner.read_text())
                                     .get("launcher") if owner.exists() else None, "started": time.time()}))
    except Exception as e:  # reported by the test
        errors.append(repr(e))
    finally:
        gate.touch()


def test_codex_keeps_its_websocket_across_a_proxy_restart(work):
    tmp, home, cwd = work
    gates = tmp / "gates"
    gates.mkdir()
    model = GatedMarathon(steps=12, output_kb=3, at=9, gate_dir=gates).start()
    try:
        env = codex_env(home, agent_bin_dir(PINS["codex"], tmp))
        port, errors = free_port(), []
        helper = threading.Thread(target=restart_proxy, args=(env, port, gates / "tool-started",
                                                              gates / "proxy-restarted", errors), daemon=True)
        helper.start()
        run = run_launcher("codex", [*FLAGS, TASK], env=env, cwd=cwd, model=model, work=tmp, launcher_args=OPTS,
                           port=port)
        helper.join(timeout=30)
        info = report(run, model)
        assert not errors, f"{errors}\n{info}"
        assert "restarted by the test" in run.proxy_log, info
        got, landed = check_run(run, model, connections=2)
        # a fold landed before the restart, and folding went on after it
        first2 = next(i for i, r in enumerate(got) if r.conversation_id == 2)
        assert any(i < first2 for i in landed), info
        # the first turn on the new connection: its chain lived on the old one, so codex sends its
        # whole history; the new proxy folds it from the session in its store (the summary in,
        # the folded listing out), and the next turns chain on it as deltas again
        r = got[first2]
        assert r.frame.get("previous_response_id") is None, info
        text = json.dumps(r.frame["input"])
        assert SUMMARY in text and "listing-1-row-00001" not in text, info
        after = run.proxy_log[run.proxy_log.index("restarted by the test"):]
        assert "delta forwarded on the provider's chain" in after, info
        assert len(got) - first2 >= 3, info
        assert run.proxy_pid is not None and not run.leftovers
    finally:
        model.stop()
