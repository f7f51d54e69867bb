"""The lane-neutral core message and the byte-exact patching machinery every codec shares.

A request body is held as an ordered ``dict[str, msgspec.Raw]``: keys we never touch keep their
original bytes.  The conversation array (``messages`` / ``input`` / ``contents``) is held as a
``list[msgspec.Raw]`` of *items*; an item we do not patch is re-emitted byte for byte.  A patch is a
path inside one item (``("content", 2, "text")``) and a new JSON value; only the objects on that
path are re-encoded, siblings keep their raw bytes.
"""

from __future__ import annotations

import hashlib
import operator
from bisect import bisect_right
from collections import OrderedDict
from itertools import accumulate
from typing import Any, Iterable

import msgspec

from bili_addon.wire.frozen import Frozen

# contentType literals of the core model
TEXT = "text"
TOOL_CALL = "tool-call"
TOOL_RESULT = "tool-result"
REASONING = "reasoning"
IMAGE = "image"
OTHER = "other"  # a part we carry opaquely (documents, server tool blocks, ...)

_dec_raw_obj = msgspec.json.Decoder(dict[str, msgspec.Raw])
_dec_raw_list = msgspec.json.Decoder(list[msgspec.Raw])
_dec_any = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()

Path = tuple  # tuple[str | int, ...]


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()  # a patch value: remove the key at the end of the path


class Core(msgspec.Struct, gc=False):
    """One content part of one wire item, in the lane-neutral shape the kernel works on."""

    role: str  # user | assistant | system | tool
    ctype: str  # TEXT | TOOL_CALL | TOOL_RESULT | REASONING | IMAGE | OTHER
    text: str
    tool_name: str = ""
    tool_call_id: str = ""
    media: str = ""  # payload slot for media cores (hash of data, or the URL)
    item: int = 0  # index of the wire item this part lives in
    path: Path = ()  # where ``text`` lives inside the item, when it is patchable prose
    last_item: bool = False  # the part belongs to the final item of the conversation


class CodecError(ValueError):
    """The body does not have the shape of its lane; the request passes through untouched."""


def decode_obj(raw: bytes | msgspec.Raw) -> dict[str, msgspec.Raw]:
    try:
        return _dec_raw_obj.decode(raw)
    except msgspec.ValidationError as e:
        raise CodecError(f"expected a JSON object: {e}") from None


def decode_list(raw: bytes | msgspec.Raw) -> list[msgspec.Raw]:
    try:
        return _dec_raw_list.decode(raw)
    except msgspec.ValidationError as e:
        raise CodecError(f"expected a JSON array: {e}") from None


def decode_any(raw: bytes | msgspec.Raw) -> Any:
    return _dec_any.decode(raw)


def encode(value: Any) -> bytes:
    return _enc.encode(value)


def content_cores(role: str, content: Any, part_core) -> list[Core]:
    """Cores of a ``content`` value: a string is one text core, an array one core per part
    (``part_core(role, index, part)`` reads a part in the lane's own shape)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Core(role, TEXT, content, path=("content",))]
    if not isinstance(content, list):
        return [Core(role, OTHER, compact_json(content))]
    return [part_core(role, j, part) for j, part in enumerate(content)]


def by_item(got: tuple | None, flat: bool) -> tuple | None:
    """A lane's ``array_cores`` answer from its flat reading ``got`` (``(the cores of every item in
    one list, where each item's cores end in it, *the rest)``, or None): as it is when ``flat`` (or
    None), else each item's cores as a list of their own, then the rest."""
    if got is None or flat:
        return got
    cores, ends, *rest = got
    return ([cores[a:b] for a, b in zip([0, *ends], ends)], *rest)


def compact_json(value: Any) -> str:
    """Compact JSON text of a parsed value (key order kept), as tool-call argument text."""
    return _enc.encode(value).decode()


def patch(raw: bytes | msgspec.Raw, path: Path, value: Any) -> bytes:
    """Return ``raw`` with the JSON value at ``path`` replaced; everything off the path stays byte-exact."""
    if not path:
        return _enc.encode(value)
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        arr = decode_list(raw)
        arr[head] = msgspec.Raw(patch(arr[head], rest, value))
        return _enc.encode(arr)
    obj = decode_obj(raw)
    if rest:
        obj[head] = msgspec.Raw(patch(obj[head], rest, value))
    elif value is DELETE:
        obj.pop(head, None)
    else:
        obj[head] = msgspec.Raw(_enc.encode(value))
    return _enc.encode(obj)


