"""#11, a turn's fixed glue (kernel/turn.py, lineage.py, sessions.py, wire/base.py): cheaper without changing
a byte.  The oracles are the functions as they were (kept below) compared with the code as it is: property
by property (the body's split over bodies of every layout, the request's session and agent over headers of
every kind, the prefix counter, the fork key's fingerprint, the lineage record), and whole Engine runs
(tests/oracle_runs.py) with the oracles patched in, over the bench's conversations (first turns, forks,
follow-ups, folded follow-ups, reminders and truncations), the folds of every kind, and the captures
(BILI_CAPTURES): the same bytes out, the same results, flags, ledgers and lineage parts."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import msgspec
import pytest

from bili_addon.kernel.envelope import Envelope
from bili_addon.wire.base import Body

from bili_addon.kernel import envelope, lineage, sessions, turn
from bili_addon.kernel.envelope import FIELD, EnvelopeRejected, parse, shape_of  # noqa: F401  (the oracle's)
from bili_addon.kernel.identity import digest
from bili_addon.kernel.lineage import SIDE_REQUEST_MAX_ITEMS  # noqa: F401  (the oracle's)
from bili_addon.kernel.sessions import SESSION_HEADERS, _CONTENT_KEYED_CACHE_KEY_PREFIXES, _header, codex_thread  # noqa: F401
from bili_addon.kernel.state import Entry, ItemInfo, Memo, Part, Resolved, Session, TurnResult
from bili_addon.wire import LANES, base
from bili_addon.wire.base import _COMPACT, _KEY_BYTES, _KEY_NAMES, Core

from tests import oracle_runs
from tests.oracle_runs import capture_turns, same_runs
from tests.test_first_fixed import Trace, benchs_turns
from tests.test_folded_follow_up import folds_of_every_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_overhead  # noqa: E402  (its synthetic conversations)


# -- the oracles: the functions as they were ---------------------------------------------------------

def old_split_compact(raw: bytes, key: str = "messages"):
    dec, top_keys = _COMPACT[key]
    try:
        t = dec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    values = msgspec.structs.astuple(t)
    items = values[0]
    if items is msgspec.UNSET:
        return None
    unset = msgspec.UNSET
    n_items = len(items)
    sizes = {k: len(v) for k, v in zip(top_keys, values[1:]) if v is not unset}
    sizes[key] = 2 + sum(map(len, items)) + (n_items - 1 if n_items else 0)
    key_bytes = _KEY_BYTES
    if 1 + sum(map(len, map(key_bytes.__getitem__, sizes))) + sum(sizes.values()) + len(sizes) != len(raw):
        return None
    top: dict[str, msgspec.Raw] = {}
    names, find, view = _KEY_NAMES, raw.find, memoryview(raw)
    off = 1
    for _ in range(len(sizes)):
        q = find(b'":', off + 1)
        k = names.get(raw[off + 1:q]) if raw[off:off + 1] == b'"' and q > 0 else None
        if k is None or k in top or k not in sizes:
            return None
        at = q + 2
        end = at + sizes[k]
        if k == key:
            top[k], span = msgspec.Raw(view[at:end]), (at, end)
        else:
            top[k] = getattr(t, k)
        off = end + 1
    if off != len(raw):
        return None
    return top, items, span


def old_session_from_request(headers: Mapping[str, str], top: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(session_id, source)`` from the agent's own ids, or None for an anonymous request.

    ``top`` is the decoded top-level body (only small scalar fields are read).
    """
    thread = codex_thread(headers)
    if thread:
        return thread, "codex-thread"
    for name in SESSION_HEADERS:
        v = _header(headers, name)
        if v:
            return v, f"header:{name}"
    sid = top.get("session_id")
    if isinstance(sid, str) and sid.strip():
        return sid.strip(), "body:session_id"
    meta = top.get("metadata")
    if isinstance(meta, dict):
        if isinstance(meta.get("session_id"), str) and meta["session_id"].strip():
            return meta["session_id"].strip(), "body:metadata.session_id"
        uid = meta.get("user_id")
        if isinstance(uid, str) and uid.startswith("{"):
            try:
                inner = json.loads(uid)
            except ValueError:
                inner = None
            if isinstance(inner, dict) and isinstance(inner.get("session_id"), str) and inner["session_id"]:
                return inner["session_id"], "body:metadata.user_id"
    pck = top.get("prompt_cache_key")
    if isinstance(pck, str) and pck.strip() and not pck.startswith(_CONTENT_KEYED_CACHE_KEY_PREFIXES):
        return pck.strip(), "body:prompt_cache_key"
    return None


