"""Whole Engine runs twice, as the code is and with old functions patched in as oracles: the turns
of both runs are compared by the tests that use it (test_folded_follow_up, test_followup_steps,
test_folded_100)."""

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

