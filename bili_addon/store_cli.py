"""``bili store``: what a store holds, and copying one into another.

    bili store info [--store URL|DIR] [--data-dir DIR]
    bili store migrate --to URL|DIR [--from URL|DIR] [--data-dir DIR]

A store is named as for ``bili run --store``: a ``postgresql://`` URL, or a directory holding
``bili.sqlite3``; without ``--from`` the source is ``$BILI_STORE``, else ``--data-dir``'s (or the
default data dir's) SQLite store.  The target must hold no conversation yet; every table is copied
row for row (refs, folds, originals, calls, usage, lineage), then the two are compared.
"""

from __future__ import annotations

import argparse
import json
import sys

from bili_addon.store import StoreError, default_data_dir
from bili_addon.stores import TABLES, copy_store, describe, open_store, store_spec


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


def run(args: argparse.Namespace) -> int:
    data_dir = str(args.data_dir or default_data_dir())
    try:
        if args.store_command == "info":
            return _info(store_spec(args.store or ""), data_dir, args.json)
        return _migrate(store_spec(args.source or ""), args.to, data_dir)
    except StoreError as e:
        print(f"bili: error: {e}" + (f" ({e.hint})" if e.hint else ""), file=sys.stderr)
        return 1


def _info(spec: str, data_dir: str, as_json: bool) -> int:
    s = open_store(spec, data_dir)
    try:
        doc = {"backend": s.backend, "at": s.where, "schema_version": s.schema_version(),
               "conversations": len(s.sessions()), "latency_ms": round(s.ping() * 1000, 3)}
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
