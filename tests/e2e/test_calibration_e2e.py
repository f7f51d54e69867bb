"""Calibration of the cache model through a real mitmdump (#10): a provider whose cache keeps
entries one minute (the documentation says five) is learned from its reports, per session and then
per host (persisted: a restarted proxy starts new sessions from it); a provider that never caches is
learned as such.  Predicted vs reported cache reads show in ``/__bili/stats``.  Time is an injected
clock shared by the fake provider and the proxy (tests/e2e/clock_addon.py): no sleeps."""

from __future__ import annotations

import time
import uuid

import pytest

from .cache_upstream import CacheUpstream, FileClock
from .support import HERE, Mitmdump, anthropic_client, openai_client

pytestmark = pytest.mark.e2e

CLOCK_ADDON = HERE / "clock_addon.py"
SYSTEM = "You are a careful assistant working on a large code base. " * 120  # ~1.7K tokens: cacheable


class ClockedProxy(Mitmdump):
    def __init__(self, workdir, upstream_port, clock: FileClock, **kw):
        super().__init__(workdir, upstream_port, **kw)
        self.clock = clock

    def command(self) -> list[str]:
        return super().command() + ["-s", str(CLOCK_ADDON), "--set", f"test_clock_file={self.clock.path}"]


def wait_answers(proxy: Mitmdump, sid: str, n: int) -> dict:
    """The session's stats entry once ``n`` answers are calibrated (answers are accounted after they
    reach the client, on the store's worker)."""
    deadline = time.monotonic() + 15
    while True:
        s = proxy.session(sid) or {}
        if (s.get("calibration") or {}).get("turns", 0) >= n or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


@pytest.fixture
def clock(tmp_path):
    return FileClock(tmp_path / "clock")


def test_a_one_minute_cache_is_learned_and_shown_and_kept_for_the_host(tmp_path, clock):
    with CacheUpstream(clock, ttl=60) as up:
        proxy = ClockedProxy(tmp_path / "p", up.port, clock).start()
        try:
            sid = f"e2e-calib-{uuid.uuid4().hex[:8]}"
            client, _tee = anthropic_client(proxy.url)
            messages: list[dict] = []
            gaps = (0, 20, 90, 20, 90, 20, 90, 20, 100)
            for i, gap in enumerate(gaps):
                clock.advance(gap)
                messages.append({"role": "user", "content": f"step {i}: go on"})
                kw = dict(model="claude-sonnet-4-5", max_tokens=16,
                          system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                          messages=messages, extra_headers={"x-claude-code-session-id": sid})
                if i == 4:  # one answer streamed: its usage comes in message_start
                    with client.messages.stream(**kw) as stream:
                        answer = stream.get_final_message()
                else:
                    answer = client.messages.create(**kw)
                assert answer.content[0].text == "ok"
                messages.append({"role": "assistant", "content": "ok"})
                wait_answers(proxy, sid, i + 1)
            s = wait_answers(proxy, sid, len(gaps))
            c = s["calibration"]
            # the fake's own reports, as the proxy recorded them
            assert [r[1] > 0 for r in up.reports] == [False, True, False, True, False, True, False, True, False]
            assert c["turns"] == len(gaps) and c["host"] == "127.0.0.1" and c["family"] == "anthropic"
            assert (c["hits"], c["misses"]) == (4, 3)
            assert c["effective"] == {"ttl": 90.0, "source": "session"}  # the entry was gone after 90 s, 3 times
            assert c["learned"]["ttl"] == 90.0
            rows = proxy.admin(f"/__bili/stats?session={sid}")[1]["calibration"]
            assert [r["verdict"] for r in rows] == ["none", "hit", "miss", "hit", "miss", "hit", "miss", "hit", "none"]
            # the last gap (100 s) is past the learned lifetime: predicted a miss, and so it was
            assert rows[-1]["predicted_read"] == 0 and rows[-1]["reported_read"] == 0 and rows[-1]["gap"] == 100
            for r in rows:
                if r["verdict"] == "hit":  # predicted vs reported reads, tokens estimated vs counted
                    assert r["reported_read"] > 0 and r["predicted_read"] > 0 and r["age"] == 20
                    assert 0.5 < r["predicted_read"] / r["reported_read"] < 2
                if r["verdict"] == "miss":
                    assert r["age"] == 90 and r["reported_write"] > 0
            assert c["reported_read"] == sum(r[1] for r in up.reports)
            hosts = {(h["host"], h["family"]): h for h in proxy.stats()["hosts"]}
            assert hosts[("127.0.0.1", "anthropic")]["learned"] == {"ttl": 90.0}

            # restarted: the host's lifetime is known before a new session has any evidence of its own
            proxy.restart()
            clock.advance(10)
            other = f"e2e-calib-{uuid.uuid4().hex[:8]}"
            client.messages.create(model="claude-sonnet-4-5", max_tokens=16,
                                   system=[{"type": "text", "text": SYSTEM + " Other.",
                                            "cache_control": {"type": "ephemeral"}}],
                                   messages=[{"role": "user", "content": "hello"}],
                                   extra_headers={"x-claude-code-session-id": other})
            c2 = wait_answers(proxy, other, 1)["calibration"]
            assert c2["effective"] == {"ttl": 90.0, "source": "host"} and c2["learned"] == {}
            from bili_addon import statscmd

            table = statscmd.sessions_table(proxy.stats())
            assert f"  {other[:10]} read 0 pred / 0 rep, agree 100% of 1; ttl 90s (host)" in table
            assert "  host 127.0.0.1 (anthropic): 10 answers, ttl 90s" in table
        finally:
            proxy.stop()


def test_a_provider_that_never_caches_is_learned(tmp_path, clock):
    with CacheUpstream(clock, ttl=None) as up:
        proxy = ClockedProxy(tmp_path / "p", up.port, clock).start()
        try:
            sid = f"e2e-nocache-{uuid.uuid4().hex[:8]}"
            client, _tee = openai_client(proxy.url + "/v1")
            messages = [{"role": "system", "content": SYSTEM}]
            for i in range(4):
                clock.advance(5)
                messages.append({"role": "user", "content": f"step {i}"})
                out = client.chat.completions.create(model="gpt-5", messages=messages,
                                                     extra_headers={"x-session-id": sid})
                messages.append({"role": "assistant", "content": out.choices[0].message.content})
                wait_answers(proxy, sid, i + 1)
            c = wait_answers(proxy, sid, 4)["calibration"]
            assert c["family"] == "openai" and (c["hits"], c["misses"]) == (0, 3)
            assert c["effective"] == {"no_cache": True, "source": "session"}
            assert c["reported_write"] is None and c["reported_read"] == 0 and c["predicted_read"] > 0
            hosts = {(h["host"], h["family"]): h for h in proxy.stats()["hosts"]}
            assert hosts[("127.0.0.1", "openai")]["learned"] == {"no_cache": True}
        finally:
            proxy.stop()
