"""Building the toolkit's C++ CPU kernels at first use (`fewrow_cpu`, `int4_cpu`, `int8dot_cpu`), so that no kill can
wedge a later run.

Each kernel is compiled once per machine and torch install into its own folder of the kernel cache
(`options.kernel_cache()`: $CHATGLM_TUNE_KERNELS, else ~/.cache/chatglm_tune/kernels), named by the kernel, the torch
version and a hash of everything the binary depends on (source, flags, torch's install folder, Python, machine): two
virtual environments never rebuild each other's kernels. A build runs the compiler into a private temporary folder,
then moves the library into place with one rename, so a library in place is always whole. One process builds at a
time, under an OS file lock (`flock`) that ends with its holder: a process killed mid-build (Ctrl-C, SIGTERM,
SIGKILL, OOM) leaves no lock behind, only its temporary folder, which the next build removes. A process that waits
says for what after a few seconds, and builds on its own after `WAIT_LIMIT_S`. Where the kernel cannot be built (no
compiler, a failed build) one warning says so and the caller runs its fallback.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from chatglm_tune.options import kernel_cache
from chatglm_tune.runtime import leftovers

SAY_AFTER_S = 3.0  # a wait for another process's build is named after this long, and again every SAY_EVERY_S
SAY_EVERY_S = 30.0
WAIT_LIMIT_S = 600.0  # then this process builds on its own (the other's build may be stopped, not ended)
POLL_S = 0.2
BUILD_PREFIX = ".build-"  # a temporary build folder: .build-<host>-<pid>-<random>
LOCK_NAME = ".lock"


def x86() -> bool:
    """Whether this machine is x86-64 (the only one the kernels are written for)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def build(name: str, source: str, cflags: list[str], what: str, otherwise: str) -> bool:
    """Compile (once: see the module docstring) and load `source` as the op library `name` (OpenMP, -O3 plus
    `cflags`). False, with one warning naming `what` could not be built and what runs `otherwise`, where there is no
    compiler or the build fails. A KeyboardInterrupt during the build propagates, leaving nothing half-built."""
    import torch

    library = library_path(name, source, cflags)
    try:
        if not library.is_file():
            with _build_lock(library.parent, what):
                if not library.is_file():
                    _compile_into_place(name, source, cflags, library)
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        lines = str(e).strip().splitlines()
        warnings.warn(f"chatglm_tune.{name.removeprefix('chatglm_')}: {what} could not be built ({type(e).__name__}: "
                      f"{lines[-1] if lines else ''}); {otherwise}")
        return False
    return True


def library_path(name: str, source: str, cflags: list[str]) -> Path:
    """Where the built library of `name` lives: <kernel cache>/<name>-<torch version>-<hash>/<name>.so."""
    import torch

    identity = "\0".join([source, *cflags, torch.__version__, os.path.dirname(torch.__file__),
                          sys.implementation.cache_tag, sys.abiflags, platform.machine(), os.environ.get("CXX", "c++"),
                          *_compile_flags([])])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return kernel_cache() / f"{name}-{torch.__version__.replace('+', '_')}-{digest}" / f"{name}.so"


def _compile_flags(cflags: list[str]) -> list[str]:
    from torch.utils import cpp_extension

    return ["-shared", "-fPIC", "-std=c++20", "-O3", *cflags, "-fopenmp",
            *(f"-isystem{p}" for p in cpp_extension.include_paths())]


def _compile_into_place(name: str, source: str, cflags: list[str], library: Path) -> None:
    """The compiler's library, built in a private folder beside `library` and renamed into place."""
    from torch.utils import cpp_extension

    leftovers.remove_abandoned(library.parent, BUILD_PREFIX)
    private = Path(tempfile.mkdtemp(prefix=leftovers.owned_prefix(BUILD_PREFIX), dir=library.parent))
    try:
        (private / f"{name}.cpp").write_text(source, encoding="utf-8")
        links = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
        command = [os.environ.get("CXX", "c++"), *_compile_flags(cflags), f"-DTORCH_EXTENSION_NAME={name}",
                   str(private / f"{name}.cpp"), "-o", str(private / library.name), *links]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{command[0]} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(private / library.name, library)
    finally:
        shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(folder: Path, what: str):
    """The folder's build lock (an flock: released by the OS when its holder ends, however it ends), waited for
    with a message; given up after WAIT_LIMIT_S, and skipped where the file system has no locks."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+") as lock:
        held = _wait_for(lock, folder, what)
        try:
            if held:
                _say_if_taken_over(lock, what)
                lock.truncate(0)
                lock.write(f"{socket.gethostname()} {os.getpid()}\n")
                lock.flush()
            yield
        finally:
            if held:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for(lock, folder: Path, what: str) -> bool:
    """Whether the lock was taken: at once, or after waiting for another process's build (said after SAY_AFTER_S).
    False after WAIT_LIMIT_S, or where locks are not supported: the caller then builds without it."""
    start = said = time.monotonic()
    first = True
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # no locks on this file system (some network mounts): builds may then overlap, harmlessly
            return False
        waited = time.monotonic() - start
        if waited >= WAIT_LIMIT_S:
            print(f"chatglm_tune: gave up waiting after {waited:.0f} s; building {what} in this process too",
                  file=sys.stderr, flush=True)
            return False
        if waited >= SAY_AFTER_S and (first or time.monotonic() - said >= SAY_EVERY_S):
            print(f"chatglm_tune: waiting for {_holder(lock)} to finish building {what} in {folder} "
                  f"({waited:.0f} s so far; it is built once per machine and torch install)",
                  file=sys.stderr, flush=True)
            first, said = False, time.monotonic()
        time.sleep(POLL_S)


def _say_if_taken_over(lock, what: str) -> None:
    """A message where the lock names a build on this host whose process has ended: its lock went with it, and
    this process builds in its place (the library is not in place, or no build would be under way)."""
    lock.seek(0)
    holder = lock.read().split()
    if (len(holder) == 2 and holder[0] == socket.gethostname() and holder[1].isdigit()
        and not leftovers.alive(int(holder[1]))):
        print(f"chatglm_tune: the build of {what} by process {holder[1]} ended before it finished; "
              "building it in this process", file=sys.stderr, flush=True)


def _holder(lock) -> str:
    """The process that holds the lock, as its holder wrote it ("host pid")."""
    lock.seek(0)
    holder = lock.read().split()
    return f"process {holder[1]} on {holder[0]}" if len(holder) == 2 else "another process"
