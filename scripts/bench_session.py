#!/usr/bin/env python3
"""A long synthetic coding session replayed with and without the addon, under a prefix-cache price model.

A seeded script of ``--turns`` agent steps (user prompts, assistant prose + tool calls, tool outputs
of realistic sizes: file reads 2-20 KB, test runs, greps, edits) is replayed twice on the Anthropic
Messages lane:

* **without the addon**: the agent sends its history as is; when a request would exceed ~90% of the
  window it compacts like Claude Code's /compact (one summarisation request over the whole history,
  then all history but the last few steps replaced by one ~2K-token summary message);
* **with the addon**: every request goes through ``Engine.process(..., render=True)`` and the bytes
  of ``result.body`` are billed.  The scripted model reads the tagged body it receives; when the
  context passes ``--fold-at`` of the window it calls ``compress`` on the oldest unfolded span of
  consumed work (refs parsed from the tags, the newest ~10 messages left alone, a summary of 1-2% of
  the folded size), distilling earlier blocks (bN..bM) into the same call once a few have piled up.
  The agent answers the unknown tool with Claude Code's error, the addon's response path is
  emulated with ``Engine.record_calls`` and ``Store.record_usage``.

Billing: for each request the common byte prefix with the previous request of the same run is
cache read (0.1 per token), the rest cache write (1.25); tokens ~ bytes / 4; uncached = 1.0.

    python scripts/bench_session.py                 # 300 turns, seed 1
    python scripts/bench_session.py --turns 150 --seed 3
    python scripts/bench_session.py --no-sweep      # without the runs at other fold thresholds
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bili_addon.kernel.fold import FoldConfig  # noqa: E402
from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.store import Store  # noqa: E402
from bili_addon.wire import LANES  # noqa: E402

WINDOW = 200_000
COMPACT_AT = 0.90  # the agent compacts when a request would pass this share of the window
PRICE_READ, PRICE_WRITE, PRICE_BASE = 0.1, 1.25, 1.0
SID = "bench"
HEADERS = {"x-acp-session": SID}
ANTH = LANES["anthropic"]
UNKNOWN_TOOL = "<tool_use_error>Error: No such tool available: compress</tool_use_error>"
TAG = re.compile(r'^<acp tokens="[^"]+" type="text">(m\d{5})</acp>\n')
BLOCK = re.compile(r"^\[Compressed conversation section (b\d+) · (m\d{5})–(m\d{5})")

TARGET_COST = 0.50
TARGET_CACHE = 0.90


def tokens(n_bytes: int) -> int:
    return n_bytes // 4


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# -- the synthetic session ---------------------------------------------------------------------

_WORDS = (
    "the a to of and in is for that this with on it we be as file function test error value config "
    "module import return class self path line call result check update fix build run pass fail "
    "parser request response cache session store token message index handler server client async "
    "should will need let me now look at see because then first next also only when where which "
    "retry timeout schema migration field default option flag logger metrics worker queue batch"
).split()
_MODULES = [f"src/{a}/{b}.py" for a in ("core", "api", "db", "cli", "net", "util") for b in
            ("models", "views", "handlers", "session", "cache", "parser", "config", "store", "client")]
_CODE = [
    "def {w}_{w2}(self, {w2}: str, *, timeout: float = {n}.0) -> int:",
    "    return self._{w}.get({w2!r}, {n})",
    "    if not {w}:",
    "        raise ValueError(f\"bad {w2}: {{{w}!r}}\")",
    "from {w}.{w2} import {W}{W2}",
    "class {W}{W2}({W}Base):",
    "    {w} = {w2}_{n}({w}, retries={n2})",
    "    # {w} the {w2} before {w}",
    "    for {w} in self.{w2}s:",
    "        log.debug(\"{w} %s -> %s\", {w2}, {n})",
    "    \"\"\"{W} the {w2} and return the {w}.\"\"\"",
    "",
]


class Script:
    """The seeded content of the session: the same for both runs."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.code = [self._code_line() for _ in range(6000)]

    def _code_line(self) -> str:
        r = self.r
        w, w2 = r.choice(_WORDS), r.choice(_WORDS)
        return r.choice(_CODE).format(w=w, w2=w2, W=w.capitalize(), W2=w2.capitalize(),
                                      n=r.randint(0, 999), n2=r.randint(0, 9))

    def prose(self, lo: int, hi: int, r: random.Random | None = None) -> str:
        r = r or self.r
        target = r.randint(lo, hi)
        out, size = [], 0
        while size < target:
            sent = " ".join(r.choice(_WORDS) for _ in range(r.randint(6, 18)))
            if r.random() < 0.3:
                sent += f" in {r.choice(_MODULES)}:{r.randint(1, 900)}"
            out.append(sent[:1].upper() + sent[1:] + ".")
            size += len(sent) + 2
        return " ".join(out)

    def lines(self, lo: int, hi: int, fmt) -> str:
        r = self.r
        target = r.randint(lo, hi)
        out, size, i = [], 0, r.randint(1, 400)
        while size < target:
            line = fmt(i, self.code[r.randrange(len(self.code))])
            out.append(line)
            size += len(line) + 1
            i += 1
        return "\n".join(out)

    def tool(self, k: int) -> tuple[dict, str]:
        """One tool call and its output."""
        r = self.r
        kind = r.choices(["read", "test", "grep", "edit", "shell"], weights=[35, 18, 20, 20, 7])[0]
        path = r.choice(_MODULES)
        if kind == "read":
            call = {"name": "Read", "input": {"file_path": f"/repo/{path}"}}
            out = self.lines(2_000, 20_000, lambda i, s: f"{i:>6}\u2192{s}")
        elif kind == "test":
            call = {"name": "Bash", "input": {"command": f"pytest -x -q tests/test_{r.choice(_WORDS)}.py",
                                              "description": "Run the tests"}}
            body = self.lines(800, 7_000, lambda i, s: (
                f"tests/test_{_WORDS[i % len(_WORDS)]}.py::test_{_WORDS[(i * 7) % len(_WORDS)]}_{i} "
                + ("PASSED" if (i * 13) % 11 else f"FAILED\n    {s.strip()}\nE   AssertionError: {i} != {i + 1}")))
            out = body + f"\n{r.randint(1, 9)} failed, {r.randint(20, 300)} passed in {r.uniform(0.5, 40):.2f}s"
        elif kind == "grep":
            call = {"name": "Grep", "input": {"pattern": r.choice(_WORDS) + "_" + r.choice(_WORDS),
                                              "output_mode": "content", "-n": True}}
            out = self.lines(300, 4_000, lambda i, s: f"{_MODULES[i % len(_MODULES)]}:{i}:{s}")
        elif kind == "edit":
            old = self.code[r.randrange(len(self.code))]
            new = self.code[r.randrange(len(self.code))]
            call = {"name": "Edit", "input": {"file_path": f"/repo/{path}", "old_string": old, "new_string": new}}
            out = (f"The file /repo/{path} has been updated. Here's the result of running `cat -n` on a snippet "
                   f"of the edited file:\n" + self.lines(200, 1_800, lambda i, s: f"{i:>6}\u2192{s}"))
        else:
            call = {"name": "Bash", "input": {"command": r.choice(["git status", "git diff --stat", "ls -la src"]),
                                              "description": "Inspect the tree"}}
            out = self.lines(100, 1_500, lambda i, s: f"{_MODULES[i % len(_MODULES)]} | {i % 40} {'+' * (i % 9)}")
        return {"type": "tool_use", "id": f"toolu_{k:05d}", **call}, out

    def session(self, turns: int) -> tuple[dict, list[tuple[dict, dict]]]:
        """The opening user message and ``turns`` steps ``(assistant message, next user message)``."""
        r = self.r
        first = {"role": "user", "content": "Task 1: " + self.prose(200, 1_500)}
        steps: list[tuple[dict, dict]] = []
        task, left = 1, r.randint(8, 30)
        for k in range(turns):
            left -= 1
            if left <= 0:  # the task is done: a final answer, then the user's next task
                task += 1
                left = r.randint(8, 30)
                steps.append((
                    {"role": "assistant", "content": [{"type": "text", "text": self.prose(200, 1_500)}]},
                    {"role": "user", "content": f"Task {task}: " + self.prose(200, 1_500)},
                ))
                continue
            call, out = self.tool(k)
            steps.append((
                {"role": "assistant", "content": [{"type": "text", "text": self.prose(80, 600)}, call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": out}]},
            ))
        return first, steps

    def environment(self) -> dict:
        """System prompt and 20 tools (~12K tokens), sent before the messages on every request."""
        names = ["Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write",
                 "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell", "SlashCommand",
                 "Skill", "ListMcpResources", "ReadMcpResource"]
        tools = [{"name": n, "description": self.prose(600, 2_400), "input_schema": {
            "type": "object", "properties": {"arg": {"type": "string", "description": self.prose(40, 200)}},
            "required": ["arg"], "additionalProperties": False}} for n in names]
        system = "You are Claude Code, an interactive CLI tool for software engineering tasks.\n\n" + "\n\n".join(
            self.prose(300, 900) for _ in range(22))
        return {"model": "claude-sonnet-4-5", "max_tokens": 32000, "system": system, "tools": tools}


# -- the runs ----------------------------------------------------------------------------------


@dataclass
class Request:
    step: int
    kind: str  # step | compress | compaction
    tokens: int
    read: int
    write: int


@dataclass
class Run:
    name: str
    requests: list[Request] = field(default_factory=list)
    prev: bytes = b""
    events: list[str] = field(default_factory=list)
    folds_ok: int = 0
    folds_refused: int = 0
    distils: int = 0
    compactions: int = 0
    nudged: int = 0
    invalid: int = 0  # bodies that break Anthropic's pairing rules

    def bill(self, step: int, kind: str, sent: bytes) -> Request:
        pre = common_prefix(self.prev, sent)
        self.prev = sent
        total = tokens(len(sent))
        read = tokens(pre)
        req = Request(step, kind, total, read, total - read)
        self.requests.append(req)
        return req

    # figures
    @property
    def cost(self) -> float:
        return sum(PRICE_READ * q.read + PRICE_WRITE * q.write for q in self.requests)

    @property
    def uncached(self) -> float:
        return sum(PRICE_BASE * q.tokens for q in self.requests)

    @property
    def cache_share(self) -> float:
        return sum(q.read for q in self.requests) / max(1, sum(q.tokens for q in self.requests))

    @property
    def peak(self) -> int:
        return max(q.tokens for q in self.requests)

    def per_step(self) -> dict[int, int]:
        """Tokens of the request that carried each scripted step (the last one when several did)."""
        out: dict[int, int] = {}
        for q in self.requests:
            if q.kind != "compaction":
                out[q.step] = q.tokens
        return out


def encode_body(env: dict, msgs: list[dict]) -> bytes:
    return msgspec.json.encode({**env, "messages": msgs})


def run_without(env: dict, first: dict, steps: list[tuple[dict, dict]], script: Script, keep: int = 6) -> Run:
    run = Run("without addon")
    msgs = [first]
    r = random.Random(1_000_003)
    for t, (answer, follow) in enumerate(steps):
        raw = encode_body(env, msgs)
        if tokens(len(raw)) > COMPACT_AT * WINDOW:
            # Claude Code's compaction: one summarisation request over everything, then a fresh history
            ask = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so "
                                              "far, paying close attention to the user's explicit requests and "
                                              "your previous actions. " + script.prose(600, 900, r)}
            run.bill(t, "compaction", encode_body(env, msgs + [ask]))
            cut = len(msgs) - keep
            while cut < len(msgs) and msgs[cut]["role"] != "assistant":
                cut += 1
            summary = {"role": "user", "content": "This session is being continued from a previous conversation "
                                                  "that ran out of context. The conversation is summarized below:\n"
                       + script.prose(7_600, 8_400, r)}
            msgs = [summary] + msgs[cut:]
            run.compactions += 1
            run.events.append(f"step {t}: compaction ({len(raw) // 4:,} tokens -> {len(encode_body(env, msgs)) // 4:,})")
            raw = encode_body(env, msgs)
        run.bill(t, "step", raw)
        msgs = msgs + [answer, follow]
    return run


class Model:
    """The scripted model of the addon run: it follows the script, and folds when the context is big."""

    def __init__(self, fold_at: float, keep_recent: int, distil_at: int, seed: int, script: Script):
        self.fold_at = fold_at
        self.keep_recent = keep_recent
        self.distil_at = distil_at
        self.r = random.Random(seed * 7919 + 17)
        self.script = script
        self.calls = 0
        self.cooldown_until = -1

    def wants_fold(self, t: int, sent_tokens: int) -> bool:
        return sent_tokens > self.fold_at * WINDOW and t >= self.cooldown_until

    def compress_args(self, payload: dict) -> tuple[dict, int] | None:
        """The compress call for the body the model sees: the oldest unfolded span of consumed work,
        plus a distillation of the summary blocks once enough have piled up.  ``(args, folded bytes)``."""
        msgs = payload["messages"]
        limit = len(msgs) - self.keep_recent
        tagged: list[tuple[int, str]] = []
        blocks: list[tuple[int, str, int, int, int]] = []  # position, id, chars, first and last ref
        for i, m in enumerate(msgs[:limit]):
            content = m["content"]
            texts = [content] if isinstance(content, str) else [
                b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"]
            for text in texts:
                if (hit := TAG.match(text)) is not None:
                    tagged.append((i, hit.group(1)))
                elif (hit := BLOCK.match(text)) is not None:
                    blocks.append((i, hit.group(1), len(text), int(hit.group(2)[1:]), int(hit.group(3)[1:])))
        tagged = [(i, ref) for i, ref in tagged if i > 0]  # the opening request stays
        if len(tagged) < 2:
            return None
        (i0, start), (i1, end) = tagged[0], tagged[-1]
        folded = sum(len(msgspec.json.encode(m)) for m in msgs[i0:i1 + 2])
        # a block whose span (shown in its header) reaches into the range is absorbed by the new one:
        # its content has to live on in the new summary
        lo, hi = int(start[1:]), int(end[1:])
        absorbed = [b for b in blocks if b[3] <= hi and b[4] >= lo]
        blocks = [b for b in blocks if b not in absorbed]
        size = int(folded * self.r.uniform(0.01, 0.02) + 0.8 * sum(b[2] for b in absorbed))
        entries = [{"startId": start, "endId": end, "topic": f"work up to {end}",
                    "summary": self.script.prose(max(60, min(size, 19_000)), max(80, min(size, 19_000)), self.r)}]
        if len(blocks) >= self.distil_at:
            chars = sum(b[2] for b in blocks)
            size = int(chars * self.r.uniform(0.3, 0.5))
            entries.insert(0, {"startId": blocks[0][1], "endId": blocks[-1][1], "topic": "earlier work",
                               "summary": self.script.prose(max(60, min(size, 19_000)), max(80, min(size, 19_000)),
                                                            self.r)})
        return {"content": entries}, folded


def run_with(env: dict, first: dict, steps: list[tuple[dict, dict]], script: Script, seed: int, fold_at: float,
             keep_recent: int = 10, distil_at: int = 4) -> Run:
    run = Run(f"with addon (fold at {fold_at:.0%})")
    model = Model(fold_at, keep_recent, distil_at, seed, script)
    with tempfile.TemporaryDirectory(prefix="bili-bench-session-") as d:
        engine = Engine(Store(d), fold_cfg=FoldConfig(min_compress_chars=5000), window=WINDOW)
        msgs = [first]
        pending: str | None = None  # the call id of a compress the next request executes
        for t, (answer, follow) in enumerate(steps):
            folded_now = False
            while True:
                raw = encode_body(env, msgs)
                res = engine.process(raw, ANTH, HEADERS, render=True)
                sent = res.body if res.body is not None else raw
                req = run.bill(t, "compress" if pending else "step", sent)
                payload = msgspec.json.decode(sent)
                run.invalid += not valid_anthropic(payload)
                if b"[bili] The context" in sent[-4096:]:
                    run.nudged += 1
                if pending is not None:
                    outcome = _call_result(payload, pending)
                    ok = outcome.count("\nCompressed ") + outcome.startswith("Compressed ")
                    bad = outcome.count(" not compressed: ")
                    run.folds_ok += ok
                    run.folds_refused += bad
                    run.events.append(f"step {t}: compress executed ({', '.join(res.executed) or 'nothing run'}): "
                                      f"{ok} range(s) folded, {bad} refused; context now {req.tokens:,} tokens"
                                      + (f" -- {outcome.splitlines()[0][:120]}" if bad else ""))
                    if bad and not ok:
                        model.cooldown_until = t + 5
                    pending = None
                # output tokens of the answer, for the usage the response path would record
                out_tokens = tokens(len(msgspec.json.encode(answer)))
                engine.store.record_usage(SID, "anthropic", (req.tokens, req.read, req.write, out_tokens))
                if folded_now or not model.wants_fold(t, req.tokens):
                    break
                made = model.compress_args(payload)
                if made is None:
                    model.cooldown_until = t + 5
                    break
                args, folded = made
                model.calls += 1
                call_id = f"toolu_bili_{model.calls:03d}"
                distil = len(args["content"]) > 1
                run.distils += distil
                run.events.append(f"step {t}: the model calls compress at {req.tokens:,} tokens: "
                                  + ", ".join(f"{e['startId']}..{e['endId']} ({len(e['summary']):,} chars)"
                                              for e in args["content"])
                                  + f" over ~{folded // 4:,} tokens")
                # the response path sees the call in the stream; the agent answers the unknown tool
                engine.record_calls(SID, [(call_id, "compress", json.dumps(args))])
                msgs = msgs + [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "compress",
                                                       "input": args}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "is_error": True,
                                                  "content": UNKNOWN_TOOL}]},
                ]
                pending = call_id
                folded_now = True
            msgs = msgs + [answer, follow]
        engine.store.close()
    return run


