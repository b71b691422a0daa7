"""P-tuning v2 for ChatGLM2/3, GLM-4 and its successors: the prefix encoder and the caches that carry its keys/values;
the positions of the real tokens after it (`positions_from_mask`).

Official semantics (ChatGLM2/3 `modeling_chatglm.py` `PrefixEncoder` / `get_prompt`; GLM-4's own code has
no P-tuning and takes ChatGLM3's): `pre_seq_len` (P) learned key/value pairs per layer, of width
W = num_layers * 2 * kv_channels * multi_query_group_num; with `prefix_projection`,
Embedding(P, W) -> Linear(W, hidden) -> Tanh -> Linear(hidden, W) (ChatGLM-6B's projects from hidden
instead). The output [P, W] is viewed [P, 2 * num_layers, G, D]: layer l's key is slice
2l, its value 2l+1, used as they are (never rotated), after a dropout of 0.1 while training. They are
the first P entries of the KV cache; the first real token has position 0 (peft's PrefixTuning shifts
positions by P and gives other logits).

GLM-4.7-Flash's latent attention caches, per layer and token, the normed key/value latent and the rotated shared
key, which every head expands into its own key and value. Its prefix is each head's key (not rotated) and value
(W = num_layers * heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)), what every head attends to: a prefix
of cache latents is one such (each head's expansion of them; the prefixed model then equals transformers' with those
latents as the first cache entries), but one latent gives a head's key and value at once, and every head's from the
same few numbers: a prefix of latents learnt new relations on the tiny GLM-4.7-Flash at a tenth of the pace
(bench/training/adapt.py; figures: bench/results/kernel-notes.md). The
cache keeps P zero latents in the prefix's place (its lengths and masks as for any prefix); each layer's attention
puts its heads' prefix there (`latent_attention.LatentAttention.head_prefix`).

GLM-5.3-Flash's layers are of two kinds (KDA linear attention, sparse attention), each with its own prefix
(next_prefix.py): a config with "linear_attention" layers is handed there (`hybrid`), its width the sum of its layers'.

Official key names under `transformer.prefix_encoder.` (`embedding.weight`, `trans.0.*`, `trans.2.*`):
the model holds the encoder as `prefix_encoder`, so the key map renames the root only.
Initialisation is PyTorch's default, as in the official code.
"""

from __future__ import annotations

import torch
from torch import nn

from chatglm_tune.models.glm import next_prefix
from chatglm_tune.models.prefix import PrefixEncoder
from chatglm_tune.quant import cpu_matmul


def hybrid(config) -> bool:
    """Whether the config's layers are of two kinds, some KDA linear attention (GLM-5.3-Flash's: next_prefix.py)."""
    return next_prefix.LINEAR in (getattr(config, "layer_types", None) or ())


def cache_entry(config, layer: int = 0) -> tuple[int, int, int]:
    """(heads, key width, value width) of one prefix entry in layer `layer` (every layer's alike but in a `hybrid`
    config, whose `next_prefix.layer_entry` this is): the key/value groups and kv_channels of a `GlmConfig`, as its
    cache holds them; for latent attention (GLM-4.7-Flash) every attention head, its key's no-rotary and rotary dims and
    its value (the module docstring)."""
    if hybrid(config):
        return next_prefix.layer_entry(config, layer)
    if latent_attention(config):
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return config.num_key_value_heads, config.head_dim, config.head_dim


def latent_attention(config) -> bool:
    """Whether the config's attention is latent (GLM-4.7-Flash's: a key/value latent in the cache)."""
    return bool(getattr(config, "kv_lora_rank", None))


def prefix_width(config) -> int:
    """W = num_layers * 2 * kv_channels * multi_query_group_num for a `GlmConfig`; in general the layers' cache
    entries (`cache_entry`; a `hybrid` config's: `next_prefix.next_prefix_width`)."""
    if hybrid(config):
        return next_prefix.next_prefix_width(config)
    heads, key, value = cache_entry(config)
    return config.num_hidden_layers * heads * (key + value)


def prefix_formula(config) -> str:
    """How `prefix_width` is made, with this config's numbers."""
    if hybrid(config):
        return next_prefix.next_prefix_formula(config)
    if latent_attention(config):
        c = config
        return (f"num_layers * heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) = {c.num_hidden_layers} * "
                f"{c.num_attention_heads} * ({c.qk_nope_head_dim} + {c.qk_rope_head_dim} + {c.v_head_dim})")
    return (f"num_layers * 2 * kv_channels * multi_query_group_num = {config.num_hidden_layers} * 2 * "
            f"{config.head_dim} * {config.num_key_value_heads}")


def prefix_encoder(config) -> PrefixEncoder:
    """The encoder of this family: its projection starts from an embedding of width W (ChatGLM-6B's from hidden; a
    `hybrid` config's W: `prefix_width`)."""
    width, projection = prefix_width(config), bool(getattr(config, "prefix_projection", False))
    encoder = PrefixEncoder(config.pre_seq_len, width, config.hidden_size, projection, embedding_dim=width)
    return cpu_matmul.adopt(encoder)  # as the model's own Linears


def positions_from_mask(attention_mask: torch.Tensor, past: int, length: int) -> torch.Tensor:
    """Position ids [b, length] of the newest `length` tokens: cumsum(mask) - 1, 0 on (left) pads (the prefix has no
    position: the first real token's is 0).

    attention_mask: [b, past + length], 1 = token, over the real tokens only (no prefix columns).
    """
    if attention_mask.shape[-1] != past + length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} tokens; expected the {past} cached + {length} new "
            "(the mask of the whole sequence so far, without prefix columns)"
        )
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]


def reentrant_checkpointing(layer: nn.Module) -> bool:
    """Whether `layer` is gradient-checkpointed the reentrant way, which differentiates its positional inputs only: a
    prefix held in the cache would be backpropagated once per layer through one shared graph (P-tuning refuses it)."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return bool(getattr(func, "keywords", {}).get("use_reentrant", False))
