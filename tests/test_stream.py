"""The response path: SSE reassembly, the tag-echo filter, per-lane rewriting, usage."""

from __future__ import annotations

import gzip
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bili_addon.stream import Decoder, ResponseRewriter
from bili_addon.stream.echo import EchoFilter, strip_echoes
from bili_addon.stream.sse import SSEStream

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ECHO_SHAPES = [
    '<acp tokens="12" type="text">m00012</acp>\n',
    '<acp tokens="1.2K" type="tool:bash">m00003</acp>',
    "<acip>m00007</acip>\n\n\n\n",
    "<ACP tokens='3'>m00001 – m00009</ACP>",
    "m00004</acp>",
    "<acp/>",
    '<pca tokens="1">m00002</pca>\n',
]
TAGLIKE = re.compile(r"<\s*/?\s*(acp|acip|pca)\b|</acp>", re.IGNORECASE)


def chunked(data: bytes, rng: random.Random, most: int = 23) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        k = rng.randint(1, most)
        out.append(data[i : i + k])
        i += k
    return out


def run_stream(stream: SSEStream, chunks: list[bytes]) -> bytes:
    out: list[bytes] = []
    for c in chunks:
        got = stream(c)
        assert isinstance(got, list) and all(got), "never b'' mid-stream"
        out.extend(got)
    out.extend(stream(b""))
    return b"".join(out)


# -- the splitter ------------------------------------------------------------------------------

@SETTINGS
@given(
    events=st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=40), min_size=1,
                    max_size=12),
    eol=st.sampled_from(["\n", "\r\n"]),
    seed=st.integers(0, 10_000),
)
def test_splitter_rebuilds_every_event_for_any_chunking(events, eol, seed):
    raw = "".join(f"event: e{i}{eol}data: {json.dumps(t)}{eol}{eol}" for i, t in enumerate(events)).encode()
    seen: list[bytes] = []

    def ident(ev: bytes):
        seen.append(ev)
        return [ev]

    assert run_stream(SSEStream(ident), chunked(raw, random.Random(seed), 9)) == raw
    assert len(seen) == len(events)


def test_splitter_flushes_an_unterminated_last_event():
    s = SSEStream(lambda ev: [ev.upper()])
    assert s(b"data: a\n\ndata: b") == [b"DATA: A\n\n"]
    assert s(b"") == [b"DATA: B"]


def test_compressed_stream_is_decoded_incrementally():
    raw = b"".join(b'data: {"n": %d}\n\n' % i for i in range(50))
    comp = gzip.compress(raw)
    st_ = SSEStream(lambda ev: [ev], decoder=Decoder("gzip"))
    assert run_stream(st_, chunked(comp, random.Random(1), 7)) == raw


def _events(n: int) -> list[bytes]:
    return [b'data: {"type":"ping","n":%d}\n\n' % i for i in range(n)]


def _zstd():
    try:
        from compression import zstd  # Python 3.14
    except ImportError:
        from backports import zstd
    return zstd


@pytest.mark.parametrize("enc,compress", [
    ("gzip", gzip.compress),
    ("zstd", lambda b: _zstd().compress(b)),
])
def test_a_stream_compressed_event_by_event_is_decoded_whole(enc, compress):
    """One gzip member (or zstd frame) per event, as a server compressing each flush sends it:
    every event arrives, however the members fall across chunks."""
    evs = _events(6)
    wire = b"".join(map(compress, evs))
    for seed in range(5):
        got = run_stream(SSEStream(lambda ev: [ev], decoder=Decoder(enc)), chunked(wire, random.Random(seed), 11))
        assert got == b"".join(evs)
    # each member a chunk of its own
    assert run_stream(SSEStream(lambda ev: [ev], decoder=Decoder(enc)), list(map(compress, evs))) == b"".join(evs)


def test_a_stream_labelled_compressed_but_sent_plain_passes_as_it_arrives(caplog):
    """The decoder's failure is not the connection's: mitmproxy calls the stream outside its addon
    guard, so a raise there dropped the agent's answer.  A plain body under a gzip label is read as
    it is, and still cleaned."""
    raw = sse([(None, {"choices": [{"index": 0, "delta": {"content": '<acp tokens="1" type="text">m00001</acp>\nHi'}}]})])
    st_ = ResponseRewriter("chat").stream(Decoder("gzip"))
    with caplog.at_level("WARNING", logger="bili"):
        out = events_of(run_stream(st_, [raw]))
    assert out[0]["choices"][0]["delta"]["content"] == "Hi"
    assert "did not decode" in caplog.text


