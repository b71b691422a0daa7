"""Tests for chatglm_tune.quant.int8dot_cpu: the integer dot-product kernel on official INT8 / INT4 weights as they
are (activations quantized once per call: int8 in q8_0 blocks of 32 for INT4, int16 in blocks of 64 for INT8, or
int8 there too where asked).

- Its activation quantization equals the PyTorch one (`reference_quantize`) bit for bit, int8 and int16.
- Its output equals the same arithmetic written in PyTorch (`reference`: exact integer block sums, float64 after)
  to fp32 accumulation rounding (relative 1e-5; measured below 1e-6), on odd shapes: `in` not a multiple of 64
  or 128 (a partial chunk), of 32 (a partial block), `out` not a multiple of 4 (single rows), M = 1..5, on 1 and
  2 threads (bit-identical: each output is summed by one thread in one order), on every path this CPU runs.
- The interleaved layout (`pack`, what QuantizedLinear holds for short rows) gives the same outputs bit for bit as the
  official one, read by either path whatever path it was packed for, and `unpack` gives back the official rows.
- Small-integer inputs (block absmax 127, so d = 1; unit weight scales) give the integer matmul exactly.
- Against the fp32 dequantized math, int8 activations: relative error 0.5% with Gaussian activations (the toolkit's
  kernel tolerance is 1e-2; bf16 activations give 0.2%), 1.3% with a few outlier columns 50x the rest (bound
  2e-2), where one scale per row of x gives 8.3%: hence the blocks. int16 activations (INT8's default): < 1e-4.
- QuantizedLinear routes decode (at most `MAX_ROWS` rows; INT8 and per-row INT4) here where it is available, and
  prefill where no gradient flows through x (INT4; INT8 in fp32, or bf16 up to `MAX_ROWS_INT8_BF16` rows), holds
  the weight once (interleaved, the official one rebuilt for saving), and falls back to the previous kernels where it
  cannot build (one warning).
Kernel tests skip where it cannot run (not x86-64 with AVX2, or no compiler).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatglm_tune.quant import cpu_matmul, int8dot_cpu
from chatglm_tune.quant.format import dequantize, pack_int4, quantize_weight
from chatglm_tune.quant.modules import QuantizedLinear

ISAS = int8dot_cpu.supported_isas()
needs_kernel = pytest.mark.skipif(not int8dot_cpu.available(),
                                  reason="the int8 dot-product kernel cannot run or be built here")
each_isa = pytest.mark.parametrize("isa",
                                   ISAS or [pytest.param("none", marks=pytest.mark.skip(reason="no path runs here"))])


def rel_err(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def official(bits: int, out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(out_features, in_features, generator=g).half() * 0.02, bits)
    return (pack_int4(q) if bits == 4 else q), scale


def activations(rows: int, in_features: int, seed: int = 1, outliers: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    if outliers:  # a few columns ~50x the rest, as in ChatGLM's hidden states
        x[:, torch.randperm(in_features, generator=g)[: max(1, in_features // 256)]] *= 50
    return x


@needs_kernel
@pytest.mark.parametrize("in_features", [1, 31, 32, 33, 100, 1056, 4096])
@pytest.mark.parametrize("act", [8, 16])
def test_activation_quantization_is_the_pytorch_one_bit_for_bit(in_features, act):
    qmax, block = 2 ** (act - 1) - 1, int8dot_cpu.ACT_BLOCKS[act]
    x = activations(4, in_features, outliers=True)
    x[1] = 0  # a zero row: scale 0, integers 0
    # block absmax qmax: d = 1, exact ties
    ties = torch.tensor([qmax, 0.5, -0.5, 1.5, 2.5, -2.5, qmax - 0.5])[:in_features]
    x[2, :block] = 0
    x[2, : len(ties)] = ties  # round half to even: 0, -0, 2, 2, -2, qmax - 1
    q, d = int8dot_cpu.quantize_activations(x, act)
    rq, rd = int8dot_cpu.reference_quantize(x, act)
    assert q.dtype == (torch.int8 if act == 8 else torch.int16) and d.shape == (4, -(-in_features // block))
    assert torch.equal(q, rq) and torch.equal(d, rd)
    assert int(q.abs().max()) == qmax and torch.equal(q[1], torch.zeros_like(q[1]))


@needs_kernel
@each_isa
@pytest.mark.parametrize("bits, act", [(8, 16), (8, 8), (4, 8)])
@pytest.mark.parametrize("out_features, in_features",
                         [(36, 1056), (37, 200), (5, 130), (7, 96), (13, 4160), (3, 62), (1, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_the_same_arithmetic_in_pytorch(isa, bits, act, out_features, in_features, threads):
    weight, scale = official(bits, out_features, in_features)
    packed = int8dot_cpu.pack(weight, isa)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for rows in (1, 2, 3, 4, 5, 9):  # tiles of 4 (AVX-512) or 2 (AVX2) rows of x, and the rest
            x = activations(rows, in_features, seed=rows, outliers=True)
            y = int8dot_cpu.matmul(x, weight, scale, bits, isa, act)
            ref = int8dot_cpu.reference(x, weight, scale, bits, act)
            assert y.dtype == torch.float32 and y.shape == (rows, out_features)
            assert rel_err(y, ref) < 1e-5, rows
            assert ((y.double() - ref).abs() <= 1e-5 * ref.abs().max() + 1e-30).all(), rows
            assert torch.equal(int8dot_cpu.matmul(x, packed, scale, bits, isa, act), y), rows
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_features, in_features", [(36, 1056), (13, 200), (8, 128), (1, 2)])
def test_the_interleaved_layout_reads_back_and_serves_either_path(bits, out_features, in_features):
    weight, scale = official(bits, out_features, in_features)
    x = activations(3, in_features)
    for packed_for in int8dot_cpu.INTERLEAVE:
        packed = int8dot_cpu.pack(weight, packed_for)
        il = int8dot_cpu.INTERLEAVE[packed_for]
        # rows padded to whole blocks of 8, each row to whole chunks of 64 bytes, il rows interleaved
        assert packed.shape == (-(-out_features // 8) * 8 // il, -(-weight.shape[1] // 64), il, 64)
        assert torch.equal(int8dot_cpu.unpack(packed, 0, out_features, weight.shape[1]), weight)
        assert torch.equal(int8dot_cpu.unpack(packed, 3, min(11, out_features), weight.shape[1]), weight[3:11])
        for isa in ISAS:  # a layout made for one path is read right by the other
            assert torch.equal(int8dot_cpu.matmul(x, packed, scale, bits, isa),
                               int8dot_cpu.matmul(x, weight, scale, bits, isa))
        # in place (no padding needed: out a multiple of 8, rows of whole chunks): the same bytes, rearranged
        own = weight.clone()
        in_place = int8dot_cpu.pack(own, packed_for, in_place=True)
        assert torch.equal(in_place, packed)
        assert (in_place.data_ptr() == own.data_ptr()) == (out_features % 8 == 0 and weight.shape[1] % 64 == 0)


@needs_kernel
@each_isa
@pytest.mark.parametrize("bits, act", [(8, 16), (4, 8)])
@pytest.mark.parametrize("out_features, in_features", [(24, 1056), (13, 200)])
def test_a_grouped_call_equals_one_call_a_group(isa, bits, act, out_features, in_features):
    """matmul_multi: group g's rows times weight g, as matmul computes each, bit for bit (official and interleaved
    weights, fp16 and fp32 scales, 1 to 5 rows a group)."""
    parts = [official(bits, out_features, in_features, seed=g) for g in range(3)]
    for layout in ("official", "interleaved"):
        weights = [w if layout == "official" else int8dot_cpu.pack(w, isa) for w, _ in parts]
        for rows in (1, 2, 5):
            x = torch.stack([activations(rows, in_features, seed=10 * rows + g) for g in range(3)])
            want = torch.stack([int8dot_cpu.matmul(x[g], weights[g], parts[g][1], bits, isa, act) for g in range(3)])
            for scales in ([s for _, s in parts], [s.float() for _, s in parts]):
                got = int8dot_cpu.matmul_multi(x, weights, scales, bits, isa, act)
                assert got.shape == (3, rows, out_features) and torch.equal(got, want), (layout, rows)
            assert int8dot_cpu.matmul_multi(x.bfloat16(), weights, scales, bits, isa, act).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="a weight and a scale per group"):
        int8dot_cpu.matmul_multi(x, weights[:2], scales, bits, isa, act)


@needs_kernel
@each_isa
@pytest.mark.parametrize("bits, act", [(8, 16), (4, 8)])
def test_groups_of_rows_equal_one_call_a_group(isa, bits, act):
    """matmul_groups: group g's rows of x times weight g, as matmul computes them, bit for bit, the groups' rows one
    after another (groups of 1 to 5 rows, a group of none, two groups over the same rows)."""
    parts = [official(bits, 24, 1056, seed=g) for g in range(4)]
    x = activations(9, 1056, seed=3)
    starts, counts = [0, 1, 4, 1], [1, 3, 5, 0]
    for layout in ("official", "interleaved"):
        weights = [w if layout == "official" else int8dot_cpu.pack(w, isa) for w, _ in parts]
        for order in (range(4), (2, 0, 3, 1)):  # rows of x read in any order
            want = torch.cat([int8dot_cpu.matmul(x[starts[g]:starts[g] + counts[g]], weights[g], parts[g][1],
                                                 bits, isa, act)
                              for g in order if counts[g]])
            got = int8dot_cpu.matmul_groups(x, [starts[g] for g in order], [counts[g] for g in order],
                                            [weights[g] for g in order], [parts[g][1] for g in order], bits, isa, act)
            assert got.shape == (9, 24) and torch.equal(got, want), (layout, order)
        both = int8dot_cpu.matmul_groups(x, [1, 1], [3, 3], weights[:2], [s for _, s in parts[:2]], bits, isa, act)
        assert torch.equal(both[3:], int8dot_cpu.matmul(x[1:4], weights[1], parts[1][1], bits, isa, act))
    with pytest.raises(RuntimeError, match="rows beyond x"):
        int8dot_cpu.matmul_groups(x, [5], [5], weights[:1], [parts[0][1]], bits, isa, act)


@needs_kernel
def test_packing_in_place_goes_tile_by_tile(monkeypatch):
    weight, _ = official(8, 64, 256)
    want = int8dot_cpu.pack(weight, "avx2")
    monkeypatch.setattr(int8dot_cpu, "PACK_TILE_BYTES", 3 * 4 * 256)  # 3 groups of 4 rows a tile: a partial last one
    own = weight.clone()
    assert torch.equal(int8dot_cpu.pack(own, "avx2", in_place=True), want)


@needs_kernel
@each_isa
@pytest.mark.parametrize("bits, act", [(8, 16), (8, 8), (4, 8)])
def test_the_thread_count_does_not_change_a_bit(isa, bits, act):
    weight, scale = official(bits, 4 * 64 + 3, 1056)
    x = activations(3, 1056)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8dot_cpu.matmul(x, weight, scale, bits, isa, act)
        torch.set_num_threads(2)
        assert torch.equal(int8dot_cpu.matmul(x, weight, scale, bits, isa, act), one)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@each_isa
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("in_features", [256, 200])
def test_small_integers_are_exact(isa, bits, in_features):
    """Int8 activations, each block holding +-127 (d = 1 exactly), unit weight scales: every product and sum is an
    exact integer (int16 activations: `test_equals_the_same_arithmetic_in_pytorch`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (3, in_features), generator=g).float()
    x[:, ::32] = 127.0
    qmax = 7 if bits == 4 else 127
    q = torch.randint(-qmax, qmax + 1, (9, in_features), dtype=torch.int8, generator=g)
    q[0], q[1] = qmax, -qmax  # the extremes of both nibbles / bytes
    weight = pack_int4(q) if bits == 4 else q
    y = int8dot_cpu.matmul(x, weight, torch.ones(9, dtype=torch.float16), bits, isa, act=8)
    assert torch.equal(y, (x.double() @ q.double().t()).float())


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("outliers", [False, True])
def test_within_the_kernel_tolerance_of_the_dequantized_math(bits, outliers):
    weight, scale = official(bits, 256, 4096, seed=3)
    x = activations(2, 4096, outliers=outliers)
    ref = x @ dequantize(weight, scale, bits, torch.float32).t()
    tol = 2e-2 if outliers else 1e-2  # measured 0.0128 / 0.0052 (bf16 activations: 0.0015 / 0.0017)
    for isa in ISAS:
        assert rel_err(int8dot_cpu.matmul(x, weight, scale, bits, isa, act=8), ref) < tol
        assert rel_err(int8dot_cpu.matmul(x.bfloat16(), weight, scale, bits, isa, act=8), ref) < tol
        if bits == 8:  # int16 activations, INT8's default: measured 6e-5 with the outliers
            assert rel_err(int8dot_cpu.matmul(x, weight, scale, bits, isa), ref) < 1e-4
    if outliers:  # what the blocks buy: one scale per row of x is 6.5x worse here (0.083)
        q = (x * (127 / x.abs().amax(1, keepdim=True))).round()
        per_row = (q * (x.abs().amax(1, keepdim=True) / 127)) @ dequantize(weight, scale, bits, torch.float32).t()
        assert rel_err(per_row, ref) > 4 * rel_err(int8dot_cpu.matmul(x, weight, scale, bits, act=8), ref)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_nan_and_inf_activations_give_nan_rows_as_the_float_math_does(bits):
    weight, scale = official(bits, 8, 96)
    x = activations(3, 96)
    x[0, 40], x[2, 5] = float("nan"), float("inf")
    for isa in ISAS:
        y = int8dot_cpu.matmul(x, weight, scale, bits, isa)
        assert y[0].isnan().all() and y[2].isnan().all() and y[1].isfinite().all()


