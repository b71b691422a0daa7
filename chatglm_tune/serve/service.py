"""What the server serves: one loaded model on the continuous-batching engine, and the three ways a request
becomes ids and comes back as text (chat, completion, extraction), for asyncio handlers.

- chat: the messages become the version's official chat prompt (`chat.prepare_turn`: ChatGLM-6B / ChatGLM2
  (query, response) rounds; ChatGLM3 / GLM-4 role messages, `system` included, OpenAI's `tool` role as
  `observation`, `tools` offered as each version's demos and fine-tuning data offer them (`offer_tools`:
  ChatGLM3 a first system turn of its own, GLM-4 the system message's), an assistant's `tool_calls`
  as the messages the model writes for them (`PromptFormat.tool_call_message`: `<|assistant|>name` then
  ChatGLM3's `tool_call(k=v)` block or GLM-4-9B's JSON), all refused for the versions whose chat has no tool
  calls here: `PromptFormat.tool_calls`); the answer is what `chat()` answers (the version's post-processing;
  a ChatGLM3 / GLM-4-9B tool call as OpenAI's `tool_calls`). `tool_choice`: "none" offers no tools and reads
  no call; a named function (or "required" with one tool) ends the prompt with that call's first line, so
  the answer is its arguments, decoded under the grammar of the version's argument form for the tool's
  parameters schema (`grammar`); "required" among several tools: the answer is decoded under the grammar of
  every tool's call (its first line, then its arguments). `response_format` `json_object` / `json_schema`: the
  prompt ends with what a text answer begins with (`PromptFormat.text_answer_lead`), the answer is decoded under
  the schema's grammar and comes back as decoded (no post-processing that could change it).
- chat of the agent GLMs (GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash: `PromptFormat.has_thinking`), as vLLM serves them
  with its glm45 / glm47 tool parsers and glm45 reasoning parser: the messages (system / user / assistant / tool;
  an assistant's `reasoning_content` and `tool_calls`, a `tool` message the template's tool role) and `tools`
  are rendered whole by the release's chat template with its generation prompt (`AgentFormat.chat_prompt`), the
  request's `chat_template_kwargs` (`enable_thinking`, `clear_thinking`; none set: the template's default,
  thinking on) as its flags; as for every version's chat, the run's instruction is not added (a model directory
  without run settings has the default one). The answer (`AgentTurn`) is
  split into `reasoning_content` (`xml_calls.split_reasoning`: where the prompt left the model thinking, the text
  before `</think>`), the XML calls (`xml_calls.parse_calls`, typed by the tools' schemas) as OpenAI's
  `tool_calls`, and the rest as content; streamed, through `xml_calls.OutputStream`. `tool_choice` "none" offers
  no tools and reads no call; "required" and a named function are refused (their XML calls are not decoded under
  a grammar here). `response_format` JSON: the prompt rendered with thinking off (`enable_thinking` true is
  refused), the answer decoded under the schema's grammar after the template's content lead.
- completion: the prompt string is the record text of the run's prompt format, with the run's instruction
  (`--prompt` of train.py) before it: the model's input is what `infer.py --text` gives it; the answer is
  the decoded text (`PromptFormat.decode_answer`).
- extraction: each text as infer.py extracts it (the run's prompt, `max_src_len` cut, answer budget), the
  answer parsed into triples (`extraction.make_row`).
Decoding is the engine's (`engine.Engine`): a request's stop ids are its version's (GLM-4: `<|endoftext|>`,
`<|user|>`, `<|observation|>`). Stop strings are matched on the answer text as it grows; the text before the
first match is the answer, and the request leaves the batch at the next step. Streams send text as it
becomes final: a character whose bytes have not all come, the characters the version's post-processing may
still change (`PromptFormat.stream_lookahead`: ChatGLM-6B's last one), a tail that could still become a
stop string, and, where tool calls are read, a first line that could still name a tool (`ChatTurn.holding`)
are held back. A request of `n` answers (or of several prompts) is that many rows of the batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from chatglm_tune.data.batches import SpecialIds
from chatglm_tune.data.dialogues import Turn as DialogueTurn
from chatglm_tune.data.records import SPORecord
from chatglm_tune.data.xml_calls import OutputStream, parse_calls, split_reasoning
from chatglm_tune.decoding import grammar
from chatglm_tune.decoding.chat import ROLES, Turn, prepare_turn
from chatglm_tune.decoding.engine import Engine
from chatglm_tune.decoding.request import FINISH_CANCELLED, FINISH_ERROR, FINISH_STOP, Request
from chatglm_tune.decoding.scheduler import EngineClosed, QueueFull
from chatglm_tune.decoding.scoring import prompt_logprobs
from chatglm_tune.evaluation.extraction import make_row
from chatglm_tune.options import DEFAULT_SAMPLING, EncodingOptions, ServingOptions
from chatglm_tune.serve.protocol import ApiError, Call, bad, check_tool_use, require_fitting, seeds

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there
_GONE = object()  # put in a ticket's queue when its client has gone


def context_length(config) -> int:
    """Prompt + answer tokens the model was built for (ChatGLM-6B `max_sequence_length`, the others
    `max_position_embeddings`)."""
    for name in ("max_sequence_length", "seq_length", "max_position_embeddings"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError("the model's config names no context length")


@dataclass(frozen=True)
class Finished:
    reason: str  # request.FINISH_*
    error: str | None


class Mailbox:
    """Hands items from the engine's thread to the event loop's queues, waking the loop once for all the
    items posted until it runs (one wake-up a decoding step, not one a token: the loop's thread competes
    with the decoding threads for the cores)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, object]] = []

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:
                return  # a wake-up is on its way
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


