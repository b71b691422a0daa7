"""The routed experts of GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash, GLM-5 and GLM-5.3-Flash: their released layout, one Linear
each, against transformers' 3D weights.

Released checkpoints hold expert e of layer n as `model.layers.n.mlp.experts.e.{gate,up,down}_proj.weight`
([I, H], [I, H], [H, I]; GLM-5.3-Flash's under `model.language_model.layers.n`); transformers' classes hold them fused:
`mlp.experts.gate_up_proj` [E, 2I, H] (the gate's rows first) and `mlp.experts.down_proj` [E, H, I]. Loading fills
the 3D weights slice by slice as the files are read (`ExpertAssembler`: no per-expert copy is kept), saving splits
them back (`released_experts`). An INT model holds its experts per expert already (`quant.experts`), under the
released keys: a checkpoint's fused weights are split into those (`released_experts`) and quantized as they are read.

The multi-token-prediction layer the releases ship after the last layer (`num_nextn_predict_layers`; GLM-5.3-Flash's
config has no such field, and transformers skips the layer past its last, `shared_head` included) is not part of
transformers' classes: it is not loaded (`is_prediction_layer`), as transformers itself skips it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from chatglm_tune.runtime.checkpoint import CheckpointError

_LAYERS = r"model\.(?:language_model\.)?layers"  # a trunk's layers: `model.layers`, GLM-5.3-Flash's in its text model
EXPERT_KEY = re.compile(rf"^({_LAYERS}\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_KEY = re.compile(rf"^{_LAYERS}\.(\d+)\.")


def is_prediction_layer(key: str, config) -> bool:
    """Whether `key` is a weight of a multi-token-prediction layer (layer index past the model's last layer, where the
    config says it has one: `num_nextn_predict_layers`, or a `prediction_layer_past_last` class of config)."""
    match = _LAYER_KEY.match(key)
    shipped = getattr(config, "num_nextn_predict_layers", 0) or getattr(config, "prediction_layer_past_last", False)
    return bool(match and shipped and int(match[1]) >= config.num_hidden_layers)


def released_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every fused expert weight split into the released per-expert keys (views, no copies)."""
    out = {}
    for key, tensor in state.items():
        owner, _, leaf = key.rpartition(".")
        if not (owner.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj") and tensor.dim() == 3):
            out[key] = tensor
            continue
        for e in range(tensor.shape[0]):
            if leaf == "down_proj":
                out[f"{owner}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{owner}.{e}.gate_proj.weight"], out[f"{owner}.{e}.up_proj.weight"] = gate, up
    return out


class ExpertAssembler:
    """Fills a model's fused expert weights (still on the meta device) from released per-expert tensors, in the
    compute dtype; `expected` (name -> meta parameter) loses each fused weight once all its slices are in."""

    def __init__(self, model: nn.Module, expected: dict, dtype: torch.dtype):
        self.model, self.expected, self.dtype = model, expected, dtype
        self.filled: dict[str, set] = {}  # fused name -> (expert, part) slices written

    def take(self, key: str, tensor: torch.Tensor, file) -> bool:
        """Write `key`'s tensor into its fused weight; False for a key that is no released expert weight of this
        model (a model whose experts are held per expert takes them as they are)."""
        match = EXPERT_KEY.match(key)
        if match is None:
            return False
        owner, expert, part = match[1], int(match[2]), match[3]
        name = f"{owner}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        if name not in self.expected and name not in self.filled:
            return False
        module = self.model.get_submodule(owner)
        target = getattr(module, name.rpartition(".")[2])
        if target.is_meta:
            target = nn.Parameter(torch.empty(target.shape, dtype=self.dtype), requires_grad=target.requires_grad)
            setattr(module, name.rpartition(".")[2], target)
            self.filled[name] = set()
        rows = target.shape[1] // 2
        shape = [*target.shape[1:]] if part == "down" else [rows, target.shape[2]]
        if expert >= target.shape[0] or list(tensor.shape) != shape:
            raise CheckpointError(f"{file}: {key} has shape {list(tensor.shape)}; {name} holds {target.shape[0]} "
                                  f"experts of {shape}: does config.json match these weights?")
        where = target.data[expert] if part == "down" else target.data[expert, :rows] if part == "gate" \
            else target.data[expert, rows:]
        where.copy_(tensor)
        slices = self.filled[name]
        slices.add((expert, part))
        if len(slices) == target.shape[0] * (1 if part == "down" else 2):
            self.expected.pop(name, None)
        return True
