"""Benchmark: one benchmark on two trees of this repository side by side, to show a change keeps its numbers.

    python bench/common/trees.py --base HEAD~1 -- bench/decode/quant.py
    python bench/common/trees.py --base HEAD~1 --rounds 2 -- bench/decode/generate.py --configs mid
    python bench/common/trees.py --base 067acbf --base-script bench/quant.py -- bench/decode/quant.py

The base revision is exported from git (`git archive`) into a temporary folder; the working tree is the
other side. Each round runs the benchmark command once in each tree, in a fresh process whose working
directory is that tree (the benchmarks put their own tree first on `sys.path`, so each imports its own
`chatglm_tune`), base first in odd rounds and working tree first in even ones, so a drift in the machine's
load hits both alike. From the last line of each run (the benchmark's JSON) every number whose path
matches `--metrics` is compared: the median over rounds of each side, and working / base. A list of
results is keyed by the text fields of its items (config, dtype, method, ...) and its `batch`.
Prints a table; the last line is JSON (also written to bench/results/trees-<benchmark>.json). A base revision
from before the benchmarks moved into their rooms under bench/ has the script elsewhere (bench/quant.py rather
than bench/decode/quant.py): `--base-script` names it there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_METRICS = r"(tokens_per_s|decode_tok_s|rss_load_mb|peak_rss_mib|load_s)$"


def export(revision: str, into: Path) -> str:
    """The tree of `revision` extracted into `into`; returns the full commit id."""
    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("the benchmark printed no JSON line")


def flatten(value, path: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value by path; list items of objects are keyed by their text fields and batch."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {path: float(value)}
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            key = "/".join(str(item[k]) for k in item if isinstance(item[k], str) or k == "batch") or str(i)
            out.update(flatten(item, f"{path}[{key}]"))
    return out


def run(tree: Path, command: list[str], timeout: float) -> tuple[dict, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *command], cwd=tree, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {tree} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return last_json(done.stdout), time.perf_counter() - started


def compare(base_runs: list[dict], work_runs: list[dict], pattern: str) -> list[dict]:
    metric = re.compile(pattern)
    base = [flatten(r) for r in base_runs]
    work = [flatten(r) for r in work_runs]
    rows = []
    for key in sorted(set(base[0]) & set(work[0])):
        if not metric.search(key):
            continue
        b = statistics.median(r[key] for r in base if key in r)
        w = statistics.median(r[key] for r in work if key in r)
        rows.append({"metric": key, "base": b, "work": w, "ratio": round(w / b, 3) if b else None})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating (default 2)")
    p.add_argument("--metrics", default=DEFAULT_METRICS, help="regular expression of the numbers compared "
                   f"(default {DEFAULT_METRICS!r})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark run may take (default 1800)")
    p.add_argument("--name", help="results file name (default: the benchmark's file name)")
    p.add_argument("--base-script",
                   help="the benchmark script's path in the base tree, where it differs (default: the same)")
    p.add_argument("command", nargs="+", help="the benchmark script and its arguments, after --")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    name = args.name or Path(args.command[0]).stem
    with tempfile.TemporaryDirectory(prefix="trees-") as tmp:
        base_tree = Path(tmp)
        commit = export(args.base, base_tree)
        runs: dict[str, list[dict]] = {"base": [], "work": []}
        seconds: dict[str, list[float]] = {"base": [], "work": []}
        for r in range(args.rounds):
            order = (("base", base_tree), ("work", ROOT)) if r % 2 == 0 else (("work", ROOT), ("base", base_tree))
            for side, tree in order:
                print(f"round {r + 1}/{args.rounds}: {side} ({tree}) ...", flush=True)
                command = [args.base_script, *args.command[1:]] if side == "base" and args.base_script else args.command
                result, took = run(tree, command, args.timeout)
                runs[side].append(result)
                seconds[side].append(round(took, 1))
    rows = compare(runs["base"], runs["work"], args.metrics)
    width = max([len(r["metric"]) for r in rows] + [6])
    print(f"\n{'metric':<{width}}  {'base':>10}  {'work':>10}  {'work/base':>9}")
    for row in rows:
        print(f"{row['metric']:<{width}}  {row['base']:>10.3f}  {row['work']:>10.3f}  {row['ratio'] or '-':>9}")
    ratios = [row["ratio"] for row in rows if row["ratio"]]
    summary = {"bench": "trees", "benchmark": " ".join(args.command), "base": commit, "work": "working tree",
               "rounds": args.rounds, "run_seconds": seconds, "rows": rows,
               "ratio_range": [min(ratios), max(ratios)] if ratios else None}
    out = ROOT / "bench" / "results" / f"trees-{name}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
