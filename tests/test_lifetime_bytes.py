"""The cache lifetimes are set on the parts the engine holds (kernel/lifetime.py ``apply_parts``),
not on the finished body parsed again: the bytes that leave are the ones the earlier path made.

The reference is that earlier path, kept here: the turn computed with no lifetime set, the body
encoded, then :func:`lifetime.apply` on those bytes (the decision itself is the same code in both).
Every lifetime choice, every lane of the captured agents, folds made at once and held folds, bodies
with and without the agent's whitespace, cold moments where the decision runs.
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

from bili_addon.kernel import lifetime, pressure
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire.base import Body
from bili_addon.wire import LANES
from tests.test_fold import agent_answers_unknown, body, conversation, refs_in, roundtrip_call
from tests.test_lifetime import EPH, _step, cc_body
from tests.wirecases import CAPTURES, capture_files, captured_bodies

ANTH = LANES["anthropic"]
CHOICES = (None, lifetime.FIVE, lifetime.HEAD, lifetime.HOUR)
# Claude Code on its default host: a breakpoint of another shape on system[2]
CAPTURED_CC = Path(CAPTURES) / "claude-code" / "claude_fwd" / "009_POST_v1_messages.json"
_upgrade_lifetime = pressure.upgrade_lifetime


def _before(host, s, b, items, raw, changed, folding=None):
    """The earlier path: the decision as now, then the finished body parsed again for the lifetimes."""
    sent = b.encode(items) if changed else raw
    with mock.patch.object(lifetime, "apply_parts", lambda *a: (False, False)), \
            mock.patch.object(lifetime, "upgrade", lambda body: None):
        _upgrade_lifetime(host, s, b, items, raw, changed, folding)  # the decision only
    return lifetime.apply(sent, (s.flags.get(lifetime.FLAG) or {}).get("choice"))


def _forcing(fn, choice):
    def run(host, s, *args):
        if choice is not None:  # as a decision at an earlier cold moment left it (kept in memory only)
            s.flags[lifetime.FLAG] = {"choice": choice}
        return fn(host, s, *args)
    return run


class Twins:
    """Two engines fed the same requests: the reference path and this build's."""

    def __init__(self, tmp_path, choice, **kw):
        self.choice = choice
        self.engines = [Engine(Store(tmp_path / name), **kw) for name in ("before", "now")]
        self.t = 1_000.0
        for e in self.engines:
            e.now = lambda: self.t
        self.sent = 0

    @contextmanager
    def _path(self, k):
        with mock.patch.object(pressure, "upgrade_lifetime", _forcing(_before if k == 0 else _upgrade_lifetime,
                                                                      self.choice)):
            yield

    def process(self, raw, lane, headers, gap: float = 5.0, report: bool = True):
        self.t += gap
        outs = []
        for k, e in enumerate(self.engines):
            with self._path(k):
                res = e.process(raw, lane, headers, render=True)
            outs.append(res.body)
            if report and res.session:  # the answer came; the provider read what the model said
                turns = e.clocks.stats(res.session).get("turns") or []
                if turns:
                    e.clocks.report(res.session, read=turns[-1]["predicted_read"])
        assert outs[0] == outs[1], f"request {self.sent} ({lane.name}, choice {self.choice}) differs"
        self.sent += 1
        return outs[1] if outs[1] is not None else raw

    def call(self, sid, tool, args, cid):
        for e in self.engines:
            roundtrip_call(e, sid, tool, args, cid)

    def close(self):
        for e in self.engines:
            e.store.close()


@pytest.mark.parametrize("choice", CHOICES)
def test_captured_agents_every_lane(tmp_path, choice):
    files = capture_files()
    if not files:
        pytest.skip("no captures (set BILI_CAPTURES)")
    tw = Twins(tmp_path, choice, activate="always")
    lanes = set()
    try:
        for path in files:
            for c in captured_bodies(path):
                tw.process(c.raw, c.lane, c.headers)
                lanes.add(c.lane.name)
    finally:
        tw.close()
    assert {"anthropic", "chat", "responses"} <= lanes and tw.sent > 50


