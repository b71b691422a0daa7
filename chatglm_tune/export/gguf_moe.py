"""GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash in a GGUF file: llama.cpp's `glm4moe` and `deepseek2` architectures.

The architecture is the one llama.cpp's own converter gives the transformers class (`MOE_ARCHES`):
`Glm4MoeForCausalLM` is `glm4moe`, `Glm4MoeLiteForCausalLM` (multi-head latent attention) is `deepseek2`.
What each graph reads, and what is written here for it (`moe_layout`, `moe_hyperparameters`):
- the routed experts of a layer as three stacked tensors, `blk.N.ffn_{gate,up,down}_exps.weight` ([E, I, H],
  [E, I, H], [E, H, I] in torch order): from a loaded model, cut out of its fused 3D weights (`gate_up_proj`:
  the gate's rows first); from a checkpoint's released per-expert keys, stacked expert by expert straight into the
  encoded output, so memory holds the output tensor and one expert beside the files;
- the router `mlp.gate.weight` as `ffn_gate_inp`, its `e_score_correction_bias` as `exp_probs_b.bias` (added to
  the sigmoid scores to choose experts, not to weigh them); the shared experts as `ffn_{gate,up,down}_shexp`; a
  leading dense layer's MLP as `ffn_gate` / `ffn_up` / `ffn_down`;
- `glm4moe`: q / k / v (with their biases) as `attn_q` / `attn_k` / `attn_v`, the per-head q / k norms as
  `attn_q_norm` / `attn_k_norm`, the norm before the MLP as `post_attention_norm`; rotary NEOX-style on the first
  `head_dim x partial_rotary_factor` dims of each head, as transformers rotates them;
- `deepseek2`: `attn_q_a` / `attn_q_a_norm` / `attn_q_b` (or `attn_q` without a query latent),
  `attn_kv_a_mqa` / `attn_kv_a_norm`, and `kv_b_proj` ([heads x (nope + v), kv_lora_rank]) split per head into
  `attn_k_b` ([heads, kv_lora_rank, nope], each head's key rows transposed) and `attn_v_b` ([heads, v,
  kv_lora_rank]), which the graph multiplies into the latent; the norm before the MLP as `ffn_norm`; keys and
  values as one shared latent head (`head_count_kv` 1, `key_length` kv_lora_rank + rope dims, `value_length`
  kv_lora_rank, the decompressed head sizes as `key_length_mla` / `value_length_mla`); rotary on
  `qk_rope_head_dim` adjacent pairs, which is transformers' `rope_interleave` (a model without it is refused);
- hyperparameters: expert counts (routed, used per token, shared, groups), the expert FFN width, the leading dense
  layers (`first_k_dense_replace`, or the leading "dense" entries of `mlp_layer_types`, which must all come first),
  sigmoid gating, `routed_scaling_factor` as the weights scale, `norm_topk_prob` as the weights norm, and
  `nextn_predict_layers` 0: the releases' multi-token-prediction layer is not part of transformers' classes and is
  not written (its keys in a checkpoint are skipped).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatglm_tune.models.glm.config import transformers_form
from chatglm_tune.models.glm.experts import EXPERT_KEY, is_prediction_layer

MOE_ARCHES = {"Glm4MoeForCausalLM": "glm4moe", "Glm4MoeLiteForCausalLM": "deepseek2"}  # transformers class -> llama.cpp
# the architectures whose attention hyperparameters are latent attention's (`_latent_attention`); every other one
# writes grouped-query attention's (`gguf_file.hyperparameters`)
LATENT_ATTENTION = ("deepseek2",)

# transformers key -> llama.cpp name; {n}: layer, {w}: weight or bias, {p}: gate, up or down (kept as it is)
_COMMON_NAMES = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{n}.input_layernorm.weight", "blk.{n}.attn_norm.weight"),
    ("model.layers.{n}.self_attn.o_proj.{w}", "blk.{n}.attn_output.{w}"),
    ("model.layers.{n}.mlp.{p}_proj.weight", "blk.{n}.ffn_{p}.weight"),
    ("model.layers.{n}.mlp.gate.weight", "blk.{n}.ffn_gate_inp.weight"),
    ("model.layers.{n}.mlp.gate.e_score_correction_bias", "blk.{n}.exp_probs_b.bias"),
    ("model.layers.{n}.mlp.shared_experts.{p}_proj.weight", "blk.{n}.ffn_{p}_shexp.weight"),
)
_ARCH_NAMES = {
    "glm4moe": (
        ("model.layers.{n}.self_attn.q_proj.{w}", "blk.{n}.attn_q.{w}"),
        ("model.layers.{n}.self_attn.k_proj.{w}", "blk.{n}.attn_k.{w}"),
        ("model.layers.{n}.self_attn.v_proj.{w}", "blk.{n}.attn_v.{w}"),
        ("model.layers.{n}.self_attn.q_norm.weight", "blk.{n}.attn_q_norm.weight"),
        ("model.layers.{n}.self_attn.k_norm.weight", "blk.{n}.attn_k_norm.weight"),
        ("model.layers.{n}.post_attention_layernorm.weight", "blk.{n}.post_attention_norm.weight"),
    ),
    "deepseek2": (
        ("model.layers.{n}.self_attn.q_proj.weight", "blk.{n}.attn_q.weight"),
        ("model.layers.{n}.self_attn.q_a_proj.weight", "blk.{n}.attn_q_a.weight"),
        ("model.layers.{n}.self_attn.q_a_layernorm.weight", "blk.{n}.attn_q_a_norm.weight"),
        ("model.layers.{n}.self_attn.q_b_proj.weight", "blk.{n}.attn_q_b.weight"),
        ("model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight", "blk.{n}.attn_kv_a_mqa.weight"),
        ("model.layers.{n}.self_attn.kv_a_layernorm.weight", "blk.{n}.attn_kv_a_norm.weight"),
        ("model.layers.{n}.post_attention_layernorm.weight", "blk.{n}.ffn_norm.weight"),
    ),
}
_GROUPS = {"n": r"(?P<n>\d+)", "w": r"(?P<w>weight|bias)", "p": r"(?P<p>gate|up|down)"}


def _compiled(pairs) -> list[tuple[re.Pattern, str]]:
    out = []
    for key, name in pairs:
        pattern = re.escape(key)
        for group, regex in _GROUPS.items():
            pattern = pattern.replace(re.escape("{" + group + "}"), regex)
        out.append((re.compile("^" + pattern + "$"), name))
    return out


_NAMES = {arch: _compiled((*_COMMON_NAMES, *pairs)) for arch, pairs in _ARCH_NAMES.items()}
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(?P<n>\d+)\.mlp\.experts\.(?P<leaf>gate_up_proj|down_proj)$")
_KV_B = re.compile(r"^model\.layers\.(?P<n>\d+)\.self_attn\.kv_b_proj\.weight$")


def moe_arch(config) -> str | None:
    """llama.cpp's architecture of a mixture-of-experts model of this family (its config); None for another."""
    return MOE_ARCHES.get(transformers_form(config)["architectures"][0])


