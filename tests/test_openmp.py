"""openmp: a thread's idle OpenMP team handed back, and the serving engine doing so for the thread that starts it
(the thread that loaded the model), so that the engine's own team spins between parallel regions."""

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from chatglm_tune.data.batches import SpecialIds
from chatglm_tune.decoding.engine import Engine
from chatglm_tune.runtime import openmp

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and openmp._pause_functions()),
                                reason="an OpenMP 5 runtime on Linux (/proc/self/task lists the threads)")


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _start_a_team() -> set[str]:
    """The worker threads a parallel region on the calling thread (a new one: no team yet) starts."""
    before = _tasks()
    x = torch.ones(1 << 22)
    x.mul_(2.0)  # 4 M elements: over ATen's grain, so a parallel region on 2 threads
    return _tasks() - before


def _left_after(team: set[str], timeout: float = 10.0) -> set[str]:
    """The threads of `team` still alive, waited for up to `timeout` seconds: a released worker leaves the
    runtime's barrier first and exits a moment later, later still on a busy machine."""
    deadline = time.monotonic() + timeout
    while (alive := team & _tasks()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _on_a_new_thread(body):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", body()))
    thread.start()
    thread.join()
    return result["value"]


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_a_threads_idle_team_is_handed_back(two_threads):
    def body():
        team = _start_a_team()
        return team, openmp.release_idle_team(), _left_after(team)

    team, released, alive = _on_a_new_thread(body)
    assert team, "a parallel region on 2 threads started no worker thread"
    assert released and not alive


def test_the_engine_hands_the_starting_threads_team_back(two_threads):
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(eos_token_id=2)

    def body():
        team = _start_a_team()
        engine = Engine(model, SpecialIds(pad_token_id=0), vocab_limit=None).start()
        alive = _left_after(team)
        engine.close()
        return team, alive

    team, alive = _on_a_new_thread(body)
    assert team and not alive
