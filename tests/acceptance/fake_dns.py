"""A DNS server of the tests' own, on a loopback address (UDP and TCP port 53): it answers A and AAAA
questions for the names it is given and NXDOMAIN for every other name, so that a program run under
it resolves the model hosts to test addresses and reaches nothing else (no query leaves loopback).

Only what a stub resolver asks: one question per message, class IN, no recursion, no compression of
incoming names (answers point back at the question's name).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from collections.abc import Mapping, Sequence

A, AAAA, CLASS_IN = 1, 28, 1
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4
TTL = 5


def _question(msg: bytes) -> tuple[str, int, int, int] | None:
    """(name, type, class, end offset) of the first question, or None."""
    if len(msg) < 12 or struct.unpack("!H", msg[4:6])[0] < 1:
        return None
    labels, i = [], 12
    while i < len(msg):
        n = msg[i]
        if n == 0:
            i += 1
            break
        if n & 0xC0:  # a pointer: never in a stub resolver's question
            return None
        labels.append(msg[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    if i + 4 > len(msg):
        return None
    qtype, qclass = struct.unpack("!HH", msg[i:i + 4])
    return ".".join(labels).lower(), qtype, qclass, i + 4


def answer(msg: bytes, names: Mapping[str, Sequence[str]]) -> bytes | None:
    """The reply to one DNS query (``names``: name -> its addresses, IPv4 and IPv6 mixed)."""
    if len(msg) < 12:
        return None
    qid, flags = struct.unpack("!HH", msg[:4])
    q = _question(msg)
    rd = flags & 0x0100
    if q is None:
        return struct.pack("!HHHHHH", qid, 0x8000 | rd | FORMERR, 0, 0, 0, 0)
    name, qtype, qclass, end = q
    question = msg[12:end]
    if qclass != CLASS_IN:
        return struct.pack("!HHHHHH", qid, 0x8000 | rd | NOTIMP, 1, 0, 0, 0) + question
    known = name.rstrip(".") in names
    records = []
    for addr in names.get(name.rstrip("."), ()):
        ip = ipaddress.ip_address(addr)
        rtype = A if ip.version == 4 else AAAA
        if rtype == qtype:
            records.append(struct.pack("!HHHIH", 0xC00C, rtype, CLASS_IN, TTL, len(ip.packed)) + ip.packed)
    rcode = NOERROR if known else NXDOMAIN
    head = struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | rd | 0x0080 | rcode, 1, len(records), 0, 0)
    return head + question + b"".join(records)


class FakeDns:
    """Serves :func:`answer` on ``ip``:53 (UDP and TCP) until :meth:`close`; ``asked`` records
    (name, type, client address) of every question, in order."""

    def __init__(self, ip: str, names: Mapping[str, Sequence[str]]):
        self.ip = ip
        self.names = {k.lower().rstrip("."): list(v) for k, v in names.items()}
        self.asked: list[tuple[str, int, str]] = []
        self._stop = threading.Event()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.udp.bind((ip, 53))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((ip, 53))
        self.tcp.listen()
        for s in (self.udp, self.tcp):
            s.settimeout(0.2)  # the loops look at the stop flag in between
        self._threads = [threading.Thread(target=self._serve_udp, daemon=True),
                         threading.Thread(target=self._serve_tcp, daemon=True)]
        for t in self._threads:
            t.start()

    def _reply(self, msg: bytes, peer: str) -> bytes | None:
        q = _question(msg)
        if q is not None:
            self.asked.append((q[0], q[1], peer))
        return answer(msg, self.names)

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                msg, peer = self.udp.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            out = self._reply(msg, peer[0])
            if out is not None:
                try:
                    self.udp.sendto(out, peer)
                except OSError:
                    continue

    def _serve_tcp(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    head = conn.recv(2)
                    if len(head) < 2:
                        continue
                    n = struct.unpack("!H", head)[0]
                    msg = b""
                    while len(msg) < n:
                        chunk = conn.recv(n - len(msg))
                        if not chunk:
                            break
                        msg += chunk
                    out = self._reply(msg, peer[0])
                    if out is not None:
                        conn.sendall(struct.pack("!H", len(out)) + out)
                except OSError:
                    continue

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for s in (self.udp, self.tcp):
            s.close()
