"""What a full-size GLM-5 / GLM-5.3-Flash holds, counted without a weight: parameters by part, weights in bf16 /
INT8 / INT4, and the trainable parameters of P-tuning v2 and LoRA (bench/scale/scale_cards.py's accounting; the
versions are bench/common/accounted_versions.py's rows).

Parameters: transformers' own class of the release, built on the meta device (no memory), its state_dict's tensors
(persistent buffers included: the routers' score-correction biases) summed by part; `formula_parts` gives the same
sums from the config's numbers, so the table says how each part is made and the two are checked against each other.

Weights: bf16 is 2 bytes an element, but for the tensors transformers keeps in float32 when it loads in bf16
(the class's `_keep_in_fp32_modules_strict`: the routers' weights and biases, and GLM-5.3-Flash's KDA conv, dt_bias,
A_log and the hyper-connections' bases and scales). INT8 / INT4 replace, in the official per-row layout the toolkit
writes (int8 `[out, in]` or packed `[out, in/2]`, one fp16 scale a row), the Linears of `AccountedVersion` rows'
QUANTIZED set in the attention, linear-attention, dense-MLP and shared-expert parts, and the routed experts' 3D weights
(a row per expert and output); the rest stays as in bf16, for these reasons:
- norms: vectors, no product to speed up;
- routers: their scores pick 8 experts of 256 / 288, a discrete choice a rounding error can flip (transformers keeps
  them in float32);
- the indexer (its query / key projections, key norm, head weights, GLM-5.3-Flash's pool gate): its scores pick the
  2048 tokens each query attends to, the same kind of choice; it runs without gradients, and GLM-5's transformers
  class keeps its head weights in float32 under fp16;
- KDA's gates (forget gate `f_a_proj` / `f_b_proj`, `dt_bias`, `A_log`; the input gate `b_proj`; the output gate
  `g_a_proj` / `g_b_proj`) and its causal conv: the forget gate is a decay exponentiated and multiplied along the
  whole sequence into the recurrent state, so an error in it compounds instead of staying in one token; the low-rank
  gates are 128 wide (with the conv, dt_bias and A_log under 3% of a KDA layer's attention weights), and
  transformers keeps the conv, dt_bias and A_log in float32;
- the hyper-connections (`fn` [24, 4 * hidden], `base`, `scale`): they make the mixing weights through sigmoids,
  a softmax and Sinkhorn iterations computed in float32, and are 0.8 M a layer;
- the embedding and head stay bf16 as the toolkit loads them (`quantize_embedding` makes each an INT8 copy).

P-tuning v2 (pre_seq_len P, no projection; its prefix encoder is an Embedding(P, W)): a sparse-attention layer takes
each head's prefix keys and values as GLM-4.7-Flash's latent attention does (the toolkit's `prefix.cache_entry`:
heads x (qk_nope + qk_rope + v) a position and layer); a KDA layer P virtual keys and values a head (heads x (Dk +
Dv)), from which its initial recurrent state is made. LoRA (rank r, peft): r x (in + out) a targeted Linear, and on
the routed experts (peft's `target_parameters`) an adapter per expert, r x E x (in + out) a 3D weight.
"""

from __future__ import annotations

import math
import re

import torch

from bench.common.accounted_versions import QUANTIZED, AccountedVersion, text_config, transformers_config

PARTS = ("embedding", "attention", "indexer", "linear attention", "linear-attention gates", "routed experts",
         "shared experts", "routers", "dense MLP", "hyper-connections", "norms", "head")
QUANTIZED_PARTS = ("attention", "linear attention", "dense MLP", "shared experts")
KDA_GATES = ("forget_gate", "b_proj", "g_a_proj", "g_b_proj", "conv1d")  # KDA's modules that are not q / k / v / o
LAYER = re.compile(r"layers\.(\d+)\.")
GB = 1e9


def meta_model(version: AccountedVersion, cfg: dict):
    """transformers' `model_class` for text config `cfg`, on the meta device (no memory)."""
    import transformers

    config = transformers_config(version, cfg)
    with torch.device("meta"):
        return getattr(transformers, version.model_class)(config)


