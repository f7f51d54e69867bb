"""#11: a conversation's first pass tags its prose in the items' bytes (the lanes' ``tag_typed``,
kernel/render.py ``_render_prose``) and lays the conversation out visiting only the items where
something happens (render.assemble): each gives exactly what the general path gives, byte for byte
(wire.base.patch_many on the item's bytes; the item-by-item layout)."""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from bili_addon.kernel import fold, render
from bili_addon.kernel.fold import PartView, View, ViewItem
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from bili_addon.wire.anthropic import AnthropicLane
from bili_addon.wire.base import patch_many
from bili_addon.wire.chat import ChatLane

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

TAG = '<acp tokens="12" type="text">m00007</acp>\n'
ODD = [  # texts that are hard to put a tag before by bytes
    'say "hi" \\ back\tslash\n\r\b\f',
    "café \u2028 \u2029 \U0001F600 \x01\x1f\x7f",
    TAG + "a tag of ours already at the start",
    "a tag of ours at the end " + TAG,
    TAG,  # the whole text is the tag's own text
    '<acp tokens=\\"12\\" type=\\"text\\">',  # the tag's escaped bytes as text
    "{\"type\":\"text\",\"text\":\"",  # a text block's head as text
    "x",
]


def _anthropic_items() -> list[dict]:
    items = []
    for text in ODD:
        items += [
            {"role": "user", "content": text},
            {"content": text},  # no role
            {"content": [{"type": "text", "text": text}]},
            {"content": [{"type": "tool_use", "id": "t3", "name": "X", "input": None}, {"type": "text", "text": text}]},
            {"role": 7, "content": text},  # a role that is no string
            {"role": "assistant", "content": [{"type": "text", "text": text},
                                              {"type": "tool_use", "id": "t1", "name": "Read", "input": {"text": text}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": text, "signature": "s"},
                                              {"type": "redacted_thinking", "data": text},
                                              {"type": "text", "text": text}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": text, "is_error": True},
                                         {"type": "text", "text": text}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": text}]},  # (a text block inside)
                                         {"type": "text", "text": text}]},
            {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "second " + text}]},
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}},
                                         {"type": "text", "text": text}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "Bash", "input": None},
                                              {"type": "text", "text": text}]},
        ]
    return items


def _writings(item) -> list[bytes]:
    """The item as msgspec writes it, and as other JSON writers do (spaces, ASCII escapes)."""
    return [msgspec.json.encode(item), json.dumps(item).encode(), json.dumps(item, ensure_ascii=False).encode(),
            json.dumps(item, separators=(",", ":")).encode(), json.dumps(item, indent=1).encode()]


def _text_paths(item) -> list[tuple]:
    content = item.get("content")
    if isinstance(content, str):
        return [("content",)]
    return [("content", j, "text") for j, b in enumerate(content or []) if b.get("type") == "text"]


def _escaped(tag: str) -> bytes:
    return msgspec.json.encode(tag)[1:-1]


def _text_at(item, path) -> str:
    return item["content"] if len(path) == 1 else item["content"][path[1]]["text"]


def test_anthropic_tag_typed_is_patch_many_or_nothing():
    """A tag put into an item's bytes where its text starts is what patch_many makes of the
    bytes with the tagged text; an item not proven msgspec's own, a text that is not the one
    at the path, a path it cannot place: nothing."""
    lane = LANES["anthropic"]
    made = set()
    for item in _anthropic_items():
        for path in _text_paths(item):
            text = _text_at(item, path)
            for raw in _writings(item):
                struct = lane.array_cores(b"[" + raw + b"]")[1][0]
                out = lane.tag_typed(raw, struct, path, _escaped(TAG), text)
                if out is not None:
                    made.add((len(path), path[1] if len(path) > 1 else 0, raw == msgspec.json.encode(item)))
                    assert out == patch_many(raw, [(path, TAG + text)])
                    assert raw == msgspec.json.encode(item)  # (only msgspec's own bytes)
                assert lane.tag_typed(raw, struct, path, _escaped(TAG), text + " cleaned") is None
    # the string content, a first text block and text blocks after others, all placed
    assert {(1, 0, True), (3, 0, True), (3, 1, True), (3, 2, True)} <= made
    raw = msgspec.json.encode(_anthropic_items()[3])
    struct = lane.array_cores(b"[" + raw + b"]")[1][0]
    for path in (("content", 1, "text"), ("content",), ("content", 5, "text"), ("role",), ("content", 0, "cache_control")):
        assert lane.tag_typed(raw, struct, path, _escaped(TAG), "x") is None


