"""Write-behind: a turn's store write goes right after its request (``Engine.write_behind``, the
proxy's way), under the session's lock, before any other work of the engine.

What it must keep: the same bytes out and the same store as writing first (bench conversations with
folds, churn and the captures); the session's lock held until the write (SQLite's too, across
processes: locks.py); a write that fails drops what the engine holds of the session, lets its lock
go, and the next turn over the same history gives the same refs the failed one sent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from bili_addon import locks, stores
from bili_addon.kernel.turn import Engine
from bili_addon.store import SessionBusy, Store, StoreError
from bili_addon.wire import LANES
from tests.oracle_runs import capture_turns
from tests.test_fold import conversation
from tests.test_folded_follow_up import bench_overhead

_CLOCKS = {"created", "last_seen", "first_seen", "ts", "executed", "pruned"}  # (when: not what)
_CREATED = re.compile(r'"created": [0-9.]+')  # (a block's clock)
TABLES = [(t, tuple(c for c in cols if c not in _CLOCKS), key) for t, (cols, key) in stores.TABLES.items()]


def engine(store, behind: bool) -> Engine:
    eng = Engine(store, activate="always")
    eng.lineage.defer = True
    eng.write_behind = behind
    return eng


def run(store, turns, behind: bool, write_now: bool = True) -> list:
    """The turns through one engine; ``write_now``: the pending write made after each turn (as the
    proxy's next job), else left to the next turn (which makes it first)."""
    eng = engine(store, behind)
    outs = []
    behind_turns[0] = 0
    for item in turns:
        if callable(item):  # a step of the scenario that is not a request (the model's call)
            eng.write_pending()  # (the proxy's keeper makes a pending write before any work)
            item(eng, outs)
            continue
        lane, headers, raw = item
        res = eng.process(raw, LANES[lane], headers, render=True)
        outs.append((res.body, res.session, res.refs_new, res.refs_known, res.tagged, res.reused, res.source,
                     tuple(res.executed)))
        behind_turns[0] += eng.pending
        if write_now:
            eng.write_pending()
        assert not eng.pending or not write_now
        eng.lineage.flush()
    eng.write_pending()
    ledgers = [store.ledger(sid) for sid in sorted({o[1] for o in outs if o[1]})]
    dumps = [[tuple(_CREATED.sub("", v) if isinstance(v, str) else v for v in row) for row in store.dump(t, cols, key)]
             for t, cols, key in TABLES]
    assert (behind_turns[0] > 0) == behind  # (write-behind was exercised: most turns left their write)
    return outs + ledgers + dumps


behind_turns = [0]  # turns of the last run that left their write for after it


def compare(tmp_path: Path, turns) -> None:
    """``turns``: a list, or a function making the scenario's turns afresh for each run."""
    got = {}
    for name, behind, now in (("first", False, True), ("behind", True, True), ("lazy", True, False)):
        d = tmp_path / name
        d.mkdir()
        store = Store(str(d))
        try:
            got[name] = run(store, turns() if callable(turns) else turns, behind, now)
        finally:
            store.close()
    assert got["behind"] == got["first"]
    assert got["lazy"] == got["first"]


def fold_call(case, msgs_box: list, sid: str):
    """The model folds the first half (one compress call in its answer, the agent's error result)."""
    def step(eng: Engine, outs) -> None:
        msgs = msgs_box[0]
        items = eng.sessions[sid].last_view.items
        ends = [it for it in items[: len(items) // 2] if it.parts and all(p.role in ("user", "tool") for p in it.parts)]
        args = {"content": [{"startId": items[0].parts[0].ref, "endId": ends[-1].parts[-1].ref,
                             "topic": "the first half", "summary": "Read the modules of the first half. " * 4}]}
        eng.record_calls(sid, [("toolu_wb", "compress", msgspec.json.encode(args).decode())])
        msgs_box[0] = msgs + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_wb", "name": "compress", "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_wb", "is_error": True,
                                          "content": "Error: No such tool available: compress"}]}]
    return step


