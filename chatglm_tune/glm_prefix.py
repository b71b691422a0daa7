"""P-tuning v2 for ChatGLM2/3 and GLM-4: the prefix encoder and the caches that carry its keys/values.

Official semantics (ChatGLM2/3 `modeling_chatglm.py` `PrefixEncoder` / `get_prompt`; GLM-4's own code has
no P-tuning and takes ChatGLM3's): `pre_seq_len` (P) learned key/value pairs per layer, of width
W = num_layers * 2 * kv_channels * multi_query_group_num; with `prefix_projection`,
Embedding(P, W) -> Linear(W, hidden) -> Tanh -> Linear(hidden, W) (ChatGLM-6B's projects from hidden
instead: see prefix.py). The output [P, W] is viewed [P, 2 * num_layers, G, D]: layer l's key is slice
2l, its value 2l+1, used as they are (never rotated), after a dropout of 0.1 while training. They are
the first P entries of the KV cache; the first real token has position 0 (peft's PrefixTuning shifts
positions by P and gives other logits).

Official key names under `transformer.prefix_encoder.` (`embedding.weight`, `trans.0.*`, `trans.2.*`):
the model holds the encoder as `prefix_encoder`, so the key map renames the root only.
Initialisation is PyTorch's default, as in the official code.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

PREFIX_DROPOUT = 0.1


def prefix_width(config) -> int:
    """W = num_layers * 2 * kv_channels * multi_query_group_num, for a `GlmConfig`."""
    return config.num_hidden_layers * 2 * config.head_dim * config.num_key_value_heads


class GlmPrefixEncoder(nn.Module):
    """prefix index [b, P] -> [b, P, W] (W = `prefix_width(config)`), optionally through a Tanh MLP."""

    def __init__(self, config):
        super().__init__()
        width = prefix_width(config)
        self.prefix_projection = bool(config.prefix_projection)
        self.embedding = nn.Embedding(config.pre_seq_len, width)
        if self.prefix_projection:
            self.trans = nn.Sequential(nn.Linear(width, config.hidden_size), nn.Tanh(), nn.Linear(config.hidden_size, width))

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        out = self.embedding(prefix)
        return self.trans(out) if self.prefix_projection else out


def prefix_key_values(
    encoder: GlmPrefixEncoder, dropout: nn.Module, config, batch_size: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each [b, G, P, D] in `dtype` (the cache layout); keys are not rotated.

    As the official `get_prompt`: encoder output cast to the compute dtype, then dropout, then split.
    """
    p, g, d, layers = config.pre_seq_len, config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    weight = encoder.embedding.weight
    tokens = torch.arange(p, device=weight.device).expand(batch_size, p)
    kv = dropout(encoder(tokens).to(dtype))  # [b, P, W]
    kv = kv.view(batch_size, p, 2 * layers, g, d).permute(2, 0, 3, 1, 4)  # [2L, b, G, P, D]
    return [(kv[2 * layer], kv[2 * layer + 1]) for layer in range(layers)]


def fill_cache(cache: DynamicCache, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the prefix as the first entries of an empty cache, layer by layer."""
    if cache.get_seq_length() != 0:
        raise ValueError("the prefix goes into an empty cache only")
    for layer, (k, v) in enumerate(pairs):
        cache.update(k, v, layer)


class _PrefixLayer(DynamicLayer):
    """A cache layer holding only the prefix: `update` returns [prefix | new] and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PrefixCache(Cache):
    """The prefix as a read-only cache, for forwards that keep no cache (training, scoring).

    Writing nothing makes a layer's forward repeatable: a gradient-checkpointed layer recomputed in the
    backward pass sees the same keys/values, so the prefix survives checkpointing (transformers drops
    any cache a checkpointed layer is given unless the layer says it only reads it; the model says so
    for exactly this cache). The prefix tensors stay in the autograd graph: gradients reach the encoder.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[_PrefixLayer(k, v) for k, v in pairs])
