"""heap: glibc's heap handed back to the system; the large-model guard of `mmap_large_blocks`."""

import subprocess
import sys
import textwrap

import pytest
from torch import nn

from chatglm_tune.runtime import heap

GLIBC = heap._glibc("mallopt") is not None


def _in_a_fresh_process(body: str, kinds: tuple[str, str]) -> dict[str, str]:
    """What `body` prints, run for each of `kinds` (as sys.argv[1]) in a fresh process that loads heap.py alone
    (as `heap`, with sys and torch): glibc's settings are process-wide, and importing transformers first changes
    glibc's heap history."""
    code = (textwrap.dedent(f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("heap", {heap.__file__!r})
        heap = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(heap)
    """) + textwrap.dedent(body))
    return {kind: subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True,
                                 check=True).stdout.strip() for kind in kinds}


def test_small_models_keep_the_default_allocator():
    assert heap.mmap_large_blocks(nn.Linear(64, 64)) is False
    heap.trim()  # callable anywhere; a no-op off glibc


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_freed_large_blocks_leave_the_process_for_a_large_model():
    # After a 16 MB block is freed, glibc serves blocks below 16 MB from the heap, where freed ones stay resident
    # between kept small tensors; with the setting they are mmap'd and leave when freed.
    grown = _in_a_fresh_process("""
        from torch import nn
        def rss_mb():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        if sys.argv[1] == "large":
            heap.LARGE_MODEL_BYTES = 0
            assert heap.mmap_large_blocks(nn.Linear(8, 8))
        block = torch.ones(4 << 20)  # 16 MB, mmap'd; freeing it raises glibc's dynamic threshold to 16 MB
        del block
        before, kept, big = rss_mb(), [], []
        for _ in range(64):
            big.append(torch.ones(2 << 18))  # 2 MB, touched
            kept.append(torch.ones(64))
        del big
        print(rss_mb() - before)
    """, ("default", "large"))
    grown = {kind: float(value) for kind, value in grown.items()}
    assert grown["large"] < 16 < grown["default"], grown


def test_huge_page_tensors_are_aligned_writable_and_freed_with_the_tensor():
    import torch

    assert heap.huge_pages_empty((1024,), torch.float32) is None  # under one 2 MB page: the ordinary allocator
    tensor = heap.huge_pages_empty((3, 1 << 19), torch.float32)  # 6 MB
    if not heap.huge_pages_available():
        assert tensor is None
        return
    assert tensor.shape == (3, 1 << 19) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % heap.HUGE_PAGE_BYTES == 0
    tensor.fill_(2.5)
    assert float(tensor.sum()) == 2.5 * 3 * (1 << 19)
    address = tensor.data_ptr()

    def mapped() -> bool:  # whether a mapping of this process holds the address
        spans = (line.split()[0].split("-") for line in open("/proc/self/maps"))
        return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans)

    assert mapped()
    del tensor
    assert not mapped()


def test_weights_under_one_huge_page_share_such_pages_without_overlapping(monkeypatch):
    """`large_empty` cuts weights from SHARED_PAGE_MIN_BYTES up to one 2 MB page (a mixture-of-experts model's experts)
    one after another from 2 MB-page blocks (a new block where the next does not fit); smaller ones are ordinary
    tensors; every tensor its own bytes."""
    import torch

    if not heap.huge_pages_available():
        pytest.skip("no transparent huge pages here")
    monkeypatch.setattr(heap, "_SHARED", heap._SharedPages())
    monkeypatch.setattr(heap, "SHARED_BLOCK_BYTES", 4 << 20)
    small = heap.large_empty((1000,), torch.int8)
    assert small.untyped_storage().nbytes() == 1000  # not from a block
    pieces = [heap.large_empty((1536, 1000), torch.int8) for _ in range(3)]  # 1.5 MB each: two a 4 MB block
    starts = [t.data_ptr() for t in pieces]
    assert starts[0] % heap.HUGE_PAGE_BYTES == 0 and starts[1] == starts[0] + 1536 * 1000  # 1536000: a 64-byte multiple
    assert starts[2] % heap.HUGE_PAGE_BYTES == 0 and starts[2] != starts[0]  # a new block
    for value, piece in enumerate(pieces):
        piece.fill_(value)
    assert [int(piece.float().mean()) for piece in pieces] == [0, 1, 2]
    half = heap.large_empty((512, 1024), torch.float16)  # 1 MB of fp16, after the third piece
    assert half.dtype == torch.float16 and half.data_ptr() == starts[2] + 1536 * 1000


def test_a_prefill_trims_after_each_layer_and_a_decode_step_or_training_does_not(monkeypatch):
    import torch

    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    heap.trim_after_each(layers)

    def forward(rows):
        x = torch.randn(1, rows, 8)
        for layer in layers:
            x = layer(x)

    with torch.no_grad():
        forward(heap.TRIM_MIN_ROWS)  # a prefill: after every layer
        assert len(trims) == 3
        forward(heap.TRIM_MIN_ROWS - 1)  # a (batched) decode step: never
        assert len(trims) == 3
    forward(64)  # with gradients (training): never
    assert len(trims) == 3


def test_quantizing_rows_gives_its_temporaries_back(monkeypatch):
    import torch

    from chatglm_tune.quant.format import quantize_rows

    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    q, scale = quantize_rows(torch.randn(40, 64, dtype=torch.float16), torch.bfloat16, 8, 0)
    assert q.shape == (40, 64) and scale.shape == (40,) and trims == [1]


def test_inside_one_trim_a_prefill_trims_once_at_the_end(monkeypatch):
    import torch

    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    heap.trim_after_each(layers)

    def prefill():
        x = torch.randn(1, heap.TRIM_MIN_ROWS, 8)
        for layer in layers:
            x = layer(x)

    with torch.no_grad():
        with heap.one_trim():
            prefill()
            with heap.one_trim():  # nested: still one trim, at the outer end
                prefill()
            assert trims == []
        assert trims == [1]
        prefill()  # outside: after every layer again
        assert len(trims) == 4


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_large_blocks_come_from_the_heap_for_a_server():
    # A 40 MB block is a fresh mmap by glibc's defaults (over its 32 MB automatic limit), whose pages a prefill's
    # next layer would fault in anew; with the setting it lies in the heap, where freed pages stay for the next
    # layer until `trim()`.
    in_heap = _in_a_fresh_process("""
        if sys.argv[1] == "heap":
            assert heap.heap_large_blocks()
        block = torch.ones(10 << 20)  # 40 MB
        spans = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
        print(any(int(a, 16) <= block.data_ptr() < int(b, 16) for a, b in spans))
    """, ("default", "heap"))
    assert in_heap == {"default": "False", "heap": "True"}
