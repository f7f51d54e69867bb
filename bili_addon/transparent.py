"""Transparent interception (Linux) for programs that ignore ``HTTPS_PROXY``.

``bili <agent> --transparent`` and ``bili run --transparent -- PROGRAM`` run the program where its
model traffic reaches bili whether or not it honours a proxy variable.  Two mechanisms:

``netns`` (the default)
    The program runs in a network namespace of its own, joined to this machine by a veth pair.
    An nftables table of its own (one per launch, removed at exit) does three things on the host
    end of the pair: outgoing TCP to the model hosts' addresses (resolved at start and every
    :data:`REFRESH` seconds, plus the ``--redirect`` override list) is DNAT'd to mitmproxy's
    transparent listener on 127.0.0.1 (``--mode transparent@127.0.0.1:PORT`` beside the regular
    one; mitmproxy reads the original destination with ``SO_ORIGINAL_DST``); the proxy's own port
    is reachable at the host end's address (``HTTPS_PROXY`` for the parts of the program that do
    honour it); everything else is masqueraded out as from this machine, untouched and not
    decrypted.  ``route_localnet`` is set on the host end only (DNAT to 127.0.0.1 needs it), and
    ``ip_forward`` is switched on while a namespace lives (and restored after the last one).
    Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` (iproute2) and ``nft`` (nftables).

``local``
    mitmproxy's own ``local`` redirect mode (an eBPF program in the root cgroup hands the sockets of
    processes with the program's name to mitmproxy).  Needs root, cgroup v2 mounted at
    /sys/fs/cgroup, kernel BTF and the ``mitmproxy-linux`` redirector; :func:`support` says which
    is missing.  mitmproxy starts the redirector through ``sudo`` even as root; without sudo, bili
    gives the proxy a ``sudo`` of its own that runs the command as is (root only).

Rules and commands are built as data here (unit-tested); :class:`Namespace` applies them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from bili_addon import procs

MECHANISMS = ("netns", "local")
SUBNET = ipaddress.ip_network("10.231.0.0/16")  # one /30 per namespace
MAX_INDEX = SUBNET.num_addresses // 4 - 1
REFRESH = 60.0  # seconds between re-resolutions of the model hosts (CDN addresses move)
RESOLVE_TIMEOUT = 5.0
STATE = Path("/run/bili-addon/transparent")  # machine-wide: namespaces, addresses and ip_forward are
APT = {"nft": "nftables", "ip": "iproute2", "sudo": "sudo"}
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")

CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF = 12, 21, 39
CGROUP2_FS = "cgroup2"


class TransparentError(RuntimeError):
    """Transparent interception cannot be set up here (said with the fix where there is one)."""


def apt_command(packages: Iterable[str]) -> str:
    return "apt-get install -y " + " ".join(sorted(set(packages)))


def which(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A system tool, on PATH or in the sbin directories (a user's PATH often lacks them)."""
    env = os.environ if env is None else env
    path = os.pathsep.join([env.get("PATH", ""), *SBIN])
    return shutil.which(name, path=path)


# -- addresses and names ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Net:
    """One namespace's names and addresses (index 1..MAX_INDEX)."""

    index: int

    def __post_init__(self) -> None:
        if not 1 <= self.index <= MAX_INDEX:
            raise ValueError(f"namespace index {self.index} out of range 1..{MAX_INDEX}")

    @property
    def netns(self) -> str:
        return f"bili-{self.index}"

    @property
    def host_if(self) -> str:  # at most 15 characters: bili16383h
        return f"bili{self.index}h"

    @property
    def ns_if(self) -> str:
        return f"bili{self.index}n"

    @property
    def table(self) -> str:
        return f"bili_{self.index}"

    @property
    def _base(self) -> ipaddress.IPv4Address:
        return SUBNET.network_address + self.index * 4  # type: ignore[return-value]

    @property
    def host_ip(self) -> str:
        return str(self._base + 1)

    @property
    def ns_ip(self) -> str:
        return str(self._base + 2)


