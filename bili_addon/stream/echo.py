"""The tag-echo filter: models imitate the ``<acp ...>mNNNNN</acp>`` tags they are shown.

Applied to model **prose** only (text deltas and their aggregates); tool-call arguments are never
passed through here.  ``strip_echoes`` cleans a whole text; ``EchoFilter`` cleans a text that
arrives in pieces, holding back a short suffix that could still become a tag and releasing
everything when the block ends, so prose is never lost.
"""

from __future__ import annotations

import itertools
import re

# Tag names: a, c, p in any order, optionally with one inserted letter from {a, c, p, i}
# (typos like ``acip``), plus drift names seen in the wild.
_names: set[str] = set()
for perm in itertools.permutations("acp"):
    base = "".join(perm)
    _names.add(base)
    for pos in range(4):
        for extra in "acpi":
            _names.add(base[:pos] + extra + base[pos:])
_names |= {"accessp", "acacp", "acb"}
NAMES = frozenset(_names)
_NAME_PREFIXES = frozenset(n[:k] for n in NAMES for k in range(1, len(n) + 1))

_N = "(?:" + "|".join(sorted(NAMES, key=len, reverse=True)) + ")"
# the names as models write bili's tags, lower case: code's own ``Vec<Cap>``, ``Once<Apic>``, ``<Pac>``
# (a type, a component) is an echo only with what an echo holds beside its name (a ref run, bili's
# attributes), never on its name alone
_NL = "(?-i:" + _N[3:]
# (no two adjacent optional runs of the same characters: a failing match must not try every way
# of splitting a run of spaces between them)
_REFS = r"m\d{4,}(?:\s*(?:[–—,\-]\s*)?m\d{4,})*"
_AFTER_NAME = r"(?=[\s>/=])"
# An echo's attributes are short (bili's own: `` tokens="12.3k" type="tool-result"``): a longer run after
# a tag's name up to a ``>`` is prose that happens to hold both ("the <acp markers ... if x > 0"), kept
ATTRS_MAX = 64
_ATTRS = rf"(?:\s[^<>]{{0,{ATTRS_MAX}}})?"
# attributes that name bili's own (``tokens=``, ``type=``), within ATTRS_MAX of the name
_EVID = rf"\s(?=[^<>]{{0,{ATTRS_MAX}}}>)[^<>]*?\b(?:tokens|type)\s*=[^<>]*"

# one alternation, tried left to right at each position; ``nl`` eats the blank lines a removed
# tag drags along when the tag stood at the start of a line
_ECHO = re.compile(
    "(?:"
    + rf"<{_N}{_AFTER_NAME}{_ATTRS}>\s*{_REFS}\s*</[^<>\n]{{1,32}}>"  # paired, refs-only body
    + rf"|<(?:{_NL}{_AFTER_NAME}{_ATTRS}|{_N}{_EVID})>\s*</[^<>\n]{{1,32}}>"  # paired, empty body
    + rf"|(?P<open><(?:{_NL}{_AFTER_NAME}{_ATTRS}|{_N}{_EVID})>)(?P<prose>[^<]*?)</{_N}\s*>"  # around prose: kept
    + rf"|(?<![\w>]){_REFS}\s*</{_N}[^<>]{{0,32}}>"  # orphan refs before a close
    + rf"|<(?:{_NL}{_AFTER_NAME}[^<>]{{0,{ATTRS_MAX}}}|{_N}{_EVID})/>"  # self-closing
    + rf"|<{_N}=[^<>]{{0,{ATTRS_MAX}}}>"  # mangled open
    + rf"|<{_N}{_AFTER_NAME}{_ATTRS}>[ \t]*{_REFS}"  # lone open with a ref run right after it
    + rf"|<(?:{_NL}{_AFTER_NAME}{_ATTRS}|{_N}{_EVID})>"  # lone open (not code's ``Vec<Cap>``)
    + rf"|</{_NL}(?:\s[^<>]{{0,31}})?>"  # lone close (not the prose after it, up to a later ">")
    + r")(?P<nl>[ \t]*\n+)?",
    re.IGNORECASE,
)
_QUICK = re.compile(rf"</?{_N}|{_REFS}\s*</", re.IGNORECASE)

BODY_CAP = 80  # text after a complete opening tag is held this long waiting for its close
HOLD_LIMIT = 128  # an ambiguous tail (``<ac``, ``m001``) is held this long at most


def _one_pass(text: str, before: str, removed: list[str] | None) -> str:
    """One left-to-right substitution; ``before`` is the raw text preceding ``text`` (context for
    look-behinds and for "at the start of a line"); what goes is appended to ``removed``."""
    whole = before + text
    out: list[str] = []
    last = len(before)
    for m in _ECHO.finditer(whole, len(before)):
        out.append(whole[last : m.start()])
        prose = m.group("prose")
        if prose is not None:
            out.append(prose + (m.group("nl") or ""))
        elif not (m.start() == 0 or whole[m.start() - 1] == "\n"):
            out.append(m.group("nl") or "")
        if removed is not None:
            gone = m.group(0).rstrip("\n\t ")
            if prose is not None:  # the tags went, the prose between them stayed
                gone = m.group("open") + "…" + gone[len(m.group("open")) + len(prose):]
            removed.append(gone)
        last = m.end()
    out.append(whole[last:])
    return "".join(out)


