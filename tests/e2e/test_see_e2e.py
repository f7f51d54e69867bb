"""Seeing what bili does (#12), on a scripted session that folds through a real mitmdump: the log
line per request, ``/__bili/stats`` with money, ``bili stats``, and the page.

The session: the anthropic agent of test_fold_e2e for 12 turns (turn 8 compresses turns 1-4, 11
decompresses b1), usage reported as the real API does (prompt size), and a price file for the
fake model so the money is checked against prices computed here by hand."""

from __future__ import annotations

import json
import os
import re
import uuid

import pytest

from bili_addon import prices

from .support import Mitmdump
from .test_fold_e2e import make_agent, run_bash, session_script

pytestmark = pytest.mark.e2e

TURNS = 12
# $ per million tokens for the fake model (the price file the proxy reads from its data dir)
PRICE = {"provider": "anthropic", "input": 3.0, "cache_write_5m": 3.75, "cache_write_1h": 6.0, "cache_read": 0.3,
         "output": 15.0}
LINE = re.compile(r"bili (\S+) (\S{1,8}) t(\d+) (\w+): (\S+) -> (\S+) tok(?: \(([+-]\d+%)\))?, cache read (\S+) "
                  r"\(reported (\S+)\), (\d+) blocks?(?:, (-?\$[\d.,]+) \(saved (-?\$[\d.,]+)\))?")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def session(fake, tmp_path_factory, request):
    """A proxy with the price file, and one scripted session run through it: (proxy, sid).  Once per
    store backend: the figures live in the store's wire table (SQLite, or a shared PostgreSQL)."""
    options = {"bili_store": request.getfixturevalue("pg_server").fresh()} if request.param == "postgresql" else {}
    proxy = Mitmdump(tmp_path_factory.mktemp("see"), fake.port, options=options)
    proxy.data_dir.mkdir(parents=True)
    (proxy.data_dir / "prices.json").write_text(json.dumps({"as_of": "2026-12-01", "models": {"claude-fake-1": PRICE}}))
    proxy.start()
    status, health = proxy.admin("/__bili/health")
    assert status == 200 and health["store"] is True and health["store_backend"] == request.param, health
    sid = f"e2e-see-{uuid.uuid4().hex[:8]}"
    fake.script(sid, session_script(), real_usage=True)
    agent = make_agent("anthropic", proxy, sid, sid)
    for t in range(1, TURNS + 1):
        agent.step(t, run_bash)
    proxy.agent = agent  # the browser test sends one more turn to see the page follow it
    try:
        yield proxy, sid
    finally:
        proxy.stop()


def turns_of(proxy, sid):
    status, body = proxy.admin(f"/__bili/stats?session={sid}")
    assert status == 200, body
    return body


def wait_turns(proxy, sid, n=TURNS):
    import time

    deadline = time.monotonic() + 10
    while True:
        body = turns_of(proxy, sid)
        if len(body["turns"]) >= n or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def hand_cost(t) -> tuple[float, float]:
    uncached = t["input_tokens"] - t["cache_read"] - t["cache_write"]
    cost = (uncached * PRICE["input"] + t["cache_write"] * PRICE["cache_write_5m"] + t["cache_read"] * PRICE["cache_read"]
            + t["output_tokens"] * PRICE["output"]) / 1e6
    if t["agent_tokens"] >= t["sent_tokens"]:  # what bili took off, as cache reads
        saved = (t["agent_tokens"] - t["sent_tokens"]) * PRICE["cache_read"] / 1e6
    else:  # what it added, where the turn paid the most for its tokens: negative
        long, short, plain, read = prices.added_where(t["sent_tokens"] - t["agent_tokens"], t["input_tokens"],
                                                      t["cache_read"], t["cache_write"], 0)
        saved = -(short * PRICE["cache_write_5m"] + plain * PRICE["input"] + read * PRICE["cache_read"]) / 1e6
    return cost, saved


