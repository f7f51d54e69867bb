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

from acceptance.marathon_model import TASK, MarathonModel  # noqa: E402

VERSIONS = {"claude": "2.1.197", "codex": "0.171.0", "pi": "0.73.1"}


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