def test_formats_it_cannot_take_are_refused():
    assert int8dot_cpu.usable(4096, 4096, 8, 0) and int8dot_cpu.usable(13696, 4096, 4, 0)
    assert not int8dot_cpu.usable(1024, 64, 4, 32)  # group-wise INT4 scales


@needs_kernel
def test_a_path_this_cpu_lacks_is_refused_not_run(monkeypatch):
    weight, scale = official(8, 4, 64)
    for isa in set(int8dot_cpu.ISAS) - set(ISAS):
        with pytest.raises(RuntimeError, match="lacks"):
            int8dot_cpu.matmul(torch.randn(1, 64), weight, scale, 8, isa)


def test_the_path_follows_pytorchs_capability(monkeypatch):
    monkeypatch.setattr(int8dot_cpu, "supported_isas", lambda: ["avx2", "avx512vnni"])
    monkeypatch.setattr(int8dot_cpu, "_x86", lambda: True)
    try:
        for capability, want in (("AVX512", "avx512vnni"), ("AVX2", "avx2"), ("DEFAULT", None)):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            int8dot_cpu.isa.cache_clear()
            assert int8dot_cpu.isa() == want, capability
    finally:
        int8dot_cpu.isa.cache_clear()


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_routes_decode_and_prefill_here(bits):
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(256, 68).half(), bits)
    official_weight = layer.weight.clone()
    for rows in range(1, int8dot_cpu.MAX_ROWS + 1, 3):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        ref = F.linear(x.float(), dequantize(official_weight, layer.weight_scale, bits, torch.float32),
                       layer.bias.float())
        y = layer(x)
        assert layer.last_kernel == "int8dot" and y.dtype == torch.bfloat16
        assert rel_err(y, ref) < 1e-2
    assert layer.held_layout == "int8dot" and layer.weight.numel() == 0  # one copy: the interleaved one
    long = int8dot_cpu.MAX_ROWS_INT8_BF16 + 1
    layer(torch.randn(long, 256))
    assert layer.last_kernel == "int8dot"  # prefill in fp32, the CPU default
    layer(torch.randn(long, 256, dtype=torch.bfloat16))
    native_bf16 = cpu_matmul.native_bf16_gemm()  # where bf16 GEMMs are native, they win there for INT8
    assert layer.last_kernel == ("int8dot" if bits == 4 or not native_bf16 else "dequant")
    layer(torch.randn(int8dot_cpu.MAX_ROWS + 1, 256, requires_grad=True))
    assert layer.last_kernel == "dequant"  # training: the dequantized math, as the backward's
    with torch.no_grad():
        layer(torch.randn(int8dot_cpu.MAX_ROWS + 1, 256, requires_grad=True))
    assert layer.last_kernel == "int8dot"
    grouped = QuantizedLinear.from_linear(nn.Linear(256, 64).half(), 4, group_size=32)
    grouped(torch.randn(1, 256))
    assert grouped.last_kernel != "int8dot"


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("in_features, out_features", [(200, 37), (256, 64)])  # padded; rearranged in place
def test_the_layer_holds_its_weight_once_interleaved_and_nothing_changes(bits, in_features, out_features, tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features).half()
    layer, twin = QuantizedLinear.from_linear(linear, bits), QuantizedLinear.from_linear(linear, bits)
    twin.kernel = "dequant"
    official_weight, where = layer.state_dict()["weight"].clone(), layer.weight.data_ptr()
    decode, prefill = torch.randn(1, in_features), torch.randn(int8dot_cpu.MAX_ROWS + 1, in_features)
    y_decode = layer(decode)
    assert layer.held_layout == "int8dot" and layer.weight.numel() == 0 and "int8dot layout" in repr(layer)
    assert (layer.weight_for("int8dot").data_ptr() == where) == (out_features % 8 == 0)  # in place: one copy ever
    assert torch.equal(y_decode, int8dot_cpu.matmul(decode, official_weight, layer.weight_scale, bits) + layer.bias)
    # the dequantize path (training forward and backward) reads the integers from the interleaved layout: bit-identical
    x, x_twin = prefill.clone().requires_grad_(), prefill.clone().requires_grad_()
    y, y_twin = layer(x), twin(x_twin)
    assert layer.last_kernel == "dequant" and torch.equal(y, y_twin)
    y.sum().backward()
    y_twin.sum().backward()
    assert torch.equal(x.grad, x_twin.grad)
    # the official weight comes back for saving, loading and moving; a forced other kernel rebuilds it
    assert torch.equal(layer.state_dict()["weight"], official_weight)
    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    assert torch.equal(load_file(tmp_path / "layer.safetensors")["weight"], official_weight)
    other = QuantizedLinear.from_linear(nn.Linear(in_features, out_features).half(), bits)
    layer.load_state_dict(other.state_dict())
    assert layer.held_layout is None and torch.equal(layer(decode), other(decode))
    layer.to(torch.float32)
    assert layer.held_layout is None and torch.equal(layer.weight, other.state_dict()["weight"])
    if bits == 8:  # a forced kernel that reads the official weight gets it back
        forced = QuantizedLinear.from_linear(nn.Linear(256, 40).half(), bits)
        weight = forced.weight.clone()
        forced(torch.randn(1, 256))
        forced.kernel = "int8pack"
        forced(torch.randn(1, 256))
        assert forced.last_kernel == "int8pack" and forced.held_layout is None and torch.equal(forced.weight, weight)


