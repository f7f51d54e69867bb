"""Codex over its own transport: Responses over a WebSocket, through ``bili codex`` (fold mode).

Codex's built-in OpenAI provider opens ``wss://api.openai.com/v1/responses`` and sends one
``response.create`` frame per turn: the new items only, chained by ``previous_response_id`` to a
response of the same connection (``store: false``).  The scripted model (:mod:`.marathon_model`,
speaking WebSocket with the chains of the real API) answers bili's fold reminders with ``compress``.
Asserted: the upgrade is accepted (no 426), the session runs 8+ turns over the socket and folds,
the model sees the whole folded input (no ``previous_response_id``) exactly on the turns where a
fold landed and the agent's deltas on every other turn, codex exits 0 with the expected answer.
"""

from __future__ import annotations

import pytest

from .conftest import PINS, agent_bin_dir, base_env, run_launcher
from .marathon_model import TASK, MarathonModel

pytestmark = pytest.mark.acceptance

FLAGS = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
OPTS = ["--set", "bili_remind_at=2500"]


@pytest.fixture
def work(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    return tmp_path, home, cwd


def _codex_env(home, bins):
    conf = home / ".codex" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text('model = "gpt-5.1-codex"\n')
    return base_env(home, bins, CODEX_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))


def _report(run, model) -> str:
    rows = []
    for r in model.seen:
        f = r.frame if isinstance(r.frame, dict) else {}
        rows.append(f"  {r.seq} {r.transport} {r.method} {r.path} -> {r.status} conn={r.conversation_id} "
                    f"prev={f.get('previous_response_id')} items={len(f.get('input') or [])} "
                    f"kind={model.log[[e['seq'] for e in model.log].index(r.seq)]['kind'] if r.seq in [e['seq'] for e in model.log] else '-'}")
    return (f"exit {run.rc} after {run.seconds:.1f}s\n--- stdout\n{run.stdout[-2000:]}\n--- stderr\n{run.stderr[-3000:]}"
            "\n--- model saw\n" + "\n".join(rows) + "\n--- proxy log (tail)\n"
            + "\n".join(ln[:400] for ln in run.proxy_log.splitlines()[-80:]))


def test_codex_websocket_explore(work):
    tmp, home, cwd = work
    model = MarathonModel(steps=9, output_kb=3).start()
    try:
        env = _codex_env(home, agent_bin_dir(PINS["codex"], tmp))
        run = run_launcher("codex", [*FLAGS, TASK], env=env, cwd=cwd, model=model, work=tmp,
                           launcher_args=OPTS)
        print(_report(run, model))
        assert False
    finally:
        model.stop()


def test_codex_websocket_dump(work):
    import json
    tmp, home, cwd = work
    model = MarathonModel(steps=3, output_kb=1).start()
    try:
        env = _codex_env(home, agent_bin_dir(PINS["codex"], tmp))
        run = run_launcher("codex", [*FLAGS, TASK], env=env, cwd=cwd, model=model, work=tmp,
                           launcher_args=OPTS)
        for r in model.seen:
            if r.transport == "ws":
                f = dict(r.frame)
                f.pop("tools", None)
                for it in f.get("input") or []:
                    for c in it.get("content") or []:
                        if isinstance(c, dict) and len(c.get("text", "")) > 200:
                            c["text"] = c["text"][:200] + "..."
                    if isinstance(it.get("output"), str):
                        it["output"] = it["output"][:200]
                print(r.seq, json.dumps(f, indent=1)[:3000])
        assert False
    finally:
        model.stop()
