"""Public names are promises: every name of `chatglm_tune.__all__` is imported and called, every `chatglm_tune...`
name the README's Python shows resolves, and every dotted name a docstring of the package cites (`batches.prompt_ids`,
`quant.apply.QuantizeOnLoad`, `BatchCache.prefill`) names something that exists, so a module that moves takes its
citations with it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

import chatglm_tune

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "chatglm_tune"

# A backticked dotted name in a docstring, optionally called: `a.b`, `a.b.c()`.
CITED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
# File names (`config.json`, `ice_text.model`) are not citations of code.
FILE_SUFFIXES = {"json", "jsonl", "model", "bin", "safetensors", "py", "cpp", "md", "yaml", "txt", "jinja",
                 "gguf", "html", "png", "so", "pt", "csv"}
# The first parts of dotted names that are objects or fields, not modules: `model.chat`, `config.pre_seq_len`,
# `self.x`. A cited name that starts with none of these, no module of the package and no importable module fails, so
# a docstring that names a module under an old name (`data.prompt_ids` after `data` became `batches`) is caught.
OBJECTS = {"self", "cls", "model", "config", "tokenizer", "args", "run_args", "transformer", "mlp",
           "layers", "accelerator", "call", "rope", "lora_B", "lora_A", "adapter_config", "adapter_model",
           "pytorch_model", "tokenizer_config", "stream_options", "general", "embedding", "module", "page", "settings",
           "encoding", "family", "linear", "options", "request", "ice_text", "infer", "train", "quantize",
           "exp_probs_b", "trainer_spec", "modeling_chatglm", "tokenization_chatglm", "configuration_chatglm",
           "finetune", "finetune_hf", "lm_head", "self_attn", "attn_hc", "conv1d"}
# Short names of outside modules and classes the docstrings use.
ALIASES = {"aten": "torch.ops.aten", "nn": "torch.nn", "F": "torch.nn.functional",
           "AutoConfig": "transformers.AutoConfig"}


# --------------------------------------------------------------------------------------------------------------------
# chatglm_tune.__all__, imported and called


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny ChatGLM-6B directory (character-level tokenizer, random weights), built with the public names."""
    from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer

    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = train_tokenizer(["发动机水温高，风扇始终是低速转动。", "制动钳异响"] * 4, directory, max_piece_length=1)
    torch.manual_seed(0)
    config = chatglm_tune.ChatGLMConfig.from_name("tiny", **tokenizer.config_overrides())
    chatglm_tune.ChatGLMForConditionalGeneration(config).save_pretrained(directory)
    return directory


def test_every_public_name_is_imported_and_called(tiny_dir):
    assert chatglm_tune.__all__ == ["ChatGLMConfig", "ChatGLMForConditionalGeneration", "ChatGLMModel",
                                    "ChatGLMTokenizer", "from_pretrained", "generate", "load_tokenizer"]
    tokenizer = chatglm_tune.load_tokenizer(tiny_dir)
    assert isinstance(tokenizer, chatglm_tune.ChatGLMTokenizer)
    assert chatglm_tune.ChatGLMTokenizer(tokenizer.vocab_file).encode("制动钳") == tokenizer.encode("制动钳")
    model = chatglm_tune.from_pretrained(tiny_dir)
    assert isinstance(model, chatglm_tune.ChatGLMForConditionalGeneration)
    assert isinstance(model.transformer, chatglm_tune.ChatGLMModel)
    ids = torch.tensor([tokenizer.encode("制动钳")])
    new = chatglm_tune.generate(model, ids, max_new_tokens=3, eos_token_id=None)
    assert len(new) == 1 and len(new[0]) == 3
    assert chatglm_tune.generate(model, ids, max_new_tokens=3, eos_token_id=None) == new  # greedy by default


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'generation'"):
        chatglm_tune.generation  # noqa: B018


# --------------------------------------------------------------------------------------------------------------------
# The README's names


def readme_names(text: str) -> list[str]:
    """The `chatglm_tune.x.y` names and `from chatglm_tune[.m] import a, b` names of the README's Python blocks."""
    blocks = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    names = re.findall(r"\bchatglm_tune(?:\.\w+)+", blocks)
    for module, imported in re.findall(r"from (chatglm_tune(?:\.\w+)*) import ([\w, ]+)", blocks):
        names += [f"{module}.{name.strip()}" for name in imported.split(",")]
    return sorted(set(names))


