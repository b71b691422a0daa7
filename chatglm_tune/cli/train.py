r"""Fine-tune ChatGLM on SPO extraction data: P-tuning v2, LoRA or full fine-tuning (see README).

  python train.py --model tiny --tuning full --train-file data/spo_train.jsonl \
      --dev-file data/spo_dev.jsonl --output-dir checkpoints/tiny
  python train.py --model checkpoints/tiny --tuning ptuning --pre-seq-len 128 ...
  accelerate launch train.py --model DIR --tuning lora ...        # several GPUs or nodes
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from chatglm_tune import cli
from chatglm_tune.cli.config import CommandParser
from chatglm_tune.options import (
    BAD_RECORD_MODES, COMPILE_BACKEND, DEFAULT_LR, EVALUATIONS, LOAD_DTYPES, LOSS_ON, METHOD_DEFAULTS, MIXED_PRECISIONS,
    QUANTIZATION_BITS, REASONING_EFFORTS, SCHEDULES, THREADS_PER_CPU, TINY_DEMO, TINY_DEMO_STEPS, TINY_MAX_LAYERS,
    TINY_PRESETS, TUNINGS,
    choose_threads, raise_problems, tiny_demo, DataColumns, EncodingOptions, LoraOptions, TrainOptions,
)

D, L, E = TrainOptions(), LoraOptions(), EncodingOptions()


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> CommandParser:
    """train's flags (`--config FILE.yaml` gives them from a file)."""
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_and_model_flags(p)
    add_training_flags(p)
    return p


