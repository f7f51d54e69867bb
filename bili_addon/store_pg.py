"""The shared store: PostgreSQL, for a team gateway (several bili instances, one database).

The same tables and the same two rules as the embedded SQLite store (:mod:`bili_addon.store`):
a ref is allocated in the transaction that records it (the session's next numbers, in order),
and every write to a session's state checks and advances the session's ``version`` (an
``UPDATE ... WHERE version = expected``: under READ COMMITTED a second instance writing the same
session waits for the first one's row lock, then finds the version moved and gets
:class:`StaleSession`, so the engine reloads the session and computes the turn again).

psycopg 3 with its connection pool (the optional extra ``bili-addon[postgres]``); imported only
when a ``postgresql://`` store is chosen.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import select
import time
from contextlib import contextmanager
from pathlib import Path

import msgspec

from bili_addon.store import (
    CALIBRATION_COLS, CHAIN_COLS, DB_NAME, HANGING, SCHEMA_VERSION, CalibrationRow, LedgerRow, SessionBusy, SessionRow,
    FRESH_GIVEN, StaleSession, StoreError, USAGE, UsageTotals, WireTurn, WIRE_COLS, WIRE_LAST, WIRE_SUMS, WIRE_GROUP,
    _json, _wire_rows, contiguous, dead_chains, newer_schema,
    _not_pruned, archived_records, fresh_first, ledger_rows, rebase, retired_taken, tombstone_flags, usage_totals,
    wire_turn,
)

_WIRE_ROWS = _wire_rows("%s")  # (the wire sums' rows: store.WIRE_SUMS)

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import generators as pg_generators
    from psycopg.pq import ConnStatus, ExecStatus
    from psycopg_pool import ConnectionPool, PoolTimeout
except ImportError as e:  # pragma: no cover - the extra is not installed
    psycopg = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

try:  # CPython's own SHA-256 (HACL*): the same digest as OpenSSL's, without OpenSSL's dispatch
    from _sha2 import sha256 as _sha256
except ImportError:  # pragma: no cover - another Python
    _sha256 = hashlib.sha256
_SESSION_KEY = _sha256(b"bili-session:")  # copied per key: the prefix is hashed once

POOL_MAX = 4
CONNECT_TIMEOUT = 5.0  # seconds to get a connection before the store counts as unreachable
LOCK_WAIT = 2.0  # seconds a turn waits for its session's lock held by another instance, then passes through
_LOCK_KEY = 0x6B696C69  # the advisory lock that serialises schema creation and migrations

# one versioned schema: each version's statements, applied in order by whichever instance comes
# first (under an advisory lock); ``meta.schema_version`` says how far a database is.  The column
# types are SQLite's, spelled for PostgreSQL (REAL -> double precision, BLOB -> bytea).
_MIGRATIONS: dict[int, list[str]] = {
    2: [
        "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE IF NOT EXISTS sessions(
            id TEXT PRIMARY KEY,
            agent TEXT NOT NULL DEFAULT '',
            lane TEXT NOT NULL DEFAULT '',
            created DOUBLE PRECISION NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL,
            requests BIGINT NOT NULL DEFAULT 0,
            messages BIGINT NOT NULL DEFAULT 0,
            next_ref BIGINT NOT NULL DEFAULT 1,
            flags TEXT NOT NULL DEFAULT '{}',
            input_tokens BIGINT NOT NULL DEFAULT 0,
            cache_read BIGINT NOT NULL DEFAULT 0,
            cache_write BIGINT NOT NULL DEFAULT 0,
            output_tokens BIGINT NOT NULL DEFAULT 0,
            turns BIGINT NOT NULL DEFAULT 0,
            version BIGINT NOT NULL DEFAULT 0)""",
        """CREATE TABLE IF NOT EXISTS ledger(
            session_id TEXT NOT NULL,
            msg_id TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            ref TEXT NOT NULL,
            role TEXT NOT NULL,
            ctype TEXT NOT NULL,
            tokens BIGINT NOT NULL,
            first_seen DOUBLE PRECISION NOT NULL,
            PRIMARY KEY(session_id, msg_id, content_hash))""",
        """CREATE TABLE IF NOT EXISTS refs(
            session_id TEXT NOT NULL,
            ref TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            PRIMARY KEY(session_id, ref))""",
        """CREATE TABLE IF NOT EXISTS affinity(
            session_id TEXT PRIMARY KEY,
            depth BIGINT NOT NULL,
            tail TEXT NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS affinity_tail ON affinity(tail)",
        """CREATE TABLE IF NOT EXISTS turns(
            session_id TEXT NOT NULL,
            n BIGINT NOT NULL,
            ts DOUBLE PRECISION NOT NULL,
            lane TEXT NOT NULL,
            input_tokens BIGINT NOT NULL,
            cache_read BIGINT NOT NULL,
            cache_write BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            PRIMARY KEY(session_id, n))""",
        """CREATE TABLE IF NOT EXISTS blocks(
            session_id TEXT NOT NULL,
            block_id TEXT NOT NULL,
            body TEXT NOT NULL,
            active BIGINT NOT NULL,
            PRIMARY KEY(session_id, block_id))""",
        """CREATE TABLE IF NOT EXISTS originals(
            session_id TEXT NOT NULL,
            ref TEXT NOT NULL,
            role TEXT NOT NULL,
            ctype TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            tool_call_id TEXT NOT NULL,
            text TEXT NOT NULL,
            tokens BIGINT NOT NULL,
            PRIMARY KEY(session_id, ref))""",
        """CREATE TABLE IF NOT EXISTS transcript(
            session_id TEXT NOT NULL,
            seq BIGINT NOT NULL,
            sig TEXT NOT NULL,
            refs TEXT NOT NULL,
            item BYTEA NOT NULL,
            PRIMARY KEY(session_id, seq))""",
        """CREATE TABLE IF NOT EXISTS copies(
            session_id TEXT PRIMARY KEY,
            doc TEXT NOT NULL)""",
        # lineage (#15/#20): forks inherit their parent's view; id-less sessions match any earlier point
        """CREATE TABLE IF NOT EXISTS lineage(
            session_id TEXT PRIMARY KEY,
            parent TEXT NOT NULL DEFAULT '',
            root TEXT NOT NULL,
            fork_at BIGINT NOT NULL DEFAULT 0,
            created DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS lineage_root ON lineage(root)",
        """CREATE TABLE IF NOT EXISTS lineage_parts(
            session_id TEXT NOT NULL,
            seq BIGINT NOT NULL,
            ref TEXT NOT NULL,
            chash TEXT NOT NULL,
            fp TEXT NOT NULL,
            PRIMARY KEY(session_id, seq))""",
        "CREATE INDEX IF NOT EXISTS lineage_parts_head ON lineage_parts(fp) WHERE seq=0",
        """CREATE TABLE IF NOT EXISTS affinity_points(
            hash TEXT NOT NULL,
            session_id TEXT NOT NULL,
            depth BIGINT NOT NULL,
            PRIMARY KEY(hash, session_id))""",
        """CREATE TABLE IF NOT EXISTS calls(
            session_id TEXT NOT NULL,
            call_key TEXT NOT NULL,
            name TEXT NOT NULL,
            args TEXT NOT NULL,
            result TEXT,
            created DOUBLE PRECISION NOT NULL,
            executed DOUBLE PRECISION,
            PRIMARY KEY(session_id, call_key))""",
    ],
    # the per-answered-turn figures (meter, bili stats, the page)
    3: [
        """CREATE TABLE IF NOT EXISTS wire(
            session_id TEXT NOT NULL,
            n BIGINT NOT NULL,
            ts DOUBLE PRECISION NOT NULL,
            request BIGINT NOT NULL,
            model TEXT NOT NULL,
            agent_tokens BIGINT NOT NULL,
            sent_tokens BIGINT NOT NULL,
            predicted DOUBLE PRECISION,
            blocks BIGINT NOT NULL,
            folded BIGINT NOT NULL,
            executed TEXT NOT NULL,
            input_tokens BIGINT NOT NULL,
            cache_read BIGINT NOT NULL,
            cache_write BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            PRIMARY KEY(session_id, n))""",
    ],
    # the cache model's prediction vs the provider's report, per answered request (kernel/calibration.py)
    4: [
        """CREATE TABLE IF NOT EXISTS calibration(
            session_id TEXT NOT NULL,
            n BIGINT NOT NULL,
            ts DOUBLE PRECISION NOT NULL,
            host TEXT NOT NULL,
            family TEXT NOT NULL,
            lane TEXT NOT NULL,
            gap DOUBLE PRECISION,
            age DOUBLE PRECISION,
            predicted_input BIGINT NOT NULL,
            predicted_read BIGINT NOT NULL,
            predicted_write BIGINT NOT NULL,
            reported_input BIGINT,
            reported_read BIGINT NOT NULL,
            reported_write BIGINT,
            PRIMARY KEY(session_id, n))""",
        "CREATE INDEX IF NOT EXISTS calibration_host ON calibration(host, family, ts)",
    ],
    # server-side chains (#13, kernel/chains.py)
    5: [
        """CREATE TABLE IF NOT EXISTS chains(
            id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL,
            conn TEXT NOT NULL,
            stored BIGINT NOT NULL,
            agent_base TEXT NOT NULL,
            agent_keep BIGINT NOT NULL,
            agent BYTEA NOT NULL,
            sent_base TEXT NOT NULL,
            sent_keep BIGINT NOT NULL,
            sent BYTEA,
            output BYTEA NOT NULL,
            owner TEXT NOT NULL DEFAULT '',
            created DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS chains_session ON chains(session_id)",
        # (a store made before the chains' owner has the table without it: see _HOLDS)
        "ALTER TABLE chains ADD COLUMN IF NOT EXISTS owner TEXT NOT NULL DEFAULT ''",
    ],
}
_STALE = "BL001"  # bili_commit_turn's refusal: the session changed meanwhile (StaleSession)
# 6: a turn's commit in one statement (one round trip): PL/pgSQL doing what Store.commit_turn does
_MIGRATIONS[6] = [
    """CREATE OR REPLACE FUNCTION bili_commit_turn(
        p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_created DOUBLE PRECISION, p_now DOUBLE PRECISION,
        p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
        p_minted JSON, p_rows JSON, p_depth BIGINT, p_tail TEXT) RETURNS BIGINT LANGUAGE plpgsql AS $$
    DECLARE
        v BIGINT;
        first BIGINT;
        fam BIGINT;
        n BIGINT;
        k BIGINT := json_array_length(p_minted);
    BEGIN
        -- the session's version must still be the one the turn was computed from (its row lock
        -- makes a second instance wait here, then find the version moved)
        UPDATE sessions SET version = version + 1 WHERE id = p_id AND version = p_expect RETURNING version INTO v;
        IF v IS NULL AND p_expect = 0 THEN
            INSERT INTO sessions(id, created, last_seen, version) VALUES(p_id, p_now, p_now, 1)
                ON CONFLICT(id) DO NOTHING RETURNING version INTO v;
        END IF;
        IF v IS NULL THEN
            SELECT version INTO v FROM sessions WHERE id = p_id;
            RAISE EXCEPTION 'session % was changed by another instance', p_id
                USING ERRCODE = 'BL001', DETAIL = COALESCE(v, 0)::TEXT;
        END IF;
        -- refs: the session's next free numbers (a family shares one counter), each given once
        IF k > 0 THEN
            SELECT (SELECT next_ref FROM sessions WHERE id = p_id),
                   (SELECT MAX(s.next_ref) FROM lineage m JOIN sessions s ON s.id = m.session_id
                     WHERE m.root = (SELECT root FROM lineage WHERE session_id = p_id))
              INTO first, fam;
            first := GREATEST(COALESCE(first, 1), COALESCE(fam, 0));
            IF first + k <> p_next_ref THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
            INSERT INTO refs(session_id, ref, content_hash)
                SELECT p_id, e->>0, e->>1 FROM json_array_elements(p_minted) AS e ON CONFLICT DO NOTHING;
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n <> k THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
        END IF;
        INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version)
            VALUES(p_id, p_agent, p_lane, p_created, p_now, p_requests, p_messages, p_next_ref, p_flags, v)
            ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen,
                requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref,
                flags=excluded.flags, version=excluded.version;
        INSERT INTO ledger(session_id, msg_id, content_hash, ref, role, ctype, tokens, first_seen)
            SELECT p_id, x.msg_id, x.content_hash, x.ref, x.role, x.ctype, x.tokens, p_now
            FROM json_to_recordset(p_rows) AS x(msg_id TEXT, content_hash TEXT, ref TEXT, role TEXT, ctype TEXT,
                                                 tokens BIGINT);
        IF p_tail IS NOT NULL THEN
            INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(p_id, p_depth, p_tail, p_now)
                ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail,
                    last_seen=excluded.last_seen;
        END IF;
        RETURN v;
    END
    $$""",
    # the session's lock, then (a fresh snapshot per statement: VOLATILE) its version, family and
    # last usage, in one statement; the lock is the session's (it outlives the statement)
    """CREATE OR REPLACE FUNCTION bili_hold(p_key BIGINT, p_id TEXT)
        RETURNS TABLE(o_version BIGINT, o_family TEXT[], o_last BIGINT[]) LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        PERFORM pg_advisory_lock(p_key);
        RETURN QUERY SELECT
            (SELECT s.version FROM sessions s WHERE s.id = p_id),
            (SELECT ARRAY[l.root, l.parent, l.fork_at::TEXT, (SELECT MAX(s.next_ref) FROM sessions s JOIN lineage m
                ON m.session_id = s.id WHERE m.root = l.root)::TEXT] FROM lineage l WHERE l.session_id = p_id),
            (SELECT ARRAY[t.input_tokens, t.cache_read, t.cache_write, t.output_tokens] FROM turns t
                WHERE t.session_id = p_id ORDER BY t.n DESC LIMIT 1);
    END
    $$""",
]
# 7 (#11): the ledger and the refs as one row per session write (as in SQLite: store._SCHEMA), the
# rows of a schema-6 store moved into them (every row keeps its first_seen), the tables of one row
# per part replaced by views of the same names; the turn's commit writes one row of each
_MIGRATIONS[7] = [
    """CREATE TABLE IF NOT EXISTS ledger_turns(
        session_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        first_seen DOUBLE PRECISION NOT NULL,
        n BIGINT NOT NULL,
        rows TEXT NOT NULL,
        PRIMARY KEY(session_id, seq))""",
    """CREATE TABLE IF NOT EXISTS refs_turns(
        session_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        n BIGINT NOT NULL,
        given TEXT NOT NULL,
        PRIMARY KEY(session_id, seq))""",
    """DO $$ BEGIN
        IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('ledger')) = 'r' THEN
            INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows)
                SELECT session_id, ROW_NUMBER() OVER (PARTITION BY session_id ORDER BY first_seen)
                    - COUNT(*) OVER (PARTITION BY session_id), first_seen, COUNT(*),
                    json_agg(json_build_array(msg_id, content_hash, ref, role, ctype, tokens)
                             ORDER BY msg_id COLLATE "C", content_hash COLLATE "C")::TEXT
                FROM ledger GROUP BY session_id, first_seen;
            DROP TABLE ledger;
        END IF;
        IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('refs')) = 'r' THEN
            INSERT INTO refs_turns(session_id, seq, n, given)
                SELECT session_id, 0, COUNT(*), json_agg(json_build_array(ref, content_hash) ORDER BY ref)::TEXT
                FROM refs GROUP BY session_id;
            DROP TABLE refs;
        END IF;
    END $$""",
    """CREATE OR REPLACE VIEW ledger AS SELECT t.session_id, e->>0 AS msg_id, e->>1 AS content_hash, e->>2 AS ref,
        e->>3 AS role, e->>4 AS ctype, (e->>5)::BIGINT AS tokens, t.first_seen
        FROM ledger_turns t, json_array_elements(t.rows::json) AS e""",
    """CREATE OR REPLACE VIEW refs AS SELECT t.session_id, e->>0 AS ref, e->>1 AS content_hash
        FROM refs_turns t, json_array_elements(t.given::json) AS e""",
    """CREATE OR REPLACE FUNCTION bili_commit_turn(
        p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_created DOUBLE PRECISION, p_now DOUBLE PRECISION,
        p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
        p_minted JSON, p_rows JSON, p_depth BIGINT, p_tail TEXT) RETURNS BIGINT LANGUAGE plpgsql AS $$
    DECLARE
        v BIGINT;
        first BIGINT;
        fam BIGINT;
        k BIGINT := json_array_length(p_minted);
        n BIGINT := json_array_length(p_rows);
    BEGIN
        -- the session's version must still be the one the turn was computed from (its row lock
        -- makes a second instance wait here, then find the version moved)
        UPDATE sessions SET version = version + 1 WHERE id = p_id AND version = p_expect RETURNING version INTO v;
        IF v IS NULL AND p_expect = 0 THEN
            INSERT INTO sessions(id, created, last_seen, version) VALUES(p_id, p_now, p_now, 1)
                ON CONFLICT(id) DO NOTHING RETURNING version INTO v;
        END IF;
        IF v IS NULL THEN
            SELECT version INTO v FROM sessions WHERE id = p_id;
            RAISE EXCEPTION 'session % was changed by another instance', p_id
                USING ERRCODE = 'BL001', DETAIL = COALESCE(v, 0)::TEXT;
        END IF;
        -- refs: the session's next free numbers (a family shares one counter), in order (the client
        -- checked they are consecutive), so none is given twice: the counter only grows
        IF k > 0 THEN
            SELECT (SELECT next_ref FROM sessions WHERE id = p_id),
                   (SELECT MAX(s.next_ref) FROM lineage m JOIN sessions s ON s.id = m.session_id
                     WHERE m.root = (SELECT root FROM lineage WHERE session_id = p_id))
              INTO first, fam;
            first := GREATEST(COALESCE(first, 1), COALESCE(fam, 0));
            IF first + k <> p_next_ref OR p_minted->0->>0 <> 'm' || lpad(first::TEXT, 5, '0') THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
            INSERT INTO refs_turns(session_id, seq, n, given) VALUES(p_id, v, k, p_minted::TEXT);
        END IF;
        INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version)
            VALUES(p_id, p_agent, p_lane, p_created, p_now, p_requests, p_messages, p_next_ref, p_flags, v)
            ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen,
                requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref,
                flags=excluded.flags, version=excluded.version;
        IF n > 0 THEN
            INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(p_id, v, p_now, n, p_rows::TEXT);
        END IF;
        IF p_tail IS NOT NULL THEN
            INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(p_id, p_depth, p_tail, p_now)
                ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail,
                    last_seen=excluded.last_seen;
        END IF;
        RETURN v;
    END
    $$""",
]
# 8: retention (bili_addon/retention.py): when a session's rows were pruned (its row stays, a tombstone
# keeping its ref counter; listed again once seen after that), and indexes of the chains' bases
_MIGRATIONS[8] = [
    "ALTER TABLE sessions ADD COLUMN IF NOT EXISTS pruned DOUBLE PRECISION NOT NULL DEFAULT 0",
    "CREATE INDEX IF NOT EXISTS chains_agent_base ON chains(agent_base)",
    "CREATE INDEX IF NOT EXISTS chains_sent_base ON chains(sent_base)",
]
# 9: the 1-hour part of each answered turn's cache writes and who said it (as in SQLite: store._SCHEMA's
# wire, Store._wire_split); older rows keep 0 and '' (priced at the 5-minute rate, as they were)
_MIGRATIONS[9] = [
    "ALTER TABLE wire ADD COLUMN IF NOT EXISTS cache_write_1h BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE wire ADD COLUMN IF NOT EXISTS write_split TEXT NOT NULL DEFAULT ''",
]
# 10 (#11): a conversation's first turn writes its refs once: its refs_turns row names the refs of its
# ledger_turns row (store.FRESH_GIVEN) instead of repeating them; the turn's commit takes its documents as
# text with their counts (nothing for the server to parse: they are msgspec's JSON, kept as they are); the
# session's lock reads a new session's fork candidates in the same statement (no pipeline)
_MIGRATIONS[10] = [
    """CREATE OR REPLACE VIEW refs AS SELECT t.session_id, e->>0 AS ref, e->>1 AS content_hash
        FROM refs_turns t, json_array_elements(CASE WHEN t.given LIKE '[%' THEN t.given ELSE '[]' END::json) AS e
        UNION ALL SELECT t.session_id, e->>2, e->>1 FROM refs_turns t JOIN ledger_turns l
            ON l.session_id = t.session_id AND l.seq = t.seq,
            json_array_elements(CASE WHEN t.given LIKE '[%' THEN '[]' ELSE l.rows END::json) AS e""",
    "DROP FUNCTION IF EXISTS bili_commit_turn(TEXT, BIGINT, TEXT, TEXT, DOUBLE PRECISION, DOUBLE PRECISION, BIGINT, "
    "BIGINT, BIGINT, TEXT, JSON, JSON, BIGINT, TEXT)",
    """CREATE OR REPLACE FUNCTION bili_commit_turn(
        p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_now DOUBLE PRECISION,
        p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
        p_given TEXT, p_k BIGINT, p_first TEXT, p_rows TEXT, p_n BIGINT, p_depth BIGINT, p_tail TEXT)
        RETURNS BIGINT LANGUAGE plpgsql AS $$
    DECLARE
        v BIGINT;
        first BIGINT;
        fam BIGINT;
    BEGIN
        -- the session's version must still be the one the turn was computed from (its row lock
        -- makes a second instance wait here, then find the version moved)
        UPDATE sessions SET version = version + 1 WHERE id = p_id AND version = p_expect RETURNING version INTO v;
        IF v IS NULL AND p_expect = 0 THEN
            INSERT INTO sessions(id, created, last_seen, version) VALUES(p_id, p_now, p_now, 1)
                ON CONFLICT(id) DO NOTHING RETURNING version INTO v;
        END IF;
        IF v IS NULL THEN
            SELECT version INTO v FROM sessions WHERE id = p_id;
            RAISE EXCEPTION 'session % was changed by another instance', p_id
                USING ERRCODE = 'BL001', DETAIL = COALESCE(v, 0)::TEXT;
        END IF;
        -- refs: the session's next free numbers (a family shares one counter), in order (the client
        -- checked they are consecutive and that p_first is the first of them), so none is given twice
        IF p_k > 0 THEN
            SELECT (SELECT next_ref FROM sessions WHERE id = p_id),
                   (SELECT MAX(s.next_ref) FROM lineage m JOIN sessions s ON s.id = m.session_id
                     WHERE m.root = (SELECT root FROM lineage WHERE session_id = p_id))
              INTO first, fam;
            first := GREATEST(COALESCE(first, 1), COALESCE(fam, 0));
            IF first + p_k <> p_next_ref OR p_first IS DISTINCT FROM 'm' || lpad(first::TEXT, 5, '0') THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
            INSERT INTO refs_turns(session_id, seq, n, given) VALUES(p_id, v, p_k, p_given);
        END IF;
        INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version)
            VALUES(p_id, p_agent, p_lane, p_now, p_now, p_requests, p_messages, p_next_ref, p_flags, v)
            ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen,
                requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref,
                flags=excluded.flags, version=excluded.version;
        IF p_n > 0 THEN
            INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(p_id, v, p_now, p_n, p_rows);
        END IF;
        IF p_tail IS NOT NULL THEN
            INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(p_id, p_depth, p_tail, p_now)
                ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail,
                    last_seen=excluded.last_seen;
        END IF;
        RETURN v;
    END
    $$""",
    "DROP FUNCTION IF EXISTS bili_hold(BIGINT, TEXT)",
    # the session's lock, then (a fresh snapshot per statement: VOLATILE) its version, family, last usage
    # and, for a session this instance does not know (``p_fp``: its first part's fingerprint), its fork
    # candidates (the sessions of its lane whose recorded history opens with that part)
    """CREATE OR REPLACE FUNCTION bili_hold(p_key BIGINT, p_id TEXT, p_fp TEXT, p_lane TEXT)
        RETURNS TABLE(o_version BIGINT, o_family TEXT[], o_last BIGINT[], o_cands TEXT[])
        LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        PERFORM pg_advisory_lock(p_key);
        RETURN QUERY SELECT
            (SELECT s.version FROM sessions s WHERE s.id = p_id),
            (SELECT ARRAY[l.root, l.parent, l.fork_at::TEXT, (SELECT MAX(s.next_ref) FROM sessions s JOIN lineage m
                ON m.session_id = s.id WHERE m.root = l.root)::TEXT] FROM lineage l WHERE l.session_id = p_id),
            (SELECT ARRAY[t.input_tokens, t.cache_read, t.cache_write, t.output_tokens] FROM turns t
                WHERE t.session_id = p_id ORDER BY t.n DESC LIMIT 1),
            CASE WHEN p_fp IS NULL THEN NULL::TEXT[] ELSE ARRAY(SELECT p.session_id FROM lineage_parts p
                JOIN sessions s ON s.id = p.session_id WHERE p.seq = 0 AND p.fp = p_fp AND s.lane = p_lane
                ORDER BY s.created) END;
    END
    $$""",
]
# 11 (#11): the turn's commit writes the session's canonical copy too (``p_copy``, NULL: unchanged), so a
# folded session's follow-up turn is one write (its copy a statement of its own before)
_MIGRATIONS[11] = [
    "DROP FUNCTION IF EXISTS bili_commit_turn(TEXT, BIGINT, TEXT, TEXT, DOUBLE PRECISION, BIGINT, BIGINT, BIGINT, "
    "TEXT, TEXT, BIGINT, TEXT, TEXT, BIGINT, BIGINT, TEXT)",
    """CREATE OR REPLACE FUNCTION bili_commit_turn(
        p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_now DOUBLE PRECISION,
        p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
        p_given TEXT, p_k BIGINT, p_first TEXT, p_rows TEXT, p_n BIGINT, p_depth BIGINT, p_tail TEXT,
        p_copy TEXT)
        RETURNS BIGINT LANGUAGE plpgsql AS $$
    DECLARE
        v BIGINT;
        first BIGINT;
        fam BIGINT;
    BEGIN
        -- the session's version must still be the one the turn was computed from (its row lock
        -- makes a second instance wait here, then find the version moved)
        UPDATE sessions SET version = version + 1 WHERE id = p_id AND version = p_expect RETURNING version INTO v;
        IF v IS NULL AND p_expect = 0 THEN
            INSERT INTO sessions(id, created, last_seen, version) VALUES(p_id, p_now, p_now, 1)
                ON CONFLICT(id) DO NOTHING RETURNING version INTO v;
        END IF;
        IF v IS NULL THEN
            SELECT version INTO v FROM sessions WHERE id = p_id;
            RAISE EXCEPTION 'session % was changed by another instance', p_id
                USING ERRCODE = 'BL001', DETAIL = COALESCE(v, 0)::TEXT;
        END IF;
        -- refs: the session's next free numbers (a family shares one counter), in order (the client
        -- checked they are consecutive and that p_first is the first of them), so none is given twice
        IF p_k > 0 THEN
            SELECT (SELECT next_ref FROM sessions WHERE id = p_id),
                   (SELECT MAX(s.next_ref) FROM lineage m JOIN sessions s ON s.id = m.session_id
                     WHERE m.root = (SELECT root FROM lineage WHERE session_id = p_id))
              INTO first, fam;
            first := GREATEST(COALESCE(first, 1), COALESCE(fam, 0));
            IF first + p_k <> p_next_ref OR p_first IS DISTINCT FROM 'm' || lpad(first::TEXT, 5, '0') THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
            INSERT INTO refs_turns(session_id, seq, n, given) VALUES(p_id, v, p_k, p_given);
        END IF;
        INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version)
            VALUES(p_id, p_agent, p_lane, p_now, p_now, p_requests, p_messages, p_next_ref, p_flags, v)
            ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen,
                requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref,
                flags=excluded.flags, version=excluded.version;
        IF p_n > 0 THEN
            INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(p_id, v, p_now, p_n, p_rows);
        END IF;
        IF p_tail IS NOT NULL THEN
            INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(p_id, p_depth, p_tail, p_now)
                ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail,
                    last_seen=excluded.last_seen;
        END IF;
        IF p_copy IS NOT NULL THEN
            INSERT INTO copies(session_id, doc) VALUES(p_id, p_copy)
                ON CONFLICT(session_id) DO UPDATE SET doc=excluded.doc;
        END IF;
        RETURN v;
    END
    $$""",
]
# 12: a family's commits serialised (a transaction lock on the family's root, taken before its ref counter
# is read): two sessions of one family committing at once gave the same refs (nothing in SQLite, whose one
# writer reads the family's counter inside its write)
_MIGRATIONS[12] = [
    """CREATE OR REPLACE FUNCTION bili_commit_turn(
        p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_now DOUBLE PRECISION,
        p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
        p_given TEXT, p_k BIGINT, p_first TEXT, p_rows TEXT, p_n BIGINT, p_depth BIGINT, p_tail TEXT,
        p_copy TEXT)
        RETURNS BIGINT LANGUAGE plpgsql AS $$
    DECLARE
        v BIGINT;
        first BIGINT;
        fam BIGINT;
        r TEXT;
    BEGIN
        -- the session's version must still be the one the turn was computed from (its row lock
        -- makes a second instance wait here, then find the version moved)
        UPDATE sessions SET version = version + 1 WHERE id = p_id AND version = p_expect RETURNING version INTO v;
        IF v IS NULL AND p_expect = 0 THEN
            INSERT INTO sessions(id, created, last_seen, version) VALUES(p_id, p_now, p_now, 1)
                ON CONFLICT(id) DO NOTHING RETURNING version INTO v;
        END IF;
        IF v IS NULL THEN
            SELECT version INTO v FROM sessions WHERE id = p_id;
            RAISE EXCEPTION 'session % was changed by another instance', p_id
                USING ERRCODE = 'BL001', DETAIL = COALESCE(v, 0)::TEXT;
        END IF;
        -- refs: the session's next free numbers (a family shares one counter), in order (the client
        -- checked they are consecutive and that p_first is the first of them), so none is given twice
        IF p_k > 0 THEN
            -- a family's sessions give refs from one counter: their commits take the family's lock
            -- first (until this transaction ends), so the counter read below has every earlier
            -- commit of the family in it; without it, a parent and its fork committing at once on
            -- two instances each read the other's counter as it was, and gave the same refs
            SELECT root INTO r FROM lineage WHERE session_id = p_id;
            IF r IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(('x' || left(encode(sha256(convert_to('bili-family:' || r, 'UTF8')), 'hex'), 16))::bit(64)::bigint);
            END IF;
            SELECT (SELECT next_ref FROM sessions WHERE id = p_id),
                   (SELECT MAX(s.next_ref) FROM lineage m JOIN sessions s ON s.id = m.session_id
                     WHERE m.root = r)
              INTO first, fam;
            first := GREATEST(COALESCE(first, 1), COALESCE(fam, 0));
            IF first + p_k <> p_next_ref OR p_first IS DISTINCT FROM 'm' || lpad(first::TEXT, 5, '0') THEN
                RAISE EXCEPTION 'refs of session % were given by another instance', p_id
                    USING ERRCODE = 'BL001', DETAIL = first::TEXT;
            END IF;
            INSERT INTO refs_turns(session_id, seq, n, given) VALUES(p_id, v, p_k, p_given);
        END IF;
        INSERT INTO sessions(id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version)
            VALUES(p_id, p_agent, p_lane, p_now, p_now, p_requests, p_messages, p_next_ref, p_flags, v)
            ON CONFLICT(id) DO UPDATE SET agent=excluded.agent, lane=excluded.lane, last_seen=excluded.last_seen,
                requests=excluded.requests, messages=excluded.messages, next_ref=excluded.next_ref,
                flags=excluded.flags, version=excluded.version;
        IF p_n > 0 THEN
            INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(p_id, v, p_now, p_n, p_rows);
        END IF;
        IF p_tail IS NOT NULL THEN
            INSERT INTO affinity(session_id, depth, tail, last_seen) VALUES(p_id, p_depth, p_tail, p_now)
                ON CONFLICT(session_id) DO UPDATE SET depth=excluded.depth, tail=excluded.tail,
                    last_seen=excluded.last_seen;
        END IF;
        IF p_copy IS NOT NULL THEN
            INSERT INTO copies(session_id, doc) VALUES(p_id, p_copy)
                ON CONFLICT(session_id) DO UPDATE SET doc=excluded.doc;
        END IF;
        RETURN v;
    END
    $$""",
]
# 13: an answered turn says whether it was a side request (as in SQLite: store._SCHEMA's wire); older rows 0
_MIGRATIONS[13] = ["ALTER TABLE wire ADD COLUMN IF NOT EXISTS side INTEGER NOT NULL DEFAULT 0"]
assert max(_MIGRATIONS) == SCHEMA_VERSION, "a SQLite schema change needs its PostgreSQL migration"



def _column(table: str, column: str) -> str:
    return (f"EXISTS(SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('{table}') AND attname = '{column}' "
            "AND NOT attisdropped)")


def _kind(name: str, kind: str) -> str:
    return f"(SELECT relkind FROM pg_class WHERE oid = to_regclass('{name}')) = '{kind}'"


def _function(name: str, args: int, body: str = "") -> str:
    return (f"EXISTS(SELECT 1 FROM pg_proc WHERE proname = '{name}' AND pronargs = {args} "
            f"AND pg_function_is_visible(oid){f' AND prosrc LIKE {body!r}' if body else ''})")


# what a step made, each asked of the catalogue (one statement at every open): a store that lacks it
# takes that step again, and every later one, whatever its stamp says (each step's statements are
# idempotent, and a later step replaces what an earlier one made: the functions).  A development
# branch stamped its own steps with the same numbers (``ttl``, c59c025: 8 was the wire's 1-hour
# writes, without retention's ``sessions.pruned``), and the chains' ``owner`` came without a step of
# its own (a store made before it has the table without the column): such a store heals when opened.
_HOLDS: dict[int, str] = {
    2: " AND ".join(f"to_regclass('{t}') IS NOT NULL" for t in (
        "meta", "sessions", "affinity", "turns", "blocks", "originals", "transcript", "copies", "lineage",
        "lineage_parts", "affinity_points", "calls")),
    3: "to_regclass('wire') IS NOT NULL",
    4: "to_regclass('calibration') IS NOT NULL",
    5: _column("chains", "owner"),
    7: f"to_regclass('ledger_turns') IS NOT NULL AND to_regclass('refs_turns') IS NOT NULL AND {_kind('ledger', 'v')} "
       f"AND {_kind('refs', 'v')}",
    8: f"{_column('sessions', 'pruned')} AND to_regclass('chains_agent_base') IS NOT NULL "
       "AND to_regclass('chains_sent_base') IS NOT NULL",
    9: f"{_column('wire', 'cache_write_1h')} AND {_column('wire', 'write_split')}",
    10: f"pg_get_viewdef(to_regclass('refs')) LIKE '%ledger_turns%' AND {_function('bili_hold', 4)}",
    11: _function("bili_commit_turn", 17),
    12: _function("bili_commit_turn", 17, "%bili-family:%"),
    13: _column("wire", "side"),
}
_HOLDS_SQL = "SELECT " + ", ".join(f"COALESCE({_HOLDS[v]}, false)" for v in sorted(_HOLDS))


def schema_of(url: str) -> int:
    """The database's schema version, read without opening it as a store (which migrates an older
    one: ``bili store prune --dry-run`` writes nothing); 0 when it has no bili tables."""
    with psycopg.connect(url, connect_timeout=5, autocommit=True) as c:
        if c.execute("SELECT to_regclass('meta')").fetchone()[0] is None:
            return 0
        row = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else 0


def redact(url: str) -> str:
    """The URL (or libpq's ``key=value`` string) without its password, in every form libpq takes:
    ``user:pw@``, ``:pw@`` and a ``password=`` setting (for logs, health and errors)."""
    url = re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
    return _PASSWORD_SETTING.sub(r"\1***", url)


_PASSWORD_SETTING = re.compile(r"(?i)((?:^|[?&\s])(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)")


def _classify(e: BaseException) -> tuple[str, str]:
    if psycopg is not None:
        if isinstance(e, PoolTimeout):
            return "unreachable", "no connection to the database within the timeout"
        if isinstance(e, (pg_errors.InsufficientPrivilege,)):
            return "read-only", "the database user may not write these tables"
        if isinstance(e, pg_errors.DiskFull):
            return "disk full", "the database server's disk is full"
        if isinstance(e, (pg_errors.LockNotAvailable, pg_errors.QueryCanceled)):
            return "locked", "a lock of the database was not granted in time"
        if isinstance(e, psycopg.OperationalError):
            return "unreachable", "the database cannot be reached"
    return "error", "the database failed"


_HINTS = {
    "unreachable": "check that the PostgreSQL server runs and the URL (bili_store) is right; bili retries by itself",
    "read-only": "grant the database user the rights on bili's tables (or use a database it owns)",
    "disk full": "free space on the database server; bili resumes storing by itself",
    "locked": "another instance held the lock; bili retries on the next requests",
}


def pg_error(action: str, url: str, e: BaseException) -> StoreError:
    kind, words = _classify(e)
    return StoreError(redact(f"cannot {action} the store at {redact(url)}: {words} ({e})".strip()), kind,
                      _HINTS.get(kind, ""))


def _failed(pgconn, result, enc: str):
    """A statement sent through libpq (:data:`_HOLD`, :data:`_COMMIT`, :data:`_SAVE_PARTS`) that did not
    answer as it does: raised as psycopg raises it."""
    if pgconn.status != _CONN_OK:  # the connection is lost (as psycopg's wait would raise it)
        raise psycopg.OperationalError(f"the connection is lost: {pgconn.get_error_message(enc)}")
    raise pg_errors.error_from_result(result, encoding=enc)


def _results_of(conn) -> list:
    """The results of the statement sent on ``conn`` without waiting for them: read with libpq's calls
    while they are in, the rest waited for (psycopg's wait: the GIL let go)."""
    pgconn = conn.pgconn
    pgconn.consume_input()  # what came
    results = []
    while not pgconn.is_busy():
        r = pgconn.get_result()
        if r is None:
            return results
        results.append(r)
    return results + conn.wait(pg_generators.fetch_many(pgconn))


def _text_params(params, enc: str) -> list:
    """A statement's parameters as libpq takes them (:meth:`PgStore._call`): text in ``enc`` (bytes: bili's
    own JSON, which escapes a NUL), None as NULL; a text holding a NUL refused (libpq would cut it there)."""
    if any("\0" in p for p in params if type(p) is str):
        raise ValueError(_NUL)
    return [p if p is None or isinstance(p, bytes) else str(p).encode(enc) for p in params]


def _reads(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except StoreError:
            raise
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("read", self.url, e) from e
    return wrapper


# the two statements of every turn, sent through libpq as they are (PgStore._call): the session's lock and
# what it reads (its version, family, last usage, fork candidates: as one JSON text), the turn's commit.
# The lock's key is the server's SHA-256 of the session id (the same number as PgStore.lock_key: the first
# 8 bytes of the digest of its UTF-8 bytes, big-endian, signed), not the client's (~15 us of its CPU cold)
_KEY_SQL = "('x' || left(encode(sha256(convert_to('bili-session:' || {}::text, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
# (with the candidates, the archived lineage records of the lane's sessions that open with the part,
# PgStore.lineage_archived: read in the statement, not in bili_hold, so no new schema: it reads them as
# of the statement's start, before the lock, and they are other sessions' records, not the one it locks)
_HOLD_ARCHIVED = ("CASE WHEN $2::text IS NULL THEN NULL ELSE ARRAY(SELECT ARRAY[s.id, p.session_id] "
                  "FROM lineage_parts p JOIN sessions s ON s.id=split_part(p.session_id, chr(31), 1) "
                  "WHERE p.seq=0 AND p.fp=$2 AND s.lane=$3 AND strpos(p.session_id, chr(31)) > 0 "
                  "ORDER BY s.created, p.session_id) END")
_HOLD = (b"SELECT json_build_array(o_version, o_family, o_last, o_cands, " + _HOLD_ARCHIVED.encode()
         + b")::text FROM bili_hold(" + _KEY_SQL.format("$1").encode() + b", $1, $2, $3)")
_UNLOCK_ONE = b"SELECT pg_advisory_unlock(" + _KEY_SQL.format("$1").encode() + b")"  # (false, a warning: not held)
# how long a turn that ended before it asked for its early hold (PgStore.hold_soon) waits for the hold's
# answer before it cancels it (an answer comes within ~2 ms, unless the session is held elsewhere)
SOON_GRACE = 0.02
# what bili_hold answers for a session the store has no row, lineage nor usage of (a new conversation)
_NEW_HOLD = b"[null, null, null, null, null]"
# libpq reads a text parameter up to its first NUL byte: such a text (PostgreSQL cannot store it) is
# refused before it is sent, for the turn to pass unchanged, never cut to another value
_NUL = "a text with a NUL character cannot go to PostgreSQL (libpq would cut it there)"
# the texts a session stores as they came (a folded part's original, a call's arguments and result) may hold
# a NUL character (a tool's output of a binary file), which a PostgreSQL text cannot: such a text, and one
# that begins as such a text's stored form does, is stored as its JSON after this mark (_nul_back reads it)
_NUL_MARK = "\ufffebili-json:"


def _nul_safe(v):
    if type(v) is str and ("\0" in v or v.startswith(_NUL_MARK)):
        return _NUL_MARK + msgspec.json.encode(v).decode()
    return v


def _nul_back(v):
    if type(v) is str and v.startswith(_NUL_MARK):
        return msgspec.json.decode(v[len(_NUL_MARK):])
    return v


def _original_safe(o: tuple) -> tuple:
    """An original's row ``(ref, role, ctype, tool_name, tool_call_id, text, tokens)``, its text storable."""
    return (*o[:5], _nul_safe(o[5]), *o[6:])


def _call_back(c) -> tuple:
    """A call's row ``(key, name, args, result)`` as stored, read back."""
    return (c[0], c[1], _nul_back(c[2]), _nul_back(c[3]))


# a dumped table's rows (bili store migrate) read back, and loaded storable: the columns of those texts
_NUL_COLS = {"originals": ("text",), "calls": ("args", "result")}
_NEW_HOLD_CANDS = b"[null, null, null, [], []]"
_TUPLES_OK = int(ExecStatus.TUPLES_OK) if psycopg is not None else 2
_CONN_OK = int(ConnStatus.OK) if psycopg is not None else 0
_BAD = int(ConnStatus.BAD) if psycopg is not None else 1  # a connection psycopg calls ``closed``
_UNLOCK = b"SELECT pg_advisory_unlock_all()"
# a turn's commit that is its last write, with the session's unlock (PgStore.commit_turn(release=True)): the
# commit's own transaction ends (COMMIT: another instance that gets the lock next sees the turn), then every
# session the connection holds is let go, in one statement, one round trip.  A procedure of the lock
# connection's own (pg_temp: made when it opens, gone with it; no schema change); a refused commit raises
# before its COMMIT: nothing written, the lock kept (release lets it go, as for any other turn)
_COMMIT_RELEASE_PROC = """CREATE OR REPLACE PROCEDURE pg_temp.bili_commit_release(
    p_id TEXT, p_expect BIGINT, p_agent TEXT, p_lane TEXT, p_now DOUBLE PRECISION,
    p_requests BIGINT, p_messages BIGINT, p_next_ref BIGINT, p_flags TEXT,
    p_given TEXT, p_k BIGINT, p_first TEXT, p_rows TEXT, p_n BIGINT, p_depth BIGINT, p_tail TEXT,
    p_copy TEXT, INOUT v BIGINT)
    LANGUAGE plpgsql AS $$
BEGIN
    v := bili_commit_turn(p_id, p_expect, p_agent, p_lane, p_now, p_requests, p_messages, p_next_ref, p_flags,
                          p_given, p_k, p_first, p_rows, p_n, p_depth, p_tail, p_copy);
    COMMIT;
    PERFORM pg_advisory_unlock_all();
END
$$"""
_COMMIT_RELEASE = (b"CALL pg_temp.bili_commit_release($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, "
                   b"$15, $16, $17, NULL)")
_COMMIT = b"SELECT bili_commit_turn($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)"
# a session's lineage parts from ``keep`` on replaced (PgStore.save_lineage_parts): the rows as one JSON
# text (msgspec's: ``[[ref, chash, fp], ...]``, each row numbered by its place), not three text arrays
# (psycopg's list dumper adapts them element by element in Python: ~0.6 ms of the client's CPU after a
# first turn of 100 messages); spelled for libpq ($n, the lock connection) and for psycopg (%s)
_SAVE_PARTS_DELETE = "DELETE FROM lineage_parts WHERE session_id={s} AND seq>={end}"
_SAVE_PARTS_INSERT = ("INSERT INTO lineage_parts(session_id, seq, ref, chash, fp) "
                      "SELECT {s}, {keep} + u.i - 1, u.v->>0, u.v->>1, u.v->>2 FROM json_array_elements({rows}::json) "
                      "WITH ORDINALITY AS u(v, i) "
                      "ON CONFLICT(session_id, seq) DO UPDATE SET ref=excluded.ref, chash=excluded.chash, fp=excluded.fp")
_SAVE_PARTS_SQL = f"WITH gone AS ({_SAVE_PARTS_DELETE}) {_SAVE_PARTS_INSERT}"
_SAVE_PARTS = _SAVE_PARTS_SQL.format(s="$1", end="$2", keep="$3", rows="$4").encode()
_SAVE_PARTS_PG = _SAVE_PARTS_SQL.format(s="%(s)s", end="%(end)s", keep="%(keep)s", rows="%(rows)s")
# the lock connection's own prepared statements of these (PgStore._prepare_turns: parsed once when it opens,
# not per turn: the hold's answer came ~35 us sooner here, a little less client CPU, less of the server's);
# names psycopg's own (``_pg3_N``) never take.  The last one where the connection has its procedure.
_PREPARED = ((b"bili_hold", _HOLD), (b"bili_commit", _COMMIT), (b"bili_save_parts", _SAVE_PARTS),
             (b"bili_commit_release", _COMMIT_RELEASE))
_PREPARED_NAMES = {sql: name for name, sql in _PREPARED}
_COMMAND_OK = int(ExecStatus.COMMAND_OK) if psycopg is not None else 1
# a new session's fork candidates: the sessions of its lane whose first part has its fingerprint
_CANDIDATES = ("SELECT p.session_id FROM lineage_parts p JOIN sessions s ON s.id=p.session_id "
               "WHERE p.seq=0 AND p.fp=%s AND s.lane=%s ORDER BY s.created")

# the archived lineage records of a lane's sessions that open with a part (PgStore.lineage_archived): as
# store._ARCHIVED reads them
_ARCHIVED = ("SELECT s.id, p.session_id FROM lineage_parts p JOIN sessions s "
             "ON s.id=split_part(p.session_id, chr(31), 1) "
             "WHERE p.seq=0 AND p.fp=%s AND s.lane=%s AND strpos(p.session_id, chr(31)) > 0 "
             "ORDER BY s.created, p.session_id")


_MAX_PARAMS = 30000  # values sent in one versioned statement at most (the protocol takes 65,535 parameters)
_USAGE_UPDATE = ("UPDATE sessions SET turns=turns+1, input_tokens=input_tokens+%s, cache_read=cache_read+%s, "
                 "cache_write=cache_write+%s, output_tokens=output_tokens+%s WHERE id=%s RETURNING turns")
_USAGE_INSERT = ("INSERT INTO turns(session_id, n, ts, lane, input_tokens, cache_read, cache_write, output_tokens) "
                 "SELECT %s, turns, %s, %s, %s, %s, %s, %s FROM {src} ON CONFLICT(session_id, n) DO UPDATE SET "
                 "ts=excluded.ts, lane=excluded.lane, input_tokens=excluded.input_tokens, cache_read=excluded.cache_read, "
                 "cache_write=excluded.cache_write, output_tokens=excluded.output_tokens")


def _wire_insert(row: WireTurn) -> tuple[str, str, tuple]:
    """A wire row's columns (``n`` first), the placeholders of its values after ``n``, and those values."""
    return WIRE_COLS, ", ".join(["%s"] * 16), (
        row.ts or time.time(), row.request, row.model, row.agent_tokens, row.sent_tokens, row.predicted, row.blocks,
        row.folded, ",".join(row.executed), row.input_tokens, row.cache_read, row.cache_write, row.output_tokens,
        row.cache_write_1h, row.write_split, int(row.side))


def _calibration_insert(row: CalibrationRow) -> tuple[str, str, tuple]:
    """As :func:`_wire_insert`, of a cache observation."""
    return CALIBRATION_COLS, ", ".join(["%s"] * 12), (
        row.ts, row.host, row.family, row.lane, row.gap, row.age, row.predicted_input, row.predicted_read,
        row.predicted_write, row.reported_input, row.reported_read, row.reported_write)


def _rows_lock_key(kind: str, session_id: str) -> int:
    """The transaction-scoped advisory lock under which a session's ``kind`` rows (``wire``,
    ``calibration``) are numbered: the first 8 bytes of SHA-256 of ``bili-<kind>:<session>``."""
    return int.from_bytes(hashlib.sha256(f"bili-{kind}:{session_id}".encode()).digest()[:8], "big", signed=True)


# the numbered records of an answer (PgStore._send_answer): each kind's insert
_NUMBERED_INSERT = {"wire": _wire_insert, "calibration": _calibration_insert}


class PgStore:
    """The PostgreSQL store: the same methods as :class:`bili_addon.store.Store`."""

    backend = "postgresql"
    exclusive = True  # a session's advisory lock keeps the other instances off it until release (or the commit's)

    def __init__(self, url: str, data_dir: str | None = None, *, pool_max: int = POOL_MAX,
                 timeout: float = CONNECT_TIMEOUT, lock_wait: float = LOCK_WAIT):
        if psycopg is None:
            raise StoreError(f"a PostgreSQL store needs psycopg: pip install 'bili-addon[postgres]' ({_IMPORT_ERROR})",
                             "cannot open", "install the extra: pip install 'bili-addon[postgres]'")
        self.url = url
        self.where = redact(url)
        # exports (decompress toFile) and the admin token stay in the local data dir
        self.path = Path(data_dir or ".") / DB_NAME
        self.writes = 0
        self.tightened: list[str] = []
        self.round_trips = 0  # statements sent, transaction control included (the benches report them)
        self._conn: psycopg.Connection | None = None  # held inside a transaction or a snapshot
        self.lock_wait = lock_wait
        self._lock_conn: psycopg.Connection | None = None  # holds the sessions' advisory locks
        self._lock_enc = "utf-8"  # its client encoding (read when it is opened)
        self._lock_proc = False  # it has its commit-and-release procedure (:data:`_COMMIT_RELEASE_PROC`)
        self._lock_prep = False  # it has the turn's statements prepared (:data:`_PREPARED`)
        self._unlocking = False  # release's unlock is on its way: its answer is read before the next statement
        self._held: set[str] = set()
        # the sessions whose lock a turn's commit let go (``commit_turn(release=True)``: the commit was to be
        # the turn's last write of them) until :meth:`release`: a write of one after it takes the lock again
        # first (:meth:`_again`)
        self._let_go: set[str] = set()
        # what :meth:`hold` read right after the session's lock was granted (its version, family and
        # last usage), answering :meth:`version`, :meth:`family` and :meth:`last_usage` until this
        # instance writes or lets go of the session: one round trip instead of four
        self._state: dict[str, tuple[int, tuple | None, tuple | None]] = {}
        # sessions :meth:`hold` found without a row: nothing of them to load (their ledger, blocks,
        # calls and copy are written with their row, never before), so :meth:`session_state` answers
        # at once while that read still holds (the version it read is still 0 in ``_state``)
        self._absent: set[str] = set()
        # the fork candidates :meth:`hold` read with the lock (``(first fingerprint, lane) -> ids``; and
        # ``(_ARCHIVED, first fingerprint, lane) -> (id, key)`` of the archived records):
        # :meth:`lineage_candidates` and :meth:`lineage_archived` answer from them once, until this
        # instance writes lineage parts
        self._cands: dict[tuple, list] = {}
        self._answer: list[tuple] | None = None  # an answer's records queued (:meth:`answer`), None: none being made
        # ``(session, candidates)`` of the hold :meth:`hold_soon` sent, whose answer :meth:`hold` reads
        self._soon: tuple[str, tuple[str, str] | None] | None = None
        try:
            # one direct connection first: a server that is down or refuses us fails at once, with its
            # own words (the pool would retry until its timeout while requests wait on the worker)
            psycopg.connect(url, connect_timeout=max(1, int(timeout))).close()
            self.pool = ConnectionPool(url, min_size=1, max_size=pool_max, timeout=timeout, open=False,
                                       kwargs={"autocommit": True, "prepare_threshold": 0},
                                       name="bili-store")
            self.pool.open(wait=True, timeout=timeout)
        except (psycopg.Error, PoolTimeout, Exception) as e:
            self.close()
            if isinstance(e, StoreError):
                raise
            raise pg_error("open", url, e) from e
        try:
            self._migrate()
            # the sessions' lock connection too, now: a proxy's first turn does not wait for it
            # (hold opens it again when it is lost)
            self._lock_connection()
        except (psycopg.Error, PoolTimeout, StoreError) as e:  # (StoreError: a schema newer than this bili's)
            self.close()  # (the pool's connection and threads with it)
            if isinstance(e, StoreError):
                raise
            raise pg_error("open", url, e) from e

    # -- connections and transactions ----------------------------------------------------------
    @contextmanager
    def _use(self):
        """The connection of the transaction in progress, else one from the pool."""
        if self._conn is not None:
            yield self._conn
            return
        with self.pool.connection() as conn:
            yield conn

    def _q(self, sql: str, params=()) -> list[tuple]:
        if self._answer:
            self._send_answer()
        with self._use() as conn:
            self.round_trips += 1
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []

    def _one(self, sql: str, params=()):
        rows = self._q(sql, params)
        return rows[0] if rows else None

    def _many(self, sql: str, rows: list) -> None:
        if not rows:
            return
        if self._answer:
            self._send_answer()
        with self._use() as conn, conn.cursor() as cur:
            self.round_trips += 1
            cur.executemany(sql, rows)  # psycopg pipelines the batch: one round trip

    @contextmanager
    def _tx(self):
        """One atomic write on one pooled connection (statements inside use it)."""
        if self._conn is not None:  # nested: part of the enclosing transaction
            yield self._conn
            return
        if self._answer:  # (an answer's records queued so far go first: see answer)
            self._send_answer()
        self._state.clear()  # this instance writes: what hold read may not hold any more
        self._cands.clear()
        try:
            with self.pool.connection() as conn:
                self._conn = conn
                self.round_trips += 2  # BEGIN, COMMIT
                try:
                    with conn.transaction():
                        yield conn
                finally:
                    self._conn = None
            self.writes += 1
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("write", self.url, e) from e

    @contextmanager
    def snapshot(self):
        """Reads that see one consistent state (REPEATABLE READ, read only)."""
        if self._conn is not None:
            yield
            return
        if self._answer:
            self._send_answer()
        try:
            with self.pool.connection() as conn:
                self._conn = conn
                try:
                    self.round_trips += 3  # BEGIN, SET TRANSACTION, COMMIT
                    with conn.transaction():
                        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        yield
                finally:
                    self._conn = None
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("read", self.url, e) from e

    def _migrate(self) -> None:
        with self._tx() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))  # one instance migrates at a time
            have = 0
            if conn.execute("SELECT to_regclass('meta')").fetchone()[0] is not None:
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                have = int(row[0]) if row else 0
            if have > SCHEMA_VERSION:
                raise newer_schema(self.where, have)
            holds = zip(sorted(_HOLDS), conn.execute(_HOLDS_SQL).fetchone())
            first = min([have + 1] + [v for v, held in holds if not held])  # (see _HOLDS)
            for v in sorted(_MIGRATIONS):
                if v >= first:
                    for stmt in _MIGRATIONS[v]:
                        conn.execute(stmt)
            if first <= SCHEMA_VERSION:
                conn.execute("INSERT INTO meta(key, value) VALUES('schema_version', %s) ON CONFLICT(key) "
                             "DO UPDATE SET value=excluded.value", (str(SCHEMA_VERSION),))

    # -- per-session serialisation across instances ----------------------------------------------
    @staticmethod
    def lock_key(session_id: str) -> int:
        h = _SESSION_KEY.copy()
        h.update(session_id.encode())
        return int.from_bytes(h.digest()[:8], "big", signed=True)

    def hold_soon(self, session_id: str, candidates: tuple[str, str] | None = None) -> None:
        """:meth:`hold`'s statement sent now, its answer read when :meth:`hold` is called: the lock's
        round trip (the database's work of it, ~0.3 ms for a new session on loopback) goes on while
        the turn reads its request, and the answer is mostly in when the turn asks for it (no wait:
        the process does not sleep and wake for it, ~0.05 ms of its CPU).  Nothing is sent while
        this instance holds a session (the connection's state is then the turn's), while an answer's
        records wait to be sent (:meth:`hold` sends them first, and says if that fails), or for a text
        :meth:`_call` would refuse; a failure to send leaves it to :meth:`hold`."""
        if self._held or self._soon is not None or self._answer:
            return
        fp, lane = candidates if candidates is not None else (None, None)
        try:
            args = _text_params((session_id, fp, lane), self._lock_enc)
        except (ValueError, UnicodeError):
            return  # (hold refuses it, as it does: nothing was sent)
        conn = self._lock_conn
        if conn is None or conn.closed or conn.pgconn.status == _BAD:  # (BAD: psycopg's ``closed``)
            return  # a connection to open: hold opens it (its failure said once, after one wait)
        try:
            if self._unlocking:
                self._unlocked()  # (release's unlock answered first; a failure drops the connection)
                conn = self._lock_conn
                if conn is None:
                    return
            pgconn = conn.pgconn
            if self._lock_prep:
                pgconn.send_query_prepared(_PREPARED_NAMES[_HOLD], args)
            else:
                pgconn.send_query_params(_HOLD, args)
            self._soon = (session_id, candidates)
            self.round_trips += 1
        except psycopg.Error:
            self._drop_lock_conn()  # (nothing is held: hold opens another and sends it as it does)

    def hold(self, session_id: str, candidates: tuple[str, str] | None = None) -> None:
        """The session's advisory lock, held until :meth:`release`: one instance at a time works on
        a session (join, fold decisions, commit).  Waits at most ``lock_wait`` seconds, then
        :class:`SessionBusy` (the request passes through unchanged).  The server drops the lock
        of an instance that dies (its connection closes).  The session's version, family and last
        usage are read in the same statement (``bili_hold``, schema 6: its read takes its snapshot
        once the lock is granted, so it sees every turn committed before).  ``candidates``: ``(first
        fingerprint, lane)`` of a session this instance does not know yet: its fork candidates
        (:meth:`lineage_candidates`) are read in the same round trip, right after the lock.  The
        answer of a hold :meth:`hold_soon` sent is read first (the session it named is then held,
        with what it read)."""
        self._settle_soon()
        if session_id in self._held:
            return
        self._take(session_id, candidates)

    def _let_soon_go(self) -> None:
        """The hold :meth:`hold_soon` sent for a turn that ended before it asked for it: its answer read
        (mostly in within a millisecond), else the statement cancelled (the session is held elsewhere:
        it waits for the lock; not waited out), and a lock it was granted let go with the others.
        Nothing else is held (hold_soon sends only then); the connection stays, but for a failure."""
        soon, self._soon = self._soon, None
        conn = self._lock_conn
        try:
            pgconn = conn.pgconn
            end = time.monotonic() + SOON_GRACE
            pgconn.consume_input()
            while pgconn.is_busy():
                left = end - time.monotonic()
                if left <= 0:
                    pgconn.get_cancel().cancel()
                    break
                select.select([pgconn.socket], [], [], left)
                pgconn.consume_input()
            self._answer_of(conn)
            self._held.add(soon[0])  # (granted: the release's unlock lets it go)
        except (pg_errors.QueryCanceled, pg_errors.LockNotAvailable):
            self._unlock_after(conn, soon[0])  # (granted right before it was cancelled, maybe)
        except (psycopg.Error, AttributeError, OSError):
            self._drop_lock_conn()  # (whatever it may hold goes with it)

    def _settle_soon(self) -> None:
        """The answer of the hold :meth:`hold_soon` sent, read (its session then held), before anything
        else is sent on the lock connection."""
        soon, self._soon = self._soon, None
        if soon is not None:
            self._take(soon[0], soon[1], sent=True)

    def _take(self, session_id: str, candidates: tuple[str, str] | None, sent: bool = False) -> None:
        """:meth:`hold`'s statement sent and answered (``sent``: its answer read, :meth:`hold_soon`
        sent it), and what it read kept."""
        conn = self._lock_conn
        try:
            if sent:
                result = self._answer_of(conn)
            else:
                if conn is None or self._unlocking or conn.pgconn.status == _BAD:  # (BAD: psycopg's ``closed``)
                    self._lock_connection()
                    conn = self._lock_conn
                self.round_trips += 1
                fp, lane = candidates if candidates is not None else (None, None)
                # one statement (schema 10: the candidates too; a pipeline of two cost ~3x the client's time)
                result = self._call(conn, _HOLD, (session_id, fp, lane))
            got = result.get_value(0, 0)
            if got == _NEW_HOLD or got == _NEW_HOLD_CANDS:  # a new session (nothing to decode)
                version = fam = last = None
                cands = archived = ()
            else:
                version, fam, last, cands, archived = msgspec.json.decode(got)
            if candidates is not None:
                self._cands[candidates] = list(cands or ())
                self._cands[(_ARCHIVED, *candidates)] = [tuple(a) for a in archived or ()]
        except pg_errors.LockNotAvailable as e:
            # the lock not granted in time, or granted and then a read of bili_hold waited past the
            # timeout on a table's lock (another instance's migration, a VACUUM FULL): the session's
            # lock outlives that failed statement, so it is let go here (not held: a no-op)
            self._unlock_after(conn, session_id)
            raise SessionBusy(session_id, self.lock_wait) from e
        except psycopg.Error as e:
            self._drop_lock_conn()  # whatever it may hold goes with it (a lock outlives a failed statement)
            raise pg_error("lock a session in", self.url, e) from e
        self._held.add(session_id)
        self._let_go.discard(session_id)
        if version is None:
            self._absent.add(session_id)
        self._state[session_id] = (
            int(version or 0),
            (fam[0], fam[1], int(fam[2]), int(fam[3] or 1)) if fam is not None else None,
            tuple(int(x) for x in last) if last is not None else None,
        )

    def _answer_of(self, conn):
        """The one result of the statement :meth:`hold_soon` sent on ``conn`` (waited for, the GIL let
        go, when it is not in yet), raised as :meth:`_call` raises a failure."""
        pgconn = conn.pgconn
        results = _results_of(conn)  # (mostly in already: the turn read its request meanwhile)
        if len(results) != 1:
            raise psycopg.OperationalError(f"the hold sent before was answered with {len(results)} results")
        if results[0].status != _TUPLES_OK:
            _failed(pgconn, results[0], self._lock_enc)
        return results[0]

    def _unlock_after(self, conn, session_id: str) -> None:
        """The session's lock let go after :meth:`hold` failed, in case its statement took it before
        failing; when that cannot be said, the connection goes, and every lock with it."""
        try:
            self._call(conn, _UNLOCK_ONE, (session_id,))
        except Exception:
            self._drop_lock_conn()

    def _call(self, conn, sql: bytes, params: tuple):
        """One statement of a turn's path (:data:`_HOLD`, :data:`_COMMIT`, :data:`_COMMIT_RELEASE`) sent
        through libpq as it is, or as the lock connection's prepared statement of it (:data:`_PREPARED`):
        its parameters as text, its one result returned (a failure raised as psycopg raises it).
        psycopg's cursor machinery cost the client ~2-3x the statement's own work (39 against 15 us
        hot; a turn pays it cold), twice per turn.  libpq's own blocking call (``PQexecParams``, the
        GIL let go while it waits): psycopg's wait generator is Python code run cold each turn; the
        lock connection's encoding is the one read when it was opened (never changed after)."""
        if self._answer:
            self._send_answer()
        if conn is self._lock_conn and self._soon is not None:  # (its answer first: the hold it sent is held)
            self._settle_soon()
        if conn is self._lock_conn:
            enc = self._lock_enc
            name = _PREPARED_NAMES.get(sql) if self._lock_prep else None
        else:
            enc = conn.info.encoding
            name = None
        pgconn = conn.pgconn
        params = _text_params(params, enc)
        result = pgconn.exec_params(sql, params) if name is None else pgconn.exec_prepared(name, params)
        if result.status != _TUPLES_OK:
            _failed(pgconn, result, enc)
        return result

    def _lock_connection(self) -> None:
        """The connection that holds the sessions' advisory locks (opened when missing)."""
        if self._unlocking:
            self._unlocked()
        if self._lock_conn is None or self._lock_conn.closed:
            self._lock_conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            self._lock_conn.execute(f"SET lock_timeout = {max(1, int(self.lock_wait * 1000))}")
            self._lock_enc = self._lock_conn.info.encoding
            try:  # (a database that refuses temporary objects: release sends the unlock, as it did)
                self._lock_conn.execute(_COMMIT_RELEASE_PROC)
                self._lock_proc = True
            except psycopg.Error:
                self._lock_proc = False
            self._lock_prep = self._prepare_turns(self._lock_conn.pgconn)

    def _prepare_turns(self, pgconn) -> bool:
        """The turn's statements (:data:`_PREPARED`; the commit-and-release one where the connection has
        its procedure) prepared on the lock connection as it opens; False (they are sent as they are,
        parsed per turn) when one is refused."""
        try:
            for name, sql in _PREPARED if self._lock_proc else _PREPARED[:-1]:
                if pgconn.prepare(name, sql).status != _COMMAND_OK:
                    return False
        except psycopg.Error:
            return False
        return True

    def release(self, wait: bool = False) -> None:
        """Let go of the sessions :meth:`hold` took.  The unlock is sent without waiting for its answer
        (the server lets the locks go when it reads it; the answer is read before this connection's
        next statement), so another connection's *try* of the lock may still find it held for a
        moment: ``wait`` reads the answer now, for a caller that needs the lock free on return."""
        if self._soon is not None:
            self._let_soon_go()
        self._state.clear()
        self._absent.clear()
        self._cands.clear()
        self._let_go.clear()
        if not self._held:  # (none, or the turn's commit let them go: nothing left to send)
            return
        self._held.clear()
        try:
            self.round_trips += 1  # a statement sent, its answer not waited for
            if self._unlocking:
                self._unlocked()
            # the unlock is sent (flushed to the server, which lets the locks go when it reads it), its
            # answer read before the connection's next statement (hold): the turn does not wait for a
            # round trip to the database to end
            pgconn = self._lock_conn.pgconn
            pgconn.send_query(_UNLOCK)  # (libpq sends it: not in pipeline mode)
            self._unlocking = True
            if pgconn.flush():  # what the socket did not take at once
                self._lock_conn.wait(pg_generators.send(pgconn))
            if wait:
                self._unlocked()
        except (psycopg.Error, AttributeError):  # a broken connection held nothing any more
            self._drop_lock_conn()

    def _unlocked(self) -> None:
        """The answer of the unlock :meth:`release` sent; a failure drops the connection (and with it
        whatever it may still hold)."""
        self._unlocking = False
        try:
            conn = self._lock_conn
            results = _results_of(conn)  # (it came long ago, as a rule)
            ok = bool(results) and all(r.status == _TUPLES_OK for r in results)
        except (psycopg.Error, AttributeError):
            ok = False
        if not ok:
            self._drop_lock_conn()

    def _drop_lock_conn(self) -> None:
        self._unlocking = False
        self._soon = None  # (a hold sent on it: nothing of it is held once the connection closes)
        self._lock_proc = False
        self._lock_prep = False
        conn, self._lock_conn = self._lock_conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def close(self) -> None:
        self._held = set()
        self._let_go = set()
        self._state = {}
        self._answer = None
        self._absent = set()
        self._cands = {}
        self._drop_lock_conn()
        pool = getattr(self, "pool", None)
        if pool is not None:
            try:
                pool.close()
            except Exception:
                pass

    # -- what operations ask -------------------------------------------------------------------
    def schema_version(self) -> int:
        row = self._one("SELECT value FROM meta WHERE key='schema_version'")
        return int(row[0]) if row else 0

    def ping(self) -> float:
        """Seconds for one round trip to the database."""
        t = time.perf_counter()
        self._q("SELECT 1")
        return time.perf_counter() - t

    def pool_stats(self) -> dict:
        st = self.pool.get_stats()
        return {k: st.get(k, 0) for k in ("pool_min", "pool_max", "pool_size", "pool_available", "requests_waiting")}

    # -- the same reads as the SQLite store ----------------------------------------------------
    def _advance(self, conn, session_id: str, expect: int) -> int:
        self.round_trips += 1
        if conn.execute("UPDATE sessions SET version=version+1 WHERE id=%s AND version=%s RETURNING version",
                        (session_id, expect)).fetchone():
            return expect + 1
        if expect == 0:
            now = time.time()
            self.round_trips += 1
            if conn.execute("INSERT INTO sessions(id, created, last_seen, version) VALUES(%s,%s,%s,1) "
                            "ON CONFLICT(id) DO NOTHING RETURNING version", (session_id, now, now)).fetchone():
                return 1
        row = conn.execute("SELECT version FROM sessions WHERE id=%s", (session_id,)).fetchone()
        raise StaleSession(session_id, expect, row[0] if row else 0)

    @_reads
    def version(self, session_id: str) -> int:
        if session_id in self._state:
            return self._state[session_id][0]
        row = self._one("SELECT version FROM sessions WHERE id=%s", (session_id,))
        return row[0] if row else 0

    _SESSION_COLS = "id, agent, lane, created, last_seen, requests, messages, next_ref, flags, version"

    @_reads
    def session(self, session_id: str) -> SessionRow | None:
        row = self._one(f"SELECT {self._SESSION_COLS} FROM sessions WHERE id=%s", (session_id,))
        return SessionRow(*row) if row else None

    @_reads
    def sessions(self) -> list[SessionRow]:
        return [SessionRow(*r) for r in self._q(f"SELECT {self._SESSION_COLS} FROM sessions WHERE pruned < last_seen "
                                                "ORDER BY last_seen DESC")]  # not a pruned one's tombstone (schema 8)

    @_reads
    def ledger(self, session_id: str) -> list[LedgerRow]:
        return ledger_rows(r[0] for r in self._q(
            "SELECT rows FROM ledger_turns WHERE session_id=%s ORDER BY seq", (session_id,)))

    @_reads
    def session_state(self, session_id: str) -> tuple[SessionRow | None, list[LedgerRow], list[str], list[tuple],
                                                      str | None]:
        """As :meth:`bili_addon.store.Store.session_state`, in one statement (one snapshot, one round
        trip instead of eight: a session's first turn, and every reload of another instance's turn)."""
        if self._conn is None and session_id in self._absent and self._state.get(session_id, (1,))[0] == 0:
            self._absent.discard(session_id)  # a new session, as hold saw it under its lock: no read
            return None, [], [], [], None
        if self._conn is not None:  # inside a transaction or a snapshot: its reads
            return (self.session(session_id), self.ledger(session_id), self.blocks(session_id),
                    self.calls(session_id), self.copy(session_id))
        cols = ", ".join(f"s.{c.strip()}" for c in self._SESSION_COLS.split(","))
        row = self._one(
            f"SELECT {cols}, "
            "ARRAY(SELECT rows FROM ledger_turns WHERE session_id=%(id)s ORDER BY seq), "
            "ARRAY(SELECT body FROM blocks WHERE session_id=%(id)s ORDER BY block_id COLLATE \"C\"), "
            "ARRAY(SELECT json_build_array(call_key, name, args, result)::TEXT FROM calls WHERE session_id=%(id)s "
            "ORDER BY created, call_key), "
            "(SELECT doc FROM copies WHERE session_id=%(id)s) "
            "FROM (SELECT 1) AS one LEFT JOIN sessions s ON s.id=%(id)s", {"id": session_id})
        n = len(self._SESSION_COLS.split(","))
        calls = [_call_back(msgspec.json.decode(c)) for c in row[n + 2]]
        return (SessionRow(*row[:n]) if row[0] is not None else None, ledger_rows(row[n]), list(row[n + 1]),
                calls, row[n + 3])

    @_reads
    def ref_count(self, session_id: str) -> int:
        return int(self._one("SELECT COALESCE(SUM(n), 0) FROM ledger_turns WHERE session_id=%s", (session_id,))[0])

    @_reads
    def usage(self, session_id: str) -> UsageTotals:
        return usage_totals(self._one(USAGE.format("%(id)s"), {"id": session_id}))

    @_reads
    def last_usage(self, session_id: str) -> tuple[int, int, int, int] | None:
        if session_id in self._state:
            return self._state[session_id][2]
        row = self._one("SELECT input_tokens, cache_read, cache_write, output_tokens FROM turns WHERE session_id=%s "
                        "ORDER BY n DESC LIMIT 1", (session_id,))
        return tuple(row) if row else None

    @_reads
    def affinity(self) -> list[tuple[str, int, str]]:
        return self._q("SELECT session_id, depth, tail FROM affinity")

    @_reads
    def affinity_of(self, tails: list[str]) -> list[tuple[str, int, str]]:
        if not tails:
            return []
        return self._q("SELECT session_id, depth, tail FROM affinity WHERE tail = ANY(%s)", (list(tails),))

    # -- writes --------------------------------------------------------------------------------
    def commit_turn(self, row: SessionRow, new_refs: list[LedgerRow], chain: tuple[int, str] | None = None, *,
                    expect: int, minted: list[tuple[str, str]] = (), fresh: bool = False,
                    copy: str | None = None, release: bool = False) -> int:
        """As :meth:`bili_addon.store.Store.commit_turn`, in one round trip: ``bili_commit_turn`` (schema
        11) checks and advances the version, allocates the minted refs, writes the session row, the
        ledger rows, the prefix chain and the canonical copy (``copy``) in one statement (its own
        transaction); a refusal rolls it all back and names itself (:data:`_STALE`).  ``release``: this
        is the turn's last write of the session: the session's lock goes in the same round trip
        (:meth:`_commit_on`), and :meth:`release` has nothing left to send."""
        if row.id in self._let_go:  # (:meth:`_again`, inline)
            self.hold(row.id)
        now = time.time()
        fresh = fresh and bool(new_refs)
        if fresh and minted:
            raise StoreError("a fresh turn's refs are its rows' (minted must be left out)")
        if fresh:  # the refs are the rows' (consecutive: checked here; the first against the counter there)
            fresh_first(new_refs)
            given, k, first = FRESH_GIVEN, len(new_refs), new_refs[0].ref
        elif minted:
            minted = list(minted)
            contiguous(minted)
            given, k, first = _json.encode(minted).decode(), len(minted), minted[0][0]
        else:
            given, k, first = None, 0, None
        # the documents as text with their counts (msgspec's JSON, kept as it is: schema 7, sent as its
        # bytes: UTF-8); psycopg's array dumper would work element by element in Python
        doc = _json.encode(new_refs) if new_refs else None
        lock_conn = self._lock_conn if self._conn is None and row.id in self._held and not self._unlocking else None
        try:
            if lock_conn is not None:
                # the session's lock connection (the turn's own: hold took it there, on this thread): the
                # statement is its own transaction there as on a pooled one (autocommit; an advisory lock
                # of the session is not a transaction's), without the pool's check-out and return
                # (~70 us of the client's CPU a turn, cold)
                version = self._commit_on(lock_conn, row, expect, now, given, k, first, doc, len(new_refs), chain,
                                          copy, release and self._lock_proc and len(self._held) == 1)
            else:
                with self._use() as conn:
                    version = self._commit_on(conn, row, expect, now, given, k, first, doc, len(new_refs), chain,
                                              copy)
        except psycopg.Error as e:
            self._state.pop(row.id, None)
            if lock_conn is not None and lock_conn.closed:
                self._drop_lock_conn()  # lost, and the session's lock with it (the next hold opens another)
            if getattr(e, "sqlstate", None) == _STALE:  # the version moved, or a ref was given meanwhile
                found = int((getattr(e.diag, "message_detail", None) or "0").strip() or 0)
                raise StaleSession(row.id, expect, found) from e
            raise pg_error("write", self.url, e) from e
        except PoolTimeout as e:
            raise pg_error("write", self.url, e) from e
        self.writes += 1
        held = self._state.get(row.id)
        if held is not None:  # the turn moved the version; its family and last usage are as they were
            self._state[row.id] = (int(version), *held[1:])
        return int(version)

    def _commit_on(self, conn, row: SessionRow, expect: int, now: float, given, k: int, first, doc: bytes | None,
                   n: int, chain, copy, unlock: bool = False) -> int:
        """``bili_commit_turn`` on ``conn``: the new version (:meth:`_call`).  ``unlock``: ``conn`` is the
        lock connection, which lets its sessions go right after the commit, in the same round trip
        (:data:`_COMMIT_RELEASE`: the commit's transaction ends before the unlock runs).  Done, the
        sessions are let go: :meth:`release` sends nothing for them, and a write of one after this takes
        its lock again (:meth:`_again`).  Refused (:data:`_STALE`: before its COMMIT), nothing is written
        and the lock is kept.  Any other failure drops the connection (the locks go with it; whether the
        commit was written is the store's to say: the session is read again).  The unlock on its own
        (:meth:`release`: its send, its answer read before the next statement) cost ~55 us of the
        client's CPU a turn, cold, plus that read."""
        self.round_trips += 1  # (with the unlock: the same one statement)
        enc = self._lock_enc if conn is self._lock_conn else conn.info.encoding
        if doc is not None and enc != "utf-8":
            doc = doc.decode().encode(enc)
        params = (row.id, expect, row.agent, row.lane, repr(now), row.requests, row.messages, row.next_ref,
                  row.flags, given, k, first, doc, n,
                  chain[0] if chain is not None else None, chain[1] if chain is not None else None, copy)
        if not unlock:
            return int(self._call(conn, _COMMIT, params).get_value(0, 0))
        try:
            result = self._call(conn, _COMMIT_RELEASE, params)
        except psycopg.Error as e:
            if getattr(e, "sqlstate", None) != _STALE:
                self._drop_lock_conn()
                self._let_go_all()
            raise
        self._let_go_all()
        return int(result.get_value(0, 0))

    def _let_go_all(self) -> None:
        """The sessions held are let go (the lock connection's unlock ran, or it was dropped)."""
        self._let_go.update(self._held)
        self._held.clear()
        self._state.clear()
        self._absent.clear()
        self._cands.clear()

    def _again(self, session_id: str) -> None:
        """Before every write of a session: when the turn's commit let its lock go (it was to be the
        turn's last write), the lock taken again (:meth:`hold`), so the write is one instance's at a
        time as ever; its version check refuses it (:class:`StaleSession`: the turn is computed again)
        when another instance's turn came in between.  (Nothing for a session still held.)"""
        if session_id in self._let_go:
            self.hold(session_id)

    def set_flags(self, row: SessionRow, *, expect: int) -> int:
        """A learned fact of an existing session: one statement (its own transaction); a new session
        or a version that moved takes the general path (which raises :class:`StaleSession`)."""
        self._again(row.id)
        try:
            with self._use() as conn:
                self.round_trips += 1
                done = conn.execute("UPDATE sessions SET version=version+1, flags=%s WHERE id=%s AND version=%s "
                                    "RETURNING version", (row.flags, row.id, expect)).fetchone()
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("write", self.url, e) from e
        if done is not None:
            self.writes += 1
            held = self._state.get(row.id)
            if held is not None:
                self._state[row.id] = (int(done[0]), *held[1:])
            return int(done[0])
        with self._tx() as conn:
            version = self._advance(conn, row.id, expect)
            self.round_trips += 1
            conn.execute(
                "INSERT INTO sessions(id, agent, lane, created, last_seen, flags, version) "
                "VALUES(%s,%s,%s,%s,%s,%s,%s) ON CONFLICT(id) DO UPDATE SET flags=excluded.flags",
                (row.id, row.agent, row.lane, row.created, row.last_seen, row.flags, version),
            )
        return version

    def _write_one(self, sql: str, params: tuple):
        """One write that is one statement, its own transaction (the pooled connections commit each
        statement): one round trip where :meth:`_tx` makes three (BEGIN, the statement, COMMIT).
        Returns its first row (None: none)."""
        if self._answer:
            self._send_answer()
        nested = self._conn is not None
        if not nested:
            self._state.clear()  # (as _tx: this instance writes, what hold read may not hold any more)
            self._cands.clear()
        try:
            with self._use() as conn:
                self.round_trips += 1
                cur = conn.execute(sql, params)
                row = cur.fetchone() if cur.description is not None else None
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("write", self.url, e) from e
        if not nested:
            self.writes += 1
        return row

    def record_usage(self, session_id: str, lane: str, usage: tuple[int, int, int, int], last: bool = True) -> None:
        """An answer's usage: the session's totals and its turn's row, in one statement (the row
        numbered by the totals' update, as the update locks the session's row).  ``last``: as
        :meth:`bili_addon.store.Store.record_usage` (a side request's: the totals only)."""
        self._record(("usage", session_id, (lane, usage, time.time(), last)))

    def _record(self, record: tuple, send: bool = False) -> dict[str, int]:
        """An answer's record (``(kind, session, what)``): queued inside :meth:`answer` (sent now when
        ``send``), else a statement of its own, made as the queue's is.  ``{table: n}`` of what went."""
        if self._answer is None:
            self._answer = [record]
            try:
                return self._send_answer()
            finally:
                self._answer = None
        self._queue(record)
        return self._send_answer() if send else {}

    def _numbered(self, key: int, table: str, cols: str, values: str, params: tuple, session_id: str) -> int:
        """Insert a row numbered as the session's next ``n`` of ``table`` (:meth:`record_wire`,
        :meth:`record_calibration`) in a transaction of two statements: the session's transaction-scoped
        advisory lock of those rows, then the insert, whose snapshot comes after the lock.  The way when
        the one statement of :meth:`_send_answer` found the number taken (its snapshot is the statement's,
        taken before the lock was granted: another instance's row committed in between is not in it),
        and the only way before it (every instance, of this version or an older one, numbers under the
        same lock)."""
        with self._tx() as conn:
            self.round_trips += 2
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
            n = conn.execute(
                f"INSERT INTO {table}(session_id, {cols}) SELECT %s, COALESCE(MAX(n), 0) + 1, {values} "
                f"FROM {table} WHERE session_id=%s RETURNING n", (session_id, *params, session_id)).fetchone()
        return int(n[0])

    @contextmanager
    def answer(self):
        """One answer's records (:meth:`record_usage`, :meth:`record_calibration`, :meth:`record_wire`;
        the lineage its request kept back, :meth:`save_lineage_parts`), made inside, sent as one
        statement (:meth:`_send_answer`, which sends each record of its own outside): the usage's,
        then each numbered insert as a data-modifying part of its own (taking the lock :meth:`_numbered`
        takes), when :meth:`record_wire` is called (it needs its number) or at the end.  Inside, a cache
        observation is numbered when the batch goes (:meth:`record_calibration` returns 0).  One round
        trip where the records made three; a number another instance took meanwhile is given again by
        :meth:`_numbered`.  Any other statement meanwhile (a read of what they write included) sends
        the queue first.  Nested: part of the enclosing batch."""
        if self._answer is not None:
            yield
            return
        self._answer = []
        try:
            yield
        finally:  # (what was queued goes even when the work after it failed, as it went before)
            try:
                if self._answer:
                    self._send_answer()
            finally:
                self._answer = None

    def _queue(self, record: tuple) -> None:
        """A record of :meth:`answer`, queued: as a write would, it ends what :meth:`hold` read (a read of
        the session's usage now reads the store, which sends the queue first)."""
        if any(kind == record[0] for kind, _s, _w in self._answer):  # (one of a kind per statement)
            self._send_answer()
        self._state.clear()
        self._cands.clear()
        self._answer.append(record)

    def _send_answer(self) -> dict[str, int]:
        """The queued records of :meth:`answer`, in one statement; ``{table: n}`` of the numbered ones."""
        batch, self._answer = self._answer, []
        ctes: list[str] = []
        params: list = []
        numbered: list[tuple] = []  # (table, session, lock key, its insert) in the statement's order
        for kind, sid, what in batch:
            i = len(ctes)
            if kind == "lineage":
                keep, end, doc = what
                ctes.append(f"g{i} AS ({_SAVE_PARTS_DELETE.format(s='%s', end='%s')})")
                ctes.append(f"p{i} AS ({_SAVE_PARTS_INSERT.format(s='%s', keep='%s', rows='%s')})")
                params += [sid, end, sid, keep, doc]
                continue
            if kind == "usage":
                lane, (inp, read, write, out), ts, last = what
                ctes.append(f"u{i} AS ({_USAGE_UPDATE})")
                params += [inp, read, write, out, sid]
                if last:
                    ctes.append(f"t{i} AS ({_USAGE_INSERT.format(src=f'u{i}')})")
                    params += [sid, ts, lane, inp, read, write, out]
                continue
            key = _rows_lock_key(kind, sid)
            insert = _NUMBERED_INSERT[kind](what)
            cols, values, vals = insert
            ctes.append(f"l{i} AS (SELECT pg_advisory_xact_lock(%s))")
            params.append(key)
            ctes.append(f"n_{kind} AS (INSERT INTO {kind}(session_id, {cols}) SELECT %s, (SELECT COALESCE(MAX(n), 0) + 1 "
                        f"FROM {kind} WHERE session_id=%s), {values} FROM l{i} "
                        "ON CONFLICT(session_id, n) DO NOTHING RETURNING n)")
            params += [sid, sid, *vals]
            numbered.append((kind, sid, key, insert))
        tail = ", ".join(f"(SELECT n FROM n_{t[0]})" for t in numbered) or "NULL"
        got = self._write_one(f"WITH {', '.join(ctes)} SELECT {tail}", tuple(params))
        out: dict[str, int] = {}
        for (table, sid, key, insert), n in zip(numbered, got or ()):
            if n is None:  # taken meanwhile: numbered again under the lock
                n = self._numbered(key, table, *insert, sid)
            out[table] = int(n)
        return out

    # -- what went on the wire, per answered turn (stats, the page, the log line) ---------------
    def record_wire(self, session_id: str, row: WireTurn) -> int:
        """As :meth:`bili_addon.store.Store.record_wire`: the turn's number is the session's next.

        Numbering ``n`` with several instances: under READ COMMITTED two transactions would both
        read the same ``MAX(n)`` and the second insert would fail on the primary key.  So the
        transaction first takes a transaction-scoped advisory lock of the session's wire rows, then
        numbers and inserts in one statement, which (a new snapshot per statement) sees every turn
        committed before the lock was granted; the lock goes with the commit (:meth:`_numbered`; mostly
        one statement that takes the lock itself: :meth:`_send_answer`).  Not the session's
        row lock: the SQLite store numbers answers of a session that has no row too, and a lock on
        nothing serialises nothing.  Not :meth:`hold`'s key either: this instance may hold that one
        on its lock connection while it records the answer (a pooled connection waiting on it
        would wait on itself, with no timeout)."""
        return self._record(("wire", session_id, row), send=True)["wire"]  # (an answer's last record: it goes now)

    @_reads
    def wire_totals(self, session_id: str) -> tuple[int, WireTurn | None, int, int, list[tuple]]:
        """As :meth:`bili_addon.store.Store.wire_totals` (sums cast back to integers: PostgreSQL
        sums BIGINTs as NUMERIC; models in byte order, as SQLite sorts them)."""
        with self.snapshot():
            n, peak_a, peak_s = self._one(
                "SELECT COUNT(*), COALESCE(MAX(agent_tokens), 0), COALESCE(MAX(sent_tokens), 0) FROM wire "
                "WHERE session_id=%s", (session_id,))
            if not n:
                return 0, None, 0, 0, []
            last = self._one(WIRE_LAST.format("%s"), (session_id,))
            models = self._q(
                f"SELECT {WIRE_SUMS} FROM {_WIRE_ROWS} GROUP BY {WIRE_GROUP} ORDER BY model COLLATE \"C\", lw, lo",
                (session_id,))
        return n, wire_turn(last), peak_a, peak_s, [(r[0], *(int(x) for x in r[1:])) for r in models]

    @_reads
    def wire(self, session_id: str) -> list[WireTurn]:
        return [wire_turn(r) for r in self._q(
            f"SELECT {WIRE_COLS} FROM wire WHERE session_id=%s ORDER BY n", (session_id,))]

    # -- the cache model's calibration (kernel/calibration.py) -------------------------------------
    def record_calibration(self, session_id: str, row: CalibrationRow) -> int:
        """As :meth:`bili_addon.store.Store.record_calibration`; numbered as :meth:`record_wire` numbers
        (under a transaction-scoped advisory lock of the session's observations).  Inside :meth:`answer`:
        0, the row is numbered when the batch goes."""
        return self._record(("calibration", session_id, row)).get("calibration", 0)

    @_reads
    def calibration(self, session_id: str, limit: int = 0) -> list[CalibrationRow]:
        rows = self._q(f"SELECT {CALIBRATION_COLS} FROM calibration WHERE session_id=%s ORDER BY n DESC"
                       + (" LIMIT %s" if limit else ""), (session_id, limit) if limit else (session_id,))
        return [CalibrationRow(*r) for r in reversed(rows)]

    @_reads
    def calibration_totals(self, session_id: str) -> tuple[int, int, int, int, int, int, int]:
        return tuple(int(x) for x in self._one(
            "SELECT COUNT(*), COALESCE(SUM(predicted_read), 0), COALESCE(SUM(reported_read), 0), "
            "COALESCE(SUM(CASE WHEN reported_write IS NOT NULL THEN predicted_write END), 0), "
            "COALESCE(SUM(reported_write), 0), COUNT(reported_write), "
            "COALESCE(SUM(CASE WHEN (predicted_read > 0) = (reported_read > 0) THEN 1 ELSE 0 END), 0) "
            "FROM calibration WHERE session_id=%s", (session_id,)))

    @_reads
    def host_calibration(self, host: str, family: str, limit: int) -> list[CalibrationRow]:
        rows = self._q(f"SELECT {CALIBRATION_COLS} FROM calibration WHERE host=%s AND family=%s "
                       "ORDER BY ts DESC LIMIT %s", (host, family, limit))
        return [CalibrationRow(*r) for r in reversed(rows)]

    @_reads
    def calibration_hosts(self) -> list[tuple[str, str, int]]:
        return [(h, f, int(n)) for h, f, n in self._q(
            "SELECT host, family, COUNT(*) FROM calibration WHERE host != '' GROUP BY host, family "
            "ORDER BY host COLLATE \"C\", family COLLATE \"C\"")]

    # -- folding -------------------------------------------------------------------------------
    @_reads
    def blocks(self, session_id: str) -> list[str]:
        # SQLite's WITHOUT ROWID table returns them in primary key order; so does this
        return [r[0] for r in self._q("SELECT body FROM blocks WHERE session_id=%s ORDER BY block_id COLLATE \"C\"",
                                      (session_id,))]

    @_reads
    def originals(self, session_id: str, refs: list[str] | None = None) -> list[tuple]:
        q = "SELECT ref, role, ctype, tool_name, tool_call_id, text, tokens FROM originals WHERE session_id=%s"
        rows = [(*r[:5], _nul_back(r[5]), *r[6:]) for r in self._q(q, (session_id,))]
        if refs is None:
            return sorted(rows)
        want = set(refs)
        return sorted(r for r in rows if r[0] in want)

    @_reads
    def calls(self, session_id: str) -> list[tuple[str, str, str, str | None]]:
        return [_call_back(c) for c in self._q("SELECT call_key, name, args, result FROM calls WHERE session_id=%s "
                                                "ORDER BY created, call_key", (session_id,))]

    def _versioned(self, session_id: str, expect: int, writes: list[tuple[str, list]]) -> int | None:
        """A versioned write of a session the store has, in one statement (one round trip where a
        transaction makes four or more): the session's version advanced when it is still ``expect``,
        and ``writes``, each a data-modifying statement with the rows it writes (``(sql, rows)``:
        ``{rows}`` in ``sql`` stands for their ``VALUES`` list as table ``x``, which reads the version's
        update ``v``, so nothing is written when the version moved).  Returns the new version, or None
        (a new session, a version that moved, or more values than one statement takes: the caller's
        transaction says which, or writes them)."""
        if sum(len(rows) * len(rows[0]) for _sql, rows in writes if rows) > _MAX_PARAMS:
            return None
        ctes = ["v AS (UPDATE sessions SET version=version+1 WHERE id=%s AND version=%s RETURNING version)"]
        params: list = [session_id, expect]
        for i, (sql, rows) in enumerate(writes):
            if not rows:
                continue
            width = len(rows[0])
            one = "(" + ", ".join(["%s"] * width) + ")"
            ctes.append(f"w{i} AS ({sql.format(rows='(VALUES ' + ', '.join([one] * len(rows)) + ')')})")
            params += [x for r in rows for x in r]
        row = self._write_one(f"WITH {', '.join(ctes)} SELECT version FROM v", tuple(params))
        return int(row[0]) if row else None

    def record_calls(self, session_id: str, calls: list[tuple[str, str, str]], *, expect: int) -> int:
        self._again(session_id)
        now = time.time()
        if expect and calls:
            version = self._versioned(session_id, expect, [(
                "INSERT INTO calls(session_id, call_key, name, args, created) SELECT x.* FROM v, {rows} "
                "AS x(session_id, call_key, name, args, created) ON CONFLICT DO NOTHING",
                [(session_id, k, n, _nul_safe(a), now) for k, n, a in calls])])
            if version is not None:
                return version
        with self._tx() as conn:
            version = self._advance(conn, session_id, expect)
            self._many("INSERT INTO calls(session_id, call_key, name, args, created) VALUES(%s,%s,%s,%s,%s) "
                       "ON CONFLICT DO NOTHING", [(session_id, k, n, _nul_safe(a), now) for k, n, a in calls])
        return version

    def commit_fold(self, session_id: str, blocks: list[tuple[str, str, bool]],
                    originals: list[tuple[str, str, str, str, str, str, int]], results: list[tuple[str, str]], *,
                    expect: int) -> int:
        self._again(session_id)
        now = time.time()
        # (one statement but where a block or a call comes twice: one statement's upsert or update
        # touches a row once, the transaction's statements one after the other)
        if expect and len({b[0] for b in blocks}) == len(blocks) and len({k for k, _r in results}) == len(results):
            version = self._versioned(session_id, expect, [
                ("INSERT INTO blocks(session_id, block_id, body, active) SELECT x.* FROM v, {rows} "
                 "AS x(session_id, block_id, body, active) ON CONFLICT(session_id, block_id) DO UPDATE SET "
                 "body=excluded.body, active=excluded.active", [(session_id, bid, body, int(active))
                                                                for bid, body, active in blocks]),
                ("INSERT INTO originals(session_id, ref, role, ctype, tool_name, tool_call_id, text, tokens) "
                 "SELECT x.* FROM v, {rows} AS x(session_id, ref, role, ctype, tool_name, tool_call_id, text, "
                 "tokens) ON CONFLICT DO NOTHING", [(session_id, *_original_safe(o)) for o in originals]),
                # a call's result is written once: the claim (``result IS NULL``) makes it execute once
                ("UPDATE calls c SET result=x.result, executed=x.executed FROM v, {rows} "
                 "AS x(session_id, call_key, result, executed) WHERE c.session_id=x.session_id "
                 "AND c.call_key=x.call_key AND c.result IS NULL", [(session_id, key, _nul_safe(res), now)
                                                                    for key, res in results]),
            ])
            if version is not None:
                return version
        with self._tx() as conn:
            version = self._advance(conn, session_id, expect)
            self._many("INSERT INTO blocks(session_id, block_id, body, active) VALUES(%s,%s,%s,%s) "
                       "ON CONFLICT(session_id, block_id) DO UPDATE SET body=excluded.body, active=excluded.active",
                       [(session_id, bid, body, int(active)) for bid, body, active in blocks])
            self._many("INSERT INTO originals(session_id, ref, role, ctype, tool_name, tool_call_id, text, tokens) "
                       "VALUES(%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                       [(session_id, *_original_safe(o)) for o in originals])
            # a call's result is written once: the claim (``result IS NULL``) makes it execute once
            self._many("UPDATE calls SET result=%s, executed=%s WHERE session_id=%s AND call_key=%s AND result IS NULL",
                       [(_nul_safe(res), now, session_id, key) for key, res in results])
        return version

    @_reads
    def copy(self, session_id: str) -> str | None:
        row = self._one("SELECT doc FROM copies WHERE session_id=%s", (session_id,))
        return row[0] if row else None

    def save_copy(self, session_id: str, doc: str, *, expect: int) -> int:
        self._again(session_id)
        if expect:
            version = self._versioned(session_id, expect, [(
                "INSERT INTO copies(session_id, doc) SELECT x.* FROM v, {rows} AS x(session_id, doc) "
                "ON CONFLICT(session_id) DO UPDATE SET doc=excluded.doc", [(session_id, doc)])])
            if version is not None:
                return version
        with self._tx() as conn:
            version = self._advance(conn, session_id, expect)
            self.round_trips += 1
            conn.execute("INSERT INTO copies(session_id, doc) VALUES(%s,%s) ON CONFLICT(session_id) "
                         "DO UPDATE SET doc=excluded.doc", (session_id, doc))
        return version

    @_reads
    def transcript(self, session_id: str) -> list[tuple[str, list[str], bytes]]:
        rows = self._q("SELECT sig, refs, item FROM transcript WHERE session_id=%s ORDER BY seq", (session_id,))
        return [(sig, json.loads(refs), bytes(item)) for sig, refs, item in rows]

    def save_transcript(self, session_id: str, keep: int, rows: list[tuple[str, list[str], bytes]], *,
                        expect: int) -> int:
        self._again(session_id)
        with self._tx() as conn:
            version = self._advance(conn, session_id, expect)
            self.round_trips += 1
            conn.execute("DELETE FROM transcript WHERE session_id=%s AND seq>=%s", (session_id, keep))
            self._many("INSERT INTO transcript(session_id, seq, sig, refs, item) VALUES(%s,%s,%s,%s,%s)",
                       [(session_id, keep + i, sig, json.dumps(refs), item) for i, (sig, refs, item) in enumerate(rows)])
        return version

    # -- server-side chains (#13, kernel/chains.py) ------------------------------------------------
    def save_chain(self, row: tuple, *, replace: bool = False) -> bool:
        action = ("DO UPDATE SET " + ", ".join(f"{c}=excluded.{c}" for c in CHAIN_COLS[1:])) if replace else "DO NOTHING"
        with self._tx() as conn:
            self.round_trips += 1
            cur = conn.execute(f"INSERT INTO chains({', '.join(CHAIN_COLS)}) "
                               f"VALUES({', '.join(['%s'] * len(CHAIN_COLS))}) ON CONFLICT(id) {action}", row)
            return cur.rowcount == 1

    @_reads
    def chain(self, response_id: str) -> tuple | None:
        r = self._one(f"SELECT {', '.join(CHAIN_COLS)} FROM chains WHERE id=%s", (response_id,))
        return None if r is None else tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)

    # -- lineage (#15, #20): the SQLite store's queries, spelled for PostgreSQL -------------------
    @_reads
    def lineage(self) -> list[tuple[str, str, str, int]]:
        return self._q("SELECT session_id, parent, root, fork_at FROM lineage ORDER BY created")

    @_reads
    def lineage_parts(self, session_id: str) -> list[tuple[str, str, str]]:
        return self._q("SELECT ref, chash, fp FROM lineage_parts WHERE session_id=%s ORDER BY seq", (session_id,))

    def save_lineage_parts(self, session_id: str, keep: int, rows: list[tuple[str, str, str]]) -> None:
        """Parts from ``keep`` on replaced by ``rows``, in one statement (its own transaction)."""
        end = keep + len(rows)
        if self._soon is not None and self._answer is None and self._conn is None:
            self._settle_soon()  # (a hold sent on the lock connection, where this goes: its answer first)
        self._cands.clear()  # what hold read of the candidates may miss these
        doc = _json.encode(rows)  # (see _SAVE_PARTS: UTF-8)
        if self._answer is not None:  # an answer's lineage: with its records (see answer)
            self._queue(("lineage", session_id, (keep, end, doc.decode())))
            return
        try:
            if self._conn is None:
                # the lock connection (the turns' own, on this thread: a statement of its own there as on a
                # pooled one): the turn's commit went there too, so a pooled connection's check-out and
                # return, run cold after the answer, would cost more than the turn saved by it; sent
                # through libpq as the turn's statements are (see _HOLD)
                try:
                    self._lock_connection()  # (the unlock's answer read first, when it is on its way)
                    self.round_trips += 1
                    enc = self._lock_enc
                    pgconn = self._lock_conn.pgconn
                    if "\0" in session_id:
                        raise ValueError(_NUL)
                    params = [str(session_id).encode(enc), str(end).encode(enc), str(keep).encode(enc),
                              doc if enc == "utf-8" else doc.decode().encode(enc)]
                    result = (pgconn.exec_prepared(b"bili_save_parts", params) if self._lock_prep
                              else pgconn.exec_params(_SAVE_PARTS, params))
                    if result.status != _COMMAND_OK:
                        _failed(pgconn, result, enc)
                except psycopg.Error:
                    if self._lock_conn is not None and self._lock_conn.closed:
                        self._drop_lock_conn()  # lost (the next hold opens another)
                    raise
            else:
                with self._use() as conn:
                    self.round_trips += 1
                    conn.execute(_SAVE_PARTS_PG, {"s": session_id, "end": end, "keep": keep, "rows": doc.decode()})
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("write", self.url, e) from e
        self.writes += 1

    @_reads
    def lineage_candidates(self, first_fp: str, lane: str) -> list[str]:
        got = self._cands.pop((first_fp, lane), None)  # read with the session's lock (hold)
        return got if got is not None else [r[0] for r in self._q(_CANDIDATES, (first_fp, lane))]

    @_reads
    def lineage_archived(self, first_fp: str, lane: str) -> list[tuple[str, str]]:
        got = self._cands.pop((_ARCHIVED, first_fp, lane), None)  # read with the session's lock (hold)
        return got if got is not None else [tuple(r) for r in self._q(_ARCHIVED, (first_fp, lane))]

    @_reads
    def family_next_ref(self, root: str) -> int:
        row = self._one("SELECT MAX(next_ref) FROM sessions WHERE id IN (SELECT session_id FROM lineage WHERE root=%s)",
                        (root,))
        return int(row[0]) if row and row[0] else 1

    @_reads
    def family(self, session_id: str) -> tuple[str, str, int, int] | None:
        if session_id in self._state:
            return self._state[session_id][1]
        row = self._one(
            "SELECT l.root, l.parent, l.fork_at, (SELECT MAX(s.next_ref) FROM sessions s JOIN lineage m "
            "ON m.session_id=s.id WHERE m.root=l.root) FROM lineage l WHERE l.session_id=%s", (session_id,))
        return (row[0], row[1], row[2], int(row[3] or 1)) if row else None

    def adopt(self, child: SessionRow, parent: str, root: str, fork_at: int, ledger: list[LedgerRow],
              blocks: list[tuple[str, str, bool]], originals: list[tuple], calls: list[tuple[str, str, str, str | None]],
              retired: list[tuple[str, str, str]] = (), *, expect: int) -> int:
        """As :meth:`bili_addon.store.Store.adopt`: one transaction, a versioned session write."""
        self._again(child.id)
        now = time.time()
        with self._tx() as conn:
            if parent not in self._held:
                # the parent's lock first (transaction-scoped, waited for as a turn's): a turn of the parent on
                # another instance may have sent refs of the family's counter whose write waits (write-behind:
                # it was in no family at its lock); the family's next refs are given after that write
                self.round_trips += 2
                conn.execute(f"SET LOCAL lock_timeout = {max(1, int(self.lock_wait * 1000))}")
                try:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.lock_key(parent),))
                except pg_errors.LockNotAvailable as e:
                    raise SessionBusy(parent, self.lock_wait) from e
            version = self._advance(conn, child.id, expect)
            self.round_trips += 1  # (its row shared-locked: a prune of the parent's family waits, or is seen)
            _not_pruned(child.id, parent, conn.execute("SELECT pruned, last_seen FROM sessions WHERE id=%s FOR SHARE",
                                                       (parent,)).fetchone(), expect)
            if retired:
                # the family's counter (its root's too: not in lineage before its first fork), its rows
                # locked: a commit of the family in progress is waited for, one after it waits for this
                self.round_trips += 1
                got = conn.execute("SELECT MAX(next_ref) FROM (SELECT next_ref FROM sessions WHERE id=%s OR id IN "
                                   "(SELECT session_id FROM lineage WHERE root=%s) FOR UPDATE) f", (root, root)).fetchone()
                retired_taken(child.id, retired, int(got[0]) if got and got[0] else 1, expect)
            # the child's own rows and refs the inherited ones replace, and its retired rows' new refs
            self.round_trips += 2
            led, given = rebase(
                conn.execute("SELECT seq, rows FROM ledger_turns WHERE session_id=%s", (child.id,)).fetchall(),
                conn.execute("SELECT seq, given FROM refs_turns WHERE session_id=%s", (child.id,)).fetchall(),
                ledger, retired)
            for table, col, docs in (("ledger_turns", "rows", led), ("refs_turns", "given", given)):
                for seq, (n, doc) in docs.items():
                    self.round_trips += 1
                    if n:
                        conn.execute(f"UPDATE {table} SET n=%s, {col}=%s WHERE session_id=%s AND seq=%s",
                                     (n, doc, child.id, seq))
                    else:
                        conn.execute(f"DELETE FROM {table} WHERE session_id=%s AND seq=%s", (child.id, seq))
            # the refs each name one text in the child from now on
            named = [(r.ref, r.content_hash) for r in ledger] + [(ref, chash) for _msg_id, chash, ref in retired]
            named = list(dict(named).items())
            rows = list({(r.msg_id, r.content_hash): r for r in ledger}.values())
            if named:
                self.round_trips += 1
                conn.execute("INSERT INTO refs_turns(session_id, seq, n, given) VALUES(%s,%s,%s,%s)",
                             (child.id, version, len(named), msgspec.json.encode(named).decode()))
            if rows:
                self.round_trips += 1
                conn.execute("INSERT INTO ledger_turns(session_id, seq, first_seen, n, rows) VALUES(%s,%s,%s,%s,%s)",
                             (child.id, version, now, len(rows), msgspec.json.encode(rows).decode()))
            self.round_trips += 3
            conn.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES(%s,%s,%s,%s,%s) "
                         "ON CONFLICT DO NOTHING", (root, "", root, 0, now))
            conn.execute("INSERT INTO lineage(session_id, parent, root, fork_at, created) VALUES(%s,%s,%s,%s,%s)",
                         (child.id, parent, root, fork_at, now))
            conn.execute(
                "INSERT INTO sessions(id, agent, lane, created, last_seen, next_ref, flags) VALUES(%s,%s,%s,%s,%s,%s,%s) "
                "ON CONFLICT(id) DO UPDATE SET next_ref=GREATEST(sessions.next_ref, excluded.next_ref), "
                "flags=excluded.flags",
                (child.id, child.agent, child.lane, child.created, now, child.next_ref, child.flags))
            self._many("INSERT INTO blocks(session_id, block_id, body, active) VALUES(%s,%s,%s,%s) "
                       "ON CONFLICT(session_id, block_id) DO UPDATE SET body=excluded.body, active=excluded.active",
                       [(child.id, bid, body, int(active)) for bid, body, active in blocks])
            self._many("INSERT INTO originals(session_id, ref, role, ctype, tool_name, tool_call_id, text, tokens) "
                       "VALUES(%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                       [(child.id, *_original_safe(o)) for o in originals])
            self._many("INSERT INTO calls(session_id, call_key, name, args, result, created, executed) "
                       "VALUES(%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                       [(child.id, k, n, _nul_safe(a), _nul_safe(r), now, now if r is not None else None)
                        for k, n, a, r in calls])
        return version

    @_reads
    def affinity_points(self, hashes: list[str]) -> dict[str, list[tuple[str, int]]]:
        out: dict[str, list[tuple[str, int]]] = {}
        if not hashes:
            return out
        rows = self._q("SELECT p.hash, p.session_id, p.depth FROM affinity_points p LEFT JOIN affinity a "
                       "ON a.session_id=p.session_id WHERE p.hash = ANY(%s) ORDER BY a.last_seen DESC NULLS LAST",
                       (list(hashes),))
        for h, sid, depth in rows:
            out.setdefault(h, []).append((sid, depth))
        return out

    def add_affinity_points(self, session_id: str, points: list[tuple[int, str]]) -> None:
        if points:
            with self._tx():
                self._many("INSERT INTO affinity_points(hash, session_id, depth) VALUES(%s,%s,%s) ON CONFLICT DO NOTHING",
                           [(h, session_id, d) for d, h in points])

    # -- copying a whole store (bili store migrate) ----------------------------------------------
    def dump(self, table: str, cols: tuple[str, ...], key: tuple[str, ...]) -> list[tuple]:
        order = ", ".join(f'{k} COLLATE "C"' if k not in ("n", "seq") else k for k in key)
        rows = self._q(f"SELECT {', '.join(cols)} FROM {table} ORDER BY {order}")
        texts = [cols.index(c) for c in _NUL_COLS.get(table, ())]
        return [tuple(bytes(v) if isinstance(v, memoryview) else _nul_back(v) if i in texts else v
                      for i, v in enumerate(r)) for r in rows]

    def load(self, table: str, cols: tuple[str, ...], rows: list[tuple]) -> None:
        texts = [cols.index(c) for c in _NUL_COLS.get(table, ())]
        if texts:
            rows = [tuple(_nul_safe(v) if i in texts else v for i, v in enumerate(r)) for r in rows]
        with self._tx():
            self._many(f"INSERT INTO {table}({', '.join(cols)}) VALUES({', '.join(['%s'] * len(cols))})", rows)

    def clear(self, tables) -> None:
        with self._tx() as conn:
            for table in tables:
                conn.execute(f"DELETE FROM {table}")

    def is_empty(self) -> bool:
        return self._one("SELECT COUNT(*) FROM sessions")[0] == 0

    # -- retention (schema 8): as the SQLite store's, with the sessions' locks of the instances --
    @_reads
    def idle_sessions(self, before: float) -> list[tuple[str, float]]:
        return self._q("SELECT id, last_seen FROM sessions WHERE last_seen < %s AND pruned < last_seen "
                       "ORDER BY last_seen", (before,))

    def _pointing(self, rids: list[str]) -> list[tuple[str, str, str]]:
        if not rids:
            return []
        return self._q("SELECT id, agent_base, sent_base FROM chains WHERE agent_base = ANY(%(r)s) UNION "
                       "SELECT id, agent_base, sent_base FROM chains WHERE sent_base = ANY(%(r)s)", {"r": rids})

    def prune(self, sids: list[str], before: float, *, dry_run: bool = False) -> dict[str, int] | None:
        """As :meth:`bili_addon.store.Store.prune`.  Several instances: the transaction first takes
        every session's lock (the one :meth:`hold` takes for a turn) without waiting; one that another
        instance holds (it is serving the session) leaves the whole family alone (None).  The rows
        of the sessions are locked too, so a turn committed meanwhile is seen by the check."""
        sids = list(dict.fromkeys(sids))
        if not sids:
            return None
        if self._unlocking and not dry_run:
            # this instance's own last turn let its sessions go without waiting for the answer: read it
            # first, or the try below may find this instance's own lock not yet let go
            self._unlocked()
        try:
            with (self.snapshot() if dry_run else self._tx()):
                if not dry_run and not self._one("SELECT bool_and(pg_try_advisory_xact_lock(k)) FROM "
                                                 "unnest(%s::bigint[]) AS k", ([self.lock_key(x) for x in sids],))[0]:
                    return None
                rows = self._q("SELECT id, last_seen, pruned, next_ref, flags FROM sessions WHERE id = ANY(%s)"
                               + ("" if dry_run else " FOR UPDATE"), (sids,))
                if any(r[1] >= before for r in rows) or not any(r[2] < r[1] for r in rows):
                    return None  # seen meanwhile, or pruned already
                # (an adoption into the family takes the parent's row FOR SHARE: it waited for the rows
                # locked above, or committed before them and is read here)
                if not set(sids).issuperset(r[0] for r in self._q(
                        "SELECT session_id FROM lineage WHERE root IN (SELECT root FROM lineage WHERE "
                        "session_id = ANY(%s))", (sids,))):
                    return None  # the family grew meanwhile (a fork of it): a family is pruned whole or not at all
                counts = {"sessions": sum(1 for r in rows if r[2] < r[1])}
                cands = {r[0]: (r[1], r[2]) for r in self._q(
                    "SELECT id, agent_base, sent_base FROM chains WHERE session_id = ANY(%s)", (sids,))}
                dead = dead_chains(cands, self._pointing(list(cands)))
                for t in HANGING:
                    if dry_run:
                        n = int(self._one(f"SELECT COUNT(*) FROM {t} WHERE session_id = ANY(%s)", (sids,))[0])
                    else:
                        with self._use() as conn:
                            self.round_trips += 1
                            n = conn.execute(f"DELETE FROM {t} WHERE session_id = ANY(%s)", (sids,)).rowcount
                    if n:
                        counts[t] = n
                # the lineage records of the epochs their compactions ended, under keys of their own
                keys = [k for r in rows for k in archived_records(r[0], r[4])]
                if keys:
                    if dry_run:
                        n = int(self._one("SELECT COUNT(*) FROM lineage_parts WHERE session_id = ANY(%s)", (keys,))[0])
                    else:
                        with self._use() as conn:
                            self.round_trips += 1
                            n = conn.execute("DELETE FROM lineage_parts WHERE session_id = ANY(%s)", (keys,)).rowcount
                    if n:
                        counts["lineage_parts"] = counts.get("lineage_parts", 0) + n
                if dead:
                    counts["chains"] = len(dead)
                    if not dry_run:
                        self._q("DELETE FROM chains WHERE id = ANY(%s)", (dead,))
                if not dry_run:
                    top = max(r[3] for r in rows)  # a family shares one counter: each keeps the family's
                    now = time.time()
                    self._many("UPDATE sessions SET pruned=%s, next_ref=%s, flags=%s, version=version+1 WHERE id=%s",
                               [(max(now, r[1]), max(top, r[3]), tombstone_flags(r[4]), r[0]) for r in rows])
        except (psycopg.Error, PoolTimeout) as e:
            raise pg_error("prune", self.url, e) from e
        return counts

    def trim(self, limit: int, stored_before: float, unstored_before: float,
             after: str = "") -> tuple[dict[str, int], list[str], str]:
        """As :meth:`bili_addon.store.Store.trim`."""
        out: dict[str, int] = {}
        dead: list[str] = []
        with self._tx() as conn:
            self.round_trips += 2
            n = conn.execute(
                "DELETE FROM turns WHERE (session_id, n) IN (SELECT t.session_id, t.n FROM turns t "
                "WHERE t.n < (SELECT MAX(m.n) FROM turns m WHERE m.session_id=t.session_id) LIMIT %s)",
                (limit,)).rowcount
            if n:
                out["turns"] = n
            page = conn.execute(
                # the primary key's order (the database's collation: the comparison uses the same one)
                "SELECT id, agent_base, sent_base, stored, created FROM chains WHERE id > %s ORDER BY id LIMIT %s",
                (after, limit)).fetchall()
            cands = {r[0]: (r[1], r[2]) for r in page if r[4] < (stored_before if r[3] else unstored_before)}
            dead = dead_chains(cands, self._pointing(list(cands))) if cands else []
            if dead:
                self._q("DELETE FROM chains WHERE id = ANY(%s)", (dead,))
                out["chains"] = len(dead)
        return out, dead, page[-1][0] if len(page) == limit else ""

    def reclaim(self, pages: int = 0) -> int:
        """Nothing to do: PostgreSQL's autovacuum makes the space of removed rows reusable."""
        return 0

    @_reads
    def size(self) -> int:
        """Bytes bili's tables take (indexes and TOAST included)."""
        tables = ["meta", "sessions", "chains", *HANGING]
        return int(self._one("SELECT COALESCE(SUM(pg_total_relation_size(to_regclass(t))), 0) FROM unnest(%s::text[]) "
                             "AS t WHERE to_regclass(t) IS NOT NULL", (tables,))[0])
