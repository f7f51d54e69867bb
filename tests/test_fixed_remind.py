"""#11, a conversation's first turn: the fixed costs of its reminder and of loading its session cut
without changing a decision or a stored byte.  A flag set while its session's commit is staged has its
JSON made when the flush writes that commit (``Sessions.unwritten``), not at once (a first turn's
reminder is stored after its request goes, with write-behind).

The oracles are the functions as they were (kept below, patched in), compared with the code as it is
by whole Engine runs (tests/oracle_runs.py) over the bench's conversations (first turns, forks,
follow-ups, windows that make the reminder urgent and cut tool outputs; written behind the request
or not), its folded follow-ups, the folds of every kind of tests/test_folded_follow_up.py, and the
captures (BILI_CAPTURES): the same bytes out, the same results, the same flags (as stored: their
JSON, byte for byte, and as the session's row holds them once written), ledgers and lineage; and on
both backends, the row a first turn with a reminder stores."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from bisect import bisect_left, bisect_right
from pathlib import Path

import pytest

from bili_addon import locks
from bili_addon.kernel import fold, nudge, pressure, registry
from bili_addon.kernel.compaction import asks_for_summary
from bili_addon.kernel.fold import Block, View
from bili_addon.kernel.nudge import NudgeConfig
from bili_addon.kernel.pressure import PressureHost
from bili_addon.kernel.state import Resolved, Session
from bili_addon.kernel.tags import format_tokens
from bili_addon.wire.base import TEXT
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import StaleSession
from bili_addon.wire import LANES

from tests import oracle_runs
from tests.oracle_runs import same_runs
from tests.test_first_fixed import Trace, benchs_turns, conversation
from tests.test_first_fixed import again
from tests.test_folded_follow_up import folds_of_every_kind, random_view

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


# -- the oracles: the functions as they were --------------------------------------------------------

def old_flush(self, last: bool = False) -> None:
    while self.staged:
        sid = next(iter(self.staged))
        self.staged[sid](self.copies.get(sid), last and len(self.staged) == 1)
        del self.staged[sid]
        self.copies.pop(sid, None)


def old_unstage(self) -> list[str]:
    dropped = list(self.staged)
    self.staged.clear()
    self.copies.clear()
    for sid in dropped:
        self.forget(sid)
    return dropped


def old_set_flags(self, sid: str, values: dict) -> bool:
    s = self.load(sid)
    changed = {k: v for k, v in values.items() if s.flags.get(k) != v}
    if not changed:
        return False
    s.flags.update(changed)
    s.row.flags = json.dumps(s.flags, sort_keys=True)
    if sid not in self.staged:  # else the staged commit writes the row with them
        s.stored = self.store.set_flags(s.row, expect=s.stored)
    if any(k in registry.RENDER_FLAGS for k in changed):
        s.version += 1  # old items render differently now
    return True


def old_runs_unfolded(view, protected: set[int]) -> list[tuple[str, str, int, int]]:
    out = []
    items = view.items
    tokens, filled, _peak = view.sums()
    begin = 0
    stops = sorted(protected)
    stops.append(len(items))
    for stop in stops:
        if stop > begin:
            n = filled[stop] - filled[begin]  # the items with parts
            if n:
                first = bisect_right(filled, filled[begin], begin) - 1
                last = bisect_left(filled, filled[stop], 0, stop) - 1
                out.append((items[first].parts[0].ref, items[last].parts[-1].ref, n, tokens[stop] - tokens[begin]))
        if stop >= begin:
            begin = stop + 1
    return out


def old_decide(view: View, blocks: list[Block], fold_cfg: FoldConfig, cfg: NudgeConfig, used: int, window: int,
           last_nudge_at: int, cov: dict[str, Block] | None = None) -> str | None:
    """The reminder for this turn, or None.  ``used``: the input tokens the last answer reported;
    ``last_nudge_at``: ``used`` when the last reminder was given (lowered when the context shrank);
    ``cov``: ``fold.coverage(blocks)``, when the caller has it."""
    urgent = window > 0 and used >= cfg.pressure * window
    if not urgent and last_nudge_at and used - last_nudge_at < cfg.regrowth_tokens:
        # whatever could be folded, nothing is asked again before the context grew: the ranges are
        # not looked for (the turns after a reminder or a fold stop here).  The view's figures
        # against the coverage are kept running, for the next view to extend
        if cov:
            view.unfolded(cov)
        return None
    if cov is None:
        cov = fold.coverage(blocks)
    least = fold_cfg.min_compress_chars
    ranges = [r for r in nudge.compressible(view, blocks, fold_cfg, cov) if r[3] * 4 >= least]
    distil = nudge.distillable(view, blocks, fold_cfg, cfg, ranges=ranges, cov=cov)
    if not ranges and not distil:
        return None
    pending = 0
    for r in ranges:
        pending += r[3]
    if not urgent and pending < cfg.batch_tokens and not distil:
        return None
    if not distil and (urgent or pending >= cfg.batch_tokens):
        distil = nudge.distillable(view, blocks, fold_cfg, cfg, along=True, ranges=ranges, cov=cov)
    if len(ranges) > 5:
        listed = sorted(ranges, key=nudge._by_tokens)[:5]
        listed.sort(key=nudge._by_start)
    else:  # (every range listed: by start, the ranges of one start in the order of their tokens)
        listed = sorted(ranges, key=nudge._by_start_tokens) if len(ranges) > 1 else ranges
    lines = [f"  {s}–{e}  {n} messages  ~{format_tokens(t)} tokens" for s, e, n, t in listed]
    if distil:  # the pile stands before every range: oldest first, as the wire has them
        first, last, n, t = distil
        lines.insert(0, f"  {first}–{last}  {n} summaries  ~{format_tokens(t)} tokens (distil them into one)")
    if urgent:
        head = "[bili] The context is nearly full: fold consumed work now, oldest first."
    elif pending >= cfg.batch_tokens:
        head = f"[bili] ~{format_tokens(pending)} tokens of older work can be folded; fold what you no longer need verbatim:"
    else:
        head = "[bili] The summaries have piled up. Fold them into one denser summary:"
    return "\n".join([
        head,
        *lines,
        "One compress call, one entry per range, alongside your next step if you like.",
    ])


def old_apply(host: PressureHost, s: Session, view: View, resolved: list[list[Resolved]], new: bool = False,
              snoozed=()) -> None:
    """Nudge and emergency truncation, decided from the usage the last answer reported.  ``new``:
    the store had no row of the session when this turn loaded it, so no answer of it is recorded
    (usage is recorded for a stored session only): nothing to read."""
    if not view.items:
        return
    last = None if new else host.reported_usage(s)
    # the size the provider reported for the last request; without one (a Chat stream without
    # include_usage), the conversation's own estimate
    blocks = s.blocks
    cov = fold.coverage(blocks) if blocks else {}  # (read by the reminder and the truncations too)
    if last:
        used = last[0]
    elif not blocks:  # nothing folded: every part counts
        used = view.sums().tokens[-1]
    else:
        # (the tokens of the parts no block holds)
        used = ((view.unfolded(cov).tokens[-1] if cov else view.sums().tokens[-1])
                + sum(b.summary_tokens for b in blocks if b.active))
    known = s.flags.get("truncated", {})
    if not last and known:  # (the estimate counts the outputs cut before as cut)
        used -= sum(p.tokens - len(known[p.ref]) // 4 for it in view.items for p in it.parts
                    if p.ref in known and p.ref not in cov)
    window = host.window_for(s)
    flags = s.flags
    at = flags.get("last_nudge_at", 0)
    if used < int(at):
        # a fold (or the host's own compaction) shrank the context: growth counts from here
        host.set_flag(s.row.id, "last_nudge_at", used)
        at = flags.get("last_nudge_at", 0)
    cfg = host.nudge_cfg
    if used < min(cfg.batch_tokens, cfg.distil_tokens, cfg.pressure * window, cfg.truncate_at * window):
        return  # not even the whole context would be worth a fold, and the window is far
    nudges = dict(flags.get("nudges", {}))
    newest = resolved[-1]
    if newest and not (nudges and pressure._given(newest, nudges)):
        text = old_decide(view, blocks, host.fold_cfg, cfg, used, window, int(at), cov)
        if text and not asks_for_summary(view):  # (asked only when there is a reminder to give)
            prose = None
            for r in reversed(newest):  # (the last of the user's prose parts, else the last part)
                core = r.core
                if core.role == "user" and core.ctype == TEXT and core.path and core.text.strip():
                    prose = r
                    break
            if prose is not None or not any(r.core.role == "assistant" for r in newest):  # (never a prefill)
                nudges[(newest[-1] if prose is None else prose).entry.ref] = {
                    "text": text, "how": "item" if prose is None else "suffix"}
                host.sessions.set_flags(s.row.id, {"nudges": nudges, "last_nudge_at": used})  # one write
    cut = nudge.truncations(view, blocks, host.fold_cfg, cfg, used, window, cov, known)
    if cut:
        host.set_flag(s.row.id, "truncated", {**cut, **known})


def old_offset(session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "big") >> 2


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(nudge, "_runs_unfolded", old_runs_unfolded)
    mp.setattr(nudge, "decide", old_decide)
    mp.setattr(pressure, "apply", old_apply)
    mp.setattr(locks, "offset", old_offset)
    mp.setattr(registry.Sessions, "flush", old_flush)
    mp.setattr(registry.Sessions, "unstage", old_unstage)
    mp.setattr(registry.Sessions, "set_flags", old_set_flags)


# -- whole Engine runs: as they are, and with the oracles patched in ----------------------------------

class Behind(Trace):
    """A run as the proxy runs it: each turn's write after its request (write-behind), read once
    written (the next turn writes it first, as the keeper does)."""

    def __init__(self, e):
        super().__init__(e)
        e.write_behind = True
        assert e.store.exclusive  # (SQLite's session locks: write-behind applies)

    def send(self, raw: bytes, sid: str, lane=LANES["anthropic"], answered: bool = True):
        res = self.e.process(raw, lane, {"x-acp-session": sid}, render=True)
        self.pending = self.e.pending
        self.e.write_pending()
        if answered:
            self.e.lineage.flush()
        s = self.e.sessions.get(res.session) if res.session else None
        self.turns.append((dict(vars(res)), self.pending, None if s is None else (
            s.row.flags, json.dumps(s.flags, sort_keys=True, default=str), s.sent_tokens, s.unfolded_tokens,
            s.row.next_ref, s.version, [(b.id, b.active, b.covered) for b in s.blocks])))
        if sid not in self.sids:
            self.sids.append(sid)
        return res


def both(tmp_path: Path, scenario, trace=Trace) -> list:
    return same_runs(tmp_path, scenario, patch_oracles, trace)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 40_000, 25_000, 6_000])
@pytest.mark.parametrize("big", [False, True])
def test_the_benchs_turns_are_the_oracles(tmp_path, lane, n, window, big):
    """New conversations' first turns, a fork, follow-ups; reminders of both kinds, urgent ones,
    truncations: written before the request goes."""
    both(tmp_path, benchs_turns(lane, n, window, big))


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("window", [0, 25_000, 6_000])
def test_the_benchs_turns_written_behind_are_the_oracles(tmp_path, lane, window):
    """The same, each turn's write after its request (as the proxy runs): the row as stored and as
    the session holds it once written."""
    new = both(tmp_path, benchs_turns(lane, 100, window, True), Behind)
    assert any(t[1] for t in new[0])  # (turns were written behind their requests)


@pytest.mark.parametrize("window", [0, 40_000, 20_000])
@pytest.mark.parametrize("behind", [False, True])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window, behind):
    both(tmp_path, oracle_runs.folded_follow_ups(window), Behind if behind else Trace)


@pytest.mark.parametrize("window", [0, 30_000, 12_000])
@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window, materialize):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, materialize))


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old


# -- the row a staged turn writes, on both backends --------------------------------------------------

def _first_turns(store, behind: bool) -> list:
    case = bench_overhead.Case("anthropic", 100, seed=5)
    eng = Engine(store, window=25_000)
    eng.lineage.defer = True
    eng.write_behind = behind
    out = []
    msgs = conversation(case, 0, True)
    for k, sid in enumerate(("a", "a", "b")):
        raw = case.body(msgs + [case.new(i) for i in range(k)])
        res = eng.process(raw, LANES["anthropic"], {"x-acp-session": sid}, render=True)
        eng.write_pending()
        eng.lineage.flush()
        row = store.session(sid)
        out.append((res.body, res.refs_new, row.flags, row.requests, row.next_ref, eng.sessions[sid].row.flags))
    return out


@pytest.mark.parametrize("behind", [False, True])
def test_a_staged_turns_row_is_the_oracles_on_both_backends(backend, behind):
    """A first turn with a reminder and a truncation, its follow-up, another first turn: the rows
    stored (their flags' JSON byte for byte) and the bytes out as before, on SQLite and PostgreSQL."""
    deferred: list[bool] = []
    real = registry.Sessions.flush
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry.Sessions, "flush", lambda self, last=False: deferred.append(bool(self.unwritten))
                   or real(self, last))
        new = _first_turns(backend(), behind)
    assert any(deferred)  # (flags were set while staged: their JSON made by the flush)
    with pytest.MonkeyPatch.context() as mp:
        patch_oracles(mp)
        old = _first_turns(backend("old"), behind)
    assert new == old
    flags = json.loads(new[0][2])
    assert flags["nudges"] and flags["truncated"]  # (the turn learned flags: they were deferred)


