"""export.py on GLM-4.5 (`glm4-moe`), GLM-4.7-Flash (`glm4-moe-lite`) and GLM-5 (`glm5`): the GGUF file in
llama.cpp's `glm4moe` / `deepseek2` / `glm-dsa` architectures (names, shapes, values and hyperparameters, from the
checkpoint's files and from a loaded model), the hf directory in the released layout that plain transformers loads with
the toolkit's logits and greedy ids, the chat templates that render the toolkit's prompts by default, a LoRA run merged
into both and a P-tuning run refused; and llama.cpp's own llama-server on the f16 files (tokenization and greedy ids
against the toolkit), which skips without a llama-server. GLM-5.3-Flash (`glm53-flash`): its hf directory
(transformers' composite `Glm5NextForConditionalGeneration`) decodes as the toolkit does; GGUF and GGML, which no engine
has for it, are refused with the reason before anything is written."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason='the export extra is not installed: pip install -e ".[export]"')
from bench.serve.serve_servers import LLAMA_SERVER_BUILD, find_llama_server, llama_server  # noqa: E402
from serving import ROOT, TEXTS, tiny_model  # noqa: E402

from test_export import export  # noqa: E402  (export.py's exit status)

from chatglm_tune.export import gguf_moe  # noqa: E402
from chatglm_tune.export.gguf_file import write_gguf  # noqa: E402
from chatglm_tune.export.hf_dir import write_hf  # noqa: E402
from chatglm_tune.export.source import open_export  # noqa: E402
from chatglm_tune.export.tensors import CheckpointTensors, ModelTensors  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.runs import loading  # noqa: E402

VERSIONS = {"glm4-moe": ("glm4moe", gguf.MODEL_ARCH.GLM4_MOE),
            "glm4-moe-lite": ("deepseek2", gguf.MODEL_ARCH.DEEPSEEK2),
            "glm5": ("glm-dsa", gguf.MODEL_ARCH.GLM_DSA)}
TRANSFORMERS_CLASSES = {"glm4-moe": "Glm4MoeForCausalLM", "glm4-moe-lite": "Glm4MoeLiteForCausalLM",
                        "glm5": "GlmMoeDsaForCausalLM"}
# the tiny presets' fields changed here: llama.cpp's glm-dsa rotates the indexer's keys and queries by a Hadamard
# matrix of 64 x 64 or larger, so its key length (the preset's 16) must be a multiple of 64
TINY_OVERRIDES = {"glm5": {"index_head_dim": 64}}
# the agent conversations (`test_agent_data.conversations`) in each version's template form
CONVERSATION_FORMS = {"glm4-moe": "glm45", "glm4-moe-lite": "glm47", "glm5": "glm47"}
LINES = (ROOT / "data" / "spo_train.jsonl").read_text(encoding="utf-8").splitlines()
CHATS = [[{"role": "user", "content": "你好 world"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[0]},
          {"role": "assistant", "content": "好的"}, {"role": "user", "content": TEXTS[1]}]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """version -> a random tiny model directory (seed 0, `TINY_OVERRIDES`; the routers' score corrections random too,
    so that the `exp_probs_b` they become is checked)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name in VERSIONS:
        torch.manual_seed(0)
        model, _ = registry.VERSIONS[name].tiny(TEXTS, root / name, **TINY_OVERRIDES.get(name, {}))
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0, 0.05)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """version -> {"lora": a LoRA run on its tiny model, "ptuning": a P-tuning run on it} (train.py, 2 steps)."""
    import train as train_cli

    root = tmp_path_factory.mktemp("moe-runs")
    data = root / "data.jsonl"
    data.write_text("".join(line + "\n" for line in LINES[:4]), encoding="utf-8")
    flags = ["--train-file", data, "--max-src-len", 64, "--max-len", 80, "--batch-size", 4, "--threads", 1,
             "--max-steps", 2]
    out = {}
    for version in VERSIONS:
        out[version] = {}
        for tuning, extra in (("lora", ["--lr", "3e-2"]), ("ptuning", ["--pre-seq-len", "4"])):
            out[version][tuning] = root / f"{version}-{tuning}"
            args = ["--model", tiny[version], "--tuning", tuning, *extra, *flags, "--output-dir", out[version][tuning]]
            assert train_cli.main([str(a) for a in args]) == 0
    return out


