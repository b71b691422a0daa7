"""Benchmark: ChatGLM-6B at full size on CPU against the C++ peer, chatglm.cpp (issue 15): decode speed,
prefill time and peak memory side by side, and batched extraction records/s.

    python bench/peer.py --step write                      # the random fp16 checkpoint (official layout)
    python bench/peer.py --step convert-q4_0               # GGML files: convert-f16, convert-q8_0, convert-q4_0
    python bench/peer.py --step cpp-q4_0 --threads 2       # chatglm.cpp: cpp-f16, cpp-q8_0, cpp-q4_0
    python bench/peer.py --step toolkit-int4 --threads 2   # the toolkit: toolkit-bf16, toolkit-int8, toolkit-int4
    python bench/peer.py --step toolkit-int4 --threads 2 --quantize-embedding   # ... with the INT8 embedding/head
    python bench/peer.py --step batch-int4-b8 --threads 2  # batched extraction: batch-{bf16,int8,int4}-b{1,8,32}
    python bench/peer.py --step report                     # peer.json, peer.md, the closing JSON line
    python bench/peer.py --step clean                      # delete the checkpoint and GGML files
    python bench/peer.py --quick --step all                # a 2-layer slice, every step, into /tmp

chatglm.cpp is optional, for this bench only: `CMAKE_ARGS="-DCMAKE_POLICY_VERSION_MINIMUM=3.5" pip install
chatglm-cpp==0.4.2` (built from source, about 4 minutes). Without it the convert-*/cpp-* steps are skipped
(recorded as such) and the report shows the toolkit alone.

What each step measures, each in a fresh process (`measure.run`: the process's own peak RSS):
- `write`: `bench/checkpoint_writer.py` (fp16 shards, config.json, index; keys, shapes and order of the
  official files). One checkpoint feeds both runtimes.
- `convert-*`: a GGML file in chatglm.cpp 0.4.2's ChatGLM-6B format, written here from the state dict
  (`write_ggml`; chatglm.cpp's own converter needs the official remote code, which this checkout does not
  have): header, config, a SentencePiece model (a tiny one trained here: the ids are given, never encoded),
  then every tensor: f16, or ggml's q8_0 / q4_0 blocks (32 weights and an fp16 scale each; q4_0 scaled by
  the block's signed absmax / -8) for the embedding (tied head) and the four block Linears, f32 LayerNorms
  and biases.
- `cpp-*`: `chatglm_cpp.Pipeline(file).model.generate_next_token` (0.4.2's `Pipeline.generate` is broken),
  greedy, after an 8-token warm-up that also faults the mapped weights in: a 64-token prompt then 64 new
  tokens (prefill = the first call; decode ms/token = the other 63 calls), then one extraction record (a
  64-token prompt, 32 new tokens: chatglm.cpp decodes one sequence at a time, so records/s = 1 / its time).
  Threads: 0.4.2's Python API has no thread setting (`cpp_threads`: the online CPUs, up to 4); cpp steps run
  only with `--threads` equal to that number.
- `toolkit-*`: `from_pretrained(dtype=bfloat16, quantization_bit=8/4)` (quantized at load from the fp16
  checkpoint), torch threads = `--threads`, the same warm-up, prompt and 64 new tokens through
  `generation.generate` (KV cache, greedy, no stop on <eop>); the kernel the INT4 layers ran is recorded.
- `batch-*-bN`: what infer.py does per batch (`extraction._decode_batch` -> `generation.generate`): N prompts of
  64 tokens (ending [gMASK] <sop>, no padding), 32 new tokens each; records/s = N / wall time of the call.
`--capability avx2` runs toolkit/batch steps with `ATEN_CPU_CAPABILITY=avx2` (PyTorch's kernels as on a CPU
without AVX-512); results are kept beside the native ones under a `+avx2` suffix, as `+e8` marks
`--quantize-embedding`. chatglm.cpp is built for the machine it runs on (ggml's native build).

Step records accumulate in `peer_steps.json` (bench/results at full size); `report` writes `peer.json` (the
issue's shape: the fastest honest setting of each variant at the reported thread count) and `peer.md` (every
run). Every process stays under ~14 GB (bf16 and cpp f16 are the largest, about 13 GB); run one at a time.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from measure import copy_bandwidth, peak_rss, run_python  # noqa: E402
from scale_children import _bytes_read_per_token  # noqa: E402

GB = 1e9
PROMPT_LEN, NEW_TOKENS, WARMUP_PROMPT, WARMUP_TOKENS = 64, 64, 8, 2
EXTRACT_NEW_TOKENS, BATCHES = 32, (1, 8, 32)
GMASK, BOS = 130001, 130004  # ChatGLM-6B's [gMASK] and <sop> ids (the toolkit's config; chatglm.cpp gets the same ids)
CPP_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids
BITS = {"bf16": 0, "int8": 8, "int4": 4}
QUICK_LAYERS = 2
INSTALL = 'CMAKE_ARGS="-DCMAKE_POLICY_VERSION_MINIMUM=3.5" pip install chatglm-cpp==0.4.2'
STEPS = (["write"] + [f"convert-{t}" for t in CPP_TYPES] + [f"cpp-{t}" for t in CPP_TYPES] + [f"toolkit-{b}" for b in BITS]
         + [f"batch-{b}-b{n}" for b in BITS for n in BATCHES] + ["report"])


def has_chatglm_cpp() -> bool:
    try:
        import chatglm_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def prompt(length: int, seed: int, batch: int = 1) -> list[list[int]]:
    """`batch` random prompts of `length` ids ending [gMASK] <sop>, from ids both tokenizers' models accept."""
    import torch

    ids = torch.randint(5, 130000, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, -2:] = torch.tensor([GMASK, BOS])
    return ids.tolist()


