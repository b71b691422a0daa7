"""The prompt formats of ChatGLM2-6B, ChatGLM3-6B, GLM-4-9B, GLM-4-0414, GLM-Edge, GLM-4.5 / 4.6 / 4.7 and
GLM-4.7-Flash: one family, seven ways to talk to it.

    ChatGLM2-6B  [gMASK] sop prompt "[Round 1]\\n\\n问：{text}\\n\\n答：" | answer </s>     (ptuning/main.py)
    ChatGLM3-6B  [gMASK] sop <|user|> \\n prompt + text <|assistant|> | \\n answer </s>   (finetune_demo)
    GLM-4-9B     [gMASK] <sop> <|user|> \\n prompt + text <|assistant|> | \\n answer <|user|> (finetune.py)
    GLM-4-0414   its chat template: [gMASK] <sop> <|user|> \\n prompt + text <|assistant|> \\n | answer <|user|>
    GLM-Edge     its chat template: <|user|> \\n prompt + text <|assistant|> | \\n answer <|user|>
    GLM-4.5      its chat template, thinking off: [gMASK] <sop> <|user|> \\n prompt + text /nothink <|assistant|>
                 \\n <think> </think> | \\n answer <|user|>   (GLM-4.6's too)
    GLM-4.7-Flash its chat template, thinking off: [gMASK] <sop> <|user|> prompt + text <|assistant|> </think> |
                 answer <|user|>   (GLM-4.7's too: GLM-4.5's architecture, GLM-4.7-Flash's template form)

Labels start at `|`. A history (earlier turns) comes before the query: ChatGLM2 as its official rounds,
ChatGLM3 and GLM-4 as user / assistant messages. ChatGLM3 encodes "\\n" and the text after a role token
apart (its `build_single_message`); GLM-4's chat template renders them as one text. Each class is
attached to its tokenizer class (`tokenizer.prompt_format`).

Chat: ChatGLM2 takes (query, response) pairs, as ChatGLM-6B; ChatGLM3 and GLM-4 take role messages (the
official `chat()` prompt: ChatGLM3's `build_chat_input`, GLM-4's chat template) and post-process the answer
into messages and tool calls (`process_chat_response`). ChatGLM3 and GLM-4-9B write a tool call as
`<|assistant|>name\n arguments` (a plain answer starts with "\n"), and so does GLM-4-0414 where tools are offered
(its template's form of a call: `metadata` the name); without tools a GLM-4-0414 answer is all content, every line
of it, as a GLM-Edge answer always is (its template has no tool form).

Outside the toolkit (export.py) the same prompts are Jinja chat templates whose text, tokenized with special
tokens parsed (llama.cpp's `parse_special`, transformers' fast tokenizers), gives these ids:
- ChatGLM3-6B: `[gMASK]sop`, per message `<|role|>`, "\\n", " " and the content, then `<|assistant|>`: the
  official `build_chat_input` encodes "\\n" and the content apart, each with SentencePiece's leading "▁",
  which the space before the content gives in one text (an empty content gets no "▁", and no space);
- GLM-4: its tokenizer's own chat template;
- ChatGLM2-6B: `[gMASK]sop` then `build_prompt`'s rounds as one text.
ChatGLM2/3 name their start token `sop`: with special tokens parsed, "sop" typed in a message is that token
too. The ollama templates (Go) render the same prompts; ChatGLM2's holds one round (Go templates cannot count).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Callable, Sequence

from chatglm_tune.data.batches import IGNORE_INDEX, EncodedExample, PromptFormat
from chatglm_tune.data.dialogues import TOOL_PROMPT, Dialogue, ToolCall, Turn, json_call, tool_call_code
from chatglm_tune.data.records import SPORecord
from chatglm_tune.options import GLM_CHAT_MAX_LENGTH, GLM_CHAT_SAMPLING, EncodingOptions


_MARK = "\ue0f0"  # a private-use character, never in a template: where a message's content goes in a render
# ollama's Go template: `$last` marks the message the model answers; INSTRUCTION is a run's instruction.
_GO_LOOP = "{{- range $i, $m := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 }}"
_GO_CONTENT = "{{ if and $last (eq $m.Role \"user\") }}INSTRUCTION{{ end }}{{ $m.Content }}"


class _GLMFormat(PromptFormat):
    """What the three share: the official chat() defaults, the tokenizer's stop ids, and the answer as
    `lead + text + end` (hooks below)."""

    chat_sampling = GLM_CHAT_SAMPLING
    chat_max_length = GLM_CHAT_MAX_LENGTH
    training_time = "2023年"  # what the official post-processing writes for `[[训练时间]]`

    def stop_ids(self, tokenizer) -> list[int]:
        return list(tokenizer.stop_token_ids)

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        lead, ids = self.answer_lead(tokenizer), tokenizer.encode_text(self.after_role(answer))
        room = options.answer_budget - len(lead) - 1
        return lead + ids[:room] + [self.end_id(tokenizer)], len(ids) > room

    def answer_lead(self, tokenizer) -> list[int]:
        """Ids before the answer's own (ChatGLM3: "\\n", encoded apart)."""
        return []

    def after_role(self, text: str) -> str:
        """Text that follows a role token, as one text (GLM-4's template puts the "\\n" in it)."""
        return text

    def end_id(self, tokenizer) -> int:
        """The id a trained answer ends with."""
        return tokenizer.eos_token_id


