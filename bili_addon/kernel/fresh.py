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
from itertools import accumulate
from operator import attrgetter

from bili_addon.kernel.fold import PartView, ViewItem
from bili_addon.kernel.identity import count_tokens
from bili_addon.kernel.state import Entry, ItemInfo, Resolved, Session
from bili_addon.store import MAX_REF, LedgerRow, ref_names  # past MAX_REF the general path raises


def applies(s: Session, cov: dict, reused: int, pinned, vouched) -> bool:
    """Nothing of the session is known: every part of the pass gets a new ref.  (A part of ours
    whose stale tag would be stripped needs its ref among the session's owners: none yet.)"""
    return not reused and not s.refs and not s.owners and not cov and not pinned and vouched is None


def first_pass(s: Session, infos: list[ItemInfo], counter: Counter,
               first_index: int) -> tuple[list[list[Resolved]], list[LedgerRow], list[ViewItem]] | None:
    """``(resolved, new ledger rows, view items)`` of a pass whose every part is new (see
    :func:`applies`); the rows are staged in ``s.refs`` as ``_resolve`` stages them.  None when the
    refs would run past the last one (the general path says so).

    Column by column: each field of every part in one C-level loop (``map``, comprehensions),
    then the per-item lists cut from the flat ones (the same way)."""
    next_ref = s.row.next_ref
    parts = [p for info in infos for p in info.parts]
    total = len(parts)
    if next_ref < 1 or next_ref + total - 1 > MAX_REF:
        return None
    names = ref_names(next_ref, total)  # tags.ref_of of each number, in order
    cores = list(map(_CORE, parts))
    bases = list(map(_BASE, parts))
    chashes = list(map(_CHASH, parts))
    if not counter and len(set(bases)) == total:  # no base twice: every msg_id is its base
        msg_ids = bases
        counter.update(bases)
    else:
        msg_ids = []
        counter_get = counter.get
        for base in bases:
            n = counter_get(base, 0)
            counter[base] = n + 1
            msg_ids.append(base if n == 0 else f"{base}_{n}")
    texts = list(map(_TEXT, cores))
    roles = list(map(_ROLE, cores))
    ctypes = list(map(_CTYPE, cores))
    # identity.count_tokens (its ASCII case inlined)
    tokens = [-(-len(t) // 4) if t.isascii() else count_tokens(t) for t in texts]
    entries = list(map(Entry, names, tokens))
    s.refs.update(zip(zip(msg_ids, chashes), entries))  # staged: forgotten again if the commit fails
    rows = list(map(LedgerRow, msg_ids, chashes, names, roles, ctypes, tokens))
    flat = list(map(Resolved, cores, entries, map(_DIRTY, parts), msg_ids, bases))
    views_flat = list(map(PartView, names, roles, ctypes, map(_TOOL_NAME, cores), map(_TOOL_CALL_ID, cores),
                          texts, tokens))
    ends = list(accumulate(map(len, map(_PARTS, infos))))
    cuts = list(zip([0, *ends], ends))
    resolved = [flat[begin:end] for begin, end in cuts]
    views = list(map(ViewItem, range(first_index, first_index + len(infos)),
                     [views_flat[begin:end] for begin, end in cuts]))
    return resolved, rows, views


_CORE, _BASE, _CHASH, _DIRTY = attrgetter("core"), attrgetter("base"), attrgetter("chash"), attrgetter("dirty")
_TEXT, _ROLE, _CTYPE = attrgetter("text"), attrgetter("role"), attrgetter("ctype")
_TOOL_NAME, _TOOL_CALL_ID = attrgetter("tool_name"), attrgetter("tool_call_id")
_PARTS = attrgetter("parts")


__all__ = ["applies", "first_pass"]


def stages(first, s: Session, env, tail, render: bool, lineage_deferred: bool) -> bool:
    """Whether a turn's commit may wait until its reminder is decided (``Sessions.stage``), so the
    flags it learns go in the same write: a conversation's first pass (``first``) of a session with
    no fold and no pending call, where nothing else writes the session in between (no envelope to
    bind, no prefix chain to note, the lineage kept back until the answer; a render, not observe)."""
    return (first is not None and env is None and tail is None and render and lineage_deferred
            and not s.blocks and not s.calls and not s.copy.latched)