def test_chat_tag_typed_is_patch_many_or_nothing():
    lane = LANES["chat"]
    made = 0
    items = [m for text in ODD for m in (
        {"role": "user", "content": text}, {"role": "system", "content": text},
        {"role": "assistant", "content": text, "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": text}}]},
        {"role": "tool", "tool_call_id": "c", "content": text}, {"content": text, "role": "user"})]
    for item in items:
        for raw in _writings(item):
            struct = lane.array_cores(b"[" + raw + b"]")[1][0]
            out = lane.tag_typed(raw, struct, ("content",), _escaped(TAG), item["content"])
            if out is not None:
                made += 1
                assert out == patch_many(raw, [(("content",), TAG + item["content"])])
                assert raw == msgspec.json.encode(item) and next(iter(item)) == "role"
            assert lane.tag_typed(raw, struct, ("content",), _escaped(TAG), "other") is None
            assert lane.tag_typed(raw, struct, ("content", 0, "text"), _escaped(TAG), item["content"]) is None
    assert made >= 3 * len(ODD)


def _tricky(lane: str, n: int, seed: int, end_with_prose: bool) -> list[bytes]:
    """A bench conversation with odd prose here and there, some items written by other JSON
    writers, several text blocks in some items, our tags (and the [bili] marker) echoed in
    assistant prose (cleaned at ingress: the wire text is not the core's)."""
    case = bench_overhead.Case(lane, n, seed=seed)
    rnd = random.Random(seed)
    msgs = copy.deepcopy(case.msgs)
    for m in msgs:
        content = m.get("content")
        if isinstance(content, str) and rnd.random() < 0.3:
            m["content"] = rnd.choice(ODD) + content + rnd.choice(ODD)
        elif isinstance(content, list) and rnd.random() < 0.3:
            for b in content:
                if b.get("type") == "text" and rnd.random() < 0.5:
                    b["text"] = rnd.choice(ODD) + b["text"]
            if rnd.random() < 0.3:
                content.insert(rnd.choice((0, len(content))), {"type": "text", "text": rnd.choice(ODD) + " more"})
        if m.get("role") == "assistant" and rnd.random() < 0.1:
            if isinstance(m.get("content"), str):
                m["content"] = "[bili] folded\n" + m["content"]
            elif isinstance(m.get("content"), list) and m["content"][0].get("type") == "text":
                m["content"][0]["text"] = TAG + m["content"][0]["text"]
    if end_with_prose:
        msgs.append(case.new(0))

    def body(ms):
        items = [msgspec.json.encode(m) if rnd.random() < 0.9 else json.dumps(m).encode() for m in ms]
        top = msgspec.json.encode({k: v for k, v in case.top.items() if k != "messages"})
        return top[:-1] + b',"messages":[' + b",".join(items) + b"]}"
    return [body(msgs), body(msgs + [case.new(1)])]


def _run(tmp_path, name: str, lane: str, bodies: list[bytes]) -> list:
    e = Engine(Store(tmp_path / name))
    e.now = lambda: 1000.0
    outs = []
    for raw in bodies:
        r = e.process(raw, LANES[lane], {"x-acp-session": "rt"}, render=True)
        outs.append((r.body, r.refs_new, r.refs_known, r.tagged, r.notes))
    outs.append(e.store.ledger("rt"))
    e.store.close()
    return outs


@pytest.mark.parametrize("lane,end_with_prose", [("anthropic", False), ("anthropic", True), ("chat", True)])
def test_tags_in_the_bytes_are_the_general_path_s(tmp_path, monkeypatch, lane, end_with_prose):
    """A first turn's tags put by the lanes into the items' bytes, and its layout by marks, give
    the bytes the general path gives (each item patched from its decoded struct or its bytes,
    every item visited), with a reminder at the end (in the last prose, or an item of its own)."""
    bodies = _tricky(lane, 1000, 5, end_with_prose)
    fast = _run(tmp_path, "fast", lane, bodies)
    monkeypatch.setattr(AnthropicLane, "tag_typed", staticmethod(lambda *a: None), raising=False)
    monkeypatch.setattr(ChatLane, "tag_typed", staticmethod(lambda *a: None), raising=False)
    monkeypatch.setattr(render, "_holding", lambda view, refs: {
        k for k, it in enumerate(view.items) for p in it.parts if p.ref in refs})
    general = _run(tmp_path, "general", lane, bodies)
    assert fast == general
    assert fast[0][0] is not None and fast[0][3] > 300 and b"[bili] " in fast[0][0]  # tagged, and a reminder


