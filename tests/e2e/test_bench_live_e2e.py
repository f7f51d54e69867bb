"""scripts/bench_live.py runs bench_overhead.py's turns through a real mitmdump with its timing addon
beside bili: the script runs, the proxy answers every turn (the script stops on anything else), and
each row has the turns it says, a floor, a turn and their ratio; with a PostgreSQL store, each of
its rows the hold's CPU too, and a bare round trip's CPU for reference (figures printed, not
judged: no timing assertion)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^sqlite\s+30\s+(first|follow-up)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*$")
PG_ROW = re.compile(r"^pg\s+30\s+(first|follow-up)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\d+)\s*$")
BARE = re.compile(r"^for reference, a bare round trip .*: client CPU (\d+) us after 0\.01 s idle, (\d+) us back to back$")


def test_the_live_bench_times_the_proxys_turns(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_live.py"), "--msgs", "30", "--turns", "3",
                        "--gap", "0"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    rows = [m.groups() for m in map(ROW.match, r.stdout.splitlines()) if m]
    assert [kind for kind, *_ in rows] == ["first", "follow-up"], r.stdout
    for _kind, n, floor, turn, ratio in rows:  # (figures, not judged here: speed is the bench's to print)
        assert int(n) == 3 and float(floor) > 0 and float(turn) > 0 and float(ratio) > 0


def test_the_live_bench_times_a_postgresql_proxys_hold_beside_a_bare_round_trip(pg_url, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_live.py"), "--msgs", "30", "--turns", "3",
                        "--gap", "0.01", "--postgresql", pg_url], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    lines = r.stdout.splitlines()
    assert [m.group(1) for m in map(ROW.match, lines) if m] == ["first", "follow-up"], r.stdout
    rows = [m.groups() for m in map(PG_ROW.match, lines) if m]
    assert [kind for kind, *_ in rows] == ["first", "follow-up"], r.stdout
    for _kind, n, floor, turn, ratio, hold in rows:  # a turn of a PostgreSQL store waits on its hold
        assert int(n) == 3 and float(floor) > 0 and float(turn) > 0 and float(ratio) > 0 and int(hold) > 0
    bare = [m.groups() for m in map(BARE.match, lines) if m]
    assert len(bare) == 1 and all(int(us) > 0 for us in bare[0]), r.stdout
