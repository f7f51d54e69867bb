"""The one rewrite decision (kernel/rewrite.py), on hand-worked cases."""

from __future__ import annotations

import pytest

from bili_addon.kernel import rewrite
from bili_addon.kernel.cache import anthropic_rules, openai_rules
from bili_addon.kernel.rewrite import Change, Moment, decide, horizon

ANTH = anthropic_rules("claude-sonnet-4-5")


def moment(**kw) -> Moment:
    base = dict(rules=ANTH, cold=False, used=30_000, window=200_000, pressure=0.75, requests=50)
    return Moment(**{**base, **kw})


def test_cold_makes_any_change_now():
    d = decide(Change(saved=10, tail=100_000), moment(cold=True))
    assert d.now and d.why == "cold"


def test_the_window_forces_it():
    d = decide(Change(saved=10, tail=100_000), moment(used=150_000))
    assert d.now and d.why == "window"
    assert not decide(Change(saved=10, tail=100_000), moment(used=149_999)).now
    assert not rewrite.window_forces(10**9, 0, 0.75)  # an unknown window forces nothing


def test_pays_when_the_saved_reads_outweigh_the_rewrite():
    # Anthropic: rewriting 10K tokens costs (1.25 - 0.1) * 10K = 11.5K; saving 1K tokens a request
    # reads 0.1 * 1K = 100 less per request: it takes 115 requests
    change = Change(saved=1_000, tail=10_000)
    assert rewrite.cost_of(change, ANTH) == pytest.approx(11_500)
    held = decide(change, moment(requests=100))  # no gaps seen: the rest of the session is as long as so far
    assert not held.now and held.why == "pending"
    assert held.benefit == pytest.approx(10_000) and held.cost == pytest.approx(11_500)
    now = decide(change, moment(requests=120))
    assert now.now and now.why == "pays" and now.benefit == pytest.approx(12_000)


def test_a_change_that_saves_nothing_waits_for_a_free_moment():
    assert not decide(Change(saved=0, tail=0), moment(requests=1000)).now
    assert not decide(Change(saved=-500, tail=10), moment(requests=1000)).now
    assert decide(Change(saved=-500, tail=10), moment(cold=True)).now


def test_the_horizon_is_the_expected_wait_for_a_cold_moment():
    assert horizon(moment(requests=2)) == rewrite.MIN_REST  # a young session is given a few requests
    assert horizon(moment(requests=300)) == 300
    # one gap in four outlives the 5-minute entry: a cold moment comes within ~4 requests
    gaps = (10.0, 20.0, 400.0, 30.0) * 5
    h = horizon(moment(requests=300, gaps=gaps))
    assert h == pytest.approx((1 - 0.75 ** 300) / 0.25)
    # so a change that would pay over the session waits for that moment instead
    change = Change(saved=1_000, tail=10_000)
    assert decide(change, moment(requests=300)).now
    assert not decide(change, moment(requests=300, gaps=gaps)).now
    # a lifetime learned shorter than documented makes more gaps cold
    assert horizon(moment(requests=300, gaps=(100.0,) * 10, ttl=60.0)) == 1.0


def test_openai_has_no_write_premium():
    rules = openai_rules("gpt-5")  # read 0.1, an uncached token 1.0
    change = Change(saved=1_000, tail=9_000)
    assert rewrite.cost_of(change, rules) == pytest.approx(8_100)
    assert decide(change, moment(rules=rules, requests=81)).now
    assert not decide(change, moment(rules=rules, requests=80)).now


def test_a_fold_that_brings_the_prompt_under_the_long_context_line_pays_its_premium():
    """Sonnet 4.5 with the 1M window: over 200K prompt tokens every token costs twice as much.  A held
    fold that takes a 210K prompt to 190K saves the premium on every later request: it lands (in input
    units it saved 20K reads a request against a 60K rewrite, and stayed pending)."""
    change = Change(saved=20_000, tail=60_000)
    flat = decide(change, moment(used=210_000, window=1_000_000, requests=10, gaps=(20.0,) * 10))
    assert not flat.now and flat.benefit == pytest.approx(0.1 * 20_000 * 10)
    d = decide(change, moment(used=210_000, window=1_000_000, requests=10, gaps=(20.0,) * 10, long=2.0))
    # each later request reads 190K at 1x instead of 210K at 2x: 0.1 * (420K - 190K) * 10 requests
    assert d.now and d.why == "pays" and d.benefit == pytest.approx(0.1 * 230_000 * 10)
    assert d.cost == pytest.approx(1.15 * 60_000)  # (the rewrite goes on a request under the line)
    # over the line on both sides: both weighed at 2x (the same verdict as without the tier)
    both = decide(Change(saved=1_000, tail=10_000), moment(used=400_000, window=1_000_000, requests=100, long=2.0))
    assert not both.now and both.benefit == pytest.approx(20_000) and both.cost == pytest.approx(23_000)
    from bili_addon import prices
    assert prices.long_factor("claude-sonnet-4-5") == 2.0 and prices.long_factor("gpt-4.1") == 1.0
