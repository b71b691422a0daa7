"""What the mixture-of-experts versions (GLM-4.5 / 4.6 / 4.7: `glm4-moe`; GLM-4.7-Flash: `glm4-moe-lite`; GLM-5:
`glm5`; GLM-5.3-Flash: `glm53-flash`, whose experts' SwiGLU clamps its inputs) add to the versions before them: LoRA
on the routed experts' 3D weights through train.py (trained, saved, read back, merged;
quantize.py merges it and stores every expert in INT8 / INT4, as for a float model, and infer.py runs that), INT8 /
INT4 experts that run only the experts a token is routed to, equal to the float experts quantized the same way, and
serve.py answering a chat on a tiny model.

transformers' equality (logits, greedy ids, the prefix as the first cache entries, saving) is in
test_glm_transformers_forms.py; the tiny presets end to end in test_tiny_released_forms.py.
"""

import json
import urllib.request

import pytest
import torch
from safetensors import safe_open
from torch import nn

import quantize
from chatglm_tune.quant.experts import QuantizedExperts, quantize_experts
from chatglm_tune.quant.format import dequantize
from chatglm_tune.runs import loading
from chatglm_tune.runs.loading import text_fields
from chatglm_tune.runs.lora import load_lora
from serving import serve_py, tiny_model
from test_tiny_glm4 import in_process
from test_versions import DEV

VERSIONS = ("glm4-moe", "glm4-moe-lite", "glm5", "glm53-flash")
LAYERS = {version: "model.layers." for version in VERSIONS} | {"glm53-flash": "model.language_model.layers."}
CLAMPED = ("glm53-flash",)  # experts whose SwiGLU clamps its inputs (`swiglu_limit`): no decode step held in C++
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module", params=VERSIONS)
def tiny(request, tmp_path_factory):
    return request.param, tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expert_lora(tiny, tmp_path_factory):
    """A 3-step train.py LoRA run on the tiny model, its adapters on the attention output (`o_proj`) and the routed
    experts' 3D weights."""
    version, directory = tiny
    root = tmp_path_factory.mktemp(f"{version}-lora")
    data = root / "data.jsonl"
    data.write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:8]) + "\n", encoding="utf-8")
    in_process("train.py", "--model", directory, "--tuning", "lora", "--lora-target", "o_proj", *EXPERT_TARGETS,
               "--lora-dropout", 0, "--train-file", data, "--max-src-len", 64, "--max-len", 96, "--batch-size", 4,
               "--threads", 1, "--max-steps", 3, "--lr", "5e-2", "--output-dir", root / "lora")
    return root / "lora"


def chat_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.prompt_format.chat_ids(tokenizer, [{"role": "user", "content": "水泵漏油。"}])])


