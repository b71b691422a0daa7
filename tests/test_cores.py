"""A default thread count fits the machine it runs on (`cores`): the cores this process may use (affinity, cgroup
quota) less those other work keeps busy; a count the user gave is taken as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chatglm_tune.runtime import cores


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cores, "cgroup_quota", lambda: None)


@pytest.mark.parametrize("busy, threads", [(0.0, 2), (0.3, 2), (0.7, 1), (1.0, 1), (2.0, 1), (None, 2)])
def test_busy_cores_are_left_to_the_work_that_keeps_them(two_cores, monkeypatch, busy, threads):
    monkeypatch.setattr(cores, "busy_elsewhere", lambda: busy)
    assert cores.fit(2)[0] == threads and cores.fit(4)[0] == threads  # never more than the cores
    assert cores.fitted(2, "the run's")[0] == threads
    assert cores.fitted(2, "--threads") == (2, "--threads") and cores.fitted(4, "OMP_NUM_THREADS")[0] == 4


def test_a_cgroup_quota_below_the_affinity_bounds_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cores, "cgroup_quota", lambda: 2.5)
    assert cores.usable() == (2, "the cgroup's CPU quota of 2.5")


def test_one_thread_looks_at_nothing(two_cores, monkeypatch):
    monkeypatch.setattr(cores, "busy_elsewhere", lambda: pytest.fail("looked"))
    assert cores.fit(1) == (1, "2 cores usable")


def test_a_process_spinning_beside_this_one_is_seen_busy():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = cores.busy_elsewhere(look=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.7  # its core, give or take what the rest of the machine did
