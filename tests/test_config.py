"""The installed command and run configs in files: `chatglm-tune COMMAND ...` (and `python -m chatglm_tune`) runs each
command line, its `--help` lists them without importing torch; `--config FILE.yaml` gives any command's flags from a
file (typed as the flags, the command line winning, unknown keys and wrong types refused naming file and key); a
training run's run.yaml trains it again to the same weights; every file under examples/ parses with its command, and
the tiny demo's trains as its flags do; the repository's scripts are the package's command modules."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from chatglm_tune import cli
from chatglm_tune.cli import config as cli_config
from commands import HANG_S, ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
COMMANDS = ("train", "infer", "quantize", "serve", "export")
HEAVY = ("torch", "transformers", "peft", "accelerate", "chatglm_tune.runs.auto")


def command_of(example: Path) -> str:
    return example.name.split("-")[0]


def parse(command: str, *argv):
    return importlib.import_module(f"chatglm_tune.cli.{command}").parse_args([str(a) for a in argv])


def refused(capsys, command: str, *argv) -> str:
    """The one error line of a command line that its parser refuses (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        parse(command, *argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def written(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def python(*args, cwd=ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python args` with this checkout first on the path, offline, one thread."""
    environment = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"} | (env or {})
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=environment,
                          timeout=HANG_S)


# 1. The examples


def test_there_are_examples_of_every_command():
    assert {command_of(e) for e in EXAMPLES} == set(COMMANDS)
    trains = [yaml.safe_load(e.read_text(encoding="utf-8")) for e in EXAMPLES if command_of(e) == "train"]
    assert {t["tuning"] for t in trains} == {"full", "ptuning", "lora"}
    assert any(t.get("quantization-bit") for t in trains if t["tuning"] == "lora")  # QLoRA
    assert any("tools" in t["train-file"] for t in trains)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_every_example_parses_with_its_command(example, monkeypatch):
    """Each file says how to run it on its first line and parses with that command's flags (train's also fit
    together); a file for a model directory that the tests do not have says it is only parse-checked."""
    monkeypatch.chdir(ROOT)
    command, text = command_of(example), example.read_text(encoding="utf-8")
    assert text.splitlines()[0] == f"# chatglm-tune {command} --config examples/{example.name}"
    args = parse(command, "--config", example)
    assert args.config == str(example)
    if command == "train":
        import train as train_cli

        train_cli.options_from(args, {})  # ValueError where the flags do not fit together
    model = str(getattr(args, "model", None) or args.model_dir)
    if model.startswith("/models/") or command == "export" and model != "checkpoints/tiny":
        comment = " ".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
        assert "Only parse-checked by the tests" in comment, example.name


# 2. A training run from a file, and again from its run.yaml


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    files = {}
    for name, lines in (("train", 120), ("dev", 6)):
        text = (ROOT / "data" / f"spo_{name}.jsonl").read_text(encoding="utf-8").splitlines()[:lines]
        files[name] = written(root / f"{name}.jsonl", "\n".join(text) + "\n")
    return files


QUICK = ["--max-steps", "3", "--eval-every", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory, small_data) -> dict[str, Path]:
    """The tiny demo's example through the installed command's `main` (in this process), and the same flags on a
    command line; both with a small train and dev file and 3 steps given on the command line."""
    from chatglm_tune.cli import main as dispatcher

    import train as train_cli

    root = tmp_path_factory.mktemp("runs")
    quick = ["--train-file", small_data["train"], "--dev-file", small_data["dev"], *QUICK]
    here = os.getcwd()
    saved = dict(cli._started)
    try:
        os.chdir(ROOT)
        assert dispatcher.main(["train", "--config", "examples/train-tiny-demo.yaml", *map(str, quick),
                                "--output-dir", str(root / "from-file")]) == 0
        cli._started.clear()
        assert train_cli.main(["--model", "tiny", "--tuning", "full", *map(str, quick),
                               "--output-dir", str(root / "from-flags")]) == 0
    finally:
        os.chdir(here)
        cli._started.clear()
        cli._started.update(saved)
    return {"file": root / "from-file", "flags": root / "from-flags", "root": root}


def run_args(run: Path) -> dict:
    return json.loads((run / "run_args.json").read_text(encoding="utf-8"))


def same_tensors(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(first) == sorted(second)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_the_tiny_demo_example_trains_as_its_flags_do(demo_runs):
    assert run_args(demo_runs["file"]) == run_args(demo_runs["flags"])
    same_tensors(demo_runs["file"], demo_runs["flags"])


def test_a_run_yaml_holds_the_flags_of_its_run(demo_runs, small_data):
    run = demo_runs["file"]
    text = (run / "run.yaml").read_text(encoding="utf-8")
    assert text.startswith("# The flags of this training run.")
    settings = yaml.safe_load(text)
    assert {k: settings[k] for k in ("model", "tuning", "max-steps", "eval-every", "threads")} == {
        "model": "tiny", "tuning": "full", "max-steps": 3, "eval-every": 3, "threads": 1}
    assert settings["train-file"] == str(small_data["train"].resolve()) and settings["output-dir"] == str(run.resolve())
    assert "resume" not in settings and "overwrite" not in settings and "config" not in settings
    flags = yaml.safe_load((demo_runs["flags"] / "run.yaml").read_text(encoding="utf-8"))
    assert {**flags, "output-dir": None} == {**settings, "output-dir": None}


def test_a_run_yaml_trains_the_run_again_to_the_same_weights(demo_runs, tmp_path):
    """From another directory, with a new --output-dir on the command line (which wins over the file's)."""
    import train as train_cli

    run, again = demo_runs["file"], tmp_path / "again"
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert train_cli.main(["--config", str(run / "run.yaml"), "--output-dir", str(again)]) == 0
    finally:
        os.chdir(here)
    assert run_args(again) == run_args(run)
    same_tensors(again, run)


def test_a_run_yaml_resumes_its_run(demo_runs, capsys):
    """Its own output directory: `--resume auto` finds the run finished."""
    import train as train_cli

    assert train_cli.main(["--config", str(demo_runs["flags"] / "run.yaml"), "--resume", "auto"]) == 0
    assert "has finished (3 steps): nothing to do" in capsys.readouterr().out


def test_a_run_without_run_yaml_still_resumes(demo_runs, small_data, tmp_path, capsys):
    """Runs trained before run.yaml was written: the same command continues them (here: one step more)."""
    import train as train_cli

    old = tmp_path / "old"
    shutil.copytree(demo_runs["flags"], old)
    (old / "run.yaml").unlink()
    flags = ["--model", "tiny", "--tuning", "full", "--train-file", small_data["train"],
             "--dev-file", small_data["dev"], *QUICK[2:], "--max-steps", 4, "--output-dir", old, "--resume", "auto"]
    assert train_cli.main([str(a) for a in flags]) == 0
    assert "done: 4 steps" in capsys.readouterr().out
    assert not (old / "run.yaml").exists()


def test_the_tiny_examples_run_on_the_demo_run(demo_runs, small_data, tmp_path, monkeypatch, capsys):
    """infer-tiny.yaml and export-ggml.yaml on the demo's run (its directory, a small input and the output on the
    command line, which win over the files')."""
    import export as export_cli
    import infer as infer_cli

    monkeypatch.chdir(ROOT)
    run = demo_runs["file"]
    infer_cli.main(["--config", "examples/infer-tiny.yaml", "--model", str(run), "--input", str(small_data["dev"]),
                    "--output", str(tmp_path / "rows.jsonl"), "--max-new-tokens", "4"])
    assert len((tmp_path / "rows.jsonl").read_text(encoding="utf-8").splitlines()) == 6
    pytest.importorskip("gguf", reason="export --format ggml writes with gguf-py (the export extra)")
    export_cli.main(["--config", "examples/export-ggml.yaml", str(run), str(tmp_path / "ggml")])
    assert [p.name for p in (tmp_path / "ggml").iterdir() if p.suffix == ".ggml"] == ["ggml-q4_0.ggml"]
    capsys.readouterr()


# 3. What a config file may hold


def test_a_config_gives_every_kind_of_flag_and_the_command_line_wins(tmp_path):
    path = written(tmp_path / "run.yaml", "model: tiny\ntuning: lora\ntrain_file: a.jsonl\noutput-dir: out\n"
                   "max-steps: 7\nlr: 1e-4\nlora-target: [q_proj, v_proj]\npacking: true\n"
                   "gradient-checkpointing: false\nmixed-precision: no\ncompile: true\nlora-dropout: 0\nprompt: null\n")
    args = parse("train", "--config", path)
    assert (args.model, args.train_file, args.output_dir) == ("tiny", "a.jsonl", "out")
    assert (args.max_steps, args.lr) == (7, 1e-4)
    assert (args.lora_target, args.packing, args.gradient_checkpointing) == (["q_proj", "v_proj"], True, False)
    assert (args.mixed_precision, args.compile, args.lora_dropout, args.prompt) == ("no", "inductor", 0.0, None)
    args = parse("train", f"--config={path}", "--max-steps", 9, "--lora-target", "dense", "--mixed-precision", "bf16")
    assert (args.max_steps, args.lora_target, args.mixed_precision, args.lr) == (9, ["dense"], "bf16", 1e-4)


def test_the_command_line_replaces_what_its_flags_exclude_or_repeat(tmp_path):
    infer = written(tmp_path / "infer.yaml", "model: m\ninput: in.jsonl\noutput: out.jsonl\nspeculative: off\n"
                    "do-sample: true\n")
    args = parse("infer", "--config", infer)
    assert (args.input, args.text, args.speculative, args.do_sample) == (Path("in.jsonl"), None, "off", True)
    args = parse("infer", "--config", written(tmp_path / "text.yaml", "model: m\ntext: t\ngreedy: true\n"),
                 "--input", "a.jsonl", "--output", "b.jsonl")
    assert (args.input, args.text, args.do_sample) == (Path("a.jsonl"), None, False)
    serve = written(tmp_path / "serve.yaml", "model: m\ncors-origin: [http://a, http://b]\nno-speculative: true\n")
    assert parse("serve", "--config", serve).options.cors_origins == ("http://a", "http://b")
    assert parse("serve", "--config", serve, "--cors-origin", "http://c").options.cors_origins == ("http://c",)
    quantize = written(tmp_path / "q.yaml", "model_dir: a\nout-dir: b\nbits: 8\n")
    assert vars(parse("quantize", "--config", quantize)) | {"config": None} == {
        "config": None, "model_dir": Path("a"), "out_dir": Path("b"), "bits": 8, "group_size": 0, "lora": None,
        "dtype": "float16"}
    args = parse("quantize", "--config", quantize, "c", "d", "--bits", 4)
    assert (args.model_dir, args.out_dir, args.bits) == (Path("c"), Path("d"), 4)
    args = parse("export", "--config", written(tmp_path / "e.yaml", "out_dir: o\nformat: hf\n"), "m")
    assert (args.model_dir, args.out_dir, args.format) == (Path("m"), Path("o"), "hf")


BAD_TYPES = {
    "train": ("max-steps: many", "key 'max-steps': expected an integer, got a string ('many')"),
    "infer": ("batch_size: 2.5", "key 'batch_size': expected an integer, got a number (2.5)"),
    "quantize": ("bits: 3", "key 'bits': expected one of 4, 8, got an integer (3)"),
    "serve": ("speculative: 1", "key 'speculative': expected true or false, got an integer (1)"),
    "export": ("type: [q4_0]", "key 'type': expected one of f16, bf16, q8_0, q4_0, got a list (['q4_0'])"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_key_and_a_badly_typed_value_are_refused_naming_file_and_key(command, tmp_path, capsys):
    unknown = written(tmp_path / "unknown.yaml", "no-such-flag: 1\n")
    err = refused(capsys, command, "--config", unknown)
    assert f"error: {unknown}: unknown key 'no-such-flag': {Path(sys.argv[0]).name} has no --no-such-flag (" in err
    value, said = BAD_TYPES[command]
    bad = written(tmp_path / "bad.yaml", value + "\n")
    assert refused(capsys, command, "--config", bad).endswith(f"error: {bad}: {said}")


def test_the_other_problems_of_a_config_file_name_it(tmp_path, capsys):
    cases = {"max_stepz: 3\n": "unknown key 'max_stepz': {prog} has no --max-stepz (did you mean 'max-steps'?)",
             "lora-target: q_proj\n": "key 'lora-target': expected a list of strings, got a string ('q_proj')",
             "packing: yes\n": "key 'packing': expected true or false, got a string ('yes')",
             "max-steps: 1\nmax_steps: 2\n": "keys 'max-steps' and 'max_steps' set the same flag: give one",
             "- model\n": "expected a mapping of flags to values (`key: value` lines), got a list",
             "model: [\n": "not valid YAML (line 2, column 1): expected the node content, but found '<stream end>'",
             "config: other.yaml\n": "key 'config': a config file cannot name another"}
    prog = Path(sys.argv[0]).name
    for text, said in cases.items():
        path = written(tmp_path / "c.yaml", text)
        assert refused(capsys, "train", "--config", path).endswith(f"error: {path}: {said.format(prog=prog)}"), text
    both = written(tmp_path / "both.yaml", "model: m\ninput: a\ntext: b\n")
    assert refused(capsys, "infer", "--config", both).endswith(f"{both}: keys 'input' and 'text' exclude each other: "
                                                                "give one")
    missing = tmp_path / "missing.yaml"
    assert refused(capsys, "train", "--config", missing).endswith(f"--config {missing}: cannot be read: No such file "
                                                                   "or directory")
    empty = written(tmp_path / "empty.yaml", "# nothing yet\n")
    assert "required: --train-file" in refused(capsys, "train", "--config", empty)


def test_a_bad_config_stops_the_installed_command_with_one_line(tmp_path):
    bad = written(tmp_path / "bad.yaml", "model: tiny\nmax-steps: many\n")
    done = python("-m", "chatglm_tune", "train", "--config", bad, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"python -m chatglm_tune train: error: {bad}: key 'max-steps': "
                                                    "expected an integer, got a string ('many')")


def test_settings_of_writes_back_what_parses_to_the_same(tmp_path):
    import train as train_cli

    argv = ["--model", "tiny", "--train-file", "a", "--output-dir", "o", "--packing", "--lora-target", "x", "y",
            "--no-prefix-projection", "--lr", "0.5", "--compile"]
    parser = train_cli.build_parser()
    args = parser.parse_args(argv)
    settings = cli_config.settings_of(parser, args)
    assert settings["packing"] is True and settings["prefix-projection"] is False and "tensorboard" not in settings
    path = written(tmp_path / "again.yaml", yaml.safe_dump(settings))
    assert vars(parser.parse_args(["--config", str(path)])) == vars(args) | {"config": str(path)}


# 4. The command and the scripts


def test_chatglm_tune_help_lists_the_commands_without_importing_torch():
    probe = ("import sys, time\nstart = time.perf_counter()\nfrom chatglm_tune.cli.main import main\n"
             "code = main(['--help'])\nprint('SECONDS', time.perf_counter() - start)\n"
             f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], code)")
    done = python("-c", probe, cwd=Path("/"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "HEAVY [] 0"
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert listed == list(COMMANDS)
    # Importing torch was what made a --help take seconds; 0.1 s without it on a quiet machine. The modules are the
    # check; the clock only catches a pathological case on a loaded one.
    assert float(lines[-2].split()[1]) < 5


@pytest.mark.parametrize("command", COMMANDS)
def test_python_m_chatglm_tune_command_help_works_without_torch(command):
    probe = ("import runpy, sys\n"
             f"sys.argv = ['chatglm_tune', {command!r}, '--help']\n"
             "try:\n    runpy.run_module('chatglm_tune', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as stop:\n    print('EXIT', stop.code)\n"
             f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])")
    done = python("-c", probe, cwd=Path("/"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["EXIT 0", "HEAVY []"]
    assert f"usage: python -m chatglm_tune {command} [-h] [--config FILE.yaml]" in " ".join(done.stdout.split())


def test_an_unknown_or_missing_command_is_refused():
    done = python("-m", "chatglm_tune", "tune", cwd=Path("/"))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "python -m chatglm_tune: error: unknown command 'tune' (choose from train, infer, quantize, serve, export)")
    done = python("-m", "chatglm_tune", cwd=Path("/"))
    assert done.returncode == 2 and "commands:" in done.stderr


def test_a_dispatched_command_names_itself_as_it_was_started(monkeypatch):
    import quantize as quantize_cli
    import train as train_cli

    monkeypatch.setattr(cli, "_started", {})
    assert train_cli.continue_command(["--model", "tiny", "--resume"]).endswith(" train.py --model tiny --resume auto")
    cli.started(["chatglm-tune"], "chatglm-tune", "train")
    assert train_cli.continue_command(["--model", "tiny"]) == "chatglm-tune train --model tiny --resume auto"
    assert train_cli.build_parser().prog == "chatglm-tune train" and cli.hint("infer") == "chatglm-tune infer"
    assert quantize_cli.__name__ == "chatglm_tune.cli.quantize"


def test_the_scripts_are_the_package_command_modules():
    """`import train` is `chatglm_tune.cli.train` itself (what a test patches on it, the command sees); a script
    loaded from its file under another name has the command's names."""
    import infer
    import train

    import chatglm_tune.cli.infer
    import chatglm_tune.cli.train

    assert train is chatglm_tune.cli.train and infer is chatglm_tune.cli.infer
    spec = importlib.util.spec_from_file_location("infer_from_file", ROOT / "infer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is chatglm_tune.cli.infer.main and module.parse_args is chatglm_tune.cli.infer.parse_args


INSTALL_ENV = "CHATGLM_TUNE_TEST_INSTALL"
INSTALL_BUDGET_S = 30


def test_a_non_editable_install_gets_the_chatglm_tune_command(tmp_path, small_data):
    """The package built and installed (no dependencies: the venv sees this one's) into a fresh venv: its
    `chatglm-tune` runs from outside the checkout, on the installed package: its help, and the main job (train the
    tiny default, a few steps here, then extract with it). It takes a few seconds (the build and
    install); where it takes over INSTALL_BUDGET_S it skips, unless CHATGLM_TUNE_TEST_INSTALL=1 asks it to finish."""
    source, venv = tmp_path / "source", tmp_path / "venv"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "chatglm_tune", source / "chatglm_tune", ignore=shutil.ignore_patterns("__pycache__"))
    start = time.monotonic()
    # The venv's own pip would build with the venv's bundled setuptools; the system's pip builds with this one's.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=HANG_S)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", "--no-build-isolation", str(source)], capture_output=True, text=True,
                          timeout=HANG_S, env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if done.returncode and "no such option: --python" in done.stderr:
        pytest.skip("this pip has no --python (pip >= 22.3 installs into another interpreter)")
    assert done.returncode == 0, done.stderr[-3000:]
    took = time.monotonic() - start
    if took > INSTALL_BUDGET_S and os.environ.get(INSTALL_ENV) != "1":
        pytest.skip(f"building and installing took {took:.0f} s (over {INSTALL_BUDGET_S} s): set {INSTALL_ENV}=1 to "
                    "run the installed command's checks anyway")
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = str(venv / "bin" / "chatglm-tune")
    shown = subprocess.run([command, "--help"], capture_output=True, text=True, cwd=tmp_path, env=environment,
                           timeout=HANG_S)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("  ")] == list(COMMANDS)
    train_help = subprocess.run([command, "train", "--help"], capture_output=True, text=True, cwd=tmp_path,
                                env=environment, timeout=HANG_S)
    assert train_help.returncode == 0 and "--config FILE.yaml" in train_help.stdout, train_help.stderr
    probe = "import chatglm_tune.cli; print(chatglm_tune.cli.__file__)"
    where = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                           env=environment, timeout=HANG_S)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    run, predictions = tmp_path / "tiny", tmp_path / "dev_predictions.jsonl"
    for argv in (["train", "--model", "tiny", "--tuning", "full", "--train-file", small_data["train"], "--dev-file",
                  small_data["dev"], "--output-dir", run, *QUICK],
                 ["infer", "--model", run, "--input", small_data["dev"], "--output", predictions, "--threads", "1"]):
        done = subprocess.run([command, *map(str, argv)], capture_output=True, text=True, cwd=tmp_path,
                              env=environment, timeout=HANG_S)
        assert done.returncode == 0, done.stderr[-3000:]
    assert len(predictions.read_text(encoding="utf-8").splitlines()) == 6


def test_the_parser_class_is_argparse_with_a_config_flag():
    parser = cli_config.CommandParser(prog="x")
    parser.add_argument("--n", type=int, default=1)
    assert isinstance(parser, argparse.ArgumentParser)
    assert vars(parser.parse_args([])) == {"config": None, "n": 1}
