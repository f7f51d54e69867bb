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
    real = Calibration._host

    def host(self, *args):
        monkeypatch.setattr(cal_mod, "HOST_FRESH", fresh[self])
        return real(self, *args)

    monkeypatch.setattr(Calibration, "_host", host)
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
    assert len(one._host("api.example.com", "anthropic")) == 1  # read once (its own observation)
    t, p = 1000.0, Provider(60)
    for gap in (0, 20, 90, 20, 90, 20, 90):  # the other process's session learns a one-minute cache
        t += gap
        _turn(two, "b", t, p)
    assert two.effective_ttl("b") == 90.0
    _turn(one, "c", t + 1, Provider(60))  # a new session here: the host's facts as this process's copy has them
    assert one.effective_ttl("c") is None and len(one._host("api.example.com", "anthropic")) == 2
    clock[0] += cal_mod.HOST_FRESH + 1
    assert one.effective_ttl("c") == 90.0  # read again: the other process's observations are in
    assert len(one._host("api.example.com", "anthropic")) == 9
    assert one.facts("c")[1] == "host"


@pytest.mark.parametrize("fails", [False, True])
def test_an_observation_the_store_refused_is_not_pooled(backend, fails):
    """As before: the host's pool is what the store has (a refused write is learned by its session
    only)."""
    from bili_addon.store import StoreError

    store = backend()
    cal = Calibration(store, Clocks())
    _turn(cal, "a", 1000.0, Provider(60))
    assert len(cal._host("api.example.com", "anthropic")) == 1
    if fails:
        def broken(*a, **kw):
            raise StoreError("disk full")
        store.record_calibration = broken
    _turn(cal, "a", 1020.0, Provider(60))
    assert len(cal._host("api.example.com", "anthropic")) == (1 if fails else 2)
    assert len(cal.sessions["a"].obs) == 2