def old_agent_of(headers: Mapping[str, str]) -> str:
    """A best-effort label for stats and logs; never used for identity."""
    ua = _header(headers, "user-agent").lower()
    if "claude-cli" in ua or "claude-code" in ua:
        return "claude-code"
    if "codex" in ua or _header(headers, "originator").startswith("codex"):
        return "codex"
    if ua.startswith("opencode") or _header(headers, "originator") == "opencode":
        return "opencode"
    if ua.startswith("omp/"):
        return "omp"
    if "/python" in ua:
        return "python-sdk"
    if "/js" in ua:
        return "js-sdk"
    return ua.split("/", 1)[0] if ua else "unknown"



def old_prefix_counter(memo, q):
    if memo is None or q == 0:
        return Counter()
    counts = Counter(memo.bases)
    for parts in memo.resolved[q:]:
        for r in parts:
            counts[r.base] -= r.incs
    return counts


def old_natively(names):
    return any("bili" in n and n.endswith("compress") for n in names)


def old_record(self, s: Session, infos: list[ItemInfo], start: int, resolved: list[list[Resolved]],
               reused: int = 0, _parts=None, _epoch: int = 0) -> None:
    """Keep the session's history (per part: ref, content hash, verification fingerprint) for
    the forks to come.  A request that only repeats a prefix of it (a side request, a retry of
    an older turn) keeps the longer record.  ``reused``: leading items this pass shares with
    the session's previous one, unchanged (not compared again when that pass was recorded)."""
    sid = s.row.id
    if sid in self.pending:  # the previous pass's parts were not stored yet (no answer came)
        self.flush(sid)
    old = self._record(sid)
    first = reused if reused and self.whole.get(sid) else 0
    if not old and not first and self.defer and any(resolved):
        # the session's first record, every part new: nothing to compare, and nothing read
        # before the answer, so even the list of its parts is made after it (by :meth:`flush`)
        self.records.pop(sid, None)
        self.whole[sid] = True
        self.pending[sid] = (0, (infos[start:], list(resolved)))
        return
    off = min(sum(map(len, resolved[:first])), len(old)) if first else 0
    parts = [(r.entry.ref, p) for info, rs in zip(infos[start + first:], resolved[first:])
             for p, r in zip(info.parts, rs)]
    k, n = off, min(len(old), off + len(parts))
    while k < n and old[k][0] == parts[k - off][0] and old[k][1] == parts[k - off][1].chash:
        k += 1
    total = off + len(parts)
    if k == total or (total < len(old) and len(resolved) < SIDE_REQUEST_MAX_ITEMS):
        self.whole[sid] = k == total == len(old)
        return
    new = parts[k - off:]
    # compared on refs and content hashes only: the fingerprints are for the forks to come
    self.records[sid] = old[:k] + [(ref, p.chash, "") for ref, p in new]
    self.whole[sid] = True
    self.pending[sid] = (k, new)
    if not self.defer:
        self.flush(sid)


def old_pins(s: Session, body: Body, headers: Mapping[str, str], infos: list[ItemInfo], start: int,
         result: TurnResult) -> tuple[Envelope | None, dict[int, list[Entry]], bool]:
    """The host-vouched ids of this request, and the refs they pin (by conversation item)."""
    stripped = FIELD in body.top
    field = body.top.pop(FIELD, None)
    try:
        env = parse(msgspec.json.decode(field) if field is not None else None, headers, len(infos))
    except EnvelopeRejected as e:
        result.notes.append(f"message ids ignored for this turn ({e}); content identity applies")
        return None, {}, stripped
    if env is None:
        return None, {}, stripped
    bound = s.flags.get("envelope", {})
    pinned: dict[int, list[Entry]] = {}
    for i in range(start, len(infos)):
        stored = bound.get(env.ids[i])
        if stored is None:
            continue
        shape, refs = stored
        if shape == shape_of(infos[i].parts) and len(refs) == len(infos[i].parts):
            pinned[i - start] = [Entry(r, t) for r, t in refs]
        elif not env.resync:
            result.status = 400
            result.error = (f"message id {env.ids[i]!r} is already bound to a different message; "
                            f"send resync: true to re-claim the whole set")
            return env, {}, stripped
    return env, pinned, stripped


