"""GLM-5's sparse attention (DeepSeek Sparse Attention on GLM-4.7-Flash's latent attention), with the indexer's keys
held in the model's one cache and the P-tuning prefix.

transformers' `GlmMoeDsaAttention` is latent attention (a key/value latent and a rotated shared key per token, each
head's key and value expanded from them by `kv_b_proj`) in which a query attends only to the `index_topk` (2048)
earlier tokens its layer's indexer scores highest: per query, index score(t) = sum over the indexer's heads h of
w_h * relu(q_h . k_t) / sqrt(head_dim) / sqrt(heads), with its own query (from the query latent), one key per
token (128 wide, normed, rotary on the first 64 dims, interleaved) and weights w from the hidden state; the layers
marked "shared" (`config.indexer_types`) reuse the previous full layer's choice. transformers keeps the indexer's keys
in a cache beside the latents (transformers' `DynamicIndexedLayer`); here they ride in the same cache entry as the
rotated shared key (its value tensor is [b, 1, L, qk_rope_head_dim + index_head_dim] in a layer with an indexer), so
every cache the toolkit decodes with (grown, sliced, joined, trimmed by rows and columns) holds them without knowing
of them. The computation is transformers' own, operation for operation (tests compare the logits).

P-tuning (`head_prefix`, as GLM-4.7-Flash's: `latent_attention.HeadPrefix`): P zero entries lead the cache, each
head's prefix keys and values stand in their place, and every query attends to every prefix position: the indexer
chooses among the real tokens only (its scores of the P zero entries are dropped, not ranked: `index_topk` real tokens
are chosen as without a prefix, and the P prefix positions are added to every query's choice). The prefix thus changes
no index score; it changes which tokens the indexer sees only through the hidden states the earlier layers computed
with it.

The choice is `torch.topk`'s, as transformers makes it, ties included: where scores tie at the k-th place (an
indexer's heads can all score a key 0 through their relu), which tied tokens `topk` returns depends on where they lie
in memory, so a row left-padded in a batch may then attend to other tokens than alone, in transformers as here. With
GLM-5's 32 indexer heads such ties are rare; the tiny preset has 8 heads (with 4, a served row met one within 20
tokens). Near ties go the same way: a forward of several queries (a speculative verification) rounds the scores
otherwise than one-token steps, and a top-k that is discontinuous may then choose another token at the k-th place
(one of 2048 at full size, a small change; one of a tiny model's 8, often a different answer token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (GlmMoeDsaAttention, apply_rotary_pos_emb_interleave,
                                                                  eager_attention_forward)

from chatglm_tune.models.glm.latent_attention import HeadPrefix


class SparseAttention(HeadPrefix, GlmMoeDsaAttention):
    """`GlmMoeDsaAttention` with the indexer's keys in the cache entry and the P-tuning prefix (the module
    docstring). forward returns (output, None, the chosen positions [b, s, k]) as transformers' does."""

    def cached_key_width(self) -> int:
        """The width of the second tensor this layer caches a token: the rotated shared key, and the indexer's key in
        a layer with an indexer."""
        return self.qk_rope_head_dim + (self.indexer.head_dim if self.indexer is not None else 0)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None, position_ids=None,
                prev_topk_indices=None, **kwargs):
        b, s = hidden_states.shape[:-1]
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_pass, q_rot = self.q_b_proj(q_resid).view(b, s, -1, self.qk_head_dim).transpose(1, 2).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        k_pass, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_a_layernorm(k_pass).view(b, 1, s, self.kv_lora_rank)
        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, self.qk_rope_head_dim), cos, sin)
        index_query = None
        if self.indexer is not None:
            index_query, index_key = _index_query_key(self.indexer, hidden_states, q_resid, position_embeddings)
            k_rot = torch.cat([k_rot, index_key.to(k_rot.dtype).unsqueeze(1)], dim=-1)
        if cache is not None:
            k_pass, k_rot = cache.update(k_pass, k_rot, self.layer_idx, kwargs=kwargs)
        k_rot, index_keys = k_rot.split([self.qk_rope_head_dim, k_rot.shape[-1] - self.qk_rope_head_dim], dim=-1)
        key_states, value_states = self.expand_kv(k_pass, k_rot)
        if index_query is not None:
            topk = self._chosen(hidden_states, index_query, index_keys.squeeze(1), attention_mask[:, 0])
        elif prev_topk_indices is None:
            raise ValueError("a shared sparse-attention layer needs the chosen positions of a full indexer layer")
        else:
            topk = prev_topk_indices
        hidden = topk.new_ones((b, s, key_states.shape[2]), dtype=torch.bool).scatter(-1, topk.long(), False)[:, None]
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & ~hidden
        else:
            attention_mask = attention_mask.masked_fill(hidden, torch.finfo(hidden_states.dtype).min)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        out, weights = interface(self, torch.cat((q_pass, q_rot), dim=-1), key_states, value_states, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(b, s, -1).contiguous()), weights, topk

    @torch.no_grad()
    def _chosen(self, hidden_states: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The positions [b, s, k] each query attends to: the indexer's top `index_topk` real tokens (scored as
        transformers' indexer scores them, `mask` [b, s, L] hiding as it does), after the P prefix positions."""
        indexer = self.indexer
        scores = torch.matmul(query.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [b, s, heads, L]
        scores.mul_(indexer.softmax_scale).relu_()  # in place: at 4K tokens each copy is 2 GB
        weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        index_scores = torch.matmul((weights * indexer.n_heads ** -0.5).unsqueeze(-2), scores).squeeze(-2)
        if mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~mask, float("-inf"))
        else:
            index_scores = index_scores + mask
        p = self.prefix_length()
        real = index_scores[..., p:]
        chosen = real.topk(min(indexer.index_topk, real.shape[-1]), dim=-1).indices.to(torch.int32)
        if not p:
            return chosen
        prefix = torch.arange(p, dtype=torch.int32, device=chosen.device).expand(*chosen.shape[:-1], p)
        return torch.cat([prefix, chosen + p], dim=-1)


@torch.no_grad()  # as transformers' indexer: its choice is not differentiated
def _index_query_key(indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                     position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries [b, s, heads, head_dim] and the new tokens' keys [b, s, head_dim], rotated (interleaved,
    the first qk_rope_head_dim dims) as `GlmMoeDsaIndexer` rotates them."""
    b, s, _ = hidden_states.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
