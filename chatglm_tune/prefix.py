"""P-tuning v2 prefix encoder: `pre_seq_len` learned key/value pairs in front of every layer (spec section 4).

Official key names (`transformer.prefix_encoder.embedding.weight`, and `trans.0`/`trans.2` with
projection), so an official P-tuning checkpoint loads as is. Like the official `ptuning/main.py`, the
encoder is meant to stay in float32 while the trunk runs in half precision; its output is cast to the
trunk's dtype. Initialisation is PyTorch's default, as in the official code.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from .config import ChatGLMConfig


class PrefixEncoder(nn.Module):
    """prefix token index [b, P] -> past keys/values [b, P, 2 * num_layers * hidden_size].

    Without projection: an embedding of that width. With projection:
    embedding [P, hidden] -> Linear(hidden, hidden) -> Tanh -> Linear(hidden, 2 * num_layers * hidden).
    """

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.prefix_projection = config.prefix_projection
        width = 2 * config.num_layers * config.hidden_size
        if self.prefix_projection:
            self.embedding = nn.Embedding(config.pre_seq_len, config.hidden_size)
            self.trans = nn.Sequential(
                nn.Linear(config.hidden_size, config.hidden_size),
                nn.Tanh(),
                nn.Linear(config.hidden_size, width),
            )
        else:
            self.embedding = nn.Embedding(config.pre_seq_len, width)

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        out = self.embedding(prefix)
        return self.trans(out) if self.prefix_projection else out


def prefix_key_values(
    encoder: PrefixEncoder, dropout: nn.Dropout, config: ChatGLMConfig, batch_size: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), each [b, heads, P, head_dim] in `dtype`; keys are not rotated.

    Channel `((2 * layer + kv) * heads + head) * head_dim + d` of the encoder output is element
    `d` of head `head` of the key (kv=0) or value (kv=1) of `layer`, as in the official `get_prompt`.
    One dropout mask covers keys and values alike.
    """
    p, nh, hd = config.pre_seq_len, config.num_attention_heads, config.head_dim
    weight = encoder.embedding.weight
    tokens = torch.arange(p, device=weight.device).expand(batch_size, p)
    kv = encoder(tokens).to(dtype)  # [b, P, 2 * L * H]
    kv = dropout(kv.view(batch_size, p, 2 * config.num_layers, nh, hd))
    kv = kv.permute(2, 0, 3, 1, 4)  # [2L, b, nh, P, hd]
    return [(kv[2 * layer], kv[2 * layer + 1]) for layer in range(config.num_layers)]


def seed_cache(cache: Cache, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """`cache` (empty) with the prefix as its first `pre_seq_len` entries of every layer."""
    for layer, (k, v) in enumerate(prefix):
        cache.update(k, v, layer)
    return cache


class PrefixCache(Cache):
    """The prefix as a cache that keeps nothing new: a training forward (no `use_cache`) sees the prefix
    as every layer's first cached entries, exactly as decoding does, and `update` stores nothing, so a
    layer recomputed by gradient checkpointing sees the same keys and values the second time."""

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[])
        self.prefix = prefix

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k, v = self.prefix[layer_idx]
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix[layer_idx][0].shape[2]
