"""Benchmark: a ChatGLM version at full size on this machine: peak memory and speed of inference and of
one training step, bf16 / INT8 / INT4. `--version` (bench/common/scale_versions.py, one row per version):
`chatglm` (default) ChatGLM-6B, beside the seed's GPU figures (Table 18-1); `chatglm3`
ChatGLM3-6B; `glm4` GLM-4-9B; `glm4-0414` GLM-4-9B-0414 (transformers' `Glm4ForCausalLM` form);
`glm4-0414-32b` GLM-4-32B-0414, written directly in quantize.py's INT4 layout (no fp16 checkpoint), its rows in
GLM-4-9B-0414's results (`scale-glm4-0414.json`, keys `32b:<step>`; `--step report` of either writes both);
`glm47-flash` GLM-4.7-Flash in INT4; `glm45-air` GLM-4.5-Air, its first 4 layers in INT4 (the full size does not fit:
the `memory` step gives its memory from the loader's accounting, `scale_memory.py`).

    python bench/scale/scale.py --quick [--version V]              # 2-layer slice of the real config,
                                                                    #   every step in one go
    python bench/scale/scale.py [--version V] --step write          # full size, one step per command:
    python bench/scale/scale.py [--version V] --step quantize-int8  #   write, quantize-int8, quantize-int4,
    ...                                                             #   infer-bf16, infer-int8-load, infer-int8-file,
    ...                                                             #   infer-int4-load, infer-int4-file,
    ...                                                             #   train-{ptuning,lora}-{bf16,int8,int4}, report
    python bench/scale/scale.py [--version V] --step report
    python bench/scale/scale.py [--version V] --step clean          # then delete the checkpoints

Steps:
- `write`: a random-weight checkpoint of the version's full-size config in its official layout
  (`bench/common/checkpoint_writer.py`; ChatGLM-6B: `ChatGLMConfig.from_name("chatglm-6b")`, the model's own keys
  from its meta-device `state_dict` plus `lm_head.weight` and the `rotary_emb.inv_freq` buffers, fp16 `.bin`
  shards, M = 8; ChatGLM3-6B / GLM-4-9B: the official config.json and keys, fp16 safetensors shards, M = 7 /
  10, and the real tokenizer, copied from the shared assets when they sit beside this checkout; 3 shards
  with `--quick`). Generated shard by shard (std 0.02, seeded per key): at most one shard in memory.
  GLM-4-0414: transformers' config.json and keys, a tokenizer.json; GLM-4-32B-0414 as quantize.py's INT4 output.
- `quantize-int8`, `quantize-int4`: `quantize.py --bits B` of that checkpoint (official per-row layout);
  its time and peak RSS are recorded.
- `infer-*` (`bench/scale/scale_children.py infer`): in a fresh process, load with `chatglm_tune.from_pretrained(dir,
  dtype=bfloat16)` (bf16;
  INT8/INT4 quantized at load (`-load`) or read from the quantize.py output (`-file`)), then batch-1
  greedy decoding of 32 new tokens after a 64-token prompt in the version's frame (random ordinary ids
  between its special ids: `... [gMASK] <sop>`; `[gMASK] <sop> <|user|> ... <|assistant|>`)
  (`generation.generate`, no stop on <eop>, after
  a 2-token warm-up that also builds the INT4 kernel layout). Decode tokens/s = 31 / (end - start of the
  first incremental step); bound tokens/s = copy bandwidth / weight bytes read per token (an untied input
  embedding not counted: a step reads one row of it), the copy
  bandwidth ((read + written) bytes/s of a 256 MiB tensor copy, same thread count) measured by this step
  just before the load.
- `train-{ptuning,lora}-{bf16,int8,int4}` (`bench/scale/scale_children.py train`): in a fresh process, one
  training step (forward with labels, backward, AdamW step) on batch 1 x 256 tokens (128 prompt tokens
  in the version's frame, 128 labelled answer tokens), gradient checkpointing on
  (`activation_checkpointing_enable` + `enable_input_require_grads`), bf16 compute; the library's
  defaults: P-tuning v2 with `TrainOptions()`'s pre_seq_len (128) and no projection, LoRA with
  `LoraOptions()` (r 8 on the version's targets: query_key_value; q_proj k_proj v_proj), each at `training.DEFAULT_LR`
  (2e-2, 2e-4). INT8/INT4 bases are quantized at load (what `train.py --quantization-bit` does), and glibc's large
  blocks are mmap'd as train.py has them (`heap.mmap_large_blocks`). A step that would not finish inside `--budget-s`
  (the 10-minute command limit) is stopped at the budget: the forward pass and the backward of the layers done
  are measured, the rest of the backward is extrapolated per layer, and the result says `partial`.
- `memory`: the loader's accounting of the model's memory at full size and as written (`scale_memory.py`): what each
  part takes in INT4 with the INT8 embedding and head; the report sets it beside the written copy's measured peak.
- `clean` (not part of `all`): deletes the checkpoint and the quantize.py outputs beside it.
- `report` (`bench/scale/scale_report.py`): the table (also `<results>.md`; ChatGLM-6B beside the seed's GPU
  figures, with a bar chart `scale.png`), the version's targets, and the closing JSON line
  (`{"<results>": {...}}`).

Peak RSS is the whole measuring process's own `ru_maxrss` (`measure.run`), the Python + torch baseline
included; GB = 1e9 bytes. Every step appends its numbers to the results JSON (`bench/results/scale.json`,
`scale-chatglm3.json`, `scale-glm4.json` at full size; with `--quick` everything goes to `--out`, default
/tmp/{chatglm6b,chatglm3,glm4}-scale-quick). The checkpoint goes to /tmp/{chatglm6b,chatglm3,glm4}-random
(`-2l` with `--quick`), the quantize.py outputs beside it (`-int8`, `-int4`).

Variants (kept beside the as-is numbers, under the step name + a suffix, and shown in their own rows):
`--quantize-embedding` loads with `quantize_embedding=True` (`+e8`: ChatGLM-6B's tied embedding / head as one
INT8 copy, the GLM family's untied ones as one INT8 copy each), `--train-dtype float32` trains in float32 (`+f32`),
`--max-kernel-rows N`
sets `QuantizedLinear.max_kernel_rows`, `--malloc-mmap-threshold B` runs the measuring process with
glibc's `MALLOC_MMAP_THRESHOLD_=B`. The closing JSON's top level is the toolkit's defaults;
`with_options` repeats it from the variants with the most options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, run_python  # noqa: E402
from bench.common.scale_versions import DEFAULT_VERSION, QUICK_LAYERS, QUICK_SHARDS, VERSIONS, frame_json  # noqa: E402
from bench.scale.scale_children import GB, INFER, TRAIN  # noqa: E402
from bench.scale.scale_memory import accounting  # noqa: E402
from bench.scale.scale_report import report  # noqa: E402
from chatglm_tune.quant.cpu_matmul import native_bf16_gemm  # noqa: E402

STEPS = ["write", "quantize-int8", "quantize-int4", *(f"infer-{k}" for k in INFER),
         *(f"train-{k}" for k in TRAIN), "memory", "report"]
CLEAN = "clean"  # not part of `all`: deletes the checkpoint and the quantize.py outputs beside it


class Bench:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.version = VERSIONS[args.version]
        self.num_layers = QUICK_LAYERS if args.quick else self.version.slice_layers  # None: the full size
        slug = self.version.slug
        self.model_dir = args.model_dir or Path(f"/tmp/{slug}-random" + ("-2l" if args.quick else ""))
        self.out = args.out or (Path(f"/tmp/{slug}-scale-quick") if args.quick else RESULTS)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_file = self.out / f"{self.version.stem}.json"
        self.prefix = self.version.results_prefix  # its keys in a results file it shares with another version

    def dirs(self, which: str) -> Path:
        if which == "source" or which == f"int{self.version.written_bits}":
            return self.model_dir  # a version written quantized: its checkpoint is the quantize.py output
        return Path(f"{self.model_dir}-{which}")

    def not_applicable(self, step: str) -> str | None:
        """Why `step` cannot run (it needs the fp16 checkpoint of a version written quantized), else None."""
        bits = self.version.written_bits
        if bits and (step.startswith("quantize-") or step.startswith("train-") and not step.endswith(f"-int{bits}")
                     or step.startswith("infer-") and step != f"infer-int{bits}-file"):
            return f"{step}: {self.version.title} is written as INT{bits} (no fp16 checkpoint): not run"
        return None

    def load_results(self) -> dict:
        return json.loads(self.results_file.read_text()) if self.results_file.exists() else {}

    def save(self, name: str, record: dict) -> None:
        results = self.load_results()
        record.update(when=time.strftime("%Y-%m-%d %H:%M:%S"), load_average=[round(x, 2) for x in os.getloadavg()],
                      threads=self.args.threads, torch=torch.__version__,
                      cpu_capability=torch.backends.cpu.get_cpu_capability(), native_bf16_gemm=native_bf16_gemm())
        results[self.prefix + name] = record
        results[self.prefix + "_config"] = {"quick": self.quick, **self.version.shape(self.num_layers),
                                            "model_dir": str(self.model_dir), "written_bits": self.version.written_bits}
        tmp = self.results_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, self.results_file)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()
                 if not k.startswith("status")}
        print(f"[{name}] {json.dumps(shown)}", flush=True)

    def variant(self) -> tuple[str, dict | None]:
        """(key suffix, child environment) of the variant options in effect."""
        suffix = "+e8" if self.args.quantize_embedding else ""
        if self.args.train_dtype == "float32":
            suffix += "+f32"
        if self.args.max_kernel_rows is not None:
            suffix += f"+kr{self.args.max_kernel_rows}"
        env = None
        if self.args.malloc_mmap_threshold is not None:
            suffix += f"+mmap{self.args.malloc_mmap_threshold // 1024}k"
            env = {"MALLOC_MMAP_THRESHOLD_": str(self.args.malloc_mmap_threshold)}
        return suffix, env

    def frame(self) -> str:
        """The prompt frame's ids (JSON) for the measuring processes (`scale_versions.frame_json`)."""
        return frame_json(self.version.name, self.model_dir)

    def check_memory(self, step: str) -> None:
        """Refuse a bf16 step whose weights alone (the fp16 checkpoint's files) + 1 GB do not fit in the memory
        available now, rather than leave it to the kernel's OOM killer on a machine shared with other jobs
        (GLM-4-9B in bf16 needs about 20 GB)."""
        from chatglm_tune.runtime.checkpoint import weight_files

        need = sum(f.stat().st_size for f in weight_files(self.model_dir)) + 1e9  # + Python, torch, activations
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        if need > available:
            raise SystemExit(f"{step}: needs about {need / GB:.1f} GB, {available / GB:.1f} GB of memory is available "
                             "now: not run (free memory, then run this step again)")

    def child(self, kind: str, *extra, env: dict | None = None):
        """`measure.run` of `scale_children.py KIND ...` with the variant options in effect."""
        rows = [] if self.args.max_kernel_rows is None else ["--max-kernel-rows", self.args.max_kernel_rows]
        e8 = ["--quantize-embedding"] if self.args.quantize_embedding else []
        f32 = ["--train-dtype", "float32"] if kind == "train" and self.args.train_dtype == "float32" else []
        return run_python(HERE / "scale_children.py", kind, *extra, "--threads", self.args.threads,
                          "--budget-s", self.args.budget_s, *rows, *e8, *f32, env=env)

    def run(self, step: str) -> None:
        if self.not_applicable(step):
            raise SystemExit(self.not_applicable(step))
        if step == "write":
            layers = ["--num-layers", self.num_layers] if self.num_layers else []
            done = run_python(HERE.parent / "common" / "checkpoint_writer.py", self.model_dir, "--version",
                              self.version.name, *layers, "--shards",
                              QUICK_SHARDS if self.quick else self.version.shards)
            info = done.last_json()
            info.update(seconds=round(done.seconds, 1), peak_rss_gb=done.peak_rss / GB, dir=str(self.model_dir))
            self.save("write", info)
        elif step.startswith("quantize-"):
            bits = int(step[-1])
            out_dir = self.dirs(f"int{bits}")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            done = run_python("quantize.py", "--bits", bits, self.model_dir, out_dir)
            size = sum(f.stat().st_size for f in out_dir.iterdir() if f.suffix == ".safetensors")
            text = done.stdout.strip()
            self.save(step, {"seconds": round(done.seconds, 1), "peak_rss_gb": done.peak_rss / GB, "disk_gb": size / GB,
                             "dir": str(out_dir), "output": text.splitlines()[0] if text else ""})
        elif step.startswith("infer-"):
            name = step[len("infer-"):]
            bits, source = INFER[name]
            if not bits:
                self.check_memory(step)
            bandwidth = self.child("bandwidth").last_json()
            suffix, env = self.variant()
            done = self.child("infer", "--bits", bits, "--model-dir", self.dirs(source), "--frame",
                              self.frame(), env=env)
            r = done.last_json()
            r.update(peak_rss_gb=done.peak_rss / GB, process_s=round(done.seconds, 1), copy_gb_s=bandwidth / GB,
                     bound_tok_s=bandwidth / r["weight_bytes_per_token"])
            r["of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
            r["malloc_mmap_threshold"] = self.args.malloc_mmap_threshold
            self.save(step + suffix, r)
        elif step.startswith("train-"):
            name = step[len("train-"):]
            if name.endswith("-bf16"):
                self.check_memory(step)
            suffix, env = self.variant()
            done = self.child("train", name, "--model-dir", self.model_dir, "--frame", self.frame(), env=env)
            r = done.last_json()
            r.update(peak_rss_gb=done.peak_rss / GB, process_s=round(done.seconds, 1),
                     malloc_mmap_threshold=self.args.malloc_mmap_threshold)
            self.save(step + suffix, r)
        elif step == "memory":
            self.save("memory", {"full": accounting(self.version.config_json(), 4),
                                 "sliced": accounting(self.version.config_json(self.num_layers), 4),
                                 "sliced_layers": self.num_layers or self.version.shape()["num_layers"]})
        elif step == CLEAN:
            for which in ("source", "int8", "int4"):
                directory = self.dirs(which)
                if directory.exists():
                    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
                    shutil.rmtree(directory)
                    print(f"[clean] removed {directory} ({size / GB:.1f} GB)", flush=True)
        elif step == "report":
            report(self.load_results(), self.out, VERSIONS[self.version.reported_by or self.version.name])
        else:
            raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", choices=VERSIONS, default=DEFAULT_VERSION,
                   help="chatglm: ChatGLM-6B; chatglm3: ChatGLM3-6B; glm4: GLM-4-9B; glm4-0414: GLM-4-9B-0414; "
                        "glm4-0414-32b: GLM-4-32B-0414 (written as INT4); glm47-flash: GLM-4.7-Flash; "
                        "glm45-air: GLM-4.5-Air (4 layers) "
                        "(default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"a {QUICK_LAYERS}-layer slice of the real config (default: full size, 28 layers; GLM-4-9B 40)")
    p.add_argument("--step", choices=STEPS + ["all", CLEAN], default=None,
                   help="run one step (full size: one per command, each under 10 minutes); default: all (--quick) ")
    p.add_argument("--model-dir", type=Path, help="where the random checkpoint goes (default "
                   "/tmp/{chatglm6b,chatglm3,glm4}-random[-2l]); "
                   "quantize.py outputs go beside it (DIR-int8, DIR-int4)")
    p.add_argument("--out", type=Path, help="results folder (default bench/results; --quick: "
                   "/tmp/{chatglm6b,chatglm3,glm4}-scale-quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per measuring process (default %(default)s: "
                                                          "on 2 cores shared with other processes, one thread measured "
                                                          "faster than two for every kernel used here, fp32 GEMMs "
                                                          "included)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="a training process stops its step after this many seconds from its start and extrapolates "
                        "(default 540: under the 10-minute command limit; --quick 90)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="infer-*/train-* steps: load with the embedding and head in INT8 (ChatGLM-6B's tied pair as "
                        "one copy); results are kept under '<step>+e8' beside the as-is ones (default: off)")
    p.add_argument("--train-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="train-* steps: the float weights' and the compute's dtype; float32 (train.py's default, for "
                        "CPUs without native bf16 matmuls, where a bf16 one is ~100x slower) is kept under "
                        "'<step>+f32' (default %(default)s)")
    p.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                   help="infer-*/train-* steps: run the measuring process with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: "
                        "allocations from this size are mmap'd and returned to the system when freed, instead of "
                        "staying in a fragmented heap); results are kept under '<step>+mmap<K>k' (default: glibc's "
                        "own)")
    p.add_argument("--max-kernel-rows", type=int, metavar="N",
                   help="infer-*/train-* steps: set QuantizedLinear.max_kernel_rows = N (inputs of up to N rows use "
                        "the int8pack/int4pack kernels instead of dequantizing); results under '<step>+krN' (default: "
                        "the class's)")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 90.0 if args.quick else 540.0
    bench = Bench(args)
    step = args.step or ("all" if args.quick else None)
    if step is None:
        p.error("full size runs step by step: pass --step (one of: " + ", ".join(STEPS) + "), or --step all")
    for s in (STEPS if step == "all" else [step]):
        if step == "all" and bench.not_applicable(s):
            continue
        bench.run(s)


if __name__ == "__main__":
    main()