def test_undecodable_bytes_after_a_good_member_keep_what_decoded():
    evs = _events(2)
    junk = b"\x00\x01junk"
    got = run_stream(SSEStream(lambda ev: [ev], decoder=Decoder("gzip")), [gzip.compress(evs[0]) + junk, evs[1]])
    assert got == evs[0] + junk + evs[1]  # the member's events, then the rest as it came


# -- the echo filter ---------------------------------------------------------------------------

@SETTINGS
@given(
    words=st.lists(st.sampled_from(["alpha", "beta gamma", "x < y", "<div>", "acpi.h", "I'm", "m", "\n", " ",
                                    " x > 0 holds."] + ECHO_SHAPES), max_size=14),
    seed=st.integers(0, 10_000),
)
def test_streamed_filter_equals_whole_text_filter(words, seed):
    text = "".join(words)
    want = strip_echoes(text)
    f = EchoFilter()
    rng = random.Random(seed)
    out, i = "", 0
    while i < len(text):
        k = rng.randint(1, 9)
        out += f.feed(text[i : i + k])
        i += k
    out += f.flush()
    assert out == want
    assert not TAGLIKE.search(want)
    assert bool(f.removed) == (want != text)  # what it took out is reported, and only that


def test_the_echoes_taken_out_are_reported_as_written():
    text = ('See <acp tokens="12" type="text">m00012</acp> and <acp type="x">the parser</acp> done.\n'
            '<acp tokens="3" type="text">m00013</acp>\nend <acp type="t')
    want = ['<acp tokens="12" type="text">m00012</acp>', '<acp type="x">…</acp>',
            '<acp tokens="3" type="text">m00013</acp>', '<acp type="t']
    removed: list[str] = []
    assert strip_echoes(text, removed=removed) == "See  and the parser done.\nend "
    assert removed == want
    f = EchoFilter()
    out = "".join(f.feed(text[i : i + 5]) for i in range(0, len(text), 5)) + f.flush()
    assert out == "See  and the parser done.\nend " and f.removed == want


@pytest.mark.parametrize(
    "text,want",
    [
        ('<acp tokens="12" type="text">m00012</acp>\nHello', "Hello"),
        ('Intro\n\n<acp tokens="1" type="text">m00001</acp>\n\n\n\n\nBody', "Intro\n\nBody"),
        ("<acip>m00001</acip>\nTypo'd tag", "Typo'd tag"),
        ("<acp>prose inside stays</acp>", "prose inside stays"),
        ("see m00012</acp> here", "see  here"),
        ("a < b, <div>x</div>, acpi.h, <caption>, item m", "a < b, <div>x</div>, acpi.h, <caption>, item m"),
        ("[m00003] look-alike text is content", "[m00003] look-alike text is content"),
    ],
)
def test_strip_echoes_cases(text, want):
    assert strip_echoes(text) == want


PROSE_ABOUT_TAGS = [
    # prose that names the tag: an opening left unclosed to the end of the text is not a stream cut
    # off mid-tag (which dropped the whole rest of the answer), nor is a later ">" its end
    ("Those <acp markers are added by the proxy in front of each message; I do not need to repeat them. "
     "Here is the fix for your bug: change line 12 to use a lock.", None),
    ("The <acp tags mark each message, so a long answer that mentions them once and then talks about how "
     "the parser handles x > 0 and other cases keeps every word of it.", None),
    # the prose after a close is not part of it, up to a later ">"
    ("Done.</acp> Note that x > 0 holds.", "Done. Note that x > 0 holds."),
    ('Done.<acp tokens="1" type="text">m00001</acp> Then x > 0.', "Done. Then x > 0."),
    # what a cut-off echo looks like is still dropped at the end
    ('Answer. <acp tokens="12" ty', "Answer. "),
    ("Answer. <acp tokens='1.2K' type=", "Answer. "),
    ("Answer. </acp", "Answer. "),
]


