"""A run survives the machine it runs on: SIGTERM (a scheduler's stop, a preemption) saves the last finished step
and says how to go on; `--resume auto`, what a requeued job runs, starts, continues, finishes or refuses as the
directory says; the continued run ends where an uninterrupted one does, dropout's random numbers included."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from commands import HANG_S, ROOT, ONE_THREAD
from serving import tiny_model

from chatglm_tune.runtime import crashpoints

# LoRA with dropout on a tiny ChatGLM3 base, 2 micro-batches a step: a stop in the middle of a step has drawn
# dropout's random numbers that the resumed run must draw again.
FLAGS = ["--tuning", "lora", "--lora-dropout", "0.1", "--max-steps", "5", "--eval-every", "2", "--batch-size", "4",
         "--grad-accum", "2", "--log-every", "1", "--max-src-len", "64", "--max-len", "96", "--threads", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:24]) + "\n", encoding="utf-8")
    (root / "dev.jsonl").write_text("\n".join(lines[24:28]) + "\n", encoding="utf-8")
    base = tiny_model("chatglm3", root / "base")
    args = ["--model", str(base), "--train-file", str(root / "train.jsonl"), "--dev-file",
            str(root / "dev.jsonl"), *FLAGS]
    assert train(args, root / "whole") == 0
    return root, args


def train(args, out: Path, *more) -> int:
    import train as train_cli

    return train_cli.main([*map(str, args), "--output-dir", str(out), *map(str, more)])


def log(run: Path) -> list[dict]:
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in e.items()} if "final" not in e else {"final": {**e["final"], "seconds": None}}
            for e in entries]


def temporary(run: Path) -> list[str]:
    return [p.name for p in run.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]


def test_sigterm_mid_step_saves_the_last_step_and_the_printed_command_ends_as_an_uninterrupted_run(setup, capsys):
    root, args = setup
    run = root / "stopped"
    at = crashpoints.spell("micro-batch", 7, "SIGTERM")  # the first half of step 4: it finishes, then the run stops
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--output-dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_S, env={**os.environ, **ONE_THREAD,
                                                                                crashpoints.AT_ENV: at})
    assert done.returncode == 143, done.stderr[-3000:]  # 128 + SIGTERM
    said = done.stderr.strip().splitlines()
    assert said[-2].startswith(f"train.py: interrupted by SIGTERM after step 4: its state is saved in {run}"), said[-2:]
    assert json.loads((run / "state" / "progress.json").read_text())["step"] == 4 and temporary(run) == []
    command = shlex.split(said[-1])
    assert command[:2] == [sys.executable, str(ROOT / "train.py")] and command[-2:] == ["--resume", "auto"]
    capsys.readouterr()
    import train as train_cli

    assert train_cli.main(command[2:]) == 0
    assert "--resume auto: continuing the run" in capsys.readouterr().err
    assert log(run) == log(root / "whole")
    adapter = "adapter_model.safetensors"
    assert (run / adapter).read_bytes() == (root / "whole" / adapter).read_bytes()
    assert temporary(run) == []


def test_resume_auto_starts_a_new_run_and_says_a_finished_one_has_nothing_to_do(setup, capsys):
    root, args = setup
    fresh = root / "fresh"
    assert train(args, fresh, "--resume", "auto") == 0
    assert "--resume auto: starting the run" in capsys.readouterr().err
    assert log(fresh) == log(root / "whole")
    before = {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()}
    assert train(args, fresh, "--resume", "auto") == 0
    assert "has finished (5 steps): nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()} == before
    assert train(args, fresh, "--resume", "auto", "--max-steps", "6") == 0  # a longer budget goes on
    assert log(fresh)[-1]["final"]["step"] == 6


def test_resume_auto_refuses_another_runs_directory_naming_what_differs_and_a_directory_of_other_files(setup, capsys):
    root, args = setup
    assert train(args, root / "whole", "--resume", "auto", "--lr", "0.5") == 2
    err = capsys.readouterr().err
    assert "--resume auto:" in err and "holds another run: lr: the run used" in err and "now 0.5" in err
    other = root / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert train(args, other, "--resume", "auto") == 2
    assert "is not empty and holds no train.py run" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("moment", ["atomic-write#1", "micro-batch#1"])  # recording itself; its first step
def test_a_run_killed_before_it_saved_a_state_starts_again_in_place(setup, capsys, moment):
    root, args = setup
    run = root / f"early-{moment}"
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--output-dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, **ONE_THREAD,
                               crashpoints.AT_ENV: crashpoints.spell(moment.split("#")[0],
                                                                     int(moment.split("#")[1]), "SIGKILL")})
    assert done.returncode == -9 and any(run.iterdir()) and not (run / "state").exists()
    assert train(args, run, "--resume", "auto") == 0
    said = capsys.readouterr().err
    assert "--resume auto: starting" in said
    assert log(run) == log(root / "whole") and temporary(run) == []