def test_the_bench_with_a_fold_and_churn(tmp_path):
    compare(tmp_path, fold_and_churn)


def fold_and_churn() -> list:
    case = bench_overhead.Case("anthropic", 60)
    other = bench_overhead.Case("anthropic", 40, seed=5)
    box = [list(case.msgs)]
    turns = [("anthropic", {"x-acp-session": "a"}, case.body(box[0]))]
    turns.append(fold_call(case, box, "a"))

    def later(i):
        def step(eng, outs):
            box[0] = box[0] + [case.new(i), {"role": "assistant", "content": f"done {i}"}]
            lane, headers, raw = "anthropic", {"x-acp-session": "a"}, case.body(box[0])
            res = eng.process(raw, LANES[lane], headers, render=True)
            outs.append((res.body, res.session, res.refs_new, res.refs_known, res.tagged, res.reused, res.source,
                         tuple(res.executed)))
        return step

    turns.append(later(0))  # the call runs: a fold (its own write), then the turn's
    for i in range(1, 5):
        turns.append(later(i))
        turns.append(("anthropic", {"x-acp-session": "b"}, other.body(other.msgs + [other.new(i)])))
    turns.append(("anthropic", {"x-acp-session": "b"}, other.body(other.msgs[:25])))  # truncated
    turns.append(("anthropic", {}, case.body(case.msgs[:30])))  # anonymous
    return turns


@pytest.mark.parametrize("lane", ["chat", "responses"])
def test_the_other_lanes(tmp_path, lane):
    case = bench_overhead.Case(lane, 50)
    items = list(case.msgs)
    turns = []
    for i in range(4):
        items = items + [case.new(i)]
        turns.append((lane, {"x-acp-session": "c"}, case.body(items)))
    turns.append((lane, {"x-acp-session": "c"}, case.body(items[:20])))
    compare(tmp_path, turns)


def test_the_captures(tmp_path):
    turns = capture_turns()
    assert len(turns) >= 10
    compare(tmp_path, turns)


# -- the lock and the write ------------------------------------------------------------------------

def test_the_write_waits_and_the_session_stays_held(tmp_path, backend):
    """After a turn, before its write: nothing of it in the store, the session held (another
    instance's hold waits, then says busy); the write lands it and lets the session go."""
    store = backend()
    eng = engine(store, True)
    case = bench_overhead.Case("anthropic", 20)
    res = eng.process(case.body(case.msgs), LANES["anthropic"], {"x-acp-session": "held"}, render=True)
    assert res.refs_new > 0 and eng.pending and b"<acp " in res.body
    other = backend()
    other_wait(other, 0.05)
    assert other.version("held") == 0  # nothing of the turn written yet
    with pytest.raises(SessionBusy):
        other.hold("held")
    other.hold("another")  # another session is free
    other.release()
    eng.write_pending()
    assert not eng.pending
    assert other.version("held") == 1
    other.hold("held")  # free now
    other.release()
    given = {r.ref for r in other.ledger("held")}
    assert len(given) == res.refs_new


def other_wait(store, seconds: float) -> None:
    if store.backend == "postgresql":
        store.lock_wait = seconds
        if store._lock_conn is not None:
            store._lock_conn.execute(f"SET lock_timeout = {max(1, int(seconds * 1000))}")
    else:
        store._locks.wait = seconds