@pytest.mark.parametrize("text,want", PROSE_ABOUT_TAGS)
def test_prose_that_names_the_tag_is_kept_whole_or_streamed(text, want):
    want = text if want is None else want
    assert strip_echoes(text) == want
    for size in (1, 3, 7, 40):
        f = EchoFilter()
        out = "".join(f.feed(text[i:i + size]) for i in range(0, len(text), size)) + f.flush()
        assert out == want, size
    body = json.dumps({"content": [{"type": "text", "text": text}]}).encode()
    got = ResponseRewriter("anthropic").json_body(body)
    assert json.loads(got if got is not None else body)["content"][0]["text"] == want


def test_amplified_echo_collapses():
    text = "".join(f'<acp tokens="1" type="text">m{i:05d}</acp>\n\n\n' for i in range(77)) + "Answer."
    assert strip_echoes(text) == "Answer."


# -- per-lane streams --------------------------------------------------------------------------

def sse(events: list[tuple[str | None, dict | str]]) -> bytes:
    out = []
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {payload}\n\n")
    return "".join(out).encode()


def events_of(raw: bytes) -> list[dict]:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                out.append(json.loads(line[6:]))
    return out


PIECES = ["Here ", "<acp tok", 'ens="3" type="text">m000', "12</acp>\n", "is the ", "answer <ac", "ip>m00002</acip>", "."]
ARGS = '{"cmd": "echo \'<acp tokens=\\"1\\">m00001</acp>\'"}'


def anthropic_stream() -> bytes:
    ev = [("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
        "usage": {"input_tokens": 100, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 0,
                  "output_tokens": 1}}}),
          ("content_block_start", {"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}})]
    ev += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": p}}) for p in PIECES]
    ev += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
           ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
               "type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}}),
           ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                    "delta": {"type": "input_json_delta", "partial_json": ARGS[:20]}}),
           ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                    "delta": {"type": "input_json_delta", "partial_json": ARGS[20:]}}),
           ("content_block_stop", {"type": "content_block_stop", "index": 1}),
           ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                              "usage": {"output_tokens": 42}}),
           ("message_stop", {"type": "message_stop"})]
    return sse(ev)


def chat_stream() -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    ev = [(None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    ev += [(None, {**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]})
           for p in PIECES]
    ev += [(None, {**base, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "bash", "arguments": ARGS}}]}}]}),
           (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
           (None, {**base, "choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 5,
                                                    "prompt_tokens_details": {"cached_tokens": 800}}}),
           (None, "[DONE]")]
    return sse(ev)


def responses_stream() -> bytes:
    full = "".join(PIECES)
    item = {"type": "message", "id": "msg_9", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": full, "annotations": []}]}
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "bash", "arguments": ARGS}
    ev = [("response.created", {"type": "response.created", "sequence_number": 0, "response": {"id": "r1"}})]
    ev += [("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": i + 1,
                                           "item_id": "msg_9", "output_index": 0, "content_index": 0, "delta": p})
           for i, p in enumerate(PIECES)]
    n = len(PIECES) + 1
    ev += [("response.output_text.done", {"type": "response.output_text.done", "sequence_number": n,
                                          "item_id": "msg_9", "output_index": 0, "content_index": 0, "text": full}),
           ("response.content_part.done", {"type": "response.content_part.done", "sequence_number": n + 1,
                                           "item_id": "msg_9", "output_index": 0, "content_index": 0,
                                           "part": {"type": "output_text", "text": full}}),
           ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": n + 2,
                                          "output_index": 0, "item": item}),
           ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                       "sequence_number": n + 3, "item_id": "fc_1",
                                                       "output_index": 1, "delta": ARGS}),
           ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": n + 4,
                                          "output_index": 1, "item": call}),
           ("response.completed", {"type": "response.completed", "sequence_number": n + 5, "response": {
               "id": "r1", "status": "completed", "output": [item, call],
               "usage": {"input_tokens": 2000, "input_tokens_details": {"cached_tokens": 1500},
                         "output_tokens": 9}}})]
    return sse(ev)


