"""GLM-5.3-Flash's P-tuning v2 prefix: what it is in each kind of layer, and how the encoder's output is cut into it.

GLM-5.3-Flash (transformers' `glm5_next`) has two kinds of layer (`config.layer_types`):
- sparse attention (`indexed_attention`): latent attention without rotary dims (`qk_rope_head_dim` 0), whose keys
  a lightning indexer picks per query. The prefix is each head's own keys and values, as GLM-4.7-Flash's (its
  latent attention): per layer and position `num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim +
  v_head_dim)` numbers, seen by every query; the cache holds P zero latents in its place (`next_layers`).
- KDA linear attention (`linear_attention`): no key/value cache, a recurrent state S [heads, Dk, Dv] per row that
  each token updates by the gated delta rule (keys l2-normed):
      S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   out_t = S^T q_t / sqrt(Dk)
  (g_t <= 0 the per-channel log decay, beta_t in (0, 1) the write strength). The prefix is the layer's initial
  state: the encoder gives P virtual keys and values per head (`linear_num_heads * 2 * linear_head_dim` numbers a
  layer and position), and the state is this same recurrence run from zero over them with g = 0 (no forgetting)
  and beta = 1 (each virtual key writes its value in full: afterwards S^T k_t = v_t for the last one, and the
  earlier ones as far as later keys overlap them) - what P tokens would leave behind had their keys and values
  been those, and the layer not decayed them. P thus counts virtual tokens in every layer, and the trainable size
  is P x (the layers' widths) as for any prefix. A prefix of zeros gives the zero state: these layers then compute
  exactly what they compute without a prefix (the sparse layers do not: zero keys still take attention weight).
  The layer's short convolution keeps a zero state: it mixes the last few tokens' projections of hidden states,
  which virtual keys and values are not, so the first real tokens are convolved as without a prefix (against
  zeros) and the prefix acts through the recurrent state alone.

The encoder is the family's (`models.prefix.PrefixEncoder`: an embedding of width W, or with `prefix_projection`
Embedding(P, W) -> Linear(W, hidden) -> Tanh -> Linear(hidden, W)), W the sum of the layers' widths; its output
[P, W] is cut layer after layer in order, each layer's part its keys (head after head) then its values.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

from chatglm_tune.models.prefix import PrefixEncoder

LINEAR = "linear_attention"  # `config.layer_types`' name of a KDA layer (the others are sparse attention)


def is_linear(config, layer: int) -> bool:
    """Whether layer `layer` of a GLM-5.3-Flash config is KDA linear attention."""
    return config.layer_types[layer] == LINEAR


def layer_entry(config, layer: int) -> tuple[int, int, int]:
    """(heads, key width, value width) of one prefix position in layer `layer`: a KDA layer's virtual key and value
    per head, a sparse attention layer's key and value per head (module docstring)."""
    if is_linear(config, layer):
        return config.linear_num_heads, config.linear_head_dim, config.linear_head_dim
    return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim


def layer_widths(config) -> list[int]:
    """The encoder's channels of each layer, in layer order."""
    widths = []
    for layer in range(config.num_hidden_layers):
        heads, key, value = layer_entry(config, layer)
        widths.append(heads * (key + value))
    return widths


def next_prefix_width(config) -> int:
    """W, the encoder's output width: the sum of the layers' widths."""
    return sum(layer_widths(config))


def next_prefix_formula(config) -> str:
    """How `next_prefix_width` is made, with this config's numbers."""
    c = config
    linear = sum(is_linear(c, layer) for layer in range(c.num_hidden_layers))
    sparse = c.num_hidden_layers - linear
    return (f"linear_layers * linear_num_heads * 2 * linear_head_dim + sparse_layers * heads * (qk_nope_head_dim + "
            f"qk_rope_head_dim + v_head_dim) = {linear} * {c.linear_num_heads} * 2 * {c.linear_head_dim} + {sparse} * "
            f"{c.num_attention_heads} * ({c.qk_nope_head_dim} + {c.qk_rope_head_dim} + {c.v_head_dim})")


def prefix_parts(encoder: PrefixEncoder, dropout: nn.Module, config, batch_size: int,
                 dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of the prefix in `dtype` (dropout applies in training mode, one mask for keys and
    values alike): a KDA layer's virtual keys [b, P, heads, Dk] and values [b, P, heads, Dv] (the recurrence's
    layout), a sparse layer's keys [b, heads, P, Dk] and values [b, heads, P, Dv] (attention's layout)."""
    weight = encoder.embedding.weight
    p = weight.shape[0]
    tokens = torch.arange(p, device=weight.device).expand(batch_size, p)
    out = dropout(encoder(tokens).to(dtype))  # [b, P, W]
    parts = []
    for layer, part in enumerate(out.split(layer_widths(config), dim=-1)):
        heads, key, value = layer_entry(config, layer)
        keys = part[..., : heads * key].reshape(batch_size, p, heads, key)
        values = part[..., heads * key:].reshape(batch_size, p, heads, value)
        if not is_linear(config, layer):
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        parts.append((keys, values))
    return parts


def prefix_state(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A KDA layer's initial recurrent state [b, heads, Dk, Dv] (float32, as transformers keeps the state) from its
    virtual keys [b, P, heads, Dk] and values [b, P, heads, Dv]: transformers' own recurrence
    (`recurrent_kimi_delta_attention`, keys l2-normed) run from a zero state over them with g = 0 and beta = 1
    (module docstring). Differentiable: gradients reach the encoder through it."""
    b, p, heads, _ = keys.shape
    g = keys.new_zeros(keys.shape, dtype=torch.float32)
    beta = keys.new_ones(b, p, heads, dtype=torch.float32)
    _, state = recurrent_kimi_delta_attention(keys, keys, values, g=g, beta=beta, initial_state=None,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return state
