"""Retention: what the store keeps, and for how long (schema 8).

Two kinds of removal, both off the requests' path, with the same rules on SQLite and PostgreSQL:

- **Trimming** rows that nothing can read any more, in live sessions too (automatic, a bounded
  pass on the store's worker at start-up and then every :data:`EVERY_TURNS` answered turns or
  :data:`EVERY_SECONDS`): the usage row of each answered turn but the session's newest (only the
  newest is ever read: ``last_usage``; the totals live in the session's row), and chain rows of
  server-side conversations (``previous_response_id``) made before the provider forgets them
  (:data:`CHAIN_DAYS`; ``store: false`` ones live on their connection only: :data:`UNSTORED_HOURS`)
  that no remaining row is based on (a row is rebuilt from its bases, so a live chain keeps its
  whole history).
- **Pruning** whole sessions not seen for a while (``bili store prune --older-than 30d``, and the
  proxy's ``bili_retention`` days): every row that hangs off them goes (ledger, refs, folds and
  their originals, calls, the canonical copy and transcript, wire and calibration figures, lineage,
  id-less points, chains), a family only as a whole (a fork inherits its parent's rows as of its
  parting point, and a new fork of any member reads them).  The ``sessions`` row stays as a
  tombstone: its ref counter (raised to its family's), the provider facts it learned and its
  usage totals, so a ref is never given twice even if the conversation comes back (it then starts
  cold: new refs, no folds).  Its version moves, so a process that still holds the session reloads it.

The tables, what reads them, and when their rows are dead (both backends):

==================  =======================================================  ================================
table               read by                                                  removed
==================  =======================================================  ================================
sessions            every turn (counter, flags, version), stats              never: a pruned one's tombstone
ledger_turns        session load (the whole ledger: a rewind brings old      with the session
                    keys back), adoption, ref_count
refs_turns          adoption (rebase), the ``refs`` view                     with the session
turns               the newest row only (last_usage, bili_hold)              trimmed: all but the newest
blocks, originals   session load, decompress, search, the page, adoption    with the session
calls               session load (a call runs once while in the history)     with the session
copies, transcript  the fold coverage check, snapshot render (only the       with the session
                    current rows exist: both are replaced, not appended)
wire                stats, the page, the meter (all rows, summed)            with the session
calibration         the learner (newest 64 per session and host), stats      with the session
                    (all rows: totals, the per-turn list)
lineage(_parts)     fork detection of any new session, the family counter    with the whole family
affinity(_points)   id-less sessions: which one a history continues          with the session
chains              a request continuing a chain (rebuilt through its        trimmed: past the provider's
                    bases)                                                   retention and no row's base
==================  =======================================================  ================================

Nothing is removed that a live session, a fork, decompress, search_context, replay or stats still
reads: a session seen since the cutoff is never pruned (checked again in the pruning transaction),
and on PostgreSQL a session another instance is serving (it holds the session's lock) leaves its
whole family alone until a later pass.  One race is left, in the cheap direction: a chain row
another instance bases a new row on in the very moment it is trimmed (a response older than the
provider keeps it, continued after all) leaves that new row without its base, so a request
continuing it passes through observed; nothing is ever rebuilt wrong.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("bili")

DAY = 86400.0
DEFAULT_DAYS = 30  # bili_retention's default (Claude Code's own transcripts: 30 days; OpenAI's stored responses: 30)
CHAIN_DAYS = 30  # how long OpenAI keeps a stored response (a ``previous_response_id`` older than that is gone)
UNSTORED_HOURS = 24  # a ``store: false`` response lives on its connection only; no connection lasts a day
TRIM_ROWS = 500  # rows of each kind one trim pass removes at most
PRUNE_FAMILIES = 5  # families one background pass prunes at most (more: the next answered turn queues another)
RECLAIM_PAGES = 256  # SQLite pages (4 KB) a background pass gives back to the file system at most
EVERY_TURNS = 200  # answered turns between two background passes ...
EVERY_SECONDS = 6 * 3600.0  # ... or this long, whichever comes first

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY, "w": 7 * DAY, "": DAY}


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s`` (a bare number: days) in seconds."""
    m = _AGE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not an age: write it like 30d, 12h, 90m or 2w")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass
