"""Official ChatGLM2/3 / GLM-4 checkpoint keys <-> transformers `GlmForCausalLM` keys.

Official layout (the official modeling code's names; NH heads, G = multi_query_group_num, D = kv_channels):
`transformer.embedding.word_embeddings`, `transformer.encoder.layers.N.{input_layernorm,
self_attention.query_key_value, self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h,
mlp.dense_4h_to_h}`, `transformer.encoder.final_layernorm`, `transformer.output_layer` (untied),
`transformer.prefix_encoder.*` (P-tuning v2), and the unused buffer `transformer.rotary_pos_emb.inv_freq`.

Every Linear maps one to one except `query_key_value`, whose rows are `q (NH*D) | k (G*D) | v (G*D)`
and become `q_proj` / `k_proj` / `v_proj`. The split and the fusion work on rows whatever the tensor
is: `weight` [out, in], `bias` [out], and equally a quantized `weight` [out, in/2] with its
`weight_scale` [out] or [out, groups], so a key's last part (`weight`, `bias`, `weight_scale`, ...) is
carried over unchanged. `dense_h_to_4h` rows are `gate | up`, the very layout of transformers'
fused `gate_up_proj` (`chunk(2)`: gate first), so it maps as is.

LoRA adapters trained with peft on the official code (ChatGLM3 finetune_demo, GLM-4 finetune.py,
LLaMA-Factory) use the same names: `target_modules` such as `["query_key_value"]` (or also `dense`,
`dense_h_to_4h`, `dense_4h_to_h`) and keys `base_model.model.<official module>.lora_A.weight` [r, in] /
`lora_B.weight` [out, r]. They map by the same table (`adapter_targets`, `adapter_to_transformers`):
on the fused `query_key_value`, `delta = scaling * B @ A` has the rows of the weight, so
`B = B_q | B_k | B_v` is split by rows like it while `A` (the input side) is shared, a copy for each of
q/k/v; with r and lora_alpha unchanged, the q/k/v adapters add exactly the fused one's delta.

`gguf_name`: llama.cpp's name in a GGUF file of a tensor under either layout's keys (`GGUF_NAMES`,
`GGUF_TRANSFORMERS_NAMES`, the latter with GLM-4-0414's two extra norms).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

IGNORED = re.compile(r"^transformer\.rotary_pos_emb\.inv_freq$")  # recomputed, and never includes rope_ratio
OFFICIAL_PREFIX_ENCODER = "transformer.prefix_encoder."
PREFIX_ENCODER = "prefix_encoder."

# (official module, transformers module); {n} = layer index. The tensor name after the module is kept.
RENAMES = (
    ("transformer.embedding.word_embeddings", "model.embed_tokens"),
    ("transformer.output_layer", "lm_head"),
    ("transformer.encoder.final_layernorm", "model.norm"),
    ("transformer.encoder.layers.{n}.input_layernorm", "model.layers.{n}.input_layernorm"),
    ("transformer.encoder.layers.{n}.post_attention_layernorm", "model.layers.{n}.post_attention_layernorm"),
    ("transformer.encoder.layers.{n}.self_attention.dense", "model.layers.{n}.self_attn.o_proj"),
    ("transformer.encoder.layers.{n}.mlp.dense_h_to_4h", "model.layers.{n}.mlp.gate_up_proj"),
    ("transformer.encoder.layers.{n}.mlp.dense_4h_to_h", "model.layers.{n}.mlp.down_proj"),
    ("transformer.prefix_encoder", "prefix_encoder"),
)
QKV = "transformer.encoder.layers.{n}.self_attention.query_key_value"
QKV_PARTS = ("model.layers.{n}.self_attn.q_proj", "model.layers.{n}.self_attn.k_proj",
             "model.layers.{n}.self_attn.v_proj")


# official module -> llama.cpp's name in a GGUF file (its `chatglm` architecture); q|k|v stay fused as
# `attn_qkv`, and `ffn_up` holds dense_h_to_4h's gate|up rows (llama.cpp's SwiGLU gates with the first half).
# A checkpoint in transformers' own form (GLM-4-0414's `Glm4ForCausalLM`, GLM-Edge's and glm-4-9b-chat-hf's
# `GlmForCausalLM`) is named by GGUF_TRANSFORMERS_NAMES: q, k, v apart (`attn_q|k|v`, which llama.cpp's
# `chatglm` and `glm4` architectures load as they load `attn_qkv`), `gate_up_proj` as `ffn_up`, and GLM-4-0414's
# norms after attention and after the MLP as `post_attention_norm` and `post_ffw_norm` (llama.cpp's `glm4`).
GGUF_NAMES = (
    ("transformer.embedding.word_embeddings", "token_embd"),
    ("transformer.encoder.layers.{n}.input_layernorm", "blk.{n}.attn_norm"),
    (QKV, "blk.{n}.attn_qkv"),
    ("transformer.encoder.layers.{n}.self_attention.dense", "blk.{n}.attn_output"),
    ("transformer.encoder.layers.{n}.post_attention_layernorm", "blk.{n}.ffn_norm"),
    ("transformer.encoder.layers.{n}.mlp.dense_h_to_4h", "blk.{n}.ffn_up"),
    ("transformer.encoder.layers.{n}.mlp.dense_4h_to_h", "blk.{n}.ffn_down"),
    ("transformer.encoder.final_layernorm", "output_norm"),
    ("transformer.output_layer", "output"),
)
GGUF_TRANSFORMERS_NAMES = (
    ("model.embed_tokens", "token_embd"),
    ("model.layers.{n}.input_layernorm", "blk.{n}.attn_norm"),
    ("model.layers.{n}.self_attn.q_proj", "blk.{n}.attn_q"),
    ("model.layers.{n}.self_attn.k_proj", "blk.{n}.attn_k"),
    ("model.layers.{n}.self_attn.v_proj", "blk.{n}.attn_v"),
    ("model.layers.{n}.self_attn.o_proj", "blk.{n}.attn_output"),
    ("model.layers.{n}.post_self_attn_layernorm", "blk.{n}.post_attention_norm"),
    ("model.layers.{n}.post_attention_layernorm", "blk.{n}.ffn_norm"),
    ("model.layers.{n}.mlp.gate_up_proj", "blk.{n}.ffn_up"),
    ("model.layers.{n}.mlp.down_proj", "blk.{n}.ffn_down"),
    ("model.layers.{n}.post_mlp_layernorm", "blk.{n}.post_ffw_norm"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
)


def _pattern(module: str) -> re.Pattern:
    """`a.b.{n}.c` -> a regex matching `a.b.<n>.c.<tensor name>` with groups n and name."""
    return re.compile("^" + re.escape(module).replace(re.escape("{n}"), r"(?P<n>\d+)") + r"\.(?P<name>.+)$")


_TO_HF = [(_pattern(o), h) for o, h in RENAMES]
_TO_GGUF = [(_pattern(o), g) for o, g in (*GGUF_NAMES, *GGUF_TRANSFORMERS_NAMES)]
_TO_OFFICIAL = [(_pattern(h), o) for o, h in RENAMES]
_QKV_OFFICIAL = _pattern(QKV)
_QKV_HF = [_pattern(p) for p in QKV_PARTS]


def qkv_rows(config) -> tuple[int, int, int]:
    """Rows of q, k, v inside the official `query_key_value` (NH*D, G*D, G*D) for a `GlmConfig`."""
    d = config.head_dim
    return config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d


def split_rows(tensor: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
    """Views of `tensor` cut along dim 0 into pieces of `rows` rows (which must add up to its rows)."""
    if tensor.dim() == 0 or tensor.shape[0] != sum(rows):
        raise ValueError(f"cannot split a tensor of shape {list(tensor.shape)} into rows {list(rows)}")
    return list(torch.split(tensor, list(rows), dim=0))


def fuse_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inverse of `split_rows`: `parts` stacked along dim 0 (trailing shapes must agree)."""
    return torch.cat(list(parts), dim=0)


