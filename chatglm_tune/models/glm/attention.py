"""The attention these models run: transformers' SDPA attention, except for one query over grouped key/value heads.

A decode step (one query per row) with no mask reaches PyTorch's `scaled_dot_product_attention(enable_gqa=True)`
from transformers' SDPA attention. On a CPU that path is slow: for ChatGLM3-6B's 32 query heads over 2 key/value
heads it takes ten times as long or more as the same attention with the 16 query heads of each group as 16 queries
of one head (`pack_gqa`, what transformers itself does when a mask is given), a noticeable part of an INT4 decode
step (figures: bench/results/kernel-notes.md). `ATTENTION` therefore sends every one-query step through that form
(a mask that is the same for all heads rides along) and anything else to transformers' own function; the result is
the same attention.

`PrefixModel` switches a model built with "sdpa" (transformers' default) to `ATTENTION`; "eager", flash attention
and others stay as the user set them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "chatglm_sdpa"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, H, s, D], key / value [b, G, L, D] -> ([b, s, H, D], None)."""
    b, heads, length, dim = query.shape
    groups = key.shape[1]
    if length == 1 and groups < heads and (attention_mask is None or attention_mask.shape[1] == 1) and dropout == 0.0:
        grouped = query.reshape(b, groups, heads // groups, dim)  # each group's heads as queries of one head
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, heads, dim), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks of "sdpa", which `attention` reads as it does
