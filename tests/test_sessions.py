"""Session identity of every captured agent run, as hosts-lab.md measured it."""

from __future__ import annotations

import collections

import pytest

import wirecases as wc
from bili_addon.kernel.sessions import PrefixAffinity, chain, session_from_request
from bili_addon.kernel.turn import Engine

# run -> lane -> (how the id is found, conversations in the run on that lane)
EXPECTED = {
    "claude-code/claude_rev": {"anthropic": ("header:x-claude-code-session-id", 1)},
    "claude-code/claude_fwd": {"anthropic": ("header:x-claude-code-session-id", 1)},
    "codex/codex_rev": {"responses": ("header:session-id", 1)},
    "codex/codex_fwd": {"responses": ("header:session-id", 1)},
    "codex/codex_fwd_blk": {"responses": ("header:session-id", 1)},
    "pi/pi_rev": {"anthropic": ("prefix", 1), "chat": ("prefix", 1), "responses": ("header:session_id", 1)},
    "opencode/opencode_rev": {"anthropic": ("header:x-session-affinity", 1)},
    "omp/omp_anth": {"anthropic": ("header:x-claude-code-session-id", 1)},
    "omp/omp_anthkey": {"anthropic": ("header:x-claude-code-session-id", 1)},
    "omp/omp_chat": {"chat": ("prefix", 1)},
    "omp/omp_resp": {"responses": ("body:prompt_cache_key", 1)},
    "omp/omp_cont": {"responses": ("body:prompt_cache_key", 1)},
    "omp/omp_unk": {"anthropic": ("header:x-claude-code-session-id", 2), "chat": ("prefix", 1),
                    "responses": ("body:prompt_cache_key", 1)},
    "omp/omp_fwd": {"responses": ("header:session_id", 1)},
    "omp/omp_fwd_anth": {"anthropic": ("header:x-claude-code-session-id", 1)},
    "hermes/hermes_chat": {"chat": ("prefix", 1)},
    "hermes/hermes_anth": {"anthropic": ("prefix", 1)},
    "hermes/hermes_resp": {"responses": ("prefix", 1)},
    "hermes/hermes_cont": {"anthropic": ("prefix", 1)},
    "hermes/hermes_cont_oai": {"chat": ("prefix", 1), "responses": ("prefix", 1)},
    "hermes/hermes_unk": {"anthropic": ("prefix", 1), "chat": ("prefix", 1), "responses": ("prefix", 1)},
    "hermes/hermes_fwd": {"anthropic": ("prefix", 1)},
    "hermes/hermes_fwd_oauth": {"anthropic": ("prefix", 1)},
}
DELTA_RUNS = {"codex/codex_fwd", "omp/omp_fwd"}  # previous_response_id: history not visible


def runs() -> dict[str, list]:
    out = collections.defaultdict(list)
    for path in wc.capture_files():
        for cap in wc.captured_bodies(path):
            out[cap.name.split("#")[0]].append(cap)
    return out


RUNS = runs()
pytestmark = pytest.mark.skipif(not RUNS, reason=f"no captured flows at {wc.CAPTURES}")


def test_every_captured_run_is_in_the_table():
    assert set(RUNS) == set(EXPECTED)


@pytest.mark.parametrize("run", sorted(EXPECTED))
def test_sessions_of_a_captured_run(run, backend):
    engine = Engine(backend(), inject=False)
    seen = collections.defaultdict(lambda: collections.defaultdict(int))
    for cap in RUNS[run]:
        res = engine.process(cap.raw, cap.lane, cap.headers, render=True)
        assert res.session, f"{cap.name}: no session"
        seen[res.lane][(res.session, res.source)] += 1
    assert set(seen) == set(EXPECTED[run])
    for lane, (source, conversations) in EXPECTED[run].items():
        got = seen[lane]
        assert {src for _sid, src in got} == {source}, got
        assert len(got) == conversations, f"{run}/{lane}: {dict(got)}"
    flagged = {sid for sid in engine.sessions if engine.sessions[sid].flags.get("delta_history")}
    assert bool(flagged) == (run in DELTA_RUNS)


def test_headers_agree_with_the_bodies_where_both_carry_the_id():
    """Claude Code and omp also put the session in metadata.user_id; codex in prompt_cache_key."""
    for run in ("claude-code/claude_rev", "omp/omp_anth", "codex/codex_rev"):
        for cap in RUNS[run]:
            body = wc.msgspec.json.decode(cap.raw)
            from_headers = session_from_request(cap.headers, {})
            from_body = session_from_request({}, body)
            assert from_headers and from_body and from_headers[0] == from_body[0]


def test_hermes_prompt_cache_key_is_not_a_conversation_id():
    cap = RUNS["hermes/hermes_resp"][0]
    body = wc.msgspec.json.decode(cap.raw)
    assert body["prompt_cache_key"].startswith("pck_")
    assert session_from_request(cap.headers, body) is None


def test_two_conversations_that_open_alike_do_not_share_state():
    a = chain([b"open", b"answer A", b"more A"])
    b = chain([b"open", b"answer B", b"more B"])
    aff = PrefixAffinity()
    first = aff.resolve(a[:1])
    aff.note(first, 1, a[0])
    aff.note(first, 3, a[2])  # conversation A moved on
    other = aff.resolve(b[:1])  # B opens with the very same words
    assert other != first
    aff.note(other, 1, b[0])
    assert aff.resolve(b) == other and aff.resolve(a + [chain([b"x"])[0]]) == first


@pytest.mark.parametrize("where", ["header", "session_id", "metadata", "user_id", "prompt_cache_key"])
def test_an_id_holding_a_nul_is_no_id(where):
    """PostgreSQL cannot store a NUL and libpq cuts a text parameter there: ``"victim\\u0000x"`` was
    locked, read and written as session ``victim``.  Such an id is skipped: the next source is read."""
    bad = "victim\0other"
    headers, top = {}, {}
    if where == "header":
        headers["x-session-id"] = bad
    elif where == "session_id":
        top["session_id"] = bad
    elif where == "metadata":
        top["metadata"] = {"session_id": bad}
    elif where == "user_id":
        top["metadata"] = {"user_id": '{"session_id": "victim\\u0000other"}'}
    else:
        top["prompt_cache_key"] = bad
    assert session_from_request(headers, top) is None
    top["metadata"] = {**top.get("metadata", {}), "session_id": "fine"} if where != "metadata" else {"session_id": "fine"}
    got = session_from_request(headers, top)
    assert got is not None and got[0] == "fine"