def to_transformers(key: str, tensor: torch.Tensor, rows: Sequence[int]) -> list[tuple[str, torch.Tensor]] | None:
    """The transformers (key, tensor) pairs for one official tensor; [] if ignored, None if unknown.

    `rows`: `qkv_rows(config)`. Split tensors are views (no copy).
    """
    if IGNORED.match(key):
        return []
    m = _QKV_OFFICIAL.match(key)
    if m:
        names = [p.format(n=m["n"]) + "." + m["name"] for p in QKV_PARTS]
        return list(zip(names, split_rows(tensor, rows)))
    name = _renamed(key, _TO_HF)
    return None if name is None else [(name, tensor)]


def to_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official keys for a transformers state dict, q/k/v re-fused (in the order q, k, v) by rows.

    Raises ValueError for a key with no official name, or a q/k/v part whose siblings are missing.
    """
    out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, tensor name) -> {0: q, 1: k, 2: v}
    for key, tensor in state.items():
        for part, pattern in enumerate(_QKV_HF):
            m = pattern.match(key)
            if m:
                pending.setdefault((m["n"], m["name"]), {})[part] = tensor
                break
        else:
            out[_official_name(key)] = tensor
    for (n, name), parts in pending.items():
        if len(parts) != 3:
            have = ", ".join(QKV_PARTS[i].format(n=n) for i in sorted(parts))
            raise ValueError(f"layer {n}: {name} of q/k/v must be saved together to fuse query_key_value; got only "
                             f"{have}")
        out[QKV.format(n=n) + "." + name] = fuse_rows([parts[0], parts[1], parts[2]])
    return out


def gguf_name(key: str) -> str:
    """llama.cpp's name of an official tensor (`GGUF_NAMES`), e.g. `blk.3.attn_qkv.bias`, or of a tensor under
    transformers' keys (`GGUF_TRANSFORMERS_NAMES`), e.g. `blk.3.post_ffw_norm.weight`; ValueError if none."""
    name = _renamed(key, _TO_GGUF)
    if name is None:
        raise ValueError(f"{key} has no name in llama.cpp's chatglm / glm4 architectures")
    return name


