"""GLM-5.3-Flash (transformers' `glm5_next`) as the toolkit runs it, on tiny random configs in fp32: the text model and
head (`modeling.Glm5NextForCausalLMWithPrefix`) against transformers' own `Glm5NextForConditionalGeneration` with
the same weights, the P-tuning prefix (next_prefix.py: each head's keys and values in the sparse attention layers, an
initial recurrent state in the KDA layers), its cache (next_cache.py), left pads, and the toolkit's decoding.

Two layer plans: the released one (every fourth layer sparse attention, the others KDA, `hc_mult` 4) and one with two
sparse layers in a row, the second reusing the first's top-k selection (`indexer_types` "shared"), `hc_mult` 2. The
indexer has 8 heads: with 2, every head's (relu) score of every pool is often 0 for a query, a tie its top-k breaks
either way, and a padded row could pick other pools than the same row alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate, recurrent_kimi_delta_attention

from chatglm_tune.decoding import static_decoding
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.generation import generate
from chatglm_tune.models.glm.next_cache import HybridCache, KdaStateLayer, PrefixStates, seed_prefix
from chatglm_tune.models.glm.next_layers import PadKeepingForgetGate, PrefixedLinearAttention, PrefixedSparseAttention
from chatglm_tune.models.glm.modeling import Glm5NextForCausalLMWithPrefix
from chatglm_tune.models.glm.next_model import TEXT_MODEL, VISION_MODEL
from chatglm_tune.models.glm.next_prefix import (layer_widths, next_prefix_formula, next_prefix_width, prefix_parts,
                                                 prefix_state)

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=8,
            index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=16, linear_num_heads=4,
            hc_sinkhorn_iters=4, pad_token_id=0, eos_token_id=1, max_position_embeddings=512, initializer_range=0.05)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32, patch_size=2, image_size=8)
PLANS = {
    "released": dict(hc_mult=4),  # the config's own schedule: layers 0-2 KDA, layer 3 sparse attention
    "shared-topk": dict(hc_mult=2, layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                                "linear_attention"],
                        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse"] * 2),
}
P = 3  # pre_seq_len
LENGTH = 14  # prompt tokens: more than the indexer keeps (index_topk 8 + the incomplete last pool of 4)
PADS = 5


@pytest.fixture(scope="module", params=list(PLANS))
def plan(request):
    """(the text config's fields, transformers' model with random weights)."""
    text = {**TEXT, **PLANS[request.param]}
    torch.manual_seed(0)
    reference = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=VISION)).eval()
    return text, reference


def ours(plan, **prefix) -> Glm5NextForCausalLMWithPrefix:
    """Our model with transformers' weights (its text keys, as named there), a random prefix encoder where asked."""
    text, reference = plan
    torch.manual_seed(1)
    model = Glm5NextForCausalLMWithPrefix(Glm5NextTextConfig(**text, **prefix)).eval()
    weights = {k: v for k, v in reference.state_dict().items() if not k.startswith(VISION_MODEL)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert unexpected == [] and all(k.startswith("prefix_encoder.") for k in missing), (missing, unexpected)
    return model


def prompts(pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of LENGTH tokens, the second left-padded by PADS where asked: (ids, mask)."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(2, TEXT["vocab_size"], (2, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :PADS] = 0
        ids[1, :PADS] = TEXT["pad_token_id"]
    return ids, mask


def cached_logits(model, ids: torch.Tensor, mask: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of every position, the first `prefill` tokens in one forward, then one token a forward, on the cache
    the model makes."""
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    assert isinstance(out.cache, HybridCache)
    logits = [out.logits]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=out.cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy ids [b, steps], a cached step at a time on the model's own cache."""
    out = model(ids, attention_mask=mask, use_cache=True)
    tokens, cache = [out.logits[:, -1].argmax(-1)], out.cache
    for _ in range(steps - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        tokens.append(model(tokens[-1][:, None], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
                      .argmax(-1))
    return torch.stack(tokens, dim=1)


def test_the_text_keys_are_the_released_models(plan):
    text, reference = plan
    mine = set(ours(plan).state_dict())
    theirs = set(reference.state_dict())
    assert mine == {k for k in theirs if not k.startswith(VISION_MODEL)}
    assert "lm_head.weight" in mine and all(k.startswith(TEXT_MODEL) for k in mine - {"lm_head.weight"})
    assert any(k.startswith(VISION_MODEL) for k in theirs)


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left-padded"])
@torch.no_grad()
def test_logits_equal_transformers(plan, pad):
    _, reference = plan
    ids, mask = prompts(pad)
    want = reference(input_ids=ids, attention_mask=mask).logits
    got = ours(plan)(ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max() < 1e-5


@torch.no_grad()
def test_greedy_ids_equal_transformers_generate(plan):
    """transformers' generate against a cached decode through our forward on our cache, and the toolkit's `generate`
    (its `BatchCache`, whose empty cache the model gives its layers)."""
    _, reference = plan
    ids, mask = prompts(pad=True)
    theirs = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[:, LENGTH:]
    model = ours(plan)
    assert torch.equal(greedy(model, ids, mask, 6), theirs)
    assert generate(model, ids, mask, max_new_tokens=6, eos_token_id=None) == theirs.tolist()


@torch.no_grad()
def test_a_zero_length_prefix_is_none_and_a_zero_prefix_leaves_the_kda_layers_as_they_are(plan):
    """pre_seq_len 0 is no prefix. A prefix of zeros gives every KDA layer the zero state, what it starts from without
    a prefix: the first layer (KDA) computes the same (to the rounding of the zero state's terms, which differs between
    instruction sets); the sparse layers' zero keys still take attention weight (the logits differ)."""
    ids, mask = prompts(pad=True)
    plain = ours(plan)
    want = plain(ids, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(ours(plan, pre_seq_len=0)(ids, attention_mask=mask).logits, want.logits)
    zero = ours(plan, pre_seq_len=P)
    torch.nn.init.zeros_(zero.prefix_encoder.embedding.weight)
    states = zero.prefix_states(2, torch.float32)
    assert all(s is None or not s.any() for s in states) and any(s is not None for s in states)
    got = zero(ids, attention_mask=mask, output_hidden_states=True)
    assert isinstance(zero.model.layers[0].self_attn, PrefixedLinearAttention)
    assert (got.hidden_states[1] - want.hidden_states[1]).abs().max() < 1e-6  # the zero state's terms: rounding
    assert (got.logits - want.logits)[mask.bool()].abs().max() > 1e-4


@torch.no_grad()
def test_the_kda_prefix_is_the_layers_recurrence_over_the_virtual_tokens(plan, monkeypatch):
    """Each KDA layer, with the prefix, computes what transformers' recurrence computes over the P virtual keys and
    values (g = 0, beta = 1) followed by the layer's own tokens, and ends in the same state."""
    ids, _ = prompts(pad=False)
    model = ours(plan, pre_seq_len=P, prefix_projection=True)
    calls = []
    chunked = modeling_glm5_next.chunk_kimi_delta_attention

    def recorded(query, key, value, g, beta, **kwargs):
        out, state = chunked(query, key, value, g=g, beta=beta, **kwargs)
        calls.append((query, key, value, g, beta, kwargs["initial_state"], out, state))
        return out, state

    monkeypatch.setattr(modeling_glm5_next, "chunk_kimi_delta_attention", recorded)
    out = model(ids, use_cache=True)
    kda = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, PrefixedLinearAttention)]
    assert len(calls) == len(kda)
    parts = model.prefix_key_values(2, torch.float32)
    for layer, (query, key, value, g, beta, initial, got, state) in zip(kda, calls):
        virtual_keys, virtual_values = parts[layer]
        torch.testing.assert_close(initial, prefix_state(virtual_keys, virtual_values), rtol=0, atol=0)
        assert initial.abs().max() > 1e-2
        want, want_state = recurrent_kimi_delta_attention(
            torch.cat([virtual_keys, query], 1), torch.cat([virtual_keys, key], 1),
            torch.cat([virtual_values, value], 1), g=torch.cat([torch.zeros_like(virtual_keys), g], 1),
            beta=torch.cat([torch.ones(2, P, virtual_keys.shape[2]), beta], 1), initial_state=None,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (got - want[:, P:]).abs().max() < 1e-5
        assert (state - want_state).abs().max() < 1e-5
        cached = out.cache.layers[layer]
        assert isinstance(cached, KdaStateLayer) and torch.equal(cached.recurrent_states[0], state)
        assert cached.get_seq_length() == P + LENGTH


@torch.no_grad()
def test_the_indexer_picks_among_the_real_tokens_and_every_query_sees_the_prefix(plan):
    """A sparse layer's indexer, given the same hidden states, picks the same tokens with the prefix in the cache as
    without (their indices shifted by P): the prefix's entries are never candidates, and the pools start at the first
    real token. Its pick is sparse here (fewer than the causal tokens), and the attention mask adds the prefix columns
    for every query, a left pad's included."""
    text, _ = plan
    model = ours(plan, pre_seq_len=P)
    config = model.config
    index = next(i for i, t in enumerate(config.layer_types) if t != "linear_attention")
    attention = model.model.layers[index].self_attn
    assert isinstance(attention, PrefixedSparseAttention) and attention.indexer is not None
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, LENGTH, text["hidden_size"], generator=generator)
    _, mask = prompts(pad=True)
    picks = []
    hook = attention.indexer.register_forward_hook(lambda module, args, output: picks.append(output))
    for prefixed in (False, True):
        cache = HybridCache(config)
        if prefixed:
            states = model.prefix_states(2, torch.float32)  # also hands the sparse layers their heads' prefix
            seed_prefix(cache, config, states, 2, P, model.model.norm.weight)
        attention(hidden, attention_mask=mask.bool(), cache=cache)
    hook.remove()
    plain, prefixed = picks
    shifted = torch.where(plain >= 0, plain + P, plain)
    assert torch.equal(prefixed.sort(-1).values, shifted.sort(-1).values)
    seen = (plain >= 0).sum(-1)
    assert int(seen[0, -1]) < LENGTH and int(seen[1, :PADS].max()) == 0  # sparse; a pad's query picks nothing
    query = torch.zeros(2, config.num_attention_heads, LENGTH, 1)
    with_prefix = visible(attention.build_attention_mask_from_topk(prefixed.long(), query, P + LENGTH))
    attention.head_prefix = None
    without = visible(attention.build_attention_mask_from_topk(plain.long(), query, LENGTH))
    assert bool(with_prefix[..., :P].all()) and torch.equal(with_prefix[..., P:], without)


def visible(mask: torch.Tensor) -> torch.Tensor:
    """An attention mask as booleans (True = attend): boolean already, or additive (0 = attend)."""
    return mask if mask.dtype == torch.bool else mask == 0


def test_gradients_reach_every_layers_prefix_and_survive_checkpointing(plan):
    """A training step reaches each layer's share of the encoder's output (KDA: through its initial state; sparse:
    its heads' keys and values); non-reentrant gradient checkpointing, which reruns each layer over a read-only
    prefix cache, gives the same loss and gradients."""
    ids, mask = prompts(pad=True)
    labels = ids.masked_fill(mask == 0, -100)
    model = ours(plan, pre_seq_len=P).train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable()  # non-reentrant, the default
        model.zero_grad()
        torch.manual_seed(4)  # the prefix's dropout
        loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        grads.append((loss.detach(), model.prefix_encoder.embedding.weight.grad.clone()))
    (loss, grad), (again, checkpointed) = grads
    torch.testing.assert_close(again, loss, rtol=0, atol=0)
    torch.testing.assert_close(checkpointed, grad, rtol=1e-5, atol=1e-7)
    for share in grad.split(layer_widths(model.config), dim=-1):
        assert share.abs().sum() > 0
    width = next_prefix_width(model.config)
    assert grad.shape == (P, width) and eval(next_prefix_formula(model.config).split(" = ")[1]) == width


@torch.no_grad()
def test_a_left_padded_row_is_itself_alone_with_a_prefix(plan):
    """A left-padded row's logits and greedy ids are the row's alone: its pads leave the KDA layers' prefix state as
    it is (with transformers' forget gate they decay it, and the row changes)."""
    ids, mask = prompts(pad=True)
    model = ours(plan, pre_seq_len=P, prefix_projection=True)
    alone = model(ids[1:, PADS:]).logits[0]
    got = model(ids, attention_mask=mask).logits[1, PADS:]
    assert (got - alone).abs().max() < 1e-5
    assert generate(model, ids, mask, max_new_tokens=5, eos_token_id=None)[1] == \
        generate(model, ids[1:, PADS:], None, max_new_tokens=5, eos_token_id=None)[0]
    gates = [layer.self_attn.forget_gate for layer in model.model.layers if hasattr(layer.self_attn, "forget_gate")]
    for gate in gates:
        gate.__class__ = Glm5NextTextForgetGate
    decayed = model(ids, attention_mask=mask).logits[1, PADS:]
    for gate in gates:
        gate.__class__ = PadKeepingForgetGate
    assert (decayed - alone).abs().max() > 1e-3


@pytest.mark.parametrize("prefix", [0, P], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left-padded"])
@torch.no_grad()
def test_a_cached_decode_equals_the_full_forward(plan, prefix, pad):
    """A prefill then one token a forward on the model's cache gives the logits of one forward without a cache (its
    prefix in a read-only `PrefixStates`)."""
    ids, mask = prompts(pad)
    model = ours(plan, **({"pre_seq_len": prefix} if prefix else {}))
    full = model(ids, attention_mask=mask, use_cache=False)
    assert full.cache is None
    got = cached_logits(model, ids, mask, prefill=PADS + 2)
    assert (got - full.logits)[mask.bool()].abs().max() < 1e-5


@torch.no_grad()
def test_rows_leave_join_and_are_trimmed_as_the_toolkit_decodes(plan):
    """`BatchCache` over the model's layers: a batch's rows merged with another's (the shorter left-padded after the
    prefix: zero latents, indexer entries of validity 0, recurrent states stacked), a row leaving and the pad columns
    cut, each remaining row scored as decoding alone; a prompt prefilled a chunk at a time scored as at once.
    Speculative checking is refused (recurrent states cannot take tokens back), and so is compiled decoding."""
    model = ours(plan, pre_seq_len=P)
    ids, _ = prompts(pad=False)
    long_prompt, short_prompt = ids[:1], ids[1:, PADS:]
    alone = [BatchCache.prefill(model, prompt, None) for prompt in (long_prompt, short_prompt)]
    batch, scores = BatchCache.prefill(model, long_prompt, None)
    other, other_scores = BatchCache.prefill(model, short_prompt, None)
    batch.merge(other)
    assert batch.padded and batch.mask.shape == (2, LENGTH)
    tokens = torch.cat([scores, other_scores]).argmax(-1)
    merged = batch.step(model, tokens)
    for row, (cache, first) in enumerate(alone):
        assert (merged[row] - cache.step(model, first.argmax(-1))[0]).abs().max() < 1e-5
    batch.select(torch.tensor([1]))
    batch.trim()
    assert not batch.padded and batch.mask.shape == (1, LENGTH - PADS + 1)
    sparse = [layer for layer in batch.cache.layers if not isinstance(layer, KdaStateLayer)]
    assert all(layer.keys.shape[-2] == P + LENGTH - PADS + 1 for layer in sparse)
    token = merged[1:].argmax(-1)
    assert (batch.step(model, token)[0] - alone[1][0].step(model, token)[0]).abs().max() < 1e-5
    chunked = BatchCache.empty(model, ids.device)  # a long prompt a chunk at a time (the engine's chunked prefill)
    for start in range(0, LENGTH, 6):
        last = chunked.extend(model, long_prompt[:, start:start + 6])
    assert (last - scores).abs().max() < 1e-5
    with pytest.raises(ValueError, match="cannot take back"):
        batch.verify(model, [int(token)], [[5, 6]])
    assert "static cache" in static_decoding.unsupported(model)


def test_packed_rows_and_4d_masks_are_refused(plan):
    model = ours(plan)
    ids, mask = prompts(pad=False)
    with pytest.raises(ValueError, match="packed rows"):
        model(ids, segment_ids=torch.ones_like(ids))
    with pytest.raises(ValueError, match="2D attention_mask"):
        model(ids, attention_mask=mask[:, None, None, :].bool())


def test_the_prefix_is_cut_layer_by_layer(plan):
    """The encoder's output, channel for channel: each layer's keys (head after head) then its values, KDA layers'
    [b, P, heads, D], sparse layers' [b, heads, P, D]; a read-only `PrefixStates` holds the KDA states and zero
    entries where the sparse layers' prefix goes."""
    model = ours(plan, pre_seq_len=P)
    config = model.config
    encoder = model.prefix_encoder
    out = encoder(torch.arange(P)[None])[0]  # [P, W]
    parts = prefix_parts(encoder, torch.nn.Identity(), config, 1, torch.float32)
    start = 0
    for layer, ((keys, values), width) in enumerate(zip(parts, layer_widths(config))):
        chunk = out[:, start:start + width]
        start += width
        if config.layer_types[layer] != "linear_attention":
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        assert torch.equal(torch.cat([keys[0].flatten(1), values[0].flatten(1)], dim=-1), chunk)
    assert start == out.shape[-1] == next_prefix_width(config)
    states = model.prefix_states(1, torch.float32)
    cache = PrefixStates(config, states, 1, P, model.model.norm.weight)
    for layer, state in zip(cache.layers, states):
        if state is None:
            assert layer.get_seq_length() == P and not layer.keys.any()
        else:
            assert layer.get_seq_length() == P and layer.recurrent_states[0] is state


@torch.no_grad()
def test_a_reset_cache_takes_the_prefix_again(plan):
    """transformers' `reset` empties the cache (the KDA layers forget their prefix count too): the next forward puts
    the prefix in anew and gets the logits of a new cache."""
    ids, mask = prompts(pad=True)
    model = ours(plan, pre_seq_len=P)
    first = model(ids, attention_mask=mask, use_cache=True)
    first.cache.reset()
    again = model(ids, attention_mask=mask, cache=first.cache, use_cache=True)
    assert torch.equal(again.logits, first.logits)
    assert all(layer.get_seq_length() == P + LENGTH for layer in again.cache.layers)
