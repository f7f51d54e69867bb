"""A real PostgreSQL server for the tests: the distribution's server binaries (``initdb``,
``pg_ctl``) in a temp dir on a loopback port, installed with apt-get when missing (a fresh CI
machine), run as the ``postgres`` user when the tests run as root (initdb refuses root).

A run that was killed (a timeout, ``kill -9``, Ctrl-C twice) leaves its server running and its
directory behind (40-130 MB each).  Each new server first sweeps those: a directory whose owner
(the process that made it, recorded in ``owner``) is gone has its server stopped and is removed."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from bili_addon.procs import alive


class NoServer(Exception):
    """No PostgreSQL server can be had here (the reason is the message)."""


def _bindir() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.path.exists(os.path.join(d, "initdb")):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _install() -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise NoServer("no PostgreSQL server binaries (initdb) and no root apt-get to install postgresql-15")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "postgresql-15"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise NoServer(f"{' '.join(cmd)} failed: {r.stderr.strip()[-400:]}")


PREFIX = "bili-pg-"
OWNER = "owner"  # the pid of the process that made the directory
UNOWNED_AFTER = 600.0  # seconds: a directory without an owner file (made before it was written) is left this long


def sweep(tmp: str | Path, pg_ctl: Path, prefix: list[str]) -> list[Path]:
    """Stop and remove the servers of runs that are gone: each ``bili-pg-*`` directory in ``tmp`` whose
    owner process no longer runs (or, without an owner file, older than :data:`UNOWNED_AFTER`).
    A directory whose owner still runs is never touched.  Returns the directories removed."""
    gone = []
    for root in sorted(Path(tmp).glob(PREFIX + "*")):
        try:
            owner = int((root / OWNER).read_text())
        except FileNotFoundError:
            try:
                if time.time() - root.stat().st_mtime < UNOWNED_AFTER:
                    continue
            except OSError:
                continue
        except (OSError, ValueError):
            continue
        else:
            if alive(owner):
                continue
        data = root / "data"
        pid_file = data / "postmaster.pid"
        if pid_file.exists():  # its server may still run: stopped first (as the user who runs the servers)
            try:
                subprocess.run([*prefix, str(pg_ctl), "-D", str(data), "-m", "immediate", "-w", "stop"],
                               capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                pass
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            gone.append(root)
    return gone


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        bindir = _bindir()
        if bindir is None:
            _install()
            bindir = _bindir()
        if bindir is None:
            raise NoServer("postgresql-15 was installed but initdb is still not found")
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.root / OWNER).write_text(str(os.getpid()))
        self.data = self.root / "data"
        self.port = _port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            runuser = shutil.which("runuser") or shutil.which("setpriv")
            try:
                import pwd
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise NoServer("running as root and there is no 'postgres' user to run the server as") from None
            if runuser is None:
                raise NoServer("running as root and neither runuser nor setpriv is available")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self.prefix = ([runuser, "-u", "postgres", "--"] if runuser.endswith("runuser") else
                           [runuser, f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"])
        self.user = "postgres" if os.geteuid() == 0 else (os.environ.get("USER") or "postgres")
        sweep(self.root.parent, self.bindir / "pg_ctl", self.prefix)  # (runs killed before: the module's doc)

    def _run(self, *cmd: str) -> None:
        r = subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise NoServer(f"{cmd[0]} failed: {(r.stderr or r.stdout).strip()[-600:]}")

    def start(self) -> "PgServer":
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust",
                  "-E", "UTF8", "--locale=C", "--no-sync")
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"),
                  "-w", "-t", "60", "start")
        return self

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def fresh(self) -> str:
        """The URL of a fresh empty store (a schema of its own, by search_path)."""
        import psycopg

        schema = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f"CREATE SCHEMA {schema}")
        return f"{self.url}?options=-csearch_path%3D{schema}"

    def stop(self) -> None:
        try:
            subprocess.run([*self.prefix, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def wait_ready(url: str, timeout: float = 10.0) -> None:
    import psycopg

    end = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