class Ticket:
    """One request in the engine, as an async iterator of its token ids and then one `Finished`. Leaving the
    iteration early (a client gone, a stop string) cancels the request."""

    def __init__(self, engine: Engine, mailbox: Mailbox, prompt: Sequence[int], budget: int, call: Call,
                 stop_ids: Sequence[int], constraint: grammar.Constraint | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine, self.done = engine, False
        post = mailbox.post
        self.request = Request(prompt, budget, on_token=lambda token: post(self.queue, token),
                               on_finish=lambda reason, error: post(self.queue, Finished(reason, error)),
                               sampling=call.sampling, seed=call.seed, stop_ids=tuple(stop_ids),
                               logprobs=call.logprobs, on_logprob=lambda *scored: post(self.queue, LogProb(*scored)),
                               constraint=constraint)
        try:
            engine.submit(self.request)
        except QueueFull as err:
            raise ApiError(429, f"the server is busy: {err}; retry later", code="queue_full") from None
        except EngineClosed:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None

    async def events(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator:
        """The request's token ids, then its `Finished`. `disconnected`: polled every DISCONNECT_POLL_S by a task
        of its own, whether tokens come or not; once it says so, the iteration ends (and the request is
        cancelled in the engine)."""
        watcher = None if disconnected is None else asyncio.create_task(self._watch(disconnected))
        try:
            while True:
                item = await self.queue.get()
                if item is _GONE:
                    return
                if isinstance(item, Finished):
                    self.done = True
                yield item
                if self.done:
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            if not self.done:
                self.engine.cancel(self.request)

    async def _watch(self, disconnected: Callable[[], Awaitable[bool]]) -> None:
        while not await disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.engine.cancel(self.request)  # at the engine's next step, even before the handler hears of it
        self.queue.put_nowait(_GONE)


class TextStream:
    """The answer text of a growing list of ids: `render(ids)` is the whole text so far; `update` returns
    the part that became final since the last call and whether a stop string ended the answer. While `hold(ids)`,
    nothing becomes final but what a stop string ends."""

    def __init__(self, render: Callable[[list[int]], str], stops: Sequence[str], lookahead: int = 0,
                 hold: Callable[[list[int]], bool] | None = None):
        self.render, self.stops, self.lookahead, self.hold = render, tuple(stops), lookahead, hold
        self.sent = ""
        self.text = ""

    def update(self, ids: list[int], *, final: bool) -> tuple[str, bool]:
        text = self.render(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text, final = text[: min(hits)], True
        self.text = text
        if final:
            ready = text
        elif text.endswith("\ufffd") or (self.hold is not None and self.hold(ids)):
            return "", False
        else:
            ready = text[: max(0, len(text) - self.lookahead)]
            ready = ready[: len(ready) - self._stop_prefix(ready)]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return "", stopped  # nothing new, or post-processing rewrote sent text (it cannot be taken back)
        delta, self.sent = ready[len(self.sent):], ready
        return delta, stopped

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a stop string."""
        return max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@dataclass(frozen=True)
class ChatTurn:
    """A chat request's turn: `chat.Turn` (the version's prompt and post-processing) and the prompt the engine
    decodes, which goes on with `lead` where the request names the tool to call (that call's first line);
    `tool_calls`: whether a call is read from the answer (not with `tool_choice` "none")."""

    turn: Turn
    prompt: list[int]
    lead: str
    tool_calls: bool
    grammar: str | None = None  # Lark text the answer keeps to (`grammar`): a JSON answer, a call's arguments
    json_answer: bool = False  # the answer is JSON text (`response_format`): its text as decoded, no post-processing
    tool_names: tuple[str, ...] = ()  # the tools offered

    @property
    def history(self) -> list:
        return self.turn.history

    def response(self, ids: Sequence[int]):
        """`chat()`'s response of the answer ids: text, or a tool call dict (never with `tool_calls` off: then
        a first line naming a tool stays text, as written); a JSON answer's text as it is."""
        if self.json_answer:
            return "".join(self.turn.texts(list(ids))).strip()
        texts = self.turn.texts(list(ids))
        texts[0] = self.lead + texts[0]
        response = self.turn.result(texts)[0]
        return response if self.tool_calls or isinstance(response, str) else "\n".join(texts).strip()

    def shown(self, ids: Sequence[int]) -> str:
        """The answer's text so far: the response, where it is text (a tool call shows none)."""
        response = self.response(ids)
        return response if isinstance(response, str) else ""

    def holding(self, ids: Sequence[int]) -> bool:
        """Whether a stream holds the text back for now: where calls are read, while the last segment's first line
        is unfinished and not empty (a call's first line is the tool's name, a text answer's is empty), so that a
        call's name never streams as text; where only a declared tool's name makes a call (GLM-4), while that line
        could still become one of `tool_names`."""
        if not (self.tool_calls and self.turn.format.tool_calls) or self.lead:
            return False
        segment = self.turn.texts(list(ids))[-1]
        if "\n" in segment or not segment.strip():
            return False
        return not self.turn.format.declared_calls_only or any(n.startswith(segment.strip()) for n in self.tool_names)


_AGENT_ROLES = ("system", "user", "assistant", "tool")  # the agent GLMs' chat templates' roles


@dataclass(frozen=True)
class AgentTurn:
    """An agent GLM's chat turn: the prompt the engine decodes and how its answer is read. `thinking`: the prompt
    left the model thinking (the text before `</think>` is reasoning); `tools`: those offered, whose XML calls are
    read and typed by their schemas (None: no call is read, the text after the reasoning is all content);
    `json_answer`: the answer is JSON text under `grammar` (`response_format`), content as decoded, stripped."""

    prompt: list[int]
    tokenizer: object
    stop_ids: tuple[int, ...]
    thinking: bool
    tools: list | None
    grammar: str | None = None
    json_answer: bool = False

    def shown(self, ids: Sequence[int]) -> str:
        """The answer's text so far: its ids decoded, special tokens as their text (`<think>`, `<tool_call>`) with no
        space around them (as the releases' tokenizer.json decodes, and so these tokenizers), less the stop id that
        ended it."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids)

    def holding(self, ids: Sequence[int]) -> bool:
        """Nothing is held back by ids: `OutputStream` holds the text that could still become a tag."""
        return False

    def read(self, text: str) -> tuple[str | None, str, list]:
        """(reasoning or None, content, calls as `ToolCall`s) of an answer's whole text."""
        if self.json_answer:
            return None, text.strip(), []
        reasoning, rest = split_reasoning(text, self.thinking)
        if self.tools is None:
            return reasoning, rest.strip(), []
        content, calls = parse_calls(rest, self.tools)
        return reasoning, content, calls

    def stream(self) -> OutputStream:
        """A reader of the answer's text as it comes, whose events join to `read`'s parts."""
        return OutputStream(self.thinking, self.tools, calls=self.tools is not None)


@dataclass(frozen=True)
class Delta:
    text: str
    scored: tuple = ()  # (id, LogProb) of the answer ids since the last delta, where the request asked


@dataclass(frozen=True)
class LogProb:
    """The next answer id's log probability and the likeliest ids' ((id, log probability), ...)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Done:
    text: str  # the whole answer (stop string cut)
    finish: str  # "stop" or "length"
    tokens: int  # ids generated
    ids: tuple[int, ...]
    stop_string: bool  # a stop string ended it
    logprobs: tuple[LogProb, ...] = ()  # each id's but the stop id's that ended it, where the request asked
    scored: tuple = ()  # (id, LogProb) of the ids after the last `Delta`'s (a stream sends them at its end)

    @property
    def scored_pairs(self) -> tuple:
        return tuple(zip(self.ids, self.logprobs))


class Service:
    """A loaded model, its tokenizer and run settings, and the engine decoding for it."""

    def __init__(self, model, tokenizer, *, served: str, encoding: EncodingOptions = EncodingOptions(),
                 free_text: bool = False, options: ServingOptions = ServingOptions()):
        self.model, self.tokenizer, self.served = model, tokenizer, served
        self.encoding, self.free_text, self.options = encoding, free_text, options
        self.format = tokenizer.prompt_format
        self.context = context_length(model.config)
        self.rows = model.config.vocab_size  # the width of the model's scores
        self.engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer), options=options)
        self._mailbox: Mailbox | None = None
        self.stopping = False  # shutting down: new requests get 503 (`server.DrainingServer`)

    def start(self) -> "Service":
        """Start the engine once it has decoded a few tokens (`Engine.warm_up`): the kernels the first request
        needs are built then, and compiled serving's steps compiled (on a GPU recorded), before the server says it
        is ready."""
        prompt = self.format.prompt_ids(self.tokenizer, SPORecord("warm up", None, source="prompt"), self.encoding)[0]
        self.engine.start(warm_up=prompt)
        return self

    def mailbox(self) -> Mailbox:
        """The mailbox of the running event loop (made at its first request)."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    def close(self, timeout: float = 10.0) -> None:
        self.engine.close(timeout)

    @property
    def chat_sampling(self):
        return self.format.chat_sampling

    completion_sampling = DEFAULT_SAMPLING  # greedy, as infer.py

    # ------------------------------------------------------------------------------------------
    # chat

    def chat_turn(self, call: Call) -> "ChatTurn | AgentTurn":
        """The `ChatTurn` of a chat call: its prompt, stop ids and post-processing (the agent GLMs': `AgentTurn`);
        400 on bad messages. An assistant's `reasoning_content` is read by the agent GLMs alone."""
        if self.format.has_thinking:
            return self._agent_turn(call)
        self._effort(call, {})  # a reasoning_effort is refused: these versions write no such line
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in call.messages]
        tools = call.tools if call.tool_choice != "none" else None  # "none": the tools are not offered
        called = self._called_tool(call)
        if (call.tools or called) and not self.format.tool_calls:
            param = "tools" if call.tools else "tool_choice"
            raise bad(param, f"{self.format.title} has no tool calls here")
        *history, last = messages
        if self.format.tool_calls:
            check_tool_use(call.messages, call.tools)  # the rules of fine-tuning data
        else:
            self._no_tool_calls(history)
            self._no_tool_results(call.messages)
        if self.format.chat_in_pairs:
            history, last = self._fold_system(history, last)
            pairs = self._pairs(history)
            query, role = last["content"], self._last_role(last, ("user",), len(messages) - 1)
            history = pairs
        else:
            history = self._role_messages(history)
            if tools:
                history = self.format.offer_tools(history, tools)
            role = "observation" if last["role"] == "tool" else last["role"]
            role = self._last_role({**last, "role": role}, ("user", "observation"), len(messages) - 1)
            query = last["content"]
        try:
            turn = prepare_turn(self.tokenizer, query, history, role, self.context, call.sampling)
        except ValueError as err:
            raise bad(self._refused_part(query, history, role, tools), str(err)) from None
        if call.json_schema is not None:
            lead = self.format.text_answer_lead(self.tokenizer)
            answer = self._grammar(grammar.lark([("", grammar.json_rule(call.json_schema))]), "response_format")
            lead_ids = self.tokenizer.encode_text(lead) if lead else []
            return ChatTurn(turn, turn.prompt + lead_ids, lead, False, answer, json_answer=True)
        if called is not None:
            arguments = self._grammar(self._call_grammar([called], call.tools, lead=False), "tool_choice")
            return ChatTurn(turn, turn.prompt + self.format.tool_call_lead(self.tokenizer, called), f"{called}\n", True,
                            arguments)
        if call.tool_choice == "required":  # one of several tools: the grammar of every call
            names = [_function(tool).get("name") for tool in call.tools]
            return ChatTurn(turn, turn.prompt, "", True, self._grammar(self._call_grammar(names, call.tools), "tools"),
                            tool_names=tuple(names))
        offered = tuple(_function(tool).get("name") for tool in tools or ())
        return ChatTurn(turn, turn.prompt, "", call.tool_choice != "none", tool_names=offered)

    def _agent_turn(self, call: Call) -> "AgentTurn":
        """The agent GLMs' turn (module docstring): the whole conversation through the release's chat template;
        400 naming the parameter it cannot take."""
        flags = self._effort(call, self._template_flags(call.template_kwargs))
        if call.tool_choice in ("required", "function"):
            raise bad("tool_choice", f"a forced call (\"required\" or a named function) is not supported for "
                                     f"{self.format.title} yet (its XML calls are not decoded under a grammar here): "
                                     "use \"auto\" or \"none\"")
        messages = self._agent_messages(call.messages)
        check_tool_use(call.messages, call.tools)  # the rules of fine-tuning data
        tools = call.tools if call.tool_choice != "none" else None  # "none": the tools are not offered
        if call.json_schema is not None:
            if flags.get("enable_thinking"):
                raise bad("response_format", "a JSON answer is decoded with thinking off: leave "
                                             "chat_template_kwargs.enable_thinking out or false")
            flags = {**flags, "enable_thinking": False}
        try:
            prompt = self.format.chat_prompt(self.tokenizer, messages, tools, flags)
        except ValueError as err:
            raise bad("messages", str(err)) from None
        stop = tuple(self.format.stop_ids(self.tokenizer))
        if call.json_schema is None:
            return AgentTurn(prompt, self.tokenizer, stop, self.format.chat_thinking(flags), tools)
        # what the template writes before content, thinking off (GLM-5.3-Flash, which always thinks: `</think>`)
        answer = self._grammar(grammar.lark([("", grammar.json_rule(call.json_schema))]), "response_format")
        return AgentTurn(prompt + self.format.answer_lead_ids(self.tokenizer), self.tokenizer, stop, False, None,
                         answer, json_answer=True)

    def _effort(self, call: Call, flags: dict) -> dict:
        """`flags` with OpenAI's top-level `reasoning_effort` as the template's kwarg, where the template writes a
        reasoning-effort line (GLM-5.2, GLM-5.3-Flash) and the value is one of its efforts; 400 naming
        `reasoning_effort` otherwise, or where the reasoning_effort of `chat_template_kwargs` says another."""
        effort = call.reasoning_effort
        if effort is None:
            return flags
        why = self.format.effort_problem(effort)
        if why:
            raise bad("reasoning_effort", why)
        if flags.get("reasoning_effort", effort) != effort:
            raise bad("reasoning_effort", f"{effort!r} where chat_template_kwargs.reasoning_effort says "
                                          f"{flags['reasoning_effort']!r}: leave one out")
        return {**flags, "reasoning_effort": effort}

    def _template_flags(self, value) -> dict:
        """`chat_template_kwargs` checked: an object of the template's flags (`AgentFormat.template_flags`), each
        true or false, and `reasoning_effort` one its template writes (GLM-5.2's); {} where none is given."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad("chat_template_kwargs", f"must be an object, got {value!r:.80}")
        for key, flag in value.items():
            if key not in self.format.template_flags:
                raise bad(f"chat_template_kwargs.{key}", f"{self.format.title}'s chat template takes "
                                                          f"{', '.join(self.format.template_flags)}, not {key!r}")
            if key == "reasoning_effort":
                why = self.format.effort_problem(flag) if flag is not None else "must name an effort, not null"
                if why:
                    raise bad(f"chat_template_kwargs.{key}", why)
            elif not isinstance(flag, bool):
                raise bad(f"chat_template_kwargs.{key}", f"must be true or false, got {flag!r:.80}")
        return dict(value)

    def _agent_messages(self, messages) -> list[dict]:
        """The request's messages in the chat template's form: roles system / user / assistant / tool, the last a
        user or tool message; an assistant's `reasoning_content` (a string) and its calls as the template reads
        them (arguments a dict). 400 naming the message's field the template cannot take."""
        out = []
        for i, message in enumerate(messages):
            role = message["role"]
            if role not in _AGENT_ROLES:
                raise bad(f"messages[{i}].role", f"must be one of {_AGENT_ROLES}, got {role!r}")
            if "tools" in message:
                raise bad(f"messages[{i}].tools", f"{self.format.title} takes tools as the request's tools")
            reasoning = message.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise bad(f"messages[{i}].reasoning_content", f"must be a string, got {reasoning!r:.80}")
            out.append({"role": role, "content": message["content"],
                        **({"reasoning_content": reasoning} if reasoning is not None else {}),
                        **({"tool_calls": [{"type": "function", "function": dict(c)} for c in message["tool_calls"]]}
                           if message.get("tool_calls") else {})})
        self._last_role(out[-1], ("user", "tool"), len(out) - 1)
        return out

    def _call_grammar(self, names: list[str], tools: list, lead: bool = True) -> str:
        """The Lark grammar of a call to one of `names` (each declared in `tools`): with `lead`, its first line (as the
        version writes it), then its arguments in the version's form under the tool's parameters schema."""
        alternatives, rules = [], []
        for i, name in enumerate(names):
            schema = _arguments_schema(next(_function(t) for t in tools if _function(t).get("name") == name))
            if self.format.tool_arguments_form == "python":
                rules += grammar.python_call_rules(schema, f"call{i}")
                body = f"call{i}"
            else:
                body = grammar.json_rule(schema)
            text = self.tokenizer.decode(self.format.tool_call_lead(self.tokenizer, name)) if lead else ""
            alternatives.append((text, body))
        return grammar.lark(alternatives, rules)

    def _grammar(self, lark: str, param: str) -> str:
        """`lark`, checked: 400 naming `param` where it cannot be decoded under (a schema llguidance refuses)."""
        try:
            grammar.check(lark, self.tokenizer, self.rows)
        except grammar.GrammarError as err:
            raise bad(param, f"the answer cannot be held to it: {err}") from None
        return lark

    def _refused_part(self, query: str, history: list, role: str, tools) -> str:
        """The parameter to name where the prompt cannot be built: "tools" where the chat builds without them
        (a GLM-4 chat template that takes no tools, or not these), else "messages"."""
        if tools and history and "tools" in history[0]:
            plain = [{k: v for k, v in history[0].items() if k != "tools"}, *history[1:]]
            try:
                prepare_turn(self.tokenizer, query, plain, role, self.context, None)
                return "tools"
            except ValueError:
                pass
        return "messages"

    @staticmethod
    def _fold_system(history: list[dict], last: dict) -> tuple[list[dict], dict]:
        """ChatGLM-6B / ChatGLM2 have no system role: the leading system messages' text goes before the first
        user message's ("system\nuser"), as their users write an instruction."""
        systems = 0
        while systems < len(history) and history[systems]["role"] == "system":
            systems += 1
        if not systems:
            return history, last
        text = "\n".join(m["content"] for m in history[:systems])
        rest = [*history[systems:], last]
        if rest[0]["role"] == "user":
            rest[0] = {**rest[0], "content": f"{text}\n{rest[0]['content']}"}
        return rest[:-1], rest[-1]

    def _called_tool(self, call: Call) -> str | None:
        """The tool the answer must call (`tool_choice` a named function, or "required" with one tool), else None;
        400 naming tool_choice where there are no tools or the named one is not declared."""
        if call.tool_choice not in ("required", "function"):
            return None
        if not call.tools:
            raise bad("tool_choice", f"{call.tool_choice!r} needs tools: none are given")
        names = [_function(tool).get("name") for tool in call.tools]
        if call.tool_choice == "function":
            if call.tool_name not in names:
                raise bad("tool_choice", f"names {call.tool_name!r}, which tools do not declare ({names})")
            return call.tool_name
        return names[0] if len(names) == 1 else None  # "required" among several: a grammar of every call

    def _no_tool_calls(self, history: list[dict]) -> None:
        for i, message in enumerate(history):
            if "tool_calls" in message:
                raise bad(f"messages[{i}].tool_calls", f"{self.format.title} has no tool calls here")

    def _no_tool_results(self, messages) -> None:
        """A tool's result (a `tool` or `observation` message) where the version has no tool form: 400 with the reason
        its training refuses one for (`PromptFormat.check_turn`); the versions that chat in pairs refuse its role."""
        for i, message in enumerate(messages):
            if message["role"] in ("tool", "observation"):
                try:
                    self.format.check_turn(DialogueTurn("observation", message["content"]))
                except ValueError as err:
                    raise bad(f"messages[{i}].role", str(err)) from None

    def _role_messages(self, history: list[dict]) -> list[dict]:
        """ChatGLM3 / GLM-4 history: OpenAI's `tool` role as `observation`; an assistant's tool calls as the messages
        the version writes for them (`PromptFormat.tool_call_message`), after its text if it has any."""
        messages = []
        for i, message in enumerate(history):
            message["role"] = "observation" if message["role"] == "tool" else message["role"]
            if message["role"] not in ROLES:
                raise bad(f"messages[{i}].role", f"must be one of {ROLES + ('tool',)}, got {message['role']!r}")
            calls = message.pop("tool_calls", [])
            if message["role"] == "assistant":
                message.setdefault("metadata", "")
            if not calls or message["content"]:
                messages.append(message)
            for j, call in enumerate(calls):
                try:
                    messages.append(self.format.tool_call_message(call["name"], call["arguments"]))
                except ValueError as err:
                    raise bad(f"messages[{i}].tool_calls[{j}]", str(err)) from None
        return messages

    def _pairs(self, history: list[dict]) -> list[tuple[str, str]]:
        if len(history) % 2:
            raise bad("messages", f"{self.format.title} chats in rounds: user and assistant messages in turn, the last "
                                  "one the user's")
        pairs = []
        for i in range(0, len(history), 2):
            for j, role in ((i, "user"), (i + 1, "assistant")):
                if history[j]["role"] != role:
                    raise bad(f"messages[{j}].role", f"{self.format.title} chats in rounds of user then assistant "
                                                     f"messages (no system role); expected {role!r}, got "
                                                     f"{history[j]['role']!r}")
            pairs.append((history[i]["content"], history[i + 1]["content"]))
        return pairs

    @staticmethod
    def _last_role(message: dict, allowed: tuple[str, ...], index: int) -> str:
        if message["role"] not in allowed:
            raise bad(f"messages[{index}].role", f"the last message must be from {' or '.join(allowed)}, got "
                                                 f"{message['role']!r}")
        return message["role"]

    # ------------------------------------------------------------------------------------------
    # completion and extraction

    def completion_prompts(self, call: Call) -> list[list[int]]:
        """The run's prompt format around each of `call.prompts`, uncut (whether they fit is the caller's check), or
        each of `call.prompt_ids` as it is (400 naming an id the tokenizer does not have)."""
        for i, ids in enumerate(call.prompt_ids):
            for j, token in enumerate(ids):
                if not 0 <= token < len(self.tokenizer):
                    where = f"prompt[{i}][{j}]" if len(call.prompt_ids) > 1 else f"prompt[{j}]"
                    raise bad(where, f"{token} is not a token id of this model's tokenizer "
                                     f"(0 to {len(self.tokenizer) - 1})")
        return [list(ids) for ids in call.prompt_ids] or [self._completion_prompt(text) for text in call.prompts]

    def prompt_scored(self, ids: list[int], top: int) -> list:
        """An echoed prompt's tokens as `protocol.Scored` with their log probabilities and the `top` likeliest
        (`scoring.prompt_logprobs`, a forward between two engine steps); its first token has none (None)."""
        with self.engine.model_lock:
            scored = prompt_logprobs(self.model, ids, top, len(self.tokenizer))
        return [(self.tokenizer.decode([ids[0]]), None, None)] + self.scored(
            (token, LogProb(*item)) for token, item in zip(ids[1:], scored))

    def _completion_prompt(self, text: str) -> list[int]:
        # room for the whole text, so an over-long prompt is refused at its real length, not at a cut one
        room = self.context + 4 * len(self.encoding.prompt + text) + 64
        encoding = EncodingOptions(prompt=self.encoding.prompt, max_src_len=room, max_len=room + 2)
        return self.format.prompt_ids(self.tokenizer, SPORecord(text, None, source="prompt"), encoding)[0]

    def completion_render(self) -> Callable[[list[int]], str]:
        return lambda ids: self.format.decode_answer(self.tokenizer, ids)

    async def extract(self, call: Call, disconnected=None) -> tuple[list[dict], int, int]:
        """(rows, prompt tokens, generated tokens) of `call.texts`, decoded together in the engine."""
        records = [SPORecord(text, None, source=f"texts[{i}]") for i, text in enumerate(call.texts)]
        prompts = await asyncio.to_thread(lambda: [self.format.prompt_ids(self.tokenizer, record, self.encoding)
                                                   for record in records])  # tokenizing: off the event loop
        budget = call.max_tokens or self.encoding.answer_budget
        for i, (prompt, _) in enumerate(prompts):
            require_fitting(len(prompt), budget, self.context, param=f"texts[{i}]")
        stop_ids = self.format.stop_ids(self.tokenizer)
        tickets = [Ticket(self.engine, self.mailbox(), prompt, budget, call, stop_ids) for prompt, _ in prompts]
        answers = await asyncio.gather(*(_collect_ids(t, disconnected) for t in tickets))
        rows = []
        for i, (record, (_, cut), ids) in enumerate(zip(records, prompts, answers)):
            row = make_row(i, record, self.tokenizer, ids, text_truncated=cut, free_text=self.free_text)
            rows.append({k: row[k] for k in ("index", "text", "text_truncated", "generated", "triples", "malformed",
                                             "new_tokens", "stopped")})
        return rows, sum(len(p) for p, _ in prompts), sum(len(ids) for ids in answers)

    # ------------------------------------------------------------------------------------------
    # decoding

    def generate(self, prompts: Sequence[tuple[list[int], int]], call: Call, render: Callable[[list[int]], str],
                 hold: Callable[[list[int]], bool] | None = None, disconnected=None,
                 grammar_text: str | None = None) -> list[AsyncIterator[Delta | Done]]:
        """The events of each choice (`call.n` a prompt of `prompts`, (ids, budget) each; choice p * n + i is
        prompt p's answer seeded `protocol.seeds(call)[i]`): deltas of the answer text `render(ids)` (none while
        `hold(ids)`), then `Done`; each answer kept to `grammar_text` (Lark) where given. The requests are in the
        engine's queue when this returns (429 / 503 raised here, before any byte of a response is sent, the choices
        queued before it cancelled)."""
        tickets: list[Ticket] = []
        stop_ids = self.format.stop_ids(self.tokenizer)
        try:
            for prompt, budget in prompts:
                for seed in seeds(call):
                    constraint = grammar.Constraint(grammar_text, self.tokenizer, self.rows) if grammar_text else None
                    tickets.append(Ticket(self.engine, self.mailbox(), prompt, budget, replace(call, seed=seed),
                                          stop_ids, constraint))
        except ApiError:
            for ticket in tickets:
                self.engine.cancel(ticket.request)
            raise
        lookahead = self.format.stream_lookahead
        return [self._text_events(ticket, TextStream(render, call.stop, lookahead, hold), disconnected)
                for ticket in tickets]

    async def _text_events(self, ticket: Ticket, stream: TextStream, disconnected) -> AsyncIterator[Delta | Done]:
        ids: list[int] = []
        scored: list[LogProb] = []  # each answer id's, where asked; the stop id that ends an answer has none
        stops, shown = set(ticket.request.stop_ids), 0  # shown: the ids whose log probabilities went with a delta

        def unsent() -> tuple:
            """(id, LogProb) of the ids after those a delta took, taken now."""
            nonlocal shown
            pairs, shown = tuple(zip(ids[shown:], scored[shown:])), len(scored)
            return pairs

        async for item in ticket.events(disconnected):
            if isinstance(item, LogProb):
                scored.append(item)
                continue
            if isinstance(item, Finished):
                _raise_failed(item)
                text, hit = stream.update(ids, final=True)
                if text:
                    yield Delta(text, unsent())
                finish = "stop" if item.reason == FINISH_STOP or hit else "length"
                yield Done(stream.text, finish, len(ids), tuple(ids), hit, tuple(scored), unsent())
                return
            ids.append(item)
            if item in stops and len(scored) == len(ids):
                scored.pop()
            text, hit = stream.update(ids, final=False)
            if text:
                yield Delta(text, unsent())
            if hit:
                yield Done(stream.text, "stop", len(ids), tuple(ids), True, tuple(scored), unsent())
                return  # leaving the iteration cancels the request in the engine

    def scored(self, pairs) -> list:
        """(text, log probability, ((text, log probability), ...)) of each (id, `LogProb`) of `pairs`
        (`protocol.Scored`: a `Done`'s `scored_pairs`, or a `Delta`'s `scored`)."""
        text = self.tokenizer.decode
        return [(text([token]), item.logprob, tuple((text([alt]), value) for alt, value in item.top))
                for token, item in pairs]


def _function(tool: dict) -> dict:
    """An OpenAI tool's function (`{"type": "function", "function": f}`), or the tool itself in the short form."""
    return tool.get("function") or tool


def _arguments_schema(function: dict) -> dict:
    """The JSON schema a call's arguments keep to: the function's `parameters` (a JSON schema: `type` or `properties`),
    with no keys beside the declared ones unless it says otherwise (`additionalProperties`); any object where it
    declares no schema (ChatGLM3's demos write `{"city": "str"}`)."""
    parameters = function.get("parameters")
    if not (isinstance(parameters, dict) and ("type" in parameters or "properties" in parameters)):
        return {"type": "object"}
    return {"additionalProperties": False, **parameters} if "properties" in parameters else parameters


async def _collect_ids(ticket: Ticket, disconnected) -> list[int]:
    ids: list[int] = []
    async for item in ticket.events(disconnected):
        if isinstance(item, Finished):
            _raise_failed(item)
            return ids
        ids.append(item)
    raise ApiError(499, "the client went away")



def _raise_failed(finished: Finished) -> None:
    """A request that did not finish by itself: 500 where decoding failed; 503 where the engine closed under it
    (the server shutting down: a client's own leaving never reads its ticket's end)."""
    if finished.reason == FINISH_ERROR:
        raise ApiError(500, f"decoding failed: {finished.error}", code="engine_error")
    if finished.reason == FINISH_CANCELLED:
        raise ApiError(503, "the server is shutting down: the answer was cut where its grace ran out",
                       code="shutting_down")
