"""Claude Code's billing header (first-party: ``system[0]`` is ``x-anthropic-billing-header: ...;
cch=...;``, the ``cch`` new on every request) is no part of the prefix Anthropic caches: the cache
model leaves it out, so a first-party session reads its cache turn after turn as it does upstream
(kernel/cache.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bili_addon.kernel import cache

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"
EPH = {"type": "ephemeral"}


def body(cch: str | None, msgs: int, header_text: str | None = None, header_cc: bool = False) -> bytes:
    system = [{"type": "text", "text": "You are Claude Code. " * 400, "cache_control": EPH}]
    if cch is not None:
        head = {"type": "text", "text": header_text or f"x-anthropic-billing-header: cc_version=2.1.197.fbe; "
                                                      f"cc_entrypoint=cli; cch={cch};"}
        if header_cc:
            head["cache_control"] = EPH
        system.insert(0, head)
    messages = []
    for i in range(msgs):
        messages.append({"role": "user" if i % 2 == 0 else "assistant",
                         "content": [{"type": "text", "text": f"step {i} " + "work " * 300}]})
    messages[-1]["content"][-1]["cache_control"] = EPH
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "system": system,
                       "tools": [{"name": "Bash", "description": "run " * 200, "input_schema": {}}],
                       "messages": messages}, separators=(",", ":")).encode()


def bills(bodies: list[bytes], memo: bool = True) -> list[cache.Bill]:
    clk = cache.Clock("anthropic", "claude-sonnet-4-5")
    clk.cache.memo = memo
    return [clk.send(b, 1000.0 + 10 * i) for i, b in enumerate(bodies)]


@pytest.mark.parametrize("memo", [True, False])
def test_a_new_cch_every_request_still_reads_the_cached_prefix(memo):
    got = bills([body(c, n) for c, n in (("1a2b3", 3), ("9f8e7", 5), ("00aa1", 7))], memo)
    without = bills([body(None, n) for n in (3, 5, 7)], memo)
    assert [b.read for b in got[1:]] == [b.read for b in without[1:]] and all(b.read > 0 for b in got[1:])
    assert got == without  # (the header is no prompt: the same bills as without it)


@pytest.mark.parametrize("memo", [True, False])
def test_other_system_text_is_prompt(memo):
    # the words elsewhere in a block, or a header block with a breakpoint of its own: prompt as any
    for kw in ({"header_text": "note: x-anthropic-billing-header: cch={};"}, {"header_cc": True}):
        seq = [body(c, n, **{k: (v.format(c) if isinstance(v, str) else v) for k, v in kw.items()})
               for c, n in (("1a2b3", 3), ("9f8e7", 5))]
        got = bills(seq, memo)
        assert got[1].read < bills([body(None, 3), body(None, 5)], memo)[1].read


def test_the_first_party_capture_reads_its_cache_on_turn_two():
    files = sorted((CAPTURES / "claude-code" / "claude_fwd").glob("*_POST_v1_messages.json"))
    if not files:
        pytest.skip("the captures are not here")
    raws = []
    for f in files:
        b = json.loads(f.read_text())["body"]
        raws.append(b.encode() if isinstance(b, str) else json.dumps(b).encode())
    assert all(b"x-anthropic-billing-header" in r for r in raws)
    got = bills(raws)
    assert got[-1].read > 0 and got[-1].read > got[-1].write  # (the loop's second turn: the head read)
    assert got == bills(raws, memo=False)
