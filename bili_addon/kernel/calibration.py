"""Calibration: the provider cache model (:mod:`bili_addon.kernel.cache`) checked against what the
provider reports, and corrected where the reports keep contradicting it.

Every answered request gives one observation: what the model predicted the request would read from
the cache (and write), for the body actually sent, and what the provider's usage said it read (and
wrote).  Observations are stored (table ``calibration``, one row per answered request) and judged
by :func:`learn`, per session and per host (every session that reaches a host pools its
observations there; new sessions start from what the host taught):

- **A shorter lifetime.**  A *miss* is a request the model expected to read (its entry was younger
  than the documented lifetime) for which the provider reported no read; its *age* is how long that
  entry had been unused.  A *hit* is a reported read; it proves entries live at least its age (so
  does a read the model did not expect, at the gap since the previous request).  Misses older than
  every hit are consistent with a lifetime shorter than theirs; at :data:`EVIDENCE` of them the
  lifetime is learned as the youngest such miss's age (the provider had dropped the entry by then).
  A miss younger than some hit was an eviction, not a lifetime: it teaches nothing.  One later hit
  older than the learned lifetime withdraws it.
- **No cache at all.**  :data:`EVIDENCE` misses of entries unused for at most :data:`SHORT` seconds
  and not one reported read: the provider keeps nothing (a single reported read withdraws it).
  Without hits but with older misses only, what is learned is a lifetime shorter than the youngest.
- **A larger minimum.**  Misses of young entries (no older than some hit) whose prefixes were all
  shorter than every prefix the provider did read: at :data:`EVIDENCE` of them, prefixes up to the
  longest of those are taken as too short to be cached there.

A session's own facts apply where its observations taught something; otherwise its host's do,
unless the session's own reports contradict them (a read older than the host's lifetime, any read
where the host has no cache, a read of a prefix under the host's minimum).  The facts are applied to the session's
clock (:meth:`Clock.apply <bili_addon.kernel.cache.Clock.apply>`), so every warm/cold judgement
(lazy activation, the lifetime decision, deferred rewrites) uses them; :meth:`Calibration.effective_ttl`
says the lifetime in force.  Learning is fail-safe in the cheap direction: a lifetime is only ever
shortened to an age at which the provider had really dropped an entry, so a learned fact can make
bili wait for a cold moment a little longer than needed, never rewrite a prefix that is still warm
by the evidence.
"""

from __future__ import annotations

import logging
from bisect import insort
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from operator import itemgetter
from time import monotonic as _now
from typing import TYPE_CHECKING, Any

from bili_addon import printable
from bili_addon.kernel.cache import Clock, Clocks, Turn
from bili_addon.store import CalibrationRow, StoreError

if TYPE_CHECKING:
    from bili_addon.store import Store

log = logging.getLogger("bili")
_TS = itemgetter(0)

EVIDENCE = 3  # consistent observations a learned fact needs
SHORT = 20.0  # seconds: an entry unused this briefly is still alive in any cache worth the name
KEEP = 64  # observations judged per session and per host (the newest)
# seconds a host's observations read from the store serve before they are read again (the other
# processes on the store add theirs); this process's own are added as it makes them
HOST_FRESH = 10.0
SESSIONS = 512  # sessions whose observations are kept in memory


@dataclass(frozen=True)
class Observation:
    predicted: int  # cache-read tokens the model predicted
    reported: int  # cache-read tokens the provider reported
    age: float | None  # predicted read: how long its entry had been unused; else the gap since the previous request

    @property
    def verdict(self) -> str:
        """``hit`` (both read), ``miss`` (predicted, not reported), ``extra`` (reported, not predicted),
        ``none`` (neither)."""
        if self.predicted > 0:
            return "hit" if self.reported > 0 else "miss"
        return "extra" if self.reported > 0 else "none"


def observation(row: CalibrationRow) -> Observation:
    return Observation(row.predicted_read, row.reported_read, row.age if row.predicted_read > 0 else row.gap)


@dataclass
class Facts:
    """What observations taught of a provider's cache (None / False: nothing; the documented rule holds)."""

    ttl: float | None = None  # a lifetime shorter than documented (seconds)
    no_cache: bool = False  # the provider keeps no cache at all
    min_tokens: int | None = None  # prefixes up to this many (model) tokens are not cached
    hits: int = 0
    misses: int = 0
    extra: int = 0
    agree: int = 0  # observations whose verdict (read or not) the provider confirmed

    @property
    def learned(self) -> bool:
        return bool(self.ttl or self.no_cache or self.min_tokens)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v not in (None, False)}
        if self.ttl:
            out["ttl"] = round(self.ttl, 1)
        return out