class ChatGLM2Format(_GLMFormat):
    name = "chatglm2"
    title = "ChatGLM2-6B"
    chat_in_pairs = True
    jinja_template = (
        "[gMASK]sop{% set round = namespace(n=0) %}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{% set round.n = round.n + 1 %}[Round {{ round.n }}]\n\n问：{{ message['content'] }}\n\n答："
        "{% elif message['role'] == 'assistant' %}{{ message['content'] }}\n\n{% endif %}{% endfor %}"
    )
    ollama_template = "[gMASK]sop[Round 1]\n\n问：INSTRUCTION{{ .Prompt }}\n\n答："
    stop_texts = ("</s>",)

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        """ChatGLM2's official prompt, `prefix + build_prompt(query, history)`, encoded as one text (as its
        `ptuning/main.py` does: SentencePiece joins across the template and the query); a query too long
        loses its end, whole characters at a time, until the prompt fits `max_src_len` tokens."""
        self.check_pairs(record)
        history, max_len = list(record.history or ()), options.max_src_len

        def encode(text: str) -> list[int]:
            return tokenizer.get_prefix_tokens() + tokenizer.encode_text(options.prompt
                                                                         + tokenizer.build_prompt(text, history))

        ids, kept = encode(record.text), record.text
        while len(ids) > max_len and kept:
            kept = kept[: len(kept) - max(1, len(ids) - max_len)]
            ids = encode(kept)
        return ids, kept != record.text

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        """The official post-processing: strip, the training year."""
        response = texts[0].strip().replace("[[训练时间]]", self.training_time)
        return response, [*history, (query, response)]


