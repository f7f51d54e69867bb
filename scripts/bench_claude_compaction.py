#!/usr/bin/env python3
"""Does the real Claude Code still auto-compact through bili?  A long scripted session, with and
without the proxy, against a local model that reports the real prompt size.

Claude Code decides to compact from the usage the API reports for its last request (input + cache
read + cache write tokens): at ``window - 20K reserved for the summary - 13K`` (167K of 200K), or at
``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` percent of the effective window when that is lower.  The window
is set with ``CLAUDE_CODE_AUTO_COMPACT_WINDOW=200000`` (``--window``): without it, 2.1.197 took a
larger window for ``claude-sonnet-4-5`` behind a custom base URL and never auto-compacted.  Through
bili the reported usage is the size of the prompt bili actually sent, folded.

The scripted model (loopback only) drives ``claude -p`` through ``--steps`` shell steps, each
printing ~``--output-kb`` KB, then answers; it answers Claude Code's summarisation request with a
summary, and a bili reminder with one ``compress`` call over the ranges the reminder lists (in an
answer of its own; Claude Code answers the unknown tool and the proxy runs it on the next
request).  Its usage reports the request body's size / 4 as input tokens.

Needs Claude Code installed by the acceptance tests (``$BILI_AGENT_CACHE`` or
``~/.cache/bili-addon/agents/claude-<version>``), or ``--claude PATH``.  Prints, per run: the steps
done, Claude Code's compactions (summarisation requests), the largest reported prompt, the
requests, and where the first request after each compaction starts.  ``--capture DIR`` writes the
request bodies around each compaction (as Claude Code sent them to the proxy or the model).

    python scripts/bench_claude_compaction.py                     # 60 steps of ~20 KB, both runs
    python scripts/bench_claude_compaction.py --pct 40 --steps 40  # a lower threshold, sooner
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from acceptance.scripted_model import (  # noqa: E402
    Action,
    ScriptedModel,
    anthropic_answer,
    lane_of,
    shell_args,
    tools_of,
)

VERSION = "2.1.197"
COMPACT_ASKS = ("Your task is to create a detailed summary of the",)
CONTINUED = "This session is being continued from a previous conversation that ran out of context"
REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)", re.M)
TASK = "Work through the numbered listings step by step with your shell tool until the model says done."


def _text(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content if isinstance(content, list) else []:
        if isinstance(b, dict):
            if b.get("type") == "text":
                out.append(b.get("text", ""))
            elif b.get("type") == "tool_result":
                out.append(_text(b.get("content")))
    return "\n".join(out)


class MarathonModel(ScriptedModel):
    """Anthropic Messages only: shell steps, summaries for compaction requests, compress for reminders."""

    def __init__(self, steps: int, output_kb: int, late: bool = False):
        super().__init__()
        self.steps, self.output_kb = steps, output_kb
        self.late = late  # ignore bili's reminders until Claude Code has compacted once
        self.compacted = False
        self.step = 0
        self.log: list[dict] = []  # one entry per model request: kind, reported tokens, head of the history

    def answer(self, rec):
        rec.lane = lane_of(rec.method, rec.path)
        if rec.lane != "anthropic":
            return 404, "application/json", b'{"error": {"type": "not_found", "message": "scripted"}}'
        try:
            rec.json = body = json.loads(rec.body)
        except ValueError:
            return 400, "application/json", b'{"error": {"type": "invalid_request_error", "message": "not JSON"}}'
        msgs = body.get("messages") or []
        last = _text(msgs[-1]["content"]) if msgs else ""
        head = _text(msgs[0]["content"])[:200] if msgs else ""
        prompt = len(rec.body) // 4
        tools = tools_of("anthropic", body)
        if any(a in last for a in COMPACT_ASKS):
            kind = "compaction"
            self.compacted = True
            summary = ("<analysis>scripted</analysis>\n<summary>\n1. Primary Request and Intent: work through the "
                       f"numbered listings. 2. Progress: {self.step} steps done, every listing read and checked. "
                       "3. Pending: continue with the next listing.\n" + "Detail line of the summary. " * 150
                       + "\n</summary>")
            action = Action("text", 0, summary)
        elif "Bash" not in tools:
            kind, action = "side", Action("text", 0, '{"title": "Marathon"}')
        else:
            ranges = REMINDER.findall(last[last.rindex("[bili] "):]) if "[bili] " in last else []
            if ranges and "compress" in tools and (self.compacted or not self.late):
                kind = "compress"
                args = {"content": [{"startId": a, "endId": b, "topic": "listings",
                                     "summary": f"Listings {a}..{b} were read and checked; all rows in order, "
                                                "nothing to follow up."} for a, b, _n, _k in ranges]}
                action = Action("tool", 900 + len(self.log), "Folding the older listings.", "compress", args)
            elif self.step < self.steps:
                self.step += 1
                kind = "step"
                lines = self.output_kb * 1024 // 64
                cmd = f"seq -f 'listing-{self.step}-row-%05g the quick brown fox jumps over the lazy dog' 1 {lines}"
                action = Action("tool", self.step, f"Step {self.step}: reading listing {self.step}.", "Bash",
                                shell_args(tools["Bash"], cmd))
            else:
                kind, action = "final", Action("text", 0, "All listings are done. MARATHON-DONE")
        self.log.append({"kind": kind, "prompt": prompt, "messages": len(msgs), "head": head, "seq": rec.seq,
                         "step": self.step})
        rec.action = action
        ctype, out = anthropic_answer(rec.seq, body.get("model") or "scripted", action, bool(body.get("stream")),
                                      prompt)
        # the final usage event carries the input figures too, as Anthropic's does
        out = out.replace(b'"usage": {"output_tokens": 20}}',
                          b'"usage": {"input_tokens": %d, "cache_creation_input_tokens": 0, '
                          b'"cache_read_input_tokens": 0, "output_tokens": 20}}' % prompt)
        return 200, ctype, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claude_binary(given: str | None) -> Path:
    if given:
        return Path(given)
    root = Path(os.environ.get("BILI_AGENT_CACHE") or Path.home() / ".cache" / "bili-addon" / "agents")
    path = root / f"claude-{VERSION}" / "node_modules" / ".bin" / "claude"
    if not path.exists():
        sys.exit(f"Claude Code {VERSION} is not installed at {path}; run the acceptance tests once, or --claude PATH")
    return path


def run(claude: Path, steps: int, output_kb: int, pct: int | None, through_bili: bool, work: Path,
        timeout: float, window: int | None = 200_000, late: bool = False) -> tuple[MarathonModel, dict]:
    model = MarathonModel(steps, output_kb, late).start()
    proxy = None
    home, cwd = work / "home", work / "project"
    home.mkdir(parents=True)
    cwd.mkdir()
    base = f"http://127.0.0.1:{model.port}"
    try:
        if through_bili:
            port = free_port()
            mitmdump = Path(sys.executable).parent / "mitmdump"
            log = open(work / "proxy.log", "w")
            proxy = subprocess.Popen(
                [str(mitmdump), "-s", str(REPO / "bili_addon" / "addon.py"), "--mode", f"reverse:{base}",
                 "--listen-host", "127.0.0.1", "--listen-port", str(port), "--set", f"bili_data_dir={work / 'data'}",
                 "--set", f"confdir={work / 'ca'}", "--set", "connection_strategy=lazy"],
                stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.1)
            base = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE", "BILI_"))
               and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env.update(HOME=str(home), ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY="sk-ant-api03-scripted",
                   DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", NO_COLOR="1",
                   TERM="dumb", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        if pct:
            env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = str(pct)
        if window:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(window)
        t0 = time.monotonic()
        p = subprocess.run([str(claude), "-p", TASK, "--allowedTools", "Bash", "--model", "claude-sonnet-4-5",
                            "--max-turns", str(steps * 3 + 20)],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        info = {"rc": p.returncode, "seconds": time.monotonic() - t0, "stdout": p.stdout[-500:],
                "stderr": p.stderr[-1500:]}
    finally:
        model.stop()
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
    return model, info


def summarise(name: str, model: MarathonModel, info: dict) -> dict:
    log = model.log
    comp = [i for i, e in enumerate(log) if e["kind"] == "compaction"]
    after = [log[i + 1] for i in comp if i + 1 < len(log)]
    main = [e for e in log if e["kind"] in ("step", "compress", "final")]
    out = {
        "run": name, "rc": info["rc"], "seconds": round(info["seconds"], 1), "steps": model.step,
        "requests": len(log), "compactions": len(comp), "folds_asked": sum(e["kind"] == "compress" for e in log),
        "peak_reported": max((e["prompt"] for e in main), default=0),
        "compacted_at": [log[i]["prompt"] for i in comp],
        "folds_after_first_compaction": sum(e["kind"] == "compress" for e in log[comp[0]:]) if comp else 0,
        "after_compaction_head": [e["head"][:90] for e in after],
        "finished": "MARATHON-DONE" in info["stdout"],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--output-kb", type=int, default=20, help="KB each shell step prints (default 20)")
    ap.add_argument("--pct", type=int, help="CLAUDE_AUTOCOMPACT_PCT_OVERRIDE (default: Claude Code's own threshold)")
    ap.add_argument("--window", type=int, default=200_000,
                    help="CLAUDE_CODE_AUTO_COMPACT_WINDOW (default 200000; 0: Claude Code's own idea of the "
                         "model's window, which for claude-sonnet-4-5 through a custom base URL is larger: "
                         "2.1.197 then never auto-compacted in our runs)")
    ap.add_argument("--only", choices=("alone", "bili"))
    ap.add_argument("--late", action="store_true",
                    help="the model ignores bili's reminders until Claude Code has compacted once (so the run "
                         "through bili compacts too, and shows folding after it)")
    ap.add_argument("--claude")
    ap.add_argument("--capture", help="write the request bodies around each compaction here")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    claude = claude_binary(args.claude)
    results = []
    for name, through in (("alone", False), ("bili", True)):
        if args.only and args.only != name:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"bili-cc-{name}-"))
        try:
            model, info = run(claude, args.steps, args.output_kb, args.pct, through, work, args.timeout,
                              args.window or None, args.late)
            res = summarise(name, model, info)
            results.append(res)
            if args.capture:
                dest = Path(args.capture) / name
                dest.mkdir(parents=True, exist_ok=True)
                reqs = [r for r in model.seen if r.lane == "anthropic"]
                for i, e in enumerate(model.log):
                    if e["kind"] == "compaction":
                        for r in reqs[max(0, i - 1): i + 3]:
                            (dest / f"{r.seq:04d}.json").write_bytes(r.body)
            if res["rc"] != 0 or not res["finished"]:
                print(f"{name}: claude exited {info['rc']}\n{info['stderr']}", file=sys.stderr)
            if through:
                lines = (work / "proxy.log").read_text().splitlines()
                res["proxy_log"] = [ln[:260] for ln in lines if "compacted its history" in ln or "no longer matches" in ln]
                res["proxy_executed_compress"] = sum("ran=compress" in ln for ln in lines)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