@needs_kernel
def test_a_layout_a_forced_kernel_left_is_interleaved_again():
    int4 = QuantizedLinear.from_linear(nn.Linear(256, 64).half(), 4)
    official_weight, x = int4.weight.clone(), torch.randn(1, 256)
    int4.kernel = "int4pack"
    int4(x)
    int4.kernel = "auto"
    y = int4(x)
    assert int4.last_kernel == "int8dot" and int4.held_layout == "int8dot"
    assert torch.equal(int4.state_dict()["weight"], official_weight)
    assert torch.equal(y, int8dot_cpu.matmul(x, official_weight, int4.weight_scale, 4) + int4.bias)


@needs_kernel
def test_a_weight_of_whole_huge_pages_is_held_in_them_where_linux_offers_them():
    from chatglm_tune.quant.format import quantize_rows
    from chatglm_tune.runtime import heap

    layer = QuantizedLinear.from_linear(nn.Linear(4096, 1024).half(), 8)  # 4 MB
    official_weight, x = layer.weight.clone(), torch.randn(1, 4096)
    y = layer(x)
    held = layer.weight_for("int8dot")
    assert (held.data_ptr() % heap.HUGE_PAGE_BYTES == 0) == heap.huge_pages_available()
    assert torch.equal(y, int8dot_cpu.matmul(x, official_weight, layer.weight_scale, 8) + layer.bias)
    assert torch.equal(layer.state_dict()["weight"], official_weight)
    # a weight quantized as loaders do it is in such pages already: rearranged in its own bytes, never copied
    quantized, scale = quantize_rows(torch.randn(1024, 4096), torch.float32, 8, 0)
    assert heap.on_huge_pages(quantized) == heap.huge_pages_available()
    loaded = QuantizedLinear.from_parts(quantized, scale, None, 8)
    where = quantized.data_ptr()
    loaded(x)
    assert loaded.held_layout == "int8dot" and loaded.weight_for("int8dot").data_ptr() == where


