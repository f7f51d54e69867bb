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
    refs would run past the last one (the general path says so)."""
    next_ref = s.row.next_ref
    total = sum(len(info.parts) for info in infos)
    if next_ref < 1 or next_ref + total - 1 > MAX_REF:
        return None
    names = iter(ref_names(next_ref, total))  # tags.ref_of of each number, in order
    refs = s.refs
    counter_get = counter.get
    rows: list[LedgerRow] = []
    add_row = rows.append
    resolved: list[list[Resolved]] = []
    views: list[ViewItem] = []
    for k, info in enumerate(infos, first_index):
        out = []
        view = []
        for part in info.parts:
            core, base, chash = part.core, part.base, part.chash
            n = counter_get(base, 0)
            counter[base] = n + 1
            msg_id = base if n == 0 else f"{base}_{n}"
            ref = next(names)
            text = core.text
            # identity.count_tokens (its ASCII case inlined)
            tokens = -(-len(text) // 4) if text.isascii() else count_tokens(text)
            entry = Entry(ref, tokens)
            refs[(msg_id, chash)] = entry  # staged: forgotten again if the commit fails
            role, ctype = core.role, core.ctype
            add_row(LedgerRow(msg_id, chash, ref, role, ctype, tokens))
            out.append(Resolved(core, entry, part.dirty, msg_id, base))
            view.append(PartView(ref, role, ctype, core.tool_name, core.tool_call_id, text, tokens))
        resolved.append(out)
        views.append(ViewItem(k, view))
    return resolved, rows, views


__all__ = ["applies", "first_pass"]
