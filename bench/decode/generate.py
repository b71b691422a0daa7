"""Benchmark: batched KV-cache decoding (`generation.generate`) against the reference loop that recomputes
the whole sequence every step (`generation.generate_recompute`), side by side in one run.

    python bench/decode/generate.py                # tiny and mid configs, fp32, batch 1 and 16 (~3-5 min)
    python bench/decode/generate.py --configs mid --dtypes float32,bfloat16 --threads 1

bf16 is not in the default run: on a CPU without native bf16 (AVX2 only, as here) its batch-1
decoding is faster than fp32 (half the bytes) but its large matmuls are several times slower, and
the bf16 recompute loop alone takes over ten minutes.

Random weights, random prompts ending `[gMASK] <sop>` (batch rows of different lengths, left-padded),
no stop on `<eop>` so every row generates the full count. tokens/s = generated tokens (all rows) /
wall time of the whole call, prompt included. The recompute loop is measured over fewer new tokens
(`--recompute-tokens`); its step cost grows with the sequence, so that rate overstates its rate over
the cached run's length. `recompute~` rows estimate the recompute loop over the cached run's full
length from one timed step at its shortest and one at its longest sequence (cost linear in length);
the headline speedup uses that estimate. Peak memory: this process's highest resident set during each
measured call (`measure.PeakRSS`: the high-water mark reset before the call, read after). The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import PeakRSS, median_seconds  # noqa: E402
from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration  # noqa: E402
from chatglm_tune.data.batches import SpecialIds, collate_prompts  # noqa: E402
from chatglm_tune.decoding.generation import generate, generate_recompute  # noqa: E402

# Special ids inside the tiny preset's 2048-token vocabulary (the preset leaves them to a tokenizer).
TINY_SPECIAL = dict(mask_token_id=2040, gmask_token_id=2041, bos_token_id=2044, eos_token_id=2045, pad_token_id=3)
TARGET_TOKENS_PER_S = 20.0
TARGET_SPEEDUP = 50.0


def bench_config(name: str) -> ChatGLMConfig:
    return ChatGLMConfig.from_name(name, **(TINY_SPECIAL if name == "tiny" else {}))


def random_prompts(config: ChatGLMConfig, batch: int, prompt_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts: row i has prompt_len - 2*i (at least 8) random tokens, then [gMASK] <sop>."""
    g = torch.Generator().manual_seed(seed)
    hi = min(config.mask_token_id, config.vocab_size) - 1
    rows = []
    for i in range(batch):
        n = max(8, prompt_len - 2 - 2 * i)
        rows.append(torch.randint(5, hi, (n,), generator=g).tolist() + [config.gmask_token_id, config.bos_token_id])
    return collate_prompts(rows, SpecialIds.of(config))


