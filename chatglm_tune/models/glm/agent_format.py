"""GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash, the agent GLMs: a conversation is what the release's chat template
writes for the whole of it (tools, reasoning, XML tool calls, tool results), and the model's answers are read back
from the same form (`xml_calls`).

Rows. A conversation record (any form: OpenAI-style messages, GLM-4's messages, plain turns) is rendered whole by
the tokenizer's chat template with its tools and thinking flags (`thinking_kwargs`: the record's `enable_thinking` /
`clear_thinking`, else the run's, else thinking on exactly where the record holds reasoning), text as data
(`render_marked`), and cut at the role tokens the template writes: one block a message (a run of tool results is
one `<|observation|>` block). The ids are the template's; an assistant block with a loss is trained from after its
lead to the role token after it (or the stop token the row ends with: `<|observation|>` after a call,
`<|user|>` after an answer). The lead is what the prompt already holds when the model writes that turn: the
generation prompt's text after `<|assistant|>` (`\\n<think></think>` or `</think>` with thinking off, `<think>`
with GLM-4.7's thinking on), or, on a turn before the last user message, the empty think block the template
writes where it drops that turn's reasoning. So reasoning is trained where the template keeps it (the turns after
the last user message, and every turn with GLM-4.7's `clear_thinking` false) and nowhere else.

GLM-5.2 writes a reasoning-effort line first while thinking is on (`<|system|>Reasoning Effort: Max`, or `High` for
the template kwarg `reasoning_effort` "high": `glm5_templates.EffortLine`): a leading system block, never trained; the
run's `reasoning_effort` (`EncodingOptions`) asks for one, and a served chat may set it.

GLM-5.3-Flash's template has no thinking switch: every generation prompt ends `<|assistant|><think>`, the effort line
is always written, and earlier turns' reasoning is kept unless `clear_thinking` is true (`thinking_switch` false:
thinking off is refused, never rendered as if it applied).

GLM-4.5's form drops the reasoning of earlier turns whatever `clear_thinking` says: clear_thinking false on a
conversation whose earlier turns reason is refused there, rather than trained as if kept.

A served chat (`chat_prompt`): a request's whole conversation rendered by the template with the request's flags
and the generation prompt, refusing nothing the template writes; `chat_thinking` says whether that prompt leaves the
model thinking, which is how its answer is read back.
"""

from __future__ import annotations

from chatglm_tune.data.batches import IGNORE_INDEX, EncodedExample
from chatglm_tune.data.dialogues import Dialogue, ToolCall, Turn
from chatglm_tune.data.records import SPORecord
from chatglm_tune.data.xml_calls import THINK_CLOSE, parse_calls, split_reasoning
from chatglm_tune.models.glm.formats import (GLM45_OLLAMA, GLM47_OLLAMA, GLM52_OLLAMA, GLM53_FLASH_OLLAMA,
                                             TemplateFormat)
from chatglm_tune.models.glm.glm5_templates import GLM52_EFFORT, GLM53_FLASH_EFFORT, EffortLine
from chatglm_tune.options import EncodingOptions

_ROLE_TOKENS = {"<|system|>": "system", "<|user|>": "user", "<|assistant|>": "assistant",
                "<|observation|>": "tool"}
_EMPTY_THINK = ("\n<think></think>", "<think></think>", THINK_CLOSE)  # longest first