def moe_gguf_name(key: str, arch: str) -> str:
    """llama.cpp's name, in `arch`, of a tensor that maps one to one (e.g. `blk.1.exp_probs_b.bias`); ValueError
    for a key with none (routed experts and `kv_b_proj` are written by `moe_layout`)."""
    for pattern, name in _NAMES[arch]:
        m = pattern.match(key)
        if m:
            return name.format(**m.groupdict())
    raise ValueError(f"{key} has no name in llama.cpp's {arch} architecture")


@dataclass
class GgufTensor:
    """One tensor of the file: its name, its shape (torch order) and `parts()`: pieces along dim 0 whose
    concatenation is the tensor, read from the source when called."""

    name: str
    shape: tuple[int, ...]
    parts: Callable[[], object]


def moe_layout(arch: str, config, source) -> list[GgufTensor]:
    """The GGUF tensors of a model of `arch` from `source` (`export.tensors`: `shapes()` and `get(key)`), in the
    order of the source's keys: fused or per-expert routed experts stacked, `kv_b_proj` split, every other tensor
    renamed; a multi-token-prediction layer's keys skipped. ValueError for a key with no name, or experts missing."""
    items = []  # GgufTensors, and (layer, part) where a stacked experts' tensor goes
    experts: dict[tuple[str, str], dict[int, tuple]] = {}  # (layer, part) -> {expert: (key, shape)}
    for key, shape in source.shapes():
        if is_prediction_layer(key, config):
            continue
        m = EXPERT_KEY.match(key)
        if m is None:
            items += _tensors(arch, config, source, key, shape)
            continue
        where = (m[1].split(".")[2], m[3])
        if where not in experts:
            items.append(where)  # the stacked tensor goes where its first expert is
        experts.setdefault(where, {})[int(m[2])] = (key, shape)
    return [item if isinstance(item, GgufTensor) else _stacked(*item, experts[item], config, source) for item in items]


