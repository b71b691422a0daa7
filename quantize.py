"""Quantize a ChatGLM model directory to INT8/INT4 weights in the official layout (spec section 6).

    python quantize.py --bits 4 MODEL_DIR OUT_DIR                   # official per-row INT4
    python quantize.py --bits 4 --group-size 32 MODEL_DIR OUT_DIR   # group-wise INT4 (our extension)
    python quantize.py --bits 8 --lora ADAPTER MODEL_DIR OUT_DIR    # merge a LoRA adapter, then INT8

OUT_DIR gets config.json (`quantization_bit`, `quantization_group_size`), safetensors and the
tokenizer; `ChatGLMForConditionalGeneration.from_pretrained(OUT_DIR)` loads it. Without `--lora` the
block Linears are quantized one by one while the checkpoint loads; with it the float model is loaded,
the adapter merged, and each float weight freed as soon as it is quantized: either way peak memory
stays near one copy of the source weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from chatglm_tune import ChatGLMForConditionalGeneration
from chatglm_tune.checkpoint import weight_files
from chatglm_tune.tokenizer import VOCAB_FILE, ChatGLMTokenizer

DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_DTYPE = "float16"  # the official rule: scales and W / scale computed in fp16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="source model directory (half or float weights, config.json)")
    p.add_argument("out_dir", type=Path, help="new directory for the quantized model (must not exist or be empty)")
    p.add_argument("--bits", type=int, choices=(8, 4), required=True, help="INT8 or INT4 weights (required)")
    p.add_argument("--group-size", type=int, default=0,
                   help="INT4 only: one scale per this many columns; 0 = one per row, the official layout (default %(default)s)")
    p.add_argument("--lora", type=Path, help="peft LoRA adapter directory to merge before quantizing (default: none)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help="dtype the weights are quantized in and the embeddings, LayerNorms and biases are kept in (default %(default)s)")
    return p.parse_args(argv)


def check_args(args) -> None:
    """ValueError naming every problem found before any weight is read."""
    config_file = args.model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{args.model_dir}: not a model directory (no config.json)")
    config = json.loads(config_file.read_text())
    problems = []
    if config.get("quantization_bit"):
        problems.append(f"{args.model_dir} is already INT{config['quantization_bit']}: quantize its half/float source instead")
    if args.group_size < 0:
        problems.append(f"--group-size must be >= 0, got {args.group_size}")
    elif args.group_size and args.bits != 4:
        problems.append("--group-size applies to --bits 4 only (INT8 keeps the official per-row scales)")
    elif args.group_size:
        widths = {"hidden_size": config.get("hidden_size"), "inner_hidden_size": config.get("inner_hidden_size")}
        bad = [f"{k}={v}" for k, v in widths.items() if not v or v % args.group_size]
        if bad:
            problems.append(f"--group-size {args.group_size} must divide the Linears' input widths ({', '.join(bad)})")
    if args.lora is not None and not (args.lora / "adapter_config.json").is_file():
        problems.append(f"{args.lora}: not a peft LoRA adapter directory (no adapter_config.json)")
    if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
        problems.append(f"{args.out_dir} exists and is not an empty directory: choose a new output directory")
    if problems:
        raise ValueError("; ".join(problems))


def quantized_model(args) -> ChatGLMForConditionalGeneration:
    dtype = getattr(torch, args.dtype)
    if args.lora is None:
        return ChatGLMForConditionalGeneration.from_pretrained(
            args.model_dir, dtype=dtype, quantization_bit=args.bits, quantization_group_size=args.group_size)
    from chatglm_tune.lora import load_lora, merge_lora
    from chatglm_tune.quantization import quantize_model

    model = ChatGLMForConditionalGeneration.from_pretrained(args.model_dir, dtype=dtype)
    try:
        model = merge_lora(load_lora(model, args.lora))
    except RuntimeError as err:  # peft's load_state_dict size mismatches
        raise ValueError(f"{args.lora}: the adapter does not fit {args.model_dir}: {err}") from err
    quantize_model(model, args.bits, args.group_size)
    model.config.quantization_bit, model.config.quantization_group_size = args.bits, args.group_size
    return model


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(directory))


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        check_args(args)
        start = time.perf_counter()
        model = quantized_model(args)
        model.save_pretrained(args.out_dir)
        if (args.model_dir / VOCAB_FILE).exists():
            ChatGLMTokenizer.from_pretrained(args.model_dir).save_pretrained(args.out_dir)
        seconds = time.perf_counter() - start
        before, after = disk_bytes(args.model_dir), disk_bytes(args.out_dir)
    except (ValueError, FileNotFoundError) as err:  # CheckpointError is a ValueError
        print(f"quantize.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    fmt = f"INT{args.bits}" + (f", group {args.group_size}" if args.group_size else ", per-row scales")
    merged = f" + LoRA {args.lora}" if args.lora else ""
    print(f"{args.model_dir}{merged} -> {args.out_dir} ({fmt}): {before / 1e6:,.1f} MB -> {after / 1e6:,.1f} MB on disk "
          f"({after / before:.2f}x) in {seconds:.1f} s")
    print(f"P-tuning v2 on this base (the prefix encoder stays float32 on top of the INT{args.bits} weights):\n"
          f"  train: python train.py --model {args.out_dir} --tuning ptuning ...\n"
          f"  run:   python infer.py --model {args.out_dir} --ptuning-checkpoint RUN_DIR ...\n"
          f"  code:  m = ChatGLMForConditionalGeneration.from_pretrained('{args.out_dir}', pre_seq_len=N, "
          f"prefix_projection=...); m.load_prefix('RUN_DIR')")


if __name__ == "__main__":
    main()
