"""Values that never change: bili's own tools (kernel/prompts.py), frozen so that their JSON is written
once, when they are made, and a memo key (wire.base.memo_tools) reads it instead of encoding them on
every turn."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode  # (wire.base.encode's encoder: the same bytes)


class Frozen(dict):
    """A dict that is never changed (its values are Frozen, FrozenList or immutable too: made by
    :func:`freeze`), so its JSON is written once, when it is made (``json``: msgspec's encoding of
    it), and a memo key reads it from there.  Its methods that change a dict raise; a copy of it
    (``copy.copy``, ``copy.deepcopy``, pickling) is a plain, changeable dict."""

    __slots__ = ("json",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a Frozen dict is made by freeze() (its values frozen, its JSON written)")

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Frozen dict cannot be changed")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _frozen

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        import copy
        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class FrozenList(list):
    """A list that is never changed (see :class:`Frozen`); a copy of it is a plain list."""

    __slots__ = ()

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a FrozenList cannot be changed")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = pop = remove = clear = \
        sort = reverse = _frozen

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict) -> list:
        import copy
        return [copy.deepcopy(v, memo) for v in self]

    def __reduce__(self) -> Any:
        return list, (list(self),)


def freeze(value: Any) -> Any:
    """``value`` (dicts, lists and JSON scalars) made :class:`Frozen` and :class:`FrozenList`, all the
    way down; a Frozen's ``json`` is its encoding (the same bytes as the plain value's)."""
    if type(value) is dict:
        out = dict.__new__(Frozen)
        for k, v in value.items():
            dict.__setitem__(out, k, freeze(v))
        out.json = _encode(out)
        return out
    if type(value) is list:
        return FrozenList(freeze(v) for v in value)
    if value is None or type(value) in (str, int, float, bool):
        return value
    raise TypeError(f"cannot freeze a {type(value).__name__}")


__all__ = ["Frozen", "FrozenList", "freeze"]
