"""The suite's PostgreSQL servers (tests/pgserver.py) do not pile up: a run that was killed leaves its
server running and its directory behind, and the next server made sweeps them (stops the server,
removes the directory) once the process that made them is gone, never while it runs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import pgserver
from pgserver import OWNER, PREFIX, sweep

TESTS = Path(__file__).resolve().parent


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _dir(tmp: Path, name: str, owner: int | None, age: float = 0.0) -> Path:
    d = tmp / (PREFIX + name)
    (d / "data").mkdir(parents=True)
    if owner is not None:
        (d / OWNER).write_text(str(owner))
    if age:
        then = time.time() - age
        os.utime(d, (then, then))
    return d


def test_a_directory_is_swept_once_its_owner_is_gone_and_never_while_it_runs(tmp_path):
    dead = _dir(tmp_path, "dead", _dead_pid())
    live = _dir(tmp_path, "live", os.getpid())
    old = _dir(tmp_path, "old", None, age=pgserver.UNOWNED_AFTER + 60)  # (made before owner files)
    young = _dir(tmp_path, "young", None)  # (being made right now: its owner file comes next)
    other = tmp_path / "not-ours"
    other.mkdir()
    gone = sweep(tmp_path, Path("/nonexistent/pg_ctl"), [])
    assert sorted(gone) == sorted([dead, old])
    assert not dead.exists() and not old.exists()
    assert live.exists() and young.exists() and other.exists()


def test_a_swept_directorys_server_is_stopped_first(tmp_path):
    """Where a server may still run (its ``postmaster.pid``), ``pg_ctl stop`` is called on its data
    directory, through the prefix that runs the servers (the ``postgres`` user under root)."""
    calls = tmp_path / "calls"
    pg_ctl = tmp_path / "pg_ctl"
    pg_ctl.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    pg_ctl.chmod(0o755)
    running = _dir(tmp_path, "running", _dead_pid())
    (running / "data" / "postmaster.pid").write_text("12345\n")
    stopped = _dir(tmp_path, "stopped", _dead_pid())
    assert sorted(sweep(tmp_path, pg_ctl, ["env"])) == sorted([running, stopped])
    assert calls.read_text().splitlines() == [f"-D {running / 'data'} -m immediate -w stop"]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_server_of_a_killed_run_is_stopped_and_its_directory_removed():
    """A real server whose maker was killed with SIGKILL keeps running; the sweep stops it."""
    if pgserver._bindir() is None:
        pytest.skip("no PostgreSQL server binaries here (the suite's PostgreSQL tests install them)")
    base = Path(tempfile.mkdtemp(prefix="bili-sweep-test-"))
    base.chmod(0o755)  # (the postgres user runs the server under root: it must reach its directory)
    try:
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, tempfile, time; sys.path.insert(0, sys.argv[1]); tempfile.tempdir = sys.argv[2]\n"
             "from pgserver import PgServer\n"
             "s = PgServer().start(); print(s.root, s.port, flush=True); time.sleep(600)",
             str(TESTS), str(base)],
            stdout=subprocess.PIPE, text=True)
        try:
            root, port = child.stdout.readline().split()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        root, port = Path(root), int(port)
        assert root.parent == base and _accepts(port)  # the orphan runs on
        maker = pgserver.PgServer()  # (not started: the binaries and the prefix that runs them)
        shutil.rmtree(maker.root, ignore_errors=True)
        assert sweep(base, maker.bindir / "pg_ctl", maker.prefix) == [root]
        assert not root.exists()
        assert not _accepts(port)
    finally:
        shutil.rmtree(base, ignore_errors=True)
