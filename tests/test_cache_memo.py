"""The billing memo (kernel/cache.py): a Cache that keeps its previous body's blocks, keys and prefix
digests bills every request exactly as one that recomputes everything from scratch.

Oracle tests: two clocks side by side (memo on, memo off = today's full path) over long randomized
sequences of bodies (appended turns, edits in the middle, truncations, tool and system changes,
cache_control moves, 5m/1h breakpoints, rules and calibration changes, gaps longer than the
lifetimes, invalid bodies, duplicate members, other member orders and whitespace), the bench's
conversations and the captured agents' bodies; same Bills, entries, hit_age and turns at each step.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import msgspec
import pytest

from bili_addon.kernel import cache
from bili_addon.kernel.cache import Clock, Clocks, anthropic_rules

HERE = os.path.dirname(os.path.abspath(__file__))


# -- the oracle ----------------------------------------------------------------------------------


class Pair:
    """A clock with the memo and one without, fed the same requests."""

    def __init__(self, lane: str, model: str = ""):
        self.a = Clock(lane, model)
        self.b = Clock(lane, model)
        self.b.cache.memo = False
        self.steps = 0

    def send(self, body: bytes, now: float) -> Any:
        out = []
        for clk in (self.a, self.b):
            try:
                out.append(clk.send(body, now))
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as e:
                out.append(type(e))
        assert out[0] == out[1], (self.steps, out)
        self.check()
        self.steps += 1
        return out[0]

    def check(self) -> None:
        a, b = self.a.cache, self.b.cache
        assert a.entries == b.entries, self.steps
        assert a.hit_age == b.hit_age
        assert a.rules == b.rules
        assert self.a.turns == self.b.turns
        assert self.a.cold(self.a.last or 0.0) == self.b.cold(self.b.last or 0.0)

    def both(self, fn) -> None:
        fn(self.a)
        fn(self.b)


def enc(obj: Any, rng: random.Random | None = None) -> bytes:
    """JSON bytes, compact or (sometimes) with spaces/newlines between tokens."""
    if rng is None or rng.random() < 0.8:
        return msgspec.json.encode(obj)
    if rng.random() < 0.5:
        return json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
    return json.dumps(obj, indent=rng.choice([1, 2]), ensure_ascii=False).encode()


# -- Anthropic bodies ----------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def prose(rng: random.Random, lo: int, hi: int) -> str:
    tail = rng.choice(["", " é", " \u2014", "\n\t\"q\""])
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + tail


def block(rng: random.Random, role: str) -> dict:
    k = rng.random()
    if role == "assistant" and k < 0.3:
        return {"type": "tool_use", "id": f"tu_{rng.randrange(10**6)}", "name": "bash",
                "input": {"command": prose(rng, 1, 8)}}
    if role == "user" and k < 0.3:
        return {"type": "tool_result", "tool_use_id": f"tu_{rng.randrange(10**6)}",
                "content": [{"type": "text", "text": prose(rng, 20, 400)}]}
    return {"type": "text", "text": prose(rng, 5, 300)}


def message(rng: random.Random, role: str) -> dict:
    if rng.random() < 0.3:
        return {"role": role, "content": prose(rng, 5, 200)}
    if rng.random() < 0.05:
        return {"content": [block(rng, role)], "role": role}  # role after content
    return {"role": role, "content": [block(rng, role) for _ in range(rng.randint(1, 3))]}


def tools(rng: random.Random, n: int) -> list[dict]:
    return [{"name": f"tool_{i}", "description": prose(rng, 20, 120),
             "input_schema": {"type": "object", "properties": {"messages": {"type": "string"}}}}
            for i in range(n)]


def cc(ttl: str | None) -> dict:
    return {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}


def mark(obj: dict, ttl: str | None, rng: random.Random) -> dict:
    """A copy of a block (or tool) with a breakpoint (cache_control first or last)."""
    if rng.random() < 0.3:
        return {"cache_control": cc(ttl), **obj}
    return {**obj, "cache_control": cc(ttl)}


class AnthConv:
    """A conversation and its breakpoints, rendered as a body in one of several member orders."""

    ORDERS = [("model", "messages", "system", "tools", "max_tokens"),  # Claude Code
              ("model", "max_tokens", "tools", "system", "messages"),
              ("model", "system", "messages", "tools", "stream"),
              ("messages", "model")]

    def __init__(self, rng: random.Random, n: int):
        self.rng = rng
        self.tools = tools(rng, rng.randint(0, 5))
        self.system: Any = ([{"type": "text", "text": prose(rng, 100, 600)}] if rng.random() < 0.8
                            else prose(rng, 50, 300))
        self.msgs = [message(rng, "user" if i % 2 == 0 else "assistant") for i in range(n)]
        self.order = rng.choice(self.ORDERS)
        self.bp_long = rng.random() < 0.5  # 1-hour breakpoints on tools/system
        self.tail_bps = 1
        self.ws = False
        self.stable = False  # the breakpoints always written the same way
        self.head_seed = 0  # how the head's breakpoints are written

    def body(self) -> bytes:
        rng = random.Random(0) if self.stable else self.rng
        hr = random.Random(self.head_seed)
        tl = [dict(t) for t in self.tools]
        if tl and hr.random() < 0.8:
            tl[-1] = mark(tl[-1], "1h" if self.bp_long else None, hr)
        system = self.system
        if isinstance(system, list) and system and hr.random() < 0.8:
            system = system[:-1] + [mark(system[-1], "1h" if self.bp_long else None, hr)]
        msgs = [dict(m) for m in self.msgs]
        # the moving breakpoints: on the last block of the last few messages
        for j in range(1, min(self.tail_bps, len(msgs)) + 1):
            m = msgs[-j]
            c = m["content"]
            if isinstance(c, str):
                c = [{"type": "text", "text": c}]
            m["content"] = c[:-1] + [mark(c[-1], None, rng)]
        top = {"model": "claude-sonnet-4-5", "messages": msgs, "system": system, "tools": tl,
               "max_tokens": 32000, "stream": True}
        obj = {k: top[k] for k in self.order if k in top}
        if "system" not in self.order and rng.random() < 0.5:
            obj["system"] = system
        return enc(obj, rng if self.ws else None)

    def mutate(self) -> None:
        rng = self.rng
        k = rng.random()
        if k < 0.55:  # a turn: one or two messages appended
            for _ in range(rng.choice([1, 1, 2])):
                self.msgs.append(message(rng, "user" if len(self.msgs) % 2 == 0 else "assistant"))
        elif k < 0.65 and len(self.msgs) > 4:  # an edit in the middle (a fold)
            i = rng.randrange(len(self.msgs) - 1)
            self.msgs[i] = message(rng, self.msgs[i]["role"])
        elif k < 0.7 and len(self.msgs) > 4:  # a truncation (a rewind)
            del self.msgs[rng.randrange(1, len(self.msgs)):]
        elif k < 0.75:  # a tool added or changed
            if self.tools and rng.random() < 0.5:
                self.tools[rng.randrange(len(self.tools))]["description"] = prose(rng, 5, 50)
            else:
                self.tools.append(tools(rng, 1)[0] | {"name": f"mcp_{rng.randrange(999)}"})
        elif k < 0.78:  # the system changes
            self.system = [{"type": "text", "text": prose(rng, 100, 600)}]
        elif k < 0.82:
            self.tail_bps = rng.randint(0, 3)
        elif k < 0.85:
            self.bp_long = not self.bp_long
        elif k < 0.87:
            self.order = rng.choice(self.ORDERS)
        elif k < 0.88:
            self.ws = not self.ws
        elif k < 0.9:
            self.head_seed += 1
        elif k < 0.92:  # a message's content switches between string and blocks
            i = rng.randrange(len(self.msgs))
            c = self.msgs[i]["content"]
            self.msgs[i] = {"role": self.msgs[i]["role"],
                            "content": [{"type": "text", "text": c}] if isinstance(c, str) else prose(rng, 5, 50)}
        # else: the same conversation again (a retry)


def broken(rng: random.Random, body: bytes) -> bytes:
    """A body today's path refuses (or reads oddly): truncated, trailing comma, tools null, a
    message that is no object, duplicate members."""
    k = rng.randrange(7)
    if k == 0:
        return body[: rng.randrange(1, len(body))]
    if k == 1:
        i = body.rfind(b"}]")
        return body[:i + 1] + b",]" + body[i + 2:] if i > 0 else body
    if k == 2:
        return body[:-1] + b',"tools":null}'
    if k == 3:
        return body.replace(b'"messages":[', b'"messages":[1,', 1)
    if k == 4:
        return body[:-1] + b',"messages":[{"role":"user","content":"dup"}]}'
    if k == 5:
        return body[:-1] + b',"system":"a later system"}'
    return body.replace(b'"messages":[', b'"messages":[],"x":{"messages":[', 1)[:-1] + b"}}"


def run_anthropic(seed: int, steps: int, n0: int) -> Pair:
    rng = random.Random(seed)
    conv = AnthConv(rng, n0)
    model = rng.choice(["claude-sonnet-4-5", "claude-haiku-4-5", "claude-3-5-haiku", ""])
    pair = Pair("anthropic", model)
    now = 0.0
    for step in range(steps):
        k = rng.random()
        if k < 0.03:
            ttl = rng.choice([None, 120.0, 250.0])
            pair.both(lambda c: c.apply(ttl=ttl))
        elif k < 0.05:
            floor = rng.choice([0, 2048, 5000])
            pair.both(lambda c: c.apply(min_tokens=floor))
        elif k < 0.06:
            pair.both(lambda c: c.apply(no_cache=True))
        elif k < 0.07:
            pair.both(lambda c: c.apply())
        elif k < 0.09:  # a rules change (another model's minimum, other lifetimes)
            rules = rng.choice([anthropic_rules("claude-haiku-4-5"), anthropic_rules(),
                                cache.replace(anthropic_rules(), ttl=200.0, ttl_long=1000.0)])
            pair.both(lambda c: setattr(c.cache, "rules", type(c.cache.rules)(**rules.__dict__)))
        conv.mutate()
        body = conv.body()
        if rng.random() < 0.04:
            body = broken(rng, body)
        now += rng.choice([1.0, 5.0, 30.0, 200.0, 299.0, 301.0, 900.0, 3601.0])
        pair.send(body, now)
    return pair


@pytest.mark.parametrize("seed", range(12))
def test_anthropic_memo_matches_recompute(seed):
    run_anthropic(seed, steps=120, n0=seed * 3)


def test_anthropic_memo_reads_only_the_suffix(monkeypatch):
    """A follow-up (one message appended, the breakpoint moved) parses a few messages, not all."""
    parsed: list[int] = []
    real = cache._cut

    def spy(*a, **k):
        got = real(*a, **k)
        parsed.append(-1 if got is None else len(got[0]))
        return got

    monkeypatch.setattr(cache, "_cut", spy)
    rng = random.Random(5)
    conv = AnthConv(rng, 200)
    conv.order, conv.stable = AnthConv.ORDERS[0], True
    pair = Pair("anthropic", "claude-sonnet-4-5")
    for i in range(10):
        conv.msgs.append(message(rng, "user" if len(conv.msgs) % 2 == 0 else "assistant"))
        pair.send(conv.body(), float(i))
    assert parsed[0] > 200 and all(0 < n <= cache._LAST + 2 for n in parsed[1:]), parsed
    assert isinstance(pair.a.cache._memo, cache._AnthMemo)


def test_anthropic_memo_after_a_mid_edit_reparses_from_a_kept_boundary(monkeypatch):
    parsed: list[int] = []
    real = cache._cut
    monkeypatch.setattr(cache, "_cut", lambda *a, **k: (lambda g: parsed.append(len(g[0])) or g)(real(*a, **k)))
    rng = random.Random(9)
    conv = AnthConv(rng, 300)
    conv.stable = True
    pair = Pair("anthropic", "claude-sonnet-4-5")
    pair.send(conv.body(), 0.0)
    conv.msgs[150] = message(rng, conv.msgs[150]["role"])
    pair.send(conv.body(), 1.0)
    assert parsed[1] <= 300 - 150 + cache._EVERY + 1


# -- OpenAI / Gemini bodies ----------------------------------------------------------------------


def chat_body(rng: random.Random, msgs: list[dict], extra: dict, lane: str, first: bool = False) -> bytes:
    key = {"gemini": "contents", "responses": "input"}.get(lane, "messages")
    obj = {**extra, "model": "gpt-5", key: msgs} if first else {"model": "gpt-5", key: msgs, **extra}
    body = msgspec.json.encode(obj)
    if rng.random() < 0.05:  # a member twice: the later one counts
        body = body[:-1] + b',"prompt_cache_retention":"24h"}'
    return body


@pytest.mark.parametrize("lane", ["chat", "responses", "gemini"])
@pytest.mark.parametrize("seed", range(4))
def test_prefix_memo_matches_recompute(lane, seed):
    rng = random.Random(seed * 31 + len(lane))
    model = {"chat": "gpt-4o", "responses": "gpt-5", "gemini": rng.choice(["gemini-2.5-flash", "gemini-2.5-pro"])}[lane]
    pair = Pair(lane, model)
    msgs = [{"role": "system", "content": prose(rng, 200, 900)}]
    extra: dict = {"tools": tools(rng, 3)}
    first = False  # the other members before the conversation
    now = 0.0
    for step in range(100):
        k = rng.random()
        if k < 0.5:
            msgs.append({"role": rng.choice(["user", "assistant"]), "content": prose(rng, 5, 400)})
        elif k < 0.6 and len(msgs) > 3:
            msgs[rng.randrange(1, len(msgs))] = {"role": "user", "content": prose(rng, 5, 100)}
        elif k < 0.65 and len(msgs) > 3:
            del msgs[rng.randrange(1, len(msgs)):]
        elif k < 0.72:
            extra["prompt_cache_retention"] = rng.choice(["24h", "in_memory", None])
        elif k < 0.76:
            extra["tools"] = tools(rng, rng.randint(0, 4))
        elif k < 0.78:
            first = not first
        elif k < 0.8:
            floor, ttl = rng.choice([0, 2048, 3000]), rng.choice([None, 100.0])
            pair.both(lambda c: c.apply(min_tokens=floor, ttl=ttl))
        elif k < 0.84 and len(msgs) > 2:  # the opening instructions grow or shrink (a developer message)
            i = rng.randrange(0, 3)
            msgs[i] = {**msgs[i], "role": rng.choice(["system", "developer", "user"])}
        elif k < 0.87:  # instructions of their own, before or after the conversation
            name = "systemInstruction" if lane == "gemini" else "instructions"
            extra[name] = rng.choice([None, prose(rng, 50, 300), {"parts": [{"text": prose(rng, 5, 50)}]}])
        body = chat_body(rng, msgs, extra, lane, first)
        if rng.random() < 0.05:
            body = broken(rng, body)
        now += rng.choice([1.0, 30.0, 299.0, 301.0, 3000.0, 90000.0])
        pair.send(body, now)


def test_prefix_memo_survives_rules_changes():
    rng = random.Random(3)
    pair = Pair("chat", "gpt-5")
    msgs = [{"role": "user", "content": prose(rng, 500, 900)}]
    for i in range(30):
        msgs.append({"role": "assistant", "content": prose(rng, 20, 200)})
        if i % 7 == 3:
            rules = cache.replace(pair.a.rules, step=rng.choice([64, 128, 256]), min_tokens=rng.choice([512, 1024]))
            pair.both(lambda c: setattr(c.cache, "rules", type(c.cache.rules)(**rules.__dict__)))
        pair.send(chat_body(rng, msgs, {}, "chat"), float(i * 60))


# -- the bench's conversations -------------------------------------------------------------------


def bench_case(lane: str, n: int):
    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    try:
        from bench_overhead import Case
    finally:
        sys.path.pop(0)
    return Case(lane, n)


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_bench_conversations(lane):
    c = bench_case(lane, 160)
    rng = random.Random(1)
    pair = Pair(lane, c.top["model"])
    msgs = list(c.msgs[:40])
    now = 0.0
    for i, m in enumerate(c.msgs[40:] + [c.new(j) for j in range(10)]):
        msgs.append(m)
        out = [dict(x) for x in msgs]
        if lane == "anthropic":  # Claude Code's moving breakpoint on the last message
            last = out[-1]
            content = last["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            last["content"] = content[:-1] + [{**content[-1], "cache_control": {"type": "ephemeral"}}]
        if i % 25 == 24:  # a fold rewrites an old message
            msgs[i // 2] = {"role": msgs[i // 2]["role"], "content": f"[folded {i}]"}
        now += rng.choice([3.0, 40.0, 400.0])
        pair.send(c.body(out), now)
    assert any(t.predicted.read for t in pair.a.turns)


# -- the captured agents' bodies -----------------------------------------------------------------


def captured() -> list[tuple[str, str, list[bytes]]]:
    sys.path.insert(0, HERE)
    try:
        import wirecases
    finally:
        sys.path.pop(0)
    out = []
    for path in wirecases.capture_files():
        by_lane: dict[str, list[bytes]] = {}
        for c in wirecases.captured_bodies(path):
            by_lane.setdefault(c.lane.name, []).append(c.raw)
        out += [(path, lane, bodies) for lane, bodies in by_lane.items()]
    return out


def grow(body: bytes, rng: random.Random, lane: str) -> bytes:
    """The captured body with a turn appended to its conversation (as the agent would send it)."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    key = {"anthropic": "messages", "chat": "messages", "responses": "input", "gemini": "contents"}.get(lane)
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        return body
    if lane == "gemini":
        item = {"role": "user", "parts": [{"text": prose(rng, 5, 200)}]}
    elif lane == "responses":
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prose(rng, 5, 200)}]}
    else:
        item = {"role": "user", "content": prose(rng, 5, 200)}
    obj[key] = obj[key] + [item]
    return msgspec.json.encode(obj)


