"""Calibration of the cache model (kernel/calibration.py): the evidence rules on hand-worked
observations, and the learning through a real store (SQLite and PostgreSQL), per session and per host."""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel.cache import Clocks
from bili_addon.kernel.calibration import EVIDENCE, Calibration, Observation, learn

HIT, MISS = 2000, 0


def obs(*pairs: tuple[float, int], predicted: int = 2000) -> list[Observation]:
    """``(age, reported read)`` pairs of requests the model expected to read ``predicted`` tokens."""
    return [Observation(predicted, rep, age) for age, rep in pairs]


# -- the evidence rules, hand-worked ------------------------------------------------------------------
def test_agreement_teaches_nothing():
    f = learn(obs((10, HIT), (40, HIT), (200, HIT), (5, HIT)) + [Observation(0, 0, None)])
    assert not f.learned and (f.hits, f.misses, f.extra, f.agree) == (4, 0, 0, 5)


def test_a_shorter_lifetime_needs_several_consistent_misses():
    # a one-minute cache seen by a session with 30 s and 90 s gaps
    seen = obs((30, HIT), (90, MISS), (30, HIT), (95, MISS))
    assert learn(seen).ttl is None  # two misses: not yet
    f = learn(seen + obs((30, HIT), (120, MISS)))
    assert f.ttl == 90  # the youngest entry the provider had dropped
    assert not f.no_cache and f.min_tokens is None
    # a hit older than that: the misses were evictions, not a lifetime
    assert learn(seen + obs((30, HIT), (120, MISS), (150, HIT))).ttl is None


def test_a_miss_younger_than_a_hit_is_an_eviction_and_teaches_no_lifetime():
    f = learn(obs((100, HIT), (20, MISS), (50, MISS), (70, MISS), (110, MISS), (130, MISS)))
    assert f.ttl is None  # only two misses older than the 100 s hit
    f = learn(obs((100, HIT), (20, MISS), (110, MISS), (130, MISS), (240, MISS)))
    assert f.ttl == 110


def test_an_unexpected_read_proves_a_lifetime_too():
    f = learn(obs((90, MISS), (100, MISS), (120, MISS)))
    assert f.ttl == 90 and not f.no_cache  # no hit at all, but no short miss: a lifetime under 90 s
    f = learn(obs((90, MISS), (100, MISS), (120, MISS)) + [Observation(0, 1500, 200.0)])
    assert f.ttl is None and f.extra == 1  # the provider read after a 200 s gap: entries live that long


def test_no_cache_at_all():
    f = learn(obs((2, MISS), (5, MISS)))
    assert not f.learned
    f = learn(obs((2, MISS), (5, MISS), (3, MISS)))
    assert f.no_cache and f.ttl is None
    assert not learn(obs((2, MISS), (5, MISS), (3, MISS), (4, HIT))).no_cache  # one read: a cache exists


def test_a_larger_minimum():
    small = [Observation(1500, 0, 3.0), Observation(1800, 0, 4.0), Observation(1600, 0, 2.0)]
    big = [Observation(6000, 5900, 5.0), Observation(6100, 6000, 3.0)]
    f = learn(big + small)
    assert f.min_tokens == 1801 and f.ttl is None and not f.no_cache
    # a read of a short prefix: the minimum is not larger after all
    assert learn(big + small + [Observation(1200, 1100, 2.0)]).min_tokens is None


# -- through a store and the clocks ------------------------------------------------------------------
def _body(text: str = "sys " * 1500) -> bytes:
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 8,
                       "system": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


class Provider:
    """A provider whose cache keeps an entry ``ttl`` seconds (None: no cache), driven by the test's clock."""

    def __init__(self, ttl: float | None):
        self.ttl, self.last = ttl, None

    def read(self, now: float, tokens: int) -> int:
        hit = self.ttl is not None and self.last is not None and now - self.last < self.ttl
        self.last = now
        return tokens if hit else 0


def _turn(cal: Calibration, sid: str, now: float, provider: Provider, host: str = "api.example.com"):
    cal.clocks.sent(sid, "anthropic", _body(), now, host)
    read = provider.read(now, 1600)
    turn = cal.clocks.report(sid, read, 0 if read else 1600, 1700)
    cal.observe(sid, "anthropic", turn)
    return turn