def test_lora_on_the_routed_experts_trains_saves_and_merges(tiny, expert_lora):
    version, directory = tiny
    config = json.loads((expert_lora / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(EXPERT_TARGETS) and config["target_modules"] == ["o_proj"]
    with safe_open(expert_lora / "adapter_model.safetensors", "pt") as f:
        experts = [k for k in f.keys() if ".mlp.experts." in k]
        assert experts and all(f.get_tensor(k).abs().sum() > 0 for k in experts)  # trained, not zero
    merged, tokenizer = loading.load_run(loading.resolve_run(expert_lora))  # the adapter folded into the base
    base, _ = loading.load_run(loading.resolve_run(directory))
    ids = chat_ids(tokenizer)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = load_lora(base, expert_lora)(ids).logits  # peft's adapters beside the weights
        assert (adapted - plain).abs().max() > 1e-4  # the adapters change the answer
        assert (merged(ids).logits - adapted).abs().max() < 1e-5
    assert isinstance(merged.model.layers[1].mlp.experts.gate_up_proj, nn.Parameter)  # folded back into the 3D weight


def sees_every_token(model) -> None:
    """GLM-5's and GLM-5.3-Flash's sparse attention made to choose every token (as many as the context holds): a
    query's top-k choice among a tiny model's few tokens flips with INT4's error (a discontinuous change the weights'
    error does not measure), so the weights are compared with every token seen."""
    for layer in model.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = model.config.max_position_embeddings


def stored_layout(directory) -> dict[str, tuple[str, list[int]]]:
    """{key: (dtype, shape)} of the tensors in a directory's model.safetensors."""
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("bits", (8, 4))
def test_quantize_py_merges_an_expert_lora_run_into_int_experts_that_infer_py_runs(tiny, expert_lora, tmp_path, bits):
    """quantize.py on a LoRA run (adapters on attention and on the routed experts): the adapter merged into the float
    base, then the tensors a float model directory quantizes to (every routed expert INT8 / packed INT4 with its
    scales, as the attention and the shared expert); infer.py runs the result, whose logits are the float merged
    model's within the quantization error."""
    version, directory = tiny
    quantize.main([f"--bits={bits}", str(expert_lora), str(tmp_path / "lora")])
    quantize.main([f"--bits={bits}", str(directory), str(tmp_path / "float-model")])
    layout, full = stored_layout(tmp_path / "lora"), stored_layout(tmp_path / "float-model")
    assert {k for k in layout.keys() | full.keys() if layout.get(k) != full.get(k)} == set()
    inner = text_fields(json.loads((directory / "config.json").read_text()))["moe_intermediate_size"]
    down = LAYERS[version] + "1.mlp.experts.7.down_proj"
    assert layout[down + ".weight"][0] == "I8" and layout[down + ".weight"][1][1] * 8 // bits == inner
    assert layout[down + ".weight_scale"][0] == "F16"
    quantized, tokenizer = loading.load_run(loading.resolve_run(tmp_path / "lora"))
    merged, _ = loading.load_run(loading.resolve_run(expert_lora))
    base, _ = loading.load_run(loading.resolve_run(directory))
    assert isinstance(quantized.model.layers[1].mlp.experts, QuantizedExperts)
    ids = chat_ids(tokenizer)
    for model in (quantized, merged, base):  # GLM-5: every query sees every token (`sees_every_token`)
        sees_every_token(model)
    with torch.no_grad():
        got, want, plain = quantized(ids).logits, merged(ids).logits, base(ids).logits
    # measured: INT8 0.0022-0.0025, INT4 0.043-0.045 from the merged model (GLM-5's 0.41: INT4 on a tiny random model
    # is 0.23 for GLM-4.7-Flash and GLM-5 alike, and this merged one of GLM-5 lands further); the adapter moves it
    # 26-34. The tiny GLM-5.3-Flash's INT8 0.21, INT4 0.87 (agreeing on 31% of the argmax): its routers' top-2 of 8
    # experts and its KDA keys (l2-normed) turn a weight's error into other choices (float noise of INT8's size on
    # k_proj alone moves it 0.11, as INT8 there does): the INT model stays nearer the merged one than the base, which
    # the adapter moves 1.34 away.
    tolerance = {"glm5": {8: 0.01, 4: 0.5}, "glm53-flash": {8: 0.3, 4: 1.0}}.get(version, {8: 0.01, 4: 0.1})[bits]
    assert (got - want).norm() < tolerance * want.norm() < (plain - want).norm()
    agreement = {("glm53-flash", 4): 0.25}.get((version, bits), 0.7)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > agreement
    in_process("infer.py", "--model", tmp_path / "lora", "--text", "水泵漏油。", "--max-new-tokens", 4, "--threads", 1)


@pytest.mark.parametrize("bits", (8, 4))
def test_int_experts_run_only_the_chosen_experts_as_the_float_ones_quantized(tiny, bits):
    version, directory = tiny
    model, _ = loading.load_run(loading.resolve_run(directory))
    experts = model.model.layers[1].mlp.experts
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 3], [3, 1], [7, 0], [2, 6], [5, 5]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    quantized = QuantizedExperts.from_fused(experts, bits)
    # the float experts with each weight replaced by its dequantized INT form: the same sum, in float
    with torch.no_grad():
        for e in range(experts.gate_up_proj.shape[0]):
            expert = quantized.expert(e)
            fused = [dequantize(p.weight, p.weight_scale, bits, torch.float32)
                     for p in (expert.gate_proj, expert.up_proj)]
            experts.gate_up_proj[e] = torch.cat(fused)
            experts.down_proj[e] = dequantize(expert.down_proj.weight, expert.down_proj.weight_scale,
                                              bits, torch.float32)
        want = experts(hidden, index, weights)
        calls = []
        for e in range(quantized.num_experts):
            quantized.expert(e).register_forward_pre_hook(lambda m, args, e=e: calls.append(e))
        got = quantized(hidden, index, weights)  # in grouped calls where the integer-dot kernel runs, else one by one
    ran = set(calls) | {e for e in range(quantized.num_experts)
                        if all(getattr(quantized.expert(e), name).last_kernel
                               for name in ("gate_proj", "up_proj", "down_proj"))}
    # each chosen expert once, no other
    assert sorted(calls) == sorted(set(calls)) and sorted(ran) == [0, 1, 2, 3, 5, 6, 7]
    with torch.no_grad():
        for row in range(5):  # one token (a decode step) alone: what the batch gave it
            assert torch.allclose(quantized(hidden[row:row + 1], index[row:row + 1], weights[row:row + 1]),
                                  got[row:row + 1], rtol=1e-5, atol=1e-7)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()  # activations quantized on the integer path
    layers_with_experts = {"glm53-flash": 3}.get(version, 1)  # its tiny model: 4 layers, experts after the first
    assert quantize_experts(model, bits) == layers_with_experts
    assert isinstance(model.model.layers[1].mlp.experts, QuantizedExperts)


@pytest.mark.parametrize("bits", (8, 4))
def test_int_experts_clamp_as_glm53_flash_experts(tmp_path, bits):
    """GLM-5.3-Flash's experts clamp their SwiGLU's inputs (the gate at most L, the up projection within [-L, L]):
    INT experts clamp alike, one token or many, grouped or expert by expert (equal bit for bit), close to the float
    experts of the dequantized weights, and hold no C++ decode step (it has no clamp). A limit the tiny model's
    activations reach shows the clamp at work."""
    from chatglm_tune.quant import int8dot_cpu

    model, _ = loading.load_run(loading.resolve_run(tiny_model("glm53-flash", tmp_path)))
    experts = model.model.layers[1].mlp.experts
    quantized = QuantizedExperts.from_fused(experts, bits)
    assert quantized.swiglu_limit == experts.swiglu_limit == model.config.swiglu_limit
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, model.config.hidden_size, generator=generator) * 20
    index = torch.stack([torch.randperm(quantized.num_experts, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    with torch.no_grad():
        for e in range(quantized.num_experts):  # the float experts of the dequantized weights
            expert = quantized.expert(e)
            experts.gate_up_proj[e] = torch.cat([dequantize(p.weight, p.weight_scale, bits, torch.float32)
                                                 for p in (expert.gate_proj, expert.up_proj)])
            experts.down_proj[e] = dequantize(expert.down_proj.weight, expert.down_proj.weight_scale, bits,
                                              torch.float32)
        gate_up = torch.einsum("th,eih->tei", hidden, experts.gate_up_proj)
        limit = 0.5 * gate_up.abs().amax().item()  # reached: the clamp changes the sum
        experts.swiglu_limit = quantized.swiglu_limit = limit
        want = experts(hidden, index, weights)
        got = quantized(hidden, index, weights)
        quantized._grouped = False  # expert by expert
        assert torch.equal(quantized(hidden, index, weights), got)
        quantized._grouped = True
        alone = torch.cat([quantized(hidden[t:t + 1], index[t:t + 1], weights[t:t + 1]) for t in range(6)])
        quantized.swiglu_limit = None
        unclamped = quantized(hidden, index, weights)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    assert torch.allclose(alone, got, rtol=1e-5, atol=1e-6)
    assert (unclamped - got).abs().max() > 0.1 * want.abs().max()
    quantized.swiglu_limit = limit
    if int8dot_cpu.available():
        assert quantized.decoder(model.model.layers[1].mlp.gate, None) is None


@pytest.mark.parametrize("bits,dtype", ((8, torch.bfloat16), (4, torch.bfloat16), (4, torch.float32)))
def test_a_decode_step_runs_the_chosen_and_shared_experts_in_two_grouped_calls(tiny, bits, dtype):
    """Over INT experts a one-token step of a mixture-of-experts layer runs its chosen experts and the shared expert in
    two grouped integer-dot calls, equal bit for bit to transformers' forward expert by expert; a shared expert the
    grouped calls cannot take (a float layer, as an adapter leaves it) runs transformers' way."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.quant import int8dot_cpu

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    version, directory = tiny
    if version in CLAMPED:
        pytest.skip("its experts clamp their SwiGLU's inputs, which the C++ step does not (the clamp: "
                    "test_int_experts_clamp_as_glm53_flash_experts)")
    model = from_pretrained(directory, quantization_bit=bits, dtype=dtype)
    layer = model.model.layers[1].mlp
    plain_forward = type(layer).__mro__[2].forward  # transformers' own layer forward
    calls = []
    for module in layer.modules():
        module.register_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))

    def check(seeds):
        for seed in seeds:
            x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
            calls.clear()
            grouped = layer(x)
            assert "QuantizedLinear" not in calls and "QuantizedExpert" not in calls  # no layer by layer
            assert layer._held_decoder[1] is not None  # the step held in C++
            layer.experts._grouped = False  # expert by expert, then the shared expert
            want = plain_forward(layer, x)
            layer.experts._grouped = True
            assert torch.equal(grouped, want)
        return x

    with torch.no_grad():
        check(range(4))
        held = layer._held_decoder
        layer.gate.e_score_correction_bias.copy_(torch.randn(layer.gate.e_score_correction_bias.shape,
                                                             generator=torch.Generator().manual_seed(9)))
        check(range(4, 8))  # a score correction that changes the choice, read where it is
        assert layer._held_decoder is held
        state = layer.state_dict()
        for key in [k for k in state if k.endswith("weight_scale")]:
            state[key] = state[key] * 1.5
        layer.load_state_dict(state)  # new layouts: the held step is made again from them
        x = check(range(8, 10))
        shared = layer.shared_experts
        float_gate = nn.Linear(shared.gate_proj.in_features, shared.gate_proj.out_features, bias=False).to(dtype)
        shared.gate_proj = float_gate
        float_gate.register_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))
        calls.clear()
        out = layer(x)
        assert "Linear" in calls and torch.equal(out, plain_forward(layer, x))


def test_decoding_makes_each_layers_held_step_once(tiny, monkeypatch):
    """A model's forward slices its list of layers anew at every step: that is no change that makes the held decode
    steps again (made at every step, they would be slower than the Python step): the experts' step and, for
    GLM-4.7-Flash, the whole layer's."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.generation import generate
    from chatglm_tune.models.glm import latent_layer
    from chatglm_tune.quant import int8dot_cpu

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    version, directory = tiny
    if version in CLAMPED:
        pytest.skip("its experts clamp their SwiGLU's inputs, which the C++ step does not: no step held")
    model = from_pretrained(directory, quantization_bit=4, dtype=torch.float32)
    made, layers_made = [], []
    real, real_layer = QuantizedExperts.decoder, latent_layer._made_step
    monkeypatch.setattr(QuantizedExperts, "decoder", lambda self, *args: made.append(self) or real(self, *args))
    monkeypatch.setattr(latent_layer, "_made_step", lambda layer, x: layers_made.append(layer) or real_layer(layer, x))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    generate(model, ids, torch.ones_like(ids), max_new_tokens=6, eos_token_id=[])
    layers = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert layers and sorted(map(id, made)) == sorted(map(id, layers))
    held = [m for m in model.modules() if isinstance(m, latent_layer.LatentLayer)]
    assert sorted(map(id, layers_made)) == sorted(map(id, held)) and bool(held) == (version == "glm4-moe-lite")
    if held:  # the dense first layer too: its MLP as the experts' step with no routed experts
        assert all(layer._held[1] is not None for layer in held) and model.config.mlp_layer_types[0] == "dense"


@pytest.mark.parametrize("bits,dtype", ((8, torch.bfloat16), (4, torch.bfloat16), (4, torch.float32)))
def test_a_prompts_tokens_run_every_chosen_expert_in_two_grouped_calls(tiny, bits, dtype):
    """Over INT experts the tokens of a prompt run every chosen expert on the rows routed to it in two grouped
    integer-dot calls (all gates and ups, then all downs), no expert's module called, equal bit for bit to the expert
    by expert loop; a dropped choice (index E) counts for nothing; under autograd the loop runs."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.quant import int8dot_cpu

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    version, directory = tiny
    model = from_pretrained(directory, quantization_bit=bits, dtype=dtype)
    experts = model.model.layers[1].mlp.experts
    count, chosen = experts.num_experts, model.config.num_experts_per_tok
    calls = []
    for e in range(count):
        experts.expert(e).register_forward_pre_hook(lambda m, args, e=e: calls.append(e))
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(11, model.config.hidden_size, generator=generator).to(dtype)
        index = torch.stack([torch.randperm(count, generator=generator)[:chosen] for _ in range(11)])
        index[4, 0] = count  # dropped
        weights = torch.rand(11, chosen, generator=generator).to(dtype)
        with torch.no_grad():
            calls.clear()
            grouped = experts(hidden, index, weights)
            assert calls == []
            experts._grouped = False  # the loop, expert by expert
            want = experts(hidden, index, weights)
            experts._grouped = True
        assert sorted(set(calls)) == sorted(set(index[index < count].tolist()))
        assert torch.equal(grouped, want)
    calls.clear()
    with torch.enable_grad():
        experts(hidden.requires_grad_(), index, weights)
    assert calls


def test_the_one_group_router_chooses_as_transformers_router(tiny):
    """`moe_layer.route` skips the group selection of one group of experts: the same weights and experts, in the
    same order, bit for bit (a score correction bias that changes the choice included)."""
    from chatglm_tune.models.glm.moe_layer import route

    version, directory = tiny
    model, _ = loading.load_run(loading.resolve_run(directory))
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
        _, want_weights, want_index = gate(x)
        weights, index = route(gate, x)
    assert gate.num_group == 1 and torch.equal(index, want_index) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("bits", (8, 4))
def test_latent_decode_steps_over_int_weights_read_the_integer_kv_b_proj(tmp_path_factory, bits):
    """GLM-4.7-Flash's absorbed products over INT `kv_b_proj`: the value rows as stored and the key rows transposed in
    INT8, every head in one grouped call, close to the float32 products of the dequantized weight."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.models.glm import latent_attention
    from chatglm_tune.quant import int8dot_cpu

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    directory = tiny_model("glm4-moe-lite", tmp_path_factory.mktemp("lite-int"))
    attention = from_pretrained(directory, quantization_bit=bits).model.layers[0].self_attn
    with torch.no_grad():
        absorbed = attention._absorbed()
        assert isinstance(absorbed, latent_attention.IntAbsorbed)
        heads, shape = attention.num_heads, (attention.num_heads, attention.qk_nope_head_dim + attention.v_head_dim,
                                             attention.kv_lora_rank)
        exact = latent_attention.FloatAbsorbed(latent_attention._float_weight(attention.kv_b_proj).view(shape),
                                               attention.qk_nope_head_dim)
        q = torch.randn(heads, 3, attention.qk_nope_head_dim, generator=torch.Generator().manual_seed(0))
        mixed = torch.randn(heads, 3, attention.kv_lora_rank, generator=torch.Generator().manual_seed(1))
        for got, want in ((absorbed.keys(q), exact.keys(q)), (absorbed.values(mixed), exact.values(mixed))):
            assert got.shape == want.shape and (got - want).norm() < 2e-2 * want.norm()


@pytest.mark.parametrize("bits,dtype", ((4, torch.float32), (8, torch.bfloat16)))
def test_a_latent_layers_decode_step_runs_in_cpp_with_the_same_bits(tmp_path_factory, monkeypatch, bits, dtype):
    """GLM-4.7-Flash over INT weights: a one-token decode step of a layer with experts, or of the dense first layer,
    runs as one held C++ step (none of its projections' forwards called), its scores equal bit for bit to the Python
    step's, a left-padded prompt's mask included; a norm's weight replaced is read by the step made again; a hook on one
    of its modules sends the step back to the modules, and so does a float projection swapped in."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.batch_cache import BatchCache
    from chatglm_tune.models.glm.latent_layer import LatentLayer
    from chatglm_tune.quant import int8dot_cpu
    from chatglm_tune.quant.modules import QuantizedLinear

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    directory = tiny_model("glm4-moe-lite", tmp_path_factory.mktemp("lite-held"))
    model = from_pretrained(directory, quantization_bit=bits, dtype=dtype)
    layer = model.model.layers[1]
    ids = torch.randint(5, 200, (1, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    one_row = []
    real_forward = QuantizedLinear.forward

    def counted(self, x):
        if x.numel() == x.shape[-1]:  # a one-token step
            one_row.append(self)
        return real_forward(self, x)

    monkeypatch.setattr(QuantizedLinear, "forward", counted)

    def decode(steps=4):
        with torch.no_grad():
            batch, scores = BatchCache.prefill(model, ids, mask)
            out = [scores]
            for _ in range(steps):
                out.append(batch.step(model, out[-1].argmax(-1)))
        return torch.stack(out)

    def python_decode(steps=4):
        with monkeypatch.context() as python_step:
            python_step.setattr(LatentLayer, "_held_step", lambda self, x, cache: None)
            return decode(steps)

    held = decode()
    projections = set(map(id, layer.self_attn.children()))
    assert layer._held[1] is not None and not projections & set(map(id, one_row))
    dense = model.model.layers[0]  # its MLP held as the experts' step with no routed experts
    assert dense._held[1] is not None and not set(map(id, dense.mlp.children())) & set(map(id, one_row))
    assert torch.equal(python_decode(), held) and projections & set(map(id, one_row))
    norm = layer.post_attention_layernorm
    norm.weight = nn.Parameter(torch.rand(norm.weight.shape, generator=torch.Generator().manual_seed(5)).to(dtype))
    changed = decode(2)
    assert not torch.equal(changed, held[:3]) and torch.equal(changed, python_decode(2))  # the new weight read
    seen = []
    handle = layer.self_attn.q_a_layernorm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert torch.equal(decode(1), changed[:2]) and (1, 1, model.config.q_lora_rank) in seen
    handle.remove()
    attention = layer.self_attn
    attention.o_proj = nn.Linear(attention.o_proj.in_features, attention.o_proj.out_features, bias=False, dtype=dtype)
    decode(1)
    assert layer._held[1] is None



def test_a_decode_step_runs_the_held_layers_without_their_module_calls(tmp_path_factory, monkeypatch):
    """GLM-4.7-Flash's trunk decodes a token over the toolkit's cache without calling the held layers' modules (each
    one C++ call writing its cache entries); a hook on a layer itself, or transformers' own cache, sends that layer
    through its module again (two C++ calls around the cache's update): the same scores bit for bit either way."""
    from transformers.cache_utils import DynamicCache

    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.batch_cache import BatchCache
    from chatglm_tune.models.glm.latent_layer import LatentLayer
    from chatglm_tune.quant import int8dot_cpu

    if not int8dot_cpu.available():
        pytest.skip("the int8 dot-product kernel cannot run or be built here")
    model = from_pretrained(tiny_model("glm4-moe-lite", tmp_path_factory.mktemp("lite-loop")), quantization_bit=4,
                            dtype=torch.float32)
    ids = torch.randint(5, 200, (1, 7), generator=torch.Generator().manual_seed(6))
    called = []
    real_forward = LatentLayer.forward

    def counted(self, x, *args, **kwargs):
        called.append((self.self_attn.layer_idx, x.shape[1]))
        return real_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(LatentLayer, "forward", counted)

    def decode(steps=3):
        called.clear()
        with torch.no_grad():
            batch, scores = BatchCache.prefill(model, ids, None)
            out = [scores]
            for _ in range(steps):
                out.append(batch.step(model, out[-1].argmax(-1)))
        return torch.stack(out), [layer for layer, tokens in called if tokens == 1]

    held, stepped = decode()
    layers = model.model.layers
    assert stepped == [] and all(layer._held[1] is not None for layer in layers)
    seen = []
    handle = layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    hooked, stepped = decode()
    handle.remove()
    assert torch.equal(hooked, held) and stepped == [1] * 3 and len(seen) == 4
    with torch.no_grad():  # transformers' cache: every layer through its module
        cache = DynamicCache(config=model.config)
        scores = [model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
        for _ in range(3):
            scores.append(model(scores[-1].argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1])
    assert torch.equal(torch.stack(scores), held)

def test_serve_answers_a_chat_whole_and_streamed(tiny, tmp_path):
    """A greedy chat answered whole, then streamed: the stream's content deltas are the whole answer's content."""
    version, directory = tiny
    body = {"messages": [{"role": "user", "content": "水泵漏油。"}], "max_tokens": 6, "temperature": 0}

    def post(payload: dict):
        return urllib.request.urlopen(urllib.request.Request(base + "/v1/chat/completions",
                                                             data=json.dumps(payload).encode(),
                                                             headers={"Content-Type": "application/json"}), timeout=60)

    with serve_py(directory, tmp_path / "serve.log") as (_, base):
        with post(body) as response:
            answer = json.loads(response.read())
        with post({**body, "stream": True}) as response:
            events = [line[len(b"data: "):].strip() for line in response if line.startswith(b"data: ")]
    assert answer["choices"][0]["message"]["role"] == "assistant" and answer["usage"]["completion_tokens"] >= 1
    assert events[-1] == b"[DONE]"
    deltas = [json.loads(event)["choices"][0]["delta"] for event in events[:-1]]
    streamed = "".join(delta.get("content") or "" for delta in deltas)
    assert streamed == (answer["choices"][0]["message"]["content"] or "")


@pytest.mark.parametrize("prefix", (0, 4))
@pytest.mark.parametrize("bits", (0, 4))
def test_latent_decode_steps_agree_with_the_expanded_attention(tmp_path_factory, bits, prefix):
    """GLM-4.7-Flash's decode steps (attention against the cached latents, `kv_b_proj` absorbed) choose what
    transformers' expanded attention over the whole sequence chooses, float and INT4 (`kv_b_proj` dequantized), with
    and without a P-tuning prefix (each head's keys and values; the C++ step, which knows none, stands aside); a row
    decoded alone after the others left the cache gives that row's logits."""
    from transformers import DynamicCache

    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.generation import generate
    from chatglm_tune.models.glm.latent_attention import LatentAttention

    directory = tiny_model("glm4-moe-lite", tmp_path_factory.mktemp("lite"))
    model = from_pretrained(directory, quantization_bit=bits or None, pre_seq_len=prefix or None)
    assert all(type(layer.self_attn) is LatentAttention for layer in model.model.layers)
    if prefix:
        with torch.no_grad():
            model.prefix_encoder.embedding.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    new = generate(model, ids, mask, max_new_tokens=8, eos_token_id=[])
    with torch.no_grad():
        whole = torch.cat([ids, torch.tensor(new)], 1)
        logits = model(whole, attention_mask=torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1)).logits
        assert new == logits[:, 11:-1].argmax(-1).tolist()
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, cache=cache)
        cache.batch_select_indices(torch.tensor([1]))
        step = model(whole[1:, 12:13], attention_mask=torch.ones(1, 13, dtype=mask.dtype), cache=cache).logits
    # INT4: the step's keys go through kv_b_proj's key rows re-quantized to INT8 (latent_attention.IntAbsorbed)
    assert (step[0, -1] - logits[1, 12]).abs().max() < (2e-2 if bits else 1e-4)
