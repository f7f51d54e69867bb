"""Lazy activation in the kernel (kernel/activation.py): nothing of bili until folding pays, a cold
moment brings it earlier, and once active a session stays active."""

from __future__ import annotations

import json

from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

LANE = LANES["anthropic"]


def body(n_work: int, tail: str = "Go on.") -> bytes:
    msgs = [{"role": "user", "content": "Start."}]
    for i in range(n_work):
        msgs.append({"role": "assistant", "content": f"Step {i}."})
        msgs.append({"role": "user", "content": f"file {i}: " + "x = 1\n" * 700})  # ~1.05K tokens
    msgs += [{"role": "assistant", "content": "Read."}, {"role": "user", "content": tail}]
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 64,
                       "tools": [{"name": "shell", "input_schema": {}}],
                       "system": [{"type": "text", "text": "sys " * 1200, "cache_control": {"type": "ephemeral"}}],
                       "messages": msgs}).encode()


def engine(tmp_path, threshold=6000) -> Engine:
    eng = Engine(Store(tmp_path / "data"), activate="lazy")
    eng.nudge_cfg.batch_tokens = threshold
    eng.t = 1000.0
    eng.now = lambda: eng.t
    return eng


def send(eng, sid, raw):
    return eng.process(raw, LANE, {"x-claude-code-session-id": sid}, render=True)


def injected(res) -> bool:
    return res.body is not None and b'"name":"compress"' in res.body.replace(b" ", b"")


def test_inactive_until_threshold_then_stays(tmp_path):
    eng = engine(tmp_path)
    for n in (0, 1, 3):
        res = send(eng, "s1", body(n))
        assert res.body is None and not res.active and res.refs_new > 0  # byte-exact, ledger recorded
        eng.t += 10
    res = send(eng, "s1", body(7))  # ~6.3K foldable tokens: past the threshold
    assert res.active and injected(res) and b"<acp" in res.body
    assert eng.sessions["s1"].flags["active"] == "threshold"
    eng.t += 10
    res = send(eng, "s1", body(1, tail="A new short history."))  # the tools never flicker
    assert res.active and injected(res)
    eng.store.close()
    eng2 = engine(tmp_path)  # persisted: a restarted proxy keeps it active
    assert injected(send(eng2, "s1", body(1, tail="again")))
    eng2.store.close()


def test_cold_moment_activates_at_half_the_threshold(tmp_path):
    eng = engine(tmp_path)
    send(eng, "warm", body(4))
    eng.t += 60  # one minute later: the cache is warm, 4K foldable tokens is under the threshold
    assert not send(eng, "warm", body(4, tail="next")).active
    eng.t += 301  # the 5-minute entry has expired: the next request is written in full anyway
    assert eng.clocks.cold("warm", eng.t)
    res = send(eng, "warm", body(4, tail="after a pause"))
    assert res.active and injected(res)
    assert eng.sessions["warm"].flags["active"] == "cold"
    eng.store.close()


def test_cold_but_too_little_work_stays_inactive(tmp_path):
    eng = engine(tmp_path)
    send(eng, "small", body(1))
    eng.t += 3600
    res = send(eng, "small", body(1, tail="later"))
    assert not res.active and res.body is None
    eng.store.close()


def test_always_injects_from_the_first_request(tmp_path):
    eng = Engine(Store(tmp_path / "data"), activate="always")
    assert injected(send(eng, "a", body(0)))
    eng.store.close()


def test_the_clock_predicts_what_was_sent(tmp_path):
    eng = engine(tmp_path)
    send(eng, "c", body(2))
    eng.t += 5
    send(eng, "c", body(2, tail="more"))
    first, second = eng.clocks.stats("c")["turns"]
    assert first["predicted_read"] == 0 and first["predicted_write"] > 0
    assert second["predicted_read"] > 1000  # the system block's breakpoint entry (tools + system) is read
    eng.clocks.report("c", read=0)  # the provider disagrees
    assert eng.clocks.stats("c")["turns"][-1]["reported_read"] == 0
    eng.store.close()


