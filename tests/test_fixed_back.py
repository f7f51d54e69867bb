"""#11, the back half of a turn (after the items are rendered): its fixed costs cut without changing a
byte.  bili's tools are frozen (wire.frozen.freeze: a tool that cannot change has its JSON written once),
so the injection's memo key reads that JSON, the same bytes object turn after turn, not an encoding of
the tools made each turn; Body.encode finds the array's end from the joined body's length.

The oracles are the code as it was (kept below, patched in: the tools as plain dicts, the memo key
encoded, Body.encode summing every item's length), compared with the code as it is by whole Engine
runs (tests/oracle_runs.py) over the bench's conversations on the three lanes (first turns, forks,
follow-ups, reminders, truncations, folded follow-ups, folds of every kind) and the captures
(BILI_CAPTURES): the same bytes out, the same results, the same stored rows."""

from __future__ import annotations

import copy
import json
import pickle
import random
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import prompts, turn
from bili_addon.wire import LANES, anthropic, base, chat, responses
from bili_addon.wire.base import Body, encode
from bili_addon.wire.frozen import Frozen, FrozenList, freeze

from tests import test_fixed_remind as fr
from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_first_fixed import Trace, benchs_turns
from tests.test_folded_follow_up import folds_of_every_kind

bench_overhead = fr.bench_overhead
PLAIN_TOOLS = copy.deepcopy(list(prompts.TOOLS))


# -- the oracles: the code as it was -----------------------------------------------------------------

def old_encode(self, items):
    if items is None or not self.array:
        return base._enc.encode(self.top)
    pieces: list = []
    add = pieces.append
    sep = b"{"
    at = end = 0
    written = base._KEY_BYTES
    for k, v in self.top.items():
        add(sep)
        sep = b","
        kb = written.get(k)
        add(kb if kb is not None else base._enc.encode(k) + b":")
        if k == self.key:
            at = sum(map(len, pieces))
            n = len(items)
            if n:
                array = [b","] * (2 * n + 1)
                array[0], array[-1] = b"[", b"]"
                array[1::2] = items
                pieces += array
                end = at + sum(map(len, items)) + n + 1
            else:
                add(b"[]")
                end = at + 2
        else:
            add(v)
    add(b"}" if pieces else b"{}")
    joined = b"".join(pieces)
    self.top[self.key] = msgspec.Raw(memoryview(joined)[at:end])
    return joined


def old_memo_tools(memo, body, tools, names, run):
    if not tools or type(names) is not list:
        return run()
    raw = body.top.get("tools")
    if type(raw) is not msgspec.Raw and type(raw) is not bytes:
        return run()
    try:
        key = (encode(tools), raw)
    except (TypeError, ValueError):
        return run()
    return base._replay_or_run(memo, key, names, body, None, 0, run, False, False)


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(Body, "encode", old_encode)
    mp.setattr(turn, "TOOLS", tuple(copy.deepcopy(PLAIN_TOOLS)))  # (plain dicts: what turn.py injected)
    for lane in (anthropic, chat, responses):
        mp.setattr(lane, "memo_tools", old_memo_tools)


def _clear_memos() -> None:
    for lane in (anthropic, chat, responses):
        lane._TOOLS.clear()
        lane._PROMPT.clear()
        lane._NAMES.clear()


def both(tmp_path: Path, scenario, trace=Trace) -> None:
    def fresh(make):  # (each run from empty memos: both run the injection, then replay it)
        _clear_memos()
        return scenario(make)

    same_runs(tmp_path, fresh, patch_oracles, trace)


# -- whole Engine runs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 25_000, 6_000])
@pytest.mark.parametrize("big", [False, True])
def test_the_benchs_turns_are_the_oracles(tmp_path, lane, n, window, big):
    both(tmp_path, benchs_turns(lane, n, window, big))


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_the_benchs_turns_written_behind_are_the_oracles(tmp_path, lane):
    both(tmp_path, benchs_turns(lane, 100, 25_000, True), fr.Behind)


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("window", [0, 12_000])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, "now"))


def test_the_captures_replay_as_the_oracles():
    new, old = oracle_runs.replays_both(patch_oracles, "now", before=_clear_memos)
    assert new == old


# -- the parts on their own -----------------------------------------------------------------------------

