"""A training run's output directory: what it holds, how it is written, how it is loaded back.

    <run>/config.json, model.safetensors         full fine-tuning: the whole model
    <run>/config.json, model.safetensors         P-tuning v2: config with pre_seq_len, prefix weights only
    <run>/adapter_config.json, adapter_model.*   LoRA: a peft adapter directory (it names its base)
    <run>/ice_text.model, tokenizer_config.json  the tokenizer
    <run>/run_args.json                          the run's options; `model` names the base it tuned
    <run>/metrics.jsonl, loss_curve.png          training log
    <run>/state/                                 what --resume needs: trained weights, optimizer, RNG

The model files at the top are the best checkpoint by dev F1 (the last one without a dev file). Each
file is written to a temporary directory first and renamed into place, so a crash while saving
leaves the previous checkpoint loadable.

Loading. `resolve_run` reads a `--model` directory: a model directory (config.json + weights:
official, merged, quantized, or a full fine-tuning run), or a P-tuning or LoRA run whose
`run_args.json` names the base; `--ptuning-checkpoint` / `--lora` add an adapter to a model directory.
The result, a `ModelSource`, also carries what the run was trained with: its prompt and length
budget (`EncodingOptions`), and the quantization of its base (a QLoRA run trained on INT4 weights is
run on INT4 weights). `load_run` turns a source into a model and its tokenizer.
`chatglm_tune.from_pretrained(run)` and the Auto classes load a P-tuning or LoRA run the same way
(`adapter_run`, `load_adapted`); train.py refuses one as the base to tune (`require_model_dir`): it
names the run's base, which --model tunes afresh and with which --resume continues the run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import versions
from .checkpoint import atomic_write, follow_umask
from .options import DataColumns, EncodingOptions

RUN_ARGS = "run_args.json"
ADAPTER_CONFIG = "adapter_config.json"
STATE_DIR = "state"
CONFIG = "config.json"


class RunDirectoryError(ValueError):
    """A directory that is not what it was given as (no model, no base, an adapter on an adapter...)."""


# ----------------------------------------------------------------------------------------------
# Writing


def write_run_args(directory: Path, args: dict) -> None:
    atomic_write(Path(directory) / RUN_ARGS, lambda p: Path(p).write_text(json.dumps(args, indent=2, ensure_ascii=False)))


def read_run_args(directory: Path) -> dict | None:
    path = Path(directory) / RUN_ARGS
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


# Options a resumed run may change: how long it runs and how it reports, not what it learns.
RESUMABLE_CHANGES = ("epochs", "max_steps", "budget_steps", "patience", "threads", "eval_batch_size", "log_every",
                     "tensorboard")


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

    from .options import TINY_PRESETS

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
        raise RunDirectoryError(f"{output_dir}: nothing to resume (no {RUN_ARGS} or {STATE_DIR}/)")
    differences = []
    for key, value in record.items():
        if key in RESUMABLE_CHANGES or (key == "data" and key not in saved):  # runs recorded before data was
            continue
        if key == "data":
            differences += [f"--{name}-file: the run used {_describe_file(saved['data'].get(name))}, now "
                            f"{_describe_file(value[name])}" for name in ("train", "dev")
                            if _file_key(saved["data"].get(name)) != _file_key(value[name])]
        elif saved.get(key) != value:
            differences.append(f"{key}: the run used {saved.get(key)!r}, now {value!r}")
    if differences:
        raise RunDirectoryError(f"--resume would change the stopped run in {output_dir}: " + "; ".join(differences)
                                + ". Resume with the run's own data and options, or train into a new --output-dir")
    return saved


def _file_key(identity: dict | None):
    return None if identity is None else identity["sha256"]  # the same data moved elsewhere is the same data


def _describe_file(identity: dict | None) -> str:
    return "none" if identity is None else f"{identity['path']} ({identity['bytes']:,} bytes, sha256 {identity['sha256'][:12]})"


def prepare_output_dir(output_dir: Path, *, base: Path | None, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a directory that holds something (a model, another run) unless `resume`, or
    `overwrite` of a run directory, which is then emptied; never into the base being tuned."""
    output_dir = Path(output_dir)
    if base is not None and output_dir.resolve() == Path(base).resolve():
        raise RunDirectoryError(f"--output-dir {output_dir} is the base model being tuned: choose another directory")
    if resume or not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise RunDirectoryError(f"--output-dir {output_dir} exists and is not a directory")
    if not any(output_dir.iterdir()):
        return
    if not overwrite:
        raise RunDirectoryError(
            f"--output-dir {output_dir} is not empty: pass --resume to continue its run, --overwrite to replace it, "
            "or choose a new directory"
        )
    if read_run_args(output_dir) is None:
        raise RunDirectoryError(f"--overwrite: {output_dir} is not a train.py run directory (no {RUN_ARGS}); "
                                "remove it yourself if it should go")
    for entry in output_dir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def publish(write, directory: Path) -> None:
    """Run `write(tmp_dir)`, then move each file it wrote into `directory`, one atomic rename each."""
    directory = Path(directory)
    tmp = directory / ".publishing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    follow_umask(tmp)
    for file in sorted(tmp.iterdir()):
        os.replace(file, directory / file.name)
    tmp.rmdir()