def gemini_stream() -> bytes:
    ev = [(None, {"candidates": [{"content": {"role": "model", "parts": [{"text": p}]}, "index": 0}]})
          for p in PIECES[:-1]]
    ev += [(None, {"candidates": [{"content": {"role": "model", "parts": [{"text": PIECES[-1]}]},
                                   "finishReason": "STOP", "index": 0}],
                   # (thinking and server-side tools' prompts counted apart: billed as output and input)
                   "usageMetadata": {"promptTokenCount": 500, "cachedContentTokenCount": 100,
                                     "candidatesTokenCount": 7, "thoughtsTokenCount": 30,
                                     "toolUsePromptTokenCount": 20, "totalTokenCount": 557}})]
    return sse(ev)


CLEAN = "Here \nis the answer ."  # an inline echo keeps the line break after it


def prose_of(lane: str, events: list[dict]) -> str:
    if lane == "anthropic":
        return "".join(e["delta"]["text"] for e in events
                       if e.get("type") == "content_block_delta" and e["delta"]["type"] == "text_delta")
    if lane == "chat":
        return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    if lane == "responses":
        return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    return "".join(p.get("text", "") for e in events for c in e["candidates"] for p in c["content"]["parts"])


@pytest.mark.parametrize(
    "lane,make,usage",
    [
        ("anthropic", anthropic_stream, (1000, 900, 0, 42)),
        ("chat", chat_stream, (1000, 800, 0, 5)),
        ("responses", responses_stream, (2000, 1500, 0, 9)),
        ("gemini", gemini_stream, (520, 100, 0, 37)),
    ],
)
@pytest.mark.parametrize("seed", range(12))
def test_lane_streams_clean_prose_only(lane, make, usage, seed):
    raw = make()
    rw = ResponseRewriter(lane)
    out = run_stream(rw.stream(), chunked(raw, random.Random(seed), 31))
    before, after = events_of(raw), events_of(out)
    assert len(after) == len(before), "no event invented or dropped"
    assert prose_of(lane, after) == CLEAN
    # tool-call arguments are byte-identical, wherever they travel
    assert out.count(json.dumps(ARGS)[1:-1].encode()) == raw.count(json.dumps(ARGS)[1:-1].encode())
    if lane == "anthropic":
        args = "".join(e["delta"]["partial_json"] for e in after if e.get("type") == "content_block_delta"
                       and e["delta"]["type"] == "input_json_delta")
        assert args == ARGS
    if lane == "responses":
        done = [e for e in after if e["type"] == "response.output_text.done"][0]["text"]
        part = [e for e in after if e["type"] == "response.content_part.done"][0]["part"]["text"]
        item = [e for e in after if e["type"] == "response.output_item.done"][0]["item"]["content"][0]["text"]
        completed = [e for e in after if e["type"] == "response.completed"][0]["response"]
        assert done == part == item == completed["output"][0]["content"][0]["text"] == CLEAN
        assert completed["output"][1]["arguments"] == ARGS
        assert [e["sequence_number"] for e in after] == [e["sequence_number"] for e in before]
    u = rw.usage
    assert (u.input, u.cache_read, u.cache_write, u.output) == usage


def test_clean_stream_passes_byte_identical():
    raw = sse([(None, {"choices": [{"index": 0, "delta": {"content": "plain text"}}]}), (None, "[DONE]")])
    assert run_stream(ResponseRewriter("chat").stream(), chunked(raw, random.Random(3))) == raw


def test_observe_reads_usage_but_never_changes_bytes():
    raw = anthropic_stream()
    rw = ResponseRewriter("anthropic", rewrite=False)
    assert run_stream(rw.stream(), chunked(raw, random.Random(5))) == raw
    assert rw.usage.output == 42


def test_a_stream_cut_mid_tag_still_releases_the_held_event():
    raw = sse([(None, {"choices": [{"index": 0, "delta": {"content": "Done. <ac"}}]})])
    out = events_of(run_stream(ResponseRewriter("chat").stream(), [raw]))
    assert out[0]["choices"][0]["delta"]["content"] == "Done. <ac"


