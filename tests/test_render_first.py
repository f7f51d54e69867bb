"""#11: the output side of a conversation's first turn.  render.assemble's search for the items that
hold a reminder given as an item of its own (``_holding_all``) reads the parts for those refs alone
when no ref's position is known yet (a first pass: nothing else of the turn asks for them), instead
of making every ref's position (View.pos) to look a few up; render's prose pass (``_render_prose``)
reads an item of two parts (an assistant's prose and its tool call) without a list of the parts
with a path.  Nothing else changes: the same items, the same bytes out.

The functions as they were are kept below as oracles.  Proof: (1) the search against its oracle
over random views (refs seen twice, refs not there, positions known or not, views that are not
fold.View); the prose pass against its oracle over random items (one, two or more parts, each
with a path or not, dirty, untaggable, nudged); (2) whole Engine
runs, once as the code is and once with the oracle patched in (tests/oracle_runs.py): first turns
and follow-ups of the bench's conversations (both lanes, several sizes and seeds), conversations of
odd texts (unicode, escapes, ``<acp`` look-alikes, empty and blank texts, tool calls and results,
thinking, images), and the agents' captured requests replayed: the same bytes out, results, flags,
copies and stored rows on every turn.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from itertools import accumulate, islice
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from msgspec import Struct

from bili_addon.kernel import render, tags
from bili_addon.kernel.fold import PartView, View, ViewItem
from bili_addon.kernel.tags import ref_of
from bili_addon.wire import LANES
from bili_addon.wire.base import TEXT, encode

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


def old_render_prose(lane, infos, start: int, q: int, resolved: list,
                     rendered: list[bytes], changed_cum: list[int], tagged_cum: list[int], active: bool,
                     nudges: dict[str, str], objs: list | None) -> None:
    """:func:`render_items` where the only edits are the parts' own (tags, truncations): only
    the parts with a text path are looked at, one by one; the rest of the items go as they came.
    An item whose one edit is its tag (the commonest: a conversation's prose) is tagged by its
    lane in its bytes (``tag_typed``) when the pass decoded it into the lane's typed struct."""
    end = len(resolved)
    outs = [info.raw for info in infos[start + q:start + end]]  # the items' bytes (infos were looked up by them)
    changed = [0] * (end - q)
    tagged = [0] * (end - q)
    last = len(infos) - 1 - start  # (the last item: an assistant's text there is a prefill)
    tag_typed = getattr(lane, "tag_typed", None) if objs is not None else None
    format_tokens, formatted = tags.format_tokens, tags._FORMATTED  # (its cache: a count seen before, one lookup)
    for k in range(q, end):
        parts = resolved[k]
        if len(parts) == 1:  # (the commonest item: one part)
            r = parts[0]
            core = r.core
            if not core.path:
                continue
            edits = None
        else:
            with_path = [r for r in parts if r.core.path]
            if not with_path:
                continue
            if len(with_path) > 1:  # more parts of this item to edit
                edits, count = render._item_edits(parts, active, k != last, nudges)
            else:
                r = with_path[0]
                core = r.core
                edits = None
        if edits is None:  # the one part of the item with a path: ``r``
            text = core.text
            # (taggable(core, k != last), inline: it runs for every such part)
            if (active and core.ctype == TEXT and text and (core.role == "user" or (core.role == "assistant" and k != last))
                    and not text.isspace()):
                entry = r.entry
                ref = entry.ref
                tokens = formatted.get(entry.tokens) or format_tokens(entry.tokens)
                if tag_typed is not None and not r.dirty and not (nudges and nudges.get(ref)):
                    obj = objs[start + k]
                    if isinstance(obj, Struct):
                        # the tag's JSON-escaped bytes (a token count's and an alphanumeric
                        # ref's characters escape to themselves)
                        tag = (f'<acp tokens=\\"{tokens}\\" type=\\"text\\">{ref}</acp>\\n'.encode() if ref.isalnum()
                               else encode(f'<acp tokens="{tokens}" type="{TEXT}">{ref}</acp>\n')[1:-1])
                        out = tag_typed(outs[k - q], obj, core.path, tag, text)
                        if out is not None:
                            outs[k - q] = out
                            changed[k - q] = tagged[k - q] = 1
                            continue
                edits, count = [render._tag_edit(core, tokens, ref, nudges.get(ref) if nudges else None)], 1
            elif r.dirty:
                edits, count = [(core.path, text)], 0
            else:
                continue
        if edits:
            src = outs[k - q]
            out = outs[k - q] = render._patch(lane, src, objs[start + k] if objs is not None else None, edits)
            changed[k - q] = out != src
            tagged[k - q] = count
    rendered += outs
    changed_cum += islice(accumulate(changed, initial=changed_cum[-1]), 1, None)
    tagged_cum += islice(accumulate(tagged, initial=tagged_cum[-1]), 1, None)


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(render, "_holding_all", old_holding_all)
    mp.setattr(render, "_render_prose", old_render_prose)


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


def _random_item(rng: random.Random, lane: str) -> dict:
    text = lambda: rng.choice(ODD_TEXTS) if rng.random() < 0.5 else f"words {rng.randint(0, 99)}"
    role = rng.choice(["user", "assistant", "user", "system"] if lane == "chat" else ["user", "assistant"])
    if lane == "chat":
        if rng.random() < 0.2:
            return {"role": "tool", "tool_call_id": "c1", "content": text()}
        item: dict = {"role": role, "content": rng.choice([text(), text(), None, [{"type": "text", "text": text()}]])}
        if role == "assistant" and rng.random() < 0.5:
            item["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]
        return item
    if rng.random() < 0.3:
        return {"role": role, "content": text()}
    blocks = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.45:
            blocks.append({"type": "text", "text": text()})
        elif kind < 0.6:
            blocks.append({"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": text()}})
        elif kind < 0.75:
            blocks.append({"type": "tool_result", "tool_use_id": "t1", "content": text()})
        elif kind < 0.9:
            blocks.append({"type": "thinking", "thinking": text(), "signature": "s"})
        else:
            blocks.append({"type": "image", "source": {"type": "url", "url": "u"}})
    return {"role": role, "content": blocks}


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
@pytest.mark.parametrize("seed", range(150))
def test_render_prose_is_the_oracle_s(lane_name, seed):
    """The prose pass over random items (each item's parts with a path or not, cleaned, not
    taggable, nudged, the last one a prefill), the items read typed, as dicts or not at all."""
    from bili_addon.kernel.state import Entry, ItemInfo, Resolved

    rng = random.Random(seed)
    lane = LANES[lane_name]
    items = [_random_item(rng, lane_name) for _ in range(rng.randint(1, 14))]
    writer = rng.choice([msgspec.json.encode, lambda v: json.dumps(v).encode()])
    raws = [writer(it) for it in items]
    typed = lane.array_cores(b"[" + b",".join(raws) + b"]") if rng.random() < 0.8 else None
    n = 0
    infos, resolved = [], []
    nudges = {}
    for k, (item, raw) in enumerate(zip(items, raws)):
        cores = typed[0][k] if typed is not None else lane.item_cores(json.loads(raw))
        parts = []
        for core in cores:
            n += 1
            core = msgspec.structs.replace(core)
            dirty = rng.random() < 0.1
            if dirty:
                core.text = core.text.strip() + " (cleaned)"
            if rng.random() < 0.05:
                nudges[ref_of(n)] = rng.choice(["see above", ""])
            parts.append(Resolved(core, Entry(ref_of(n) if rng.random() < 0.95 else f"x-{n}", rng.randint(0, 20000)),
                                  dirty, "", ""))
        infos.append(ItemInfo(raw, False, []))
        resolved.append(parts)
    start = rng.choice([0, 0, min(1, len(items) - 1)])
    q = rng.randint(0, len(items) - start) if rng.random() < 0.3 else 0
    active = rng.random() < 0.9

    as_dicts = rng.random() < 0.5

    def objs_now():  # (a copy each run: patching changes them in place)
        if typed is not None:
            return copy.deepcopy(typed[1])
        return [json.loads(r) for r in raws] if as_dicts else None

    runs = []
    for fn in (render._render_prose, old_render_prose):
        rendered, changed_cum, tagged_cum = [b"head"] * start, [0] * (start + 1), [0] * (start + 1)
        fn(lane, infos, start, q, resolved[start:], rendered, changed_cum, tagged_cum, active, nudges, objs_now())
        runs.append((rendered, changed_cum, tagged_cum))
    assert runs[0] == runs[1]


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
    from tests import oracle_runs

    new, old = oracle_runs.replays_both(patch_oracles, "now")
    assert new == old
    assert any(t[3] for run in new for t in run)  # bodies were rendered