def save_trained(model, tokenizer, directory: Path, tuning: str) -> None:
    """Publish what `tuning` trained: the prefix encoder (P-tuning), or the whole model or the LoRA
    adapter (`save_pretrained` of either writes what it trains)."""

    def write(tmp: Path) -> None:
        if tuning == "ptuning":
            model.save_pretrained(tmp, state_dict=versions.of_config(model.config).prefix_state(model))
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
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


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


# ----------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class ModelSource:
    """What to load: a base directory, optionally a P-tuning prefix or a LoRA adapter, the tokenizer,
    and what the model was trained with (the run's prompt/length settings and base quantization)."""

    base: Path
    tokenizer_dir: Path | None  # None: no tokenizer beside the weights
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    pre_seq_len: int | None = None
    prefix_projection: bool = False
    prefix_dir: Path | None = None
    lora_dir: Path | None = None
    quantization_bit: int = 0  # the base was quantized to INT8/INT4 at load when the run trained on it
    quantize_embedding: bool = False
    threads: int | None = None  # the run's torch threads
    columns: DataColumns = field(default_factory=DataColumns)  # the run's data shape (prompt/response columns)

    def describe(self) -> str:
        if self.prefix_dir is not None:
            adapter = f" + P-tuning prefix {self.prefix_dir} (pre_seq_len={self.pre_seq_len}, projection={self.prefix_projection})"
        elif self.lora_dir is not None:
            adapter = f" + LoRA {self.lora_dir}"
        else:
            adapter = ""
        return f"{self.base}{adapter}"

    def identity(self, quantization_bit: int | None = None, quantize_embedding: bool | None = None) -> str:
        """Which model this is, with absolute paths and the weights' form (`load_run`'s arguments), to
        tell whether two runs used the same one."""
        bits = self.quantization_bit if quantization_bit is None else quantization_bit
        embedding = self.quantize_embedding if quantize_embedding is None else quantize_embedding
        adapter = self.prefix_dir or self.lora_dir
        parts = [str(self.base.resolve()), *([f"adapter {adapter.resolve()}"] if adapter else []),
                 f"INT{bits}" if bits else "weights as stored", *(["INT8 embedding"] if embedding else [])]
        return ", ".join(parts)


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
        raise RunDirectoryError(f"{directory} is a LoRA adapter, not a model: pass its base model, and --lora {directory}")
    what = "no such directory" if not directory.exists() else f"not a model directory (no {CONFIG})"
    raise RunDirectoryError(f"{directory}: {what}")


