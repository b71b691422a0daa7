"""The KV cache of a batch of rows decoding together, and the forwards that fill it: the prompt's, then one
token a row a step. `generate` and the serving engine both decode through it.

Layout: every layer's keys/values `[rows, heads, P + L, D]`: the P-tuning prefix (the model's first
`pre_seq_len` entries, put there by the model at the prefill), then the real tokens left-padded to a
common length L; the 2D mask `[rows, L]` covers the real tokens (1 = token, 0 = pad). Masked pads weigh
exactly 0 in attention, and positions come from each row's own tokens (`model.prompt_positions` /
`next_positions`: ChatGLM-6B's 2D GLM positions; the other models return None and derive them from the
mask), so a row's tokens do not depend on its neighbours, up to the float rounding of batched products.

The model gets no mask while nothing is padded (`padded`, kept up to date where rows change: never
recomputed on a decoding step, which only appends a real token to every row). Rows leave with `select`
(a finished row costs nothing after); `trim` cuts the pad columns every row has on its left (pads left by
a long row that finished), `merge` joins two batches with the shorter side left-padded after the prefix:
the engine's continuous batching; each kind of cache layer is cut and joined as `cache_layers` says (GLM-5.3-Flash's
linear attention layers hold per-row states, no columns, and take no guesses back: no speculative `verify`). The cache
is a `GrowingCache` (a decode step writes into room kept at the end of
each layer's buffers, where transformers' `DynamicCache` concatenates the whole cache again); the methods here
may replace a layer's tensors, which it then takes into new buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from chatglm_tune.decoding.cache_layers import cut_columns, join_rows, takes_back
from chatglm_tune.decoding.growing_cache import GrowingCache


def last_scores(model, ids: torch.Tensor, cache: DynamicCache, **inputs) -> torch.Tensor:
    """The model on `ids` [b, s] over `cache` (extended in place): the scores of each row's last position [b, V]."""
    return model(ids, cache=cache, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]


