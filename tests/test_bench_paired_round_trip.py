"""scripts/bench_overhead.py's paired first turns (``paired_round_trip``): SQLite, SQLite with a bare
round trip to the PostgreSQL server where the turn takes its session's lock, and PostgreSQL, each a
new conversation, alternating; every one of the middle way's timed turns made its round trip
(figures printed by the bench, not judged here: no timing assertion)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_overhead  # noqa: E402


def test_the_paired_first_turns_run_the_three_ways_and_the_middle_one_makes_its_round_trip(pg_url, monkeypatch):
    monkeypatch.setattr(bench_overhead, "STORE_URL", "")
    monkeypatch.setattr(bench_overhead, "HEADERS", dict(bench_overhead.HEADERS))
    case = bench_overhead.Case("anthropic", 30)
    ratios, trips = bench_overhead.paired_round_trip(case, pg_url, 3)
    assert list(ratios) == ["sqlite", "sqlite + a round trip", "pg"]
    assert all(r > 0 for r in ratios.values())
    assert trips == 3  # (one per timed turn of the middle way: its session's lock)
