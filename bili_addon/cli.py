"""``bili``: the command line.

    bili run [options] [-- extra mitmdump args]   start the proxy (mitmdump with the addon)
    bili run --transparent [options] -- PROGRAM   run PROGRAM with its model traffic redirected to bili
    bili ca [--confdir DIR] [--json]              create the CA if needed and print its paths
    bili mcp [--proxy URL] [--conversation ID]    bili's tools as a stdio MCP server
    bili claude|codex|pi|omp|hermes|opencode [options] [-- agent args]
                                                  run an agent through the proxy (started if needed)
    bili doctor                                   check the CA, the port, the store and the agents
    bili store info|migrate --to URL               a store's backend and size; copy it (SQLite <-> PostgreSQL)
    bili store prune --older-than 30d [--dry-run]  remove the conversations not seen for a while
    bili replay FLOWS.mitm|DIR ...                what the addon would have sent, per session and turn
    bili stats [--session ID] [--json] [--watch]  what the running proxy did: tokens, cache, folds, money
    bili page [--open]                            the URL of the proxy's page (a one-time sign-in code)
    bili addon-path                               the installed addon's loader, for mitmdump -s
    bili --version

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a help line, a function that adds its
arguments to its subparser, and a handler returning the exit code.  New subcommands register there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bili_addon import (BILI_MODES, DEFAULT_HOST, DEFAULT_PORT, FIRST_PARTY, __version__, launch, mcp, replay,
                        statscmd, store_cli)
from bili_addon.agents import AGENTS


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False  # takes extra arguments after ``--`` (as ``args.extra``)
    description: str = ""
    extra_name: str = "MITMDUMP_ARGS"  # what the arguments after ``--`` are, for the usage line


def _err(msg: str) -> None:
    print(f"bili: error: {msg}", file=sys.stderr)


# -- bili ca ---------------------------------------------------------------------------------------
def _ca_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--confdir", metavar="DIR", help="where the CA lives (default: the checkout's certs/, "
                   "else $XDG_DATA_HOME/bili-addon/certs)")
    p.add_argument("--json", action="store_true", help="print the paths as JSON")


def _ca(args: argparse.Namespace) -> int:
    from bili_addon.certs import CertError, ensure_ca

    try:
        ca = ensure_ca(args.confdir)
    except CertError as e:
        _err(str(e))
        return 1
    if args.json:
        print(json.dumps({
            "confdir": str(ca.confdir), "cert": str(ca.cert), "key": str(ca.key),
            "combined": str(ca.combined), "roots_source": ca.roots_source,
            "private": [str(p) for p in ca.secured],
        }, indent=2))
        return 0
    roots = ca.roots_source or "none found: the bundle holds only our CA"
    print(f"confdir          {ca.confdir}")
    print(f"CA certificate   {ca.cert}")
    print("                 -> NODE_EXTRA_CA_CERTS (Node/Bun agents), or trust it system-wide")
    print(f"combined bundle  {ca.combined}")
    print(f"                 -> SSL_CERT_FILE / REQUESTS_CA_BUNDLE (codex, Python); system roots from {roots}")
    print(f"CA private key   {ca.key} (mode 0600, never share it)")
    return 0


# -- bili run --------------------------------------------------------------------------------------
def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen-host", default=DEFAULT_HOST, metavar="HOST",
                   help=f"address to bind (default: {DEFAULT_HOST})")
    p.add_argument("--listen-port", "--port", dest="listen_port", type=int, default=launch.default_port(),
                   metavar="PORT", help=f"port to bind (default: $BILI_PORT, else {DEFAULT_PORT})")
    p.add_argument("--mode", action="append", metavar="MODE",
                   help="mitmproxy mode: regular (forward proxy, the default), reverse:URL (e.g. "
                        "reverse:https://api.anthropic.com), upstream:URL, socks5, ...; repeatable")
    p.add_argument("--data-dir", metavar="DIR",
                   help="where the store lives (bili_data_dir; default: $XDG_DATA_HOME/bili-addon)")
    p.add_argument("--store", metavar="URL",
                   help="bili_store: postgresql://user@host/db to share one database between instances (a "
                        "team gateway); default: $BILI_STORE, else SQLite in the data dir")
    p.add_argument("--confdir", metavar="DIR",
                   help="mitmproxy confdir holding the CA (default: the checkout's certs/, "
                        "else $XDG_DATA_HOME/bili-addon/certs)")
    p.add_argument("--bili-mode", choices=BILI_MODES, default=None,
                   help="fold: ledger plus ref tags rendered into the request; observe: ledger and "
                        "stats, bodies forwarded unchanged; passthrough: byte-exact, nothing recorded "
                        "(default: fold)")
    p.add_argument("--intercept", choices=("models", "all"), default="models",
                   help="models: decrypt only model API hosts (the agents' built-in providers and the base "
                        "URLs in their configuration files, read-only) and tunnel everything else "
                        "untouched; all: decrypt every HTTPS connection (default: models)")
    p.add_argument("--intercept-host", action="append", metavar="HOST[:PORT]",
                   help="with --intercept models, decrypt this host too (repeatable)")
    p.add_argument("--first-party", choices=FIRST_PARTY, default=None,
                   help="bili_first_party: observe leaves Claude Code's first-party api.anthropic.com "
                        "requests unchanged (default: fold)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="a mitmproxy or bili option (repeatable), e.g. --set bili_remind_at=30000; it replaces "
                        "bili run's own value of that option (allow_hosts: adds to it). A --set after -- is "
                        "treated the same way")
    p.add_argument("--quiet", action="store_true", help="do not print the set-up instructions")
    p.add_argument("-v", "--verbose", action="store_true", help="with --transparent: say the program's pid and exit")
    launch.configure_transparent(p)


def _display_host(host: str) -> str:
    """The address a local client should dial for a listener bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        host = "::1"
    return f"[{host}]" if ":" in host else host


