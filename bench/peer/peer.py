"""Benchmark: ChatGLM-6B at full size on CPU against the C++ peers, chatglm.cpp and (ChatGLM3-6B) llama.cpp: decode
speed, prefill time and peak memory side by side, and batched extraction records/s.

    python bench/peer/peer.py --step write                      # the random fp16 checkpoint (official layout)
    python bench/peer/peer.py --step convert-q4_0               # GGML files: convert-f16, convert-q8_0, convert-q4_0
    python bench/peer/peer.py --step cpp-q4_0 --threads 2       # chatglm.cpp: cpp-f16, cpp-q8_0, cpp-q4_0
    python bench/peer/peer.py --version chatglm3 --step gguf-q4_0              # GGUF files: gguf-{f16,q8_0,q4_0}
    python bench/peer/peer.py --version chatglm3 --step llama-q4_0 --threads 2 # llama.cpp: llama-{f16,q8_0,q4_0}
    python bench/peer/peer.py --version chatglm3 --step llama-batch-q4_0-b8 --threads 2
                                                                # llama-batch-{q8_0,q4_0}-b{1,8,32}
    python bench/peer/peer.py --step toolkit-int4 --threads 2   # the toolkit: toolkit-bf16, toolkit-int8, toolkit-int4
    python bench/peer/peer.py --step toolkit-int4 --threads 2 --quantize-embedding   # ... with the INT8 embedding/head
    python bench/peer/peer.py --step batch-int4-b8 --threads 2  # batched extraction: batch-{bf16,int8,int4}-b{1,8,32}
    python bench/peer/peer.py --version chatglm3 --step toolkit-int4 --threads 2 --quantize-embedding --again
                                                                # one more run: the record is the median one
                                                                # (alternate sides)
    python bench/peer/peer.py --version chatglm3 --step llama-q4_0 --capability avx2 --llama-cpp DIR
                                                                # without AVX-512: llama.cpp's AVX2 build in DIR (+avx2)
    python bench/peer/peer.py --step report                     # peer.json, peer.md, the closing JSON line
    python bench/peer/peer.py --step clean                      # delete the checkpoint, GGML and GGUF files
    python bench/peer/peer.py --quick --step all                # a 2-layer slice, every step, into /tmp
    python bench/peer/peer.py --version chatglm3 --step all     # the same for ChatGLM3-6B (results: peer-chatglm3.*)

chatglm.cpp is optional, for this bench only: `CMAKE_ARGS="-DCMAKE_POLICY_VERSION_MINIMUM=3.5" pip install
chatglm-cpp==0.4.2` (built from source, about 4 minutes). Without it the convert-*/cpp-* steps are skipped
(printed, not recorded) and the report leaves its columns empty.

llama.cpp is optional too, through llama-cpp-python (0.3.36 measured here): `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
llama-cpp-python` (built from source for this machine's ISA, about 10-15 minutes on 2 cores). Without it the
gguf-*/llama-* steps are skipped (printed, not recorded). llama.cpp runs ChatGLM3-6B (its `chatglm` architecture) but
not ChatGLM-6B: with `--version chatglm` those steps are recorded as not run, saying why, and listed under "Not run".

What each step measures, each in a fresh process (`measure.run`: the process's own peak RSS):
- `write`: `bench/common/checkpoint_writer.py --version V` (fp16 shards, config.json, index; keys, shapes and order of
  the official files; ChatGLM3-6B's real tokenizer beside them). One checkpoint feeds every runtime.
  `--version` (`chatglm`: ChatGLM-6B, the default; `chatglm3`: ChatGLM3-6B) picks the row of
  bench/common/scale_versions.py: config, layout, and the prompt frame (ChatGLM-6B: random ids, then [gMASK] <sop>;
  ChatGLM3-6B: [gMASK] sop <|user|>, random ids, <|assistant|>), resolved here and passed to every child.
- `convert-*` (`bench/peer/peer_cpp.py`, as `cpp-*`): a GGML file in chatglm.cpp 0.4.2's format of the version,
  written here from the state dict (`write_ggml`; chatglm.cpp's own converter needs the official remote code,
  which this checkout does not have): header, config, a SentencePiece model (ChatGLM-6B: a tiny one trained
  here, the ids are given, never encoded; ChatGLM3-6B: its real one), then every tensor: f16, or ggml's q8_0 /
  q4_0 blocks (32 weights and an fp16 scale each; q4_0 scaled by the block's signed absmax / -8) for the
  embedding, the head and the block Linears, f32 norms and biases.
- `cpp-*`: `chatglm_cpp.Pipeline(file).model.generate_next_token` (0.4.2's `Pipeline.generate` is broken),
  greedy, after an 8-token warm-up that also faults the mapped weights in: a 64-token prompt (`--prompt-len`) then 64
  new tokens (prefill = the first call; decode ms/token = the other 63 calls), then one extraction record (a
  64-token prompt, 32 new tokens: chatglm.cpp decodes one sequence at a time, so records/s = 1 / its time).
  Threads: 0.4.2's Python API has no thread setting (`cpp_threads`: the online CPUs, up to 4); cpp steps run
  only with `--threads` equal to that number.
- `gguf-*` (`bench/peer/peer_llama.py`, as `llama-*`): the toolkit's exporter as a user runs it, `export.py CHECKPOINT
  <checkpoint>-gguf-T --format gguf --type T --name <checkpoint's name>` (its process: seconds from start to exit, the
  file's size, peak RSS; matrices in f16, or q8_0 / q4_0 blocks quantized by gguf-py, a q4_0 file's head in q8_0).
- `llama-*`: a fresh `bench/peer/peer_llama.py` process (llama_cpp and numpy, no torch): `llama_cpp.Llama(file,
  n_threads=n_threads_batch=--threads, flash attention on)`, the same prompt ids, warm-up, 64-token prompt and 64
  greedy new tokens as the other runtimes, fed as ids through the low-level API, argmax of the logits taken there:
  prefill = the prompt's one `llama_decode` call; decode ms/token = the mean of the other 63 calls (the median is
  recorded beside). Runs at any `--threads`.
- `llama-batch-T-bN` (q8_0 and q4_0 files): the N prompts of `batch-*-bN` decoded together, 32 new tokens each: one
  llama.cpp context with n_seq_max = N, each step one `llama_decode` of a `llama_batch` holding one entry per row
  (its token, position, sequence id, logits flag), `llama_get_logits_ith` per row; records/s = N / the wall time of
  the prefill and the 32 steps. `Llama` has no n_seq_max setting, so this context comes from the low-level calls
  with `Llama`'s settings.
- `toolkit-*` (`bench/peer/peer_children.py`, as `batch-*`; the workload every runtime shares is there too):
  `from_pretrained(dtype=bfloat16, quantization_bit=8/4)` (quantized at load from the fp16 checkpoint), torch
  threads = `--threads`, the same warm-up, prompt and 64 new tokens through `generation.generate` (KV cache,
  greedy, no stop on <eop>); the kernel the INT4 layers ran is recorded.
- `batch-*-bN`: what infer.py does per batch (`extraction._decode_batch` -> `generation.generate`): N prompts of
  64 tokens (ending [gMASK] <sop>, no padding), 32 new tokens each; records/s = N / wall time of the call.
`--prompt-len N` gives toolkit-*, cpp-* and llama-* steps a prompt of N tokens instead of 64 (prefill of long prompts),
kept under a `+pN` suffix. `--capability avx2` runs toolkit/batch steps with `ATEN_CPU_CAPABILITY=avx2` (PyTorch's
kernels as on a CPU without AVX-512), and llama-* steps on a llama.cpp built with ggml's AVX2 kernels only, which
`--llama-cpp DIR` names (built as `peer_llama.INSTALL_AVX2` says, into DIR, 10-15 minutes on 2 cores; a build reporting
AVX512 = 1 is refused); results are kept beside the native ones under a `+avx2` suffix, as `+e8` marks
`--quantize-embedding` (the toolkit's steps only). chatglm.cpp is built for the machine it runs on (ggml's native
build). On a CPU with AMX, `--capability avx2` works for ChatGLM-6B only: transformers' GLM attention (ChatGLM3-6B) then
reaches PyTorch's bf16 flash attention, which fails under that setting ("pack_vnni2 is only supported when avx512 is
supported").

Step records accumulate in `peer_steps.json` (bench/results at full size; ChatGLM3-6B: `peer-chatglm3_steps.json`);
`report` (`bench/peer/peer_report.py`) writes `peer.json` (the reported shape: the fastest honest setting of each
variant at the reported thread count, chatglm.cpp's and llama.cpp's runs beside) and `peer.md` (every run, the files
written, the steps not run), or `peer-chatglm3.json` / `.md`. Every process stays under ~14 GB (bf16, cpp f16 and
llama f16 are the largest, about 13 GB; the GGUF exports read the checkpoint a tensor at a time, about 2.5 GB); run
one at a time. Disk at full size: the checkpoint (12.5 GB) and each peer's three files (GGML and
GGUF: about 22.6 GB each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, run_python  # noqa: E402
from bench.common.scale_versions import VERSIONS, frame_json  # noqa: E402
from bench.peer.peer_children import BATCHES, BITS, GB, PROMPT_LEN, child_batch, child_toolkit  # noqa: E402
from bench.peer.peer_cpp import CPP_TYPES, INSTALL, child_convert, child_cpp, cpp_threads, has_chatglm_cpp  # noqa: E402
from bench.peer.peer_llama import (BATCH_TYPES, LLAMA_TYPES, NO_CHATGLM6B, export_args, gguf_path,  # noqa: E402
                                   has_llama_cpp, remove_gguf, workload)
from bench.peer.peer_llama import INSTALL as LLAMA_INSTALL  # noqa: E402
from bench.peer.peer_llama import INSTALL_AVX2 as LLAMA_INSTALL_AVX2  # noqa: E402
from bench.peer.peer_report import report  # noqa: E402

QUICK_LAYERS = 2
PEER_VERSIONS = ("chatglm", "chatglm3")  # what chatglm.cpp 0.4.2 and `peer_cpp.write_ggml` both run here
STEPS = (["write"] + [f"convert-{t}" for t in CPP_TYPES] + [f"cpp-{t}" for t in CPP_TYPES]
         + [f"gguf-{t}" for t in LLAMA_TYPES] + [f"llama-{t}" for t in LLAMA_TYPES]
         + [f"llama-batch-{t}-b{n}" for t in BATCH_TYPES for n in BATCHES] + [f"toolkit-{b}" for b in BITS]
         + [f"batch-{b}-b{n}" for b in BITS for n in BATCHES] + ["report"])
PEERS = ("cpp", "convert", "gguf", "llama")  # steps of a peer: no +e8 (the toolkit's loading)
BUILT_FOR_CAPABILITY = ("toolkit", "batch", "llama")  # steps that --capability avx2 runs as without AVX-512 (+avx2)


# What a run's speed is read from, fastest first: decode ms per token, else a batch's seconds.
SPEED_FIELDS = ("decode_ms", "seconds")


def median_run(runs: list[dict]) -> dict:
    """The run of median speed (the slower middle one of an even count), holding every run's record in `runs`."""
    field = next(f for f in SPEED_FIELDS if f in runs[0])
    plain = [{k: v for k, v in r.items() if k != "runs"} for r in runs]
    middle = sorted(plain, key=lambda r: r[field])[len(plain) // 2]
    return {**middle, "runs": plain}


class Bench:
    def __init__(self, args):
        self.args = args
        self.version = VERSIONS[args.version]
        slug = self.version.slug
        self.model_dir = args.model_dir or Path(f"/tmp/{slug}-peer" + ("-2l" if args.quick else ""))
        self.out = args.out or (Path(f"/tmp/{slug}-peer-quick") if args.quick else RESULTS)
        self.out.mkdir(parents=True, exist_ok=True)
        self.stem = "peer" if args.version == "chatglm" else f"peer-{args.version}"
        self.steps_file = self.out / f"{self.stem}_steps.json"

    def frame(self) -> str:
        """The prompt frame's ids (JSON) for the measuring processes (`scale_versions.frame_json`)."""
        return frame_json(self.version.name, self.model_dir)

    def ggml(self, dtype: str) -> Path:
        return self.model_dir.with_name(self.model_dir.name + f"-{dtype}.ggml")

    def load(self) -> dict:
        return json.loads(self.steps_file.read_text()) if self.steps_file.exists() else {}

    def save(self, key: str, record: dict) -> None:
        import torch

        record.update(when=time.strftime("%Y-%m-%d %H:%M:%S"), load_average=[round(v, 2) for v in os.getloadavg()],
                      torch=torch.__version__)
        results = self.load()
        earlier = results.get(key, {})
        if self.args.again and any(f in earlier and f in record for f in SPEED_FIELDS):
            record = median_run(earlier.get("runs", [earlier]) + [record])
        results[key] = record
        tmp = self.steps_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, self.steps_file)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()}
        print(f"[{key}] {json.dumps(shown)}", flush=True)

    def key(self, step: str) -> str:
        a = self.args
        suffix = ("+e8" if a.quantize_embedding and not step.startswith(PEERS) else "")
        suffix += f"+{a.capability}" if a.capability and step.startswith(BUILT_FOR_CAPABILITY) else ""
        # what --prompt-len sets
        long_prompt = step.startswith(("toolkit-", "llama-", "cpp-")) and not step.startswith("llama-batch-")
        suffix += f"+p{a.prompt_len}" if a.prompt_len != PROMPT_LEN and long_prompt else ""
        return f"{step}@{a.threads}t{suffix}" if step.split("-")[0] in ("cpp", "toolkit", "batch", "llama") else step

    def child(self, kind: str, *extra, env: dict | None = None):
        return run_python(__file__, "--child", kind, "--threads", self.args.threads, "--version", self.args.version,
                          *extra, env=env)

    def run(self, step: str) -> None:
        a = self.args
        env = {"ATEN_CPU_CAPABILITY": a.capability} if a.capability else None
        e8 = ["--quantize-embedding"] if a.quantize_embedding else []
        if step == "write":
            done = run_python(HERE.parent / "common" / "checkpoint_writer.py", self.model_dir, "--version", a.version,
                              *(["--num-layers", QUICK_LAYERS, "--shards", 3] if a.quick else []))
            self.save(step, {**done.last_json(), "seconds": done.seconds, "peak_rss_gb": done.peak_rss / GB,
                             "dir": str(self.model_dir)})
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
            done = self.child("cpp", "--ggml", self.ggml(dtype), "--frame", self.frame(), "--prompt-len", a.prompt_len)
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB, "process_s": done.seconds,
                                       "file_gb": self.ggml(dtype).stat().st_size / GB})
        elif step.startswith(("gguf-", "llama-")):
            self.run_llama(step)
        elif step.startswith("toolkit-"):
            done = self.child("toolkit", "--variant", step.split("-", 1)[1], "--model-dir", self.model_dir,
                              "--frame", self.frame(), "--prompt-len", a.prompt_len, *e8, env=env)
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB,
                                       "process_s": done.seconds})
        elif step.startswith("batch-"):
            _, variant, b = step.split("-")
            done = self.child("batch", "--variant", variant, "--batch", b[1:], "--model-dir", self.model_dir, "--frame",
                              self.frame(), *e8, env=env)
            self.save(self.key(step), {**done.last_json(), "peak_rss_gb": done.peak_rss / GB,
                                       "process_s": done.seconds})
        elif step == "report":
            report(self.load(), self.out, a.threads, title=self.version.title, stem=self.stem, quick=a.quick)
        elif step == "clean":
            shutil.rmtree(self.model_dir, ignore_errors=True)
            for dtype in CPP_TYPES:
                self.ggml(dtype).unlink(missing_ok=True)
            for dtype in LLAMA_TYPES:
                remove_gguf(self.model_dir, dtype)
            print(f"removed {self.model_dir} and its GGML and GGUF files", flush=True)
        else:
            raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}, clean")

    def run_llama(self, step: str) -> None:
        """`gguf-*`, `llama-*`, `llama-batch-*-bN`: recorded as not run for ChatGLM-6B; skipped without llama_cpp."""
        if self.args.version == "chatglm":
            print(f"[{step}] not run: {NO_CHATGLM6B}", flush=True)
            self.save(self.key(step), {"skipped": NO_CHATGLM6B})
        elif not has_llama_cpp():
            print(f"[{step}] skipped: llama_cpp is not installed (optional, this bench only: {LLAMA_INSTALL})",
                  flush=True)
        elif step.startswith("gguf-"):
            self.export_gguf(step.split("-", 1)[1])
        elif step.startswith("llama-batch-"):
            _, _, dtype, b = step.split("-")
            self.llama_child(step, dtype, int(b[1:]))
        else:
            self.llama_child(step, step.split("-", 1)[1], None)

    def export_gguf(self, dtype: str) -> None:
        """export.py's process writing the GGUF file: its seconds (and export.py's own), the file's size, peak RSS."""
        remove_gguf(self.model_dir, dtype)
        done = run_python(*export_args(self.model_dir, dtype))
        path = gguf_path(self.model_dir, dtype)
        said = re.search(r" in ([0-9.]+) s$", next((x for x in done.stdout.splitlines() if " -> " in x), ""))
        self.save(f"gguf-{dtype}", {"seconds": done.seconds, "export_s": float(said[1]) if said else None,
                                    "bytes": path.stat().st_size, "peak_rss_gb": done.peak_rss / GB, "file": str(path)})

    def llama_child(self, step: str, dtype: str, batch: int | None) -> None:
        """A `bench/peer/peer_llama.py` process on the GGUF file: one sequence (batch None) or `batch` together."""
        path = gguf_path(self.model_dir, dtype)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: run --step gguf-{dtype} first")
        a = self.args
        paths = ([str(a.llama_cpp), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                 if a.llama_cpp else [])
        # an empty entry would add the working directory
        build = {"PYTHONPATH": os.pathsep.join(paths)} if paths else None
        done = run_python(HERE / "peer_llama.py", "--child", "llama" if batch is None else "llama-batch",
                          "--gguf", path, "--threads", a.threads, "--workload",
                          workload(json.loads(self.frame()), batch, a.prompt_len),
                          *(["--capability", a.capability] if a.capability else []), env=build)
        record = done.last_json()
        if "skipped" not in record:  # a binding missing in the installed llama-cpp-python: recorded as not run
            record.update(peak_rss_gb=done.peak_rss / GB, process_s=done.seconds, file_gb=path.stat().st_size / GB)
        self.save(self.key(step), record)



def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", choices=STEPS + ["all", "clean"],
                   help="one step per command at full size; `all` runs every step")
    p.add_argument("--version", choices=PEER_VERSIONS, default="chatglm", help="ChatGLM-6B (default) or ChatGLM3-6B")
    p.add_argument("--quick", action="store_true",
                   help=f"a {QUICK_LAYERS}-layer slice, results in /tmp/<version>-peer-quick")
    p.add_argument("--threads", type=int, default=2, help="threads of the measured process (default %(default)s)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="toolkit/batch steps: the embedding / head in INT8 (+e8)")
    p.add_argument("--capability", choices=["avx2"],
                   help="toolkit/batch steps: ATEN_CPU_CAPABILITY for PyTorch's kernels; "
                   "llama-* steps: a llama.cpp built without AVX-512 (--llama-cpp), refused otherwise (+avx2)")
    p.add_argument("--llama-cpp", type=Path, help="llama-* steps: a directory holding another llama-cpp-python build "
                   f"(`{LLAMA_INSTALL_AVX2}`), first on their import path")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                   help="toolkit-*/cpp-*/llama-* steps: the prompt's tokens (default %(default)s; another length adds "
                        "+pN to the step's key)")
    p.add_argument("--again", action="store_true",
                   help="keep the step's earlier runs: its record becomes the run of median speed, with every run in "
                        "`runs` (alternate the two sides' steps: this machine's memory bandwidth drifts by 20%% within "
                        "minutes)")
    p.add_argument("--model-dir", type=Path,
                   help="the random checkpoint (default /tmp/<version>-peer[-2l]); GGML and GGUF files go beside it")
    p.add_argument("--out", type=Path,
                   help="results folder (default bench/results; --quick: /tmp/<version>-peer-quick)")
    p.add_argument("--child", choices=["convert", "cpp", "toolkit", "batch"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ggml", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(BITS), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--frame", type=json.loads, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"convert": child_convert, "cpp": child_cpp, "toolkit": child_toolkit,
                          "batch": child_batch}[args.child](args)))
        return
    if args.step is None:
        p.error("pass --step (one of: " + ", ".join(STEPS) + ", clean), or --step all")
    bench = Bench(args)
    for step in (STEPS if args.step == "all" else [args.step]):
        bench.run(step)


if __name__ == "__main__":
    main()