class AgentFormat(TemplateFormat):
    """The prompt format of the agent GLMs (module docstring). `call_form`: "glm45" (GLM-4.5 / 4.6: a newline after
    each part) or "glm47" (GLM-4.7, GLM-4.7-Flash: none; earlier reasoning kept where `clear_thinking` is false)."""

    tool_arguments_form = "xml"
    declared_calls_only = True
    has_thinking = True
    pairs_answer_last = False  # every conversation is the template's render of the whole of it

    def __init__(self, name: str, title: str, ollama_template: str, call_form: str, effort: EffortLine | None = None,
                 thinking_switch: bool = True):
        super().__init__(name, title, ollama_template, None, {"enable_thinking": False})
        self.call_form = call_form
        self.keeps_history_reasoning = call_form == "glm47"
        self.effort = effort  # the reasoning-effort line the template writes first (GLM-5.2, GLM-5.3-Flash), or None
        self.thinking_switch = thinking_switch  # whether the template reads enable_thinking (GLM-5.3-Flash's does not)
        # the chat template's kwargs a chat request may set
        self.template_flags = (*(("enable_thinking",) if thinking_switch else ()), "clear_thinking",
                               *(("reasoning_effort",) if effort else ()))
        self._leads: dict = {}

    # ----- checks, before a tokenizer exists -----

    def check_turn(self, turn: Turn) -> None:
        """Every turn has a form here: reasoning, calls, tool results."""

    def check_dialogue(self, dialogue: Dialogue, options: EncodingOptions) -> None:
        """ValueError (naming the field) for what this format cannot write as the record asks: ChatGLM3-6B's tool
        conversations (their tools are a system prompt's text), reasoning rendered with thinking off, and earlier
        turns' reasoning kept (`clear_thinking` false) where GLM-4.5's template always drops it."""
        if dialogue.form == "conversations" and any(t.all_calls for t in dialogue.turns):
            raise ValueError("ChatGLM3-6B's tool conversations (tools + conversations) write their tools as a system "
                             f"prompt's text: {self.title} takes tools as OpenAI-style or GLM-4 messages")
        if not self.thinking_switch and False in (dialogue.enable_thinking, options.enable_thinking):
            raise ValueError(f"enable_thinking false: {self.title}'s chat template always thinks (it has no thinking "
                             "switch); leave enable_thinking out")
        flags = self.thinking_kwargs(dialogue, options)
        reasoning = [t for t in dialogue.turns if t.reasoning]
        if reasoning and not flags["enable_thinking"]:
            raise ValueError(f"field {reasoning[0].where}: the conversation is rendered with "
                             "thinking off (enable_thinking false), where no turn reasons")
        last_user = _last_user(dialogue.turns)
        earlier = [t for i, t in enumerate(dialogue.turns[:last_user]) if t.reasoning]
        if earlier and flags.get("clear_thinking") is False and not self.keeps_history_reasoning:
            raise ValueError(f"field {earlier[0].where}: {self.title}'s chat template drops the "
                             "reasoning of turns before the last user message whatever clear_thinking says; leave "
                             "clear_thinking on (that reasoning is then not trained)")

    def thinking_kwargs(self, dialogue: Dialogue | None, options: EncodingOptions) -> dict:
        """The template's flags for a record: its own, else the run's (`options`), else thinking on exactly where
        the conversation holds reasoning; `clear_thinking` only where one of them sets it."""
        def pick(name: str):
            own = getattr(dialogue, name, None) if dialogue is not None else None
            return own if own is not None else getattr(options, name)

        enable = pick("enable_thinking") if self.thinking_switch else True
        if enable is None:
            enable = dialogue is not None and any(t.reasoning for t in dialogue.turns)
        clear = pick("clear_thinking")
        effort = options.reasoning_effort if self.effort is not None else None
        return {"enable_thinking": enable, **({} if clear is None else {"clear_thinking": clear}),
                **({} if effort is None else {"reasoning_effort": effort})}

    def leading_blocks(self, flags: dict, tools: list | None) -> int:
        """The system blocks the template writes before the messages with `flags`: the reasoning-effort line (GLM-5.2,
        while thinking is on) and the tools."""
        line = self.effort
        effort = line is not None and (not line.needs_thinking or flags.get("enable_thinking") is not False)
        return int(effort) + int(bool(tools))

    # ----- prompts and rows -----

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        if record.dialogue is None:
            return super().prompt_ids(tokenizer, record, options)
        return self.dialogue_prompt(tokenizer, record.dialogue, options.prompt, options), False

    def dialogue_prompt(self, tokenizer, dialogue: Dialogue, instruction: str = "",
                        options: EncodingOptions = EncodingOptions()) -> list[int]:
        """The template's generation prompt after the turns before the gold answer."""
        messages, tools, _ = template_messages(dialogue, instruction, dialogue.answer_at)
        marked = tokenizer.render_marked(messages, True, tools, **self.thinking_kwargs(dialogue, options))
        return tokenizer.encode_marked(marked)

    def dialogue_row(self, tokenizer, dialogue: Dialogue, options: EncodingOptions, origin: str = "") -> EncodedExample:
        """The whole conversation's ids, labels on each trained assistant block (module docstring), cut at
        `max_len`."""
        flags = self.thinking_kwargs(dialogue, options)
        messages, tools, owners = template_messages(dialogue, options.prompt, None)
        marked = tokenizer.render_marked(messages, False, tools, **flags)
        spans = tokenizer.special_spans(marked)
        blocks = _blocks(marked, spans, messages, self.leading_blocks(flags, tools), self.title)
        special_ends = {end for _, end in spans}
        lead = self.generation_lead(tokenizer, flags)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        ids, trained = tokenizer.encode_marked(marked[:blocks[0][1]]), []
        for message_at, start, end in blocks:
            block = marked[start:end]
            loss = message_at is not None and messages[message_at]["role"] == "assistant" \
                and dialogue.turns[owners[message_at]].loss
            skip = (len("<|assistant|>") + self.untrained_lead(block, lead, message_at < last_user) if loss
                    else len(block))
            if loss and start + skip not in special_ends:  # a cut inside text would encode otherwise than whole
                raise ValueError(f"{origin or 'record'}: {self.title}'s chat template writes a lead that does not end "
                                 "at a special token: its trained spans cannot be cut out")
            head, rest = tokenizer.encode_marked(block[:skip]), tokenizer.encode_marked(block[skip:])
            if loss:
                trained.append((len(ids) + len(head), len(ids) + len(head) + len(rest)))
            ids += head + rest
        last = dialogue.turns[-1]
        ids.append(tokenizer.get_command("<|observation|>" if last.all_calls else "<|user|>"))
        labels = [IGNORE_INDEX] * len(ids)
        for begin, end in trained:
            labels[begin:end + 1] = ids[begin:end + 1]  # the span and the token after it
        return self.finished_row(ids, labels, options, origin, "no assistant turn has a loss")

    def generation_lead(self, tokenizer, flags: dict) -> str:
        """What the template's generation prompt writes after its last `<|assistant|>` with `flags` (marked text)."""
        key = (tokenizer.chat_template, tuple(sorted(flags.items())))
        if key not in self._leads:
            prompt = tokenizer.render_marked([{"role": "user", "content": "q"}], True, None, **flags)
            self._leads[key] = prompt.rpartition("<|assistant|>")[2]
        return self._leads[key]

    @staticmethod
    def untrained_lead(block: str, lead: str, earlier: bool) -> int:
        """Characters of an assistant block after `<|assistant|>` that the model does not write: the generation
        prompt's `lead`, or on a turn before the last user message an empty think block; the longer."""
        body = block[len("<|assistant|>"):]
        found = [len(lead)] if body.startswith(lead) else [0]
        found += [len(empty) for empty in _EMPTY_THINK if earlier and body.startswith(empty)]
        return max(found)

    # ----- a served chat -----

    def chat_prompt(self, tokenizer, messages: list[dict], tools: list | None, flags: dict) -> list[int]:
        """The ids of a chat request's conversation as the release's chat template renders it whole, its generation
        prompt last: `messages` in the template's form (roles system / user / assistant / tool; an assistant's
        `reasoning_content`, and `tool_calls` as [{"type": "function", "function": {"name", "arguments": a dict}}]),
        `tools` as the request gives them (None: no tools block), `flags` the template's kwargs (`template_flags`;
        one left out takes the template's default: thinking on, earlier reasoning cleared). Every string is data.
        ValueError where the template cannot render the messages."""
        from jinja2 import TemplateError

        try:
            marked = tokenizer.render_marked(messages, True, tools or None, **flags)
        except TemplateError as err:
            raise ValueError(f"{self.title}'s chat template: {err}") from None
        return tokenizer.encode_marked(marked)

    def chat_thinking(self, flags: dict) -> bool:
        """Whether the generation prompt rendered with `flags` leaves the model thinking: unless `enable_thinking` is
        false, and always on a template without the switch."""
        return not self.thinking_switch or flags.get("enable_thinking") is not False

    # ----- reading answers -----

    def read_calls(self, answer: str, tools: list | None = None) -> tuple[ToolCall, ...]:
        """The XML calls of a decoded answer, after its reasoning; arguments typed by `tools`' schemas."""
        _, rest = split_reasoning(answer, THINK_CLOSE in answer)
        return tuple(parse_calls(rest, tools)[1])

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        """(response, history) of a chat: the answer's reasoning, content and XML calls (typed by the tools of a first
        system message, where it offers them) as an assistant message with `reasoning_content` and `tool_calls`; the
        response its content, or its first call as `{"name", "parameters"}` (GLM-4's chat() answer for a call)."""
        text = texts[-1]
        reasoning, rest = split_reasoning(text, THINK_CLOSE in text)
        tools = history[0].get("tools") if history and history[0].get("role") == "system" else None
        content, calls = parse_calls(rest, tools)
        message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {}),
                   **({"tool_calls": [{"type": "function", "function": call.to_json()} for call in calls]}
                      if calls else {})}
        response = {"name": calls[0].name, "parameters": calls[0].arguments} if calls else content
        return response, [*history, message]

    def read_call(self, answer: str) -> ToolCall | None:
        calls = self.read_calls(answer)
        return calls[0] if calls else None



