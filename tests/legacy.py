"""Stores as an older bili left them: the ledger and the refs one row per part (schema 6 and before).

:func:`to_schema_6` turns a store of either backend into that layout in place, with the rows it
held (read through the ``ledger`` and ``refs`` views of schema 7, ``first_seen`` included), or
with the rows a test gives; opening the store again migrates it (schema 7).
"""

from __future__ import annotations

# the tables of one row per part as schema 6 created them (store.py / store_pg.py of that schema)
SQLITE_V6 = """
CREATE TABLE ledger(
    session_id TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    ref TEXT NOT NULL,
    role TEXT NOT NULL,
    ctype TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    first_seen REAL NOT NULL,
    PRIMARY KEY(session_id, msg_id, content_hash)
) WITHOUT ROWID;
CREATE TABLE refs(
    session_id TEXT NOT NULL,
    ref TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY(session_id, ref)
) WITHOUT ROWID;
"""
PG_V6 = [
    """CREATE TABLE ledger(
        session_id TEXT NOT NULL,
        msg_id TEXT NOT NULL,
        content_hash TEXT NOT NULL,
        ref TEXT NOT NULL,
        role TEXT NOT NULL,
        ctype TEXT NOT NULL,
        tokens BIGINT NOT NULL,
        first_seen DOUBLE PRECISION NOT NULL,
        PRIMARY KEY(session_id, msg_id, content_hash))""",
    """CREATE TABLE refs(
        session_id TEXT NOT NULL,
        ref TEXT NOT NULL,
        content_hash TEXT NOT NULL,
        PRIMARY KEY(session_id, ref))""",
]

LEDGER_COLS = "session_id, msg_id, content_hash, ref, role, ctype, tokens, first_seen"


def rows_of(store) -> tuple[list[tuple], list[tuple]]:
    """Every row of the ``ledger`` and ``refs`` (tables or views), sorted."""
    q = store.db.execute if store.backend == "sqlite" else store._q
    ledger = [tuple(r) for r in q(f"SELECT {LEDGER_COLS} FROM ledger")]
    refs = [tuple(r) for r in q("SELECT session_id, ref, content_hash FROM refs")]
    return sorted(ledger), sorted(refs)


def to_schema_6(store, version: int = 6, ledger: list[tuple] | None = None, refs: list[tuple] | None = None) -> None:
    """The store (of schema 7) as bili of ``version`` (<= 6) left it: ledger and refs one row per
    part, holding the rows it holds now (or ``ledger`` / ``refs``: ``LEDGER_COLS`` tuples and
    ``(session_id, ref, content_hash)``), ``meta.schema_version`` set back.  The store is closed."""
    have_ledger, have_refs = rows_of(store)
    ledger = have_ledger if ledger is None else ledger
    refs = have_refs if refs is None else refs
    if store.backend == "sqlite":
        db = store.db
        db.execute("BEGIN")
        db.execute("DROP VIEW ledger")
        db.execute("DROP VIEW refs")
        db.execute("DROP TABLE ledger_turns")
        db.execute("DROP TABLE refs_turns")
        for stmt in SQLITE_V6.split(";"):
            if stmt.strip():
                db.execute(stmt)
        db.executemany("INSERT INTO ledger VALUES(?,?,?,?,?,?,?,?)", ledger)
        db.executemany("INSERT INTO refs VALUES(?,?,?)", refs)
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))
        db.execute("COMMIT")
    else:
        with store.pool.connection() as conn, conn.transaction():
            for stmt in ("DROP VIEW ledger", "DROP VIEW refs", "DROP TABLE ledger_turns", "DROP TABLE refs_turns",
                         *PG_V6):
                conn.execute(stmt)
            with conn.cursor() as cur:
                if ledger:
                    cur.executemany("INSERT INTO ledger VALUES(%s,%s,%s,%s,%s,%s,%s,%s)", ledger)
                if refs:
                    cur.executemany("INSERT INTO refs VALUES(%s,%s,%s)", refs)
            conn.execute("UPDATE meta SET value=%s WHERE key='schema_version'", (str(version),))
    store.close()
