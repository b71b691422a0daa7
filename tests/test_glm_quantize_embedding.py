"""`quantize_embedding` on ChatGLM2/3 and GLM-4 (chatglm_tune.models.glm, chatglm_tune.quant): the untied input
embedding becomes a `QuantizedEmbedding` of its own INT8 rows and `lm_head` an INT8 `QuantizedLinear`, both with
the official per-row rule of the ChatGLM quantization format, quantized while loading (no float copy of either),
beside any block format, under a P-tuning prefix or LoRA, refused by saving, and reachable from the commands.

Fixtures: the golden tiny models of tests/fixtures/{chatglm3,glm4}-tiny (structure and integers). Their random
weights (embedding std 1, layers ~0.25) amplify any weight error several times, so accuracy is measured on
models of the same configs initialised as transformers initialises them (std 0.02, the real models' scale).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from chatglm_tune.models.glm.config import glm_config
from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix, load_glm, save_official
from chatglm_tune.models.registry import VERSIONS
from chatglm_tune.options import TrainOptions
from chatglm_tune.quant.apply import quantize_embedding
from chatglm_tune.quant.format import dequantize
from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear
from chatglm_tune.runs import loading
from chatglm_tune.runtime import checkpoint
from chatglm_tune.tuning.training import set_trainable
from test_glm_quantization import golden_dir, official_quantize, raw_config
from test_tiny_glm4 import in_process
from test_versions import DEV

GLM_VERSIONS = ("chatglm3", "glm4")
BITS = (None, 8, 4)  # the block Linears beside the INT8 embedding / head
EMBEDDING, HEAD = "transformer.embedding.word_embeddings.weight", "transformer.output_layer.weight"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def batch() -> torch.Tensor:
    """[2, 24] ordinary ids of the golden vocabulary (1024 rows; specials from 1000)."""
    return torch.randint(5, 1000, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Through the dequantized math (the official one): what differs between two models is their weights, not
    which kernel each prefill took (the kernels' own error is tested with them)."""
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.kernel = "dequant"
    with torch.no_grad():
        return model(ids).logits


def assert_int8_embedding_and_head(model) -> None:
    embedding, head = model.model.embed_tokens, model.lm_head
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert type(embedding) is QuantizedEmbedding and type(head) is QuantizedLinear and head.bits == 8
    assert embedding.weight.dtype == head.weight.dtype == torch.int8
    assert embedding.weight.shape == head.weight.shape == (vocab, hidden)
    assert embedding.weight_scale.dtype == head.weight_scale.dtype == torch.float16
    assert embedding.weight_scale.shape == head.weight_scale.shape == (vocab,)
    assert embedding.weight.data_ptr() != head.weight.data_ptr()  # untied: one copy each
    assert head.bias is None
    assert not any(p.requires_grad for p in (embedding.weight, embedding.weight_scale, head.weight, head.weight_scale))


# --- loading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("version", GLM_VERSIONS)
def test_loading_quantizes_embedding_and_head_as_it_reads_them(version, bits, monkeypatch):
    """Right after `load_glm`: both INT8, never copied out of the file as floats, the same integers as
    `quantize_embedding` of the float-loaded model."""
    copied = []
    copy_out = checkpoint.copy_out
    monkeypatch.setattr(checkpoint, "copy_out", lambda name, *a, **k: copied.append(name) or copy_out(name, *a, **k))
    model = load_glm(golden_dir(version), quantization_bit=bits, quantize_embedding=True)
    monkeypatch.undo()
    assert_int8_embedding_and_head(model)
    assert copied and not {"model.embed_tokens.weight", "lm_head.weight"} & set(copied)
    assert model.config.quantization_bit == (bits or 0)
    after = quantize_embedding(load_glm(golden_dir(version), quantization_bit=bits))
    mine, theirs = model.state_dict(), after.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    ids = batch()
    assert torch.equal(logits_of(model, ids), logits_of(after, ids))


@pytest.mark.parametrize("version", GLM_VERSIONS)
def test_the_integers_are_the_official_rule_and_a_lookup_dequantizes_them(version):
    """Loaded in fp16 (as the official code quantizes): the official per-row INT8 of the file's fp16 tensors; a
    lookup is `q * scale` of the rows asked for, in the compute dtype, which follows `model.to(dtype)`."""
    model = load_glm(golden_dir(version), dtype=torch.float16, quantize_embedding=True)
    original = load_file(golden_dir(version) / "model.safetensors")
    for layer, key in ((model.model.embed_tokens, EMBEDDING), (model.lm_head, HEAD)):
        q, scale = official_quantize(original[key], 8)
        assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale), key
    embedding = model.model.embed_tokens
    ids = torch.tensor([[3, 7, 500, 1007]])
    assert torch.equal(embedding(ids)[0], embedding.weight[ids[0]].half() * embedding.weight_scale[ids[0], None])
    model.to(torch.bfloat16)
    assert embedding(ids).dtype == torch.bfloat16 and embedding.weight_scale.dtype == torch.float16
    assert model.lm_head.weight_scale.dtype == torch.float16


