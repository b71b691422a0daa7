"""ChatGLM-6B as the rest of the toolkit sees it (`models.version.Version`), and how its files are recognised."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chatglm_tune.data.batches import PromptFormat, SpecialIds
from chatglm_tune.models.chatglm6b.config import CONFIG_FIELDS, LORA_TARGETS, QUANTIZABLE_LINEARS, ChatGLMConfig
from chatglm_tune.models.chatglm6b.format import FORMAT
from chatglm_tune.models.version import Version
from chatglm_tune.options import TINY_CONTEXT, raise_problems


@dataclass(frozen=True)
class ChatGLM6B(Version):
    format: PromptFormat = FORMAT
    config_class: type = ChatGLMConfig
    lora_targets: tuple[str, ...] = LORA_TARGETS
    quantizable_linears: tuple[str, ...] = QUANTIZABLE_LINEARS
    prefix_module: str = "transformer.prefix_encoder"
    export_refusals: Mapping[str, str] = field(default_factory=lambda: {
        "gguf": "ChatGLM-6B has no llama.cpp architecture (GLM's 2D positions, bidirectional attention over the "
                "prompt): use --format ggml, which chatglm.cpp runs"})
    ggml_model_type: int | None = 1
    hf_native: bool = False  # transformers has no ChatGLM-6B class: its directory is the official layout

    def load_model(self, path, *, quantize_embedding: bool = False, **kwargs):
        from chatglm_tune.models.chatglm6b.modeling import ChatGLMForConditionalGeneration

        if "group_size" in kwargs:  # `from_pretrained` names it quantization_group_size
            kwargs["quantization_group_size"] = kwargs.pop("group_size")
        return ChatGLMForConditionalGeneration.from_pretrained(path, quantize_embedding=quantize_embedding, **kwargs)

    def load_tokenizer(self, directory, **kwargs):
        from chatglm_tune.models.chatglm6b.tokenizer import ChatGLMTokenizer

        return ChatGLMTokenizer.from_pretrained(directory, **kwargs)

    def check_tokenizer(self, tokenizer, config) -> None:
        """Also: its special ids equal the config's."""
        ours, theirs = SpecialIds.of(tokenizer), SpecialIds.of(config)
        problems = [f"{k}: tokenizer {v}, model {getattr(theirs, k)}" for k, v in asdict(ours).items()
                    if v != getattr(theirs, k)]
        raise_problems(problems, "the tokenizer does not belong to this model: ")
        super().check_tokenizer(tokenizer, config)

    def tiny_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None):
        from chatglm_tune.models.chatglm6b.tokenizer import ChatGLMTokenizer, train_tokenizer

        if chat_template_of is not None:
            raise ValueError(f"{self.title} has no chat template to choose")
        if (Path(directory) / "tokenizer_config.json").exists():  # a resumed run keeps its tokenizer
            return ChatGLMTokenizer.from_pretrained(directory)
        return train_tokenizer(corpus, directory, max_piece_length=1)  # character-level: see train_tokenizer

    def tiny(self, corpus: list[str], directory: Path, *, context: int = TINY_CONTEXT, chat_template_of=None,
             **config_overrides):
        from chatglm_tune.models.chatglm6b.modeling import ChatGLMForConditionalGeneration

        tokenizer = self.tiny_tokenizer(corpus, directory, chat_template_of=chat_template_of)
        config = ChatGLMConfig.from_name("tiny", **config_overrides, **tokenizer.config_overrides())
        config.max_sequence_length = max(config.max_sequence_length, context)
        return ChatGLMForConditionalGeneration(config), tokenizer


CHATGLM6B = ChatGLM6B()


MODEL_TYPES = ("chatglm",)  # config.json's model_type (what the registry reads of this family)


def detect(raw: dict, directory=None) -> str | None:
    """"chatglm" for a ChatGLM-6B config.json dict, else None."""
    return FORMAT.name if raw.get("model_type") != "glm" and any(k in raw for k in CONFIG_FIELDS) else None


def detect_tokenizer(directory: Path) -> str | None:
    """"chatglm" for a directory holding ChatGLM-6B's tokenizer (`ice_text.model`), else None."""
    from chatglm_tune.models.chatglm6b.tokenizer import VOCAB_FILE

    return FORMAT.name if (Path(directory) / VOCAB_FILE).is_file() else None
