"""End-to-end tests of infer.py and chatglm_tune.evaluation.extraction on a tiny random model and a small tokenizer.

The model is random, so the generated text is noise; what is tested is the plumbing: every record
once, in input order, identical between batch sizes, after a SIGKILL and `--resume`, with adapters
loaded from the directory layouts `train.py` writes.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
from chatglm_tune.data.batches import SpecialIds, collate_prompts, prompt_ids
from chatglm_tune.data.records import SPORecord, read_records
from chatglm_tune.decoding.generation import generate
from chatglm_tune.evaluation.extraction import extract, rows_to_resume
from chatglm_tune.options import ExtractionSettings
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.loading import load_run, resolve_run
from chatglm_tune.runs.rundir import RunDirectoryError
from commands import ROOT, cli, ok, side_by_side, wait_until

INFER = ROOT / "infer.py"
DEV = ROOT / "data" / "spo_dev.jsonl"
N_RECORDS = 20



@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tokenizer trained on the shipped data, a tiny random model saved with it, an input file."""
    from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("infer")
    lines = DEV.read_text(encoding="utf-8").splitlines()
    texts = [t for line in lines for t in json.loads(line).values()]
    model_dir = root / "model"
    tokenizer = train_tokenizer(texts, model_dir, vocab_size=1000)
    torch.manual_seed(0)
    config = ChatGLMConfig.from_name(
        "tiny", hidden_size=32, num_layers=2, num_attention_heads=2, inner_hidden_size=64,
        **tokenizer.config_overrides()
    )
    model = ChatGLMForConditionalGeneration(config)
    records = lines[:N_RECORDS - 1] + [json.dumps({"text": "没有标注的记录：发动机异响。"}, ensure_ascii=False)]
    (root / "input.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    make_some_rows_stop(model, tokenizer, root / "input.jsonl")
    model.save_pretrained(model_dir)
    return root


def make_some_rows_stop(model, tokenizer, input_file) -> None:
    """Give a random model's most frequent first answer token the role of <eop>: some rows then stop
    at once, some later, the rest at max_new_tokens. (A random ChatGLM mostly repeats one token, so the
    token ids are relabelled: the embedding rows of that token and of <eop> are swapped.)"""
    with torch.no_grad():
        for name, p in model.transformer.layers.named_parameters():
            if p.dim() == 2:
                p.mul_(20)  # weights large enough that the prompt decides what is generated
    records, _ = read_records(input_file)
    batch = collate_prompts([prompt_ids(r, tokenizer) for r in records], SpecialIds.of(tokenizer))
    out = generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=1, eos_token_id=None,
                   vocab_limit=len(tokenizer))
    special = set(tokenizer.all_special_ids) | {tokenizer.gmask_token_id}
    token = Counter(row[0] for row in out if row[0] not in special).most_common(1)[0][0]
    emb = model.transformer.word_embeddings.weight
    with torch.no_grad():
        emb[[token, tokenizer.eos_token_id]] = emb[[tokenizer.eos_token_id, token]]


def infer_main(argv):
    spec = importlib.util.spec_from_file_location("infer_cli", INFER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in argv])


def run_infer(workdir, output, *extra):
    infer_main(["--model", workdir / "model", "--input", workdir / "input.jsonl", "--output", output,
                "--max-new-tokens", 10, *extra])
    return [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]


def test_every_record_once_in_order_with_scores(workdir, tmp_path):
    rows = run_infer(workdir, tmp_path / "out.jsonl", "--batch-size", 3)
    records, _ = read_records(workdir / "input.jsonl")
    assert [r["index"] for r in rows] == list(range(N_RECORDS))
    assert [r["text"] for r in rows] == [r.text for r in records]
    assert {r["stopped"] for r in rows} == {"eos", "length"}, "the fixture model should stop some rows early"
    for row, record in zip(rows, records):
        assert row["answer"] == record.answer
        assert (row["f1"] is None) == (record.triples is None)
        assert row["new_tokens"] <= 10
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["records"] == N_RECORDS and summary["scores"]["scored_records"] == N_RECORDS - 1
    assert summary["this_run"]["new_tokens"] == sum(r["new_tokens"] for r in rows)
    assert set(summary["scores"]) >= {"micro", "sample_f1", "per_relation"}


