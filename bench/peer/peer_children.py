"""The workload of bench/peer/peer.py and the toolkit's measuring processes (`toolkit-*`, `batch-*-bN`).

The workload is shared with chatglm.cpp's process (bench/peer/peer_cpp.py): random prompts of ids both
runtimes accept, in the version's frame (`--frame`, resolved by peer.py: ChatGLM-6B's end [gMASK] <sop>),
an 8-token warm-up of 2 new tokens, a 64-token prompt (`--prompt-len`: another length) then 64 new tokens, and
extraction records of 64 + 32 tokens. Each child runs fresh (started by peer.py with `--child`), returns one dict that
peer.py prints as a JSON line, and is measured from outside (its peak RSS and wall time) by `measure.run`.
"""

from __future__ import annotations

import time

from bench.common.measure import copy_bandwidth, huge_pages_gb, peak_rss, weight_bytes_per_token
from bench.common.scale_versions import framed_ids

GB = 1e9
PROMPT_LEN, NEW_TOKENS, WARMUP_PROMPT, WARMUP_TOKENS = 64, 64, 8, 2
EXTRACT_NEW_TOKENS, BATCHES = 32, (1, 8, 32)
BITS = {"bf16": 0, "int8": 8, "int4": 4}


def prompt(frame: dict, length: int, seed: int, batch: int = 1) -> list[list[int]]:
    """`batch` random prompts of `length` ids in the frame (`PromptFrame.resolve`): its head, random ordinary
    ids, its tail."""
    return framed_ids(frame, length, length, seed, batch).tolist()


def _load_toolkit(args):
    import torch

    from chatglm_tune import from_pretrained

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = from_pretrained(args.model_dir, dtype=torch.bfloat16, quantization_bit=BITS[args.variant] or None,
                            quantize_embedding=args.quantize_embedding)
    return model, time.perf_counter() - start


def _kernels(model) -> list[str]:
    from chatglm_tune.quant.modules import QuantizedLinear

    return sorted({m.last_kernel for m in model.modules() if isinstance(m, QuantizedLinear) and m.last_kernel})


def child_toolkit(args) -> dict:
    import torch

    from chatglm_tune.decoding.generation import generate

    torch.set_num_threads(args.threads)
    copy_gb_s = copy_bandwidth() / GB  # before the load: its two 256 MiB buffers stay out of the model's peak RSS
    model, load_s = _load_toolkit(args)
    rss_load = peak_rss()
    generate(model, torch.tensor(prompt(args.frame, WARMUP_PROMPT, 1)), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    calls: list[float] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
    start = time.perf_counter()
    out = generate(model, torch.tensor(prompt(args.frame, args.prompt_len, 0)), max_new_tokens=NEW_TOKENS,
                   eos_token_id=None)[0]
    end = time.perf_counter()
    hook.remove()
    assert len(out) == NEW_TOKENS == len(calls), (len(out), len(calls))
    return {"load_s": load_s, "prompt_len": args.prompt_len, "prefill_ms": (calls[1] - start) * 1e3,
            "decode_ms": (end - calls[1]) / (NEW_TOKENS - 1) * 1e3, "rss_load_gb": rss_load / GB,
            "kernels": _kernels(model), "distinct_tokens": len(set(out)), "first_tokens": list(out[:8]),
            "weight_bytes_per_token": weight_bytes_per_token(model), "huge_pages_gb": huge_pages_gb(),
            "capability": torch.backends.cpu.get_cpu_capability(), "copy_gb_s": copy_gb_s}


def child_batch(args) -> dict:
    import torch

    from chatglm_tune.decoding.generation import generate

    model, load_s = _load_toolkit(args)
    generate(model, torch.tensor(prompt(args.frame, WARMUP_PROMPT, 1)), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    ids = torch.tensor(prompt(args.frame, PROMPT_LEN, 3, args.batch))
    start = time.perf_counter()
    out = generate(model, ids, max_new_tokens=EXTRACT_NEW_TOKENS, eos_token_id=None)
    seconds = time.perf_counter() - start
    assert all(len(row) == EXTRACT_NEW_TOKENS for row in out)
    return {"load_s": load_s, "batch": args.batch, "seconds": seconds, "records_per_s": args.batch / seconds,
            "kernels": _kernels(model), "capability": torch.backends.cpu.get_cpu_capability()}
