"""The cache lifetime decision end to end (#10, kernel/lifetime.py), through a real ``mitmdump
--mode reverse`` on the Anthropic lane: an agent shaped like Claude Code (two breakpoints in a
~12K-token system prompt, one on its last message) works through a scripted model that folds early
on, with a human who pauses ten minutes now and then.  At the first pause after enough history
(a cold moment) bili keeps the stable head for an hour: the system's two breakpoints and its own on
the fold summary ask for ``"ttl": "1h"``, the agent's last-message breakpoint keeps 5 minutes;
none is added, moved or dropped, and the bodies stay byte-stable turn after turn.  The fake provider
keeps a prompt cache on Anthropic's documented rules (the kernel's model, on the test's clock), so
the next pause reads the head instead of writing everything again.  Time is an injected clock
shared by the fake and the proxy (tests/e2e/clock_addon.py): no sleeps."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from bili_addon.kernel.cache import Clock, anthropic_segments

from .cache_upstream import FileClock
from .fake_upstream import proxy_call
from .support import AnthropicAgent, top_level_spans
from .test_calibration_e2e import ClockedProxy, wait_answers
from .test_fold_e2e import Turns, fold, reading, run_bash, say, summary_head

pytestmark = pytest.mark.e2e

TURNS = 24
COMPRESS_TURN = 6  # folds turns 1-4
PAUSES = (14, 20)  # the human thinks ten minutes before these turns
DECIDED = PAUSES[0]
EPH = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are a coding agent working on a large repository. " * 400,
           "cache_control": EPH},
          {"type": "text", "text": "Read every module before you change it; report what you find. " * 400,
           "cache_control": EPH}]


class ClaudeCodeLike(AnthropicAgent):
    """Claude Code's breakpoints: two in system, one on the last block of the last message."""

    system = SYSTEM

    def outgoing(self, history: list[Any]) -> list[Any]:
        msgs = [dict(m) for m in history]
        last = msgs[-1]
        blocks = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
        msgs[-1] = {**last, "content": blocks[:-1] + [{**blocks[-1], "cache_control": EPH}]}
        return msgs


def script() -> list:
    acts = []
    for t in range(1, TURNS + 1):
        if t == COMPRESS_TURN:
            acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {t}: modules 1 to 4 are done, folding."))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: done."))
        else:
            acts.append(reading(t))
    return acts


def ttls(body: dict) -> list[str]:
    """The lifetime each breakpoint asks for, in cache order (tools, system, messages)."""
    blocks = list(body.get("tools", [])) + [b for b in body["system"] if isinstance(b, dict)]
    for m in body["messages"]:
        blocks += m["content"] if isinstance(m["content"], list) else []
    return [b["cache_control"].get("ttl", "5m") for b in blocks if "cache_control" in b]


class DocumentedCache:
    """The fake provider's prompt cache: Anthropic's documented rules (kernel/cache.py's model) on
    the test's clock; it reports what each request read and wrote."""

    def __init__(self, clock: FileClock):
        self.clock, self.model, self.lock = clock, Clock("anthropic", "claude-sonnet-4-5"), threading.Lock()
        self.bills: list[tuple[float, Any]] = []

    def __call__(self, raw: bytes) -> tuple[int, int]:
        with self.lock:
            bill = self.model.send(raw, self.clock.now())
            self.bills.append((self.clock.now(), bill))
        return bill.read, bill.write + bill.write_long


def test_the_head_keeps_one_hour_the_tail_five_minutes_byte_stable(fake, tmp_path, sid):
    clock = FileClock(tmp_path / "clock")
    provider = DocumentedCache(clock)
    fake.script(sid, script(), real_usage=True, cache=provider)
    proxy = ClockedProxy(tmp_path / "p", fake.port, clock).start()
    try:
        agent = ClaudeCodeLike(proxy.url, sid, sid, "Please audit this repository module by module.")
        up = Turns(fake, sid)
        for t in range(1, TURNS + 1):
            clock.advance(600.0 if t in PAUSES else 5.0)
            agent.step(t, run_bash)
            wait_answers(proxy, sid, t)  # the answer's usage reached the clock before the next request
        for t in range(1, DECIDED):
            assert b'"ttl"' not in up[t].body, f"turn {t}: no lifetime before the decision"
        assert summary_head("b1") in up[COMPRESS_TURN + 1].body.decode()

        prev = None
        for t in range(DECIDED, TURNS + 1):
            body = up[t].json
            # 1 hour on the system's two breakpoints and bili's on the fold summary; 5 minutes on the
            # agent's last message; four in all, as before (none added, moved or dropped)
            assert ttls(body) == ["1h", "1h", "1h", "5m"], (t, ttls(body))
            summary = next(m for m in body["messages"] if summary_head("b1") in json.dumps(m, ensure_ascii=False))
            assert summary["content"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
            assert body["messages"][-1]["content"][-1]["cache_control"] == EPH
            raw = up[t].body
            if prev is not None:
                # byte-stable: system and tools to the byte, and every block the previous request sent
                # is the prefix of this one as the cache matches it (the agent's moving breakpoint aside)
                for key in ("system", "tools"):
                    a, b = top_level_spans(prev)[key], top_level_spans(raw)[key]
                    assert prev[a[0]:a[1]] == raw[b[0]:b[1]], (t, key)
                sa, sb = anthropic_segments(prev), anthropic_segments(raw)
                assert [s.key for s in sa] == [s.key for s in sb[:len(sa)]], t
            prev = raw

        entry = wait_answers(proxy, sid, TURNS)
        flag = entry["lifetime"]
        assert flag["choice"] == "head" and flag["cost_head"] < min(flag["cost_5m"], flag["cost_1h"]), flag
        # the provider's reports: the first pause wrote everything again (the decision's cold moment);
        # the second, with the head kept for an hour, read the head and wrote only the tail
        bills = [b for _, b in provider.bills]
        first, second = bills[PAUSES[0] - 1], bills[PAUSES[1] - 1]
        assert first.read == 0 and first.write_long > 0
        # (the fake re-encodes the body it got: its token estimate differs from bili's by a few)
        assert abs(second.read - flag["head"]) <= 0.01 * flag["head"], (second, flag)
        assert second.write_long == 0 and 0 < second.write < second.read
    finally:
        proxy.stop()
