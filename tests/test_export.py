"""export.py: GGUF files read back with gguf-py's reader, transformers-native directories loaded by plain
transformers in a process that never imports chatglm_tune, chatglm.cpp's GGML layout, the ollama Modelfile,
and what is refused (P-tuning, INT4 directories, versions a format cannot hold). GLM-4-0414 and GLM-Edge, released
in transformers' own form, go through the same checks (GGUF at f16 and q8_0: llama.cpp's `glm4` and `chatglm`).

llama.cpp and chatglm.cpp themselves run these files in tests/test_export_engines.py (optional builds)."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commands import cli
from serving import ROOT, TEXTS, tiny_model

gguf = pytest.importorskip("gguf", reason='the export extra is not installed: pip install -e ".[export]"')

import export as export_cli  # noqa: E402
from chatglm_tune.data.records import SPORecord  # noqa: E402
from chatglm_tune.export import answering  # noqa: E402
from chatglm_tune.export.gguf_file import TYPES  # noqa: E402
from chatglm_tune.export.ollama import modelfile  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.models.glm.weights import gguf_name, to_official  # noqa: E402
from chatglm_tune.models.registry import VERSIONS  # noqa: E402
from chatglm_tune.runs import loading  # noqa: E402

GLM_VERSIONS = ("chatglm2", "chatglm3", "glm4")
RELEASED_FORMS = ("glm4-0414", "glm-edge")  # in transformers' own form: transformers' keys, tokenizer.json
ARCHES = {"glm4-0414": "glm4"}  # llama.cpp's architecture where it is not `chatglm`
LINES = (ROOT / "data" / "spo_train.jsonl").read_text(encoding="utf-8").splitlines()


def export(*args) -> int:
    try:
        export_cli.main([str(a) for a in args])
    except SystemExit as stop:
        return stop.code
    return 0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export-models")
    return {name: tiny_model(name, root / name) for name in (*GLM_VERSIONS, *RELEASED_FORMS, "chatglm")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """train.py runs on tiny GLM-4, ChatGLM3 and GLM-4-0414: full, LoRA on that full run; P-tuning; and the GLM-4
    one in INT4."""
    import quantize as quantize_cli
    import train as train_cli

    root = tmp_path_factory.mktemp("export-runs")
    data = root / "data.jsonl"
    data.write_text("\n".join(LINES[:8]) + "\n", encoding="utf-8")
    flags = ["--train-file", data, "--max-src-len", 96, "--max-len", 112, "--batch-size", 8, "--threads", 1,
             "--max-steps", 2]
    train = lambda *args: train_cli.main([str(a) for a in args]) == 0  # noqa: E731
    for version, preset in (("glm4", "tiny-glm4"), ("chatglm3", "tiny-chatglm3"), ("glm4-0414", "tiny-glm4-0414")):
        assert train("--model", preset, "--tuning", "full", *flags, "--output-dir", root / f"{version}-full")
        assert train("--model", root / f"{version}-full", "--tuning", "lora", "--lr", "3e-2", *flags,
                     "--output-dir", root / f"{version}-lora")
    assert train("--model", root / "glm4-full", "--tuning", "ptuning", "--pre-seq-len", 4, *flags, "--output-dir",
                 root / "ptuning")
    quantize_cli.main(["--bits", "4", str(root / "glm4-full"), str(root / "int4")])
    return root


def float_model(directory: Path, lora: Path | None = None):
    model, tokenizer = loading.load_run(loading.resolve_run(directory, lora=lora))
    return model, tokenizer


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under its version's released keys: official (q/k/v fused) for ChatGLM2/3 and GLM-4,
    transformers' own for GLM-4-0414 and GLM-Edge."""
    state = model.state_dict()
    return state if model.config.chatglm_version in RELEASED_FORMS else to_official(state)


# ----------------------------------------------------------------------------------------------
# GGUF


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(metadata {key: value}, tensors {name: ReaderTensor}) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in reader.fields.values()}, {t.name: t for t in reader.tensors}


