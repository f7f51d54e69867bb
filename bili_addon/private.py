"""What only this user may read: the data dir (0700), the store's files and the admin token (0600),
whatever the umask.  Standard library only: ``bili mcp`` reads the token without mitmproxy.

A data dir, token or store file that another user owns, or may write, is refused (:class:`NotPrivate`),
never used: a data dir in a shared place (``--data-dir /tmp/bili``) that someone else made first would
otherwise hold their token, which bili would trust, and their store file, into which it would write
every conversation.  "This user" is the effective uid (under ``sudo`` root, whose data dir it is).

The admin token is a per-install secret in ``<data dir>/admin-token``; every ``/__bili/`` endpoint
but health answers only a request that carries it (header ``x-bili-token``, or
``Authorization: Bearer``), since loopback is any local user, not this one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

TOKEN_FILE = "admin-token"
TOKEN_HEADER = "x-bili-token"
DIR_MODE = 0o700
FILE_MODE = 0o600
EXPORTS = "exports"  # decompress toFile writes under <data dir>/exports/<session>/ only
BILI_NAMES = ("bili.sqlite3", TOKEN_FILE, EXPORTS, "run", "certs")  # a directory holding one of these is bili's


class NotPrivate(PermissionError):
    """A data dir, token or store file bili does not use: another user's, a link, or writable by others."""


def _mode(st: os.stat_result) -> int:
    return stat.S_IMODE(st.st_mode)


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refusal(path: str | os.PathLike[str], st: os.stat_result, *, tightened: bool = False) -> str | None:
    """Why bili does not use ``path`` (stat ``st``): not this user's, a link, or writable by others
    (``tightened``: bili would have made it private, so its mode is not held against it)."""
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a link: bili follows none to its admin token or its store"
    if st.st_uid != me:
        return (f"{path} belongs to {_user(st.st_uid)}, not to this user, {_user(me)}: bili uses no data dir, "
                "admin token or store another user made (they could read the conversations, or know the token); "
                "choose another --data-dir (bili_data_dir)")
    if st.st_mode & 0o022 and not tightened:
        return (f"{path} is writable by other users (mode {_mode(st):04o}) and bili tightens only a directory of "
                "its own, never a shared one: chmod go-w it, or choose another --data-dir (bili_data_dir)")
    return None


def _refuse(why: str | None) -> None:
    if why is not None:
        raise NotPrivate(why)


def _tightens(p: Path, st: os.stat_result, created: bool = False) -> bool:
    """Would :func:`private_dir` chmod this existing directory of this user?"""
    return bool(created or not st.st_mode & stat.S_ISVTX and (
        not any(p.iterdir()) or any((p / name).exists() for name in BILI_NAMES)))