def _base_url_var(upstream_host: str) -> tuple[str, str]:
    """``(variable, path suffix)`` an agent reads its base URL from, for a known upstream."""
    h = upstream_host.lower()
    if h == "api.anthropic.com":
        return "ANTHROPIC_BASE_URL", ""
    if h == "api.openai.com":
        return "OPENAI_BASE_URL", "/v1"
    return "", ""


def _instructions(modes: list, host: str, port: int, ca, bili_mode: str,
                  intercepted: list[tuple[str, int]] | None = None) -> list[str]:
    lines = [f"bili {__version__}: bili_mode={bili_mode}, CA in {ca.confdir}"]
    for m in modes:
        if m.type_name == "upstream":
            lines.append(f"bili goes out through the proxy {m.data} (your HTTPS_PROXY, or --mode upstream:)")
    if intercepted is not None:
        names = ", ".join(h if p == 443 else f"{h}:{p}" for h, p in intercepted)
        lines.append(f"TLS is decrypted for {len(intercepted)} model hosts only ({names}); every other host "
                     "is tunnelled untouched (--intercept all decrypts everything)")
    for m in modes:
        h = _display_host(m.listen_host(host))
        p = m.listen_port(port)
        addr = f"{h}:{p}"
        if m.type_name in ("regular", "upstream"):
            lines += [
                "",
                f"Forward proxy on {addr}. Point an agent at it with:",
                f"  export HTTPS_PROXY=http://{addr}",
                f"  export NODE_EXTRA_CA_CERTS={ca.cert}   # Node/Bun agents: Claude Code, pi, omp, opencode",
                f"  export SSL_CERT_FILE={ca.combined}   # codex and Python agents",
                f"  export REQUESTS_CA_BUNDLE={ca.combined}",
                f"Health: curl -x http://{addr} http://bili.proxy/__bili/health",
            ]
        elif m.type_name == "reverse":
            var, suffix = _base_url_var(m.address[0])
            upstream = m.data
            lines += ["", f"Reverse proxy on {addr} -> {upstream}. Give the agent this base URL instead of {upstream}:"]
            if var:
                lines.append(f"  export {var}=http://{addr}{suffix}")
            else:
                lines.append(f"  http://{addr}")
            lines.append(f"Health: curl http://{addr}/__bili/health")
        else:
            lines += ["", f"{m.type_name} mode on {addr} (see mitmproxy's docs on pointing clients at it);"
                          f" trust the CA {ca.cert}"]
    return lines


port_in_use = launch.port_in_use


def _busy_message(host: str, port: int, via_mode: str | None) -> str:
    found = launch.probe(port, _display_host(host).strip("[]"))
    where = f"{_display_host(host)}:{port}"
    how = (f"choose another port in --mode {via_mode}" if via_mode else
           f"choose another port with --listen-port (e.g. bili run --listen-port {port + 1})")
    if found.kind == "bili":
        h = found.health
        return (f"{where} is in use by a bili proxy already (version {h.get('version')}, mode {h.get('mode')}): "
                f"point the agent at it, or {how}")
    return f"{where} is in use by another program; {how}"


