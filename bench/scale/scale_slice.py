"""The measured copy of bench/scale/scale_cards.py: a version's first few full-size layers with random weights in the
release's layout, and the process that measures them. Each prints one JSON line.

    python bench/scale/scale_slice.py write --version V --model-dir DIR [--shards N]
    python bench/scale/scale_slice.py measure --version V --model-dir DIR [--prefill-tokens N] [--train-tokens T]

`write`: config.json (transformers' config class of the release, the text config cut to the row's `slice_layers`)
and bf16 safetensors shards (float32 for the tensors transformers keeps in float32) under the release's key names:
transformers' state_dict keys with the row's `released_names` and `released_splits` undone (what `save_pretrained`
writes) and each routed expert's `gate_proj`, `up_proj`, `down_proj` apart. Norm weights ones, LayerNorm biases,
A_log, the routers' score-correction biases and the hyper-connections' bases zeros, their scales ones, everything
else N(0, 0.02) from a generator seeded by its key (bench/common/checkpoint_writer.py's `make_tensor`), one shard in
memory at a time.

`measure` (a fresh process; the bench takes its peak RSS from outside): the toolkit's `from_pretrained(dir,
dtype=bfloat16)` of the released layout (the model on transformers' modules, their reference PyTorch paths: no
flash-linear-attention or DSA kernels here; what transformers keeps in float32 read as float32), then
1. a prefill of `--prefill-tokens` random ids with a cache (no gradients, the last position's logits only): its
   peak RSS (the window's own, `measure.PeakRSS`) and the cache's bytes, tensor by tensor;
2. one LoRA step (the toolkit's `apply_lora` with `LoraOptions()` on the row's attention targets, gradient
   checkpointing, AdamW) on `--train-tokens` ids, the second half labelled: its peak RSS and trainable parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.accounted_versions import VERSIONS, AccountedVersion, sliced_config, transformers_config  # noqa: E402
from bench.common.checkpoint_writer import make_tensor, shard_plan  # noqa: E402
from bench.common.measure import PeakRSS, memory_status, peak_rss  # noqa: E402
from bench.scale.scale_accounting import GB, tensors  # noqa: E402

ZEROS = ("norm.bias", "A_log", "e_score_correction_bias", "hc_attn_base", "hc_ffn_base")
ONES = ("norm.weight", "hc_attn_scale", "hc_ffn_scale")


def released_tensors(version: AccountedVersion, cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(key, shape, float32) of the release's weight files for text config `cfg` (the module docstring)."""
    return [entry for key, shape, fp32 in tensors(version, cfg) for entry in _released(version, key, shape, fp32)]


