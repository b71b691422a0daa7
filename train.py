"""Fine-tune ChatGLM on SPO extraction data: P-tuning v2, LoRA or full fine-tuning (see README).

    python train.py --model tiny --tuning full --train-file data/spo_train.jsonl \
        --dev-file data/spo_dev.jsonl --output-dir checkpoints/tiny
    accelerate launch train.py --model DIR --tuning ptuning ...      # several GPUs or nodes
"""

import argparse
import sys

from chatglm_tune import heap
from chatglm_tune.data import EncodingOptions, RecordError, read_records
from chatglm_tune.lora import LoraOptions
from chatglm_tune.rundir import read_run_args
from chatglm_tune.training import DEFAULT_LR, TINY_DEMO, TUNINGS, TrainingError, TrainOptions, prepare_model, train

D, L, E = TrainOptions(), LoraOptions(), EncodingOptions()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="a ChatGLM model directory, or 'tiny' (a random tiny model and a tokenizer "
      f"trained on the train file; with --tuning full and no other flag, the demo settings {TINY_DEMO})")
    a("--train-file", required=True, help=".jsonl or .json SPO records")
    a("--dev-file", help="dev records: loss and triple P/R/F1 at each evaluation, best checkpoint by F1")
    a("--output-dir", required=True, help="the run directory (a model directory infer.py --model can run)")
    a("--tuning", choices=TUNINGS, default=D.tuning, help=f"what to train (default {D.tuning})")
    a("--pre-seq-len", type=int, default=D.pre_seq_len, help=f"P-tuning v2 prefix length (default {D.pre_seq_len})")
    a("--prefix-projection", action=argparse.BooleanOptionalAction, default=D.prefix_projection,
      help="P-tuning v2 with the two-layer MLP reparameterisation (default off)")
    a("--lora-r", type=int, default=L.r, help=f"LoRA rank (default {L.r})")
    a("--lora-alpha", type=int, default=L.alpha, help=f"LoRA alpha (default {L.alpha})")
    a("--lora-dropout", type=float, default=L.dropout, help=f"LoRA dropout (default {L.dropout})")
    a("--lora-target", nargs="+", default=list(L.target), help=f"Linears that get adapters (default {' '.join(L.target)})")
    a("--epochs", type=int, help=f"passes over the train file (default {D.epochs})")
    a("--max-steps", type=int, help="optimizer steps; overrides --epochs")
    a("--batch-size", type=int, help=f"rows per process per micro-batch (default {D.batch_size})")
    a("--grad-accum", type=int, default=D.grad_accum, help=f"micro-batches per optimizer step (default {D.grad_accum})")
    a("--lr", type=float, help=f"peak learning rate (default by tuning: {DEFAULT_LR})")
    a("--weight-decay", type=float, help=f"AdamW weight decay (default {D.weight_decay})")
    a("--warmup-ratio", type=float, help=f"share of steps warming up (default {D.warmup_ratio})")
    a("--schedule", choices=("cosine", "linear"), default=D.schedule, help=f"decay after warmup (default {D.schedule})")
    a("--max-grad-norm", type=float, default=D.max_grad_norm, help=f"gradient clipping, 0 = off (default {D.max_grad_norm})")
    a("--mixed-precision", choices=("no", "fp16", "bf16"), default=D.mixed_precision, help="autocast (default no)")
    a("--dtype", default=D.dtype, help=f"dtype of the loaded base weights (default {D.dtype})")
    a("--quantization-bit", type=int, choices=(4, 8), help="quantize the base to INT8/INT4 while loading")
    a("--quantize-embedding", action="store_true", help="hold the frozen tied embedding / head as one INT8 copy")
    a("--gradient-checkpointing", action="store_true", help="recompute activations in backward (less memory)")
    a("--seed", type=int, default=D.seed, help=f"seed of initialisation, shuffling and dropout (default {D.seed})")
    a("--eval-every", type=int, help="evaluate and checkpoint every N steps (default once an epoch)")
    a("--save-every", type=int, help="also save the resumable state every N steps (default: at evaluations)")
    a("--eval-batch-size", type=int, default=D.eval_batch_size, help=f"(default {D.eval_batch_size})")
    a("--log-every", type=int, default=D.log_every, help=f"log the loss every N steps (default {D.log_every})")
    a("--tensorboard", action="store_true", help="also log to TensorBoard under the output dir")
    a("--threads", type=int, help=f"torch CPU threads (default: torch's; the tiny demo: {TINY_DEMO['threads']})")
    a("--resume", action="store_true", help="continue the stopped run in --output-dir")
    a("--on-bad-record", choices=("error", "skip"), default="error", help="stop at a bad record, or skip and count it")
    a("--max-src-len", type=int, help=f"tokens of prompt + text + [gMASK] (default {E.max_src_len})")
    a("--max-len", type=int, help=f"tokens of a whole row; the answer gets max_len - max_src_len (default {E.max_len})")
    a("--prompt", help="instruction put before each text (default: the reference script's)")
    return p.parse_args(argv)


def _resolve(args, names, preset, defaults) -> dict:
    """Each option as given on the command line, else the preset's (tiny demo, base run), else the default."""
    return {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k, getattr(defaults, k)) for k in names}


def options_from(args) -> TrainOptions:
    demo = TINY_DEMO if args.model == "tiny" and args.tuning == "full" else {}
    # Tuning a train.py run: its prompt and lengths are the defaults (the base learned that format).
    base_run = (read_run_args(args.model) or {}).get("encoding", {}) if args.model != "tiny" else {}
    return TrainOptions(
        **_resolve(args, ("epochs", "batch_size", "lr", "weight_decay", "warmup_ratio", "threads"), demo, D),
        tuning=args.tuning, pre_seq_len=args.pre_seq_len, prefix_projection=args.prefix_projection,
        lora=LoraOptions(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target=tuple(args.lora_target)),
        encoding=EncodingOptions(**_resolve(args, ("prompt", "max_src_len", "max_len"), {**base_run, **demo}, E)),
        max_steps=args.max_steps, grad_accum=args.grad_accum, schedule=args.schedule, max_grad_norm=args.max_grad_norm,
        mixed_precision=args.mixed_precision, dtype=args.dtype, quantization_bit=args.quantization_bit or 0,
        quantize_embedding=args.quantize_embedding,
        gradient_checkpointing=args.gradient_checkpointing, seed=args.seed, eval_every=args.eval_every,
        save_every=args.save_every, eval_batch_size=args.eval_batch_size, log_every=args.log_every,
        tensorboard=args.tensorboard,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        options = options_from(args)
        train_records, bad = read_records(args.train_file, on_bad_record=args.on_bad_record)
        dev_records, dev_bad = read_records(args.dev_file, on_bad_record=args.on_bad_record) if args.dev_file else ([], None)
        for report in (bad, dev_bad):
            if report is not None and report.total:
                print(report.summary(), file=sys.stderr)
        model, tokenizer = prepare_model(args.model, train_records, args.output_dir, options)
        heap.mmap_large_blocks(model)
        bad_records = {"train": bad.to_dict(), "dev": dev_bad.to_dict() if dev_bad else None}
        summary = train(model, tokenizer, train_records, dev_records, args.output_dir, options,
                        model_arg=args.model, resume=args.resume, bad_records=bad_records)
    except (RecordError, TrainingError, ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    f1 = "n/a" if summary["best_f1"] is None else f"{summary['best_f1']:.3f}"
    print(f"done: {summary['step']} steps in {summary['seconds']}s, best dev micro-F1 {f1}, model in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
