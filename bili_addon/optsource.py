"""Where the proxy's options came from, reported once at start-up, so an override is never silent.

mitmproxy reads options from three places: ``--set name=value`` on the command line, then
``config.yaml`` (or ``config.yml``) in the confdir, then its dedicated flags (``--mode``, ``-w``,
...).  A later place wins, so a ``config.yaml`` quietly beats ``--set bili_mode=...`` (what ``bili
run --bili-mode`` passes).  :class:`OptionReport` logs every option given in a config file or on
the command line with its effective value and its source, and warns when a config file overrode a
value given on the command line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("bili")

CONFIG_NAMES = ("config.yaml", "config.yml")  # mitmproxy loads both, in this order (the later wins)
PROGRAMS = ("mitmdump", "mitmweb", "mitmproxy")
MAX_VALUE = 120  # a long value (allow_hosts) is cut in the report


@dataclass
class Given:
    """One option given explicitly: its effective value, where it came from, and what it overrode."""

    name: str
    value: Any
    source: str  # "command line", "--set", or a config file's path
    overridden: list[tuple[str, Any]] = field(default_factory=list)  # (source, value) the winner replaced


def from_config(confdir: str) -> list[tuple[str, dict[str, Any]]]:
    """``(path, options)`` of each config file in ``confdir``, in the order mitmproxy applies them."""
    from mitmproxy import exceptions, optmanager

    out = []
    for name in CONFIG_NAMES:
        p = Path(confdir).expanduser() / name
        if not p.is_file():
            continue
        try:
            data = optmanager.parse(p.read_text(encoding="utf8"))
        except (exceptions.OptionsError, OSError, UnicodeDecodeError):
            continue  # mitmproxy itself refuses to start on a broken file
        if isinstance(data, dict):
            out.append((str(p), data))
    return out


def from_command_line(options: Any, argv: list[str], program: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``(flags, sets)``: options given by mitmproxy's dedicated flags, and by ``--set name=value``
    (the text after ``=``), parsed with that program's own parser."""
    from mitmproxy.tools import cmdline

    make = {"mitmdump": cmdline.mitmdump, "mitmweb": cmdline.mitmweb, "mitmproxy": cmdline.mitmproxy}[program]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = make(options).parse_known_args(argv)
    except (SystemExit, Exception):  # noqa: BLE001 - a report must never stop the proxy
        return {}, {}
    flags = {k: v for k, v in vars(args).items() if k in options and v is not None}
    sets: dict[str, str] = {}
    for spec in args.setoptions or []:
        name, _, value = spec.partition("=")
        sets[name.strip()] = value
    return flags, sets


def sources(options: Any, argv: list[str] | None, program: str, confdir: str) -> list[Given]:
    """Every option given in a config file or on the command line, in mitmproxy's precedence:
    ``--set``, then the config files, then the dedicated flags."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if argv is not None and program in PROGRAMS:
        flags, sets = from_command_line(options, argv, program)
        layers.append(("--set", sets))
        layers += from_config(confdir)
        layers.append(("command line", flags))
    else:
        layers += from_config(confdir)
    given: dict[str, Given] = {}
    for source, values in layers:
        for name, value in values.items():
            g = given.get(name)
            if g is None:
                given[name] = Given(name, value, source)
            else:
                g.overridden.append((g.source, g.value))
                g.value, g.source = value, source
    for g in given.values():
        if g.name in options:
            g.value = getattr(options, g.name)  # the effective value, as the option holds it
    return list(given.values())


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    text = str(value)
    return text if len(text) <= MAX_VALUE else text[:MAX_VALUE] + "…"


def report(given: list[Given]) -> None:
    """Log the options by source; warn where a config file overrode the command line."""
    by_source: dict[str, list[Given]] = {}
    for g in given:
        by_source.setdefault(_where(g.source), []).append(g)
    for where, gs in by_source.items():
        log.info("[bili] options from %s: %s", where, ", ".join(f"{g.name}={_fmt(g.value)}" for g in gs))
    for g in given:
        for source, value in g.overridden:
            if source == "--set" and g.source not in ("--set", "command line"):
                log.warning("[bili] %s=%s comes from %s, which mitmproxy applies after --set: the command "
                            "line's %s=%s is overridden", g.name, _fmt(g.value), g.source, g.name, _fmt(value))
            else:
                log.info("[bili] %s=%s from %s overrides %s=%s from %s", g.name, _fmt(g.value), _where(g.source),
                         g.name, _fmt(value), _where(source))


def _where(source: str) -> str:
    return "the command line" if source in ("--set", "command line") else source


class OptionReport:
    """The addon that reports the option sources once the proxy is running."""

    def running(self) -> None:
        from mitmproxy import ctx

        program = Path(sys.argv[0]).name if sys.argv else ""
        try:
            report(sources(ctx.options, sys.argv[1:], program, ctx.options.confdir))
        except Exception as e:  # noqa: BLE001 - never stop the proxy over a report
            log.warning("[bili] could not report where the options came from: %s", e)