# ---------------------------------------------------------------------------------------------- GGML file


def _tiny_sentencepiece() -> bytes:
    """A serialized SentencePiece model with ChatGLM-6B's special pieces (chatglm.cpp's tokenizer looks them
    up); its ids never reach the model here, which is fed ids directly."""
    import sentencepiece as spm

    words = ["chatglm", "benchmark", "decode", "prefill", "memory", "tokens", "speed", "weights", "quantized", "layer"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40, hard_vocab_limit=False, model_type="unigram",
                                   user_defined_symbols=["[MASK]", "[gMASK]", "<sop>", "<eop>"], pad_id=3, unk_id=0,
                                   bos_id=1, eos_id=2, minloglevel=2)
    return model.getvalue()


def ggml_q8_0(rows):
    """ggml q8_0 blocks of fp32 `rows [n, k]`: per 32 weights, an fp16 scale absmax / 127 then 32 int8."""
    import torch

    blocks = rows.reshape(-1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round().clamp(-128, 127).to(torch.int8)
    return torch.cat((scale.half().view(torch.int8), q), dim=-1)  # (blocks, 2 + 32) bytes


def ggml_q4_0(rows):
    """ggml q4_0 blocks: per 32 weights, an fp16 scale d = (the signed value of largest magnitude) / -8, then 16
    bytes holding u = clamp(round(w / d + 8), 0, 15): weight i in the low nibble of byte i, weight i + 16 in its
    high nibble."""
    import torch

    blocks = rows.reshape(-1, 32)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = extreme / -8
    u = torch.where(d != 0, blocks / d, torch.zeros_like(blocks)).add(8).round().clamp(0, 15).to(torch.uint8)
    packed = (u[:, :16] | (u[:, 16:] << 4)).view(torch.int8)
    return torch.cat((d.half().view(torch.int8), packed), dim=-1)  # (blocks, 2 + 16) bytes


def write_ggml(out: Path, model_dir: Path, dtype: str) -> dict:
    """chatglm.cpp 0.4.2's ChatGLM-6B file from an official-layout checkpoint: tensor by tensor (row chunks for
    the quantized ones), so memory stays about one shard's map plus a chunk."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    weight_map = json.loads((model_dir / "pytorch_model.bin.index.json").read_text())["weight_map"]
    shards: dict[str, dict] = {}

    def tensor(key: str):
        name = weight_map[key]
        if name not in shards:
            shards.clear()  # keys come shard by shard: keep one map open
            shards[name] = torch.load(model_dir / name, mmap=True, weights_only=True)
        return shards[name][key]

    gtype = CPP_TYPES[dtype]
    layers = config["num_layers"]
    keys = [("transformer.word_embeddings.weight", gtype)]
    for i in range(layers):
        p = f"transformer.layers.{i}."
        keys += [(p + "input_layernorm.weight", 0), (p + "input_layernorm.bias", 0),
                 (p + "attention.query_key_value.weight", gtype), (p + "attention.query_key_value.bias", 0),
                 (p + "attention.dense.weight", gtype), (p + "attention.dense.bias", 0),
                 (p + "post_attention_layernorm.weight", 0), (p + "post_attention_layernorm.bias", 0),
                 (p + "mlp.dense_h_to_4h.weight", gtype), (p + "mlp.dense_h_to_4h.bias", 0),
                 (p + "mlp.dense_4h_to_h.weight", gtype), (p + "mlp.dense_4h_to_h.bias", 0)]
    keys += [("transformer.final_layernorm.weight", 0), ("transformer.final_layernorm.bias", 0)]
    head = tensor("lm_head.weight")
    assert torch.equal(head[:64], tensor("transformer.word_embeddings.weight")[:64]), "the head must be tied"
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(b"ggml")
        f.write(struct.pack("i", 1))  # model type: ChatGLM-6B
        f.write(struct.pack("iiiiiiiififiii", 2, gtype, config["vocab_size"], config["hidden_size"],
                            config["num_attention_heads"], config["num_attention_heads"], layers,
                            config["inner_hidden_size"], config["layernorm_epsilon"], 0, 10000.0,
                            config["max_sequence_length"], config["eos_token_id"], config["pad_token_id"]))
        proto = _tiny_sentencepiece()
        f.write(struct.pack("i", len(proto)))
        f.write(proto)
        for key, kind in keys:
            t = tensor(key)
            f.write(struct.pack("i", len(key)) + key.encode())
            f.write(struct.pack("i" * (2 + t.ndim), t.ndim, *t.shape, kind))
            f.seek((f.tell() + 15) // 16 * 16)  # data 16-byte aligned
            if kind == 0:
                f.write(t.float().numpy().tobytes())
            elif kind == 1:
                f.write(t.half().numpy().tobytes())
            else:
                quantize = ggml_q8_0 if kind == 8 else ggml_q4_0
                step = max(1, (1 << 22) // t.shape[1])  # 4M weights (16 MB of fp32) at a time
                for start in range(0, t.shape[0], step):
                    f.write(quantize(t[start : start + step].float()).numpy().tobytes())
    os.replace(tmp, out)
    return {"bytes": out.stat().st_size, "tensors": len(keys)}


# ---------------------------------------------------------------------------------------------- children


def child_convert(args) -> dict:
    start = time.perf_counter()
    info = write_ggml(Path(args.ggml), Path(args.model_dir), args.dtype)
    return {**info, "seconds": time.perf_counter() - start}


def cpp_threads() -> int:
    """The threads chatglm.cpp 0.4.2 computes with: its Python API has no setting; it takes the online CPUs
    (all of them up to 4, half beyond, at most 16), whatever the process's affinity. Pinning the process to
    fewer cores then runs that many spinning threads on them (measured here: a q4_0 run pinned to one core had not
    finished its 64 tokens after 9 minutes)."""
    n = os.cpu_count() or 4
    return min(n if n <= 4 else n // 2, 16)


def child_cpp(args) -> dict:
    import chatglm_cpp
    from chatglm_cpp import _C

    start = time.perf_counter()
    pipe = chatglm_cpp.Pipeline(str(args.ggml), max_length=PROMPT_LEN + NEW_TOKENS + 8)
    model = pipe.model
    load_s = time.perf_counter() - start
    config = _C.GenerationConfig(max_length=PROMPT_LEN + NEW_TOKENS + 8, max_new_tokens=NEW_TOKENS,
                                 max_context_length=PROMPT_LEN + 8, do_sample=False)

    def run(ids: list[int], new: int) -> tuple[list[float], list[int]]:
        """Greedy `new` tokens after `ids`: (the time of each call, the tokens), as 0.4.2's own loop feeds it."""
        ids, n_ctx, n_past, stamps, out = list(ids), len(ids), 0, [time.perf_counter()], []
        for _ in range(new):
            token = model.generate_next_token(ids, None, config, n_past, n_ctx)
            stamps.append(time.perf_counter())
            n_past = len(ids)
            ids.append(token)
            out.append(token)
        return stamps, out

    run(prompt(WARMUP_PROMPT, 1)[0], WARMUP_TOKENS)
    stamps, out = run(prompt(PROMPT_LEN, 0)[0], NEW_TOKENS)
    threads = len(os.listdir("/proc/self/task"))
    record, _ = run(prompt(PROMPT_LEN, 2)[0], EXTRACT_NEW_TOKENS)
    return {"load_s": load_s, "prefill_ms": (stamps[1] - stamps[0]) * 1e3,
            "decode_ms": (stamps[-1] - stamps[1]) / (NEW_TOKENS - 1) * 1e3, "record_s": record[-1] - record[0],
            "records_per_s": 1 / (record[-1] - record[0]), "distinct_tokens": len(set(out)), "os_threads": threads,
            "threads": cpp_threads()}


def _load_toolkit(args):
    import torch

    from chatglm_tune import ChatGLMForConditionalGeneration

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = ChatGLMForConditionalGeneration.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, quantization_bit=BITS[args.variant] or None, quantize_embedding=args.quantize_embedding)
    return model, time.perf_counter() - start


