"""The documents hold what they show: in README.md, bench/README.md and docs/*.md every `bench/...` path names a
file or folder of this checkout (`{a,b}` alternatives each, a `*` pattern at least one file), every `python
bench/....py` command names a script (a file with a `__main__` block), every command of the five CLIs in a shell
block (`python train.py ...`, `chatglm-tune train ...`, ...) parses with that CLI's own parser, and every relative
link names a file (and heading) that exists; and README.md stays a front door of at most 250 lines."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
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
        out += ([path[: braces.start()] + alt + path[braces.end():] for alt in braces.group(1).split(",")]
                if braces else [path])
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


# --------------------------------------------------------------------------------------------------------------------
# The commands of the five CLIs a document shows parse with their own parsers

CLIS = ("train", "infer", "quantize", "serve", "export")  # `python <cli>.py args` = `chatglm-tune <cli> args`
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A placeholder a document writes for a path of its reader's (`<run>`, `<the mid GLM-4>`, `$RUN`, `${RUN}`) is
# replaced by this fixed dummy path before parsing: the parsers take any path; none is read.
PLACEHOLDER = re.compile(r"<[^\s<>][^<>]*>|\$\{?[A-Za-z_]\w*\}?")
DUMMY_PATH = "placeholder/path"
ELIDED = re.compile(r"(?<!\S)\.\.\.(?!\S)")  # a bare `...`: the reader's own arguments (a quoted "..." is a value)
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1", "&>"}
REQUIRED = "the following arguments are required: "
ONE_OF = re.compile(r"one of the arguments (.+) is required")


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of each command in the document's ```bash / ```sh / ```console blocks,
    `\\` continuations joined; in a console block only the `$ ` lines (their prompt cut off)."""
    out = []
    for block in SHELL_BLOCK.finditer(text):
        console = block.group(0).startswith("```console")
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", 0
        for number, line in enumerate(block.group(1).splitlines(), first):
            start = start if pending else number
            joined = pending + line
            if joined.endswith("\\"):
                pending = joined[:-1] + " "
                continue
            pending = ""
            if console and not joined.startswith("$ "):
                continue
            out.append((start, joined[2:] if console else joined))
    return out


def cli_commands(line: str) -> list[tuple[str, list[str], bool]]:
    """(cli, its arguments, whether `...` elided some) of each `python <cli>.py ...` or `chatglm-tune <cli> ...`
    command of a shell line (split on `&&` and the other operators; `VAR=value` prefixes and comments skipped)."""
    words = shlex.split(ELIDED.sub(" __elided__ ", PLACEHOLDER.sub(DUMMY_PATH, line)), comments=True)
    segments, current = [], []
    for word in words:
        if word in SHELL_OPERATORS:
            segments.append(current)
            current = []
        else:
            current.append(word)
    found = []
    for segment in [*segments, current]:
        while segment and re.fullmatch(r"[A-Za-z_]\w*=\S*", segment[0]):
            segment = segment[1:]
        if segment[:1] in (["python"], ["python3"]) and segment[1:2] in ([f"{c}.py"] for c in CLIS):
            cli, args = segment[1][:-3], segment[2:]
        elif segment[:1] == ["chatglm-tune"] and segment[1:2] in ([c] for c in CLIS):
            cli, args = segment[1], segment[2:]
        else:
            continue
        found.append((cli, [a for a in args if a != "__elided__"], "__elided__" in args))
    return found


def parser_error(cli: str, args: list[str]) -> str | None:
    """argparse's message where `<cli>.parse_args(args)` exits with an error (None where it parses, `--help`
    included): the root script's own parser, imported from the repository root."""
    module = importlib.import_module(cli)
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
            module.parse_args(args)
    except SystemExit as stop:
        if stop.code not in (0, None):
            lines = [line for line in out.getvalue().splitlines() if line.strip()]
            return lines[-1].split(" error: ", 1)[-1] if lines else f"exit status {stop.code}"
    return None


def elided_error(cli: str, args: list[str], depth: int = 0) -> str | None:
    """The error of a command whose `...` stands for the reader's own arguments: what it shows must parse, and
    what it leaves out may be required (each missing argument gets the dummy path, a required group the first of
    its options that parses)."""
    error = parser_error(cli, args)
    if error is None or depth == 3:
        return error
    if error.startswith(REQUIRED):
        names = error[len(REQUIRED):].split(", ")
        options = [w for n in names if n.startswith("-") for w in (n.split("/")[-1], DUMMY_PATH)]
        return elided_error(cli, [DUMMY_PATH for n in names if not n.startswith("-")] + args + options, depth + 1)
    if ONE_OF.fullmatch(error):
        options = ONE_OF.fullmatch(error).group(1).split()
        return None if None in [elided_error(cli, [*args, o, DUMMY_PATH], depth + 1) for o in options] else error
    return error


def cli_problems(text: str, name: str) -> list[str]:
    """'file:line: cli args: why' for each command of the document that its CLI's parser refuses."""
    problems = []
    for number, line in shell_lines(text):
        try:
            commands = cli_commands(line)
        except ValueError as err:  # unbalanced quotes
            problems.append(f"{name}:{number}: {line.strip()}: {err}")
            continue
        for cli, args, elided in commands:
            error = elided_error(cli, args) if elided else parser_error(cli, args)
            if error:
                problems.append(f"{name}:{number}: {cli} {shlex.join(args)}: {error}")
    return problems


