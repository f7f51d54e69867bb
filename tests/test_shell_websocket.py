"""Responses over WebSocket in the shell, frame by frame (mitmproxy's test flows, no sockets): each
``response.create`` goes through the chains transcript of its connection, the answer's frames feed
it, and every frame fails open on its own."""

from __future__ import annotations

import json
import re

import pytest
from mitmproxy.test import tflow
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)", re.M)


def ws_flow(sid: str = "ws-chain"):
    f = tflow.twebsocketflow()
    f.request.path = "/v1/responses"
    f.request.headers["session_id"] = sid
    return f


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def create(input_items: list, prev: str | None = None, **extra) -> dict:
    frame = {"type": "response.create", "model": "gpt-5.1-codex", "input": input_items, "tools": TOOLS,
             "store": False, **extra}
    if prev:
        frame["previous_response_id"] = prev
    return frame


def send(bili, f, frame: dict | bytes) -> bytes:
    """A client frame through the addon; returns the bytes that go upstream."""
    raw = frame if isinstance(frame, bytes) else json.dumps(frame).encode()
    f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, True, raw))
    bili.websocket_message(f)
    return f.websocket.messages[-1].content


def answer(bili, f, rid: str, output: list, prompt: int = 100) -> list[bytes]:
    """The server's frames of one answer through the addon (``prompt``: the input tokens its usage
    reports); returns what reaches the agent."""
    events = [{"type": "response.created", "response": {"id": rid, "status": "in_progress", "output": []}}]
    events += [{"type": "response.output_item.done", "output_index": i, "item": it} for i, it in enumerate(output)]
    events.append({"type": "response.completed", "response": {
        "id": rid, "status": "completed", "output": output,
        "usage": {"input_tokens": prompt, "output_tokens": 10}}})
    got = []
    for e in events:
        f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, False, json.dumps(e).encode()))
        bili.websocket_message(f)
        got.append(f.websocket.messages[-1].content)
    return got


def step(n: int) -> list:
    return [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": f"Step {n}: reading listing {n}.", "annotations": []}]},
            {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "shell",
             "arguments": json.dumps({"cmd": f"cat listing-{n}"}), "status": "completed"}]


def result(n: int) -> dict:
    return {"type": "function_call_output", "call_id": f"call_{n}",
            "output": "\n".join(f"listing-{n}-row-{i:04d} the quick brown fox" for i in range(60))}


def test_a_delta_on_the_connection_s_own_chain_goes_up_as_a_delta(bili):
    f = ws_flow()
    first = json.loads(send(bili, f, create([user("Work through the listings.")])))
    assert "previous_response_id" not in first and first["input"][-1]["content"][0]["text"].endswith("listings.")
    answer(bili, f, "resp_1", step(1))
    up = json.loads(send(bili, f, create([result(1)], prev="resp_1")))
    # the provider's chain holds the history already: only the new item goes up, on the agent's chain
    assert up["previous_response_id"] == "resp_1"
    assert [it["type"] for it in up["input"]] == ["function_call_output"]
    assert up["input"][0]["output"] == result(1)["output"]


def test_a_delta_on_another_connection_goes_up_whole(bili):
    """``store: false`` chains live on their connection: on another one bili sends the whole input
    without ``previous_response_id`` (an id that upstream connection never saw never goes up)."""
    f = ws_flow("ws-conn")
    send(bili, f, create([user("Work through the listings.")]))
    answer(bili, f, "resp_a", step(1))
    g = ws_flow("ws-conn")
    up = json.loads(send(bili, g, create([result(1)], prev="resp_a")))
    assert "previous_response_id" not in up
    assert [it.get("type", "message") for it in up["input"]][-3:] == ["message", "function_call", "function_call_output"]
    assert "Work through the listings." in json.dumps(up["input"])
    assert all("id" not in it for it in up["input"] if it.get("type") == "function_call")  # store: false outputs


def test_a_stored_chain_continues_on_any_connection(bili):
    f = ws_flow("ws-stored")
    send(bili, f, create([user("Work through the listings.")], store=True))
    answer(bili, f, "resp_s", step(1))
    up = json.loads(send(bili, ws_flow("ws-stored"), create([result(1)], prev="resp_s", store=True)))
    assert up["previous_response_id"] == "resp_s" and len(up["input"]) == 1


def test_an_unknown_chain_passes_byte_for_byte(bili):
    f = ws_flow("ws-unknown")
    raw = json.dumps(create([result(9)], prev="resp_before_bili")).encode()
    assert send(bili, f, raw) == raw
    # its answer passes too, and the turn after it (on that unknown chain) still passes observed
    got = answer(bili, f, "resp_u", step(10))
    assert all(json.loads(x)["type"] for x in got)
    raw2 = json.dumps(create([result(10)], prev="resp_u")).encode()
    assert send(bili, f, raw2) == raw2


