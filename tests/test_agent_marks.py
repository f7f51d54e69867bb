"""breakpoints.agent_marks: the agent's cache marks in a body counted piece by piece, the items a
previous pass shared not read again, always ``raw.count`` of each word (kernel/breakpoints.py)."""

from __future__ import annotations

import json
import random

import msgspec

from bili_addon.kernel import breakpoints
from bili_addon.kernel.state import ItemInfo
from bili_addon.wire.base import Body
from tests.test_breakpoints import H, cc_body, fold, marked
from tests.test_fold import engine as engine  # noqa: F401  (the fixture)
from bili_addon.wire import LANES

CC, TTL = b'"cache_control"', b'"ttl"'
ANTH = LANES["anthropic"]


def _block(r: random.Random) -> dict:
    b: dict = {"type": "text", "text": r.choice(["plain", 'says "cache_control" and "ttl"', "\u00e9t\u00e9",
                                                 'x"ttl"y', '{"cache_control":1}'])}
    if r.random() < 0.3:
        b["cache_control"] = {"type": "ephemeral", **({"ttl": "1h"} if r.random() < 0.3 else {})}
    return b


def _msg(r: random.Random, i: int) -> dict:
    if r.random() < 0.3:
        return {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + r.choice(["a", '"ttl"'])}
    return {"role": "user" if i % 2 == 0 else "assistant", "content": [_block(r) for _ in range(r.randint(1, 3))]}


def _body(r: random.Random, msgs: list[dict], compact: bool) -> bytes:
    top: dict = {"model": "claude-x", "max_tokens": 10}
    if r.random() < 0.7:
        top["system"] = [_block(r), _block(r)]
    if r.random() < 0.5:
        top["tools"] = [{"name": "cache_control", "description": '"ttl"', "input_schema": {"type": "object"}}]
    if r.random() < 0.1:
        top["metadata"] = {"ttl": 1}
    top["messages"] = msgs
    if r.random() < 0.3:
        top["stream"] = True
    if compact:
        return msgspec.json.encode(top)
    return json.dumps(top, indent=r.choice([None, 1])).encode()  # (spaces: not a compact body)


def test_the_counts_are_the_bodys_own_turn_after_turn():
    r = random.Random(5)
    for _run in range(300):
        msgs = [_msg(r, i) for i in range(r.randint(1, 6))]
        prev, prev_raws = None, []
        for _turn in range(8):
            kind = r.random()
            if kind < 0.6:
                msgs = msgs + [_msg(r, len(msgs)) for _ in range(r.randint(1, 2))]
            elif kind < 0.75 and len(msgs) > 1:
                msgs = msgs[: r.randint(1, len(msgs) - 1)]
            elif kind < 0.9:
                k = r.randrange(len(msgs))
                msgs = msgs[:k] + [_msg(r, k)] + msgs[k + 1:]
            raw = _body(r, msgs, compact=r.random() < 0.8)
            body = Body(raw, "messages")
            raws = [bytes(x) for x in body.items]
            infos = [ItemInfo(x, False, []) for x in raws]
            shared = 0
            while shared < min(len(raws), len(prev_raws)) and raws[shared] == prev_raws[shared]:
                shared += 1
            shared = r.randint(0, shared)  # (any number of the shared items: the engine may count fewer)
            counts, run = breakpoints.agent_marks(raw, body, infos, prev, shared)
            assert counts == (raw.count(CC), raw.count(TTL))
            if body.compact:
                assert run is not None and len(run) == len(raws) + 1
            prev, prev_raws = run, raws


def compact_cc_body(msgs: list[dict]) -> bytes:
    """Claude Code's shape written as Node writes it (no spaces): a compact body (Body.compact)."""
    return json.dumps(json.loads(cc_body(msgs)), separators=(",", ":")).encode()


def test_a_folded_sessions_turns_mark_as_counting_the_whole_body_would(engine, monkeypatch):  # noqa: F811
    seen = []
    real = breakpoints.mark_head

    def checked(lane, items, start, raw, counts=None):
        assert Body(raw, "messages").compact
        assert counts == (raw.count(CC), raw.count(TTL))
        assert real(lane, list(items), start, raw, counts) == real(lane, list(items), start, raw)
        seen.append(real(lane, items, start, raw, counts))
        return seen[-1]

    monkeypatch.setattr(breakpoints, "mark_head", checked)
    nxt, res = fold(engine, compact_cc_body)
    assert len(marked(json.loads(res.body))) == 2
    msgs = nxt
    for i in range(6):  # follow-ups: the counts of the shared items carried from the previous pass
        msgs = msgs + [{"role": "assistant", "content": [{"type": "text", "text": f"Done {i}."}]},
                       {"role": "user", "content": [{"type": "text", "text": f"Next {i}"}
                                                    | ({"ttl": "5m"} if i == 3 else {})]}]
        out = engine.process(compact_cc_body(msgs), ANTH, H, render=True)
        assert len(marked(json.loads(out.body))) == (1 if i >= 3 else 2)  # (a lifetime asked for: no free mark, ever after)
    assert seen[:4] == [True] * 4 and seen[4:] == [False] * 3
