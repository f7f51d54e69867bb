"""The first pass of a conversation: every part new, its ref, ledger row and view in one loop.

When a session knows nothing yet (no ledger entry, no fold, no host-vouched ids) and the request
shares nothing with a previous pass, :meth:`Engine._resolve <bili_addon.kernel.turn.Engine._resolve>`
would look every part up in vain and give each the next ref, and the view would be built in a second
loop over the same parts.  :func:`first_pass` does what those two do for that case, in one loop,
with the same results: the same ``msg_id`` instance numbering (the pass's ``Counter``), the same
refs in the same order, the same ledger rows and view.  Anything else takes the general path.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate, islice, repeat
from operator import sub

from bili_addon.kernel.fold import PartView, Sums, ViewItem
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import Entry, ItemInfo, Resolved, Session, hash_parts
from bili_addon.store import MAX_REF, LedgerRow, ref_names  # past MAX_REF the general path raises


def applies(s: Session, cov: dict, reused: int, pinned, vouched) -> bool:
    """Nothing of the session is known: every part of the pass gets a new ref.  (A part of ours
    whose stale tag would be stripped needs its ref among the session's owners: none yet.)"""
    return not reused and not s.refs and not s.owners and not cov and not pinned and vouched is None


class Rows:
    """A first pass's new ledger rows, made when its store write is (:meth:`get`): a part's ref
    depends on its place alone here, so its content hash, its ``msg_id`` and its row wait until
    then, after the request has gone when the engine writes behind it (kernel/turn.py)."""

    __slots__ = ("n", "_make", "_rows")

    def __init__(self, n: int, make):
        self.n, self._make, self._rows = n, make, None

    def __len__(self) -> int:
        return self.n

    def get(self) -> list[LedgerRow]:
        if self._rows is None:
            self._rows = self._make()
            self._make = None
        return self._rows


def first_pass(s: Session, infos: list[ItemInfo], counter: Counter, first_index: int,
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
    # identity.count_tokens (its ASCII case inlined: the length's quarter rounded up, in two steps)
    tokens = [(len(t) + 3) // 4 if t.isascii() else count_tokens(t) for t in texts]
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


def _numbered(bases: list[str], counter: Counter) -> list[str]:
    """Each base's ``msg_id`` in the pass: its instance number counted in ``counter``."""
    msg_ids = []
    counter_get = counter.get
    for base in bases:
        n = counter_get(base, 0)
        counter[base] = n + 1
        msg_ids.append(base if n == 0 else f"{base}_{n}")
    return msg_ids


__all__ = ["Rows", "applies", "first_pass"]
