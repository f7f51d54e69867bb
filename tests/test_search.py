"""Full-text search behind the ``search_context`` tool."""

from __future__ import annotations

import pytest

from bili_addon.kernel import search as search_mod
from bili_addon.kernel.search import Doc, Hit, snippet, tokenize


@pytest.fixture(params=["python", "fts5"], autouse=True)
def engine(request, monkeypatch):
    """Every test runs on both implementations: the hand-written BM25 and SQLite FTS5's bm25()
    (scripts/bench_search.py measures them side by side)."""
    fn = search_mod.search if request.param == "python" else search_mod.search_fts5
    monkeypatch.setitem(globals(), "search", fn)
    return request.param

FILLER = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor. "


def keys(hits: list[Hit]) -> list[str]:
    return [h.key for h in hits]


@pytest.fixture
def docs() -> list[Doc]:
    return [
        Doc("b1", "Decided to keep the cache warm between turns.", "summary"),
        Doc("m00001", "Edited src/app.py so that it calls read_file before writing.", "original"),
        Doc("b2", "The configuration loader lives in config/loader.ts and uses kebab-case keys.", "summary"),
        Doc("m00002", "用户要求修改配置文件,然后重新启动服务。", "original"),
        Doc("b3", "getHTTPServer returns the server; version bumped to v1.2.3.", "summary"),
    ]


def test_tokenizer_keeps_identifiers_whole_and_in_parts():
    toks = tokenize("Open src/app.py, call read_file and getHTTPServer; bump v1.2.3 kebab-case")
    for t in ("src/app.py", "app.py", "src", "app", "py", "read_file", "read", "file",
              "gethttpserver", "get", "http", "server", "v1.2.3", "2", "3", "kebab-case", "kebab", "case"):
        assert t in toks, t
    assert tokenize("Hello WORLD") == ["hello", "world"]
    cjk = tokenize("配置文件")
    assert {"配", "置", "文", "件", "配置", "置文", "文件"} <= set(cjk)


@pytest.mark.parametrize("query", ["read file", "read_file", "READ_FILE", "app.py", "src/app.py", "app"])
def test_identifiers_found_by_parts_and_whole(docs, query):
    hits = search(query, docs)
    assert hits and hits[0].key == "m00001"
    assert hits[0].kind == "original"


def test_camel_case_and_kebab_case_parts(docs):
    assert keys(search("http server", docs))[:1] == ["b3"]
    assert keys(search("gethttpserver", docs)) == ["b3"]
    assert keys(search("kebab", docs)) == ["b2"]
    assert keys(search("1.2.3", docs)) == ["b3"]


def test_bm25_short_repetitive_doc_beats_long_single_mention():
    long_doc = Doc("long", FILLER * 40 + "The tokenizer was rewritten. " + FILLER * 40)
    short_doc = Doc("short", "tokenizer tokenizer tokenizer: the tokenizer again")
    other = Doc("other", "unrelated notes about deployment")
    hits = search("tokenizer", [long_doc, short_doc, other])
    assert keys(hits) == ["short", "long"]
    assert hits[0].score > hits[1].score > 0


def test_exact_phrase_ranks_first():
    scattered = Doc("scattered", "cache cache cache. The prompt was long. Warm it. cache prompt warm prompt cache")
    exact = Doc("exact", FILLER * 5 + "We keep the prompt cache warm between turns. " + FILLER * 5)
    hits = search("prompt cache warm", [scattered, exact])
    assert keys(hits) == ["exact", "scattered"]
    assert "prompt cache warm" in hits[0].snippet


def test_phrase_matching_collapses_whitespace_and_case():
    d = [Doc("a", "warm cache and prompt here"), Doc("b", "The Prompt\n\n   Cache is warm")]
    assert keys(search("prompt cache", d))[0] == "b"


def test_fuzzy_fallback_finds_misspelling(docs):
    hits = search("configuraton", docs)
    assert hits and hits[0].key == "b2"
    assert "configuration" in hits[0].snippet
    assert keys(search("loadr", docs)) == ["b2"]  # distance 1 on a 5-char term


def test_fuzzy_fallback_has_limits(docs):
    assert keys(search("cach", docs)) == ["b1"]  # 4 chars: distance 1 allowed
    assert keys(search("cahce", docs)) == ["b1"]  # a transposition counts as one edit
    assert search("xyz", docs) == []  # too short for fuzzy
    assert search("completelyunrelated", docs) == []


def test_fuzzy_does_not_replace_literal_hits():
    d = [Doc("lit", "the configuraton typo appears here"), Doc("ok", "configuration done right")]
    assert keys(search("configuraton", d)) == ["lit"]


def test_cjk_query_finds_cjk_doc(docs):
    hits = search("配置文件", docs)
    assert keys(hits)[:1] == ["m00002"]
    assert "配置文件" in hits[0].snippet
    assert keys(search("启动", docs)) == ["m00002"]