def valid_anthropic(payload: dict) -> bool:
    """The first message is the user's; every tool_use has its result in the next message and every
    tool_result its call in the previous one."""
    msgs = payload["messages"]
    if not msgs or msgs[0]["role"] != "user":
        return False

    def ids(m: dict, kind: str, key: str) -> set[str]:
        c = m.get("content")
        return {b[key] for b in c if isinstance(b, dict) and b.get("type") == kind} if isinstance(c, list) else set()

    for i, m in enumerate(msgs):
        uses = ids(m, "tool_use", "id")
        if uses and (i + 1 >= len(msgs) or not uses <= ids(msgs[i + 1], "tool_result", "tool_use_id")):
            return False
        results = ids(m, "tool_result", "tool_use_id")
        if results and (i == 0 or not results <= ids(msgs[i - 1], "tool_use", "id")):
            return False
    return True


def _call_result(payload: dict, call_id: str) -> str:
    for m in reversed(payload["messages"][-4:]):
        content = m.get("content")
        for b in content if isinstance(content, list) else []:
            if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") == call_id:
                c = b.get("content")
                return c if isinstance(c, str) else json.dumps(c)
    return ""


# -- report ------------------------------------------------------------------------------------

SPARK = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[int], width: int = 75) -> str:
    if not values:
        return ""
    per = max(1, -(-len(values) // width))
    cols = [max(values[i:i + per]) for i in range(0, len(values), per)]
    return "".join(SPARK[min(8, round(v / WINDOW * 8))] for v in cols)


def ktok(n: float) -> str:
    return f"{n / 1000:,.1f}K"


def report(base: Run, addon: Run, turns: int, seed: int, fold_at: float, verbose: bool) -> None:
    b_steps, a_steps = base.per_step(), addon.per_step()
    bt = [q.tokens for q in base.requests]
    at = [q.tokens for q in addon.requests]
    rows = [
        ("requests", f"{len(base.requests)} ({base.compactions} compaction req.)",
         f"{len(addon.requests)} ({sum(q.kind == 'compress' for q in addon.requests)} compress round trips)"),
        ("tokens/request min", ktok(min(bt)), ktok(min(at))),
        ("tokens/request median", ktok(statistics.median(bt)), ktok(statistics.median(at))),
        ("tokens/request max", ktok(max(bt)), ktok(max(at))),
        ("input tokens, total", ktok(sum(bt)), ktok(sum(at))),
        ("billed, uncached (x1.0)", ktok(base.uncached), ktok(addon.uncached)),
        ("billed, prefix cache", ktok(base.cost), ktok(addon.cost)),
        ("  cache read (x0.1)", ktok(sum(q.read for q in base.requests)), ktok(sum(q.read for q in addon.requests))),
        ("  cache write (x1.25)", ktok(sum(q.write for q in base.requests)),
         ktok(sum(q.write for q in addon.requests))),
        ("cache-read share", f"{base.cache_share:.1%}", f"{addon.cache_share:.1%}"),
        ("peak context", f"{ktok(base.peak)} ({base.peak / WINDOW:.0%} of window)",
         f"{ktok(addon.peak)} ({addon.peak / WINDOW:.0%} of window)"),
        ("compactions / folds", f"{base.compactions} compactions",
         f"{addon.folds_ok} ranges folded ({addon.distils} with distil), {addon.folds_refused} refused"),
    ]
    if addon.nudged:
        rows.append(("", "", f"{addon.nudged} requests carried a [bili] fold reminder"))
    rows.append(("invalid bodies sent", "-", f"{addon.invalid} (tool_use/tool_result pairing, first role)"))
    print(f"session replay: {turns} scripted turns, seed {seed}, window {WINDOW:,} tokens, tokens ~ bytes/4; "
          f"price: cache read {PRICE_READ}, cache write {PRICE_WRITE}, uncached {PRICE_BASE}")
    print()
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(len(r[1]) for r in rows) + 2
    print(f"{'':<{w0}}{base.name:<{w1}}{addon.name}")
    for a, b, c in rows:
        print(f"{a:<{w0}}{b:<{w1}}{c}")
    print()
    print("tokens sent, every 20th turn (the request that carried the turn's scripted step)")
    print(f"  {'turn':>5}{'without':>10}{'with':>10}")
    for t in list(range(0, turns, 20)) + ([turns - 1] if (turns - 1) % 20 else []):
        print(f"  {t:>5}{ktok(b_steps.get(t, 0)):>10}{ktok(a_steps.get(t, 0)):>10}")
    print()
    print(f"tokens per request against the window (each column the max of a few requests; █ = {WINDOW:,})")
    print(f"  without |{sparkline(bt)}|")
    print(f"  with    |{sparkline(at)}|")
    print()
    if verbose:
        for run in (base, addon):
            print(f"{run.name}:")
            for e in run.events:
                print(f"  {e}")
        print()
    ratio = addon.cost / base.cost
    over = [q for q in addon.requests if q.tokens > WINDOW]
    print("targets")
    print(f"  billed cost with the addon <= {TARGET_COST:.0%} of without: "
          f"{'met' if ratio <= TARGET_COST else 'MISSED'} ({ratio:.1%}: {ktok(addon.cost)} vs {ktok(base.cost)})")
    print(f"  cache-read share >= {TARGET_CACHE:.0%}: {'met' if addon.cache_share >= TARGET_CACHE else 'MISSED'} "
          f"({addon.cache_share:.1%} with the addon; {base.cache_share:.1%} without)")
    print(f"  never over the window: {'met' if not over else 'MISSED'} (peak {ktok(addon.peak)} of "
          f"{ktok(WINDOW)}; {len(over)} request(s) over)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--fold-at", type=float, default=0.60,
                    help="share of the window from which the scripted model folds (default 0.60)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip the addon runs at other fold thresholds")
    ap.add_argument("-v", "--verbose", action="store_true", help="list compactions and compress calls")
    args = ap.parse_args()

    t0 = time.perf_counter()
    script = Script(args.seed)
    env = script.environment()
    first, steps = script.session(args.turns)
    base = run_without(env, first, steps, script)
    addon = run_with(env, first, steps, script, args.seed, args.fold_at)
    report(base, addon, args.turns, args.seed, args.fold_at, args.verbose)
    if args.sweep:
        print()
        print("sweep: the scripted model's fold threshold (same session, same baseline)")
        print(f"  {'fold at':>8}{'folds':>7}{'billed':>10}{'vs without':>12}{'cache read':>12}{'peak':>9}{'median':>9}")
        for f in (0.25, 0.35, 0.45, 0.60, 0.75):
            run = addon if f == args.fold_at else run_with(env, first, steps, script, args.seed, f)
            print(f"  {f:>8.0%}{run.folds_ok:>7}{ktok(run.cost):>10}{run.cost / base.cost:>12.1%}"
                  f"{run.cache_share:>12.1%}{ktok(run.peak):>9}{ktok(statistics.median(q.tokens for q in run.requests)):>9}")
    print(f"\ntotal runtime {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
