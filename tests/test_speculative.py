"""Speculative greedy decoding (guesses looked up in a row's own tokens, checked several a forward) gives the
ids plain greedy decoding gives, for every version, with a P-tuning prefix, a merged LoRA, INT8 / INT4
layers, at batch 1 and in batches of prompts of different lengths that stop at different steps; a model whose cache
cannot take guesses back (GLM-5.3-Flash's) refuses them.

The tiny models get large random weights, so that each prompt gets its own answer (with the presets'
small ones, ChatGLM-6B repeats one token whatever the prompt). A drafter that guesses wrong (random ids)
exercises the rejections, where rows keep different numbers of tokens and the cache is realigned; an
oracle drafter (the plain answer's next tokens) shows a forward taking k + 1 tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from chatglm_tune.data.batches import SpecialIds, collate_prompts
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding import drafting, speculative
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.drafting import AnswerPool, Drafter, follow, guess
from chatglm_tune.decoding.generation import generate
from chatglm_tune.decoding.speculative import DecodeStats
from chatglm_tune.models import registry
from chatglm_tune.options import DraftOptions, EncodingOptions, LoraOptions
from chatglm_tune.quant.apply import quantize_model
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.loading import from_pretrained
from chatglm_tune.runs.lora import apply_lora, merge_lora

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [json.loads(line)["text"]
         for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:24]]
NEW = 24
DRAFTS = DraftOptions()


def test_follow_takes_the_latest_occurrence():
    assert follow([7, 1, 2, 9, 1, 2, 3, 4, 0, 1, 2], 2, 3) == [3, 4, 0]  # [1, 2] latest at 4, not at 1
    assert follow([1, 2, 3], 2, 4) == []
    assert follow([4, 4, 4], 2, 5) == [4]  # an occurrence may overlap the pattern itself


def test_guess_prefers_long_ngrams_then_the_answer_the_pool_and_the_prompt():
    options = DraftOptions(ngram_max=2, ngram_min=1)
    prompt = [5, 6, 8, 1, 6, 9]
    assert guess(prompt + [5, 6], len(prompt), 2, options) == [8, 1]  # bigram [5, 6] beats unigram [6]'s later match
    assert guess(prompt + [6, 7, 3, 6], len(prompt), 2, options) == [7, 3]  # the answer's own [6] before the prompt's
    pool = AnswerPool(size=4, ngram_max=2)
    pool.add([6, 4, 4])
    assert guess(prompt + [2, 6], len(prompt), 2, options, pool) == [4, 4]  # the pool before the prompt
    assert guess(prompt + [2, 6], len(prompt), 2, options) == [9, 2]
    assert guess(prompt + [3], len(prompt), 2, options, pool) == []
    assert guess(prompt + [5, 6], len(prompt), 0, options, pool) == []


def test_the_pool_keeps_the_last_answers_only():
    pool = AnswerPool(size=2, ngram_max=2)
    for answer in ([1, 2, 3], [4, 5], [6, 7]):
        pool.add(answer)
    assert pool.follow([1], 2) == [] and pool.follow([4], 2) == [5] and pool.follow([6], 2) == [7]


def test_draft_lengths_follow_acceptance_and_finished_rows_feed_the_pool():
    drafter = Drafter(DraftOptions(max_draft=8, first_draft=2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]
    assert drafter.draft(0, tokens, 11, 99) == [2, 3]
    drafter.update(0, 2, 2)
    assert len(drafter.draft(0, tokens, 11, 99)) == 4
    drafter.update(0, 4, 1)
    assert len(drafter.draft(0, tokens, 11, 99)) == 2
    assert drafter.draft(0, tokens, 11, 1) == [2]  # never past the budget
    drafter.finished(0, [20, 21, 22])
    assert drafter.draft(1, [30, 20], 1, 4) == [21, 22]  # a later row guesses from the answer before it


@pytest.fixture(scope="module", params=[(v, p) for v in registry.VERSIONS for p in (None, 3)],
                ids=lambda p: f"{p[0]}{'-prefix' if p[1] else ''}")
def tiny(request, tmp_path_factory):
    name, prefix = request.param
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(name)
    # GLM-5: each query choosing among every token of these short rows. A verification forward of k + 1 queries
    # rounds the indexer's scores otherwise than k + 1 one-token steps, and at a near tie on the k-th place its top-k
    # choice, discontinuous, then differs (a tiny model choosing 8 tokens: a different token); the choice among all
    # tests the verification and the cache cut of the indexer's keys, not float rounding.
    overrides = {"index_topk": 1024} if name == "glm5" else {}
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, directory, **overrides)
    answering_each_prompt(model)
    if prefix:  # saved and loaded back with a fresh P-tuning prefix, as train.py starts one
        model.save_pretrained(directory)
        model = from_pretrained(directory, pre_seq_len=prefix)
        assert model.config.pre_seq_len == prefix
    return model.eval(), tokenizer


def answering_each_prompt(model):
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.normal_(std=0.3)
    return model


def batch_of(tokenizer, texts):
    prompts = [tokenizer.prompt_format.prompt_ids(tokenizer, SPORecord(t, None), EncodingOptions())[0] for t in texts]
    batch = collate_prompts(prompts, SpecialIds.of(tokenizer))
    return batch["input_ids"], batch["attention_mask"]


def both(model, tokenizer, ids, mask, stop, stats=None):
    kwargs = dict(max_new_tokens=NEW, eos_token_id=stop, vocab_limit=len(tokenizer))
    return generate(model, ids, mask, **kwargs), generate(model, ids, mask, drafts=DRAFTS, stats=stats, **kwargs)


def a_stop_id_in_mid_answer(model, tokenizer, ids, mask) -> list[int]:
    """Stop ids under which rows stop at different steps: the format's own, and the generated token that
    ends the most rows at distinct lengths (random models seldom pick the real stop id)."""
    plain = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=None, vocab_limit=len(tokenizer))

    def lengths(token):
        return {row.index(token) if token in row else NEW for row in plain}

    return [*tokenizer.prompt_format.stop_ids(tokenizer),
            max({t for row in plain for t in row}, key=lambda t: len(lengths(t)))]


def test_greedy_ids_equal_with_and_without_speculation(tiny, monkeypatch):
    """The same ids; a model whose cache cannot take guesses back (GLM-5.3-Flash's recurrent states) refuses guesses
    asked for and decodes plainly where speculation was to choose itself (`auto`), checking no guess."""
    model, tokenizer = tiny
    ids, mask = batch_of(tokenizer, TEXTS[:6])
    stop = a_stop_id_in_mid_answer(model, tokenizer, ids, mask)
    if speculative.refusal(model):
        kwargs = dict(max_new_tokens=NEW, eos_token_id=stop, vocab_limit=len(tokenizer))
        with pytest.raises(ValueError, match="speculative decoding: .* cannot take rejected guesses back"):
            generate(model, ids, mask, drafts=DRAFTS, **kwargs)
        monkeypatch.setattr(BatchCache, "verify", lambda *args: pytest.fail("a guess was checked"))
        stats = DecodeStats()
        assert generate(model, ids, mask, drafts=dataclasses.replace(DRAFTS, auto=True), stats=stats,
                        **kwargs) == generate(model, ids, mask, **kwargs)
        assert stats.forwards == 0
        return
    stats = DecodeStats()
    plain, fast = both(model, tokenizer, ids, mask, stop, stats)
    assert fast == plain
    auto = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=stop, vocab_limit=len(tokenizer),
                    drafts=dataclasses.replace(DRAFTS, auto=True))  # steps of both kinds: the same ids
    assert auto == plain
    assert len({len(row) for row in plain}) > 1  # rows stopped at different steps
    assert stats.forwards and stats.drafted
    for i in range(2):  # batch 1
        plain_one, fast_one = both(model, tokenizer, ids[i:i + 1, mask[i].bool()], None, stop)
        assert fast_one == plain_one == [plain[i]]


def test_rejected_guesses_leave_the_ids_unchanged(tiny, monkeypatch):
    model, tokenizer = tiny
    if speculative.refusal(model):
        pytest.skip("its cache cannot take guesses back: refused (test_greedy_ids_equal_with_and_without_speculation)")
    guesses = random.Random(0)
    monkeypatch.setattr(drafting, "guess",
                        lambda tokens, n, k, *_: [guesses.randrange(len(tokenizer)) for _ in range(k)])
    ids, mask = batch_of(tokenizer, TEXTS[6:12])
    stats = DecodeStats()
    plain, fast = both(model, tokenizer, ids, mask, a_stop_id_in_mid_answer(model, tokenizer, ids, mask), stats)
    assert fast == plain
    assert stats.accepted < stats.drafted


def test_right_guesses_take_k_plus_one_tokens_a_forward(tiny, monkeypatch):
    model, tokenizer = tiny
    if speculative.refusal(model):
        pytest.skip("its cache cannot take guesses back: refused (test_greedy_ids_equal_with_and_without_speculation)")
    ids, mask = batch_of(tokenizer, TEXTS[:3])
    plain = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=None, vocab_limit=len(tokenizer))
    by_history = {}
    for row_ids, row_mask, answer in zip(ids, mask, plain):
        prompt = row_ids[row_mask.bool()].tolist()
        for n in range(len(answer) + 1):
            by_history[tuple(prompt + answer[:n])] = answer[n:]
    monkeypatch.setattr(drafting, "guess", lambda tokens, n, k, *_: by_history[tuple(tokens)][:k])
    options = DraftOptions(max_draft=7, first_draft=7)
    stats = DecodeStats()
    fast = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=None, vocab_limit=len(tokenizer), drafts=options,
                    stats=stats)
    assert fast == plain
    assert stats.accepted == stats.drafted
    assert stats.forwards == -(-(NEW - 1) // 8)  # the first token from the prefill, then 8 a forward
    assert stats.tokens_per_forward == (NEW - 1) / stats.forwards


def test_sampled_rows_decode_plainly(tiny):
    from chatglm_tune.options import SamplingOptions

    model, tokenizer = tiny
    ids, mask = batch_of(tokenizer, TEXTS[:2])
    sampling = SamplingOptions(do_sample=True, top_p=0.8, temperature=0.9)
    stats = DecodeStats()
    kwargs = dict(max_new_tokens=8, eos_token_id=None, sampling=sampling, seed=3)
    assert generate(model, ids, mask, drafts=DRAFTS, stats=stats, **kwargs) == generate(model, ids, mask, **kwargs)
    assert stats.forwards == 0


@pytest.mark.parametrize("adapt", ["int8", "int4", "lora"])
@pytest.mark.parametrize("name", ["chatglm", "chatglm3", "glm4-0414"])
def test_quantized_and_lora_models_too(name, adapt, tmp_path):
    version = registry.VERSIONS[name]
    torch.manual_seed(0)
    model, tokenizer = version.tiny(TEXTS, tmp_path)
    answering_each_prompt(model)
    if adapt == "lora":
        tuned = apply_lora(model, LoraOptions(r=4, target=version.lora_targets))
        with torch.no_grad():
            for key, weight in tuned.named_parameters():
                if "lora_B" in key:
                    weight.normal_(std=0.2)
        model = merge_lora(tuned)
    else:  # one kernel for every row count: a decode step and a check of k guesses then round alike (the
        # kernels "auto" picks by row count round apart, which flips near-ties of this chaotic model)
        quantize_model(model, 8 if adapt == "int8" else 4, targets=version.quantizable_linears)
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.kernel = "dequant"
    model.eval()
    ids, mask = batch_of(tokenizer, TEXTS[12:17])
    plain, fast = both(model, tokenizer, ids, mask, a_stop_id_in_mid_answer(model, tokenizer, ids, mask))
    assert fast == plain


def test_auto_speculation_tries_both_kinds_then_takes_the_faster_and_tries_the_other_again():
    from chatglm_tune.decoding.adaptive import EXPLORE_EVERY, WARM_UP, SpeculationChooser, bucket

    chooser = SpeculationChooser()
    kinds = []
    for _ in range(2 * WARM_UP):
        kinds.append(chooser.speculate(1))
        chooser.record(1, kinds[-1], seconds=0.010 if kinds[-1] else 0.004, tokens=3 if kinds[-1] else 1)
    assert kinds == [False, True] * WARM_UP  # plain first, then in turn
    taken = [chooser.speculate(1) for _ in range(EXPLORE_EVERY)]  # 3.3 ms a token guessing, 4 ms plain
    assert taken == [True] * (EXPLORE_EVERY - 1) + [False]
    chooser.record(1, False, seconds=0.004, tokens=1)  # the try confirms the choice: the next comes twice as late
    taken = [chooser.speculate(1) for _ in range(2 * EXPLORE_EVERY)]
    assert taken == [True] * (2 * EXPLORE_EVERY - 1) + [False]
    chooser.record(1, False, seconds=0.004, tokens=1)
    assert chooser.speculate(8) is False  # another bucket starts over
    for _ in range(10):  # guessing gets slow at one row: plain from then on
        chooser.record(1, True, seconds=0.050, tokens=2)
    assert chooser.speculate(1) is False
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
