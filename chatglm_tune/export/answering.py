"""How an exported model is asked and how it answers, the same in every engine that runs the export.

A train.py run was trained on `instruction + text` as the user message (the run's `--prompt`) and infer.py
answers it greedily. So every chat template the export writes (the GGUF's, which llama.cpp's `llama-cli -cnv`
and `llama-server` apply; the hf directory's tokenizer_config.json, which transformers' `apply_chat_template`
and vLLM apply; the ollama Modelfile's TEMPLATE) puts the instruction before the last message where that
message is the user's, and every sampling default the export writes (GGUF `general.sampling.*`, which llama.cpp
takes as its defaults; generation_config.json; the Modelfile's PARAMETERs) is greedy. A plain model directory
keeps its version's template as released and the official chat()'s sampling.
"""

from __future__ import annotations

from chatglm_tune.options import DEFAULT_SAMPLING, SamplingOptions

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def jinja_string(text: str) -> str:
    """`text` as a double-quoted Jinja string literal (what Jinja2 and llama.cpp's Jinja engine both read)."""
    return '"' + "".join(_ESCAPES.get(ch, ch) for ch in text) + '"'


def with_instruction(template: str, instruction: str) -> str:
    """The Jinja chat `template` with `instruction` put before the content of the last message when it is a user
    message with text content; the template unchanged for no instruction. The messages are rewritten once, before
    the template runs, so the template itself (a released one included) stays as it was written."""
    if not instruction:
        return template
    return (
        "{% if messages and messages[-1]['role'] == 'user' and messages[-1]['content'] is string %}"
        "{% set messages = messages[:-1] + [{'role': 'user', 'content': "
        f"{jinja_string(instruction)} ~ messages[-1]['content']}}] %}}"
        "{% endif %}"
        + template
    )


def chat_template(prompt_format, tokenizer, instruction: str) -> str:
    """The Jinja chat template an export writes for a model of `prompt_format` asked with `instruction`."""
    return with_instruction(prompt_format.chat_template(tokenizer), instruction)


def sampling(prompt_format, is_run: bool) -> SamplingOptions:
    """The sampling an export writes as its defaults: greedy for a train.py run (as infer.py extracts), the
    official chat()'s for a model directory."""
    return DEFAULT_SAMPLING if is_run else prompt_format.chat_sampling


def engine_fields(options: SamplingOptions) -> dict:
    """`options` as the engines' sampling fields, {"temperature", "top_p", "top_k"}: greedy as temperature 0 (what
    llama.cpp, ollama and vLLM each take for greedy), top_p 1 and top_k 1; a sampler without top_k leaves it out."""
    if options.greedy:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 1}
    fields = {"temperature": options.temperature, "top_p": options.top_p}
    return fields if options.top_k is None else {**fields, "top_k": options.top_k}
