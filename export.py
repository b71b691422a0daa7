"""`python export.py ARGS` in a checkout: `chatglm-tune export ARGS` (the code: chatglm_tune/cli/export.py)."""

import sys

from chatglm_tune.cli import export as _command

if __name__ == "__main__":
    _command.main()
else:  # imported, `import export` is the command's module itself: what a program patches on it, the command sees.
    # Its names are copied too, for a loader that keeps this module (importlib's spec_from_file_location).
    globals().update({name: value for name, value in vars(_command).items() if not name.startswith("__")})
    sys.modules[__name__] = _command
