"""Training runs on a tiny model: P-tuning v2 and LoRA learn, save only what they train, resume
exactly, survive a failed save, and agree across 2 processes (accelerate launch, gloo on CPU)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train as train_cli
from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
from chatglm_tune.data.batches import SpecialIds, collate_train, encode_record
from chatglm_tune.data.records import read_records
from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer
from chatglm_tune.runs import loading, rundir
from chatglm_tune.runtime import crashpoints
from chatglm_tune.tuning.training import TrainOptions, build_tiny, optimizer_and_schedule
from commands import HANG_S
from serving import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN_FILE = REPO / "data" / "spo_train.jsonl"


@pytest.fixture(scope="module")
def records():
    return read_records(TRAIN_FILE)[0][:48]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, records):
    """A random tiny base model directory with its (character-level) tokenizer."""
    directory = tmp_path_factory.mktemp("base")
    tokenizer = train_tokenizer([r.text for r in records] + [r.answer for r in records], directory, max_piece_length=1)
    torch.manual_seed(0)
    config = ChatGLMConfig.from_name("tiny", **tokenizer.config_overrides())
    ChatGLMForConditionalGeneration(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def train_file(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": r.text, "answer": r.answer}, ensure_ascii=False) + "\n"
                            for r in records))
    return path


def _run(base_dir, train_file, out, *flags):
    argv = ["--model", str(base_dir), "--train-file", str(train_file), "--output-dir", str(out),
            "--batch-size", "8", "--log-every", "1", "--max-len", "160", "--max-src-len", "128", *flags]
    assert train_cli.main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_run(directory):
    return loading.load_run(loading.resolve_run(directory))


def test_build_tiny_covers_extra_texts_and_takes_config_overrides(records, tmp_path):
    options = TrainOptions(tuning="full")
    plain_model, plain = build_tiny(records, tmp_path / "plain", options)
    model, tokenizer = build_tiny(records, tmp_path / "extra", options, extra_texts=("鑫淼",), num_layers=4)

    def pieces(tok, text):
        return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))

    assert "鑫" not in pieces(plain, "鑫")  # in no record: byte pieces
    assert pieces(tokenizer, "鑫淼") == ["▁", "鑫", "淼"]  # one piece a character
    assert (plain_model.config.num_layers, model.config.num_layers) == (3, 4)


def test_tiny_layers_sets_the_depth_of_a_preset_and_is_refused_for_a_model_directory(records, base_dir, train_file,
                                                                                    tmp_path, capsys):
    """--tiny-layers reaches each family's own config field (the official num_layers of ChatGLM-6B and ChatGLM2/3,
    transformers' num_hidden_layers of the released forms) and the model built; with a model directory it would be
    ignored, so it is refused."""
    from chatglm_tune.tuning.training import prepare_model

    for preset, layers in (("tiny", 1), ("tiny-chatglm3", 3), ("tiny-glm4-moe", 3)):
        options = TrainOptions(tuning="full", tiny_layers=layers)
        model, _ = prepare_model(preset, records[:8], tmp_path / preset, options)
        depth = model.config.num_layers if preset == "tiny" else model.config.num_hidden_layers
        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
        assert depth == layers and blocks, preset
    assert train_cli.main(["--model", str(base_dir), "--tuning", "lora", "--train-file", str(train_file),
                           "--output-dir", str(tmp_path / "refused"), "--tiny-layers", "3"]) == 2
    assert "--tiny-layers applies only to a tiny preset" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tiny_layers must be >= 1"):
        TrainOptions(tuning="full", tiny_layers=0)


def test_a_run_that_breaks_before_it_saves_a_state_leaves_its_directory_as_it_found_it(records, train_file, tmp_path,
                                                                              monkeypatch):
    """An error train.py does not expect (here DeepSpeed's assertion on a batch size, as several CPU processes
    under a DeepSpeed config raise it) still takes back the tiny model's tokenizer it wrote, so the same command
    runs again; the error itself goes on up."""
    from chatglm_tune.tuning import training

    def broken(*args, **kwargs):
        raise AssertionError("Check batch related parameters")

    monkeypatch.setattr(training, "train", broken)
    out = tmp_path / "run"
    with pytest.raises(AssertionError, match="batch related"):
        train_cli.main(["--model", "tiny-chatglm3", "--tuning", "full", "--train-file", str(train_file),
                        "--output-dir", str(out), "--max-steps", "1"])
    assert not out.exists()  # the run made it, and takes it back
    out.mkdir()  # one that was there empty stays, empty
    with pytest.raises(AssertionError, match="batch related"):
        train_cli.main(["--model", "tiny-chatglm3", "--tuning", "full", "--train-file", str(train_file),
                        "--output-dir", str(out), "--max-steps", "1"])
    assert out.is_dir() and not any(out.iterdir())


def test_a_tiny_models_context_covers_the_rows_it_trains_on(records, tmp_path):
    """A run of rows longer than the tiny preset's 512 tokens gets a model whose config says so (serve.py and the
    chat keep prompts within it); shorter runs keep 512."""
    from chatglm_tune.options import EncodingOptions
    from chatglm_tune.serve.service import context_length

    long = TrainOptions(tuning="full", encoding=EncodingOptions(max_src_len=700, max_len=800))
    for preset in ("tiny-chatglm3", "tiny-glm4-0414"):
        assert context_length(build_tiny(records[:8], tmp_path / preset, long, preset=preset)[0].config) == 800, preset
    short = build_tiny(records[:8], tmp_path / "short", TrainOptions(tuning="full"), preset="tiny-chatglm3")[0]
    assert context_length(short.config) == 512


def _losses(log):
    return [e["loss"] for e in log if "loss" in e]


def _probe_logits(model, tokenizer, records):
    batch = collate_train([encode_record(r, tokenizer) for r in records[:4]], SpecialIds.of(tokenizer))
    with torch.no_grad():
        return model(batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=0).logits


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_schedule_is_transformers_own_step_for_step(schedule):
    """The learning rate follows transformers' `get_scheduler` (warmup, then the decay) at every step, past the end
    too, and resumes from its state_dict where it stopped."""
    from transformers import get_scheduler

    def rates(scheduler, steps):
        out = []
        for _ in range(steps):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    options = TrainOptions(schedule=schedule, lr=3e-3, warmup_ratio=0.1)
    ours = optimizer_and_schedule([torch.nn.Parameter(torch.zeros(1))], options, 50)[1]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    theirs = get_scheduler(schedule, optimizer, num_warmup_steps=5, num_training_steps=50)
    assert rates(ours, 30) == rates(theirs, 30)
    resumed = optimizer_and_schedule([torch.nn.Parameter(torch.zeros(1))], options, 50)
    resumed[0].load_state_dict(ours.optimizer.state_dict())
    resumed[1].load_state_dict(ours.state_dict())
    assert rates(resumed[1], 25) == rates(theirs, 25)


def test_the_methods_accumulation_goes_with_its_batch_size():
    """P-tuning's official step is 1 row x 16 accumulated; a batch size given alone is the whole step."""
    assert (TrainOptions(tuning="ptuning").rows_per_batch, TrainOptions(tuning="ptuning").accumulation) == (1, 16)
    assert TrainOptions(tuning="ptuning", batch_size=16).accumulation == 1
    assert TrainOptions(tuning="ptuning", batch_size=4, grad_accum=4).accumulation == 4
    assert TrainOptions(tuning="ptuning", grad_accum=2).accumulation == 2


