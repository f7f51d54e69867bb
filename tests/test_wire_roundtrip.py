"""Byte-exactness of every lane: captured bodies and generated bodies through ``Body`` and the kernel.

Two properties, on real captures and on hypothesis bodies of all four lanes:

* unrendered: ``Body`` re-emits the body byte for byte, and the kernel leaves it alone;
* rendered: valid JSON that differs only at prose strings (a tag prefixed to the text; replayed
  assistant prose also loses tag echoes), with every other leaf (tool arguments, tool results,
  signatures, provider ids, cache_control) byte-identical; rendering the rendered body again in
  the same session changes nothing.
"""

from __future__ import annotations

import json
import uuid

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bili_addon.kernel.turn import Engine
from bili_addon.store import Store
from bili_addon.wire import LANES
from bili_addon.wire.base import TEXT, Body, CodecError, decode_any

import wirecases as wc

CAPTURE_FILES = wc.capture_files()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(Store(tmp_path_factory.mktemp("bili-gen")), inject=False)
    yield eng
    eng.store.close()


def _resolve(obj, path):
    for key in path:
        obj = obj[key]
    return obj


# -- captures ----------------------------------------------------------------------------------


@pytest.mark.skipif(not CAPTURE_FILES, reason="no captures")
def test_captures_cover_the_openai_lanes():
    lanes = {c.lane.name for f in CAPTURE_FILES for c in wc.captured_bodies(f)}
    assert {"anthropic", "chat", "responses"} <= lanes


@pytest.mark.parametrize("path", CAPTURE_FILES, ids=lambda p: p.split("captures/")[-1].rsplit("/", 1)[0])
def test_capture_roundtrip(path, tmp_path):
    bodies = wc.captured_bodies(path)
    if not bodies:
        pytest.skip("no model requests in this capture")
    plain = Engine(Store(tmp_path / "plain"), inject=False)
    real = Engine(Store(tmp_path / "real"), inject=False)
    forced = Engine(Store(tmp_path / "forced"), inject=False)
    try:
        for cap in bodies:
            lane, raw = cap.lane, cap.raw
            body = Body(raw, lane.conv_key)
            assert body.encode([bytes(i) for i in body.items]) == raw, cap.name

            # every path a lane hands out points at the very string of its core
            for it in body.items:
                obj = decode_any(it)
                for core in lane.item_cores(obj):
                    if core.path:
                        assert core.ctype == TEXT, cap.name
                        assert _resolve(obj, core.path) == core.text, cap.name

            assert plain.process(raw, lane, cap.headers, render=False).body is None, cap.name

            expected = wc.tagged_paths(raw, lane)
            res = real.process(raw, lane, cap.headers, render=True)
            wc.check_rendered(raw, res.body, lane, expected if res.session else {})

            # a session id of our own: the turn is always rendered, and rendering twice is stable
            headers = dict(cap.headers, **{"x-acp-session": "cap-" + cap.name.split("#")[0]})
            res = forced.process(raw, lane, headers, render=True)
            wc.check_rendered(raw, res.body, lane, expected)
            if res.body is not None and wc.replay_stable(raw, lane):
                again = forced.process(res.body, lane, headers, render=True)
                assert again.body is None and again.refs_new == 0, cap.name
    finally:
        for eng in (plain, real, forced):
            eng.store.close()


# -- hand-written bodies: the leaves that must never move --------------------------------------


SIG = "EqQBCkgIARABGAIiQM0xbW9uc3RlciBzaWduYXR1cmUgdGhhdCBtdXN0IG5vdCBjaGFuZ2U="


def _render(engine, lane_name: str, body: dict) -> tuple[bytes, bytes]:
    raw = json.dumps(body, ensure_ascii=False).encode()
    res = engine.process(raw, LANES[lane_name], {"x-acp-session": uuid.uuid4().hex}, render=True)
    assert res.body is not None
    wc.check_rendered(raw, res.body, LANES[lane_name], wc.tagged_paths(raw, LANES[lane_name]))
    return raw, res.body


