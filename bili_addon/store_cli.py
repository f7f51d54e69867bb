"""``bili store``: what a store holds, and copying one into another.

    bili store info [--store URL|DIR] [--data-dir DIR]
    bili store migrate --to URL|DIR [--from URL|DIR] [--data-dir DIR]
    bili store prune --older-than 30d [--dry-run] [--store URL|DIR] [--data-dir DIR] [--json]

A store is named as for ``bili run --store``: a ``postgresql://`` URL, or a directory holding
``bili.sqlite3``; without ``--from`` the source is ``$BILI_STORE``, else ``--data-dir``'s (or the
default data dir's) SQLite store.  The target must hold no conversation yet; every table is copied
row for row (refs, folds, originals, calls, usage, lineage), then the two are compared.

``prune`` removes the conversations not seen for the given age (a family only when all of it is
that idle): every row of theirs but a tombstone keeping the ref counter (bili_addon/retention.py),
then VACUUMs a SQLite store.  Safe while proxies run: a session seen since the cutoff, or (on
PostgreSQL) one another instance is serving, is left alone.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path

from bili_addon import retention
from bili_addon.store import DB_NAME, SCHEMA_VERSION, StoreError, default_data_dir
from bili_addon.stores import TABLES, copy_store, describe, is_url, open_store, store_spec


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="the backend, schema version and size of a store")
    info.add_argument("--store", metavar="URL|DIR", help="the store (default: $BILI_STORE, else the data dir)")
    info.add_argument("--data-dir", metavar="DIR", help="the data dir (default: $XDG_DATA_HOME/bili-addon)")
    info.add_argument("--json", action="store_true")
    mig = sub.add_parser("migrate", help="copy a store into another (SQLite <-> PostgreSQL), nothing lost",
                         description="Copy every row of a store into an empty one (a postgresql:// URL or a "
                                     "directory for SQLite) and verify the copy. Stop the proxies first.")
    mig.add_argument("--to", required=True, metavar="URL|DIR", help="the target store (must be empty)")
    mig.add_argument("--from", dest="source", metavar="URL|DIR",
                     help="the source store (default: $BILI_STORE, else the data dir's SQLite store)")
    mig.add_argument("--data-dir", metavar="DIR", help="the data dir (default: $XDG_DATA_HOME/bili-addon)")
    pr = sub.add_parser("prune", help="remove the conversations not seen for a while (whole families)",
                        description="Remove every row of the conversations not seen for --older-than (a fork's "
                                    "family only when all of it is that idle); each keeps a tombstone with its ref "
                                    "counter, so no ref is ever given twice. A SQLite store is VACUUMed afterwards. "
                                    "Safe while proxies run.")
    pr.add_argument("--older-than", required=True, metavar="AGE", type=_age,
                    help="not seen for this long: 30d, 12h, 2w (a bare number: days)")
    pr.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    pr.add_argument("--no-vacuum", action="store_true", help="do not VACUUM a SQLite store afterwards")
    pr.add_argument("--store", metavar="URL|DIR", help="the store (default: $BILI_STORE, else the data dir)")
    pr.add_argument("--data-dir", metavar="DIR", help="the data dir (default: $XDG_DATA_HOME/bili-addon)")
    pr.add_argument("--json", action="store_true")


def _age(text: str) -> float:
    try:
        return retention.parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def run(args: argparse.Namespace) -> int:
    data_dir = str(args.data_dir or default_data_dir())
    try:
        if args.store_command == "info":
            return _info(_existing(store_spec(args.store or ""), data_dir), data_dir, args.json)
        if args.store_command == "prune":
            return _prune(_existing(store_spec(args.store or ""), data_dir), data_dir, args)
        return _migrate(_existing(store_spec(args.source or ""), data_dir), args.to, data_dir)
    except StoreError as e:
        print(f"bili: error: {e}" + (f" ({e.hint})" if e.hint else ""), file=sys.stderr)
        return 1


def _existing(spec: str, data_dir: str) -> str:
    """``spec``, when it names a store that exists: a data dir without one (a mistyped --data-dir)
    would have been given a new, empty store, and a dry run, a listing or a copy read from nothing."""
    if not is_url(spec) and not (Path(spec or data_dir) / DB_NAME).exists():
        raise StoreError(f"no bili store in {spec or data_dir} ({DB_NAME} is not there)", "error",
                         "check --data-dir, --store or --from, and $BILI_STORE")
    return spec


def _schema_of(spec: str, data_dir: str) -> int:
    """The store's schema version, read without opening it as bili does (which migrates an older one)."""
    try:
        if is_url(spec):
            from bili_addon.store_pg import schema_of  # (only with the postgres extra)

            return schema_of(spec)
        path = (Path(spec or data_dir) / DB_NAME).resolve()
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
                return 0
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        finally:
            db.close()
    except Exception as e:  # (psycopg.Error, sqlite3.Error): unreadable is said as the open would say it
        raise StoreError(f"cannot read the store {describe(spec, data_dir)}: {e}", "error") from e
    return int(row[0]) if row else 0


