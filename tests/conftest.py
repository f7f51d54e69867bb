"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from mitmproxy.test import taddons

from bili_addon.shell import Bili


@pytest.fixture
def bili(tmp_path):
    """The addon in mitmproxy's test context, with a fresh store; ``bili.tctx`` configures it."""
    addon = Bili()
    with taddons.context(addon) as tctx:
        # the unit tests exercise what bili does once a session is active (lazy activation has its own tests)
        tctx.configure(addon, bili_data_dir=str(tmp_path / "data"), bili_activate="always", bili_materialize="now")
        addon.tctx = tctx
        yield addon
    addon.done()


# -- a real PostgreSQL server (the team gateway's shared store) ------------------------------------
@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL server for the run (started on first use); skipped with the reason when no
    server can be had here."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install -e '.[test]' brings it)")
    from pgserver import NoServer, PgServer

    try:
        server = PgServer().start()
    except NoServer as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty PostgreSQL store's URL."""
    return pg_server.fresh()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request):
    """``make_store()``: a store of the parametrised backend; every call opens the same store anew
    (as a second process or instance would)."""
    from bili_addon.stores import open_store

    tmp = request.getfixturevalue("tmp_path")
    spec = request.getfixturevalue("pg_url") if request.param == "postgresql" else ""
    others: dict[str, str] = {}  # name -> the spec of another store of this test
    opened = []

    def make_store(name: str = ""):
        """The test's store; ``name``: another store of its own (a second data dir or database)."""
        if not name:
            s = open_store(spec, str(tmp))
        elif request.param == "postgresql":
            s = open_store(others.setdefault(name, request.getfixturevalue("pg_server").fresh()), str(tmp))
        else:
            s = open_store("", str(tmp / name))
        opened.append(s)
        return s

    make_store.kind = request.param
    make_store.spec = spec or str(tmp)
    yield make_store
    for s in opened:
        s.close()
