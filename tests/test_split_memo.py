"""A follow-up's body is read from its predecessor's layout (wire.base.Splits): where the two bodies
share their bytes (a prefix up to the end of some items, the members after the array), only the new
items are scanned.  Proof that it reads exactly what the full split reads: (1) random chains of
compact bodies (items appended, dropped, changed, numbers that grow a digit, members changed,
re-ordered, spaced, escaped keys, the array emptied) against a fresh ``Body`` of each; (2) the count
of shared items it reports is the items' common prefix; (3) whole Engine runs over the bench's
conversations, churn and the captures, with the memo and without it: the same bytes out."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import coverage
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES, base
from bili_addon.wire.base import Body, Split, Splits, _split_compact

from tests.oracle_runs import capture_turns
from tests.test_folded_follow_up import bench_overhead

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"


def same_split(a: Body, b: Body) -> None:
    assert list(a.top) == list(b.top)
    assert [bytes(v) for v in a.top.values()] == [bytes(v) for v in b.top.values()]
    assert (a.key, a.array, a.compact) == (b.key, b.array, b.compact)
    assert [bytes(x) for x in a.items] == [bytes(x) for x in b.items]


# -- random bodies ----------------------------------------------------------------------------------

WORDS = ["a", "é", "日本", "\"q\"", "back\\slash", "tab\t", "nl\n", "<acp x>", "\u2028", "😀", "[]{},:"]


def rnd_value(r: random.Random, depth: int = 0):
    k = r.randrange(9 if depth < 3 else 5)
    if k == 0:
        return r.randrange(-5, 1000)
    if k == 1:
        return r.choice([True, False, None, 1.5, -0.25])
    if k < 5:
        return "".join(r.choice(WORDS) for _ in range(r.randrange(0, 6)))
    if k < 7:
        return [rnd_value(r, depth + 1) for _ in range(r.randrange(0, 4))]
    return {r.choice(["role", "content", "type", "text", "id", "k"]) + str(i): rnd_value(r, depth + 1)
            for i in range(r.randrange(0, 4))}


def rnd_item(r: random.Random):
    k = r.randrange(10)
    if k == 0:
        return r.randrange(0, 100)  # a number: a later body may grow it by a digit
    if k == 1:
        return rnd_value(r)
    return {"role": r.choice(["user", "assistant"]), "content": rnd_value(r)}


def encode(top: list[tuple[str, object]]) -> bytes:
    return msgspec.json.encode(dict(top))


def mutate(r: random.Random, top: list[tuple[str, object]], conv: str = "messages") -> list[tuple[str, object]]:
    top = [(k, v) for k, v in top]
    i = next(n for n, (k, _v) in enumerate(top) if k == conv)
    items = list(top[i][1])
    op = r.randrange(12)
    if op < 5:
        items += [rnd_item(r) for _ in range(r.randrange(1, 4))]
    elif op == 5 and items:
        del items[r.randrange(len(items)):]
    elif op == 6 and items:
        items[r.randrange(len(items))] = rnd_item(r)
    elif op == 7 and items and isinstance(items[-1], int):
        items[-1] = items[-1] * r.choice([10, 100, 1000]) + 7  # "12" -> "1207": the old item's bytes a prefix
    elif op == 8:
        j = r.randrange(len(top))
        if top[j][0] != conv:
            top[j] = (top[j][0], rnd_value(r))
    elif op == 9:
        r.shuffle(top)
        i = next(n for n, (k, _v) in enumerate(top) if k == conv)
    elif op == 10:
        items = []
    # op 11: the same body again
    top[i] = (conv, items)
    return top


def spaced(raw: bytes, r: random.Random) -> bytes:
    """The body with a space somewhere between two tokens (no longer compact)."""
    at = raw.rfind(b"},{") if r.random() < 0.5 else raw.find(b'":')
    if at < 0:
        return raw
    return raw[:at + 1] + b" " + raw[at + 1:]


@pytest.mark.parametrize("conv, others", [
    ("messages", ["model", "system", "tools", "max_tokens", "metadata", "stream", "temperature"]),
    ("input", ["model", "instructions", "tools", "include", "reasoning", "prompt_cache_key", "store"]),
])
def test_random_chains_read_what_the_full_split_reads(conv, others):
    r = random.Random(20261205)
    derived = 0
    orig = Split.derive
    got = []

    def counting(self, raw):
        out = orig(self, raw)
        got.append(out is not None)
        return out

    Split.derive = counting
    try:
        for chain in range(250):
            keys = r.sample(others, r.randrange(0, 5))
            if r.random() < 0.05:
                keys.append("system" if conv == "input" else "instructions")  # a key the lane's split does not know
            top = [(k, rnd_value(r)) for k in keys]
            top.insert(r.randrange(len(top) + 1), (conv, [rnd_item(r) for _ in range(r.randrange(0, 8))]))
            splits = Splits()
            recent: list = []
            for step in range(12):
                raw = encode(top)
                if r.random() < 0.08:
                    raw = spaced(raw, r)
                if r.random() < 0.04:
                    raw = raw.replace(b'"model":', b'"mod\\u0065l":', 1)  # a key written with an escape
                fresh = Body(raw, conv)
                body = splits.body(raw, conv, ("lane", chain))
                same_split(body, fresh)
                # read from a layout kept: the newest compact body's, or the one before it that a
                # body read from the newest's did not replace
                if body.shared is not None:
                    assert any(body.shared[0].items is x for x in recent)
                    assert body.shared[1] == coverage.common_prefix(body.shared[0].items, body.items)
                    recent = [x for x in recent if x is not body.shared[0].items]
                if body.compact is not None:
                    recent = [body.items, *recent][:2]
                top = mutate(r, top, conv)
    finally:
        Split.derive = orig
    derived = sum(got)
    assert derived > 1000 and len(got) - derived > 100  # (both ways were taken, many times)


def test_hand_made_edges():
    s = Splits()
    key = ("anthropic", "x")
    seq = [b'{"model":"m","messages":[12],"max_tokens":1}',
           b'{"model":"m","messages":[127],"max_tokens":1}',  # the number grew a digit
           b'{"model":"m","messages":[12734],"max_tokens":1}',  # two: not the items 127 and 34
           b'{"model":"m","messages":[12734,"x"],"max_tokens":1}',
           b'{"model":"m","messages":[12734,"xy"],"max_tokens":1}',
           b'{"model":"m","messages":[127,{"a":1}],"max_tokens":1}',
           b'{"model":"m","messages":[],"max_tokens":1}',
           b'{"model":"m","messages":[{"a":1}],"max_tokens":1}',
           b'{"model":"m","messages":[{"a":1}],"max_tokens":2}',  # a member after the array changed
           b'{"model":"m","messages":[{"a":1},{"b":2}],"max_tokens":2}',
           b'{"model":"m","messages":[{"a":1},{"b":2}, {"c":3}],"max_tokens":2}',  # a space: the general split
           b'{"model":"m","messages":[{"a":1},{"b":2}],"max_tokens":2}',
           b'{"model":"m","messages":[{"a":1},{"b":2}],"max_tokens":2}',  # the same body
           b'{"model":"m","messages":[{"a":1},{"b":2}],"max_tokens":2,"x":1}',  # a key the split does not know
           b'{"messages":[{"a":1},{"b":2},{"c":"]}"}]}',
           b'{"messages":[{"a":1},{"b":2},{"c":"]}"},{"d":4}]}',
           b'{"messages":[{"a":1},{"b":2}],"x":[{"c":3}]}',
           b'{"messages":[{"a":1},{"b":2}]}',
           b'{"messages":[{"a":1},{"b":2}],"model":"m"}']
    for raw in seq:
        body = s.body(raw, "messages", key)
        same_split(body, Body(raw, "messages"))
        json.loads(raw)
    # a body whose middle is not items: nothing read from the layout
    s = Splits()
    s.body(b'{"messages":[{"a":1}],"model":"m"}', "messages", key)
    bad = b'{"messages":[{"a":1},{"b":2}],"model":"x"},"model":"m"}'
    with pytest.raises(base.CodecError):
        s.body(bad, "messages", key)


def test_side_requests_between_turns():
    """A conversation's turns with another body under the same id between them (a title request):
    each turn is still read from the conversation's previous layout."""
    s = Splits()
    conv = [("model", "m"), ("messages", [{"a": i} for i in range(5)]), ("system", "long " * 50)]
    side = [("model", "small"), ("messages", [{"title": "x"}]), ("system", "titles")]
    shared = []
    for turn in range(6):
        raw = encode(conv)
        body = s.body(raw, "messages", "sid")
        same_split(body, Body(raw, "messages"))
        shared.append(body.shared[1] if body.shared is not None else None)
        s.body(encode(side), "messages", "sid")
        conv[1] = ("messages", conv[1][1] + [{"b": turn}])
    assert shared == [None, 5, 6, 7, 8, 9]


