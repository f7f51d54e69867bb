"""Lineage: conversations that share verified history.

A conversation with a new id whose history begins with another session's history (an agent's
fork: ``claude --resume <id> --fork-session``, ``codex exec fork``) is that session's **child**.
On its first request that carries model-authored history, the child's parts are compared position
by position with the history the parent recorded on its own last request (its self-stored
canonical copy: per part the ref and the full content hash, tool-call ids included).  Up to the
first difference the histories are the same; from there the child inherits, as of that point:

- the parent's refs for those messages (its ledger view), while new refs come from a counter the
  whole family shares, so no ref is ever given twice;
- the blocks whose every covered message lies in the verified history and whose compress call
  does too (a fold made after the histories parted is not the child's), with their originals;
- the proxy calls made in the verified history, with their results, byte for byte.

The copies are the child's own: a fold in one never changes the other.  Nothing is inherited
without verification: a shared opening (the same first message, even the same first reply) is no
history, so the verified part must hold a tool call the model made, under its provider-minted id, and a session whose
history goes on from its own earlier request is never anyone's child.

Id-less conversations (no session id; matched by the hash chain of their history) keep their
session when the agent goes back to an earlier point of it (a dropped turn, another branch): every
point of a session's chain is recorded, and a request that extends no session's latest tail is
matched against them under the same rule (see :meth:`PrefixAffinity.locate`).

An agent's compaction (kernel/compaction.py) begins a new epoch of the session: its record starts
again with the new history, and the old epoch's record is kept as it was (archived, in the store
beside it).  A fork of a point before the compaction (opencode's fork at an earlier message, Claude
Code's ``--resume-session-at`` with ``--fork-session``, codex's fork of an earlier turn) is compared
with that record, one of the new epoch with the new one: each of a candidate's records whose
first part is the fork's, under the same rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections import OrderedDict
from itertools import islice

from bili_addon import printable
from bili_addon.kernel.fold import Block
from bili_addon.kernel.identity import InstanceCounter, count_tokens
from bili_addon.kernel.reconcile import SIDE_REQUEST_MAX_ITEMS, canonical_text
from bili_addon.kernel.sessions import PrefixAffinity
from bili_addon.kernel.state import Call, Entry, ItemInfo, Part, Resolved, Session, flags_json
from bili_addon.kernel.tags import ref_of
from bili_addon.kernel.tools import call_key
from bili_addon.store import ARCHIVE_SEP, LedgerRow, Store, archived_record
from bili_addon.wire.base import REASONING, TEXT, TOOL_CALL, Core

log = logging.getLogger("bili")

try:  # a conversation's first part, fingerprinted once on a cold path (the fork key): HACL*'s SHA-256, the same
    # digest as OpenSSL's in fewer instructions cold (~half; warm, as flush runs it, OpenSSL's is faster)
    from _sha2 import sha256 as _sha256_cold
except ImportError:  # pragma: no cover
    _sha256_cold = hashlib.sha256

MAX_CANDIDATES = 64  # sessions opening with the same message that a new one is compared with
MAX_RECORDS = 256
# learned facts a child takes as they are, and per-ref ones it takes for the refs it inherits
INHERITED_FLAGS = ("strict_reasoning", "learned_windows", "pending")  # pending: held folds (kernel/pending.py)
OWN = "own_history"  # the session's fork check found it nobody's fork (never checked again)
# the flags of a new session found nobody's fork: that flag alone (as flags_json writes them, made once:
# the JSON encoder's call was ~30 us of a first turn, cold)
_OWN_ONLY = flags_json({OWN: True})
INHERITED_REF_FLAGS = ("nudges", "truncated")



def pflags_of(row) -> dict:
    """A stored session row's flags (none for no row)."""
    return json.loads(row.flags or "{}") if row is not None else {}


def _as_at_fork(blocks: list[Block], pflags: dict, refs: set[str]) -> None:
    """The inherited ``blocks`` as they stood when the histories parted (changed in place): the parent
    has them as they are now, and what it did after the fork is not the child's.  A block a later
    distil absorbed is active again unless the block that absorbed it is inherited too; one a later
    compaction of the parent retired (an epoch whose summary the shared history does not hold) is on
    the wire again."""
    absorbed = {c for b in blocks for c in b.consumed}
    retired_here = {bid for e in pflags.get("epochs") or () if e.get("marker") in refs
                    for bid in e.get("retired_blocks") or ()}
    for b in blocks:
        if b.retired and b.id not in retired_here:
            b.retired = False
        if not b.active and not b.retired and b.id not in absorbed:
            b.active = True