class _RoleFormat(_GLMFormat):
    """ChatGLM3 and GLM-4: role tokens around each message."""

    sop: str  # the start token after [gMASK]

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        """The chat prompt around `prompt + text`, the text cut to fit `max_src_len`; a conversation with a system
        prompt, tools or calls: its turns before the gold answer (`dialogue_prompt`)."""
        if record.history is None and record.dialogue is not None:
            return self.dialogue_prompt(tokenizer, record.dialogue, options.prompt), False
        command = tokenizer.get_command
        head = [command("[gMASK]"), command(self.sop)]
        for query, response in record.history or ():
            head += self.message(tokenizer, "user", query) + self.message(tokenizer, "assistant", response)
        head += [command("<|user|>")] + self.answer_lead(tokenizer)
        tail = [command("<|assistant|>")]
        query = tokenizer.encode_text(self.after_role(options.prompt + record.text))
        room = max(1, options.max_src_len - len(head) - len(tail))
        return head + query[:room] + tail, len(query) > room

    def message(self, tokenizer, role: str, content: str) -> list[int]:
        return [tokenizer.get_command(f"<|{role}|>"), *self.answer_lead(tokenizer),
                *tokenizer.encode_text(self.after_role(content))]

    # ----- conversations: every turn, a loss on each answer (the official multi-turn fine-tuning) -----

    def training_row(self, tokenizer, record: SPORecord, options: EncodingOptions) -> EncodedExample:
        """A conversation record's row as `dialogue_row` builds it, unless it is plain user / assistant turns
        trained on the last answer only (`loss_on` "last"): then the query and its history, as before."""
        dialogue = record.dialogue
        if dialogue is None or (options.loss_on == "last" and record.history is not None and self.pairs_answer_last):
            return super().training_row(tokenizer, record, options)
        if dialogue.answer is None:
            raise ValueError(f"{record.source or 'record'}: ends with no assistant turn, cannot build a training "
                             "example")
        return self.dialogue_row(tokenizer, dialogue if options.loss_on == "all" else dialogue.loss_on_last(), options,
                                 record.source)

    def dialogue_row(self, tokenizer, dialogue: Dialogue, options: EncodingOptions, origin: str = "") -> EncodedExample:
        """The official multi-turn row: the prefix, each turn's block (`turn_ids`), then the end id; a token is a
        label where the token before it belongs to a turn with a loss (so each answer's own tokens and the role
        or end token after it are trained, never the `<|assistant|>` before it); cut at `max_len`."""
        ids, carried = list(tokenizer.get_prefix_tokens()), [False] * len(tokenizer.get_prefix_tokens())
        for turn in self.instructed(dialogue.turns, options.prompt, dialogue.answer_at):
            block = self.turn_ids(tokenizer, turn)
            ids += block
            carried += [turn.loss] * len(block)
        ids.append(self.end_id(tokenizer))
        labels = [IGNORE_INDEX] + [token if loss else IGNORE_INDEX for token, loss in zip(ids[1:], carried)]
        return self.finished_row(ids, labels, options, origin, f"its assistant turns with a loss are empty, and "
                                 f"{self.title}'s chat template writes nothing for an empty message")

    def finished_row(self, ids: list[int], labels: list[int], options: EncodingOptions, origin: str,
                     why_untrained: str) -> EncodedExample:
        """The row of a conversation's `ids` and `labels`, cut at `max_len`; ValueError where no token is trained
        (`why_untrained`), or none before the cut."""
        if all(label == IGNORE_INDEX for label in labels):
            raise ValueError(f"{origin or 'record'}: no token of the conversation is trained: {why_untrained}")
        if all(label == IGNORE_INDEX for label in labels[:options.max_len]):
            raise ValueError(f"{origin or 'record'}: the conversation is {len(ids)} tokens and max_len "
                             f"{options.max_len} cuts it before any trained token: raise --max-len to {len(ids)} or "
                             "more")
        cut = len(ids) > options.max_len
        return EncodedExample(tuple(ids[:options.max_len]), tuple(labels[:options.max_len]), False, False, origin, cut)

    def dialogue_prompt(self, tokenizer, dialogue: Dialogue, instruction: str = "") -> list[int]:
        """What the model answers a conversation from: the prefix, its turns before the gold answer, `<|assistant|>`."""
        turns = self.instructed(dialogue.context, instruction, None)
        return [*tokenizer.get_prefix_tokens(), *(i for turn in turns for i in self.turn_ids(tokenizer, turn)),
                tokenizer.get_command("<|assistant|>")]

    @staticmethod
    def instructed(turns, instruction: str, answer_at: int | None) -> list[Turn]:
        """`turns` with `instruction` (a run's `--prompt`) before the last user turn before `answer_at`."""
        turns = list(turns)
        end = len(turns) if answer_at is None else answer_at
        last_user = next((i for i in range(end - 1, -1, -1) if turns[i].role == "user"), None)
        if instruction and last_user is not None:
            turns[last_user] = dataclasses.replace(turns[last_user], content=instruction + turns[last_user].content)
        return turns

    def turn_ids(self, tokenizer, turn: Turn) -> list[int]:
        """One turn's block: `<|role|>`, then `metadata + "\\n"` and the content encoded apart (ChatGLM3's
        `build_single_message`); GLM-4 and later override it."""
        if turn.tools:
            raise ValueError(f"{self.title} takes tools as its fine-tuning data's top-level tools list")
        return tokenizer.build_single_message(turn.role, turn.metadata, turn.content)

    tool_calls = True
    pairs_answer_last = True  # plain user / assistant turns trained on the last answer: the query and its history

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        return process_chat_response(texts, history, self.training_time, self.tool_call)

    def tool_call(self, name: str, content: str, tools: list | None) -> dict | None:
        """The official reading of an answer whose first line, `name`, is not empty: ChatGLM3's, a tool call
        whatever the name, `{"name", "parameters"}` where tools are declared (`tools`: the system message's)
        and the arguments parse, else `{"name", "content"}` (a call still streaming, or metadata without tools)."""
        parameters = self.tool_parameters(content) if tools is not None else None
        return {"name": name, **({"content": content} if parameters is None else {"parameters": parameters})}

    def tool_parameters(self, content: str):
        """The parameters of a tool call the model wrote, or None where `content` does not parse."""
        raise NotImplementedError

    def read_call(self, answer: str) -> ToolCall | None:
        """The call a decoded answer writes: its first line the tool's name, the rest the arguments in the version's
        form (`tool_parameters`), or the whole answer JSON `{"name", "arguments"}`; None for a text answer."""
        if not self.tool_calls:
            return None
        name, _, rest = answer.partition("\n")
        arguments = self.tool_parameters(rest) if name.strip() and rest.strip() else None
        return ToolCall(name.strip(), arguments) if isinstance(arguments, dict) else json_call(answer)

    def offer_tools(self, history: list[dict], tools: list) -> list[dict]:
        """`history` with OpenAI's request `tools` offered as the version's fine-tuning data and demos offer them
        (GLM-4: the system message's `tools`, each `{"type": "function", "function": ...}`; ChatGLM3 overrides)."""
        if history and history[0]["role"] == "system":
            return [{**history[0], "tools": tools}, *history[1:]]
        return [{"role": "system", "content": "", "tools": tools}, *history]

    def tool_call_message(self, name: str, arguments: dict) -> dict:
        """`<|assistant|>name` then the arguments in the version's form (`tool_arguments`), as the model writes a
        call and the official chat keeps it in the history (metadata: the name)."""
        if not self.tool_calls:
            return super().tool_call_message(name, arguments)
        return {"role": "assistant", "metadata": name, "content": self.tool_arguments(arguments)}

    def text_answer_lead(self, tokenizer) -> str:
        """The empty metadata line's "\\n"."""
        return "\n"

    def tool_call_lead(self, tokenizer, name: str) -> list[int]:
        """The call's first line, `name` and "\\n", as the tokenizer encodes a message's `metadata + "\\n"`."""
        if not self.tool_calls:
            return super().tool_call_lead(tokenizer, name)
        return tokenizer.encode_text(f"{name}\n")

    def tool_arguments(self, arguments: dict) -> str:
        """A call's arguments as the model writes them (what `tool_parameters` reads back)."""
        raise NotImplementedError


