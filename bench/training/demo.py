"""The README's main job, timed as a newcomer runs it: the tiny demo's training, then extraction over its dev set.

README.md's first set-up command installs the package, then runs two commands (`python train.py --model
tiny ...` and `python infer.py --model checkpoints/tiny ...`). This bench reads those two commands from
README.md (so it times what the README says, not a copy of it), points their output directory at a
fresh work directory instead of checkpoints/tiny, and runs them one after the other in fresh processes,
with the machine's cores as they are (the demo's own thread count). It reports the wall time of each
(imports, data, tokenizer, training with its evaluations, saving; loading, extraction, scoring), the
dev micro-F1 that infer.py measured on the saved model, and when the training first had a checkpoint
of dev F1 >= 0.9 (the step, from metrics.jsonl). The target: F1 >= 0.9, train + infer within 5
minutes on 2 cores. Times are this machine's: the CPU's name and capability are printed beside them.
The last line is JSON.

    python bench/training/demo.py [--results bench/results/demo.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import run  # noqa: E402
from bench.training.domains import dev_f1s, read_entries  # noqa: E402
README_OUTPUT = "checkpoints/tiny"  # the README demo's output directory, replaced by the work directory
TARGET_SECONDS, TARGET_F1 = 300, 0.9


def readme_commands(readme: Path = REPO / "README.md") -> list[list[str]]:
    """The `python train.py` and `python infer.py` commands of the README line that runs the tiny demo."""
    for line in readme.read_text(encoding="utf-8").splitlines():
        if "python train.py --model tiny " in line:
            parts = [shlex.split(part) for part in line.split("&&")]
            commands = [p for p in parts if p[:1] == ["python"] and p[1] in ("train.py", "infer.py")]
            if [c[1] for c in commands] == ["train.py", "infer.py"]:
                return commands
    raise SystemExit(f"bench/training/demo.py: {readme} has no line running `python train.py --model tiny ... && "
                     "python infer.py ...`")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(cmd: list[str]) -> float:
    """Wall seconds of a README command (`python ...`), run with this interpreter in a fresh process."""
    print("$ " + shlex.join(cmd), flush=True)
    return run([sys.executable, *cmd[1:]]).seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, help="the demo's output directory (default: a new temporary one)")
    p.add_argument("--results", type=Path, help="also write the closing JSON here (e.g. bench/results/demo.json)")
    args = p.parse_args(argv)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="chatglm_tune_demo_")) / "tiny").resolve()
    if work.exists():
        raise SystemExit(f"bench/training/demo.py: {work} exists; give another --work-dir")
    commands = [[str(work) + arg[len(README_OUTPUT):] if arg.startswith(README_OUTPUT) else arg for arg in cmd]
                for cmd in readme_commands()]
    work.parent.mkdir(parents=True, exist_ok=True)
    train_s, infer_s = (timed(cmd) for cmd in commands)
    predictions = Path(commands[1][commands[1].index("--output") + 1])
    summary = json.loads(predictions.with_name(predictions.name + ".summary.json").read_text(encoding="utf-8"))
    f1 = summary["scores"]["micro"]["f1"]
    import torch  # after the runs: the bench's own imports stay out of the timed processes' way

    machine = {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()}
    total = train_s + infer_s
    rows = [("train.py (the tiny demo)", train_s), ("infer.py (its dev set)", infer_s), ("train + infer", total)]
    print(f"\n{machine['cpu']} ({machine['capability']}, {machine['cores']} cores)")
    for label, seconds in rows:
        print(f"{label:28s} {seconds:7.1f} s")
    reached = next((step for f1_at, step in dev_f1s(read_entries(work / "metrics.jsonl")) if f1_at >= TARGET_F1), None)
    print(f"dev micro-F1 (infer.py): {f1:.4f}; the first checkpoint with F1 >= {TARGET_F1}: step {reached}")
    print(f"target: F1 >= {TARGET_F1} within {TARGET_SECONDS} s: "
          f"{'met' if f1 >= TARGET_F1 and total <= TARGET_SECONDS else 'missed'} ({total / TARGET_SECONDS:.2f} of the "
          "time)")
    line = json.dumps({"demo": {**machine, "train_s": round(train_s, 1), "infer_s": round(infer_s, 1),
                                "total_s": round(total, 1), "dev_f1": round(f1, 4), "first_step_f1_0.9": reached,
                                "target_s": TARGET_SECONDS}},
                      ensure_ascii=False)
    if args.results:
        args.results.write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main()
