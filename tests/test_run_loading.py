"""Run directories load through every door, for ChatGLM-6B, ChatGLM3 and GLM-4 alike.

On tiny runs trained here with train.py (a full fine-tune from scratch, then 2-step LoRA and P-tuning
runs on it, all with a 96/160 length budget, not the default one):
- a LoRA run records its base (an absolute path), so peft's `AutoPeftModelForCausalLM` loads it offline;
- a P-tuning or LoRA run loads with `chatglm_tune.from_pretrained` and `AutoModel` as its base plus the
  run's prefix or adapter; the model classes say what a prefix-only directory is; train.py refuses one
  as the base to tune, naming the base and --resume;
- a prefix of another version (its config.json) or shape than the model is refused, naming both;
- a bare prefix or adapter (no run_args.json) runs with the prompt and budget of its base's run.
"""

import importlib.util
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import chatglm_tune
import train as train_cli
from chatglm_tune.runs import loading, rundir
from chatglm_tune.runtime.checkpoint import CheckpointError
from commands import ROOT, cli

DEV = ROOT / "data" / "spo_dev.jsonl"
PRESETS = ("tiny", "tiny-chatglm3", "tiny-glm4")
NAMES = {"tiny": "ChatGLM-6B", "tiny-chatglm3": "ChatGLM3-6B", "tiny-glm4": "GLM-4"}
BUDGET = {"max_src_len": 96, "max_len": 160}  # the runs' budget; EncodingOptions' default is 256/288
SMALL = ["--max-src-len", 96, "--max-len", 160, "--batch-size", 8, "--threads", 1]
TEXT = "诊断过程：发动机异响。"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{preset: {"base", "lora", "ptuning": run directory}}, and the data file they trained on."""
    root = tmp_path_factory.mktemp("run-loading")
    data = root / "data.jsonl"
    data.write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:8]) + "\n", encoding="utf-8")
    flags = ["--train-file", data, *SMALL, "--max-steps", 2]
    out = {}
    train = lambda *args: train_cli.main([str(a) for a in args]) == 0  # noqa: E731  (in this process: no start-up)
    for preset in PRESETS:
        base = root / f"{preset}-base"
        assert train("--model", preset, "--tuning", "full", *flags, "--output-dir", base)
        out[preset] = {"base": base}
        for tuning in ("lora", "ptuning"):
            run = root / f"{preset}-{tuning}"
            own = ["--pre-seq-len", 4] if tuning == "ptuning" else ["--lr", "1e-2"]  # LoRA moving the logits in 2 steps
            assert train("--model", base, "--tuning", tuning, *own, *flags, "--output-dir", run)
            out[preset][tuning] = run
    return out, data


def bare_copy(run: Path, directory: Path, names) -> Path:
    """The adapter files of a run without its run_args.json and tokenizer: a bare prefix or peft adapter."""
    directory.mkdir()
    for name in names:
        shutil.copy(run / name, directory / name)
    return directory


def bare_prefix(run: Path, directory: Path) -> Path:
    return bare_copy(run, directory, ("config.json", "model.safetensors"))


def logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def offline(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# A. A LoRA run is a plain peft adapter


@pytest.mark.parametrize("preset", PRESETS)
def test_a_lora_run_records_its_base_and_loads_with_auto_peft(runs, preset, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    offline(monkeypatch)
    run = runs[0][preset]
    adapter_config = json.loads((run["lora"] / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(run["base"].resolve())
    from safetensors import safe_open

    with safe_open(run["lora"] / "adapter_model.safetensors", "pt") as saved:  # the adapter, not the embedding too
        assert list(saved.keys()) and all("lora_" in key for key in saved.keys())
    model = AutoPeftModelForCausalLM.from_pretrained(run["lora"])
    ours, tokenizer = loading.load_run(loading.resolve_run(run["lora"]))
    torch.testing.assert_close(logits(model, tokenizer), logits(ours, tokenizer), rtol=1e-4, atol=1e-4)


# B. A P-tuning or LoRA run through the front door


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tuning", ["ptuning", "lora"])
def test_a_run_loads_with_from_pretrained_and_auto_model_as_base_plus_adapter(runs, preset, tuning, monkeypatch):
    from transformers import AutoModel, AutoModelForCausalLM

    offline(monkeypatch)
    run = runs[0][preset]
    ours, tokenizer = loading.load_run(loading.resolve_run(run[tuning]))
    expected = logits(ours, tokenizer)
    base = logits(chatglm_tune.from_pretrained(run["base"]), tokenizer)
    assert (expected - base).abs().max() > 1e-4  # the adapter changes the logits: the base alone would not do
    for load in (chatglm_tune.from_pretrained, AutoModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
        model = load(run[tuning])
        assert (getattr(model.config, "pre_seq_len", None) == 4) == (tuning == "ptuning"), load
        torch.testing.assert_close(logits(model, tokenizer), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_model_class_says_a_ptuning_run_is_a_prefix_and_names_its_base(runs, preset):
    from chatglm_tune.models.chatglm6b.modeling import ChatGLMForConditionalGeneration
    from chatglm_tune.models.glm.modeling import load_glm

    run = runs[0][preset]
    load = ChatGLMForConditionalGeneration.from_pretrained if preset == "tiny" else load_glm
    with pytest.raises(CheckpointError) as err:
        load(run["ptuning"])
    message = str(err.value)
    assert "is a P-tuning run" in message and str(run["base"].resolve()) in message and "load_prefix" in message
    bare = bare_prefix(run["ptuning"], run["base"].parent / f"{preset}-bare-as-model")
    with pytest.raises(CheckpointError, match="holds only P-tuning prefix weights, not a model"):
        load(bare)


@pytest.mark.parametrize("preset", PRESETS)
def test_train_refuses_an_adapter_run_as_its_base_naming_the_base_and_resume(runs, preset, tmp_path):
    (run, data) = runs[0][preset], runs[1]
    for tuning in ("ptuning", "lora") if preset == "tiny-glm4" else ("ptuning",):
        done = cli("train.py", "--model", run[tuning], "--tuning", "ptuning", "--train-file", data, *SMALL,
                   "--max-steps", 1, "--output-dir", tmp_path / "again")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        base = str(run["base"].resolve())
        assert f"is a --tuning {tuning} run" in done.stderr and f"--model {base} to tune that base" in done.stderr
        assert f"--model {base} --resume --output-dir {run[tuning]}" in done.stderr
        assert not (tmp_path / "again").exists()


# C. A prefix of another version or shape is refused


CROSSED = [("tiny-glm4", "tiny-chatglm3"), ("tiny-chatglm3", "tiny-glm4"), ("tiny", "tiny-glm4"), ("tiny-glm4", "tiny")]


@pytest.mark.parametrize("base_preset, prefix_preset", CROSSED)
def test_a_prefix_of_another_version_is_refused_naming_both(runs, base_preset, prefix_preset, tmp_path):
    all_runs = runs[0]
    base, run = all_runs[base_preset]["base"], all_runs[prefix_preset]["ptuning"]
    both = f"a {NAMES[prefix_preset]} model (its config.json), and {{}} is {NAMES[base_preset]}"
    for prefix in (run, bare_prefix(run, tmp_path / "bare")):  # a train.py run, and an official-style folder
        with pytest.raises(rundir.RunDirectoryError) as err:
            loading.resolve_run(base, ptuning_checkpoint=prefix)
        assert str(prefix) in str(err.value) and both.format(base) in str(err.value)
        model = chatglm_tune.from_pretrained(base, pre_seq_len=4)
        with pytest.raises(CheckpointError) as err:
            model.load_prefix(prefix)
        # the model checks the shapes first: only ChatGLM3's and GLM-4's tiny prefixes are of one shape
        same_shape = {base_preset, prefix_preset} == {"tiny-chatglm3", "tiny-glm4"}
        expected = both.format("this model") if same_shape else "the prefix was trained on another model"
        assert str(prefix) in str(err.value) and expected in str(err.value)


def test_infer_names_both_versions_instead_of_a_tokenizer_error(runs):
    all_runs = runs[0]
    done = cli("infer.py", "--model", all_runs["tiny-glm4"]["base"], "--ptuning-checkpoint",
               all_runs["tiny-chatglm3"]["ptuning"], "--text", TEXT)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "is a P-tuning prefix of a ChatGLM3-6B model" in done.stderr and "is GLM-4" in done.stderr, done.stderr


@pytest.mark.parametrize("base_preset, prefix_preset, theirs, ours, width", [
    ("tiny-glm4", "tiny", 768, 512, "num_layers * 2 * kv_channels * multi_query_group_num = 2 * 2 * 16 * 8"),
    ("tiny", "tiny-chatglm3", 512, 768, "2 * num_layers * hidden_size = 2 * 3 * 128"),
])
def test_a_prefix_of_another_width_is_refused_naming_both(runs, base_preset, prefix_preset, theirs, ours,
                                                          width, tmp_path):
    """A folder whose config.json says only pre_seq_len (no version to read): the shapes decide."""
    all_runs = runs[0]
    base = all_runs[base_preset]["base"]
    prefix = bare_copy(all_runs[prefix_preset]["ptuning"], tmp_path / "prefix", ("model.safetensors",))
    (prefix / "config.json").write_text(json.dumps({"pre_seq_len": 4, "prefix_projection": False}))
    expected = (f"{prefix}: transformer.prefix_encoder.embedding.weight has shape [4, {theirs}], the model expects "
                f"[4, {ours}] (prefix width {ours}: {width}): the prefix was trained on another model")
    with pytest.raises(CheckpointError) as err:
        loading.load_run(loading.resolve_run(base, ptuning_checkpoint=prefix))
    assert str(err.value) == expected


# D. A bare prefix or adapter runs with its base run's prompt and budget


def infer_main(argv) -> None:
    spec = importlib.util.spec_from_file_location("infer_cli", ROOT / "infer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in argv])


@pytest.mark.parametrize("preset", PRESETS)
def test_a_bare_prefix_or_adapter_takes_the_encoding_of_its_base_run(runs, preset, tmp_path):
    (run, data) = runs[0][preset], runs[1]
    trained = rundir.read_run_args(run["base"])["encoding"]
    assert {k: trained[k] for k in BUDGET} == BUDGET
    prefix = bare_prefix(run["ptuning"], tmp_path / "prefix")
    adapter = bare_copy(run["lora"], tmp_path / "adapter", ("adapter_config.json", "adapter_model.safetensors"))
    for source in (loading.resolve_run(run["base"], ptuning_checkpoint=prefix),
                   loading.resolve_run(run["base"], lora=adapter)):
        assert asdict(source.encoding) == trained, source.describe()
        assert source.encoding.answer_budget == 64
    infer_main(["--model", run["base"], "--ptuning-checkpoint", prefix, "--input", data, "--output",
                tmp_path / "o.jsonl", "--batch-size", 8])
    summary = json.loads((tmp_path / "o.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["settings"]["encoding"] == trained