# -- assemble ------------------------------------------------------------------------------------

def _assemble_reference(lane, s, items_out, start, view, plan, after, pre):
    """render.assemble's layout as it was written first: every view item visited in turn."""
    nudge_at = {k for k, it in enumerate(view.items) for p in it.parts if p.ref in after} if after else set()
    if not plan.drop and not plan.inserts and not nudge_at and not pre:
        return False, items_out
    out = items_out[:start]
    ours = {}
    for k, it in enumerate(view.items):
        if k not in plan.drop:  # (since: the repair's inserts only before an item that stays)
            out.extend(pre.get(it.index, ()))
        for b in plan.inserts.get(k, ()):
            ours[len(out)] = b.text()
            out.append(lane.summary_item(ours[len(out)]))
        if k in plan.drop:
            continue
        item, notes = items_out[it.index], []
        if k in nudge_at:
            for text in (after[r] for r in it.refs if r in after):
                merged = lane.note_in_item(item, text)
                if merged is None:
                    ours[len(out) + 1 + len(notes)] = text
                    notes.append(lane.summary_item(text))
                else:
                    item = merged
        out.append(item)
        out.extend(notes)
    out.extend(items_out[start + len(view.items):])
    return True, _alternate_reference(lane, out, start, ours) if ours else out


def _alternate_reference(lane, out, start, ours):
    """render.alternate as it was written first: every item visited in turn."""
    res = out[:start]
    for i in range(start, len(out)):
        text = ours.get(i)
        if text is not None:
            joined = lane.join_user(res[-1], text, before=False) if len(res) > start else None
            if joined is not None:
                res[-1] = joined
                continue
            if i + 1 < len(out) and i + 1 not in ours:
                joined = lane.join_user(out[i + 1], text, before=True)
                if joined is not None:
                    out[i + 1] = joined
                    continue
        res.append(out[i])
    return res


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_assemble_by_marks_is_the_item_by_item_layout(monkeypatch, lane_name):
    lane = LANES[lane_name]
    rnd = random.Random(3)
    for trial in range(300):
        start, n = rnd.randint(0, 2), rnd.randint(0, 12)
        raws = [msgspec.json.encode({"role": rnd.choice(("user", "assistant")),
                                     "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "r"}]
                                     if lane_name == "anthropic" and rnd.random() < 0.5 else f"text {i}"})
                for i in range(start + n + rnd.randint(0, 1))]
        refs = [[f"m{10 * i + j:05d}" for j in range(rnd.randint(0, 2))] for i in range(n)]
        if rnd.random() < 0.2 and n > 1 and refs[0]:
            refs[-1].append(refs[0][0])  # a ref in two items: the parts' own scan
        view = View([ViewItem(start + k, [PartView(r, "user", "text", "", "", "t", 3) for r in refs[k]])
                     for k in range(n)])
        every = [r for rs in refs for r in rs]
        after = {r: f"nudge {r}" for r in rnd.sample(every, min(len(every), rnd.randint(0, 2)))}
        block = SimpleNamespace(active=True, text=lambda: "summary")
        plan = fold.Plan({k for k in range(n) if rnd.random() < 0.2},
                         {k: [block] * rnd.randint(1, 2) for k in range(n + 1) if rnd.random() < 0.15}, [])
        pre = {i: [b'{"role":"user","content":"pre"}'] for i in range(start + n + 1) if rnd.random() < 0.1}
        monkeypatch.setattr(fold, "plan", lambda *a, **k: plan)
        s = SimpleNamespace(blocks=[], calls={}, flags={"nudges": {r: {"text": t, "how": "item"} for r, t in after.items()}},
                            unfolded_tokens=0, sent_tokens=0)
        folds = SimpleNamespace(wire_blocks=lambda s: ([block], []), spent_calls=lambda *a, **k: set(),
                                fold_cfg=fold.FoldConfig())
        items_out = list(raws)
        result = SimpleNamespace(folded_items=0)
        changed = render.assemble(folds, s, lane, items_out, start, view, result, set(), pre)
        want_changed, want = _assemble_reference(lane, s, list(raws), start, view, plan, after, pre)
        assert (changed, items_out) == (want_changed, want), trial


