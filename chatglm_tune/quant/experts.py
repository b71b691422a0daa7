"""Routed experts over INT8 / INT4 weights: `QuantizedExperts`, which stands where a mixture-of-experts layer holds its
experts as 3D weights (transformers' `gate_up_proj` [E, 2I, H], the gate's rows first, and `down_proj` [E, H, I]).

Each expert is three `QuantizedLinear`s (`gate_proj`, `up_proj`, `down_proj`), so a module's state_dict holds the
released per-expert layout (`experts.E.gate_proj.weight`, ...) with the official per-row INT format, and every matmul
runs on the CPU kernels a dense Linear uses (integer dot products for decode). Per-row scales make splitting the
fused gate/up rows exact: a quantized gate and up are the quantized fused rows. A forward runs only the experts its
tokens were routed to, each on the rows routed to it (a decode step reads k experts' weights, never all E).
A decode step runs its k experts in two calls of the integer-dot kernel (`int8dot_cpu.matmul_multi`: every gate and
up, then every down), the same products as expert by expert, bit for bit, without 3k calls' overheads; `decoder` holds
that step with its router in C++ (one call a layer instead of Python's many small ones).
A prompt's tokens without gradients run every chosen expert on its rows in two calls too (`grouped_rows`,
`int8dot_cpu.matmul_groups`), bit for bit as expert by expert; that saves a short prompt's call overheads, while a
long one's time is the kernel's own work. Figures for both: bench/results/kernel-notes.md.
Experts whose SwiGLU clamps its inputs (GLM-5.3-Flash's `swiglu_limit`: the gate at most L, the up projection within
[-L, L], before `silu(gate) * up`) clamp them alike on every Python path (`QuantizedExperts.glu`); the C++ step has no
clamp, so such a layer's decode steps run in Python (`decoder` gives none).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn
from transformers.activations import SiLUActivation

from chatglm_tune.quant import int8dot_cpu
from chatglm_tune.quant.modules import QuantizedLinear

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_SILU = (nn.SiLU, SiLUActivation)  # transformers' "silu" (`ACT2FN`): `F.silu`, as the C++ step computes it


class QuantizedExpert(nn.Module):
    """One expert's SwiGLU: `down(glu(gate(x), up(x)))` over INT weights (`glu`: `QuantizedExperts.glu`)."""

    def __init__(self, gate_proj: QuantizedLinear, up_proj: QuantizedLinear, down_proj: QuantizedLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: Tensor, glu) -> Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x)))