def test_a_failed_write_lets_go_and_the_next_turn_gives_the_same_refs(tmp_path, backend, monkeypatch):
    store = backend()
    case = bench_overhead.Case("anthropic", 30)
    headers = {"x-acp-session": "again"}
    eng = engine(store, True)
    msgs = list(case.msgs[:15])
    first = eng.process(case.body(msgs), LANES["anthropic"], headers, render=True)
    eng.write_pending()
    eng.lineage.flush()  # (answered)
    msgs += case.msgs[15:25]
    sent = eng.process(case.body(msgs), LANES["anthropic"], headers, render=True)
    assert eng.pending and sent.refs_new > 0

    def boom(*a, **k):
        raise StoreError("cannot write the store at X: i/o error", "i/o error")

    monkeypatch.setattr(store, "commit_turn", boom)
    with pytest.raises(StoreError):
        eng.write_pending()
    monkeypatch.undo()
    assert not eng.pending and "again" not in eng.sessions and "again" not in eng.sessions.memos
    other = backend()
    other_wait(other, 0.05)
    other.hold("again")  # the session was let go
    other.release()
    # the next turn over the same history (the model's answer appended) gives the refs the failed one sent
    again = eng.process(case.body(msgs + [case.msgs[25]]), LANES["anthropic"], headers, render=True)
    eng.write_pending()
    def tagged(body: bytes) -> set:  # (ref, the words it tags); not the reminder's mention of a ref
        return {t for t in re.findall(rb"<acp [^>]*>(m[0-9]+)</acp>(.{0,60})", body) if not t[1].startswith(b":")}

    tags = tagged(sent.body)
    assert len(tags) > 5 and tags - tagged(first.body)  # (refs the failed turn gave)
    assert tags <= tagged(again.body)
    refs = sorted(r.ref for r in store.ledger("again"))
    assert len(refs) == len(set(refs))


def test_a_pending_write_is_made_before_the_next_turn(tmp_path):
    store = Store(str(tmp_path))
    try:
        eng = engine(store, True)
        case = bench_overhead.Case("anthropic", 20)
        eng.process(case.body(case.msgs), LANES["anthropic"], {"x-acp-session": "x"}, render=True)
        assert eng.pending and store.version("x") == 0
        eng.process(case.body(case.msgs[:5]), LANES["anthropic"], {"x-acp-session": "y"}, render=True)
        assert store.version("x") == 1  # written first
        eng.write_pending()
        assert store.version("y") >= 1
    finally:
        store.close()


def test_a_first_pass_lets_its_decoded_items_go_after_its_request(tmp_path):
    """(#11) The structs a conversation's first pass decoded its items into (for its tags) are freed
    after the request, with the turn's other work that waits for it, not while the request waits."""
    store = Store(str(tmp_path))
    try:
        eng = engine(store, True)
        case = bench_overhead.Case("anthropic", 20)
        eng.process(case.body(case.msgs), LANES["anthropic"], {"x-acp-session": "x"}, render=True)
        assert eng.pending
        held = [fn.__self__ for fn in eng._later if getattr(fn, "__self__", None).__class__ is list]
        assert len(held) == 1 and len(held[0]) == 20 and all(isinstance(o, msgspec.Struct) for o in held[0])
        eng.write_pending()
        assert held[0] == [] and eng._later == []
    finally:
        store.close()


def test_an_unlocked_store_writes_first(tmp_path, monkeypatch):
    """Where no session lock can be had (no fcntl, a file system without locks), a turn writes
    before its request goes, as it always did."""
    monkeypatch.setattr(locks, "fcntl", None)
    store = Store(str(tmp_path))
    try:
        assert not store.exclusive
        eng = engine(store, True)
        case = bench_overhead.Case("anthropic", 20)
        eng.process(case.body(case.msgs), LANES["anthropic"], {"x-acp-session": "x"}, render=True)
        assert not eng.pending and store.version("x") == 1
    finally:
        store.close()


# -- SQLite's session locks across processes (locks.py) ----------------------------------------------

HOLDER = textwrap.dedent("""
    import sys
    from bili_addon.locks import SessionLocks
    locks = SessionLocks(__import__("pathlib").Path(sys.argv[1]), 1.0)
    assert locks.hold(sys.argv[2])
    print("held", flush=True)
    sys.stdin.readline()
""")