def test_the_layout_is_bounded():
    s = Splits(keep=3, max_bytes=10_000)
    bodies = [encode([("messages", [{"t": str(i) * 50}] * 20), ("model", "m")]) for i in range(6)]
    for i, raw in enumerate(bodies):
        s.body(raw, "messages", i)
        assert len(s.last) <= 3 and s.size == sum(len(x.raw) for k in s.last.values() for x in k)
    assert list(s.last) == [3, 4, 5]
    big = encode([("messages", ["x" * 20_000]), ("model", "m")])
    s.body(big, "messages", "big")
    assert list(s.last) == ["big"] and s.size == len(big)  # (the newest always stays)
    s.body(big, "messages", "big")  # the same body again: its layout replaced, not kept twice
    assert len(s.last["big"]) == 1 and s.size == len(big)
    s.body(big, "messages", None)  # no key: nothing kept
    assert list(s.last) == ["big"]


# -- whole engines ----------------------------------------------------------------------------------

class NoMemo(Splits):
    def body(self, raw, key, memo_key):
        return Body(raw, key)


def run(d: Path, turns, memo: bool) -> list:
    eng = Engine(Store(str(d)), activate="always")
    eng.lineage.defer = True
    if not memo:
        eng.splits = NoMemo()
    outs = []
    for lane, headers, raw in turns:
        res = eng.process(raw, LANES[lane], headers, render=True)
        outs.append((res.body, res.session, res.refs_new, res.refs_known, res.tagged, res.reused, res.source))
        eng.lineage.flush()
    ledgers = [eng.store.ledger(sid) for sid in sorted({o[1] for o in outs if o[1]})]
    eng.store.close()
    return outs + ledgers


