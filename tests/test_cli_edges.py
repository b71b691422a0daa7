"""What a new user meets at the edges of the command lines, on every version's tiny preset: threads,
--resume with other data, contradicting flags, Ctrl-C, misleading messages, small output faults.

Each test names the mistake or surprise it guards against; the command lines run as a user runs them, in
fresh processes.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from commands import HANG_S, ROOT, cli, ok, side_by_side, wait_until
from serving import tiny_model

from chatglm_tune.runtime import cores
from test_first_hour import tree_bytes

DEV = ROOT / "data" / "spo_dev.jsonl"
PRESETS = ("tiny", "tiny-chatglm3", "tiny-glm4")
SMALL = ["--max-src-len", "96", "--max-len", "160", "--batch-size", "8"]


def train_here(*args, capsys) -> tuple[int, str, str]:
    """train.py in this process (no interpreter start): (exit code, stdout, stderr)."""
    import train as train_cli

    code = train_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def infer_here(*args, capsys) -> tuple[int, str, str]:
    """infer.py in this process: (exit code, stdout, stderr)."""
    from infer import main as infer_main

    try:
        infer_main([str(a) for a in args])
        code = 0
    except SystemExit as stopped:
        code = stopped.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edges")
    lines = DEV.read_text(encoding="utf-8").splitlines()
    (root / "a.jsonl").write_text("\n".join(lines[:24]) + "\n", encoding="utf-8")
    (root / "b.jsonl").write_text("\n".join(lines[24:40]) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def runs(data):
    """A 2-step full run of each preset (with a dev file), trained with OMP_NUM_THREADS=1 and no --threads."""
    done = side_by_side(*(("train.py", "--model", preset, "--tuning", "full", "--train-file", data / "a.jsonl",
                           "--dev-file", data / "a.jsonl", *SMALL, "--max-steps", 2, "--output-dir", data / preset)
                          for preset in PRESETS))
    return {preset: (data / preset, run) for preset, run in zip(PRESETS, done)}


# Threads: an environment the user set wins over a preset, and the summary says which


@pytest.mark.parametrize("preset", PRESETS)
def test_omp_num_threads_wins_over_the_tiny_demo_and_the_summary_says_so(runs, preset):
    run, done = runs[preset]
    assert re.search(r"^threads: 1 \(OMP_NUM_THREADS\)$", done.stdout, re.M), done.stdout
    assert json.loads((run / "run_args.json").read_text())["threads"] == 1
    # the tiny demo's own summary does not go on about real models' defaults after stating its own lr
    assert "for real models" not in done.stdout


def test_threads_flag_beats_the_environment_and_the_preset_applies_without_either(data, tmp_path, capsys, monkeypatch):
    args = ["--model", "tiny", "--tuning", "full", "--train-file", data / "b.jsonl", *SMALL, "--max-steps", 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    code, out, _ = train_here(*args, "--threads", 1, "--output-dir", tmp_path / "f", capsys=capsys)
    assert code == 0 and re.search(r"^threads: 1 \(--threads\)$", out, re.M)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cores, "busy_elsewhere", lambda: 0.0)  # a quiet machine: the preset's 2 threads
    code, out, _ = train_here(*args, "--output-dir", tmp_path / "p", capsys=capsys)
    assert code == 0 and re.search(r"^threads: 2 \(the tiny demo's; \d+ cores usable\)$", out, re.M), out


def test_infer_takes_omp_num_threads_over_the_run_s_threads(runs, capsys, monkeypatch):
    run, _ = runs["tiny-glm4"]
    args = json.loads((run / "run_args.json").read_text())
    args["threads"] = 2
    (run / "run_args.json").write_text(json.dumps(args))
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        code, _, err = infer_here("--model", run, "--text", "一辆车。", capsys=capsys)
        assert code == 0 and "1 threads (OMP_NUM_THREADS)" in err
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cores, "busy_elsewhere", lambda: 0.0)  # a quiet machine: the run's 2 threads
        code, _, err = infer_here("--model", run, "--text", "一辆车。", capsys=capsys)
        assert code == 0 and "2 threads (the run's; " in err
        monkeypatch.setattr(cores, "busy_elsewhere", lambda: 1.0)  # a core kept busy by other work: one thread
        code, _, err = infer_here("--model", run, "--text", "一辆车。", capsys=capsys)
        assert code == 0 and "1 threads (the run's 2, capped at the cores free: 2 cores usable, 1 kept busy" in err
    finally:
        args["threads"] = 1
        (run / "run_args.json").write_text(json.dumps(args))


# --resume continues the run it was given, nothing else


@pytest.mark.parametrize("preset", PRESETS)
def test_resume_with_other_data_or_options_is_refused_and_the_run_is_untouched(runs, data, preset, capsys, monkeypatch):
    run, _ = runs[preset]
    before = tree_bytes(run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = ["--model", preset, "--tuning", "full", *SMALL, "--output-dir", run, "--resume"]
    code, _, err = train_here(*base, "--train-file", data / "b.jsonl", "--max-steps", 4, capsys=capsys)
    assert code == 2 and f"--train-file: the run used {(data / 'a.jsonl').resolve()}" in err
    assert f"now {(data / 'b.jsonl').resolve()}" in err
    assert "--dev-file: the run used" in err and "now none" in err
    code, _, err = train_here(*base, "--train-file", data / "a.jsonl", "--dev-file", data / "a.jsonl", "--lr", "0.1",
                              capsys=capsys)
    assert code == 2 and "lr: the run used 0.004, now 0.1" in err
    assert tree_bytes(run) == before


def test_resume_may_change_the_length_and_the_threads(runs):
    from chatglm_tune.runs import rundir

    run, _ = runs["tiny"]
    record = rundir.read_run_args(run)
    rundir.check_resume(run, {**record, "max_steps": 40, "threads": 2, "patience": 0})
    with pytest.raises(rundir.RunDirectoryError, match="seed: the run used 42, now 7"):
        rundir.check_resume(run, {**record, "seed": 7})


# Flags that contradict each other


def test_contradicting_flags_are_refused_in_one_message(data, tmp_path, capsys):
    import train as train_cli

    code = train_cli.main(["--model", "tiny-chatglm3", "--tuning", "lora", "--pre-seq-len", "8", "--prefix-projection",
                           "--warmup-ratio", "1.5", "--threads", "0", "--epochs", "2", "--max-steps", "3", "--lr", "-1",
                           "--train-file", str(data / "a.jsonl"), "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    for problem in ("--pre-seq-len applies only to --tuning ptuning, not lora",
                    "--prefix-projection applies only to --tuning ptuning, not lora",
                    "warmup_ratio is a share of the steps, in [0, 1), got 1.5", "--threads must be >= 1, got 0",
                    "give --epochs or --max-steps, not both", "lr must be >= 0, got -1.0"):
        assert problem in err, problem
    assert err.count("train.py: error:") == 1 and not (tmp_path / "r").exists()
    for flags, problem in ((["--tuning", "full", "--prefix-projection"],
                            "--prefix-projection applies only to --tuning ptuning"),
                           (["--tuning", "ptuning", "--lora-r", "4"],
                            "--lora-r applies only to --tuning lora, not ptuning")):
        code = train_cli.main(["--model", "tiny", *flags, "--train-file", str(data / "a.jsonl"), "--output-dir",
                               str(tmp_path / "r")])
        assert code == 2 and problem in capsys.readouterr().err


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed")
def test_tensorboard_without_its_package_is_refused(data, tmp_path):
    done = cli("train.py", "--model", "tiny", "--tuning", "full", "--tensorboard", "--train-file", data / "a.jsonl",
               "--output-dir", tmp_path / "r")
    assert done.returncode == 2 and "--tensorboard needs the tensorboard package" in done.stderr


# Ctrl-C


def interrupt_when(args: list, ready, what: str) -> subprocess.CompletedProcess:
    """Run a command, send it SIGINT (Ctrl-C) once `ready()` holds (`what` it waits for: a failure names it), and
    return what it did once it exits. Its output goes to files: a pipe nobody reads could stall it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=env, text=True,
                                   stdout=out, stderr=err)
        try:
            wait_until(ready, what, alive=lambda: process.poll() is None)
            process.send_signal(signal.SIGINT)
            process.wait(HANG_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def logged_steps(run: Path) -> int:
    log = run / "metrics.jsonl"
    return log.read_text().count('"loss"') if log.exists() else 0


@pytest.mark.parametrize("preset", ["tiny-glm4"])
def test_ctrl_c_in_training_saves_the_state_and_says_how_to_resume(data, tmp_path, preset, capsys):
    run = tmp_path / "run"
    args = ["--model", preset, "--tuning", "full", "--train-file", data / "a.jsonl", *SMALL, "--log-every", 1,
            "--threads", 1, "--output-dir", run]
    done = interrupt_when([ROOT / "train.py", *args, "--max-steps", 2000], lambda: logged_steps(run) >= 3,
                          "train.py logging its third step")
    assert done.returncode == 130 and "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    match = re.search(r"train\.py: interrupted by SIGINT after step (\d+): its state is saved in .*--resume",
                      done.stderr)
    assert match, done.stderr[-2000:]
    assert json.loads((run / "state" / "progress.json").read_text())["step"] == int(match.group(1)) >= 3
    # a run may be shortened
    code, out, _ = train_here(*args, "--max-steps", int(match.group(1)) + 2, "--resume", capsys=capsys)
    assert code == 0 and f"resuming {run} at step {match.group(1)}" in out


