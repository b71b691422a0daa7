"""Building the toolkit's C++ CPU kernels at first use (`int4_cpu`, `int8dot_cpu`): one compile per machine,
cached by PyTorch under ~/.cache/torch_extensions, and a single warning where it cannot be done."""

from __future__ import annotations

import inspect
import platform
import subprocess
import warnings


def x86() -> bool:
    """Whether this machine is x86-64 (the only one the kernels are written for)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def build(name: str, source: str, cflags: list[str], what: str, otherwise: str) -> bool:
    """Compile and load `source` as the op library `name` (OpenMP, -O3 plus `cflags`). False, with one warning naming
    `what` could not be built and what runs `otherwise`, where there is no compiler / ninja or the build fails."""
    from torch.utils import cpp_extension

    # without torch/extension.h (pybind11): a faster build; the option exists from torch 2.6
    lean_option = "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters
    lean = {"no_implicit_headers": True} if lean_option else {}
    try:
        cpp_extension.load_inline(name, source, extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                                  is_python_module=False, **lean)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:  # no compiler / ninja, or a failed build
        warnings.warn(f"chatglm_tune.{name.removeprefix('chatglm_')}: {what} could not be built ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); {otherwise}")
        return False
    return True
