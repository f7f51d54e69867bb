"""A sick store never stops or stalls the proxy (#18 items 4-5, #16 item 3), through real mitmdump.

- a data dir that cannot be created: the proxy starts, forwards byte-identical, health says why;
- the store locked by another process: health and another session are answered while the lock is
  held, the locked session's turn goes out unchanged, the lock holder is named, storing resumes;
- a full disk (a small tmpfs) and a read-only mount: the proxy starts, forwards, logs the cause in
  plain words, and resumes storing once there is room / the mount is writable again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from . import conftest
from .support import Mitmdump, strip_tags
from .support import request as http_request

pytestmark = pytest.mark.e2e


class StoreAt(Mitmdump):
    """A proxy whose ``bili_data_dir`` is exactly ``store`` (the fixture does not create it)."""

    def __init__(self, workdir: Path, upstream_port: int, store: Path):
        super().__init__(workdir, upstream_port)
        self.store = store

    @property
    def bili_data_dir(self) -> Path:
        return self.store

    def command(self) -> list[str]:
        cmd = super().command()
        return [f"bili_data_dir={self.store}" if c.startswith("bili_data_dir=") else c for c in cmd]


@pytest.fixture
def proxies(fake, tmp_path):
    started: list[Mitmdump] = []

    def make(store: Path) -> StoreAt:
        p = StoreAt(tmp_path / f"proxy{len(started)}", fake.port, store)
        started.append(p)
        conftest._running.append(p)
        return p.start()

    yield make
    for p in started:
        p.stop()
        conftest._running.remove(p)


def body(*texts: str) -> bytes:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    return json.dumps({"model": "claude-fake-1", "max_tokens": 16, "messages": msgs}).encode()


def send(fake, proxy, sid: str, raw: bytes):
    """One model request; the upstream's record of it."""
    case = uuid.uuid4().hex
    reply = http_request(proxy.url + "/v1/messages", raw, headers={
        "content-type": "application/json", "x-claude-code-session-id": sid, "x-case": case})
    assert reply.status == 200, reply.body
    return fake.last(lambda r: r.header("x-case") == case)


def tagged(rec) -> int:
    return len(strip_tags(rec.json)[1])


def health(proxy) -> dict:
    return proxy.health()