def template_messages(dialogue: Dialogue, instruction: str, end: int | None) -> tuple[list[dict], list | None, list]:
    """(messages as the chat template reads them, the tools, the turn each message comes from) of `dialogue`'s turns
    before `end` (None: all), `instruction` before the last user message's text. OpenAI-style records as they are;
    GLM-4's messages: a system message's tools as the tools, a call (metadata) as `tool_calls`, an observation as a
    tool message."""
    turns = dialogue.turns[:end]
    last_user = _last_user(turns)
    messages, owners, tools = [], [], list(dialogue.tools) if dialogue.tools is not None else None
    for i, turn in enumerate(turns):
        if dialogue.form == "openai":
            message = dict(dialogue.messages[i])
        elif turn.tools is not None:
            tools = [*(tools or []), *turn.tools]
            if not turn.content:
                continue
            message = {"role": "system", "content": turn.content}
        elif turn.call is not None:
            message = {"role": "assistant", "content": "",
                       "tool_calls": [{"type": "function", "function": {"name": turn.call.name,
                                                                        "arguments": turn.call.arguments}}]}
        else:
            message = {"role": "tool" if turn.role == "observation" else turn.role, "content": turn.content}
        if i == last_user and instruction:
            message["content"] = instruction + message["content"]
        messages.append(message)
        owners.append(i)
    return messages, tools or None, owners


