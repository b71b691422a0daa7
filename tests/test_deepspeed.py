"""The DeepSpeed configs as users launch them: `accelerate launch --config_file configs/deepspeed_zero2.yaml train.py`
(ZeRO-2) and `deepspeed_zero3.yaml` (ZeRO-3, the optimizer offloaded to CPU memory), full and LoRA tuning of a tiny
ChatGLM3: each run's losses and saved weights equal a plain train.py run's, and the run loads.

On a CPU, accelerate runs DeepSpeed in one process: with no GPU it gives several processes no backend (DeepSpeed
then sees 2 ranks and accelerate 1: "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step *
world_size"), and its --cpu path is DDP over gloo instead (test_training, test_fsdp). So these runs are one
process each; what they check is the configs' settings, the optimizer DeepSpeed wraps, and the save. Two processes
are refused before training, saying what runs instead.
Skipped without deepspeed: `pip install deepspeed` (about a minute; ZeRO-3's offload builds its CPU Adam the
first time it runs, a few minutes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import HANG_S, ROOT, finish, start
from safetensors.torch import load_file
from serving import tiny_model

from chatglm_tune.runs import loading

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed: pip install deepspeed")

STEPS = 3
CONFIGS = ("deepspeed_zero2.yaml", "deepspeed_zero3.yaml")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, list]:
    """(a tiny ChatGLM3 directory, train.py's arguments on 16 SPO records for STEPS steps, a loss logged each)."""
    root = tmp_path_factory.mktemp("deepspeed")
    data = root / "data.jsonl"
    data.write_text("".join((ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines(True)[:16]),
                    encoding="utf-8")
    base = tiny_model("chatglm3", root / "base")
    return base, ["--model", base, "--train-file", data, "--max-steps", STEPS, "--batch-size", 4, "--max-src-len", 96,
                  "--max-len", 160, "--log-every", 1, "--threads", 1]


def launch(*args, config: str | None = None, processes: int = 1, check: bool = True):
    """train.py with `args`, under `accelerate launch --config_file configs/<config>` (float32) or alone; checked
    to exit 0 unless not `check`."""
    if config is None:
        done = finish(start("train.py", *args))
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / config,
                    "--num_processes", processes, "--mixed_precision", "no", ROOT / "train.py"]
        done = subprocess.run(list(map(str, [*launcher, *args])), capture_output=True, text=True, cwd=ROOT,
                              timeout=HANG_S, env=os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 or not check, done.stderr[-3000:]
    return done


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in e]


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_each_deepspeed_config_trains_and_saves_as_a_plain_run(setup, tmp_path, tuning):
    _, args = setup
    launch(*args, "--tuning", tuning, "--output-dir", tmp_path / "plain")
    weights = "model.safetensors" if tuning == "full" else "adapter_model.safetensors"
    plain = load_file(tmp_path / "plain" / weights)
    for config in CONFIGS:
        run = tmp_path / config.removesuffix(".yaml")
        launch(*args, "--tuning", tuning, "--output-dir", run, config=config)
        assert losses(run) == pytest.approx(losses(tmp_path / "plain"), rel=1e-4), config
        saved = load_file(run / weights)
        assert saved.keys() == plain.keys(), config
        assert all(torch.allclose(saved[k], plain[k], atol=1e-3) for k in plain), config
        model, _ = loading.load_run(loading.resolve_run(run))
        assert model.config.chatglm_version == "chatglm3"


def test_several_cpu_processes_under_deepspeed_are_refused_saying_what_works(setup, tmp_path):
    """Two processes: accelerate joins them into no run (each would train alone, and DeepSpeed fails on the batch
    size); train.py says so before training, and the directory is left empty."""
    _, args = setup
    run = tmp_path / "two"
    done = launch(*args, "--tuning", "full", "--output-dir", run, config=CONFIGS[0], processes=2, check=False)
    assert done.returncode != 0
    assert "train.py: error: 2 processes were launched, but accelerate runs each alone" in done.stderr
    assert "--num_processes 1" in done.stderr and not (run.exists() and any(run.iterdir()))