def add_data_and_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data").add_argument
    g("--train-file", required=True, help=".jsonl or .json SPO records")
    g("--dev-file",
      help="dev records: loss and triple P/R/F1 at each evaluation, best checkpoint by F1 (default: none)")
    g("--on-bad-record", choices=BAD_RECORD_MODES, default=BAD_RECORD_MODES[0],
      help="stop at a bad record, or skip and count it (default %(default)s)")
    g("--prompt-column", help="prompt/response data (the official P-tuning shape, e.g. AdvertiseGen's content): the "
      "field holding the prompt; answers are then scored by BLEU-4 / ROUGE (default: the SPO shapes)")
    g("--response-column", help="with --prompt-column: the field holding the answer (e.g. summary)")
    g("--history-column",
      help="with --prompt-column: the field holding earlier [query, response] turns (default: none)")
    g("--prompt", help=f"instruction put before each text (default: the base run's, else {E.prompt!r}; with "
      "--prompt-column, none)")
    g("--max-src-len", type=int, help=f"tokens of prompt + text + [gMASK] (default {E.max_src_len})")
    g("--max-len", type=int, help=f"tokens of a whole row; the answer gets max_len - max_src_len (default {E.max_len})")
    g("--loss-on", choices=LOSS_ON, help="conversation records (ChatGLM3 / GLM-4 and later): train on every assistant "
      f"turn, as the official fine-tuning does, or on the last one only (default: the base run's, else {E.loss_on})")
    g("--enable-thinking", action=argparse.BooleanOptionalAction, help="GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash: render "
      "conversation records with thinking on or off where a record sets no enable_thinking of its own (default: the "
      "base run's, else on exactly for the records that hold reasoning)")
    g("--clear-thinking", action=argparse.BooleanOptionalAction, help="GLM-4.7 / GLM-4.7-Flash: --no-clear-thinking "
      "keeps (and trains) the reasoning of turns before the last user message, which their template drops by default "
      "(default: the base run's, else the template's: dropped)")
    g("--reasoning-effort", choices=REASONING_EFFORTS, help="GLM-5.2: the reasoning-effort line its chat template "
      "writes first while thinking (default: the base run's, else the template's: max)")
    g("--dry-run", action="store_true", help="read and check the data, build the tokenizer and every training row, "
      "print the data report and the first example with its trained spans marked, write examples.jsonl (input_ids, "
      "labels) into --output-dir, and stop before any weight is loaded")
    g = p.add_argument_group("model").add_argument
    g("--model", required=True, help="a ChatGLM-6B, ChatGLM2/3, GLM-4, GLM-4-0414, GLM-Edge, GLM-4.5 / 4.6 / 4.7 or "
      f"GLM-4.7-Flash model directory, or {' / '.join(map(repr, TINY_PRESETS))} (a random tiny model of that version "
      "and a tokenizer trained on the train file in that version's format; with --tuning full and no other flag, "
      f"the demo settings {TINY_DEMO} and step budgets {TINY_DEMO_STEPS})")
    g("--tiny-layers", type=int, help="with a tiny preset: decoder layers of the random model, at most "
      f"{TINY_MAX_LAYERS} (default: the preset's). "
      "A deeper one copies arguments better: 3 layers of tiny ChatGLM3 wrote the shipped tool set's calls exactly "
      "where its 2 plateaued below 0.8")
    g("--dtype", choices=LOAD_DTYPES, default=D.dtype, help="dtype of the loaded base weights (default %(default)s)")
    g("--quantization-bit", type=int, choices=QUANTIZATION_BITS,
      help="quantize the base to INT8/INT4 while loading (default: no)")
    g("--quantize-embedding", action="store_true", help="hold the frozen embedding and output head in INT8, quantized "
      "while loading (ChatGLM-6B's tied pair as one copy; ptuning and lora only; default: no)")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tuning").add_argument
    g("--tuning", choices=TUNINGS, default=D.tuning, help="what to train (default %(default)s)")
    g("--pre-seq-len", type=int, help=f"P-tuning v2 prefix length, at most the model's context (ptuning only; default "
      f"{D.pre_seq_len})")
    g("--prefix-projection", action=argparse.BooleanOptionalAction,
      help="P-tuning v2 with the two-layer MLP reparameterisation (ptuning only; default off, as the official scripts; "
           "with it use a lower --lr: at 2e-2 it diverged on bench/training/adapt.py's tiny GLM-4 base)")
    g("--lora-r", type=int, help=f"LoRA rank, at most the model's hidden size (lora only; default {L.r})")
    g("--lora-alpha", type=int, help=f"LoRA alpha (lora only; default {L.alpha})")
    g("--lora-dropout", type=float, help=f"LoRA dropout (lora only; default {L.dropout})")
    g("--lora-target", nargs="+", help="Linears that get adapters (default: the attention projections of the version: "
      "query_key_value for ChatGLM-6B, q_proj k_proj v_proj for ChatGLM2/3 and GLM-4); the routed experts of GLM-4.5 / "
      "GLM-4.7-Flash as experts.gate_up_proj experts.down_proj (an adapter per expert), the router never")
    g = p.add_argument_group("optimisation").add_argument
    g("--max-steps", type=int, help="optimizer steps (default: --epochs, else the budget of the method, "
      f"{ {t: d['max_steps'] for t, d in METHOD_DEFAULTS.items()} }; the tiny demos: {TINY_DEMO_STEPS})")
    g("--epochs", type=int, help="passes over the train file, instead of a number of steps (default: none)")
    g("--patience", type=int, default=D.patience, help="with --dev-file: stop after this many evaluations without a "
      "better checkpoint (dev F1, ties by dev loss); 0 = never (default %(default)s)")
    g("--batch-size", type=int, help="rows per process per micro-batch (default by method: "
      f"{ {t: d['batch_size'] for t, d in METHOD_DEFAULTS.items()} }; the tiny demo: {TINY_DEMO['batch_size']})")
    g("--packing", action="store_true", help="pack several examples into each row of up to --max-len tokens (none "
      "sees another, each keeps its own positions): fewer pad tokens a step, more examples a row (default: off)")
    g("--grad-accum", type=int, help="micro-batches per optimizer step (default by method: "
      f"{ {t: d['grad_accum'] for t, d in METHOD_DEFAULTS.items()} }, with the method's batch size; 1 when "
      "--batch-size is given)")
    g("--lr", type=float,
      help=f"peak learning rate (default by method: {DEFAULT_LR}; the tiny demo: {TINY_DEMO['lr']})")
    g("--weight-decay", type=float, help=f"AdamW weight decay (default {D.weight_decay})")
    g("--warmup-ratio", type=float, help=f"share of steps warming up (default {D.warmup_ratio})")
    g("--schedule", choices=SCHEDULES, default=D.schedule, help="decay after warmup (default %(default)s)")
    g("--max-grad-norm", type=float, default=D.max_grad_norm, help="gradient clipping, 0 = off (default %(default)s)")
    g("--seed", type=int, default=D.seed, help="seed of initialisation, shuffling and dropout (default %(default)s)")
    g = p.add_argument_group("evaluation and saving").add_argument
    g("--output-dir", required=True, help="the run directory (a model directory infer.py --model can run); must be "
      "new or empty unless --resume or --overwrite")
    g("--resume", nargs="?", const=True, default=False, choices=("auto",), help="continue the stopped run in "
      "--output-dir; --resume auto: continue it where its state is there, start it where the directory is new or empty "
      "(or holds only this run's start), say so and exit 0 where it has finished, refuse another run's directory: "
      "what a requeued job runs")
    g("--overwrite", action="store_true", help="replace the run in --output-dir (never the base model)")
    g("--eval-every", type=int,
      help=f"evaluate and checkpoint every N steps (default: {EVALUATIONS} times over the run)")
    g("--save-every", type=int, help="also save the resumable state every N steps (default: at evaluations)")
    g("--eval-batch-size", type=int, default=D.eval_batch_size, help="dev rows decoded together (default %(default)s)")
    g("--log-every", type=int, default=D.log_every, help="log the mean loss every N steps (default %(default)s)")
    g("--tensorboard", action="store_true",
      help="also log to TensorBoard under the output dir (needs the tensorboard package)")
    g = p.add_argument_group("hardware").add_argument
    g("--mixed-precision", choices=MIXED_PRECISIONS, default=D.mixed_precision, help="autocast (default %(default)s)")
    g("--gradient-checkpointing", action="store_true", help="recompute activations in backward (less memory)")
    g("--compile", nargs="?", const=COMPILE_BACKEND, metavar="BACKEND", help="torch.compile each decoder layer with "
      f"BACKEND (default when given: {COMPILE_BACKEND}; meant for GPUs: on a CPU the tiny models trained no faster; "
      "default: off)")
    g("--threads", type=int, help=f"torch CPU threads, at most {THREADS_PER_CPU} a CPU (default: OMP_NUM_THREADS when "
      "set, else the tiny demo's "
      f"{TINY_DEMO['threads']}, else torch's)")


