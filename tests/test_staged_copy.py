"""#11: the canonical copy of a folded session's pass (``reconcile.Copy``) is encoded with msgspec
(every steady turn writes it), and its write goes in the turn's commit.

The copy's document: msgspec's text is json.dumps' where it is ASCII and UTF-8 where json.dumps
escaped; a document either wrote reads back as the same copy.

A folded session's turn is staged (``registry.stages``) and the copy it rolls (``coverage.roll_copy``,
``Sessions.save_copy``) goes in the staged commit (``commit_turn(copy=)``; PostgreSQL:
``bili_commit_turn``'s last argument, schema 11): one SQLite transaction, three PostgreSQL round
trips (the lock, the commit, the release) where the copy was a write of its own.  Pinned against an
engine never staged over tests/test_churn.py's scenarios (drift, claims, truncation, collapse),
scripts/bench_session.py's seeded sessions (folds, distils, held folds, compactions) and, in
tests/test_staged_flags.py, the captures: the same bytes, refs and stored rows after every turn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import churn as C
import test_churn as TC
from bili_addon.kernel import pressure
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.reconcile import _LATER, Copy
from bili_addon.kernel.turn import Engine
from bili_addon.store import SCHEMA_VERSION, StaleSession, StoreError
from bili_addon.wire import LANES
from test_staged_flags import engine, staged_count, unstaged  # noqa: F401  (unstaged: a fixture)
from test_staged_flags import stored as stored_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_session  # noqa: E402


def copies() -> list[Copy]:
    return [
        Copy(),
        Copy(refs=["m00001", "m00002"], fps=["ab", "cd"], items=[0, 1], ids=["x", "y_1"], streak=2),
        Copy(refs=["m00001"], fps=["é✓"], items=[3], ids=["ünï\u2028\x00\"\\"], witness=["m00001"],
             truncated=["m00007"], latched=True, streak=-1),
    ]


@pytest.mark.parametrize("c", copies())
def test_the_copy_reads_back_as_it_was_whoever_wrote_it(c):
    # as the copy was written before (the fields added later left out at their defaults: Copy.to_json)
    old = json.dumps({k: v for k, v in c.__dict__.items() if v or k not in _LATER}, separators=(",", ":"))
    assert Copy.from_json(old) == c == Copy.from_json(c.to_json())
    assert json.loads(c.to_json()) == json.loads(old)
    if c.to_json().isascii():
        assert c.to_json() == old  # byte for byte where nothing was escaped


@pytest.mark.parametrize("doc", [None, "", "null", "[]", "{", '{"nope": 1}', '{"refs": 1', "NaN"])
def test_a_copy_that_does_not_read_is_empty(doc):
    assert Copy.from_json(doc) == Copy()


# -- a folded session's turn: its copy in the turn's commit --------------------------------------


def stored(store, sid: str) -> tuple | None:
    """Everything of the session the store holds (test_staged_flags.stored), its copy too, a
    block's creation time aside (the clock's: two engines fold a moment apart)."""
    rows = stored_rows(store, sid)
    if rows is None:
        return None
    blocks = [{k: v for k, v in json.loads(doc).items() if k != "created"} for doc in rows[7]]
    return (*rows[:7], blocks, *rows[8:], store.copy(sid))


def result_of(res) -> tuple:
    return (res.body, res.session, res.refs_new, res.refs_known, res.tagged, res.reused, res.executed, res.epoch,
            res.drift, res.active, res.notes, res.declined, res.marker)


class Fan:
    """Calls a method of both engines' objects (what the test's driver writes through: the store's
    usage, the clocks); returns the first one's answer."""

    def __init__(self, *objs):
        self.objs = objs

    def __getattr__(self, name):
        vals = [getattr(o, name) for o in self.objs]
        if callable(vals[0]):
            return lambda *a, **k: [v(*a, **k) for v in vals][0]
        return vals[0]


