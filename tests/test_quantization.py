"""Tests for chatglm_tune.quant: the official INT8/INT4 format, every matmul
path of QuantizedLinear against `F.linear(x, dequantize(...), bias)`, the kernel guards
(shapes the CPU kernels cannot take fall back to dequant), input-only gradients, save/load, and the module swaps.

Tolerances (relative Frobenius error against the dequantized reference): 1e-5 when the path computes
in fp32, 1e-2 when it computes in bf16 (the CPU kernels always do; bf16 has an 8-bit significand).
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from chatglm_tune.models.chatglm6b.config import QUANTIZABLE_LINEARS
from chatglm_tune.quant import cpu_matmul, int4_cpu, int8dot_cpu, kernels
from chatglm_tune.quant.apply import quantize_model, to_bitsandbytes
from chatglm_tune.quant.format import dequantize, pack_int4, quantize_weight, unpack_int4
from chatglm_tune.quant.modules import QuantizedLinear

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FORMATS = [(8, 0), (4, 0), (4, 32)]  # (bits, group_size)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    w = dequantize(layer.state_dict()["weight"], layer.weight_scale, layer.bits, x.dtype)  # official layout
    return F.linear(x, w, layer.bias.to(x.dtype))


def make_layer(bits, group_size, in_features=64, out_features=48, seed=0):
    torch.manual_seed(seed)
    return QuantizedLinear.from_linear(nn.Linear(in_features, out_features).half(), bits, group_size)


# ---------------------------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_weight_is_the_official_fp16_rule(bits):
    torch.manual_seed(0)
    w = torch.randn(64, 96, dtype=torch.float16) * 0.05
    q, scale = quantize_weight(w, bits)
    # the official lines, verbatim (fp16 throughout)
    ref_scale = (w.abs().max(dim=-1).values / (2 ** (bits - 1) - 1)).half()
    ref_q = torch.round(w / ref_scale[:, None]).to(torch.int8)
    assert scale.dtype == torch.float16 and scale.shape == (64,)
    assert torch.equal(scale, ref_scale)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q)
    qmax = 2 ** (bits - 1) - 1
    assert q.abs().max() == qmax  # the absmax element of each row maps to +-qmax
    if bits == 4:
        packed = pack_int4(q)
        assert packed.dtype == torch.int8 and packed.shape == (64, 48)
        assert torch.equal(unpack_int4(packed), ref_q)


def test_quantize_weight_fp32_divides_in_fp32_by_the_fp16_scale():
    torch.manual_seed(1)
    w = torch.randn(16, 32)
    q, scale = quantize_weight(w, 8)
    assert torch.equal(scale, (w.abs().amax(-1) / 127).half())
    assert torch.equal(q, torch.round(w / scale.float()[:, None]).to(torch.int8))


def test_int4_nibble_order_on_a_hand_built_row():
    q = torch.tensor([[1, -2, 7, -7], [-7, 3, -1, -1]], dtype=torch.int8)
    packed = pack_int4(q)
    # (1 << 4) | (-2 & 0xF) = 0x1E; (7 << 4) | (-7 & 0xF) = 0x79; 0x93 = -109 as int8; 0xFF = -1
    assert packed.tolist() == [[0x1E, 0x79], [-109, -1]]
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize(
    "name, out_f, in_f",
    [
        ("query_key_value", 12288, 4096),
        ("dense", 4096, 4096),
        ("dense_h_to_4h", 16384, 4096),
        ("dense_4h_to_h", 4096, 16384),
    ],
)
def test_chatglm_6b_shapes_of_the_spec_table_on_meta(name, out_f, in_f):
    w = torch.empty(out_f, in_f, dtype=torch.float16, device="meta")
    for bits, packed_in in ((8, in_f), (4, in_f // 2)):
        q, scale = quantize_weight(w, bits)
        stored = pack_int4(q) if bits == 4 else q
        empty = QuantizedLinear(in_f, out_f, bits, device="meta")
        for layer_weight in (stored, empty.weight):
            assert layer_weight.shape == (out_f, packed_in) and layer_weight.dtype == torch.int8
        assert scale.shape == empty.weight_scale.shape == (out_f,)
        assert empty.weight_scale.dtype == torch.float16


def test_int8_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(2)
    w = torch.randn(32, 64, dtype=torch.float16)
    q, scale = quantize_weight(w, 8)
    err = (dequantize(q, scale, 8, torch.float32) - w.float()).abs()
    # half a step, plus the official fp16 rounding of w / scale before round(): the quotient's fp16
    # spacing is 1/16 in [64, 128), so it may move by 1/32 of a step
    steps = err / scale.float()[:, None]
    assert steps.max() <= 0.5 + 1 / 32 and steps.max() > 0.49
    assert torch.equal(dequantize(q, scale, 8), (q.half() * scale[:, None]))  # fp16 like the official kernel


def test_zero_rows_give_zero_not_nan():
    w = torch.randn(4, 32, dtype=torch.float16)
    w[1] = 0
    w[2] = 1e-7  # a subnormal fp16 whose absmax / 7 (or / 127) underflows to a 0 scale
    for bits in (8, 4):
        q, scale = quantize_weight(w, bits)
        assert scale[1] == 0 and (q[1] == 0).all() and (q[2] == 0).all()
        assert torch.isfinite(dequantize(pack_int4(q) if bits == 4 else q, scale, bits)).all()


def test_invalid_formats_are_rejected():
    w = torch.randn(4, 32)
    with pytest.raises(ValueError, match="bits"):
        quantize_weight(w, 3)
    with pytest.raises(ValueError, match="group_size=0 with bits=8"):
        quantize_weight(w, 8, group_size=16)
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_weight(w, 4, group_size=12)


# ---------------------------------------------------------------------------------------------- (b)

EXPECTED_FAST = {8: "int8pack", 4: "int4pack"}
# What `auto` picks for a per-row-scale layer at decode: int8dot_cpu wherever it builds; else int8pack for INT8,
# and for INT4 int4_cpu on AVX2-only CPUs, int4pack elsewhere.
AUTO_FAST = {8: "int8pack", 4: "int4cpu" if int4_cpu.available() else "int4pack"}
if int8dot_cpu.available():
    AUTO_FAST = {8: "int8dot", 4: "int8dot"}


@pytest.fixture
def int4pack_auto(monkeypatch):
    """`auto` as on CPUs where int4pack is INT4's kernel (AVX-512 without the int8 dot-product kernel), whatever
    this CPU is."""
    monkeypatch.setattr(int4_cpu, "available", lambda: False)
    monkeypatch.setattr(int8dot_cpu, "available", lambda: False)


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("kernel", ["fast", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_every_path_matches_dequantized_linear(bits, group_size, kernel, dtype, rows):
    layer = make_layer(bits, group_size)
    layer.kernel = EXPECTED_FAST[bits] if kernel == "fast" else "dequant"
    x = torch.randn(rows, 64, dtype=dtype)
    y = layer(x)
    assert layer.last_kernel == layer.kernel
    assert y.dtype == dtype and y.shape == (rows, 48)
    tol = TOL[torch.bfloat16] if layer.kernel != "dequant" else TOL[dtype]
    assert rel_err(y, reference(layer, x)) < tol


@pytest.mark.parametrize("in_features, group_size", [(768, 0), (192, 0), (256, 128), (512, 256), (1024, 512)])
def test_int4pack_expresses_every_scale_group_as_kernel_groups(in_features, group_size):
    # per-row scales over 768 columns -> 3 kernel groups of 256; 192 -> 3 of 64; 512-wide groups -> 2 x 256
    layer = make_layer(4, group_size, in_features=in_features, out_features=32)
    layer.kernel = "int4pack"
    x = torch.randn(2, in_features, dtype=torch.bfloat16)
    y = layer(x)
    assert layer.last_kernel == "int4pack"
    assert rel_err(y, reference(layer, x)) < TOL[torch.bfloat16]


def test_int4pack_per_row_scales_are_applied_to_the_output_and_the_unit_scales_shared():
    # per-row scales: no (in/gs, out, 2) tensor per layer (0.16 GB at GLM-4-9B), one of ones per shape; the
    # fp16 scale multiplies the output in fp32, so a row scaled by 2**k gives exactly 2**k times its output
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False).half()
    a, b = QuantizedLinear.from_linear(linear, 4, 0), QuantizedLinear.from_linear(linear, 4, 0)
    b.weight_scale.mul_(4)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    for layer in (a, b):
        layer.kernel = "int4pack"
    ya, yb = a(x), b(x)
    assert (a.weight_for("int4pack")[2] is b.weight_for("int4pack")[2]
            and torch.equal(a.weight_for("int4pack")[2][..., 0], torch.ones(1, 64).bfloat16()))
    assert torch.equal(yb, ya * 4)
    assert rel_err(ya, F.linear(x, dequantize(a.state_dict()["weight"], a.weight_scale, 4,
                                              x.dtype))) < TOL[torch.bfloat16]
    grouped = make_layer(4, 128, in_features=256, out_features=64)
    grouped.kernel = "int4pack"
    grouped(x)
    assert grouped.weight_for("int4pack")[3] is None  # group-wise scales stay in the kernel's own tensor


@pytest.mark.parametrize("bits", [8, 4])
def test_auto_uses_the_kernel_for_decode_and_the_faster_path_for_prefill(bits):
    layer = make_layer(bits, 0)
    layer(torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert layer.last_kernel == AUTO_FAST[bits]
    # a bf16 prefill: INT4 stays on the integer-dot kernel where it builds, INT8 takes the dequantizing GEMM where
    # bf16 GEMMs are native
    layer(torch.randn(max(QuantizedLinear.max_kernel_rows, int8dot_cpu.MAX_ROWS_INT8_BF16) + 1, 64,
                      dtype=torch.bfloat16))
    integer_dot = int8dot_cpu.available() and (bits == 4 or not cpu_matmul.native_bf16_gemm())
    assert layer.last_kernel == ("int8dot" if integer_dot else "dequant")


def test_dequant_tiles_cover_every_row(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "TILE_ELEMENTS", 16 * 64)  # 16 rows of 64: 48 rows -> 3 tiles
    layer = make_layer(4, 32)
    layer.kernel = "dequant"
    x = torch.randn(5, 64)
    assert rel_err(layer(x), reference(layer, x)) < TOL[torch.float32]


def test_dequant_tiles_reuse_one_buffer_across_layers_and_calls(monkeypatch):
    """Prefill and backward write every tile into the same workspace; interleaved layers of other
    shapes and formats neither corrupt one another nor allocate a new tile each time."""
    monkeypatch.setattr(cpu_matmul, "TILE_ELEMENTS", 16 * 64)
    layers = [make_layer(4, 32, out_features=64), make_layer(8, 0, out_features=96, seed=1),
              make_layer(4, 0, out_features=64, seed=2)]
    x = torch.randn(7, 64)
    want = [reference(layer, x) for layer in layers]
    for layer in layers:
        layer.kernel = "dequant"
        if layer.bits == 4:
            # held in the kernel layout (whole blocks of 32 or 64 rows) where it reads back
            layer.weight_for("int4pack")
    seen = set()
    for _ in range(2):
        for layer, expect in zip(layers, want):
            xg = x.clone().requires_grad_()
            y = layer(xg)
            assert rel_err(y, expect) < TOL[torch.float32]
            y.backward(torch.ones_like(y))
            tiles = {w.data_ptr() for _, w in kernels.dequant_tiles(layer, torch.float32, x.device)}
            seen |= tiles | {cpu_matmul.workspace("weight", (1,), torch.float32).data_ptr()}
    assert len(seen) == 1  # every tile of every layer, in the one buffer


def test_kernel_guards_fall_back_instead_of_crashing():
    # K = 24 is not a multiple of 16: int8pack would segfault
    layer = make_layer(8, 0, in_features=24)
    layer.kernel = "int8pack"
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    y = layer(x)
    assert layer.last_kernel == "dequant"
    assert rel_err(y, reference(layer, x)) < TOL[torch.bfloat16]
    # N = 24 is not a multiple of 16; K = 48 has no 32..256 kernel group
    for out_f, in_f in ((24, 64), (32, 48)):
        layer = make_layer(4, 0, in_features=in_f, out_features=out_f)
        layer.kernel = "int4pack"
        layer(torch.randn(2, in_f, dtype=torch.bfloat16))
        assert layer.last_kernel == "dequant"


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_intmm_casts_the_integers_and_scales_the_output(bits, group_size, dtype):
    """intmm (the GPU's weight-only form, runnable anywhere when forced): the dequantized matmul for INT8 and per-row
    INT4; group-wise INT4 falls back to dequant. The GPU's tinygemm kernel (int4mm) falls back on the CPU."""
    layer = make_layer(bits, group_size)
    x = torch.randn(5, 64, dtype=dtype)
    for kernel in ("intmm", "int4mm"):
        layer.kernel = kernel
        y = layer(x)
        ran = "intmm" if kernel == "intmm" and (bits == 8 or group_size == 0) else "dequant"
        assert layer.last_kernel == ran and y.dtype == dtype
        assert rel_err(y, reference(layer, x)) < TOL[dtype]


@pytest.mark.parametrize("out_features, in_features, group_size", [(27392, 4096, 0), (4096, 13696, 0), (200, 384, 64)])
def test_int4mm_calls_fit_pytorchs_tinygemm_ops(out_features, in_features, group_size):
    """The GPU's INT4 kernel (`cuda_matmul`) on fake tensors (shapes and dtypes only, no GPU): the repacked layout is
    tinygemm's [out/8, in/(16 x tiles), 32, tiles/2] int32 for an official weight (ChatGLM3-6B's MLP shapes; GLM's
    13696 columns take 128-column groups), the product [rows, out] in the activations' dtype, and the integers read
    back [out, in] int8."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from chatglm_tune.quant import cuda_matmul

    with FakeTensorMode():
        weight = torch.empty(out_features, in_features // 2, dtype=torch.int8)
        scale = torch.empty((out_features, in_features // group_size) if group_size else (out_features,),
                            dtype=torch.float16)
        packed, gs, scale_and_zeros, row_scale = cuda_matmul.int4mm_weight(weight, scale)
        gs_expected, tiles = cuda_matmul.int4mm_shape(in_features, out_features, group_size)
        assert gs == gs_expected and packed.dtype == torch.int32
        assert packed.shape == (out_features // 8, in_features // (16 * tiles), 32, tiles // 2)
        assert scale_and_zeros.shape == (in_features // gs, out_features, 2) and (row_scale is None) == bool(group_size)
        y = cuda_matmul.int4mm(torch.empty(3, in_features, dtype=torch.float16), packed, gs, scale_and_zeros, row_scale)
        assert y.shape == (3, out_features) and y.dtype == torch.float16
        ints = cuda_matmul.int4mm_to_int(packed, gs, in_features, out_features)
        assert ints.shape == (out_features, in_features) and ints.dtype == torch.int8
    assert cuda_matmul.int4mm_shape(384, 12, 0) is None and cuda_matmul.int4mm_shape(200, 16, 0) is None


@pytest.mark.parametrize("bits", [8, 4])
def test_misaligned_input_view_is_handled(bits):
    layer = make_layer(bits, 0)
    layer.kernel = EXPECTED_FAST[bits]
    x = torch.randn(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64)
    assert x.storage_offset() == 1
    y = layer(x)
    assert layer.last_kernel == EXPECTED_FAST[bits]
    assert rel_err(y, reference(layer, x)) < TOL[torch.bfloat16]


def test_unknown_kernel_name_is_rejected():
    layer = make_layer(8, 0)
    layer.kernel = "int3"
    with pytest.raises(ValueError, match="kernel"):
        layer(torch.randn(1, 64))


# ---------------------------------------------------------------------------------------------- (c)


@pytest.mark.parametrize("bits, group_size", FORMATS)
@pytest.mark.parametrize("kernel", ["auto", "dequant"])
def test_backward_gives_the_input_gradient_only(bits, group_size, kernel):
    layer = make_layer(bits, group_size)
    layer.kernel = kernel
    weight = layer.weight.clone()  # the forward may repack it into its kernel's layout
    x = torch.randn(2, 1, 64, requires_grad=True)
    grad_y = torch.randn(2, 1, 48)
    layer(x).backward(grad_y)
    expected = grad_y @ dequantize(weight, layer.weight_scale, bits, torch.float32)
    assert rel_err(x.grad, expected) < TOL[torch.float32]
    for p in layer.parameters():
        assert not p.requires_grad and p.grad is None


def test_a_trainable_adapter_learns_on_a_frozen_quantized_base():
    layer = make_layer(4, 0)
    torch.manual_seed(3)
    adapter = nn.Linear(64, 64, bias=False)  # trained in front of the frozen base
    nn.init.zeros_(adapter.weight)
    x, target = torch.randn(8, 64), torch.randn(8, 48)
    opt = torch.optim.SGD(adapter.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        loss = F.mse_loss(layer(x + adapter(x)), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert layer.weight.grad is None


# ---------------------------------------------------------------------------------------------- (d)


@pytest.mark.parametrize("bits, group_size", FORMATS)
def test_state_dict_save_load_gives_identical_outputs(bits, group_size, tmp_path):
    layer = make_layer(bits, group_size)
    sd = layer.state_dict()
    assert list(sd) == ["weight", "weight_scale", "bias"]
    assert sd["weight"].dtype == torch.int8 and sd["weight_scale"].dtype == torch.float16
    assert sd["bias"].dtype == torch.float16
    save_file(sd, tmp_path / "layer.safetensors")

    loaded = QuantizedLinear(64, 48, bits, group_size, device="meta")
    loaded.load_state_dict(load_file(tmp_path / "layer.safetensors"), assign=True)
    for kernel in ("auto", "dequant"):
        layer.kernel = loaded.kernel = kernel
        for x in (torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(3, 64)):
            assert torch.equal(layer(x), loaded(x))
    assert all(not p.requires_grad for p in loaded.parameters())


def test_loading_new_weights_refreshes_the_repacked_int4_weight(int4pack_auto):
    layer, other = make_layer(4, 0, seed=0), make_layer(4, 0, seed=1)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    layer(x)  # builds the repacked weight
    layer.load_state_dict(other.state_dict())  # in-place copy: same storage, new values
    assert torch.equal(layer(x), other(x))
    assert layer.last_kernel == "int4pack"


int4pack_invertible = pytest.mark.skipif(
    not kernels.int4pack_is_invertible(),
    reason="this CPU's int4pack layout is not one that reads back: both copies are kept"
)


@int4pack_invertible
@pytest.mark.parametrize("group_size", [0, 32])
def test_int4_is_held_once_in_the_kernel_layout_and_nothing_changes(group_size, tmp_path, int4pack_auto):
    layer, twin = make_layer(4, group_size, out_features=128), make_layer(4, group_size, out_features=128)
    decode, prefill = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(40, 64)
    official = layer.state_dict()["weight"].clone()
    y_decode = layer(decode)
    assert layer.last_kernel == "int4pack" and layer.held_layout == "int4pack"
    assert layer.weight.numel() == 0 and "int4pack layout" in repr(layer)
    # the dequantize path (prefill, backward) reads the integers from the kernel layout: bit-identical
    assert torch.equal(layer(prefill), twin(prefill)) and layer.last_kernel == "dequant"
    assert twin.held_layout is None and torch.equal(y_decode, twin(decode))
    x = prefill.clone().requires_grad_()
    layer(x).sum().backward()
    x_twin = prefill.clone().requires_grad_()
    twin.kernel = "dequant"
    twin(x_twin).sum().backward()
    assert torch.equal(x.grad, x_twin.grad)
    # the official weight comes back for saving, loading and moving
    assert torch.equal(layer.state_dict()["weight"], official)
    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    assert torch.equal(load_file(tmp_path / "layer.safetensors")["weight"], official)
    other = make_layer(4, group_size, out_features=128, seed=1)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(decode), other(decode)) and torch.equal(layer.state_dict()["weight"],
                                                                     other.state_dict()["weight"])
    layer.to(torch.float32)
    assert layer.held_layout is None and torch.equal(layer.weight, other.state_dict()["weight"])


@int4pack_invertible
def test_the_kernel_layout_is_read_back_exactly_and_built_in_tiles():
    q = torch.randint(-7, 8, (128, 96), dtype=torch.int8)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).int(), 1)
    assert torch.equal(kernels.int4pack_to_int(whole, 96), q)
    into = torch.full((128, 96), 99, dtype=torch.int8)
    assert torch.equal(kernels.int4pack_to_int(whole, 96, out=into), q) and torch.equal(into, q)
    scale = torch.ones(128, dtype=torch.float16)
    tiled = kernels.int4pack_weight(pack_int4(q), scale, tile_rows=64)[0]  # whole blocks of AVX2 and AVX-512
    assert torch.equal(tiled, whole)


def test_casting_the_model_keeps_the_fp16_scales():
    layer = make_layer(4, 32)
    scale = layer.weight_scale.clone()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert layer.weight_scale.dtype == torch.float16 and torch.equal(layer.weight_scale, scale)
    assert layer.weight.dtype == torch.int8 and "bits=4, group_size=32" in repr(layer)


# ---------------------------------------------------------------------------------------------- (e)


def test_group_wise_int4_beats_per_row_int4_with_outlier_columns():
    torch.manual_seed(4)
    w = torch.randn(64, 256, dtype=torch.float16) * 0.02
    w[:, ::37] *= 30  # a few outlier columns inflate every per-row scale
    errors = {}
    for gs in (0, 32):
        q, scale = quantize_weight(w, 4, gs)
        errors[gs] = rel_err(dequantize(pack_int4(q), scale, 4, torch.float32), w)
    assert errors[32] < 0.7 * errors[0], errors


# ---------------------------------------------------------------------------------------------- (f)

H = 32


def tiny_chatglm(num_layers=2, vocab=50, pre_seq_len=4):
    """Stand-in with the official module names (no forward): blocks, embeddings, LayerNorms, a
    prefix encoder with `trans.0`/`trans.2` Linears, an lm_head and a `dense` outside the blocks."""

    def block():
        return nn.ModuleDict(
            {
                "input_layernorm": nn.LayerNorm(H),
                "attention": nn.ModuleDict({"query_key_value": nn.Linear(H, 3 * H), "dense": nn.Linear(H, H)}),
                "mlp": nn.ModuleDict({"dense_h_to_4h": nn.Linear(H, 4 * H), "dense_4h_to_h": nn.Linear(4 * H, H)}),
            }
        )

    prefix = nn.ModuleDict(
        {
            "embedding": nn.Embedding(pre_seq_len, H),
            "trans": nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, 2 * H)),
        }
    )
    transformer = nn.ModuleDict(
        {
            "word_embeddings": nn.Embedding(vocab, H),
            "layers": nn.ModuleList([block() for _ in range(num_layers)]),
            "final_layernorm": nn.LayerNorm(H),
            "prefix_encoder": prefix,
            "dense": nn.Linear(H, H),  # a target name outside any block: must stay float
        }
    )
    return nn.ModuleDict({"transformer": transformer, "lm_head": nn.Linear(H, vocab, bias=False)})


BLOCK_LINEARS = ["attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"]
EXPECTED_SWAPPED = {f"transformer.layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS}


def quantized_names(model):
    return {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize("bits, group_size", FORMATS)
def test_quantize_model_swaps_exactly_the_block_linears(bits, group_size):
    torch.manual_seed(5)
    model = tiny_chatglm()
    before = {n: m for n, m in model.named_modules()}
    originals = {n: before[n].weight.detach().clone() for n in EXPECTED_SWAPPED}
    quantize_model(model, bits, group_size, targets=QUANTIZABLE_LINEARS)
    assert quantized_names(model) == EXPECTED_SWAPPED
    for name, module in model.named_modules():
        if name in EXPECTED_SWAPPED:
            q, scale = quantize_weight(originals[name], bits, group_size)
            assert torch.equal(module.weight, pack_int4(q) if bits == 4 else q)
            assert torch.equal(module.weight_scale, scale)
        elif not any(name.startswith(s + ".") for s in EXPECTED_SWAPPED):
            assert module is before[name]  # embeddings, LayerNorms, prefix encoder, lm_head untouched


def test_quantize_model_frees_each_float_weight_before_the_next(monkeypatch):
    model = tiny_chatglm()
    seen, alive_at_call = [], []
    original = QuantizedLinear.from_linear.__func__

    def spy(cls, linear, bits, group_size=0):
        alive_at_call.append(sum(ref() is not None for ref in seen))
        seen.append(weakref.ref(linear.weight))
        return original(cls, linear, bits, group_size)

    monkeypatch.setattr(QuantizedLinear, "from_linear", classmethod(spy))
    quantize_model(model, 8, targets=QUANTIZABLE_LINEARS)
    assert len(seen) == 8 and alive_at_call == [0] * 8


def test_quantize_model_refuses_a_wrapped_linear_and_changes_nothing():
    class LoRALinear(nn.Linear):  # a loralib-style subclass would lose its adapter
        pass

    model = tiny_chatglm()
    model.transformer.layers[1].attention.dense = LoRALinear(H, H)
    with pytest.raises(TypeError, match=r"layers\.1\.attention\.dense is LoRALinear"):
        quantize_model(model, 4, targets=QUANTIZABLE_LINEARS)
    assert quantized_names(model) == set()
    with pytest.raises(ValueError, match="no Linear"):
        quantize_model(model.transformer.prefix_encoder, 8, targets=QUANTIZABLE_LINEARS)


@pytest.mark.parametrize("bits, group_size", [(8, 0), (4, 32)])
def test_empty_init_on_meta_loads_a_quantized_checkpoint(bits, group_size, tmp_path):
    model = quantize_model(tiny_chatglm(), bits, group_size, targets=QUANTIZABLE_LINEARS)
    save_file(dict(model.state_dict()), tmp_path / "model.safetensors")
    with torch.device("meta"):
        empty = quantize_model(tiny_chatglm(), bits, group_size, targets=QUANTIZABLE_LINEARS, empty_init=True)
    assert quantized_names(empty) == EXPECTED_SWAPPED
    assert empty.transformer.layers[0].mlp.dense_4h_to_h.weight.device.type == "meta"
    empty.load_state_dict(load_file(tmp_path / "model.safetensors"), assign=True)
    for name in EXPECTED_SWAPPED:
        a, b = model.get_submodule(name), empty.get_submodule(name)
        xin = torch.randn(1, a.in_features, dtype=torch.bfloat16)
        assert torch.equal(a(xin), b(xin))
    assert torch.equal(model.lm_head.weight, empty.lm_head.weight)  # float modules load as usual


# ---------------------------------------------------------------------------------------------- (g)


@pytest.mark.parametrize("mode, tol", [("int8", 0.05), ("nf4", 0.25)])
def test_bitsandbytes_swap_runs_on_cpu(mode, tol):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(6)
    model = tiny_chatglm()
    reference_layer = model.transformer.layers[0].mlp.dense_h_to_4h
    x = torch.randn(3, H)
    expected = reference_layer(x).detach()
    to_bitsandbytes(model, mode, targets=QUANTIZABLE_LINEARS)
    cls = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    swapped = {n for n, m in model.named_modules() if isinstance(m, cls)}
    assert swapped == EXPECTED_SWAPPED
    assert type(model.lm_head) is nn.Linear and type(model.transformer.prefix_encoder.trans[0]) is nn.Linear
    y = model.transformer.layers[0].mlp.dense_h_to_4h(x)
    assert y.shape == (3, 4 * H) and rel_err(y, expected) < tol


def test_bitsandbytes_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode"):
        to_bitsandbytes(tiny_chatglm(), "fp8", targets=QUANTIZABLE_LINEARS)
