"""GLM 2D position ids and the GLM attention mask, vectorised over a batch.

A ChatGLM prompt is `context [gMASK] <sop> generated...`. Tokens before `<sop>` (the context) see the
whole context in both directions; `<sop>` and later tokens are causal, plus the full context.
Channel 0 of the position ids counts the context and then stays at the `[gMASK]` index; channel 1 (the
"block" position) is 0 over the context and counts 1, 2, ... from `<sop>` on.

Padding: `pad_mask` ([b, s], 1 = token, 0 = pad) may mark left pads (inference, the official
tokenizer's layout) or right pads (training). Left pads shift the positions so that a padded row gets
the positions of the same prompt alone; pad columns are never attended; pad rows get position 0.
"""

from __future__ import annotations

import torch


def _first_index(hit: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of a [b, s] bool tensor (s where there is none)."""
    s = hit.shape[1]
    idx = torch.arange(s, device=hit.device).expand_as(hit)
    return torch.where(hit, idx, s).min(dim=1).values


def context_lengths(input_ids: torch.Tensor, bos_token_id: int) -> torch.Tensor:
    """[b] index of the first `<sop>` in each row; ValueError naming the rows that have none."""
    c = _first_index(input_ids == bos_token_id)
    missing = (c == input_ids.shape[1]).nonzero().flatten().tolist()
    if missing:
        raise ValueError(
            f"rows {missing} of input_ids have no <sop> (id {bos_token_id}): a ChatGLM prompt must end "
            "with [gMASK] <sop> (the tokenizer's build_inputs_with_special_tokens adds them)"
        )
    return c


def mask_positions(input_ids: torch.Tensor, gmask_token_id: int, mask_token_id: int) -> torch.Tensor:
    """[b] index of `[gMASK]` in each row, else of `[MASK]` (the model's priority); ValueError if neither."""
    s = input_ids.shape[1]
    g = _first_index(input_ids == gmask_token_id)
    m = _first_index(input_ids == mask_token_id)
    pos = torch.where(g < s, g, m)
    missing = (pos == s).nonzero().flatten().tolist()
    if missing:
        raise ValueError(
            f"rows {missing} of input_ids have neither [gMASK] (id {gmask_token_id}) nor [MASK] (id {mask_token_id})"
        )
    return pos


def build_position_ids(
    input_ids: torch.Tensor,
    *,
    bos_token_id: int,
    gmask_token_id: int,
    mask_token_id: int,
    pad_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Official 2D position ids, [b, 2, s] (long), for prompts that contain `[gMASK] <sop>`."""
    b, s = input_ids.shape
    c = context_lengths(input_ids, bos_token_id)[:, None]  # [b, 1]
    mpos = mask_positions(input_ids, gmask_token_id, mask_token_id)[:, None]
    offset = _left_pad_count(pad_mask, b, input_ids.device)
    j = torch.arange(s, device=input_ids.device)[None, :]  # [1, s]
    in_context = j < c
    pos = torch.where(in_context, j, mpos) - offset
    block = torch.where(in_context, 0, j - c + 1)
    if pad_mask is not None:
        keep = pad_mask.bool()
        pos, block = pos * keep, block * keep
    return torch.stack([pos, block], dim=1).long()


def build_attention_mask(
    input_ids: torch.Tensor, *, bos_token_id: int, pad_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Official GLM mask, [b, 1, s, s] bool, True = blocked: bidirectional context, causal after `<sop>`.

    With `pad_mask`, pad columns and pad rows are blocked as the official tokenizer's `_pad` does.
    """
    s = input_ids.shape[1]
    c = context_lengths(input_ids, bos_token_id)
    return glm_mask(c, s, s, past_length=0, pad_mask=pad_mask)


def packed_inputs(input_ids: torch.Tensor, segment_ids: torch.Tensor, *, bos_token_id: int, gmask_token_id: int,
                  mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(2D position ids [b, 2, s], official mask [b, 1, s, s] bool, True = blocked) of packed training rows
    (`segment_ids`: 1, 2, ... an example, 0 on pads): each example's positions and GLM mask as it has them alone, in
    its own block; nothing across examples, pads blocked."""
    b, s = input_ids.shape
    positions = torch.zeros(b, 2, s, dtype=torch.long, device=input_ids.device)
    blocked = torch.ones(b, 1, s, s, dtype=torch.bool, device=input_ids.device)
    for r in range(b):
        start = 0
        for k, n in zip(*(t.tolist() for t in segment_ids[r].unique_consecutive(return_counts=True))):
            end = start + n
            if k:  # an example (0: pads)
                ids = input_ids[r : r + 1, start:end]
                positions[r, :, start:end] = build_position_ids(ids, bos_token_id=bos_token_id,
                                                                gmask_token_id=gmask_token_id,
                                                                mask_token_id=mask_token_id)[0]
                blocked[r, :, start:end, start:end] = build_attention_mask(ids, bos_token_id=bos_token_id)[0]
            start = end
    return positions, blocked


def glm_mask(
    context_length: torch.Tensor,
    q_len: int,
    k_len: int,
    *,
    past_length: int,
    pad_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GLM mask for queries at absolute positions `past_length + [0, q_len)` over `k_len` keys.

    `context_length` [b]: key j is visible to query i when `j < c` or `j <= i`. `pad_mask` [b, k_len]
    (1 = token) blocks pad columns, and pad rows entirely. Returns [b, 1, q_len, k_len] bool, True = blocked.
    """
    device = context_length.device
    i = torch.arange(past_length, past_length + q_len, device=device)[None, :, None]  # [1, q, 1]
    j = torch.arange(k_len, device=device)[None, None, :]  # [1, 1, k]
    visible = (j <= i) | (j < context_length[:, None, None])  # [b, q, k]
    if pad_mask is not None:
        pad = pad_mask.bool()
        visible = visible & pad[:, None, :] & pad[:, past_length : past_length + q_len, None]
    return ~visible[:, None]


def _left_pad_count(pad_mask: torch.Tensor | None, b: int, device) -> torch.Tensor:
    """[b, 1] number of pads before the first token of each row (0 without a pad mask)."""
    if pad_mask is None:
        return torch.zeros(b, 1, dtype=torch.long, device=device)
    return _first_index(pad_mask.bool())[:, None]