class Twin:
    """Two engines as one: ``a`` stages (as the proxy runs it: the lineage after the answer), ``b``
    never does (forced unstaged).  Every request goes through both; the results, bytes, refs and
    every stored row of the session must be equal after each turn.  Reads go to ``a``."""

    def __init__(self, a: Engine, b: Engine, off):
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)
        for e in (a, b):
            e.lineage.defer = True
        off(b)
        object.__setattr__(self, "log", [])  # the sessions a staged (per staged turn)
        object.__setattr__(self, "folded", [])  # per turn of a: (staged, folded, transactions)
        staged_count(a, self.log)

    def process(self, raw, lane, headers, *, render: bool, origin: str = ""):
        out = []
        for e in (self.a, self.b):
            w, n = e.store.writes, len(self.log)
            try:
                res = e.process(raw, lane, headers, render=render, origin=origin)
            except Exception as x:  # noqa: BLE001  (both fail alike, or the test fails)
                out.append(x)
            else:
                out.append(res)
                if e is self.a and res.session:
                    s = e.sessions.get(res.session)
                    self.folded.append((len(self.log) > n, bool(s is not None and s.blocks), e.store.writes - w,
                                        res.epoch, res.drift))
            e.lineage.flush()  # (the proxy's, after the answer)
        ra, rb = out
        if isinstance(ra, Exception) or isinstance(rb, Exception):
            assert type(ra) is type(rb), (ra, rb)
            raise ra
        assert result_of(ra) == result_of(rb)
        if ra.session:
            sa, sb = stored(self.a.store, ra.session), stored(self.b.store, ra.session)
            if sa != sb:  # (which part, readably)
                for k, (x, y) in enumerate(zip(sa, sb)):
                    if x != y:
                        import difflib
                        diff = "\n".join(difflib.unified_diff(str(x).split(", "), str(y).split(", "), lineterm="", n=1))
                        raise AssertionError(f"stored rows differ at {k}:\n{diff[:3000]}")
            assert self.a.store.copy(ra.session) == self.b.store.copy(ra.session)
        return ra

    def record_calls(self, *a, **k):
        out = []
        for e in (self.a, self.b):
            out.append(e.record_calls(*a, **k))
            e.store.release()  # (the lock its load took: the proxy lets it go after the answer)
        return out[0]

    def set_flag(self, *a, **k):
        return [e.set_flag(*a, **k) for e in (self.a, self.b)][0]

    def __getattr__(self, name):
        if name in ("store", "clocks"):
            return Fan(self.a.store if name == "store" else self.a.clocks,
                       self.b.store if name == "store" else self.b.clocks)
        return getattr(self.a, name)

    def __setattr__(self, name, value):
        for e in (self.a, self.b):
            setattr(e, name, value)

    def staged_folded(self) -> int:
        return sum(1 for staged, folded, *_ in self.folded if staged and folded)

    def one_write(self) -> list:
        """The staged turns of a folded session that were not one transaction (a new epoch, a
        drift's claims: writes of their own after the flush)."""
        if self.a.snapshot:  # (its transcript a write of its own after the flush)
            return []
        return [t for t in self.folded if t[0] and t[1] and t[2] != 1 and not t[3] and not t[4]]


H = {"x-acp-session": TC.SID}
ANTH = LANES["anthropic"]


def folded_session(store, lane: str = "anthropic", n: int = 4) -> tuple[Engine, list[bytes]]:
    """An engine (as the proxy runs it) whose session has a fold (tests/test_churn.py's), and ``n``
    follow-ups of it, each a new turn."""
    eng = engine(store)
    ts = C.turns(12)
    pair, _ = TC.fold_early_turns(eng, lane, ts, C.Scheme())
    eng.lineage.flush()
    eng.store.release()
    assert eng.sessions[TC.SID].blocks
    more = []
    for t in range(12, 12 + n):
        ts.append(C.Turn(t, f"Turn {t}: next question.", f"Reply Turn {t}.", tool=t % 2 == 0))
        more.append(C.body(lane, C.BUILD[lane](ts, C.Scheme(), pair)))
    return eng, more


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses", "gemini"])
def test_a_folded_follow_up_is_one_transaction(backend, unstaged, lane):
    """A session with a fold: its follow-up turn writes its commit and its canonical copy in one
    transaction (two before: the copy a write of its own); the same bytes and rows as unstaged."""
    a, more = folded_session(backend(), lane)
    b, _ = folded_session(backend("apart"), lane)
    unstaged(b)
    for k, raw in enumerate(more):
        copy = a.store.copy(TC.SID)
        wa, wb = a.store.writes, b.store.writes
        ra = a.process(raw, LANES[lane], H, render=True)
        rb = b.process(raw, LANES[lane], H, render=True)
        wa, wb = a.store.writes - wa, b.store.writes - wb
        for e in (a, b):
            e.lineage.flush()
        assert result_of(ra) == result_of(rb), k
        assert stored(a.store, TC.SID) == stored(b.store, TC.SID), k
        assert a.store.copy(TC.SID) != copy and b"[Compressed conversation section b1" in ra.body, k
        assert (wa, wb) == (1, 2), k  # (unstaged: the commit, the copy)


