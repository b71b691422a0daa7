"""How `batch_cache.BatchCache` cuts pad columns from, and joins the rows of, each kind of cache layer.

- Attention layers (transformers' `DynamicLayer`, the toolkit's `GrowingLayer`): keys / values [rows, heads, P + L, D]:
  the P-tuning prefix's P columns, then the real tokens left-padded to L.
- Sparse attention layers with an indexer (transformers' `DynamicIndexedLayer`: GLM-5.3-Flash's): the same, plus the
  indexer's keys [rows, P + L, D'] column for column with them (where the layer runs its own indexer). A zero entry
  there has validity 0 (its last channel), what a left pad has: the columns a join pads with are pads to the indexer.
- Linear attention layers (transformers' `LinearAttentionCacheLayerMixin`: GLM-5.3-Flash's KDA): per row a recurrent
  state and a short-convolution state, no columns. A left pad never entered them (the model keeps a pad out of its
  state), so cutting pad columns leaves them as they are and joining rows stacks them; but no column can be cut off
  their end either, so guesses a speculative step wrote cannot be taken back (`takes_back`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

COLUMNS = ("keys", "values", "indexer_keys")  # a layer's tensors whose next-to-last dimension is the columns


def is_recurrent(layer) -> bool:
    """Whether `layer` holds per-row states rather than columns (linear attention)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def takes_back(cache) -> bool:
    """Whether tokens written into `cache` can be taken back by cutting columns (no recurrent layer)."""
    return not any(is_recurrent(layer) for layer in cache.layers)


def _column_tensors(layer) -> list[str]:
    return [name for name in COLUMNS if getattr(layer, name, None) is not None]


def cut_columns(layer, prefix: int, lead: int) -> None:
    """Drop the `lead` columns after the first `prefix` of every column tensor of `layer` (left pads every row has)."""
    for name in _column_tensors(layer):
        states = getattr(layer, name)
        setattr(layer, name, torch.cat([states[..., :prefix, :], states[..., prefix + lead:, :]], dim=-2))


def join_rows(mine, theirs, pads: tuple[int, int], prefix: int) -> None:
    """`theirs`' rows after `mine`'s, in `mine`: each side's columns left-padded after the prefix by its count in
    `pads` (zeros), a recurrent layer's states stacked."""
    if is_recurrent(mine):
        for i in range(mine.number_of_states):
            if mine.is_conv_states_initialized[i]:
                mine.conv_states[i] = torch.cat([mine.conv_states[i], theirs.conv_states[i]], dim=0)
            if mine.is_recurrent_states_initialized[i]:
                mine.recurrent_states[i] = torch.cat([mine.recurrent_states[i], theirs.recurrent_states[i]], dim=0)
        return
    for name in _column_tensors(mine):
        parts = [_pad_after_prefix(getattr(layer, name), n, prefix) for layer, n in zip((mine, theirs), pads)]
        setattr(mine, name, torch.cat(parts, dim=0))


def _pad_after_prefix(states: torch.Tensor, n: int, prefix: int) -> torch.Tensor:
    if n == 0:
        return states
    pad = states.new_zeros(*states.shape[:-2], n, states.shape[-1])
    return torch.cat([states[..., :prefix, :], pad, states[..., prefix:, :]], dim=-2)
