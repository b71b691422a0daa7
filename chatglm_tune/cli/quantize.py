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

OUT_DIR is written as `.OUT_DIR.partial` beside it and renamed into place when complete: an error, Ctrl-C, SIGTERM
or SIGUSR1 removes it (exit 130 / 143 / 138 for the signals), a SIGKILL's is removed by the next run, and the same
command run again on a finished OUT_DIR says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from chatglm_tune import cli
from chatglm_tune.cli.config import CommandParser
from chatglm_tune.options import LOAD_DTYPES, QUANTIZATION_BITS, QUANTIZE_DTYPE


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path,
                   help="source model directory (half or float weights, config.json), or a train.py run")
    p.add_argument("out_dir", type=Path, help="new directory for the quantized model (must not exist or be empty)")
    p.add_argument("--bits", type=int, choices=QUANTIZATION_BITS, required=True, help="INT8 or INT4 weights (required)")
    p.add_argument("--group-size", type=int, default=0,
                   help="INT4 only: one scale per this many columns; 0 = one per row, the official layout "
                        "(default %(default)s)")
    p.add_argument("--lora", type=Path, help="peft LoRA adapter directory to merge before quantizing (ours, or one of "
                   "the official ChatGLM2/3 / GLM-4 code: query_key_value ...; default: none)")
    p.add_argument("--dtype", choices=LOAD_DTYPES, default=QUANTIZE_DTYPE,
                   help="dtype the weights are quantized in and the embeddings, LayerNorms and biases are kept in "
                        "(default %(default)s)")
    return p.parse_args(argv)


def made(args) -> dict:
    """What this command's output records of it (`destination.made_by`)."""
    from chatglm_tune.export.destination import made_by

    return made_by("quantize.py", [args.model_dir, args.lora], bits=args.bits, group_size=args.group_size,
                   dtype=args.dtype, model_dir=str(args.model_dir.resolve()),
                   lora=str(args.lora.resolve()) if args.lora else None)


def check_args(args, source) -> bool:
    """ValueError naming every problem found before any weight is read; True where OUT_DIR already holds this
    command's finished output."""
    import json

    from chatglm_tune.export.destination import check_destination
    from chatglm_tune.runs.loading import text_fields

    config = text_fields(json.loads((source.base / "config.json").read_text()))  # a composite one's text model
    problems = []
    if config.get("quantization_bit"):
        problems.append(f"{source.base} is already INT{config['quantization_bit']}: quantize its half/float source "
                        "instead")
    if args.group_size < 0:
        problems.append(f"--group-size must be >= 0, got {args.group_size}")
    elif args.group_size and args.bits != 4:
        problems.append("--group-size applies to --bits 4 only (INT8 keeps the official per-row scales)")
    elif args.group_size:
        widths = {"hidden_size": config.get("hidden_size"),
                  "inner width": config.get("inner_hidden_size") or config.get("ffn_hidden_size")}
        bad = [f"{k}={v}" for k, v in widths.items() if not v or v % args.group_size]
        if bad:
            problems.append(f"--group-size {args.group_size} must divide the Linears' input widths ({', '.join(bad)})")
    try:
        done = check_destination(args.out_dir, made(args))
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))
    return done


def quantize(args, source) -> None:
    """Load `source` quantized (an adapter merged first), write it with its tokenizer and the run's settings."""
    from chatglm_tune.export.destination import writing_into
    from chatglm_tune.runs import loading, rundir

    with writing_into(args.out_dir, made(args)) as partial:  # whole or not at all
        model = loading.load_model(source, dtype=args.dtype, quantization_bit=args.bits, group_size=args.group_size,
                                   quantize_embedding=False)
        tokenizer = loading.load_tokenizer(source) if source.tokenizer_dir is not None else None
        try:
            model.save_pretrained(partial)
            if tokenizer is not None:
                tokenizer.save_pretrained(partial)
            rundir.write_run_args(partial, loading.derived_run_args(source, quantization_bit=args.bits))
        except OSError as err:  # the file system refuses it (full, gone read-only)
            raise rundir.cannot_create(args.out_dir, err) from None


def main(argv=None) -> None:
    from chatglm_tune.runtime.stopping import exit_status, signal_name, signals_stop

    args = parse_args(argv)
    try:
        with signals_stop():
            from chatglm_tune.runs import loading
            from chatglm_tune.runtime.checkpoint import weight_files

            source = loading.resolve_run(args.model_dir, lora=args.lora)
            if check_args(args, source):
                print(f"quantize.py: {args.out_dir} already holds this quantization of {args.model_dir}: nothing to do")
                return
            start = time.perf_counter()
            quantize(args, source)
            seconds = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as err:  # CheckpointError and RunDirectoryError are ValueErrors
        print(f"quantize.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as interrupt:
        print(f"quantize.py: interrupted by {signal_name(interrupt)}; what was written is removed ({args.out_dir} is "
              "as it was)", file=sys.stderr)
        sys.exit(exit_status(interrupt))
    before = sum(f.stat().st_size for f in weight_files(source.base))
    after = sum(f.stat().st_size for f in weight_files(args.out_dir))
    fmt = f"INT{args.bits}" + (f", group {args.group_size}" if args.group_size else ", per-row scales")
    print(f"{source.describe()} -> {args.out_dir} ({fmt}): {before / 1e6:,.1f} MB -> {after / 1e6:,.1f} MB on disk "
          f"({after / before:.2f}x) in {seconds:.1f} s")
    print(f"run it:  {cli.hint('infer')} --model {args.out_dir} ...\n"
          f"P-tune or LoRA-tune it (the prefix / adapter stays float on top of the INT{args.bits} weights):\n"
          f"         {cli.hint('train')} --model {args.out_dir} --tuning ptuning ...")


if __name__ == "__main__":
    main()
