"""What a new user meets in the first hour (the aim: nothing lost, nothing surprising), run as the user
runs it: the three command lines in fresh processes, on a tiny model trained here.

Each test names the mistake or surprise it guards against: an empty training file, a run into an
existing directory or onto its own base, a mistyped --model, a quantized run that forgets its prompt
and budget, a QLoRA run inferred in float, files only their owner can read, a training state that
holds the frozen base, warnings that are not the user's business, the official API where people look
for it, and help texts.
"""

import json
import os
import re
import select
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chatglm_tune
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs import loading, rundir
from commands import HANG_S, ROOT, cli, finish, ok, side_by_side, start, wait_until

DEV = ROOT / "data" / "spo_dev.jsonl"
SMALL = ["--max-src-len", "96", "--max-len", "160", "--batch-size", "8", "--threads", "1"]
WARNING = re.compile(r"warn|Removed shared tensor|deprecat", re.IGNORECASE)


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny model trained (full) until it extracts its 24 records, and 2-step LoRA / QLoRA / P-tuning runs on it."""
    root = tmp_path_factory.mktemp("first-hour")
    umask = os.umask(0o022)  # the runs below are made as under the usual umask (test 6)
    (root / "data.jsonl").write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:24]) + "\n",
                                     encoding="utf-8")
    data = ["--train-file", root / "data.jsonl", "--dev-file", root / "data.jsonl", *SMALL]
    base = ok(cli("train.py", "--model", "tiny", "--tuning", "full", *data, "--max-steps", 200, "--lr", "1e-2",
                  "--eval-every", 200, "--output-dir", root / "base"))
    adapters = {  # two cores: the three short runs on the base go side by side
        "lora": ["--tuning", "lora"],
        "qlora": ["--tuning", "lora", "--quantization-bit", 4],
        "ptuning": ["--tuning", "ptuning", "--pre-seq-len", 4],
    }
    done = side_by_side(*(("train.py", "--model", root / "base", *flags, *data, "--max-steps", 2,
                           "--output-dir", root / name)
                          for name, flags in adapters.items()))
    runs = {"base": base} | dict(zip(adapters, done))
    os.umask(umask)
    return root, runs


# 1. An empty training file


def test_an_empty_training_file_is_an_error_naming_it(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    for flags in ((), ("--max-steps", 5)):  # it hung with --max-steps and "trained" 0 steps without
        done = cli("train.py", "--model", "tiny", "--tuning", "full", "--train-file", empty, "--output-dir",
                   tmp_path / "r", *flags)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert f"{empty}: no training records" in done.stderr
        assert not (tmp_path / "r").exists()


def test_a_file_of_only_bad_records_says_so(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": ""}\n{"nope": 1}\n')
    done = cli("train.py", "--model", "tiny", "--tuning", "full", "--train-file", bad, "--output-dir", tmp_path / "r",
               "--on-bad-record", "skip")
    assert done.returncode == 2 and "no training records (skipped 2 bad record(s)" in done.stderr


def test_a_run_that_fails_before_it_starts_leaves_no_directory(tmp_path):
    """A tiny model's tokenizer is written before the rows are built: a row that cannot be built fails the run, and
    what it wrote goes, so the same command, fixed, runs again (it was refused as "not a train.py run directory")."""
    data = tmp_path / "chat.jsonl"
    long = {"messages": [{"role": "user", "content": "你好" * 40}, {"role": "assistant", "content": "好"}]}
    data.write_text(json.dumps(long, ensure_ascii=False) + "\n", encoding="utf-8")
    out = tmp_path / "r"
    args = ["train.py", "--model", "tiny-glm4", "--tuning", "full", "--train-file", data, "--output-dir", out,
            "--max-steps", 1, "--max-src-len", 16]
    done = cli(*args, "--max-len", 20)
    assert done.returncode == 2 and "cuts it before any trained token" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()  # the run made it, and takes it back
    ok(cli(*args, "--max-len", 200))


# 2. Runs into existing directories


def test_a_run_onto_its_own_base_is_refused_and_the_base_is_untouched(work):
    root, _ = work
    before = tree_bytes(root / "base")
    done = cli("train.py", "--model", root / "base", "--tuning", "ptuning", "--train-file", root / "data.jsonl",
               "--output-dir", root / "base", "--overwrite", "--max-steps", 1)
    assert done.returncode == 2 and "is the base model being tuned" in done.stderr
    assert tree_bytes(root / "base") == before


def test_a_run_into_an_existing_run_is_refused_unless_resumed_or_overwritten(work, tmp_path):
    root, _ = work
    args = ["--model", root / "base", "--tuning", "lora", "--train-file", root / "data.jsonl", *SMALL, "--max-steps", 1]
    before = tree_bytes(root / "lora")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    again = tmp_path / "again"
    first_run = start("train.py", *args, "--output-dir", again)  # side by side with the two refused
    into_run = start("train.py", *args, "--output-dir", root / "lora")
    done = cli("train.py", *args, "--output-dir", other, "--overwrite")
    assert done.returncode == 2 and "not a train.py run directory" in done.stderr
    done = finish(into_run)
    assert done.returncode == 2 and "not empty: pass --resume" in done.stderr and "Traceback" not in done.stderr
    assert tree_bytes(root / "lora") == before
    assert (other / "mine.txt").read_text() == "keep me"

    ok(finish(first_run))
    (again / "stale.txt").write_text("from before")
    ok(cli("train.py", *args, "--output-dir", again, "--overwrite"))
    assert not (again / "stale.txt").exists() and (again / "adapter_model.safetensors").exists()


# 3. A mistyped --model


def test_a_missing_model_directory_fails_at_once_without_a_traceback(tmp_path):
    """It was taken for a Hub id: 45 HTTP retries over minutes. Here the Hub is a local socket that never answers
    (HF_ENDPOINT, not offline): train.py must say the directory is missing without ever connecting to it."""
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub_env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}"}
        process = start("train.py", "--model", tmp_path / "chatglm-6bb", "--tuning", "lora", "--train-file", DEV,
                        "--output-dir", tmp_path / "r", env=hub_env)
        called = lambda: bool(select.select([hub], [], [], 0)[0])  # noqa: E731  (a connection waits to be accepted)
        wait_until(lambda: called() or process.poll() is not None, "train.py exiting")
        if called():
            process.kill()
        done = finish(process)
        assert not called(), f"train.py looked {tmp_path / 'chatglm-6bb'} up on the Hub"
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"train.py: error: {tmp_path / 'chatglm-6bb'}: no such directory"


# 4. A quantized run keeps the run's settings


def test_a_quantized_run_infers_with_its_prompt_and_budget_and_scores_as_the_run(work, tmp_path):
    root, _ = work

    def infer(name: str, model: Path) -> subprocess.Popen:
        return start("infer.py", "--model", model, "--input", root / "data.jsonl", "--output",
                     tmp_path / f"{name}.jsonl")

    float_run = infer("float", root / "base")  # beside the quantization
    ok(cli("quantize.py", "--bits", 8, root / "base", tmp_path / "q8"))
    trained = rundir.read_run_args(root / "base")
    carried = rundir.read_run_args(tmp_path / "q8")
    assert carried["encoding"] == trained["encoding"] and carried["tuning"] == "full"
    runs = {"float": float_run, "int8": infer("int8", tmp_path / "q8")}
    scores = {}
    for name, process in runs.items():
        ok(finish(process))
        summary = json.loads((tmp_path / f"{name}.jsonl.summary.json").read_text(encoding="utf-8"))
        encoding = summary["settings"]["encoding"]
        assert (encoding["prompt"], encoding["max_src_len"], encoding["max_len"]) == (
            trained["encoding"]["prompt"], 96, 160)
        scores[name] = summary["scores"]["micro"]["f1"]
    assert scores["float"] > 0.9  # the model learned its records: the comparison means something
    assert abs(scores["int8"] - scores["float"]) <= 0.02, scores


def test_a_run_directory_of_each_kind_quantizes(work, tmp_path):
    root, _ = work
    started = {kind: start("quantize.py", "--bits", 4, root / kind, tmp_path / kind) for kind in ("lora", "ptuning")}
    for kind, process in started.items():
        done = ok(finish(process))
        assert "run it:" in done.stdout
        model, _ = loading.load_run(loading.resolve_run(tmp_path / kind))
        assert model.config.quantization_bit == 4
        assert not any("lora" in name for name, _ in model.named_parameters())  # merged, then quantized
        assert (model.config.pre_seq_len == 4) == (kind == "ptuning")  # the prefix travels with the weights


# 5. A QLoRA run is inferred on INT4 weights


def test_a_qlora_run_infers_on_its_int4_base(work, tmp_path):
    root, _ = work
    source = loading.resolve_run(root / "qlora")
    assert source.quantization_bit == 4
    model, _ = loading.load_run(source)
    blocks = [m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and ".layers." in name]
    assert blocks and all(m.bits == 4 for m in blocks)
    assert any("lora_A" in name for name, _ in model.named_parameters())  # beside the integers, as trained
    done = ok(cli("infer.py", "--model", root / "qlora", "--input", root / "data.jsonl", "--output",
                  tmp_path / "o.jsonl"))
    assert "(INT4 float32, cpu, " in done.stderr


# 6. File permissions


def test_every_file_a_run_writes_follows_the_umask(work, tmp_path):
    root, _ = work
    umask = os.umask(0o022)
    quantized = tmp_path / "q4"
    try:
        ok(cli("quantize.py", "--bits", 4, root / "base", quantized))
    finally:
        os.umask(umask)
    for directory in (root / "base", root / "lora", root / "ptuning", quantized):
        modes = {str(f.relative_to(directory)): stat.S_IMODE(f.stat().st_mode) for f in directory.rglob("*")
                 if f.is_file()}
        assert modes and all(mode == 0o644 for mode in modes.values()), {k: oct(v)
                                                                         for k, v in modes.items() if v != 0o644}


# 7. The training state holds what trains


def test_the_state_of_a_ptuning_run_holds_no_frozen_weight(work):
    from safetensors.torch import load_file

    root, _ = work
    state = load_file(root / "ptuning" / rundir.STATE_DIR / "model.safetensors")
    assert state and all(k.startswith("transformer.prefix_encoder.") for k in state)
    prefix = load_file(root / "ptuning" / "model.safetensors")
    assert state.keys() == prefix.keys()


# 8. Noise, and the facts a user needs


def test_runs_print_a_start_summary_and_no_warnings(work):
    _, runs = work
    for name, done in runs.items():
        lines = [line for line in re.split(r"[\r\n]", done.stderr + done.stdout) if line.strip()]
        assert not [line for line in lines if WARNING.search(line)], name
        out = done.stdout
        assert re.search(r"^data: 24 training records \(0 skipped\), 24 dev records \(0 skipped\)$", out, re.M), name
        assert re.search(r"^truncated: \d+ texts longer than max_src_len=96, \d+ answers longer than", out, re.M), name
        assert re.search(r"^model: \w+, [\d,]+ of [\d,]+ parameters trainable$", out, re.M), name
        assert re.search(r"^steps: \d+ optimizer steps", out, re.M), name
        assert re.search(r"^step \d+: dev loss [\d.]+, micro P/R/F1: ", out, re.M), name  # on a line of its own


# 9. The official API where people look for it


def test_a_lora_run_loads_with_plain_peft_auto_classes(work):
    from peft import AutoPeftModelForCausalLM

    root, _ = work
    adapter_config = json.loads((root / "lora" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((root / "base").resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(root / "lora")
    ours, tokenizer = loading.load_run(loading.resolve_run(root / "lora"))
    ids = torch.tensor([tokenizer.encode("诊断过程：发动机异响。")])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)


def test_quantize_on_an_adapter_directory_points_at_its_base(work, tmp_path):
    root, _ = work
    adapter_only = tmp_path / "adapter"
    adapter_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapter_only / name).write_bytes((root / "lora" / name).read_bytes())
    done = cli("quantize.py", "--bits", 8, adapter_only, tmp_path / "q")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pass the base with --model and this directory with --lora" in done.stderr


# 10. Help texts


@pytest.mark.parametrize("script", ["train.py", "infer.py", "quantize.py", "serve.py", "export.py"])
def test_help_imports_neither_torch_nor_transformers(script):
    probe = ("import runpy, sys; sys.argv = [{0!r}, '--help']\n"
             "try:\n    runpy.run_path({0!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "heavy = [m for m in ('torch', 'transformers', 'peft', 'accelerate', 'chatglm_tune.runs.auto') if m in "
             "sys.modules]\nprint('HEAVY', heavy)").format(str(ROOT / script))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    # What made --help take 2.5 s (7-11 s before that) was importing torch and transformers, for the Auto classes'
    # registration and then for the model code; without them 0.1-0.2 s on a quiet machine. The modules are the
    # check, not a clock (a loaded machine makes any time bound a guess).
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"
    assert "usage:" in done.stdout and "spec section" not in done.stdout


AUTO_PROBE = """
import sys
{first}
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
fixtures = {fixtures!r}
print(type(AutoConfig.from_pretrained(fixtures + "/chatglm3-tiny")).__name__)
print(type(AutoModelForCausalLM.from_pretrained(fixtures + "/chatglm3-tiny")).__name__)
print(type(AutoModel.from_pretrained(fixtures + "/model-small-vocab")).__name__)
print(type(AutoTokenizer.from_pretrained({tokenizer!r})).__name__)
"""


AUTO_FIRSTS = ["import chatglm_tune", "import transformers; import chatglm_tune",
               "import chatglm_tune; import transformers.models.auto.configuration_auto",
               "from chatglm_tune.runs import loading", "import chatglm_tune, importlib.util; "
                                                   "importlib.util.find_spec('transformers.models.auto.configuration_auto')"]


def test_import_chatglm_tune_is_all_the_auto_classes_need(work):
    """Transformers' Auto classes load every version's directory after `import chatglm_tune`, whichever of the
    two was imported first, and after an import of the package's own that imports transformers: one fresh process
    each way (they run side by side)."""
    root, _ = work
    probes = {first: subprocess.Popen(
        [sys.executable, "-c", AUTO_PROBE.format(first=first, fixtures=str(ROOT / "tests" / "fixtures"),
                                                 tokenizer=str(root / "base"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        for first in AUTO_FIRSTS}
    tokenizer = type(chatglm_tune.load_tokenizer(root / "base")).__name__
    for first, probe in probes.items():
        out, err = probe.communicate(timeout=HANG_S)
        assert probe.returncode == 0, (first, err[-3000:])
        names = out.split()
        assert names == ["ChatGLMFamilyConfig", "GlmForCausalLMWithPrefix", "ChatGLMForConditionalGeneration",
                         tokenizer], (first, names)


def test_import_chatglm_tune_imports_neither_torch_nor_transformers():
    done = subprocess.run([sys.executable, "-c", "import sys, chatglm_tune, chatglm_tune.options\n"
                           "print([m for m in ('torch', 'transformers') if m in sys.modules])"],
                          capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_train_help_is_grouped_and_shows_every_default():
    done = ok(cli("train.py", "--help"))
    text = done.stdout
    for group in ("data:", "model:", "tuning:", "optimisation:", "evaluation and saving:", "hardware:"):
        assert f"\n{group}\n" in text, group
    assert "--train-file data/spo_train.jsonl \\\n" in text  # the example keeps its line break
    assert "--dtype {float32,bfloat16,float16}" in text
    flat = " ".join(text.split())
    assert "stop at a bad record, or skip and count it (default error)" in flat
    assert "(default: the base run's, else '按给定的格式抽取文本信息。\\n文本：';" in flat