def test_a_frame_fails_open_and_the_next_one_is_handled(bili, monkeypatch, caplog):
    f = ws_flow("ws-failopen")
    raw = json.dumps(create([user("first words")])).encode()
    eng = bili.engine
    real = eng.process

    def boom(*a, **kw):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(eng, "process", boom)
    assert send(bili, f, raw) == raw
    assert "internal error" in caplog.text and "forwarding unchanged" in caplog.text
    monkeypatch.setattr(eng, "process", real)
    assert send(bili, f, raw) != raw  # tagged again once the kernel works


def test_a_server_frame_fails_open(bili, monkeypatch, caplog):
    f = ws_flow("ws-server-failopen")
    send(bili, f, create([user("hello")]))
    st = bili._flows[f]

    def boom(raw):
        raise RuntimeError("rewriter bug")

    monkeypatch.setattr(st.rewriter, "ws_frame", boom)
    frame = b'{"type":"response.output_text.delta","delta":"x"}'
    f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, False, frame))
    bili.websocket_message(f)
    assert f.websocket.messages[-1].content == frame
    assert "WebSocket frame handling failed" in caplog.text


def test_non_create_and_binary_frames_pass(bili):
    f = ws_flow("ws-other")
    raw = b'{"type":"response.cancel"}'
    assert send(bili, f, raw) == raw
    f.websocket.messages.append(WebSocketMessage(Opcode.BINARY, True, b"\x00\x01"))
    bili.websocket_message(f)
    assert f.websocket.messages[-1].content == b"\x00\x01"


def test_tag_echoes_are_stripped_from_the_server_frames(bili):
    f = ws_flow("ws-echo")
    send(bili, f, create([user("hello")]))
    out = [{"type": "message", "id": "msg_e", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": '<acp tokens="3" type="text">m00001</acp>\nHi.',
                         "annotations": []}]}]
    got = answer(bili, f, "resp_e", out)
    final = json.loads(got[-1])
    assert final["response"]["output"][0]["content"][0]["text"] == "Hi."
    # the transcript keeps the answer as the provider sent it: the next delta still chains on it
    up = json.loads(send(bili, f, create([user("and then?")], prev="resp_e")))
    assert up["previous_response_id"] == "resp_e" and len(up["input"]) == 1


def test_a_fold_goes_up_as_the_whole_folded_input_then_deltas_resume(bili):
    """Deltas while nothing already sent changes; the turn a fold lands on goes up whole, without
    ``previous_response_id``; the agent's next delta chains on that response as usual."""
    bili.tctx.configure(bili, bili_remind_at=1500, bili_min_compress_chars=0)
    f = ws_flow("ws-fold")
    send(bili, f, create([user("Work through the listings one by one.")]))
    prev, ranges, n = "resp_0", [], 0
    answer(bili, f, prev, step(1))
    modes = []
    for n in range(1, 12):
        up = json.loads(send(bili, f, create([result(n)], prev=prev)))
        modes.append("delta" if up.get("previous_response_id") == prev else "full")
        # the reminder rides in the delta (a user message after the newest result), never in the history
        said = "\n".join(p.get("text", "") for it in up["input"] for p in it.get("content") or [] if isinstance(p, dict))
        ranges = REMINDER.findall(said) if "[bili] " in said else []
        prev = f"resp_{n}"
        if ranges:
            break
        answer(bili, f, prev, step(n + 1), prompt=700 * n)  # the prompt's size, as the real API reports it
    assert ranges and set(modes) == {"delta"}, modes
    # the model folds what the reminder names; codex answers "unknown tool"
    args = {"content": [{"startId": a, "endId": b, "topic": "listings", "summary": "Listings 1 to 4 were read; every row is in order and nothing needs a follow-up."}
                        for a, b, _n, _k in ranges]}
    answer(bili, f, prev, [{"type": "function_call", "id": "fc_c", "call_id": "call_c", "name": "compress",
                            "arguments": json.dumps(args), "status": "completed"}])
    unknown = {"type": "function_call_output", "call_id": "call_c", "output": "unsupported call: compress"}
    up = json.loads(send(bili, f, create([unknown], prev=prev)))
    assert "previous_response_id" not in up, (ranges, up["input"])
    text = json.dumps(up["input"])
    assert "[Compressed conversation section b1" in text and "listing-1-row-0000" not in text
    assert "Work through the listings one by one." in text
    assert up["input"][-1]["call_id"] == "call_c" and "unsupported call" not in up["input"][-1]["output"]
    answer(bili, f, "resp_after", step(50))
    nxt = json.loads(send(bili, f, create([result(50)], prev="resp_after")))
    assert nxt["previous_response_id"] == "resp_after" and len(nxt["input"]) == 1


