"""``bili stats`` rendering and --watch, without a proxy (the e2e test runs it against one)."""

from __future__ import annotations

import argparse

from bili_addon import statscmd

DOC = {"sessions": [
    {"id": "0123456789abcdef", "agent": "claude", "lane": "anthropic", "requests": 1234, "last_seen": 1000.0,
     "usage": {"cache_read_share": 0.5}, "fold": {"blocks": 12},
     "wire": {"turns": 3, "agent_now": 181_200, "sent_now": 46_100, "reported": 0.92, "cost": 123.4, "saved": -0.5}},
    {"id": "s2", "agent": "", "lane": "chat", "requests": 1, "last_seen": 0, "usage": {}, "fold": {}, "wire": {}},
], "store": False, "store_status": {"ok": False, "reason": "disk full"}, "prices": {"as_of": "2025-11-01"}}


def test_sessions_table_fits_80_columns():
    out = statscmd.sessions_table(DOC, now=1000.0 + 7200)
    lines = out.splitlines()
    assert all(len(ln) <= 80 for ln in lines), out
    assert lines[1].split() == ["0123456789", "claude", "anthropic", "1234", "181.2K->46.1K", "92%", "12", "$123",
                                "-$0.500", "2h"]
    assert lines[2].split()[:4] == ["s2", "-", "chat", "1"] and "store unusable: disk full" in out


def test_watch_redraws_until_ctrl_c(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(statscmd, "fetch", lambda proxy, path, token, **kw: calls.append(path) or DOC)
    sleeps = iter([None, KeyboardInterrupt()])

    def sleep(_):
        x = next(sleeps)
        if x is not None:
            raise x

    monkeypatch.setattr(statscmd.time, "sleep", sleep)
    monkeypatch.setenv("BILI_TOKEN", "t")
    args = argparse.Namespace(proxy="127.0.0.1:1", data_dir=None, session=None, json=False, watch=1.0)
    assert statscmd.run(args) == 0
    out = capsys.readouterr().out
    assert len(calls) == 2 and out.count("\x1b[H\x1b[2J") == 2 and "0123456789" in out


def test_unreachable_proxy_is_a_clear_error(capsys, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("BILI_TOKEN", "t")
    args = argparse.Namespace(proxy=f"127.0.0.1:{port}", data_dir=None, session="x", json=False, watch=None)
    assert statscmd.run(args) == 1
    err = capsys.readouterr().err
    assert "not reachable" in err and "bili run" in err


CALIB = {"host": "api.anthropic.com", "family": "anthropic", "turns": 10, "predicted_read": 123_400,
         "reported_read": 119_000, "agree": 0.9, "hits": 6, "misses": 3, "extra": 0,
         "learned": {"ttl": 90.0}, "effective": {"ttl": 90.0, "source": "session"}}


def test_the_cache_model_against_the_provider_is_shown_per_session_and_per_host():
    doc = {**DOC, "sessions": [{**DOC["sessions"][0], "calibration": CALIB}, DOC["sessions"][1]],
           "hosts": [{"host": "api.anthropic.com", "family": "anthropic", "observations": 24, "learned": {"ttl": 90.0}},
                     {"host": "127.0.0.1", "family": "openai", "observations": 5, "learned": {"no_cache": True}}]}
    out = statscmd.sessions_table(doc, now=1000.0)
    assert all(len(ln) <= 80 for ln in out.splitlines()), out
    assert ("  0123456789 read 123.4K pred / 119.0K rep, agree 90% of 10; ttl 90s (session)"
            in out.splitlines())
    assert "  host api.anthropic.com (anthropic): 24 answers, ttl 90s" in out
    assert "  host 127.0.0.1 (openai): 5 answers, no cache" in out
    one = {"session": {"id": "s", "calibration": {**CALIB, "effective": {"source": "documented"}}}, "turns": [],
           "calibration": [{"n": 1, "gap": None, "age": None, "predicted_read": 0, "reported_read": 0,
                            "predicted_write": 5000, "reported_write": 5100, "verdict": "none"},
                           {"n": 2, "gap": 95.2, "age": 95.2, "predicted_read": 5000, "reported_read": 0,
                            "predicted_write": 0, "reported_write": None, "verdict": "miss"}]}
    view = statscmd.session_view(one, now=1000.0)
    assert "cache model: read 123.4K pred / 119.0K rep, agree 90% of 10; documented rules" in view
    assert view.splitlines()[-1].split() == ["2", "95s", "95s", "5.0K", "0", "0", "-", "miss"]
    assert view.splitlines()[-2].split() == ["1", "-", "-", "0", "0", "5.0K", "5.1K", "none"]


def test_the_cache_writes_by_lifetime_and_who_split_them():
    w = {"priced": True, "cost": 0.25, "saved": 0.1, "cache_write": 14_000, "cache_write_1h": 10_000,
         "write_split": {"reported": 8_000, "sent": 4_000, "none": 2_000}}
    view = statscmd.session_view({"session": {"id": "s", "wire": w}, "turns": []}, now=1000.0)
    line = next(ln for ln in view.splitlines() if ln.startswith("writes"))
    assert line == "writes 14.0K: 1 h 10.0K, 5 min 4.0K (reported 8.0K, as sent 4.0K, unsplit 2.0K)"
    assert len(line) <= 80 and "cost $0.250, saved $0.100" in view and "no price" not in view
    none = statscmd.session_view({"session": {"id": "s", "wire": {"cache_write": 0}}, "turns": []}, now=1000.0)
    assert "writes" not in none


def test_stats_page_and_mcp_find_the_proxy_at_bili_port(monkeypatch, capsys):
    """`bili run` and the launchers listen on $BILI_PORT; stats, page and mcp looked at 8787 whatever it said."""
    from bili_addon import default_proxy

    monkeypatch.delenv("BILI_PROXY", raising=False)
    monkeypatch.setenv("BILI_PORT", "18971")
    assert default_proxy() == "http://127.0.0.1:18971"
    monkeypatch.setenv("BILI_PROXY", "http://127.0.0.1:9")
    assert default_proxy() == "http://127.0.0.1:9"  # (the address, said outright, wins)
    monkeypatch.delenv("BILI_PROXY")
    monkeypatch.setenv("BILI_PORT", "not-a-port")
    assert default_proxy() == "http://127.0.0.1:8787"
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("BILI_PORT", str(port))
    monkeypatch.setenv("BILI_TOKEN", "t")
    assert statscmd.run(argparse.Namespace(proxy=None, data_dir=None, session="x", json=False, watch=None)) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_a_request_chosen_name_cannot_write_to_the_terminal(monkeypatch, capsys):
    """A session id comes from the request (``metadata.session_id``, ``prompt_cache_key``...), and an
    agent's or a model's name too: ``bili stats`` printed them as they came, escape sequences (a
    window title, a cleared screen, hidden text) included."""
    import copy

    doc = copy.deepcopy(DOC)
    doc["sessions"][0]["id"] = "\x1b]2;pwned\x07evil"
    doc["sessions"][0]["agent"] = "a\x1b[2Jb"
    monkeypatch.setattr(statscmd, "fetch", lambda proxy, path, token, **kw: doc)
    monkeypatch.setenv("BILI_TOKEN", "t")
    args = argparse.Namespace(proxy="127.0.0.1:1", data_dir=None, session=None, json=False, watch=None)
    assert statscmd.run(args) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]2;pwne" in out
