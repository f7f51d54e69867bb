"""What must survive a mitmdump restart with the same data dir: refs of a named session, and the
attachment of anonymous conversations (no session header) to their session."""

from __future__ import annotations

import pytest

from .fake_upstream import REPLY_TEXT
from .support import anthropic_client, assert_only_tags_added, openai_client, tags_by_text

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy("reverse", "fold")


def test_refs_survive_a_restart(fake, proxy, sid):
    hdr = {"x-claude-code-session-id": sid}
    u1 = "Turn one: describe the module layout."
    u2 = "Turn two: which module owns the store?"
    u3 = "Turn three, after the restart: and the admin endpoints?"

    client, tee = anthropic_client(proxy.url)
    history = [{"role": "user", "content": u1}]
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history, extra_headers=hdr)
    history += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": u2}]
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history, extra_headers=hdr)
    before = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    client.close()

    proxy.restart()

    client, tee = anthropic_client(proxy.url)
    history += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": u3}]
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history, extra_headers=hdr)
    after = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)

    tags = assert_only_tags_added(after.json, tee.last.request_json)
    assert [(t.text, t.ref) for t in tags] == [
        (u1, "m00001"),
        (REPLY_TEXT, "m00002"),
        (u2, "m00003"),
        (REPLY_TEXT, "m00004"),  # the same text again is a second message, with its own ref
        (u3, "m00005"),
    ]
    # the history is rendered byte-identically across the restart (the provider's prompt cache holds)
    assert after.json["messages"][:3] == before.json["messages"]
    s = proxy.session(sid)
    assert (s["requests"], s["messages"], s["refs"]) == (3, 5, 5)
    lines = proxy.wait_bili_lines(3, session=sid)
    assert [(m.group(4), m.group(5)) for m in lines] == [("1", "0"), ("2", "1"), ("2", "3")]


def _session_of_next_request(proxy, send) -> str:
    """Run ``send()`` and return the session id of the one model line it logged."""
    n = len(proxy.bili_lines())
    send()
    lines = proxy.wait_bili_lines(n + 1)
    assert len(lines) == n + 1, "the request logged no [bili] session= line"
    return lines[-1].group(1)


def test_anonymous_conversations_keep_their_session_across_a_restart(fake, proxy):
    system = {"role": "system", "content": "You are a coding assistant. Answer in one short paragraph."}
    a1 = {"role": "user", "content": "Conversation A: please summarise the quarterly report for me."}
    b1 = {"role": "user", "content": "Conversation B: write a limerick about proxies and caches."}
    client, tee = openai_client(proxy.url + "/v1")

    def chat(messages):
        return lambda: client.chat.completions.create(model="gpt-fake-1", messages=messages)

    sa = _session_of_next_request(proxy, chat([system, a1]))
    sb = _session_of_next_request(proxy, chat([system, b1]))
    assert sa != sb, "two conversations that share only a system prompt must not share a session"

    a_turn2 = [system, a1, {"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": "Now in French."}]
    assert _session_of_next_request(proxy, chat(a_turn2)) == sa
    rec = fake.last(lambda r: r.route == "/v1/chat/completions")
    assert tags_by_text(rec.json) == {a1["content"]: "m00001", REPLY_TEXT: "m00002", "Now in French.": "m00003"}
    client.close()

    proxy.restart()

    client, tee = openai_client(proxy.url + "/v1")
    a_turn3 = a_turn2 + [{"role": "assistant", "content": "Voici."}, {"role": "user", "content": "Merci, and in German?"}]
    assert _session_of_next_request(proxy, lambda: client.chat.completions.create(model="gpt-fake-1", messages=a_turn3)) == sa
    rec = fake.last(lambda r: r.route == "/v1/chat/completions")
    tags = assert_only_tags_added(rec.json, tee.last.request_json)
    assert [t.ref for t in tags] == ["m00001", "m00002", "m00003", "m00004", "m00005"]

    # B is untouched by all of A's turns
    stats = {s["id"]: s for s in proxy.stats()["sessions"]}
    assert (stats[sa]["requests"], stats[sa]["messages"], stats[sa]["lane"]) == (3, 5, "chat")
    assert (stats[sb]["requests"], stats[sb]["messages"]) == (1, 1)


def test_refs_survive_kill_9(fake, proxy, sid):
    """A committed turn is on disk before its bytes leave: ``kill -9`` loses nothing of it."""
    hdr = {"x-claude-code-session-id": sid}
    client, tee = anthropic_client(proxy.url)
    history = [{"role": "user", "content": "Before the crash: list the lanes."}]
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history, extra_headers=hdr)
    before = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    client.close()

    proxy.proc.kill()  # SIGKILL: no shutdown hook runs
    proxy.proc.wait(timeout=10)
    proxy.proc = None
    proxy.start()

    client, tee = anthropic_client(proxy.url)
    history += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": "After the crash."}]
    client.messages.create(model="claude-fake-1", max_tokens=32, messages=history, extra_headers=hdr)
    after = fake.last(lambda r: r.header("x-claude-code-session-id") == sid)
    client.close()
    tags = assert_only_tags_added(after.json, tee.last.request_json)
    assert [t.ref for t in tags] == ["m00001", "m00002", "m00003"]
    assert after.json["messages"][0] == before.json["messages"][0]