def test_stats_per_turn_and_money(session):
    proxy, sid = session
    body = wait_turns(proxy, sid)
    turns = body["turns"]
    assert [t["n"] for t in turns] == list(range(1, TURNS + 1))
    assert [t["request"] for t in turns] == list(range(1, TURNS + 1))
    assert all(t["model"] == "claude-fake-1" for t in turns)
    # before the fold bili sends more than the agent did (its tags, tools and prompt); after, less
    assert turns[8]["blocks"] == 1 and turns[7]["blocks"] == 0
    assert all(t["sent_tokens"] > t["agent_tokens"] for t in turns[:8])
    assert turns[8]["sent_tokens"] < turns[8]["agent_tokens"] and turns[8]["sent_tokens"] < turns[7]["sent_tokens"]
    # whole bodies: what bili sent is near what the provider counted (the fake: its JSON's bytes // 4)
    assert all(0.7 < t["sent_tokens"] / t["input_tokens"] < 1.3 for t in turns)
    assert "compress" in turns[8]["executed"] and "decompress" in turns[11]["executed"]
    for t in turns:
        cost, saved = hand_cost(t)
        assert t["cost"] == pytest.approx(cost, abs=1e-6) and t["saved"] == pytest.approx(saved, abs=1e-6)
    # turn 1 by hand: fake usage = the prompt's JSON bytes // 4 input tokens, 7 output
    t1 = turns[0]
    assert t1["cost"] == pytest.approx(t1["input_tokens"] * 3e-6 + 7 * 15e-6, abs=1e-6)
    # the prediction: turn 2 repeats turn 1's request from the start, mostly
    assert turns[0]["predicted"] is None and 0.5 < turns[1]["predicted"] <= 1
    w = body["session"]["wire"]
    assert w["turns"] == TURNS and w["priced"]
    assert w["cost"] == pytest.approx(sum(hand_cost(t)[0] for t in turns), abs=1e-5)
    assert w["saved"] == pytest.approx(sum(hand_cost(t)[1] for t in turns), abs=1e-5)
    assert w["agent_now"] == turns[-1]["agent_tokens"] and w["sent_now"] == turns[-1]["sent_tokens"]
    assert w["agent_peak"] == max(t["agent_tokens"] for t in turns)
    assert body["session"]["usage"]["input_tokens"] == sum(t["input_tokens"] for t in turns)
    status, missing = proxy.admin("/__bili/stats?session=no-such-session")
    assert status == 404


def test_a_log_line_per_answered_request(session):
    from bili_addon import prices
    from bili_addon.meter import pct, tokens

    proxy, sid = session
    turns = wait_turns(proxy, sid)["turns"]
    lines = [m for m in map(LINE.search, proxy.log().splitlines()) if m and sid.startswith(m.group(2))]
    assert len(lines) == TURNS, proxy.log_tail(40)
    for m, t in zip(lines, turns):
        assert m.group(2) == sid[:8] and int(m.group(3)) == t["request"] and m.group(4) == "anthropic"
        assert (m.group(5), m.group(6)) == (tokens(t["agent_tokens"]), tokens(t["sent_tokens"]))
        assert m.group(8) == pct(t["predicted"]) and m.group(9) == pct(t["reported"])
        assert int(m.group(10)) == t["blocks"]
        assert (m.group(11), m.group(12)) == (prices.money(t["cost"]), prices.money(t["saved"]))
    folded = lines[8]
    assert folded.group(7).startswith("-") and folded.group(10) == "1"


def bili_cli(proxy, *args: str) -> str:
    import subprocess
    import sys

    from .support import clean_env

    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", *args, "--proxy", proxy.url, "--data-dir",
                          str(proxy.bili_data_dir)], capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bili_stats_equals_the_store(session):
    from bili_addon import prices
    from bili_addon.meter import tokens

    proxy, sid = session
    body = wait_turns(proxy, sid)
    w = body["session"]["wire"]
    table = bili_cli(proxy, "stats")
    assert all(len(ln) <= 80 for ln in table.splitlines()), table
    row = [ln for ln in table.splitlines() if ln.startswith(sid[:10])]
    assert len(row) == 1, table
    cells = row[0].split()
    assert cells[1] == "python-sdk" and cells[2] == "anthropic" and int(cells[3]) == TURNS
    assert cells[4] == f"{tokens(w['agent_now'])}->{tokens(w['sent_now'])}"
    assert cells[6] == str(body["session"]["fold"]["blocks"])
    assert cells[7] == prices.money(w["cost"]) and cells[8] == prices.money(w["saved"])
    assert "2026-12-01" in table

    one = bili_cli(proxy, "stats", "--session", sid)
    assert all(len(ln) <= 80 for ln in one.splitlines()), one
    assert f"cost {prices.money(w['cost'])}, saved {prices.money(w['saved'])}" in one
    rows = [ln.split() for ln in one.splitlines() if re.match(r"\s*\d+\s+\d+\s", ln)]
    assert len(rows) == TURNS
    for cells, t in zip(rows, body["turns"]):
        assert cells[:4] == [str(t["n"]), str(t["request"]), tokens(t["agent_tokens"]), tokens(t["sent_tokens"])]
        assert cells[10] == prices.money(t["cost"])
    assert rows[7][-1] == "compress" or "compress" in rows[8][-1]

    doc = json.loads(bili_cli(proxy, "stats", "--json", "--session", sid))
    assert doc["turns"] == body["turns"] and doc["session"]["wire"] == w


