"""Test-only mitmproxy addon: bili's engine reads the time from a file the test writes (an
injectable clock: the cache model's time runs as the test says, no sleeps).  Load it after the bili
addon; ``--set test_clock_file=PATH`` (the file holds one float, seconds)."""

from __future__ import annotations

from pathlib import Path

from mitmproxy import ctx


class TestClock:
    def load(self, loader) -> None:
        loader.add_option("test_clock_file", str, "", "A file holding the time bili's engine reads (tests only).")

    def running(self) -> None:
        self._patch()

    def request(self, flow) -> None:  # bili may have opened its engine again since
        self._patch()

    def _patch(self) -> None:
        path = ctx.options.test_clock_file
        bili = ctx.master.addons.get("bili")
        eng = bili.keeper.engine if bili is not None else None
        if not path or eng is None or getattr(eng.now, "test_clock", None) == path:
            return

        def now() -> float:
            return float(Path(path).read_text())

        now.test_clock = path
        eng.now = now


addons = [TestClock()]
