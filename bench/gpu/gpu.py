"""Benchmark: the toolkit on a CUDA GPU. First the GPU tests (`python -m pytest -q -m cuda tests/test_cuda.py`, in
a subprocess: pass / fail counts recorded), then decoding and training steps on the GPU: a mid-size model and,
memory permitting, ChatGLM3-6B and GLM-4-9B at full size (random weights), in bf16 / INT8 / INT4 (the toolkit's
`quantize_model`; bitsandbytes LLM.int8() / NF4 too where bitsandbytes imports), beside transformers' own
`GlmForCausalLM.generate` and a peft LoRA step on that model (the same weight tensors, same run).

    python bench/gpu/gpu.py                    # the tests, then mid, chatglm3-6b and glm4-9b
    python bench/gpu/gpu.py --quick            # the tests, then the mid-size model, fewer tokens and steps
    python bench/gpu/gpu.py --skip-tests --models glm4-9b --precisions bf16,int4  # a part; merged into the results

Installs nothing; without CUDA it says so in one line and exits with code 2.

Per model and precision (bench/gpu/gpu_models.py: models, prompts, how each number is taken):
- decode at batch 1 and 32 (`--batches`): a `--prompt-len`-token prompt in the version's chat frame, then
  `--new-tokens` greedy tokens, no early stop; tok/s over the whole call and decode tok/s of the incremental steps;
  bf16 also through transformers' `GlmForCausalLM.generate` (min_new_tokens = max_new_tokens);
- one P-tuning v2 step (pre_seq_len 128, the library's defaults) and one LoRA step (r 8 on q/k/v), batch
  `--train-batch` x `--train-len` tokens (the second half labelled), AdamW; bf16 also a peft LoRA step on
  transformers' model with the same LoraConfig, as LLaMA-Factory runs LoRA. Full-size models train with gradient
  checkpointing (what train.py --gradient-checkpointing switches on), the mid-size one without;
- peak GPU memory of each (`torch.cuda.max_memory_allocated`, reset before each measurement; weights included).
A model is skipped, saying why, when its bf16 weights x 1.2 + 6 GB exceed the free GPU memory
(`torch.cuda.mem_get_info`); a measurement that fails is kept as a row with its error, and the rest goes on.

Results: a table, bench/results/gpu.json and gpu.md (named by the GPU, `torch.cuda.get_device_name`; a run of some
models on the same GPU replaces only theirs), and one closing JSON line.
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

DEFAULT_MODELS = ("mid", "chatglm3-6b", "glm4-9b")
HEADER = (f"{'model':<12} {'precision':<9} {'impl':<18} {'what':<13} {'batch':>5} {'seconds':>8} {'tok/s':>9} "
          f"{'decode tok/s':>12} {'peak GB':>8}")


def run_tests() -> dict:
    """The GPU tests in a subprocess: {"passed", "failed", ... counts, "returncode", "seconds", "summary"}."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)
    lines = [line.strip("= ") for line in done.stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", summary)}
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {**counts, "returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "summary": summary or done.stdout[-500:] + done.stderr[-500:], "not_passed": failures}


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
    return (f"{r['model']:<12} {r['precision']:<9} {r['impl']:<18} {r['what']:<13} {r['batch']:>5} {r['seconds']:>8.3f} "
            f"{r['tok_s']:>9.1f} {decode} {r['peak_gb']:>8.2f}")


def bench_model(name: str, args, rows: list) -> dict:
    """Every precision of one model: decode and training rows appended to `rows`; returns the model's notes."""
    from bench.gpu import gpu_models as G

    version = G.MODELS[name][0]
    params = G.parameter_count(name)
    need, free = params * 2 * 1.2 + 6e9, torch.cuda.mem_get_info()[0]
    notes = {"parameters": params, "layers": G.config_of(name).num_hidden_layers, "hidden": G.config_of(name).hidden_size}
    if need > free:
        notes["skipped"] = f"needs about {need / G.GB:.1f} GB of GPU memory, {free / G.GB:.1f} GB free"
        print(f"{name}: skipped: {notes['skipped']}", flush=True)
        return notes
    ckpt = name != "mid"
    notes["gradient_checkpointing"] = ckpt
    prompts = {b: G.prompt(version, b, args.prompt_len) for b in args.batches}
    batch = G.train_batch(version, args.train_batch, args.train_len)
    for precision in args.precisions:
        G.free()
        base = {"model": name, "precision": precision}
        toolkit = {**base, "impl": "toolkit"}
        model = attempt(rows, {**toolkit, "what": "build"}, lambda: G.quantize(G.build(name), precision))
        if model is None:
            continue
        notes.setdefault("weights_gb", {})[precision] = torch.cuda.memory_allocated() / G.GB
        for ids in prompts.values():
            measure(rows, {**toolkit, "what": "decode"}, G.decode, model, G.toolkit_decoder(model), ids, args.new_tokens)
        twin = None
        if precision == "bf16":  # transformers' own model on the same weight tensors
            hf = {**base, "impl": "transformers"}
            twin = attempt(rows, {**hf, "what": "build"}, G.transformers_twin, model)
            for ids in prompts.values() if twin is not None else ():
                measure(rows, {**hf, "what": "decode"}, G.decode, twin, G.transformers_decoder(twin), ids, args.new_tokens)
        measure(rows, {**toolkit, "what": "ptuning step"}, G.ptuning_step, model, batch, args.steps, ckpt)
        measure(rows, {**toolkit, "what": "lora step"}, G.lora_step, model, batch, args.steps, ckpt)
        if twin is not None:
            measure(rows, {**base, "impl": "transformers+peft", "what": "lora step"}, G.lora_step, twin, batch, args.steps,
                    ckpt, transformers=True)
        del model, twin
    return notes


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_gb": round(props.total_memory / 1e9, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": _version("transformers"), "peft": _version("peft"), "bitsandbytes": _version("bitsandbytes")}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def merged(path: Path, info: dict, tests: dict | None, models: dict, rows: list, settings: dict) -> dict:
    """This run's results, with the other models of an earlier run on the same GPU kept (tests: the latest run's)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("device", {}).get("device") != info["device"]:
        old = {}
    kept = [r for r in old.get("rows", []) if r["model"] not in models]
    return {"device": info, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": settings,
            "tests": tests if tests is not None else old.get("tests"),
            "models": {**{k: v for k, v in old.get("models", {}).items() if k not in models}, **models},
            "rows": kept + rows}


def headline(results: dict) -> dict:
    """Per model: bf16 decode tok/s at each batch, toolkit against transformers; the LoRA step, toolkit against
    transformers + peft; the toolkit's INT8 / INT4 decode at batch 1."""
    out = {}
    for name in results["models"]:
        rows = [r for r in results["rows"] if r["model"] == name and "error" not in r]

        def pick(precision, impl, what, batch=None, key="tok_s"):
            hit = [r for r in rows if (r["precision"], r["impl"], r["what"]) == (precision, impl, what)
                   and (batch is None or r["batch"] == batch)]
            return round(hit[0][key], 3) if hit else None

        entry = {f"bf16_decode_b{b}_tok_s": {"toolkit": pick("bf16", "toolkit", "decode", b),
                                             "transformers": pick("bf16", "transformers", "decode", b)}
                 for b in sorted({r["batch"] for r in rows if r["what"] == "decode"})}
        entry["bf16_lora_step_s"] = {"toolkit": pick("bf16", "toolkit", "lora step", key="seconds"),
                                     "transformers+peft": pick("bf16", "transformers+peft", "lora step", key="seconds")}
        entry["decode_b1_tok_s"] = {p: pick(p, "toolkit", "decode", 1) for p in sorted({r["precision"] for r in rows})}
        out[name] = entry
    return out


def markdown(results: dict) -> str:
    info, tests = results["device"], results["tests"] or {}
    s = results["settings"]
    lines = [f"# The toolkit on a CUDA GPU: {info['device']}", "",
             f"GPU: {info['device']} (compute capability {info['capability']}, {info['memory_gb']} GB); torch {info['torch']}, "
             f"CUDA {info['cuda']}, transformers {info['transformers']}, peft {info['peft']}, bitsandbytes "
             f"{info['bitsandbytes'] or 'not installed'}. Made by `python bench/gpu/gpu.py` ({results['when']}); GB = 1e9 bytes.", "",
             f"Tests (`pytest -m cuda tests/test_cuda.py`): {tests.get('summary', 'not run')}", ""]
    lines += [f"- not passed: `{line}`" for line in tests.get("not_passed", [])]
    lines += ["", f"Decode: {s['prompt_len']}-token prompt, {s['new_tokens']} greedy tokens, no early stop; tok/s over the "
              "whole call, decode tok/s of the incremental steps. Steps: batch "
              f"{s['train_batch']} x {s['train_len']} tokens (half labelled), AdamW, median of {s['steps']} after a warm-up; "
              "P-tuning v2 pre_seq_len 128, LoRA r 8 on q/k/v. Peak = `torch.cuda.max_memory_allocated` (weights included). "
              "Random weights (bench/gpu/gpu_models.py).", ""]
    for name, notes in results["models"].items():
        lines += [f"## {name}: {notes['layers']} layers, hidden {notes['hidden']}, {notes['parameters'] / 1e9:.2f} B parameters", ""]
        if "skipped" in notes:
            lines += [f"Skipped: {notes['skipped']}.", ""]
            continue
        lines += [f"Gradient checkpointing: {'on' if notes.get('gradient_checkpointing') else 'off'}. Weights on the GPU: "
                  + ", ".join(f"{p} {gb:.2f} GB" for p, gb in notes.get("weights_gb", {}).items()) + ".", "",
                  "| precision | impl | what | batch | seconds | tok/s | decode tok/s | peak GB |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in results["rows"] if r["model"] == name):
            if "error" in r:
                lines.append(f"| {r['precision']} | {r['impl']} | {r['what']} | | error: {r['error']} | | | |")
                continue
            decode = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else ""
            lines.append(f"| {r['precision']} | {r['impl']} | {r['what']} | {r['batch']} | {r['seconds']:.3f} | "
                         f"{r['tok_s']:.1f} | {decode} | {r['peak_gb']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the mid-size model only, 16 new tokens, 1 timed step")
    p.add_argument("--models", help=f"comma-separated, of {', '.join(DEFAULT_MODELS)} (default: all; --quick: mid)")
    p.add_argument("--precisions", help="comma-separated, of bf16, int8, int4, bnb-int8, bnb-nf4 (default: bf16,int8,int4, "
                   "and bnb-int8,bnb-nf4 where bitsandbytes imports; --quick: bf16,int8,int4)")
    p.add_argument("--batches", default="1,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="decode prompt tokens (default %(default)s)")
    p.add_argument("--new-tokens", type=int, help="greedy tokens per row (default 64; --quick 16)")
    p.add_argument("--train-batch", type=int, default=4, help="rows per training step (default %(default)s)")
    p.add_argument("--train-len", type=int, default=1024,
                   help="tokens per training row (default %(default)s: the 4 x 1024 LoRA step the GPU targets name)")
    p.add_argument("--steps", type=int, help="timed training steps, after one warm-up (default 3; --quick 1)")
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/test_cuda.py first")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default %(default)s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else "no GPU found"
        print(f"bench/gpu/gpu.py: needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {build})",
              file=sys.stderr)
        return 2
    bnb = importlib.util.find_spec("bitsandbytes") is not None and not args.quick
    models = args.models.split(",") if args.models else (["mid"] if args.quick else list(DEFAULT_MODELS))
    precisions = args.precisions.split(",") if args.precisions else ["bf16", "int8", "int4", *(["bnb-int8", "bnb-nf4"] if bnb else [])]
    unknown = [m for m in models if m not in DEFAULT_MODELS] + [x for x in precisions if x not in
                                                                 ("bf16", "int8", "int4", "bnb-int8", "bnb-nf4")]
    if unknown:
        p.error(f"unknown model or precision: {', '.join(unknown)}")
    args.precisions = precisions
    args.batches = [int(b) for b in args.batches.split(",")]
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.steps = args.steps or (1 if args.quick else 3)
    info = device_info()
    print(f"{info['device']} ({info['memory_gb']} GB), torch {info['torch']}, CUDA {info['cuda']}", flush=True)
    tests = None
    if not args.skip_tests:
        print("running tests/test_cuda.py ...", flush=True)
        tests = run_tests()
        print(f"tests: {tests['summary']} (exit code {tests['returncode']})", flush=True)
        for line in tests["not_passed"]:
            print(f"  {line}", flush=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"\n{HEADER}\n{'-' * len(HEADER)}", flush=True)
    rows, notes = [], {}
    for name in models:
        notes[name] = bench_model(name, args, rows)
    settings = {k: getattr(args, k) for k in ("batches", "prompt_len", "new_tokens", "train_batch", "train_len", "steps", "quick")}
    args.out.mkdir(parents=True, exist_ok=True)
    results = merged(args.out / "gpu.json", info, tests, notes, rows, settings)
    results["headline"] = headline(results)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "gpu.md").write_text(markdown(results) + "\n")
    print(f"\nwrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")
    counts = {k: v for k, v in (results["tests"] or {}).items() if isinstance(v, int) and k not in ("returncode",)}
    print(json.dumps({"gpu": {"device": info["device"], "tests": counts, "headline": results["headline"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
