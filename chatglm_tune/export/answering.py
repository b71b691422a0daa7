"""How an exported model is asked and how it answers, the same in every engine that runs the export.

A train.py run was trained on `instruction + text` as the user message (the run's `--prompt`) and infer.py
answers it greedily. So every chat template the export writes (the GGUF's, which llama.cpp's `llama-cli -cnv`
and `llama-server` apply; the hf directory's tokenizer_config.json, which transformers' `apply_chat_template`
and vLLM apply; the ollama Modelfile's TEMPLATE) puts the instruction before the last message where that
message is the user's, and every sampling default the export writes (GGUF `general.sampling.*`, which llama.cpp
takes as its defaults; generation_config.json; the Modelfile's PARAMETERs) is greedy. A plain model directory
keeps its version's template as released and the official chat()'s sampling.

ChatGLM3-6B's, GLM-4-9B's and GLM-4-0414's templates also take tool conversations in OpenAI's form, as llama.cpp's
`llama-server --jinja` and transformers' `apply_chat_template(messages, tools=...)` pass them, and write the
prompt serve.py writes for the same request (`tool_messages`): `tools` offered as serve.py offers them
(`offer_tools`), an assistant's `tool_calls` as the messages the model writes for them (`metadata` the name,
the arguments in the version's form), a `tool` message as `observation`, `developer` as `system`. Arguments
must be an object (llama-server parses a JSON string into one for these templates, as vLLM does; a template
cannot parse JSON): a string raises. What the template cannot write exactly raises (`raise_exception`) rather
than writing something else: a float anywhere in the arguments (llama.cpp writes 2.0 as 2, 1.5e-07 as 0.0);
for ChatGLM3, whose arguments are Python literals (`tool_call(k=v)`), a name that is not an ASCII identifier,
a list or object value, and a string holding a control, format or separator character that `repr` escapes
(other than tab, newline and carriage return, which it escapes as repr does). Not caught: private-use and
unassigned characters, which `repr` escapes and the template writes as they are.
"""

from __future__ import annotations

import json
import keyword
import unicodedata
from dataclasses import dataclass

from chatglm_tune.data.dialogues import TOOL_PROMPT
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


def jinja_list(texts) -> str:
    """`texts` as a Jinja list literal of strings."""
    return "[" + ", ".join(jinja_string(text) for text in texts) + "]"


# Characters Python's repr escapes, past the ASCII controls (which `tojson` escapes): DEL, C1 controls, format,
# space (but " ") and line / paragraph separator characters.
_ESCAPED_BY_REPR = [chr(c) for c in range(0x7F, 0x110000)
                    if unicodedata.category(chr(c)) in ("Cc", "Cf", "Zs", "Zl", "Zp")]
_NOT_IN_NAMES = [c for c in map(chr, range(0x20, 0x7F)) if not (c.isalnum() or c == "_")]
_REFUSE = ("{%- macro _refuse_any(chars, text, why) -%}{%- for char in chars -%}{%- if char in text -%}"
           "{{- raise_exception(why) -}}{%- endif -%}{%- endfor -%}{%- endmacro -%}")
