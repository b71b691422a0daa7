"""GLM-5.3-Flash's attention layers with the P-tuning prefix (next_prefix.py), and left pads that change no row.

Sparse attention (`PrefixedSparseAttention`): transformers' `Glm5NextTextAttention` caches, per token, the normed
key/value latent and a shared rotary key (0 wide: the layer has no rotary dims), which `expand_kv` turns into every
head's key and value. The prefix is each head's own keys and values (`head_prefix`, which the model hands every
layer whenever it puts the prefix into an empty cache), in the place of P zero latents at the start of the cache,
as GLM-4.7-Flash's. Which cached tokens a query attends to is the indexer's choice (`Glm5NextTextIndexer`): it
scores pools of `index_kpool` tokens, the first pool starting at the first *valid* token of the row (a validity
channel the indexer caches beside its keys: 0 on left pads), and returns the tokens of the best pools and of the
incomplete last one. The prefix's P entries in the indexer's cache are zeros with validity 0: it treats them as it
treats left pads, so they are never a candidate, the pools are cut from the first real token as without a prefix,
and a query's candidates and their scores are the ones the same hidden states score without a prefix (the top-k
token indices are theirs plus P, but where scores tie exactly, which top-k breaks either way). The prefix reaches
the indexer only through the hidden states, which the earlier layers computed with it. `build_attention_mask_from_topk`
then makes the P prefix columns visible to every query, its pads' too (which the indexer lets see nothing:
with the prefix they see it alone, a finite output that no other position reads). Layers that reuse an earlier
layer's selection (`indexer_types` "shared") get indices counted the same way, the prefix included.

KDA linear attention (`PrefixedLinearAttention`): transformers zeroes a pad's hidden state, so a pad writes nothing
into the recurrent state (its key, value and short-convolution output are zero), but its forget gate, computed from
that zero input, still decays the state: harmless from a zero state, it would shrink a prefix's state by as many
pads as a row has. Here a pad's decay is 0 (`PadKeepingForgetGate`), so a left-padded row's state reaches its
first token as the prefix left it, and the row computes what it computes alone. Without a prefix nothing changes
but rounding (a zero state decays to zero either way).
"""

from __future__ import annotations

import torch
from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextTextAttention, Glm5NextTextForgetGate,
                                                              Glm5NextTextLinearAttention)

from chatglm_tune.models.glm.latent_attention import HeadPrefix


class PrefixedSparseAttention(HeadPrefix, Glm5NextTextAttention):
    """`Glm5NextTextAttention` with each head's prefix keys and values in place of the cache's first P latents
    (`latent_attention.HeadPrefix`, set by the model's `prefix_states`), visible to every query (module docstring)."""

    def build_attention_mask_from_topk(self, topk_indices: torch.Tensor, query_states: torch.Tensor,
                                       kv_length: int) -> torch.Tensor:
        """transformers' mask of the indexer's picks (True / 0.0 = attend), with the prefix columns seen by all."""
        mask = super().build_attention_mask_from_topk(topk_indices, query_states, kv_length)
        p = self.prefix_length()
        if p:
            mask[..., :p] = True if mask.dtype == torch.bool else 0.0
        return mask


class PadKeepingForgetGate(Glm5NextTextForgetGate):
    """`Glm5NextTextForgetGate` whose log decay is 0 on pads (`keep`: the forward's [b, s] mask, False on a pad; set by
    `PrefixedLinearAttention` for the duration of its forward)."""

    keep: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        g = super().forward(hidden_states)  # [b, s, heads, Dk]
        if self.keep is None:
            return g
        return g.masked_fill(~self.keep.bool()[:, :, None, None], 0.0)


class PrefixedLinearAttention(Glm5NextTextLinearAttention):
    """`Glm5NextTextLinearAttention` whose pads leave the recurrent state as it is (module docstring). The prefix is
    the initial state in the cache (`next_cache`); the forward is transformers'."""

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
        self.forget_gate.keep = attention_mask
        try:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        finally:
            self.forget_gate.keep = None
