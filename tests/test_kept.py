"""kernel/kept.py: what a pure function gave, kept within a budget (a summary's tokens, a merged reminder)."""

from bili_addon.kernel.kept import MISSING, Kept


def test_values_are_kept_within_the_budget_and_dropped_together_past_it():
    k = Kept(160)
    assert k.get("a") is MISSING and k.get("a", None) is None
    k.put("a", 1, 10)
    k.put("b", None, 10)  # (a kept None is a value)
    assert k.get("a") == 1 and k.get("b") is None and k.used == 20
    k.put("big", 3, 11)  # over a sixteenth of the budget: not kept
    assert k.get("big") is MISSING and k.used == 20
    for i in range(15):  # (20 + 140 fill it; the 15th is past it)
        k.put(i, i, 10)
    assert k.used == 10 and k.get(14) == 14
    assert k.get("a") is MISSING  # (past the budget everything before went)