class Report:
    """What a prune did (or, dry, would do)."""

    removed: list[list[str]] = field(default_factory=list)  # the families (or lone sessions) pruned
    skipped: list[list[str]] = field(default_factory=list)  # busy in another instance, or seen meanwhile
    rows: dict[str, int] = field(default_factory=dict)  # rows per table
    more: bool = False  # stopped at its limit: more idle sessions wait for the next pass

    def add(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self.rows[k] = self.rows.get(k, 0) + v


def idle_families(store: Any, before: float) -> list[list[str]]:
    """The sessions not seen since ``before`` and not pruned yet, grouped by family (a family only
    when every member is that idle), the longest idle first."""
    idle = dict(store.idle_sessions(before))
    if not idle:
        return []
    root_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for sid, _parent, root, _at in store.lineage():
        root_of[sid] = root
        members.setdefault(root, []).append(sid)
    out: list[list[str]] = []
    seen: set[str] = set()
    for sid in idle:
        if sid in seen:
            continue
        root = root_of.get(sid)
        family = members[root] if root is not None else [sid]
        seen.update(family)
        if all(m in idle or _idle(store, m, before) for m in family):
            out.append(family)
    return out


def _idle(store: Any, sid: str, before: float) -> bool:
    row = store.session(sid)
    return row is None or row.last_seen < before


def prune(store: Any, older_than: float, *, now: float | None = None, dry_run: bool = False,
          limit: int = 0) -> Report:
    """Prune (``dry_run``: count) every session not seen for ``older_than`` seconds, by family;
    ``limit``: at most so many families."""
    before = (time.time() if now is None else now) - older_than
    rep = Report()
    families = idle_families(store, before)
    if limit and len(families) > limit:
        families, rep.more = families[:limit], True
    for family in families:
        counts = store.prune(family, before, dry_run=dry_run)
        if counts is None:
            rep.skipped.append(family)
        else:
            rep.removed.append(family)
            rep.add(counts)
    return rep


def trim(store: Any, *, now: float | None = None, limit: int = TRIM_ROWS,
         after: str = "") -> tuple[dict[str, int], list[str], str]:
    """One bounded trim pass: ``(rows removed per table, the chain ids removed, where the next pass
    goes on)``."""
    now = time.time() if now is None else now
    return store.trim(limit, now - CHAIN_DAYS * DAY, now - UNSTORED_HOURS * 3600.0, after)


def forget(eng: Any, sessions: list[str] = (), chain_ids: list[str] = ()) -> None:
    """What this process holds in memory of pruned sessions and removed chain rows (the store is
    the truth: a session comes back from its tombstone, cold)."""
    for sid in sessions:
        eng.sessions.forget(sid)
        eng.lineage.forget(sid)
        eng.calibration.sessions.pop(sid, None)
    eng.chains.forget(sessions, chain_ids)


class Maintainer:
    """When the proxy trims and prunes: one bounded pass at a time, submitted to the store's worker
    (:meth:`Keeper.submit <bili_addon.keeper.Keeper.submit>`) at start-up and after every
    :data:`EVERY_TURNS` answered turns or :data:`EVERY_SECONDS`; never inside a request's or an
    answer's own work, and never inline (outside mitmproxy's loop nothing is submitted)."""

    def __init__(self, keeper: Any):
        self.keeper = keeper
        self.days = float(DEFAULT_DAYS)  # bili_retention (0: sessions are kept forever; trimming goes on)
        self.turns = 0
        self.due = 0.0  # monotonic time of the next pass
        self.after = ""  # where the next pass goes on among the chain rows
        self.passes = 0
        self.last: dict[str, Any] = {}  # the last pass's figures (stats)

    def start(self) -> None:
        self._submit()

    def answered(self) -> None:
        """An answered turn (called on the worker, inside the answer's work: only counts, and
        submits the pass to run after that work)."""
        self.turns += 1
        if self.turns >= EVERY_TURNS or time.monotonic() >= self.due:
            self._submit()

    def _submit(self) -> None:
        if not self.keeper.offloading:
            return
        self.turns, self.due = 0, time.monotonic() + EVERY_SECONDS
        self.keeper.submit(self.run, None)  # a pass that cannot run loses nothing: the next one does it

    def run(self, eng: Any) -> dict[str, Any]:
        """One pass (on the worker)."""
        t = time.perf_counter()
        rows, dead, self.after = trim(eng.store, after=self.after)
        forget(eng, chain_ids=dead)
        if rows.get("turns", 0) >= TRIM_ROWS:  # a backlog (a store from before schema 8): again after the next turn
            self.due = 0.0
        out: dict[str, Any] = {"trimmed": rows}
        if self.days > 0:
            rep = prune(eng.store, self.days * DAY, limit=PRUNE_FAMILIES)
            forget(eng, sessions=[s for fam in rep.removed for s in fam])
            out.update(pruned=sum(map(len, rep.removed)), pruned_rows=rep.rows, busy=len(rep.skipped))
            if rep.more:  # a backlog (a store that never pruned): one pass after each answered turn until done
                self.due = 0.0
            if rep.removed:
                log.info("[bili] retention: pruned %d session(s) not seen for %g day(s) (%d rows)",
                         out["pruned"], self.days, sum(rep.rows.values()))
        out["reclaimed_bytes"] = eng.store.reclaim(RECLAIM_PAGES)
        out["ms"] = round((time.perf_counter() - t) * 1000, 3)
        if rows:
            log.debug("[bili] retention: trimmed %s", rows)
        self.passes += 1
        self.last = out
        return out


__all__ = ["CHAIN_DAYS", "DEFAULT_DAYS", "Maintainer", "Report", "UNSTORED_HOURS", "forget", "idle_families",
           "parse_age", "prune", "trim"]