@needs_kernel
def test_a_head_tied_to_its_embedding_keeps_the_one_official_copy():
    from chatglm_tune.quant.apply import install_int8_embedding
    from chatglm_tune.quant.format import quantize_rows

    model = nn.Module()
    model.embed, model.head = nn.Embedding(50, 64), None
    model.set_input_embeddings = lambda m: setattr(model, "embed", m)
    model.set_output_embeddings = lambda m: setattr(model, "head", m)
    install_int8_embedding(model, *quantize_rows(torch.randn(50, 64), torch.float32, 8, 0), torch.float32)
    model.head(torch.randn(1, 64))
    assert model.head.last_kernel == "int8dot" and model.head.held_layout is None
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (50, 64)


def test_a_failed_build_keeps_the_previous_kernels_with_one_warning(monkeypatch, no_compiler):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(int8dot_cpu, "_x86", lambda: True)
    int8dot_cpu._build.cache_clear()
    int8dot_cpu.isa.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            assert not int8dot_cpu.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not int8dot_cpu.available()  # cached: no second build, no warning
        layer = QuantizedLinear.from_linear(nn.Linear(64, 32).half(), 8)
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
        assert layer.last_kernel == "int8pack"  # PyTorch's kernel, as before
        layer.kernel = "int8dot"
        layer(torch.randn(1, 64))
        assert layer.last_kernel == "dequant"  # forced but not built: the dequantized math, never a crash
    finally:
        int8dot_cpu._build.cache_clear()
        int8dot_cpu.isa.cache_clear()