class ChatGLM3Format(_RoleFormat):
    name = "chatglm3"
    title = "ChatGLM3-6B"
    tool_arguments_form = "python"
    sop = "sop"
    # `build_chat_input`: metadata, "\n", then the content (a system message's tools as JSON after it)
    jinja_template = (
        "{% for message in messages %}{% if loop.first %}[gMASK]sop{% endif %}<|{{ message['role'] }}|>"
        "{{ message['metadata'] if message['metadata'] is defined and message['metadata'] else '' }}\n"
        "{% set content = message['content'] %}{% if message['role'] == 'system' and message['tools'] is defined %}"
        "{% set content = content ~ '\\n' ~ message['tools'] | tojson(indent=4) %}{% endif %}"
        "{% if content %} {{ content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ollama_template = "[gMASK]sop" + _GO_LOOP + "<|{{ $m.Role }}|>\n " + _GO_CONTENT + "{{ end }}<|assistant|>"
    stop_texts = ("</s>", "<|user|>", "<|observation|>")

    def answer_lead(self, tokenizer) -> list[int]:
        return tokenizer.encode_text("\n")  # after a role token, "\n" and the text are encoded apart

    def offer_tools(self, history: list[dict], tools: list) -> list[dict]:
        """A system message of its own, first, as its tool demo and fine-tuning data write it: `TOOL_PROMPT` and the
        functions (an OpenAI `{"type": "function", "function": f}` as `f`) as indented JSON; the chat's own system
        message stays after it."""
        functions = [tool["function"] if tool.get("type") == "function" and "function" in tool else tool
                     for tool in tools]
        return [{"role": "system", "content": TOOL_PROMPT.removesuffix("\n"), "tools": functions}, *history]

    def chat_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """Its tokenizer's `build_chat_input` (the official chat() prompt)."""
        *history, last = messages
        return tokenizer.build_chat_input(last["content"], history, role=last["role"])["input_ids"][0].tolist()

    def tool_arguments(self, arguments: dict) -> str:
        """`tool_call(k=v, ...)` in a Python code block, each value a Python literal; ValueError for a name that
        cannot be a keyword argument (`dialogues.tool_call_code`, what its fine-tuning data holds too)."""
        return tool_call_code(arguments)

    def tool_parameters(self, content: str):
        """`tool_call(k=v, ...)` in a code block, its arguments read as Python literals (the official code
        evaluates the block; this runs nothing)."""
        lines = content.strip().split("\n")
        if lines[0].startswith("```"):
            lines = lines[1:]
        if lines and lines[-1].strip() == "```":
            lines = lines[:-1]
        try:
            call = ast.parse("\n".join(lines).strip(), mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"
                    and not call.args and all(k.arg is not None for k in call.keywords)):
                return None
            return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None


class GLM4Format(_RoleFormat):
    name = "glm4"
    title = "GLM-4"
    tool_arguments_form = "json"
    declared_calls_only = True
    sop = "<sop>"
    training_time = "2024年"
    template_kwargs: dict = {}  # what every render of the chat template is given besides the messages
    ollama_template = "[gMASK]<sop>" + _GO_LOOP + "<|{{ $m.Role }}|>\n" + _GO_CONTENT + "{{ end }}<|assistant|>"
    stop_texts = ("<|endoftext|>", "<|user|>", "<|observation|>")

    def chat_template(self, tokenizer) -> str:
        """Its tokenizer's own (the official one; the tiny tokenizer's takes no tools)."""
        return tokenizer.chat_template

    def after_role(self, text: str) -> str:
        return "\n" + text

    def end_id(self, tokenizer) -> int:
        return tokenizer.get_command("<|user|>")

    def turn_ids(self, tokenizer, turn: Turn) -> list[int]:
        """The message rendered alone by the chat template, without the prefix it begins with (the official
        fine-tuning script's `apply_chat_template([message])[2:]`)."""
        message = {"role": turn.role, "content": turn.content, **({"metadata": turn.metadata} if turn.metadata else {}),
                   **({"tools": list(turn.tools)} if turn.tools else {})}
        return self.without_prefix(tokenizer, self.chat_ids(tokenizer, [message], generation_prompt=False))

    @staticmethod
    def without_prefix(tokenizer, ids: list[int]) -> list[int]:
        """`ids` without the `[gMASK] <sop>` a render begins with (a template that writes none: as they are)."""
        prefix = tokenizer.get_prefix_tokens()
        return ids[len(prefix):] if ids[:len(prefix)] == prefix else ids

    def chat_ids(self, tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        """Its chat template (`encode_chat`: message text stays data); a ValueError where the template refuses
        the messages (the tiny tokenizer's takes no tools)."""
        from jinja2 import TemplateError

        try:
            return tokenizer.encode_chat(messages, add_generation_prompt=generation_prompt, **self.template_kwargs)
        except TemplateError as err:
            raise ValueError(f"{self.title}'s chat template: {err}") from None

    def tool_call(self, name: str, content: str, tools: list | None) -> dict | None:
        """GLM-4-9B's official reading (its OpenAI API demo): a tool call only where the first line names a tool
        the system message declares, its arguments JSON (`{"name", "content"}` while they do not parse: a call
        still streaming); any other answer is text, its first line too."""
        declared = {(tool.get("function") or tool).get("name") for tool in tools or () if isinstance(tool, dict)}
        return super().tool_call(name, content, tools) if name in declared else None

    def tool_arguments(self, arguments: dict) -> str:
        """JSON."""
        return json.dumps(arguments, ensure_ascii=False)

    def tool_parameters(self, content: str):
        """JSON."""
        try:
            return json.loads(content)
        except json.JSONDecodeError:
            return None


class TemplateFormat(GLM4Format):
    """GLM-4-0414 (GLM-Z1) and GLM-Edge: their prompt is their own chat template (tokenizer_config.json or
    chat_template.jinja), rendered with the record's text as data (`encode_chat`), so a released directory's
    template is followed as it is written: GLM-4-0414's begins with `[gMASK]<sop>`, GLM-Edge's with the first
    role token. A trained answer is the text the template writes between its generation prompt and an
    assistant message's content, then the answer, then `<|user|>`. GLM-Z1 thinks inside `<think>...</think>`:
    a chat answer keeps what follows it.

    GLM-4-0414's template takes tools as its own `tools` argument (a system block before the messages) and writes
    a call as an assistant message whose metadata names the tool, a result as an observation: GLM-4's fine-tuning
    records (a system message's tools, calls, observations) render through it, each message alone as GLM-4's
    script renders them, the tools as the template's. Where tools are offered, the model answers after
    `<|assistant|>` (the template's generation prompt without what follows it), as it is trained on those rows:
    a call's first line names the tool, a text answer starts with "\n". Without tools an answer is all content,
    every line of it. GLM-Edge (`tool_refusal`) has no tool form: such records are refused.

    GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash think unless told not to (`template_kwargs`, given to every render:
    `enable_thinking` false, the prompt of their non-thinking answers); their tool calls (`<tool_call>` with
    `<arg_key>` / `<arg_value>`) are not read here (`tool_refusal`)."""

    def __init__(self, name: str, title: str, ollama_template: str, tool_refusal: str | None = None,
                 template_kwargs: dict | None = None):
        self.name, self.title, self.ollama_template = name, title, ollama_template
        self.tool_refusal = tool_refusal  # why a conversation with tools, calls or observations is refused
        self.tool_calls = tool_refusal is None
        self.template_kwargs = dict(template_kwargs or {})
        self._leads: dict[str, str] = {}  # answer_lead_text by chat template

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        """The template around the history and `prompt + text`; a text too long loses its end, whole characters
        at a time, until the prompt fits `max_src_len` tokens; a conversation record: `dialogue_prompt`."""
        if record.history is None and record.dialogue is not None:
            return self.dialogue_prompt(tokenizer, record.dialogue, options.prompt), False
        history = [{"role": role, "content": content} for query, response in record.history or ()
                   for role, content in (("user", query), ("assistant", response))]

        def encode(text: str) -> list[int]:
            return self.chat_ids(tokenizer, [*history, {"role": "user", "content": options.prompt + text}])

        ids, kept = encode(record.text), record.text
        while len(ids) > options.max_src_len and kept:
            kept = kept[: len(kept) - max(1, len(ids) - options.max_src_len)]
            ids = encode(kept)
        return ids, kept != record.text

    def check_turn(self, turn: Turn) -> None:
        """Without a tool form (`tool_refusal`): ValueError for a system turn's tools, a call and an observation."""
        super().check_turn(turn)
        if self.tool_refusal and (turn.metadata or turn.tools or turn.role == "observation"):
            raise ValueError(f"{self.title}: {self.tool_refusal}; conversation records with tools train ChatGLM3-6B, "
                             "GLM-4-9B and GLM-4-0414")

    def turn_ids(self, tokenizer, turn: Turn) -> list[int]:
        """GLM-4's per-message rendering; a system turn's tools as the template's `tools` (its block, then the
        system message where it has text). Without a tool form, tools, calls and observations are refused
        (`check_turn`)."""
        self.check_turn(turn)
        if not turn.tools:
            return super().turn_ids(tokenizer, turn)
        system = [{"role": "system", "content": turn.content}] if turn.content else []
        after = [{"role": "user", "content": ""}]  # a template renders no empty conversation: a message, cut off below
        ids = self.without_prefix(tokenizer, self.chat_ids(tokenizer, system + after, generation_prompt=False,
                                                          tools=list(turn.tools)))
        tail = self.without_prefix(tokenizer, self.chat_ids(tokenizer, after, generation_prompt=False))
        if ids[len(ids) - len(tail):] != tail:
            raise ValueError(f"{self.title}'s chat template writes a message after its tools otherwise than alone")
        return ids[:len(ids) - len(tail)]

    def chat_ids(self, tokenizer, messages: list[dict], generation_prompt: bool = True,
                 tools: list | None = None) -> list[int]:
        """The template's render; a first system message's `tools` (GLM-4's form, `offer_tools`) are passed as the
        template's `tools` (the message itself kept where it has text). With tools the prompt ends at
        `<|assistant|>`, where the model writes a call's name or a text answer's "\n"."""
        if not self.tool_calls:
            return super().chat_ids(tokenizer, messages, generation_prompt)
        if messages and messages[0].get("role") == "system" and "tools" in messages[0]:
            first, *rest = messages
            tools = first["tools"]
            messages = [{k: v for k, v in first.items() if k != "tools"}, *rest] if first.get("content") else rest
        if not tools:
            return super().chat_ids(tokenizer, messages, generation_prompt)
        from jinja2 import TemplateError

        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=False, tools=tools, **self.template_kwargs)
        except TemplateError as err:
            raise ValueError(f"{self.title}'s chat template: {err}") from None
        return ids + [tokenizer.get_command("<|assistant|>")] if generation_prompt else ids

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        ids = self.answer_lead_ids(tokenizer, answer)
        room = options.answer_budget - 1
        return ids[:room] + [self.end_id(tokenizer)], len(ids) > room

    def text_answer_lead(self, tokenizer) -> str:
        """`answer_lead_text`: what the template writes before an assistant message's content."""
        return self.answer_lead_text(tokenizer)

    def answer_lead_ids(self, tokenizer, answer: str = "") -> list[int]:
        """The ids of `answer_lead_text` then `answer`: the lead's special tokens (GLM-5.3-Flash's `</think>`, its
        generation prompt opening the reasoning) as the template's ids, the text after the last of them and the
        answer as one run of text."""
        lead = self.answer_lead_text(tokenizer)
        spans = tokenizer.special_spans(lead)
        cut = spans[-1][1] if spans else 0
        return (tokenizer.encode_marked(lead[:cut]) if cut else []) + tokenizer.encode_text(lead[cut:] + answer)

    def answer_lead_text(self, tokenizer) -> str:
        """What the template writes after its generation prompt and before an assistant message's content
        (GLM-Edge: "\n"; a template whose generation prompt ends with "\n": nothing). Read once a template."""
        if tokenizer.chat_template in self._leads:
            return self._leads[tokenizer.chat_template]
        user = {"role": "user", "content": "q"}
        prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False,
                                               **self.template_kwargs)
        turn = tokenizer.apply_chat_template([user, {"role": "assistant", "content": _MARK}], tokenize=False,
                                             **self.template_kwargs)
        before = turn[: turn.index(_MARK)]
        if not before.startswith(prompt):
            raise ValueError(f"{self.title}'s chat template does not continue its generation prompt {prompt[-40:]!r} "
                             f"with the assistant's message ({before[-40:]!r})")
        self._leads[tokenizer.chat_template] = before[len(prompt):]
        return before[len(prompt):]

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        """Each segment after the reasoning (what a GLM-Z1 answer writes after `</think>`): with a tool form, GLM-4's
        reading (a call only where the first line names a tool the system message declares); else, stripped, an
        assistant message's content, every line of it."""
        segments = [text.rpartition("</think>")[2] for text in texts]
        return process_chat_response(segments, history, None, self.tool_call if self.tool_calls else None)

    def tool_call_lead(self, tokenizer, name: str) -> list[int]:
        """The call's first line as the template writes it between `<|assistant|>` and the arguments."""
        if not self.tool_calls:
            return super().tool_call_lead(tokenizer, name)
        text = tokenizer.apply_chat_template([{"role": "assistant", "metadata": name, "content": _MARK}],
                                             tokenize=False, **self.template_kwargs)
        return tokenizer.encode_text(text[: text.index(_MARK)].rpartition("<|assistant|>")[2])


