"""Real agents on server-side chains (Responses ``store: true`` + ``previous_response_id``): omp's
built-in OpenAI transport sends its whole history once, then only the new items of each turn.

The scripted model keeps chains as OpenAI does (it refuses an id it never issued); bili rebuilds
each turn from its transcript, forwards the agent's delta while the history it already sent stands,
and sends the whole folded input (no ``previous_response_id``) on the turn a fold lands.  In a
chain the model's own earlier prose carries no ref tag, so the scripted model folds what bili's
reminder offers (``bili_remind_at=1500``).
"""

from __future__ import annotations

import json

import pytest

from .conftest import PINS, agent_bin_dir, base_env, run_launcher, snapshot
from .scripted_model import COMPRESS_STAGE, FINAL, call_id, results_of
from .test_agents import _report, _write, git_init, work  # noqa: F401  (work: the fixture)

pytestmark = pytest.mark.acceptance

PROMPT = "List the rows step by step as your tools allow, then report."
REMIND = ["--set", "bili_remind_at=1500"]


def test_omp_openai_chains_fold(model, work):
    tmp, home, cwd = work
    bins = agent_bin_dir(PINS["omp"], tmp)
    git_init(cwd)
    cfg = [_write(home / ".omp" / "agent" / "models.yml", "providers: {}\n")]
    before = snapshot(cfg)
    env = base_env(home, bins, OPENAI_API_KEY="sk-fake-omp-openai")
    run = run_launcher("omp", ["-p", "--model", "openai/gpt-5.1-codex", PROMPT], env=env, cwd=cwd,
                       model=model, work=tmp, launcher_args=REMIND)
    info = _report(run, model)
    assert run.rc == 0, info
    assert FINAL in run.stdout, info
    assert "<acp" not in run.stdout, info
    reqs = model.model_requests()
    assert reqs and all(r.lane == "responses" and r.host.startswith("api.openai.com") for r in reqs), info
    assert all(r.status == 200 for r in model.seen if r.lane == "responses"), \
        "the model refused a request (an unknown previous_response_id?)\n" + info
    assert all(r.json.get("store") is True for r in reqs), info
    # the chain: every previous_response_id bili sent is one the model issued (to bili) before
    issued = [f"resp_scripted{r.seq:05d}" for r in model.seen if r.lane == "responses"]
    for r in reqs:
        prev = r.json.get("previous_response_id")
        assert prev is None or prev in issued[: issued.index(f"resp_scripted{r.seq:05d}")], info
    by_stage = {s: model.by_stage(s)[-1] for s in range(1, COMPRESS_STAGE + 3) if model.by_stage(s)}
    assert set(by_stage) == set(range(1, COMPRESS_STAGE + 3)), info
    carrying = by_stage[COMPRESS_STAGE + 1]
    # the turn the fold landed on: the whole folded input, no previous_response_id
    assert "previous_response_id" not in carrying.json, info
    text = carrying.body.decode()
    assert "[Compressed conversation section b1 · " in text and "SUMMARY-MARK-91c2" in text, info
    assert "alpha-row-" not in text, "the oldest listing should be folded"
    result = results_of("responses", carrying.json).get(call_id("responses", COMPRESS_STAGE), "")
    assert result.startswith("Compressed ") and "→ b1" in result, result
    # every other turn after the first: the agent's delta on the provider's chain
    for s, r in by_stage.items():
        if s not in (1, COMPRESS_STAGE + 1):
            assert r.json.get("previous_response_id"), f"stage {s} should be a delta\n{info}"
    # after the fold the model's view (the chain) stays folded
    after = json.dumps(by_stage[COMPRESS_STAGE + 2].conversation, ensure_ascii=False)
    assert "[Compressed conversation section b1 · " in after and "alpha-row-" not in after, info
    assert "chained turn on" in run.proxy_log and "whole input sent without previous_response_id" in run.proxy_log
    assert snapshot(cfg) == before
