"""GLM-5.3-Flash's cache: per KDA layer a recurrent state and a short-convolution state, per sparse attention layer the
token latents and the indexer's keys; and the P-tuning prefix in it.

transformers' `DynamicCache(config=...)` holds a `LinearAttentionLayer` for each KDA layer (conv state [b, 3 x heads
x Dk, kernel], recurrent state [b, heads, Dk, Dv] float32, a count of the tokens seen) and a `DynamicIndexedLayer`
for each sparse attention layer (latents [b, 1, L, kv_lora_rank], rotary keys [b, 1, L, 0], the indexer's packed
keys [b, L, 2 x index_head_dim + 1]: key, pooling gate, validity). `HybridCache` holds the same with
`KdaStateLayer` for the KDA layers, which
- stores a step's recurrent state by assignment, where transformers copies it in place: a prefix's state is part
  of the autograd graph of a training step, and an in-place copy over a tensor the step saved for its backward
  pass breaks it;
- selects and repeats rows (`batch_select_indices`, `batch_repeat_interleave`: decoding drops finished rows);
- counts the prefix among its entries (`get_seq_length`), as the sparse layers' caches count their P zero latents:
  every layer then says how long the cached sequence is, prefix included (`reset` forgets it: empty again).
`adopt` gives an empty cache made without a config (the toolkit's decoding makes those) these layers.

The prefix (`seed_prefix`): every sparse layer gets P zero latents (their place is where the heads' prefix goes,
`next_layers.PrefixedSparseAttention`) and, where it runs an indexer, P zero indexer entries of validity 0 (never
a candidate); every KDA layer gets its prefix state as its recurrent state, a zero conv state, and "a previous
state" (transformers reads a layer's states only once it has one). A forward that keeps no cache (training,
scoring) gets the prefix in a `PrefixStates`, which stores nothing across calls: each layer's call sees the prefix
and its own new entries only, so a gradient-checkpointed layer, run again in the backward pass, sees what it saw.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicIndexedLayer, LinearAttentionLayer

from chatglm_tune.models.glm.next_prefix import is_linear


class KdaStateLayer(LinearAttentionLayer):
    """transformers' `LinearAttentionLayer` with assigned states, row selection and the prefix counted (module
    docstring)."""

    prefix = 0  # the P-tuning prefix's virtual tokens in the state

    def get_seq_length(self) -> int:
        return int(self.cumulative_length_linear) + self.prefix

    def reset(self) -> None:
        super().reset()
        self.prefix = 0  # empty again: the next forward puts the prefix in anew

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        if self.record_past:  # transformers' rollback keeps copies of past states: its own way
            return super().update_recurrent_state(recurrent_states, state_idx, **kwargs)
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self.recurrent_states[state_idx] = last
        self.is_recurrent_states_initialized[state_idx] = True
        return last

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _rows(self, take) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = take(self.conv_states[i])
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = take(self.recurrent_states[i])


def hybrid_layers(config) -> list:
    """A new cache layer for each layer of the model: `KdaStateLayer` or `DynamicIndexedLayer`."""
    return [KdaStateLayer() if is_linear(config, i) else DynamicIndexedLayer() for i in range(config.num_hidden_layers)]


class HybridCache(DynamicCache):
    """The model's cache (module docstring)."""

    def __init__(self, config):
        Cache.__init__(self, layers=hybrid_layers(config))


def adopt(cache: Cache, config) -> Cache:
    """`cache` as this model reads it: an empty one made without a config (layers made as they are first written,
    `DynamicLayer`s or the toolkit's) gets the model's layers; one whose layers are not of the model's kinds is
    refused (ValueError)."""
    if not cache.layers and cache.layer_class_to_replicate is not None:
        cache.layers, cache.layer_class_to_replicate = hybrid_layers(config), None
    kinds = [isinstance(layer, LinearAttentionLayer) if is_linear(config, i) else hasattr(layer, "update_indexer")
             for i, layer in enumerate(cache.layers)]
    if len(kinds) != config.num_hidden_layers or not all(kinds):
        raise ValueError(f"a {type(cache).__name__} of {[type(layer).__name__ for layer in cache.layers]} is not a "
                         f"cache of this model's layers {list(config.layer_types)} (give none, an empty one, or a "
                         "HybridCache)")
    return cache


def cached_entries(cache: Cache, config) -> int:
    """The sequence the cache holds, P-tuning prefix included: a sparse layer's entries (else the first KDA layer's
    tokens and prefix)."""
    for i, layer in enumerate(cache.layers):
        if not is_linear(config, i):
            return int(layer.get_seq_length())
    layer = cache.layers[0]
    return int(layer.get_seq_length()) + (0 if isinstance(layer, KdaStateLayer) else getattr(layer, "prefix", 0))