def process_chat_response(segments: Sequence[str], history: Sequence[dict], training_time: str | None,
                          tool_call: Callable[[str, str, list | None], dict | None]
                          | None) -> tuple[str | dict, list[dict]]:
    """ChatGLM3 / GLM-4's official post-processing of an answer: (response, history + its assistant messages).

    `segments`: the decoded answer split where the model wrote `<|assistant|>` (one text for a plain answer).
    `history`: the messages so far, the query last; it is not changed. The response is the last segment's.
    A segment whose first line is not empty goes to `tool_call(first line stripped, the rest, the tools of a
    first system message or None)`: a tool call's response (`{"name", "parameters"}`, or `{"name", "content"}`),
    and the message `{"role": "assistant", "metadata": first line, "content": the rest}`; None (and a segment
    of one line, or one that starts with "\n", or any where `tool_call` is None) makes it text: the whole
    segment stripped is the message's content, and the response, with `[[训练时间]]` written as `training_time`
    (in the response only, as officially; None: left as it is).
    """
    history = list(history)
    tools = (history[0].get("tools") if history and history[0].get("role") == "system"
             and "tools" in history[0] else None)
    response: str | dict = ""
    for text in segments:
        metadata, content = text.split("\n", 1) if "\n" in text else ("", text)
        call = tool_call(metadata.strip(), content, tools) if tool_call is not None and metadata.strip() else None
        if call is not None:
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            response = call
            continue
        content = text.strip()
        history.append({"role": "assistant", "metadata": "", "content": content})
        response = content if training_time is None else content.replace("[[训练时间]]", training_time)
    return response, history


