"""What only this user may read: the data dir (0700), the store's files and the admin token (0600),
whatever the umask.  Standard library only: ``bili mcp`` reads the token without mitmproxy.

The admin token is a per-install secret in ``<data dir>/admin-token``; every ``/__bili/`` endpoint
but health answers only a request that carries it (header ``x-bili-token``, or
``Authorization: Bearer``), since loopback is any local user, not this one.
"""

from __future__ import annotations

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


def _mode(st: os.stat_result) -> int:
    return stat.S_IMODE(st.st_mode)


def private_dir(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` (0700) or tighten it to 0700.  An existing directory is tightened only when it
    is bili's (empty, or holding the store, the token or the exports), owned by this user and not a
    shared sticky directory such as /tmp.  True when an existing directory's mode was changed."""
    p = Path(path)
    try:
        p.mkdir(parents=True, mode=DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    st = os.stat(p)
    if _mode(st) == DIR_MODE or st.st_uid != os.getuid() or st.st_mode & stat.S_ISVTX:
        return False
    if created or not any(p.iterdir()) or any((p / name).exists() for name in BILI_NAMES):
        os.chmod(p, DIR_MODE)  # mkdir's mode is masked by the umask
        return not created
    return False


def tighten(path: str | os.PathLike[str], mode: int = FILE_MODE) -> bool:
    """``chmod`` an existing file of this user to ``mode``; True when it was wider."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or _mode(st) == mode or st.st_uid != os.getuid():
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


def read_token(data_dir: str | os.PathLike[str]) -> str | None:
    """The install's admin token, or None when there is none (yet) or it cannot be read."""
    try:
        text = (Path(data_dir) / TOKEN_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def ensure_token(data_dir: str | os.PathLike[str]) -> str:
    """The install's admin token, created (0600, atomically: a racing creator's token wins) on first
    use.  Raises OSError when the data dir cannot be written."""
    private_dir(data_dir)
    path = Path(data_dir) / TOKEN_FILE
    token = read_token(data_dir)
    if token is not None:
        tighten(path)
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
