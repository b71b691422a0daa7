"""Decoding over a static (preallocated) KV cache, each step through one compiled function (`torch.compile`).

`generate(..., compiled=True)` decodes here on models whose class says `static_cache = True` (their attention
reads transformers' cache and masks: every version) with float weights, or INT8 / INT4 layers whose kernel a
compiled graph can hold (CUDA's weight-only kernels; `unsupported` says why another model cannot: the CPU's integer
kernels, INT experts). The MoE GLMs' float experts are picked by transformers' loop over the experts hit (a
`nonzero` whose size depends on the data): their compiled step runs as several graphs, split there. The prompt goes
through the model as it is (eager); every step after runs one compiled forward, whose shapes never change within a
call, so it is compiled once and replayed:
- the cache is transformers' `StaticCache` of `pre_seq_len + L` columns (the P-tuning prefix first, put there by
  the model at the prefill), L the prompt plus the answer budget rounded up to `LENGTH_STEP`, so that batches of
  other lengths reuse the compiled step (after a second shape `torch.compile` makes the lengths symbolic); the model
  holds the cache of its last shape and resets it for the next call of that shape (`held_cache`);
- the pad mask [rows, L] covers the prompt (left pads 0), then each step sets its column; positions are each
  row's own count of real tokens, as the models derive them from the mask (ChatGLM-6B: its 2D positions, the
  prompt's from `prompt_positions`, each step's `next_positions`);
- a finished row stays in the batch to the end (its tokens are dropped, its generator never read again), where the
  cached loop lets it leave: a fixed batch costs the finished rows' share of each step, and saves a recompilation.
On a CUDA GPU the step is captured as CUDA graphs and replayed with one launch (`compile_options`), where an eager
step launches hundreds of kernels from Python. The tokens are the cached loop's, up to the float rounding of a
differently fused computation (a near-tie of the two best scores can fall either way, as between batch sizes).
Compiling takes seconds to a minute the first time in a process (PyTorch keeps the generated code on disk for the
next); the gain is the Python and dispatch overhead of every step: most of a small model's step, a small share of
a large model's on a CPU. PyTorch keeps a few compiled variants of the step a process
(`torch._dynamo.config.recompile_limit`, 8: each model, and the shapes made symbolic after the first): a process that
compiles for many models runs the later ones eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import StaticCache

from chatglm_tune.decoding.batch_cache import prefix_length
from chatglm_tune.decoding.sampling import next_tokens
from chatglm_tune.options import SamplingOptions
from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear

LENGTH_STEP = 256  # the cache's columns (past the prefix) are a multiple of this
COMPILABLE_KERNELS = ("intmm", "int4mm")  # QuantizedLinear kernels a compiled step can hold
CUDA_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}  # `compile_options` on CUDA


def unsupported(model) -> str | None:
    """Why `model` cannot decode here, or None: its class must say it decodes on a static cache, and its weights be
    float, or INT8 / INT4 layers whose decode kernel a compiled graph can hold (`COMPILABLE_KERNELS`: CUDA's; the
    CPU's kernels choose and lay out their work in Python or C++ at every call, and decode as before)."""
    if not getattr(type(model), "static_cache", False):
        return (f"compiled decoding needs a model that decodes on a static cache ({type(model).__name__} keeps its "
                "own cache form)")
    param = next(model.parameters())
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), param.dtype)
    for name, module in model.named_modules():
        if all(p.is_floating_point() for p in module.parameters(recurse=False)):
            continue
        if isinstance(module, QuantizedEmbedding):
            continue  # rows dequantized by plain tensor operations
        kernel = module.kernel_for(param.device, dtype, 1, False) if isinstance(module, QuantizedLinear) else None
        if kernel not in COMPILABLE_KERNELS:
            return (f"compiled decoding runs float weights, or INT8 / INT4 layers on a CUDA GPU; {name} "
                    f"({type(module).__name__}{f', kernel {kernel}' if kernel else ''}) decodes without it")
    return None


def compile_options(device: torch.device) -> dict:
    """`torch.compile`'s options for a decode step on `device`: on CUDA the step is captured as CUDA graphs
    (replayed with one launch: a 6B model's step is ~500 kernels) and one-row matmuls become reductions that fuse
    an INT8 weight's cast (coordinate-descent tuning, as gpt-fast compiles); the CPU's defaults elsewhere."""
    return dict(CUDA_OPTIONS) if device.type == "cuda" else {}


def cache_length(prompt_length: int, max_new_tokens: int) -> int:
    """The cache's columns past the prefix for a prompt and an answer budget: a multiple of LENGTH_STEP."""
    return -(-(prompt_length + max_new_tokens) // LENGTH_STEP) * LENGTH_STEP


def forward_step(model, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    return model(tokens, cache=cache, use_cache=True, attention_mask=mask, position_ids=positions,
                 logits_to_keep=1).logits[:, -1]


def compiled_step(model, dynamic: bool = False):
    """The model's compiled decode step, made once and kept on the model: (tokens [b, 1], positions [b, 1],
    mask [b, L], cache) -> the scores of each row's next token [b, V]. Shapes are made symbolic after a second one,
    or (`dynamic`) from the first: one graph for every batch and length but one row, as the serving engine's steps
    change both at every join and leave."""
    key = "_compiled_decode_step" + ("_dynamic" if dynamic else "")
    step = model.__dict__.get(key)
    if step is None:
        options = compile_options(next(model.parameters()).device)
        step = torch.compile(lambda *args: forward_step(model, *args), options=options,
                             dynamic=True if dynamic else None)
        model.__dict__[key] = step
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
    with held_cache(model, rows, prefix_length(model) + columns) as cache:
        yield from _decode(model, cache, ids, mask, columns, max_new_tokens, sampling, generators, stop, fallback,
                           vocab_limit)


@contextlib.contextmanager
def held_cache(model, rows: int, length: int) -> Iterator[StaticCache]:
    """A static cache of `rows` x `length` columns: the one the model holds for its last shape, reset, where no other
    call is using it, else a new one (then held). The compiled step's CUDA graphs read the cache's tensors where they
    were recorded: a new cache each call would move them, and each call would record its graphs again."""
    param = next(model.parameters())
    key = (rows, length, param.device, param.dtype)
    current = model.__dict__.get("_static_cache")
    if current is not None and current["key"] == key and not current["busy"]:
        held = current
        held["cache"].reset()
    else:
        held = {"key": key, "busy": False, "cache": StaticCache(config=model.config, max_cache_len=length)}
        if current is None or not current["busy"]:
            model.__dict__["_static_cache"] = held
    held["busy"] = True
    try:
        yield held["cache"]
    finally:
        held["busy"] = False


def _decode(model, cache, ids, mask, columns: int, max_new_tokens: int, sampling: SamplingOptions, generators: list,
            stop, fallback: int, vocab_limit) -> Iterator[tuple[list[int], list[int]]]:
    rows, length = ids.shape
    full = torch.zeros(rows, columns, dtype=torch.long, device=ids.device)
    full[:, :length] = 1 if mask is None else mask
    positions = model.prompt_positions(ids, mask if mask is not None and not bool(mask.all()) else None)
    if positions is None:  # each row's own count of real tokens
        positions = (full[:, :length].cumsum(dim=1) - 1).clamp(min=0)
    scores = forward_step(model, ids, positions, full, cache)
    following = getattr(model, "next_positions", lambda last: last + 1)  # ChatGLM-6B: its 2D positions' next
    positions = following(positions[..., -1:])
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
        positions = following(positions)
