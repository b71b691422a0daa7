"""The job scripts in docs/jobs run as a scheduler runs them, stopped and started again: SLURM's batch script gets
SIGUSR1 before its time limit, passes it to train.py, requeues itself, and the requeued script finishes the run;
the Kubernetes Job's command gets SIGTERM as a pod's process 1 does, and the restarted pod's same command finishes
it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from commands import HANG_S, ONE_THREAD, ROOT, wait_until

from chatglm_tune.runtime import crashpoints

JOBS = ROOT / "docs" / "jobs"
SMALL = "--tuning full --max-steps 40 --log-every 1 --batch-size 4 --threads 1 --max-src-len 64 --max-len 96"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jobs")
    lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:16]) + "\n", encoding="utf-8")
    (root / "dev.jsonl").write_text("\n".join(lines[16:18]) + "\n", encoding="utf-8")
    return root


def steps(run: Path) -> int:
    log = run / "metrics.jsonl"
    return sum('"loss"' in line for line in log.read_text().splitlines()) if log.exists() else 0


def test_slurm_script_stops_on_usr1_requeues_and_the_requeued_job_finishes(data, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    run = tmp_path / "run"
    env = os.environ | ONE_THREAD | {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "MODEL": "tiny",
        "TRAIN": str(data / "train.jsonl"), "DEV": str(data / "dev.jsonl"), "RUN": str(run), "FLAGS": SMALL}

    def job() -> subprocess.Popen:
        return subprocess.Popen(["bash", str(JOBS / "slurm.sbatch")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = job()
    wait_until(lambda: steps(run) >= 1, "train.py's first step", alive=lambda: first.poll() is None)
    first.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1: to the batch shell only
    out, _ = first.communicate(timeout=HANG_S)
    assert first.returncode == 138, out[-3000:]
    assert "interrupted by SIGUSR1 after step" in out and "requeueing job 42" in out
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "42"]
    stopped_at = json.loads((run / "state" / "progress.json").read_text())["step"]
    assert 1 <= stopped_at < 40
    again = job()  # the requeued job: the same script
    out, _ = again.communicate(timeout=HANG_S)
    assert (again.returncode == 0 and "--resume auto: continuing the run" in out
            and f"at step {stopped_at}" in out), out[-3000:]
    assert steps(run) == 40
    last = job()  # requeued once more (a node failure after the end): nothing to do
    out, _ = last.communicate(timeout=HANG_S)
    assert last.returncode == 0 and "has finished (40 steps): nothing to do" in out


def test_kubernetes_jobs_command_continues_after_sigterm_in_a_new_pod(data, tmp_path):
    job = yaml.safe_load((JOBS / "kubernetes.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and pod["terminationGracePeriodSeconds"] > 0
    command = pod["containers"][0]["command"]
    assert command[:2] == ["python", "train.py"] and command[-2:] == ["--resume", "auto"]  # exec form: python is pid 1
    places = {"/models/chatglm3-6b": "tiny", "data/spo_train.jsonl": str(data / "train.jsonl"),
              "data/spo_dev.jsonl": str(data / "dev.jsonl"), "/checkpoints/spo-lora": str(tmp_path / "run"),
              "lora": "full"}
    argv = [places.get(a, a) for a in command[2:]] + shlex.split(SMALL.replace("--max-steps 40", "--max-steps 6"))[2:]
    pod_once = [sys.executable, str(ROOT / "train.py"), *argv]
    stopped = subprocess.run(pod_once, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                             env=os.environ | ONE_THREAD
                             | {crashpoints.AT_ENV: crashpoints.spell("train-step", 3, "SIGTERM")})
    assert stopped.returncode == 143 and "interrupted by SIGTERM after step 3" in stopped.stderr, stopped.stderr[-2000:]
    restarted = subprocess.run(pod_once, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                               env=os.environ | ONE_THREAD)
    assert restarted.returncode == 0 and "continuing the run" in restarted.stderr and steps(tmp_path / "run") == 6
