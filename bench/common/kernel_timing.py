"""The timing and the command line that the kernel benches share (bench/kernels/int4_kernels.py and
int8dot_kernels.py): candidates called side by side in interleaved rounds (median kept), each call on the next of
several copies of the weights; sweeps over the rows of x; the arguments of the parent and of its measuring
process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROWS = [1, 2, 4, 8, 16, 32]  # rows of x a sweep times by default (decode batches)


def time_rounds(fns: dict, copies: int, x, rounds: int, calls: int) -> dict:
    """Median over `rounds` of (seconds per call over `calls` calls rotating the copies), interleaved."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for c in range(calls):
                fn(c % copies, x)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(v) for name, v in times.items()}


def time_rows(torch, fns: dict, copies: int, K: int, rounds: int, calls: int, rows=ROWS) -> dict:
    """{rows M: {candidate: ms}} for x of each of `rows` rows (`time_rounds`, after one call each), printed as it
    goes."""
    out = {}
    for M in rows:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        for fn in fns.values():
            fn(0, x)
        medians = time_rounds(fns, copies, x, rounds, calls)
        out[str(M)] = {k: v * 1e3 for k, v in medians.items()}
        print(f"  rows {M}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in medians.items()) + " ms", flush=True)
    return out


def kernel_bench_args(argv, description: str, candidates: list[str], out: Path, calls: int, rows_help: str):
    """(parser, args) of a kernel bench (bench/kernels/: int4_kernels.py, int8dot_kernels.py): threads, capabilities,
    rounds, calls, a rows sweep, candidates, the results file; `--quick` shortens the timing; `--child` is the
    measuring process."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smoke run: one small shape, few rounds")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default 1 2)")
    p.add_argument("--capabilities", nargs="+", default=["native", "avx2"],
                   help="native and/or an ATEN_CPU_CAPABILITY value")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median kept)")
    p.add_argument("--calls", type=int, default=calls, help="calls per round, rotating the weight copies")
    p.add_argument("--rows", action="store_true", help=rows_help)
    p.add_argument("--candidates", nargs="+", choices=candidates, default=candidates,
                   help="which to run (default: all)")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 3, 4
    return p, args


def child_argv(args) -> list:
    """The measuring process's arguments, as the parent got them."""
    return ["--threads", *args.threads, "--rounds", args.rounds, "--calls", args.calls, "--candidates",
            *args.candidates] \
        + (["--quick"] if args.quick else []) + (["--rows"] if args.rows else [])
