"""ChatGLM2-6B / ChatGLM3-6B / GLM-4-9B model core (chatglm_tune.models.glm) against the official code's golden outputs.

Fixtures: tests/fixtures/{chatglm2,chatglm3,glm4}-tiny, the official code's golden outputs
copied whole: official config.json and fp16 weights under official keys, cases.json, every position's
fp32 logits, and for ChatGLM2/3 official P-tuning v2 prefix files. Tolerances are the ones the golden
outputs were made for: max |diff| of logits < 1e-3 where attention_mask == 1, loss < 1e-3, greedy ids
equal up to a step whose top-1/top-2 margin is below 1e-3.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, GlmConfig

from chatglm_tune.models import registry
from chatglm_tune.models.glm.config import detect_version, glm_config, official_config
from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix, load_glm, positions_from_mask, save_official
from chatglm_tune.models.glm.prefix import prefix_width
from chatglm_tune.models.glm.weights import qkv_rows, to_official, to_transformers
from chatglm_tune.runtime.checkpoint import CheckpointError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VERSIONS = ("chatglm2", "chatglm3", "glm4")
TOL, MARGIN = 1e-3, 1e-3


class GoldenGlm:
    def __init__(self, version: str):
        self.version = version
        self.dir = FIXTURES / f"{version}-tiny"
        self.cases = json.loads((self.dir / "cases.json").read_text())["cases"]
        self.logits = load_file(self.dir / "logits.safetensors")
        self._models = {}

    def case(self, name):
        return next(c for c in self.cases if c["name"] == name)

    def model(self, pre_seq_len=None, prefix_projection=False, prefix_file=None):
        """A loaded eval-mode model, cached per prefix setting (tests must not modify it)."""
        key = (pre_seq_len, prefix_projection, prefix_file)
        if key not in self._models:
            model = load_glm(self.dir, pre_seq_len=pre_seq_len, prefix_projection=prefix_projection)
            if prefix_file:
                model.load_prefix(self.dir / prefix_file)
            self._models[key] = model
        return self._models[key]

    def case_model(self, case):
        if "prefix_file" not in case:
            return self.model()
        return self.model(case["pre_seq_len"], case["prefix_projection"], case["prefix_file"])


GOLDEN = {v: GoldenGlm(v) for v in VERSIONS}
CASES = [(v, c["name"]) for v in VERSIONS for c in GOLDEN[v].cases]


def batch(case):
    """input_ids [b, s] and attention_mask [b, s] of a case (single rows get b = 1 and an all-ones mask)."""
    ids = torch.tensor(case["input_ids"])
    ids = ids[None] if ids.dim() == 1 else ids
    mask = torch.tensor(case["attention_mask"]) if "attention_mask" in case else torch.ones_like(ids)
    return ids, mask


@torch.no_grad()
def greedy(model, input_ids, attention_mask, steps):
    """KV-cached greedy decoding: new ids [b, steps]; positions come from the growing mask."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, use_cache=True).logits[:, -1]
    new = []
    for _ in range(steps):
        token = logits.argmax(-1)
        new.append(token)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], dim=1)
        logits = model(token[:, None], attention_mask=attention_mask, cache=cache, use_cache=True).logits[:, -1]
    return torch.stack(new, dim=1)


def assert_greedy(got, expect, margins):
    """Rows equal up to (not including) the first step whose golden margin is below MARGIN."""
    expect, margins = torch.tensor(expect), torch.tensor(margins)
    expect, margins = (expect[None], margins[None]) if expect.dim() == 1 else (expect, margins)
    assert got.shape == expect.shape
    for row in range(len(expect)):
        close = (margins[row] < MARGIN).nonzero()
        upto = int(close[0]) if len(close) else expect.shape[1]
        assert got[row, :upto].tolist() == expect[row, :upto].tolist(), f"row {row}"


