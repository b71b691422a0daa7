"""Benchmark: the int8 dot-product kernel (`chatglm_tune.quant.int8dot_cpu`, activations quantized to q8_0) against
the kernels QuantizedLinear used before it, at batch 1 on ChatGLM-6B / ChatGLM3-6B layer shapes.

    python bench/kernels/int8dot_kernels.py                      # native and AVX2 capability, 1 and 2 threads
    python bench/kernels/int8dot_kernels.py --capabilities native --threads 2
    python bench/kernels/int8dot_kernels.py --quick              # smoke run: one small shape, few repeats

Candidates (same random official-format weights, side by side in interleaved rounds, median kept):
- INT8: `int8pack` (`torch._weight_int8pack_mm`, bf16 x: the previous INT8 path), `int8dot` (the new kernel on
  the path it picks at this capability, int16 activations, the official layout as it is), `int8dot-interleaved` (the
  same on `int8dot_cpu.pack`'s layout), `int8dot-interleaved-2m` (that layout in 2 MB pages: what QuantizedLinear
  holds where the system offers them, `heap.huge_pages_empty`),
  `int8dot-avx2` (its AVX2 path, forced, at the native capability), `int8dot-act8` (int8 activations, q8_0, as
  llama.cpp's q8_0 x q8_0: faster in principle, not routed: its error broke the toolkit's INT8 accuracy bounds);
- INT4: `int4pack` (PyTorch's kernel on its repacked weight: the previous INT4 path at the AVX512 level),
  `int4cpu` (the fp32 AVX2 kernel: the previous path at the AVX2 level), `int4dot`, `int4dot-interleaved`,
  `int4dot-interleaved-2m`, `int4dot-avx2`.
Each capability runs in its own process (`ATEN_CPU_CAPABILITY=avx2` for "avx2", which also makes `int8dot` take
its AVX2 path). Weights rotate over enough copies (>= 256 MB per candidate) that every call streams them from
memory, as a decode step does. Per shape and thread count: ms per call, GB/s of weight bytes read, and that
rate over `measure.copy_bandwidth` (read + written bytes of a 256 MiB copy) at the same thread count, on 4 KB
pages, and for the `-2m` candidates on 2 MB ones (a stream over 4 KB pages also pays a TLB miss per page); relative
error against the fp32 dequantized math. `--rows` adds M = 1..32 rows of x (decode, batched) and 64..512 (prefill) at
12288x4096. The load average is recorded: timings taken beside other work are only comparable within one run.
Results go to bench/results/int8dot_kernels.json (`--out`); the last printed line is JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.kernel_timing import child_argv, kernel_bench_args, time_rounds, time_rows  # noqa: E402
from bench.common.measure import RESULTS, copy_bandwidth, run_python  # noqa: E402

# (out, in, layer)
SHAPES = [(4096, 4096, "dense"), (4608, 4096, "query_key_value (ChatGLM2/3)"),
          (12288, 4096, "query_key_value (ChatGLM-6B)"), (27392, 4096, "dense_h_to_4h (ChatGLM2/3)"),
          (4096, 13696, "dense_4h_to_h (ChatGLM2/3)")]
QUICK_SHAPES = [(1024, 1024, "small")]
CANDIDATES = ["int8pack", "int8dot", "int8dot-interleaved", "int8dot-interleaved-2m", "int8dot-avx2",
              "int8dot-act8", "int4pack", "int4cpu", "int4dot", "int4dot-interleaved", "int4dot-interleaved-2m",
              "int4dot-avx2"]


def _layers(torch, N: int, K: int, copies: int, seed: int):
    from chatglm_tune.quant import int8dot_cpu
    from chatglm_tune.quant.format import pack_int4
    from chatglm_tune.quant.kernels import int4pack_weight
    from chatglm_tune.runtime import heap

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(copies):
        q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        q4 = torch.randint(-7, 8, (N, K), dtype=torch.int8, generator=g)
        s8 = (torch.rand(N, generator=g) * 1e-3 + 1e-4).half()
        s4 = (torch.rand(N, generator=g) * 1e-2 + 1e-3).half()
        p4 = pack_int4(q4)
        layer = {"q8": q8, "s8": s8, "s8b": s8.bfloat16(), "p4": p4, "s4": s4, "int4pack": int4pack_weight(p4, s4)}
        if int8dot_cpu.isa():  # the interleaved layout of the path run, on 4 KB pages and on 2 MB ones where offered
            layer |= {"q8i": int8dot_cpu.pack(q8), "p4i": int8dot_cpu.pack(p4)}
            for key, w in (("q8h", q8), ("p4h", p4)):
                if (pages := heap.huge_pages_empty(int8dot_cpu.packed_shape(*w.shape), torch.int8)) is not None:
                    layer[key] = int8dot_cpu.pack(w, out=pages)
        out.append(layer)
    return out


def _candidates(torch, layers, N: int, K: int) -> dict:
    """name -> (fn(i, x) on copy i, weight bytes read per call, bits)."""
    from chatglm_tune.quant import int4_cpu, int8dot_cpu
    from chatglm_tune.quant.kernels import int4pack_mm

    fns = {
        "int8pack": (lambda i, x: torch._weight_int8pack_mm(x.bfloat16(), layers[i]["q8"], layers[i]["s8b"]),
                     N * K + 2 * N, 8),
        "int4pack": (lambda i, x: int4pack_mm(x.bfloat16(), *layers[i]["int4pack"]),
                     N * K // 2 + 4 * N * K // layers[0]["int4pack"][1] + 4 * N, 4),
    }
    if int4_cpu.compiled():
        fns["int4cpu"] = (lambda i, x: int4_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"]), N * K // 2 + 2 * N, 4)
    isa = int8dot_cpu.isa()
    if isa:
        fns["int8dot"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["q8"], layers[i]["s8"], 8), N * K + 2 * N, 8)
        fns["int8dot-interleaved"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["q8i"], layers[i]["s8"], 8),
                                      N * K + 2 * N, 8)
        fns["int4dot"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"], 4),
                          N * K // 2 + 2 * N, 4)
        fns["int4dot-interleaved"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["p4i"], layers[i]["s4"], 4),
                                      N * K // 2 + 2 * N, 4)
        if "q8h" in layers[0]:
            fns["int8dot-interleaved-2m"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["q8h"], layers[i]["s8"], 8),
                                             N * K + 2 * N, 8)
            fns["int4dot-interleaved-2m"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["p4h"], layers[i]["s4"], 4),
                                             N * K // 2 + 2 * N, 4)
        fns["int8dot-act8"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["q8"], layers[i]["s8"], 8, act=8),
                               N * K + 2 * N, 8)
        if isa != "avx2":
            fns["int8dot-avx2"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["q8"], layers[i]["s8"], 8, "avx2"),
                                   N * K + 2 * N, 8)
            fns["int4dot-avx2"] = (lambda i, x: int8dot_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"], 4, "avx2"),
                                   N * K // 2 + 2 * N, 4)
    return fns


def child(args) -> dict:
    import torch

    from chatglm_tune.quant import int8dot_cpu
    from chatglm_tune.quant.format import dequantize

    capability = torch.backends.cpu.get_cpu_capability()
    want = os.environ.get("ATEN_CPU_CAPABILITY")
    if want and capability.lower() != want.lower():
        raise SystemExit(f"ATEN_CPU_CAPABILITY={want} did not take effect: get_cpu_capability() = {capability}")
    out = {"capability": capability, "int8dot_isa": int8dot_cpu.isa(), "torch": torch.__version__,
           "load_average_start": list(os.getloadavg()), "threads": {}}
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy_gb_s = copy_bandwidth(mib=256, repeats=3) / 1e9
        copy_2m = copy_bandwidth(mib=256, repeats=3, huge_pages=True)
        copy_gb_s_2m = copy_2m / 1e9 if copy_2m else None
        per_shape = {}
        for N, K, name in shapes:
            copies = 2 if args.quick else max(2, -(-256 * 2**20 // (N * K // 2)))
            layers = _layers(torch, N, K, copies, seed=N * 7 + K)
            fns = {c: v for c, v in _candidates(torch, layers, N, K).items() if c in args.candidates}
            x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
            row = {"copies": copies, "candidates": {}}
            for cname, (fn, nbytes, bits) in fns.items():
                w = layers[0]["q8"] if bits == 8 else layers[0]["p4"]
                s = layers[0]["s8b"].float() if cname == "int8pack" else layers[0]["s8" if bits == 8 else "s4"]
                ref = x @ dequantize(w, s, bits, torch.float32).t()
                y = fn(0, x)
                row["candidates"][cname] = {"bytes": nbytes, "rel_err": ((y.float() - ref).norm() / ref.norm()).item()}
            for cname, sec in time_rounds({c: v[0] for c, v in fns.items()}, copies, x, args.rounds,
                                          args.calls).items():
                c = row["candidates"][cname]
                gb_s = c["bytes"] / sec / 1e9
                c.update(ms=sec * 1e3, gb_s=gb_s,
                         of_copy_bw=gb_s / (copy_gb_s_2m if cname.endswith("-2m") else copy_gb_s))
            per_shape[f"{N}x{K}"] = {"layer": name, **row}
            print(f"[{capability} {threads}t] {N}x{K}: " + ", ".join(
                f"{k} {v['ms']:.2f} ms ({v['of_copy_bw']:.0%})" for k, v in row["candidates"].items()), flush=True)
            del fns, layers
        entry = {"copy_gb_s": copy_gb_s, "copy_gb_s_2m": copy_gb_s_2m, "shapes": per_shape}
        if args.rows and not args.quick:
            entry["rows"] = _rows_sweep(torch, args)
        out["threads"][str(threads)] = entry
    out["load_average_end"] = list(os.getloadavg())
    return out


# --rows: decode and batched decode, then prefill lengths (64 tokens, 512) and a batch of 8 x 64
PREFILL_ROWS = (64, 128, 512)


def _rows_sweep(torch, args) -> dict:
    """ms per call at 12288x4096 for M rows of x (fp32, the CPU default; `-bf16`: bf16 x): the kernels and
    QuantizedLinear's dequant path (its tiles dequantized to x's dtype, then a GEMM)."""
    from chatglm_tune.quant.modules import QuantizedLinear

    N, K, copies = 12288, 4096, 6
    layers = _layers(torch, N, K, copies, seed=5)
    fns = {c: v[0] for c, v in _candidates(torch, layers, N, K).items() if c in args.candidates}
    for bits, key, scale in ((8, "q8", "s8"), (4, "p4", "s4")):
        deq = [QuantizedLinear.from_parts(layer[key], layer[scale], None, bits) for layer in layers]
        for layer in deq:
            layer.kernel = "dequant"
        fns[f"dequant{bits}"] = (lambda d: lambda i, x: d[i](x))(deq)
        fns[f"dequant{bits}-bf16"] = (lambda d: lambda i, x: d[i](x.bfloat16()))(deq)
    rounds, calls = max(3, args.rounds // 2), max(4, args.calls // 3)
    # prefill: the integer-dot kernels against the dequant path (the GEMV kernels were never routed there)
    prefill = {name: fn for name, fn in fns.items() if "dot" in name or name.startswith("dequant")}
    with torch.inference_mode():
        return time_rows(torch, fns, copies, K, rounds, calls) | time_rows(torch, prefill, copies, K, rounds, 2,
                                                                           rows=PREFILL_ROWS)


def report(runs: dict) -> str:
    lines = []
    for cap, run in runs.items():
        if "error" in run:
            lines.append(f"\n## {cap}: {run['error']}")
            continue
        lines.append(f"\n## capability {run['capability']} ({cap}), int8dot path {run['int8dot_isa']}, torch "
                     f"{run['torch']}, load average {run['load_average_start'][0]:.1f} -> "
                     f"{run['load_average_end'][0]:.1f}")
        for threads, entry in run["threads"].items():
            names = [c for c in CANDIDATES if any(c in r["candidates"] for r in entry["shapes"].values())]
            huge = f", {entry['copy_gb_s_2m']:.1f} on 2 MB pages" if entry.get("copy_gb_s_2m") else ""
            lines.append(f"\n{threads} thread(s), copy bandwidth {entry['copy_gb_s']:.1f} GB/s{huge}: ms per call at "
                         "M=1 (GB/s of weight bytes read, share of the copy bandwidth on the same pages)")
            lines += [f"| shape | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
            for shape, row in entry["shapes"].items():
                cells = [f"{v['ms']:.2f} ({v['gb_s']:.1f}, {v['of_copy_bw']:.0%})"
                         if (v := row["candidates"].get(c)) else "-" for c in names]
                lines.append(f"| {shape} {row['layer']} | " + " | ".join(cells) + " |")
            if entry.get("rows"):
                rn = list(next(iter(entry["rows"].values())))
                lines += ["", f"12288x4096, M rows of x, ms per call: | M | {' | '.join(rn)} |",
                          "|---" * (len(rn) + 1) + "|"]
                lines += [f"| {M} | " + " | ".join(f"{r[n]:.2f}" if n in r else "-" for n in rn) + " |"
                          for M, r in entry["rows"].items()]
    text = "\n".join(lines)
    print(text)
    return text


def main(argv=None) -> None:
    p, args = kernel_bench_args(argv, __doc__.split("\n\n")[0], CANDIDATES, RESULTS / "int8dot_kernels.json", 12,
                                "also sweep M = 1..512 rows of x at 12288x4096")
    if args.child:
        print(json.dumps(child(args)))
        return
    forwarded = child_argv(args)
    runs = {}
    for cap in args.capabilities:
        env = {} if cap == "native" else {"ATEN_CPU_CAPABILITY": cap}
        try:
            done = run_python(__file__, "--child", *forwarded, env=env)
            print(done.stdout.strip().rsplit("\n", 1)[0], flush=True)
            runs[cap] = done.last_json()
        except RuntimeError as e:
            runs[cap] = {"error": str(e)[-500:]}
    text = report(runs)
    result = {"bench": "int8dot_kernels", "quick": args.quick, "load_average": list(os.getloadavg()),
              "runs": runs, "text": text}
    if not args.quick or args.out != p.get_default("out"):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    summary = {cap: {t: {s: {c: round(v["ms"], 3) for c, v in r["candidates"].items()} for s, r in e["shapes"].items()}
                     for t, e in run.get("threads", {}).items()} for cap, run in runs.items()}
    print(json.dumps({"bench": "int8dot_kernels", "ms_m1": summary, "out": str(args.out)}))


if __name__ == "__main__":
    main()
