"""GLM-5.3-Flash's weights as released, against the module names of transformers' `glm5_next` classes.

The released checkpoint holds the text model under `model.language_model.*` (and `lm_head.weight`), the vision encoder
under `model.visual.*` (not loaded: the toolkit runs the text model), a multi-token-prediction layer past the last
(`experts.is_prediction_layer`, as transformers skips it), and in each layer names that transformers renames as it
loads (its conversion mapping for `glm5_next`) and writes back as it saves:
- a KDA layer's forget gate under its attention: `self_attn.f_a_proj.weight`, `self_attn.f_b_proj.weight`,
  `self_attn.dt_bias`, `self_attn.A_log` (transformers: `self_attn.forget_gate.*`);
- its short convolution as three: `self_attn.q_conv1d.weight`, `k_conv1d`, `v_conv1d`, each [C, 1, K] (transformers:
  one `self_attn.conv1d.weight` [3C, 1, K], q's channels, then k's, then v's);
- each layer's hyper-connections as `hc_attn_fn` / `hc_attn_base` / `hc_attn_scale` and `hc_ffn_*` (transformers:
  `attn_hc.fn`, ..., `ffn_hc.*`);
- the routed experts one by one (`mlp.experts.E.{gate,up,down}_proj.weight`: `experts.py`).
`released_layout` writes a state dict so (every version released in transformers' form: the experts one by one, and
these names, which no other version has); `transformers_name` and `ConvAssembler` read it back.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from chatglm_tune.models.glm.experts import released_experts
from chatglm_tune.runtime.checkpoint import CheckpointError

VISION_KEYS = "model.visual."  # the released vision encoder's keys
# (transformers' name, the released one) of the renamed parts of a key
_RENAMES = ((".self_attn.forget_gate.", ".self_attn."), (".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_"))
_GATE_PARTS = ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log")  # what the released attention holds of its forget gate
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_CONV_PARTS = "qkv"


def released_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (transformers' names) as a version released in transformers' form stores it: the routed experts one by
    one (`experts.released_experts`) and GLM-5.3-Flash's released names (the module docstring); views, no copies."""
    out = {}
    for key, tensor in released_experts(state).items():
        if key.endswith(".self_attn.conv1d.weight"):
            owner = key.removesuffix(".conv1d.weight")
            for part, rows in zip(_CONV_PARTS, tensor.chunk(3, dim=0)):
                out[f"{owner}.{part}_conv1d.weight"] = rows
            continue
        for ours, theirs in _RENAMES:
            key = key.replace(ours, theirs)
        out[key] = tensor
    return out


def transformers_name(key: str) -> str:
    """The module name of a released key (the module docstring's renames undone; the convolution's three parts are
    `ConvAssembler`'s); any other key as it is."""
    for ours, theirs in _RENAMES[1:]:
        key = key.replace(theirs, ours)
    owner, _, leaf = key.rpartition(".self_attn.")
    if owner and leaf.startswith(_GATE_PARTS):
        key = f"{owner}.self_attn.forget_gate.{leaf}"
    return key


class ConvAssembler:
    """Fills a KDA layer's `conv1d.weight` (still on the meta device) from the released q / k / v parts, in the
    compute dtype; `expected` (name -> meta parameter) loses it once its three parts are in."""

    def __init__(self, model: nn.Module, expected: dict, dtype: torch.dtype):
        self.model, self.expected, self.dtype = model, expected, dtype
        self.filled: dict[str, set] = {}  # conv1d weight -> the parts written

    def take(self, key: str, tensor: torch.Tensor, file) -> bool:
        """Write `key`'s tensor into its layer's convolution; False for a key that is no released part of one."""
        match = _CONV.match(key)
        if match is None:
            return False
        name = f"{match[1]}.conv1d.weight"
        if name not in self.expected and name not in self.filled:
            raise CheckpointError(f"{file}: {key} gives {name} twice, or the model has no such convolution")
        conv = self.model.get_submodule(f"{match[1]}.conv1d")
        if conv.weight.is_meta:
            conv.weight = nn.Parameter(torch.empty(conv.weight.shape, dtype=self.dtype),
                                       requires_grad=conv.weight.requires_grad)
            self.filled[name] = set()
        channels = conv.weight.shape[0] // 3
        if list(tensor.shape) != [channels, *conv.weight.shape[1:]]:
            raise CheckpointError(f"{file}: {key} has shape {list(tensor.shape)}; {name} takes three of "
                                  f"{[channels, *conv.weight.shape[1:]]}: does config.json match these weights?")
        start = _CONV_PARTS.index(match[2]) * channels
        conv.weight.data[start:start + channels].copy_(tensor)
        self.filled[name].add(match[2])
        if len(self.filled[name]) == len(_CONV_PARTS):
            self.expected.pop(name, None)
        return True
