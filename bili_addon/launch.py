"""``bili <agent> [options] [-- agent args]``: run an agent through the proxy, and ``bili doctor``.

The launcher makes sure the CA exists, re-uses a bili proxy already answering on the port or starts
one (``mitmdump`` with the addon, in its own session, intercepting only model API hosts), runs the
agent as its child with ``HTTPS_PROXY`` and the CA variable it understands, forwards signals to it,
and exits with the agent's exit code.  A proxy started by a launcher is stopped when the last
launcher using it exits (bookkeeping in ``<state dir>/proxy-<port>.*``); a proxy you started
yourself with ``bili run`` is never stopped.

The agent's configuration is read (for custom base URLs), never written.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hmac
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from bili_addon import (BILI_MODES, DEFAULT_HOST, DEFAULT_PORT, FIRST_PARTY, __version__, adminclient, default_port,
                        printable, private, procs, transparent)
from bili_addon.agents import (AGENTS, ANY_CA, BUNDLE_CA, CODEX_CA, NODE_CA, Agent, HostPlan, allow_hosts_regex,
                               intercept_plan, load_config)
from bili_addon.store import DB_NAME, SCHEMA_VERSION, StoreError, default_data_dir, newer_schema
from bili_addon.stores import is_url, open_store, store_spec

START_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
ADDON_GRACE = 3.0  # a port that answers, but not as bili, for this long: the addon did not load
ADDON = Path(__file__).resolve().parent / "addon.py"


class LaunchError(RuntimeError):
    pass


def _say(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"bili: {msg}", file=sys.stderr, flush=True)


# -- the mitmdump command (shared with ``bili run``) --------------------------------------------------
def find_mitmdump() -> Path | None:
    here = Path(sys.executable).parent / "mitmdump"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("mitmdump")
    return Path(found) if found else None


def system_roots_for_upstream(source: str | None) -> str | None:
    """The system roots for ``ssl_verify_upstream_trusted_ca``, unless they are certifi's already."""
    if not source:
        return None
    try:
        import certifi

        if Path(source).resolve() == Path(certifi.where()).resolve():
            return None
    except ImportError:
        pass
    return source


# -- mitmdump options: bili's own, merged with the user's -----------------------------------------------
# mitmproxy refuses two values for one option, and when that option belongs to an addon loaded with
# -s it drops the addon without a word.  So every option goes on the command line once: bili's own
# values, then the user's (``--set NAME=VALUE`` of bili run / the launchers, and any ``--set`` after
# ``--``) replacing them.  Options that hold a list (allow_hosts) take the user's values as well.
SEQUENCE_OPTIONS = frozenset({"allow_hosts", "ignore_hosts", "modify_headers", "modify_body", "map_local",
                              "map_remote", "scripts", "setheaders"})
# options bili run sets from its own flags, which it must know (it prints them and checks the port):
# refused after ``--``, with the flag to use instead
RESERVED = {"listen_host": "--listen-host", "listen_port": "--listen-port", "mode": "--mode", "confdir": "--confdir"}
RESERVED_ARGS = {"--listen-host": "--listen-host", "--listen-port": "--listen-port", "-p": "--listen-port",
                 "--mode": "--mode", "-m": "--mode"}
# bili's flags and the addon option each one sets
FLAG_OPTIONS = {"--bili-mode": "bili_mode", "--first-party": "bili_first_party", "--data-dir": "bili_data_dir",
                "--store": "bili_store"}


class OptionError(ValueError):
    """The user's options cannot be merged with bili's (said in bili's terms)."""


def _parse_set(spec: str) -> tuple[str, str | None]:
    name, eq, value = spec.partition("=")
    name = name.strip()
    if not name:
        raise OptionError(f"--set {spec!r}: expected NAME=VALUE")
    return name, (value if eq else None)


