"""Tests of chatglm_tune.decoding.generation: golden greedy ids, batching, cache, samplers, stopping, chat().

The golden checkpoints come from conftest's `golden` fixture (`model-small-vocab` always, `model-tiny`
when the shared golden folder beside the checkout is there). Ids are compared up to the first step
whose golden top-1/top-2 margin is below 1e-3 (where another float summation order may legitimately
pick the other token).
"""

import pytest
import torch
from conftest import left_pad_mask

from chatglm_tune.decoding.chat import chat
from chatglm_tune.decoding.generation import generate, generate_recompute
from chatglm_tune.decoding.sampling import guard_invalid_scores, limit_vocab, next_tokens, top_k_filter, top_p_filter
from chatglm_tune.models.chatglm6b.format import process_response
from chatglm_tune.options import CHAT_SAMPLING, SamplingOptions

MARGIN = 1e-3



def reliable_prefix(case) -> int:
    """How many golden ids must match: all, or those before the first step with a margin < 1e-3."""
    margins = case.get("step_margins") or []
    small = [i for i, m in enumerate(margins) if m < MARGIN]
    return small[0] if small else len(case["expect_new_ids"])


def batch_of(case):
    ids = torch.tensor(case["input_ids"])
    return ids, left_pad_mask(ids, 3)


def unpadded_rows(ids, mask):
    return [row[m.bool()][None] for row, m in zip(ids, mask)]


# ----------------------------------------------------------------------------------------------
# Golden parity


def test_greedy_cases_match_golden(golden):
    model = golden.model()
    for case in golden.of_kind("greedy"):
        got = generate(model, torch.tensor([case["input_ids"]]), max_new_tokens=case["max_new_tokens"],
                       eos_token_id=None)[0]
        n = reliable_prefix(case)
        assert len(got) == case["max_new_tokens"]
        assert got[:n] == case["expect_new_ids"][:n], case["name"]


def test_batch_greedy_cases_match_golden(golden):
    model = golden.model()
    for case in golden.of_kind("batch_greedy"):
        ids, mask = batch_of(case)
        assert not bool(mask.all()), "the golden batch is left-padded"
        got = generate(model, ids, mask, max_new_tokens=case["max_new_tokens"], eos_token_id=None)
        assert got == case["expect_new_ids"], case["name"]


def test_prefix_cases_match_golden(golden):
    for case in golden.of_kind("prefix"):
        model = golden.model(pre_seq_len=case["pre_seq_len"], prefix_projection=case["prefix_projection"])
        model.load_prefix(golden.dir / case["prefix_file"])
        expect = case["expect_new_ids"]
        got = generate(model, torch.tensor([case["input_ids"]]), max_new_tokens=len(expect), eos_token_id=None)[0]
        assert got == expect, case["name"]


def test_each_padded_row_equals_its_prompt_alone(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    batched = generate(model, ids, mask, max_new_tokens=12, eos_token_id=None)
    alone = [generate(model, row, max_new_tokens=12, eos_token_id=None)[0] for row in unpadded_rows(ids, mask)]
    assert batched == alone


# ----------------------------------------------------------------------------------------------
# Cache against recompute


def test_cached_equals_recompute_greedy(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    cached = generate(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    assert cached == generate_recompute(model, ids, mask, max_new_tokens=16, eos_token_id=None)


def test_cached_equals_recompute_with_prefix_and_sampling(golden):
    case = golden.of_kind("prefix")[-1]
    model = golden.model(pre_seq_len=case["pre_seq_len"], prefix_projection=case["prefix_projection"])
    model.load_prefix(golden.dir / case["prefix_file"])
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    kwargs = dict(max_new_tokens=10, sampling=SamplingOptions(do_sample=True, top_p=0.9, temperature=0.8,
                                                              top_k=40), seed=7,
                  eos_token_id=None)
    assert generate(model, ids, mask, **kwargs) == generate_recompute(model, ids, mask, **kwargs)


def test_cached_equals_recompute_with_stops(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    eos = golden.of_kind("batch_greedy")[0]["expect_new_ids"][1][2]  # row 1 stops at its 3rd token
    cached = generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos)
    assert cached == generate_recompute(model, ids, mask, max_new_tokens=12, eos_token_id=eos)


# ----------------------------------------------------------------------------------------------
# Stopping, finished rows, vocabulary limit


def test_eos_stops_each_row_and_is_kept(golden):
    model = golden.model()
    case = golden.of_kind("batch_greedy")[0]
    ids, mask = batch_of(case)
    full = generate(model, ids, mask, max_new_tokens=8, eos_token_id=None)
    eos = case["expect_new_ids"][1][2]
    stopped = generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos)
    for row_full, row_stopped in zip(full, stopped):
        cut = row_full.index(eos) + 1 if eos in row_full else len(row_full)
        assert row_stopped == row_full[:cut]
    assert stopped[1] == full[1][:3] and len(stopped[1]) < len(full[1])


def test_finished_rows_leave_the_batch(golden):
    model = golden.model()
    case = golden.of_kind("batch_greedy")[0]
    ids, mask = batch_of(case)
    eos = case["expect_new_ids"][1][2]
    sizes = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: sizes.append(args[0].shape[0]), with_kwargs=True)
    try:
        out = generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos)
    finally:
        hook.remove()
    # Forward n (n = 0: the prompt) runs only the rows that had not stopped within their first n tokens.
    expect = [sum(len(row) > n for row in out) for n in range(max(map(len, out)))]
    assert sizes == expect
    assert min(expect) < 3, "some row must stop early for this test to mean anything"


