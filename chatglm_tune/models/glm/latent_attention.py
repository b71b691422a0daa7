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
transformers' own. A query that sees no key (a left pad's, in a padded prompt of few tokens) gets zero weights and a
zero output, as SDPA gives it in transformers' forward (`_softmax`). Over INT8 / INT4 weights W_UV is `kv_b_proj`'s own
value rows and W_UK^T its key rows transposed and quantized to INT8, every head in one grouped call of the integer-dot
kernel (`IntAbsorbed`; a GLM-4.7-Flash layer reads 3.3 MB for them a step, against 18.4 MB of float32 copies: 0.71 GB
less a token, and a faster decode step). Float weights keep float32 copies (`FloatAbsorbed`), remade when `kv_b_proj`'s
weight changes; the step's attention runs in float32 (in bf16 its small batched products were most of a decode step's
attention on a CPU). Figures: bench/results/kernel-notes.md. A `kv_b_proj` wrapped by a LoRA adapter runs transformers'
forward.

A P-tuning prefix is each head's own keys and values (`head_prefix`, which the model hands every layer whenever it
puts the prefix into an empty cache: glm/prefix.py), and the cache's first P latents are zeros in its place:
transformers' forward finds the heads' prefix where those P entries expand (`expand_kv`), the absorbed step scores it
per head and adds its values (the zero latents mix in nothing). The held C++ step (latent_layer.py) takes no prefix.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (Glm4MoeLiteAttention, apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)

from chatglm_tune.quant import cpu_matmul, int8dot_cpu
from chatglm_tune.quant.format import dequantize, quantize_weight
from chatglm_tune.quant.modules import QuantizedLinear

ABSORBED_MAX_QUERIES = 8


class HeadPrefix:
    """A P-tuning prefix for latent attention (GLM-4.7-Flash's, GLM-5's sparse one): each head's own keys and values in
    place of the cache's first P latents (zeros), which the attention's `expand_kv` expands (the module docstring)."""

    # Each head's keys [b or 1, H, P, qk_nope_head_dim + qk_rope_head_dim] (not rotated) and values [b or 1, H, P,
    # v_head_dim]; set by the model (its `prefix_key_values`).
    head_prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    def prefix_length(self) -> int:
        """P: the prefix's positions at the start of the cache (0 without a prefix)."""
        return 0 if self.head_prefix is None else self.head_prefix[0].shape[2]

    def cached_key_width(self) -> int:
        """The width of the second tensor the cache holds a token: the rotated shared key."""
        return self.qk_rope_head_dim

    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' keys and values of the cached latents, the heads' prefix in place of the first P."""
        if self.head_prefix is None:
            return super().expand_kv(kv_nope, k_rot)
        keys, values = self.prefix_rows(kv_nope.shape[0])
        p = keys.shape[2]
        own_keys, own_values = super().expand_kv(kv_nope[:, :, p:], k_rot[:, :, p:])
        return (torch.cat([keys.to(own_keys.dtype), own_keys], dim=2),
                torch.cat([values.to(own_values.dtype), own_values], dim=2))

    def prefix_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`head_prefix` for a batch of `rows`: as made, or its first row for each where decoding dropped or joined
        rows since (no dropout outside training: every row's prefix is the same)."""
        keys, values = self.head_prefix
        if keys.shape[0] == rows:
            return keys, values
        if self.training:
            raise ValueError(f"the prefix was made for {keys.shape[0]} rows, this forward has {rows}")
        return keys[:1].expand(rows, -1, -1, -1), values[:1].expand(rows, -1, -1, -1)