def test_ctrl_c_in_infer_keeps_the_rows_and_says_how_to_resume(runs, data, tmp_path, capsys):
    run, _ = runs["tiny-chatglm3"]
    out = tmp_path / "out.jsonl"
    lines = lambda: out.read_text().count("\n") if out.exists() else 0  # noqa: E731
    args = ["--model", run, "--input", data / "a.jsonl", "--output", out, "--batch-size", 1]
    held = (  # infer.py as run from the shell, held once its second row is written until the Ctrl-C lands there (on a
        # fast machine the 24 rows of a tiny model are otherwise written before the signal arrives). Held in short
        # sleeps, not one blocking wait: Linux may hand the SIGINT to another thread (OpenMP's, tqdm's), and only
        # a main thread that wakes runs Python's handler
        "import runpy, sys, time; import chatglm_tune.evaluation.extraction as e; write = e.append_rows; written = []; "
        "e.append_rows = lambda f, rows: (write(f, rows), written.extend(rows), "
        "len(written) >= 2 and any(time.sleep(0.05) for _ in iter(int, 1))); "
        f"sys.argv = [{str(ROOT / 'infer.py')!r}, *{list(map(str, args))!r}]; "
        f"runpy.run_path({str(ROOT / 'infer.py')!r}, run_name='__main__')")
    done = interrupt_when(["-c", held], lambda: lines() >= 2, "infer.py writing its second row")
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-2000:]
    kept = lines()
    assert f"interrupted by SIGINT after {kept} of 24 records" in done.stderr and "--resume" in done.stderr
    code, _, _ = infer_here(*args, "--resume", capsys=capsys)
    assert code == 0 and lines() == 24


