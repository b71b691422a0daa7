"""Benchmark: the toolkit on a CUDA GPU. First the GPU tests (`python -m pytest -q -m cuda tests/test_cuda.py`, in
a subprocess: pass / fail counts recorded), then decoding and training steps on the GPU: a mid-size model and,
memory permitting, ChatGLM3-6B and GLM-4-9B at full size (random weights), in bf16 / INT8 / INT4 (the toolkit's
`quantize_model`; bitsandbytes LLM.int8() / NF4 too where bitsandbytes imports), beside transformers' own
`GlmForCausalLM.generate` and a peft LoRA step on that model (the same weight tensors, same run).

    python bench/gpu/gpu.py                    # the tests, then mid, chatglm3-6b and glm4-9b
    python bench/gpu/gpu.py --quick            # the tests, then the mid-size model, fewer tokens and steps
    python bench/gpu/gpu.py --tests none --models glm4-9b --precisions bf16,int4  # a part; merged into the results

Installs nothing; without CUDA it says so in one line and exits with code 2. First the card's device-to-device copy
rate (`device.copy_gb_s`: bytes read + written), the ceiling of a decode step that reads its weights once.

Per model and precision (bench/gpu/gpu_models.py: models, prompts, how each number is taken):
- decode at batch 1 and 32 (`--batches`): a `--prompt-len`-token prompt in the version's chat frame, then
  `--new-tokens` greedy tokens, no early stop; tok/s over the whole call and decode tok/s of the steps after the
  first token; the toolkit's cached loop (`toolkit`) and its compiled steps on a static cache (`toolkit-compiled`:
  CUDA graphs; its ids compared with the cached loop's), bf16 also transformers' `GlmForCausalLM.generate`
  (min_new_tokens = max_new_tokens); INT8 / INT4 also the relative error of their kernels' logits against the
  dequantizing path, and the weight bytes a step reads (`measure.weight_bytes_per_token`);
- one P-tuning v2 step (pre_seq_len 128, the library's defaults) and one LoRA step (r 8 on q/k/v), batch
  `--train-batch` x `--train-len` tokens (the second half labelled), AdamW; bf16 also a peft LoRA step on
  transformers' model with the same LoraConfig, as LLaMA-Factory runs LoRA. Full-size models train with gradient
  checkpointing (what train.py --gradient-checkpointing switches on), the mid-size one without;
- peak GPU memory of each (`torch.cuda.max_memory_allocated`, reset before each measurement; weights included).
A model is skipped, saying why, when its bf16 weights x 1.2 + 6 GB exceed the free GPU memory
(`torch.cuda.mem_get_info`); a measurement that fails is kept as a row with its error, and the rest goes on.
`--deadline` bounds a run (GPU time is short): what is measured is saved after each precision.

Results: a table, bench/results/gpu.json and gpu.md (named by the GPU, `torch.cuda.get_device_name`; a run's rows
replace the same rows of an earlier run on the same GPU, each row keeping the time of its run), and one closing
JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS  # noqa: E402
from bench.gpu.gpu_report import agreement_text, headline, markdown, merged  # noqa: E402

DEFAULT_MODELS = ("mid", "chatglm3-6b", "glm4-9b")
HEADER = (f"{'model':<12} {'precision':<9} {'impl':<18} {'what':<13} {'batch':>5} {'seconds':>8} {'tok/s':>9} "
          f"{'decode tok/s':>12} {'peak GB':>8}")


def run_tests(k: str | None = None, timeout: float | None = None) -> dict:
    """The GPU tests (those `-k` selects) in a subprocess: {"passed", "failed", ... counts, "returncode", "seconds",
    "summary"}; stopped after `timeout` seconds, saying so."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider",
               *(["-k", k] if k else [])]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"returncode": None, "seconds": round(time.perf_counter() - start, 1), "not_passed": [],
                "summary": f"stopped after {timeout:.0f} s: {out[-300:]}"}
    lines = [line.strip("= ") for line in done.stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", summary)}
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {**counts, "returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "summary": (summary + (f" (-k {k!r})" if k else "")) if summary
            else done.stdout[-500:] + done.stderr[-500:], "not_passed": failures}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]


def measure(rows: list, base: dict, fn, *args, **kwargs) -> dict | None:
    """`fn(*args, **kwargs)` as a row (`base` + its result), printed; a failure becomes a row with its error."""
    from bench.gpu import gpu_models as G

    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # an out-of-memory or a broken path: recorded, the bench goes on
        result = {"error": _error(e)}
    if "error" in result:
        G.free()  # outside the except block: the failed call's frames are gone
    row = {**base, **result}
    rows.append(row)
    print(table_row(row), flush=True)
    return None if "error" in row else row


def attempt(rows: list, base: dict, fn, *args):
    """`fn(*args)`, or None with its error kept as a row."""
    try:
        return fn(*args)
    except Exception as e:
        error = _error(e)
    measure(rows, base, dict, error=error)
    return None