class Lineage:
    """Families of sessions over a :class:`Store` (which alone says who belongs to one); the Engine
    calls the hooks below."""

    def __init__(self, store: Store):
        self.store = store
        self.records: OrderedDict[str, list[tuple[str, str, str]]] = OrderedDict()
        self.whole: dict[str, bool] = {}  # the record is exactly the session's last pass
        self.checked: set[str] = set()  # sessions compared once, found to be nobody's fork
        # ``defer``: a pass's new parts are fingerprinted and stored by :meth:`flush` (the proxy calls
        # it on its worker after the answer), not on the request's path; off, :meth:`record` stores them
        self.defer = False
        self.pending: dict[str, tuple[int, list[tuple[str, Part]]]] = {}  # sid -> (from seq, new parts)
        # sid -> (key, record) of an epoch the session's compaction ended, stored by :meth:`flush` too
        self.archives: dict[str, tuple[str, list[tuple[str, str, str]]]] = {}
        self._first: tuple[Core, str] | None = None  # the last first part fingerprinted, and its fingerprint

    # -- sessions with an id of their own --------------------------------------------------------
    def before_turn(self, s: Session, infos: list[ItemInfo], start: int) -> str | None:
        """Before refs are given: a fresh session may turn out to be a fork (returns the note
        saying so); a family member's next ref is the family's."""
        sid = s.row.id
        note = None
        made = False  # (its record made here: empty, the newest)
        if s.unstored:  # a new session: nothing of it in the store to read (two reads less)
            s.unstored = False
            family = None
            if sid not in self.records and sid not in self.pending:
                self.records[sid] = []
                made = True
        else:
            family = self.store.family(sid)  # from the store: another proxy on it may have made one
        s.family = family is not None
        if family is None and sid not in self.checked and not s.flags.get(OWN) and self._fresh(s):
            conv = infos[start:]
            if _answered(conv):
                # a history that goes on from the session's own earlier request is its own, even
                # where another conversation said the same (a fork's first request carries the
                # parent's history; at most a side request of other words comes before it)
                own = [] if made else self._record(sid)  # (what _record gives of a record made just now)
                parts = [p for info in conv for p in info.parts] if own else None
                continues = parts is not None and len(parts) >= len(own) and all(
                    o[1] == p.chash for o, p in zip(own, parts))
                note = None if continues else self._adopt(s, conv, parts)
                s.family = note is not None
                self.checked.add(sid)  # never compared again
                if note is None:
                    # nobody's fork, for good: kept in the session's row (written with this turn's
                    # commit), so a restart does not compare it again (its record is its last pass:
                    # a rewound or edited request after a restart does not go on from it, and the
                    # session was taken for a fork of a copy of itself, its live refs given again)
                    s.flags[OWN] = True
                    s.row.flags = _OWN_ONLY if len(s.flags) == 1 else flags_json(s.flags)
        if family is not None:
            s.row.next_ref = max(s.row.next_ref, family[3])
        return note

    def head(self, sid: str, conv: list[ItemInfo], lane: str) -> tuple[str, str] | None:
        """What :meth:`before_turn`'s fork check of a session not loaded yet would look up in the
        store (its first part's fingerprint and its lane), or None when it would not look."""
        if sid in self.checked or not _answered(conv):
            return None
        first = _opening(conv)
        return (self._first_fingerprint(first.core), lane) if first is not None else None

    def head_of(self, sid: str, first: Core | None, answered: bool, lane: str) -> tuple[str, str] | None:
        """:meth:`head` from what the conversation's first items say (``state.head_cores``: its first
        part, whether it has an answer), before the pass reads them all."""
        if sid in self.checked or not answered or first is None:
            return None
        return self._first_fingerprint(first), lane

    def _first_fingerprint(self, core: Core) -> str:
        """The fingerprint of a conversation's first part: computed once for :meth:`head` and the
        fork check that follows it (the same core object), and for :meth:`head_of` before them (the
        same core read early: an equal one)."""
        known = self._first
        if known is not None and (known[0] is core or known[0] == core):
            return known[1]
        fp = fingerprint(core)
        self._first = (core, fp)
        return fp

    def record(self, s: Session, infos: list[ItemInfo], start: int, resolved: list[list[Resolved]],
               reused: int = 0, parts: int | None = None, epoch: int = 0) -> None:
        """Keep the session's history (per part: ref, content hash, verification fingerprint) for
        the forks to come.  A request that only repeats a prefix of it (a side request, a retry of
        an older turn) keeps the longer record.  ``reused``: leading items this pass shares with
        the session's previous one, unchanged (not compared again when that pass was recorded);
        ``parts``: how many parts ``resolved`` holds, when the caller counted them (the reused ones are
        then counted from the few after them); ``epoch``: the epoch this pass began (the agent
        compacted its history), else 0."""
        sid = s.row.id
        if ARCHIVE_SEP in sid:  # (its record's key could be another session's archive: no lineage)
            return
        if sid in self.pending:  # the previous pass's parts were not stored yet (no answer came)
            self.flush(sid)
        old = self._record(sid)
        if epoch and old:
            # the old epoch's record stays, archived, for the forks of a point before the compaction;
            # the new history is recorded however short it is (its first passes are no side requests:
            # the longer record is the old history's)
            self.archives[sid] = (archived_record(sid, epoch - 1), list(old))
        first = reused if reused and self.whole.get(sid) else 0
        if not old and not first and self.defer and any(resolved):
            # the session's first record, every part new: nothing to compare, and nothing read
            # before the answer, so even the list of its parts is made after it (by :meth:`flush`)
            self.records.pop(sid, None)
            self.whole[sid] = True
            self.pending[sid] = (0, (infos[start:], list(resolved)))
            return
        if first:
            off = min(sum(map(len, islice(resolved, first))) if parts is None else
                      parts - sum(map(len, islice(resolved, first, None))), len(old))
        else:
            off = 0
        parts = [(r.entry.ref, p) for info, rs in zip(infos[start + first:], resolved[first:])
                 for p, r in zip(info.parts, rs)]
        k, n = off, min(len(old), off + len(parts))
        while k < n and old[k][0] == parts[k - off][0] and old[k][1] == parts[k - off][1].chash:
            k += 1
        total = off + len(parts)
        if not epoch and (k == total or (total < len(old) and len(resolved) < SIDE_REQUEST_MAX_ITEMS)):
            self.whole[sid] = k == total == len(old)
            return
        new = parts[k - off:]
        # compared on refs and content hashes only: the fingerprints are for the forks to come
        # (the record changed in place, not copied every turn: ``old`` is this session's in ``records``,
        # held by nothing else)
        del old[k:]
        old += [(ref, p.chash, "") for ref, p in new]
        self.records[sid] = old
        self.whole[sid] = True
        self.pending[sid] = (k, new)
        if not self.defer:
            self.flush(sid)

    def flush(self, sid: str | None = None) -> None:
        """Fingerprint and store the parts :meth:`record` kept back (of ``sid``, or of every
        session): the proxy runs this on its worker after the answer, before the agent can fork."""
        for key in ([sid] if sid is not None else list(dict.fromkeys([*self.pending, *self.archives]))):
            done = self.archives.pop(key, None)
            if done is not None:  # (before the new epoch's record: that one replaces it)
                self.store.save_lineage_parts(done[0], 0, done[1])
            job = self.pending.pop(key, None)
            if job is None:
                continue
            k, new = job
            first = isinstance(new, tuple)
            if first:  # a first record, kept as the pass had it (see record)
                infos, resolved = new
                new = [(r.entry.ref, p) for info, rs in zip(infos, resolved) for p, r in zip(info.parts, rs)]
            tail = [(ref, p.chash, _fingerprint(p.core)) for ref, p in new]
            self.store.save_lineage_parts(key, k, tail)
            rec = self.records.get(key)
            if rec is None and first:
                self.records[key] = list(tail)
            elif rec is not None and len(rec) == k + len(tail):
                rec[k:] = tail

    def _flush_opening(self, head: str) -> None:
        """:meth:`flush` the kept-back parts of the sessions whose history opens with the part whose
        fingerprint is ``head`` (a new session's candidates: no other can be one), and of any whose
        opening is not known here; the others wait for the worker's flush after their answers (a
        first pass kept back is every part of its conversation to fingerprint: a new conversation
        arriving while others wait for their answers fingerprinted them all first)."""
        for key, (_key, done) in list(self.archives.items()):  # (an old epoch's record opens as it did)
            if not done[0][2] or done[0][2] == head:
                self.flush(key)
        for key in list(self.pending):
            job = self.pending.get(key)
            if job is None:
                continue
            k, new = job
            opening = None
            if k:  # its opening is recorded (read from the store, or flushed before)
                rec = self.records.get(key)
                opening = rec[0][2] if rec else None
            elif isinstance(new, tuple):  # a first record, kept as the pass had it (see record)
                part = next((p for info, rs in zip(*new) for p, _r in zip(info.parts, rs)), None)
                opening = fingerprint(part.core) if part is not None else None
            elif new:
                opening = fingerprint(new[0][1].core)
            if not opening or opening == head:
                self.flush(key)

    def forget(self, sid: str) -> None:
        """Retention pruned the session, or a turn of it was not written: its record, kept-back parts
        and verdict go with it (as after a restart)."""
        self.records.pop(sid, None)
        self.whole.pop(sid, None)
        self.pending.pop(sid, None)
        self.archives.pop(sid, None)
        self.checked.discard(sid)

    # -- id-less sessions ------------------------------------------------------------------------
    def locate(self, affinity: PrefixAffinity, hashes: list[str], conv: list[ItemInfo]) -> tuple[str, int]:
        """The session of an id-less history and how deep it already knew it (0: new)."""

        def points(hs: list[str]) -> dict:
            try:
                return self.store.affinity_points(hs)
            except Exception as e:  # an unreadable store: no earlier points, as before
                log.warning("[bili] earlier points of id-less sessions unreadable (%s)", printable(e))
                return {}

        def verified(depth: int) -> bool:
            # the fork rule (_adopt): a tool call the model made, under its provider-minted id (unique
            # to one conversation); a stock first reply a harness opens every conversation with is
            # said in two conversations alike
            return any(p.core.ctype == TOOL_CALL and p.core.tool_call_id for info in conv[:depth] for p in info.parts)

        def taken(sid: str) -> bool:
            # (a session this process has no point of: another process gave the id; its tail is not
            # this request's, or the request's own points, read before, would have matched it)
            return self.store.session(sid) is not None

        return affinity.locate(hashes, points, verified, taken)

    def note_points(self, sid: str, hashes: list[str], known: int) -> None:
        self.store.add_affinity_points(sid, [(d, hashes[d - 1]) for d in range(known + 1, len(hashes) + 1)])

    # -- stats -----------------------------------------------------------------------------------
    def families(self) -> dict[str, dict]:
        """Every session in a family, as the store has them: ``{root, parent, fork_at, children}``."""
        rows = self.store.lineage()
        out = {sid: {"root": root, "parent": parent or None, "fork_at": fork_at, "children": []}
               for sid, parent, root, fork_at in rows}
        for sid, parent, _root, _fork_at in rows:
            if parent in out:
                out[parent]["children"].append(sid)
        return out

    def family_of(self, sid: str) -> dict | None:
        return self.families().get(sid)

    # -- adoption --------------------------------------------------------------------------------
    @staticmethod
    def _fresh(s: Session) -> bool:
        flags = s.flags
        return (not s.blocks and not s.calls and
                "envelope" not in flags and "nudges" not in flags and "truncated" not in flags)

    def _record(self, sid: str) -> list[tuple[str, str, str]]:
        if sid in self.pending:  # its record is complete once its kept-back parts are in
            self.flush(sid)
        rec = self.records.get(sid)
        if rec is None:
            rec = [tuple(r) for r in self.store.lineage_parts(sid)]
            self.records[sid] = rec
            while len(self.records) > MAX_RECORDS:
                self.whole.pop(self.records.popitem(last=False)[0], None)
        else:
            self.records.move_to_end(sid)
        return rec

    def _adopt(self, s: Session, conv: list[ItemInfo], parts: list[Part] | None = None) -> str | None:
        """``parts``: those of ``conv``, when the caller has them (else made once a candidate is found)."""
        sid = s.row.id
        first = _opening(conv)
        if first is None:
            return None
        head = self._first_fingerprint(first.core)
        self._flush_opening(head)  # what this process holds back of the candidates is part of their records
        lane = s.row.lane
        # (session, record key) of its lane (a fork is the same agent's): each session's record, then the
        # records of the epochs its compactions ended
        # (a session whose id holds the separator records nothing: a record under such an id is an archive)
        cands = [(c, c) for c in self.store.lineage_candidates(head, lane)[-MAX_CANDIDATES:]
                 if c != sid and ARCHIVE_SEP not in c]
        cands += [c for c in self.store.lineage_archived(head, lane)[-MAX_CANDIDATES:] if c[0] != sid]
        if not cands:
            return None
        if parts is None:
            parts = [p for info in conv for p in info.parts]
        fps: list[str] = [self._first_fingerprint(first.core)]

        def fp(i: int) -> str:  # the child's fingerprints, computed as far as they are compared
            while len(fps) <= i:
                fps.append(_fingerprint(parts[len(fps)].core))
            return fps[i]

        best, best_rec, best_n = None, [], 0
        for cand, key in cands:
            rec = [tuple(r) for r in self.store.lineage_parts(key)]  # as the store has it now
            n = 0
            for (_ref, chash, pfp), p in zip(rec, parts):
                if chash != p.chash and pfp != fp(n):
                    break
                n += 1
            if n > best_n:
                best, best_rec, best_n = cand, rec, n
        if best is None:
            return None
        # the verified history: the same message at the same position (byte for byte, or as the
        # churn rules compare: canonical text, the same call ids), one ref per message, and no tag
        # of ours to strip first
        count = InstanceCounter()
        ledger: list[LedgerRow] = []
        seen: set[str] = set()
        called = False
        for p, (ref, _chash, _fp) in zip(parts[:best_n], best_rec):
            core = p.core
            key = (count(p.base), p.chash)
            if ref in seen or (core.ctype == TEXT and core.role != "assistant" and core.text.startswith("<acp ")):
                break
            seen.add(ref)
            called = called or (core.ctype == TOOL_CALL and bool(core.tool_call_id))
            ledger.append(LedgerRow(key[0], p.chash, ref, core.role, core.ctype, count_tokens(core.text)))
        if not called:
            # an opening in common is not a history in common, nor is a short first reply the
            # model may give twice: the provider's call ids are unique to one conversation
            return None
        fork_at = len(ledger)
        verified = parts[:fork_at]
        refs = {r.ref for r in ledger}
        keys = {call_key(p.core.tool_call_id, p.core.tool_name, p.core.text)
                for p in verified if p.core.ctype == TOOL_CALL}
        keys.discard("")

        parent = self.store.session(best)
        calls = [c for c in self.store.calls(best) if c[0] in keys]
        blocks = []
        for doc in self.store.blocks(best):
            b = Block(**json.loads(doc))
            if b.call_id not in keys or not b.covered:
                # folded after the histories parted (or a block of no messages); a fold of no known call
                # (a native one whose answer was not read: bili mcp with a conversation named) is not
                # known to lie in the shared history either
                continue
            if all(r in refs or b.claimed.get(r) in refs for r in b.covered):
                blocks.append(b)
        pflags = pflags_of(parent)
        _as_at_fork(blocks, pflags, refs)
        covered = sorted({r for b in blocks for r in b.covered})
        originals = self.store.originals(best, covered) if covered else []
        flags = {k: pflags[k] for k in INHERITED_FLAGS if k in pflags}
        for k in INHERITED_REF_FLAGS:
            kept = {ref: v for ref, v in (pflags.get(k) or {}).items() if ref in refs}
            if kept:
                flags[k] = kept
        # the agent's compactions whose summary the shared history holds: the child's history is of that
        # epoch too (its summary foldable as the parent's is: kernel/compaction.py); every answer the
        # child has is of it (its usage counts from none)
        eps = [{**e, "usage_turns": 0} for e in pflags.get("epochs") or () if e.get("marker") in refs]
        if eps:
            flags["epochs"] = eps
        family = self.store.family(best)
        root = family[0] if family is not None else best
        next_ref = max(s.row.next_ref, parent.next_ref if parent is not None else 1, self.store.family_next_ref(root))

        # what the child gave before it was recognised (a side request's message, on its own
        # counter) and now collides with an inherited ref takes a new one: a ref names one message
        inherited = {(r.msg_id, r.content_hash) for r in ledger}
        retired = []
        for key, entry in s.refs.items():
            if key not in inherited and entry.ref in refs:
                retired.append((key, Entry(ref_of(next_ref), entry.tokens)))
                next_ref += 1

        merged = {**s.flags, **flags}
        row = dataclasses.replace(s.row, flags=flags_json(merged), next_ref=next_ref)
        s.stored = self.store.adopt(row, best, root, fork_at, ledger,
                                    [(b.id, json.dumps(b.__dict__), b.active) for b in blocks], originals, calls,
                                    [(k[0], k[1], e.ref) for k, e in retired], expect=s.stored)
        # the store has it all; now the live session
        s.row = row
        s.flags.clear()
        s.flags.update(merged)
        for key, entry in retired:
            s.refs[key] = entry
        for r in ledger:
            s.refs[(r.msg_id, r.content_hash)] = Entry(r.ref, r.tokens)
        s.owners.clear()
        for (_msg_id, chash), entry in s.refs.items():
            s.owners.setdefault(entry.ref, chash)
        s.blocks = sorted(blocks, key=lambda b: b.number)
        s.calls.update({k: Call(n, a, res) for k, n, a, res in calls})
        s.version += 1
        done = sum(1 for c in calls if c[3] is not None)
        note = (f"a fork of {best}: {fork_at} message part(s) verified in its history; inherits their refs, "
                f"{len(blocks)} block(s) and {done} call result(s)")
        if retired:
            note += f"; {len(retired)} ref(s) it gave before it was recognised are given anew"
        return note


