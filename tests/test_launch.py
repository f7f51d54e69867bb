"""The launcher (``bili <agent>``), ``bili doctor``, ``bili run`` as a system proxy, and the
first-party option of the addon.

Unit tests build host lists from sample configuration files in a temporary HOME, check the
``allow_hosts`` expression and each agent's environment.  The e2e tests run the launcher with fake
agents (small Python scripts named like the real ones) against real mitmdump processes: exit codes,
signals, re-use of a running proxy, nothing left behind, configuration files never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from mitmproxy import http
from mitmproxy.test import tflow, tutils

from bili_addon import agents, cli, launch, private
from fakehealth import health_server
from bili_addon.agents import AGENTS, allow_hosts_regex, intercept_plan, strip_jsonc
from bili_addon.certs import ensure_ca
from bili_addon.shell import first_party_claude

ROOT = Path(__file__).resolve().parents[1]
ROUTE_ADDON = ROOT / "tests" / "e2e" / "route_addon.py"
BUILTIN = {(h, 443) for h in agents.all_builtin_hosts()}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- sample configurations ------------------------------------------------------------------------------
def sample_configs(home: Path, project: Path) -> list[Path]:
    """One configuration per agent naming custom base URLs, in the places the agents read them."""
    (project / ".git").mkdir(parents=True, exist_ok=True)
    return [
        _write(home / ".claude" / "settings.json",
               json.dumps({"env": {"ANTHROPIC_BASE_URL": "https://claude-gw.corp.example:8443"}})),
        _write(project / ".claude" / "settings.local.json",
               json.dumps({"env": {"ANTHROPIC_BASE_URL": "https://claude-project.corp.example"}})),
        _write(home / ".codex" / "config.toml",
               'model = "gpt-5.1-codex"\n[model_providers.corp]\nname = "corp"\nbase_url = "https://codex-gw.corp.example/v1"\n'
               '[model_providers.local]\nbase_url = "http://127.0.0.1:11434/v1"\n'),
        _write(home / ".pi" / "agent" / "models.json",
               json.dumps({"providers": {"corp": {"baseUrl": "https://pi-gw.corp.example/v1", "api": "openai-completions"},
                                         "anthropic": {"baseUrl": "https://pi-anthropic.corp.example"}}})),
        _write(home / ".omp" / "agent" / "models.yml",
               "providers:\n  corp:\n    baseUrl: https://omp-gw.corp.example:9443/v1\n    api: openai-responses\n"),
        _write(project / "opencode.jsonc",
               '{\n  // the team gateway\n  "provider": {"anthropic": {"options": {"baseURL": "{env:OC_GATEWAY}/v1",},},},\n'
               '  /* trailing commas too */\n}\n'),
        _write(home / ".config" / "opencode" / "opencode.json",
               json.dumps({"provider": {"corp": {"options": {"baseURL": "https://oc-global.corp.example/v1"}}}})),
        _write(home / ".hermes" / "config.yaml",
               "model:\n  provider: custom\n  base_url: https://hermes-model.corp.example/v1\n"
               "providers:\n  corp:\n    base_url: https://hermes-gw.corp.example/v1\n    api_mode: chat_completions\n"),
    ]


@pytest.fixture
def home(tmp_path):
    h, p = tmp_path / "home", tmp_path / "home" / "src" / "proj"
    p.mkdir(parents=True)
    files = sample_configs(h, p)
    env = {"HOME": str(h), "PATH": os.environ.get("PATH", ""), "OC_GATEWAY": "https://oc-gw.corp.example"}
    return SimpleNamespace(home=h, project=p, files=files, env=env)


def hosts_of(name: str, home) -> set[tuple[str, int]]:
    return set(AGENTS[name].model_hosts(home.env, home.project).hosts)


def test_every_agent_has_a_subcommand_and_a_help_line():
    help_text = cli.build_parser().format_help()
    for name, agent in AGENTS.items():
        assert f"{name} " in help_text and f"run {agent.title} through the proxy" in help_text
    for name in AGENTS:
        assert cli.COMMANDS[name].passthrough and cli.COMMANDS[name].extra_name == "AGENT_ARGS"
    for name in ("doctor", "replay"):
        assert name in cli.COMMANDS
    assert "claude" in cli.build_parser().format_help()


def test_claude_base_urls_from_user_and_project_settings(home):
    got = hosts_of("claude", home)
    assert ("api.anthropic.com", 443) in got
    assert {("claude-gw.corp.example", 8443), ("claude-project.corp.example", 443)} <= got
    env = dict(home.env, ANTHROPIC_BASE_URL="https://from-env.corp.example")
    assert ("from-env.corp.example", 443) in AGENTS["claude"].model_hosts(env, home.project).hosts


def test_codex_providers_and_the_http_loopback_note(home):
    plan = AGENTS["codex"].model_hosts(home.env, home.project)
    assert {("api.openai.com", 443), ("chatgpt.com", 443), ("codex-gw.corp.example", 443)} <= set(plan.hosts)
    assert ("127.0.0.1", 11434) not in plan.hosts
    assert any("http://127.0.0.1:11434/v1" in n and "reverse" in n for n in plan.notes)
    env = dict(home.env, CODEX_HOME=str(home.home / "elsewhere"))
    assert ("codex-gw.corp.example", 443) not in AGENTS["codex"].model_hosts(env, home.project).hosts


def test_pi_omp_opencode_hermes_base_urls(home):
    assert {("pi-gw.corp.example", 443), ("pi-anthropic.corp.example", 443)} <= hosts_of("pi", home)
    assert ("omp-gw.corp.example", 9443) in hosts_of("omp", home)
    oc = hosts_of("opencode", home)
    assert {("oc-gw.corp.example", 443), ("oc-global.corp.example", 443)} <= oc  # {env:...}, JSONC, XDG
    assert {("hermes-model.corp.example", 443), ("hermes-gw.corp.example", 443)} <= hosts_of("hermes", home)
    pi_dir = home.home / "pi-elsewhere"
    _write(pi_dir / "models.json", json.dumps({"providers": {"x": {"baseUrl": "https://pi-dir.corp.example"}}}))
    env = dict(home.env, PI_CODING_AGENT_DIR=str(pi_dir))
    assert ("pi-dir.corp.example", 443) in AGENTS["pi"].model_hosts(env, home.project).hosts


def test_opencode_finds_project_config_up_to_the_git_root(home):
    sub = home.project / "pkg" / "deep"
    sub.mkdir(parents=True)
    assert ("oc-gw.corp.example", 443) in AGENTS["opencode"].model_hosts(home.env, sub).hosts


def test_a_broken_config_is_a_note_not_a_crash(home):
    _write(home.home / ".pi" / "agent" / "models.json", "{not json")
    plan = AGENTS["pi"].model_hosts(home.env, home.project)
    assert any("cannot read" in n for n in plan.notes)
    assert ("api.anthropic.com", 443) in plan.hosts


def test_strip_jsonc_keeps_strings_intact():
    text = '{"a": "http://x//y /* no */", // c\n "b": [1, 2,], /* d */ "c": "\\"//"}'
    assert json.loads(strip_jsonc(text)) == {"a": "http://x//y /* no */", "b": [1, 2], "c": '"//'}


def test_intercept_plan_for_a_launch_and_for_bili_run(home):
    plan = intercept_plan(AGENTS["codex"], home.env, home.project, ["extra.corp.example", "other.example:8443"])
    hosts = plan.hosts
    assert hosts[:3] == [("api.openai.com", 443), ("chatgpt.com", 443), ("codex-gw.corp.example", 443)]
    assert BUILTIN <= set(hosts)  # so agents launched later can share the proxy
    assert ("claude-gw.corp.example", 8443) not in hosts  # another agent's custom host: not this launch's
    assert {("extra.corp.example", 443), ("other.example", 8443)} <= set(hosts)
    everyone = set(intercept_plan(None, home.env, home.project).hosts)
    assert {("claude-gw.corp.example", 8443), ("omp-gw.corp.example", 9443), ("hermes-gw.corp.example", 443)} <= everyone


def test_allow_hosts_regex_matches_host_and_port_exactly():
    rx = re.compile(allow_hosts_regex([("api.anthropic.com", 443), ("gw.corp.example", 8443)]), re.IGNORECASE)
    for ok in ("api.anthropic.com:443", "API.Anthropic.com:443", "gw.corp.example:8443"):
        assert rx.search(ok), ok
    for bad in ("api.anthropic.com.evil.example:443", "xapi.anthropic.com:443", "api.anthropic.com:8443",
                "gw.corp.example:443", "example.com:443", "apixanthropic.com:443", "160.79.104.10:443"):
        assert not rx.search(bad), bad
    with pytest.raises(ValueError):
        allow_hosts_regex([])


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_agent_environment(name, tmp_path):
    ca = ensure_ca(tmp_path / "ca")
    base = {"PATH": "/usr/bin", "HOME": str(tmp_path), "KEEP": "1"}
    env = launch.agent_env(AGENTS[name], base, "http://127.0.0.1:9999", ca)
    assert env["HTTPS_PROXY"] == env["https_proxy"] == "http://127.0.0.1:9999"
    assert env["BILI_PROXY"] == "http://127.0.0.1:9999" and env["KEEP"] == "1"
    assert "HTTP_PROXY" not in env and "http_proxy" not in env
    if name in ("claude", "pi", "omp", "opencode"):
        assert env["NODE_EXTRA_CA_CERTS"] == str(ca.cert)
        assert "SSL_CERT_FILE" not in env
    else:
        assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == str(ca.combined)
        assert "NODE_EXTRA_CA_CERTS" not in env
    assert env.get("CODEX_CA_CERTIFICATE") == (str(ca.combined) if name == "codex" else None)
    assert ("PI_PROXY" in env) == (name == "omp")
    assert base == {"PATH": "/usr/bin", "HOME": str(tmp_path), "KEEP": "1"}  # not mutated


def test_users_extra_node_cas_are_kept(tmp_path):
    ca = ensure_ca(tmp_path / "ca")
    theirs = _write(tmp_path / "corp.pem", "-----BEGIN CERTIFICATE-----\ncorp\n-----END CERTIFICATE-----\n")
    env = launch.agent_env(AGENTS["claude"], {"NODE_EXTRA_CA_CERTS": str(theirs)}, "http://127.0.0.1:1", ca)
    merged = Path(env["NODE_EXTRA_CA_CERTS"])
    assert merged.parent == ca.confdir and merged != ca.cert
    assert merged.read_bytes().startswith(theirs.read_bytes().rstrip())
    assert ca.cert.read_bytes() in merged.read_bytes()
    assert theirs.read_text().endswith("corp\n-----END CERTIFICATE-----\n")  # theirs untouched


def test_no_proxy_naming_a_model_host_is_reported():
    hosts = [("api.anthropic.com", 443), ("api.openai.com", 443)]
    assert launch.no_proxy_conflicts({"NO_PROXY": "localhost,.anthropic.com"}, hosts) == ["api.anthropic.com"]
    assert launch.no_proxy_conflicts({"no_proxy": "*"}, hosts) == ["api.anthropic.com", "api.openai.com"]
    assert launch.no_proxy_conflicts({"NO_PROXY": "127.0.0.1,localhost"}, hosts) == []
    # Claude Code takes space-separated entries too
    assert launch.no_proxy_conflicts({"NO_PROXY": "localhost api.anthropic.com"}, hosts) == ["api.anthropic.com"]
    assert launch.no_proxy_conflicts({"NO_PROXY": "localhost", "no_proxy": " api.openai.com\t"}, hosts) == [
        "api.openai.com"]


def test_the_agents_no_proxy_loses_the_model_hosts_only(tmp_path):
    """A NO_PROXY entry naming the agent's own model host took the agent around bili: the launcher only
    said so.  That entry goes; nothing else: a suffix or ``*`` names the user's other hosts too, another
    agent's host is not this one's, and where bili goes out through the user's proxy their NO_PROXY says
    what that proxy does not serve."""
    ca = ensure_ca(tmp_path / "ca")
    own = [("api.anthropic.com", 443)]
    env = launch.agent_env(AGENTS["claude"], {"NO_PROXY": "localhost API.anthropic.com:443 api.openai.com, .corp.example",
                                              "no_proxy": ".anthropic.com"}, "http://127.0.0.1:1", ca, hosts=own)
    assert env["NO_PROXY"] == "localhost,api.openai.com,.corp.example" and env["no_proxy"] == ".anthropic.com"
    assert launch.no_proxy_conflicts(env, own) == ["api.anthropic.com"]  # (the suffix: said, kept)
    assert launch.taken_out({"NO_PROXY": "api.anthropic.com"}, own) == ["api.anthropic.com"]
    keep = {"NO_PROXY": "localhost, 127.0.0.1"}  # (nothing to take out: as the user wrote it)
    assert launch.agent_env(AGENTS["claude"], keep, "http://127.0.0.1:1", ca, hosts=own)["NO_PROXY"] == keep["NO_PROXY"]
    assert launch.agent_env(AGENTS["claude"], {"NO_PROXY": "*"}, "http://127.0.0.1:1", ca, hosts=own)["NO_PROXY"] == "*"
    chained = launch.agent_env(AGENTS["claude"], {"NO_PROXY": "api.anthropic.com,.corp.example"}, "http://127.0.0.1:1",
                               ca, hosts=own, chained=True)
    assert chained["NO_PROXY"] == "api.anthropic.com,.corp.example"
    assert launch.taken_out({"NO_PROXY": "api.anthropic.com"}, own, chained=True) == []


def test_a_corporate_no_proxy_keeps_its_internal_hosts_direct(home, tmp_path):
    """HTTP(S)_PROXY is the corporate proxy, NO_PROXY sends .corp.example past it, and the agent's model
    host is an internal gateway there: the agent still reaches it (and every other internal host) as the
    user's NO_PROXY says, and the launcher warns that bili does not see it."""
    env = {**home.env, "HTTPS_PROXY": "http://proxy.corp.example:3128",
           "HTTP_PROXY": "http://proxy.corp.example:3128", "NO_PROXY": "localhost,127.0.0.1,.corp.example",
           "ANTHROPIC_BASE_URL": "https://llm.corp.example"}
    args = cli.build_parser().parse_args(["claude", "--port", "9911", "--confdir", str(tmp_path / "ca")])
    args.extra = []
    plan = launch.plan_launch(AGENTS["claude"], args, env=env, cwd=home.home)
    assert plan.upstream == "http://proxy.corp.example:3128"
    assert plan.env["NO_PROXY"] == "localhost,127.0.0.1,.corp.example" and plan.no_proxy == []
    assert any("NO_PROXY names llm.corp.example" in w and "goes out through your proxy" in w for w in plan.bypass)


