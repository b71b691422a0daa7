"""GLM-4.7-Flash at full size on this machine, the toolkit beside llama.cpp on the same weights: INT4 decode and prefill
speed, load time and peak memory, the engines taking turns.

    python bench/scale/scale.py --version glm47-flash --step write      # the INT4 checkpoint (16 GB, 90 s)
    python bench/peer/flash.py --step gguf                               # the same weights as a q4_0 GGUF
    LLAMA_SERVER=.../llama-server python bench/peer/flash.py --step measure [--threads 1 2]
    LLAMA_SERVER=.../llama-server python bench/peer/flash.py --step load     # as root: drops the page cache

The checkpoint is bench/scale's (random weights in the layout `quantize.py --bits 4` writes: every block Linear and
routed expert per-row INT4, embedding and head fp16; `bench/common/scale_versions.py`). `gguf` writes those weights,
dequantized, through export.py's GGUF writer as llama.cpp's `deepseek2` q4_0 file (its own rule: output.weight
q8_0, routers f32): the same model, each engine in its own 4-bit format. `measure`, per thread count, each engine in a
process of its own on a quiet machine, the two taking turns `--rounds` times (`measure`; this machine's speed drifts
by more than the engines differ over minutes, and a turn-taking run lays that drift on both):
- the toolkit (`from_pretrained(dir, dtype=bf16, quantize_embedding=True)`; `--dtype float32` for fp32 activations:
  INT4 blocks and experts, INT8 embedding and head): load seconds (the page cache warm, as the writer or the previous
  run left it), prefill of 64 and of 512 tokens (seconds to the first new token), decode tokens/s over 32 greedy tokens
  after the 64-token prompt (the median of `DECODE_RUNS` runs), peak RSS;
- llama.cpp's own server (`--ctx-size 1024`, one slot, its defaults): seconds from start to /health (the load), the
  prompt and decode timings its /completion reports for the same prompt ids (`cache_prompt` off), peak RSS sampled.
Prompts are the bench frame's ids (`scale_versions.framed_ids`). `load`: each engine's load alone, one thread, from a
cold page cache (dropped before each) and then a warm one. Prints a table (each measure's median over the rounds) and
the decode ratios (toolkit over llama.cpp, round by round, their median) and ends with one line of JSON;
results in bench/results/peer-glm47-flash.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.measure import peak_rss  # noqa: E402
from bench.common.scale_versions import VERSIONS, frame_json, framed_ids  # noqa: E402

VERSION = VERSIONS["glm47-flash"]
MODEL_DIR = Path(f"/tmp/{VERSION.slug}-random")
GGUF = Path(f"/tmp/{VERSION.slug}-q4_0.gguf")
RESULTS = REPO / "bench" / "results" / "peer-glm47-flash.json"
PROMPTS, NEW_TOKENS, SEED = (64, 512), 32, 0
DECODE_RUNS = 3  # decode measured this many times an engine, the median kept (a shared machine's speed drifts)
ROUNDS = 3  # turns of the two engines a thread count (`measure`)
GB = 1e9


class DequantizedTensors:
    """An INT checkpoint's tensors as export.py's writer reads a float one: each INT `weight` with its `weight_scale`
    dequantized to float32 under the weight's key (the scales themselves not listed), every other tensor as stored."""

    def __init__(self, directory: Path, bits: int):
        from chatglm_tune.export.tensors import CheckpointTensors

        self.source, self.bits = CheckpointTensors(directory), bits
        self.scaled = {key.removesuffix("_scale") for key, _ in self.source.shapes() if key.endswith(".weight_scale")}

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for key, shape in self.source.shapes():
            if key.endswith(".weight_scale"):
                continue
            out.append((key, (shape[0], shape[1] * 8 // self.bits) if key in self.scaled else shape))
        return out

    def get(self, key: str):
        from chatglm_tune.quant.format import dequantize

        import torch

        tensor = self.source.get(key)
        if key not in self.scaled:
            return tensor
        return dequantize(tensor, self.source.get(key + "_scale"), self.bits, torch.float32)

    def __iter__(self):
        return ((key, self.get(key)) for key, _ in self.shapes())


def write_gguf_file() -> dict:
    from chatglm_tune.export.gguf_file import write_gguf
    from chatglm_tune.models.glm.config import glm_config
    from chatglm_tune.models.registry import detect, load_tokenizer

    raw = json.loads((MODEL_DIR / "config.json").read_text())
    config = glm_config(raw, version=detect(raw))
    start = time.perf_counter()
    written = write_gguf(GGUF, config, load_tokenizer(MODEL_DIR),
                         DequantizedTensors(MODEL_DIR, raw["quantization_bit"]), "q4_0",
                         name="GLM-4.7-Flash (random weights)")
    return {**written, "seconds": round(time.perf_counter() - start, 1)}


def child_toolkit(threads: int, dtype: str) -> dict:
    """The toolkit's row, measured in this process (`--child`), activations in `dtype`."""
    import torch

    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.generation import generate

    torch.set_num_threads(threads)
    frame = json.loads(frame_json(VERSION.name, MODEL_DIR))
    start = time.perf_counter()
    model = from_pretrained(MODEL_DIR, dtype=getattr(torch, dtype), quantize_embedding=True)
    out = {"load_s": round(time.perf_counter() - start, 1)}
    warm = framed_ids(frame, 8, 8, SEED + 1)
    generate(model, warm, torch.ones_like(warm), max_new_tokens=2)  # the kernels' layouts, built once
    for length in PROMPTS:
        ids = framed_ids(frame, length, length, SEED)
        start = time.perf_counter()
        generate(model, ids, torch.ones_like(ids), max_new_tokens=1)
        out[f"prefill_{length}_s"] = round(time.perf_counter() - start, 2)
    ids = framed_ids(frame, PROMPTS[0], PROMPTS[0], SEED)
    calls: list[float] = []  # each forward's start: the prompt's, then one a new token
    hook = model.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
    rates = []
    for _ in range(DECODE_RUNS):
        calls.clear()
        generate(model, ids, torch.ones_like(ids), max_new_tokens=NEW_TOKENS, eos_token_id=[])
        rates.append((len(calls) - 1) / (time.perf_counter() - calls[1]))
    hook.remove()
    out["decode_tok_s"] = round(statistics.median(rates), 3)
    out["peak_rss_gb"] = round(peak_rss() / GB, 2)
    return out


def llama_row(binary: Path, threads: int) -> dict:
    """llama-server's row: load, then the same prompts through /completion (timings as it reports them)."""
    from bench.serve.serve_servers import RssSampler

    server = _llama_server(binary, threads)
    frame = json.loads(frame_json(VERSION.name, MODEL_DIR))
    out = {"load_s": round(server.start(timeout=900), 1)}
    try:
        with RssSampler(server.proc.pid) as rss:
            _complete(server, framed_ids(frame, 8, 8, SEED + 1)[0].tolist(), 2)  # warm-up, as the toolkit's
            for length in PROMPTS:
                timings = _complete(server, framed_ids(frame, length, length, SEED)[0].tolist(), 1)
                out[f"prefill_{length}_s"] = round(timings["prompt_ms"] / 1000, 2)
            prompt = framed_ids(frame, PROMPTS[0], PROMPTS[0], SEED)[0].tolist()
            rates = [_complete(server, prompt, NEW_TOKENS)["predicted_per_second"] for _ in range(DECODE_RUNS)]
            out["decode_tok_s"] = round(statistics.median(rates), 3)
        out["peak_rss_gb"] = round(rss.peak / GB, 2)
    finally:
        server.stop()
    return out


def _llama_server(binary: Path, threads: int):
    """llama-server on the GGUF, one slot of 1024 tokens, `threads` threads for prompts and decoding (not started)."""
    from bench.serve.serve_servers import Server, free_port

    cmd = [str(binary), "--model", str(GGUF), "--host", "127.0.0.1", "--port", str(free_port()),
           "--threads", str(threads), "--threads-batch", str(threads), "--parallel", "1", "--ctx-size",
           "1024", "--no-webui"]
    return Server("llama-server", cmd, {}, Path(f"/tmp/{VERSION.slug}-llama-server.log"), engine_stats=False)


def _complete(server, ids: list[int], n: int) -> dict:
    import urllib.request

    body = {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    request = urllib.request.Request(server.base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())["timings"]


def measure(threads: list[int], binary: Path | None, dtype: str, rounds: int) -> dict:
    """Per thread count, `rounds` rounds of the two engines, each in a process of its own, taking turns (toolkit first
    in even rounds, llama.cpp first in odd ones): a drift of the machine's speed over minutes falls on both. Each
    engine's row holds the median of every measure over its rounds (peak RSS: the largest) and the rounds themselves;
    `decode_ratio_<n>t` is the median over the rounds of the toolkit's decode rate over llama.cpp's in that round."""
    runs: dict[str, list[dict]] = {}
    for n in threads:
        for turn in range(rounds):
            engines = ("toolkit", "llama") if turn % 2 == 0 else ("llama", "toolkit")
            for engine in engines:
                if engine == "toolkit":
                    runs.setdefault(f"toolkit_{n}t", []).append(toolkit_row(n, dtype))
                elif binary is not None:
                    runs.setdefault(f"llama_{n}t", []).append(llama_row(binary, n))
    rows = {name: summary(each) for name, each in runs.items()}
    for n in threads:
        if f"llama_{n}t" in runs:
            pairs = zip(runs[f"toolkit_{n}t"], runs[f"llama_{n}t"])
            rows[f"decode_ratio_{n}t"] = round(statistics.median(ours["decode_tok_s"] / theirs["decode_tok_s"]
                                                                 for ours, theirs in pairs), 3)
    return rows


def toolkit_row(threads: int, dtype: str) -> dict:
    child = subprocess.run([sys.executable, __file__, "--child", str(threads), "--dtype", dtype], capture_output=True,
                           text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def summary(each: list[dict]) -> dict:
    """One engine's rounds: the median of each measure (peak RSS the largest), and the rounds as they ran."""
    row = {key: max(r[key] for r in each) if key == "peak_rss_gb" else round(statistics.median(r[key] for r in each), 3)
           for key in each[0]}
    return row | ({"rounds": each} if len(each) > 1 else {})


def child_load() -> dict:
    """Seconds to load the toolkit's model (`--child-load`), nothing else."""
    import torch

    from chatglm_tune import from_pretrained

    torch.set_num_threads(1)
    start = time.perf_counter()
    from_pretrained(MODEL_DIR, dtype=torch.bfloat16, quantize_embedding=True)
    return {"load_s": round(time.perf_counter() - start, 1), "peak_rss_gb": round(peak_rss() / GB, 2)}


def _drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def load_times(binary: Path | None) -> dict:
    """Each engine's load, one thread, from a cold page cache (dropped first: needs root) and then warm."""
    rows = {}
    for cache in ("cold", "warm"):
        if cache == "cold":
            _drop_page_cache()
        child = subprocess.run([sys.executable, __file__, "--child-load"], capture_output=True, text=True, check=True)
        rows[f"toolkit_{cache}"] = json.loads(child.stdout.strip().splitlines()[-1])
        if binary is None:
            continue
        if cache == "cold":
            _drop_page_cache()
        server = _llama_server(binary, 1)
        rows[f"llama_{cache}"] = {"load_s": round(server.start(timeout=1800), 1)}
        server.stop()
    return rows


def table(rows: dict) -> str:
    keys = ("load_s", "prefill_64_s", "prefill_512_s", "decode_tok_s", "peak_rss_gb")
    lines = ["| engine, threads | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for name, row in rows.items()]
    return "\n".join(lines)


def main() -> None:
    from bench.serve.serve_servers import LLAMA_SERVER_BUILD, find_llama_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", choices=("gguf", "measure", "load"))
    p.add_argument("--child-load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the toolkit's activations (default %(default)s; float32 where the CPU lacks bf16 arithmetic)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="turns of the two engines a thread count, medians kept (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (default %(default)s)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.child or args.child_load:
        print(json.dumps(child_toolkit(args.child, args.dtype) if args.child else child_load()))
        return
    if not (MODEL_DIR / "config.json").is_file():
        sys.exit(f"{MODEL_DIR}: no checkpoint; write it first: python bench/scale/scale.py --version glm47-flash "
                 "--step write")
    if args.step == "gguf":
        print(json.dumps(write_gguf_file()))
        return
    binary = find_llama_server()
    if binary is None:
        print(f"no llama-server ($LLAMA_SERVER or on PATH): the toolkit's rows only. {LLAMA_SERVER_BUILD}")
    elif not GGUF.is_file():
        sys.exit(f"{GGUF}: no GGUF; write it first: python bench/peer/flash.py --step gguf")
    earlier = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if args.step == "load":  # kept beside the speed rows of `measure`
        rows = {**{k: v for k, v in earlier.items() if k != "load"}, "load": load_times(binary)}
        print(table(rows["load"]))
    else:
        rows = {**measure(args.threads, binary, args.dtype, args.rounds),
                **({"load": earlier["load"]} if "load" in earlier else {})}
        print(table({k: v for k, v in rows.items() if isinstance(v, dict) and k != "load"}))
        print(", ".join(f"{k} {v}" for k, v in rows.items() if k.startswith("decode_ratio")))
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({"peer-glm47-flash": rows}))


if __name__ == "__main__":
    main()
