"""Benchmarks run end to end on their smallest setting (the library under them moves; a bench that no
longer runs is found here, not by the next person who measures)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import HANG_S

REPO = Path(__file__).resolve().parents[1]


def test_generate_bench_runs_and_ends_with_its_json():
    done = subprocess.run(
        [sys.executable, "bench/decode/generate.py", "--configs", "tiny", "--new-tokens", "1:4",
         "--recompute-tokens", "1:2", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    methods = {row["method"] for row in summary["results"]}
    assert {"kv-cache", "recompute"} <= methods
    assert all(row["tokens_per_s"] > 0 for row in summary["results"])


def test_demo_bench_times_the_readme_demo_and_its_infer_reads_the_trained_run():
    from bench.training import demo

    train, infer = demo.readme_commands()
    assert train[:4] == ["python", "train.py", "--model", "tiny"]
    run_dir = train[train.index("--output-dir") + 1]
    assert run_dir == demo.README_OUTPUT  # the directory the bench swaps for its own
    assert infer[infer.index("--model") + 1] == run_dir  # infer.py scores the model the demo just trained
    assert infer[infer.index("--input") + 1] == train[train.index("--dev-file") + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench/gpu/gpu.py runs for real there")
def test_gpu_bench_says_in_one_line_that_it_needs_a_gpu():
    done = subprocess.run([sys.executable, "bench/gpu/gpu.py", "--quick"], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and message.startswith("bench/gpu/gpu.py: needs a CUDA GPU: torch.cuda.is_available() "
                                                      "is False")


def test_gpu_results_merge_by_row_and_take_a_gpu_serve_run(tmp_path):
    """A gpu.py run replaces only the rows it measured (model, precision, impl, what, batch), each row keeping its
    run's time; serve.py's results on that GPU join as "serve" rows, in the page and the headline."""
    from bench.gpu import gpu_report

    info = {"device": "GPU X", "capability": "9.0", "memory_gb": 1.0, "torch": "t", "cuda": "c", "transformers": "t",
            "peft": "p", "bitsandbytes": None, "copy_gb_s": 4000.0}
    notes = {"m": {"parameters": 1e9, "layers": 2, "hidden": 8, "weights_gb": {"bf16": 2.0},
                   "read_gb_per_token": {"bf16": 2.0}}}
    settings = {"prompt_len": 4, "new_tokens": 4, "train_batch": 1, "train_len": 8, "steps": 1}

    def row(impl, batch, tok_s):
        return {"model": "m", "precision": "bf16", "impl": impl, "what": "decode", "batch": batch, "seconds": 1.0,
                "tok_s": tok_s, "decode_tok_s": tok_s, "peak_gb": 2.0}

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(gpu_report.merged(path, info, None, notes,
                                                 [row("toolkit", 1, 50.0), row("toolkit", 32, 900.0)], settings)))
    first = json.loads(path.read_text())["rows"][1]["run"]
    results = gpu_report.merged(path, info, None, {"m": {"kernel_vs_dequant_error": {"int4": 0.01}}},
                                [row("toolkit", 1, 60.0), row("toolkit-compiled", 1, 1200.0)], settings)
    kept = {(r["impl"], r["batch"]): r for r in results["rows"]}
    assert kept.keys() == {("toolkit", 1), ("toolkit", 32), ("toolkit-compiled", 1)}
    assert kept["toolkit", 1]["tok_s"] == 60.0 and kept["toolkit", 32]["run"] == first
    assert results["models"]["m"]["weights_gb"] == {"bf16": 2.0} and "kernel_vs_dequant_error" in results["models"]["m"]
    path.write_text(json.dumps(results))
    serve = {"when": "then", "argv": [], "model": {}, "results": [
        {"server": "batch64-compiled", "streams": 64, "requests": 128, "failed": 0, "tokens": 4096, "wall_s": 1.0,
         "tokens_per_s": 4096.0, "ttft_p50_ms": 10.0, "ttft_p95_ms": 20.0, "itl_p50_ms": 5.0, "itl_p95_ms": 9.0}]}
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    assert gpu_report.main(["--serve", str(tmp_path / "serve.json"), "--model", "m", "--out", str(tmp_path)]) == 0
    merged = json.loads(path.read_text())
    assert merged["headline"]["m"]["serve_tok_s"] == {"batch64-compiled@64": 4096.0}
    assert merged["headline"]["m"]["bf16_compiled_b1_bandwidth_share"] == round(1200.0 * 2.0 / 4000.0, 3)
    page = (tmp_path / "gpu.md").read_text()
    assert "| bf16 | batch64-compiled | 64 | 128 (0) | 4096.0 | 10.0 / 20.0 | 5.0 / 9.0 | then |" in page


def test_serve_bench_runs_both_servers_and_its_soak(tmp_path):
    pytest.importorskip("openai", reason="bench/serve/serve.py drives the server with the openai client")
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "bench/serve/serve.py", "--quick", "--streams", "1,2", "--requests-per-stream", "2",
         "--soak", "120", "--no-floor", "--threads", "1", "--speculative", "--schema", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {key for key in summary["tokens_per_s"] if key.startswith("batch")}  # + llama-server's where one is found
    assert ours == {"batch32@1", "batch32@2", "batch1@1", "batch1@2", "batch32-spec@1", "batch32-spec@2",
                    "batch32-chat@1", "batch32-chat@2", "batch32-schema@1", "batch32-schema@2"}
    assert set(summary["speculative_vs_plain"]) == set(summary["schema_vs_plain"]) == {"1", "2"}  # streams (JSON keys)
    assert all(rate > 0 for rate in summary["tokens_per_s"].values())
    assert summary["soak_passed"], json.loads(out.read_text())["soak"]["checks"]


def test_serve_bench_puts_llama_server_on_the_same_work(tmp_path):
    """llama-server gets the same prompts (the ids serve.py builds, the same chat messages) and answers as long."""
    from bench.serve.serve_servers import LLAMA_SERVER_BUILD, find_llama_server

    pytest.importorskip("openai", reason="bench/serve/serve.py drives the servers with the openai client")
    pytest.importorskip("gguf", reason='the export extra is not installed: pip install -e ".[export]"')
    binary = find_llama_server()
    if binary is None:
        pytest.skip(f"no llama-server ($LLAMA_SERVER or on PATH): {LLAMA_SERVER_BUILD}")
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "bench/serve/serve.py", "--quick", "--streams", "1,2", "--requests-per-stream",
         "2", "--soak", "0", "--no-floor", "--no-baseline", "--threads", "1", "--llama-server", str(binary),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["server"], r["streams"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("batch32", 1), ("batch32", 2), ("llama-server", 1), ("llama-server", 2)}
    for streams in (1, 2):
        ours, theirs = rows[("batch32", streams)], rows[("llama-server", streams)]
        assert theirs["failed"] == 0 and theirs["tokens_per_s"] > 0
        assert (theirs["prompt_tokens"], theirs["tokens"]) == (ours["prompt_tokens"], ours["tokens"])


def _peer(*args, out: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "bench/peer/peer.py", *args, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_peer_bench_records_the_llama_steps_of_chatglm6b_as_not_run(tmp_path):
    _peer("--version", "chatglm", "--step", "gguf-q4_0", out=tmp_path)
    _peer("--version", "chatglm", "--step", "llama-batch-q4_0-b8", "--threads", "1", out=tmp_path)
    report = _peer("--version", "chatglm", "--step", "report", "--threads", "1", out=tmp_path)
    summary = json.loads(report.stdout.strip().splitlines()[-1])
    steps = json.loads((tmp_path / "peer_steps.json").read_text())
    assert set(steps) == {"gguf-q4_0", "llama-batch-q4_0-b8@1t"}
    assert all("ChatGLM-6B" in r["skipped"] for r in steps.values())
    assert summary["decode_tok_s"]["llama_q4_0"] is None and summary["records_per_s"]["llama_q4_0_b8"] is None
    not_run = "## Not run\n\n- gguf-q4_0, llama-batch-q4_0-b8@1t: llama.cpp has no ChatGLM-6B"
    assert not_run in (tmp_path / "peer.md").read_text()


def test_peer_bench_again_keeps_every_run_and_reports_the_median_one():
    from bench.peer import peer, peer_report

    runs = [{"decode_ms": ms, "prefill_ms": 10.0 * i} for i, ms in enumerate((120.0, 90.0, 100.0))]
    record = peer.median_run(peer.median_run(runs[:2])["runs"] + runs[2:])
    assert record["decode_ms"] == 100.0 and record["prefill_ms"] == 20.0  # the whole median run, not mixed fields
    assert [r["decode_ms"] for r in record["runs"]] == [120.0, 90.0, 100.0]
    assert peer.median_run(runs[:2])["decode_ms"] == 120.0  # an even count: the slower middle run
    batch = peer.median_run([{"seconds": 30.0}, {"seconds": 20.0}, {"seconds": 25.0}])
    assert batch["seconds"] == 25.0
    table = "\n".join(peer_report._repeats_table({"toolkit-int4@2t": record, "llama-q4_0@2t": runs[0]}))
    assert "| toolkit-int4@2t | 3 | 120, 90, 100 | 100.0 |" in table and "llama-q4_0@2t" not in table


def test_peer_bench_runs_llama_without_avx512_only_on_a_build_without_it(tmp_path):
    """--capability avx2 marks llama-* steps +avx2 (not the GGUF export, which llama.cpp does not run), and a
    llama.cpp whose ggml reports AVX-512 kernels is refused with what to build instead."""
    from bench.peer import peer, peer_llama

    args = peer.argparse.Namespace(version="chatglm3", model_dir=tmp_path / "m", quick=False, out=tmp_path, threads=2,
                                   quantize_embedding=True, capability="avx2", prompt_len=peer.PROMPT_LEN)
    bench = peer.Bench(args)
    assert bench.key("llama-q4_0") == "llama-q4_0@2t+avx2" and bench.key("toolkit-int4") == "toolkit-int4@2t+e8+avx2"
    assert bench.key("gguf-q4_0") == "gguf-q4_0" and bench.key("cpp-q4_0") == "cpp-q4_0@2t"

    class Build:
        __file__ = "/somewhere/llama_cpp/__init__.py"

        def __init__(self, info):
            self.info = info

        def llama_print_system_info(self):
            return self.info.encode()

    native = Build("CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 |")
    avx2 = Build("CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |")
    refused = peer_llama._wrong_build(native, "avx2")
    assert "/somewhere/llama_cpp" in refused and "-DGGML_AVX512=OFF" in refused and "--llama-cpp DIR" in refused
    assert peer_llama._wrong_build(avx2, "avx2") is None and peer_llama._wrong_build(native, None) is None


def test_peer_report_puts_the_avx2_runs_side_by_side():
    from bench.peer import peer_report

    run = lambda ms, prefill, rss: {"decode_ms": ms, "prefill_ms": prefill, "peak_rss_gb": rss}  # noqa: E731
    steps = {"toolkit-int4@2t+avx2": run(150.0, 3000.0, 4.4), "toolkit-int4@2t+e8+avx2": run(120.0, 2900.0, 3.9),
             "llama-q4_0@2t+avx2": run(132.0, 4600.0, 6.9), "toolkit-int8@1t+e8+avx2": run(300.0, 6000.0, 6.7),
             "llama-q4_0@2t": run(100.0, 2700.0, 6.9)}
    lines = peer_report._without_avx512(steps)
    assert ("| 2 | toolkit-int4@2t+e8+avx2 | 120.0 | 2900 | 3.90 | q4_0 | 132.0 | 4600 | 6.90 | 1.10x | 1.59x | 0.57x |"
            in lines)
    assert not any(line.startswith("| 1 |") for line in lines)  # no llama.cpp run of INT8 at one thread: no row
    assert peer_report._without_avx512({"llama-q4_0@2t": run(100.0, 2700.0, 6.9)}) == []


def test_peer_bench_llama_children_decode_as_the_toolkit(tmp_path):
    """bench/peer/peer_llama.py's processes on a tiny ChatGLM3 GGUF (export.py, f16): one sequence, and three decoded in
    one llama.cpp batch, give the toolkit's greedy tokens."""
    pytest.importorskip("gguf", reason='the export extra is not installed: pip install -e ".[export]"')
    pytest.importorskip("llama_cpp", reason='llama-cpp-python is not installed: '
                                            'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python')
    from serving import tiny_model

    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.generation import generate

    directory = tiny_model("chatglm3", tmp_path / "tiny")
    gguf = tmp_path / "gguf"
    done = subprocess.run([sys.executable, "export.py", str(directory), str(gguf), "--type", "f16", "--name", "tiny"],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    model = from_pretrained(directory, dtype=torch.float32)
    prompts = torch.randint(5, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    want = [list(row) for row in generate(model, torch.tensor(prompts), max_new_tokens=6, eos_token_id=None)]
    work = {"warmup": prompts[0][:4], "warmup_new": 2, "prompts": prompts, "new": 6}
    records = {}
    for child, rows in (("llama", prompts[:1]), ("llama-batch", prompts)):
        done = subprocess.run([sys.executable, "bench/peer/peer_llama.py", "--child", child, "--gguf",
                               str(gguf / "tiny-f16.gguf"), "--threads", "1", "--workload",
                               json.dumps({**work, "prompts": rows})],
                              cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 0, done.stderr[-2000:]
        records[child] = json.loads(done.stdout.strip().splitlines()[-1])
    assert records["llama"]["first_tokens"] == want[0] and records["llama"]["decode_ms"] > 0
    batch = records["llama-batch"]
    assert (batch["batch"] == 3 and batch["first_tokens"] == want[0]
            and batch["last_tokens"] == [row[-1] for row in want])


def _tensor_layout(directory: Path) -> dict:
    from safetensors import safe_open

    layout = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                layout[key] = (part.get_dtype(), tuple(part.get_shape()))
    return layout


def test_scale_bench_writes_glm4_0414_as_released_and_its_32b_as_quantize_py_would(tmp_path):
    """bench/scale/scale.py's GLM-4-0414 checkpoints at a tiny shape: the fp16 one (transformers' form) loads as
    `Glm4ForCausalLM`, and the INT4 one written directly (the 32B row: no fp16 checkpoint) has the keys, dtypes and
    shapes that quantize.py --bits 4 writes from the fp16 one, and loads and runs."""
    import dataclasses

    from bench.common.checkpoint_writer import write_checkpoint
    from bench.common.scale_versions import VERSIONS

    from chatglm_tune import from_pretrained

    tiny = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 16,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "pad_token_id": 0, "eos_token_id": [1]}

    def row(name):
        version = VERSIONS[name]
        return dataclasses.replace(version, official_config={**version.official_config, **tiny}, tokenizer_assets=None)

    write_checkpoint(tmp_path / "fp16", row("glm4-0414"), 2)
    write_checkpoint(tmp_path / "int4", row("glm4-0414-32b"), 2)
    model = from_pretrained(tmp_path / "fp16", dtype=torch.float32)
    assert type(model).__name__ == "Glm4ForCausalLMWithPrefix"
    done = subprocess.run([sys.executable, "quantize.py", "--bits", "4", str(tmp_path / "fp16"), str(tmp_path / "q")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _tensor_layout(tmp_path / "int4") == _tensor_layout(tmp_path / "q")
    written = json.loads((tmp_path / "int4" / "config.json").read_text())
    assert written["quantization_bit"] == 4 and written["model_type"] == "glm4"
    model = from_pretrained(tmp_path / "int4", dtype=torch.bfloat16, quantization_bit=4)
    logits = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_scale_bench_writes_glm47_flash_as_quantize_py_would(tmp_path):
    """bench/scale/scale.py's GLM-4.7-Flash checkpoint at a tiny shape, written directly in INT4: the keys, dtypes and
    shapes quantize.py --bits 4 writes from the same model in float (routed experts one by one), and it runs."""
    import dataclasses

    from bench.common.checkpoint_writer import write_checkpoint
    from bench.common.scale_versions import VERSIONS

    from chatglm_tune import from_pretrained

    tiny = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "mlp_layer_types": ["dense", "sparse"], "vocab_size": 256, "pad_token_id": 0, "eos_token_id": [1]}
    int4 = dataclasses.replace(VERSIONS["glm47-flash"],
                               official_config={**VERSIONS["glm47-flash"].official_config, **tiny},
                               tokenizer_assets=None)
    write_checkpoint(tmp_path / "int4", int4, 2)
    write_checkpoint(tmp_path / "float", dataclasses.replace(int4, layout="glm4-0414", written_bits=0), 2)
    done = subprocess.run([sys.executable, "quantize.py", "--bits", "4", str(tmp_path / "float"), str(tmp_path / "q")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    written = _tensor_layout(tmp_path / "int4")
    assert (written == _tensor_layout(tmp_path / "q")
            and "model.layers.1.mlp.experts.3.down_proj.weight_scale" in written)
    model = from_pretrained(tmp_path / "int4", dtype=torch.bfloat16, quantize_embedding=True)
    logits = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_tools_bench_sends_each_dev_conversation_as_openai_does():
    """The tool bench's requests: the dev conversation before its gold call, the tools in OpenAI's form, and the
    gold call the records read."""
    from bench.training.tools import DATA, openai_request
    from chatglm_tune.data.records import read_records

    for version, (_, dev) in DATA.items():
        path = REPO / dev
        messages, tools, gold = openai_request(json.loads(path.read_text(encoding="utf-8").splitlines()[0]))
        record = read_records(path)[0][0]
        assert messages == [{"role": "user", "content": record.text}], version
        assert all(tool["type"] == "function" and "name" in tool["function"] for tool in tools) and len(tools) == 3
        assert gold == record.dialogue.answer.call.to_json()


def test_scale_bench_accounts_glm45_air_memory_as_the_loader_allocates_it(tmp_path):
    """bench/scale/scale_memory.py's accounting of GLM-4.5-Air at a tiny shape (INT4 experts and blocks, INT8
    embedding and head) sums, part by part, to the bytes of the model the loader fills from the INT4 checkpoint the
    bench writes; the full size's weights are GLM-4.5-Air's ~54 GB."""
    import dataclasses

    from bench.common.checkpoint_writer import write_checkpoint
    from bench.common.scale_versions import VERSIONS
    from bench.scale.scale_memory import GB, PARTS, accounting, bytes_by_part

    from chatglm_tune import from_pretrained

    tiny = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "vocab_size": 256, "pad_token_id": 0, "eos_token_id": [1]}
    air = dataclasses.replace(VERSIONS["glm45-air"], official_config={**VERSIONS["glm45-air"].official_config, **tiny},
                              tokenizer_assets=None)
    write_checkpoint(tmp_path / "int4", air, 2)
    model = from_pretrained(tmp_path / "int4", dtype=torch.bfloat16, quantize_embedding=True)
    loaded = bytes_by_part(model.state_dict())
    counted = accounting(air.config_json(), 4)
    assert {part: counted[part] for part in PARTS} == loaded and loaded["routed experts"] > 0
    full = accounting(VERSIONS["glm45-air"].config_json(), 4)
    assert 50 < sum(full[part] for part in PARTS) / GB < 60


def test_tools_bench_reuses_only_finished_runs(tmp_path):
    """`--reuse` measures a run whose metrics.jsonl ends with its final entry; a stopped or absent one trains."""
    from bench.training.tools import finished_run_seconds

    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    for run, lines in ((finished, [{"step": 10, "loss": 1.0}, {"final": {"step": 10, "seconds": 12.5}}]),
                       (stopped, [{"step": 10, "loss": 1.0}])):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert [finished_run_seconds(run) for run in (finished, stopped, tmp_path / "absent")] == [12.5, None, None]


@pytest.fixture(scope="module")
def tiny_chatglm3(tmp_path_factory):
    """A random tiny ChatGLM3 run directory, shared by the benches that decode one."""
    from serving import tiny_model

    return tiny_model("chatglm3", tmp_path_factory.mktemp("tiny"))


def test_full_size_speculative_bench_replays_the_pattern_it_recorded(tiny_chatglm3, tmp_path):
    """bench/decode/speculative_full.py on its smallest setting: a tiny model stands for both the trained model and
    the full-size one; the replay decodes as many tokens both ways, in as many forwards as the pattern says."""
    directory = tiny_chatglm3
    out = tmp_path / "full.json"
    done = subprocess.run([sys.executable, "bench/decode/speculative_full.py", "--model", str(directory), "--pattern",
                           str(directory), "--records", "2", "--batch-sizes", "1,2", "--max-draft", "2", "--reps", "1",
                           "--quantization-bit", "0", "--dtype", "float32", "--threads", "1", "--gguf",
                           str(tmp_path / "none.gguf"), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text(encoding="utf-8"))
    assert [row["guesses"] for row in summary["verify"]] == [0, 1, 2, 4, 8]
    assert summary["drafts"]["max_draft"] == 2 and summary["drafts"]["first_draft"] == 2
    one, two = summary["replay"]
    assert (one["batch"], two["batch"]) == (1, 2) and one["records"] == two["records"] == 2
    assert one["decoded_tokens"] == two["decoded_tokens"] > 0  # the same answers, however batched
    assert one["tokens_per_forward"] == round(one["decoded_tokens"] / one["speculative_forwards"], 3) >= 1
    assert one["plain_forwards"] == one["decoded_tokens"]  # at batch 1, a forward a token
    assert two["plain_forwards"] < two["decoded_tokens"] and two["speculative_forwards"] <= two["plain_forwards"]
    assert all(r["plain_tok_s"] > 0 and r["speculative_tok_s"] > 0 for r in (one, two))
    assert summary["llama"]["skipped"].startswith("no ") and "gguf-q4_0" in summary["llama"]["skipped"]
    assert "| 2 | " in out.with_suffix(".md").read_text(encoding="utf-8")  # the batch-2 row of the table


def test_fewrow_benches_time_both_sides_on_the_same_work(tiny_chatglm3, tmp_path):
    """bench/kernels/fewrow.py --quick and bench/decode/fewrow_decode.py on a tiny ChatGLM3: both sides timed, the
    kernel's products within float rounding of float64, both sides' greedy tokens compared."""
    from chatglm_tune.quant import fewrow_cpu

    if not fewrow_cpu.available():
        pytest.skip("the few-row kernel needs x86-64 with AVX2 and FMA")
    done = subprocess.run([sys.executable, "bench/kernels/fewrow.py", "--quick", "--threads", "1", "--out",
                           str(tmp_path / "k.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["fewrow"]["rows"]
    assert {(r["dtype"], r["rows"]) for r in rows} >= {("float32", 1), ("float32", 32), ("bfloat16", 9)}
    assert all(r["pytorch_ms"] > 0 and r["fewrow_ms"] > 0 for r in rows)
    assert all(r["max_abs_error"] < 1e-3 for r in rows if r["dtype"] == "float32")
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "bench/decode/fewrow_decode.py", "--model", str(tiny_chatglm3),
                           "--threads", "1", "--batches", "2", "--steps", "2", "--reps", "1", "--rounds", "1",
                           "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])["fewrow_decode"]
    assert result == json.loads(out.read_text(encoding="utf-8"))["fewrow_decode"]
    for side in ("pytorch", "fewrow"):
        assert set(result[side]["step_ms"]) == {"1", "2"} and set(result[side]["check_ms"]) == {"1", "2", "4", "8"}
    assert set(result["same_tokens"]) == {"1", "2"}


# GLM-5 and GLM-5.3-Flash at a tiny shape: 4 layers (GLM-5.3-Flash's default pattern: 3 KDA, then a sparse one;
# both: 3 dense MLPs, then routed experts), every width small.
_TINY_NEXT = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
              "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
              "v_head_dim": 16, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "pad_token_id": 0}
_TINY = {"glm5": {**_TINY_NEXT, "qk_rope_head_dim": 8},
         "glm53-flash": {**_TINY_NEXT, "index_kpool": 4, "linear_head_dim": 8, "linear_num_heads": 4, "hc_mult": 2}}


def _tiny_row(name):
    import dataclasses

    from bench.common.accounted_versions import VERSIONS

    version = VERSIONS[name]
    return dataclasses.replace(version, config={**version.config, **_TINY[name]}, slice_layers=4, slice_overrides={})


@pytest.mark.parametrize("name", ["glm5", "glm53-flash"])
def test_scale_cards_configs_are_transformers_defaults_and_count_parts_as_its_classes_hold_them(name):
    """The accounted rows' configs are the installed transformers' config defaults field for field; the parameters
    by part from the config's numbers equal the sums over transformers' class built on the meta device, tiny and at
    full size (GLM-5 ~744 B, GLM-5.3-Flash ~313 B without the multi-token-prediction layer and vision tower)."""
    import transformers

    from bench.common.accounted_versions import VERSIONS, text_config
    from bench.scale.scale_accounting import GB, active_elements, formula_parts, parts

    version = VERSIONS[name]
    defaults = text_config(version, {})
    assert {k: getattr(defaults, k) for k in version.config if k != "architectures"} == {
        k: v for k, v in version.config.items() if k != "architectures"}
    assert getattr(transformers, version.model_class)  # the class the row builds
    for row in (_tiny_row(name), version):
        counted = parts(row, row.config)
        assert counted == formula_parts(row, row.config) and counted["routed experts"] > 0
    total, active = sum(counted.values()) / GB, active_elements(version, version.config, counted) / GB
    assert (700 < total < 800 and 38 < active < 45) if name == "glm5" else (300 < total < 330 and 15 < active < 20)


@pytest.mark.parametrize("name", ["glm5", "glm53-flash"])
def test_scale_cards_measured_copy_is_the_released_layout_and_its_bytes_are_the_accounted_ones(name, tmp_path):
    """The bench's writer at a tiny shape: the keys and shapes transformers' save_pretrained writes (the release's
    layout), loaded by transformers' class with none missing or unexpected, the dtypes the accounting assumes (float32
    where transformers keeps it), the accounted bf16 bytes; a prefill's cache holds the accounted bytes, tensor by
    tensor; a LoRA step trains the accounted parameters and gives finite gradients."""
    import transformers
    from safetensors import safe_open

    from bench.common.accounted_versions import transformers_config
    from bench.scale import scale_accounting as acc
    from bench.scale.scale_cards import cache_bytes
    from bench.scale.scale_slice import lora_step, prefill, released_tensors, write

    torch.manual_seed(0)
    row = _tiny_row(name)
    model = getattr(transformers, row.model_class)(transformers_config(row, row.config))
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.startswith(row.skipped)}
    assert {key: shape for key, shape, _ in released_tensors(row, row.config)} == saved
    write(row, tmp_path / "copy", 2, row.config)
    loaded, info = getattr(transformers, row.model_class).from_pretrained(
        tmp_path / "copy", dtype=torch.bfloat16, output_loading_info=True)
    assert not info["unexpected_keys"] and not [k for k in info["missing_keys"] if not k.startswith(row.skipped)]
    state = loaded.state_dict()
    assert {k: state[k].dtype == torch.float32 for k, _, _ in acc.tensors(row, row.config)} == {
        k: fp32 for k, _, fp32 in acc.tensors(row, row.config)}
    held = sum(t.numel() * t.element_size() for k, t in state.items() if not k.startswith(row.skipped))
    assert held == sum(acc.weight_bytes(row, row.config, 0).values())
    measured = prefill(loaded.eval(), 256, 40)
    assert measured["finite"] and measured["cache_bytes"] == sum(cache_bytes(row, row.config, 40).values())
    step = lora_step(loaded, row, 256, 24)
    assert step["finite_grads"] and step["trainable_params"] == acc.lora_elements(row, row.config, row.lora_targets, 8)


def test_scale_cards_accounting_follows_the_toolkit_prefix_and_needs_the_fewest_cards():
    """GLM-5's P-tuning size is the toolkit's latent-attention prefix width (each head's key and value) times
    pre_seq_len; a KDA layer adds heads x (Dk + Dv) a position; `cards_needed` is the fewest cards that fit (one
    fewer does not), None where a card's floor (root unit, two gathered layers, activations) does not fit."""
    from bench.common.accounted_versions import VERSIONS, text_config
    from bench.scale.scale_accounting import ptuning_elements
    from bench.scale.scale_cards import USABLE, cards_needed, per_card
    from chatglm_tune.models.glm.prefix import prefix_width

    glm5 = VERSIONS["glm5"]
    assert ptuning_elements(glm5, glm5.config, 16) == {
        "sparse attention": 16 * prefix_width(text_config(glm5, glm5.config)), "linear attention": 0}
    row = _tiny_row("glm53-flash")
    only_kda = {**row.config, "layer_types": ["linear_attention"] * 4}
    assert ptuning_elements(row, only_kda, 16)["linear attention"] == 16 * 4 * 4 * (8 + 8)
    base, root, layer, trainable, act, capacity = 1000e9, 4e9, 20e9, 3e9, 10e9, 80e9
    n = cards_needed(base, root, layer, trainable, act, capacity)
    assert per_card(base, root, layer, trainable, act, n) <= USABLE * capacity
    assert per_card(base, root, layer, trainable, act, n - 1) > USABLE * capacity
    assert cards_needed(base, root, layer, trainable, 60e9, capacity) is None