def test_claude_settings_that_go_around_bili_are_said(home, tmp_path):
    """Claude Code applies its settings' env table over its environment: an HTTPS_PROXY or a NO_PROXY there
    took it around bili, without a word."""
    url, hosts = "http://127.0.0.1:8787", [("api.anthropic.com", 443)]
    claude = AGENTS["claude"]
    assert launch.settings_bypass(claude, home.env, home.project, url, hosts) == []
    user = _write(home.home / ".claude" / "settings.json", json.dumps({"env": {"HTTPS_PROXY": "http://proxy.corp:3128",
                                                                          "NO_PROXY": "localhost api.anthropic.com"}}))
    local = _write(home.project / ".claude" / "settings.local.json", json.dumps({"env": {"https_proxy": url + "/"}}))
    said = launch.settings_bypass(claude, home.env, home.project, url, hosts)
    assert len(said) == 2 and all(s.startswith(f"{user} sets env.") for s in said), said
    assert "env.HTTPS_PROXY=http://proxy.corp:3128" in said[0] and "bili does not edit the file" in said[0]
    assert "env.NO_PROXY=localhost api.anthropic.com, which names api.anthropic.com" in said[1]
    assert launch.settings_bypass(AGENTS["codex"], home.env, home.project, url, hosts) == []  # (no env table)
    assert json.loads(user.read_text())["env"]["NO_PROXY"] and local.exists()  # (read, never written)


def test_dry_run_prints_the_plan(home, tmp_path, capsys):
    p = cli.build_parser()
    args = p.parse_args(["codex", "--port", "9911", "--confdir", str(tmp_path / "ca"), "--dry-run",
                         "--first-party", "observe", "--set", "flow_detail=0", "-s", "extra.py"])
    args.extra = ["exec", "hi"]
    old = dict(os.environ)
    try:
        os.environ.update(home.env)
        os.environ["PATH"] = "/nonexistent"
        cwd = os.getcwd()
        os.chdir(home.project)
        try:
            assert launch.launch(AGENTS["codex"], args) == 0
        finally:
            os.chdir(cwd)
    finally:
        os.environ.clear()
        os.environ.update(old)
    out = capsys.readouterr().out
    assert "not found on PATH" in out and "argv       codex exec hi" in out
    assert "codex-gw.corp.example" in out and "base URL   https://codex-gw.corp.example/v1" in out
    assert "env        SSL_CERT_FILE=" in out and "env        HTTPS_PROXY=http://127.0.0.1:9911" in out
    assert re.search(r"command    \S*mitmdump .*--set allow_hosts=\^\(\?:api\\\.openai\\\.com:443\|", out)
    assert "--set bili_first_party=observe" in out and out.rstrip().endswith("--set flow_detail=0")
    assert f"-s {(home.project / 'extra.py').resolve()}" in out


@pytest.mark.parametrize("agent,argv", [("opencode", ["{p}"]), ("codex", ["exec", "-C", "{p}", "hi"]),
                                        ("codex", ["--cd={p}"]), ("codex", ["-C{p}"])])