def test_a_one_minute_cache_is_learned_for_the_session_then_shared_with_the_host(backend):
    store = backend()
    cal = Calibration(store, Clocks())
    p = Provider(60)
    t = 1000.0
    for gap in (0, 20, 90, 20, 90, 20):
        t += gap
        _turn(cal, "a", t, p)
    assert cal.effective_ttl("a") is None  # two misses after 90 s
    t += 90
    _turn(cal, "a", t, p)
    assert cal.effective_ttl("a") == 90.0
    assert cal.clocks.by_session["a"].learned() == {"ttl": 90.0, "source": "session"}
    assert cal.clocks.cold("a", t + 91) and not cal.clocks.cold("a", t + 80)
    # a new session on the same host starts from what the host taught, before any evidence of its own
    q = Provider(60)
    _turn(cal, "b", t + 1, q)
    assert cal.effective_ttl("b", "api.example.com") == 90.0
    assert cal.clocks.by_session["b"].learned()["source"] == "host"
    for gap in (10, 20, 30):  # reads after short gaps: nothing against the host's lifetime
        _turn(cal, "b", t + 1 + gap, q)
        t += gap
    assert cal.effective_ttl("b") == 90.0 and cal.summary("b")["hits"] == 3
    # ... another host does not
    _turn(cal, "c", t + 1, Provider(60), host="other.example.com")
    assert cal.effective_ttl("c") is None and cal.clocks.by_session["c"].learned() == {}
    summary = cal.summary("a")
    assert summary["turns"] == 7 and (summary["hits"], summary["misses"]) == (3, 3)
    assert summary["learned"] == {"ttl": 90.0, "hits": 3, "misses": 3, "agree": 4}
    assert summary["effective"] == {"ttl": 90.0, "source": "session"}
    assert summary["recent"][2]["verdict"] == "miss" and summary["recent"][2]["age"] == 90
    assert summary["predicted_read"] > 0 and summary["reported_read"] == 3 * 1600
    store.close()
    # persisted: another process (a restart) knows the host's lifetime at once
    store2 = backend()
    cal2 = Calibration(store2, Clocks())
    _turn(cal2, "d", 5000.0, Provider(60))
    assert cal2.effective_ttl("d") == 90.0 and cal2.clocks.cold("d", 5000.0 + 91)
    assert cal2.effective_ttl("a") == 90.0  # the session's own observations, read back
    hosts = {h["host"]: h for h in cal2.host_facts()}
    assert hosts["api.example.com"]["learned"] == {"ttl": 90.0} and hosts["api.example.com"]["observations"] == 12
    assert hosts["other.example.com"]["learned"] == {}
    store2.close()


def test_a_provider_without_cache_is_learned_and_a_session_with_its_own_reads_keeps_its_cache(backend):
    store = backend()
    cal = Calibration(store, Clocks())
    p = Provider(None)
    for i in range(EVIDENCE + 1):
        _turn(cal, "n", 100.0 + 5 * i, p, host="nocache.local")
    assert cal.effective_ttl("n") == 0.0 and cal.clocks.cold("n", 100.0 + 5 * EVIDENCE + 1)
    assert cal.summary("n")["effective"] == {"no_cache": True, "source": "session"}
    # a session at the same host whose own reports show reads: its own evidence wins
    q = Provider(600)
    for i in range(EVIDENCE + 1):
        _turn(cal, "m", 200.0 + 5 * i, q, host="nocache.local")
        if i == 0:
            assert cal.effective_ttl("m") == 0.0  # the host's fact, until the session has its own
    assert cal.effective_ttl("m") is None and cal.clocks.by_session["m"].learned() == {}
    store.close()


def test_stats_of_a_session_without_observations_and_a_failed_store_write(tmp_path, caplog):
    from bili_addon.store import Store, StoreError

    store = Store(tmp_path)
    cal = Calibration(store, Clocks())
    assert cal.summary("none") is None and cal.host_facts() == []

    def broken(*a, **k):
        raise StoreError("disk full", "disk full")

    store.record_calibration = broken
    p = Provider(None)
    for i in range(EVIDENCE + 1):  # the first request expects no read
        _turn(cal, "x", 10.0 + i, p)
    assert cal.effective_ttl("x") == 0.0  # learned in memory all the same
    assert "cannot store the cache observation" in caplog.text
    store.close()


@pytest.mark.parametrize("lane,family", [("chat", "openai"), ("gemini", "gemini")])
def test_providers_without_write_figures_store_none(tmp_path, lane, family):
    from bili_addon.store import Store

    store = Store(tmp_path)
    cal = Calibration(store, Clocks())
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 9000 + b'"}]}'
    if lane == "gemini":
        body = b'{"contents":[{"role":"user","parts":[{"text":"' + b"x" * 9000 + b'"}]}]}'
    cal.clocks.sent("o", lane, body, 1.0, "h")
    cal.observe("o", lane, cal.clocks.report("o", 0, 0, 2300))
    cal.clocks.sent("o", lane, body, 2.0, "h")
    cal.observe("o", lane, cal.clocks.report("o", 2048, 0, 2300))
    rows = store.calibration("o")
    assert [r.family for r in rows] == [family, family] and [r.reported_write for r in rows] == [None, None]
    assert rows[1].predicted_read > 0 and rows[1].age == 1.0 and rows[1].reported_input == 2300
    store.close()


def test_a_session_takes_its_hosts_facts_unless_its_own_reports_contradict_them():
    from bili_addon.kernel.calibration import Facts, contradicts

    host = Facts(ttl=90.0)
    assert not contradicts(host, obs((20, HIT), (30, HIT), (5, MISS)))  # short hits say nothing of 90 s
    assert contradicts(host, obs((20, HIT), (120, HIT)))  # an entry lived 120 s here
    assert contradicts(host, [Observation(0, 800, 95.0)])  # a read the model did not expect, after 95 s
    assert contradicts(Facts(no_cache=True), obs((3, HIT)))
    assert not contradicts(Facts(no_cache=True), obs((3, MISS), (4, MISS)))
    assert contradicts(Facts(min_tokens=3000), [Observation(2000, 1900, 2.0)])
    assert not contradicts(Facts(min_tokens=3000), [Observation(5000, 4900, 2.0)])
