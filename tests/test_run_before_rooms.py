"""Runs trained before the package's modules moved into rooms (subpackages) still load and answer the same.

tests/fixtures/run-before-rooms holds three train.py runs made with the code of before the move, from the
repository root (their run_args.json name the base by the absolute path it had there):

    train.py --model tiny --tiny-layers 1 --tuning full --train-file F/train.jsonl --dev-file F/dev.jsonl \
        --max-steps 4 --output-dir F/base --threads 1
    train.py --model F/base --tuning ptuning --pre-seq-len 4 ... --max-steps 2 --output-dir F/ptuning
    train.py --model F/base --tuning lora --lr 1e-2 ... --max-steps 2 --output-dir F/lora

(F/train.jsonl, F/dev.jsonl: the first 20 and 10 lines of data/spo_train.jsonl and data/spo_dev.jsonl; the runs'
state/ folders and loss curves left out), and `golden.json` + `logits.safetensors`, which `python
tests/test_run_before_rooms.py` wrote with that same code: each adapted run's greedy answers to the first
dev texts (prompt ids, answer ids, text, and the smallest gap between the best and second-best logit along the
answer), and the logits of one forward of the first prompt (its last 4 positions).

Checked here on a copy of the fixture (the base path pointed at the copy): each run loads with
`loading.load_run(loading.resolve_run(run))`; the prefix equals the saved one bit for bit (the LoRA run: its
base's weights plus the saved adapter, merged); the logits match the saved ones to 1e-4; each golden answer
is still greedy (teacher-forced: at every step its token is the best to 1e-4); and where the golden gaps are
wide (over 1e-3, far beyond what another CPU's rounding moves) extraction answers the same ids and text.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatglm_tune.data.records import read_records
from chatglm_tune.evaluation import extraction
from chatglm_tune.options import ExtractionSettings
from chatglm_tune.runs import loading

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "run-before-rooms"
RUNS = ("ptuning", "lora")
TEXTS = 3  # the first dev records answered
NEW_TOKENS = 12
TIE = 1e-4  # logits closer than this may swap order on another CPU
LOGIT_ROWS = 4  # positions of the first prompt whose logits are saved
WIDE = 1e-3  # a golden whose every step wins by more than this is compared exactly


def copied(tmp: Path) -> dict[str, Path]:
    """The fixture copied into `tmp`, each adapted run's run_args.json naming the copied base."""
    shutil.copytree(FIXTURE, tmp, dirs_exist_ok=True)
    for run in RUNS:
        args_file = tmp / run / "run_args.json"
        args = json.loads(args_file.read_text(encoding="utf-8"))
        args["model"] = str(tmp / Path(args["model"]).name)
        args_file.write_text(json.dumps(args, indent=2, ensure_ascii=False), encoding="utf-8")
    return {run: tmp / run for run in RUNS}


def answers(model, tokenizer, source) -> list[dict]:
    """Greedy extraction of the first dev texts: prompt ids, answer ids, text, and the narrowest winning gap."""
    records, _ = read_records(FIXTURE / "dev.jsonl")
    settings = ExtractionSettings(batch_size=1, max_new_tokens=NEW_TOKENS, encoding=source.encoding)
    rows = [row for batch in extraction.extract(model, tokenizer, records[:TEXTS], settings) for row in batch]
    out = []
    for record, row in zip(records, rows):
        prompt, _ = tokenizer.prompt_format.prompt_ids(tokenizer, record, source.encoding)
        new_ids = extraction_ids(model, tokenizer, prompt, settings)
        assert len(new_ids) == row["new_tokens"]
        gaps = step_logits(model, prompt, new_ids).topk(2, dim=-1).values
        out.append({"prompt_ids": prompt, "new_ids": new_ids, "generated": row["generated"],
                    "narrowest_gap": float((gaps[:, 0] - gaps[:, 1]).min())})
    return out


def extraction_ids(model, tokenizer, prompt: list[int], settings: ExtractionSettings) -> list[int]:
    """The answer ids extraction decodes for one prompt (its `_decode_batch`, a batch of one)."""
    return extraction._decode_batch(model, tokenizer, [prompt], [0], settings, None, None)[0]


