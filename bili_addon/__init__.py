"""bili-addon: a mitmproxy addon that keeps AI coding agents' context and prompt cache healthy."""

__version__ = "0.1.0"

# shared by the addon, the CLI and the launcher (kept here: this module imports nothing heavy)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
BILI_MODES = ("fold", "observe", "passthrough")  # the addon's bili_mode choices
FIRST_PARTY = ("fold", "observe")  # the bili_first_party choices


def default_proxy(env=None) -> str:
    """The running proxy's address for ``bili stats``, ``bili page`` and ``bili mcp``: ``$BILI_PROXY``,
    else this host at ``$BILI_PORT`` (the port ``bili run`` and the launchers take), else 8787."""
    import os

    env = os.environ if env is None else env
    if env.get("BILI_PROXY"):
        return env["BILI_PROXY"]
    try:
        port = int(env.get("BILI_PORT") or DEFAULT_PORT)
    except ValueError:
        port = DEFAULT_PORT
    return f"http://{DEFAULT_HOST}:{port}"
