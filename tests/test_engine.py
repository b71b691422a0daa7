"""The continuous-batching engine: every request gets the tokens `generate` gives its prompt alone.

On tiny random models of every version, with and without a P-tuning prefix (GLM-4.7-Flash, GLM-5 and GLM-5.3-Flash
with one): requests of different prompt lengths, budgets, stop ids and sampling (greedy, and seeded top-p) arrive while
others run, more than the batch holds; prompts longer than the prefill budget are prefilled in chunks (ChatGLM-6B's
whole); rows leave at different steps (their padding columns are cut). Also: a cancelled request leaves at the next
step and the others go on unchanged; the queue refuses beyond `max_queue`; a closed engine admits nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from chatglm_tune.data.batches import SpecialIds
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding import emitter, speculative
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.engine import Engine, padding_groups
from chatglm_tune.decoding.generation import generate
from chatglm_tune.decoding.request import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Request
from chatglm_tune.decoding.scheduler import EngineClosed, QueueFull
from chatglm_tune.models import registry
from chatglm_tune.options import DraftOptions, EncodingOptions, SamplingOptions, ServingOptions

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [json.loads(line)["text"]
         for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:40]]
SAMPLINGS = [SamplingOptions(), SamplingOptions(do_sample=True, top_p=0.8, temperature=0.9)]


@pytest.fixture(scope="module", params=[(v, p) for v in ("chatglm", "chatglm2", "chatglm3", "glm4") for p in (None, 3)]
                + [("glm4-moe-lite", 3),  # GLM-4.7-Flash: each head's prefix in place of zero latents
                   ("glm5", 3),  # GLM-5: the same, and the indexer's keys in the latents' cache entries
                   ("glm53-flash", 3)],  # GLM-5.3-Flash: KDA layers' recurrent states beside sparse layers' entries
                ids=lambda param: f"{param[0]}{'-prefix' if param[1] else ''}")
def tiny(request, tmp_path_factory):
    name, prefix = request.param
    torch.manual_seed(0)
    overrides = {"pre_seq_len": prefix} if prefix else {}
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, tmp_path_factory.mktemp(name), **overrides)
    assert (getattr(model.config, "pre_seq_len", None) or None) == prefix
    return model.eval(), tokenizer


class Recorder:
    """on_token / on_finish of one request."""

    def __init__(self):
        self.tokens: list[int] = []
        self.finish: str | None = None

    def request(self, prompt, n, **kwargs) -> Request:
        return Request(prompt, n, on_token=self.tokens.append, on_finish=self.finished, **kwargs)

    def finished(self, reason, error):
        assert self.finish is None, "finished twice"
        self.finish = reason


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    fmt = tokenizer.prompt_format
    return [fmt.prompt_ids(tokenizer, SPORecord(text, None), EncodingOptions())[0] for text in TEXTS[:n]]


def run_until_idle(engine: Engine, arrivals: dict[int, list[Request]], limit: int = 2000) -> int:
    step = 0
    while step < limit:
        for request in arrivals.pop(step, []):
            engine.submit(request)
        if not arrivals and engine.idle:
            return step
        engine.step()
        step += 1
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("guesses", ["lookup", "wrong", "off"])
def test_each_request_gets_what_generate_gives_it_alone(tiny, guesses, monkeypatch):
    """Greedy requests guess their next tokens (speculative decoding) from their own tokens, or
    guess wrong (random ids: rows keep different numbers of tokens), or do not guess: the same tokens. A model whose
    cache cannot take guesses back (GLM-5.3-Flash's recurrent states) refuses guesses asked of the engine."""
    model, tokenizer = tiny
    if guesses != "off" and speculative.refusal(model):
        with pytest.raises(ValueError, match="cannot take rejected guesses back"):
            Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer),
                   options=ServingOptions(drafts=DraftOptions()))
        return
    checks = spy_on_checks(monkeypatch)
    if guesses == "wrong":
        draw = random.Random(0)
        monkeypatch.setattr(emitter, "guess",
                            lambda tokens, n, k, *_: [draw.randrange(len(tokenizer)) for _ in range(k)])
    prompts = prompts_of(tokenizer, 10)
    stop_ids = tokenizer.prompt_format.stop_ids(tokenizer)
    jobs = []
    for i, prompt in enumerate(prompts):
        sampling, n = SAMPLINGS[i % 2], 4 + (i * 5) % 17
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=n, sampling=sampling, seed=i,
                         eos_token_id=stop_ids, vocab_limit=len(tokenizer))[0]
        # every third request stops on the id it generates 3rd (a stop id of its own): it leaves early
        own_stop = [*stop_ids, alone[2]] if i % 3 == 0 and len(alone) > 3 else stop_ids
        if own_stop is not stop_ids:
            alone = generate(model, torch.tensor([prompt]), max_new_tokens=n, sampling=sampling, seed=i,
                             eos_token_id=own_stop, vocab_limit=len(tokenizer))[0]
        jobs.append((prompt, n, sampling, own_stop, alone))
    options = ServingOptions(max_batch=4, prefill_tokens=48, drafts=None if guesses == "off" else DraftOptions())
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=options)
    recorders = [Recorder() for _ in jobs]
    requests = [r.request(p, n, sampling=s, seed=i, stop_ids=stop)
                for i, (r, (p, n, s, stop, _)) in enumerate(zip(recorders, jobs))]
    arrivals = {0: requests[:3], 2: requests[3:6], 5: requests[6:]}  # newcomers while others run; more than the batch
    steps = run_until_idle(engine, arrivals)
    for i, (recorder, (prompt, n, _, stop, alone)) in enumerate(zip(recorders, jobs)):
        assert recorder.tokens == alone, f"request {i}"
        assert recorder.finish == (FINISH_STOP if alone[-1] in stop else FINISH_LENGTH), f"request {i}"
    assert any(len(p) > 48 for p in prompts)  # some prompts went in chunks (or whole, for ChatGLM-6B)
    assert steps < sum(len(job[4]) for job in jobs)  # batched
    assert (checks.count > 0) == (guesses != "off")


