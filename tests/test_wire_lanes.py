"""Unit tests of the Chat, Responses and Gemini lanes on hand-written items."""

from __future__ import annotations

import pytest

from bili_addon.kernel.identity import digest
from bili_addon.wire import LANES, detect_lane
from bili_addon.wire.base import IMAGE, OTHER, REASONING, TEXT, TOOL_CALL, TOOL_RESULT, Core
from bili_addon.wire.chat import ChatLane
from bili_addon.wire.gemini import GeminiLane
from bili_addon.wire.media import payload_of_data, payload_of_url
from bili_addon.wire.responses import ResponsesLane

chat, resp, gem = ChatLane(), ResponsesLane(), GeminiLane()

PNG_A = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
PNG_B = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNX"


def kinds(cores: list[Core]) -> list[tuple[str, str]]:
    return [(c.role, c.ctype) for c in cores]


def ids(cores: list[Core]) -> list[str]:
    return [digest(c)[0] for c in cores]


def test_registry_has_four_lanes():
    assert set(LANES) == {"anthropic", "chat", "responses", "gemini"}
    assert detect_lane("POST", "/v1/chat/completions") is LANES["chat"]
    assert detect_lane("POST", "/v1/responses?x=1") is LANES["responses"]
    assert detect_lane("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse") is LANES["gemini"]
    assert detect_lane("GET", "/v1/responses") is None
    for lane in LANES.values():
        assert LANES[lane.name] is lane


# -- Chat Completions --------------------------------------------------------------------------


def test_chat_string_and_array_content():
    (c,) = chat.item_cores({"role": "user", "content": "hi 😀"})
    assert (c.role, c.ctype, c.text, c.path) == ("user", TEXT, "hi 😀", ("content",))

    cores = chat.item_cores({"role": "user", "content": [
        {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_A, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://x.example/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": "and this"},
    ]})
    assert kinds(cores) == [("user", TEXT), ("user", IMAGE), ("user", IMAGE), ("user", OTHER), ("user", TEXT)]
    assert cores[0].path == ("content", 0, "text") and cores[4].path == ("content", 4, "text")
    assert cores[1].media == payload_of_data(PNG_A) and cores[1].text == "[image]"
    assert cores[2].media == "url:https://x.example/a.png"
    assert all(not c.path for c in cores[1:4])


def test_chat_system_items():
    assert chat.is_system_item({"role": "system", "content": "s"})
    assert chat.is_system_item({"role": "developer", "content": "s"})
    assert not chat.is_system_item({"role": "user", "content": "s"})
    assert not chat.is_system_item("system")
    cores = chat.item_cores({"role": "developer", "content": [{"type": "text", "text": "rules"}]})
    assert kinds(cores) == [("system", TEXT)] and cores[0].path == ("content", 0, "text")


def test_chat_assistant_reasoning_text_and_calls_in_order():
    args = '{"command": "echo hi",  "x": 1}'  # odd spacing must survive as sent
    cores = chat.item_cores({
        "role": "assistant",
        "reasoning_content": "think first",
        "content": "running it",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": args}},
            {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": "{}"}},
        ],
    })
    assert kinds(cores) == [
        ("assistant", REASONING), ("assistant", TEXT), ("assistant", TOOL_CALL), ("assistant", TOOL_CALL),
    ]
    assert cores[0].text == "think first" and not cores[0].path
    assert cores[1].path == ("content",)
    assert (cores[2].text, cores[2].tool_name, cores[2].tool_call_id, cores[2].path) == (args, "bash", "call_1", ())
    assert cores[3].tool_call_id == "call_2"


def test_chat_tool_call_only_assistant_null_and_empty_content_agree():
    call = [{"id": "call_9", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    a = chat.item_cores({"role": "assistant", "content": None, "tool_calls": call})
    b = chat.item_cores({"role": "assistant", "content": "", "tool_calls": call})
    assert kinds(a) == [("assistant", TOOL_CALL)]
    assert ids(a) == ids(b)
    # a bare empty assistant message still has one (empty, untaggable) text core
    assert kinds(chat.item_cores({"role": "assistant", "content": ""})) == [("assistant", TEXT)]


def test_chat_legacy_function_call_and_function_role():
    (c,) = chat.item_cores({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{\"a\":1}"}})
    assert (c.ctype, c.tool_name, c.text, c.tool_call_id) == (TOOL_CALL, "f", '{"a":1}', "")
    (r,) = chat.item_cores({"role": "function", "name": "f", "content": "42"})
    assert (r.role, r.ctype, r.tool_name, r.text) == ("tool", TOOL_RESULT, "f", "42")


def test_chat_tool_result_name_is_not_identity():
    # hermes sends "name" on a tool message in one turn and drops it in the next
    a = chat.item_cores({"role": "tool", "name": "terminal", "content": "hi", "tool_call_id": "call_1"})
    b = chat.item_cores({"role": "tool", "content": "hi", "tool_call_id": "call_1"})
    assert kinds(a) == [("tool", TOOL_RESULT)] and a[0].tool_call_id == "call_1" and not a[0].path
    assert ids(a) == ids(b)
    (p,) = chat.item_cores({"role": "tool", "tool_call_id": "c", "content": [
        {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]})
    assert p.text == "line 1\nline 2"
    (j,) = chat.item_cores({"role": "tool", "tool_call_id": "c", "content": {"ok": True}})
    assert j.text == '{"ok":true}'


def test_chat_one_changed_image_remints_only_itself():
    def msg(second: str) -> dict:
        return {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_A}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + second}},
        ]}

    before, after = ids(chat.item_cores(msg(PNG_A))), ids(chat.item_cores(msg(PNG_B)))
    assert before[:2] == after[:2] and before[2] != after[2]
    # both images equal: the same id twice (the kernel's instance counter tells them apart)
    assert before[1] == before[2]


