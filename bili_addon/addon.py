"""Loader for ``mitmdump -s bili_addon/addon.py`` (the package must be installed; imports are absolute)."""

from bili_addon.optsource import OptionReport
from bili_addon.shell import Bili

addons = [Bili(), OptionReport()]
