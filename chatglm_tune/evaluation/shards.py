"""Extraction over several processes (`accelerate launch` or `torchrun` of infer.py; GPUs, CPU nodes or one box):
process r of N takes every N-th record from the r-th (`records[r::N]`) into its own part file beside the output,
`<output>.part-<r>-of-<N>.jsonl`, written and resumed as a one-process output is (`extraction.rows_to_resume`), and
says it is done with `<part>.done.json` (its rows, tokens and seconds). The last process to finish (the others'
marks are there; an flock on the output's model record keeps it to one) merges the parts into the output, each row's
`index` made its place in the input again, in input order, written whole (`checkpoint.atomic_write`), and removes the
parts. A process killed at any moment loses nothing `--resume` cannot finish: its part resumes where it stopped, a
finished part is not run again, and an output merged already is complete. The rows equal one process's: each row is
decoded on its own (left-padded batches give a row the same ids whatever its neighbours).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from chatglm_tune.runtime.checkpoint import atomic_write


@dataclass(frozen=True)
class World:
    """This process's place among those launched together: `rank` of `size`."""

    rank: int = 0
    size: int = 1

    @classmethod
    def from_environment(cls) -> World:
        """RANK and WORLD_SIZE as torchrun and accelerate launch set them (one process where they are absent)."""
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        return cls(int(os.environ.get("RANK", "0") or 0), size) if size > 1 else cls()

    def share(self, records: list) -> list:
        return records[self.rank :: self.size]

    def part(self, output: Path) -> Path:
        return output.with_name(f"{output.name}.part-{self.rank}-of-{self.size}.jsonl")


def parts_of_another_launch(output: Path, world: World) -> list[Path]:
    """Part files beside `output` that a launch of another size wrote (resumed only by as many processes)."""
    pattern = re.compile(re.escape(output.name) + r"\.part-\d+-of-(\d+)\.jsonl$")
    return sorted(p for p in output.parent.glob(f"{output.name}.part-*") if (m := pattern.match(p.name))
                  and int(m.group(1)) != world.size)


def done_mark(part: Path) -> Path:
    return part.with_name(part.name + ".done.json")


def mark_done(part: Path, counts: dict) -> None:
    """Say that `part` holds every row of its share, with this run's `counts` (rows, tokens, seconds)."""
    atomic_write(done_mark(part), lambda p: Path(p).write_text(json.dumps(counts)))


def merge_if_last(output: Path, world: World, n_records: int, identity: str) -> tuple[list[dict], list[dict]] | None:
    """Where every part is done and no other process is merging: (the merged rows in input order, each part's counts),
    the output written whole beside its model record (`identity`) and the parts removed; else None (another process
    merges, or will)."""
    parts = [World(r, world.size).part(output) for r in range(world.size)]
    if not all(done_mark(p).exists() for p in parts):
        return None
    folder = os.open(output.parent, os.O_RDONLY)  # the lock: an flock of the output's folder, gone with its holder
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # another process merges
        if not all(done_mark(p).exists() for p in parts):
            return None  # merged meanwhile
        return _merge(output, parts, world, n_records, identity)
    finally:
        os.close(folder)


def _merge(output: Path, parts: list[Path], world: World, n_records: int, identity: str):
    """The merge itself (`merge_if_last`)."""
    rows = [None] * n_records
    for r, part in enumerate(parts):
        for line in part.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            row["index"] = r + world.size * row["index"]  # its place in the input
            rows[row["index"]] = row
    counts = [json.loads(done_mark(p).read_text()) for p in parts]
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(output.with_name(output.name + ".model.json"),
                 lambda p: Path(p).write_text(json.dumps({"model": identity}, ensure_ascii=False)))
    atomic_write(output, lambda p: Path(p).write_text(text, encoding="utf-8"))
    for part in parts:  # the mark first: a part left unmarked is resumed (nothing to do), marked and merged again
        for path in (done_mark(part), part.with_name(part.name + ".model.json"), part):
            path.unlink(missing_ok=True)
    return rows, counts
