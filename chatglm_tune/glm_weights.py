"""Official ChatGLM2/3 / GLM-4 checkpoint keys <-> transformers `GlmForCausalLM` keys.

Official layout (../shared/golden/README-glm.md; NH heads, G = multi_query_group_num, D = kv_channels):
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
QKV_PARTS = ("model.layers.{n}.self_attn.q_proj", "model.layers.{n}.self_attn.k_proj", "model.layers.{n}.self_attn.v_proj")


def _pattern(module: str) -> re.Pattern:
    """`a.b.{n}.c` -> a regex matching `a.b.<n>.c.<tensor name>` with groups n and name."""
    return re.compile("^" + re.escape(module).replace(re.escape("{n}"), r"(?P<n>\d+)") + r"\.(?P<name>.+)$")


_TO_HF = [(_pattern(o), h) for o, h in RENAMES]
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
    for pattern, target in _TO_HF:
        m = pattern.match(key)
        if m:
            return [(target.format(n=m.groupdict().get("n")) + "." + m["name"], tensor)]
    return None


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
            raise ValueError(f"layer {n}: {name} of q/k/v must be saved together to fuse query_key_value; got only {have}")
        out[QKV.format(n=n) + "." + name] = fuse_rows([parts[0], parts[1], parts[2]])
    return out


def _official_name(key: str) -> str:
    for pattern, target in _TO_OFFICIAL:
        m = pattern.match(key)
        if m:
            return target.format(n=m.groupdict().get("n")) + "." + m["name"]
    raise ValueError(f"{key} has no official ChatGLM name")
