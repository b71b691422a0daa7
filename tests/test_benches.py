"""Benchmarks run end to end on their smallest setting (the library under them moves; a bench that no
longer runs is found here, not by the next person who measures)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_generate_bench_runs_and_ends_with_its_json():
    done = subprocess.run(
        [sys.executable, "bench/generate.py", "--configs", "tiny", "--new-tokens", "1:4", "--recompute-tokens", "1:2",
         "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    methods = {row["method"] for row in summary["results"]}
    assert {"kv-cache", "recompute"} <= methods
    assert all(row["tokens_per_s"] > 0 for row in summary["results"])


def test_demo_bench_times_the_readme_demo_and_its_infer_reads_the_trained_run():
    sys.path.insert(0, str(REPO / "bench"))
    import demo

    train, infer = demo.readme_commands()
    assert train[:4] == ["python", "train.py", "--model", "tiny"]
    run_dir = train[train.index("--output-dir") + 1]
    assert run_dir == demo.README_OUTPUT  # the directory the bench swaps for its own
    assert infer[infer.index("--model") + 1] == run_dir  # infer.py scores the model the demo just trained
    assert infer[infer.index("--input") + 1] == train[train.index("--dev-file") + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench/gpu.py runs for real there")
def test_gpu_bench_says_in_one_line_that_it_needs_a_gpu():
    done = subprocess.run([sys.executable, "bench/gpu.py", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and message.startswith("bench/gpu.py: needs a CUDA GPU: torch.cuda.is_available() is False")


def test_serve_bench_runs_both_servers_and_its_soak(tmp_path):
    pytest.importorskip("openai", reason="bench/serve.py drives the server with the openai client")
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "bench/serve.py", "--quick", "--streams", "1,2", "--requests-per-stream", "2", "--soak", "120",
         "--no-floor", "--threads", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary["tokens_per_s"]) == {"batch32@1", "batch32@2", "batch1@1", "batch1@2"}
    assert all(rate > 0 for rate in summary["tokens_per_s"].values())
    assert summary["soak_passed"], json.loads(out.read_text())["soak"]["checks"]
