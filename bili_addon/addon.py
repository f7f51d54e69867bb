"""Loader for ``mitmdump -s bili_addon/addon.py`` (the package must be installed; imports are absolute).

The installed copy's path: ``bili addon-path``."""

import sys

try:
    from bili_addon.optsource import OptionReport
    from bili_addon.shell import Bili
except ModuleNotFoundError as e:  # mitmproxy's own Python lacks bili or one of its dependencies
    raise ModuleNotFoundError(
        f"bili: {e.name!r} cannot be imported by this mitmproxy's Python ({sys.executable}). Install bili into "
        "mitmproxy's environment: pipx inject --include-apps mitmproxy bili-addon, or uv tool install mitmproxy "
        "--with bili-addon, or pip install bili-addon with that Python (a checkout's path works in place of "
        "the name); then mitmdump -s \"$(bili addon-path)\"",
        name=e.name,
    ) from e

addons = [Bili(), OptionReport()]
