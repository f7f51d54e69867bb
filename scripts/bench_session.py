#!/usr/bin/env python3
"""A long synthetic coding session replayed with and without the addon, under a prefix-cache price model.

A seeded script of ``--turns`` agent steps (user prompts, assistant prose + tool calls, tool outputs
of realistic sizes: file reads 2-20 KB, test runs, greps, edits) is replayed twice on the Anthropic
Messages lane:

* **without the addon**: the agent sends its history as is; when a request would exceed ~90% of the
  window it compacts like Claude Code's /compact (one summarisation request over the whole history,
  then all history but the last few steps replaced by one ~2K-token summary message);
* **with the addon**: every request goes through ``Engine.process(..., render=True)`` and the bytes
  of ``result.body`` are billed.  The scripted model does what the addon asks of it and no more:
  when a request ends with a ``[bili]`` reminder, its answer folds the ranges the reminder lists in
  one ``compress`` call (a summary of 1-2% of each range, 30-50% when it distils earlier summaries),
  alongside the tool call of its next step (``--style parallel``, the default) or as a response of
  its own (``--style turn``).  So the run measures the addon's own policy: when it reminds, what it
  protects, where summaries go.  The agent answers the unknown tool with Claude Code's error; the
  addon's response path is emulated with ``Engine.record_calls`` and ``Store.record_usage``.

Billing: for each request the common byte prefix with the previous request of the same run is
cache read (0.1 per token), the rest cache write (1.25); tokens ~ bytes / 4; uncached = 1.0.  The
output tokens the model spends on summaries (compaction or compress calls) are listed, not billed.

    python scripts/bench_session.py                 # 300 turns, seed 1
    python scripts/bench_session.py --turns 600 --seed 3
    python scripts/bench_session.py --no-sweep      # without the runs at other reminder sizes
    python scripts/bench_session.py --marathon      # 600 turns; both agents compact like Claude Code
    python scripts/bench_session.py --materialize now   # every fold leaves the wire at once

The addon runs as shipped: lazy activation, and folds held off the wire until the rewrite decision
(kernel/rewrite.py) lands them; the report counts the folds held and the requests that landed them.

**Marathon mode** (``--marathon``, 600 turns by default): the agent compacts the way Claude Code
does, in both runs: when the usage the provider reported for its last request (input + cache read
+ cache write, i.e. the prompt as it was actually sent) reaches its auto-compact threshold
(``window - 20K reserved for the summary - 13K buffer`` = 167K of 200K), it sends one summarisation
request over its history and continues from a history of one user message starting "This session
is being continued from a previous conversation that ran out of context".  Through the addon the
reported usage is the folded prompt's, so the agent compacts when (and only when) the folded prompt
reaches the threshold; the addon recognises the compaction (a new epoch) and folds on.  The
comparison is the agent with the addon against the agent alone, compactions included.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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

from bili_addon.kernel.cache import Bill, Clock  # noqa: E402
from bili_addon.kernel.nudge import NudgeConfig  # noqa: E402
from bili_addon.kernel.pending import SENTENCE as HELD  # noqa: E402
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

TARGET_COST = 0.50
MATERIALIZE = "cost"  # the addon's bili_materialize option (--materialize)
TARGET_CACHE = 0.90

# Claude Code's auto-compact: effective window (the window minus up to 20K output tokens reserved for
# the summary) minus a 13K buffer, compared with the usage the provider reported for the last request
CC_COMPACT_AT = WINDOW - 20_000 - 13_000
MARATHON_TURNS = 600
TARGET_MARATHON_COST = 0.45
TARGET_MARATHON_PEAK = 0.60
COMPACT_ASK = ("Your task is to create a detailed summary of the conversation so far, paying close attention to "
               "the user's explicit requests and your previous actions. ")
CC_SUMMARY_HEAD = ("This session is being continued from a previous conversation that ran out of context. The "
                   "conversation is summarized below:\n")


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
        # Claude Code's cache breakpoints: two in system (the last message carries the third, encode_body)
        cut = system.index("\n\n", len(system) // 8)
        eph = {"type": "ephemeral"}
        return {"model": "claude-sonnet-4-5", "max_tokens": 32000, "tools": tools, "system": [
            {"type": "text", "text": system[:cut], "cache_control": eph},
            {"type": "text", "text": system[cut:], "cache_control": eph}]}


# -- time: the gap model ------------------------------------------------------------------------

TOOL_GAP = (6.0, 0.6)  # seconds between the requests of a tool loop: lognormal (median, sigma)
HUMAN_GAP = (90.0, 1.5)  # seconds the human takes: lognormal (median, sigma); ~21% over 5 min
# the share of tool steps where the agent waits for the human (a permission prompt for an edit or a
# command, a question) before its next request: the same lognormal think-time.  Calibrated so that
# the agent alone spends ~24% of its Anthropic bill on writes after an expired entry (the low end of
# the 24-40% public reports cite for cache entries expired during human think-time; 19-29% over
# seeds 1-3 at 300 and 600 turns).  With the human only between tasks (session 4: 0.0) the agent
# alone spends 4-14% there (2-6 pauses over 5 minutes per 300 turns), and no think-time distribution
# reaches the cited range that way: the script has only 14-17 task boundaries per 300 turns.
WAIT_SHARE = 0.15
SESSION4_WAIT_SHARE = 0.0  # the gap model of session 4: the human only between tasks
NO_PAUSE_HUMAN = 20.0  # the timeline without pauses: a human answers in 20 s


def timeline(steps: list[tuple[dict, dict]], seed: int, pauses: bool, wait_share: float = WAIT_SHARE) -> list[float]:
    """When the request of each scripted step leaves.  After a tool result the model's next request
    follows within seconds, or (``wait_share`` of tool steps) after the human's think-time; after a
    final answer the human's next task comes after a heavy-tailed pause (``pauses``) or after 20 s.
    Without ``pauses`` the human always answers in 20 s and never holds a tool step."""
    r = random.Random(seed * 104_729 + 7)
    at, out = 0.0, []
    for t in range(len(steps)):
        human = t > 0 and isinstance(steps[t - 1][1]["content"], str)
        tool_gap = r.lognormvariate(math.log(TOOL_GAP[0]), TOOL_GAP[1])
        human_gap = r.lognormvariate(math.log(HUMAN_GAP[0]), HUMAN_GAP[1])
        # drawn only where the model has waits (session 4's timeline stays as it was, draw for draw)
        waits = pauses and wait_share > 0 and r.random() < wait_share and t > 0
        at += (human_gap if pauses else NO_PAUSE_HUMAN) if human else (human_gap if waits else tool_gap)
        out.append(at)
    return out


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
    times: list[float] = field(default_factory=list)  # when each step's request leaves (the gap model)
    requests: list[Request] = field(default_factory=list)
    # the same requests under the providers' cache rules (kernel/cache.py): Anthropic's breakpoints
    # and lifetimes, and OpenAI's automatic prefix caching of the prompt it would build from them
    # (kernel/cache.py's _prompt: the system prompt, the tools, then the messages)
    anth: Clock = field(default_factory=lambda: Clock("anthropic", "claude-sonnet-4-5"))
    oai: Clock = field(default_factory=lambda: Clock("responses", "gpt-5"))
    anth_bills: list[Bill] = field(default_factory=list)
    oai_bills: list[Bill] = field(default_factory=list)
    prev: bytes = b""
    events: list[str] = field(default_factory=list)
    folds_ok: int = 0
    folds_refused: int = 0
    distils: int = 0
    compactions: int = 0
    nudged: int = 0
    invalid: int = 0  # bodies that break Anthropic's pairing rules
    summary_tokens: int = 0  # output tokens the model spent on summaries
    compacted_at: list[int] = field(default_factory=list)  # request index after each compaction
    epochs: int = 0  # compactions the addon recognised as new epochs
    fold_at: list[int] = field(default_factory=list)  # request index of each fold leaving the wire
    held: int = 0  # folds executed but held off the wire until it paid (bili_materialize=cost)
    landings: int = 0  # requests that landed held folds
    sent_at: list[float] = field(default_factory=list)  # when each request left
    lifetime: dict | None = None  # the addon's cache lifetime decision (kernel/lifetime.py), as stats show it

    def folds_after_compaction(self) -> int:
        return sum(1 for k in self.fold_at if self.compacted_at and k > self.compacted_at[0])

    def at(self, step: int, kind: str) -> float:
        """The time of a request: its step's, plus a few seconds for each extra request of the step."""
        base = self.times[step] if self.times else float(step)
        same = sum(1 for q in self.requests if q.step == step)
        return base + (30.0 if kind == "compaction" else 3.0) * same

    def bill(self, step: int, kind: str, sent: bytes) -> Request:
        at = self.at(step, kind)
        self.sent_at.append(at)
        self.anth_bills.append(self.anth.send(sent, at))
        self.oai_bills.append(self.oai.send(sent, at))
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
    def anth_cost(self) -> float:
        return sum(b.cost(self.anth.rules) for b in self.anth_bills)

    @property
    def oai_cost(self) -> float:
        return sum(b.cost(self.oai.rules) for b in self.oai_bills)

    @property
    def anth_read_share(self) -> float:
        return sum(b.read for b in self.anth_bills) / max(1, sum(b.total for b in self.anth_bills))

    def expired_share(self) -> float:
        """The share of the Anthropic bill spent on writes after an expiry: the cache writes (at their
        lifetime's price) of every request sent after a gap longer than a 5-minute entry lives."""
        r = self.anth.rules
        spent = sum(r.write * b.write + r.write_long * b.write_long for b, prev, at in
                    zip(self.anth_bills[1:], self.sent_at, self.sent_at[1:]) if at - prev > r.ttl)
        return spent / max(1e-9, self.anth_cost)

    def anth_writes(self) -> int:
        return sum(b.write + b.write_long for b in self.anth_bills)

    def after_fold_hit(self) -> float | None:
        """The Anthropic cache-read share of the first request that carries each fold (the request that
        executed the compress call and left the range off the wire), on average."""
        hits = [self.anth_bills[k - 1].read / max(1, self.anth_bills[k - 1].total) for k in self.fold_at
                if 0 < k <= len(self.anth_bills)]
        return sum(hits) / len(hits) if hits else None

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
    """The agent's request, with Claude Code's third breakpoint on the last block of the last message."""
    if msgs:
        last = msgs[-1]
        content = last["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if blocks:
            blocks[-1] = {**blocks[-1], "cache_control": {"type": "ephemeral"}}
            msgs = msgs[:-1] + [{**last, "content": blocks}]
    return msgspec.json.encode({**env, "messages": msgs})


def run_without(env: dict, first: dict, steps: list[tuple[dict, dict]], script: Script, keep: int = 6,
                marathon: bool = False, times: list[float] | None = None) -> Run:
    """``marathon``: the agent compacts like Claude Code, from the usage reported for its last
    request, and keeps nothing of the old history but the summary."""
    run = Run("agent alone" if marathon else "without addon", times or [])
    msgs = [first]
    r = random.Random(1_000_003)
    if marathon:
        keep = 0
    for t, (answer, follow) in enumerate(steps):
        raw = encode_body(env, msgs)
        reported = run.requests[-1].tokens if run.requests else 0
        if (reported >= CC_COMPACT_AT) if marathon else (tokens(len(raw)) > COMPACT_AT * WINDOW):
            # Claude Code's compaction: one summarisation request over everything, then a fresh history
            ask = {"role": "user", "content": COMPACT_ASK + script.prose(600, 900, r)}
            run.bill(t, "compaction", encode_body(env, msgs + [ask]))
            cut = len(msgs) - keep
            while keep and cut < len(msgs) and msgs[cut]["role"] != "assistant":
                cut += 1
            summary = {"role": "user", "content": CC_SUMMARY_HEAD + script.prose(7_600, 8_400, r)}
            msgs = [summary] + msgs[cut:]
            run.compactions += 1
            run.summary_tokens += tokens(len(summary["content"]))
            run.events.append(f"step {t}: compaction ({len(raw) // 4:,} tokens -> {len(encode_body(env, msgs)) // 4:,})")
            raw = encode_body(env, msgs)
        run.bill(t, "step", raw)
        msgs = msgs + [answer, follow]
    return run


REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)  ~([\d.]+)(K?) tokens", re.M)