class LatentAttention(HeadPrefix, Glm4MoeLiteAttention):
    """`Glm4MoeLiteAttention` with decode steps against the cached latents (the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None, **kwargs):
        if not self.absorbs(hidden_states, cache):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        q_pass, q_rot, latent, k_rot = self.absorbed_query(hidden_states, position_embeddings)
        latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)  # [b, 1, L, 512], [b, 1, L, 64]
        out = self.absorbed_attention(q_pass, q_rot, latent, k_rot, attention_mask)
        return self.o_proj(out.to(hidden_states.dtype)), None

    def absorbs(self, hidden_states: torch.Tensor, cache) -> bool:
        """Whether this forward runs against the cached latents (nothing trained, a few queries, a cache)."""
        return (not self.training and not torch.is_grad_enabled() and hidden_states.shape[1] <= ABSORBED_MAX_QUERIES
                and type(self.kv_b_proj) in (nn.Linear, cpu_matmul.Linear, QuantizedLinear) and cache is not None)

    def absorbed_query(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """(each head's no-rotary query [b, H, s, 192], the rotated query [b, H, s, 64]) and what to cache: (the
        normed latent [b, 1, s, 512], the rotated shared key [b, 1, s, 64])."""
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
        return q_pass, q_rot, latent, k_rot

    def absorbed_attention(self, q_pass: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                           attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The attention's output before o_proj [b, s, H * 256] from `absorbed_query`'s queries and the whole cache
        (latents [b, 1, L, 512], shared keys [b, 1, L, 64]), in float32: small batched products, which a CPU runs
        several times faster than in bf16. Every head's queries of a row multiply that row's latents in one product."""
        heads, b, s = self.num_heads, q_rot.shape[0], q_rot.shape[2]
        keys, shared = latent.float().select(1, 0), k_rot.float().select(1, 0)  # [b, L, 512], [b, L, 64]
        length = keys.shape[1]
        query = self._absorbed().keys(q_pass.float().transpose(0, 1).reshape(heads, b * s, -1))  # [H, b s, 512]
        query = query.view(heads, b, s, self.kv_lora_rank).transpose(0, 1).reshape(b, heads * s, self.kv_lora_rank)
        rotated = q_rot.float().reshape(b, heads * s, -1)
        if _threaded_products(keys):
            scores = int8dot_cpu.latent_scores(query, rotated, keys, shared)
        else:
            scores = query @ keys.transpose(1, 2) + rotated @ shared.transpose(1, 2)
        scores = scores.view(b, heads, s, length)
        prefix = None if self.head_prefix is None else self.prefix_rows(b)
        if prefix is not None:  # each head's own prefix keys in place of the first P (zero) latents
            prefix_scores = torch.cat([q_pass, q_rot], dim=-1).float() @ prefix[0].float().transpose(2, 3)
            scores = torch.cat([prefix_scores, scores[..., prefix_scores.shape[-1]:]], dim=-1)
        probs = _softmax(_masked(scores * self.scaling, attention_mask, s))
        flat = probs.reshape(b, heads * s, length)
        mixed = int8dot_cpu.latent_mix(flat, keys) if _threaded_products(keys) else flat @ keys
        mixed = mixed.view(b, heads, s, self.kv_lora_rank)
        mixed = mixed.transpose(0, 1).reshape(heads, b * s, self.kv_lora_rank)
        out = self._absorbed().values(mixed).view(heads, b, s, self.v_head_dim).permute(1, 2, 0, 3)  # [b, s, H, 256]
        if prefix is not None:  # the zero latents mixed in nothing: the prefix's values
            out = out + (probs[..., :prefix_scores.shape[-1]] @ prefix[1].float()).transpose(1, 2)
        return out.reshape(b, s, -1)

    def _absorbed(self) -> FloatAbsorbed | IntAbsorbed:
        """`kv_b_proj` split for the absorbed products, made again when its weight changed: from INT8 / INT4 weights
        where the integer-dot kernel runs (`IntAbsorbed`), else in float32 (`FloatAbsorbed`). A compiled decode step
        (`decoding.static_decoding`, after an eager prompt that made it) takes the one held: no weight changes while
        it decodes, and the check would split its graph."""
        held = getattr(self, "_absorbed_cache", None)
        if held is not None and torch.compiler.is_compiling():
            return held[1]
        layer = self.kv_b_proj
        weight = layer.weight
        key = (weight.data_ptr(), weight._version, getattr(layer, "held_layout", None))
        if held is None or held[0] != key:
            shape = (self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            if IntAbsorbed.usable(layer, shape, self.qk_nope_head_dim):
                made = IntAbsorbed(layer, shape, self.qk_nope_head_dim)
            else:
                made = FloatAbsorbed(_float_weight(layer).view(shape), self.qk_nope_head_dim)
            held = (key, made)
            self._absorbed_cache = held
        return held[1]


class FloatAbsorbed:
    """W_UK^T [H, 512, 192] and W_UV [H, 256, 512] in float32, each head's weight multiplying the step's vectors (a
    batched matrix-vector product that streams the weight)."""

    def __init__(self, full: torch.Tensor, key_dim: int):
        key, value = full.split([key_dim, full.shape[1] - key_dim], dim=1)
        self.key_weight, self.value_weight = key.transpose(1, 2).contiguous(), value.contiguous()

    def keys(self, q: torch.Tensor) -> torch.Tensor:
        """Each head's no-rotary query [H, n, 192] in the latent space: [H, n, 512]."""
        return (self.key_weight @ q.transpose(1, 2)).transpose(1, 2)

    def values(self, mixed: torch.Tensor) -> torch.Tensor:
        """Each head's attention-weighted latent [H, n, 512] expanded into its value: [H, n, 256]."""
        return (self.value_weight @ mixed.transpose(1, 2)).transpose(1, 2)


class IntAbsorbed:
    """The same products over integer weights, every head in one call of the integer-dot kernel
    (`int8dot_cpu.matmul_multi`). W_UV is `kv_b_proj`'s own value rows (INT8 / INT4, per-row scales as stored);
    W_UK^T, whose rows are the stored weight's columns, is the dequantized key rows transposed and quantized to INT8
    per row (an error well below INT4's own). Against float32 copies a GLM-4.7-Flash layer reads 3.3 MB instead of
    18.4 MB a step."""

    def __init__(self, layer: QuantizedLinear, shape: tuple[int, int, int], key_dim: int):
        heads, rows, latent = shape
        official = _stored_weight(layer)
        scale = layer.weight_scale.view(heads, rows)
        values = official.view(heads, rows, -1)[:, key_dim:].reshape(heads * (rows - key_dim), -1)
        self.value_weights = _per_head(int8dot_cpu.pack(values.contiguous()), heads)
        self.value_scales = list(scale[:, key_dim:].float().contiguous())
        self.value_bits = layer.bits
        full = dequantize(official, layer.weight_scale, layer.bits, torch.float32).view(shape)
        key, key_scale = quantize_weight(full[:, :key_dim].transpose(1, 2).reshape(heads * latent, key_dim), 8)
        self.key_weights = _per_head(int8dot_cpu.pack(key), heads)
        self.key_scales = list(key_scale.view(heads, latent).float())

    @staticmethod
    def usable(layer: nn.Module, shape: tuple[int, int, int], key_dim: int) -> bool:
        """Whether `layer` (`kv_b_proj`) is INT8 / INT4 the grouped kernel runs, with each head's rows whole blocks of
        its layout (the usual shapes: 192 + 256 rows over 512 columns)."""
        heads, rows, latent = shape
        return (isinstance(layer, QuantizedLinear) and layer.grouped_kernel_runs()
                and (rows - key_dim) % int8dot_cpu.BLOCK_ROWS == 0 and latent % int8dot_cpu.BLOCK_ROWS == 0)

    def keys(self, q: torch.Tensor) -> torch.Tensor:
        return int8dot_cpu.matmul_multi(q, self.key_weights, self.key_scales, 8)

    def values(self, mixed: torch.Tensor) -> torch.Tensor:
        return int8dot_cpu.matmul_multi(mixed, self.value_weights, self.value_scales, self.value_bits)


def _per_head(packed: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """`int8dot_cpu.pack`'s layout of `heads` equal blocks of rows, as one contiguous view per head."""
    return list(packed.view(heads, -1, *packed.shape[1:]).unbind(0))


def _stored_weight(layer: QuantizedLinear) -> torch.Tensor:
    """An INT layer's weight in the stored layout, rebuilt where a kernel's layout holds it."""
    return layer._official_weight() if layer.held_layout else layer.weight


def _float_weight(layer: nn.Module) -> torch.Tensor:
    """`kv_b_proj`'s weight in float32 (dequantized from INT8 / INT4)."""
    if isinstance(layer, QuantizedLinear):
        return dequantize(_stored_weight(layer), layer.weight_scale, layer.bits, torch.float32)
    return layer.weight.detach().float()


def _threaded_products(keys: torch.Tensor) -> bool:
    """Whether the step's two products run on `int8dot_cpu`'s threaded kernels (a CPU where it is built: what the held
    C++ step runs, so both give the same bits), else PyTorch's batched matmul, which runs them on one thread at a
    decode step's sizes (2 threads, 20 rows over 104 cached latents: 157 against 77 us a layer), and which a
    compiled step (`decoding.static_decoding`) traces."""
    return not torch.compiler.is_compiling() and keys.device.type == "cpu" and int8dot_cpu.available()


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """The attention weights of masked `scores` [b, H, s, L]: their softmax over the keys, and zeros for a query that
    sees no key (a left pad's query in a padded prompt: its scores all -inf, whose softmax is NaN). Such a query's
    output is then zero, as PyTorch's SDPA gives it in transformers' forward; a NaN there would reach every token of
    its row through the next layer's products (0 x NaN). The other queries' weights are the softmax's own bits."""
    probs = scores.softmax(-1)
    return probs.masked_fill(scores.amax(-1, keepdim=True) == float("-inf"), 0.0)


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
