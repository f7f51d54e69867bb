"""Unit tests of transparent interception: the nftables rules and ip commands built for a namespace,
resolving the model hosts, what ``bili doctor`` says each mechanism needs, and the launcher glue
(``--transparent`` in the plan, the checks of a re-used proxy, ``bili run --transparent``'s refusals).
The real namespace is exercised end to end in tests/e2e/test_transparent_e2e.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from mitmproxy.test import tflow, tutils

from bili_addon import cli, launch, transparent
from bili_addon.agents import ANY_CA, BUNDLE_CA, NODE_CA
from bili_addon.transparent import Net, Redirect

ROOT_CAPS = (1 << 41) - 1
USER_CAPS = 0
MOUNTS_V2 = "35 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
MOUNTS_HYBRID = ("35 25 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro\n"
                 "36 35 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")


# -- names and addresses --------------------------------------------------------------------------------
def test_a_namespace_gets_its_own_slash_30_and_short_interface_names():
    a, b = Net(1), Net(transparent.MAX_INDEX)
    assert (a.host_ip, a.ns_ip) == ("10.231.0.5", "10.231.0.6")
    assert (b.host_ip, b.ns_ip) == ("10.231.255.253", "10.231.255.254")
    assert len(b.host_if) <= 15 and len(b.ns_if) <= 15  # the kernel's limit on interface names
    assert a.netns == "bili-1" and a.table == "bili_1"
    with pytest.raises(ValueError):
        Net(0)
    with pytest.raises(ValueError):
        Net(transparent.MAX_INDEX + 1)


def test_the_ruleset_redirects_model_destinations_and_nothing_else():
    net = Net(7)
    rules = transparent.ruleset(net, Redirect([("1.2.3.4", 443), ("5.6.7.8", 8443), ("1.2.3.4", 443)], 8788, 8787))
    assert rules.startswith("table ip bili_7 {")
    assert "elements = { 1.2.3.4 . 443, 5.6.7.8 . 8443 }" in rules  # sorted, no duplicates
    # the only DNAT to the transparent listener is for the set, and only from this namespace's veth
    assert re.findall(r".*dnat to 127\.0\.0\.1:8788.*", rules) == [
        '\t\tiifname "bili7h" ip daddr . tcp dport @models dnat to 127.0.0.1:8788']
    # the proxy's own port at the host end, for the parts of the program that honour HTTPS_PROXY
    assert f'iifname "bili7h" ip daddr {net.host_ip} tcp dport 8787 dnat to 127.0.0.1:8787' in rules
    assert f'ip saddr {net.ns_ip} oifname != "bili7h" masquerade' in rules
    assert 'iifname "bili7h" ip daddr . udp dport @models reject' in rules  # no HTTP/3 around the redirect
    assert "dport 53" not in rules  # the resolver is reachable as it is


def test_a_loopback_resolver_is_forwarded_from_the_host_end():
    net = Net(3)
    rules = transparent.ruleset(net, Redirect([("1.2.3.4", 443)], 9001, 9000, dns="127.0.0.53"))
    for proto in ("udp", "tcp"):
        assert f'iifname "bili3h" ip daddr {net.host_ip} {proto} dport 53 dnat to 127.0.0.53:53' in rules
    host = "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch corp.example\n"
    assert transparent.loopback_resolver(host) == "127.0.0.53"
    assert transparent.loopback_resolver("# x\nnameserver 10.0.0.2\nnameserver 127.0.0.1\n") is None
    assert transparent.loopback_resolver("") is None
    assert transparent.namespace_resolv_conf(host, net.host_ip) == (
        f"nameserver {net.host_ip}\noptions edns0 trust-ad\nsearch corp.example\n")


def test_an_empty_set_and_added_elements():
    rules = transparent.ruleset(Net(9), Redirect([], 1, 2))
    assert "elements" not in rules and "@models" in rules
    assert transparent.add_elements(Net(9), [("9.9.9.9", 443), ("8.8.8.8", 443)]) == (
        "add element ip bili_9 models { 8.8.8.8 . 443, 9.9.9.9 . 443 }\n")
    assert transparent.add_elements(Net(9), []) == ""


@pytest.mark.skipif(os.geteuid() != 0 or transparent.which("nft") is None, reason="nft -c needs root and nftables")
def test_nft_accepts_the_ruleset():
    for r in (Redirect([("1.2.3.4", 443)], 8788, 8787, "127.0.0.53"), Redirect([], 8788, 8787)):
        done = subprocess.run([transparent.which("nft"), "-c", "-f", "-"], input=transparent.ruleset(Net(11), r),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_setup_and_teardown_commands():
    net = Net(5)
    cmds = transparent.setup_commands(net)
    assert cmds[0] == ["ip", "netns", "add", "bili-5"]
    assert ["ip", "link", "add", "bili5h", "type", "veth", "peer", "name", "bili5n"] in cmds
    assert ["ip", "link", "set", "bili5n", "netns", "bili-5"] in cmds
    assert cmds[-1] == ["ip", "-n", "bili-5", "route", "add", "default", "via", net.host_ip]
    assert transparent.sysctls(net) == {"net/ipv4/conf/bili5h/route_localnet": "1"}  # this interface only
    assert transparent.teardown_commands(net) == [["nft", "delete", "table", "ip", "bili_5"],
                                                  ["ip", "link", "del", "bili5h"], ["ip", "netns", "del", "bili-5"]]


def test_exec_prefix_runs_as_the_sudo_user(monkeypatch):
    net = Net(2)
    assert transparent.exec_prefix(net, {"PATH": "/usr/bin"})[:4] == ["ip", "netns", "exec", "bili-2"]
    if os.geteuid() == 0 and transparent.which("setpriv"):
        p = transparent.exec_prefix(net, {"SUDO_UID": "1000", "SUDO_GID": "1000", "PATH": "/usr/bin"})
        assert p[4:] == ["setpriv", "--reuid=1000", "--regid=1000", "--init-groups", "--"]


# -- resolving ---------------------------------------------------------------------------------------------
def test_parse_dest():
    assert transparent.parse_dest("api.openai.com") == ("api.openai.com", 443)
    assert transparent.parse_dest("10.0.0.1:8443") == ("10.0.0.1", 8443)
    assert transparent.parse_dest(" Model.Example:444 ") == ("model.example", 444)
    with pytest.raises(ValueError):
        transparent.parse_dest(" ")


def test_resolve_takes_literals_resolves_names_and_notes_the_rest():
    def lookup(host, port):
        if host in ("gone.example", "gone2.example", "gone3.example"):
            raise socket.gaierror("Name or service not known")
        if host == "slow.example":
            time.sleep(3)
        return {"api.example": ["1.1.1.1", "1.1.1.2", "1.1.1.1"], "dual.example": ["2.2.2.2", "2001:db8::1"]}.get(host, [])

    dests, notes = transparent.resolve([("10.9.8.7", 443), ("api.example", 443), ("dual.example", 8443),
                                        ("gone.example", 443), ("slow.example", 443), ("2001:db8::5", 443),
                                        ("gone3.example", 443), ("gone2.example", 443)],
                                       timeout=1.0, lookup=lookup)
    assert sorted(dests) == [("1.1.1.1", 443), ("1.1.1.2", 443), ("10.9.8.7", 443), ("2.2.2.2", 8443)]
    text = "\n".join(notes)
    # the hosts that fail alike in one note (an offline machine does not print a line per model host)
    assert "3 hosts do not resolve (Name or service not known): gone.example, gone2.example, gone3.example" in text
    assert len(notes) == 3, notes
    assert "slow.example did not resolve within 1 s" in text
    assert "2001:db8::5 is an IPv6 address" in text


# -- what the machine supports -------------------------------------------------------------------------------
def test_capabilities_and_the_cgroup_mount():
    status = "Name:\tx\nCapEff:\t0000000000001000\n"
    caps = transparent.capabilities(status)
    assert transparent.has_cap(caps, transparent.CAP_NET_ADMIN) and not transparent.has_cap(caps, transparent.CAP_SYS_ADMIN)
    assert transparent.capabilities("nothing here") == 0
    assert transparent.cgroup2_root(MOUNTS_V2) == "cgroup2"
    assert transparent.cgroup2_root(MOUNTS_HYBRID) == "tmpfs"
    assert transparent.cgroup2_root("") is None


def _ok_run(*a, **kw):
    return subprocess.CompletedProcess(a[0], 0, "", "")


def _tools(tmp_path, *names):
    d = tmp_path / "bin"
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("#!/bin/sh\n")
        (d / n).chmod(0o755)
    return {"PATH": str(d)}


def test_netns_needs_root_ip_and_nft(tmp_path, monkeypatch):
    monkeypatch.setattr(transparent, "SBIN", ())  # only the PATH given
    env = _tools(tmp_path, "ip", "nft")
    found = {m.name: m for m in transparent.support(env, euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_V2, run=_ok_run)}
    assert found["netns"].ok, found["netns"].why
    user = {m.name: m for m in transparent.support(env, euid=1000, caps=USER_CAPS, mountinfo=MOUNTS_V2, run=_ok_run)}
    assert not user["netns"].ok and "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in user["netns"].why
    # a process with the two capabilities (not root) will do
    caps = 1 << transparent.CAP_NET_ADMIN | 1 << transparent.CAP_SYS_ADMIN
    assert {m.name: m for m in transparent.support(env, euid=1000, caps=caps, mountinfo=MOUNTS_V2,
                                                   run=_ok_run)}["netns"].ok
    bare = {m.name: m for m in transparent.support(_tools(tmp_path / "x"), euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_V2,
                                                   run=_ok_run)}["netns"]
    assert not bare.ok and "nft is not installed" in bare.why and "ip is not installed" in bare.why
    assert bare.fix == "apt-get install -y iproute2 nftables"

    def no_nf_tables(*a, **kw):
        return subprocess.CompletedProcess(a[0], 1, "", "Error: Could not process rule: Operation not supported")
    broken = {m.name: m for m in transparent.support(env, euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_V2,
                                                     run=no_nf_tables)}["netns"]
    assert not broken.ok and "nf_tables: Error: Could not process rule" in broken.why


def test_local_mode_needs_cgroup2_at_the_root_and_root(tmp_path, monkeypatch):
    monkeypatch.setattr(transparent, "SBIN", ())
    env = _tools(tmp_path, "ip", "nft")
    hybrid = {m.name: m for m in transparent.support(env, euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_HYBRID,
                                                     run=_ok_run)}["local"]
    assert not hybrid.ok
    assert ("/sys/fs/cgroup is tmpfs, not cgroup2 (cgroup2 is at /sys/fs/cgroup/unified; unshare and mount would "
            "bind it there)") in hybrid.why
    # with unshare and mount, a hybrid layout will do: the proxy gets the cgroup2 root bound over /sys/fs/cgroup
    bound = {m.name: m for m in transparent.support(_tools(tmp_path, "unshare", "mount"), euid=0, caps=ROOT_CAPS,
                                                    mountinfo=MOUNTS_HYBRID, run=_ok_run)}["local"]
    assert bound.cgroup_bind == "/sys/fs/cgroup/unified"
    assert "bound over /sys/fs/cgroup" in bound.why
    assert transparent.cgroup2_elsewhere(MOUNTS_HYBRID) == "/sys/fs/cgroup/unified"
    assert transparent.cgroup2_elsewhere(MOUNTS_V2) is None
    # a cgroup2 mount of a sub-cgroup (a container's view) is not the root the redirector needs
    assert transparent.cgroup2_elsewhere("36 35 0:31 /user.slice /mnt/cg rw - cgroup2 cgroup2 rw\n") is None
    user = {m.name: m for m in transparent.support(env, euid=1000, caps=USER_CAPS, mountinfo=MOUNTS_V2,
                                                   run=_ok_run)}["local"]
    assert not user.ok and "needs root" in user.why and user.missing == ["sudo"]
    v2 = {m.name: m for m in transparent.support(env, euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_V2,
                                                 run=_ok_run)}["local"]
    if os.path.exists("/sys/kernel/btf/vmlinux"):
        assert v2.ok, v2.why  # the redirector ships with mitmproxy
        assert v2.missing == []  # root without sudo: bili gives the proxy a shim


def test_doctor_lists_both_mechanisms_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(transparent, "SBIN", ())
    checks = launch.transparent_checks(_tools(tmp_path, "ip"), euid=0, caps=ROOT_CAPS, mountinfo=MOUNTS_HYBRID,
                                       run=_ok_run)
    by = {c.name: c for c in checks}
    assert set(by) == {"netns redirect", "local redirect"} and not any(c.required for c in checks)
    assert not by["netns redirect"].ok
    assert "nft is not installed; install with: apt-get install -y nftables" in by["netns redirect"].detail
    assert "--install-deps" in by["netns redirect"].detail
    assert "not cgroup2" in by["local redirect"].detail


def test_the_sudo_shim_runs_its_command_as_is(tmp_path):
    d = transparent.sudo_shim(tmp_path / "shim")
    out = subprocess.run([str(d / "sudo"), "--non-interactive", "--preserve-env", "echo", "-n", "ran"],
                         capture_output=True, text=True)
    assert out.stdout == "ran"


# -- the launcher glue ---------------------------------------------------------------------------------------
def test_a_reused_proxy_must_have_the_listener():
    mode = transparent.transparent_mode(8788)
    assert mode == "transparent@127.0.0.1:8788"
    assert transparent.proxy_lacks({"modes": ["regular", mode]}, mode) is None
    assert "no transparent@127.0.0.1:8788 listener (its modes: regular)" in transparent.proxy_lacks(
        {"modes": ["regular"]}, mode)
    assert "does not say its modes" in transparent.proxy_lacks({}, mode)
    assert transparent.local_mode("/usr/bin/node") == "local:node"
    assert transparent.local_mode("/opt/a-very-long-program-name") == "local:a-very-long-pro"  # the kernel's comm
    # and the launched program's pid: every thread of it, whatever the thread's name
    mode = transparent.local_mode("/usr/bin/claude", 4242)
    assert mode == "local:claude,4242"
    cmd = ["mitmdump", "--mode", "regular", "--mode", "local:claude", "--set", "x=local:claude"]
    assert transparent.with_mode(cmd, "local:claude", mode) == [
        "mitmdump", "--mode", "regular", "--mode", mode, "--set", "x=local:claude"]


def test_a_held_program_runs_with_the_pid_it_was_given_only_once_released(tmp_path):
    out = tmp_path / "out"
    held = launch.Held(["/bin/sh", "-c", f'echo "$$" > {out}'], dict(os.environ))
    time.sleep(0.3)
    assert not out.exists() and held.proc.poll() is None  # held: it has not run
    assert held.release().wait(timeout=10) == 0
    assert out.read_text().strip() == str(held.pid)  # exec'd in place: the pid local mode was given
    held.cancel()  # released: nothing to do

    never = launch.Held(["/bin/sh", "-c", f"touch {tmp_path / 'ran'}"], dict(os.environ))
    never.cancel()
    assert never.proc.returncode == 125 and not (tmp_path / "ran").exists()


def test_the_local_proxy_command_binds_the_cgroup2_root_in_its_own_mount_namespace(tmp_path):
    cmd = ["mitmdump", "-s", "addon.py"]
    assert transparent.local_proxy_command(cmd, None) == cmd
    wrapped = transparent.local_proxy_command(cmd, "/sys/fs/cgroup/unified")
    assert wrapped[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert wrapped[-4:] == ["/sys/fs/cgroup/unified", "mitmdump", "-s", "addon.py"]
    # the shell line binds $0 and execs the rest, arguments intact (a stand-in for mount shows it)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mount").write_text("#!/bin/sh\necho \"mount $*\"\n")
    (fake / "mount").chmod(0o755)
    out = subprocess.run(["sh", "-c", wrapped[7], wrapped[8], "printf", "%s|", "a b", "c"], capture_output=True,
                         text=True, env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert out.stdout == "mount --bind /sys/fs/cgroup/unified /sys/fs/cgroup\na b|c|"


def test_the_namespace_env_points_the_proxy_variables_at_the_host_end():
    env = {"HTTPS_PROXY": "http://127.0.0.1:8787", "https_proxy": "http://127.0.0.1:8787",
           "BILI_PROXY": "http://127.0.0.1:8787", "PI_PROXY": "http://127.0.0.1:8787",
           "HTTP_PROXY": "http://corp-proxy:3128", "SSL_CERT_FILE": "/ca.pem"}
    out = transparent.namespace_env(env, "http://10.231.0.5:8787")
    assert out["HTTPS_PROXY"] == out["https_proxy"] == out["BILI_PROXY"] == out["PI_PROXY"] == "http://10.231.0.5:8787"
    assert out["HTTP_PROXY"] == "http://corp-proxy:3128" and out["SSL_CERT_FILE"] == "/ca.pem"


def test_the_child_without_a_mechanism_is_unchanged(tmp_path):
    with transparent.child(None, "", {}, [], 8787, ["prog", "a"], {"X": "1"}, print, tmp_path) as (argv, env):
        assert argv == ["prog", "a"] and env == {"X": "1"}
    with pytest.raises(transparent.TransparentError, match="no transparent@127.0.0.1:9 listener"):
        with transparent.child("netns", "transparent@127.0.0.1:9", {"modes": ["regular"]}, [], 8787, ["p"], {},
                               print, tmp_path):
            pass


def _dry_run(argv, extra, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(argv)
    args.extra = extra
    return args


def test_the_plan_adds_the_transparent_listener_and_the_redirect(capsys, monkeypatch, tmp_path):
    args = _dry_run(["claude", "--port", "9911", "--confdir", str(tmp_path / "ca"), "--dry-run", "--transparent",
                     "--redirect", "10.232.0.2", "--redirect", "model.example:8443"], [], capsys, monkeypatch, tmp_path)
    plan = launch.plan_launch(launch.AGENTS["claude"], args)
    assert plan.transparent == "netns" and plan.transparent_mode == "transparent@127.0.0.1:9912"
    assert plan.redirect == [("10.232.0.2", 443), ("model.example", 8443)]
    cmd = " ".join(plan.command)
    assert "--mode regular --mode transparent@127.0.0.1:9912" in cmd
    assert "10\\.232\\.0\\.2:443" in plan.allow and "model\\.example:8443" in plan.allow  # decrypted there
    assert launch.launch(launch.AGENTS["claude"], args) == 0
    out = capsys.readouterr().out
    assert "transparent netns: transparent@127.0.0.1:9912; redirects 10.232.0.2, model.example:8443" in out
    # without --redirect: every intercepted model host
    args = _dry_run(["codex", "--port", "9911", "--confdir", str(tmp_path / "ca"), "--transparent",
                     "--transparent-port", "7000"], [], capsys, monkeypatch, tmp_path)
    plan = launch.plan_launch(launch.AGENTS["codex"], args)
    assert plan.transparent_mode == "transparent@127.0.0.1:7000" and ("api.openai.com", 443) in plan.redirect
    assert plan.redirect == plan.hosts.hosts
    # local mode: the program's name
    args = _dry_run(["pi", "--port", "9911", "--confdir", str(tmp_path / "ca"), "--transparent=local"], [],
                    capsys, monkeypatch, tmp_path)
    plan = launch.plan_launch(launch.AGENTS["pi"], args)
    assert plan.transparent == "local" and "--mode local:pi" in " ".join(plan.command)


def test_a_program_gets_both_ca_variables(tmp_path):
    from bili_addon.certs import ensure_ca

    ca = ensure_ca(str(tmp_path / "ca"))
    env = launch.agent_env(launch.program_agent("/usr/bin/node"), {}, "http://127.0.0.1:1", ca)
    assert env[NODE_CA] == str(ca.cert) and env[BUNDLE_CA] == str(ca.combined) and env["REQUESTS_CA_BUNDLE"]
    assert launch.program_agent("/usr/bin/node").ca_var == ANY_CA


@pytest.mark.parametrize("argv, needle", [
    (["run", "--transparent"], "give it after --"),
    (["run", "--transparent", "--mode", "socks5", "--", "true"], "--mode cannot be combined with --transparent"),
    (["run", "--transparent", "--intercept", "all", "--", "true"], "--intercept all cannot be combined"),
    (["run", "--redirect", "1.2.3.4"], "go with --transparent"),
])
def test_bili_run_transparent_refusals(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_launch_refuses_a_mechanism_this_machine_lacks(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(transparent, "support", lambda *a, **kw: [
        transparent.Mechanism("netns", False, "nft is not installed", ["nftables"]),
        transparent.Mechanism("local", False, "no cgroup2")])
    args = _dry_run(["claude", "--port", "9911", "--confdir", str(tmp_path / "ca"), "--transparent"], [], capsys,
                    monkeypatch, tmp_path)
    monkeypatch.setattr(launch.shutil, "which", lambda *a, **kw: "/bin/true")
    assert launch.launch(launch.AGENTS["claude"], args) == 1
    err = capsys.readouterr().err
    assert "--transparent=netns does not work here: nft is not installed (install with: apt-get install -y " \
           "nftables, or give --install-deps)" in err


def test_health_lists_the_proxy_modes(bili):
    f = tflow.tflow(req=tutils.treq(method=b"GET", path=b"/__bili/health", host="127.0.0.1", port=8787))
    f.client_conn.peername = ("127.0.0.1", 50000)
    bili.request(f)
    doc = json.loads(f.response.content)
    assert doc["ok"] is True and doc["modes"] == ["regular"]


def test_the_refresher_adds_addresses_the_model_hosts_moved_to(tmp_path, monkeypatch):
    ns = transparent.Namespace([("api.example", 443)], 9001, 9000, state=tmp_path, refresh=0.01)
    ns.net, ns.redirect = Net(4), Redirect([("1.1.1.1", 443)], 9001, 9000)
    answers = iter([([("1.1.1.1", 443)], []), ([("1.1.1.1", 443), ("1.1.1.9", 443)], [])])
    monkeypatch.setattr(transparent, "resolve", lambda hosts: next(answers, ([("1.1.1.1", 443), ("1.1.1.9", 443)], [])))
    applied: list[str] = []

    def fake_run(cmd, *, input=None, check=True):
        applied.append(input)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ns, "_run", fake_run)
    import threading

    t = threading.Thread(target=ns._refresher, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not applied and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    ns._stop.set()
    t.join(5)
    assert applied == ["add element ip bili_4 models { 1.1.1.9 . 443 }\n"]  # once, only the new address
    assert ns.redirect.dests == [("1.1.1.1", 443), ("1.1.1.9", 443)]


def test_packages_are_installed_only_when_asked(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("install() refuses without root; this checks what it runs as root")
    log = tmp_path / "apt.log"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n")
    (fake / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    monkeypatch.setattr(transparent, "SBIN", ())
    state = {"installed": False}

    def support(*a, **kw):
        ok = state["installed"]
        return [transparent.Mechanism("netns", ok, "ok" if ok else "nft is not installed", [] if ok else ["nftables"]),
                transparent.Mechanism("local", False, "no")]

    monkeypatch.setattr(transparent, "support", support)
    with pytest.raises(transparent.TransparentError, match=r"install with: apt-get install -y nftables, or give "
                                                           r"--install-deps"):
        transparent.require("netns", install_deps=False, say=print)
    assert not log.exists(), "nothing is installed unless the user asks"
    said: list[str] = []
    with pytest.raises(transparent.TransparentError, match="nft is not installed"):  # the fake installs nothing
        transparent.require("netns", install_deps=True, say=said.append)
    assert log.read_text().splitlines() == ["update", "install -y --no-install-recommends nftables"]
    assert said == ["installing nftables with apt-get"]
    state["installed"] = True
    transparent.require("netns", install_deps=True, say=said.append)  # works: nothing more to do
    assert len(log.read_text().splitlines()) == 2


def test_a_program_intercepts_what_bili_run_intercepts(tmp_path):
    env = {"HOME": str(tmp_path), "OPENAI_BASE_URL": "https://gw.corp.example/v1"}
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text('[model_providers.x]\nbase_url = "https://codex-gw.example/v1"\n')
    hosts = set(launch.program_agent("./client").model_hosts(env, tmp_path).hosts)
    assert {("gw.corp.example", 443), ("codex-gw.example", 443)} <= hosts


@pytest.mark.skipif(os.geteuid() != 0 or transparent.which("nft") is None, reason="needs root and nftables")
def test_a_namespace_left_by_a_killed_launcher_is_removed_by_the_next(tmp_path, monkeypatch):
    # ip_forward is the machine's: the e2e test's namespace (another xdist worker) switches it too,
    # so this test's namespaces switch one of their own (every other key is the real one)
    forward_file = tmp_path / "ip_forward"
    forward_file.write_text("0\n")
    real = transparent.Namespace._sysctl

    def sysctl(self, key, value=None):
        if key != "net/ipv4/ip_forward":
            return real(self, key, value)
        if value is not None:
            forward_file.write_text(value)
            return value
        return forward_file.read_text().strip()

    monkeypatch.setattr(transparent.Namespace, "_sysctl", sysctl)
    forward = forward_file.read_text().strip()
    first = transparent.Namespace([("10.232.255.9", 443)], 1, 2, state=tmp_path, refresh=0).open()
    gone = first.net
    assert gone.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert forward_file.read_text().strip() == "1"
    # a mark inside the first namespace: the next launch may re-use the name, not the namespace
    subprocess.run(["ip", "-n", gone.netns, "addr", "add", "10.99.99.99/32", "dev", "lo"], check=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = tmp_path / f"transparent-{gone.index}.json"
    record.write_text(json.dumps({"index": gone.index, "pid": dead.pid}))  # its launcher was killed
    second = transparent.Namespace([("10.232.255.9", 443)], 1, 2, state=tmp_path, refresh=0).open()
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert second.net.netns in listed
        assert json.loads((tmp_path / f"transparent-{second.net.index}.json").read_text())["pid"] == os.getpid()
        if second.net.index == gone.index:
            assert "10.99.99.99" not in subprocess.run(["ip", "-n", gone.netns, "addr", "show", "lo"],
                                                       capture_output=True, text=True).stdout
        else:
            assert gone.netns not in listed and not record.exists()
    finally:
        second.close()
    assert second.net is None and not list(tmp_path.glob("transparent-*.json"))
    assert forward_file.read_text().strip() == forward == "0"


def test_the_default_transparent_port_is_one_that_can_be_had(capsys, monkeypatch, tmp_path):
    """port + 1 when free; a free one when another program holds port + 1 (mitmdump would exit with
    "address already in use"); the running bili proxy's own listener when it is re-used."""
    from fakehealth import health_server

    def plan_for(port):
        args = _dry_run(["claude", "--port", str(port), "--confdir", str(tmp_path / "ca"), "--dry-run",
                         "--transparent"], [], capsys, monkeypatch, tmp_path)
        return int(launch.plan_launch(launch.AGENTS["claude"], args).transparent_mode.rsplit(":", 1)[1])

    with socket.socket() as a, socket.socket() as b:  # two neighbouring free ports
        for _ in range(50):
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                a.close()
                a = socket.socket()
        else:
            pytest.skip("no two neighbouring free ports")
        a.close()  # the proxy's port: free; port + 1 held by another program
        b.listen()
        got = plan_for(port)
        assert got not in (port, port + 1) and not launch.port_in_use("127.0.0.1", got)
    assert plan_for(port) == port + 1  # both free again

    with health_server({"ok": True, "version": "x", "modes": ["regular", "transparent@127.0.0.1:7123"]}) as port:
        assert plan_for(port) == 7123  # the running proxy's listener, re-used


