"""What the addon leaves in a flow's ``metadata``: plain values only (str, int, bool, bytes, lists and
dicts of them), so every mitmproxy feature that copies or saves flows (``-w``, ``save.file``,
mitmweb's export and duplicate) works with the addon loaded, and ``bili replay`` can replay a
captured session the way the proxy lived it.  The live per-flow state (the response rewriter)
stays in the addon, keyed weakly by the flow.

``flow.metadata["bili"]``, one model request over HTTP:

- ``v`` (schema version), ``mode`` (the addon's ``bili_mode``), ``rendered`` (fold rendering applied
  to this request), ``lane``, ``via`` (``http``), ``session``;
- what the kernel did: ``messages``, ``refs_new``, ``refs_known``, ``tagged``, ``blocks`` (active fold
  blocks after the request), ``folded`` (items left off the wire), ``folds`` (``[block, first ref,
  last ref]`` of each active block), ``executed`` (proxy tools run for the request), ``bytes_in``,
  ``bytes_out``;
- what went on the wire (:mod:`bili_addon.meter`): ``agent``, ``model``, ``turn`` (the session's
  request count), ``agent_tokens`` / ``sent_tokens`` (estimated tokens as the agent sent it and as
  bili did), ``predicted`` (cache-read share predicted from the previous request, filled in when the answer
  arrives; None on the first);
- ``request``: the agent's own body (content-decoded) when the addon changed it; the flow's request
  then holds what went upstream;
- ``answered``: the status the addon answered with itself, if it did;
- once the answer is through: ``called`` (``[call key, name, arguments]`` of each proxy tool call
  the answer made; streamed answers are not kept in the flow unless ``store_streamed_bodies`` is
  set, so replay needs them here), ``recorded`` (the calls were recorded to run on the next
  request), ``usage`` (``input``, ``cache_read``, ``cache_write``, ``output``), ``stripped`` (how many tag
  echoes were taken out of the model's prose) and ``echoes`` (the first of them, as written).

``flow.metadata["bili_ws"]``, a Responses WebSocket: a list of the same, one per
``response.create`` frame, each with ``message``, the frame's index in ``flow.websocket.messages``.
"""

from __future__ import annotations

from typing import Any

KEY = "bili"
WS_KEY = "bili_ws"
VERSION = 1

# the per-turn figures the proxy logs, and replay compares against what it computes itself
FIGURES = ("messages", "refs_new", "refs_known", "blocks", "folded", "executed")
ECHOES_KEPT, ECHO_CHARS = 20, 200  # the tag echoes kept on a flow, each cut to this length


def request_record(res: Any, *, mode: str, rendered: bool, lane: str, via: str, raw: bytes, sent: bytes,
                   blocks: list) -> dict[str, Any]:
    """The record of one processed request (``res``: the kernel's TurnResult; ``raw``: the agent's body;
    ``sent``: what goes upstream; ``blocks``: the session's fold blocks after the request)."""
    rec: dict[str, Any] = {
        "v": VERSION, "mode": mode, "rendered": rendered, "lane": lane, "via": via, "session": res.session,
        "messages": res.messages, "refs_new": res.refs_new, "refs_known": res.refs_known, "tagged": res.tagged,
        "blocks": sum(1 for b in blocks if b.active), "folded": res.folded_items,
        "folds": [[b.id, b.start_ref, b.end_ref] for b in blocks if b.active],
        "executed": list(res.executed), "bytes_in": len(raw), "bytes_out": len(sent),
    }
    if sent != raw:
        rec["request"] = bytes(raw)
    if res.status:
        rec["answered"] = res.status
    return rec


def record_answer(rec: dict[str, Any], rw: Any, recorded: list[str]) -> None:
    """What the answer left behind (``rw``: its ResponseRewriter, complete; ``recorded``: the names of
    the calls the kernel recorded to run next)."""
    rec["called"] = [[str(k), str(n), str(a)] for k, n, a in rw.calls]
    rec["recorded"] = bool(recorded)
    u = rw.usage
    if u.seen:
        rec["usage"] = {"input": u.input, "cache_read": u.cache_read, "cache_write": u.cache_write,
                        "output": u.output}
        if not getattr(u, "cache_known", True):  # (no figure of its cache reads: the replay learns nothing either)
            rec["usage"]["cache_known"] = False
        long = min(int(getattr(u, "cache_write_1h", None) or 0), u.cache_write)
        if long:  # the part written for 1 hour (the provider's split, else the one bili sent)
            rec["usage"]["cache_write_1h"] = long
    if rw.stripped:
        rec["stripped"] = rw.stripped
        rec["echoes"] = [e[:ECHO_CHARS] for e in rw.echoes[:ECHOES_KEPT]]


def read(metadata: Any) -> dict[str, Any] | None:
    """The HTTP record of a flow read from a file, if it is one this version understands."""
    rec = metadata.get(KEY) if isinstance(metadata, dict) else None
    return rec if isinstance(rec, dict) and rec.get("v") == VERSION else None


def read_ws(metadata: Any) -> dict[int, dict[str, Any]]:
    """The WebSocket records of a flow read from a file, by message index."""
    recs = metadata.get(WS_KEY) if isinstance(metadata, dict) else None
    if not isinstance(recs, list):
        return {}
    return {r["message"]: r for r in recs
            if isinstance(r, dict) and r.get("v") == VERSION and isinstance(r.get("message"), int)}


def original_request(rec: dict[str, Any] | None) -> bytes | None:
    """The agent's own body, when the record kept it (the addon changed it)."""
    body = rec.get("request") if rec else None
    return body if isinstance(body, bytes) else None