def _health_target(modes: list, host: str, port: int) -> tuple[str, int] | None:
    """Where to ask ``/__bili/health`` for the proxy's first mode that answers HTTP (None: none does)."""
    for m in modes:
        if m.type_name in ("regular", "upstream", "reverse"):
            return _display_host(m.listen_host(host)).strip("[]"), m.listen_port(port)
    return None


def _serve(cmd: list[str], target: tuple[str, int] | None, ready: Callable[[dict], None],
           env: dict[str, str] | None = None) -> int:
    """Run mitmdump as our child (its output is ours; ``env``: its environment, else ours), wait until
    ``/__bili/health`` answers as bili, then call ``ready``; forward signals to it and return its exit
    code.  If it answers, but not as bili (the addon did not load: traffic would flow with bili off),
    stop it and return 1."""
    import time

    failed: list[str] = []
    answered: list[dict] = []

    def check(pid: int) -> None:
        if target is None:
            answered.append({})
            ready({})
            return
        deadline = time.monotonic() + launch.START_TIMEOUT
        other_since = None
        while time.monotonic() < deadline:
            if not launch._alive(pid):
                return  # exited during start-up: its own messages say why
            found = launch.probe(target[1], target[0], timeout=1.0)
            if found.kind == "bili":
                answered.append(found.health)
                ready(found.health)
                return
            if found.kind == "other":
                other_since = other_since or time.monotonic()
                if time.monotonic() - other_since > launch.ADDON_GRACE:
                    failed.append(f"mitmdump is running but the bili addon did not load (/__bili/health: "
                                  f"{found.detail}); see mitmdump's messages above. Stopped it: without the addon "
                                  "traffic would pass with bili off")
                    break
            else:
                other_since = None
            time.sleep(0.1)
        else:
            failed.append(f"the proxy did not answer /__bili/health within {launch.START_TIMEOUT:.0f} s; stopped it")
        launch.SharedProxy._kill(pid, None)

    try:
        rc = launch.run_child(cmd, os.environ if env is None else env, on_start=check)
    except OSError as e:
        _err(f"cannot start {cmd[0]}: {e}")
        return 1
    if failed:
        _err(failed[0])
        return 1
    if rc > 0 and not answered:
        _err(f"mitmdump exited during start-up (code {rc}); see its messages above")
    return launch._exit_like(rc)


def _run_transparent(args: argparse.Namespace) -> int:
    """``bili run --transparent -- PROGRAM ARGS``: PROGRAM through bili as the agent launchers run
    theirs (a proxy re-used or started, with its transparent listener), exit code PROGRAM's."""
    refused = [flag for flag, given in (("--mode", args.mode), ("--intercept all", args.intercept == "all"),
                                        ("--listen-host", args.listen_host != DEFAULT_HOST)) if given]
    if refused:
        _err(f"{', '.join(refused)} cannot be combined with --transparent (the program's traffic reaches the "
             f"proxy on {DEFAULT_HOST} through the redirect)")
        return 2
    if not args.extra:
        _err("--transparent runs a program: give it after --, e.g. bili run --transparent -- node app.js")
        return 2
    sets, scripts = [], []  # the launcher takes scripts as -s (a --set scripts= beside -s would be a second value)
    for spec in args.set or []:
        name, _, value = spec.partition("=")
        (scripts.append(value) if name.strip() == "scripts" and value else sets.append(spec))
    agent = launch.program_agent(args.extra[0])
    ns = argparse.Namespace(
        port=args.listen_port, bili_mode=args.bili_mode, first_party=args.first_party, data_dir=args.data_dir,
        confdir=args.confdir, intercept_host=args.intercept_host, script=scripts, set=sets, dry_run=False,
        quiet=args.quiet, verbose=args.verbose, extra=args.extra[1:], transparent=args.transparent,
        transparent_port=args.transparent_port, redirect=args.redirect, install_deps=args.install_deps,
        store=args.store)  # (as $BILI_STORE: a URL's password in the proxy's arguments is every local user's to read)
    return launch.launch(agent, ns)


