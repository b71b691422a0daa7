"""A KV cache that grows into room it keeps, not by concatenation.

transformers' `DynamicCache` appends a step's keys and values with `torch.cat`: every step of every layer copies
the whole cache of every row again, a cost that grows with the rows and the tokens cached (the serving engine at
32 streams spent about a tenth of a step on it). Here each layer keeps its keys and values in buffers with spare
columns (`GrowingLayer`): a step writes its new entries in place, and `keys` / `values` are views of the filled
part, read by attention as before. Past the buffer's end the buffer is made anew with a quarter more room (`ROOM`
columns at the least): a copy of the cache every few dozen or hundred steps where the concatenation copied it every
step, for at most a quarter more memory than the cache holds.

Whoever replaces a layer's `keys` / `values` with tensors of their own (`BatchCache.select`, `trim`, `merge`, a
speculative `accept` that shifts rows) is free to: the layer notices they are no longer its buffers' views and
takes them into new buffers at the next update. A view of its own buffers cut shorter (an `accept` that drops
rejected guesses) is kept, its tail written over by the next tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

ROOM = 64  # columns a buffer grows by at the least


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys / values are views of the first columns of longer buffers (module docstring)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = None  # (keys, values) with room, or None
        self._views = None  # the (keys, values) views `grow` made last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        for view, new in zip(self.grow(n, key_states, value_states), (key_states, value_states)):
            view[..., -n:, :].copy_(new)
        return self.keys, self.values

    def grow(self, n: int, key_like: torch.Tensor | None = None, value_like: torch.Tensor | None = None):
        """`keys` / `values` `n` columns longer, the new ones not yet written (the caller writes them): (keys, values).
        The layer must hold entries already, or `key_like` / `value_like` give the rows, heads and widths."""
        filled = self.get_seq_length()
        end = filled + n
        if not self._holds(filled, end):
            likes = (self.keys if key_like is None else key_like, self.values if value_like is None else value_like)
            self._buffers = tuple(_roomy(old, like, filled, end) for old, like in zip((self.keys, self.values), likes))
        self.keys, self.values = self._views = tuple(buffer[..., :end, :] for buffer in self._buffers)
        return self.keys, self.values

    def _holds(self, filled: int, end: int) -> bool:
        """Whether `keys` / `values` are still views of the first `filled` columns of this layer's buffers, and
        those have room up to `end`."""
        if self._buffers is None or filled == 0:
            return False
        if self._views is not None and self.keys is self._views[0] and self.values is self._views[1]:
            return end <= self._buffers[0].shape[-2]  # the views made last, untouched
        return all(view.data_ptr() == buffer.data_ptr() and view.shape[:-2] == buffer.shape[:-2]
                   and view.stride() == buffer.stride() and end <= buffer.shape[-2]
                   for view, buffer in zip((self.keys, self.values), self._buffers))


def _roomy(old: torch.Tensor, new: torch.Tensor, filled: int, end: int) -> torch.Tensor:
    """A buffer of `new`'s rows, heads and width with room for a quarter more than `end` columns (`ROOM` more at the
    least), its first `filled` columns `old`'s."""
    capacity = end + max(ROOM, end // 4)
    buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
    if filled:
        buffer[..., :filled, :].copy_(old)
    return buffer


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s."""

    def __init__(self):  # Cache's own constructor: DynamicCache's would make DynamicLayers
        super(DynamicCache, self).__init__(layer_class_to_replicate=GrowingLayer)