def strip_echoes(text: str, *, before: str = "", final: bool = True, removed: list[str] | None = None) -> str:
    """Remove tag echoes (and the blank lines they bring) from prose.

    ``before``: the raw character preceding ``text`` in its stream ("" at the start);
    ``final``: nothing follows, so an opening cut off at the very end (a stream that stopped
    mid-tag) is dropped too; ``removed``: if given, each echo removed is appended to it (around
    prose that stays, the tags with "…" between them).
    """
    if "<" not in text:  # every echo shape has an angle bracket
        return text
    # (the text's own end only: an opening that removing an echo leaves last was not cut off there)
    cut = _TRUNCATED_TAIL.search(text) if final else None
    if cut:
        text = text[: cut.start()]
    prev = None
    while prev != text and _QUICK.search(text):  # removing one echo can expose another
        prev = text
        text = _one_pass(text, before, removed)
    if cut and removed is not None:
        removed.append(cut.group(0))
    return text


_TRAILING_REFS = re.compile(r"(?<![\w>])m[\s\d,\-–—m]*$")  # "m", then anything a ref run may still hold


def _hold_from(buf: str, before: str) -> int:
    """Index from which ``buf`` must be held back because it may still become an echo."""
    cut = len(buf)
    i = buf.find("<")
    while i != -1:
        if _undecided_tag_at(buf, i):
            cut = i
            break
        i = buf.find("<", i + 1)
    # a ref run right before the cut could be an orphan ref waiting for its close
    m = _TRAILING_REFS.search(before + buf, len(before), len(before) + cut)
    if m and len(before) + cut - m.start() <= HOLD_LIMIT:
        cut = m.start() - len(before)
    return cut


def _only_space(t: str) -> bool:
    return len(t) <= HOLD_LIMIT and not t.strip(" \t\r\n")


def _undecided_tag_at(buf: str, i: int) -> bool:
    """Whether the text from ``buf[i] == "<"`` may still grow into (or extend) an echo."""
    s = buf[i + 1 :]
    closing = s.startswith("/")
    if closing:
        s = s[1:]
    j = 0
    while j < len(s) and s[j].isalpha():
        j += 1
    name, rest = s[:j].lower(), s[j:]
    if not rest:  # ``<``, ``</a``, ``<acp`` at the very end
        return (not name or name in _NAME_PREFIXES) and len(buf) - i <= HOLD_LIMIT
    if name not in NAMES or rest[0] not in " \t\r\n>/=":
        return False
    gt = rest.find(">")
    if gt == -1:  # an opening still arriving, while its attributes may still be an echo's
        return len(rest) <= ATTRS_MAX + 1
    if gt > ATTRS_MAX + 1:
        return False  # no echo's opening: prose that holds a tag's name and, later, a ">"
    after = rest[gt + 1 :]
    if closing or rest[gt - 1 : gt] == "/" or rest[0] == "=":
        return _only_space(after)  # complete, but the blank lines it drags may still arrive
    close = re.search(r"</[^<>\n]{1,32}>", after)
    if close:
        return _only_space(after[close.end() :])
    if after.endswith("<") or re.search(r"</[^<>\n]{0,32}$", after):
        return True  # its close is arriving
    return len(after) < BODY_CAP


class EchoFilter:
    """Streams prose through :func:`strip_echoes`, holding only what may still become an echo.
    ``removed``: the echoes it took out, in order."""

    __slots__ = ("buf", "removed", "before")

    def __init__(self) -> None:
        self.buf = ""
        self.removed: list[str] = []
        self.before = ""  # the last raw character released

    def feed(self, piece: str) -> str:
        self.buf += piece
        return self._emit(_hold_from(self.buf, self.before), final=False)

    def flush(self) -> str:
        """End of the block: release everything; an opening cut off mid-tag is dropped."""
        return self._emit(len(self.buf), final=True)

    def _emit(self, cut: int, final: bool) -> str:
        ready, self.buf = self.buf[:cut], self.buf[cut:]
        if not ready:
            return ""
        clean = strip_echoes(ready, before=self.before, final=final, removed=self.removed)
        self.before = ready[-1]
        return clean


# An echo cut off at the very end of a stream: an opening whose attributes stop mid-way (each one
# ``name=value`` as echoes write them, the last one possibly cut; no prose sentence is that), a close, or a
# ref run before a close; within what a stream holds back (ATTRS_MAX), so a stream drops what a whole text does
_A_NAME = r"[\w:.\-]+"
_A_VALUE = r"""(?:"[^"<>]*"|'[^'<>]*'|[^\s"'<>]+)"""
_A_CUT = rf"""{_A_NAME}(?:\s*=\s*(?:"[^"<>]*|'[^'<>]*|[^\s"'<>]*)?)?"""
_TRUNCATED_TAIL = re.compile(
    rf"(?:<{_N}(?=[\s=][^<>]{{0,{ATTRS_MAX}}}$)(?:=[^\s<>]*)?(?:\s+{_A_NAME}\s*=\s*{_A_VALUE})*(?:\s+(?:{_A_CUT})?)?\s*"
    rf"|</{_NL}(?:\s[^<>]{{0,31}})?|m\d{{4,}}</\w*)$",
    re.IGNORECASE,
)
