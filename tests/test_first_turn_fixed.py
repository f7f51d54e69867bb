"""#11: the fixed work of a conversation's first turn takes shortcuts (the reminder from the first
pass's token figures, no usage read for a session the store has no row of, a new session loaded
from its one missing row, tool names read by a typed decoder, a View's positions made when read,
the first part fingerprinted once).  Each gives exactly what the general path gives; each test
below fails if a shortcut changes a decision."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

from bili_addon.kernel import fresh, pressure
from bili_addon.kernel.fold import PartView, View, ViewItem
from bili_addon.kernel.lineage import fingerprint
from bili_addon.kernel.reconcile import canonical_text, normalize_text
from bili_addon.kernel.state import ItemCache, Session
from bili_addon.kernel.turn import Engine
from bili_addon.store import SessionRow, Store
from bili_addon.wire import LANES, base
from bili_addon.wire.base import Body, Core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

ANTHROPIC = LANES["anthropic"]


def bodies(lane: str, n: int, big: bool = False) -> list[bytes]:
    case = bench_overhead.Case(lane, n, seed=11)
    msgs = list(case.msgs)
    if big:  # tool outputs an emergency truncation cuts
        for m in msgs:
            if m["role"] == "tool":
                m["content"] = m["content"] * 4
            elif isinstance(m["content"], list):
                for b in m["content"]:
                    if b.get("type") == "tool_result":
                        b["content"] = b["content"] * 4
    msgs.insert(3, {"role": "user", "content": []})  # an item without parts
    return [case.body(msgs), case.body(msgs + [case.new(0)])]


def run(store, lane: str, raws: list[bytes], window: int = 0) -> tuple[list, dict]:
    eng = Engine(store, window=window)
    eng.lineage.defer = True
    outs = []
    for raw in raws:
        r = eng.process(raw, LANES[lane], {"x-acp-session": "t"}, render=True)
        outs.append((r.body, r.refs_new, r.refs_known, r.tagged))
        eng.lineage.flush()
    row = eng.store.session("t")
    return outs, (json.loads(row.flags), row.requests, row.next_ref, eng.store.ledger("t"))


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("window", [0, 60_000], ids=["nudge", "truncate"])
def test_the_first_turns_reminder_is_the_general_paths(tmp_path, monkeypatch, lane, window):
    """The reminder (its decision, text and ref), the truncations and the bytes of a first turn
    from the first pass's figures equal the general path's (its View computes them from the items;
    the usage is read)."""
    raws = bodies(lane, 160, big=bool(window))
    fast = run(Store(tmp_path / "fast"), lane, raws, window)
    flags = fast[1][0]
    assert "nudges" in flags  # (the case this is about)
    assert ("truncated" in flags) == bool(window)
    monkeypatch.setattr(fresh, "applies", lambda *a: False)  # the general path: _resolve, View(items)
    real = pressure.apply
    monkeypatch.setattr(pressure, "apply", lambda host, s, view, resolved, new=False, snoozed=(): real(host, s, view, resolved, False, snoozed))
    general = run(Store(tmp_path / "general"), lane, raws, window)
    assert fast == general


def test_a_view_from_the_first_pass_is_the_view_of_its_items():
    """``View(items, sums)`` (the first pass's figures) reads as ``View(items)``: the same sums,
    positions, user turns; also with bases given twice, items without parts and non-ASCII text."""
    lane = ANTHROPIC
    case = bench_overhead.Case("anthropic", 90, seed=4)
    msgs = list(case.msgs)
    msgs[5] = dict(msgs[1])  # the same message twice: its base twice (numbered instances)
    msgs[7] = {"role": "user", "content": "Grüße «naïve» 漢字 café " * 20}
    msgs.insert(9, {"role": "assistant", "content": []})
    body = Body(case.body(msgs), lane.conv_key)
    infos = ItemCache().get_many(lane, body.items, [])
    for counter in (Counter(), Counter({infos[5].parts[0].base: 1})):
        s = Session(SessionRow("v", "", "", 0, 0, 0, 0, 1))
        resolved, rows, items, sums = fresh.first_pass(s, infos, counter, 0)
        rows = rows.get()
        fast, general = View(items, sums), View(items)
        assert fast.sums() == general.sums() and sums.peak == max(p.tokens for it in items for p in it.parts)
        assert fast.pos == general.pos and list(fast.pos) == list(general.pos)
        assert (fast.first_user(), fast.last_user()) == (general.first_user(), general.last_user())
    assert len({r.msg_id for r in rows}) == len(rows)


def _pos_reference(items: list[ViewItem]) -> dict[str, int]:
    pos: dict[str, int] = {}
    for k, it in enumerate(items):
        for p in it.parts:
            pos.setdefault(p.ref, k)
    return pos


def test_a_views_figures_are_its_items():
    rnd = random.Random(3)
    for _ in range(200):
        items = []
        for k in range(rnd.randint(0, 25)):
            parts = [PartView(f"m{rnd.randint(1, 40):05d}", rnd.choice(["user", "assistant", "tool"]),
                              rnd.choice(["text", "tool-result", "tool-call"]), "", "", "x", rnd.randint(0, 3000))
                     for _ in range(rnd.choice([0, 1, 1, 2, 3]))]
            items.append(ViewItem(k, parts))
        view = View(items)
        assert view.pos == _pos_reference(items) and list(view.pos) == list(_pos_reference(items))
        tokens, filled, peak = view.sums()
        for k in range(len(items) + 1):
            assert tokens[k] == sum(p.tokens for it in items[:k] for p in it.parts)
            assert filled[k] == sum(1 for it in items[:k] if it.parts)
        assert peak == max((p.tokens for it in items for p in it.parts), default=0)
        users = [k for k, it in enumerate(items) if it.user_turn]
        assert view.first_user() == (users[0] if users else None)
        assert view.last_user() == (users[-1] if users else None)


def test_a_stored_session_reads_its_usage_and_a_new_one_does_not(backend):
    """A session the store has a row of (here: from another process, so not cached) reads the
    usage its last answer reported: the reminder says so (the context is nearly full).  A session
    the store has no row of reads nothing, and decides as if it had read that nothing."""
    raws = bodies("anthropic", 60)
    store = backend()
    first = Engine(store)
    reads: list[str] = []
    orig = first.reported_usage
    first.reported_usage = lambda s: reads.append(s.row.id) or orig(s)
    first.process(raws[0], ANTHROPIC, {"x-acp-session": "u"}, render=True)
    assert reads == []  # new: nothing recorded, nothing read
    flags = json.loads(store.session("u").flags)
    assert "nearly full" not in json.dumps(flags)
    store.record_usage("u", "anthropic", (190_000, 0, 0, 100))

    later = Engine(backend())  # another process: the session is stored, not cached
    reads2: list[str] = []
    orig2 = later.reported_usage
    later.reported_usage = lambda s: reads2.append(s.row.id) or orig2(s)
    later.process(raws[1], ANTHROPIC, {"x-acp-session": "u"}, render=True)
    assert reads2 == ["u"]
    nudges = json.loads(later.store.session("u").flags)["nudges"]
    assert any("nearly full" in n["text"] for n in nudges.values())

    # the same engine, a turn of a session it holds (stored since): read too
    first.process(raws[1], ANTHROPIC, {"x-acp-session": "u"}, render=True)
    assert reads == ["u"]


def test_a_new_session_loads_from_one_read(tmp_path):
    """SQLite: a session the store has no row of is one statement (no snapshot); a stored one
    is read whole, as before."""
    store = Store(tmp_path)
    sent: list[str] = []
    store.db.set_trace_callback(sent.append)
    assert store.session_state("n") == (None, [], [], [], None)
    assert len(sent) == 1 and sent[0].startswith("SELECT")
    eng = Engine(store)
    eng.process(bodies("anthropic", 30)[0], ANTHROPIC, {"x-acp-session": "n"}, render=True)
    row, ledger, blocks, calls, copy = store.session_state("n")
    assert row is not None and row.requests == 1 and len(ledger) == eng.sessions["n"].row.next_ref - 1
    fresh_eng = Engine(Store(tmp_path))
    s = fresh_eng.session("n")
    assert not s.unstored and s.refs == eng.sessions["n"].refs and s.flags == eng.sessions["n"].flags


_TOOLS_CASES = [  # JSON text: a key given twice is the last one, as a dict reads it
    '[]',
    '[{"name": "a", "description": "d", "input_schema": {"type": "object"}}, {"name": "b"}]',
    '[{"name": 3}, {"name": null}, {"x": 1}, {"name": "ok", "name": "no"}]',
    '[{"name": "a", "name": "b"}, {"name": "c", "name": 4}]',
    '[1, {"name": "a"}]',
    '["s", null, [], {"name": "z"}]',
    '[{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}, {"type": "function"}]',
    '[{"type": "function", "function": {"name": 5}}, {"function": null}, {"function": "x"}]',
    '[{"function": {"name": "a", "name": "b"}}, {"function": {"name": "c"}, "name": "top"}]',
    '[{"function": {"name": "a"}, "function": {"name": "b"}}, {"function": [1]}]',
]


@pytest.mark.parametrize("lane", ["anthropic", "chat"])
@pytest.mark.parametrize("k", range(len(_TOOLS_CASES)))
def test_tool_names_read_as_the_general_reader_does(lane, k):
    general = {
        "anthropic": lambda t: t.get("name") if isinstance(t, dict) and isinstance(t.get("name"), str) else None,
        "chat": lambda t: (t.get("function").get("name") if isinstance(t, dict) and isinstance(t.get("function"), dict)
                           and isinstance(t.get("function").get("name"), str) else None),
    }[lane]
    tools = _TOOLS_CASES[k]
    for raw in (b'{"model":"m","tools":' + tools.encode() + b',"messages":[]}',
                b'{"model": "m", "tools": ' + tools.replace(", ", ",\n  ").encode() + b', "messages": []}'):
        body = Body(raw, "messages")
        assert LANES[lane].tool_names(body) == base.tool_names(body.top.get("tools"), general)
    for raw in (b'{"model":"m","messages":[]}', b'{"tools":{"name":"a"},"messages":[]}', b'{"tools":null,"messages":[]}'):
        body = Body(raw, "messages")
        assert LANES[lane].tool_names(body) is None


def test_canonical_text_parses_what_can_be_json_only():
    for text in ("[1, 2]", "  {\"b\": 1, \"a\": [1,2]}\n\t ", "[1,\n 2]\r\n", "{}", "[]"):
        assert canonical_text(text) == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    for text in ("[Image #1] look at this", "[run 7] Fix the  parser.\n\n", "{not json}", "[1, 2] and more",
                 "{\"a\": 1} trailing", "[1, 2]\u2028", "[", "{"):
        assert canonical_text(text) == normalize_text(text)


def test_the_first_part_is_fingerprinted_once_for_the_fork_check(tmp_path, monkeypatch):
    """head() and the fork check that follows share the first part's fingerprint (the same core);
    a fork is still found (its parent's first part has the same fingerprint)."""
    from bili_addon.kernel import lineage as lineage_mod

    case = bench_overhead.Case("anthropic", 40, seed=2)
    eng = Engine(Store(tmp_path))
    eng.process(case.body(case.msgs), ANTHROPIC, {"x-acp-session": "parent"}, render=True)
    calls: list[Core] = []
    monkeypatch.setattr(lineage_mod, "fingerprint", lambda core: calls.append(core) or fingerprint(core))
    eng.items.forget()
    eng.lineage.defer = True  # (its record fingerprinted after the answer, not counted here)
    res = eng.process(case.body(case.msgs), ANTHROPIC, {"x-acp-session": "child"}, render=True)
    assert any("a fork of parent" in n for n in res.notes)
    # at most once (the identical history compares by content hash; the parent's opening is an equal
    # core: its fingerprint is known already)
    assert len(calls) <= 1
    assert eng.sessions["child"].refs.keys() >= eng.sessions["parent"].refs.keys()