def _official_name(key: str) -> str:
    name = _renamed(key, _TO_OFFICIAL)
    if name is None:
        raise ValueError(f"{key} has no official ChatGLM name")
    return name


def _renamed(key: str, table) -> str | None:
    """`key` under the first (pattern, target module) of `table` that matches it, its tensor name kept."""
    for pattern, target in table:
        m = pattern.match(key)
        if m:
            return target.format(n=m.groupdict().get("n")) + "." + m["name"]
    return None


# ----------------------------------------------------------------------------------------------
# peft LoRA adapters of the official models

PEFT_PREFIX = "base_model.model."  # before the model's own keys in a saved peft adapter
_OFFICIAL_ADAPTER_KEY = re.compile(r"^" + re.escape(PEFT_PREFIX) + r"transformer\.(embedding|encoder|output_layer)\.")
SHARED_INPUT = "lora_A."  # the tensors of a fused query_key_value adapter that q/k/v share (all others: split by rows)


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


# official `target_modules` name -> transformers names (the Linears and the embedding of RENAMES, and q/k/v)
ADAPTER_TARGETS = {
    _leaf(QKV): tuple(_leaf(p) for p in QKV_PARTS),
    **{_leaf(o): (_leaf(h),) for o, h in RENAMES if not o.endswith(("layernorm", "prefix_encoder"))},
}


def is_official_adapter(keys) -> bool:
    """Whether the keys of a saved peft adapter are those of the official ChatGLM2/3 / GLM-4 modules."""
    return any(_OFFICIAL_ADAPTER_KEY.match(k) for k in keys)


def adapter_targets(targets) -> list[str]:
    """The transformers `target_modules` for an official adapter's (a list of official module names).

    Raises ValueError for a regex (a string) or a name with no transformers counterpart.
    """
    if isinstance(targets, str):
        raise ValueError(f"target_modules {targets!r} is a pattern; only a list of official module names "
                         f"({', '.join(ADAPTER_TARGETS)}) can be mapped")
    unknown = sorted(t for t in targets if t not in ADAPTER_TARGETS)
    if unknown:
        raise ValueError(f"target_modules {', '.join(unknown)}: not official ChatGLM2/3 / GLM-4 modules that LoRA "
                         f"can target ({', '.join(ADAPTER_TARGETS)})")
    return sorted({name for t in targets for name in ADAPTER_TARGETS[t]})


def adapter_to_transformers(key: str, tensor: torch.Tensor,
                            rows: Sequence[int]) -> list[tuple[str, torch.Tensor]] | None:
    """The transformers adapter (key, tensor) pairs for one tensor of an official adapter; None if unknown.

    `key`: `base_model.model.<official key>`, e.g. `...self_attention.query_key_value.lora_B.weight`.
    `rows`: `qkv_rows(config)`. A `query_key_value` `lora_A` [r, in] is copied to each of q/k/v; its
    `lora_B` [q+k+v, r] (and a `lora_B.bias` or a saved base bias) is split by rows as `to_transformers`
    splits the weight (ValueError when its rows do not add up); other modules are renamed.
    """
    if not key.startswith(PEFT_PREFIX):
        return None
    inner = key[len(PEFT_PREFIX):]
    m = _QKV_OFFICIAL.match(inner)
    if m and m["name"].startswith(SHARED_INPUT):
        return [(PEFT_PREFIX + p.format(n=m["n"]) + "." + m["name"], tensor.clone()) for p in QKV_PARTS]
    pairs = to_transformers(inner, tensor, rows)
    return None if pairs is None else [(PEFT_PREFIX + name, part) for name, part in pairs]
