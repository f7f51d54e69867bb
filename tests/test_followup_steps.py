"""The steps a follow-up turn pays whatever its size were made to look at its new items only, without
changing a single decision, byte or stored row: the coverage check of a steady turn (no covered part
missing: nothing for reconcile to claim), the canonical copy (its refs, items and ids extended from
the previous view's), the shared head of two passes (one pass in C), the agent's compaction marker
at the head (found once for the head the views share), the newest user turn (the previous view's,
when the new items hold none), the items holding a reminder, and the summaries' token counts.

The functions as they were are kept below as oracles.  Proof: (1) the new functions against them
over random views and view chains (shared, dropped, rebuilt equal, changed in place), random blocks,
claims, truncations and copies; (2) whole Engine runs, once as they are and once with the oracles
patched in, over the bench's folded follow-ups, folds of every kind (reminders as a suffix and as
an item, truncations, held folds), churn (re-minted ids, re-serialisation, a truncated oldest slice,
a collapse and its recovery, a folded message said again) and the agents' compactions: the same
bytes out, results, flags, blocks, copies and stored rows on every turn.
"""

from __future__ import annotations

import copy as copymod
import json
import random
from typing import Any

import pytest

from bili_addon.kernel import compaction, coverage, fold, nudge, reconcile, render
from bili_addon.kernel.compaction import HEAD_ITEMS, MAX_HEAD, SHAPES, CLAUDE_CODE
from bili_addon.kernel.fold import Block, FoldConfig, PartView, View, ViewItem
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.reconcile import Copy
from bili_addon.kernel.tags import ref_of
from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from bili_addon.wire.base import TEXT, TOOL_RESULT

import tests.churn as C
from tests import compactions as CP
from tests.oracle_runs import run_both
from tests.test_folded_follow_up import bench_overhead, folds_of_every_kind, random_view


# ---- oracles: the functions as they were ----------------------------------------------------------

def old_common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def old_check(store, sessions, s, view, resolved, result):
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS:
        return None
    sid = s.row.id
    if s.copy.parked:  # (the pause's end and the way back are decisions of their own, not the oracle's)
        coverage._unpark(sessions, s, view, lambda refs: store.originals(sid, refs), resolved)
    fresh = {r.entry.ref for ps in resolved for r in ps if r.incs > 1}
    out = reconcile.reconcile(view, s.blocks, s.copy, lambda refs: store.originals(sid, refs), fresh)
    if out.claims:
        by_block: dict[str, list[str]] = {}
        owner = fold.coverage(s.blocks)
        for old, new in out.claims.items():
            b = owner[old]
            if b.claimed.get(old) != new:
                b.claimed[old] = new
                by_block.setdefault(b.id, []).append(new)
        sessions.save_blocks(s, [b for b in s.blocks if b.id in by_block])
    was_latched = s.copy.latched
    reconcile.verdict(out, view, s.blocks, s.copy, lambda refs: store.originals(sid, refs))
    if out.drifted:
        coverage.count(sessions, s, out)
    s.copy.paused = s.copy.paused + 1 if s.copy.latched else 0
    if s.copy.paused >= coverage.RETIRE_AFTER:
        if out.verdict == "drift":
            s.copy.latched, s.copy.paused, s.copy.witness = False, 0, []
        else:
            out = coverage._start_over(sessions, s, view, out.missing)
    s.copy.branched = s.copy.branched + 1 if out.verdict == "rewound" else 0
    if s.copy.branched >= coverage.ADOPT_AFTER:
        out = coverage._start_over(sessions, s, view, out.missing, adopt=True)
    result.drift = out.verdict
    if out.verdict == "rewound":
        s.copy.branch = [r.msg_id for ps in resolved for r in ps]
    if out.drifted or was_latched:
        sessions.save_copy(s)
    return out