def toolkit_model(directory: Path):
    return loading.load_model(loading.resolve_run(directory), dtype="float32").eval()


def expected_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors of a loaded model, built here from its state dict with gguf-py's own name map."""
    config, state = model.config, model.state_dict()
    table = gguf.get_tensor_name_map(VERSIONS[model.config.chatglm_version][1], config.num_hidden_layers)

    def name(key: str) -> str:
        return table.get_name(key, try_suffixes=(".weight", ".bias"))

    out = {}
    for key, tensor in state.items():
        tensor = tensor.float()
        if key.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            base = key.removesuffix("gate_up_proj")
            out[name(base + "gate_proj.weight")] = gate
            out[name(base + "up_proj.weight")] = up
        elif key.endswith("mlp.experts.down_proj"):
            out[name(key + ".weight")] = tensor
        elif key.endswith("kv_b_proj.weight"):
            heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            per_head = tensor.view(heads, nope + v, -1)
            out[name(key.replace("kv_b", "k_b"))] = per_head[:, :nope].transpose(1, 2)
            out[name(key.replace("kv_b", "v_b"))] = per_head[:, nope:]
        elif key.endswith("e_score_correction_bias"):
            out[key.split(".mlp")[0].replace("model.layers", "blk") + ".exp_probs_b.bias"] = tensor
        else:
            out[name(key)] = tensor
    return out