@torch.no_grad()
def step_logits(model, prompt: list[int], new_ids: list[int]) -> torch.Tensor:
    """Teacher-forced: the logits that chose each of `new_ids` after `prompt` (one forward, float32)."""
    ids = torch.tensor([prompt + new_ids[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1 :].float()


@torch.no_grad()
def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """The logits at the last `LOGIT_ROWS` positions of one forward of `prompt`."""
    return model(input_ids=torch.tensor([prompt])).logits[0, -LOGIT_ROWS:].float().contiguous()


def write_golden(tmp: Path) -> None:
    """golden.json and logits.safetensors in the fixture folder, from the runs as this code loads them."""
    golden, logits = {}, {}
    for run, directory in copied(tmp).items():
        source = loading.resolve_run(directory)
        model, tokenizer = loading.load_run(source)
        golden[run] = answers(model, tokenizer, source)
        logits[run] = prompt_logits(model, golden[run][0]["prompt_ids"])
    text = json.dumps({"new_tokens": NEW_TOKENS, "runs": golden}, indent=1, ensure_ascii=False)
    (FIXTURE / "golden.json").write_text(text + "\n", encoding="utf-8")
    save_file(logits, FIXTURE / "logits.safetensors")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """{run: (model, tokenizer, source, directory)} for the copied fixture."""
    out = {}
    for run, directory in copied(tmp_path_factory.mktemp("run-before-rooms")).items():
        source = loading.resolve_run(directory)
        out[run] = (*loading.load_run(source), source, directory)
    return out


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((FIXTURE / "golden.json").read_text(encoding="utf-8"))


def test_a_ptuning_run_from_before_loads_its_own_prefix(loaded):
    model, _, source, directory = loaded["ptuning"]
    assert source.pre_seq_len == 4 and source.prefix_dir == directory
    saved = load_file(directory / "model.safetensors")
    state = model.state_dict()
    assert list(saved) == ["transformer.prefix_encoder.embedding.weight"]
    assert torch.equal(state["transformer.prefix_encoder.embedding.weight"], saved[next(iter(saved))])
    base = load_file(directory.parent / "base" / "model.safetensors")
    assert all(torch.equal(state[k], v) for k, v in base.items() if k in state)


def test_a_lora_run_from_before_loads_its_adapter_merged(loaded):
    model, _, source, directory = loaded["lora"]
    assert source.lora_dir == directory
    config = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
    saved = load_file(directory / "adapter_model.safetensors")
    merged = [k.removeprefix("base_model.model.").replace(".lora_A", "") for k in saved if ".lora_A." in k]
    base, state = load_file(directory.parent / "base" / "model.safetensors"), model.state_dict()
    assert merged == ["transformer.layers.0.attention.query_key_value.weight"]
    for key in merged:
        a, b = (saved["base_model.model." + key.replace(".weight", f".{m}.weight")] for m in ("lora_A", "lora_B"))
        expected = base[key] + config["lora_alpha"] / config["r"] * (b @ a)
        torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-6)
    assert all(torch.equal(state[k], v) for k, v in base.items() if k not in merged and k in state)


@pytest.mark.parametrize("run", RUNS)
def test_a_run_from_before_gives_the_same_logits(loaded, golden, run):
    model, _, _, _ = loaded[run]
    saved = load_file(FIXTURE / "logits.safetensors")[run]
    torch.testing.assert_close(prompt_logits(model, golden["runs"][run][0]["prompt_ids"]), saved, rtol=0, atol=1e-4)


@pytest.mark.parametrize("run", RUNS)
def test_a_run_from_before_answers_as_it_did(loaded, golden, run):
    model, tokenizer, source, _ = loaded[run]
    records, _ = read_records(FIXTURE / "dev.jsonl")
    new_tokens, golden = golden["new_tokens"], golden["runs"][run]
    assert len(golden) == TEXTS
    for record, expected in zip(records, golden):
        prompt, _ = tokenizer.prompt_format.prompt_ids(tokenizer, record, source.encoding)
        assert prompt == expected["prompt_ids"]
        assert tokenizer.prompt_format.decode_answer(tokenizer, expected["new_ids"]) == expected["generated"]
        logits = step_logits(model, prompt, expected["new_ids"])
        chosen = logits.gather(1, torch.tensor(expected["new_ids"])[:, None])[:, 0]
        assert (chosen >= logits.max(dim=-1).values - TIE).all()  # still greedy, up to a rounding tie
    wide = [expected for expected in golden if expected["narrowest_gap"] > WIDE]
    assert wide, "no golden answer wins by a clear gap at every step: nothing compared exactly"
    settings = ExtractionSettings(batch_size=1, max_new_tokens=new_tokens, encoding=source.encoding)
    for expected in wide:
        assert extraction_ids(model, tokenizer, expected["prompt_ids"], settings) == expected["new_ids"]
    rows = [row for batch in extraction.extract(model, tokenizer, records[:TEXTS], settings) for row in batch]
    assert [row["generated"] for row, expected in zip(rows, golden) if expected in wide] == [
        expected["generated"] for expected in wide]


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        write_golden(Path(scratch))
    sys.exit(0)
