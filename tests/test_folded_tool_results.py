"""A fold over a stretch where the model used bili's own tools keeps, behind the ref of each such
call's result, the result the model was shown on every turn (the executed call's), not the agent's
"unknown tool" error the request carries in its place: decompress and search_context give back what
the model read under that ref."""

from __future__ import annotations

import json

import pytest

import churn as C
from bili_addon.kernel.fold import FoldConfig
from bili_addon.kernel.turn import Engine
from bili_addon.stores import open_store
from bili_addon.wire import LANES

SUMMARY = "Fold summary covering the early turns: modules were read and their values noted carefully."
BUILD = {"anthropic": C.anthropic, "chat": C.chat, "responses": C.responses, "gemini": C.gemini}


class Agent:
    def __init__(self, eng: Engine, lane: str, sid: str = "s1"):
        self.eng, self.lane, self.sid = eng, lane, sid
        self.extra: list[dict] = []

    def send(self, ts, tail=None):
        raw = C.body(self.lane, BUILD[self.lane](ts, C.Scheme(), self.extra if tail is None else tail))
        res = self.eng.process(raw, LANES[self.lane], {"x-acp-session": self.sid}, render=True)
        out = res.body if res.body is not None else raw
        self.eng.store.record_usage(self.sid, self.lane, (len(out) // 4, 0, 0, 10))
        self.eng.store.release()
        return out

    def call(self, cid: str, name: str, args: dict) -> None:
        self.eng.record_calls(self.sid, [(cid, name, json.dumps(args))])
        self.eng.store.release()
        self.extra = self.extra + C.proxy_call(self.lane, cid, name, args)


def shown_result(out: bytes, marker: str) -> str:
    """The tool result text on the wire that holds ``marker``."""
    for text in C.strings(json.loads(out)):
        if marker in text:
            return text
    raise AssertionError(f"{marker!r} not on the wire")


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses", "gemini"])
def test_a_folded_search_result_is_what_the_model_read(lane, tmp_path):
    eng = Engine(open_store("", str(tmp_path)), fold_cfg=FoldConfig(min_compress_chars=2000))
    a = Agent(eng, lane)
    ts = C.turns(6)
    refs = C.refs_by_text(a.send(ts))
    a.call("c1", "compress", {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 3: "],
                                           "summary": SUMMARY}]})
    a.send(ts)
    a.call("s1", "search_context", {"query": "file-2-row-33"})
    out = a.send(ts)
    seen = shown_result(out, 'Matches for "file-2-row-33"')  # what the model read as s1's result
    more = [C.Turn(t, f"Turn {t}: please analyze module {t}. {C.FILLER}", f"Reply Turn {t}: module {t} reviewed.",
                   tool=t % 2 == 0) for t in range(6, 14)]
    tail = a.extra + BUILD[lane](more, C.Scheme())
    refs = C.refs_by_text(a.send(ts, tail))
    # the model folds a range holding its search call and that call's result
    a.call("c2", "compress", {"content": [{"startId": refs["Turn 4: please"], "endId": refs["Reply Turn 8: "],
                                           "summary": SUMMARY + " two"}]})
    a.extra = tail + a.extra[-2:]
    out = a.send(ts)
    assert 'Matches for "file-2-row-33"' not in out.decode()  # (folded)
    s = eng.sessions.get("s1")
    (b2,) = [b for b in s.blocks if b.id == "b2"]
    kept = {o[0]: o[5] for o in eng.store.originals("s1", b2.direct)}
    assert seen in kept.values(), "the fold keeps another text behind the search result's ref"
    assert not any("No such tool" in text for text in kept.values())
    # and decompress gives it back
    a.call("d2", "decompress", {"blockId": "b2"})
    out = a.send(ts)
    got = shown_result(out, "[assistant → search_context]")
    assert seen in got and "No such tool" not in got
    eng.store.close()


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses", "gemini"])
def test_a_compress_call_points_only_at_a_summary_the_request_shows(lane, tmp_path):
    """An executed compress call shows a pointer to its block in place of its summary while that
    summary stands where the range was.  A host that drops its head (codex, pi) drops the range and
    the block's summary with it: the call keeps the model's own summary then, the only record left of
    what the range held."""
    eng = Engine(open_store("", str(tmp_path)), fold_cfg=FoldConfig(min_compress_chars=2000))
    a = Agent(eng, lane)
    ts = C.turns(20)
    refs = C.refs_by_text(a.send(ts))
    a.call("c1", "compress", {"content": [{"startId": refs["Turn 1: please"], "endId": refs["Reply Turn 5: "],
                                           "summary": SUMMARY + " KEEP-THIS-FACT"}]})
    out = a.send(ts)
    assert out.count(b"KEEP-THIS-FACT") == 1 and b"this summary stands in the conversation as b1" in out
    again = a.send(ts)
    assert again == out  # (the same history: the same bytes)
    cut = a.send(ts[8:])  # the head dropped, the folded turns with it; the compress call stays
    assert b"KEEP-THIS-FACT" in cut and b"this summary stands in the conversation as b1" not in cut
    assert a.send(ts[8:]) == cut
    eng.store.close()


def test_an_agents_own_call_0_result_rendered_again_keeps_its_output(tmp_path):
    """A provider that numbers its calls per answer (every answer's first call is ``call_0``): the
    agent's own ``sh`` call_0 just before the model's compress call_0.  The pass that executes the
    compress renders the sh call's result again (the previous pass's last item) with the call itself in
    the reused prefix: the result stays the agent's output, as a pass from the start (a restart) gives."""
    row = " ".join(f"row-{i}" for i in range(200))

    def body(items):
        return json.dumps({"model": "gpt-4.1", "messages": [{"role": "system", "content": "agent"}] + items,
                           "tools": [{"type": "function", "function": {"name": "sh"}}]}).encode()

    def step(items, text, name, args, out):
        items += [{"role": "assistant", "content": text, "tool_calls": [
                      {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": out}]

    def run(memo: bool) -> list[str]:
        eng = Engine(open_store("", str(tmp_path / f"m{memo}")), fold_cfg=FoldConfig(min_compress_chars=2000))
        items = [{"role": "user", "content": "audit the repo"}]
        for t in range(14):
            step(items, f"Step {t}.", "sh", {"t": t}, f"file-{t} {row}")
        first = eng.process(body(items), LANES["chat"], {"x-acp-session": "c"}, render=True).body
        refs = C.refs_by_text(first)
        args = {"content": [{"startId": refs["Step 1."], "endId": refs["Step 5."],
                             "summary": "Summary A: steps 1-5 read files; nothing to change in them at all."}]}
        if not memo:  # (a restart: no previous pass)
            eng = Engine(open_store("", str(tmp_path / f"m{memo}")), fold_cfg=FoldConfig(min_compress_chars=2000))
        eng.record_calls("c", [("call_0", "compress", json.dumps(args))])
        step(items, "Fold A.", "compress", args, "Tool compress not found")
        out = json.loads(eng.process(body(items), LANES["chat"], {"x-acp-session": "c"}, render=True).body)
        eng.store.close()
        return [m["content"][:7] for m in out["messages"] if m["role"] == "tool"][-2:]

    assert run(True) == run(False) == ["file-13", "Compres"]
