"""Decoding on a static cache with a compiled step gives the ids of the cached loop: every version that has one
(ChatGLM-6B's 2D positions and both-ways prompts included), with a P-tuning prefix, left-padded rows that stop at
different steps, greedy and seeded sampling. The versions whose cache is their own (the MoE GLMs) refuse it, saying so.

Compiling takes tens of seconds on two cores, so the static cache is checked for every version with the step run
eagerly (the same function), and compiled for real on one version, prefixed, batched and sampled.
"""

from __future__ import annotations

import pytest
import torch
from test_speculative import TEXTS, answering_each_prompt, batch_of

from chatglm_tune.decoding import static_decoding
from chatglm_tune.decoding.generation import generate, generate_steps
from chatglm_tune.models import registry
from chatglm_tune.options import DraftOptions, SamplingOptions
from chatglm_tune.quant.apply import quantize_model
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.loading import from_pretrained

NEW = 20
SAMPLING = SamplingOptions(do_sample=True, top_p=0.9, temperature=0.9)


def tiny(name, directory, prefix=None):
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, directory)
    answering_each_prompt(model)
    if prefix:  # saved and loaded back with a fresh P-tuning prefix, as train.py starts one
        model.save_pretrained(directory)
        model = from_pretrained(directory, pre_seq_len=prefix)
    return model.eval(), tokenizer


def a_stop_that_ends_rows_early(plain) -> int:
    """The generated token that ends the most rows at distinct lengths (random models seldom pick the real stop)."""
    def lengths(token):
        return {row.index(token) if token in row else NEW for row in plain}

    return max({t for row in plain for t in row}, key=lambda t: len(lengths(t)))


def both(model, tokenizer, ids, mask, **kwargs):
    kwargs = dict(max_new_tokens=NEW, vocab_limit=len(tokenizer), **kwargs)
    return generate(model, ids, mask, **kwargs), generate(model, ids, mask, compiled=True, **kwargs)


@pytest.fixture
def eager_steps(monkeypatch):
    """The static cache, each step the same function uncompiled."""
    monkeypatch.setattr(static_decoding, "compiled_step",
                        lambda model: lambda *args: static_decoding.forward_step(model, *args))


@pytest.mark.parametrize("name", list(registry.VERSIONS))
def test_a_static_cache_gives_the_cached_loops_ids(name, tmp_path, eager_steps):
    model, tokenizer = tiny(name, tmp_path)
    ids, mask = batch_of(tokenizer, TEXTS[:5])
    if static_decoding.unsupported(model):
        with pytest.raises(ValueError, match="compiled decoding needs a model that decodes on a static cache"):
            generate(model, ids, mask, max_new_tokens=2, compiled=True)
        return
    plain = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=None, vocab_limit=len(tokenizer))
    stop = a_stop_that_ends_rows_early(plain)
    cached, static = both(model, tokenizer, ids, mask, eos_token_id=stop)
    assert static == cached
    assert len({len(row) for row in cached}) > 1  # rows stopped at different steps
    cached, static = both(model, tokenizer, ids, mask, eos_token_id=stop, sampling=SAMPLING, seed=7)
    assert static == cached


@pytest.mark.parametrize("name", ["glm4", "chatglm"])
def test_a_prefixed_model_on_a_static_cache(name, tmp_path, eager_steps):
    model, tokenizer = tiny(name, tmp_path, prefix=3)
    ids, mask = batch_of(tokenizer, TEXTS[:4])
    cached, static = both(model, tokenizer, ids, mask, eos_token_id=None)
    assert static == cached


