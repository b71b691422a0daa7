"""`python -m chatglm_tune COMMAND ...`: the same as the installed `chatglm-tune COMMAND ...` (`cli.main`)."""

import sys

from chatglm_tune.cli.main import main

if __name__ == "__main__":
    sys.exit(main(module_run=True))
