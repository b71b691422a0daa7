"""The training run: P-tuning v2, LoRA or full fine-tuning of ChatGLM in an Accelerator loop.

The loop is written out (no Trainer): AdamW, warmup then cosine or linear decay, gradient accumulation
through `accelerator.accumulate`, clipping, mixed precision, evaluation (dev loss and triple P/R/F1
from greedy generation) every epoch or every N steps, the best checkpoint by dev F1 published into
the run directory (`rundir`), and the full state (optimizer, scheduler, RNG, step, data position)
saved through `accelerator.save_state` so `resume=True` continues a stopped run exactly.
Distribution is accelerate's (`accelerate launch`, DDP, DeepSpeed, FSDP): nothing here is home-made.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from . import rundir
from .config import ChatGLMConfig
from .data import EncodedDataset, EncodingOptions, SpecialIds, collate_prompts, collate_train, prompt_ids
from .generation import generate
from .lora import LoraOptions, apply_lora
from .metrics import SPOScorer
from .model import ChatGLMForConditionalGeneration
from .tokenizer import ChatGLMTokenizer, train_tokenizer

TUNINGS = ("ptuning", "lora", "full")
# Learning rates: P-tuning v2 as the official train.sh, full fine-tuning as its DeepSpeed script.
DEFAULT_LR = {"ptuning": 2e-2, "lora": 2e-4, "full": 1e-4}


@dataclass(frozen=True)
class TrainOptions:
    """Every training option and its default (train.py builds its flags from this class)."""

    tuning: str = "ptuning"
    pre_seq_len: int = 128
    prefix_projection: bool = False
    lora: LoraOptions = field(default_factory=LoraOptions)
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    lr: float | None = None  # None: DEFAULT_LR of the tuning
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    dtype: str = "float32"
    quantization_bit: int = 0
    quantize_embedding: bool = False  # the frozen tied embedding / head as one INT8 copy
    gradient_checkpointing: bool = False
    seed: int = 42
    eval_every: int | None = None  # steps; None = once an epoch
    save_every: int | None = None  # steps; the state is also saved at each evaluation and at the end
    eval_batch_size: int = 32
    log_every: int = 10
    tensorboard: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default

    def __post_init__(self):
        problems = []
        if self.tuning not in TUNINGS:
            problems.append(f"tuning must be one of {', '.join(TUNINGS)}, got {self.tuning!r}")
        if self.schedule not in ("cosine", "linear"):
            problems.append(f"schedule must be cosine or linear, got {self.schedule!r}")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            problems.append(f"mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.quantization_bit not in (0, 4, 8):
            problems.append(f"quantization_bit must be 0, 4 or 8, got {self.quantization_bit}")
        if self.quantization_bit and self.tuning == "full":
            problems.append("full fine-tuning cannot update INT8/INT4 weights: use ptuning or lora on a quantized base")
        if self.quantize_embedding and self.tuning == "full":
            problems.append("full fine-tuning trains the embedding: quantize_embedding is for ptuning or lora")
        for name in ("epochs", "batch_size", "grad_accum", "pre_seq_len", "eval_batch_size", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.tuning]


# The from-scratch demo: `--model tiny --tuning full` with no other flag trains with these. Its
# tokenizer is character-level, so an answer of three triples is ~45 tokens: the answer budget
# (max_len - max_src_len) is 80 instead of the 32 that suit ChatGLM-6B's word-level vocabulary.
# lr 2e-3: dev F1 0.935 / 0.926 for seeds 42 / 43, against 0.906 / 0.939 at 3e-3 (0.877 on two threads)
# and 0.80 at 5e-3: the steadier rate. Two threads: 255 s of training on the two cores of a quiet
# machine, against ~300 s on one (on a shared machine, --threads 1: OpenMP threads that outnumber the
# free cores slow the tiny model down tenfold).
TINY_DEMO = dict(epochs=5, batch_size=16, lr=2e-3, warmup_ratio=0.03, weight_decay=0.01, max_src_len=160, max_len=240,
                 threads=2)


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
        order = [i for s in range(0, len(order), span) for i in sorted(order[s : s + span], key=lambda i: -self.lengths[i])]
        batches = [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        for b in torch.randperm(len(batches), generator=g).tolist():
            yield from batches[b]


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a non-finite loss); the last good checkpoint stays in place."""


def build_tiny(train_records, output_dir: Path, options: TrainOptions, *, extra_texts=(), **config_overrides):
    """A tokenizer trained on the prompt, `extra_texts` and the training texts and answers, and a random
    tiny model (the preset, with `config_overrides`) for it."""
    tokenizer_dir = Path(output_dir)
    if (tokenizer_dir / "tokenizer_config.json").exists():  # a resumed run keeps its tokenizer
        tokenizer = ChatGLMTokenizer.from_pretrained(tokenizer_dir)
    else:
        corpus = [options.encoding.prompt, *extra_texts] + [r.text for r in train_records] + [r.answer or "" for r in train_records]
        tokenizer = train_tokenizer(corpus, tokenizer_dir, max_piece_length=1)  # character-level: see train_tokenizer
    config = ChatGLMConfig.from_name("tiny", **config_overrides, **tokenizer.config_overrides())
    return ChatGLMForConditionalGeneration(config), tokenizer


