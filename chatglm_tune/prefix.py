"""P-tuning v2: `pre_seq_len` learned key/value pairs in front of every layer, for every ChatGLM version.

The encoder (official `PrefixEncoder`): an embedding of the P prefix positions, optionally through a
Tanh MLP (`prefix_projection`), giving each position one vector of width
W = 2 * num_layers * heads * head_dim. ChatGLM-6B (spec section 4): heads x head_dim = hidden, and the
projection starts from an embedding of width hidden. ChatGLM2/3 and GLM-4: heads = kv groups, head_dim =
kv_channels, and the projection starts from an embedding of width W. Official key names
(`transformer.prefix_encoder.embedding.weight`, `trans.0`/`trans.2` with projection), so official
P-tuning checkpoints load as they are. Like the official `ptuning/main.py`, the encoder stays in float32
while the trunk runs in half precision; its output is cast to the trunk's dtype, then dropout (0.1,
training only). Initialisation is PyTorch's default, as in the official code.

The prefix is always the first P entries of the KV cache, keys not rotated: `seed_cache` writes it into
a cache that decoding then extends; a forward that keeps no cache (training) reads it from a
`PrefixCache`, which stores nothing new.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

PREFIX_DROPOUT = 0.1


class PrefixEncoder(nn.Module):
    """prefix index [b, P] -> [b, P, width]: an embedding of `width`, or (projection) one of
    `embedding_dim` -> Linear(embedding_dim, hidden) -> Tanh -> Linear(hidden, width)."""

    def __init__(self, pre_seq_len: int, width: int, hidden_size: int, projection: bool, embedding_dim: int):
        super().__init__()
        self.prefix_projection = projection
        self.embedding = nn.Embedding(pre_seq_len, embedding_dim if projection else width)
        if projection:
            self.trans = nn.Sequential(nn.Linear(embedding_dim, hidden_size), nn.Tanh(), nn.Linear(hidden_size, width))

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        out = self.embedding(prefix)
        return self.trans(out) if self.prefix_projection else out


def prefix_key_values(encoder: PrefixEncoder, dropout: nn.Module, num_layers: int, heads: int, head_dim: int,
                      batch_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), each [b, heads, P, head_dim] in `dtype` (the cache layout).

    Channel `((2 * layer + kv) * heads + head) * head_dim + d` of the encoder output is element `d` of
    head `head` of the key (kv=0) or value (kv=1) of `layer`, as in the official `get_prompt`. One
    dropout mask covers keys and values alike.
    """
    weight = encoder.embedding.weight
    p = weight.shape[0]
    tokens = torch.arange(p, device=weight.device).expand(batch_size, p)
    kv = dropout(encoder(tokens).to(dtype))  # [b, P, W]
    kv = kv.view(batch_size, p, 2 * num_layers, heads, head_dim).permute(2, 0, 3, 1, 4)  # [2L, b, heads, P, hd]
    return [(kv[2 * layer], kv[2 * layer + 1]) for layer in range(num_layers)]


def seed_cache(cache: Cache, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """`cache` (empty) with the prefix as the first `pre_seq_len` entries of every layer."""
    if cache.get_seq_length() != 0:
        raise ValueError("the prefix goes into an empty cache only")
    for layer, (k, v) in enumerate(prefix):
        cache.update(k, v, layer)
    return cache


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
    backward pass sees the same keys/values, so the prefix survives checkpointing. The prefix tensors
    stay in the autograd graph: gradients reach the encoder.
    """

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[_PrefixLayer(k, v) for k, v in prefix])
