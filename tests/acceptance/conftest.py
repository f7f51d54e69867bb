"""Acceptance fixtures: the real agents at pinned versions, installed once into a cache directory
(``$BILI_AGENT_CACHE``, else ``~/.cache/bili-addon/agents``), and a runner that drives one agent
through ``bili <agent>`` against the scripted model.

An agent whose registry cannot be reached is skipped with the reason; any other install failure
fails the test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .scripted_model import ScriptedModel

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ROUTE_ADDON = REPO / "tests" / "e2e" / "route_addon.py"
INSTALL_TIMEOUT = 900


@dataclass(frozen=True)
class Pin:
    name: str
    kind: str  # npm or pypi
    package: str
    version: str
    binary: str
    extra: tuple[str, ...] = ()  # more npm packages installed alongside (omp needs bun)
    extra_bins: tuple[str, ...] = ()


PINS = {
    "claude": Pin("claude", "npm", "@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": Pin("codex", "npm", "@openai/codex", "0.171.0", "codex"),
    "pi": Pin("pi", "npm", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
    "omp": Pin("omp", "npm", "@oh-my-pi/pi-coding-agent", "18.2.3", "omp", extra=("bun",), extra_bins=("bun",)),
    "opencode": Pin("opencode", "npm", "opencode-ai", "1.18.33", "opencode"),
    "hermes": Pin("hermes", "pypi", "hermes-agent[anthropic,mcp]", "0.19.0", "hermes"),
}


def cache_root() -> Path:
    return Path(os.environ.get("BILI_AGENT_CACHE") or Path.home() / ".cache" / "bili-addon" / "agents")


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _registry_reachable(pin: Pin, python: str) -> tuple[bool, str]:
    if pin.kind == "npm":
        if shutil.which("npm") is None:
            return False, "npm is not installed"
        cmd = ["npm", "view", f"{pin.package}@{pin.version}", "version"]
    else:
        cmd = [python, "-m", "pip", "index", "versions", pin.package.split("[")[0]]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{' '.join(cmd)}: {e}"
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines
        return False, f"{' '.join(cmd)} exited {r.returncode}: {' / '.join(errors[:3])[:300]}"
    if pin.kind == "pypi" and pin.version not in r.stdout:
        return False, f"{pin.package} {pin.version} is not in the configured index"
    return True, ""


def _bin_of(pin: Pin, d: Path, name: str) -> Path:
    return d / "venv" / "bin" / name if pin.kind == "pypi" else d / "node_modules" / ".bin" / name


def install(pin: Pin) -> Path:
    """The agent's install directory (installed now if not cached); skips when the registry is unreachable."""
    python = sys.executable
    if pin.kind == "pypi" and sys.version_info >= (3, 14):
        pytest.skip(f"{pin.package} {pin.version} requires Python < 3.14 (this is {sys.version.split()[0]})")
    d = cache_root() / f"{pin.name}-{pin.version}"
    done = d / ".bili-complete"
    with _locked(cache_root() / f".{pin.name}-{pin.version}.lock"):
        spec = f"{pin.package}@{pin.version} {' '.join(pin.extra)}".strip()
        if done.exists() and done.read_text().splitlines()[:1] == [spec] and _bin_of(pin, d, pin.binary).exists():
            return d
        ok, why = _registry_reachable(pin, python)
        if not ok:
            pytest.skip(f"{pin.kind} registry unreachable, cannot install {pin.package}@{pin.version}: {why}")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        if pin.kind == "npm":
            cmd = ["npm", "install", "--prefix", str(d), "--no-audit", "--no-fund", "--loglevel=error",
                   f"{pin.package}@{pin.version}", *pin.extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, stdin=subprocess.DEVNULL)
        else:
            r = subprocess.run([python, "-m", "venv", str(d / "venv")], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                cmd = [str(d / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                       f"{pin.package}=={pin.version}"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                                   stdin=subprocess.DEVNULL)
        if r.returncode != 0 or not _bin_of(pin, d, pin.binary).exists():
            pytest.fail(f"installing {pin.package}@{pin.version} failed ({r.returncode}):\n{r.stdout[-2000:]}\n"
                        f"{r.stderr[-3000:]}")
        done.write_text(f"{spec}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    return d


# installs run in the background, three at a time, as soon as the session knows which agents it needs
_POOL: ThreadPoolExecutor | None = None
_INSTALLS: dict[str, Future] = {}
_AGENT_OF_TEST = re.compile(r"^test_(" + "|".join(PINS) + r")(?:_|$|\[)")


def prefetch(names: list[str]) -> None:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=3, thread_name_prefix="agent-install")
    for name in names:
        if name not in _INSTALLS:
            _INSTALLS[name] = _POOL.submit(install, PINS[name])


def installed(pin: Pin) -> Path:
    prefetch([pin.name])
    return _INSTALLS[pin.name].result()  # re-raises the install's skip or failure in the test


@pytest.fixture(scope="session", autouse=True)
def _install_selected_agents(request):
    names = []
    for item in request.session.items:
        m = _AGENT_OF_TEST.match(item.name)
        if m and m.group(1) not in names and item.get_closest_marker("acceptance"):
            names.append(m.group(1))
    prefetch(names)
    yield
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)


def agent_bin_dir(pin: Pin, tmp: Path) -> Path:
    """A directory holding only the agent's binaries (symlinks), to put first on PATH."""
    d = installed(pin)
    out = tmp / "agent-bin"
    out.mkdir(exist_ok=True)
    for name in (pin.binary, *pin.extra_bins):
        link = out / name
        if not link.exists():
            link.symlink_to(_bin_of(pin, d, name))
    return out


# -- processes ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid``."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_bytes().rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(p.name))
    return out


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    launcher_pid: int
    proxy_pid: int | None
    agent_pid: int | None
    leftovers: list[int] = field(default_factory=list)  # processes of the launcher's group still alive
    proxy_log: str = ""


PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "pi_proxy")