def table_row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<12} {r['precision']:<9} {r['impl']:<18} {r['what']:<13} error: {r['error']}"
    decode = f"{r['decode_tok_s']:12.1f}" if "decode_tok_s" in r else f"{'':12}"
    return (f"{r['model']:<12} {r['precision']:<9} {r['impl']:<18} {r['what']:<13} {r['batch']:>5} "
            f"{r['seconds']:>8.3f} {r['tok_s']:>9.1f} {decode} {r['peak_gb']:>8.2f}")


def bench_model(name: str, args, rows: list, notes: dict, save) -> None:
    """Every precision of one model: decode and training rows appended to `rows`, the model's `notes` filled in,
    `save()` after each precision."""
    from bench.common.measure import weight_bytes_per_token
    from bench.gpu import gpu_models as G

    version = G.MODELS[name][0]
    params = G.parameter_count(name)
    need, free = params * 2 * 1.2 + 6e9, torch.cuda.mem_get_info()[0]
    notes.update(parameters=params, layers=G.config_of(name).num_hidden_layers, hidden=G.config_of(name).hidden_size)
    if need > free:
        notes["skipped"] = f"needs about {need / G.GB:.1f} GB of GPU memory, {free / G.GB:.1f} GB free"
        print(f"{name}: skipped: {notes['skipped']}", flush=True)
        return
    ckpt = name != "mid"
    notes["gradient_checkpointing"] = ckpt
    prompts = {b: G.prompt(version, b, args.prompt_len) for b in args.batches}
    batch = G.train_batch(version, args.train_batch, args.train_len)
    for precision in args.precisions:
        if time.monotonic() > args.stop_at:
            notes.setdefault("not_reached", []).append(precision)
            continue
        G.free()
        torch._dynamo.reset()  # the last model's compiled steps and CUDA graph memory
        base = {"model": name, "precision": precision}
        toolkit = {**base, "impl": "toolkit"}
        model = attempt(rows, {**toolkit, "what": "build"}, lambda: G.quantize(G.build(name), precision))
        if model is None:
            continue
        notes.setdefault("weights_gb", {})[precision] = torch.cuda.memory_allocated() / G.GB
        if precision in ("int8", "int4"):
            error = attempt(rows, {**toolkit, "what": "kernel check"}, G.kernel_error, model, prompts[min(prompts)])
            notes.setdefault("kernel_vs_dequant_error", {})[precision] = error
        notes.setdefault("read_gb_per_token", {})[precision] = weight_bytes_per_token(model) / G.GB
        decode_rows(rows, toolkit, model, prompts, args, save)
        twin = None
        if precision == "bf16" and not args.skip_transformers:  # transformers' own model on the same weight tensors
            hf = {**base, "impl": "transformers"}
            twin = attempt(rows, {**hf, "what": "build"}, G.transformers_twin, model)
            for ids in prompts.values() if twin is not None else ():
                measure(rows, {**hf, "what": "decode"}, G.decode, G.transformers_decoder(twin), ids, args.new_tokens)
        if not args.skip_train:
            training_rows(rows, base, model, twin, batch, args.steps, ckpt)
        del model, twin
        save()


def decode_rows(rows: list, toolkit: dict, model, prompts: dict, args, save) -> None:
    """The toolkit's decode rows at each batch: the cached loop, then (`--compiled`) the compiled steps on a static
    cache, with whether their ids are the cached loop's (`G.agreement`); saved after each batch."""
    from bench.gpu import gpu_models as G

    for ids in prompts.values():
        save()
        eager = measure(rows, {**toolkit, "what": "decode"}, G.decode, G.toolkit_decoder(model), ids, args.new_tokens)
        row = None
        if args.compiled and time.monotonic() <= args.stop_at:
            compiled = {**toolkit, "impl": "toolkit-compiled", "what": "decode"}
            row = measure(rows, compiled, G.decode, G.toolkit_decoder(model, compiled=True), ids, args.new_tokens)
        if row is not None and eager is not None:
            row.update(attempt(rows, {**compiled, "what": "agreement"}, G.agreement, model, ids,
                               eager["ids"], row["ids"])
                       or {})
            print(f"{'':12} compiled ids against the cached loop's: {agreement_text(row)}", flush=True)
        for done in (eager, row):  # the ids served the comparison: not kept in the results
            if done is not None:
                done.pop("ids")