def seed_state(layer: LinearAttentionLayer, config, state: torch.Tensor, dtype: torch.dtype, prefix: int) -> None:
    """A KDA layer's cache (empty) with `state` [b, heads, Dk, Dv] as its recurrent state, a zero conv state
    [b, 3 x heads x Dk (q | k | v), kernel] in `dtype` and a previous state, so that transformers reads them."""
    if layer.has_previous_state[0]:
        raise ValueError("the prefix goes into an empty cache only")
    conv_channels, kernel = 3 * config.linear_num_heads * config.linear_head_dim, config.linear_conv_kernel_dim
    layer.device, layer.dtype = state.device, dtype
    layer.cumulative_length_linear = layer.cumulative_length_linear.to(state.device)
    layer.conv_states[0] = torch.zeros(state.shape[0], conv_channels, kernel, dtype=dtype, device=state.device)
    layer.conv_kernel_size[0] = kernel
    layer.recurrent_states[0] = state
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.prefix = prefix


def seed_prefix(cache: Cache, config, states: list[torch.Tensor | None], batch_size: int, prefix: int,
                like: torch.Tensor) -> Cache:
    """`cache` (empty) with the prefix (module docstring): `states[i]` the recurrent state of KDA layer i (None for a
    sparse layer), `prefix` = P, the entries in the dtype and on the device of `like` (a weight of the trunk)."""
    for i, (layer, state) in enumerate(zip(cache.layers, states, strict=True)):
        if is_linear(config, i):
            seed_state(layer, config, state, like.dtype, prefix)
            continue
        if layer.get_seq_length():
            raise ValueError("the prefix goes into an empty cache only")
        latents, rotary, indexer = _zero_entries(config, i, batch_size, prefix, like)
        layer.update(latents, rotary)
        if indexer is not None:
            layer.update_indexer(indexer)
    return cache


def _zero_entries(config, layer: int, batch_size: int, prefix: int, like: torch.Tensor):
    """(latents [b, 1, P, kv_lora_rank], rotary keys [b, 1, P, qk_rope_head_dim], indexer entries [b, P, 2 x
    index_head_dim + 1] or None for a layer without an indexer): zeros in `like`'s dtype, in the prefix's place."""
    shape = (batch_size, 1, prefix)
    latents, rotary = like.new_zeros(*shape, config.kv_lora_rank), like.new_zeros(*shape, config.qk_rope_head_dim)
    runs_indexer = config.indexer_types[layer] != "shared"
    indexer = like.new_zeros(batch_size, prefix, 2 * config.index_head_dim + 1) if runs_indexer else None
    return latents, rotary, indexer


class _PrefixKda(KdaStateLayer):
    """A KDA layer's prefix state, read-only: each call starts from it and stores nothing."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return torch.cat([torch.zeros_like(self.conv_states[state_idx]).to(conv_states.dtype), conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]

    def increase_count(self, state_idx: int) -> None:
        pass


class _PrefixIndexed(DynamicIndexedLayer):
    """A sparse layer's prefix entries, read-only: each call's entries are the prefix's and its own, kept until the
    next call (the indexer reads the layer's length after the attention wrote it)."""

    def __init__(self, latents: torch.Tensor, rotary: torch.Tensor, indexer: torch.Tensor | None):
        super().__init__()
        self.lazy_initialization(latents, rotary)
        self.prefix_entries = (latents, rotary, indexer)
        self.keys, self.values = latents, rotary

    def update(self, key_states, value_states, *args, **kwargs):
        latents, rotary, _ = self.prefix_entries
        self.keys, self.values = torch.cat([latents, key_states], dim=-2), torch.cat([rotary, value_states], dim=-2)
        return self.keys, self.values

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        self.lazy_initialization_indexer(indexer_key_states)
        self.indexer_keys = torch.cat([self.prefix_entries[2], indexer_key_states], dim=1)
        return self.indexer_keys


class PrefixStates(Cache):
    """The prefix as a read-only cache, for forwards that keep no cache (module docstring)."""

    def __init__(self, config, states: list[torch.Tensor | None], batch_size: int, prefix: int, like: torch.Tensor):
        layers = []
        for i, state in enumerate(states):
            if is_linear(config, i):
                layer = _PrefixKda()
                seed_state(layer, config, state, like.dtype, prefix)
            else:
                layer = _PrefixIndexed(*_zero_entries(config, i, batch_size, prefix, like))
            layers.append(layer)
        super().__init__(layers=layers)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """A fresh zero conv state: a one-token forward updates the one it is given in place."""
        return torch.zeros_like(self.layers[layer_idx].conv_states[state_idx])