def error_bound(kind: str, source: torch.Tensor) -> torch.Tensor:
    """The most a value may move when stored in ggml type `kind`: half a step of the format (f16: 2^-11 relative,
    bf16: 2^-8; q8_0: the block's absmax / 127 / 2), plus the fp16 rounding of the scale. q4_0 maps the block's
    signed extreme to -8 steps of absmax / 8, so the other sign reaches only +7 steps: up to one whole step."""
    if kind in ("F32",):
        return torch.zeros_like(source)
    if kind in ("F16", "BF16"):
        return source.abs() * (2 ** -11 if kind == "F16" else 2 ** -8) + 1e-7
    blocks = source.reshape(-1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / (127 if kind == "Q8_0" else 8)
    return (step * (0.5 if kind == "Q8_0" else 1.0) + blocks.abs() * 2 ** -10
            + 1e-7).expand_as(blocks).reshape(source.shape)


@pytest.mark.parametrize("version,kind", [(v, k) for v in GLM_VERSIONS for k in TYPES]
                         + [(v, k) for v in RELEASED_FORMS for k in ("f16", "q8_0")])
def test_gguf_reads_back_as_the_model(models, tmp_path, version, kind):
    out = tmp_path / "out"
    assert export(models[version], out, "--type", kind, "--name", "m") == 0
    meta, tensors = read_gguf(out / f"m-{kind}.gguf")
    model, tokenizer = float_model(models[version])
    c = model.config
    arch = ARCHES.get(version, "chatglm")
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"], meta[f"{arch}.feed_forward_length"]) == (
        c.num_hidden_layers, c.hidden_size, c.intermediate_size)
    assert (meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]) == (c.num_attention_heads,
                                                                                               c.num_key_value_heads)
    assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.attention.value_length"] == c.head_dim
    assert meta[f"{arch}.rope.dimension_count"] == c.head_dim // 2  # rotary on half of each head
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(c.rope_parameters["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    assert meta[f"{arch}.context_length"] == c.max_position_embeddings
    # the tokenizer: one entry per embedding row, the special tokens at their ids, the stop ids
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == c.vocab_size == len(meta["tokenizer.ggml.token_type"])
    for text, token_id in tokenizer.special_ids.items():
        assert tokens[token_id] == text
        assert meta["tokenizer.ggml.token_type"][token_id] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    stops = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id")
             if k in meta}
    assert stops == set(tokenizer.stop_token_ids)
    assert meta["tokenizer.ggml.add_bos_token"] is False and "tokenizer.ggml.bos_token_id" not in meta
    assert meta["tokenizer.ggml.model"] == ("llama" if version in ("chatglm2", "chatglm3") else "gpt2")
    if meta["tokenizer.ggml.model"] == "gpt2":  # GLM-4's regex, under the name llama.cpp gives it in the architecture
        assert meta["tokenizer.ggml.pre"] == ("glm4" if arch == "glm4" else "chatglm-bpe")
        assert len(meta["tokenizer.ggml.merges"]) > 0
    else:
        sp = tokenizer.sp_model
        assert tokens[:sp.get_piece_size()] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        assert meta["tokenizer.ggml.scores"][5] == pytest.approx(sp.get_score(5))
    template = meta["tokenizer.chat_template"]
    assert template == answering.chat_template(tokenizer.prompt_format, tokenizer, "")
    assert ("[gMASK]" in template) == (version != "glm-edge")  # GLM-Edge's prompts start with the first role token
    # every tensor: llama.cpp's name, the checkpoint's shape, the type asked for, the values within its error
    state = checkpoint_state(model)
    assert set(tensors) == {gguf_name(k) for k in state}
    layer = {n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")}
    attention = {"attn_q.weight", "attn_k.weight",
                 "attn_v.weight"} if version in RELEASED_FORMS else {"attn_qkv.weight"}
    sandwich = {"post_attention_norm.weight", "post_ffw_norm.weight"}  # GLM-4-0414's norms after attention / the MLP
    assert attention <= layer and layer & sandwich == (sandwich if version == "glm4-0414" else set())
    for key, source in state.items():
        t = tensors[gguf_name(key)]
        expected_type = "F32" if source.dim() == 1 else ("Q8_0" if kind == "q4_0" and gguf_name(key) == "output.weight"
                                                         else TYPES[kind].name)
        assert t.tensor_type.name == expected_type, key
        assert [int(n) for n in reversed(t.shape)] == list(source.shape), key
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").copy())
        values = values.reshape(source.shape)
        assert ((values - source).abs() <= error_bound(expected_type, source)).all(), key
        if expected_type == "F32":
            assert torch.equal(values, source), key
    modelfile_text = (out / "Modelfile").read_text(encoding="utf-8")
    assert modelfile_text.startswith(f"FROM ./m-{kind}.gguf\n")
    assert all(f'PARAMETER stop "{stop}"' in modelfile_text for stop in tokenizer.prompt_format.stop_texts)
    # a model directory samples as the official chat() in llama.cpp (its defaults from the file) and in ollama
    sampling = tokenizer.prompt_format.chat_sampling
    assert (meta["general.sampling.temp"], meta["general.sampling.top_p"], meta["general.sampling.top_k"]) == (
        pytest.approx(sampling.temperature), pytest.approx(sampling.top_p), sampling.top_k)
    assert f"PARAMETER temperature {sampling.temperature:g}\nPARAMETER top_p {sampling.top_p:g}\n" in modelfile_text


@pytest.mark.parametrize("version,kind",
                         [("glm4", "f16"), ("glm4", "q4_0"), ("glm4-0414", "q8_0"), ("glm-edge", "f16")])
def test_a_model_directory_streams_into_the_same_gguf_as_the_loaded_model(models, tmp_path, version, kind):
    """export.py writes a model directory's GGUF from its files, never loading the model (an official checkpoint, or
    one in transformers' own form): the tensors are those a GGUF of the loaded model holds, byte for byte."""
    from chatglm_tune.export.gguf_file import write_gguf
    from chatglm_tune.export.source import open_export
    from chatglm_tune.export.tensors import CheckpointTensors, ModelTensors

    streamed = open_export(models[version], form="gguf")
    assert streamed.model is None and isinstance(streamed.tensors, CheckpointTensors)
    model, tokenizer = float_model(models[version])
    write_gguf(tmp_path / "files.gguf", streamed.config, streamed.tokenizer, streamed.tensors, kind)
    write_gguf(tmp_path / "model.gguf", model.config, tokenizer, ModelTensors(model), kind)
    (meta_a, a), (meta_b, b) = read_gguf(tmp_path / "files.gguf"), read_gguf(tmp_path / "model.gguf")
    assert set(a) == set(b) and all(bytes(a[n].data.tobytes()) == bytes(b[n].data.tobytes()) for n in a)
    assert {k: v for k, v in meta_a.items() if k != "general.name"} == {k: v for k, v in meta_b.items()
                                                                        if k != "general.name"}


def test_gguf_fuses_qkv_and_the_gated_mlp_in_llama_cpp_order(models, tmp_path):
    assert export(models["glm4"], tmp_path / "out", "--type", "f16", "--name", "m") == 0
    _, tensors = read_gguf(tmp_path / "out" / "m-f16.gguf")
    model, _ = float_model(models["glm4"])
    layer = model.model.layers[1]
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    as_stored = lambda name: torch.from_numpy(tensors[name].data.astype("float32").copy())  # noqa: E731
    assert torch.allclose(as_stored("blk.1.attn_qkv.weight").reshape(qkv.shape), qkv, rtol=1e-3, atol=1e-4)
    bias = torch.cat([layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias])
    assert torch.equal(as_stored("blk.1.attn_qkv.bias"), bias)
    gate_up = layer.mlp.gate_up_proj.weight  # llama.cpp's SwiGLU: silu(first half) * second half
    assert torch.allclose(as_stored("blk.1.ffn_up.weight").reshape(gate_up.shape), gate_up, rtol=1e-3, atol=1e-4)


def test_glm4_0414s_extra_norms_take_llama_cpps_glm4_names(models, tmp_path):
    """llama.cpp's `glm4` graph: attn_norm, attention, `post_attention_norm` (transformers' post_self_attn_layernorm)
    before the residual add; ffn_norm (post_attention_layernorm), the MLP, `post_ffw_norm` (post_mlp_layernorm)."""
    names = {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
             "post_attention_layernorm": "ffn_norm", "input_layernorm": "attn_norm"}
    for ours, theirs in names.items():
        assert gguf_name(f"model.layers.7.{ours}.weight") == f"blk.7.{theirs}.weight"
    model, _ = float_model(models["glm4-0414"])
    with torch.no_grad():  # norms of their own values, so that a swapped name shows
        for n, layer in enumerate(model.model.layers):
            for i, norm in enumerate(names):
                getattr(layer, norm).weight.copy_(torch.linspace(0.5, 1.5, model.config.hidden_size) + i + 10 * n)
    model.save_pretrained(tmp_path / "marked")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "marked" / file).write_bytes((models["glm4-0414"] / file).read_bytes())
    assert export(tmp_path / "marked", tmp_path / "out", "--type", "f16", "--name", "m") == 0
    _, tensors = read_gguf(tmp_path / "out" / "m-f16.gguf")
    for n, layer in enumerate(model.model.layers):
        for ours, theirs in names.items():
            assert torch.equal(torch.from_numpy(tensors[f"blk.{n}.{theirs}.weight"].data.copy()),
                               getattr(layer, ours).weight)
    q = model.model.layers[1].self_attn.q_proj.weight  # q, k, v apart, as llama.cpp's converter writes them
    written = torch.from_numpy(tensors["blk.1.attn_q.weight"].data.astype("float32").copy()).reshape(q.shape)
    assert torch.allclose(written, q, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("version", ["glm4", "chatglm3", "glm4-0414"])
def test_a_lora_run_is_merged_into_its_base(runs, tmp_path, version):
    out = tmp_path / "out"
    assert export(runs / f"{version}-lora", out, "--type", "f16", "--name", "m") == 0
    _, tensors = read_gguf(out / "m-f16.gguf")
    merged, _ = float_model(runs / f"{version}-lora")  # the float base + the adapter, merged by peft
    base, _ = float_model(runs / f"{version}-full")
    q = lambda m: m.model.layers[0].self_attn.q_proj.weight  # noqa: E731
    assert not torch.allclose(q(merged), q(base)), "the adapter must change what it targets"
    name = "blk.0.attn_q.weight" if version in RELEASED_FORMS else "blk.0.attn_qkv.weight"  # q rows come first
    qkv = torch.from_numpy(tensors[name].data.astype("float32").copy())
    assert torch.allclose(qkv[: q(merged).shape[0]], q(merged), rtol=1e-3, atol=1e-4)
    assert set(tensors) == {gguf_name(k) for k in checkpoint_state(merged)}  # GLM-4-0414's extra norms included


def test_the_modelfile_carries_the_runs_instruction_and_the_stops(runs, tmp_path):
    assert export(runs / "glm4-lora", tmp_path / "out", "--name", "spo") == 0
    text = (tmp_path / "out" / "Modelfile").read_text(encoding="utf-8")
    run_args = json.loads((runs / "glm4-lora" / "run_args.json").read_text(encoding="utf-8"))
    assert text.splitlines()[1] == "FROM ./spo-f16.gguf"
    assert run_args["encoding"]["prompt"] in text
    for stop in ("<|endoftext|>", "<|user|>", "<|observation|>"):
        assert f'PARAMETER stop "{stop}"' in text
    assert "PARAMETER temperature 0\n" in text  # greedy, as infer.py extracts
    plain = modelfile(VERSIONS["chatglm3"].format, "x.gguf")
    assert plain.startswith("FROM ./x.gguf\n") and "[gMASK]sop" in plain and "INSTRUCTION" not in plain
    assert "{{ if and $last" not in plain  # no empty condition left where no instruction goes
    with pytest.raises(ValueError, match="ollama TEMPLATE"):
        modelfile(VERSIONS["glm4"].format, "x.gguf", 'say """ this')


@pytest.mark.parametrize("version", ["glm4", "chatglm3", "glm4-0414"])
def test_every_file_of_a_run_export_asks_with_its_instruction_and_answers_greedily(runs, tmp_path, version):
    """One run, one prompt, one answer in every engine: the GGUF (llama.cpp's chat template and sampling defaults),
    the hf directory (transformers / vLLM) and the Modelfile (ollama) all put the run's instruction before the last
    user message and sample greedily, as infer.py does."""
    run = runs / f"{version}-lora"
    assert export(run, tmp_path / "gguf", "--type", "f16", "--name", "m") == 0
    assert export(run, tmp_path / "hf", "--format", "hf") == 0
    meta, _ = read_gguf(tmp_path / "gguf" / "m-f16.gguf")
    hf_template = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert meta["tokenizer.chat_template"] == hf_template
    assert (meta["general.sampling.temp"], meta["general.sampling.top_k"]) == (0.0, 1)
    assert "PARAMETER temperature 0\n" in (tmp_path / "gguf" / "Modelfile").read_text(encoding="utf-8")
    instruction = loading.resolve_run(run).encoding.prompt
    assert instruction and "\n" in instruction  # the default prompt: a newline inside, escaped in the template
    rendered = render(hf_template, [{"role": "user", "content": "first"}, {"role": "assistant", "content": "A"},
                                    {"role": "user", "content": "second"}])
    assert (rendered.count(instruction) == 1 and instruction + "second" in rendered
            and instruction + "first" not in rendered)
    assert instruction not in render(hf_template,
                                     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def render(template: str, messages: list[dict], **extra) -> str:
    """`template` rendered as transformers renders a chat template (a sandboxed Jinja2 environment)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "天气",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}


def tool_call(arguments: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather",
                                             "arguments": json.dumps(arguments, ensure_ascii=False)}}


ARGUMENTS = {"city": "北京", "days": 3, "exact": True, "unit": None, "note": 'it\'s "a" \\ b\n\tc\r'}
TOOL_BODIES = [  # OpenAI request bodies: tools and a question; round trips (a call, its result)
    {"messages": [{"role": "user", "content": "北京天气"}], "tools": [WEATHER]},
    {"messages": [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "北京天气"}],
     "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "北京天气"}, {"role": "assistant", "content": None,
                                                        "tool_calls": [tool_call(ARGUMENTS)]},
                  {"role": "tool", "content": "晴"}], "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "天气"}, {"role": "assistant", "content": "我查一下",
                                                      "tool_calls": [tool_call({"city": "北京"}),
                                                                     tool_call({"city": "上海"})]},
                  {"role": "tool", "content": "晴"}, {"role": "tool", "content": "雨"}], "tools": [WEATHER]},
]


def serve_prompt(directory: Path, body: dict) -> list[int]:
    """serve.py's prompt ids for the OpenAI request `body` on the model in `directory`."""
    from chatglm_tune.serve.protocol import parse_call
    from chatglm_tune.serve.service import Service

    model, tokenizer = loading.load_run(loading.resolve_run(directory))
    service = Service(model, tokenizer, served="tiny")
    try:
        return service.chat_turn(parse_call(body, kind="chat", served="tiny", defaults=service.chat_sampling)).prompt
    finally:
        service.close()


def parsed(messages: list[dict]) -> list[dict]:
    """`messages` with each tool call's arguments parsed into an object (what llama-server and vLLM pass)."""
    messages = json.loads(json.dumps(messages))
    for call in (call for message in messages for call in message.get("tool_calls") or ()):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


@pytest.fixture(scope="module")
def hf_tokenizers(models, tmp_path_factory) -> dict:
    """{version: plain transformers' tokenizer of its --format hf directory} for ChatGLM3, GLM-4 and GLM-4-0414."""
    from transformers import AutoTokenizer

    found = {}
    for version in ("chatglm3", "glm4", "glm4-0414"):
        out = tmp_path_factory.mktemp("hf-tools") / version
        assert export(models[version], out, "--format", "hf") == 0
        found[version] = AutoTokenizer.from_pretrained(out)
    return found


@pytest.mark.parametrize("version", ["chatglm3", "glm4", "glm4-0414"])
def test_the_hf_template_writes_openai_tool_conversations_as_serve_does(models, hf_tokenizers, version):
    """Tools (top-level), an assistant's tool_calls (arguments an object) and tool results, through transformers'
    apply_chat_template, give serve.py's prompt ids for the same request body."""
    tokenizer = hf_tokenizers[version]
    for body in TOOL_BODIES:
        got = tokenizer.apply_chat_template(parsed(body["messages"]), tools=body.get("tools"),
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(got) == serve_prompt(models[version], body), body


@pytest.mark.parametrize("version", ["chatglm3", "glm4", "glm4-0414"])
def test_glm_form_tool_messages_render_as_the_official_chat(models, hf_tokenizers, version):
    """Messages already in the GLM form (a system message's tools, an assistant's metadata, the observation role)
    give the version's official chat() prompt, as before."""
    _, tokenizer = loading.load_run(loading.resolve_run(models[version]))
    prompt_format = tokenizer.prompt_format
    messages = [{"role": "system", "content": "", "tools": [WEATHER]}, {"role": "user", "content": "北京天气"},
                prompt_format.tool_call_message("get_weather", {"city": "北京"}),
                {"role": "observation", "content": "晴"}]
    got = hf_tokenizers[version].apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    assert list(got) == prompt_format.chat_ids(tokenizer, messages)


@pytest.mark.parametrize("version,arguments,refused", [
    ("glm4", {"t": 2.0}, "float"), ("glm4", {"t": [{"x": 0.5}]}, "float"), ("chatglm3", {"t": 2.5}, "Python literals"),
    ("chatglm3", {"t": [1]}, "Python literals"), ("chatglm3", {"t": "a\u3000b"}, "escaped"),
    ("chatglm3", {"t": "a\x01"}, "control character"), ("chatglm3", {"class": 1}, "keyword arguments"),
    ("chatglm3", {"a-b": 1}, "keyword arguments"), ("chatglm3", {"城市": 1}, "keyword arguments"),
    ("chatglm3", {"1a": 1}, "keyword arguments")])
def test_what_the_template_cannot_write_exactly_raises(hf_tokenizers, version, arguments, refused):
    """Floats (engines write them unlike json.dumps / repr); for ChatGLM3's Python literals, nested values, strings
    with characters repr escapes, and names that are not ASCII identifiers; arguments as a JSON string."""
    from jinja2 import TemplateError

    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [tool_call(arguments)]},
                {"role": "tool", "content": "r"}]
    tokenizer = hf_tokenizers[version]
    with pytest.raises(TemplateError, match=refused):
        tokenizer.apply_chat_template(parsed(messages), add_generation_prompt=True, tokenize=False)
    with pytest.raises(TemplateError, match="JSON string"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_an_instruction_is_data_in_the_template_whatever_it_holds():
    from chatglm_tune.export.answering import with_instruction

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tricky = 'say "{{ x }}" %} \\ back\nslash\t{% if %}'
    got = render(with_instruction(template, tricky), [{"role": "user", "content": "text"}])
    assert got == "<user>" + tricky + "text"
    assert with_instruction(template, "") == template
    parts = [{"type": "text", "text": "t"}]  # content parts are left as they are, not glued to a string
    assert render(with_instruction("{{ messages[-1]['content'] | length }}", "I: "),
                  [{"role": "user", "content": parts}]) == "1"


@pytest.mark.parametrize("version", RELEASED_FORMS)
def test_the_modelfile_of_a_released_form_version_is_its_chat_template(version):
    """GLM-4-0414's template begins `[gMASK]<sop>` and ends its generation prompt with a newline; GLM-Edge's begins
    with the first role token. The run's instruction goes before the last user message."""
    prompt_format = VERSIONS[version].format
    text = modelfile(prompt_format, "x.gguf", "Extract: ")
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert template.startswith("[gMASK]<sop>{{") == (version == "glm4-0414")
    assert "[gMASK]" not in template or version == "glm4-0414"
    assert template.endswith("<|assistant|>\n" if version == "glm4-0414" else "<|assistant|>")
    assert 'eq $m.Role "user") }}Extract: {{ end }}{{ $m.Content }}' in template
    assert [line for line in text.splitlines() if line.startswith("PARAMETER stop")] == [
        f'PARAMETER stop "{stop}"' for stop in prompt_format.stop_texts]
    assert "INSTRUCTION" not in modelfile(prompt_format, "x.gguf")


# ----------------------------------------------------------------------------------------------
# transformers-native directories

LOAD_ELSEWHERE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
results = {}
for source, (directory, ids, texts, messages) in json.loads(sys.stdin.read()).items():
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        logits = [model(torch.tensor([i])).logits[0].tolist() for i in ids]
    results[source] = {"class": type(model).__name__, "logits": logits,
                       "encoded": [tokenizer.encode(t, add_special_tokens=False) for t in texts],
                       "with_start": tokenizer.encode(texts[0]),
                       "chat": list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=False))}
print(json.dumps({"results": results, "imported": sorted(m for m in sys.modules if m.startswith("chatglm"))}))
"""
HF_SOURCES = ["glm4", "chatglm3", "chatglm2", "glm4-lora", "chatglm3-lora", *RELEASED_FORMS]
HF_TEXTS = TEXTS[:40]


def hf_inputs(tokenizer) -> tuple[list[list[int]], list[dict]]:
    """(ids whose logits are compared, the chat messages rendered) for an hf directory of `tokenizer`'s version."""
    ids = [tokenizer.get_prefix_tokens() + tokenizer.encode_text(t)[:30] for t in HF_TEXTS[:3]]
    return ids, [{"role": "user", "content": HF_TEXTS[5]}]


@pytest.fixture(scope="module")
def loaded_elsewhere(models, runs, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """{source: (its --format hf directory, what plain transformers made of it)}: every directory loaded in one
    process that never imports chatglm_tune (one transformers import for all)."""
    jobs, outs = {}, {}
    for source in HF_SOURCES:
        directory = runs / source if source.endswith("lora") else models[source]
        outs[source] = tmp_path_factory.mktemp("hf") / "hf"
        assert export(directory, outs[source], "--format", "hf") == 0
        ids, messages = hf_inputs(float_model(directory)[1])
        jobs[source] = [str(outs[source]), ids, HF_TEXTS, messages]
    done = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=tmp_path_factory.mktemp("elsewhere"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["imported"] == []
    return {source: (outs[source], got["results"][source]) for source in HF_SOURCES}


@pytest.mark.parametrize("source", HF_SOURCES)
def test_an_hf_directory_loads_in_plain_transformers(runs, models, loaded_elsewhere, source):
    directory = runs / source if source.endswith("lora") else models[source]
    out, got = loaded_elsewhere[source]
    model, tokenizer = float_model(directory)
    texts = HF_TEXTS
    ids, messages = hf_inputs(tokenizer)
    with torch.no_grad():
        expected = [model(torch.tensor([i])).logits[0] for i in ids]
    version = model.config.chatglm_version
    architecture = "Glm4ForCausalLM" if version == "glm4-0414" else "GlmForCausalLM"
    assert got["class"] == architecture
    assert max((torch.tensor(g) - e).abs().max().item() for g, e in zip(got["logits"], expected)) < 1e-4
    assert got["encoded"] == [tokenizer.encode_text(t) for t in texts]
    assert got["with_start"] == tokenizer.get_prefix_tokens() + tokenizer.encode_text(texts[0])
    if source.endswith("lora"):  # a run's template asks as infer.py does: its instruction before the text
        encoding = loading.resolve_run(directory).encoding
        assert got["chat"] == tokenizer.prompt_format.prompt_ids(tokenizer, SPORecord(texts[5], None), encoding)[0]
    else:
        assert got["chat"] == tokenizer.prompt_format.chat_ids(tokenizer, messages)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("glm4" if version == "glm4-0414"
                                    else "glm") and config["architectures"] == [architecture]
    assert "chatglm_version" not in config  # transformers' fields only
    if version in RELEASED_FORMS:  # the directory reads back as its version
        assert registry.of_directory(out).name == version
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tokenizer.stop_token_ids)
    if source.endswith("lora"):  # greedy, as infer.py extracts (vLLM reads the temperature)
        assert (generation["do_sample"], generation["temperature"]) == (False, 0.0)
    else:
        sampling = tokenizer.prompt_format.chat_sampling
        assert (generation["top_p"], generation["temperature"]) == (sampling.top_p, sampling.temperature)


def test_the_sentencepiece_bpe_of_real_chatglm3_converts_exactly():
    """The real ChatGLM2/3 tokenizer.model is a SentencePiece BPE, as the tiny ones are."""
    real = ROOT.parent / "shared" / "assets" / "chatglm3" / "tokenizer.model"
    if not real.is_file():
        pytest.skip("the real ChatGLM3 tokenizer.model is not in this checkout")
    from chatglm_tune.data.tokenizing import sentencepiece_model_type
    from chatglm_tune.export.hf_dir import _sentencepiece_backend
    from chatglm_tune.models.glm.sp_tokenizer import ChatGLM3Tokenizer

    tokenizer = ChatGLM3Tokenizer(str(real))
    assert sentencepiece_model_type(tokenizer.sp_model) == "bpe"
    backend = _sentencepiece_backend(tokenizer)
    texts = TEXTS + ["Hello world, a test.  Two spaces\n\nand\ttabs", "数字123456和English混合", "😀 emoji ü ß"]
    assert [backend.encode(t).ids for t in texts] == [tokenizer.encode_text(t) for t in texts]


def test_chatglm6b_hf_export_is_the_official_layout(models, tmp_path):
    out = tmp_path / "hf"
    assert export(models["chatglm"], out, "--format", "hf") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "chatglm" and (out / "ice_text.model").is_file()
    model, _ = float_model(models["chatglm"])
    again, _ = float_model(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("version", ["chatglm", "glm4", "glm4-0414"])
def test_the_hint_after_an_hf_export_loads_the_directory(models, tmp_path, capsys, version):
    """The `python -c` commands export.py prints after `--format hf` load what it wrote; ChatGLM-6B, which
    transformers has no class of, is pointed at this toolkit (and the official remote code), not at
    AutoModelForCausalLM or vLLM."""
    out = tmp_path / "hf"
    capsys.readouterr()
    assert export(models[version], out, "--format", "hf") == 0
    hint = capsys.readouterr().out.split("run it:", 1)[1]
    commands = re.findall(r'python -c "([^"]+)"', hint)
    assert commands, hint
    for code in commands:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env=os.environ | {"HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, (code, done.stderr[-2000:])
    native = version != "chatglm"
    assert (("vllm serve" in hint) == native
            and ("from transformers import AutoModelForCausalLM;" in hint) == native), hint
    if not native:
        assert f"infer.py --model {out}" in hint and f"serve.py --model {out}" in hint and "trust_remote_code" in hint


# ----------------------------------------------------------------------------------------------
# chatglm.cpp's GGML file


def read_ggml(path: Path) -> tuple[tuple, dict]:
    """(header ints, {name: (shape, ggml type, data offset)}) of a chatglm.cpp GGML file."""
    data = path.read_bytes()
    assert data[:4] == b"ggml"
    model_type, version, qtype = struct.unpack_from("iii", data, 4)
    record = struct.unpack_from("iiiiiififiii", data, 16)
    at = 16 + 48
    (proto_len,) = struct.unpack_from("i", data, at)
    at += 4 + proto_len
    tensors = {}
    while at < len(data):
        (name_len,) = struct.unpack_from("i", data, at)
        name = data[at + 4: at + 4 + name_len].decode()
        at += 4 + name_len
        (ndim,) = struct.unpack_from("i", data, at)
        *shape, ttype = struct.unpack_from("i" * (ndim + 1), data, at + 4)
        at = (at + 4 * (ndim + 2) + 15) // 16 * 16
        size = int(torch.tensor(shape).prod())
        nbytes = {0: 4 * size, 1: 2 * size, 8: size // 32 * 34, 2: size // 32 * 18}[ttype]
        tensors[name] = (tuple(shape), ttype, at)
        at += nbytes
    return (model_type, version, qtype, *record), tensors


@pytest.mark.parametrize("version", ["chatglm", "chatglm3"])
def test_ggml_file_has_chatglm_cpps_layout(models, tmp_path, version):
    out = tmp_path / "out"
    assert export(models[version], out, "--format", "ggml", "--type", "q8_0", "--name", "m") == 0
    header, tensors = read_ggml(out / "m-q8_0.ggml")
    model, _ = float_model(models[version])
    assert header[:3] == ({"chatglm": 1, "chatglm3": 3}[version], 2, 8)
    assert header[3] == model.config.vocab_size and header[4] == model.config.hidden_size
    state = model.state_dict() if version == "chatglm" else to_official(model.state_dict())
    expected = {k for k in state if k != "lm_head.weight" and "rotary" not in k}
    assert set(tensors) == expected
    for name, (shape, ttype, _) in tensors.items():
        assert shape == tuple(state[name].shape) and ttype == (8 if state[name].dim() == 2 else 0), name


# ----------------------------------------------------------------------------------------------
# progress and threads


@pytest.mark.parametrize("form,version", [("gguf", "glm4"), ("hf", "glm4"), ("hf", "chatglm"), ("ggml", "chatglm3")])
def test_every_format_shows_a_progress_bar_that_reaches_its_total(models, tmp_path, capsys, form, version):
    capsys.readouterr()
    assert export(models[version], tmp_path / "out", "--format", form) == 0
    bars = [line for line in re.split(r"[\r\n]", capsys.readouterr().err) if "100%|" in line]
    assert bars, "no progress bar reached its total"
    if form == "gguf":  # a tensor at a time, out of the file's
        n = len(gguf.GGUFReader(next((tmp_path / "out").glob("*.gguf"))).tensors)
        assert f" {n}/{n} " in bars[-1], bars[-1]


def test_threads_is_a_flag_and_is_applied(models, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        capsys.readouterr()
        assert export(models["glm4"], tmp_path / "out", "--format", "hf", "--threads", 1) == 0
        assert torch.get_num_threads() == 1
        assert "1 thread (--threads)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert export(models["glm4"], tmp_path / "again", "--threads", 0) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the destination: checked before any weight is read, written whole or not at all


def test_an_unwritable_destination_is_a_one_line_error_before_loading(models, tmp_path):
    """A destination under a file cannot be made: one line naming it, exit 2, before the model is read (these
    weights are not even weights: reading them first would be another error)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in models["glm4"].iterdir():
        (broken / file.name).write_bytes(b"not weights" if file.suffix == ".safetensors" else file.read_bytes())
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "hf"
    for form in ("hf", "gguf"):
        done = cli("export.py", broken, out, "--format", form, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and str(out) in done.stderr, done.stderr
        assert done.stderr.startswith("export.py: error: ") and "not a directory" in done.stderr, done.stderr


# export.py with its atomic writes stopping inside the first file: the test waits for WRITING to appear, then
# sends SIGTERM (the export of a tiny model is otherwise over before a signal could reach it).
PAUSED_EXPORT = """
import pathlib, runpy, sys, time
from chatglm_tune.runtime import checkpoint

def paused(path, write, atomic_write=checkpoint.atomic_write, writing=pathlib.Path(sys.argv[1])):
    def write_then_wait(tmp):
        write(tmp)
        writing.touch()
        time.sleep(120)
    atomic_write(path, write_then_wait)

checkpoint.atomic_write = paused
sys.argv = ["export.py", *sys.argv[2:]]
runpy.run_path("export.py", run_name="__main__")
"""


def test_an_interrupted_hf_export_leaves_nothing_and_runs_again(models, tmp_path):
    destination = tmp_path / "exports"
    destination.mkdir()
    out, writing = destination / "hf", tmp_path / "WRITING"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"HF_HUB_OFFLINE": "1",
                                                                             "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", PAUSED_EXPORT, str(writing), str(models["glm4"]), str(out),
                                "--format", "hf"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 120
    while not writing.exists():  # the first file is being written
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "export.py never started writing"
        time.sleep(0.05)
    assert any(destination.rglob("*")), "a file is being written: something is there"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode != 0 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("export.py: interrupted"), err  # after the progress bar
    assert list(destination.rglob("*")) == [], list(destination.rglob("*"))  # no file, hidden or not, no directory
    assert export(models["glm4"], out, "--format", "hf") == 0  # a rerun writes it whole
    assert (out / "model.safetensors").is_file()
    assert [f.name for f in out.iterdir() if f.name.startswith(".")] == [".made_by.json"]  # what and how it was made
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert export(models["glm4"], out, "--format", "hf") == 0  # again (a requeued job): finished, nothing to do
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before
    assert export(models["glm4"], out, "--format", "gguf") == 2  # another export: refused, naming what differs


# ----------------------------------------------------------------------------------------------
# what is refused


def test_what_cannot_be_exported_says_why(models, runs, tmp_path, capsys):
    cases = [
        ((runs / "ptuning", tmp_path / "a"), "no engine .* takes a KV prefix"),
        ((runs / "int4", tmp_path / "b"), "stored in INT4 .*made from .*export its float source"),
        ((models["chatglm"], tmp_path / "c"), "no llama.cpp architecture.*--format ggml"),
        ((models["glm4"], tmp_path / "d", "--format", "ggml"), "use --format gguf"),
        ((models["glm4-0414"], tmp_path / "f", "--format", "ggml"), "GLM-4-0414 file .*use --format gguf"),
        ((models["glm-edge"], tmp_path / "g", "--format", "ggml"), "GLM-Edge file .*use --format gguf"),
        ((models["glm4"], tmp_path / "e", "--format", "hf", "--type", "q4_0"), "--type applies to gguf and ggml"),
        ((models["glm4"], models["chatglm3"]), "not an empty directory"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert export(*args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("export.py: error: ") and "Traceback" not in err
        assert __import__("re").search(message, err), err
    assert not any((tmp_path / n).exists() and any((tmp_path / n).iterdir()) for n in "abcdefg")
