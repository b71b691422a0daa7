"""The documents cite benches and results that exist: every `bench/...` path in README.md, bench/README.md and
docs/*.md names a file or folder of this checkout (`{a,b}` alternatives each, a `*` pattern at least one file),
and every `python bench/....py` command names a script (a file with a `__main__` block)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A path starts at `bench/` (not inside another path: `chatglm_tune/bench/x` is not one) and ends at a letter,
# digit, `_`, `*` or `}`, so that the sentence's own `.`, `,` or `)` after it is left out.
BENCH_PATH = re.compile(r"(?<![\w/.-])bench/[\w./{},*-]*[\w*}]")
COMMAND = re.compile(r"\bpython3?\s+(bench/[\w./-]+\.py)\b")


def bench_paths(text: str) -> list[str]:
    """The `bench/...` paths cited in `text`, `{a,b}` alternatives spelled out, in order."""
    out = []
    for match in BENCH_PATH.finditer(text):
        path = match.group(0)
        braces = re.search(r"\{([^{}]*)\}", path)
        out += [path[: braces.start()] + alt + path[braces.end():] for alt in braces.group(1).split(",")] if braces else [path]
    return out


def commands(text: str) -> list[str]:
    """The scripts of the `python bench/....py` commands in `text`."""
    return COMMAND.findall(text)


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """The cited `bench/...` paths under `root` that name nothing there (a pattern: no file)."""
    return [p for p in bench_paths(text) if not (any(root.glob(p)) if "*" in p else (root / p).exists())]


def missing_scripts(text: str, root: Path = ROOT) -> list[str]:
    """The scripts of `python bench/....py` commands that are not there or have no `__main__` block."""
    return [s for s in commands(text)
            if not (root / s).is_file() or "__name__ == \"__main__\"" not in (root / s).read_text(encoding="utf-8")]


def test_the_bench_citations_of_the_documents_exist():
    assert (ROOT / "bench" / "README.md").is_file()
    found = {doc.relative_to(ROOT).as_posix(): missing_paths(doc.read_text(encoding="utf-8")) for doc in DOCUMENTS}
    assert {doc: paths for doc, paths in found.items() if paths} == {}


def test_the_bench_commands_of_the_documents_name_scripts():
    found = {doc.relative_to(ROOT).as_posix(): missing_scripts(doc.read_text(encoding="utf-8")) for doc in DOCUMENTS}
    assert {doc: scripts for doc, scripts in found.items() if scripts} == {}
    assert commands((ROOT / "bench" / "README.md").read_text(encoding="utf-8")), "bench/README.md shows no command"


def test_a_broken_citation_is_caught(tmp_path):
    (tmp_path / "bench" / "peer").mkdir(parents=True)
    (tmp_path / "bench" / "results").mkdir()
    (tmp_path / "bench" / "peer" / "peer.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "bench" / "peer" / "peer_report.py").write_text('"""imported, never run"""\n')
    (tmp_path / "bench" / "results" / "gpu.json").write_text("{}")
    text = ("Run `python bench/peer/peer.py --step write` (results: `bench/results/gpu.{json,md}`, "
            "bench/results/peer-*.md, bench/results/gpu*.json). Gone: `python bench/peer.py`, "
            "python bench/peer/peer_report.py, bench/results/peer-chatglm3-2m.md. Not citations: "
            "chatglm_tune/bench/x.py, `bench.peer.peer`.")
    assert bench_paths(text) == ["bench/peer/peer.py", "bench/results/gpu.json", "bench/results/gpu.md",
                                 "bench/results/peer-*.md", "bench/results/gpu*.json", "bench/peer.py",
                                 "bench/peer/peer_report.py", "bench/results/peer-chatglm3-2m.md"]
    assert missing_paths(text, tmp_path) == ["bench/results/gpu.md", "bench/results/peer-*.md", "bench/peer.py",
                                             "bench/results/peer-chatglm3-2m.md"]
    assert missing_scripts(text, tmp_path) == ["bench/peer.py", "bench/peer/peer_report.py"]
