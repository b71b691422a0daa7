"""Does the tiny preset with no flags fit SPO sets it was not tuned on? Dev micro-F1 per domain set.

For each set (a directory holding `train.jsonl` and `dev.jsonl`; by default every set under
data/domains/, written by `data/make_domains.py --all`) this runs, in a fresh process,

    python train.py --model tiny --tuning full --train-file <set>/train.jsonl --dev-file <set>/dev.jsonl \
        --output-dir <work-dir>/<name>

with no other flag (the tiny preset's defaults; `--extra` appends flags, for checking the plumbing),
then reads the run's best dev micro-F1 from its metrics.jsonl (the `eval` entries' `micro.f1`), its
optimizer steps (the `final` entry) and the wall time of the process. Prints a table, writes
bench/results/domains.json (`--results`) and ends with the same JSON on one line:
`{"domains": {name: {"f1", "steps", "seconds", "best_step", "train_records"}}, "extra": [...]}`.
The target is f1 >= 0.9 on every set with no extra flag.
Sets of the same kinds drawn with other seeds, never run while the defaults were chosen
(`python data/make_domains.py --domain products --seed 8|9 --out-dir DIR`, `--domain people --seed 8`),
one thread each: products 0.950 and 0.917, people 0.937 (bench/results/domains-unseen.json).

    python bench/training/domains.py                          # every set under data/domains/
    python bench/training/domains.py --data-dir data/domains/people --data-dir /path/to/other_set
    python bench/training/domains.py --data-dir data/domains/people --extra="--max-steps 20" --results /tmp/d.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO / "data" / "domains"
DEFAULT_RESULTS = REPO / "bench" / "results" / "domains.json"


def find_sets(dirs: list[Path]) -> dict[str, Path]:
    """name -> set directory: a dir with train.jsonl is a set; otherwise its subdirs that are."""
    sets = {}
    for d in (d.resolve() for d in dirs):  # train.py runs in the repository root
        found = [d] if (d / "train.jsonl").exists() else sorted(p for p in d.iterdir() if (p / "train.jsonl").exists())
        if not found:
            raise SystemExit(f"bench/training/domains.py: no train.jsonl in {d} or its subdirectories")
        for s in found:
            if not (s / "dev.jsonl").exists():
                raise SystemExit(f"bench/training/domains.py: {s} has no dev.jsonl (the F1 needs one)")
            if s.name in sets:
                raise SystemExit(f"bench/training/domains.py: two sets named {s.name!r}: {sets[s.name]} and {s}")
            sets[s.name] = s
    return sets


def read_entries(metrics: Path) -> list[dict]:
    """The entries of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]


def dev_f1s(entries: list[dict]) -> list[tuple[float, int]]:
    """(dev micro-F1, step) of each evaluation among metrics.jsonl `entries`, in order."""
    return [(e["eval"]["micro"]["f1"], e["step"]) for e in entries if "eval" in e and e["eval"].get("micro")]


def read_run(metrics: Path) -> dict:
    """Best dev micro-F1 (and its step) and the optimizer steps of a finished run's metrics.jsonl."""
    entries = read_entries(metrics)
    evals = dev_f1s(entries)
    final = next((e["final"] for e in reversed(entries) if "final" in e), {})
    best = max(evals, key=lambda fs: fs[0], default=(None, None))  # the first of equal F1s
    steps = final.get("step", max((e.get("step", 0) for e in entries), default=0))
    return {"f1": best[0], "best_step": best[1], "steps": steps}


def run_set(name: str, data: Path, work_dir: Path, extra: list[str]) -> dict:
    out = work_dir / name
    if out.exists():
        raise SystemExit(f"bench/training/domains.py: {out} exists; give another --work-dir")
    cmd = [sys.executable, str(REPO / "train.py"), "--model", "tiny", "--tuning", "full",
           "--train-file", str(data / "train.jsonl"), "--dev-file", str(data / "dev.jsonl"), "--output-dir",
           str(out), *extra]
    print("$ " + shlex.join(["python", "train.py", *cmd[2:]]), flush=True)
    log = work_dir / f"{name}.log"
    started = time.time()
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = round(time.time() - started, 1)
    if code != 0 or not (out / "metrics.jsonl").exists():
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"bench/training/domains.py: train.py failed on {name} (exit {code}); the end of "
                         f"{log}:\n{tail}")
    train_records = sum(1 for line in open(data / "train.jsonl", encoding="utf-8") if line.strip())
    return {**read_run(out / "metrics.jsonl"), "seconds": seconds, "train_records": train_records}


def table(results: dict[str, dict]) -> str:
    rows = [f"{'set':<12} {'train':>6} {'dev F1':>7} {'best@':>6} {'steps':>6} {'seconds':>8}"]
    for name, r in results.items():
        f1 = "n/a" if r["f1"] is None else f"{r['f1']:.3f}"
        rows.append(f"{name:<12} {r['train_records']:>6} {f1:>7} {str(r['best_step']):>6} {r['steps']:>6} "
                    f"{r['seconds']:>8.1f}")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[-4:]))
    p.add_argument("--data-dir", type=Path, action="append",
                   help="a set directory or a parent of sets; repeatable (default "
                        f"{DEFAULT_DATA_DIR.relative_to(REPO)})")
    p.add_argument("--work-dir", type=Path, help="where the runs go, <work-dir>/<name> (default: a new temporary dir)")
    p.add_argument("--extra", default="",
                   help='flags appended to every train.py command, e.g. --extra="--max-steps 20"')
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON written here (default %(default)s)")
    args = p.parse_args(argv)
    sets = find_sets(args.data_dir or [DEFAULT_DATA_DIR])
    extra = shlex.split(args.extra)
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="chatglm_tune_domains_"))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(sets)} set(s): {', '.join(sets)}; runs in {work_dir}" + (f"; extra flags {extra}" if extra else ""))
    results = {}
    for name, data in sets.items():
        results[name] = run_set(name, data, work_dir, extra)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(table(results))
    summary = {"domains": results, "extra": extra}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