def _resolve(args, names, preset, defaults, strip: str = "") -> dict:
    """Each option as given on the command line, else the preset's (tiny demo, base run), else the default;
    keyed by its name less `strip` (`lora_r` -> `r`)."""
    given = {k: getattr(args, k, None) for k in names}
    return {k.removeprefix(strip): v if v is not None else preset.get(k, getattr(defaults, k.removeprefix(strip)))
            for k, v in given.items()}


# Flags that belong to one tuning method: given with another, they would be recorded and silently ignored.
METHOD_FLAGS = {"ptuning": ("pre_seq_len", "prefix_projection"),
                "lora": ("lora_r", "lora_alpha", "lora_dropout", "lora_target")}


def misplaced_flags(args) -> list[str]:
    """The problems of flags given together that contradict each other."""
    problems = [f"--{name.replace('_', '-')} applies only to --tuning {tuning}, not {args.tuning}"
                for tuning, names in METHOD_FLAGS.items() if args.tuning != tuning
                for name in names if getattr(args, name) is not None]
    if args.tiny_layers is not None and args.model not in TINY_PRESETS:
        problems.append(f"--tiny-layers applies only to a tiny preset ({', '.join(TINY_PRESETS)}), not a model "
                        "directory")
    if args.epochs is not None and args.max_steps is not None:
        problems.append("give --epochs or --max-steps, not both")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard needs the tensorboard package (pip install tensorboard)")
    return problems


