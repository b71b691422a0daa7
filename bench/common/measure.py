"""Measuring for every bench: peak resident set (of a fresh process, or of a window inside this one),
copy bandwidth, the weight bytes a decode step reads, a timer with warm-up and median, and the machine a result
was measured on.

Peak RSS of a child process: `run(cmd)` starts the command from a small stdlib-only interpreter
(about 13 MB) and reports the `ru_maxrss` that `os.wait4` returns for the command: that process's own
peak. Why not the other ways the benches had:
- `os.wait4` called from the bench itself: Linux copies the parent's high-water mark into a child at
  fork / exec, so a child of a bench that already held a model reports the bench's peak (measured here:
  `python -c pass` started by a process that had touched 2 GiB reports 2 GiB). The small interpreter
  in between sets that floor to its own 13 MB.
- `resource.getrusage(RUSAGE_CHILDREN)`: the maximum over every child waited for so far, so every
  child after the first reports the largest before it.
- VmHWM printed by the child itself: right, but only for children that cooperate (not a CLI such as
  `quantize.py`, not a child that stops with `os._exit`).
Peak RSS inside this process: `peak_rss()` is its high-water mark (VmHWM of /proc/self/status, the
same counter as `ru_maxrss`); `PeakRSS()` resets that mark on entry (`/proc/self/clear_refs` "5",
Linux >= 4.0) and reads it on exit: the exact peak of one call, where a thread sampling RSS would
miss short spikes. All sizes are bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the measured commands run there
RESULTS = ROOT / "bench" / "results"  # every bench's results files

# The interpreter between the bench and the measured command: stdlib only, so that its own peak (the
# floor that fork / exec hands to the command) stays about 13 MB.
_SPAWN = (
    "import json, os, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "proc = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "seconds = time.perf_counter() - start\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    json.dump({'peak_rss': usage.ru_maxrss * 1024, 'seconds': seconds}, f)\n"  # Linux: KiB
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


@dataclass
class ChildRun:
    stdout: str
    seconds: float  # wall time of the command, from its start to its exit
    peak_rss: int  # the command's own peak resident set, bytes

    def last_json(self) -> dict:
        """The command's last stdout line, read as JSON (the benches' children end with one)."""
        return json.loads(self.stdout.strip().splitlines()[-1])


def run(cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> ChildRun:
    """Run `cmd` in a fresh process (its output captured) and measure it; raises on a non-zero exit with
    the end of its output. `env` is added to this process's environment."""
    with tempfile.TemporaryDirectory(prefix="bench-measure-") as tmp:
        report = Path(tmp) / "peak.json"
        done = subprocess.run([sys.executable, "-S", "-c", _SPAWN, str(report), *map(str, cmd)], capture_output=True,
                              text=True, cwd=cwd, env=None if env is None else {**os.environ, **env})
        if done.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        measured = json.loads(report.read_text())
    return ChildRun(done.stdout, measured["seconds"], measured["peak_rss"])


def run_python(script: Path | str, *args, env: dict | None = None) -> ChildRun:
    """`run` of a Python script (a path relative to the repository root, or absolute) with this interpreter."""
    return run([sys.executable, str(script), *map(str, args)], env=env)


def peak_rss() -> int:
    """This process's peak resident set so far (since its start or the last `PeakRSS` entry), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def huge_pages_gb() -> float | None:
    """This process's anonymous memory in 2 MB pages (AnonHugePages of /proc/self/smaps_rollup), GB; None off Linux."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def memory_status() -> dict:
    """VmHWM (the peak), VmRSS, RssAnon and RssFile of this process in MB (1e6 bytes): where memory is."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(line.split()[1]) * 1024 / 1e6)
    return out


class PeakRSS:
    """`with PeakRSS() as p: ...` -> `p.peak`: the highest resident set (bytes) of this process inside
    the block (the high-water mark reset to the current RSS on entry, read on exit)."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.peak = None
        return self

    def __exit__(self, *exc):
        self.peak = peak_rss()


def copy_bandwidth(mib: int = 256, repeats: int = 5, huge_pages: bool = False) -> float | None:
    """(read + written) bytes per second of the fastest of `repeats` copies of a `mib` MiB fp32 tensor
    into another (after one untimed copy that faults both in), at torch's current thread count; `huge_pages`: both
    in 2 MB pages (`heap.huge_pages_empty`; None where the system offers none)."""
    import torch

    from chatglm_tune.runtime import heap

    n = mib * 2**20 // 4
    if huge_pages:
        src, dst = heap.huge_pages_empty((n,), torch.float32), heap.huge_pages_empty((n,), torch.float32)
        if src is None:
            return None
        src.fill_(1.0)
    else:
        src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every unique parameter once (the tied head too), with an
    INT8/INT4 layer counted as the kernel layout it runs from when it has one; an untied input embedding
    (ChatGLM2/3, GLM-4; float or INT8 rows and scales) is not counted: a step reads one row of it; routed experts
    count for the share a token reads (`num_experts_per_tok` of `n_routed_experts`)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and head.weight is not embedding.weight
    seen = {id(p) for p in embedding.parameters()} if untied else set()
    share = _routed_share(model)
    return round(sum(_module_bytes(module, seen) * share.get(id(module), 1.0) for module in model.modules()))


def _routed_share(model) -> dict[int, float]:
    """{id(module): the share of it a token reads} for every module inside a mixture-of-experts layer's routed
    experts."""
    config = getattr(model, "config", None)
    chosen, experts = getattr(config, "num_experts_per_tok", None), getattr(config, "n_routed_experts", None)
    if not (chosen and experts):
        return {}
    return {id(m): chosen / experts for name, outer in model.named_modules() if name.endswith("mlp.experts")
            for m in outer.modules()}


def _module_bytes(module, seen: set) -> int:
    """The bytes a step reads of `module`'s own parameters not counted yet (`seen`, which gains them)."""
    import torch

    from chatglm_tune.quant.modules import QuantizedLinear

    total = 0
    layout = module._layout if isinstance(module, QuantizedLinear) else None
    # what the kernel reads instead: int8dot's layout and the official scales, int4pack's four
    skipped = () if layout is None else ("weight",) if layout[0] == "int8dot" else ("weight", "weight_scale")
    for name, p in module.named_parameters(recurse=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name not in skipped:
            total += p.numel() * p.element_size()
    if layout is not None:
        total += sum(t.numel() * t.element_size() for t in layout[2:] if torch.is_tensor(t))
    return total


def median_seconds(fn, repeats: int = 1, warmup: int = 1) -> float:
    """Median wall seconds of `repeats` calls of `fn()`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine(threads: int) -> dict:
    """The machine a bench runs on, as its results record it: the CPU, PyTorch's kernel level, threads, torch."""
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads, "torch": torch.__version__}


def made_by(script: str, on: dict) -> str:
    """A results page's line on how it was made: "`python SCRIPT ARGS` on CPU (LEVEL, N threads, torch V)", with this
    process's arguments and the `machine` `on`."""
    command = " ".join([f"python {script}", *sys.argv[1:]])
    return f"`{command}` on {on['cpu']} ({on['capability']}, {on['threads']} threads, torch {on['torch']})"