class QuantizedExperts(nn.Module):
    """E `QuantizedExpert`s (children "0" .. "E-1") with the routed experts' forward: (hidden [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H], the weighted sum of each token's chosen experts (an index of E,
    transformers' mark of a dropped choice, counts for nothing). `swiglu_limit`: the clamp of the SwiGLU's inputs
    (None: none; the module docstring)."""

    def __init__(self, experts: list[QuantizedExpert], act_fn, swiglu_limit: float | None = None):
        super().__init__()
        self.num_experts = len(experts)
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.act_fn = act_fn
        self.swiglu_limit = swiglu_limit

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        """`act(gate) * up`, the inputs clamped first where the experts clamp them (`swiglu_limit`)."""
        limit = self.swiglu_limit
        if limit is None:
            return self.act_fn(gate) * up
        return self.act_fn(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    def expert(self, index: int) -> QuantizedExpert:
        return self._modules[str(index)]

    @classmethod
    def empty(cls, experts: nn.Module, bits: int, group_size: int = 0, device="meta") -> QuantizedExperts:
        """Uninitialised layers of `experts`' shapes (its `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), to be
        filled from a checkpoint."""
        count, rows, hidden = experts.gate_up_proj.shape
        inner = rows // 2

        def layer(n_in, n_out):
            return QuantizedLinear(n_in, n_out, bits, group_size, bias=False, device=device,
                                   dtype=experts.down_proj.dtype)

        return cls([QuantizedExpert(layer(hidden, inner), layer(hidden, inner), layer(inner, hidden))
                    for _ in range(count)], *_activation(experts))

    @classmethod
    def from_fused(cls, experts: nn.Module, bits: int, group_size: int = 0) -> QuantizedExperts:
        """`experts`' 3D float weights quantized, expert by expert (per row: the official rule)."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        inner = gate_up.shape[1] // 2

        def layer(weight: Tensor) -> QuantizedLinear:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            return QuantizedLinear.from_linear(linear, bits, group_size)

        return cls([QuantizedExpert(layer(gate_up[e, :inner]), layer(gate_up[e, inner:]), layer(down[e]))
                    for e in range(gate_up.shape[0])], *_activation(experts))

    def prepare_kernels(self) -> None:
        """Build every expert's integer-dot layout now (in the weights' own bytes), where that kernel runs: an expert
        first chosen mid-answer would otherwise pay its repacking inside a decode step."""
        layers = [layer for layer in self.modules() if isinstance(layer, QuantizedLinear)]
        for layer in layers:
            if layer.grouped_kernel_runs():
                layer.weight_for("int8dot")
        self._grouped = all(layer.grouped_kernel_runs() for layer in layers)
        self._prepared = True

    def grouped_decode_runs(self, x: Tensor) -> bool:
        """Whether `decode_step` runs for these rows of x: one token, no gradient, every layer on the integer-dot
        kernel (the layouts are built here the first time a forward runs without gradients)."""
        if torch.is_grad_enabled():
            return False
        if not getattr(self, "_prepared", False):
            self.prepare_kernels()
        return self._grouped and x.shape[0] == 1 and x.device.type == "cpu"

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self.grouped_decode_runs(hidden_states):
            step = self.decode_step(hidden_states, top_k_index[0], top_k_weights[0])
            if step is not None:
                return step
        out = torch.zeros_like(hidden_states)
        if hidden_states.shape[0] == 1:  # a decode step: its k experts in expert order, as the grouped sum adds them
            for expert, weight in sorted(zip(top_k_index[0].tolist(), top_k_weights[0])):
                if expert < self.num_experts:
                    out += (self.expert(expert)(hidden_states, self.glu) * weight).to(out.dtype)
            return out
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
        chosen = [e for e, count in enumerate(counts[: self.num_experts]) if count]
        if self.grouped_rows_run(hidden_states, chosen, counts):
            return self.grouped_rows(hidden_states, top_k_index, top_k_weights, order, [(e, counts[e]) for e in chosen])
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):
            if count:
                pairs = order[start : start + count]
                tokens = pairs // top_k_index.shape[-1]
                y = self.expert(expert)(hidden_states[tokens], self.glu)
                weights = top_k_weights.reshape(-1)[pairs, None]
                out.index_add_(0, tokens, (y * weights).to(out.dtype))
            start += count
        return out

    def grouped_rows_run(self, x: Tensor, chosen: list[int], counts: list[int]) -> bool:
        """Whether `grouped_rows` runs these rows (x [T, H]; the `chosen` experts; `counts` of (token, choice) pairs an
        expert): no gradient, on the CPU, and every chosen expert's layers plain INT layers that the integer-dot kernel
        runs for its count of rows, as their own forwards would."""
        if torch.is_grad_enabled() or x.device.type != "cpu" or not x.is_floating_point():
            return False
        if not getattr(self, "_prepared", False):
            self.prepare_kernels()
        layers = [getattr(self.expert(e), name) for e in chosen for name in _PROJECTIONS]
        return (self._grouped and bool(chosen) and all(type(layer) is QuantizedLinear for layer in layers)
                and all(int8dot_cpu.routes(layers[0].bits, counts[e], x.dtype, needs_grad=False) for e in chosen))

    def grouped_rows(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, order: Tensor,
                     chosen: list[tuple[int, int]]) -> Tensor:
        """The forward's sum over many tokens (`order`: the (token, choice) pairs grouped by expert; `chosen`: each
        chosen expert with its count of pairs, in expert order) in two integer-dot calls for all experts
        (`int8dot_cpu.matmul_groups`: every gate and up, then every down), each expert on the rows routed to it: what
        the forward's expert-by-expert loop computes, bit for bit, without its 3 calls an expert (a 64-token prompt
        of GLM-4.7-Flash chooses nearly every expert of each layer)."""
        sizes = [count for _, count in chosen]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        pairs = order[: sum(sizes)]  # an index of E (a dropped choice) sorts last
        tokens = pairs // top_k_index.shape[-1]
        experts = [self.expert(e) for e, _ in chosen]
        gates, ups = [expert.gate_proj for expert in experts], [expert.up_proj for expert in experts]
        rows = x[tokens]
        gate_up = _grouped_rows_matmul(rows, starts * 2, sizes * 2, gates + ups).view(2, len(tokens), -1)
        down = _grouped_rows_matmul(self.glu(gate_up[0], gate_up[1]), starts, sizes,
                                    [expert.down_proj for expert in experts])
        weights = top_k_weights.reshape(-1)[pairs, None]
        return torch.zeros_like(x).index_add_(0, tokens, (down * weights).to(x.dtype))

    def decode_step(self, x: Tensor, index: Tensor, weights: Tensor, shared: nn.Module | None = None) -> Tensor | None:
        """One token's chosen experts (x [1, H], its k `index`es and `weights`) in two grouped integer-dot calls,
        summed in expert order as the other paths add them, then `shared` (an expert of the same shape with
        `gate_proj` / `up_proj` / `down_proj`, weight 1: a layer's shared expert) added last. Where
        `grouped_decode_runs(x)`; None where a chosen expert's layer is no longer a plain INT layer (an adapter
        wraps it since): the caller's other path runs it."""
        chosen = sorted((e, i) for i, e in enumerate(index.tolist()) if e < self.num_experts)
        experts = [self.expert(e) for e, _ in chosen] + ([shared] if shared is not None else [])
        out = torch.zeros_like(x)
        if not experts:
            return out
        projections = [layer for expert in experts for layer in (expert.gate_proj, expert.up_proj)]
        downs = [expert.down_proj for expert in experts]
        if not all(type(layer) is QuantizedLinear for layer in projections + downs):
            return None
        gate_up = _grouped_matmul(x.expand(len(projections), *x.shape), projections)
        gate_up = gate_up.view(len(experts), 2, x.shape[0], -1)
        down = _grouped_matmul(self.glu(gate_up[:, 0], gate_up[:, 1]), downs)
        scale = weights[[i for _, i in chosen]]
        if shared is not None:
            scale = torch.cat([scale, scale.new_ones(1)])
        for row in (down * scale.view(-1, 1, 1)).to(out.dtype):
            out += row
        return out

    def decoder(self, router: nn.Module, shared: nn.Module | None):
        """This layer's decode step held in C++ (`int8dot_cpu.moe_decoder`: `.step(x)`, x [1, H]) with its `router`
        (transformers' GLM router: one group of experts) and `shared` expert (`takes_as_expert`), the same arithmetic
        as `decode_step` after `moe_layer.route`, bit for bit; None where it cannot run (an adapter wraps a layer, an
        activation other than SiLU, clamped inputs: `swiglu_limit`, a layer off the grouped kernel). It holds the
        layers' layouts as they are now: valid while `modules.layouts_epoch()` stays the same."""
        modules = [self.expert(e) for e in range(self.num_experts)] + ([shared] if shared is not None else [])
        layers = [getattr(module, name) for module in modules for name in _PROJECTIONS]
        if not (type(self.act_fn) in _SILU and self.swiglu_limit is None
                and all(type(layer) is QuantizedLinear and layer.grouped_kernel_runs() for layer in layers)):
            return None
        return int8dot_cpu.moe_decoder(*_int8dot_weights(layers), self.num_experts, router.weight,
                                       router.e_score_correction_bias, router.top_k, router.norm_topk_prob,
                                       float(router.routed_scaling_factor), layers[0].bits)

    def takes_as_expert(self, module: nn.Module) -> bool:
        """Whether `module` (a shared expert) can join `decode_step`: INT layers of the routed experts' format and
        shapes that the grouped kernel runs."""
        def shape(layer):
            return layer.bits, layer.in_features, layer.out_features

        pairs = [(getattr(module, name, None), getattr(self.expert(0), name)) for name in _PROJECTIONS]
        return all(isinstance(layer, QuantizedLinear) and layer.grouped_kernel_runs() and shape(layer) == shape(ref)
                   for layer, ref in pairs)


