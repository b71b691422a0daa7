"""What export.py reads: a model directory or a train.py run, as one float model with its tokenizer.

A LoRA run (or `--lora`) is merged into its float base (`loading.load_model` with no quantization): every
engine then runs plain weights. A full fine-tuning run and a model directory are taken as they are.
Refused, with the reason and what works instead:
- a P-tuning run: its prefix is 2 x layers x pre_seq_len cache entries that the model attends to before any
  token; no engine (llama.cpp, ollama, transformers' generate, vLLM) takes a KV prefix;
- a directory stored in INT8/INT4 (quantize.py's output, an official -int4 model): its weights are already
  rounded in a layout only this toolkit and the official code read; export the float source, with a `--type`.
A model directory or a full run, in the official layout or in transformers' own form (GLM-4-0414, GLM-Edge,
glm-4-9b-chat-hf), goes into a GGUF file straight from its weight files (`export.tensors`), without loading the
model. A QLoRA run (a LoRA adapter trained on a base quantized at load) merges into the float base: the adapter
learned against rounded weights, so the merged float model differs from what the run evaluated by that rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from chatglm_tune.export import answering
from chatglm_tune.export.tensors import CheckpointTensors, ModelTensors, names_every_tensor
from chatglm_tune.models import registry
from chatglm_tune.models.version import Version
from chatglm_tune.runs import loading
from chatglm_tune.runs.loading import ModelSource
from chatglm_tune.runs.rundir import CONFIG, read_run_args


class ExportError(ValueError):
    """A source that cannot be exported in the form asked for; the message says why and what works."""


@dataclass
class Exportable:
    model: object | None  # in eval mode, float weights, any adapter merged; None: read from the files (`tensors`)
    config: object  # the model's config (transformers' GlmConfig for ChatGLM2/3, GLM-4, GLM-4-0414, GLM-Edge)
    tensors: object | None  # for a GGUF file: an `export.tensors` source of the tensors under checkpoint keys
    tokenizer: object
    version: Version
    source: ModelSource
    notes: list[str]  # what the user should know about this export (printed by export.py)

    @cached_property
    def is_run(self) -> bool:
        """Whether this is a train.py run (or a LoRA run merged), not a plain model directory (read once)."""
        return read_run_args(self.source.lora_dir or self.source.base) is not None

    @property
    def run_prompt(self) -> str:
        """The instruction a train.py run put before each record's text ("" for a plain model directory)."""
        return self.source.encoding.prompt if self.is_run else ""

    @property
    def chat_template(self) -> str:
        """The Jinja chat template every file of the export carries: the version's, with the run's instruction."""
        return answering.chat_template(self.version.format, self.tokenizer, self.run_prompt)

    @property
    def gguf_chat_template(self) -> str:
        """`chat_template` as a GGUF file carries it, for llama.cpp (`answering.template_defaults`)."""
        return answering.chat_template(self.version.format, self.tokenizer, self.run_prompt, llama_cpp=True)

    @property
    def sampling(self):
        """The sampling defaults every file of the export carries: greedy for a run, the official chat()'s else."""
        return answering.sampling(self.version.format, self.is_run)


def check_exportable(source: ModelSource) -> None:
    """ExportError for a P-tuning source or one stored in INT8/INT4, naming what to export instead."""
    if source.prefix_dir is not None:
        raise ExportError(
            f"{source.prefix_dir} is a P-tuning run: its prefix is {source.pre_seq_len} key/value entries per layer "
            "that the model attends to before any token, and no engine (llama.cpp, ollama, transformers, vLLM) takes "
            "a KV prefix; LoRA runs (merged here) and full fine-tuning runs export")
    config = json.loads((source.base / CONFIG).read_text(encoding="utf-8"))
    bits = config.get("quantization_bit") or 0
    if bits:
        origin = (read_run_args(source.base) or {}).get("derived_from")
        where = f" (it was made from {origin})" if origin else ""
        raise ExportError(f"{source.base} is stored in INT{bits}{where}: export its float source instead, and pick "
                          "the file's precision with --type (q8_0 and q4_0 are llama.cpp's own INT8/INT4 blocks)")


def open_export(model_dir, *, lora=None, dtype: str = "auto", form: str | None = None) -> Exportable:
    """The model of `model_dir` (+ `lora`), its adapter merged, in `dtype` ("auto": as stored), with its tokenizer.
    `form` ("gguf", "hf", "ggml"): refuse, before any weight is read, a version that cannot be written so. A GGUF
    file of a checkpoint with no adapter, in the official layout or transformers' own form, is written from its
    files (`tensors`): the model is not loaded."""
    source = loading.resolve_run(model_dir, lora=lora)
    check_exportable(source)
    version = registry.of_directory(source.base)
    refusal = version.export_refusals.get(form)
    if refusal:
        raise ExportError(refusal)
    notes = []
    if source.lora_dir is not None and source.quantization_bit:
        notes.append(f"{source.lora_dir} trained on its base quantized to INT{source.quantization_bit} at load "
                     "(QLoRA); it is merged into the float base, which differs from the weights it trained against by "
                     "that rounding")
    tokenizer = loading.load_tokenizer(source)
    files = CheckpointTensors(source.base) if form == "gguf" and source.lora_dir is None else None
    if files is not None:
        from chatglm_tune.models.glm.config import glm_config  # GGUF holds this family only

        config = glm_config(json.loads((source.base / CONFIG).read_text(encoding="utf-8")), version=version.name)
    if files is not None and names_every_tensor(files, config):
        model, tensors = None, files
    else:
        model = loading.load_model(source, dtype=dtype, quantization_bit=0, quantize_embedding=False)
        config, tensors = model.config, (ModelTensors(model) if form == "gguf" else None)
    version.check_tokenizer(tokenizer, config)
    return Exportable(model, config, tensors, tokenizer, version, source, notes)
