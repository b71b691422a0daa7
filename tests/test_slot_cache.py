"""Compiled serving (`ServingOptions(compiled=True)`, serve.py --compile): the engine's running batch in fixed
slots (`slot_cache.SlotCache`), each step one compiled function. Every request gets the tokens `generate` gives its
prompt alone, while requests join and leave, the live columns move right (a prompt longer than the column every row
writes next), left (columns only rows that left used) and the buffers grow. The step runs eagerly in most tests (the
same function: compiling takes tens of seconds on two cores), compiled for real in one. Models that keep a cache of
their own (ChatGLM-6B, GLM-5.3-Flash), and speculative drafts, are refused with a reason.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import SAMPLINGS, TEXTS, Recorder, prompts_of, run_until_idle

import serve as serve_cli
from chatglm_tune.data.batches import SpecialIds
from chatglm_tune.decoding import slot_cache, static_decoding
from chatglm_tune.decoding.engine import Engine
from chatglm_tune.decoding.generation import generate
from chatglm_tune.models import registry
from chatglm_tune.options import DraftOptions, ServingOptions


@pytest.fixture(scope="module", params=[("chatglm3", 3), ("glm4", None)], ids=["chatglm3-prefix", "glm4"])
def tiny(request, tmp_path_factory):
    name, prefix = request.param
    torch.manual_seed(0)
    overrides = {"pre_seq_len": prefix} if prefix else {}
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, tmp_path_factory.mktemp(name), **overrides)
    return model.eval(), tokenizer


@pytest.fixture
def eager_steps(monkeypatch):
    monkeypatch.setattr(static_decoding, "compiled_step",
                        lambda model, **_: lambda *a: static_decoding.forward_step(model, *a))


def serve_alone_and_together(model, tokenizer, n_requests: int, max_batch: int):
    """(each request's tokens from the compiled-serving engine, from `generate` alone, the engine): requests of
    different prompt lengths, budgets and sampling arriving while others run."""
    stop_ids = tokenizer.prompt_format.stop_ids(tokenizer)
    jobs = []
    for i, prompt in enumerate(prompts_of(tokenizer, n_requests)):
        sampling, n = SAMPLINGS[i % 2], 4 + (i * 5) % 17
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=n, sampling=sampling, seed=i,
                         eos_token_id=stop_ids, vocab_limit=len(tokenizer))[0]
        jobs.append((prompt, n, sampling, alone))
    options = ServingOptions(max_batch=max_batch, prefill_tokens=48, compiled=True)
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=options)
    recorders = [Recorder() for _ in jobs]
    requests = [r.request(p, n, sampling=s, seed=i, stop_ids=stop_ids)
                for i, (r, (p, n, s, _)) in enumerate(zip(recorders, jobs))]
    third = max(1, n_requests // 3)
    run_until_idle(engine, {0: requests[:third], 2: requests[third:2 * third], 5: requests[2 * third:]})
    return [r.tokens for r in recorders], [job[3] for job in jobs], engine


def test_each_request_gets_what_generate_gives_it_alone(tiny, eager_steps, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr(slot_cache, "COLUMN_STEP", 8)  # buffers of a few columns: moves and growth every few steps
    moves = []
    move = slot_cache.SlotCache._move
    monkeypatch.setattr(slot_cache.SlotCache, "_move", lambda self, n: (moves.append(n), move(self, n))[1])
    got, alone, engine = serve_alone_and_together(model, tokenizer, 10, max_batch=4)
    assert got == alone
    assert isinstance(engine._cache, slot_cache.SlotCache) and engine._cache.capacity > 8 * 4  # grew
    assert any(n > 0 for n in moves) and any(n < 0 for n in moves)  # room made before a prompt, and columns cut
    assert engine._cache.rows == [] and engine._cache.column == 0  # all left: the next rows start at the first column


@pytest.mark.parametrize("name", ["glm4-moe", "glm4-moe-lite", "glm5"])
def test_the_moe_glms_serve_on_slots_as_generate_alone(name, tmp_path, eager_steps, monkeypatch):
    """Their experts and GLM-4.7-Flash's latent cache (the latents and shared keys as the layers' keys and values)."""
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, tmp_path)
    monkeypatch.setattr(slot_cache, "COLUMN_STEP", 8)
    got, alone, engine = serve_alone_and_together(model.eval(), tokenizer, 7, max_batch=4)
    assert got == alone and isinstance(engine._cache, slot_cache.SlotCache)


def test_the_compiled_engine_gives_the_same_tokens(tmp_path, tracing_only, monkeypatch):
    """Compiled for real: the same tokens, and one graph for every batch and length but one row (a step over a view
    of a whole buffer, or a mask of other strides, compiled again: the spare column and a contiguous mask)."""
    monkeypatch.setattr(slot_cache, "COLUMN_STEP", 8)  # steps over growing buffers and changing column buckets
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS["chatglm3"].tiny(TEXTS, tmp_path, pre_seq_len=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, alone, engine = serve_alone_and_together(model.eval(), tokenizer, 6, max_batch=4)
    assert got == alone and "_compiled_decode_step_dynamic" in model.__dict__
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # one row, and every other shape


@pytest.fixture
def tracing_only(monkeypatch):
    """torch.compile's tracing and guards without code generation (backend "eager"): seconds, not tens of them."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decoding.torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))


def test_warm_up_runs_a_step_at_every_row_bucket_on_the_engines_thread(tiny, eager_steps, monkeypatch):
    """`start(warm_up=...)` returns once the engine's thread has run a step at every row bucket."""
    model, tokenizer = tiny
    seen = []
    step = slot_cache.SlotCache.step

    def counted(self, *args):
        seen.append((self._row_bucket(max(self.rows) + 1), threading.current_thread().name))
        return step(self, *args)

    monkeypatch.setattr(slot_cache.SlotCache, "step", counted)
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer),
                    options=ServingOptions(max_batch=6, compiled=True))
    engine.start(warm_up=prompts_of(tokenizer, 1)[0])
    try:
        assert {rows for rows, _ in seen} == set(slot_cache.row_buckets(6)) == {1, 2, 4, 6}
        assert {thread for _, thread in seen} == {"chatglm_tune-engine"} and engine.unfinished == 0
    finally:
        engine.close()


def test_chatglm6b_and_drafts_are_refused(tmp_path):
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS["chatglm"].tiny(TEXTS, tmp_path)
    with pytest.raises(ValueError,
                       match="compiled serving: ChatGLMForConditionalGeneration carries two positions a row"):
        Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=ServingOptions(compiled=True))
    with pytest.raises(ValueError, match="compiled serving and speculative drafts do not combine"):
        ServingOptions(compiled=True, drafts=DraftOptions())
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--model", str(tmp_path), "--compile", "--speculative"])
    assert serve_cli.parse_args(["--model", str(tmp_path), "--compile"]).options.compiled


def test_glm53_flash_is_refused_compiled_serving_with_the_reason(tmp_path):
    """GLM-5.3-Flash's cache (recurrent states beside sparse layers' entries) has no static form: compiled serving and
    compiled decoding say so; it serves eagerly."""
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS["glm53-flash"].tiny(TEXTS, tmp_path)
    with pytest.raises(ValueError, match="compiled serving: compiled decoding needs a model that decodes on a static "
                                         "cache .Glm5NextForCausalLMWithPrefix keeps its own cache form"):
        Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=ServingOptions(compiled=True))
    with pytest.raises(ValueError, match="static cache"):
        generate(model, torch.tensor([prompts_of(tokenizer, 1)[0]]), max_new_tokens=2, compiled=True)
    assert Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=ServingOptions()).idle