@dataclass(eq=False)
class BatchCache:
    """Rows decoding together: their cache, pad mask and (ChatGLM-6B) next positions; see the module docstring."""

    cache: DynamicCache
    mask: torch.Tensor  # [rows, L] long
    next_positions: torch.Tensor | None  # ChatGLM-6B's positions of each row's next token; None for the others
    prefix_len: int  # the P-tuning prefix's entries at the start of every layer's cache
    padded: bool  # any 0 in `mask`: the model gets the mask only then
    verifying: int = 0  # the columns of the last `verify`, until `accept`

    @classmethod
    def prefill(cls, model, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple["BatchCache", torch.Tensor]:
        """Left-padded prompts `ids` [b, s] (`mask` [b, s], None: no padding) into a new cache: (it, the scores
        of each prompt's last position [b, V])."""
        padded = mask is not None and not bool(mask.all())
        model_mask = mask if padded else None
        positions = model.prompt_positions(ids, model_mask)  # ChatGLM-6B: [b, 2, s]; the others: None
        batch = cls(GrowingCache(), torch.ones_like(ids) if mask is None else mask.long(), None, prefix_length(model),
                    padded)
        scores = last_scores(model, ids, batch.cache, position_ids=positions, attention_mask=model_mask)
        batch.next_positions = None if positions is None else model.next_positions(positions[..., -1:])
        return batch, scores

    @classmethod
    def empty(cls, model, device) -> "BatchCache":
        """One row with nothing cached yet, to fill a chunk at a time (`extend`)."""
        return cls(GrowingCache(), torch.ones(1, 0, dtype=torch.long, device=device), None, prefix_length(model), False)

    def extend(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The next chunk of a lone, unpadded prompt whose positions follow from the cache (causal models):
        the scores of its last position [1, V]."""
        scores = last_scores(model, ids, self.cache, position_ids=None, attention_mask=None)
        self.mask = torch.cat([self.mask, self.mask.new_ones(1, ids.shape[1])], dim=1)
        return scores

    def step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """One token a row in (`tokens` [rows]), the scores of the next out [rows, V]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        scores = last_scores(model, tokens[:, None], self.cache, position_ids=self.next_positions,
                             attention_mask=self.mask if self.padded else None)
        if self.next_positions is not None:
            self.next_positions = model.next_positions(self.next_positions)
        return scores

    def verify(self, model, pending: list[int], guesses: list[list[int]]) -> torch.Tensor:
        """Each row's pending token and its guesses in one forward, to check the guesses (speculative decoding):
        the rows are right-padded to the longest (pads masked). The scores after each position [rows, W, V];
        `accept` then says how many of each row's stay in the cache. A cache of recurrent states (linear attention)
        cannot take tokens back: ValueError."""
        if not takes_back(self.cache):
            raise ValueError(f"{type(model).__name__} keeps recurrent states (linear attention) that cannot take back "
                             "rejected guesses: decode it without speculative drafts")
        width = 1 + max(len(g) for g in guesses)
        device = self.mask.device
        tokens = torch.tensor([[p] + g + [p] * (width - 1 - len(g)) for p, g in zip(pending, guesses)], device=device)
        self.verifying = width
        lengths = torch.tensor([1 + len(g) for g in guesses], device=device)
        real = torch.arange(width, device=device)[None, :] < lengths[:, None]
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        self.padded = self.padded or not bool(real.all())
        positions = None
        if self.next_positions is not None:  # ChatGLM-6B: the block position counts on, the other stays
            positions = self.next_positions.expand(len(pending), 2, width).clone()
            positions[:, 1] += torch.arange(width, device=positions.device)
        return model(tokens, cache=self.cache, use_cache=True, logits_to_keep=width, position_ids=positions,
                     attention_mask=self.mask if self.padded else None).logits

    def accept(self, kept: list[int]) -> None:
        """After `verify` of W tokens a row: only the first `kept[r]` of row r's stay (its pending token and the
        guesses the model agreed with); the rows are left-padded to a common length again."""
        old = self.mask.shape[1] - self.verifying
        self.verifying = 0
        ends = [old + k for k in kept]  # each row's real columns end here
        length = max(ends)
        shifts = torch.tensor([length - e for e in ends], device=self.mask.device)
        columns = torch.arange(length, device=self.mask.device)[None, :] - shifts[:, None]  # [rows, length]
        valid = columns >= 0
        index = columns.clamp(min=0)
        self.mask = self.mask.gather(1, index) * valid
        p = self.prefix_len
        if bool((shifts == 0).all()):  # every row kept as many: cut the tail
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :p + length, :], layer.values[..., :p + length, :]
        else:
            for layer in self.cache.layers:
                layer.keys, layer.values = (_shift_rows(t, index, p) for t in (layer.keys, layer.values))
        if self.next_positions is not None:
            self.next_positions = self.next_positions.clone()
            self.next_positions[:, 1] += torch.tensor(kept, device=self.next_positions.device)[:, None]
        self.padded = not bool(self.mask.all())

    def select(self, index: torch.Tensor) -> None:
        """Only the rows at `index` (1D long, ascending) stay; a row repeated in `index` is copied (rows that share
        a prompt)."""
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        if self.next_positions is not None:
            self.next_positions = self.next_positions[index]
        self.padded = self.padded and not bool(self.mask.all())

    def trim(self) -> None:
        """Cut the pad columns that every row has on its left."""
        lead = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())
        if lead == 0:
            return
        for layer in self.cache.layers:
            cut_columns(layer, self.prefix_len, lead)
        self.mask = self.mask[:, lead:]
        self.padded = not bool(self.mask.all())

    def merge(self, other: "BatchCache") -> None:
        """`other`'s rows after these, in this cache: the shorter side left-padded after the prefix."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        pads = (length - self.mask.shape[1], length - other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            join_rows(mine, theirs, pads, self.prefix_len)
        masks = [torch.cat([m.new_zeros(m.shape[0], length - m.shape[1]), m], dim=1) for m in (self.mask, other.mask)]
        self.mask = torch.cat(masks, dim=0)
        if self.next_positions is not None:
            self.next_positions = torch.cat([self.next_positions, other.next_positions], dim=0)
        self.padded = not bool(self.mask.all())


def _shift_rows(states: torch.Tensor, index: torch.Tensor, p: int) -> torch.Tensor:
    """`states` [rows, heads, p + L, D] with each row's columns after the prefix taken at `index` [rows, L']."""
    rows, heads, _, dim = states.shape
    taken = states[..., p:, :].gather(2, index[:, None, :, None].expand(rows, heads, index.shape[1], dim))
    return torch.cat([states[..., :p, :], taken], dim=2)


def prefix_length(model) -> int:
    """The P-tuning prefix's entries at the start of the model's cache (0 without a prefix)."""
    return getattr(model.config, "pre_seq_len", None) or 0