def assert_logits(logits, expect, mask):
    expect = expect[None] if expect.dim() == 2 else expect
    assert logits.shape == expect.shape
    diff = (logits - expect).abs()[mask.bool()].max().item()
    assert diff < TOL, diff


def expected_loss(logits, labels):
    """The official loss from logits: shift by one, mean cross entropy over labelled tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


# --- every golden case ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version, name", CASES)
def test_golden_case(version, name):
    golden = GOLDEN[version]
    case = golden.case(name)
    model = golden.case_model(case)
    ids, mask = batch(case)
    kind = case["kind"]
    if kind in ("single", "batch_left_padded", "prefix", "prefix_batch_left_padded"):
        # batched cases: the mask alone, no position_ids: the model derives the official ones from it
        with torch.no_grad():
            logits = model(ids, attention_mask=mask if "attention_mask" in case else None).logits
        assert_logits(logits, golden.logits[case["expect_tensor"] + "_all"], mask)
        if "top5_ids" in case:
            top = logits[0].topk(5)
            assert torch.allclose(top.values, torch.tensor(case["top5_logits"]), atol=TOL)
    if kind in ("batch_left_padded", "batch_greedy", "prefix_batch_left_padded", "loss_batch_left_padded"):
        # the official tokenizer's position_ids agree with the ones derived from the mask
        assert positions_from_mask(mask, 0, ids.shape[1]).tolist() == case["position_ids"]
    if kind in ("greedy", "batch_greedy", "prefix", "prefix_batch_left_padded"):
        got = greedy(model, ids, mask, case["max_new_tokens"])
        assert_greedy(got, case["expect_new_ids"], case["step_margins"])
    if kind in ("loss", "loss_batch_left_padded"):
        labels = torch.tensor(case["labels"])
        labels = labels[None] if labels.dim() == 1 else labels
        with torch.no_grad():
            loss = model(ids, attention_mask=mask, labels=labels).loss
        assert abs(loss.item() - case["expect_loss"]) < TOL


def test_every_kind_is_covered():
    kinds = {c["kind"] for v in VERSIONS for c in GOLDEN[v].cases}
    assert kinds == {"single", "greedy", "batch_left_padded", "batch_greedy", "prefix", "prefix_batch_left_padded",
                     "loss", "loss_batch_left_padded"}


@pytest.mark.parametrize("version", ("chatglm2", "chatglm3"))
def test_prefix_without_a_cache_equals_the_cached_path(version):
    """use_cache=False carries the prefix in a read-only PrefixCache: same logits as the DynamicCache path."""
    golden = GOLDEN[version]
    case = golden.case("prefix_proj_batch")
    model = golden.case_model(case)
    ids, mask = batch(case)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False)
    assert out.cache is None
    assert_logits(out.logits, golden.logits[case["expect_tensor"] + "_all"], mask)


@pytest.mark.parametrize("padded", (False, True))
def test_the_decode_step_attention_equals_transformers_sdpa(padded):
    """One query over grouped key/value heads runs as the group's heads as queries of one head: the same logits as
    transformers' SDPA attention, with no mask (PyTorch's GQA path there) and with a left-padding mask."""
    from chatglm_tune.models.glm.attention import ATTENTION

    model = load_glm(FIXTURES / "glm4-tiny")
    assert model.config._attn_implementation == ATTENTION
    torch.manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
    steps = {}
    for attention in (ATTENTION, "sdpa"):
        model.set_attn_implementation(attention)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache, use_cache=True)
            steps[attention] = model(ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True).logits
    torch.testing.assert_close(steps[ATTENTION], steps["sdpa"], rtol=1e-5, atol=1e-5)


# --- training: prefix, gradient checkpointing, nothing frozen ------------------------------------------


def _train_step(golden, case, checkpointing):
    model = load_glm(golden.dir, pre_seq_len=case["pre_seq_len"], prefix_projection=case["prefix_projection"])
    model.load_prefix(golden.dir / case["prefix_file"])
    model.requires_grad_(False)  # the P-tuning v2 recipe: a frozen trunk, a trainable encoder
    model.prefix_encoder.requires_grad_(True)
    model.train()
    model.prefix_dropout.eval()  # deterministic, to compare with the golden (eval) logits
    if checkpointing:
        model.activation_checkpointing_enable()
    ids, mask = batch(case)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out, labels, {k: p.grad for k, p in model.prefix_encoder.named_parameters()}


@pytest.mark.parametrize("version", ("chatglm2", "chatglm3"))
def test_prefix_training_step_with_gradient_checkpointing(version):
    golden = GOLDEN[version]
    case = golden.case("prefix_proj_batch")
    out, labels, grads = _train_step(golden, case, checkpointing=True)
    expect = expected_loss(golden.logits[case["expect_tensor"] + "_all"], labels)
    assert abs(out.loss.item() - expect.item()) < TOL  # the prefix survived checkpointing
    assert set(grads) == {"embedding.weight", "trans.0.weight", "trans.0.bias", "trans.2.weight", "trans.2.bias"}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    _, _, plain = _train_step(golden, case, checkpointing=False)
    for key in grads:
        torch.testing.assert_close(grads[key], plain[key], rtol=1e-4, atol=1e-6)


def test_reentrant_checkpointing_with_a_prefix_is_refused():
    golden = GOLDEN["chatglm3"]
    model = load_glm(golden.dir, pre_seq_len=4)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        model(torch.tensor([[1001, 1003, 5, 6]]))


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_loss_in_training_mode_with_checkpointing(version):
    golden = GOLDEN[version]
    model = load_glm(golden.dir)
    model.train()
    model.activation_checkpointing_enable()
    case = golden.case("loss_batch")
    ids, mask = batch(case)
    out = model(ids, attention_mask=mask, labels=torch.tensor(case["labels"]))
    assert abs(out.loss.item() - case["expect_loss"]) < TOL
    out.loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_the_pad_token_embedding_learns_like_the_official_one():
    """GLM-4's pad id is its eos <|endoftext|>, a real token at the end of every training answer: the official
    embedding has no padding_idx, so full fine-tuning must update that row too."""
    golden = GOLDEN["glm4"]
    model = load_glm(golden.dir)
    pad = model.config.pad_token_id
    ids = torch.tensor([[1002, 1004, 1007, 857, 1008, 976, pad, 1007, 5]])  # a reply ends, a new turn starts
    model(ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad[pad].abs().sum() > 0


def test_prefix_dropout_is_active_in_training_only():
    golden = GOLDEN["chatglm2"]
    model = load_glm(golden.dir, pre_seq_len=4)
    model.load_prefix(golden.dir / "prefix_noproj.safetensors")
    ids = torch.tensor([[1001, 1003, 791, 73, 88]])
    model.train()
    torch.manual_seed(0)
    a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b)
    model.eval()
    assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("version", VERSIONS)
def test_nothing_is_frozen_by_construction(version):
    golden = GOLDEN[version]
    loaded = load_glm(golden.dir, pre_seq_len=4, prefix_projection=True)
    config = glm_config(json.loads((golden.dir / "config.json").read_text()), version=version, pre_seq_len=4)
    built = GlmForCausalLMWithPrefix(config)
    for model in (loaded, built):
        names = [n for n, _ in model.named_parameters()]
        assert any(n.startswith("prefix_encoder.") for n in names)
        assert all(p.requires_grad for p in model.parameters())
    # width W = num_layers * 2 * kv_channels * multi_query_group_num
    raw = json.loads((golden.dir / "config.json").read_text())
    width = raw["num_layers"] * 2 * raw["kv_channels"] * raw["multi_query_group_num"]
    assert prefix_width(config) == width == loaded.prefix_encoder.embedding.weight.shape[1]


def test_fresh_prefix_encoder_when_the_checkpoint_has_none():
    model = load_glm(GOLDEN["glm4"].dir, pre_seq_len=3)  # GLM-4: ChatGLM3's prefix semantics
    weight = model.prefix_encoder.embedding.weight
    assert weight.shape == (3, prefix_width(model.config)) and weight.dtype == torch.float32
    assert weight.std() > 0.5  # PyTorch's N(0, 1) embedding init, as the official encoder
    model(torch.tensor([[1002, 1004, 1007, 5]])).logits.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


# --- loading the official prefix checkpoints -------------------------------------------------------------


def test_load_prefix_infers_settings_and_refuses_other_ones(tmp_path):
    golden = GOLDEN["chatglm3"]
    model = load_glm(golden.dir)  # no pre_seq_len: taken from the checkpoint
    with pytest.raises(CheckpointError, match="prefix width 192"):  # ChatGLM2's 2 layers, not ChatGLM3's 3
        model.load_prefix(GOLDEN["chatglm2"].dir / "prefix_proj.safetensors")
    assert model.prefix_encoder is None and model.config.pre_seq_len is None  # untouched by the refusal
    model.load_prefix(golden.dir / "prefix_proj.safetensors")
    assert (model.config.pre_seq_len, model.config.prefix_projection) == (4, True)
    case = golden.case("prefix_proj_0")
    ids, mask = batch(case)
    with torch.no_grad():
        assert_logits(model(ids).logits, golden.logits[case["expect_tensor"] + "_all"], mask)
    other = load_glm(golden.dir, pre_seq_len=4, prefix_projection=False)
    with pytest.raises(CheckpointError, match="prefix_projection=True"):
        other.load_prefix(golden.dir / "prefix_proj.safetensors")
    # an official P-tuning directory: config.json + weights
    directory = tmp_path / "ptuning"
    directory.mkdir()
    shutil.copy(golden.dir / "prefix_noproj.safetensors", directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({**json.loads((golden.dir / "config.json").read_text()),
                                                       "pre_seq_len": 4, "prefix_projection": False}))
    other.load_prefix(directory)
    with pytest.raises(CheckpointError, match="not a prefix-encoder weight"):
        other.load_prefix(golden.dir / "model.safetensors")


def test_base_checkpoint_with_prefix_weights_needs_prefix_settings(tmp_path):
    golden = GOLDEN["chatglm2"]
    state = {**load_file(golden.dir / "model.safetensors"), **load_file(golden.dir / "prefix_noproj.safetensors")}
    directory = tmp_path / "merged"
    directory.mkdir()
    save_file(state, directory / "model.safetensors")
    shutil.copy(golden.dir / "config.json", directory / "config.json")
    with pytest.raises(CheckpointError, match="P-tuning weights"):
        load_glm(directory)
    model = load_glm(directory, pre_seq_len=4)
    case = golden.case("prefix_noproj_0")
    with torch.no_grad():
        assert_logits(model(batch(case)[0]).logits, golden.logits[case["expect_tensor"] + "_all"], batch(case)[1])


# --- key map, saving, round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_official_transformers_official_round_trip_is_exact(version):
    golden = GOLDEN[version]
    config = glm_config(json.loads((golden.dir / "config.json").read_text()), version=version)
    official = load_file(golden.dir / "model.safetensors")
    if version != "glm4":
        official.update(load_file(golden.dir / "prefix_proj.safetensors"))
    hf = {}
    for key, tensor in official.items():
        pairs = to_transformers(key, tensor, qkv_rows(config))
        assert pairs is not None, key
        hf.update(pairs)
    assert "model.layers.0.self_attn.k_proj.bias" in hf and "model.layers.0.mlp.gate_up_proj.weight" in hf
    assert ("prefix_encoder.trans.0.weight" in hf) == (version != "glm4")
    back = to_official(hf)
    dropped = set(official) - set(back)
    assert dropped == {"transformer.rotary_pos_emb.inv_freq"}
    assert set(back) <= set(official)
    for key, tensor in back.items():
        assert torch.equal(tensor, official[key]), key


def test_row_split_works_for_any_per_row_tensor():
    """Quantized companions split by rows like the weight: packed INT4 [out, in/2], weight_scale [out]."""
    config = glm_config(json.loads((GOLDEN["glm4"].dir / "config.json").read_text()), version="glm4")
    rows = qkv_rows(config)
    out = sum(rows)
    packed = torch.randint(-128, 127, (out, 64), dtype=torch.int8)
    scale = torch.rand(out, dtype=torch.float16)
    base = "transformer.encoder.layers.1.self_attention.query_key_value."
    hf = dict(to_transformers(base + "weight", packed, rows) + to_transformers(base + "weight_scale", scale, rows))
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (rows[1], 64)
    assert torch.equal(hf["model.layers.1.self_attn.v_proj.weight_scale"], scale[rows[0] + rows[1]:])
    back = to_official(hf)
    assert torch.equal(back[base + "weight"], packed) and torch.equal(back[base + "weight_scale"], scale)
    with pytest.raises(ValueError, match="together"):
        to_official({k: v for k, v in hf.items() if "v_proj" not in k})


@pytest.mark.parametrize("version", VERSIONS)
def test_save_official_round_trips_the_directory(version, tmp_path):
    golden = GOLDEN[version]
    model = golden.model()
    save_official(model, tmp_path, dtype=torch.float16)
    original = load_file(golden.dir / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(original) - {"transformer.rotary_pos_emb.inv_freq"}
    assert all(torch.equal(saved[k], original[k]) for k in saved)  # fp16 -> fp32 -> fp16 is exact
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((golden.dir / "config.json").read_text())
    again = load_glm(tmp_path)
    ids = torch.tensor([golden.cases[0]["input_ids"]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_save_official_prefix_only_is_an_official_ptuning_checkpoint(tmp_path):
    golden = GOLDEN["chatglm3"]
    model = golden.model(4, True, "prefix_proj.safetensors")
    prefix = {k: v for k, v in model.state_dict().items() if k.startswith("prefix_encoder.")}
    save_official(model, tmp_path, state_dict=prefix)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == load_file(golden.dir / "prefix_proj.safetensors").keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["pre_seq_len"], config["prefix_projection"]) == (4, True)
    fresh = load_glm(golden.dir)
    fresh.load_prefix(tmp_path)
    ids = torch.tensor([[1001, 1003, 1006, 483, 1007]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


# --- refusals ------------------------------------------------------------------------------------------------


def _copy_golden(version, tmp_path, edit_state=None, edit_config=None):
    golden = GOLDEN[version]
    state = load_file(golden.dir / "model.safetensors")
    config = json.loads((golden.dir / "config.json").read_text())
    if edit_state:
        edit_state(state)
    if edit_config:
        edit_config(config)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_wrong_shape_is_refused_with_file_and_key(tmp_path):
    key = "transformer.encoder.layers.1.self_attention.query_key_value.weight"

    def shrink(state):
        state[key] = state[key][:-16].clone()

    directory = _copy_golden("chatglm2", tmp_path, edit_state=shrink)
    with pytest.raises(CheckpointError) as err:
        load_glm(directory)
    message = str(err.value)
    assert "model.safetensors" in message and key in message and "shape" in message


def test_missing_and_unexpected_keys_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    missing = _copy_golden("glm4", tmp_path / "a", edit_state=lambda s: s.pop("transformer.output_layer.weight"))
    with pytest.raises(CheckpointError, match="missing weights: lm_head.weight"):
        load_glm(missing)
    (tmp_path / "b").mkdir()
    extra = _copy_golden("glm4", tmp_path / "b",
                         edit_state=lambda s: s.update({"transformer.extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="unexpected key transformer.extra.weight"):
        load_glm(extra)


def test_a_v1_directory_is_told_apart_and_refused():
    v1 = FIXTURES / "model-small-vocab"
    raw = json.loads((v1 / "config.json").read_text())
    assert registry.detect(raw, v1) == "chatglm"
    assert detect_version(raw, v1) is None  # not a version of this family
    assert registry.of_directory(v1) is registry.VERSIONS["chatglm"]
    with pytest.raises(CheckpointError, match="v1"):
        load_glm(v1)


# --- versions, config reading, the -hf form ------------------------------------------------------------------


def test_versions_are_told_apart():
    for version in VERSIONS:
        assert registry.of_directory(GOLDEN[version].dir) is registry.VERSIONS[version]
    raw = json.loads((GOLDEN["chatglm3"].dir / "config.json").read_text())
    assert detect_version({**raw, "_name_or_path": "THUDM/chatglm2-6b"}) == "chatglm2"
    assert detect_version({**raw, "transformers_version": "4.27.1"}) == "chatglm2"
    assert detect_version({**raw, "transformers_version": "4.30.2"}) == "chatglm3"
    assert detect_version({**raw, "eos_token_id": [2, 5]}) == "glm4"
    assert detect_version({**raw, "padded_vocab_size": 151552}) == "glm4"
    assert detect_version({"model_type": "glm", "vocab_size": 8}) == "glm4"
    assert detect_version({"model_type": "chatglm", "hidden_size": 8}) is None
    with pytest.raises(CheckpointError):
        registry.detect({"model_type": "chatglm", "hidden_size": 8})


def test_config_fields():
    glm4 = glm_config(json.loads((GOLDEN["glm4"].dir / "config.json").read_text()), version="glm4")
    assert glm4.rope_parameters["rope_theta"] == 10000 * 500  # rope_ratio read from config.json
    assert glm4.rope_parameters["partial_rotary_factor"] == 0.5
    assert (glm4.num_key_value_heads, glm4.head_dim, glm4.rms_norm_eps) == (2, 32, 1.5625e-07)
    assert (glm4.vocab_size, glm4.intermediate_size, glm4.tie_word_embeddings) == (1024, 192, False)
    assert glm4.eos_token_id == [1000, 1007, 1009] and glm4.attention_bias
    chatglm2 = glm_config(json.loads((GOLDEN["chatglm2"].dir / "config.json").read_text()), version="chatglm2")
    assert chatglm2.rope_parameters["rope_theta"] == 10000  # no rope_ratio: 1
    with pytest.raises(CheckpointError, match="rmsnorm=False"):
        glm_config({**chatglm2.official_config, "rmsnorm": False}, version="chatglm2")


def test_wrong_rope_ratio_changes_the_logits(tmp_path):
    """The golden comparison catches a wrong rope base (the mistake of transformers' own converter)."""
    directory = _copy_golden("glm4", tmp_path, edit_config=lambda c: c.pop("rope_ratio"))
    golden = GOLDEN["glm4"]
    case = golden.case("single_2")
    with torch.no_grad():
        logits = load_glm(directory)(batch(case)[0]).logits
    assert (logits - golden.logits["single_2_all"]).abs().max() > 0.1


def _write_hf(directory: Path, flat_rope: bool):
    """The glm-4-9b-chat-hf form of the golden GLM-4: transformers' keys and config.json."""
    golden = GOLDEN["glm4"]
    config = glm_config(json.loads((golden.dir / "config.json").read_text()), version="glm4")
    state = {}
    for key, tensor in load_file(golden.dir / "model.safetensors").items():
        state.update(to_transformers(key, tensor, qkv_rows(config)))
    directory.mkdir()
    save_file(state, directory / "model.safetensors")
    hf = GlmConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "pad_token_id", "eos_token_id", "max_position_embeddings")},
        rope_parameters=dict(config.rope_parameters), tie_word_embeddings=False).to_dict()
    hf.update(architectures=["GlmForCausalLM"], torch_dtype="float16")
    if flat_rope:  # as the 4.4x-era release writes it
        rope = hf.pop("rope_parameters")
        hf.update(rope_theta=rope["rope_theta"], partial_rotary_factor=0.5)
    (directory / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("flat_rope", (True, False))
def test_hf_form_loads_and_gives_the_same_logits(tmp_path, flat_rope):
    golden = GOLDEN["glm4"]
    directory = tmp_path / "glm-4-hf"
    _write_hf(directory, flat_rope)
    assert registry.of_directory(directory) is registry.VERSIONS["glm4"]
    model = load_glm(directory)
    assert model.config.rope_parameters["rope_theta"] == 5e6
    case = golden.case("batch")
    ids, mask = batch(case)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        assert torch.equal(logits, golden.model()(ids, attention_mask=mask).logits)
    assert_logits(logits, golden.logits["batch_all"], mask)
    save_official(model, tmp_path / "official", dtype=torch.float16)  # and it saves in the official layout
    saved = load_file(tmp_path / "official" / "model.safetensors")
    original = load_file(golden.dir / "model.safetensors")
    assert all(torch.equal(saved[k], original[k]) for k in saved) and len(saved) == len(original) - 1
    written = json.loads((tmp_path / "official" / "config.json").read_text())
    assert (written["model_type"], written["rope_ratio"], written["kv_channels"]) == ("chatglm", 500, 32)


def test_official_config_from_scratch_reads_back_the_same():
    config = glm_config(json.loads((GOLDEN["glm4"].dir / "config.json").read_text()), version="glm4")
    config.official_config = None  # as a model loaded from the -hf form has
    again = glm_config(official_config(config), version="glm4")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "eos_token_id", "pad_token_id",
                  "attention_bias", "max_position_embeddings"):
        assert getattr(again, field) == getattr(config, field), field