def split_sets(args: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """The ``--set NAME=VALUE`` (and ``--set=NAME=VALUE``) pairs among mitmdump arguments, and the rest."""
    pairs, rest = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--set":
            if i + 1 >= len(args):
                raise OptionError("--set at the end of the arguments: expected NAME=VALUE after it")
            pairs.append(_parse_set(args[i + 1]))
            i += 2
            continue
        if a.startswith("--set="):
            pairs.append(_parse_set(a[len("--set="):]))
        else:
            rest.append(a)
        i += 1
    return pairs, rest


def _same(name: str, a: str | None, b: str | None) -> bool:
    if a == b:
        return True
    if name in ("bili_data_dir", "confdir") and a and b:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


def user_options(sets: list[str] | None, extra: list[str] = (), *,  # type: ignore[assignment]
                 flags: Mapping[str, str | None] | None = None,
                 reserved: bool = False) -> tuple[list[tuple[str, str | None]], list[str]]:
    """The user's mitmproxy options, once each: ``sets`` (bili's own ``--set`` flag), then any ``--set``
    in ``extra`` (mitmdump arguments after ``--``); returns them and ``extra`` without them.

    ``flags``: bili's flags the user gave explicitly (``{"--bili-mode": "observe"}``); a ``--set`` of
    the same option with another value is refused, as is one option given twice with two values.
    ``reserved``: refuse the options bili run sets from its own flags (listen address, mode, confdir)."""
    pairs = [_parse_set(s) for s in sets or []]
    more, rest = split_sets(list(extra))
    pairs += more
    if reserved:
        for a in rest:
            flag = RESERVED_ARGS.get(a.split("=", 1)[0])
            if flag:
                raise OptionError(f"{a} after --: give it as bili run's own {flag} (before --), so that bili "
                                  "binds, checks and prints the same address")
        for name, _v in pairs:
            if name in RESERVED:
                raise OptionError(f"--set {name}=...: give it as bili run's own {RESERVED[name]} (before --)")
    given = {FLAG_OPTIONS[f]: (f, v) for f, v in (flags or {}).items() if v is not None and f in FLAG_OPTIONS}
    seen: dict[str, str | None] = {}
    out: list[tuple[str, str | None]] = []
    for name, value in pairs:
        if name in SEQUENCE_OPTIONS:
            if (name, value) not in out:
                out.append((name, value))
            continue
        if name in seen:
            if not _same(name, seen[name], value):
                raise OptionError(f"{name} is given twice ({seen[name]!r} and {value!r}); give it once")
            continue
        if name in given and not _same(name, given[name][1], value):
            flag, fv = given[name]
            raise OptionError(f"{flag} {fv} and --set {name}={value} disagree; give one of them")
        seen[name] = value
        out.append((name, value))
    return out, rest


def option_value(pairs: list[tuple[str, str | None]], name: str, default: str | None) -> str | None:
    """The user's value of a scalar option, else ``default``."""
    for n, v in pairs:
        if n == name:
            return v
    return default


def mitmdump_command(
    mitmdump: Path | str,
    *,
    listen_host: str,
    listen_port: int,
    modes: list[str],
    confdir: Path,
    data_dir: str | None,
    bili_mode: str,
    upstream_ca: str | None,
    lazy: bool,
    allow_hosts: str | None = None,
    first_party: str | None = None,
    scripts: list[str] = (),  # type: ignore[assignment]
    sets: list[tuple[str, str | None]] = (),  # type: ignore[assignment]
    extra: list[str] = (),  # type: ignore[assignment]
) -> list[str]:
    """The mitmdump command line; ``sets`` are the user's options (:func:`user_options`), each replacing
    bili's value of the same option (list options: added to it), so that no option is given twice."""
    cmd = [str(mitmdump), "-s", str(ADDON)]
    for s in scripts:
        cmd += ["-s", str(Path(s).expanduser().resolve())]
    cmd += ["--listen-host", listen_host, "--listen-port", str(listen_port)]
    for m in modes:
        cmd += ["--mode", m]
    ours: dict[str, list[str | None]] = {"confdir": [str(confdir)]}
    if data_dir:
        ours["bili_data_dir"] = [str(Path(data_dir).expanduser().resolve())]
    ours["bili_mode"] = [bili_mode]
    if first_party:
        ours["bili_first_party"] = [first_party]
    if upstream_ca:
        # mitmproxy verifies upstream servers against certifi only; trust what this machine trusts
        # (a corporate or sandbox TLS inspector's CA lives in the system store, not in certifi)
        ours["ssl_verify_upstream_trusted_ca"] = [upstream_ca]
    if lazy:
        # mitmproxy's default ("eager") dials the upstream as soon as a client connects and drops
        # the client if that fails; lazy lets /__bili/ answer even while the upstream is down
        ours["connection_strategy"] = ["lazy"]
    if allow_hosts:
        # TLS is intercepted for these hosts only; every other CONNECT is tunnelled untouched
        ours["allow_hosts"] = [allow_hosts]
    replaced: set[str] = set()
    for name, value in sets:
        if name in SEQUENCE_OPTIONS:
            ours.setdefault(name, []).append(value)
        else:
            if name not in replaced:
                ours[name] = []
                replaced.add(name)
            ours[name].append(value)
    for name, values in ours.items():
        for v in values:
            cmd += ["--set", name if v is None else f"{name}={v}"]
    return cmd + list(extra)


# -- probing a port ------------------------------------------------------------------------------------
@dataclass
class Probe:
    kind: str  # "bili", "other" (something else listens), "free"
    health: dict = field(default_factory=dict)
    detail: str = ""


def probe(port: int, host: str = DEFAULT_HOST, timeout: float = 2.0, token: str | None = None) -> Probe:
    """Is a bili proxy answering ``/__bili/health`` on ``host:port``?  Asked in origin form (what
    a forward proxy in mitmproxy answers itself) and, failing that, in proxy form.  With ``token``
    the answer's ``authenticated`` says whether that proxy is this install's: it proves it holds
    the token (its answer to a challenge, :func:`private.proof`); the token itself is never sent
    to whatever listens on the port."""
    detail = ""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    challenge = secrets.token_hex(16) if token else ""
    for proxy_form in (False, True):
        try:
            got = adminclient.call(address, "/__bili/health", timeout=timeout, proxy_form=proxy_form, limit=65536,
                                   headers={private.CHALLENGE_HEADER: challenge} if token else None)
        except adminclient.Unreachable as e:
            if e.refused:
                return Probe("free")
            detail = e.reason
            continue
        doc = got.doc
        if got.status == 200 and isinstance(doc, dict) and doc.get("ok") is True and "version" in doc:
            if token:
                shown = doc.get("proof")
                doc["authenticated"] = isinstance(shown, str) and hmac.compare_digest(
                    shown, private.proof(token, challenge))
            return Probe("bili", doc)
        detail = f"HTTP {got.status}: {got.raw[:120]!r}"
    return Probe("other", detail=detail)


def request_intercept(port: int, hosts: list[tuple[str, int]], host: str = DEFAULT_HOST,
                      timeout: float = 5.0, token: str | None = None) -> dict | str:
    """Ask a running bili proxy to decrypt ``hosts`` too (``POST /__bili/intercept``): its answer, or
    why it did not take them."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        got = adminclient.call(address, "/__bili/intercept", method="POST", token=token or "",
                               body={"hosts": [f"{h}:{p}" for h, p in hosts]}, timeout=timeout, limit=65536)
    except adminclient.Unreachable as e:
        return e.reason
    if got.status == 200 and isinstance(got.doc, dict) and got.doc.get("ok"):
        return got.doc
    return f"HTTP {got.status}: {got.error[:120]}"


# -- the shared proxy, with a lease per launcher ---------------------------------------------------------
def state_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    run = env.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run) and os.access(run, os.W_OK):
        return Path(run) / "bili-addon"
    return default_data_dir(env) / "run"


_alive = procs.alive  # the name cli.py and the tests know


def _is_mitmdump(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"mitmdump" in f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc") and _alive(pid)  # no procfs (macOS): trust the pid
    except OSError:
        return False


class SharedProxy:
    """Attach to the bili proxy on a port (re-use or start it); detach stops it when this was the
    last launcher using a proxy some launcher started."""

    def __init__(self, port: int, command: list[str], *, host: str = DEFAULT_HOST, env: Mapping[str, str] | None = None,
                 quiet: bool = False, state: Path | None = None, token: str | None = None):
        self.port, self.host, self.command, self.quiet = port, host, command, quiet
        self.token = token  # this install's admin token: a proxy that refuses it is not re-used
        self.env = dict(os.environ if env is None else env)
        self.dir = state or state_dir(self.env)
        self.lock_path = self.dir / f"proxy-{port}.lock"
        self.owner_path = self.dir / f"proxy-{port}.json"
        self.users_dir = self.dir / f"proxy-{port}.users"
        self.log_path = self.dir / f"proxy-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # the proxy's pid, when a launcher started it
        self.started = False
        self.reused = False
        self.health: dict = {}
        self.stopped: int | None = None  # pid this detach stopped

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.lock_path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _owner(self) -> int | None:
        try:
            pid = int(json.loads(self.owner_path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if _alive(pid) and _is_mitmdump(pid):
            return pid
        self.owner_path.unlink(missing_ok=True)  # stale: that proxy is gone
        return None

    def _users(self) -> list[int]:
        out = []
        try:
            entries = list(self.users_dir.iterdir())
        except FileNotFoundError:
            return out
        for p in entries:
            try:
                pid = int(p.name)
            except ValueError:
                continue
            if pid != os.getpid() and _alive(pid):
                out.append(pid)
            elif pid != os.getpid():
                p.unlink(missing_ok=True)
        return out

    def attach(self) -> "SharedProxy":
        with self._locked():
            found = probe(self.port, self.host, token=self.token)
            if found.kind == "bili":
                self._check_ours(found)
                self.reused, self.health, self.pid = True, found.health, self._owner()
            elif found.kind == "other":
                raise LaunchError(f"{self.host}:{self.port} is in use by something that is not a bili proxy "
                                  f"({found.detail}); choose another port with --listen-port (or $BILI_PORT)")
            else:
                self._start()
            self.users_dir.mkdir(parents=True, exist_ok=True)
            (self.users_dir / str(os.getpid())).touch()
        return self

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(self.command)}\n".encode())
        log.flush()
        env = {k: v for k, v in self.env.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        except OSError as e:
            raise LaunchError(f"cannot start {self.command[0]}: {e}") from e
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        other_since = None
        while True:
            found = probe(self.port, self.host, timeout=1.0, token=self.token)
            if found.kind == "other" and self.proc.poll() is None:
                # mitmdump listens (scripts load before it binds) but /__bili/health is not ours: the
                # addon did not load, and traffic would flow with bili off
                other_since = other_since or time.monotonic()
                if time.monotonic() - other_since > ADDON_GRACE:
                    self._kill(self.proc.pid, self.proc)
                    self.proc = None
                    raise LaunchError(f"mitmdump started but the bili addon did not load (/__bili/health: "
                                      f"{found.detail}); stopped it. Its log {self.log_path} ends:\n"
                                      + _tail(self.log_path))
            else:
                other_since = None
            if found.kind == "bili":
                if self.proc.poll() is None:
                    self.pid, self.started, self.health = self.proc.pid, True, found.health
                    self.owner_path.write_text(json.dumps({"pid": self.proc.pid, "port": self.port,
                                                           "launcher": os.getpid(), "started": time.time()}))
                    return
                # ours died (lost the race for the port) and another launcher's proxy answers
                self._check_ours(found)
                self.proc, self.reused, self.health, self.pid = None, True, found.health, self._owner()
                return
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise LaunchError(f"the proxy exited during start-up (code {code}); its log {self.log_path} ends:\n"
                                  + _tail(self.log_path))
            if time.monotonic() > deadline:
                self._kill(self.proc.pid, self.proc)
                self.proc = None
                raise LaunchError(f"the proxy did not answer /__bili/health within {START_TIMEOUT:.0f} s; "
                                  f"log: {self.log_path}\n" + _tail(self.log_path))
            time.sleep(0.1)

    def _check_ours(self, found: Probe) -> None:
        """The agent's traffic never goes through a proxy that does not know this install's token:
        another user's (it would read the conversation and the API keys) or another data dir's."""
        if found.health.get("authenticated") is False:
            raise LaunchError(f"the bili proxy on {self.host}:{self.port} does not prove it holds this install's "
                              "admin token: another user's proxy, one started with another --data-dir, or an "
                              "older bili's (stop it); choose another port with --port (or give the same --data-dir)")

    def detach(self, hurry=None) -> None:
        """``hurry()``: true once the stop should not wait for a clean exit any more."""
        with self._locked():
            (self.users_dir / str(os.getpid())).unlink(missing_ok=True)
            if self._users():
                return  # another launcher still runs an agent through it
            pid = self.proc.pid if self.proc is not None and self.proc.poll() is None else self._owner()
            if pid is None:
                return  # not started by a launcher (bili run): never ours to stop
            try:
                self._kill(pid, self.proc if self.proc is not None and self.proc.pid == pid else None, hurry)
            finally:
                self.owner_path.unlink(missing_ok=True)
            self.stopped = pid
            self.proc = None

    @staticmethod
    def _kill(pid: int, proc: subprocess.Popen | None, hurry=None) -> None:
        """SIGTERM to the proxy's process group, SIGKILL after STOP_TIMEOUT (at once when ``hurry()``)."""
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):  # not a group leader (bili run's child), or gone
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if sig == signal.SIGTERM and hurry is not None and hurry():
                    break
                if proc is not None:
                    if proc.poll() is not None:
                        return
                elif not _alive(pid):
                    return
                time.sleep(0.05)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -- the agent's environment -----------------------------------------------------------------------------