@pytest.mark.parametrize("tuning, flags", [
    ("ptuning", ["--pre-seq-len", "4", "--prefix-projection", "--lr", "1e-2"]),
    ("lora", ["--lora-r", "4", "--lr", "1e-2"]),
])
def test_short_run_learns_changes_only_trainable_weights_and_reloads(base_dir, train_file, records, tmp_path,
                                                                     tuning, flags):
    out = tmp_path / tuning
    log = _run(base_dir, train_file, out, "--tuning", tuning, "--max-steps", "12", *flags)
    losses = _losses(log)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses

    from safetensors.torch import load_file

    saved = (load_file(out / "model.safetensors") if tuning == "ptuning"
             else load_file(out / "adapter_model.safetensors"))
    trained_marker = "prefix_encoder" if tuning == "ptuning" else "lora_"
    assert saved and all(trained_marker in k for k in saved)

    # The training state holds what trains and no frozen weight: the trained tensors as published.
    state = load_file(out / "state" / "model.safetensors")
    assert state and all(trained_marker in k for k in state)
    published = {k.replace(".default.", ".").removeprefix("base_model.model."): v for k, v in saved.items()}
    assert {k.replace(".default.", ".").removeprefix("base_model.model."): v.shape for k, v in state.items()} == {
        k: v.shape for k, v in published.items()}
    for key, value in state.items():
        assert torch.equal(value, published[key.replace(".default.", ".").removeprefix("base_model.model.")]), key

    model, tokenizer = load_run(out)
    again, _ = load_run(out)
    assert torch.equal(_probe_logits(model, tokenizer, records), _probe_logits(again, tokenizer, records))


