"""The command line, the CA handling and scripts/bootstrap."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from glob import glob
from pathlib import Path

import pytest

from bili_addon import __version__, certs, cli

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

    def fake_exec(file, argv):
        seen.append(list(argv))
        raise OSError("not really")

    monkeypatch.setattr(os, "execvp", fake_exec)
    rc = cli.main(["run", "--listen-port", "9999", "--mode", "reverse:https://api.anthropic.com",
                   "--data-dir", str(tmp_path / "data"), "--confdir", str(tmp_path / "ca"),
                   "--bili-mode", "observe", "--", "--set", "flow_detail=0"])
    assert rc == 1 and len(seen) == 1
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
