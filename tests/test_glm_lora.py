"""LoRA adapters of the official ChatGLM2/3 / GLM-4 code (fused `query_key_value`) on our GlmForCausalLM.

An adapter is written by hand in the layout peft saves for the official remote-code model (keys
`base_model.model.transformer.encoder.layers.N.self_attention.query_key_value.lora_A.weight` [r, in],
`lora_B.weight` [q+k+v, r]; adapter_config.json naming `query_key_value`), with random nonzero A and B.
Loaded through the toolkit (run directories' `--lora`, `lora.load_lora`) it must give the logits of the
official checkpoint whose fused weights carry the delta applied by hand, `W + lora_alpha / r * B @ A`,
loaded as a plain checkpoint: fp32, max |diff| < 1e-5 (merged, as infer.py runs it). Beside the
weights (unmerged) the adapter adds the same delta in another order of operations, which fp32 rounding
shows at ~1e-5 on these logits: that path is compared in float64 (max |diff| < 1e-10).
Tiny random models: tests/fixtures/*-tiny.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from chatglm_tune.models.glm.modeling import load_glm
from chatglm_tune.models.glm.weights import adapter_targets, adapter_to_transformers
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.loading import load_model, resolve_run
from chatglm_tune.runs.lora import load_lora
from chatglm_tune.runtime.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
VERSIONS = ("chatglm2", "chatglm3", "glm4")
QKV_AND_MLP = ("query_key_value", "dense_h_to_4h")
ALL_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
R, ALPHA = 4, 8  # scaling 2
TOL = 1e-5


def official_adapter(directory: Path, base: Path, targets=QKV_AND_MLP, *, seed=0, weights="safetensors") -> dict:
    """Write a peft adapter of the official model's `targets` for the checkpoint in `base`; its tensors."""
    state = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, weight in state.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_features, in_features = weight.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(R, in_features, generator=gen) / 4
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, R, generator=gen) / 4
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "THUDM/chatglm3-6b",
              "target_modules": list(targets), "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.1,
              "fan_in_fan_out": False, "bias": "none", "inference_mode": True}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    if weights == "safetensors":
        save_file(tensors, directory / "adapter_model.safetensors")
    else:
        torch.save(tensors, directory / "adapter_model.bin")
    return tensors


def merged_by_hand(directory: Path, base: Path, adapter: dict, dtype=torch.float32) -> Path:
    """The official checkpoint in `base` with `W + lora_alpha / r * B @ A` on every adapted fused weight."""
    state = {k: t.to(dtype) for k, t in load_file(base / "model.safetensors").items()}
    for key in adapter:
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            a, b = adapter[key].to(dtype), adapter[key.replace("lora_A", "lora_B")].to(dtype)
            state[module + ".weight"] = state[module + ".weight"] + ALPHA / R * (b @ a)
    directory.mkdir(parents=True)
    save_file(state, directory / "model.safetensors")
    shutil.copy(base / "config.json", directory / "config.json")
    return directory


@torch.no_grad()
def logits(model, seed=1):
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    return model(ids, attention_mask=mask).logits[mask.bool()]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("targets", [QKV_AND_MLP, ALL_LINEARS], ids=["qkv+mlp", "all"])
def test_official_adapter_equals_its_delta_on_the_fused_weights(version, targets, tmp_path):
    base = FIXTURES / f"{version}-tiny"
    adapter = official_adapter(tmp_path / "adapter", base, targets)
    expect = logits(load_glm(merged_by_hand(tmp_path / "merged", base, adapter)))
    assert max_diff(expect, logits(load_glm(base))) > 0.1  # the adapter changes the model
    source = resolve_run(base, lora=tmp_path / "adapter")  # what infer.py / quantize.py --model BASE --lora DIR load
    merged = load_model(source)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert max_diff(logits(merged), expect) < TOL
    beside = load_lora(load_glm(base, dtype=torch.float64), tmp_path / "adapter")  # unmerged: beside the weights
    exact = load_glm(merged_by_hand(tmp_path / "merged64", base, adapter, torch.float64), dtype=torch.float64)
    assert max_diff(logits(beside), logits(exact)) < 1e-10
    config = beside.peft_config["default"]
    assert set(config.target_modules) == set(adapter_targets(targets)) and (config.r, config.lora_alpha) == (R, ALPHA)