def append_part(raw: bytes | msgspec.Raw, key: str, part: Any) -> bytes | None:
    """``raw`` (an object) with ``part`` appended to its array at ``key``, the rest byte-exact;
    None when ``key`` does not hold an array."""
    try:
        obj = decode_obj(raw)
    except (CodecError, msgspec.DecodeError):
        return None
    arr = obj.get(key)
    if arr is None or bytes(arr)[:1] != b"[":
        return None
    obj[key] = msgspec.Raw(_enc.encode([*decode_list(arr), msgspec.Raw(_enc.encode(part))]))
    return _enc.encode(obj)


def patch_many(raw: bytes, edits: Iterable[tuple[Path, Any]]) -> bytes:
    for path, value in edits:
        raw = patch(raw, path, value)
    return raw


def patch_decoded(raw: bytes, obj: Any, edits: list[tuple[Path, Any]]) -> bytes | None:
    """:func:`patch_many`'s bytes, computed from ``obj``, the item ``raw`` decoded (and no longer
    needed: it is changed in place), when ``raw`` is exactly msgspec's encoding of ``obj``; else
    None.  In that case every value's raw bytes are its encoding, so re-encoding the whole item
    with the new values is what patching re-encodes along each path (an agent's compact JSON, as
    Node's ``JSON.stringify`` writes it: one encode instead of a decode and an encode per level
    and per edit)."""
    if _enc.encode(obj) != raw:
        return None
    try:
        for path, value in edits:
            if not path or value is DELETE:
                return None
            parent = obj
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            if isinstance(parent, list) != isinstance(last, int) or (isinstance(parent, dict) and last not in parent):
                return None  # patch would fail or add a key: its own path
            parent[last] = value
    except (KeyError, IndexError, TypeError):
        return None
    return _enc.encode(obj)


class LaneDefaults:
    """What most lanes do for the optional parts of the :class:`~bili_addon.wire.Lane` protocol."""

    @staticmethod
    def note_in_item(raw: bytes, text: str) -> bytes | None:
        return None  # no place for prose in the item: a reminder is an item of its own

    @staticmethod
    def join_user(raw: bytes, text: str, *, before: bool) -> bytes | None:
        return None  # the API takes user turns in a row (and merges them)

    @staticmethod
    def transplant_hints(row: bytes, client: bytes) -> bytes:
        return row  # no per-turn transport hints in the items