def _released(version: AccountedVersion, key: str, shape: tuple[int, ...], fp32: bool) -> list:
    for fused, parts in version.released_splits:
        if key.endswith(fused):
            stem = key[: -len(fused)]
            return [(stem + part, (shape[0] // len(parts), *shape[1:]), fp32) for part in parts]
    if len(shape) == 3 and ".mlp.experts." in key:  # [E, 2I, H] gate_up or [E, H, I] down, expert by expert
        stem, weight = key.rsplit(".", 1)
        names = ("gate_proj", "up_proj") if weight == "gate_up_proj" else ("down_proj",)
        rows = shape[1] // len(names)
        return [(f"{stem}.{e}.{name}.weight", (rows, shape[2]), fp32) for e in range(shape[0]) for name in names]
    for ours, theirs in version.released_names:
        key = key.replace(ours, theirs)
    return [(key, shape, fp32)]


def init_of(key: str) -> str:
    return "zeros" if key.endswith(ZEROS) else "ones" if key.endswith(ONES) else key


def write(version: AccountedVersion, directory: Path, n_shards: int, cfg: dict | None = None) -> dict:
    """The measured copy (text config `cfg`, default the row's slice) into `directory` (replaced): {"keys",
    "shards", "bytes"}."""
    from safetensors.torch import save_file

    cfg = cfg or sliced_config(version, version.slice_layers)
    entries = released_tensors(version, cfg)
    entries.sort(key=lambda e: e[0].startswith("lm_head."))  # the head last, as shard_plan expects
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    plan = shard_plan([(key, shape, init_of(key)) for key, shape, _ in entries], n_shards)
    weight_map, total = {}, 0
    for s, group in enumerate(plan, 1):
        name = f"model-{s:05d}-of-{len(plan):05d}.safetensors"
        shard = {}
        for j in group:
            key, shape, fp32 = entries[j]
            shard[key] = make_tensor(shape, init_of(key)).to(torch.float32 if fp32 else torch.bfloat16)
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = transformers_config(version, cfg)
    config.architectures = [version.model_class]
    config.save_pretrained(directory)
    return {"keys": len(entries), "shards": len(plan), "bytes": total}


def tensor_bytes_in(obj, seen: set | None = None) -> int:
    """Bytes of the tensors an object holds in its attributes, dicts and lists (a cache layer's keys, values,
    indexer keys, conv and recurrent states), each counted once; 0-dim ones left out (a KDA layer's length count)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        if obj.data_ptr() in seen or obj.device.type == "meta" or not obj.dim():
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes_in(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes_in(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes_in(v, seen) for v in vars(obj).values())
    return 0


def cache_of(output):
    return getattr(output, "cache", None) or output.past_key_values


def load(version: AccountedVersion, directory: Path):
    """The toolkit's loader of the released layout (what train.py and infer.py read it with), in bfloat16."""
    from chatglm_tune import from_pretrained

    return from_pretrained(directory, dtype=torch.bfloat16)


def prefill(model, vocab: int, tokens: int) -> dict:
    """Peak RSS and the cache's bytes of a prefill of `tokens` random ids."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with PeakRSS() as window, torch.no_grad():
        output = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = cache_of(output)
    out = {"tokens": tokens, "peak_rss_gb": window.peak / GB, "seconds": round(time.perf_counter() - start, 1),
           "cache_bytes": tensor_bytes_in(cache.layers), "finite": bool(torch.isfinite(output.logits).all()),
           "status_mb": memory_status()}
    del output, cache
    gc.collect()
    return out


def lora_step(model, version: AccountedVersion, vocab: int, tokens: int) -> dict:
    """Peak RSS, trainable parameters and loss of one LoRA step on `tokens` random ids (the second half labelled)."""
    from chatglm_tune.options import DEFAULT_LR, LoraOptions
    from chatglm_tune.runs.lora import apply_lora

    model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    peft = apply_lora(model, LoraOptions(target=version.lora_targets), title=version.title)
    peft.train()
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=DEFAULT_LR["lora"])
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, : tokens // 2] = -100
    start = time.perf_counter()
    with PeakRSS() as window:
        loss = peft(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
    return {"tokens": tokens, "peak_rss_gb": window.peak / GB, "seconds": round(time.perf_counter() - start, 1),
            "trainable_params": sum(p.numel() for p in params), "loss": round(loss.item(), 4),
            "status_mb": memory_status(),
            "finite_grads": all(torch.isfinite(p.grad).all().item() for p in params if p.grad is not None)}


def measure(version: AccountedVersion, directory: Path, prefill_tokens: int, train_tokens: int) -> dict:
    start = time.perf_counter()
    model = load(version, directory)
    model.eval()
    held = {k: t for k, t in model.state_dict().items() if not k.startswith(version.skipped)}
    out = {"load_s": round(time.perf_counter() - start, 1), "rss_load_gb": peak_rss() / GB,
           "status_load_mb": memory_status(), "weights_bytes": sum(t.numel() * t.element_size() for t in held.values()),
           "layers": sliced_config(version, version.slice_layers)["num_hidden_layers"]}
    vocab = version.config["vocab_size"]
    out["prefill"] = prefill(model, vocab, prefill_tokens)
    out["lora"] = lora_step(model, version, vocab, train_tokens)
    out["status_end_mb"] = memory_status()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("write", "measure"))
    p.add_argument("--version", choices=VERSIONS, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--shards", type=int, default=4, help="write: weight files (default %(default)s)")
    p.add_argument("--prefill-tokens", type=int, help="measure: default the row's `measured_tokens`")
    p.add_argument("--train-tokens", type=int, help="measure: default the row's `measured_tokens`")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    version = VERSIONS[args.version]
    if args.kind == "write":
        print(json.dumps(write(version, args.model_dir, args.shards)))
    else:
        prefill_tokens, train_tokens = version.measured_tokens
        result = measure(version, args.model_dir, args.prefill_tokens or prefill_tokens,
                         args.train_tokens or train_tokens)
        result.update(threads=args.threads, torch=torch.__version__, when=time.strftime("%Y-%m-%d %H:%M:%S"),
                      load_average=[round(x, 2) for x in os.getloadavg()])
        print(json.dumps(result))


if __name__ == "__main__":
    main()
