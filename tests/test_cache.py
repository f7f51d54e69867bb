"""The provider cache models against hand-worked cases (bili_addon/kernel/cache.py)."""

import json

import pytest

from bili_addon.kernel import cache
from bili_addon.kernel.cache import Bill, Cache, Clock, Segment, anthropic_rules, chain, openai_rules

A = anthropic_rules("claude-sonnet-4-5")


def segs(sizes, bps, names=None, ttl=300.0):
    """Segments of the given token sizes; ``bps``: indices carrying a breakpoint (ttl per index or one)."""
    out = [Segment(n, (bps[i] if isinstance(bps, dict) else ttl) if i in bps else None) for i, n in enumerate(sizes)]
    return chain(out, [(names or [f"b{i}" for i in range(len(sizes))])[i].encode() for i in range(len(sizes))])


def test_anthropic_first_request_writes_up_to_last_breakpoint():
    c = Cache(A)
    bill = c.send_segments(segs([1000, 500, 300], {1}), now=0)
    assert bill == Bill(input=300, read=0, write=1500)
    assert bill.cost(A) == 300 + 1.25 * 1500


def test_anthropic_hit_reads_prefix_and_writes_the_extension():
    c = Cache(A)
    c.send_segments(segs([1000, 500, 300], {1}), now=0)
    # next turn: same prefix, one more block, breakpoint moved to the new last block
    bill = c.send_segments(segs([1000, 500, 300, 200], {3}), now=10)
    assert bill == Bill(input=0, read=1500, write=500)


def test_anthropic_below_minimum_is_not_cached():
    c = Cache(A)
    assert c.send_segments(segs([600, 300], {1}), now=0) == Bill(input=900)
    assert c.send_segments(segs([600, 300], {1}), now=1) == Bill(input=900)
    haiku = Cache(anthropic_rules("claude-3-5-haiku"))
    assert haiku.rules.min_tokens == 2048
    assert haiku.send_segments(segs([1500], {0}), now=0) == Bill(input=1500)