class Body:
    """A request body split into untouched top-level raw values and the conversation item array."""

    __slots__ = ("top", "key", "items", "array", "compact", "shared")

    def __init__(self, raw: bytes, key: str, prevs: "Iterable[Split]" = ()):
        # compact: where the conversation array lies in the body's bytes, when those are exactly its
        # members' keys (written without escapes) and raw values, and the items in its array, with
        # nothing between them but the JSON punctuation (else None).  ``prevs``: earlier compact
        # bodies' layouts (Splits): this one is read from the first that applies, where the two
        # share their bytes, and ``shared`` is then ``(that layout, how many leading items the two
        # bodies have in common, where this body's items end)``
        self.shared = None
        if key in _COMPACT and type(raw) is bytes:
            for prev in prevs:
                got = prev.derive(raw) if prev.key == key else None
                if got is not None:
                    self.top, self.items, self.compact, j, ends = got
                    self.shared = (prev, j, ends)
                    self.key, self.array = key, True
                    return
            split = _split_compact(raw, key)
            if split is not None:
                self.top, self.items, self.compact = split
                self.key, self.array = key, True
                return
        self.compact = None
        try:
            self.top = _dec_raw_obj.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise CodecError(f"body is not a JSON object: {e}") from None
        self.key = key
        conv = self.top.get(key)
        # a conversation that is not an array (Responses' plain-string ``input``) has no items
        self.array = conv is not None and memoryview(conv)[:1] == b"["  # (bytes(conv) would copy it all)
        self.items: list[msgspec.Raw] = decode_list(conv) if self.array else []

    def get(self, key: str, default: Any = None) -> Any:
        raw = self.top.get(key)
        return default if raw is None else _dec_any.decode(raw)

    def set(self, key: str, value: Any) -> None:
        self.top[key] = msgspec.Raw(_enc.encode(value))

    def encode(self, items: list[bytes] | None) -> bytes:
        """Re-emit the body; ``items`` replaces the conversation array when given.  The body is
        msgspec's encoding of ``top`` (``{"key":raw,...}``, each key encoded as msgspec encodes
        it): written here in one join of the pieces, the items copied once, not three times
        (joined, bracketed, then copied again into the top object's encoding)."""
        if items is None or not self.array:
            return _enc.encode(self.top)
        pieces: list = []
        add = pieces.append
        sep = b"{"
        at = after = 0  # where the array lies in the result: its start, the first piece after it
        written = _KEY_BYTES  # (the keys agents send, as msgspec writes them, with their colon)
        for k, v in self.top.items():
            add(sep)
            sep = b","
            kb = written.get(k)
            add(kb if kb is not None else _enc.encode(k) + b":")
            if k == self.key:
                at = sum(map(len, pieces))
                n = len(items)
                if n:  # ``[``, the items with a comma between each two, ``]``: laid out by slices
                    array = [b","] * (2 * n + 1)
                    array[0], array[-1] = b"[", b"]"
                    array[1::2] = items
                    pieces += array
                else:
                    add(b"[]")
                after = len(pieces)
            else:
                add(v)
        add(b"}" if pieces else b"{}")
        joined = b"".join(pieces)
        # (its end: the result's length less what follows it, the few top-level values after it,
        # not the sum of every item's length)
        end = len(joined) - sum(map(len, pieces[after:]))
        self.top[self.key] = msgspec.Raw(memoryview(joined)[at:end])  # the new array (no copy of it)
        return joined


# The top-level keys of the Messages and Chat Completions requests agents send (the conversation
# under "messages"), and of the Responses requests (under "input"), for Body's one-scan split
# (_split_compact); a key not here sends a body the general way.
_TOP_KEYS = (
    "model", "max_tokens", "system", "tools", "tool_choice", "metadata", "thinking", "context_management",
    "context_hint", "output_config", "output_format", "temperature", "top_p", "top_k", "stop_sequences", "stream",
    "stream_options", "store", "max_completion_tokens", "reasoning_effort", "parallel_tool_calls",
    "response_format", "seed", "n", "stop", "user", "prompt_cache_key", "safety_identifier", "service_tier",
    "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "logit_bias", "modalities",
    "verbosity", "reasoning", "container", "mcp_servers", "betas", "session_id", "biliMsgIds",
)
_INPUT_TOP_KEYS = (
    "model", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "store", "stream",
    "stream_options", "include", "prompt_cache_key", "prompt_cache_retention", "client_metadata", "text",
    "temperature", "top_p", "top_logprobs", "max_output_tokens", "max_tool_calls", "metadata", "user",
    "safety_identifier", "service_tier", "truncation", "previous_response_id", "background", "prompt",
    "conversation", "session_id", "biliMsgIds",
)


def _top_struct(key: str, keys: tuple[str, ...]) -> tuple[msgspec.json.Decoder, tuple[str, ...]]:
    typ = msgspec.defstruct("_Top_" + key, [(key, list[msgspec.Raw], msgspec.UNSET)]
                            + [(k, msgspec.Raw, msgspec.UNSET) for k in keys], gc=False)
    return msgspec.json.Decoder(typ), keys


# the conversation's key -> the decoder of its compact bodies and their other keys, in its order
_COMPACT = {"messages": _top_struct("messages", _TOP_KEYS), "input": _top_struct("input", _INPUT_TOP_KEYS)}
_KEY_BYTES = {k: b'"' + k.encode() + b'":' for k in ("messages", "input", *_TOP_KEYS, *_INPUT_TOP_KEYS)}
_KEY_NAMES = {k.encode(): k for k in _KEY_BYTES}  # a key as written (no escapes) -> its name
# (the conversation's key, how many members) -> their order in the last such compact body (_ordered)
_ORDER: dict[tuple[str, int], tuple] = {}


