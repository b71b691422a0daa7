"""Benchmark: INT4 matmul kernels against int8pack at batch 1, ChatGLM-6B's layer shapes, on this CPU as it is
and as an AVX2-only CPU (the target: INT4 no slower than INT8 without AVX-512).

    python bench/kernels/int4_kernels.py           # both capabilities, 1 and 2 threads (about 6 minutes)
    python bench/kernels/int4_kernels.py --quick   # smoke run: one small shape, few repeats

Each capability runs in its own fresh process (`ATEN_CPU_CAPABILITY=avx2` makes PyTorch's kernels, the
int4pack layout and inductor's C++ code take their AVX2 paths on an AVX-512 CPU; the child checks that
`get_cpu_capability()` says so). Inside one process every candidate runs side by side, in interleaved
rounds (median kept), on the same random weights, quantized with the official per-row rule:
- `int8pack`: `torch._weight_int8pack_mm`, bf16 x, INT8 weight (the toolkit's INT8 path; the bar to beat);
- `int4pack`: `aten._weight_int4pack_mm_for_cpu` on the repacked weight (the toolkit's INT4 path so far);
- `int4cpu`: `chatglm_tune.quant.int4_cpu.matmul`, the official packed weight read as it is by a small AVX2 C++
  kernel, fp32 math (the candidate "other layout": no layout at all);
- `tiles`: INT4 unpacked into cache-sized INT8 tiles (arithmetic shifts into a reused buffer, columns
  permuted to [even | odd] so that each shift writes contiguous halves) feeding `_weight_int8pack_mm`;
  per-row scales rounded to bf16 as int8pack needs them;
- `compile-sum`, `compile-mm`: `torch.compile` (inductor, C++ backend) of the dequantized math, written as
  an explicit reduction (`(x_even * hi + x_odd * lo).sum(-1) * scale`) and literally (`x @ (q * scale).T`);
- bitsandbytes' 4-bit kernels are not a candidate: NF4 / FP4 are non-uniform 4-bit codebooks with their
  own blockwise absmax scales, so no bitsandbytes tensor can hold the official uniform INT4 levels
  q * scale in [-7, 7] per row (the bench says so in its output rather than measuring another format).
Weights rotate over enough copies (>= 256 MB per candidate) that every call streams from memory, as a
decode step does over 28 layers; relative error is against `x @ dequantize(W).T` in fp32. Bandwidth: the
read rate of an fp32 `sum` over 512 MiB and the (read + written) rate of `measure.copy_bandwidth`, at the
same thread count. `--rows` adds a sweep over M (rows of x) at 16384x4096 for the batched decode crossover.
Results go to bench/results/int4_kernels.json (`--out`); the last printed line is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.kernel_timing import child_argv, kernel_bench_args, time_rounds, time_rows  # noqa: E402
from bench.common.measure import RESULTS, copy_bandwidth, run_python  # noqa: E402

SHAPES = [(4096, 4096, "dense"), (12288, 4096, "query_key_value"), (16384, 4096, "dense_h_to_4h"),
          (4096, 16384, "dense_4h_to_h")]
QUICK_SHAPES = [(1024, 1024, "small")]
CANDIDATES = ["int8pack", "int4pack", "int4cpu", "tiles", "compile-sum", "compile-mm"]
ROW_CANDIDATES = ["int8pack", "int4pack", "int4cpu-direct", "int4cpu-buffered", "dequant"]
MB = 1e6
TILE_BYTES = 1 << 19  # int8 tile of the `tiles` candidate: 512 KB, half of this CPU's 1 MB L2
BNB_NOTE = ("bitsandbytes 4-bit: NF4/FP4 codebooks (non-uniform levels) with blockwise fp32 absmax scales it computes "
            "itself; the official per-row uniform INT4 (q in [-7, 7] times an fp16 row scale) has no exact form there")


# ---------------------------------------------------------------------------------------------- child


def _candidates(torch, N: int, K: int, copies: int):
    """name -> (fn(i, x) over copy i, bytes read per call); plus the fp32 references' inputs."""
    from chatglm_tune.quant import int4_cpu
    from chatglm_tune.quant.format import dequantize, pack_int4, quantize_weight
    from chatglm_tune.quant.kernels import int4pack_mm, int4pack_weight

    g = torch.Generator().manual_seed(N * 7 + K)
    layers = []
    for _ in range(copies):
        w = torch.randn(N, K, generator=g) * 0.02
        q8, s8 = quantize_weight(w, 8)
        q4, s4 = quantize_weight(w, 4)
        p4 = pack_int4(q4)
        layers.append({"q8": q8, "s8": s8.bfloat16(), "p4": p4, "s4": s4, "s4b": s4.bfloat16(), "s4f": s4.float()})
        del w, q4
    for layer in layers:
        layer["int4pack"] = int4pack_weight(layer["p4"], layer["s4"])
    tile_rows = max(1, TILE_BYTES // K)
    tile = torch.empty(tile_rows, K, dtype=torch.int8)
    K2 = K // 2

    def int8pack(i, x):
        return torch._weight_int8pack_mm(x.bfloat16(), layers[i]["q8"], layers[i]["s8"])

    def int4pack(i, x):
        return int4pack_mm(x.bfloat16(), *layers[i]["int4pack"])

    def int4cpu(i, x):
        return int4_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"])

    def tiles(i, x):
        p4, s = layers[i]["p4"], layers[i]["s4b"]
        xb = x.bfloat16()
        xp = torch.cat((xb[:, 0::2], xb[:, 1::2]), 1).contiguous()  # (M, K): [even columns | odd columns]
        y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
        for start in range(0, N, tile_rows):
            w = p4[start : start + tile_rows]
            t = tile[: w.shape[0]]
            torch.bitwise_right_shift(w, 4, out=t[:, :K2])  # high nibbles: the even columns
            torch.bitwise_left_shift(w, 4, out=t[:, K2:])
            t[:, K2:].bitwise_right_shift_(4)  # low nibbles, sign-extended: the odd columns
            y[:, start : start + w.shape[0]] = torch._weight_int8pack_mm(xp, t, s[start : start + w.shape[0]])
        return y

    def deq_sum(x, w, s):
        xe, xo = x[:, 0::2].float(), x[:, 1::2].float()  # (M, K/2)
        hi, lo = (w >> 4).float(), ((w << 4) >> 4).float()  # (N, K/2)
        return (xe[:, None, :] * hi + xo[:, None, :] * lo).sum(-1) * s.float()  # (M, N)

    def deq_mm(x, w, s):
        q = torch.stack((w >> 4, (w << 4) >> 4), dim=-1).flatten(-2)  # (N, K)
        return x.float() @ (q.float() * s.float()[:, None]).t()

    fns = {"int8pack": (int8pack, N * K + 2 * N),
           "int4pack": (int4pack, N * K // 2 + 4 * N * K // layers[0]["int4pack"][1]),
           "int4cpu": (int4cpu, N * K // 2 + 2 * N), "tiles": (tiles, N * K // 2 + 2 * N)}
    for name, body in (("compile-sum", deq_sum), ("compile-mm", deq_mm)):
        compiled = torch.compile(body, dynamic=False)
        fns[name] = ((lambda c: lambda i, x: c(x, layers[i]["p4"], layers[i]["s4"]))(compiled), N * K // 2 + 2 * N)
    def reference(name: str, i: int, x):
        """The fp32 dequantized math of the weight `name` runs on: INT8 for int8pack, the official INT4 otherwise."""
        w = dequantize(layers[i]["q8"], layers[i]["s8"].float(), 8, torch.float32) if name == "int8pack" else \
            dequantize(layers[i]["p4"], layers[i]["s4"], 4, torch.float32)
        return x @ w.t()

    return fns, reference, layers, int4_cpu


def _read_bandwidth(torch, mib: int = 512, repeats: int = 3) -> float:
    """Bytes per second of the fastest of `repeats` fp32 sums over `mib` MiB (a pure read, as a GEMV is)."""
    probe = torch.ones(mib * 2**20 // 4)
    probe.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        probe.sum()
        best = min(best, time.perf_counter() - start)
    return probe.numel() * 4 / best


def child(args) -> dict:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    want = os.environ.get("ATEN_CPU_CAPABILITY")
    if want and capability.lower() != want.lower():
        raise SystemExit(f"ATEN_CPU_CAPABILITY={want} did not take effect: get_cpu_capability() = {capability}")
    from chatglm_tune.quant import kernels

    block = kernels.int4pack_block_rows()  # the int4pack layout's block rows where it reads back (32 AVX2, 64 AVX-512)
    out = {"capability": capability, "int4pack_layout": f"{block}-row blocks" if block else "other",
           "torch": torch.__version__, "threads": {}}
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = {"read_gb_s": _read_bandwidth(torch) / 1e9, "copy_gb_s": copy_bandwidth(mib=256, repeats=3) / 1e9}
        per_shape = {}
        for N, K, name in shapes:
            int4_bytes = N * K // 2
            copies = max(2, -(-256 * 2**20 // int4_bytes)) if not args.quick else 2
            fns, reference, layers, int4_cpu = _candidates(torch, N, K, copies)
            x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
            row = {"copies": copies, "candidates": {}}
            usable = {}
            for cname, (fn, nbytes) in fns.items():
                if cname not in args.candidates:
                    continue
                if cname == "int4cpu" and not int4_cpu.compiled():
                    row["candidates"][cname] = {"error": "int4_cpu kernel not built here (no AVX2 or no compiler)"}
                    continue
                try:
                    start = time.perf_counter()
                    y = fn(0, x)
                    first_s = time.perf_counter() - start
                except Exception as e:  # noqa: BLE001 (a candidate that cannot run here is reported, not fatal)
                    row["candidates"][cname] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
                    continue
                ref = reference(cname, 0, x)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                row["candidates"][cname] = {"rel_err": err, "first_call_s": round(first_s, 2), "bytes": nbytes}
                usable[cname] = fn
            medians = time_rounds(usable, copies, x, args.rounds, args.calls)
            base = medians.get("int8pack")
            for cname, sec in medians.items():
                c = row["candidates"][cname]
                c.update(ms=sec * 1e3, gb_s=c["bytes"] / sec / 1e9, of_read_bw=c["bytes"] / sec / 1e9 / bw["read_gb_s"])
                if base:
                    c["x_int8pack"] = base / sec
            per_shape[f"{N}x{K}"] = {"layer": name, **row}
            print(f"[{capability} {threads}t] {N}x{K}: " + ", ".join(
                f"{k} {v['ms']:.2f} ms" if "ms" in v else f"{k} -" for k, v in row["candidates"].items()), flush=True)
            del fns, layers
        entry = {"bandwidth": bw, "shapes": per_shape}
        if args.rows and not args.quick:
            entry["rows"] = _rows_sweep(torch, args)
        out["threads"][str(threads)] = entry
    return out


def _rows_sweep(torch, args) -> dict:
    """ms per call at 16384x4096 for M rows of x, the INT4 and INT8 kernels and QuantizedLinear's dequant path."""
    from chatglm_tune.quant import int4_cpu
    from chatglm_tune.quant.modules import QuantizedLinear

    N, K, copies = 16384, 4096, 8
    fns, _, layers, _ = _candidates(torch, N, K, copies)
    dequant = [QuantizedLinear.from_parts(layer["p4"], layer["s4"], None, 4) for layer in layers]
    for layer in dequant:
        layer.kernel = "dequant"
    chosen = {"int8pack": fns["int8pack"][0], "int4pack": fns["int4pack"][0],
              "dequant": lambda i, x: dequant[i](x)}
    if int4_cpu.compiled():
        chosen["int4cpu-direct"] = lambda i, x: int4_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"],
                                                                direct_rows=1 << 20)
        chosen["int4cpu-buffered"] = lambda i, x: int4_cpu.matmul(x, layers[i]["p4"], layers[i]["s4"], direct_rows=0)
    return time_rows(torch, chosen, copies, K, max(3, args.rounds // 2), max(4, args.calls // 4))


# ---------------------------------------------------------------------------------------------- report


def report(runs: dict) -> dict:
    lines = []
    for cap_name, run in runs.items():
        if "error" in run:
            lines.append(f"\n## {cap_name}: {run['error']}")
            continue
        lines.append(f"\n## capability {run['capability']} ({cap_name}; int4pack layout {run['int4pack_layout']}), "
                     f"torch {run['torch']}")
        for threads, entry in run["threads"].items():
            bw = entry["bandwidth"]
            lines.append(f"\n{threads} thread(s): read bandwidth {bw['read_gb_s']:.1f} GB/s, copy "
                         f"{bw['copy_gb_s']:.1f} GB/s. ms per call at M=1 (x int8pack's speed; GB/s of weight bytes "
                         "read; relative error vs the fp32 dequantized math)")
            header = f"| shape | {' | '.join(CANDIDATES)} |"
            lines += [header, "|---" * (len(CANDIDATES) + 1) + "|"]
            for shape, row in entry["shapes"].items():
                cells = []
                base = row["candidates"].get("int8pack", {}).get("ms")
                for c in CANDIDATES:
                    v = row["candidates"].get(c, {"error": "-"})
                    ratio = f"{base / v['ms']:.2f}x" if base and "ms" in v else "-"
                    cells.append(f"{v['ms']:.2f} ({ratio}, {v['gb_s']:.1f} GB/s, {v['rel_err']:.0e})"
                                 if "ms" in v else f"n/a: {v['error'][:60]}")
                lines.append(f"| {shape} {row['layer']} | " + " | ".join(cells) + " |")
            if "rows" in entry:
                names = list(next(iter(entry["rows"].values())))
                lines += ["", f"16384x4096, M rows of x, ms per call: | M | {' | '.join(names)} |",
                          "|---" * (len(names) + 1) + "|"]
                for M, r in entry["rows"].items():
                    lines.append(f"| {M} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")
    lines.append(f"\n{BNB_NOTE}.")
    text = "\n".join(lines)
    print(text)
    summary = {}
    for cap_name, run in runs.items():
        for threads, entry in run.get("threads", {}).items():
            for shape, row in entry["shapes"].items():
                ms = {c: round(v["ms"], 3) for c, v in row["candidates"].items() if "ms" in v}
                summary.setdefault(cap_name, {}).setdefault(threads, {})[shape] = ms
    return {"text": text, "summary": summary}


def main(argv=None) -> None:
    p, args = kernel_bench_args(argv, __doc__.split("\n\n")[0], CANDIDATES, RESULTS / "int4_kernels.json", 16,
                                "also sweep M = 1..32 rows at 16384x4096")
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = {}
    forwarded = child_argv(args)
    for cap in args.capabilities:
        # A private inductor cache per capability: reusing artifacts compiled under another capability gave
        # silently wrong results here (relative error ~50 for `compile-sum` under avx2 after a native run).
        env = {"TORCHINDUCTOR_CACHE_DIR": f"/tmp/chatglm-int4-kernels-inductor-{cap}"}
        if cap != "native":
            env["ATEN_CPU_CAPABILITY"] = cap
        try:
            done = run_python(__file__, "--child", *forwarded, env=env)
            print(done.stdout.strip().rsplit("\n", 1)[0], flush=True)  # the child's progress lines
            runs[cap] = {**done.last_json(), "peak_rss_gb": done.peak_rss / 1e9}
        except RuntimeError as e:
            runs[cap] = {"error": str(e)[-500:]}
    # a partial re-run (some threads or candidates) replaces only what it measured
    if args.out.exists() and not args.quick:
        kept = json.loads(args.out.read_text()).get("runs", {})
        for cap, run in runs.items():
            if "threads" in run and "threads" in kept.get(cap, {}):
                for threads, entry in run["threads"].items():
                    old = kept[cap]["threads"].get(threads, {"shapes": {}})
                    for shape, row in entry["shapes"].items():
                        merged = old["shapes"].get(shape, {"candidates": {}})
                        merged["candidates"].update(row["candidates"])
                        entry["shapes"][shape] = {**row, "candidates": merged["candidates"]}
                    entry.setdefault("rows", old.get("rows")) if old.get("rows") else None
                kept[cap]["threads"].update(run["threads"])
                kept[cap]["load_average_at_rerun"] = list(os.getloadavg())
            else:
                kept[cap] = run
        runs = kept
    rep = report(runs)
    result = {"bench": "int4_kernels", "quick": args.quick, "load_average": list(os.getloadavg()), "runs": runs,
              "bitsandbytes": BNB_NOTE}
    if not args.quick or args.out != p.get_default("out"):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"bench": "int4_kernels", "ms_m1": rep["summary"], "out": str(args.out)}))


if __name__ == "__main__":
    main()
