"""`--config FILE.yaml`: a command's flags read from a YAML file, for every command (`CommandParser`).

The file is a mapping of flags to values:

    model: tiny                # --model tiny
    tuning: full
    train-file: data/spo_train.jsonl
    max_steps: 200             # dashes or underscores, as you like
    lora-target: [q_proj, v_proj]   # a flag that takes several values: a list
    packing: true              # a flag without a value: true gives it, false (or null) leaves it out

- a key is a long flag without its dashes (`max-steps` or `max_steps`); a positional argument is named as in the
  usage line (`model_dir`, `out_dir`);
- a value has the flag's type: an integer, a number, a string (a path), one of the flag's choices; a string that the
  flag would read on the command line is taken too (`lr: 1e-4`, which YAML reads as a string); a flag that takes
  several values, or that repeats, takes a list; a flag without a value takes true or false; `--no-X` flags are keys
  too (`no-speculative: true`), and `X: false` of an `--X / --no-X` pair is `--no-X`; null is the flag left out;
- flags on the command line win over the file: the file's values are the defaults of this command line. A flag of
  the command line also replaces the file's value of another flag it excludes (`--text` a file's `input`), and a
  repeated flag given on the command line replaces the file's list;
- paths are read as on the command line: relative to the current directory;
- booleans are YAML 1.2's, true and false: `no`, `off`, `on` and `yes` are strings (`mixed-precision: no`);
- an unknown key, a value of the wrong type and two keys for one setting are refused (exit 2), naming the file and
  the key, before anything else is done.

`settings_of` turns a parsed command line back into such a mapping (a training run's `run.yaml`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from contextlib import contextmanager
from pathlib import Path

from chatglm_tune import cli

_SKIP = object()  # a value that leaves its flag out (false for a flag without a value)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser with `--config FILE.yaml` (the module's docstring); its program name follows how the command
    was started (`cli.prog`)."""

    def __init__(self, *args, **kwargs):
        if cli.prog() is not None:
            kwargs.setdefault("prog", cli.prog())
        super().__init__(*args, **kwargs)
        self.add_argument("--config", metavar="FILE.yaml", help="read flags from this YAML file (keys: the long flags, "
                          "dashes or underscores; values typed as the flags'); flags given here win over the file's")
        self._given: set | None = None  # the actions the command line gives, while it is parsed with a file

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        path = config_path(args, self.prog)
        if path is None:
            return super().parse_known_args(args, namespace)
        settings = read_config(self, path)
        with file_defaults(self, settings) as defaults:
            self._given = set()
            try:
                namespace, extras = super().parse_known_args(args, namespace)
            finally:
                given, self._given = self._given, None
        command_line_wins(self, namespace, settings, given, defaults)
        return namespace, extras

    def _get_values(self, action, arg_strings):  # argparse calls it for each argument the command line gives
        if self._given is not None and (action.option_strings or arg_strings):
            self._given.add(action)
        return super()._get_values(action, arg_strings)


def config_path(args: list[str], prog: str) -> Path | None:
    """The `--config` file the command line `args` names (`--config F`, `--config=F`), or None."""
    finder = argparse.ArgumentParser(prog=prog, add_help=False)
    finder.add_argument("--config", nargs="?")
    found, _ = finder.parse_known_args(args)
    return None if found.config is None else Path(found.config)


class ConfigError(ValueError):
    """A problem of a config file, the file named."""


def read_config(parser: argparse.ArgumentParser, path: Path) -> dict:
    """{action: value} of the file at `path` for `parser`; the parser's error (exit 2) naming the file and the key of
    any problem."""
    try:
        return config_settings(parser, load_file(path), path)
    except ConfigError as err:
        parser.error(str(err))


def load_file(path: Path) -> dict:
    """The mapping a YAML file holds; ConfigError naming it where it cannot be read or is not one."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"--config {path}: cannot be read: {why}") from None
    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flags to values (`key: value` lines), got "
                          f"{_kind(data)}")
    return data


def _loader():
    """PyYAML's safe loader with YAML 1.2's booleans: true and false only, so that `mixed-precision: no` and
    `speculative: off` are the strings the flags take (YAML 1.1 reads yes / no / on / off as booleans)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag != bool_tag]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


def config_settings(parser: argparse.ArgumentParser, data: dict, path: Path) -> dict:
    """{action: value to set} of the mapping `data` read from `path`; ConfigError naming the file and the key of the
    first unknown key, badly typed value or pair of keys that do not combine."""
    settings, keys = {}, {}
    for key, value in data.items():
        action, negated = find_action(parser, key, path)
        if value is None:
            continue
        try:
            typed = typed_value(action, value, negated)
        except _Wrong as wrong:
            raise ConfigError(f"{path}: key {key!r}: expected {wrong.expected}, got {_shown(value)}") from None
        if typed is _SKIP:
            continue
        clash = next(((a, k) for a, k in keys.items() if a.dest == action.dest or _exclusive(parser, a, action)), None)
        if clash is not None:
            said = "set the same flag" if clash[0].dest == action.dest else "exclude each other"
            raise ConfigError(f"{path}: keys {clash[1]!r} and {key!r} {said}: give one")
        settings[action], keys[action] = typed, key
    return settings


