"""Benchmark: serve.py under concurrent OpenAI clients: the continuous-batching server (--max-batch 32) and the
same server one request at a time (--max-batch 1, as the official ChatGLM demos and chatglm.cpp serve), side
by side in one run; then a soak test of the batching server (bad inputs, abandoned streams, RSS growth).

    python bench/serve/serve.py                    # random mid GLM-4 (1024 hidden, 8 layers), 1/4/16/32 streams (~8 min)
    python bench/serve/serve.py --quick            # a small model, 1/4/16 streams, 120-request soak (~1-2 min)
    python bench/serve/serve.py --model DIR --streams 1,16 --requests-per-stream 8 --soak 0
    python bench/serve/serve.py --gguf model.gguf  # + llama.cpp's server (`python -m llama_cpp.server`) on the same load
    python bench/serve/serve.py --full-size        # ChatGLM3-6B at full size, INT4 (bench/peer/peer.py writes it; long)

The random model (built when --model is not given) has its output head zeroed for tokens that render no text
alone (special tokens, byte pieces of a character): its greedy answers are printable and never stop, so every
token is a stream chunk and TTFT times the first token, not the first whole character.

Servers: each a fresh `python serve.py --model DIR --threads T --max-batch N` (OMP_NUM_THREADS=T) on a free
loopback port, ready when GET /health answers, warmed up by two short requests, stopped with SIGTERM (killed
if still there 15 s later). The model: `--model DIR`, or a random one built once into /tmp (bench/serve/serve_children.py
build: `registry.VERSIONS[v].tiny(...)` with the --size fields, its tokenizer trained on data/spo_dev.jsonl).

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
  character until the next token: `PromptFormat.stream_lookahead`). Every stream sends its first request at the same moment: the
  p95 "later" leaves those out (steady state, where requests arrive as others finish).
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

llama.cpp (optional): with --gguf PATH and `llama_cpp` importable, `python -m llama_cpp.server --model PATH
--n_threads T` gets the same load (counted by chunks when it sends no usage); otherwise the run says it was
skipped and why. Results: bench/results/serve.json (--quick: /tmp/serve-quick.json; --full-size:
bench/results/serve-full.json) and a .md beside it; the last stdout line is one line of JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # the repository: bench.<room>.<module> (this process imports no torch)

from bench.common.measure import RESULTS, run_python  # noqa: E402
from bench.serve.serve_children import RECIPE  # noqa: E402  (stdlib only at import)

DEV = ROOT / "data" / "spo_dev.jsonl"
MB = 1e6
TARGET_SPEEDUP = 6.0  # tok/s at 16 streams, batching / one at a time
TARGET_TTFT_RATIO = 3.0  # TTFT p95 at 16 streams / at 1 stream, batching server
TARGET_STREAMS = 16
SOAK_RSS_GROWTH = 0.10
OTHERS_LIMIT_PCT = 20.0  # CPU (% of one core) other processes may take during a measurement before it is flagged
OVERHEAD_SHARE = 0.5  # a configuration whose larger floor is under this share of its wall time is overhead-bound
SOAK_RSS_AFTER = 100
SOAK_TEXT_CHARS = 12  # soak prompts: the first characters of a dev text (short requests: prefill stays small)
STOP_GRACE_S = 15.0
LLAMA_INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'
FULL_DIR = Path("/tmp/chatglm3-peer")  # where `bench/peer/peer.py --version chatglm3 --step write` puts ChatGLM3-6B


# ----------------------------------------------------------------------------------------------
# The server processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM of a process, bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    except (FileNotFoundError, ProcessLookupError):
        return {}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all CPUs; /proc/stat: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]) / os.sysconf("SC_CLK_TCK")


def self_cpu_seconds() -> float:
    """This process's CPU seconds and those of its children waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """One server subprocess: started, probed (health, RSS, CPU), stopped."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, health_path: str = "/health"):
        self.name, self.cmd, self.env, self.log, self.health_path = name, cmd, env, log, health_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None

    def start(self, timeout: float) -> float:
        start = time.perf_counter()
        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, **self.env}, stdout=self.log_file,
                                     stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while starting:\n{self.log_tail()}")
            if time.perf_counter() - start > timeout:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer {self.health_path} within {timeout:.0f} s:\n{self.log_tail()}")
            try:
                self.get(self.health_path, timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        self.model_id = self.get("/v1/models")["data"][0]["id"]
        return time.perf_counter() - start

    def get(self, path: str, timeout: float = 10) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return json.loads(r.read())

    def health(self) -> dict | None:
        if self.health_path != "/health":
            return None
        try:
            return self.get("/health")
        except OSError:
            return None

    def wait_idle(self, timeout: float = 30) -> bool:
        """Until nothing runs or waits in the engine (True), or `timeout` seconds (False)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            h = self.health()
            if h is None:
                return self.health_path != "/health"
            if h.get("running") == 0 and h.get("waiting") == 0:
                return True
            time.sleep(0.1)
        return False

    def memory(self) -> dict:
        return proc_status(self.proc.pid)

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid)

    def log_tail(self, n: int = 3000) -> str:
        self.log_file.flush()
        return self.log.read_text(errors="replace")[-n:]

    def tracebacks(self) -> int:
        self.log_file.flush()
        return self.log.read_text(errors="replace").count("Traceback")

    def stop(self) -> dict:
        """SIGTERM, then SIGKILL after STOP_GRACE_S: {"exit_code", "stop_s", "killed"}."""
        if self.proc is None or self.proc.poll() is not None:
            return {"exit_code": None if self.proc is None else self.proc.returncode, "stop_s": 0.0, "killed": False}
        start, killed = time.perf_counter(), False
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            killed = True
        self.log_file.close()
        return {"exit_code": self.proc.returncode, "stop_s": round(time.perf_counter() - start, 2), "killed": killed}


def toolkit_server(name: str, model_dir: Path, threads: int, max_batch: int, extra: list[str], log_dir: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, str(ROOT / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--max-batch", str(max_batch), *extra]
    return Server(name, cmd, {"OMP_NUM_THREADS": str(threads)}, log_dir / f"{name}.log")


def llama_server(gguf: Path, threads: int, log_dir: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_ctx", "2048"]
    return Server("llama.cpp", cmd, {"OMP_NUM_THREADS": str(threads)}, log_dir / "llama_cpp.log", health_path="/v1/models")


class RssSampler:
    """The highest VmRSS of a process, sampled every `every` seconds while in the `with` block."""

    def __init__(self, pid: int, every: float = 0.25):
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status(self.pid).get("VmRSS", 0))
            self._stop.wait(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status(self.pid).get("VmRSS", 0))


# ----------------------------------------------------------------------------------------------
# The load


@dataclass(frozen=True)
class Spec:
    kind: str  # "chat" or "completion"
    text: str
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    gaps: list = field(default_factory=list)
    chunks: int = 0
    finish: str | None = None
    prompt_tokens: int = 0
    usage: bool = False
    error: str | None = None
    last: float | None = None  # request sent -> last text chunk
    first_of_stream: bool = False  # its stream's first request (all streams send theirs at once)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first text: (last text - first text) / (tokens - 1)."""
        if self.ttft is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.ttft) / (self.tokens - 1)


