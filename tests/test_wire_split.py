"""Money for 1-hour cache writes (schema 9): Anthropic bills a write made for 1 hour at 2x the input
price, one for 5 minutes at 1.25x, and reports the split (``usage.cache_creation``).  The meter
records the split per answered turn (as reported, or as the request asked when the provider did not
say), prices each part at its rate, and says which in the stats."""

from __future__ import annotations

import json

import pytest

from types import SimpleNamespace

from bili_addon import flowmeta, mitmview, prices
from bili_addon.kernel import cache
from bili_addon.kernel.tools import written_for_an_hour
from bili_addon.kernel.turn import Engine
from bili_addon.meter import Meter, summary, totals, turn_dict, turn_money
from bili_addon.store import SCHEMA_VERSION, WireTurn
from bili_addon.stream import ResponseRewriter
from bili_addon.wire import LANES
from test_lifetime import cc_body
from test_fold import conversation

SONNET = "claude-sonnet-4-5"  # $3 in, $3.75 5m write, $6 1h write, $0.30 read, $15 out per MTok


def test_each_write_at_its_lifetimes_rate_hand_computed():
    # 100,000 prompt tokens: 90,000 read, 8,000 written (6,000 for 1 hour, 2,000 for 5 minutes), 2,000 uncached
    c = prices.cost(SONNET, 100_000, 90_000, 8_000, 1_000, cache_write_1h=6_000)
    assert c.cache_write == pytest.approx((6_000 * 6 + 2_000 * 3.75) / 1e6)  # 0.0435
    assert c.total == pytest.approx(0.006 + 0.027 + 0.0435 + 0.015)
    assert prices.cost(SONNET, 100_000, 90_000, 8_000, 1_000).cache_write == pytest.approx(0.03)  # all 5 minutes
    assert prices.cost(SONNET, 100_000, 90_000, 8_000, 1_000, cache_write_1h=8_000).cache_write == pytest.approx(
        prices.cost(SONNET, 100_000, 90_000, 8_000, 1_000, ttl="1h").cache_write)  # all 1 hour: 0.048
    # a split larger than the writes (a provider's rounding) never bills more than the writes at 1 hour
    assert prices.cost(SONNET, 100_000, 90_000, 8_000, 1_000, cache_write_1h=9_999).cache_write == pytest.approx(0.048)
    # OpenAI: writes cost what input does at any lifetime
    assert prices.cost("gpt-5", 10_000, 0, 1_000, 0, cache_write_1h=1_000).total == pytest.approx(10_000 * 1.25 / 1e6)
    # what it would have cost without bili keeps the same writes (the folded tokens priced as reads)
    w = prices.without_bili(SONNET, 100_000, 90_000, 8_000, 1_000, 50_000, cache_write_1h=6_000)
    assert w.total - c.total == pytest.approx(50_000 * 0.3 / 1e6)


def _turn(write: int, long: int, split: str, model: str = SONNET) -> WireTurn:
    return WireTurn(0, 0.0, 1, model, 120_000, 100_000, None, 1, 3, [], 100_000, 90_000, write, 1_000, long, split)


def test_the_meter_prices_a_turn_and_a_session_by_lifetime():
    reported, sent, old = _turn(8_000, 6_000, "reported"), _turn(4_000, 4_000, "sent"), _turn(2_000, 0, "")
    cost, saved = turn_money(reported)
    assert cost == pytest.approx(0.006 + 0.027 + 0.0435 + 0.015)
    assert saved == pytest.approx(20_000 * 0.3 / 1e6)  # the split is the same on both sides
    d = turn_dict(reported)
    assert (d["cache_write"], d["cache_write_1h"], d["write_split"]) == (8_000, 6_000, "reported")
    s = summary([reported, sent, old])
    assert s["cache_write"] == 14_000 and s["cache_write_1h"] == 10_000
    assert s["write_split"] == {"reported": 8_000, "sent": 4_000, "none": 2_000}
    by_hand = sum(prices.cost(SONNET, 100_000, 90_000, w, 1_000, cache_write_1h=h).total
                  for w, h in ((8_000, 6_000), (4_000, 4_000), (2_000, 0)))
    assert s["cost"] == pytest.approx(by_hand, abs=1e-6)
    # the turns' figures as /__bili/stats reads them from the store's sums, on both backends
    assert summary([])["write_split"] == {"reported": 0, "sent": 0, "none": 0}


def test_totals_from_the_store_price_the_split(backend):
    store = backend()
    for w in (_turn(8_000, 6_000, "reported"), _turn(4_000, 4_000, "sent"), _turn(2_000, 0, "")):
        store.record_wire("s", w)
    t = totals(store, "s")
    assert t["cache_write_1h"] == 10_000 and t["write_split"] == {"reported": 8_000, "sent": 4_000, "none": 2_000}
    assert t["cost"] == pytest.approx(summary(store.wire("s"))["cost"], abs=2e-6)
    assert store.wire("s")[0].write_split == "reported" and store.wire("s")[0].cache_write_1h == 6_000