def resolve_run(model_dir, *, ptuning_checkpoint=None, lora=None) -> ModelSource:
    """Work out base, adapter, tokenizer and training settings from `--model` (+ `--ptuning-checkpoint` / `--lora`).

    A P-tuning prefix of another version than the base (its config.json, read as `versions.of_directory`
    reads a model's) is refused, naming both. The training settings (prompt, lengths, data columns) are the
    adapter's run_args.json; an adapter without one (a bare prefix or peft adapter) takes the base's, when
    the base is a train.py run.
    """
    model_dir = Path(model_dir)
    if ptuning_checkpoint is not None and lora is not None:
        raise RunDirectoryError("pass at most one of --ptuning-checkpoint and --lora")
    run_args = read_run_args(model_dir) or {}
    tuning = run_args.get("tuning", "full")
    if tuning == "full" and (model_dir / ADAPTER_CONFIG).exists():
        raise RunDirectoryError(
            f"{model_dir} is a LoRA adapter without a {RUN_ARGS} naming its base: pass the base with --model "
            "and this directory with --lora"
        )
    if tuning == "full":
        base, prefix_dir, lora_dir = require_model_dir(model_dir), None, None
    else:
        base = Path(run_args["model"])
        if not is_model_dir(base):
            raise RunDirectoryError(f"{model_dir / RUN_ARGS} names base model {base}, which is not a model directory here")
        prefix_dir, lora_dir = (model_dir, None) if tuning == "ptuning" else (None, model_dir)
    if (ptuning_checkpoint is not None or lora is not None) and tuning != "full":
        raise RunDirectoryError(f"{model_dir} already holds an adapter (a {tuning} run); do not add another")
    if ptuning_checkpoint is not None:
        prefix_dir = Path(ptuning_checkpoint)
        if not is_model_dir(prefix_dir):
            raise RunDirectoryError(f"{prefix_dir}: a P-tuning checkpoint needs its {CONFIG} (pre_seq_len, prefix_projection)")
    if lora is not None:
        lora_dir = Path(lora)
        if not (lora_dir / ADAPTER_CONFIG).exists():
            raise RunDirectoryError(f"{lora_dir}: not a peft adapter directory (no {ADAPTER_CONFIG})")
    pre_seq_len, projection = None, False
    if prefix_dir is not None:
        prefix_config = json.loads((prefix_dir / CONFIG).read_text(encoding="utf-8"))
        pre_seq_len, projection = prefix_config.get("pre_seq_len"), bool(prefix_config.get("prefix_projection"))
        if not pre_seq_len:
            raise RunDirectoryError(f"{prefix_dir}/{CONFIG} has no pre_seq_len: not a P-tuning checkpoint")
        from .prefix import check_prefix_version

        check_prefix_version(prefix_dir, versions.of_directory(base).name, base, error=RunDirectoryError)
    tuned = prefix_dir or lora_dir or model_dir  # the directory that was trained last
    candidates = list(dict.fromkeys([tuned, model_dir, base]))
    tokenizer_dir = next((d for d in candidates if versions.has_tokenizer(d)), None)
    trained = read_run_args(tuned) or read_run_args(model_dir) or {}  # a bare adapter: what its base was trained with
    encoding = EncodingOptions(**trained["encoding"]) if trained.get("encoding") else EncodingOptions()
    # A run trained on a base quantized at load runs on that base (not on the float one beneath it).
    adapter_run = trained if trained.get("tuning") in ("ptuning", "lora") else {}
    return ModelSource(base, tokenizer_dir, encoding, pre_seq_len, projection, prefix_dir, lora_dir,
                       quantization_bit=adapter_run.get("quantization_bit") or 0,
                       quantize_embedding=bool(adapter_run.get("quantize_embedding")), threads=run_args.get("threads"),
                       columns=DataColumns(**trained.get("columns") or {}))


def load_run(source: ModelSource, *, dtype="float32", device="cpu", quantization_bit: int | None = None,
             quantize_embedding: bool | None = None):
    """(model in eval mode, tokenizer) for `source` (`load_model`, `load_tokenizer`); the tokenizer's
    special ids must equal the model config's."""
    model = load_model(source, dtype=dtype, device=device, quantization_bit=quantization_bit,
                       quantize_embedding=quantize_embedding)
    tokenizer = load_tokenizer(source)
    versions.of_config(model.config).check_tokenizer(tokenizer, model.config)
    return model, tokenizer


def load_tokenizer(source: ModelSource):
    if source.tokenizer_dir is None:
        places = ", ".join(map(str, dict.fromkeys(d for d in (source.prefix_dir, source.lora_dir, source.base) if d)))
        raise RunDirectoryError(f"no tokenizer in {places}")
    return versions.of_directory(source.base).load_tokenizer(source.tokenizer_dir)


