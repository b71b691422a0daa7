"""The commands on the tiny presets of the GLMs of late 2026 (`tiny-glm5`: GLM-5's sparse attention;
`tiny-glm53-flash`: GLM-5.3-Flash's linear attention beside it), besides what the shared version tests run on them
(train full / P-tuning with projection / LoRA and infer: test_tiny_released_forms; LoRA on the experts, quantize 8 / 4
and infer on it, served chat: test_moe; served agent chat and streams: test_serve_agent; export: test_export_moe): a
training run stopped and resumed, P-tuning without projection, and infer.py over a file in batches, stopped and
resumed to the file an uninterrupted run writes."""

import json
import shutil

import pytest

from test_tiny_glm4 import in_process
from test_versions import DEV

PRESETS = ["tiny-glm5", "tiny-glm53-flash"]


@pytest.mark.parametrize("preset", PRESETS)
def test_train_resume_ptune_and_infer_resume(preset, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:8]) + "\n", encoding="utf-8")
    common = ["--train-file", data, "--max-src-len", 64, "--max-len", 96, "--batch-size", 4, "--threads", 1]
    base = tmp_path / "base"
    in_process("train.py", "--model", preset, "--tuning", "full", *common, "--max-steps", 2, "--output-dir", base)
    capsys.readouterr()
    in_process("train.py", "--model", preset, "--tuning", "full", *common, "--max-steps", 4, "--output-dir", base,
               "--resume")
    assert f"resuming {base} at step 2" in capsys.readouterr().out
    assert json.loads((base / "state" / "progress.json").read_text())["step"] == 4
    ptuning = tmp_path / "ptuning"
    in_process("train.py", "--model", base, "--tuning", "ptuning", "--pre-seq-len", 3, *common, "--max-steps", 2,
               "--output-dir", ptuning)
    for run in (base, ptuning):
        whole, part = tmp_path / f"{run.name}-whole.jsonl", tmp_path / f"{run.name}-part.jsonl"
        in_process("infer.py", "--model", run, "--input", data, "--output", whole, "--batch-size", 3,
                   "--max-new-tokens", 6, "--threads", 1)
        rows = whole.read_text(encoding="utf-8").splitlines()
        assert len(rows) == 8
        part.write_text("\n".join(rows[:3]) + "\n", encoding="utf-8")  # a run stopped after its third row
        shutil.copy(f"{whole}.model.json", f"{part}.model.json")  # which model wrote it
        in_process("infer.py", "--model", run, "--input", data, "--output", part, "--batch-size", 3,
                   "--max-new-tokens", 6, "--threads", 1, "--resume")
        assert part.read_text(encoding="utf-8").splitlines() == rows
    in_process("infer.py", "--model", ptuning, "--text", "水泵漏油。", "--max-new-tokens", 4, "--threads", 1)