def _kernels(model) -> list[str]:
    from chatglm_tune.quantization import QuantizedLinear

    return sorted({m.last_kernel for m in model.modules() if isinstance(m, QuantizedLinear) and m.last_kernel})


def child_toolkit(args) -> dict:
    import torch

    from chatglm_tune.generation import generate

    torch.set_num_threads(args.threads)
    copy_gb_s = copy_bandwidth() / GB  # before the load: its two 256 MiB buffers stay out of the model's peak RSS
    model, load_s = _load_toolkit(args)
    rss_load = peak_rss()
    generate(model, torch.tensor(prompt(WARMUP_PROMPT, 1)), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    calls: list[float] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
    start = time.perf_counter()
    out = generate(model, torch.tensor(prompt(PROMPT_LEN, 0)), max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]
    end = time.perf_counter()
    hook.remove()
    assert len(out) == NEW_TOKENS == len(calls), (len(out), len(calls))
    return {"load_s": load_s, "prefill_ms": (calls[1] - start) * 1e3, "decode_ms": (end - calls[1]) / (NEW_TOKENS - 1) * 1e3,
            "rss_load_gb": rss_load / GB, "kernels": _kernels(model), "distinct_tokens": len(set(out)),
            "weight_bytes_per_token": _bytes_read_per_token(model),
            "capability": torch.backends.cpu.get_cpu_capability(), "copy_gb_s": copy_gb_s}


def child_batch(args) -> dict:
    import torch

    from chatglm_tune.generation import generate

    model, load_s = _load_toolkit(args)
    generate(model, torch.tensor(prompt(WARMUP_PROMPT, 1)), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    ids = torch.tensor(prompt(PROMPT_LEN, 3, args.batch))
    start = time.perf_counter()
    out = generate(model, ids, max_new_tokens=EXTRACT_NEW_TOKENS, eos_token_id=None)
    seconds = time.perf_counter() - start
    assert all(len(row) == EXTRACT_NEW_TOKENS for row in out)
    return {"load_s": load_s, "batch": args.batch, "seconds": seconds, "records_per_s": args.batch / seconds,
            "kernels": _kernels(model), "capability": torch.backends.cpu.get_cpu_capability()}


# ---------------------------------------------------------------------------------------------- steps


class Bench:
    def __init__(self, args):
        self.args = args
        self.model_dir = args.model_dir or Path("/tmp/chatglm6b-peer" + ("-2l" if args.quick else ""))
        self.out = args.out or (Path("/tmp/chatglm6b-peer-quick") if args.quick else HERE / "results")
        self.out.mkdir(parents=True, exist_ok=True)
        self.steps_file = self.out / "peer_steps.json"

    def ggml(self, dtype: str) -> Path:
        return self.model_dir.with_name(self.model_dir.name + f"-{dtype}.ggml")

    def load(self) -> dict:
        return json.loads(self.steps_file.read_text()) if self.steps_file.exists() else {}

    def save(self, key: str, record: dict) -> None:
        import torch

        record.update(when=time.strftime("%Y-%m-%d %H:%M:%S"), load_average=[round(v, 2) for v in os.getloadavg()],
                      torch=torch.__version__)
        results = self.load()
        results[key] = record
        tmp = self.steps_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, self.steps_file)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()}
        print(f"[{key}] {json.dumps(shown)}", flush=True)

    def key(self, step: str) -> str:
        a = self.args
        suffix = ("+e8" if a.quantize_embedding and not step.startswith(("cpp", "convert")) else "")
        suffix += f"+{a.capability}" if a.capability and not step.startswith(("cpp", "convert")) else ""
        return f"{step}@{a.threads}t{suffix}" if step.split("-")[0] in ("cpp", "toolkit", "batch") else step

    def child(self, kind: str, *extra, env: dict | None = None):
        return run_python(__file__, "--child", kind, "--threads", self.args.threads, *extra, env=env)

    def run(self, step: str) -> None:
        a = self.args
        env = {"ATEN_CPU_CAPABILITY": a.capability} if a.capability else None
        e8 = ["--quantize-embedding"] if a.quantize_embedding else []
        if step == "write":
            done = run_python(HERE / "checkpoint_writer.py", self.model_dir, *(["--num-layers", QUICK_LAYERS, "--shards", 3] if a.quick else []))
            self.save(step, {**done.last_json(), "seconds": done.seconds, "peak_rss_gb": done.peak_rss / GB, "dir": str(self.model_dir)})
        elif step.startswith(("convert-", "cpp-")) and not has_chatglm_cpp():
            print(f"[{step}] skipped: chatglm_cpp is not installed (optional, this bench only: {INSTALL})", flush=True)
        elif step.startswith("convert-"):
            dtype = step.split("-", 1)[1]
            done = self.child("convert", "--dtype", dtype, "--model-dir", self.model_dir, "--ggml", self.ggml(dtype))
            self.save(step, {**done.last_json(), "peak_rss_gb": done.peak_rss / GB, "file": str(self.ggml(dtype))})
        elif step.startswith("cpp-") and a.threads != cpp_threads():
            print(f"[{step}] skipped: chatglm.cpp 0.4.2 computes with {cpp_threads()} threads here and its Python API "
                  f"cannot change that; run it with --threads {cpp_threads()}", flush=True)
        elif step.startswith("cpp-"):
            dtype = step.split("-", 1)[1]
            done = self.child("cpp", "--ggml", self.ggml(dtype))
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB, "process_s": done.seconds,
                                       "file_gb": self.ggml(dtype).stat().st_size / GB})
        elif step.startswith("toolkit-"):
            done = self.child("toolkit", "--variant", step.split("-", 1)[1], "--model-dir", self.model_dir, *e8, env=env)
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB, "process_s": done.seconds})
        elif step.startswith("batch-"):
            _, variant, b = step.split("-")
            done = self.child("batch", "--variant", variant, "--batch", b[1:], "--model-dir", self.model_dir, *e8, env=env)
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB, "process_s": done.seconds})
        elif step == "report":
            report(self.load(), self.out, a.threads, quick=a.quick)
        elif step == "clean":
            shutil.rmtree(self.model_dir, ignore_errors=True)
            for dtype in CPP_TYPES:
                self.ggml(dtype).unlink(missing_ok=True)
            print(f"removed {self.model_dir} and its GGML files", flush=True)
        else:
            raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}, clean")

