"""Benchmark: ChatGLM-6B at full size on this machine (issue 6): peak memory and speed of inference and
of one training step, bf16 / INT8 / INT4, beside the seed's GPU figures (Table 18-1).

    python bench/scale.py --quick               # 2-layer slice of the real config, every step in one go
    python bench/scale.py --step write          # full size (28 layers), one step per command:
    python bench/scale.py --step quantize-int8  #   write, quantize-int8, quantize-int4, infer-bf16,
    ...                                         #   infer-int8-load, infer-int8-file, infer-int4-load,
    python bench/scale.py --step report         #   infer-int4-file, train-{ptuning,lora}-{bf16,int8,int4}, report

Steps:
- `write`: a random-weight ChatGLM-6B checkpoint (config `ChatGLMConfig.from_name("chatglm-6b")`) in the
  official layout: fp16 `pytorch_model-0000N-of-0000M.bin` shards (M = 8 at full size) +
  `pytorch_model.bin.index.json` + config.json, `lm_head.weight` stored too (equal to the embedding) and
  the `rotary_emb.inv_freq` buffers. Generated shard by shard (std 0.02, seeded per key): at most one
  shard in memory, never two copies of the weights.
- `quantize-int8`, `quantize-int4`: `quantize.py --bits B` of that checkpoint (official per-row layout);
  its time and peak RSS are recorded.
- `infer-*`: in a fresh process, load with `dtype=bfloat16` (bf16; INT8/INT4 quantized at load
  (`-load`) or read from the quantize.py output (`-file`)), then batch-1 greedy decoding of 32 new tokens
  after a 64-token prompt (`generation.generate`, no stop on <eop>, after a 2-token warm-up that also
  builds the INT4 kernel layout). Decode tokens/s = 31 / (end - start of the first incremental step);
  bound tokens/s = copy bandwidth / weight bytes read per token, the copy bandwidth ((read + written)
  bytes/s of a 256 MiB tensor copy, same thread count) measured by this step just before the load.
- `train-{ptuning,lora}-{bf16,int8,int4}`: in a fresh process, one training step (forward with labels,
  backward, AdamW step) on batch 1 x 256 tokens (128 prompt tokens ending [gMASK] <sop>, 128 labelled
  answer tokens), gradient checkpointing on (`activation_checkpointing_enable` +
  `enable_input_require_grads`), bf16 compute; P-tuning v2: pre_seq_len 128, no projection, lr 2e-2;
  LoRA: r 8 on query_key_value (`LoraOptions`), lr 2e-4. INT8/INT4 bases are quantized at load (what
  `train.py --quantization-bit` does), and glibc's large blocks are mmap'd as train.py has them
  (`heap.mmap_large_blocks`). A step that would not finish inside `--budget-s` (the 10-minute command
  limit) is stopped at the budget: the forward pass and the backward of the layers done are measured,
  the rest of the backward is extrapolated per layer, and the result says `partial`.
- `report`: the table (also `scale.md`, beside the seed's GPU figures), a bar chart (`scale.png`), and
  the closing JSON line.

Peak RSS is the whole measuring process's `ru_maxrss` (from `os.wait4`), the Python + torch baseline
included; GB = 1e9 bytes. Every step appends its numbers to the results JSON (`bench/results/scale.json`
at full size; with `--quick` everything goes to `--out`, default /tmp/chatglm6b-scale-quick).

Variants (kept beside the as-is numbers, under the step name + a suffix, and shown in their own rows):
`--quantize-embedding` loads with the tied embedding / head as one INT8 copy (`+e8`), `--max-kernel-rows N`
sets `QuantizedLinear.max_kernel_rows`, `--malloc-mmap-threshold B` runs the measuring process with
glibc's `MALLOC_MMAP_THRESHOLD_=B`. The closing JSON's top level is the toolkit's defaults;
`with_options` repeats it from the variants with the most options.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chatglm_tune import ChatGLMConfig  # noqa: E402

GB = 1e9
QUICK_LAYERS = 2
FULL_SHARDS, QUICK_SHARDS = 8, 3
PROMPT_LEN, NEW_TOKENS, WARMUP_PROMPT, WARMUP_TOKENS = 64, 32, 8, 2
TRAIN_LEN, TRAIN_PROMPT, PRE_SEQ_LEN, LORA_R = 256, 128, 128, 8
LR = {"ptuning": 2e-2, "lora": 2e-4}
BITS = {"bf16": 0, "int8": 8, "int4": 4}
# name -> (bits, where the weights come from: "source" = the fp16 checkpoint, quantized at load if bits)
INFER = {"bf16": (0, "source"), "int8-load": (8, "source"), "int8-file": (8, "int8"),
         "int4-load": (4, "source"), "int4-file": (4, "int4")}
TRAIN = [f"{tuning}-{base}" for tuning in ("ptuning", "lora") for base in BITS]
STEPS = ["write", "quantize-int8", "quantize-int4", *(f"infer-{k}" for k in INFER), *(f"train-{k}" for k in TRAIN), "report"]
# The seed's Table 18-1 (GPU memory of the official code) and issue 6's targets (peak RSS, this machine).
SEED_GPU_GB = {"inference": {"bf16": 13, "int8": 8, "int4": 6}, "ptuning": {"bf16": 16, "int8": 9, "int4": 7}}
TARGET_GB = {"inference": {"bf16": 12.8, "int8": 7.2, "int4": 4.5}, "ptuning": {"bf16": 14, "int8": 8, "int4": 6}}
TARGET_OF_BOUND = 0.6  # bf16 and INT8 decode
TARGET_INT4_X_BF16 = 2.0


# ---------------------------------------------------------------------------------------------- helpers


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _status() -> dict:
    """VmHWM (this process's own peak RSS), VmRSS, RssAnon, RssFile in MB, from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(line.split()[1]) * 1024 / 1e6)
    return out


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """(read + written) bytes per second of the best of `repeats` copies of a `mib` MiB fp32 tensor."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def run_process(cmd: list[str], env: dict | None = None) -> tuple[str, float, int]:
    """(stdout, seconds, peak RSS bytes of that process): os.wait4 reports the child's own ru_maxrss."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, cwd=ROOT, env=None if env is None else {**os.environ, **env})
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    if code:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{text[-4000:]}")
    return text, seconds, usage.ru_maxrss * 1024


def bench_config(quick: bool) -> ChatGLMConfig:
    return ChatGLMConfig.from_name("chatglm-6b", **({"num_layers": QUICK_LAYERS} if quick else {}))


# ---------------------------------------------------------------------------------------------- step: write


def official_tensors(config: ChatGLMConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init) of the official checkpoint, in its key order (spec section 2)."""
    h, inner, v = config.hidden_size, config.inner_hidden_size, config.vocab_size
    rot = config.head_dim // 2
    out = [("transformer.word_embeddings.weight", (v, h), "normal")]
    for i in range(config.num_layers):
        p = f"transformer.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), "ones"), (p + "input_layernorm.bias", (h,), "zeros"),
            (p + "attention.query_key_value.weight", (3 * h, h), "normal"), (p + "attention.query_key_value.bias", (3 * h,), "normal"),
            (p + "attention.dense.weight", (h, h), "normal"), (p + "attention.dense.bias", (h,), "normal"),
            (p + "attention.rotary_emb.inv_freq", (rot // 2,), "inv_freq"),
            (p + "post_attention_layernorm.weight", (h,), "ones"), (p + "post_attention_layernorm.bias", (h,), "zeros"),
            (p + "mlp.dense_h_to_4h.weight", (inner, h), "normal"), (p + "mlp.dense_h_to_4h.bias", (inner,), "normal"),
            (p + "mlp.dense_4h_to_h.weight", (h, inner), "normal"), (p + "mlp.dense_4h_to_h.bias", (h,), "normal"),
        ]
    out += [("transformer.final_layernorm.weight", (h,), "ones"), ("transformer.final_layernorm.bias", (h,), "zeros"),
            ("lm_head.weight", (v, h), "normal")]
    return out


def make_tensor(key: str, shape, init: str, std: float = 0.02) -> torch.Tensor:
    """fp16 tensor for `key`, generated directly in fp16; the head repeats the embedding (tied)."""
    if init == "ones":
        return torch.ones(shape, dtype=torch.float16)
    if init == "zeros":
        return torch.zeros(shape, dtype=torch.float16)
    if init == "inv_freq":
        rot = 2 * shape[0]
        return (1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))).half()
    seed_key = "transformer.word_embeddings.weight" if key == "lm_head.weight" else key
    g = torch.Generator().manual_seed(zlib.crc32(seed_key.encode()))
    return torch.empty(shape, dtype=torch.float16).normal_(0.0, std, generator=g)


def shard_plan(tensors, n_shards: int) -> list[list[int]]:
    """Contiguous groups of tensor indices: n_shards - 1 groups of about equal bytes, then the rest with
    `lm_head.weight` (last, as in the official shard 8). Every group non-empty."""
    sizes = [2 * torch.Size(shape).numel() for _, shape, _ in tensors]
    body = list(range(len(tensors) - 1))  # all but lm_head
    groups, i = [], 0
    for shard in range(n_shards - 1):
        left = n_shards - 1 - shard  # groups still to fill, this one included
        target = sum(sizes[j] for j in body[i:]) / left
        group, size = [], 0
        while i < len(body) and len(body) - i > left - 1:  # leave one key for each later group
            if group and size + sizes[body[i]] > target:
                break
            group.append(body[i])
            size += sizes[body[i]]
            i += 1
        groups.append(group)
    groups.append(body[i:] + [len(tensors) - 1])
    assert all(groups) and sum(map(len, groups)) == len(tensors)
    return groups


def write_checkpoint(directory: Path, config: ChatGLMConfig, n_shards: int) -> dict:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tensors = official_tensors(config)
    plan = shard_plan(tensors, n_shards)
    weight_map, total = {}, 0
    for s, group in enumerate(plan, 1):
        name = f"pytorch_model-{s:05d}-of-{len(plan):05d}.bin"
        shard = {tensors[j][0]: make_tensor(*tensors[j]) for j in group}
        torch.save(shard, directory / name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    cfg = config.to_dict()
    cfg.update(architectures=["ChatGLMModel"], torch_dtype="float16")
    cfg.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"keys": len(tensors), "shards": len(plan), "bytes": total}


# ---------------------------------------------------------------------------------------------- children


def _prompt(config, length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(5, 130000, (1, length), generator=torch.Generator().manual_seed(seed))
    ids[0, -2:] = torch.tensor([config.gmask_token_id, config.bos_token_id])
    return ids


def _bytes_read_per_token(model) -> int:
    """Weight bytes one decode step reads: every unique parameter once (the tied head too), with an
    INT4 layer counted as the kernel layout it runs from when it has one."""
    from chatglm_tune.quantization import QuantizedLinear

    seen, total = set(), 0
    for module in model.modules():
        cache = getattr(module, "_int4_cache", None) if isinstance(module, QuantizedLinear) else None
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if cache is not None and name in ("weight", "weight_scale"):
                continue
            total += p.numel() * p.element_size()
        if cache is not None:
            total += sum(t.numel() * t.element_size() for t in cache[1:] if torch.is_tensor(t))
    return total


def child_infer(args) -> dict:
    from chatglm_tune import ChatGLMForConditionalGeneration
    from chatglm_tune.generation import generate

    torch.set_num_threads(args.threads)
    rss_start = _maxrss()
    start = time.perf_counter()
    model = ChatGLMForConditionalGeneration.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, quantization_bit=args.bits or None, quantize_embedding=args.quantize_embedding)
    load_s, rss_load, status_load = time.perf_counter() - start, _maxrss(), _status()
    config = model.config
    start = time.perf_counter()
    generate(model, _prompt(config, WARMUP_PROMPT, 1), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    warmup_s, rss_warmup = time.perf_counter() - start, _maxrss()
    calls: list[float] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
    start = time.perf_counter()
    out = generate(model, _prompt(config, PROMPT_LEN, 0), max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]
    end = time.perf_counter()
    hook.remove()
    assert len(out) == NEW_TOKENS and len(calls) == NEW_TOKENS, (len(out), len(calls))
    return {
        "load_s": round(load_s, 1), "warmup_s": round(warmup_s, 1), "prefill_s": round(calls[1] - start, 2),
        "decode_tok_s": (NEW_TOKENS - 1) / (end - calls[1]), "weight_bytes_per_token": _bytes_read_per_token(model),
        "rss_start_gb": rss_start / GB, "rss_load_gb": rss_load / GB, "rss_warmup_gb": rss_warmup / GB,
        "rss_end_gb": _maxrss() / GB, "status_load_mb": status_load, "status_end_mb": _status(),
        "distinct_tokens": len(set(out)), "quantize_embedding": args.quantize_embedding,
    }


def child_train(args) -> dict:
    import threading

    from chatglm_tune import ChatGLMForConditionalGeneration, heap
    from chatglm_tune.lora import LoraOptions, apply_lora

    deadline = time.perf_counter() + args.budget_s
    torch.set_num_threads(args.threads)
    tuning, base = args.child_train.split("-")
    bits = BITS[base]
    result = {"tuning": tuning, "base": base, "quantize_embedding": args.quantize_embedding, "rss_start_gb": _maxrss() / GB}
    marks: dict[str, list[float]] = {"forward": [], "backward": []}
    phase = {"name": "load", "t0": None, "t_fwd": None}
    lock = threading.Lock()

    def watchdog():  # the step cannot finish inside the budget: report what was measured, then exit
        time.sleep(max(0.0, deadline - time.perf_counter()))
        with lock:
            now = time.perf_counter()
            result.update(partial=True, stopped_in=phase["name"], rss_at_stop_gb=_maxrss() / GB, status_end_mb=_status(),
                          rss_end_gb=_maxrss() / GB)
            if phase["t0"] is not None:
                result["stopped_after_s"] = round(now - phase["t0"], 1)
            fwd, bwd = marks["forward"], marks["backward"]
            if phase["name"] == "forward" and len(fwd) > 1:
                result.update(forward_layers_done=len(fwd) - 1, forward_per_layer_s=round((fwd[-1] - fwd[0]) / (len(fwd) - 1), 2))
            if phase["name"] == "backward":
                done = max(0, len(bwd) - 1)  # layers whose recompute + backward finished
                result["backward_layers_done"] = done
                if done:
                    per_layer = (bwd[-1] - bwd[0]) / done
                    head_s = bwd[0] - phase["t_fwd"]
                    result.update(backward_per_layer_s=round(per_layer, 1), head_backward_s=round(head_s, 1),
                                  step_s=round(result["forward_s"] + head_s + per_layer * n_layers, 1))
            print(json.dumps(result), flush=True)
            os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    start = time.perf_counter()
    extra = {"pre_seq_len": PRE_SEQ_LEN, "prefix_projection": False} if tuning == "ptuning" else {}
    model = ChatGLMForConditionalGeneration.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, quantization_bit=bits or None, quantize_embedding=args.quantize_embedding, **extra)
    model.activation_checkpointing_enable()
    model.enable_input_require_grads()
    heap.mmap_large_blocks(model)  # as train.py does
    core = model
    if tuning == "lora":
        model = apply_lora(model, LoraOptions(r=LORA_R))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR[tuning])
    config = core.config
    ids = torch.randint(5, 130000, (1, TRAIN_LEN), generator=torch.Generator().manual_seed(2))
    ids[0, TRAIN_PROMPT - 2 : TRAIN_PROMPT] = torch.tensor([config.gmask_token_id, config.bos_token_id])
    ids[0, -1] = config.eos_token_id
    labels = ids.clone()
    labels[0, :TRAIN_PROMPT] = -100
    n_layers = len(core.transformer.layers)
    # Hooks on a child of each block: they fire in the forward and again in the checkpoint recompute.
    handles = [layer.input_layernorm.register_forward_pre_hook(lambda *_: marks[phase["name"]].append(time.perf_counter()))
               for layer in core.transformer.layers]
    with lock:
        result.update(load_s=round(time.perf_counter() - start, 1), trainable_params=sum(p.numel() for p in params),
                      rss_load_gb=_maxrss() / GB, status_load_mb=_status())
        phase.update(name="forward", t0=time.perf_counter())
    t0 = phase["t0"]
    loss = model(input_ids=ids, labels=labels).loss
    with lock:
        t_fwd = time.perf_counter()
        result.update(loss=round(loss.item(), 4), forward_s=round(t_fwd - t0, 1), rss_forward_gb=_maxrss() / GB)
        phase.update(name="backward", t_fwd=t_fwd)
    loss.backward()
    with lock:
        t_bwd = time.perf_counter()
        result.update(backward_s=round(t_bwd - t_fwd, 1), rss_backward_gb=_maxrss() / GB)
        phase["name"] = "optimizer"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with lock:
        t_opt = time.perf_counter()
        for h in handles:
            h.remove()
        fwd = marks["forward"]
        result.update(optimizer_s=round(t_opt - t_bwd, 2), step_s=round(t_opt - t0, 1), partial=False,
                      forward_per_layer_s=round((fwd[-1] - fwd[0]) / max(1, len(fwd) - 1), 2),
                      rss_end_gb=_maxrss() / GB, status_end_mb=_status())
        phase["name"] = "done"
        return dict(result)


# ---------------------------------------------------------------------------------------------- parent steps


class Bench:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.config = bench_config(args.quick)
        self.model_dir = args.model_dir or Path("/tmp/chatglm6b-random" + ("-2l" if args.quick else ""))
        self.out = args.out or (Path("/tmp/chatglm6b-scale-quick") if args.quick else ROOT / "bench" / "results")
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_file = self.out / "scale.json"

    def dirs(self, which: str) -> Path:
        return self.model_dir if which == "source" else Path(f"{self.model_dir}-{which}")

    def load_results(self) -> dict:
        return json.loads(self.results_file.read_text()) if self.results_file.exists() else {}

    def save(self, name: str, record: dict) -> None:
        results = self.load_results()
        record.update(when=time.strftime("%Y-%m-%d %H:%M:%S"), load_average=[round(x, 2) for x in os.getloadavg()],
                      threads=self.args.threads, torch=torch.__version__,
                      cpu_capability=torch.backends.cpu.get_cpu_capability())
        results[name] = record
        results["_config"] = {"quick": self.quick, "num_layers": self.config.num_layers, "hidden_size": self.config.hidden_size,
                              "vocab_size": self.config.vocab_size, "model_dir": str(self.model_dir)}
        tmp = self.results_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, self.results_file)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items() if not k.startswith("status")}
        print(f"[{name}] {json.dumps(shown)}", flush=True)

    def variant(self) -> tuple[str, dict | None]:
        """(key suffix, child environment) of the variant options in effect."""
        suffix = "+e8" if self.args.quantize_embedding else ""
        if self.args.max_kernel_rows is not None:
            suffix += f"+kr{self.args.max_kernel_rows}"
        env = None
        if self.args.malloc_mmap_threshold is not None:
            suffix += f"+mmap{self.args.malloc_mmap_threshold // 1024}k"
            env = {"MALLOC_MMAP_THRESHOLD_": str(self.args.malloc_mmap_threshold)}
        return suffix, env

    def child_cmd(self, *extra) -> list[str]:
        rows = [] if self.args.max_kernel_rows is None else ["--max-kernel-rows", str(self.args.max_kernel_rows)]
        e8 = ["--quantize-embedding"] if self.args.quantize_embedding else []
        return [sys.executable, str(Path(__file__).resolve()), "--threads", str(self.args.threads),
                "--budget-s", str(self.args.budget_s), *rows, *e8, *extra]

    def run(self, step: str) -> None:
        start = time.perf_counter()
        if step == "write":
            text, seconds, rss = run_process(self.child_cmd("--child-write", "--model-dir", str(self.model_dir),
                                                            *(["--quick"] if self.quick else [])))
            info = json.loads(text.strip().splitlines()[-1])
            info.update(seconds=round(seconds, 1), peak_rss_gb=rss / GB, dir=str(self.model_dir))
            self.save("write", info)
        elif step.startswith("quantize-"):
            bits = int(step[-1])
            out_dir = self.dirs(f"int{bits}")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            text, seconds, rss = run_process([sys.executable, "quantize.py", "--bits", str(bits), str(self.model_dir), str(out_dir)])
            size = sum(f.stat().st_size for f in out_dir.iterdir() if f.suffix == ".safetensors")
            self.save(step, {"seconds": round(seconds, 1), "peak_rss_gb": rss / GB, "disk_gb": size / GB, "dir": str(out_dir),
                             "output": text.strip().splitlines()[0] if text.strip() else ""})
        elif step.startswith("infer-"):
            name = step[len("infer-"):]
            bits, source = INFER[name]
            bandwidth = float(run_process(self.child_cmd("--child-bandwidth"))[0].strip().splitlines()[-1])
            suffix, env = self.variant()
            text, seconds, rss = run_process(self.child_cmd("--child-infer", "--bits", str(bits), "--model-dir", str(self.dirs(source))), env)
            r = json.loads(text.strip().splitlines()[-1])
            r.update(peak_rss_gb=rss / GB, process_s=round(seconds, 1), copy_gb_s=bandwidth / GB,
                     bound_tok_s=bandwidth / r["weight_bytes_per_token"])
            r["of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
            r["malloc_mmap_threshold"] = self.args.malloc_mmap_threshold
            self.save(step + suffix, r)
        elif step.startswith("train-"):
            name = step[len("train-"):]
            suffix, env = self.variant()
            text, seconds, rss = run_process(self.child_cmd("--child-train", name, "--model-dir", str(self.model_dir)), env)
            r = json.loads(text.strip().splitlines()[-1])
            r.update(peak_rss_gb=rss / GB, process_s=round(seconds, 1), malloc_mmap_threshold=self.args.malloc_mmap_threshold)
            self.save(step + suffix, r)
        elif step == "report":
            report(self)
        else:
            raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")


# ---------------------------------------------------------------------------------------------- report


VARIANT_LABELS = {"e8": "INT8 embedding"}
# '+kr64' -> QuantizedLinear.max_kernel_rows = 64 (an existing class setting)


def _variant_label(suffix: str) -> str:
    """'+e8+mmap64k' -> 'INT8 embedding + MALLOC_MMAP_THRESHOLD_=64 KiB'; '' -> 'as is'."""
    parts = [p for p in suffix.split("+") if p]
    if not parts:
        return "as is"
    def label(p):
        if p in VARIANT_LABELS:
            return VARIANT_LABELS[p]
        if p.startswith("mmap"):
            return f"MALLOC_MMAP_THRESHOLD_={p[4:-1]} KiB"
        if p.startswith("kr"):
            return f"max_kernel_rows={p[2:]}"
        return p

    return " + ".join(label(p) for p in parts)


def _variants(results: dict, step: str) -> list[tuple[str, dict]]:
    """(suffix, record) of `step` as is and of its variants, as-is first."""
    out = [(k[len(step):], v) for k, v in results.items() if k == step or k.startswith(step + "+")]
    return sorted(out, key=lambda kv: (kv[0].count("+"), kv[0]))


def summary(results: dict) -> dict:
    """The closing JSON's numbers (None where a step has not run).

    Top level: the toolkit's defaults (the official formats). Inference RSS for INT8/INT4 is the worse of
    quantized-at-load and loaded-from-file; decode speed is that of the quantize.py file (the deployment
    path). Training: a complete step (partial measurements of a step stopped at the budget under
    `as_is_training`). `with_options`: the same numbers from the runs with the most options measured
    (`--quantize-embedding`, environment settings), the options named under `variants`.
    """
    def rec(step, suffixes):
        for suffix in suffixes:
            r = results.get(step + suffix)
            if r is not None and not r.get("partial"):
                return r, suffix
        return None, None

    def most_changes(step):
        complete = [(suf, r) for suf, r in _variants(results, step) if not r.get("partial")]
        return (complete[-1][1], complete[-1][0]) if complete else (None, None)

    def worst(*values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    infer = {"bf16": ["infer-bf16"], "int8": ["infer-int8-load", "infer-int8-file"], "int4": ["infer-int4-load", "infer-int4-file"]}
    file_step = {"bf16": "infer-bf16", "int8": "infer-int8-file", "int4": "infer-int4-file"}

    def block(choose) -> dict:
        out = {"inference_rss_gb": {}, "ptuning_rss_gb": {}, "lora_rss_gb": {}, "decode_tok_s": {}, "bound_tok_s": {},
               "step_s": {}, "training_source": {}}
        for kind, steps in infer.items():
            out["inference_rss_gb"][kind] = worst(*((choose(s)[0] or {}).get("peak_rss_gb") for s in steps))
            r = choose(file_step[kind])[0] or {}
            out["decode_tok_s"][kind], out["bound_tok_s"][kind] = r.get("decode_tok_s"), r.get("bound_tok_s")
        for name in TRAIN:
            tuning, base = name.split("-")
            r, suffix = choose(f"train-{name}")
            out[f"{tuning}_rss_gb"][base] = r.get("peak_rss_gb") if r else None
            out["step_s"][f"{tuning}_{base}"] = r.get("step_s") if r else None
            out["training_source"][f"{tuning}_{base}"] = _variant_label(suffix) if r else None
        return out

    out = block(lambda step: rec(step, [""]))
    as_is = {}
    for name in TRAIN:
        r = results.get(f"train-{name}")
        if r is not None and r.get("partial"):
            as_is[name.replace("-", "_")] = {k: r.get(k) for k in ("forward_s", "stopped_in", "stopped_after_s", "peak_rss_gb")
                                              if r.get(k) is not None}
    if as_is:
        out["as_is_training"] = as_is
    best = block(most_changes)
    best["variants"] = {s: _variant_label(most_changes(s)[1]) for s in
                        [*(f"infer-{k}" for k in INFER), *(f"train-{k}" for k in TRAIN)] if most_changes(s)[0] is not None}
    del best["training_source"]
    out["with_options"] = best

    def rounded(d):
        if isinstance(d, dict):
            return {k: rounded(v) for k, v in d.items()}
        return round(d, 3) if isinstance(d, float) else d

    return rounded(out)


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def report(bench: Bench) -> None:
    results = bench.load_results()
    s = summary(results)
    cfg = results.get("_config", {})
    layers = cfg.get("num_layers")
    lines = [f"# ChatGLM-6B at {'a 2-layer slice of ' if cfg.get('quick') else ''}full size on this machine (issue 6)", ""]
    lines.append(f"Config: {layers} layers, hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}; "
                 f"random fp16 weights (std 0.02) in the official sharded layout. Generated by `python bench/scale.py"
                 f"{' --quick' if cfg.get('quick') else ' --step ...'}` (see its docstring). GB = 1e9 bytes; RSS = peak "
                 "`ru_maxrss` of the whole measuring process, a fresh one per row (Python + torch + transformers baseline, "
                 "about 0.4 GB, included). The seed's figures are GPU memory of the official code (Table 18-1).")
    lines.append("")
    any_rec = next((v for k, v in results.items() if not k.startswith("_")), {})
    lines.append(f"Machine: {os.cpu_count()} CPUs ({any_rec.get('cpu_capability', '?')}: no native bf16 matmul), torch "
                 f"{any_rec.get('torch', '?')}, {any_rec.get('threads', '?')} torch thread(s) per process; other processes "
                 "share the cores (load average per row), so times vary run to run.")
    lines.append("")
    lines.append("`code`: `as is` = the toolkit's defaults (official formats); `INT8 embedding` = `from_pretrained("
                 "quantize_embedding=True)` (`--quantize-embedding`: the tied embedding / head as one INT8 copy); "
                 "`MALLOC_MMAP_THRESHOLD_` is glibc's setting for the measuring process.")
    lines += ["", "## Inference (bf16 compute; batch 1, 64-token prompt, 32 greedy tokens)", "",
              "`-load`: quantized while loading the fp16 checkpoint; `-file`: loaded from the `quantize.py` output. "
              "Bound = copy bandwidth (read + written bytes/s, measured just before) / weight bytes read per token.", "",
              "| variant | code | peak RSS GB | target GB | seed GPU GB | load s | prefill s | decode tok/s | bound tok/s | of bound | GB read/token | copy GB/s | load avg |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in INFER:
        kind = name.split("-")[0]
        found = _variants(results, f"infer-{name}")
        if not found:
            lines.append(f"| {name} | | not run | {TARGET_GB['inference'][kind]} | {SEED_GPU_GB['inference'][kind]} |" + " |" * 8)
        for suffix, r in found:
            lines.append(f"| {name} | {_variant_label(suffix)} | {r['peak_rss_gb']:.2f} | {TARGET_GB['inference'][kind]} | "
                         f"{SEED_GPU_GB['inference'][kind]} | {r['load_s']:.0f} | {r['prefill_s']:.1f} | {r['decode_tok_s']:.3f} | "
                         f"{r['bound_tok_s']:.3f} | {r['of_bound']:.0%} | {r['weight_bytes_per_token'] / GB:.2f} | "
                         f"{r['copy_gb_s']:.1f} | {r['load_average'][0]} |")
    lines += ["", "## One training step (batch 1 x 256 tokens, 128 labelled; gradient checkpointing; bf16 weights and activations; AdamW)", "",
              "A row stopped at the budget (the 10-minute command limit) shows what was measured before the stop.", "",
              "| step | code | peak RSS GB | target GB | seed GPU GB | load s | forward s | backward s | step s | trainable | load avg |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in TRAIN:
        tuning, base = name.split("-")
        target = TARGET_GB["ptuning"][base] if tuning == "ptuning" else "-"
        seed = SEED_GPU_GB["ptuning"][base]  # the seed's figure is for parameter-efficient tuning (P-tuning v2)
        found = _variants(results, f"train-{name}")
        if not found:
            lines.append(f"| {name} | | not run | {target} | {seed} |" + " |" * 6)
        for suffix, r in found:
            if r.get("partial"):
                if r.get("stopped_in") == "backward":
                    bwd = (f"stopped after {r['stopped_after_s'] - r['forward_s']:.0f} s, "
                           f"{r.get('backward_layers_done', 0)}/{layers} layers done")
                else:
                    bwd = "not reached"
                step_s = f"~{r['step_s']} (extrapolated)" if r.get("step_s") is not None else f"> {r.get('stopped_after_s')} (stopped)"
                rss = f"{r['peak_rss_gb']:.2f} (at stop)"
            else:
                bwd, step_s, rss = r["backward_s"], r["step_s"], f"{r['peak_rss_gb']:.2f}"
            lines.append(f"| {name} | {_variant_label(suffix)} | {rss} | {target} | {seed} | {r.get('load_s', '-')} | "
                         f"{r.get('forward_s', '-')} | {bwd} | {step_s} | {r.get('trainable_params', 0):,} | {r['load_average'][0]} |")
    extra = []
    if "write" in results:
        w = results["write"]
        extra.append(f"- write: {w['keys']} tensors, {w['shards']} shards, {w['bytes'] / GB:.2f} GB in {w['seconds']} s, "
                     f"peak RSS {w['peak_rss_gb']:.2f} GB (one shard at a time)")
    for b in (8, 4):
        q = results.get(f"quantize-int{b}")
        if q:
            extra.append(f"- quantize.py --bits {b}: {q['seconds']} s, peak RSS {q['peak_rss_gb']:.2f} GB, {q['disk_gb']:.2f} GB on disk")
    if extra:
        lines += ["", "## Preparation", "", *extra]
    lines += ["", "## Targets (as is)", ""] + [f"- {t}" for t in target_lines(s)]
    lines += ["", "## Targets with the measured options (see `code` above)", ""] + [f"- {t}" for t in target_lines(s["with_options"])]
    text = "\n".join(lines) + "\n"
    (bench.out / "scale.md").write_text(text)
    chart(bench.out / "scale.png", s, cfg)
    print(text)
    print(json.dumps({"scale": s}))


def target_lines(s: dict) -> list[str]:
    out = []
    for section, key in (("inference", "inference_rss_gb"), ("ptuning", "ptuning_rss_gb")):
        for b, want in TARGET_GB[section].items():
            got = s[key].get(b)
            source = (s.get("training_source") or {}).get("ptuning_" + b) if section == "ptuning" else None
            note = f" ({source})" if source and source != "as is" else ""
            out.append(f"{section} {b} peak RSS {_fmt(got)} GB <= {want}: "
                       + ("not run" if got is None else "met" if got <= want else "MISSED") + note)
    for b in ("bf16", "int8"):
        got, bound = s["decode_tok_s"].get(b), s["bound_tok_s"].get(b)
        ratio = None if got is None or bound is None else got / bound
        out.append(f"decode {b} {_fmt(ratio, '.0%')} of the bandwidth bound >= {TARGET_OF_BOUND:.0%}: "
                   + ("not run" if ratio is None else "met" if ratio >= TARGET_OF_BOUND else "MISSED"))
    a, b = s["decode_tok_s"].get("int4"), s["decode_tok_s"].get("bf16")
    ratio = None if a is None or b is None else a / b
    out.append(f"decode int4 {_fmt(ratio)}x bf16 >= {TARGET_INT4_X_BF16}x: "
               + ("not run" if ratio is None else "met" if ratio >= TARGET_INT4_X_BF16 else "MISSED"))
    return out


def chart(path: Path, s: dict, cfg: dict) -> None:
    """Grouped bars per panel: the seed's GPU figure, our peak RSS as is, and with the measured options."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = s.get("with_options", {})
    groups = [("inference", "inference_rss_gb", SEED_GPU_GB["inference"], TARGET_GB["inference"]),
              ("P-tuning v2 step", "ptuning_rss_gb", SEED_GPU_GB["ptuning"], TARGET_GB["ptuning"]),
              ("LoRA step", "lora_rss_gb", SEED_GPU_GB["ptuning"], None)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), sharey=True)
    w = 0.27
    for ax, (title, key, seed, target) in zip(axes, groups):
        ours, prop = s[key], best.get(key, {})
        xs = list(range(len(BITS)))
        ax.bar([x - w for x in xs], [seed[b] for b in BITS], w, label="seed: official code, GPU memory", color="#bbbbbb")
        ax.bar(xs, [ours.get(b) or 0 for b in BITS], w, color="#3a7bd5",
               label="this toolkit: peak RSS, CPU (defaults)")
        ax.bar([x + w for x in xs], [prop.get(b) or 0 for b in BITS], w, label="with --quantize-embedding", color="#59a14f",
               hatch="//", edgecolor="white")
        for x, b in zip(xs, BITS):
            for dx, v in ((0, ours.get(b)), (w, prop.get(b))):
                if v:
                    ax.text(x + dx, v + 0.2, f"{v:.1f}", ha="center", fontsize=7)
            if target:
                ax.plot([x - 0.5 * w, x + 1.5 * w], [target[b]] * 2, color="#d62728", lw=2, label="target" if x == 0 else None)
        ax.set_xticks(xs, [b.upper() if b != "bf16" else "half (bf16)" for b in BITS])
        ax.set_title(title)
    axes[0].set_ylabel("GB")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"ChatGLM-6B{' (2-layer slice)' if cfg.get('quick') else ''}: memory beside the seed's GPU figures")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_LAYERS}-layer slice of the real config (default: full, 28 layers)")
    p.add_argument("--step", choices=STEPS + ["all"], default=None,
                   help="run one step (full size: one per command, each under 10 minutes); default: all (--quick) ")
    p.add_argument("--model-dir", type=Path, help="where the random checkpoint goes (default /tmp/chatglm6b-random[-2l]); "
                   "quantize.py outputs go beside it (DIR-int8, DIR-int4)")
    p.add_argument("--out", type=Path, help="results folder (default bench/results; --quick: /tmp/chatglm6b-scale-quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per measuring process (default %(default)s: on 2 cores shared with other processes, one thread measured faster than two for every kernel used here, fp32 GEMMs included)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="a training process stops its step after this many seconds from its start and extrapolates "
                        "(default 540: under the 10-minute command limit; --quick 90)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="infer-*/train-* steps: load with the tied embedding / head as one INT8 copy; results are kept "
                        "under '<step>+e8' beside the as-is ones (default: off)")
    p.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                   help="infer-*/train-* steps: run the measuring process with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: "
                        "allocations from this size are mmap'd and returned to the system when freed, instead of "
                        "staying in a fragmented heap); results are kept under '<step>+mmap<K>k' (default: glibc's own)")
    p.add_argument("--max-kernel-rows", type=int, metavar="N",
                   help="infer-*/train-* steps: set QuantizedLinear.max_kernel_rows = N (inputs of up to N rows use the "
                        "int8pack/int4pack kernels instead of dequantizing); results under '<step>+krN' (default: the class's)")
    p.add_argument("--child-infer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-train", help=argparse.SUPPRESS)
    p.add_argument("--child-write", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-bandwidth", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bits", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 90.0 if args.quick else 540.0
    if args.child_bandwidth:
        torch.set_num_threads(args.threads)
        print(copy_bandwidth())
        return
    if args.child_write:
        print(json.dumps(write_checkpoint(args.model_dir, bench_config(args.quick), QUICK_SHARDS if args.quick else FULL_SHARDS)))
        return
    if args.child_infer or args.child_train:
        if args.max_kernel_rows is not None:
            from chatglm_tune.quantization import QuantizedLinear

            QuantizedLinear.max_kernel_rows = args.max_kernel_rows
        result = child_infer(args) if args.child_infer else child_train(args)
        result["max_kernel_rows"] = args.max_kernel_rows
        print(json.dumps(result))
        return
    bench = Bench(args)
    step = args.step or ("all" if args.quick else None)
    if step is None:
        p.error("full size runs step by step: pass --step (one of: " + ", ".join(STEPS) + "), or --step all")
    for s in (STEPS if step == "all" else [step]):
        bench.run(s)


if __name__ == "__main__":
    main()
