"""``bili stats``: what the running proxy did, in the terminal.

    bili stats                    every session, newest first (one line each, 80 columns)
    bili stats --session ID       one session: its figures and a row per answered turn
    bili stats --json             the proxy's JSON as it is (``/__bili/stats``), for scripts
    bili stats --watch [SECONDS]  redraw until Ctrl-C

The figures come from the proxy's ``/__bili/stats`` (with the install's admin token, found as
``bili mcp`` finds it).  Also ``bili page``: prints (or opens) the URL of the page at ``/__bili/``
with a one-time sign-in code.  Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from typing import Any

from bili_addon import DEFAULT_HOST, adminclient, default_proxy, printable
from bili_addon.mcp import DEFAULT_PROXY, find_token, normalize_proxy
from bili_addon.meter import pct, tokens
from bili_addon.prices import money

WIDTH = 80


class ProxyError(Exception):
    pass


def fetch(proxy: str, path: str, token: str | None, *, method: str = "GET", timeout: float = 10) -> Any:
    try:
        got = adminclient.call(proxy, path, method=method, token=token, timeout=timeout)
    except adminclient.Unreachable as e:
        raise ProxyError(f"the bili proxy at {proxy} is not reachable: {e.reason} "
                         "(is `bili run` running? --proxy or $BILI_PROXY point elsewhere)") from None
    if got.status >= 400:
        raise ProxyError(f"the proxy at {proxy} answered HTTP {got.status}: {got.error}")
    if got.doc is None:
        raise ProxyError(f"{proxy} answered something that is not bili's JSON: {got.raw[:120]!r}")
    return got.doc


# -- rendering ---------------------------------------------------------------------------------------
def ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "-"
    d = max(0, (now or time.time()) - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= size:
            return f"{d / size:.0f}{unit}"
    return f"{d:.0f}s"


def _saving(w: dict[str, Any]) -> str:
    if not w.get("agent_now"):
        return ""
    return f"{(w['sent_now'] - w['agent_now']) / w['agent_now']:+.0%}"


def facts_text(f: dict[str, Any] | None) -> str:
    """What the calibration learned (or has in force), in words: ``ttl 90s``, ``no cache``, ``min 2.0K``."""
    f = f or {}
    out = []
    if f.get("no_cache"):
        out.append("no cache")
    elif f.get("ttl"):
        out.append(f"ttl {f['ttl']:g}s")
    if f.get("min_tokens"):
        out.append(f"min {tokens(f['min_tokens'])}")
    return ", ".join(out) or "documented rules"


def calibration_line(c: dict[str, Any]) -> str:
    """A session's cache model against its provider: reads predicted and reported, how often the
    read/no-read verdict agreed, and the lifetime in force with its source."""
    eff = c.get("effective") or {}
    src = eff.get("source", "documented")
    return (f"read {tokens(c.get('predicted_read', 0))} pred / {tokens(c.get('reported_read', 0))} rep, "
            f"agree {pct(c.get('agree'))} of {c.get('turns', 0)}; {facts_text(eff)}"
            + (f" ({src})" if src != "documented" else ""))


def sessions_table(doc: dict[str, Any], now: float | None = None) -> str:
    """Every session, one line each, at most 80 columns."""
    rows = doc.get("sessions") or []
    head = (f"{'SESSION':<10} {'AGENT':<10} {'LANE':<9} {'REQS':>4} {'agent->bili':>13} {'READ':>4} "
            f"{'BLK':>3} {'COST':>7} {'SAVED':>7} {'AGO':>4}")
    lines = [head]
    for s in rows:
        w = s.get("wire") or {}
        fold = s.get("fold") or {}
        now_tok = f"{tokens(w.get('agent_now', 0))}->{tokens(w.get('sent_now', 0))}" if w.get("turns") else "-"
        reported = w.get("reported")
        if reported is None:
            reported = (s.get("usage") or {}).get("cache_read_share")
        line = (f"{s['id'][:10]:<10} {(s.get('agent') or '-')[:10]:<10} {(s.get('lane') or '-')[:9]:<9} "
                f"{s.get('requests', 0):>4} {now_tok[:13]:>13} {pct(reported) if reported is not None else '-':>4} "
                f"{fold.get('blocks', 0):>3} {money(w.get('cost')) or '-':>7} {money(w.get('saved')) or '-':>7} "
                f"{ago(s.get('last_seen'), now):>4}")
        lines.append(line[:WIDTH])
    if not rows:
        lines.append("(no sessions yet)")
    calibrated = [s for s in rows if s.get("calibration")]
    if calibrated:
        lines.append("CACHE MODEL vs PROVIDER")
        for s in calibrated:
            lines.append(f"  {s['id'][:10]:<10} {calibration_line(s['calibration'])}"[:WIDTH])
    for h in doc.get("hosts") or []:
        lines.append(f"  host {h['host']} ({h['family']}): {h['observations']} answers, "
                     f"{facts_text(h.get('learned'))}"[:WIDTH])
    status = doc.get("store_status") or {}
    if doc.get("store") is False or status.get("ok") is False:
        lines.append(f"store unusable: {status.get('reason', 'unknown')}")
    p = doc.get("prices") or {}
    if p:
        lines.append(f"prices as of {p.get('as_of')}"[:WIDTH])
        lines.append("SAVED: on the prompt, a lower bound (cuts priced as cache reads, additions at\n"
                     "       their dearest; not the summaries the model writes with bili's tools)")
    return "\n".join(lines)


def session_view(doc: dict[str, Any], now: float | None = None) -> str:
    """One session: its figures, then one row per answered turn (at most 80 columns)."""
    s, turns = doc.get("session") or {}, doc.get("turns") or []
    w, fold, u = s.get("wire") or {}, s.get("fold") or {}, s.get("usage") or {}
    out = [f"session {s.get('id', '?')}  {s.get('agent') or '-'} / {s.get('lane') or '-'} / "
           f"{w.get('model') or '-'}"[:WIDTH],
           f"requests {s.get('requests', 0)}, answered {len(turns)}, last {ago(s.get('last_seen'), now)} ago",
           f"tokens now {tokens(w.get('agent_now', 0))} -> {tokens(w.get('sent_now', 0))} ({_saving(w) or 'n/a'}), "
           f"peak {tokens(w.get('agent_peak', 0))} -> {tokens(w.get('sent_peak', 0))}",
           f"cache read {pct(w.get('reported'))} reported, last predicted {pct(w.get('predicted'))}; "
           f"written {tokens(u.get('cache_write', 0))}",
           f"blocks {fold.get('blocks', 0)} active of {fold.get('blocks_total', 0)}, "
           f"{tokens(fold.get('tokens_folded', 0))} tokens folded, epoch {fold.get('epoch', 1)}"]
    if w.get("priced"):
        out.append(f"cost {money(w.get('cost'))}, saved {money(w.get('saved'))} (on the prompt, a lower bound of it)")
    else:
        out.append("cost: no price for this model (tokens only; add it to prices.json in the data dir)")
    if w.get("cache_write"):  # "unsplit": turns recorded before the split was (schema 9), priced at 5 minutes
        out.append(writes_line(w)[:WIDTH])
    c = s.get("calibration")
    if c:
        out.append(f"cache model: {calibration_line(c)}"[:WIDTH])
    out.append("")
    out.append(f"{'T':>4} {'REQ':>4} {'AGENT':>7} {'SENT':>7} {'READ':>7} {'WRITE':>7} {'OUT':>6} {'PRED':>4} "
               f"{'REP':>4} {'B':>2} {'COST':>7} RAN")
    for t in turns:
        out.append((f"{t['n']:>4} {t['request']:>4} {tokens(t['agent_tokens']):>7} {tokens(t['sent_tokens']):>7} "
                    f"{tokens(t['cache_read']):>7} {tokens(t['cache_write']):>7} {tokens(t['output_tokens']):>6} "
                    f"{pct(t['predicted']):>4} {pct(t['reported']):>4} {t['blocks']:>2} "
                    f"{money(t['cost']) or '-':>7} {','.join((['side'] if t.get('side') else []) + t['executed'])}")[:WIDTH])
    rows = doc.get("calibration") or []
    if rows:
        out.append("")
        out.append("cache model vs provider (tokens: the model's estimate / the provider's count)")
        out.append(f"{'N':>4} {'GAP':>6} {'AGE':>6} {'PRED RD':>8} {'REP RD':>8} {'PRED WR':>8} {'REP WR':>8} VERDICT")
        for r in rows[-20:]:
            out.append((f"{r['n']:>4} {_secs(r['gap']):>6} {_secs(r['age']):>6} {tokens(r['predicted_read']):>8} "
                        f"{tokens(r['reported_read']):>8} {tokens(r['predicted_write']):>8} "
                        f"{'-' if r['reported_write'] is None else tokens(r['reported_write']):>8} "
                        f"{r['verdict']}")[:WIDTH])
    return "\n".join(out)


def writes_line(w: dict[str, Any]) -> str:
    """The cache writes by lifetime (priced at 2x / 1.25x input) and who split them."""
    total, long = w.get("cache_write", 0), w.get("cache_write_1h", 0)
    sp = w.get("write_split") or {}
    said = [f"{t} {tokens(sp[k])}" for k, t in (("reported", "reported"), ("sent", "as sent"), ("none", "unsplit"))
            if sp.get(k)]
    return (f"writes {tokens(total)}: 1 h {tokens(long)}, 5 min {tokens(total - long)}"
            + (f" ({', '.join(said)})" if said else ""))


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}s"


# -- the command ---------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy", metavar="URL", default=None,
                   help=f"the running bili proxy (default: $BILI_PROXY, else {DEFAULT_HOST}:$BILI_PORT, "
                        f"else {DEFAULT_PROXY})")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="the proxy's data directory, where its admin token is (default: $BILI_DATA_DIR, "
                        "else $XDG_DATA_HOME/bili-addon); $BILI_TOKEN overrides the token")


def configure(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--session", metavar="ID", help="one session: its figures and a row per answered turn")
    p.add_argument("--json", action="store_true", help="print the proxy's JSON as it is")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (default 2) until Ctrl-C")


def _target(args: argparse.Namespace) -> tuple[str, str | None, str]:
    proxy = normalize_proxy(args.proxy or default_proxy())
    token, source = find_token(args.data_dir, os.environ)
    return proxy, token, source


def once(args: argparse.Namespace, proxy: str, token: str | None) -> str:
    path = "/__bili/stats" + (f"?session={urllib.parse.quote(args.session)}" if args.session else "")
    doc = fetch(proxy, path, token)
    if args.json:
        return json.dumps(doc, indent=2, ensure_ascii=False)
    return printable(session_view(doc) if args.session else sessions_table(doc), lines=True)


def run(args: argparse.Namespace) -> int:
    proxy, token, source = _target(args)
    if token is None:
        print(f"bili stats: {source}; the proxy will refuse", file=sys.stderr)
    try:
        if args.watch is None:
            print(once(args, proxy, token))
            return 0
        while True:
            text = once(args, proxy, token)
            sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.watch:g}s; Ctrl-C ends)\n")
            sys.stdout.flush()
            time.sleep(max(0.2, args.watch))
    except ProxyError as e:
        print(f"bili: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


# -- bili page -----------------------------------------------------------------------------------------
def configure_page(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--open", action="store_true", help="open the URL in the browser too")


def run_page(args: argparse.Namespace) -> int:
    """Ask the proxy for a one-time sign-in code and print the page's URL carrying it: the page trades
    it for a page token at once and drops it from the address bar (the admin token itself never
    reaches the browser)."""
    proxy, token, source = _target(args)
    if token is None:
        print(f"bili page: {source}; the proxy will refuse", file=sys.stderr)
    try:
        doc = fetch(proxy, "/__bili/page/code", token, method="POST")
    except ProxyError as e:
        print(f"bili: error: {e}", file=sys.stderr)
        return 1
    url = f"{proxy}/__bili/#code={doc['code']}"
    ttl = float(doc.get("ttl", 60))
    print(url)
    print(f"(a one-time code, valid {ttl:g}s)", file=sys.stderr)
    if args.open:
        return open_page(url, lambda: _pending(proxy, token, doc.get("id")), ttl)
    return 0


REDIRECT = """<!doctype html>
<meta charset="utf-8"><meta name="referrer" content="no-referrer"><title>bili</title>
<meta http-equiv="refresh" content="0;url={url}">
<p>Opening <a href="{url}">bili's page</a>&hellip;</p>
"""


def open_page(url: str, pending, ttl: float) -> int:
    """Open ``url`` in the browser with its code on no command line: a browser's arguments are in
    ``/proc/PID/cmdline`` for every local user to read, and whoever redeems the code first has the
    page.  The browser is given a file instead, readable by this user alone (0600, in a fresh 0700
    folder), that sends it on to ``url``; the folder goes once the code is used (``pending()`` says
    no) or has expired."""
    import html
    import shutil
    import tempfile
    import webbrowser
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="bili-page-"))
    try:
        fd = os.open(folder / "open.html", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(REDIRECT.format(url=html.escape(url, quote=True)))
        if not webbrowser.open((folder / "open.html").as_uri()):
            print("bili page: no browser could be started: open the URL above", file=sys.stderr)
            return 1
        print("(waiting for the browser to sign in; Ctrl-C stops)", file=sys.stderr)
        deadline = time.monotonic() + ttl
        while time.monotonic() < deadline and pending() is not False:
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pending(proxy: str, token: str | None, cid: str | None) -> bool | None:
    """Is the code still to be used (None: the proxy cannot say)?"""
    if not cid:
        return None
    try:
        return bool(fetch(proxy, f"/__bili/page/code?id={urllib.parse.quote(cid)}", token, timeout=5).get("pending"))
    except ProxyError:
        return None


__all__ = ["configure", "configure_page", "open_page", "run", "run_page", "session_view", "sessions_table"]