def test_a_bin_adapter_loads_the_same(tmp_path):
    base = FIXTURES / "chatglm3-tiny"
    adapter = official_adapter(tmp_path / "adapter", base, weights="bin")
    expect = logits(load_glm(merged_by_hand(tmp_path / "merged", base, adapter)))
    assert not (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert max_diff(logits(load_model(resolve_run(base, lora=tmp_path / "adapter"))), expect) < TOL


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # plain peft reads it
def test_the_converted_adapter_is_frozen_or_trainable_and_saves_as_our_own(tmp_path):
    base = FIXTURES / "glm4-tiny"
    official_adapter(tmp_path / "adapter", base)
    frozen = load_lora(load_glm(base), tmp_path / "adapter")
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    trainable = load_lora(load_glm(base), tmp_path / "adapter", trainable=True)
    names = {n for n, p in trainable.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert any(".q_proj.lora_A" in n for n in names) and any(".gate_up_proj.lora_B" in n for n in names)
    frozen.save_pretrained(tmp_path / "ours")  # q/k/v keys from now on: plain peft loads it
    again = PeftModel.from_pretrained(load_glm(base), tmp_path / "ours").eval()
    assert max_diff(logits(again), logits(frozen)) == 0


def test_infer_runs_an_official_adapter_given_with_lora(tmp_path, capsys):
    """`infer.py --model BASE --lora ADAPTER` (a tiny ChatGLM3 with its tokenizer) prints what the
    hand-merged checkpoint prints."""
    from chatglm_tune.models.registry import VERSIONS

    lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
    torch.manual_seed(0)
    model, _ = VERSIONS["chatglm3"].tiny([json.loads(line)["text"] for line in lines[:40]], tmp_path / "base")
    model.save_pretrained(tmp_path / "base")  # the official layout
    adapter = official_adapter(tmp_path / "adapter", tmp_path / "base", ALL_LINEARS)
    merged = merged_by_hand(tmp_path / "merged", tmp_path / "base", adapter)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tmp_path / "base" / name, merged / name)
    spec = importlib.util.spec_from_file_location("infer_cli", ROOT / "infer.py")
    infer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(infer)
    text = ["--text", json.loads(lines[0])["text"], "--max-new-tokens", "12"]
    infer.main(["--model", str(tmp_path / "base"), "--lora", str(tmp_path / "adapter"), *text])
    got = capsys.readouterr()
    assert f"+ LoRA {tmp_path / 'adapter'}" in got.err
    infer.main(["--model", str(merged), *text])
    assert got.out == capsys.readouterr().out
    infer.main(["--model", str(tmp_path / "base"), *text])
    assert got.out != capsys.readouterr().out  # the adapter made a difference


def test_official_adapter_merges_before_quantizing(tmp_path):
    """quantize.py --lora / infer.py --quantization-bit: merged into the float weights, then INT8, which is
    the hand-merged official checkpoint quantized while loading."""
    base = FIXTURES / "chatglm3-tiny"
    adapter = official_adapter(tmp_path / "adapter", base)
    int8 = load_model(resolve_run(base, lora=tmp_path / "adapter"), quantization_bit=8)
    assert isinstance(int8.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert not any("lora" in name for name, _ in int8.named_parameters())
    expect = logits(load_glm(merged_by_hand(tmp_path / "merged", base, adapter), quantization_bit=8))
    assert max_diff(logits(int8), expect) < TOL


def test_on_a_stored_int8_base_the_adapter_runs_beside_the_integers(tmp_path):
    """An official INT8 directory cannot absorb the adapter: it runs unmerged on q/k/v and gate_up_proj."""
    base = FIXTURES / "chatglm3-tiny"
    official_adapter(tmp_path / "adapter", base)
    load_glm(base, quantization_bit=8).save_pretrained(tmp_path / "int8")
    model = load_model(resolve_run(tmp_path / "int8", lora=tmp_path / "adapter"))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, QuantizedLinear) and "default" in q_proj.lora_A
    expect = logits(load_model(resolve_run(base, lora=tmp_path / "adapter")))
    plain = logits(load_glm(tmp_path / "int8"))
    assert (logits(model) - expect).norm() < 0.1 * (plain - expect).norm()  # INT8 error only, the delta is there


def test_lora_a_is_shared_and_lora_b_split_by_rows():
    a, b = torch.randn(4, 64), torch.randn(128, 4)
    key = "base_model.model.transformer.encoder.layers.2.self_attention.query_key_value.lora_{}.weight"
    shared = adapter_to_transformers(key.format("A"), a, (64, 32, 32))
    assert [k for k, _ in shared] == [f"base_model.model.model.layers.2.self_attn.{p}_proj.lora_A.weight"
                                      for p in "qkv"]
    assert all(torch.equal(t, a) for _, t in shared)
    split = adapter_to_transformers(key.format("B"), b, (64, 32, 32))
    assert torch.equal(torch.cat([t for _, t in split]), b) and [t.shape[0] for _, t in split] == [64, 32, 32]
    mlp = "base_model.model.transformer.encoder.layers.0.mlp.dense_h_to_4h.lora_B.weight"
    assert (adapter_to_transformers(mlp, b, (64, 32, 32))[0][0]
            == "base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight")
    assert adapter_to_transformers("base_model.model.something.else", b, (64, 32, 32)) is None
    assert adapter_targets(["query_key_value", "dense"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with pytest.raises(ValueError, match="mlp_proj"):
        adapter_targets(["query_key_value", "mlp_proj"])


@pytest.mark.parametrize("part, shape, message", [
    ("lora_B", (100, R), "whose rows are not this model's q"),  # the fused rows of another model
    ("lora_A", (R, 32), "this model expects"),  # another hidden size
])
def test_an_adapter_of_another_shape_names_file_and_key(part, shape, message, tmp_path):
    base = FIXTURES / "chatglm3-tiny"
    tensors = official_adapter(tmp_path / "adapter", base)
    key = f"base_model.model.transformer.encoder.layers.1.self_attention.query_key_value.{part}.weight"
    tensors[key] = torch.randn(shape)
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(resolve_run(base, lora=tmp_path / "adapter"))
    assert str(file) in str(err.value) and key in str(err.value)


def test_an_adapter_of_another_version_is_refused(tmp_path):
    official_adapter(tmp_path / "adapter", FIXTURES / "chatglm3-tiny")  # hidden 64, q|k|v 64|32|32
    with pytest.raises(CheckpointError, match="query_key_value.lora_B.weight has shape"):
        load_lora(load_glm(FIXTURES / "glm4-tiny"), tmp_path / "adapter")  # hidden 128, q|k|v 128|64|64


def test_missing_weights_and_unmappable_targets_are_refused(tmp_path):
    base = FIXTURES / "chatglm3-tiny"
    official_adapter(tmp_path / "adapter", base)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "target_modules": [*QKV_AND_MLP, "dense"]}))
    with pytest.raises(CheckpointError, match="missing adapter weights for .*o_proj"):
        load_lora(load_glm(base), tmp_path / "adapter")
    config_file.write_text(json.dumps({**config, "target_modules": ".*query_key_value"}))
    with pytest.raises(CheckpointError, match="is a pattern"):
        load_lora(load_glm(base), tmp_path / "adapter")