def _split_compact(raw: bytes, key: str = "messages"
                   ) -> tuple[dict[str, msgspec.Raw], list[msgspec.Raw], tuple[int, int]] | None:
    """``(top, items)`` as Body reads them, in one scan of the body instead of two (the top
    object, then the conversation array again), when the body is compact at its top level and in
    its array (``{"k":v,...,"messages":[item,...],...}``, no space between them: Node's
    ``JSON.stringify``, Rust's serde_json) and holds only keys its conversation's key knows
    (:data:`_COMPACT`: ``messages``, ``input``); else None.  The body is decoded into a struct (each
    value a raw slice, the items one each); its size proves it is exactly those members written
    compactly, and the members are then read off in the order they stand, one step each (no search
    through the body: the conversation stands before most keys, as agents write them): those are
    exactly the keys, order and values the general split would give.  The third value: where the
    conversation array lies in ``raw`` (from its ``[`` to past its ``]``)."""
    dec, top_keys = _COMPACT[key]
    try:
        t = dec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    values = msgspec.structs.astuple(t)
    items = values[0]
    unset = msgspec.UNSET
    if items is unset:
        return None
    n_items = len(items)
    array = 2 + sum(map(len, items)) + (n_items - 1 if n_items else 0)  # the array's size, written compactly
    # The members mostly stand in the order the last body of this conversation key had them (an agent
    # writes its bodies alike): that order is tried first, its members' keys checked where they
    # would stand (see _ordered); else the members are read off one by one (_members), and their order
    # kept for the next body.  Both read the same members in the same order, or give None.
    order = _ORDER.get((key, len(values) - values.count(unset)))  # (by how many members: agents of other kinds)
    if order is not None:
        got = _ordered(raw, t, values, order, array)
        if got is not _MISS:
            return (got[0], items, got[1]) if got is not None else None
    sizes = {k: len(v) for k, v in zip(top_keys, values[1:]) if v is not unset}
    sizes[key] = array
    got = _members(raw, key, t, sizes)
    if got is None:
        return None
    top, span = got
    # (the order learnt: which values stand where, their keys as written, the fixed bytes before each value)
    index = {k: i for i, k in enumerate((key, *top_keys))}
    names = tuple(top)
    fixed = list(accumulate(len(_KEY_BYTES[k]) + 1 for k in names))  # each member's key and the separator before it
    conv = names.index(key)
    _ORDER[key, len(names)] = (tuple(index[k] for k in names), names, tuple(_KEY_BYTES[k] for k in names), fixed, conv)
    return top, items, span


def _members(raw: bytes, key: str, t: Any, sizes: dict[str, int]
             ) -> tuple[dict[str, msgspec.Raw], tuple[int, int]] | None:
    """:func:`_split_compact`'s members, read off one by one in the order they stand, and the array's span."""
    # The body holds at least, apart from each other: its braces, each member's key ("k": at the
    # least: a key written with escapes is longer), its value (a raw slice), a comma between
    # members, and in the array its brackets, the items and a comma between them.  Exactly that
    # many bytes: nothing else is in it (no space, no other or repeated key, no key written with
    # escapes), so it is those members, each once, in some order, one right after the other.
    key_bytes = _KEY_BYTES
    if 1 + sum(map(len, map(key_bytes.__getitem__, sizes))) + sum(sizes.values()) + len(sizes) != len(raw):
        return None
    top: dict[str, msgspec.Raw] = {}
    names, find, view = _KEY_NAMES, raw.find, memoryview(raw)
    off = 1
    for _ in range(len(sizes)):  # each member where the one before it ends: its key, then its value
        q = find(b'":', off + 1)
        k = names.get(raw[off + 1:q]) if raw[off:off + 1] == b'"' and q > 0 else None
        if k is None or k in top or k not in sizes:
            return None  # (cannot happen once the size holds: kept as a guard)
        at = q + 2
        end = at + sizes[k]
        if k == key:
            top[k], span = msgspec.Raw(view[at:end]), (at, end)
        else:
            top[k] = getattr(t, k)
        off = end + 1  # (past the comma, or the closing brace after the last member)
    if off != len(raw):
        return None
    return top, span