_NO_FLOATS = (  # a float anywhere in `value` raises: engines write floats unlike json.dumps and repr
    "{%- macro _no_floats(value) -%}{%- if value is float -%}"
    "{{- raise_exception('a tool call argument is a float (' ~ value ~ '), which this template cannot write exactly') "
    "-}}{%- elif value is mapping -%}{%- for item in value.values() -%}{{- _no_floats(item) -}}{%- endfor -%}"
    "{%- elif value is iterable and value is not string -%}{%- for item in value -%}{{- _no_floats(item) -}}{%- endfor "
    "-%}{%- endif -%}{%- endmacro -%}"
)
_GLM4_ARGUMENTS = "{%- macro _arguments(value) -%}{{- _no_floats(value) -}}{{- value | tojson -}}{%- endmacro -%}"
_PYTHON_STRING = r"""{%- macro _repr_string(value) -%}
{{- _refuse_any(ESCAPED, value, 'a tool call argument holds a character that Python writes escaped: this template cannot write it') -}}
{%- set bare = value.replace('\\', '').replace('"', '').replace('\n', '').replace('\r', '').replace('\t', '') -%}
{%- if bare | tojson != '"' ~ bare ~ '"' -%}
{{- raise_exception('a tool call argument holds a control character: this template cannot write it') -}}
{%- endif -%}
{%- set quote = '"' if "'" in value and '"' not in value else "'" -%}
{%- set text = value.replace('\\', '\\\\') -%}
{%- if quote == "'" -%}{%- set text = text.replace("'", "\\'") -%}{%- endif -%}
{{- quote ~ text.replace('\n', '\\n').replace('\r', '\\r').replace('\t', '\\t') ~ quote -}}
{%- endmacro -%}"""  # noqa: E501 -- the template's text is exported as it is: its long lines are kept, not wrapped
_PYTHON_ARGUMENTS = r"""{%- macro _repr(value) -%}
{%- if value is none -%}None{%- elif value is boolean -%}{{- 'True' if value else 'False' -}}
{%- elif value is integer -%}{{- value | string -}}{%- elif value is string -%}{{- _repr_string(value) -}}
{%- else -%}{{- raise_exception('ChatGLM3-6B writes tool call arguments as Python literals: this template cannot write ' ~ (value | tojson)) -}}
{%- endif -%}{%- endmacro -%}
{%- macro _arguments(value) -%}```python
tool_call({%- for name, item in value.items() -%}
{%- set why = 'ChatGLM3-6B writes tool call arguments as Python keyword arguments: this template cannot write ' ~ (name | tojson) -%}
{%- if not (name is string and name and name | tojson(ensure_ascii=True) == '"' ~ name ~ '"' and name[:1] not in '0123456789' and name not in KEYWORDS) -%}
{{- raise_exception(why) -}}{%- endif -%}{{- _refuse_any(NOT_IN_NAMES, name, why) -}}
{{- (', ' if not loop.first else '') ~ name ~ '=' ~ _repr(item) -}}
{%- endfor -%})
```{%- endmacro -%}"""  # noqa: E501 -- the template's text is exported as it is: its long lines are kept, not wrapped
_CHATGLM3_ARGUMENTS = (_PYTHON_STRING.replace("\n{", "{").replace("ESCAPED", jinja_list(_ESCAPED_BY_REPR))
                       + _PYTHON_ARGUMENTS.replace("-%}\n{", "-%}{").replace("KEYWORDS", jinja_list(keyword.kwlist))
                       .replace("NOT_IN_NAMES", jinja_list(_NOT_IN_NAMES)))
# The messages in the GLM form (what serve.py's `Service._role_messages` and `offer_tools` make of OpenAI's).
_GLM_MESSAGES = r"""{%- set glm = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- set role = {'tool': 'observation', 'developer': 'system'}.get(message['role'], message['role']) -%}
{%- if message['tool_calls'] is defined and message['tool_calls'] -%}
{%- if message['content'] -%}
{%- set glm.messages = glm.messages + [{'role': role, 'content': message['content']}] -%}
{%- endif -%}
{%- for call in message['tool_calls'] -%}
{%- if call['function']['arguments'] is string -%}
{{- raise_exception('tool call arguments as a JSON string: this template takes them parsed, as an object') -}}
{%- endif -%}
{%- set glm.messages = glm.messages + [{'role': 'assistant', 'metadata': call['function']['name'],
 'content': _arguments(call['function']['arguments'])}] -%}
{%- endfor -%}
{%- elif role != message['role'] -%}
{%- set glm.messages = glm.messages + [{'role': role, 'content': message['content']}] -%}
{%- else -%}{%- set glm.messages = glm.messages + [message] -%}{%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools -%}OFFER{%- endif -%}
{%- set messages = glm.messages -%}""".replace("\n", "")
# ChatGLM3: a system message of its own, first: its tool prompt and the functions (OpenAI's tools unwrapped).
_CHATGLM3_OFFER = r"""{%- set functions = namespace(list=[]) -%}
{%- for tool in tools -%}
{%- set functions.list = functions.list + [tool['function'] if tool['type'] == 'function'
 and tool['function'] is defined else tool] -%}
{%- endfor -%}
{%- set glm.messages = [{'role': 'system', 'content': PROMPT, 'tools': functions.list}] + glm.messages -%}"""
# GLM-4: the tools as sent, in the first system message, or in a new one first.
_GLM4_OFFER = r"""{%- if glm.messages and glm.messages[0]['role'] == 'system' -%}
{%- set glm.messages = [{'role': 'system', 'content': glm.messages[0]['content'], 'tools': tools}]
 + glm.messages[1:] -%}
{%- else -%}{%- set glm.messages = [{'role': 'system', 'content': '', 'tools': tools}] + glm.messages -%}
{%- endif -%}"""
# GLM-4-0414: a first system message's tools (GLM-4's form, as serve.py offers them) are the template's `tools`.
_LIFT_TOOLS = ("{%- if messages and messages[0]['tools'] is defined and messages[0]['tools'] and not (tools is defined "
               "and tools) -%}{%- set tools = messages[0]['tools'] -%}{%- if messages[0]['content'] -%}"
               "{%- set messages = [{'role': 'system', 'content': messages[0]['content']}] + messages[1:] -%}"
               "{%- else -%}{%- set messages = messages[1:] -%}{%- endif -%}{%- endif -%}")
