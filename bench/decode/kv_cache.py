"""Benchmark: a decode step with the KV cache that grows into room it keeps (`decoding.growing_cache.GrowingCache`,
what `generate` and the serving engine use) against transformers' `DynamicCache` (each step concatenates the whole
cache again), side by side in one run, on the same random mid-size models and prompts.

A decode step's ms: (`generate` of N + 1 tokens - `generate` of 1 token) / N, greedy, no early stop, the two caches
alternated over `--rounds` (the median kept); the ids of the two must be equal. Models: ChatGLM-6B's mid config
(hidden 1024, 8 layers, 16 key/value heads, its 130,528-word head) and a mid GLM-4 of 2 key/value heads, each at the
batch sizes and prompt lengths of `CASES`. The last line printed is JSON.

    python bench/decode/kv_cache.py [--threads 2] [--rounds 3] [--results bench/results/kv_cache.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

# (model, rows, prompt tokens): batch 1 after a long prompt, and the batches a server holds
CASES = [("chatglm6b-mid", 1, 512), ("chatglm6b-mid", 16, 256), ("glm4-mid", 32, 128)]
NEW_TOKENS = 32


def build(name: str):
    """(model, a vocabulary bound, ids maker) of a random mid-size model."""
    torch.manual_seed(0)
    if name == "chatglm6b-mid":
        from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration

        config = ChatGLMConfig.from_name("mid")
        return ChatGLMForConditionalGeneration(config).eval(), config
    from chatglm_tune.models.glm.config import glm_config
    from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix

    raw = {"model_type": "chatglm", "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 8, "kv_channels": 128,
           "multi_query_group_num": 2, "ffn_hidden_size": 2816, "padded_vocab_size": 832, "layernorm_epsilon": 1e-5,
           "add_qkv_bias": True, "seq_length": 2048, "rmsnorm": True, "post_layer_norm": True}
    return GlmForCausalLMWithPrefix(glm_config(raw, version="glm4")).eval(), None


def prompts(config, rows: int, length: int) -> torch.Tensor:
    ids = torch.randint(10, 800, (rows, length), generator=torch.Generator().manual_seed(1))
    if config is not None:  # ChatGLM-6B's prompts end with [gMASK] <sop>
        ids[:, -2], ids[:, -1] = config.gmask_token_id, config.bos_token_id
    return ids


def step_ms(model, ids, cache_class) -> tuple[float, list]:
    from chatglm_tune.decoding import batch_cache
    from chatglm_tune.decoding.generation import generate

    batch_cache.GrowingCache = cache_class  # what BatchCache fills
    began = time.perf_counter()
    generate(model, ids, max_new_tokens=1, eos_token_id=None)
    prefill = time.perf_counter() - began
    began = time.perf_counter()
    out = generate(model, ids, max_new_tokens=NEW_TOKENS + 1, eos_token_id=None)
    return (time.perf_counter() - began - prefill) / NEW_TOKENS * 1e3, out


def main(argv=None) -> None:
    from transformers.cache_utils import DynamicCache

    from chatglm_tune.decoding.growing_cache import GrowingCache

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--results", type=Path, help="also write the closing JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    caches = {"DynamicCache": DynamicCache, "GrowingCache": GrowingCache}
    rows = []
    for name, batch, length in CASES:
        model, config = build(name)
        ids = prompts(config, batch, length)
        times: dict[str, list[float]] = {c: [] for c in caches}
        outputs = {}
        for _ in range(args.rounds):
            for cache, cls in caches.items():
                ms, outputs[cache] = step_ms(model, ids, cls)
                times[cache].append(ms)
        median = {c: round(statistics.median(t), 1) for c, t in times.items()}
        rows.append({"model": name, "rows": batch, "prompt": length, **{f"{c}_ms": m for c, m in median.items()},
                     "speedup": round(median["DynamicCache"] / median["GrowingCache"], 3),
                     "same_ids": outputs["DynamicCache"] == outputs["GrowingCache"]})
        print(rows[-1], file=sys.stderr)
    print(f"\ndecode step, ms (median of {args.rounds} alternated rounds, {args.threads} threads, {NEW_TOKENS} new "
          "tokens)")
    print(f"{'model':14s} {'rows':>4s} {'prompt':>6s} {'DynamicCache':>12s} {'GrowingCache':>12s} {'speedup':>8s} "
          f"{'same ids':>8s}")
    for r in rows:
        print(f"{r['model']:14s} {r['rows']:4d} {r['prompt']:6d} {r['DynamicCache_ms']:12.1f} "
              f"{r['GrowingCache_ms']:12.1f} {r['speedup']:7.2f}x {str(r['same_ids']):>8s}")
    line = json.dumps({"kv_cache": {"threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability(),
                                    "cases": rows}})
    if args.results:
        args.results.write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main()