def node_ca_file(ca, env: Mapping[str, str]) -> str:
    """``NODE_EXTRA_CA_CERTS`` for the agent: our CA, plus the user's own extra CAs when they have some
    (the variable takes one file), merged into a file in the confdir."""
    theirs = env.get(NODE_CA, "")
    ours = Path(ca.cert)
    if not theirs or Path(theirs).resolve() == ours.resolve():
        return str(ours)
    try:
        extra = Path(theirs).read_bytes()
    except OSError:
        return str(ours)
    return _merged_file(ca.confdir, "node-extra-ca-", theirs + "\0" + str(ours), [extra, ours.read_bytes()])


# where a user names the CAs they trust beside the system's (a corporate TLS inspector's: Claude Code's
# documentation sends such users to NODE_EXTRA_CA_CERTS, codex's to CODEX_CA_CERTIFICATE); $SSL_CERT_FILE
# is the system roots' own source
EXTRA_CA_VARS = (NODE_CA, CODEX_CA, "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
# bili's own files made of them, and its copies of another proxy's CA (certs.proxy_ca): never read back
_MERGED = ("node-extra-ca-", "upstream-ca-", "agent-ca-", "proxy-ca-", "proxy-combined-")


def user_extra_cas(ca, env: Mapping[str, str]) -> list[tuple[str, bytes]]:
    """``(path, PEM)`` of each bundle the user's environment names beside the system roots, in
    :data:`EXTRA_CA_VARS`' order, each once: none of bili's own files, nor the system roots' source."""
    skip = set()
    for p in (ca.cert, ca.combined, ca.roots_source):
        if p:
            skip.add(Path(p).resolve())
    confdir = Path(ca.confdir).resolve()
    out: list[tuple[str, bytes]] = []
    for var in EXTRA_CA_VARS:
        value = env.get(var)
        if not value:
            continue
        try:
            path = Path(value).resolve()
            if path in skip or (path.parent == confdir and path.name.startswith(_MERGED)):
                continue
            data = path.read_bytes()
        except OSError:
            continue
        if b"-----BEGIN CERTIFICATE-----" in data:
            skip.add(path)
            out.append((str(path), data))
    return out


def _merged_file(confdir, prefix: str, key: str, parts: list[bytes]) -> str:
    """A bundle of ``parts`` in the confdir (written when it differs, atomically, through a file of its
    own: two launches may write it at once): its path.  ``key`` names what it is made of (the files,
    the CA it holds: a launch re-using a proxy of another CA writes a bundle of its own, never the one
    another launch's agent reads)."""
    import hashlib
    import tempfile

    merged = Path(confdir) / f"{prefix}{hashlib.sha256(key.encode()).hexdigest()[:12]}.pem"
    body = b"".join(p.rstrip() + b"\n" for p in parts)
    if not merged.exists() or merged.read_bytes() != body:
        fd, tmp = tempfile.mkstemp(dir=confdir, prefix=f".{prefix}", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, merged)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return str(merged)


_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def user_upstream(env: Mapping[str, str], listen_port: int) -> tuple[str | None, str]:
    """The proxy the user's programs go through (``HTTPS_PROXY``, else ``ALL_PROXY``), as bili's own
    upstream (``--mode upstream:URL``): where egress goes through a corporate proxy, what bili dials
    must too (it dialled every host directly, and failed there).  ``(URL, note)``: None and why not
    when there is none, it is this proxy on loopback (a loop), another bili on loopback, or it needs
    credentials (mitmproxy takes them as an option, which would show them in its command line: the note
    says how to give them)."""
    from urllib.parse import urlsplit

    raw = next((env[v] for v in _PROXY_VARS if env.get(v)), "")
    if not raw:
        return None, ""
    try:
        u = urlsplit(raw if "://" in raw else "http://" + raw)
        host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None, f"{raw} is no proxy URL bili can chain to: it dials hosts directly"
    if u.scheme not in ("http", "https") or not host:
        return None, f"{raw} is no HTTP proxy bili can chain to: it dials hosts directly"
    if port == listen_port and host in ("localhost", "127.0.0.1", "::1"):
        return None, ""  # (this proxy itself: the variable was set for bili)
    if _loopback(host) and _answers_as_bili(host, port):
        # another bili (`bili run`'s instructions export HTTPS_PROXY): its CA is not one the system trusts, and
        # every request through it failed (502); folding twice is no use anyway
        return None, f"{u.scheme}://{host}:{port} is a bili proxy: bili never chains to bili, it dials hosts directly"
    if u.username or u.password:
        return None, (f"{u.scheme}://{host}:{port} needs credentials: bili dials hosts directly; to go through "
                      f"it, run bili with --set upstream_auth=USER:PASSWORD and --mode upstream:{u.scheme}://{host}:{port}")
    where = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{where}:{port}", ""


def _answers_as_bili(host: str, port: int, deadline: float = 1.0) -> bool:
    """Does the proxy on ``host:port`` answer ``/__bili/health`` as bili, within ``deadline`` seconds in
    all (a local corporate proxy that hangs or answers a byte at a time must not hold the launch: its
    socket's timeout is per operation; one that does not answer in time is not bili)."""
    import threading

    got: list[bool] = []
    asker = threading.Thread(target=lambda: got.append(probe(port, host, timeout=deadline).kind == "bili"),
                             daemon=True)
    asker.start()
    asker.join(deadline)
    return bool(got and got[0])


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def upstream_trust(ca, env: Mapping[str, str]) -> str | None:
    """``ssl_verify_upstream_trusted_ca``: the system roots (None: certifi's, mitmproxy's own), plus the
    CAs the user trusts beside them.  Behind a TLS-inspecting network the model host's certificate is
    the inspector's: the agent trusted it through its extra CAs, and it no longer talks to the host,
    mitmdump does (without them every request to the host failed, 502)."""
    base = system_roots_for_upstream(ca.roots_source)
    extras = user_extra_cas(ca, env)
    if not extras:
        return base
    try:
        if ca.roots_source:
            roots = Path(ca.roots_source).read_bytes()
        else:
            import certifi

            roots = Path(certifi.where()).read_bytes()
    except (OSError, ImportError):
        roots = b""
    return _merged_file(ca.confdir, "upstream-ca-", "\0".join(p for p, _d in extras), [roots, *(d for _p, d in extras)])


def agent_env(agent: Agent, env: Mapping[str, str], proxy_url: str, ca, data_dir: str | None = None,
              hosts: list[tuple[str, int]] = (), chained: bool = False) -> dict[str, str]:  # type: ignore[assignment]
    """The agent's environment: the caller's, plus the proxy and the CA variable it understands, and
    ``NO_PROXY`` without its entries naming the agent's own model ``hosts`` (:func:`without_model_hosts`;
    ``chained``: bili goes out through the user's proxy)."""
    out = dict(env)
    out["HTTPS_PROXY"] = out["https_proxy"] = proxy_url
    for var, value in without_model_hosts(env, list(hosts), chained).items():
        if value is None:
            del out[var]
        else:
            out[var] = value
    for var in agent.proxy_vars:
        out[var] = proxy_url
    if agent.ca_var in (NODE_CA, ANY_CA):
        out[NODE_CA] = node_ca_file(ca, env)
    if agent.ca_var != NODE_CA:
        # one bundle instead of the system roots: ours, and the user's extra CAs (the hosts bili tunnels
        # untouched are still the inspector's)
        extras = user_extra_cas(ca, env)
        bundle = str(ca.combined) if not extras else _merged_file(
            ca.confdir, "agent-ca-", "\0".join([str(ca.combined), *(p for p, _d in extras)]),
            [Path(ca.combined).read_bytes(), *(d for _p, d in extras)])
        out[BUNDLE_CA] = bundle
        out["REQUESTS_CA_BUNDLE"] = bundle
        for var in agent.bundle_vars:  # (codex reads its own first: the user's, without bili's CA, failed TLS)
            out[var] = bundle
    out["BILI_PROXY"] = proxy_url  # where `bili mcp`, started by the agent, finds this proxy
    if data_dir:  # where it finds the proxy's admin token
        out["BILI_DATA_DIR"] = str(Path(data_dir).expanduser().resolve())
    return out


_NO_PROXY_VARS = ("NO_PROXY", "no_proxy")


def no_proxy_entries(raw: str) -> list[str]:
    """A ``NO_PROXY`` value's entries: separated by commas or by spaces (Claude Code, curl take both)."""
    return [e for e in re.split(r"[,\s]+", raw) if e]


def _names(entry: str, host: str) -> bool:
    e = entry.strip().lower().split(":")[0]
    return e == "*" or host == e.lstrip(".") or host.endswith("." + e.lstrip(".").lstrip("*."))


def no_proxy_conflicts(env: Mapping[str, str], hosts: list[tuple[str, int]]) -> list[str]:
    """Model hosts the agent would reach directly because ``NO_PROXY`` (or ``no_proxy``) names them."""
    entries = [e for var in _NO_PROXY_VARS for e in no_proxy_entries(env.get(var) or "")]
    return [host for host, _port in hosts if any(_names(e, host) for e in entries)]


def _entry_host(entry: str) -> str:
    """The host a ``NO_PROXY`` entry names as it is written (lower case, without a port); a suffix
    (``.corp.example``), ``*`` or a bracketed address stays as written."""
    e = entry.strip().lower()
    return e if e.startswith("[") else e.split(":")[0]


def without_model_hosts(env: Mapping[str, str], hosts: list[tuple[str, int]],
                        chained: bool = False) -> dict[str, str | None]:
    """``NO_PROXY`` and ``no_proxy`` without their entries naming exactly one of ``hosts`` (the agent's
    own model hosts; None: nothing is left), for each that has such an entry: the agent reached that
    host directly, out of bili's sight, and the launcher only said so.  Nothing else goes: a suffix
    (``.corp.example``) or ``*`` names the user's other hosts too, which the user sends past their
    proxy (and another agent's hosts are not this one's).  Nothing at all when bili goes out through
    the user's own proxy (``chained``): their NO_PROXY says what that proxy does not serve."""
    if chained:
        return {}
    names = {h.lower() for h, _p in hosts}
    out: dict[str, str | None] = {}
    for var in _NO_PROXY_VARS:
        entries = no_proxy_entries(env.get(var) or "")
        kept = [e for e in entries if _entry_host(e) not in names]
        if kept != entries:
            out[var] = ",".join(kept) or None
    return out


def taken_out(env: Mapping[str, str], hosts: list[tuple[str, int]], chained: bool = False) -> list[str]:
    """The model hosts :func:`without_model_hosts` takes out of ``NO_PROXY`` (the launcher says so)."""
    if chained:
        return []
    entries = {_entry_host(e) for var in _NO_PROXY_VARS for e in no_proxy_entries(env.get(var) or "")}
    return [h for h, _p in hosts if h.lower() in entries]


def settings_bypass(agent: Agent, env: Mapping[str, str], cwd: Path, proxy_url: str,
                    hosts: list[tuple[str, int]]) -> list[str]:
    """What in the ``env`` table of the agent's settings files takes it around bili (Claude Code applies
    that table over the environment the launcher gives it): an ``HTTPS_PROXY`` other than bili's, a
    ``NO_PROXY`` naming a model host.  Said, never edited (the files are only read)."""
    if not agent.env_table:
        return []
    out = []
    for path in agent.config_files(env, cwd):
        try:
            table = load_config(path).get("env")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(table, dict):
            continue
        for var in ("HTTPS_PROXY", "https_proxy"):
            value = table.get(var)
            if isinstance(value, str) and value.strip().rstrip("/") != proxy_url:
                out.append(f"{path} sets env.{var}={printable(value)}: {agent.title} applies it over the "
                           f"launcher's {proxy_url} and goes around bili; remove that key (or set it to {proxy_url}): "
                           "bili does not edit the file")
        for var in _NO_PROXY_VARS:
            value = table.get(var)
            named = no_proxy_conflicts({var: value}, hosts) if isinstance(value, str) else []
            if named:
                out.append(f"{path} sets env.{var}={printable(value)}, which names {_some(named)}: {agent.title} "
                           "reaches them directly, bili sees none of it; take them out of that key: bili does not "
                           "edit the file")
    return out


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# -- the agent's background servers ----------------------------------------------------------------------
def stale_daemons(agent: Agent, proxy_url: str, proc_dir: str = "/proc") -> list[tuple[int, str]]:
    """The agent's background servers (codex's TUI leaves a ``codex app-server`` behind) running with
    another ``HTTPS_PROXY`` than this launch's, or none: ``(pid, their HTTPS_PROXY)``.  The agent may
    hand its work to such a server, which keeps the proxy it was started with (a dead port, or no bili
    at all).  Found through /proc, for processes of this user; elsewhere nothing is found."""
    if not agent.daemons or not os.path.isdir(proc_dir):
        return []
    names = {agent.binary, agent.binary + ".js"}
    out = []
    for entry in os.listdir(proc_dir):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = [os.path.basename(a.decode(errors="replace"))
                    for a in Path(proc_dir, entry, "cmdline").read_bytes().split(b"\0") if a]
            at = next((i for i, a in enumerate(argv) if a in names), None)
            if at is None or not any(a in agent.daemons for a in argv[at + 1:]):
                continue
            env = dict(e.split(b"=", 1) for e in Path(proc_dir, entry, "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:  # gone, or not ours to read
            continue
        theirs = (env.get(b"HTTPS_PROXY") or env.get(b"https_proxy") or b"").decode(errors="replace")
        if theirs.rstrip("/") != proxy_url:
            out.append((int(entry), theirs))
    return sorted(out)


def _daemon_note(agent: Agent, pid: int, theirs: str) -> str:
    what = f"a background {agent.binary} {agent.daemons[0]} (pid {pid})"
    if not theirs:
        state = "runs without HTTPS_PROXY: bili sees none of its traffic"
    else:
        try:
            port = int(theirs.rstrip("/").rsplit(":", 1)[1])
            found = probe(port)
        except (ValueError, IndexError):
            found = Probe("other")
        state = (f"still uses HTTPS_PROXY={theirs}, where " +
                 ("nothing answers any more: its requests fail" if found.kind == "free" else
                  "another bili proxy answers" if found.kind == "bili" else "something that is not bili answers"))
    return (f"{what} {state}. {agent.title} may hand its work to it instead of using this launch's proxy; "
            f"stop it (kill {pid}) and it is started again with this launch's settings")


# -- running the agent ------------------------------------------------------------------------------------
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _terminal_delivers(signum: int) -> bool:
    """Ctrl-C / Ctrl-\\ on our terminal reach the whole foreground process group, the agent
    included: forwarding them again would deliver them twice."""
    if signum not in (signal.SIGINT, signal.SIGQUIT):
        return False
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


class Held:
    """A program started but held before it runs (a small Python waits on a pipe, then execs it: the
    same pid), so that its pid is known before anything it does (``--transparent=local`` intercepts
    that pid)."""

    HOLD = ("import os, sys\nfd = int(sys.argv[1])\nif os.read(fd, 3) != b'go\\n':\n    sys.exit(125)\nos.close(fd)\n"
            "try:\n    os.execvp(sys.argv[2], sys.argv[2:])\nexcept OSError as e:\n"
            "    sys.stderr.write(f'bili: cannot run {sys.argv[2]}: {e}\\n')\n    sys.exit(126)\n")

    def __init__(self, argv: list[str], env: Mapping[str, str]):
        r, self._w = os.pipe()
        try:  # (the read end keeps its number in the child: pass_fds)
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", self.HOLD, str(r), *argv],
                                         env=dict(env), pass_fds=(r,))
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)
        self.released = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> subprocess.Popen:
        os.write(self._w, b"go\n")
        os.close(self._w)
        self.released = True
        return self.proc

    def cancel(self) -> None:
        """The program never runs: the holder exits (125) as its pipe closes."""
        if not self.released:
            os.close(self._w)
            self.released = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


def run_child(argv: list[str], env: Mapping[str, str], on_start=None, held: Held | None = None) -> int:
    """Run the agent (or let ``held`` go), forwarding SIGINT/SIGTERM/SIGHUP/SIGQUIT; its return code
    (negative: a signal)."""
    holder: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, _frame):
        if _terminal_delivers(signum):
            return
        if not holder:
            pending.append(signum)  # arrived while the agent was being started
            return
        with contextlib.suppress(ProcessLookupError):
            holder[0].send_signal(signum)

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        holder.append(held.release() if held is not None else subprocess.Popen(argv, env=dict(env)))
        if on_start is not None:
            on_start(holder[0].pid)
        for signum in pending:
            with contextlib.suppress(ProcessLookupError):
                holder[0].send_signal(signum)
        return holder[0].wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _raise_on_signal(signum, _frame):
    raise _Interrupted(signum)


