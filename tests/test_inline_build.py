"""The CPU kernels' first-use build cannot wedge a run: a build killed by any signal leaves no lock (the next process
builds, saying so) and no half-built library; a process that waits for another's build says what it waits for;
a folder per kernel, source, flags and torch install. A kernel here is a one-function library, built through a
stand-in compiler that waits at a gate the test opens, so each moment of a build is reached on an event."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chatglm_tune.quant import inline_build
from commands import HANG_S, ROOT, wait_until

SOURCE = 'extern "C" int chatglm_test_answer() { return 42; }\n'
NAME = "chatglm_test_kernel"
BUILD = ("import sys; from chatglm_tune.quant import inline_build; "
         f"sys.exit(0 if inline_build.build({NAME!r}, {SOURCE!r}, [], 'the test kernel', 'nothing') else 3)")


@pytest.fixture
def gated(tmp_path, monkeypatch):
    """A kernel cache of its own and a compiler that waits at a gate: (environment, gate path, cache folder).
    `<gate>.started` appears when a build's compiler runs; the compiler goes on once `<gate>.open` exists."""
    gate = tmp_path / "gate"
    compiler = tmp_path / "gated-c++"
    compiler.write_text(f'#!/bin/sh\ntouch "{gate}.started"\nwhile [ ! -e "{gate}.open" ]; do sleep 0.05; done\n'
                        'exec c++ "$@"\n')
    compiler.chmod(0o755)
    cache = tmp_path / "kernels"
    environment = {"CXX": str(compiler), "CHATGLM_TUNE_KERNELS": str(cache)}
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    return os.environ | environment, gate, cache


def start_build(environment) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD], env=environment, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def library() -> Path:
    return inline_build.library_path(NAME, SOURCE, [])


def answer() -> int:
    return ctypes.CDLL(str(library())).chatglm_test_answer()


def leftovers(cache: Path) -> list[str]:
    """What a finished build should not leave: temporary build folders, any file but the libraries and locks."""
    return sorted(p.name for p in cache.rglob("*") if p.name.startswith(inline_build.BUILD_PREFIX)
                  or (p.is_file() and p.suffix != ".so" and p.name != inline_build.LOCK_NAME))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_build_killed_midway_leaves_nothing_that_stops_the_next(gated, sig):
    environment, gate, cache = gated
    first = start_build(environment)
    wait_until(lambda: gate.with_suffix(".started").exists(), "the first build's compiler",
               alive=lambda: first.poll() is None)
    os.killpg(first.pid, sig)  # the process and its compiler, as Ctrl-C in a terminal or a job's end reaches both
    assert first.wait(HANG_S) != 0
    assert not library().exists()
    gate.with_suffix(".open").touch()
    second = subprocess.run([sys.executable, "-c", BUILD], env=environment, cwd=ROOT, capture_output=True, text=True,
                            timeout=HANG_S)
    assert second.returncode == 0, second.stderr
    assert answer() == 42
    assert leftovers(cache) == []
    if sig == signal.SIGKILL:  # its lock named it; the OS released the lock with it
        assert f"by process {first.pid} ended before it finished" in second.stderr


def test_a_waiting_process_says_for_what_then_loads_the_others_build(gated, monkeypatch, capfd):
    environment, gate, cache = gated
    monkeypatch.setattr(inline_build, "SAY_AFTER_S", 0.0)
    builder = start_build(environment)
    wait_until(lambda: gate.with_suffix(".started").exists(), "the build's compiler",
               alive=lambda: builder.poll() is None)

    def open_gate_once_said():
        wait_until(lambda: "to finish building the test kernel" in capfd.readouterr().err, "the waiting message")
        gate.with_suffix(".open").touch()

    import threading

    opener = threading.Thread(target=open_gate_once_said)
    opener.start()
    assert inline_build.build(NAME, SOURCE, [], "the test kernel", "nothing")
    opener.join(HANG_S)
    assert builder.wait(HANG_S) == 0
    assert answer() == 42 and leftovers(cache) == []


def test_a_builder_that_is_stopped_not_ended_is_waited_for_no_longer_than_the_limit(gated, monkeypatch, capfd):
    environment, gate, cache = gated
    monkeypatch.setattr(inline_build, "WAIT_LIMIT_S", 0.5)
    builder = start_build(environment)
    try:
        wait_until(lambda: gate.with_suffix(".started").exists(), "the build's compiler",
                   alive=lambda: builder.poll() is None)
        os.killpg(builder.pid, signal.SIGSTOP)
        gate.with_suffix(".open").touch()  # for this process's own compiler
        assert inline_build.build(NAME, SOURCE, [], "the test kernel", "nothing")
        assert "gave up waiting" in capfd.readouterr().err and answer() == 42
    finally:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait(HANG_S)


def test_each_kernel_source_flags_and_torch_install_has_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("CHATGLM_TUNE_KERNELS", str(tmp_path))
    here = inline_build.library_path(NAME, SOURCE, [])
    assert here.parent.parent == tmp_path and torch.__version__.split("+")[0] in here.parent.name
    assert len({here, inline_build.library_path(NAME, SOURCE + "\n", []),
                inline_build.library_path(NAME, SOURCE, ["-mavx2"]),
                inline_build.library_path("chatglm_other", SOURCE, [])}) == 4
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert inline_build.library_path(NAME, SOURCE, []) != here