def _ordered(raw: bytes, t: Any, values: tuple, order: tuple, array: int) -> Any:
    """:func:`_members` read in a known ``order`` (``(value indices, names, keys as written, fixed
    bytes before each value, the array's position)``) when the body holds exactly the members it
    names (the caller found as many): the members (None: the body is not compact, as
    _members finds it) or _MISS (not in that order: _members reads it).  The size proves the body
    is those members in some order (see _members); each key then stands where this order puts it
    exactly when it is this order (no key's name holds ``"``), which is what _members reads."""
    idx, names, keys, fixed, conv = order
    vals = list(map(values.__getitem__, idx))
    if msgspec.UNSET in vals:
        return _MISS  # (other members than the order's)
    sizes = list(map(len, vals))
    sizes[conv] = array
    ends = list(accumulate(sizes))  # each value's end, less the bytes before it of keys and separators
    if fixed[-1] + ends[-1] + 1 != len(raw):
        return None  # (_members would find the size wrong)
    offs = list(map(int.__add__, fixed, ends))  # past each value, less one: the next member's separator
    if not all(map(raw.startswith, keys, [1, *[o + 1 for o in offs[:-1]]])):
        return _MISS
    top = dict(zip(names, vals))
    end = offs[conv]  # (past the array's ``]``)
    at = end - array
    top[names[conv]] = msgspec.Raw(memoryview(raw)[at:end])
    return top, (at, end)


