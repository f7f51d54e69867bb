"""Results of pure functions kept for the turns after, within a size: what the kernel computes turn
after turn from the same inputs (a summary's token count, a reminder merged into its item)."""

from __future__ import annotations

from typing import Any, Hashable

MISSING = object()


class Kept:
    """Values by key, kept while their sizes add up to at most ``budget``; past it every value is
    dropped at once (the next ones are kept again).  A value larger than a sixteenth of the budget
    is not kept."""

    __slots__ = ("budget", "used", "items")

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self.items: dict[Hashable, Any] = {}

    def get(self, key: Hashable, default: Any = MISSING) -> Any:
        return self.items.get(key, default)

    def put(self, key: Hashable, value: Any, size: int) -> None:
        if size > self.budget >> 4:
            return
        if self.used + size > self.budget:
            self.items.clear()
            self.used = 0
        self.items[key] = value
        self.used += size


__all__ = ["MISSING", "Kept"]