# Messages that misled


def test_infer_refuses_its_input_or_a_directory_as_output_and_exits_2(runs, data, tmp_path, capsys):
    from infer import main as infer_main

    run, _ = runs["tiny"]
    for output, message in ((data / "a.jsonl", "is the --input file"), (run, "is a directory")):
        with pytest.raises(SystemExit) as stopped:
            infer_main(["--model", str(run), "--input", str(data / "a.jsonl"), "--output", str(output)])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and message in err and "remove it" not in err
    with pytest.raises(SystemExit) as stopped:
        infer_main(["--model", str(tmp_path / "nowhere"), "--text", "x"])
    assert stopped.value.code == 2 and "no such directory" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_infer_on_cuda_without_cuda_is_an_error_not_a_traceback(runs, capsys):
    run, _ = runs["tiny"]
    code, _, err = infer_here("--model", run, "--text", "x", "--device", "cuda", capsys=capsys)
    assert code == 2 and "CUDA is not available" in err


def test_float16_on_a_cpu_says_it_is_slow(runs, capsys):
    run, _ = runs["tiny"]
    code, _, err = infer_here("--model", run, "--text", "一辆车。", "--dtype", "float16", "--device",
                              "cpu", capsys=capsys)
    assert code == 0 and "float16 on a CPU has no fast kernels" in err


def test_a_non_finite_loss_before_any_save_does_not_point_at_a_checkpoint(tmp_path):
    from accelerate import Accelerator

    from chatglm_tune.tuning.training import TrainingError, _check_finite

    with pytest.raises(TrainingError) as caught:
        _check_finite(Accelerator(cpu=True), torch.tensor(float("nan")), {"step": 0, "epoch": 0}, tmp_path)
    assert "No checkpoint was written yet" in str(caught.value) and "state" not in str(caught.value)
    assert "bfloat16" in str(caught.value)


# Small output faults


