"""The modules that moved from the package's root into rooms (subpackages) keep their old names: users wrote
`from chatglm_tune import loading` and `import chatglm_tune.training`, and pickles name `chatglm_tune.loading.X`.
Each old path imports the very module object of its new path (one entry under both names in `sys.modules`, its
`__name__` and `__spec__` the new path's), with no file left at the root; a name that never was a module is still
a ModuleNotFoundError."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import chatglm_tune

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "chatglm_tune"
# Where each module that sat at the package's root lives now: a promise, written out here.
MOVED = {
    "heap": "runtime.heap", "openmp": "runtime.openmp", "cores": "runtime.cores", "crashpoints": "runtime.crashpoints",
    "leftovers": "runtime.leftovers", "stopping": "runtime.stopping", "checkpoint": "runtime.checkpoint",
    "records": "data.records", "dialogues": "data.dialogues", "batches": "data.batches",
    "tokenizing": "data.tokenizing", "prefix": "models.prefix", "loss": "models.loss",
    "training": "tuning.training", "curves": "tuning.curves", "metrics": "evaluation.metrics",
    "textmetrics": "evaluation.textmetrics", "callmetrics": "evaluation.callmetrics",
    "extraction": "evaluation.extraction", "shards": "evaluation.shards", "loading": "runs.loading",
    "rundir": "runs.rundir", "lora": "runs.lora", "auto": "runs.auto",
}


def test_the_package_moves_exactly_these_modules():
    assert chatglm_tune._MOVED == MOVED
    for old, new in MOVED.items():
        assert not (PACKAGE / f"{old}.py").exists(), f"{old}.py is back at the package's root"
        assert PACKAGE.joinpath(*new.split(".")).with_suffix(".py").is_file(), new


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_of_its_new_one(old):
    new = importlib.import_module(f"chatglm_tune.{MOVED[old]}")
    assert importlib.import_module(f"chatglm_tune.{old}") is new
    assert sys.modules[f"chatglm_tune.{old}"] is sys.modules[f"chatglm_tune.{MOVED[old]}"] is new
    assert new.__name__ == new.__spec__.name == f"chatglm_tune.{MOVED[old]}"
    assert getattr(__import__("chatglm_tune", fromlist=[old]), old) is new  # from chatglm_tune import <old>
    assert getattr(chatglm_tune, old) is new


def test_old_paths_in_a_fresh_process():
    """Before anything imported the new paths: `from chatglm_tune import ...` and `import chatglm_tune.x` of old
    names, attribute access after a bare `import chatglm_tune`, and the package's import still light."""
    code = ("import sys, chatglm_tune\n"
            "light = not any(m in sys.modules for m in ('torch', 'transformers'))\n"
            "from chatglm_tune import loading, records\n"
            "import chatglm_tune.training\n"
            "import chatglm_tune.tuning.training as training\n"
            "print(light, loading is sys.modules['chatglm_tune.runs.loading'], chatglm_tune.training is training,\n"
            "      records.__name__, chatglm_tune.heap.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True", "True", "chatglm_tune.data.records", "chatglm_tune.runtime.heap"]


def test_a_pickle_naming_an_old_path_loads():
    from chatglm_tune.runs.loading import ModelSource

    source = ModelSource(Path("base"), Path("base"), prefix_dir=Path("run"), pre_seq_len=4)
    written = pickle.dumps(source, protocol=0).replace(b"chatglm_tune.runs.loading", b"chatglm_tune.loading")
    assert b"chatglm_tune.loading" in written and b"chatglm_tune.runs" not in written
    assert pickle.loads(written) == source


@pytest.mark.parametrize("name", ["chatglm_tune.nothing", "chatglm_tune.runs.training", "chatglm_tune.loading.x"])
def test_an_unknown_module_is_still_not_found(name):
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module(name)
    assert raised.value.name == name


def test_an_unknown_name_is_still_an_import_error_and_an_attribute_error():
    with pytest.raises(ImportError, match="cannot import name 'nothing'"):
        exec("from chatglm_tune import nothing")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        chatglm_tune.nothing  # noqa: B018
