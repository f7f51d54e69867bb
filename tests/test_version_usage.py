"""A follow-up turn checks its session's version and then reads the usage of its latest answer (the
reminder's measure): SQLite reads both in one statement (``Store.version``), and ``last_usage``
answers once from what it read, until the store writes or lets go: the same answer as its own read."""

from __future__ import annotations

from bili_addon.store import SessionRow, Store


def _row(sid: str) -> SessionRow:
    return SessionRow(sid, "a", "anthropic", 1.0, 1.0, 1, 1, 1)


def fresh_last(store: Store, sid: str):
    store._usage = None
    return store.last_usage(sid)


def test_version_reads_the_last_usage_with_it(tmp_path):
    st = Store(tmp_path)
    try:
        assert st.version("none") == 0 and st.last_usage("none") is None
        v = st.commit_turn(_row("s"), [], expect=0)
        assert st.version("s") == v and st._usage == ("s", None)  # stored, no answer yet
        assert st.last_usage("s") is None and st._usage is None  # (answered once)
        st.record_usage("s", "anthropic", (100, 10, 20, 5))
        st.record_usage("s", "anthropic", (200, 150, 30, 7))
        assert st.version("s") == v
        assert st.last_usage("s") == (200, 150, 30, 7) == fresh_last(st, "s")
        # another session's read is its own
        st.version("s")
        assert st.last_usage("other") is None and st._usage is None
        # a write in between: the store reads again
        st.version("s")
        st.record_usage("s", "anthropic", (300, 250, 0, 9))
        assert st._usage is None and st.last_usage("s") == (300, 250, 0, 9)
        # let go after a turn: forgotten
        st.version("s")
        st.release()
        assert st._usage is None
    finally:
        st.close()


def test_engine_turns_read_the_same_usage(tmp_path):
    """Whole turns: the reminder sees the usage the last answer reported, whether it was read with the
    version or on its own (the engine's own reads counted: one statement fewer per follow-up)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_overhead as bo
    from bili_addon.kernel.turn import Engine
    from bili_addon.wire import LANES

    case = bo.Case("anthropic", 30)
    more = [case.new(i) for i in range(4)]  # (the case's generator moves on with each)
    outs = []
    for cached in (True, False):
        st = Store(tmp_path / str(cached))
        eng = Engine(st, activate="always")
        eng.lineage.defer = True  # (as the proxy runs it: the turn's commit waits for its reminder)
        if not cached:
            st.version = lambda sid, _v=Store.version, _st=st: (_v(_st, sid), setattr(_st, "_usage", None))[0]
        msgs = list(case.msgs)
        got = []
        for i in range(4):
            msgs.append(more[i])
            res = eng.process(case.body(msgs), LANES["anthropic"], {"x-acp-session": "u"}, render=True)
            got.append((res.body, eng.sessions["u"].flags.get("last_nudge_at")))
            eng.lineage.flush()
            st.record_usage("u", "anthropic", (150_000 + 1000 * i, 80_000, 100, 50))  # a large context: the reminder reads it
        outs.append(got)
        st.close()
    assert outs[0] == outs[1]
    # the reminder measured the context by the usage the answers reported (not by its own estimate)
    assert [at for _b, at in outs[0]] == [None, 150_000, 151_000, 152_000]
