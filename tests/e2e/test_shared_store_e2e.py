"""Two mitmdump processes on one data dir (#19): one conversation alternates between them for 20
turns with a fold; every ref names one text, in the store and on the wire, no turn fails on the
store, and every turn is tagged."""

from __future__ import annotations

import sqlite3

import pytest

from bili_addon.store import DB_NAME

from . import conftest
from .fake_upstream import proxy_call, say
from .support import AnthropicAgent, Mitmdump, strip_tags
from .test_fold_e2e import TASK, Turns, assert_folded, fold, reading, run_bash

pytestmark = pytest.mark.e2e

TURNS = 20
COMPRESS_TURN = 8  # folds turns 1-4; the call runs on turn 9, in the other process


@pytest.fixture(scope="module")
def pair(fake, tmp_path_factory):
    """Two proxies, each its own process and confdir, one data dir."""
    shared = tmp_path_factory.mktemp("shared-data")
    procs = []
    for name in ("one", "two"):
        p = Mitmdump(tmp_path_factory.mktemp(f"shared-{name}"), fake.port)
        p.data_dir = shared
        procs.append(p)
        conftest._running.append(p)
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()
            conftest._running.remove(p)


def script() -> list:
    acts = []
    for t in range(1, TURNS + 1):
        if t == COMPRESS_TURN:
            acts.append(proxy_call("compress", fold(1, 4, 1), prose=f"Turn {t}: modules 1 to 4 are done, folding."))
        elif t == TURNS:
            acts.append(say(f"Turn {t}: the audit is complete."))
        else:
            acts.append(reading(t))
    return acts


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_one_conversation_alternating_between_two_processes_on_one_store(fake, pair, sid, stream):
    fake.script(sid, script())
    # the proxy call the model makes is recorded before the answer's end reaches the agent (the
    # response hook is awaited), so the other process runs it on the very next turn
    agent = AnthropicAgent(pair[0].url, sid, sid, TASK, stream=stream)
    up = Turns(fake, sid)
    names: dict[str, str] = {}  # ref -> the text it named on the wire, over all turns and both processes
    for t in range(1, TURNS + 1):
        proxy = pair[t % 2]
        if agent.base_url != proxy.url:
            agent.base_url = proxy.url
            agent.connect()
        agent.step(t, run_bash)
        rec = up[t]
        _plain, found = strip_tags(rec.json)
        texts = {tag.text for tag in found}
        assert TASK in texts, f"turn {t}: the task went upstream untagged"
        if t > 1:  # the newest prose, written by the other process's turn, is tagged
            assert any(x.startswith(f"Turn {t - 1}:") for x in texts), f"turn {t}: untagged prose went upstream"
        for tag in found:
            assert names.setdefault(tag.ref, tag.text) == tag.text, (
                f"turn {t} ({'one' if proxy is pair[0] else 'two'}): {tag.ref} named {names[tag.ref]!r}, "
                f"now {tag.text!r}")
        if t > COMPRESS_TURN:
            assert_folded(rec.body, kept=(5, 6, 7))

    # both processes took turns, each turn tagged by the process that forwarded it
    for p in pair:
        lines = p.wait_bili_lines(TURNS // 2, session=sid)
        assert len(lines) == TURNS // 2, p.log_tail()
        assert all(int(m.group(6)) > 0 for m in lines), [m.group(0) for m in lines]
        assert "UNIQUE constraint" not in p.log() and "forwarding unchanged" not in p.log(), p.log_tail()
    assert sum(f"session={sid} " in ln and "ran=compress" in ln for p in pair for ln in p.log().splitlines()) == 1

    # the store: every ref of the session names one text, and was given once
    db = sqlite3.connect(pair[0].data_dir / DB_NAME)
    try:
        twice = db.execute("SELECT ref, COUNT(DISTINCT content_hash) FROM ledger WHERE session_id=? GROUP BY ref "
                           "HAVING COUNT(DISTINCT content_hash) > 1", (sid,)).fetchall()
        given = db.execute("SELECT COUNT(*) FROM refs WHERE session_id=?", (sid,)).fetchone()[0]
        used = db.execute("SELECT COUNT(DISTINCT ref) FROM ledger WHERE session_id=?", (sid,)).fetchone()[0]
    finally:
        db.close()
    assert twice == [] and given == used > 0
    assert set(names) <= {f"m{n:05d}" for n in range(1, given + 1)}
