"""Benchmark: extraction with speculative greedy decoding (guesses looked up in each record's own text, checked
several a forward) against plain greedy decoding, side by side in one run, on trained models.

    python bench/decode/speculative.py                                  # the README main job's run (checkpoints/tiny)
    python bench/decode/speculative.py --model checkpoints/tiny --model DIR --batch-sizes 1,8 --records 64
    python bench/decode/speculative.py --model /models/chatglm3-6b-int4 --verify-only --threads 2   # k-row cost

A model is a train.py run directory (or any model directory infer.py takes); the README's main job makes
`checkpoints/tiny`. Each model extracts the first `--records` records of `--input` with infer.py's code
(`extraction.extract`: prompts sorted by length within a window, left-padded batches), once plainly and once
with speculation, alternated over `--rounds` (plain first in odd rounds), and the rows of the two must be
equal. Per model and batch size: decode tok/s (generated tokens / wall time, prompts included; the median
round), the speedup, the guessed tokens the model took (acceptance) and a row's tokens per forward.

`--verify-only` (or always, with `--verify-cost`): the cost of a forward that checks k guesses, k = 0 (a plain
decode step), 1, 2, 4, 8, at batch 1 after the first record's prompt: the median ms of `BatchCache.verify`
over `--reps`, and its ratio to the plain step. Decoding reads the weights once a forward, so a forward of
k + 1 rows costs about one row's where the weights' bytes, not arithmetic, bound it.

At full size, where a forward's cost is what speculation trades, on a trained model's acceptance pattern and beside
llama.cpp: bench/decode/speculative_full.py.

Targets: speculative tok/s >= 2x plain at batch 1 and >= 1.5x at batch 8, on every model, with equal rows.
Results: bench/results/speculative.json and .md; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, ROOT, machine, made_by  # noqa: E402

TARGETS = {1: 2.0, 8: 1.5}  # batch size -> speculative / plain tok/s
VERIFY_GUESSES = (0, 1, 2, 4, 8)


def load(model_dir: Path, threads: int | None, *, bits: int | None = None, dtype: str | None = None):
    """(source, model, tokenizer, its line) on the CPU, as infer.py loads it; `bits` INT8 / INT4 layers with the
    embedding and head in INT8."""
    from chatglm_tune.runs import loading

    source = loading.resolve_run(str(model_dir))
    model, tokenizer, line = loading.load_for_inference(source, device="cpu", dtype=dtype, threads=threads,
                                                        quantization_bit=bits,
                                                        quantize_embedding=bits is not None or None,
                                                        note=lambda _: None)
    return source, model, tokenizer, line


def records_of(path: Path, n: int, source):
    from chatglm_tune.data.records import read_records

    records, _ = read_records(path, columns=source.columns)
    return records[:n]


def extract_once(model, tokenizer, records, settings) -> tuple[list[dict], float, object]:
    from chatglm_tune.decoding.speculative import DecodeStats
    from chatglm_tune.evaluation import extraction

    stats = DecodeStats()
    began = time.perf_counter()
    rows = [r for ready in extraction.extract(model, tokenizer, records, settings, stats=stats) for r in ready]
    return rows, time.perf_counter() - began, stats


def compare(model, tokenizer, records, source, batch: int, rounds: int) -> dict:
    """Plain and speculative extraction of `records` at `batch`, alternated: the median round of each."""
    from dataclasses import replace

    from chatglm_tune.options import DEFAULT_DRAFTS, ExtractionSettings

    base = ExtractionSettings(batch_size=batch, encoding=source.encoding)
    sides = {"plain": replace(base, drafts=None), "speculative": replace(base, drafts=DEFAULT_DRAFTS)}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[dict]] = {}
    stats = None
    for r in range(rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):
            rows, took, run_stats = extract_once(model, tokenizer, records, sides[name])
            seconds[name].append(took)
            outputs[name] = rows
            stats = run_stats if name == "speculative" else stats
    tokens = sum(row["new_tokens"] for row in outputs["plain"])
    plain_s, fast_s = statistics.median(seconds["plain"]), statistics.median(seconds["speculative"])
    return {"batch": batch, "records": len(records), "new_tokens": tokens,
            "same_rows": outputs["plain"] == outputs["speculative"],
            "plain_tok_s": round(tokens / plain_s, 2), "speculative_tok_s": round(tokens / fast_s, 2),
            "speedup": round(plain_s / fast_s, 3), "tokens_per_forward": round(stats.tokens_per_forward, 3),
            "acceptance": round(stats.acceptance, 3), "forwards": stats.forwards, "plain_s": seconds["plain"],
            "speculative_s": seconds["speculative"], "f1": scores_of(outputs["speculative"], records)}


def scores_of(rows: list[dict], records) -> float | None:
    from chatglm_tune.evaluation.metrics import score_answers

    micro = score_answers([row["generated"] for row in rows], records).get("micro")
    return None if micro is None else round(micro["f1"], 4)


@torch.inference_mode()
def verify_cost(model, tokenizer, record, source, reps: int) -> list[dict]:
    """ms of one forward checking k guesses (k + 1 tokens a row), at batch 1 after `record`'s prompt."""
    from chatglm_tune.decoding.batch_cache import BatchCache

    prompt = tokenizer.prompt_format.prompt_ids(tokenizer, record, source.encoding)[0]
    ids = torch.tensor([prompt])
    out = []
    for k in VERIFY_GUESSES:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            cache, scores = BatchCache.prefill(model, ids, None)
            token = int(scores.argmax())
            began = time.perf_counter()
            if k == 0:
                cache.step(model, torch.tensor([token]))
            else:
                cache.verify(model, [token], [[token] * k])
            times.append(time.perf_counter() - began)
        out.append({"guesses": k, "ms": round(1000 * statistics.median(times[1:]), 2)})
    for row in out:
        row["x_plain_step"] = round(row["ms"] / out[0]["ms"], 3)
    return out


