"""GLM-4-0414 (transformers' `Glm4ForCausalLM`), GLM-Edge (`GlmForCausalLM` with its own chat template), GLM-4.5 /
4.6 / 4.7 (`Glm4MoeForCausalLM`: experts), GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: latent attention, experts), GLM-5
(`GlmMoeDsaForCausalLM`: sparse attention) and GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, whose text model the
toolkit runs: KDA linear and sparse attention, hyper-connections): the versions released in transformers' own form,
whose official implementation is transformers' own.

Each test model is a tiny random model built and saved by transformers itself (`save_pretrained`), with random norm
weights (ones would hide a missing or misplaced norm), and a small byte-level BPE tokenizer written as these models
ship it (`tokenizer.json`, tokenizer_config.json with the chat template):
- the toolkit loads the directory as the right version and class, and gives transformers' logits (fp32, max |diff|
  < 1e-5) with and without left padding, and transformers' greedy ids; GLM-4.7-Flash's left-padded prompt of few
  tokens (attention against the cached latents) is finite, each row's logits those of the row alone;
- a directory whose weights do not fit the class its config.json names is refused, saying which;
- P-tuning v2: pre_seq_len 0 is no prefix, a prefix changes the output, save + load gives the same logits; the
  prefix is transformers' model with it as the first cache entries (GLM-4.7-Flash's is each head's keys and values:
  set to the heads' expansion of cache latents, it is transformers' model with those latents first in its cache);
- saving writes transformers' form back (transformers loads it; routed experts one by one, as released), INT8 / INT4
  included (the routed experts too); GLM-5.3-Flash's as released (its composite config.json, its layers' released
  names, the tensors transformers itself saves but the vision encoder's), and a released directory of it (sharded, a
  vision encoder and a multi-token-prediction layer beside the text model) loads as its text model;
- the tokenizer round-trips, and its chat prompts are transformers' `apply_chat_template` on the same
  `tokenizer.json`; a training row is the template's conversation with the record's text as data;
- a `glm4_moe` directory renders the form of the template it ships: GLM-4.5's, or GLM-4.7's (GLM-4.7 is GLM-4.5's
  architecture with GLM-4.7-Flash's template form), in training, prompts and the ollama template; without
  config.json both forms are `glm4-moe` (the template does not tell GLM-4.7 from GLM-4.7-Flash); a tool call with
  null arguments raises in both forms, as the releases' templates do.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from jinja2 import TemplateError
from transformers import (DynamicCache, Glm4Config, Glm4ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM,
                          Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, Glm5NextConfig, Glm5NextForConditionalGeneration,
                          GlmConfig, GlmForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast)

from chatglm_tune import from_pretrained
from chatglm_tune.data.batches import encode_record, prompt_ids
from chatglm_tune.decoding.generation import generate
from chatglm_tune.export.ollama import modelfile
from chatglm_tune.models import registry
from chatglm_tune.models.glm.glm4_tokenizer import RELEASED_CHAT_TEMPLATES, train_released_bpe
from chatglm_tune.models.glm.latent_attention import ABSORBED_MAX_QUERIES
from chatglm_tune.models.glm.moe_templates import GLM4_MOE_LITE_TEMPLATE, GLM4_MOE_TEMPLATE
from chatglm_tune.runtime.checkpoint import CheckpointError
from chatglm_tune.models.glm.modeling import (Glm4ForCausalLMWithPrefix, Glm4MoeForCausalLMWithPrefix,
                                              Glm4MoeLiteForCausalLMWithPrefix, Glm5NextForCausalLMWithPrefix,
                                              GlmForCausalLMWithPrefix, GlmMoeDsaForCausalLMWithPrefix)
from chatglm_tune.data.records import SPORecord
from chatglm_tune.options import EncodingOptions
from test_versions import assert_record_text_is_data

CORPUS = ["故障现象：发动机水温高，风扇始终是低速转动。", "Hello world, the fan turns slowly: 42.",
          "水泵_部件故障_漏油"] * 10
ARCHITECTURES = {"glm4-0414": (Glm4Config, Glm4ForCausalLM, Glm4ForCausalLMWithPrefix),
                 "glm-edge": (GlmConfig, GlmForCausalLM, GlmForCausalLMWithPrefix),
                 "glm4-moe": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeForCausalLMWithPrefix),
                 "glm4-moe-lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, Glm4MoeLiteForCausalLMWithPrefix),
                 "glm5": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GlmMoeDsaForCausalLMWithPrefix),
                 "glm53-flash": (Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextForCausalLMWithPrefix)}
_ATTENTION = dict(num_key_value_heads=2, head_dim=16, attention_bias=True, partial_rotary_factor=0.5)
# 6 experts, 2 a token, so that a batch's tokens route to different ones; the experts' first dense layer
_EXPERTS = dict(moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                routed_scaling_factor=2.5, num_nextn_predict_layers=0)
FIELDS = {"glm4-0414": _ATTENTION, "glm-edge": _ATTENTION,
          "glm4-moe": {**_ATTENTION, **_EXPERTS, "first_k_dense_replace": 1, "use_qk_norm": True},
          "glm4-moe-lite": {**_EXPERTS, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                            "qk_nope_head_dim": 8, "v_head_dim": 16, "mlp_layer_types": ["dense", "sparse"]},
          # GLM-5: 3 layers (a full indexer, one sharing its choice, a full one), each query seeing 4 of its tokens
          "glm5": {**_EXPERTS, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                   "v_head_dim": 16, "mlp_layer_types": ["dense", "sparse", "sparse"], "index_topk": 4,
                   "index_head_dim": 16, "index_n_heads": 2, "indexer_types": ["full", "shared", "full"],
                   "num_hidden_layers": 3},
          # GLM-5.3-Flash: 4 layers, as released every fourth sparse attention (an indexer of 8 heads: with fewer,
          # ties among its pools' scores, which top-k breaks either way, make a padded row pick other tokens), the
          # others KDA; a one-block vision encoder beside them
          "glm53-flash": {**_EXPERTS, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
                          "qk_rope_head_dim": 0, "qk_nope_head_dim": 16, "v_head_dim": 16,
                          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_topk": 8,
                          "index_head_dim": 16, "index_n_heads": 8, "index_kpool": 4, "linear_head_dim": 16,
                          "linear_num_heads": 4, "hc_sinkhorn_iters": 4, "num_hidden_layers": 4,
                          "vision_config": dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                                                out_hidden_size=64, projection_intermediate_size=32, patch_size=2,
                                                image_size=8)}}
# where each version's layers are (GLM-5.3-Flash's text model is the language model of its composite model)
LAYERS = {version: "model.layers." for version in FIELDS} | {"glm53-flash": "model.language_model.layers."}
A_QUANTIZED_KEY = {"glm4-0414": "model.layers.0.mlp.gate_up_proj.weight_scale",
                   "glm-edge": "model.layers.0.mlp.gate_up_proj.weight_scale",
                   "glm4-moe": "model.layers.1.mlp.experts.5.down_proj.weight_scale",
                   "glm4-moe-lite": "model.layers.1.mlp.experts.5.gate_proj.weight_scale",
                   "glm5": "model.layers.2.mlp.experts.5.gate_proj.weight_scale",
                   "glm53-flash": "model.language_model.layers.2.mlp.experts.5.gate_proj.weight_scale"}
NO_INSTRUCTION = EncodingOptions(prompt="")


def released(directory, version: str, seed: int = 0):
    """A tiny random model of `version` saved by transformers itself, and its tokenizer, in `directory`."""
    config_class, model_class, _ = ARCHITECTURES[version]
    tokenizer = train_released_bpe(CORPUS, directory, version)
    fields = {"num_hidden_layers": 2, **FIELDS[version]}
    config = config_class(vocab_size=len(tokenizer) + 10, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          rope_theta=10000.0, eos_token_id=tokenizer.stop_token_ids,
                          pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256, **fields)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:  # a router's correction: 0 would hide it too
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model, tokenizer = released(directory, request.param)
    return request.param, directory, model, tokenizer


def batch(tokenizer, pad: bool):
    """[2, 10] ids (row 0 left-padded by 3 when `pad`), their mask and positions (cumsum - 1, 0 on pads)."""
    ids = torch.randint(0, tokenizer.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if pad:
        ids[0, :3], mask[0, :3] = tokenizer.pad_token_id, 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("pad", (False, True))
def test_logits_equal_transformers(tiny, pad):
    version, directory, reference, tokenizer = tiny
    ours = from_pretrained(directory)
    assert type(ours) is ARCHITECTURES[version][2] and ours.config.chatglm_version == version
    ids, mask, positions = batch(tokenizer, pad)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
    assert (got - want)[mask.bool()].abs().max() < 1e-5


def test_greedy_ids_equal_transformers(tiny):
    _, directory, reference, tokenizer = tiny
    ours = from_pretrained(directory)
    ids, mask, _ = batch(tokenizer, pad=True)
    stops = tokenizer.stop_token_ids  # config.json's eos ids, which transformers stops on
    new = generate(ours, ids, mask, max_new_tokens=12, eos_token_id=stops)
    with torch.no_grad():
        theirs = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:].tolist()
    assert new == [row[: len(mine)] for row, mine in zip(theirs, new)]
    assert all(len(mine) == 12 or mine[-1] in stops for mine in new)


@pytest.mark.parametrize("tiny", ["glm4-moe-lite"], indirect=True)
def test_latent_attention_left_padded_short_batch_is_each_row_alone(tiny):
    """GLM-4.7-Flash on 3 rows left-padded to 7 tokens (2, 1 and 0 pads), a prompt short enough for the attention
    against the cached latents (`ABSORBED_MAX_QUERIES`) and, without a cache, transformers' forward: finite logits,
    each row's real positions those of the row alone and transformers' own model's on the same weights."""
    _, directory, reference, tokenizer = tiny
    ours = from_pretrained(directory)
    ids = torch.randint(0, tokenizer.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    pads = (2, 1, 0)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = tokenizer.pad_token_id, 0
    assert ids.shape[1] <= ABSORBED_MAX_QUERIES
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        alone = [ours(ids[row:row + 1, pad:]).logits[0] for row, pad in enumerate(pads)]
        for use_cache in (True, False):
            got = ours(ids, attention_mask=mask, use_cache=use_cache).logits
            assert torch.isfinite(got).all(), use_cache
            assert (got - want)[mask.bool()].abs().max() < 1e-5, use_cache
            for row, pad in enumerate(pads):
                assert (got[row, pad:] - alone[row]).abs().max() < 1e-5, (use_cache, row)


def test_detection_names_each_kind_of_directory(tiny, tmp_path):
    version, directory, _, _ = tiny
    assert registry.of_directory(directory).name == version and registry.detect_tokenizer(directory) == version
    assert type(registry.load_tokenizer(directory)).prompt_format.name == version
    config = json.loads((directory / "config.json").read_text())
    # a GlmForCausalLM directory of GLM-4-9B's vocabulary, or with GLM-4's template, is glm-4-9b-chat-hf
    if version == "glm-edge":
        assert registry.detect({**config, "vocab_size": 151552}) == "glm4"
        glm4 = tmp_path / "glm4-template"
        glm4.mkdir()
        (glm4 / "chat_template.jinja").write_text(RELEASED_CHAT_TEMPLATES["glm4-0414"])
        assert registry.detect(config, glm4) == "glm4" and registry.detect(config, tmp_path / "none") == "glm4"


def test_weights_of_the_other_class_are_refused(tmp_path):
    released(tmp_path / "glm4", "glm4-0414")
    released(tmp_path / "glm", "glm-edge")

    def mixed(weights: str, model_type: str):
        """The weights of the `weights` directory under its config.json with another `model_type`."""
        directory = tmp_path / f"{weights}-as-{model_type}"
        directory.mkdir()
        save_file(load_file(tmp_path / weights / "model.safetensors"), directory / "model.safetensors")
        config = json.loads((tmp_path / weights / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        return directory

    with pytest.raises(CheckpointError, match="post_(self_attn|mlp)_layernorm.*Glm4ForCausalLM.*model_type glm4"):
        from_pretrained(mixed("glm4", "glm"))  # Glm4ForCausalLM weights under model_type glm
    with pytest.raises(CheckpointError, match="missing weights.*post_self_attn_layernorm.*model_type glm\\)"):
        from_pretrained(mixed("glm", "glm4"))  # GlmForCausalLM weights under model_type glm4


def test_prefix_zero_length_trained_and_saved(tiny, tmp_path):
    version, directory, _, tokenizer = tiny
    ids, mask, _ = batch(tokenizer, pad=True)
    plain = from_pretrained(directory)
    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
        assert torch.equal(from_pretrained(directory, pre_seq_len=0)(ids, attention_mask=mask).logits, want)
        tuned = from_pretrained(directory, pre_seq_len=4, prefix_projection=True)
        tuned.prefix_encoder.embedding.weight.normal_(0, 1.0)
        got = tuned(ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max() > 1e-3  # the prefix changes the output
    tuned.save_pretrained(tmp_path / "full")  # the whole model, prefix included
    saved = load_file(tmp_path / "full" / "model.safetensors")
    assert "transformer.prefix_encoder.embedding.weight" in saved
    assert LAYERS[version] + "0.self_attn.o_proj.weight" in saved
    prefix_only = tmp_path / "prefix"
    tuned.save_pretrained(prefix_only, state_dict={k: v for k, v in tuned.state_dict().items()
                                                   if k.startswith("prefix_encoder.")})
    again = from_pretrained(directory)
    again.load_prefix(prefix_only)
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "full")(ids, attention_mask=mask).logits, got)
        assert torch.equal(again(ids, attention_mask=mask).logits, got)


def test_the_prefix_is_the_first_cache_entries_of_transformers_model(tiny, monkeypatch):
    """P-tuning v2 as ChatGLM3 / GLM-4 have it: transformers' own model with the prefix's keys and values as the first
    `pre_seq_len` cache entries, the mask `[ones(P), mask]`, the real tokens at positions from 0. GLM-4.7-Flash's
    prefix, each head's keys and values, set to what random cache latents expand into: transformers' model with those
    latents as the first cache entries. GLM-5's likewise, its indexers choosing more tokens than there are (every
    query sees the prefix, which transformers' indexer would otherwise rank among the tokens)."""
    version, directory, reference, tokenizer = tiny
    if version == "glm53-flash":
        pytest.skip("GLM-5.3-Flash's prefix is a recurrent state in its KDA layers: test_glm53_flash.py checks it "
                    "against transformers' recurrence")
    tuned = from_pretrained(directory, pre_seq_len=4)
    ids, mask, positions = batch(tokenizer, pad=True)
    with torch.no_grad():
        tuned.prefix_encoder.embedding.weight.normal_(0, 1.0)
        entries = tuned.prefix_key_values(2, torch.float32)
        if version in ("glm4-moe-lite", "glm5"):
            entries = expanded_latents(tuned, reference, rows=2)
        cache = DynamicCache(config=reference.config) if version == "glm5" else DynamicCache()
        for layer, (key, value) in enumerate(entries):
            cache.update(key, value, layer)
            indexer = getattr(reference.model.layers[layer].self_attn, "indexer", None)
            if indexer is not None:  # the prefix positions' indexer keys: any, all are seen
                cache.layers[layer].update_indexer(torch.randn(2, 4, indexer.head_dim))
        for model in (tuned, reference):
            for layer in model.model.layers:
                if getattr(layer.self_attn, "indexer", None) is not None:
                    monkeypatch.setattr(layer.self_attn.indexer, "index_topk", 64)
        want = reference(ids, attention_mask=torch.cat([torch.ones(2, 4, dtype=mask.dtype), mask], 1),
                         position_ids=positions, cache=cache).logits
        got = tuned(ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max() < 1e-5


def expanded_latents(tuned, reference, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random latents and shared keys of `tuned`'s pre_seq_len cache entries ([rows, 1, P, *] per layer), `tuned`'s
    prefix set to each head's expansion of them by transformers' own attention (`expand_kv`)."""
    config, length = reference.config, tuned.pre_seq_len
    generator = torch.Generator().manual_seed(3)
    entries, channels = [], []
    for layer in reference.model.layers:
        latent = torch.randn(1, 1, length, config.kv_lora_rank, generator=generator)
        shared = torch.randn(1, 1, length, config.qk_rope_head_dim, generator=generator)
        keys, values = layer.self_attn.expand_kv(latent, shared)  # [1, H, P, key], [1, H, P, value]
        channels += [keys[0].transpose(0, 1).flatten(1), values[0].transpose(0, 1).flatten(1)]
        entries.append((latent.expand(rows, -1, -1, -1), shared.expand(rows, -1, -1, -1)))
    tuned.prefix_encoder.embedding.weight.copy_(torch.cat(channels, dim=1))
    return entries


@pytest.mark.parametrize("tiny", ["glm5", "glm53-flash"], indirect=True)
def test_a_bfloat16_load_keeps_in_float32_what_transformers_keeps(tiny):
    """GLM-5's indexer head weights and routers, GLM-5.3-Flash's KDA convolution and decay, hyper-connection base and
    scale and routers: float32 as in transformers' own bfloat16 load, every other weight bfloat16; it decodes."""
    version, directory, _, tokenizer = tiny
    ours = from_pretrained(directory, dtype=torch.bfloat16)
    theirs = ARCHITECTURES[version][1].from_pretrained(directory, dtype=torch.bfloat16)
    mine = {name: p.dtype for name, p in ours.named_parameters() if not name.startswith("prefix_encoder")}
    kept = {name: p.dtype for name, p in theirs.named_parameters() if name in mine}
    assert len(kept) == len(mine) and kept == mine
    assert torch.float32 in set(mine.values()) and torch.bfloat16 in set(mine.values())
    ids, mask, _ = batch(tokenizer, pad=True)
    new = generate(ours, ids, mask, max_new_tokens=4, eos_token_id=None)
    assert all(len(row) == 4 for row in new)


def test_saving_writes_transformers_form_back(tiny, tmp_path):
    version, directory, reference, tokenizer = tiny
    ids, mask, positions = batch(tokenizer, pad=True)
    from_pretrained(directory).save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == json.loads((directory / "config.json").read_text())["model_type"]
    assert config["chatglm_version"] == version
    _, model_class, _ = ARCHITECTURES[version]
    with torch.no_grad():  # transformers reads it back as its own
        again = model_class.from_pretrained(tmp_path / "saved").eval()
        assert torch.equal(again(ids, attention_mask=mask, position_ids=positions).logits,
                           reference(ids, attention_mask=mask, position_ids=positions).logits)
    for bits in (8, 4):
        quantized = from_pretrained(directory, quantization_bit=bits)
        quantized.save_pretrained(tmp_path / f"int{bits}")
        stored = json.loads((tmp_path / f"int{bits}" / "config.json").read_text())
        assert stored["quantization_bit"] == bits and stored["model_type"] == config["model_type"]
        assert A_QUANTIZED_KEY[version] in load_file(tmp_path / f"int{bits}" / "model.safetensors")
        with torch.no_grad():
            assert torch.equal(from_pretrained(tmp_path / f"int{bits}")(ids, attention_mask=mask).logits,
                               quantized(ids, attention_mask=mask).logits)
    small = from_pretrained(directory, quantization_bit=4, quantize_embedding=True)  # the INT8 embedding and head too
    with torch.no_grad():
        got = small(ids, attention_mask=mask).logits
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
    assert (got.argmax(-1) == want.argmax(-1))[mask.bool()].float().mean() > 0.7


@pytest.mark.parametrize("tiny", ["glm53-flash"], indirect=True)
def test_a_released_glm53_flash_directory_loads_as_its_text_model(tiny, tmp_path, capsys):
    """GLM-5.3-Flash as released (transformers' own save: its layers' released names, the routed experts one by one,
    the vision encoder beside the text model), sharded, with a multi-token-prediction layer past the last: the toolkit
    loads its text model (the vision encoder and the prediction layer skipped, one note for the encoder) with
    transformers' logits, and saves the same tensors under the same names, the vision encoder's aside."""
    _, directory, reference, tokenizer = tiny
    theirs = load_file(directory / "model.safetensors")
    for released in ("layers.0.hc_attn_fn", "layers.0.self_attn.q_conv1d.weight", "layers.0.self_attn.f_a_proj.weight",
                     "layers.0.self_attn.A_log", "layers.1.mlp.experts.0.gate_proj.weight"):
        assert "model.language_model." + released in theirs, released
    last = reference.config.text_config.num_hidden_layers - 1
    prediction = {k.replace(f"layers.{last}.", f"layers.{last + 1}."): v.clone() for k, v in theirs.items()
                  if k.startswith(f"{LAYERS['glm53-flash']}{last}.")}
    prediction[f"{LAYERS['glm53-flash']}{last + 1}.shared_head.norm.weight"] = torch.ones(64)
    tensors = {**theirs, **prediction}
    keys = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, sharded / name)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in shards.items() for k in part}}))
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (sharded / file).write_bytes((directory / file).read_bytes())
    capsys.readouterr()
    ours = from_pretrained(sharded)
    assert capsys.readouterr().err.count("vision encoder") == 1
    ids, mask, _ = batch(tokenizer, pad=True)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max() < 1e-5
    ours.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    text = {k: v for k, v in theirs.items() if not k.startswith("model.visual.")}
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in text.items()}
    assert all(torch.equal(saved[k], v) for k, v in text.items())