def _bodies() -> list:
    """Pairs of equal Bodies: the bench's (split from the start, and read from an earlier body's layout,
    base.Splits) on the three lanes, and the captures'."""
    out = []
    for lane in ("anthropic", "chat", "responses"):
        key = LANES[lane].conv_key
        for n in (0, 1, 12, 100):
            case = bench_overhead.Case(lane, n)
            raw = case.body(case.msgs)
            out.append((lambda raw=raw, key=key: Body(raw, key)))
            splits = base.Splits()
            splits.body(raw, key, "m")
            later = case.body([*case.msgs, case.new(0)])
            out.append((lambda later=later, key=key, splits=splits: splits.body(later, key, "m")))
    from wirecases import capture_files, captured_bodies
    for f in capture_files():
        for c in captured_bodies(f):
            key = getattr(c.lane, "conv_key", "messages")
            out.append((lambda raw=c.raw, key=key: Body(raw, key)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_body_encode_is_the_oracles(seed):
    """The same bytes, and the same array left in the body, for items kept, changed, added, dropped."""
    rng = random.Random(seed)
    for made in _bodies():
        try:
            a, b = made(), made()
        except base.CodecError:
            continue
        assert a.top.keys() == b.top.keys()
        items = [bytes(i) for i in a.items]
        if items and rng.random() < 0.5:
            items[rng.randrange(len(items))] = b'{"role":"user","content":"x\\u00e9"}'
        if rng.random() < 0.3:
            items.append(b'{"role":"user","content":"new"}')
        if items and rng.random() < 0.2:
            del items[rng.randrange(len(items)):]
        for got in (items, None, []):
            assert a.encode(got) == old_encode(b, got)
            assert bytes(a.top[a.key]) == bytes(b.top[b.key]) if a.key in a.top else a.key not in b.top
            assert list(a.top) == list(b.top)


def test_the_tools_are_frozen_and_encode_as_plain():
    for t in prompts.TOOLS:
        assert type(t) is Frozen and t.json == encode(t) == encode(copy.deepcopy(t))
        with pytest.raises(TypeError):
            t["name"] = "x"
        with pytest.raises(TypeError):
            t["parameters"]["properties"]["extra"] = {}
        with pytest.raises(TypeError):
            t.update(name="x")
        with pytest.raises(TypeError):
            t["parameters"].setdefault("extra", 1)
        with pytest.raises(TypeError):
            t.pop("name")
        with pytest.raises(TypeError):
            del t["name"]
    req = prompts.TOOLS[0]["parameters"]["required"]
    assert type(req) is FrozenList
    for change in (lambda: req.append("x"), lambda: req.__setitem__(0, "x"), lambda: req.sort(),
                   lambda: req.extend(["x"]), lambda: req.__iadd__(["x"]), lambda: req.clear()):
        with pytest.raises(TypeError):
            change()
    plain = copy.deepcopy(list(prompts.TOOLS))
    assert plain == PLAIN_TOOLS == list(prompts.TOOLS)
    assert json.loads(json.dumps(list(prompts.TOOLS))) == plain
    assert encode(plain) == encode(list(prompts.TOOLS)) == base._tools_json(list(prompts.TOOLS))
    for copied in (plain[0], copy.copy(prompts.TOOLS[0]), pickle.loads(pickle.dumps(prompts.TOOLS[0]))):
        assert type(copied) is dict
        copied["name"] = "x"  # (a copy changes)
    assert prompts.TOOLS[0]["name"] == "compress"
    assert freeze(PLAIN_TOOLS) == PLAIN_TOOLS
    with pytest.raises(TypeError):
        freeze({"a": object()})
    with pytest.raises(TypeError):
        Frozen({"a": 1})  # (only freeze makes one: its values frozen, its JSON written)


def test_tools_json_is_encode():
    """Every list of tools: the encoding of them as they are now, frozen or not, changed or not."""
    frozen = list(prompts.TOOLS)
    plain = copy.deepcopy(frozen)
    for tools in (frozen, plain, frozen[:2], frozen[::-1], [frozen[0], plain[1]], frozen, plain[:1], frozen):
        assert base._tools_json(tools) == encode(tools)
    assert base._tools_json(frozen) is base._tools_json(list(prompts.TOOLS))  # (the same object again)
    plain[0]["description"] = "changed"
    assert base._tools_json(plain) == encode(plain)
    plain[1]["parameters"]["properties"]["limit"] = {"minimum": True}
    assert base._tools_json(plain) == encode(plain)
