"""What the server tests share: a free loopback port, a tiny random model directory, serve.py as a process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [json.loads(line)["text"] for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:40]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_model(name: str, directory: Path) -> Path:
    """A random tiny model of version `name` (seed 0) and its tokenizer, trained on TEXTS, saved in `directory`."""
    import torch

    from chatglm_tune.models import registry

    torch.manual_seed(0)
    model, _ = registry.VERSIONS[name].tiny(TEXTS, directory)
    model.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def serve_py(directory: Path, log_path: Path, *args: str, start_timeout: float = 90):
    """(process, base URL) of `python serve.py --model directory` on a free port, one thread, once /health answers;
    its output goes to `log_path`. Afterwards: SIGTERM, killed if still there 15 s later."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--model", str(directory), "--port", str(port),
                                 "--threads", "1", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"serve.py exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if json.loads(response.read())["status"] == "ok":
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"serve.py did not answer /health in {start_timeout:.0f} s:\n"
                                     f"{log_path.read_text(errors='replace')}")
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
