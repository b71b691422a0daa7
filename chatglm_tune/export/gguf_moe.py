"""GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash and GLM-5 in a GGUF file: llama.cpp's `glm4moe`, `deepseek2` and `glm-dsa`.

The architecture is the one llama.cpp's own converter gives the transformers class (`MOE_ARCHES`):
`Glm4MoeForCausalLM` is `glm4moe`, `Glm4MoeLiteForCausalLM` (multi-head latent attention) is `deepseek2`,
`GlmMoeDsaForCausalLM` (GLM-5's latent attention with DeepSeek Sparse Attention's indexer) is `glm-dsa`, which the
converter writes as `deepseek2` plus the indexer (its class for GLM-5 is DeepSeek-V2's with another architecture).
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
- `deepseek2` and `glm-dsa`: `attn_q_a` / `attn_q_a_norm` / `attn_q_b` (or `attn_q` without a query latent),
  `attn_kv_a_mqa` / `attn_kv_a_norm`, and `kv_b_proj` ([heads x (nope + v), kv_lora_rank]) split per head into
  `attn_k_b` ([heads, kv_lora_rank, nope], each head's key rows transposed) and `attn_v_b` ([heads, v,
  kv_lora_rank]), which the graph multiplies into the latent; the norm before the MLP as `ffn_norm`; keys and
  values as one shared latent head (`head_count_kv` 1, `key_length` kv_lora_rank + rope dims, `value_length`
  kv_lora_rank, the decompressed head sizes as `key_length_mla` / `value_length_mla`); rotary on
  `qk_rope_head_dim` adjacent pairs (`rope.dimension_count`), which is transformers' `rope_interleave` (a
  GLM-4.7-Flash without it is refused; GLM-5's attention and indexer always rotate so);
- `glm-dsa`'s indexer (in a layer with one: `indexer_types` "full"), under the converter's names
  blk.N.indexer.*: the indexer's `wq_b` as attn_q_b ([heads x key, q_lora_rank]: its queries from the query
  latent), `wk` as attn_k ([key, hidden]), `weights_proj` as proj ([heads, hidden]) and its key's LayerNorm `k_norm`
  as k_norm (weight and bias); its hyperparameters attention.indexer.head_count (`index_n_heads`), key_length
  (`index_head_dim`) and top_k (`index_topk`); the indexer rotates the first `rope.dimension_count` dims of its keys
  and queries as the attention does. llama.cpp's graph turns the indexer's keys and queries by a Hadamard matrix at
  least 64 wide, so it runs a key length that is a multiple of 64 (GLM-5's is 128);
- hyperparameters: expert counts (routed, used per token, shared, groups), the expert FFN width, the leading dense
  layers (`first_k_dense_replace`, or the leading "dense" entries of `mlp_layer_types`, which must all come first),
  sigmoid gating, `routed_scaling_factor` as the weights scale, `norm_topk_prob` as the weights norm.

Where the toolkit departs from the converter (what it writes the converter does not, or otherwise):
- `nextn_predict_layers` 0 and `block_count` the model's layers: the releases' multi-token-prediction layer is not
  part of transformers' classes and is not written (its keys in a checkpoint are skipped). The converter keeps it
  for `glm4moe` and `glm-dsa` (block_count + 1, `nextn_predict_layers` 1), as layers llama.cpp loads and skips
  (the later converter's `--no-mtp` drops it as here);
- `glm-dsa`: which layers have an indexer, as attention.indexer.types (`INDEXER_TYPES_KEY`: a bool a layer, true
  for a "full" layer with its own indexer, false for a "shared" one, which reuses the choice of the full layer before
  it), as the later converter writes it and llama.cpp's `glm-dsa` reads it since GLM-5.2 shares indexers; the
  converter of gguf-py 0.19's day writes none (GLM-5's and GLM-5.1's layers are all full). A model with shared layers
  runs only in a llama.cpp that reads the key: one that does not gives every layer an indexer, and a shared layer has
  none;
- `glm-dsa`: the indexer's proj stays F32 in every `--type` (`gguf_file.F32_MATRICES`), as transformers computes
  `weights_proj` in float32 whatever the model's dtype; the converter writes it in the output type. Both keep the
  norms (the indexer's LayerNorm weight and bias too), the biases and the routers in F32 and write the indexer's
  attn_q_b and attn_k in the output type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatglm_tune.models.glm.config import transformers_form
from chatglm_tune.models.glm.experts import EXPERT_KEY, is_prediction_layer

# transformers class -> llama.cpp architecture
MOE_ARCHES = {"Glm4MoeForCausalLM": "glm4moe", "Glm4MoeLiteForCausalLM": "deepseek2", "GlmMoeDsaForCausalLM": "glm-dsa"}
# the architectures whose attention hyperparameters are latent attention's (`_latent_attention`); every other one
# writes grouped-query attention's (`gguf_file.hyperparameters`)
LATENT_ATTENTION = ("deepseek2", "glm-dsa")
SPARSE_ATTENTION = ("glm-dsa",)  # those with DeepSeek Sparse Attention's indexer (`_sparse_attention`)
# which layers have their own indexer, a bool a layer (true: "full"), as llama.cpp's later gguf-py names it
# (`Keys.Attention.Indexer.TYPES`); gguf-py 0.19 has no name for it
INDEXER_TYPES_KEY = "{arch}.attention.indexer.types"
INDEXER_TYPES = {"full": True, "shared": False}

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
_LATENT_NAMES = (
    ("model.layers.{n}.self_attn.q_proj.weight", "blk.{n}.attn_q.weight"),
    ("model.layers.{n}.self_attn.q_a_proj.weight", "blk.{n}.attn_q_a.weight"),
    ("model.layers.{n}.self_attn.q_a_layernorm.weight", "blk.{n}.attn_q_a_norm.weight"),
    ("model.layers.{n}.self_attn.q_b_proj.weight", "blk.{n}.attn_q_b.weight"),
    ("model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight", "blk.{n}.attn_kv_a_mqa.weight"),
    ("model.layers.{n}.self_attn.kv_a_layernorm.weight", "blk.{n}.attn_kv_a_norm.weight"),
    ("model.layers.{n}.post_attention_layernorm.weight", "blk.{n}.ffn_norm.weight"),
)
_INDEXER_NAMES = (
    ("model.layers.{n}.self_attn.indexer.wq_b.weight", "blk.{n}.indexer.attn_q_b.weight"),
    ("model.layers.{n}.self_attn.indexer.wk.weight", "blk.{n}.indexer.attn_k.weight"),
    ("model.layers.{n}.self_attn.indexer.weights_proj.weight", "blk.{n}.indexer.proj.weight"),
    ("model.layers.{n}.self_attn.indexer.k_norm.{w}", "blk.{n}.indexer.k_norm.{w}"),
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
    "deepseek2": _LATENT_NAMES,
    "glm-dsa": (*_LATENT_NAMES, *_INDEXER_NAMES),
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
    if m and arch in LATENT_ATTENTION:
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
    see the module docstring), latent attention's and the indexer's among them; ValueError for a latent attention
    whose rotary is not interleaved, or an indexer type other than "full" / "shared"."""
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
        _latent_attention(writer, config, arch)
    if arch in SPARSE_ATTENTION:
        _sparse_attention(writer, config)


def _latent_attention(writer, config, arch: str) -> None:
    if not getattr(config, "rope_interleave", True):
        raise ValueError(f"rope_interleave is false: llama.cpp's {arch} rotates adjacent pairs, which is "
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


def _sparse_attention(writer, config) -> None:
    """The indexer's hyperparameters, and which layers have one (`INDEXER_TYPES_KEY`)."""
    import gguf

    writer.add_indexer_head_count(config.index_n_heads)
    writer.add_indexer_key_length(config.index_head_dim)
    writer.add_indexer_top_k(config.index_topk)
    kinds = list(getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers)
    unknown = sorted(set(kinds) - set(INDEXER_TYPES))
    if unknown or len(kinds) != config.num_hidden_layers:
        raise ValueError(f"indexer_types {kinds}: llama.cpp's glm-dsa takes one of {', '.join(INDEXER_TYPES)} a layer "
                         f"({config.num_hidden_layers} layers)")
    writer.add_key_value(INDEXER_TYPES_KEY.format(arch=writer.arch), [INDEXER_TYPES[kind] for kind in kinds],
                         gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
