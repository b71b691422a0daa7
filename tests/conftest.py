"""Shared test fixtures: the golden checkpoints of the official implementation, one thread a test, and how many
worker processes the suite runs on.

`model-small-vocab` ships in tests/fixtures (always tested); `model-tiny` (38 MB) is read from the
`shared/` folder beside the checkout when it is there, and its tests skip cleanly when it is not.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED = Path(__file__).resolve().parents[2] / "shared"
GOLDEN_DIRS = {
    "small-vocab": FIXTURES / "model-small-vocab",
    "tiny": SHARED / "golden" / "model-tiny",
}


MAX_WORKERS = 4  # the longest file alone takes about a quarter of the suite on one core: more workers wait on it


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the default, pyproject.toml): a worker process a core this process may run on, up to MAX_WORKERS.
    The tests run their models on one thread each (`one_thread`), so the workers share the cores without
    oversubscribing them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tests run tiny models on one thread: it beats OpenMP's start-up, is immune to busy shared cores,
    and gives every fixture (module-scoped ones included) the same reduction order as the test that
    compares against it, so bitwise comparisons hold on any number of cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def back_to_one_thread():
    """A test that asks for more threads (`TrainOptions.threads`, `infer.py --threads`) leaves one."""
    yield
    torch.set_num_threads(1)


class Golden:
    """One golden checkpoint directory: its cases, expected logits and a loader."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.cases = json.loads((directory / "cases.json").read_text())["cases"]
        self.logits = load_file(directory / "logits.safetensors")

    def of_kind(self, kind):
        return [c for c in self.cases if c["kind"] == kind]

    def model(self, **overrides):
        from chatglm_tune import ChatGLMForConditionalGeneration

        return ChatGLMForConditionalGeneration.from_pretrained(self.dir, **overrides)


@pytest.fixture(scope="session", params=sorted(GOLDEN_DIRS))
def golden(request) -> Golden:
    directory = GOLDEN_DIRS[request.param]
    if not (directory / "model.safetensors").exists():
        pytest.skip(f"{directory} is absent (it lives in shared/ beside the checkout)")
    return Golden(directory)


def left_pad_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """2D mask (1 = token) of a left-padded batch: the leading run of pad ids is padding."""
    return (input_ids != pad_id).long().cummax(dim=1).values


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a C++ compiler, as the CPU kernels' build meets it: $CXX names no program, and the kernel
    cache is empty (a build of this "compiler" has its own folder anyway)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("CHATGLM_TUNE_KERNELS", str(tmp_path / "kernels"))