def base_env(home: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if k.lower() not in PROXY_VARS and not k.endswith("_BASE_URL") and not k.endswith("_API_KEY")
            and not k.startswith(("BILI_", "CODEX_", "PI_", "OPENCODE_", "CLAUDE", "ANTHROPIC_", "OPENAI_",
                                  "HERMES_", "XDG_"))}
    keep.update(
        HOME=str(home),
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        TMPDIR=str(home / "tmp"),
        NO_COLOR="1",
        TERM="dumb",
    )
    keep.update(extra)
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return keep


def run_launcher(agent: str, agent_args: list[str], *, env: dict[str, str], cwd: Path, model: ScriptedModel,
                 work: Path, timeout: float = 240, launcher_args: list[str] = (), port: int | None = None,
                 prefix: list[str] = ()) -> Run:
    """``prefix``: a command the launcher runs under (it must exec it, keeping the pid)."""
    port = port or free_port()
    cmd = [*prefix, sys.executable, "-m", "bili_addon.cli", agent, "-v", "--port", str(port),
           "--confdir", str(work / "ca"), "--data-dir", str(work / "data"),
           "-s", str(ROUTE_ADDON), "--set", f"test_route=127.0.0.1:{model.port}",
           "--set", "connection_strategy=lazy", "--set", "bili_min_compress_chars=1000",
           # the scripted model calls compress at a fixed stage of a short session: bili must show itself
           # from the first request, unless a test is about lazy activation (its own bili_activate)
           *([] if any("bili_activate" in a for a in launcher_args) else ["--set", "bili_activate=always"]),
           # and its fold leaves the wire with the next request, unless a test is about held folds
           *([] if any("bili_materialize" in a for a in launcher_args) else ["--set", "bili_materialize=now"]),
           *launcher_args, "--", *agent_args]
    t0 = time.monotonic()
    env = dict(env, PWD=str(cwd))  # Bun agents (opencode) take their directory from $PWD
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _kill_proxy(err.decode(errors="replace"))
        pytest.fail(f"bili {agent} did not finish within {timeout:.0f} s\nstdout:\n{out.decode(errors='replace')[-3000:]}"
                    f"\nstderr:\n{err.decode(errors='replace')[-5000:]}\n{_proxy_log(env, port)}")
    seconds = time.monotonic() - t0
    stderr = err.decode(errors="replace")
    m = re.search(r"started the proxy on \S+ \(pid (\d+)", stderr)
    a = re.search(r"running \S+ \(pid (\d+)\)", stderr)
    time.sleep(0.2)
    return Run(proc.returncode, out.decode(errors="replace"), stderr, seconds, proc.pid,
               int(m.group(1)) if m else None, int(a.group(1)) if a else None, group_members(proc.pid),
               _proxy_log(env, port))


def _proxy_log(env: dict[str, str], port: int) -> str:
    from bili_addon.launch import state_dir

    try:
        return (state_dir(env) / f"proxy-{port}.log").read_text(errors="replace")
    except OSError:
        return ""


def _kill_proxy(stderr: str) -> None:
    m = re.search(r"started the proxy on \S+ \(pid (\d+)", stderr)
    if m:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(m.group(1)), signal.SIGKILL)


def snapshot(paths: list[Path]) -> dict[str, tuple[bytes, int] | None]:
    out: dict[str, tuple[bytes, int] | None] = {}
    for p in paths:
        try:
            out[str(p)] = (p.read_bytes(), p.stat().st_mtime_ns)
        except FileNotFoundError:
            out[str(p)] = None
    return out


@pytest.fixture
def model():
    m = ScriptedModel().start()
    yield m
    m.stop()
