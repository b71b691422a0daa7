"""Benchmark: fp32, bf16, INT8 and INT4 weights side by side on CPU for a mid-size ChatGLM
(hidden 2048, 8 layers, 16 heads of 128, inner 8192, the real 130528-token vocabulary).

    python bench/decode/quant.py          # the full run (about 3 minutes on 2 shared cores)
    python bench/decode/quant.py --quick  # smoke run: 2 layers, 8 new tokens

Random weights are written once in fp16 and quantized by `quantize.py` (INT8 and INT4 with per-row
scales: the official formats). fp32 and bf16 load the fp16 file. `+e8` variants also hold the tied
embedding / head as one INT8 copy (`quantize_embedding`, beyond the official format). Measured:
- disk: the bytes of the weight file each variant loads;
- RSS to load: each variant loaded alone in a fresh process, its own peak resident set
  (`measure.run`); the Python + torch baseline of such a process (its peak before loading) is printed
  beside it;
- decode tokens/s at batch 1: `generation.generate`, greedy, a 16-token prompt, no stop on <eop>,
  (new - 1) / (time(new tokens) - time(1 token)) so the prompt step is excluded. All four models are
  held in this process and measured in interleaved rounds (the median is kept), so a change of load
  on the shared machine hits every variant alike;
- ratios to bf16, to fp32 and to the memory-bandwidth bound: copy bandwidth / weight bytes read per
  token, with the copy bandwidth = (read + written) bytes / s of a 512 MiB tensor copy (the best of 3,
  `measure.copy_bandwidth`) measured in the same rounds and the bytes per token = the block and
  final-LayerNorm parameters plus the head (tied to the embedding). A GEMV only reads, so it can run
  slightly above that bound.
A torch.profiler pass per variant says where decode time goes. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import copy_bandwidth, median_seconds, peak_rss, run_python  # noqa: E402
from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration  # noqa: E402
from chatglm_tune.decoding.generation import generate  # noqa: E402
from chatglm_tune.models.chatglm6b.config import QUANTIZABLE_LINEARS as BLOCK_LINEARS  # noqa: E402

MID = dict(hidden_size=2048, num_layers=8, num_attention_heads=16, inner_hidden_size=8192)
QUICK = dict(num_layers=2, new_tokens=8, rounds=2)
FULL = dict(new_tokens=32, rounds=3)
# Variant -> (weights: "fp16" (the source) or "int8"/"int4" (quantize.py --bits), compute dtype, embedding:
# "half" as stored (the official format) or "int8" (`from_pretrained(quantize_embedding=True)`: one INT8 copy
# of the tied embedding / head, whose decode matmul then runs in the int8pack kernel)).
VARIANTS = {"fp32": ("fp16", "float32", "half"), "bf16": ("fp16", "bfloat16", "half"),
            "int8": ("int8", "float32", "half"), "int4": ("int4", "float32", "half"),
            "int8+e8": ("int8", "float32", "int8"), "int4+e8": ("int4", "float32", "int8")}
TARGETS = {"int8": 1.6, "int4": 2.0, "int8+e8": 1.6, "int4+e8": 2.0}  # decode tokens/s over bf16
TARGET_INT4_DISK = 0.3  # INT4 bytes / fp16 bytes of the block Linears
OP_GROUPS = {"aten::_weight_int8pack_mm": "int8pack", "aten::_weight_int4pack_mm_for_cpu": "int4pack",
             "aten::mm": "dense matmul", "aten::addmm": "dense matmul", "aten::bmm": "dense matmul"}


# ---------------------------------------------------------------------------------------------- children


def load_variant(model_dir, dtype: str, embedding: str):
    return ChatGLMForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                           quantize_embedding=embedding == "int8")


def load_child(model_dir: str, dtype: str, embedding: str) -> None:
    """Load one variant (this process is measured from outside); its baseline peak and load time."""
    before = peak_rss()
    start = time.perf_counter()
    load_variant(model_dir, dtype, embedding)
    print(json.dumps({"seconds": time.perf_counter() - start, "baseline": before}))


def quantize_child(argv: list[str]) -> None:
    """Run quantize.py's main (this process is measured from outside); its time, imports excluded."""
    import quantize

    start = time.perf_counter()
    quantize.main(argv)
    print(json.dumps({"seconds": time.perf_counter() - start}))


# ---------------------------------------------------------------------------------------------- measurements


def write_source(directory: Path, config: ChatGLMConfig) -> None:
    """Random weights (`_init_weights`), built directly in fp16: one copy in memory."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        ChatGLMForConditionalGeneration(config).save_pretrained(directory)
    finally:
        torch.set_default_dtype(default)


def decode_rate(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Greedy decode tokens/s, the prompt step excluded (the warm-up was done once for all rounds)."""
    def seconds(n: int) -> float:
        def call():
            assert len(generate(model, ids, max_new_tokens=n, eos_token_id=None)[0]) == n

        return median_seconds(call, repeats=1, warmup=0)

    one = seconds(1)
    return (new_tokens - 1) / (seconds(new_tokens) - one)


def bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: blocks, final LayerNorm, the head (the tied embedding)."""
    modules = (model.transformer.layers, model.transformer.final_layernorm, model.lm_head)
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def profile_decode(model, ids: torch.Tensor, tokens: int) -> dict:
    """Self CPU seconds by op group over one `generate` of `tokens` tokens, and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        generate(model, ids, max_new_tokens=tokens, eos_token_id=None)
        wall = time.perf_counter() - start
    groups = {}
    for e in prof.key_averages():
        group = OP_GROUPS.get(e.key, "attention" if "attention" in e.key else "other ops")
        groups[group] = groups.get(group, 0.0) + e.self_cpu_time_total / 1e6
    groups["python + dispatch"] = max(0.0, wall - sum(groups.values()))
    return {"wall": round(wall, 3), **{k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}


def layer_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of the block Linears' tensors, bytes of all tensors) in a directory's safetensors."""
    from safetensors import safe_open

    size = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
    linears = total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                n = torch.Size(s.get_shape()).numel() * size[s.get_dtype()]
                total += n
                linears += n if key.split(".")[-2] in BLOCK_LINEARS else 0
    return linears, total


# ---------------------------------------------------------------------------------------------- run


def bench(args, mode: dict) -> dict:
    torch.set_num_threads(args.threads)
    config = ChatGLMConfig.from_name("mid",
                                     **{**MID, **({"num_layers": mode["num_layers"]} if "num_layers" in mode else {})})
    load = [os.getloadavg()[0]]
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {load[0]:.2f} on {os.cpu_count()} CPUs; "
          f"hidden {config.hidden_size}, {config.num_layers} layers, inner {config.inner_hidden_size}, vocab "
          f"{config.vocab_size}")
    results = {name: {"dtype": dtype, "weights": weights, "embedding": emb}
               for name, (weights, dtype, emb) in VARIANTS.items()}
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        dirs = {"fp16": Path(tmp) / "fp16", "int8": Path(tmp) / "int8", "int4": Path(tmp) / "int4"}
        start = time.perf_counter()
        write_source(dirs["fp16"], config)
        print(f"random fp16 weights written in {time.perf_counter() - start:.1f} s")
        quantize_runs = {}
        for bits in (8, 4):
            done = run_python(__file__, "--threads", args.threads, "--child", "quantize", "--bits", bits, dirs["fp16"],
                              dirs[f"int{bits}"])
            seconds = done.last_json()["seconds"]
            quantize_runs[f"int{bits}"] = {"seconds": round(seconds, 1), "peak_rss_mb": round(done.peak_rss / 1e6)}
            print(f"quantize.py --bits {bits}: {seconds:.1f} s, peak RSS {done.peak_rss / 1e6:,.0f} MB")
        for name, r in results.items():
            done = run_python(__file__, "--threads", args.threads, "--child", "load", dirs[r["weights"]], r["dtype"],
                              r["embedding"])
            loaded = done.last_json()
            linears, total = layer_bytes(dirs[r["weights"]])
            r.update(disk_bytes=total, disk_linear_bytes=linears, load_s=round(loaded["seconds"], 2),
                     rss_load_mb=round(done.peak_rss / 1e6), rss_baseline_mb=round(loaded["baseline"] / 1e6))
        models = {name: load_variant(dirs[r["weights"]], r["dtype"], r["embedding"]) for name, r in results.items()}
        ids = torch.randint(5, 130000, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
        ids[0, -2:] = torch.tensor([config.gmask_token_id, config.bos_token_id])
        for model in models.values():
            generate(model, ids, max_new_tokens=4, eos_token_id=None)  # warm-up (and the INT4 repack)
        rates, bandwidths = {name: [] for name in models}, []
        for round_ in range(mode["rounds"]):
            bandwidths.append(copy_bandwidth(mib=512, repeats=3))
            for name, model in models.items():
                rates[name].append(decode_rate(model, ids, mode["new_tokens"]))
            print(f"round {round_ + 1}: copy {bandwidths[-1] / 1e9:.1f} GB/s; "
                  + ", ".join(f"{n} {v[-1]:.2f}" for n, v in rates.items()) + " tok/s", flush=True)
        bandwidth = statistics.median(bandwidths)
        for name, model in models.items():
            r = results[name]
            r.update(weight_bytes_per_token=bytes_per_token(model), decode_tok_s=statistics.median(rates[name]),
                     rounds_tok_s=[round(v, 3) for v in rates[name]],
                     profile_s=profile_decode(model, ids, args.profile_tokens))
            r["bound_tok_s"] = bandwidth / r["weight_bytes_per_token"]
    load.append(os.getloadavg()[0])
    return {"config": config, "results": results, "quantize": quantize_runs, "bandwidth": bandwidth, "load": load}


def report(args, mode: dict, run: dict) -> None:
    results = run["results"]
    bf16, fp32 = results["bf16"]["decode_tok_s"], results["fp32"]["decode_tok_s"]
    for r in results.values():
        r.update(x_bf16=r["decode_tok_s"] / bf16, x_fp32=r["decode_tok_s"] / fp32,
                 of_bound=r["decode_tok_s"] / r["bound_tok_s"])
    header = (f"{'variant':<8}{'loads':>7}{'embed':>6}{'disk MB':>9}{'RSS load MB':>12}{'MB read/tok':>12}{'tok/s':>8}"
              f"{'x bf16':>8}{'x fp32':>8}{'bound tok/s':>12}{'of bound':>9}")
    print(f"\n{header}\n{'-' * len(header)}")
    for name, r in results.items():
        print(f"{name:<8}{r['weights']:>7}{r['embedding']:>6}{r['disk_bytes'] / 1e6:>9,.0f}{r['rss_load_mb']:>12,}"
              f"{r['weight_bytes_per_token'] / 1e6:>12,.0f}{r['decode_tok_s']:>8.2f}{r['x_bf16']:>8.2f}"
              f"{r['x_fp32']:>8.2f}{r['bound_tok_s']:>12.2f}{r['of_bound']:>9.0%}")
    linear_ratio = results["int4"]["disk_linear_bytes"] / results["fp32"]["disk_linear_bytes"]
    file_ratio = results["int4"]["disk_bytes"] / results["fp32"]["disk_bytes"]
    print(f"\ncopy bandwidth {run['bandwidth'] / 1e9:.1f} GB/s (median of the rounds); RSS includes the process "
          f"baseline ({results['fp32']['rss_baseline_mb']:,} MB before loading); INT8/INT4 compute in float32 around "
          "the integer kernels.")
    print(f"INT4 on disk / fp16: block Linears {linear_ratio:.3f}, whole file {file_ratio:.3f} (the fp16 embedding, "
          "the tied head, stays)")
    targets = {f"{n}_tok_s_vs_bf16": {"value": round(results[n]["x_bf16"], 2), "target": t,
                                      "met": results[n]["x_bf16"] >= t}
               for n, t in TARGETS.items()}
    targets["int4_linear_disk_vs_fp16"] = {"value": round(linear_ratio, 3), "target": TARGET_INT4_DISK,
                                           "met": linear_ratio <= TARGET_INT4_DISK}
    verdicts = (f"{k} {v['value']} (target {v['target']}: {'met' if v['met'] else 'MISSED'})"
                for k, v in targets.items())
    print("targets: " + "; ".join(verdicts))
    print(f"\nwhere decode time goes (torch.profiler over {args.profile_tokens} tokens, the prompt step included; self "
          "CPU s):")
    for name, r in results.items():
        print(f"  {name:<5} " + ", ".join(f"{k} {v:.2f}" for k, v in r["profile_s"].items()))
    print(f"load average before/after: {run['load'][0]:.2f}/{run['load'][1]:.2f}")
    config = run["config"]
    summary = {
        "bench": "quant", "quick": args.quick, "threads": args.threads, "prompt_len": args.prompt_len, **mode,
        "config": {k: getattr(config, k)
                   for k in ("hidden_size", "num_layers", "num_attention_heads", "inner_hidden_size", "vocab_size")},
        "load_average": [round(v, 2) for v in run["load"]], "copy_bandwidth_gb_s": round(run["bandwidth"] / 1e9, 2),
        "quantize": run["quantize"],
        "variants": {n: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                     for n, r in results.items()},
        "int4_disk_vs_fp16": {"block_linears": round(linear_ratio, 3), "whole_file": round(file_ratio, 3)},
        "targets": targets,
    }
    print(json.dumps(summary))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} (default: {FULL}, 8 layers)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default %(default)s: on 2 shared cores, OpenMP "
                   "barriers waiting for a descheduled thread cost more than the second core brings)")
    p.add_argument("--prompt-len", type=int, default=16,
                   help="prompt tokens, [gMASK] <sop> included (default %(default)s)")
    p.add_argument("--profile-tokens", type=int, default=6,
                   help="tokens generated under torch.profiler (default %(default)s)")
    # internal: load / quantize in a fresh process
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        torch.set_num_threads(args.threads)
        kind, *rest = args.child
        return load_child(*rest) if kind == "load" else quantize_child(rest)
    mode = QUICK if args.quick else FULL
    report(args, mode, bench(args, mode))


if __name__ == "__main__":
    main()