def test_the_smoothed_loss_runs_through_a_falling_curve():
    from chatglm_tune.tuning.curves import smooth

    noise = torch.Generator().manual_seed(0)
    falling = [5 - 0.01 * i + 0.3 * float(torch.rand(1, generator=noise) - 0.5) for i in range(300)]
    above = sum(s > x for s, x in zip(smooth(falling), falling))
    assert 0.3 < above / len(falling) < 0.7  # a one-way average sat above nearly every point
    line = [5 - 0.01 * i for i in range(300)]
    assert max(abs(s - x) for s, x in zip(smooth(line)[60:-60], line[60:-60])) < 1e-3  # edges: each start's debiasing


@pytest.mark.parametrize("entries", [
    [{"step": 1, "epoch": 0, "loss": 2.0, "lr": 0.0}],
    [{"step": 1, "epoch": 0, "loss": 2.0, "lr": 0.0}, {"step": 1, "epoch": 0, "eval": {"score": 0.0, "dev_loss": 1.9}}],
    [{"step": 1, "epoch": 0, "loss": 0.0, "lr": 0.0}],
    [],
], ids=["one-point", "one-point-and-eval", "zero-loss", "empty"])
def test_a_curve_of_few_points_draws_without_warnings(tmp_path, entries):
    from chatglm_tune.tuning.curves import plot_curves

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_curves(log, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_prompt_response_runs_report_one_score_and_no_triples(tmp_path, capsys):
    pairs = [{"content": f"类型#裙*颜色#{c}*长度#{n}", "summary": f"这条{c}的裙子是{n}的。"}
             for c in ("红色", "蓝色", "白色", "黑色") for n in ("长款", "短款", "中长款")]
    data = tmp_path / "ad.json"
    data.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in pairs) + "\n", encoding="utf-8")
    columns = ["--prompt-column", "content", "--response-column", "summary"]
    code, out, _ = train_here("--model", "tiny", "--tuning", "full", "--train-file", data, "--dev-file", data, *columns,
                              *SMALL, "--max-steps", 2, "--threads", 1, "--output-dir", tmp_path / "run", capsys=capsys)
    evaluated = re.findall(r"rouge-l ([\d.]+)", out)
    best = re.search(r"best dev score rouge-l ([\d.]+)", out)
    assert code == 0 and evaluated and best and best.group(1) in evaluated, out
    code, _, _ = infer_here("--model", tmp_path / "run", "--input", data, "--output",
                            tmp_path / "p.jsonl", capsys=capsys)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert code == 0 and rows and all(row["triples"] is None and row["malformed"] is None for row in rows)