# GLM-4-0414 with tools offered: the prompt ends at `<|assistant|>` (the model writes a call's name or a text answer's
# "\n" there), not at the template's generation prompt, which the template then does not write.
_HOLD_GENERATION_PROMPT = ("{%- set tool_prompt = false -%}{%- if add_generation_prompt and tools is defined and tools "
                           "-%}{%- set tool_prompt = true -%}{%- set add_generation_prompt = false -%}{%- endif -%}")
_TOOL_PROMPT_END = "{%- if tool_prompt %}<|assistant|>{% endif -%}"


@dataclass(frozen=True)
class ToolForm:
    """How a version's exported template takes OpenAI-form tool conversations."""

    offer: str  # how tools are offered (Jinja run with `glm.messages` built)
    arguments: str  # the `_arguments` macro: how a call's arguments are written
    before: str = ""  # Jinja run first, on the messages as sent
    after: str = ""  # Jinja run after the rewrite, before the template
    end: str = ""  # Jinja after the template


_TOOL_FORMS = {
    "chatglm3": ToolForm(_CHATGLM3_OFFER.replace("\n", "").replace("PROMPT",
                                                                   jinja_string(TOOL_PROMPT.removesuffix("\n"))),
                         _CHATGLM3_ARGUMENTS),
    "glm4": ToolForm(_GLM4_OFFER.replace("\n", ""), _NO_FLOATS + _GLM4_ARGUMENTS),
    # its template writes the `tools` it is given itself
    "glm4-0414": ToolForm("", _NO_FLOATS + _GLM4_ARGUMENTS, _LIFT_TOOLS, _HOLD_GENERATION_PROMPT, _TOOL_PROMPT_END),
}


def tool_messages(prompt_format) -> str:
    """The Jinja preamble that rewrites OpenAI-form tool conversations (`tools`, `tool_calls`, the `tool` role) into
    the GLM form the version's template writes, as serve.py does; "" for a version without tool calls here.
    GLM-4-0414's also takes a first system message's tools as the template's own and holds back the template's
    generation prompt where tools are offered (`tool_prompt_end`)."""
    form = _TOOL_FORMS.get(prompt_format.name)
    if form is None:
        return ""
    return _REFUSE + form.arguments + form.before + _GLM_MESSAGES.replace("OFFER", form.offer) + form.after


def tool_prompt_end(prompt_format) -> str:
    """What follows the template (GLM-4-0414: a prompt with tools offered ends at `<|assistant|>`); "" otherwise."""
    form = _TOOL_FORMS.get(prompt_format.name)
    return "" if form is None else form.end


THINKING_SWITCHES = ("enable_thinking",)  # render arguments that llama-server always defines itself
# a request that asks llama-server for reasoning (OpenAI's `reasoning_effort`, which it passes to the template)
_ASKS_REASONING = "reasoning_effort is defined and reasoning_effort and reasoning_effort != 'none'"


def template_defaults(prompt_format, llama_cpp: bool = False) -> str:
    """The Jinja preamble that gives the format's render arguments (`template_kwargs`: GLM-4.5's and GLM-4.7-Flash's
    `enable_thinking` false) the toolkit's values by default, so that an exported template renders the toolkit's own
    prompt; "" for a format without any.

    For transformers' `apply_chat_template` and vLLM (the hf directory) an argument is set where the caller left it
    undefined: a request passing `enable_thinking=True` gets the thinking prompt. llama-server always defines
    `enable_thinking` itself (true for a template it finds can think), so it cannot tell a request's value from its
    own; in a GGUF file (`llama_cpp`) the switch is set to the toolkit's value unless the request asks for
    reasoning with `reasoning_effort` (other than "none"), which llama-server hands to the template: that request
    gets the template's thinking prompt."""
    out = []
    for name, value in getattr(prompt_format, "template_kwargs", {}).items():
        literal = json.dumps(value)
        if llama_cpp and name in THINKING_SWITCHES:
            out.append(f"{{%- if not ({_ASKS_REASONING}) -%}}{{%- set {name} = {literal} -%}}{{%- endif -%}}")
        else:
            out.append(f"{{%- if {name} is not defined -%}}{{%- set {name} = {literal} -%}}{{%- endif -%}}")
    return "".join(out)


def chat_template(prompt_format, tokenizer, instruction: str, llama_cpp: bool = False) -> str:
    """The Jinja chat template an export writes for a model of `prompt_format` asked with `instruction`: its render
    defaults set first (`template_defaults`; `llama_cpp`: the GGUF file's), tool conversations in OpenAI's form
    rewritten (`tool_messages`)."""
    return with_instruction(template_defaults(prompt_format, llama_cpp) + tool_messages(prompt_format)
                            + prompt_format.chat_template(tokenizer) + tool_prompt_end(prompt_format), instruction)


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