class Model:
    """The scripted model of the addon run: it works through the script and answers the addon's
    reminders.  A reminder lists ranges; the model folds each of them in one compress call, with a
    summary of 1-2% of a range's size by default (30-50% when it distils summaries)."""

    def __init__(self, seed: int, script: Script, share: tuple[float, float] = (0.01, 0.02), obey: float = 1.0):
        self.share = share
        self.obey = obey  # the share of reminders the model answers (the rest it ignores)
        self.r = random.Random(seed * 7919 + 17)
        self.ignore = random.Random(seed * 31 + 5)
        self.script = script
        self.calls = 0
        self.summary_tokens = 0  # what the model wrote into compress calls (output tokens)

    def answer_reminder(self, payload: dict) -> dict | None:
        """The compress arguments for a reminder on the newest turn of ``payload``, or None."""
        tail = payload["messages"][-2:]
        texts = [c if isinstance(c, str) else "\n".join(b.get("text", "") for b in c if isinstance(b, dict))
                 for c in (m["content"] for m in tail)]
        note = next((t[t.index("[bili] "):] for t in texts if "[bili] " in t), None)
        if note is None or self.ignore.random() >= self.obey:
            return None
        entries = []
        for m in REMINDER.finditer(note):
            size = float(m.group(5)) * (1000 if m.group(6) else 1) * 4  # chars
            share = self.r.uniform(0.3, 0.5) if m.group(4) == "summaries" else self.r.uniform(*self.share)
            chars = max(80, min(int(size * share), 19_000))
            entries.append({"startId": m.group(1), "endId": m.group(2), "topic": f"work {m.group(1)}–{m.group(2)}",
                            "summary": self.script.prose(chars - 20, chars, self.r)})
        if not entries:
            return None
        self.summary_tokens += sum(tokens(len(e["summary"])) for e in entries)
        return {"content": entries}