def test_a_provider_that_keeps_entries_one_minute_is_learned(tmp_path):
    """Calibration through the answer path: the provider reports a read only within a minute of the
    previous request; after a two-minute gap it reports none, and the clock learns a shorter life."""
    from bili_addon.stream import Usage

    class Answer:  # an answer as the response path leaves it: no proxy calls, the usage reported
        calls: list = []
        rewrite = False

        def __init__(self, read: int):
            self.usage = Usage(100, read, 0, 10, seen=True, cache_known=True)

    eng = engine(tmp_path)
    last = None
    for i, gap in enumerate((0, 30, 30, 120, 30, 120, 30, 120)):
        eng.t += gap
        send(eng, "ttl", body(2))
        predicted = eng.clocks.stats("ttl")["turns"][-1]["predicted_read"]
        provider_read = predicted if last is not None and eng.t - last <= 60 else 0
        eng.record_answer("ttl", "anthropic", Answer(provider_read))
        last = eng.t
        if i == 5:  # two misses after two minutes: not yet evidence enough
            assert eng.clocks.stats("ttl")["learned"] == {}
    learned = eng.clocks.stats("ttl")["learned"]
    assert learned == {"ttl": 120.0, "source": "session"}  # the entry was gone after 120 s, three times
    rows = eng.clocks.stats("ttl")["turns"]
    assert rows[3]["predicted_read"] > 0 and rows[3]["reported_read"] == 0  # the contradiction, kept for stats
    stored = eng.store.calibration("ttl")
    assert [eng_row.reported_read > 0 for eng_row in stored] == [False, True, True, False, True, False, True, False]
    assert not eng.clocks.cold("ttl", eng.t + 100) and eng.clocks.cold("ttl", eng.t + 121)  # (time runs forward)
    eng.store.close()


def test_what_an_active_session_carries_stays_small():
    """bili's tools and prompt are read on every request of an active session (bench_session: ~0.1
    input-token units per token per request), so their size is a cost: ~690 tokens since #10."""
    from bili_addon.kernel.prompts import SYSTEM_PROMPT, TOOLS

    tools = json.dumps(list(TOOLS), separators=(",", ":"))
    assert len(tools) + len(SYSTEM_PROMPT) <= 2_900, (len(tools), len(SYSTEM_PROMPT))
    for word in ("compress", "decompress", "<acp", "[bili]", "[Compressed conversation section", "history"):
        assert word in SYSTEM_PROMPT  # what the model must still be told


def test_an_answer_without_a_cache_figure_teaches_no_cache_model(tmp_path):
    """A gateway (or an OpenAI-compatible server) whose usage has no figure of cache reads at all is no
    evidence of a miss: it used to be read as "0 read", and three quick answers taught "this provider
    keeps no cache" (the session judged cold at once, its held folds landing on a warm cache, the
    host's other sessions given the same).  An answer that says 0 still teaches it."""
    from bili_addon.stream.lanes import AnthropicResponse, ChatResponse

    def answers(sid: str, usage: dict) -> dict:
        eng = engine(tmp_path / sid, threshold=10**9)
        for _ in range(4):
            send(eng, sid, body(3))
            rw = AnthropicResponse()
            rw.body({"type": "message", "content": [], "usage": usage})
            eng.record_answer(sid, "anthropic", rw)
            eng.t += 5
        learned = eng.clocks.stats(sid)["learned"]
        eng.store.close()
        return learned

    assert answers("silent", {"input_tokens": 3300, "output_tokens": 5}) == {}
    assert answers("zero", {"input_tokens": 3300, "output_tokens": 5, "cache_read_input_tokens": 0,
                            "cache_creation_input_tokens": 0}).get("no_cache") is True

    # OpenAI's details, DeepSeek's own field, and neither
    for usage, read, known in (({"prompt_tokens": 3100, "prompt_tokens_details": {"cached_tokens": 3000}}, 3000, True),
                               ({"prompt_tokens": 3100, "prompt_cache_hit_tokens": 3000}, 3000, True),
                               ({"prompt_tokens": 3100, "completion_tokens": 5}, 0, False)):
        rw = ChatResponse()
        rw.body({"choices": [], "usage": usage})
        assert (rw.usage.seen, rw.usage.input, rw.usage.cache_read, rw.usage.cache_known) == (True, 3100, read, known)
