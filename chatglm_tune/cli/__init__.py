"""The command lines, a module each: `train`, `infer`, `quantize`, `serve` and `export` (each with `parse_args(argv)`
and `main(argv)`). They run as `chatglm-tune COMMAND ...` (the installed command, `main`), as `python -m chatglm_tune
COMMAND ...`, or from a checkout as `python COMMAND.py ...`; `config` reads the `--config FILE.yaml` every one takes.

The package sits above every other: nothing of `chatglm_tune` imports it. Importing it imports nothing else, so that
`chatglm-tune --help` answers at once; a command's module is imported when that command is chosen.
"""

from __future__ import annotations

import sys

# The commands and what each does, in a line (`chatglm-tune --help`).
COMMANDS = {
    "train": "fine-tune ChatGLM / GLM: P-tuning v2, LoRA (QLoRA on an INT8/INT4 base) or full fine-tuning",
    "infer": "extract SPO triples or answer prompts with a model or training run (a .jsonl file or one --text)",
    "quantize": "quantize a model or training run to INT8 / INT4 weights in the official layout",
    "serve": "serve a model or training run over OpenAI's HTTP API, with continuous batching",
    "export": "export a model or training run to GGUF (llama.cpp, ollama), a transformers directory or GGML",
}

# How this process was started, where `main` dispatched the command: the words that run it (`chatglm-tune`, or the
# interpreter, `-m`, `chatglm_tune`), the same shown short, and the command. Empty for a command run otherwise.
_started: dict = {}


def started(words: list[str], shown: str, command: str) -> None:
    """Record that `main` runs `command`, started as `words` (shown as `shown` in usage lines and hints)."""
    _started.update(words=list(words), shown=shown, command=command)


def prog() -> str | None:
    """The program name a command's usage line shows: `chatglm-tune train` where dispatched, else None (argparse's
    own: the script's file name)."""
    return f"{_started['shown']} {_started['command']}" if _started else None


def command_words(script: str, argv) -> list[str]:
    """The words that run `script`'s command again as this process ran it: `chatglm-tune train` (or the interpreter
    with `-m chatglm_tune train`) where dispatched; the interpreter and the script as started where it ran as a script
    (`argv` None: the command line is `sys.argv`); else the interpreter and `script` (its `main` called in a
    program)."""
    if _started:
        return [*_started["words"], _started["command"]]
    return [sys.executable, sys.argv[0] if argv is None else script]


def hint(command: str) -> str:
    """How a printed hint names another command: as this one was started (`chatglm-tune infer`), else as the
    repository's script (`python infer.py`)."""
    return f"{_started['shown']} {command}" if _started else f"python {command}.py"