def old_encode(self, items: list[bytes] | None) -> bytes:
    """Re-emit the body; ``items`` replaces the conversation array when given.  The body is
    msgspec's encoding of ``top`` (``{"key":raw,...}``, each key encoded as msgspec encodes
    it): written here in one join of the pieces, the items copied once, not three times
    (joined, bracketed, then copied again into the top object's encoding)."""
    if items is None or not self.array:
        return base._enc.encode(self.top)
    pieces: list = []
    add = pieces.append
    sep = b"{"
    at = end = 0  # where the array lies in the result
    for k, v in self.top.items():
        add(sep)
        sep = b","
        add(base._enc.encode(k))
        if k == self.key:
            add(b":")
            at = sum(map(len, pieces))
            n = len(items)
            if n:  # ``[``, the items with a comma between each two, ``]``: laid out by slices
                array = [b","] * (2 * n + 1)
                array[0], array[-1] = b"[", b"]"
                array[1::2] = items
                pieces += array
                end = at + sum(map(len, items)) + n + 1  # (n - 1 commas, two brackets)
            else:
                add(b"[]")
                end = at + 2
        else:
            add(b":")
            add(v)
    add(b"}" if pieces else b"{}")
    joined = b"".join(pieces)
    self.top[self.key] = msgspec.Raw(memoryview(joined)[at:end])  # the new array (no copy of it)
    return joined


def old_key_types_ok(key) -> bool:
    for x in key:
        if type(x) not in base._KEY_TYPES:
            return False
    return True


def patch_oracles(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(base, "_split_compact", old_split_compact)
    mp.setattr(turn, "session_from_request", old_session_from_request)
    mp.setattr(turn, "agent_of", old_agent_of)
    mp.setattr(turn, "_prefix_counter", old_prefix_counter)
    mp.setattr(turn, "_natively", old_natively)
    mp.setattr(lineage, "fingerprint", lineage._fingerprint)
    mp.setattr(lineage.Lineage, "record", old_record)
    mp.setattr(envelope, "pins", old_pins)
    mp.setattr(base.Body, "encode", old_encode)


# -- (1) property by property -----------------------------------------------------------------------

def _same_split(a, b) -> bool:
    if a is None or b is None:
        return a is b
    (t1, i1, s1), (t2, i2, s2) = a, b
    return (list(t1) == list(t2) and [bytes(v) for v in t1.values()] == [bytes(v) for v in t2.values()]
            and all(type(v) is msgspec.Raw for v in t1.values())
            and [bytes(x) for x in i1] == [bytes(x) for x in i2] and s1 == s2)


def _variants(rng: random.Random, lane: str, n: int):
    """Bodies of the bench's conversations in every layout: members in the order an agent writes
    them, shuffled, some left out, others added, written with spaces, a key written with an escape,
    a key twice, an item array empty or missing, trailing bytes."""
    case = bench_overhead.Case(lane, n)
    key = case.lane.conv_key
    for _ in range(60):
        d = json.loads(case.unique_body())
        ks = list(d)
        r = rng.random()
        if r < 0.35:
            rng.shuffle(ks)
        elif r < 0.5:
            ks = ks[:rng.randint(1, len(ks))]
        if rng.random() < 0.2:
            ks.append(rng.choice(["temperature", "stream", "metadata", "bogus", "session_id", "prompt_cache_key"]))
        body = {k: d.get(k, rng.choice([1, "x", None, [], {}])) for k in ks}
        if rng.random() < 0.05 and key in body:
            body[key] = []
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()
        r = rng.random()
        if r < 0.08:
            raw = json.dumps(body).encode()
        elif r < 0.12:
            raw = raw.replace(b'"model":', b'"mod\\u0065l":', 1)
        elif r < 0.16:
            raw = raw.replace(b'"stream":', b'"model":', 1)
        elif r < 0.18:
            raw = raw + b" "
        elif r < 0.20:
            raw = raw.replace(b"},{", b"}, {", 1)
        for _ in range(rng.choice([1, 1, 2])):  # (the same body again: its order known)
            yield key, raw


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_the_split_is_the_oracles(seed, lane):
    """_split_compact (the members in the order the last body had them, else one by one) is the old
    one-by-one reading, over bodies of every layout in a row (the known order right, wrong, of
    other members), and Body reads them as it did."""
    rng = random.Random(seed)
    read = 0
    for key, raw in _variants(rng, lane, rng.choice([4, 12, 40])):
        got, want = base._split_compact(raw, key), old_split_compact(raw, key)
        assert _same_split(got, want), raw[:300]
        read += got is not None
    assert read


def test_the_splits_known_order_is_taken_and_left():
    """(The test above meets the three outcomes of a known order: taken, not this body's order, a
    body of the wrong size.)"""
    seen = Counter()
    real = base._ordered

    def spy(*a):
        r = real(*a)
        seen["taken" if r is not base._MISS and r is not None else "other order" if r is base._MISS else "none"] += 1
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "_ordered", spy)
        for lane in ("anthropic", "chat", "responses"):
            for seed in range(6):
                for key, raw in _variants(random.Random(seed), lane, 12):
                    assert _same_split(base._split_compact(raw, key), old_split_compact(raw, key))
    assert all(seen[k] for k in ("taken", "other order", "none")), seen


