"""A prompt's own log probabilities: each token's under the model given the tokens before it (what a completions
request with `echo` and `logprobs` returns, and lm-eval's loglikelihood reads), from one forward of the prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatglm_tune.decoding.sampling import limit_vocab


@torch.inference_mode()
def prompt_logprobs(model, ids: Sequence[int], top: int, vocab_limit: int | None) -> list[tuple]:
    """(log probability, ((id, log probability) of the `top` likeliest, ...)) of each token of `ids` after the first,
    under `model` given the tokens before it (ids >= `vocab_limit` have none)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0, :-1].float()
    logprobs = torch.log_softmax(limit_vocab(logits, vocab_limit), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(ids[1:]), device=device)[:, None])[:, 0].tolist()
    if not top:
        return [(value, ()) for value in chosen]
    best = logprobs.topk(top, dim=-1)
    return [(value, tuple(zip(indices, values))) for value, indices, values in
            zip(chosen, best.indices.tolist(), best.values.tolist())]
