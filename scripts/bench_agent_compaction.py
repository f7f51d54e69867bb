#!/usr/bin/env python3
"""Does a real agent still auto-compact through bili?  A long scripted session, with and without the
proxy, against a local model that reports the real prompt size (Claude Code, codex and pi).

Both agents decide to compact from the usage the API reports for the requests they send.  Claude
Code: the input + cache read + cache write tokens of its last request against ``window - 20K
reserved for the summary - 13K`` (167K of 200K), or ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` percent of
the effective window when that is lower; the window is set with
``CLAUDE_CODE_AUTO_COMPACT_WINDOW=200000`` (``--window``): without it, 2.1.197 took a larger window
for ``claude-sonnet-4-5`` behind a custom base URL and never auto-compacted.  codex: the reported
total tokens against ``model_auto_compact_token_limit`` (``--codex-limit``; with a custom provider
it compacts locally, its summary prefixed with "Another language model started to solve this
problem...").  pi: the reported tokens against the model's ``contextWindow`` less 16K, checked
between prompts only; within one ``pi -p`` prompt it compacts when the provider refuses the prompt
as too long, which the scripted model does above ``--pi-window``.  Through bili the reported usage
is the size of the prompt bili actually sent, folded.

The scripted model (loopback only) drives ``claude -p``, ``codex exec`` or ``pi -p`` through ``--steps`` shell
steps, each printing ~``--output-kb`` KB, then answers; it answers the agent's summarisation
request with a summary, and a bili reminder with one ``compress`` call over the ranges the reminder
lists (in an answer of its own; the agent answers the unknown tool and the proxy runs it on the
next request); ``--late``: only once the agent has compacted.  Its usage reports the request body's
size / 4 as input tokens.

Needs the agent installed by the acceptance tests (``$BILI_AGENT_CACHE`` or
``~/.cache/bili-addon/agents/<agent>-<version>``), or ``--binary PATH``.  Prints, per run: the steps
done, the agent's compactions (summarisation requests), the largest reported prompt, the requests,
the folds, and where the first request after each compaction starts.  ``--capture DIR`` writes the
request bodies around each compaction (as the agent sent them to the model, or bili to the model).

    python scripts/bench_agent_compaction.py --steps 100                          # Claude Code
    python scripts/bench_agent_compaction.py --agent codex --steps 40 --codex-limit 60000
    python scripts/bench_agent_compaction.py --agent pi --steps 40 --output-kb 8
    python scripts/bench_agent_compaction.py --steps 100 --late --only bili        # the epoch, live
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
    SHELL_NAMES,
    Action,
    ScriptedModel,
    anthropic_answer,
    lane_of,
    responses_answer,
    shell_args,
    tools_of,
)

VERSIONS = {"claude": "2.1.197", "codex": "0.171.0", "pi": "0.73.1"}
COMPACT_ASKS = ("Your task is to create a detailed summary of the",  # Claude Code
                "CONTEXT CHECKPOINT COMPACTION",  # codex
                "The messages above are a conversation to summarize",  # pi
                "You are a context summarization assistant")  # pi (its system prompt, turn-prefix summaries too)
CONTINUED = "This session is being continued from a previous conversation that ran out of context"
REMINDER = re.compile(r"^  ([mb]\d+)–([mb]\d+)  (\d+) (messages|summaries)", re.M)
TASK = "Work through the numbered listings step by step with your shell tool until the model says done."


def _text(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content if isinstance(content, list) else []:
        if isinstance(b, dict):
            if b.get("type") in ("text", "input_text", "output_text"):
                out.append(b.get("text", ""))
            elif b.get("type") == "tool_result":
                out.append(_text(b.get("content")))
    return "\n".join(out)


def _conversation(lane: str, body: dict) -> tuple[list[str], str]:
    """(the text of each conversation item, the newest user turn's text incl. tool results)."""
    if lane == "anthropic":
        msgs = body.get("messages") or []
        texts = [_text(m.get("content")) for m in msgs]
        return texts, texts[-1] if texts else ""
    items = [it for it in body.get("input") or [] if isinstance(it, dict)]
    texts = [_text(it.get("content")) if it.get("type", "message") == "message" else str(it.get("output", ""))
             for it in items]
    tail = []
    for it, t in zip(reversed(items), reversed(texts)):
        if it.get("role") == "assistant" or it.get("type") == "function_call":
            break
        tail.append(t)
    return texts, "\n".join(reversed(tail))


class MarathonModel(ScriptedModel):
    """Shell steps, a summary for the agent's compaction request, compress for bili's reminders."""

    def __init__(self, steps: int, output_kb: int, late: bool = False, overflow_at: int = 0):
        super().__init__()
        self.overflow_at = overflow_at  # refuse larger prompts as Anthropic does ("prompt is too long")
        self.steps, self.output_kb = steps, output_kb
        self.late = late  # ignore bili's reminders until the agent has compacted once
        self.compacted = False
        self.step = 0
        self.log: list[dict] = []  # one entry per model request: kind, reported tokens, head of the history

    def answer(self, rec):
        rec.lane = lane = lane_of(rec.method, rec.path)
        if lane not in ("anthropic", "responses"):
            if rec.path.split("?")[0].rstrip("/").endswith("/models") and rec.method == "GET":
                return 200, "application/json", b'{"object": "list", "data": [], "has_more": false}'
            return 404, "application/json", b'{"error": {"type": "not_found", "message": "scripted"}}'
        try:
            rec.json = body = json.loads(rec.body)
        except ValueError:
            return 400, "application/json", b'{"error": {"type": "invalid_request_error", "message": "not JSON"}}'
        texts, last = _conversation(lane, body)
        head = "\n".join(texts)[:200]
        prompt = len(rec.body) // 4
        tools = tools_of(lane, body)
        shell = next((n for n in SHELL_NAMES if n in tools), None)
        if self.overflow_at and prompt > self.overflow_at and lane == "anthropic":
            self.log.append({"kind": "overflow", "prompt": prompt, "items": len(texts), "head": head, "seq": rec.seq,
                             "step": self.step})
            return 400, "application/json", json.dumps({"type": "error", "error": {
                "type": "invalid_request_error",
                "message": f"prompt is too long: {prompt} tokens > {self.overflow_at} maximum"}}).encode()
        whole = rec.body.decode("utf-8", "replace")
        if any(a in last for a in COMPACT_ASKS) or (shell is None and any(a in whole for a in COMPACT_ASKS)):
            kind = "compaction"
            self.compacted = True
            summary = ("<analysis>scripted</analysis>\n<summary>\n1. Primary Request and Intent: work through the "
                       f"numbered listings. 2. Progress: {self.step} steps done, every listing read and checked. "
                       "3. Pending: continue with the next listing.\n" + "Detail line of the summary. " * 150
                       + "\n</summary>")
            action = Action("text", 0, summary)
        elif shell is None:
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
                action = Action("tool", self.step, f"Step {self.step}: reading listing {self.step}.", shell,
                                shell_args(tools[shell], cmd))
            else:
                kind, action = "final", Action("text", 0, "All listings are done. MARATHON-DONE")
        self.log.append({"kind": kind, "prompt": prompt, "items": len(texts), "head": head, "seq": rec.seq,
                         "step": self.step})
        rec.action = action
        model = body.get("model") or "scripted"
        if lane == "responses":
            ctype, out = responses_answer(rec.seq, model, action, bool(body.get("stream")), prompt)
            return 200, ctype, out
        ctype, out = anthropic_answer(rec.seq, model, action, bool(body.get("stream")), prompt)
        # the final usage event carries the input figures too, as Anthropic's does
        out = out.replace(b'"usage": {"output_tokens": 20}}',
                          b'"usage": {"input_tokens": %d, "cache_creation_input_tokens": 0, '
                          b'"cache_read_input_tokens": 0, "output_tokens": 20}}' % prompt)
        return 200, ctype, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_binary(agent: str, given: str | None) -> Path:
    if given:
        return Path(given)
    root = Path(os.environ.get("BILI_AGENT_CACHE") or Path.home() / ".cache" / "bili-addon" / "agents")
    path = root / f"{agent}-{VERSIONS[agent]}" / "node_modules" / ".bin" / agent
    if not path.exists():
        sys.exit(f"{agent} {VERSIONS[agent]} is not installed at {path}; run the acceptance tests once, or --binary")
    return path


def agent_command(agent: str, binary: Path, base: str, home: Path, opts: argparse.Namespace) -> tuple[list, dict]:
    """The agent's command line and environment against the model (or the proxy) at ``base``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE", "BILI_", "CODEX_", "OPENAI_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(HOME=str(home), NO_COLOR="1", TERM="dumb")
    if agent == "claude":
        env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY="sk-ant-api03-scripted", DISABLE_TELEMETRY="1",
                   DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        if opts.pct:
            env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = str(opts.pct)
        if opts.window:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(opts.window)
        return [str(binary), "-p", TASK, "--allowedTools", "Bash", "--model", "claude-sonnet-4-5",
                "--max-turns", str(opts.steps * 3 + 20)], env
    if agent == "pi":
        models = {"providers": {"scripted": {
            "baseUrl": base, "api": "anthropic-messages", "apiKey": "sk-ant-scripted",
            "models": [{"id": "claude-scripted", "contextWindow": opts.pi_window, "maxTokens": 8000}]}}}
        (home / ".pi" / "agent").mkdir(parents=True, exist_ok=True)
        (home / ".pi" / "agent" / "models.json").write_text(json.dumps(models, indent=2))
        return [str(binary), "-p", "--model", "scripted/claude-scripted", TASK], env
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    limit = f"model_auto_compact_token_limit = {opts.codex_limit}\n" if opts.codex_limit else ""
    (codex_home / "config.toml").write_text(
        f'model = "gpt-5.1-codex"\nmodel_provider = "scripted"\n{limit}\n'
        f'[model_providers.scripted]\nname = "scripted"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        'env_key = "SCRIPTED_API_KEY"\n')
    env.update(CODEX_HOME=str(codex_home), SCRIPTED_API_KEY="sk-scripted")
    return [str(binary), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK], env


def run(agent: str, binary: Path, opts: argparse.Namespace, through_bili: bool,
        work: Path) -> tuple[MarathonModel, dict]:
    model = MarathonModel(opts.steps, opts.output_kb, opts.late,
                          opts.pi_window if agent == "pi" else 0).start()
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
        cmd, env = agent_command(agent, binary, base, home, opts)
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=opts.timeout,
                           stdin=subprocess.DEVNULL)
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
    ap.add_argument("--agent", choices=tuple(VERSIONS), default="claude")
    ap.add_argument("--binary", help="the agent's binary (default: the acceptance tests' install)")
    ap.add_argument("--pi-window", type=int, default=60_000,
                    help="pi: the model's contextWindow in models.json; the scripted model refuses larger prompts "
                         "with Anthropic's 'prompt is too long' (pi -p compacts on that overflow, and otherwise only "
                         "between prompts)")
    ap.add_argument("--codex-limit", type=int, default=0,
                    help="codex: model_auto_compact_token_limit (default: codex's own)")
    ap.add_argument("--capture", help="write the request bodies around each compaction here")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    binary = agent_binary(args.agent, args.binary)
    results = []
    for name, through in (("alone", False), ("bili", True)):
        if args.only and args.only != name:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"bili-cc-{name}-"))
        try:
            model, info = run(args.agent, binary, args, through, work)
            res = summarise(name, model, info)
            results.append(res)
            if args.capture:
                dest = Path(args.capture) / name
                dest.mkdir(parents=True, exist_ok=True)
                reqs = [r for r in model.seen if r.lane in ("anthropic", "responses")]
                for i, e in enumerate(model.log):
                    if e["kind"] == "compaction":
                        for r in reqs[max(0, i - 1): i + 3]:
                            (dest / f"{r.seq:04d}.json").write_bytes(r.body)
            if res["rc"] != 0 or not res["finished"]:
                print(f"{name}: {args.agent} exited {info['rc']}\n{info['stderr']}", file=sys.stderr)
            if through:
                lines = (work / "proxy.log").read_text().splitlines()
                res["proxy_log"] = [ln[:260] for ln in lines
                                    if "compacted its history" in ln or "no longer matches" in ln]
                res["proxy_executed_compress"] = sum("ran=compress" in ln for ln in lines)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
