"""Log probabilities under the model: of the tokens a row is handed (`emitter`, where a request asks) and of a
prompt's own tokens, each given the ones before it (what a completions request with `echo` and `logprobs` returns,
and lm-eval's loglikelihood reads), from one forward of the prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatglm_tune.decoding.sampling import limit_vocab


def token_logprobs(scores: torch.Tensor, ids: Sequence[int], top: int, vocab_limit: int | None) -> list[tuple]:
    """(log probability, ((id, log probability) of the `top` likeliest, ...)) of each of `ids` under the scores
    [len(ids), V] of its position (their log-softmax; ids >= `vocab_limit` have none)."""
    logprobs = torch.log_softmax(limit_vocab(scores.float(), vocab_limit), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(ids), device=scores.device)[:, None])[:, 0].tolist()
    if not top:
        return [(value, ()) for value in chosen]
    best = logprobs.topk(top, dim=-1)
    return [(value, tuple(zip(indices, values))) for value, indices, values in
            zip(chosen, best.indices.tolist(), best.values.tolist())]


@torch.inference_mode()
def prompt_logprobs(model, ids: Sequence[int], top: int, vocab_limit: int | None) -> list[tuple]:
    """`token_logprobs` of each token of `ids` after the first, under `model` given the tokens before it."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0, :-1]
    return token_logprobs(logits, ids[1:], top, vocab_limit)
