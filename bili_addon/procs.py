"""Whether a process is still there (the launcher's proxy records, the transparent namespaces)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """``pid`` runs (or exists under another user); a zombie (exited, not reaped) is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:  # no procfs (macOS): the signal said enough
        return True
