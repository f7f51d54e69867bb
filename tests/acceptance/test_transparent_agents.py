"""The real agents through ``bili <agent> --transparent``, with no proxy variable at all: Claude Code
(netns, local, and netns with ``bili mcp``), codex and pi (netns).

Each agent is started by a wrapper that drops every proxy variable the launcher gives it (an agent
that ignores ``HTTPS_PROXY``): its model traffic reaches bili only through the redirect, and a test
addon in the proxy logs the listener of every request.  The launcher runs in a mount namespace of
the test's own, whose ``/etc/resolv.conf`` names a DNS server of the test (:mod:`.fake_dns`, on a
loopback address) that answers the model hosts with an IPv4 and an IPv6 address of the test and
NXDOMAIN for every other name: bili resolves the model hosts there as it does on a real machine, the
agent in the namespace asks the same server through the namespace's forwarded resolver, and no query
or connection leaves loopback.  Both addresses are added to ``lo`` for the test run: a connection
the redirect missed is refused here, not sent out.  The scripted model behind the test route addon
stands in for the provider, as in :mod:`.test_agents`, and the assertions are that test's: a
compress runs, the next requests carry the summary instead of the folded listings, nothing is left
running, the agent's configuration is untouched.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bili_addon import transparent
from tests.e2e.support import need_root_and_nft

from .conftest import PINS, _bin_of, base_env, free_port, installed, run_launcher, snapshot
from .fake_dns import FakeDns
from .test_agents import HTTP_FALLBACK, MCP_SERVER, PROMPT, _report, _write, assert_mcp_tools, assert_scripted_run

pytestmark = pytest.mark.acceptance

MODEL_HOST = "api.anthropic.com"
PI_HOST = "llm.pi.bili-test.invalid"
OPENAI_HOST = "api.openai.com"


def _addresses() -> tuple[str, str, str]:
    """(the model host's IPv4 and IPv6 address, the DNS server's address) of this test run."""
    k = os.getpid() % 16000 + 1
    v4 = ipaddress.ip_address("10.233.0.0") + k * 4 + 2
    v6 = ipaddress.ip_address("fd00:b111::") + k
    dns = ipaddress.ip_address("127.53.0.0") + k
    return str(v4), str(v6), str(dns)


@pytest.fixture
def resolver(tmp_path):
    need_root_and_nft()
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: the test's resolv.conf is bound in a mount namespace")
    v4, v6, dns_ip = _addresses()
    added = []
    try:
        for family, addr, extra in (("-4", f"{v4}/32", []), ("-6", f"{v6}/128", ["nodad"])):
            subprocess.run(["ip", family, "addr", "add", addr, "dev", "lo", *extra], check=True, capture_output=True)
            added.append(["ip", family, "addr", "del", addr, "dev", "lo"])
        dns = FakeDns(dns_ip, {h: [v6, v4] for h in (MODEL_HOST, PI_HOST, OPENAI_HOST)})
        try:
            conf = tmp_path / "resolv.conf"
            conf.write_text(f"nameserver {dns_ip}\noptions timeout:1 attempts:1\n")
            # the launcher (and the proxy it starts) see the test's resolv.conf, nothing else changes
            prefix = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                      'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf)]
            yield {"v4": v4, "v6": v6, "dns": dns, "prefix": prefix}
        finally:
            dns.close()
    finally:
        for cmd in added:
            subprocess.run(cmd, capture_output=True)


MODE_ADDON = Path(__file__).resolve().parent / "mode_addon.py"
MODE_LINE = re.compile(r"\[test-mode\] mode=(\S+) peer=(\S+) host=(\S+) path=(\S+)")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "PI_PROXY")


def _proxyless(tmp: Path, name: str, real: Path) -> Path:
    """A directory with ``name``: a wrapper that drops the proxy variables and runs the real agent
    under the same name (local mode captures processes by name); it records the environment it
    passes on in ``env.txt`` beside it."""
    d = tmp / "proxyless"
    (d / "real").mkdir(parents=True)
    (d / "real" / name).symlink_to(real)
    wrapper = d / name
    wrapper.write_text(f"#!/bin/sh\nunset {' '.join(PROXY_VARS)}\nenv > {d / 'env.txt'}\n"
                       f"exec {d / 'real' / name} \"$@\"\n")
    wrapper.chmod(0o755)
    return d


@pytest.fixture
def work(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    (cwd / "README.md").write_text("A scratch project for the acceptance run.\n")
    return tmp_path, home, cwd


def _need(mechanism: str) -> None:
    if mechanism == "local":
        local = {m.name: m for m in transparent.support()}["local"]
        if not local.ok:
            pytest.skip(f"--transparent=local does not work here: {local.why}")


def run_transparent(agent: str, args: list[str], *, env_extra: dict, mechanism: str, model, work, resolver,
                    launcher_args: list[str] = ()):
    """``bili AGENT --transparent=MECHANISM`` with the agent's proxy variables dropped."""
    _need(mechanism)
    tmp, home, cwd = work
    pin = PINS[agent]
    bins = _proxyless(tmp, pin.binary, _bin_of(pin, installed(pin), pin.binary))
    env = base_env(home, bins, **env_extra)
    # netns: a listener port of its own (the default, the proxy's port + 1, may be another test's)
    tport = ["--transparent-port", str(free_port())] if mechanism == "netns" else []
    run = run_launcher(agent, args, env=env, cwd=cwd, model=model, work=tmp, prefix=resolver["prefix"],
                       launcher_args=[f"--transparent={mechanism}", *tport, "-s", str(MODE_ADDON), *launcher_args])
    return run, bins


