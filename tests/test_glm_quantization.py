"""INT8/INT4 ChatGLM2/3 and GLM-4 (chatglm_tune.models.glm): quantizing while loading, the official
`weight` + `weight_scale` layout of the fused Linears, loading it back, kernels, LoRA / P-tuning beside it.

The reference here is written from the official ChatGLM-6B quantization format (which the official
ChatGLM2 `quantization.py` follows for its four fused Linears `query_key_value`, `dense`,
`dense_h_to_4h`, `dense_4h_to_h`), independently of chatglm_tune.quant: per output row,
`weight_scale = (absmax / (2^(b-1) - 1)).half()`, `q = round(W / weight_scale)` in fp16 (the official code
quantizes the fp16 model), INT4 packed two per byte with the even column in the high nibble.
Fixtures: the golden tiny models of tests/fixtures/{chatglm2,chatglm3,glm4}-tiny (fp16 weights under the
official keys, fp32 logits of the official code).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatglm_tune.models import registry
from chatglm_tune.models.glm.modeling import load_glm, save_official
from chatglm_tune.models.glm.weights import qkv_rows, split_rows
from chatglm_tune.options import LoraOptions
from chatglm_tune.quant import int8dot_cpu
from chatglm_tune.quant.apply import quantize_model
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.lora import apply_lora
from chatglm_tune.runtime.checkpoint import CheckpointError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VERSIONS = ("chatglm2", "chatglm3", "glm4")
FORMATS = ((8, 0), (4, 0), (4, 32))  # (bits, group_size); INT4 group-wise is our extension
OFFICIAL_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
HF_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_up_proj",
              "mlp.down_proj")
INV_FREQ = "transformer.rotary_pos_emb.inv_freq"


def golden_dir(version: str) -> Path:
    return FIXTURES / f"{version}-tiny"


def raw_config(version: str) -> dict:
    return json.loads((golden_dir(version) / "config.json").read_text())


def cases(version: str, kind: str) -> list[dict]:
    return [c for c in json.loads((golden_dir(version) / "cases.json").read_text())["cases"] if c["kind"] == kind]


def linear_keys(state: dict) -> list[str]:
    """The official keys of the four quantized Linears' weights, every layer."""
    return sorted(k for k in state if k.endswith(".weight") and any(f".{m}." in k for m in OFFICIAL_LINEARS))


# --- the official rule, from its format ---------------------------------------------------------------------------


