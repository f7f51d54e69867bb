"""Choosing a store: the embedded SQLite file (the default) or a shared PostgreSQL database.

``bili_store`` (``--set bili_store=...``, ``$BILI_STORE``, ``bili run --store``) names it: empty
for SQLite under ``bili_data_dir``, ``postgresql://user@host/db`` for a team gateway.  The kernel
uses a store only through the methods of :class:`StoreProtocol`; both backends implement them with
the same rules (refs allocated in the turn's transaction, a per-session version on every write).
"""

from __future__ import annotations

import os
from typing import Mapping, Protocol, runtime_checkable

from bili_addon.store import LedgerRow, SessionRow, Store, StoreError, UsageTotals, WireTurn

URL_SCHEMES = ("postgresql://", "postgres://")

# every table a store holds, its columns and its primary key (``bili store migrate`` copies them)
TABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sessions": (("id", "agent", "lane", "created", "last_seen", "requests", "messages", "next_ref", "flags",
                  "input_tokens", "cache_read", "cache_write", "output_tokens", "turns", "version"), ("id",)),
    "ledger": (("session_id", "msg_id", "content_hash", "ref", "role", "ctype", "tokens", "first_seen"),
               ("session_id", "msg_id", "content_hash")),
    "refs": (("session_id", "ref", "content_hash"), ("session_id", "ref")),
    "affinity": (("session_id", "depth", "tail", "last_seen"), ("session_id",)),
    "turns": (("session_id", "n", "ts", "lane", "input_tokens", "cache_read", "cache_write", "output_tokens"),
              ("session_id", "n")),
    "blocks": (("session_id", "block_id", "body", "active"), ("session_id", "block_id")),
    "originals": (("session_id", "ref", "role", "ctype", "tool_name", "tool_call_id", "text", "tokens"),
                  ("session_id", "ref")),
    "transcript": (("session_id", "seq", "sig", "refs", "item"), ("session_id", "seq")),
    "wire": (("session_id", "n", "ts", "request", "model", "agent_tokens", "sent_tokens", "predicted", "blocks",
              "folded", "executed", "input_tokens", "cache_read", "cache_write", "output_tokens"), ("session_id", "n")),
    "copies": (("session_id", "doc"), ("session_id",)),
    "lineage": (("session_id", "parent", "root", "fork_at", "created"), ("session_id",)),
    "lineage_parts": (("session_id", "seq", "ref", "chash", "fp"), ("session_id", "seq")),
    "affinity_points": (("hash", "session_id", "depth"), ("hash", "session_id")),
    "calls": (("session_id", "call_key", "name", "args", "result", "created", "executed"),
              ("session_id", "call_key")),
}


