"""scripts/bench_fleet.py runs a fleet of real mitmdump instances on one PostgreSQL store against one
SQLite instance: the script runs, every session's turns are answered through each fleet, and the
upstream received the same bytes from each fleet as from the SQLite instance (figures printed, not
judged: no timing assertion)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(sqlite|postgresql)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$")


def test_the_fleet_bench_runs_its_fleets_and_proves_the_bytes(pg_url, tmp_path):
    sessions = 3
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fleet.py"), "--quick", "--sessions",
                        str(sessions), "--postgresql", pg_url], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    rows = [m.groups() for m in map(ROW.match, r.stdout.splitlines()) if m]
    assert [(store, int(n)) for store, n, *_ in rows] == [("sqlite", 1), ("postgresql", 1), ("postgresql", 2)], r.stdout
    for _store, _n, requests, rps, p50, p99, same in rows:
        assert int(requests) == sessions * 12 and float(rps) > 0 and 0 < float(p50) <= float(p99)
    assert [same for *_, same in rows] == ["reference", "yes", "yes"], r.stdout
    assert not list(tmp_path.glob("bili-fleet-*"))  # (its instances' stores and logs go with the run)


def test_the_fleet_bench_refuses_a_store_that_is_not_a_postgresql_url(tmp_path):
    """``--postgresql`` takes a URL or ``auto``: anything else would have each instance open a SQLite
    store of its own in a directory of that name (rows labelled postgresql that were not)."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fleet.py"), "--postgresql", "somewhere"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "postgresql:// URL or auto" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "somewhere").exists() and "store at" not in r.stdout