def old_roll_copy(sessions, s, view, resolved, drift) -> None:
    if len(view.items) < reconcile.SIDE_REQUEST_MAX_ITEMS or s.copy.latched:
        return
    if drift is not None and drift.unmatched and drift.verdict != "truncated":
        return
    copy = s.copy
    parts = [p for it in view.items for p in it.parts]
    refs = [p.ref for p in parts]
    same = min(old_common_prefix(refs, copy.refs), len(copy.fps))
    copy.fps = copy.fps[:same] + [reconcile.fingerprint(p) for p in parts[same:]]
    copy.refs = refs
    copy.items = [k for k, it in enumerate(view.items) for _p in it.parts]
    copy.ids = [r.msg_id for ps in resolved for r in ps]
    sessions.save_copy(s)


def old_marker_in_head(lane: str, view) -> tuple[str, PartView, int] | None:
    shapes = [s for s in SHAPES if lane in s.lanes]
    assistant_seen = False
    for k, it in enumerate(view.items):
        if k >= MAX_HEAD or (k >= HEAD_ITEMS and assistant_seen):
            break
        for p in it.parts:
            for s in shapes:
                if s.match(p, k):
                    return s.agent, p, k
        assistant_seen = assistant_seen or any(p.role == "assistant" for p in it.parts)
    return None


def old_holding(view, refs: dict) -> set[int]:
    items, pos = view.items, view.pos
    if len(pos) == sum(len(it.parts) for it in items):
        found = {pos[r]: r for r in refs if r in pos}
        if all(r in items[k].refs for k, r in found.items()):
            return set(found)
    return {k for k, it in enumerate(items) for p in it.parts if p.ref in refs}


def old_last_user(self) -> int | None:
    if self._last_user is fold._UNKNOWN:
        items = self.items
        self._last_user = next((k for k in range(len(items) - 1, -1, -1) if fold._user_turn(items[k].parts)), None)
    return self._last_user


def old_coverage(blocks) -> dict[str, Block]:
    out: dict[str, Block] = {}
    for b in blocks:
        if b.active:
            for r in b.coverage:
                out.setdefault(r, b)
    return out


def old_runs(drop) -> dict[int, int]:
    runs: dict[int, int] = {}
    head = prev = -2
    for k in sorted(drop):
        if k != prev + 1:
            head = k
        runs[head] = k + 1
        prev = k
    return runs


def old_plan(view, blocks, hidden=frozenset(), snoozed=frozenset(), protected=()):
    p = real_plan(view, blocks, hidden, snoozed, protected)
    return fold.Plan(p.drop, p.inserts, p.rendered)  # (its runs made again by assemble)


real_plan = fold.plan


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    for mod in (fold, nudge, reconcile):
        mp.setattr(mod, "coverage", old_coverage)
    mp.setattr(fold, "_runs", old_runs)
    mp.setattr(fold, "plan", old_plan)
    mp.setattr(coverage, "common_prefix", old_common_prefix)
    mp.setattr(coverage, "check", old_check)
    mp.setattr(coverage, "roll_copy", old_roll_copy)
    mp.setattr(compaction, "marker_in_head", old_marker_in_head)
    mp.setattr(render, "_holding", old_holding)
    mp.setattr(View, "last_user", old_last_user)
    mp.setattr(Block, "summary_tokens", property(lambda b: count_tokens(b.summary)))
    mp.setattr(fold, "tokens_of", count_tokens)


# ---- (1) the functions against the oracles --------------------------------------------------------