def spy_on_checks(monkeypatch):
    """Counts the forwards that check guesses (`BatchCache.verify`)."""
    verify = BatchCache.verify

    def counted(self, *args):
        counted.count += 1
        return verify(self, *args)

    counted.count = 0
    monkeypatch.setattr(BatchCache, "verify", counted)
    return counted


def test_requests_of_one_prompt_share_its_prefill(tiny, monkeypatch):
    """The n answers of a prompt (requests of equal prompts admitted together) are one row of the prefill forward,
    its cache row copied to each; each answer is still what `generate` gives its prompt alone with its seed."""
    model, tokenizer = tiny
    shared, other = prompts_of(tokenizer, 2)
    stop_ids = tokenizer.prompt_format.stop_ids(tokenizer)
    widths = []
    prefill = BatchCache.prefill.__func__
    monkeypatch.setattr(BatchCache, "prefill", classmethod(lambda cls, m, ids, mask: widths.append(ids.shape[0])
                                                           or prefill(cls, m, ids, mask)))
    jobs = [(shared, SAMPLINGS[1], 0), (shared, SAMPLINGS[1], 1), (shared, SAMPLINGS[0], 2), (other, SAMPLINGS[1], 3)]
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer),
                    options=ServingOptions(max_batch=4, prefill_tokens=4096))
    recorders = [Recorder() for _ in jobs]
    run_until_idle(engine, {0: [r.request(p, 6, sampling=s, seed=seed, stop_ids=stop_ids)
                                for r, (p, s, seed) in zip(recorders, jobs)]})
    assert sum(widths) == 2, widths  # two distinct prompts: two rows of prefill for four requests
    for recorder, (prompt, sampling, seed) in zip(recorders, jobs):
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=6, sampling=sampling, seed=seed,
                         eos_token_id=stop_ids, vocab_limit=len(tokenizer))[0]
        assert recorder.tokens == alone, seed


def test_a_cancelled_request_leaves_and_the_others_go_on(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, 3)
    alone = [generate(model, torch.tensor([p]), max_new_tokens=12, eos_token_id=None, vocab_limit=len(tokenizer))[0]
             for p in prompts]
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer))
    recorders = [Recorder() for _ in prompts]
    requests = [r.request(p, 12, stop_ids=[-1]) for r, p in zip(recorders, prompts)]
    for request in requests:
        engine.submit(request)
    for _ in range(4):
        engine.step()
    engine.cancel(requests[1])
    engine.step()
    assert engine.running == 2 and recorders[1].finish == FINISH_CANCELLED
    assert recorders[1].tokens == alone[1][:len(recorders[1].tokens)]
    while engine.running:
        engine.step()
    assert [recorders[0].tokens, recorders[2].tokens] == [alone[0], alone[2]]


def test_a_request_being_prefilled_is_unfinished_though_the_engine_looks_idle(tiny):
    """During a prefill the request is out of the queue and not yet in the batch: `idle` says so, `unfinished`
    (what serve.py's shutdown waits on) still counts it, until its on_finish has run."""
    model, tokenizer = tiny
    seen = []
    hook = model.register_forward_pre_hook(lambda module, inputs: seen.append((engine.idle, engine.unfinished)))
    try:
        engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer))
        recorder = Recorder()
        engine.submit(recorder.request(prompts_of(tokenizer, 1)[0], 3, stop_ids=[-1]))
        assert engine.unfinished == 1 and not engine.idle
        while recorder.finish is None:
            engine.step()
    finally:
        hook.remove()
    assert seen[0] == (True, 1)  # the prefill's forward
    assert engine.unfinished == 0 and recorder.finish == FINISH_LENGTH


def test_the_queue_holds_max_queue_beyond_a_full_batch(tiny):
    model, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer),
                    options=ServingOptions(max_batch=2, max_queue=1))
    for _ in range(3):  # two fill the batch's room, one waits beyond it
        engine.submit(Recorder().request(prompt, 5))
    with pytest.raises(QueueFull):
        engine.submit(Recorder().request(prompt, 5))
    assert engine.unfinished == 3  # the refused one is not counted
    engine.step()  # two admitted: one waits
    assert (engine.running, engine.waiting) == (2, 1)
    with pytest.raises(QueueFull):
        engine.submit(Recorder().request(prompt, 5))
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(Recorder().request(prompt, 5))


def test_newcomers_are_prefilled_in_groups_of_near_length_shortest_first():
    requests = [Request([1] * n, 4, on_token=lambda t: None, on_finish=lambda r, e: None)
                for n in (40, 30, 31, 48, 33, 41)]
    groups = padding_groups(requests, padding=0.1)
    assert [[len(r.prompt) for r in g] for g in groups] == [[30, 31, 33], [40, 41], [48]]
    assert sorted(map(id, (r for g in groups for r in g))) == sorted(map(id, requests))  # each once
    for group in groups:  # pads at most a tenth of a group's positions
        longest = max(len(r.prompt) for r in group)
        assert longest * len(group) - sum(len(r.prompt) for r in group) <= 0.1 * longest * len(group)
    same = [Request([1] * 7, 4, on_token=lambda t: None, on_finish=lambda r, e: None) for _ in range(5)]
    assert padding_groups(same, padding=0.0) == [same]