def _exit_like(rc: int) -> int:
    """The launcher's exit: the agent's code, or the agent's death by signal re-enacted."""
    if rc >= 0:
        return rc
    sig = -rc
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, ValueError):
        signal.signal(sig, signal.SIG_DFL)  # (SIGKILL and SIGSTOP have no handler to reset)
    with contextlib.suppress(OSError, ValueError):
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a pending signal is delivered right away; this is a safety net
    return 128 + sig


@dataclass
class Plan:
    """Everything a launch decides before anything runs (``--dry-run`` prints it)."""

    agent: Agent
    binary: str | None
    argv: list[str]
    hosts: HostPlan
    allow: str
    proxy_url: str
    env: dict[str, str]
    command: list[str]
    ca: object
    transparent: str | None = None  # the mechanism (transparent.MECHANISMS), or None
    transparent_mode: str = ""  # the proxy mode it needs (transparent@127.0.0.1:PORT, local:NAME)
    redirect: list[tuple[str, int]] = field(default_factory=list)  # what the namespace sends to it
    upstream: str | None = None  # the user's own proxy, bili's upstream (user_upstream)
    upstream_note: str = ""  # why the user's proxy is not bili's upstream
    data_dir: str = ""  # the proxy's data directory (--data-dir, --set bili_data_dir=, else the default)
    no_proxy: list[str] = field(default_factory=list)  # model hosts taken out of the agent's NO_PROXY
    bypass: list[str] = field(default_factory=list)  # what in the agent's settings goes around bili (settings_bypass)
    own_hosts: list[tuple[str, int]] = field(default_factory=list)  # the agent's own model hosts (its NO_PROXY's)


