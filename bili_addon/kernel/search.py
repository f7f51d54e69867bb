"""Dependency-free full-text search over folded conversation parts (the ``search_context`` tool).

Okapi BM25 over identifier-aware tokens, an exact-phrase bonus, and a fuzzy fallback (edit
distance / shared prefix) when nothing matches literally.  Output is deterministic: ties keep the
input order of the docs.

:func:`search_fts5` is the same search on SQLite FTS5's ``bm25()``.  ``search_context`` builds its
index on every call, and that way scripts/bench_search.py measures FTS5 at ~2x the hand-written
search, so :func:`search` is the one that runs; an FTS5 index kept in the store would win.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

K1 = 1.2
B = 0.75
FUZZY_SCALE = 0.5
SNIPPET_CHARS = 240
ELLIPSIS = "…"

_CJK = "\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD = rf"[^\W{_CJK}]"  # a word character that is not CJK (letters, digits, underscore)
# a CJK run, or a compound: word runs joined by path / dot / dash / colon separators
_TOKEN_RE = re.compile(rf"[{_CJK}]+|{_WORD}+(?:[./\\:\-]{_WORD}+)*")
_CJK_RE = re.compile(rf"[{_CJK}]")
_SPLITS = (re.compile(r"[/\\]+"), re.compile(r"[.:\-]+"), re.compile(r"_+"))
_CAMEL = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class Doc:
    """A searchable text: ``key`` like ``b3`` (summary block) or ``m00042`` (original message)."""

    key: str
    text: str
    kind: str = ""


@dataclass(frozen=True)
class Hit:
    """One result: ``snippet`` is <= 240 chars around the best match, ``…`` at cut ends."""

    key: str
    kind: str
    score: float
    snippet: str


# --------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=1 << 16)
def _expand(raw: str) -> tuple[str, ...]:
    """All index terms of one raw match: the whole compound plus its parts at every level."""
    if _CJK_RE.match(raw):
        return tuple(dict.fromkeys([*raw, *(raw[i:i + 2] for i in range(len(raw) - 1))]))
    if (raw.isalpha() or raw.isdigit()) and (raw.islower() or raw.isupper() or raw.isdigit()):
        return (raw.lower(),)
    out: dict[str, None] = {raw.lower(): None}

    def walk(s: str, level: int) -> None:
        if level < len(_SPLITS):
            parts = [p for p in _SPLITS[level].split(s) if p]
            for p in parts:
                out[p.lower()] = None
            for p in parts:
                walk(p, level + 1)
        elif s.isascii():
            for p in _CAMEL.findall(s):
                out[p.lower()] = None

    walk(raw, 0)
    return tuple(out)


def tokenize(text: str) -> list[str]:
    """Index terms of ``text`` in order (compounds followed by their parts)."""
    return [t for raw in _TOKEN_RE.findall(text) for t in _expand(raw)]


class _Index:
    """Raw-token counts per doc; term frequencies are derived on demand for the terms asked about.

    Doc length is counted in raw tokens (words/compounds), before expansion into parts.
    """

    def __init__(self, docs: Sequence[Doc]) -> None:
        raws = [_TOKEN_RE.findall(d.text) for d in docs]
        self.counts = [Counter(r) for r in raws]
        self.lengths = [len(r) for r in raws]
        self.n = len(docs)
        self.avgdl = (sum(self.lengths) / self.n if self.n else 0.0) or 1.0
        # unique raw tokens in first-seen order (deterministic)
        self.uniq = list(dict.fromkeys(chain.from_iterable(self.counts)))
        self.tf: dict[str, list[int]] = {}
        self.idf: dict[str, float] = {}

    def vocabulary(self) -> list[str]:
        """Every index term, in first-seen order."""
        return list(dict.fromkeys(chain.from_iterable(map(_expand, self.uniq))))

    def prepare(self, terms: Sequence[str]) -> None:
        """Compute frequencies and idf for ``terms`` (one pass over the unique raw tokens)."""
        want = {t for t in terms if t not in self.tf}
        if not want:
            return
        found: dict[str, list[str]] = {t: [] for t in want}
        for raw in self.uniq:
            for t in _expand(raw):
                if t in want:
                    found[t].append(raw)
        for t, rs in found.items():
            holders = frozenset(rs)
            if holders:  # dict_keys & set walks the smaller side
                tfs = [sum(c[r] for r in c.keys() & holders) for c in self.counts]
            else:
                tfs = [0] * self.n
            df = sum(1 for x in tfs if x)
            self.tf[t] = tfs
            self.idf[t] = math.log(1.0 + (self.n - df + 0.5) / (df + 0.5))

    def weight(self, t: str, i: int) -> float:
        """BM25 contribution of term ``t`` to doc ``i`` (``prepare`` first)."""
        tf = self.tf[t][i]
        if not tf:
            return 0.0
        norm = K1 * (1.0 - B + B * self.lengths[i] / self.avgdl)
        return self.idf[t] * tf * (K1 + 1.0) / (tf + norm)


# --------------------------------------------------------------------------- fuzzy matching


def _within(a: str, b: str, k: int) -> bool:
    """Optimal-string-alignment distance of ``a`` and ``b`` is at most ``k`` (banded, early exit)."""
    la, lb = len(a), len(b)
    if abs(la - lb) > k:
        return False
    big = k + 1
    prev2: list[int] = []
    prev = [j if j <= k else big for j in range(lb + 1)]
    for i in range(1, la + 1):
        cur = [big] * (lb + 1)
        cur[0] = i if i <= k else big
        ca = a[i - 1]
        best = cur[0]
        for j in range(max(1, i - k), min(lb, i + k) + 1):
            v = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != b[j - 1]))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == b[j - 1]:
                v = min(v, prev2[j - 2] + 1)
            cur[j] = v if v < big else big
            if v < best:
                best = v
        if best > k:
            return False
        prev2, prev = prev, cur
    return prev[lb] <= k


def _fuzzy_terms(term: str, vocab: Sequence[str]) -> list[str]:
    """Vocabulary terms close to ``term``: edit distance (1 for 4-7 chars, 2 for 8+) or a shared
    prefix of at least 5 chars.  Short, numeric and CJK terms get no fuzzy matching.  (Its definition,
    every word measured: searches take :class:`_Near`'s, the same terms.)"""
    n = len(term)
    if n < 4 or term.isdigit() or _CJK_RE.search(term):
        return []
    k = 1 if n <= 7 else 2
    head = term[:5] if n >= 5 else None
    out = []
    for v in vocab:
        if v == term:
            continue
        if head is not None and v.startswith(head):
            out.append(v)
        elif abs(len(v) - n) <= k and _within(term, v, k):
            out.append(v)
    return out


class _Near:
    """A vocabulary indexed for :func:`_fuzzy_terms`: the terms a query term's could be found among
    without measuring its distance to every one (a few tenths of a second per term over the ~100,000
    words of a long session's originals, on the request's path).  An edit (a substitution, a
    transposition, an insertion or a deletion) touches at most two neighbouring characters, so a term
    within one edit of another of 5+ characters keeps its first two or its last two, and one within
    two edits (8+ characters) its first two, its last two or its middle two (shifted by at most two):
    only the words sharing one are measured (4 characters: the first or the last).  The same terms,
    in the vocabulary's order."""

    def __init__(self, vocab: Sequence[str]):
        self.vocab = vocab
        self._order: dict[str, int] | None = None
        self._by: dict[str, dict[str, list[str]]] = {}

    def _bucket(self, kind: str, key: str) -> list[str]:
        index = self._by.get(kind)
        if index is None:
            index = self._by[kind] = {}
            cut = {"head2": lambda v: v[:2], "tail2": lambda v: v[-2:], "head1": lambda v: v[:1],
                   "tail1": lambda v: v[-1:], "len": lambda v: str(len(v))}[kind]
            for v in self.vocab:
                index.setdefault(cut(v), []).append(v)
        return index.get(key, [])

    def terms(self, term: str) -> list[str]:
        n = len(term)
        if n < 4 or term.isdigit() or _CJK_RE.search(term):
            return []
        k = 1 if n <= 7 else 2
        if n == 4:
            cand = {*self._bucket("head1", term[:1]), *self._bucket("tail1", term[-1:])}
        else:
            cand = {*self._bucket("head2", term[:2]), *self._bucket("tail2", term[-2:])}
        if k == 2:
            mid = n // 2 - 1
            seg, lo = term[mid:mid + 2], max(0, mid - 2)
            for length in range(n - k, n + k + 1):
                cand.update(v for v in self._bucket("len", str(length)) if seg in v[lo:mid + 4])
        cand.discard(term)
        if self._order is None:
            self._order = {v: i for i, v in enumerate(self.vocab)}
        head = term[:5] if n >= 5 else None
        out = []
        for v in sorted(cand, key=self._order.__getitem__):
            if head is not None and v.startswith(head):
                out.append(v)
            elif abs(len(v) - n) <= k and _within(term, v, k):
                out.append(v)
        return out


# --------------------------------------------------------------------------- snippets


def _term_pattern(term: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![^\W_]){re.escape(term)}(?![^\W_])", re.IGNORECASE)


def _phrase_pattern(query: str) -> re.Pattern[str] | None:
    words = query.split()
    if not words:
        return None
    body = r"\s+".join(re.escape(w) for w in words)
    first, last = words[0][0], words[-1][-1]
    pre = rf"(?<!{_WORD})" if re.match(_WORD, first) else ""
    post = rf"(?!{_WORD})" if re.match(_WORD, last) else ""
    return re.compile(pre + body + post, re.IGNORECASE)


def _find(text: str, term: str) -> tuple[int, int] | None:
    """First occurrence of ``term``: standalone if possible, else anywhere (case-insensitive)."""
    m = _term_pattern(term).search(text) or re.search(re.escape(term), text, re.IGNORECASE)
    return m.span() if m else None


def _trim_left(s: str, cut_mid_word: bool) -> str:
    if cut_mid_word:
        sp = s.find(" ")
        if 0 <= sp <= 25:
            s = s[sp:]
    return s.lstrip()


def _trim_right(s: str, cut_mid_word: bool) -> str:
    if cut_mid_word:
        sp = s.rfind(" ")
        if sp >= 0 and len(s) - sp <= 25:
            s = s[:sp]
    return s.rstrip()


def snippet(text: str, span: tuple[int, int] | None, width: int = SNIPPET_CHARS) -> str:
    """About ``width`` chars of ``text`` centred on ``span``, whitespace collapsed, ``…`` at cuts."""
    start, end = span or (0, 0)
    budget = width - 2 * len(ELLIPSIS)
    core = _WS.sub(" ", text[start:end])
    if len(core) >= budget:
        return core[:budget].strip() + ELLIPSIS
    reach = 4 * width
    lo, hi = max(0, start - reach), min(len(text), end + reach)
    before = _WS.sub(" ", text[lo:start])
    after = _WS.sub(" ", text[end:hi])
    if lo == 0:
        before = before.lstrip()
    if hi == len(text):
        after = after.rstrip()
    room = budget - len(core)
    left = min(len(before), room // 2)
    right = min(len(after), room - left)
    left = min(len(before), room - right)
    lpart, rpart = before[len(before) - left:], after[:right]
    cut_l = left < len(before) or lo > 0
    cut_r = right < len(after) or hi < len(text)
    if cut_l:
        mid = left < len(before) and before[len(before) - left - 1] != " " and lpart[:1] != " "
        lpart = ELLIPSIS + _trim_left(lpart, mid)
    if cut_r:
        mid = right < len(after) and after[right] != " " and rpart[-1:] != " "
        rpart = _trim_right(rpart, mid) + ELLIPSIS
    return _WS.sub(" ", lpart + core + rpart).strip()


# --------------------------------------------------------------------------- search


def search(query: str, docs: Sequence[Doc], limit: int = 5) -> list[Hit]:
    """Rank ``docs`` for ``query``: BM25 + exact-phrase bonus, fuzzy fallback when nothing matches."""
    if not query or not query.strip() or not docs or limit <= 0:
        return []
    terms = list(dict.fromkeys(tokenize(query)))
    index = _Index(docs)
    index.prepare(terms)
    weight = index.weight
    n_docs = index.n

    # per doc: (score, term to centre the snippet on)
    scored: dict[int, tuple[float, str | None]] = {}
    for i in range(n_docs):
        total, best, best_w = 0.0, None, 0.0
        for t in terms:
            w = weight(t, i)
            total += w
            if w > best_w:
                best, best_w = t, w
        if total > 0:
            scored[i] = (total, best)

    spans = _phrase_bonus(query, docs, scored, bool(terms))

    if not scored:
        nearby = _Near(index.vocabulary())
        expansions = [(t, nearby.terms(t)) for t in terms]
        index.prepare([v for _, near in expansions for v in near])
        for i in range(n_docs):
            total, best, best_w = 0.0, None, 0.0
            for _, near in expansions:
                top, top_t = 0.0, None
                for v in near:
                    w = weight(v, i)
                    if w > top:
                        top, top_t = w, v
                total += top
                if top > best_w:
                    best, best_w = top_t, top
            if total > 0:
                scored[i] = (total * FUZZY_SCALE, best)

    return _hits(docs, scored, spans, limit)


def _phrase_bonus(query: str, docs: Sequence[Doc], scored: dict[int, tuple[float, str | None]],
                  any_terms: bool) -> dict[int, tuple[int, int]]:
    """Docs holding the query as an exact phrase rank above every other (``scored`` is updated);
    returns where the phrase stands in each of them.  Without terms every doc is a candidate."""
    phrase = _phrase_pattern(query)
    spans: dict[int, tuple[int, int]] = {}
    if phrase is None:
        return spans
    for i in (list(scored) if any_terms else range(len(docs))):
        m = phrase.search(docs[i].text)
        if m:
            spans[i] = m.span()
    if spans:
        bonus = max((sc for sc, _ in scored.values()), default=0.0) + 1.0
        for i in spans:
            base, best = scored.get(i, (0.0, None))
            scored[i] = (base + bonus, best)
    return spans


def _hits(docs: Sequence[Doc], scored: dict[int, tuple[float, str | None]], spans: dict[int, tuple[int, int]],
          limit: int) -> list[Hit]:
    """The best ``limit`` docs, each with a snippet around its phrase or its best term."""
    ranked = sorted(scored, key=lambda i: (-scored[i][0], i))[:limit]
    hits = []
    for i in ranked:
        score, best = scored[i]
        text = docs[i].text
        span = spans.get(i) or (_find(text, best) if best else None)
        hits.append(Hit(docs[i].key, docs[i].kind, score, snippet(text, span)))
    return hits


# --------------------------------------------------------------------------- SQLite FTS5 (bm25())
# The same search over an in-memory SQLite FTS5 index ranked by its bm25(), kept beside the
# hand-written one for scripts/bench_search.py, which measures both side by side (the README says
# which runs and why).  Documents are indexed as this module's own terms (identifier parts, CJK
# bigrams), each hex-encoded into one FTS5 token, so both see the same vocabulary; the phrase bonus,
# the fuzzy fallback and the snippets are shared.  Differences: FTS5 measures a document's length in
# index terms (parts included), and its idf has no +1 (a term in most documents weighs ~0).


def _fts_token(term: str) -> str:
    return "x" + term.encode().hex()


class FtsIndex:
    """An in-memory SQLite FTS5 index of ``docs``; :meth:`search` ranks them with ``bm25()``."""

    def __init__(self, docs: Sequence[Doc]) -> None:
        import sqlite3

        self.docs = list(docs)
        self.con = sqlite3.connect(":memory:")
        self.con.execute("CREATE VIRTUAL TABLE d USING fts5(t, tokenize='ascii')")
        vocab: dict[str, None] = {}
        rows = []
        for i, doc in enumerate(self.docs):
            toks = tokenize(doc.text)
            vocab.update(dict.fromkeys(toks))
            rows.append((i + 1, " ".join(map(_fts_token, toks))))
        self.con.executemany("INSERT INTO d(rowid, t) VALUES (?, ?)", rows)
        self.vocab = list(vocab)

    def close(self) -> None:
        self.con.close()

    def _weights(self, terms: Sequence[str]) -> dict[str, dict[int, float]]:
        """Per term, its bm25() weight in each document holding it (higher is better)."""
        sql = "SELECT rowid, -bm25(d) FROM d WHERE d MATCH ?"
        return {t: {r - 1: w for r, w in self.con.execute(sql, (f'"{_fts_token(t)}"',))} for t in terms}

    def search(self, query: str, limit: int = 5) -> list[Hit]:
        docs = self.docs
        if not query or not query.strip() or not docs or limit <= 0:
            return []
        terms = list(dict.fromkeys(tokenize(query)))
        w = self._weights(terms)
        scored: dict[int, tuple[float, str | None]] = {}
        for t in terms:
            for i, x in w[t].items():
                total, best = scored.get(i, (0.0, None))
                if best is None or x > w[best].get(i, 0.0):
                    best = t
                scored[i] = (total + x, best)

        spans = _phrase_bonus(query, docs, scored, bool(terms))

        if not scored:
            nearby = _Near(self.vocab)
            expansions = [(t, nearby.terms(t)) for t in terms]
            fw = self._weights([v for _, near in expansions for v in near])
            acc: dict[int, tuple[float, str, float]] = {}  # doc -> (total, best variant, its weight)
            for _, near in expansions:
                top: dict[int, tuple[float, str]] = {}  # per doc, the best variant of this query term
                for v in near:
                    for i, x in fw[v].items():
                        if x > top.get(i, (0.0, ""))[0]:
                            top[i] = (x, v)
                for i, (x, v) in top.items():
                    total, best, best_w = acc.get(i, (0.0, v, 0.0))
                    acc[i] = (total + x, v if x > best_w else best, max(x, best_w))
            scored = {i: (total * FUZZY_SCALE, best) for i, (total, best, _w) in acc.items()}

        return _hits(docs, scored, spans, limit)


def search_fts5(query: str, docs: Sequence[Doc], limit: int = 5) -> list[Hit]:
    """:func:`search` on SQLite FTS5 and its ``bm25()``: the index built for this call, as
    ``search_context`` would (its documents come from the store on every call)."""
    if not query or not query.strip() or not docs or limit <= 0:
        return []
    index = FtsIndex(docs)
    try:
        return index.search(query, limit)
    finally:
        index.close()
