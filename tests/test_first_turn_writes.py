"""#11: a conversation's first turn writes once.  Its commit waits until the reminder is decided
(``Sessions.stage``, gated by ``registry.stages``), so the flags the turn learns go in the same write:
one SQLite transaction, and on PostgreSQL three round trips (the lock with the session's state and
its fork candidates, the commit, the release).  Everything else is as when the flags were a write
of their own: the same bytes, refs, ledger and flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bili_addon.kernel import pressure, registry
from bili_addon.kernel.turn import Engine
from bili_addon.wire import LANES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

ANTHROPIC = LANES["anthropic"]


def bodies(n: int = 100) -> list[bytes]:
    case = bench_overhead.Case("anthropic", n, seed=5)
    msgs = list(case.msgs)
    return [case.body(msgs), case.body(msgs + [case.new(0)])]


def turns(eng: Engine, sid: str, raws: list[bytes]) -> list[tuple]:
    out = []
    for raw in raws:
        r = eng.process(raw, ANTHROPIC, {"x-acp-session": sid}, render=True)
        out.append((r.body, r.refs_new, r.refs_known, r.tagged))
        eng.lineage.flush()
    return out


def stored(store, sid: str) -> tuple:
    row = store.session(sid)
    return (row.requests, row.messages, row.next_ref, json.loads(row.flags), store.ledger(sid))


def test_a_first_turn_with_a_reminder_is_one_write(backend, monkeypatch):
    raws = bodies()
    eng = Engine(backend())
    eng.lineage.defer = True
    writes: list[str] = []
    for name in ("commit_turn", "set_flags"):
        orig = getattr(eng.store, name)
        setattr(eng.store, name, lambda *a, _o=orig, _n=name, **k: writes.append(_n) or _o(*a, **k))
    staged = turns(eng, "one", raws[:1])
    assert writes == ["commit_turn"]  # the reminder's flags went with it
    assert "nudges" in json.loads(eng.store.session("one").flags)  # (the case this is about)
    staged += turns(eng, "one", raws[1:])
    got = stored(eng.store, "one")

    monkeypatch.setattr(registry, "stages", lambda *a: False)  # the commit first, the flags a write of their own
    other = Engine(backend("apart"))
    other.lineage.defer = True
    assert turns(other, "one", raws) == staged
    assert stored(other.store, "one") == got
    assert eng.store.version("one") == other.store.version("one") - 1  # one write less


def test_a_turn_that_fails_before_its_staged_commit_keeps_nothing(backend, monkeypatch):
    raws = bodies(60)
    eng = Engine(backend())
    eng.lineage.defer = True
    real = pressure.apply
    monkeypatch.setattr(pressure, "apply", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        eng.process(raws[0], ANTHROPIC, {"x-acp-session": "f"}, render=True)
    assert eng.store.session("f") is None and "f" not in eng.sessions and not eng.sessions.staged
    monkeypatch.setattr(pressure, "apply", real)
    again = turns(eng, "f", raws)
    clean = Engine(backend("clean"))
    clean.lineage.defer = True
    assert again == turns(clean, "f", raws)
    assert stored(eng.store, "f") == stored(clean.store, "f")


def test_a_first_turn_on_postgresql_takes_two_round_trips(pg_url, tmp_path):
    """The lock with the session's state (none: no row, so nothing loaded) and its fork candidates
    (pipelined), the commit with the reminder's flags and the release (one pipeline: the turn's last
    write carries the unlock, tests/test_pg_release.py).  Main made six."""
    from bili_addon.store_pg import PgStore

    store = PgStore(pg_url, str(tmp_path))
    try:
        eng = Engine(store)
        eng.lineage.defer = True
        raws = bodies()
        before = store.round_trips
        eng.process(raws[0], ANTHROPIC, {"x-acp-session": "a"}, render=True)
        assert store.round_trips - before == 2
        assert "nudges" in json.loads(store.session("a").flags)
        eng.lineage.flush()  # after the answer: its record, the parts a fork is matched against
        # another session id with the same history is a fork of it: the candidates read with the
        # lock name the first (another instance: nothing of either known)
        other = Engine(PgStore(pg_url, str(tmp_path)))
        res = other.process(raws[1], ANTHROPIC, {"x-acp-session": "b"}, render=True)
        assert any("fork" in n for n in res.notes), res.notes
        assert other.store.family("b") is not None and other.store.family("b")[0] == "a"
        other.store.close()
    finally:
        store.close()


def test_a_hold_that_reads_the_candidates_waits_and_fails_as_a_plain_one(pg_url, tmp_path):
    """The pipelined hold (lock, state, fork candidates): busy in another instance is
    :class:`SessionBusy`, the connection goes on working, and what it read answers once."""
    from bili_addon.store import SessionBusy
    from bili_addon.store_pg import PgStore

    a, b = PgStore(pg_url, str(tmp_path), lock_wait=0.2), PgStore(pg_url, str(tmp_path), lock_wait=0.2)
    try:
        a.hold("x")
        with pytest.raises(SessionBusy, match="busy in another instance"):
            b.hold("x", ("fp", "anthropic"))
        b.hold("y", ("fp", "anthropic"))  # other sessions go on, on the same connection
        trips = b.round_trips
        assert b.lineage_candidates("fp", "anthropic") == [] and b.round_trips == trips  # read with the lock
        assert b.lineage_candidates("fp", "anthropic") == [] and b.round_trips == trips + 1  # once
        assert b.session_state("y") == (None, [], [], [], None) and b.round_trips == trips + 1  # no row: no read
        a.release()
        b.hold("x", ("fp", "anthropic"))
        b.release()
    finally:
        a.close()
        b.close()
