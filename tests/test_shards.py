"""infer.py over several processes (`shards`): each takes every N-th record into its part, the last to finish
merges; the merged output equals one process's, row for row, for a float run, a P-tuning run and an INT4 base; a
process killed mid-share loses nothing --resume cannot finish. One real launch (torchrun, what `accelerate launch
--multi_gpu` runs); the other cases run the two processes one after the other in this one, with the RANK and
WORLD_SIZE a launcher sets (infer.py's processes never talk to each other: their files are the whole protocol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from commands import HANG_S, ONE_THREAD, ROOT
from serving import free_port, tiny_model

from chatglm_tune.runtime import crashpoints

TWO = {"WORLD_SIZE": "2"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny ChatGLM3 base, a P-tuning run on it, and 13 records (an odd count: the shares differ)."""
    import train as train_cli

    root = tmp_path_factory.mktemp("shards")
    lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
    (root / "in.jsonl").write_text("\n".join(lines[:13]) + "\n", encoding="utf-8")
    base = tiny_model("chatglm3", root / "base")
    assert train_cli.main(["--model", str(base), "--tuning", "ptuning", "--pre-seq-len", "4", "--train-file",
                           str(root / "in.jsonl"), "--max-steps", "2", "--batch-size", "4", "--max-src-len", "64",
                           "--max-len", "96", "--threads", "1", "--output-dir", str(root / "ptuning")]) == 0
    return root


def infer(work: Path, model: Path, out: Path, *more, env: dict | None = None) -> int:
    """infer.py in this process, as the process `env` (RANK, WORLD_SIZE) of a launch says."""
    from infer import main as infer_main

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(env or {})
    try:
        infer_main([*map(str, ["--model", model, "--input", work / "in.jsonl", "--output", out, "--batch-size", 3,
                               "--max-new-tokens", 12, *more])])
        return 0
    except SystemExit as stopped:
        return stopped.code
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def rows(out: Path) -> str:
    return out.read_text(encoding="utf-8")


def left(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if ".part-" in p.name)


@pytest.mark.parametrize("kind", ["float", "ptuning", "int4"])
def test_two_processes_write_what_one_writes(work, tmp_path, kind, capsys):
    model, more = {"float": (work / "base", ()), "ptuning": (work / "ptuning", ()),
                   "int4": (work / "base", ("--quantization-bit", 4))}[kind]
    assert infer(work, model, tmp_path / "one.jsonl", *more) == 0
    two = tmp_path / "two.jsonl"
    assert infer(work, model, two, *more, env={**TWO, "RANK": "1"}) == 0  # the first to finish waits for nothing
    assert two.exists() is False and left(two) == ["two.jsonl.part-1-of-2.jsonl",
                                                   "two.jsonl.part-1-of-2.jsonl.done.json",
                                                   "two.jsonl.part-1-of-2.jsonl.model.json"]
    capsys.readouterr()
    assert infer(work, model, two, *more, env={**TWO, "RANK": "0"}) == 0  # the last merges
    assert "records: 13 (13 this run, 2 processes)" in capsys.readouterr().out
    assert rows(two) == rows(tmp_path / "one.jsonl") and left(two) == []
    assert json.loads((tmp_path / "two.jsonl.summary.json").read_text())["this_run"]["processes"] == 2


def test_a_process_killed_mid_share_and_the_launch_resumed_ends_as_one_process(work, tmp_path):
    assert infer(work, work / "base", tmp_path / "one.jsonl") == 0
    two = tmp_path / "two.jsonl"
    killed = subprocess.run([sys.executable, str(ROOT / "infer.py"), "--model", str(work / "base"), "--input",
                             str(work / "in.jsonl"), "--output", str(two), "--batch-size", "3",
                             "--max-new-tokens", "12"],
                            cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                            env=os.environ | ONE_THREAD | TWO
                            | {"RANK": "1", crashpoints.AT_ENV: crashpoints.spell("append", 2, "SIGKILL")})
    assert killed.returncode == -9
    assert infer(work, work / "base", two, env={**TWO, "RANK": "0"}) == 0  # its share done, not merged: 1 is missing
    assert not two.exists()
    # done already: nothing to extract
    assert infer(work, work / "base", two, "--resume", env={**TWO, "RANK": "0"}) == 0
    assert infer(work, work / "base", two, "--resume", env={**TWO, "RANK": "1"}) == 0  # resumes its part, merges
    assert rows(two) == rows(tmp_path / "one.jsonl") and left(two) == []
    assert infer(work, work / "base", two, "--resume", env={**TWO, "RANK": "1"}) == 0  # a requeued launch: complete
    assert infer(work, work / "base", two, env=TWO | {"WORLD_SIZE": "3", "RANK": "0"}) == 2  # not resumed: refused


def test_a_real_launch_of_two_processes(work, tmp_path):
    out = tmp_path / "two.jsonl"
    assert infer(work, work / "base", tmp_path / "one.jsonl") == 0
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(ROOT / "infer.py"), "--model", str(work / "base"), "--input",
                           str(work / "in.jsonl"), "--output", str(out), "--batch-size", "3", "--max-new-tokens", "12"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=os.environ | ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes" in done.stdout and rows(out) == rows(tmp_path / "one.jsonl") and left(out) == []