def find_action(parser: argparse.ArgumentParser, key, path: Path) -> tuple[argparse.Action, bool]:
    """(the action a key names, whether it names the `--no-X` of an `--X / --no-X` pair); ConfigError naming the file
    and the key where none does."""
    flag = "--" + str(key).replace("_", "-")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == "config":
            continue
        if flag in action.option_strings:
            return action, isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")
        if not action.option_strings and str(key).replace("-", "_") == action.dest:
            return action, False
    if key == "config":
        raise ConfigError(f"{path}: key 'config': a config file cannot name another")
    names = [o[2:] for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.dest != "config"
             for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(str(key).replace("_", "-"), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" ({parser.prog} --help lists the flags)"
    raise ConfigError(f"{path}: unknown key {key!r}: {parser.prog} has no {flag}{hint}")


class _Wrong(Exception):
    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def typed_value(action: argparse.Action, value, negated: bool = False):
    """`value` of a config file as the flag `action` takes it (what the command line would set), or _SKIP for a flag
    left out; _Wrong naming what was expected otherwise."""
    if action.nargs == 0:  # --flag without a value: store_true / store_false / store_const, --X / --no-X
        if not isinstance(value, bool):
            raise _Wrong("true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value != negated
        return action.const if value else _SKIP
    if action.nargs == "?" and action.const is not None and isinstance(value, bool):
        return action.const if value else _SKIP  # --compile alone; --compile BACKEND is a string
    several = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if not several:
        return scalar(action, value)
    what = f"a list of {_expected(action, plural=True)}"
    if not isinstance(value, list):
        raise _Wrong(what)
    if action.nargs == "+" and not value:
        raise _Wrong(f"{what}, at least one")
    if isinstance(action.nargs, int) and len(value) != action.nargs:
        raise _Wrong(f"{what}, {action.nargs} of them")
    try:
        return [scalar(action, item) for item in value]
    except _Wrong:
        raise _Wrong(what) from None


def scalar(action: argparse.Action, value):
    """One value of the flag `action`: of its type (an int is a number too), or a string its type reads."""
    kind = action.type
    if isinstance(value, (bool, list, dict)) or value is None:
        raise _Wrong(_expected(action))
    try:
        if kind is int and isinstance(value, int) or kind is float and isinstance(value, (int, float)):
            typed = kind(value)
        elif isinstance(value, str):
            typed = value if kind is None else kind(value)
        else:
            raise _Wrong(_expected(action))
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise _Wrong(_expected(action)) from None
    if action.choices is not None and typed not in action.choices:
        raise _Wrong(_expected(action))
    return typed


def _expected(action: argparse.Action, plural: bool = False) -> str:
    if action.choices is not None:
        return ("values of " if plural else "one of ") + ", ".join(map(str, action.choices))
    names = {int: ("an integer", "integers"), float: ("a number", "numbers"), None: ("a string", "strings"),
             str: ("a string", "strings"), Path: ("a path (a string)", "paths (strings)")}
    if action.type in names:
        return names[action.type][plural]
    return f"{'strings' if plural else 'a string'} that {getattr(action.type, '__name__', action.type)} reads"


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", bool: "true or false", str: "a string", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    text = repr(value)
    return f"{_kind(value)} ({text if len(text) <= 60 else text[:57] + '...'})"


def _exclusive(parser: argparse.ArgumentParser, a: argparse.Action, b: argparse.Action) -> bool:
    """Whether the actions `a` and `b` are of one mutually exclusive group."""
    groups = parser._mutually_exclusive_groups
    return a is not b and any(a in g._group_actions and b in g._group_actions for g in groups)


@contextmanager
def file_defaults(parser: argparse.ArgumentParser, settings: dict):
    """While parsing: the file's values as the defaults of their flags (and of flags sharing their destination),
    required flags and groups the file gives no longer required, a positional the file gives optional. Yields the
    defaults before (destination -> default), for `command_line_wins`; afterwards the parser is as it was."""
    saved = [(a, a.default, a.required, a.nargs) for a in parser._actions]
    groups = [(g, g.required) for g in parser._mutually_exclusive_groups]
    defaults = {a.dest: a.default for a in reversed(parser._actions)}  # the first action's, as argparse applies
    dests = {action.dest: value for action, value in settings.items()}
    try:
        for action in parser._actions:
            if action.dest in dests:
                action.default, action.required = dests[action.dest], False
                if not action.option_strings and action.nargs is None:
                    action.nargs = "?"
        for group, _ in groups:
            if any(action in settings for action in group._group_actions):
                group.required = False
        yield defaults
    finally:
        for action, default, required, nargs in saved:
            action.default, action.required, action.nargs = default, required, nargs
        for group, required in groups:
            group.required = required


def command_line_wins(parser, namespace, settings: dict, given: set, defaults: dict) -> None:
    """After parsing with a file's values as defaults: a repeated flag the command line gives holds only its values,
    and a file's value of a flag that a flag of the command line excludes is dropped (its default back)."""
    for action, value in settings.items():
        if action in given and isinstance(action, argparse._AppendAction):
            setattr(namespace, action.dest, getattr(namespace, action.dest)[len(value):])
        elif action not in given and any(_exclusive(parser, action, other) and other.dest != action.dest
                                         for other in given):
            setattr(namespace, action.dest, defaults[action.dest])


def settings_of(parser: argparse.ArgumentParser, args: argparse.Namespace, *, skip=()) -> dict:
    """The config file that gives `args` (parsed by `parser`), as a mapping: each flag set to a value (those left at
    None and the `skip` destinations aside) under its long name without dashes; paths as strings, tuples as lists."""
    out, seen = {}, set(skip) | {"help", "config"}
    for action in parser._actions:
        if action.dest in seen or isinstance(action, argparse._HelpAction):
            continue
        seen.add(action.dest)
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        long = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        key = long[0][2:] if long else action.dest
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            if value == action.default:
                continue  # a flag without a value, not given: left out
            value = True
        out[key] = _plain(value)
    return out


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value

