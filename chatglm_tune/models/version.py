"""A model version as the rooms above the model families see it: the interface every family implements.

A `Version` holds its prompt format (`format`, a `batches.PromptFormat`: prompts, answers, stop ids, chat)
and says as data what the rest of the package needs: the Linears LoRA targets (`lora_targets`) and quantization
swaps (`quantizable_linears`), where the P-tuning prefix encoder lives (`prefix_module`), what export.py
cannot write it as (`export_refusals`), whether its transformers directory is transformers' own (`hf_native`) and
whether it trains on packed rows (`packing_refusal`). It loads its model and tokenizer from a directory and builds the
random tiny model of the from-scratch demos. The registry (`models/registry.py`) maps names and directories to
versions; the families never import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chatglm_tune.data.batches import PromptFormat
from chatglm_tune.options import TINY_CONTEXT


@dataclass(frozen=True)
class Version:
    format: PromptFormat
    config_class: type  # the transformers config class its config.json reads as
    lora_targets: tuple[str, ...]
    quantizable_linears: tuple[str, ...]
    prefix_module: str  # where the P-tuning prefix encoder lives in the model
    # export.py: the formats ("gguf", "hf", "ggml") this version cannot be written as, each with why and what
    # works instead; its model type in chatglm.cpp's GGML files (None: none).
    export_refusals: Mapping[str, str] = field(default_factory=dict)
    ggml_model_type: int | None = None
    # export.py --format hf: a class of transformers' own (plain transformers and vLLM load it), else the
    # official layout, which this toolkit and the official remote code load.
    hf_native: bool = True
    layers_field: str = "num_layers"  # the config field of its number of decoder layers (a tiny model's depth)
    # train.py --packing: why this version cannot train on packed rows (several examples a row), None where it can
    packing_refusal: str | None = None

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def title(self) -> str:
        return self.format.title

    def prefix_encoder(self, model):
        return model.get_submodule(self.prefix_module)

    def prefix_state(self, model) -> dict:
        """The trainable P-tuning weights of `model` (what a P-tuning run saves)."""
        prefix = self.prefix_module + "."
        return {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}

    def check_tokenizer(self, tokenizer, config) -> None:
        """ValueError unless the tokenizer's vocabulary fits the model."""
        if len(tokenizer) > config.vocab_size:
            raise ValueError(f"the tokenizer does not belong to this model: vocabulary: tokenizer {len(tokenizer)} "
                             f"tokens, model {config.vocab_size} rows")

    def mismatch_hint(self, theirs: str, config_file) -> str:
        """What to add to the error when a P-tuning prefix's config.json names version `theirs` instead."""
        return ""

    def load_model(self, path, **kwargs):
        """The model of a directory (dtype, device, pre_seq_len, prefix_projection, quantization_bit,
        group_size, quantize_embedding)."""
        raise NotImplementedError

    def load_tokenizer(self, directory, **kwargs):
        """The tokenizer of a directory; `kwargs` override tokenizer_config.json."""
        raise NotImplementedError

    def prompt_format_of(self, directory=None, *, chat_template_of: str | None = None):
        """The prompt format the tokenizer of `directory` (None: a tiny preset's, carrying `chat_template_of`'s
        template where given) will have, known before it is loaded: the version's, unless its chat template
        chooses another (a `glm4_moe` directory with GLM-4.7's template form)."""
        return self.format

    def tiny_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None):
        """The tiny model's tokenizer: trained on `corpus` and written to `directory`, or loaded from there where a
        resumed run (or a dry run) wrote it; `chat_template_of`: a version whose released chat template it carries
        instead of its own (a tiny GLM-4.7: GLM-4.5's architecture, GLM-4.7-Flash's template form)."""
        raise NotImplementedError

    def tiny(self, corpus: list[str], directory: Path, *, context: int = TINY_CONTEXT, **config_overrides):
        """(random tiny model, tokenizer trained on `corpus`, written to `directory`): the from-scratch demo, its
        config's context `context` tokens at least (a run's max_len: what it is trained on, served within)."""
        raise NotImplementedError