def test_common_prefix_is_the_oracles():
    rng = random.Random(5)
    for _ in range(3000):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 8))]
        b = a[:rng.randint(0, len(a))] + [rng.choice("abcd") for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.5:
            a, b = b, a
        assert coverage.common_prefix(a, b) == old_common_prefix(a, b)
    raw = [b"x" * 10, b"y"]
    assert coverage.common_prefix(raw, [b"x" * 10, b"z"]) == 1
    assert coverage.common_prefix([1.0, float("nan")], [1, float("nan")]) == 1  # (== as the loop compares)


def chain_of_views(rng: random.Random, size: int):
    """Views of one conversation, each made after the one before (``prev``), as it grows, goes back,
    has its last item made again (equal, not the same object), and the list the previous view was
    made of changed in place: (view, the items it holds then)."""
    base, blocks, _hidden = random_view(rng, size)
    others, _b, _h = random_view(random.Random(rng.random()), 20)
    items, spare = list(base.items), list(others.items)
    v = None
    for _ in range(rng.randint(2, 8)):
        v = View(items, prev=v)
        yield v, items, blocks
        change = rng.random()
        if change < 0.1 and items:
            items[rng.randrange(len(items))] = rng.choice(spare)  # in place: the view must not follow
        elif change < 0.25 and items:
            last = items[-1]
            items = items[:-1] + [ViewItem(last.index, list(last.parts), last.sig)]
        elif change < 0.4:
            items = items[:rng.randint(0, len(items))]
        else:
            items = items + rng.sample(spare, rng.randint(0, 4))


def oracle_view(items) -> View:
    return View(list(items))


@pytest.mark.parametrize("seed", range(300))
def test_the_views_new_figures_are_a_pass_from_the_start(seed):
    """View.last_user and part_counts of a view made after another: one pass over the whole."""
    rng = random.Random(seed)
    for v, items, _blocks in chain_of_views(rng, rng.choice([1, 3, 12, 40])):
        asks = ["last", "count", "counts", "first"]
        rng.shuffle(asks)
        for ask in asks[:rng.randint(0, 4)]:
            if ask == "last":
                o = View(list(items))
                assert v.last_user() == old_last_user(o)
            elif ask == "count":
                assert v.part_count() == sum(len(it.parts) for it in items)
            elif ask == "counts":
                assert v.part_counts() == [sum(len(it.parts) for it in items[:k]) for k in range(len(items) + 1)]
            else:
                v.sums(), v.pos
        assert v.last_user() == old_last_user(View(list(items)))


@pytest.mark.parametrize("seed", range(300))
def test_the_items_holding_reminders_are_the_oracles_view_after_view(seed):
    """render._holding of a view made after another (refs seen twice among them): the oracle's, for
    the same refs, more refs, or others."""
    rng = random.Random(seed)
    refs: dict[str, str] = {}
    for v, items, _blocks in chain_of_views(rng, rng.choice([3, 12, 40])):
        pool = [p.ref for it in items for p in it.parts] + ["m09999"]
        move = rng.random()
        if move < 0.3 or not refs:
            refs = {**refs, rng.choice(pool): "text"}
        elif move < 0.4:
            refs = {rng.choice(pool): "text"}
        for _again in range(rng.randint(1, 2)):
            assert render._holding(v, refs) == old_holding(View(list(items)), refs)


def random_head(rng: random.Random, n: int) -> list[ViewItem]:
    items = []
    for k in range(n):
        parts = []
        for j in range(rng.randint(0, 2)):
            role = rng.choice(["user", "assistant", "user", "tool"])
            text = rng.choice([f"plain {k}", "  " + CLAUDE_CODE + f" {k}", compaction.PI + " x", "What did we do so far?"])
            parts.append(PartView(ref_of(3 * k + j + 1), role, TEXT if role != "tool" else TOOL_RESULT, "", "",
                                  text if rng.random() < 0.15 else f"text {k}.{j}", 3))
        items.append(ViewItem(k, parts))
    return items


@pytest.mark.parametrize("seed", range(300))
def test_the_marker_at_the_head_is_the_oracles_view_after_view(seed):
    rng = random.Random(seed)
    pool = random_head(rng, rng.choice([3, 12, 40, 300]))
    items = pool[:rng.randint(0, len(pool))]
    v = None
    for _ in range(rng.randint(2, 8)):
        v = View(items, prev=v)
        lane = rng.choice(["anthropic", "anthropic", "chat", "responses"])
        for _again in range(rng.randint(1, 2)):
            assert compaction.marker_in_head(lane, v) == old_marker_in_head(lane, View(list(items)))
        move = rng.random()
        if move < 0.5:
            items = items + pool[len(items):len(items) + rng.randint(0, 3)]
        elif move < 0.6 and items:
            k = rng.randrange(len(items))
            items[k] = ViewItem(items[k].index, list(reversed(items[k].parts)))  # (in place)
        elif move < 0.75 and items:
            last = items[-1]
            items = items[:-1] + [ViewItem(last.index, list(last.parts))]
        else:
            items = items[:rng.randint(0, len(items))]


@pytest.mark.parametrize("seed", range(200))
def test_coverage_is_the_oracles_as_the_blocks_change(seed):
    """The coverage kept for the same blocks is the one made again: blocks (de)activated, claims
    made, refs covered, blocks added or dropped, other sessions' blocks asked for between."""
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([5, 30, 80]))
    others = random_view(random.Random(seed + 7), 30)[1]
    for _ in range(rng.randint(1, 12)):
        ask = rng.choice([blocks, blocks, others, [b for b in blocks if b.active], blocks[::-1]])
        got, want = fold.coverage(ask), old_coverage(ask)
        assert list(got.items()) == list(want.items())  # (the same blocks, the same order)
        assert all(got[r] is want[r] for r in got)
        move = rng.random()
        if blocks and move < 0.2:
            rng.choice(blocks).active ^= True
        elif blocks and move < 0.35:
            b = rng.choice(blocks)
            if b.covered:
                b.claimed[rng.choice(b.covered)] = f"m0{rng.randint(1000, 9999)}"
        elif blocks and move < 0.5:
            rng.choice(blocks).covered.append(f"m0{rng.randint(1000, 9999)}")  # (in place)
        elif blocks and move < 0.6:
            b = rng.choice(blocks)
            if b.covered:
                b.covered[rng.randrange(len(b.covered))] = f"m0{rng.randint(1000, 9999)}"  # (in place)
        elif move < 0.7 and blocks:
            blocks = blocks[:-1]
        elif move < 0.8 and (blocks or others):
            blocks = blocks + [copymod.copy(rng.choice(blocks or others))]
    drop = {rng.randrange(100) for _ in range(rng.randint(0, 40))}
    assert fold._runs(drop) == old_runs(drop)


