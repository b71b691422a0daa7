"""The server processes of bench/serve/serve.py: serve.py (or llama.cpp's server) started on a free loopback port,
probed (GET /health, the process's RSS and CPU from /proc) and stopped; the machine's and this process's CPU time;
a sampler of a process's highest RSS.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MB = 1e6
STOP_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM of a process, bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}
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

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, *, engine_stats: bool = True,
                 prompt_of: Callable[[str], str | list[int]] = lambda text: text, extra_body: dict | None = None):
        """`engine_stats`: GET /health reports the engine's steps and queue (serve.py's; llama-server's does not).
        `prompt_of`: what a completion request sends for an SPO text (serve.py puts the run's prompt around the
        text itself; llama-server is sent those ids). `extra_body`: fields every generating request adds."""
        self.name, self.cmd, self.env, self.log, self.engine_stats = name, cmd, env, log, engine_stats
        self.prompt_of, self.extra_body = prompt_of, extra_body or {}
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
                raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            try:
                self.get("/health", timeout=2)
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
        if not self.engine_stats:
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
                return not self.engine_stats
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
    cmd = [sys.executable, str(ROOT / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch), *extra]
    return Server(name, cmd, {"OMP_NUM_THREADS": str(threads)}, log_dir / f"{name}.log")


# llama-server from the llama.cpp sources that llama-cpp-python's source package carries (no download past PyPI's)
LLAMA_SERVER_BUILD = ("pip download llama-cpp-python --no-binary :all: --no-deps; tar xzf llama_cpp_python-*.tar.gz; "
                      "cmake -S llama_cpp_python-*/vendor/llama.cpp -B llama-build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
                      "-DCMAKE_BUILD_TYPE=Release; cmake --build llama-build --target llama-server -j; "
                      "then --llama-server llama-build/bin/llama-server or LLAMA_SERVER=llama-build/bin/llama-server")


def find_llama_server(explicit: Path | None = None) -> Path | None:
    """`explicit`, else $LLAMA_SERVER, else `llama-server` on PATH; None where there is none."""
    found = explicit or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return Path(found) if found and Path(found).is_file() else None


def llama_server(binary: Path, gguf: Path, threads: int, slots: int, slot_context: int, log_dir: Path,
                 prompt_of: Callable[[str], list[int]]) -> Server:
    """llama.cpp's own C++ server on `gguf`: `slots` parallel sequences (continuous batching, its default) of
    `slot_context` tokens each, `threads` threads for decoding and for prompts, its other settings its defaults
    (flash attention auto: on for a CPU; the chat template and sampling defaults the GGUF carries)."""
    port = free_port()
    cmd = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
           "--threads-batch", str(threads), "--parallel", str(slots), "--ctx-size",
           str(slots * slot_context), "--no-webui"]
    return Server("llama-server", cmd, {}, log_dir / "llama-server.log", engine_stats=False, prompt_of=prompt_of,
                  extra_body={"ignore_eos": True})  # answers run to max_tokens, as the random model's do in serve.py


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
