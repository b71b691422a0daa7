"""The chat templates of the GLM-5 releases (`model_type: glm_moe_dsa`: GLM-5, GLM-5.1, GLM-5.2; `glm5_next`:
GLM-5.3-Flash), as data, and what each changes against GLM-4.7's form (`moe_templates.GLM4_MOE_LITE_TEMPLATE`):

- GLM-5 (`GLM5_TEMPLATE`): GLM-4.7's template, text for text.
- GLM-5.1 (`GLM51_TEMPLATE`): the tools block writes each tool as the function object itself, unwrapped from
  {"type": "function", "function": {...}} (a tool given bare stays as it is), through a `tool_to_json` macro that
  leaves out the keys `defer_loading` and `strict` and skips a tool whose `defer_loading` is true. A tool message
  whose content is a list of tool references ({"type": "tool_reference", "name": ...}) is written as the referenced
  tools' schemas, `<tool_response><tools>` one a line `</tools></tool_response>`. Everything else (string tool
  results, calls, thinking, `</think>` as the empty think block, the generation prompt) is GLM-4.7's.
- GLM-5.2 (`GLM52_TEMPLATE`): GLM-5.1's, plus a reasoning-effort line: `<|system|>Reasoning Effort: High` where the
  `reasoning_effort` kwarg is "high", `... Max` for anything else or none (`GLM52_EFFORT`), written first (right after
  `[gMASK]<sop>`, before the tools block) and only while thinking is on (`enable_thinking` unset or true). Its empty
  think block is `<think></think>` (a turn whose reasoning is dropped, and the generation prompt with thinking off:
  `<|assistant|><think></think>`); with thinking on the prompt still ends `<|assistant|><think>`.
- GLM-5.3-Flash (`GLM53_FLASH_TEMPLATE`): a template of its own. The effort line is always written: "low", "high",
  else "max" (`GLM53_FLASH_EFFORT`); there is no `enable_thinking` (every generation prompt ends
  `<|assistant|><think>`); `clear_thinking` defaults to false, so every turn's reasoning is kept unless it is set
  true; reasoning is written as given (not stripped) and a turn without reasoning gets `<think></think>`; the tool
  results of a run of tool messages are written in the order of the calls before them where every call and result
  carries a matching id (`tool_call_id`); content parts of images, video and audio are written as their tokens.
  Tools, calls and string tool results are written as GLM-5.2's.

All of them begin with `[gMASK]<sop>` and write calls as GLM-4.7's `<tool_call>name<arg_key>..</arg_key>
<arg_value>..</arg_value></tool_call>`. The special tokens they write are GLM-4.5's (`moe_templates.MOE_SPECIALS`
after GLM-4's): none is added. (GLM-5's tokenizer holds those special tokens in GLM-4.5's order after a larger BPE:
`<|endoftext|>` 154820, `<|user|>` 154827, `<|observation|>` 154829, `<think>` 154841, `<|image|>` 154854.) What the
releases share with GLM-4.7 is that text here (`moe_templates`' parts); the parts below are theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatglm_tune.models.glm.moe_templates import (_GLM47_CALL_FORMAT, _GLM47_MESSAGES, _TEXT_AND_LAST_USER,
                                                   _TOOLS_HEAD, _TOOLS_TAIL, GLM4_MOE_LITE_TEMPLATE)


@dataclass(frozen=True)
class EffortLine:
    """The reasoning-effort line a template writes first, `<|system|>Reasoning Effort: <Effort>` (capitalized):
    `values` the efforts its `reasoning_effort` kwarg may name, `default` the one written for any other value or
    none, `needs_thinking` whether it is written only while thinking is on (`enable_thinking` unset or true)."""

    values: tuple[str, ...]
    default: str
    needs_thinking: bool

    def effort(self, asked: str | None = None) -> str:
        """The effort the template writes for `asked` (the `reasoning_effort` kwarg; None: left out)."""
        return asked if asked in self.values else self.default

    def line(self, asked: str | None = None) -> str:
        """The line the template writes for `asked`, special token first."""
        return "<|system|>Reasoning Effort: " + self.effort(asked).capitalize()


GLM52_EFFORT = EffortLine(("high", "max"), "max", needs_thinking=True)
GLM53_FLASH_EFFORT = EffortLine(("low", "high", "max"), "max", needs_thinking=False)


def _replaced(text: str, old: str, new: str) -> str:
    """`text` with its one `old` as `new` (ValueError where `old` is not there exactly once)."""
    if text.count(old) != 1:
        raise ValueError(f"the template part to replace occurs {text.count(old)} times: {old[:60]!r}")
    return text.replace(old, new)


_BEGIN = "[gMASK]<sop>\n"
_IF_TOOLS = "{%- if tools -%}\n"
# GLM-5.1 on: a tool written as its function object, without `defer_loading` and `strict`.
_TOOL_TO_JSON = r"""{%- macro tool_to_json(tool) -%}
    {%- set ns_tool = namespace(first=true) -%}
    {{ '{' -}}
    {%- for k, v in tool.items() -%}
        {%- if k != 'defer_loading' and k != 'strict' -%}
            {%- if not ns_tool.first -%}{{- ', ' -}}{%- endif -%}
            {%- set ns_tool.first = false -%}
            "{{ k }}": {{ v | tojson(ensure_ascii=False) }}
        {%- endif -%}
    {%- endfor -%}
    {{- '}' -}}
{%- endmacro -%}
"""
_TOOL_LOOP = r"""{% for tool in tools %}
{%- if 'function' in tool -%}
    {%- set tool = tool['function'] -%}
{%- endif -%}
{% if tool.defer_loading is not defined or not tool.defer_loading %}
{{ tool_to_json(tool) }}
{% endif %}
{% endfor %}
"""
_GLM5_TOOLS = _TOOLS_HEAD + _TOOL_LOOP + _TOOLS_TAIL + _GLM47_CALL_FORMAT
# GLM-4.7's tool message with list content (results as {"output": ...}), and GLM-5.1's (tool references).
_GLM47_LISTED_RESULTS = r"""{%- else -%}
<|observation|>{% for tr in m.content %}
<tool_response>{{ tr.output if tr.output is defined else tr }}</tool_response>{% endfor -%}
{% endif -%}
"""
_GLM51_TOOL_REFERENCES = r"""{%- else -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '<tool_response><tools>\n' }}
{%- for tr in m.content -%}
    {%- for tool in tools -%}
        {%- if 'function' in tool -%}
            {%- set tool = tool['function'] -%}
        {%- endif -%}
        {%- if tool.name == tr.name -%}
            {{- tool_to_json(tool) + '\n' -}}
        {%- endif -%}
    {%- endfor -%}
{%- endfor -%}
{{- '</tools></tool_response>' -}}
{% endif -%}
"""
# GLM-5.2: the effort line, and `<think></think>` for GLM-4.7's empty think block `</think>`.
_GLM52_EFFORT_LINE = r"""{%- set effective_reasoning_effort = 'high' if reasoning_effort is defined and reasoning_effort == 'high' else 'max' -%}
{%- if (enable_thinking is not defined or enable_thinking) and effective_reasoning_effort is not none -%}<|system|>Reasoning Effort: {{ effective_reasoning_effort | capitalize }}{%- endif -%}
"""  # noqa: E501 -- a released template's lines, kept as they are
_GLM47_DROPPED_THINK, _GLM52_DROPPED_THINK = "{{ '</think>' }}", "{{ '<think></think>' }}"
_GLM47_PROMPT_THINK = "'</think>' if (enable_thinking is defined and not enable_thinking) else '<think>'"
_GLM52_PROMPT_THINK = "'<think></think>' if (enable_thinking is defined and not enable_thinking) else '<think>'"
# GLM-5.3-Flash: its effort line (always), its clear_thinking default, the tool-reference macro, its messages.
_GLM53_EFFORT_LINE = r"""{%- set effective_reasoning_effort = reasoning_effort if reasoning_effort is defined and reasoning_effort in ['low', 'high'] else 'max' -%}
{%- if effective_reasoning_effort is not none -%}<|system|>Reasoning Effort: {{ effective_reasoning_effort | capitalize }}{%- endif -%}
{%- set clear_thinking = clear_thinking if clear_thinking is defined else false -%}
"""  # noqa: E501 -- a released template's lines, kept as they are
_GLM53_TOOL_REFERENCES = r"""{%- macro tool_references_to_response(refs) -%}
    {{- '<tool_response><tools>\n' -}}
    {%- for tr in refs -%}
        {%- for tool in tools -%}
            {%- if 'function' in tool -%}
                {%- set tool = tool['function'] -%}
            {%- endif -%}
            {%- if tool.name == tr.name -%}
                {{- tool_to_json(tool) + '\n' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endfor -%}
    {{- '</tools></tool_response>' -}}
{%- endmacro -%}
"""
_GLM53_MESSAGES = r"""{%- macro emit_image() -%}<|begin_of_image|><|image|><|end_of_image|>{%- endmacro -%}
{%- macro emit_video() -%}<|begin_of_video|><|video|><|end_of_video|>{%- endmacro -%}
{%- macro emit_audio() -%}<|begin_of_audio|><|end_of_audio|>{%- endmacro -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text -}}
            {%- elif item is string -%}
                {{- item -}}
            {%- elif item is mapping and item.type in ['image', 'image_url'] -%}
                {{- emit_image() -}}
            {%- elif item is mapping and item.type in ['video', 'video_url'] -%}
                {{- emit_video() -}}
            {%- elif item is mapping and item.type in ['audio', 'audio_url', 'input_audio'] -%}
                {{- emit_audio() -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_response(text) -%}
{{- '<tool_response>' + text + '</tool_response>' -}}
{%- endmacro -%}
{%- macro render_tool_response(m) -%}
{%- if m.content is string -%}
    {{- tool_response(m.content) -}}
{%- elif m.content and m.content is not mapping and m.content.0.type == "tool_reference" -%}
    {{- tool_references_to_response(m.content) -}}
{%- elif is_list_of_outputs(m) -%}
    {%- for tr in m.content -%}
        {%- if tr.output is iterable and tr.output is not string and tr.output is not mapping and tr.output and tr.output.0.type == "tool_reference" -%}
            {{- tool_references_to_response(tr.output) -}}
        {%- else -%}
            {{- tool_response(visible_text(tr.output)) -}}
        {%- endif -%}
    {%- endfor -%}
{%- else -%}
    {{- tool_response(visible_text(m.content)) -}}
{%- endif -%}
{%- endmacro -%}
{%- macro id_of(obj) -%}
    {%- if obj.tool_call_id -%}
        {{- obj.tool_call_id -}}
    {%- elif obj.id -%}
        {{- obj.id -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro is_list_of_outputs(m) -%}
    {%- if m.content and m.content.0.output is defined -%}1{%- endif -%}
{%- endmacro -%}
{%- macro has_dup_tool_result_id(lo, hi, target) -%}
    {%- set ns_cnt = namespace(n=0) -%}
    {%- for k in range(lo, hi + 1) -%}
        {%- set m = messages[k] -%}
        {%- if is_list_of_outputs(m) -%}
            {%- for entry in m.content -%}
                {%- if id_of(entry) == target -%}
                    {%- set ns_cnt.n = ns_cnt.n + 1 -%}
                {%- endif -%}
            {%- endfor -%}
        {%- elif id_of(m) == target -%}
            {%- set ns_cnt.n = ns_cnt.n + 1 -%}
        {%- endif -%}
        {%- if ns_cnt.n > 1 -%}{%- break -%}{%- endif -%}
    {%- endfor -%}
    {%- if ns_cnt.n > 1 -%}1{%- endif -%}
{%- endmacro -%}
{%- macro tc_id_exists(tcs, target) -%}
    {%- set ns_f = namespace(found=false) -%}
    {%- for tc in tcs -%}
        {%- if id_of(tc) == target -%}
            {%- set ns_f.found = true -%}
            {%- break -%}
        {%- endif -%}
    {%- endfor -%}
    {%- if ns_f.found -%}1{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) -%}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ visible_text(m.content) }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- elif '</think>' in content %}
    {%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1] %}
    {%- set content = content.split('</think>')[-1] %}
{%- endif %}
{%- if (not clear_thinking or loop.index0 > ns.last_user_index) and reasoning_content is defined -%}
{{ '<think>' + reasoning_content +  '</think>'}}
{%- else -%}
{{ '<think></think>' }}
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
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' -}}
    {%- set block_start = loop.index0 -%}
    {%- set ns_blk = namespace(end=block_start) -%}
    {%- for j in range(block_start, messages|length) -%}
        {%- if messages[j].role == 'tool' -%}
            {%- set ns_blk.end = j -%}
        {%- else -%}
            {%- break -%}
        {%- endif -%}
    {%- endfor -%}
    {%- set ns_a = namespace(tool_calls=none) -%}
    {%- if block_start > 0 and messages[block_start - 1].role == 'assistant' and messages[block_start - 1].tool_calls -%}
        {%- set ns_a.tool_calls = messages[block_start - 1].tool_calls -%}
    {%- endif -%}
    {%- set ns_chk = namespace(can_sort=true) -%}
    {%- if not ns_a.tool_calls -%}
        {%- set ns_chk.can_sort = false -%}
    {%- else -%}
        {%- for k in range(block_start, ns_blk.end + 1) -%}
            {%- set m = messages[k] -%}
            {%- if is_list_of_outputs(m) -%}
                {%- for entry in m.content -%}
                    {%- set eid = id_of(entry) -%}
                    {%- if not eid -%}
                        {%- set ns_chk.can_sort = false -%}
                    {%- elif has_dup_tool_result_id(block_start, ns_blk.end, eid) -%}
                        {%- set ns_chk.can_sort = false -%}
                    {%- elif not tc_id_exists(ns_a.tool_calls, eid) -%}
                        {%- set ns_chk.can_sort = false -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- else -%}
                {%- set tk_id = id_of(m) -%}
                {%- if not tk_id -%}
                    {%- set ns_chk.can_sort = false -%}
                {%- elif has_dup_tool_result_id(block_start, ns_blk.end, tk_id) -%}
                    {%- set ns_chk.can_sort = false -%}
                {%- elif not tc_id_exists(ns_a.tool_calls, tk_id) -%}
                    {%- set ns_chk.can_sort = false -%}
                {%- endif -%}
            {%- endif -%}
        {%- endfor -%}
        {%- for i in range(ns_a.tool_calls | length) -%}
            {%- set tc_id = id_of(ns_a.tool_calls[i]) -%}
            {%- if not tc_id -%}
                {%- set ns_chk.can_sort = false -%}
            {%- endif -%}
            {%- for j in range(i + 1, ns_a.tool_calls | length) -%}
                {%- if id_of(ns_a.tool_calls[j]) == tc_id -%}
                    {%- set ns_chk.can_sort = false -%}
                {%- endif -%}
            {%- endfor -%}
    {%- endfor -%}
    {%- endif -%}
    {%- if ns_chk.can_sort -%}
        {%- for tc in ns_a.tool_calls -%}
            {%- set tc_id = id_of(tc) -%}
            {%- for k in range(block_start, ns_blk.end + 1) -%}
                {%- set m = messages[k] -%}
                {%- if is_list_of_outputs(m) -%}
                    {%- for entry in m.content -%}
                        {%- set eid = id_of(entry) -%}
                        {%- if eid == tc_id -%}
                            {%- if entry.output is iterable and entry.output is not string and entry.output is not mapping and entry.output and entry.output.0.type == "tool_reference" -%}
                                {{- tool_references_to_response(entry.output) -}}
                            {%- else -%}
                                {{- tool_response(visible_text(entry.output)) -}}
                            {%- endif -%}
                        {%- endif -%}
    {%- endfor -%}
{%- else -%}
                    {%- set tk_id = id_of(m) -%}
                    {%- if tk_id == tc_id -%}
                        {{- render_tool_response(m) -}}
                    {%- endif -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endfor -%}
    {%- else -%}
        {%- for k in range(block_start, ns_blk.end + 1) -%}
            {{- render_tool_response(messages[k]) -}}
        {%- endfor -%}
    {%- endif -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
"""  # noqa: E501 -- a released template, kept byte for byte: its long lines are not wrapped
_GLM53_PROMPT = r"""{%- if add_generation_prompt -%}
    <|assistant|>{{- '<think>' -}}
{%- endif -%}
"""

GLM5_TEMPLATE = GLM4_MOE_LITE_TEMPLATE
GLM51_TEMPLATE = (_BEGIN + _IF_TOOLS + _TOOL_TO_JSON + _GLM5_TOOLS + _TEXT_AND_LAST_USER
                  + _replaced(_GLM47_MESSAGES, _GLM47_LISTED_RESULTS, _GLM51_TOOL_REFERENCES))
GLM52_TEMPLATE = _replaced(_replaced(_replaced(GLM51_TEMPLATE, _BEGIN, _BEGIN + _GLM52_EFFORT_LINE),
                                     _GLM47_DROPPED_THINK, _GLM52_DROPPED_THINK),
                           _GLM47_PROMPT_THINK, _GLM52_PROMPT_THINK)
GLM53_FLASH_TEMPLATE = (_BEGIN + _GLM53_EFFORT_LINE + _IF_TOOLS + _TOOL_TO_JSON + _GLM53_TOOL_REFERENCES + _GLM5_TOOLS
                        + "{%- endif -%}\n" + _GLM53_MESSAGES + _GLM53_PROMPT)


def writes_effort_line(template) -> bool:
    """Whether a chat template writes a reasoning-effort line (GLM-5.2's, GLM-5.3-Flash's); False for any other
    template and none."""
    return isinstance(template, str) and "Reasoning Effort: " in template