def test_the_ca_files_are_copied_where_the_user_behind_sudo_reads_them(tmp_path):
    """``sudo bili <agent> --transparent``: the program runs as the user behind sudo, its CA variables named
    files in root's 0700 data directory, which it could not read (every TLS connection failed)."""
    import pwd

    private = tmp_path / "root-data"
    private.mkdir(mode=0o700)
    cert, bundle = private / "ca.pem", private / "combined.pem"
    cert.write_text("CERT")
    bundle.write_text("BUNDLE")
    user = pwd.getpwnam("nobody") if os.geteuid() == 0 else pwd.getpwuid(os.getuid())
    env = {"NODE_EXTRA_CA_CERTS": str(cert), "SSL_CERT_FILE": str(bundle), "REQUESTS_CA_BUNDLE": str(bundle),
           "KEEP": "1"}
    folder = transparent.readable_cas(env, user.pw_uid, user.pw_gid)
    try:
        assert env["KEEP"] == "1" and env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] != str(bundle)
        for var, text in (("NODE_EXTRA_CA_CERTS", "CERT"), ("SSL_CERT_FILE", "BUNDLE")):
            copy = Path(env[var])
            assert copy.parent == Path(folder) and copy.read_text() == text
            assert copy.stat().st_uid == user.pw_uid and copy.stat().st_mode & 0o777 == 0o644
        assert Path(folder).stat().st_uid == user.pw_uid
    finally:
        shutil.rmtree(folder)
    assert transparent.readable_cas({"KEEP": "1"}, user.pw_uid, user.pw_gid) is None
