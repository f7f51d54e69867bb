"""Money for 1-hour cache writes end to end, through a real ``mitmdump --mode reverse``: the official
``anthropic`` SDK streams (and once does not) through bili to a fake provider whose usage splits
the cache writes by lifetime as Anthropic does (``usage.cache_creation``, in ``message_start``).
``/__bili/stats`` prices the 1-hour part at 2x the input price and the rest at 1.25x, and says who
split the writes; a provider that does not split them leaves bili to split them as it sent the
request (the agent's own 1-hour breakpoints)."""

from __future__ import annotations

import time

import pytest

from bili_addon import prices

from .fake_upstream import say
from .support import anthropic_client

pytestmark = pytest.mark.e2e

MODEL = "claude-sonnet-4-5"  # priced: $3 in, $3.75 5m write, $6 1h write, $0.30 read, $15 out per MTok
EPH = {"type": "ephemeral"}
SYSTEM = "You are a careful coding agent working through a large repository, one module at a time. " * 60


def answered(proxy, sid: str, n: int) -> dict:
    """The session's per-turn figures once ``n`` answers are recorded (on the store's worker, after
    the answer reached the client)."""
    deadline = time.monotonic() + 15
    while True:
        status, doc = proxy.admin(f"/__bili/stats?session={sid}")
        if status == 200 and len(doc.get("turns") or []) >= n or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


def converse(proxy, sid: str, system, turns: int, *, stream: bool = True) -> None:
    client, _ = anthropic_client(proxy.url)
    h = {"x-claude-code-session-id": sid, "x-fake-script": sid}
    history: list[dict] = []
    for t in range(1, turns + 1):
        history.append({"role": "user", "content": [{"type": "text", "text": f"Question {t} about module {t}.",
                                                     "cache_control": EPH}]})
        msgs = [dict(m) for m in history]
        for m in msgs[:-1]:  # the breakpoint rides on the last message only, as Claude Code's
            m["content"] = [{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]]
        args = dict(model=MODEL, max_tokens=16, system=system, messages=msgs, extra_headers=h)
        if stream:
            with client.messages.stream(**args) as s:
                text = "".join(s.text_stream)
        else:
            text = client.messages.create(**args).content[0].text
        history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})


def priced(t: dict) -> float:
    return prices.cost(MODEL, t["input_tokens"], t["cache_read"], t["cache_write"], t["output_tokens"],
                       cache_write_1h=t["cache_write_1h"]).total


def test_reported_split_priced_at_each_lifetimes_rate(fake, reverse_proxy, sid):
    usage = iter([(0, 6_000, 4_000), (6_000, 900, 0), (0, 7_000, 7_000)])  # (read, write, written for 1 hour)
    fake.script(sid, [say(f"Answer {t}.") for t in range(1, 4)], cache=lambda raw: next(usage))
    converse(reverse_proxy, sid, [{"type": "text", "text": SYSTEM, "cache_control": {**EPH, "ttl": "1h"}}], 2)
    client_turn3 = [{"type": "text", "text": SYSTEM, "cache_control": {**EPH, "ttl": "1h"}}]
    # the third answer not streamed: the split is in the message's usage
    fake.script(sid, [say("Answer 3.")], cache=lambda raw: next(usage))
    converse(reverse_proxy, sid, client_turn3, 1, stream=False)

    turns = answered(reverse_proxy, sid, 3)["turns"]
    assert [(t["cache_write"], t["cache_write_1h"], t["write_split"]) for t in turns] == [
        (6_000, 4_000, "reported"), (900, 0, "reported"), (7_000, 7_000, "reported")]
    first = turns[0]
    # by hand: 4,000 written for 1 hour at $6, 2,000 for 5 minutes at $3.75, the output at $15 per MTok
    assert first["cost"] == pytest.approx((4_000 * 6 + 2_000 * 3.75 + first["output_tokens"] * 15
                                           + (first["input_tokens"] - 6_000) * 3) / 1e6, abs=1e-6)
    assert first["cost"] > prices.cost(MODEL, first["input_tokens"], 0, 6_000, first["output_tokens"]).total
    for t in turns:
        assert t["cost"] == pytest.approx(priced(t), abs=1e-6)

    w = reverse_proxy.session(sid)["wire"]
    assert w["priced"] and w["cost"] == pytest.approx(sum(priced(t) for t in turns), abs=3e-6)
    assert (w["cache_write"], w["cache_write_1h"]) == (13_900, 11_000)
    assert w["write_split"] == {"reported": 13_900, "sent": 0, "none": 0}


def test_without_a_split_bili_splits_the_writes_as_it_sent_them(fake, reverse_proxy, sid):
    """The provider reports writes but not their lifetimes: the agent asked 1 hour for its system
    prompt, 5 minutes for its last message; the writes are split as the cache model read the
    request's breakpoints, and the stats say so."""
    fake.script(sid, [say(f"Answer {t}.") for t in range(1, 3)], cache=lambda raw: (0, 5_000))
    converse(reverse_proxy, sid, [{"type": "text", "text": SYSTEM, "cache_control": {**EPH, "ttl": "1h"}}], 2)
    plain = sid + "-plain"
    fake.script(plain, [say("Answer 1.")], cache=lambda raw: (0, 5_000))
    converse(reverse_proxy, plain, [{"type": "text", "text": SYSTEM, "cache_control": EPH}], 1)

    turns = answered(reverse_proxy, sid, 2)["turns"]
    for t in turns:
        assert t["write_split"] == "sent" and t["cache_write"] == 5_000, t
        assert t["cost"] == pytest.approx(priced(t), abs=1e-6)
    # the first request wrote the system for an hour and the rest for 5 minutes; the second, as the
    # cache model has it, read the system and wrote only its new messages, for 5 minutes
    assert 0 < turns[0]["cache_write_1h"] < 5_000 and turns[1]["cache_write_1h"] == 0
    w = reverse_proxy.session(sid)["wire"]
    assert w["write_split"] == {"reported": 0, "sent": 10_000, "none": 0}
    assert w["cache_write_1h"] == turns[0]["cache_write_1h"]
    assert w["cost"] > prices.cost(MODEL, sum(t["input_tokens"] for t in turns), 0, 10_000,
                                   sum(t["output_tokens"] for t in turns)).total  # more than all at 5 minutes
    only = answered(reverse_proxy, plain, 1)["turns"][0]
    assert (only["write_split"], only["cache_write_1h"]) == ("sent", 0)  # nothing asked for an hour
