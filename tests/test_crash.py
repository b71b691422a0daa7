"""The crash test's quick pass (bench/crash/crash.py runs the long one): each command on the README's tiny model is
killed once, at a moment where a kill does harm if anything can (inside a checkpoint's publication, between a write
and its rename, inside the very first kernel build, in the middle of serving), then run again as it was (train.py
with --resume auto, infer.py with --resume): it finishes, its output equals an uninterrupted run's, nothing hangs,
no temporary file is left."""

from __future__ import annotations

import pytest

from bench.crash.crash import Kill, one_kill, reference, table
from bench.crash.crash_commands import commands, prepare, quiet_env, trained

# (command, signal, kind, where): a moment each, the harms they would show named
KILLS = [
    ("train", "SIGKILL", "point", "publish#2"),  # half the best checkpoint's files renamed: a mixed model, .publishing
    ("infer", "SIGINT", "build", ""),  # a user's Ctrl-C during the first run's kernel build: a lock left, a wedge
    ("quantize", "SIGTERM", "point", "atomic-write#2"),  # between a file's write and its rename: a half directory
    ("export", "SIGKILL", "point", "export-tensor#7"),  # half the file written: a partial left, a refused rerun
    ("serve", "SIGKILL", "point", "engine-step#4"),  # mid-answer: the next server's answers
]


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    warm = None  # the user's kernel cache, built already or by the first reference (the suite's other tests share it)
    inputs = prepare(root / "inputs")
    refs = {"train": reference(commands(inputs)["train"], root, warm)}
    inputs = trained(inputs, refs["train"].work)
    chosen = commands(inputs)
    for name in sorted({k[0] for k in KILLS} - {"train"}):
        refs[name] = reference(chosen[name], root, warm)
    return root, warm, chosen, refs


@pytest.mark.parametrize("kill", KILLS, ids=[f"{c}-{s}-{w or k}" for c, s, k, w in KILLS])
def test_a_command_killed_there_finishes_with_the_uninterrupted_output(crash_setup, kill):
    root, warm, chosen, refs = crash_setup
    command, sig, kind, where = kill
    if kind == "point":  # the moment is one the uninterrupted run passed
        moment, n = where.rsplit("#", 1)
        assert refs[command].moments[moment] >= int(n), refs[command].moments
    row = one_kill(chosen[command], Kill(command, sig, kind, where), refs[command], root, warm)
    assert row["landed"], row  # the command was killed there, not after it ended
    assert (row["hang"], row["failed"], row["differs"], row["leftovers"]) == (False, False, False, []), row


def test_the_table_counts_each_kind_of_harm():
    rows = [dict(command="infer", signal="SIGKILL", landed=True, hang=False, failed=False, differs=True, leftovers=[]),
            dict(command="infer", signal="SIGKILL", landed=False, hang=True, failed=True, differs=False,
                 leftovers=["x"])]
    assert table(rows) == [dict(command="infer", signal="SIGKILL", kills=2, landed=1, hangs=1, failed=1, differs=1,
                                leftovers=1)]
    assert quiet_env(A="1")["OMP_NUM_THREADS"] == "1"