@pytest.mark.parametrize("model,minimum", [
    ("claude-opus-4-6", 4096), ("anthropic/claude-opus-4.6", 4096), ("claude-opus-4-5-20251101", 4096),
    ("claude-haiku-4-5-20251001", 4096), ("claude-3-5-haiku-20241022", 2048), ("claude-3-haiku-20240307", 2048),
    ("claude-sonnet-4-6", 1024), ("claude-sonnet-4-5-20250929", 1024), ("claude-opus-4-1-20250805", 1024),
    ("claude-opus-4-20250514", 1024), ("claude-3-7-sonnet-20250219", 1024),
])
def test_anthropic_minimum_per_model_as_documented(model, minimum):
    """Anthropic's table of minimum cacheable prompt lengths: Opus 4.6 caches nothing under 4096 tokens
    (the model took 1024 for it: it predicted writes and reads the provider never made)."""
    assert anthropic_rules(model).min_tokens == minimum
    body = json.dumps({"model": model, "system": [{"type": "text", "text": "s" * 4 * (minimum - 100),
                                                    "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    clk = Clock("anthropic", model)
    assert clk.send(body, 0.0).write == 0 and clk.send(body, 10.0).read == 0


def test_anthropic_at_most_four_breakpoints():
    c = Cache(A)
    bill = c.send_segments(segs([2000] * 6, {0, 1, 2, 3, 4, 5}), now=0)
    # only the first four breakpoints count: blocks 4 and 5 are plain input
    assert bill == Bill(input=4000, write=8000)
    assert len(c.entries) == 4


def test_anthropic_lookback_is_twenty_blocks():
    names = [f"b{i}" for i in range(40)]
    c = Cache(A)
    c.send_segments(segs([100] * 11, {10}, names[:11]), now=0)  # entry at block 10 (1100 tokens)
    # 20 blocks later, breakpoint at block 30: lookback 30..11 does not reach block 10
    far = c.send_segments(segs([100] * 31, {30}, names[:31]), now=1)
    assert far.read == 0 and far.write == 3100
    c2 = Cache(A)
    c2.send_segments(segs([100] * 11, {10}, names[:11]), now=0)
    near = c2.send_segments(segs([100] * 30, {29}, names[:30]), now=1)  # lookback 29..10 reaches it
    assert near == Bill(read=1100, write=1900)


def test_anthropic_changed_block_breaks_the_prefix():
    c = Cache(A)
    c.send_segments(segs([1100, 500, 300], {0, 2}, ["a", "b", "c"]), now=0)
    bill = c.send_segments(segs([1100, 500, 300], {0, 2}, ["a", "X", "c"]), now=1)  # a fold changed block 1
    assert bill == Bill(read=1100, write=800)


def test_anthropic_ttl_expiry_and_refresh_on_hit():
    c = Cache(A)
    s = segs([2000, 100], {1})
    c.send_segments(s, now=0)
    assert c.send_segments(s, now=299).read == 2100  # hit at 4:59 refreshes
    assert c.send_segments(s, now=299 + 299).read == 2100  # so 4:59 after that still hits
    miss = c.send_segments(s, now=598 + 301)  # 5:01 idle: expired
    assert miss == Bill(write=2100)


def test_anthropic_one_hour_ttl_writes_at_2x():
    c = Cache(A)
    s = segs([2000, 100], {1: 3600.0})
    first = c.send_segments(s, now=0)
    assert first == Bill(write_long=2100) and first.cost(A) == 4200
    assert c.send_segments(s, now=1800).read == 2100  # 30 min later: still warm
    assert c.send_segments(s, now=1800 + 3601).read == 0


HOUR, FIVE = 3600.0, 300.0


def test_mixed_lifetimes_bill_one_hour_writes_up_to_the_last_one_hour_breakpoint():
    """Anthropic's A/B/C rule, hand-worked: tools 4K, system 6K (1h), a fold summary 3K (1h), the live
    tail 2K + 1K (5m).  The head is 13K tokens, the whole prompt 16K."""
    names = ["tools", "system", "summary", "tail-a", "tail-b", "tail-c"]
    c = Cache(A)
    s0 = segs([4000, 6000, 3000, 2000, 1000], {1: HOUR, 2: HOUR, 4: FIVE}, names[:5])
    assert cache.ordered(s0)
    first = c.send_segments(s0, now=0)
    # A = 0 (nothing cached), B = 13K (the last 1-hour breakpoint), C = 16K (the last breakpoint)
    assert first == Bill(write_long=13_000, write=3_000)
    assert first.cost(A) == 2.0 * 13_000 + 1.25 * 3_000
    # the next turn: one block more, the tail breakpoint on it; the previous entry is read
    s1 = segs([4000, 6000, 3000, 2000, 1000, 500], {1: HOUR, 2: HOUR, 5: FIVE}, names)
    assert c.send_segments(s1, now=10) == Bill(read=16_000, write=500)
    # a 10-minute pause: the tail's 5-minute entries are gone, the head's 1-hour ones are not
    # (the read at t=10 refreshed them): the head is read, only the tail written again, at 1.25
    paused = c.send_segments(s1, now=610)
    assert paused == Bill(read=13_000, write=3_500)
    assert paused.cost(A) == 0.1 * 13_000 + 1.25 * 3_500  # 5,675; with 5-minute entries only: 1.25 * 16,500
    # over an hour: everything expired, written again at its own lifetime's price
    assert c.send_segments(s1, now=610 + 3601) == Bill(write_long=13_000, write=3_500)


def test_mixed_lifetimes_a_fold_after_the_head_writes_only_its_new_summary_at_2x():
    c = Cache(A)
    c.send_segments(segs([4000, 6000, 3000, 2000, 1000], {1: HOUR, 2: HOUR, 4: FIVE},
                         ["tools", "system", "s1", "t1", "t2"]), now=0)
    # a fold: the tail's range becomes a second summary (the head breakpoint moves onto it)
    folded = segs([4000, 6000, 3000, 800, 1500], {1: HOUR, 3: HOUR, 4: FIVE}, ["tools", "system", "s1", "s2", "t3"])
    bill = c.send_segments(folded, now=20)
    # A: the first summary is not a breakpoint any more, but the lookback from s2 finds its entry
    assert bill == Bill(read=13_000, write_long=800, write=1_500)


def test_a_clock_with_one_hour_on_the_head_knows_when_its_tail_is_cold():
    body = json.dumps({"model": "claude-sonnet-4-5",
                       "system": [{"type": "text", "text": "s" * 8000,
                                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "t" * 8000,
                                                                  "cache_control": {"type": "ephemeral"}}]}]}).encode()
    clk = Clock("anthropic", "claude-sonnet-4-5")
    clk.send(body, 0)
    assert not clk.cold(200) and not clk.cold(200, tail=True)
    assert not clk.cold(600) and clk.cold(600, tail=True)  # the tail's 5-minute entry is gone, the head's not
    assert clk.cold(3700) and clk.cold(3700, tail=True)


def test_mixed_lifetimes_must_put_one_hour_first():
    assert cache.ordered(segs([2000, 2000, 2000], {0: HOUR, 1: HOUR, 2: FIVE}))
    assert cache.ordered(segs([2000, 2000], {0: FIVE, 1: FIVE}))
    assert not cache.ordered(segs([2000, 2000, 2000], {0: HOUR, 1: FIVE, 2: HOUR}))


def test_anthropic_segments_ignore_moving_cache_control():
    def body(n, cc_on):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": "x" * 3000}]}
                for i in range(n)]
        msgs[cc_on]["content"][0]["cache_control"] = {"type": "ephemeral"}
        return json.dumps({"model": "claude-sonnet-4-5", "system": "s" * 100, "messages": msgs}).encode()

    c = Cache(A)
    first = cache.bill_request(c, body(3, 2), now=0)
    assert first.read == 0 and first.write > 0
    second = cache.bill_request(c, body(5, 4), now=5)  # breakpoint moved two messages on
    assert second.read == first.write  # the old entry (without its cache_control) is found by lookback


def test_openai_prefix_from_1024_in_128_steps():
    r = openai_rules("gpt-5-codex")
    c = Cache(r)
    small = b"a" * (1000 * 4)
    assert c.send_prefix(small, now=0) == Bill(input=1000)
    base = b"a" * (1200 * 4)
    assert c.send_prefix(base, now=1) == Bill(input=1200)  # first time: nothing cached
    longer = base + b"b" * (500 * 4)
    bill = c.send_prefix(longer, now=2)
    assert bill.read == 1152  # 1024 + 128, the last full step inside the shared 1200 tokens
    assert bill.input == 1700 - 1152
    assert bill.cost(r) == pytest.approx(548 + 0.1 * 1152)


def test_openai_idle_expiry_and_retention():
    r = openai_rules("gpt-4.1")
    assert r.read == 0.25
    c = Cache(r)
    body = b"z" * (2048 * 4)
    c.send_prefix(body, now=0)
    assert c.send_prefix(body, now=200).read == 2048
    assert c.send_prefix(body, now=200 + 301).read == 0
    long = Cache(r)
    retained = json.dumps({"model": "gpt-4.1", "prompt_cache_retention": "24h", "input": "q" * 9000}).encode()
    cache.bill_request(long, retained, now=0)
    assert cache.bill_request(long, retained, now=3 * 3600).read > 0


def test_gemini_minimums():
    pro = Cache(cache.gemini_rules("gemini-2.5-pro"))
    body = b"g" * (2000 * 4)
    pro.send_prefix(body, now=0)
    assert pro.send_prefix(body, now=1).read == 0  # under Pro's 4096
    flash = Cache(cache.gemini_rules("gemini-2.5-flash"))
    flash.send_prefix(body, now=0)
    assert flash.send_prefix(body, now=1).read == 1920  # 1024 + 7 steps of 128


def test_gemini_reads_at_the_price_tables_rate():
    """Google bills a 2.5 model's cached reads at a tenth of its input (0.125 of 1.25 for Pro, 0.03 of
    0.3 for Flash), as the price table has it; the cache model took a quarter (2.0's rate)."""
    from bili_addon import prices

    for model in ("gemini-2.5-pro", "gemini-2.5-flash", "models/gemini-2.5-flash"):
        p = prices.BUILTIN[prices.normalise(model)]
        assert cache.gemini_rules(model).read == pytest.approx(p.cache_read / p.input) == pytest.approx(0.1)
    assert cache.gemini_rules("gemini-2.0-flash").read == 0.25  # (not in the table: 0.025 of 0.10)


def test_a_gemini_sessions_clock_has_the_model_of_its_url():
    """A Gemini body names no model (its URL does, and the session has it): the clock was made for
    the model '' (Flash's 1024-token minimum) and read a Pro prompt too short for Pro's cache."""
    clocks = cache.Clocks()
    body = json.dumps({"contents": [{"role": "user", "parts": [{"text": "word " * 2500}]}]}).encode()
    for t in (0.0, 10.0):
        clocks.sent("g", "gemini", body, t, "", "gemini-2.5-pro")
    rules = clocks.history("g")[0]
    assert (rules.min_tokens, rules.read) == (4096, 0.1)
    assert [t.predicted.read for t in clocks.by_session["g"].turns] == [0, 0]  # ~3100 tokens: under Pro's minimum


def test_clock_applies_learned_facts_and_notes_each_reads_age():
    """What the calibration learned (kernel/calibration.py) changes the clock's warm/cold judgement;
    the clock notes how long the entry each predicted read came from had been unused."""
    clk = Clock("anthropic", "claude-sonnet-4-5")
    body = json.dumps({"model": "claude-sonnet-4-5", "system": [{"type": "text", "text": "s" * 8000,
                                                                  "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    clk.send(body, 0)
    assert clk.turns[-1].age is None and clk.turns[-1].gap is None
    assert clk.send(body, 120).read > 0  # documented: 5 minutes, warm after 2
    assert clk.turns[-1].age == 120 and clk.turns[-1].gap == 120
    assert clk.ttl == 300 and not clk.cold(120 + 299)
    clk.apply(ttl=90.0, source="host")
    assert clk.ttl == 90 and clk.learned() == {"ttl": 90.0, "source": "host"}
    assert not clk.cold(120 + 89) and clk.cold(120 + 91)
    assert clk.send(body, 120 + 91).read == 0  # predicted a miss now
    clk.apply(no_cache=True, source="session")
    assert clk.ttl == 0 and clk.cold(120 + 92) and clk.send(body, 120 + 92).read == 0
    clk.apply()  # withdrawn: the documented rules again
    assert clk.learned() == {} and clk.ttl == 300
    clk.send(body, 300)
    assert clk.send(body, 301).read > 0 and clk.turns[-1].age == 1


def test_a_learned_minimum_keeps_short_prefixes_out_of_the_cache():
    clk = Clock("chat", "gpt-5")
    body = b'{"model":"gpt-5","messages":[{"role":"user","content":"' + b"x" * 9000 + b'"}]}'
    clk.send(body, 0)
    assert clk.send(body, 1).read > 0  # ~2.2K tokens: over the documented 1024
    clk.apply(min_tokens=4000)
    clk.send(body, 2)
    assert clk.send(body, 3).read == 0 and clk.learned()["min_tokens"] == 4000
    long = body.replace(b"x" * 9000, b"x" * 20000)
    clk.send(long, 4)
    assert clk.send(long, 5).read >= 4000


def test_anthropic_blocks_match_byte_for_byte_without_their_cache_control():
    r = anthropic_rules("claude-sonnet-4-5")
    a = b'{"type": "text", "text": "' + b"y" * 5000 + b'", "cache_control": {"type": "ephemeral"}}'
    b = b'{"type": "text", "text": "' + b"y" * 5000 + b'"}'
    first = b'{"cache_control":{"type":"ephemeral","ttl":"1h"},"type":"text","text":"z"}'
    assert cache._block(a, r) == (b, 300.0)
    assert cache._block(first, r) == (b'{"type":"text","text":"z"}', 3600.0)
    assert cache._block(b, r) == (b, None)
    quoted = b'{"type":"text","text":"\\"cache_control\\" is a key"}'  # mentioned, not set: no breakpoint
    assert cache._block(quoted, r) == (quoted, None)


def test_the_lifetime_decision_sees_the_lifetimes_in_force():
    from bili_addon.kernel.cache import Clocks

    clocks = Clocks()
    body = json.dumps({"model": "claude-sonnet-4-5", "system": [{"type": "text", "text": "s" * 8000,
                                                                  "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    for t in (0, 10, 400):
        clocks.sent("s", "anthropic", body, t)
    rules, gaps, _size, _new = clocks.history("s")
    assert (rules.ttl, rules.ttl_long, gaps) == (300, 3600, [10, 390])
    clocks.by_session["s"].apply(ttl=90.0)
    rules = clocks.history("s")[0]
    assert (rules.ttl, rules.ttl_long) == (90, 90)  # a 1-hour entry would not outlive it either
    clocks.by_session["s"].apply(no_cache=True)
    assert clocks.history("s") is None  # no cache: no lifetime to choose


def test_anthropic_string_content_is_the_text_block_it_stands_for():
    """Claude Code sends a user's text as one block (with the last breakpoint) while it is the last
    message and as a string after: the same prompt, so the same cache prefix."""
    def body(content):
        return json.dumps({"model": "claude-sonnet-4-5", "system": "s", "messages": [
            {"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]},
            separators=(",", ":")).encode()
    text = "Task 2: fix the parser \u00e9 \"quoted\""
    as_block = cache.anthropic_segments(body([{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]))
    as_string = cache.anthropic_segments(body(text))
    assert [s.key for s in as_block] == [s.key for s in as_string]
    assert as_block[1].ttl is not None and as_string[1].ttl is None
    other = cache.anthropic_segments(body([{"type": "text", "text": text + "!"}]))
    assert other[1].key != as_string[1].key


def test_the_live_tail_of_a_session_that_asks_an_hour_everywhere_lives_an_hour():
    """With every breakpoint asking for 1 hour (the session's "1h" lifetime, or an agent's own), the
    tail's entries live an hour: ``cold(tail=True)`` said cold after any 5-minute pause (it counted
    only entries of the default lifetime, and there were none), and a held fold landed as free over a
    cache the same request would read in full, rewriting it at the 1-hour write price."""
    import json as _json

    from bili_addon.kernel import cache, lifetime

    def body(n: int, hour: bool) -> bytes:
        msgs = []
        for i in range(n):
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"question {i} " + "x" * 4000}]})
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " + "y" * 4000}]})
        msgs.append({"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]})
        raw = _json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 10,
                           "system": [{"type": "text", "text": "s" * 8000, "cache_control": {"type": "ephemeral"}}],
                           "messages": msgs}).encode()
        return lifetime.upgrade(raw) if hour else raw

    for hour, alive in ((True, 3600.0), (False, 300.0)):
        clocks = cache.Clocks()
        clocks.sent("s1", "anthropic", body(10, hour), 0.0)
        assert not clocks.cold("s1", alive - 10, tail=True)
        assert clocks.cold("s1", alive + 10, tail=True)
        assert clocks.by_session["s1"].cache.tail_ttl() == alive
    # the stable head for an hour, the tail for 5 minutes: the tail's expiry is the free moment
    head = lifetime.upgrade_head(body(10, False).replace(b'"x', b'"[Compressed conversation section b1 x', 1))
    clocks = cache.Clocks()
    clocks.sent("s2", "anthropic", head or body(10, False), 0.0)
    assert clocks.cold("s2", 400.0, tail=True) and clocks.by_session["s2"].cache.tail_ttl() == 300.0


# -- OpenAI and Gemini: the prompt in the provider's order -------------------------------------------

INSTR = "Be terse. " * 400  # ~1000 tokens of instructions
TOOLS = [{"type": "function", "name": f"tool_{i}", "description": "Does a thing. " * 60,
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}} for i in range(6)]


def agent_body(lane, turns, tools=TOOLS, order="agent"):
    """A body as the agents send it (``order="agent"``: the conversation first, then the instructions
    where they are a member, then the tools: omp, hermes, codex) or with the members the other way."""
    said = [("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "word " * 300) for i in range(turns)]
    if lane == "chat":
        conv = {"messages": [{"role": "system", "content": INSTR}] + [{"role": r, "content": t} for r, t in said]}
        head = {}
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    elif lane == "responses":
        conv = {"input": [{"type": "message", "role": r, "content": [{"type": "input_text", "text": t}]}
                          for r, t in said]}
        head = {"instructions": INSTR}
    else:
        conv = {"contents": [{"role": "model" if r == "assistant" else "user", "parts": [{"text": t}]}
                             for r, t in said]}
        head = {"systemInstruction": {"parts": [{"text": INSTR}]}}
        tools = [{"functionDeclarations": [{k: v for k, v in t.items() if k != "type"} for t in tools]}]
    top = {"model": "gpt-5", "stream": True}
    if order == "agent":
        obj = {**top, **conv, **head, "tools": tools}
    else:
        obj = {**top, **head, "tools": tools, **conv}
    return json.dumps(obj).encode()


def tokens_of(obj) -> int:
    return len(json.dumps(obj).encode()) // 4


@pytest.mark.parametrize("lane", ["chat", "responses", "gemini"])
def test_openai_gemini_read_the_tools_before_the_conversation(lane):
    """The provider renders the instructions, then the tools, then the conversation: a follow-up reads
    the agent's tools from the cache.  Read in the body's key order (tools after the conversation),
    the model billed them uncached on every request."""
    clk = Clock(lane, "gemini-2.5-flash" if lane == "gemini" else "gpt-5")
    clk.send(agent_body(lane, 8), 0.0)
    bill = clk.send(agent_body(lane, 9), 10.0)
    assert bill.input < 128 + 400  # the new message (~300 tokens) and the step it ends in; the rest read
    assert bill.read >= tokens_of(TOOLS) + 1000 + 8 * 300


@pytest.mark.parametrize("lane", ["chat", "responses", "gemini"])
def test_openai_gemini_new_tools_rewrite_all_after_the_instructions(lane):
    """A tool added (bili's own on activation) changes the prompt right after the instructions: the
    conversation is written again, not read (the key order's model saw a change at the end)."""
    clk = Clock(lane, "gemini-2.5-flash" if lane == "gemini" else "gpt-5")
    clk.send(agent_body(lane, 20), 0.0)
    more = TOOLS + [{"type": "function", "name": "compress", "description": "Fold.", "parameters": {}}]
    bill = clk.send(agent_body(lane, 20, tools=more), 10.0)
    assert bill.read <= tokens_of(TOOLS) + 1100  # at most the instructions and the tools' shared opening
    assert bill.input >= 20 * 300


@pytest.mark.parametrize("lane", ["chat", "responses", "gemini"])
def test_openai_gemini_bill_the_same_prompt_in_any_member_order(lane):
    """The members' order in the JSON is no part of the prompt: the agent's order and the provider's
    bill alike, turn after turn (memo or none)."""
    for memo in (True, False):
        bills = []
        for order in ("agent", "provider"):
            clk = Clock(lane, "gpt-5")
            clk.cache.memo = memo
            bills.append([clk.send(agent_body(lane, n, order=order), 10.0 * n) for n in (4, 5, 6, 8)])
        assert bills[0] == bills[1]
        assert bills[0][-1].read > 0


def test_chat_leading_system_messages_come_before_the_tools():
    """Chat Completions: the opening system (or developer) messages are the instructions the tools
    follow; a tool change keeps them read, a change to them reads nothing."""
    clk = Clock("chat", "gpt-5")
    clk.send(agent_body("chat", 6), 0.0)
    more = TOOLS + [{"type": "function", "name": "compress", "description": "Fold.", "parameters": {}}]
    assert clk.send(agent_body("chat", 6, tools=more), 10.0).read >= 1024  # the system message's ~1000 tokens
    other = agent_body("chat", 6, tools=more).replace(b"Be terse.", b"Be brief.", 1)
    assert clk.send(other, 20.0).read == 0


def test_anthropic_bills_the_same_in_any_member_order():
    """Anthropic caches tools, then system, then messages whatever the JSON's order (the agents send
    messages first): the model reads them so."""
    tools = [{"name": f"t{i}", "description": "Does a thing. " * 60, "input_schema": {"type": "object"}}
             for i in range(6)]
    system = [{"type": "text", "text": "Be terse. " * 400, "cache_control": {"type": "ephemeral"}}]

    def body(n, first):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 300} for i in range(n)]
        msgs[-1] = {"role": msgs[-1]["role"], "content": [{"type": "text", "text": msgs[-1]["content"],
                                                           "cache_control": {"type": "ephemeral"}}]}
        head = {"tools": tools, "system": system}
        obj = {"model": "claude-sonnet-4-5", **head, "messages": msgs} if first else \
            {"model": "claude-sonnet-4-5", "messages": msgs, **head}
        return json.dumps(obj).encode()

    runs = []
    for first in (True, False):
        clk = Clock("anthropic", "claude-sonnet-4-5")
        runs.append([clk.send(body(n, first), 10.0 * n) for n in (3, 4, 6)])
    assert runs[0] == runs[1] and runs[0][-1].read > 0


def test_a_model_switch_reads_nothing_of_the_other_models_cache_and_a_switch_back_finds_its_own():
    """A provider caches per model: the first request after a switch (Claude Code's /model) writes its
    prefix anew, and a switch back within the lifetime reads the first model's entries.  Predicted
    reads across the switch were wrong, and the calibration learned from the mismatch."""
    def body(model: str, n: int) -> bytes:
        return json.dumps({"model": model, "system": [{"type": "text", "text": "s" * 8000,
                                                       "cache_control": {"type": "ephemeral"}}],
                           "messages": [{"role": "user", "content": f"turn {i} " * 50} for i in range(n)]}).encode()

    clocks = cache.Clocks()
    clocks.sent("m", "anthropic", body("claude-sonnet-4-5", 1), 0.0, "", "claude-sonnet-4-5")
    clocks.sent("m", "anthropic", body("claude-sonnet-4-5", 2), 10.0, "", "claude-sonnet-4-5")
    clocks.sent("m", "anthropic", body("claude-opus-4-1", 3), 20.0, "", "claude-opus-4-1")
    clocks.sent("m", "anthropic", body("claude-sonnet-4-5", 4), 30.0, "", "claude-sonnet-4-5")
    clocks.report("m", None)
    turns = clocks.by_session["m"].turns
    assert [t.predicted.read > 0 for t in turns] == [False, True, False, True]
    assert turns[2].predicted.write > 1500  # the system written again, for the other model
    assert clocks.by_session["m"].model == "claude-sonnet-4-5"


def test_the_clocks_keep_no_more_sessions_unanswered_requests_than_sessions():
    """A request whose answer never came (an agent closed mid-answer) kept its whole body until its
    session was seen again: with sessions that never were, without bound."""
    from bili_addon.kernel.cache import Clocks

    clocks = Clocks(max_sessions=16)
    body = json.dumps({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    for i in range(100):
        clocks.sent(f"s{i}", "anthropic", body, 1000.0 + i)
    assert len(clocks.pending) == 16 and list(clocks.pending) == [f"s{i}" for i in range(84, 100)]
    clocks.sent("s99", "anthropic", body, 1200.0)  # (its own requests stay, up to MAX_PENDING)
    assert len(clocks.pending["s99"]) == 2 and len(clocks.pending) == 16