def run_with(env: dict, first: dict, steps: list[tuple[dict, dict]], script: Script, seed: int,
             style: str = "parallel", batch: int | None = None,
             share: tuple[float, float] = (0.01, 0.02), obey: float = 1.0, marathon: bool = False,
             times: list[float] | None = None, activate: str = "lazy", materialize: str | None = None) -> Run:
    """``style``: "parallel", the model calls compress alongside the tool call of its next step (one
    response, as the reminder suggests); "turn", compress is a response of its own (an extra request).
    ``marathon``: the agent compacts like Claude Code when the usage reported for the (folded)
    request it sent last reaches its threshold."""
    cfg = NudgeConfig() if batch is None else NudgeConfig(batch_tokens=batch)
    run = Run(f"with addon ({style}, reminders at {cfg.batch_tokens // 1000}K)", times or [])
    r = random.Random(1_000_003)
    model = Model(seed, script, share, obey)
    with tempfile.TemporaryDirectory(prefix="bili-bench-session-") as d:
        engine = Engine(Store(d), window=WINDOW, activate=activate, materialize=materialize or MATERIALIZE)
        engine.nudge_cfg = cfg
        clock = {"now": 0.0}
        engine.now = lambda: clock["now"]
        msgs = [first]
        ask: dict | None = None  # compress arguments the model answers the last reminder with

        def send(t: int, kind: str, out_tokens: int) -> dict:
            raw = encode_body(env, msgs)
            clock["now"] = run.at(t, kind)
            res = engine.process(raw, ANTH, HEADERS, render=True)
            sent = res.body if res.body is not None else raw
            req = run.bill(t, kind, sent)
            if res.landed and "compress" not in res.executed:  # held folds left the wire with this request
                run.landings += 1
                run.fold_at.append(len(run.requests))
            payload = msgspec.json.decode(sent)
            run.invalid += not valid_anthropic(payload)
            # the response path records the usage the provider reports
            engine.store.record_usage(SID, "anthropic", (req.tokens, req.read, req.write, out_tokens))
            engine.clocks.report(SID, run.anth_bills[-1].read)  # the provider's figures calibrate the clock
            return payload

        def outcome(t: int, payload: dict, call_id: str) -> None:
            text = _call_result(payload, call_id)
            ok, bad = text.count("Compressed "), text.count(" not compressed: ")
            run.folds_ok += ok
            if HELD in text:
                run.held += ok
            else:
                run.fold_at += [len(run.requests)] * ok
            run.folds_refused += bad
            run.distils += text.count("(tier 2") + text.count("(tier 3")
            run.events.append(f"step {t}: compress executed: {ok} range(s) folded, {bad} refused; context now "
                              f"{run.requests[-1].tokens:,} tokens" + (f" -- {text.splitlines()[0][:120]}" if bad else ""))

        pending: str | None = None  # a compress call the next request executes
        for t, (answer, follow) in enumerate(steps):
            if marathon and run.requests and run.requests[-1].tokens >= CC_COMPACT_AT:
                # Claude Code's auto-compact, from the usage reported for the prompt bili sent
                before = run.requests[-1].tokens
                msgs = msgs + [{"role": "user", "content": COMPACT_ASK + script.prose(600, 900, r)}]
                send(t, "compaction", 2_000)
                summary = {"role": "user", "content": CC_SUMMARY_HEAD + script.prose(7_600, 8_400, r)}
                msgs, pending = [summary], None
                run.compactions += 1
                run.summary_tokens += tokens(len(summary["content"]))
                run.events.append(f"step {t}: compaction ({before:,} tokens reported)")
                run.compacted_at.append(len(run.requests))
            payload = send(t, "step", tokens(len(msgspec.json.encode(answer))))
            if pending is not None:
                outcome(t, payload, pending)
                pending = None
            ask = None
            if "[bili] " in msgspec.json.encode(payload["messages"][-2:]).decode():
                run.nudged += 1
                ask = model.answer_reminder(payload)
            if ask is not None:
                model.calls += 1
                call_id = f"toolu_bili_{model.calls:03d}"
                call = {"type": "tool_use", "id": call_id, "name": "compress", "input": ask}
                error = {"type": "tool_result", "tool_use_id": call_id, "is_error": True, "content": UNKNOWN_TOOL}
                run.events.append(f"step {t}: the model calls compress: " + ", ".join(
                    f"{e['startId']}..{e['endId']} ({len(e['summary']):,} chars)" for e in ask["content"]))
                # the response path sees the call in the stream
                engine.record_calls(SID, [(call_id, "compress", json.dumps(ask))])
                if style == "parallel" and isinstance(follow["content"], list):
                    answer = {**answer, "content": answer["content"] + [call]}
                    follow = {**follow, "content": follow["content"] + [error]}
                    pending = call_id
                else:  # a response of its own; the agent answers the unknown tool, and the model goes on
                    msgs = msgs + [{"role": "assistant", "content": [call]}, {"role": "user", "content": [error]}]
                    outcome(t, send(t, "compress", tokens(len(json.dumps(ask)))), call_id)
            msgs = msgs + [answer, follow]
        run.summary_tokens += model.summary_tokens
        run.epochs = len(engine.session(SID).flags.get("epochs", []))
        run.lifetime = engine.session(SID).flags.get("ttl")
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


