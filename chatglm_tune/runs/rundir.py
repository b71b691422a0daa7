"""A training run's output directory: what it holds, how it is written, how --resume checks it.

    <run>/config.json, model.safetensors         full fine-tuning: the whole model
    <run>/config.json, model.safetensors         P-tuning v2: config with pre_seq_len, prefix weights only
    <run>/adapter_config.json, adapter_model.*   LoRA: a peft adapter directory (it names its base)
    <run>/ice_text.model, tokenizer_config.json  the tokenizer
    <run>/run_args.json                          the run's options; `model` names the base it tuned
    <run>/run.yaml                               the flags of the command that made it, as a --config file
    <run>/metrics.jsonl, loss_curve.png          training log
    <run>/state/                                 what --resume needs: trained weights, optimizer, RNG

The model files at the top are the best checkpoint by dev F1 (the last one without a dev file). Each
file is written to a temporary directory first and renamed into place, so a crash while saving
leaves the previous checkpoint loadable.

How a run directory becomes a model again (base + prefix or adapter + quantization) is `loading.py`'s
job; `require_model_dir` refuses a P-tuning or LoRA run as the base to tune: it names the run's base, which
--model tunes afresh and with which --resume continues the run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

from chatglm_tune.models import registry
from chatglm_tune.runtime import crashpoints, leftovers
from chatglm_tune.runtime.checkpoint import atomic_write, follow_umask

RUN_ARGS = "run_args.json"
DRY_RUN_REPORT = "dry_run.json"  # what `train.py --dry-run` writes beside its rows (`EXAMPLES_FILE`)
EXAMPLES_FILE = "examples.jsonl"
RUN_CONFIG = "run.yaml"  # runs trained before it was written have none: nothing reads it back but a user's --config
ADAPTER_CONFIG = "adapter_config.json"
STATE_DIR = "state"
SHARED_STATE_TMP = f".{STATE_DIR}.parts.tmp"  # the state all processes of a run write before it is swapped in
CONFIG = "config.json"


class RunDirectoryError(ValueError):
    """A directory that is not what it was given as (no model, no base, an adapter on an adapter...)."""


# ----------------------------------------------------------------------------------------------
# Writing


def write_run_args(directory: Path, args: dict) -> None:
    atomic_write(Path(directory) / RUN_ARGS,
                 lambda p: Path(p).write_text(json.dumps(args, indent=2, ensure_ascii=False)))


def read_run_args(directory: Path) -> dict | None:
    path = Path(directory) / RUN_ARGS
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


# Options a resumed run may change: how long it runs, how fast and how it reports, not what it learns.
RESUMABLE_CHANGES = ("epochs", "max_steps", "budget_steps", "patience", "threads", "eval_batch_size", "log_every",
                     "tensorboard", "compile")


def file_identity(path) -> dict:
    """The absolute path, size and SHA-256 of a data file: what a run trained on, checked on --resume."""
    import hashlib

    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def run_record(model_arg: str, options, train_file, dev_file=None) -> dict:
    """The `run_args.json` of a new run: the base (`tiny` or a resolved path), every option, and the data
    files it trains and evaluates on."""
    from dataclasses import asdict

    from chatglm_tune.options import TINY_PRESETS

    plain = asdict(options)
    if plain["lora"]["target"] is not None:
        plain["lora"]["target"] = list(plain["lora"]["target"])
    data = {"train": file_identity(train_file), "dev": file_identity(dev_file) if dev_file else None}
    return {"model": model_arg if model_arg in TINY_PRESETS else str(Path(model_arg).resolve()), **plain, "data": data}


def check_resume(output_dir: Path, record: dict) -> dict:
    """The stopped run's record when `record` continues it: same base, data and options but for
    RESUMABLE_CHANGES; else an error naming each difference (the directory is left as it is)."""
    saved = read_run_args(output_dir)
    if saved is None or state_dir(output_dir) is None:
        raise RunDirectoryError(f"{output_dir}: nothing to resume (no {RUN_ARGS} or {STATE_DIR}/): --resume auto "
                                "starts a run where there is none yet")
    changed = differences(saved, record)
    if changed:
        raise RunDirectoryError(f"--resume would change the stopped run in {output_dir}: " + "; ".join(changed)
                                + ". Resume with the run's own data and options, or train into a new --output-dir")
    return saved


def differences(saved: dict, record: dict) -> list[str]:
    """What `record` changes of the recorded run `saved`, RESUMABLE_CHANGES aside: a line each."""
    changed = []
    for key, value in record.items():
        if key in RESUMABLE_CHANGES or (key == "data" and key not in saved):  # runs recorded before data was
            continue
        if key == "data":
            changed += [f"--{name}-file: the run used {_describe_file(saved['data'].get(name))}, now "
                        f"{_describe_file(value[name])}" for name in ("train", "dev")
                        if _file_key(saved["data"].get(name)) != _file_key(value[name])]
        elif saved.get(key) != value:
            changed.append(f"{key}: the run used {saved.get(key)!r}, now {value!r}")
    return changed


# How long a run trains: a finished run given a longer budget goes on (a resumable change).
BUDGET_KEYS = ("epochs", "max_steps", "budget_steps")


def auto_resume(output_dir: Path, record: dict) -> str:
    """What `--resume auto` does in `output_dir` for the run `record`: "fresh" (nothing there yet), "restart" (this
    run recorded itself but saved no state: it starts again in place), "resume" (its state is there), "finished" (it
    ended, with this budget). RunDirectoryError where the directory holds something else, or another run (naming
    each setting that differs)."""
    output_dir = Path(output_dir)
    leftovers.remove_abandoned_writes(output_dir)  # a start killed while it recorded itself
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return "fresh"
    saved = read_run_args(output_dir)
    if saved is None:
        raise RunDirectoryError(f"--resume auto: {output_dir} is not empty and holds no train.py run (no {RUN_ARGS}): "
                                "choose a new --output-dir")
    changed = differences(saved, record)
    if changed:
        raise RunDirectoryError(f"--resume auto: {output_dir} holds another run: " + "; ".join(changed)
                                + ". Train into a new --output-dir, or give that run's data and options")
    if final_summary(output_dir) is not None and all(saved.get(k) == record.get(k) for k in BUDGET_KEYS):
        return "finished"
    return "resume" if state_dir(output_dir) is not None else "restart"


def final_summary(output_dir: Path) -> dict | None:
    """The summary a finished run wrote last in its metrics.jsonl, else None."""
    log = Path(output_dir) / "metrics.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    last = json.loads(lines[-1]) if lines and lines[-1].strip().endswith("}") else {}
    return last.get("final")


def record_start(output_dir: Path, record: dict, *, settings: dict | None = None, about: str = "") -> None:
    """A new run's directory with its run_args.json, before anything else is written there: whatever a killed start
    leaves then names its run (`auto_resume`); then `settings`, the flags of the command that starts it, as its
    run.yaml (after the comment `about`), where given."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    write_run_args(output_dir, record)
    if settings is not None:
        write_run_config(output_dir, settings, about)