def _last_user(turns) -> int:
    return max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)


def _blocks(marked: str, spans: list, messages: list[dict], leading: int, title: str) -> list[tuple]:
    """(message index or None for a leading system block, start, end) of each block the template writes from its first
    role token on (`spans`: the template's special tokens in `marked`; `leading`: the system blocks it writes before
    the messages); ValueError where they are not those and then one a message in order (a run of tool messages one
    block)."""
    starts = [(begin, _ROLE_TOKENS[marked[begin:end]]) for begin, end in spans if marked[begin:end] in _ROLE_TOKENS]
    expected = [(None, "system")] * leading
    for i, message in enumerate(messages):
        if not (message["role"] == "tool" and i and messages[i - 1]["role"] == "tool"):
            expected.append((i, message["role"]))
    if [role for _, role in starts] != [role for _, role in expected]:
        raise ValueError(f"{title}'s chat template writes these messages otherwise than one block a message "
                         f"(blocks {[role for _, role in starts]}, messages {[role for _, role in expected]})")
    ends = [begin for begin, _ in starts[1:]] + [len(marked)]
    return [(at, begin, end) for (at, _), (begin, _), end in zip(expected, starts, ends)]


GLM4_MOE = AgentFormat("glm4-moe", "GLM-4.5", GLM45_OLLAMA, "glm45")
GLM4_MOE_LITE = AgentFormat("glm4-moe-lite", "GLM-4.7-Flash", GLM47_OLLAMA, "glm47")
# GLM-4.7: `glm4-moe` (GLM-4.5's architecture) with GLM-4.7-Flash's template form: the format of a `glm4-moe`
# tokenizer whose chat template has that form (`moe_templates.glm47_form`).
GLM47 = AgentFormat("glm4-moe", "GLM-4.7", GLM47_OLLAMA, "glm47")
# GLM-5 (`glm_moe_dsa`) ships GLM-4.7's template form; GLM-5.1 too (its tools block writes each tool unwrapped, which
# changes no cut); GLM-5.2 adds the reasoning-effort line and writes `<think></think>` as its empty think block.
GLM5 = AgentFormat("glm5", "GLM-5", GLM47_OLLAMA, "glm47")
GLM52 = AgentFormat("glm5", "GLM-5.2", GLM52_OLLAMA, "glm47", effort=GLM52_EFFORT)
# GLM-5.3-Flash (`glm5_next`): its own template, GLM-4.7's turns, the reasoning-effort line always written.
GLM53_FLASH = AgentFormat("glm53-flash", "GLM-5.3-Flash", GLM53_FLASH_OLLAMA, "glm47", effort=GLM53_FLASH_EFFORT,
                          thinking_switch=False)
