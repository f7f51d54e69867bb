"""What the engine's caches let go during a turn (a session evicted for a new one, a previous pass
over the memo budget, a session another process changed) is freed after the turn's request has
left (``Engine.write_pending``, the write-behind the shell runs), not on the request's path:
freeing a session is freeing a whole conversation's objects.  The turns' bytes are the same as an
engine's that frees them at once."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)

ANTHROPIC = LANES["anthropic"]


class _Probe:
    """Weak references to what a session's state was made of (a dataclass holding dicts: the refs)."""

    def __init__(self):
        self.refs: list[weakref.ref] = []

    def watch(self, eng: Engine, sid: str) -> None:
        s = eng.sessions.get(sid)
        holder = _Held()
        s.flags["_probe"] = holder  # (not written: the turn's flags were written with its commit)
        self.refs.append(weakref.ref(holder))
        memo = eng.sessions.memos.get(sid)
        if memo is not None:
            box = _Held()
            memo.__dict__["_probe"] = box
            self.refs.append(weakref.ref(box))

    def alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.refs)


class _Held:
    pass


def _body(case: bench_overhead.Case) -> bytes:
    return case.unique_body()


def _engine(path, write_behind: bool = True, **kw) -> Engine:
    """An engine as the shell makes it (its lineage and its turn's write after the request)."""
    eng = Engine(Store(str(path)), **kw)
    eng.lineage.defer = True
    eng.write_behind = write_behind
    return eng


def test_an_evicted_session_is_freed_after_its_evictors_request(tmp_path):
    case = bench_overhead.Case("anthropic", 6, seed=3)
    eng = _engine(tmp_path / "a.db", max_sessions=2)
    probes = {}
    for i in range(2):
        sid = f"s{i}"
        eng.process(_body(case), ANTHROPIC, {"x-acp-session": sid}, render=True)
        eng.write_pending()
        eng.lineage.flush()
        probes[sid] = _Probe()
        probes[sid].watch(eng, sid)
    assert probes["s0"].alive() == 2
    # a third session: the least recently used one (s0) and its previous pass leave the caches
    eng.process(_body(case), ANTHROPIC, {"x-acp-session": "s2"}, render=True)
    assert "s0" not in eng.sessions and "s0" not in eng.sessions.memos
    assert probes["s0"].alive() == 2, "freed on the request's path"
    eng.write_pending()  # the request has left: its bookkeeping frees them
    assert probes["s0"].alive() == 0
    assert probes["s1"].alive() == 2  # (still cached)
    eng.store.close()


def test_without_write_behind_they_are_freed_when_the_turn_ends(tmp_path):
    case = bench_overhead.Case("anthropic", 6, seed=4)
    eng = _engine(tmp_path / "a.db", write_behind=False, max_sessions=1)
    eng.process(_body(case), ANTHROPIC, {"x-acp-session": "a"}, render=True)
    probe = _Probe()
    probe.watch(eng, "a")
    eng.process(_body(case), ANTHROPIC, {"x-acp-session": "b"}, render=True)
    assert probe.alive() == 0
    assert not eng.sessions.dropped
    eng.store.close()


def test_the_bytes_are_those_of_an_engine_whose_caches_never_evict(tmp_path):
    case = bench_overhead.Case("anthropic", 8, seed=5)
    small = _engine(tmp_path / "small.db", max_sessions=2)
    small.sessions.memo_bytes = 1  # (every earlier pass over the budget: dropped on each turn)
    big = _engine(tmp_path / "big.db")
    msgs = {f"s{i}": list(case.msgs) for i in range(4)}
    for step in range(16):
        sid = f"s{step % 4}"
        msgs[sid].append(case.new(step))
        raw = case.body(msgs[sid])
        outs = []
        for eng in (small, big):
            r = eng.process(raw, ANTHROPIC, {"x-acp-session": sid}, render=True)
            eng.write_pending()
            eng.lineage.flush()
            outs.append((r.body, r.refs_new, r.refs_known))
        assert outs[0] == outs[1]
    assert len(small.sessions) == 2 and not small.sessions.dropped
    for eng in (small, big):
        eng.store.close()