def plan_launch(agent: Agent, args: argparse.Namespace, env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> Plan:
    from bili_addon.certs import ensure_ca

    env = dict(os.environ if env is None else env)
    cwd = cwd or Path.cwd()
    binary = shutil.which(agent.binary, path=env.get("PATH"))
    ca = ensure_ca(args.confdir)
    mechanism = getattr(args, "transparent", None)
    override = [transparent.parse_dest(d) for d in getattr(args, "redirect", None) or []]
    project = agent_project(agent, getattr(args, "extra", None) or [], cwd)
    hosts = intercept_plan(agent, env, project, [*(args.intercept_host or []), *(f"{h}:{p}" for h, p in override)])
    allow = allow_hosts_regex(hosts.hosts)
    upstream, upstream_note = user_upstream(env, args.port)
    if upstream and mechanism:
        upstream, upstream_note = None, f"{upstream} is not chained to with --transparent: bili dials hosts directly"
    modes = [f"upstream:{upstream}" if upstream else "regular"]
    tmode = ""
    if mechanism == "netns":
        tmode = transparent.transparent_mode(transparent_port(args.port, getattr(args, "transparent_port", None)))
    elif mechanism == "local":
        tmode = transparent.local_mode(binary or agent.binary)
    if tmode:
        modes.append(tmode)
    proxy_url = f"http://{DEFAULT_HOST}:{args.port}"
    mitmdump = find_mitmdump() or Path("mitmdump")
    sets, _ = user_options(args.set, flags={"--bili-mode": args.bili_mode, "--first-party": args.first_party,
                                            "--data-dir": args.data_dir})
    # (where the proxy keeps its store and admin token, as it reads its options: the launcher's token and
    # the agent's `bili mcp` are that directory's, whatever $BILI_DATA_DIR the caller has)
    data_dir = str(Path(option_value(sets, "bili_data_dir", args.data_dir) or default_data_dir(env)).expanduser()
                   .resolve())
    command = mitmdump_command(
        mitmdump, listen_host=DEFAULT_HOST, listen_port=args.port, modes=modes, confdir=ca.confdir,
        data_dir=args.data_dir, bili_mode=args.bili_mode or "fold",
        upstream_ca=upstream_trust(ca, env), lazy=False, allow_hosts=allow,
        first_party=args.first_party, scripts=args.script or [], sets=sets,
    )
    if mechanism == "local":
        local = {m.name: m for m in transparent.support(env, probe_nft=False)}["local"]
        command = transparent.local_proxy_command(command, local.cgroup_bind)
    own = agent.model_hosts(env, project).hosts  # (NO_PROXY loses entries naming these only)
    agent_vars = agent_env(agent, env, proxy_url, ca, data_dir, own, bool(upstream))
    direct = no_proxy_conflicts(agent_vars, own)  # (what NO_PROXY still sends around bili)
    bypass = [f"NO_PROXY names {_some(direct)}: {agent.title} reaches them directly, out of bili's sight (its entry "
              "is kept: " + ("bili goes out through your proxy, and NO_PROXY says what that proxy does not serve"
                             if upstream else "a suffix or * names your other hosts too") + "); take them out of "
              "NO_PROXY to have bili see them"] if direct else []
    return Plan(agent, binary, [binary or agent.binary, *args.extra], hosts, allow, proxy_url,
                agent_vars, command, ca, mechanism, tmode,
                override or list(hosts.hosts), upstream, upstream_note, data_dir,
                taken_out(env, own, bool(upstream)),
                bypass + settings_bypass(agent, env, project, proxy_url, hosts.hosts), list(own))


def agent_project(agent: Agent, argv: list[str], cwd: Path) -> Path:
    """The directory the agent works in, whose configuration names its model hosts: codex's ``-C DIR``
    (``--cd``), opencode's project argument (a directory), else ``cwd``."""
    found = None
    if agent.name == "codex":
        for i, a in enumerate(argv):
            if a in ("-C", "--cd") and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith("--cd="):
                found = a[len("--cd="):]
            elif a.startswith("-C") and len(a) > 2:
                found = a[2:]
    elif agent.name == "opencode":
        found = next((a for a in argv if not a.startswith("-") and (cwd / a).is_dir()), None)
    if not found:
        return cwd
    path = (cwd / Path(found).expanduser()).resolve()
    return path if path.is_dir() else cwd


def reuse_ignores(args: argparse.Namespace, health: Mapping) -> list[str]:
    """The options asked of this launch that a proxy it re-uses (``health``: its answer) does not take."""
    out = []
    if args.bili_mode and args.bili_mode != health.get("mode"):
        out.append(f"--bili-mode {args.bili_mode} (it runs in {health.get('mode')})")
    for flag, given in (("--first-party", args.first_party), ("--set", args.set), ("-s", args.script)):
        if given:
            out.append(flag)
    return out


def port_in_use(host: str, port: int) -> bool:
    """Something listens on ``host:port`` (bound the way mitmproxy binds: SO_REUSEADDR)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def transparent_port(port: int, given: int | None) -> int:
    """The transparent listener's port for a proxy on ``port``: ``given``; else the one of the bili
    proxy already there (re-used with it); else ``port + 1`` when nothing listens there; else a free
    port the system picks (another program holds ``port + 1``: mitmdump would not start)."""
    if given:
        return given
    found = probe(port, DEFAULT_HOST, timeout=1.0)
    if found.kind == "bili":
        for mode in found.health.get("modes") or ():
            if isinstance(mode, str) and mode.startswith("transparent@"):
                with contextlib.suppress(ValueError):
                    return int(mode.rsplit(":", 1)[1])
    if port + 1 <= 65535 and not port_in_use(DEFAULT_HOST, port + 1):
        return port + 1
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((DEFAULT_HOST, 0))
        return s.getsockname()[1]


def program_agent(program: str) -> Agent:
    """Any program, for ``bili run --transparent -- PROGRAM``: the model hosts of every agent (built-in
    and configured, as ``bili run`` intercepts them), every CA variable set."""
    return Agent("run", Path(program).name, program, ANY_CA, (),
                 lambda env, cwd: [f for a in AGENTS.values() for f in a.config_files(env, cwd)],
                 bundle_vars=tuple(dict.fromkeys(v for a in AGENTS.values() for v in a.bundle_vars)),
                 env_base_urls=tuple(dict.fromkeys(v for a in AGENTS.values() for v in a.env_base_urls)))



def configure_agent(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen-port", "--port", dest="port", type=int, default=default_port(), metavar="PORT",
                   help=f"the proxy's port on 127.0.0.1; a bili proxy already there is re-used "
                        f"(default: $BILI_PORT, else {DEFAULT_PORT}; --port is the old spelling)")
    p.add_argument("--bili-mode", choices=BILI_MODES, default=None,
                   help="bili_mode of a proxy this launch starts (default: fold)")
    p.add_argument("--first-party", choices=FIRST_PARTY, default=None,
                   help="bili_first_party of a proxy this launch starts: observe leaves Claude Code's "
                        "first-party api.anthropic.com requests unchanged (default: fold)")
    p.add_argument("--data-dir", metavar="DIR", help="the store of a proxy this launch starts")
    p.add_argument("--confdir", metavar="DIR", help="where the CA lives (as for bili run)")
    p.add_argument("--intercept-host", action="append", metavar="HOST[:PORT]",
                   help="intercept this host too (repeatable); model hosts and the agent's configured "
                        "base URLs are intercepted anyway")
    p.add_argument("-s", "--script", action="append", metavar="FILE",
                   help="one more mitmproxy addon for a proxy this launch starts (repeatable)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="a mitmproxy or bili option for a proxy this launch starts (repeatable); it replaces "
                        "the launcher's own value of that option (allow_hosts: adds to it)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the hosts, the agent's environment and the proxy command, run nothing")
    p.add_argument("-q", "--quiet", action="store_true", help="no bili: lines on stderr (errors excepted)")
    p.add_argument("-v", "--verbose", action="store_true", help="also say which pid the agent runs as, and how it exited")
    configure_transparent(p)


def configure_transparent(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transparent", nargs="?", const="netns", choices=transparent.MECHANISMS, default=None,
                   metavar="MECHANISM",
                   help="for programs that ignore HTTPS_PROXY (Linux, root): netns (the default) runs it in a "
                        "network namespace whose TCP to the model hosts is redirected to mitmproxy's "
                        "transparent mode, everything else untouched; local uses mitmproxy's local redirect "
                        "mode (see bili doctor for what this machine supports). bili run --transparent -- "
                        "PROGRAM ARGS runs any program so")
    p.add_argument("--transparent-port", type=int, metavar="PORT",
                   help="the transparent listener's port on 127.0.0.1 (default: the running bili proxy's, else the proxy's "
                        "port + 1 when free, else a free one)")
    p.add_argument("--redirect", action="append", metavar="HOST[:PORT]",
                   help="with --transparent: redirect these destinations (repeatable; names are resolved, "
                        "IPv4 addresses taken as they are) instead of every intercepted model host")
    p.add_argument("--install-deps", action="store_true",
                   help="with --transparent: install what the mechanism needs (nftables) with apt-get")


def launch(agent: Agent, args: argparse.Namespace) -> int:
    try:
        plan = plan_launch(agent, args)
    except OptionError as e:
        _say(f"error: {e}")
        return 2
    except Exception as e:  # CertError, ValueError
        _say(f"error: {e}")
        return 1
    if args.dry_run:
        return _print_plan(plan)
    if plan.binary is None:
        how = agent.package.split(":", 1)
        install = (f"npm install -g {how[1]}" if how[0] == "npm" else f"pipx install {how[1]}") if agent.package else ""
        _say(f"error: {agent.binary} ({agent.title}) is not on PATH" + (f"; install it with: {install}" if install else ""))
        return 127
    for note in plan.hosts.notes:
        _say(f"note: {note}", args.quiet)
    if plan.no_proxy:
        _say(f"note: NO_PROXY names {_some(plan.no_proxy)}: taken out of {agent.binary}'s NO_PROXY (it would reach "
             "them directly, out of bili's sight)", args.quiet)
    for why in plan.bypass:  # (past -q: the agent runs with bili off)
        _say(f"warning: {why}")
    old_proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    if old_proxy and old_proxy.rstrip("/") != plan.proxy_url:
        _say(f"note: HTTPS_PROXY={old_proxy} is replaced by {plan.proxy_url} for {agent.binary}", args.quiet)
    if plan.upstream:
        _say(f"note: bili goes out through your proxy {plan.upstream}", args.quiet)
    elif plan.upstream_note:
        _say(f"warning: your proxy {plan.upstream_note}")  # (past -q: egress that should go through it does not)

    for pid, theirs in stale_daemons(agent, plan.proxy_url):
        _say(f"note: {_daemon_note(agent, pid, theirs)}", args.quiet)

    proxy_env = None
    if plan.transparent:
        try:
            transparent.require(plan.transparent, install_deps=args.install_deps, say=lambda m: _say(m, args.quiet))
        except transparent.TransparentError as e:
            _say(f"error: {e}")
            return 1
        proxy_env = transparent.proxy_env(plan.transparent, os.environ, state_dir())
    if getattr(args, "store", None):  # (bili run --transparent --store: read from the environment, never argv)
        proxy_env = {**(proxy_env if proxy_env is not None else os.environ), "BILI_STORE": args.store}
    held = None
    if plan.transparent == "local":  # the agent's pid goes into the local mode: started, held before it runs
        try:
            held = Held(plan.argv, plan.env)
        except OSError as e:
            _say(f"error: cannot run {plan.argv[0]}: {e}")
            return 126
        mode = transparent.local_mode(plan.binary or agent.binary, held.pid)
        plan.command = transparent.with_mode(plan.command, plan.transparent_mode, mode)
        plan.transparent_mode = mode

    try:  # created now if this is the first run, so that racing launchers agree on it
        token = private.ensure_token(Path(plan.data_dir))
    except OSError as e:
        token = None
        if isinstance(e, private.NotPrivate):  # (past -q: the proxy will not use that data dir either)
            _say(f"warning: {e}")
    proxy = SharedProxy(args.port, plan.command, quiet=args.quiet, token=token, env=proxy_env)
    old = {s: signal.signal(s, _raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    rc = 1
    try:
        try:
            proxy.attach()
            if proxy.reused and not plan.transparent:
                _forwards(proxy.health, plan.proxy_url)
            ca = reused_ca(plan.ca, proxy.health, plan.proxy_url) if proxy.reused else plan.ca
            if held is not None and ca is not plan.ca:  # (started already, with this launch's CA in its environment)
                raise LaunchError(f"the bili proxy at {plan.proxy_url} signs with the CA in "
                                  f"{printable(proxy.health.get('ca_cert'))}; give the launcher its --confdir")
        except LaunchError as e:
            _say(f"error: {e}")
            return 1
        if not proxy.health.get("store", True):  # (said even with --quiet: the agent runs with bili off)
            _say(f"warning: the proxy's store is unusable ({proxy.health.get('store_error') or 'see its log'}): its "
                 "requests pass through unchanged, bili is off until the store works again", False)
        if proxy.started:
            _say(f"started the proxy on {plan.proxy_url} (pid {proxy.pid}, log {proxy.log_path}); "
                 f"intercepting {len(plan.hosts.hosts)} model hosts", args.quiet)
        else:
            _say(f"re-using the bili proxy on {plan.proxy_url} (version {proxy.health.get('version')}, "
                 f"mode {proxy.health.get('mode')})", args.quiet)
            if ca is not plan.ca:
                _say(f"note: it signs with the CA in {printable(proxy.health.get('ca_cert'))}, not with this launch's "
                     f"({plan.ca.cert}): {agent.binary} trusts that one", args.quiet)
                plan.ca, plan.env = ca, agent_env(agent, os.environ, plan.proxy_url, ca, plan.data_dir,
                                                  plan.own_hosts, bool(plan.upstream))
            ignored = reuse_ignores(args, proxy.health)
            if ignored:  # (past -q: the agent runs under options other than the ones asked for)
                _say(f"warning: the running proxy keeps its own options; {', '.join(ignored)} apply only to a proxy "
                     f"this launch starts (stop the one on port {args.port}, or choose another --port)")
            got = request_intercept(args.port, plan.hosts.hosts, token=proxy.token)
            if isinstance(got, dict):
                if got.get("added"):
                    _say(f"the proxy now decrypts {', '.join(got['added'])} too (this agent's model hosts)", args.quiet)
            elif plan.hosts.endpoints:
                _say(f"note: the running proxy did not take this agent's model hosts ({got}); "
                     f"{', '.join(sorted({e.host for e in plan.hosts.endpoints}))} may not be decrypted", args.quiet)
        try:
            with transparent.child(plan.transparent, plan.transparent_mode, proxy.health, plan.redirect,
                                   args.port, plan.argv, plan.env, lambda m: _say(m, args.quiet)) as (argv, env):
                rc = run_child(argv, env, held=held, on_start=(
                    (lambda pid: _say(f"running {plan.argv[0]} (pid {pid})")) if args.verbose and not args.quiet else None))
            if args.verbose:
                _say(f"{agent.binary} exited with {'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}", args.quiet)
        except transparent.TransparentError as e:
            _say(f"error: {e}")
            rc = 1
        except OSError as e:
            _say(f"error: cannot run {plan.argv[0]}: {e}")
            rc = 126
    except _Interrupted as e:  # killed while the proxy was starting
        rc = -e.signum
    except KeyboardInterrupt:  # Ctrl-C while the proxy was starting
        rc = -signal.SIGINT
    finally:
        # stopping the proxy: a signal now (Ctrl-C again, the service manager) only hurries it along
        # (SIGKILL at once); it never interrupts the clean-up, so the agent's code is still the exit
        # code and the lease files are gone
        hurry: list[int] = []
        for s in old:
            signal.signal(s, lambda signum, _f: hurry.append(signum))
        prev_int = signal.signal(signal.SIGINT, lambda signum, _f: hurry.append(signum))
        try:
            proxy.detach(hurry=lambda: bool(hurry))
        except OSError as e:
            _say(f"warning: could not stop the proxy: {e}")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            signal.signal(signal.SIGINT, prev_int)
        if held is not None:
            held.cancel()  # (when it never ran)
        if proxy.stopped:
            _say(f"stopped the proxy (pid {proxy.stopped})", args.quiet)
    return _exit_like(rc)


def reused_ca(ca, health: Mapping, url: str):
    """The CA the agent must trust for a re-used proxy (``health``: its answer): this install's when the
    proxy signs with it, else the proxy's own (the certificate its health names, copied into bundles in
    this install's confdir, :func:`certs.proxy_ca`).  A proxy started elsewhere keeps its own CA (another
    checkout's ``certs/``, a pipx install's, ``~/.mitmproxy``, ``bili run --confdir``): the agent given
    this confdir's failed TLS on every request.  LaunchError when that CA cannot be read here."""
    from bili_addon import certs

    theirs = health.get("ca_sha256")
    if not isinstance(theirs, str) or not theirs:
        return ca  # (a bili that does not say: this confdir's is the best guess)
    try:
        if certs.sha256(Path(ca.cert).read_bytes()) == theirs.lower():
            return ca
    except (OSError, ValueError):
        pass
    where = health.get("ca_cert")
    where = where if isinstance(where, str) and where else None
    pem = certs.cert_with(where, theirs) if where else None
    if pem is None:
        raise LaunchError(
            f"the bili proxy at {url} signs with another CA (SHA-256 {printable(theirs[:16])}...) than this "
            f"launch's ({ca.cert}) and " + (f"names {printable(where)}, where this launcher cannot read it" if where
                                   else "does not say where it keeps it")
            + ": its agent would fail TLS on every request. Give the launcher that proxy's CA directory "
              "(--confdir DIR, the one it was started with), or choose another --port")
    try:
        return certs.proxy_ca(ca, pem)
    except certs.CertError as e:
        raise LaunchError(str(e)) from e