def test_the_project_the_agent_is_given_names_its_model_hosts(home, tmp_path, agent, argv):
    """``bili opencode -- DIR``, ``bili codex -- -C DIR``: the agent works in DIR and reads its
    configuration there; the launcher read its own directory's, and DIR's gateway went untouched."""
    proj = tmp_path / "proj"
    (proj / ".codex").mkdir(parents=True)
    (proj / ".git").mkdir()
    (proj / "opencode.json").write_text(json.dumps({"provider": {"corp": {
        "npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "https://llm-gw.corp.example/v1"}}}}))
    (proj / ".codex" / "config.toml").write_text('[model_providers.corp]\nbase_url = "https://llm-gw.corp.example/v1"\n')
    args = cli.build_parser().parse_args([agent, "--port", "9911", "--confdir", str(tmp_path / "ca")])
    args.extra = [a.format(p=proj) for a in argv]
    plan = launch.plan_launch(AGENTS[agent], args, env=home.env, cwd=home.home)
    assert ("llm-gw.corp.example", 443) in plan.hosts.hosts
    args.extra = []
    assert ("llm-gw.corp.example", 443) not in launch.plan_launch(AGENTS[agent], args, env=home.env, cwd=home.home).hosts.hosts


def test_the_data_directory_is_the_proxys_as_it_reads_its_options(home, tmp_path, monkeypatch):
    """``--set bili_data_dir=DIR`` is ``--data-dir DIR`` (README): the proxy took DIR and its token, the
    launcher and the agent's ``bili mcp`` the default directory's (a second launch then refused the proxy:
    "does not prove it holds this install's admin token").  A caller's own $BILI_DATA_DIR never reaches
    the agent in place of the proxy's."""
    p = cli.build_parser()
    mine = tmp_path / "mine"
    env = {**home.env, "BILI_DATA_DIR": str(tmp_path / "elsewhere")}
    for argv, want in ((["--set", f"bili_data_dir={mine}"], mine), (["--data-dir", str(mine)], mine), ([], None)):
        args = p.parse_args(["hermes", "--port", "9911", "--confdir", str(tmp_path / "ca"), *argv])
        args.extra = []
        plan = launch.plan_launch(AGENTS["hermes"], args, env=env, cwd=home.project)
        want = want.resolve() if want is not None else launch.default_data_dir(env).resolve()
        assert plan.data_dir == plan.env["BILI_DATA_DIR"] == str(want)


def test_a_transparent_runs_store_url_is_never_in_the_proxys_arguments(lab, monkeypatch):
    """``bili run --transparent --store URL``: the URL (its password) went into mitmdump's command line and
    the launcher's log, which ``bili run`` keeps it out of ($BILI_STORE)."""
    url = "postgresql://bili:s3cret-pw@db.example/bili"
    seen = {}

    class Proxy:
        stopped = False

        def __init__(self, port, command, *, quiet, token, env):
            seen.update(command=command, env=env)

        def attach(self):
            raise launch.LaunchError("stop here")

        def detach(self, hurry=None):
            pass

    monkeypatch.setattr(launch, "SharedProxy", Proxy)
    monkeypatch.setattr(launch.transparent, "require", lambda *a, **kw: None)
    monkeypatch.setattr(launch.transparent, "proxy_env", lambda mechanism, env, state: dict(env, NS="1"))
    for k, v in lab.env().items():
        monkeypatch.setenv(k, v)
    assert cli.main(["run", "--transparent", "--listen-port", str(free_port()), "--confdir", str(lab.confdir),
                     "--store", url, "--", "codex"]) == 1
    assert not any("s3cret-pw" in a for a in seen["command"])
    assert seen["env"]["BILI_STORE"] == url and seen["env"]["NS"] == "1"


# -- first-party Claude Code ------------------------------------------------------------------------------
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.fbe; cc_entrypoint=sdk-cli; cch=3f2a1;"


def first_party_body(**extra) -> bytes:
    # key order and spacing as Claude Code sends them; the billing block has no cache_control
    body = {
        "model": "claude-opus-4-8",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Run the tests, please."}]}],
        "system": [{"type": "text", "text": BILLING},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": json.dumps({"session_id": "fp-session-1"})},
        "max_tokens": 64000, "stream": True,
    }
    body.update(extra)
    return json.dumps(body, separators=(",", ":")).encode()


def anthropic_flow(content: bytes, host: str = "api.anthropic.com"):
    h = http.Headers(host=host, content_type="application/json", accept_encoding="gzip, br",
                     x_claude_code_session_id="fp-session-1")
    req = tutils.treq(method=b"POST", path=b"/v1/messages?beta=true", host=host, port=443, scheme=b"https",
                      headers=h, content=content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 50000)
    return f


def _raw_system(body: bytes) -> bytes:
    start = body.index(b'"system":[') + len(b'"system":[')
    return body[start:]


def test_first_party_detection():
    assert first_party_claude(first_party_body(), "api.anthropic.com")
    assert first_party_claude(first_party_body(), "API.anthropic.com.")
    assert not first_party_claude(first_party_body(), "gateway.corp.example")
    assert not first_party_claude(first_party_body(system="x-anthropic-billing-header: a"), "api.anthropic.com")
    assert not first_party_claude(first_party_body(system=[{"type": "text", "text": "hi"},
                                                           {"type": "text", "text": BILLING}]), "api.anthropic.com")
    assert not first_party_claude(b'{"system": [', "api.anthropic.com")


def test_fold_keeps_the_billing_block_first_and_byte_exact(bili):
    raw = first_party_body()
    f = anthropic_flow(raw)
    bili.request(f)
    sent = f.request.content
    assert sent != raw  # folded: tags and the prompt went in
    block = json.dumps({"type": "text", "text": BILLING}, separators=(",", ":")).encode()
    assert _raw_system(raw).startswith(block) and _raw_system(sent).startswith(block)
    system = json.loads(sent)["system"]
    assert system[0] == {"type": "text", "text": BILLING}
    assert system[1] == json.loads(raw)["system"][1]
    assert len(system) == 3 and "Context folding" in system[2]["text"]  # our prompt goes last
    assert f.request.headers["accept-encoding"] == "identity"
    assert bili._flows[f].rewriter.rewrite is True and f.metadata["bili"]["rendered"] is True


def test_observe_leaves_first_party_bodies_alone(bili):
    bili.tctx.configure(bili, bili_first_party="observe")
    raw = first_party_body()
    f = anthropic_flow(raw)
    bili.request(f)
    assert f.request.raw_content == raw
    assert f.request.headers["accept-encoding"] == "gzip, br"
    assert bili._flows[f].rewriter.rewrite is False  # answers pass unchanged too
    assert f.metadata["bili"]["rendered"] is False and "request" not in f.metadata["bili"]
    assert [(s["id"], s["refs"]) for s in bili.stats()["sessions"]] == [("fp-session-1", 1)]  # still recorded
    # a gateway, or a body without the billing block, is folded as usual
    other = anthropic_flow(raw, host="gateway.corp.example")
    bili.request(other)
    assert other.request.content != raw
    plain = first_party_body(system=[{"type": "text", "text": "You are a Claude agent."}])
    f2 = anthropic_flow(plain)
    bili.request(f2)
    assert f2.request.content != plain


# -- fake agents through the real launcher ----------------------------------------------------------------
FAKE_AGENT = r'''#!{python}
import json, os, signal, sys, time, urllib.request
out = os.environ["FAKE_AGENT_OUT"]
mode = os.environ.get("FAKE_AGENT_MODE", "exit")
rec = {{"pid": os.getpid(), "pgid": os.getpgrp(), "argv": sys.argv[1:], "signals": [],
       "env": {{k: os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE",
                                              "REQUESTS_CA_BUNDLE", "PI_PROXY", "BILI_PROXY", "HTTP_PROXY",
                                              "BILI_DATA_DIR", "NO_PROXY", "no_proxy")}}}}
def write():
    with open(out + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(out + ".tmp", out)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{"http": os.environ["HTTPS_PROXY"]}}))
try:
    rec["health"] = json.load(opener.open("http://bili.proxy/__bili/health", timeout=10))
except Exception as e:
    rec["health"] = str(e)
def on(sig, frame):
    rec["signals"].append(sig)
    write()
    sys.exit(40 + sig)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
write()
if mode == "wait":
    while True:
        time.sleep(0.05)
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(os.environ.get("FAKE_AGENT_CODE", "0")))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def wait_for(cond, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Lab:
    """A temporary HOME with fake agents on PATH, and launcher runs in it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.home = tmp / "home"
        self.project = self.home / "src" / "proj"
        self.project.mkdir(parents=True)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for a in AGENTS.values():
            p = self.bin / a.binary
            p.write_text(FAKE_AGENT.format(python=sys.executable))
            p.chmod(0o755)
        self.confdir = tmp / "ca"
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "xdg_runtime_dir")
               and not k.startswith(("BILI_", "XDG_")) and k != "NODE_EXTRA_CA_CERTS"}
        env.update(HOME=str(self.home), PATH=f"{self.bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                   f"{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def out(self, tag: str) -> Path:
        return self.tmp / f"agent-{tag}.json"

    def launch(self, agent: str, port: int, tag: str, mode: str = "exit", code: int = 0, args=(), launcher=(),
               **env) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "bili_addon.cli", agent, "-v", "--port", str(port), "--confdir",
               str(self.confdir), "--data-dir", str(self.tmp / "data"), *launcher, "--", *args]
        p = subprocess.Popen(cmd, cwd=self.project, env=self.env(FAKE_AGENT_OUT=str(self.out(tag)),
                                                                 FAKE_AGENT_MODE=mode, FAKE_AGENT_CODE=str(code), **env),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, text=True)
        self.procs.append(p)
        return p

    def bili_run(self, port: int, *args: str) -> subprocess.Popen:
        """``bili run`` of its own on ``port`` (``args``: its options), once its health answers."""
        run = subprocess.Popen([sys.executable, "-m", "bili_addon.cli", "run", "--listen-port", str(port), "--confdir",
                                str(self.confdir), "--quiet", *args], env=self.env(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(run)
        wait_for(lambda: launch.probe(port).kind == "bili", 30, "bili run")
        return run

    def record(self, tag: str, timeout: float = 30) -> dict:
        path = self.out(tag)
        wait_for(path.exists, timeout, f"the fake agent {tag}")
        return json.loads(path.read_text())

    def owner_pid(self, port: int) -> int | None:
        p = launch.state_dir(self.env()) / f"proxy-{port}.json"
        return json.loads(p.read_text())["pid"] if p.exists() else None

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        with contextlib.suppress(OSError, ValueError, TypeError):
            for f in launch.state_dir(self.env()).glob("proxy-*.json"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(json.loads(f.read_text())["pid"], signal.SIGKILL)


@pytest.fixture
def lab(tmp_path):
    lb = Lab(tmp_path)
    yield lb
    lb.cleanup()


def finish(p: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def started_pid(stderr: str) -> int:
    m = re.search(r"started the proxy on \S+ \(pid (\d+)", stderr)
    assert m, stderr
    return int(m.group(1))


@pytest.mark.e2e
def test_exit_code_environment_and_cleanup(lab):
    port = free_port()
    rc, out, err = finish(lab.launch("codex", port, "a", code=7, args=["exec", "--flag", "x y"]))
    assert rc == 7, err
    rec = lab.record("a")
    assert rec["argv"] == ["exec", "--flag", "x y"]
    assert rec["health"]["ok"] is True  # the proxy answered through HTTPS_PROXY's address
    env = rec["env"]
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["BILI_PROXY"] == f"http://127.0.0.1:{port}"
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == str(lab.confdir.resolve() / "combined-ca.pem")
    assert env["HTTP_PROXY"] is None
    proxy = started_pid(err)
    assert f"running {lab.bin / 'codex'} (pid {rec['pid']})" in err
    assert "codex exited with code 7" in err and f"stopped the proxy (pid {proxy})" in err
    assert not alive(proxy) and not alive(rec["pid"])
    assert lab.owner_pid(port) is None
    assert launch.probe(port).kind == "free"  # nothing listens there any more


@pytest.mark.e2e
def test_signals_reach_the_agent_and_its_code_comes_back(lab):
    port = free_port()
    p = lab.launch("omp", port, "t", mode="wait")
    rec = lab.record("t")
    assert rec["env"]["PI_PROXY"] == f"http://127.0.0.1:{port}"
    assert rec["env"]["NODE_EXTRA_CA_CERTS"] == str(lab.confdir.resolve() / "mitmproxy-ca-cert.pem")
    proxy = lab.owner_pid(port)
    assert proxy and alive(proxy)
    os.kill(p.pid, signal.SIGTERM)  # the launcher only, as a service manager would
    rc, _, err = finish(p)
    assert rc == 40 + signal.SIGTERM, err
    assert json.loads(lab.out("t").read_text())["signals"] == [signal.SIGTERM]
    assert not alive(proxy) and not alive(rec["pid"])

    p = lab.launch("pi", port, "i", mode="wait")
    rec = lab.record("i")
    os.kill(p.pid, signal.SIGINT)  # no terminal: the launcher forwards it
    rc, _, err = finish(p)
    assert rc == 40 + signal.SIGINT, err
    assert not alive(rec["pid"])


@pytest.mark.e2e
def test_an_agent_killed_by_a_signal_kills_the_launcher_the_same_way(lab):
    port = free_port()
    rc, _, err = finish(lab.launch("hermes", port, "k", mode="die"))
    assert rc == -signal.SIGKILL, err
    assert "stopped the proxy" in err
    assert not alive(started_pid(err))


@pytest.mark.e2e
def test_launchers_share_a_proxy_and_the_last_one_stops_it(lab):
    port = free_port()
    first = lab.launch("claude", port, "first", mode="wait")
    lab.record("first")
    proxy = lab.owner_pid(port)
    assert proxy and alive(proxy)

    rc, _, err = finish(lab.launch("opencode", port, "second", code=3))
    assert rc == 3, err
    assert "re-using the bili proxy" in err and "started the proxy" not in err
    assert alive(proxy), "the second launcher stopped a proxy the first one still uses"
    assert lab.record("second")["health"]["ok"] is True

    os.kill(first.pid, signal.SIGTERM)
    rc, _, err = finish(first)
    assert rc == 40 + signal.SIGTERM
    assert f"stopped the proxy (pid {proxy})" in err
    assert not alive(proxy)


@pytest.mark.e2e
def test_a_proxy_started_by_bili_run_is_reused_and_left_running(lab):
    port = free_port()
    run = subprocess.Popen([sys.executable, "-m", "bili_addon.cli", "run", "--listen-port", str(port), "--confdir",
                            str(lab.confdir), "--data-dir", str(lab.tmp / "data"), "--quiet"],
                           env=lab.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    lab.procs.append(run)
    wait_for(lambda: launch.probe(port).kind == "bili", 30, "bili run")
    rc, _, err = finish(lab.launch("claude", port, "r"))
    assert rc == 0, err
    assert "re-using the bili proxy" in err and "stopped the proxy" not in err and "keeps its own options" not in err
    assert run.poll() is None and launch.probe(port).kind == "bili"
    # options this launch cannot give the running proxy are said, even with -q (a passthrough asked for)
    rc, _, err = finish(lab.launch("claude", port, "q", launcher=("-q", "--bili-mode", "passthrough",
                                                                  "--set", "flow_detail=0")))
    assert rc == 0 and "re-using" not in err
    assert "keeps its own options; --bili-mode passthrough (it runs in fold), --set apply only" in err
    rec = lab.record("r")
    assert rec["health"]["ok"] is True
    # where the agent's `bili mcp` finds the proxy's admin token
    assert rec["env"]["BILI_DATA_DIR"] == str((lab.tmp / "data").resolve())


@pytest.mark.e2e
def test_a_bili_proxy_that_refuses_this_installs_token_is_not_reused(lab):
    """Another user's proxy (here: one with another data dir, hence another token) on the port: the
    agent's traffic, API keys included, must not go through it."""
    port = free_port()
    run = lab.bili_run(port, "--data-dir", str(lab.tmp / "someone-else"))
    rc, _, err = finish(lab.launch("claude", port, "t"))
    assert rc == 1 and "does not prove it holds this install's" in err, err
    assert not lab.out("t").exists()
    assert run.poll() is None  # not ours to stop


@pytest.mark.e2e
def test_a_port_held_by_something_else_is_an_error(lab):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def answer():
        with contextlib.suppress(OSError):
            while True:
                c, _ = srv.accept()
                c.recv(4096)
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno")
                c.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        rc, _, err = finish(lab.launch("claude", port, "x"))
    finally:
        srv.close()
    assert rc == 1 and "is in use by something that is not a bili proxy" in err
    assert not lab.out("x").exists()


def test_the_admin_token_is_never_sent_to_whatever_listens_on_the_port(tmp_path):
    """Something else on the port that answers health as bili does (another local user's listener):
    the launcher asked it with the install's token in a header, then refused it, too late.  It now
    sends a challenge only; the listener's answer cannot prove the token, so it is not ours."""
    token = "a-secret-admin-token-0123456789"
    seen: list[dict] = []
    with health_server({"ok": True, "version": "9.9", "mode": "fold", "proof": "0" * 64}, seen) as port:
        found = launch.probe(port, token=token)
    assert found.kind == "bili" and found.health["authenticated"] is False
    assert seen and not any(token in v for h in seen for v in h.values())


def test_a_bili_proxy_proves_it_holds_the_token(bili):
    """The health answer to a challenge (private.proof) is what the launcher checks."""
    from bili_addon import private
    from mitmproxy import http as mhttp
    from mitmproxy.test import tflow, tutils

    token = bili.load_token()
    req = tutils.treq(method=b"GET", path=b"/__bili/health", host="127.0.0.1", port=8787, scheme=b"http",
                      headers=mhttp.Headers(**{private.CHALLENGE_HEADER: "nonce-1"}), content=b"")
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 50000)
    bili.request(f)
    doc = json.loads(f.response.content)
    assert doc["proof"] == private.proof(token, "nonce-1") and doc["proof"] != private.proof(token, "nonce-2")
    assert token not in f.response.text


@pytest.mark.e2e
def test_a_reverse_proxy_on_the_port_is_not_reused_as_the_agents_https_proxy(lab):
    """`bili run --mode reverse:...` on the port: the launcher re-used it as HTTPS_PROXY, and every
    CONNECT of the agent got 400."""
    port = free_port()
    run = lab.bili_run(port, "--data-dir", str(lab.tmp / "data"), "--mode", "reverse:http://127.0.0.1:9")
    rc, _, err = finish(lab.launch("claude", port, "t"))
    assert rc == 1 and "not as a forward proxy" in err, err
    assert not lab.out("t").exists()
    assert run.poll() is None  # not ours to stop


@pytest.mark.e2e
def test_an_agent_run_with_the_store_unusable_is_told_so(lab):
    """The data dir is a file: the proxy starts, but passes every request through unchanged. The
    launcher said only "started the proxy" and ran the agent with bili off."""
    (lab.tmp / "a-file").write_text("not a directory")
    rc, _, err = finish(lab.launch("claude", free_port(), "t", launcher=("--data-dir", str(lab.tmp / "a-file"))))
    assert rc == 0 and "store is unusable" in err and "bili is off" in err, err
    assert lab.record("t")


def test_a_missing_agent_is_exit_127(lab, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("HOME", str(lab.home))
    args = cli.build_parser().parse_args(["claude", "--port", str(free_port()), "--confdir", str(lab.confdir)])
    args.extra = []
    assert launch.launch(AGENTS["claude"], args) == 127
    assert "npm install -g @anthropic-ai/claude-code" in capsys.readouterr().err


@pytest.mark.e2e
def test_configuration_files_are_never_written(lab):
    files = sample_configs(lab.home, lab.project)
    for f in files:
        os.utime(f, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = {str(f): (f.read_bytes(), f.stat().st_mtime_ns, f.stat().st_mode) for f in files}
    listing = sorted(str(p) for p in lab.home.rglob("*"))
    port = free_port()
    holder = lab.launch("claude", port, "holder", mode="wait", OC_GATEWAY="https://oc-gw.corp.example")
    lab.record("holder")
    for name in AGENTS:  # the holder started the proxy, these re-use it
        rc, _, err = finish(lab.launch(name, port, name, code=0, OC_GATEWAY="https://oc-gw.corp.example"))
        assert rc == 0, err
    os.kill(holder.pid, signal.SIGTERM)
    assert finish(holder)[0] == 40 + signal.SIGTERM
    rc, _, err = finish(lab.launch("codex", port, "dry", launcher=["--dry-run"]))
    assert rc == 0, err
    r = subprocess.run([sys.executable, "-m", "bili_addon.cli", "doctor", "--port", str(port), "--confdir",
                        str(lab.confdir)], env=lab.env(), cwd=lab.project, capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1), r.stderr
    after = {str(f): (f.read_bytes(), f.stat().st_mtime_ns, f.stat().st_mode) for f in files}
    assert after == before
    # nothing new next to them either (the launcher's own state lives under ~/.local/share/bili-addon)
    new = [p for p in sorted(str(p) for p in lab.home.rglob("*")) if p not in listing]
    state = str(lab.home / ".local" / "share" / "bili-addon")
    assert all(p.startswith(state) or state.startswith(p + "/") for p in new), new


# -- bili doctor -------------------------------------------------------------------------------------------
def test_doctor_reports_ca_port_store_and_agents(lab):
    pkg = lab.tmp / "node_modules" / "@anthropic-ai" / "claude-code"
    _write(pkg / "package.json", json.dumps({"name": "@anthropic-ai/claude-code", "version": "2.1.197"}))
    real = _write(pkg / "bin" / "claude.exe", "#!/bin/sh\nexit 0\n")
    real.chmod(0o755)
    (lab.bin / "claude").unlink()
    (lab.bin / "claude").symlink_to(real)
    env = lab.env()
    port = free_port()
    cmd = [sys.executable, "-m", "bili_addon.cli", "doctor", "--port", str(port), "--confdir", str(lab.confdir),
           "--data-dir", str(lab.tmp / "data"), "--json"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert r.returncode == 1 and doc["ok"] is False and not checks["CA"]["ok"]  # no CA yet
    assert "bili ca" in checks["CA"]["detail"]
    ensure_ca(lab.confdir)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert r.returncode == 0 and doc["ok"] is True, r.stdout
    assert checks["CA"]["ok"] and "key mode 600" in checks["CA"]["detail"]
    assert checks["port"]["ok"] and "is free" in checks["port"]["detail"]
    assert checks["store"]["ok"] and "not created yet" in checks["store"]["detail"]
    assert "Claude Code 2.1.197 at" in checks["agent claude"]["detail"]
    assert all(f"agent {n}" in checks for n in AGENTS)
    text = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "all required checks passed" in text and re.search(r"^ok\s+CA\s", text, re.M)


# -- bili run as the system proxy ---------------------------------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).seen.append((self.headers.get("host"), self.path, body))
        reply = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                            "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                            "usage": {"input_tokens": 3, "output_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def _tls_server(tmp: Path):
    """A TLS server on loopback with its own self-signed certificate (a host bili must tunnel)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tunnel-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp / "tunnel.pem").write_bytes(cert_pem)
    (tmp / "tunnel.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "tunnel.pem", tmp / "tunnel.key")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        with contextlib.suppress(OSError):
            while True:
                c, _ = srv.accept()
                try:
                    with ctx.wrap_socket(c, server_side=True) as t:
                        t.recv(4096)
                        t.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\nconnection: close\r\n\r\ntunnelled")
                except (OSError, ssl.SSLError):
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return srv, tmp / "tunnel.pem"


def _via_proxy(proxy_port: int, host: str, port: int, cafile: Path, path: str = "/", body: bytes | None = None):
    import http.client

    ctx = ssl.create_default_context(cafile=str(cafile))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy_port, timeout=20, context=ctx)
    conn.set_tunnel(host, port)
    try:
        conn.request("POST" if body is not None else "GET", path, body=body,
                     headers={"content-type": "application/json", "x-claude-code-session-id": "sys-proxy-1"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.e2e
def test_bili_run_as_a_system_proxy_intercepts_only_model_hosts(lab):
    _write(lab.home / ".codex" / "config.toml", '[model_providers.corp]\nbase_url = "https://codex-gw.corp.example/v1"\n')
    _Recorder.seen = []
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    tls, tls_cert = _tls_server(lab.tmp)
    port = free_port()
    log = lab.tmp / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "bili_addon.cli", "run", "--listen-port", str(port), "--confdir", str(lab.confdir),
             "--data-dir", str(lab.tmp / "data"), "--", "-s", str(ROUTE_ADDON), "--set",
             f"test_route=127.0.0.1:{fake.server_address[1]}", "--set", "connection_strategy=lazy",
             "--set", "bili_activate=always"],  # tags from the first request: the addon saw it
            env=lab.env(), cwd=lab.project, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    lab.procs.append(run)
    try:
        wait_for(lambda: launch.probe(port).kind == "bili", 30, "bili run")
        wait_for(lambda: "bili: ready" in log.read_text(), 30, "bili run's ready line")  # printed after health
        text = log.read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("TLS is decrypted for"))
        assert "api.anthropic.com" in line and "api.openai.com" in line
        assert "codex-gw.corp.example" in line  # read from the codex configuration
        assert "--set allow_hosts=" not in text  # (the instructions are human text, not the command)

        ca = lab.confdir / "mitmproxy-ca-cert.pem"
        body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}]}).encode()
        status, reply = _via_proxy(port, "api.anthropic.com", 443, ca, "/v1/messages", body)
        assert status == 200 and json.loads(reply)["content"][0]["text"] == "hello"
        host, path, upstream = _Recorder.seen[-1]
        assert host == "api.anthropic.com" and path == "/v1/messages"
        assert json.loads(upstream)["messages"][0]["content"].startswith("<acp ")  # the addon saw it

        # any other host is tunnelled: the client talks TLS with the server itself, not with bili
        status, reply = _via_proxy(port, "127.0.0.1", tls.getsockname()[1], tls_cert)
        assert (status, reply) == (200, b"tunnelled")
        with pytest.raises(ssl.SSLError):  # and bili's CA is not what that server shows
            _via_proxy(port, "127.0.0.1", tls.getsockname()[1], ca)
        assert len(_Recorder.seen) == 1
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(15)
        tls.close()
        fake.shutdown()


def _bili_run_intercepting(lab, port: int, host_port: int, **env: str):
    """``bili run`` on ``port`` decrypting 127.0.0.1:``host_port`` too (``env``: more of its environment),
    once it says it is ready: its process and its log."""
    log = lab.tmp / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "bili_addon.cli", "run", "--listen-port", str(port), "--confdir", str(lab.confdir),
             "--data-dir", str(lab.tmp / "data"), "--intercept-host", f"127.0.0.1:{host_port}"],
            env={**lab.env(), **env}, cwd=lab.project, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    lab.procs.append(run)
    wait_for(lambda: "bili: ready" in log.read_text(), 30, "bili run's ready line")
    return run, log


@pytest.mark.e2e
@pytest.mark.parametrize("var", ["NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE"])
def test_the_users_extra_cas_verify_an_intercepted_host_upstream(lab, var):
    """Behind a TLS-inspecting network the model host shows the inspector's certificate, which the user
    trusts through NODE_EXTRA_CA_CERTS (REQUESTS_CA_BUNDLE for Python agents, CODEX_CA_CERTIFICATE for
    codex).  With bili the agent no longer talks to the host, mitmdump does: it verified the host against
    the system roots only, and every request failed (502).  Here the host is a loopback server with a
    certificate of its own."""
    tls, tls_cert = _tls_server(lab.tmp)
    host_port = tls.getsockname()[1]
    port = free_port()
    run, log = _bili_run_intercepting(lab, port, host_port, **{var: str(tls_cert)})
    try:
        ca = lab.confdir / "mitmproxy-ca-cert.pem"
        assert _via_proxy(port, "127.0.0.1", host_port, ca) == (200, b"tunnelled")  # (decrypted: bili's CA to the client)
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(15)
        tls.close()


class _CorpProxy:
    """A corporate egress proxy on loopback: CONNECT tunnels to where it is asked (every one noted)."""

    def __init__(self):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.port, self.seen = self.srv.getsockname()[1], []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        with contextlib.suppress(OSError):
            while True:
                c, _ = self.srv.accept()
                threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c):
        with contextlib.suppress(OSError, ValueError), c:  # (ValueError: no CONNECT, a launcher's health probe)
            head = b""
            while b"\r\n\r\n" not in head:
                got = c.recv(4096)
                if not got:
                    return
                head += got
            method, target = head.split(b" ")[:2]
            self.seen.append((method.decode(), target.decode()))
            host, port = target.decode().rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as up:
                c.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                threading.Thread(target=self._pipe, args=(up, c), daemon=True).start()
                self._pipe(c, up)

    @staticmethod
    def _pipe(a, b):
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)


@pytest.mark.e2e
def test_the_users_own_proxy_is_bilis_way_out(lab):
    """Where egress must go through a corporate proxy (HTTPS_PROXY), the proxy bili started dialled every
    host directly (mitmdump does not read the variable), and everything failed there.  It goes out
    through that proxy now: the hosts it decrypts and those it tunnels untouched alike."""
    corp = _CorpProxy()
    tls, tls_cert = _tls_server(lab.tmp)
    model = _tls_server(lab.tmp / "model") if (lab.tmp / "model").mkdir() is None else None
    host_port, model_port = tls.getsockname()[1], model[0].getsockname()[1]
    port = free_port()
    run, log = _bili_run_intercepting(lab, port, model_port, HTTPS_PROXY=f"http://127.0.0.1:{corp.port}",
                                      NODE_EXTRA_CA_CERTS=str(model[1]))
    try:
        assert f"goes out through the proxy http://127.0.0.1:{corp.port}" in log.read_text()
        ca = lab.confdir / "mitmproxy-ca-cert.pem"
        assert _via_proxy(port, "127.0.0.1", model_port, ca) == (200, b"tunnelled")  # decrypted by bili
        assert _via_proxy(port, "127.0.0.1", host_port, tls_cert) == (200, b"tunnelled")  # tunnelled untouched
        assert ("CONNECT", f"127.0.0.1:{model_port}") in corp.seen and ("CONNECT", f"127.0.0.1:{host_port}") in corp.seen
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(15)
        tls.close()
        model[0].close()
        corp.srv.close()


def test_the_agents_bundle_and_the_upstream_trust_keep_the_users_extra_cas(tmp_path):
    ca = ensure_ca(tmp_path / "ca")
    corp = _write(tmp_path / "corp.pem", "-----BEGIN CERTIFICATE-----\ncorp\n-----END CERTIFICATE-----\n")
    bundle = _write(tmp_path / "bundle.pem", "-----BEGIN CERTIFICATE-----\npy\n-----END CERTIFICATE-----\n")
    env = {"NODE_EXTRA_CA_CERTS": str(corp), "REQUESTS_CA_BUNDLE": str(bundle)}
    trust = Path(launch.upstream_trust(ca, env)).read_bytes()
    assert b"corp\n" in trust and b"py\n" in trust and trust.count(b"BEGIN CERTIFICATE") > 2  # (the system roots too)
    agent = launch.agent_env(AGENTS["codex"], env, "http://127.0.0.1:1", ca)
    mine = Path(agent["SSL_CERT_FILE"]).read_bytes()
    assert agent["REQUESTS_CA_BUNDLE"] == agent["SSL_CERT_FILE"] and ca.cert.read_bytes().strip() in mine
    assert b"corp\n" in mine and b"py\n" in mine
    own = {"REQUESTS_CA_BUNDLE": agent["REQUESTS_CA_BUNDLE"], "NODE_EXTRA_CA_CERTS": str(ca.cert),
           "CURL_CA_BUNDLE": str(ca.combined)}
    assert launch.upstream_trust(ca, own) == launch.upstream_trust(ca, {})  # (bili's own files are not extras)
    assert launch.upstream_trust(ca, {}) == launch.system_roots_for_upstream(ca.roots_source)


def test_codexs_own_ca_variable_is_the_users_and_gets_bilis_bundle(tmp_path):
    """codex reads CODEX_CA_CERTIFICATE before SSL_CERT_FILE: one the user set (a TLS inspector's) was
    neither trusted upstream (502 on every request) nor given bili's CA (codex then trusted the
    inspector's alone, and bili's certificates failed)."""
    ca = ensure_ca(tmp_path / "ca")
    corp = _write(tmp_path / "corp.pem", "-----BEGIN CERTIFICATE-----\ncorp\n-----END CERTIFICATE-----\n")
    env = {"CODEX_CA_CERTIFICATE": str(corp)}
    assert b"corp\n" in Path(launch.upstream_trust(ca, env)).read_bytes()
    agent = launch.agent_env(AGENTS["codex"], env, "http://127.0.0.1:1", ca)
    assert agent["CODEX_CA_CERTIFICATE"] == agent["SSL_CERT_FILE"] == agent["REQUESTS_CA_BUNDLE"]
    mine = Path(agent["CODEX_CA_CERTIFICATE"]).read_bytes()
    assert b"corp\n" in mine and ca.cert.read_bytes().strip() in mine and mine.count(b"BEGIN CERTIFICATE") > 2
    assert launch.upstream_trust(ca, {"CODEX_CA_CERTIFICATE": agent["CODEX_CA_CERTIFICATE"]}) == launch.upstream_trust(
        ca, {})  # (bili's own bundle, from an enclosing launch, is not the user's)
    assert launch.agent_env(launch.program_agent("/usr/bin/codex"), {}, "http://127.0.0.1:1", ca)[
        "CODEX_CA_CERTIFICATE"] == str(ca.combined)  # (bili run --transparent -- codex)


def test_bili_run_intercept_options_build_the_allow_list(tmp_path, monkeypatch):
    seen: list[list[str]] = []

    monkeypatch.setattr(cli, "_serve", lambda cmd, target, ready, env=None: seen.append(list(cmd)) or 0)
    monkeypatch.setattr(cli, "port_in_use", lambda host, port: False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = ["run", "--quiet", "--confdir", str(tmp_path / "ca")]
    cli.main(base + ["--intercept-host", "llm.corp.example:8443", "--first-party", "observe"])
    argv = seen[-1]
    allow = next(a for a in argv if a.startswith("allow_hosts="))[len("allow_hosts="):]
    assert re.search(allow, "llm.corp.example:8443") and re.search(allow, "api.anthropic.com:443")
    assert not re.search(allow, "github.com:443")
    assert "bili_first_party=observe" in argv
    cli.main(base + ["--intercept", "all"])
    assert not any(a.startswith("allow_hosts=") for a in seen[-1])
    cli.main(base + ["--mode", "reverse:https://api.anthropic.com"])
    assert not any(a.startswith("allow_hosts=") for a in seen[-1])  # a reverse proxy has one upstream
    cli.main(base + ["--mode", "regular", "--mode", "reverse:http://127.0.0.1:9@8788"])
    allow = next(a for a in seen[-1] if a.startswith("allow_hosts="))[len("allow_hosts="):]
    assert re.search(allow, "127.0.0.1:9") and re.search(allow, "api.openai.com:443")


def test_agent_version_from_npm_and_python_packages(tmp_path):
    pkg = tmp_path / "node_modules" / "@openai" / "codex"
    _write(pkg / "package.json", json.dumps({"name": "@openai/codex", "version": "0.171.0"}))
    js = _write(pkg / "bin" / "codex.js", "#!/usr/bin/env node\n")
    (tmp_path / "codex").symlink_to(js)
    assert launch.agent_version(str(tmp_path / "codex")) == "0.171.0"
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.12" / "site-packages" / "hermes_agent-0.19.0.dist-info").mkdir(parents=True)
    (venv / "lib" / "python3.12" / "site-packages" / "httpx-0.28.1.dist-info").mkdir()
    script = _write(venv / "bin" / "hermes", f"#!{venv}/bin/python\nfrom hermes_cli.main import main\n")
    assert launch.agent_version(str(script)) == "0.19.0"
    assert launch.agent_version(str(_write(tmp_path / "plain", "#!/bin/sh\n"))) == "unknown version"


# -- the launcher's edge cases (#20) ---------------------------------------------------------------------
SLOW_STOP = '''import os, time
class SlowStop:
    def done(self):
        open(os.environ["SLOW_STOP_MARK"], "w").close()
        time.sleep(20)
addons = [SlowStop()]
'''


@pytest.mark.e2e
def test_ctrl_c_while_the_proxy_stops_keeps_the_agents_code_and_leaves_nothing(lab):
    script = lab.tmp / "slow_stop.py"
    script.write_text(SLOW_STOP)
    mark = lab.tmp / "stopping"
    port = free_port()
    p = lab.launch("claude", port, "c", code=5, launcher=["-s", str(script)], SLOW_STOP_MARK=str(mark))
    wait_for(mark.exists, 60, "the proxy to start stopping")
    os.kill(p.pid, signal.SIGINT)  # as Ctrl-C would, while the launcher waits for the proxy to exit
    rc, _, err = finish(p)
    assert rc == 5, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    proxy = started_pid(err)
    assert f"stopped the proxy (pid {proxy})" in err
    assert not alive(proxy)  # hurried: killed at once rather than after the grace period
    assert lab.owner_pid(port) is None
    assert not list((launch.state_dir(lab.env()) / f"proxy-{port}.users").iterdir())


@pytest.mark.e2e
def test_a_stale_codex_app_server_is_explained(lab):
    dead = free_port()
    daemon = subprocess.Popen([str(lab.bin / "codex"), "app-server", "--listen", "stdio"],
                              env=lab.env(FAKE_AGENT_OUT=str(lab.out("daemon")), FAKE_AGENT_MODE="wait",
                                          HTTPS_PROXY=f"http://127.0.0.1:{dead}"),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    lab.procs.append(daemon)
    lab.record("daemon")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    assert launch.stale_daemons(AGENTS["codex"], url) == [(daemon.pid, f"http://127.0.0.1:{dead}")]
    assert launch.stale_daemons(AGENTS["codex"], f"http://127.0.0.1:{dead}") == []  # the same proxy: fine
    assert launch.stale_daemons(AGENTS["claude"], url) == []  # claude has no daemons
    rc, _, err = finish(lab.launch("codex", port, "a", code=0))
    assert rc == 0, err
    assert (f"a background codex app-server (pid {daemon.pid}) still uses HTTPS_PROXY=http://127.0.0.1:{dead}, "
            "where nothing answers any more") in err
    assert f"kill {daemon.pid}" in err
    os.killpg(daemon.pid, signal.SIGKILL)
    daemon.wait(10)
    rc, _, err = finish(lab.launch("codex", port, "b", code=0))
    assert rc == 0 and "app-server" not in err, err


@pytest.mark.e2e
def test_a_reused_proxy_takes_the_agents_custom_model_hosts(lab):
    sample_configs(lab.home, lab.project)
    port = free_port()
    holder = lab.launch("claude", port, "holder", mode="wait")  # starts the proxy with claude's hosts
    lab.record("holder")
    rc, _, err = finish(lab.launch("codex", port, "codex"))
    assert rc == 0, err
    assert "re-using the bili proxy" in err
    assert "the proxy now decrypts codex-gw.corp.example:443 too" in err
    assert "may not be decrypted" not in err
    # asked again: already there, nothing to say
    rc, _, err = finish(lab.launch("codex", port, "again"))
    assert rc == 0 and "now decrypts" not in err, err
    token = private.read_token(lab.tmp / "data")
    assert launch.request_intercept(port, [("new.corp.example", 8443)]).startswith("HTTP 403")  # no token
    got = launch.request_intercept(port, [("codex-gw.corp.example", 443), ("new.corp.example", 8443)], token=token)
    assert isinstance(got, dict) and got["present"] == ["codex-gw.corp.example:443"]
    assert got["added"] == ["new.corp.example:8443"]
    bad = launch.request_intercept(port, [("bad host!", 443)], token=token)
    assert isinstance(bad, str) and bad.startswith("HTTP 400")
    os.kill(holder.pid, signal.SIGTERM)
    finish(holder)


def _intercept_flow(body: bytes, token: str):
    req = tutils.treq(method=b"POST", path=b"/__bili/intercept", host="bili.proxy", port=80, scheme=b"http",
                      headers=http.Headers(host="bili.proxy", content_type="application/json",
                                           x_bili_token=token), content=body)
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 50000)
    return f


def test_the_intercept_endpoint_adds_hosts_to_allow_hosts(bili):
    def call(body: dict | bytes):
        f = _intercept_flow(body if isinstance(body, bytes) else json.dumps(body).encode(), bili.token)
        bili.request(f)
        return f.response.status_code, json.loads(f.response.content)

    # decrypting everything (no allow_hosts): nothing to add
    status, doc = call({"hosts": ["gw.corp.example"]})
    assert status == 200 and doc["all"] is True and doc["added"] == []
    bili.tctx.options.update(allow_hosts=[allow_hosts_regex([("api.anthropic.com", 443)])])
    status, doc = call({"hosts": ["api.anthropic.com:443", "GW.corp.example", "gw.corp.example:8443"]})
    assert status == 200 and doc["added"] == ["gw.corp.example:443", "gw.corp.example:8443"]
    assert doc["present"] == ["api.anthropic.com:443"]
    allow = list(bili.tctx.options.allow_hosts)
    assert len(allow) == 2 and re.search(allow[1], "gw.corp.example:8443") and not re.search(allow[1], "gw.corp.example:9")
    assert call({"hosts": ["gw.corp.example:8443"]})[1]["added"] == []
    for bad in (b"not json", {"hosts": "gw"}, {"hosts": ["bad host"]}, {"hosts": ["gw:99999"]}, {"hosts": [1]}):
        status, doc = call(bad)
        assert status == 400 and doc["ok"] is False, bad
    assert len(bili.tctx.options.allow_hosts) == 2


# -- a re-used proxy's own CA --------------------------------------------------------------------------------
def test_a_reused_proxy_that_signs_with_another_ca_gives_the_agent_that_ca(tmp_path):
    """A proxy started from another checkout (its certs/), a pipx install or ``bili run --confdir`` keeps its
    own CA: the launcher gave the agent its own confdir's, and every request of the agent failed TLS."""
    from bili_addon import certs

    ours, theirs = ensure_ca(tmp_path / "ours"), ensure_ca(tmp_path / "theirs")
    fp = certs.sha256(theirs.cert.read_bytes())
    url = "http://127.0.0.1:1"
    assert launch.reused_ca(ours, {"ca_sha256": certs.sha256(ours.cert.read_bytes())}, url) is ours
    assert launch.reused_ca(ours, {"version": "0.1"}, url) is ours  # (a bili that does not say)
    ca = launch.reused_ca(ours, {"ca_sha256": fp, "ca_cert": str(theirs.cert)}, url)
    assert ca.confdir == ours.confdir and ca.cert.read_bytes().strip() == theirs.cert.read_bytes().strip()
    node = launch.agent_env(AGENTS["claude"], {}, url, ca)
    assert Path(node["NODE_EXTRA_CA_CERTS"]).read_bytes().strip() == theirs.cert.read_bytes().strip()
    bundle = Path(launch.agent_env(AGENTS["codex"], {}, url, ca)["SSL_CERT_FILE"]).read_bytes()
    assert theirs.cert.read_bytes().strip() in bundle and ours.cert.read_bytes().strip() not in bundle
    assert bundle.count(b"BEGIN CERTIFICATE") > 2  # (the system roots too)
    # only the certificate the proxy names: not the key, nor other certificates in the file
    mixed = _write(tmp_path / "mixed.pem", (theirs.key.read_text() + ours.cert.read_text()))
    ca = launch.reused_ca(ours, {"ca_sha256": fp, "ca_cert": str(mixed)}, url)
    assert b"PRIVATE KEY" not in ca.cert.read_bytes() and ca.cert.read_bytes().count(b"BEGIN CERTIFICATE") == 1
    assert certs.sha256(ca.cert.read_bytes()) == fp
    # a CA this launcher cannot read (or a file without it): refused, saying what to do
    for health in ({"ca_sha256": fp, "ca_cert": str(tmp_path / "gone.pem")}, {"ca_sha256": fp},
                   {"ca_sha256": fp, "ca_cert": str(ours.cert)}):
        with pytest.raises(launch.LaunchError, match="signs with another CA .*--confdir DIR"):
            launch.reused_ca(ours, health, url)


_HTTPS_AGENT = r'''#!{python}
# a Node agent's one request: HTTPS through HTTPS_PROXY to the model host, trusting NODE_EXTRA_CA_CERTS
import http.client, json, os, ssl
rec = {{"ca": os.environ.get("NODE_EXTRA_CA_CERTS")}}
try:
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(os.environ["NODE_EXTRA_CA_CERTS"])
    host, port = os.environ["HTTPS_PROXY"].split("://", 1)[1].rstrip("/").rsplit(":", 1)
    c = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=20)
    c.set_tunnel("api.anthropic.com", 443)
    c.request("POST", "/v1/messages", body=json.dumps({{"model": "m", "max_tokens": 5,
              "messages": [{{"role": "user", "content": "hi"}}]}}), headers={{"content-type": "application/json"}})
    rec["status"] = c.getresponse().status
except Exception as e:
    rec["error"] = repr(e)
open(os.environ["FAKE_AGENT_OUT"], "w").write(json.dumps(rec))
'''


@pytest.mark.e2e
def test_a_reused_proxy_with_a_ca_of_its_own_serves_the_agent(lab):
    """``bili run --confdir A``, then ``bili claude --confdir B`` on its port: the agent's request through
    the re-used proxy succeeds (it trusts A), and the proxy's health names the CA it signs with."""
    from bili_addon import certs

    (lab.bin / "claude").write_text(_HTTPS_AGENT.format(python=sys.executable))
    _Recorder.seen = []
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    port, other = free_port(), lab.tmp / "other-ca"
    run = subprocess.Popen(
        [sys.executable, "-m", "bili_addon.cli", "run", "--listen-port", str(port), "--confdir", str(other),
         "--data-dir", str(lab.tmp / "data"), "--quiet", "--", "-s", str(ROUTE_ADDON), "--set",
         f"test_route=127.0.0.1:{fake.server_address[1]}", "--set", "connection_strategy=lazy"],
        env=lab.env(), cwd=lab.project, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    lab.procs.append(run)
    try:
        wait_for(lambda: launch.probe(port).kind == "bili", 30, "bili run")
        health = launch.probe(port).health
        assert health["ca_sha256"] == certs.sha256((other / "mitmproxy-ca-cert.pem").read_bytes())
        assert health["ca_cert"] == str((other / "mitmproxy-ca-cert.pem").resolve())
        rc, _, err = finish(lab.launch("claude", port, "t"))
        assert rc == 0, err
        assert f"signs with the CA in {health['ca_cert']}, not with this launch's" in err
        rec = lab.record("t")
        assert rec.get("status") == 200, rec
        assert Path(rec["ca"]).parent == lab.confdir.resolve()  # (a copy in this install's confdir)
        assert len(_Recorder.seen) == 1 and run.poll() is None
    finally:
        fake.shutdown()


# -- the user's HTTPS_PROXY: another bili is never chained to ------------------------------------------------
def test_an_https_proxy_that_is_another_bili_is_not_chained_to(tmp_path, monkeypatch):
    """`bili run` tells the user to export HTTPS_PROXY; a later launch on another port took that bili for a
    corporate proxy and went out through it: the other bili's CA is no system root, every request 502."""
    corp = _CorpProxy()
    with health_server({"ok": True, "version": "9.9", "mode": "fold"}) as other, contextlib.ExitStack() as done:
        done.callback(corp.srv.close)
        for url in (f"http://127.0.0.1:{other}", f"http://localhost:{other}/"):
            upstream, note = launch.user_upstream({"HTTPS_PROXY": url}, 8787)
            assert upstream is None and note.endswith("is a bili proxy: bili never chains to bili, it dials hosts directly")
        # a proxy on loopback that is not bili is still the way out
        assert launch.user_upstream({"HTTPS_PROXY": f"http://127.0.0.1:{corp.port}"}, 8787) == (
            f"http://127.0.0.1:{corp.port}", "")
        # bili run: the same
        seen: list[list[str]] = []
        monkeypatch.setattr(cli, "_serve", lambda cmd, target, ready, env=None: seen.append(list(cmd)) or 0)
        monkeypatch.setattr(cli, "port_in_use", lambda host, port: False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{other}")
        assert cli.main(["run", "--quiet", "--confdir", str(tmp_path / "ca")]) == 0
        assert "regular" in seen[-1] and not any(a.startswith("upstream:") for a in seen[-1])


@pytest.mark.e2e
def test_a_launch_with_https_proxy_at_another_bili_goes_out_directly(lab):
    other, port = free_port(), free_port()
    lab.bili_run(other, "--data-dir", str(lab.tmp / "data"))
    rc, _, err = finish(lab.launch("claude", port, "t", HTTPS_PROXY=f"http://127.0.0.1:{other}"))
    assert rc == 0, err
    assert f"your proxy http://127.0.0.1:{other} is a bili proxy: bili never chains to bili" in err
    assert "goes out through your proxy" not in err
    assert lab.record("t")["health"]["modes"] == ["regular"]  # (the proxy this launch started)


@pytest.mark.e2e
def test_the_agent_goes_through_bili_whatever_no_proxy_says(lab):
    """NO_PROXY space-separated (as Claude Code takes it) named the model host: the agent went around bili
    and the launcher said nothing; one in Claude's settings.json, nothing either."""
    _write(lab.home / ".claude" / "settings.json", json.dumps({"env": {"NO_PROXY": "api.anthropic.com"}}))
    rc, _, err = finish(lab.launch("claude", free_port(), "t", NO_PROXY="localhost api.anthropic.com",
                                   no_proxy="*"))
    assert rc == 0, err
    assert "NO_PROXY names api.anthropic.com" in err and "taken out of claude's NO_PROXY" in err
    assert f"{lab.home / '.claude' / 'settings.json'} sets env.NO_PROXY=api.anthropic.com" in err
    assert "a suffix or * names your other hosts too" in err  # (no_proxy=*: said, kept)
    env = lab.record("t")["env"]
    assert env["NO_PROXY"] == "localhost" and env["no_proxy"] == "*"


def test_a_launch_re_using_a_proxy_of_another_ca_writes_bundles_of_its_own(tmp_path):
    """Two launches share one confdir and the user's corporate CAs: launch A runs its own proxy, launch
    B re-uses one that signs with another CA.  B's agent gets bundles of that CA, in files of its own:
    the ones A's running agent reads still hold the CA A's proxy signs with."""
    from bili_addon import certs

    ours, other, corp = (ensure_ca(tmp_path / n) for n in ("ours", "other", "corp"))
    env = {"NODE_EXTRA_CA_CERTS": str(corp.cert), "REQUESTS_CA_BUNDLE": str(corp.cert), "HOME": str(tmp_path)}
    our_pem = Path(ours.cert).read_bytes().strip()
    for name, var in (("claude", "NODE_EXTRA_CA_CERTS"), ("hermes", "SSL_CERT_FILE"), ("codex", "SSL_CERT_FILE")):
        a = launch.agent_env(AGENTS[name], env, "http://127.0.0.1:1", ours)
        theirs = certs.proxy_ca(ours, Path(other.cert).read_bytes())  # (what reused_ca gives launch B)
        b = launch.agent_env(AGENTS[name], env, "http://127.0.0.1:2", theirs)
        assert a[var] != b[var], name
        assert our_pem in Path(a[var]).read_bytes(), name
        assert Path(other.cert).read_bytes().strip() in Path(b[var]).read_bytes(), name


def test_the_probe_of_a_loopback_proxy_gives_up_while_it_still_answers():
    """A local corporate proxy (cntlm, px) that answers a byte at a time: whether it is a bili is asked
    with one deadline in all, not a timeout per byte, and it is chained to as the user's proxy."""
    finished = threading.Event()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        c, _ = srv.accept()
        with c:
            c.recv(4096)
            for b in b"HTTP/1.1 407 Proxy Auth Required\r\nX-Slow: yes\r\n\r\n":
                try:
                    c.send(bytes([b]))
                except OSError:
                    break
                time.sleep(0.4)
        finished.set()

    threading.Thread(target=serve, daemon=True).start()
    try:
        url, why = launch.user_upstream({"HTTPS_PROXY": f"http://127.0.0.1:{srv.getsockname()[1]}"}, 8787)
        assert not finished.is_set(), "the launch waited for the whole answer"
        assert url == f"http://127.0.0.1:{srv.getsockname()[1]}" and why == ""
    finally:
        srv.close()