def compare(tmp_path: Path, turns) -> None:
    (tmp_path / "memo").mkdir()
    (tmp_path / "none").mkdir()
    assert run(tmp_path / "memo", turns, True) == run(tmp_path / "none", turns, False)


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_engine_turns_of_the_bench(tmp_path, lane):
    case = bench_overhead.Case(lane, 60)
    other = bench_overhead.Case(lane, 60, seed=3)
    msgs, omsgs = list(case.msgs), list(other.msgs)
    turns = []
    for i in range(6):
        msgs = msgs + [case.new(i), {"role": "assistant", "content": f"done {i}"}]
        turns.append((lane, {"x-acp-session": "a"}, case.body(msgs)))
        omsgs = omsgs + [other.new(i)]
        turns.append((lane, {"x-acp-session": "b"}, other.body(omsgs)))
        turns.append((lane, {}, case.body(msgs)))  # anonymous: keyed by its first bytes
    turns.append((lane, {"x-acp-session": "a"}, case.body(msgs[:40])))  # truncated
    turns.append((lane, {"x-acp-session": "a"}, case.body(msgs[:40] + [case.new(99)])))
    compare(tmp_path, turns)


def test_engine_turns_of_the_captures(tmp_path):
    turns = capture_turns()
    assert len(turns) >= 10 and any(lane == "responses" for lane, _h, _r in turns)
    compare(tmp_path, turns)


def test_engine_turns_of_responses(tmp_path):
    """The bench's Codex-shaped conversation (Responses: reasoning, function calls, outputs)."""
    case = bench_overhead.Case("responses", 60)
    items = list(case.msgs)
    assert _split_compact(case.body(items), "input") is not None  # (the one-scan split reads them)
    more = [case.new(i) for i in range(12)]
    turns = []
    for i in range(6):
        items = items + [more[i], {"type": "message", "role": "assistant", "id": f"msg_x{i}",
                                   "content": [{"type": "output_text", "text": f"done {i}"}]}]
        turns.append(("responses", {"session_id": "codex-1"}, case.body(items)))
        turns.append(("responses", {}, case.body(items[:30] + [more[6 + i]])))
    turns.append(("responses", {"session_id": "codex-1"}, case.body(items[:50])))
    compare(tmp_path, turns)


def test_a_conversations_items_keep_no_body_but_the_first_alive():
    """The shared items are the earlier body's items as they are, a new item a copy of its own bytes:
    over a long session the items never keep a whole body per turn alive (only the first body, which
    its items were sliced from, and the newest, whose layout is kept for the next turn)."""
    import sys

    s = Splits()
    msgs = [{"role": "user", "content": "x" * 200}]
    bodies, kept_items = [], None
    for turn in range(40):
        msgs.append({"role": "assistant" if turn % 2 else "user", "content": f"turn {turn} " + "y" * 300})
        raw = encode([("model", "m"), ("messages", list(msgs)), ("system", "s" * 100)])
        bodies.append(raw)
        body = s.body(raw, "messages", "sid")
        same_split(body, Body(raw, "messages"))
        if turn:
            assert body.shared is not None and body.shared[1] == turn + 1
            assert all(a is b for a, b in zip(body.items, kept_items))  # (the same objects)
        kept_items = body.items  # what the session's memo keeps
        del body
    # a body's only holders: the list above (and the count's own references, as for a body nothing
    # else holds: ``alone``), but the first (its items are slices of it) and the newest (its layout's)
    alone = [sys.getrefcount(b) for b in [bytes(bytearray(bodies[0]))]][0]
    counts = [sys.getrefcount(b) for b in bodies]
    assert counts[1:-1] == [alone] * (len(bodies) - 2)
    assert counts[0] > alone and counts[-1] > alone
    assert len(kept_items) == 41