def assert_transparent(run, model, bins: Path, mechanism: str, host: str, resolver: dict) -> str | None:
    """The agent had no proxy variable; every model request came in by the redirect, for ``host``;
    in a namespace, the agent resolved the host through the namespace's resolver (its address
    returned)."""
    info = _report(run, model)
    given = dict(line.split("=", 1) for line in (bins / "env.txt").read_text().splitlines() if "=" in line)
    assert not set(PROXY_VARS) & set(given), sorted(set(PROXY_VARS) & set(given))
    lines = [m.groups() for m in MODE_LINE.finditer(run.proxy_log)]
    model_paths = {r.path.split("?", 1)[0] for r in model.model_requests()}
    mine = [ln for ln in lines if ln[3] in model_paths]
    assert mine and all(r.host.startswith(host) for r in model.model_requests()), info
    want = "transparent@127.0.0.1:" if mechanism == "netns" else "local:"
    assert all(mode.startswith(want) for mode, _peer, _host, _path in mine), mine
    if mechanism == "netns":
        m = re.search(r"runs in network namespace bili-\d+ \((10\.231\.[\d.]+)\)", run.stderr)
        assert m and all(peer == m.group(1) for _mode, peer, _host, _path in mine), (mine, info)
        asked = resolver["dns"].asked
        assert (host, 1, m.group(1)) in asked, asked  # A, from the namespace (forwarded at its host end)
        return m.group(1)
    # local: the agent's own pid is in the mode (it ran as the pid the launcher held)
    assert run.agent_pid and all(mode.endswith(f",{run.agent_pid}") for mode, _peer, _host, _path in mine), mine
    return None