# --- formats and transformers' generate ------------------------------------------------------------------------


def test_official_sharded_bin_checkpoint_loads(tmp_path):
    """pytorch_model-0000N-of-0000M.bin + index, read with weights_only (as the real ChatGLM2/3 releases ship)."""
    golden = GOLDEN["chatglm3"]
    state = load_file(golden.dir / "model.safetensors")
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    for name, names in shards.items():
        torch.save({k: state[k] for k in names}, tmp_path / name)
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    shutil.copy(golden.dir / "config.json", tmp_path / "config.json")
    model = load_glm(tmp_path)
    case = golden.case("batch")
    ids, mask = batch(case)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, golden.model()(ids, attention_mask=mask).logits)


def test_save_pretrained_is_the_official_layout(tmp_path):
    model = GOLDEN["glm4"].model()
    model.save_pretrained(tmp_path, dtype=torch.float16)
    saved = load_file(tmp_path / "model.safetensors")
    assert "transformer.encoder.layers.0.self_attention.query_key_value.bias" in saved
    with pytest.raises(TypeError, match="safe_serialization"):
        model.save_pretrained(tmp_path, safe_serialization=True)
    again = GlmForCausalLMWithPrefix.from_pretrained(tmp_path)
    assert isinstance(again, GlmForCausalLMWithPrefix)


@pytest.mark.parametrize("version, name", [("chatglm3", "prefix_proj_batch"), ("glm4", "batch_greedy")])
def test_transformers_generate_gives_the_golden_ids(version, name):
    """transformers' own generate (its DynamicCache, the growing 2D mask) with the prefix and left padding."""
    golden = GOLDEN[version]
    case = golden.case(name)
    model = golden.case_model(case)
    ids, mask = batch(case)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=case["max_new_tokens"], do_sample=False)
    assert_greedy(out[:, ids.shape[1]:], case["expect_new_ids"], case["step_margins"])
