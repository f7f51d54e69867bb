"""Host-vouched message ids: the msgid envelope.

A client that keeps stable ids for its messages sends them beside the conversation, as the body
field ``biliMsgIds`` (a string array parallel to ``messages`` / ``input`` / ``contents``, or
``{"ids": [...], "resync": true}``) or the header ``x-bili-msg-ids`` (the same, as JSON).  The
addon removes both before the request leaves.  All or nothing: a length mismatch, an invalid id or
an id given twice drops the whole set for that turn, and content identity applies.  A valid id
wins over content churn (the message keeps its ref when the host re-encodes it); an id re-used for
a message of another shape is refused with 400, never silently re-bound, unless ``resync`` asks to
re-claim the whole set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

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