@pytest.mark.parametrize("mechanism", transparent.MECHANISMS)
def test_claude_code_transparent(model, work, resolver, mechanism):
    tmp, home, cwd = work
    cfg = [_write(home / ".claude" / "settings.json", json.dumps({"env": {"BILI_TEST_MARK": "1"}}, indent=2) + "\n")]
    before = snapshot(cfg)
    run, bins = run_transparent("claude", ["-p", PROMPT, "--allowedTools", "Bash"], mechanism=mechanism,
                                env_extra={"ANTHROPIC_API_KEY": "sk-ant-api03-fake-bili-acceptance"},
                                model=model, work=work, resolver=resolver)
    assert_scripted_run(run, model, "anthropic", before, cfg)
    ns_ip = assert_transparent(run, model, bins, mechanism, MODEL_HOST, resolver)
    if ns_ip:  # offered an IPv6 address too, it came over IPv4 (the namespace has no IPv6)
        assert (MODEL_HOST, 28, ns_ip) in resolver["dns"].asked, resolver["dns"].asked


def test_claude_code_mcp_transparent(model, work, resolver):
    """bili's tools as Claude Code's own (``bili mcp``, started by the agent in the namespace): its
    calls reach the proxy's admin endpoints at the namespace's host end."""
    tmp, home, cwd = work
    mcp = _write(cwd / "bili-mcp.json", json.dumps({"mcpServers": {"bili": {"command": MCP_SERVER[0],
                                                                            "args": MCP_SERVER[1:]}}}))
    before = snapshot([mcp])
    run, bins = run_transparent(
        "claude", ["-p", PROMPT, "--mcp-config", str(mcp), "--allowedTools", "Bash,mcp__bili__compress"],
        mechanism="netns", model=model, work=work, resolver=resolver,
        env_extra={"ANTHROPIC_API_KEY": "sk-ant-api03-fake-bili-acceptance", "ENABLE_TOOL_SEARCH": "false"})
    assert_scripted_run(run, model, "anthropic", before, [mcp], mcp=True)
    assert_mcp_tools(model, "anthropic", "mcp__bili__compress")
    assert_transparent(run, model, bins, "netns", MODEL_HOST, resolver)
    m = re.search(r"runs in network namespace bili-\d+ \((10\.231\.[\d.]+)\)", run.stderr)
    tool = [ln for ln in MODE_LINE.finditer(run.proxy_log) if ln.group(4) == "/__bili/plugin/tool"]
    assert tool and all(ln.group(1) == "regular" and ln.group(2) == m.group(1) for ln in tool), tool


def test_pi_transparent(model, work, resolver):
    tmp, home, cwd = work
    models = {"providers": {"scripted": {
        "baseUrl": f"https://{PI_HOST}/v1", "api": "openai-completions", "apiKey": "sk-fake-pi",
        "models": [{"id": "gpt-scripted", "contextWindow": 200000, "maxTokens": 8000}]}}}
    cfg = [_write(home / ".pi" / "agent" / "models.json", json.dumps(models, indent=2) + "\n")]
    before = snapshot(cfg)
    run, bins = run_transparent("pi", ["-p", "--model", "scripted/gpt-scripted", PROMPT], mechanism="netns",
                                env_extra={}, model=model, work=work, resolver=resolver)
    assert_scripted_run(run, model, "chat", before, cfg)
    assert_transparent(run, model, bins, "netns", PI_HOST, resolver)


def test_codex_transparent(model, work, resolver):
    """netns only: under local mode codex's model traffic comes from a child process (the npm package's
    Node entry point spawns the native binary) on threads named tokio-rt-worker, which neither the
    launched pid nor the name matches."""
    mechanism = "netns"
    tmp, home, cwd = work
    cfg = [_write(home / ".codex" / "config.toml", 'model = "gpt-5.1-codex"\n')]
    before = snapshot(cfg)
    run, bins = run_transparent("codex", ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                                          PROMPT], mechanism=mechanism,
                                env_extra={"CODEX_API_KEY": "sk-fake-bili-acceptance", "CODEX_HOME": str(home / ".codex")},
                                model=model, work=work, resolver=resolver, launcher_args=HTTP_FALLBACK)
    assert_scripted_run(run, model, "responses", before, cfg)
    assert_transparent(run, model, bins, mechanism, OPENAI_HOST, resolver)