def learn(obs: list[Observation]) -> Facts:
    """The facts ``obs`` (oldest first) support by the evidence rules of this module's doc."""
    f = Facts()
    for o in obs:
        v = o.verdict
        f.hits += v == "hit"
        f.misses += v == "miss"
        f.extra += v == "extra"
        f.agree += v in ("hit", "none")
    hits = [o for o in obs if o.verdict in ("hit", "extra")]
    misses = [o for o in obs if o.verdict == "miss" and o.age is not None]
    oldest_hit = max((o.age for o in hits if o.age is not None), default=0.0)
    if not hits:
        if sum(1 for o in misses if o.age <= SHORT) >= EVIDENCE:
            f.no_cache = True
            return f
    lifetime = [o for o in misses if o.age > oldest_hit]
    if len(lifetime) >= EVIDENCE:
        f.ttl = min(o.age for o in lifetime)
    seen = [o.predicted for o in hits if o.predicted > 0]
    if seen:
        small = [o for o in misses if o.age <= oldest_hit and o.predicted < min(seen)]
        if len(small) >= EVIDENCE:
            f.min_tokens = max(o.predicted for o in small) + 1
    return f


def contradicts(f: Facts, obs: list[Observation]) -> bool:
    """Whether a session's observations contradict facts learned elsewhere (its host's)."""
    for o in obs:
        if o.verdict not in ("hit", "extra"):
            continue
        if f.no_cache:
            return True
        if f.ttl and o.age is not None and o.age >= f.ttl:
            return True
        if f.min_tokens and 0 < o.predicted < f.min_tokens:
            return True
    return False


@dataclass
class _Session:
    host: str = ""
    family: str = ""
    obs: list[Observation] = field(default_factory=list)
    loaded: bool = False
    # what its observations taught, kept until they change (``changed`` counts the changes): an answer
    # applies the host's facts to every live session on the host, which would learn each one's again
    changed: int = 0
    taught: tuple | None = None  # (changed, Facts)
    against: tuple | None = None  # (changed, the host's pool and its changes, contradicts(pool's facts, obs))

    def facts(self) -> Facts:
        """What its newest observations teach (learned again only when they changed)."""
        t = self.taught
        if t is None or t[0] != self.changed:
            t = self.taught = (self.changed, learn(self.obs[-KEEP:]))
        return t[1]


class _Pool:
    """A host's newest observations as the store has them: read at ``read_at`` (monotonic seconds),
    oldest first with their times, this process's own added as it stores them (``changed`` counts the
    additions; what they teach is kept until the next)."""

    __slots__ = ("read_at", "rows", "changed", "taught")

    def __init__(self, read_at: float, rows: list[tuple[float, Observation]]):
        self.read_at, self.rows, self.changed, self.taught = read_at, rows, 0, None

    def facts(self) -> Facts:
        t = self.taught
        if t is None or t[0] != self.changed:
            t = self.taught = (self.changed, learn([o for _ts, o in self.rows]))
        return t[1]