@pytest.mark.parametrize(
    "lane,body,get",
    [
        ("anthropic", {"content": [{"type": "text", "text": '<acp tokens="1" type="text">m00001</acp>\nHi'},
                                   {"type": "tool_use", "id": "t", "name": "x", "input": {"a": "<acp>m00001</acp>"}}]},
         lambda b: (b["content"][0]["text"], b["content"][1]["input"]["a"])),
        ("chat", {"choices": [{"index": 0, "message": {
            "role": "assistant", "content": "<acp>m00001</acp>\nHi",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "x", "arguments": "<acp>m00001</acp>"}}]}}]},
         lambda b: (b["choices"][0]["message"]["content"], b["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])),
        ("responses", {"output": [
            {"type": "message", "id": "m", "role": "assistant", "content": [{"type": "output_text", "text": "<acp>m00001</acp>\nHi"}]},
            {"type": "function_call", "call_id": "c", "name": "x", "arguments": "<acp>m00001</acp>"}]},
         lambda b: (b["output"][0]["content"][0]["text"], b["output"][1]["arguments"])),
        ("gemini", {"candidates": [{"content": {"parts": [{"text": "<acp>m00001</acp>\nHi"},
                                                          {"functionCall": {"name": "x", "args": {"a": "<acp>m00001</acp>"}}}]}}]},
         lambda b: (b["candidates"][0]["content"]["parts"][0]["text"], b["candidates"][0]["content"]["parts"][1]["functionCall"]["args"]["a"])),
    ],
)
def test_json_bodies_clean_prose_and_keep_tool_calls(lane, body, get):
    out = ResponseRewriter(lane).json_body(json.dumps(body).encode())
    assert out is not None
    assert get(json.loads(out)) == ("Hi", "<acp>m00001</acp>")


def test_echo_filter_stays_linear_on_code_with_a_lone_m():
    """A line ending in a lone "m" and a deeply indented next line: the filter holds the tail back
    as a possible ref run, and deciding that must not try every split of the spaces (with the old
    patterns this input took hours)."""
    pieces = ["    return", " m", "\n", " " * 40, "}", "\n" + "m0001 m0002 " * 30 + "end"]
    f = EchoFilter()
    out = "".join(f.feed(p) for p in pieces) + f.flush()
    assert out == "".join(pieces)
    assert strip_echoes("m00012 " * 30 + "x") == "m00012 " * 30 + "x"


def _lane_events(lane: str, events: list[dict]) -> list[dict]:
    s = ResponseRewriter(lane).stream()
    out = []
    for e in events:
        out += s(b"data: " + json.dumps(e).encode() + b"\n\n")
    out += s(b"")
    return [json.loads(b.split(b"data: ", 1)[1]) for b in out]


def test_gemini_held_prose_goes_out_before_the_call_that_follows_it():
    """A text chunk held back (it ends in an echo that may still grow) and then a functionCall
    chunk: the held chunk went after the call, and the client rebuilds its parts in the order they
    come (the history it sends back then has them swapped)."""
    text = {"candidates": [{"index": 0, "content": {"role": "model", "parts": [
        {"text": "Reading the file <acp>m00012</acp>"}]}}]}
    call = {"candidates": [{"index": 0, "content": {"role": "model", "parts": [
        {"functionCall": {"name": "read_file", "args": {"path": "a.py"}}}]}}]}
    fin = {"candidates": [{"index": 0, "content": {"role": "model", "parts": [{"text": ""}]}, "finishReason": "STOP"}]}
    got = _lane_events("gemini", [text, call, fin])
    parts = [e["candidates"][0]["content"]["parts"][0] for e in got]
    assert ["functionCall" in p for p in parts] == [False, True, False]
    assert parts[0]["text"] == "Reading the file "


def test_chat_held_prose_goes_out_before_the_tool_call_chunk():
    text = {"choices": [{"index": 0, "delta": {"content": "Let me look <"}}]}
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                               "function": {"name": "Bash", "arguments": "{}"}}]}}]}
    fin = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    got = _lane_events("chat", [text, call, fin])
    deltas = [e["choices"][0]["delta"] for e in got]
    assert [("tool_calls" in d, d.get("content")) for d in deltas] == [(False, "Let me look <"), (True, None), (False, None)]


