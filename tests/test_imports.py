"""The package's rooms, checked on its source (AST, nothing imported): imports flow one way; and sizes.

    command lines: cli/ (train, infer, quantize, serve, export, the `chatglm-tune` dispatcher, --config files) and
    __main__ (`python -m chatglm_tune`); the scripts train.py, infer.py, ... at the repository's root run cli/'s
      -> training, extraction, metrics (callmetrics, textmetrics), lora, loading, rundir, auto, serve/, export/
         (the upper layers)
      -> models/registry.py -> models/<family>/ (chatglm6b, glm) -> models/version.py (the interface)
      -> shared layers: batches, records, dialogues, decoding/ (generation, the engine, chat), prefix, checkpoint,
         tokenizing, quant/, heap, openmp
      -> options

Nothing outside the command lines imports them; a family never imports another family, the registry or an upper
layer; a shared layer never imports `models/`; no module imports one that imports it back (a function-level import
counts: it is the same knot, tied later). Every module must be placed in one of these rooms, so a new one is a
decision. Also: no comparison with a version name ("glm4", ...) outside the folder of that version's family, no
comment or docstring that points outside the repository, no function of the package over 80 lines (methods, async
and nested functions included) and no .py file under bench/ over 400 lines.
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

SHARED = {"options", "heap", "openmp", "cores", "crashpoints", "leftovers", "stopping", "loss", "checkpoint", "prefix",
          "records", "dialogues", "batches", "decoding", "tokenizing", "quant"}
UPPER = {"training", "extraction", "shards", "metrics", "textmetrics", "callmetrics", "curves", "lora", "loading",
         "rundir", "auto", "serve", "export", ""}  # "": __init__
FAMILIES = {"chatglm6b", "glm"}
COMMANDS = {"cli", "__main__"}  # the top: they import any room, and no module outside them imports them


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
    """"command", "shared", "interface", "family:<name>", "registry" or "upper"; KeyError for a module in no room."""
    parts = module.split(".")[1:]
    if (parts[0] if parts else "") in COMMANDS:
        return "command"
    if parts[:1] == ["models"]:
        if parts[1:] in ([], ["version"]):
            return "interface"
        if parts[1:] == ["registry"]:
            return "registry"
        if len(parts) > 1 and parts[1] in FAMILIES:
            return f"family:{parts[1]}"
    elif (parts[0] if parts else "") in SHARED:
        return "shared"
    elif (parts[0] if parts else "") in UPPER:
        return "upper"
    raise KeyError(f"{module} is in no room: add it to SHARED, UPPER or FAMILIES in {Path(__file__).name}")


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


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the direction of the rooms."""
    allowed = {"shared": {"shared"}, "interface": {"shared", "interface"},
               "registry": {"shared", "interface", "family"}}
    out = []
    for module, imports in sorted(graph.items()):
        mine = room(module)
        for target in sorted(imports):
            theirs = room(target)
            if mine.startswith("family:"):
                ok = theirs in ("shared", "interface", mine)
            elif mine == "command":
                ok = True
            elif mine == "upper":
                ok = theirs != "command"
            else:
                ok = theirs.split(":")[0] in allowed[mine]
            if not ok:
                out.append(f"{module} ({mine}) imports {target} ({theirs})")
    return out


def test_the_checks_catch_a_circle_and_imports_against_the_rooms():
    graph = {"chatglm_tune.batches": {"chatglm_tune.decoding.generation"},
             "chatglm_tune.decoding.generation": {"chatglm_tune.batches"},
             "chatglm_tune.models.glm.modeling": {"chatglm_tune.models.chatglm6b.config", "chatglm_tune.loading"},
             "chatglm_tune.prefix": {"chatglm_tune.models.registry"}, "chatglm_tune.models.chatglm6b.config": set(),
             "chatglm_tune.loading": {"chatglm_tune.cli.config"}, "chatglm_tune.models.registry": set(),
             "chatglm_tune.cli.train": {"chatglm_tune.loading", "chatglm_tune.cli.config"},
             "chatglm_tune.cli.config": set(),
             "chatglm_tune.__main__": {"chatglm_tune.cli.main"}, "chatglm_tune.cli.main": {"chatglm_tune.cli.train"}}
    assert cycles(graph) == [["chatglm_tune.batches", "chatglm_tune.decoding.generation", "chatglm_tune.batches"]]
    assert violations(graph) == [
        "chatglm_tune.loading (upper) imports chatglm_tune.cli.config (command)",
        "chatglm_tune.models.glm.modeling (family:glm) imports chatglm_tune.loading (upper)",
        "chatglm_tune.models.glm.modeling (family:glm) imports chatglm_tune.models.chatglm6b.config (family:chatglm6b)",
        "chatglm_tune.prefix (shared) imports chatglm_tune.models.registry (registry)",
    ]
    with pytest.raises(KeyError, match="in no room"):
        room("chatglm_tune.serving")


def test_the_package_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_imports_flow_one_way_through_the_rooms():
    assert violations(import_graph()) == []


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