def report(base: Run, addon: Run, turns: int, seed: int, verbose: bool) -> None:
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
         f"{addon.folds_ok} ranges folded ({addon.distils} of them distils), {addon.folds_refused} refused"),
        ("folds held off the wire", "-", f"{addon.held} of them held until it paid, landed by "
                                         f"{addon.landings} later request(s)"),
        ("summaries written (output)", f"{ktok(base.summary_tokens)} tokens",
         f"{ktok(addon.summary_tokens)} tokens (not billed above)"),
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


TARGET_ANTH_FLAT = 0.45
TARGET_ANTH_GAPS = 0.40


def lifetime_label(flag: dict | None) -> str:
    if not flag:
        return "5m (undecided)"
    return {"5m": "5m", "head": "1h head, 5m tail", "1h": "1h everywhere"}.get(flag.get("choice"), str(flag))


def report_provider(pairs: list[tuple[str, Run, Run]]) -> None:
    """The same runs billed under the providers' cache rules (kernel/cache.py), beside the old figure."""
    print("billed under the providers' cache rules (kernel/cache.py), the old byte-prefix figure beside it")
    print(f"  gap model: tool loop lognormal median {TOOL_GAP[0]:.0f} s sigma {TOOL_GAP[1]}; the human's think-time "
          f"lognormal median {HUMAN_GAP[0]:.0f} s sigma {HUMAN_GAP[1]}, before each new task and before "
          f"{WAIT_SHARE:.0%} of the tool steps")
    print("  (a permission prompt, a question), calibrated so that the agent alone spends ~24% of its bill on writes")
    print(f"  after an expiry, the low end of the 24-40% public reports cite; session-4 parameters: the human before "
          f"a new task only ({SESSION4_WAIT_SHARE:.0%} of tool steps); no pauses: the human answers in "
          f"{NO_PAUSE_HUMAN:.0f} s")
    w = max(len(label) for label, _, _ in pairs) + 10
    head = (f"  {'timeline':<{w}}{'billing':<28}{'without':>10}{'with':>10}{'ratio':>8}{'read share':>12}"
            f"{'writes w/o→with':>18}{'1st after fold':>16}{'expired w/o→with':>18}")
    print(head)
    for label, base, addon in pairs:
        pauses = sum(1 for a, b in zip(base.times, base.times[1:]) if b - a > 300)
        name = f"{label} ({pauses}>5m)"
        hit = addon.after_fold_hit()
        rows = [
            ("byte prefix (old)", base.cost, addon.cost, addon.cache_share, "", "", ""),
            ("Anthropic breakpoints, TTL", base.anth_cost, addon.anth_cost, addon.anth_read_share,
             f"{ktok(base.anth_writes())}→{ktok(addon.anth_writes())}", f"{hit:.0%}" if hit is not None else "-",
             f"{base.expired_share():.1%}→{addon.expired_share():.1%}"),
            ("OpenAI prefix (its prompt)", base.oai_cost, addon.oai_cost,
             sum(b.read for b in addon.oai_bills) / max(1, sum(b.total for b in addon.oai_bills)), "", "", ""),
        ]
        for how, b, a, share, writes, first, expired in rows:
            print(f"  {name:<{w}}{how:<28}{ktok(b):>10}{ktok(a):>10}{a / b:>8.1%}{share:>12.1%}{writes:>18}"
                  f"{first:>16}{expired:>18}")
            name = ""
        f = addon.lifetime or {}
        costs = ", ".join(f"{k} {f[c]:,.0f}" for k, c in
                          (("5m", "cost_5m"), ("1h head", "cost_head"), ("1h", "cost_1h")) if c in f)
        print(f"  {'':<{w}}the addon's cache lifetime: {lifetime_label(addon.lifetime)}"
              + (f" (expected per request, input-token units: {costs})" if costs else ""))
    print("  (ratio: with the addon against without; read share: cache reads of the input with the addon;")
    print("  1st after fold: the Anthropic read share of the first request after each fold, on average;")
    print("  expired: the share of the Anthropic bill spent on cache writes after a gap over 5 minutes)")
    print()
    print("targets (Anthropic breakpoint rules)")
    for (label, base, addon), target in zip(pairs, (TARGET_ANTH_FLAT, TARGET_ANTH_GAPS, TARGET_ANTH_GAPS)):
        ratio = addon.anth_cost / base.anth_cost
        note = "" if "session-4" not in label else " (for comparison: the gap model the target was set on)"
        print(f"  {label}: billed <= {target:.0%} of without: {'met' if ratio <= target else 'MISSED'} ({ratio:.1%}); "
              f"cache-read share >= {TARGET_CACHE:.0%}: {'met' if addon.anth_read_share >= TARGET_CACHE else 'MISSED'} "
              f"({addon.anth_read_share:.1%}){note}")


