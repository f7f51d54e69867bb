"""Whole Engine runs twice, as the code is and with old functions patched in as oracles: the turns
of both runs are compared by the tests that use it (test_folded_follow_up, test_followup_steps,
test_folded_100, test_first_fixed, test_first_prop, test_fixed_*); :func:`same_runs` compares them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from bili_addon.kernel.turn import Engine
from bili_addon.store import Store


def run_both(tmp_path: Path, scenario: Callable, patch_oracles: Callable, trace: Callable) -> tuple[list, list]:
    """``scenario(make)`` run as the code is, then with ``patch_oracles(monkeypatch)`` applied;
    ``make(**engine_kw)`` gives ``trace(engine)`` of a new Engine on a store of its own, its clock
    (``engine.t``, ``engine.now``) set by the scenario.  Returns the two runs' results (new, old)."""
    runs = []
    for old in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if old:
                patch_oracles(mp)
            engines: list[Engine] = []
            d = tmp_path / ("old" if old else "new")
            d.mkdir()

            def make(**kw):
                e = Engine(Store(d / f"s{len(engines)}.db"), **kw)
                e.t = 1000.0
                e.now = lambda e=e: e.t
                engines.append(e)
                return trace(e)

            try:
                runs.append(scenario(make))
            finally:
                for e in engines:
                    e.store.close()
    return runs[0], runs[1]


CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"



def same_runs(tmp_path: Path, scenario: Callable, patch_oracles: Callable, trace: Callable,
              what: str = "part") -> list:
    """:func:`run_both`, asserting the two runs give the same results, ``what`` by ``what`` (the
    first that differs named); the new run's results."""
    new, old = run_both(tmp_path, scenario, patch_oracles, trace)
    assert len(new) == len(old)
    for i, (a, b) in enumerate(zip(new, old)):
        assert a == b, f"{what} {i} differs"
    return new

def capture_turns() -> list[tuple[str, dict, bytes]]:
    """``(lane, headers, body)`` of every captured request in ``shared/captures`` (skipped where
    there are none), in file order: the agents' real bodies as fixtures."""
    import json

    if not CAPTURES.is_dir():
        pytest.skip(f"no captures at {CAPTURES}")
    turns = []
    for f in sorted(CAPTURES.glob("*/*/*.json")):
        req = json.loads(f.read_text())
        url = req.get("orig_url") or ""
        lane = ("anthropic" if url.endswith("/v1/messages") else "chat" if url.endswith("/chat/completions")
                else "responses" if url.endswith("/responses") else None)
        if lane is None or not isinstance(req.get("body"), dict):
            continue
        headers = {k.lower(): v for k, v in req["headers"]}
        turns.append((lane, headers, json.dumps(req["body"], separators=(",", ":"), ensure_ascii=False).encode()))
    return turns



def replays_both(patch_oracles: Callable, materialize: str, before: Callable | None = None) -> tuple[list, list]:
    """Every capture (``wirecases.capture_files``, skipped where there are none) replayed through
    ``bili_addon.replay`` as the code is, then with ``patch_oracles(monkeypatch)`` applied: each
    run's turns (session, flow, turn, body, blocks, folded, executed).  ``before()``: called at the
    start of each run (e.g. to clear a process-wide memo).  Returns (new, old)."""
    from bili_addon import replay
    from wirecases import capture_files

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    runs = []
    for old in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if old:
                patch_oracles(mp)
            if before is not None:
                before()
            out = []
            for f in files:
                report = replay.replay_file(Path(f), activate="always", materialize=materialize, min_compress_chars=200)
                out.append([(t.session, t.flow, t.turn, t.body, t.blocks, t.folded, t.executed) for t in report.turns])
            runs.append(out)
    return runs[0], runs[1]


def folded_follow_ups(window: int, turns: int = 5) -> Callable:
    """A scenario for :func:`run_both`: the bench's 100-message Anthropic conversation, its first half
    folded by the model (``bench_overhead.fold_half``), then ``turns`` follow-ups of one new message
    each, ten seconds apart (``window``: the engine's context window, 0 for the model's)."""
    import bench_overhead
    from bili_addon.kernel.fold import FoldConfig

    case = bench_overhead.Case("anthropic", 100)
    news = [case.new(i) for i in range(turns)]

    def scenario(make):
        cfg = FoldConfig(min_compress_chars=2000)
        t = make(window=window, fold_cfg=cfg) if window else make(fold_cfg=cfg)
        sid = "bench-folded"
        t.sids.append(sid)
        msgs = bench_overhead.fold_half(t.e, case, list(case.msgs), {"x-acp-session": sid})
        for new in news:
            msgs.append(new)
            t.e.t += 10
            t.send(case.body(msgs), sid, case.lane)
        return [t.turns, t.stored()]

    return scenario