def _tensors(arch: str, config, source, key: str, shape: tuple[int, ...]) -> list[GgufTensor]:
    """The GGUF tensors of one source tensor that is not a released per-expert weight."""
    m = _FUSED_EXPERTS.match(key)
    if m and len(shape) == 3:
        blk = f"blk.{m['n']}"
        if m["leaf"] == "down_proj":
            return [GgufTensor(f"{blk}.ffn_down_exps.weight", shape, lambda: [source.get(key)])]
        rows = shape[1] // 2
        half = (shape[0], rows, shape[2])
        return [GgufTensor(f"{blk}.ffn_gate_exps.weight", half, lambda: [source.get(key)[:, :rows]]),
                GgufTensor(f"{blk}.ffn_up_exps.weight", half, lambda: [source.get(key)[:, rows:]])]
    m = _KV_B.match(key)
    if m and arch == "deepseek2":
        return _split_kv_b(m["n"], config, source, key, shape)
    return [GgufTensor(moe_gguf_name(key, arch), shape, lambda: [source.get(key)])]


def _split_kv_b(layer: str, config, source, key: str, shape: tuple[int, ...]) -> list[GgufTensor]:
    """`kv_b_proj` [heads x (nope + v), rank] as `attn_k_b` [heads, rank, nope] and `attn_v_b` [heads, v, rank]."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    if len(shape) != 2 or shape[0] != heads * (nope + v):
        raise ValueError(f"{key} has shape {list(shape)}; {heads} heads of {nope} key + {v} value rows need "
                         f"{heads * (nope + v)} rows")
    rank = shape[1]

    def per_head() -> torch.Tensor:
        return source.get(key).reshape(heads, nope + v, rank)

    return [GgufTensor(f"blk.{layer}.attn_k_b.weight", (heads, rank, nope),
                       lambda: [per_head()[:, :nope].transpose(1, 2)]),
            GgufTensor(f"blk.{layer}.attn_v_b.weight", (heads, v, rank), lambda: [per_head()[:, nope:]])]


def _stacked(layer: str, part: str, group: dict, config, source) -> GgufTensor:
    """The routed experts' `part` of `layer`, from their released per-expert keys, as one [E, ...] tensor."""
    count = config.n_routed_experts
    shapes = {shape for _, shape in group.values()}
    if sorted(group) != list(range(count)) or len(shapes) != 1:
        have = ", ".join(f"{e} {list(s)}" for e, (_, s) in sorted(group.items()))
        raise ValueError(f"layer {layer}: {part}_proj of the routed experts must be experts 0..{count - 1} "
                         f"(n_routed_experts) of one shape; the checkpoint has {have}")
    keys = [group[e][0] for e in range(count)]
    return GgufTensor(f"blk.{layer}.ffn_{part}_exps.weight", (count, *shapes.pop()),
                      lambda: (source.get(k).unsqueeze(0) for k in keys))


def leading_dense_layers(config) -> int:
    """How many layers come first with a dense MLP (llama.cpp runs all the others with experts); ValueError for a
    model whose dense layers do not all come first."""
    types = getattr(config, "mlp_layer_types", None)
    if not types:
        return int(config.first_k_dense_replace)
    lead = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if any(kind != "sparse" for kind in types[lead:]):
        raise ValueError(f"mlp_layer_types {types}: llama.cpp runs leading dense layers then expert layers only")
    return lead


def moe_hyperparameters(writer, config, arch: str) -> None:
    """The architecture's own hyperparameters beyond those every architecture here has (`gguf_file.hyperparameters`:
    see the module docstring), latent attention's among them; ValueError, in `deepseek2`, for a rotary that is not
    interleaved."""
    import gguf

    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(leading_dense_layers(config))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_nextn_predict_layers(0)
    if arch in LATENT_ATTENTION:
        _latent_attention(writer, config)


def _latent_attention(writer, config) -> None:
    if not getattr(config, "rope_interleave", True):
        raise ValueError("rope_interleave is false: llama.cpp's deepseek2 rotates adjacent pairs, which is "
                         "transformers' rope_interleave true")
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_vocab_size(config.vocab_size)
    writer.add_head_count_kv(1)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_rope_dimension_count(rope)
