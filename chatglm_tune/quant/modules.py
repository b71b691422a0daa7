"""The quantized layers: `QuantizedLinear` (a frozen Linear over official-layout INT8/INT4 weights) and
`QuantizedEmbedding` (INT8 rows, dequantized on lookup).

Their state_dict entries are the checkpoint's keys and nothing else (`weight`, fp16 `weight_scale`,
`bias`); `model.to(dtype)` casts the bias but never the official scales. The matmul is `kernels`'.
A layer may hold its weight in a kernel's own layout instead of the official one (one copy, not two; built at the
kernel's first use, for this process only); `state_dict` then rebuilds the official weight.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from chatglm_tune.quant import cpu_matmul, cuda_matmul, int4_cpu, int8dot_cpu
from chatglm_tune.quant.format import check_format, dequantize, pack_int4, quantize_weight
from chatglm_tune.runtime import heap
from chatglm_tune.quant.kernels import (KERNELS, QuantizedMatmul, int4pack_block_rows, int4pack_to_int, int4pack_weight,
                                        quantized_matmul, whole_int4pack_blocks)


# ------------------------------------------------------------------------------------------------
# Module
# ------------------------------------------------------------------------------------------------

_EPOCH = [0]


def layouts_epoch() -> int:
    """A number that changes whenever a QuantizedLinear makes or drops a kernel's layout, and, once `watch_modules`
    was called, whenever a submodule or a parameter anywhere is replaced or a QuantizedLinear is set (an adapter
    wrapping a layer, or unwrapping it): holders of layouts and parameters (the held decode steps of
    `models/glm/moe_layer` and `latent_layer`) check it before they reuse theirs."""
    return _EPOCH[0]


def _layouts_changed() -> None:
    _EPOCH[0] += 1


def _on_submodule(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    # called before `module` is set: a new container filled (transformers slices its ModuleList of layers every
    # forward) changes nothing
    if parent._modules.get(name) is not None or type(module) is QuantizedLinear:
        _layouts_changed()


def _on_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    # called before `parameter` is set: a held step reads the one it replaces
    if module._parameters.get(name) is not None:
        _layouts_changed()


@functools.cache
def watch_modules() -> None:
    """From now on a submodule or a parameter replaced anywhere, or a QuantizedLinear set (`nn.Module.__setattr__`,
    `register_module`, `register_parameter`), changes `layouts_epoch` (once per process)."""
    nn.modules.module.register_module_module_registration_hook(_on_submodule)
    nn.modules.module.register_module_parameter_registration_hook(_on_parameter)


class QuantizedLinear(nn.Module):
    """A frozen Linear holding official-layout integer weights: `y = x @ dequant(W).T + bias`.

    Parameters (all `requires_grad=False`), named as the checkpoint keys and the only state_dict
    entries: `weight` int8 `[out, in]` (bits 8) or `[out, in/2]` (bits 4, packed), `weight_scale` fp16
    `[out]` or `[out, in/group_size]`, `bias` in the compute dtype (or None). `model.to(dtype)` casts
    the bias but keeps `weight_scale` fp16 (a cast would round the official scales).

    The first int8dot or int4pack call repacks the weight into that kernel's layout and releases the official one
    (`held_layout`; a weight shared with a tied embedding stays as it is).

    `kernel` picks the matmul: "auto" (default), or force "int8dot", "int8pack", "int4pack", "int4cpu", "intmm",
    "int4mm" or "dequant"; a forced kernel whose requirements are not met (shape, device, bits) falls back to "dequant",
    never crashes. On a CUDA GPU "auto" runs `cuda_matmul`'s weight-only kernels where no gradient flows through x
    (tinygemm's int4mm for INT4 under bf16, else intmm), the dequantizing path where one does.
    `last_kernel` records the path that ran. "auto" uses `int8dot_cpu` (activations quantized to int8 blocks for
    INT4, int16 ones for INT8; integer dot products) for INT8 and per-row INT4 where it builds, for decode (at most
    `int8dot_cpu.MAX_ROWS` rows) and, where no gradient flows through x, for prefill where it beats the dequantizing
    GEMM (`int8dot_cpu.routes`); else the other CPU kernels for at most `max_kernel_rows`
    rows of x: beyond, dequantizing in 512-row tiles then an fp32 matmul catches up with int8pack (a tie near 64
    rows) and then wins (figures: bench/results/kernel-notes.md).
    """

    max_kernel_rows = 32

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int = 0,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float16,
    ):
        """Empty (uninitialized) layer of the given format, e.g. on "meta" before loading a checkpoint;
        `dtype` is the bias (compute) dtype."""
        super().__init__()
        check_format(in_features, bits, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        packed_in = in_features // 2 if bits == 4 else in_features
        scale_shape = (out_features, in_features // group_size) if group_size else (out_features,)

        def frozen(shape, dt):
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        self.weight = frozen((out_features, packed_in), torch.int8)
        self.weight_scale = frozen(scale_shape, torch.float16)
        self.bias = frozen((out_features,), dtype) if bias else None
        self.kernel = "auto"
        self.last_kernel: str | None = None
        self.shares_weight = False  # the weight is also a tied embedding's: never repacked
        # (kernel, data_ptr of the official weight or None once it is released, then that kernel's weight data)
        self._layout: tuple | None = None  # never saved

    @classmethod
    def from_parts(cls, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, bits: int, group_size: int = 0,
                   shared: bool = False) -> QuantizedLinear:
        """A layer holding these tensors as they are (the stored layout: `weight` packed for INT4; Parameters,
        e.g. a tied embedding's, shared, not wrapped); `bias` None for none, or a meta tensor for one assigned
        later (by a checkpoint loader); `shared`: another module reads `weight` too (it is never repacked)."""
        in_features = weight.shape[1] * (2 if bits == 4 else 1)
        layer = cls(in_features, weight.shape[0], bits, group_size, bias=False, device="meta")
        layer.weight, layer.weight_scale = _frozen(weight), _frozen(weight_scale)
        layer.shares_weight = shared
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 0) -> QuantizedLinear:
        """Quantize `linear.weight` with `quantize_weight`; the bias tensor is reused, not copied."""
        q, scale = quantize_weight(linear.weight.detach(), bits, group_size)
        return cls.from_parts(pack_int4(q) if bits == 4 else q, scale, linear.bias, bits, group_size)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, weight={(self.out_features, self.weight_row_bytes)}, "
            f"weight_scale={tuple(self.weight_scale.shape)}, bias={self.bias is not None}"
            + (f", held in the {self.held_layout} layout" if self.held_layout else "")
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out), in x's dtype."""
        kernel = self._choose_kernel(x)
        if not torch.compiler.is_compiling():  # a compiled step keeps no Python state
            self.record_kernel(kernel)
        bias = self.bias
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            y = QuantizedMatmul.apply(x, self, kernel)
            return y if bias is None else y + bias.to(y.dtype)
        # no gradient to give: the kernel straight away (a decode step is ~170 such calls; autograd's bookkeeping
        # took a fifth of each small one's time)
        return quantized_matmul(x, self, kernel, bias)

    def _choose_kernel(self, x: Tensor) -> str:
        rows = x.numel() // self.in_features
        return self.kernel_for(x.device, x.dtype, rows, torch.is_grad_enabled() and x.requires_grad)

    def kernel_for(self, device: torch.device, dtype: torch.dtype, rows: int, needs_grad: bool) -> str:
        """The kernel a call with `rows` rows of x (`dtype`, on `device`) runs."""
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not dtype.is_floating_point or rows == 0:
            return "dequant"
        if device.type == "cuda" and self.weight.device.type == "cuda":
            return self._cuda_kernel(dtype, needs_grad)
        if not (device.type == "cpu" and self.weight.device.type == "cpu"):
            return "dequant"
        if self.kernel == "auto":
            if int8dot_cpu.routes(self.bits, rows, dtype, needs_grad) and self._usable("int8dot"):
                return "int8dot"
            fast = "int8pack" if self.bits == 8 else "int4cpu" if self._usable("int4cpu") else "int4pack"
            return fast if self._usable(fast) and rows <= self.max_kernel_rows else "dequant"
        return self.kernel if self._usable(self.kernel) else "dequant"

    def _cuda_kernel(self, dtype: torch.dtype, needs_grad: bool) -> str:
        """On a CUDA GPU, where no gradient flows through x, the weight-only kernels (`cuda_matmul`): tinygemm for INT4
        under bf16, else intmm; "dequant" where neither can run the layer."""
        if needs_grad:
            return "dequant"
        if self.kernel != "auto":
            return self.kernel if self.kernel in ("intmm", "int4mm") and self._usable(self.kernel) else "dequant"
        if self.bits == 4 and dtype == torch.bfloat16 and self._usable("int4mm"):
            return "int4mm"
        return "intmm" if self._usable("intmm") else "dequant"

    def _usable(self, kernel: str) -> bool:
        """Whether `kernel` can run this layer (asked only of the kernel being considered, so the C++ kernels'
        builds, once per machine, happen only where they would run, and prefill and training never wait for them)."""
        if kernel == "intmm":  # INT8, or INT4 of per-row scales
            return self.bits == 8 or self.group_size == 0
        if kernel == "int4mm":  # a held layout answers without asking the device (a compiled step traces this)
            return (self.bits == 4 and cuda_matmul.int4mm_shape(self.in_features, self.out_features, self.group_size)
                    is not None and (self.held_layout == "int4mm" or cuda_matmul.tinygemm_runs(self.weight.device)))
        if kernel == "int8pack":  # int8pack segfaults for K % 16 != 0 (measured)
            return self.bits == 8 and self.in_features % 16 == 0
        if kernel == "int4pack":  # needs N % 16 == 0 and scale groups made of 32..256-column kernel groups
            return self.bits == 4 and self.out_features % 16 == 0 and (self.group_size or self.in_features) % 32 == 0
        if kernel == "int4cpu":  # where it beats int4pack (AVX2-only CPUs)
            return (self.bits == 4 and int4_cpu.usable(self.in_features, self.out_features, self.group_size)
                    and int4_cpu.available())
        if kernel == "int8dot":  # INT8 and per-row INT4, wherever it builds (AVX2 or AVX-512 VNNI)
            return int8dot_cpu.usable(self.in_features, self.out_features, self.bits,
                                      self.group_size) and int8dot_cpu.available()
        return True  # dequant

    @property
    def held_layout(self) -> str | None:
        """The kernel ("int8dot", "int4pack") whose layout alone holds the weight once the official one is
        released, else None."""
        return self._layout[0] if self._layout is not None and self._layout[1] is None else None

    def weight_for(self, kernel: str):
        """The weight as `kernel` reads it: "int8dot" `int8dot_cpu.pack`'s layout (the official weight where it is
        shared), "int4pack" `int4pack_weight`'s four, any other the official weight (rebuilt if released).

        A kernel's layout is built at its first use and kept for this process only. The official weight is then
        released (one resident copy, not two; int8dot's layout is made a tile at a time) where the layout reads back
        (int8dot's always, int4pack's where `int4pack_block_rows` knows it: AVX2 and AVX-512): the dequantize path reads
        its integers from that layout, and `state_dict`, `load_state_dict` and `.to()` rebuild the official one.
        """
        as_is = kernel not in ("int8dot", "int4pack", "int4mm") or (kernel == "int8dot" and self.shares_weight)
        if as_is:  # the official weight, back from a layout another kernel left
            self._restore_official_weight()
            return self.weight
        cache = self._layout
        if cache is None or cache[0] != kernel or (cache[1] is not None and cache[1] != self.weight.data_ptr()):
            self._restore_official_weight()  # another kernel's layout (a forced kernel), or weights loaded since
            if kernel == "int8dot":
                data, release = self._int8dot_weight(), True
            elif kernel == "int4mm":
                data, release = cuda_matmul.int4mm_weight(self.weight, self.weight_scale), not self.shares_weight
            else:
                data = int4pack_weight(self.weight, self.weight_scale)
                block = int4pack_block_rows()
                release = block is not None and self.out_features % block == 0
            self._layout = (kernel, None if release else self.weight.data_ptr(), *data)
            _layouts_changed()
            if release:
                self.weight.data = torch.empty(0, dtype=torch.int8, device=self.weight.device)
            heap.trim()  # the freed official weight and the repacking temporaries sit among kept tensors
        return self._layout[2] if kernel == "int8dot" else self._layout[2:]

    def _int8dot_weight(self) -> tuple[Tensor]:
        """(int8dot's weight,): the interleaved layout (`int8dot_cpu.pack`), in 2 MB pages where the system gives them
        (the kernel streams it at every step): made in the official weight's own bytes where those are such pages (a
        loaded weight: `heap.large_empty`) or none are offered, else written tile by tile into new ones."""
        weight = self.weight.data
        out = None if heap.on_huge_pages(weight) else heap.huge_pages_empty(
            int8dot_cpu.packed_shape(self.out_features, self.weight_row_bytes), torch.int8)
        return (int8dot_cpu.pack(weight, in_place=out is None, out=out),)

    def held_rows(self, start: int, stop: int) -> tuple[Tensor, int]:
        """Rows start .. stop - 1 of a released weight read from the layout that holds it, and their `bits` for
        `dequantize` (int4pack's come as int8 integers: 8, written into one reused CPU buffer)."""
        if self.held_layout == "int4pack":
            ints = cpu_matmul.workspace("int4", (stop - start, self.in_features), torch.int8)
            return int4pack_to_int(self._layout[2][start:stop], self.in_features, out=ints), 8
        if self.held_layout == "int4mm":
            return self._int4mm_ints()[start:stop], 8
        return int8dot_cpu.unpack(self._layout[2], start, stop, self.weight_row_bytes), self.bits

    def float_scale(self) -> Tensor:
        """`weight_scale` in float32, as grouped integer-dot calls read it without a conversion a call (kept beside the
        official fp16 scale for this process, made again when that changes)."""
        scale = self._parameters["weight_scale"]
        held = self.__dict__.get("_float_scale")  # plain attributes, read and set past nn.Module's slower hooks
        if held is None or held[0] is not scale or held[1] != scale._version:
            held = (scale, scale._version, scale.float())
            self.__dict__["_float_scale"] = held
        return held[2]

    def grouped_kernel_runs(self) -> bool:
        """Whether grouped integer-dot calls (`int8dot_cpu.matmul_multi`, which add no bias) can run this layer as it
        stands: the automatic kernel, on the CPU, no bias."""
        return (self.kernel == "auto" and self.weight.device.type == "cpu" and self.bias is None
                and self._usable("int8dot"))

    def record_kernel(self, kernel: str) -> None:
        """Set `last_kernel` (a plain attribute, set past nn.Module's `__setattr__`: a decode step sets it ~700
        times)."""
        self.__dict__["last_kernel"] = kernel

    @property
    def weight_row_bytes(self) -> int:
        """Bytes of a row of the official weight (INT4 packs two columns a byte)."""
        return self.in_features // 2 if self.bits == 4 else self.in_features

    def _official_weight(self) -> Tensor:
        """The official weight, rebuilt (tile by tile for int4pack) from the layout that holds it."""
        if self.held_layout == "int8dot":
            return int8dot_cpu.unpack(self._layout[2], 0, self.out_features, self.weight_row_bytes)
        if self.held_layout == "int4mm":
            return pack_int4(self._int4mm_ints())
        packed = self._layout[2]
        step = whole_int4pack_blocks(cpu_matmul.tile_rows(self.in_features))
        tiles = range(0, self.out_features, step)
        return torch.cat([pack_int4(int4pack_to_int(packed[s : s + step], self.in_features)) for s in tiles])

    def _int4mm_ints(self) -> Tensor:
        """The signed integers [out, in] of a weight held in tinygemm's layout."""
        return cuda_matmul.int4mm_to_int(self._layout[2], self._layout[3], self.in_features, self.out_features)

    def _restore_official_weight(self) -> None:
        if self.held_layout:
            self.weight.data = self._official_weight()
        if self._layout is not None:
            self._layout = None
            _layouts_changed()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.held_layout:
            destination[prefix + "weight"] = self._official_weight()

    def _apply(self, fn, recurse=True):
        # Move the fp16 scales with the module but never cast them; drop the repacked weight.
        self._restore_official_weight()
        return _apply_keeping_scale_dtype(self, super()._apply, fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict copies in place (same data_ptr, new values): drop the repacked weight
        if self.held_layout:
            self.weight.data = torch.empty(self.out_features, self.weight_row_bytes, dtype=torch.int8,
                                           device=self.weight.device)
        self._layout = None
        _layouts_changed()
        super()._load_from_state_dict(*args, **kwargs)


class QuantizedEmbedding(nn.Module):
    """An input embedding held as INT8 rows (`quantize_embedding`): `weight` int8 `[vocab, hidden]` and fp16
    per-row `weight_scale` `[vocab]`, the official rule. ChatGLM-6B's are the tied head's own Parameters (one
    copy, tied as the float embedding and head are); ChatGLM2/3's and GLM-4's its own, beside an INT8 head.

    A lookup dequantizes only the rows asked for, in the compute dtype, which the empty buffer `_dtype`
    holds so that it follows `model.to(dtype)`.
    """

    bits, group_size = 8, 0  # the format, in QuantizedLinear's terms (what a loader quantizes into)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, *,
                 device: torch.device | str | None = None):
        """Empty (uninitialized) rows, e.g. on "meta" before a loader quantizes into them; `dtype`: the compute
        dtype."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _frozen(torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.weight_scale = _frozen(torch.empty(num_embeddings, dtype=torch.float16, device=device))
        # It holds no data, so never on "meta": a model loaded there can then be moved.
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=None if str(device) == "meta" else device),
                             persistent=False)

    @classmethod
    def from_parts(cls, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> QuantizedEmbedding:
        """An embedding holding these tensors as they are (Parameters, e.g. a tied head's, shared, not wrapped)."""
        embedding = cls(*weight.shape, dtype, device="meta")
        embedding.weight, embedding.weight_scale = _frozen(weight), _frozen(weight_scale)
        return embedding

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = input_ids.reshape(-1)
        rows = dequantize(self.weight[ids], self.weight_scale[ids], 8, self._dtype.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, INT8 rows, computing in {self._dtype.dtype}"

    def _apply(self, fn, recurse=True):  # the fp16 scales move but are never cast
        return _apply_keeping_scale_dtype(self, super()._apply, fn, recurse)


def _frozen(tensor: Tensor) -> nn.Parameter:
    """`tensor` as a frozen Parameter; a Parameter as it is (shared: a tied embedding and head stay one)."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


def _apply_keeping_scale_dtype(module: nn.Module, apply, fn, recurse: bool) -> nn.Module:
    """`apply(fn, recurse)` (nn.Module._apply), then `module.weight_scale` back in its own dtype, on the
    new device: `model.to(dtype)` must not round the official fp16 scales."""
    scale = module.weight_scale.detach()
    apply(fn, recurse)
    if module.weight_scale.dtype != scale.dtype:
        module.weight_scale.data = scale.to(module.weight_scale.device)
    return module