CHATGLM2, CHATGLM3, GLM4 = ChatGLM2Format(), ChatGLM3Format(), GLM4Format()
# ollama's templates of the released chat templates: GLM-4-0414's ends its generation prompt with "\n".
GLM4_0414 = TemplateFormat("glm4-0414", "GLM-4-0414", "[gMASK]<sop>" + _GO_LOOP + "<|{{ $m.Role }}|>\n" + _GO_CONTENT
                           + "{{ end }}<|assistant|>\n")
GLM_EDGE = TemplateFormat("glm-edge", "GLM-Edge",
                          _GO_LOOP + "<|{{ $m.Role }}|>\n" + _GO_CONTENT + "{{ end }}<|assistant|>",
                          "its chat template has no tool form (it writes system, user and assistant messages only)")
# ollama's templates of the agent GLMs' (`agent_format`), thinking off: GLM-4.5's form and GLM-4.7's.
GLM45_OLLAMA = ("[gMASK]<sop>" + _GO_LOOP + "<|{{ $m.Role }}|>\n"
                + "{{ if eq $m.Role \"assistant\" }}<think></think>\n{{ end }}" + _GO_CONTENT
                + "{{ if eq $m.Role \"user\" }}/nothink{{ end }}{{ end }}<|assistant|>\n<think></think>")
GLM47_OLLAMA = ("[gMASK]<sop>" + _GO_LOOP + "<|{{ $m.Role }}|>" + "{{ if eq $m.Role \"assistant\" }}</think>{{ end }}"
                + _GO_CONTENT + "{{ end }}<|assistant|></think>")
# GLM-5.2's: GLM-4.7's with its empty think block `<think></think>` (thinking off writes no reasoning-effort line).
GLM52_OLLAMA = GLM47_OLLAMA.replace("</think>", "<think></think>")
# GLM-5.3-Flash's, which always thinks: its reasoning-effort line first, earlier answers with an empty think block,
# the generation prompt opening the reasoning.
GLM53_FLASH_OLLAMA = ("[gMASK]<sop><|system|>Reasoning Effort: Max" + _GO_LOOP + "<|{{ $m.Role }}|>"
                      + "{{ if eq $m.Role \"assistant\" }}<think></think>{{ end }}" + _GO_CONTENT
                      + "{{ end }}<|assistant|><think>")
