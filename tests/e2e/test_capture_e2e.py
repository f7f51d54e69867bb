"""Capturing flows with the addon loaded (``mitmdump -w``, here ``--set save_stream_file``, the option
``-w`` sets), in every mode, and replaying the capture with ``bili replay``.

The addon keeps its live per-flow state out of ``flow.metadata`` (mitmproxy serialises it) and
leaves only a plain record there; a folding session captured this way replays, turn by turn, to
the figures the live proxy logged, and to the very bodies the upstream received.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from mitmproxy import io
from websockets.sync.client import connect as ws_connect

from bili_addon import replay

from .fake_upstream import say
from .support import MITMDUMP, clean_env
from .test_fold_e2e import COMPRESS_TURN, TURNS, Turns, make_agent, reading, run_bash, session_script

pytestmark = pytest.mark.e2e

# one logged request: msgs, refs new, refs known; then optionally blocks/folded and ran=
LIVE_LINE = re.compile(r"\[bili\] session=(\S+) lane=\S+ msgs=(\d+) refs new=(\d+) known=(\d+) tagged=\d+"
                       r"(?: blocks=(\d+) folded=(\d+))?.*?(?: ran=(\S+))? bytes in=")


def live_turns(proxy, sid: str) -> list[tuple]:
    """``(msgs, refs new, refs known, blocks, folded, ran)`` per request of ``sid``, from the proxy's log."""
    out = []
    for line in proxy.log().splitlines():
        m = LIVE_LINE.search(line)
        if m and m.group(1) == sid:
            out.append((int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5) or 0),
                        int(m.group(6) or 0), m.group(7).split(",") if m.group(7) else []))
    return out


def replayed_turns(rep: replay.FileReport, sid: str) -> list[replay.Turn]:
    return [t for t in rep.turns if t.session == sid]


def read_back(path) -> subprocess.CompletedProcess:
    """``mitmdump -nr FILE``: mitmproxy itself reads the capture (no server, no addon)."""
    return subprocess.run([str(MITMDUMP), "-n", "-r", str(path), "--set", f"confdir={path.parent / 'conf-r'}"],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def assert_clean_log(proxy) -> None:
    log = proxy.log()
    assert "Addon error" not in log and "unserializable" not in log, proxy.log_tail()
    assert "Traceback" not in log, proxy.log_tail()


def captured(make_proxy, tmp_path, mode: str):
    path = tmp_path / f"{mode}.mitm"
    return make_proxy("reverse", mode, save_stream_file=str(path)), path


def flows_of(path) -> list:
    """The model flows of a capture (the start-up health checks are captured too)."""
    with open(path, "rb") as f:
        return [f for f in io.FlowReader(f).stream() if not f.request.path.startswith("/__bili/")]


@pytest.mark.parametrize("lane,stream", [("anthropic", True), ("responses", True), ("gemini", False)])
def test_a_folding_session_captured_replays_turn_by_turn(fake, make_proxy, tmp_path, sid, lane, stream):
    """Fold mode: turn 8's answer calls compress, turn 9 runs it; later turns decompress, search and
    ask for the status.  Streamed answers are not kept in the flow (mitmproxy's default): the
    addon's record carries their proxy tool calls, and replay runs them as the proxy did."""
    proxy, path = captured(make_proxy, tmp_path, "fold")
    fake.script(sid, session_script())
    agent = make_agent(lane, proxy, sid, sid, stream=stream)
    up = Turns(fake, sid)
    for t in range(1, TURNS + 1):
        agent.step(t, run_bash)
        up[t]
    live = proxy.wait_bili_lines(TURNS, session=sid)
    assert len(live) == TURNS
    proxy.stop()  # the file is complete once mitmdump closes it
    assert_clean_log(proxy)
    assert path.stat().st_size > 0

    flows = flows_of(path)
    assert len(flows) == TURNS
    for f in flows:
        rec = f.metadata["bili"]
        assert rec["session"] == sid and rec["lane"] == lane and rec["mode"] == "fold"
        assert isinstance(rec["request"], bytes)  # the agent's own body; the flow holds what went upstream
        if stream:
            assert not f.response.content  # not kept: the record is what replay has
    assert flows[COMPRESS_TURN - 1].metadata["bili"]["called"][0][1] == "compress"
    assert flows[COMPRESS_TURN].metadata["bili"]["executed"] == ["compress"]
    assert flows[COMPRESS_TURN].metadata["bili"]["folds"][0][0] == "b1"

    r = read_back(path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("POST http://") == TURNS and r.stdout.count("<< 200 OK") >= TURNS, r.stdout[-2000:]

    rep = replay.replay_file(path, activate="always", materialize="now")
    assert not rep.errors
    turns = replayed_turns(rep, sid)
    assert [(t.messages, t.refs_new, t.refs_known, t.blocks, t.folded, t.executed) for t in turns] == \
        live_turns(proxy, sid)
    assert turns[COMPRESS_TURN].executed == ["compress"] and turns[COMPRESS_TURN].blocks == 1
    assert [t.executed for t in turns[11:14]] == [["decompress"], ["search_context"], ["acp_status"]]
    assert not any("live:" in t.note for t in turns), [t.note for t in turns]
    # the same bytes the upstream received, turn by turn
    for t in turns:
        assert t.body == up[t.turn].body, f"turn {t.turn}: the replay sends other bytes than the proxy did"

    # and the command: the table shows the fold where the proxy ran it
    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "replay", "--activate", "always", "--materialize", "now", str(path)],
                         capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines() if re.match(r"^\s+\d+\s+" + lane, ln)]
    assert len(rows) == TURNS
    assert rows[COMPRESS_TURN][0] == str(COMPRESS_TURN + 1) and "compress" in rows[COMPRESS_TURN]


