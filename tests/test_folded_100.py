"""A folded session's follow-up at 100 messages: what it pays on top of an unfolded one, cut without
changing a decision, a byte or a stored row.

The reminder (``nudge.decide``) of a turn within the regrowth of the last reminder (not urgent)
is None before the foldable ranges are looked for: every path of the old function that got there
returned None too.  The function as it was is kept below as the oracle.  Proof: (1) against it
over random views and every (used, window, last reminder) around the regrowth and pressure
edges, the view's figures it keeps running included; (2) whole Engine runs, once as they are and
once with the oracle patched in, over the bench's folded follow-ups (prose, and tool calls with
results), folds of every kind (reminders as a suffix and as an item, truncations, held folds), a
reminder's regrowth turn after turn, churn and the agents' compaction: the same bytes out,
results, flags, blocks, copies and stored rows on every turn.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from bili_addon.kernel import nudge, render, turn
from bili_addon.kernel.fold import Block, FoldConfig, View, coverage
from bili_addon.kernel.kept import Kept
from bili_addon.kernel.nudge import NudgeConfig, compressible, distillable
from bili_addon.kernel.tags import format_tokens

import tests.test_followup_steps as steps
from bili_addon.wire import LANES
from tests.test_folded_follow_up import (bench_overhead, folds_of_every_kind, long_conversation, old_assemble,
                                         random_view, same_figures)


# ---- the oracle: decide as it was ----------------------------------------------------------------

def old_decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
               last_nudge_at: int, cov: dict[str, Block] | None = None) -> str | None:
    if cov is None:
        cov = coverage(blocks)
    ranges = [r for r in compressible(view, blocks, fold_cfg, cov) if r[3] * 4 >= fold_cfg.min_compress_chars]
    distil = distillable(view, blocks, fold_cfg, cfg, ranges=ranges, cov=cov)
    if not ranges and not distil:
        return None
    pending = sum(r[3] for r in ranges)
    urgent = window > 0 and used >= cfg.pressure * window
    if not urgent:
        if pending < cfg.batch_tokens and not distil:
            return None
        if last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
            return None
    if not distil and (urgent or pending >= cfg.batch_tokens):
        distil = distillable(view, blocks, fold_cfg, cfg, along=True, ranges=ranges, cov=cov)
    listed = sorted(ranges, key=lambda r: -r[3])[:5]
    listed.sort(key=lambda r: int(r[0][1:]))
    lines = [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in listed]
    if distil:
        first, last, n, t = distil
        lines.insert(0, f"  {first}–{last}  {n} summaries  ~{format_tokens(t)} tokens (distil them into one)")
    if urgent:
        head = "[bili] The context is nearly full: fold consumed work now, oldest first."
    elif pending >= cfg.batch_tokens:
        head = (f"[bili] ~{format_tokens(pending)} tokens of older work can be folded; fold what you no longer "
                "need verbatim:")
    else:
        head = "[bili] The summaries have piled up. Fold them into one denser summary:"
    return "\n".join([
        head,
        *lines,
        "One compress call, one entry per range, alongside your next step if you like.",
    ])


def patch_oracle(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(nudge, "decide", old_decide)
    mp.setattr(turn, "assemble", old_assemble)  # (each reminder merged anew, each summary's text made twice)


# ---- (1) the reminder against the oracle over random views ---------------------------------------

@pytest.mark.parametrize("seed", range(200))
def test_the_reminder_is_the_oracles_around_the_regrowth_and_pressure_edges(seed):
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([0, 1, 3, 10, 40, 120]))
    fcfg = FoldConfig(min_compress_chars=rng.choice([200, 2000, 5000]), recent_parts=rng.choice([1, 4, 8]))
    ncfg = NudgeConfig(batch_tokens=rng.choice([500, 3000, 12000]), distil_tokens=rng.choice([100, 5000]),
                       distil_along_tokens=rng.choice([50, 1500]), regrowth_tokens=rng.choice([1, 2000, 10_000]),
                       pressure=rng.choice([0.5, 0.75, 1.0]))
    cov = coverage(blocks)
    total = sum(it.tokens for it in view.items)
    grow = ncfg.regrowth_tokens
    for used in {0, 1, total // 3, total, total * 2, grow, grow + 1}:
        for window in {0, 1, max(1, total), max(1, total * 3), int(used / ncfg.pressure) + 1,
                       int(used / ncfg.pressure), 1_000_000}:
            for last in {0, 1, used, used // 2, used - grow, used - grow + 1, used - grow - 1, used + 5}:
                last = max(0, last)
                want = old_decide(view, blocks, fcfg, ncfg, used, window, last)
                assert nudge.decide(view, blocks, fcfg, ncfg, used, window, last) == want
                assert nudge.decide(view, blocks, fcfg, ncfg, used, window, last, cov) == want


@pytest.mark.parametrize("seed", range(40))
def test_a_regrowth_turn_keeps_the_views_figures_running(seed):
    """A turn that stops at the regrowth still extends the view's figures against the coverage: the
    next view's extend them as a pass from the start gives them."""
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([3, 10, 40]))
    cov = coverage(blocks)
    ncfg = NudgeConfig(regrowth_tokens=10_000)
    assert nudge.decide(view, blocks, FoldConfig(), ncfg, 5_000, 1_000_000, 1_000, cov) is None
    if cov:
        u = view._unfolded
        assert u is not None and u.refs == cov.keys()
        got = View(list(view.items), prev=view).unfolded(cov)
        fresh = View(list(view.items)).unfolded(cov)
        assert (got.held, got.tokens, got.first, got.last) == (fresh.held, fresh.tokens, fresh.first, fresh.last)