def _activation(experts: nn.Module) -> tuple:
    """(activation, swiglu_limit) of transformers' 3D experts: their `act_fn` (GLM-5.3-Flash's have none: their gate is
    `F.silu`, as `nn.SiLU` computes it) and the clamp of their SwiGLU's inputs (None: none)."""
    return getattr(experts, "act_fn", None) or nn.SiLU(), getattr(experts, "swiglu_limit", None)


def dense_decoder(mlp: nn.Module):
    """A dense SwiGLU MLP's decode step held in C++ as the mixture-of-experts step with no routed experts and `mlp`
    the shared one (`.step(x)`, x [1, H]): gate and up in one grouped call, down in another, the same bits as its
    forward; None where it cannot run (not SiLU, clamped inputs: `swiglu_limit`, a layer that is not INT on the grouped
    kernel)."""
    layers = [getattr(mlp, name, None) for name in _PROJECTIONS]
    if getattr(mlp, "swiglu_limit", None) is not None:
        return None
    if not (type(getattr(mlp, "act_fn", None)) in _SILU and all(type(layer) is QuantizedLinear
                                                                 and layer.grouped_kernel_runs() for layer in layers)
            and len({layer.bits for layer in layers}) == 1):
        return None
    no_router = torch.empty(0, layers[0].in_features)
    return int8dot_cpu.moe_decoder(*_int8dot_weights(layers), 0, no_router, torch.empty(0), 0, False, 1.0,
                                   layers[0].bits)


