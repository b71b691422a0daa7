"""What a writer killed outright leaves is removed by the next writer: temporary names carry their host and
process (`leftovers`), and `checkpoint.atomic_write` clears the ones of ended processes beside its target."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from chatglm_tune.runtime import leftovers
from chatglm_tune.runtime.checkpoint import atomic_write


def ended_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_atomic_write_removes_the_temporary_file_of_a_killed_writer_and_keeps_a_live_ones(tmp_path):
    target = tmp_path / "out.json"
    prefix = f".{target.name}."
    dead = tmp_path / leftovers.owned_prefix(prefix).replace(f"-{os.getpid()}-", f"-{ended_pid()}-")
    live = tmp_path / leftovers.owned_prefix(prefix).replace(f"-{os.getpid()}-", f"-{os.getppid()}-")
    other_file = tmp_path / f".other.json.{dead.name.split('.', 3)[-1]}"
    for path in (dead, live, other_file):
        path.write_text("half")
    atomic_write(target, lambda p: Path(p).write_text("whole"))
    assert target.read_text() == "whole"
    assert not dead.exists() and live.exists() and other_file.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other_file.name])


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def interrupted(path):
        Path(path).write_text("ne")
        raise KeyboardInterrupt

    try:
        atomic_write(target, interrupted)
    except KeyboardInterrupt:
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and target.read_text() == "old"


def test_names_of_another_host_or_prefix_are_not_owned(tmp_path):
    assert leftovers.owner(leftovers.owned_prefix(".x.") + "abc", ".x.") == os.getpid()
    assert leftovers.owner(".x.otherhost-1-abc", ".x.") is None and leftovers.owner(".y.host-1-abc", ".x.") is None


def test_a_folder_holding_only_a_killed_writers_temporary_files_is_empty_again(tmp_path):
    dead = leftovers.owned_prefix(".run_args.json.").replace(f"-{os.getpid()}-", f"-{ended_pid()}-")
    (tmp_path / f"{dead}abc.tmp").write_text("{")
    live = tmp_path / f"{leftovers.owned_prefix('.x.json.')}abc.tmp"
    live.write_text("{")
    assert [p.name for p in leftovers.remove_abandoned_writes(tmp_path)] == [f"{dead}abc.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == [live.name]
