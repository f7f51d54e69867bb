"""#11, a conversation's first turn at 100 messages (kernel/fresh.py, wire/anthropic.py): its
work cut without changing a byte.  A text block after others (a tool result's, a thought's) is
tagged in the item's bytes with one copy of them (``str.replace`` of the first text block's head,
where ``find`` and two slices copied them twice), its blocks' scalars checked in one C-level call;
a part's tokens are its length's quarter rounded up in two integer steps, not four.  The oracles
are the functions as they were (kept below, patched in), compared with the code as it is: unit by
unit over the odd shapes and writings of tests/test_render_tags.py and random block runs, and
whole Engine runs (tests/oracle_runs.py) over the bench's conversations (first turns, forks,
follow-ups, folded follow-ups) and the captures (BILI_CAPTURES): the same bytes out, the same
results, flags, ledgers and lineage."""

from __future__ import annotations

import random
import sys
from collections import Counter
from itertools import accumulate, islice, repeat
from operator import sub
from pathlib import Path

import msgspec
import pytest

from bili_addon.kernel import fresh
from bili_addon.kernel.fold import PartView, Sums, ViewItem
from bili_addon.kernel.fresh import Rows, _numbered
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import Entry, ItemCache, ItemInfo, Resolved, Session, hash_parts
from bili_addon.store import MAX_REF, LedgerRow, SessionRow, ref_names
from bili_addon.wire import LANES, anthropic
from bili_addon.wire.anthropic import (_HEADS, _NO_ROLE, _SCALARS, _TEXT_BLOCK, _UNSET, AnthropicLane, _enc_msg,
                                       _heads, _Msg, _Text)
from bili_addon.wire.base import Body

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_first_fixed import Trace, benchs_turns, conversation
from tests.test_render_tags import ODD, TAG, _anthropic_items, _escaped, _odd_writings, _text_paths, _writings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


# -- the oracles: the functions as they were --------------------------------------------------------

def old_tag_typed_rare(raw: bytes, msg: _Msg, path: tuple, tag: bytes, text: str) -> bytes | None:
    """AnthropicLane.tag_typed's other cases: a role not seen yet, no role, a text block after
    others."""
    role, content = msg.role, msg.content
    if type(role) is str:
        if role not in _HEADS:
            if len(_HEADS) >= 64:
                return None
            _HEADS[role] = _heads(b'{"role":' + _enc_msg.encode(role) + b',"content":')
            return AnthropicLane.tag_typed(raw, msg, path, tag, text)
        head = _HEADS[role][("content",)][:-1]
    elif role is _UNSET:
        head = _NO_ROLE[("content",)][:-1]
        if path in _NO_ROLE:
            if not raw.startswith(_NO_ROLE[path]) or _enc_msg.encode(msg) != raw:
                return None
            if (content if len(path) == 1 else content[0].text) != text:  # (its encoding's head: there)
                return None
            n = len(_NO_ROLE[path])
            return raw[:n] + tag + raw[n:]
    else:
        return None
    if not (len(path) == 3 and path[0] == "content" and path[2] == "text" and type(content) is list):
        return None
    j = path[1]
    if type(j) is not int or not 0 < j < len(content) or type(content[j]) is not _Text or content[j].text != text:
        return None
    for block in content[:j]:  # their encodings hold no ``{"`` but where each starts
        if type(block) is _Text or not all(type(getattr(block, f)) in _SCALARS for f in block.__struct_fields__):
            return None
    head += b"["
    if not raw.startswith(head) or _enc_msg.encode(msg) != raw:
        return None
    at = raw.find(_TEXT_BLOCK, len(head))  # the first text block's: the j-th block
    if at < 0:
        return None
    at += len(_TEXT_BLOCK)
    return raw[:at] + tag + raw[at:]