def _int8dot_weights(layers: list[QuantizedLinear]) -> tuple[list[Tensor], list[Tensor]]:
    """The layers' weights in the integer-dot kernel's layout and their float32 scales, each layer recorded as run by
    that kernel."""
    for layer in layers:
        layer.record_kernel("int8dot")
    return [layer.weight_for("int8dot") for layer in layers], [layer.float_scale() for layer in layers]


def _grouped_matmul(x: Tensor, layers: list[QuantizedLinear]) -> Tensor:
    """x [G, M, in] group by group times `layers` (one format and shape): [G, M, out]."""
    return int8dot_cpu.matmul_multi(x, *_int8dot_weights(layers), layers[0].bits)


def _grouped_rows_matmul(x: Tensor, starts: list[int], counts: list[int], layers: list[QuantizedLinear]) -> Tensor:
    """Rows `starts[g]` .. `starts[g] + counts[g] - 1` of x [R, in] times `layers[g]` (one format and shape), group
    after group: [sum of counts, out]."""
    return int8dot_cpu.matmul_groups(x, starts, counts, *_int8dot_weights(layers), layers[0].bits)


def quantize_experts(model: nn.Module, bits: int, group_size: int = 0, *, empty_init: bool = False) -> int:
    """Swap, in place, every module of `model` holding 3D routed-expert weights (`gate_up_proj` and `down_proj`
    Parameters) for a `QuantizedExperts` (empty with `empty_init`, for a loader to fill); the number swapped."""
    slots = [(name, module) for name, module in model.named_modules() if _is_fused_experts(module)]
    for name, module in slots:
        parent_name, _, attr = name.rpartition(".")
        new = (QuantizedExperts.empty(module, bits, group_size, module.gate_up_proj.device) if empty_init
               else QuantizedExperts.from_fused(module, bits, group_size))
        setattr(model.get_submodule(parent_name), attr, new)
    return len(slots)


def _is_fused_experts(module: nn.Module) -> bool:
    weights = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)
