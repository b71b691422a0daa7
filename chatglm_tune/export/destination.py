"""Where export.py and quantize.py write: a new (or empty) directory, there whole or not at all.

`check_destination` runs before any weight is read: the directory must be absent or empty, and the nearest
existing directory above it one this process may write into, or the command stops with one line naming the
path. A finished output holds `.made_by.json`, the command, its settings and its source files' sizes and times
(`made_by`): the same command run again on it (a requeued job, a kill that landed after the rename) finds it
finished and has nothing to do; another command's output is refused naming what differs. `writing_into` gives the export
a directory beside the destination, `.NAME.partial`, and renames it onto the destination when the export is complete; an
error, Ctrl-C or SIGTERM (raised as KeyboardInterrupt by export.py) removes it with whatever was written, so the
destination is as it was and the same command runs again. One that a SIGKILL left behind is removed by the next export
to that destination.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chatglm_tune.runtime import crashpoints


class DestinationError(ValueError):
    """An output directory this export cannot write; the message names it."""


MADE_BY = ".made_by.json"


# The files of a source directory that make its model: weights and configs (not logs, predictions or state)
SOURCE_FILES = ("*.safetensors", "*.bin", "config.json", "adapter_config.json", "*.safetensors.index.json")


def made_by(command: str, sources: list, **settings) -> dict:
    """The record of a command's output: its name, `settings`, and the size and modification time of each weight and
    config file of its `sources` (directories; a run trained further since is another source)."""
    files = sorted({p for s in sources if s is not None for pattern in SOURCE_FILES for p in Path(s).glob(pattern)})
    return {"command": command, **settings, "sources": {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns]
                                                        for p in files}}


def check_destination(out: Path, made: dict | None = None) -> bool:
    """False where `out` is absent or an empty directory in a directory this process may write (write it there);
    True where it holds the finished output of this very command (`made`, `made_by`): nothing to do.
    DestinationError otherwise, naming what differs from an earlier output of the command."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        earlier = _read_made_by(out)
        if made is not None and earlier == made:
            return True
        if made is not None and earlier is not None and earlier.get("command") == made["command"]:
            changed = [k for k in made if earlier.get(k) != made[k]]
            raise DestinationError(f"{out} holds an earlier {made['command']} output with other "
                                   f"{', '.join(changed)}: choose a new output directory, or remove it")
        raise DestinationError(f"{out} exists and is not an empty directory: choose a new output directory")
    above = Path(os.path.abspath(out)).parent
    while not above.exists():  # a path under a file does not exist either: the walk stops at the file
        above = above.parent
    if not above.is_dir():
        raise DestinationError(f"cannot create {out}: {above} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create {out}: {above} is not writable")
    return False


def _read_made_by(out: Path) -> dict | None:
    try:
        return json.loads((out / MADE_BY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def partial_directory(out: Path) -> Path:
    """The directory an export into `out` is written in until it is complete."""
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name}.partial")


@contextmanager
def writing_into(out: Path, made: dict | None = None) -> Iterator[Path]:
    """A new, empty `partial_directory(out)` to write the export in, renamed onto `out` (absent or an empty
    directory) when the block ends, with `made` as its `.made_by.json`; removed, with all written in it, when the
    block raises (KeyboardInterrupt included). A DestinationError names `out` where the directory cannot be made or
    moved there."""
    partial = partial_directory(out)
    try:
        shutil.rmtree(partial, ignore_errors=True)  # what an export killed outright left
        partial.mkdir(parents=True)
    except OSError as err:
        raise DestinationError(f"cannot create {out}: {err.strerror} ({err.filename})") from None
    try:
        yield partial
        if made is not None:
            (partial / MADE_BY).write_text(json.dumps(made, indent=1, ensure_ascii=False), encoding="utf-8")
        crashpoints.reached("export-rename")
        try:
            os.replace(partial, out)
        except OSError as err:
            raise DestinationError(f"cannot move the export into {out}: {err.strerror}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