def _forwards(health: dict, url: str) -> None:
    """A proxy re-used as the agent's ``HTTPS_PROXY`` must listen as a forward proxy: one started as a
    reverse proxy (``bili run --mode reverse:...``) answers an agent's CONNECT with 400, every request
    of it failing."""
    modes = health.get("modes")
    if isinstance(modes, list) and modes and not any(
            isinstance(m, str) and m.split("@", 1)[0].split(":", 1)[0] in ("regular", "upstream") for m in modes):
        raise LaunchError(f"the bili proxy at {url} runs as {', '.join(map(str, modes))}, not as a forward proxy "
                          "an agent can use; choose another port with --port (or start it without --mode)")


def _print_plan(plan: Plan) -> int:
    out = sys.stdout
    print(f"agent      {plan.agent.title} ({plan.agent.name}): {plan.binary or 'not found on PATH'}", file=out)
    print(f"argv       {' '.join(plan.argv)}", file=out)
    print(f"proxy      {plan.proxy_url}", file=out)
    print("intercept  " + ", ".join(h if p == 443 else f"{h}:{p}" for h, p in plan.hosts.hosts), file=out)
    for ep in plan.hosts.endpoints:
        print(f"base URL   {ep.url} (from {ep.source})", file=out)
    for note in plan.hosts.notes:
        print(f"note       {note}", file=out)
    for why in plan.bypass:
        print(f"warning    {why}", file=out)
    changed = {k: v for k, v in plan.env.items() if os.environ.get(k) != v}
    for k in sorted(changed):
        print(f"env        {k}={changed[k]}", file=out)
    print(f"allow      {plan.allow}", file=out)
    if plan.transparent:
        what = ", ".join(h if p == 443 else f"{h}:{p}" for h, p in plan.redirect)
        print(f"transparent {plan.transparent}: {plan.transparent_mode}" +
              (f"; redirects {what}" if plan.transparent == "netns" else ""), file=out)
    print(f"command    {' '.join(plan.command)}", file=out)
    return 0


