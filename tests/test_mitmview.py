"""The "bili" content view (mitmproxy's contentviews API), on flows built with mitmproxy's test
helpers and on real agents' captured flows (``/work/shared/captures``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mitmproxy import contentviews, io
from test_flowmeta import ARGS, _session, _through
from test_replay import _answer, _flow

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"
if not CAPTURES.is_dir():
    CAPTURES = Path("/work/shared/captures")


def view(message, flow) -> str:
    out = contentviews.prettify_message(message, flow, "bili")
    assert out.view_name == "bili", out.text
    return out.text


def test_registered_when_the_addon_loads(bili):
    assert contentviews.registry["bili"].name == "bili"


def test_a_folded_request_shows_its_blocks_and_what_bili_injected(bili):
    msgs, after = _session()
    call = {"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": ARGS}
    first = _flow(msgs, _answer([call]))
    echo = '<acp tokens="40" type="text">m00003</acp>'
    second = _flow(after, _answer([{"type": "text", "text": f"Done.\n{echo}\nNext: <acp type=\"x\">mod3</acp>."}]))
    _through(bili, first)
    _through(bili, second)
    text = view(second.request, second)
    assert "bili · session replay-fold · anthropic over http · fold mode" in text
    assert "folds:\n  b1  m00002 – m00008" in text
    assert "ran for this request: compress" in text
    assert "injected: tools compress, decompress, search_context, acp_status; its prompt" in text
    lines = text.splitlines()
    # the block covers whole turns: from the first ref of the range to the end of its last turn
    summary = [ln for ln in lines if re.search(r"◆ bili summary b1 \(folds m00002–m000\d\d\)", ln)]
    assert len(summary) == 1 and "Modules 0 to 2 were read" in summary[0]
    assert any("[m00001] Please audit the repository." in ln for ln in lines)
    result = [ln for ln in lines if "result of bili's compress" in ln]
    assert len(result) == 1 and "Compressed m00002" in result[0]
    # the folded turns' output is not what the model received; the kept ones are
    assert "file-0" not in text and "file-7" in text
    assert "the agent sent 19" in text  # 17 items of the conversation + the call and the agent's error

    answer = view(second.response, second)
    assert "tag echoes stripped from the model's prose: 2" in answer
    assert f"\n  {echo}\n" in answer and '\n  <acp type="x">…</acp>\n' in answer  # what went, as written

    answer = view(first.response, first)
    assert "the model called bili's tools" in answer and "compress" in answer and "[toolu_c1]" in answer
    assert "usage: input 1,000" in answer


@pytest.mark.skipif(not (CAPTURES / "claude-code" / "claude_rev" / "flows.mitm").exists(),
                    reason="the captures are not there")
def test_captured_claude_code_flows(bili):
    with open(CAPTURES / "claude-code" / "claude_rev" / "flows.mitm", "rb") as fh:
        flows = list(io.FlowReader(fh).stream())
    untouched = flows[1].copy()
    for f in flows:
        _through(bili, f)
    head, turn1, turn2 = flows[0], flows[2], flows[3]
    plain = view(head.request, head)
    assert plain.startswith("bili did not change this request")
    t2 = view(turn2.request, turn2)
    assert "bili · session d987b626-7580-416a-a849-6f14d8c5b1c5 · anthropic" in t2
    assert "injected: tools compress, decompress, search_context, acp_status" in t2
    assert "folds:" not in t2 and "◆" not in t2  # nothing folded in a two-turn run
    items = [ln for ln in t2.splitlines() if re.match(r"\s+\d+ ", ln)]
    assert len(items) == 4 and re.match(r"\s+0 user\s+\[m\d{5}(,m\d{5})*\] <system-reminder>", items[0])
    assert "→ Bash" in t2  # the turn-1 call, as the model received it
    # a flow that never went through bili (a passthrough proxy): its body and nothing extra
    other = view(untouched.request, untouched)
    assert other.startswith("bili did not change this request") and "[m0" not in other and "injected" not in other
    assert view(turn1.response, turn1).startswith("bili · session d987b626")
