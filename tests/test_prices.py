"""Money: the price table, hand-computed."""

from __future__ import annotations

import json

import pytest

from bili_addon import prices


def test_anthropic_turn_hand_computed():
    # claude-sonnet-4-5: $3 in, $3.75 5m write, $6 1h write, $0.30 read, $15 out per MTok
    # 100,000 prompt tokens = 90,000 read + 8,000 written + 2,000 uncached; 1,000 output
    c = prices.cost("claude-sonnet-4-5-20250929", 100_000, 90_000, 8_000, 1_000)
    assert c is not None and c.model == "claude-sonnet-4-5"
    assert c.uncached == pytest.approx(2_000 * 3 / 1e6)  # 0.006
    assert c.cache_read == pytest.approx(0.027)  # 90,000 * 0.30 / 1e6
    assert c.cache_write == pytest.approx(0.03)  # 8,000 * 3.75 / 1e6
    assert c.output == pytest.approx(0.015)
    assert c.total == pytest.approx(0.078)
    one_hour = prices.cost("claude-sonnet-4-5", 100_000, 90_000, 8_000, 1_000, ttl="1h")
    assert one_hour.cache_write == pytest.approx(0.048)  # 8,000 * 6 / 1e6


def test_longest_prefix_and_routing_prefixes():
    assert prices.cost("claude-opus-4-5-20251101", 1_000_000).total == pytest.approx(5)
    assert prices.cost("claude-opus-4-1-20250805", 1_000_000).total == pytest.approx(15)
    assert prices.cost("anthropic/claude-opus-4-20250514", 1_000_000).total == pytest.approx(15)
    assert prices.cost("us.anthropic.claude-haiku-4-5-20251001-v1:0", 0, output=1_000_000).total == pytest.approx(5)
    assert prices.cost("gpt-5-mini-2025-08-07", 1_000_000).model == "gpt-5-mini"
    assert prices.cost("gpt-5", 1_000_000).model == "gpt-5"
    assert prices.cost("models/gemini-2.5-pro", 0, output=2_000_000).total == pytest.approx(20)


def test_openai_cached_input_hand_computed():
    # gpt-5: $1.25 in, $0.125 cached, $10 out; OpenAI's input counts the cached tokens too
    c = prices.cost("gpt-5-codex", 50_000, 40_000, 0, 2_000)
    assert c.total == pytest.approx(10_000 * 1.25 / 1e6 + 40_000 * 0.125 / 1e6 + 2_000 * 10 / 1e6)  # 0.0375


def test_unknown_model_has_no_price():
    assert prices.cost("my-local-llama", 1000, 0, 0, 10) is None
    assert prices.cost("", 1000) is None
    assert prices.cost("gpt-50", 1000) is None  # a prefix of the name, not of a version: no guess
    # another model that begins with a key is priced otherwise: no price, not the key's
    for other in ("claude-opus-4-6", "gpt-5-pro", "o3-pro", "o3-mini", "gpt-5.1-codex-mini", "gemini-2.5-flash-lite",
                  "claude-sonnet-4.5", "gpt-4o-audio-preview"):
        assert prices.default().find(other) is None, other
    # a snapshot of a listed model, under its routers' names too
    for name, key in (("claude-sonnet-4-5@20250929", "claude-sonnet-4-5"), ("gpt-4o-2024-08-06", "gpt-4o"),
                      ("claude-3-5-sonnet-latest", "claude-3-5-sonnet"),
                      ("anthropic.claude-opus-4-1-20250805-v1:0", "claude-opus-4-1")):
        assert prices.default().find(name)[0] == key, name


def test_without_bili_prices_folded_tokens_as_reads():
    # 20,000 tokens folded off the wire of a sonnet turn: 20,000 * 0.30 / 1e6 = $0.006 more
    with_ = prices.cost("claude-sonnet-4-5", 30_000, 25_000, 1_000, 500)
    without = prices.without_bili("claude-sonnet-4-5", 30_000, 25_000, 1_000, 500, 20_000)
    assert without.total - with_.total == pytest.approx(0.006)