def test_all_rows_finished_stops_early(golden):
    model = golden.model()
    case = golden.of_kind("greedy")[0]
    first = case["expect_new_ids"][0]
    assert generate(model, torch.tensor([case["input_ids"]]), max_new_tokens=10, eos_token_id=first) == [[first]]


def test_default_eos_is_the_config_eop(golden):
    model = golden.model()
    case = golden.of_kind("greedy")[0]
    eos = case["expect_new_ids"][1]
    model.config.eos_token_id = eos
    got = generate(model, torch.tensor([case["input_ids"]]), max_new_tokens=10)[0]
    assert got == case["expect_new_ids"][: case["expect_new_ids"].index(eos) + 1]


@pytest.mark.parametrize("do_sample", [False, True])
def test_vocab_limit_is_respected(golden, do_sample):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    unlimited = generate(model, ids, mask, max_new_tokens=6, eos_token_id=None)
    limit = min(min(row) for row in unlimited)  # excludes every id the unlimited run picked
    got = generate(model, ids, mask, max_new_tokens=6, eos_token_id=None, vocab_limit=limit,
                   sampling=SamplingOptions(do_sample=do_sample), seed=0)
    assert all(0 <= t < limit for row in got for t in row)


def test_max_new_tokens_zero_and_bad_inputs(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    assert generate(model, ids, mask, max_new_tokens=0) == [[], [], []]
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask must be the 2D pad mask"):
        generate(model, ids, mask[:, None, None, :].bool(), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, mask, max_new_tokens=-1)
    with pytest.raises(ValueError, match="no <sop>"):
        generate(model, ids[:, :-1], mask[:, :-1], max_new_tokens=2)


def test_generate_restores_training_mode(golden):
    model = golden.model().train()
    generate(model, torch.tensor([golden.of_kind("greedy")[0]["input_ids"]]), max_new_tokens=2)
    assert model.training


# ----------------------------------------------------------------------------------------------
# Sampling: reproducibility and validation


def test_seeded_sampling_is_reproducible_and_per_row(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    kwargs = dict(max_new_tokens=12, sampling=SamplingOptions(do_sample=True, top_p=0.95, temperature=1.5),
                  eos_token_id=None)
    a = generate(model, ids, mask, seed=123, **kwargs)
    assert a == generate(model, ids, mask, seed=123, **kwargs)
    assert a != generate(model, ids, mask, seed=124, **kwargs)
    # Row i draws from its own generator (seed + i): alone, with seed [123 + i], it samples the same.
    alone = [generate(model, row, seed=[123 + i], **kwargs)[0] for i, row in enumerate(unpadded_rows(ids, mask))]
    assert a == alone


def test_temperature_zero_means_greedy(golden):
    model = golden.model()
    ids, mask = batch_of(golden.of_kind("batch_greedy")[0])
    greedy = generate(model, ids, mask, max_new_tokens=5, eos_token_id=None)
    assert generate(model, ids, mask, max_new_tokens=5, eos_token_id=None,
                    sampling=SamplingOptions(do_sample=True, temperature=0)) == greedy


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.01, float("nan")])
def test_top_p_outside_unit_interval_is_rejected(top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingOptions(do_sample=True, top_p=top_p)


@pytest.mark.parametrize("temperature", [-0.5, float("inf"), float("nan")])
def test_bad_temperature_is_rejected(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingOptions(do_sample=True, temperature=temperature)


def test_generate_takes_its_sampling_as_one_validated_object(golden):
    model = golden.model()
    ids = torch.tensor([golden.of_kind("greedy")[0]["input_ids"]])
    with pytest.raises(TypeError, match="sampling must be a SamplingOptions"):
        generate(model, ids, max_new_tokens=2, sampling={"do_sample": True, "top_p": 1.5})
    with pytest.raises(TypeError):
        generate(model, ids, max_new_tokens=2, do_sample=True)  # no loose sampling arguments


def test_sampling_defaults():
    assert SamplingOptions().greedy
    assert (SamplingOptions().top_p, SamplingOptions().temperature) == (0.95, 0.95)
    assert (CHAT_SAMPLING.do_sample, CHAT_SAMPLING.top_p, CHAT_SAMPLING.temperature,
            CHAT_SAMPLING.top_k) == (True, 0.7, 0.95, 50)


# ----------------------------------------------------------------------------------------------
# Samplers on hand-built distributions


def kept_ids(probs, p):
    sorted_probs, sorted_ids = top_p_filter(torch.tensor([probs]), p)
    kept = sorted_probs[0] > 0
    return set(sorted_ids[0][kept].tolist()), sorted_probs[0][kept]


@pytest.mark.parametrize(
    "p, expect",
    [
        (0.1, {2}),  # the top token alone reaches p
        (0.5, {2}),  # exactly reached by the top token: the smallest set is one token
        (0.5001, {2, 0}),
        (0.75, {2, 0}),  # exactly reached by two tokens
        (0.8, {2, 0, 3}),
        (0.875, {2, 0, 3}),
        (0.9, {2, 0, 3, 1}),
        (1.0, {2, 0, 3, 1}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expect):
    probs = [0.25, 0.125, 0.5, 0.125]  # sorted: id 2 (0.5), id 0 (0.25), then 3 and 1 (0.125 each)
    kept, renormalised = kept_ids(probs, p)
    if len(expect) == 3:  # a tie at 0.125: either of ids 1 and 3 completes the set
        assert len(kept) == 3 and {2, 0} <= kept
    else:
        assert kept == expect
    assert torch.isclose(renormalised.sum(), torch.tensor(1.0))


def test_top_p_keeps_one_token_of_a_peaked_row_and_all_of_a_flat_one():
    probs = torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]])
    sorted_probs, _ = top_p_filter(probs, 0.9)
    assert (sorted_probs > 0).sum(dim=-1).tolist() == [1, 4]


def test_top_p_draws_only_kept_tokens():
    scores = torch.log(torch.tensor([[0.25, 0.125, 0.5, 0.125]])).repeat(200, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    tokens = next_tokens(scores, SamplingOptions(do_sample=True, top_p=0.75, temperature=1.0), gens, fallback_id=0)
    assert set(tokens.tolist()) == {0, 2}


def test_top_k_keeps_k_best_and_ties():
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    assert torch.isfinite(top_k_filter(scores, 2)).tolist() == [[False, True, True, True, False]]
    assert torch.equal(top_k_filter(scores, None), scores)


def test_guard_replaces_only_invalid_rows():
    scores = torch.tensor([[0.1, 0.2, 0.3], [float("nan"), 1.0, 0.0], [0.0, float("inf"), 1.0]])
    with pytest.warns(RuntimeWarning, match="2 row"):
        out = guard_invalid_scores(scores, fallback_id=2)
    assert torch.equal(out[0], scores[0])
    assert out[1:].argmax(dim=-1).tolist() == [2, 2]
    assert not torch.isnan(out).any()
    gens = [torch.Generator().manual_seed(0)] * 3
    with pytest.warns(RuntimeWarning):
        drawn = next_tokens(scores, SamplingOptions(do_sample=True), gens, fallback_id=2)
    assert drawn[1:].tolist() == [2, 2]


def test_limit_vocab():
    scores = torch.zeros(2, 6)
    assert torch.isinf(limit_vocab(scores, 4)[:, 4:]).all() and torch.isfinite(limit_vocab(scores, 4)[:, :4]).all()
    assert torch.equal(limit_vocab(scores, None), scores)


# ----------------------------------------------------------------------------------------------
# chat()


def test_process_response_official_rules():
    assert process_response("  你好,世界!ok, fine: [[训练时间]]  ") == "你好，世界！ok, fine: 2023年"
    assert process_response("问题?答案:是;对") == "问题？答案：是；对"


def test_chat_uses_the_official_prompt_and_history(tmp_path):
    from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
    from chatglm_tune.models.chatglm6b.format import chat_prompt
    from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["你好，我是人工智能助手。", "问：答：Round"] * 20, tmp_path, vocab_size=400)
    torch.manual_seed(0)
    config = ChatGLMConfig.from_name("tiny", hidden_size=32, num_layers=1, num_attention_heads=2, inner_hidden_size=64,
                                     **tokenizer.config_overrides())
    model = ChatGLMForConditionalGeneration(config).eval()
    response, history = chat(model, tokenizer, "你好", [("早", "早上好")], max_length=40, seed=1)
    ids = tokenizer.encode(chat_prompt("你好", [("早", "早上好")]))
    official = SamplingOptions(do_sample=True, top_p=0.7, temperature=0.95, top_k=50)
    expect_ids = generate(model, torch.tensor([ids]), max_new_tokens=40 - len(ids), sampling=official, seed=1,
                          vocab_limit=len(tokenizer))[0]
    assert response == process_response(tokenizer.decode(expect_ids))
    assert history == [("早", "早上好"), ("你好", response)]
    # the official method on the model: model.chat(tokenizer, query, history)
    assert model.chat(tokenizer, "你好", [("早", "早上好")], max_length=40, seed=1) == (response, history)
    greedy, _ = model.chat(tokenizer, "你好", max_length=40, do_sample=False)
    ids = tokenizer.encode(chat_prompt("你好", None))
    assert greedy == process_response(tokenizer.decode(generate(model, torch.tensor([ids]),
                                                                max_new_tokens=40 - len(ids),
                                                                vocab_limit=len(tokenizer))[0]))
    with pytest.raises(ValueError, match="no room left"):
        chat(model, tokenizer, "你好" * 30, max_length=10)