def test_rows_do_not_depend_on_batch_size(workdir, tmp_path):
    one = run_infer(workdir, tmp_path / "b1.jsonl", "--batch-size", 1)
    many = run_infer(workdir, tmp_path / "b7.jsonl", "--batch-size", 7)
    assert one == many


def test_speculative_decoding_changes_no_row(workdir, tmp_path, capsys):
    plain = run_infer(workdir, tmp_path / "plain.jsonl", "--batch-size", 4, "--no-speculative")
    assert "speculative decoding off" in capsys.readouterr().err
    summary = json.loads((tmp_path / "plain.jsonl.summary.json").read_text(encoding="utf-8"))
    assert "speculative" not in summary["this_run"] and summary["settings"]["drafts"] is None
    auto = run_infer(workdir, tmp_path / "auto.jsonl", "--batch-size", 4)  # the default: steps of both kinds
    assert "speculative decoding auto: steps guess where guessing has been faster" in capsys.readouterr().err
    assert auto == plain
    assert json.loads((tmp_path / "auto.jsonl.summary.json").read_text(encoding="utf-8"))["settings"]["drafts"]["auto"]
    fast = run_infer(workdir, tmp_path / "fast.jsonl", "--batch-size", 4, "--speculative")
    captured = capsys.readouterr()
    assert "speculative decoding on" in captured.err and "speculative decoding:" in captured.out
    assert fast == plain
    spec = json.loads((tmp_path / "fast.jsonl.summary.json").read_text(encoding="utf-8"))["this_run"]["speculative"]
    assert spec["forwards"] > 0 and spec["accepted"] <= spec["drafted"] and spec["tokens_per_forward"] >= 1
    capped = run_infer(workdir, tmp_path / "capped.jsonl", "--batch-size", 4, "--speculative", "--max-draft", 1)
    assert "up to 1 guessed tokens checked a forward" in capsys.readouterr().err
    assert capped == plain
    summary = json.loads((tmp_path / "capped.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["settings"]["drafts"]["max_draft"] == 1 and summary["settings"]["drafts"]["first_draft"] == 1
    one = summary["this_run"]["speculative"]
    assert one["drafted"] <= one["forwards"] * 4  # at most one guess a row a forward, 4 rows


def test_compile_decodes_as_before_and_refuses_the_cpus_integer_kernels(workdir, tmp_path, capsys, monkeypatch):
    from serving import tiny_model

    from chatglm_tune.decoding import static_decoding

    # the static cache, each step run uncompiled (tests/test_static_decoding.py compiles it for real)
    monkeypatch.setattr(static_decoding, "compiled_step",
                        lambda model: lambda *a: static_decoding.forward_step(model, *a))
    glm = tiny_model("chatglm3", tmp_path / "chatglm3")
    rows = {}
    for name, flags in (("plain", []), ("compiled", ["--compile"])):
        infer_main(["--model", glm, "--input", workdir / "input.jsonl", "--output", tmp_path / f"{name}.jsonl",
                    "--max-new-tokens", 10, "--batch-size", 3, *flags])
        rows[name] = [json.loads(line)
                      for line in (tmp_path / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
    assert "decode steps compiled on a static cache" in capsys.readouterr().err
    assert rows["compiled"] == rows["plain"] and len(rows["plain"]) == N_RECORDS
    chatglm6b = {name: run_infer(workdir, tmp_path / f"6b-{name}.jsonl", "--batch-size", 3, *flags)
                 for name, flags in (("plain", []), ("compiled", ["--compile"]))}
    assert chatglm6b["compiled"] == chatglm6b["plain"]  # its 2D positions and both-ways prompts on a static cache
    with pytest.raises(SystemExit) as stop:  # the CPU's INT4 kernel chooses its work in C++ at every call
        run_infer(workdir, tmp_path / "refused.jsonl", "--compile", "--quantization-bit", 4)
    assert (stop.value.code == 2
            and "infer.py: error: --compile: compiled decoding runs float weights" in capsys.readouterr().err)
    assert not (tmp_path / "refused.jsonl").exists()


@pytest.mark.parametrize("flags, message",
                         [(["--no-speculative", "--max-draft", "2"], "--max-draft applies only with --speculative"),
                          (["--compile", "--speculative"], "--compile and --speculative do not combine"),
                          (["--speculative", "--max-draft", "0"], "--max-draft must be >= 1, got 0")])
def test_max_draft_needs_speculation_and_a_positive_count(workdir, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        run_infer(workdir, tmp_path / "out.jsonl", *flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_rows_equal_direct_generation(workdir):
    model, tokenizer = load_run(resolve_run(workdir / "model"))
    records, _ = read_records(workdir / "input.jsonl")
    rows = [r for ready in extract(model, tokenizer, records[:4], ExtractionSettings(batch_size=4, max_new_tokens=10))
            for r in ready]
    for row, record in zip(rows, records):
        ids = generate(model, torch.tensor([prompt_ids(record, tokenizer)]), max_new_tokens=10,
                       vocab_limit=len(tokenizer))[0]
        assert row["new_tokens"] == len(ids) and row["generated"] == tokenizer.decode(ids).strip()


def test_resume_after_sigkill_gives_the_uninterrupted_file(workdir, tmp_path):
    reference = tmp_path / "reference.jsonl"
    run_infer(workdir, reference, "--batch-size", 2)
    killed = tmp_path / "killed.jsonl"
    args = ["--model", str(workdir / "model"), "--input", str(workdir / "input.jsonl"), "--output", str(killed),
            "--max-new-tokens", "10", "--batch-size", "2"]
    stalled = tmp_path / "stalled"
    stalled_infer = (  # infer.py that stops for good once it has written 3 rows (and says so): killed mid-run
        "import pathlib, runpy, sys, threading; import chatglm_tune.evaluation.extraction as e; write = e.append_rows; "
        f"written = []; stalled = pathlib.Path({str(stalled)!r}); "
        "e.append_rows = lambda f, rows: (write(f, rows), written.extend(rows), "
        "len(written) >= 3 and (stalled.touch(), threading.Event().wait())); "
        f"sys.argv = [{str(INFER)!r}, *{args!r}]; runpy.run_path({str(INFER)!r}, run_name='__main__')"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", stalled_infer], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(stalled.exists, "infer.py writing 3 rows", alive=lambda: proc.poll() is None)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    written = killed.read_text(encoding="utf-8").count("\n")
    assert 3 <= written < N_RECORDS
    with open(killed, "a", encoding="utf-8") as f:
        f.write('{"index": 99, "text": "a torn li')  # a line the kill cut in half
    run_infer(workdir, killed, "--batch-size", 2, "--resume")
    assert killed.read_bytes() == reference.read_bytes()


def test_resume_of_a_complete_run_changes_nothing(workdir, tmp_path):
    out = tmp_path / "out.jsonl"
    run_infer(workdir, out, "--batch-size", 4)
    before = out.read_bytes()
    run_infer(workdir, out, "--batch-size", 4, "--resume")
    assert out.read_bytes() == before


def test_existing_output_needs_resume_and_must_match_the_input(workdir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    run_infer(workdir, out, "--batch-size", 4)
    with pytest.raises(SystemExit) as stopped:
        run_infer(workdir, out)
    assert stopped.value.code == 2 and "pass --resume" in capsys.readouterr().err
    records, _ = read_records(workdir / "input.jsonl")
    rows = out.read_text(encoding="utf-8").splitlines()
    out.write_text("\n".join(rows[1:]) + "\n", encoding="utf-8")  # not a prefix of the input any more
    with pytest.raises(ValueError, match="expected the row of record 0"):
        rows_to_resume(out, records, resolve_run(workdir / "model").identity(), resume=True)


def test_resume_with_another_model_is_refused_naming_both(workdir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    run_infer(workdir, out, "--batch-size", 4)
    before = out.read_bytes()
    with pytest.raises(SystemExit) as stopped:
        run_infer(workdir, out, "--batch-size", 4, "--resume", "--quantization-bit", "8")
    assert stopped.value.code == 2
    assert re.search(r"written by .*model, weights as stored; this run's model is .*model, INT8",
                     capsys.readouterr().err)
    assert out.read_bytes() == before


def test_int8_embedding_flag_decodes_every_record(workdir, tmp_path):
    rows = run_infer(workdir, tmp_path / "e8.jsonl", "--batch-size", 4, "--quantize-embedding")
    assert [r["index"] for r in rows] == list(range(N_RECORDS))
    assert all(r["new_tokens"] <= 10 for r in rows)


def test_sampling_flags_need_do_sample(workdir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_infer(workdir, tmp_path / "x.jsonl", "--top-p", "0.5")
    assert "apply only with --do-sample" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        run_infer(workdir, tmp_path / "x.jsonl", "--do-sample", "--top-p", "1.5")
    assert stopped.value.code == 2 and re.search(r"top_p must be in \(0, 1\]", capsys.readouterr().err)


def test_seeded_sampling_is_resumable(workdir, tmp_path):
    a = run_infer(workdir, tmp_path / "a.jsonl", "--do-sample", "--seed", "5", "--batch-size", 3)
    b = run_infer(workdir, tmp_path / "b.jsonl", "--do-sample", "--seed", "5", "--batch-size", 8)
    assert a == b  # record i samples with seed + i, whatever its batch


def test_text_one_off(workdir, capsys):
    infer_main(["--model", workdir / "model", "--text", "故障现象：发动机异响。", "--max-new-tokens", 6])
    model, tokenizer = load_run(resolve_run(workdir / "model"))
    row = next(r for ready in extract(model, tokenizer, [SPORecord("故障现象：发动机异响。", None)],
                                      ExtractionSettings(max_new_tokens=6)) for r in ready)
    assert capsys.readouterr().out.splitlines()[0] == row["generated"]


# ----------------------------------------------------------------------------------------------
# Model directories: P-tuning and LoRA runs as train.py writes them, and the adapter flags


def write_run_args(run_dir: Path, base: Path, tuning: str) -> None:
    (run_dir / "run_args.json").write_text(json.dumps({"model": str(base), "tuning": tuning}))


def test_ptuning_run_directory_and_flag(workdir, tmp_path):
    base = workdir / "model"
    torch.manual_seed(1)
    tuned = ChatGLMForConditionalGeneration.from_pretrained(base, pre_seq_len=3, prefix_projection=True)
    run = tmp_path / "ptuning-run"
    prefix_state = {k: v for k, v in tuned.state_dict().items() if k.startswith("transformer.prefix_encoder.")}
    tuned.save_pretrained(run, state_dict=prefix_state)
    write_run_args(run, base, "ptuning")

    source = resolve_run(run)
    assert (source.base, source.prefix_dir, source.pre_seq_len, source.prefix_projection) == (base, run, 3, True)
    assert source.tokenizer_dir == base  # the run has no tokenizer files of its own
    model, tokenizer = load_run(source)
    ids = torch.tensor([tokenizer.encode("发动机异响")])
    expect = generate(tuned.eval(), ids, max_new_tokens=8, eos_token_id=None)
    assert generate(model, ids, max_new_tokens=8, eos_token_id=None) == expect
    flagged, _ = load_run(resolve_run(base, ptuning_checkpoint=run))
    assert generate(flagged, ids, max_new_tokens=8, eos_token_id=None) == expect
    with pytest.raises(ValueError, match="already holds an adapter"):
        resolve_run(run, ptuning_checkpoint=run)


def test_lora_run_directory_is_merged(workdir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = workdir / "model"
    torch.manual_seed(2)
    peft_model = get_peft_model(
        ChatGLMForConditionalGeneration.from_pretrained(base),
        LoraConfig(target_modules=["query_key_value", "dense_h_to_4h"], r=4, lora_alpha=8, init_lora_weights=False),
    )
    run = tmp_path / "lora-run"
    peft_model.save_pretrained(run)
    write_run_args(run, base, "lora")

    source = resolve_run(run)
    assert (source.base, source.lora_dir) == (base, run)
    model, tokenizer = load_run(source)
    ids = torch.tensor([tokenizer.encode("发动机异响")])
    with torch.no_grad():
        expect = peft_model.eval()(input_ids=ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name, _ in model.named_parameters())
    int8_embedding, _ = load_run(source, quantize_embedding=True)  # merged, then its head in INT8
    assert isinstance(int8_embedding.lm_head, QuantizedLinear)
    with torch.no_grad():
        assert (int8_embedding(ids).logits - expect).norm() / expect.norm() < 0.02
    flagged = resolve_run(base, lora=run)
    assert (flagged.base, flagged.lora_dir) == (base, run)


def test_run_directory_without_run_args_is_explained(workdir, tmp_path):
    run = tmp_path / "orphan"
    run.mkdir()
    (run / "adapter_config.json").write_text("{}")
    with pytest.raises(RunDirectoryError, match="run_args.json"):
        resolve_run(run)


# ----------------------------------------------------------------------------------------------
# Directories written by train.py itself


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """A 2-step full fine-tuning of `--model tiny`, then 2-step P-tuning and LoRA runs on top of it."""
    root = tmp_path_factory.mktemp("runs")
    lines = DEV.read_text(encoding="utf-8").splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:24]) + "\n", encoding="utf-8")
    (root / "dev.jsonl").write_text("\n".join(lines[24:30]) + "\n", encoding="utf-8")
    common = ["--train-file", root / "train.jsonl", "--dev-file", root / "dev.jsonl", "--max-steps", "2",
              "--batch-size", "8", "--max-src-len", "48", "--max-len", "60", "--prompt", "抽取："]
    runs = {"full": ["--model", "tiny", "--tuning", "full"],
            "ptuning": ["--model", root / "full", "--tuning", "ptuning", "--pre-seq-len", "4", "--prefix-projection"],
            "lora": ["--model", root / "full", "--tuning", "lora"]}
    command = {name: ("train.py", *args, *common, "--output-dir", root / name) for name, args in runs.items()}
    ok(cli(*command["full"]))
    side_by_side(command["ptuning"], command["lora"])  # both on the full run
    return root


@pytest.mark.parametrize("tuning", ["full", "ptuning", "lora"])
def test_a_train_run_directory_is_enough(train_runs, tuning, tmp_path):
    run = train_runs / tuning
    source = resolve_run(run)
    assert source.base == (run if tuning == "full" else train_runs / "full")
    assert (source.encoding.prompt, source.encoding.max_src_len, source.encoding.max_len) == ("抽取：", 48, 60)
    out = tmp_path / "out.jsonl"
    infer_main(["--model", run, "--input", train_runs / "dev.jsonl", "--output", out])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert all(r["new_tokens"] <= 60 - 48 for r in rows)  # the run's answer budget
    if tuning != "full":  # the same model through the adapter flags on the base
        flag = "--ptuning-checkpoint" if tuning == "ptuning" else "--lora"
        flagged = tmp_path / "flagged.jsonl"
        infer_main(["--model", train_runs / "full", flag, run, "--input", train_runs / "dev.jsonl",
                    "--output", flagged])
        assert flagged.read_bytes() == out.read_bytes()


@pytest.fixture(scope="module")
def glm53_flash(tmp_path_factory):
    """A tiny random GLM-5.3-Flash (KDA linear attention and sparse attention) and 8 records."""
    from serving import tiny_model

    root = tmp_path_factory.mktemp("glm53-flash")
    tiny_model("glm53-flash", root / "model")
    (root / "input.jsonl").write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:8]) + "\n",
                                      encoding="utf-8")
    return root


def test_glm53_flash_infers_in_batches_resumes_and_decodes_without_guesses(glm53_flash, tmp_path, capsys):
    """Left-padded batches give each record its rows alone; `--resume` finishes a cut file as the whole run wrote it;
    speculation left to choose itself (the default `auto`) stays off, its recurrent states taking no guesses back, and
    asked for outright (`--speculative`) is refused with the reason, as `--compile` is (no static cache)."""
    def run(output, *extra):
        infer_main(["--model", glm53_flash / "model", "--input", glm53_flash / "input.jsonl", "--output", output,
                    "--max-new-tokens", 6, "--threads", 1, *extra])
        return output.read_text(encoding="utf-8")

    batched = run(tmp_path / "batched.jsonl", "--batch-size", 3)
    assert "speculative decoding off (Glm5NextForCausalLMWithPrefix keeps recurrent states" in capsys.readouterr().err
    assert json.loads((tmp_path / "batched.jsonl.summary.json").read_text())["records"] == 8
    assert run(tmp_path / "alone.jsonl", "--batch-size", 1, "--no-speculative") == batched
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(batched.splitlines(keepends=True)[:3]), encoding="utf-8")
    (tmp_path / "cut.jsonl.model.json").write_bytes((tmp_path / "batched.jsonl.model.json").read_bytes())
    assert run(cut, "--batch-size", 3, "--resume") == batched
    capsys.readouterr()
    for flag, reason in (("--speculative", "--speculative on: .* cannot take rejected guesses back"),
                         ("--compile", "--compile: compiled decoding needs a model that decodes on a static cache")):
        with pytest.raises(SystemExit) as stop:
            run(tmp_path / f"{flag[2:]}.jsonl", flag)
        assert stop.value.code == 2 and re.search(reason, capsys.readouterr().err), flag
