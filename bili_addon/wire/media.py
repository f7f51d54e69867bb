"""Payload identity of media parts: one changed image re-mints only itself."""

from __future__ import annotations

import hashlib
import re
from typing import Any

_DATA_URL = re.compile(r"^data:([^;,]+)(?:;[^,]*)?,(.*)$", re.IGNORECASE | re.DOTALL)


def payload_of_data(data: str) -> str:
    """The payload slot of inline (base64) media: a hash of the encoded bytes."""
    return "sha256:" + hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def payload_of_url(url: str) -> str:
    """A data: URL is addressed by its bytes, anything else by the URL itself."""
    m = _DATA_URL.match(url)
    if m:
        return payload_of_data(m.group(2))
    return "url:" + url


def payload_of_source(source: Any) -> str:
    """Anthropic image/document ``source`` objects (base64, url, file)."""
    if not isinstance(source, dict):
        return ""
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        return payload_of_data(source["data"])
    if kind == "url" and isinstance(source.get("url"), str):
        return payload_of_url(source["url"])
    if kind == "file" and isinstance(source.get("file_id"), str):
        return "file:" + source["file_id"]
    return ""
