"""Quantized whole models: quantize.py's exported format, save/load identity, accuracy against fp32,
training on an INT4 base, the official int4/int8 `.bin` layout, the `--lora` merge path, CLI errors.

The expected integers are computed here from the official format's formula, not with
`chatglm_tune.quant`: `scale = (W.abs().max(-1) / (2**(bits-1) - 1))` and `q = round(W / scale)`,
all in fp16; INT4 bytes hold the even column in the high nibble.

Accuracy bounds (relative Frobenius error, measured with torch 2.13 on CPU, then set with margin):
- Per Linear, on the activations the golden prompts produce in the fp32 golden model: INT8 <= 0.01
  (measured 0.0072 at most; half a step of absmax/127 over a weight of std ~absmax/4 is about 0.0065),
  INT4 <= 0.15 (measured 0.128; absmax/7 steps), group-32 INT4 below per-row INT4 on average (0.098
  against 0.116).
- Logits, golden small-vocab model as is: INT8 top-1 equal at the last position of every golden
  prompt and error <= 0.1 (measured 0.019-0.045). The golden weights are random with std ~0.4 at
  width 96 (4x the 1/sqrt(fan_in) scale of trained weights): attention saturates and any weight
  perturbation grows 5-7x from the Linears to the logits (INT4 there: 0.56-0.87, top-1 lost). So INT4
  logits are checked on the same model with its block Linears rescaled to std 1/sqrt(fan_in):
  INT8 <= 0.005 (measured 0.0016), INT4 <= 0.06 (measured 0.023-0.028), top-1 equal, group-32 below
  per-row (0.020 against 0.025 on average).
- `--lora` merge then INT8 against the unmerged float adapter model: <= 0.01 (see that test).
"""

import json
import subprocess
import weakref
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import quantize
from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
from chatglm_tune.data.batches import EncodedDataset, SpecialIds, collate_train
from chatglm_tune.data.records import read_records
from chatglm_tune.options import EncodingOptions
from chatglm_tune.quant import int4_cpu, int8dot_cpu
from chatglm_tune.quant.apply import quantize_embedding
from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear
from chatglm_tune.runs import rundir
from chatglm_tune.runs.loading import load_run, resolve_run
from chatglm_tune.runs.lora import LoraOptions, apply_lora, load_lora
from chatglm_tune.tuning.training import TrainOptions, prepare_model
from conftest import GOLDEN_DIRS, Golden

ROOT = Path(__file__).resolve().parents[1]
SMALL_VOCAB = GOLDEN_DIRS["small-vocab"]
BLOCK_LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
FORMATS = [(8, 0), (4, 0), (4, 32)]  # (bits, group_size)
# Special ids inside the 512-token vocabulary of the models built here.
SPECIAL = dict(mask_token_id=500, gmask_token_id=501, bos_token_id=504, eos_token_id=505, pad_token_id=3)



# ---------------------------------------------------------------------------------------------- helpers


def run_quantize(*args) -> None:
    quantize.main([str(a) for a in args])


