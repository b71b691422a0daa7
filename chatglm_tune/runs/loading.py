"""Assembling a model from what a directory names: a base, a P-tuning prefix or a LoRA adapter, quantization.

`resolve_run` reads a `--model` directory: a model directory (config.json + weights: official, merged,
quantized, or a full fine-tuning run), or a P-tuning or LoRA run whose `run_args.json` names the base
(`rundir.py` describes the run directory); `--ptuning-checkpoint` / `--lora` add an adapter to a model
directory. The result, a `ModelSource`, also carries what the run was trained with: its prompt and length
budget (`EncodingOptions`), and the quantization of its base (a QLoRA run trained on INT4 weights is run on
INT4 weights). `load_run` turns a source into a model and its tokenizer, each of its version
(`models.registry`). `from_pretrained` (`chatglm_tune.from_pretrained`) and the Auto classes load a
P-tuning or LoRA run the same way (`adapter_run`, `load_adapted`), and a model directory of any version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from chatglm_tune.models import registry
from chatglm_tune.models.prefix import check_prefix_version
from chatglm_tune.options import DataColumns, EncodingOptions, choose_threads
from chatglm_tune.runtime import cores
from chatglm_tune.runs.rundir import (ADAPTER_CONFIG, ADAPTER_TUNINGS, CONFIG, RUN_ARGS, RunDirectoryError,
                                      is_model_dir, read_run_args, require_model_dir)


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
            adapter = (f" + P-tuning prefix {self.prefix_dir} (pre_seq_len={self.pre_seq_len}, "
                       f"projection={self.prefix_projection})")
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


def resolve_run(model_dir, *, ptuning_checkpoint=None, lora=None) -> ModelSource:
    """Work out base, adapter, tokenizer and training settings from `--model` (+ `--ptuning-checkpoint` / `--lora`).

    A P-tuning prefix of another version than the base (its config.json, read as `registry.of_directory`
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
            raise RunDirectoryError(f"{model_dir / RUN_ARGS} names base model {base}, which is not a model directory "
                                    "here")
        prefix_dir, lora_dir = (model_dir, None) if tuning == "ptuning" else (None, model_dir)
    if (ptuning_checkpoint is not None or lora is not None) and tuning != "full":
        raise RunDirectoryError(f"{model_dir} already holds an adapter (a {tuning} run); do not add another")
    if ptuning_checkpoint is not None:
        prefix_dir = Path(ptuning_checkpoint)
        if not is_model_dir(prefix_dir):
            raise RunDirectoryError(f"{prefix_dir}: a P-tuning checkpoint needs its {CONFIG} (pre_seq_len, "
                                    "prefix_projection)")
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
        ours, theirs = registry.of_directory(base), registry.prefix_version(prefix_dir)
        hint = ours.mismatch_hint(theirs, prefix_dir / CONFIG) if theirs else ""
        check_prefix_version(prefix_dir, theirs and registry.VERSIONS[theirs].title, ours.title, base,
                             error=RunDirectoryError, hint=hint)
    tuned = prefix_dir or lora_dir or model_dir  # the directory that was trained last
    candidates = list(dict.fromkeys([tuned, model_dir, base]))
    tokenizer_dir = next((d for d in candidates if registry.has_tokenizer(d)), None)
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
    registry.of_config(model.config).check_tokenizer(tokenizer, model.config)
    return model, tokenizer


def load_for_inference(source: ModelSource, *, device: str = "auto", dtype: str | None = None,
                       threads: int | None = None, quantization_bit: int | None = None,
                       quantize_embedding: bool | None = None, note=lambda text: None):
    """(model, tokenizer, a line describing them) as infer.py and serve.py run a model: `device` "auto" is
    CUDA when there is one; `dtype` None is float32 on a CPU and float16 on CUDA ("auto": config.json's);
    `threads` None: OMP_NUM_THREADS, else the run's, else torch's. `note(text)` hears advice (float16 on a CPU)."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available to this torch ({torch.__version__}, "
                         f"{'a CPU build' if torch.version.cuda is None else 'no GPU found'}); use --device cpu")
    dtype = dtype or ("float16" if str(device).startswith("cuda") else "float32")
    if dtype == "float16" and device == "cpu":
        note("float16 on a CPU has no fast kernels (about 10x slower than float32 here) and may overflow: prefer "
             "float32 or bfloat16")
    threads, origin = choose_threads(threads, source.threads, "the run's")
    if device == "cpu":
        threads, origin = cores.fitted(threads, origin)
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_run(source, dtype=dtype, device=device, quantization_bit=quantization_bit,
                                quantize_embedding=quantize_embedding)
    bits = model.config.quantization_bit
    cpu_threads = f", {torch.get_num_threads()} threads ({origin})" if device == "cpu" else ""
    line = f"model: {source.describe()} ({f'INT{bits} ' if bits else ''}{dtype}, {device}{cpu_threads})"
    return model, tokenizer, line


# The context length's field, by version: ChatGLM-6B's, ChatGLM2/3 and GLM-4's, transformers' (GLM-4-0414 and later)
CONTEXT_FIELDS = ("max_sequence_length", "seq_length", "max_position_embeddings")


def text_fields(raw: dict) -> dict:
    """A config.json dict's fields of its text model: a composite one's `text_config` (transformers' form of a model
    with a vision encoder beside it: GLM-5.3-Flash's), with the top level's beside them; else the dict itself."""
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def context_length(config) -> int | None:
    """Prompt + answer tokens a model was built for, from its config (a loaded one, or config.json's dict: its text
    model's, `text_fields`); None where it names none."""
    get = text_fields(config).get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    return next((int(get(name)) for name in CONTEXT_FIELDS if get(name)), None)


def load_tokenizer(source: ModelSource):
    if source.tokenizer_dir is None:
        places = ", ".join(map(str, dict.fromkeys(d for d in (source.prefix_dir, source.lora_dir, source.base) if d)))
        raise RunDirectoryError(f"no tokenizer in {places}")
    return registry.of_directory(source.base).load_tokenizer(source.tokenizer_dir)


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
    version = registry.of_directory(source.base)
    follow_run = quantization_bit is None
    bits = source.quantization_bit if follow_run else quantization_bit
    embedding = source.quantize_embedding if quantize_embedding is None else quantize_embedding
    prefix = {} if source.pre_seq_len is None else {"pre_seq_len": source.pre_seq_len,
                                                    "prefix_projection": source.prefix_projection}
    if source.lora_dir is None or (follow_run and bits):
        quantized = dict(quantization_bit=bits, group_size=group_size) if bits else {}
        model = version.load_model(source.base, dtype=dtype, device=device, quantize_embedding=embedding,
                                   **quantized, **prefix)
        if source.prefix_dir is not None:
            model.load_prefix(source.prefix_dir)
        if source.lora_dir is not None:
            from chatglm_tune.runs.lora import load_lora

            model = load_lora(model, source.lora_dir)
    else:
        model = version.load_model(source.base, dtype=dtype, device=device)
        model = merge_lora_and_quantize(model, source.lora_dir, bits, group_size, source.base)
        if embedding:  # after the merge, which refuses integer weights (LoRA never targets the head)
            from chatglm_tune.quant.apply import quantize_embedding as int8_embedding_and_head

            int8_embedding_and_head(model)
    return model.eval()


def adapter_run(directory) -> ModelSource | None:
    """`resolve_run` of a train.py P-tuning or LoRA run directory (its run_args.json names the base it
    tuned); None for any other directory."""
    tuning = (read_run_args(directory) or {}).get("tuning") if Path(directory).is_dir() else None
    return resolve_run(directory) if tuning in ADAPTER_TUNINGS else None


def load_adapted(source: ModelSource, *, dtype=None, torch_dtype=None, device="cpu",
                 quantization_bit: int | None = None, group_size: int = 0, quantization_group_size: int | None = None,
                 quantize_embedding: bool | None = None, pre_seq_len: int | None = None,
                 prefix_projection: bool | None = None):
    """`load_model` for `from_pretrained`'s arguments (`from_pretrained`, the Auto classes): the base
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
    Linears and its routed experts' 3D weights quantized, as loading a float checkpoint with `bits`
    quantizes them. On a base stored quantized the adapter cannot be merged: it runs beside the
    integer weights (and `bits` must be the stored ones)."""
    from chatglm_tune.quant.apply import quantize_model
    from chatglm_tune.quant.experts import quantize_experts
    from chatglm_tune.quant.format import check_bits
    from chatglm_tune.runs.lora import load_lora, merge_lora

    stored = model.config.quantization_bit
    check_bits(stored, bits, base or "the base")
    try:
        model = load_lora(model, lora_dir)
    except RuntimeError as err:  # peft's load_state_dict size mismatches
        raise RunDirectoryError(f"{lora_dir}: the adapter does not fit {base or 'the base'}: {err}") from err
    if stored:
        return model
    model = merge_lora(model)
    if not bits:
        return model
    quantize_model(model, bits, group_size, targets=registry.of_config(model.config).quantizable_linears)
    quantize_experts(model, bits, group_size)  # a mixture-of-experts model's fused experts: no Linears to swap
    return model


def derived_run_args(source: ModelSource, **changes) -> dict:
    """The `run_args.json` of a directory made from `source` (a merged or quantized copy): the run's
    own settings (prompt, lengths, threads), loaded as a whole model from now on; a bare adapter's are its
    base run's, as `resolve_run` reads them."""
    tuned = source.prefix_dir or source.lora_dir or source.base
    args = dict(read_run_args(tuned) or read_run_args(source.base) or {})
    return {**args, "tuning": "full", "derived_from": source.describe(), **changes}


def from_pretrained(directory, **kwargs):
    """The model of any version from its directory (`Version.load_model`'s arguments: dtype, device,
    pre_seq_len, prefix_projection, quantization_bit, group_size, quantize_embedding).

    A train.py P-tuning or LoRA run directory (its run_args.json names the base) loads as that base with
    the run's prefix or LoRA adapter (`load_adapted`, `load_model`: the base quantized as the
    run trained on it unless quantization_bit says otherwise; an adapter merged into a float base, beside
    the integer weights of a quantized one)."""
    source = adapter_run(directory)
    if source is not None:
        return load_adapted(source, **kwargs)
    return registry.of_directory(directory).load_model(directory, **kwargs)
