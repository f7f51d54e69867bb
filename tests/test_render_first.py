"""#11: the output side of a conversation's first turn.  render.assemble's search for the items that
hold a reminder given as an item of its own (``_holding_all``) reads the parts for those refs alone
when no ref's position is known yet (a first pass: nothing else of the turn asks for them), instead
of making every ref's position (View.pos) to look a few up.  Nothing else changes: the same items,
the same bytes out.

The function as it was is kept below as an oracle.  Proof: (1) against it over random views (refs
seen twice, refs not there, positions known or not, views that are not fold.View); (2) whole Engine
runs, once as the code is and once with the oracle patched in (tests/oracle_runs.py): first turns
and follow-ups of the bench's conversations (both lanes, several sizes and seeds), conversations of
odd texts (unicode, escapes, ``<acp`` look-alikes, empty and blank texts, tool calls and results,
thinking, images), and the agents' captured requests replayed: the same bytes out, results, flags,
copies and stored rows on every turn.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from bili_addon.kernel import render
from bili_addon.kernel.fold import PartView, View, ViewItem
from bili_addon.kernel.tags import ref_of
from bili_addon.wire import LANES

from tests.oracle_runs import run_both
from tests.test_followup_steps import Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


# ---- the oracle: the function as it was -----------------------------------------------------------

def old_holding_all(view: View, refs: dict) -> set[int]:
    """:func:`_holding` from the start."""
    items, pos = view.items, view.pos
    if len(pos) == (view.part_count() if isinstance(view, View) else sum(len(it.parts) for it in items)):
        # each ref in one part: where View found it
        found = {pos[r]: r for r in refs if r in pos}
        if all(r in items[k].refs for k, r in found.items()):
            return set(found)
    return {k for k, it in enumerate(items) for p in it.parts if p.ref in refs}


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(render, "_holding_all", old_holding_all)


# ---- (1) the function against the oracle ----------------------------------------------------------

def _random_items(rng: random.Random, n: int) -> list[ViewItem]:
    items, refs, next_ref = [], [], 1
    for k in range(n):
        parts = []
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            ref = rng.choice(refs) if refs and rng.random() < 0.05 else ref_of(next_ref)  # (a ref seen twice)
            next_ref += 1
            refs.append(ref)
            parts.append(PartView(ref, rng.choice(["user", "assistant", "tool"]), "text", "", "", "t", rng.randint(0, 50)))
        items.append(ViewItem(k + rng.choice([0, 0, 3]), parts))
    return items


@pytest.mark.parametrize("seed", range(400))
def test_holding_all_is_the_oracle_s(seed):
    rng = random.Random(seed)
    items = _random_items(rng, rng.choice([0, 1, 2, 10, 40, 150]))
    every = [p.ref for it in items for p in it.parts]
    refs = {r: "x" for r in rng.sample(every, min(len(every), rng.randint(0, 3)))}
    if rng.random() < 0.3:
        refs["m99999"] = "not there"
    mine, theirs = View(list(items)), View(list(items))
    if rng.random() < 0.5:  # positions known (a follow-up's, a fold's plan asked for them)
        mine.pos, theirs.pos
    assert render._holding_all(mine, refs) == old_holding_all(theirs, refs)
    assert mine.pos == theirs.pos  # (asked for later: the same)
    plain = SimpleNamespace(items=items, pos=View(items).pos)  # a view that is not fold.View
    assert render._holding_all(plain, refs) == old_holding_all(plain, refs)
    # and _holding's answer and what it keeps for the next view
    mine, theirs = View(list(items)), View(list(items))
    got = render._holding(mine, refs)
    with pytest.MonkeyPatch.context() as mp:
        patch_oracles(mp)
        want = render._holding(theirs, refs)
    assert got == want and mine.memo["holding"][:2] == theirs.memo["holding"][:2]


# ---- (2) whole Engine runs: as the code is, and with the oracle patched in --------------------------

def both(tmp_path, scenario) -> list:
    new, old = run_both(tmp_path, scenario, patch_oracles, Trace)
    assert len(new) == len(old) and new
    for i, (a, b) in enumerate(zip(new, old)):
        assert a == b, f"turn {i} differs"
    return new


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("n,seed", [(10, 7), (100, 7), (100, 3), (300, 11)])
def test_the_benchs_first_turns_and_follow_ups(tmp_path, lane, n, seed):
    """First turns of the bench's conversations (a reminder given as an item of its own at 100
    messages and more), a second conversation in the same engine, and follow-ups."""
    case = bench_overhead.Case(lane, n, seed)
    news = [case.new(i) for i in range(2)]  # (made once: the generator moves on)

    def scenario(make):
        t = make()
        msgs = list(case.msgs)
        for c in range(2):
            sid = f"bench-first-{c}"
            first = dict(msgs[1] if lane == "chat" else msgs[0])
            first["content"] = f"[conversation {c}] {first['content']}"
            conv = ([msgs[0], first] + msgs[2:]) if lane == "chat" else [first] + msgs[1:]
            t.send(case.body(conv), sid, LANES[lane])
            for i in range(2):
                conv = conv + [news[i]]
                t.send(case.body(conv), sid, LANES[lane])
        return t.turns

    turns = both(tmp_path, scenario)
    assert turns[0][0] is not None and turns[0][3] > 0  # rendered, tagged
    if n >= 100:
        assert any(b"[bili] " in (t[0] or b"") for t in turns)  # a reminder reached the wire


ODD_TEXTS = [
    "", " ", "\n\t ", "plain words", 'say "hi" \\ back\tslash\n\r\b\f', "café \u2028 \u2029 \U0001F600 \x01\x1f\x7f",
    '<acp tokens="12" type="text">m00007</acp>\nalready tagged', "ends with a tag <acp tokens=\"3\" type=\"text\">m00001</acp>\n",
    '<acp tokens=\\"12\\" type=\\"text\\">', '{"type":"text","text":"', "</acp>", "<acp", "\u0000nul", "x" * 3000,
]


def _odd_anthropic(rng: random.Random, n: int) -> list[dict]:
    text = lambda: rng.choice(ODD_TEXTS) + (bench_overhead.Gen(rng.randint(0, 9)).prose(20, 200) if rng.random() < 0.6 else "")
    msgs: list[dict] = [{"role": "user", "content": text() or "start"}]
    k = 0
    while len(msgs) < n:
        k += 1
        blocks: list[dict] = []
        if rng.random() < 0.3:
            blocks.append({"type": "thinking", "thinking": text(), "signature": f"sig{k}"})
        if rng.random() < 0.8:
            blocks.append({"type": "text", "text": text()})
        blocks.append({"type": "tool_use", "id": f"toolu_{k}", "name": "Read", "input": {"path": text()}})
        msgs.append({"role": "assistant", "content": blocks})
        result: list[dict] = [{"type": "tool_result", "tool_use_id": f"toolu_{k}",
                               "content": text() + "\n" + "out\n" * rng.randint(10, 400)}]
        if rng.random() < 0.15:
            result.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}})
        if rng.random() < 0.3:
            result.append({"type": "text", "text": text()})
        msgs.append({"role": "user", "content": result})
        if rng.random() < 0.15:
            msgs.append({"role": "assistant", "content": text() or "ok"})
            msgs.append({"role": "user", "content": text() or "go on"})
    return msgs[:n]


def _odd_chat(rng: random.Random, n: int) -> list[dict]:
    text = lambda: rng.choice(ODD_TEXTS) + (bench_overhead.Gen(rng.randint(0, 9)).prose(20, 200) if rng.random() < 0.6 else "")
    msgs: list[dict] = [{"role": "system", "content": "sys " + text()}, {"role": "user", "content": text() or "start"}]
    k = 0
    while len(msgs) < n:
        k += 1
        msgs.append({"role": "assistant", "content": text(), "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "Read", "arguments": json.dumps({"p": text()})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": text() + "\n" + "out\n" * rng.randint(10, 400)})
        if rng.random() < 0.2:
            msgs.append({"role": "user", "content": [{"type": "text", "text": text()}] if rng.random() < 0.3 else text()})
    return msgs[:n]


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("seed", range(4))
def test_odd_texts_first_turns(tmp_path, lane, seed):
    rng = random.Random(seed)
    msgs = (_odd_anthropic if lane == "anthropic" else _odd_chat)(rng, rng.choice([20, 120, 200]))
    top = ({"model": "claude-sonnet-4-5", "max_tokens": 1000, "system": "be brief", "tools": [
        {"name": "Read", "description": "read", "input_schema": {"type": "object"}}]} if lane == "anthropic"
        else {"model": "gpt-4.1", "tools": [{"type": "function", "function": {"name": "Read", "parameters": {}}}]})

    after = [rng.choice(ODD_TEXTS) for _ in range(2)]  # (drawn once: both runs send the same)

    def scenario(make):
        t = make()
        for w, writer in enumerate((msgspec.json.encode, lambda v: json.dumps(v).encode())):  # (compact; spaced, escaped)
            sid = f"odd-{seed}-{w}"
            t.send(writer({**top, "messages": msgs}), sid, LANES[lane])
            t.send(writer({**top, "messages": msgs + [{"role": "user", "content": "and then " + after[w]}]}), sid, LANES[lane])
        return t.turns

    both(tmp_path, scenario)


def test_the_captures_replay_as_the_oracle(monkeypatch):
    from bili_addon import replay
    from tests.test_folded_follow_up import capture_files

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    runs = []
    for old in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if old:
                patch_oracles(mp)
            out = []
            for f in files:
                report = replay.replay_file(Path(f), activate="always", materialize="now", min_compress_chars=200)
                out.append([(t.session, t.flow, t.turn, t.body, t.blocks, t.folded, t.executed) for t in report.turns])
            runs.append(out)
    assert runs[0] == runs[1]
    assert any(t[3] for run in runs[0] for t in run)  # bodies were rendered
