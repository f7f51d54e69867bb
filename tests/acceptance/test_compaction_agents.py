"""The real agents compact their own history through ``bili <agent>``, and folding goes on.

Each run drives the agent through a marathon (:mod:`.marathon_model`: shell steps of ~4 KB, the
model reporting the real prompt size) with a low compaction threshold, so the agent compacts within
a minute.  The model answers bili's first reminder (one fold, b1) and then no more until the agent
has compacted; after the compaction it folds whenever bili reminds it.  Asserted: the agent
compacted; bili recognised it as a new epoch of the same session (b1 retired, never the "no longer
matches any fold" pause); bili reminded and folded again in the new epoch; the run ended normally.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import PINS, agent_bin_dir, base_env, run_launcher
from .marathon_model import TASK, MarathonModel

pytestmark = pytest.mark.acceptance

# lazy activation (the default) with real agents: bili's tools arrive with its first reminder
REMIND = ["--set", "bili_remind_at=3000", "--set", "bili_activate=lazy"]


@pytest.fixture
def work(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    return tmp_path, home, cwd


def check(run, model: MarathonModel, agent: str) -> None:
    kinds = [e["kind"] for e in model.log]
    info = (f"exit {run.rc}\n--- requests\n{kinds}\n--- stderr\n{run.stderr[-2000:]}\n--- proxy log (tail)\n"
            + "\n".join(ln[:300] for ln in run.proxy_log.splitlines()[-40:]))
    assert run.rc == 0, info
    assert "MARATHON-DONE" in run.stdout, info
    first = kinds.index("compaction") if "compaction" in kinds else -1
    assert first > 0, "the agent never compacted\n" + info
    assert "compress" in kinds[:first], "no fold before the compaction\n" + info
    assert "compress" in kinds[first:], "no fold after the compaction\n" + info
    log = run.proxy_log
    epoch = re.search(rf"the agent compacted its history \({agent} summary at m\d+;.*epoch 2 begins: "
                      r"(\d+) block\(s\) \((b[\d, b]+)\) retire", log)
    assert epoch and "b1" in epoch.group(2), info
    assert "no longer matches any fold" not in log, info
    # the folds after the compaction ran: every compress call of the model was executed by the proxy
    assert log.count("ran=compress") == kinds.count("compress"), info


def test_claude_code_compacts_and_folding_goes_on(work):
    tmp, home, cwd = work
    model = MarathonModel(steps=45, output_kb=4, folds_before=1).start()
    try:
        bins = agent_bin_dir(PINS["claude"], tmp)
        env = base_env(home, bins, ANTHROPIC_API_KEY="sk-ant-api03-fake-bili-acceptance",
                       CLAUDE_CODE_AUTO_COMPACT_WINDOW="200000", CLAUDE_AUTOCOMPACT_PCT_OVERRIDE="25")
        run = run_launcher("claude", ["-p", TASK, "--allowedTools", "Bash", "--max-turns", "200"], env=env, cwd=cwd,
                           model=model, work=tmp, launcher_args=REMIND)
        check(run, model, "claude-code")
    finally:
        model.stop()


def test_codex_compacts_and_folding_goes_on(work):
    tmp, home, cwd = work
    model = MarathonModel(steps=45, output_kb=4, folds_before=1).start()
    try:
        bins = agent_bin_dir(PINS["codex"], tmp)
        conf = home / ".codex" / "config.toml"
        conf.parent.mkdir(parents=True)
        conf.write_text('model = "gpt-5.1-codex"\nmodel_provider = "scripted"\nmodel_auto_compact_token_limit = 30000\n'
                        '\n[model_providers.scripted]\nname = "scripted"\nbase_url = "https://codex.bili-test.invalid/v1"\n'
                        'wire_api = "responses"\nenv_key = "SCRIPTED_API_KEY"\n')
        env = base_env(home, bins, SCRIPTED_API_KEY="sk-fake-bili-acceptance", CODEX_HOME=str(home / ".codex"))
        run = run_launcher("codex", ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK],
                           env=env, cwd=cwd, model=model, work=tmp, launcher_args=REMIND)
        check(run, model, "codex")
        assert all(r.host.startswith("codex.bili-test.invalid") for r in model.seen if r.lane)
    finally:
        model.stop()