def test_a_session_held_by_another_process(tmp_path):
    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / locks.LOCK_NAME), "s-proc"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert p.stdout.readline().strip() == "held"
        store = Store(str(tmp_path))
        try:
            store._locks.wait = 0.05
            with pytest.raises(SessionBusy):
                store.hold("s-proc")
            store.hold("s-other")
            store.release()
            p.stdin.close()
            p.wait(10)  # the process ended: the kernel let its lock go
            store.hold("s-proc")
            store.release()
        finally:
            store.close()
    finally:
        if p.poll() is None:
            p.kill()


def test_locks_in_one_process_exclude_each_other(tmp_path):
    a = locks.SessionLocks(tmp_path / "l", 0.02)
    b = locks.SessionLocks(tmp_path / "l", 0.02)
    try:
        assert a.hold("s") and a.hold("s")  # (held already: a no-op)
        assert not b.hold("s") and b.hold("t")
        a.release()
        assert b.hold("s") and not a.hold("t")
        b.release()
        assert a.hold("t")
    finally:
        a.close()
        b.close()


def test_the_keeper_queues_the_write_after_its_caller_had_the_turn(tmp_path):
    """On mitmproxy's loop: the turn's result comes back with its write still to make (the session
    held meanwhile); the write is queued when the loop runs on (after the request went) and lands
    before any later work."""
    import asyncio

    from bili_addon.keeper import Keeper

    case = bench_overhead.Case("anthropic", 20)
    k = Keeper(lambda d: engine(Store(d), True))
    k.open(str(tmp_path))
    k.start()

    async def main():
        res = await k.call(lambda eng: eng.process(case.body(case.msgs), LANES["anthropic"],
                                                   {"x-acp-session": "kq"}, render=True))
        assert b"<acp " in res.body and k.engine.pending  # (nothing queued yet: the loop has not run on)
        other = Store(str(tmp_path))
        try:
            other._locks.wait = 0.05
            assert other.version("kq") == 0
            with pytest.raises(SessionBusy):
                other.hold("kq")
            await asyncio.sleep(0)  # the loop runs on: the write is queued
            await asyncio.get_running_loop().run_in_executor(k._pool, lambda: None)  # ... and made
            assert not k.engine.pending and other.version("kq") == 1
            other.hold("kq")
            other.release()
        finally:
            other.close()
        assert await k.call(lambda eng: eng.store.version("kq")) == 1

    try:
        asyncio.run(main())
    finally:
        k.stop()


def test_a_prune_skips_a_session_a_process_serves_and_lets_go_only_its_own(tmp_path):
    a = locks.SessionLocks(tmp_path / "l", 0.02)
    b = locks.SessionLocks(tmp_path / "l", 0.02)
    try:
        assert a.hold("turn")
        assert b.try_hold(["x", "turn"]) is None and b.held == set()  # all or none
        assert a.hold("x") is True  # (b let x go again)
        a.release()
        assert b.try_hold(["x", "y"]) == ["x", "y"] and b.hold("own")
        b.let_go(["x", "y"])
        assert b.held == {"own"} and a.hold("x") and a.hold("y") and not a.hold("own")
    finally:
        a.close()
        b.close()



PARENT, FORK = {"x-claude-code-session-id": "parent"}, {"x-claude-code-session-id": "fork"}


def _two_proxies(tmp_path, kind: str, request) -> tuple[Engine, Engine]:
    """Two proxies' engines (writing behind) on one store of ``kind``."""
    if kind == "sqlite":
        make = lambda: Store(tmp_path / "data")  # noqa: E731
    else:
        url = request.getfixturevalue("pg_url")
        make = lambda: stores.open_store(url, str(tmp_path / "pgdata"))  # noqa: E731
    return engine(make(), True), engine(make(), True)


def _more(msgs: list[dict], text: str) -> list[dict]:
    return msgs + [{"role": "assistant", "content": f"Noted: {text}."}, {"role": "user", "content": text}]


def _turn(e: Engine, msgs: list[dict], h: dict) -> dict[str, str]:
    from tests.test_fold import body, refs_in

    return refs_in(json.loads(e.process(body(msgs), LANES["anthropic"], h, render=True).body))