# ---------------------------------------------------------------------------------------------- report

PAIRS = [("bf16", "f16"), ("int8", "q8_0"), ("int4", "q4_0")]  # the toolkit's variant against chatglm.cpp's nearest


def _best(steps: dict, base: str, threads: int, field: str, higher: bool = True) -> tuple[str | None, dict | None]:
    """(key, record) of the best native run of `base` at `threads` (as is or +e8) by `field`."""
    runs = [(k, r) for k, r in steps.items() if k in (f"{base}@{threads}t", f"{base}@{threads}t+e8") and field in r]
    if not runs:
        return None, None
    return max(runs, key=lambda kr: kr[1][field] if higher else -kr[1][field])


def summarize(steps: dict, threads: int) -> dict:
    """The issue's shape: per variant the fastest honest setting (native capability, as is or +e8) at `threads`."""
    decode, rss, records, chosen = {}, {}, {}, {}
    for variant, cpp in PAIRS:
        for name, base in ((variant, f"toolkit-{variant}"), (f"cpp_{cpp}", f"cpp-{cpp}")):
            key, r = _best(steps, base, threads, "decode_ms", higher=False)
            decode[name] = None if r is None else round(1e3 / r["decode_ms"], 3)
            rss[name] = None if r is None else round(r["peak_rss_gb"], 2)
            chosen[name] = key
    for name, base in (("bf16_b1", "batch-bf16-b1"), ("int8_b1", "batch-int8-b1"), ("int4_b1", "batch-int4-b1"),
                       ("int8_b8", "batch-int8-b8"), ("int4_b8", "batch-int4-b8"), ("int8_b32", "batch-int8-b32"),
                       ("int4_b32", "batch-int4-b32"), ("cpp_q8_0", "cpp-q8_0"), ("cpp_q4_0", "cpp-q4_0")):
        key, r = _best(steps, base, threads, "records_per_s")
        records[name] = None if r is None else round(r["records_per_s"], 4)
        chosen[f"records_{name}"] = key
    return {"peer": {"threads": threads, "decode_tok_s": decode, "peak_rss_gb": rss, "records_per_s": records}, "chosen": chosen}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def report(steps: dict, out: Path, threads: int, quick: bool = False) -> None:
    summary = summarize(steps, threads)
    peer = summary["peer"]
    lines = [f"# ChatGLM-6B on CPU: the toolkit against chatglm.cpp 0.4.2 (issue 15){' (--quick: 2 layers)' if quick else ''}", "",
             "Generated by `python bench/peer.py --step ...` (its docstring says what each step measures). One random fp16 "
             "checkpoint in the official layout feeds both runtimes; batch-1 greedy decoding, a 64-token prompt, 64 new tokens; "
             "peak RSS = the measuring process's own `ru_maxrss` (bench/measure.py), GB = 1e9 bytes. `+e8`: the tied "
             "embedding / head held as one INT8 copy (`quantize_embedding`); `+avx2`: PyTorch's kernels run with "
             "`ATEN_CPU_CAPABILITY=avx2` (as on a CPU without AVX-512; chatglm.cpp is built for this machine's ISA either way).", "",
             "## Every run", "",
             "GB read/token: the weight bytes one decode step reads (the toolkit: every parameter once; chatglm.cpp: its "
             "file, all weights). Bound: copy bandwidth measured by the toolkit's process at the same thread count "
             "(`measure.copy_bandwidth`, read + written bytes/s) / GB read per token; a GEMV only reads, so it can exceed it.", "",
             "| run | decode ms/token | tok/s | prefill ms (64 tokens) | peak RSS GB | kernels | GB read/token | bound tok/s | of bound | records/s (64+32) | load s | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    copy = {}  # threads -> a copy bandwidth measured by a toolkit process
    for key, r in steps.items():
        if "copy_gb_s" in r:
            copy.setdefault(key.split("@")[1].split("t")[0], r["copy_gb_s"])
    for key, r in steps.items():
        if key.startswith(("toolkit-", "cpp-")):
            cpp = key.startswith("cpp-")
            per_token = r.get("file_gb") if cpp else r.get("weight_bytes_per_token", 0) / GB or None
            bw = copy.get(key.split("@")[1].split("t")[0]) if cpp else r.get("copy_gb_s")
            bound = bw / per_token if bw and per_token else None
            tok_s = 1e3 / r["decode_ms"]
            lines.append(f"| {key} | {r['decode_ms']:.0f} | {tok_s:.2f} | {r['prefill_ms']:.0f} | {r['peak_rss_gb']:.2f} | "
                         f"{'ggml' if cpp else ','.join(r.get('kernels', [])) or 'bf16'} | "
                         f"{per_token or 0:.2f} | {bound or 0:.2f} | {f'{tok_s / bound:.0%}' if bound else '-'} | "
                         f"{r['records_per_s']:.3f} | {r['load_s']:.0f} | {r['load_average'][0]} |".replace("| 0.00 |", "| - |")
                         if "records_per_s" in r else
                         f"| {key} | {r['decode_ms']:.0f} | {tok_s:.2f} | {r['prefill_ms']:.0f} | {r['peak_rss_gb']:.2f} | "
                         f"{'ggml' if cpp else ','.join(r.get('kernels', [])) or 'bf16'} | {per_token or 0:.2f} | {bound or 0:.2f} | "
                         f"{f'{tok_s / bound:.0%}' if bound else '-'} | - | {r['load_s']:.0f} | {r['load_average'][0]} |".replace("| 0.00 |", "| - |"))
    batch = [(k, r) for k, r in steps.items() if k.startswith("batch-")]
    if batch:
        lines += ["", "## Batched extraction (the toolkit; prompts of 64 tokens, 32 new tokens each)", "",
                  "| run | batch | seconds | records/s | peak RSS GB | INT kernels |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {r['batch']} | {r['seconds']:.1f} | {r['records_per_s']:.3f} | {r['peak_rss_gb']:.2f} | {','.join(r['kernels']) or '-'} |"
                  for k, r in batch]
    d, m, rec = peer["decode_tok_s"], peer["peak_rss_gb"], peer["records_per_s"]
    lines += ["", f"## Side by side at {threads} threads (the fastest honest setting of each; `peer.json`)", "",
              "| toolkit | tok/s | peak RSS GB | chatglm.cpp | tok/s | peak RSS GB | decode speed ratio | RSS ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for variant, cpp in PAIRS:
        c = f"cpp_{cpp}"
        lines.append(f"| {variant} ({summary['chosen'][variant] or 'not run'}) | {d[variant] or '-'} | {m[variant] or '-'} | {cpp} | "
                     f"{d[c] or '-'} | {m[c] or '-'} | {_ratio(d[variant], d[c])} | {_ratio(m[variant], m[c])} |")
    lines += ["", "| records/s | " + " | ".join(rec) + " |", "|---" * (len(rec) + 1) + "|",
              "| value | " + " | ".join("-" if v is None else f"{v:.3f}" for v in rec.values()) + " |"]
    checks = [("INT8 decode >= chatglm.cpp q8_0 (1.0x; 1.5x aimed)", d["int8"], d["cpp_q8_0"], 1.0),
              ("INT4 decode >= chatglm.cpp q4_0 (1.0x; 1.5x aimed)", d["int4"], d["cpp_q4_0"], 1.0),
              ("INT4 decode >= INT8 decode", d["int4"], d["int8"], 1.0),
              ("INT4 peak RSS <= chatglm.cpp q4_0 + 10%", m["cpp_q4_0"], m["int4"], 1 / 1.1),
              ("INT8 batch 32 records/s >= 1.5x chatglm.cpp q8_0 sequential", rec["int8_b32"], rec["cpp_q8_0"], 1.5),
              ("INT4 batch 32 records/s >= 1.5x chatglm.cpp q4_0 sequential", rec["int4_b32"], rec["cpp_q4_0"], 1.5)]
    lines += ["", "## Acceptance (issue 15)", ""]
    for text, a, b, need in checks:
        verdict = "not measured" if not (a and b) else f"{a / b:.2f} (needs >= {need:.2f}): {'met' if a / b >= need else 'MISSED'}"
        lines.append(f"- {text}: {verdict}")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "peer.md").write_text(text)
    (out / "peer.json").write_text(json.dumps({"peer": peer}, indent=1) + "\n")
    print(json.dumps({"bench": "peer", "quick": quick, **peer, "chosen": summary["chosen"]}))



def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", choices=STEPS + ["all", "clean"], help="one step per command at full size; `all` runs every step")
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_LAYERS}-layer slice, results in /tmp/chatglm6b-peer-quick")
    p.add_argument("--threads", type=int, default=2, help="threads of the measured process (default %(default)s)")
    p.add_argument("--quantize-embedding", action="store_true", help="toolkit/batch steps: the tied embedding / head as one INT8 copy (+e8)")
    p.add_argument("--capability", choices=["avx2"], help="toolkit/batch steps: ATEN_CPU_CAPABILITY for PyTorch's kernels (+avx2)")
    p.add_argument("--model-dir", type=Path, help="the random checkpoint (default /tmp/chatglm6b-peer[-2l]); GGML files go beside it")
    p.add_argument("--out", type=Path, help="results folder (default bench/results; --quick: /tmp/chatglm6b-peer-quick)")
    p.add_argument("--child", choices=["convert", "cpp", "toolkit", "batch"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ggml", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(BITS), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"convert": child_convert, "cpp": child_cpp, "toolkit": child_toolkit, "batch": child_batch}[args.child](args)))
        return
    if args.step is None:
        p.error("pass --step (one of: " + ", ".join(STEPS) + ", clean), or --step all")
    bench = Bench(args)
    for step in (STEPS if args.step == "all" else [args.step]):
        bench.run(step)


if __name__ == "__main__":
    main()
