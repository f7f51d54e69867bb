"""turn._id_sets: the canonical copy's ids as sets, extended turn by turn, always the sets of the
copy's list as it is (the ledger's echo-or-new-instance rule reads them: kernel/turn.py _resolve)."""

from __future__ import annotations

import random

from bili_addon.kernel.state import Session
from bili_addon.kernel.turn import _id_sets
from bili_addon.store import SessionRow


def _session() -> Session:
    return Session(SessionRow("s", "", "anthropic", 0.0, 0.0, 0, 0, 1))


def _ids(r: random.Random, n: int) -> list[str]:
    return [f"h_{r.getrandbits(64):016x}" + (f"_{r.randint(1, 3)}" if r.random() < 0.2 else "") for _ in range(n)]


def test_the_sets_are_those_of_the_copy_as_it_is_after_every_kind_of_change():
    r = random.Random(11)
    for _run in range(200):
        s = _session()
        ids: list[str] = _ids(r, r.randint(0, 30))
        for _turn in range(30):
            kind = r.random()
            if kind < 0.5:  # a follow-up: the previous ids and the new items' (a new list, as roll_copy makes it)
                ids = ids[:] + _ids(r, r.randint(0, 4))
            elif kind < 0.6:  # the same list again (a turn that rolled no copy)
                pass
            elif kind < 0.7:  # the host truncated its oldest slice
                ids = ids[r.randint(0, max(0, len(ids) - 1)):]
            elif kind < 0.8:  # an edit in the middle, the rest kept
                if ids:
                    k = r.randrange(len(ids))
                    ids = ids[:k] + _ids(r, 1) + ids[k + 1:]
            elif kind < 0.9:  # cut back (a rewind), then grown again
                ids = ids[: r.randint(0, len(ids))] + _ids(r, r.randint(0, 3))
            else:  # another copy altogether (a reload, a new epoch)
                ids = _ids(r, r.randint(0, 30))
            s.copy.ids = ids
            got, bases = _id_sets(s)
            assert got == set(ids)
            assert bases == {i[:18] for i in ids}


def test_a_copy_whose_ids_were_changed_in_place_is_read_again():
    s = _session()
    s.copy.ids = ["h_aaaaaaaaaaaaaaaa", "h_bbbbbbbbbbbbbbbb"]
    assert _id_sets(s)[0] == {"h_aaaaaaaaaaaaaaaa", "h_bbbbbbbbbbbbbbbb"}
    s.copy.ids[0] = "h_cccccccccccccccc"  # (nothing does this today: the sets must still follow)
    got, bases = _id_sets(s)
    assert got == {"h_cccccccccccccccc", "h_bbbbbbbbbbbbbbbb"}
    assert bases == {"h_cccccccccccccccc", "h_bbbbbbbbbbbbbbbb"}