# -- bili doctor --------------------------------------------------------------------------------------------
def configure_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen-port", "--port", dest="port", type=int, default=default_port(), metavar="PORT",
                   help=f"the port to check (default: $BILI_PORT, else {DEFAULT_PORT})")
    p.add_argument("--confdir", metavar="DIR", help="where the CA lives (default as for bili run)")
    p.add_argument("--data-dir", metavar="DIR", help="where the store lives (default: $XDG_DATA_HOME/bili-addon)")
    p.add_argument("--store", metavar="URL", help="a shared PostgreSQL store to check (default: $BILI_STORE)")
    p.add_argument("--json", action="store_true", help="the checks as JSON")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def agent_version(binary: str) -> str:
    """The installed version, read from the package next to the binary (the agent is not run:
    some write to their home directory on every start)."""
    real = Path(binary).resolve()
    for d in list(real.parents)[:6]:
        pkg = d / "package.json"
        if pkg.is_file():
            try:
                doc = json.loads(pkg.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("version"), str) and doc.get("name"):
                return doc["version"]
    try:  # a Python console script: its interpreter's site-packages
        first = real.read_bytes()[:256].split(b"\n", 1)[0]
        if first.startswith(b"#!"):
            py = Path(first[2:].decode().strip().split()[0])
            for dist in sorted(py.parent.parent.glob("lib/python*/site-packages/*.dist-info")):
                name, _, version = dist.name[: -len(".dist-info")].partition("-")
                if version and name.lower().replace("_", "-").startswith(real.name.lower()):
                    return version
    except (OSError, UnicodeDecodeError, IndexError):
        pass
    return "unknown version"


