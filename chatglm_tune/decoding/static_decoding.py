"""Decoding over a static (preallocated) KV cache, each step through one compiled function (`torch.compile`).

`generate(..., compiled=True)` decodes here on float models whose class says `static_cache = True` (their attention
reads transformers' cache and masks: ChatGLM2/3, GLM-4, GLM-4-0414, GLM-Edge; `unsupported` says why another
cannot). The prompt goes through the model as it is (eager); every step after runs one compiled forward, whose
shapes never change within a call, so it is compiled once and replayed:
- the cache is transformers' `StaticCache` of `pre_seq_len + L` columns (the P-tuning prefix first, put there by
  the model at the prefill), L the prompt plus the answer budget rounded up to `LENGTH_STEP`, so that batches of
  other lengths reuse the compiled step (after a second shape `torch.compile` makes the lengths symbolic);
- the pad mask [rows, L] covers the prompt (left pads 0), then each step sets its column; positions are each
  row's own count of real tokens, as the models derive them from the mask;
- a finished row stays in the batch to the end (its tokens are dropped, its generator never read again), where the
  cached loop lets it leave: a fixed batch costs the finished rows' share of each step, and saves a recompilation.
The tokens are the cached loop's, up to the float rounding of a differently fused computation (a near-tie of the
two best scores can fall either way, as between batch sizes). Compiling takes seconds to a minute the first time
in a process (PyTorch keeps the generated code on disk for the next); the gain is the Python and dispatch overhead
of every step: most of a small model's step, a small share of a large model's. PyTorch keeps a few compiled
variants of the step a process (`torch._dynamo.config.recompile_limit`, 8: each model, and the shapes made
symbolic after the first): a process that compiles for many models runs the later ones eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers.cache_utils import StaticCache

from chatglm_tune.decoding.batch_cache import prefix_length
from chatglm_tune.decoding.sampling import next_tokens
from chatglm_tune.options import SamplingOptions

LENGTH_STEP = 256  # the cache's columns (past the prefix) are a multiple of this


def unsupported(model) -> str | None:
    """Why `model` cannot decode here, or None: its class must say it decodes on a static cache, and its weights be
    float (the INT8 / INT4 layers choose and lay out their kernels in Python at every call, which a compiled graph
    cannot hold: they decode as before)."""
    if not getattr(type(model), "static_cache", False):
        return f"compiled decoding needs a model that decodes on a static cache ({type(model).__name__} keeps its own cache form)"
    if not all(p.is_floating_point() for p in model.parameters()):
        return "compiled decoding runs float weights; a model with INT8 / INT4 layers decodes without it"
    return None


def cache_length(prompt_length: int, max_new_tokens: int) -> int:
    """The cache's columns past the prefix for a prompt and an answer budget: a multiple of LENGTH_STEP."""
    return -(-(prompt_length + max_new_tokens) // LENGTH_STEP) * LENGTH_STEP


def _forward(model, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    return model(tokens, cache=cache, use_cache=True, attention_mask=mask, position_ids=positions,
                 logits_to_keep=1).logits[:, -1]


def compiled_step(model):
    """The model's compiled decode step, made once and kept on the model: (tokens [b, 1], positions [b, 1],
    mask [b, L], cache) -> the scores of each row's next token [b, V]."""
    step = model.__dict__.get("_compiled_decode_step")
    if step is None:
        step = model.__dict__["_compiled_decode_step"] = torch.compile(lambda *args: _forward(model, *args))
    return step


def static_steps(model, ids: torch.Tensor, mask: torch.Tensor | None, *, max_new_tokens: int,
                 sampling: SamplingOptions, generators: list, stop: torch.Tensor | None, fallback: int,
                 vocab_limit: int | None) -> Iterator[tuple[list[int], list[int]]]:
    """`generation`'s cached loop on a static cache and a compiled step: yields (the prompt index of every live
    row, its new token) a step, before the stop check and the next forward."""
    if max_new_tokens == 0:
        return
    rows, length = ids.shape
    columns = cache_length(length, max_new_tokens)
    cache = StaticCache(config=model.config, max_cache_len=prefix_length(model) + columns)
    full = torch.zeros(rows, columns, dtype=torch.long, device=ids.device)
    full[:, :length] = 1 if mask is None else mask
    positions = (full[:, :length].cumsum(dim=1) - 1).clamp(min=0)
    scores = _forward(model, ids, positions, full, cache)
    positions = positions[:, -1:] + 1
    step = compiled_step(model)
    live, stop_ids = list(range(rows)), set() if stop is None else set(stop.tolist())
    for n in range(max_new_tokens):
        tokens = next_tokens(scores, sampling, generators, fallback_id=fallback, vocab_limit=vocab_limit)
        out = tokens.tolist()
        yield live, [out[r] for r in live]
        if n == max_new_tokens - 1:
            break
        live = [r for r in live if out[r] not in stop_ids]
        if not live:
            break
        full[:, length + n] = 1
        scores = step(tokens[:, None], positions, full, cache)
        positions = positions + 1