def load_model(source: ModelSource, *, dtype="float32", device="cpu", quantization_bit: int | None = None,
               group_size: int = 0, quantize_embedding: bool | None = None):
    """The model `source` describes, in eval mode.

    `quantization_bit` None runs the model as it was trained: the base as stored, or quantized at load
    as the run's base was (QLoRA, P-tuning on INT4), with a LoRA adapter beside the integer weights.
    4 or 8 asks for INT4/INT8 block Linears: a LoRA adapter is then merged into the float base first
    (`merge_lora_and_quantize`), as it is always merged into a float base, where decoding pays nothing
    for it. `quantize_embedding` None follows the run; True holds the embedding and head in INT8 (ChatGLM-6B's
    tied pair as one copy, the untied ones of ChatGLM2/3 and GLM-4 as one each).
    """
    version = versions.of_directory(source.base)
    follow_run = quantization_bit is None
    bits = source.quantization_bit if follow_run else quantization_bit
    embedding = source.quantize_embedding if quantize_embedding is None else quantize_embedding
    prefix = {} if source.pre_seq_len is None else {"pre_seq_len": source.pre_seq_len, "prefix_projection": source.prefix_projection}
    if source.lora_dir is None or (follow_run and bits):
        quantized = dict(quantization_bit=bits, group_size=group_size) if bits else {}
        model = version.load_model(source.base, dtype=dtype, device=device, quantize_embedding=embedding, **quantized, **prefix)
        if source.prefix_dir is not None:
            model.load_prefix(source.prefix_dir)
        if source.lora_dir is not None:
            from .lora import load_lora

            model = load_lora(model, source.lora_dir)
    else:
        model = version.load_model(source.base, dtype=dtype, device=device)
        model = merge_lora_and_quantize(model, source.lora_dir, bits, group_size, source.base)
        if embedding:  # after the merge, which refuses integer weights (LoRA never targets the head)
            from .quantization import quantize_embedding as int8_embedding_and_head

            int8_embedding_and_head(model)
    return model.eval()


def adapter_run(directory) -> ModelSource | None:
    """`resolve_run` of a train.py P-tuning or LoRA run directory (its run_args.json names the base it
    tuned); None for any other directory."""
    tuning = (read_run_args(directory) or {}).get("tuning") if Path(directory).is_dir() else None
    return resolve_run(directory) if tuning in ADAPTER_TUNINGS else None


def load_adapted(source: ModelSource, *, dtype=None, torch_dtype=None, device="cpu", quantization_bit: int | None = None,
                 group_size: int = 0, quantization_group_size: int | None = None, quantize_embedding: bool | None = None,
                 pre_seq_len: int | None = None, prefix_projection: bool | None = None):
    """`load_model` for `from_pretrained`'s arguments (`versions.from_pretrained`, the Auto classes): the base
    of `source` with its prefix or its LoRA adapter. The prefix settings are the checkpoint's; others given
    are refused. dtype (or torch_dtype) default float32."""
    given = {"pre_seq_len": pre_seq_len, "prefix_projection": prefix_projection}
    own = {"pre_seq_len": source.pre_seq_len, "prefix_projection": source.prefix_projection}
    clashes = [f"{k}={v!r}" for k, v in given.items() if v is not None and (source.prefix_dir is None or v != own[k])]
    if clashes:
        has = (f"pre_seq_len={source.pre_seq_len}, prefix_projection={source.prefix_projection}"
               if source.prefix_dir is not None else "no prefix")
        raise RunDirectoryError(f"{source.describe()} has {has}: cannot load it with {', '.join(clashes)}")
    if quantization_group_size is not None:
        if group_size and group_size != quantization_group_size:
            raise ValueError(f"group_size={group_size} and quantization_group_size={quantization_group_size} disagree")
        group_size = quantization_group_size
    dtype = dtype if dtype is not None else torch_dtype
    return load_model(source, dtype="float32" if dtype is None else dtype, device=device,
                      quantization_bit=quantization_bit, group_size=group_size, quantize_embedding=quantize_embedding)


def merge_lora_and_quantize(model, lora_dir: Path, bits: int | None, group_size: int = 0, base: Path | None = None):
    """`model` with the LoRA adapter in `lora_dir` folded into its weights, then (bits 4/8) its block
    Linears quantized. On a base stored quantized the adapter cannot be merged: it runs beside the
    integer weights (and `bits` must be the stored ones)."""
    from .lora import load_lora, merge_lora
    from .quantization import check_bits, quantize_model

    stored = model.config.quantization_bit
    check_bits(stored, bits, base or "the base")
    try:
        model = load_lora(model, lora_dir)
    except RuntimeError as err:  # peft's load_state_dict size mismatches
        raise RunDirectoryError(f"{lora_dir}: the adapter does not fit {base or 'the base'}: {err}") from err
    if stored:
        return model
    model = merge_lora(model)
    targets = versions.of_config(model.config).quantizable_linears
    return quantize_model(model, bits, group_size, targets=targets) if bits else model


def derived_run_args(source: ModelSource, **changes) -> dict:
    """The `run_args.json` of a directory made from `source` (a merged or quantized copy): the run's
    own settings (prompt, lengths, threads), loaded as a whole model from now on; a bare adapter's are its
    base run's, as `resolve_run` reads them."""
    tuned = source.prefix_dir or source.lora_dir or source.base
    args = dict(read_run_args(tuned) or read_run_args(source.base) or {})
    return {**args, "tuning": "full", "derived_from": source.describe(), **changes}