def test_infer_says_when_it_cuts_a_text(runs, tmp_path, capsys):
    run, _ = runs["tiny-chatglm3"]
    long = "发动机水温高，风扇始终是低速转动。" * 400
    code, _, err = infer_here("--model", run, "--text", long, "--max-new-tokens", 2, capsys=capsys)
    assert code == 0 and "the text was cut to fit max_src_len=96 tokens" in err
    records = tmp_path / "long.jsonl"
    records.write_text(json.dumps({"text": long}, ensure_ascii=False) + "\n"
                       + DEV.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    code, out, _ = infer_here("--model", run, "--input", records, "--output", tmp_path / "o.jsonl",
                              "--max-new-tokens", 2, capsys=capsys)
    assert code == 0 and "texts cut to fit max_src_len=96 tokens: 1" in out
    assert [json.loads(line)["text_truncated"]
            for line in (tmp_path / "o.jsonl").read_text().splitlines()] == [True, False]


@pytest.mark.parametrize("name", ["chatglm", "chatglm3", "glm4"])
def test_a_quantized_model_counts_the_parameters_of_its_float_form(name, tmp_path):
    from chatglm_tune.models.registry import VERSIONS
    from chatglm_tune.quant.apply import quantize_model
    from chatglm_tune.tuning.training import parameter_counts

    version = VERSIONS[name]
    model, _ = version.tiny([json.loads(line)["text"]
                             for line in DEV.read_text(encoding="utf-8").splitlines()[:20]], tmp_path)
    float_counts = parameter_counts(model)
    assert float_counts[0] == float_counts[1] == sum(p.numel() for p in model.parameters())
    for bits in (8, 4):
        quantized = quantize_model(type(model)(model.config), bits, targets=version.quantizable_linears)
        assert parameter_counts(quantized)[1] == float_counts[1], bits


def test_infer_help_names_every_version():
    done = ok(cli("infer.py", "--help"))
    flat = " ".join(done.stdout.split())
    assert "ChatGLM-6B, ChatGLM2/3 or GLM-4" in flat


def test_records_with_their_own_instruction_get_no_other_and_conversations_are_free_text(tmp_path, capsys):
    talks = [{"conversations": [{"role": "user", "content": f"介绍{c}的裙子"},
                                {"role": "assistant", "content": f"这条{c}的裙子很好看。"}]}
             for c in ("红色", "蓝色", "白色", "黑色", "灰色", "绿色")]
    data = tmp_path / "talks.json"
    data.write_text(json.dumps(talks, ensure_ascii=False), encoding="utf-8")
    code, _, _ = train_here("--model", "tiny-chatglm3", "--tuning", "full", "--train-file", data, *SMALL,
                            "--max-steps", 1, "--threads", 1, "--output-dir", tmp_path / "run", capsys=capsys)
    assert code == 0 and json.loads((tmp_path / "run" / "run_args.json").read_text())["encoding"]["prompt"] == ""
    code, _, _ = infer_here("--model", tmp_path / "run", "--input", data, "--output", tmp_path / "p.jsonl",
                            "--max-new-tokens", 4, capsys=capsys)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert code == 0 and len(rows) == 6 and all(row["triples"] is None for row in rows)
    summary = json.loads((tmp_path / "p.jsonl.summary.json").read_text())
    assert "rouge-l" in summary["scores"]


# Sizes past what the model or the machine holds, weights cut short, output paths that cannot be made, records and
# LoRA targets the version has no place for: one line naming what is wrong, exit 2, nothing written

FIXTURE = ROOT / "tests" / "fixtures" / "glm4-tiny"  # its config.json: a context of 256 tokens, hidden size 128


def usage_error(parse, argv: list, capsys) -> str:
    """The one-line error of a command line's `parse_args` that refuses `argv` (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        parse([str(a) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_sizes_past_what_the_model_holds_are_refused_naming_the_bound(data, tmp_path, capsys):
    run = ["--model", FIXTURE, "--train-file", data / "a.jsonl", "--output-dir", tmp_path / "r", "--max-steps", 1]
    for flags, message in ((["--tuning", "ptuning", "--pre-seq-len", 10**9],
                            "--pre-seq-len must be at most the model's "
                            f"context of 256 tokens ({FIXTURE}), got 1000000000"),  # was 2 TB asked of the allocator
                           (["--tuning", "lora", "--lora-r", 10**9],
                            "--lora-r must be at most the model's hidden size 128")):
        code, _, err = train_here(*run, *flags, capsys=capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
    code, _, err = infer_here("--model", FIXTURE, "--text", "你好", "--max-new-tokens", 10**9, capsys=capsys)
    assert code == 2 and "--max-new-tokens must be at most the model's context of 256 tokens" in err


def test_threads_and_sizes_past_the_machine_are_refused_naming_the_bound(data, tmp_path, capsys):
    import export as export_cli
    import infer as infer_cli
    import serve as serve_cli
    import train as train_cli
    from chatglm_tune.options import TrainOptions

    # a billion threads: libgomp aborted the process asking for 216 GB, so the flags are only parsed here
    bound = f"--threads must be at most {4 * (os.cpu_count() or 1)} (4 x the "
    for parse, argv in ((infer_cli.parse_args, ["--model", FIXTURE, "--text", "你好"]),
                        (serve_cli.parse_args, ["--model", FIXTURE]),
                        (export_cli.parse_args, [FIXTURE, tmp_path / "e"])):
        assert bound in usage_error(parse, [*argv, "--threads", 10**9], capsys)
    args = train_cli.parse_args([str(a) for a in ["--model", "tiny", "--tuning", "full", "--train-file",
                                                  data / "a.jsonl", "--output-dir", tmp_path / "r",
                                                  "--threads", 10**9]])
    with pytest.raises(ValueError, match=bound.replace("(", r"\(")):
        train_cli.options_from(args, {})
    with pytest.raises(ValueError, match="tiny_layers must be at most 64"):
        TrainOptions(tuning="full", tiny_layers=10**9)
    err = usage_error(serve_cli.parse_args, ["--model", FIXTURE, "--max-batch", 10**9, "--port", 70000], capsys)
    assert ("max_batch must be an integer in [1, 4096], got 1000000000" in err
            and "port must be an integer in [0, 65535]" in err)


def test_a_truncated_safetensors_file_is_named_by_every_command(data, tmp_path, capsys):
    import export as export_cli
    import quantize as quantize_cli
    import serve as serve_cli

    model = tiny_model("glm4", tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a download cut short
    said = f"{weights}: truncated or not a safetensors file ("

    def exit_error(main, argv: list) -> str:
        with pytest.raises(SystemExit) as stop:
            main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2, err
        return err

    code, _, train_err = train_here("--model", model, "--tuning", "lora", "--train-file", data / "a.jsonl",
                                    "--max-steps", 1, "--output-dir", tmp_path / "r", capsys=capsys)
    code_infer, _, infer_err = infer_here("--model", model, "--text", "你好", capsys=capsys)
    errors = {"train.py": train_err, "infer.py": infer_err,
              "quantize.py": exit_error(quantize_cli.main, ["--bits", 8, model, tmp_path / "q"]),
              "export.py": exit_error(export_cli.main, [model, tmp_path / "e"]),
              "serve.py": exit_error(serve_cli.main, ["--model", model])}
    assert code == code_infer == 2
    for script, err in errors.items():
        assert err.strip().splitlines() == [f"{script}: error: {err.strip().partition(': error: ')[2]}"], err
        assert said in err and "download it again" in err, (script, err)
    assert not any(p.exists() for p in (tmp_path / "q", tmp_path / "e")) and not any((tmp_path / "r").glob("*"))


def test_an_output_path_under_a_file_cannot_be_created_and_says_so(data, tmp_path, capsys):
    import quantize as quantize_cli

    blocker = tmp_path / "a-file"  # a path under a regular file: refused even to root
    blocker.write_text("")
    said = f"cannot create {blocker / 'out'}: {blocker} is not a directory"
    code, _, err = train_here("--model", "tiny", "--tuning", "full", "--train-file", data / "a.jsonl", "--max-steps", 1,
                              "--output-dir", blocker / "out", capsys=capsys)
    assert code == 2 and err.strip() == f"train.py: error: {said}"
    code, _, err = infer_here("--model", FIXTURE, "--input", data / "a.jsonl", "--output",
                              blocker / "out", capsys=capsys)
    assert code == 2 and err.strip() == f"infer.py: error: {said}"
    with pytest.raises(SystemExit) as stop:
        quantize_cli.main(["--bits", "8", str(FIXTURE), str(blocker / "out")])
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == f"quantize.py: error: {said}"
    assert blocker.read_text() == ""


def test_a_lora_target_that_matches_nothing_is_refused_beside_ones_that_match(data, tmp_path, capsys):
    """GLM-4.5's attention names on GLM-4.7-Flash, whose attention is latent (q_a_proj ...): peft trained the experts
    alone, with a warning at most, where a list of which nothing matches is refused."""
    model = tiny_model("glm4-moe-lite", tmp_path / "model")
    code, _, err = train_here("--model", model, "--tuning", "lora", "--lora-target", "q_proj", "experts.gate_up_proj",
                              "experts.down_proj", "--lora-dropout", 0, "--train-file", data / "a.jsonl", *SMALL,
                              "--max-steps", 1, "--threads", 1, "--output-dir", tmp_path / "r", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--lora-target q_proj: matches nothing in the GLM-4.7-Flash model" in err
    assert ("q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj" in err
            and "experts.gate_up_proj experts.down_proj" in err)
    assert not (tmp_path / "r").exists()


def _presets_refusing_tools() -> list[str]:
    from chatglm_tune.models.registry import VERSIONS
    from chatglm_tune.options import TINY_PRESETS

    return [preset for preset, name in TINY_PRESETS.items() if getattr(VERSIONS[name].format, "tool_refusal", None)]


@pytest.mark.parametrize("preset", _presets_refusing_tools())
def test_tool_records_a_version_cannot_train_are_refused_naming_file_line_and_field(preset, tmp_path, capsys):
    records = tmp_path / "tools.jsonl"
    shipped = (ROOT / "data" / "tools_glm4_train.jsonl").read_text(encoding="utf-8")
    records.write_text("".join(shipped.splitlines(True)[:2]), encoding="utf-8")
    code, _, err = train_here("--model", preset, "--tuning", "full", "--train-file", records, "--max-steps", 1,
                              "--threads", 1, "--output-dir", tmp_path / "r", capsys=capsys)
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert (err.startswith(f"train.py: error: {records}:1, field 'messages[0].tools': ")
            and "tool" in err.partition("tools': ")[2])
    assert not (tmp_path / "r").exists()  # refused before the tiny model's tokenizer was written there