def test_bili_stats_without_the_token_says_why(session, tmp_path):
    import subprocess
    import sys

    from .support import clean_env

    proxy, _ = session
    out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "stats", "--proxy", proxy.url, "--data-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 1 and "403" in out.stderr and "admin token" in out.stderr


# -- the page in a real headless Chromium (last: it adds a turn) ----------------------------------------
def page_code(proxy) -> str:
    status, body = proxy.admin("/__bili/page/code", method="POST")
    assert status == 200, body
    return body["code"]


def test_the_page_refuses_without_sign_in(session):
    from .support import request

    proxy, sid = session
    for path in (f"/__bili/page/session?session={sid}", "/__bili/stats", f"/__bili/page/block?session={sid}&id=b1"):
        assert request(proxy.url + path).status == 403
    page = request(proxy.url + "/__bili/")  # the page holds no data: it needs no sign-in, its data does
    assert page.status == 200 and b"<title>bili</title>" in page.body and sid.encode() not in page.body
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    code = page_code(proxy)
    sign_in = json.dumps({"code": code}).encode()
    first = request(proxy.url + "/__bili/page/sign-in", sign_in, headers={"content-type": "application/json"})
    assert first.status == 200 and "set-cookie" not in first.headers, first.body
    again = request(proxy.url + "/__bili/page/sign-in", sign_in, headers={"content-type": "application/json"})
    assert again.status == 403, "a code signs in once"
    jar = {"x-bili-page": json.loads(first.body)["token"]}
    assert request(proxy.url + f"/__bili/page/session?session={sid}", headers=jar).status == 200
    # the token opens the page's read-only data, never the tool endpoint
    assert request(proxy.url + "/__bili/plugin/tool", b"{}", method="POST", headers=jar).status == 403
    assert proxy.token.encode() not in page.body


class Neighbour:
    """Another local user's web server on another port of 127.0.0.1: what the browser sends it."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = (b"<!doctype html><title>elsewhere</title><script>fetch('/__bili/stats').then(() => "
                        b"{ document.title = 'asked:' + sessionStorage.length + ':' + document.cookie; });</script>"
                        if self.path == "/" else b"{}")
                self.send_response(200)
                self.send_header("content-type", "text/html" if self.path == "/" else "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_pages_sign_in_stays_on_its_port(session, tmp_path):
    """A browser keeps cookies per host, not per port (RFC 6265, section 8.5): the page's cookie went
    to any server on 127.0.0.1 the user opened, and, replayed on bili's port, read every session's
    originals.  The page token is in the tab's sessionStorage, which is the origin's (port included)."""
    from .browser import Browser, find_chromium

    binary, why = find_chromium()
    if binary is None:
        pytest.skip(why)
    proxy, sid = session
    other = Neighbour()
    b = Browser(binary, tmp_path)
    try:
        url = bili_cli(proxy, "page").strip()
        b.goto(url)
        b.wait(f"document.body && document.body.dataset.loaded === '1' && "
               f"!!document.querySelector('tr.s[data-id=\"{sid}\"]')")
        assert b.js("location.href") == proxy.url + "/__bili/", "the code leaves the address bar"
        token = b.js("sessionStorage.getItem('bili-page-token')")
        b.goto(other.url + "/")  # later, the same browser opens a page another user serves on 127.0.0.1
        assert b.wait("document.title.startsWith('asked:') && document.title") == "asked:0:"
        assert {"/", "/__bili/stats"} <= {p for p, _ in other.seen}
        for path, headers in other.seen:
            assert "cookie" not in headers and "x-bili-page" not in headers, (path, headers)
            assert not token or token not in json.dumps(headers), (path, headers)
        assert token and b.cmd("Storage.getCookies")["cookies"] == [], "the sign-in sets no cookie"
        # and back on bili's origin the tab is still signed in (a reload keeps it, no new code needed)
        b.goto(proxy.url + "/__bili/")
        b.wait(f"document.body.dataset.loaded === '1' && !!document.querySelector('tr.s[data-id=\"{sid}\"]')")
        b.pump(0.3)
        assert b.errors == []
    finally:
        b.close()
        other.close()


def test_a_new_link_in_the_same_tab_signs_the_page_in_again(session, tmp_path):
    """Signed out (the proxy restarted, the sign-in expired), the user pastes the new link `bili page`
    prints into the same tab: only the address's fragment changes (no new document), and the page
    trades that code too."""
    from .browser import Browser, find_chromium

    binary, why = find_chromium()
    if binary is None:
        pytest.skip(why)
    proxy, sid = session
    b = Browser(binary, tmp_path)
    try:
        b.goto(bili_cli(proxy, "page").strip())
        b.wait(f"document.body && document.body.dataset.loaded === '1' && "
               f"!!document.querySelector('tr.s[data-id=\"{sid}\"]')")
        b.js("sessionStorage.clear()")  # signed out
        url = bili_cli(proxy, "page").strip()
        b.js(f"location.href = {json.dumps(url)}")  # (the same document: a fragment navigation)
        b.wait("!!sessionStorage.getItem('bili-page-token') && location.hash === ''")
        b.wait(f"!!document.querySelector('tr.s[data-id=\"{sid}\"]')")
        b.pump(0.3)
        assert b.errors == []
    finally:
        b.close()


def test_bili_page_open_keeps_the_code_off_every_command_line(session, tmp_path):
    """``bili page --open`` gave the browser the URL with its one-time code as an argument: any local
    user read it in /proc/PID/cmdline while the browser started, redeemed it first and had the page.
    The browser is given a file instead that only this user reads and that sends it on (here a program
    that does what the file and the page tell a browser to do); the file's folder is gone once the
    code is used."""
    import subprocess
    import sys
    import threading
    import time

    from .support import clean_env, request

    proxy, sid = session
    seen: set[bytes] = set()  # every command line and environment on the machine while `bili page --open` runs
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                for part in ("cmdline", "environ") if pid.isdigit() else ():
                    try:
                        with open(f"/proc/{pid}/{part}", "rb") as f:
                            seen.add(f.read())
                    except OSError:
                        pass
            time.sleep(0.002)

    given = tmp_path / "given"
    # the browser: what the file tells one to do (its refresh to the sign-in URL, then what the page's
    # script does with the code in its fragment: trade it for a token, read the sessions with it); the
    # page itself signing in from that URL in Chromium is test_a_new_link_in_the_same_tab_signs_the_page_in_again's
    (tmp_path / "browse.py").write_text(r"""