def shared_store_check(spec: str, data_dir: str) -> Check:
    """A PostgreSQL store: reachable, its schema version, its round trip and pool, its size."""
    try:
        s = open_store(spec, data_dir)
    except StoreError as e:
        return Check("store", False, f"{e}" + (f" ({e.hint})" if e.hint else ""))
    try:
        version, ms = s.schema_version(), s.ping() * 1000
        n = len(s.sessions())
        pool = s.pool_stats()
    except StoreError as e:
        return Check("store", False, str(e))
    finally:
        s.close()
    ok = version == SCHEMA_VERSION
    return Check("store", ok, f"{s.where} (postgresql): schema version {version}"
                 f"{'' if ok else f' (this bili expects {SCHEMA_VERSION})'}, {n} conversation(s), round trip "
                 f"{ms:.1f} ms, pool {pool['pool_size']}/{pool['pool_max']}")


def doctor_checks(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[Check]:
    from bili_addon.certs import CA_CERT, CA_KEY, COMBINED, default_confdir
    env = dict(os.environ if env is None else env)
    checks: list[Check] = []
    confdir = Path(args.confdir).expanduser().resolve() if args.confdir else default_confdir()
    cert, key, combined = confdir / CA_CERT, confdir / CA_KEY, confdir / COMBINED
    if not cert.is_file() or not key.is_file():
        checks.append(Check("CA", False, f"no CA in {confdir}; create it with: bili ca"))
    else:
        try:
            from cryptography import x509

            c = x509.load_pem_x509_certificate(cert.read_bytes())
            expires = c.not_valid_after_utc
            import datetime

            mode = key.stat().st_mode & 0o777
            ok = expires > datetime.datetime.now(datetime.timezone.utc) and mode == 0o600
            why = "" if ok else (" (EXPIRED)" if expires <= datetime.datetime.now(datetime.timezone.utc)
                                 else f" (key mode {mode:o}, should be 600: run bili ca)")
            checks.append(Check("CA", ok, f"{cert}, expires {expires:%Y-%m-%d}, key mode {mode:o}{why}"))
        except Exception as e:
            checks.append(Check("CA", False, f"{cert} does not load: {e}"))
        if combined.is_file() and cert.is_file() and cert.read_bytes().strip() in combined.read_bytes():
            checks.append(Check("CA bundle", True, f"{combined} (system roots + our CA)"))
        else:
            checks.append(Check("CA bundle", False, f"{combined} missing or stale; run bili ca"))

    found = probe(args.port)
    if found.kind == "bili":
        h = found.health
        checks.append(Check("port", True, f"127.0.0.1:{args.port}: a bili proxy answers (version {h.get('version')}, "
                                          f"mode {h.get('mode')}, store {'ok' if h.get('store') else 'UNAVAILABLE'})"))
    elif found.kind == "free":
        checks.append(Check("port", True, f"127.0.0.1:{args.port} is free (bili <agent> starts a proxy there)"))
    else:
        checks.append(Check("port", False, f"127.0.0.1:{args.port} is used by something else ({found.detail}); "
                                           f"use --listen-port / BILI_PORT"))

    data = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    db = data / DB_NAME
    shared = store_spec(getattr(args, "store", None) or "", env)
    refused = private.refusal(data)
    if refused:
        checks.append(Check("data dir", False, f"{refused}: bili will not use it (its store nor its admin token); "
                                               "choose another --data-dir, or remove it"))
    if is_url(shared):
        checks.append(shared_store_check(shared, str(data)))
    elif db.is_file():
        import sqlite3

        try:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
            try:
                n = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            finally:
                conn.close()
            have = int(row[0]) if row else 0
            if have > SCHEMA_VERSION:  # (the proxy refuses it: its requests would pass through unchanged)
                e = newer_schema(str(db), have)
                checks.append(Check("store", False, f"{e} ({e.hint})"))
            else:
                checks.append(Check("store", True, f"{db}: {n} conversation(s)"))
        except (sqlite3.Error, ValueError) as e:
            checks.append(Check("store", False, f"{db} does not open: {e}"))
    else:
        parent = next((p for p in [data, *data.parents] if p.exists()), None)
        ok = parent is not None and os.access(parent, os.W_OK | os.X_OK)
        checks.append(Check("store", ok, f"{db} not created yet ({'its directory is writable' if ok else 'NOT writable'})"))

    mitm = find_mitmdump()
    checks.append(Check("mitmdump", mitm is not None, str(mitm) if mitm else "not found: is mitmproxy installed?"))
    checks += transparent_checks(env)

    for a in AGENTS.values():
        binary = shutil.which(a.binary, path=env.get("PATH"))
        plan = a.model_hosts(env)
        custom = [f"{e.url} ({e.source})" for e in plan.endpoints]
        if binary is None:
            checks.append(Check(f"agent {a.name}", False, f"{a.title}: not installed ({a.package})", required=False))
            continue
        ver = agent_version(binary)
        line = f"{a.title} {ver} at {binary}"
        if a.tested_version and ver != a.tested_version:
            line += f" (tested with {a.tested_version})"
        if custom:
            line += "; custom base URLs: " + ", ".join(custom)
        for n in plan.notes:
            line += f"; note: {n}"
        checks.append(Check(f"agent {a.name}", True, line, required=False))
    return checks


def transparent_checks(env: Mapping[str, str], **kw) -> list[Check]:
    """``--transparent``: which mechanism works on this machine, and why (not required checks)."""
    if not sys.platform.startswith("linux"):
        return [Check("transparent", False, "Linux only (network namespaces, nftables, eBPF)", required=False)]
    out = []
    for m in transparent.support(env, **kw):
        detail = f"--transparent={m.name}: " + ("works here: " if m.ok else "not here: ") + m.why
        if m.fix:
            detail += f"; install with: {m.fix} (or let bili do it: --transparent={m.name} --install-deps)"
        out.append(Check(f"{m.name} redirect", m.ok, detail, required=False))
    return out


def doctor(args: argparse.Namespace) -> int:
    checks = doctor_checks(args)
    bad = [c for c in checks if c.required and not c.ok]
    if args.json:
        print(json.dumps({"ok": not bad, "version": __version__,
                          "checks": [c.__dict__ for c in checks]}, indent=2))
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "--  ")
            print(f"{mark} {c.name:<15} {c.detail}")
        print("\nall required checks passed" if not bad else f"\n{len(bad)} check(s) failed")
    return 0 if not bad else 1