def _run(args: argparse.Namespace) -> int:
    from mitmproxy.proxy.mode_specs import ProxyMode

    if args.transparent:
        return _run_transparent(args)
    if args.redirect or args.transparent_port or args.install_deps:
        _err("--redirect, --transparent-port and --install-deps go with --transparent")
        return 2

    from bili_addon.agents import allow_hosts_regex, intercept_plan
    from bili_addon.certs import CertError, ensure_ca
    from bili_addon.launch import find_mitmdump, mitmdump_command, upstream_trust, user_upstream

    upstream, why = user_upstream(os.environ, args.listen_port) if not args.mode else (None, "")
    if why:
        print(f"bili: warning: your proxy {why}", file=sys.stderr, flush=True)
    specs = args.mode or [f"upstream:{upstream}" if upstream else "regular"]
    try:
        modes = [ProxyMode.parse(s) for s in specs]
    except ValueError as e:
        _err(f"invalid --mode: {e}")
        return 2
    try:
        sets, rest = launch.user_options(args.set, args.extra, reserved=True, flags={
            "--bili-mode": args.bili_mode, "--first-party": args.first_party, "--data-dir": args.data_dir,
            "--store": args.store})
    except launch.OptionError as e:
        _err(str(e))
        return 2
    bili_mode = launch.option_value(sets, "bili_mode", args.bili_mode or "fold")
    env = None
    if args.store and all(name != "bili_store" for name, _v in sets):
        # (the addon reads $BILI_STORE: a URL's password in mitmdump's arguments is every local user's to read)
        env = {**os.environ, "BILI_STORE": args.store}
    for m in modes:
        host, port = m.listen_host(args.listen_host), m.listen_port(args.listen_port)
        if port and port_in_use(host, port):
            _err(_busy_message(host, port, m.full_spec if m.custom_listen_port else None))
            return 1
    try:
        ca = ensure_ca(args.confdir)
    except CertError as e:
        _err(str(e))
        return 1

    mitmdump = find_mitmdump()
    if mitmdump is None:
        _err(f"mitmdump not found next to {sys.executable} nor on PATH; is mitmproxy installed?")
        return 1

    allow = None
    intercepted = None
    if args.intercept == "models" and any(m.type_name != "reverse" for m in modes):
        plan = intercept_plan(None, os.environ, Path.cwd(), args.intercept_host or [])
        intercepted = list(plan.hosts)
        for m in modes:
            if m.type_name == "reverse":  # a reverse target is intercepted by definition
                host, port = m.address
                plan.add(host, port)
        allow = allow_hosts_regex(plan.hosts)
    cmd = mitmdump_command(
        mitmdump, listen_host=args.listen_host, listen_port=args.listen_port, modes=specs, confdir=ca.confdir,
        data_dir=args.data_dir, bili_mode=bili_mode,
        upstream_ca=upstream_trust(ca, os.environ),
        lazy=any(m.type_name == "reverse" for m in modes), allow_hosts=allow, first_party=args.first_party,
        sets=sets, extra=rest,
    )

    def ready(health: dict) -> None:
        if args.quiet:
            return
        lines = _instructions(modes, args.listen_host, args.listen_port, ca, health.get("mode", bili_mode),
                              intercepted)
        if health:
            store = "ok" if health.get("store") else "UNAVAILABLE (see the log above)"
            lines.append(f"\nbili: ready (health answers: version {health.get('version')}, mode {health.get('mode')}, "
                         f"store {store})")
        print("\n".join(lines), flush=True)

    sys.stdout.flush()
    sys.stderr.flush()
    return _serve(cmd, _health_target(modes, args.listen_host, args.listen_port), ready, env)


