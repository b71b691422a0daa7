"""What the server tests share: a free loopback port, a tiny random model directory, serve.py as a process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from commands import HANG_S, wait_until

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [json.loads(line)["text"]
         for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:40]]


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


# serve.py whose model takes at least SECONDS a forward (`time.sleep` in a forward hook): a slow model, whose long
# answer cannot end within a shutdown grace on any machine.
SLOW_SERVE = """
import runpy, sys, time
from chatglm_tune.runs import loading

def slow(*args, load=loading.load_for_inference, **kwargs):
    model, tokenizer, line = load(*args, **kwargs)
    model.register_forward_pre_hook(lambda module, inputs: time.sleep({seconds}))
    return model, tokenizer, line

loading.load_for_inference = slow
sys.argv = [{serve!r}, *sys.argv[1:]]
runpy.run_path({serve!r}, run_name="__main__")
"""


@contextlib.contextmanager
def serve_py(directory: Path, log_path: Path, *args: str, seconds_a_forward: float | None = None):
    """(process, base URL) of `python serve.py --model directory` on a free port, one thread, once /health answers
    (however long loading takes: HANG_S bounds a hang); its output goes to `log_path`. `seconds_a_forward`: the model
    sleeps that long before each forward (SLOW_SERVE). Afterwards: SIGTERM, waited for until it exits (killed after
    HANG_S)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = str(ROOT / "serve.py")
    program = [serve] if seconds_a_forward is None else ["-c",
                                                         SLOW_SERVE.format(seconds=seconds_a_forward, serve=serve)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *program, "--model", str(directory), "--port", str(port),
                                 "--threads", "1", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        try:
            wait_until(lambda: healthy(base), "serve.py answering /health", alive=lambda: proc.poll() is None)
        except AssertionError as err:
            raise AssertionError(f"{err} (exit code {proc.poll()}):\n{log_path.read_text(errors='replace')}") from None
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(HANG_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def healthy(base: str) -> bool:
    """Whether the server at `base` answers /health with status ok (False while it is not listening yet)."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=HANG_S) as response:
            return json.loads(response.read())["status"] == "ok"
    except (urllib.error.URLError, ConnectionError):
        return False
