"""Server-sent events over mitmproxy's streaming callable.

mitmproxy hands ``flow.response.stream`` raw network chunks, not events: an event may be split
anywhere and several may share a chunk.  ``SSEStream`` reassembles events for any chunking and
framing (``\\n``, ``\\r\\n``, ``\\r``), passes each to a transform, and never returns ``b""``
before the end (that would terminate an HTTP/1.1 chunked body).
"""

from __future__ import annotations

import logging
import re
import zlib
from typing import Callable, Iterable

from bili_addon import printable

log = logging.getLogger("bili")

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
_LINE = re.compile(rb"\r\n|\n|\r")

Transform = Callable[[bytes], Iterable[bytes]]


class SSEEvent:
    """One event: its field lines, its ``data`` payload, and the line ending it arrived with."""

    __slots__ = ("lines", "eol", "name")

    def __init__(self, raw: bytes):
        m = _LINE.search(raw)
        self.eol = m.group(0) if m else b"\n"
        self.lines = [ln for ln in _LINE.split(raw) if ln]

    @property
    def data(self) -> bytes | None:
        parts = [ln[5:].removeprefix(b" ") for ln in self.lines if ln.startswith(b"data:")]
        return b"\n".join(parts) if parts else None

    def with_data(self, data: bytes) -> bytes:
        out, done = [], False
        for ln in self.lines:
            if ln.startswith(b"data:"):
                if not done:
                    out.append(b"data: " + data)
                    done = True
            else:
                out.append(ln)
        if not done:
            out.append(b"data: " + data)
        return self.eol.join(out) + self.eol + self.eol


class SSEStream:
    """The callable for ``flow.response.stream``: chunks in, whole (transformed) events out."""

    def __init__(self, transform: Transform, finish: Callable[[], Iterable[bytes]] | None = None,
                 decoder: "Decoder | None" = None):
        self.buf = b""
        self.transform = transform
        self.finish = finish
        self.decoder = decoder

    def __call__(self, chunk: bytes) -> list[bytes]:
        final = chunk == b""
        if self.decoder is not None:
            try:
                chunk = self.decoder.flush() if final else self.decoder.feed(chunk)
            except Exception as e:  # (mitmproxy calls this outside its addon guard: a raise drops the connection)
                # fail open: the rest goes on as it arrives (a stream labelled compressed but sent plain
                # is then read right; a corrupt one reaches the agent as it would have without bili)
                log.warning("[bili] a %s stream did not decode (%s: %s); the rest passes as it arrives",
                            printable(self.decoder.encoding), type(e).__name__, printable(e))
                self.decoder = None
                if isinstance(e, Undecodable):  # what decoded before the failure, then the rest as it came
                    chunk = e.decoded + e.rest
        self.buf += chunk
        out: list[bytes] = []
        pos = 0
        for m in _EVENT_END.finditer(self.buf):
            out.extend(self.transform(self.buf[pos : m.end()]))
            pos = m.end()
        self.buf = self.buf[pos:]
        if final:
            if self.buf:
                out.extend(self.transform(self.buf))
                self.buf = b""
            if self.finish is not None:
                out.extend(self.finish())
        return [b for b in out if b]


class Decoder:
    """Incremental content-decoding of a compressed stream (gzip, deflate, br, zstd)."""

    def __init__(self, encoding: str):
        enc = encoding.strip().lower()
        if enc in ("gzip", "x-gzip"):
            self._d = _Members(lambda: zlib.decompressobj(16 + zlib.MAX_WBITS))
        elif enc == "deflate":
            self._d = _Deflate()
        elif enc == "br":
            import brotli  # mitmproxy depends on it

            self._d = brotli.Decompressor()
        elif enc == "zstd":
            try:
                from compression import zstd  # Python 3.14
            except ImportError:
                from backports import zstd  # mitmproxy depends on it
            self._d = _Members(zstd.ZstdDecompressor)
        else:
            raise ValueError(f"unsupported content-encoding {encoding!r}")
        self.encoding = enc

    def feed(self, chunk: bytes) -> bytes:
        d = self._d
        if hasattr(d, "decompress"):
            return d.decompress(chunk)
        return d.process(chunk)  # brotli.Decompressor

    def flush(self) -> bytes:
        d = self._d
        return d.flush() if hasattr(d, "flush") else b""


class Undecodable(Exception):
    """A chunk that did not decode past some point: ``decoded``, what did before it (earlier
    members of the chunk); ``rest``, the chunk's bytes from the failing member on."""

    def __init__(self, decoded: bytes, rest: bytes, cause: Exception):
        super().__init__(str(cause))
        self.decoded, self.rest = decoded, rest


class _Members:
    """A stream of concatenated gzip members or zstd frames (a server that compresses event by
    event sends one per event; both formats allow it): each decoded by a decompressor of its own."""

    def __init__(self, make: Callable):
        self._make = make
        self._d = make()

    def decompress(self, chunk: bytes) -> bytes:
        out = []
        while True:
            d = self._d
            if d.eof:  # the last member ended: this chunk starts the next
                d = self._d = self._make()
            try:
                out.append(d.decompress(chunk))
            except Exception as e:
                raise Undecodable(b"".join(out), chunk, e) from e
            if not (d.eof and d.unused_data):
                return b"".join(out)
            chunk = d.unused_data

    def flush(self) -> bytes:
        d = self._d
        return d.flush() if hasattr(d, "flush") else b""


class _Deflate:
    """``deflate`` is zlib-wrapped per the RFC but raw in practice; accept both."""

    def __init__(self) -> None:
        self._d: zlib._Decompress | None = None
        self._pending = b""

    def decompress(self, chunk: bytes) -> bytes:
        if self._d is None:
            self._pending += chunk
            if len(self._pending) < 2:
                return b""
            wrapped = (self._pending[0] & 0x0F) == 8 and int.from_bytes(self._pending[:2], "big") % 31 == 0
            self._d = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
            chunk, self._pending = self._pending, b""
        return self._d.decompress(chunk)

    def flush(self) -> bytes:
        return self._d.flush() if self._d is not None else b""