def test_gemini_render_keeps_signatures_and_calls(engine):
    body = {"contents": [
        {"role": "user", "parts": [{"text": "weather in Paris?"}]},
        {"role": "model", "parts": [
            {"text": "thinking...", "thought": True, "thoughtSignature": SIG},
            {"text": "Let me check.", "thoughtSignature": SIG},
            {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}, "thoughtSignature": SIG},
        ]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"t": 20}}}]},
    ], "systemInstruction": {"parts": [{"text": "be brief"}]}}
    _raw, out = _render(engine, "gemini", body)
    got = json.loads(out)
    model = got["contents"][1]["parts"]
    assert [p.get("thoughtSignature") for p in model] == [SIG, SIG, SIG]
    assert model[0]["text"] == "thinking..."  # reasoning is never tagged
    assert model[1]["text"].endswith("</acp>\nLet me check.")
    assert got["contents"][2] == body["contents"][2] and got["systemInstruction"] == body["systemInstruction"]


def test_responses_render_keeps_ids_calls_and_reasoning(engine):
    body = {"model": "m", "input": [
        {"type": "message", "id": "msg_dev", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "id": "msg_u1", "role": "user", "content": [{"type": "input_text", "text": "run ls"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**ls**"}], "content": None,
         "encrypted_content": "gAAAA=="},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec", "arguments": "{\"cmd\": \"ls\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\n"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "one file", "annotations": []}]},
        {"role": "user", "content": "thanks"},
    ]}
    raw, out = _render(engine, "responses", body)
    items = json.loads(out)["input"]
    for i in (0, 2, 3, 4):
        assert items[i] == body["input"][i]
    assert items[1]["id"] == "msg_u1" and items[1]["content"][0]["text"].endswith("</acp>\nrun ls")
    assert items[5]["content"][0]["text"].endswith("</acp>\none file")
    assert items[6]["content"].endswith("</acp>\nthanks")


def test_chat_render_keeps_calls_results_and_cache_control(engine):
    args = '{"command":  "echo hi"}'
    body = {"model": "m", "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hi\n"},
        {"role": "assistant", "content": "prefill"},
    ]}
    raw, out = _render(engine, "chat", body)
    msgs = json.loads(out)["messages"]
    assert msgs[0] == body["messages"][0]
    assert msgs[1]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert msgs[2] == body["messages"][2] and msgs[3] == body["messages"][3]
    assert msgs[4] == body["messages"][4]  # the final assistant message is a prefill: never tagged
    assert args.encode() in out or json.dumps(args).encode() in out


def test_responses_string_input_is_left_alone(engine):
    lane = LANES["responses"]
    assert lane.item_cores("just a string") and not lane.is_system_item("just a string")
    raw = b'{"model":"m","input":"hello there, a plain string input"}'
    try:
        res = engine.process(raw, lane, {"x-acp-session": "s-string"}, render=True)
    except CodecError:
        return  # Body refuses a non-array conversation; the shell forwards such a body unchanged
    assert res.body is None


# -- generated bodies --------------------------------------------------------------------------

GEN_SETTINGS = settings(
    max_examples=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("lane_name", ["anthropic", "chat", "responses", "gemini"])
@GEN_SETTINGS
@given(data=st.data())
def test_generated_bodies(engine, lane_name, data):
    gen: wc.GenBody = data.draw(wc.bodies(lane_name), label="body")
    lane, raw = gen.lane, gen.raw

    # unrendered: byte for byte
    body = Body(raw, lane.conv_key)
    assert len(body.items) == len(gen.items)
    assert body.encode([bytes(i) for i in body.items]) == raw

    # the lane agrees with the generator's oracle
    for it, want in zip(body.items, gen.items):
        obj = msgspec.json.decode(bytes(it))
        assert lane.is_system_item(obj) == want.system
        cores = lane.item_cores(obj)
        assert [(c.role, c.ctype) for c in cores] == [(w.role, w.ctype) for w in want.wants], obj
        for c, w in zip(cores, want.wants):
            assert (c.path or None) == w.path, obj
            if w.text is not None:
                assert c.text == w.text, obj
            if c.path:
                assert _resolve(obj, c.path) == c.text
    expected = wc.oracle_tagged(gen)
    assert wc.tagged_paths(raw, lane) == expected

    session = {"x-acp-session": uuid.uuid4().hex}
    assert engine.process(raw, lane, session, render=False).body is None

    # rendered: only prose moves, and a second pass over our own output is a no-op
    res = engine.process(raw, lane, session, render=True)
    wc.check_rendered(raw, res.body, lane, expected)
    if res.body is not None and wc.replay_stable(raw, lane):
        again = engine.process(res.body, lane, session, render=True)
        assert again.body is None and again.refs_new == 0