def test_tokenizer_round_trips_and_chats_as_transformers(tiny):
    _, directory, _, tokenizer = tiny
    fast = PreTrainedTokenizerFast.from_pretrained(directory)
    for text in CORPUS[:3] + ["未见过的字：鑫龘 ünïcode\n\n  x"]:
        assert tokenizer.encode_text(text) == fast.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode_text(text)) == text
    conversations = ([{"role": "user", "content": "水泵漏油。"}],
                     [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "你好"},
                      {"role": "assistant", "content": "水泵_部件故障_漏油"}, {"role": "user", "content": "再来 one"}])
    for messages in conversations:
        want = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **tokenizer.prompt_format.template_kwargs)
        assert tokenizer.prompt_format.chat_ids(tokenizer, messages) == want


def test_training_rows_are_the_templates_conversation(tiny):
    version, directory, _, tokenizer = tiny
    fast = PreTrainedTokenizerFast.from_pretrained(directory)
    record = SPORecord("水泵漏油。", None, response="水泵_部件故障_漏油")
    row, prompt = encode_record(record, tokenizer, NO_INSTRUCTION), prompt_ids(record, tokenizer, NO_INSTRUCTION)
    user = {"role": "user", "content": record.text}
    kwargs = tokenizer.prompt_format.template_kwargs  # thinking off, where a template thinks
    assert prompt == fast.apply_chat_template([user], add_generation_prompt=True, tokenize=True,
                                              return_dict=False, **kwargs)
    conversation = fast.apply_chat_template([user, {"role": "assistant", "content": record.response}], tokenize=True,
                                            return_dict=False, **kwargs)
    if version == "glm-edge":  # its template always ends with <|assistant|>, which a trained answer does not
        conversation = conversation[:-1]
    end = tokenizer.get_command("<|user|>")
    assert list(row.input_ids) == conversation + [end] and row.labels[: len(prompt)] == (-100,) * len(prompt)
    assert_record_text_is_data(tokenizer, version, version)
    # a long text loses its end, the template keeps its own (GLM-5.3-Flash's writes its reasoning-effort line too)
    budget = len(prompt_ids(SPORecord("", None), tokenizer, NO_INSTRUCTION)) + 8
    short = prompt_ids(SPORecord("水泵漏油。" * 20, None), tokenizer, EncodingOptions(prompt="", max_src_len=budget))
    assert len(short) <= budget and short[-1] == prompt[-1]


