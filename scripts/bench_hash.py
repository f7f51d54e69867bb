#!/usr/bin/env python3
"""BLAKE3 (the ``blake3`` package) against the standard library's SHA-256, side by side, on the inputs
the addon hashes: the prefix chain of anonymous conversations (``kernel.sessions.chain``:
``H(previous digest || 0 || canonical item)`` per conversation item) and the seed of an anonymous
session id.

Inputs, each timed with both hashes in the same run (best of several rounds, ``time.perf_counter``):

* the canonical items of every model request in the captured sessions of real agents
  (``/work/shared/captures`` or ``--captures DIR``; skipped when absent): the real size mix;
* synthetic items of 64 B to 1 MiB: where the crossover lies;
* the session-id seed (~80 B);
* for scale: the time ``bili replay`` takes to push the same captured requests through the kernel.

The addon keeps BLAKE3 only where this shows it faster: the chain (faster on the captured mix,
thanks to the large tool outputs; slower on items under 4 KiB); the session-id seed uses SHA-256.

    python scripts/bench_hash.py
    python scripts/bench_hash.py --quick
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HASHES: dict[str, Callable[[bytes], bytes]] = {"sha256": lambda b: hashlib.sha256(b).digest()}
try:
    import blake3

    HASHES["blake3"] = lambda b: blake3.blake3(b).digest()
except ImportError:  # the addon no longer depends on it; install it to compare
    pass

DEFAULT_CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"


def captured_items(root: Path) -> list[bytes]:
    """The canonical items (as the chain hashes them) of every model request in ``root``'s *.mitm."""
    import msgspec
    from mitmproxy import http, io

    from bili_addon.kernel.sessions import canonical_item
    from bili_addon.wire import detect_lane

    items: list[bytes] = []
    for path in sorted(root.rglob("*.mitm")):
        with open(path, "rb") as f:
            for flow in io.FlowReader(f).stream():
                if not isinstance(flow, http.HTTPFlow) or detect_lane(flow.request.method, flow.request.path) is None:
                    continue
                try:
                    body = msgspec.json.decode(flow.request.get_content(strict=False) or b"")
                except (msgspec.DecodeError, ValueError):
                    continue
                conv = next((body[k] for k in ("messages", "input", "contents")
                             if isinstance(body, dict) and isinstance(body.get(k), list)), [])
                items += [canonical_item(it) for it in conv]
    return items


def chain_inputs(items: list[bytes]) -> list[bytes]:
    prev = b"\x00" * 32
    return [prev + b"\x00" + c for c in items]


def best_of(fn: Callable[[bytes], bytes], inputs: list[bytes], rounds: int, min_time: float) -> float:
    """Seconds for one pass over ``inputs``: the best of ``rounds`` timed loops of at least ``min_time``."""
    best = float("inf")
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while True:
            for b in inputs:
                fn(b)
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / n)
    return best


def row(label: str, inputs: list[bytes], rounds: int, min_time: float) -> None:
    size = sum(map(len, inputs))
    t = {name: best_of(fn, inputs, rounds, min_time) for name, fn in HASHES.items()}
    per = "  ".join(f"{name} {1e6 * v / len(inputs):9.2f} µs/item" for name, v in t.items())
    ratio = f"  blake3/sha256 = {t['blake3'] / t['sha256']:.2f}x" if "blake3" in t else ""
    print(f"{label:<34} {len(inputs):>6} items {size / len(inputs):>10.0f} B avg  {per}{ratio}")


def scale(root: Path, inputs: list[bytes]) -> None:
    """The chain over every captured item, against the kernel's whole work on the same requests."""
    from bili_addon.replay import replay_file

    files = sorted(root.rglob("*.mitm"))
    t0 = time.perf_counter()
    for path in files:
        replay_file(path)
    kernel = time.perf_counter() - t0
    chain = {name: best_of(fn, inputs, 3, 0.05) for name, fn in HASHES.items()}
    print(f"  for scale: bili replay of the same {len(files)} files takes {1e3 * kernel:.0f} ms; the chain over "
          "all their items: " + ", ".join(f"{name} {1e3 * v:.2f} ms ({100 * v / kernel:.3f}%)"
                                          for name, v in chain.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--captures", type=Path, default=DEFAULT_CAPTURES)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rounds, min_time = (3, 0.05) if args.quick else (7, 0.2)
    if "blake3" not in HASHES:
        print("blake3 is not installed: only SHA-256 is timed (pip install blake3 to compare)")
    print(f"best of {rounds} rounds; ratio > 1: BLAKE3 is slower than SHA-256 on that input")
    if args.captures.is_dir():
        items = captured_items(args.captures)
        if items:
            row("captured items (the chain, real)", chain_inputs(items), rounds, min_time)
            small = [c for c in items if len(c) <= 4096]
            large = [c for c in items if len(c) > 4096]
            for label, part in (("  of them <= 4 KiB", small), ("  of them > 4 KiB", large)):
                if part:
                    row(label, chain_inputs(part), rounds, min_time)
            scale(args.captures, chain_inputs(items))
    else:
        print(f"(no captures at {args.captures}: synthetic sizes only)")
    for size in (64, 256, 1024, 4096, 16384, 65536, 1 << 20):
        row(f"synthetic {size} B", [bytes(i % 251 for i in range(size))] * 8, rounds, min_time)
    row("session-id seed", [b"9f" * 32 + b"\x0012\x001"] * 8, rounds, min_time)


if __name__ == "__main__":
    main()
