"""The tiny presets of the versions released in transformers' form (`--model tiny-glm4-0414`, `tiny-glm-edge`,
`tiny-glm4-moe`, `tiny-glm47-flash`, `tiny-glm5`, `tiny-glm53-flash`),
end to end and cheaply: train.py `--tuning full` for a few steps, P-tuning v2 and LoRA on that run for 2 steps each
(`test_versions.tiny_runs`, as for the tiny GLM-4, without a dev file: no generation while training),
each run read back from its own directory and run by infer.py.
Whether they learn is bench/training/adapt.py's question (bench/results/adapt-glm4-0414.json), not this file's.
"""

import json

import pytest

from chatglm_tune.models import registry
from chatglm_tune.models.glm.config import TRANSFORMERS_FORMS
from chatglm_tune.options import TINY_PRESETS
from chatglm_tune.runs import loading
from test_tiny_glm4 import in_process
from test_versions import DEV, tiny_runs


@pytest.mark.parametrize("preset", ["tiny-glm4-0414", "tiny-glm-edge", "tiny-glm4-moe", "tiny-glm47-flash",
                                    "tiny-glm5", "tiny-glm53-flash"])
def test_a_tiny_released_form_trains_then_ptunes_and_lora_tunes_end_to_end(preset, tmp_path):
    version = TINY_PRESETS[preset]
    root = tiny_runs(tmp_path, preset, base_steps=4, run=in_process, dev=False)
    assert registry.of_directory(root / "base").name == version
    assert json.loads((root / "base" / "config.json").read_text())["model_type"] == TRANSFORMERS_FORMS[version]
    for name in ("base", "ptuning", "lora"):
        model, _ = loading.load_run(loading.resolve_run(root / name))
        assert model.config.chatglm_version == version, name
        assert (model.config.pre_seq_len == 4) == (name == "ptuning"), name
        in_process("infer.py", "--model", root / name, "--text", "水泵漏油。", "--max-new-tokens", 4, "--threads", 1)
    adapter_config = json.loads((root / "lora" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == sorted(registry.VERSIONS[version].lora_targets)


def test_glm53_flash_ptunes_without_projection_and_a_stopped_run_resumes_as_uninterrupted(tmp_path, capsys):
    """The tiny GLM-5.3-Flash's prefix without its projection (an embedding of the layers' width: KDA layers' virtual
    keys and values, sparse layers' heads' keys and values), trained with dropout over 2 micro-batches a step: a
    SIGTERM mid-run saves the last step, and the run resumed ends as the uninterrupted one (its log and prefix)."""
    import os
    import subprocess
    import sys

    from commands import HANG_S, ONE_THREAD, ROOT
    from serving import tiny_model

    from chatglm_tune.runtime import crashpoints
    (tmp_path / "data.jsonl").write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:16]) + "\n",
                                         encoding="utf-8")
    base = tiny_model("glm53-flash", tmp_path / "base")
    args = ["--model", base, "--tuning", "ptuning", "--pre-seq-len", 4, "--train-file", tmp_path / "data.jsonl",
            "--max-steps", 4, "--save-every", 1, "--batch-size", 4, "--grad-accum", 2, "--log-every", 1,
            "--max-src-len", 64, "--max-len", 96, "--threads", 1]
    in_process("train.py", *args, "--output-dir", tmp_path / "whole")
    stopped = tmp_path / "stopped"
    at = crashpoints.spell("micro-batch", 5, "SIGTERM")  # in step 3: it finishes, then the run stops
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args), "--output-dir", str(stopped)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, **ONE_THREAD, crashpoints.AT_ENV: at})
    assert done.returncode == 143, done.stderr[-3000:]
    assert json.loads((stopped / "state" / "progress.json").read_text())["step"] == 3
    in_process("train.py", *args, "--output-dir", stopped, "--resume")
    model, _ = loading.load_run(loading.resolve_run(stopped))
    assert model.config.pre_seq_len == 4 and not model.config.prefix_projection

    def log(run):
        entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [e for e in entries if "final" not in e]

    assert log(stopped) == log(tmp_path / "whole")
    assert (stopped / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_glm53_flash_refuses_packed_rows_with_the_reason(tmp_path, capsys):
    import train

    (tmp_path / "data.jsonl").write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:4]) + "\n",
                                         encoding="utf-8")
    code = train.main(["--model", "tiny-glm53-flash", "--tuning", "full", "--train-file", str(tmp_path / "data.jsonl"),
                       "--packing", "--max-steps", "1", "--output-dir", str(tmp_path / "run")])
    assert code == 2
    assert "--packing: GLM-5.3-Flash trains on one example a row" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("layers", [1, 2, 6])
def test_the_tiny_glm53_flash_plans_its_layers_at_any_depth(tmp_path, layers):
    """`--tiny-layers N`: every fourth layer sparse attention as released, and the last at any depth, the others KDA;
    a dense first MLP, experts after; every sparse layer its own indexer. The model runs a batch."""
    import torch

    from chatglm_tune.models.glm.next_prefix import LINEAR

    model, tokenizer = registry.VERSIONS["glm53-flash"].tiny([DEV.read_text(encoding="utf-8")[:2000]], tmp_path,
                                                              num_hidden_layers=layers)
    config = model.config
    sparse = [i for i, kind in enumerate(config.layer_types) if kind != LINEAR]
    assert len(config.layer_types) == len(config.mlp_layer_types) == len(config.indexer_types) == layers
    assert sparse == sorted({i for i in range(layers) if i % 4 == 3} | {layers - 1})
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * (layers - 1) and set(config.indexer_types) == {"full"}
    ids = torch.tensor([tokenizer.encode_text("水泵漏油。发动机异响。")])
    with torch.no_grad():
        assert torch.isfinite(model.eval()(ids).logits).all()