def dev_texts() -> list[str]:
    return [json.loads(line)["text"] for line in DEV.read_text(encoding="utf-8").splitlines()]


def chat_content(text: str) -> str:
    return f"请从下面这段话中抽取实体和它们的关系：{text}"


def workload(streams: int, per_stream: int, mix: list[int], texts: list[str]) -> list[list[Spec]]:
    """Each stream's requests, in order (request k of the run: completion when k is even, chat when odd;
    max_tokens mix[k % len(mix)]; text k % len(texts))."""
    out = []
    for s in range(streams):
        specs = []
        for i in range(per_stream):
            k = s * per_stream + i
            specs.append(Spec("completion" if k % 2 == 0 else "chat", texts[k % len(texts)], mix[k % len(mix)]))
        out.append(specs)
    return out


def openai_client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=1800)


def stream_one(client, model: str, spec: Spec) -> Outcome:
    """One streamed request through the openai client, timed chunk by chunk."""
    kw = dict(model=model, max_tokens=spec.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    out = Outcome(ok=False)
    last = None
    try:
        if spec.kind == "chat":
            stream = client.chat.completions.create(messages=[{"role": "user", "content": chat_content(spec.text)}], **kw)
        else:
            stream = client.completions.create(prompt=spec.text, **kw)
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                if getattr(chunk, "usage", None):
                    out.usage, out.tokens = True, chunk.usage.completion_tokens
                    out.prompt_tokens = chunk.usage.prompt_tokens
                for choice in chunk.choices:
                    text = choice.delta.content if spec.kind == "chat" else choice.text
                    if text:
                        out.chunks += 1
                        if out.ttft is None:
                            out.ttft = now - start
                        else:
                            out.gaps.append(now - last)
                        last = now
                    if choice.finish_reason:
                        out.finish = choice.finish_reason
    except Exception as err:  # the run goes on; the table counts it
        out.error = f"{type(err).__name__}: {err}"[:300]
    out.seconds = time.perf_counter() - start
    out.last = None if last is None else last - start
    if not out.usage:
        out.tokens = out.chunks  # a server without usage chunks (llama.cpp may send none): chunks ~ tokens
    out.ok = out.error is None and out.finish is not None
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


def run_config(server: Server, streams: int, specs: list[list[Spec]]) -> dict:
    """Every stream's requests, concurrently; the configuration's figures."""
    clients = [openai_client(server) for _ in range(streams)]
    server.wait_idle()
    h0, cpu0, self0 = server.health(), server.cpu(), resource.getrusage(resource.RUSAGE_SELF)
    busy0, mine0 = busy_cpu_seconds(), self_cpu_seconds()
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def one_stream(s: int):
        for i, spec in enumerate(specs[s]):
            o = stream_one(clients[s], server.model_id, spec)
            o.first_of_stream = i == 0
            with lock:
                outcomes.append(o)

    with RssSampler(server.proc.pid) as rss:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            list(pool.map(one_stream, range(streams)))
        wall = time.perf_counter() - start
    h1, cpu1, self1 = server.health(), server.cpu(), resource.getrusage(resource.RUSAGE_SELF)
    others = busy_cpu_seconds() - busy0 - (self_cpu_seconds() - mine0) - (cpu1 - cpu0)
    for c in clients:
        c.close()
    good = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in good)
    ttfts = [o.ttft for o in good if o.ttft is not None]
    later = [o.ttft for o in good if o.ttft is not None and not o.first_of_stream]
    gaps = [g for o in good for g in o.gaps]
    tpots = [o.tpot for o in good if o.tpot is not None]
    chunks = sum(o.chunks for o in good)
    row = {"server": server.name, "streams": streams, "requests": len(outcomes), "failed": len(outcomes) - len(good),
           "errors": sorted({o.error for o in outcomes if o.error})[:3], "tokens": tokens,
           "prompt_tokens": sum(o.prompt_tokens for o in good), "wall_s": round(wall, 2),
           "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(good) / wall, 3),
           "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p95_ms": ms(percentile(ttfts, 95)),
           "ttft_p95_later_ms": ms(percentile(later, 95)),
           "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p95_ms": ms(percentile(gaps, 95)),
           "tpot_p50_ms": ms(percentile(tpots, 50)), "tpot_p95_ms": ms(percentile(tpots, 95)),
           "chunks_per_token": round(chunks / tokens, 3) if tokens else None,
           "finish": {f: sum(o.finish == f for o in good) for f in sorted({o.finish for o in good})},
           "server_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1),
           "client_cpu_pct": round(100 * (self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime) / wall, 1),
           "peak_rss_mb": round(rss.peak / MB), "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB),
           "others_cpu_pct": round(max(0.0, 100 * others / wall), 1)}
    if h0 is not None and h1 is not None:
        steps = h1["steps"] - h0["steps"]
        row.update(steps=steps, steps_per_s=round(steps / wall, 2),
                   rows_per_step=round((tokens - len(good)) / steps, 2) if steps else None,
                   ms_per_step=round(1000 * wall / steps, 1) if steps else None)
    return row


