"""Tests for chatglm_tune.quant.int4_cpu: the AVX2 INT4 kernel reading the official packed weight, against
`x @ dequantize(W).T` in fp32 (both of its loops: per-row unpacking and the shared fp32 buffer), its
guards, its clean absence where it cannot be built, and QuantizedLinear's routing to it.

The kernel computes in fp32, so fp32 inputs are held to the fp32 tolerance of tests/test_quantization.py
(1e-5 relative), bf16 inputs to the bf16 one (1e-2: the result is rounded to bf16). Kernel tests skip
where it cannot run (not x86-64 with AVX2, or no compiler).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatglm_tune.quant import int4_cpu, int8dot_cpu, kernels
from chatglm_tune.quant.format import dequantize, pack_int4, quantize_weight
from chatglm_tune.quant.modules import QuantizedLinear

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

needs_kernel = pytest.mark.skipif(not int4_cpu.compiled(), reason="the AVX2 INT4 kernel cannot run or be built here")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def official_int4(out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(out_features, in_features, generator=g).half() * 0.02, 4)
    return pack_int4(q), scale


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("direct_rows", [0, 64])  # every row through the fp32 buffer / every row unpacking itself
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_math(rows, direct_rows, dtype):
    # in = 1056: 528 packed bytes, two whole 256-byte chunks of the buffered loop and a partial one
    weight, scale = official_int4(36, 1056)
    x = torch.randn(rows, 1056).to(dtype)
    y = int4_cpu.matmul(x, weight, scale, direct_rows=direct_rows)
    ref = x.float() @ dequantize(weight, scale, 4, torch.float32).t()
    assert y.dtype == dtype and y.shape == (rows, 36)
    assert rel_err(y, ref) < TOL[dtype]


@needs_kernel
def test_nibble_order_and_sign_on_a_hand_built_weight():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 1)  # every signed nibble, in both the high and low halves
    q[1] = q[1].flip(0)
    q[2] = -q[2].clamp(min=-7)
    weight, scale = pack_int4(q), torch.tensor([1.0, 0.5, 2.0, 0.25], dtype=torch.float16)
    x = torch.zeros(2, 16)
    x[0, 0::2] = 1.0  # the even columns: high nibbles
    x[1, 1::2] = 1.0  # the odd columns: low nibbles
    want = torch.stack([q[:, 0::2].float().sum(1), q[:, 1::2].float().sum(1)]) * scale.float()
    assert torch.equal(int4_cpu.matmul(x, weight, scale), want)  # small integers: exact


@needs_kernel
def test_chatglm_6b_shape_at_batch_one():
    weight, scale = official_int4(4096, 4096, seed=3)
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    ref = x.float() @ dequantize(weight, scale, 4, torch.float32).t()
    assert rel_err(int4_cpu.matmul(x, weight, scale), ref) < TOL[torch.bfloat16]
    assert rel_err(int4_cpu.matmul(x.float(), weight, scale), ref) < TOL[torch.float32]


@needs_kernel
@needs_kernel
def test_the_kernel_runs_on_pytorchs_threads():
    """Built with OpenMP, `at::parallel_for` splits the rows over PyTorch's threads; built without it, the same
    code compiles and silently runs on one (it once did: 1.9x slower at 2 threads)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.chatglm_int4_cpu.parallel_chunks() == 2
    finally:
        torch.set_num_threads(threads)


def test_shapes_it_cannot_take_are_refused_not_misread():
    assert not int4_cpu.usable(1032, 64, 0)  # in % 16
    assert not int4_cpu.usable(1024, 66, 0)  # out % 4
    assert not int4_cpu.usable(1024, 64, 32)  # group-wise scales
    weight, scale = official_int4(6, 64)
    with pytest.raises(RuntimeError, match="out % 4"):
        int4_cpu.matmul(torch.randn(1, 64), weight, scale)


def test_a_failed_build_means_unavailable_with_one_warning(monkeypatch, no_compiler):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(int4_cpu, "_x86", lambda: True)
    monkeypatch.setattr(int8dot_cpu, "available", lambda: False)  # decode's first choice where it builds
    int4_cpu._build.cache_clear()
    int4_cpu.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            assert not int4_cpu.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not int4_cpu.available() and not int4_cpu.compiled()  # cached: no second build, no warning
        layer = QuantizedLinear.from_linear(nn.Linear(64, 32).half(), 4)
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
        assert layer.last_kernel == "int4pack"  # PyTorch's kernel, as before
    finally:
        int4_cpu._build.cache_clear()
        int4_cpu.available.cache_clear()


def test_avx512_cpus_keep_int4pack_without_building(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(int4_cpu, "_build", lambda: pytest.fail("built on an AVX-512 CPU"))
    int4_cpu.available.cache_clear()
    try:
        assert not int4_cpu.available()
    finally:
        int4_cpu.available.cache_clear()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 32])
def test_quantized_linear_routes_decode_here_where_available(monkeypatch, rows):
    monkeypatch.setattr(int4_cpu, "available", lambda: True)
    monkeypatch.setattr(int8dot_cpu, "available", lambda: False)  # decode's first choice where it builds
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(256, 64).half(), 4)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(layer.weight, layer.weight_scale, 4, torch.float32), layer.bias.float())
    y = layer(x)
    assert layer.last_kernel == "int4cpu" and y.dtype == torch.bfloat16
    assert rel_err(y, ref) < TOL[torch.bfloat16]
    assert layer.held_layout is None  # the official weight is the only copy: nothing repacked
    layer(torch.randn(QuantizedLinear.max_kernel_rows + 1, 256, dtype=torch.bfloat16))
    assert layer.last_kernel == "dequant"  # prefill as before


@needs_kernel
def test_quantized_linear_falls_back_where_it_cannot_route_here(monkeypatch):
    monkeypatch.setattr(int4_cpu, "available", lambda: True)
    grouped = QuantizedLinear.from_linear(nn.Linear(256, 64).half(), 4, group_size=32)
    grouped(torch.randn(1, 256, dtype=torch.bfloat16))
    assert grouped.last_kernel == "int4pack"  # group-wise scales: PyTorch's kernel
    layer = QuantizedLinear.from_linear(nn.Linear(256, 64).half(), 4)
    layer.kernel = "int4pack"
    layer(torch.randn(1, 256, dtype=torch.bfloat16))
    if layer.held_layout == "int4pack":  # the official weight was released for the kernel layout (AVX2 layout)
        layer.kernel = "int4cpu"  # a forced kernel that reads the official weight gets it back
        x = torch.randn(1, 256)
        y = layer(x)
        assert layer.last_kernel == "int4cpu" and layer.held_layout is None
        ref = F.linear(x, dequantize(layer.state_dict()["weight"], layer.weight_scale, 4, torch.float32),
                       layer.bias.float())
        assert rel_err(y, ref) < TOL[torch.float32]
    assert kernels.KERNELS.count("int4cpu") == 1
