"""Operating a PostgreSQL store: the addon picks it from bili_store, health names the backend and
its round trip, bili doctor checks it, and an unreachable database fails open with the reason."""

from __future__ import annotations

import argparse
import json

from mitmproxy.test import tflow

from bili_addon.launch import doctor_checks
from bili_addon.store import SCHEMA_VERSION
from bili_addon.stores import open_store, store_spec

DEAD = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"


def health(bili) -> dict:
    f = tflow.tflow()
    f.request.path = "/__bili/health"
    f.request.host = "127.0.0.1"
    assert bili.request(f) is None
    return json.loads(f.response.content)


def test_bili_store_picks_postgresql_and_health_names_it(bili, pg_url):
    bili.tctx.configure(bili, bili_store=pg_url)
    assert bili.engine is not None and bili.engine.store.backend == "postgresql"
    h = health(bili)
    assert h["store"] is True and h["store_backend"] == "postgresql"
    assert h["store_at"].startswith("postgresql://postgres@127.0.0.1:")
    bili.keeper.probe()  # not running: no worker, no figure (health never waits on the store)
    assert "store_latency_ms" not in h


def test_an_unreachable_database_fails_open_with_the_reason(bili):
    bili.tctx.configure(bili, bili_store=DEAD)
    h = health(bili)
    assert h["store"] is False and h["store_backend"] == "postgresql"
    assert "cannot open the store at postgresql://nobody@127.0.0.1:1/none" in h["store_error"]
    assert h["store_hint"]


def test_the_environment_names_the_store_when_the_option_does_not():
    assert store_spec("", {"BILI_STORE": " postgresql://a@b/c "}) == "postgresql://a@b/c"
    assert store_spec("postgresql://x@y/z", {"BILI_STORE": "postgresql://a@b/c"}) == "postgresql://x@y/z"
    assert store_spec("", {}) == ""


def test_a_password_never_shows(pg_url, tmp_path):
    s = open_store(pg_url.replace("postgres@", "postgres:secret@"), str(tmp_path))
    try:
        assert "secret" not in s.where and ":***@" in s.where
    finally:
        s.close()


def test_doctor_checks_the_shared_store(pg_url, tmp_path):
    args = argparse.Namespace(confdir=str(tmp_path / "conf"), data_dir=str(tmp_path / "data"), port=1, store=pg_url)
    store = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["store"]
    assert store.ok and f"schema version {SCHEMA_VERSION}" in store.detail and "round trip" in store.detail
    args.store = DEAD
    store = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["store"]
    assert not store.ok and "cannot open the store" in store.detail