def _answered(conv: list[ItemInfo]) -> bool:
    """Whether a part of ``conv`` is the assistant's (a plain loop: it stops at the first, mostly
    the conversation's second item)."""
    for info in conv:
        for p in info.parts:
            if p.core.role == "assistant":
                return True
    return False


def _opening(conv: list[ItemInfo]) -> Part | None:
    """The first part of ``conv`` (None: no item has one)."""
    for info in conv:
        parts = info.parts
        if parts:
            return parts[0]
    return None


def fingerprint(core: Core) -> str:
    """What verifies a message at its position when the bytes differ: the churn rules' canonical
    text (JSON key-sorted and compacted, prose whitespace-normalised), with its call id and kind;
    reasoning on its role alone, as the fold-coverage layer does (providers re-mint what stands
    for it).  One part's, cold (a conversation's first part, the fork key): HACL*'s SHA-256, the
    same digest as OpenSSL's in fewer instructions there; :func:`_fingerprint` gives it for many
    parts in a row (OpenSSL's, faster warm)."""
    return _sha256_cold(_seed(core)).hexdigest()[:32]


def _fingerprint(core: Core) -> str:
    """:func:`fingerprint` (the same digest) of parts fingerprinted many in a row (a pass's new parts)."""
    return hashlib.sha256(_seed(core)).hexdigest()[:32]