def test_a_flag_set_while_staged_is_in_the_row_the_flush_writes(tmp_path):
    """Until the flush, the staged row keeps the flags it had; the flush writes them into it, once,
    as json.dumps(flags, sort_keys=True) of the session's flags; a flag set after the flush is
    written at once (nothing staged)."""
    from bili_addon.store import SessionRow, Store

    store = Store(tmp_path)
    sessions = registry.Sessions(store)
    s = sessions.load("x", "agent", "anthropic")
    row = SessionRow("x", "agent", "anthropic", 1.0, 1.0, 1, 2, 3, s.row.flags)
    written: list = []

    def write(copy, release):
        written.append(row.flags)
        s.stored = store.commit_turn(row, [], None, expect=s.stored, minted=[], copy=copy, release=release)

    sessions.stage("x", write)
    s.row = row
    assert sessions.set_flags("x", {"nudges": {"m1": {"text": "fold – now", "how": "item"}}, "last_nudge_at": 7})
    assert not sessions.set_flags("x", {"last_nudge_at": 7})  # (unchanged: nothing to write)
    assert sessions.set_flag("x", "truncated", {"m2": "cut"})  # a render flag: the version moves
    assert s.version == 1
    assert row.flags == "{}" and sessions.unwritten
    sessions.flush(last=True)
    want = json.dumps(s.flags, sort_keys=True)
    assert written == [want] and row.flags == want and store.session("x").flags == want
    assert not sessions.unwritten
    assert sessions.set_flag("x", "ttl", {"choice": "1h"})
    assert store.session("x").flags == json.dumps(s.flags, sort_keys=True) == s.row.flags
    store.close()


