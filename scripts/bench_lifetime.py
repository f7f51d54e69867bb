#!/usr/bin/env python3
"""What the cache lifetimes (kernel/lifetime.py) cost a follow-up turn, per lifetime choice.

A Claude Code-shaped session (two breakpoints in ``system``, one on the last message, 20 tools,
tool loops) of about 500 KB, folded once (bili's head breakpoint sits on the summary), then
follow-up turns (one new message each) timed with the session's lifetime choice set to 5m, head
and 1h; beside them the floor (``msgspec`` decode + encode of the same body).  The row "extra"
is what a choice adds to the 5m turn: the work of setting the lifetimes.

    python scripts/bench_lifetime.py                    # this checkout
    python scripts/bench_lifetime.py --repo ../main     # another checkout's bili_addon (before/after)

Times are CPU time (``time.process_time``), median over the repeats, over the same seeds for
every choice.  The body each choice sends is printed as a digest: the same across checkouts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the checkout whose bili_addon runs")
ap.add_argument("--messages", type=int, default=700, help="conversation items (700: ~500 KB)")
ap.add_argument("--reps", type=int, default=41, help="follow-up turns timed per choice and seed")
ap.add_argument("--seeds", type=int, default=3)
args = ap.parse_args()

sys.path.insert(0, args.repo)
import bili_addon  # noqa: E402  (the checkout's package, before the bench helpers import it)

sys.path.insert(1, str(Path(__file__).resolve().parent))
import msgspec  # noqa: E402
from bench_overhead import Case, cpu  # noqa: E402

from bili_addon.kernel.fold import FoldConfig  # noqa: E402
from bili_addon.kernel.turn import Engine  # noqa: E402
from bili_addon.store import Store  # noqa: E402
from bili_addon.stream import ResponseRewriter  # noqa: E402

EPH = {"type": "ephemeral"}
TAG = re.compile(r'>(m\d{5})</acp>')
CHOICES = ("5m", "head", "1h")


def cc_body(case: Case, msgs: list[dict]) -> bytes:
    """Claude Code's breakpoints: two in system, one on the last block of the last message."""
    last = msgs[-1]
    blocks = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    msgs = msgs[:-1] + [{**last, "content": blocks[:-1] + [{**blocks[-1], "cache_control": EPH}]}]
    half = len(case.top["system"]) // 2
    system = [{"type": "text", "text": case.top["system"][:half], "cache_control": EPH},
              {"type": "text", "text": case.top["system"][half:], "cache_control": EPH}]
    return msgspec.json.encode({**case.top, "system": system, "messages": msgs})