def test_observe_mode_is_captured(fake, make_proxy, tmp_path, sid):
    proxy, path = captured(make_proxy, tmp_path, "observe")
    fake.script(sid, [reading(1), reading(2), reading(3), say("Turn 4: done.")])
    agent = make_agent("anthropic", proxy, sid, sid)
    for t in range(1, 5):
        agent.step(t, run_bash)
    proxy.wait_bili_lines(4, session=sid)
    proxy.stop()
    assert_clean_log(proxy)
    flows = flows_of(path)
    assert len(flows) == 4
    for f in flows:
        rec = f.metadata["bili"]
        assert rec["mode"] == "observe" and rec["rendered"] is False and "request" not in rec  # body unchanged
        assert rec["usage"]["output"] > 0  # the streamed answer's usage, recorded
    assert read_back(path).returncode == 0
    turns = replayed_turns(replay.replay_file(path, activate="always", materialize="now"), sid)
    assert [(t.messages, t.refs_new, t.refs_known) for t in turns] == [x[:3] for x in live_turns(proxy, sid)]
    assert not any("live:" in t.note for t in turns)


def test_passthrough_mode_is_captured(fake, make_proxy, tmp_path, sid):
    proxy, path = captured(make_proxy, tmp_path, "passthrough")
    fake.script(sid, [reading(1), say("Turn 2: done.")])
    agent = make_agent("anthropic", proxy, sid, sid)
    for t in (1, 2):
        agent.step(t, run_bash)
    proxy.stop()
    assert_clean_log(proxy)
    flows = flows_of(path)
    assert len(flows) == 2 and not any("bili" in f.metadata for f in flows)  # nothing recorded, as promised
    assert read_back(path).returncode == 0
    turns = replayed_turns(replay.replay_file(path, activate="always", materialize="now"), sid)
    assert [t.turn for t in turns] == [1, 2] and turns[0].live is None


def test_a_responses_websocket_is_captured_with_its_frames_records(fake, make_proxy, tmp_path, sid):
    """Fold mode with the WebSocket allowed: each ``response.create`` frame is rewritten; the flow keeps
    one record per frame, with the agent's own frame, and replay takes those."""
    path = tmp_path / "ws.mitm"
    proxy = make_proxy("reverse", "fold", save_stream_file=str(path), bili_refuse_websocket="false")
    history = [{"role": "user", "content": "A first question over the socket."}]
    frames = []
    with ws_connect(f"ws://127.0.0.1:{proxy.port}/v1/responses", additional_headers={"session_id": sid},
                    proxy=None) as ws:
        for text in ("A follow-up question.", None):
            frame = json.dumps({"type": "response.create", "model": "gpt-fake-1", "input": history})
            frames.append(frame.encode())
            ws.send(frame)
            while json.loads(ws.recv(timeout=30))["type"] != "response.completed":
                pass
            if text:
                history = history + [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": text}]
    upstream = [r.raw for r in fake.find(lambda r: r.transport == "ws" and r.header("session_id") == sid)]
    assert len(upstream) == 2 and upstream[0] != frames[0]  # tagged on the way
    proxy.wait_bili_lines(2, session=sid)
    proxy.stop()
    assert_clean_log(proxy)
    [flow] = [f for f in flows_of(path) if f.websocket is not None]
    records = flow.metadata["bili_ws"]
    assert [r["request"] for r in records] == frames and all(r["via"] == "ws" for r in records)
    assert [flow.websocket.messages[r["message"]].content for r in records] == upstream
    turns = replayed_turns(replay.replay_file(path, activate="always", materialize="now"), sid)
    assert [(t.messages, t.refs_new, t.refs_known) for t in turns] == [x[:3] for x in live_turns(proxy, sid)]
    assert [t.body for t in turns] == upstream and all(t.via == "ws" for t in turns)
    assert [t.note for t in turns] == ["", ""]  # the proxy took this socket: no "refused" note, no difference
