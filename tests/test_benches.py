"""Benchmarks run end to end on their smallest setting (the library under them moves; a bench that no
longer runs is found here, not by the next person who measures)."""

import json
import subprocess
import sys
from pathlib import Path

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
