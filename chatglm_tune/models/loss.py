"""The training loss of every version: cross entropy of the next token at the labelled positions only, computed
in chunks of tokens, so the [tokens x vocabulary] logits of a step never exist at once.

A causal LM's loss is the mean over the positions t whose next label `labels[:, t + 1]` is not -100 of
cross_entropy(head(hidden[:, t]), labels[:, t + 1]), with the logits in float32 (what transformers'
`ForCausalLMLoss` computes over all positions). Only those positions go through the output layer: a conversation
labels its answers, not its system prompt and tools (a tool row of ~530 tokens labels ~50). Past `chunk_tokens`
picked positions, each chunk's logits are computed, reduced to a sum and dropped, and recomputed in the backward
pass (a checkpoint a chunk): GLM-4's 151,552-word vocabulary makes fp32 logits of 8 x 4096 tokens ~20 GB (and as
much again for their gradient); chunks of 4096 tokens hold ~2.5 GB at a time, for one more pass of the output
layer over the labelled tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from chatglm_tune.data.batches import IGNORE_INDEX

CHUNK_TOKENS = 4096  # labelled positions whose logits exist at once (4096 x 151,552 fp32: 2.5 GB)


def labelled_hidden(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [n, h] of the positions whose next token is labelled, those labels [n]): hidden [b, s, h] and
    labels [b, s] of the same rows, -100 ignored."""
    following = labels[:, 1:]
    picked = following != IGNORE_INDEX
    return hidden[:, :-1][picked], following[picked]


def _chunk_loss_sum(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def causal_lm_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                   chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The mean next-token cross entropy of `labels` [b, s] (-100 ignored) from the final hidden states [b, s, h]
    through `head` (the output layer), over the labelled positions only, `chunk_tokens` at a time (see the module's
    docstring). No labelled token: NaN, as the mean over nothing is (transformers' loss gives the same)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    states, targets = labelled_hidden(hidden, labels)
    if states.shape[0] <= chunk_tokens:
        return F.cross_entropy(head(states).float(), targets)
    total = states.new_zeros((), dtype=torch.float32)
    for start in range(0, states.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, head, states[part], targets[part], use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, states[part], targets[part])
    return total / targets.shape[0]