@pytest.mark.parametrize("refuse", [False, True])
def test_observe_mode_never_refuses_and_records(bili, refuse):
    bili.tctx.configure(bili, bili_mode="observe", bili_refuse_websocket=refuse)
    f = ws_flow("ws-observe")
    raw = json.dumps(create([user("observed words")])).encode()
    assert send(bili, f, raw) == raw
    answer(bili, f, "resp_o", step(1))
    raw2 = json.dumps(create([result(1)], prev="resp_o")).encode()
    assert send(bili, f, raw2) == raw2
    assert [s["id"] for s in bili.stats()["sessions"]] == ["ws-observe"]


def test_a_closed_connection_leaves_nothing_behind_in_the_transcript_s_memory(bili):
    """Each WebSocket (its flow id) is a key of the transcript's newest-response-per-connection map; a
    connection that ended can never be chained on again (``store: false`` responses die with it), so
    its key goes with it: a proxy that runs for weeks does not keep one entry per connection ever made."""
    chains = bili.keeper.run(lambda eng: eng.chains)
    for i in range(3):
        f = ws_flow(f"ws-gone-{i}")
        send(bili, f, create([user(f"Conversation {i}.")]))
        answer(bili, f, f"resp_gone_{i}", step(1))
        assert chains._last_on_conn.get(f.id) == f"resp_gone_{i}"
        bili.websocket_end(f)
        assert f.id not in chains._last_on_conn
    assert chains._last_on_conn == {}


@pytest.mark.parametrize("mode", ["fold", "observe"])
def test_a_chained_turn_s_predicted_cache_share_is_of_the_whole_chain(bili, mode):
    """The provider reads the whole chain (its history plus the delta), in observe mode as in fold
    mode: the flow record's predicted cache-read share compares whole prompts, not two deltas."""
    from bili_addon import flowmeta

    bili.tctx.configure(bili, bili_mode=mode)
    f = ws_flow(f"ws-predict-{mode}")
    send(bili, f, create([user("Work through the listings.")]))
    answer(bili, f, "resp_p0", step(1))
    for n in range(1, 4):
        send(bili, f, create([result(n)], prev=f"resp_p{n - 1}"))
        answer(bili, f, f"resp_p{n}", step(n + 1))
    rec = f.metadata[flowmeta.WS_KEY][-1]
    assert rec["predicted"] is not None and rec["predicted"] > 0.6, rec.get("predicted")


def test_a_frame_passed_on_unchanged_leaves_without_bilis_own_envelope(bili, monkeypatch):
    f = ws_flow("ws-envelope")
    frame = create([user("first words")], biliMsgIds=["a1"])

    def boom(*a, **kw):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(bili.engine, "process", boom)
    sent = json.loads(send(bili, f, frame))
    assert sent == {k: v for k, v in frame.items() if k != "biliMsgIds"}


def test_a_frame_the_kernel_refuses_leaves_without_bilis_own_envelope(bili):
    """A vouched id re-used for another message: over HTTP bili answers 400 itself; a WebSocket frame
    cannot be answered so, and went up with ``biliMsgIds``, which the provider refuses."""
    f = ws_flow("ws-env")
    up1 = json.loads(send(bili, f, create([user("hello")], biliMsgIds=["a"])))
    assert "biliMsgIds" not in up1
    answer(bili, f, "resp_e1", step(1))
    frame = create([user("hello"), *step(1), result(1)], biliMsgIds=["b", "c", "d", "a"])
    up2 = json.loads(send(bili, f, frame))
    assert "biliMsgIds" not in up2 and up2["input"] == frame["input"]


def test_passthrough_sends_a_frame_as_it_came_without_bilis_own_envelope(bili):
    """``bili_mode=passthrough`` forwards every body untouched but bili's own ``biliMsgIds`` (the provider
    answers 400 to it); a WebSocket frame kept it.  Other frames and the answers are not touched."""
    bili.tctx.configure(bili, bili_mode="passthrough")
    f = ws_flow("ws-pass")
    frame = create([user("first words")], biliMsgIds=["a1"])
    assert json.loads(send(bili, f, frame)) == {k: v for k, v in frame.items() if k != "biliMsgIds"}
    plain = json.dumps(create([user("again")])).encode()
    assert send(bili, f, plain) == plain


@pytest.mark.parametrize("active", [True, False])
def test_the_upgrade_request_leaves_without_bilis_own_headers(bili, active):
    """A host that vouches its message ids (``x-bili-msg-ids``) may send the header on the WebSocket's
    upgrade request too: it is bili's alone and never reaches the provider, whether bili is on or off."""
    from bili_addon.kernel import envelope

    if not active:
        bili.tctx.configure(bili, bili_mode="passthrough")
    f = ws_flow()
    f.request.method = "GET"
    f.request.headers["upgrade"] = "websocket"
    f.request.headers[envelope.HEADER] = '["a","b"]'
    f.request.headers[envelope.RESYNC_HEADER] = "1"
    bili.request(f)
    assert envelope.HEADER not in f.request.headers and envelope.RESYNC_HEADER not in f.request.headers
    assert f.request.headers["session_id"] == "ws-chain"