def test_a_reminders_merge_is_the_lanes_turn_after_turn(monkeypatch):
    """The merge kept for a reminder given as an item is the lane's, for any item and text, within
    its bound (bytes only: anything else is merged anew, never kept)."""
    monkeypatch.setattr(render, "_NOTES", Kept(1 << 12))
    rng = random.Random(5)
    items = [msgspec.json.encode({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                               "content": "x" * rng.randrange(0, 400)}]})
             for k in range(30)]
    items += [msgspec.json.encode({"role": "user", "content": "plain prose"}), b'{"role":"user"}', b"not json",
              msgspec.json.encode({"role": "user", "parts": [{"text": "hi"}]})]
    for _ in range(400):
        lane = LANES[rng.choice(["anthropic", "chat", "responses", "gemini"])]
        item, text = rng.choice(items), rng.choice(["[bili] fold", "[bili] other ✓", ""])
        want = lane.note_in_item(item, text)
        assert render._note_in_item(lane.note_in_item, item, text) == want
        got = render._note_in_item(lane.note_in_item, bytearray(item), text)
        assert got == lane.note_in_item(bytearray(item), text)
        assert render._NOTES.used <= 1 << 12
    assert render._NOTES.items


@pytest.mark.parametrize("seed", range(100))
def test_the_unfolded_figures_extend_the_previous_views_for_equal_refs(seed):
    """A view's figures against a coverage extend the previous view's when the coverage holds the
    same refs (an equal dict, not the same one: the previous view's set of them is taken), and are
    made from the start for other refs: as one pass over the whole gives them."""
    rng = random.Random(seed)
    base, blocks, _hidden = random_view(rng, rng.choice([2, 5, 30, 80]))
    covs = [coverage(blocks), coverage(blocks[:1]), {}]
    items, last = list(base.items), None
    for _ in range(rng.randint(2, 7)):
        v = View(items, prev=last)
        cov = dict(rng.choice(covs))  # (a dict of its own every time)
        if rng.random() < 0.3:
            cov = {r: b for r, b in cov.items() if rng.random() < 0.9}  # (other refs)
        same_figures(v, items, cov)
        if last is not None and last._unfolded is not None and last._unfolded.refs == cov.keys():
            assert v._unfolded.refs is last._unfolded.refs
        keep = rng.randint(max(0, len(items) - 3), len(items))
        items = items[:keep] + rng.sample(list(base.items), rng.randint(0, min(3, len(base.items))))
        last = v


