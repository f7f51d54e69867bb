"""#11: the reminder's runs stop at the protected positions in order (``fold.View.protected_order``:
the rule in one place, ``View.protected`` its set; no set made and sorted each turn), and
``View.first_user`` is a plain loop.  The oracles are the code as it was, patched back in: the old
``protected`` and ``first_user`` (below), the old ``nudge.compressible`` and ``_runs_unfolded``
(tests/test_first_fixed.py keeps them).  Property by property over random views, then whole Engine
runs (tests/oracle_runs.py) over the bench's first turns, forks and follow-ups, its folded
follow-ups, folds of every kind and the captures: the same bytes out, results, flags and rows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bili_addon.kernel import fold, nudge
from bili_addon.kernel.fold import FoldConfig, View, _user_turn

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_first_fixed import Trace, again, benchs_turns, old_compressible, old_runs_unfolded
from tests.test_folded_follow_up import OldView, folds_of_every_kind, random_view


# (test_folded_follow_up keeps an older View whole: its protected set is the one protected_order replaced)
old_protected = OldView.protected


def old_first_user(self: View) -> int | None:
    if self._first_user is fold._UNKNOWN:
        self._first_user = next((k for k, it in enumerate(self.items) if _user_turn(it.parts)), None)
    return self._first_user


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(View, "protected", old_protected)
    mp.setattr(View, "first_user", old_first_user)
    mp.setattr(nudge, "compressible", old_compressible)
    mp.setattr(nudge, "_runs_unfolded", old_runs_unfolded)


@pytest.mark.parametrize("seed", range(40))
def test_the_protected_positions_in_order_are_the_oracles(seed):
    """protected_order is the old protected set, ascending (first user turns that are the agent's
    summary or not, items without parts, recent zones of every size); protected() its set; the runs
    they stop; first_user as it was."""
    rng = random.Random(seed)
    for _ in range(30):
        view, _blocks, _hidden = random_view(rng, rng.choice([1, 2, 3, 8, 20, 60]))
        view.first_free = rng.random() < 0.2
        cfg = FoldConfig(recent_parts=rng.choice([0, 1, 2, 4, 9, 40, 400]))
        want = old_protected(again(view), cfg)
        assert view.protected_order(cfg) == sorted(want)
        assert again(view).protected(cfg) == want
        assert again(view).first_user() == old_first_user(again(view))
        assert nudge.compressible(again(view), [], cfg) == old_compressible(again(view), [], cfg)


def both(tmp_path: Path, scenario) -> None:
    same_runs(tmp_path, scenario, patch_oracles, Trace)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("window", [0, 25_000, 6_000])
def test_the_benchs_first_turns_forks_and_follow_ups_are_the_oracles(tmp_path, lane, window):
    """First turns (one while another waits for its answer), a fork, follow-ups; windows that make
    the reminder urgent."""
    both(tmp_path, benchs_turns(lane, 100, window, side=False))


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("window", [0, 12_000])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, "now"))


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old
