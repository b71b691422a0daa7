"""Temporary files and folders named after the process that writes them, so that what a killed process left
(SIGKILL, OOM: no `finally` ran) is told apart from what a live one is writing, and removed by the next writer.

A name is `<prefix><host>-<pid>-<anything>`: `owned_prefix(prefix)` gives its start for this process, and
`remove_abandoned(folder, prefix)` removes the entries of `folder` so named whose process on this host has ended.
Entries of another host (a shared network folder) are left to that host.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path


def owned_prefix(prefix: str) -> str:
    """`prefix` followed by this host and process: the start of a temporary name this process owns."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-"


def alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner(name: str, prefix: str) -> int | None:
    """The pid in `name` when it is `prefix` + this host + pid, else None."""
    start = f"{prefix}{socket.gethostname()}-"
    pid = name[len(start):].split("-")[0] if name.startswith(start) else ""
    return int(pid) if pid.isdigit() else None


def remove_abandoned_writes(folder: Path) -> list[Path]:
    """Remove the temporary files of `checkpoint.atomic_write` in `folder` (`.<name>.<host>-<pid>-<random>.tmp`)
    whose process on this host has ended; the paths removed. A folder holding only those holds nothing."""
    removed = []
    for entry in Path(folder).glob(f".*.{socket.gethostname()}-*.tmp") if Path(folder).is_dir() else ():
        name = entry.name[: entry.name.rindex(f".{socket.gethostname()}-") + 1]
        removed += remove_abandoned(folder, name) if entry.exists() else []
    return removed


def remove_abandoned(folder: Path, prefix: str) -> list[Path]:
    """Remove the entries of `folder` named by `owned_prefix(prefix)` for a process of this host that has ended;
    the paths removed."""
    removed = []
    for entry in Path(folder).glob(f"{prefix}{socket.gethostname()}-*"):
        pid = owner(entry.name, prefix)
        if pid is not None and pid != os.getpid() and not alive(pid):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
