"""The package's rooms, checked on its source (AST, nothing imported): imports flow one way; and sizes.

    command lines: cli/ (train, infer, quantize, serve, export, the `chatglm-tune` dispatcher, --config files) and
    __main__ (`python -m chatglm_tune`); the scripts train.py, infer.py, ... at the repository's root run cli/'s
      -> tuning/ (training, curves), serve/, export/, the package's __init__        (the upper rooms, top)
      -> runs/ (loading, rundir, lora, auto), evaluation/ (extraction, shards, metrics, textmetrics, callmetrics)
         (the upper rooms beneath them: neither imports the other)
      -> models/registry.py -> models/<family>/ (chatglm6b, glm)
      -> models/version.py (the interface), models/prefix.py, models/loss.py (what every family uses)
      -> decoding/ (generation, the engine, chat)                                      (the shared rooms)
      -> data/ (records, dialogues, batches, tokenizing), quant/
      -> runtime/ (checkpoint, heap, openmp, cores, stopping, crashpoints, leftovers)
      -> options

Nothing outside the command lines imports them; an upper room imports only upper rooms beneath its own; a family
never imports another family, the registry or an upper room; the interface imports only shared rooms; a shared room
never imports `models/`, an upper room or a shared room above its own; no module imports one that imports it back (a
function-level import counts: it is the same knot, tied later). Every module must be placed in one of these rooms, so
a new one is a decision, and the package's root holds at most 3 modules besides its `__init__` (now `options` and
`__main__`): everything else lives in a room. Also: no comparison with a version name ("glm4", ...) outside the
folder of that version's family, no comment or docstring that points outside the repository, no function of the
package over 80 lines (methods, async and nested functions included) and no .py file under bench/ over 400 lines.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "chatglm_tune"

# The shared rooms by level: a shared module imports its own room and the rooms of lower levels only.
SHARED = {"options": 0, "runtime": 1, "data": 2, "quant": 2, "decoding": 3}
# The upper rooms by level: an upper module imports its own room, the upper rooms of lower levels and anything of
# `models/` and the shared rooms. "": the package's __init__.
UPPER = {"runs": 0, "evaluation": 0, "tuning": 1, "serve": 1, "export": 1, "": 1}
FAMILIES = {"chatglm6b", "glm"}
INTERFACE = {"", "version", "prefix", "loss"}  # models/ and these modules of it: what the families share
COMMANDS = {"cli", "__main__"}  # the top: they import any room, and no module outside them imports them
MAX_ROOT_MODULES = 3  # modules at the package's root besides __init__.py


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """The chatglm_tune modules a file imports anywhere (top level and inside functions), resolved to modules
    (a `from package import name` counts as `package.name` when that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "chatglm_tune"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import (this package imports absolutely)")
            if (node.module or "").split(".")[0] != "chatglm_tune":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if is_module(sub) else node.module)
    return out


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    return {module_name(p): package_imports(p) - {module_name(p)} for p in files}