def _ask(tw, sid, msgs, payload, first, last, cid):
    refs = refs_in(payload)
    start = next(r for r, x in refs.items() if x.startswith(first))
    end = next(r for r, x in refs.items() if x.startswith(last))
    args = {"content": [{"startId": start, "endId": end, "topic": f"{first}..{last}",
                         "summary": f"{first} to {last}: modules read; mod3.py defines load_config()."}]}
    tw.call(sid, "compress", args, cid)
    return agent_answers_unknown(msgs, "compress", args, cid)


@pytest.mark.parametrize("materialize", ["now", "cost"])
@pytest.mark.parametrize("shape", ["claude-code", "plain"])
@pytest.mark.parametrize("choice", CHOICES)
def test_folding_sessions_with_pauses(tmp_path, choice, shape, materialize):
    """Folds (landing at once or held until a cold moment), the head breakpoint on the summary,
    pauses of 10 minutes and over an hour (cold moments: the decision runs on both paths), the same
    history sent twice; Claude Code's shape (breakpoints in system and on the last message, the
    agent's whitespace) and a plain one (no breakpoint of the agent's: nothing to set)."""
    make = cc_body if shape == "claude-code" else body
    sid = f"bytes-{shape}"
    h = {"x-claude-code-session-id": sid}
    tw = Twins(tmp_path, choice, activate="always", fold_cfg=FoldConfig(min_compress_chars=2000),
               materialize=materialize)
    try:
        msgs = conversation(8)
        out = json.loads(tw.process(make(msgs), ANTH, h, gap=1.0))
        msgs = _ask(tw, sid, msgs, out, "Step 1:", "Step 4:", "toolu_c1")
        tw.process(make(msgs), ANTH, h)
        for k in range(9, 44):
            msgs = _step(msgs, k)
            gap = {20: 600.0, 28: 600.0, 33: 4_000.0, 38: 600.0}.get(k, 5.0)
            out = json.loads(tw.process(make(msgs), ANTH, h, gap=gap))
            if k == 24:
                msgs = _ask(tw, sid, msgs, out, "Step 5:", "Step 12:", "toolu_c2")
            if k == 35:
                msgs = _ask(tw, sid, msgs, out, "Step 13:", "Step 20:", "toolu_c3")
        tw.process(make(msgs), ANTH, h)  # the same history again
        tw.process(make(msgs), ANTH, h, gap=700.0)
        sent = tw.process(make(msgs), ANTH, h)
    finally:
        tw.close()
    if shape == "claude-code" and choice in (lifetime.HEAD, lifetime.HOUR):
        assert b'"ttl":"1h"' in sent  # the lifetimes were set (the comparison compared something)
    if choice in (None, lifetime.FIVE) or shape == "plain":
        assert b'"ttl"' not in sent or choice is None


