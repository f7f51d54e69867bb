"""Host-vouched message ids: the msgid envelope.

A client that keeps stable ids for its messages sends them beside the conversation, as the body
field ``biliMsgIds`` (a string array parallel to ``messages`` / ``input`` / ``contents``, or
``{"ids": [...], "resync": true}``) or the header ``x-bili-msg-ids`` (the same, as JSON).  The
addon removes both before the request leaves.  All or nothing: a length mismatch, an invalid id or
an id given twice drops the whole set for that turn, and content identity applies.  A valid id
wins over content churn (the message keeps its ref when the host re-encodes it); an id re-used for
a message of another shape is refused with 400, never silently re-bound, unless ``resync`` asks to
re-claim the whole set.

:func:`pins` reads a request's set against the session's bound ids (the refs they pin); :func:`bind`
records the ids of a turn's messages once their refs are committed (the session flag ``envelope``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import msgspec

from bili_addon.kernel.reconcile import canonical_text
from bili_addon.kernel.state import Entry, ItemInfo, Resolved, Session, TurnResult
from bili_addon.wire.base import REASONING, Body

if TYPE_CHECKING:
    from bili_addon.kernel.registry import Sessions

FIELD = "biliMsgIds"
HEADER = "x-bili-msg-ids"
RESYNC_HEADER = "x-bili-msg-ids-resync"
_VALID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


@dataclass
class Envelope:
    ids: list[str]
    resync: bool


class EnvelopeRejected(ValueError):
    """The set is unusable for this turn (content identity applies); the reason is logged."""


def parse(raw_field: Any, headers: Mapping[str, str], items: int) -> Envelope | None:
    """The envelope of a request, None when it carries none.  Raises EnvelopeRejected."""
    value, resync = raw_field, False
    if value is None:
        h = headers.get(HEADER)
        if not h:
            return None
        try:
            value = json.loads(h)
        except ValueError:
            raise EnvelopeRejected(f"the {HEADER} header is not JSON") from None
        resync = str(headers.get(RESYNC_HEADER, "")).strip().lower() in ("1", "true", "yes")
    if isinstance(value, dict):
        resync = resync or value.get("resync") is True
        value = value.get("ids")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EnvelopeRejected("message ids must be an array of strings")
    if len(value) != items:
        raise EnvelopeRejected(f"{len(value)} message ids for {items} messages")
    bad = next((v for v in value if not _VALID.match(v)), None)
    if bad is not None:
        raise EnvelopeRejected(f"invalid message id {bad[:40]!r}")
    if len(set(value)) != len(value):
        raise EnvelopeRejected("a message id is given twice")
    return Envelope(value, resync)


def shape_of(parts) -> str:
    """What must not change under an id: the roles and kinds of the message's parts."""
    return ",".join(f"{p.core.role}/{p.core.ctype}" for p in parts)


def words_of(parts) -> list[str]:
    """What an id's message must still say for the id to keep its refs: each part's words (its role,
    kind, tool and canonical text: JSON key-sorted and compacted, prose whitespace-normalised; a
    reasoning part's kind alone, providers re-mint what stands for it), not its call id, which hosts
    re-mint, nor the bytes a host re-serialises."""
    out = []
    for p in parts:
        c = p.core
        text = "" if c.ctype == REASONING else canonical_text(c.text)
        seed = "\0".join((c.role, c.ctype, c.tool_name, text, c.media or ""))
        out.append(hashlib.sha256(seed.encode("utf-8", "surrogatepass")).hexdigest()[:16])
    return out


def pins(s: Session, body: Body, headers: Mapping[str, str], infos: list[ItemInfo], start: int,
         result: TurnResult) -> tuple[Envelope | None, dict[int, list[Entry]], bool]:
    """The host-vouched ids of this request, and the refs they pin (by conversation item)."""
    if FIELD not in body.top and not headers.get(HEADER):  # (mostly: no envelope, as parse finds)
        return None, {}, False
    stripped = FIELD in body.top
    field = body.top.pop(FIELD, None)
    try:
        env = parse(msgspec.json.decode(field) if field is not None else None, headers, len(infos))
    except EnvelopeRejected as e:
        result.notes.append(f"message ids ignored for this turn ({e}); content identity applies")
        return None, {}, stripped
    if env is None:
        return None, {}, stripped
    if env.resync:  # the whole set re-claimed: every id bound anew to what it names now (bind)
        return env, {}, stripped
    bound = s.flags.get("envelope", {})
    pinned: dict[int, list[Entry]] = {}
    for i in range(start, len(infos)):
        stored = bound.get(env.ids[i])
        if stored is None:
            continue
        shape, refs = stored[0], stored[1]
        parts = infos[i].parts
        if shape == shape_of(parts) and len(refs) == len(parts):
            # the id keeps its refs over the host's churn (its call ids re-minted, its JSON re-serialised)
            # while its words are the ones bound: words changed under it (an edit, another message under a
            # re-used id) are new content, which content identity refs, the id bound anew to it
            if len(stored) > 3 and (stored[3] == [p.chash for p in parts] or stored[2] == words_of(parts)):
                pinned[i - start] = [Entry(r, t) for r, t in refs]  # (the same bytes' content hashes: no words made)
        else:
            result.status = 400
            result.error = (f"message id {env.ids[i]!r} is already bound to a different message; "
                            f"send resync: true to re-claim the whole set")
            return env, {}, stripped
    return env, pinned, stripped


def bind(sessions: Sessions, s: Session, env: Envelope, infos: list[ItemInfo], start: int,
         resolved: list[list[Resolved]], pinned: dict[int, list[Entry]]) -> None:
    """Bind each id of the set this turn did not pin to its message's shape and refs."""
    bound = dict(s.flags.get("envelope", {}))
    changed = False
    for k, parts in enumerate(resolved):
        cid = env.ids[start + k]
        item = infos[start + k].parts
        if k in pinned:  # (its words the same: the bytes as the host sends them now, compared first next time)
            stored = bound.get(cid)
            hashes = [p.chash for p in item]
            if stored is not None and len(stored) > 3 and stored[3] != hashes:
                bound[cid] = [*stored[:3], hashes]
                changed = True
            continue
        value = [shape_of(item), [[r.entry.ref, r.entry.tokens] for r in parts], words_of(item), [p.chash for p in item]]
        if bound.get(cid) != value:
            bound[cid] = value
            changed = True
    if changed:
        sessions.set_flag(s.row.id, "envelope", bound)