def tensors(version: AccountedVersion, cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(key, shape, kept in float32) of every tensor of the text model's state_dict (`skipped` prefixes left out)."""
    model = meta_model(version, cfg)
    fp32 = tuple(model._keep_in_fp32_modules_strict or ())
    return [(key, tuple(t.shape), any(name in key for name in fp32)) for key, t in model.state_dict().items()
            if not key.startswith(version.skipped)]


def part_of(key: str, layer_types: list[str] | None) -> str:
    """Which of PARTS a state_dict key belongs to (`layer_types`: the config's, telling KDA layers apart)."""
    if "embed_tokens." in key:
        return "embedding"
    if key.startswith("lm_head."):
        return "head"
    for fragment, part in ((".mlp.experts.", "routed experts"), (".mlp.shared_experts.", "shared experts"),
                           (".mlp.gate.", "routers"), (".mlp.", "dense MLP"), ("_hc.", "hyper-connections"),
                           (".self_attn.indexer.", "indexer")):
        if fragment in key:
            return part
    if key.endswith("norm.weight"):
        return "norms"
    if any(f".self_attn.{name}." in key for name in KDA_GATES):
        return "linear-attention gates"
    layer = LAYER.search(key)
    if layer and layer_types and layer_types[int(layer.group(1))] == "linear_attention":
        return "linear attention"
    return "attention"


def layer_kinds(config) -> list[tuple[bool, bool]]:
    """(KDA, routed experts) of each layer of transformers' text config object."""
    types = getattr(config, "layer_types", None) or ["indexed_attention"] * config.num_hidden_layers
    return [(t == "linear_attention", m == "sparse") for t, m in zip(types, config.mlp_layer_types)]


def parts(version: AccountedVersion, cfg: dict) -> dict[str, int]:
    """{part: elements} of the meta-device model's tensors."""
    types = getattr(text_config(version, cfg), "layer_types", None)
    out = dict.fromkeys(PARTS, 0)
    for key, shape, _ in tensors(version, cfg):
        out[part_of(key, types)] += math.prod(shape)
    return out


def formula_parts(version: AccountedVersion, cfg: dict) -> dict[str, int]:
    """{part: elements} from the config's numbers alone (what `parts` counts on the built model)."""
    c = text_config(version, cfg)
    h, heads, q, kv = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    bias = bool(c.attention_bias)
    out = dict.fromkeys(PARTS, 0)
    out["embedding"] = out["head"] = c.vocab_size * h
    out["norms"] = h  # the final norm
    kpool = getattr(c, "index_kpool", None)
    for kda, routed in layer_kinds(c):
        out["norms"] += 2 * h
        if kda:
            width, d = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim
            out["linear attention"] += 4 * h * width
            out["linear-attention gates"] += (2 * (h * d + d * width) + width + c.linear_num_heads
                                              + h * c.linear_num_heads + 3 * width * c.linear_conv_kernel_dim)
            out["norms"] += d  # the gated output norm
        else:
            out["attention"] += (h * q + q * heads * (nope + rope) + h * (kv + rope) + kv * heads * (nope + v)
                                 + heads * v * h + bias * (q + kv + rope + h))
            out["norms"] += q + kv
            idx = c.index_head_dim
            out["indexer"] += q * c.index_n_heads * idx + h * idx + 2 * idx + h * c.index_n_heads
            out["indexer"] += (kpool * idx + idx * h) if kpool else 0
        if routed:
            out["routed experts"] += 3 * c.n_routed_experts * h * c.moe_intermediate_size
            out["shared experts"] += 3 * h * c.moe_intermediate_size * c.n_shared_experts
            out["routers"] += c.n_routed_experts * (h + 1)
        else:
            out["dense MLP"] += 3 * h * c.intermediate_size
        streams = getattr(c, "hc_mult", 0)
        if streams:
            mix = (2 + streams) * streams
            out["hyper-connections"] += 2 * (mix * streams * h + mix + 3)
    return out


def active_elements(version: AccountedVersion, cfg: dict, counted: dict[str, int]) -> int:
    """Elements a token runs through: all but the routed experts it does not choose (the input embedding counted)."""
    c = text_config(version, cfg)
    return sum(counted.values()) - counted["routed experts"] * (1 - c.num_experts_per_tok / c.n_routed_experts)


def quantized(key: str, part: str) -> bool:
    """Whether INT8 / INT4 replace this tensor (the module docstring says which do and why)."""
    if part == "routed experts":
        return True
    leaf = key.rsplit(".", 2)[-2] if key.endswith(".weight") else None
    return part in QUANTIZED_PARTS and leaf in QUANTIZED


def tensor_bytes(shape: tuple[int, ...], fp32: bool, bits: int) -> int:
    """Bytes of one tensor: float (bf16, or float32 where kept) with `bits` 0; else the official per-row INT8 / INT4
    layout (rows = every dimension but the last, an fp16 scale each)."""
    n = math.prod(shape)
    if not bits:
        return n * (4 if fp32 else 2)
    rows, cols = n // shape[-1], shape[-1]
    return rows * (cols if bits == 8 else -(-cols // 2)) + 2 * rows


def weight_bytes(version: AccountedVersion, cfg: dict, bits: int, int8_embedding: bool = False,
                 table=None) -> dict[str, int]:
    """{part: bytes} with INT`bits` (0: bf16) where `quantized` says, the embedding and head INT8 rows with
    `int8_embedding`."""
    types = getattr(text_config(version, cfg), "layer_types", None)
    out = dict.fromkeys(PARTS, 0)
    for key, shape, fp32 in table or tensors(version, cfg):
        part = part_of(key, types)
        q = bits if bits and quantized(key, part) else 0
        if int8_embedding and part in ("embedding", "head"):
            q = 8
        out[part] += tensor_bytes(shape, fp32, q)
    return out


def ptuning_elements(version: AccountedVersion, cfg: dict, pre_seq_len: int) -> dict[str, int]:
    """{"sparse attention", "linear attention"}: the prefix encoder's elements for each kind of layer (the module
    docstring)."""
    from chatglm_tune.models.glm.prefix import cache_entry

    c = text_config(version, cfg)
    heads, key, value = cache_entry(c)
    kinds = layer_kinds(c)
    kda = sum(k for k, _ in kinds)
    linear = kda * c.linear_num_heads * 2 * c.linear_head_dim if kda else 0
    return {"sparse attention": pre_seq_len * (len(kinds) - kda) * heads * (key + value),
            "linear attention": pre_seq_len * linear}


def lora_elements(version: AccountedVersion, cfg: dict, targets: tuple[str, ...], r: int, table=None) -> int:
    """LoRA's trainable elements on `targets` (leaf names of Linears, or `experts.<weight>` for the routed experts'
    3D weights), rank `r`."""
    total = 0
    for key, shape, _ in table or tensors(version, cfg):
        if len(shape) == 3 and any(key.endswith("mlp." + t) for t in targets if t.startswith("experts.")):
            total += r * shape[0] * (shape[1] + shape[2])
        elif len(shape) == 2 and key.endswith(".weight") and key.rsplit(".", 2)[-2] in targets:
            total += r * (shape[0] + shape[1])
    return total