def test_a_folded_follow_up_on_postgresql_takes_two_round_trips(pg_url, tmp_path):
    """The lock with the session's state, the commit with the copy (and any flags) and the release
    in one pipeline (four before: the copy a statement of its own; three: the release its own)."""
    from bili_addon.store_pg import PgStore

    store = PgStore(pg_url, str(tmp_path))
    try:
        eng, more = folded_session(store, n=2)  # (a third reads the host's calibration: a round trip more)
        for raw in more:
            copy = store.copy(TC.SID)
            trips = store.round_trips
            eng.process(raw, ANTH, H, render=True)
            assert store.round_trips - trips == 2  # (the commit carries the unlock: tests/test_pg_release.py)
            assert store.copy(TC.SID) != copy  # (the copy rolled, in the commit)
            eng.lineage.flush()
    finally:
        store.close()


def test_a_folded_follow_up_that_fails_before_its_staged_write_keeps_nothing(backend, monkeypatch):
    eng, more = folded_session(backend())
    before = (stored(eng.store, TC.SID), eng.store.version(TC.SID), eng.store.copy(TC.SID))
    real = pressure.apply

    def boom(host, s, *a):
        assert TC.SID in host.sessions.staged and TC.SID in host.sessions.copies  # the copy rolled, staged
        raise RuntimeError("boom")

    monkeypatch.setattr(pressure, "apply", boom)
    with pytest.raises(RuntimeError):
        eng.process(more[0], ANTH, H, render=True)
    assert (stored(eng.store, TC.SID), eng.store.version(TC.SID), eng.store.copy(TC.SID)) == before
    assert TC.SID not in eng.sessions and not eng.sessions.staged and not eng.sessions.copies
    monkeypatch.setattr(pressure, "apply", real)
    clean, _ = folded_session(backend("clean"))
    for raw in more:
        assert eng.process(raw, ANTH, H, render=True).body == clean.process(raw, ANTH, H, render=True).body
        for e in (eng, clean):
            e.lineage.flush()
        assert stored(eng.store, TC.SID) == stored(clean.store, TC.SID)  # (the copy included)


@pytest.mark.parametrize("error", [StaleSession("churn", 1, 2), StoreError("down")])
def test_a_folded_staged_write_the_store_refuses_keeps_nothing(backend, error):
    """Refused: computed again from the store (the copy too) and written; failed: nothing kept."""
    eng, more = folded_session(backend())
    before = (stored(eng.store, TC.SID), eng.store.copy(TC.SID))
    real = eng.store.commit_turn
    failed = []

    def once(*a, **k):
        if not failed:
            failed.append(1)
            assert TC.SID in eng.sessions.staged and k.get("copy")  # the staged write, its copy with it
            raise error
        return real(*a, **k)

    eng.store.commit_turn = once
    clean, _ = folded_session(backend("clean"))
    if isinstance(error, StaleSession):
        got = eng.process(more[0], ANTH, H, render=True)
        assert got.body == clean.process(more[0], ANTH, H, render=True).body
    else:
        with pytest.raises(StoreError):
            eng.process(more[0], ANTH, H, render=True)
        assert TC.SID not in eng.sessions and not eng.sessions.staged and not eng.sessions.copies
        eng.lineage.flush()
        assert (stored(eng.store, TC.SID), eng.store.copy(TC.SID)) == before
        assert eng.process(more[0], ANTH, H, render=True).body == clean.process(
            more[0], ANTH, H, render=True).body
    for raw in more[1:]:
        assert eng.process(raw, ANTH, H, render=True).body == clean.process(raw, ANTH, H, render=True).body
    for e in (eng, clean):
        e.lineage.flush()
    assert stored(eng.store, TC.SID) == stored(clean.store, TC.SID)  # (the copy included)