_VALUES = [None, "", " ", "  sid-1 ", "sid-2", "\t", 7, b"bytes", "pck_abc", "{", "x" * 40]


def _headers(rng: random.Random) -> dict:
    names = [*SESSION_HEADERS, "user-agent", "originator", "x-codex-turn-metadata", "thread-id", "other"]
    h = {}
    for name in rng.sample(names, rng.randint(0, 6)):
        v = rng.choice(_VALUES)
        if name == "user-agent" and rng.random() < 0.7:
            v = rng.choice(["claude-cli/1.0", "Claude-Code/2", "codex_cli_rs/0.1", "opencode/1", "OpenCode",
                            "omp/3", "OpenAI/Python 1.2", "Anthropic/JS 0.3", "curl/8", "", " x/1 "])
        elif name == "originator" and rng.random() < 0.7:
            v = rng.choice(["codex_cli_rs", "codex", "opencode", " opencode ", "other", ""])
        elif name == "x-codex-turn-metadata" and rng.random() < 0.7:
            tid = rng.choice(["t1", "t2"])
            v = json.dumps(rng.choice([{"thread_source": "subagent", "thread_id": tid}, {"thread_source": "user",
                                       "thread_id": tid}, [1], {"thread_id": tid}]))
            if rng.random() < 0.7:
                h["thread-id"] = rng.choice(["t1", "t2", " t1 "])
            if rng.random() < 0.1:
                v = "{not json"
        if v is not None or rng.random() < 0.5:
            h[name] = v
    return h


def _top(rng: random.Random) -> dict:
    top = {}
    if rng.random() < 0.3:
        top["session_id"] = rng.choice(_VALUES)
    if rng.random() < 0.3:
        top["metadata"] = rng.choice([None, {}, {"session_id": rng.choice(_VALUES)},
                                      {"user_id": json.dumps({"session_id": rng.choice(["s", "", 3])})},
                                      {"user_id": "{bad"}, "meta"])
    if rng.random() < 0.3:
        top["prompt_cache_key"] = rng.choice(_VALUES)
    return top


@pytest.mark.parametrize("seed", range(10))
def test_the_requests_session_and_agent_are_the_oracles(seed):
    rng = random.Random(seed)
    for _ in range(3000):
        h, top = _headers(rng), _top(rng)
        assert sessions.session_from_request(h, top) == old_session_from_request(h, top), (h, top)
        assert sessions.session_from_request(h, {}) == old_session_from_request(h, {})
        assert sessions.agent_of(h) == old_agent_of(h), h


def _resolved(rng: random.Random, n: int) -> list[list[Resolved]]:
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 3)):
            base_id = f"b{rng.randint(0, 12)}"
            core = Core("user", "text", text="x")
            parts.append(Resolved(core, Entry("m1", 1), False, base_id, base_id, rng.randint(1, 3)))
        out.append(parts)
    return out


@pytest.mark.parametrize("seed", range(10))
def test_the_prefix_counter_is_the_oracles(seed):
    """The same counts, in the same order, a Counter as before (missing bases count 0)."""
    rng = random.Random(seed)
    for _ in range(300):
        resolved = _resolved(rng, rng.randint(0, 12))
        bases = Counter(r.base for parts in resolved for r in parts for _ in range(r.incs))
        memo = None if rng.random() < 0.1 else Memo("anthropic", "s", 0, [], [], 0, None, resolved, [], None, [0], [0],
                                                     bases)
        q = rng.randint(0, len(resolved))
        got, want = turn._prefix_counter(memo, q), old_prefix_counter(memo, q)
        assert type(got) is Counter and got == want and list(got.items()) == list(want.items())
        assert got is not bases and got["never"] == 0
        got["b1"] += 1
        assert bases == Counter(r.base for parts in resolved for r in parts for _ in range(r.incs))