def timed(model, method: str, prompts: dict, new_tokens: int) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one decoding call; every row generates `new_tokens` tokens."""
    run = generate if method == "kv-cache" else generate_recompute

    def call(n: int):
        out = run(model, prompts["input_ids"], prompts["attention_mask"], max_new_tokens=n, eos_token_id=None)
        assert sum(map(len, out)) == len(out) * n

    call(1)  # warm-up: one token, so that a slow loop is not run twice over its full length
    with PeakRSS() as rss:
        seconds = median_seconds(lambda: call(new_tokens), repeats=1, warmup=0)
    return seconds, rss.peak / 2**20


def measure(model, method: str, batch: int, new_tokens: int, prompt_len: int) -> dict:
    seconds, peak = timed(model, method, random_prompts(model.config, batch, prompt_len), new_tokens)
    return result(method, batch, new_tokens, prompt_len, seconds, peak)


def project_recompute(model, batch: int, new_tokens: int, prompt_len: int) -> dict:
    """The recompute loop over `new_tokens`, estimated from one step at its shortest and one at its longest
    sequence (a step's cost is linear in the length: the head runs over every position)."""
    short = random_prompts(model.config, batch, prompt_len)
    extra = torch.randint(5, min(model.config.mask_token_id, model.config.vocab_size) - 1, (batch, new_tokens - 1))
    long = {"input_ids": torch.cat([short["input_ids"], extra], dim=1),
            "attention_mask": torch.cat([short["attention_mask"], torch.ones_like(extra)], dim=1)}
    (first, peak_short), (last, peak_long) = timed(model, "recompute", short, 1), timed(model, "recompute", long, 1)
    return result("recompute~", batch, new_tokens, prompt_len, new_tokens * (first + last) / 2,
                  max(peak_short, peak_long))


def result(method, batch, new_tokens, prompt_len, seconds, peak) -> dict:
    return {"method": method, "batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len,
            "seconds": round(seconds, 3), "tokens_per_s": round(batch * new_tokens / seconds, 2),
            "peak_rss_mib": round(peak)}


def build_model(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    return ChatGLMForConditionalGeneration(bench_config(name)).to(dtype).eval()


HEADER = (f"{'config':<6} {'dtype':<9} {'batch':>5} {'method':<10} {'new tok':>7} {'seconds':>8} {'tok/s':>9} "
          f"{'ms/tok':>8} {'peak MiB':>9} {'speedup':>8}")


def table_row(r: dict) -> str:
    per_token = 1000 * r["seconds"] / (r["batch"] * r["new_tokens"])
    speedup = f"{r['speedup']:.1f}x" if "speedup" in r else ""
    return (f"{r['config']:<6} {r['dtype']:<9} {r['batch']:>5} {r['method']:<10} {r['new_tokens']:>7} "
            f"{r['seconds']:>8.2f} {r['tokens_per_s']:>9.2f} {per_token:>8.2f} {r['peak_rss_mib']:>9} {speedup:>8}")


def batch_tokens(spec: str) -> dict[int, int]:
    """"1:128,16:64" -> {1: 128, 16: 64}."""
    return {int(b): int(n) for b, n in (item.split(":") for item in spec.split(","))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,mid", help="comma-separated presets (default %(default)s)")
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated compute dtypes, e.g. float32,bfloat16 (default %(default)s)")
    p.add_argument("--new-tokens", default="1:128,16:64",
                   help="batch:tokens generated per row with the cache (default %(default)s)")
    p.add_argument("--recompute-tokens", default="1:16,16:4",
                   help="batch:tokens measured with the recompute loop (default %(default)s)")
    p.add_argument("--project", default="1",
                   help="batch sizes whose full-length recompute time is also estimated (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=48,
                   help="longest prompt, [gMASK] <sop> included (default %(default)s)")
    p.add_argument("--threads", type=int, help=f"torch threads (default: torch's, {torch.get_num_threads()} here)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    new_tokens, recompute_tokens = batch_tokens(args.new_tokens), batch_tokens(args.recompute_tokens)
    projected = {int(b) for b in args.project.split(",") if b}
    load_before = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load_before[0]:.2f} on "
          f"{os.cpu_count()} CPUs")
    print("speedup = kv-cache tok/s / that row's tok/s; recompute~ = estimated from its first and last step\n")
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for name in args.configs.split(","):
        for dtype_name in args.dtypes.split(","):
            model = build_model(name, getattr(torch, dtype_name))
            for batch, n in new_tokens.items():
                with torch.inference_mode():
                    cached = measure(model, "kv-cache", batch, n, args.prompt_len)
                    slow = [measure(model, "recompute", batch, recompute_tokens.get(batch, 4), args.prompt_len)]
                    if batch in projected:
                        slow.append(project_recompute(model, batch, n, args.prompt_len))
                for r in (cached, *slow):
                    if r is not cached:
                        r["speedup"] = round(cached["tokens_per_s"] / r["tokens_per_s"], 1)
                    rows.append({"config": name, "dtype": dtype_name, **r})
                    print(table_row(rows[-1]), flush=True)
            del model

    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f}")
    summary = {"bench": "generate", "threads": torch.get_num_threads(),
               "load_average": [round(load_before[0], 2), round(load_after[0], 2)], "results": rows}
    key = {(r["config"], r["dtype"], r["batch"], r["method"]): r for r in rows}
    head, ref = key.get(("mid", "float32", 1, "kv-cache")), key.get(("mid", "float32", 1, "recompute~"))
    if head is not None and ref is not None:
        met = head["tokens_per_s"] >= TARGET_TOKENS_PER_S and ref["speedup"] >= TARGET_SPEEDUP
        summary["headline"] = {"mid_fp32_batch1_tokens_per_s": head["tokens_per_s"], "new_tokens": head["new_tokens"],
                               "speedup_vs_recompute": ref["speedup"],
                               "target": f">= {TARGET_TOKENS_PER_S:g} tok/s and >= {TARGET_SPEEDUP:g}x", "met": met}
        print(f"headline (mid, fp32, batch 1, {head['new_tokens']} new tokens): {head['tokens_per_s']:.1f} tok/s, "
              f"{ref['speedup']:.1f}x the recompute loop over the same tokens; target met: {met}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
