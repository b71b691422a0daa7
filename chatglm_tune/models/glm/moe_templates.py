"""The two chat template forms of the mixture-of-experts GLMs, as their released directories hold them
(chat_template.jinja or tokenizer_config.json's `chat_template`):

- GLM-4.5's form (`GLM4_MOE_TEMPLATE`, GLM-4.5's template as released): GLM-4.5 and GLM-4.6 ship it
  (`model_type: glm4_moe`). It puts "\\n" after each role token, appends `/nothink` to a user message when
  thinking is off, writes an empty think block as "\\n<think></think>" and ends a non-thinking prompt with
  `<|assistant|>\\n<think></think>` (a thinking one with `<|assistant|>`). GLM-4.5's raises on a tool call whose
  `arguments` is null (it loops over their items), where GLM-4.6's writes the call with no arguments
  (`tc.arguments or {}`).
- GLM-4.7's form (`GLM4_MOE_LITE_TEMPLATE`, GLM-4.7-Flash's template as released): GLM-4.7 (`model_type:
  glm4_moe`, GLM-4.5's architecture) and GLM-4.7-Flash (`glm4_moe_lite`) ship it. It writes content right after
  the role token, writes an empty think block as `</think>` alone, keeps past reasoning where `clear_thinking` is
  false, and ends a prompt with `<|assistant|><think>` (thinking) or `<|assistant|></think>` (not); a call with
  null `arguments` raises.

So the form a directory's template has tells GLM-4.5 / 4.6 from GLM-4.7, never GLM-4.7 from GLM-4.7-Flash
(`glm47_form`). The tiny presets ship one each, unchanged: `tiny-glm4-moe` GLM-4.5's, `tiny-glm47-flash`
GLM-4.7's. Both forms begin with `[gMASK]<sop>`, write the tools they are given as a system block in XML form,
think inside `<think>...</think>` unless `enable_thinking` is false, and write a tool call as `<tool_call>name`
with `<arg_key>` / `<arg_value>` pairs. What the two share is written once below; each template is its parts in
order.
"""

from __future__ import annotations

# The system block of the tools, before and after the loop that writes each one (GLM-5.1 and later write each
# tool otherwise, `glm5_templates`).
_TOOLS_HEAD = r"""<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
"""
_TOOLS_TAIL = r"""</tools>

For each function call, output the function name and arguments within the following XML format:
"""
# The tools block up to the call format each release spells its own way.
_TOOLS_INTRO = ("[gMASK]<sop>\n{%- if tools -%}\n" + _TOOLS_HEAD
                + "{% for tool in tools %}\n{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}\n" + _TOOLS_TAIL)
_GLM45_CALL_FORMAT = r"""<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>"""
_GLM47_CALL_FORMAT = (r"<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
                      r"<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>")
# The end of the tools block, the macro that reads a message's text, and the index of the last user message.
_TEXT_AND_LAST_USER = r"""{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
"""
_GLM45_MESSAGES = r"""{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}
"""  # noqa: E501 -- a released template, kept byte for byte: its long lines are not wrapped
_GLM47_MESSAGES = r"""{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>{{ visible_text(m.content) }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if ((clear_thinking is defined and not clear_thinking) or loop.index0 > ns.last_user_index) and reasoning_content -%}
{{ '<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '</think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{- '<tool_call>' + tc.name -}}
{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '<tool_response>' }}
{{- m.content }}
{{- '</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}
<tool_response>{{ tr.output if tr.output is defined else tr }}</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' -}}
{%- endif -%}
"""  # noqa: E501 -- a released template, kept byte for byte: its long lines are not wrapped

GLM4_MOE_TEMPLATE = _TOOLS_INTRO + _GLM45_CALL_FORMAT + _TEXT_AND_LAST_USER + _GLM45_MESSAGES
GLM4_MOE_LITE_TEMPLATE = _TOOLS_INTRO + _GLM47_CALL_FORMAT + _TEXT_AND_LAST_USER + _GLM47_MESSAGES
# What only GLM-4.5's form writes: its empty think block after a newline (in the template, a Jinja string's "\n").
_GLM45_EMPTY_THINK = "\\n<think></think>"


def glm47_form(template) -> bool:
    """True for a chat template of GLM-4.7's form: the XML tool calls of both forms (`<arg_key>`), without GLM-4.5's
    "\\n<think></think>"; False for GLM-4.5's form, any other template and none (None, or transformers' dict of
    named templates)."""
    return isinstance(template, str) and "<arg_key>" in template and _GLM45_EMPTY_THINK not in template


# The special tokens these releases add after GLM-4's (`glm4_tokenizer.OFFICIAL_SPECIALS`), in their order.
MOE_SPECIALS = ("<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
                "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>", "<tool_call>",
                "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>")