def training_rows(rows: list, base: dict, model, twin, batch: dict, steps: int, ckpt: bool) -> None:
    """A P-tuning v2 and a LoRA step of the toolkit, and transformers + peft's LoRA step where `twin` is there."""
    from bench.gpu import gpu_models as G

    toolkit = {**base, "impl": "toolkit"}
    measure(rows, {**toolkit, "what": "ptuning step"}, G.ptuning_step, model, batch, steps, ckpt)
    measure(rows, {**toolkit, "what": "lora step"}, G.lora_step, model, batch, steps, ckpt)
    if twin is not None:
        measure(rows, {**base, "impl": "transformers+peft", "what": "lora step"}, G.lora_step, twin, batch, steps,
                ckpt, transformers=True)


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_gb": round(props.total_memory / 1e9, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": _version("transformers"), "peft": _version("peft"),
            "bitsandbytes": _version("bitsandbytes")}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the mid-size model only, 16 new tokens, 1 timed step")
    p.add_argument("--models", help=f"comma-separated, of {', '.join(DEFAULT_MODELS)} (default: all; --quick: mid)")
    p.add_argument("--precisions",
                   help="comma-separated, of bf16, int8, int4, bnb-int8, bnb-nf4 (default: bf16,int8,int4, "
                   "and bnb-int8,bnb-nf4 where bitsandbytes imports; --quick: bf16,int8,int4)")
    p.add_argument("--batches", default="1,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="decode prompt tokens (default %(default)s)")
    p.add_argument("--new-tokens", type=int, help="greedy tokens per row (default 64; --quick 16)")
    p.add_argument("--train-batch", type=int, default=4, help="rows per training step (default %(default)s)")
    p.add_argument("--train-len", type=int, default=1024,
                   help="tokens per training row (default %(default)s: the 4 x 1024 LoRA step the GPU targets name)")
    p.add_argument("--steps", type=int, help="timed training steps, after one warm-up (default 3; --quick 1)")
    p.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="no compiled-decoding rows (default: beside each cached-loop decode row)")
    p.add_argument("--skip-train", action="store_true", help="no training rows")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers decode rows")
    p.add_argument("--tests", choices=("first", "last", "none"), default="first",
                   help="run tests/test_cuda.py before the benches, after them, or not (default %(default)s)")
    p.add_argument("--tests-k", help="pytest -k expression: a part of tests/test_cuda.py")
    p.add_argument("--deadline", type=float, default=float("inf"),
                   help="seconds after which no new model precision (nor the tests, when last) is started; what was "
                        "measured is saved after each precision")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default %(default)s)")
    args = p.parse_args(argv)
    bnb = importlib.util.find_spec("bitsandbytes") is not None and not args.quick
    args.models = args.models.split(",") if args.models else (["mid"] if args.quick else list(DEFAULT_MODELS))
    args.precisions = (args.precisions.split(",") if args.precisions
                       else ["bf16", "int8", "int4", *(["bnb-int8", "bnb-nf4"] if bnb else [])])
    unknown = [m for m in args.models if m not in DEFAULT_MODELS] + [x for x in args.precisions if x not in
                                                                      ("bf16", "int8", "int4", "bnb-int8", "bnb-nf4")]
    if unknown:
        p.error(f"unknown model or precision: {', '.join(unknown)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.steps = args.steps or (1 if args.quick else 3)
    args.stop_at = time.monotonic() + args.deadline
    return args


def tests_now(args) -> dict:
    print("running tests/test_cuda.py ...", flush=True)
    tests = run_tests(args.tests_k, max(30.0, args.stop_at - time.monotonic()) if args.tests == "last" else None)
    print(f"tests: {tests['summary']} (exit code {tests['returncode']})", flush=True)
    for line in tests["not_passed"]:
        print(f"  {line}", flush=True)
    return tests


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else "no GPU found"
        print(f"bench/gpu/gpu.py: needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"{build})",
              file=sys.stderr)
        return 2
    from bench.gpu import gpu_models as G

    for limit in ("recompile_limit", "accumulated_recompile_limit"):  # a compiled step for each model and shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    info = {**device_info(), "copy_gb_s": G.copy_bandwidth()}
    print(f"{info['device']} ({info['memory_gb']} GB, copy {info['copy_gb_s']:.0f} GB/s), torch {info['torch']}, "
          f"CUDA {info['cuda']}", flush=True)
    tests = tests_now(args) if args.tests == "first" else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"\n{HEADER}\n{'-' * len(HEADER)}", flush=True)
    rows, notes = [], {}
    settings = {k: getattr(args, k) for k in ("batches", "prompt_len", "new_tokens", "train_batch", "train_len",
                                              "steps", "quick")}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> dict:
        results = merged(args.out / "gpu.json", info, tests, notes, rows, settings)
        results["headline"] = headline(results)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "gpu.md").write_text(markdown(results) + "\n")
        return results

    for name in args.models:
        bench_model(name, args, rows, notes.setdefault(name, {}), save)
    if args.tests == "last" and time.monotonic() < args.stop_at:
        tests = tests_now(args)
    results = save()
    print(f"\nwrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")
    counts = {k: v for k, v in (results["tests"] or {}).items() if isinstance(v, int) and k not in ("returncode",)}
    print(json.dumps({"gpu": {"device": info["device"], "copy_gb_s": info["copy_gb_s"], "tests": counts,
                              "headline": results["headline"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
