"""Benchmark: the README main job's infer.py with its defaults on a shared machine and a quiet one, side by side
with the choices a user could have made by hand.

    python bench/decode/shared_box.py                      # checkpoints/tiny (the README main job trains it if absent)
    python bench/decode/shared_box.py --records 48 --rounds 3 --results

Threads: infer.py as the README runs it, on the first `--records` records of data/spo_dev.jsonl, with its default
threads (no --threads: the run's, fitted to the cores left free, `chatglm_tune.runtime.cores`), `--threads 1` and
`--threads 2`, on a quiet machine and beside a second process that spins one core (`while True: pass`), the
variants alternated over `--rounds`. Speculation: its default (`--speculative auto`), `--speculative on` and
`--no-speculative` at `--batch-size 1` and 8, quiet, alternated; every variant's rows must equal the plain run's.
A figure is the median round's records/s (infer.py's summary: extraction time, the model's loading left out).

Targets: busy-box default >= 0.8x the best --threads choice on the busy box; quiet-box default not below the
quiet box's --threads 2 (the run's own, what the default was before it was fitted); the default speculation within
5% of the better of on and off at batch 1 and at batch 8, rows equal.
Results: bench/results/shared-box.json and .md; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, ROOT, machine, made_by  # noqa: E402

THREADS = {"default": [], "--threads 1": ["--threads", "1"], "--threads 2": ["--threads", "2"]}
SPECULATION = {"auto (default)": [], "on": ["--speculative", "on"], "off": ["--no-speculative"]}
README_TRAIN = ["train.py", "--model", "tiny", "--tuning", "full", "--train-file", "data/spo_train.jsonl",
                "--dev-file", "data/spo_dev.jsonl", "--output-dir"]


def infer(model: Path, records: Path, out: Path, flags: list[str]) -> tuple[float, str, str]:
    """(records/s, the rows, the model line) of one infer.py run as a user runs it (no OMP_NUM_THREADS)."""
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, str(ROOT / "infer.py"), "--model", str(model), "--input", str(records),
                           "--output", str(out), *flags], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"infer.py {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
    line = next(x for x in done.stderr.splitlines() if x.startswith("model: "))
    return summary["this_run"]["records_per_s"], out.read_text(encoding="utf-8"), line


def rounds_of(variants: dict, model: Path, records: Path, work: Path, rounds: int, busy: bool, extra=()) -> dict:
    """{variant: {"records_per_s": median, "runs": [...], "line": model line, "rows": rows}}, the variants
    alternated (their order turned each round), beside a spinning process where `busy`."""
    runs = {name: [] for name in variants}
    rows, lines = {}, {}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        for r in range(rounds):
            names = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for name in names:
                speed, rows[name], lines[name] = infer(model, records, work / "out.jsonl", [*extra, *variants[name]])
                runs[name].append(round(speed, 2))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {name: {"records_per_s": statistics.median(runs[name]), "runs": runs[name], "line": lines[name],
                   "rows": rows[name]} for name in variants}


def readme_model(work: Path) -> Path:
    """checkpoints/tiny, trained with the README's command where it is not there yet."""
    model = ROOT / "checkpoints" / "tiny"
    if not (model / "config.json").exists():
        print("training the README main job's model (a few minutes) ...", file=sys.stderr)
        subprocess.run([sys.executable, *README_TRAIN, str(model)], cwd=ROOT, check=True, capture_output=True)
    return model


def verdicts(threads: dict, speculation: dict) -> dict:
    busy, quiet = threads["busy"], threads["quiet"]
    best_busy = max(busy["--threads 1"]["records_per_s"], busy["--threads 2"]["records_per_s"])
    out = {"busy_default_vs_best": round(busy["default"]["records_per_s"] / best_busy, 3),
           "quiet_default_vs_threads_2": round(quiet["default"]["records_per_s"]
                                               / quiet["--threads 2"]["records_per_s"], 3)}
    for batch, variants in speculation.items():
        better = max(variants["on"]["records_per_s"], variants["off"]["records_per_s"])
        auto = variants["auto (default)"]["records_per_s"]
        out[f"speculation_batch_{batch}_auto_vs_better"] = round(auto / better, 3)
        out[f"speculation_batch_{batch}_rows_equal"] = len({v["rows"] for v in variants.values()}) == 1
    out["threads_rows_equal"] = len({v["rows"] for box in threads.values() for v in box.values()}) == 1
    out["met"] = (out["busy_default_vs_best"] >= 0.8 and out["quiet_default_vs_threads_2"] >= 0.95
                  and all(v >= 0.95 for k, v in out.items() if k.endswith("_vs_better"))
                  and all(v for k, v in out.items() if k.endswith("_equal")))
    return out


def table(threads: dict, speculation: dict) -> str:
    lines = ["| machine | infer.py | records/s (median) | runs | threads chosen |", "|---|---|---|---|---|"]
    for box, variants in threads.items():
        for name, v in variants.items():
            chosen = v["line"].split("cpu, ", 1)[-1].split(")", 1)[0] if "cpu, " in v["line"] else ""
            lines.append(f"| {box} | {name} | {v['records_per_s']:.2f} | {v['runs']} | {chosen}) |")
    lines += ["", "| batch | --speculative | records/s (median) | runs |", "|---|---|---|---|"]
    for batch, variants in speculation.items():
        lines += [f"| {batch} | {name} | {v['records_per_s']:.2f} | {v['runs']} |" for name, v in variants.items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a run directory (default: checkpoints/tiny, trained if absent)")
    p.add_argument("--records", type=int, default=48,
                   help="records of data/spo_dev.jsonl extracted (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternated variants (default %(default)s)")
    p.add_argument("--results", action="store_true", help="write bench/results/shared-box.{json,md}")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shared-box-") as tmp:
        work = Path(tmp)
        model = args.model or readme_model(work)
        records = work / "records.jsonl"
        lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[: args.records]
        records.write_text("\n".join(lines) + "\n", encoding="utf-8")
        threads = {box: rounds_of(THREADS, model, records, work, args.rounds, busy=box == "busy")
                   for box in ("quiet", "busy")}
        speculation = {b: rounds_of(SPECULATION, model, records, work, args.rounds, busy=False,
                                    extra=["--batch-size", str(b)])
                       for b in (1, 8)}
    found = verdicts(threads, speculation)
    print(table(threads, speculation))
    on = machine(2)
    result = {"bench": "shared_box", "model": str(model), "records": args.records, "rounds": args.rounds, **on,
              **found, "threads": {box: {k: {"records_per_s": v["records_per_s"], "runs": v["runs"], "line": v["line"]}
                                         for k, v in variants.items()} for box, variants in threads.items()},
              "speculation": {str(b): {k: {"records_per_s": v["records_per_s"], "runs": v["runs"]}
                                       for k, v in variants.items()}
                              for b, variants in speculation.items()}}
    if args.results:
        (RESULTS / "shared-box.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
        made = made_by("bench/decode/shared_box.py", on)
        (RESULTS / "shared-box.md").write_text(f"# infer.py on a shared machine\n\n{made}\n\n"
                                               f"{table(threads, speculation)}\n\n{json.dumps(found)}\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("threads", "speculation")}))
    return result


if __name__ == "__main__":
    main()