def test_token_counts_escape_to_themselves():
    """render puts a tag's bytes together without escaping them: a token count is written with
    characters JSON does not escape (digits, a sign, a point, K), as an alphanumeric ref is."""
    from bili_addon.kernel import tags
    for t in [*range(-20, 12000, 7), 99_949, 99_950, 10**6, 10**9]:
        text = tags.format_tokens(t)
        assert set(text) <= set("0123456789-.K"), text
        tag = f'<acp tokens="{text}" type="text">m00001</acp>\n'
        assert msgspec.json.encode(tag)[1:-1] == f'<acp tokens=\\"{text}\\" type=\\"text\\">m00001</acp>\\n'.encode()


def _odd_writings() -> list[tuple[bytes, tuple, str]]:
    """Items whose bytes are not msgspec's own in ways a check of the text's place alone would
    miss: a duplicate key (the decode keeps the last), escapes msgspec does not write (``\\u0041``,
    ``\\/``), spaces, a content array whose first block is not text."""
    return [
        (b'{"role":"user","content":"first","content":"second"}', ("content",), "second"),
        (b'{"role":"user","content":"second","content":"second"}', ("content",), "second"),
        (b'{"role":"user","content":"\\u0041BC"}', ("content",), "ABC"),
        (b'{"role":"user","content":"a\\/b"}', ("content",), "a/b"),
        (b'{"role":"user","content":"a\\u000ab"}', ("content",), "a\nb"),
        (b'{"role":"user", "content":"abc"}', ("content",), "abc"),
        (b'{"role":"user","content":"abc" }', ("content",), "abc"),
        (b'{"role":"user","content":[{"type":"text","text":"abc"} ]}', ("content", 0, "text"), "abc"),
        (b'{"role":"user","content":[{"type":"text","text":"x"}],"content":[{"type":"text","text":"abc"}]}',
         ("content", 0, "text"), "abc"),
        (b'{"role":"user","content":[{"type":"text","text":"abc","text":"abc"}]}', ("content", 0, "text"), "abc"),
        (b'{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}},'
         b'{"type":"text","text":"abc"}]}', ("content", 1, "text"), "abc"),
        (b'{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}},'
         b'{"type":"text","text":"abc"}]}', ("content", 0, "text"), "abc"),
        (b'{"role":"user","content":[{"type":"tool_use","id":"t","name":"n","input":{"text":"abc"}},'
         b'{"type":"text","text":"abc"}]}', ("content", 1, "text"), "abc"),
        (b'{"content":"abc","role":"user"}', ("content",), "abc"),
    ]


def test_tag_typed_odd_bytes_are_the_general_path_s_or_nothing():
    """Bytes that are not msgspec's own encoding of the item: the lanes' tag_typed leaves them
    (None) or gives exactly what patch_typed / the general path gives."""
    for lane_name in ("anthropic", "chat"):
        lane = LANES[lane_name]
        for raw, path, text in _odd_writings():
            got = lane.array_cores(b"[" + raw + b"]")
            if got is None:
                continue  # (not read typed: tag_typed is never asked)
            struct = got[1][0]
            out = lane.tag_typed(raw, struct, path, _escaped(TAG), text)
            general = render._patch(lane, raw, None, [(path, TAG + text)])
            typed = lane.patch_typed(raw, copy.deepcopy(struct), [(path, TAG + text)])
            if out is not None:
                assert out == general == typed, (lane_name, raw)
            if raw != msgspec.json.encode(msgspec.json.decode(raw)):
                assert out is None, (lane_name, raw)  # not canonical: the general path's alone


@pytest.mark.parametrize("lane_name", ["anthropic", "chat"])
def test_alternate_by_marks_is_the_item_by_item_join(lane_name):
    """render.alternate looks only at the items the addon added: the same joins and layout as
    visiting every item (added items in a row, at the start, at the end, before and after a user
    turn that takes them)."""
    lane = LANES[lane_name]
    rnd = random.Random(11)
    for trial in range(500):
        start, n = rnd.randint(0, 2), rnd.randint(0, 10)
        out = [msgspec.json.encode({"role": rnd.choice(("user", "assistant")), "content": f"text {i}"})
               for i in range(start + n)]
        ours = {i: f"added {i}" for i in range(start + n + 2) if rnd.random() < 0.3}
        for i in ours:
            if i < len(out):
                out[i] = lane.summary_item(ours[i])
        if rnd.random() < 0.1 and start:
            ours[rnd.randrange(start)] = "before the conversation"
        want = _alternate_reference(lane, list(out), start, ours)
        assert render.alternate(lane, list(out), start, ours) == want, trial