class Calibration:
    """One process's calibration over a store: records each answer's observation, learns per session
    and per host, applies the facts to the sessions' clocks (:class:`~bili_addon.kernel.cache.Clocks`)."""

    def __init__(self, store: "Store", clocks: Clocks):
        self.store = store
        self.clocks = clocks
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.hosts: dict[tuple[str, str], _Pool] = {}  # per (host, family)
        clocks.on_new = self._on_new

    # -- the narrow interface for decisions --------------------------------------------------------
    def facts(self, sid: str, host: str = "", family: str = "") -> tuple[Facts, str]:
        """``(facts in force, their source)`` for a session: what its own observations taught, else
        its host's facts where the session's reports do not contradict them; source ``session``,
        ``host`` or ``""`` (the documented rules)."""
        s = self._session(sid)
        host, family = host or s.host, family or s.family
        own = s.facts()
        if own.learned:
            return own, "session"
        if host and family:
            pool = self._pool(host, family)
            pooled = pool.facts()
            if pooled.learned:
                key = (s.changed, pool, pool.changed)
                a = s.against
                if a is None or a[0] != key:
                    a = s.against = (key, contradicts(pooled, s.obs[-KEEP:]))
                if not a[1]:
                    return pooled, "host"
        return own, ""

    def effective_ttl(self, sid: str, host: str = "") -> float | None:
        """The cache lifetime in force for a session, in seconds, as the calibration knows it: 0.0
        when its provider keeps no cache, a learned shorter lifetime, or None when the reports do not
        contradict the documented rules (the caller's :class:`~bili_addon.kernel.cache.Rules` hold)."""
        clk = self.clocks.by_session.get(sid)
        f, _src = self.facts(sid, host, clk.rules.family if clk is not None else "")
        if f.no_cache:
            return 0.0
        return f.ttl

    # -- the answer path (the store's worker) --------------------------------------------------------
    def observe(self, sid: str, lane: str, turn: Turn | None) -> None:
        """A request's answer reported its usage (``turn``: its clock's turn, with the prediction and
        the report): store the observation, learn, apply."""
        clk = self.clocks.by_session.get(sid)
        if turn is None or clk is None or turn.reported_read is None:
            return
        family = clk.rules.family
        row = CalibrationRow(0, turn.at, turn.host, family, lane, turn.gap, turn.age, turn.predicted.total,
                             turn.predicted.read, turn.predicted.write + turn.predicted.write_long,
                             turn.reported_input, turn.reported_read,
                             turn.reported_write if family == "anthropic" else None)
        s = self._session(sid)
        s.host, s.family = turn.host, family
        s.obs.append(observation(row))
        del s.obs[:-KEEP]
        s.changed += 1
        try:
            self.store.record_calibration(sid, row)
        except StoreError as e:  # learned in memory all the same; the stats miss this one
            log.warning("[bili] session=%s: cannot store the cache observation: %s", printable(sid), printable(e))
        else:
            pool = self.hosts.get((turn.host, family))
            if pool is not None:  # the host's newest as the store now has them (a read would give the same)
                insort(pool.rows, (row.ts, s.obs[-1]), key=_TS)
                del pool.rows[:-KEEP]
                pool.changed += 1
        before = clk.learned()
        self._apply(sid, clk)
        after = clk.learned()
        if after != before:
            log.info("[bili] session=%s: the provider's cache reports teach %s (%s at %s)", printable(sid),
                     after or "nothing more (documented rules)", family, printable(turn.host or "?"))
        if turn.host:  # live sessions on the same host that lean on the host's facts
            for other, c in self.clocks.by_session.items():
                if other != sid and c.host == turn.host and c.rules.family == family:
                    self._apply(other, c)

    def _apply(self, sid: str, clk: Clock) -> None:
        f, src = self.facts(sid, clk.host, clk.rules.family)
        clk.apply(f.ttl, f.no_cache, f.min_tokens, src)

    def _on_new(self, sid: str, clk: Clock) -> None:
        try:
            self._apply(sid, clk)
        except Exception as e:  # a clock without calibration is still a clock (documented rules)
            log.warning("[bili] session=%s: calibration not applied (%s)", printable(sid), printable(e))

    # -- state -------------------------------------------------------------------------------------
    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = _Session()
            while len(self.sessions) > SESSIONS:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sid)
        if not s.loaded:  # a session seen before a restart: its stored observations
            s.loaded = True
            rows = self.store.calibration(sid, KEEP)
            if rows:
                s.obs[:0] = [observation(r) for r in rows]
                s.changed += 1
                s.host, s.family = s.host or rows[-1].host, s.family or rows[-1].family
        return s

    def _pool(self, host: str, family: str) -> _Pool:
        key = (host, family)
        pool = self.hosts.get(key)
        now = _now()
        if pool is None or now - pool.read_at > HOST_FRESH:
            pool = self.hosts[key] = _Pool(now, [(r.ts, observation(r)) for r in
                                                 self.store.host_calibration(host, family, KEEP)])
        return pool

    # -- stats -------------------------------------------------------------------------------------
    def summary(self, sid: str, recent: int = 10) -> dict[str, Any] | None:
        """A session's predicted vs reported cache figures, from its stored observations (None: none)."""
        n, pr, rr, pw, rw, writes, agree = self.store.calibration_totals(sid)
        if not n:
            return None
        rows = self.store.calibration(sid, KEEP)
        last = rows[-1]
        facts, source = self.facts(sid, last.host, last.family)
        own = learn([observation(r) for r in rows])
        return {
            "host": last.host, "family": last.family, "turns": n,
            "predicted_read": pr, "reported_read": rr,
            "predicted_write": pw if writes else None, "reported_write": rw if writes else None,
            # the model's read/no-read verdict confirmed by the provider, per answered request
            "agree": round(agree / n, 4),
            "read_ratio": round(pr / rr, 4) if rr else None,
            "hits": own.hits, "misses": own.misses, "extra": own.extra,
            "learned": own.to_dict() if own.learned else {},
            "effective": {**_effective(facts), "source": source or "documented"},
            "recent": [row_dict(r) for r in rows[-recent:]],
        }

    def host_facts(self) -> list[dict[str, Any]]:
        """Every host the store has observations of, with what they taught."""
        out = []
        for host, family, n in self.store.calibration_hosts():
            f = learn([observation(r) for r in self.store.host_calibration(host, family, KEEP)])
            out.append({"host": host, "family": family, "observations": n, "hits": f.hits, "misses": f.misses,
                        "extra": f.extra, "learned": _effective(f)})
        return out


def _effective(f: Facts) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if f.no_cache:
        out["no_cache"] = True
    elif f.ttl:
        out["ttl"] = round(f.ttl, 1)
    if f.min_tokens:
        out["min_tokens"] = f.min_tokens
    return out


def row_dict(r: CalibrationRow) -> dict[str, Any]:
    """One stored observation for the stats (``verdict``: hit, miss, extra, none)."""
    return {"n": r.n, "ts": round(r.ts, 3), "gap": None if r.gap is None else round(r.gap, 1),
            "age": None if r.age is None else round(r.age, 1), "predicted_input": r.predicted_input,
            "predicted_read": r.predicted_read, "predicted_write": r.predicted_write,
            "reported_input": r.reported_input, "reported_read": r.reported_read,
            "reported_write": r.reported_write, "verdict": observation(r).verdict}


__all__ = ["EVIDENCE", "KEEP", "SHORT", "Calibration", "Facts", "Observation", "contradicts", "learn", "observation",
           "row_dict"]