def options_from(args, base_run: dict) -> tuple[TrainOptions, str]:
    """(the run's options, where its thread count came from); tuning a train.py run, its prompt and
    lengths are the defaults (the base learned that format). Every problem of the flags in one error."""
    demo = tiny_demo(args.model) if args.model in TINY_PRESETS and args.tuning == "full" else {}
    problems = misplaced_flags(args)
    try:
        threads, threads_origin = choose_threads(args.threads, demo.get("threads"), "the tiny demo's")
    except ValueError as err:  # --threads or OMP_NUM_THREADS out of bounds
        problems.append(str(err))
        threads, threads_origin = None, "torch's default"  # reported once
    columns = part(problems, DataColumns, prompt=args.prompt_column, response=args.response_column,
                   history=args.history_column)
    if columns.active:  # the official P-tuning puts no instruction before a prompt (its source_prefix is empty)
        base_run = {**base_run, "encoding": {**base_run.get("encoding", {}), "prompt": ""}}
    lora = part(problems, LoraOptions, **_resolve(args, ("lora_r", "lora_alpha", "lora_dropout"), {}, L, strip="lora_"),
                target=tuple(args.lora_target) if args.lora_target else None)
    encoding = part(problems, EncodingOptions,
                    **_resolve(args, ("prompt", "max_src_len", "max_len", "loss_on", "enable_thinking",
                                      "clear_thinking", "reasoning_effort"),
                               {**base_run.get("encoding", {}), **demo}, E))
    options = part(problems, TrainOptions,
        **_resolve(args, ("budget_steps", "batch_size", "grad_accum", "lr", "weight_decay", "warmup_ratio"), demo, D),
        **_resolve(args, ("pre_seq_len", "prefix_projection"), {}, D),
        threads=threads, epochs=args.epochs, patience=args.patience, tuning=args.tuning, lora=lora, encoding=encoding,
        columns=columns, max_steps=args.max_steps, schedule=args.schedule, max_grad_norm=args.max_grad_norm,
        mixed_precision=args.mixed_precision, dtype=args.dtype, quantization_bit=args.quantization_bit or 0,
        quantize_embedding=args.quantize_embedding,
        gradient_checkpointing=args.gradient_checkpointing, compile=args.compile, packing=args.packing, seed=args.seed,
        eval_every=args.eval_every, save_every=args.save_every, eval_batch_size=args.eval_batch_size,
        log_every=args.log_every, tensorboard=args.tensorboard, tiny_layers=args.tiny_layers,
    )
    raise_problems(problems, "the options do not fit together: " if len(problems) > 1 else "")
    return options, threads_origin


def part(problems: list[str], cls, **fields):
    """`cls(**fields)`, or its defaults with the validation's message added to `problems`: so one error
    names every problem of the command line, not only the first."""
    try:
        return cls(**fields)
    except ValueError as err:
        problems.append(str(err))
        return cls()


def own_instructions(args, options: TrainOptions, train_records) -> TrainOptions:
    """Records that hold their own instruction (instruction/input/output data, conversations) get no other
    before them unless --prompt gives one; the run records that empty prompt, so infer.py does the same."""
    from dataclasses import replace

    if args.prompt is None and all(record.instructed for record in train_records):
        return replace(options, encoding=replace(options.encoding, prompt=""))
    return options


def read_data(args, columns: DataColumns):
    """(train records, dev records, bad-record reports); an error naming the file when nothing is left to train on."""
    from chatglm_tune.data.records import read_records

    read = dict(on_bad_record=args.on_bad_record, columns=columns)
    train_records, bad = read_records(args.train_file, **read)
    dev_records, dev_bad = read_records(args.dev_file, **read) if args.dev_file else ([], None)
    if not train_records:
        skipped = f" ({bad.summary()})" if bad.total else ""
        raise ValueError(f"{args.train_file}: no training records{skipped}")
    for report in (bad, dev_bad):
        if report is not None and report.total:
            print(report.summary(), file=sys.stderr)
    return train_records, dev_records, {"train": bad.to_dict(), "dev": dev_bad.to_dict() if dev_bad else None}