def old_first_pass(s: Session, infos: list[ItemInfo], counter: Counter, first_index: int,
               flat: tuple | None = None) -> tuple[list[list[Resolved]], Rows, list[ViewItem], Sums] | None:
    """``(resolved, new ledger rows, view items, sums)`` of a pass whose every part is new (see
    :func:`applies`); ``sums``: what the :class:`~bili_addon.kernel.fold.View` of the items
    computes (``View(items, sums)``).  None when the refs would run past the last one (the general
    path says so).  The rows are made when they are written (:class:`Rows`): then the parts are
    hashed (state.hash_parts), numbered in ``counter``, staged in ``s.refs`` as ``_resolve``
    stages them, and the resolved parts get their ``msg_id`` and ``base``.  ``flat``: what
    ``ItemCache.first_flat`` gives of ``infos`` (the lists the item read made of their parts), else
    made here.

    Column by column: each field of every part in one comprehension (attribute reads of the
    parts' structs, specialised by the interpreter: faster than ``map(attrgetter)``), the objects
    made by ``map`` over those columns, then the per-item lists cut from the flat ones."""
    next_ref = s.row.next_ref
    if flat is not None:  # (the lists below, as ItemCache.get_many made them for these items)
        parts, cores, dirty, item_ends = flat
    else:
        parts = [p for info in infos for p in info.parts]
        cores = dirty = item_ends = None
    total = len(parts)
    if next_ref < 1 or next_ref + total - 1 > MAX_REF:
        return None
    names = ref_names(next_ref, total)  # tags.ref_of of each number, in order
    if cores is None:
        cores = [p.core for p in parts]
        dirty = [p.dirty for p in parts]
    texts = [c.text for c in cores]
    roles = [c.role for c in cores]
    ctypes = [c.ctype for c in cores]
    # identity.count_tokens (its ASCII case inlined)
    tokens = [-(-len(t) // 4) if t.isascii() else count_tokens(t) for t in texts]
    entries = list(map(Entry, names, tokens))
    flat = list(map(Resolved, cores, entries, dirty, repeat(None), repeat(None)))

    def rows() -> list[LedgerRow]:
        hash_parts(parts)
        bases = [p.h_base for p in parts]
        chashes = [p.h_chash for p in parts]
        if not counter:
            counter.update(bases)  # (C-level count)
            if len(counter) == total:  # no base twice: every msg_id is its base
                msg_ids = bases
            else:
                counter.clear()
                msg_ids = _numbered(bases, counter)
        else:
            msg_ids = _numbered(bases, counter)
        s.refs.update(zip(zip(msg_ids, chashes), entries))  # staged: forgotten again if the commit fails
        for r, msg_id, base in zip(flat, msg_ids, bases):
            r.msg_id, r.base = msg_id, base
        return list(map(LedgerRow, msg_ids, chashes, names, roles, ctypes, tokens))

    views_flat = list(map(PartView, names, roles, ctypes, [c.tool_name for c in cores],
                          [c.tool_call_id for c in cores], texts, tokens))
    if item_ends is None:
        ends = list(accumulate([len(info.parts) for info in infos], initial=0))
    else:
        ends = [0, *item_ends]
    resolved, views = [], []
    add_resolved, add_view = resolved.append, views.append
    for k, begin, end in zip(range(first_index, first_index + len(infos)), ends, islice(ends, 1, None)):
        add_resolved(flat[begin:end])
        add_view(ViewItem(k, views_flat[begin:end]))
    # what the View of these items computes from them (View.sums), from the columns
    cum = list(accumulate(tokens, initial=0))
    # (the items with parts: every item, unless one ends where the one before it does)
    filled = (list(range(len(ends))) if len(set(ends)) == len(ends) else
              list(accumulate(map(bool, map(sub, islice(ends, 1, None), ends)), initial=0)))
    sums = Sums([cum[e] for e in ends], filled, max(tokens, default=0))
    return resolved, Rows(total, rows), views, sums


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(anthropic, "_tag_typed_rare", old_tag_typed_rare)
    mp.setattr(fresh, "first_pass", old_first_pass)


# -- (1) unit by unit --------------------------------------------------------------------------------

def _tagged_both(raw: bytes, path: tuple, tag: bytes, text: str) -> tuple:
    """AnthropicLane.tag_typed of ``raw`` as the code is, then with the old _tag_typed_rare (each
    from the same roles known: the first sight of a role adds its heads)."""
    got = AnthropicLane.array_cores(b"[" + raw + b"]")
    if got is None:
        return None, None  # (not read typed: tag_typed is never asked)
    struct = got[1][0]
    known = dict(_HEADS)
    new = AnthropicLane.tag_typed(raw, struct, path, tag, text)
    _HEADS.clear()
    _HEADS.update(known)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(anthropic, "_tag_typed_rare", old_tag_typed_rare)
        old = AnthropicLane.tag_typed(raw, struct, path, tag, text)
    _HEADS.clear()
    _HEADS.update(known)
    return new, old


TAGS = [_escaped(TAG), _escaped('<acp tokens="1.2k" type="text">m99999</acp>\n'), b'x', b'{"type":"text","text":"']


def test_the_odd_shapes_and_writings_are_tagged_as_the_oracle_tags_them():
    """Every item of tests/test_render_tags.py in every writing, at each of its text paths and
    paths it has not, with the right text and another: the same bytes or None."""
    seen = 0
    for item in _anthropic_items():
        paths = _text_paths(item) + [("content", 1, "text"), ("content", 3, "text"), ("content", 0, "text")]
        for raw in _writings(item):
            for path in paths:
                for text in {*(item["content"][p[1]]["text"] for p in [path] if isinstance(item["content"], list)
                               and len(p) == 3 and p[1] < len(item["content"])
                               and isinstance(item["content"][p[1]], dict) and "text" in item["content"][p[1]]),
                             "other"}:
                    for tag in TAGS:
                        new, old = _tagged_both(raw, path, tag, text)
                        assert new == old, (raw, path, tag, text)
                        seen += new is not None and path[-1] == "text" and path[1] != 0
    for raw, path, text in _odd_writings():
        for tag in TAGS:
            new, old = _tagged_both(raw, path, tag, text)
            assert new == old, (raw, path, tag)
    assert seen  # (text blocks after others were tagged)


def _block(rnd: random.Random, text: str) -> dict:
    kind = rnd.choice(("tool_result", "tool_result", "thinking", "redacted_thinking", "image", "tool_use", "text"))
    if kind == "tool_result":
        b = {"type": "tool_result", "tool_use_id": rnd.choice(("t1", 7, None))}
        b["content"] = rnd.choice((text * rnd.randint(1, 40), None, 3, [{"type": "text", "text": text}],
                                   '{"type":"text","text":"' + text))
        if rnd.random() < 0.3:
            b["is_error"] = rnd.choice((True, False, "x"))
    elif kind == "thinking":
        b = {"type": "thinking", "thinking": text, "signature": rnd.choice(("sig", 5, None))}
    elif kind == "redacted_thinking":
        b = {"type": "redacted_thinking", "data": text}
    elif kind == "image":
        b = {"type": "image", "source": {"type": "url", "url": "u"}}
    elif kind == "tool_use":
        b = {"type": "tool_use", "id": "t1", "name": "Read", "input": rnd.choice((None, {"text": text}, "s"))}
    else:
        b = {"type": "text", "text": text}
    if rnd.random() < 0.15:
        b["cache_control"] = rnd.choice(({"type": "ephemeral"}, "x", None))
    return b


@pytest.mark.parametrize("seed", range(4))
def test_random_block_runs_are_tagged_as_the_oracle_tags_them(seed):
    """Text blocks after runs of other blocks (scalars and not, texts of their own and inside
    results, a text block's head as a string), under every role and none, in msgspec's writing
    and others: the same bytes or None."""
    rnd = random.Random(seed)
    texts = ODD + ["plain prose", "a < b", "\\", "m00001"]
    tagged = 0
    for trial in range(400):
        text = rnd.choice(texts)
        blocks = [_block(rnd, rnd.choice(texts)) for _ in range(rnd.randint(0, 4))]
        j = len(blocks)
        blocks.append({"type": "text", "text": text, **({"cache_control": {"type": "ephemeral"}}
                                                        if rnd.random() < 0.2 else {})})
        blocks += [_block(rnd, rnd.choice(texts)) for _ in range(rnd.randint(0, 2))]
        item = {"content": blocks}
        role = rnd.choice(("user", "assistant", "system", f"role-{trial % 3}", None, 7))
        if role is not None:
            item = {"role": role, "content": blocks}
        for raw in _writings(item)[:3]:
            for path, want in ((("content", j, "text"), text), (("content", j, "text"), text + "!"),
                               (("content", max(j - 1, 0), "text"), text)):
                new, old = _tagged_both(raw, path, rnd.choice(TAGS), want)
                assert new == old, (trial, raw, path)
                tagged += new is not None and j > 0
    assert tagged


def _first(raw: bytes, lane, first_pass, cut: int = 0):
    b = Body(raw, lane.conv_key)
    cache = ItemCache()
    infos = cache.get_many(lane, b.items, [], b.top[lane.conv_key], [])
    s = Session(SessionRow(id="x", agent="", lane=lane.name, created=0.0, last_seen=0.0, requests=0, messages=0,
                           next_ref=1))
    counter = Counter()
    resolved, rows, views, sums = first_pass(s, infos[cut:], counter, cut, flat=cache.first_flat(infos[cut:]))
    return ([[msgspec.structs.asdict(r) for r in rs] for rs in resolved], rows.get(), views, sums,
            [[msgspec.structs.asdict(r) for r in rs] for rs in resolved], dict(s.refs), counter)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_a_first_pass_counts_tokens_as_the_oracle(lane):
    """Texts of every length from none to past a few quarters, ASCII or not (CJK, emoji, accents),
    and the bench's conversations: the same resolved parts, rows, view items, sums and refs."""
    L = LANES[lane]
    case = bench_overhead.Case(lane, 100)
    bodies = [case.body(conversation(case, 0)), case.body(conversation(case, 1, True))]
    for extra in ("", "é", "\u4e2d\u6587", "\U0001F600", " "):
        msgs = [dict(case.new(0), content=("x" * n) + extra * (n % 3)) for n in range(0, 41)]
        bodies.append(case.body(msgs))
    for raw in bodies:
        for cut in (0, 1):
            assert _first(raw, L, fresh.first_pass, cut) == _first(raw, L, old_first_pass, cut)


# -- (2) whole Engine runs: as they are, and with the oracles patched in -------------------------------

def both(tmp_path: Path, scenario) -> None:
    same_runs(tmp_path, scenario, patch_oracles, Trace)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 25_000, 6_000])
@pytest.mark.parametrize("big", [False, True])
def test_the_benchs_first_turns_forks_and_follow_ups_are_the_oracles(tmp_path, lane, n, window, big):
    """New conversations' first turns (one while another waits for its answer), a fork of one (its
    history under a new id: adopted), follow-ups, the same body again under a new id; windows that
    make the reminder urgent and cut tool outputs."""
    both(tmp_path, benchs_turns(lane, n, window, big, again=True, side=False))


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old


def test_the_captures_first_turns_are_the_oracles(tmp_path):
    """Every captured request as a new conversation's first turn (its own session), on the engine."""
    from tests.oracle_runs import capture_turns

    turns = capture_turns()

    def scenario(make):
        t = make()
        for i, (lane, _headers, raw) in enumerate(turns):
            t.send(raw, f"cap{i}", LANES[lane])
        return [t.turns, t.stored()]

    both(tmp_path, scenario)