def room(module: str) -> str:
    """"command", "shared:<room>", "interface", "family:<name>", "registry" or "upper:<room>"; KeyError for a
    module in no room."""
    parts = module.split(".")[1:]
    first = parts[0] if parts else ""
    if first in COMMANDS:
        return "command"
    if first == "models":
        if len(parts) <= 2 and (parts[1:] or [""])[0] in INTERFACE:
            return "interface"
        if parts[1:] == ["registry"]:
            return "registry"
        if len(parts) > 1 and parts[1] in FAMILIES:
            return f"family:{parts[1]}"
    elif first in SHARED:
        return f"shared:{first}"
    elif first in UPPER:
        return f"upper:{first}"
    raise KeyError(f"{module} is in no room: add it to SHARED, UPPER, INTERFACE or FAMILIES in {Path(__file__).name}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph (one path each, found by depth-first search)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def allowed(mine: str, theirs: str) -> bool:
    """Whether a module of room `mine` may import one of room `theirs` (rooms as `room` names them)."""
    kind, _, name = mine.partition(":")
    their_kind, _, their_name = theirs.partition(":")
    if kind == "command":
        return True
    if kind == "upper":
        return their_kind != "command" and (their_kind != "upper" or theirs == mine or UPPER[their_name] < UPPER[name])
    if kind == "registry":
        return their_kind in ("shared", "interface", "family")
    if kind == "family":
        return their_kind in ("shared", "interface") or theirs == mine
    if kind == "interface":
        return their_kind in ("shared", "interface")
    return their_kind == "shared" and (theirs == mine or SHARED[their_name] < SHARED[name])  # a shared room


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the direction of the rooms (KeyError for a module in no room, importing or not)."""
    rooms = {module: room(module) for module in {*graph, *(t for imports in graph.values() for t in imports)}}
    return [f"{module} ({rooms[module]}) imports {target} ({rooms[target]})"
            for module, imports in sorted(graph.items()) for target in sorted(imports)
            if not allowed(rooms[module], rooms[target])]


def test_the_checks_catch_a_circle_and_imports_against_the_rooms():
    graph = {"chatglm_tune.data.batches": {"chatglm_tune.decoding.generation"},
             "chatglm_tune.decoding.generation": {"chatglm_tune.data.batches", "chatglm_tune.quant.modules"},
             "chatglm_tune.quant.modules": {"chatglm_tune.runtime.heap"}, "chatglm_tune.runtime.heap": set(),
             "chatglm_tune.runtime.checkpoint": {"chatglm_tune.data.records", "chatglm_tune.options"},
             "chatglm_tune.data.records": set(), "chatglm_tune.options": set(),
             "chatglm_tune.models.glm.modeling": {"chatglm_tune.models.chatglm6b.config", "chatglm_tune.runs.loading",
                                                  "chatglm_tune.models.prefix", "chatglm_tune.models.loss"},
             "chatglm_tune.models.prefix": {"chatglm_tune.models.registry", "chatglm_tune.runtime.checkpoint"},
             "chatglm_tune.models.loss": {"chatglm_tune.data.batches"}, "chatglm_tune.models.chatglm6b.config": set(),
             "chatglm_tune.runs.loading": {"chatglm_tune.cli.config", "chatglm_tune.evaluation.metrics"},
             "chatglm_tune.evaluation.metrics": {"chatglm_tune.tuning.curves"}, "chatglm_tune.tuning.curves": set(),
             "chatglm_tune.tuning.training": {"chatglm_tune.runs.loading", "chatglm_tune.evaluation.metrics",
                                              "chatglm_tune.serve.app"}, "chatglm_tune.serve.app": set(),
             "chatglm_tune.models.registry": set(), "chatglm_tune.cli.config": set(),
             "chatglm_tune.cli.train": {"chatglm_tune.tuning.training", "chatglm_tune.cli.config"},
             "chatglm_tune.__main__": {"chatglm_tune.cli.main"}, "chatglm_tune.cli.main": {"chatglm_tune.cli.train"}}
    assert cycles(graph) == [["chatglm_tune.data.batches", "chatglm_tune.decoding.generation",
                              "chatglm_tune.data.batches"]]
    assert violations(graph) == [
        "chatglm_tune.data.batches (shared:data) imports chatglm_tune.decoding.generation (shared:decoding)",
        "chatglm_tune.evaluation.metrics (upper:evaluation) imports chatglm_tune.tuning.curves (upper:tuning)",
        "chatglm_tune.models.glm.modeling (family:glm) imports chatglm_tune.models.chatglm6b.config (family:chatglm6b)",
        "chatglm_tune.models.glm.modeling (family:glm) imports chatglm_tune.runs.loading (upper:runs)",
        "chatglm_tune.models.prefix (interface) imports chatglm_tune.models.registry (registry)",
        "chatglm_tune.runs.loading (upper:runs) imports chatglm_tune.cli.config (command)",
        "chatglm_tune.runs.loading (upper:runs) imports chatglm_tune.evaluation.metrics (upper:evaluation)",
        "chatglm_tune.runtime.checkpoint (shared:runtime) imports chatglm_tune.data.records (shared:data)",
        "chatglm_tune.tuning.training (upper:tuning) imports chatglm_tune.serve.app (upper:serve)",
    ]
    for stray in ("chatglm_tune.serving", "chatglm_tune.models.trainer", "chatglm_tune.utils.text"):
        with pytest.raises(KeyError, match="in no room"):
            room(stray)
    with pytest.raises(KeyError, match="chatglm_tune.helpers is in no room"):
        violations({"chatglm_tune.helpers": set()})  # placed or not, importing nothing or not


def test_the_package_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_imports_flow_one_way_through_the_rooms():
    assert violations(import_graph()) == []


def root_modules(package: Path) -> list[str]:
    """The modules at the package's root, `__init__` aside."""
    return sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")


def test_the_package_root_holds_at_most_3_modules(tmp_path):
    assert root_modules(PACKAGE) == ["__main__", "options"]
    assert len(root_modules(PACKAGE)) <= MAX_ROOT_MODULES
    for name in ("__init__", "__main__", "options", "helpers", "utils"):
        (tmp_path / f"{name}.py").write_text("", encoding="utf-8")
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "inside.py").write_text("", encoding="utf-8")
    assert len(root_modules(tmp_path)) == 4 > MAX_ROOT_MODULES  # one module too many, the room's not counted