@pytest.mark.parametrize("lane", ["whole", "streamed"])
def test_code_whose_types_are_named_like_a_tag_is_not_an_echo(lane):
    """A tag name's variants (``cap``, ``pac``, ``apic``, ``pcap``...) are also names of types and
    components: ``Vec<Cap>`` lost its type, ``<Pac>child</Pac>`` its tags, as echoes.  Without a ref run
    or bili's own attributes beside it, only the lower-case name as models write bili's tags is one."""
    code = ("```rust\nlet caps: Vec<Cap> = Vec::new();\nstatic LAPIC: Once<Apic> = Once::new();\n"
            "let dev: Arc<Mutex<Pcap>> = open()?;\n```\nand in JSX: <Pac>child</Pac> <Cap/> </Capa>\n")
    echoes = ('<ACP tokens="3">m00001</ACP> ', "<Cap>m00012</Cap> ", '<Acip type="text">', "<acp> ", "</acp>")
    text = code + "".join(echoes)
    if lane == "whole":
        removed: list[str] = []
        out = strip_echoes(text, removed=removed)
    else:
        f = EchoFilter()
        out = "".join(f.feed(text[i:i + 3]) for i in range(0, len(text), 3)) + f.flush()
        removed = f.removed
    assert out.startswith(code) and not out[len(code):].strip()
    assert "".join(removed).replace(" ", "") == "".join(echoes).replace(" ", "")  # (every echo, and only they)


def _events_out(out: bytes) -> list[dict]:
    return [json.loads(b[6:]) for b in out.split(b"\n\n") if b.startswith(b"data: {")]


@pytest.mark.parametrize("seed", range(6))
def test_a_chunk_of_two_text_parts_after_a_held_one_keeps_the_text_in_order(seed):
    """Gemini: a chunk whose prose the filter held (it ended in ``<ac``), then one with two text parts of
    the candidate (its text and an empty one with a thought signature): the held event went out last."""
    def ev(parts, finish=None):
        return (None, {"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0,
                                       **({"finishReason": finish} if finish else {})}]})

    raw = sse([ev([{"text": "First sentence. See <ac"}]),
               ev([{"text": 'p tokens="1" type="text">m00001</acp> second part.'}, {"text": "", "thoughtSignature": "s"}]),
               ev([{"text": " Third part."}]), ev([{"text": " End."}], "STOP")])
    out = run_stream(ResponseRewriter("gemini").stream(), chunked(raw, random.Random(seed), 40))
    text = "".join(p.get("text", "") for e in _events_out(out) for p in e["candidates"][0]["content"]["parts"])
    assert text == "First sentence. See  second part. Third part. End."


@pytest.mark.parametrize("between", [{}, {"content": ""}, {"reasoning_content": "hmm"}, "filter"])
def test_a_chunk_without_prose_does_not_end_the_prose_run(between):
    """Chat: an empty delta, a reasoning one or a content filter's annotation in the middle of an echo
    ended the choice's prose run as a tool call's chunk does: the echo was filtered as two texts and its
    second half reached the agent.  A tool call's chunk still ends it."""
    def ch(delta, finish=None):
        return (None, {"id": "c1", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    mid = (None, {"id": "c1", "choices": [{"index": 0, "delta": {}, "content_filter_results": {}}]}) \
        if between == "filter" else ch(between)
    raw = sse([ch({"role": "assistant", "content": ""}), ch({"content": 'Fixed it. <acp tokens="12" ty'}), mid,
               ch({"content": 'pe="text">m00012</acp> The test passes now.'}), ch({}, "stop"), (None, "[DONE]")])
    rw = ResponseRewriter("chat")
    out = run_stream(rw.stream(), chunked(raw, random.Random(3), 50))
    text = "".join(c["delta"].get("content") or "" for e in _events_out(out) for c in e["choices"])
    assert text == "Fixed it.  The test passes now." and rw.stripped == 1
    call = ch({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "Bash", "arguments": "{}"}}]})
    raw = sse([ch({"content": "Running it <"}), call, ch({}, "tool_calls"), (None, "[DONE]")])
    events = _events_out(run_stream(ResponseRewriter("chat").stream(), [raw]))
    kinds = ["content" if (d := e["choices"][0]["delta"]).get("content") else "call" if d.get("tool_calls") else ""
             for e in events]
    assert kinds.index("content") < kinds.index("call")  # (the held prose before the call's chunk)
