"""The commands the crash test kills, as a user runs them on the README's tiny model: each one's command line, the
same command run again after a kill (with `--resume` where it has one), and what of its output must equal an
uninterrupted run's. serve.py is driven by a client: it starts, answers a few greedy completions, and stops on
SIGTERM; its output is the answers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 300  # a command (or a wait) past this is a hang: every run here takes seconds
TEXTS = ["故障现象：发动机水温高，风扇始终是低速转动。", "制动钳异响，刹车时方向盘抖动。", "空调不制冷，压缩机不工作。"]


@dataclass(frozen=True)
class Inputs:
    """What every command reads: the train / dev files and a trained tiny run (made once by `prepare`)."""

    train: Path
    dev: Path
    run: Path


def prepare(folder: Path, train_records: int = 32, dev_records: int = 6) -> Inputs:
    """A small SPO train / dev set cut from the shipped one; the tiny run is the train command's (`trained`)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = (ROOT / "data" / "spo_train.jsonl").read_text(encoding="utf-8").splitlines()
    inputs = Inputs(folder / "train.jsonl", folder / "dev.jsonl", folder / "run")
    inputs.train.write_text("\n".join(lines[:train_records]) + "\n", encoding="utf-8")
    inputs.dev.write_text("\n".join(lines[train_records:train_records + dev_records]) + "\n", encoding="utf-8")
    return inputs


def trained(inputs: Inputs, train_work: Path) -> Inputs:
    """`inputs` whose run is the one an uninterrupted train command wrote in `train_work`."""
    return Inputs(inputs.train, inputs.dev, train_work / "run")


def quiet_env(**extra: str) -> dict:
    """This environment with one thread, offline, and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def train_args(inputs: Inputs, out: Path) -> list[str]:
    return ["--model", "tiny", "--tuning", "full", "--train-file", str(inputs.train), "--dev-file", str(inputs.dev),
            "--output-dir", str(out), "--max-steps", "6", "--eval-every", "2", "--batch-size", "8", "--log-every", "1",
            "--max-src-len", "64", "--max-len", "96", "--threads", "1"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def files_of(folder: Path, skip=()) -> dict:
    """{relative path: content digest} of the files under `folder` (absent: {})."""
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name not in skip}


def without_timing(entries: list[dict]) -> list[dict]:
    """Log entries without the fields that differ between any two runs: wall-clock ones, the output's path."""
    def drop(value):
        if isinstance(value, dict):
            return {k: drop(v) for k, v in value.items() if k not in ("seconds", "this_run", "output")}
        return value
    return [drop(e) for e in entries]


@dataclass(frozen=True)
class Command:
    """One command: `first(work)` its argv, `again(work)` the argv that finishes it after a kill, `output(work)` what
    must equal an uninterrupted run's, `moments` the crash points it passes (`chatglm_tune.runtime.crashpoints`)."""

    name: str
    first: object
    again: object
    output: object
    builds_kernel: bool = True


def script(name: str, *args) -> list[str]:
    return [sys.executable, str(ROOT / name), *map(str, args)]


def commands(inputs: Inputs) -> dict[str, Command]:
    def train(work, *more):
        return script("train.py", *train_args(inputs, work / "run"), *more)

    def train_output(work):
        run = work / "run"
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        flags = yaml.safe_load((run / "run.yaml").read_text(encoding="utf-8"))
        return {"weights": files_of(run, skip=("metrics.jsonl", "loss_curve.png", "progress.json", "data_report.json",
                                               "run.yaml")),
                "flags": {k: v for k, v in flags.items() if k != "output-dir"},  # each run writes into its own
                "metrics": without_timing(metrics),
                "progress": json.loads((run / "state" / "progress.json").read_text())}

    def infer(work, *more):
        return script("infer.py", "--model", inputs.run, "--input", inputs.dev, "--output", work / "pred.jsonl",
                      "--batch-size", 2, "--threads", 1, *more)

    def infer_output(work):
        summary = json.loads((work / "pred.jsonl.summary.json").read_text())
        return {"rows": (work / "pred.jsonl").read_text(encoding="utf-8"), "summary": without_timing([summary])}

    quantize = lambda work: script("quantize.py", "--bits", 4, inputs.run, work / "q4")  # noqa: E731
    export = lambda work: script("export.py", inputs.run, work / "ggml", "--format", "ggml", "--type", "q4_0",  # noqa: E731
                                 "--threads", 1)
    return {
        "train": Command("train", lambda w: train(w), lambda w: train(w, "--resume", "auto"), train_output),
        "infer": Command("infer", lambda w: infer(w), lambda w: infer(w, "--resume"), infer_output),
        "quantize": Command("quantize", quantize, quantize, lambda w: files_of(w / "q4"), builds_kernel=False),
        "export": Command("export", export, export, lambda w: files_of(w / "ggml"), builds_kernel=False),
        "serve": Command("serve", lambda w: serve_argv(inputs, w), lambda w: serve_argv(inputs, w),
                         lambda w: json.loads((w / "answers.json").read_text(encoding="utf-8"))),
    }


# --------------------------------------------------------------------------------------------------------------------
# serve.py, driven by a client


def serve_argv(inputs: Inputs, work: Path) -> list[str]:
    """A client process (this module run as a script) that starts serve.py as its child and writes the answers."""
    return [sys.executable, str(Path(__file__)), "--serve", str(inputs.run), str(work / "answers.json")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_S) as response:
        return json.loads(response.read())


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=HANG_S) as response:
            return json.loads(response.read())["status"] == "ok"
    except (urllib.error.URLError, ConnectionError):
        return False


def drive_serve(run: Path, answers: Path) -> int:
    """serve.py on `run` in this process group: greedy completions of TEXTS, then SIGTERM; the answers written (atomic)
    where the server ran to its clean end. A signal that reaches the group ends both, as Ctrl-C in a terminal does."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(script("serve.py", "--model", run, "--port", port, "--threads", 1), cwd=ROOT,
                              env=quiet_env())
    deadline = time.monotonic() + HANG_S
    while not _healthy(base):
        if server.poll() is not None:
            return server.returncode or 1
        if time.monotonic() > deadline:
            server.kill()
            return server.wait() or 1
        time.sleep(0.05)
    try:
        got = [_post(base, "/v1/completions", {"prompt": t, "max_tokens": 8, "temperature": 0})["choices"][0]["text"]
               for t in TEXTS]
    except (urllib.error.URLError, ConnectionError):
        return server.wait(HANG_S) or 1
    server.send_signal(signal.SIGTERM)
    if server.wait(HANG_S) not in (0, -signal.SIGTERM):  # uvicorn ends by the signal it stopped on, once it has
        return server.returncode or 1
    tmp = answers.with_name(answers.name + ".tmp")
    tmp.write_text(json.dumps(got, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, answers)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    sys.exit(drive_serve(Path(sys.argv[2]), Path(sys.argv[3])))