def optimizer_and_schedule(params, options: TrainOptions, total_steps: int):
    """AdamW over `params` and its warmup-then-decay schedule (`options.schedule`) over `total_steps`."""
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    scheduler = get_scheduler(options.schedule, optimizer, num_warmup_steps=int(options.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    return optimizer, scheduler


def prepare_model(model_arg: str, train_records, output_dir: Path, options: TrainOptions):
    """(model ready for `options.tuning`, tokenizer) from `--model tiny` or a model directory."""
    if options.threads:
        torch.set_num_threads(options.threads)
    set_seed(options.seed)  # fresh weights (tiny model, prefix encoder, LoRA) are seeded too
    if model_arg == "tiny":
        if options.tuning != "full":
            raise ValueError("--model tiny starts from random weights: train it with --tuning full first, "
                             "then P-tune or LoRA-tune the result with --model <that run>")
        model, tokenizer = build_tiny(train_records, output_dir, options)
    else:
        tokenizer = ChatGLMTokenizer.from_pretrained(model_arg)
        prefix = dict(pre_seq_len=options.pre_seq_len, prefix_projection=options.prefix_projection)
        model = ChatGLMForConditionalGeneration.from_pretrained(
            model_arg, dtype=options.dtype, quantization_bit=options.quantization_bit or None,
            quantize_embedding=options.quantize_embedding,
            **(prefix if options.tuning == "ptuning" else {}),
        )
    if options.gradient_checkpointing:
        model.activation_checkpointing_enable()
        model.enable_input_require_grads()
    if options.tuning == "lora":
        model = apply_lora(model, options.lora)
    elif options.tuning == "full":
        model.requires_grad_(True)
    return model, tokenizer


def train(model, tokenizer, train_records, dev_records, output_dir, options: TrainOptions, *,
          model_arg: str, resume: bool = False, bad_records: dict | None = None) -> dict:
    """Run the loop; returns the final summary (also in metrics.jsonl). See the module docstring."""
    output_dir = Path(output_dir)
    accelerator = Accelerator(
        mixed_precision=options.mixed_precision, gradient_accumulation_steps=options.grad_accum,
        log_with="tensorboard" if options.tensorboard else None, project_dir=str(output_dir),
    )
    set_seed(options.seed)
    special = SpecialIds.from_tokenizer(tokenizer)
    dataset = EncodedDataset.from_records(train_records, tokenizer, options.encoding)
    sampler = LengthGroupedSampler([len(e.input_ids) for e in dataset], options.batch_size, options.seed)
    # Its own generator: creating an iterator then draws no number from the global RNG (dropout's),
    # so a resumed run, which creates one more iterator, keeps the same dropout masks.
    loader = DataLoader(dataset, batch_size=options.batch_size, sampler=sampler, collate_fn=partial(collate_train, special=special),
                        generator=torch.Generator().manual_seed(options.seed))
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / options.grad_accum)
    total_steps = options.max_steps or options.epochs * steps_per_epoch
    optimizer, scheduler = optimizer_and_schedule(params, options, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    run_args = {"model": model_arg if model_arg == "tiny" else str(Path(model_arg).resolve()), **_plain(options)}
    progress = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "best_f1": None}
    if resume:
        progress = _resume(accelerator, output_dir, run_args)
    elif accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").write_text("")
        rundir.write_run_args(output_dir, run_args)
        report = {"truncation": dataset.truncation_counts(), "bad_records": bad_records or {}}
        (output_dir / "data_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    if options.tensorboard:
        accelerator.init_trackers("tensorboard")

    log = _Log(accelerator, output_dir / "metrics.jsonl")
    bar = tqdm(total=total_steps, initial=progress["step"], disable=not accelerator.is_local_main_process, desc="train")
    eval_due = options.eval_every or steps_per_epoch
    window, started = [], time.time()
    model.train()
    while progress["step"] < total_steps:
        batches = loader
        if progress["batches_in_epoch"]:  # resuming mid-epoch
            batches = accelerator.skip_first_batches(loader, progress["batches_in_epoch"])
        batches.set_epoch(progress["epoch"])  # accelerate's loaders pass it on to the sampler
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                _check_finite(accelerator, loss, progress, output_dir)
                accelerator.backward(loss)
                if accelerator.sync_gradients and options.max_grad_norm:
                    accelerator.clip_grad_norm_(params, options.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress["batches_in_epoch"] += 1
            window.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            progress["step"] += 1
            step = progress["step"]
            bar.update(1)
            if step % options.log_every == 0 or step == total_steps:
                mean = accelerator.gather(torch.stack(window).mean()[None]).mean().item()
                lr = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")
                log.write({"step": step, "epoch": progress["epoch"], "loss": mean, "lr": lr})
            window.clear()
            if step % eval_due == 0 or step == total_steps:
                _evaluate_and_publish(accelerator, model, tokenizer, dev_records, options, progress, log, output_dir)
                model.train()
            elif options.save_every and step % options.save_every == 0:
                _save_state(accelerator, output_dir, progress)
            if step >= total_steps:
                break
        else:
            progress["epoch"] += 1
            progress["batches_in_epoch"] = 0
    bar.close()
    summary = {"step": progress["step"], "best_f1": progress["best_f1"], "seconds": round(time.time() - started, 1)}
    log.write({"final": summary})
    if accelerator.is_main_process:
        from .curves import plot_curves

        plot_curves(output_dir / "metrics.jsonl", output_dir / "loss_curve.png")
    accelerator.end_training()
    return summary


def evaluate(model, tokenizer, records, options: TrainOptions, accelerator: Accelerator | None = None) -> dict:
    """Dev loss and triple P/R/F1 of greedy generations (records split over the processes)."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    special = SpecialIds.from_tokenizer(tokenizer)
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
            new = generate(model, prompts["input_ids"], prompts["attention_mask"], max_new_tokens=enc.max_len - enc.max_src_len,
                           vocab_limit=len(tokenizer))
            generated += [tokenizer.decode(ids) for ids in new]
    indexed = list(zip(range(rank, len(records), world), generated))
    loss_sum = sum(losses)
    if accelerator is not None and world > 1:
        from accelerate.utils import gather_object

        indexed = gather_object(indexed)
        loss_sum = accelerator.reduce(torch.tensor(loss_sum), reduction="sum").item()
    scorer = SPOScorer()
    for i, text in sorted(indexed):
        scorer.add(text, records[i].triples)
    return {"dev_loss": loss_sum / max(len(records), 1), **scorer.result().to_dict()}


def _evaluate_and_publish(accelerator, model, tokenizer, dev_records, options, progress, log, output_dir):
    unwrapped = accelerator.unwrap_model(model)
    improved = True
    if dev_records:
        scores = evaluate(unwrapped, tokenizer, dev_records, options, accelerator)
        f1 = scores["micro"]["f1"]
        improved = progress["best_f1"] is None or f1 > progress["best_f1"]
        if improved:
            progress["best_f1"] = f1
        log.write({"step": progress["step"], "epoch": progress["epoch"], "eval": scores})
        accelerator.print(f"step {progress['step']}: dev loss {scores['dev_loss']:.4f}, "
                          f"P/R/F1 {scores['micro']['precision']:.3f}/{scores['micro']['recall']:.3f}/{f1:.3f}")
    if improved and accelerator.is_main_process:
        rundir.save_trained(unwrapped, tokenizer, output_dir, options.tuning)
    _save_state(accelerator, output_dir, progress)


def _save_state(accelerator, output_dir, progress) -> None:
    def write(tmp):
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            (Path(tmp) / "progress.json").write_text(json.dumps(progress))

    if accelerator.num_processes == 1:
        rundir.replace_dir(write, output_dir / rundir.STATE_DIR)
        return
    # Several processes write one state directory; the main process swaps it in once all are done.
    tmp = output_dir / f".{rundir.STATE_DIR}.tmp"
    write(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        rundir.replace_dir(lambda t: tmp.rename(t), output_dir / rundir.STATE_DIR)
    accelerator.wait_for_everyone()


def _resume(accelerator, output_dir, run_args) -> dict:
    saved_args = rundir.read_run_args(output_dir)
    state = rundir.state_dir(output_dir)
    if saved_args is None or state is None:
        raise TrainingError(f"{output_dir}: nothing to resume (no {rundir.RUN_ARGS} or {rundir.STATE_DIR}/)")
    changed = {k for k in run_args if k not in ("epochs", "max_steps") and saved_args.get(k) != run_args[k]}
    if changed:
        raise TrainingError(f"--resume with options that differ from the stopped run: {', '.join(sorted(changed))}")
    accelerator.load_state(str(state))
    progress = json.loads((state / "progress.json").read_text())
    accelerator.print(f"resuming {output_dir} at step {progress['step']} (epoch {progress['epoch']})")
    return progress


def _check_finite(accelerator, loss, progress, output_dir) -> None:
    if bool(torch.isfinite(accelerator.gather(loss.detach()[None])).all()):
        return
    raise TrainingError(
        f"the loss became {loss.item()} at step {progress['step'] + 1} (epoch {progress['epoch']}); the run stopped. "
        f"The last good checkpoint is in {output_dir} (and its state/ for --resume). "
        "Lower the learning rate, or use bf16 instead of fp16."
    )


def _plain(options: TrainOptions) -> dict:
    """The options as JSON-ready values (the record of the run, checked on --resume)."""
    out = asdict(options)
    out["lora"]["target"] = list(out["lora"]["target"])
    return out


class _Log:
    """metrics.jsonl (and TensorBoard scalars when enabled), written by the main process."""

    def __init__(self, accelerator, path: Path):
        self.accelerator, self.path = accelerator, path

    def write(self, entry: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        if "loss" in entry:
            self.accelerator.log({"train/loss": entry["loss"], "train/lr": entry["lr"]}, step=entry["step"])
        if "eval" in entry:
            self.accelerator.log({"dev/f1": entry["eval"]["micro"]["f1"], "dev/loss": entry["eval"]["dev_loss"]}, step=entry["step"])