def common_prefix_bytes(a: bytes, b: bytes, limit: int | None = None) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (at most ``limit``): memcmp in
    chunks (no copy), then halving within the chunk that differs."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    mv = memoryview(a)
    lo = 0
    while lo < n:
        hi = min(n, lo + _CHUNK)
        if not b.startswith(mv[lo:hi], lo):
            break
        lo = hi
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if b.startswith(mv[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


_CHUNK = 1 << 16
_PLUS_ONE = (1).__add__


class Split:
    """Where a compact body's members and items lie (:class:`Body` read it so): enough to read a later
    body that shares its bytes without scanning them again (:meth:`derive`)."""

    __slots__ = ("raw", "key", "keys", "sizes", "at", "items", "ends")

    def __init__(self, raw: bytes, key: str, top: dict[str, msgspec.Raw], items: list[msgspec.Raw], at: int,
                 ends: list[int] | None = None):
        self.raw = raw
        self.key = key  # the conversation's
        self.keys = list(top)  # in the order they stand (a compact split reads them so)
        self.sizes = list(map(len, top.values()))
        self.at = at  # the conversation array's ``[``
        self.items = items  # (the Body's list, never changed: the pass that follows compares against it)
        # where each item ends (exclusive; a comma or the ``]`` follows): computed when first
        # needed, or carried over from the layout this body was read from
        self.ends = ends

    def derive(self, raw: bytes) -> tuple[dict[str, msgspec.Raw], list[msgspec.Raw], tuple[int, int], int,
                                          list[int]] | None:
        """``(top, items, span, j, ends)`` of ``raw``: its split as :func:`_split_compact` reads it,
        from this layout, how many leading items it shares with this body's (``j``), and where its
        items end; or None.  ``raw`` must hold this body's bytes up to the end of some
        of its items (a common prefix: the items that end in it are the same items, each where it
        was) and its bytes from the array's ``]`` to the end (the same members after the array, each
        shifted by the same amount); between the two, only whole items with a comma before each (no
        space: compact) are read, by one decode of them alone.  That makes ``raw`` this body with
        its items after the shared ones replaced: valid JSON with the same members (the grammar's
        state at each end of the middle is the one the earlier body had there), so exactly what the
        full split reads."""
        old = self.raw
        at = self.at
        ends = self.ends
        if ends is None:
            ends = list(accumulate(map(_PLUS_ONE, map(len, self.items)), initial=at))[1:]
        close = ends[-1] if ends else at + 1  # the ``]`` of this body's array
        tail = len(old) - close
        close_new = len(raw) - tail
        if close_new <= at or not raw.endswith(memoryview(old)[close:]):
            return None
        shared = common_prefix_bytes(old, raw, close)
        j = bisect_right(ends, shared)  # items wholly in the shared prefix
        start = ends[j - 1] if j else at + 1
        if shared < start or close_new < start:  # (the members before the array and its ``[`` shared too)
            return None
        view = memoryview(raw)
        raw_of = msgspec.Raw
        ends = ends[:j]
        # the shared items are this body's items (the same bytes: each as it was read, a slice of the
        # body it first came in or its own copy); a new item is a copy of its own bytes, not a slice of
        # this body (a slice would keep the whole body alive as long as the conversation's items live:
        # one body per turn)
        items = self.items[:j]
        if close_new > start:  # new items (after a comma when an item stands before them)
            first = start
            if j:
                if raw[start] != 44:  # ","
                    return None
                first += 1
            try:
                more = _dec_raw_list.decode(b"[" + raw[first:close_new] + b"]")
            except (msgspec.ValidationError, msgspec.DecodeError):
                return None
            sizes = list(map(len, more))
            if sum(sizes) + len(sizes) - 1 != close_new - first:  # a space between them: not compact
                return None
            new_ends = list(accumulate(map(_PLUS_ONE, sizes), initial=first - 1))[1:]
            new_starts = list(map(int.__sub__, new_ends, sizes))
            items += map(raw_of, map(raw.__getitem__, map(slice, new_starts, new_ends)))
            ends += new_ends
        # the members in their order, each key then its value: those after the array follow its new end
        top: dict[str, msgspec.Raw] = {}
        off = 1
        key_bytes = _KEY_BYTES
        conv = self.key
        for k, size in zip(self.keys, self.sizes):
            begin = off + len(key_bytes[k])
            if k == conv:
                if begin != at:
                    return None  # (cannot happen: the layout is the split's own)
                top[k] = raw_of(view[at:close_new + 1])
                off = close_new + 2
            else:
                top[k] = raw_of(view[begin:begin + size])
                off = begin + size + 1
        return top, items, (at, close_new + 1), j, ends


class Splits:
    """The layouts of recent compact bodies (:class:`Split`) by a key the caller chooses (a
    conversation's id from its headers, else the body's first bytes): a follow-up turn's body is read
    from its predecessor's layout, only its new items scanned.  Two layouts per key (an agent's side
    requests, a title or a summary, come with the conversation's id and bodies of their own); at
    most ``keep`` keys whose bodies hold ``max_bytes`` together (the least recently used go first;
    the newest always stays)."""

    PER_KEY = 2

    def __init__(self, keep: int = 256, max_bytes: int = 128 << 20):
        self.keep, self.max_bytes = keep, max_bytes
        self.size = 0
        self.last: OrderedDict[Any, list[Split]] = OrderedDict()

    def body(self, raw: bytes, key: str, memo_key: Any) -> Body:
        """``Body(raw, key)``, read from a layout kept under ``memo_key`` where one applies (the most
        recent first); a compact body's layout is kept under it for the next (None: neither)."""
        if memo_key is None:
            return Body(raw, key)
        last = self.last
        kept = last.pop(memo_key, None) or []
        body = Body(raw, key, kept)
        if body.shared is not None:  # (its layout is replaced by this body's)
            kept.remove(body.shared[0])
            self.size -= len(body.shared[0].raw)
        if body.compact is not None:
            kept.insert(0, Split(raw, key, body.top, body.items, body.compact[0],
                                 body.shared[2] if body.shared is not None else None))
            self.size += len(raw)
            while len(kept) > self.PER_KEY:
                self.size -= len(kept.pop().raw)
        if kept:
            last[memo_key] = kept
            while len(last) > 1 and (len(last) > self.keep or self.size > self.max_bytes):
                self.size -= sum(len(x.raw) for x in last.popitem(last=False)[1])
        return body


def idless_call_key(name: str, args: Any) -> str:
    """The key of a tool call that carries no id (Gemini): its name and its arguments, canonical,
    so two calls of the same tool stay apart and a re-serialised call keeps its key.  No arguments
    are empty arguments (the request side reads a missing ``args`` as ``{}``)."""
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = _dec_any.decode(args)
        except (msgspec.DecodeError, ValueError):
            pass
    canon = msgspec.json.Encoder(order="sorted").encode(args)
    return f"name:{name}:" + hashlib.sha256(canon).hexdigest()[:12]


# -- what the fold and the proxy tools need from every lane ------------------------------------

PROMPT_SEPARATOR = "\n\n---\n\n"


def tool_names(raw_tools: msgspec.Raw | None, name_of) -> list[str] | None:
    """Names of the request's tools (None when it declares none: side requests get no injection)."""
    if raw_tools is None or bytes(raw_tools)[:1] != b"[":
        return None
    names = []
    for t in decode_list(raw_tools):
        n = name_of(decode_any(t))
        if n is not None:
            names.append(n)
    return names


def append_tools(body: Body, key: str, existing: list[str], new: list[dict]) -> bool:
    """Append the tools whose names are absent, after the agent's own (byte-exact) ones."""
    missing = [t for t in new if t["_name"] not in existing]
    if not missing:
        return False
    items = decode_list(body.top[key])
    items.extend(msgspec.Raw(encode({k: v for k, v in t.items() if k != "_name"})) for t in missing)
    body.top[key] = msgspec.Raw(encode(items))
    return True


def append_to_text_value(raw: msgspec.Raw, prompt: str, part: dict) -> msgspec.Raw | None:
    """A system value that is a string gets the prompt appended; an array gets one more part."""
    first = bytes(raw)[:1]
    if first == b'"':
        return msgspec.Raw(encode(decode_any(raw) + PROMPT_SEPARATOR + prompt))
    if first == b"[":
        items = decode_list(raw)
        items.append(msgspec.Raw(encode(part)))
        return msgspec.Raw(encode(items))
    return None


# -- the same injection, turn after turn -------------------------------------------------------
#
# An agent sends the same tools array on every turn of a session (and of its other sessions), most
# send the same system prompt too, and bili injects constant tools and a constant prompt: what a
# lane reads for the injection is almost always the bytes it read before, and so is what it writes.
# A lane keeps what it wrote for the last few inputs it saw (each input whole: every byte of each
# raw value it reads, bili's tools as msgspec encodes them, the very prompt and name objects) and
# sets it back into the body when its inputs are exactly one of those again.  The tools and the
# prompt are kept apart: a system that changes every request (Claude Code's ``cch`` billing block)
# misses the prompt's memo and leaves the tools' (the larger part) to hit.

_MISS = object()
_is = operator.is_
_KEY_TYPES = (msgspec.Raw, bytes, str, bool, type(None))
_KEY_TYPESET = frozenset(_KEY_TYPES)


class Memo:
    """The values stored under the last few keys, the latest first.  A key is a tuple compared
    ``==`` element by element (a ``msgspec.Raw`` compares its bytes; the elements are of
    :data:`_KEY_TYPES`), plus ``names``: a hit needs those very objects (strings, kept alive by the
    entry, so no other object has their identity)."""

    __slots__ = ("entries", "size")

    def __init__(self, size: int = 8):
        self.entries: list[tuple[tuple, tuple, Any]] = []
        self.size = size

    def get(self, key: tuple, names: list | tuple = ()) -> Any:
        entries = self.entries
        n = len(names)
        for i, entry in enumerate(entries):
            k, ns, value = entry
            if k == key and len(ns) == n and all(map(_is, ns, names)):
                if i:  # (a new list, set in one step: a concurrent reader sees one list or the other)
                    self.entries = [entry, *entries[:i], *entries[i + 1:]]
                return value
        return _MISS

    def put(self, key: tuple, names: tuple, value: Any) -> None:
        self.entries = [(tuple(map(_owned, key)), names, value), *self.entries[: self.size - 1]]

    def clear(self) -> None:
        self.entries = []


def _owned(value: Any) -> Any:
    """A key's element as the memo keeps it: a raw value's own bytes (not a view that holds the body)."""
    return value.copy() if type(value) is msgspec.Raw else value


def memo_tool_names(memo: Memo, raw: Any, compute) -> list[str] | None:
    """``compute()`` (a lane's tool names), or the names it gave for the same tools bytes before (a new list)."""
    if raw is None or (type(raw) is not msgspec.Raw and type(raw) is not bytes):
        return compute()
    value = memo.get((raw,))
    if value is not _MISS:
        return None if value is None else list(value)
    names = compute()
    if names is None:
        memo.put((raw,), (), None)
    elif type(names) is list and all(type(n) is str for n in names):
        memo.put((raw,), (), tuple(names))
    return names


_TOOLS_JSON: tuple[tuple, bytes] = ((), b"[]")  # (the last Frozen tools _tools_json wrote, and their JSON)


def _tools_json(tools: list) -> bytes:
    """``encode(tools)``: from the Frozen tools' own encodings, when every one is Frozen (never changed
    since it was written), else encoded; the very bytes object of the last call when the tools are
    the same Frozen objects again (the memo's key then compares by identity, not byte by byte)."""
    global _TOOLS_JSON
    last, written = _TOOLS_JSON
    if len(tools) == len(last) and all(map(_is, tools, last)):
        return written
    for t in tools:
        if type(t) is not Frozen:
            return encode(tools)
    written = b"[" + b",".join([t.json for t in tools]) + b"]"
    _TOOLS_JSON = (tuple(tools), written)  # (one assignment: a concurrent reader sees either)
    return written


def memo_tools(memo: Memo, body: Body, tools: list[dict], names: list[str], run) -> bool:
    """``run()`` (a lane's tools half of the injection: bili's tools after the agent's, in
    ``body.top["tools"]``), or its effect replayed when the agent's tools bytes, bili's tools and
    the names (the same objects) are the ones it ran on before."""
    if not tools or type(names) is not list:
        return run()
    raw = body.top.get("tools")
    if type(raw) is not msgspec.Raw and type(raw) is not bytes:
        return run()  # (none: the lane's own code fails)
    try:
        key = (_tools_json(tools), raw)
    except (TypeError, ValueError):
        return run()
    return _replay_or_run(memo, key, names, body, None, 0, run, False, False, True)


def memo_prompt(memo: Memo, body: Body, items: list, start: int, prompt: str, reads: tuple, run, *,
                reads_item: bool = False, inserts: bool = False) -> bool:
    """``run()`` (a lane's prompt half of the injection), or its effect replayed when it saw these
    inputs before.  ``reads``: the raw values of ``body`` it reads, as they are (``None`` for a
    missing key); ``reads_item``: it also reads the item before ``start`` (and may replace it);
    ``inserts``: it may insert one item at ``start`` (and changes no other item)."""
    if type(prompt) is not str or type(items) is not list:
        return run()
    item = None
    if reads_item and start > 0:
        if start > len(items):
            return run()  # (the lane's own code fails there)
        item = items[start - 1]
    key = (prompt, start > 0, body.array, item, *reads)
    return _replay_or_run(memo, key, (), body, items, start, run, reads_item, inserts)


def _replay_or_run(memo: Memo, key: tuple, names: list | tuple, body: Body, items: list | None, start: int, run,
                   reads_item: bool, inserts: bool, typed: bool = False) -> bool:
    """The effect kept under ``key`` and ``names`` set into the body (the top-level values the run
    set, in the order they stand: a new key lands last, as the run added it; an item replaced
    before ``start`` or inserted at ``start``) and the run's result; else the run, and its effect
    kept when it has that shape.  ``typed``: the caller made the key of :data:`_KEY_TYPES` (not checked again)."""
    if not typed and not _KEY_TYPESET.issuperset(map(type, key)):  # (a type of _KEY_TYPES each)
        return run()
    value = memo.get(key, names)
    top = body.top
    if value is not _MISS:
        writes, op, new_item, result = value
        for k, v in writes:
            top[k] = v
        if op == 1:
            items[start - 1] = new_item
        elif op == 2:
            items.insert(start, new_item)
        return result
    before = dict(top)
    n = len(items) if items is not None else 0
    prev = items[start - 1] if reads_item and 0 < start <= n else None
    at = items[start] if inserts and 0 <= start < n else None
    result = run()
    if type(result) is not bool or body.top is not top or any(type(x) is not str for x in names):
        return result
    if list(top)[: len(before)] != list(before):
        return result  # a key removed or moved: not an effect a replay makes
    writes = tuple((k, _owned(v)) for k, v in top.items() if before.get(k, _MISS) is not v)
    if any(type(v) is not msgspec.Raw for _, v in writes):
        return result
    op, new_item = 0, None
    if items is not None:
        if len(items) == n:
            if prev is not None and items[start - 1] is not prev:
                op, new_item = 1, items[start - 1]
        elif len(items) == n + 1 and inserts and 0 <= start <= n and (start == n or items[start + 1] is at) \
                and (prev is None or items[start - 1] is prev):
            op, new_item = 2, items[start]
        else:
            return result
        if op and type(new_item) is not bytes:
            return result
    memo.put(key, tuple(names), (writes, op, new_item, result))
    return result
