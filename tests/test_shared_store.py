"""Two processes on one store (two Engines, two connections to one SQLite file or PostgreSQL database): refs are given in
the store, a cached session another process advanced is reloaded, no ref ever names two texts."""

from __future__ import annotations

import json
import re

import pytest

from bili_addon.kernel.turn import Engine
from bili_addon.store import StaleSession, Store
from bili_addon.wire import LANES
from legacy import to_schema_6

ANTH = LANES["anthropic"]
SID = {"x-acp-session": "shared"}
TAG = re.compile(r'<acp [^<>]*>(m\d{5})</acp>\n')


def body(messages) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 10, "messages": messages}).encode()


def wire_refs(raw: bytes) -> dict[str, str]:
    """ref -> the text it is attached to, on the wire."""
    out = {}
    for m in json.loads(raw)["messages"]:
        texts = [m["content"]] if isinstance(m["content"], str) else [b.get("text", "") for b in m["content"]]
        for t in texts:
            hit = TAG.match(t)
            if hit:
                out[hit.group(1)] = t[hit.end():]
    return out


def assert_one_text_per_ref(store, sid: str = "shared") -> None:
    texts: dict[str, set[str]] = {}
    for r in store.ledger(sid):
        texts.setdefault(r.ref, set()).add(r.content_hash)
    assert texts and all(len(h) == 1 for h in texts.values()), {r: h for r, h in texts.items() if len(h) != 1}


def test_two_engines_alternating_on_one_session_never_share_a_ref(backend):
    a, b = Engine(backend()), Engine(backend())
    history: list = []
    seen: dict[str, str] = {}
    for turn in range(12):
        history.append({"role": "user", "content": f"question number {turn}"})
        eng = (a, b)[turn % 2]
        raw = body(history)
        res = eng.process(raw, ANTH, SID, render=True)
        assert res.body is not None and res.tagged == len(history), (turn, res)
        for ref, text in wire_refs(res.body).items():
            assert seen.setdefault(ref, text) == text, f"turn {turn}: {ref} names {seen[ref]!r} and {text!r}"
        history.append({"role": "assistant", "content": [{"type": "text", "text": f"answer number {turn}"}]})
    assert len(seen) == 23 and sorted(seen) == [f"m{n:05d}" for n in range(1, 24)]
    assert_one_text_per_ref(backend())


def test_a_write_over_a_session_another_process_advanced_is_refused_and_the_turn_recomputed(backend, monkeypatch):
    a, b = Engine(backend()), Engine(backend())
    h1 = [{"role": "user", "content": "first"}]
    a.process(body(h1), ANTH, SID, render=True)
    # B moves the session on: m00002, m00003
    h2 = h1 + [{"role": "assistant", "content": [{"type": "text", "text": "one"}]}, {"role": "user", "content": "b"}]
    b.process(body(h2), ANTH, SID, render=True)
    # A's version check comes too early to see it (the race: B commits between A's check and A's write)
    cached = a.sessions["shared"]
    calls = []
    real_version = a.store.version

    def racing_version(sid):
        calls.append(sid)
        return cached.stored if len(calls) == 1 else real_version(sid)

    monkeypatch.setattr(a.store, "version", racing_version)
    h3 = h1 + [{"role": "assistant", "content": [{"type": "text", "text": "other"}]}, {"role": "user", "content": "c"}]
    res = a.process(body(h3), ANTH, SID, render=True)
    refs = wire_refs(res.body)
    # the store refused A's first computation (it would have given m00002 again); the turn was
    # computed again from the store's state
    assert refs == {"m00001": "first", "m00004": "other", "m00005": "c"}
    assert_one_text_per_ref(backend())


def test_the_store_refuses_a_ref_given_twice(backend):
    s = backend()
    from bili_addon.store import LedgerRow, SessionRow

    row = SessionRow("x", "", "", 0.0, 0.0, 1, 1, 2)
    v = s.commit_turn(row, [LedgerRow("h_a", "aa", "m00001", "user", "text", 1)], expect=0, minted=[("m00001", "aa")])
    assert v == 1
    with pytest.raises(StaleSession):  # a process that missed that turn
        s.commit_turn(row, [LedgerRow("h_b", "bb", "m00001", "user", "text", 1)], expect=0,
                      minted=[("m00001", "bb")])
    with pytest.raises(StaleSession):  # versions agree but the counter does not: the ref is taken
        s.commit_turn(row, [LedgerRow("h_b", "bb", "m00001", "user", "text", 1)], expect=1,
                      minted=[("m00001", "bb")])
    assert s.ref_count("x") == 1 and s.version("x") == 1


def test_an_old_store_with_a_ref_given_twice_is_repaired_on_open(tmp_path):
    s = Store(tmp_path)
    s.db.execute("INSERT INTO sessions(id, created, last_seen, next_ref) VALUES('old', 0, 0, 3)")
    to_schema_6(s, version=1, refs=[], ledger=[  # schema 1: one row per part, no refs
        ("old", "h_a", "aa", "m00001", "user", "text", 1, 1.0),
        ("old", "h_b", "bb", "m00002", "user", "text", 1, 2.0),
        ("old", "h_c", "cc", "m00002", "user", "text", 1, 3.0),
        ("old", "h_d", "dd", "m00003", "user", "text", 1, 4.0)])
    s = Store(tmp_path)
    owners = dict(s.db.execute("SELECT ref, content_hash FROM refs WHERE session_id='old'").fetchall())
    assert owners == {"m00001": "aa", "m00002": "bb", "m00003": "dd"}
    row = s.session("old")
    assert row.next_ref == 4  # allocation continues after every ref ever given
    assert row.version == 1  # a process that cached the session reloads it


def test_an_anonymous_conversation_another_process_continued_is_found_in_the_store(backend):
    a, b = Engine(backend()), Engine(backend())
    h = [{"role": "user", "content": "an anonymous conversation starts here"}]
    first = a.process(body(h), ANTH, {}, render=True)
    h += [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": "more"}]
    # B never saw the conversation: the prefix chain A stored tells it which session this is
    second = b.process(body(h), ANTH, {}, render=True)
    assert second.session == first.session and second.refs_known == 1 and second.refs_new == 2