def hyperparameters(config, arch: str) -> dict:
    """The hyperparameters llama.cpp's converter writes for the config (keys without the architecture prefix)."""
    common = {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size, "block_count": config.num_hidden_layers,
        "attention.head_count": config.num_attention_heads, "rope.freq_base": config.rope_parameters["rope_theta"],
        "attention.layer_norm_rms_epsilon": config.rms_norm_eps, "expert_count": config.n_routed_experts,
        "expert_used_count": config.num_experts_per_tok, "expert_group_count": config.n_group,
        "expert_group_used_count": config.topk_group, "expert_feed_forward_length": config.moe_intermediate_size,
        "expert_shared_count": config.n_shared_experts, "leading_dense_block_count": 1,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "expert_weights_scale": config.routed_scaling_factor, "expert_weights_norm": config.norm_topk_prob,
        "nextn_predict_layers": 0}
    if arch == "glm4moe":
        return {**common, "attention.head_count_kv": config.num_key_value_heads,
                "attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
                "rope.dimension_count": config.head_dim // 2}
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    latent = {**common, "vocab_size": config.vocab_size, "attention.head_count_kv": 1,
              "attention.q_lora_rank": config.q_lora_rank, "attention.kv_lora_rank": rank,
              "attention.key_length": rank + rope, "attention.value_length": rank,
              "attention.key_length_mla": config.qk_nope_head_dim + rope,
              "attention.value_length_mla": config.v_head_dim, "rope.dimension_count": rope}
    if arch == "deepseek2":
        return latent
    return {**latent, "attention.indexer.head_count": config.index_n_heads,
            "attention.indexer.key_length": config.index_head_dim, "attention.indexer.top_k": config.index_topk,
            "attention.indexer.types": [kind == "full" for kind in config.indexer_types]}


def check_tensors(reader, model, arch: str) -> dict[str, torch.Tensor]:
    """The f16 file's tensors are the model's (`expected_tensors`, returned), each under a name of gguf-py's list for
    the architecture, F32 ones exact and the others as f16; norms, biases, routers and GLM-5's indexer weights F32."""
    arch_enum = VERSIONS[model.config.chatglm_version][1]
    allowed = {gguf.TENSOR_NAMES[t].format(bid=n) for t in gguf.MODEL_TENSORS[arch_enum] for n in range(2)}
    expected = expected_tensors(model, arch)
    tensors_read = {t.name: t for t in reader.tensors}
    assert set(tensors_read) == set(expected)
    for name, tensor in tensors_read.items():
        assert name.rsplit(".", 1)[0] in allowed, name
        data = np.asarray(tensor.data)
        assert data.shape == tuple(expected[name].shape), name  # torch order: stacked experts [E, ...]
        want_values = expected[name].numpy() if data.dtype == np.float32 else expected[name].half().numpy()
        assert np.array_equal(data, want_values), name
        if name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight", "indexer.proj.weight")):
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
    return expected


@pytest.mark.parametrize("read", ["files", "model"])
@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_gguf_file_is_llama_cpps_architecture_with_its_tensors_and_hyperparameters(tiny, tmp_path, version, read):
    arch, arch_enum = VERSIONS[version]
    model = toolkit_model(tiny[version])
    if read == "files":
        source = open_export(tiny[version], form="gguf")
        assert source.model is None and isinstance(source.tensors, CheckpointTensors)  # streamed, not loaded
        config, tensors, tokenizer = source.config, source.tensors, source.tokenizer
    else:
        config, tensors, tokenizer = (model.config, ModelTensors(model),
                                      loading.load_tokenizer(loading.resolve_run(tiny[version])))
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tokenizer, tensors, "f16")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == arch
    got = {f.name.removeprefix(arch + "."): f.contents() for f in reader.fields.values()
           if f.name.startswith(arch + ".")}
    want = hyperparameters(config, arch)
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    expected = check_tensors(reader, model, arch)
    if arch == "glm4moe":
        assert "blk.1.ffn_gate_exps.weight" in expected and expected["blk.1.ffn_gate_exps.weight"].shape == (8, 64, 128)
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_q.bias", "blk.0.post_attention_norm.weight"} <= set(expected)
    else:
        assert expected["blk.1.attn_k_b.weight"].shape == (8, 32, 16)
        assert expected["blk.1.attn_v_b.weight"].shape == (8, 16, 32)
    if arch == "glm-dsa":  # the indexer of the full layer 0 (8 heads of 64 dims); the shared layer 1 has none
        types = reader.fields["glm-dsa.attention.indexer.types"]
        assert [gguf.GGUFValueType(t) for t in types.types] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
        assert {name: tuple(t.shape) for name, t in expected.items() if ".indexer." in name} == {
            "blk.0.indexer.attn_q_b.weight": (8 * 64, 48), "blk.0.indexer.attn_k.weight": (64, 128),
            "blk.0.indexer.proj.weight": (8, 128), "blk.0.indexer.k_norm.weight": (64,),
            "blk.0.indexer.k_norm.bias": (64,)}


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_q8_0_file_quantizes_the_matrices_alike_from_files_and_model_and_keeps_routers_f32(tiny, tmp_path, version):
    source = open_export(tiny[version], form="gguf")
    write_gguf(tmp_path / "files.gguf", source.config, source.tokenizer, source.tensors, "q8_0")
    model = toolkit_model(tiny[version])
    write_gguf(tmp_path / "model.gguf", model.config, source.tokenizer, ModelTensors(model), "q8_0")
    files, loaded = ({t.name: t for t in gguf.GGUFReader(tmp_path / f"{name}.gguf").tensors}
                     for name in ("files", "model"))
    assert files["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert files["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    if "blk.0.indexer.proj.weight" in files:  # GLM-5's indexer weights stay F32, its key projection is quantized
        assert files["blk.0.indexer.proj.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert files["blk.0.indexer.attn_k.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert set(files) == set(loaded)
    for name, tensor in files.items():  # experts stacked one by one into the output = cut out of the fused weight
        assert np.array_equal(np.asarray(tensor.data), np.asarray(loaded[name].data)), name


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_hf_directory_is_the_released_layout_plain_transformers_loads_with_our_logits(tiny, tmp_path, version):
    import transformers
    from safetensors import safe_open

    source = open_export(tiny[version], form="hf", dtype="float32")
    out = tmp_path / "hf"
    write_hf(out, source.model, source.tokenizer, chat_template=source.chat_template, sampling=source.sampling)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")} <= keys
    assert not {k for k in keys if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert json.loads((out / "config.json").read_text())["architectures"] == [TRANSFORMERS_CLASSES[version]]
    plain = getattr(transformers, TRANSFORMERS_CLASSES[version]).from_pretrained(out, dtype=torch.float32).eval()
    assert type(plain).__module__.startswith("transformers.")
    ids = torch.tensor([source.tokenizer.encode_text(TEXTS[2])[:24]])
    toolkit = toolkit_model(tiny[version])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, toolkit(ids).logits, atol=1e-5, rtol=0)
        generated = plain.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    stops = set(source.tokenizer.stop_token_ids)  # generation_config.json's eos ids: generate ends on the first
    want = toolkit_greedy(toolkit, ids[0].tolist(), NEW_TOKENS, stops)
    assert generated[:len(want)] == want and (len(want) == NEW_TOKENS or generated[len(want)] in stops)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    fmt, tokenizer = source.version.format, source.tokenizer
    for messages in CHATS:  # thinking off unless asked, as the toolkit prompts
        for asked in ({}, {"enable_thinking": True}):
            text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **asked)
            want = tokenizer.encode_chat(messages, add_generation_prompt=True, **{**fmt.template_kwargs, **asked})
            assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == want, asked


@pytest.mark.parametrize("version", list(VERSIONS))
def test_a_lora_run_is_merged_into_the_hf_directory_and_the_gguf_file(runs, tiny, tmp_path, version):
    import transformers

    run = runs[version]["lora"]
    assert export(run, tmp_path / "hf", "--format", "hf") == 0
    assert export(run, tmp_path / "gguf", "--type", "f16") == 0
    merged, base = toolkit_model(run), toolkit_model(tiny[version])  # the run: its float base + its adapter
    plain = getattr(transformers, TRANSFORMERS_CLASSES[version]).from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.tensor([loading.load_tokenizer(loading.resolve_run(run)).encode_text(TEXTS[2])[:24]])
    with torch.no_grad():
        want = merged(ids).logits
        assert (want - base(ids).logits).abs().max() > 1e-3  # the adapter changes the model
        torch.testing.assert_close(plain.eval()(ids).logits, want, atol=1e-5, rtol=0)
    (path,) = (tmp_path / "gguf").glob("*.gguf")
    check_tensors(gguf.GGUFReader(path), merged, VERSIONS[version][0])


@pytest.mark.parametrize("version", list(VERSIONS))
def test_a_ptuning_run_is_refused_in_every_format(runs, tmp_path, capsys, version):
    for form in ("gguf", "hf"):
        capsys.readouterr()
        assert export(runs[version]["ptuning"], tmp_path / form, "--format", form) == 2
        err = capsys.readouterr().err
        assert err.startswith("export.py: error: ") and "Traceback" not in err, err
        assert re.search(r"is a P-tuning run: .*no engine .* takes a KV prefix", err), err
        assert not (tmp_path / form).exists() or not any((tmp_path / form).iterdir())


def test_an_indexer_type_llama_cpp_does_not_know_is_refused(tiny, tmp_path):
    source = open_export(tiny["glm5"], form="gguf")
    source.config.indexer_types = ["full", "sliding"]
    with pytest.raises(ValueError, match=r"indexer_types .*one of full, shared a layer"):
        write_gguf(tmp_path / "m.gguf", source.config, source.tokenizer, source.tensors, "f16")
    assert list(tmp_path.iterdir()) == []


def with_specials(tokenizer, text: str) -> list[int]:
    """`text` tokenized with its special-token text as special tokens (llama-server's /tokenize, parse_special)."""
    ids, start = [], 0
    for match in tokenizer._special_re.finditer(text):
        ids += tokenizer.encode_text(text[start:match.start()]) + [tokenizer.special_ids[match.group()]]
        start = match.end()
    return ids + tokenizer.encode_text(text[start:])


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_gguf_template_renders_the_toolkit_prompt_whatever_the_server_defines(tiny, version):
    """llama-server defines `enable_thinking` in every render (true for a template that can think): the GGUF's
    template gives the toolkit's prompt all the same, and the thinking prompt where the request asks for reasoning
    (`reasoning_effort`)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = open_export(tiny[version], form="gguf")
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = environment.from_string(source.gguf_chat_template)
    fmt, tokenizer = source.version.format, source.tokenizer
    for messages in CHATS:
        want = tokenizer.encode_chat(messages, add_generation_prompt=True, **fmt.template_kwargs)
        for defined in (True, False):
            text = template.render(messages=messages, add_generation_prompt=True, enable_thinking=defined)
            assert with_specials(tokenizer, text) == want
        thinking = template.render(messages=messages, add_generation_prompt=True, enable_thinking=True,
                                   reasoning_effort="high")
        assert with_specials(tokenizer, thinking) == tokenizer.encode_chat(messages, add_generation_prompt=True,
                                                                           enable_thinking=True)


def test_a_checkpoint_missing_an_expert_or_with_dense_layers_late_is_refused(tiny, tmp_path):
    source = CheckpointTensors(tiny["glm4-moe"])
    config = open_export(tiny["glm4-moe"], form="gguf").config

    class Missing:
        def shapes(self):
            return [(k, s) for k, s in source.shapes() if k != "model.layers.1.mlp.experts.5.up_proj.weight"]

        def get(self, key):
            return source.get(key)

    with pytest.raises(ValueError, match=r"layer 1: up_proj of the routed experts must be experts 0\.\.7"):
        gguf_moe.moe_layout("glm4moe", config, Missing())
    lite = open_export(tiny["glm4-moe-lite"], form="gguf").config
    lite.mlp_layer_types = ["sparse", "dense"]
    with pytest.raises(ValueError, match="leading dense layers then expert layers only"):
        gguf_moe.leading_dense_layers(lite)


# ------------------------------------------------------------------------------------------------------------------
# llama.cpp's own server on the f16 files

NEW_TOKENS = 8


def post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def as_stored_in_f16(model):
    """`model` with the weights an f16 file holds in F16 rounded to it: every matrix but the routers and GLM-5's indexer
    weights, which the file keeps in F32 as it keeps the vectors (`gguf_file.tensor_type`). A near tie of two logits,
    or of two tokens' indexer scores where GLM-5's sparse attention chooses, can go either way between the float32
    weights and the file's."""
    with torch.no_grad():
        for key, weight in model.named_parameters():
            if weight.dim() >= 2 and not key.endswith(("mlp.gate.weight", "indexer.weights_proj.weight")):
                weight.copy_(weight.half().float())
    return model


def toolkit_greedy(model, ids: list[int], new: int, stops) -> list[int]:
    """Greedy ids in float32, the whole sequence recomputed at each step, up to and without a stop id."""
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for _ in range(new):
            token = int(model(x).logits[0, -1].argmax())
            if token in stops:
                break
            out.append(token)
            x = torch.cat([x, torch.tensor([[token]])], 1)
    return out


@pytest.mark.skipif(find_llama_server() is None,
                    reason=f"no llama-server ($LLAMA_SERVER or on PATH): {LLAMA_SERVER_BUILD}")
@pytest.mark.parametrize("version", list(VERSIONS))
def test_llama_server_tokenizes_prompts_and_answers_as_the_toolkit(tiny, tmp_path, version):
    from bench.export.export_engines import sample_strings

    source = open_export(tiny[version], form="gguf")
    path = tmp_path / "m-f16.gguf"
    write_gguf(path, source.config, source.tokenizer, source.tensors, "f16", chat_template=source.gguf_chat_template)
    tokenizer, fmt = source.tokenizer, source.version.format
    model = as_stored_in_f16(toolkit_model(tiny[version]))  # what the file holds, as llama.cpp computes with it
    stops = set(tokenizer.stop_token_ids)
    strings = sample_strings(300)
    prompts = [[{"role": "user", "content": text}] for text in strings[-20:]]
    server = llama_server(find_llama_server(), path, 1, 1, 512, tmp_path, prompt_of=lambda text: text)
    server.start(timeout=120)
    try:
        tokens = [post(server.base, "/tokenize", {"content": s, "parse_special": False})["tokens"] for s in strings]
        rendered = [post(server.base, "/apply-template", {"messages": m})["prompt"] for m in prompts]
        prompt_ids = [post(server.base, "/tokenize", {"content": r, "parse_special": True})["tokens"] for r in rendered]
        answers = [post(server.base, "/completion", {"prompt": ids, "n_predict": NEW_TOKENS, "temperature": 0,
                                                     "top_k": 1, "return_tokens": True,
                                                     "cache_prompt": False})["tokens"]
                   for ids in prompt_ids]
    finally:
        server.stop()
    wrong = [s for s, got in zip(strings, tokens) if got != tokenizer.encode_text(s)]
    assert wrong == [], f"{len(wrong)} of {len(strings)} strings tokenized otherwise"
    want_prompts = [tokenizer.encode_chat(m, add_generation_prompt=True, **fmt.template_kwargs) for m in prompts]
    assert prompt_ids == want_prompts
    want = [toolkit_greedy(model, ids, NEW_TOKENS, stops) for ids in want_prompts]
    got = [[t for t in answer[:len(w) + 1] if t not in stops][:NEW_TOKENS] for answer, w in zip(answers, want)]
    assert len({t for w in want for t in w}) > 3  # the random model answers, not one token over and over
    assert sum(w == g for w, g in zip(want, got)) == len(prompts), list(zip(want, got))


@pytest.mark.parametrize("version", list(VERSIONS))
def test_exported_templates_render_agent_conversations_to_the_training_ids(tiny, tmp_path, version):
    """Conversations with tools, calls, results, reasoning on and off (`test_agent_data.conversations`): the hf
    directory's template through transformers, and the GGUF file's as llama-server renders it (`enable_thinking`
    always defined, reasoning asked by `reasoning_effort`), give the ids a training row holds (less its stop token)."""
    import transformers
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from test_agent_data import conversations, flags, template_messages

    from chatglm_tune.data.batches import encode_record
    from chatglm_tune.data.records import parse_record
    from chatglm_tune.options import EncodingOptions

    source = open_export(tiny[version], form="hf", dtype="float32")
    write_hf(tmp_path / "hf", source.model, source.tokenizer, chat_template=source.chat_template,
             sampling=source.sampling)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, ensure_ascii=False, **kw: json.dumps(value, ensure_ascii=ensure_ascii,
                                                                                       **kw)
    gguf_template = environment.from_string(open_export(tiny[version], form="gguf").gguf_chat_template)
    options = EncodingOptions(prompt="", max_src_len=4096, max_len=8192)
    for i, raw in enumerate(conversations(CONVERSATION_FORMS[version], n=20, seed=3)):
        want = list(encode_record(parse_record(raw, f"c:{i}"), source.tokenizer, options).input_ids[:-1])
        messages, asked = template_messages(json.loads(json.dumps(raw))), flags(raw)
        ids = hf_tokenizer.apply_chat_template(messages, tools=raw["tools"], tokenize=True, **asked)
        assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == want, raw
        server = {"enable_thinking": True, **({"reasoning_effort": "high"} if asked["enable_thinking"] else {}),
                  **{k: v for k, v in asked.items() if k == "clear_thinking"}}
        text = gguf_template.render(messages=messages, tools=raw["tools"], add_generation_prompt=False, **server)
        assert with_specials(source.tokenizer, text) == want, raw


@pytest.fixture(scope="module")
def glm53_flash(tmp_path_factory) -> Path:
    return tiny_model("glm53-flash", tmp_path_factory.mktemp("glm53-flash"))


def test_glm53_flash_exports_an_hf_directory_plain_transformers_decodes_as_the_toolkit(glm53_flash, tmp_path):
    """The composite config.json (its vision encoder's config as the tiny model holds it), the text model's tensors
    under their released names (no vision encoder: transformers initialises one, which text never reaches), and
    transformers' greedy ids those of the toolkit's `generate`, left pads included."""
    import transformers
    from safetensors import safe_open

    from chatglm_tune.decoding.generation import generate

    out = tmp_path / "hf"
    assert export(glm53_flash, out, "--format", "hf") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"] and "chatglm_version" not in config
    assert config["vision_config"]["depth"] == 1 and config["text_config"]["layer_types"][-1] == "indexed_attention"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.language_model.layers.0.self_attn.q_conv1d.weight" in keys
    assert not any(k.startswith("model.visual.") for k in keys)
    plain = transformers.Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ours = toolkit_model(glm53_flash)
    tokenizer = registry.VERSIONS["glm53-flash"].load_tokenizer(glm53_flash)
    ids = torch.tensor([tokenizer.encode_text(TEXTS[i] + TEXTS[i + 1])[:20] for i in (2, 4)])
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = tokenizer.pad_token_id, 0
    with torch.no_grad():
        theirs = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    assert generate(ours, ids, mask, max_new_tokens=8, eos_token_id=None) == theirs.tolist()


@pytest.mark.parametrize("form", ["gguf", "ggml"])
def test_glm53_flash_is_refused_as_gguf_and_ggml_with_the_reason(glm53_flash, tmp_path, capsys, form):
    assert export(glm53_flash, tmp_path / form, "--format", form) == 2
    err = capsys.readouterr().err
    assert "--format hf" in err and ("llama.cpp" in err if form == "gguf" else "chatglm.cpp" in err)
    assert not (tmp_path / form).exists()