def test_limit_respected():
    d = [Doc(f"m{i:05d}", f"note {i} about the widget") for i in range(20)]
    assert len(search("widget", d)) == 5
    assert len(search("widget", d, limit=3)) == 3
    assert search("widget", d, limit=0) == []


def test_ties_keep_input_order():
    d = [Doc(k, "same text about widgets") for k in ("z", "a", "m")]
    assert keys(search("widgets", d)) == ["z", "a", "m"]


@pytest.mark.parametrize("query", ["", "   ", "\n\t"])
def test_empty_query_returns_nothing(docs, query):
    assert search(query, docs) == []


def test_empty_docs_and_no_tokens(docs):
    assert search("anything", []) == []
    assert search("!!!", docs) == []
    assert search("cache", [Doc("e", "")]) == []


def test_zero_score_docs_not_returned(docs):
    hits = search("cache", docs)
    assert keys(hits) == ["b1"]


def test_snippets_contain_term_and_are_bounded():
    text = FILLER * 200 + "  the\n\n needle_in_haystack   sits here  " + FILLER * 200
    hits = search("needle", [Doc("big", text)])
    snip = hits[0].snippet
    assert "needle_in_haystack" in snip
    assert len(snip) <= 240
    assert snip.startswith("…") and snip.endswith("…")
    assert "  " not in snip and "\n" not in snip


def test_snippet_at_doc_edges_has_no_leading_ellipsis():
    text = "needle first. " + FILLER * 20
    snip = search("needle", [Doc("d", text)])[0].snippet
    assert snip.startswith("needle first.")
    assert snip.endswith("…") and len(snip) <= 240
    short = search("needle", [Doc("s", "  a short   needle doc ")])[0].snippet
    assert short == "a short needle doc"


def test_snippet_helper_truncates_huge_match():
    s = snippet("x" * 1000, (0, 1000))
    assert len(s) <= 240 and s.endswith("…")


def test_huge_doc_is_searchable():
    big = Doc("huge", ("lorem ipsum " * 8000) + "the rare_token_xyz lives here" + (" dolor sit" * 2000))
    assert len(big.text) > 100_000
    hits = search("rare_token_xyz", [Doc("small", "nothing"), big])
    assert keys(hits) == ["huge"]
    assert "rare_token_xyz" in hits[0].snippet


def test_output_is_deterministic(docs):
    many = docs * 30
    first = search("config loader cache", many, limit=10)
    assert first == search("config loader cache", many, limit=10)
    assert first == search("config loader cache", list(many), limit=10)


def test_search_context_leaves_the_fold_coverage_every_turn_reads_as_it_was():
    """``fold.coverage`` gives every caller the same dict while the blocks are the same; the
    search named the owners of a retired block's originals by adding them to it, so the plan of
    every later turn took those refs for folded and dropped a message of theirs back on the wire
    with nothing in its place."""
    from bili_addon.kernel import surfaces
    from bili_addon.kernel.fold import Block, coverage

    retired = Block("b1", 1, "s" * 60, "", ["m00002", "m00003"], ["m00002", "m00003"], [], "m00002", "m00003",
                    active=False, retired=True)
    live = Block("b2", 1, "t" * 60, "", ["m00007"], ["m00007"], [], "m00007", "m00007")
    blocks = [retired, live]
    before = dict(coverage(blocks))
    originals = [("m00002", "", "", "", 0, "the secret config value"), ("m00007", "", "", "", 0, "other")]
    out = surfaces.search_context({"query": "config"}, blocks, lambda refs: originals)
    assert "m00002 (inside b1)" in out  # (the retired block still names its originals)
    assert coverage(blocks) == before == {"m00007": live}


def test_the_indexed_fuzzy_lookup_finds_exactly_the_measured_terms():
    """``_Near`` measures only the words sharing a part an edit cannot have touched: the same terms, in
    the same order, as measuring every word (``_fuzzy_terms``), over random vocabularies and terms one
    or two edits away from their words (transpositions, insertions and deletions at either end)."""
    import random

    from bili_addon.kernel.search import _fuzzy_terms, _Near

    rng = random.Random(3)
    alpha = "abcde"

    def word() -> str:
        return "".join(rng.choice(alpha) for _ in range(rng.randint(3, 12)))

    for _ in range(150):
        vocab = list(dict.fromkeys(word() for _ in range(300)))
        near = _Near(vocab)
        for _ in range(20):
            t = list(rng.choice(vocab)) if rng.random() < 0.6 else list(word())
            for _ in range(rng.randint(0, 2)):
                i = rng.randrange(len(t) + 1)
                op = rng.randint(0, 3)
                if op == 0 and i < len(t):
                    t[i] = rng.choice(alpha)
                elif op == 1:
                    t.insert(i, rng.choice(alpha))
                elif op == 2 and i < len(t) and len(t) > 1:
                    del t[i]
                elif op == 3 and i < len(t) - 1:
                    t[i], t[i + 1] = t[i + 1], t[i]
            term = "".join(t)
            assert near.terms(term) == _fuzzy_terms(term, vocab), term
