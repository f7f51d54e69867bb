"""The addon's flows stay serialisable: live state outside ``flow.metadata``, a plain record inside it,
and a file written from such flows replays to what the addon did (``mitmproxy.test.tflow``)."""

from __future__ import annotations

import json

from e2e.fake_upstream import Reply, anthropic_sse
from mitmproxy import http, io
from mitmproxy.io import tnetstring
from test_replay import _answer, _conversation, _flow

from bili_addon import flowmeta, replay

ARGS = {"content": [{"startId": "m00002", "endId": "m00008", "topic": "modules 0-2",
                     "summary": "Modules 0 to 2 were read; nothing unusual, mod1.py holds the parser."}]}


def _session() -> tuple[list[dict], list[dict]]:
    """A conversation whose answer calls compress, and the next request carrying the agent's error."""
    msgs = _conversation(8)
    call = {"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": ARGS}
    after = msgs + [{"role": "assistant", "content": [call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "is_error": True,
                                                  "content": "Error: No such tool available: compress"}]}]
    return msgs, after


def _through(bili, flow: http.HTTPFlow, stream: bytes | None = None) -> None:
    """The hooks mitmproxy runs for one flow; ``stream``: an SSE answer, streamed (not kept in the flow)."""
    resp = flow.response
    flow.response = None
    bili.request(flow)
    flow.response = resp
    if stream is not None:
        resp.headers["content-type"] = "text/event-stream"
        resp.data.content = None
        bili.responseheaders(flow)
        assert callable(resp.stream)
        resp.stream(stream)
        resp.stream(b"")
    bili.response(flow)


def _serialisable(flow: http.HTTPFlow) -> None:
    tnetstring.dumps(flow.get_state())  # raises on a live object, as -w and save.file did
    assert flow.copy().metadata == flow.metadata


def test_fold_mode_flows_serialise_copy_and_replay(bili, tmp_path):
    msgs, after = _session()
    call = {"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": ARGS}
    first = _flow(msgs, _answer([call]))
    second = _flow(after, _answer([{"type": "text", "text": "Done."}]))
    _through(bili, first)
    _through(bili, second)
    for f in (first, second):
        _serialisable(f)
        assert f not in bili._flows  # the live state goes with the answer
    rec1, rec2 = first.metadata["bili"], second.metadata["bili"]
    assert [c[:2] for c in rec1["called"]] == [["toolu_c1", "compress"]] and json.loads(rec1["called"][0][2]) == ARGS
    assert rec1["recorded"] is True and rec1["usage"]["input"] == 1000
    assert rec2["executed"] == ["compress"] and rec2["blocks"] == 1 and rec2["folds"][0][0] == "b1"
    assert json.loads(rec2["request"]) == json.loads(_flow(after, {}).request.content)  # the agent's own body
    assert second.request.content != rec2["request"]  # the flow holds what went upstream

    path = tmp_path / "flows.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        w.add(first)
        w.add(second)
    turns = replay.replay_file(path, activate="always", materialize="now").turns
    assert [(t.messages, t.refs_new, t.refs_known, t.blocks, t.folded, t.executed) for t in turns] == [
        (r["messages"], r["refs_new"], r["refs_known"], r["blocks"], r["folded"], r["executed"]) for r in (rec1, rec2)]
    assert turns[1].body == second.request.content  # the bytes the proxy sent
    assert all(t.live is not None and "live:" not in t.note for t in turns)


def test_a_streamed_answer_replays_from_the_record(bili, tmp_path):
    """mitmproxy keeps no body of a streamed answer: the record's calls make the fold replayable."""
    msgs, after = _session()
    first = _flow(msgs, {})
    sse = b"".join(anthropic_sse(1, "claude-x", Reply("Folding.", ("Folding.",), "compress", json.dumps(ARGS),
                                                          "toolu_c1")))
    _through(bili, first, stream=sse)
    second = _flow(after, {})
    _through(bili, second, stream=b"".join(anthropic_sse(2, "claude-x")))
    assert not first.response.content
    assert first.metadata["bili"]["called"][0][:2] == ["toolu_c1", "compress"]
    assert second.metadata["bili"]["executed"] == ["compress"]
    _serialisable(first)
    path = tmp_path / "flows.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        w.add(first)
        w.add(second)
    turns = replay.replay_file(path, activate="always", materialize="now").turns
    assert turns[0].called == ["compress"] and turns[1].executed == ["compress"] and turns[1].blocks == 1
    assert turns[1].body == second.request.content


def test_replay_notes_where_the_live_proxy_differed(bili, tmp_path):
    """A capture begun mid-conversation (the proxy knew refs the file does not show): the row says so."""
    msgs, _after = _session()
    f = _flow(msgs, _answer([{"type": "text", "text": "ok"}]))
    _through(bili, f)
    f.metadata["bili"]["refs_known"] += 5
    path = tmp_path / "flows.mitm"
    with open(path, "wb") as fh:
        io.FlowWriter(fh).add(f)
    [turn] = replay.replay_file(path, activate="always", materialize="now").turns
    assert "live: msgs" in turn.note and turn.live["refs_known"] == f.metadata["bili"]["refs_known"]


def test_observe_mode_records_without_keeping_a_copy(bili):
    bili.tctx.configure(bili, bili_mode="observe")
    msgs, _ = _session()
    f = _flow(msgs, _answer([{"type": "text", "text": "ok"}]))
    _through(bili, f)
    rec = f.metadata["bili"]
    assert rec["mode"] == "observe" and not rec["rendered"] and "request" not in rec
    assert rec["bytes_in"] == rec["bytes_out"]
    _serialisable(f)


def test_records_of_another_version_are_ignored():
    assert flowmeta.read({"bili": {"v": 99, "session": "x"}}) is None
    assert flowmeta.read({"bili": object()}) is None
    assert flowmeta.read_ws({"bili_ws": [{"v": 1, "message": 3}, {"v": 1}, "junk"]}) == {3: {"v": 1, "message": 3}}


def test_a_failed_flow_leaves_no_live_state(bili):
    msgs, _ = _session()
    f = _flow(msgs, {})
    f.response = None
    bili.request(f)
    assert f in bili._flows and f.metadata["bili"]["session"] == "replay-fold"
    bili.error(f)  # the upstream never answered
    assert f not in bili._flows and "called" not in f.metadata["bili"]
    _serialisable(f)
