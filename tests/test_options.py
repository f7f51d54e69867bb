"""The addon's options are validated the way mitmproxy's own addons validate theirs: a bad value
raises ``OptionsError`` in ``configure`` (naming the option, the value and the choices), so mitmdump
refuses to start with it and a change at run time is undone.  The real-mitmdump side is in
tests/test_cli.py (``test_a_bad_option_value_stops_mitmdump_with_the_choices``)."""

from __future__ import annotations

import pytest
from mitmproxy import exceptions


@pytest.mark.parametrize("name, value, words", [
    ("bili_mode", "flod", "bili_mode='flod' is not one of: fold, observe, passthrough"),
    ("bili_first_party", "bogus", "bili_first_party='bogus' is not one of: fold, observe"),
    ("bili_min_compress_chars", -5, "bili_min_compress_chars=-5 must be 0 or more"),
    ("bili_remind_at", -1, "bili_remind_at=-1 must be 0 or more"),
    ("bili_context_window", -100, "bili_context_window=-100 must be 0 or more"),
    ("bili_retention", -1, "bili_retention=-1 must be 0 or more"),
])
def test_a_bad_value_is_refused_and_the_old_one_kept(bili, name, value, words):
    before = getattr(bili.tctx.options, name)
    with pytest.raises(exceptions.OptionsError, match=words.replace("(", r"\(").replace(")", r"\)")):
        bili.tctx.configure(bili, **{name: value})
    assert getattr(bili.tctx.options, name) == before  # mitmproxy rolled the change back
    assert bili.mode == "fold" and bili.first_party == "fold"


def test_good_values_apply(bili):
    bili.tctx.configure(bili, bili_mode="observe", bili_first_party="observe", bili_remind_at=0)
    assert bili.mode == "observe" and bili.first_party == "observe"
    assert bili.engine.nudge_cfg.batch_tokens > 10**12  # 0: only near the window's end


def test_unparseable_deferred_values_are_reported_not_dropped(caplog):
    """mitmproxy applies --set values of an addon's options after its load hook and, when one fails
    to parse, drops the addon silently; check_deferred logs it as an error first (mitmdump then exits)."""
    from mitmproxy.options import Options

    from bili_addon.shell import check_deferred

    opts = Options()
    opts.set("bili_mode=fold", "bili_mode=observe", "bili_remind_at=soon", "bili_marker=false", "other=1", defer=True)
    opts.add_option("bili_mode", str, "fold", "")  # as the addon's load hook does
    opts.add_option("bili_remind_at", int, 1, "")
    opts.add_option("bili_marker", bool, True, "")
    with caplog.at_level("ERROR", logger="bili"):
        check_deferred(opts)
    text = caplog.text
    assert "multiple values for bili_mode" in text and "bili_remind_at: not an integer: soon" in text
    assert "bili_marker" not in text and "other" not in text
