"""The crash test: each command (train.py, infer.py, quantize.py, export.py, serve.py) on the README's tiny model,
killed with SIGINT, SIGTERM and SIGKILL at seeded random moments; after each kill the same command (train.py with
`--resume auto`, infer.py with `--resume`, the others as they were) must finish, its output must equal an
uninterrupted run's, no command may hang, and no temporary file may be left (in the command's folder or the kernel
cache).

    python bench/crash/crash.py                                  # 20 kills a command and signal; --results writes
    python bench/crash/crash.py --kills 2 --commands infer train # bench/results/crash.{json,md}

A moment is one of:
- point: the n-th time the command passes a named crash point (`chatglm_tune.runtime.crashpoints`: a write before its
  rename, between two renames, an output append, a training step, an engine step), drawn from the points an
  uninterrupted run passed; the process sends itself the signal there;
- time: a seeded delay into an uninterrupted run's duration (start-up, loading, anywhere), the signal sent from here;
- build: the first kernel build on an empty kernel cache, the signal sent once the compiler runs (a user's Ctrl-C
  during the very first run).
Signals go to the command's process group, as a terminal's Ctrl-C, `kill -- -PGID` or a job's end reach them.
Prints a table (command x signal: kills, kills that landed, hangs, failed reruns, outputs that differ, leftovers)
and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.crash.crash_commands import HANG_S, ROOT, Command, commands, prepare, quiet_env, trained  # noqa: E402
from chatglm_tune.options import KERNEL_CACHE_ENV, kernel_cache  # noqa: E402
from chatglm_tune.quant import inline_build  # noqa: E402
from chatglm_tune.runtime.crashpoints import AT_ENV, LOG_ENV, spell  # noqa: E402
from chatglm_tune.runtime.leftovers import alive, owner  # noqa: E402

SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")
RESULTS = ROOT / "bench" / "results"
# What an interrupted write may leave and a finished command must not: temporary files and folders, a kernel build's.
TEMPORARY = (".tmp", ".partial", ".old", ".publishing", ".build-")
WARM_UP = ("from chatglm_tune.quant import fewrow_cpu, int4_cpu, int8dot_cpu; "
           "fewrow_cpu.available(); int4_cpu.compiled(); int8dot_cpu.isa()")


@dataclass
class Reference:
    output: object
    seconds: float
    work: Path
    moments: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Kill:
    command: str
    signal: str
    kind: str  # "point", "time" or "build"
    where: str  # the crash point ("append#2"), the delay ("1.234"), or "" for a build


def leftovers(work: Path, cache: Path) -> list[str]:
    """Temporary files and folders under `work`, and kernel builds in `cache` whose process has ended (a cache shared
    with other processes may hold their builds under way)."""
    found = [p for p in work.rglob("*") if any(mark in p.name for mark in TEMPORARY)] if work.exists() else []
    builds = cache.glob(f"*/{inline_build.BUILD_PREFIX}*") if cache.exists() else []
    found += [p for p in builds if not alive(owner(p.name, inline_build.BUILD_PREFIX) or 0)]
    return sorted(map(str, found))


def run_to_end(argv: list[str], env: dict, log: Path) -> tuple[int | None, float]:
    """(exit code, seconds) of a command run to its end; None for a hang (killed after HANG_S)."""
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(HANG_S), time.monotonic() - start
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, time.monotonic() - start


def reference(command: Command, root: Path, cache: Path | None) -> Reference:
    """An uninterrupted run of `command`: its output, duration and the crash points it passed."""
    work = Path(tempfile.mkdtemp(prefix=f"{command.name}-reference-", dir=root))
    moments = work.parent / f"{work.name}.moments"
    code, seconds = run_to_end(command.first(work), quiet_env(**{LOG_ENV: str(moments)}, **cache_env(cache)),
                               root / f"{work.name}.log")
    if code != 0:
        raise RuntimeError(f"{command.name}'s uninterrupted run failed ({code}): see {root / (work.name + '.log')}")
    counted = Counter(moments.read_text().split()) if moments.exists() else Counter()
    return Reference(command.output(work), seconds, work, counted)


def plan(commands_: dict[str, Command], refs: dict[str, Reference], kills: int, signals, seed: int) -> list[Kill]:
    """`kills` moments a command and signal: a first kernel build first (commands that build one), then crash points
    and delays in turn."""
    rng = random.Random(seed)
    out = []
    for name, command in commands_.items():
        points = [(m, n) for m, count in sorted(refs[name].moments.items()) for n in range(1, count + 1)]
        for sig in signals:
            for i in range(kills):
                if i == 0 and command.builds_kernel:
                    out.append(Kill(name, sig, "build", ""))
                elif i % 2 and points:
                    moment, n = rng.choice(points)
                    out.append(Kill(name, sig, "point", f"{moment}#{n}"))
                else:
                    out.append(Kill(name, sig, "time", f"{rng.uniform(0, refs[name].seconds):.3f}"))
    return out


def _signal_at(proc: subprocess.Popen, kill: Kill, cache: Path) -> None:
    """Send the kill's signal to the command's group at its moment (time and build kills; a point kill is the
    command's own)."""
    if kill.kind == "time":
        try:
            proc.wait(float(kill.where))
            return  # ended first: the kill did not land
        except subprocess.TimeoutExpired:
            pass
    elif kill.kind == "build":
        deadline = time.monotonic() + HANG_S
        while not any(cache.glob("*/.build-*")):
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.01)
    else:
        return
    try:
        os.killpg(proc.pid, getattr(signal, kill.signal))
    except ProcessLookupError:
        pass


def cache_env(cache: Path | None) -> dict:
    """The environment that points the kernels at `cache` (None: the user's own)."""
    return {} if cache is None else {KERNEL_CACHE_ENV: str(cache)}