def resolves(dotted: str) -> bool:
    """Whether `dotted` (a module, or a module's attribute chain) exists, imported for real."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_the_readme_names_resolve():
    names = readme_names((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "chatglm_tune.from_pretrained" in names and "chatglm_tune.runs.loading" in names
    assert [n for n in names if not resolves(n)] == []


def test_a_moved_readme_name_is_caught():
    assert readme_names("```python\nfrom chatglm_tune import generation\nchatglm_tune.quantization.x()\n```") == [
        "chatglm_tune.generation", "chatglm_tune.quantization.x"]
    assert not resolves("chatglm_tune.generation") and not resolves("chatglm_tune.runs.loading.no_such_name")


# --------------------------------------------------------------------------------------------------------------------
# The docstrings' citations, resolved on the source (AST: nothing imported)


class Source:
    """What the package defines, read from its files: each module's top-level names, each class's names."""

    def __init__(self, package: Path):
        self.modules: dict[str, set[str]] = {}  # dotted path under the package -> top-level names
        self.classes: dict[str, set[str]] = {}  # class name -> names its body defines (any module)
        self.bases: dict[str, set[str]] = {}  # class name -> its bases' names
        self.docstrings: list[tuple[str, str]] = []  # (where, text)
        for path in sorted(package.rglob("*.py")):
            self._read(path, package)

    def _read(self, path: Path, package: Path) -> None:
        parts = path.relative_to(package).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        self.modules[dotted] = top_level_names(tree) | submodules(path) | lazy_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, set()).update(top_level_names(node) | instance_names(node))
                self.bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) and ast.get_docstring(node):
                where = f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', 1)}"
                self.docstrings.append((where, ast.get_docstring(node)))

    def module_paths(self, name: str) -> list[str]:
        """The package's modules that `name` may mean: a full dotted path, or its last parts (`apply`,
        `quant.apply`)."""
        if name == "chatglm_tune" or name.startswith("chatglm_tune."):  # a full path means that module only
            return [m for m in self.modules if m == name.removeprefix("chatglm_tune").removeprefix(".")]
        return [m for m in self.modules if m == name or m.endswith("." + name)]

    def problem(self, cited: str) -> str | None:
        """Why `cited` names nothing, or None where it resolves (or is not a citation of code)."""
        parts = cited.split(".")
        if parts[-1] in FILE_SUFFIXES or parts[0] in OBJECTS or any(len(p) == 1 and p.isupper() for p in parts[1:]):
            return None  # a file, an object's field, or a key pattern (`layers.N.mlp`)
        if parts[0] in ALIASES:
            return None if resolves(".".join([ALIASES[parts[0]], *parts[1:]])) else "no such name"
        for cut in range(len(parts), 0, -1):
            paths = self.module_paths(".".join(parts[:cut]))
            if paths:
                return None if any(self._has(m, parts[cut:])
                                   for m in paths) else f"{'.'.join(parts[cut:])} not in {paths}"
        if parts[0] in self.classes:
            return None if self.member(parts[0], parts[1]) else "no such member"
        return None if resolves(cited) else "no module or class of that name"

    def _has(self, module: str, attributes: list[str]) -> bool:
        if not attributes:
            return True
        if attributes[0] not in self.modules[module]:
            return False
        return len(attributes) == 1 or attributes[0] not in self.classes or self.member(attributes[0], attributes[1])

    def member(self, cls: str, name: str) -> bool:
        """Whether class `cls` defines `name`, itself or through its bases; a base from outside the package
        (nn.Module, a transformers class) may define anything."""
        if name in self.classes.get(cls, ()):
            return True
        return any(base not in self.classes or self.member(base, name) for base in self.bases.get(cls, ()) - {cls})


def top_level_names(node: ast.AST) -> set[str]:
    """The names a module or class body defines: functions, classes, assignments, imports."""
    names = set()
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, (ast.Assign, ast.AnnAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in child.names}
        elif isinstance(child, (ast.If, ast.Try)):
            names |= top_level_names(ast.Module(body=child.body + getattr(child, "orelse", []), type_ignores=[]))
    return names


def instance_names(node: ast.ClassDef) -> set[str]:
    """The attributes a class's methods set on `self`."""
    return {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def lazy_names(tree: ast.Module) -> set[str]:
    """The names a package hands out at first use: the keys of its top-level `_PUBLIC` table."""
    return {k.value for n in tree.body if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "_PUBLIC" for t in n.targets) for k in n.value.keys
            if isinstance(k, ast.Constant)}


def submodules(path: Path) -> set[str]:
    """A package's modules and subpackages, by name (for `quant.apply` on `quant/__init__.py`)."""
    if path.name != "__init__.py":
        return set()
    return {p.stem for p in path.parent.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()}


@pytest.fixture(scope="module")
def source() -> Source:
    return Source(PACKAGE)


def test_every_dotted_name_a_docstring_cites_exists(source):
    cited = [(where, name) for where, text in source.docstrings for name in CITED.findall(text)]
    assert len(cited) > 200
    problems = [f"{where}: `{name}`: {why}" for where, name in cited if (why := source.problem(name))]
    assert problems == []


@pytest.mark.parametrize("name", ["quantization.QuantizeOnLoad", "data.prompt_ids", "batches.no_such_function",
                                  "quant.apply.NoSuchClass", "chatglm_tune.generation.generate"])
def test_a_stale_citation_is_caught(source, name):
    assert source.problem(name)


@pytest.mark.parametrize("name", ["batches.prompt_ids", "quant.apply", "sampling.row_generators", "config.json",
                                  "model.chat", "torch.backends.cpu.get_cpu_capability",
                                  "decoding.generation.generate"])
def test_a_live_citation_resolves(source, name):
    assert source.problem(name) is None


# --------------------------------------------------------------------------------------------------------------------
# The lists of versions a reader sees


def test_the_registry_table_and_the_package_description_name_every_version():
    from chatglm_tune.models import registry

    table = ast.get_docstring(ast.parse((PACKAGE / "models" / "registry.py").read_text(encoding="utf-8")))
    listed = {line.split()[0] for line in table.splitlines() if line.startswith("    ")}
    assert listed == set(registry.VERSIONS)
    description = re.search(r'^description = "(.*)"$',
                            (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)
    for shown in ("ChatGLM-6B", "ChatGLM2", "ChatGLM3", "GLM-4", "GLM-4-0414", "GLM-Edge", "GLM-4.5", "GLM-4.7-Flash",
                  "GLM-5", "GLM-5.3-Flash"):
        assert shown in description
