"""The repository passes `ruff check` under the configuration in pyproject.toml (`[tool.ruff]`). Skipped where ruff
is not installed (`pip install -e ".[dev]"` installs it)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff_command() -> list[str] | None:
    """How ruff runs here: its module under this interpreter, else a `ruff` on PATH; None where there is neither."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def ruff(*args) -> subprocess.CompletedProcess:
    command = ruff_command()
    if command is None:
        pytest.skip('ruff is not installed here (pip install -e ".[dev]" installs it)')
    return subprocess.run([*command, "check", "--no-cache", "--output-format", "concise", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ruff_check_finds_nothing_in_the_repository():
    done = ruff(".")
    assert done.returncode == 0, done.stdout + done.stderr


def string_line(width: int) -> str:
    """`x = "..."`, `width` columns long, with a space inside (ruff lets a line of one word run long)."""
    return 'x = "' + "a" * 50 + " " + "b" * (width - 57) + '"'


def test_the_configuration_is_the_one_ruff_reads(tmp_path):
    """pyproject.toml's settings apply: a line of 120 columns passes, one of 121 does not; an unused import is
    caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"import os\n\n{string_line(120)}\n", encoding="utf-8")
    done = ruff("--config", ROOT / "pyproject.toml", probe)
    assert done.returncode == 1 and "F401" in done.stdout and "E501" not in done.stdout, done.stdout + done.stderr
    probe.write_text(f"{string_line(121)}\n", encoding="utf-8")
    done = ruff("--config", ROOT / "pyproject.toml", probe)
    assert done.returncode == 1 and "E501" in done.stdout, done.stdout + done.stderr
