"""Fold coverage under churn: which inbound parts are the ones the blocks already cover?

Hosts re-serialise their history (ids re-minted, JSON re-encoded, images placeholdered, the oldest
messages dropped), so content-hash refs change and a fold's coverage silently stops matching.  This
layer keeps a canonical copy of the last pass (per position: a fingerprint of
``role|toolName|canonical text``) and re-anchors a missing covered ref onto its new counterpart
only where that is verified: by position against the stored copy, by a unique tool-call id, or by
a unique normalised identity.  What cannot be verified re-enters the wire; a guess never claims.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import msgspec

from bili_addon.kernel.fold import Block, PartView, View, coverage
from bili_addon.wire.base import IMAGE, REASONING, TEXT, TOOL_CALL, TOOL_RESULT

SIDE_REQUEST_MAX_ITEMS = 10  # smaller requests (titles, probes) never move the copy
SHAPE_MASS_MIN = 8  # a drift this large gets the shape tier and a verdict
COLLAPSE_MIN = 10
_encode = msgspec.json.Encoder().encode  # the copy's document (Copy.to_json, from_json)
_decode = msgspec.json.Decoder().decode


def side_request(items: int, before: int, same_opening: bool) -> bool:
    """Whether a request of ``items`` conversation items, in a session whose conversation last had
    ``before``, is a side request (a title, a probe: an agent's small request under its session's id),
    not a turn of the conversation: fewer than :data:`SIDE_REQUEST_MAX_ITEMS`, where the conversation
    has more, and not opening as it does (``same_opening``: its first message is the conversation's:
    a rewind to an early message, whose turns are the conversation's from then on).  Not a request as
    short as the conversation, whatever its model: a title request sent before the conversation's first
    turn would then take that turn for the side request (Claude Code, opencode send one at the start)."""
    return items < SIDE_REQUEST_MAX_ITEMS and before > items and not same_opening


# -- fingerprints ------------------------------------------------------------------------------

def normalize_text(t: str) -> str:
    """NFC, one kind of line break, each run of other whitespace one space, no blank lines, no space
    at a line's ends (str.split's whitespace is the regex ``\\s``: the same as three regex passes,
    at a fraction of their time on a conversation's first pass)."""
    t = unicodedata.normalize("NFC", t or "")
    if "\r" in t:
        t = t.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(filter(None, (" ".join(line.split()) for line in t.split("\n"))))


def canonical_text(text: str) -> str:
    """JSON-shaped text key-sorted and compacted; prose normalised."""
    s = text.lstrip()
    # (a JSON text ends with its closing bracket, but for JSON whitespace, which rstrip strips too:
    # prose that only opens with one, ``[Image #1] ...``, is not parsed in vain)
    if s[:1] in ("{", "[") and s.rstrip()[-1:] in ("}", "]"):
        try:
            return json.dumps(json.loads(s), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (ValueError, RecursionError):
            pass
    return normalize_text(text)


def _h(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def fingerprint(p: PartView) -> str:
    """Positional fingerprint: tool-call ids and the content-type literal excluded (they re-encode
    across codecs); reasoning on its role alone (providers re-mint what stands for it)."""
    if p.ctype == REASONING:
        return _h(p.role, "reasoning")
    if p.ctype == IMAGE:
        return _h(p.role, "image", p.text)
    if p.ctype == TOOL_RESULT and cleared(p.text):  # (every clearing placeholder alike: a file's path says nothing)
        return _CLEARED_FPS.get(p.role) or _h(p.role, "", CLEARED)
    return _h(p.role, p.tool_name, canonical_text(p.text))


def norm_identity(p: PartView, with_call_id: bool = True) -> str:
    return _h(p.role, p.ctype, p.tool_name, p.tool_call_id if with_call_id else "", normalize_text(p.text))


def words(text: str) -> Counter:
    """The bag of whitespace-separated tokens: layout may change, no character may."""
    return Counter(text.lower().split())


def simhash(text: str) -> int:
    v = [0] * 64
    for w, n in words(text).items():
        h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "big")
        for i in range(64):
            v[i] += n if h >> i & 1 else -n
    return sum(1 << i for i in range(64) if v[i] > 0)


# -- the stored copy ---------------------------------------------------------------------------

@dataclass
class Copy:
    """The canonical copy of a pass: part refs and their fingerprints, in conversation order."""

    refs: list[str] = field(default_factory=list)
    fps: list[str] = field(default_factory=list)
    items: list[int] = field(default_factory=list)  # which item each part belonged to
    ids: list[str] = field(default_factory=list)  # the pass's ledger ids (echo vs new instance)
    witness: list[str] = field(default_factory=list)  # frozen old-order tail of a drift episode
    truncated: list[str] = field(default_factory=list)  # covered refs the host dropped (oldest slice)
    latched: bool = False  # total collapse: folding paused until the history aligns again
    # the ledger ids of the newest pass on a branch the host rewound to (verdict "rewound"), while the
    # copy stays the first branch's (so that branch can come back): what the branch holds is no new
    # instance of its own folded words when a pass resolves it from scratch (a restart, a lost memo)
    branch: list[str] = field(default_factory=list)
    streak: int = 0
    paused: int = 0  # passes in a row latched (folding paused): kernel/coverage.py ends the pause at RETIRE_AFTER
    branched: int = 0  # passes in a row "rewound": kernel/coverage.py takes the branch for the copy at ADOPT_AFTER
    # what ending a pause put aside: the copy as it was (its fields) and the blocks it retired; when a later
    # pass holds those blocks whole again (the conversation is back: a subagent's turns under its id had
    # latched the pause), they stand again and that copy is the copy again (kernel/coverage.py)
    parked: dict = field(default_factory=dict)

    def to_json(self) -> str:
        # msgspec: 1/7 of json.dumps' time on a copy of 1,500 parts (written every steady turn of a
        # folded session); the same text where it is ASCII (refs, hex fingerprints and ids), UTF-8
        # where json.dumps escaped: both read back the same.  The fields added since a copy was last a
        # plain document are left out at their defaults: a bili of before them reads it whole (it took
        # a document with a field it does not know for no copy at all)
        doc = self.__dict__
        if not (doc["branch"] or doc["paused"] or doc["branched"] or doc["parked"]):
            doc = {k: v for k, v in doc.items() if k not in _LATER}
        return _encode(doc).decode()

    @classmethod
    def from_json(cls, doc: str | None) -> "Copy":
        if not doc:
            return cls()
        try:
            got = _decode(doc)  # (a document json.dumps wrote reads the same)
            return cls(**{k: v for k, v in got.items() if k in _FIELDS})  # (a later bili's fields: not ours)
        except (TypeError, ValueError, AttributeError):  # (msgspec.DecodeError is a ValueError)
            return cls()


_LATER = ("branch", "paused", "branched", "parked")  # Copy's fields of schema 13's bili (see to_json)
_FIELDS = frozenset(Copy.__dataclass_fields__)


@dataclass
class Outcome:
    claims: dict[str, str] = field(default_factory=dict)  # old covered ref -> new ref
    by: Counter = field(default_factory=Counter)  # how each claim was made
    missing: int = 0
    covered: int = 0  # covered messages of the active blocks
    unmatched: list[str] = field(default_factory=list)
    suspects: int = 0
    verdict: str = ""  # "", "transformed", "truncated", "rewound", "drift", "collapse", "recovered", "restarted",
    # "adopted"
    # blocks not rendered for this request: their range the host truncated away, or a rewind left
    snoozed: set[str] = field(default_factory=set)

    @property
    def drifted(self) -> bool:
        return self.missing > 0


def reconcile(view: View, blocks: list[Block], copy: Copy, originals, fresh: set[str] = frozenset()) -> Outcome:
    """Plan claims for covered refs that went missing. ``originals(refs)`` gives the stored
    originals of folded parts: ``(ref, role, ctype, tool_name, tool_call_id, text, tokens)``;
    ``fresh``: refs of parts that are new instances of folded words (never claimed by content)."""
    parts: list[PartView] = [p for it in view.items for p in it.parts]
    new_refs = [p.ref for p in parts]
    present = set(new_refs)
    cov = coverage(blocks)
    if copy.truncated:  # what the host truncated and now sends again is simply present
        copy.truncated = [r for r in copy.truncated if r not in present]
    gone = set(copy.truncated)
    # the ref a covered message has now: itself, or what an earlier verified claim moved it to
    now_of: dict[str, str] = {}
    for b in blocks:
        if b.active:
            now_of.update(b.claimed)
    orig_of = {new: old for old, new in now_of.items()}
    missing = [r for b in blocks if b.active for r in b.covered
               if r not in present and now_of.get(r) not in present and r not in gone]
    missing = list(dict.fromkeys(missing))
    out = Outcome(missing=len(missing), covered=len({r for b in blocks if b.active for r in b.covered}))
    if not missing:
        return out
    missing_set = set(missing)
    claimed_new: set[str] = set()

    def claim(old: str, new: str, how: str) -> None:
        out.claims[old] = new
        claimed_new.add(new)
        out.by[how] += 1

    # a ref the canonical copy has is a message of its own there: a covered message the host re-mints or
    # re-encodes comes back under a ref new to it (the same words said again, a live twin the host's
    # truncation moved up, are never what a covered one became)
    own = set(copy.refs)

    def free(new: str) -> bool:
        return new not in cov and new not in claimed_new and new not in fresh and new not in own

    new_fps = [fingerprint(p) for p in parts]
    old_refs, old_fps = copy.refs, copy.fps
    if old_refs and len(old_refs) == len(old_fps):
        prefix = 0
        while prefix < min(len(old_refs), len(new_refs)) and old_refs[prefix] == new_refs[prefix]:
            prefix += 1
        # pass 0, head first: aligned positions whose fingerprints match, until the first mismatch
        i = prefix
        while i < min(len(old_refs), len(new_refs)) and old_fps[i] == new_fps[i]:
            o, n = orig_of.get(old_refs[i], old_refs[i]), new_refs[i]
            if o in missing_set and o != n and free(n):
                claim(o, n, "position")
            i += 1
        # ... and tail first
        j = 1
        while j <= min(len(old_refs), len(new_refs)) - prefix and old_fps[-j] == new_fps[-j]:
            o, n = orig_of.get(old_refs[-j], old_refs[-j]), new_refs[-j]
            if o in missing_set and o not in out.claims and o != n and free(n):
                claim(o, n, "position")
            j += 1

    rest = [r for r in missing if r not in out.claims]
    anchors = {row[0]: row for row in originals(rest)} if rest else {}
    candidates = [p for p in parts if free(p.ref)]

    # pass 1: a tool-call id names exactly one inbound part of the same role
    by_call: dict[tuple[str, str], list[PartView]] = defaultdict(list)
    for p in candidates:
        if p.tool_call_id:
            by_call[(p.role, p.tool_call_id)].append(p)
    for r in rest:
        a = anchors.get(r)
        if a is None or not a[4]:
            continue
        usable = [p for p in by_call.get((a[1], a[4]), []) if free(p.ref)]
        if len(usable) == 1 and fingerprint(usable[0]) == fingerprint(_anchor_part(a)):
            claim(r, usable[0].ref, "call id")

    _cleared_pass(rest, anchors, parts, free, claim, copy, own, now_of)

    # pass 2: the normalised identity, k-th to k-th, with a length guard
    by_norm: dict[str, list[PartView]] = defaultdict(list)
    for p in candidates:
        if p.ctype != IMAGE:
            by_norm[norm_identity(p)].append(p)
    taken: Counter = Counter()
    for r in rest:
        a = anchors.get(r)
        if a is None or r in out.claims or a[2] == IMAGE:  # "[image]" says nothing of which image
            continue
        key = norm_identity(_anchor_part(a))
        group = [p for p in by_norm.get(key, []) if free(p.ref)]
        if group and abs(len(group[0].text) - len(a[5])) <= max(256, len(a[5]) // 4):
            claim(r, group[0].ref, "normalised")
            taken[key] += 1

    _turn_pass(rest, anchors, candidates, free, claim, copy)
    _image_variant_pass(rest, anchors, candidates, free, claim)

    _with_items(missing, anchors, out, copy, view, free, claim, now_of)
    unmatched = [r for r in missing if r not in out.claims]
    # a covered call whose twin came back under another call id: named, never claimed (#2396)
    no_id = defaultdict(set)
    for p in candidates:
        if p.tool_call_id and free(p.ref):
            no_id[norm_identity(p, with_call_id=False)].add(p.tool_call_id)
    for r in unmatched:
        a = anchors.get(r)
        if a is not None and a[4]:
            twins = no_id.get(norm_identity(_anchor_part(a), with_call_id=False), set())
            if twins - {a[4]}:
                out.suspects += 1

    if len(unmatched) >= SHAPE_MASS_MIN or (unmatched and len(unmatched) == len(missing)):
        _shape_tier(unmatched, anchors, parts, free, claim, out, view)
        _with_items(missing, anchors, out, copy, view, free, claim, now_of)
        unmatched = [r for r in missing if r not in out.claims]
    out.unmatched = unmatched
    return out


PLACEHOLDER = "\n(image omitted: model does not support images)"


def _with_items(missing, anchors, out: Outcome, copy: Copy, view: View, free, claim, now_of) -> None:
    """Parts without words of their own (reasoning, images) follow their message: once a sibling
    of the same old item was verified, they take the parts of their kind in the new item, in order,
    or, where the new item has none (reasoning merged into the text, an image replaced by a
    placeholder line), the sibling's claim: explained by the transformation."""
    if len(copy.items) != len(copy.refs):
        return
    item_of = dict(zip(copy.refs, copy.items))
    new_item = {p.ref: k for k, it in enumerate(view.items) for p in it.parts}

    def old_item(r: str):
        return item_of.get(now_of.get(r, r), item_of.get(r))

    anchor_of_item: dict = defaultdict(list)
    for o, n in out.claims.items():
        anchor_of_item[old_item(o)].append(n)
    for r in missing:
        a = anchors.get(r)
        if r in out.claims or a is None or a[2] not in (REASONING, IMAGE):
            continue
        targets = anchor_of_item.get(old_item(r))
        if not targets:
            continue
        k = new_item.get(targets[0])
        same = [p.ref for p in (view.items[k].parts if k is not None else []) if p.ctype == a[2] and free(p.ref)]
        if same:
            claim(r, same[0], "with its item")
        else:
            out.claims[r] = targets[0]
            out.by["with its item"] += 1


def cleared(text: str) -> bool:
    """Whether a tool result's text is what a host put in place of a result it cleared from its history
    (Claude Code's clearing of old tool results, its "microcompact": the result's content becomes
    ``[Old tool result content cleared]``, or a ``<persisted-output>`` note naming the file it saved
    the result to)."""
    return text == CLEARED or (text.startswith(PERSISTED) and text.rstrip().endswith(PERSISTED_END))


CLEARED = "[Old tool result content cleared]"
PERSISTED, PERSISTED_END = "<persisted-output>", "</persisted-output>"
# a cleared tool result's fingerprint (fingerprint: as the plain placeholder's always was), by role: for telling
# a truncation or a rewind from a drift (verdict), a cleared result matches whatever stood at its place (the host
# clears results as it goes: a rewind's branch, a truncated history hold them cleared where the copy has them
# whole, or back whole where the copy has them cleared); no claim is ever made by it
_CLEARED_FPS = {r: _h(r, "", CLEARED) for r in ("tool", "user")}
_WILD = frozenset(_CLEARED_FPS.values())


def _alike(a: str, b: str) -> bool:
    """Two fingerprints at one place, for the verdict: the same, or either a cleared tool result's."""
    return a == b or a in _WILD or b in _WILD


def _cleared_pass(rest, anchors, parts: list[PartView], free, claim, copy: Copy, own: set[str], now_of) -> None:
    """A covered tool result the host cleared in place: its call's id names exactly one inbound result,
    whose text is a clearing placeholder (:func:`cleared`), the call it answers is the copy's own part
    (the same ref: the same words and id), unique on both sides, and the result stands as far after
    that call as it stood in the copy.  The result is that message with its content cleared, the fold
    over it stands (its summary said more than the placeholder does); a per-answer id (``call_0``) given
    twice, or a call the host changed, claims nothing."""
    if not rest or len(copy.items) != len(copy.refs):
        return
    want = {}
    for r in rest:
        a = anchors.get(r)
        if a is not None and a[2] == TOOL_RESULT and a[4] and not cleared(a[5]):
            want[r] = a
    if not want:
        return
    ids = {a[4] for a in want.values()}
    calls: dict[str, list[int]] = defaultdict(list)
    results: dict[str, list[int]] = defaultdict(list)
    for k, p in enumerate(parts):
        if p.tool_call_id in ids:
            if p.ctype == TOOL_CALL:
                calls[p.tool_call_id].append(k)
            elif p.ctype == TOOL_RESULT:
                results[p.tool_call_id].append(k)
    old_at = {ref: i for i, ref in enumerate(copy.refs)}
    for r, a in want.items():
        got, call = results.get(a[4], ()), calls.get(a[4], ())
        if len(got) != 1 or len(call) != 1:
            continue
        p, c = parts[got[0]], parts[call[0]]
        if p.role != a[1] or not cleared(p.text) or not free(p.ref) or c.ref not in own:
            continue
        i, j = old_at.get(now_of.get(r, r)), old_at.get(c.ref)
        if i is None or j is None:  # (a pass's refs are unique: each part its own)
            continue
        if i - j == got[0] - call[0] > 0:
            claim(r, p.ref, "cleared")


def _turn_pass(rest, anchors, candidates, free, claim, copy: Copy) -> None:
    """Model switch: an assistant turn's reasoning and text merged into one text (with a newline
    or seamlessly).  Claimed only when exactly one inbound assistant text equals the merge."""
    if len(copy.items) != len(copy.refs):
        return
    item_of = dict(zip(copy.refs, copy.items))
    by_item: dict[int, list[tuple]] = defaultdict(list)
    for r in rest:
        a = anchors.get(r)
        if a is not None and a[1] == "assistant" and a[2] in (REASONING, TEXT) and r in item_of:
            by_item[item_of[r]].append(a)
    texts: dict[str, list[PartView]] = defaultdict(list)
    for p in candidates:
        if p.role == "assistant" and p.ctype == TEXT:
            texts[normalize_text(p.text)].append(p)
    for group in by_item.values():
        reasoning = "".join(a[5] for a in group if a[2] == REASONING)
        text = "".join(a[5] for a in group if a[2] == TEXT)
        if not reasoning or not text:
            continue
        for merged in (reasoning + "\n" + text, reasoning + text, reasoning + "\n\n" + text):
            hits = [p for p in texts.get(normalize_text(merged), []) if free(p.ref)]
            if len(hits) == 1:
                for a in group:
                    claim(a[0], hits[0].ref, "turn")
                break


def _image_variant_pass(rest, anchors, candidates, free, claim) -> None:
    """Model switch: a user text whose images were replaced by a placeholder line."""
    texts: dict[str, list[PartView]] = defaultdict(list)
    for p in candidates:
        if p.role == "user" and p.ctype == TEXT:
            texts[p.text].append(p)
    for r in rest:
        a = anchors.get(r)
        if a is None or a[1] != "user" or a[2] != TEXT:
            continue
        for variant in (a[5] + PLACEHOLDER, a[5].removesuffix(PLACEHOLDER)):
            hits = [p for p in texts.get(variant, []) if free(p.ref)]
            if len(hits) == 1 and variant != a[5]:
                claim(r, hits[0].ref, "image placeholder")
                break


def _anchor_part(a: tuple) -> PartView:
    ref, role, ctype, tool_name, call_id, text, tokens = a
    return PartView(ref, role, ctype, tool_name, call_id, text, tokens)


def _shape_tier(unmatched, anchors, parts, free, claim, out: Outcome, view: View) -> None:
    """A mass of covered refs went missing at once: pair residual prose in order under strict
    word-bag equality (plus simhash, role and length), and images k-th to k-th between verified
    flanks.  A systematic mutation (a suffix stamped on every message) changes the word bag, so it
    is never claimed."""
    pos = {p.ref: k for k, p in enumerate(parts)}
    cursor = 0
    for r in unmatched:
        a = anchors.get(r)
        if a is None or a[2] not in (TEXT,) or not a[5].strip():
            continue
        want, sh = words(a[5]), simhash(a[5])
        for k in range(cursor, len(parts)):
            p = parts[k]
            if not free(p.ref) or p.role != a[1] or p.ctype != TEXT:
                continue
            if abs(len(p.text) - len(a[5])) > max(64, len(a[5]) // 8):
                continue
            if words(p.text) == want and bin(simhash(p.text) ^ sh).count("1") <= 8:
                claim(r, p.ref, "shape")
                cursor = k + 1
                break
    # textless parts (images) between claimed flanks, when the counts agree exactly
    claimed_pos = sorted(pos[n] for n in out.claims.values() if n in pos)
    images_old = [r for r in unmatched if r not in out.claims and anchors.get(r) and anchors[r][2] == IMAGE]
    if images_old and len(claimed_pos) >= 2:
        lo, hi = claimed_pos[0], claimed_pos[-1]
        images_new = [p.ref for p in parts[lo:hi] if p.ctype == IMAGE and free(p.ref)]
        if len(images_new) == len(images_old):
            for o, n in zip(images_old, images_new):
                claim(o, n, "image flank")


def verdict(out: Outcome, view: View, blocks: list[Block], copy: Copy, originals) -> None:
    """Classify what no channel verified: explained by transformation, benign truncation of the
    oldest slice (its blocks snooze), or drift; total collapse latches a pause."""
    if not out.missing:
        if copy.latched:
            out.verdict = "recovered"
        copy.latched, copy.streak, copy.witness = False, 0, []
        return
    if not out.unmatched:
        out.verdict = "transformed" if out.by else ""
        copy.streak = 0
        return
    new_fps = [fingerprint(p) for it in view.items for p in it.parts]
    # (the words of a part the copy has under its ref are that message's own: a live twin of a dropped
    # covered one, "continue" said again, is no sign the covered one came back in another form)
    own = set(copy.refs)
    texts = {p.text for it in view.items for p in it.parts if p.ref not in own}
    residual = {row[0]: row for row in originals(out.unmatched)}
    near_dups = any(row[5] in texts for row in residual.values())
    head_aligned = _heads_inbound(copy.fps if not copy.witness else copy.witness, new_fps)
    cov = coverage(blocks)
    if not near_dups and head_aligned:
        out.verdict = "truncated"
        # (the history aligns with the copy again: a pause a collapse latched ends with this pass, as
        # the next one, finding the truncated refs gone, would end it: not one request later)
        copy.latched = False
        copy.truncated = sorted(set(copy.truncated) | set(out.unmatched))
        for r in out.unmatched:
            b = cov.get(r)
            if b is not None and not any(x in view.pos for x in b.coverage):
                out.snoozed.add(b.id)
        copy.streak = 0
        return
    if _rewound(copy, new_fps, view.pos, out.unmatched):
        # the agent went back to an earlier point of this history (a rewind, a retry of an older
        # turn, another branch): a block that covered messages past that point stands for history
        # this request does not have (its summary tells of turns that are gone): not rendered while
        # the request is on this branch, its messages here on the wire as they are
        out.verdict = "rewound"
        copy.latched = False  # (the history is the copy's up to a point: verified, as a truncation's head is)
        gone_now = set(out.unmatched)
        for b in blocks:  # (every block over a ref the branch lacks: two may cover one message)
            if b.active and not gone_now.isdisjoint(b.covered):
                out.snoozed.add(b.id)
        copy.streak = 0
        return
    copy.streak += 1
    if not copy.witness:
        copy.witness = copy.fps[-64:]
    total = not out.claims and (len(out.unmatched) >= COLLAPSE_MIN or len(out.unmatched) == out.covered)
    if total:
        out.verdict = "collapse"
        copy.latched = True
    else:
        out.verdict = "drift"


def not_a_tail(blocks: list[Block], present: dict[str, int], gone: set[str]) -> set[str]:
    """The active blocks some of whose messages the host truncated away (``gone``: its oldest slice)
    whose messages still here are not the end of their range: a truncation of the oldest slice
    leaves a block's newest messages, so a covered ref here with one of the block's later messages
    gone is not that block's message (a user said the same words again after the host dropped the
    folded copy, and the ledger's instance numbers, which follow the request, gave it the folded
    copy's ref).  Such a block is not rendered: what it covers here stays on the wire."""
    out: set[str] = set()
    for b in blocks:
        if not b.active or gone.isdisjoint(b.covered):
            continue
        claimed = b.claimed
        seen_gone = False
        for r in reversed(b.covered):  # (newest first: every ref here must come after every one gone)
            if r in present or claimed.get(r) in present:
                if seen_gone:
                    out.add(b.id)
                    break
            elif r in gone:
                seen_gone = True
    return out


def _rewound(copy: Copy, new_fps: list[str], present: dict[str, int], unmatched: list[str]) -> bool:
    """Whether the inbound history is the copy's up to some point and then another (or nothing):
    it starts with the copy's own first parts, leaves it before its end, holds few of the parts the
    copy has past that point (a quarter at most: an edit in place, a cleared tool result, keeps
    most of them), and every covered part it misses lies past that point."""
    old = copy.fps
    at = next((k for k, (a, b) in enumerate(zip(old, new_fps)) if not _alike(a, b)), min(len(old), len(new_fps)))
    if at == 0 or at >= len(old) or len(copy.refs) != len(old):
        return False
    tail = copy.refs[at:]
    if sum(1 for r in tail if r in present) * 4 > len(tail):
        return False
    head = set(copy.refs[:at])
    return all(r not in head for r in unmatched)


def _heads_inbound(old_fps: list[str], new_fps: list[str], need: int = 8) -> bool:
    """The inbound history starts with a stretch of the old order (the oldest slice was dropped), after
    the parts both begin with (a rolling window that keeps the conversation's opening)."""
    if not old_fps or not new_fps:
        return False
    a = 0
    while a < min(len(old_fps), len(new_fps)) and _alike(old_fps[a], new_fps[a]):
        a += 1
    head = new_fps[a:a + need]
    if not head:
        return False
    n = len(head)
    for j in range(a + 1, len(old_fps) - n + 1):
        win = old_fps[j : j + n]
        # (a cleared result matches whatever stood at its place, but the place is told by the parts both sides
        # hold in the same words: at least half of the head, else a window of the copy's cleared results, or a
        # shift by one of two cleared stretches, would take any history for a truncation of it)
        if all(map(_alike, win, head)) and sum(1 for o, h in zip(win, head) if o == h and h not in _WILD) * 2 >= n:
            return True
    return False
