"""Benchmark: float decoding on CPU with the models' few-row products in PyTorch's kernels against `fewrow_cpu`'s, side
by side in one run: decode steps at batch 1 to 32, and forwards checking k speculative guesses.

    python bench/decode/fewrow_decode.py                    # the serve bench's random mid-size GLM-4 (built once)
    python bench/decode/fewrow_decode.py --model DIR --dtype bfloat16 --threads 2

Each side after the same prompts (the first records of data/spo_dev.jsonl, left-padded): the median ms of
a decode step over `--steps` greedy steps, and of a forward checking k = 1, 2, 4, 8 guesses at batch 1 (k + 1 rows:
what speculative decoding trades against a step), over interleaved `--rounds` (the sides alternate which goes
first). PyTorch's side is the same code with `fewrow_cpu.routes` answering no. Also whether the two sides' greedy
tokens agree (float rounding differs: a near tie may part them). Results in bench/results/fewrow-decode.json and
.md (`--out`); the last printed line is JSON. Timings beside other work are only comparable within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, ROOT, machine, made_by  # noqa: E402
from chatglm_tune.data.batches import SpecialIds, collate_prompts  # noqa: E402
from chatglm_tune.quant import fewrow_cpu  # noqa: E402

BATCHES = (1, 8, 16, 32)  # the default batch sizes (32: fewrow_cpu.MAX_ROWS)
GUESSES = (1, 2, 4, 8)
SIDES = ("pytorch", "fewrow")


@contextlib.contextmanager
def side(name: str):
    """The products as `name` runs them: "fewrow" as the toolkit does, "pytorch" with the kernel turned away."""
    if name == "fewrow":
        yield
        return
    routes = fewrow_cpu.routes
    fewrow_cpu.routes = lambda x, weight: False
    try:
        yield
    finally:
        fewrow_cpu.routes = routes


def prompts(model_dir: Path, batch: int, dtype: str, threads: int):
    from chatglm_tune.data.records import read_records
    from chatglm_tune.runs import loading

    source = loading.resolve_run(str(model_dir))
    model, tokenizer, line = loading.load_for_inference(source, device="cpu", dtype=dtype, threads=threads,
                                                        note=lambda _: None)
    records, _ = read_records(ROOT / "data" / "spo_dev.jsonl", columns=source.columns)
    ids = [tokenizer.prompt_format.prompt_ids(tokenizer, r, source.encoding)[0] for r in records[:batch]]
    return model, line, ids, SpecialIds.of(tokenizer)


@torch.inference_mode()
def steps(model, ids: list[list[int]], special, n: int) -> tuple[float, list[list[int]]]:
    """(median seconds of a decode step, each row's greedy tokens) over `n` steps after the prompts."""
    from chatglm_tune.decoding.batch_cache import BatchCache

    batch = collate_prompts(ids, special)  # left-padded
    cache, scores = BatchCache.prefill(model, batch["input_ids"], batch["attention_mask"])
    chosen, times = [scores.argmax(-1)], []
    for _ in range(n):
        began = time.perf_counter()
        scores = cache.step(model, chosen[-1])
        times.append(time.perf_counter() - began)
        chosen.append(scores.argmax(-1))
    return statistics.median(times), torch.stack(chosen, 1).tolist()


@torch.inference_mode()
def check(model, prompt: list[int], k: int, reps: int) -> float:
    """Median seconds of a forward checking `k` guesses at batch 1 after `prompt`."""
    from chatglm_tune.decoding.batch_cache import BatchCache

    times = []
    for _ in range(reps):
        cache, scores = BatchCache.prefill(model, torch.tensor([prompt]), None)
        token = int(scores.argmax())
        began = time.perf_counter()
        cache.verify(model, [token], [[token] * k])
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(model, ids: list[list[int]], special, args) -> dict:
    """{side: {"step_ms": {batch: ms}, "check_ms": {k: ms}, "tokens": {batch: ids}}} over alternated rounds."""
    runs = {name: {"step": {b: [] for b in args.batches}, "check": {k: [] for k in GUESSES}, "tokens": {}}
            for name in SIDES}
    for r in range(args.rounds):
        for name in (SIDES if r % 2 == 0 else SIDES[::-1]):
            with side(name):
                for b in args.batches:
                    took, tokens = steps(model, ids[:b], special, args.steps)
                    runs[name]["step"][b].append(took)
                    runs[name]["tokens"][b] = tokens
                for k in GUESSES:
                    runs[name]["check"][k].append(check(model, ids[0], k, args.reps))
    out = {}
    for name, run in runs.items():
        out[name] = {"step_ms": {b: round(1e3 * statistics.median(v), 3) for b, v in run["step"].items()},
                     "check_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in run["check"].items()}}
    out["same_tokens"] = {b: runs["pytorch"]["tokens"][b] == runs["fewrow"]["tokens"][b] for b in args.batches}
    return out


def page(result: dict, on: dict) -> str:
    p, f = result["pytorch"], result["fewrow"]
    lines = ["# Float decoding: PyTorch's few-row products against fewrow_cpu's\n",
             f"{made_by('bench/decode/fewrow_decode.py', on)}; {result['loaded']}.\n",
             "| forward | PyTorch ms | fewrow ms | speedup | x a batch-1 step (PyTorch, fewrow) |",
             "|---|---|---|---|---|"]
    base = {"pytorch": p["step_ms"][1], "fewrow": f["step_ms"][1]}
    for b in p["step_ms"]:
        lines.append(f"| decode step, batch {b} | {p['step_ms'][b]} | {f['step_ms'][b]} | "
                     f"{p['step_ms'][b] / f['step_ms'][b]:.2f}x | {p['step_ms'][b] / base['pytorch']:.2f}, "
                     f"{f['step_ms'][b] / base['fewrow']:.2f} |")
    for k in GUESSES:
        lines.append(f"| checking {k} guesses, batch 1 | {p['check_ms'][k]} | {f['check_ms'][k]} | "
                     f"{p['check_ms'][k] / f['check_ms'][k]:.2f}x | {p['check_ms'][k] / base['pytorch']:.2f}, "
                     f"{f['check_ms'][k] / base['fewrow']:.2f} |")
    lines.append(f"\nGreedy tokens equal on both sides: {result['same_tokens']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a model or run directory (default: the serve bench's random mid GLM-4)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="comma-separated batch sizes, 1 always among them (default %(default)s)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch and round")
    parser.add_argument("--reps", type=int, default=5, help="checking forwards timed per k and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per side (median kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fewrow-decode.json")
    args = parser.parse_args()
    args.batches = sorted({1, *(int(b) for b in args.batches.split(","))})  # batch 1: what the rest is set against
    if not fewrow_cpu.available():
        sys.exit("the few-row kernel cannot run or be built here (x86-64 with AVX2 and FMA, and a C++ compiler)")
    if args.model is None:
        from bench.serve.serve import prepare_model

        args.model, _ = prepare_model(argparse.Namespace(full_size=False, model=None, version="glm4", size="mid"))
    model, line, ids, special = prompts(args.model, max(args.batches), args.dtype, args.threads)
    result = {"model": str(args.model), "loaded": line, **measure(model, ids, special, args)}
    on = machine(args.threads)
    text = page(result, on)
    print("\n" + text)
    args.out.with_suffix(".md").write_text(text)
    json_line = json.dumps({"fewrow_decode": {"machine": on, **result}})
    args.out.write_text(json_line + "\n")
    print(json_line)


if __name__ == "__main__":
    main()