def test_a_stored_int_checkpoint_gets_its_embedding_and_head_quantized_too(tmp_path):
    version = "glm4"
    save_official(load_glm(golden_dir(version), quantization_bit=4), tmp_path)
    model = load_glm(tmp_path, quantize_embedding=True)
    assert model.config.quantization_bit == 4
    assert_int8_embedding_and_head(model)
    reference = quantize_embedding(load_glm(golden_dir(version), quantization_bit=4))
    ids = batch()
    assert torch.equal(logits_of(model, ids), logits_of(reference, ids))


def test_quantizing_twice_or_a_tied_pair_on_load_is_refused():
    model = load_glm(golden_dir("chatglm3"), quantize_embedding=True)
    with pytest.raises(TypeError,
                       match="needs a float nn.Embedding and a bias-free nn.Linear head, not QuantizedEmbedding"):
        quantize_embedding(model)
    tied = load_glm(golden_dir("chatglm3"))
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ValueError, match="empty_init is for an untied embedding and head"):
        quantize_embedding(tied, empty_init=True)


# --- accuracy ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def realistic(tmp_path_factory):
    """{version: fp16 model directory}: the golden configs with transformers' init (std 0.02), seeded."""
    root = tmp_path_factory.mktemp("glm-std002")
    for version in GLM_VERSIONS:
        torch.manual_seed(0)
        save_official(GlmForCausalLMWithPrefix(glm_config(raw_config(version), version=version)), root / version,
                      dtype=torch.float16)
    return root


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("version", GLM_VERSIONS)
def test_int8_embedding_and_head_keep_the_logits_close(version, bits, realistic):
    """Against the model of the same block format with a float embedding / head. Per-row INT8 of 128-wide rows
    is a 0.6% weight error; each of the two INT8 tensors alone moves the logits under 1% (measured 0.53-0.76%),
    the two together add about in quadrature (measured 0.79-0.99%), and the greedy tokens stay."""
    directory = realistic / version
    base = load_glm(directory, quantization_bit=bits)
    int8 = load_glm(directory, quantization_bit=bits, quantize_embedding=True)
    assert_int8_embedding_and_head(int8)
    ids = batch()
    ref, both = logits_of(base, ids), logits_of(int8, ids)
    for part in ("embed_tokens", "lm_head"):
        alone = load_glm(directory, quantization_bit=bits)
        if part == "embed_tokens":
            alone.model.embed_tokens = int8.model.embed_tokens
        else:
            alone.lm_head = int8.lm_head
        assert 1e-3 < rel(logits_of(alone, ids), ref) < 0.01, part
    assert 1e-3 < rel(both, ref) < 0.0125
    assert (both.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_the_int8_head_decodes_through_the_int8pack_kernel(realistic):
    model = load_glm(realistic / "glm4", quantize_embedding=True)
    with torch.no_grad():
        fast = model(batch()[:1, :4]).logits
        assert model.lm_head.last_kernel in ("int8pack", "int8dot")  # int8dot where it builds
        model.lm_head.kernel = "dequant"
        slow = model(batch()[:1, :4]).logits
    assert rel(fast, slow) < 0.01  # bf16 (int8pack) or int16 (int8dot) activations in the kernel


def test_the_head_reads_the_dequantized_rows():
    """What the integers mean: the INT8 model (dequant path) computes what the float model computes with
    `q * scale` as its embedding and head."""
    version = "glm4"
    model = load_glm(golden_dir(version), quantize_embedding=True)
    model.lm_head.kernel = "dequant"
    float_model = load_glm(golden_dir(version))
    with torch.no_grad():
        for name in ("model.embed_tokens", "lm_head"):
            layer = model.get_submodule(name)
            float_model.get_submodule(name).weight.copy_(dequantize(layer.weight, layer.weight_scale, 8, torch.float32))
    ids = batch()
    assert (logits_of(model, ids) - logits_of(float_model, ids)).abs().max() < 1e-4


# --- tuning on top, saving -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", (None, 4))
@pytest.mark.parametrize("version", GLM_VERSIONS)
def test_ptuning_prefix_learns_on_a_frozen_int8_embedding_and_head(version, bits):
    model = load_glm(golden_dir(version), quantization_bit=bits, quantize_embedding=True, pre_seq_len=4)
    model.activation_checkpointing_enable()
    model.enable_input_require_grads()  # what train.py --gradient-checkpointing does
    model = set_trainable(model, TrainOptions(tuning="ptuning", quantization_bit=bits or 0, quantize_embedding=True))
    heads = (model.model.embed_tokens, model.lm_head)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in heads]  # the official forms, as saved
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in model.prefix_encoder.parameters()}
    optimizer = torch.optim.AdamW(trainable, lr=0.1)
    ids = batch()[:1, :12]
    model.train()
    model(ids, labels=ids).loss.backward()
    assert model.prefix_encoder.embedding.weight.grad.abs().sum() > 0
    optimizer.step()
    for m, saved in zip(heads, before):
        assert all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())
        assert all(p.grad is None and not p.requires_grad for p in m.parameters())