def wait_until(pred, timeout: float = 20.0, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        out = pred()
        if out or time.monotonic() > deadline:
            return out
        time.sleep(step)


def assert_no_error_lines(proxy) -> None:
    log = proxy.log()
    assert "Error logged during startup" not in log
    assert "cannot rollback" not in log and "Traceback" not in log, proxy.log_tail()


# -- a data dir that cannot be created --------------------------------------------------------------


def test_a_data_dir_that_cannot_be_created_leaves_the_proxy_serving(fake, proxies, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proxy = proxies(blocker / "data")
    h = health(proxy)
    assert h["ok"] is True and h["store"] is False
    assert "not a directory" in h["store_error"] and h["store_hint"], h
    raw = body("A question while the store cannot be opened.")
    rec = send(fake, proxy, "no-store", raw)
    assert rec.raw == raw  # byte-identical
    assert "[bili] cannot open the store" in proxy.log()
    assert_no_error_lines(proxy)
    assert proxy.running


# -- a data dir another user made first ------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory: made as root (chown)")
def test_a_data_dir_another_user_made_is_not_used(fake, proxies, tmp_path):
    """--data-dir in a shared place someone reached first, with a token they know and a store file
    anyone may write: the proxy serves (requests pass through), stores nothing there, trusts not
    their token, and health says why, naming the owner."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    data = shared / "bili"
    old = os.umask(0)
    try:
        data.mkdir(mode=0o777)
        (data / "admin-token").write_text("planted-token\n")
        (data / "bili.sqlite3").write_bytes(b"")
    finally:
        os.umask(old)
    for p in (data, data / "admin-token", data / "bili.sqlite3"):
        os.chown(p, 65534, 65534)
    proxy = proxies(data)
    h = health(proxy)
    assert h["ok"] is True and h["store"] is False and h["store_cause"] == "not private", h
    assert f"{data} belongs to nobody (uid 65534)" in h["store_error"], h
    assert f"{data} belongs to nobody (uid 65534)" in h["token_error"], h
    raw = body("A secret the other user must not read: hunter2.")
    assert send(fake, proxy, "planted", raw).raw == raw  # byte-identical
    status, _ = proxy.admin("/__bili/stats")  # (with the planted token)
    assert proxy.token == "planted-token" and status == 403
    assert sorted(os.listdir(data)) == ["admin-token", "bili.sqlite3"] and (data / "bili.sqlite3").read_bytes() == b""
    assert f"[bili] cannot open the store at {data / 'bili.sqlite3'}" in proxy.log()
    assert_no_error_lines(proxy)


# -- a store locked by another process --------------------------------------------------------------

LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


def test_a_locked_store_stalls_no_flow_and_storing_resumes(fake, proxies, tmp_path):
    proxy = proxies(tmp_path / "data")
    first = body("Locked-store conversation, first question.")
    assert tagged(send(fake, proxy, "locked-a", first)) == 1
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path / "data" / "bili.sqlite3")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        # the locked session's next turn (it must write new refs) and, meanwhile, health
        raw = body("Locked-store conversation, first question.", "An answer.", "A second question.")
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("rec", send(fake, proxy, "locked-a", raw)))
        t.start()
        h_during = health(proxy)
        t.join(30)
        # its request goes at once, tagged; its write follows it (bili's write-behind) and fails
        assert tagged(out["rec"]) == 3, "the locked session's turn goes out as computed"
        other = body("Another session's question while the store is locked.")
        assert send(fake, proxy, "locked-b", other).raw == other
        h = health(proxy)
        assert locker.poll() is None, "all of it was answered while the lock was held"
        assert h_during["ok"] is True
        assert h["store"] is False and h["store_cause"] == "locked", h
        assert f"PID {locker.pid}" in h["store_error"], h
        stats = proxy.stats()["store_status"]
        assert stats["forwarded_unchanged"] >= 1 and stats["writes_dropped"] >= 1, stats
    finally:
        locker.stdin.close()
        locker.wait(10)
    # the lock is gone: storing resumes by itself
    again = body("Locked-store conversation, first question.", "An answer.", "A second question.",
                 "Another answer.", "A third question.")
    assert wait_until(lambda: tagged(send(fake, proxy, "locked-a", again)) == 5)
    assert health(proxy)["store"] is True
    assert "is usable again" in proxy.log()
    assert_no_error_lines(proxy)


# -- a full disk and a read-only mount (root: a small tmpfs) ------------------------------------------


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MiB tmpfs of the test's own (skipped where mounting is not permitted)."""
    where = tmp_path / "mnt"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        _mount("-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(where))
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"mount is not permitted here: {getattr(e, 'stderr', e)}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where: Path) -> Path:
    """Fill the file system under ``where``; returns the filler (delete it to free the space)."""
    filler = where / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_at_start_and_during_a_session(fake, proxies, tmpfs):
    filler = fill(tmpfs)
    proxy = proxies(tmpfs / "data")  # the store cannot even be created
    h = health(proxy)
    assert h["store"] is False and h["store_cause"] == "disk full", h
    raw = body("A question while the disk is full.")
    assert send(fake, proxy, "full", raw).raw == raw
    assert "the disk is full" in proxy.log() and "free some space" in proxy.log()

    filler.unlink()  # room again: bili resumes by itself
    assert wait_until(lambda: tagged(send(fake, proxy, "full", raw)) == 1)
    assert health(proxy)["store"] is True

    # full again during the session: a turn that needs room goes out unchanged, the cause is named
    filler = fill(tmpfs)
    big = body("A question while the disk is full.", "An answer.", "x " * 300_000)
    assert wait_until(lambda: send(fake, proxy, "full", big).raw == big)
    h = health(proxy)
    assert h["store"] is False and h["store_cause"] == "disk full", h
    assert_no_error_lines(proxy)

    filler.unlink()
    assert wait_until(lambda: tagged(send(fake, proxy, "full", big)) == 3)
    assert health(proxy)["store"] is True
    assert proxy.log().count("is usable again") == 2


def test_a_read_only_mount(fake, proxies, tmpfs):
    (tmpfs / "data").mkdir()
    _mount("-o", "remount,ro", str(tmpfs))
    proxy = proxies(tmpfs / "data")
    h = health(proxy)
    assert h["store"] is False and h["store_cause"] == "read-only", h
    raw = body("A question while the store is read-only.")
    assert send(fake, proxy, "ro", raw).raw == raw
    assert "read-only" in proxy.log()

    _mount("-o", "remount,rw", str(tmpfs))
    assert wait_until(lambda: tagged(send(fake, proxy, "ro", raw)) == 1)
    assert health(proxy)["store"] is True
    assert_no_error_lines(proxy)
