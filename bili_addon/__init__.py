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
