"""bili-addon: a mitmproxy addon that keeps AI coding agents' context and prompt cache healthy."""

__version__ = "0.1.0"

# shared by the addon, the CLI and the launcher (kept here: this module imports nothing heavy)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
BILI_MODES = ("fold", "observe", "passthrough")  # the addon's bili_mode choices
FIRST_PARTY = ("fold", "observe")  # the bili_first_party choices


def default_port(env=None) -> int:
    """``$BILI_PORT``, else 8787: the port of bili run, the launchers and bili doctor."""
    import os

    env = os.environ if env is None else env
    try:
        return int(env.get("BILI_PORT") or DEFAULT_PORT)
    except ValueError:
        return DEFAULT_PORT


def default_proxy(env=None) -> str:
    """The running proxy's address for ``bili stats``, ``bili page`` and ``bili mcp``: ``$BILI_PROXY``,
    else this host at :func:`default_port`."""
    import os

    env = os.environ if env is None else env
    return env.get("BILI_PROXY") or f"http://{DEFAULT_HOST}:{default_port(env)}"


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROLS = (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
_ESCAPED = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROLS}
_ESCAPED_BUT_LINES = {c: e for c, e in _ESCAPED.items() if c != 0x0A}


def printable(text: object, lines: bool = False) -> str:
    """``text`` with its control characters shown as escapes (``\\x1b``), never sent as they are to
    a terminal or a log: a path, a host, a header, a session id or a model name comes from a request,
    which any local user can send, and an escape sequence in one would rewrite the terminal, a line
    break forge a log line of its own.  ``lines``: line breaks stay (a table of ``bili stats``)."""
    return str(text).translate(_ESCAPED_BUT_LINES if lines else _ESCAPED)