def official_quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight int8 [out, in] or packed [out, in/2], weight_scale fp16 [out]) of an fp16 `w` [out, in]."""
    assert w.dtype == torch.float16
    scale = (w.abs().max(dim=-1).values / (2 ** (bits - 1) - 1)).half()
    q = torch.round(w / scale[:, None]).to(torch.int8)
    if bits == 4:
        q = pack_pairs(q)
    return q, scale


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """byte[i, j] = (q[i, 2j] << 4) | (q[i, 2j+1] & 0xF), as a signed int8 (the C kernel's layout)."""
    hi, lo = q[:, 0::2].to(torch.int32), q[:, 1::2].to(torch.int32)
    byte = ((hi << 4) | (lo & 0xF)) & 0xFF
    return torch.where(byte > 127, byte - 256, byte).to(torch.int8)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """w[2j] = (int8)byte >> 4, w[2j+1] = (int8)(byte << 4) >> 4 (signed nibbles)."""
    b = packed.to(torch.int32)
    hi = b >> 4  # b is the sign-extended byte: an arithmetic shift
    lo = torch.where((b & 0xF) > 7, (b & 0xF) - 16, b & 0xF)
    return torch.stack((hi, lo), dim=-1).flatten(-2).to(torch.int8)


def dequantized(weight: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    q = unpack_pairs(weight) if bits == 4 else weight
    rows = q.shape[0]
    return (q.float().view(rows, scale.view(rows, -1).shape[1], -1) * scale.float().view(rows, -1, 1)).view(rows, -1)


def test_the_reference_packing_is_the_spec():
    q = torch.tensor([[-7, 7, 3, -1, 0, -8]], dtype=torch.int8)
    packed = pack_pairs(q)
    assert packed.view(torch.uint8).tolist() == [[0x97, 0x3F, 0x08]]  # even column in the high nibble
    assert torch.equal(unpack_pairs(packed), q)


def write_official_int(version: str, directory: Path, bits: int, *, config_bits: int | None = None,
                       state_bits: int | None = None) -> Path:
    """An official INT`bits` directory made from the golden fp16 weights with the official rule (what the
    official `model.quantize(bits)` + `save_pretrained` writes): `weight` int8 + fp16 `weight_scale` for the
    four Linears, everything else as is, `quantization_bit` in config.json."""
    state = load_file(golden_dir(version) / "model.safetensors")
    for key in linear_keys(state):
        state[key], state[key.removesuffix("weight")
                          + "weight_scale"] = official_quantize(state[key], state_bits or bits)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, directory / "model.safetensors")
    config = raw_config(version)
    config["quantization_bit"] = config_bits or bits
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@torch.no_grad()
def logits_of(model, case: dict) -> torch.Tensor:
    ids = torch.tensor(case["input_ids"])
    ids = ids[None] if ids.dim() == 1 else ids
    mask = torch.tensor(case["attention_mask"]) if "attention_mask" in case else None
    return model(ids, attention_mask=mask).logits


# --- (1) the official layout, written and read back -----------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("version", VERSIONS)
def test_quantize_save_load_gives_identical_logits(version, bits, group_size, tmp_path):
    model = load_glm(golden_dir(version), quantization_bit=bits, group_size=group_size)
    assert (model.config.quantization_bit, model.config.quantization_group_size) == (bits, group_size)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == len(HF_LINEARS) * model.config.num_hidden_layers
    assert not isinstance(model.lm_head, QuantizedLinear) and model.model.embed_tokens.weight.is_floating_point()
    single, padded = cases(version, "single")[0], cases(version, "batch_left_padded")[0]
    before = [logits_of(model, single), logits_of(model, padded)]  # batch 1 runs the CPU kernels first
    save_official(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["quantization_bit"] == bits
    assert written.get("quantization_group_size", 0) == group_size
    again = load_glm(tmp_path)
    assert (again.config.quantization_bit, again.config.quantization_group_size) == (bits, group_size)
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    after = [logits_of(again, single), logits_of(again, padded)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("version", VERSIONS)
def test_saved_file_is_the_official_layout_with_the_official_integers(version, bits, tmp_path):
    """Quantized in fp16 (as quantize.py does by default), the file holds exactly what the official
    `quantize(bits)` makes of the fused fp16 weights, under the official keys, dtypes and shapes."""
    model = load_glm(golden_dir(version), quantization_bit=bits, dtype=torch.float16)
    save_official(model, tmp_path)
    original = load_file(golden_dir(version) / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    weights = linear_keys(original)
    assert len(weights) == len(OFFICIAL_LINEARS) * raw_config(version).get("num_layers", 2)
    scales = {k.removesuffix("weight") + "weight_scale" for k in weights}
    assert set(saved) == (set(original) - {INV_FREQ}) | scales
    for key in weights:
        out, inp = original[key].shape
        expect_q, expect_scale = official_quantize(original[key], bits)
        scale_key = key.removesuffix("weight") + "weight_scale"
        assert saved[key].dtype == torch.int8 and saved[key].shape == (out, inp if bits == 8 else inp // 2), key
        assert saved[scale_key].dtype == torch.float16 and saved[scale_key].shape == (out,), scale_key
        assert torch.equal(saved[key], expect_q), key
        assert torch.equal(saved[scale_key], expect_scale), scale_key
    for key in set(original) - {INV_FREQ} - set(weights):  # embeddings, norms, head, qkv bias: the fp16 source
        assert saved[key].dtype == torch.float16 and torch.equal(saved[key], original[key]), key
    assert any(k.endswith("query_key_value.bias") for k in saved)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["quantization_bit"] == bits and "quantization_group_size" not in written
    assert written["torch_dtype"] == "float16"
    assert {k: v for k, v in written.items() if k not in ("quantization_bit",)} == raw_config(version)


@pytest.mark.parametrize("bits", (8, 4))
def test_q_k_v_hold_the_row_split_of_the_fused_official_quantization(bits):
    """Per-row scales: quantizing q, k, v apart (as the loader does) equals splitting the fused result."""
    version = "chatglm3"
    model = load_glm(golden_dir(version), quantization_bit=bits, dtype=torch.float16)
    original = load_file(golden_dir(version) / "model.safetensors")
    rows = qkv_rows(model.config)
    for n in range(model.config.num_hidden_layers):
        fused = original[f"transformer.encoder.layers.{n}.self_attention.query_key_value.weight"]
        fused_q, fused_scale = official_quantize(fused, bits)
        attn = model.model.layers[n].self_attn
        for layer, q, scale in zip((attn.q_proj, attn.k_proj, attn.v_proj), split_rows(fused_q, rows),
                                   split_rows(fused_scale, rows)):
            assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)
            assert layer.bias.dtype == torch.float16  # biases stay float


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("version", VERSIONS)
def test_an_official_int_directory_loads_and_matches(version, bits, tmp_path):
    directory = write_official_int(version, tmp_path / "int", bits)
    loaded = load_glm(directory)
    assert loaded.config.quantization_bit == bits and loaded.config.quantization_group_size == 0
    # the same integers as quantizing the fp16 checkpoint at load in fp16; float parts then in float32
    reference = load_glm(golden_dir(version), quantization_bit=bits, dtype=torch.float16).float()
    mine, theirs = loaded.state_dict(), reference.state_dict()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    for case in (cases(version, "single")[1], cases(version, "batch_left_padded")[0]):
        assert torch.equal(logits_of(loaded, case), logits_of(reference, case))
    assert load_glm(directory, dtype="auto").model.embed_tokens.weight.dtype == torch.float16
    assert load_glm(directory, quantization_bit=bits).config.quantization_bit == bits  # asking for the stored bits
    save_official(loaded, tmp_path / "again", dtype=torch.float16)  # and it writes back the file it came from
    saved, source = load_file(tmp_path / "again" / "model.safetensors"), load_file(directory / "model.safetensors")
    assert set(saved) == set(source) - {INV_FREQ} and all(torch.equal(saved[k], source[k]) for k in saved)


# --- (2) quantizing while loading = quantizing after --------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("version", VERSIONS)
def test_quantize_at_load_equals_quantize_after_load(version, bits, group_size, dtype):
    at_load = load_glm(golden_dir(version), quantization_bit=bits, group_size=group_size, dtype=dtype)
    after = load_glm(golden_dir(version), dtype=dtype)
    quantize_model(after, bits, group_size, targets=registry.VERSIONS[version].quantizable_linears)
    assert (after.config.quantization_bit, after.config.quantization_group_size) == (bits, group_size)
    mine, theirs = at_load.state_dict(), after.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    if dtype == torch.float32:
        case = cases(version, "single")[0]
        assert torch.equal(logits_of(at_load, case), logits_of(after, case))


# --- (3) accuracy ------------------------------------------------------------------------------------------------


def _accuracy(version: str, bits: int, group_size: int):
    """Per position over the golden single cases: relative L2 error of the logits against the official fp32
    ones, centred cosine, golden top-1/top-2 margin, and whether the top-1 is kept."""
    model = load_glm(golden_dir(version), quantization_bit=bits, group_size=group_size)
    golden = load_file(golden_dir(version) / "logits.safetensors")
    rel, cos, margin, kept = [], [], [], []
    for case in cases(version, "single"):
        ref = golden[case["expect_tensor"] + "_all"]
        out = logits_of(model, case)[0]
        rel.append((out - ref).norm(dim=-1) / ref.norm(dim=-1))
        cos.append(torch.cosine_similarity(out - out.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True), dim=-1))
        top2 = ref.topk(2).values
        margin.append(top2[:, 0] - top2[:, 1])
        kept.append(out.argmax(-1) == ref.argmax(-1))
    return torch.cat(rel), torch.cat(cos), torch.cat(margin), torch.cat(kept)


@pytest.mark.parametrize("version", VERSIONS)
def test_int8_logits_stay_close_to_the_float_model(version):
    """The golden models are random (weights ~0.25, 2-3 layers): they amplify the 0.6% weight error of INT8
    about ten times, so top-1 flips where the official top-1/top-2 margin is small (below 0.4 seen)."""
    rel, cos, margin, kept = _accuracy(version, 8, 0)
    assert rel.mean() < 0.1 and rel.max() < 0.2
    assert cos.min() > 0.98
    assert kept[margin >= 0.5].all()
    assert kept.float().mean() >= 0.8


@pytest.mark.parametrize("bits, group_size", ((4, 0), (4, 32)))
@pytest.mark.parametrize("version", VERSIONS)
def test_int4_logits_stay_within_a_looser_bound(version, bits, group_size):
    """INT4 (7 levels a side) is an 11% weight error on these random models, which their logits amplify:
    a loose bound that a wrong layout (swapped nibbles, wrong rows: errors near 1.4, cosine near 0) fails."""
    rel, cos, _, _ = _accuracy(version, bits, group_size)
    int8_rel = _accuracy(version, 8, 0)[0]
    assert rel.mean() < 0.85 and rel.max() < 1.2
    assert cos.mean() > 0.5
    assert int8_rel.mean() < rel.mean() / 4


@pytest.mark.parametrize("bits, group_size", FORMATS)
def test_the_quantized_model_is_the_float_model_with_dequantized_weights(bits, group_size):
    """What the integers mean, checked against the official dequantization: the quantized model (dequant path)
    computes what the float model computes with `scale * q` as its weights."""
    version = "glm4"
    model = load_glm(golden_dir(version), quantization_bit=bits, group_size=group_size)
    float_model = load_glm(golden_dir(version))
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            layer.kernel = "dequant"
            float_model.get_submodule(name).weight.data = dequantized(layer.weight, layer.weight_scale, bits)
    case = cases(version, "batch_left_padded")[0]
    mask = torch.tensor(case["attention_mask"]).bool()
    diff = (logits_of(model, case) - logits_of(float_model, case)).abs()[mask].max()
    assert diff < 1e-4


# --- (4) kernels -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("version", VERSIONS)
def test_cpu_kernels_run_at_batch_one(version, bits, group_size):
    """Every golden width is a multiple of 16 and 32 (hidden 64/128, ffn 128/160/192, rows of q/k/v 32/64/128),
    so no layer falls back at batch 1: int8dot where it builds (INT8, per-row INT4), else int8pack for INT8,
    int4pack (or the AVX2-only `int4cpu`, per-row INT4 on such CPUs) for INT4. A prefill longer than `max_kernel_rows`
    (fp32, no gradient) takes int8dot where it builds (INT8, per-row INT4), else the dequant path."""
    model = load_glm(golden_dir(version), quantization_bit=bits, group_size=group_size)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    with torch.no_grad():
        model(torch.tensor([[5]]))
    fast = {"int8pack", "int8dot"} if bits == 8 else {"int4pack", "int4cpu", "int8dot"}
    assert {m.last_kernel for m in layers} <= fast, {m.last_kernel for m in layers}
    long = torch.arange(QuantizedLinear.max_kernel_rows + 1)[None] + 5
    with torch.no_grad():
        model(long)
    prefill = "int8dot" if int8dot_cpu.available() and group_size == 0 else "dequant"
    assert {m.last_kernel for m in layers} == {prefill}


def test_kernel_and_dequant_paths_agree():
    """The batch-1 kernels (bf16 activations) and the dequant path (fp32) give nearly the same logits."""
    version = "chatglm3"
    ids = torch.tensor([cases(version, "single")[0]["input_ids"]])
    for bits in (8, 4):
        model = load_glm(golden_dir(version), quantization_bit=bits)
        with torch.no_grad():
            fast = torch.stack([model(ids[:, : i + 1]).logits[0, -1] for i in range(3)])
            for m in model.modules():
                if isinstance(m, QuantizedLinear):
                    m.kernel = "dequant"
            slow = torch.stack([model(ids[:, : i + 1]).logits[0, -1] for i in range(3)])
        assert ((fast - slow).norm(dim=-1) / slow.norm(dim=-1)).max() < 0.05


# --- (5) refusals ----------------------------------------------------------------------------------------------


def test_wrong_bits_are_refused(tmp_path):
    version = "chatglm2"
    with pytest.raises(ValueError, match="quantization_bit must be 4 or 8"):
        load_glm(golden_dir(version), quantization_bit=3)
    with pytest.raises(ValueError, match="group-wise scales are an INT4 extension"):
        load_glm(golden_dir(version), quantization_bit=8, group_size=32)
    with pytest.raises(CheckpointError, match="cannot hold INT4 weights.*group_size=48"):
        load_glm(golden_dir(version), quantization_bit=4, group_size=48)  # does not divide 64
    int8 = write_official_int(version, tmp_path / "int8", 8)
    with pytest.raises(ValueError, match="holds INT8 weights; cannot load them as INT4"):
        load_glm(int8, quantization_bit=4)
    bad = tmp_path / "int5"
    shutil.copytree(int8, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_bit": 5}))
    with pytest.raises(CheckpointError, match="quantization_bit=5"):
        load_glm(bad)


def test_a_config_that_disagrees_with_the_weights_is_refused(tmp_path):
    version = "chatglm3"
    packed_says_8 = write_official_int(version, tmp_path / "a", 4, config_bits=8)
    with pytest.raises(CheckpointError, match=r"\.weight of shape \[64, 64\], the model expects \[64, 128\] "
                                              r"\(config.json's quantization_bit=8"):
        load_glm(packed_says_8)
    floats_say_4 = tmp_path / "b"
    shutil.copytree(golden_dir(version), floats_say_4)
    (floats_say_4 / "config.json").write_text(json.dumps({**raw_config(version), "quantization_bit": 4}))
    with pytest.raises(CheckpointError, match="float16 weights where an INT4 checkpoint"):
        load_glm(floats_say_4)
    ints_say_nothing = write_official_int(version, tmp_path / "c", 8)
    (ints_say_nothing / "config.json").write_text(json.dumps(raw_config(version)))
    with pytest.raises(CheckpointError, match="int8 weights but config.json says no quantization_bit"):
        load_glm(ints_say_nothing)


# --- (6) quantize_model, LoRA and P-tuning on a quantized GLM ----------------------------------------------------


def test_lora_sits_beside_quantized_q_k_v():
    version = "chatglm3"
    family = registry.VERSIONS[version]
    model = load_glm(golden_dir(version))
    quantize_model(model, 8, targets=family.quantizable_linears)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    case = cases(version, "single")[0]
    base = logits_of(model, case)
    peft_model = apply_lora(model, LoraOptions(r=4, alpha=8, dropout=0.0, target=family.lora_targets))
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(getattr(m, "base_layer", None), QuantizedLinear)]
    assert len(wrapped) == 3 * model.config.num_hidden_layers
    peft_model.eval()
    assert torch.equal(logits_of(peft_model, case), base)  # LoRA B starts at zero
    peft_model.train()
    ids = torch.tensor([case["input_ids"]])
    peft_model(input_ids=ids, labels=ids).loss.backward()
    trained = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    assert len(trained) == 2 * len(wrapped)


def test_ptuning_prefix_on_a_quantized_base():
    version = "chatglm3"
    golden = load_file(golden_dir(version) / "logits.safetensors")
    case = next(c for c in cases(version, "prefix") if c["name"] == "prefix_noproj_0")
    model = load_glm(golden_dir(version), quantization_bit=8, pre_seq_len=4)
    model.load_prefix(golden_dir(version) / "prefix_noproj.safetensors")
    ref = golden[case["expect_tensor"] + "_all"]
    out = logits_of(model, case)[0]
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean() < 0.1
    model.train()
    ids = torch.tensor([case["input_ids"]])
    model(ids, labels=ids).loss.backward()
    assert model.prefix_encoder.embedding.weight.grad is not None  # the prefix learns through the INT8 layers
    assert not any(p.grad is not None for m in model.modules() if isinstance(m, QuantizedLinear)
                   for p in m.parameters())