def test_compiled_layers_train_as_eager_ones_and_save_the_same_keys(base_dir, train_file, tmp_path, capsys):
    """`--compile BACKEND` compiles each decoder layer, here of a LoRA run (the layers inside peft's wrapper), with
    dynamo's own "eager" backend (the capture and its guards are what runs, at no kernel-compiling cost); the losses
    equal an uncompiled run's and the run reloads as one."""
    flags = ["--tuning", "lora", "--max-steps", "3", "--lr", "1e-3", "--lora-r", "4"]
    plain = _losses(_run(base_dir, train_file, tmp_path / "plain", *flags))
    compiled = _losses(_run(base_dir, train_file, tmp_path / "compiled", *flags, "--compile", "eager"))
    assert "decoder layers compiled (eager)" in capsys.readouterr().out
    assert compiled == pytest.approx(plain, rel=1e-5)
    saved = {p.name for p in (tmp_path / "compiled").iterdir() if p.suffix == ".safetensors"}
    assert saved == {p.name for p in (tmp_path / "plain").iterdir() if p.suffix == ".safetensors"}
    load_run(tmp_path / "compiled")


def test_compile_takes_the_layers_the_model_declares():
    from chatglm_tune.tuning.training import compile_layers, decoder_layers

    config = ChatGLMConfig.from_name("tiny")
    model = ChatGLMForConditionalGeneration(config)
    assert [type(m).__name__ for m in decoder_layers(model)] == ["GLMBlock"] * config.num_layers
    assert compile_layers(model, "eager") == config.num_layers


def test_resume_gives_the_same_weights_as_a_straight_run(base_dir, train_file, tmp_path, monkeypatch):
    flags = ["--tuning", "ptuning", "--pre-seq-len", "4", "--max-steps", "8", "--save-every", "4", "--lr", "1e-2"]
    straight = _run(base_dir, train_file, tmp_path / "straight", *flags)

    import chatglm_tune.tuning.training as training

    real_check = training._check_finite

    def crash_after_step_4(accelerator, loss, progress, output_dir):
        if progress["step"] == 4:
            raise KeyboardInterrupt("simulated kill after the step-4 save")
        real_check(accelerator, loss, progress, output_dir)

    monkeypatch.setattr(training, "_check_finite", crash_after_step_4)
    argv = ["--model", str(base_dir), "--train-file", str(train_file), "--output-dir", str(tmp_path / "resumed"),
            "--batch-size", "8", "--log-every", "1", "--max-len", "160", "--max-src-len", "128", *flags]
    assert train_cli.main(argv) == 130  # Ctrl-C: the state of step 4 kept as saved, not written again
    monkeypatch.setattr(training, "_check_finite", real_check)
    resumed = _run(base_dir, train_file, tmp_path / "resumed", *flags, "--resume")

    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(straight)[4:] == _losses(resumed)[-4:]


def test_failed_save_leaves_the_previous_checkpoint_loadable(base_dir, train_file, records, tmp_path, monkeypatch):
    import chatglm_tune.runtime.checkpoint as checkpoint

    out, saved = tmp_path / "run", []
    real_save = checkpoint.save_file

    def save_then_fail(tensors, path, metadata=None):  # the first checkpoint is written, the second breaks mid-file
        if saved:
            Path(path).write_bytes(b"half a file")
            raise OSError("disk full")
        real_save(tensors, path, metadata=metadata)
        saved.append({k: v.clone() for k, v in tensors.items()})

    monkeypatch.setattr(checkpoint, "save_file", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        _run(base_dir, train_file, out, "--tuning", "full", "--max-steps", "2", "--eval-every", "1", "--lr", "1e-2")
    model, _ = load_run(out)
    first = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert first.keys() == saved[0].keys() and all(torch.equal(first[k], saved[0][k]) for k in first)


def test_non_finite_loss_stops_with_a_clear_message(base_dir, train_file, tmp_path, capsys):
    argv = ["--model", str(base_dir), "--train-file", str(train_file), "--output-dir", str(tmp_path / "nan"),
            "--tuning", "full", "--max-steps", "3", "--lr", "1e30", "--max-grad-norm", "0", "--batch-size", "8"]
    assert train_cli.main(argv) == 2
    assert "the loss became" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [(), ("--overwrite",), ("--resume", "auto")])
