"""#11: the canonical copy of a folded session's pass (``reconcile.Copy``) is encoded with msgspec
(every steady turn writes it), and its write goes in the turn's commit.

The copy's document: msgspec's text is json.dumps' where it is ASCII and UTF-8 where json.dumps
escaped; a document either wrote reads back as the same copy."""

from __future__ import annotations

import json

import pytest

from bili_addon.kernel.reconcile import Copy


def copies() -> list[Copy]:
    return [
        Copy(),
        Copy(refs=["m00001", "m00002"], fps=["ab", "cd"], items=[0, 1], ids=["x", "y_1"], streak=2),
        Copy(refs=["m00001"], fps=["é✓"], items=[3], ids=["ünï\u2028\x00\"\\"], witness=["m00001"],
             truncated=["m00007"], latched=True, streak=-1),
    ]


@pytest.mark.parametrize("c", copies())
def test_the_copy_reads_back_as_it_was_whoever_wrote_it(c):
    old = json.dumps(c.__dict__, separators=(",", ":"))  # as the copy was written before
    assert Copy.from_json(old) == c == Copy.from_json(c.to_json())
    assert json.loads(c.to_json()) == json.loads(old)
    if c.to_json().isascii():
        assert c.to_json() == old  # byte for byte where nothing was escaped


@pytest.mark.parametrize("doc", [None, "", "null", "[]", "{", '{"nope": 1}', '{"refs": 1', "NaN"])
def test_a_copy_that_does_not_read_is_empty(doc):
    assert Copy.from_json(doc) == Copy()
