#!/usr/bin/env python3
"""``search_context``'s search: the hand-written BM25 (``search``) against SQLite FTS5's ``bm25()``
(``search_fts5``), side by side, on the same documents and queries.

``search_context`` searches a conversation's summaries and folded originals, and builds its index on
every call (the documents come from the store each time), so a call's cost is build + query.  The
documents here are a seeded synthetic coding session (prose, shell output, file contents with paths
and identifiers, summaries) of 50, 500 and 5,000 parts; the queries are identifiers, words, a phrase
and misspellings (the fuzzy fallback).  Printed per size: the median time of one call for each and
their ratio; FTS5's query alone on an index built beforehand (what an index kept in the store, updated
as parts are folded, would cost per call); and how often the two agree on the top 5 (keys in order,
and as a set: FTS5 counts a document's length in index terms and its idf has no +1, so close scores
can swap).

    python scripts/bench_search.py            # ~1 minute
    python scripts/bench_search.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bili_addon.kernel.search import Doc, FtsIndex, _fuzzy_terms, _Index, _Near, search, search_fts5, tokenize  # noqa: E402

WORDS = ("cache warm prompt tokenizer parser config loader request response handler session fold summary "
         "decision error retry timeout value module test fixture branch merge commit deploy build index "
         "query vector window budget reminder ledger store schema migrate column table row").split()
IDENTS = ("read_file getHTTPServer src/app.py config/loader.ts kebab-case v1.2.3 parse_args TurnResult "
          "bili_addon.kernel.fold tests/test_cli.py max_tokens allow_hosts OptionsError run_child "
          "ensure_ca default_data_dir ResponseRewriter".split())


def corpus(n: int, rng: random.Random) -> list[Doc]:
    docs = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.15:
            words = [rng.choice(WORDS) for _ in range(rng.randint(40, 120))] + rng.sample(IDENTS, 3)
            docs.append(Doc(f"b{i}", " ".join(words) + ".", "summary"))
            continue
        size = rng.randint(20, 400) if kind < 0.6 else rng.randint(400, 2000)
        words = []
        for _ in range(size):
            r = rng.random()
            words.append(rng.choice(IDENTS) if r < 0.08 else f"line{rng.randint(1, 999)}" if r < 0.15
                         else rng.choice(WORDS))
        docs.append(Doc(f"m{i:05d}", " ".join(words), "original"))
    return docs


QUERIES = ["read_file", "getHTTPServer", "src/app.py", "loader", "tokenizer parser", "prompt cache warm",
           "OptionsError run_child", "timeout retry", "configuraton", "toknizer", "ResponseRewritr",
           "nothing-matches-here"]
MISSPELT = ["configuraton", "toknizer", "ResponseRewritr", "sesion handlr timeot", "deploymnt pipelne"]


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = (50, 500) if args.quick else (50, 500, 5000)
    repeat = 3 if args.quick else 5
    print(f"{'parts':>6}  {'hand-written':>13}  {'FTS5 bm25()':>12}  {'FTS5/hand':>9}  {'FTS5 query only':>15}  "
          f"{'same top-5 (order)':>18}  {'same top-5 (set)':>16}")
    for n in sizes:
        docs = corpus(n, random.Random(n))
        hand = fts = query_only = 0.0
        order = same_set = 0
        index = FtsIndex(docs)
        for q in QUERIES:
            a, b = search(q, docs), search_fts5(q, docs)
            assert [h.key for h in b] == [h.key for h in index.search(q)]
            order += [h.key for h in a] == [h.key for h in b]
            same_set += {h.key for h in a} == {h.key for h in b}
            hand += median_ms(lambda: search(q, docs), repeat)
            fts += median_ms(lambda: search_fts5(q, docs), repeat)
            query_only += median_ms(lambda: index.search(q), repeat)
        index.close()
        k = len(QUERIES)
        print(f"{n:>6}  {hand / k:>10.2f} ms  {fts / k:>9.2f} ms  {fts / hand:>8.2f}x  {query_only / k:>12.2f} ms  "
              f"{order:>10}/{k:<7}  {same_set:>8}/{k:<7}")
    # the fuzzy fallback's lookup (a query matching nothing as written): every word of the vocabulary
    # measured (_fuzzy_terms, as it was) against the indexed lookup searches take (_Near, made once per
    # search: its buckets included), same terms
    print()
    print(f"{'parts':>6}  {'words':>7}  {'fuzzy, every word':>17}  {'fuzzy, indexed':>14}  {'ratio':>6}")
    for n in sizes:
        docs = corpus(n, random.Random(n))
        vocab = _Index(docs).vocabulary()
        terms = [t for q in MISSPELT for t in tokenize(q)]
        assert [_Near(vocab).terms(t) for t in terms] == [_fuzzy_terms(t, vocab) for t in terms]
        every = median_ms(lambda: [_fuzzy_terms(t, vocab) for t in terms], repeat)
        indexed = median_ms(lambda: (lambda near: [near.terms(t) for t in terms])(_Near(vocab)), repeat)
        print(f"{n:>6}  {len(vocab):>7,}  {every:>14.2f} ms  {indexed:>11.2f} ms  {every / indexed:>5.1f}x")
    # a long session's vocabulary (hashes, paths, generated names): 100,000 distinct words
    rng = random.Random(7)
    vocab = list(dict.fromkeys("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12)))
                               for _ in range(100_000)))
    terms = [t for q in MISSPELT for t in tokenize(q)]
    every = median_ms(lambda: [_fuzzy_terms(t, vocab) for t in terms], 1 if args.quick else 3)
    indexed = median_ms(lambda: (lambda near: [near.terms(t) for t in terms])(_Near(vocab)), 1 if args.quick else 3)
    print(f"{'random':>6}  {len(vocab):>7,}  {every:>14.2f} ms  {indexed:>11.2f} ms  {every / indexed:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
