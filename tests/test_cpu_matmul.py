"""cpu_matmul: bf16 matmuls in fp32 tiles on CPUs without native bf16 GEMMs, exact to an fp32 matmul
rounded once to bf16, forward and backward; decode-sized inputs and native CPUs keep F.linear."""

import pytest
import torch
import torch.nn.functional as F

from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
from chatglm_tune.quant import cpu_matmul, fewrow_cpu


@pytest.fixture
def slow_cpu(monkeypatch):
    """Behave as on an AVX2-only CPU whatever this one is."""
    monkeypatch.setattr(cpu_matmul, "native_bf16_gemm", lambda: False)


def operands(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, 64, generator=g).bfloat16()
    w = torch.randn(80, 64, generator=g).bfloat16()
    b = torch.randn(80, generator=g).bfloat16()
    return x, w, b


def fp32_reference(x, w, b):
    """Forward and all three gradients computed in fp32 from the bf16 values, each rounded once."""
    xf, wf, bf = (t.float().requires_grad_() for t in (x, w, b))
    y = F.linear(xf, wf, bf)
    grad = torch.linspace(-1, 1, y.numel()).view_as(y)
    y.backward(grad.bfloat16().float())
    return y.bfloat16(), grad.bfloat16(), (xf.grad.bfloat16(), wf.grad.bfloat16(), bf.grad.bfloat16())


@pytest.mark.parametrize("tile_elements", [cpu_matmul.TILE_ELEMENTS, 16 * 64])
def test_bf16_rows_run_in_fp32_and_round_once(slow_cpu, monkeypatch, tile_elements):
    monkeypatch.setattr(cpu_matmul, "TILE_ELEMENTS", tile_elements)  # 16 * 64: five 16-row tiles of the 80-row weight
    x, w, b = operands(rows=40)
    expect, grad, expect_grads = fp32_reference(x, w, b)
    calls = []
    original = cpu_matmul._Fp32TiledLinear.apply
    monkeypatch.setattr(cpu_matmul._Fp32TiledLinear, "apply", lambda *a: calls.append(1) or original(*a))
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = cpu_matmul.linear(x, w, b)
    assert calls and y.dtype == torch.bfloat16
    y.backward(grad)
    # one rounding to bf16 of an fp32 result: equal up to a last-bit flip where BLAS orders sums differently
    for got, want in zip((y, x.grad, w.grad, b.grad), (expect, *expect_grads)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2**-8, atol=0)


def test_decode_sized_inputs_and_native_cpus_keep_f_linear(slow_cpu, monkeypatch):
    monkeypatch.setattr(fewrow_cpu, "available", lambda: False)  # its few rows: tests/test_fewrow_cpu.py
    x, w, b = operands(rows=cpu_matmul.MIN_ROWS - 1)
    assert not cpu_matmul.slow_bf16(x)
    assert torch.equal(cpu_matmul.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(cpu_matmul, "native_bf16_gemm", lambda: True)
    x, w, b = operands(rows=40)
    assert torch.equal(cpu_matmul.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(cpu_matmul.linear(x.float(), w.float(), b.float()), F.linear(x.float(), w.float(), b.float()))


def test_bf16_autocast_runs_fp32_weights_in_fp32_and_returns_bf16(slow_cpu):
    x, w, b = operands(rows=40)
    w, b = w.float().requires_grad_(), b.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = cpu_matmul.linear(x.float(), w, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), w, b).bfloat16())
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and torch.allclose(w.grad, x.float().reshape(-1, 64).sum(0).expand(80, 64))


def test_a_bf16_model_on_a_slow_cpu_stays_close_to_fp32_and_trains(slow_cpu):
    torch.manual_seed(0)
    config = ChatGLMConfig.from_name("tiny", vocab_size=512, mask_token_id=500, gmask_token_id=501, bos_token_id=504,
                                     eos_token_id=505, pad_token_id=3)
    model = ChatGLMForConditionalGeneration(config)
    ids = torch.randint(5, 400, (2, 24))
    ids[:, -2:] = torch.tensor([501, 504])
    with torch.no_grad():
        full = model(ids).logits
        half = model.to(torch.bfloat16)(ids).logits
    assert ((half - full).norm() / full.norm()).item() < 0.02
    labels = ids.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_bf16_attention_over_many_queries_runs_in_fp32(slow_cpu):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    mask = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    out = cpu_matmul.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expect = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expect.bfloat16(), rtol=2**-8, atol=1e-6)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = cpu_matmul.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, expect.detach().bfloat16())
    decode = [t.detach()[:, :, -1:] for t in (q, k, v)]  # one query: PyTorch's own kernel
    assert torch.equal(cpu_matmul.scaled_dot_product_attention(*decode), F.scaled_dot_product_attention(*decode))


def test_workspace_is_one_buffer_per_name_and_dtype_grown_when_too_small():
    a = cpu_matmul.workspace("test", (4, 8), torch.float32)
    assert cpu_matmul.workspace("test", (2, 8), torch.float32).data_ptr() == a.data_ptr()
    assert cpu_matmul.workspace("test", (4, 8), torch.int8).data_ptr() != a.data_ptr()  # per dtype
    big = cpu_matmul.workspace("test", (64, 64), torch.float32)
    assert big.shape == (64, 64) and cpu_matmul.workspace("test", (4, 8), torch.float32).data_ptr() == big.data_ptr()


def test_upcast_tiles_all_live_in_the_workspace(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "TILE_ELEMENTS", 16 * 64)
    _, w, _ = operands(rows=40)
    tiles = list((rows, t.data_ptr(), t.clone()) for rows, t in cpu_matmul._upcast_tiles(w))
    assert len(tiles) == 5 and len({ptr for _, ptr, _ in tiles}) == 1
    assert torch.equal(torch.cat([t for _, _, t in tiles]), w.float())


def test_capability_avx2_counts_as_a_cpu_without_native_bf16(tmp_path):
    """`ATEN_CPU_CAPABILITY=avx2` (how the benches act as an AVX2-only CPU) must take the fp32 attention: on an
    AMX CPU oneDNN still reports bf16 there, and PyTorch's bf16 flash attention over many queries then fails."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ATEN_CPU_CAPABILITY=avx2 is an x86 setting")
    code = ("import torch; from chatglm_tune.quant import cpu_matmul\n"
            "assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"
            "assert not cpu_matmul.native_bf16_gemm()\n"
            "q = torch.randn(1, 2, 64, 16).bfloat16()\n"
            "mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()\n"
            "out = cpu_matmul.scaled_dot_product_attention(q, q, q, attn_mask=mask)\n"
            "assert out.dtype == torch.bfloat16 and out.isfinite().all()\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_one_fp32_query_without_a_mask_is_two_matmuls_and_a_softmax(monkeypatch):
    """A decode step's attention: the same numbers as PyTorch's SDPA, without its slow CPU flash kernel."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 1, 16, generator=g)
    k, v = (torch.randn(3, 4, 37, 16, generator=g) for _ in range(2))
    expect = F.scaled_dot_product_attention(q, k, v)
    calls = []
    monkeypatch.setattr(cpu_matmul.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1))
    out = cpu_matmul.scaled_dot_product_attention(q, k, v)
    assert not calls
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