COMMANDS: dict[str, Command] = {
    "run": Command(
        help="start the proxy (mitmdump with the bili addon)",
        description="Start the proxy: makes sure the CA exists, runs mitmdump with the bili addon, waits "
                    "until /__bili/health answers and prints how to point an agent at it. Arguments after -- "
                    "go to mitmdump (a --set there is merged with bili's own options).",
        configure=_run_args, run=_run, passthrough=True,
    ),
    "ca": Command(
        help="create the proxy's CA if needed and print where it is",
        description="Create the mitmproxy CA if it does not exist yet, restrict its key files to 0600, "
                    "rewrite the combined bundle (system roots + our CA) and print the paths.",
        configure=_ca_args, run=_ca,
    ),
    "mcp": Command(
        help="serve bili's tools to an agent as a stdio MCP server",
        description="Serve compress, decompress, search_context and acp_status as native tools over "
                    "MCP's stdio transport; each call runs in the running proxy (POST "
                    "/__bili/plugin/tool). Start it from the agent's MCP configuration.",
        configure=mcp.configure, run=mcp.run,
    ),
    **{
        name: Command(
            help=f"run {agent.title} through the proxy (starts one if needed)",
            description=f"Run {agent.title} as a child process with HTTPS_PROXY and the CA variable it needs. A bili "
                        f"proxy already answering on the port is re-used; otherwise one is started (decrypting "
                        f"only model API hosts: the built-in ones and the base URLs in {agent.title}'s own "
                        f"configuration, which is read, never written) and stopped when the agent exits. "
                        f"Arguments after -- go to {agent.title} as-is; the exit code is {agent.title}'s.",
            configure=launch.configure_agent, run=functools.partial(launch.launch, agent), passthrough=True,
            extra_name="AGENT_ARGS",
        )
        for name, agent in AGENTS.items()
    },
    "doctor": Command(
        help="check the CA, the port, the store and which agents are installed",
        description="Check the CA and its bundle, whether the port is free or held by a bili proxy, the "
                    "store, mitmdump, and which agents are installed (with the custom base URLs their "
                    "configuration names). Changes nothing. Exit code 1 when a required check fails.",
        configure=launch.configure_doctor, run=launch.doctor,
    ),
    "store": Command(
        help="a store's backend and size; copy a store into another (SQLite <-> PostgreSQL); prune it",
        description="info: the backend, schema version and conversations of a store. migrate --to URL|DIR: "
                    "copy every row of the store (default: $BILI_STORE, else the data dir's SQLite) into an "
                    "empty one and verify the copy; stop the proxies first. prune --older-than AGE [--dry-run]: "
                    "remove the conversations not seen for AGE (whole families; safe while proxies run).",
        configure=store_cli.configure, run=store_cli.run,
    ),
    "replay": Command(
        help="run captured flows (mitmproxy files) through the addon offline",
        description="Read flows saved by mitmproxy (-w FILE) and push every model request through a fresh "
                    "in-memory addon kernel in fold mode, feeding the recorded answers back so proxy tools "
                    "run as they would live; print, per session and turn, what would have been sent "
                    "upstream. A directory is searched for *.mitm files.",
        configure=replay.configure, run=replay.run,
    ),
    "stats": Command(
        help="what the running proxy did: sessions, tokens, cache, folds, money",
        description="Print the running proxy's figures (/__bili/stats, with the install's admin token): "
                    "every session, or one with --session ID and a row per answered turn; --json for "
                    "scripts; --watch to follow a live proxy.",
        configure=statscmd.configure, run=statscmd.run,
    ),
    "page": Command(
        help="print (or --open) the URL of bili's page in the running proxy",
        description="Ask the running proxy for a one-time sign-in code and print the URL of its page "
                    "(/__bili/) carrying it; the page trades the code for a cookie at once.",
        configure=statscmd.configure_page, run=statscmd.run_page,
    ),
    "addon-path": Command(
        help="print the path of the installed addon's loader (mitmdump -s \"$(bili addon-path)\")",
        description="Print the path of addon.py in the installed package, for a mitmproxy of your own that "
                    "has bili installed next to it (pipx inject mitmproxy bili-addon; uv tool install "
                    "mitmproxy --with bili-addon): mitmdump -s \"$(bili addon-path)\".",
        configure=lambda p: None, run=lambda args: _addon_path(),
    ),
}


def _addon_path() -> int:
    print(Path(__file__).resolve().parent / "addon.py")
    return 0


def _version() -> str:
    try:
        from mitmproxy.version import VERSION as mitm
    except ImportError:
        mitm = "not installed"
    return f"bili {__version__} (mitmproxy {mitm}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bili",
        description="bili-addon: a mitmproxy addon that keeps a persistent ledger of every agent "
                    "conversation passing through it.",
        epilog="Run 'bili COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, c in COMMANDS.items():
        usage_extra = f" [-- {c.extra_name} ...]" if c.passthrough else ""
        sp = sub.add_parser(name, help=c.help, description=c.description or c.help)
        c.configure(sp)
        if usage_extra:
            sp.usage = sp.format_usage().removeprefix("usage: ").rstrip() + usage_extra
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    cmd = COMMANDS[args.command]
    if extra and not cmd.passthrough:
        parser.error(f"'{args.command}' takes no arguments after --")
    args.extra = extra
    return cmd.run(args)


if __name__ == "__main__":
    sys.exit(main())
