"""`python train.py ARGS` in a checkout: `chatglm-tune train ARGS` (the code: chatglm_tune/cli/train.py)."""

import sys

from chatglm_tune.cli import train as _command

if __name__ == "__main__":
    status = _command.main()
    _command.exit_if_distributed(status)  # a distributed run ends here, without destructors
    sys.exit(status)
else:  # imported, `import train` is the command's module itself: what a program patches on it, the command sees.
    # Its names are copied too, for a loader that keeps this module (importlib's spec_from_file_location).
    globals().update({name: value for name, value in vars(_command).items() if not name.startswith("__")})
    sys.modules[__name__] = _command
