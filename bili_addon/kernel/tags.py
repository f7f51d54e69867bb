"""Ref tags: ``<acp tokens="N" type="K">mNNNNN</acp>`` rendered toward the model, never stored as identity."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

REF_RE = re.compile(r"^m0*(\d{1,5})$")
# a tag we rendered, at the very start of a text, as we render it (one trailing newline)
OWN_TAG = re.compile(r'^<acp tokens="[^"<>]*" type="[^"<>]*">(m\d{5})</acp>\n?')


def ref_of(index: int) -> str:
    if not 1 <= index <= 99999:
        raise ValueError(f"ref index out of bounds: {index} (allowed 1-99999)")
    return f"m{index:05d}"


def index_of(ref: str) -> int | None:
    m = REF_RE.match(ref.strip().lower())
    if not m:
        return None
    i = int(m.group(1))
    return i if 1 <= i <= 99999 else None


def format_tokens(t: int) -> str:
    text = _FORMATTED.get(t)
    if text is None:
        text = _format_tokens(t)
        if len(_FORMATTED) < 65536:  # token counts of prose repeat: a tag costs one dict lookup
            _FORMATTED[t] = text
    return text


_FORMATTED: dict[int, str] = {}


def _format_tokens(t: int) -> str:
    if t < 1000:
        return str(t)
    if t < 10000:
        # JS toFixed(1): ties round away from zero on the exact binary value
        return str(Decimal(t / 1000).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)) + "K"
    return f"{int(Decimal(t / 1000).quantize(Decimal('1'), rounding=ROUND_HALF_UP))}K"


def tag(ref: str, tokens: int, kind: str) -> str:
    return f'<acp tokens="{format_tokens(tokens)}" type="{kind}">{ref}</acp>\n'


def render(ref: str, tokens: int, kind: str, clean: str) -> str:
    return f'<acp tokens="{format_tokens(tokens)}" type="{kind}">{ref}</acp>\n{clean}'


def split_own_tag(text: str) -> tuple[str, str] | None:
    """``(ref, rest)`` when ``text`` starts with a tag in our rendered form, else None."""
    m = OWN_TAG.match(text)
    if not m:
        return None
    return m.group(1), text[m.end() :]
