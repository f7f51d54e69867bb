"""A ``config.yaml`` in the confdir overriding the command line is reported at start-up by a real
mitmdump (mitmproxy applies the file after ``--set``: the override itself is mitmproxy's)."""

from __future__ import annotations

import pytest

from .support import Mitmdump

pytestmark = pytest.mark.e2e


def test_a_config_file_override_is_never_silent(fake, tmp_path):
    proxy = Mitmdump(tmp_path, fake.port, bili_mode="fold")  # --set bili_mode=fold
    proxy.confdir.mkdir(parents=True)
    config = proxy.confdir / "config.yaml"
    config.write_text("bili_mode: observe\nbili_min_compress_chars: 1234\n")
    proxy.start()
    try:
        assert proxy.health()["mode"] == "observe"  # what mitmproxy made of it
        log = proxy.log()
    finally:
        proxy.stop()
    assert (f"[bili] bili_mode=observe comes from {config}, which mitmproxy applies after --set: "
            "the command line's bili_mode=fold is overridden") in log
    assert f"[bili] options from {config}: bili_mode=observe, bili_min_compress_chars=1234" in log
    line = next(ln for ln in log.splitlines() if "[bili] options from the command line:" in ln)
    assert f"bili_data_dir={proxy.data_dir}" in line and f"confdir={proxy.confdir}" in line
    assert f"listen_port={proxy.port}" in line
