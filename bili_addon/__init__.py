"""bili-addon: a mitmproxy addon that keeps AI coding agents' context and prompt cache healthy."""

__version__ = "0.1.0"

# shared by the addon, the CLI and the launcher (kept here: this module imports nothing heavy)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
BILI_MODES = ("fold", "observe", "passthrough")  # the addon's bili_mode choices
FIRST_PARTY = ("fold", "observe")  # the bili_first_party choices
