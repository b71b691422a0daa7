"""Benchmark: latent attention's two float32 products in a GLM-4.7-Flash decode step (20 heads' queries against the
cached latents: scores q keys^T + q_rot shared^T, then the weighted sum p keys), PyTorch's batched matmul against
`int8dot_cpu.latent_scores` / `latent_mix` (the entries or the latent's columns split over the threads).

    python bench/kernels/latent_products.py [--threads 1 2] [--entries 104 300 600] [--quick]

GLM-4.7-Flash's sizes (kv_lora_rank 512, qk_rope_head_dim 64, 20 heads, one query), the cache as the toolkit's cache
gives it (views of longer buffers). Both candidates side by side in interleaved rounds, the median of each kept; a
layer's two products are run 46 times a decode step. Each thread count runs in a process of its own: in one process,
after calls on one thread, calls asking for two still ran on one. Results in bench/results/latent_products.json; the
last printed line is JSON. Timings beside other work are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.measure import machine, run_python  # noqa: E402
from chatglm_tune.quant import int8dot_cpu  # noqa: E402

HEADS, RANK, ROPE = 20, 512, 64
RESULTS = REPO / "bench" / "results" / "latent_products.json"


def candidates(entries: int) -> dict:
    """Each candidate's call: a layer's scores and weighted sum over `entries` cached latents."""
    g = torch.Generator().manual_seed(entries)
    keys = torch.randn(1, entries + 64, RANK, generator=g)[:, :entries]  # the cache's view of its buffer
    shared = torch.randn(1, entries + 64, ROPE, generator=g)[:, :entries]
    q, q_rot = torch.randn(1, HEADS, RANK, generator=g), torch.randn(1, HEADS, ROPE, generator=g)
    p = torch.rand(1, HEADS, entries, generator=g).softmax(-1)
    return {
        "pytorch bmm": lambda: (q @ keys.transpose(1, 2) + q_rot @ shared.transpose(1, 2), p @ keys),
        "int8dot threaded": lambda: (int8dot_cpu.latent_scores(q, q_rot, keys, shared),
                                     int8dot_cpu.latent_mix(p, keys)),
    }


def measure(entries: int, rounds: int, calls: int) -> dict:
    """Microseconds a call (scores and sum) of each candidate, the median of `rounds` interleaved rounds."""
    runs = candidates(entries)
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: round(statistics.median(ts), 1) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--entries", type=int, nargs="+", default=[104, 300, 600], help="cached latents")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # measure at this many threads, print the rows
    args = parser.parse_args()
    if not int8dot_cpu.available():
        sys.exit("the int8dot kernels cannot run or be built here (x86-64 with AVX2 and a C++ compiler)")
    rounds, calls = (3, 10) if args.quick else (15, 100)
    if args.child:
        torch.set_num_threads(args.child)
        print(json.dumps([{"threads": args.child, "entries": entries, "us": measure(entries, rounds, calls)}
                          for entries in args.entries]))
        return
    rows = []
    for threads in args.threads:
        more = ["--quick"] if args.quick else []
        child = run_python(Path(__file__), "--child", threads, "--entries", *args.entries, *more)
        rows += json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{'threads':>7} {'entries':>7} {'pytorch bmm us':>15} {'int8dot us':>11} {'speedup':>8} "
          f"{'ms a step (46)':>15}")
    for row in rows:
        torch_us, ours = row["us"]["pytorch bmm"], row["us"]["int8dot threaded"]
        row["speedup"] = round(torch_us / ours, 2)
        print(f"{row['threads']:>7} {row['entries']:>7} {torch_us:>15.1f} {ours:>11.1f} {row['speedup']:>8.2f} "
              f"{46 * torch_us / 1e3:>7.1f} -> {46 * ours / 1e3:.1f}")
    line = json.dumps({"latent_products": {"machine": machine(max(args.threads)), "rows": rows}})
    args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