def _seed(core: Core) -> bytes:
    """What a part's fingerprint hashes."""
    text = "" if core.ctype == REASONING else _canonical(core.text)
    return "\x00".join((core.role, core.ctype, core.tool_call_id, core.tool_name, text, core.media or "")).encode(
        "utf-8", "surrogatepass")


def _canonical(text: str) -> str:
    """``canonical_text(text)``: the text itself where that is what it gives, ASCII prose (NFC
    leaves it as it is; not a JSON text: it opens with no bracket, or closes with none) whose only
    whitespace is single spaces and line breaks between words (normalize_text's lines and words
    then join back into the same text): no control character but its line breaks, and no two of
    those and spaces in a row.  Found by a few scans of it (each stops at what it looks for) instead
    of splitting it into words and joining them again; anything else as canonical_text makes it."""
    if (text.isascii() and text and text[0] not in _EDGE and text[-1] not in _EDGE
            and (text[0] not in "{[" or text[-1] not in "}]") and "  " not in text):
        # (a text that is not, mostly a tool's output, is told by its first two spaces in a row)
        if "\n" not in text:
            if text.isprintable():
                return text
        elif (" \n" not in text and "\n " not in text and "\n\n" not in text
              and text.replace("\n", " ").isprintable()):
            return text
    return canonical_text(text)


_EDGE = frozenset(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")  # (an ASCII text's whitespace: str.split's and strip's)


__all__ = ["Lineage"]