def test_captures():
    caps = captured()
    if not caps:
        pytest.skip("no captures here (BILI_CAPTURES)")
    rng = random.Random(2)
    for path, lane, bodies in caps:
        model = cache.model_of(bodies[0])
        pair = Pair(lane, model)
        now = 0.0
        for raw in bodies:
            body = raw
            for _ in range(4):
                now += rng.choice([2.0, 100.0, 400.0])
                pair.send(body, now)
                body = grow(body, rng, lane)


# -- Clocks: one memo per clock; evicted clocks take theirs -------------------------------------


def test_clocks_pairwise_and_eviction():
    rng = random.Random(4)
    on, off = Clocks(max_sessions=3), Clocks(max_sessions=3)
    off.on_new = lambda sid, clk: setattr(clk.cache, "memo", False)
    convs = {f"s{i}": AnthConv(random.Random(i), 10) for i in range(5)}
    now = 0.0
    for step in range(150):
        sid = rng.choice(list(convs))
        convs[sid].mutate()
        body = convs[sid].body()
        now += rng.choice([1.0, 50.0, 400.0])
        for clocks in (on, off):
            clocks.sent(sid, "anthropic", body, now)
        if rng.random() < 0.8:
            read = rng.choice([None, 0, 1000])
            assert on.report(sid, read) == off.report(sid, read)
        assert on.history(sid) == off.history(sid)
        assert on.cold(sid, now + 350) == off.cold(sid, now + 350)
        for s, clk in on.by_session.items():
            assert clk.cache.entries == off.by_session[s].cache.entries
    assert len(on.by_session) <= 3


