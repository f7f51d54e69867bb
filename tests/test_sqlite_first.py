"""#11: a new conversation's first turn on SQLite reads its session's row and its fork candidates in
one statement (``Store.hold`` names the candidates, ``Store.session_state`` reads them and the
archived records of that opening with the row, ``Store.lineage_candidates`` and
``Store.lineage_archived`` answer from them once), checks its refs with a list display
(``fresh_first``), and stores before its fork check only what other conversations kept back that
opens as it does (``Lineage._flush_opening``; the rest waits for the flush after their answers).  Each gives exactly what the statements and code before gave: the same
candidates in the same order, the same session state, the same outgoing bytes and stored rows (the
old code is patched in as the oracle and both runs compared, over the bench's conversations, forks
of them and the captures in ``BILI_CAPTURES``)."""

from __future__ import annotations

import json
import operator
import sqlite3
import sys
from pathlib import Path

import pytest

from bili_addon import store as store_mod
from bili_addon.kernel.lineage import Lineage
from bili_addon.kernel.turn import Engine
from bili_addon.store import LedgerRow, SessionRow, StoreError, Store, ref_names
from bili_addon.wire import LANES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

CANDS_SQL = ("SELECT p.session_id FROM lineage_parts p JOIN sessions s ON s.id=p.session_id "
             "WHERE p.seq=0 AND p.fp=? AND s.lane=? ORDER BY s.created")


# -- the oracles: the code before ------------------------------------------------------------------
def old_session_state(self, session_id):
    if self.session(session_id) is None:
        return None, [], [], [], None
    with self.snapshot():
        row = self.session(session_id)
        if row is None:
            return None, [], [], [], None
        return (row, self.ledger(session_id), self.blocks(session_id), self.calls(session_id),
                self.copy(session_id))


def old_lineage_candidates(self, first_fp, lane):
    return [r[0] for r in self.db.execute(CANDS_SQL, (first_fp, lane)).fetchall()]


def old_lineage_archived(self, first_fp, lane):
    return self.db.execute(store_mod._ARCHIVED, (first_fp, lane)).fetchall()


def old_fresh_first(rows):
    refs = list(map(operator.attrgetter("ref"), rows))
    first = int(refs[0][1:])
    if refs != ref_names(first, len(refs)):
        raise StoreError(f"the refs of a turn are not consecutive ({refs[0]}...{refs[-1]})")
    return first