@pytest.mark.parametrize("seed", range(4))
def test_pins_are_the_oracles(seed):
    """envelope.pins without an envelope (no field, no header: its shortcut) and with one, valid or not."""
    from bili_addon.wire.base import Body

    rng = random.Random(seed)
    case = bench_overhead.Case("anthropic", 4)
    for _ in range(200):
        d = json.loads(case.body(case.msgs))
        n = len(d["messages"])
        if rng.random() < 0.3:
            d[FIELD] = rng.choice([[f"id{i}" for i in range(n)], ["x"] * n, [1], {"ids": [f"i{i}" for i in range(n)]},
                                   None])
        headers = {}
        if rng.random() < 0.3:
            headers[envelope.HEADER] = rng.choice(["", "[]", "nope", json.dumps([f"h{i}" for i in range(n)])])
        raw = msgspec.json.encode(d)
        runs = []
        for fn in (envelope.pins, old_pins):
            from bili_addon.kernel.state import Session as S
            from bili_addon.store import SessionRow
            s = S(SessionRow("s", "a", "anthropic", 0.0, 0.0, 0, 0, 1, "{}"))
            body = Body(raw, "messages")
            res = TurnResult(None)
            env, pinned, stripped = fn(s, body, headers, [None] * n, 0, res)
            runs.append((None if env is None else (env.ids, env.resync), pinned, stripped, list(body.top),
                         vars(res)))
        assert runs[0] == runs[1]


def test_natively_is_the_oracles():
    for names in ([], ["Bash"], ["mcp__bili__compress"], ["bili_compress", "x"], ["compress"], ["bilicompressx"],
                  ["a", "mcp__bili__decompress"]):
        assert turn._natively(names) == old_natively(names)


_TEXTS = ["hello world", "  spaced  ", "{\"b\": 1, \"a\": [1, 2]}", "line\nbreaks\n\nhere", "", "é e\u0301",
          "\x00ctl", "tab\there", "x" * 5000]


def test_the_fork_keys_fingerprint_is_fingerprints():
    """The fork key's cold SHA-256 (HACL*) gives fingerprint's digest, for parts of every kind."""
    for role in ("user", "assistant", "tool"):
        for ctype in ("text", "tool-call", "tool-result", "reasoning", "image"):
            for text in _TEXTS:
                core = Core(role, ctype, text=text, tool_call_id="c1" if ctype != "text" else "",
                            tool_name="Bash" if ctype == "tool-call" else "", media="m" if ctype == "image" else None)
                assert lineage.fingerprint(core) == lineage._fingerprint(core)


def test_the_known_keys_are_written_as_msgspec_writes_them():
    for k, written in _KEY_BYTES.items():
        assert written == base._enc.encode(k) + b":"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
def test_a_bodys_encoding_is_the_oracles(seed, lane):
    """Body.encode (the known keys written from a table) is the old encoding, over bodies of every layout
    (keys known or not, written with escapes, not ASCII), items replaced or not, and read back after."""
    rng = random.Random(seed)
    for key, raw in _variants(rng, lane, 12):
        d = json.loads(raw) if raw.lstrip()[:1] == b"{" else None
        if isinstance(d, dict) and rng.random() < 0.3:
            d["é\"k"] = 1
            d["x-unknown"] = [1]
            raw = json.dumps(d, separators=(",", ":")).encode()
        try:
            b1, b2 = base.Body(raw, key), base.Body(raw, key)
        except base.CodecError:
            continue
        items = None if rng.random() < 0.3 else [bytes(x) for x in b1.items][: rng.randint(0, len(b1.items))]
        out1, out2 = b1.encode(items), old_encode(b2, items)
        assert out1 == out2
        assert list(b1.top) == list(b2.top) and [bytes(v) for v in b1.top.values()] == [bytes(v) for v in b2.top.values()]
        if items is not None:
            assert b1.encode(None) == old_encode(b2, None)


def test_the_key_types_are_checked_as_before():
    keys = [(msgspec.Raw(b"1"), b"x", "s", True, None), (1,), (1.0,), ([],), (), ("s", {}), (bytearray(b"x"),),
            (memoryview(b"x"),)]
    for key in keys:
        assert base._KEY_TYPESET.issuperset(map(type, key)) == old_key_types_ok(key)


