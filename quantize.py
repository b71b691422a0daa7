"""Quantize a ChatGLM model or train.py run to INT8/INT4 weights in the official layout.

    python quantize.py --bits 4 MODEL_DIR OUT_DIR                   # official per-row INT4
    python quantize.py --bits 4 --group-size 32 MODEL_DIR OUT_DIR   # group-wise INT4 (our extension)
    python quantize.py --bits 8 --lora ADAPTER MODEL_DIR OUT_DIR    # merge a LoRA adapter, then INT8
    python quantize.py --bits 8 RUN_DIR OUT_DIR                     # a train.py run: full, P-tuning or LoRA

Official layout: per output row, scale = absmax / (2^(bits-1) - 1) in fp16; INT8 weights as int8,
INT4 packed two per byte (the even column in the high nibble); biases, LayerNorms and embeddings kept
in half precision. OUT_DIR gets config.json (`quantization_bit`, `quantization_group_size`),
safetensors and the tokenizer; a run's OUT_DIR also gets its run_args.json, so infer.py runs it with
the run's prompt and answer budget. A P-tuning run's prefix is kept (in float32) inside OUT_DIR; a
LoRA adapter is merged into the float base first. Without an adapter the block Linears are quantized
one by one while the checkpoint loads: peak memory stays near one copy of the source weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from chatglm_tune.options import LOAD_DTYPES, QUANTIZATION_BITS, QUANTIZE_DTYPE


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="source model directory (half or float weights, config.json), or a train.py run")
    p.add_argument("out_dir", type=Path, help="new directory for the quantized model (must not exist or be empty)")
    p.add_argument("--bits", type=int, choices=QUANTIZATION_BITS, required=True, help="INT8 or INT4 weights (required)")
    p.add_argument("--group-size", type=int, default=0,
                   help="INT4 only: one scale per this many columns; 0 = one per row, the official layout (default %(default)s)")
    p.add_argument("--lora", type=Path, help="peft LoRA adapter directory to merge before quantizing (ours, or one of the "
                   "official ChatGLM2/3 / GLM-4 code: query_key_value ...; default: none)")
    p.add_argument("--dtype", choices=LOAD_DTYPES, default=QUANTIZE_DTYPE,
                   help="dtype the weights are quantized in and the embeddings, LayerNorms and biases are kept in (default %(default)s)")
    return p.parse_args(argv)


def check_args(args, source) -> None:
    """ValueError naming every problem found before any weight is read."""
    import json

    config = json.loads((source.base / "config.json").read_text())
    problems = []
    if config.get("quantization_bit"):
        problems.append(f"{source.base} is already INT{config['quantization_bit']}: quantize its half/float source instead")
    if args.group_size < 0:
        problems.append(f"--group-size must be >= 0, got {args.group_size}")
    elif args.group_size and args.bits != 4:
        problems.append("--group-size applies to --bits 4 only (INT8 keeps the official per-row scales)")
    elif args.group_size:
        widths = {"hidden_size": config.get("hidden_size"), "inner width": config.get("inner_hidden_size") or config.get("ffn_hidden_size")}
        bad = [f"{k}={v}" for k, v in widths.items() if not v or v % args.group_size]
        if bad:
            problems.append(f"--group-size {args.group_size} must divide the Linears' input widths ({', '.join(bad)})")
    if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
        problems.append(f"{args.out_dir} exists and is not an empty directory: choose a new output directory")
    if problems:
        raise ValueError("; ".join(problems))


def quantize(args, source) -> None:
    """Load `source` quantized (an adapter merged first), write it with its tokenizer and the run's settings."""
    from chatglm_tune import loading, rundir

    model = loading.load_model(source, dtype=args.dtype, quantization_bit=args.bits, group_size=args.group_size,
                              quantize_embedding=False)
    model.save_pretrained(args.out_dir)
    if source.tokenizer_dir is not None:
        loading.load_tokenizer(source).save_pretrained(args.out_dir)
    rundir.write_run_args(args.out_dir, loading.derived_run_args(source, quantization_bit=args.bits))


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        from chatglm_tune import loading
        from chatglm_tune.checkpoint import weight_files

        source = loading.resolve_run(args.model_dir, lora=args.lora)
        check_args(args, source)
        start = time.perf_counter()
        quantize(args, source)
        seconds = time.perf_counter() - start
        before = sum(f.stat().st_size for f in weight_files(source.base))
        after = sum(f.stat().st_size for f in weight_files(args.out_dir))
    except (ValueError, FileNotFoundError) as err:  # CheckpointError and RunDirectoryError are ValueErrors
        print(f"quantize.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    fmt = f"INT{args.bits}" + (f", group {args.group_size}" if args.group_size else ", per-row scales")
    print(f"{source.describe()} -> {args.out_dir} ({fmt}): {before / 1e6:,.1f} MB -> {after / 1e6:,.1f} MB on disk "
          f"({after / before:.2f}x) in {seconds:.1f} s")
    print(f"run it:  python infer.py --model {args.out_dir} ...\n"
          f"P-tune or LoRA-tune it (the prefix / adapter stays float on top of the INT{args.bits} weights):\n"
          f"         python train.py --model {args.out_dir} --tuning ptuning ...")


if __name__ == "__main__":
    main()
