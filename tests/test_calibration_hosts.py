"""A host's pooled cache observations (kernel/calibration.py): read from the store once, then kept with
this process's own added as it stores them, and read again after ``HOST_FRESH`` seconds (the other
processes on the store add theirs).  They used to be read again after every answer: one round trip
of the proxy's store worker per answer.  What a process learns from them is the same."""

from __future__ import annotations

import pytest

from bili_addon.kernel import calibration as cal_mod
from bili_addon.kernel.cache import Clocks
from bili_addon.kernel.calibration import Calibration
from tests.test_calibration import Provider, _turn


class Counting:
    """A store whose host reads are counted."""

    def __init__(self, store):
        self.store, self.host_reads = store, 0

    def host_calibration(self, *a, **kw):
        self.host_reads += 1
        return self.store.host_calibration(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _state(cal: Calibration, sids) -> list:
    return [(cal.effective_ttl(sid), cal.clocks.by_session[sid].learned(), cal.facts(sid)[1]) for sid in sids]


def test_what_is_learned_is_what_reading_the_host_every_answer_learned(backend, monkeypatch):
    """The same answers through two processes' calibrations, each over a store of its own: one keeps
    its host's observations, the other reads them after every answer (as before).  After every
    answer both apply the same facts to every session; the first read each host once."""
    kept, every = Counting(backend()), Counting(backend("other"))
    a, b = Calibration(kept, Clocks()), Calibration(every, Clocks())
    fresh = {a: cal_mod.HOST_FRESH, b: -1.0}  # (-1: always older than that: read every time)
    real = Calibration._pool

    def pool(self, *args):
        monkeypatch.setattr(cal_mod, "HOST_FRESH", fresh[self])
        return real(self, *args)

    monkeypatch.setattr(Calibration, "_pool", pool)
    monkeypatch.setattr(cal_mod, "KEEP", 8)  # (the host's newest 8 of ~40: the oldest leave as new ones come)
    # four sessions on a host whose cache keeps entries a minute, their turns interleaved (each on a
    # time line of its own: misses after 90 s teach the lifetime), then one whose short gaps teach
    # nothing of its own (it leans on the host's facts); one more on a host without a cache
    gaps = (0, 20, 90, 20, 90, 20, 90, 20, 20, 90)
    turns = [(f"s{i}", 1000.0 + 7 * i + sum(gaps[:k + 1]), "api.example.com")
             for k in range(len(gaps)) for i in range(4)]
    turns += [("late", 3000.0 + 20 * k, "api.example.com") for k in range(4)]
    turns += [("far", 4000.0 + g, "other.example.com") for g in (0, 2, 7, 10, 14)]
    providers = {cal: {} for cal in (a, b)}
    learned = set()
    for sid, t, host in turns:
        for cal in (a, b):
            _turn(cal, sid, t, providers[cal].setdefault(sid, Provider(None if sid == "far" else 60)), host=host)
        seen = [x for x in ("s0", "s1", "s2", "s3", "late", "far") if x in a.clocks.by_session]
        assert _state(a, seen) == _state(b, seen)
        learned |= {(src, str(lrn)) for _ttl, lrn, src in _state(a, seen) if src}
    assert ("host", str({"ttl": 90.0, "source": "host"})) in learned and any(s == "session" for s, _l in learned)
    assert a.effective_ttl("far") == 0.0  # (no cache there: learned by the session)
    assert kept.host_reads == 2 and every.host_reads > 40


def test_another_processs_observations_are_read_after_host_fresh_seconds(backend, monkeypatch):
    """Two processes on one store, sessions on one host: what the other stored comes in when this
    process's copy is older than ``HOST_FRESH`` seconds; its own at once."""
    clock = [100.0]
    monkeypatch.setattr(cal_mod, "_now", lambda: clock[0])
    one, two = Calibration(backend(), Clocks()), Calibration(backend(), Clocks())
    _turn(one, "a", 1000.0, Provider(60))
    assert one.facts("a") == (cal_mod.learn([]).__class__(hits=0, misses=0, extra=0, agree=1), "")
    assert len(one._pool("api.example.com", "anthropic").rows) == 1  # read once (its own observation)
    t, p = 1000.0, Provider(60)
    for gap in (0, 20, 90, 20, 90, 20, 90):  # the other process's session learns a one-minute cache
        t += gap
        _turn(two, "b", t, p)
    assert two.effective_ttl("b") == 90.0
    _turn(one, "c", t + 1, Provider(60))  # a new session here: the host's facts as this process's copy has them
    assert one.effective_ttl("c") is None and len(one._pool("api.example.com", "anthropic").rows) == 2
    clock[0] += cal_mod.HOST_FRESH + 1
    assert one.effective_ttl("c") == 90.0  # read again: the other process's observations are in
    assert len(one._pool("api.example.com", "anthropic").rows) == 9
    assert one.facts("c")[1] == "host"


@pytest.mark.parametrize("fails", [False, True])
def test_an_observation_the_store_refused_is_not_pooled(backend, fails):
    """As before: the host's pool is what the store has (a refused write is learned by its session
    only)."""
    from bili_addon.store import StoreError

    store = backend()
    cal = Calibration(store, Clocks())
    _turn(cal, "a", 1000.0, Provider(60))
    assert len(cal._pool("api.example.com", "anthropic").rows) == 1
    if fails:
        def broken(*a, **kw):
            raise StoreError("disk full")
        store.record_calibration = broken
    _turn(cal, "a", 1020.0, Provider(60))
    assert len(cal._pool("api.example.com", "anthropic").rows) == (1 if fails else 2)
    assert len(cal.sessions["a"].obs) == 2


def _reference(cal: Calibration, sid: str) -> tuple:
    """What ``facts`` gives, learned afresh from the calibration's observations (no memo)."""
    s = cal.sessions[sid]
    own = cal_mod.learn(s.obs[-cal_mod.KEEP:])
    if own.learned:
        return own, "session"
    pool = cal.hosts.get((s.host, s.family))
    if pool is not None:
        pooled = cal_mod.learn([o for _ts, o in pool.rows])
        if pooled.learned and not cal_mod.contradicts(pooled, s.obs[-cal_mod.KEEP:]):
            return pooled, "host"
    return own, ""


def test_an_answer_does_not_learn_every_live_session_again(backend, monkeypatch):
    """An answer applies its host's facts to every live session on the host; what each session's own
    observations and the host's teach is kept until they change, so an answer learns its own session
    and its host again, not all of them (it learned 2 per live session per answer).  What every
    session is given is what learning afresh gives, after every answer."""
    cal = Calibration(backend(), Clocks())
    calls = [0]
    real = cal_mod.learn

    def counted(obs):
        calls[0] += 1
        return real(obs)

    monkeypatch.setattr(cal_mod, "learn", counted)
    sessions = [f"s{i}" for i in range(24)]
    providers = {sid: Provider(60) for sid in sessions}
    gaps = (0, 20, 90, 20, 90, 20, 90, 20)
    per_answer = []
    for k, gap in enumerate(gaps):
        for i, sid in enumerate(sessions):
            t = 1000.0 + 3 * i + sum(gaps[:k + 1])
            calls[0] = 0
            _turn(cal, sid, t, providers[sid])
            per_answer.append(calls[0])
            for other in sessions[:i + 1] if k == 0 else sessions:
                got = cal.facts(other)
                want = _reference(cal, other)
                assert (got[0].ttl, got[0].no_cache, got[0].min_tokens, got[1]) == (
                    want[0].ttl, want[0].no_cache, want[0].min_tokens, want[1])
                clk = cal.clocks.by_session[other].learned()
                assert clk.get("ttl") == (round(want[0].ttl, 1) if want[0].ttl else None)
    assert any(cal.facts(sid)[0].ttl == 90.0 for sid in sessions)
    # a first answer: its new clock's facts too; then its own session's and its host's (24 live sessions
    # on the host: 48 learned per answer before)
    assert per_answer[0] <= 4 and max(per_answer[1:]) <= 3 and max(per_answer[len(sessions):]) <= 2