@pytest.mark.parametrize("style,marathon,turns,obey", [("parallel", False, 150, 1.0), ("turn", True, 250, 0.1)])
def test_bench_sessions_staged_are_the_unstaged_ones(tmp_path, monkeypatch, unstaged, style, marathon, turns,
                                                     obey):
    """scripts/bench_session.py's seeded session (reminders, folds, distils, held folds landing,
    Claude Code's compactions in the marathon) through a staged engine and one never staged: the
    same bytes, results and stored rows after every turn, the folded turns staged."""
    from bili_addon.store import Store

    twins = []

    def make(store, **kw):
        twins.append(Twin(Engine(store, **kw), Engine(Store(str(tmp_path / f"b{len(twins)}")), **kw), unstaged))
        return twins[-1]

    monkeypatch.setattr(bench_session, "Engine", make)
    script = bench_session.Script(1)
    env = script.environment()
    first, steps = script.session(turns)
    run = bench_session.run_with(env, first, steps, script, 1, style, marathon=marathon, obey=obey)
    t = twins[0]
    assert run.folds_ok >= (1 if marathon else 3) and run.compactions >= marathon  # (a fold retires in one)
    assert t.staged_folded() > (turns // 4 if marathon else turns // 2)
    assert t.one_write() == [], t.one_write()  # one transaction each


CHURN = [  # test_churn's scenarios (drift, claims, truncation, collapse, re-sent copies, vouched ids)
    ("test_churn_keeps_coverage_and_an_edit_re_enters", {"lane": "anthropic"}),
    ("test_churn_keeps_coverage_and_an_edit_re_enters", {"lane": "chat"}),
    ("test_churn_keeps_coverage_and_an_edit_re_enters", {"lane": "responses"}),
    ("test_churn_keeps_coverage_and_an_edit_re_enters", {"lane": "gemini"}),
    ("test_control_without_the_layer_the_churn_re_bills", {"lane": "anthropic"}),
    ("test_cross_wire_swap_keeps_coverage", {}),
    ("test_model_switch_merging_reasoning_and_placeholdering_images", {}),
    ("test_a_systematic_re_stamp_is_never_claimed", {}),
    ("test_benign_truncation_snoozes_the_block", {}),
    ("test_a_foreign_conversation_under_the_same_id_is_drift_and_gets_no_summary", {}),
    ("test_total_collapse_pauses_passes_through_and_recovers", {}),
    ("test_a_re_sent_copy_of_folded_text_is_a_new_instance", {}),
    ("test_image_identity_is_per_payload", {}),
    ("test_vouched_ids_win_over_content_churn_and_never_leave", {}),
    ("test_a_live_id_re_used_for_another_message_is_refused_unless_resync", {}),
    ("test_snapshot_render_keeps_the_fold_through_churn_from_its_own_transcript", {}),
]


# (no turn of a folded session staged: a fold's call lands on the last request, or ids are vouched)
UNFOLDED = {"test_image_identity_is_per_payload", "test_vouched_ids_win_over_content_churn_and_never_leave",
            "test_a_live_id_re_used_for_another_message_is_refused_unless_resync"}


@pytest.mark.parametrize("name,kw", CHURN, ids=[f"{n}-{kw.get('lane', '')}" for n, kw in CHURN])
def test_churn_staged_is_the_churn_unstaged(backend, monkeypatch, unstaged, name, kw):
    """Each churn scenario of tests/test_churn.py (its own assertions too) through a staged engine
    and one never staged, compared after every request."""
    twins = []

    def make(bk, **k):
        twins.append(Twin(Engine(bk(), fold_cfg=FoldConfig(min_compress_chars=2000), **k),
                          Engine(backend(f"twin{len(twins)}"), fold_cfg=FoldConfig(min_compress_chars=2000), **k),
                          unstaged))
        return twins[-1]

    monkeypatch.setattr(TC, "make_engine", make)
    getattr(TC, name)(backend, **kw)
    if name not in UNFOLDED:
        assert twins and sum(t.staged_folded() for t in twins) >= 1  # folded turns were staged
    for t in twins:
        assert t.one_write() == [], t.one_write()


def _to_schema_10(s) -> None:
    """The store as bili of schema 10 left it: PostgreSQL's turn commit without the copy."""
    if s.backend == "sqlite":
        s.db.execute("UPDATE meta SET value='10' WHERE key='schema_version'")
    else:
        from bili_addon.store_pg import _MIGRATIONS

        s._q("DROP FUNCTION bili_commit_turn")
        with s.pool.connection() as conn:  # (no parameters: their % are PL/pgSQL's)
            conn.execute(_MIGRATIONS[10][2])  # bili_commit_turn(..., p_tail)
        s._q("UPDATE meta SET value='10' WHERE key='schema_version'")
    s.close()


def test_a_schema_10_store_migrates_and_its_sessions_go_on(backend):
    from bili_addon.store import LedgerRow, SessionRow

    s = backend()
    row = LedgerRow("h", "aa", "m00001", "user", "text", 1)
    v = s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 1, 1, 2), [row], expect=0, fresh=True)
    v = s.save_copy("old", Copy(refs=["m00001"], fps=["f"]).to_json(), expect=v)
    _to_schema_10(s)
    s = backend()
    assert s.schema_version() == SCHEMA_VERSION >= 11
    assert Copy.from_json(s.copy("old")) == Copy(refs=["m00001"], fps=["f"])
    doc = Copy(refs=["m00001", "m00002"], fps=["f", "é"], ids=["h", "h2"]).to_json()
    s.hold("old")
    w = s.writes
    v2 = s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 2, 2, 3),
                       [LedgerRow("h2", "bb", "m00002", "user", "text", 1)], expect=v,
                       minted=[("m00002", "bb")], copy=doc)
    s.release()
    assert v2 == v + 1 and s.writes - w == 1
    assert s.copy("old") == doc and Copy.from_json(s.copy("old")).fps == ["f", "é"]
    assert [r.ref for r in s.ledger("old")] == ["m00001", "m00002"]
    # without a copy: the copy stays as it was
    assert s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 3, 2, 3), [], expect=v2) == v2 + 1
    assert s.copy("old") == doc
    with pytest.raises(StaleSession):  # refused whole: neither the row nor the copy
        s.commit_turn(SessionRow("old", "", "anthropic", 0.0, 0.0, 4, 2, 3), [], expect=v2, copy="{}")
    assert s.copy("old") == doc and s.session("old").requests == 3
    s.close()
    again = backend()  # opened again: nothing to migrate
    assert again.schema_version() == SCHEMA_VERSION and again.copy("old") == doc


