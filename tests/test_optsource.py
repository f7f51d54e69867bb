"""Where the options came from: a config file in the confdir and the command line, in mitmproxy's
precedence (``--set``, then ``config.yaml``, then the dedicated flags), reported at start-up."""

from __future__ import annotations

import logging

from mitmproxy.test import taddons

from bili_addon import optsource
from bili_addon.shell import Bili


def _sources(tmp_path, argv, program="mitmdump", report=False):
    addon = Bili()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, bili_data_dir=str(tmp_path / "data"), bili_mode="observe")
        given = optsource.sources(tctx.options, argv, program, str(tmp_path))
        if report:
            optsource.report(given)
        return {g.name: g for g in given}


def test_a_config_file_over_set_is_reported_with_both_values(tmp_path, caplog):
    (tmp_path / "config.yaml").write_text("bili_mode: observe\nbili_marker: false\n")
    with caplog.at_level(logging.INFO, logger="bili"):
        got = _sources(tmp_path, ["--set", "bili_mode=fold", "--set", f"confdir={tmp_path}", "-p", "9999"],
                       report=True)
    mode = got["bili_mode"]
    assert (mode.value, mode.source) == ("observe", str(tmp_path / "config.yaml"))  # the effective value
    assert mode.overridden == [("--set", "fold")]
    assert got["confdir"].source == "--set" and not got["confdir"].overridden
    assert got["bili_marker"].source.endswith("config.yaml")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"[bili] bili_mode=observe comes from {tmp_path / 'config.yaml'}, which mitmproxy applies "
                        "after --set: the command line's bili_mode=fold is overridden"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    # the effective values (this test context never read the file, so bili_marker kept its default)
    assert f"[bili] options from {tmp_path / 'config.yaml'}: bili_mode=observe, bili_marker=True" in infos


def test_a_dedicated_flag_wins_over_the_config_file(tmp_path):
    (tmp_path / "config.yaml").write_text("listen_port: 8899\n")
    (tmp_path / "config.yml").write_text("listen_port: 8898\n")  # loaded after config.yaml
    got = _sources(tmp_path, ["--listen-port", "8787"])
    port = got["listen_port"]
    assert port.source == "command line"
    assert port.overridden == [(str(tmp_path / "config.yaml"), 8899), (str(tmp_path / "config.yml"), 8898)]


def test_nothing_given_nothing_reported(tmp_path):
    assert _sources(tmp_path, []) == {}
    # another program (a test runner, an embedding): only the config files count
    (tmp_path / "config.yaml").write_text("bili_mode: passthrough\n")
    got = _sources(tmp_path, ["--set", "bili_mode=fold"], program="pytest")
    assert got["bili_mode"].source.endswith("config.yaml") and not got["bili_mode"].overridden


def test_a_broken_config_file_or_command_line_does_not_stop_the_report(tmp_path):
    (tmp_path / "config.yaml").write_text("bili_mode: [unclosed\n")
    assert _sources(tmp_path, ["--no-such-flag", "--set", "bili_mode=fold"])["bili_mode"].source == "--set"
    assert _sources(tmp_path, ["--mode"]) == {}  # argparse gives up: no command-line part