def random_blocks_and_copy(rng: random.Random, view: View, blocks: list[Block]) -> Copy:
    """Claims, truncations and a copy of a pass before (some refs gone since)."""
    refs = [p.ref for it in view.items for p in it.parts]
    for b in blocks:
        if rng.random() < 0.3 and b.covered:
            b.claimed[rng.choice(b.covered)] = rng.choice(refs) if refs and rng.random() < 0.7 else "m99999"
        if rng.random() < 0.2:
            b.covered.append(f"m9{rng.randint(1000, 9999)}")  # a covered part not in this pass
    truncated = sorted({r for b in blocks for r in b.covered if rng.random() < 0.2})
    if rng.random() < 0.3:
        truncated.append(rng.choice(refs) if refs else "m00001")
    return Copy(refs=list(refs), fps=["f"] * len(refs), items=[0] * len(refs), truncated=truncated,
                latched=rng.random() < 0.1)


@pytest.mark.parametrize("seed", range(300))
def test_a_steady_check_is_reconciles_outcome(seed):
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([2, 10, 30, 80]))
    view = View(view.items)
    c = random_blocks_and_copy(rng, view, blocks)
    mine, theirs = copymod.deepcopy(c), copymod.deepcopy(c)
    got = coverage._steady(view, blocks, mine)
    want = reconcile.reconcile(view, blocks, theirs, lambda refs: [], set())
    if got is None:
        assert want.missing > 0
    else:
        assert want.missing == 0 and got == want and mine == theirs