class Run:
    """One session of ``case`` under one lifetime choice, folded once, ready for follow-up turns."""

    def __init__(self, case: Case, choice: str, d: str):
        self.case, self.choice, self.sid = case, choice, "bench-lifetime"
        self.h = {"x-claude-code-session-id": self.sid}
        self.eng = Engine(Store(d), fold_cfg=FoldConfig(), activate="always", materialize="now")
        self.t = 1_000.0
        self.eng.now = lambda: self.t
        self.msgs = list(case.msgs)
        self.digest, self.size = hashlib.sha256(), 0
        refs = TAG.findall(self.send().decode())
        args = {"content": [{"startId": refs[1], "endId": refs[len(refs) // 2], "topic": "the first half",
                             "summary": "Read the first half of the modules; nothing unusual."}]}
        rw = ResponseRewriter("anthropic")
        rw.json_body(json.dumps({"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-x",
                                 "content": [{"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}],
                                 "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5}}).encode())
        self.eng.record_calls(self.sid, rw.calls)
        self.msgs += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "is_error": True,
                                          "content": "<tool_use_error>Error: No such tool available: compress"
                                                     "</tool_use_error>"}]}]
        assert b"[Compressed conversation section b1" in self.send(), "the fold did not land"
        self.eng.set_flag(self.sid, "ttl", {"choice": choice})

    def send(self, raw: bytes | None = None) -> bytes:
        self.t += 2.0  # a tool loop: never a cold moment, the choice stays as set
        res = self.eng.process(raw or cc_body(self.case, self.msgs), self.case.lane, self.h, render=True)
        return res.body or raw

    def follow_up(self, i: int) -> tuple[float, float]:
        """CPU seconds of one follow-up turn and of the floor of its body."""
        self.msgs += [self.case.new(i), {"role": "assistant", "content": f"Noted {i}."},
                      {"role": "user", "content": f"go on {i}"}]
        raw = cc_body(self.case, self.msgs)
        floor = cpu(lambda: msgspec.json.encode(msgspec.json.decode(raw)))
        out = []
        took = cpu(lambda: out.append(self.send(raw)))
        self.digest.update(out[0])
        self.size = len(out[0])
        assert (b'"ttl":"1h"' in out[0]) == (self.choice != "5m"), "lifetimes not as chosen"
        self.eng.write_pending()  # (the proxy's write-behind, off the request's path)
        self.eng.lineage.flush()
        return took, floor


def step(run: Run) -> None:
    """The head's lifetimes alone, on the last body the 5m run sent: the body parsed again
    (``lifetime.apply``, the path before) against the parts the engine holds (``apply_parts``, when
    this checkout has it; the encode the turn makes anyway not counted), paired per repeat."""
    from bili_addon.kernel import lifetime
    from bili_addon.wire.base import Body

    sent = cc_body(run.case, run.msgs)
    sent = run.eng.process(sent, run.case.lane, run.h, render=True).body
    parts = Body(sent, "messages")
    items = [bytes(i) for i in parts.items]
    again, held = [], []
    for _ in range(args.reps * 5):
        again.append(cpu(lambda: lifetime.apply(sent, "head")))
        if hasattr(lifetime, "apply_parts"):
            top, its = dict(parts.top), list(items)
            held.append(cpu(lambda: lifetime.apply_parts(top, "messages", its)))
    a = statistics.median(again) * 1000
    line = f"     the head's lifetimes alone, {len(sent) / 1024:.0f}K: parsed again {a:.3f} ms"
    if held:
        h = statistics.median(held) * 1000
        line += f", on the parts {h:.3f} ms ({a / h:.1f}x less)"
    print(line, flush=True)


def main() -> None:
    print(f"bili_addon from {Path(bili_addon.__file__).resolve().parents[1]}; python {sys.version.split()[0]}")
    print(f"{'seed':>4}{'choice':>8}{'body':>10}{'floor ms':>10}{'turn ms':>10}{'extra ms':>10}"
          f"{'extra/floor':>13}  sent (sha256)")
    extras: dict[str, list[float]] = {c: [] for c in CHOICES}
    floors_all: list[float] = []
    for seed in range(1, args.seeds + 1):
        case = Case("anthropic", args.messages, seed=seed)
        with tempfile.TemporaryDirectory(prefix="bili-bench-") as d:
            runs = [Run(case, c, str(Path(d) / c)) for c in CHOICES]
            turns: dict[str, list[float]] = {c: [] for c in CHOICES}
            floors: list[float] = []
            for i in range(args.reps):  # interleaved: the host's load drifts alike for every choice
                for r in runs:
                    took, floor = r.follow_up(i)
                    turns[r.choice].append(took)
                    floors.append(floor)
            step(runs[CHOICES.index("5m")])
            for r in runs:
                r.eng.store.close()
        floor = statistics.median(floors) * 1000
        floors_all.append(floor)
        for r in runs:
            turn = statistics.median(turns[r.choice]) * 1000
            # the median of the per-turn differences to the 5m run's same turn
            extra = statistics.median(a - b for a, b in zip(turns[r.choice], turns["5m"])) * 1000
            extras[r.choice].append(extra)
            print(f"{seed:>4}{r.choice:>8}{r.size / 1024:>9.0f}K{floor:>10.2f}{turn:>10.2f}{extra:>10.2f}"
                  f"{extra / floor:>12.2f}x  {r.digest.hexdigest()[:12]}", flush=True)
    floor = statistics.median(floors_all)
    print()
    for choice in CHOICES[1:]:
        e = statistics.median(extras[choice])
        print(f"{choice}: a follow-up turn costs {e:+.2f} ms over the same turn under 5m (median of {args.seeds} "
              f"seeds), {e / floor:+.2f}x the {floor:.2f} ms floor")


if __name__ == "__main__":
    main()