def test_a_failed_turn_drops_what_it_deferred(tmp_path):
    """unstage (a turn failed before its write) forgets the deferred flags with the session; a
    refused write is computed again from the store."""
    from bili_addon.store import Store

    store = Store(tmp_path)
    sessions = registry.Sessions(store)
    s = sessions.load("y")
    sessions.stage("y", lambda copy, release: (_ for _ in ()).throw(StaleSession("y", 0, 1)))
    sessions.set_flag("y", "native_tools", True)
    with pytest.raises(StaleSession):
        sessions.flush()
    assert s.row.flags == '{"native_tools": true}'  # (made before the write, as set_flags made it)
    assert sessions.unstage() == ["y"] and not sessions.unwritten and "y" not in sessions
    sessions.stage("y", lambda copy, release: None)
    sessions.load("y")
    sessions.set_flag("y", "native_tools", True)
    assert sessions.unstage() == ["y"] and not sessions.unwritten
    store.close()


# -- property by property ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(100))
def test_the_unfolded_runs_are_the_oracles(seed):
    """nudge._runs_unfolded (a run's own first and last items looked at before a search) as it was,
    over random views (items without parts among them) and protected sets of every shape."""
    rng = random.Random(seed)
    view, _blocks, _hidden = random_view(rng, rng.choice([1, 3, 8, 20, 60, 150]))
    n = len(view.items)
    for _ in range(20):
        protected = ({k for k in range(n) if rng.random() < rng.choice([0.0, 0.1, 0.5, 0.9])} if rng.random() < 0.7
                     else view.protected(FoldConfig(recent_parts=rng.choice([0, 1, 4, 40]))))
        assert nudge._runs_unfolded(again(view), sorted(protected)) == old_runs_unfolded(again(view), protected)