def main(argv=None) -> int:
    """Check, train, report. SIGTERM and SIGUSR1 stop a run as Ctrl-C does (`stopping`): the state of the last
    finished step is saved and the exit status is 128 + the signal's number (130, 143, 138)."""

    from chatglm_tune.runtime.stopping import signals_stop

    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    with signals_stop(deferred=int(os.environ.get("WORLD_SIZE", "1")) > 1) as stop:  # every process stops at one step
        try:
            checked = check(args)
        except (ValueError, FileNotFoundError) as e:  # RecordError and RunDirectoryError included
            return fail(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "before training started; nothing was written")
        if checked is None:
            return 0
        try:
            return run(args, *checked, stop=stop)
        except KeyboardInterrupt as e:
            step = getattr(e, "step", None)
            if step is None:
                return interrupted(e, "before the first step; nothing to resume")
            return interrupted(e, f"after step {step}: its state is saved in {args.output_dir}; the same command with "
                               f"--resume continues from there:\n  {continue_command(argv)}")


def dry_run(args) -> int:
    """`--dry-run`: the checks of a run, then its tokenizer and rows (`tuning.dry_run`); nothing is trained."""
    from chatglm_tune.runs import rundir

    if args.resume:
        return fail(ValueError("--dry-run starts no run: it has nothing to resume (drop --resume)"))
    made = not Path(args.output_dir).exists()
    try:
        base = None if args.model in TINY_PRESETS else rundir.require_model_dir(args.model)
        rundir.prepare_output_dir(args.output_dir, base=base, resume=False, overwrite=args.overwrite)
        options, _ = options_from(args, (rundir.read_run_args(base) or {}) if base else {})
        train_records, dev_records, _ = read_data(args, options.columns)
        options = own_instructions(args, options, train_records)
        from chatglm_tune.tuning.training import check_fit
        from chatglm_tune.tuning.dry_run import dry_run as build_rows

        check_fit(args.model, base, options, [*train_records, *dev_records])
        build_rows(args.model, base, train_records, dev_records, Path(args.output_dir), options)
    except BaseException as e:  # Ctrl-C included: the directory was empty (or new) before, and is so again
        rundir.discard_unstarted(args.output_dir, made=made)
        if isinstance(e, (ValueError, FileNotFoundError)):
            return fail(e)
        if isinstance(e, KeyboardInterrupt):
            return interrupted(e, "during the dry run; nothing is left of it")
        raise
    return 0


def check(args):
    """(options, threads' origin, run record, train, dev and bad records) of a run to start or continue, checked before
    anything is loaded; None where `--resume auto` finds the run finished. The new run's directory is recorded."""
    from chatglm_tune.runs import rundir

    base = None if args.model in TINY_PRESETS else rundir.require_model_dir(args.model)
    first = int(os.environ.get("RANK", "0")) == 0  # of several processes, the first alone checks and writes the
    # directory: another would find what it records there (not empty) or empty it under it (--overwrite)
    rundir.prepare_output_dir(args.output_dir, base=base, resume=bool(args.resume) or not first,
                              overwrite=args.overwrite)
    options, threads_origin = options_from(args, (rundir.read_run_args(base) or {}) if base else {})
    train_records, dev_records, bad_records = read_data(args, options.columns)
    options = own_instructions(args, options, train_records)
    from chatglm_tune.tuning.training import check_fit  # here: the flags and data are checked without its imports

    check_fit(args.model, base, options, [*train_records, *dev_records])  # nothing is written yet
    record = rundir.run_record(args.model, options, args.train_file, args.dev_file)
    if args.resume == "auto":
        mode = rundir.auto_resume(args.output_dir, record)
        if mode == "finished":
            print(f"train.py: the run in {args.output_dir} has finished "
                  f"({rundir.final_summary(args.output_dir)['step']} steps): nothing to do")
            return None
        print(f"train.py: --resume auto: {AUTO_SAYS[mode]} in {args.output_dir}", file=sys.stderr)
        args.resume = mode == "resume"
    if args.resume:  # before anything is loaded or written
        rundir.check_resume(args.output_dir, record)
    elif first:
        rundir.discard_unstarted(args.output_dir)  # a restart: what this run's killed start wrote
        args.made_output_dir = not Path(args.output_dir).exists()
        rundir.record_start(args.output_dir, record, settings=run_settings(args), about=RUN_CONFIG_ABOUT)
    return options, threads_origin, record, train_records, dev_records, bad_records


