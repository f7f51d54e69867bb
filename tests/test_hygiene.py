"""Request-side hygiene: replayed echoes and markers, proxy ids, strict reasoning echo."""

from __future__ import annotations

import json

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from bili_addon.kernel.turn import Engine
from bili_addon.shell import Bili
from bili_addon.store import Store
from bili_addon.wire import LANES

H = {"x-acp-session": "hyg"}


@pytest.fixture
def engine(tmp_path):
    e = Engine(Store(tmp_path), inject=False)
    yield e
    e.store.close()


def chat_body(*messages, model="gpt-x"):
    return json.dumps({"model": model, "messages": list(messages)}).encode()


CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": '{"c": "ls"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}


def test_replayed_echo_never_reaches_the_model_and_keeps_identity(engine):
    clean = chat_body({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "next"})
    echoed = chat_body({"role": "user", "content": "hi"},
                       {"role": "assistant", "content": '<acp tokens="2" type="text">m00001</acp>\n\n\nHello!'},
                       {"role": "user", "content": "next"})
    a = engine.process(clean, LANES["chat"], H, render=True)
    b = engine.process(echoed, LANES["chat"], H, render=True)
    assert b.body == a.body  # the echo is gone and the message kept its ref
    assert b.refs_new == 0


def test_replayed_marker_lines_are_stripped(engine):
    body = chat_body({"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "[bili] compressed m00002–m00009 → b1, ~3K tokens saved\nDone."},
                     {"role": "user", "content": "ok"})
    out = json.loads(engine.process(body, LANES["chat"], H, render=True).body)
    assert out["messages"][1]["content"].endswith("</acp>\nDone.")
    assert "[bili]" not in out["messages"][1]["content"]


def test_a_line_of_the_models_own_that_starts_like_bilis_is_its_prose(engine):
    """Any leading "[bili] ..." line was taken for bili's marker and removed, in every session (one bili
    never showed itself in too): the model quoting bili's log lost its words."""
    said = "[bili] session=s1: stripped 2 tag echo(es) from the answer\nThat is the line from your log."
    body = chat_body({"role": "user", "content": "what does this log line mean?"},
                     {"role": "assistant", "content": said}, {"role": "user", "content": "ok"})
    out = json.loads(engine.process(body, LANES["chat"], H, render=True).body)
    assert out["messages"][1]["content"].endswith("</acp>\n" + said)
    held = "[bili] compressed m00002–m00009 → b1, ~3K tokens saved (the range leaves when the prompt cache is cold)\nOk."
    body = chat_body({"role": "user", "content": "hi"}, {"role": "assistant", "content": held},
                     {"role": "user", "content": "ok"})
    assert json.loads(engine.process(body, LANES["chat"], H, render=True).body)["messages"][1]["content"].endswith(
        "</acp>\nOk.")


def test_proxy_ids_are_removed_and_provider_ids_kept(engine):
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_abc", "summary": [], "encrypted_content": "enc"},
        {"type": "message", "id": "msg-proxy-1733-0", "role": "assistant",
         "content": [{"type": "output_text", "text": "[bili] compressed m00001–m00002 → b1"}]},
        {"type": "message", "id": "msg_real", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "x"},
        {"type": "message", "role": "user", "content": "go"},
    ]
    raw = json.dumps({"model": "m", "input": items}).encode()
    out = json.loads(engine.process(raw, LANES["responses"], H, render=True).body)["input"]
    assert "id" not in out[2]
    assert [out[1]["id"], out[3]["id"], out[4]["id"]] == ["rs_abc", "msg_real", "fc_1"]
    assert out[1]["encrypted_content"] == "enc"
    # observe mode still forwards everything unchanged
    assert engine.process(raw, LANES["responses"], H, render=False).body is None


def test_non_strict_sessions_get_no_reasoning_repair(engine):
    body = chat_body({"role": "user", "content": "hi"}, CALL, RESULT)
    out = json.loads(engine.process(body, LANES["chat"], H, render=True).body)
    assert "reasoning_content" not in out["messages"][1]


@pytest.mark.parametrize("learned,model", [(True, "gpt-x"), (False, "deepseek-chat")])
def test_strict_chat_sessions_get_empty_reasoning_content(engine, learned, model):
    if learned:
        engine.session("hyg")
        engine.set_flag("hyg", "strict_reasoning", True)
    body = chat_body({"role": "user", "content": "hi"}, CALL, RESULT,
                     {"role": "assistant", "content": "done", "reasoning_content": "thought"}, model=model)
    out = json.loads(engine.process(body, LANES["chat"], H, render=True).body)["messages"]
    assert out[1]["reasoning_content"] == ""
    assert out[3]["reasoning_content"] == "thought"  # never dropped or replaced
    assert out[1]["tool_calls"] == CALL["tool_calls"]


def test_a_switch_to_a_strict_model_repairs_the_items_reused_from_before(engine):
    """The repair by model name was decided per pass, but the items the previous pass rendered were reused
    as they were: after a switch to a DeepSeek model the older tool-call messages went without
    ``reasoning_content`` (the provider refuses them), and the same body gave other bytes after a restart."""
    def call(i):
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": {"name": "sh", "arguments": '{"c":"ls"}'}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"out {i}"}]

    def send(msgs, model):
        res = engine.process(json.dumps({"model": model, "messages": msgs}).encode(), LANES["chat"], H, render=True)
        return ["reasoning_content" in m for m in json.loads(res.body)["messages"] if m.get("tool_calls")]

    msgs = [{"role": "user", "content": "list the files please"}, *call(1)]
    assert send(msgs, "gpt-x") == [False]
    msgs += call(2)
    assert send(msgs, "deepseek-chat") == [True, True]
    msgs += call(3)
    assert send(msgs, "gpt-x") == [False, False, False]  # (and back)


