"""fewrow_cpu: a few rows of x times an fp32 or bf16 weight, each weight read once; the arithmetic of a row of x
independent of the other rows, the tiles and the threads; taken by the models' Linears where no gradient flows."""

import pytest
import torch
import torch.nn.functional as F

from chatglm_tune.quant import cpu_matmul, fewrow_cpu

pytestmark = pytest.mark.skipif(not fewrow_cpu.available(), reason="the few-row kernel needs x86-64 with AVX2 and FMA")

# (out, in): whole 8-column pieces and 4-row blocks, and tails of both
SHAPES = [(64, 64), (7, 13), (33, 67), (4, 8), (1, 1), (130, 1030)]


def operands(n, k, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((m, k), (n, k), (n,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_products_match_float64(n, k, dtype):
    for m in (1, 2, 3, 4, 5, 9, fewrow_cpu.MAX_ROWS):
        x, w, b = operands(n, k, m, dtype, seed=m)
        y = fewrow_cpu.matmul(x, w, b)
        want = x.double() @ w.double().T + b.double()
        assert y.dtype == dtype and y.shape == (m, n)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
        else:  # fp32 products of the bf16 values, rounded once
            torch.testing.assert_close(y, want.to(dtype), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_in_a_batch_and_on_any_threads(dtype):
    x, w, b = operands(130, 1030, 11, dtype)
    batch = fewrow_cpu.matmul(x, w, b)
    alone = torch.cat([fewrow_cpu.matmul(x[i : i + 1], w, b) for i in range(len(x))])
    assert torch.equal(alone, batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = fewrow_cpu.matmul(x, w, b)
        torch.set_num_threads(1)
        assert torch.equal(fewrow_cpu.matmul(x, w, b), two)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, batch)


def test_leading_dimensions_and_views():
    x, w, b = operands(40, 64, 6, torch.float32)
    x3 = x.view(2, 3, 64)
    assert torch.equal(fewrow_cpu.matmul(x3, w, b), fewrow_cpu.matmul(x, w, b).view(2, 3, 40))
    last = torch.randn(2, 5, 64)[:, -1:]  # a model's last position: a view with a stride
    torch.testing.assert_close(fewrow_cpu.matmul(last, w), F.linear(last, w), rtol=1e-5, atol=1e-5)


def test_routes_only_few_float_rows_without_a_gradient():
    x, w, _ = operands(40, 64, 2, torch.float32)
    assert fewrow_cpu.routes(x, w)
    assert fewrow_cpu.routes(x.bfloat16(), w.bfloat16())
    assert not fewrow_cpu.routes(torch.randn(fewrow_cpu.MAX_ROWS + 1, 64), w)  # prefill: PyTorch's GEMM
    assert not fewrow_cpu.routes(x.half(), w.half())
    assert not fewrow_cpu.routes(x, w.bfloat16())
    assert not fewrow_cpu.routes(x, w.t().contiguous().t())  # a transposed view
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fewrow_cpu.routes(x, w)  # autocast's product is bf16
    assert not fewrow_cpu.routes(x.requires_grad_(), w)  # training
    with torch.no_grad():
        assert fewrow_cpu.routes(x, w.requires_grad_())


def test_linear_takes_it_where_it_routes(monkeypatch):
    x, w, b = operands(40, 64, 3, torch.float32)
    assert torch.equal(cpu_matmul.linear(x, w, b), fewrow_cpu.matmul(x, w, b))
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    monkeypatch.setattr(cpu_matmul, "native_bf16_gemm", lambda: False)
    assert torch.equal(cpu_matmul.linear(xb, wb, bb), fewrow_cpu.matmul(xb, wb, bb))
    monkeypatch.setattr(cpu_matmul, "native_bf16_gemm", lambda: True)  # bf16 there: PyTorch's own product
    assert torch.equal(cpu_matmul.linear(xb, wb, bb), F.linear(xb, wb, bb))
    w.requires_grad_()
    assert torch.equal(cpu_matmul.linear(x, w, b), F.linear(x, w, b))  # a gradient flows: PyTorch's


def test_glm_models_build_their_linears_as_the_toolkits():
    from pathlib import Path

    from chatglm_tune.models.glm.modeling import load_glm

    model = load_glm(Path(__file__).parent / "fixtures" / "glm4-tiny", pre_seq_len=4, prefix_projection=True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is cpu_matmul.Linear for m in linears)


def test_a_compiled_graph_calls_it_without_a_break():
    x, w, b = operands(64, 48, 3, torch.float32)

    def step(x):
        return torch.relu(cpu_matmul.linear(x, w, b))

    with torch.no_grad():
        explained = torch._dynamo.explain(step)(x)
        assert explained.graph_count == 1 and not explained.break_reasons
        assert any("chatglm_fewrow_cpu" in str(node.target) for node in explained.graphs[0].graph.nodes)
        assert torch.equal(torch.compile(step, backend="eager")(x), step(x))