ODD_CHAT = [
    None, 1, "x", [], {}, {"role": "user"}, {"role": "user", "content": 5}, {"role": "user", "content": [1, None, {}]},
    {"role": "user", "content": [{"type": "text", "text": 3}, {"type": "image_url"}, {"type": "image_url", "image_url": 7}]},
    {"role": "assistant", "tool_calls": "x"}, {"role": "assistant", "tool_calls": [1, {"function": 3}, {"id": 5}]},
    {"role": "assistant", "content": None, "function_call": "f"},
    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 1, "arguments": {"a": 1}}}]},
    {"role": "tool", "content": {"a": 1}}, {"role": "weird", "content": "x"}, {"role": None, "content": "x"},
    {"role": "assistant", "reasoning_content": 5, "content": {"x": 1}},
]


@pytest.mark.parametrize("obj", ODD_CHAT, ids=repr)
def test_chat_odd_shapes_never_raise(obj):
    cores = chat.item_cores(obj)
    chat.is_system_item(obj)
    for c in cores:
        assert isinstance(c, Core) and isinstance(c.text, str)
        assert not c.path or c.ctype == TEXT


def test_chat_non_string_arguments_are_compact_json():
    (c,) = chat.item_cores({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": [1, 2]}}}]})
    assert c.text == '{"a":[1,2]}'


# -- Responses ---------------------------------------------------------------------------------


def test_responses_messages():
    (c,) = resp.item_cores({"role": "user", "content": "hello"})  # typeless message
    assert (c.role, c.ctype, c.path) == ("user", TEXT, ("content",))
    cores = resp.item_cores({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [
        {"type": "output_text", "text": "done", "annotations": [], "logprobs": []},
        {"type": "refusal", "refusal": "no"},
        {"type": "mystery", "x": 1},
    ]})
    assert kinds(cores) == [("assistant", TEXT), ("assistant", TEXT), ("assistant", OTHER)]
    assert cores[0].path == ("content", 0, "text") and cores[1].path == () and cores[1].text == "no"
    assert cores[2].text == '{"type":"mystery","x":1}'


def test_responses_system_items():
    assert resp.is_system_item({"type": "message", "role": "developer", "content": []})
    assert resp.is_system_item({"role": "system", "content": "s"})
    assert not resp.is_system_item({"role": "user", "content": "s"})
    assert not resp.is_system_item({"type": "function_call", "role": "system"})
    assert not resp.is_system_item("developer")
    (c,) = resp.item_cores({"role": "developer", "content": [{"type": "input_text", "text": "rules"}]})
    assert (c.role, c.ctype, c.path) == ("system", TEXT, ("content", 0, "text"))


def test_responses_provider_ids_are_not_identity():
    a = resp.item_cores({"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "x"}]})
    b = resp.item_cores({"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "x"}]})
    c = resp.item_cores({"role": "user", "content": [{"type": "input_text", "text": "x"}]})
    assert ids(a) == ids(b) == ids(c)
    f1 = resp.item_cores({"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_1", "name": "bash", "arguments": "{\"cmd\": \"ls\"}"})
    f2 = resp.item_cores({"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": "{\"cmd\": \"ls\"}"})
    assert ids(f1) == ids(f2)
    w1 = resp.item_cores({"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "q"}})
    w2 = resp.item_cores({"type": "web_search_call", "id": "ws_2", "status": "completed", "action": {"query": "q"}})
    assert kinds(w1) == [("assistant", OTHER)] and ids(w1) == ids(w2) and "ws_1" not in w1[0].text


def test_responses_tool_pair():
    (call,) = resp.item_cores({"type": "function_call", "call_id": "call_7", "name": "bash", "arguments": "{\"cmd\": \"ls\"}"})
    assert (call.role, call.ctype, call.text, call.tool_name, call.tool_call_id, call.path) == (
        "assistant", TOOL_CALL, '{"cmd": "ls"}', "bash", "call_7", ())
    (out,) = resp.item_cores({"type": "function_call_output", "id": "fco_1", "call_id": "call_7", "output": "a\nb"})
    assert (out.role, out.ctype, out.text, out.tool_call_id, out.path) == ("tool", TOOL_RESULT, "a\nb", "call_7", ())
    (parts,) = resp.item_cores({"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "one"}, {"type": "input_image", "image_url": "data:image/png;base64," + PNG_A}]})
    assert parts.text == "one\n[image]" and parts.media == payload_of_data(PNG_A)
    (js,) = resp.item_cores({"type": "function_call_output", "call_id": "c", "output": {"ok": 1}})
    assert js.text == '{"ok":1}'


def test_responses_custom_and_builtin_tools():
    (c,) = resp.item_cores({"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"})
    assert (c.ctype, c.text, c.tool_name, c.tool_call_id) == (TOOL_CALL, "*** Begin Patch", "apply_patch", "c1")
    (o,) = resp.item_cores({"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"})
    assert (o.ctype, o.text, o.tool_call_id) == (TOOL_RESULT, "ok", "c1")
    (sh,) = resp.item_cores({"type": "local_shell_call", "id": "lsh_1", "call_id": "c2", "status": "completed",
                             "action": {"type": "exec", "command": ["ls"]}})
    assert (sh.ctype, sh.tool_name, sh.tool_call_id, sh.text) == (TOOL_CALL, "local_shell", "c2", '{"type":"exec","command":["ls"]}')
    (shot,) = resp.item_cores({"type": "computer_call_output", "call_id": "c3",
                               "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64," + PNG_B}})
    assert (shot.ctype, shot.text, shot.media) == (TOOL_RESULT, "[image]", payload_of_data(PNG_B))
    (ref,) = resp.item_cores({"type": "item_reference", "id": "msg_9"})
    assert ref.ctype == OTHER and "msg_9" in ref.text


def test_responses_reasoning_text_sources():
    def text(item: dict) -> str:
        (c,) = resp.item_cores(item)
        assert (c.role, c.ctype, c.path) == ("assistant", REASONING, ())
        return c.text

    summary = [{"type": "summary_text", "text": "**a**"}, {"type": "summary_text", "text": "b"}]
    content = [{"type": "reasoning_text", "text": "deep"}]
    assert text({"type": "reasoning", "id": "rs_1", "summary": summary, "content": content}) == "deep"
    assert text({"type": "reasoning", "id": "rs_1", "summary": summary, "content": None}) == "**a**\nb"
    assert text({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}) == "rs_1"
    assert text({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}) == (
        '{"type":"reasoning","summary":[],"encrypted_content":"gAAA"}')


def test_responses_images_and_one_changed_image():
    def msg(second: str) -> dict:
        return {"role": "user", "content": [
            {"type": "input_text", "text": "see"},
            {"type": "input_image", "image_url": "data:image/png;base64," + PNG_A, "detail": "auto"},
            {"type": "input_image", "image_url": "data:image/jpeg;base64," + second},
            {"type": "input_image", "file_id": "file-abc"},
        ]}

    cores = resp.item_cores(msg(PNG_A))
    assert kinds(cores) == [("user", TEXT)] + [("user", IMAGE)] * 3
    assert cores[1].media == payload_of_url("data:image/png;base64," + PNG_A)
    assert cores[3].media == "file:file-abc"
    before, after = ids(cores), ids(resp.item_cores(msg(PNG_B)))
    assert [b == a for b, a in zip(before, after)] == [True, True, False, True]


ODD_RESPONSES = [
    None, 0, "text", [1], {}, {"type": None}, {"type": 5}, {"role": "user"}, {"content": "x"},
    {"role": "user", "content": None}, {"role": "user", "content": 3}, {"role": "alien", "content": "x"},
    {"type": "message", "role": "user", "content": [None, 1, {"type": "input_text"}, {"type": "input_image"}]},
    {"type": "function_call"}, {"type": "function_call", "arguments": {"a": 1}, "call_id": 4},
    {"type": "function_call_output", "call_id": "c"}, {"type": "function_call_output", "call_id": "c", "output": None},
    {"type": "reasoning"}, {"type": "reasoning", "summary": "x", "content": 3},
    {"type": "computer_call", "call_id": "c", "action": None}, {"type": "mcp_call", "id": "mcp_1", "name": "x"},
    {"type": "local_shell_call_output", "id": "c", "output": "o"},
]


@pytest.mark.parametrize("obj", ODD_RESPONSES, ids=repr)
def test_responses_odd_shapes_never_raise(obj):
    resp.is_system_item(obj)
    for c in resp.item_cores(obj):
        assert isinstance(c, Core) and isinstance(c.text, str)
        assert not c.path or c.ctype == TEXT


# -- Gemini ------------------------------------------------------------------------------------


def test_gemini_parts():
    cores = gem.item_cores({"role": "model", "parts": [
        {"text": "let me think", "thought": True, "thoughtSignature": "c2ln"},
        {"text": "answer", "thoughtSignature": "c2ln"},
        {"functionCall": {"name": "get_weather", "args": {"city": "Paris", "n": 2}, "id": "fc1"}, "thoughtSignature": "c2ln"},
    ]})
    assert kinds(cores) == [("assistant", REASONING), ("assistant", TEXT), ("assistant", TOOL_CALL)]
    assert cores[0].text == "let me think" and not cores[0].path
    assert cores[1].path == ("parts", 1, "text")
    assert (cores[2].text, cores[2].tool_name, cores[2].tool_call_id) == ('{"city":"Paris","n":2}', "get_weather", "fc1")
    assert all("c2ln" not in c.text for c in cores)

    (r,) = gem.item_cores({"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"t": 20}}}]})
    assert (r.role, r.ctype, r.tool_name, r.tool_call_id, r.text) == ("tool", TOOL_RESULT, "get_weather", "", '{"t":20}')
    (u,) = gem.item_cores({"parts": [{"text": "no role"}]})
    assert (u.role, u.path) == ("user", ("parts", 0, "text"))
    assert not gem.is_system_item({"role": "system", "parts": []})


def test_gemini_snake_case_and_other_parts():
    cores = gem.item_cores({"role": "model", "parts": [
        {"function_call": {"name": "f", "args": {}}},
        {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
        {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1"}},
        {"inline_data": {"mime_type": "image/png", "data": PNG_A}},
    ]})
    assert kinds(cores) == [("assistant", TOOL_CALL), ("assistant", OTHER), ("assistant", OTHER), ("assistant", IMAGE)]
    assert cores[0].text == "{}" and cores[3].media == payload_of_data(PNG_A)


def test_gemini_images_and_one_changed_image():
    def item(second: str) -> dict:
        return {"role": "user", "parts": [
            {"text": "two pictures"},
            {"inlineData": {"mimeType": "image/png", "data": PNG_A}},
            {"inlineData": {"mimeType": "image/png", "data": second}},
            {"fileData": {"mimeType": "image/png", "fileUri": "gs://bucket/a.png"}},
        ]}

    cores = gem.item_cores(item(PNG_A))
    assert kinds(cores) == [("user", TEXT)] + [("user", IMAGE)] * 3
    assert cores[1].media == payload_of_data(PNG_A) and cores[3].media == "url:gs://bucket/a.png"
    before, after = ids(cores), ids(gem.item_cores(item(PNG_B)))
    assert [b == a for b, a in zip(before, after)] == [True, True, False, True]


ODD_GEMINI = [
    None, 2, "x", [], {}, {"role": "model"}, {"role": "user", "parts": "hi"}, {"role": 3, "parts": [None, 4, "s", []]},
    {"parts": [{}, {"text": 5}, {"thought": True}, {"functionCall": "f"}, {"functionCall": {"args": 3, "name": 1}}]},
    {"parts": [{"functionResponse": {}}, {"inlineData": {}}, {"fileData": {"fileUri": 1}}, {"inlineData": "x"}]},
]


@pytest.mark.parametrize("obj", ODD_GEMINI, ids=repr)
def test_gemini_odd_shapes_never_raise(obj):
    gem.is_system_item(obj)
    for c in gem.item_cores(obj):
        assert isinstance(c, Core) and isinstance(c.text, str)
        assert not c.path or c.ctype == TEXT


def test_a_namespace_tool_whose_tools_are_not_a_list_names_only_itself():
    """Responses: ``{"type":"namespace","tools":5}`` raised TypeError from the tool names' reading,
    logged as bili's internal error (the body went up unchanged)."""
    from bili_addon.wire import LANES
    from bili_addon.wire.base import Body

    raw = (b'{"model":"m","tools":[{"type":"namespace","name":"mcp__x","tools":5},'
           b'{"type":"namespace","name":"mcp__y","tools":[{"name":"go"}]}],'
           b'"input":[{"type":"message","role":"user","content":"hi"}]}')
    assert LANES["responses"].tool_names(Body(raw, "input")) == ["mcp__x", "mcp__y", "mcp__y__go"]