def test_clocks_memo_budget():
    """Beyond the budget, the least recently billed clocks drop their memo (and bill as before)."""
    on, off = Clocks(max_sessions=8), Clocks(max_sessions=8)
    on.MEMO_BYTES = 3 * 2 * 60_000
    off.on_new = lambda sid, clk: setattr(clk.cache, "memo", False)
    convs = {f"s{i}": AnthConv(random.Random(i), 60) for i in range(6)}
    rng = random.Random(8)
    now = 0.0
    for step in range(120):
        sid = rng.choice(list(convs))
        convs[sid].mutate()
        body = convs[sid].body()
        now += 10.0
        for clocks in (on, off):
            clocks.sent(sid, "anthropic", body, now)
            clocks.report(sid, 0)
        assert on.history(sid) == off.history(sid)
        assert on.memo_total == sum(c.memo_bytes() for c in on.by_session.values()) == sum(on.memos.values())
        assert on.memo_total <= on.MEMO_BYTES or len(on.memos) == 1
        assert next(reversed(on.memos)) == sid


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
def test_other_body_types_take_the_full_path(lane):
    rng = random.Random(6)
    pair = Pair(lane, "")
    msgs: list[dict] = []
    for i in range(6):
        msgs.append({"role": "user", "content": prose(rng, 400, 900)})
        body = msgspec.json.encode({"model": "m", "messages": msgs})
        pair.send([body, bytearray(body), body.decode()][i % 3], float(i))