# The mixture-of-experts releases' two template forms: (template, the non-thinking prompt of a text {}, the text an
# answer follows in a training row)
MOE_FORMS = {"GLM-4.5": (GLM4_MOE_TEMPLATE, "[gMASK]<sop><|user|>\n{}/nothink<|assistant|>\n<think></think>", "\n"),
             "GLM-4.7": (GLM4_MOE_LITE_TEMPLATE, "[gMASK]<sop><|user|>{}<|assistant|></think>", "")}


def moe_directory(directory, template: str, model_type: str | None = "glm4_moe"):
    """A small tokenizer of the mixture-of-experts releases' (`train_released_bpe`) shipping `template`, beside a
    config.json of `model_type` (None: none)."""
    train_released_bpe(CORPUS, directory, "glm4-moe")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template},
                                                                ensure_ascii=False),
                                                     encoding="utf-8")
    if model_type:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    return directory


@pytest.mark.parametrize("release", MOE_FORMS)
def test_a_glm4_moe_directory_renders_the_form_of_its_template(release, tmp_path):
    """GLM-4.7 ships GLM-4.7-Flash's template form under `model_type: glm4_moe`: its directory trains and answers on
    that form's prompts (content right after the role token, `</think>` with thinking off), is titled GLM-4.7 and
    exports that form's ollama template; a directory of GLM-4.5's form keeps GLM-4.5's."""
    template, prompt_text, lead = MOE_FORMS[release]
    directory = moe_directory(tmp_path, template)
    version = registry.of_directory(directory)
    tokenizer = version.load_tokenizer(directory)  # as a run's model loads its tokenizer
    assert version.name == "glm4-moe" and tokenizer.prompt_format.name == "glm4-moe"
    fast = PreTrainedTokenizerFast.from_pretrained(directory)
    record = SPORecord("水泵漏油。", None, response="水泵_部件故障_漏油")
    user = {"role": "user", "content": record.text}
    prompt = prompt_ids(record, tokenizer, NO_INSTRUCTION)  # what infer.py answers
    assert prompt == fast.apply_chat_template([user], add_generation_prompt=True, tokenize=True, return_dict=False,
                                              enable_thinking=False)
    assert tokenizer.decode(prompt, spaces_between_special_tokens=False) == prompt_text.format(record.text)
    row = encode_record(record, tokenizer, NO_INSTRUCTION)
    conversation = fast.apply_chat_template([user, {"role": "assistant", "content": record.response}], tokenize=True,
                                            return_dict=False, enable_thinking=False)
    assert list(row.input_ids) == conversation + [tokenizer.get_command("<|user|>")]
    assert tokenizer.decode(list(row.input_ids[len(prompt):-1])) == lead + record.response
    assert tokenizer.prompt_format.title == release
    ollama = modelfile(tokenizer.prompt_format, "x.gguf").split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert ollama.endswith("<|assistant|>" + prompt_text.rpartition("<|assistant|>")[2])
    assert ("/nothink" in ollama) == (release == "GLM-4.5")


