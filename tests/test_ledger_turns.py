"""Schema 7 (#11): the ledger and the refs as one row per session write, on both backends.

A store of schema 6 (one row per part) migrates to 7 when opened and loses nothing: every ledger
row (its first_seen too) and every ref is there, read row by row through the views of the old
names, and the conversation goes on from it exactly as from a store that was never migrated.
"""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.store import SCHEMA_VERSION, LedgerRow, SessionRow, StaleSession, StoreError
from legacy import rows_of, to_schema_6
from test_fold import ANTH, H, agent_answers_unknown, body, conversation, refs_in, roundtrip_call


def fold_conversation(store) -> tuple[Engine, list[dict]]:
    """A conversation with a fold, over three turns (three writes of ledger rows)."""
    e = Engine(store, fold_cfg=FoldConfig(min_compress_chars=2000))
    msgs = conversation(8)
    refs = refs_in(json.loads(e.process(body(msgs), ANTH, H, render=True).body))
    start = next(r for r, t in refs.items() if t.startswith("Step 1:"))
    end = next(r for r, t in refs.items() if t.startswith("Step 4:"))
    args = {"content": [{"startId": start, "endId": end, "topic": "modules 1-4",
                         "summary": "Read modules 1 to 4: nothing unusual; mod3.py defines load_config()."}]}
    roundtrip_call(e, "fold-1", "compress", args, "toolu_c1")
    msgs = agent_answers_unknown(msgs, "compress", args, "toolu_c1")
    assert e.process(body(msgs), ANTH, H, render=True).executed == ["compress"]
    return e, msgs


def test_a_schema_6_store_migrates_to_7_and_loses_nothing(backend):
    e, msgs = fold_conversation(backend())
    sid = "fold-1"
    before = rows_of(e.store)
    ledger, count = e.store.ledger(sid), e.store.ref_count(sid)
    assert len({r[-1] for r in before[0]}) >= 2  # rows of several writes (first_seen apart)
    to_schema_6(e.store)

    s = backend()  # opened again: migrated
    assert s.schema_version() == SCHEMA_VERSION == 8
    assert rows_of(s) == before  # every row, its first_seen too, through the views
    assert s.ledger(sid) == ledger and s.ref_count(sid) == count
    raw = s.db.execute if s.backend == "sqlite" else s._q
    ph = "?" if s.backend == "sqlite" else "%s"
    turns = list(raw(f"SELECT seq, n FROM ledger_turns WHERE session_id={ph} ORDER BY seq", (sid,)))
    assert [seq for seq, _n in turns] == list(range(1 - len(turns), 1))  # one row per write, numbered up to 0
    assert sum(n for _seq, n in turns) == count

    # the conversation goes on from the migrated store as from one that never was
    control, cmsgs = fold_conversation(backend("control"))
    assert cmsgs == msgs
    nxt = msgs + [{"role": "assistant", "content": "More audit."}, {"role": "user", "content": "and on"}]
    a = Engine(s, fold_cfg=FoldConfig(min_compress_chars=2000))
    b = Engine(backend("control"), fold_cfg=FoldConfig(min_compress_chars=2000))
    ra, rb = a.process(body(nxt), ANTH, H, render=True), b.process(body(nxt), ANTH, H, render=True)
    assert ra.body == rb.body and ra.refs_new == rb.refs_new == 2
    assert s.ledger(sid) == b.store.ledger(sid)


def test_a_turn_writes_one_row_of_ledger_and_one_of_refs(backend):
    s = backend()
    rows = [LedgerRow(f"h_{i}", f"{i:064x}", f"m{i + 1:05d}", "user", "text", i) for i in range(300)]
    v = s.commit_turn(SessionRow("one", "", "", 0.0, 0.0, 1, 300, 301), rows, expect=0,
                      minted=[(r.ref, r.content_hash) for r in rows])
    raw = s.db.execute if s.backend == "sqlite" else s._q
    ph = "?" if s.backend == "sqlite" else "%s"
    assert [tuple(r) for r in raw(f"SELECT seq, n FROM ledger_turns WHERE session_id={ph}", ("one",))] == [(v, 300)]
    assert [tuple(r) for r in raw(f"SELECT seq, n FROM refs_turns WHERE session_id={ph}", ("one",))] == [(v, 300)]
    assert s.ledger("one") == sorted(rows, key=lambda r: (r.msg_id, r.content_hash)) and s.ref_count("one") == 300
    given = dict(tuple(r) for r in raw(f"SELECT ref, content_hash FROM refs WHERE session_id={ph}", ("one",)))
    assert given == {r.ref: r.content_hash for r in rows}


def test_refs_a_turn_gives_must_be_the_stores_next_numbers_in_order(backend):
    s = backend()
    row = SessionRow("gap", "", "", 0.0, 0.0, 1, 2, 3)
    rows = [LedgerRow("h_a", "aa", "m00001", "user", "text", 1), LedgerRow("h_b", "bb", "m00003", "user", "text", 1)]
    with pytest.raises(StoreError):  # m00001, m00003: not consecutive (a kernel fault): nothing written
        s.commit_turn(row, rows, expect=0, minted=[("m00001", "aa"), ("m00003", "bb")])
    assert s.version("gap") == 0 and s.ledger("gap") == []
    with pytest.raises(StaleSession):  # consecutive, but not from the store's counter
        s.commit_turn(SessionRow("gap", "", "", 0.0, 0.0, 1, 2, 4), rows[:1], expect=0,
                      minted=[("m00002", "aa"), ("m00003", "bb")])
    assert s.commit_turn(row, [rows[0], LedgerRow("h_b", "bb", "m00002", "user", "text", 1)], expect=0,
                         minted=[("m00001", "aa"), ("m00002", "bb")]) == 1


def test_a_sessions_state_is_read_at_once_as_its_parts_read_it(backend):
    e, _msgs = fold_conversation(backend())
    s = e.store
    s.record_calls("fold-1", [("k-wait", "search_context", '{"query": "x"}')], expect=s.version("fold-1"))
    state = s.session_state("fold-1")
    assert state == (s.session("fold-1"), s.ledger("fold-1"), s.blocks("fold-1"), s.calls("fold-1"),
                     s.copy("fold-1"))
    assert state[2] and state[4] and [c[3] for c in state[3]][-1] is None  # blocks, a copy, a call waiting
    assert s.session_state("nobody") == (None, [], [], [], None)