def official(w16: torch.Tensor, bits: int, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The official rule on an fp16 weight [out, in]: (q int16 [out, in], fp16 scale [out] or [out, G])."""
    out_f, in_f = w16.shape
    groups = w16.view(out_f, -1, group_size or in_f)  # (out, G, group), fp16
    scale = groups.abs().amax(-1) / (2 ** (bits - 1) - 1)  # fp16 arithmetic
    q = torch.round(groups / scale[..., None]).to(torch.int16).view(out_f, in_f)
    return q, (scale if group_size else scale[:, 0])


def nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed (high, low) nibbles of int8 bytes, by integer arithmetic on the unsigned byte."""
    u = packed.view(torch.uint8).to(torch.int16)
    hi, lo = u // 16, u % 16
    return torch.where(hi >= 8, hi - 16, hi), torch.where(lo >= 8, lo - 16, lo)


def pack_official(q: torch.Tensor) -> torch.Tensor:
    """`byte = (q[2j] << 4) | (q[2j+1] & 0xF)` as int8 [out, in/2] (the C kernel's layout)."""
    byte = ((q[:, 0::2] & 0xF) << 4) | (q[:, 1::2] & 0xF)  # int16 in [0, 255]
    return byte.to(torch.uint8).view(torch.int8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def make_model_dir(path: Path, seed: int = 0, embedding_std: float = 1.0, **overrides) -> Path:
    """A random fp16 model directory (the `tiny` preset of config.PRESETS, whose widths every CPU kernel
    takes) with trained-like scales: Linears N(0, 1/fan_in), biases and LayerNorm
    offsets N(0, 0.02), embeddings N(0, embedding_std). `overrides`: config fields (default: a
    512-token vocabulary)."""
    torch.manual_seed(seed)
    model = ChatGLMForConditionalGeneration(ChatGLMConfig.from_name("tiny",
                                                                    **{"vocab_size": 512, **SPECIAL, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("word_embeddings.weight"):
                p.normal_(0, embedding_std)
            elif p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            elif "layernorm.weight" in name:
                p.normal_(1, 0.02)
            else:
                p.normal_(0, 0.02)
    model.half().save_pretrained(path)
    return path


def prompts(config, n: int = 3, length: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.tensor([torch.randint(5, 400, (length - 2,), generator=g).tolist()
                          + [config.gmask_token_id, config.bos_token_id]]) for _ in range(n)]


@torch.no_grad()
def logits(model, ids_list) -> list[torch.Tensor]:
    return [model(ids).logits[0] for ids in ids_list]


def in_memory(source: Path, bits: int, group_size: int = 0):
    """The model quantized while loading, in fp16 as quantize.py does, computing in fp32."""
    return ChatGLMForConditionalGeneration.from_pretrained(
        source, dtype=torch.float16, quantization_bit=bits, quantization_group_size=group_size).float()


@pytest.fixture(scope="module")
def h128(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("h128") / "model")


# ---------------------------------------------------------------------------------------------- (a) format


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("source", ["small-vocab", "h128"])
def test_exported_file_holds_the_official_integers(source, bits, group_size, h128, tmp_path):
    src = SMALL_VOCAB if source == "small-vocab" else h128
    run_quantize("--bits", bits, "--group-size", group_size, src, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert (config["quantization_bit"], config["quantization_group_size"]) == (bits, group_size)
    h, inner = config["hidden_size"], config["inner_hidden_size"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        before = {k: f.get_tensor(k) for k in f.keys()}
    after = tensors(tmp_path / "q")
    width = {"attention.query_key_value": (3 * h, h), "attention.dense": (h, h),
             "mlp.dense_h_to_4h": (inner, h), "mlp.dense_4h_to_h": (h, inner)}
    quantized = set()
    for i in range(config["num_layers"]):
        for name in BLOCK_LINEARS:
            key = f"transformer.layers.{i}.{name}"
            quantized |= {key + ".weight", key + ".weight_scale"}
            out_f, in_f = width[name]
            q, scale = official(before[key + ".weight"].half(), bits, group_size)
            weight, weight_scale = after[key + ".weight"], after[key + ".weight_scale"]
            assert weight.dtype == torch.int8 and weight_scale.dtype == torch.float16
            assert weight.shape == ((out_f, in_f // 2) if bits == 4 else (out_f, in_f)), key
            assert weight_scale.shape == ((out_f, in_f // group_size) if group_size else (out_f,)), key
            assert torch.equal(weight_scale, scale), key
            if bits == 4:
                hi, lo = nibbles(weight)
                assert torch.equal(hi, q[:, 0::2]) and torch.equal(lo, q[:, 1::2]), key  # even column high
            else:
                assert torch.equal(weight.to(torch.int16), q), key
    untouched = set(before) - quantized - {"lm_head.weight"}  # the tied head is stored once
    assert set(after) == untouched | quantized
    for key in untouched:  # embeddings, LayerNorms, biases: the fp16 source values
        assert after[key].dtype == torch.float16 and torch.equal(after[key], before[key].half()), key


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("source", ["small-vocab", "h128"])
def test_the_cpu_kernels_apply_to_both_test_models(source, bits, h128):
    """Widths 96/384 (golden) and 128/512 are multiples of 16 and 32: no layer falls back to dequant."""
    model = ChatGLMForConditionalGeneration.from_pretrained(SMALL_VOCAB if source == "small-vocab" else h128,
                                                            quantization_bit=bits)
    model(torch.tensor([[5, 6, 7, model.config.gmask_token_id, model.config.bos_token_id]]))
    kernels = {m.last_kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    int4 = "int4cpu" if int4_cpu.available() else "int4pack"  # int4cpu: the kernel for AVX2-only CPUs
    assert kernels == {"int8dot" if int8dot_cpu.available() else "int8pack" if bits == 8 else int4}


# ---------------------------------------------------------------------------------------------- (b) save/load


@pytest.mark.parametrize("bits, group_size", FORMATS)
def test_quantize_save_load_gives_identical_logits(bits, group_size, h128, tmp_path):
    memory = ChatGLMForConditionalGeneration.from_pretrained(h128, quantization_bit=bits,
                                                             quantization_group_size=group_size)
    memory.save_pretrained(tmp_path / "saved")
    reloaded = ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "saved")
    run_quantize("--bits", bits, "--group-size", group_size, h128, tmp_path / "cli")
    from_cli = ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "cli")
    ids = prompts(memory.config) + [prompts(memory.config, 1, length=40)[0]]  # decode kernel and prefill path
    for a, b, c, d in zip(logits(memory, ids), logits(reloaded, ids), logits(in_memory(h128, bits, group_size), ids),
                          logits(from_cli, ids)):
        assert torch.equal(a, b) and torch.equal(c, d)


# ---------------------------------------------------------------------------------------------- (c) accuracy


def golden_prompts() -> list[torch.Tensor]:
    return [torch.tensor([c["input_ids"]]) for c in Golden(SMALL_VOCAB).of_kind("single")]


def rescaled(model):
    """The model with each block Linear's weight rescaled to std 1/sqrt(fan_in) (trained-like scale)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and ".layers." in name:
                m.weight.mul_(1 / (m.weight.std() * m.in_features**0.5))
    return model


def quantized_copy(source_dir: Path, bits: int, group_size: int, transform=lambda m: m):
    from chatglm_tune.models.chatglm6b.config import QUANTIZABLE_LINEARS
    from chatglm_tune.quant.apply import quantize_model

    model = transform(ChatGLMForConditionalGeneration.from_pretrained(source_dir)).half()
    return quantize_model(model, bits, group_size, targets=QUANTIZABLE_LINEARS).float()


@torch.no_grad()
def test_each_quantized_linear_stays_close_on_golden_activations():
    ref = ChatGLMForConditionalGeneration.from_pretrained(SMALL_VOCAB)
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.setdefault(n, []).append((i[0], o)))
             for n, m in ref.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    logits(ref, golden_prompts())
    for hook in hooks:
        hook.remove()
    errors = {}
    for bits, group_size in FORMATS:
        layers = dict(quantized_copy(SMALL_VOCAB, bits, group_size).named_modules())
        errors[bits, group_size] = [
            rel(layers[n](torch.cat([x.flatten(0, 1) for x, _ in pairs])),
                torch.cat([y.flatten(0, 1) for _, y in pairs]))
            for n, pairs in seen.items()
        ]
    assert len(errors[8, 0]) == 8
    assert max(errors[8, 0]) < 0.01, errors[8, 0]
    assert max(errors[4, 0]) < 0.15 and max(errors[4, 32]) < 0.15
    assert sum(errors[4, 32]) < sum(errors[4, 0]), errors


def test_int8_logits_keep_the_top1_of_the_golden_model():
    ids = golden_prompts()
    full = logits(ChatGLMForConditionalGeneration.from_pretrained(SMALL_VOCAB), ids)
    int8 = logits(quantized_copy(SMALL_VOCAB, 8, 0), ids)
    for a, b in zip(int8, full):
        assert a[-1].argmax() == b[-1].argmax()
        assert rel(a[-1], b[-1]) < 0.1


def test_int4_logits_on_the_rescaled_golden_model_and_group_wise_beats_per_row():
    ids = golden_prompts()
    full = logits(rescaled(ChatGLMForConditionalGeneration.from_pretrained(SMALL_VOCAB)), ids)
    errors = {}
    for bits, group_size in FORMATS:
        quant = logits(quantized_copy(SMALL_VOCAB, bits, group_size, rescaled), ids)
        errors[bits, group_size] = [rel(a[-1], b[-1]) for a, b in zip(quant, full)]
        assert all(a[-1].argmax() == b[-1].argmax() for a, b in zip(quant, full)), (bits, group_size)
    assert max(errors[8, 0]) < 0.005, errors
    assert max(errors[4, 0]) < 0.06 and max(errors[4, 32]) < 0.06, errors
    assert sum(errors[4, 32]) < sum(errors[4, 0]), errors


# ---------------------------------------------------------------------------------------------- the INT8 embedding


def test_int8_embedding_is_one_official_int8_copy_read_by_lookup_and_head(h128):
    half = ChatGLMForConditionalGeneration.from_pretrained(h128, dtype=torch.float16)
    float_weight = half.transformer.word_embeddings.weight
    gone = weakref.ref(float_weight)
    q, scale = official(float_weight.detach(), 8)
    del float_weight
    quantize_embedding(half)
    assert gone() is None  # the float embedding is freed, not kept beside the INT8 copy
    embedding, head = half.transformer.word_embeddings, half.lm_head
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(head, QuantizedLinear) and head.bits == 8
    assert embedding.weight is head.weight and embedding.weight_scale is head.weight_scale
    assert torch.equal(head.weight.to(torch.int16), q) and torch.equal(head.weight_scale, scale)
    ids = torch.tensor([[3, 7, 500, 504]])
    assert torch.equal(embedding(ids)[0], (q[ids[0]].half() * scale[ids[0], None]))  # the official fp16 dequantization
    model = half.float()
    assert embedding(ids).dtype == torch.float32 and head.weight_scale.dtype == torch.float16
    with pytest.raises(ValueError, match="INT8 .quantize_embedding."):
        model.save_pretrained(h128.parent / "refused")
    assert not (h128.parent / "refused" / "model.safetensors").exists()
    # quantized while loading: the same integers, and no float embedding ever built
    at_load = ChatGLMForConditionalGeneration.from_pretrained(h128, dtype=torch.float16, quantize_embedding=True)
    assert at_load.lm_head.weight is at_load.transformer.word_embeddings.weight
    assert torch.equal(at_load.lm_head.weight, head.weight) and torch.equal(at_load.lm_head.weight_scale, scale)


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_int8_embedding_keeps_logits_and_greedy_tokens_close(bits, h128):
    """Bound: the INT8 head decodes through int8pack, which computes in bf16 (measured <= 0.009)."""
    base = ChatGLMForConditionalGeneration.from_pretrained(h128, quantization_bit=bits or None)
    model = ChatGLMForConditionalGeneration.from_pretrained(h128, quantization_bit=bits or None,
                                                            quantize_embedding=True)
    ids = prompts(model.config)
    for a, b in zip(logits(model, ids), logits(base, ids)):
        assert a[-1].argmax() == b[-1].argmax()
        assert rel(a[-1], b[-1]) < 0.02 and rel(a, b) < 0.02, (rel(a[-1], b[-1]), rel(a, b))


# ---------------------------------------------------------------------------------------------- (d) training


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    """A tokenizer trained on 8 SPO records, a random model for it (hidden 128) saved with it, a batch."""
    from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("train")
    records = read_records(ROOT / "data" / "spo_train.jsonl")[0][:8]
    tokenizer = train_tokenizer([r.text for r in records] + [r.answer for r in records] + [EncodingOptions().prompt],
                                root / "model", vocab_size=640)
    # embeddings N(0, 0.1): logits of std ~1, a loss near ln(vocab) that a few steps can lower
    make_model_dir(root / "model", embedding_std=0.1, **tokenizer.config_overrides())
    encoding = EncodingOptions(max_src_len=48, max_len=80)
    batch = collate_train(EncodedDataset.from_records(records, tokenizer, encoding).examples, SpecialIds.of(tokenizer))
    return root, records, batch


def eval_loss(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


# Learning rates for a handful of steps (the run defaults, 2e-2 and 2e-4, are for thousands): measured
# eval losses 13.17 -> 11.47 (P-tuning, 4 prefix tokens) and 13.16 -> 6.70 (LoRA r=8 on query_key_value).
@pytest.mark.parametrize("tuning, lr", [("ptuning", 0.3), ("lora", 1e-2)])
@pytest.mark.parametrize("base", ["quantized at load", "quantize.py output", "INT8 embedding too"])
def test_training_on_an_int4_base_lowers_the_loss_and_keeps_the_integers(base, tuning, lr, train_setup, tmp_path):
    root, records, batch = train_setup
    model_dir = root / "model"
    if base == "quantize.py output":  # what quantize.py tells the user to train on; it carries the tokenizer
        model_dir = tmp_path / "int4"
        run_quantize("--bits", 4, root / "model", model_dir)
    options = TrainOptions(tuning=tuning, quantization_bit=4, pre_seq_len=4, lr=lr,
                           quantize_embedding=base == "INT8 embedding too")
    model, tokenizer = prepare_model(str(model_dir), records, tmp_path / "run", options)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 4 * model.config.num_layers + options.quantize_embedding  # + the head
    # the official integers and scales as saved (a forward may hold a weight in its kernel's layout instead)
    frozen = [(m, {k: v.clone() for k, v in m.state_dict().items()}) for m in quantized]
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate)
    before = eval_loss(model, batch)
    torch.manual_seed(0)  # dropout
    for _ in range(8):
        model.train()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = eval_loss(model, batch)
    assert after < before - 0.5, (before, after)
    for m, saved in frozen:
        assert all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())
        assert all(not p.requires_grad and p.grad is None for p in m.parameters())
    # quantize.py's advice: infer.py --model OUT --ptuning-checkpoint RUN
    if (base, tuning) == ("quantize.py output", "ptuning"):
        rundir.save_trained(model, tokenizer, tmp_path / "run", "ptuning")
        reloaded, _ = load_run(resolve_run(model_dir, ptuning_checkpoint=tmp_path / "run"))
        assert reloaded.config.quantization_bit == 4
        assert reloaded.transformer.prefix_encoder.embedding.weight.dtype == torch.float32
        assert eval_loss(reloaded, batch) == pytest.approx(after, rel=1e-5)


# ---------------------------------------------------------------------------------------------- (e) official .bin


@pytest.mark.parametrize("bits", [4, 8])
def test_an_official_format_bin_directory_loads_and_matches(bits, h128, tmp_path):
    source = tensors(h128)
    config = json.loads((h128 / "config.json").read_text())
    state = {}
    for key, value in source.items():
        linear = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and linear.endswith(BLOCK_LINEARS):
            q, scale = official(value.half(), bits)
            state[key] = pack_official(q) if bits == 4 else q.to(torch.int8)
            state[linear + ".weight_scale"] = scale
        else:
            state[key] = value.half()
    state["lm_head.weight"] = source["transformer.word_embeddings.weight"].half()
    for i in range(config["num_layers"]):  # the official checkpoints carry this ignored buffer
        state[f"transformer.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(config["hidden_size"] // 4 // 2)
    official_dir = tmp_path / "chatglm-int"
    official_dir.mkdir()
    torch.save(state, official_dir / "pytorch_model.bin")
    keep = {k: v for k, v in config.items() if k not in ("dtype", "quantization_group_size", "transformers_version")}
    official_config = {**keep, "quantization_bit": bits, "torch_dtype": "float16",
                       "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"}}
    (official_dir / "config.json").write_text(json.dumps(official_config))
    loaded = ChatGLMForConditionalGeneration.from_pretrained(official_dir)
    assert loaded.config.quantization_bit == bits
    ids = prompts(loaded.config)
    for a, b in zip(logits(loaded, ids), logits(in_memory(h128, bits), ids)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- (f) --lora


def test_lora_merged_then_quantized_stays_close_to_the_adapter_model(h128, tmp_path):
    base = ChatGLMForConditionalGeneration.from_pretrained(h128)
    ids = prompts(base.config)
    plain = logits(base, ids)
    adapted = apply_lora(base, LoraOptions(r=4, alpha=8, dropout=0.0, target=("query_key_value", "dense_h_to_4h")))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: B is zero only at init
    adapted.save_pretrained(tmp_path / "adapter")
    reference = logits(load_lora(ChatGLMForConditionalGeneration.from_pretrained(h128), tmp_path / "adapter"), ids)
    run_quantize("--bits", 8, "--lora", tmp_path / "adapter", h128, tmp_path / "q")
    merged = ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "q")
    assert merged.config.quantization_bit == 8
    assert not any("lora" in k for k in tensors(tmp_path / "q"))
    for m, r, p in zip(logits(merged, ids), reference, plain):
        # measured: merged INT8 vs adapter 0.0031-0.0038, adapter vs base 0.21-0.25: the adapter's effect survives
        assert rel(m, r) < 0.01 and rel(p, r) > 0.1, (rel(m, r), rel(p, r))
        assert m[-1].argmax() == r[-1].argmax()


# ---------------------------------------------------------------------------------------------- (g) errors


def cli_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_quantize(*args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_cli_errors_are_clear_messages_with_exit_code_2(capsys, h128, tmp_path):
    out = tmp_path / "out"
    assert "no such directory" in cli_error(capsys, "--bits", 4, tmp_path / "missing", out)
    run_quantize("--bits", 4, h128, tmp_path / "int4")
    capsys.readouterr()
    assert "already INT4" in cli_error(capsys, "--bits", 8, tmp_path / "int4", out)
    assert "must divide" in cli_error(capsys, "--bits", 4, "--group-size", 48, h128, out)
    assert "--bits 4 only" in cli_error(capsys, "--bits", 8, "--group-size", 32, h128, out)
    assert ">= 0" in cli_error(capsys, "--bits", 4, "--group-size", -32, h128, out)
    assert "output with other bits" in cli_error(capsys, "--bits", 8, h128, tmp_path / "int4")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "not an empty directory" in cli_error(capsys, "--bits", 4, h128, tmp_path / "other")
    run_quantize("--bits", 4, h128, tmp_path / "int4")  # the same command again: finished, nothing to do
    assert "already holds this quantization" in capsys.readouterr().out
    assert "adapter_config.json" in cli_error(capsys, "--bits", 8, "--lora", tmp_path, h128, out)
    assert "invalid choice" in cli_error(capsys, "--bits", 3, h128, out)
    assert not out.exists()


def test_cli_error_as_a_process_prints_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "quantize.py"), "--bits", "4", str(tmp_path / "missing"),
                           str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"quantize.py: error: {tmp_path / 'missing'}: no such directory"]