@runtime_checkable
class StoreProtocol(Protocol):
    """What the kernel, the shell and the CLI use of a store."""

    backend: str
    path: object  # the local data dir's store path (exports live beside it)
    writes: int
    tightened: list[str]

    @property
    def where(self) -> str: ...
    def close(self) -> None: ...
    def snapshot(self): ...
    def schema_version(self) -> int: ...
    def ping(self) -> float: ...
    def version(self, session_id: str) -> int: ...
    def session(self, session_id: str) -> SessionRow | None: ...
    def sessions(self) -> list[SessionRow]: ...
    def ledger(self, session_id: str) -> list[LedgerRow]: ...
    def ref_count(self, session_id: str) -> int: ...
    def usage(self, session_id: str) -> UsageTotals: ...
    def last_usage(self, session_id: str) -> tuple[int, int, int, int] | None: ...
    def affinity(self) -> list[tuple[str, int, str]]: ...
    def affinity_of(self, tails: list[str]) -> list[tuple[str, int, str]]: ...
    def commit_turn(self, row: SessionRow, new_refs: list[LedgerRow], chain=None, *, expect: int,
                    minted: list[tuple[str, str]] = ()) -> int: ...
    def set_flags(self, row: SessionRow, *, expect: int) -> int: ...
    def record_usage(self, session_id: str, lane: str, usage: tuple[int, int, int, int]) -> None: ...
    def record_wire(self, session_id: str, row: WireTurn) -> int: ...
    def wire_totals(self, session_id: str) -> tuple[int, WireTurn | None, int, int, list[tuple]]: ...
    def wire(self, session_id: str) -> list[WireTurn]: ...
    def blocks(self, session_id: str) -> list[str]: ...
    def originals(self, session_id: str, refs: list[str] | None = None) -> list[tuple]: ...
    def calls(self, session_id: str) -> list[tuple[str, str, str, str | None]]: ...
    def record_calls(self, session_id: str, calls: list[tuple[str, str, str]], *, expect: int) -> int: ...
    def commit_fold(self, session_id: str, blocks, originals, results, *, expect: int) -> int: ...
    def copy(self, session_id: str) -> str | None: ...
    def save_copy(self, session_id: str, doc: str, *, expect: int) -> int: ...
    def transcript(self, session_id: str) -> list[tuple[str, list[str], bytes]]: ...
    def save_transcript(self, session_id: str, keep: int, rows, *, expect: int) -> int: ...
    def lineage(self) -> list[tuple[str, str, str, int]]: ...
    def lineage_parts(self, session_id: str) -> list[tuple[str, str, str]]: ...
    def save_lineage_parts(self, session_id: str, keep: int, rows: list[tuple[str, str, str]]) -> None: ...
    def lineage_candidates(self, first_fp: str, lane: str) -> list[str]: ...
    def family_next_ref(self, root: str) -> int: ...
    def family(self, session_id: str) -> tuple[str, str, int, int] | None: ...
    def adopt(self, child: SessionRow, parent: str, root: str, fork_at: int, ledger, blocks, originals, calls,
              retired=(), *, expect: int) -> int: ...
    def affinity_points(self, hashes: list[str]) -> dict[str, list[tuple[str, int]]]: ...
    def add_affinity_points(self, session_id: str, points: list[tuple[int, str]]) -> None: ...
    def dump(self, table: str, cols: tuple[str, ...], key: tuple[str, ...]) -> list[tuple]: ...
    def load(self, table: str, cols: tuple[str, ...], rows: list[tuple]) -> None: ...
    def is_empty(self) -> bool: ...


def is_url(spec: str | None) -> bool:
    return bool(spec) and spec.strip().lower().startswith(URL_SCHEMES)


def store_spec(option: str = "", env: Mapping[str, str] | None = None) -> str:
    """The chosen store: the option, else ``$BILI_STORE``, else '' (SQLite in the data dir)."""
    env = os.environ if env is None else env
    return (option or env.get("BILI_STORE", "")).strip()


def open_store(spec: str, data_dir: str) -> StoreProtocol:
    """The store ``spec`` names (a ``postgresql://`` URL or a data dir; '' is ``data_dir``'s SQLite)."""
    if is_url(spec):
        from bili_addon.store_pg import PgStore  # only with the postgres extra

        return PgStore(spec, data_dir)
    if spec and "://" in spec:
        raise StoreError(f"unknown store {spec!r}: use a postgresql:// URL or a directory", "cannot open",
                         "bili_store takes postgresql://user@host/db (empty: SQLite in the data dir)")
    return Store(spec or data_dir)


def describe(spec: str, data_dir: str) -> str:
    if is_url(spec):
        from bili_addon.store_pg import redact

        return redact(spec)
    return str(spec or data_dir)


def copy_store(src: StoreProtocol, dst: StoreProtocol) -> dict[str, int]:
    """Every row of ``src`` into ``dst`` (which must be empty); returns the rows copied per table."""
    if not dst.is_empty():
        raise StoreError(f"the target store {dst.where} already holds conversations; migrate into an empty one",
                         "error", "choose an empty database or data dir")
    if src.schema_version() != dst.schema_version():
        raise StoreError(f"schema versions differ ({src.schema_version()} vs {dst.schema_version()})")
    counts = {}
    for table, (cols, key) in TABLES.items():
        rows = src.dump(table, cols, key)
        dst.load(table, cols, rows)
        counts[table] = len(rows)
    return counts
