"""Retention through a real mitmdump: at start-up the proxy prunes a conversation not seen for
longer than ``bili_retention`` days (on its store's worker), a live one goes on untouched, and the
pruned one, when it comes back, gets new refs only: none it was given before is given again."""

from __future__ import annotations

import time

import pytest

from bili_addon.store import Store

from .fake_upstream import REPLY_TEXT
from .support import anthropic_client, assert_only_tags_added

pytestmark = pytest.mark.e2e


def talk(proxy, sid: str, history: list[dict]):
    client, tee = anthropic_client(proxy.url)
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history,
                           extra_headers={"x-claude-code-session-id": sid})
    client.close()
    return tee.last.request_json


def test_an_idle_conversation_is_pruned_at_start_up_and_comes_back_without_reusing_a_ref(fake, make_proxy, sid):
    proxy = make_proxy("reverse", "fold", bili_retention="30")
    old, live = f"{sid}-old", f"{sid}-live"
    h_old = [{"role": "user", "content": "Old conversation: list the modules."}]
    h_live = [{"role": "user", "content": "Live conversation: explain the store."}]
    for _ in range(2):
        talk(proxy, old, h_old)
        talk(proxy, live, h_live)
        h_old += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": f"more {len(h_old)}"}]
        h_live += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": f"and {len(h_live)}"}]
    proxy.stop()
    s = Store(proxy.data_dir)  # a month and a half goes by for the old one
    s.db.execute("UPDATE sessions SET last_seen=? WHERE id=?", (time.time() - 45 * 86400, old))
    given = s.session(old).next_ref
    s.close()

    proxy.start()
    deadline = time.monotonic() + 15
    while (stats := proxy.stats())["retention"]["passes"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["retention"]["days"] == 30 and stats["retention"]["last"]["pruned"] == 1, stats["retention"]
    ids = [x["id"] for x in stats["sessions"]]
    assert live in ids and old not in ids

    # the live conversation goes on as before the restart: its refs, byte for byte
    sent = talk(proxy, live, h_live)
    assert [t.ref for t in assert_only_tags_added(fake.last(lambda r: r.header("x-claude-code-session-id") == live)
                                                  .json, sent)] == ["m00001", "m00002", "m00003", "m00004", "m00005"]
    # the pruned one comes back cold: every message gets a ref it was never given
    sent = talk(proxy, old, h_old)
    refs = [t.ref for t in assert_only_tags_added(fake.last(lambda r: r.header("x-claude-code-session-id") == old)
                                                  .json, sent)]
    assert refs and min(int(r[1:]) for r in refs) >= given, (refs, given)