import json, re, sys, urllib.request
html = open(sys.argv[1]).read()
url = re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', html).group(1)
base, code = url.split("/__bili/", 1)[0], url.split("#code=", 1)[1]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request(base + "/__bili/page/sign-in", data=json.dumps({"code": code}).encode(),
                             headers={"content-type": "application/json"})
token = json.load(opener.open(req, timeout=30))["token"]
stats = opener.open(urllib.request.Request(base + "/__bili/stats", headers={"x-bili-page": token}), timeout=30)
print(json.dumps([s["id"] for s in json.load(stats)["sessions"]]))
""")
    browser = tmp_path / "browser.sh"
    browser.write_text(f"""#!/bin/sh
f="${{1#file://}}"
stat -c '%a %u %n' "$f" "$(dirname "$f")" > {given}
exec {sys.executable} {tmp_path}/browse.py "$f" > {tmp_path}/seen.json
""")
    browser.chmod(0o755)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = subprocess.run([sys.executable, "-m", "bili_addon.cli", "page", "--open", "--proxy", proxy.url,
                              "--data-dir", str(proxy.bili_data_dir)], capture_output=True, text=True, timeout=120,
                             env=clean_env(BROWSER=f"{browser} %s"))
    finally:
        stop.set()
        watcher.join()
    assert out.returncode == 0, out.stderr
    code = out.stdout.strip().split("#code=", 1)[1]
    assert len(code) >= 32 and len(seen) > 10
    assert not [blob for blob in seen if code.encode() in blob], "the code was on a command line"
    (file_mode, file_uid, file), (dir_mode, dir_uid, folder) = (ln.split() for ln in given.read_text().splitlines())
    assert (file_mode, dir_mode) == ("600", "700") and file_uid == dir_uid == str(os.getuid())
    assert code not in file and not os.path.exists(folder), "the file goes once the code is used"
    # the browser signed in through the file: it reads the sessions (written once it has them: `bili page`
    # returns when the code is used), and the code is used up
    seen_json = tmp_path / "seen.json"
    for _ in range(300):
        if seen_json.exists() and seen_json.read_text().strip():
            break
        time.sleep(0.1)
    assert sid in json.loads(seen_json.read_text())
    again = request(proxy.url + "/__bili/page/sign-in", json.dumps({"code": code}).encode())
    assert again.status == 403


def test_the_page_in_chromium(session, tmp_path):
    import shutil

    from bili_addon import prices
    from bili_addon.meter import tokens

    from .browser import Browser, find_chromium

    binary, why = find_chromium()
    if binary is None:
        pytest.skip(why)
    proxy, sid = session
    stats = wait_turns(proxy, sid)
    w = stats["session"]["wire"]
    out = tmp_path / "screens"
    out.mkdir()
    b = Browser(binary, tmp_path)
    try:
        url = bili_cli(proxy, "page").strip()  # what a user opens: a one-time code, never the token
        assert url.startswith(proxy.url + "/__bili/#code=") and proxy.token not in url
        b.goto(url)
        b.wait("document.body && document.body.dataset.loaded === '1' && location.hash === ''")
        row = b.wait(f"""(() => {{ const r = document.querySelector('tr.s[data-id="{sid}"]'); if (!r) return null;
            const v = {{}}; for (const td of r.cells) if (td.classList.length) v[td.classList[td.classList.length - 1]] =
            [td.dataset.v, td.textContent]; return v; }})()""")
        assert row["requests"][0] == str(stats["session"]["requests"])
        assert row["now"] == [str(w["sent_now"]), f"{tokens(w['agent_now'])} → {tokens(w['sent_now'])}"]
        assert row["blocks"][0] == str(stats["session"]["fold"]["blocks"])
        assert row["folded"][0] == str(stats["session"]["fold"]["tokens_folded"])
        assert row["cost"] == [str(w["cost"]), prices.money(w["cost"])]
        assert row["saved"][1] == prices.money(w["saved"])
        assert float(row["read"][0] or 0) == (w["reported"] or 0)
        b.js("document.getElementById('filter').value = 'no-such-thing'; "
             "document.getElementById('filter').dispatchEvent(new Event('input'))")
        assert b.js(f"!document.querySelector('tr.s[data-id=\"{sid}\"]')")
        b.js("document.getElementById('filter').value = ''; document.getElementById('filter').dispatchEvent(new Event('input'))")
        b.screenshot(out / "sessions.png")

        b.js(f"document.querySelector('tr.s[data-id=\"{sid}\"]').click()")
        b.wait("document.body.dataset.loaded === '1' && document.querySelectorAll('#turnchart circle.pt.sent').length > 0")
        assert b.js("document.querySelectorAll('#turnchart circle.pt.sent').length") == TURNS
        assert b.js("document.querySelectorAll('#turnchart circle.pt.agent').length") == TURNS
        assert b.js("[...document.querySelectorAll('#turnchart circle.pt.sent')].map(c => +c.dataset.v)") == \
            [t["sent_tokens"] for t in stats["turns"]]
        assert b.js("document.querySelectorAll('#turnchart line.fold').length") == 1
        assert b.js("document.querySelectorAll('#turns tbody tr').length") == TURNS
        # the cache model against the provider's reports: a row per answered request, and the summary line
        assert b.js("[...document.querySelectorAll('#calibration tbody tr')].map(r => +r.dataset.n)") == \
            [r["n"] for r in stats["calibration"]] and len(stats["calibration"]) == TURNS
        assert float(b.js("document.getElementById('calib').dataset.agree")) == stats["session"]["calibration"]["agree"]
        assert "answers. In force:" in b.js("document.getElementById('calib').textContent")
        # expanding b1 shows what decompress would: the folded turns' original tool output
        b.js("document.querySelector('.block[data-id=\"b1\"] button.expand').click()")
        text = b.wait("(() => { const p = document.querySelector('.block[data-id=\"b1\"] pre.original'); "
                      "return p && !p.classList.contains('hidden') && p.textContent; })()")
        assert "file-1-row-0:" in text and "file-4-row-49:" in text and "file-5-row-" not in text
        # the search box runs search_context over the folded parts
        b.js("document.getElementById('q').value = 'file-3-row-7'; "
             "document.getElementById('searchform').requestSubmit()")
        found = b.wait("document.getElementById('results').dataset.q === 'file-3-row-7' && "
                       "document.getElementById('results').textContent")
        assert found.startswith('Matches for "file-3-row-7"') and "file-3-row-7" in found and "(inside b1)" in found
        b.screenshot(out / "session.png")

        # the page follows the session live: one more turn shows up without a reload
        proxy.agent.step(TURNS + 1, run_bash)
        b.wait(f"document.querySelectorAll('#turnchart circle.pt.sent').length === {TURNS + 1}", timeout=20)
        assert b.js("document.querySelector('.block[data-id=\"b1\"] pre.original').classList.contains('hidden')") is False
        b.pump(0.5)
        assert b.errors == []
    finally:
        b.close()
        keep = os.environ.get("BILI_SCREENSHOTS")
        if keep:
            shutil.copytree(out, keep, dirs_exist_ok=True)