Dest = tuple[str, int]  # (IPv4 address, TCP port)


@dataclass
class Redirect:
    """What the namespace's traffic does: ``dests`` go to the transparent listener ``tport``; the
    proxy's ``proxy_port`` is reachable at the host end; ``dns`` (a loopback resolver of this
    machine, or None) answers at the host end too."""

    dests: list[Dest]
    tport: int
    proxy_port: int
    dns: str | None = None


def _element(d: Dest) -> str:
    return f"{d[0]} . {int(d[1])}"


def ruleset(net: Net, r: Redirect) -> str:
    """The nftables table of one namespace (``nft -f -`` input)."""
    h = f'iifname "{net.host_if}"'
    lines = [f"table ip {net.table} {{",
             "\tset models {",
             "\t\ttype ipv4_addr . inet_service"]
    if r.dests:
        lines.append("\t\telements = { " + ", ".join(_element(d) for d in sorted(set(r.dests))) + " }")
    lines += ["\t}",
              "\tchain prerouting {",
              "\t\ttype nat hook prerouting priority dstnat; policy accept;",
              f"\t\t{h} ip daddr . tcp dport @models dnat to 127.0.0.1:{int(r.tport)}",
              f"\t\t{h} ip daddr {net.host_ip} tcp dport {int(r.proxy_port)} dnat to 127.0.0.1:{int(r.proxy_port)}"]
    if r.dns:
        for proto in ("udp", "tcp"):
            lines.append(f"\t\t{h} ip daddr {net.host_ip} {proto} dport 53 dnat to {r.dns}:53")
    lines += ["\t}",
              "\tchain postrouting {",
              "\t\ttype nat hook postrouting priority srcnat; policy accept;",
              f'\t\tip saddr {net.ns_ip} oifname != "{net.host_if}" masquerade',
              "\t}",
              "\tchain forward {",
              "\t\ttype filter hook forward priority filter; policy accept;",
              # HTTP/3 to a model host would pass by the redirect: refused, the client falls back to TCP
              f"\t\t{h} ip daddr . udp dport @models reject",
              "\t}",
              "}"]
    return "\n".join(lines) + "\n"


def add_elements(net: Net, dests: Iterable[Dest]) -> str:
    """``nft -f -`` input adding destinations to a live table's set."""
    items = sorted(set(dests))
    if not items:
        return ""
    return f"add element ip {net.table} models {{ " + ", ".join(_element(d) for d in items) + " }\n"


def setup_commands(net: Net) -> list[list[str]]:
    """The ``ip`` commands that make the namespace and its veth pair (run in order)."""
    n = net.netns
    return [
        ["ip", "netns", "add", n],
        ["ip", "link", "add", net.host_if, "type", "veth", "peer", "name", net.ns_if],
        ["ip", "link", "set", net.ns_if, "netns", n],
        ["ip", "addr", "add", f"{net.host_ip}/30", "dev", net.host_if],
        ["ip", "link", "set", net.host_if, "up"],
        ["ip", "-n", n, "link", "set", "lo", "up"],
        ["ip", "-n", n, "addr", "add", f"{net.ns_ip}/30", "dev", net.ns_if],
        ["ip", "-n", n, "link", "set", net.ns_if, "up"],
        ["ip", "-n", n, "route", "add", "default", "via", net.host_ip],
    ]


def sysctls(net: Net) -> dict[str, str]:
    """Host sysctls of the namespace's host end (path under /proc/sys -> value)."""
    return {f"net/ipv4/conf/{net.host_if}/route_localnet": "1"}


def teardown_commands(net: Net) -> list[list[str]]:
    """Undo :func:`setup_commands` and the table; each may fail (already gone) without harm."""
    return [["nft", "delete", "table", "ip", net.table],
            ["ip", "link", "del", net.host_if],
            ["ip", "netns", "del", net.netns]]


