"""The per-request figures and the log line, by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bili_addon import prices
from bili_addon.meter import Meter, line, summary, tokens, turn_money
from bili_addon.store import WireTurn


def body(tools: list, system: str, msgs: list) -> bytes:
    # the JSON keys in the SDK's order (messages first): the cache reads tools, system, messages
    return json.dumps({"max_tokens": 10, "messages": msgs, "model": "m", "system": system, "tools": tools}).encode()


def test_predicted_share_is_the_unchanged_leading_parts():
    m = Meter()
    tools, system = [{"name": "Bash"}], "You are an agent."
    msgs = [{"role": "user", "content": "a" * 100}, {"role": "assistant", "content": "b" * 100}]
    assert m.predict("s", body(tools, system, msgs)) is None  # the first request
    nxt = msgs + [{"role": "user", "content": "c" * 100}]
    parts = [json.dumps(tools), json.dumps(system), *map(json.dumps, nxt)]
    total = sum(map(len, parts))
    assert m.predict("s", body(tools, system, nxt)) == round((total - len(parts[-1])) / total, 4)
    # the system prompt changed: nothing after it is read from the cache
    assert m.predict("s", body(tools, "You are another agent.", nxt)) == round(len(parts[0]) / (
        total - len(parts[1]) + len(json.dumps("You are another agent."))), 4)
    assert m.predict("other", body(tools, system, nxt)) is None


def test_the_log_line_by_hand():
    # the example: sonnet 4.5, 181.2K tokens from the agent, 46.1K sent, 93% predicted,
    # 46,100 prompt tokens of which 42,412 read (92%), 2,000 written, 1,688 uncached; 500 out
    w = WireTurn(42, 0.0, 42, "claude-sonnet-4-5", 181_200, 46_100, 0.93, 3, 120, [], 46_100, 42_412, 2_000, 500)
    cost = (1_688 * 3 + 2_000 * 3.75 + 42_412 * 0.3 + 500 * 15) / 1e6  # 0.0327876
    saved = (181_200 - 46_100) * 0.3 / 1e6  # 0.04053
    assert line("3fe7b19e-aaaa", "anthropic", "claude", w) == (
        "bili claude 3fe7b19e t42 anthropic: 181.2K -> 46.1K tok (-75%), cache read 93% (reported 92%), "
        f"3 blocks, {prices.money(cost)} (saved {prices.money(saved)})")
    assert prices.money(cost) == "$0.033" and prices.money(saved) == "$0.041"
    w.model = "a-model-without-price"
    assert line("3fe7b19e", "chat", "", w).endswith("3 blocks")  # tokens only
    w.model, w.cache_write_1h = "claude-sonnet-4-5", 1_500  # 1,500 of the 2,000 written for an hour, at 2x input
    cost = (1_688 * 3 + 500 * 3.75 + 1_500 * 6 + 42_412 * 0.3 + 500 * 15) / 1e6
    assert line("3fe7b19e", "anthropic", "claude", w) == (
        "bili claude 3fe7b19e t42 anthropic: 181.2K -> 46.1K tok (-75%), cache read 93% (reported 92%), "
        f"3 blocks, cache write 2.0K (1.5K for 1 h), {prices.money(cost)} (saved {prices.money(saved)})")


def test_summary_over_turns():
    t1 = WireTurn(1, 0, 1, "gpt-5", 1000, 1200, None, 0, 0, [], 1200, 0, 0, 10)
    t2 = WireTurn(2, 0, 2, "gpt-5", 9000, 3000, 0.5, 1, 4, ["compress"], 3000, 2000, 0, 10)
    s = summary([t1, t2])
    assert (s["agent_now"], s["sent_now"], s["agent_peak"], s["sent_peak"]) == (9000, 3000, 9000, 3000)
    assert s["reported"] == round(2000 / 4200, 4) and s["predicted"] == 0.5 and s["priced"]
    # gpt-5: $1.25 in, $0.125 cached, $10 out
    cost = (1200 * 1.25 + 10 * 10 + 1000 * 1.25 + 2000 * 0.125 + 10 * 10) / 1e6
    # (the 200 tokens bili added to t1, a turn that read nothing, were uncached input: not the cheapest rate)
    saved = ((9000 - 3000) * 0.125 - (1200 - 1000) * 1.25) / 1e6
    assert abs(s["cost"] - cost) < 1e-9 and abs(s["saved"] - saved) < 1e-9
    t2.model = "unknown-model"
    assert summary([t1, t2])["cost"] is None and not summary([t1, t2])["priced"]
    assert tokens(999) == "999" and tokens(1_000) == "1.0K" and tokens(2_500_000) == "2.5M"


def test_totals_from_the_store_equal_the_turn_by_turn_summary(backend):
    from bili_addon.meter import totals

    store = backend()
    rows = [WireTurn(0, 0, 1, "gpt-5", 1000, 1200, None, 0, 0, [], 1200, 0, 0, 10),
            WireTurn(0, 0, 2, "claude-sonnet-4-5", 9000, 3000, 0.5, 1, 4, ["compress"], 3000, 2000, 500, 10,
                     300, "reported"),
            WireTurn(0, 0, 3, "gpt-5", 9500, 3300, 0.9, 1, 4, [], 3300, 2900, 0, 20),
            WireTurn(0, 0, 4, "claude-sonnet-4-5", 9800, 3400, 0.9, 1, 4, [], 3400, 2500, 800, 20, 800, "sent"),
            # bili added 600 tokens to a turn that wrote the cache (300 of it for an hour): they were written
            WireTurn(0, 0, 5, "claude-sonnet-4-5", 2000, 2600, 0.4, 1, 4, [], 2600, 1000, 1200, 10, 300, "reported")]
    for w in rows:
        w.n = store.record_wire("s", w)
    assert [w.n for w in store.wire("s")] == [1, 2, 3, 4, 5]
    by_turn, by_sums = summary(store.wire("s")), totals(store, "s")
    assert by_sums.keys() == by_turn.keys()
    for k, v in by_turn.items():
        if k in ("cost", "saved"):  # the same sums in another order: rounded to the micro-dollar, one apart at most
            assert abs(by_sums[k] - v) <= 1.01e-6, k
        else:
            assert by_sums[k] == v, k
    assert totals(store, "none")["turns"] == 0
    # what the page and /__bili/stats read back: the same turns, field for field, from a second opening
    again = backend()
    assert again.wire("s") == store.wire("s") and again.wire("s")[1].executed == ["compress"]
    assert again.wire("s")[0].predicted is None and again.wire("none") == []
    n, last, peak_a, peak_s, models = again.wire_totals("s")
    assert (n, last, peak_a, peak_s) == (5, store.wire("s")[-1], 9800, 3400)
    assert last.cache_write_1h == 300 and last.write_split == "reported"
    # per model: input, read, write, output, agent - sent, the writes' 1-hour part, writes split as
    # the provider reported / as bili sent, the tokens bili took off, and where what it added is taken
    # off (1-hour writes, other writes, uncached input, reads: prices.added_where)
    # (then whether the turns' requests, and the agent's own, were over the long-context line: no)
    assert models == [("claude-sonnet-4-5", 9000, 5500, 2500, 40, 11800, 1400, 1700, 800, 12400, 300, 300, 0, 0, 0, 0),
                      ("gpt-5", 4500, 2900, 0, 30, 6000, 0, 0, 0, 6200, 0, 0, 200, 0, 0, 0)]
    assert by_sums["cache_write_1h"] == 1400 and by_sums["write_split"] == {"reported": 1700, "sent": 800, "none": 0}
    assert all(type(v) is int for m in models for v in m[1:])


def test_turns_recorded_at_once_by_several_instances_are_numbered_once_each(backend):
    """Four instances (four openings of one store, each used by its own thread, as a store is)
    answering turns of one session at the same time: every turn gets its own number, 1..N."""
    from concurrent.futures import ThreadPoolExecutor

    instances, each = [backend() for _ in range(4)], 10

    def answer(k: int) -> list[int]:
        return [instances[k].record_wire("busy", WireTurn(0, 0, k * each + i, "gpt-5", 100, 90, None, 0, 0, [],
                                                          90, 0, 0, 1)) for i in range(each)]

    with ThreadPoolExecutor(len(instances)) as pool:
        given = [n for ns in pool.map(answer, range(len(instances))) for n in ns]
    total = len(instances) * each
    assert sorted(given) == list(range(1, total + 1))
    turns = backend().wire("busy")
    assert [w.n for w in turns] == list(range(1, total + 1))
    assert sorted(w.request for w in turns) == list(range(total))


def test_totals_over_the_long_context_line_equal_the_turn_by_turn_summary(backend):
    """A model's long-context price is for the whole request: the store's sums are kept apart on each
    side of the line (bili's request, and the agent's own, over 200K tokens or not)."""
    from bili_addon.meter import totals

    store = backend()
    one_m = "claude-sonnet-4-5[1m]"  # (requests that asked for the 1M-token window: prices.may_go_long)
    rows = [WireTurn(0, 0, 1, one_m, 150_000, 150_000, None, 0, 0, [], 150_000, 140_000, 9_000, 500),
            # the agent's request over the line, bili's under it (folded)
            WireTurn(0, 0, 2, one_m, 260_000, 120_000, 0.9, 1, 4, [], 120_000, 100_000, 19_000, 800),
            # both over it
            WireTurn(0, 0, 3, one_m, 420_000, 230_000, 0.9, 2, 8, [], 230_000, 220_000, 9_000, 900,
                     3_000, "reported"),
            WireTurn(0, 0, 4, "gemini-2.5-pro", 300_000, 310_000, 0.5, 0, 0, [], 310_000, 200_000, 0, 100),
            WireTurn(0, 0, 5, one_m, 190_000, 199_000, 0.9, 2, 8, [], 205_000, 190_000, 14_000, 100),
            # without the 1M window: the agent's request over the line would have been refused, not priced long
            WireTurn(0, 0, 6, "claude-sonnet-4-5", 240_000, 150_000, 0.9, 1, 4, [], 150_000, 140_000, 9_000, 500)]
    for w in rows:
        w.n = store.record_wire("s", w)
    by_turn, by_sums = summary(store.wire("s")), totals(store, "s")
    assert by_turn["priced"] and by_sums["priced"]
    assert abs(by_sums["cost"] - by_turn["cost"]) <= 1.01e-6 and abs(by_sums["saved"] - by_turn["saved"]) <= 1.01e-6
    # by hand, the second turn: $3 in, $0.30 read, $3.75 write, $15 out at 120K; the agent's 260K at 2x / 1.5x
    cost = (1_000 * 3 + 100_000 * 0.3 + 19_000 * 3.75 + 800 * 15) / 1e6
    without = (1_000 * 6 + 240_000 * 0.6 + 19_000 * 7.5 + 800 * 22.5) / 1e6
    assert turn_money(store.wire("s")[1]) == (pytest.approx(cost), pytest.approx(without - cost))
    no_window = store.wire("s")[5]
    assert turn_money(no_window)[1] == pytest.approx(90_000 * 0.3 / 1e6)  # (the tokens folded, as reads: no premium)
    flat = prices.Table({k: dataclasses.replace(p, long_input=0, long_output=0) for k, p in prices.BUILTIN.items()})
    assert by_sums["saved"] > totals(store, "s", flat)["saved"] + 0.05  # (what the tier adds to the saving)