def test_the_captures_folded_staged_are_the_captures_unstaged(tmp_path, unstaged):
    """Every captured agent's requests under one session id each; then a fold of the first half of
    its conversation (made as a native tool call makes it: ``plugin_tool``) and the requests again,
    now follow-ups of a folded session (staged): the same bytes, results and stored rows.  (The
    captures are short: their folds are allowed from 50 characters, and few of their passes have
    the items a copy is kept for.)"""
    from bili_addon.store import Store
    from wirecases import capture_files, captured_bodies

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    t = Twin(*(Engine(Store(str(tmp_path / n)), fold_cfg=FoldConfig(min_compress_chars=50)) for n in "ab"),
             unstaged)
    folded = 0
    for k, path in enumerate(files):
        caps = captured_bodies(path)
        sid = f"cap-{k}"
        for c in caps:
            t.process(c.raw, c.lane, {**c.headers, "x-acp-session": sid}, render=True)
        s = t.a.sessions.get(sid)
        if s is None or s.last_view is None:
            continue
        refs = [p.ref for it in s.last_view.items for p in it.parts]
        if len(refs) < 4:
            continue
        args = {"content": [{"startId": refs[0], "endId": refs[len(refs) // 2],
                             "summary": "The first half of the conversation: read, nothing odd."}]}
        got = [e.plugin_tool(sid, "compress", args) for e in (t.a, t.b)]
        for e in (t.a, t.b):
            e.store.release()
        assert got[0] == got[1]
        folded += bool(t.a.sessions[sid].blocks)
        for c in caps + caps[-1:]:
            t.process(c.raw, c.lane, {**c.headers, "x-acp-session": sid}, render=True)
    assert folded >= 3 and t.staged_folded() >= 10  # (5 and 27 here)
    assert t.one_write() == [], t.one_write()
