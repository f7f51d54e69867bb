"""#11: a follow-up turn's commit is staged too (``registry.stages``), so the flags it learns (a
reminder) go in the same write: one SQLite transaction, three PostgreSQL round trips (the lock with
the session's state, the commit, the release), where the flags were a write of their own before.

Staged or not, a turn is the same: the session is as written at once in memory, only the store's
write waits for the flush before rendering, and nothing else of the session is written in between
(a turn that would write something else is not staged, or flushes first: blocks saved).  Pinned here
against the unstaged path over the bench's conversations (reminders, folds made from them, turns
after folds, retries, side requests, rewinds) and an agent's compaction: the same bytes, refs,
stored rows, flags, blocks, calls, copy and lineage.  A turn that fails before its staged write
keeps nothing, a write the store refuses is computed again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import churn as C
import compactions as X
from bili_addon.kernel import pressure, registry
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import StaleSession, StoreError
from bili_addon.wire import LANES
from test_compaction import REMINDER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

REAL = registry.stages


@pytest.fixture
def unstaged(monkeypatch):
    """``unstaged(engine)``: that engine never stages (each flag a write of its own, as before)."""
    off: list = []
    monkeypatch.setattr(registry, "stages", lambda s, tail, render, lineage: (
        False if any(lineage is o for o in off) else REAL(s, tail, render, lineage)))
    return lambda eng: off.append(eng.lineage) or eng


def engine(store) -> Engine:
    eng = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000))
    eng.lineage.defer = True  # as the proxy runs it (stored after the answer)
    return eng


def stored(store, sid: str) -> tuple:
    """Everything of the session the store holds, its version and times aside."""
    row, ledger, blocks, calls, copy = store.session_state(sid)
    if row is None:
        return None
    flags = json.loads(row.flags or "{}")
    for e in flags.get("epochs", []):
        e.pop("at")  # (the clock's)
    return (row.agent, row.lane, row.requests, row.messages, row.next_ref, flags,
            ledger, sorted(blocks), sorted(map(tuple, calls)), copy, store.lineage_parts(sid),
            store.ref_count(sid))


def staged_count(eng: Engine, log: list) -> None:
    real = eng.sessions.stage
    eng.sessions.stage = lambda sid, write: log.append(sid) or real(sid, write)


class Agent:
    """Sends a conversation through one engine as the proxy does: the answer's usage recorded, the
    lineage stored after it, a reminder answered by the model with a compress call (folded on the
    next request)."""

    def __init__(self, eng: Engine, lane: str, sid: str, fold_from: int = 0):
        self.eng, self.lane, self.sid = eng, LANES[lane], sid
        self.fold_from = fold_from  # the model ignores the reminders of the turns before this one
        self.turn = 0
        self.lane_name = lane
        self.calls: list[dict] = []  # the compress calls made so far (the agent's history keeps them)
        self.staged: list[str] = []
        self.nudges: dict = {}
        staged_count(eng, self.staged)

    def send(self, msgs: list[dict], body) -> tuple:
        w = self.eng.store.writes
        staged = len(self.staged)
        res = self.eng.process(body(msgs + self.calls), self.lane, {"x-acp-session": self.sid}, render=True)
        writes = self.eng.store.writes - w
        out = res.body if res.body is not None else body(msgs + self.calls)
        self.eng.store.record_usage(self.sid, self.lane_name, (len(out) // 4, 0, 0, 10))
        self.eng.lineage.flush()
        nudges = json.loads(self.eng.store.session(self.sid).flags).get("nudges", {})
        given = [v["text"] for k, v in nudges.items() if k not in self.nudges]
        self.nudges = nudges
        ranges = [(m.group(1), m.group(2)) for m in REMINDER.finditer(given[-1])] if given else []
        self.turn += 1
        if ranges and self.turn > self.fold_from:  # the model folds what the reminder it was given names
            args = {"content": [{"startId": a, "endId": b, "summary": f"Summary of {a}..{b}: read, nothing odd."}
                                for a, b in ranges]}
            cid = f"c{len(self.calls)}"
            self.eng.record_calls(self.sid, [(cid, "compress", json.dumps(args))])
            self.eng.store.release()  # (the lock its load took: the proxy lets it go after the answer)
            self.calls += C.proxy_call(self.lane_name, cid, "compress", args)
        return ((res.body, res.refs_new, res.refs_known, res.tagged, res.reused, res.executed, res.epoch,
                 res.drift, res.active, res.notes), len(self.staged) > staged, writes)


def histories(case: bench_overhead.Case) -> list[list[dict]]:
    """A conversation growing by steps to its end, then follow-ups, with a retry (the same body
    again), a side request (a short prefix of it) and a rewind (an older history going on)."""
    msgs = list(case.msgs)
    n = len(msgs)
    out = [msgs[: n // 3]]
    while len(out[-1]) < n:
        out.append(msgs[: len(out[-1]) + max(2, n // 12)])
    out.append(out[-1])  # a retry
    out.append(msgs[:3])  # a side request
    for i in range(6):
        out.append(out[-2 if i == 0 else -1] + [case.new(i), {"role": "assistant", "content": f"Done {i}."}])
    out.append(msgs[: n // 2] + [case.new(99)])  # a rewind
    out.append(out[-1] + [{"role": "assistant", "content": "ok"}, case.new(100)])
    return out


@pytest.mark.parametrize("lane,n", [("anthropic", 100), ("anthropic", 300), ("chat", 300)])
def test_staged_turns_are_the_unstaged_ones_with_fewer_writes(backend, unstaged, lane, n):
    case = bench_overhead.Case(lane, n, seed=5)
    convs = histories(case)
    a = Agent(engine(backend()), lane, "s", fold_from=len(convs) // 2)
    b = Agent(unstaged(engine(backend("apart"))), lane, "s", fold_from=len(convs) // 2)
    reminded_staged = folded = 0
    for k, msgs in enumerate(convs):
        had = json.loads(a.eng.store.session("s").flags).get("nudges", {}) if k else {}
        ra, staged, wa = a.send(msgs, case.body)
        rb, _, wb = b.send(msgs, case.body)
        assert ra == rb, k
        assert stored(a.eng.store, "s") == stored(b.eng.store, "s"), k
        if staged:
            assert wa == 1, k  # the commit, its flags with it
            if k and json.loads(a.eng.store.session("s").flags).get("nudges", {}) != had:
                reminded_staged += 1
                assert wb == 2, k  # (the commit, then the reminder's flags)
        folded += bool(ra[5])  # executed: a fold landed
    assert reminded_staged >= 1 and folded >= 1  # (the cases this is about)
    assert not a.staged or a.eng.store.version("s") < b.eng.store.version("s")
    assert len(a.staged) > 1  # follow-ups were staged (not the first pass alone)


def test_a_reminder_follow_up_is_one_write(backend, unstaged):
    case = bench_overhead.Case("anthropic", 300, seed=5)
    msgs = list(case.msgs)
    raws = [case.body(msgs[:100]), case.body(msgs[:130])]
    eng = engine(backend())
    H = {"x-acp-session": "r"}
    eng.process(raws[0], case.lane, H, render=True)
    eng.lineage.flush()
    before = json.loads(eng.store.session("r").flags)["nudges"]
    w, v = eng.store.writes, eng.store.version("r")
    res = eng.process(raws[1], case.lane, H, render=True)
    assert eng.store.writes - w == 1 and eng.store.version("r") == v + 1
    assert json.loads(eng.store.session("r").flags)["nudges"] != before  # it gave a reminder
    # the same as the unstaged path
    other = unstaged(engine(backend("apart")))
    for raw in raws:
        got = other.process(raw, case.lane, H, render=True)
        other.lineage.flush()
    assert got.body == res.body
    eng.lineage.flush()
    assert stored(eng.store, "r") == stored(other.store, "r")


def test_a_reminder_follow_up_on_postgresql_takes_two_round_trips(pg_url, tmp_path):
    """The lock with the session's state, the commit with the reminder's flags and the release in
    one pipeline (four before: the flags an UPDATE of their own; three: the release its own)."""
    from bili_addon.store_pg import PgStore

    store = PgStore(pg_url, str(tmp_path))
    try:
        eng = engine(store)
        case = bench_overhead.Case("anthropic", 300, seed=5)
        msgs = list(case.msgs)
        H = {"x-acp-session": "p"}
        eng.process(case.body(msgs[:100]), case.lane, H, render=True)
        eng.lineage.flush()
        before = json.loads(store.session("p").flags)["nudges"]
        trips = store.round_trips
        eng.process(case.body(msgs[:130]), case.lane, H, render=True)
        assert store.round_trips - trips == 2  # (the commit carries the unlock: tests/test_pg_release.py)
        assert json.loads(store.session("p").flags)["nudges"] != before
    finally:
        store.close()


def test_a_compaction_on_a_staged_turn_writes_the_commit_first(backend, unstaged):
    """An agent's compaction in a session with no fold: the turn is staged, the new epoch's copy
    and flags go with its commit; all as the unstaged path."""
    ts = C.turns(14)
    ask = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}
    convs = [C.anthropic(ts[:6], C.Scheme()), C.anthropic(ts, C.Scheme()), C.anthropic(ts, C.Scheme()) + [ask],
             X.claude_code_alone(), X.claude_code(C.turns(3), C.Scheme())]
    a = Agent(engine(backend()), "anthropic", "e")
    b = Agent(unstaged(engine(backend("apart"))), "anthropic", "e")
    body = lambda m: C.body("anthropic", m)  # noqa: E731
    epochs = 0
    for k, conv in enumerate(convs):
        ra, staged, _ = a.send(conv, body)
        rb, _, _ = b.send(conv, body)
        assert ra == rb, k
        assert stored(a.eng.store, "e") == stored(b.eng.store, "e"), k
        if ra[6]:
            assert staged
            epochs += 1
    assert epochs == 1 and [e["epoch"] for e in json.loads(a.eng.store.session("e").flags)["epochs"]] == [2]


def reminder_pair():
    case = bench_overhead.Case("anthropic", 300, seed=5)
    msgs = list(case.msgs)
    return case, [case.body(msgs[:100]), case.body(msgs[:130]), case.body(msgs[:160])]


def test_a_follow_up_that_fails_before_its_staged_write_keeps_nothing(backend, monkeypatch):
    case, raws = reminder_pair()
    H = {"x-acp-session": "f"}
    eng = engine(backend())
    eng.process(raws[0], case.lane, H, render=True)
    eng.lineage.flush()
    before = (stored(eng.store, "f"), eng.store.version("f"))
    real = pressure.apply

    def boom(host, s, *a):
        real(host, s, *a)  # the reminder's flags learned (staged), then the turn fails
        assert "f" in host.sessions.staged and "f" in host.lineage.pending
        raise RuntimeError("boom")

    monkeypatch.setattr(pressure, "apply", boom)
    with pytest.raises(RuntimeError):
        eng.process(raws[1], case.lane, H, render=True)
    assert (stored(eng.store, "f"), eng.store.version("f")) == before  # nothing of it written
    assert "f" not in eng.sessions and not eng.sessions.staged and "f" not in eng.lineage.pending
    eng.lineage.flush()  # (the proxy does after the answer: nothing of the failed turn to store)
    assert stored(eng.store, "f") == before[0]
    monkeypatch.setattr(pressure, "apply", real)
    clean = engine(backend("clean"))
    for raw in raws:
        if raw is not raws[0]:
            assert eng.process(raw, case.lane, H, render=True).body == clean.process(raw, case.lane, H,
                                                                                     render=True).body
        else:
            clean.process(raw, case.lane, H, render=True)
        eng.lineage.flush()
        clean.lineage.flush()
        assert stored(eng.store, "f") == stored(clean.store, "f")


@pytest.mark.parametrize("error", [StaleSession("f", 1, 2), StoreError("down")])
def test_a_staged_write_the_store_refuses_keeps_nothing(backend, monkeypatch, error):
    """Refused (another process moved the session): the turn is computed again from the store and
    goes through; failed: the error goes up (the proxy forwards the original) and nothing is kept."""
    case, raws = reminder_pair()
    H = {"x-acp-session": "f"}
    eng = engine(backend())
    eng.process(raws[0], case.lane, H, render=True)
    eng.lineage.flush()
    before = stored(eng.store, "f")
    real = eng.store.commit_turn
    failed = []

    def once(*a, **k):
        if not failed:
            failed.append(1)
            assert "f" in eng.sessions.staged  # the staged write, at the flush
            raise error
        return real(*a, **k)

    eng.store.commit_turn = once
    clean = engine(backend("clean"))
    clean.process(raws[0], case.lane, H, render=True)
    clean.lineage.flush()
    if isinstance(error, StaleSession):
        got = eng.process(raws[1], case.lane, H, render=True)
        assert got.body == clean.process(raws[1], case.lane, H, render=True).body
    else:
        with pytest.raises(StoreError):
            eng.process(raws[1], case.lane, H, render=True)
        assert "f" not in eng.sessions and not eng.sessions.staged and "f" not in eng.lineage.pending
        eng.lineage.flush()
        assert stored(eng.store, "f") == before
        assert eng.process(raws[1], case.lane, H, render=True).body == clean.process(
            raws[1], case.lane, H, render=True).body
    for e in (eng, clean):
        e.lineage.flush()
    assert stored(eng.store, "f") == stored(clean.store, "f")
    assert eng.process(raws[2], case.lane, H, render=True).body == clean.process(raws[2], case.lane, H,
                                                                                 render=True).body
    for e in (eng, clean):
        e.lineage.flush()
    assert stored(eng.store, "f") == stored(clean.store, "f")


def test_the_captures_staged_are_the_captures_unstaged(tmp_path, unstaged):
    """Every captured agent's requests, in order, then again (retries), as they came and under one
    session id each (follow-ups of one session: staged): the same bytes, results and stored rows."""
    from bili_addon.store import Store
    from wirecases import capture_files, captured_bodies

    files = capture_files()
    if not files:
        pytest.skip("no captures here (BILI_CAPTURES)")
    a, b = engine(Store(str(tmp_path / "a"))), unstaged(engine(Store(str(tmp_path / "b"))))
    log: list[str] = []
    staged_count(a, log)
    sids: set[str] = set()
    for k, path in enumerate(files):
        caps = captured_bodies(path)
        for headers in (None, {"x-acp-session": f"cap-{k}"}):
            for c in caps + caps:
                h = c.headers if headers is None else {**c.headers, **headers}
                ra, rb = (e.process(c.raw, c.lane, h, render=True) for e in (a, b))
                assert (ra.body, ra.session, ra.refs_new, ra.refs_known, ra.tagged, ra.reused, ra.notes) == (
                    rb.body, rb.session, rb.refs_new, rb.refs_known, rb.tagged, rb.reused, rb.notes), c.name
                for e in (a, b):
                    e.lineage.flush()
                if ra.session:
                    sids.add(ra.session)
                    assert stored(a.store, ra.session) == stored(b.store, ra.session), c.name
    assert all(stored(a.store, sid) == stored(b.store, sid) for sid in sids)
    assert len(log) > len(files)  # follow-ups were staged