def write_run_config(directory: Path, settings: dict, about: str = "") -> None:
    """`settings` (flag -> value) as the YAML file run.yaml in `directory`, written whole, after the comment `about`."""
    import yaml

    header = "".join(f"# {line}".rstrip() + "\n" for line in about.splitlines())
    text = header + yaml.safe_dump(settings, sort_keys=False, allow_unicode=True, default_flow_style=False, width=1000)
    atomic_write(Path(directory) / RUN_CONFIG, lambda p: Path(p).write_text(text, encoding="utf-8"))


def _file_key(identity: dict | None):
    return None if identity is None else identity["sha256"]  # the same data moved elsewhere is the same data


def _describe_file(identity: dict | None) -> str:
    return ("none" if identity is None
            else f"{identity['path']} ({identity['bytes']:,} bytes, sha256 {identity['sha256'][:12]})")


def prepare_output_dir(output_dir: Path, *, base: Path | None, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a directory that holds something (a model, another run) unless `resume`, or
    `overwrite` of a run directory, which is then emptied; never into the base being tuned. A directory holding only
    a dry run's output (`DRY_RUN_REPORT`, no run) is emptied: the run makes it again."""
    output_dir = Path(output_dir)
    if base is not None and output_dir.resolve() == Path(base).resolve():
        raise RunDirectoryError(f"--output-dir {output_dir} is the base model being tuned: choose another directory")
    if not output_dir.exists():
        check_creatable(output_dir)
    if resume or not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise RunDirectoryError(f"--output-dir {output_dir} exists and is not a directory")
    leftovers.remove_abandoned_writes(output_dir)
    if not any(output_dir.iterdir()):
        return
    if (output_dir / DRY_RUN_REPORT).is_file() and read_run_args(output_dir) is None:
        print(f"train.py: replacing the dry run's output in {output_dir}", file=sys.stderr)
        _empty(output_dir)  # what `train.py --dry-run` wrote: a tokenizer and rows, made again from the same data
        return
    if not overwrite:
        raise RunDirectoryError(
            f"--output-dir {output_dir} is not empty: pass --resume to continue its run, --overwrite to replace it, "
            "or choose a new directory"
        )
    if read_run_args(output_dir) is None:
        raise RunDirectoryError(f"--overwrite: {output_dir} is not a train.py run directory (no {RUN_ARGS}); "
                                "remove it yourself if it should go")
    _empty(output_dir)


def check_creatable(path: Path) -> None:
    """RunDirectoryError `cannot create PATH: why` unless directory `path` (absent) can be made, before anything is
    read or written for it: the nearest existing path above it must be a directory in which a directory can be made.
    That is tried (a directory made there and removed at once), as a permission check alone passes for root, and
    file systems such as /proc take no new directory from anyone."""
    path = Path(os.path.abspath(path))
    first = path  # the topmost directory to make
    while not first.parent.exists():  # a path under a file does not exist either: the walk stops at the file
        first = first.parent
    above = first.parent
    if not above.is_dir():
        raise RunDirectoryError(f"cannot create {path}: {above} is not a directory")
    try:
        first.mkdir()
    except FileExistsError:  # made meanwhile (another process of the same launch)
        return
    except OSError as err:
        raise cannot_create(path, err) from None
    first.rmdir()


def cannot_create(path: Path, err: OSError) -> RunDirectoryError:
    """The error for `path` (a directory or a file to write) whose making failed with `err`: `cannot create PATH: why`,
    naming the nearest existing path above it where that is a file, or not writable."""
    above = Path(os.path.abspath(path)).parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        why = f"{above} is not a directory"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{above} is not writable ({err.strerror})"
    else:  # ENOENT from /proc, ENOSPC, ...
        why = f"{above} takes no new entry ({err.strerror})"
    return RunDirectoryError(f"cannot create {path}: {why}")


def discard_unstarted(output_dir: Path, *, made: bool = False) -> None:
    """After a new run that failed or was stopped before it saved any state: the files it wrote (its run_args.json, a
    tiny model's tokenizer, a log) go, and the directory too where the run `made` it, so that the same command,
    fixed, runs again. `prepare_output_dir` let the run into an empty directory only, so they are all its own."""
    output_dir = Path(output_dir)
    if output_dir.is_dir() and state_dir(output_dir) is None:
        _empty(output_dir)
        if made:
            output_dir.rmdir()


def _empty(directory: Path) -> None:
    """Every entry of `directory` removed; one gone meanwhile (another process of the run emptying it) is fine."""
    for entry in directory.iterdir():
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def publish(write, directory: Path) -> None:
    """Run `write(tmp_dir)`, then move each file it wrote into `directory`, one atomic rename each."""
    directory = Path(directory)
    tmp = directory / ".publishing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    follow_umask(tmp)
    for file in sorted(tmp.iterdir()):
        crashpoints.reached("publish")
        os.replace(file, directory / file.name)
    tmp.rmdir()


def save_trained(model, tokenizer, directory: Path, tuning: str) -> None:
    """Publish what `tuning` trained: the prefix encoder (P-tuning), or the whole model or the LoRA
    adapter (`save_pretrained` of either writes what it trains)."""

    def write(tmp: Path) -> None:
        if tuning == "ptuning":
            model.save_pretrained(tmp, state_dict=registry.of_config(model.config).prefix_state(model))
        elif tuning == "lora":  # the adapter only: peft's "auto" adds the whole embedding and head whenever it
            model.save_pretrained(tmp, save_embedding_layers=False)  # believes the vocabulary was resized
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for extra in ("special_tokens_map.json", "added_tokens.json"):  # chat_template.jinja stays: GLM-4's template
            (tmp / extra).unlink(missing_ok=True)

    publish(write, directory)


def replace_dir(write, target: Path) -> None:
    """Write a whole directory (e.g. accelerate's state) beside `target`, then swap it in."""
    target = Path(target)
    tmp, old = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    follow_umask(tmp)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        crashpoints.reached("replace-dir")
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(run: Path) -> None:
    """What a run killed while publishing or saving left (`publish`, `replace_dir`): half-published files, a
    half-written state, and a replaced state once its successor is in place."""
    run = Path(run)
    leftovers = [run / ".publishing", run / f".{STATE_DIR}.tmp", run / SHARED_STATE_TMP]
    if (run / STATE_DIR).is_dir():
        leftovers.append(run / f".{STATE_DIR}.old")
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def has_trained_model(run: Path) -> bool:
    """Whether `save_trained` has published a model (whole, prefix or adapter) into `run`."""
    return any((Path(run) / name).exists() for name in ("model.safetensors", "adapter_model.safetensors",
                                                        "model.safetensors.index.json"))


def state_dir(run: Path) -> Path | None:
    """The saved training state, also after a crash between the two renames of `replace_dir`."""
    run = Path(run)
    for candidate in (run / STATE_DIR, run / f".{STATE_DIR}.old"):
        if candidate.is_dir():
            return candidate
    return None


def is_model_dir(directory: Path) -> bool:
    return (Path(directory) / CONFIG).is_file()


ADAPTER_TUNINGS = {"ptuning": "a P-tuning prefix", "lora": "a LoRA adapter"}  # what such a run holds instead of a model


def require_model_dir(directory: Path) -> Path:
    """`directory` when it holds a whole model (config.json + weights), the base a training run tunes; a
    clear error otherwise: for a train.py P-tuning or LoRA run (its weights are a prefix or an adapter
    only), one naming its base, the flags that tune that base or continue the run, and how to run it;
    for a bare LoRA adapter, one saying to pass its base, and the adapter with --lora."""
    directory = Path(directory)
    run_args = read_run_args(directory) or {}
    holds = ADAPTER_TUNINGS.get(run_args.get("tuning"))
    if holds is not None:
        base = run_args.get("model")
        raise RunDirectoryError(
            f"{directory} is a --tuning {run_args['tuning']} run: it holds {holds} trained on {base}, not a model to "
            f"tune: pass --model {base} to tune that base afresh, or --model {base} --resume --output-dir {directory} "
            f"(with the run's options) to continue this run; infer.py --model {directory} runs it"
        )
    if is_model_dir(directory):
        return directory
    if (directory / ADAPTER_CONFIG).exists():
        raise RunDirectoryError(f"{directory} is a LoRA adapter, not a model: pass its base model, and --lora "
                                f"{directory}")
    what = "no such directory" if not directory.exists() else f"not a model directory (no {CONFIG})"
    raise RunDirectoryError(f"{directory}: {what}")
