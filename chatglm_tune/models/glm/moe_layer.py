"""The mixture-of-experts layers of GLM-4.5 / 4.6 / 4.7 (`Glm4MoeMoE`), GLM-4.7-Flash (`Glm4MoeLiteMoE`) and GLM-5
(`GlmMoeDsaMoE`) with decode steps in two calls of the integer-dot kernel: over INT8 / INT4 experts
(`quant.experts.QuantizedExperts`) a token's chosen experts and the layer's shared expert (as an expert of weight 1,
added last as transformers adds it) run their gate and up projections in one grouped call and their down projections
in another, the same products bit for bit; the router's arithmetic is transformers' own (`route`). Where the layer's
experts and router allow it (SiLU, one group of experts: every GLM release) the whole step, router included, runs as
one C++ call (`QuantizedExperts.decoder`: the same operations, without ~40 Python-level ones a layer). Prefill,
training and float experts run transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

from chatglm_tune.quant.experts import QuantizedExperts
from chatglm_tune.quant.modules import layouts_epoch, watch_modules


class _GroupedDecode:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        x = hidden_states.view(-1, hidden_states.shape[-1])
        decoder = self._decoder(x)
        if decoder is not None:
            return decoder.step(x).view(hidden_states.shape)
        if isinstance(experts, QuantizedExperts) and experts.grouped_decode_runs(x) and self._shared_joins():
            weights, index = route(self.gate, x)
            out = experts.decode_step(x, index[0], weights[0], self.shared_experts)
            if out is not None:
                return out.view(hidden_states.shape)
        return super().forward(hidden_states)

    def _decoder(self, x: torch.Tensor):
        """The C++ decode step (`QuantizedExperts.decoder`) where it runs these rows of x, made once and kept while no
        layout or submodule changed (`layouts_epoch`); a stale one is dropped at the next forward of any kind, so the
        layouts it holds are never kept beside rebuilt ones."""
        held = self.__dict__.get("_held_decoder")
        if held is not None and held[0] != layouts_epoch():
            held = self.__dict__["_held_decoder"] = None
        experts = self.experts
        if not (isinstance(experts, QuantizedExperts) and experts.grouped_decode_runs(x)):
            return None
        if held is None:
            watch_modules()
            joins = _one_group(self.gate) and self._shared_joins()
            decoder = experts.decoder(self.gate, self.shared_experts) if joins else None
            held = self.__dict__["_held_decoder"] = (layouts_epoch(), decoder)
        return held[1]

    def _apply(self, fn, recurse=True):
        self.__dict__["_held_decoder"] = None  # it holds the tensors as they were
        return super()._apply(fn, recurse)

    def _shared_joins(self) -> bool:
        """Whether the shared expert can run in the routed experts' grouped calls (asked once per pair of modules)."""
        key = (id(self.experts), id(self.shared_experts))
        held = getattr(self, "_joins", None)
        if held is None or held[0] != key:
            held = (key, self.experts.takes_as_expert(self.shared_experts))
            self._joins = held
        return held[1]


def route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, index) of the experts transformers' router (`Glm4MoeTopkRouter`, `Glm4MoeLiteTopkRouter`) chooses for
    the rows of x: its own arithmetic, in the same order. With one group of experts (every GLM release: n_group 1) its
    group selection keeps every expert, and is skipped (11 of its 20 operations a token)."""
    if not _one_group(gate):
        _, weights, index = gate(x)
        return weights, index
    scores = F.linear(x.type(torch.float32), gate.weight.type(torch.float32)).sigmoid()
    index = torch.topk(scores + gate.e_score_correction_bias, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if gate.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * gate.routed_scaling_factor, index


def _one_group(gate: nn.Module) -> bool:
    """Whether the router chooses among all its experts as one group (its group selection keeps every expert)."""
    return gate.num_group == 1 and gate.topk_group == 1


class MoeLayer(_GroupedDecode, Glm4MoeMoE):
    """GLM-4.5 / 4.6 / 4.7's layer with grouped decode steps (the module docstring)."""


class MoeLiteLayer(_GroupedDecode, Glm4MoeLiteMoE):
    """GLM-4.7-Flash's layer with grouped decode steps (the module docstring)."""


class MoeDsaLayer(_GroupedDecode, GlmMoeDsaMoE):
    """GLM-5's layer with grouped decode steps (the module docstring)."""


_GROUPED = {Glm4MoeMoE: MoeLayer, Glm4MoeLiteMoE: MoeLiteLayer, GlmMoeDsaMoE: MoeDsaLayer}


def use_grouped_decode(model: torch.nn.Module) -> None:
    """Give every mixture-of-experts layer of `model` the grouped decode steps, in place (the same parameters)."""
    for module in model.modules():
        if type(module) in _GROUPED:
            module.__class__ = _GROUPED[type(module)]