# ---- (2) whole Engine runs: as they are, and with the oracles patched in --------------------------

def _untimed(doc: str) -> dict:
    d = json.loads(doc)
    d.pop("created", None)  # (when the block was made: the clock's)
    return d


def _flags(flags: dict) -> str:
    flags = {**flags, "epochs": [{k: v for k, v in e.items() if k != "at"} for e in flags.get("epochs", [])]}
    return json.dumps(flags, sort_keys=True, default=str)  # (less when each epoch began: the clock's)


class Trace:
    def __init__(self, e: Engine):
        self.e = e
        self.turns: list = []

    def send(self, raw: bytes, sid: str, lane=LANES["anthropic"]):
        res = self.e.process(raw, lane, {"x-acp-session": sid}, render=True)
        self.e.lineage.flush()
        s = self.e.sessions.get(res.session) if res.session else None
        st = self.e.store
        self.turns.append((
            res.body, res.folded_items, list(res.executed), res.tagged, res.landed, res.active, res.drift,
            res.epoch, res.refs_new, res.refs_known, res.reused,
            None if s is None else (
                _flags(s.flags), s.sent_tokens, s.unfolded_tokens,
                s.copy.to_json(), [(b.id, b.active, b.retired, b.covered, b.claimed) for b in s.blocks],
                st.copy(s.row.id), [_untimed(doc) for doc in st.blocks(s.row.id)], list(st.ledger(s.row.id)),
            ),
        ))
        return res


def both(tmp_path, scenario) -> None:
    new, old = run_both(tmp_path, scenario, patch_oracles, Trace)
    assert len(new) == len(old) and new
    for i, (a, b) in enumerate(zip(new, old)):
        if a != b and a[:11] == b[:11] and a[11] and b[11]:
            for j, (x, y) in enumerate(zip(a[11], b[11])):
                assert x == y, f"turn {i}: the session's state differs ({j})"
        assert a == b, f"turn {i} differs"


@pytest.mark.parametrize("n", [30, 100])
@pytest.mark.parametrize("tools", [False, True])
def test_the_benchs_folded_follow_ups(tmp_path, n, tools):
    """Follow-ups of the bench's folded session: user prose, or (``tools``) tool calls and their
    results, whose newest user turn lies further back turn after turn."""
    case = bench_overhead.Case("anthropic", n)
    news = [case.new(i) for i in range(8)]

    def scenario(make):
        t = make(fold_cfg=FoldConfig(min_compress_chars=2000))
        sid = "bench-folded"
        msgs = bench_overhead.fold_half(t.e, case, list(case.msgs), {"x-acp-session": sid})
        for i in range(8):
            if tools and i % 3:
                msgs = msgs + [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_x{i}", "name": "Read",
                                                       "input": {"path": f"f{i}.py"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_x{i}",
                                                  "content": f"line {i}\n" * (50 + 400 * (i % 2))}]}]
            else:
                msgs.append(news[i])
            t.e.t += 10
            t.send(case.body(msgs), sid)
        return t.turns

    both(tmp_path, scenario)


@pytest.mark.parametrize("window", [0, 30_000, 12_000])
@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_folds_of_every_kind(tmp_path, window, materialize):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, materialize))


def test_folds_rendered_from_the_transcript(tmp_path):
    both(tmp_path, lambda make: folds_of_every_kind(make, 40_000, "now", snapshot=True, batch=2_000))


SID = "churn"
SUMMARY = "Identity-proof fold summary covering the early turns: modules were read, values noted."


