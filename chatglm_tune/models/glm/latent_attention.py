"""GLM-4.7-Flash's latent attention in decode steps, computed against the cached latents themselves.

transformers' `Glm4MoeLiteAttention` caches, per token, the normed key/value latent c (kv_lora_rank = 512 wide) and
the rotated shared key r (64), and at every step expands all of them back into keys and values through `kv_b_proj`
([heads x (192 + 256), 512]): a decode step after L tokens multiplies L rows by that matrix in every layer (at
L = 100, 47 layers: 22 G multiply-adds, many times what the rest of the step costs). The same attention, with
`kv_b_proj` split per head into W_UK [192, 512] (no-rotary key) and W_UV [256, 512] (value), is
    score_h = scaling * ((q_h,nope W_UK,h) . c + q_h,rot . r),   out_h = (softmax(score_h) . c) W_UV,h^T
which reads each cached latent once and never expands it. `LatentAttention` runs that form where nothing is trained
and a forward has few queries (`ABSORBED_MAX_QUERIES`: decode steps, a speculative step's guesses), transformers'
own forward otherwise (prefill, training), so the cache, the P-tuning prefix in it and the parameters are
transformers' own; W_UK / W_UV are a float32 copy of `kv_b_proj` (dequantized once from INT8 / INT4), remade when its
weight changes, and the step's attention runs in float32 (in bf16 its small batched products took 1 ms each on a
2-core AVX-512 EPYC, most of a GLM-4.7-Flash decode step's attention), each head's weight multiplying the step's
vectors (a weight-streaming product: 0.47 ms a layer for W_UK against 0.74 ms with the vectors first). A `kv_b_proj` wrapped by a LoRA adapter runs transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (Glm4MoeLiteAttention, apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)

from chatglm_tune.quant.format import dequantize
from chatglm_tune.quant.modules import QuantizedLinear

ABSORBED_MAX_QUERIES = 8


class LatentAttention(Glm4MoeLiteAttention):
    """`Glm4MoeLiteAttention` with decode steps against the cached latents (the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None, **kwargs):
        absorbed = (not self.training and not torch.is_grad_enabled() and hidden_states.shape[1] <= ABSORBED_MAX_QUERIES
                    and type(self.kv_b_proj) in (nn.Linear, QuantizedLinear) and cache is not None)
        if not absorbed:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        b, s = hidden_states.shape[:2]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_pass, q_rot = q.view(b, s, -1, self.qk_head_dim).transpose(1, 2).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, s, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)  # [b, 1, L, 512], [b, 1, L, 64]
        # in float32: small batched products, which a CPU runs several times faster than in bf16
        key_weight, value_weight = self._absorbed()  # W_UK^T [H, 512, 192], W_UV [H, 256, 512]
        latent, k_rot = latent.float(), k_rot.float()
        heads = self.num_heads
        # weight @ vectors, each head's weight contiguous: a batched matrix-vector product that streams the weight
        query = (key_weight @ q_pass.float().permute(1, 3, 0, 2).reshape(heads, self.qk_nope_head_dim, b * s))
        query = query.view(heads, self.kv_lora_rank, b, s).permute(2, 0, 3, 1)  # [b, H, s, 512]
        scores = (query @ latent.transpose(-1, -2) + q_rot.float() @ k_rot.transpose(-1, -2)) * self.scaling  # [b,H,s,L]
        probs = _masked(scores, attention_mask, s).softmax(-1)
        mixed = (probs @ latent).permute(1, 3, 0, 2).reshape(heads, self.kv_lora_rank, b * s)  # [H, 512, b s]
        out = (value_weight @ mixed).view(heads, self.v_head_dim, b, s).permute(2, 3, 0, 1)  # [b, s, H, 256]
        return self.o_proj(out.reshape(b, s, -1).to(hidden_states.dtype)), None

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK^T [H, 512, 192], W_UV [H, 256, 512]) of `kv_b_proj` in float32, made again when its weight changed."""
        layer = self.kv_b_proj
        weight = layer.weight
        key = (weight.data_ptr(), weight._version, getattr(layer, "held_layout", None))
        held = getattr(self, "_absorbed_cache", None)
        if held is None or held[0] != key:
            if isinstance(layer, QuantizedLinear):
                official = layer._official_weight() if layer.held_layout else layer.weight
                full = dequantize(official, layer.weight_scale, layer.bits, torch.float32)
            else:
                full = weight.detach().float()
            full = full.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            parts = full.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
            held = (key, parts[0].transpose(1, 2).contiguous(), parts[1].contiguous())
            self._absorbed_cache = held
        return held[1], held[2]


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, queries: int) -> torch.Tensor:
    """`scores` [b, H, s, L] with the attention mask applied: a boolean one (True: attend), an additive one, or
    None: causal over the last `queries` positions (none to hide for one query)."""
    if mask is not None:
        mask = mask[..., -scores.shape[-1]:]
        return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if queries > 1:
        length = scores.shape[-1]
        future = torch.ones(queries, queries, dtype=torch.bool, device=scores.device).triu(1)
        hidden = torch.zeros(queries, length, dtype=torch.bool, device=scores.device)
        hidden[:, length - queries:] = future
        return scores.masked_fill(hidden, float("-inf"))
    return scores
