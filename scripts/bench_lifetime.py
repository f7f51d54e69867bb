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
ap.add_argument("--messages", type=int, default=400, help="conversation items (400: ~500 KB)")
ap.add_argument("--reps", type=int, default=25, help="follow-up turns timed per choice and seed")
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


def session(case: Case, choice: str, d: str, reps: int) -> tuple[list[float], list[float], str, int]:
    sid = "bench-lifetime"
    h = {"x-claude-code-session-id": sid}
    eng = Engine(Store(d), fold_cfg=FoldConfig(), activate="always", materialize="now")
    t = {"now": 1_000.0}
    eng.now = lambda: t["now"]

    def send(msgs):
        t["now"] += 2.0  # a tool loop: never a cold moment, the choice stays as set
        return eng.process(cc_body(case, msgs), case.lane, h, render=True)

    msgs = list(case.msgs)
    out = send(msgs).body
    refs = TAG.findall(out.decode())
    args = {"content": [{"startId": refs[1], "endId": refs[len(refs) // 2], "topic": "the first half",
                         "summary": "Read the first half of the modules; nothing unusual."}]}
    rw = ResponseRewriter("anthropic")
    rw.json_body(json.dumps({"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-x",
                             "content": [{"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}],
                             "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5}}).encode())
    eng.record_calls(sid, rw.calls)
    msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_c1", "name": "compress", "input": args}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "is_error": True,
                                           "content": "<tool_use_error>Error: No such tool available: compress"
                                                      "</tool_use_error>"}]}]
    out = send(msgs).body
    assert b"[Compressed conversation section b1" in out, "the fold did not land"
    eng.set_flag(sid, "ttl", {"choice": choice})
    samples, floors, digest, size = [], [], hashlib.sha256(), 0
    for i in range(reps):
        msgs.append(case.new(i))
        msgs.append({"role": "assistant", "content": f"Noted {i}."})
        msgs.append({"role": "user", "content": f"go on {i}"})
        raw = cc_body(case, msgs)
        floors.append(cpu(lambda: msgspec.json.encode(msgspec.json.decode(raw))))
        t["now"] += 2.0
        res = None

        def run():
            nonlocal res
            res = eng.process(raw, case.lane, h, render=True)

        samples.append(cpu(run))
        sent = res.body or raw
        digest.update(sent)
        size = len(sent)
        if choice != "5m":
            assert b'"ttl":"1h"' in sent, "no lifetime set"
        eng.lineage.flush()
    eng.store.close()
    return samples, floors, digest.hexdigest()[:12], size


def main() -> None:
    print(f"bili_addon from {Path(bili_addon.__file__).resolve().parents[1]}; python {sys.version.split()[0]}")
    print(f"{'seed':>4}{'choice':>8}{'body':>10}{'floor ms':>10}{'turn ms':>10}{'extra ms':>10}"
          f"{'extra/floor':>13}  sent (sha256)")
    extras: dict[str, list[float]] = {c: [] for c in CHOICES}
    floors_all: list[float] = []
    for seed in range(1, args.seeds + 1):
        case = Case("anthropic", args.messages, seed=seed)
        base = None
        for choice in CHOICES:
            with tempfile.TemporaryDirectory(prefix="bili-bench-") as d:
                samples, floors, digest, size = session(case, choice, d, args.reps)
            turn, floor = statistics.median(samples) * 1000, statistics.median(floors) * 1000
            base = turn if choice == "5m" else base
            extra = turn - base
            extras[choice].append(extra)
            floors_all.append(floor)
            print(f"{seed:>4}{choice:>8}{size / 1024:>9.0f}K{floor:>10.2f}{turn:>10.2f}{extra:>10.2f}"
                  f"{extra / floor:>12.2f}x  {digest}", flush=True)
    floor = statistics.median(floors_all)
    print()
    for choice in CHOICES[1:]:
        e = statistics.median(extras[choice])
        print(f"{choice}: a follow-up turn costs {e:+.2f} ms over the same turn under 5m (median of {args.seeds} "
              f"seeds), {e / floor:+.2f}x the {floor:.2f} ms floor")


if __name__ == "__main__":
    main()
