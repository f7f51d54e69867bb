"""Fixtures of the end-to-end suite: one fake upstream for the whole run, mitmdump subprocesses per
module (tests inside a module share them and keep apart by using their own session ids)."""

from __future__ import annotations

import re
import uuid

import pytest

from .fake_upstream import FakeUpstream
from .support import MITMDUMP, Mitmdump

_running: list[Mitmdump] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        for p in _running:
            report.sections.append((f"mitmdump {p.workdir.name} (log tail)", p.log_tail(60)))


@pytest.fixture(scope="session")
def fake():
    if not MITMDUMP.exists():
        pytest.skip(f"mitmdump not found next to the interpreter ({MITMDUMP})")
    f = FakeUpstream().start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def make_proxy(fake, tmp_path_factory, request):
    """``make_proxy(kind="reverse"|"forward", bili_mode="fold"|"observe"|"passthrough", **options)`` -> a
    started :class:`Mitmdump` (``options`` become ``--set name=value``), stopped when the module is done."""
    started: list[Mitmdump] = []
    module = request.module.__name__.rsplit(".", 1)[-1]

    def make(kind: str = "reverse", bili_mode: str = "fold", **options: str) -> Mitmdump:
        workdir = tmp_path_factory.mktemp(f"{module}-{kind}-{bili_mode}")
        proxy = Mitmdump(workdir, fake.port, kind=kind, bili_mode=bili_mode, options=options)
        started.append(proxy)
        _running.append(proxy)
        return proxy.start()

    yield make
    for proxy in reversed(started):
        proxy.stop()
        _running.remove(proxy)


@pytest.fixture(scope="module")
def reverse_proxy(make_proxy) -> Mitmdump:
    return make_proxy("reverse", "fold")


@pytest.fixture(scope="module")
def forward_proxy(make_proxy) -> Mitmdump:
    return make_proxy("forward", "fold")


@pytest.fixture
def sid(request) -> str:
    """A session id of this test's own."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"e2e-{name}-{uuid.uuid4().hex[:8]}"
