"""scripts/bench_live.py runs bench_overhead.py's turns through a real mitmdump with its timing addon
beside bili: the script runs, the proxy answers every turn (the script stops on anything else), and
each row has the turns it says, a floor, a turn and their ratio (figures printed, not judged:
no timing assertion)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^sqlite\s+30\s+(first|follow-up)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*$")


def test_the_live_bench_times_the_proxys_turns(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_live.py"), "--msgs", "30", "--turns", "3",
                        "--gap", "0"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    rows = [m.groups() for m in map(ROW.match, r.stdout.splitlines()) if m]
    assert [kind for kind, *_ in rows] == ["first", "follow-up"], r.stdout
    for _kind, n, floor, turn, ratio in rows:  # (figures, not judged here: speed is the bench's to print)
        assert int(n) == 3 and float(floor) > 0 and float(turn) > 0 and float(ratio) > 0