# ---- (2) whole Engine runs: as they are, and with the oracle patched in ---------------------------

def both(tmp_path, scenario) -> None:
    """:func:`tests.test_followup_steps.both` with this file's oracle."""
    was = steps.patch_oracles
    steps.patch_oracles = patch_oracle
    try:
        steps.both(tmp_path, scenario)
    finally:
        steps.patch_oracles = was


@pytest.mark.parametrize("n", [30, 100, 300])
@pytest.mark.parametrize("tools", [False, True])
def test_the_benchs_folded_follow_ups(tmp_path, n, tools):
    case = bench_overhead.Case("anthropic", n)
    news = [case.new(i) for i in range(10)]

    def scenario(make):
        t = make(fold_cfg=FoldConfig(min_compress_chars=2000))
        sid = "bench-folded"
        msgs = bench_overhead.fold_half(t.e, case, list(case.msgs), {"x-acp-session": sid})
        for i in range(10):
            if tools and i % 3:
                msgs = msgs + [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_x{i}", "name": "Read",
                                                       "input": {"path": f"f{i}.py"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_x{i}",
                                                  "content": f"line {i}\n" * (50 + 4000 * (i % 2))}]}]
            else:
                msgs.append(news[i])
            t.e.t += 10
            t.send(case.body(msgs), sid)
        return t.turns

    both(tmp_path, scenario)


def regrowth(make):
    """Reminders given, and the regrowth after each passing turn after turn."""
    t = make(fold_cfg=FoldConfig(min_compress_chars=1500))
    t.e.nudge_cfg = NudgeConfig(batch_tokens=2_000, regrowth_tokens=3_000, distil_tokens=600, distil_along_tokens=200)
    conv = long_conversation(40, big_every=3)
    for k in range(7, len(conv) + 1, 2):  # (each request ends with the user's turn, as agents send them)
        t.e.t += 10
        t.send(_body(conv[:k]), "regrowth")
    return t.turns


def _body(msgs: list[dict]) -> bytes:
    return msgspec.json.encode({"model": "claude-sonnet-4-5", "max_tokens": 1000, "messages": msgs})


def test_a_reminders_regrowth_turn_after_turn(tmp_path):
    both(tmp_path, regrowth)


@pytest.mark.parametrize("window", [0, 30_000, 12_000])
@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_folds_of_every_kind(tmp_path, window, materialize):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, materialize))


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses", "gemini"])
def test_churn(tmp_path, lane):
    both(tmp_path, lambda make: steps.churned(make, lane))


def test_the_agents_compaction(tmp_path):
    both(tmp_path, steps.compacted)


def test_the_regrowth_is_reached(tmp_path, monkeypatch):
    """(The runs above do stop at the regrowth, and give reminders too.)"""
    seen = {"stopped": 0, "given": 0}
    real = nudge.decide

    def counted(view, blocks, fold_cfg, cfg, used, window, last_nudge_at, cov=None):
        text = real(view, blocks, fold_cfg, cfg, used, window, last_nudge_at, cov)
        urgent = window > 0 and used >= cfg.pressure * window
        if not urgent and last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
            seen["stopped"] += 1
        seen["given"] += text is not None
        return text

    monkeypatch.setattr(nudge, "decide", counted)
    runs = []

    def make(**kw):
        t = steps.Trace(steps.Engine(steps.Store(tmp_path / f"s{len(runs)}.db"), **kw))
        t.e.t = 1000.0
        t.e.now = lambda e=t.e: e.t
        runs.append(t)
        return t

    regrowth(make)
    for t in runs:
        t.e.store.close()
    assert seen["stopped"] and seen["given"]