def private_dir(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` (0700) or tighten it to 0700.  An existing directory is tightened only when it
    is bili's (empty, or holding the store, the token or the exports) and not a shared sticky
    directory such as /tmp.  True when an existing directory's mode was changed.  Raises
    :class:`NotPrivate` for a directory of another user, or one others may write that is not bili's
    to tighten (a link to a directory is followed: its target is checked)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, mode=DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    st = os.stat(p)
    tightens = _mode(st) != DIR_MODE and st.st_uid == os.geteuid() and _tightens(p, st, created)
    _refuse(_refusal(p, st, tightened=tightens))
    if tightens:
        os.chmod(p, DIR_MODE)  # mkdir's mode is masked by the umask
        return not created
    return False


def tighten(path: str | os.PathLike[str], mode: int = FILE_MODE) -> bool:
    """``chmod`` an existing file of this user to ``mode``; True when it was wider.  Raises
    :class:`NotPrivate` for a link or a file of another user (never followed, never used)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    _refuse(_refusal(path, st, tightened=True))
    if not stat.S_ISREG(st.st_mode) or _mode(st) == mode:
        return False
    os.chmod(path, mode)
    return True


def create_private(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` empty and 0600 if it does not exist yet (before SQLite opens it, so neither it
    nor the WAL files SQLite derives from its mode are ever readable by others).  True if created."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    except FileExistsError:
        return False
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    return True


def _dir_refusal(p: Path) -> str | None:
    """Why bili would refuse the existing directory ``p`` (:func:`private_dir`, changing nothing)."""
    st = os.stat(p)
    return _refusal(p, st, tightened=st.st_uid == os.geteuid() and _tightens(p, st))


def refusal(data_dir: str | os.PathLike[str]) -> str | None:
    """Why bili would refuse ``data_dir`` (its token or its store's files), or None; changes nothing
    (``bili doctor``, ``bili mcp``).  What bili would tighten is not held against it."""
    p = Path(data_dir)
    try:
        why = _dir_refusal(p)
        for name in (TOKEN_FILE, "bili.sqlite3", "bili.sqlite3-wal", "bili.sqlite3-shm"):
            if why is None:
                with contextlib.suppress(FileNotFoundError):
                    why = _refusal(p / name, os.lstat(p / name), tightened=True)
    except OSError:
        return None  # not there (yet), or not this user's to look into: said by whatever reads it
    return why


def _read_token(data_dir: str | os.PathLike[str]) -> str | None:
    """The token file's content, or None when there is none or it is empty; raises
    :class:`NotPrivate` for a data dir or token file of another user, writable by others, or a link."""
    _refuse(_dir_refusal(Path(data_dir)))
    path = Path(data_dir) / TOKEN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            _refuse(f"{path} is a link: bili follows none to its admin token or its store")
        raise
    try:
        # (bili tightens its own token, as it does its store's files: its mode is not held against it, or a
        # file system whose modes are all 0777, chmod taking no effect there, refused the token bili wrote)
        _refuse(_refusal(path, os.fstat(fd), tightened=True))
        text = os.read(fd, 4096).decode("ascii").strip()
    finally:
        os.close(fd)
    return text or None


def read_token(data_dir: str | os.PathLike[str]) -> str | None:
    """The install's admin token, or None when there is none (yet), it cannot be read, or it is not
    this user's alone (:class:`NotPrivate`: another user's token is never trusted)."""
    try:
        return _read_token(data_dir)
    except (OSError, UnicodeDecodeError):
        return None


def ensure_token(data_dir: str | os.PathLike[str]) -> str:
    """The install's admin token, created (0600, atomically: a racing creator's token wins) on first
    use.  Raises OSError when the data dir cannot be written, :class:`NotPrivate` when it or the token
    file is another user's (or writable by others)."""
    private_dir(data_dir)
    path = Path(data_dir) / TOKEN_FILE
    tighten(path)
    try:
        token = _read_token(data_dir)
    except UnicodeDecodeError:
        token = None
    if token is not None:
        return token
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never replaces a token another process wrote meanwhile
    except FileExistsError:
        if read_token(data_dir) is None:  # there, but empty or garbled: replaced
            os.replace(tmp, path)
    except OSError:  # a file system without hard links
        if not path.exists():
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    token = read_token(data_dir)
    if token is None:
        raise OSError(f"cannot read the admin token {path}")
    return token


def presented_token(headers) -> str:
    """The token a request carries (``x-bili-token``, or ``Authorization: Bearer``), or ''."""
    direct = headers.get(TOKEN_HEADER, "")
    if direct:
        return direct.strip()
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


CHALLENGE_HEADER = "x-bili-challenge"


def proof(token: str, challenge: str) -> str:
    """What a proxy that holds ``token`` answers to ``challenge`` on ``/__bili/health``: a client
    tells its own proxy from anything else on the port without sending the token there first."""
    return hmac.new(token.encode(), b"bili-health:" + challenge.encode(), hashlib.sha256).hexdigest()


def token_matches(presented: str, token: str | None) -> bool:
    if not token or not presented:
        return False
    return secrets.compare_digest(presented.encode(), token.encode())
