"""The page's gate (unit, in mitmproxy's test context): loopback only, the admin token or the
page's token from a one-time code, and what that token opens."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest
from test_mcp import flow, model_request

from bili_addon import page


def get(bili, path: str, *, peer: str = "127.0.0.1", headers: dict | None = None, method: str = "GET",
        body: bytes = b""):
    f = flow(path, body, method=method, peer=peer, headers=headers or {})
    bili.request(f)
    assert f.response is not None
    return f.response


def new_code(bili) -> str:
    return json.loads(get(bili, "/__bili/page/code", method="POST", headers={"x-bili-token": bili.token}).content)["code"]


def exchange(bili, code: str):
    return get(bili, "/__bili/page/sign-in", method="POST", body=json.dumps({"code": code}).encode())


def sign_in(bili) -> dict:
    code = new_code(bili)
    r = exchange(bili, code)
    assert r.status_code == 200 and "set-cookie" not in r.headers, r.content
    doc = json.loads(r.content)
    assert doc["ttl"] == 12 * 3600
    return {"x-bili-page": doc["token"]}


@pytest.mark.parametrize("peer", ["10.1.2.3", "2001:db8::1"])
def test_non_loopback_is_refused_even_signed_in(bili, peer):
    jar = sign_in(bili)
    for path in ("/__bili/", "/__bili/stats", "/__bili/page/session?session=x"):
        assert get(bili, path, peer=peer, headers={**jar, "x-bili-token": bili.token}).status_code == 403
    assert get(bili, "/__bili/page/code", peer=peer, method="POST",
               headers={"x-bili-token": bili.token}).status_code == 403
    code = new_code(bili)
    assert get(bili, "/__bili/page/sign-in", peer=peer, method="POST",
               body=json.dumps({"code": code}).encode()).status_code == 403


def test_without_token_nothing_but_the_empty_page(bili):
    model_request(bili, "conv-p", "hello there")
    for path in ("/__bili/stats", "/__bili/page/session?session=conv-p", "/__bili/page/block?session=conv-p&id=b1"):
        assert get(bili, path).status_code == 403
        assert get(bili, path, headers={"x-bili-page": "guess"}).status_code == 403
    # the page itself is the package's HTML, the same for everyone: no data, no token in it
    r = get(bili, "/__bili/")
    assert r.status_code == 200 and r.content == page.html() and b"conv-p" not in r.content
    assert get(bili, "/__bili/page/code", method="POST").status_code == 403  # a code needs the token
    for body in (b'{"code": "made-up"}', b"{}", b"not json", b'{"code": 7}', b'{"code": "' + b"x" * 2000 + b'"}'):
        r = get(bili, "/__bili/page/sign-in", method="POST", body=body)
        assert r.status_code == 403 and json.loads(r.content)["ok"] is False, body


def test_the_page_token_opens_the_pages_data_only(bili):
    model_request(bili, "conv-p", "hello there")
    jar = sign_in(bili)
    r = get(bili, "/__bili/", headers=jar)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert bili.token.encode() not in r.content
    # no external assets: nothing loaded from a URL (the only one is the SVG namespace name)
    assert not re.search(rb"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", r.content)
    assert set(re.findall(rb"https?://[^\s\"']+", r.content)) == {b"http://www.w3.org/2000/svg"}
    doc = json.loads(get(bili, "/__bili/page/session?session=conv-p", headers=jar).content)
    assert doc["ok"] and doc["session"]["id"] == "conv-p" and doc["blocks"] == []
    assert get(bili, "/__bili/page/session?session=nope", headers=jar).status_code == 404
    assert json.loads(get(bili, "/__bili/stats", headers=jar).content)["sessions"][0]["id"] == "conv-p"
    # never the tool endpoint, the manifest, or a write
    assert get(bili, "/__bili/plugin/manifest", headers=jar).status_code == 403
    assert get(bili, "/__bili/page/code", method="POST", headers=jar).status_code == 403
    assert get(bili, "/__bili/plugin/tool", method="POST", headers=jar, body=b"{}").status_code == 403
    # a cookie of that value opens nothing (a browser sends a cookie to every port of the host)
    assert get(bili, "/__bili/stats", headers={"cookie": f"bili_page={jar['x-bili-page']}"}).status_code == 403


def test_the_pages_script_runs_by_its_hash_alone(bili):
    """The page token is in the tab's storage, where any script of the page reads it: the policy runs
    the page's one inline script, named by its hash, and nothing else."""
    r = get(bili, "/__bili/")
    csp = r.headers["content-security-policy"]
    scripts = re.findall(rb"<script>(.*?)</script>", r.content, re.S)
    assert len(scripts) == 1 and b"<script" not in r.content.replace(b"<script>", b"", 1)
    digest = base64.b64encode(hashlib.sha256(scripts[0]).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in csp and "unsafe-inline'; img-src" in csp  # (styles only)
    assert "script-src 'unsafe-inline'" not in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"


def test_a_page_token_expires(bili):
    jar = sign_in(bili)
    assert get(bili, "/__bili/stats", headers=jar).status_code == 200
    page.auth(bili).tokens[jar["x-bili-page"]] = 0.0
    assert get(bili, "/__bili/stats", headers=jar).status_code == 403


def test_a_code_is_used_once_and_expires(bili, monkeypatch):
    pa = page.auth(bili)
    code = pa.new_code()
    assert pa.exchange(code) is not None and pa.exchange(code) is None
    late = pa.new_code()
    pa.codes[late] = 0.0  # expired
    assert pa.exchange(late) is None
    used = new_code(bili)
    assert exchange(bili, used).status_code == 200 and exchange(bili, used).status_code == 403


def test_no_api_key_reaches_the_page(bili):
    secret = "sk-ant-api03-SECRET-never-shown"
    f = flow("/v1/messages", json.dumps({"model": "claude-test", "max_tokens": 16, "messages": [
        {"role": "user", "content": "hello there"}]}).encode(),
        headers={"x_acp_session": "conv-k", "x-api-key": secret, "authorization": f"Bearer {secret}"})
    bili.request(f)
    jar = sign_in(bili)
    for path in ("/__bili/", "/__bili/stats", "/__bili/stats?session=conv-k", "/__bili/page/session?session=conv-k",
                 "/__bili/page/search?session=conv-k&q=hello"):
        r = get(bili, path, headers=jar)
        assert r.status_code == 200, (path, r.content)
        assert b"SECRET" not in r.content, path


def test_reading_a_session_on_the_page_never_holds_its_lock(bili, tmp_path):
    """The page's view of one session took the session's lock across processes, and kept it while it
    computed every session's figures: another instance's turn of that session waited, then went by
    unchanged (busy)."""
    from pathlib import Path

    from bili_addon import locks

    model_request(bili, "s0", "conversation 0: please look at the build")
    data = Path(bili.engine.store.path).parent
    other = locks.SessionLocks(data / locks.LOCK_NAME, 0.0)  # another process's view of the locks
    real, could = bili.stats, []

    def stats(eng=None, only=None):
        got = other.hold("s0")
        could.append(got)
        if got:
            other.release()
        return real(eng, only)

    bili.stats = stats
    f = flow("/__bili/page/session?session=s0", method="GET", headers={"x-bili-token": bili.token})
    bili.request(f)
    assert f.response.status_code == 200 and could == [True]


def test_one_sessions_figures_read_that_session_alone(bili, monkeypatch):
    """The page polls its session every two seconds (and `stats?session=`): the figures of every session
    the store holds were made each time, some ten reads each, on the store's worker, where every agent's
    turn waits (~0.8 s behind one poll with 3,000 sessions)."""
    for i in range(6):
        model_request(bili, f"conv-{i}", f"hello there {i}")
    store = bili.engine.store
    read = []
    real = store.usage
    monkeypatch.setattr(store, "usage", lambda sid: read.append(sid) or real(sid))
    headers = {"x-bili-token": bili.token}
    doc = json.loads(get(bili, "/__bili/page/session?session=conv-3", headers=headers).content)
    assert doc["session"]["id"] == "conv-3" and doc["session"]["usage"]["turns"] == 0
    doc = json.loads(get(bili, "/__bili/stats?session=conv-4", headers=headers).content)
    assert doc["session"]["id"] == "conv-4"
    assert read == ["conv-3", "conv-4"]
    assert len(json.loads(get(bili, "/__bili/stats", headers=headers).content)["sessions"]) == 6  # (the list: all)


def test_bili_page_open_asks_whether_its_code_is_used(bili):
    """``bili page --open`` removes the file that carried the code to the browser once the code is used:
    it asks by the code's id (which redeems nothing), with the admin token alone."""
    admin = {"x-bili-token": bili.token}
    doc = json.loads(get(bili, "/__bili/page/code", method="POST", headers=admin).content)
    assert doc["id"] == page.code_id(doc["code"]) and doc["id"] not in doc["code"]
    asked = f"/__bili/page/code?id={doc['id']}"
    assert json.loads(get(bili, asked, headers=admin).content)["pending"] is True
    assert exchange(bili, doc["id"]).status_code == 403  # the id is no code
    jar = {"x-bili-page": json.loads(exchange(bili, doc["code"]).content)["token"]}
    assert json.loads(get(bili, asked, headers=admin).content)["pending"] is False
    assert get(bili, asked, headers=jar).status_code == 403  # the page's token opens no code
    assert get(bili, asked).status_code == 403
    late = page.auth(bili).new_code()
    page.auth(bili).codes[late] = 0.0  # expired
    assert json.loads(get(bili, f"/__bili/page/code?id={page.code_id(late)}", headers=admin).content)["pending"] is False
