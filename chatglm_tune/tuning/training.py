"""The training run: P-tuning v2, LoRA or full fine-tuning of ChatGLM in an Accelerator loop.

The loop is written out (no Trainer): AdamW, warmup then cosine or linear decay, gradient accumulation
through `accelerator.accumulate`, clipping, mixed precision, evaluation (dev loss and triple P/R/F1
from greedy generation) every epoch or every N steps, the best checkpoint by dev F1 published into
the run directory (`rundir`), and the state (trainable weights, optimizer, scheduler, RNG, step, data
position) saved through `accelerator.save_state` so `resume=True` continues a stopped run exactly.
Distribution is accelerate's (`accelerate launch`, DDP, DeepSpeed, FSDP): nothing here is home-made.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from chatglm_tune.runs import rundir
from chatglm_tune.runtime import crashpoints
from chatglm_tune.data.batches import (EncodedDataset, SpecialIds, collate_packed, collate_prompts, collate_train, pack,
                                       prompt_ids)
from chatglm_tune.decoding.generation import generate
from chatglm_tune.evaluation.metrics import describe_scores, score_answers
from chatglm_tune.evaluation.callmetrics import record_tools
from chatglm_tune.models import registry
from chatglm_tune.options import (EVALUATIONS, METHOD_DEFAULTS, TINY_CHAT_TEMPLATES, TINY_CONTEXT, TINY_PRESETS,
                                  EncodingOptions, TrainOptions, raise_problems)
from chatglm_tune.runs.loading import context_length, text_fields
from chatglm_tune.runtime.checkpoint import open_safetensors, read_config_file
from chatglm_tune.runtime.stopping import Stopped, StopRequest, signal_name


class LengthGroupedSampler(torch.utils.data.Sampler):
    """A shuffled order whose consecutive runs of `batch_size` rows have similar lengths.

    Each epoch: shuffle (seeded by `seed + epoch`), sort windows of `window` batches by length, cut
    into batches and shuffle the batches. Batches then pad to their own longest row, not to the
    longest of the set: a few long texts no longer make every batch long.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, window: int = 32):
        self.lengths, self.batch_size, self.seed, self.window = lengths, batch_size, seed, window
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        span = self.window * self.batch_size
        order = [i for s in range(0, len(order), span)
                 for i in sorted(order[s : s + span], key=lambda i: -self.lengths[i])]
        batches = [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        for b in torch.randperm(len(batches), generator=g).tolist():
            yield from batches[b]


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a non-finite loss); the last good checkpoint stays in place."""


def _has_accelerator() -> bool:
    """Whether torch sees a GPU (or another accelerator) here."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _check_launch(accelerator) -> None:
    """TrainingError where `accelerate launch` started several processes that accelerate does not join into one
    run: DeepSpeed on CPUs, for which it has no backend (DeepSpeed then sees every rank and accelerate one, and
    fails on the batch size); each process would otherwise train alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise TrainingError(f"{launched} processes were launched, but accelerate runs each alone "
                            f"({accelerator.distributed_type.value} on {accelerator.device.type}): DeepSpeed on CPUs "
                            "runs in one process (--num_processes 1); several CPU processes train with "
                            "configs/ddp.yaml or --multi_gpu --num_processes N (DDP over gloo; accelerate's --cpu "
                            "starts one process)")


class TrainingInterrupted(Stopped):
    """Ctrl-C, SIGTERM or SIGUSR1 (`signal_name`) during the loop, after the state of the last finished step (`step`)
    was saved for --resume."""

    def __init__(self, step: int, signal_name: str = "SIGINT"):
        super().__init__(signal_name, f"after step {step}")
        self.step = step


def build_tiny(train_records, output_dir: Path, options: TrainOptions, *, extra_texts=(), preset: str = "tiny",
               **config_overrides):
    """A small tokenizer (`tiny_tokenizer`) and a random tiny model of the preset's version for it:
    `options.tiny_layers` deep where given, with `config_overrides`."""
    context = max(TINY_CONTEXT, options.encoding.max_len)  # what the run trains on, its model serves
    version = registry.VERSIONS[TINY_PRESETS[preset]]
    depth = {version.layers_field: options.tiny_layers} if options.tiny_layers else {}
    model, tokenizer = version.tiny(tiny_corpus(train_records, options, extra_texts), Path(output_dir),
                                    context=context, chat_template_of=TINY_CHAT_TEMPLATES.get(preset),
                                    **{**depth, **config_overrides})
    return start_output_as_input(model), tokenizer


def tiny_tokenizer(train_records, output_dir: Path, options: TrainOptions, preset: str):
    """The tokenizer of `build_tiny`'s model alone (no weights): every character of the prompt and the training
    texts and answers (a conversation's every turn: system prompts, tools, reasoning, calls, observations; the GLM
    versions' also word pieces of the text outside CJK and digits, `TINY_WORD_PIECES`), written to `output_dir`."""
    version = registry.VERSIONS[TINY_PRESETS[preset]]
    return version.tiny_tokenizer(tiny_corpus(train_records, options), Path(output_dir),
                                  chat_template_of=TINY_CHAT_TEMPLATES.get(preset))


def tiny_corpus(train_records, options: TrainOptions, extra_texts=()) -> list[str]:
    """The texts a tiny tokenizer is trained on (`tiny_tokenizer`)."""
    corpus = ([options.encoding.prompt, *extra_texts] + [r.text for r in train_records]
              + [r.answer or "" for r in train_records])
    return corpus + [text for r in train_records if r.dialogue for text in r.dialogue.texts()]


def start_output_as_input(model):
    """`model` with its output layer starting as a copy of its embedding (not tied: each trains on its own, as the
    released GLM models have them; ChatGLM-6B's are one weight already). A token's embedding then already scores
    that token highest, so copying (an SPO span, a tool call's argument) starts aligned: a tiny ChatGLM3 learns to
    write tool calls exactly in fewer steps than with a random output layer (figures: bench/results/kernel-notes.md)."""
    model.get_output_embeddings().weight.data.copy_(model.get_input_embeddings().weight.data)
    return model


def optimizer_and_schedule(params, options: TrainOptions, total_steps: int):
    """AdamW over `params` and its warmup-then-decay schedule (`options.schedule`) over `total_steps`."""
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    factor = partial(_schedule_factor, options.schedule, int(options.warmup_ratio * total_steps), total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _schedule_factor(kind: str, warmup: int, total: int, step: int) -> float:
    """The learning rate's factor at `step`: linear from 0 over `warmup` steps, then down to 0 at `total`, in a
    straight line ("linear") or half a cosine ("cosine"), as transformers' `get_scheduler` computes them (not
    imported: it imports peft, ~4 s a process)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def check_fit(model_arg: str, base: Path | None, options: TrainOptions, records) -> None:
    """ValueError, before anything is loaded or written, where the run cannot go on `model_arg` (a tiny preset, or the
    model directory `base`): a record whose turns the version's prompt format has no form for (`check_turns`), packed
    rows for a version that takes none (`Version.packing_refusal`), a P-tuning prefix longer than the model's context
    (config.json's), or a LoRA rank above its hidden size (an adapter's rank is at most the width of the Linears it
    adapts; `--lora-r 1000000000` asked for half a terabyte)."""
    version = registry.VERSIONS[TINY_PRESETS[model_arg]] if model_arg in TINY_PRESETS else registry.of_directory(base)
    if options.packing and version.packing_refusal:
        raise ValueError(f"--packing: {version.packing_refusal}")
    prompt_format = version.prompt_format_of(base, chat_template_of=TINY_CHAT_TEMPLATES.get(model_arg))
    check_thinking(prompt_format, options.encoding, records)
    for record in records:
        check_turns(prompt_format, record, options.encoding)
    if base is None:
        return
    config = text_fields(read_config_file(base))
    problems = []
    context = context_length(config)
    if options.tuning == "ptuning" and context and options.pre_seq_len > context:
        problems.append(f"--pre-seq-len must be at most the model's context of {context} tokens ({base}), got "
                        f"{options.pre_seq_len}")
    hidden = config.get("hidden_size")
    if options.tuning == "lora" and hidden and options.lora.r > hidden:
        problems.append(f"--lora-r must be at most the model's hidden size {hidden} ({base}): a rank past the width of "
                        f"the Linears it adapts adds nothing; got {options.lora.r}")
    raise_problems(problems)


def check_turns(prompt_format, record, encoding: EncodingOptions = EncodingOptions()) -> None:
    """ValueError naming the record's file, line and field where `prompt_format` has no form for its conversation
    (`PromptFormat.check_pairs`: a version that chats in pairs; `check_turn`: reasoning, tools, calls, observations
    where the version has none; `check_dialogue`: thinking flags it cannot render as asked), found without a
    tokenizer."""
    prompt_format.check_pairs(record)
    for turn in record.dialogue.turns if record.dialogue is not None else ():
        try:
            prompt_format.check_turn(turn)
        except ValueError as err:
            raise ValueError(f"{record.source}, field {turn.where!r}: {err}") from None
    if record.dialogue is not None:
        try:
            prompt_format.check_dialogue(record.dialogue, encoding)
        except ValueError as err:
            raise ValueError(f"{record.source}: {err}") from None


def check_thinking(prompt_format, encoding: EncodingOptions, records) -> None:
    """ValueError where the run's thinking flags cannot apply: on a version without thinking, or on records that are
    not conversations (their prompts are rendered with thinking off) only; records' own flags likewise."""
    given = [name for name in ("enable_thinking", "clear_thinking") if getattr(encoding, name) is not None]
    own = next((r for r in records if r.dialogue is not None
                and (r.dialogue.enable_thinking is not None or r.dialogue.clear_thinking is not None)), None)
    if (given or own) and not prompt_format.has_thinking:
        what = f"--{given[0].replace('_', '-')}" if given else f"{own.source}'s enable_thinking / clear_thinking"
        raise ValueError(f"{what}: {prompt_format.title}'s chat has no thinking (GLM-4.5 / 4.6 / 4.7 and "
                         "GLM-4.7-Flash have)")
    why = prompt_format.effort_problem(encoding.reasoning_effort)
    if why:
        raise ValueError(f"--reasoning-effort {encoding.reasoning_effort}: {why}")
    if given and not any(r.dialogue is not None for r in records):
        raise ValueError(f"--{given[0].replace('_', '-')} applies to conversation records; these are not (their "
                         "prompts are rendered with thinking off)")


def prepare_model(model_arg: str, train_records, output_dir: Path, options: TrainOptions):
    """(model ready for `options.tuning`, tokenizer) from `--model tiny` or a model directory."""
    if options.threads:
        torch.set_num_threads(options.threads)
    set_seed(options.seed)  # fresh weights (tiny model, prefix encoder, LoRA) are seeded too
    if model_arg in TINY_PRESETS:
        if options.tuning != "full":
            raise ValueError(f"--model {model_arg} starts from random weights: train it with --tuning full first, "
                             "then P-tune or LoRA-tune the result with --model <that run>")
        model, tokenizer = build_tiny(train_records, output_dir, options, preset=model_arg)
    else:
        version = registry.of_directory(rundir.require_model_dir(model_arg))
        tokenizer = version.load_tokenizer(model_arg)
        prefix = dict(pre_seq_len=options.pre_seq_len, prefix_projection=options.prefix_projection)
        quantized = dict(quantization_bit=options.quantization_bit, group_size=0) if options.quantization_bit else {}
        model = version.load_model(model_arg, dtype=options.dtype, quantize_embedding=options.quantize_embedding,
                                   **quantized, **(prefix if options.tuning == "ptuning" else {}))
    if options.gradient_checkpointing:
        model.activation_checkpointing_enable()
        model.enable_input_require_grads()
    model = set_trainable(model, options)
    if options.compile:
        compile_layers(model, options.compile)
    return model, tokenizer


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes it declares unsplittable (`_no_split_modules`:
    ChatGLM-6B's GLMBlock, transformers' GlmDecoderLayer, Glm4MoeDecoderLayer, ...; read through peft's wrapper),
    the unit FSDP shards and `--compile` compiles."""
    names = set(model._no_split_modules or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def compile_layers(model, backend: str) -> int:
    """torch.compile each decoder layer in place (its weights and their names unchanged, so checkpoints save and
    load as without), shapes dynamic (rows of any length compile once); the number compiled."""
    layers = decoder_layers(model)
    if not layers:
        raise TrainingError(f"{type(model).__name__} declares no decoder layer class to compile")
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def set_trainable(model, options: TrainOptions):
    """The model with only what `options.tuning` trains left trainable: the prefix encoder (P-tuning v2,
    the official behaviour), LoRA adapters (returned wrapped by peft), or every weight (full)."""
    version = registry.of_config(model.config)
    if options.tuning == "lora":  # on the version's attention projections unless told otherwise
        from chatglm_tune.runs.lora import apply_lora  # here: peft takes ~4 s to import, which other runs never need

        return apply_lora(model, replace(options.lora, target=options.lora.target or version.lora_targets),
                          title=f"the {version.title}")
    model.requires_grad_(options.tuning == "full")
    if options.tuning == "ptuning":
        version.prefix_encoder(model).requires_grad_(True)
    return model


def train(model, tokenizer, train_records, dev_records, output_dir, options: TrainOptions, *,
          record: dict, resume: bool = False, bad_records: dict | None = None, stop: StopRequest | None = None) -> dict:
    """Run the loop; returns the final summary (also in metrics.jsonl). See the module docstring.

    `record`: the run's `run_args.json` (`rundir.run_record`); with `resume`, checked against the stopped
    run's (`rundir.check_resume`). Ctrl-C (or another stop signal, `stopping`) saves the state of the last finished
    step and raises `TrainingInterrupted`. `stop` (`stopping.signals_stop`'s): one process defers a signal that comes
    during a step to the step's end; several processes defer every signal and read them together after each step, so
    that all stop after the same step whichever got the signal."""
    output_dir = Path(output_dir)
    if not train_records:
        raise TrainingError("no training records: nothing to train on")
    accelerator = Accelerator(
        mixed_precision=options.mixed_precision, gradient_accumulation_steps=options.accumulation,
        log_with="tensorboard" if options.tensorboard else None, project_dir=str(output_dir),
        cpu=not _has_accelerator(),  # on a machine of CPUs only, several launched processes join over gloo (MULTI_CPU)
        step_scheduler_with_optimizer=False,  # one schedule step an optimizer step (accelerate's: one a process)
    )
    _check_launch(accelerator)
    set_seed(options.seed)
    dataset = EncodedDataset.from_records(train_records, tokenizer, options.encoding)
    loader = _train_loader(dataset, SpecialIds.of(tokenizer), options)
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / options.accumulation)
    total_steps = options.total_steps(steps_per_epoch)
    optimizer, scheduler = optimizer_and_schedule(params, options, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    _keep(accelerator, model)
    _keep_only_trainable_in_state(accelerator)

    if resume:
        progress = _resume(accelerator, output_dir, record)
    else:
        progress = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "best_f1": None, "best_loss": None, "since_best": 0}
        _start_run(accelerator, output_dir, record, dataset, bad_records)
    accelerator.print(start_summary(accelerator.unwrap_model(model), dataset, dev_records, bad_records, options,
                                    total_steps, steps_per_epoch * accelerator.num_processes * options.accumulation,
                                    tiny=record["model"] in TINY_PRESETS))
    if options.tensorboard:
        accelerator.init_trackers("tensorboard")
    started = time.time()
    finished: dict = {}  # the progress of the last finished optimizer step, kept up by _loop
    _finish(finished, progress, output_dir / "metrics.jsonl")
    try:
        _loop(accelerator, model, tokenizer, loader, optimizer, scheduler, params, dev_records, options, progress,
              total_steps, steps_per_epoch, output_dir, finished, stop)
    except KeyboardInterrupt as interrupt:  # save what the finished steps learned; a step under way is done again
        if finished["updating"]:  # a second signal cut a step in its weight update: the last saved state stands
            raise TrainingInterrupted(progress.get("state_step", 0), signal_name(interrupt)) from None
        if progress.get("state_step") != finished["step"]:  # not saved since that step ended
            _save_state(accelerator, output_dir, finished, log_bytes=finished["log_bytes"])
        _leave(accelerator)
        raise TrainingInterrupted(finished["step"], signal_name(interrupt)) from None
    summary = {"step": progress["step"], "best_f1": progress["best_f1"], "best_dev_loss": progress["best_loss"],
               "stopped_early": bool(progress.get("stopped_early")), "seconds": round(time.time() - started, 1)}
    _Log(accelerator, output_dir / "metrics.jsonl").write({"final": summary})
    if accelerator.is_main_process:
        from chatglm_tune.tuning.curves import plot_curves

        plot_curves(output_dir / "metrics.jsonl", output_dir / "loss_curve.png")
    accelerator.end_training()
    _leave(accelerator)
    return summary


def _train_loader(dataset, special: SpecialIds, options: TrainOptions) -> DataLoader:
    """Batches of `rows_per_batch` rows of similar lengths: examples, or with `packing` packed rows of up to max_len
    tokens (`batches.pack`, once; their order shuffled each epoch)."""
    rows, collate = list(dataset), partial(collate_train, special=special)
    lengths = [len(e.input_ids) for e in rows]
    if options.packing:
        groups = pack(lengths, options.encoding.max_len)
        rows, collate = [[dataset[i] for i in group] for group in groups], partial(collate_packed, special=special)
        lengths = [sum(len(e.input_ids) for e in row) for row in rows]
    sampler = LengthGroupedSampler(lengths, options.rows_per_batch, options.seed)
    # Its own generator: creating an iterator then draws no number from the global RNG (dropout's),
    # so a resumed run, which creates one more iterator, keeps the same dropout masks.
    return DataLoader(rows, batch_size=options.rows_per_batch, sampler=sampler, collate_fn=collate,
                      generator=torch.Generator().manual_seed(options.seed))


def _loop(accelerator, model, tokenizer, loader, optimizer, scheduler, params, dev_records, options, progress,
          total_steps, steps_per_epoch, output_dir, finished: dict, stop: StopRequest | None = None) -> None:
    """Optimizer steps until `total_steps`: log the mean loss of each logging window, evaluate, save.
    `finished` is kept equal to `progress` as it stood after the last optimizer step (and its saves)."""
    log = _Log(accelerator, output_dir / "metrics.jsonl")
    after_step = partial(_after_step, accelerator, model, tokenizer, dev_records, options, progress, log, output_dir)
    with tqdm(total=total_steps, initial=progress["step"], disable=not accelerator.is_local_main_process,
              desc="train") as bar:
        eval_due = options.eval_every or max(1, total_steps // EVALUATIONS)
        # losses since the last log
        window = [torch.tensor(x, device=accelerator.device) for x in progress.get("window", [])]
        if progress.get("eval_pending") and after_step(bar):  # stopped during the evaluation of its last step
            return
        model.train()
        while progress["step"] < total_steps and not progress.get("stopped_early"):
            batches = loader
            if progress["batches_in_epoch"]:  # resuming mid-epoch
                batches = accelerator.skip_first_batches(loader, progress["batches_in_epoch"])
            batches.set_epoch(progress["epoch"])  # accelerate's loaders pass it on to the sampler
            for batch in batches:
                _step_under_way(accelerator, stop)
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    _check_finite(accelerator, loss, progress, output_dir)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and options.max_grad_norm:
                        accelerator.clip_grad_norm_(params, options.max_grad_norm)
                    finished["updating"] = accelerator.sync_gradients  # the weights change: the step is not undone
                    optimizer.step()
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:  # fp16 overflow
                        scheduler.step()
                    optimizer.zero_grad()
                progress["batches_in_epoch"] += 1
                window.append(loss.detach())
                crashpoints.reached("micro-batch")
                if not accelerator.sync_gradients:
                    continue
                progress["step"] += 1
                step = progress["step"]
                bar.update(1)
                if step % options.log_every == 0 or step == total_steps:
                    mean = accelerator.gather(torch.stack(window).mean()[None]).mean().item()
                    window.clear()
                    lr = scheduler.get_last_lr()[0]
                    bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")
                    log.write({"step": step, "epoch": progress["epoch"], "loss": mean, "lr": lr})
                progress.update(window=list(window), eval_pending=step % eval_due == 0 or step == total_steps)
                _finish(finished, progress, log.path)
                crashpoints.reached("train-step")
                _stop_if_asked(accelerator, stop)
                if after_step(bar):
                    break
                _finish(finished, progress, log.path)
                _stop_if_asked(accelerator, stop, collective=True)
                if step >= total_steps:
                    break
            else:
                progress["epoch"] += 1
                progress["batches_in_epoch"] = 0
                _finish(finished, progress, log.path)


def _after_step(accelerator, model, tokenizer, dev_records, options, progress, log, output_dir, bar) -> bool:
    """The evaluation due after the step `progress` stands at (`eval_pending`), or the save due; True where the run
    stops early."""
    if progress.get("eval_pending"):
        _evaluate_and_publish(accelerator, model, tokenizer, dev_records, options, progress, log, output_dir, bar)
        model.train()
        if progress.get("stopped_early"):
            bar.write(f"step {progress['step']}: no better dev checkpoint in {options.patience} evaluations, stopping "
                      "early")
            return True
    elif options.save_every and progress["step"] % options.save_every == 0:
        _save_state(accelerator, output_dir, progress)
    return False


def _finish(finished: dict, progress: dict, log: Path) -> None:
    """`finished` := `progress` as it stands after a step, with the log's length then: what a stop saves (the lines
    logged after it are logged again by the resumed run)."""
    finished.update(progress, log_bytes=log.stat().st_size if log.exists() else 0, updating=False)


def _step_under_way(accelerator, stop: StopRequest | None) -> None:
    """A micro-batch begins: on one process, a stop signal now waits for the step's end (`_stop_if_asked`), so that
    no step is cut between its weight update and its count."""
    if stop is not None and accelerator.num_processes == 1:
        stop.deferring = True


_KEPT: list = []  # (accelerator, DDP model) of each distributed run of this process: never freed (`_keep`)


def _keep(accelerator, model) -> None:
    """Several processes: the accelerator and its DDP model are kept to the end of the process, which train.py ends
    without running destructors. Freeing a DDP model's reducer joins a gloo thread that may be waiting for the
    interpreter lock its freer holds: the process would hang at the end of a finished run."""
    if accelerator.num_processes > 1:
        _KEPT.append((accelerator, model))


def _leave(accelerator) -> None:
    """Several processes: all wait for each other and take their process group down together."""
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():  # end_training may have taken it down
        accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()


def _stop_if_asked(accelerator, stop: StopRequest | None, *, collective: bool = False) -> None:
    """At a step's end: raise `Stopped` where a stop signal came meanwhile, and take signals as they come until the
    next step begins (one process). Several processes check only where `collective` (after the step's evaluation):
    then all of them raise once any has received one, after the same step."""
    if stop is None:
        return
    if accelerator.num_processes == 1:
        stop.deferring = False
        if stop.signal_name:
            name, stop.signal_name = stop.signal_name, None
            raise Stopped(name)
        return
    if not collective:
        return
    number = torch.tensor([int(getattr(signal, stop.signal_name)) if stop.signal_name else 0],
                          device=accelerator.device)
    number = int(accelerator.gather(number).max().item())
    if number:
        raise Stopped(signal.Signals(number).name)


def _start_run(accelerator, output_dir: Path, run_args: dict, dataset, bad_records) -> None:
    """A new run directory: an empty log, the run's arguments and its data report."""
    if not accelerator.is_main_process:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.jsonl").write_text("")
    rundir.write_run_args(output_dir, run_args)
    report = {"truncation": dataset.truncation_counts(), "bad_records": bad_records or {}}
    (output_dir / "data_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))


def start_summary(model, dataset, dev_records, bad_records: dict | None, options: TrainOptions, total_steps: int,
                  batches_per_epoch: int, *, tiny: bool = False) -> str:
    """The lines printed before the first step: data, truncation, trainable parameters, steps, stopping;
    and, for a real model, the method's defaults for real models (a tiny demo has its own)."""
    skipped = {k: (v or {}).get("skipped", 0) for k, v in (bad_records or {}).items()}
    cut = dataset.truncation_counts()
    trainable, total = parameter_counts(model)
    epochs = total_steps * options.accumulation / max(batches_per_epoch, 1)
    accumulated = f" x {options.accumulation} accumulated" if options.accumulation > 1 else ""
    packed = f"packed (examples together, up to {options.encoding.max_len} tokens) " if options.packing else ""
    stopping = (f"after {options.patience} evaluations without a better dev checkpoint" if options.patience
                and dev_records else "off")
    method = ", ".join(f"{k} {v:g}" for k, v in METHOD_DEFAULTS[options.tuning].items())
    return "\n".join([
        f"data: {len(dataset)} training records ({skipped.get('train', 0)} skipped), {len(dev_records)} dev records "
        f"({skipped.get('dev', 0)} skipped)",
        f"truncated: {cut['source_truncated']} texts longer than max_src_len={options.encoding.max_src_len}, "
        f"{cut['answer_truncated']} answers longer than max_len-max_src_len={options.encoding.answer_budget}"
        + (f", {cut['row_truncated']} conversations cut at max_len={options.encoding.max_len}"
           if cut["row_truncated"] else ""),
        f"model: {options.tuning}, {trainable:,} of {total:,} parameters trainable"
        + (f"; decoder layers compiled ({options.compile})" if options.compile else ""),
        f"steps: {total_steps} optimizer steps (~{epochs:.1f} epochs of {batches_per_epoch} batches) of "
        f"{options.rows_per_batch} {packed}rows{accumulated}, lr {options.learning_rate:g} {options.schedule}; early "
        f"stopping {stopping}",
        *([] if tiny
          else [f"defaults of {options.tuning} for real models (the official scripts; flags override): {method}"]),
    ])


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters, an INT8/INT4 weight counted as the float weight it stands for (INT4
    packs two values a byte; its scales are not counted): a QLoRA run reads as the same model in float."""
    from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear

    stand_in = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            stand_in[id(module.weight)] = module.out_features * module.in_features
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            stand_in[id(module.weight_scale)] = 0
    counts = [(p.requires_grad, stand_in.get(id(p), p.numel())) for p in model.parameters()]
    return sum(n for trains, n in counts if trains), sum(n for _, n in counts)


def evaluate(model, tokenizer, records, options: TrainOptions, accelerator: Accelerator | None = None) -> dict:
    """Dev loss and the scores of greedy generations (`score_answers`: triple P/R/F1, or text metrics and tool
    calls; records split over the processes)."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    special, prompt_format = SpecialIds.of(tokenizer), tokenizer.prompt_format
    mine = records[rank::world]
    enc = options.encoding
    losses, generated = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(mine), options.eval_batch_size):
            chunk = mine[start : start + options.eval_batch_size]
            batch = collate_train(EncodedDataset.from_records(chunk, tokenizer, enc).examples, special)
            device = next(model.parameters()).device
            losses.append(model(**{k: v.to(device) for k, v in batch.items()}).loss.item() * len(chunk))
            prompts = collate_prompts([prompt_ids(r, tokenizer, enc) for r in chunk], special)
            new = generate(model, prompts["input_ids"], prompts["attention_mask"], max_new_tokens=enc.answer_budget,
                           eos_token_id=prompt_format.stop_ids(tokenizer), vocab_limit=len(tokenizer))
            generated += [prompt_format.decode_answer(tokenizer, ids) for ids in new]
    indexed = list(zip(range(rank, len(records), world), generated))
    loss_sum = sum(losses)
    if accelerator is not None and world > 1:
        from accelerate.utils import gather_object

        indexed = gather_object(indexed)
        # NCCL: GPU tensors
        loss_sum = accelerator.reduce(torch.tensor(loss_sum, device=accelerator.device), reduction="sum").item()
    texts = [text for _, text in sorted(indexed)]
    calls = [prompt_format.read_calls(text, record_tools(record)) for text, record in zip(texts, records)]
    return {"dev_loss": loss_sum / max(len(records), 1), **score_answers(texts, records, calls)}


def _evaluate_and_publish(accelerator, model, tokenizer, dev_records, options, progress, log, output_dir, bar):
    unwrapped = accelerator.unwrap_model(model)
    improved = True
    if dev_records:
        scores = evaluate(unwrapped, tokenizer, dev_records, options, accelerator)
        f1, loss = scores["score"], scores["dev_loss"]
        improved = is_better(f1, loss, progress["best_f1"], progress["best_loss"])
        progress["since_best"] = 0 if improved else progress["since_best"] + 1
        if improved:
            progress["best_f1"], progress["best_loss"] = f1, loss
        progress["stopped_early"] = bool(options.patience and progress["since_best"] >= options.patience)
        log.write({"step": progress["step"], "epoch": progress["epoch"], "eval": scores})
        if accelerator.is_local_main_process:  # on its own line above the progress bar
            bar.write(f"step {progress['step']}: dev loss {scores['dev_loss']:.4f}, {describe_scores(scores)}")
    if improved and accelerator.is_main_process:
        rundir.save_trained(unwrapped, tokenizer, output_dir, options.tuning)
    progress["eval_pending"] = False
    _save_state(accelerator, output_dir, progress)


def _save_state(accelerator, output_dir, progress, log_bytes: int | None = None) -> None:
    """accelerate's state and `progress` in `state/`, swapped in whole, then `progress["state_step"]` set. It records
    how long metrics.jsonl was (`log_bytes`, else its length now), so that a resumed run's log continues from there (no
    line logged twice, no torn last line)."""
    log = Path(output_dir) / "metrics.jsonl"
    log_bytes = log_bytes if log_bytes is not None else log.stat().st_size if log.exists() else 0
    saved = {**{k: v for k, v in progress.items() if k != "updating"},
             "window": [float(x) for x in progress.get("window", [])], "state_step": progress["step"],
             "log_bytes": log_bytes}

    def write(tmp):
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            (Path(tmp) / "progress.json").write_text(json.dumps(saved))

    if accelerator.num_processes == 1:
        rundir.replace_dir(write, output_dir / rundir.STATE_DIR)
    else:  # several processes write one state directory; the main process swaps it in once all are done
        tmp = output_dir / rundir.SHARED_STATE_TMP  # not replace_dir's own temporary name
        write(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            rundir.replace_dir(lambda t: tmp.rename(t), output_dir / rundir.STATE_DIR)
        accelerator.wait_for_everyone()
    progress["state_step"] = progress["step"]


def is_better(f1: float, loss: float, best_f1: float | None, best_loss: float | None) -> bool:
    """A checkpoint beats the best so far on its dev score (micro-F1; the tool-call exact match of a dev set of
    calls; ROUGE-L for free-text answers), a tie (all 0.0 early on, say) on lower dev loss."""
    return best_f1 is None or f1 > best_f1 or (f1 == best_f1 and loss < best_loss)


def _keep_only_trainable_in_state(accelerator) -> None:
    """accelerate's `save_state` writes every weight of the model: at 6B, the whole frozen base at every
    evaluation of a P-tuning or LoRA run. Keep only the trainable weights in `state/` (the rest is the
    base, which --resume loads again), and load them back checking that exactly those came back.
    FSDP and DeepSpeed save their own shards (`weights` is then empty) and are left to accelerate."""

    def trainable_names(model) -> set[str]:
        return {name for name, p in model.named_parameters() if p.requires_grad}

    def save(models, weights, output_dir) -> None:
        for i, (model, state) in enumerate(zip(models, weights)):
            keep = trainable_names(model)
            weights[i] = {k: v for k, v in state.items() if k in keep}

    def load(models, input_dir) -> None:
        for i, model in enumerate(models):
            file = Path(input_dir) / (f"model_{i}.safetensors" if i else "model.safetensors")
            with open_safetensors(file, device=str(next(model.parameters()).device)) as f:
                state = {key: f.get_tensor(key) for key in f.keys()}
            if set(state) != trainable_names(model):
                raise TrainingError(f"{file} does not hold this run's trainable weights: the model was built otherwise")
            model.load_state_dict(state, strict=False)
        models.clear()  # loaded: accelerate must not look for whole-model files

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _resume(accelerator, output_dir, record) -> dict:
    rundir.check_resume(output_dir, record)
    if accelerator.is_main_process:
        rundir.remove_leftovers(output_dir)
    accelerator.wait_for_everyone()
    state = rundir.state_dir(output_dir)
    accelerator.load_state(str(state))
    progress = {"best_loss": None, "since_best": 0, **json.loads((state / "progress.json").read_text())}
    log = Path(output_dir) / "metrics.jsonl"
    if (accelerator.is_main_process and "log_bytes" in progress and log.exists()
        and log.stat().st_size > progress["log_bytes"]):
        with open(log, "r+b") as f:  # what was logged after the state was saved is logged again from here
            f.truncate(progress["log_bytes"])
    accelerator.print(f"resuming {output_dir} at step {progress['step']} (epoch {progress['epoch']})")
    return progress


def _check_finite(accelerator, loss, progress, output_dir) -> None:
    if bool(torch.isfinite(accelerator.gather(loss.detach()[None])).all()):
        return
    state = rundir.state_dir(output_dir)
    kept = (f"The last good checkpoint is in {output_dir}" if rundir.has_trained_model(output_dir) else
            "No checkpoint was written yet")
    kept += (f" (and its state of step {json.loads((state / 'progress.json').read_text())['step']} for --resume)"
             if state else "")
    raise TrainingError(
        f"the loss became {loss.item()} at step {progress['step'] + 1} (epoch {progress['epoch']}); the run stopped. "
        f"{kept}. Lower the learning rate; in half precision (--dtype float16, --mixed-precision fp16) use bfloat16 "
        "or float32 instead."
    )


class _Log:
    """metrics.jsonl (and TensorBoard scalars when enabled), written by the main process."""

    def __init__(self, accelerator, path: Path):
        self.accelerator, self.path = accelerator, path

    def write(self, entry: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        crashpoints.reached("log")
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        if "loss" in entry:
            self.accelerator.log({"train/loss": entry["loss"], "train/lr": entry["lr"]}, step=entry["step"])
        if "eval" in entry:
            self.accelerator.log({"dev/score": entry["eval"]["score"], "dev/loss": entry["eval"]["dev_loss"]},
                                 step=entry["step"])
