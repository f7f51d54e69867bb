"""bili-addon: a mitmproxy addon that keeps AI coding agents' context and prompt cache healthy."""

__version__ = "0.1.0"