def test_a_tokenizer_directory_without_config_json_is_glm4_moe_in_either_form(tmp_path):
    """Without config.json the template does not tell GLM-4.7 from GLM-4.7-Flash: a tokenizer of either form is
    `glm4-moe`, rendering its template's form; config.json's model_type names GLM-4.7-Flash."""
    for release, (template, prompt_text, _) in MOE_FORMS.items():
        directory = moe_directory(tmp_path / release, template, model_type=None)
        assert registry.detect_tokenizer(directory) == "glm4-moe", release
        tokenizer = registry.load_tokenizer(directory)
        prompt = tokenizer.prompt_format.chat_ids(tokenizer, [{"role": "user", "content": "q"}])
        assert tokenizer.prompt_format.title == release
        assert tokenizer.decode(prompt, spaces_between_special_tokens=False) == prompt_text.format("q")
    (directory / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}), encoding="utf-8")
    assert registry.detect_tokenizer(directory) == "glm4-moe-lite"


def test_a_tool_call_with_null_arguments_raises_as_the_releases_templates_do(tmp_path):
    """GLM-4.5's template as released reads a call's arguments with `.items()`: null arguments raise (GLM-4.6's
    writes an empty call instead), as they do in GLM-4.7's form; `{}` writes the call with no argument pairs."""
    fast = PreTrainedTokenizerFast.from_pretrained(moe_directory(tmp_path, GLM4_MOE_TEMPLATE, model_type=None))

    def render(template: str, arguments) -> str:
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        return fast.apply_chat_template(messages, chat_template=template, tokenize=False)

    for template, empty_call in ((GLM4_MOE_TEMPLATE, "\n<tool_call>get_weather\n</tool_call>"),
                                 (GLM4_MOE_LITE_TEMPLATE, "<tool_call>get_weather</tool_call>")):
        with pytest.raises(TemplateError, match="items"):
            render(template, None)
        assert render(template, {}).rstrip("\n").endswith(empty_call)