def warm_up(server: Server, texts: list[str]) -> None:
    client = openai_client(server)
    for kind in ("completion", "chat"):
        o = stream_one(client, server.model_id, Spec(kind, texts[0], 4))
        if not o.ok:
            raise RuntimeError(f"{server.name}: the warm-up {kind} request failed: {o.error}\n{server.log_tail()}")
    client.close()


# ----------------------------------------------------------------------------------------------
# Soak


BAD_KINDS = ("temperature", "model", "empty_messages", "max_tokens_0", "invalid_json")


@dataclass(frozen=True)
class SoakSpec:
    k: int
    category: str  # "good", "bad", "abandon"
    kind: str  # "chat" / "completion"; for "bad" one of BAD_KINDS
    stream: bool
    max_tokens: int
    text: str


def soak_specs(n: int, texts: list[str], seed: int = 0) -> list[SoakSpec]:
    specs = []
    for k in range(n):
        text = texts[k % len(texts)][:SOAK_TEXT_CHARS]
        max_tokens, kind = 4 + k % 5, ("completion", "chat")[(k // 10) % 2]
        if k % 10 == 0:
            specs.append(SoakSpec(k, "bad", BAD_KINDS[(k // 10) % len(BAD_KINDS)], False, max_tokens, text))
        elif k % 10 == 1:
            specs.append(SoakSpec(k, "abandon", kind, True, max_tokens, text))
        else:
            specs.append(SoakSpec(k, "good", ("completion", "chat")[k % 2], (k // 2) % 2 == 0, max_tokens, text))
    random.Random(seed).shuffle(specs)
    return specs


def soak_body(spec: SoakSpec, model: str) -> tuple[str, bytes]:
    """(path, body) of a soak request."""
    if spec.category == "bad":
        body = {"model": model, "messages": [{"role": "user", "content": chat_content(spec.text)}], "max_tokens": spec.max_tokens}
        if spec.kind == "temperature":
            body["temperature"] = -1
        elif spec.kind == "model":
            body["model"] = "no-such-model"
        elif spec.kind == "empty_messages":
            body["messages"] = []
        elif spec.kind == "max_tokens_0":
            body["max_tokens"] = 0
        else:
            return "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}'  # cut short: not JSON
        return "/v1/chat/completions", json.dumps(body).encode()
    body = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0, "stream": spec.stream}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.kind == "chat":
        body["messages"] = [{"role": "user", "content": chat_content(spec.text)}]
        return "/v1/chat/completions", json.dumps(body, ensure_ascii=False).encode()
    body["prompt"] = spec.text
    return "/v1/completions", json.dumps(body, ensure_ascii=False).encode()


def soak_one(session, base: str, model: str, spec: SoakSpec) -> str | None:
    """Send one soak request; None if it behaved, else what went wrong."""
    path, body = soak_body(spec, model)
    headers = {"Content-Type": "application/json"}
    if spec.category == "bad":
        r = session.post(base + path, data=body, headers=headers, timeout=120)
        try:
            err = r.json().get("error", {})
        except ValueError:
            err = None
        if r.status_code != 400 or not isinstance(err, dict) or not err.get("message"):
            return f"bad/{spec.kind}: HTTP {r.status_code} {r.text[:120]!r} (expected 400 with an error object)"
        return None
    if spec.category == "abandon":
        with session.post(base + path, data=body, headers=headers, timeout=120, stream=True) as r:
            if r.status_code != 200:
                return f"abandon/{spec.kind}: HTTP {r.status_code} {r.text[:120]!r}"
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    break  # the first chunk: hang up (the with block closes the connection)
        return None
    if not spec.stream:
        r = session.post(base + path, data=body, headers=headers, timeout=300)
        if r.status_code != 200:
            return f"good/{spec.kind}: HTTP {r.status_code} {r.text[:160]!r}"
        data = r.json()
        return _check_answer(spec, [data["choices"][0].get("finish_reason")], data.get("usage"), True)
    with session.post(base + path, data=body, headers=headers, timeout=300, stream=True) as r:
        if r.status_code != 200:
            return f"good/{spec.kind}/stream: HTTP {r.status_code} {r.text[:160]!r}"
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return f"good/{spec.kind}/stream: no data: [DONE] at the end ({events[-1:]!r})"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return f"good/{spec.kind}/stream: an error event {[c for c in chunks if 'error' in c][0]}"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return _check_answer(spec, finishes, usage[-1] if len(usage) == 1 else None, len(usage) == 1)


def _check_answer(spec: SoakSpec, finishes: list, usage: dict | None, one_usage: bool) -> str | None:
    what = f"good/{spec.kind}/{'stream' if spec.stream else 'whole'}"
    if len(finishes) != 1 or finishes[0] not in ("length", "stop"):
        return f"{what}: finish_reason {finishes!r} (expected exactly one of length/stop)"
    if usage is None or not one_usage:
        return f"{what}: no (single) usage"
    n = usage["completion_tokens"]
    if not (n == spec.max_tokens and finishes[0] == "length") and not (finishes[0] == "stop" and 1 <= n <= spec.max_tokens):
        return f"{what}: {n} completion tokens with finish_reason {finishes[0]!r}, max_tokens {spec.max_tokens}"
    return None


def soak(server: Server, n: int, clients: int, time_limit: float, texts: list[str]) -> dict:
    import requests

    specs = soak_specs(n, texts)
    queue = list(reversed(specs))
    lock = threading.Lock()
    done = {"count": 0}
    failures: list[str] = []
    counts = {c: 0 for c in ("good", "bad", "abandon")}
    rss_marks: dict[str, int] = {}
    deadline = time.perf_counter() + time_limit
    server.wait_idle()

    def worker():
        session = requests.Session()
        while True:
            with lock:
                if not queue or time.perf_counter() > deadline:
                    return
                spec = queue.pop()
            try:
                problem = soak_one(session, server.base, server.model_id, spec)
            except Exception as err:
                problem = f"{spec.category}/{spec.kind}: {type(err).__name__}: {err}"[:300]
            with lock:
                counts[spec.category] += 1
                done["count"] += 1
                if problem:
                    failures.append(problem)
                if done["count"] == SOAK_RSS_AFTER:
                    rss_marks["after_first"] = server.memory().get("VmRSS", 0)

    cpu0 = server.cpu()
    with RssSampler(server.proc.pid) as rss:
        start = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    idle = server.wait_idle(15)
    health = server.health()
    rss_end = server.memory().get("VmRSS", 0)
    rss_first = rss_marks.get("after_first")
    growth = None if not rss_first else (rss_end - rss_first) / rss_first
    sent = done["count"]
    checks = {
        "every_request_sent": sent == n,
        "good_answered_in_full": not [f for f in failures if f.startswith("good")],
        "bad_got_400": not [f for f in failures if f.startswith("bad")],
        "abandoned_streams_opened": not [f for f in failures if f.startswith("abandon")],
        "health_ok_and_idle_at_end": bool(health and health.get("status") == "ok" and idle),
        "no_traceback_in_server_log": server.tracebacks() == 0,
        f"rss_growth_within_{int(100 * SOAK_RSS_GROWTH)}pct": growth is not None and growth <= SOAK_RSS_GROWTH,
    }
    return {"requests": n, "sent": sent, "time_limit_s": time_limit, "wall_s": round(wall, 1), "clients": clients,
            "by_category": counts, "failures": len(failures), "failure_examples": failures[:8],
            "requests_per_s": round(sent / wall, 2), "server_cpu_pct": round(100 * (server.cpu() - cpu0) / wall, 1),
            "rss_after_first_mb": round((rss_first or 0) / MB), "rss_end_mb": round(rss_end / MB),
            "rss_peak_mb": round(rss.peak / MB), "rss_growth_pct": None if growth is None else round(100 * growth, 2),
            "health_end": health, "checks": checks, "passed": all(checks.values())}


# ----------------------------------------------------------------------------------------------
# What limits the figures


def step_ms(floor: dict, rows: float) -> float:
    """The model alone's ms per decode step at `rows` rows: linear between the batch sizes it was timed at."""
    points = sorted((int(b), v["ms_per_step"]) for b, v in floor["batches"].items())
    if rows <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if rows <= b1:
            return t0 + (t1 - t0) * (rows - b0) / (b1 - b0)
    return points[-1][1] * rows / points[-1][0]


def model_alone_s(floor: dict, row: dict, batching: bool) -> float:
    """Seconds the model alone needs for a configuration's work: its prompt tokens at the measured prefill cost
    per token (4 prompts a forward when batching, else 1) and its decode steps at its rows per step."""
    per_token = floor["prefill_ms_per_token_4x64" if batching else "prefill_ms_per_token_1x64"]
    return (row["prompt_tokens"] * per_token + row["steps"] * step_ms(floor, row["rows_per_step"] or 1)) / 1000


def limits(rows: list[dict], floor: dict | None, ceil: dict | None, weight_bytes: int, params: int) -> list[str]:
    """One line per toolkit row: its wall time against what the model alone needs for the same work (the rest
    is the server's: HTTP, the event loop, scheduling, cache copies), and against two floors of the cores,
    the larger naming the bound: reading the weights once per decode step (steps x weight bytes / the GEMV
    read rate from memory) and the arithmetic (2 x params x (prompt + completion tokens) / the GEMM peak)."""
    if not ceil or not weight_bytes or not params:
        return []
    lines = []
    gemv, peak = ceil["gemv_read_gbs"] * 1e9, ceil["gemm_gflops"]["512"] * 1e9
    for r in rows:
        if not r.get("steps"):
            continue
        rows_step = r["rows_per_step"] or 1
        memory_s = r["steps"] * weight_bytes / gemv
        flops = 2 * params * (r["tokens"] + r["prompt_tokens"])
        compute_s = flops / peak
        bound = "weight reads (memory bandwidth)" if memory_s >= compute_s else "arithmetic (the cores' GEMM rate)"
        floor_s = max(memory_s, compute_s)
        if floor_s < OVERHEAD_SHARE * r["wall_s"]:
            bound = f"neither floor explains half the time (nearer: {bound.split(' (')[0]})"
        r["limit"] = {"memory_floor_s": round(memory_s, 2), "compute_floor_s": round(compute_s, 2), "bound": bound,
                      "of_floor": round(floor_s / r["wall_s"], 2),
                      "weights_gbs": round(r["steps"] * weight_bytes / r["wall_s"] / 1e9, 2),
                      "gflops": round(flops / r["wall_s"] / 1e9, 1)}
        alone = ""
        if floor:
            alone_s = model_alone_s(floor, r, r["server"] != "batch1")
            r["limit"].update(model_alone_s=round(alone_s, 2), model_alone_step_ms=round(step_ms(floor, rows_step), 1),
                              server_share=round(1 - alone_s / r["wall_s"], 2))
            share = 1 - alone_s / r["wall_s"]
            alone = (f"; the model alone needs {alone_s:.1f} s for this work ({step_ms(floor, rows_step):.0f} ms/step at "
                     f"{rows_step:.1f} rows + prefills): the server adds "
                     + (f"{100 * share:.0f}% of the wall" if share >= 0 else "nothing measurable")
                     + (" (the model-alone timing was disturbed: it exceeds the server's wall by over 10%)"
                        if share < -0.1 else ""))
        lines.append(
            f"{r['server']:<8} {r['streams']:>2} streams: wall {r['wall_s']:.1f} s, {r['ms_per_step']:.0f} ms/step at "
            f"{rows_step:.1f} rows{alone}; cores: weights {memory_s:.1f} s ({r['limit']['weights_gbs']:.1f} GB/s of "
            f"{ceil['gemv_read_gbs']}), arithmetic {compute_s:.1f} s ({r['limit']['gflops']:.1f} GFLOP/s of "
            f"{ceil['gemm_gflops']['512']}) -> {bound}; server CPU {r['server_cpu_pct']:.0f}% of a core, "
            f"clients {r['client_cpu_pct']:.0f}%")
    return lines


def reachable_speedup(rows: list[dict], floor: dict | None, batch_name: str) -> dict | None:
    """The tok/s ratio the model alone allows at 16 streams for the same work: the batching row's work at its
    rows per step, against the same work one request at a time (batch-1 steps, one prompt a forward)."""
    b16 = next((r for r in rows if r["server"] == batch_name and r["streams"] == TARGET_STREAMS and r.get("steps")), None)
    if not floor or b16 is None:
        return None
    batched = model_alone_s(floor, b16, True)
    decode_rows = b16["tokens"] - (b16["requests"] - b16["failed"])
    single = (b16["prompt_tokens"] * floor["prefill_ms_per_token_1x64"] + decode_rows * step_ms(floor, 1)) / 1000
    return {"batched_s": round(batched, 2), "one_at_a_time_s": round(single, 2), "ratio": round(single / batched, 2)}


# ----------------------------------------------------------------------------------------------
# Report


HEADER = (f"{'server':<12} {'str':>3} {'req':>4} {'fail':>4} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'req/s':>6} "
          f"{'TTFT50':>7} {'TTFT95':>7} {'ITL50':>6} {'ITL95':>6} {'TPOT50':>6} {'TPOT95':>6} {'steps/s':>7} {'rows/st':>7} "
          f"{'srvCPU':>6} {'cliCPU':>6} {'other':>5} {'RSS MB':>6}")


def fmt(v, spec=""):
    return "-" if v is None else format(v, spec)


def table_row(r: dict) -> str:
    return (f"{r['server']:<12} {r['streams']:>3} {r['requests']:>4} {r['failed']:>4} {r['tokens']:>6} {r['wall_s']:>7.1f} "
            f"{r['tokens_per_s']:>7.1f} {r['requests_per_s']:>6.2f} {fmt(r['ttft_p50_ms'], '.0f'):>7} "
            f"{fmt(r['ttft_p95_ms'], '.0f'):>7} {fmt(r['itl_p50_ms'], '.0f'):>6} {fmt(r['itl_p95_ms'], '.0f'):>6} "
            f"{fmt(r['tpot_p50_ms'], '.0f'):>6} {fmt(r['tpot_p95_ms'], '.0f'):>6} "
            f"{fmt(r.get('steps_per_s'), '.1f'):>7} {fmt(r.get('rows_per_step'), '.1f'):>7} {r['server_cpu_pct']:>6.0f} "
            f"{r['client_cpu_pct']:>6.0f} {r['others_cpu_pct']:>5.0f} {r['peak_rss_mb']:>6}")


def targets(rows: list[dict], batch_name: str, one_name: str, floor: dict | None = None) -> dict:
    def find(server, streams):
        return next((r for r in rows if r["server"] == server and r["streams"] == streams), None)

    out = {}
    b16, o16, b1 = find(batch_name, TARGET_STREAMS), find(one_name, TARGET_STREAMS), find(batch_name, 1)
    if b16 and o16 and o16["tokens_per_s"]:
        ratio = b16["tokens_per_s"] / o16["tokens_per_s"]
        out["speedup_at_16"] = {"value": round(ratio, 2), "target": TARGET_SPEEDUP, "pass": ratio >= TARGET_SPEEDUP,
                                "text": f"tok/s at {TARGET_STREAMS} streams: {b16['tokens_per_s']:.1f} (--max-batch 32) vs "
                                        f"{o16['tokens_per_s']:.1f} (--max-batch 1) = {ratio:.2f}x (target >= {TARGET_SPEEDUP:g}x)"}
    if b16 and b1 and b1["ttft_p95_ms"] and b16["ttft_p95_ms"] is not None:
        ratio = b16["ttft_p95_ms"] / b1["ttft_p95_ms"]
        text = (f"TTFT p95 (--max-batch {b16['server'][5:]}): {b16['ttft_p95_ms']:.0f} ms at {TARGET_STREAMS} streams vs "
                f"{b1['ttft_p95_ms']:.0f} ms at 1 = {ratio:.2f}x (target <= {TARGET_TTFT_RATIO:g}x)")
        entry = {"value": round(ratio, 2), "target": TARGET_TTFT_RATIO, "pass": ratio <= TARGET_TTFT_RATIO}
        if b16.get("ttft_p95_later_ms") is not None:
            later = b16["ttft_p95_later_ms"] / b1["ttft_p95_ms"]
            entry["later_requests"] = round(later, 2)
            text += (f"; without each stream's first request (the {TARGET_STREAMS} sent at once): "
                     f"{b16['ttft_p95_later_ms']:.0f} ms = {later:.2f}x")
        if floor:
            burst_ms = TARGET_STREAMS * b16["prompt_tokens"] / max(1, b16["requests"]) * floor["prefill_ms_per_token_4x64"]
            entry["burst_prefill_ms"] = round(burst_ms)
            text += (f"; prefilling {TARGET_STREAMS} prompts that arrive at once takes the model alone {burst_ms:.0f} ms "
                     f"(= {burst_ms / b1['ttft_p95_ms']:.1f}x the 1-stream p95) before the last one's first token")
        entry["text"] = text
        out["ttft_p95_16_vs_1"] = entry
    return out


def markdown(summary: dict) -> str:
    m = summary["model"]
    size = (f", {m['params'] / 1e6:.0f} M parameters, {m['weight_bytes'] / MB:.0f} MB float32" if m.get("params")
            else "")  # the full-size run times no model alone, which is where these come from
    lines = [f"# serve.py under concurrent OpenAI clients ({'quick' if summary['quick'] else 'full run'})", "",
             f"Generated by `python bench/serve/serve.py {' '.join(summary['argv'])}` (its docstring says what each figure is). "
             f"Model: {m.get('version', '?')} {m.get('size', '')} random weights{size}; {summary['threads']} threads; "
             f"CPU: {summary['cpu']}; {summary['seconds']:.0f} s in all.", "",
             "| server | streams | requests | failed | tokens | wall s | tok/s | req/s | TTFT p50 ms | TTFT p95 ms | TTFT p95 later ms "
             "| ITL p50 ms | ITL p95 ms | TPOT p50 ms | TPOT p95 ms | steps/s | rows/step | server CPU % | client CPU % | others' CPU % "
             "| peak RSS MB |",
             "|" + "---|" * 21]
    for r in summary["results"]:
        lines.append("| " + " | ".join(fmt(v) for v in (
            r["server"], r["streams"], r["requests"], r["failed"], r["tokens"], r["wall_s"], r["tokens_per_s"],
            r["requests_per_s"], r["ttft_p50_ms"], r["ttft_p95_ms"], r["ttft_p95_later_ms"], r["itl_p50_ms"], r["itl_p95_ms"],
            r["tpot_p50_ms"], r["tpot_p95_ms"], r.get("steps_per_s"), r.get("rows_per_step"), r["server_cpu_pct"],
            r["client_cpu_pct"], r["others_cpu_pct"], r["peak_rss_mb"])) + " |")
    lines += ["", "## Targets", ""]
    lines += [f"- {'PASS' if t['pass'] else 'MISS'}: {t['text']}" for t in summary["targets"].values()]
    if summary.get("limits"):
        lines += ["", "## What limits each figure", ""] + [f"- {line}" for line in summary["limits"]]
        if summary.get("floor"):
            fb = summary["floor"]["batches"]
            lines.append("- model alone (`generation.generate`): " + ", ".join(
                f"batch {b}: {v['ms_per_step']} ms/step = {v['tokens_per_s']} tok/s" for b, v in fb.items()))
        if summary.get("ceilings"):
            c = summary["ceilings"]
            lines.append(f"- cores: copy {c['copy_bandwidth_gbs']} GB/s, GEMV read {c['gemv_read_gbs']} GB/s, GEMM GFLOP/s "
                         "by rows " + ", ".join(f"{k}: {v}" for k, v in c["gemm_gflops"].items()))
    for name, note in summary.get("skipped", {}).items():
        lines.append(f"- {name} skipped: {note}")
    s = summary.get("soak")
    if s:
        lines += ["", "## Soak (--max-batch 32)", "",
                  f"{s['sent']}/{s['requests']} requests from {s['clients']} clients in {s['wall_s']} s "
                  f"({s['requests_per_s']} req/s): {s['by_category']}; failures {s['failures']}; RSS after the first "
                  f"{SOAK_RSS_AFTER} {s['rss_after_first_mb']} MB, at the end {s['rss_end_mb']} MB ({s['rss_growth_pct']}%), "
                  f"peak {s['rss_peak_mb']} MB: **{'PASS' if s['passed'] else 'FAIL'}**", ""]
        lines += [f"- {'ok' if v else 'FAILED'}: {k}" for k, v in s["checks"].items()]
        lines += [f"- failure: `{f}`" for f in s["failure_examples"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------


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
        out["others_cpu_pct"] = round(max(0.0, 100 * (busy_cpu_seconds() - busy0 - (self_cpu_seconds() - mine0)) / wall), 1)
        if best is None or out["others_cpu_pct"] < best["others_cpu_pct"]:
            best = out
        if best["others_cpu_pct"] <= OTHERS_LIMIT_PCT:
            break
        print(f"{what}: other processes took {out['others_cpu_pct']:.0f}% of a core meanwhile; measuring again", flush=True)
    return best


def prepare_model(args) -> tuple[Path, dict]:
    """The model directory and what is known of it."""
    if args.full_size:
        directory = args.full_size_dir
        if not (directory / "config.json").exists():
            print(f"writing ChatGLM3-6B random fp16 shards to {directory} (bench/peer/peer.py --version chatglm3 --step write)",
                  flush=True)
            subprocess.run([sys.executable, str(HERE.parent / "peer" / "peer.py"), "--version", "chatglm3", "--step", "write",
                            "--model-dir", str(directory)], cwd=ROOT, check=True)
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
    p.add_argument("--model", type=Path, help="a model directory to serve (default: a random --version --size model, built once "
                                               "into /tmp)")
    p.add_argument("--version", default="glm4", choices=("glm4", "chatglm3"), help="random model's version (default %(default)s)")
    p.add_argument("--size", choices=("mid", "small"), help="random model's size (default mid; --quick: small)")
    p.add_argument("--streams", help="concurrent streams per configuration (default 1,4,16,32; --quick 1,4,16; "
                                     "--full-size 1,4,8)")
    p.add_argument("--requests-per-stream", type=int,
                   help="requests each stream sends (default 3: one of each of 16/32/64 tokens; --quick 3; --full-size 2)")
    p.add_argument("--max-tokens", help="max_tokens of the requests, in turn (default 16,32,64; --full-size 16,32)")
    p.add_argument("--threads", type=int, default=2, help="server threads (--threads and OMP_NUM_THREADS; default %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="the batching server's --max-batch (default %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the --max-batch 1 server")
    p.add_argument("--gguf", type=Path, help="a GGUF of the same model: adds llama.cpp's server (needs llama-cpp-python)")
    p.add_argument("--soak", type=int, help="soak requests after the table, 0 = none (default 1000; --quick 120; "
                                            "--full-size 0)")
    p.add_argument("--soak-clients", type=int, default=16, help="concurrent soak clients (default %(default)s)")
    p.add_argument("--soak-time-limit", type=float, default=300.0, help="seconds the soak may send for (default %(default)s)")
    p.add_argument("--no-floor", action="store_true", help="skip timing the model alone and the cores' ceilings")
    p.add_argument("--quick", action="store_true", help="a ~1-2 minute smoke run: small model, fewer streams and requests")
    p.add_argument("--full-size", action="store_true", help="ChatGLM3-6B at full size, INT4 (+INT8 embedding): written by "
                                                           f"bench/peer/peer.py into {FULL_DIR} when absent (12 GB); long")
    p.add_argument("--full-size-dir", type=Path, default=FULL_DIR, help="--full-size: the checkpoint (default %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve.py argument (repeatable)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start (default %(default)s)")
    p.add_argument("--out", type=Path, help="results JSON (default bench/results/serve.json; --quick /tmp/serve-quick.json; "
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
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    began = time.perf_counter()
    texts = dev_texts()
    model_dir, info = prepare_model(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"model: {model_dir} {json.dumps(info)}; server logs in {log_dir}", flush=True)

    floor = ceil = None
    if not args.no_floor:
        ceil = quiet_child_json("ceilings", "--threads", args.threads)
        print(f"cores: {json.dumps(ceil)}", flush=True)
        if not args.full_size:
            floor = quiet_child_json("floor", "--model-dir", model_dir, "--threads", args.threads,
                               "--batches", ",".join(map(str, sorted({1, *args.streams}))))
            print(f"model alone: {json.dumps(floor)}", flush=True)
            info.setdefault("params", floor["params"])
            info.setdefault("weight_bytes", floor["weight_bytes"])

    servers = [(f"batch{args.max_batch}", args.max_batch)] + ([] if args.no_baseline else [("batch1", 1)])
    rows, servers_info, skipped = [], {}, {}
    soak_result = None
    print(HEADER, flush=True)

    def run_streams(server) -> None:
        """Warm `server` up, then one row for each stream count."""
        warm_up(server, texts)
        for streams in args.streams:
            row = run_config(server, streams, workload(streams, args.requests_per_stream, args.max_tokens, texts))
            rows.append(row)
            print(table_row(row), flush=True)

    for name, max_batch in servers:
        server = toolkit_server(name, model_dir, args.threads, max_batch, args.server_arg, log_dir)
        load_s = server.start(args.start_timeout)
        try:
            run_streams(server)
            if max_batch == args.max_batch and args.soak:
                soak_result = soak(server, args.soak, args.soak_clients, args.soak_time_limit, texts)
            servers_info[name] = {"load_s": round(load_s, 1), "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB),
                                  "tracebacks_in_log": server.tracebacks(), "log": str(server.log)}
        finally:
            servers_info.setdefault(name, {})["stop"] = server.stop()

    llama_ready = importlib.util.find_spec("llama_cpp") is not None
    if args.gguf and llama_ready:
        server = llama_server(args.gguf, args.threads, log_dir)
        load_s = server.start(args.start_timeout)
        try:
            run_streams(server)
            servers_info["llama.cpp"] = {"load_s": round(load_s, 1), "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB)}
        finally:
            servers_info.setdefault("llama.cpp", {})["stop"] = server.stop()
    else:
        why = []
        if not llama_ready:
            why.append(f"llama-cpp-python is not installed ({LLAMA_INSTALL})")
        if not args.gguf:
            why.append("no GGUF given (--gguf PATH; the toolkit has no GGUF export yet)")
        skipped["llama.cpp"] = "; ".join(why)
        print(f"llama.cpp server skipped: {skipped['llama.cpp']}", flush=True)

    got = targets(rows, f"batch{args.max_batch}", "batch1", floor)
    reachable = reachable_speedup(rows, floor, f"batch{args.max_batch}")
    if reachable and "speedup_at_16" in got:
        got["speedup_at_16"]["model_alone"] = reachable
        got["speedup_at_16"]["text"] += (f"; the model alone allows {reachable['ratio']:.2f}x for this work "
                                         f"({reachable['one_at_a_time_s']:.1f} s one at a time / {reachable['batched_s']:.1f} s "
                                         f"at the batching run's rows per step)")
    print()
    for t in got.values():
        print(f"{'PASS' if t['pass'] else 'MISS'}: {t['text']}")
    limit_lines = limits(rows, floor, ceil, info.get("weight_bytes", 0), info.get("params", 0))
    if limit_lines:
        print("\nwhat limits each figure:")
        for line in limit_lines:
            print("  " + line)
    if soak_result:
        s = soak_result
        print(f"\nsoak: {s['sent']}/{s['requests']} requests in {s['wall_s']} s, {s['by_category']}, failures {s['failures']}, "
              f"RSS {s['rss_after_first_mb']} -> {s['rss_end_mb']} MB ({s['rss_growth_pct']}%): "
              f"{'PASS' if s['passed'] else 'FAIL'}")
        for k, v in s["checks"].items():
            print(f"  {'ok    ' if v else 'FAILED'} {k}")
        for f in s["failure_examples"]:
            print(f"  failure: {f}")

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    summary = {"bench": "serve", "quick": args.quick, "full_size": args.full_size, "argv": argv, "model": info,
               "threads": args.threads, "cpu": f"{cpu}, {os.cpu_count()} CPUs", "streams": args.streams,
               "requests_per_stream": args.requests_per_stream, "max_tokens": args.max_tokens, "results": rows,
               "targets": got, "limits": limit_lines, "floor": floor, "ceilings": ceil, "servers": servers_info,
               "skipped": skipped, "soak": soak_result, "seconds": round(time.perf_counter() - began, 1),
               "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')} ({summary['seconds']:.0f} s in all)")
    print(json.dumps({k: summary[k] for k in ("bench", "quick", "seconds")} | {
        "targets": {k: {"value": v["value"], "pass": v["pass"]} for k, v in got.items()},
        "soak_passed": None if soak_result is None else soak_result["passed"],
        "tokens_per_s": {f"{r['server']}@{r['streams']}": r["tokens_per_s"] for r in rows}}))


if __name__ == "__main__":
    main()