def _infos(rng: random.Random, n: int) -> list[ItemInfo]:
    out = []
    for k in range(n):
        parts = []
        for j in range(rng.randint(1, 2)):
            core = Core(rng.choice(["user", "assistant"]), "text", text=f"t{rng.randint(0, 6)}")
            b, chash = digest(core)
            parts.append(Part(core, b, chash, False))
        out.append(ItemInfo(b"{}", False, parts))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_lineage_record_is_the_oracles(seed, tmp_path):
    """Lineage.record (its record changed in place) keeps what it kept: records, verdicts, parts kept
    back, over passes that extend, repeat, rewind and change a session's history, deferred or not."""
    from bili_addon.store import Store

    rng = random.Random(seed)
    runs = []
    for old in (False, True):
        rng = random.Random(seed)
        st = Store(tmp_path / f"{old}.db")
        lin = lineage.Lineage(st)
        lin.defer = rng.random() < 0.5
        rec = old_record if old else lineage.Lineage.record
        out = []
        sessions_ = {}
        for step in range(40):
            sid = f"s{rng.randint(0, 2)}"
            prev = sessions_.get(sid, [])
            r = rng.random()
            if r < 0.5 or not prev:
                infos = prev + _infos(rng, rng.randint(1, 4))
            elif r < 0.7:
                infos = prev[:rng.randint(1, len(prev))]
            else:
                infos = prev[:rng.randint(0, len(prev))] + _infos(rng, rng.randint(1, 3))
            sessions_[sid] = infos
            resolved = [[Resolved(p.core, Entry(f"m{abs(hash(p.chash)) % 997}", 1), False, p.base, p.base)
                         for p in info.parts] for info in infos]
            s = type("S", (), {})()
            s.row = type("R", (), {"id": sid})()
            reused = rng.randint(0, len(infos)) if rng.random() < 0.5 else 0
            counted = rng.random() < 0.5
            if old or not counted:
                rec(lin, s, infos, 0, resolved, reused)
            else:  # (the parts counted by the caller)
                rec(lin, s, infos, 0, resolved, reused, sum(map(len, resolved)))
            if rng.random() < 0.4:
                lin.flush()
            out.append((sid, {k: list(v) for k, v in lin.records.items()}, dict(lin.whole),
                        {k: (v[0], repr(v[1])) for k, v in lin.pending.items()}))
        lin.flush()
        out.append([(sid, [tuple(p) for p in st.lineage_parts(sid)]) for sid in sorted(sessions_)])
        st.close()
        runs.append(out)
    assert runs[0] == runs[1]


# -- (2) whole Engine runs: as they are, and with the oracles patched in -------------------------------

def both(tmp_path: Path, scenario) -> None:
    same_runs(tmp_path, scenario, patch_oracles, Trace)


@pytest.mark.parametrize("lane", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("n", [12, 100])
@pytest.mark.parametrize("window", [0, 25_000])
def test_the_benchs_first_turns_forks_and_follow_ups_are_the_oracles(tmp_path, lane, n, window):
    both(tmp_path, benchs_turns(lane, n, window, window > 0, rewind=True))


@pytest.mark.parametrize("window", [0, 20_000])
def test_the_benchs_folded_follow_ups_are_the_oracles(tmp_path, window):
    both(tmp_path, oracle_runs.folded_follow_ups(window))


@pytest.mark.parametrize("window", [0, 12_000])
def test_folds_of_every_kind_are_the_oracles(tmp_path, window):
    both(tmp_path, lambda make: folds_of_every_kind(make, window, "now"))


def test_the_captured_turns_are_the_oracles(tmp_path):
    """Every captured request (the agents' real bodies and headers), through one engine in file order."""
    turns = capture_turns()

    def scenario(make):
        t = make()
        out = []
        for lane, headers, raw in turns:
            t.e.t += 5
            try:
                res = t.e.process(raw, LANES[lane], headers, render=True)
            except Exception as e:  # (the same failure either way)
                out.append(("raised", type(e).__name__, str(e)))
                continue
            t.e.lineage.flush()
            out.append(dict(vars(res)))
        return [out]

    both(tmp_path, scenario)


@pytest.mark.parametrize("materialize", ["now", "cost"])
def test_the_captures_replay_as_the_oracles(materialize):
    new, old = oracle_runs.replays_both(patch_oracles, materialize)
    assert new == old