def exec_prefix(net: Net, env: Mapping[str, str] | None = None) -> list[str]:
    """The command prefix that runs a program in the namespace; under sudo, as the user who ran it."""
    env = os.environ if env is None else env
    prefix = ["ip", "netns", "exec", net.netns]
    uid, gid = env.get("SUDO_UID"), env.get("SUDO_GID")
    if os.geteuid() == 0 and uid and gid and uid != "0" and which("setpriv", env):
        prefix += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]
    return prefix


# -- the model hosts' addresses ---------------------------------------------------------------------
def parse_dest(item: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``IP`` or ``IP:PORT`` (port 443 by default)."""
    item = item.strip()
    m = re.fullmatch(r"(.+):(\d+)", item)
    if m and ":" not in m.group(1):
        return m.group(1).lower(), int(m.group(2))
    if not item:
        raise ValueError("empty destination")
    return item.lower(), 443


def _ipv4(host: str) -> str | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(ip) if ip.version == 4 else None


def resolve(hosts: Sequence[tuple[str, int]], timeout: float = RESOLVE_TIMEOUT,
            lookup: Callable[[str, int], list[str]] | None = None) -> tuple[list[Dest], list[str]]:
    """The IPv4 addresses of ``hosts`` (address literals as they are): ``(dests, notes)``; a host
    that does not resolve within ``timeout`` is a note, not an error."""
    def default_lookup(host: str, port: int) -> list[str]:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        return [i[4][0] for i in infos]

    lookup = lookup or default_lookup
    dests: list[Dest] = []
    notes: list[str] = []
    names = []
    failed: dict[str, list[str]] = {}
    for host, port in hosts:
        ip = _ipv4(host)
        if ip:
            dests.append((ip, port))
        elif ":" in host:
            notes.append(f"{host} is an IPv6 address: the namespace has IPv4 only, it is not redirected")
        else:
            names.append((host, port))
    if names:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(names)))
        futures = {pool.submit(lookup, h, p): (h, p) for h, p in names}
        try:
            for fut in concurrent.futures.as_completed(futures, timeout=timeout):
                h, p = futures[fut]
                try:
                    dests += [(ip, p) for ip in fut.result() if _ipv4(ip)]
                except OSError as e:
                    failed.setdefault(str(e), []).append(h)
        except concurrent.futures.TimeoutError:
            late = sorted(h for f, (h, _p) in futures.items() if not f.done())
            notes.append(f"{', '.join(late)} did not resolve within {timeout:.0f} s: not redirected yet")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    for why, hs in failed.items():  # one note per reason (a machine without DNS: every host, one line)
        hs = sorted(set(hs))
        notes.append(f"{hs[0]} does not resolve ({why}): its traffic is not redirected" if len(hs) == 1 else
                     f"{len(hs)} hosts do not resolve ({why}): {', '.join(hs)}; their traffic is not redirected")
    out: list[Dest] = []
    for d in dests:
        if d not in out:
            out.append(d)
    return out, notes


def loopback_resolver(resolv_conf: str) -> str | None:
    """The first nameserver of ``resolv.conf`` text when it is a loopback address (systemd-resolved's
    127.0.0.53): the namespace cannot reach it directly, so it is forwarded from the host end."""
    for line in resolv_conf.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                ip = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            return str(ip) if ip.version == 4 and ip.is_loopback else None
    return None


def namespace_resolv_conf(resolv_conf: str, host_ip: str) -> str:
    """The namespace's resolv.conf: the host end as its nameserver, the rest as on the host."""
    keep = [ln for ln in resolv_conf.splitlines() if ln.split()[:1] and ln.split()[0] in ("search", "domain", "options")]
    return "\n".join([f"nameserver {host_ip}", *keep]) + "\n"


# -- what this machine supports ---------------------------------------------------------------------
def capabilities(status: str | None = None) -> int:
    """The effective capability mask of this process (from /proc/self/status)."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return 0
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status, re.M)
    return int(m.group(1), 16) if m else 0


def has_cap(mask: int, cap: int) -> bool:
    return bool(mask >> cap & 1)


def cgroup2_root(mountinfo: str | None = None) -> str | None:
    """The filesystem type mounted at /sys/fs/cgroup (``cgroup2`` is what the local redirector needs)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    fstype = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and fields[4] == "/sys/fs/cgroup" and right.split():
            fstype = right.split()[0]  # the last mount on the point wins
    return fstype


def redirector_path(env: Mapping[str, str] | None = None) -> Path | None:
    """mitmproxy's local redirector, where mitmproxy-linux installs it (the scripts directory of this
    Python, as ``mitmproxy_linux.executable_path`` finds it), else on PATH."""
    import sys
    import sysconfig

    name = "mitmproxy-linux-redirector"
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        if d and (Path(d) / name).is_file():
            return Path(d) / name
    found = shutil.which(name, path=(env or os.environ).get("PATH"))
    return Path(found) if found else None


def cgroup2_elsewhere(mountinfo: str | None = None) -> str | None:
    """Where the root of the cgroup v2 hierarchy is mounted when it is not at /sys/fs/cgroup (a
    hybrid layout: /sys/fs/cgroup/unified), or None."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        f = left.split()
        if len(f) >= 5 and right.split()[:1] == [CGROUP2_FS] and f[3] == "/" and f[4] != "/sys/fs/cgroup":
            return f[4]
    return None


@dataclass
class Mechanism:
    name: str
    ok: bool
    why: str
    missing: list[str] = field(default_factory=list)  # Debian packages that would help
    cgroup_bind: str | None = None  # local: the cgroup2 mount to bind over /sys/fs/cgroup for the proxy

    @property
    def fix(self) -> str:
        return apt_command(self.missing) if self.missing else ""


def support(env: Mapping[str, str] | None = None, *, euid: int | None = None, caps: int | None = None,
            mountinfo: str | None = None, probe_nft: bool = True,
            run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[Mechanism]:
    """Which mechanisms work here, and why (or why not)."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    caps = capabilities() if caps is None else caps
    out: list[Mechanism] = []

    # -- netns
    why: list[str] = []
    missing: list[str] = []
    if not os.path.exists("/proc/self/ns/net"):
        why.append("this kernel has no network namespaces (/proc/self/ns/net)")
    if not (euid == 0 or (has_cap(caps, CAP_NET_ADMIN) and has_cap(caps, CAP_SYS_ADMIN))):
        why.append("needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run bili with sudo")
    for tool in ("ip", "nft"):
        if not which(tool, env):
            why.append(f"{tool} is not installed")
            missing.append(APT[tool])
    if not why and probe_nft:
        try:
            r = run([which("nft", env) or "nft", "list", "tables"], capture_output=True, text=True, timeout=10)
            if r.returncode != 0:
                why.append(f"nft cannot use the kernel's nf_tables: {r.stderr.strip() or r.returncode}")
        except (OSError, subprocess.TimeoutExpired) as e:
            why.append(f"nft does not run: {e}")
    out.append(Mechanism("netns", not why, "; ".join(why) if why else
                         "root, ip and nft present, nf_tables answers: a namespace with a veth pair and an "
                         "nftables redirect to mitmproxy's transparent mode", missing))

    # -- local
    why, missing = [], []
    if euid != 0:
        why.append("needs root (mitmproxy starts its eBPF redirector with sudo)")
    if redirector_path(env) is None:
        why.append("mitmproxy's redirector (mitmproxy-linux-redirector, from the mitmproxy-linux package that "
                   "mitmproxy brings on Linux) is not installed next to mitmproxy")
    fstype = cgroup2_root(mountinfo)
    bind = None
    how = "cgroup v2 at /sys/fs/cgroup"
    if fstype != CGROUP2_FS:
        other = cgroup2_elsewhere(mountinfo)
        if other and which("unshare", env) and which("mount", env):
            bind = other
            how = (f"/sys/fs/cgroup is {fstype or 'not mounted'}, but the cgroup v2 root is at {other}: bili runs "
                   f"that proxy in a mount namespace of its own with {other} bound over /sys/fs/cgroup, where "
                   "the redirector attaches its eBPF program")
        else:
            where = f" (cgroup2 is at {other}; unshare and mount would bind it there)" if other else ""
            why.append(f"/sys/fs/cgroup is {fstype or 'not mounted'}, not cgroup2{where}: the redirector attaches "
                       "its eBPF program to the cgroup v2 root there (boot with systemd.unified_cgroup_hierarchy=1)")
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        why.append("the kernel exposes no BTF (/sys/kernel/btf/vmlinux)")
    if not which("sudo", env) and euid != 0:
        missing.append(APT["sudo"])
    out.append(Mechanism("local", not why, "; ".join(why) if why else
                         f"root, kernel BTF, the mitmproxy-linux redirector, {how}: mitmproxy's local mode "
                         "captures the program's sockets by its pid and its process name", missing, bind))
    return out


def local_proxy_command(command: list[str], bind: str | None) -> list[str]:
    """The proxy's command for local mode: as it is, or (``bind``: a hybrid cgroup layout) run in a
    private mount namespace with the cgroup v2 root ``bind`` mounted over /sys/fs/cgroup, the one
    place mitmproxy's redirector attaches to.  unshare and sh exec, so the pid stays the proxy's."""
    if not bind:
        return list(command)
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /sys/fs/cgroup && exec "$@"', bind, *command]


def install(packages: Iterable[str], say: Callable[[str], None]) -> None:
    """``apt-get install`` the packages (only when the user asked for it: ``--install-deps``)."""
    packages = sorted(set(packages))
    if not packages:
        return
    if os.geteuid() != 0:
        raise TransparentError(f"installing {', '.join(packages)} needs root: {apt_command(packages)}")
    apt = which("apt-get")
    if not apt:
        raise TransparentError(f"no apt-get here: install {', '.join(packages)} with this system's package manager")
    say(f"installing {', '.join(packages)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([apt, "update"], [apt, "install", "-y", "--no-install-recommends", *packages]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0 and cmd[1] == "install":
            raise TransparentError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()[-400:]}")


def require(mechanism: str, *, install_deps: bool, say: Callable[[str], None]) -> None:
    """Raise with the reason (and the fix) unless ``mechanism`` works here; with ``install_deps``,
    install the missing packages first."""
    found = {m.name: m for m in support()}[mechanism]
    if not found.ok and found.missing and install_deps:
        install(found.missing, say)
        found = {m.name: m for m in support()}[mechanism]
    if not found.ok:
        fix = f" (install with: {found.fix}, or give --install-deps)" if found.fix else ""
        raise TransparentError(f"--transparent={mechanism} does not work here: {found.why}{fix}")


def sudo_shim(directory: Path) -> Path:
    """A ``sudo`` that runs its command as is (options dropped), for mitmproxy's local mode as root
    on a machine without sudo: mitmproxy runs ``sudo -n -E <redirector>`` whoever it runs as."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    shim = directory / "sudo"
    text = ('#!/bin/sh\n# bili: mitmproxy runs its local redirector through sudo; this process is root already\n'
            'while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done\nexec "$@"\n')
    if not shim.is_file() or shim.read_text() != text:
        tmp = shim.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, shim)
    return directory


# -- proxy modes -------------------------------------------------------------------------------------
def transparent_mode(tport: int) -> str:
    return f"transparent@127.0.0.1:{int(tport)}"


def local_mode(program: str, pid: int | None = None) -> str:
    """mitmproxy's local mode for a program: by process name, as the kernel keeps it (15 characters),
    and by ``pid``.  mitmproxy's eBPF program compares the name of the *thread* that opens a socket:
    a runtime that does its HTTP on a thread of its own (Bun's "HTTP Client": Claude Code) is missed
    by name, never by its pid (all of the process's threads)."""
    name = Path(program).name[:15]
    return f"local:{name},{int(pid)}" if pid else f"local:{name}"


def with_mode(command: Sequence[str], old: str, new: str) -> list[str]:
    """The proxy's command with the mode ``old`` given as ``new``."""
    return [new if a == old else a for a in command]


def proxy_lacks(health: Mapping, mode: str) -> str | None:
    """Why a running proxy (its ``/__bili/health``) cannot serve ``mode``, or None."""
    modes = health.get("modes")
    if not isinstance(modes, list):
        return ("the running bili proxy does not say its modes (an older bili): stop it, or use another "
                "--listen-port, so that a proxy with the transparent listener is started")
    if mode in modes:
        return None
    return (f"the running bili proxy has no {mode} listener (its modes: {', '.join(modes)}): stop it, or use "
            "another --listen-port, so that a proxy with it is started")


# -- the namespace -----------------------------------------------------------------------------------
class Namespace:
    """Set up (``open``) and remove (``close``) one namespace; ``prefix`` runs a program in it.

    Bookkeeping in ``state`` (:data:`STATE`, one for the machine, as namespaces, their addresses and
    ``ip_forward`` are): ``transparent-<index>.json`` per live namespace (with the launcher's pid: a
    namespace whose launcher died is removed by the next launch) and ``transparent-forward`` holding
    ``ip_forward``'s value before bili switched it on (restored when the last namespace goes)."""

    def __init__(self, hosts: Sequence[tuple[str, int]], tport: int, proxy_port: int, *, state: Path = STATE,
                 say: Callable[[str], None] = lambda m: None, resolv_conf: Path = Path("/etc/resolv.conf"),
                 proc_sys: Path = Path("/proc/sys"), refresh: float = REFRESH):
        self.hosts = list(hosts)
        self.tport, self.proxy_port = tport, proxy_port
        self.state, self.say = state, say
        self.resolv_conf, self.proc_sys, self.refresh = resolv_conf, proc_sys, refresh
        self.net: Net | None = None
        self.redirect: Redirect | None = None
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._etc: Path | None = None

    # -- helpers
    def _run(self, cmd: list[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        exe = which(cmd[0]) or cmd[0]
        r = subprocess.run([exe, *cmd[1:]], input=input, capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise TransparentError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()}")
        return r

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.state / "transparent.lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _records(self) -> dict[int, int]:
        """index -> launcher pid of the namespaces this state directory knows."""
        out = {}
        for p in self.state.glob("transparent-*.json"):
            try:
                doc = json.loads(p.read_text())
                out[int(doc["index"])] = int(doc["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def _sweep(self) -> None:
        """Remove the namespaces whose launcher is gone (killed before it could clean up)."""
        for index, pid in self._records().items():
            if not procs.alive(pid):
                net = Net(index)
                for cmd in teardown_commands(net):
                    self._run(cmd, check=False)
                self._remove_etc(net)
                (self.state / f"transparent-{index}.json").unlink(missing_ok=True)

    def _taken(self, net: Net) -> bool:
        return (Path("/run/netns") / net.netns).exists() or Path("/sys/class/net", net.host_if).exists()

    def _allocate(self) -> Net:
        known = self._records()
        start = os.getpid() % MAX_INDEX + 1
        for k in range(MAX_INDEX):
            index = (start + k - 1) % MAX_INDEX + 1
            net = Net(index)
            if index not in known and not self._taken(net):
                return net
        raise TransparentError("no free namespace address left in " + str(SUBNET))

    def _sysctl(self, key: str, value: str | None = None) -> str:
        path = self.proc_sys / key
        if value is not None:
            path.write_text(value)
            return value
        return path.read_text().strip()

    def _remove_etc(self, net: Net) -> None:
        d = Path("/etc/netns") / net.netns
        with contextlib.suppress(OSError):
            for p in d.iterdir():
                p.unlink()
            d.rmdir()

    # -- lifecycle
    def open(self) -> "Namespace":
        dests, notes = resolve(self.hosts)
        self.notes += notes
        if not dests:
            raise TransparentError("none of the model hosts resolved to an IPv4 address: nothing to redirect")
        try:
            conf = self.resolv_conf.read_text()
        except OSError:
            conf = ""
        dns = loopback_resolver(conf)
        with self._locked():
            self._sweep()
            self.net = net = self._allocate()
            (self.state / f"transparent-{net.index}.json").write_text(
                json.dumps({"index": net.index, "pid": os.getpid(), "netns": net.netns}))
            try:
                for cmd in setup_commands(net):
                    self._run(cmd)
                for key, value in sysctls(net).items():
                    self._sysctl(key, value)
                # IPv4 only in the namespace: getaddrinfo then offers no IPv6 address to try first
                self._run(["ip", "netns", "exec", net.netns, "sysctl", "-q", "-w",
                           "net.ipv6.conf.all.disable_ipv6=1"], check=False)
                if dns:
                    self._etc = Path("/etc/netns") / net.netns
                    self._etc.mkdir(parents=True, exist_ok=True)
                    (self._etc / "resolv.conf").write_text(namespace_resolv_conf(conf, net.host_ip))
                self.redirect = Redirect(dests, self.tport, self.proxy_port, dns)
                self._run(["nft", "-f", "-"], input=ruleset(net, self.redirect))
                if self._sysctl("net/ipv4/ip_forward") != "1":
                    (self.state / "transparent-forward").write_text("0")
                    self._sysctl("net/ipv4/ip_forward", "1")
            except BaseException:
                self._teardown()
                raise
        if self.refresh > 0:
            self._thread = threading.Thread(target=self._refresher, name="bili-transparent-refresh", daemon=True)
            self._thread.start()
        return self

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh):
            assert self.net is not None and self.redirect is not None
            dests, _ = resolve(self.hosts)
            new = [d for d in dests if d not in self.redirect.dests]
            if new:
                r = self._run(["nft", "-f", "-"], input=add_elements(self.net, new), check=False)
                if r.returncode == 0:
                    self.redirect.dests += new

    def _teardown(self) -> None:
        net = self.net
        if net is None:
            return
        for cmd in teardown_commands(net):
            self._run(cmd, check=False)
        self._remove_etc(net)
        (self.state / f"transparent-{net.index}.json").unlink(missing_ok=True)
        forward = self.state / "transparent-forward"
        if forward.exists() and not any(procs.alive(pid) for i, pid in self._records().items() if i != net.index):
            with contextlib.suppress(OSError):
                self._sysctl("net/ipv4/ip_forward", forward.read_text().strip() or "0")
            forward.unlink(missing_ok=True)
        self.net = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._locked():
            self._teardown()

    def __enter__(self) -> "Namespace":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def proxy_url(self) -> str:
        assert self.net is not None
        return f"http://{self.net.host_ip}:{self.proxy_port}"

    def prefix(self, env: Mapping[str, str] | None = None) -> list[str]:
        assert self.net is not None
        return exec_prefix(self.net, env)


def namespace_env(env: Mapping[str, str], proxy_url: str) -> dict[str, str]:
    """The program's environment in the namespace: the proxy variables point at the proxy's port as
    seen from there (127.0.0.1 in the namespace is its own loopback)."""
    out = dict(env)
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "PI_PROXY",
              "BILI_PROXY"):
        if k in out and re.match(r"^https?://(127\.0\.0\.1|localhost)(:\d+)?/?$", out[k]):
            out[k] = proxy_url
    return out


def proxy_env(mechanism: str, env: Mapping[str, str], state: Path) -> dict[str, str] | None:
    """The environment of a proxy a transparent launch starts (None: the launcher's own)."""
    if mechanism == "local" and os.geteuid() == 0 and not which("sudo", env):
        shim = sudo_shim(state / "sudo-shim")
        return {**env, "PATH": os.pathsep.join([str(shim), env.get("PATH", "")])}
    return None


@contextlib.contextmanager
def child(mechanism: str | None, mode: str, health: Mapping, redirect: Sequence[tuple[str, int]], proxy_port: int,
          argv: list[str], env: Mapping[str, str], say: Callable[[str], None],
          state: Path = STATE) -> Iterator[tuple[list[str], dict[str, str]]]:
    """The program's command line and environment for ``mechanism`` (as they are without one), with
    the namespace set up around the ``with`` block."""
    if not mechanism:
        yield argv, dict(env)
        return
    why = proxy_lacks(health, mode)
    if why:
        raise TransparentError(why)
    if mechanism == "local":
        name, _, pid = mode.split(":", 1)[1].partition(",")
        say(f"mitmproxy's local mode ({mode}) hands the connections of {Path(argv[0]).name}"
            + (f" (pid {pid}, every thread)" if pid else "") + f" and of every other process named {name} on this "
            "machine to the proxy (model hosts decrypted, the rest relayed as is)")
        yield argv, dict(env)
        return
    tport = int(mode.rsplit(":", 1)[1])
    ns = Namespace(redirect, tport, proxy_port, state=state, say=say)
    ns.open()
    copies = None
    try:
        assert ns.net is not None and ns.redirect is not None
        for note in ns.notes:
            say(f"note: {note}")
        say(f"{Path(argv[0]).name} runs in network namespace {ns.net.netns} ({ns.net.ns_ip}); its TCP to "
            f"{len(ns.redirect.dests)} model host address(es) goes to bili's transparent listener "
            f"127.0.0.1:{tport}, everything else leaves untouched")
        prefix, child_env = ns.prefix(env), namespace_env(env, ns.proxy_url)
        if "setpriv" in prefix:  # run as the user behind sudo: with that user's home, not root's
            import pwd

            with contextlib.suppress(KeyError, ValueError):
                user = pwd.getpwuid(int(env["SUDO_UID"]))
                child_env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
            try:
                copies = readable_cas(child_env, int(env["SUDO_UID"]), int(env["SUDO_GID"]))
            except (KeyError, ValueError, OSError) as e:
                say(f"warning: the CA files could not be made readable for the user behind sudo ({e})")
        yield prefix + argv, child_env
    finally:
        ns.close()
        if copies is not None:
            shutil.rmtree(copies, ignore_errors=True)


CA_VARS = ("NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CODEX_CA_CERTIFICATE")


def readable_cas(env: dict[str, str], uid: int, gid: int) -> str | None:
    """The CA files ``env`` names, copied where the user ``uid`` (the one behind sudo, whom the program
    runs as) can read them, ``env`` pointed at the copies: under sudo the proxy's CA lives in root's
    0700 data directory, and the program could read none of them (every TLS connection failed).
    Returns the copies' directory (to remove after the program), or None when there were none."""
    names = [v for v in CA_VARS if env.get(v) and os.path.isfile(env[v])]
    if not names:
        return None
    folder = tempfile.mkdtemp(prefix="bili-ca-")
    try:
        os.chown(folder, uid, gid)
        done: dict[str, str] = {}
        for var in names:
            src = env[var]
            if src not in done:
                dst = os.path.join(folder, f"{len(done)}-{os.path.basename(src)}")
                shutil.copyfile(src, dst)
                os.chown(dst, uid, gid)
                os.chmod(dst, 0o644)
                done[src] = dst
            env[var] = done[src]
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder
