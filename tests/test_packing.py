"""Packed training rows (`--packing`): several examples a row, none seeing another, each with the positions it has
alone, so the loss and its gradients equal those of the same examples in rows of their own, for every version that
takes them; a version that takes none (GLM-5.3-Flash: its recurrent states would run from one example into the next)
says why, and its model refuses them."""

from pathlib import Path

import pytest
import torch
from serving import tiny_model

from chatglm_tune.data.batches import (EncodedDataset, SpecialIds, collate_packed, collate_train, pack,
                                       segment_positions, segment_visibility)
from chatglm_tune.data.records import read_records
from chatglm_tune.models import registry
from chatglm_tune.options import EncodingOptions, LoraOptions, TrainOptions
from chatglm_tune.tuning.training import set_trainable

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = sorted(registry.VERSIONS)
PACKED = [name for name in VERSIONS if registry.VERSIONS[name].packing_refusal is None]  # the versions that pack


def test_pack_fills_rows_longest_first_and_keeps_every_row_once():
    lengths = [5, 3, 8, 2, 7, 12]
    rows = pack(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert rows == [[5], [2, 3], [4, 1], [0]]  # 12 alone (too long), then first fit from the longest
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows if len(row) > 1)


def test_segments_give_positions_from_zero_and_no_sight_across_examples():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0]]
    seen = segment_visibility(segments)[0]
    assert seen[4, 3] and not seen[3, 2] and not seen[5].any() and not seen[:, 5].any()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packing")
    return {name: tiny_model(name, root / name) for name in VERSIONS}


def examples(tokenizer, n=5):
    records = read_records(ROOT / "data" / "spo_dev.jsonl")[0][:n]
    return EncodedDataset.from_records(records, tokenizer, EncodingOptions(max_src_len=48, max_len=64)).examples


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("tuning", ["full", "ptuning", "lora"])
def test_packed_rows_give_the_loss_and_gradients_of_separate_rows(models, name, tuning):
    version = registry.VERSIONS[name]
    tokenizer = version.load_tokenizer(models[name])
    torch.manual_seed(0)
    model = version.load_model(models[name], **(dict(pre_seq_len=4) if tuning == "ptuning" else {}))
    options = TrainOptions(tuning=tuning, lora=LoraOptions(r=4, dropout=0.0))  # LoRA: segment_ids through peft
    model = set_trainable(model, options).eval()  # eval: no dropout, the same arithmetic twice
    rows = examples(tokenizer)
    special = SpecialIds.of(tokenizer)
    groups = pack([len(e.input_ids) for e in rows], 150)
    assert len(groups) < len(rows)  # some rows hold several examples
    packed = collate_packed([[rows[i] for i in group] for group in groups], special)
    loss, grads = loss_and_grads(model, packed)
    alone, expect = loss_and_grads(model, collate_train(rows, special))
    torch.testing.assert_close(loss, alone, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expect.keys() and grads
    for key in grads:
        torch.testing.assert_close(grads[key], expect[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_version_that_takes_no_packed_rows_refuses_them(models):
    refusing = [name for name in VERSIONS if name not in PACKED]
    assert refusing == ["glm53-flash"]
    for name in refusing:
        version = registry.VERSIONS[name]
        assert "recurrent state" in version.packing_refusal
        rows = examples(version.load_tokenizer(models[name]))
        packed = collate_packed([rows[:2]], SpecialIds.of(version.load_tokenizer(models[name])))
        with pytest.raises(ValueError, match="packed rows"):
            version.load_model(models[name])(**packed)


def test_train_py_packs_when_asked_and_says_so(models, tmp_path, capsys):
    import train as train_cli

    argv = ["--model", str(models["glm4"]), "--train-file", str(ROOT / "data" / "spo_dev.jsonl"), "--tuning", "full",
            "--max-steps", "2", "--batch-size", "4", "--max-src-len", "48", "--max-len", "128", "--packing",
            "--threads", "1", "--output-dir", str(tmp_path / "run")]
    assert train_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "packed (examples together, up to 128 tokens) rows" in out
    # 200 records of at most 128 tokens, several a row: fewer batches of 4 than the 50 of one record a row
    batches = int(out.split("epochs of ")[1].split(" batches")[0])
    assert batches < 50