def _parent_so_far(one: Engine) -> tuple[list[dict], dict[str, str]]:
    """The parent's first two turns through ``one``, each written: its history and the refs it showed."""
    msgs = conversation(4)
    _turn(one, msgs, PARENT)
    _after(one)
    msgs = _more(msgs, "go on with module five")
    before = _turn(one, msgs, PARENT)
    _after(one)
    return msgs, before


def _after(e: Engine) -> None:
    """What the proxy's worker does after the request and the answer."""
    e.write_pending()
    e.lineage.flush()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_family_members_turn_is_written_before_its_request_goes(tmp_path, kind, request):
    """A parent and its fork served by two proxies on one store: the parent's turn went with refs from
    the family's counter and its write waited; the fork's turn on the other proxy (its own session's
    lock) gave the same numbers to other texts and was written first; the parent's write was then
    refused, after its request had shown one ref for two texts in the family.  A family member's turn
    is written before its request goes (a refusal computes it again)."""
    one, two = _two_proxies(tmp_path, kind, request)
    p, f = PARENT, FORK
    more, turn, after = _more, _turn, _after
    msgs, before = _parent_so_far(one)
    fork = more(msgs, "continue in the fork")
    turn(two, fork, f)
    after(two)
    parent = turn(one, more(msgs, "the parent goes on"), p)
    forked = turn(two, more(fork, "the fork goes on too"), f)
    after(two)
    after(one)
    shown = {}
    for refs in (parent, forked):
        for ref, text in refs.items():
            if ref not in before:
                assert shown.setdefault(ref, text) == text, ref
    again = turn(one, more(more(msgs, "the parent goes on"), "and further"), p)
    assert all(again[r] == t for r, t in parent.items())
    for e in (one, two):
        e.store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_fork_adopted_while_its_parents_write_waits_takes_the_refs_after_it(tmp_path, kind, request):
    """A parent in no family yet: its turn goes with refs from its own counter, its write behind the
    request.  Meanwhile another proxy meets the first request of a fork of it and adopts the fork into
    the parent's family, whose next refs it gave to the fork's own texts: the same numbers the parent's
    request had just shown for other texts (its write then refused).  The adoption now waits for the
    parent's lock (its write), as a turn of the parent would."""
    import threading

    one, two = _two_proxies(tmp_path, kind, request)
    p, f = PARENT, FORK
    more, turn, after = _more, _turn, _after
    msgs, before = _parent_so_far(one)
    parent = turn(one, more(msgs, "the parent goes on"), p)
    assert one.pending  # its write waits for the proxy's worker
    later = threading.Timer(0.2, after, (one,))  # (the worker of the parent's proxy, while the fork's turn runs)
    later.start()
    try:
        fork = turn(two, more(msgs, "continue in the fork"), f)
    finally:
        later.join()
    after(two)
    assert not one.pending and two.store.family("fork") is not None  # adopted, after the parent's write
    shown = {}
    for refs in (parent, fork):
        for ref, text in refs.items():
            if ref not in before:
                assert shown.setdefault(ref, text) == text, ref  # one ref, one text in the family
    again = turn(one, more(more(msgs, "the parent goes on"), "and further"), p)
    assert all(again[r] == t for r, t in parent.items())
    for e in (one, two):
        e.store.close()


def test_a_store_closed_twice_closes_its_lock_file_once(tmp_path):
    """A second close of a store closed its lock file's descriptor again: by then the number was another
    file's (here a pipe's; in the suite, an event loop's socket, which then failed as a bad descriptor)."""
    import os

    store = Store(tmp_path / "data")
    store.close()
    r, w = os.pipe()  # (takes the lowest free numbers: the lock file's among them)
    try:
        store.close()
        os.write(w, b"x")
        assert os.read(r, 1) == b"x"
    finally:
        os.close(r)
        os.close(w)
