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
from test_versions import tiny_runs


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