@needs_kernel
@pytest.mark.parametrize("batch, rows, entries, width, rope",
                         [(1, 20, 104, 512, 64), (2, 7, 33, 40, 12), (3, 1, 1, 8, 4)])
def test_latent_attentions_products_are_exact_sums_with_the_same_bits_at_any_thread_count(batch, rows, entries, width,
                                                                                          rope):
    """Latent attention's scores (q keys^T + q_rot shared^T) and weighted sums (p keys) from the cache's views (rows of
    a longer buffer): float32 sums within rounding of the float64 ones, and the same bits on one thread and two."""
    g = torch.Generator().manual_seed(entries)
    q, q_rot = torch.randn(batch, rows, width, generator=g), torch.randn(batch, rows, rope, generator=g)
    keys = torch.randn(batch, entries + 5, width, generator=g)[:, :entries]  # a view, as the cache gives
    shared = torch.randn(batch, entries + 5, rope, generator=g)[:, :entries]
    p = torch.rand(batch, rows, entries, generator=g).softmax(-1)
    want = q.double() @ keys.double().transpose(1, 2) + q_rot.double() @ shared.double().transpose(1, 2)
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = (int8dot_cpu.latent_scores(q, q_rot, keys, shared), int8dot_cpu.latent_mix(p, keys))
    finally:
        torch.set_num_threads(before)
    scores, mixed = got[1]
    assert scores.dtype == torch.float32 and scores.shape == (batch, rows, entries)
    assert (scores.double() - want).abs().max() < 1e-5 * want.abs().max()
    assert (mixed.double() - p.double() @ keys.double()).abs().max() < 1e-5 * keys.abs().max()
    assert all(torch.equal(a, b) for a, b in zip(got[1], got[2]))
