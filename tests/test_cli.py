"""The command line, the CA handling and scripts/bootstrap."""

from __future__ import annotations

import json
import os
import signal
import socket
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from glob import glob
from pathlib import Path

import pytest

from bili_addon import __version__, certs, cli, launch
from bili_addon.agents import AGENTS

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "scripts" / "bootstrap"
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env.update(extra)
    return env


def _bili_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "bili"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "bili_addon.cli"]


def _version_of(python: str) -> tuple[int, int]:
    out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout
    major, minor = out.split()
    return int(major), int(minor)


# -- scripts/bootstrap ---------------------------------------------------------------------------
def test_bootstrap_finds_a_python_312_or_newer():
    r = subprocess.run([str(BOOTSTRAP), "--print-python"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    python = r.stdout.strip()
    assert Path(python).is_absolute()
    assert _version_of(python) >= (3, 12)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)


def test_bootstrap_skips_shims_that_fail_and_pythons_that_are_too_old(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # a pyenv shim for a version that is not selected, and an old python3
    _fake(fake, "python3.13", 'echo "pyenv: python3.13: command not found" >&2; exit 127')
    _fake(fake, "python3.12", 'echo "pyenv: python3.12: command not found" >&2; exit 127')
    _fake(fake, "python3", 'exit 3')
    env = _clean_env(PATH=f"{fake}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run([str(BOOTSTRAP), "--print-python"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    python = r.stdout.strip()
    assert not python.startswith(str(fake))
    assert _version_of(python) >= (3, 12)


def test_bootstrap_honours_bili_python(tmp_path):
    env = _clean_env(BILI_PYTHON=sys.executable)
    r = subprocess.run([str(BOOTSTRAP), "--print-python"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == sys.executable

    _fake(tmp_path, "oldpython", "exit 3")
    env = _clean_env(BILI_PYTHON=str(tmp_path / "oldpython"))
    r = subprocess.run([str(BOOTSTRAP), "--print-python"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1
    assert "BILI_PYTHON" in r.stderr


def test_bootstrap_locks_in_its_checkout_never_in_a_shared_directory(tmp_path):
    """Its lock had a predictable name in $TMPDIR (/tmp), opened for writing: another user could plant a
    link there to a file of yours (truncated), or a file you cannot open (every first install failed)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(BOOTSTRAP, root / "scripts" / "bootstrap")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    checksum = subprocess.run(["sh", "-c", "printf '%s' \"$1\" | cksum | cut -d' ' -f1", "_", str(root.resolve())],
                              capture_output=True, text=True).stdout.strip()
    (shared / f"bili-bootstrap-{os.getuid()}-{checksum}.lock").symlink_to(victim)  # (where it was)
    env = _clean_env(TMPDIR=str(shared), BILI_PYTHON="/bin/false")  # (stops right after the lock)
    r = subprocess.run([str(root / "scripts" / "bootstrap"), "-q"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 1 and "BILI_PYTHON" in r.stderr
    assert victim.read_text() == "precious" and (root / ".bootstrap.lock").is_file()


def _linked(target: Path, where: Path) -> Path:
    """``where/<name>`` reaching ``target`` through two links, a relative one to an absolute one (as
    ``ln -s <checkout>/scripts/bili ~/.local/bin/bili`` does, and a link to that link)."""
    (where / "via").mkdir(parents=True, exist_ok=True)
    (where / "via" / target.name).symlink_to(target)
    (where / target.name).symlink_to(Path("via") / target.name)
    return where / target.name


def test_the_scripts_find_their_checkout_through_a_symlink(tmp_path):
    """scripts/bili run through a link on PATH took the link's directory for its own and ran
    <link dir>/../scripts/bootstrap; scripts/test, scripts/bootstrap and .ci/run had the same line."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / ".ci").mkdir()
    for name in ("bili", "test"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    shutil.copy(ROOT / ".ci" / "run", root / ".ci" / "run")
    _fake(root / "scripts", "bootstrap", 'echo "bootstrap $*"')
    (root / ".venv" / "bin").mkdir(parents=True)
    _fake(root / ".venv" / "bin", "bili", 'echo "bili $*"')
    _fake(root / ".venv" / "bin", "python", 'echo "python $*"')
    env = _clean_env()
    for script, args, want in ((root / "scripts" / "bili", ["--version"], "bootstrap \nbili --version\n"),
                               (root / "scripts" / "test", ["-x"], "bootstrap --test\npython -m pytest -rs -x\n"),
                               (root / ".ci" / "run", ["-x"], "bootstrap --test\npython -m pytest -rs -x\n")):
        link = _linked(script, tmp_path / "bin" / script.parent.name)
        r = subprocess.run([str(link), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
        assert (r.returncode, r.stdout) == (0, want), (script, r.stderr)
    # bootstrap itself: its lock is in the checkout it belongs to (BILI_PYTHON=/bin/false stops right after it)
    other = tmp_path / "other"
    (other / "scripts").mkdir(parents=True)
    shutil.copy(BOOTSTRAP, other / "scripts" / "bootstrap")
    shutil.copy(ROOT / "pyproject.toml", other / "pyproject.toml")
    link = _linked(other / "scripts" / "bootstrap", tmp_path / "elsewhere" / "bin")
    r = subprocess.run([str(link), "-q"], capture_output=True, text=True, env=_clean_env(BILI_PYTHON="/bin/false"),
                       timeout=60)
    assert r.returncode == 1 and "BILI_PYTHON" in r.stderr
    assert (other / ".bootstrap.lock").is_file() and not (tmp_path / "elsewhere" / ".bootstrap.lock").exists()


_SYSTEM_GLOBS = ("/usr/bin/python3.1[2-9]", "/usr/local/bin/python3.1[2-9]", "/opt/homebrew/bin/python3.1[2-9]",
                 "/opt/local/bin/python3.1[2-9]",
                 "/Library/Frameworks/Python.framework/Versions/3.1[2-9]/bin/python3")


@pytest.mark.skipif(any(glob(g) for g in _SYSTEM_GLOBS), reason="a system Python >= 3.12 is always found")
def test_bootstrap_explains_when_no_python_fits(tmp_path):
    # a PATH with nothing but the tools the script needs, and a HOME without pyenv
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("bash", "dirname"):
        found = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        os.symlink(found, tools / name)
    _fake(tools, "python3", "exit 3")
    env = {"PATH": str(tools), "HOME": str(tmp_path / "home")}
    r = subprocess.run([str(tools / "bash"), str(BOOTSTRAP), "--print-python"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1
    assert "no Python >= 3.12 found" in r.stderr
    assert "BILI_PYTHON" in r.stderr


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="only meaningful inside the repo's .venv (scripts/test)")
def test_bootstrap_second_run_is_a_no_op():
    t0 = time.monotonic()
    r = subprocess.run([str(BOOTSTRAP), "--test"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "installing" not in r.stderr
    assert time.monotonic() - t0 < 10


# -- certs ---------------------------------------------------------------------------------------
def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_bili_ca_creates_the_ca_with_private_files_0600_and_a_combined_bundle(tmp_path, capsys):
    confdir = tmp_path / "ca"
    assert cli.main(["ca", "--confdir", str(confdir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert Path(info["confdir"]) == confdir.resolve()

    key = confdir / "mitmproxy-ca.pem"
    cert = confdir / "mitmproxy-ca-cert.pem"
    combined = confdir / "combined-ca.pem"
    assert Path(info["cert"]) == cert.resolve() and Path(info["combined"]) == combined.resolve()
    assert b"PRIVATE KEY" in key.read_bytes()
    assert b"PRIVATE KEY" not in cert.read_bytes()
    for secret in (key, confdir / "mitmproxy-ca.p12"):
        assert _mode(secret) == 0o600, secret
    assert {Path(p).name for p in info["private"]} == {"mitmproxy-ca.pem", "mitmproxy-ca.p12"}

    ours = cert.read_bytes().strip()
    bundle = combined.read_bytes()
    assert bundle.count(ours) == 1
    if info["roots_source"]:
        assert bundle.count(b"-----BEGIN CERTIFICATE-----") > 1
    assert b"PRIVATE KEY" not in bundle

    # second run: same CA, permissions repaired, our cert still once
    key.chmod(0o644)
    assert cli.main(["ca", "--confdir", str(confdir)]) == 0
    out = capsys.readouterr().out
    assert str(cert.resolve()) in out and str(combined.resolve()) in out
    assert cert.read_bytes().strip() == ours
    assert _mode(key) == 0o600
    assert combined.read_bytes().count(ours) == 1
    assert not [p for p in confdir.iterdir() if p.name.endswith(".tmp")]


def test_combined_bundle_never_feeds_on_itself(tmp_path, monkeypatch):
    ca = certs.ensure_ca(tmp_path)
    ours = ca.cert.read_bytes().strip()
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.combined))  # as after `export SSL_CERT_FILE=...`
    again = certs.ensure_ca(tmp_path)
    assert again.roots_source != str(ca.combined)
    assert again.combined.read_bytes().count(ours) == 1

    # a copy of the bundle elsewhere as the roots: our CA is still not repeated
    copy = tmp_path / "copy.pem"
    copy.write_bytes(ca.combined.read_bytes())
    monkeypatch.setenv("SSL_CERT_FILE", str(copy))
    third = certs.ensure_ca(tmp_path)
    assert third.roots_source == str(copy)
    assert third.combined.read_bytes().count(ours) == 1


def test_default_confdir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    checkout = tmp_path / "checkout"
    (checkout / "certs").mkdir(parents=True)
    assert certs.default_confdir(checkout) == checkout / "certs"

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "certs").write_text("not a directory")
    assert certs.default_confdir(blocked) == tmp_path / "xdg" / "bili-addon" / "certs"

    if (ROOT / "pyproject.toml").is_file() and Path(certs.__file__).resolve().is_relative_to(ROOT):
        assert certs.checkout_root() == ROOT


# -- bili ----------------------------------------------------------------------------------------
def test_bili_run_help_and_version():
    r = subprocess.run([*_bili_cmd(), "run", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--listen-host", "--listen-port", "--mode", "--data-dir", "--confdir", "--bili-mode", "--quiet"):
        assert flag in r.stdout
    r = subprocess.run([*_bili_cmd(), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and __version__ in r.stdout


def test_bili_modes_match_the_addon():
    from bili_addon.shell import MODES

    assert cli.BILI_MODES == MODES


def test_bili_run_builds_the_mitmdump_command(tmp_path, monkeypatch, capsys):
    seen: list[list[str]] = []

    def fake_serve(cmd, target, ready, env=None):
        seen.append(list(cmd))
        ready({"ok": True, "version": __version__, "mode": "observe", "store": True})
        return 0

    monkeypatch.setattr(cli, "_serve", fake_serve)
    monkeypatch.setattr(cli, "port_in_use", lambda host, port: False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):  # (the caller's own: see below)
        monkeypatch.delenv(var, raising=False)
    rc = cli.main(["run", "--listen-port", "9999", "--mode", "reverse:https://api.anthropic.com",
                   "--data-dir", str(tmp_path / "data"), "--confdir", str(tmp_path / "ca"),
                   "--bili-mode", "observe", "--", "--set", "flow_detail=0"])
    assert rc == 0 and len(seen) == 1
    argv = seen[0]
    assert Path(argv[0]).name == "mitmdump"
    assert argv[argv.index("-s") + 1] == str(Path(cli.__file__).resolve().parent / "addon.py")
    assert argv[argv.index("--listen-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--listen-port") + 1] == "9999"
    assert argv[argv.index("--mode") + 1] == "reverse:https://api.anthropic.com"
    assert f"confdir={(tmp_path / 'ca').resolve()}" in argv
    assert f"bili_data_dir={(tmp_path / 'data').resolve()}" in argv
    assert "bili_mode=observe" in argv
    assert argv[-2:] == ["--set", "flow_detail=0"]
    out = capsys.readouterr().out
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:9999" in out
    assert "bili: ready" in out

    # forward mode (the default): the proxy and CA variables; no data dir unless given
    seen.clear()
    cli.main(["run", "--confdir", str(tmp_path / "ca")])
    argv = seen[0]
    assert argv[argv.index("--mode") + 1] == "regular"
    assert not any(a.startswith("bili_data_dir=") for a in argv)
    assert "bili_mode=fold" in argv
    out = capsys.readouterr().out
    assert "HTTPS_PROXY=http://127.0.0.1:8787" in out
    assert f"NODE_EXTRA_CA_CERTS={(tmp_path / 'ca').resolve() / 'mitmproxy-ca-cert.pem'}" in out
    assert f"SSL_CERT_FILE={(tmp_path / 'ca').resolve() / 'combined-ca.pem'}" in out
    assert "REQUESTS_CA_BUNDLE=" in out

    seen.clear()
    cli.main(["run", "--quiet", "--confdir", str(tmp_path / "ca")])
    assert seen and capsys.readouterr().out == ""

    # the user's own proxy (a corporate one) is bili's upstream; not the proxy itself, nor one with credentials
    for proxy, mode in (("http://proxy.corp.example:3128", "upstream:http://proxy.corp.example:3128"),
                        ("http://127.0.0.1:8787/", "regular"), ("http://u:pw@proxy.corp.example:3128", "regular")):
        seen.clear()
        monkeypatch.setenv("HTTPS_PROXY", proxy)
        cli.main(["run", "--confdir", str(tmp_path / "ca")])
        argv = seen[0]
        assert argv[argv.index("--mode") + 1] == mode and "pw" not in " ".join(argv)
        out, err = capsys.readouterr()
        assert ("goes out through the proxy http://proxy.corp.example:3128" in out) == (mode != "regular")
        assert ("upstream_auth=USER:PASSWORD" in err) == ("pw" in proxy)


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_options_after_dashdash_are_merged_with_bilis_own_never_doubled(tmp_path, monkeypatch, capsys):
    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "_serve", lambda cmd, target, ready, env=None: seen.append(list(cmd)) or 0)
    monkeypatch.setattr(cli, "port_in_use", lambda host, port: False)
    ca = ["--confdir", str(tmp_path / "ca")]

    # the user's value replaces bili's: one bili_mode, theirs
    assert cli.main(["run", *ca, "--", "--set", "bili_mode=observe", "-w", "flows.mitm"]) == 0
    sets = _sets(seen[-1])
    assert [s for s in sets if s.startswith("bili_mode=")] == ["bili_mode=observe"]
    assert seen[-1][-2:] == ["-w", "flows.mitm"]
    # bili run's own --set, and --set=NAME=VALUE after --, the same way
    assert cli.main(["run", *ca, "--set", "bili_remind_at=30000", "--", "--set=bili_first_party=observe"]) == 0
    sets = _sets(seen[-1])
    assert "bili_remind_at=30000" in sets and "bili_first_party=observe" in sets
    assert len(sets) == len({s.split("=", 1)[0] for s in sets if not s.startswith("allow_hosts=")}) + \
        sum(s.startswith("allow_hosts=") for s in sets)
    # the same data dir twice is one option; allow_hosts (a list) gains the user's entry
    data = tmp_path / "data"
    assert cli.main(["run", *ca, "--data-dir", str(data), "--", "--set", f"bili_data_dir={data}",
                     "--set", "allow_hosts=^extra\\.example:443$"]) == 0
    sets = _sets(seen[-1])
    assert [s for s in sets if s.startswith("bili_data_dir=")] == [f"bili_data_dir={data.resolve()}"]
    allow = [s for s in sets if s.startswith("allow_hosts=")]
    assert len(allow) == 2 and allow[-1] == "allow_hosts=^extra\\.example:443$"
    capsys.readouterr()

    # what cannot be merged is refused, saying what to do, and nothing runs
    n = len(seen)
    for argv, words in [
        (["--bili-mode", "observe", "--", "--set", "bili_mode=fold"], ["--bili-mode observe", "bili_mode=fold"]),
        (["--data-dir", str(data), "--", "--set", f"bili_data_dir={tmp_path / 'other'}"], ["--data-dir"]),
        (["--set", "bili_mode=observe", "--", "--set", "bili_mode=passthrough"], ["bili_mode", "twice"]),
        (["--", "--listen-port", "9000"], ["--listen-port"]),
        (["--", "-p", "9000"], ["--listen-port"]),
        (["--", "--set", "confdir=/tmp/x"], ["--confdir"]),
        (["--", "--mode", "socks5"], ["--mode"]),
        (["--", "--set"], ["NAME=VALUE"]),
    ]:
        assert cli.main(["run", *ca, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("bili: error:") and all(w in err for w in words), (argv, err)
    assert len(seen) == n


def test_the_launchers_take_set_and_merge_it(tmp_path, capsys):
    args = cli.build_parser().parse_args(["claude", "--confdir", str(tmp_path / "ca"), "--set", "bili_mode=observe",
                                          "--set", "bili_remind_at=0", "--listen-port", "9123"])
    args.extra = []
    plan = launch.plan_launch(AGENTS["claude"], args, env={"HOME": str(tmp_path), "PATH": ""}, cwd=tmp_path)
    sets = _sets(plan.command)
    assert [s for s in sets if s.startswith("bili_mode=")] == ["bili_mode=observe"]
    assert "bili_remind_at=0" in sets and plan.proxy_url == "http://127.0.0.1:9123"
    # --port stays as the old spelling of --listen-port
    old = cli.build_parser().parse_args(["claude", "--port", "9124"])
    assert old.port == 9124
    args = cli.build_parser().parse_args(["claude", "--confdir", str(tmp_path / "ca"), "--bili-mode", "fold",
                                          "--set", "bili_mode=observe", "--dry-run"])
    args.extra = []
    assert launch.launch(AGENTS["claude"], args) == 2
    assert "--bili-mode fold and --set bili_mode=observe disagree" in capsys.readouterr().err


def test_bili_run_rejects_a_bad_mode(tmp_path, capsys):
    assert cli.main(["run", "--mode", "nonsense", "--confdir", str(tmp_path)]) == 2
    assert "invalid --mode" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poll_health(opener: urllib.request.OpenerDirector, url: str, proc: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 20
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"bili run exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with opener.open(url, timeout=2) as r:
                return json.loads(r.read())
        except OSError as e:  # URLError, connection refused, timeout
            last = e
            time.sleep(0.2)
    pytest.fail(f"no answer from {url} within 20 s ({last}):\n{log.read_text(errors='replace')}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["reverse", "regular"])
def test_bili_run_serves_health(tmp_path, mode):
    port = _free_port()
    args = ["run", "--listen-port", str(port), "--data-dir", str(tmp_path / "data"),
            "--confdir", str(tmp_path / "ca")]
    if mode == "reverse":
        args += ["--mode", "reverse:http://127.0.0.1:9"]
        url = f"http://127.0.0.1:{port}/__bili/health"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    else:
        url = "http://bili.proxy/__bili/health"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))
    log = tmp_path / "bili.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*_bili_cmd(), *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_clean_env(), start_new_session=True)
    try:
        health = _poll_health(opener, url, proc, log)
    finally:
        _stop(proc)
    assert health["ok"] is True
    assert health["version"] == __version__
    assert health["mode"] == "fold"
    assert health["store"] is True
    assert (tmp_path / "data" / "bili.sqlite3").exists()
    assert (tmp_path / "ca" / "mitmproxy-ca-cert.pem").exists()


# -- options and start-up errors through the real CLI and mitmdump ---------------------------------------
def _run_cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*_bili_cmd(), *args], capture_output=True, text=True, env=_clean_env(),
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.e2e
def test_bili_run_with_an_option_after_dashdash_runs_bili_with_the_users_value(tmp_path):
    port = _free_port()
    log = tmp_path / "bili.log"
    args = ["run", "--listen-port", str(port), "--data-dir", str(tmp_path / "data"), "--confdir", str(tmp_path / "ca"),
            "--mode", "reverse:http://127.0.0.1:9", "--", "--set", "bili_mode=observe",
            "--set", f"bili_data_dir={tmp_path / 'data'}"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with log.open("wb") as out:
        proc = subprocess.Popen([*_bili_cmd(), *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_clean_env(), start_new_session=True)
    try:
        health = _poll_health(opener, f"http://127.0.0.1:{port}/__bili/health", proc, log)
        deadline = time.monotonic() + 10
        while "bili: ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _stop(proc)
    assert health["mode"] == "observe" and health["store"] is True
    text = log.read_text()
    assert "bili: ready (health answers: version" in text and "mode observe" in text
    assert "[bili] store at" in text


@pytest.mark.e2e
def test_a_bad_option_value_stops_mitmdump_with_the_choices(tmp_path):
    from tests.e2e.support import ADDON, MITMDUMP

    base = [str(MITMDUMP), "-s", str(ADDON), "--listen-host", "127.0.0.1", "--set", f"confdir={tmp_path / 'ca'}",
            "--set", f"bili_data_dir={tmp_path / 'data'}"]
    cases = [
        (["--set", "bili_mode=bogus"], "bili_mode='bogus' is not one of: fold, observe, passthrough"),
        (["--set", "bili_first_party=flod"], "bili_first_party='flod' is not one of: fold, observe"),
        (["--set", "bili_remind_at=-1"], "bili_remind_at=-1 must be 0 or more"),
        # mitmproxy itself would drop the addon without a word for these two
        (["--set", "bili_mode=fold", "--set", "bili_mode=observe"], "multiple values for bili_mode"),
        (["--set", "bili_remind_at=soon"], "bili_remind_at: not an integer: soon"),
    ]
    for extra, words in cases:
        r = subprocess.run([*base, "--listen-port", str(_free_port()), *extra], capture_output=True, text=True,
                           env=_clean_env(), stdin=subprocess.DEVNULL, timeout=60)
        assert r.returncode == 1, (extra, r.stdout, r.stderr)
        assert words in r.stdout + r.stderr, (extra, r.stdout, r.stderr)

    # through bili run: the same refusal, and bili says mitmdump did not start
    r = _run_cli(["run", "--listen-port", str(_free_port()), "--confdir", str(tmp_path / "ca"), "--data-dir",
                  str(tmp_path / "data"), "--set", "bili_mode=flod"])
    assert r.returncode == 1
    assert "bili_mode='flod' is not one of" in r.stdout + r.stderr
    assert "bili: error: mitmdump exited during start-up (code 1)" in r.stderr
    assert "bili: ready" not in r.stdout


@pytest.mark.e2e
def test_a_port_in_use_is_refused_in_bilis_terms(tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r = _run_cli(["run", "--listen-port", str(port), "--confdir", str(tmp_path / "ca"), "--quiet"])
    assert r.returncode == 1
    assert f"127.0.0.1:{port} is in use by another program" in r.stderr
    assert "--listen-port" in r.stderr and "--mode regular@" not in r.stderr + r.stdout


@pytest.mark.e2e
def test_mitmdump_answering_without_the_addon_is_an_error_not_ready(tmp_path, capsys):
    from tests.e2e.support import MITMDUMP

    port = _free_port()
    cmd = [str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", str(port), "--set",
           f"confdir={tmp_path / 'ca'}", "--mode", "reverse:http://127.0.0.1:9", "--set", "connection_strategy=lazy"]
    ready: list[dict] = []
    assert cli._serve(cmd, ("127.0.0.1", port), ready.append) == 1
    assert not ready
    assert "the bili addon did not load" in capsys.readouterr().err
    assert cli.port_in_use("127.0.0.1", port) is False  # stopped

    proxy = launch.SharedProxy(port, cmd, state=tmp_path / "state")
    with pytest.raises(launch.LaunchError, match="the bili addon did not load"):
        proxy.attach()
    assert cli.port_in_use("127.0.0.1", port) is False


# -- installed like a tool (pipx install . / uv tool install .) -----------------------------------------
@pytest.mark.e2e
def test_a_tool_style_install_gives_a_working_bili_from_any_directory(tmp_path):
    """What ``pipx install .`` and ``uv tool install .`` do: a non-editable install of the checkout into
    a venv of its own.  bili then runs from any directory and keeps its CA and store in the XDG data
    dir (the checkout's certs/ only serves a checkout install)."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "bili_addon", src / "bili_addon", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "tool-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(src)],
                       capture_output=True, text=True, timeout=600, env=_clean_env())
    if r.returncode != 0 and ("Could not find a version" in r.stderr or "NewConnectionError" in r.stderr):
        pytest.skip(f"PyPI not reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    bili = venv / "bin" / "bili"
    assert bili.is_file()

    home, elsewhere = tmp_path / "home", tmp_path / "some" / "project"
    elsewhere.mkdir(parents=True)
    env = {k: v for k, v in _clean_env().items() if not k.startswith(("XDG_", "BILI_"))}
    env.update(HOME=str(home), PATH=f"/usr/bin{os.pathsep}/bin")  # the venv is not on PATH: bili finds mitmdump
    r = subprocess.run([str(bili), "--help"], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60)
    assert r.returncode == 0 and "run" in r.stdout and "replay" in r.stdout, r.stderr
    data = home / ".local" / "share" / "bili-addon"
    r = subprocess.run([str(bili), "ca", "--json"], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["confdir"] == str(data / "certs")

    port = _free_port()
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(bili), "run", "--listen-port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tmp_path / "some", env=env, start_new_session=True)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))
    try:
        health = _poll_health(opener, "http://bili.proxy/__bili/health", proc, log)
    finally:
        _stop(proc)
    assert health["ok"] is True and health["store"] is True
    text = log.read_text()
    assert f"CA in {data / 'certs'}" in text and str(venv) in text  # the installed addon, the XDG CA
    assert (data / "bili.sqlite3").exists() and (data / "certs" / "mitmproxy-ca-cert.pem").exists()
    assert not list(elsewhere.iterdir()) and not (tmp_path / "some" / "certs").exists()


@pytest.mark.e2e
def test_the_readmes_plain_mitmdump_line_binds_loopback_and_uses_the_projects_ca(tmp_path):
    import re
    import shlex

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines()
                if ln.startswith(".venv/bin/mitmdump -s bili_addon/addon.py"))
    argv = shlex.split(line)
    assert argv[argv.index("--listen-host") + 1] == "127.0.0.1"
    assert "confdir=certs" in argv
    mitmdump = Path(sys.executable).parent / "mitmdump"
    port = _free_port()
    home = tmp_path / "home"
    cmd = [str(mitmdump), *argv[1:], "--listen-port", str(port), "--set", f"bili_data_dir={tmp_path / 'data'}"]
    log = tmp_path / "mitmdump.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_clean_env(HOME=str(home)), start_new_session=True)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))
    try:
        health = _poll_health(opener, "http://bili.proxy/__bili/health", proc, log)
    finally:
        _stop(proc)
    assert health["ok"] is True and health["mode"] == "observe"
    assert re.search(rf"proxy listening at 127\.0\.0\.1:{port}", log.read_text())
    assert (ROOT / "certs" / "mitmproxy-ca.pem").is_file()  # the project's CA, the one bili run uses
    assert not (home / ".mitmproxy").exists()
    if certs.checkout_root() == ROOT:
        assert certs.default_confdir() == ROOT / "certs"
