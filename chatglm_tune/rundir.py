"""A training run's output directory: what it holds, how it is written, how it is loaded back.

    <run>/config.json, model.safetensors         full fine-tuning: the whole model
    <run>/config.json, model.safetensors         P-tuning v2: config with pre_seq_len, prefix weights only
    <run>/adapter_config.json, adapter_model.*   LoRA: a peft adapter directory
    <run>/ice_text.model, tokenizer_config.json  the tokenizer
    <run>/run_args.json                          the run's options; `model` names the base it tuned
    <run>/metrics.jsonl, loss_curve.png          training log
    <run>/state/                                 full training state (accelerate) for --resume

The model files at the top are the best checkpoint by dev F1 (the last one without a dev file). Each
file is written to a temporary directory first and renamed into place, so a crash while saving
leaves the previous checkpoint loadable. `load_run` turns such a directory (or a plain model
directory) into a model ready for inference.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .checkpoint import atomic_write

RUN_ARGS = "run_args.json"
ADAPTER_CONFIG = "adapter_config.json"
STATE_DIR = "state"


def write_run_args(directory: Path, args: dict) -> None:
    atomic_write(Path(directory) / RUN_ARGS, lambda p: Path(p).write_text(json.dumps(args, indent=2, ensure_ascii=False)))


def read_run_args(directory: Path) -> dict | None:
    path = Path(directory) / RUN_ARGS
    return json.loads(path.read_text()) if path.exists() else None


def publish(write, directory: Path) -> None:
    """Run `write(tmp_dir)`, then move each file it wrote into `directory`, one atomic rename each."""
    directory = Path(directory)
    tmp = directory / ".publishing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    for file in sorted(tmp.iterdir()):
        os.replace(file, directory / file.name)
    tmp.rmdir()


def save_trained(model, tokenizer, directory: Path, tuning: str) -> None:
    """Publish what `tuning` trained: the whole model, the prefix encoder, or the LoRA adapter."""

    def write(tmp: Path) -> None:
        if tuning == "lora":
            model.save_pretrained(tmp)
        elif tuning == "ptuning":
            prefix = {k: v for k, v in model.state_dict().items() if k.startswith("transformer.prefix_encoder.")}
            model.save_pretrained(tmp, state_dict=prefix)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for extra in ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
            (tmp / extra).unlink(missing_ok=True)

    publish(write, directory)


def replace_dir(write, target: Path) -> None:
    """Write a whole directory (e.g. accelerate's state) beside `target`, then swap it in."""
    target = Path(target)
    tmp, old = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def state_dir(run: Path) -> Path | None:
    """The saved training state, also after a crash between the two renames of `replace_dir`."""
    run = Path(run)
    for candidate in (run / STATE_DIR, run / f".{STATE_DIR}.old"):
        if candidate.is_dir():
            return candidate
    return None
