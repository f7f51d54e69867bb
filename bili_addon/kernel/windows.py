"""Context windows: a built-in table by model name, and what providers' overflow errors teach."""

from __future__ import annotations

import functools
import re

from bili_addon.prices import ONE_MILLION

DEFAULT_WINDOW = 200_000

# (pattern on the lower-cased model id, window); first match wins
_TABLE: tuple[tuple[str, int], ...] = (
    (r"\[1m\]|-1m\b", 1_000_000),
    (r"^claude|^anthropic/claude", 200_000),
    # (400K is input and output together; a request's input may hold 272K of it, as codex's own model
    # table says: past that the API refuses it, stating no number to learn from)
    (r"gpt-5|codex", 272_000),
    (r"gpt-4\.1|gpt-4-1", 1_047_576),
    (r"^o[134]\b|^o[134]-", 200_000),
    (r"gpt-4o|gpt-4-turbo", 128_000),
    (r"gemini-(1\.5|2|3)", 1_048_576),
    (r"deepseek", 128_000),
    (r"qwen", 131_072),
    (r"glm", 128_000),
    (r"kimi|moonshot", 256_000),
    (r"grok", 256_000),
)

_OVERFLOW = re.compile(
    r"context_length_exceeded|context length exceeded|maximum context length|max context length|"
    r"maximum context size|exceeds the context window|exceeded model token limit|prompt is too long|"
    r"prompt_too_long|prompt_is_too_long|request_too_large|token limit exceeded|exceed context limit",
    re.IGNORECASE,
)
# Anthropic's "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000": the input
# such requests may hold is the limit less what the request keeps for the answer
_INPUT_AND_ANSWER = re.compile(r"([\d,]{3,})\s*\+\s*([\d,]{1,})\s*>\s*([\d,]{4,})")
_LIMIT = (
    re.compile(r">\s*([\d,]{4,})\s+maximum", re.IGNORECASE),
    re.compile(r"maximum context length (?:is|of)\s+([\d,]{4,})", re.IGNORECASE),
    re.compile(r"maximum context size (?:is|of)\s+([\d,]{4,})", re.IGNORECASE),
    re.compile(r"(?:max|maximum) (?:context )?length (?:is )?([\d,]{4,})", re.IGNORECASE),
    re.compile(r"limit of ([\d,]{4,}) token", re.IGNORECASE),
    re.compile(r"([\d,]{4,}) maximum", re.IGNORECASE),
)


# a request's own word on its window beside its model's name: Anthropic's 1M-token window is asked for
# with a beta header (Claude Code's Opus and Sonnet), the model's name the same (prices.ONE_MILLION: the
# money reads it after the model's name too)
# the model of a request whose body does not name it (Gemini: in the URL's path), as the proxy read it
# there: put in the headers the engine is given (a copy, never forwarded)
PATH_MODEL = "x-bili-path-model"
_GEMINI_PATH = re.compile(r"/models/([^/:?]+)")


def variant(headers) -> str:
    """:data:`ONE_MILLION` when the request asks for the 1M-token window (``anthropic-beta:
    context-1m-...``), else ''."""
    beta = headers.get("anthropic-beta", "") if headers is not None else ""
    return ONE_MILLION if "context-1m" in beta.lower() else ""


def window_key(s) -> str:
    """What a session's window is known by: its model's id and the window its request asks for (a
    learned window is kept per key: an overflow at 200K says nothing of the same model's 1M window)."""
    return s.model + s.variant


def model_in_path(path: str) -> str | None:
    """The model a Gemini request's path names (``/v1beta/models/gemini-2.5-pro:generateContent``)."""
    m = _GEMINI_PATH.search(path or "")
    return m.group(1) if m else None


def note_path_model(headers, lane: str, path: str) -> None:
    """The model of a request whose path names it (Gemini), put in the engine's copy of its headers
    (:data:`PATH_MODEL`): the shell does it, and a replay as the shell does."""
    model = model_in_path(path) if lane == "gemini" else None
    if model:
        headers[PATH_MODEL] = model


@functools.lru_cache(maxsize=256)  # read on every request, of a handful of model ids
def context_window(model: str) -> int:
    m = (model or "").lower()
    for pattern, window in _TABLE:
        if re.search(pattern, m):
            return window
    return DEFAULT_WINDOW


def learned_window(status: int, body: str) -> int | None:
    """The window a "context too long" error states (400/413 only), else None."""
    if status not in (400, 413) or not _OVERFLOW.search(body):
        return None
    m = _INPUT_AND_ANSWER.search(body)
    if m:
        answer, limit = (int(g.replace(",", "")) for g in m.group(2, 3))
        if limit - answer >= 1000:
            return limit - answer
    for rx in _LIMIT:
        m = rx.search(body)
        if m:
            n = int(m.group(1).replace(",", ""))
            if n >= 1000:
                return n
    return None


def is_overflow(status: int, body: str) -> bool:
    return status in (400, 413) and bool(_OVERFLOW.search(body))