def measure_model(model_dir: Path, args) -> dict:
    source, model, tokenizer, line = load(model_dir, args.threads)
    records = records_of(args.input, args.records, source)
    result = {"model": str(model_dir), "loaded": line, "version": tokenizer.prompt_format.name,
              "params": sum(p.numel() for p in model.parameters())}
    if not args.verify_only:
        result["runs"] = [compare(model, tokenizer, records, source, b, args.rounds) for b in args.batch_sizes]
    if args.verify_only or args.verify_cost:
        result["verify"] = verify_cost(model, tokenizer, records[0], source, args.reps)
    return result


def table(results: list[dict]) -> str:
    lines = ["| model | batch | plain tok/s | speculative tok/s | speedup | target | tokens/forward | acceptance | "
             "same rows | dev F1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for run in result.get("runs", ()):
            target = TARGETS.get(run["batch"])
            lines.append(f"| {Path(result['model']).name} | {run['batch']} | {run['plain_tok_s']} | "
                         f"{run['speculative_tok_s']} | {run['speedup']}x | {'-' if target is None else f'{target}x'} "
                         f"| {run['tokens_per_forward']} | {run['acceptance']:.0%} | {run['same_rows']} "
                         f"| {run['f1']} |")
    for result in results:
        if result.get("verify"):
            lines += ["", f"Cost of checking k guesses in one forward, batch 1 ({Path(result['model']).name}):", "",
                      "| k | ms | x plain step |", "|---|---|---|"]
            lines += [f"| {row['guesses']} | {row['ms']} | {row['x_plain_step']} |" for row in result["verify"]]
    return "\n".join(lines)


def verdicts(results: list[dict]) -> list[str]:
    out = []
    for result in results:
        for run in result.get("runs", ()):
            target = TARGETS.get(run["batch"])
            if target is not None:
                met = run["speedup"] >= target and run["same_rows"]
                out.append(f"{'PASS' if met else 'MISS'}: {Path(result['model']).name} batch {run['batch']}: "
                           f"{run['speedup']}x (target {target}x), rows equal: {run['same_rows']}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", help="a run or model directory (repeatable; default "
                   "checkpoints/tiny, the README main job's run)")
    p.add_argument("--input", type=Path, default=ROOT / "data" / "spo_dev.jsonl", help="records (default %(default)s)")
    p.add_argument("--records", type=int, default=64, help="records extracted per run (default %(default)s)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per side (default %(default)s)")
    p.add_argument("--threads", type=int, help="torch threads (default: the run's, else torch's)")
    p.add_argument("--verify-cost", action="store_true", help="also time forwards checking 0/1/2/4/8 guesses")
    p.add_argument("--verify-only", action="store_true", help="only that (e.g. on a full-size model)")
    p.add_argument("--reps", type=int, default=5, help="timed forwards per k (default %(default)s)")
    p.add_argument("--output", type=Path, default=RESULTS / "speculative.json", help="results (default %(default)s)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.model = args.model or [ROOT / "checkpoints" / "tiny"]
    missing = [str(m) for m in args.model if not (m / "config.json").exists() and not (m / "run_args.json").exists()]
    if missing:
        p.error(f"no model in {', '.join(missing)}; the README main job makes checkpoints/tiny: python train.py "
                "--model tiny --tuning full --train-file data/spo_train.jsonl --dev-file data/spo_dev.jsonl "
                "--output-dir checkpoints/tiny")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    results = [measure_model(m, args) for m in args.model]
    on = machine(torch.get_num_threads())
    summary = {"bench": "speculative", "machine": on, "results": results, "verdicts": verdicts(results)}
    text = table(results)
    print(text)
    print("\n".join(summary["verdicts"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    args.output.with_suffix(".md").write_text(
        f"# Speculative greedy decoding against plain greedy\n\n{made_by('bench/decode/speculative.py', on)}.\n\n"
        f"{text}\n\n" + "\n".join(f"- {v}" for v in summary["verdicts"]) + "\n", encoding="utf-8")
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