def one_kill(command: Command, kill: Kill, ref: Reference, root: Path, warm_cache: Path | None) -> dict:
    """Kill `command` at `kill`'s moment, run it again to its end, and compare: one row of the table. `warm_cache`: the
    kernel cache of the runs that do not start on an empty one (None: the user's)."""
    work = Path(tempfile.mkdtemp(prefix=f"{command.name}-", dir=root))
    cache = Path(tempfile.mkdtemp(prefix="kernels-", dir=root)) if kill.kind == "build" else warm_cache
    env = quiet_env(**cache_env(cache))
    log = root / f"{work.name}.log"
    at = {AT_ENV: spell(*kill.where.rsplit("#", 1)[:1], int(kill.where.rsplit("#", 1)[1]), kill.signal)} \
        if kill.kind == "point" else {}
    with open(log, "ab") as out:
        proc = subprocess.Popen(command.first(work), cwd=ROOT, env=env | at, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _signal_at(proc, kill, cache)
        try:
            first = proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            first = None
    row = {**asdict(kill), "first_exit": first, "landed": first not in (0, None), "hang": first is None}
    again, _ = run_to_end(command.again(work), env, log)
    row.update(hang=row["hang"] or again is None, rerun_exit=again, failed=again != 0)
    row["differs"] = not row["failed"] and command.output(work) != ref.output
    row["leftovers"] = leftovers(work, cache or kernel_cache())
    if not (row["hang"] or row["failed"] or row["differs"] or row["leftovers"]):
        shutil.rmtree(work, ignore_errors=True)
        log.unlink(missing_ok=True)
    else:
        row["log"] = str(log)
    if kill.kind == "build":
        shutil.rmtree(cache, ignore_errors=True)
    return row


def table(rows: list[dict]) -> list[dict]:
    """A line a command and signal: kills, landed, hangs, failed reruns, differing outputs, leftovers."""
    lines = {}
    for row in rows:
        line = lines.setdefault((row["command"], row["signal"]),
                                dict(command=row["command"], signal=row["signal"], kills=0, landed=0, hangs=0,
                                     failed=0, differs=0, leftovers=0))
        line["kills"] += 1
        for key, value in (("landed", row["landed"]), ("hangs", row["hang"]), ("failed", row["failed"]),
                           ("differs", row["differs"]), ("leftovers", bool(row["leftovers"]))):
            line[key] += int(value)
    return list(lines.values())


def markdown(lines: list[dict], meta: dict) -> str:
    head = ("| command | signal | kills | landed | hangs | failed reruns | outputs that differ | leftovers "
            "|\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {row['command']} | {row['signal']} | {row['kills']} | {row['landed']} | {row['hangs']} | "
                   f"{row['failed']} | {row['differs']} | {row['leftovers']} |\n" for row in lines)
    return f"# Crash test\n\n{json.dumps(meta)}\n\n{head}{body}"


def crash_test(names: list[str], kills: int, signals, seed: int, root: Path, progress=print) -> tuple[list[dict], dict]:
    """(rows, the uninterrupted runs' seconds): the whole test in `root`."""
    warm = root / "kernels"
    # built once here: the uninterrupted runs' durations leave the builds out
    subprocess.run([sys.executable, "-c", WARM_UP], cwd=ROOT,
                   env=quiet_env(**{KERNEL_CACHE_ENV: str(warm)}), check=True, timeout=HANG_S)
    inputs = prepare(root / "inputs")
    refs = {"train": reference(commands(inputs)["train"], root, warm)}  # its run is what the others read
    inputs = trained(inputs, refs["train"].work)
    chosen = {name: command for name, command in commands(inputs).items() if name in names}
    refs.update({name: reference(command, root, warm) for name, command in chosen.items() if name != "train"})
    rows = []
    for i, kill in enumerate(plan(chosen, refs, kills, signals, seed), 1):
        rows.append(one_kill(chosen[kill.command], kill, refs[kill.command], root, warm))
        r = rows[-1]
        progress(f"[{i}] {kill.command} {kill.signal} {kill.kind} {kill.where}: first exit {r['first_exit']}, rerun "
                 f"{r['rerun_exit']}{', DIFFERS' if r['differs'] else ''}{', LEFTOVERS' if r['leftovers'] else ''}")
    return rows, {name: round(ref.seconds, 2) for name, ref in refs.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="kills a command and signal (default %(default)s)")
    p.add_argument("--commands", nargs="+", default=["train", "infer", "quantize", "export", "serve"])
    p.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=SIGNALS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path,
                   help="folder for the runs (default: a new temporary one, removed if all passed)")
    p.add_argument("--results", action="store_true", help="write bench/results/crash.{json,md}")
    args = p.parse_args(argv)
    root = args.work or Path(tempfile.mkdtemp(prefix="crash-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rows, seconds = crash_test(args.commands, args.kills, args.signals, args.seed, root)
    lines = table(rows)
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": torch.backends.cpu.get_cpu_capability(), "seed": args.seed,
            "kills_a_command_and_signal": args.kills, "uninterrupted_seconds": seconds,
            "minutes": round((time.monotonic() - start) / 60, 1)}
    print(markdown(lines, meta))
    totals = {k: sum(line[k] for line in lines) for k in ("kills", "landed", "hangs", "failed", "differs", "leftovers")}
    result = {**meta, **totals, "table": lines, "problems": [r for r in rows if r.get("log")]}
    if args.results:
        (RESULTS / "crash.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
        (RESULTS / "crash.md").write_text(markdown(lines, meta))
    if not result["problems"] and args.work is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("table", "problems")}))
    return result


if __name__ == "__main__":
    sys.exit(0 if not main()["problems"] else 1)
