"""Lazy activation through a real mitmdump (``bili_activate=lazy``, the default): a short session is
forwarded byte-exact; once its foldable work passes ``bili_remind_at`` the tools, the prompt and the
tags appear, the reminder rides along, and they stay from then on.  /__bili/stats shows the
activation and the cache model's predicted vs reported reads."""

from __future__ import annotations

import json

import pytest

from .support import request as http_request
from .support import strip_tags

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lazy(make_proxy):
    return make_proxy("reverse", "fold", bili_activate="lazy", bili_remind_at="1500")


def _post(proxy, sid: str, body: dict):
    raw = json.dumps(body, indent=1).encode()  # formatted the way bili never encodes: any rewrite shows
    reply = http_request(proxy.url + "/v1/messages", raw,
                         headers={"content-type": "application/json", "x-claude-code-session-id": sid})
    assert reply.status == 200, reply.body
    return raw


def _of(sid: str):
    return lambda r: r.header("x-claude-code-session-id") == sid


def _body(n_work: int) -> dict:
    msgs = [{"role": "user", "content": "Start the refactor."}]
    for i in range(n_work):
        msgs.append({"role": "assistant", "content": f"Step {i} done; reading the next file."})
        msgs.append({"role": "user", "content": f"file {i}: " + ("def f(x):\n    return x\n" * 180)})
    msgs.append({"role": "assistant", "content": "Read them all."})
    msgs.append({"role": "user", "content": "Go on."})
    return {"model": "claude-fake-1", "max_tokens": 64,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "shell", "description": "run", "input_schema": {"type": "object"}}],
            "messages": msgs}


def test_short_session_byte_exact_then_activates_and_stays(fake, lazy, sid):
    for n in (0, 1):  # short: nothing foldable yet
        raw = _post(lazy, sid, _body(n))
        assert fake.last(_of(sid)).raw == raw
    s = lazy.session(sid)
    assert s["active"] is None and s["refs"] > 0  # the ledger records every message meanwhile

    _post(lazy, sid, _body(4))  # ~4.5K tokens of foldable work: past the 1500 threshold
    sent = fake.last(_of(sid)).json
    names = [t["name"] for t in sent["tools"]]
    assert "compress" in names and "shell" in names
    assert strip_tags(sent)[1], "no <acp> tags once active"
    assert lazy.session(sid)["active"] == "threshold"

    _post(lazy, sid, _body(5))  # and the tools stay
    assert "compress" in [t["name"] for t in fake.last(_of(sid)).json["tools"]]
    cache = lazy.session(sid)["cache"]
    assert cache["family"] == "anthropic" and len(cache["turns"]) == 4
    assert all("predicted_read" in t and "reported_read" in t for t in cache["turns"])


def test_inactive_session_answers_are_not_rewritten(fake, lazy, sid):
    """An inactive session was offered no bili tools: a call named ``compress`` is the agent's own
    business, and the answer reaches it byte for byte (nothing recorded, nothing run)."""
    import urllib.parse

    raw = json.dumps(_body(0)).encode()
    tool = urllib.parse.quote('compress:{"ranges":[]}')
    reply = http_request(lazy.url + "/v1/messages", raw, headers={
        "content-type": "application/json", "x-claude-code-session-id": sid, "x-fake-tool": tool})
    rec = fake.last(_of(sid))
    assert rec.raw == raw
    assert reply.status == 200 and reply.body == rec.response
    assert '"compress"' in reply.body.decode()
    s = lazy.session(sid)
    assert s["active"] is None and s["fold"]["blocks"] == 0