def test_user_file_overrides_and_extends(tmp_path):
    (tmp_path / "prices.json").write_text(json.dumps({"as_of": "2027-01-01", "models": {
        "claude-sonnet-4-5": {"input": 2},  # only input changes; the rest stays built-in
        "my-local-llama": {"provider": "local", "input": 0.1, "output": 0.2},
        "broken": {"input": "cheap", "output": 1},
        "half": {"input": 1},
    }}))
    t = prices.load(tmp_path)
    assert t.find("claude-sonnet-4-5")[1].input == 2 and t.find("claude-sonnet-4-5")[1].output == 15
    c = t.cost("my-local-llama", 1_000_000, 500_000, 0, 1_000_000)
    assert c.total == pytest.approx(0.05 + 0.05 + 0.2)  # no cache discount unless the file says so
    assert t.find("broken") is None and t.find("half") is None
    assert len(t.errors) == 2 and "2027-01-01" in t.as_of
    assert prices.load(tmp_path / "none").source == "built-in"


def test_bad_user_file_keeps_builtin(tmp_path):
    (tmp_path / "prices.json").write_text("{not json")
    t = prices.load(tmp_path)
    assert t.errors and t.find("gpt-5") is not None


def test_money_format():
    assert prices.money(0.0412) == "$0.041"
    assert prices.money(1.234) == "$1.23"
    assert prices.money(1234.5) == "$1,234"
    assert prices.money(None) == ""
    assert prices.money(-0.0021) == "-$0.002"
    assert prices.money(-0.0001) == "$0.000"  # no "-$0.000"


def test_bili_additions_make_a_negative_saving():
    # bili sent 1,000 tokens more than the agent (its tools and prompt) on a turn that read its prefix and
    # wrote 1,000: the additions were written (1,000 * 3.75 / 1e6), not read (a lower bound stays one)
    with_ = prices.cost("claude-sonnet-4-5", 30_000, 25_000, 1_000, 500)
    without = prices.without_bili("claude-sonnet-4-5", 30_000, 25_000, 1_000, 500, -1_000)
    assert without.total - with_.total == pytest.approx(-0.00375)
    # a warm turn that wrote nothing: they were read
    with_ = prices.cost("claude-sonnet-4-5", 30_000, 30_000, 0, 500)
    without = prices.without_bili("claude-sonnet-4-5", 30_000, 30_000, 0, 500, -1_000)
    assert without.total - with_.total == pytest.approx(-0.0003)
    # a cold turn: the agent's 20,000 tokens would have been written, bili's 24,000 were: 4,000 * 3.75
    with_ = prices.cost("claude-sonnet-4-5", 24_000, 0, 24_000, 500)
    without = prices.without_bili("claude-sonnet-4-5", 24_000, 0, 24_000, 500, -4_000)
    assert without.total == pytest.approx(prices.cost("claude-sonnet-4-5", 20_000, 0, 20_000, 500).total)
    assert without.total - with_.total == pytest.approx(-0.015)
    # the 1-hour writes first (2x), then the others, the uncached input, the reads
    assert prices.added_where(5_000, 30_000, 20_000, 4_000, 1_000) == (1_000, 3_000, 1_000, 0)
    assert prices.added_where(20_000, 30_000, 20_000, 4_000, 1_000) == (1_000, 3_000, 6_000, 10_000)


def test_a_request_over_200k_tokens_pays_the_long_context_price_for_all_of_it():
    # claude-sonnet-4-5 over 200K prompt tokens (the 1M-context beta): $6 in, $7.50 5m write, $12 1h write,
    # $0.60 read, $22.50 out per MTok, for the whole request
    c = prices.cost("claude-sonnet-4-5", 250_000, 230_000, 15_000, 2_000)
    assert c.uncached == pytest.approx(5_000 * 6 / 1e6) and c.cache_read == pytest.approx(230_000 * 0.6 / 1e6)
    assert c.cache_write == pytest.approx(15_000 * 7.5 / 1e6) and c.output == pytest.approx(2_000 * 22.5 / 1e6)
    assert prices.cost("claude-sonnet-4-5", 250_000, 0, 10_000, ttl="1h").cache_write == pytest.approx(10_000 * 12 / 1e6)
    at_line = prices.cost("claude-sonnet-4-5", 200_000, 190_000, 10_000, 2_000)  # (over it, not at it)
    assert at_line.total == pytest.approx((190_000 * 0.3 + 10_000 * 3.75 + 2_000 * 15) / 1e6)
    # Gemini 2.5 Pro: $2.50 in, $0.25 cached, $15 out over 200K; a model without the tier stays as it is
    assert prices.cost("gemini-2.5-pro", 300_000, 100_000, 0, 1_000).total == pytest.approx(
        (200_000 * 2.5 + 100_000 * 0.25 + 1_000 * 15) / 1e6)
    assert prices.cost("gpt-4.1", 300_000).total == pytest.approx(300_000 * 2 / 1e6)
    assert prices.cost("claude-opus-4-5", 300_000).total == pytest.approx(300_000 * 5 / 1e6)
    # sums of requests: the caller says which side of the line they were on
    assert prices.cost("claude-sonnet-4-5", 1_000_000, long=False).total == pytest.approx(3)
    assert prices.cost("claude-sonnet-4-5", 100_000, long=True).total == pytest.approx(0.6)