def test_the_lock_offsets_are_the_hashes():
    """A session's byte in the lock file is its hash's, made once (another process running the old
    code locks the same byte); the offsets kept are bounded."""
    rng = random.Random(1)
    ids = [f"s{i}" for i in range(locks._OFFSETS_KEPT + 50)] + ["\udcff\x00é", "", "x" * 5000]
    for sid in ids + [rng.choice(ids) for _ in range(2000)]:
        assert locks.offset(sid) == old_offset(sid)
        assert len(locks._OFFSETS) <= locks._OFFSETS_KEPT


@pytest.mark.parametrize("seed", range(150))
def test_the_reminder_is_the_oracles(seed):
    """nudge.decide (no pile asked for without blocks; two ranges ordered without a sort) as it was,
    over random views and blocks, nothing folded or folds active, urgent or not, given before or not."""
    rng = random.Random(seed)
    view, blocks, _hidden = random_view(rng, rng.choice([3, 8, 20, 60, 150]))
    if rng.random() < 0.4:
        blocks = []
    elif rng.random() < 0.3:
        for b in blocks:
            b.active = rng.random() < 0.5
    fcfg = FoldConfig(min_compress_chars=rng.choice([0, 200, 5000]), recent_parts=rng.choice([1, 4, 12]))
    ncfg = NudgeConfig(batch_tokens=rng.choice([0, 500, 12_000]), distil_tokens=rng.choice([0, 600, 5000]),
                       distil_along_tokens=rng.choice([0, 200, 1500]))
    for _ in range(4):
        used = rng.choice([0, 1_000, 20_000, 150_000])
        window = rng.choice([0, 25_000, 200_000])
        last = rng.choice([0, used, max(0, used - 20_000)])
        cov = fold.coverage(blocks) if rng.random() < 0.5 else None
        want = old_decide(again(view), blocks, fcfg, ncfg, used, window, last)
        assert nudge.decide(again(view), blocks, fcfg, ncfg, used, window, last, cov) == want
        assert nudge.decide(view, blocks, fcfg, ncfg, used, window, last) == want