def test_no_version_name_is_compared_outside_its_family():
    """`version == "glm4"`-style branches live in the version's own family folder; elsewhere a version is asked
    (its format, its `Version`), never named in a comparison."""
    from chatglm_tune.models.registry import VERSIONS

    homes = {name: Path(type(v).__module__.replace(".", "/")).parent for name, v in VERSIONS.items()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for const in ast.walk(node):
                if isinstance(const, ast.Constant) and const.value in homes:
                    if not path.relative_to(ROOT).is_relative_to(homes[const.value]):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with {const.value!r}")
    assert found == []


# Pointers to what a user's clone does not have: the design notes, the specification, the folder shared
# beside the checkout, issue numbers. Built from parts so that this file does not match itself.
_OUTSIDE = re.compile("|".join([r"DESIGN" r"\.md", r"\bspec" r" section", r"\.\./" r"shared", r"\bissue" r" #?\d+",
                                r"(?<![\w&])#" r"\d{2,}\b", r"\bshared/" r"(spec|golden|notes|DESIGN)"]))


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
    return out


def test_no_comment_or_docstring_points_outside_the_repository():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"),
             *(ROOT / name for name in ("train.py", "infer.py", "quantize.py", "serve.py", "export.py"))]
    found = [f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}" for path in sorted(files)
             if "__pycache__" not in path.parts for line, text in _comments_and_docstrings(path)
             for m in _OUTSIDE.finditer(text)]
    assert found == []


# Size: a function reads in one sitting, a bench script stays a script

MAX_FUNCTION_LINES = 80  # def line to last line, docstring and nested functions included
MAX_BENCH_FILE_LINES = 400


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line: name is N lines' for every function of `path` (sync or async, methods and nested functions,
    named by where they sit: `Class.method`, `outer.inner`) longer than `limit` lines."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > limit:
                    found.append(f"{shown(path)}:{child.lineno}: {name} is {lines} lines (at most {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def shown(path: Path) -> Path:
    """`path` from the repository root where it is in the repository."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def long_files(paths, limit: int = MAX_BENCH_FILE_LINES) -> list[str]:
    """'file:1: N lines' for each of `paths` longer than `limit` lines."""
    found = []
    for path in sorted(paths):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{shown(path)}:1: the whole file is {lines} lines (at most {limit})")
    return found


def test_the_size_checks_name_file_line_and_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    code = ("def short():\n    pass\n\n\nclass Server:\n    async def "
            f"handle(self):\n{body.replace('    ', '        ')}\n\ndef outer():\n    def "
            f"inner():\n{body.replace('    ', '        ')}    return inner\n")
    probe = tmp_path / "probe.py"
    probe.write_text(code, encoding="utf-8")
    assert long_functions(probe) == [f"{probe}:6: Server.handle is 81 lines (at most 80)",
                                     f"{probe}:89: outer is 83 lines (at most 80)",
                                     f"{probe}:90: outer.inner is 81 lines (at most 80)"]
    assert long_functions(probe, limit=83) == []
    assert long_files([probe], limit=100) == [f"{probe}:1: the whole file is 171 lines (at most 100)"]
    assert long_files([probe], limit=171) == []


def test_no_function_of_the_package_is_over_80_lines():
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    assert [line for path in files for line in long_functions(path)] == []


def test_no_bench_file_is_over_400_lines():
    assert long_files(p for p in (ROOT / "bench").rglob("*.py") if "__pycache__" not in p.parts) == []
