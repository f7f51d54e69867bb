"""The reminder policy on the kernel's own view: when distilling the pile of summaries is offered
(alongside a fold from a small pile, on its own only from a large one), what the pile is, and what
a distilling compress absorbs."""

from __future__ import annotations

import re

from bili_addon.kernel import nudge
from bili_addon.kernel.fold import Block, FoldConfig, PartView, View, ViewItem, compress
from bili_addon.kernel.tags import ref_of
from bili_addon.wire.base import TEXT

FOLD = FoldConfig()
CFG = nudge.NudgeConfig()  # reminders at 15K foldable tokens; distil at 1K alongside a fold, 5K alone


def item(k: int, tokens: int, role: str = "assistant") -> ViewItem:
    text = f"step {k} " + "x" * (tokens * 4 - 8)
    return ViewItem(k, [PartView(ref_of(k + 1), role, TEXT, "", "", text, tokens)])


def block(no: int, items: range, summary_tokens: int, tier: int = 1) -> Block:
    refs = [ref_of(k + 1) for k in items]
    return Block(id=f"b{no}", tier=tier, summary="s" * (summary_tokens * 4), topic="", covered=refs,
                 direct=refs, consumed=[], start_ref=refs[0], end_ref=refs[-1])


def session(pile: list[tuple[int, range, int, int]], strays: dict[int, int], work: int, work_tokens: int):
    """A first user turn, the pile (blocks over items 1..), the stray user turns between them, then
    ``work`` unfolded items of ``work_tokens`` each (the newest of them protected, the last one the
    newest user turn)."""
    n = max(max(r) for _no, r, _t, _tier in pile) + 1
    items = [item(0, 50, "user")]
    for k in range(1, n):
        items.append(item(k, strays.get(k, 500), "user" if k in strays else "assistant"))
    items += [item(n + j, work_tokens, "user" if j == work - 1 else "assistant") for j in range(work)]
    blocks = [block(no, r, t, tier) for no, r, t, tier in pile]
    return View(items), blocks


def listed(note: str) -> list[tuple[str, str, str]]:
    return re.findall(r"^  ([mb]\d+)–([mb]\d+)  \d+ (messages|summaries)", note, re.M)


def test_distilling_is_offered_alongside_a_fold_from_the_small_pile_threshold():
    # two summaries of ~450 tokens and a stray task prompt of 900: ~1.8K, below the 5K of a
    # distil on its own, above the 1.5K of one that rides along with a fold
    view, blocks = session([(1, range(1, 4), 450, 1), (2, range(5, 8), 450, 1)], {4: 900}, work=14, work_tokens=1500)
    pile = nudge.distillable(view, blocks, FOLD, CFG, along=True)
    assert pile is not None and pile[:3] == ("b1", "b2", 2) and 1_750 <= pile[3] <= 1_850
    assert nudge.distillable(view, blocks, FOLD, CFG) is None  # not on its own
    note = nudge.decide(view, blocks, FOLD, CFG, used=40_000, window=200_000, last_nudge_at=0)
    assert note is not None and note.startswith("[bili] ~")
    entries = listed(note)
    # oldest first: the pile, then the work after it
    assert entries[0] == ("b1", "b2", "summaries") and "(distil them into one)" in note.splitlines()[1]
    assert [kind for _s, _e, kind in entries[1:]] == ["messages"]


def test_below_the_small_threshold_a_fold_goes_alone():
    view, blocks = session([(1, range(1, 4), 200, 1), (2, range(5, 8), 200, 1)], {4: 100}, work=14, work_tokens=1500)
    assert nudge.distillable(view, blocks, FOLD, CFG, along=True) is None  # ~500 tokens
    note = nudge.decide(view, blocks, FOLD, CFG, used=40_000, window=200_000, last_nudge_at=0)
    assert note is not None and [kind for _s, _e, kind in listed(note)] == ["messages"]


def test_a_pile_below_the_large_threshold_is_not_offered_without_a_fold():
    # ~3K of summaries, but only ~3K foldable tokens: no reminder at all
    view, blocks = session([(1, range(1, 4), 1_500, 1), (2, range(5, 8), 1_500, 1)], {}, work=6, work_tokens=600)
    assert nudge.distillable(view, blocks, FOLD, CFG, along=True) is not None
    assert nudge.decide(view, blocks, FOLD, CFG, used=40_000, window=200_000, last_nudge_at=0) is None


def test_a_pile_above_the_large_threshold_is_offered_on_its_own():
    view, blocks = session([(1, range(1, 4), 3_000, 1), (2, range(5, 8), 3_000, 1)], {}, work=6, work_tokens=600)
    note = nudge.decide(view, blocks, FOLD, CFG, used=40_000, window=200_000, last_nudge_at=0)
    assert note is not None and note.startswith("[bili] The summaries have piled up")
    assert ("b1", "b2", "summaries") in listed(note)


def test_the_pile_is_every_summary_on_the_wire_in_wire_order_whatever_its_tier():
    # b5 (tier 3, a distillation made after b3 and b4) stands first on the wire; b3 is tier 2
    pile = [(5, range(1, 4), 600, 3), (3, range(4, 7), 450, 2), (4, range(8, 10), 450, 1)]
    view, blocks = session(pile, {7: 300}, work=14, work_tokens=1500)
    got = nudge.distillable(view, blocks, FOLD, CFG, along=True)
    assert got is not None and got[:3] == ("b5", "b4", 3) and got[3] >= 1_800


def test_the_pile_stops_before_a_range_that_is_a_fold_of_its_own():
    # b1, then 8K foldable tokens, then b2: distilling b1..b2 would swallow that work into a distil
    pile = [(1, range(1, 3), 900, 1), (3, range(3, 5), 900, 1), (2, range(13, 15), 900, 1)]
    view, blocks = session(pile, {}, work=14, work_tokens=1500)
    for k in range(5, 13):
        view.items[k] = item(k, 1_000)
    # items 5..12 are unfolded: a foldable range between b3 and b2
    got = nudge.distillable(view, blocks, FOLD, CFG, along=True)
    assert got is not None and got[:3] == ("b1", "b3", 2)


def test_a_distilling_compress_absorbs_every_summary_in_its_range_a_tier_above_the_highest():
    view, blocks = session([(1, range(1, 4), 300, 2), (2, range(4, 7), 300, 1), (3, range(8, 10), 300, 1)],
                           {7: 200}, work=8, work_tokens=1500)
    out = compress({"content": [{"startId": "b1", "endId": "b3", "summary": "Distilled: " + "y" * 400}]},
                   view, blocks, FOLD)
    assert len(out.blocks) == 1, out.text
    made = out.blocks[0]
    assert made.tier == 3 and made.consumed == ["b1", "b2", "b3"]
    assert sorted(b.id for b in out.deactivated) == ["b1", "b2", "b3"] and not any(b.active for b in blocks)
    assert ref_of(8) in made.direct  # the stray user turn between b2 and b3 goes in too
    assert "(tier 3, absorbing b1, b2, b3)" in out.text
