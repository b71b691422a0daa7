"""P-tuning v2 for ChatGLM2/3, GLM-4 and its successors: the prefix encoder and the caches that carry its keys/values.

Official semantics (ChatGLM2/3 `modeling_chatglm.py` `PrefixEncoder` / `get_prompt`; GLM-4's own code has
no P-tuning and takes ChatGLM3's): `pre_seq_len` (P) learned key/value pairs per layer, of width
W = num_layers * 2 * kv_channels * multi_query_group_num; with `prefix_projection`,
Embedding(P, W) -> Linear(W, hidden) -> Tanh -> Linear(hidden, W) (ChatGLM-6B's projects from hidden
instead). The output [P, W] is viewed [P, 2 * num_layers, G, D]: layer l's key is slice
2l, its value 2l+1, used as they are (never rotated), after a dropout of 0.1 while training. They are
the first P entries of the KV cache; the first real token has position 0 (peft's PrefixTuning shifts
positions by P and gives other logits).

GLM-4.7-Flash's latent attention caches, per layer and token, the normed key/value latent and the rotated shared
key instead: its prefix is those (W = num_layers * (kv_lora_rank + qk_rope_head_dim)), so a prefixed model equals
transformers' with the prefix as the first cache entries.

Official key names under `transformer.prefix_encoder.` (`embedding.weight`, `trans.0.*`, `trans.2.*`):
the model holds the encoder as `prefix_encoder`, so the key map renames the root only.
Initialisation is PyTorch's default, as in the official code.
"""

from __future__ import annotations

from chatglm_tune.prefix import PrefixEncoder


def cache_entry(config) -> tuple[int, int, int]:
    """(heads, key width, value width) of one token's cache entry in one layer: the key/value groups and
    kv_channels of a `GlmConfig`; for latent attention (GLM-4.7-Flash) one "head" of the normed key/value latent
    (`kv_lora_rank`) and the rotated shared key (`qk_rope_head_dim`), as transformers' cache holds them."""
    if getattr(config, "kv_lora_rank", None):
        return 1, config.kv_lora_rank, config.qk_rope_head_dim
    return config.num_key_value_heads, config.head_dim, config.head_dim


def prefix_width(config) -> int:
    """W = num_layers * 2 * kv_channels * multi_query_group_num for a `GlmConfig`; in general the layers' cache
    entries (`cache_entry`)."""
    heads, key, value = cache_entry(config)
    return config.num_hidden_layers * heads * (key + value)


def prefix_formula(config) -> str:
    """How `prefix_width` is made, with this config's numbers."""
    if getattr(config, "kv_lora_rank", None):
        return (f"num_layers * (kv_lora_rank + qk_rope_head_dim) = {config.num_hidden_layers} * "
                f"({config.kv_lora_rank} + {config.qk_rope_head_dim})")
    return (f"num_layers * 2 * kv_channels * multi_query_group_num = {config.num_hidden_layers} * 2 * {config.head_dim} * "
            f"{config.num_key_value_heads}")


def prefix_encoder(config) -> PrefixEncoder:
    """The encoder of this family: its projection starts from an embedding of width W (ChatGLM-6B's from hidden)."""
    width = prefix_width(config)
    return PrefixEncoder(config.pre_seq_len, width, config.hidden_size, bool(config.prefix_projection), embedding_dim=width)
