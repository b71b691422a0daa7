"""`chatglm-tune COMMAND ...`: the installed command (and `python -m chatglm_tune`) runs one of the command lines
with the rest of its arguments; `chatglm-tune --help` lists them without importing any (nor torch)."""

from __future__ import annotations

import importlib
import os
import shutil
import sys

from chatglm_tune import cli

NAME = "chatglm-tune"


def usage(shown: str) -> str:
    width = max(map(len, cli.COMMANDS))
    lines = [f"usage: {shown} COMMAND [--config FILE.yaml] [flags ...]", "",
             "Fine-tune, run, quantize, serve and export ChatGLM / GLM models.", "", "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, line in cli.COMMANDS.items()]
    lines += ["", f"{shown} COMMAND --help shows a command's flags; --config FILE.yaml reads them from a file",
              "(any long flag as a key), flags on the command line winning over the file's."]
    return "\n".join(lines)


def launcher(module_run: bool) -> tuple[list[str], str]:
    """(the words that start this program, as shown): the interpreter with `-m chatglm_tune`, or the installed
    command, by its name where that finds it on PATH, else by its path."""
    if module_run:
        return [sys.executable, "-m", "chatglm_tune"], "python -m chatglm_tune"
    started = sys.argv[0] if sys.argv and sys.argv[0] else NAME
    name = os.path.basename(started)
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(started):
        return [name], name
    return [started], started


def main(argv=None, *, module_run: bool = False):
    """Run `argv`'s command (default: this process's arguments) with the rest of it; its exit status (None: 0). The
    command's `main` may end the process itself, as it does run from its script (an error's exit status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    words, shown = launcher(module_run)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(shown), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in cli.COMMANDS:
        print(f"{usage(shown).splitlines()[0]}\n{shown}: error: unknown command {command!r} (choose from "
              f"{', '.join(cli.COMMANDS)})", file=sys.stderr)
        return 2
    cli.started(words, shown, command)
    module = importlib.import_module(f"chatglm_tune.cli.{command}")
    status = module.main(rest)
    if hasattr(module, "exit_if_distributed"):  # train: a process of a distributed run ends without destructors
        module.exit_if_distributed(status)
    return status
