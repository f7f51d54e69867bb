"""A real headless Chromium driven over the DevTools protocol (``websockets``, a test extra; no
WebDriver).  Debian's ``chromium`` is installed with apt-get where it is missing and can be; the
tests that need it skip with the reason otherwise."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(install: bool = True) -> tuple[str | None, str]:
    """``(path, why not)``: the browser, installed with apt-get when missing (as root, Debian)."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path, ""
    if not install:
        return None, "no chromium on PATH"
    if not shutil.which("apt-get"):
        return None, "no chromium on PATH and no apt-get to install it"
    if os.geteuid() != 0:
        return None, "no chromium on PATH (install Debian's chromium package; apt-get needs root)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode != 0:
            return None, f"cannot install chromium ({' '.join(cmd)}: {r.stderr.strip()[-300:]})"
    path = shutil.which("chromium")
    return (path, "") if path else (None, "apt-get installed chromium but it is not on PATH")


class Browser:
    """One headless Chromium with one page, driven over CDP."""

    def __init__(self, binary: str, workdir: Path):
        self.profile = workdir / "chromium-profile"
        self.scratch = tempfile.mkdtemp(prefix="bili-cr-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--metrics-recording-only", "--no-proxy-server", "--remote-debugging-port=0",
             "--remote-debugging-address=127.0.0.1", f"--user-data-dir={self.profile}", "--window-size=1280,1000",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            # (its scratch directories, org.chromium.Chromium.*, in one of this browser's own, removed with it,
            # not left behind in /tmp; a short path: its singleton socket's must fit a socket address)
            env={**os.environ, "TMPDIR": self.scratch})
        port = self._port()
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10)
        self.ids = itertools.count(1)
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        for m in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.cmd(m)

    def _port(self) -> int:
        deadline = time.monotonic() + 30
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self.proc.returncode})")
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                return int(m.group(1))
        raise RuntimeError("chromium did not start its DevTools endpoint")

    def _event(self, msg: dict[str, Any]) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            self.errors.append(f"log: {e.get('text')} {e.get('url', '')}")

    def cmd(self, method: str, **params: Any) -> dict[str, Any]:
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def pump(self, seconds: float) -> None:
        """Take in the events that arrive meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._event(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                return

    def js(self, expr: str) -> Any:
        r = self.cmd("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.cmd("Page.navigate", url=url)

    def wait(self, expr: str, timeout: float = 15) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                v = self.js(expr)
            except RuntimeError:
                v = None
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expr}; errors: {self.errors}")
            self.pump(0.1)

    def screenshot(self, path: Path) -> Path:
        import base64

        data = self.cmd("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            shutil.rmtree(self.scratch, ignore_errors=True)