def test_a_second_process_checks_the_directory_the_first_has_recorded(base_dir, train_file, tmp_path,
                                                                      monkeypatch, flags):
    """Of several launched processes the first alone checks and records the run directory: another, checking once
    the first has recorded its start, goes on with the same run (no "not empty"; nothing of the record emptied)."""
    argv = ["--model", str(base_dir), "--train-file", str(train_file), "--output-dir", str(tmp_path / "run"),
            "--tuning", "full", "--max-steps", "4", *flags]
    monkeypatch.setenv("RANK", "0")
    first = train_cli.check(train_cli.parse_args(argv))
    recorded = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert recorded
    monkeypatch.setenv("RANK", "1")
    second = train_cli.check(train_cli.parse_args(argv))
    assert second[2] == first[2]  # the same run record
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == recorded


def test_two_processes_follow_the_single_process_loss_curve_and_stop_together_on_sigterm(base_dir, train_file,
                                                                                         tmp_path):
    """Two CPU processes (DDP over gloo) follow one process's loss curve; SIGTERM to one of them (here the second:
    its peer never got it) stops both after the same step, its state saved once, and --resume then ends where the
    uninterrupted run did, loss for loss and weight for weight."""
    common = ["--model", str(base_dir), "--train-file", str(train_file), "--tuning", "full", "--max-steps", "4",
              "--log-every", "1", "--lr", "1e-3", "--max-grad-norm", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # DDP over gloo on the CPU: accelerate's "--cpu" would start one process whatever --num_processes says
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(free_port()), str(REPO / "train.py")]
    two = [*common, "--batch-size", "4"]
    subprocess.run(launch + two + ["--output-dir", str(tmp_path / "two")], env=env, check=True, cwd=REPO,
                   capture_output=True, timeout=HANG_S)
    subprocess.run([sys.executable, str(REPO / "train.py")] + common
                   + ["--batch-size", "8", "--output-dir", str(tmp_path / "one")], env=env, check=True, cwd=REPO,
                   capture_output=True, timeout=HANG_S)
    two_log, one_log = _entries(tmp_path / "two"), _entries(tmp_path / "one")
    assert len(_losses(one_log)) == len(_losses(two_log)) == 4
    # DDP averages the two halves' mean losses, one process the mean over all labelled tokens: close, not equal.
    assert all(abs(a - b) < 0.05 * a for a, b in zip(_losses(one_log), _losses(two_log))), (one_log, two_log)

    stopped = tmp_path / "stopped"
    done = subprocess.run(launch + two + ["--output-dir", str(stopped)], cwd=REPO, capture_output=True, text=True,
                          env=env | {crashpoints.AT_ENV: crashpoints.spell("train-step", 2, "SIGTERM", rank=1)},
                          timeout=HANG_S)
    assert (done.returncode != 0
            and "interrupted by SIGTERM after step 2: its state is saved" in done.stderr), done.stderr[-3000:]
    assert json.loads((stopped / "state" / "progress.json").read_text())["step"] == 2
    subprocess.run(launch + two + ["--output-dir", str(stopped), "--resume"], env=env, check=True, cwd=REPO,
                   capture_output=True, timeout=HANG_S)
    assert [{k: v for k, v in e.items() if k != "final" or "seconds" not in v}
            for e in _entries(stopped)][:-1] == two_log[:-1]
    assert (stopped / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()


# ----------------------------------------------------------------------------------------------
# How long a run trains: early stopping, the best checkpoint, the logged loss


def test_a_better_checkpoint_has_a_higher_f1_or_the_same_f1_and_a_lower_loss():
    from chatglm_tune.tuning.training import is_better

    assert is_better(0.0, 5.0, None, None)
    assert is_better(0.5, 9.0, 0.4, 1.0)
    assert is_better(0.0, 4.0, 0.0, 5.0)  # all F1 0.0 early on: the lower dev loss wins
    assert not is_better(0.0, 5.0, 0.0, 5.0) and not is_better(0.3, 0.1, 0.4, 9.0)


def _entries(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_early_stopping_after_patience_evaluations_without_a_better_checkpoint(base_dir, train_file, tmp_path):
    # lr 0: the first evaluation sets the best and no later one beats it
    flags = ["--tuning", "lora", "--lr", "0", "--eval-every", "1", "--dev-file", str(train_file),
             "--eval-batch-size", "48", "--max-len", "136"]
    _run(base_dir, train_file, tmp_path / "run", *flags, "--max-steps", "10", "--patience", "2")
    entries = _entries(tmp_path / "run")
    assert [e["step"] for e in entries if "eval" in e] == [1, 2, 3]  # two evaluations no better: stop
    assert entries[-1]["final"]["step"] == 3 and entries[-1]["final"]["stopped_early"]
    _run(base_dir, train_file, tmp_path / "patient", *flags, "--max-steps", "4", "--patience", "0")
    entries = _entries(tmp_path / "patient")
    assert [e["step"] for e in entries if "eval" in e] == [1, 2, 3, 4] and not entries[-1]["final"]["stopped_early"]


def test_ties_of_dev_f1_keep_the_checkpoint_with_the_lower_dev_loss(base_dir, train_file, tmp_path):
    out = tmp_path / "run"
    _run(base_dir, train_file, out, "--tuning", "full", "--lr", "1e-3", "--max-steps", "4", "--eval-every", "1",
         "--dev-file", str(train_file), "--eval-batch-size", "48", "--max-len", "136", "--patience", "0")
    entries = _entries(out)
    evals = [(e["eval"]["micro"]["f1"], e["eval"]["dev_loss"]) for e in entries if "eval" in e]
    assert len({f1 for f1, _ in evals}) == 1, evals  # a random tiny model extracts nothing yet: F1 ties throughout
    final = entries[-1]["final"]
    assert final["best_dev_loss"] == min(loss for _, loss in evals) and final["best_f1"] == evals[0][0]


def test_the_logged_loss_is_the_mean_over_its_logging_window(base_dir, train_file, tmp_path):
    every_step = _losses(_run(base_dir, train_file, tmp_path / "a", "--tuning", "ptuning", "--pre-seq-len", "4",
                              "--max-steps", "6", "--log-every", "1"))
    windows = _run(base_dir, train_file, tmp_path / "b", "--tuning", "ptuning", "--pre-seq-len", "4",
                   "--max-steps", "6", "--log-every", "3")
    logged = [e["loss"] for e in windows if "loss" in e]
    assert logged == pytest.approx([sum(every_step[:3]) / 3, sum(every_step[3:]) / 3], rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Prompt/response data (the official P-tuning shape)

ADVERTISE = REPO / "tests" / "fixtures" / "advertise_small.jsonl"


def test_prompt_response_columns_train_and_infer_with_the_generation_metrics(tmp_path, capsys):
    import infer as infer_cli

    out = tmp_path / "run"
    argv = ["--model", "tiny", "--tuning", "full", "--prompt-column", "content", "--response-column", "summary",
            "--train-file", str(ADVERTISE), "--dev-file", str(ADVERTISE), "--output-dir", str(out), "--max-steps", "6",
            "--batch-size", "4", "--max-src-len", "48", "--max-len", "112", "--threads", "1"]
    assert train_cli.main(argv) == 0
    evals = [e["eval"] for e in _entries(out) if "eval" in e]
    assert evals and all({"rouge-1", "rouge-2", "rouge-l", "bleu-4", "exact_match", "score"} <= set(e) for e in evals)
    run_args = rundir.read_run_args(out)
    assert run_args["columns"] == {"prompt": "content", "response": "summary", "history": None}
    assert run_args["encoding"]["prompt"] == ""  # the official P-tuning puts no instruction before the prompt
    capsys.readouterr()
    infer_cli.main(["--model", str(out), "--input", str(ADVERTISE), "--output", str(tmp_path / "o.jsonl")])
    printed = capsys.readouterr().out
    assert (re.search(r"^rouge-1 [\d.]+  rouge-2 [\d.]+  rouge-l [\d.]+  bleu-4 [\d.]+  exact_match [\d.]+$",
                      printed, re.M))
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
    gold = [json.loads(line) for line in ADVERTISE.read_text(encoding="utf-8").splitlines()]
    assert ([r["text"] for r in rows] == [g["content"] for g in gold]
            and [r["answer"] for r in rows] == [g["summary"] for g in gold])
    from chatglm_tune.evaluation.textmetrics import generation_scores

    summary = json.loads((tmp_path / "o.jsonl.summary.json").read_text(encoding="utf-8"))
    expect = generation_scores([r["generated"] for r in rows], [g["summary"] for g in gold])
    assert {k: summary["scores"][k] for k in expect} == pytest.approx(expect)