def _info(spec: str, data_dir: str, as_json: bool) -> int:
    s = open_store(spec, data_dir)
    try:
        doc = {"backend": s.backend, "at": s.where, "schema_version": s.schema_version(),
               "conversations": len(s.sessions()), "size_bytes": s.size(), "latency_ms": round(s.ping() * 1000, 3)}
    finally:
        s.close()
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        for k, v in doc.items():
            print(f"{k:15} {v}")
    return 0


def _migrate(source: str, target: str, data_dir: str) -> int:
    if describe(source, data_dir) == describe(target, data_dir):
        print("bili: error: --to names the source store itself", file=sys.stderr)
        return 2
    src = open_store(source, data_dir)
    try:
        dst = open_store(target, data_dir)
        try:
            counts = copy_store(src, dst)
            differ = [t for t, (cols, key) in TABLES.items() if src.dump(t, cols, key) != dst.dump(t, cols, key)]
        finally:
            dst.close()
    finally:
        src.close()
    if differ:
        print(f"bili: error: the copy differs from the source in: {', '.join(differ)}", file=sys.stderr)
        return 1
    total = sum(counts.values())
    print(f"copied {src.where} ({src.backend}) -> {dst.where} ({dst.backend}): {counts.get('sessions', 0)} "
          f"conversation(s), {total} rows; verified equal")
    return 0


def _prune(spec: str, data_dir: str, args: argparse.Namespace) -> int:
    if args.dry_run:
        have = _schema_of(spec, data_dir)
        if have < SCHEMA_VERSION:  # (opening it would migrate it: a write)
            raise StoreError(f"the store {describe(spec, data_dir)} has schema {have}, older than this bili's "
                             f"({SCHEMA_VERSION}); a dry run does not migrate it", "error",
                             "run bili once on it (or prune without --dry-run), then look again")
    s = open_store(spec, data_dir)
    try:
        seen = {r.id: r.last_seen for r in s.sessions()}
        size = s.size()
        rep = retention.prune(s, args.older_than, dry_run=args.dry_run)
        reclaimed, vacuum_error = 0, ""
        if rep.removed and not args.dry_run and not args.no_vacuum:
            try:
                reclaimed = s.reclaim()
            except StoreError as e:  # the prune is done; the space is reused anyway, and a later run shrinks it
                vacuum_error = str(e)
        where, backend = s.where, s.backend
    finally:
        s.close()
    sessions = [sid for fam in rep.removed for sid in fam if sid in seen]
    doc = {"store": where, "backend": backend, "dry_run": args.dry_run, "older_than_days": args.older_than / retention.DAY,
           "sessions": sessions, "families": [f for f in rep.removed if len(f) > 1], "rows": rep.rows,
           "skipped": [sid for fam in rep.skipped for sid in fam], "size_bytes": size, "reclaimed_bytes": reclaimed,
           "vacuum_error": vacuum_error or None}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{where} ({backend}): {verb} {len(sessions)} conversation(s) not seen for {args.older_than / retention.DAY:g} "
          f"day(s), {sum(rep.rows.values())} row(s)")
    for sid in sessions:
        print(f"  {sid}  last seen {time.strftime('%Y-%m-%d %H:%M', time.localtime(seen[sid]))}")
    for table, n in sorted(rep.rows.items()):
        print(f"  {table:16} {n}")
    if rep.skipped:
        print(f"left alone (seen meanwhile, or served by another instance): {', '.join(doc['skipped'])}")
    if vacuum_error:
        print(f"VACUUM skipped ({vacuum_error}); the freed space is reused, a later prune shrinks the file",
              file=sys.stderr)
    if reclaimed:
        print(f"VACUUM: the store shrank by {reclaimed / 1e6:.1f} MB (it was {size / 1e6:.1f} MB)")
    return 0