def test_the_cli_commands_of_the_documents_parse():
    names = {doc: doc.relative_to(ROOT).as_posix() for doc in DOCUMENTS}
    found = {names[doc]: cli_problems(doc.read_text(encoding="utf-8"), names[doc]) for doc in DOCUMENTS}
    assert {doc: problems for doc, problems in found.items() if problems} == {}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = {cli for _, line in shell_lines(readme) for cli, _, _ in cli_commands(line)}
    assert shown == set(CLIS), "the README shows a command of each CLI"


def test_a_bad_flag_in_a_document_is_caught():
    text = """Text, not a block: python train.py --no-such-flag.

```bash
# the main job
pip install -e . && python train.py --model tiny --tuning full --train-file a.jsonl --output-dir <run> && \\
    python infer.py --model $RUN --text "..." --batch-size 2   # a comment's ' is no quote
OMP_NUM_THREADS=1 python infer.py --model <the mid GLM-4> --input a.jsonl --output b.jsonl > log.txt
python train.py --model /models/chatglm-6b --tuning lora --lora-r 8 ...
python quantize.py --bits 4 ...
python train.py --model tiny --tuning full --train-file a.jsonl --output-dir x --pre-seq-len-typo 8
python infer.py --model x ... --speculative maybe
```

```console
$ chatglm-tune export in out --format gguf --type q3_k
$ chatglm-tune serve --model x --port 8000
INFO: output, not a command: python serve.py --no-such-flag
```

```python
# Python, not a shell: python serve.py --no-such-flag
```
"""
    assert [(n, cli, args) for n, line in shell_lines(text) for cli, args, _ in cli_commands(line)] == [
        (5, "train", ["--model", "tiny", "--tuning", "full", "--train-file", "a.jsonl", "--output-dir", DUMMY_PATH]),
        (5, "infer", ["--model", DUMMY_PATH, "--text", "...", "--batch-size", "2"]),
        (7, "infer", ["--model", DUMMY_PATH, "--input", "a.jsonl", "--output", "b.jsonl"]),
        (8, "train", ["--model", "/models/chatglm-6b", "--tuning", "lora", "--lora-r", "8"]),
        (9, "quantize", ["--bits", "4"]),
        (10, "train", ["--model", "tiny", "--tuning", "full", "--train-file", "a.jsonl", "--output-dir", "x",
                       "--pre-seq-len-typo", "8"]),
        (11, "infer", ["--model", "x", "--speculative", "maybe"]),
        (15, "export", ["in", "out", "--format", "gguf", "--type", "q3_k"]),
        (16, "serve", ["--model", "x", "--port", "8000"])]
    problems = cli_problems(text, "fake.md")
    assert [p.split(": ", 1)[0] for p in problems] == ["fake.md:10", "fake.md:11", "fake.md:15"]
    assert "unrecognized arguments: --pre-seq-len-typo 8" in problems[0]
    assert "--speculative: invalid choice: 'maybe'" in problems[1]
    assert "--type: invalid choice: 'q3_k'" in problems[2]
    assert cli_problems("```sh\npython infer.py --model x\n```\n", "f.md") == [
        "f.md:2: infer --model x: one of the arguments --input --text is required"]


# --------------------------------------------------------------------------------------------------------------------
# Links and length

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)  # code blocks: no headings, no links
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
README_MAX_LINES = 250


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to `-`)."""
    headings = HEADING.findall(FENCED.sub("", text))
    slugs = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings]
    return {slug if not slugs[:i].count(slug) else f"{slug}-{slugs[:i].count(slug)}" for i, slug in enumerate(slugs)}


def broken_links(text: str, where: Path) -> list[str]:
    """The relative links of a Markdown file at `where` whose file (or heading anchor in a Markdown file) is not
    there; links to web pages are not followed."""
    out = []
    for target in LINK.findall(FENCED.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (where.parent / path).resolve()
        missing = bool(path) and not file.exists()
        if not missing and anchor and (not path or file.suffix == ".md"):
            missing = anchor not in heading_anchors(file.read_text(encoding="utf-8") if path else text)
        if missing:
            out.append(target)
    return out


def test_the_documents_link_only_to_files_that_exist():
    found = {doc.relative_to(ROOT).as_posix(): broken_links(doc.read_text(encoding="utf-8"), doc) for doc in DOCUMENTS}
    assert {doc: links for doc, links in found.items() if links} == {}


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "training.md").write_text("# Training\n\n## Resuming a run\n\n## Resuming a run\n")
    (tmp_path / "README.md").write_text("x")
    text = ("[ok](docs/training.md) [ok](docs/training.md#resuming-a-run) [ok](docs/training.md#resuming-a-run-1) "
            "![img](docs/gone.png) [gone](docs/serving.md) [anchor](docs/training.md#no-such) "
            "[web](https://example.org/x) [here](#top)\n```bash\n[not a link](nowhere.md)\n```\n# Top\n")
    assert broken_links(text, tmp_path / "README.md") == ["docs/gone.png", "docs/serving.md",
                                                          "docs/training.md#no-such"]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/ (at most {README_MAX_LINES})"