def _answer(usage: dict, stream: bool) -> ResponseRewriter:
    rw = ResponseRewriter("anthropic")
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": SONNET, "content": [],
           "stop_reason": None, "usage": usage}
    if not stream:
        rw.json_body(json.dumps({**msg, "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}).encode())
        return rw
    for ev in ({"type": "message_start", "message": msg},
               {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
               {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
               {"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 9, "cache_creation_input_tokens": usage.get("cache_creation_input_tokens")}},
               {"type": "message_stop"}):
        rw.sse_event(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode())
    return rw


@pytest.mark.parametrize("stream", [True, False])
def test_the_split_is_read_from_the_answer(stream):
    """The SDK's ``Usage.cache_creation`` (``ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens``),
    in message_start's usage when streamed, in the message's when not."""
    u = _answer({"input_tokens": 50, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 300,
                 "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200},
                 "output_tokens": 1}, stream).usage
    assert (u.input, u.cache_read, u.cache_write, u.cache_write_1h, u.split) == (1250, 900, 300, 200, "reported")
    w = Meter.row({"turn": 3, "model": SONNET, "agent_tokens": 10, "sent_tokens": 10}, u)
    assert (w.cache_write, w.cache_write_1h, w.write_split) == (300, 200, "reported")
    plain = _answer({"input_tokens": 50, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 300,
                     "output_tokens": 1}, stream).usage
    assert plain.cache_write == 300 and plain.cache_write_1h is None and plain.split == ""
    # the flow's record and its mitmweb view say it too
    for usage, said in ((u, "cache write 300 (200 for 1 hour), output "), (plain, "cache write 300, output ")):
        rec: dict = {}
        flowmeta.record_answer(rec, SimpleNamespace(calls=[], usage=usage, stripped=0), [])
        assert said in mitmview.response_view(b"", rec)


def test_without_a_reported_split_the_request_says_what_was_written_for_an_hour():
    bill = cache.Bill(write=3_000, write_long=1_000)
    assert written_for_an_hour(cache.Turn(0.0, bill), 8_000, "head") == 2_000  # the predicted share of the writes
    assert written_for_an_hour(cache.Turn(0.0, cache.Bill(write=3_000)), 8_000, "1h") == 0  # as sent, not as chosen
    assert written_for_an_hour(None, 8_000, "1h") == 8_000  # no prediction: the session's choice
    assert written_for_an_hour(cache.Turn(0.0, cache.Bill()), 8_000, "head") == 0


def test_the_engine_fills_the_split_in_from_what_it_sent(tmp_path):
    from bili_addon.store import Store

    e = Engine(Store(tmp_path / "d"), activate="always")
    h = {"x-claude-code-session-id": "split"}
    raw = json.dumps(json.loads(cc_body(conversation(3)))).replace('"ephemeral"}', '"ephemeral", "ttl": "1h"}', 2)
    e.process(raw.encode(), LANES["anthropic"], h, render=True)  # the agent asks 1 hour for its system
    rw = _answer({"input_tokens": 5, "cache_creation_input_tokens": 9_000, "output_tokens": 1}, stream=True)
    e.record_answer("split", "anthropic", rw)
    u = rw.usage
    assert u.split == "sent" and 0 < u.cache_write_1h < 9_000  # the system for an hour, the rest for 5 minutes
    predicted = e.clocks.by_session["split"].turns[-1].predicted
    assert u.cache_write_1h == round(9_000 * predicted.write_long / (predicted.write + predicted.write_long))
    reported = _answer({"input_tokens": 5, "cache_creation_input_tokens": 9_000, "output_tokens": 1,
                        "cache_creation": {"ephemeral_5m_input_tokens": 9_000, "ephemeral_1h_input_tokens": 0}}, True)
    e.process(raw.encode(), LANES["anthropic"], h, render=True)
    e.record_answer("split", "anthropic", reported)
    assert (reported.usage.split, reported.usage.cache_write_1h) == ("reported", 0)  # the provider's word stands
    e.store.close()


def test_a_schema_8_store_gets_the_columns_and_prices_its_old_turns_as_before(backend):
    s = backend()
    s.record_wire("old", _turn(2_000, 0, ""))
    raw = s.db.execute if s.backend == "sqlite" else s._q
    for col in ("cache_write_1h", "write_split"):
        raw(f"ALTER TABLE wire DROP COLUMN {col}")
    raw("UPDATE meta SET value='8' WHERE key='schema_version'")
    s.close()
    s = backend()  # opened again: migrated (schema 9)
    assert s.schema_version() == SCHEMA_VERSION == 9
    old = s.wire("old")[0]
    assert (old.cache_write, old.cache_write_1h, old.write_split) == (2_000, 0, "")
    assert totals(s, "old")["cost"] == pytest.approx(prices.cost(SONNET, 100_000, 90_000, 2_000, 1_000).total, abs=1e-6)
    s.record_wire("old", _turn(8_000, 6_000, "reported"))
    assert totals(s, "old")["write_split"] == {"reported": 8_000, "sent": 0, "none": 2_000}
    s.close()
    assert backend().schema_version() == 9  # opening it again changes nothing