def test_chatglm6b_rotary_tables_compile_to_the_same_angles():
    """Its fp16 `inv_freq`, rounded inside a compiled graph, would lose the rounding (inductor keeps the fp32
    intermediate): every angle moves. Made once, eagerly, it is a constant of the graph."""
    from chatglm_tune.models.chatglm6b.modeling import rotary_tables

    positions = torch.stack([torch.full((1, 40), 7), torch.arange(40)[None]], dim=1)  # [1, 2, 40]
    eager = rotary_tables(positions, 32, torch.float32)
    compiled = torch.compile(rotary_tables)(positions, 32, torch.float32)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_the_compiled_step_gives_the_cached_loops_ids(tmp_path):
    model, tokenizer = tiny("chatglm3", tmp_path, prefix=2)
    ids, mask = batch_of(tokenizer, TEXTS[:3])
    greedy, static = both(model, tokenizer, ids, mask, eos_token_id=None)
    assert static == greedy
    step = model.__dict__["_compiled_decode_step"]
    sampled, static = both(model, tokenizer, ids, mask, eos_token_id=None, sampling=SAMPLING, seed=3)
    assert static == sampled != greedy
    assert model.__dict__["_compiled_decode_step"] is step  # compiled once a model
    streamed = [[] for _ in range(ids.shape[0])]  # the same shapes: no second compilation
    for rows, tokens in generate_steps(model, ids, mask, max_new_tokens=4, eos_token_id=None,
                                         vocab_limit=len(tokenizer), compiled=True):
        for row, token in zip(rows, tokens):
            streamed[row].append(token)
    assert streamed == [row[:4] for row in greedy]


def test_compiled_decoding_refuses_speculation_and_quantized_layers(tmp_path):
    model, tokenizer = tiny("chatglm3", tmp_path)
    ids, _ = batch_of(tokenizer, TEXTS[:1])
    with pytest.raises(ValueError, match="do not combine"):
        generate(model, ids, max_new_tokens=2, compiled=True, drafts=DraftOptions())
    quantize_model(model, 4, targets=registry.VERSIONS["chatglm3"].quantizable_linears)
    with pytest.raises(ValueError, match=r"compiled decoding runs float weights, or INT8 / INT4 layers on a CUDA GPU; "
                                         r"model\.layers\.0\.self_attn\.\w+ \(QuantizedLinear, kernel int8dot\)"):
        generate(model, ids, max_new_tokens=2, compiled=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_layers_on_the_compilable_kernel_decode_on_a_static_cache(bits, tmp_path, eager_steps):
    """INT8 / INT4 layers whose kernel a compiled step can hold (intmm, CUDA's choice; forced here on the CPU) decode on
    the static cache with the cached loop's ids."""
    model, tokenizer = tiny("chatglm3", tmp_path, prefix=2)
    quantize_model(model, bits, targets=registry.VERSIONS["chatglm3"].quantizable_linears)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.kernel = "intmm"
    assert static_decoding.unsupported(model) is None
    ids, mask = batch_of(tokenizer, TEXTS[:4])
    cached, static = both(model, tokenizer, ids, mask, eos_token_id=None)
    assert static == cached and {layer.last_kernel for layer in layers} == {"intmm"}


def test_the_cache_is_held_for_the_next_call_of_its_shape(tmp_path, eager_steps):
    """The model keeps its last static cache and resets it for the next call of that shape (its tensors stay where a
    CUDA graph recorded them); two calls interleaved get a cache each, with the same ids."""
    model, tokenizer = tiny("chatglm3", tmp_path, prefix=2)
    ids, mask = batch_of(tokenizer, TEXTS[:3])
    kwargs = dict(max_new_tokens=6, eos_token_id=None, vocab_limit=len(tokenizer), compiled=True)
    first = generate(model, ids, mask, **kwargs)
    keys = model.__dict__["_static_cache"]["cache"].layers[0].keys
    assert generate(model, ids, mask, **kwargs) == first
    assert model.__dict__["_static_cache"]["cache"].layers[0].keys is keys
    streams = [generate_steps(model, ids, mask, **kwargs) for _ in range(2)]
    made = [[[] for _ in range(3)] for _ in streams]
    for steps in zip(*streams):  # one step of each in turn
        for out, (rows, tokens) in zip(made, steps):
            for row, token in zip(rows, tokens):
                out[row].append(token)
    assert made == [first, first]


def test_compile_options_capture_cuda_graphs_on_a_gpu_only():
    cuda = static_decoding.compile_options(torch.device("cuda", 0))
    assert cuda["triton.cudagraphs"] and cuda["coordinate_descent_tuning"]
    assert static_decoding.compile_options(torch.device("cpu")) == {}


def test_the_cache_length_is_rounded_up_to_a_step():
    step = static_decoding.LENGTH_STEP
    assert static_decoding.cache_length(10, 20) == step
    assert static_decoding.cache_length(step - 5, 5) == step
    assert static_decoding.cache_length(step - 5, 6) == 2 * step
