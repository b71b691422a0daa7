"""Benchmark: serve.py under concurrent OpenAI clients: the continuous-batching server (--max-batch 32) and the
same server one request at a time (--max-batch 1, as the official ChatGLM demos and chatglm.cpp serve), side
by side in one run; then a soak test of the batching server (bad inputs, abandoned streams, RSS growth).

    python bench/serve/serve.py                    # random mid GLM-4 (1024 hidden, 8 layers), 1/4/16/32 streams
                                                   #   (~8 min)
    python bench/serve/serve.py --quick            # a small model, 1/4/16 streams, 120-request soak (~1-2 min)
    python bench/serve/serve.py --model DIR --streams 1,16 --requests-per-stream 8 --soak 0
    python bench/serve/serve.py --llama-server PATH  # + llama.cpp's llama-server on the same load (a q4_0 GGUF of it)
    python bench/serve/serve.py --speculative --streams 1,4,16 --no-baseline  # + the batching server, --speculative
    python bench/serve/serve.py --compile --streams 1,16,32 --soak 0   # + the batching server with --compile
    python bench/serve/serve.py --schema --streams 1,16 --no-baseline --soak 0  # chats plain and under a JSON schema
    python bench/serve/serve.py --device cuda --compile --streams 1,16,64 --max-batch 64 --soak 0  # on a GPU
    python bench/serve/serve.py --full-size        # ChatGLM3-6B at full size, INT4 (bench/peer/peer.py writes it; long)

The random model (built when --model is not given) has its output head zeroed for tokens that render no text
alone (special tokens, byte pieces of a character): its greedy answers are printable and never stop, so every
token is a stream chunk and TTFT times the first token, not the first whole character.

Servers: each a fresh `python serve.py --model DIR --threads T --max-batch N` (OMP_NUM_THREADS=T) on a free
loopback port, ready when GET /health answers, warmed up by two short requests, stopped with SIGTERM (killed
if still there 15 s later). The model: `--model DIR`, or a random one built once into /tmp
(bench/serve/serve_children.py build: `registry.VERSIONS[v].tiny(...)` with the --size fields, its tokenizer trained on
data/spo_dev.jsonl).

Load: S concurrent streams (threads, one `openai.OpenAI` client each, max_retries 0), each sending
--requests-per-stream requests one after another, every one streamed with stream_options.include_usage,
temperature 0, no stop strings. The mix (request k of the run): even k a completion whose prompt is an
SPO text of data/spo_dev.jsonl (the run's extraction prompt around it), odd k a chat message asking to
extract from such a text; max_tokens cycles through --max-tokens (16/32/64). A random model seldom
samples a stop id, so answers mostly run to max_tokens; tokens are counted from the usage chunk.
Per configuration:
- tok/s: completion tokens of all requests / wall time from the first request sent to the last answered
  (prefills included; the tail where fewer streams are left included). req/s the same for requests.
- TTFT: request sent -> first chunk carrying text (the chat role chunk does not count): the prefill, and for
  ChatGLM-6B one decode step more (its post-processing looks one character ahead, so a stream holds the last
  character until the next token: `PromptFormat.stream_lookahead`). Every stream sends its first request at the same
  moment: the p95 "later" leaves those out (steady state, where requests arrive as others finish).
- ITL: the gaps between consecutive text chunks of a request, pooled over all requests (chunks/token says
  how often tokens came without a chunk of their own: an incomplete UTF-8 character held, a random model's
  special token that renders as nothing). TPOT, per request: (last text chunk - first) / (tokens - 1), the
  decode time per token that client sees, whatever the chunking.
- steps/s: decode steps of the engine (GET /health "steps", before and after) / wall; rows/step: decode
  tokens (completion tokens - requests, the first token of each coming from its prefill) / steps.
- CPU: the server's user+system CPU seconds (/proc/PID/stat) / wall, in % of one core; the bench's own
  (the clients share the same cores) likewise; and other processes' (the machine's busy time in
  /proc/stat less these two): over ~20% of a core, others disturbed the figures (the 2-thread OpenMP
  kernels wait for a descheduled thread at every barrier: steps can take 10x longer).
- RSS: the server's VmHWM (its peak so far, /proc/PID/status) after the configuration, and the highest
  VmRSS sampled every 0.25 s during it.
What limits each figure: `floor` (bench/serve/serve_children.py floor) times the model alone, as serve.py loads it
(`generation.generate` at batch 1/4/16/32, no HTTP, no scheduler; a forward over 64-token prompts for the
prefill cost per token), and `ceilings` measures the cores: copy bandwidth, the read rate of float32 GEMVs
over weights read from memory, GEMM GFLOP/s at 1/16/32/512 rows. Each configuration's wall time is put
against (a) what the model alone needs for the same work (its prompt tokens, and its decode steps at its
rows per step): the rest is the server's (HTTP, event loop, scheduling, cache copies); (b) two floors of
the cores, the larger naming the bound: the weights read once per decode step (bandwidth; batch 1) and
2 x params x (prompt + completion tokens) of arithmetic at the GEMM peak (large batches). The speedup
target line also gives the ratio the model alone allows for the same work.

Targets (PASS/MISS): at 16 streams the batching server's tok/s >= 6x the --max-batch 1 server's; its TTFT
p95 at 16 streams <= 3x its TTFT p95 at 1 stream.

Soak (--soak N, 0 = off; batching server only, after the table, bounded by --soak-time-limit): --soak-clients
threads send N short requests (max_tokens 4-8) with `requests`: 10% bad (temperature -1, an unknown model,
empty messages, max_tokens 0, a body that is not JSON: each must get HTTP 400 with OpenAI's error JSON), 10%
streams abandoned after their first chunk (the response closed), the rest good, half streamed. Checks: every
good request answered once and whole (200; one finish_reason; streams end `data: [DONE]` with a usage
chunk; completion tokens = max_tokens, or fewer with finish_reason "stop"), every bad one 400, /health
answers at the end with nothing running or waiting, no traceback in the server's log, and the server's
VmRSS after all requests within 10% of its VmRSS after the first 100.

llama.cpp's own server (optional: a `llama-server` binary, --llama-server / $LLAMA_SERVER / PATH; built from the
llama.cpp sources inside llama-cpp-python's source package, LLAMA_SERVER_BUILD below) gets the same load after
serve.py's: the served checkpoint exported by export.py (--type q4_0 unless --gguf; serve.py then runs with
--server-arg --quantization-bit 4 --quantize-embedding for the same class of weights), `llama-server --threads T
--threads-batch T --parallel S --ctx-size S x C` with S the most streams and C the load's longest prompt +
max_tokens + 16 (its whole KV cache is allocated at start; serve.py's grows with the rows), its defaults
otherwise (continuous batching, flash attention). Its completions are sent the ids serve.py builds for the same
text (`serve_children.py prompts`: the run's prompt format around the text; the usage chunks' prompt tokens
match), its chats the same messages (the GGUF's chat template renders the official prompt), with `ignore_eos`
so that its answers run to max_tokens. Targets at 16 streams: serve.py's tok/s >= llama-server's (aim 1.5x),
TTFT p95 no worse, peak RSS lower. Without a binary the run says it was skipped and why. Results:
bench/results/serve.json (--quick: /tmp/serve-quick.json; --full-size: bench/results/serve-full.json) and a .md beside
it; the last stdout line is one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.<room>.<module> (this process imports no torch)

from bench.common.measure import RESULTS, run_python  # noqa: E402
from bench.peer.peer_llama import export_args, gguf_path  # noqa: E402
from bench.serve.serve_children import RECIPE  # noqa: E402  (stdlib only at import)
from bench.serve.serve_load import SCHEMA, dev_texts, run_config, warm_up, workload  # noqa: E402
from bench.serve.serve_report import (HEADER, limits, markdown, reachable_speedup, table_row,  # noqa: E402
                                      targets, tok_s_ratios)
from bench.serve.serve_servers import (LLAMA_SERVER_BUILD, MB, ROOT, Server, busy_cpu_seconds,  # noqa: E402
                                       find_llama_server, llama_server, self_cpu_seconds, toolkit_server)
from bench.serve.serve_soak import soak  # noqa: E402

OTHERS_LIMIT_PCT = 20.0  # CPU (% of one core) other processes may take during a measurement before it is flagged
FULL_DIR = Path("/tmp/chatglm3-peer")  # where `bench/peer/peer.py --version chatglm3 --step write` puts ChatGLM3-6B


def child_json(what: str, *args) -> dict:
    return run_python(HERE / "serve_children.py", what, *map(str, args)).last_json()


def quiet_child_json(what: str, *args, tries: int = 3) -> dict:
    """`child_json`, with the CPU other processes took meanwhile (`others_cpu_pct`, % of a core); run again (up to
    `tries` in all) while that is over OTHERS_LIMIT_PCT, keeping the least disturbed run."""
    best = None
    for _ in range(tries):
        busy0, mine0, start = busy_cpu_seconds(), self_cpu_seconds(), time.perf_counter()
        out = child_json(what, *args)
        wall = time.perf_counter() - start
        out["others_cpu_pct"] = round(max(0.0,
                                          100 * (busy_cpu_seconds() - busy0 - (self_cpu_seconds() - mine0)) / wall), 1)
        if best is None or out["others_cpu_pct"] < best["others_cpu_pct"]:
            best = out
        if best["others_cpu_pct"] <= OTHERS_LIMIT_PCT:
            break
        print(f"{what}: other processes took {out['others_cpu_pct']:.0f}% of a core meanwhile; measuring again",
              flush=True)
    return best


def prepare_model(args) -> tuple[Path, dict]:
    """The model directory and what is known of it."""
    if args.full_size:
        directory = args.full_size_dir
        if not (directory / "config.json").exists():
            print(f"writing ChatGLM3-6B random fp16 shards to {directory} (bench/peer/peer.py --version chatglm3 "
                  "--step write)",
                  flush=True)
            subprocess.run([sys.executable, str(HERE.parent / "peer" / "peer.py"), "--version", "chatglm3",
                            "--step", "write", "--model-dir", str(directory)], cwd=ROOT, check=True)
        return directory, {"version": "chatglm3", "size": "full (6B), INT4", "dir": str(directory)}
    if args.model:
        return args.model, {"dir": str(args.model)}
    directory = Path(tempfile.gettempdir()) / f"chatglm_tune-serve-bench-{args.version}-{args.size}"
    info_file = directory / "bench_model.json"
    if info_file.exists():
        info = json.loads(info_file.read_text())
        if info.get("recipe") == RECIPE:
            return directory, info
        shutil.rmtree(directory)
    print(f"building a random {args.version} {args.size} model in {directory}", flush=True)
    info = child_json("build", "--version", args.version, "--size", args.size, "--model-dir", directory)
    info_file.write_text(json.dumps(info))
    return directory, info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path,
                   help="a model directory to serve (default: a random --version --size model, built once "
                                               "into /tmp)")
    p.add_argument("--version", default="glm4", choices=("glm4", "chatglm3"),
                   help="random model's version (default %(default)s)")
    p.add_argument("--size", choices=("mid", "small", "6b"),
                   help="random model's size (default mid; --quick: small; 6b: "
                   "ChatGLM3-6B's blocks, for a GPU)")
    p.add_argument("--streams", help="concurrent streams per configuration (default 1,4,16,32; --quick 1,4,16; "
                                     "--full-size 1,4,8)")
    p.add_argument("--requests-per-stream", type=int,
                   help="requests each stream sends (default 3: one of each of 16/32/64 tokens; --quick 3; --full-size "
                        "2)")
    p.add_argument("--max-tokens", help="max_tokens of the requests, in turn (default 16,32,64; --full-size 16,32)")
    p.add_argument("--threads", type=int, default=2,
                   help="server threads (--threads and OMP_NUM_THREADS; default %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="the batching server's --max-batch (default %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the --max-batch 1 server")
    p.add_argument("--speculative", action="store_true", help="also the batching server with --speculative (every "
                   "request is greedy, temperature 0): its rows are `batchN-spec`, its tok/s over the plain one's "
                   "`speculative_vs_plain`")
    p.add_argument("--schema", action="store_true", help="also, on the batching server, every stream count with chats "
                   "only, plain and under a JSON schema (response_format: constrained decoding): rows `batchN-chat` "
                   "and `batchN-schema`, tok/s of the second over the first `schema_vs_plain`")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else on "
                                                     "PATH); without one its side is skipped")
    p.add_argument("--gguf", type=Path,
                   help="llama-server's GGUF of the served model (default: export.py --type q4_0 of it, "
                                             "written once beside the checkpoint)")
    p.add_argument("--soak", type=int, help="soak requests after the table, 0 = none (default 1000; --quick 120; "
                                            "--full-size 0)")
    p.add_argument("--soak-clients", type=int, default=16, help="concurrent soak clients (default %(default)s)")
    p.add_argument("--soak-time-limit", type=float, default=300.0,
                   help="seconds the soak may send for (default %(default)s)")
    p.add_argument("--no-floor", action="store_true", help="skip timing the model alone and the cores' ceilings")
    p.add_argument("--quick", action="store_true",
                   help="a ~1-2 minute smoke run: small model, fewer streams and requests")
    p.add_argument("--full-size", action="store_true",
                   help="ChatGLM3-6B at full size, INT4 (+INT8 embedding): written by "
                                                           f"bench/peer/peer.py into {FULL_DIR} when absent (12 GB); "
                                                           "long")
    p.add_argument("--full-size-dir", type=Path, default=FULL_DIR,
                   help="--full-size: the checkpoint (default %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also the batching server with --compile (compiled steps on a "
                   "slot cache: CUDA graphs on a GPU)")
    p.add_argument("--device", help="the servers' --device (cpu, cuda; default serve.py's own); a GPU's runs skip the "
                   "CPU floors (--no-floor)")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve.py argument (repeatable)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to start (default %(default)s)")
    p.add_argument("--out", type=Path,
                   help="results JSON (default bench/results/serve.json; --quick /tmp/serve-quick.json; "
                                            "--full-size bench/results/serve-full.json)")
    args = p.parse_args(argv)
    preset = "quick" if args.quick else "full" if args.full_size else "default"
    defaults = {"default": ("mid", "1,4,16,32", 3, "16,32,64", 1000),
                "quick": ("small", "1,4,16", 3, "16,32,64", 120),
                "full": ("mid", "1,4,8", 2, "16,32", 0)}[preset]
    args.size = args.size or defaults[0]
    args.streams = [int(s) for s in (args.streams or defaults[1]).split(",")]
    args.requests_per_stream = args.requests_per_stream or defaults[2]
    args.max_tokens = [int(t) for t in (args.max_tokens or defaults[3]).split(",")]
    args.soak = defaults[4] if args.soak is None else args.soak
    args.out = args.out or {"default": RESULTS / "serve.json", "quick": Path("/tmp/serve-quick.json"),
                            "full": RESULTS / "serve-full.json"}[preset]
    if args.full_size:
        args.server_arg = ["--quantization-bit", "4", "--quantize-embedding", *args.server_arg]
    if args.device:
        args.server_arg = ["--device", args.device, *args.server_arg]
        args.no_floor = args.no_floor or args.device != "cpu"
    return args


def measure_floors(args, model_dir: Path, info: dict) -> tuple[dict | None, dict | None]:
    """(the model alone, the cores' ceilings), None where not measured; the model's size goes into `info`."""
    if args.no_floor:
        return None, None
    ceil = quiet_child_json("ceilings", "--threads", args.threads)
    print(f"cores: {json.dumps(ceil)}", flush=True)
    if args.full_size:
        return None, ceil
    floor = quiet_child_json("floor", "--model-dir", model_dir, "--threads", args.threads,
                             "--batches", ",".join(map(str, sorted({1, *args.streams}))))
    print(f"model alone: {json.dumps(floor)}", flush=True)
    info.setdefault("params", floor["params"])
    info.setdefault("weight_bytes", floor["weight_bytes"])
    return floor, ceil


def run_streams(server: Server, args, texts: list[str], rows: list[dict], schema: bool = False) -> None:
    """Warm `server` up, then one row for each stream count (printed, appended to `rows`); with `schema`, two more:
    chats only, plain (`-chat`) and under `SCHEMA` (`-schema`)."""
    warm_up(server, texts, schema)
    for streams in args.streams:
        loads = [("", {})] + ([("-chat", {"chats": True}), ("-schema", {"chats": True, "response_format": SCHEMA})]
                              if schema else [])
        for suffix, kind in loads:
            load = workload(streams, args.requests_per_stream, args.max_tokens, texts, **kind)
            row = run_config(server, streams, load)
            row["server"] += suffix
            rows.append(row)
            print(table_row(row), flush=True)


def run_toolkit_servers(args, model_dir: Path, texts: list[str], log_dir: Path, rows: list[dict],
                        servers_info: dict) -> dict | None:
    """The batching server, then the one-at-a-time one (unless --no-baseline); the soak on the batching one.
    Returns the soak's result (None without one)."""
    servers = [(f"batch{args.max_batch}", args.max_batch, [])] + ([] if args.no_baseline else [("batch1", 1, [])])
    servers += [(f"batch{args.max_batch}-spec", args.max_batch, ["--speculative"])] if args.speculative else []
    servers += [(f"batch{args.max_batch}-compiled", args.max_batch, ["--compile"])] if args.compile else []
    soak_result = None
    for name, max_batch, extra in servers:
        server = toolkit_server(name, model_dir, args.threads, max_batch, [*args.server_arg, *extra], log_dir)
        load_s = server.start(args.start_timeout)
        try:
            run_streams(server, args, texts, rows, schema=args.schema and name == servers[0][0])
            if name == servers[0][0] and args.soak:
                soak_result = soak(server, args.soak, args.soak_clients, args.soak_time_limit, texts)
            servers_info[name] = {"load_s": round(load_s, 1), "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB),
                                  "tracebacks_in_log": server.tracebacks(), "log": str(server.log)}
        finally:
            servers_info.setdefault(name, {})["stop"] = server.stop()
    return soak_result


def gguf_for(args, model_dir: Path) -> Path:
    """--gguf, else the served checkpoint exported at q4_0 (export.py; once, kept beside the checkpoint)."""
    if args.gguf:
        return args.gguf
    path = gguf_path(model_dir, "q4_0")
    if not path.exists():
        print(f"exporting {model_dir} to {path} for llama-server (export.py --type q4_0)", flush=True)
        subprocess.run([sys.executable, *map(str, export_args(model_dir, "q4_0"))], cwd=ROOT, check=True)
    return path


def run_llama_server(args, model_dir: Path, texts: list[str], log_dir: Path, rows: list[dict], servers_info: dict,
                     skipped: dict) -> None:
    """llama.cpp's own server on the model's GGUF under the same load, or why it was skipped (into `skipped`)."""
    binary = find_llama_server(args.llama_server)
    if binary is None:
        skipped["llama-server"] = ("no llama-server binary (--llama-server PATH or $LLAMA_SERVER; build: "
                                   f"{LLAMA_SERVER_BUILD})")
        print(f"llama-server skipped: {skipped['llama-server']}", flush=True)
        return
    gguf = gguf_for(args, model_dir)
    prompts = child_json("prompts", "--model-dir", model_dir)
    slot_context = prompts["longest"] + max(args.max_tokens) + 16
    server = llama_server(binary, gguf, args.threads, max(args.streams), slot_context, log_dir,
                          prompt_of=prompts["completion_ids"].__getitem__)
    load_s = server.start(args.start_timeout)
    try:
        run_streams(server, args, texts, rows)
        servers_info["llama-server"] = {"load_s": round(load_s, 1),
                                        "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB), "binary": str(binary),
                                        "gguf": str(gguf), "gguf_mb": round(gguf.stat().st_size / MB),
                                        "slots": max(args.streams), "slot_context": slot_context, "command": server.cmd}
    finally:
        servers_info.setdefault("llama-server", {})["stop"] = server.stop()


def checked_targets(rows: list[dict], floor: dict | None, batch_name: str) -> dict:
    """The targets; the speedup one with the ratio the model alone allows for the same work."""
    got = targets(rows, batch_name, "batch1", floor)
    reachable = reachable_speedup(rows, floor, batch_name)
    if reachable and "speedup_at_16" in got:
        got["speedup_at_16"]["model_alone"] = reachable
        got["speedup_at_16"]["text"] += (f"; the model alone allows {reachable['ratio']:.2f}x for this work "
                                         f"({reachable['one_at_a_time_s']:.1f} s one at a time / "
                                         f"{reachable['batched_s']:.1f} s at the batching run's rows per step)")
    return got


def print_findings(got: dict, limit_lines: list[str], soak_result: dict | None) -> None:
    print()
    for t in got.values():
        print(f"{'PASS' if t['pass'] else 'MISS'}: {t['text']}")
    if limit_lines:
        print("\nwhat limits each figure:")
        for line in limit_lines:
            print("  " + line)
    if soak_result:
        s = soak_result
        print(f"\nsoak: {s['sent']}/{s['requests']} requests in {s['wall_s']} s, {s['by_category']}, failures "
              f"{s['failures']}, RSS {s['rss_after_first_mb']} -> {s['rss_end_mb']} MB ({s['rss_growth_pct']}%): "
              f"{'PASS' if s['passed'] else 'FAIL'}")
        for k, v in s["checks"].items():
            print(f"  {'ok    ' if v else 'FAILED'} {k}")
        for f in s["failure_examples"]:
            print(f"  failure: {f}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    began = time.perf_counter()
    texts = dev_texts()
    model_dir, info = prepare_model(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"model: {model_dir} {json.dumps(info)}; server logs in {log_dir}", flush=True)
    floor, ceil = measure_floors(args, model_dir, info)
    rows, servers_info, skipped = [], {}, {}
    print(HEADER, flush=True)
    soak_result = run_toolkit_servers(args, model_dir, texts, log_dir, rows, servers_info)
    run_llama_server(args, model_dir, texts, log_dir, rows, servers_info, skipped)
    got = checked_targets(rows, floor, f"batch{args.max_batch}")
    limit_lines = limits(rows, floor, ceil, info.get("weight_bytes", 0), info.get("params", 0))
    print_findings(got, limit_lines, soak_result)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    summary = {"bench": "serve", "quick": args.quick, "full_size": args.full_size, "argv": argv, "model": info,
               "threads": args.threads, "cpu": f"{cpu}, {os.cpu_count()} CPUs", "streams": args.streams,
               "requests_per_stream": args.requests_per_stream, "max_tokens": args.max_tokens, "results": rows,
               "targets": got, "limits": limit_lines, "floor": floor, "ceilings": ceil, "servers": servers_info,
               "skipped": skipped, "soak": soak_result,
               "speculative_vs_plain": tok_s_ratios(rows, args.max_batch),
               "schema_vs_plain": tok_s_ratios(rows, args.max_batch, "-chat", "-schema"),
               "seconds": round(time.perf_counter() - began, 1), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')} ({summary['seconds']:.0f} s in all)")
    print(json.dumps({k: summary[k] for k in ("bench", "quick", "seconds")} | {
        "targets": {k: {"value": v["value"], "pass": v["pass"]} for k, v in got.items()},
        "soak_passed": None if soak_result is None else soak_result["passed"],
        "speculative_vs_plain": summary["speculative_vs_plain"], "schema_vs_plain": summary["schema_vs_plain"],
        "tokens_per_s": {f"{r['server']}@{r['streams']}": r["tokens_per_s"] for r in rows}}))


if __name__ == "__main__":
    main()