def churned(make, lane: str):
    """A fold, steady turns, the host's churn (ids re-minted and arguments re-serialised), a
    truncated oldest slice, a folded message said again, a collapse and the recovery."""
    t = make(fold_cfg=FoldConfig(min_compress_chars=2000))
    ln = LANES[lane]
    ts = C.turns(14)

    def send(conv):
        return t.send(C.body(lane, conv), SID, ln)

    out = send(C.BUILD[lane](ts, C.Scheme())).body
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "], "summary": SUMMARY}]}
    t.e.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(lane, "cfold", "compress", args)
    for k in range(14, 18):
        sc = C.Scheme(ids="alt_", spaced=True) if k >= 16 else C.Scheme()
        send(C.BUILD[lane](ts, sc, pair))
        ts.append(C.Turn(k, f"Turn {k}: more.", f"Reply Turn {k}.", tool=k % 2 == 0))
    kept = ts[7:]
    send(C.BUILD[lane](kept, C.Scheme(), pair))  # the oldest slice dropped
    again = C.Turn(30, ts[3].user, "Reply again.", tool=False)  # a folded message said again
    send(C.BUILD[lane](kept, C.Scheme(), pair) + C.BUILD[lane]([again], C.Scheme())[1:])
    send(C.BUILD[lane](ts, C.Scheme(), pair))
    stamped = C.BUILD[lane](ts, C.Scheme(ids="zz_", suffix=" §"), pair)  # a collapse: paused
    send(stamped)
    send(stamped)
    ts.append(C.Turn(40, "Turn 40: back to normal.", "Reply Turn 40.", tool=False))
    send(C.BUILD[lane](ts, C.Scheme(), pair))  # recovered
    for k in range(41, 44):
        ts.append(C.Turn(k, f"Turn {k}: on.", f"Reply Turn {k}.", tool=True))
        send(C.BUILD[lane](ts, C.Scheme(), pair))
    return t.turns


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses", "gemini"])
def test_churn(tmp_path, lane):
    both(tmp_path, lambda make: churned(make, lane))


def compacted(make):
    """The agent compacts (Claude Code): a new epoch; folding and reminders go on after it."""
    t = make(fold_cfg=FoldConfig(min_compress_chars=1500))
    t.e.nudge_cfg = NudgeConfig(batch_tokens=2_000, distil_tokens=600, distil_along_tokens=200)
    ts = C.turns(12)
    lane = "anthropic"

    def send(conv):
        return t.send(C.body(lane, conv), SID)

    out = send(C.BUILD[lane](ts, C.Scheme())).body
    refs = C.refs_by_text(out)
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "], "summary": SUMMARY}]}
    t.e.record_calls(SID, [("cfold", "compress", json.dumps(args))])
    pair = C.proxy_call(lane, "cfold", "compress", args)
    for k in range(12, 15):
        send(C.BUILD[lane](ts, C.Scheme(), pair))
        ts.append(C.Turn(k, f"Turn {k}: more.", f"Reply Turn {k}.", tool=True))
    after = [C.Turn(k, f"Turn {k}: after. {C.FILLER}", f"Reply Turn {k}.", tool=k % 2 == 0) for k in range(20, 24)]
    for k in range(1, len(after) + 1):
        send(CP.claude_code(after[:k]))
    for k in range(24, 30):
        after.append(C.Turn(k, f"Turn {k}: later. {C.FILLER}", f"Reply Turn {k}.", tool=True))
        send(CP.claude_code(after))
    return t.turns


def test_the_agents_compaction(tmp_path):
    both(tmp_path, compacted)


def test_the_scenarios_do_what_they_say(tmp_path):
    """(Churn claims, truncates, collapses and recovers; the compaction starts an epoch.)"""
    seen: dict[str, Any] = {}

    def make(**kw):
        e = Engine(Store(tmp_path / f"s{len(seen)}.db"), **kw)
        e.t = 1000.0
        e.now = lambda e=e: e.t
        t = Trace(e)
        seen[len(seen)] = t
        return t

    drifts = {turn[6] for turn in churned(make, "chat")}
    assert {"transformed", "truncated", "collapse", "recovered"} <= drifts, drifts
    epochs = [turn[7] for turn in compacted(make)]
    assert 2 in epochs
    for t in seen.values():
        t.e.store.close()
