"""The batch KV cache both decoders use: rows merged into one cache, rows leaving, pad columns cut.

Each row of a merged (and later trimmed) batch gets the scores it gets decoding alone, within fp32 rounding;
the cache holds the prefix plus the longest live row, no more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chatglm_tune.data.batches import SpecialIds, collate_prompts
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.models import registry
from chatglm_tune.options import EncodingOptions

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [json.loads(line)["text"]
         for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:12]]


@pytest.fixture(scope="module", params=[("chatglm3", None), ("chatglm3", 3), ("chatglm", 3)],
                ids=lambda p: f"{p[0]}{'-prefix' if p[1] else ''}")
def tiny(request, tmp_path_factory):
    name, prefix = request.param
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS[name].tiny(TEXTS, tmp_path_factory.mktemp(name),
                                                    **({"pre_seq_len": prefix} if prefix else {}))
    return model.eval(), tokenizer, prefix or 0


def prefilled(model, tokenizer, prompts):
    batch = collate_prompts(prompts, SpecialIds.of(tokenizer))
    return BatchCache.prefill(model, batch["input_ids"], batch["attention_mask"])


def cached_length(cache: BatchCache) -> int:
    return cache.cache.layers[0].keys.shape[-2]


@torch.inference_mode()
def test_merged_and_trimmed_rows_decode_as_alone(tiny):
    model, tokenizer, prefix = tiny
    fmt = tokenizer.prompt_format
    long_prompt, short_prompt = sorted((fmt.prompt_ids(tokenizer, SPORecord(t, None), EncodingOptions())[0]
                                        for t in TEXTS[:2]), key=len, reverse=True)
    assert len(long_prompt) > len(short_prompt)
    alone = [prefilled(model, tokenizer, [p]) for p in (long_prompt, short_prompt)]
    batch, scores = prefilled(model, tokenizer, [long_prompt])
    other, other_scores = prefilled(model, tokenizer, [short_prompt])
    batch.merge(other)
    assert batch.padded and batch.mask.shape == (2, len(long_prompt))
    assert cached_length(batch) == prefix + len(long_prompt)
    tokens = torch.cat([scores, other_scores]).argmax(-1)
    merged = batch.step(model, tokens)
    for row, (cache, first) in enumerate(alone):
        torch.testing.assert_close(merged[row], cache.step(model, first.argmax(-1))[0], rtol=1e-4, atol=1e-4)
    batch.select(torch.tensor([1]))  # the long row leaves: its columns are pads of the short row only
    batch.trim()
    assert not batch.padded and batch.mask.shape == (1, len(short_prompt) + 1)
    assert cached_length(batch) == prefix + len(short_prompt) + 1
    token = merged[1:].argmax(-1)
    torch.testing.assert_close(batch.step(model, token)[0], alone[1][0].step(model, token)[0], rtol=1e-4, atol=1e-4)


def test_the_growing_cache_writes_in_place_and_takes_tensors_set_from_outside():
    """A decode step writes into the room the layer keeps (the buffer stays, no copy of what is cached); keys set
    from outside (a row selection) are taken into new buffers; a view cut shorter (rejected guesses) is written
    over; every state equals what concatenation gives."""
    from transformers.cache_utils import DynamicLayer

    from chatglm_tune.decoding.growing_cache import GrowingLayer

    torch.manual_seed(0)
    growing, plain = GrowingLayer(), DynamicLayer()
    steps = [torch.randn(3, 2, n, 4) for n in (5, 1, 1, 3)]
    for layer in (growing, plain):
        layer.update(steps[0], -steps[0])
    buffer = growing.keys.data_ptr()
    for new in steps[1:]:
        for layer in (growing, plain):
            out = layer.update(new, -new)
        assert torch.equal(out[0], growing.keys) and torch.equal(growing.keys, plain.keys)
    assert growing.keys.data_ptr() == buffer  # written in place: 10 columns fit the first buffer's room
    for layer in (growing, plain):  # a speculative accept that drops the last two columns of every row
        layer.keys, layer.values = layer.keys[..., :8, :], layer.values[..., :8, :]
        layer.update(steps[1], -steps[1])
    assert growing.keys.data_ptr() == buffer and torch.equal(growing.values, plain.values)
    index = torch.tensor([0, 2])
    for layer in (growing, plain):  # rows leave: tensors of their own
        layer.batch_select_indices(index)
        layer.update(steps[2][index], -steps[2][index])
    assert growing.keys.data_ptr() != buffer
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)
