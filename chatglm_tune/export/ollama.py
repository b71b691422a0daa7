"""An ollama Modelfile beside a GGUF file: FROM, the version's prompt as ollama's Go TEMPLATE, its stop parameters,
its sampling parameters.

The template is the version's (`PromptFormat.ollama_template`, the same prompt as its Jinja chat template).
A train.py run was trained on `instruction + text` as the user message (the run's `--prompt`); its Modelfile puts
that instruction before the last user message and samples greedily (`PARAMETER temperature 0`), so
`ollama run NAME "TEXT"` extracts as infer.py does (export/answering.py: the same in every file of an export).
"""

from __future__ import annotations

import re

from chatglm_tune.export.answering import engine_fields
from chatglm_tune.options import SamplingOptions

MARK = "INSTRUCTION"  # where a template takes the run's instruction
_WRAPPED_MARK = re.compile(r"\{\{ if [^}]*\}\}" + MARK + r"\{\{ end \}\}")  # a mark inside its own condition


def modelfile(prompt_format, gguf_name: str, instruction: str = "", sampling: SamplingOptions | None = None) -> str:
    """The Modelfile of the GGUF file `gguf_name` (beside it) for a model of `prompt_format` asked with `instruction`,
    sampling with `sampling` (None: ollama's defaults); ValueError for an instruction that a Modelfile cannot hold as
    text, or a version without an ollama template."""
    if not prompt_format.ollama_template:
        raise ValueError(f"{prompt_format.title} has no ollama template")
    if any(bad in instruction for bad in ('"""', "{{", "}}")):
        raise ValueError(f"the run's prompt {instruction!r} holds \"\"\", {{{{ or }}}}, which an ollama TEMPLATE "
                         "cannot hold as plain text; send the instruction with each message instead")
    template = prompt_format.ollama_template
    if not instruction:
        template = _WRAPPED_MARK.sub("", template)
    template = template.replace(MARK, instruction)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in prompt_format.stop_texts]
    if sampling is not None:
        lines += [f"PARAMETER {name} {value:g}" for name, value in engine_fields(sampling).items()]
    if instruction:
        lines.insert(0, f"# Trained on user messages that begin {instruction!r}: the TEMPLATE adds it to the last one.")
    return "\n".join(lines) + "\n"
