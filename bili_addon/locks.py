"""Sessions' locks across the processes that share one embedded (SQLite) store.

PostgreSQL serialises a session's turns across instances with an advisory lock; this gives SQLite
the same: one byte of a lock file beside the database, at an offset hashed from the session's id,
locked for writing while a process works on the session.  Linux's open-file-description locks
(``F_OFD_SETLK``) belong to the open file, not to the process, so two stores opened in one process
exclude each other too; elsewhere POSIX record locks (``lockf``: per process) are used.  The kernel
drops a dead process's locks.  Two sessions whose offsets collide (one in 2**62) merely wait for
each other.

With the lock, a turn's refs are given by one process at a time and its write lands before the
lock goes: what lets the engine send a request before its write (``Engine.write_behind``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # (Windows: no such locks; the engine then writes before it sends)
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "sessions.lock"
_OFD = getattr(fcntl, "F_OFD_SETLK", None) if fcntl is not None else None
# struct flock on Linux: l_type, l_whence (shorts), l_start, l_len (off_t), l_pid (0 for OFD locks), padding
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)


def offset(session_id: str) -> int:
    """The byte that stands for the session in the lock file."""
    off = _OFFSETS.get(session_id)
    if off is None:  # (a session's every turn locks the same byte: its hash made once, ~1 us warm, ~8 cold)
        off = int.from_bytes(hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                             "big") >> 2
        if len(_OFFSETS) >= _OFFSETS_KEPT:
            _OFFSETS.clear()
        _OFFSETS[session_id] = off
    return off


# the offsets of the sessions locked lately (all dropped when this many are kept)
_OFFSETS: dict[str, int] = {}
_OFFSETS_KEPT = 4096


class SessionLocks:
    """The sessions this store holds, each until :meth:`release` (all at once)."""

    def __init__(self, path: Path, wait: float):
        self.wait = wait  # seconds a session held by another process is waited for
        self.held: set[str] = set()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)

    def _try(self, off: int, lock: bool, length: int = 1) -> bool:
        """Lock (or unlock) ``length`` bytes from ``off`` (0: to the end of any file); False when
        another holds them."""
        if _OFD is not None:
            kind = fcntl.F_WRLCK if lock else fcntl.F_UNLCK
            try:
                fcntl.fcntl(self.fd, _OFD, _FLOCK.pack(kind, os.SEEK_SET, off, length, 0))
            except OSError as e:
                if lock and e.errno in _BUSY:
                    return False
                raise
            return True
        try:
            fcntl.lockf(self.fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if lock else fcntl.LOCK_UN, length, off, os.SEEK_SET)
        except OSError as e:
            if lock and e.errno in _BUSY:
                return False
            raise
        return True

    def hold(self, session_id: str) -> bool:
        """Lock the session (a no-op when held already); False when another process held it
        longer than :attr:`wait`."""
        if session_id in self.held:
            return True
        off = offset(session_id)
        deadline, pause = 0.0, 0.0005
        while not self._try(off, True):
            now = time.monotonic()
            if not deadline:
                deadline = now + self.wait
            elif now >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        self.held.add(session_id)
        return True

    def try_hold(self, session_ids: list[str]) -> list[str] | None:
        """Lock every one of the sessions without waiting, or none: the ones it took (not held
        before), or None when another process holds one (what it took is let go again)."""
        taken: list[str] = []
        for sid in session_ids:
            if sid in self.held:
                continue
            if not self._try(offset(sid), True):
                self.let_go(taken)
                return None
            self.held.add(sid)
            taken.append(sid)
        return taken

    def let_go(self, session_ids: list[str]) -> None:
        """Unlock these sessions (the others held stay held)."""
        for sid in session_ids:
            if sid in self.held:
                self.held.discard(sid)
                self._try(offset(sid), False)

    def release(self) -> None:
        """Let every held session go (one call: the whole file's range)."""
        if self.held:
            self.held.clear()
            self._try(0, False, 0)

    def close(self) -> None:
        """Let the file go (the kernel lets its locks go); once: a second close would close whatever file
        took its descriptor's number since (another part of the process's)."""
        self.held.clear()
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            os.close(fd)
        except OSError:
            pass


def open_locks(data_dir: Path, wait: float) -> SessionLocks | None:
    """The store's session locks; None where the platform or the file system has none (the engine
    then writes a turn before its request goes, as it always did)."""
    if fcntl is None:
        return None
    try:
        locks = SessionLocks(data_dir / LOCK_NAME, wait)
        if not locks.hold("\0probe"):  # the file system takes such locks
            locks.close()
            return None
        locks.release()
        return locks
    except OSError:
        return None


__all__ = ["LOCK_NAME", "SessionLocks", "offset", "open_locks"]
