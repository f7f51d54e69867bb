"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from mitmproxy.test import taddons

from bili_addon.shell import Bili


@pytest.fixture
def bili(tmp_path):
    """The addon in mitmproxy's test context, with a fresh store; ``bili.tctx`` configures it."""
    addon = Bili()
    with taddons.context(addon) as tctx:
        # the unit tests exercise what bili does once a session is active (lazy activation has its own tests)
        tctx.configure(addon, bili_data_dir=str(tmp_path / "data"), bili_activate="always")
        addon.tctx = tctx
        yield addon
    addon.done()
