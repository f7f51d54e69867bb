"""The embedded store: SQLite in WAL mode under ``bili_data_dir``.

Everything a session needs to survive a restart lives here: the ledger (``(session_id, msg_id,
content_hash) -> ref``, one row per session write since schema 7), the session rows, and the
anonymous-conversation prefix chains.  A turn
is written in one transaction, before its bytes are forwarded, so ``kill -9`` can lose at most a
turn that was never sent with its refs.

Several processes may share one store (two proxies on one data dir).  Two rules keep them
correct: a ref is allocated in the store, in the transaction that records it (a turn's new refs
must be the session's next numbers there, in order: the counter only grows, so none is given
twice; ``refs`` keeps the one text of each), and every write to a session's state checks
and advances the session's ``version``: a process whose cached copy of a session is older than
the store's gets :class:`StaleSession` and reloads the session instead of writing over it.
"""

from __future__ import annotations

import errno
import functools
import json
import operator
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec

from bili_addon import private
from bili_addon.locks import open_locks
from bili_addon.prices import LONG_PROMPT

SCHEMA_VERSION = 13  # 3: the wire table; 4: the calibration table; 5: the chains table; 6: PostgreSQL's one-statement
# turn commit and session hold (functions, nothing in SQLite); 7: the ledger and the refs as one row per session write
# (``ledger_turns``, ``refs_turns``; ``ledger`` and ``refs`` are views of them); 8: retention (``sessions.pruned``,
# indexes of the chains' bases: bili_addon/retention.py); 9: the cache writes' 1-hour part per answered turn
# (``wire.cache_write_1h``, ``wire.write_split``: who said it); 10: a first turn's refs_turns row names the refs of the
# ledger_turns row of the same write instead of repeating them (``FRESH_GIVEN``; the ``refs`` view reads both forms);
# 11: a turn's commit writes the session's canonical copy too (``commit_turn(copy=)``: nothing in SQLite, PostgreSQL's
# ``bili_commit_turn`` takes it); 12: a family's commits serialised (nothing in SQLite, whose one writer reads the
# family's counter inside its write; PostgreSQL's ``bili_commit_turn`` takes the family's lock); 13: an answered
# turn says whether it was a side request (``wire.side``: the figures' "now" is the conversation's last turn, not a
# title request's). PostgreSQL: store_pg._MIGRATIONS[3..13]
BUSY_MS = 500  # how long a write waits for another process's lock before it gives up
LOCK_WAIT = 2.0  # seconds a turn waits for its session held by another process, then passes through (as PostgreSQL's)
# the WAL is copied into the store file by a thread of the store's own past this many pages (SQLite's own
# threshold), off the writers' path; a writer checkpoints itself only past the backstop (that thread behind)
WAL_CHECKPOINT_PAGES = 1000
WAL_BACKSTOP_PAGES = 10000
# a commit that says how many pages it may have written (a turn's: ~3-20) looks at the WAL's size only once
# such commits may have added this many pages since the last look (the stat was ~10 us of a turn's commit):
# the WAL crosses the threshold by this much at most before the thread is woken
POKE_PAGES = 128

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(
    id TEXT PRIMARY KEY,
    agent TEXT NOT NULL DEFAULT '',
    lane TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    last_seen REAL NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    messages INTEGER NOT NULL DEFAULT 0,
    next_ref INTEGER NOT NULL DEFAULT 1,
    flags TEXT NOT NULL DEFAULT '{}',
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read INTEGER NOT NULL DEFAULT 0,
    cache_write INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    turns INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0
);
-- schema 7 (#11): the ledger as one row per session write (a turn, a fork's adoption): its new rows
-- ``(msg_id, content_hash) -> ref`` as one JSON array of [msg_id, content_hash, ref, role, ctype, tokens]
-- (a key is in one row of its session only); ``seq``: the session version the write made (<= 0: rows
-- a schema-6 store held, one per first_seen). ``refs_turns``: the refs each write gave, [[ref, content_hash]...]
-- (a ref is in one row of its session only); schema 10: or {"as":"ledger_turns"} (store.FRESH_GIVEN): a write whose
-- every ledger row gave its ref (a conversation's first turn): the refs are those of the ledger_turns row of the same
-- seq, in row order (``n`` of them). The views ``ledger`` and ``refs`` show them row by row.
CREATE TABLE IF NOT EXISTS ledger_turns(
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    first_seen REAL NOT NULL,
    n INTEGER NOT NULL,
    rows TEXT NOT NULL,
    PRIMARY KEY(session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS refs_turns(
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    n INTEGER NOT NULL,
    given TEXT NOT NULL,
    PRIMARY KEY(session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS affinity(
    session_id TEXT PRIMARY KEY,
    depth INTEGER NOT NULL,
    tail TEXT NOT NULL,
    last_seen REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS affinity_tail ON affinity(tail);
CREATE TABLE IF NOT EXISTS turns(
    session_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    ts REAL NOT NULL,
    lane TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    cache_read INTEGER NOT NULL,
    cache_write INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    PRIMARY KEY(session_id, n)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks(
    session_id TEXT NOT NULL,
    block_id TEXT NOT NULL,
    body TEXT NOT NULL,
    active INTEGER NOT NULL,
    PRIMARY KEY(session_id, block_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS originals(
    session_id TEXT NOT NULL,
    ref TEXT NOT NULL,
    role TEXT NOT NULL,
    ctype TEXT NOT NULL,
    tool_name TEXT NOT NULL,
    tool_call_id TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY(session_id, ref)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS transcript(
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    sig TEXT NOT NULL,
    refs TEXT NOT NULL,
    item BLOB NOT NULL,
    PRIMARY KEY(session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS wire(
    session_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    ts REAL NOT NULL,
    request INTEGER NOT NULL,
    model TEXT NOT NULL,
    agent_tokens INTEGER NOT NULL,
    sent_tokens INTEGER NOT NULL,
    predicted REAL,
    blocks INTEGER NOT NULL,
    folded INTEGER NOT NULL,
    executed TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    cache_read INTEGER NOT NULL,
    cache_write INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cache_write_1h INTEGER NOT NULL DEFAULT 0,
    write_split TEXT NOT NULL DEFAULT '',
    side INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY(session_id, n)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS copies(
    session_id TEXT PRIMARY KEY,
    doc TEXT NOT NULL
) WITHOUT ROWID;
-- lineage (#15/#20): forks inherit their parent's view; id-less sessions match any earlier point
CREATE TABLE IF NOT EXISTS lineage(
    session_id TEXT PRIMARY KEY,
    parent TEXT NOT NULL DEFAULT '',
    root TEXT NOT NULL,
    fork_at INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lineage_root ON lineage(root);
CREATE TABLE IF NOT EXISTS lineage_parts(
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ref TEXT NOT NULL,
    chash TEXT NOT NULL,
    fp TEXT NOT NULL,
    PRIMARY KEY(session_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lineage_parts_head ON lineage_parts(fp) WHERE seq=0;
CREATE TABLE IF NOT EXISTS affinity_points(
    hash TEXT NOT NULL,
    session_id TEXT NOT NULL,
    depth INTEGER NOT NULL,
    PRIMARY KEY(hash, session_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS calls(
    session_id TEXT NOT NULL,
    call_key TEXT NOT NULL,
    name TEXT NOT NULL,
    args TEXT NOT NULL,
    result TEXT,
    created REAL NOT NULL,
    executed REAL,
    PRIMARY KEY(session_id, call_key)
) WITHOUT ROWID;
-- schema 4: the cache model's prediction vs the provider's report, per answered request (kernel/calibration.py)
CREATE TABLE IF NOT EXISTS calibration(
    session_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    ts REAL NOT NULL,
    host TEXT NOT NULL,
    family TEXT NOT NULL,
    lane TEXT NOT NULL,
    gap REAL,
    age REAL,
    predicted_input INTEGER NOT NULL,
    predicted_read INTEGER NOT NULL,
    predicted_write INTEGER NOT NULL,
    reported_input INTEGER,
    reported_read INTEGER NOT NULL,
    reported_write INTEGER,
    PRIMARY KEY(session_id, n)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS calibration_host ON calibration(host, family, ts);
-- schema 5: server-side chains (#13, kernel/chains.py): per response id, both views as base[:keep] + items + output
CREATE TABLE IF NOT EXISTS chains(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    conn TEXT NOT NULL,
    stored INTEGER NOT NULL,
    agent_base TEXT NOT NULL,
    agent_keep INTEGER NOT NULL,
    agent BLOB NOT NULL,
    sent_base TEXT NOT NULL,
    sent_keep INTEGER NOT NULL,
    sent BLOB,
    output BLOB NOT NULL,
    owner TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chains_session ON chains(session_id);
"""
# schema 7: the row-by-row views of the one-row-per-write ledger and refs (ad-hoc SQL, tests, operators)
_VIEWS = """
CREATE VIEW IF NOT EXISTS ledger AS SELECT t.session_id AS session_id, json_extract(j.value, '$[0]') AS msg_id,
    json_extract(j.value, '$[1]') AS content_hash, json_extract(j.value, '$[2]') AS ref,
    json_extract(j.value, '$[3]') AS role, json_extract(j.value, '$[4]') AS ctype,
    json_extract(j.value, '$[5]') AS tokens, t.first_seen AS first_seen
    FROM ledger_turns t, json_each(t.rows) j;
CREATE VIEW IF NOT EXISTS refs AS SELECT t.session_id AS session_id, json_extract(j.value, '$[0]') AS ref,
    json_extract(j.value, '$[1]') AS content_hash
    FROM refs_turns t, json_each(CASE WHEN t.given LIKE '[%' THEN t.given ELSE '[]' END) j
    UNION ALL SELECT t.session_id, json_extract(j.value, '$[2]'), json_extract(j.value, '$[1]')
    FROM refs_turns t JOIN ledger_turns l ON l.session_id = t.session_id AND l.seq = t.seq,
    json_each(CASE WHEN t.given LIKE '[%' THEN '[]' ELSE l.rows END) j;
"""
# the schema-6 tables that schema 7 replaces (a store older than 7 is read through them once, then they go)
_LEGACY = """
CREATE TABLE IF NOT EXISTS refs(
    session_id TEXT NOT NULL,
    ref TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY(session_id, ref)
) WITHOUT ROWID;
"""
# the columns of a chains row, in the order save_chain takes and chain returns them
CHAIN_COLS = ("id", "session_id", "conn", "stored", "agent_base", "agent_keep", "agent", "sent_base", "sent_keep",
              "sent", "output", "owner", "created")


class StoreError(RuntimeError):
    """The store cannot be opened or written; the addon passes requests through.

    ``kind`` names the cause in plain words (``disk full``, ``read-only``, ``locked``, ``cannot
    open``, ``i/o error``, ``error``) and ``hint`` says what to do about it.
    """

    def __init__(self, message: str, kind: str = "error", hint: str = ""):
        super().__init__(message)
        self.kind, self.hint = kind, hint


class StaleSession(StoreError):
    """Another process changed this session since it was loaded: reload it and try again."""

    def __init__(self, session_id: str, expected: int, found: int, why: str = ""):
        super().__init__(why or f"session {session_id!r} was changed by another process (version {found}, "
                                f"this process had {expected})", "stale")
        self.session_id = session_id


def _not_pruned(child: str, parent: str, row, expect: int) -> None:
    """An adoption whose parent was pruned since it was read (its history gone, its family pruned
    without the child): :class:`StaleSession` (the turn is computed again, no parent found)."""
    if row is not None and row[0] and row[0] >= row[1]:
        raise StaleSession(child, expect, expect, f"session {child!r}: its parent {parent!r} was pruned while it "
                                                  "was recognised as its fork")


def retired_taken(child: str, retired, family_next: int, expect: int) -> None:
    """An adoption's ``retired`` rows take refs from the family's counter as the caller read it: when
    another session of the family has given numbers since (``family_next``, read inside the write),
    those may be the same ones, and a ref names one text in a family: :class:`StaleSession` (the
    turn is computed again)."""
    if retired and min(int(ref[1:]) for _msg_id, _chash, ref in retired) < family_next:
        raise StaleSession(child, expect, expect, f"session {child!r}: another session of its family gave refs "
                                                  "while it was recognised as a fork")


class SessionBusy(StoreError):
    """Another instance held the session's lock longer than the bounded wait: this request passes
    through unchanged (said in the log), the next one tries again."""

    def __init__(self, session_id: str, waited: float):
        super().__init__(f"session {session_id!r} is busy in another instance (its lock was not free within "
                         f"{waited:g}s)", "busy", "nothing to do: the session's next request tries again")
        self.session_id = session_id


_HINTS = {
    "disk full": "free some space on that disk; bili resumes storing by itself",
    "read-only": "the data dir must be writable (remount it read-write, fix its permissions or choose "
                 "another --data-dir); bili resumes storing by itself",
    "locked": "another process holds the store's lock; bili retries on the next requests",
    "cannot open": "check that --data-dir (bili_data_dir) names a directory bili can create and write",
    "i/o error": "the disk or file system failed; check it (dmesg) and the store file",
    "not private": "bili resumes storing by itself once the data dir and the store's files are this user's alone",
}


def lock_holders(path: Path) -> list[int]:
    """PIDs (other than ours) holding a write lock on the store's files, from /proc/locks (Linux)."""
    ids = set()
    for p in (path, path.with_name(path.name + "-shm"), path.with_name(path.name + "-wal")):
        try:
            st = p.stat()
        except OSError:
            continue
        ids.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    pids: list[int] = []
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return pids
    for line in lines:
        f = line.split()
        if len(f) < 6 or f[1] == "->" or f[3] != "WRITE":  # readers (other bili processes) hold READ locks
            continue
        try:
            pid = int(f[4])
            major, minor, ino = f[5].split(":")
            key = (int(major, 16), int(minor, 16), int(ino))
        except ValueError:
            continue
        if key in ids and pid != os.getpid() and pid not in pids:
            pids.append(pid)
    return pids


def _process_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    return cmd[:120]


def _fs_state(path: Path) -> str:
    """``read-only`` or ``disk full`` when the file system under ``path`` says so, else ''."""
    d = path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY or not os.access(d, os.W_OK):
        return "read-only"
    if st.f_bavail == 0:
        return "disk full"
    return ""


def classify(e: BaseException, path: Path | None = None) -> tuple[str, str]:
    """``(kind, plain words)`` for a SQLite or OS error of the store."""
    if isinstance(e, private.NotPrivate):
        return "not private", "the data dir or a store file is not this user's alone"
    name = getattr(e, "sqlite_errorname", "") or ""
    text = str(e)
    err = getattr(e, "errno", None)
    if name.startswith("SQLITE_FULL") or err == errno.ENOSPC or "disk is full" in text:
        return "disk full", "the disk is full"
    if (name.startswith("SQLITE_READONLY") or err in (errno.EROFS, errno.EACCES, errno.EPERM)
            or "readonly" in text or "read-only" in text):
        return "read-only", "the store is read-only (read-only file system or no write permission)"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        who = ""
        if path is not None:
            pids = lock_holders(path)
            if pids:
                who = " by " + ", ".join(f"PID {p}" + (f" ({n})" if (n := _process_name(p)) else "") for p in pids)
        return "locked", f"the store is locked{who or ' by another process'}"
    fs = _fs_state(path) if path is not None else ""
    if fs == "read-only":
        return "read-only", "the store is on a read-only file system (or not writable)"
    if fs == "disk full":
        return "disk full", "the disk is full"
    if err == errno.ENOTDIR:
        return "cannot open", "the data dir cannot be created: part of its path is a file, not a directory"
    if name.startswith("SQLITE_CANTOPEN") or err in (errno.ENOENT, errno.EEXIST):
        return "cannot open", "the store file cannot be opened"
    if name.startswith("SQLITE_IOERR") or err == errno.EIO:
        return "i/o error", "the disk reported an I/O error"
    return "error", "the store failed"


def store_error(action: str, path: Path, e: BaseException) -> StoreError:
    kind, words = classify(e, path)
    return StoreError(f"cannot {action} the store at {path}: {words} ({e})", kind, _HINTS.get(kind, ""))


def newer_schema(where: str, have: int) -> StoreError:
    """A store stamped by a newer bili (both backends refuse it, before writing anything): its rows
    may be in a form this bili does not know, read wrong or written so that the newer bili misreads
    them (a second install, a downgrade); requests pass through until bili is upgraded."""
    return StoreError(f"the store at {where} has schema version {have}, newer than this bili ({SCHEMA_VERSION}); "
                      "upgrade bili", "error", "upgrade bili-addon on this host")


class LedgerRow(msgspec.Struct, gc=False, array_like=True):
    """One ledger row; a write's rows are stored as one JSON array of arrays (schema 7)."""

    msg_id: str
    content_hash: str
    ref: str
    role: str
    ctype: str
    tokens: int


_LEDGER_KEY = operator.attrgetter("msg_id", "content_hash")
_ledger_dec = msgspec.json.Decoder(list[LedgerRow])
_given_dec = msgspec.json.Decoder(list[tuple[str, str]])
_json = msgspec.json.Encoder()
# schema 10: the ``refs_turns.given`` of a write whose every ledger row gave its ref (a conversation's first
# turn: ``commit_turn(..., fresh=True)``): its refs are those of the ``ledger_turns`` row of the same seq, in
# row order, not repeated (a first turn of 1,000 messages wrote ~120 KB of them again, encoded, in SQLite
# and over the wire to PostgreSQL).  A JSON object: any JSON reader of ``given`` tells it from a list.
FRESH_GIVEN = '{"as":"ledger_turns"}'
_REF, _CHASH = operator.attrgetter("ref"), operator.attrgetter("content_hash")


def given_refs(doc: str, ledger_doc: str | None) -> list[tuple[str, str]]:
    """The ``(ref, content_hash)`` a ``refs_turns`` document names; ``ledger_doc``: the rows of the
    ``ledger_turns`` row of the same write (what :data:`FRESH_GIVEN` refers to)."""
    if doc == FRESH_GIVEN:
        rows = _ledger_dec.decode(ledger_doc) if ledger_doc else []
        return list(zip(map(_REF, rows), map(_CHASH, rows)))
    return _given_dec.decode(doc)


def fresh_first(rows: list[LedgerRow]) -> int:
    """The number of the first ref of a fresh write's ``rows``, whose refs must be consecutive in
    row order (:func:`contiguous` of the refs they give)."""
    refs = [r.ref for r in rows]  # (a list display reads a Struct's field ~2.5x faster than attrgetter's map)
    first = int(refs[0][1:])
    # (the names come from ref_names' table: the list comparison is mostly identity checks)
    if refs != ref_names(first, len(refs)):
        raise StoreError(f"the refs of a turn are not consecutive ({refs[0]}...{refs[-1]})")
    return first


def ledger_rows(docs) -> list[LedgerRow]:
    """The rows of a session's ledger from its ``ledger_turns`` documents, in key order (the order
    the one-row-per-part table of schema 6 read them in)."""
    rows: list[LedgerRow] = []
    for doc in docs:
        rows += _ledger_dec.decode(doc)
    rows.sort(key=_LEDGER_KEY)
    return rows


_FIRST = operator.itemgetter(0)
_CREATED = operator.itemgetter(4)
_CREATED_KEY = operator.itemgetter(4, 2)  # (an archived record's row of Store._ROW_AND_CANDS: created, then its key)
_REF_NAMES: list[str] = []  # _REF_NAMES[i] is ref number i as tags.ref_of writes it, once made
_REF_NAMES_LOCK = threading.Lock()
MAX_REF = 99999


def ref_names(first: int, n: int) -> list[str]:
    """The refs numbered ``first`` to ``first + n - 1`` (``m00001``, as ``tags.ref_of`` writes
    them), formatted once per process: a first turn of 1,000 messages gives ~1,500 refs, and
    formatting them was ~0.4 ms each time they were made or checked."""
    end = first + n
    if first < 0 or end > MAX_REF + 1:
        return [f"m{i:05d}" for i in range(first, end)]
    if end > len(_REF_NAMES):
        with _REF_NAMES_LOCK:  # two threads never extend it twice (a name is at its own number)
            have = len(_REF_NAMES)
            if end > have:
                _REF_NAMES.extend(map("m{:05d}".format, range(have, end)))
    return _REF_NAMES[first:end]


def contiguous(minted: list[tuple[str, str]]) -> int:
    """The number of the first of ``minted`` refs, which must be consecutive (a turn gives the
    session's next free numbers in order; the store checks the first against its counter)."""
    first = int(minted[0][0][1:])
    # (C-level loops: a first turn of 1,000 messages gives ~1,500 refs)
    if list(map(_FIRST, minted)) != ref_names(first, len(minted)):
        raise StoreError(f"the refs of a turn are not consecutive ({minted[0][0]}...{minted[-1][0]})")
    return first


def rebase(ledger_docs: list[tuple[int, str]], refs_docs: list[tuple[int, str]], inherited: list[LedgerRow],
           retired: list[tuple[str, str, str]]):
    """What a fork's adoption does to the child's one-row-per-write ledger and refs (both backends):
    its rows whose keys the inherited rows take are dropped from the rows that held them, its retired
    rows take their new refs where they are, and the refs the inherited and retired rows name are
    dropped from the writes that gave them.  Returns ``(changed ledger docs, changed refs docs)`` as
    ``{seq: (n, doc)}`` (``n == 0``: delete the row)."""
    taken = {(r.msg_id, r.content_hash) for r in inherited}
    moved = {(m, h): ref for m, h, ref in retired}
    named = {r.ref for r in inherited} | set(moved.values())
    led: dict[int, tuple[int, str]] = {}
    for seq, doc in ledger_docs:
        rows = _ledger_dec.decode(doc)
        out = []
        changed = False
        for r in rows:
            key = (r.msg_id, r.content_hash)
            if key in taken:
                changed = True
                continue
            if key in moved and moved[key] != r.ref:
                r = msgspec.structs.replace(r, ref=moved[key])
                changed = True
            out.append(r)
        if changed:
            led[seq] = (len(out), _json.encode(out).decode())
    refs: dict[int, tuple[int, str]] = {}
    ledger_of = dict(ledger_docs)
    for seq, doc in refs_docs:
        given = given_refs(doc, ledger_of.get(seq))
        kept = [g for g in given if g[0] not in named]
        # a fresh write's refs are read from its ledger row (schema 10): that row changes, so they are
        # written out first
        if len(kept) != len(given) or (doc == FRESH_GIVEN and seq in led):
            refs[seq] = (len(kept), _json.encode(kept).decode())
    return led, refs


# -- retention (schema 8; the policy is bili_addon/retention.py) -----------------------------------
# every table whose rows hang off one session (``session_id``): a pruned session loses them all; its
# ``sessions`` row stays as a tombstone (its ref counter: a ref is never given twice, even after)
HANGING = ("ledger_turns", "refs_turns", "affinity", "turns", "blocks", "originals", "transcript", "wire", "copies",
           "lineage", "lineage_parts", "affinity_points", "calls", "calibration")
KEPT_FLAGS = ("learned_windows", "strict_reasoning")  # what a tombstone keeps of its flags: facts of the provider
# a session's lineage record of an epoch its agent's compaction ended (kernel/lineage.py) is kept in
# ``lineage_parts`` under a key of its own: the session's id, this separator, the epoch's number (no
# sessions row of its own: the session's lineage lookups never see it; no schema change).  A
# session id holding the separator records no lineage, so no session's record is another's archive.
ARCHIVE_SEP = "\x1f"


def archived_record(session_id: str, epoch: int) -> str:
    """The ``lineage_parts`` key of the session's record of ``epoch`` (one its compaction ended)."""
    return f"{session_id}{ARCHIVE_SEP}{epoch}"


# those of ``lane``'s sessions whose opening is a part (Store.lineage_archived): the head index's rows whose
# key holds the separator, joined with their session's row (the key up to the separator)
_ARCHIVED = ("SELECT s.id, p.session_id FROM lineage_parts p JOIN sessions s "
             "ON s.id=substr(p.session_id, 1, instr(p.session_id, char(31)) - 1) "
             "WHERE p.seq=0 AND p.fp=? AND s.lane=? AND instr(p.session_id, char(31)) > 0 "
             "ORDER BY s.created, p.session_id")


def archived_records(session_id: str, flags: str) -> list[str]:
    """The keys the session's archived lineage records may have: one per epoch its flags say ended
    (each entry of ``epochs`` began one, and ended the one before it)."""
    try:
        eps = json.loads(flags or "{}").get("epochs") or ()
    except (ValueError, AttributeError):
        return []
    return [archived_record(session_id, int(e["epoch"]) - 1) for e in eps
            if isinstance(e, dict) and isinstance(e.get("epoch"), int)]


def tombstone_flags(flags: str) -> str:
    """A pruned session's flags: the provider's learned facts only (held folds, reminders, per-ref
    notes name rows that are gone)."""
    try:
        doc = json.loads(flags or "{}")
    except ValueError:
        doc = {}
    return json.dumps({k: doc[k] for k in KEPT_FLAGS if k in doc}, sort_keys=True)


def dead_chains(cands: dict[str, tuple[str, str]], pointing: list[tuple[str, str, str]]) -> list[str]:
    """Of the chain rows ``cands`` (``id -> (agent_base, sent_base)``), those no other row needs:
    a row is rebuilt from its bases, so every base of a row that stays (``pointing``: ``(id,
    agent_base, sent_base)`` of rows pointing into ``cands``; those among ``cands`` do not count),
    and their bases in turn, stay too."""
    keep: set[str] = set()
    todo = [b for rid, a, sb in pointing if rid not in cands for b in (a, sb) if b in cands and b != rid]
    while todo:
        rid = todo.pop()
        if rid in keep:
            continue
        keep.add(rid)
        todo += [b for b in cands[rid] if b in cands and b != rid and b not in keep]
    return sorted(set(cands) - keep)


@dataclass(slots=True)
class SessionRow:
    id: str
    agent: str
    lane: str
    created: float
    last_seen: float
    requests: int
    messages: int
    next_ref: int
    flags: str = "{}"  # JSON object of learned per-session facts (strict reasoning echo, ...)
    version: int = 0  # advanced by every write to the session's state, by any process


@dataclass(slots=True)
class UsageTotals:
    turns: int
    input_tokens: int
    cache_read: int
    cache_write: int
    output_tokens: int
    last: tuple[int, int, int, int] | None  # the newest turn: input, cache read, cache write, output
    # the answer count when ``last`` was recorded (``turns`` counts side requests' answers too, whose usage
    # is never ``last``: what came after ``last`` tells nothing of the conversation's size)
    last_n: int = 0


@dataclass(slots=True)
class WireTurn:
    """One answered turn as it went on the wire (table ``wire``)."""

    n: int  # the session's n-th answered turn (0: not numbered yet)
    ts: float
    request: int  # the session's request count when it was sent
    model: str
    agent_tokens: int  # what the agent sent (estimated tokens)
    sent_tokens: int  # what bili sent
    predicted: float | None  # cache-read share predicted from the bytes shared with the previous request
    blocks: int  # active fold blocks
    folded: int  # items left off the wire
    executed: list[str]  # proxy tools run for the request
    input_tokens: int  # the provider's usage: every prompt token
    cache_read: int
    cache_write: int
    output_tokens: int
    cache_write_1h: int = 0  # the part of cache_write made for 1 hour (schema 9)
    write_split: str = ""  # who split the writes: "reported" (the provider), "sent" (the request's breakpoints), ""
    side: bool = False  # a side request's (a title request beside the conversation: schema 13), not the conversation's


# the columns of ``wire`` in WireTurn's order (both backends read them so)
WIRE_COLS = ("n, ts, request, model, agent_tokens, sent_tokens, predicted, blocks, folded, executed, "
             "input_tokens, cache_read, cache_write, output_tokens, cache_write_1h, write_split, side")
# a session's last answered turn (``wire_totals``): its conversation's newest, a side request's only if it has
# nothing else (the figures' "now", model and predicted share are the conversation's)
WIRE_LAST = f"SELECT {WIRE_COLS} FROM wire WHERE session_id={{}} ORDER BY side, n DESC LIMIT 1"
# a session's wire sums per model (``wire_totals``): model, input, cache read, cache write, output, agent
# minus sent, the writes' 1-hour part, and the writes whose split the provider reported / bili derived, ...,
# then whether the turns' requests were over prices.LONG_PROMPT, and whether the agent's own would have been
# (a model's long-context price is for the whole request: sums are linear on each side of the line)
WIRE_SUMS = ("model, SUM(input_tokens), SUM(cache_read), SUM(cache_write), SUM(output_tokens), "
             "SUM(agent_tokens - sent_tokens), SUM(cache_write_1h), "
             "SUM(CASE WHEN write_split='reported' THEN cache_write ELSE 0 END), "
             "SUM(CASE WHEN write_split='sent' THEN cache_write ELSE 0 END), "
             # the tokens bili took off the turns, and where what it added was taken off (prices.added_where)
             "SUM(CASE WHEN agent_tokens > sent_tokens THEN agent_tokens - sent_tokens ELSE 0 END), "
             "SUM(lx), SUM(sx), SUM(px), SUM(rx), lw, lo")
WIRE_GROUP = "model, lw, lo"


def _wire_rows(p: str) -> str:
    """A session's wire rows (its id the parameter ``p``) with :func:`prices.added_where
    <bili_addon.prices.added_where>` of each turn as columns (``lx``, ``sx``, ``px``, ``rx``), one step
    per column (standard SQL: both stores run it), for :data:`WIRE_SUMS`."""
    t0 = ("SELECT model, input_tokens, cache_read, cache_write, output_tokens, agent_tokens, sent_tokens, "
          "cache_write_1h, write_split, "
          "CASE WHEN sent_tokens > agent_tokens THEN sent_tokens - agent_tokens ELSE 0 END AS x, "
          "CASE WHEN cache_write_1h < cache_write THEN cache_write_1h ELSE cache_write END AS h, "
          "CASE WHEN input_tokens - cache_read - cache_write > 0 THEN input_tokens - cache_read - cache_write "
          "ELSE 0 END AS u, "
          f"CASE WHEN input_tokens > {LONG_PROMPT} THEN 1 ELSE 0 END AS lw, "
          f"CASE WHEN input_tokens + agent_tokens - sent_tokens > {LONG_PROMPT} THEN 1 ELSE 0 END AS lo "
          f"FROM wire WHERE session_id={p}")
    t1 = f"SELECT *, CASE WHEN x < h THEN x ELSE h END AS lx FROM ({t0}) AS t0"
    t2 = (f"SELECT *, CASE WHEN x - lx < cache_write - lx THEN x - lx ELSE cache_write - lx END AS sx "
          f"FROM ({t1}) AS t1")
    t3 = f"SELECT *, CASE WHEN x - lx - sx < u THEN x - lx - sx ELSE u END AS px FROM ({t2}) AS t2"
    t4 = (f"SELECT *, CASE WHEN x - lx - sx - px < cache_read THEN x - lx - sx - px ELSE cache_read END AS rx "
          f"FROM ({t3}) AS t3")
    return f"({t4}) AS w"


WIRE_ROWS = _wire_rows("?")


@dataclass(slots=True)
class CalibrationRow:
    """One answered request as the cache model predicted it and the provider reported it (table
    ``calibration``; tokens: the model's estimate for ``predicted_*``, the provider's count for
    ``reported_*``)."""

    n: int  # the session's n-th observation (0: not numbered yet)
    ts: float  # when the request left
    host: str  # where it went
    family: str  # the cache model: anthropic | openai | gemini
    lane: str
    gap: float | None  # seconds since the session's previous request (None: its first seen)
    age: float | None  # seconds the entry the model expected to read had been unused (None: no read expected)
    predicted_input: int  # every prompt token
    predicted_read: int
    predicted_write: int
    reported_input: int | None
    reported_read: int
    reported_write: int | None  # None: the provider does not report writes (OpenAI, Gemini)


CALIBRATION_COLS = ("n, ts, host, family, lane, gap, age, predicted_input, predicted_read, predicted_write, "
                    "reported_input, reported_read, reported_write")


# a session's usage totals and its last usage with its number (both stores; LEFT JOIN: no answer yet)
USAGE = ("SELECT s.turns, s.input_tokens, s.cache_read, s.cache_write, s.output_tokens, t.n, t.input_tokens, "
         "t.cache_read, t.cache_write, t.output_tokens FROM sessions s LEFT JOIN (SELECT n, input_tokens, cache_read, "
         "cache_write, output_tokens FROM turns WHERE session_id={0} ORDER BY n DESC LIMIT 1) t ON true "
         "WHERE s.id={0}")


def usage_totals(row: tuple | None) -> UsageTotals:
    """A :data:`USAGE` row (None: no such session) as :class:`UsageTotals`."""
    if row is None:
        return UsageTotals(0, 0, 0, 0, 0, None)
    last = None if row[5] is None else tuple(int(x) for x in row[6:])
    return UsageTotals(*(int(x) for x in row[:5]), last=last, last_n=int(row[5] or 0))


def wire_turn(r: tuple) -> WireTurn:
    """A ``wire`` row (:data:`WIRE_COLS`) as a :class:`WireTurn`."""
    return WireTurn(*r[:9], [x for x in r[9].split(",") if x], *r[10:16], bool(r[16]))


DB_NAME = "bili.sqlite3"


def _reads(fn):
    """A read of the store: a SQLite failure (a lock that blocks readers too, an I/O error) is a
    :class:`StoreError` with its cause, like a failed write."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except sqlite3.Error as e:
            raise store_error("read", self.path, e) from e
    return wrapper


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "share")
    return Path(base) / "bili-addon"


def secure(db: Path) -> list[str]:
    """The data dir 0700, the store and its WAL files 0600, whatever the umask (a fresh store is
    created 0600 before SQLite opens it; SQLite gives the WAL files the store's mode).  Returns the
    existing paths whose modes were wider.  Raises :class:`private.NotPrivate` when one of them is
    another user's (or a link): SQLite would write every conversation into their file."""
    out = [str(db.parent)] if private.private_dir(db.parent) else []
    private.create_private(db)
    return out + [p for p in (str(db), f"{db}-wal", f"{db}-shm") if private.tighten(p)]


class _Checkpointer:
    """Copies the WAL into the store file on a thread of its own (``PRAGMA wal_checkpoint(PASSIVE)``:
    it never waits for a writer or a reader, nor makes one wait) once a commit left the WAL past
    :data:`WAL_CHECKPOINT_PAGES`.  SQLite runs that checkpoint inside the commit that crosses its
    threshold, fsyncs included: 10-60 ms of one commit in ~20 of a proxy's first turns of 1,000
    messages (~50 pages each), ~2 ms on average against ~0.2 ms.  A commit is as durable as before
    (the WAL is written before the commit returns, the checkpoint was never part of that)."""

    def __init__(self, path: Path):
        self.path = path
        self.wal = str(path.with_name(path.name + "-wal"))
        self.owed = 0  # pages commits may have added to the WAL since its size was last looked at
        self.limit = 0
        self.event = threading.Event()
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.runs = 0  # checkpoints made (tests)

    def poke(self, page_size: int, pages: int = 0) -> None:
        """After a commit: wake the thread when the WAL has grown past the threshold (one stat).
        ``pages``: at most how many pages the commit wrote (0: not known): the WAL's size is looked
        at once such commits may have added :data:`POKE_PAGES` since the last look."""
        if pages:
            owed = self.owed + pages
            if owed < POKE_PAGES:
                self.owed = owed
                return
        self.owed = 0
        try:
            size = os.stat(self.wal).st_size
        except OSError:
            return
        if size > WAL_CHECKPOINT_PAGES * (page_size + 24) and not self.stopped:
            if self.thread is None:  # started the first time it is needed (most stores never are)
                self.thread = threading.Thread(target=self._run, name="bili-store-checkpoint", daemon=True)
                self.thread.start()
            self.event.set()

    def _run(self) -> None:
        db = None
        try:
            while True:
                self.event.wait()
                self.event.clear()
                if self.stopped:
                    return
                try:
                    if db is None:
                        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                        db.execute(f"PRAGMA busy_timeout={BUSY_MS}")
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.runs += 1
                except sqlite3.Error:  # the writers' backstop checkpoints instead
                    pass
        finally:
            if db is not None:
                db.close()

    def close(self) -> None:
        self.stopped = True
        if self.thread is not None:
            self.event.set()
            self.thread.join(timeout=10)


class _Tx:
    """:meth:`Store._tx`'s one atomic write (a class of its own: a generator's context manager cost
    ~1 us more per write)."""

    __slots__ = ("store", "pages")

    def __init__(self, store: "Store", pages: int):
        self.store, self.pages = store, pages

    def __enter__(self) -> sqlite3.Connection:
        store = self.store
        # this instance writes: what was read with a session may not hold
        store._cands = store._archived = store._usage = None
        try:
            store._cur.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise store_error("write", store.path, e) from e
        return store.db

    def __exit__(self, typ, e, tb) -> bool:
        store = self.store
        db = store.db
        if typ is None:
            try:
                store._cur.execute("COMMIT")
                store.writes += 1
                store._checkpointer.poke(store._page_size, self.pages)
                return False
            except BaseException as err:
                e = err
        if db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if isinstance(e, sqlite3.Error):
            raise store_error("write", store.path, e) from e
        if typ is None:
            raise e
        return False  # the body's own exception goes on


class Store:
    def _tx(self, pages: int = 0) -> _Tx:
        """One atomic write: everything inside commits together or not at all.  A failure keeps
        its own cause (SQLite rolls back by itself on a full disk: no second error about it).
        ``pages``: at most how many pages it writes, when known (:meth:`_Checkpointer.poke`)."""
        return _Tx(self, pages)

    def _advance(self, session_id: str, expect: int) -> int:
        """Inside a write transaction: the session's version must still be ``expect`` (else another
        process changed it: :class:`StaleSession`); it becomes ``expect + 1``, which is returned."""
        row = self.db.execute("SELECT version FROM sessions WHERE id=?", (session_id,)).fetchone()
        found = row[0] if row else 0
        if found != expect:
            raise StaleSession(session_id, expect, found)
        if row:
            self.db.execute("UPDATE sessions SET version=? WHERE id=?", (expect + 1, session_id))
        else:
            now = time.time()
            self.db.execute("INSERT INTO sessions(id, created, last_seen, version) VALUES(?,?,?,?)",
                            (session_id, now, now, expect + 1))
        return expect + 1

    def __init__(self, data_dir: str | os.PathLike[str], busy_ms: int = BUSY_MS):
        self.path = Path(data_dir) / DB_NAME
        self._checkpointer = _Checkpointer(self.path)
        self._page_size = 4096
        self.writes = 0  # transactions committed (the keeper's sign that a failed store works again)
        # what :meth:`hold` asked :meth:`session_state` to read with the session's row (``(session, (first
        # fingerprint, lane))``), and the fork candidates it read (``((first fingerprint, lane), ids)``):
        # :meth:`lineage_candidates` answers from them once, until this instance writes or releases
        self._want: tuple[str, tuple[str, str]] | None = None
        self._cands: tuple[tuple[str, str], list[str]] | None = None
        self._archived: tuple[tuple[str, str], list[tuple[str, str]]] | None = None  # (lineage_archived's, likewise)
        self._usage: tuple[str, tuple[int, int, int, int] | None] | None = None  # (read by version)
        self.tightened: list[str] = []  # existing files and dirs made private at open (logged by the shell)
        self._locks = None
        try:
            self.tightened = secure(self.path)
            # the sessions' locks across processes (locks.py): a turn's refs given by one process at a time
            self._locks = open_locks(self.path.parent, LOCK_WAIT)
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # one cursor for a turn's statements (its read, its commit): Connection.execute makes a cursor
            # per statement, and its setup and teardown were ~1-2 us of each (whose results are read at
            # once: the keeper runs the store's work on one thread)
            self._cur = self.db.cursor()
        except (sqlite3.Error, OSError) as e:
            raise store_error("open", self.path, e) from e
        try:
            self.db.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
            self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a new store only: retention frees pages bit by bit
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            # the WAL's checkpoints off the writers' path (_Checkpointer); this connection's only past the backstop
            self.db.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
            self._page_size = self.db.execute("PRAGMA page_size").fetchone()[0]
            # the WAL file cut back to half the threshold when a write starts it over after a checkpoint:
            # its size then says how much is left to copy (else, grown once, it would wake the thread,
            # and make a checkpoint with its fsyncs, after every commit)
            self.db.execute(f"PRAGMA journal_size_limit={WAL_CHECKPOINT_PAGES // 2 * (self._page_size + 24)}")
            have = self._stamp()
            if have > SCHEMA_VERSION:  # (before _SCHEMA: not even a table of ours made in it)
                raise newer_schema(self.where, have)
            self.db.executescript(_SCHEMA)
            self._migrate()
        except (sqlite3.Error, OSError, StoreError) as e:
            self.close()
            if isinstance(e, StoreError):
                raise
            raise store_error("open", self.path, e) from e

    def _migrate(self) -> None:
        """Bring a store of an older schema up to date (idempotent; one transaction).  A step is taken
        when the store lacks what it makes, whatever its stamp says: a development branch stamped its
        own steps with the same numbers (``ttl``, c59c025: schema 8 was the wire's 1-hour writes, without
        retention's ``sessions.pruned``), and a column that came without a migration (the chains'
        ``owner``) was never stamped at all; such a store, stamped with every later schema since, heals
        on its next open."""
        have = self.schema_version()
        if have >= SCHEMA_VERSION and not self._lacks():
            return
        with self._tx():
            lacks = self._lacks()  # (again, in the write: another process may have mended it meanwhile)
            # 3: the wire table, 4: the calibration table, 5: the chains table, made by _SCHEMA like
            # every table; nothing to move. 6: nothing in SQLite (PostgreSQL's turn commit became functions);
            # 11, 12: nothing either (PostgreSQL's turn commit takes the copy; a family's commits serialised)
            if "legacy" in lacks:  # a store of schema 6 or older: its ledger and refs one row per part
                self.db.execute(_LEGACY)  # (a store of schema 1 may have none)
                if have < 2:
                    self._repair_refs()
                self._one_row_per_write()
            if "retention" in lacks:
                self._retention_schema()
            if "wire_split" in lacks:
                self._wire_split()
            if "fresh_refs" in lacks:  # the refs view reads a fresh write's refs from its ledger row too
                self.db.execute("DROP VIEW IF EXISTS refs")
            if "owner" in lacks:
                self.db.execute("ALTER TABLE chains ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            for stmt in _VIEWS.split(";"):
                if stmt.strip():
                    self.db.execute(stmt)
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('schema_version', ?)",
                            (str(SCHEMA_VERSION),))

    def _lacks(self) -> set[str]:
        """The migration steps whose work this store does not hold (a few reads of SQLite's catalogue):
        ``legacy`` (schema 7: the ledger and refs still tables of one row per part), ``retention`` (8),
        ``wire_split`` (9 and 13: ``wire.side``), ``fresh_refs`` (10: the ``refs`` view reads ``ledger_turns`` too), ``owner``
        (the chains' owner), ``views`` (the ``ledger`` and ``refs`` views)."""
        def cols(table: str) -> set[str]:
            return {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}

        made = {(kind, name): sql for kind, name, sql in self.db.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE type IN ('table', 'view', 'index')")}
        out = set()
        if ("table", "ledger") in made:
            out.add("legacy")
        if ("pruned" not in cols("sessions") or ("index", "chains_agent_base") not in made
                or ("index", "chains_sent_base") not in made):
            out.add("retention")
        if not {"cache_write_1h", "write_split", "side"} <= cols("wire"):
            out.add("wire_split")
        refs = made.get(("view", "refs"))
        if refs is not None and "ledger_turns" not in refs:
            out.add("fresh_refs")
        if "owner" not in cols("chains"):
            out.add("owner")
        if refs is None or ("view", "ledger") not in made:
            out.add("views")
        return out

    def _wire_split(self) -> None:
        """Schema 9: the 1-hour part of each turn's cache writes (``cache_write_1h``) and who said it
        (``write_split``: "reported" by the provider, "sent" from the request's breakpoints; '' in the
        rows of older stores: priced at the 5-minute rate, as they were)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(wire)")}
        if "cache_write_1h" not in cols:
            self.db.execute("ALTER TABLE wire ADD COLUMN cache_write_1h INTEGER NOT NULL DEFAULT 0")
        if "write_split" not in cols:
            self.db.execute("ALTER TABLE wire ADD COLUMN write_split TEXT NOT NULL DEFAULT ''")
        if "side" not in cols:  # (schema 13: older rows are the conversation's, as they were counted)
            self.db.execute("ALTER TABLE wire ADD COLUMN side INTEGER NOT NULL DEFAULT 0")

    def _repair_refs(self) -> None:
        """Schema 2: a ``version`` per session and the ``refs`` table filled from the ledger (the
        tables of schema 6, before :meth:`_one_row_per_write` moves them)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(sessions)")}
        if "version" not in cols:
            self.db.execute("ALTER TABLE sessions ADD COLUMN version INTEGER NOT NULL DEFAULT 0")
        # each ref names the text it was first given (a store written by two processes before
        # this schema may hold a ref twice); allocation continues after every ref ever given
        self.db.execute("INSERT OR IGNORE INTO refs(session_id, ref, content_hash) "
                        "SELECT session_id, ref, content_hash FROM ledger ORDER BY first_seen")
        self.db.execute(
            "UPDATE sessions SET next_ref=given + 1, version=version + 1 FROM (SELECT session_id, "
            "MAX(CAST(substr(ref, 2) AS INTEGER)) AS given FROM refs GROUP BY session_id) AS r "
            "WHERE r.session_id=sessions.id AND sessions.next_ref <= r.given")

    def _one_row_per_write(self) -> None:
        """Schema 7: the ledger's rows of a schema-6 store grouped into one ``ledger_turns`` row per
        session and ``first_seen`` (the rows one write made share it: every row keeps its
        first_seen), numbered up to 0 in that order; each session's refs into one ``refs_turns`` row
        (seq 0); then the tables of one row per part go (their views take their names)."""
        self.db.execute(
            "INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) "
            "SELECT session_id, ROW_NUMBER() OVER (PARTITION BY session_id ORDER BY first_seen) "
            "- COUNT(*) OVER (PARTITION BY session_id), first_seen, COUNT(*), "
            "json_group_array(json_array(msg_id, content_hash, ref, role, ctype, tokens)) "
            "FROM (SELECT * FROM ledger ORDER BY session_id, msg_id, content_hash) GROUP BY session_id, first_seen")
        self.db.execute(
            "INSERT INTO refs_turns(session_id, seq, n, given) SELECT session_id, 0, COUNT(*), "
            "json_group_array(json_array(ref, content_hash)) FROM (SELECT * FROM refs ORDER BY session_id, ref) "
            "GROUP BY session_id")
        self.db.execute("DROP TABLE ledger")
        self.db.execute("DROP TABLE refs")

    def _retention_schema(self) -> None:
        """Schema 8 (retention, bili_addon/retention.py): ``sessions.pruned``, when the session's rows
        were last pruned (its row stays, a tombstone keeping its ref counter; listed again once it
        is seen after that), and indexes of the chains' bases (what a pruned row may not be)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(sessions)")}
        if "pruned" not in cols:
            self.db.execute("ALTER TABLE sessions ADD COLUMN pruned REAL NOT NULL DEFAULT 0")
        self.db.execute("CREATE INDEX IF NOT EXISTS chains_agent_base ON chains(agent_base)")
        self.db.execute("CREATE INDEX IF NOT EXISTS chains_sent_base ON chains(sent_base)")

    def close(self) -> None:
        self._checkpointer.close()
        if self._locks is not None:
            self._locks.close()
        try:
            self.db.close()
        except (sqlite3.Error, AttributeError):
            pass

    @property
    def exclusive(self) -> bool:
        """Whether :meth:`hold` keeps every other process off the session until :meth:`release`
        (then a turn may send its request before its write: ``Engine.write_behind``)."""
        return self._locks is not None

    @contextmanager
    def snapshot(self):
        """Reads that see one consistent state of the store (another process may be writing)."""
        if self.db.in_transaction:
            yield
            return
        try:
            self.db.execute("BEGIN")
        except sqlite3.Error as e:
            raise store_error("read", self.path, e) from e
        try:
            yield
        finally:
            if self.db.in_transaction:
                try:
                    self.db.execute("COMMIT")
                except sqlite3.Error:
                    pass

    # a session's version and, in the same statement, the usage of its latest answer (the turn that
    # checks its version asks for that next: the reminder's measure): a follow-up turn's reads in one
    _VERSION_USAGE = ("SELECT s.version, t.n, t.input_tokens, t.cache_read, t.cache_write, t.output_tokens "
                      "FROM sessions s LEFT JOIN (SELECT n, input_tokens, cache_read, cache_write, output_tokens "
                      "FROM turns WHERE session_id=?1 ORDER BY n DESC LIMIT 1) t ON 1 WHERE s.id=?1")

    @_reads
    def version(self, session_id: str) -> int:
        """The session's version in the store (0: never written).  The usage of its latest answer is
        read with it: :meth:`last_usage` answers from it once, until this instance writes or releases."""
        row = self._cur.execute(self._VERSION_USAGE, (session_id,)).fetchone()
        if row is None:
            self._usage = None
            return 0
        self._usage = (session_id, tuple(row[2:]) if row[1] is not None else None)
        return row[0]

    # -- reads ---------------------------------------------------------------------------------
    @_reads
    def session(self, session_id: str) -> SessionRow | None:
        row = self.db.execute(
            "SELECT id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version FROM sessions "
            "WHERE id=?",
            (session_id,),
        ).fetchone()
        return SessionRow(*row) if row else None

    @_reads
    def sessions(self) -> list[SessionRow]:
        rows = self.db.execute(
            "SELECT id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version FROM sessions "
            "WHERE pruned < last_seen ORDER BY last_seen DESC"  # not a pruned one's tombstone (schema 8)
        ).fetchall()
        return [SessionRow(*r) for r in rows]

    @_reads
    def ledger(self, session_id: str) -> list[LedgerRow]:
        return ledger_rows(r[0] for r in self.db.execute(
            "SELECT rows FROM ledger_turns WHERE session_id=? ORDER BY seq", (session_id,)))

    # a session's row and, in the same statement, the fork candidates :meth:`hold` was given (rows of
    # kind 1: ``(1, session, ..., created)``, ordered by :meth:`session_state`) and the archived records
    # of that opening (kind 2: ``(2, session, record key, ..., created)``, :data:`_ARCHIVED`'s): one read
    # of the store for a new session instead of three (the candidates' own statement was ~18 us of a
    # first turn, the archived records' ~20 us more)
    _ROW_AND_CANDS = (
        "SELECT 0, id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version FROM sessions "
        "WHERE id=?1 UNION ALL SELECT 1, p.session_id, NULL, NULL, s.created, NULL, NULL, NULL, NULL, NULL, NULL "
        "FROM lineage_parts p JOIN sessions s ON s.id=p.session_id WHERE p.seq=0 AND p.fp=?2 AND s.lane=?3 "
        "UNION ALL SELECT 2, s.id, p.session_id, NULL, s.created, NULL, NULL, NULL, NULL, NULL, NULL "
        "FROM lineage_parts p JOIN sessions s ON s.id=substr(p.session_id, 1, instr(p.session_id, char(31)) - 1) "
        "WHERE p.seq=0 AND p.fp=?2 AND s.lane=?3 AND instr(p.session_id, char(31)) > 0")

    def session_state(self, session_id: str) -> tuple[SessionRow | None, list[LedgerRow], list[str], list[tuple],
                                                      str | None]:
        """What loading a session reads, as one consistent state: its row, ledger, blocks, calls
        and canonical copy (PostgreSQL: one statement).  A new session's is its missing row: one
        statement, consistent on its own (its rows are written with its session row, never before),
        which reads the fork candidates :meth:`hold` was given too (:meth:`lineage_candidates`)."""
        want, self._want = self._want, None
        if want is not None and want[0] == session_id:
            key = want[1]
            try:
                rows = self._cur.execute(self._ROW_AND_CANDS, (session_id, *key)).fetchall()
            except sqlite3.Error as e:
                raise store_error("read", self.path, e) from e
            row = None
            cands = []
            archived = []
            for r in rows:
                if not r[0]:
                    row = r
                elif r[0] == 1:
                    cands.append(r)
                else:
                    archived.append(r)
            if len(cands) > 1:
                cands.sort(key=_CREATED)  # (the candidates' own statement: ORDER BY created)
            if len(archived) > 1:
                archived.sort(key=_CREATED_KEY)  # (_ARCHIVED's: ORDER BY s.created, p.session_id)
            self._cands = (key, [r[1] for r in cands])
            self._archived = (key, [(r[1], r[2]) for r in archived])
            if row is None:
                return None, [], [], [], None
        elif self.session(session_id) is None:
            return None, [], [], [], None
        with self.snapshot():
            row = self.session(session_id)  # read again with the rest
            if row is None:
                return None, [], [], [], None
            return (row, self.ledger(session_id), self.blocks(session_id), self.calls(session_id),
                    self.copy(session_id))

    @_reads
    def ref_count(self, session_id: str) -> int:
        """The session's ledger rows (a key is in one write's row only)."""
        return self.db.execute("SELECT COALESCE(SUM(n), 0) FROM ledger_turns WHERE session_id=?",
                               (session_id,)).fetchone()[0]

    @_reads
    def usage(self, session_id: str) -> UsageTotals:
        row = self.db.execute(USAGE.format("?1"), (session_id,)).fetchone()
        return usage_totals(row)

    @_reads
    def last_usage(self, session_id: str) -> tuple[int, int, int, int] | None:
        """The usage of the session's latest answer: input, cache read, cache write, output (as
        :meth:`version` read it, when nothing was written since)."""
        got, self._usage = self._usage, None
        if got is not None and got[0] == session_id:
            return got[1]
        last = self.db.execute(
            "SELECT input_tokens, cache_read, cache_write, output_tokens FROM turns WHERE session_id=? "
            "ORDER BY n DESC LIMIT 1",
            (session_id,),
        ).fetchone()
        return tuple(last) if last else None

    @_reads
    def affinity(self) -> list[tuple[str, int, str]]:
        return self.db.execute("SELECT session_id, depth, tail FROM affinity").fetchall()

    @_reads
    def affinity_of(self, tails: list[str]) -> list[tuple[str, int, str]]:
        """The prefix chains (another process may have written them) ending in one of ``tails``."""
        out: list[tuple[str, int, str]] = []
        for i in range(0, len(tails), 500):
            chunk = tails[i:i + 500]
            out += self.db.execute(
                f"SELECT session_id, depth, tail FROM affinity WHERE tail IN ({','.join('?' * len(chunk))})", chunk
            ).fetchall()
        return out

    # -- the one write of a turn ---------------------------------------------------------------
    # what a turn's commit reads first, in one statement: the session's version and ref counter (NULL:
    # no row yet) and its family's counter (a family shares one: a ref is never given twice in it)
    _FAMILY_NEXT = ("(SELECT MAX(f.next_ref) FROM lineage m JOIN sessions f ON f.id=m.session_id "
                    "WHERE m.root=(SELECT root FROM lineage WHERE session_id=?1))")
    _TURN_STATE = f"SELECT s.version, s.next_ref, {_FAMILY_NEXT} FROM (SELECT 1) LEFT JOIN sessions s ON s.id=?1"
    # the family's counter (as in _TURN_STATE; 0: not in a family)
    _FAMILY = f"COALESCE({_FAMILY_NEXT}, 0)"
    # the session's row written by the statement that checks it (one statement less per turn): the row
    # is at the version the turn was computed from (?10) and, when the turn gives refs (?11: how many),
    # its first (?12) is the session's next free number in the store (its counter, or its family's if
    # higher).  A session with a row (``expect`` > 0) has it updated; a new one (0) has it made, when
    # there is none and it is in no family (a new session's first ref is 1; its SELECT reads no
    # ``sessions``: an INSERT that reads its own table copies what it reads to a temporary table
    # first, ~4x the statement).  No row written: what _TURN_STATE reads says why (nothing was
    # written meanwhile), and the row is written as it was before.
    _TURN_UPDATE = ("UPDATE sessions SET agent=?2, lane=?3, last_seen=?4, requests=?5, messages=?6, next_ref=?7, "
                    "flags=?8, version=?9 WHERE id=?1 AND version=?10 AND (?11=0 OR MAX(next_ref, "
                    f"{_FAMILY})=?12)")
    _TURN_INSERT = ("INSERT OR IGNORE INTO sessions(id, agent, lane, created, last_seen, requests, messages, "
                    "next_ref, flags, version) SELECT ?1, ?2, ?3, ?4, ?4, ?5, ?6, ?7, ?8, ?9 "
                    "WHERE ?10=0 AND (?11=0 OR (?12=1 AND NOT EXISTS (SELECT 1 FROM lineage WHERE session_id=?1)))")
    # (a new session's row is created with the time of its first write, as _advance creates it)
    _TURN_UPSERT = ("INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, "
                    "version) VALUES(?1,?2,?3,?4,?4,?5,?6,?7,?8,?9) ON CONFLICT(id) DO UPDATE SET "
                    "agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen, "
                    "requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref, "
                    "flags=excluded.flags, version=excluded.version")

    def commit_turn(
        self,
        row: SessionRow,
        new_refs: list[LedgerRow],
        chain: tuple[int, str] | None = None,
        *,
        expect: int,
        minted: list[tuple[str, str]] = (),
        fresh: bool = False,
        copy: str | None = None,
        release: bool = False,  # (PostgreSQL's: the session's lock goes with it; nothing to let go here)
    ) -> int:
        """Write a turn atomically: the refs it gives for the first time (``minted``: ``(ref,
        content hash)`` in order), its new ledger rows, the session's counters, its prefix chain.
        ``expect``: the session's version this turn was computed from; returns the new one.
        ``fresh``: every row of ``new_refs`` gives its ref for the first time, in row order (a
        conversation's first pass; ``minted`` is then left out): the write's refs are its ledger
        rows', stored once (schema 10: :data:`FRESH_GIVEN`).  ``copy``: the session's canonical copy
        (:meth:`save_copy`'s document), written in the same transaction (schema 11)."""
        now = time.time()
        fresh = fresh and bool(new_refs)
        if fresh and minted:
            raise StoreError("a fresh turn's refs are its rows' (minted must be left out)")
        k = len(new_refs) if fresh else len(minted)
        claimed = (fresh_first(new_refs) if fresh else contiguous(minted)) if k else 0
        sid = row.id
        version = expect + 1
        rows = _json.encode(new_refs).decode() if new_refs else None
        given = (FRESH_GIVEN if fresh else _json.encode(minted).decode()) if k else None
        # at most the pages this write adds to the WAL (_Checkpointer.poke): each table's leaf, split
        # or not, their overflow pages, the file's header and pointer map
        pages = 2 + 6 * (2 + (k > 0) + (chain is not None) + (copy is not None)) + (
            len(rows or "") + len(copy or "") + len(row.flags)) // 2048
        args = (sid, row.agent, row.lane, now, row.requests, row.messages, row.next_ref, row.flags, version, expect, k,
                claimed if claimed + k == row.next_ref else -1)
        db = self._cur
        with self._tx(pages):
            # the session's row, checked and written in one statement; else read, checked, written
            if not db.execute(self._TURN_UPDATE if expect else self._TURN_INSERT, args).rowcount:
                found, counter, family = db.execute(self._TURN_STATE, (sid,)).fetchone()
                if found is None:
                    found = 0
                if found != expect:
                    raise StaleSession(sid, expect, found)
                if k:  # the one place refs are given: the session's next free numbers in the store, in order
                    first = counter if counter is not None else 1
                    if family:
                        first = max(first, family)
                    if first + k != row.next_ref or claimed != first:
                        # given already: another process got there first
                        raise StaleSession(sid, row.next_ref - k, first)
                db.execute(self._TURN_UPSERT, args[:9])
            if k:
                db.execute("INSERT INTO refs_turns(session_id, seq, n, given) VALUES(?,?,?,?)",
                           (sid, version, k, given))
            if rows is not None:
                # one row for the turn's new ledger rows (schema 7): a first turn of 1,000 messages
                # wrote ~1,500 rows one by one before (~5 ms), one JSON text now
                db.execute("INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(?,?,?,?,?)",
                           (sid, version, now, len(new_refs), rows))
            if chain is not None:
                db.execute(
                    "INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(?,?,?,?) "
                    "ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail, "
                    "last_seen=excluded.last_seen",
                    (sid, chain[0], chain[1], now),
                )
            if copy is not None:
                db.execute("INSERT OR REPLACE INTO copies(session_id, doc) VALUES(?,?)", (sid, copy))
        return version

    def set_flags(self, row: SessionRow, *, expect: int) -> int:
        with self._tx():
            version = self._advance(row.id, expect)
            self.db.execute(
                "INSERT INTO sessions(id, agent, lane, created, last_seen, flags, version) VALUES(?,?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET flags=excluded.flags",
                (row.id, row.agent, row.lane, row.created, row.last_seen, row.flags, version),
            )
        return version

    @contextmanager
    def answer(self):
        """One answer's records (usage, cache observation, wire figures) are made inside: here each is
        its own transaction, as outside (PostgreSQL sends them as one statement: store_pg.PgStore.answer)."""
        yield

    def record_usage(self, session_id: str, lane: str, usage: tuple[int, int, int, int], last: bool = True) -> None:
        """One upstream answer's usage: input (all prompt tokens), cache read, cache write, output.
        ``last``: it is the conversation's size as :meth:`last_usage` gives it (not a side request's:
        counted in the totals only)."""
        inp, read, write, out = usage
        with self._tx():
            cur = self.db.execute(
                "UPDATE sessions SET turns=turns+1, input_tokens=input_tokens+?, cache_read=cache_read+?, "
                "cache_write=cache_write+?, output_tokens=output_tokens+? WHERE id=? RETURNING turns",
                (inp, read, write, out, session_id),
            ).fetchone()
            if cur is not None and last:
                self.db.execute(
                    "INSERT OR REPLACE INTO turns(session_id, n, ts, lane, input_tokens, cache_read, cache_write, "
                    "output_tokens) VALUES(?,?,?,?,?,?,?,?)",
                    (session_id, cur[0], time.time(), lane, inp, read, write, out),
                )

    # -- what went on the wire, per answered turn (stats, the page, the log line) -------------------
    def record_wire(self, session_id: str, row: "WireTurn") -> int:
        """One answered turn: what the agent sent and bili sent (estimated tokens), the predicted
        cache-read share, the fold state, and the provider's usage.  Returns its number."""
        with self._tx():
            n = self.db.execute("SELECT COALESCE(MAX(n), 0) + 1 FROM wire WHERE session_id=?",
                                (session_id,)).fetchone()[0]
            self.db.execute(
                "INSERT INTO wire(session_id, n, ts, request, model, agent_tokens, sent_tokens, predicted, blocks, "
                "folded, executed, input_tokens, cache_read, cache_write, output_tokens, cache_write_1h, write_split, "
                "side) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (session_id, n, row.ts or time.time(), row.request, row.model, row.agent_tokens, row.sent_tokens,
                 row.predicted, row.blocks, row.folded, ",".join(row.executed), row.input_tokens, row.cache_read,
                 row.cache_write, row.output_tokens, row.cache_write_1h, row.write_split, int(row.side)),
            )
        return n

    @_reads
    def wire_totals(self, session_id: str) -> tuple[int, "WireTurn | None", int, int, list[tuple]]:
        """A session's wire figures without reading every turn: ``(turns, the last turn, peak agent
        tokens, peak sent tokens, per model [(model, input, cache read, cache write, output, agent
        minus sent, 1-hour writes, writes split as reported, writes split as sent)]``
        (:data:`WIRE_SUMS`)."""
        n, peak_a, peak_s = self.db.execute(
            "SELECT COUNT(*), COALESCE(MAX(agent_tokens), 0), COALESCE(MAX(sent_tokens), 0) FROM wire "
            "WHERE session_id=?", (session_id,)).fetchone()
        if not n:
            return 0, None, 0, 0, []
        last = wire_turn(self.db.execute(WIRE_LAST.format("?"), (session_id,)).fetchone())
        models = self.db.execute(f"SELECT {WIRE_SUMS} FROM {WIRE_ROWS} GROUP BY {WIRE_GROUP} ORDER BY {WIRE_GROUP}",
                                 (session_id,)).fetchall()
        return n, last, peak_a, peak_s, models

    @_reads
    def wire(self, session_id: str) -> list["WireTurn"]:
        rows = self.db.execute(f"SELECT {WIRE_COLS} FROM wire WHERE session_id=? ORDER BY n", (session_id,)).fetchall()
        return [wire_turn(r) for r in rows]

    # -- the cache model's calibration (kernel/calibration.py) -------------------------------------
    def record_calibration(self, session_id: str, row: CalibrationRow) -> int:
        """One observation; returns its number in the session."""
        with self._tx():
            n = self.db.execute("SELECT COALESCE(MAX(n), 0) + 1 FROM calibration WHERE session_id=?",
                                (session_id,)).fetchone()[0]
            self.db.execute(
                f"INSERT INTO calibration(session_id, {CALIBRATION_COLS}) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (session_id, n, row.ts, row.host, row.family, row.lane, row.gap, row.age, row.predicted_input,
                 row.predicted_read, row.predicted_write, row.reported_input, row.reported_read, row.reported_write))
        return n

    @_reads
    def calibration(self, session_id: str, limit: int = 0) -> list[CalibrationRow]:
        """A session's observations, oldest first (``limit``: only the newest so many)."""
        sql = f"SELECT {CALIBRATION_COLS} FROM calibration WHERE session_id=? ORDER BY n DESC"
        rows = self.db.execute(sql + (" LIMIT ?" if limit else ""),
                               (session_id, limit) if limit else (session_id,)).fetchall()
        return [CalibrationRow(*r) for r in reversed(rows)]

    @_reads
    def calibration_totals(self, session_id: str) -> tuple[int, int, int, int, int, int, int]:
        """A session's observations summed without reading each: ``(count, predicted read, reported
        read, predicted write and reported write where writes are reported, how many report writes,
        how many the provider confirmed read-or-not)``."""
        return tuple(self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(predicted_read), 0), COALESCE(SUM(reported_read), 0), "
            "COALESCE(SUM(CASE WHEN reported_write IS NOT NULL THEN predicted_write END), 0), "
            "COALESCE(SUM(reported_write), 0), COUNT(reported_write), "
            "COALESCE(SUM(CASE WHEN (predicted_read > 0) = (reported_read > 0) THEN 1 ELSE 0 END), 0) "
            "FROM calibration WHERE session_id=?", (session_id,)).fetchone())

    @_reads
    def host_calibration(self, host: str, family: str, limit: int) -> list[CalibrationRow]:
        """The newest ``limit`` observations of every session at ``host`` (one cache family), oldest first."""
        rows = self.db.execute(f"SELECT {CALIBRATION_COLS} FROM calibration WHERE host=? AND family=? "
                               "ORDER BY ts DESC LIMIT ?", (host, family, limit)).fetchall()
        return [CalibrationRow(*r) for r in reversed(rows)]

    @_reads
    def calibration_hosts(self) -> list[tuple[str, str, int]]:
        """``(host, family, observations)`` of every host observed."""
        return self.db.execute("SELECT host, family, COUNT(*) FROM calibration WHERE host != '' "
                               "GROUP BY host, family ORDER BY host, family").fetchall()

    # -- folding -------------------------------------------------------------------------------
    @_reads
    def blocks(self, session_id: str) -> list[str]:
        """The blocks of a session as JSON documents, oldest first."""
        rows = self.db.execute("SELECT body FROM blocks WHERE session_id=?", (session_id,)).fetchall()
        return [r[0] for r in rows]

    @_reads
    def originals(self, session_id: str, refs: list[str] | None = None) -> list[tuple]:
        """``(ref, role, ctype, tool_name, tool_call_id, text, tokens)`` of folded messages."""
        q = "SELECT ref, role, ctype, tool_name, tool_call_id, text, tokens FROM originals WHERE session_id=?"
        rows = self.db.execute(q, (session_id,)).fetchall()
        if refs is None:
            return sorted(rows)
        want = set(refs)
        return sorted(r for r in rows if r[0] in want)

    @_reads
    def calls(self, session_id: str) -> list[tuple[str, str, str, str | None]]:
        """``(call_key, name, args, result)``; result None while the call waits for its execution."""
        return self.db.execute(
            "SELECT call_key, name, args, result FROM calls WHERE session_id=? ORDER BY created", (session_id,)
        ).fetchall()

    def record_calls(self, session_id: str, calls: list[tuple[str, str, str]], *, expect: int) -> int:
        """Proxy tool calls the model made; a call id already known is never recorded twice."""
        now = time.time()
        with self._tx():
            version = self._advance(session_id, expect)
            self.db.executemany(
                "INSERT OR IGNORE INTO calls(session_id, call_key, name, args, created) VALUES(?,?,?,?,?)",
                [(session_id, k, n, a, now) for k, n, a in calls],
            )
        return version

    def commit_fold(
        self,
        session_id: str,
        blocks: list[tuple[str, str, bool]],
        originals: list[tuple[str, str, str, str, str, str, int]],
        results: list[tuple[str, str]],
        *,
        expect: int,
    ) -> int:
        """One transaction: changed blocks ``(id, json, active)``, newly folded originals, and the
        results of the calls executed for this turn (so a retry never executes them again)."""
        now = time.time()
        with self._tx():
            version = self._advance(session_id, expect)
            self.db.executemany(
                "INSERT OR REPLACE INTO blocks(session_id, block_id, body, active) VALUES(?,?,?,?)",
                [(session_id, bid, body, int(active)) for bid, body, active in blocks],
            )
            self.db.executemany(
                "INSERT OR IGNORE INTO originals(session_id, ref, role, ctype, tool_name, tool_call_id, text, "
                "tokens) VALUES(?,?,?,?,?,?,?,?)",
                [(session_id, *o) for o in originals],
            )
            self.db.executemany(
                "UPDATE calls SET result=?, executed=? WHERE session_id=? AND call_key=? AND result IS NULL",
                [(res, now, session_id, key) for key, res in results],
            )
        return version

    @_reads
    def copy(self, session_id: str) -> str | None:
        """The canonical copy of a session's last steady pass (fold coverage under churn)."""
        row = self.db.execute("SELECT doc FROM copies WHERE session_id=?", (session_id,)).fetchone()
        return row[0] if row else None

    def save_copy(self, session_id: str, doc: str, *, expect: int) -> int:
        with self._tx():
            version = self._advance(session_id, expect)
            self.db.execute("INSERT OR REPLACE INTO copies(session_id, doc) VALUES(?,?)", (session_id, doc))
        return version

    # -- the session's own transcript (snapshot render) ------------------------------------------
    @_reads
    def transcript(self, session_id: str) -> list[tuple[str, list[str], bytes]]:
        rows = self.db.execute(
            "SELECT sig, refs, item FROM transcript WHERE session_id=? ORDER BY seq", (session_id,)
        ).fetchall()
        return [(sig, json.loads(refs), bytes(item)) for sig, refs, item in rows]

    def save_transcript(self, session_id: str, keep: int, rows: list[tuple[str, list[str], bytes]], *,
                        expect: int) -> int:
        """Rows from ``keep`` on are replaced by ``rows`` (sequence numbers ``keep``...)."""
        with self._tx():
            version = self._advance(session_id, expect)
            self.db.execute("DELETE FROM transcript WHERE session_id=? AND seq>=?", (session_id, keep))
            self.db.executemany(
                "INSERT INTO transcript(session_id, seq, sig, refs, item) VALUES(?,?,?,?,?)",
                [(session_id, keep + i, sig, json.dumps(refs), item) for i, (sig, refs, item) in enumerate(rows)],
            )
        return version

    # -- server-side chains (#13, kernel/chains.py) ------------------------------------------------
    def save_chain(self, row: tuple, *, replace: bool = False) -> bool:
        """One response of a server-side chain (a row in :data:`CHAIN_COLS` order), written once:
        False when the id is there already (another process may have written it meanwhile), unless
        ``replace`` (the tombstone of an id given twice: kernel/chains.py)."""
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._tx():
            cur = self.db.execute(f"{verb} INTO chains({', '.join(CHAIN_COLS)}) "
                                  f"VALUES({', '.join('?' * len(CHAIN_COLS))})", row)
            return cur.rowcount == 1

    @_reads
    def chain(self, response_id: str) -> tuple | None:
        r = self.db.execute(f"SELECT {', '.join(CHAIN_COLS)} FROM chains WHERE id=?", (response_id,)).fetchone()
        return None if r is None else tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)

    # -- operations: health, doctor, and copying a whole store (bili store migrate) ---------------
    backend = "sqlite"

    def hold(self, session_id: str, candidates: tuple[str, str] | None = None) -> None:
        """Serialise the session's work across processes until :meth:`release`: the session's lock
        in the lock file beside the database (locks.py; waits at most ``LOCK_WAIT`` seconds, then
        :class:`SessionBusy`: the request passes through unchanged).  The session versions still
        order what is written without it.  ``candidates``: ``(first fingerprint, lane)`` of a
        session this instance does not know yet: its fork candidates are read with its row
        (:meth:`session_state`), as PostgreSQL reads them with its lock."""
        if self._locks is not None and not self._locks.hold(session_id):
            raise SessionBusy(session_id, self._locks.wait)
        self._want = (session_id, candidates) if candidates is not None else None
        self._cands = self._archived = None

    def release(self, wait: bool = False) -> None:
        """Let go of every session :meth:`hold` took (the keeper calls it after each piece of work;
        the locks are free on return).  What hold asked to read with a session, and what was read,
        is forgotten."""
        self._want = self._cands = self._archived = self._usage = None
        if self._locks is not None:
            self._locks.release()

    @property
    def where(self) -> str:
        return str(self.path)

    def schema_version(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else 0

    def _stamp(self) -> int:
        """:meth:`schema_version` of a store that may have no ``meta`` table yet (a new one: 0)."""
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
            return 0
        return self.schema_version()

    def ping(self) -> float:
        """Seconds for one read of the store."""
        t = time.perf_counter()
        self.db.execute("SELECT 1").fetchone()
        return time.perf_counter() - t

    @_reads
    def dump(self, table: str, cols: tuple[str, ...], key: tuple[str, ...]) -> list[tuple]:
        rows = self.db.execute(f"SELECT {', '.join(cols)} FROM {table} ORDER BY {', '.join(key)}").fetchall()
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]

    def load(self, table: str, cols: tuple[str, ...], rows: list[tuple]) -> None:
        with self._tx():
            self.db.executemany(f"INSERT INTO {table}({', '.join(cols)}) VALUES({', '.join('?' * len(cols))})", rows)

    def clear(self, tables) -> None:
        """Every row of ``tables`` gone, in one transaction (a copy into this store that failed)."""
        with self._tx():
            for table in tables:
                self.db.execute(f"DELETE FROM {table}")

    @_reads
    def is_empty(self) -> bool:
        return self.db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 0

    # -- lineage (#15, #20): kept apart from the rest; nothing above depends on it -------------------
    def lineage(self) -> list[tuple[str, str, str, int]]:
        """``(session, parent, root, fork_at)`` of every session that is part of a family."""
        return self.db.execute("SELECT session_id, parent, root, fork_at FROM lineage ORDER BY created").fetchall()

    def lineage_parts(self, session_id: str) -> list[tuple[str, str, str]]:
        """The session's recorded history, in conversation order: ``(ref, content hash, verification
        fingerprint)`` per part."""
        return self.db.execute(
            "SELECT ref, chash, fp FROM lineage_parts WHERE session_id=? ORDER BY seq", (session_id,)
        ).fetchall()

    def save_lineage_parts(self, session_id: str, keep: int, rows: list[tuple[str, str, str]]) -> None:
        """Parts from ``keep`` on are replaced by ``rows``."""
        with self._tx():
            self.db.execute("DELETE FROM lineage_parts WHERE session_id=? AND seq>=?", (session_id, keep))
            self.db.executemany(
                "INSERT INTO lineage_parts(session_id, seq, ref, chash, fp) VALUES(?,?,?,?,?)",
                [(session_id, keep + i, *row) for i, row in enumerate(rows)],
            )

    def lineage_archived(self, first_fp: str, lane: str) -> list[tuple[str, str]]:
        """``(session, key)`` of the archived records (:func:`archived_record`) of ``lane``'s sessions
        that open with this part, oldest session first (once as :meth:`session_state` read them with
        the session, when nothing was written since)."""
        got, self._archived = self._archived, None
        if got is not None and got[0] == (first_fp, lane):
            return got[1]
        return self.db.execute(_ARCHIVED, (first_fp, lane)).fetchall()

    def lineage_candidates(self, first_fp: str, lane: str) -> list[str]:
        """Sessions of ``lane`` whose recorded history opens with this part, oldest first (once as
        :meth:`session_state` read them with the session, when nothing was written since)."""
        got, self._cands = self._cands, None
        if got is not None and got[0] == (first_fp, lane):
            return got[1]
        return [r[0] for r in self.db.execute(
            "SELECT p.session_id FROM lineage_parts p JOIN sessions s ON s.id=p.session_id "
            "WHERE p.seq=0 AND p.fp=? AND s.lane=? ORDER BY s.created", (first_fp, lane)
        ).fetchall()]

    def family_next_ref(self, root: str) -> int:
        """The next ref no session of the family has given (refs are never given twice in a family)."""
        row = self.db.execute(
            "SELECT MAX(next_ref) FROM sessions WHERE id IN (SELECT session_id FROM lineage WHERE root=?)", (root,)
        ).fetchone()
        return int(row[0]) if row and row[0] else 1

    def family(self, session_id: str) -> tuple[str, str, int, int] | None:
        """``(root, parent, fork_at, the family's next ref)`` of a session in a family, else None
        (read from the store on every turn: another proxy on the same store may have made it one)."""
        row = self.db.execute(
            "SELECT l.root, l.parent, l.fork_at, (SELECT MAX(s.next_ref) FROM sessions s JOIN lineage m "
            "ON m.session_id=s.id WHERE m.root=l.root) FROM lineage l WHERE l.session_id=?", (session_id,)
        ).fetchone()
        return (row[0], row[1], row[2], int(row[3] or 1)) if row else None

    def adopt(self, child: SessionRow, parent: str, root: str, fork_at: int, ledger: list[LedgerRow],
              blocks: list[tuple[str, str, bool]], originals: list[tuple], calls: list[tuple[str, str, str, str | None]],
              retired: list[tuple[str, str, str]] = (), *, expect: int) -> int:
        """One transaction: ``child`` becomes ``parent``'s child in ``root``'s family and takes what it
        inherits (ledger rows, blocks, their originals, call results); ``retired``: ``(msg_id,
        content_hash, new ref)`` of the child's own rows whose ref an inherited row takes.  A session
        write like any other: ``expect`` is the child's version, the new one is returned."""
        # the parent's lock too, until this turn's release: a turn of the parent in another process may have
        # sent refs of the family's counter whose write waits (write-behind: it was in no family at its lock)
        if self._locks is not None and not self._locks.hold(parent):
            raise SessionBusy(parent, self._locks.wait)
        now = time.time()
        with self._tx():
            version = self._advance(child.id, expect)
            _not_pruned(child.id, parent, self.db.execute("SELECT pruned, last_seen FROM sessions WHERE id=?",
                                                          (parent,)).fetchone(), expect)
            if retired:  # (the one writer: the family's counter as every earlier write left it; its root's
                # too, not in lineage before its first fork)
                got = self.db.execute("SELECT MAX(next_ref) FROM sessions WHERE id=? OR id IN "
                                      "(SELECT session_id FROM lineage WHERE root=?)", (root, root)).fetchone()
                retired_taken(child.id, retired, int(got[0]) if got and got[0] else 1, expect)
            # the child's own rows and refs the inherited ones replace, and its retired rows' new refs
            led, given = rebase(
                self.db.execute("SELECT seq, rows FROM ledger_turns WHERE session_id=?", (child.id,)).fetchall(),
                self.db.execute("SELECT seq, given FROM refs_turns WHERE session_id=?", (child.id,)).fetchall(),
                ledger, retired)
            for table, col, docs in (("ledger_turns", "rows", led), ("refs_turns", "given", given)):
                for seq, (n, doc) in docs.items():
                    if n:
                        self.db.execute(f"UPDATE {table} SET n=?, {col}=? WHERE session_id=? AND seq=?",
                                        (n, doc, child.id, seq))
                    else:
                        self.db.execute(f"DELETE FROM {table} WHERE session_id=? AND seq=?", (child.id, seq))
            # the refs each name one text in the child from now on
            named = [(r.ref, r.content_hash) for r in ledger] + [(ref, chash) for _msg_id, chash, ref in retired]
            named = list(dict(named).items())
            if named:
                self.db.execute("INSERT INTO refs_turns(session_id, seq, n, given) VALUES(?,?,?,?)",
                                (child.id, version, len(named), _json.encode(named).decode()))
            self.db.execute(
                "INSERT OR IGNORE INTO lineage(session_id, parent, root, fork_at, created) VALUES(?,?,?,?,?)",
                (root, "", root, 0, now),
            )
            self.db.execute(
                "INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES(?,?,?,?,?)",
                (child.id, parent, root, fork_at, now),
            )
            self.db.execute(
                "INSERT INTO sessions(id, agent, lane, created, last_seen, next_ref, flags) VALUES(?,?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET next_ref=MAX(next_ref, excluded.next_ref), flags=excluded.flags",
                (child.id, child.agent, child.lane, child.created, now, child.next_ref, child.flags),
            )
            rows = list({(r.msg_id, r.content_hash): r for r in ledger}.values())
            if rows:
                self.db.execute("INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(?,?,?,?,?)",
                                (child.id, version, now, len(rows), _json.encode(rows).decode()))
            self.db.executemany(
                "INSERT OR REPLACE INTO blocks(session_id, block_id, body, active) VALUES(?,?,?,?)",
                [(child.id, bid, body, int(active)) for bid, body, active in blocks],
            )
            self.db.executemany(
                "INSERT OR IGNORE INTO originals(session_id, ref, role, ctype, tool_name, tool_call_id, text, "
                "tokens) VALUES(?,?,?,?,?,?,?,?)",
                [(child.id, *o) for o in originals],
            )
            self.db.executemany(
                "INSERT OR IGNORE INTO calls(session_id, call_key, name, args, result, created, executed) "
                "VALUES(?,?,?,?,?,?,?)",
                [(child.id, k, n, a, r, now, now if r is not None else None) for k, n, a, r in calls],
            )
        return version

    def affinity_points(self, hashes: list[str]) -> dict[str, list[tuple[str, int]]]:
        """Every recorded point of an id-less session's history among ``hashes``:
        ``{hash: [(session, depth), ...]}``, the most recently seen session first."""
        out: dict[str, list[tuple[str, int]]] = {}
        for i in range(0, len(hashes), 500):
            chunk = hashes[i : i + 500]
            rows = self.db.execute(
                "SELECT p.hash, p.session_id, p.depth FROM affinity_points p LEFT JOIN affinity a "
                f"ON a.session_id=p.session_id WHERE p.hash IN ({','.join('?' * len(chunk))}) "
                "ORDER BY a.last_seen DESC",
                chunk,
            ).fetchall()
            for h, sid, depth in rows:
                out.setdefault(h, []).append((sid, depth))
        return out

    def add_affinity_points(self, session_id: str, points: list[tuple[int, str]]) -> None:
        """Points ``(depth, hash)`` of an id-less session's history (known ones are kept)."""
        if points:
            self._write_many(
                "INSERT OR IGNORE INTO affinity_points(hash, session_id, depth) VALUES(?,?,?)",
                [(h, session_id, d) for d, h in points],
            )

    def _write_many(self, sql: str, rows: list[tuple]) -> None:
        with self._tx():
            self.db.executemany(sql, rows)

    # -- retention (schema 8; the policy and its rules: bili_addon/retention.py) ------------------
    @_reads
    def idle_sessions(self, before: float) -> list[tuple[str, float]]:
        """``(id, last_seen)`` of the sessions not seen since ``before`` whose rows are not pruned yet."""
        return self.db.execute("SELECT id, last_seen FROM sessions WHERE last_seen < ? AND pruned < last_seen "
                               "ORDER BY last_seen", (before,)).fetchall()

    def _chains_of(self, ids: list[str], pointing_too: bool) -> tuple[dict[str, tuple[str, str]], list]:
        q = ",".join("?" * len(ids))
        cands = {r[0]: (r[1], r[2]) for r in self.db.execute(
            f"SELECT id, agent_base, sent_base FROM chains WHERE session_id IN ({q})", ids)}
        return cands, self._pointing(list(cands)) if pointing_too else []

    def _pointing(self, rids: list[str]) -> list[tuple[str, str, str]]:
        """``(id, agent_base, sent_base)`` of the chain rows based on one of ``rids`` (indexed, schema 8)."""
        out: list[tuple[str, str, str]] = []
        for i in range(0, len(rids), 400):
            chunk = rids[i:i + 400]
            q = ",".join("?" * len(chunk))
            out += self.db.execute(f"SELECT id, agent_base, sent_base FROM chains WHERE agent_base IN ({q}) "
                                   f"UNION SELECT id, agent_base, sent_base FROM chains WHERE sent_base IN ({q})",
                                   chunk + chunk).fetchall()
        return out

    def prune(self, sids: list[str], before: float, *, dry_run: bool = False) -> dict[str, int] | None:
        """Remove every row of the sessions ``sids`` (a whole family) but their ``sessions`` rows,
        which stay as tombstones: their ref counters (each raised to the family's), the provider's
        learned facts, the usage totals; ``pruned`` set, the version advanced (a process holding one
        of them reloads it).  One transaction, which first checks again that none was seen since
        ``before`` (else nothing is done: None), taken with every session's lock (locks.py) tried
        without waiting: one a process is serving (its turn's request may have left before its
        write) is not pruned (None).  Chain rows another session's rows are based on stay.  Returns
        the rows removed per table (``dry_run``: would remove; nothing is written)."""
        sids = list(dict.fromkeys(sids))
        if not sids:
            return None
        taken = self._locks.try_hold(sids) if not dry_run and self._locks is not None else []
        if taken is None:
            return None  # a process is serving one of them (its turn holds the session: locks.py)
        try:
            return self._prune(sids, before, dry_run)
        finally:
            if taken:
                self._locks.let_go(taken)

    def _prune(self, sids: list[str], before: float, dry_run: bool) -> dict[str, int] | None:
        q = ",".join("?" * len(sids))
        ctx = self.snapshot() if dry_run else self._tx()
        with ctx:
            rows = self.db.execute(f"SELECT id, last_seen, pruned, next_ref, flags FROM sessions WHERE id IN ({q})",
                                   sids).fetchall()
            if any(r[1] >= before for r in rows) or not any(r[2] < r[1] for r in rows):
                return None  # seen meanwhile, or pruned already
            if not set(sids).issuperset(r[0] for r in self.db.execute(
                    f"SELECT session_id FROM lineage WHERE root IN (SELECT root FROM lineage WHERE session_id IN ({q}))",
                    sids)):
                return None  # the family grew meanwhile (a fork of it): a family is pruned whole or not at all
            counts = {"sessions": sum(1 for r in rows if r[2] < r[1])}
            cands, pointing = self._chains_of(sids, True)
            dead = dead_chains(cands, pointing)
            for t in HANGING:
                n = self.db.execute(f"SELECT COUNT(*) FROM {t} WHERE session_id IN ({q})", sids).fetchone()[0]
                if n:
                    counts[t] = n
                    if not dry_run:
                        self.db.execute(f"DELETE FROM {t} WHERE session_id IN ({q})", sids)
            # the lineage records of the epochs their compactions ended, under keys of their own
            keys = [k for r in rows for k in archived_records(r[0], r[4])]
            for i in range(0, len(keys), 400):
                chunk = keys[i:i + 400]
                kq = ",".join("?" * len(chunk))
                n = self.db.execute(f"SELECT COUNT(*) FROM lineage_parts WHERE session_id IN ({kq})", chunk).fetchone()[0]
                if n:
                    counts["lineage_parts"] = counts.get("lineage_parts", 0) + n
                    if not dry_run:
                        self.db.execute(f"DELETE FROM lineage_parts WHERE session_id IN ({kq})", chunk)
            if dead:
                counts["chains"] = len(dead)
                if not dry_run:
                    self._delete_chains(dead)
            if not dry_run:
                top = max(r[3] for r in rows)  # a family shares one counter: each keeps the family's
                now = time.time()
                self.db.executemany("UPDATE sessions SET pruned=?, next_ref=?, flags=?, version=version+1 WHERE id=?",
                                    [(max(now, r[1]), max(top, r[3]), tombstone_flags(r[4]), r[0]) for r in rows])
        return counts

    def _delete_chains(self, rids: list[str]) -> None:
        for i in range(0, len(rids), 400):
            chunk = rids[i:i + 400]
            self.db.execute(f"DELETE FROM chains WHERE id IN ({','.join('?' * len(chunk))})", chunk)

    def trim(self, limit: int, stored_before: float, unstored_before: float,
             after: str = "") -> tuple[dict[str, int], list[str], str]:
        """Rows that nothing can read any more, at most ``limit`` of each kind: the usage rows of
        answered turns but each session's newest (only that one is read), and chain rows made
        before ``stored_before`` (``unstored_before`` for ``store: false`` ones) that no remaining
        row is based on.  Chain rows are looked at in id order from ``after`` on; returns what was
        removed (rows per table, the chain ids) and where the next pass goes on ('' from the start)."""
        out: dict[str, int] = {}
        dead: list[str] = []
        with self._tx():
            n = self.db.execute(
                "DELETE FROM turns WHERE (session_id, n) IN (SELECT t.session_id, t.n FROM turns t "
                "WHERE t.n < (SELECT MAX(m.n) FROM turns m WHERE m.session_id=t.session_id) LIMIT ?)",
                (limit,)).rowcount
            if n:
                out["turns"] = n
            page = self.db.execute(
                "SELECT id, agent_base, sent_base, stored, created FROM chains WHERE id > ? ORDER BY id LIMIT ?",
                (after, limit)).fetchall()
            cands = {r[0]: (r[1], r[2]) for r in page if r[4] < (stored_before if r[3] else unstored_before)}
            dead = dead_chains(cands, self._pointing(list(cands))) if cands else []
            if dead:
                self._delete_chains(dead)
                out["chains"] = len(dead)
        return out, dead, page[-1][0] if len(page) == limit else ""

    def reclaim(self, pages: int = 0) -> int:
        """Give freed pages back to the file system: ``pages`` of them at most, from a store made
        with incremental auto-vacuum (cheap, any time); ``0``: VACUUM the whole file (the CLI's
        prune only: it rewrites the store, and turns on incremental auto-vacuum for an older one).
        Returns the bytes the file shrank by."""
        before = self._file_size()
        try:
            if pages:
                if self.db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
                    self.db.execute(f"PRAGMA incremental_vacuum({int(pages)})").fetchall()
            else:
                self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")
                self.db.execute("VACUUM")
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as e:
            raise store_error("vacuum", self.path, e) from e
        return max(0, before - self._file_size())

    def _file_size(self) -> int:
        return sum(p.stat().st_size for p in (self.path, self.path.with_name(self.path.name + "-wal")) if p.exists())

    def size(self) -> int:
        """Bytes the store takes (the file and its WAL)."""
        return self._file_size()