def report_marathon(base: Run, runs: list[tuple[str, Run]], turns: int, seed: int) -> None:
    """The agent with the addon against the agent alone, both compacting like Claude Code."""
    print(f"marathon: {turns} scripted turns, seed {seed}, window {WINDOW:,} tokens; the agent auto-compacts like "
          f"Claude Code when the reported usage of its last request reaches {CC_COMPACT_AT:,} tokens")
    print(f"price: cache read {PRICE_READ}, cache write {PRICE_WRITE}; tokens ~ bytes/4")
    print()
    head = (f"  {'run':<34}{'compactions':>12}{'epochs':>8}{'folds':>7}{'after 1st':>10}{'billed':>11}"
            f"{'vs alone':>10}{'cache read':>12}{'peak':>9}{'of window':>11}{'median':>9}")
    print(head)
    for name, run in [("agent alone", base)] + runs:
        print(f"  {name:<34}{run.compactions:>12}{run.epochs if run is not base else '-':>8}"
              f"{run.folds_ok if run is not base else '-':>7}"
              f"{run.folds_after_compaction() if run is not base and run.compactions else '-':>10}"
              f"{ktok(run.cost):>11}{run.cost / base.cost:>10.1%}{run.cache_share:>12.1%}{ktok(run.peak):>9}"
              f"{run.peak / WINDOW:>11.0%}{ktok(statistics.median(q.tokens for q in run.requests)):>9}")
    print("  (compactions: the agent's own; epochs: those the addon recognised; after 1st: folds executed after")
    print("  the agent's first compaction; billed and peak include the compaction requests)")
    print()
    addon = runs[0][1]
    print("tokens per request against the window (each column the max of a few requests; █ = 200,000)")
    print(f"  alone   |{sparkline([q.tokens for q in base.requests])}|")
    for name, run in runs:
        label = name.removeprefix("with addon (").removesuffix(")").replace("answers ", "").replace(" reminder", "")
        print(f"  {label[:7]:<7} |{sparkline([q.tokens for q in run.requests])}|")
    print()
    ratio = addon.cost / base.cost
    few = addon.compactions <= 1 and base.compactions >= 3
    print("targets (the first run with the addon: the model answers every reminder)")
    print(f"  compactions: at most 1 with the addon where the agent alone compacts 3 or more times: "
          f"{'met' if few else 'MISSED'} ({addon.compactions} with, {base.compactions} alone)")
    print(f"  billed cost <= {TARGET_MARATHON_COST:.0%} of the agent alone: "
          f"{'met' if ratio <= TARGET_MARATHON_COST else 'MISSED'} "
          f"({ratio:.1%}: {ktok(addon.cost)} vs {ktok(base.cost)})")
    print(f"  peak <= {TARGET_MARATHON_PEAK:.0%} of the window: "
          f"{'met' if addon.peak <= TARGET_MARATHON_PEAK * WINDOW else 'MISSED'} ({ktok(addon.peak)}, "
          f"{addon.peak / WINDOW:.0%}; alone {ktok(base.peak)}, {base.peak / WINDOW:.0%})")
    lazy = [(n, r) for n, r in runs[1:] if r.compactions]
    for name, run in lazy:
        print(f"  {name}: {run.compactions} compaction(s), {run.epochs} recognised as epochs, "
              f"{run.folds_after_compaction()} fold(s) after the first")