def test_strict_flag_survives_a_restart(tmp_path):
    e = Engine(Store(tmp_path), inject=False)
    e.session("hyg")
    e.set_flag("hyg", "strict_reasoning", True)
    e.store.close()
    e2 = Engine(Store(tmp_path), inject=False)
    assert e2.session("hyg").flags.get("strict_reasoning") is True  # (with the fork check's verdict)
    assert set(e2.session("hyg").flags) <= {"strict_reasoning", "own_history"}


def test_strict_responses_runs_get_a_reasoning_item(engine):
    engine.session("hyg")
    engine.set_flag("hyg", "strict_reasoning", True)
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "message", "role": "user", "content": "again"},
        {"type": "function_call", "call_id": "c2", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "y"},
    ]
    out = json.loads(engine.process(json.dumps({"model": "m", "input": items}).encode(),
                                    LANES["responses"], H, render=True).body)["input"]
    assert [i.get("type") for i in out] == [
        "message", "reasoning", "function_call", "function_call_output", "message",
        "reasoning", "function_call", "function_call_output",
    ]
    assert out[5] == {"type": "reasoning", "summary": [{"type": "summary_text", "text": ""}]}


def test_a_fold_takes_the_runs_it_covers_without_leaving_their_repair_behind(tmp_path):
    """Strict Responses: the empty reasoning item put before each run without one went out even where a
    fold took the run, standing alone before the summary or the next user message."""
    import churn as C
    from bili_addon.kernel.fold import FoldConfig
    from bili_addon.kernel.turn import Engine
    from bili_addon.store import Store

    sid, h = "strictfold", {"x-acp-session": "strictfold"}
    e = Engine(Store(tmp_path / "d"), fold_cfg=FoldConfig(min_compress_chars=2000))
    e.session(sid)
    e.set_flag(sid, "strict_reasoning", True)
    tail = [{"type": "reasoning", "id": "rs_last", "summary": [{"type": "summary_text", "text": "thinking"}],
             "encrypted_content": "enc"},
            {"type": "function_call", "call_id": "last", "name": "Bash", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "last", "output": "ok"}]

    def send(items):
        return json.loads(e.process(C.body("responses", items + tail), LANES["responses"], h, render=True).body)["input"]

    ts = C.turns(12)
    refs = C.refs_by_text(json.dumps({"input": send(C.BUILD["responses"](ts, C.Scheme()))}).encode())
    args = {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "], "summary": "S" * 120}]}
    e.record_calls(sid, [("cfold", "compress", json.dumps(args))])
    out = send(C.BUILD["responses"](ts, C.Scheme(), C.proxy_call("responses", "cfold", "compress", args)))
    assert any("[Compressed conversation section b1" in json.dumps(i) for i in out)
    kinds = [(i.get("type") or "message") + ":" + i.get("role", "") for i in out]
    assert all(kinds[k + 1] not in ("message:user", "reasoning:") for k, t in enumerate(kinds) if t == "reasoning:"), kinds


def flow_for(body: bytes, path="/v1/chat/completions"):
    req = tutils.treq(method=b"POST", path=path.encode(), host="relay.example", port=443, scheme=b"https",
                      headers=http.Headers(host="relay.example", content_type="application/json", x_acp_session="s"),
                      content=body)
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 1)
    return f


def test_a_400_naming_reasoning_content_teaches_the_session(tmp_path):
    addon = Bili()
    body = chat_body({"role": "user", "content": "hi"}, CALL, RESULT)
    with taddons.context(addon) as tctx:
        tctx.configure(addon, bili_data_dir=str(tmp_path))
        f = flow_for(body)
        addon.request(f)
        assert "reasoning_content" not in json.loads(f.request.content)["messages"][1]
        f.response = http.Response.make(
            400, b'{"error":{"message":"The reasoning_content in the thinking mode must be passed back"}}',
            {"content-type": "application/json"},
        )
        addon.response(f)
        g = flow_for(body)
        addon.request(g)
        assert json.loads(g.request.content)["messages"][1]["reasoning_content"] == ""
        flags = addon.stats()["sessions"][0]["flags"]
        assert flags.get("strict_reasoning") is True and set(flags) <= {"strict_reasoning", "own_history"}
    addon.done()


@pytest.mark.parametrize("mode,refuse,refused", [("fold", None, False), ("fold", True, True), ("observe", True, False)])
def test_websocket_upgrade_on_responses_is_refused_in_fold_mode_when_asked(tmp_path, mode, refuse, refused):
    """By default the upgrade goes through (chained turns are folded); ``bili_refuse_websocket``
    answers it with 426 in fold mode, so the agent falls back to HTTP."""
    addon = Bili()
    with taddons.context(addon) as tctx:
        opts = {} if refuse is None else {"bili_refuse_websocket": refuse}
        tctx.configure(addon, bili_data_dir=str(tmp_path), bili_mode=mode, **opts)
        req = tutils.treq(method=b"GET", path=b"/v1/responses", host="api.openai.com", port=443, scheme=b"https",
                          headers=http.Headers(host="api.openai.com", upgrade="websocket", connection="Upgrade"),
                          content=b"")
        f = tflow.tflow(req=req)
        addon.request(f)
        assert (f.response is not None and f.response.status_code == 426) == refused
    addon.done()