RUN_CONFIG_ABOUT = ("The flags of this training run. It runs again, into a new directory, with\n"
                    "  chatglm-tune train --config THIS_FILE --output-dir NEW_DIR\n"
                    "(python train.py --config ... in a checkout): flags given there win over this file's.")


def run_settings(args) -> dict:
    """The flags that make this run, as a `--config` file holds them (the run's `run.yaml`): every flag given or
    defaulted to a value, but --resume, --overwrite and --dry-run (how it was started, not what it trains); the data
    files, the output directory and a model directory as absolute paths, so that the file runs from anywhere."""
    from chatglm_tune.cli.config import settings_of

    settings = settings_of(build_parser(), args, skip=("resume", "overwrite", "dry_run"))
    for key in ("train-file", "dev-file", "output-dir", *(() if args.model in TINY_PRESETS else ("model",))):
        if key in settings:
            settings[key] = os.path.abspath(settings[key])
    return settings


AUTO_SAYS = {"fresh": "starting the run", "restart": "starting again the run that saved no state",
             "resume": "continuing the run"}


def continue_command(argv) -> str:
    """The command line that continues this run: this one, with --resume auto."""
    import shlex

    given = list(sys.argv[1:] if argv is None else map(str, argv))
    if "--resume" in given:
        at = given.index("--resume")
        given[at:at + 1 + (given[at + 1:at + 2] == ["auto"])] = []
    return shlex.join([*cli.command_words("train.py", argv), *given, "--resume", "auto"])


def run(args, options, threads_origin, record, train_records, dev_records, bad_records, *, stop=None) -> int:
    """Load, train, and say where the model is."""
    import torch

    from chatglm_tune.evaluation.metrics import format_score
    from chatglm_tune.runs import rundir
    from chatglm_tune.runtime import heap
    from chatglm_tune.tuning.training import TrainingError, prepare_model, train

    try:
        if not torch.cuda.is_available():  # a default fitted to the cores free (the record keeps the preset's)
            from dataclasses import replace

            from chatglm_tune.runtime import cores

            threads, threads_origin = cores.fitted(options.threads, threads_origin)
            options = replace(options, threads=threads)
        model, tokenizer = prepare_model(args.model, train_records, args.output_dir, options)
        print(f"threads: {torch.get_num_threads()} ({threads_origin})")
        if options.dtype == "float16" and not torch.cuda.is_available():
            print("train.py: note: float16 on a CPU has no fast kernels (about 10x slower than float32) and overflows "
                  "easily: prefer float32 or bfloat16", file=sys.stderr)
        heap.mmap_large_blocks(model)
        summary = train(model, tokenizer, train_records, dev_records, args.output_dir, options,
                        record=record, resume=args.resume, bad_records=bad_records, stop=stop)
    except BaseException as e:  # also Ctrl-C, a library's assertion: what a new run that saved no state wrote goes
        if not args.resume:
            rundir.discard_unstarted(args.output_dir, made=getattr(args, "made_output_dir", False))
        if isinstance(e, (ValueError, FileNotFoundError, TrainingError)):
            return fail(e)
        raise
    score = "n/a" if summary["best_f1"] is None else format_score(summary["best_f1"], dev_records)
    print(f"done: {summary['step']} steps in {summary['seconds']}s, best dev score {score}, model in {args.output_dir}")
    return 0


def interrupted(interrupt: KeyboardInterrupt, what: str) -> int:
    """Say where the run stopped; its exit status (128 + the signal's number)."""
    from chatglm_tune.runtime.stopping import exit_status, signal_name

    print(f"train.py: interrupted by {signal_name(interrupt)} {what}", file=sys.stderr)
    return exit_status(interrupt)


def fail(error: Exception) -> int:
    print(f"train.py: error: {error}", file=sys.stderr)
    return 2


def exit_if_distributed(status: int) -> None:
    """After `main`, in a command line: a process of a distributed run ends here with `status`, without destructors
    (`training._keep`); any other returns (and exits as a program does)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    status = main()
    exit_if_distributed(status)
    sys.exit(status)
