"""Hardening through a real mitmdump: the model cannot make the proxy write outside bili's data
directory, other users (and this user's clients without the token) cannot use the admin endpoints,
and the store is private whatever the umask."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from .fake_upstream import proxy_call, say
from .support import AGENTS, request
from .test_fold_e2e import TASK, Turns, fold, reading, run_bash

pytestmark = pytest.mark.e2e

VICTIM_TEXT = "# the user's own shell profile\nexport PATH=$HOME/bin:$PATH\n"


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(scope="module")
def proxy(make_proxy):
    old = os.umask(0o022)  # the usual umask: what mkdir and sqlite would give is world-readable
    try:
        return make_proxy("reverse", "fold")
    finally:
        os.umask(old)


def test_to_file_never_leaves_the_data_dir(fake, proxy, sid, tmp_path):
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    inside = proxy.data_dir / "exports" / "chosen-by-the-model.txt"
    acts = [reading(t) for t in range(1, 6)]
    acts += [
        proxy_call("compress", fold(1, 4, 1), prose="Turn 6: folding modules 1 to 4."),
        proxy_call("decompress", {"blockId": "b1", "full": True, "toFile": str(victim)},
                   prose="Turn 7: writing b1 out."),
        proxy_call("decompress", {"blockId": "b1", "toFile": str(inside)}, prose="Turn 8: again."),
        proxy_call("decompress", {"blockId": "b1", "toFile": True}, prose="Turn 9: into bili's folder."),
        say("Turn 10: done."),
    ]
    fake.script(sid, acts)
    agent = AGENTS["anthropic"](proxy.url, sid, sid, TASK, stream=True)
    up = Turns(fake, sid)
    for t in range(1, 11):
        agent.step(t, run_bash)
        up[t]

    # turn 8 carries the result of turn 7's call: refused, said to the model, nothing written
    _, refused = agent.result_of(up[8].json, agent.answers[7].call)
    assert refused.startswith("decompress refused toFile="), refused
    assert "never writes to a path you name" in refused and "Nothing was written" in refused
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in victim.parent.iterdir()) == [".bashrc"]  # no temp file left either
    # a path inside the data dir is still the model's path: refused too
    _, refused = agent.result_of(up[9].json, agent.answers[8].call)
    assert refused.startswith("decompress refused toFile="), refused
    assert not inside.exists()

    # toFile=true: bili picks the file, in this session's export folder, and says where
    _, wrote = agent.result_of(up[10].json, agent.answers[9].call)
    assert wrote.startswith("Wrote b1's original messages"), wrote
    path = Path(wrote.rsplit(" to ", 1)[1].rstrip("."))
    assert path.parent.parent == proxy.data_dir / "exports" and path.name == "b1.txt"
    assert "file-2-row-7" in path.read_text()
    assert mode(path) == 0o600 and mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700


def test_admin_needs_the_token(fake, proxy, sid):
    agent = AGENTS["anthropic"](proxy.url, sid, sid, TASK, stream=False)
    fake.script(sid, [say("Turn 1: hello.")])
    agent.step(1, run_bash)
    call = json.dumps({"conversationId": sid, "tool": "search_context", "args": {"query": "audit"}}).encode()

    # health stays open, and says whether the caller is this install
    status, health = proxy.admin("/__bili/health", token=False)
    assert status == 200 and health["ok"] is True and health["authenticated"] is False
    assert proxy.admin("/__bili/health")[1]["authenticated"] is True

    # same uid, loopback, no token (or a wrong one): 403 on everything else, nothing leaks
    for path, method, body in (("/__bili/stats", "GET", None), ("/__bili/plugin/manifest", "GET", None),
                               ("/__bili/plugin/tool", "POST", call)):
        for headers in ({}, {"x-bili-token": "not-the-token"}, {"authorization": "Bearer not-the-token"}):
            reply = request(proxy.url + path, body, method=method, headers=headers)
            assert reply.status == 403, (path, headers, reply.body)
            assert sid.encode() not in reply.body
    # with the token: answered
    status, stats = proxy.admin("/__bili/stats")
    assert status == 200 and sid in [s["id"] for s in stats["sessions"]]
    status, doc = proxy.admin("/__bili/plugin/tool", "POST", body=call)
    assert status == 200 and doc["ok"] is True, doc
    assert "refused GET /__bili/stats: no valid admin token" in proxy.log()


NOBODY_CLIENT = r"""
import json, sys, urllib.error, urllib.request
url, token_file, body = sys.argv[1], sys.argv[2], sys.argv[3].encode()
out = {}
try:
    open(token_file).read()
    out["token_read"] = True
except OSError as e:
    out["token_read"] = type(e).__name__
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for path, data in (("/__bili/health", None), ("/__bili/stats", None), ("/__bili/plugin/tool", body)):
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with opener.open(req, timeout=20) as r:
            out[path] = [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        out[path] = [e.code, e.read().decode()]
print(json.dumps(out))
"""


def test_another_uid_gets_403(fake, proxy, sid):
    """A second local user on loopback (``nobody``, through setpriv) gets health and nothing else."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.getuid() != 0 or setpriv is None or not os.path.exists(python):
        pytest.skip("needs root, setpriv and a system python3 to run a client as nobody")
    agent = AGENTS["anthropic"](proxy.url, sid, sid, TASK, stream=False)
    fake.script(sid, [say("Turn 1: a secret plan.")])
    agent.step(1, run_bash)
    call = json.dumps({"conversationId": sid, "tool": "search_context", "args": {"query": "secret"}})
    run = subprocess.run(
        [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", python, "-I", "-c", NOBODY_CLIENT,
         proxy.url, str(proxy.data_dir / "admin-token"), call],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["token_read"] == "PermissionError"
    assert out["/__bili/health"][0] == 200
    for path in ("/__bili/stats", "/__bili/plugin/tool"):
        status, body = out[path]
        assert status == 403 and "admin token" in body and sid not in body, (path, body)


def test_fresh_store_is_private_and_an_old_one_is_tightened(proxy):
    """Under umask 022: the data dir 0700, the store, its WAL files and the token 0600; a store
    left world-readable by an older bili is tightened at start, with a log line."""
    data = proxy.data_dir
    assert mode(data) == 0o700
    for name in ("bili.sqlite3", "bili.sqlite3-wal", "bili.sqlite3-shm", "admin-token"):
        if (data / name).exists() or name == "bili.sqlite3":
            assert mode(data / name) == 0o600, name
    proxy.stop()
    os.chmod(data, 0o755)
    for name in ("bili.sqlite3", "admin-token"):
        os.chmod(data / name, 0o644)
    old = os.umask(0o022)
    try:
        proxy.start()
    finally:
        os.umask(old)
    assert mode(data) == 0o700 and mode(data / "bili.sqlite3") == 0o600 and mode(data / "admin-token") == 0o600
    log = proxy.log()
    assert f"{data} was readable by other users; now 0700" in log
    assert f"{data / 'bili.sqlite3'} was readable by other users; now 0600" in log