def test_folding_a_request_under_the_line_saves_the_long_context_price():
    # the agent's request was 300K tokens (long-context prices for all of it: it asked for the 1M window,
    # recorded as the model's name with [1m] after it); bili sent 120K
    model = "claude-sonnet-4-5-20250929[1m]"
    with_ = prices.cost(model, 120_000, 110_000, 8_000, 1_000)
    without = prices.without_bili(model, 120_000, 110_000, 8_000, 1_000, 180_000)
    assert with_.model == "claude-sonnet-4-5" and prices.may_go_long(model)
    assert with_.total == pytest.approx((2_000 * 3 + 110_000 * 0.3 + 8_000 * 3.75 + 1_000 * 15) / 1e6)
    assert without.total == pytest.approx((2_000 * 6 + 290_000 * 0.6 + 8_000 * 7.5 + 1_000 * 22.5) / 1e6)
    # without the 1M window Anthropic refuses a request over 200K: the agent's own is not priced as one
    assert not prices.may_go_long("claude-sonnet-4-5")
    short = prices.without_bili("claude-sonnet-4-5", 120_000, 110_000, 8_000, 1_000, 180_000)
    assert short.total == pytest.approx((2_000 * 3 + 290_000 * 0.3 + 8_000 * 3.75 + 1_000 * 15) / 1e6)
    # Google's 2.5 Pro takes one as it is
    assert prices.may_go_long("gemini-2.5-pro") and not prices.may_go_long("an-unpriced-model")


def test_a_user_file_sets_a_long_context_price(tmp_path):
    (tmp_path / "prices.json").write_text(json.dumps({"models": {
        "my-long-model": {"input": 1, "output": 4, "cache_read": 0.1, "long_input": 2, "long_output": 8},
        "claude-sonnet-4-5": {"long_input": 0},  # (this file's prices have no tier for it)
    }}))
    t = prices.load(tmp_path)
    assert t.cost("my-long-model", 300_000, 200_000, 0, 1_000).total == pytest.approx(
        (100_000 * 2 + 200_000 * 0.2 + 1_000 * 8) / 1e6)
    assert t.cost("claude-sonnet-4-5", 300_000).total == pytest.approx(0.9)


def test_a_user_file_that_changes_a_models_prices_keeps_its_tier_in_proportion(tmp_path):
    (tmp_path / "prices.json").write_text(json.dumps({"models": {
        "claude-sonnet-4-5": {"input": 4, "cache_read": 0.4, "cache_write_5m": 5},  # the tier stays 2x input
        "gemini-2.5-pro": {"input": 0, "output": 0, "cache_read": 0},  # free: no tier either
        "claude-sonnet-4": {"long_output": 30},  # (its input's tier stays the built-in one)
        "odd": {"input": 1, "output": 2, "long_output": 3},  # a long output price without a long input price
    }}))
    t = prices.load(tmp_path)
    assert t.cost("claude-sonnet-4-5", 250_000, 200_000, 10_000, 1_000).total == pytest.approx(
        (40_000 * 8 + 200_000 * 0.8 + 10_000 * 10 + 1_000 * 22.5) / 1e6)
    assert t.cost("gemini-2.5-pro", 300_000, 0, 0, 1_000).total == 0
    assert t.cost("claude-sonnet-4", 300_000, 0, 0, 1_000).total == pytest.approx((300_000 * 6 + 1_000 * 30) / 1e6)
    assert t.find("odd") is None and any("long_output needs long_input" in e for e in t.errors)
