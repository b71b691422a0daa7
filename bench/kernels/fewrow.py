"""Benchmark: float matmuls of a few rows of x on CPU, PyTorch's `F.linear` against `chatglm_tune.quant.fewrow_cpu`.

    python bench/kernels/fewrow.py                    # 2 threads, fp32 and bf16, the shapes below
    python bench/kernels/fewrow.py --quick            # a smoke run: one small shape from cache, few rounds

Shapes: the mid-size GLM-4 the serve and speculative benches build (hidden 1024), and ChatGLM3-6B's block Linears and
head. Rows of x: a decode step (1), a speculative check of k guesses (k + 1 rows), small batches. Both candidates
side by side in interleaved rounds on the same random weights, rotating over enough copies (>= 256 MB) that every
call streams its weight from memory, as a decode step does; the median of each is kept. Per shape, dtype and rows:
ms a call, the weight's GB/s read, the speedup. bf16 runs fewer rows (PyTorch's bf16 product without native bf16
GEMMs takes ~25 ms a row at the head's shape). Results in bench/results/fewrow.json (`--out`); the last printed line
is JSON. Timings beside other work are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.measure import RESULTS, machine, made_by  # noqa: E402
from chatglm_tune.quant import cpu_matmul, fewrow_cpu  # noqa: E402

# (out, in, layer)
SHAPES = [(1536, 1024, "mid GLM-4 qkv"), (5632, 1024, "mid GLM-4 gate_up"), (1024, 2816, "mid GLM-4 down"),
          (4608, 4096, "ChatGLM3-6B qkv"), (27392, 4096, "ChatGLM3-6B h_to_4h"), (4096, 13696, "ChatGLM3-6B 4h_to_h"),
          (65024, 4096, "ChatGLM3-6B head")]
QUICK_SHAPES = [(1024, 1024, "small")]
ROWS = {torch.float32: (1, 2, 3, 5, 9, 16, 32), torch.bfloat16: (1, 2, 5, 9)}
STREAM_BYTES = 256 << 20  # weight bytes a candidate rotates over


def measure(n: int, k: int, dtype: torch.dtype, rows: tuple[int, ...], rounds: int, stream_bytes: int) -> list[dict]:
    """One row per count of x's rows: each candidate's median ms a call."""
    g = torch.Generator().manual_seed(n * k)
    size = n * k * dtype.itemsize
    copies = max(2, -(-stream_bytes // size))
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype)
        runs = {"pytorch": lambda w: F.linear(x, w), "fewrow": lambda w: fewrow_cpu.matmul(x, w)}
        error = (runs["fewrow"](weights[0]).double() - x.double() @ weights[0].double().T).abs().max().item()
        times = {name: [] for name in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                start = time.perf_counter()
                for w in weights:
                    fn(w)
                times[name].append((time.perf_counter() - start) / copies * 1e3)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        out.append({"out": n, "in": k, "dtype": str(dtype).removeprefix("torch."), "rows": m,
                    "pytorch_ms": round(ms["pytorch"], 3), "fewrow_ms": round(ms["fewrow"], 3),
                    "speedup": round(ms["pytorch"] / ms["fewrow"], 2),
                    "fewrow_gb_s": round(size / ms["fewrow"] / 1e6, 1), "max_abs_error": error})
        print(f"  {n}x{k} {dtype} rows {m}: pytorch {ms['pytorch']:.3f} ms, fewrow {ms['fewrow']:.3f} ms "
              f"({ms['pytorch'] / ms['fewrow']:.2f}x)", flush=True)
    return out


def table(rows: list[dict], names: dict) -> str:
    lines = ["| layer | shape | dtype | rows | PyTorch ms | fewrow ms | speedup | fewrow GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {names[(r['out'], r['in'])]} | {r['out']}x{r['in']} | {r['dtype']} | {r['rows']} | "
                     f"{r['pytorch_ms']} | {r['fewrow_ms']} | {r['speedup']}x | {r['fewrow_gb_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median kept)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one small shape, few rounds")
    parser.add_argument("--out", type=Path, help="the results' JSON (default bench/results/fewrow.json; --quick: none)")
    args = parser.parse_args()
    if not fewrow_cpu.available():
        sys.exit("the few-row kernel cannot run or be built here (x86-64 with AVX2 and FMA, and a C++ compiler)")
    torch.set_num_threads(args.threads)
    shapes, rounds, stream = (QUICK_SHAPES, 2, 0) if args.quick else (SHAPES, args.rounds, STREAM_BYTES)
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k, _ in shapes:
            rows += measure(n, k, dtype, ROWS[dtype], rounds, stream)
    names = {(n, k): layer for n, k, layer in shapes}
    on = machine(args.threads)
    page = (f"# Few-row float matmuls: PyTorch against fewrow_cpu\n\n{made_by('bench/kernels/fewrow.py', on)}; "
            f"native bf16 GEMMs: {cpu_matmul.native_bf16_gemm()}.\n\n{table(rows, names)}\n")
    print("\n" + page)
    line = json.dumps({"fewrow": {"machine": on, "native_bf16_gemm": cpu_matmul.native_bf16_gemm(), "rows": rows}})
    out = args.out or (None if args.quick else RESULTS / "fewrow.json")
    if out:
        out.write_text(line + "\n")
        out.with_suffix(".md").write_text(page)
    print(line)


if __name__ == "__main__":
    main()
