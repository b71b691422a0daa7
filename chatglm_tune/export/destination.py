"""Where export.py writes: a new (or empty) directory, there whole or not at all.

`check_destination` runs before any weight is read: the directory must be absent or empty, and the nearest
existing directory above it one this process may write into, or the export stops with one line naming the
path. `writing_into` gives the export a directory beside the destination, `.NAME.partial`, and renames it onto
the destination when the export is complete; an error, Ctrl-C or SIGTERM (raised as KeyboardInterrupt by
export.py) removes it with whatever was written, so the destination is as it was and the same command runs
again. One that a SIGKILL left behind is removed by the next export to that destination.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class DestinationError(ValueError):
    """An output directory this export cannot write; the message names it."""


def check_destination(out: Path) -> None:
    """DestinationError unless `out` is absent or an empty directory, in a directory this process may write."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DestinationError(f"{out} exists and is not an empty directory: choose a new output directory")
    above = Path(os.path.abspath(out)).parent
    while not above.exists():  # a path under a file does not exist either: the walk stops at the file
        above = above.parent
    if not above.is_dir():
        raise DestinationError(f"cannot create {out}: {above} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create {out}: {above} is not writable")


def partial_directory(out: Path) -> Path:
    """The directory an export into `out` is written in until it is complete."""
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name}.partial")


@contextmanager
def writing_into(out: Path) -> Iterator[Path]:
    """A new, empty `partial_directory(out)` to write the export in, renamed onto `out` (absent or an empty
    directory) when the block ends; removed, with all written in it, when the block raises (KeyboardInterrupt
    included). A DestinationError names `out` where the directory cannot be made or moved there."""
    partial = partial_directory(out)
    try:
        shutil.rmtree(partial, ignore_errors=True)  # what an export killed outright left
        partial.mkdir(parents=True)
    except OSError as err:
        raise DestinationError(f"cannot create {out}: {err.strerror} ({err.filename})") from None
    try:
        yield partial
        try:
            os.replace(partial, out)
        except OSError as err:
            raise DestinationError(f"cannot move the export into {out}: {err.strerror}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
