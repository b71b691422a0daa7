"""The torch side of bench/serve/serve.py, in processes of their own (the bench itself imports no torch, so that it
competes with the servers it measures for as little CPU and memory as possible). Each prints one JSON line.

    python bench/serve/serve_children.py build --version glm4 --size mid --model-dir DIR
    python bench/serve/serve_children.py floor --model-dir DIR [--threads 2] [--batches 1,4,16,32]
    python bench/serve/serve_children.py ceilings [--threads 2]
    python bench/serve/serve_children.py prompts --model-dir DIR

- `build`: a random model directory (`registry.VERSIONS[v].tiny(corpus, dir, **SIZES[size])`, its tokenizer
  trained on data/spo_dev.jsonl, then `save_pretrained`); prints its parameter count and weight bytes. The
  output head's rows of tokens that render no text alone (special tokens, byte pieces of a character,
  control characters) are zeroed, so that greedy answers are printable and never stop early: every token
  then reaches the client as a stream chunk, and TTFT / inter-token gaps time tokens, not the random
  model's habit of emitting bytes that the server must hold until a character is whole.
- `floor`: the model alone, as serve.py loads it (`loading.load_for_inference`: float32 on the CPU), decoding
  `generation.generate` at each batch size (random 16-token prompts, no stop): ms per decode step =
  (time of 1 + STEPS tokens - time of 1 token) / STEPS; and the prefill cost per prompt token (one 64-token
  prompt; four in one forward). What the server could reach with no HTTP and no scheduling.
- `ceilings`: what the 2 cores can do at all: copy bandwidth (`measure.copy_bandwidth`, read + written
  bytes/s), the read rate of float32 GEMVs over 24 different 1024 x 2816 weights in turn (277 MB: read from
  memory, not cache, as a decode step at batch 1 reads a model's weights), and float32 GEMM GFLOP/s at
  M = 1, 16, 32, 512 rows against the same weights (a decode step at batch M; 512: the arithmetic peak).
- `prompts`: for another server (llama-server), the ids serve.py's /v1/completions builds for each SPO text of
  data/spo_dev.jsonl (`PromptFormat.prompt_ids` with the directory's instruction, as infer.py), and the longest
  prompt of the load (completion or chat ids), which sizes that server's context.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: chatglm_tune, bench.<room>.<module>

# Random model sizes (GLM fields of config.json). mid: decoding one token at batch 1 reads ~370 MB of float32
# weights (~20-40 ms on the 2-core CPU this was written on); small: the --quick smoke run.
SIZES = {
    "mid": dict(hidden_size=1024, num_layers=8, num_attention_heads=8, kv_channels=128, multi_query_group_num=2,
                ffn_hidden_size=2816, seq_length=2048),
    "small": dict(hidden_size=256, num_layers=4, num_attention_heads=4, kv_channels=64, multi_query_group_num=2,
                  ffn_hidden_size=704, seq_length=2048),
    # ChatGLM3-6B's blocks (its vocabulary is the trained tokenizer's, ~900 ids): for GPUs (24 GB in float32)
    "6b": dict(hidden_size=4096, num_layers=28, num_attention_heads=32, kv_channels=128, multi_query_group_num=2,
               ffn_hidden_size=13696, seq_length=8192),
}
FLOOR_STEPS = 32
FLOOR_PROMPT = 16
PREFILL_LEN = 64
RECIPE = 2  # bench/serve/serve.py rebuilds a cached model directory built by another recipe
GEMM_K, GEMM_N = 1024, 2816
GEMM_WEIGHTS = 24


def build(args) -> dict:
    import torch

    from chatglm_tune.models import registry

    texts = [json.loads(line)["text"]
             for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()]
    directory = Path(args.model_dir)
    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer = registry.VERSIONS[args.version].tiny(texts + ["你好，世界。Hello!"], directory,
                                                            **SIZES[args.size])
    special = set(tokenizer.all_special_ids)
    printable = [i for i in range(len(tokenizer)) if i not in special and _renders(tokenizer.decode([i]))]
    silent = torch.ones(model.get_output_embeddings().weight.shape[0], dtype=torch.bool)
    silent[printable] = False
    with torch.no_grad():  # their logits 0: greedy picks the largest of the others' random logits, almost surely > 0
        model.get_output_embeddings().weight[silent] = 0
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    return {"dir": str(directory), "recipe": RECIPE, "version": args.version, "size": args.size, "params": params,
            "printable_tokens": len(printable),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "vocab": len(tokenizer),
            "seconds": round(time.perf_counter() - start, 1), **SIZES[args.size]}


def _renders(text: str) -> bool:
    """A token that shows as text on its own: whole characters, printable, not only spaces."""
    return bool(text.strip()) and "\ufffd" not in text and text.isprintable()


def floor(args) -> dict:
    import torch

    from chatglm_tune.decoding.generation import generate
    from chatglm_tune.runs import loading

    source = loading.resolve_run(args.model_dir)
    model, tokenizer, _ = loading.load_for_inference(source, threads=args.threads)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    hi = min(len(tokenizer), model.config.vocab_size) - 1
    out = {"params": params, "weight_bytes": weight_bytes, "threads": torch.get_num_threads(), "batches": {}}
    for batch in map(int, args.batches.split(",")):
        ids = torch.randint(5, hi, (batch, FLOOR_PROMPT), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)

        def timed(n: int) -> float:
            start = time.perf_counter()
            rows = generate(model, ids, mask, max_new_tokens=n, eos_token_id=None)
            assert all(len(r) == n for r in rows)
            return time.perf_counter() - start

        timed(2)  # warm-up
        repeats = 3 if batch <= 4 else 2  # the fastest of a few: other processes on a shared machine only slow it
        first = min(timed(1) for _ in range(repeats))
        whole = min(timed(1 + FLOOR_STEPS) for _ in range(repeats))
        step = max(whole - first, 1e-9) / FLOOR_STEPS
        out["batches"][str(batch)] = {"ms_per_step": round(1000 * step, 2), "tokens_per_s": round(batch / step, 1),
                                      "prefill_ms": round(1000 * first, 1)}
    # Prefill cost per prompt token: one 64-token prompt, and 4 of them in one forward (256 tokens: the engine's
    # default prefill budget per step), through the model's forward as the engine calls it.
    with torch.inference_mode():
        for rows in (1, 4):
            ids = torch.randint(5, hi, (rows, PREFILL_LEN), generator=torch.Generator().manual_seed(rows))
            model(ids, use_cache=True, logits_to_keep=1)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                best = min(best, time.perf_counter() - start)
            out[f"prefill_ms_per_token_{rows}x{PREFILL_LEN}"] = round(1000 * best / (rows * PREFILL_LEN), 3)
    return out


def ceilings(args) -> dict:
    import torch

    from bench.common.measure import copy_bandwidth

    torch.set_num_threads(args.threads)
    out = {"threads": torch.get_num_threads(), "copy_bandwidth_gbs": round(copy_bandwidth() / 1e9, 2),
           "gemm_gflops": {}}
    # Linear weights [out, in], 11.5 MB each, cycled through: 277 MB in all, as a model's weights far more than the
    # CPU's caches hold, so every product reads its weight from memory as a decode step does.
    weights = [torch.randn(GEMM_N, GEMM_K) for _ in range(GEMM_WEIGHTS)]
    for m in (1, 16, 32, 512):
        x = torch.randn(m, GEMM_K)
        rounds = 3
        for w in weights:
            torch.nn.functional.linear(x, w)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(x, w)
            best = min(best, (time.perf_counter() - start) / len(weights))
        out["gemm_gflops"][str(m)] = round(2 * m * GEMM_K * GEMM_N / best / 1e9, 1)
        if m == 1:
            out["gemv_read_gbs"] = round(GEMM_K * GEMM_N * 4 / best / 1e9, 2)
    return out


def prompts(args) -> dict:
    from bench.serve.serve_load import chat_content, dev_texts
    from chatglm_tune.data.records import SPORecord
    from chatglm_tune.options import EncodingOptions
    from chatglm_tune.runs import loading

    source = loading.resolve_run(args.model_dir)
    tokenizer = loading.load_tokenizer(source)
    form = tokenizer.prompt_format
    room = 1 << 16  # uncut, as serve.py's completions
    encoding = EncodingOptions(prompt=source.encoding.prompt, max_src_len=room, max_len=room + 2)
    texts = dev_texts()
    ids = {text: form.prompt_ids(tokenizer, SPORecord(text, None), encoding)[0] for text in texts}
    chats = [form.chat_ids(tokenizer, [{"role": "user", "content": chat_content(text)}]) for text in texts]
    return {"completion_ids": ids, "longest": max(map(len, [*ids.values(), *chats]))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("build", "floor", "ceilings", "prompts"))
    p.add_argument("--version", default="glm4", choices=("glm4", "chatglm3", "chatglm2"))
    p.add_argument("--size", default="mid", choices=tuple(SIZES))
    p.add_argument("--model-dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,4,16,32")
    args = p.parse_args(argv)
    print(json.dumps({"build": build, "floor": floor, "ceilings": ceilings,
                      "prompts": prompts}[args.what](args)), flush=True)


if __name__ == "__main__":
    main()