def sweep_holding(env: dict, first: dict, steps: list, script: Script, seed: int, style: str, *timelines) -> None:
    """What holding folds longer would cost: the rewrite decision's horizon (the requests a held fold
    would wait for) capped, so that folds which pay over the session are held and batched instead."""
    from bili_addon.kernel import rewrite

    print()
    print("sweep: folds held longer (the rewrite decision's horizon capped at N requests), Anthropic rules")
    print(f"  {'horizon':>9}{'held':>7}{'no pauses':>11}{'gap model':>11}")
    saved = rewrite.MAX_HORIZON, rewrite.MIN_REST
    try:
        for cap in (None, 8, 5, 3):
            cells, held = [], ""
            for times, base, shipped in timelines:
                if cap is None:
                    run = shipped
                else:
                    rewrite.MAX_HORIZON, rewrite.MIN_REST = cap, min(saved[1], cap)
                    run = run_with(env, first, steps, script, seed, style, times=times)
                    rewrite.MAX_HORIZON, rewrite.MIN_REST = saved
                cells.append(f"{run.anth_cost / base.anth_cost:.1%}")
                held = held or f"{run.held}/{run.folds_ok}"
            print(f"  {'as shipped' if cap is None else f'<= {cap}':>9}{held:>7}{cells[0]:>11}{cells[1]:>11}")
    finally:
        rewrite.MAX_HORIZON, rewrite.MIN_REST = saved
    print("  (held: folds held off the wire when executed, of all; they land with a later fold, a cold moment")
    print("  or the window)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--turns", type=int, help="scripted turns (default 300; 600 with --marathon)")
    ap.add_argument("--style", choices=("parallel", "turn"), default="parallel",
                    help="how the model answers a reminder: compress alongside its next tool call, or in a "
                         "response of its own (default parallel)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip the addon runs with other reminder sizes and the other style")
    ap.add_argument("-v", "--verbose", action="store_true", help="list compactions and compress calls")
    ap.add_argument("--marathon", action="store_true",
                    help=f"both agents compact like Claude Code, from the reported usage ({MARATHON_TURNS} turns "
                         "unless --turns is given)")
    ap.add_argument("--activate", choices=("lazy", "always"), default="lazy",
                    help="the addon's bili_activate option (default lazy)")
    ap.add_argument("--materialize", choices=("cost", "now"), default="cost",
                    help="the addon's bili_materialize option (default cost: folds leave the wire when it pays)")
    ap.set_defaults(turns=None)
    args = ap.parse_args()
    global MATERIALIZE
    MATERIALIZE = args.materialize
    if args.turns is None:
        args.turns = MARATHON_TURNS if args.marathon else 300

    quiet = logging.getLogger("bili")  # the engine's log lines (compactions, folds) are not the report
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    t0 = time.perf_counter()
    script = Script(args.seed)
    env = script.environment()
    first, steps = script.session(args.turns)
    if args.marathon:
        base = run_without(env, first, steps, script, marathon=True)
        runs = [(f"with addon ({name})", run_with(env, first, steps, script, args.seed, args.style, obey=obey,
                                                  marathon=True))
                for name, obey in (("answers every reminder", 1.0), ("answers 1 in 4", 0.25),
                                   ("answers 1 in 10", 0.1), ("never folds", 0.0))]
        report_marathon(base, runs, args.turns, args.seed)
        if args.verbose:
            for name, run in [("agent alone", base)] + runs:
                print(f"{name}:")
                for e in run.events:
                    print(f"  {e}")
        print(f"\ntotal runtime {time.perf_counter() - t0:.1f} s")
        return
    flat, gaps = timeline(steps, args.seed, False), timeline(steps, args.seed, True)
    old_gaps = timeline(steps, args.seed, True, SESSION4_WAIT_SHARE)
    base = run_without(env, first, steps, script, times=flat)
    addon = run_with(env, first, steps, script, args.seed, args.style, times=flat, activate=args.activate)
    report(base, addon, args.turns, args.seed, args.verbose)
    print()
    base_g = run_without(env, first, steps, script, times=gaps)
    addon_g = run_with(env, first, steps, script, args.seed, args.style, times=gaps, activate=args.activate)
    base_o = run_without(env, first, steps, script, times=old_gaps)
    addon_o = run_with(env, first, steps, script, args.seed, args.style, times=old_gaps, activate=args.activate)
    report_provider([("no pauses", base, addon), ("gap model", base_g, addon_g),
                     ("gap model, session-4 parameters", base_o, addon_o)])
    if args.sweep:
        default = NudgeConfig().batch_tokens
        print()
        print("sweep: the foldable tokens at which the addon reminds the model (NudgeConfig.batch_tokens), and how")
        print("the model answers (same session, same baseline)")
        print(f"  {'reminds at':>11}{'style':>10}{'summary':>9}{'answers':>9}{'folds':>7}{'billed':>11}"
              f"{'vs without':>12}{'cache read':>12}{'peak':>9}{'median':>9}{'summaries':>11}")
        other = "turn" if args.style == "parallel" else "parallel"
        usual = (0.01, 0.02)
        for batch, style, share, obey in ((7_500, args.style, usual, 1.0), (default, args.style, usual, 1.0),
                                          (default, other, usual, 1.0), (default, args.style, (0.03, 0.05), 1.0),
                                          (default, args.style, usual, 0.5), (30_000, args.style, usual, 1.0),
                                          (60_000, args.style, usual, 1.0)):
            run = addon if (batch, style, share, obey) == (default, args.style, usual, 1.0) else run_with(
                env, first, steps, script, args.seed, style, batch, share, obey)
            print(f"  {ktok(batch):>11}{style:>10}{f'{share[0]:.0%}-{share[1]:.0%}':>9}{obey:>9.0%}{run.folds_ok:>7}"
                  f"{ktok(run.cost):>11}{run.cost / base.cost:>12.1%}{run.cache_share:>12.1%}{ktok(run.peak):>9}"
                  f"{ktok(statistics.median(q.tokens for q in run.requests)):>9}{ktok(run.summary_tokens):>11}")
        print("  (summary: a fold's summary against the range it replaces; answers: the share of reminders the")
        print("  model answers, the rest it ignores; summaries: the output tokens it spent on them)")
        sweep_holding(env, first, steps, script, args.seed, args.style, (flat, base, addon), (gaps, base_g, addon_g))
    print(f"\ntotal runtime {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