def patch_old(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(Store, "session_state", old_session_state)
    mp.setattr(Store, "lineage_candidates", old_lineage_candidates)
    mp.setattr(Store, "lineage_archived", old_lineage_archived)
    mp.setattr(Store, "hold", lambda self, sid, candidates=None: None)
    mp.setattr(store_mod, "fresh_first", old_fresh_first)
    mp.setattr(Lineage, "_flush_opening", lambda self, head: self.flush())  # (every kept-back pass, before)


# -- the store's one read ------------------------------------------------------------------------
def session_row(sid: str, lane: str, created: float, next_ref: int = 3) -> SessionRow:
    return SessionRow(sid, "agent", lane, created, created, 1, 2, next_ref)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def seed(s: Store) -> None:
    """Sessions whose recorded history opens with fingerprint F or G, in two lanes, written out of
    their creation order (the candidates come oldest first)."""
    for sid, lane, created, fp in [("c3", "anthropic", 30.0, "F"), ("c1", "anthropic", 10.0, "F"),
                                   ("c2", "chat", 20.0, "F"), ("c4", "anthropic", 40.0, "G"),
                                   ("c5", "anthropic", 25.0, "F"), ("c0", "anthropic", 5.0, "F")]:
        s.commit_turn(session_row(sid, lane, created), [LedgerRow(f"h_{sid}", "x" * 64, "m00001", "user", "text", 3),
                                                          LedgerRow(f"h_{sid}2", "y" * 64, "m00002", "user", "text", 4)],
                      expect=0, fresh=True)
        s.db.execute("UPDATE sessions SET created=? WHERE id=?", (created, sid))
        s.save_lineage_parts(sid, 0, [("m00001", "x" * 64, fp), ("m00002", "y" * 64, "other")])
    s.save_lineage_parts("c0", 1, [("m00002", "y" * 64, "F")])  # (a later part with F is no opening)
    # the records of epochs their compactions ended (archived: the session's id, the separator, the epoch),
    # written out of order: oldest session first, then by key
    for sid, epoch, fp in [("c5", 2, "F"), ("c1", 3, "F"), ("c5", 1, "F"), ("c2", 1, "F"), ("c4", 1, "F"),
                           ("c3", 1, "G"), ("c1", 10, "F")]:
        s.save_lineage_parts(store_mod.archived_record(sid, epoch), 0, [("m00001", "x" * 64, fp)])
    s.save_lineage_parts(store_mod.archived_record("gone", 1), 0, [("m00001", "x" * 64, "F")])  # (no session row)


@pytest.mark.parametrize("key", [("F", "anthropic"), ("F", "chat"), ("G", "anthropic"), ("H", "anthropic"),
                                 ("F", "codex")])
def test_a_new_sessions_row_and_candidates_read_together_are_what_two_reads_give(store, key):
    seed(store)
    want = old_lineage_candidates(store, *key)
    archived = old_lineage_archived(store, *key)
    store.hold("new", key)
    assert store.session_state("new") == (None, [], [], [], None)
    assert store._cands == (key, want)
    assert store._archived == (key, archived)
    assert store.lineage_candidates(*key) == want
    assert store._cands is None  # once: then from the store again
    assert store.lineage_candidates(*key) == want
    assert store.lineage_archived(*key) == archived
    assert store._archived is None  # once, likewise
    assert store.lineage_archived(*key) == archived
    if key == ("F", "anthropic"):
        assert want == ["c0", "c1", "c5", "c3"]
        assert archived == [("c1", "c1\x1f10"), ("c1", "c1\x1f3"), ("c5", "c5\x1f1"), ("c5", "c5\x1f2"),
                            ("c4", "c4\x1f1")]
    if key == ("F", "chat"):
        assert archived == [("c2", "c2\x1f1")]


def test_a_stored_sessions_state_read_with_its_candidates_is_the_same_state(store):
    seed(store)
    store.save_copy("c1", '{"refs": []}', expect=store.version("c1"))
    before = old_session_state(store, "c1")
    store.hold("c1", ("F", "anthropic"))
    assert store.session_state("c1") == before
    assert store.lineage_candidates("F", "anthropic") == ["c0", "c1", "c5", "c3"]
    assert store.session_state("c1") == before  # (read the usual way: nothing asked with it)


def test_what_was_read_with_a_session_is_not_answered_after_a_write_a_release_or_for_another_key(store):
    seed(store)
    key = ("F", "anthropic")
    store.hold("new", key)
    store.session_state("new")
    # this instance writes a new candidate meanwhile (Lineage._adopt flushes kept-back parts first)
    store.commit_turn(session_row("c9", "anthropic", 99.0, 2), [LedgerRow("h_9", "z" * 64, "m00001", "user", "text", 1)],
                      expect=0, fresh=True)
    store.db.execute("UPDATE sessions SET created=99.0 WHERE id='c9'")
    store.save_lineage_parts("c9", 0, [("m00001", "z" * 64, "F")])
    store.save_lineage_parts(store_mod.archived_record("c9", 1), 0, [("m00001", "z" * 64, "F")])
    assert store.lineage_candidates(*key) == ["c0", "c1", "c5", "c3", "c9"]
    assert store.lineage_archived(*key)[-1] == ("c9", "c9\x1f1")
    # released: forgotten
    store.hold("new2", key)
    store.session_state("new2")
    store.release()
    assert store._cands is None and store._archived is None and store._want is None
    # another key: read from the store, and the stash stays out of its way
    store.hold("new3", key)
    store.session_state("new3")
    assert store.lineage_candidates("F", "chat") == ["c2"]
    assert store.lineage_archived("F", "chat") == [("c2", "c2\x1f1")]
    assert store.lineage_candidates(*key) == ["c0", "c1", "c5", "c3", "c9"]
    assert store.lineage_archived(*key) == old_lineage_archived(store, *key)
    # a hold of another session, or none: the next session_state reads the usual way
    store.hold("new4", key)
    assert store.session_state("new5") == (None, [], [], [], None)
    assert store._cands is None
    store.hold("new6")
    assert store.session_state("new6") == (None, [], [], [], None) and store._cands is None


def test_the_one_read_fails_as_a_read_of_the_store(store, monkeypatch):
    store.hold("x", ("F", "anthropic"))
    store.db.close()
    with pytest.raises(StoreError):
        store.session_state("x")


@pytest.mark.parametrize("n", [1, 2, 152, 1500])
def test_fresh_first_is_the_old_check(n):
    rows = [LedgerRow(f"h_{i}", "c", f"m{i + 7:05d}", "user", "text", 1) for i in range(n)]
    assert store_mod.fresh_first(rows) == old_fresh_first(rows) == 7
    for bad in ([*rows[:-1], LedgerRow("h", "c", "m99999", "user", "text", 1)] if n > 1 else [],
                list(reversed(rows)) if n > 1 else [],
                [LedgerRow("h", "c", "m00000", "user", "text", 1), *rows]):
        if not bad:
            continue
        for fn in (store_mod.fresh_first, old_fresh_first):
            with pytest.raises(StoreError):
                fn(bad)


# -- whole turns: the code as it is and the oracles --------------------------------------------
def dump(s: Store) -> dict:
    """Every table's rows, times left out (a run's clock is its own)."""
    out = {}
    db = s.db
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name").fetchall():
        cols = [r[1] for r in db.execute(f"PRAGMA table_info({name})") if r[2].upper() != "REAL"]
        rows = db.execute(f"SELECT {', '.join(cols)} FROM {name}").fetchall()
        out[name] = sorted(map(repr, rows))
    return out


def run_twice(tmp_path: Path, scenario) -> None:
    runs = []
    for old in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if old:
                patch_old(mp)
            d = tmp_path / ("old" if old else "new")
            d.mkdir()
            eng = Engine(Store(d))
            eng.lineage.defer = True
            try:
                got = scenario(eng)
                runs.append((got, dump(eng.store)))
            finally:
                eng.store.close()
    (new, new_rows), (old, old_rows) = runs
    assert new == old
    assert new_rows == old_rows


def turn(eng: Engine, raw: bytes, lane: str, headers: dict) -> tuple:
    r = eng.process(raw, LANES[lane], headers, render=True)
    eng.lineage.flush()
    return r.body, r.refs_new, r.refs_known, r.tagged, r.notes, r.source, r.status


@pytest.mark.parametrize("lane,n", [("anthropic", 100), ("chat", 100), ("anthropic", 30)])
def test_first_turns_and_forks_are_the_oracles(tmp_path, lane, n):
    case = bench_overhead.Case(lane, n, seed=5)
    msgs = list(case.msgs)
    new = [case.new(i) for i in range(6)]  # (once: each call draws new words)

    def scenario(eng: Engine) -> list:
        out = []
        for i in range(3):  # new conversations, each a first turn
            out.append(turn(eng, case.body(msgs[:n - i]), lane, {"x-acp-session": f"s{i}"}))
        # forks of s0: its history and more (adopted: candidates read with the fork's row), one cut shorter
        out.append(turn(eng, case.body(msgs + [new[0]]), lane, {"x-acp-session": "fork-a"}))
        out.append(turn(eng, case.body(msgs[: n // 2] + [new[1]]), lane, {"x-acp-session": "fork-b"}))
        # a fork's follow-up, and the parent's
        out.append(turn(eng, case.body(msgs + [new[0], new[2]]), lane, {"x-acp-session": "fork-a"}))
        out.append(turn(eng, case.body(msgs[:n] + [new[3]]), lane, {"x-acp-session": "s0"}))
        # a restart: the same store, a new engine; the fork and a new one load from the store
        eng2 = Engine(eng.store)
        eng2.lineage.defer = True
        out.append(turn(eng2, case.body(msgs + [new[0], new[2], new[4]]), lane,
                        {"x-acp-session": "fork-a"}))
        out.append(turn(eng2, case.body(msgs + [new[5]]), lane, {"x-acp-session": "fork-c"}))
        # id-less (prefix chains): no candidates asked for
        out.append(turn(eng2, case.body(msgs[:n - 1]), lane, {}))
        return out

    run_twice(tmp_path, scenario)
    # (the forks were adopted: a note says so)
    with pytest.MonkeyPatch.context():
        d = tmp_path / "check"
        d.mkdir()
        eng = Engine(Store(d))
        try:
            got = scenario(eng)
        finally:
            eng.store.close()
    assert any("a fork of s0" in " ".join(t[4]) for t in got)


def test_the_captures_first_turns_are_the_oracles(tmp_path):
    from wirecases import capture_files, captured_bodies

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")

    def scenario(eng: Engine) -> list:
        out = []
        for k, path in enumerate(files):
            caps = captured_bodies(path)
            for j, c in enumerate(caps[:6]):
                # each body a first turn of a session of its own, then its capture's own session
                out.append(turn(eng, c.raw, c.lane.name if hasattr(c.lane, "name") else c.lane,
                                {**c.headers, "x-acp-session": f"cap-{k}-{j}"}))
                out.append(turn(eng, c.raw, c.lane.name if hasattr(c.lane, "name") else c.lane,
                                {**c.headers, "x-acp-session": f"cap-{k}"}))
        return out

    run_twice(tmp_path, scenario)


def test_sqlite3_still_reads_what_the_views_show(store):
    """(the schema is unchanged: the views read the rows a first turn writes)"""
    rows = [LedgerRow(f"h_{i}", f"{i:064x}", f"m{i + 1:05d}", "user", "text", i) for i in range(5)]
    store.hold("v", ("F", "anthropic"))
    assert store.session_state("v")[0] is None
    store.commit_turn(session_row("v", "anthropic", 1.0, 6), rows, expect=0, fresh=True)
    got = store.db.execute("SELECT ref, content_hash FROM refs WHERE session_id='v' ORDER BY ref").fetchall()
    assert got == [(r.ref, r.content_hash) for r in rows]
    assert isinstance(store.db, sqlite3.Connection)
    assert json.loads(store.db.execute("SELECT rows FROM ledger_turns").fetchone()[0])[0][2] == "m00001"


def test_conversations_waiting_for_their_answers_are_the_oracles(tmp_path):
    """New conversations and forks arrive while others' passes are kept back (no flush between
    turns, as when their answers have not come yet): the same bodies, notes and, once everything is
    flushed, the same stored rows; what opens otherwise is not stored by a new conversation's turn."""
    case = bench_overhead.Case("anthropic", 60, seed=9)
    msgs = list(case.msgs)
    new = [case.new(i) for i in range(4)]
    other = bench_overhead.Case("anthropic", 40, seed=13).msgs

    waiting: list[list[str]] = []  # (what is kept back after each turn differs by design: not compared)

    def scenario(eng: Engine) -> list:
        out = []
        waiting.clear()

        def send(m, sid):
            r = eng.process(case.body(m), LANES["anthropic"], {"x-acp-session": sid}, render=True)
            out.append((r.body, r.refs_new, r.refs_known, r.notes))
            waiting.append(sorted(eng.lineage.pending))

        send(msgs, "p")  # kept back
        send(other, "q")  # another opening: "p" stays kept back
        send(msgs + [new[0]], "f1")  # a fork of "p": its parts are stored first, then compared
        send(other + [new[1]], "g1")  # a fork of "q"
        send(msgs[:30] + [new[2]], "f2")
        send(msgs + [new[0], new[3]], "f1")  # a follow-up, the rest still waiting
        eng.lineage.flush()
        return out

    run_twice(tmp_path, scenario)
    d = tmp_path / "check"
    d.mkdir()
    eng = Engine(Store(d))
    eng.lineage.defer = True
    try:
        got = scenario(eng)
    finally:
        eng.store.close()
    assert waiting[1] == ["p", "q"]  # the new conversation "q" stored nothing "p" kept back
    assert any("a fork of p" in n for n in got[2][3]) and "p" not in waiting[2]
    assert any("a fork of q" in n for n in got[3][3])