def test_an_agent_that_asks_for_lifetimes_itself_and_a_top_level_breakpoint(tmp_path):
    """Bodies the agent already gives lifetimes stay as they are; a top-level ``cache_control``
    (automatic caching) gets its hour with the rest under "1h", and is left alone under "head"."""
    top = json.loads(cc_body(conversation(3)))
    own = json.dumps(top).replace('"ephemeral"}', '"ephemeral", "ttl": "1h"}', 1).encode()
    auto = json.dumps({**top, "cache_control": {"type": "ephemeral"}}).encode()
    for choice in CHOICES:
        tw = Twins(tmp_path / str(choice), choice, activate="always")
        try:
            for n, raw in enumerate((own, auto, auto)):
                sent = tw.process(raw, ANTH, {"x-claude-code-session-id": f"own-{n}"})
                if choice == lifetime.HOUR and raw is auto:
                    assert json.loads(sent)["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
                if raw is own:
                    assert sent.count(b'"ttl"') == 1
        finally:
            tw.close()


def _random_body(r: random.Random) -> dict:
    """An Anthropic body with breakpoints, summaries and look-alikes in random places."""
    def block(k: int) -> dict:
        text = r.choice(["plain words", "[Compressed conversation section b%d (m00001-m00009)]\nsummary" % k,
                         'quoting "cache_control": {"type": "ephemeral"} and "ttl" in prose'])
        b = {"type": "text", "text": text}
        if r.random() < 0.35:
            b["cache_control"] = {"type": "ephemeral"}
        if r.random() < 0.01:  # the agent asks for a lifetime itself
            b["cache_control"] = {"type": "ephemeral", "ttl": r.choice(["5m", "1h"])}
        if r.random() < 0.04:  # a breakpoint of another shape (Claude Code's on its default host)
            b["cache_control"] = {"type": "ephemeral", "scope": "global"}
        if r.random() < 0.01:  # a tool call's argument of that name
            b = {"type": "tool_use", "id": "toolu_x", "name": "cache", "input": {"ttl": 60}}
        return b

    msgs = [{"role": ("user", "assistant")[k % 2], "content": [block(k) for _ in range(r.randint(1, 3))]}
            for k in range(r.randint(1, 9))]
    doc = {"model": "claude-x", "max_tokens": 10, "messages": msgs}
    if r.random() < 0.7:
        doc["system"] = [block(0) for _ in range(r.randint(1, 2))]
    if r.random() < 0.5:
        doc["tools"] = [{"name": "t", "input_schema": {"type": "object"},
                         **({"cache_control": {"type": "ephemeral"}} if r.random() < 0.5 else {})}]
    if r.random() < 0.1:
        doc["cache_control"] = {"type": "ephemeral"}
    if r.random() < 0.03:
        doc["ttl"] = "a top-level key of that name"
    if r.random() < 0.05:
        doc["tools"] = [{"name": "t", "input_schema": {"properties": {"ttl": {"type": "string"}}}}]
    return doc


def test_apply_parts_is_apply_on_the_encoded_body():
    """The function itself, on bodies the engine did not touch: the parts re-encoded with their
    lifetimes are the bytes :func:`lifetime.apply` makes of the whole."""
    r = random.Random(7)
    seen = set()
    for _ in range(600):
        doc = _random_body(r)
        for raw in (json.dumps(doc, separators=(",", ":")).encode(), json.dumps(doc, indent=r.choice([None, 1])).encode()):
            b = Body(raw, "messages")
            items = [bytes(i) for i in b.items]
            whole = lifetime.upgrade_head(b.encode(items))
            b = Body(raw, "messages")
            items = [bytes(i) for i in b.items]
            anything, in_items = lifetime.apply_parts(b.top, "messages", items)
            assert anything == (whole is not None), raw
            if anything:
                assert b.encode(items) == whole, raw
                seen.add((in_items, whole.count(b'"ttl":"1h"') < raw.count(b'"cache_control"')))
    assert len(seen) == 4  # some bodies had every breakpoint upgraded, some a head only, some only system/tools


@pytest.mark.parametrize("choice", CHOICES)
def test_a_body_the_engine_leaves_as_it_came(tmp_path, choice):
    """The agent's bytes (its whitespace) with the lifetimes set: what :func:`lifetime.apply` makes
    of them (the engine hands ``pressure.upgrade_lifetime`` a body it did not change)."""
    e = Engine(Store(tmp_path / "d"), activate="always")
    h = {"x-claude-code-session-id": "same"}
    doc = json.loads(cc_body(conversation(4)))
    doc["messages"][3]["content"].append({"type": "text", "text": "[Compressed conversation section b1 ...]",
                                          "cache_control": {"type": "ephemeral"}})
    plain = json.loads(cc_body(conversation(4)))  # no summary: under "head" only the system's breakpoints
    try:
        for raw in (json.dumps(doc).encode(), json.dumps(doc, indent=2).encode(), json.dumps(plain, indent=1).encode()):
            e.process(raw, ANTH, h, render=True)
            s = e.sessions[h["x-claude-code-session-id"]]
            s.flags[lifetime.FLAG] = {"choice": choice}
            b = Body(raw, "messages")
            items = [bytes(i) for i in b.items]
            assert pressure.upgrade_lifetime(e, s, b, items, raw, False) == lifetime.apply(raw, choice)
    finally:
        e.store.close()


def _lifetimes(raw: bytes) -> list[str]:
    """Each breakpoint's lifetime in cache order (tools, system, messages)."""
    doc = json.loads(raw)
    marks = [t.get("cache_control") for t in doc.get("tools") or []]
    marks += [b.get("cache_control") for b in doc.get("system") or [] if isinstance(b, dict)]
    marks += [b.get("cache_control") for m in doc["messages"] if isinstance(m["content"], list) for b in m["content"]]
    return [c.get("ttl", "5m") for c in marks if c]


def test_a_breakpoint_of_another_shape_keeps_every_one_after_it_at_5_minutes():
    """Claude Code on its default host marks ``system[2]`` ``{"type":"ephemeral","scope":"global"}``,
    which bili does not rewrite: a 1-hour breakpoint after it would be one after a 5-minute one, a
    body the provider refuses (it was sent on every turn of a session that chose an hour).  The
    hours stop at it, in every way a body gets them; the plain ones before it get theirs."""
    scope = {"type": "ephemeral", "scope": "global"}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "[Compressed conversation section b1 (m1-m9)]\nsum",
                                          "cache_control": EPH}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": EPH}]}]
    for tools_mark, expect in ((None, ["5m", "5m", "5m", "5m"]), (EPH, ["1h", "5m", "5m", "5m", "5m"])):
        doc = {"model": "claude-x", "max_tokens": 10,
               "tools": [{"name": "t", "input_schema": {"type": "object"},
                          **({"cache_control": tools_mark} if tools_mark else {})}],
               "system": [{"type": "text", "text": "a", "cache_control": scope},
                          {"type": "text", "text": "b", "cache_control": EPH}],
               "messages": msgs}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        for out in (lifetime.upgrade(raw), lifetime.upgrade_head(raw)):
            assert _lifetimes(out or raw) == expect
        b = Body(raw, "messages")
        items = [bytes(i) for i in b.items]
        anything, in_items = lifetime.apply_parts(b.top, "messages", items)
        assert _lifetimes(b.encode(items)) == expect and anything == (tools_mark is not None) and not in_items
    # the captured body itself: nothing before its first breakpoint, so nothing to upgrade
    cap = json.load(open(CAPTURED_CC)) if CAPTURED_CC.exists() else None
    if cap is not None:
        raw = json.dumps(cap["body"], separators=(",", ":")).encode()
        assert scope in [b.get("cache_control") for b in cap["body"]["system"]]
        assert lifetime.upgrade(raw) is None and lifetime.upgrade_head(raw) is None


def test_the_hours_are_always_a_prefix_of_the_breakpoints():
    """The provider's ordering rule on random bodies (breakpoints of both shapes, summaries, the
    agent's own lifetimes): whatever bili upgrades, no 1-hour breakpoint follows a 5-minute one."""
    r = random.Random(11)
    odd = 0
    for _ in range(800):
        doc = _random_body(r)
        raw = json.dumps(doc, separators=(",", ":")).encode()
        odd += b'"scope"' in raw
        for out in (lifetime.upgrade(raw), lifetime.upgrade_head(raw)):
            if out is not None:
                got = _lifetimes(out)
                assert got == sorted(got, key=lambda t: t != "1h"), raw
    assert odd > 20