def test_lora_sits_on_a_base_with_an_int8_embedding_and_head():
    model = load_glm(golden_dir("glm4"), quantization_bit=8, quantize_embedding=True)
    peft_model = set_trainable(model, TrainOptions(tuning="lora", quantization_bit=8, quantize_embedding=True))
    assert isinstance(peft_model.get_input_embeddings(), QuantizedEmbedding)
    ids = batch()[:1, :12]
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    trained = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


@pytest.mark.parametrize("version", GLM_VERSIONS)
def test_saving_the_int8_embedding_is_refused_but_a_prefix_saves(version, tmp_path):
    model = load_glm(golden_dir(version), quantize_embedding=True, pre_seq_len=4)
    with pytest.raises(ValueError,
                       match=r"holds its embedding in INT8 \(quantize_embedding: model.embed_tokens.weight_scale, "
                                         r"lm_head.weight_scale\), a runtime form"):
        model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model.save_pretrained(tmp_path / "prefix", state_dict=VERSIONS[version].prefix_state(model))
    assert set(load_file(tmp_path / "prefix" / "model.safetensors")) == {"transformer.prefix_encoder.embedding.weight"}


# --- the commands --------------------------------------------------------------------------------------------------


def test_train_and_infer_with_quantize_embedding_on_a_glm4_run(tmp_path, capsys):
    """train.py --quantize-embedding (P-tuning v2 and LoRA, on an INT4 base) on a tiny GLM-4, then infer.py on each
    run (which follows the run's INT8 embedding), and on the LoRA run asked for INT8 (merged, then quantized)."""
    lines = DEV.read_text(encoding="utf-8").splitlines()[:8]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    model, _ = VERSIONS["glm4"].tiny([json.loads(line)["text"] for line in lines], tmp_path / "base")
    model.save_pretrained(tmp_path / "base")
    data = ["--train-file", tmp_path / "data.jsonl", "--max-src-len", 64, "--max-len", 96, "--batch-size", 4,
            "--max-steps", 2, "--threads", 1, "--quantization-bit", 4, "--quantize-embedding"]
    in_process("train.py", "--model", tmp_path / "base", "--tuning", "ptuning", "--pre-seq-len", 4, *data,
               "--output-dir", tmp_path / "ptuning")
    in_process("train.py", "--model", tmp_path / "base", "--tuning", "lora", *data, "--output-dir", tmp_path / "lora")
    text = ["--text", json.loads(lines[0])["text"], "--max-new-tokens", 4]
    for run in ("ptuning", "lora"):
        assert json.loads((tmp_path / run / "run_args.json").read_text())["quantize_embedding"] is True
        source = loading.resolve_run(tmp_path / run)
        assert source.quantize_embedding and "INT8 embedding" in source.identity()
        assert_int8_embedding_and_head(loading.load_model(source).get_base_model() if run == "lora"
                                       else loading.load_model(source))
        capsys.readouterr()
        in_process("infer.py", "--model", tmp_path / run, *text)
        assert capsys.readouterr().out.endswith("\n")  # its answer's line, empty where the model stops at once
    # merged, then INT8 after loading
    merged = loading.load_model(loading.resolve_run(tmp_path / "lora"), quantization_bit=8)
    assert_int8_embedding_and_head(merged)
    assert merged.config.quantization_bit == 8
    in_process("infer.py", "--model", tmp_path / "lora", "--quantization-bit", 8, *text)
