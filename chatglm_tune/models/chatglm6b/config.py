"""ChatGLM-6B configuration: the official `config.json` field names, and named presets.

Reference: THUDM/chatglm-6b `configuration_chatglm.py`. The class defaults of the
official file are stale (pre-"slim" vocabulary of 150528); ours are the released ChatGLM-6B values,
and a `config.json` always wins over them.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from chatglm_tune.options import raise_problems

# The depth the official GLMBlock assumes when it scales its residual: `GLMBlock(num_layers=28)` is a
# constructor default that ChatGLMModel never overrides, so alpha = sqrt(2 * 28) for every config.
OFFICIAL_ALPHA_LAYERS = 28
# Module names (inside `transformer.layers.N`) that LoRA targets, and that INT8/INT4 quantization swaps for
# `quant.modules.QuantizedLinear`s (the official `model.quantize(bits)`: the four Linears of every block).
LORA_TARGETS = ("query_key_value",)
QUANTIZABLE_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
# config.json fields only ChatGLM-6B has (the versions after it say `model_type: chatglm` too)
CONFIG_FIELDS = ("position_encoding_2d", "inner_hidden_size", "gmask_token_id")


@strict
class ChatGLMConfig(PreTrainedConfig):
    """Hyper-parameters of a ChatGLM-6B-shaped model (official field names).

    `pre_seq_len`/`prefix_projection` switch on P-tuning v2; `quantization_bit` (0, 4 or 8) says the
    four Linears of every block hold official-layout integer weights; `quantization_group_size`
    (0 = one scale per output row, the official layout) is our group-wise INT4 extension.
    """

    model_type = "chatglm"
    keys_to_ignore_at_inference = ["cache"]
    # The generic names transformers' generation and cache code look for.
    attribute_map = {"num_hidden_layers": "num_layers", "max_position_embeddings": "max_sequence_length"}

    vocab_size: int = 130528
    hidden_size: int = 4096
    num_layers: int = 28
    num_attention_heads: int = 32
    inner_hidden_size: int = 16384
    layernorm_epsilon: float = 1e-5
    max_sequence_length: int = 2048
    position_encoding_2d: bool = True
    bos_token_id: int | None = 130004
    eos_token_id: int | None = 130005
    mask_token_id: int = 130000
    gmask_token_id: int = 130001
    pad_token_id: int | None = 3
    use_cache: bool = True
    pre_seq_len: int | None = None
    prefix_projection: bool = False
    quantization_bit: int = 0
    quantization_group_size: int = 0
    tie_word_embeddings: bool = True
    # Dropout on each block's attention and MLP outputs while training. The released model has none
    # (the official code: no dropout); the from-scratch tiny preset uses it against memorising small sets.
    hidden_dropout: float = 0.0

    def validate_architecture(self):
        problems = []
        if self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                            f"{self.num_attention_heads}")
        elif (self.hidden_size // self.num_attention_heads) % 4:
            problems.append(f"head_dim {self.hidden_size // self.num_attention_heads} must be a multiple of 4 (2D "
                            "rotary)")
        if self.quantization_bit not in (0, 4, 8):
            problems.append(f"quantization_bit must be 0, 4 or 8, got {self.quantization_bit}")
        if self.pre_seq_len is not None and self.pre_seq_len < 1:
            problems.append(f"pre_seq_len must be None or >= 1, got {self.pre_seq_len}")
        raise_problems(problems, "invalid ChatGLMConfig: ")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ChatGLMConfig":
        """A named preset (`chatglm-6b`, `mid`, `tiny`), with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # The released model: THUDM/chatglm-6b's config.json values.
    "chatglm-6b": {},
    # The mid-size config of the benchmarks: real vocabulary, small trunk.
    "mid": dict(hidden_size=1024, num_layers=8, num_attention_heads=16, inner_hidden_size=4096),
    # The from-scratch demo model: its vocabulary and special ids come from the tokenizer built for it.
    # 8 heads of 16 (rather than 4 of 32): more pointers for copying spans, same size and cost. 3 layers of
    # MLP 256 rather than 2 of 512: better on unseen sets in the same time (options.py, above TINY_DEMO).
    # Dropout 0.2: on sets of 2,000-4,000 records the model otherwise learns its train set by heart.
    "tiny": dict(hidden_size=128, num_layers=3, num_attention_heads=8, inner_hidden_size=256, vocab_size=2048,
                 hidden_dropout=0.2),
}
