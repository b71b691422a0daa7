"""OpenAI's HTTP protocol as the server speaks it: request bodies checked into `Call`s, errors as OpenAI's
error JSON, and the response and stream-chunk objects.

A bad field is an `ApiError` (HTTP 400) naming the parameter (`param`, OpenAI's field), never a traceback.
Fields read (the rest are ignored, as OpenAI ignores unknown ones). Refused where they would change the
answer, at any value but their default: `best_of` other than `n`, `presence_penalty`, `frequency_penalty`,
`logit_bias`, completions' `suffix` and `response_format` (and `tools` in a chat without tool calls):
- every generating endpoint: `model` (the served id; may be omitted), `max_tokens` (or
  `max_completion_tokens`), `temperature` (0 = greedy), `top_p`, `top_k` (beyond OpenAI), `seed` (-2**63 to
  2**64 - 1: a 64-bit seed, signed or not; choice i of `n` is seeded with seed + i, wrapped into the range), `stop`
  (a string or up to 4), `stream`, `stream_options.include_usage`, `n` (answers of the prompt, up to MAX_CHOICES:
  each a row of the running batch); log probabilities of the answer tokens (the model's, before sampling options):
  chat's `logprobs` and `top_logprobs` (up to 20), completions' `logprobs` (up to 5);
- chat: `messages` (role + content, `developer` read as `system`; content a string or a list of text parts;
  an assistant's `tool_calls`,
  its content then null or text, and its `reasoning_content`, which the agent GLMs' prompt keeps and the other
  versions' ignores), `tools` (ChatGLM3 / GLM-4 / the agent GLMs; tools, calls and results as training data
  holds them: `check_tool_use`), `tool_choice` ("auto", "none", "required", a named function), `response_format`
  (`text`, `json_object`, `json_schema`: the answer decoded under the schema's grammar, strict or not),
  `chat_template_kwargs` (the agent GLMs' `enable_thinking` / `clear_thinking`, GLM-5.2's `reasoning_effort`,
  checked by the service, which knows the version; the other versions ignore it);
- completions: `prompt` (a string, or a list of up to MAX_CHOICES strings: choice p * n + i is prompt p's i-th;
  or token ids, a list or a list of lists: each the whole prompt, no prompt format around it), `echo` (token-id
  prompts: the prompt's text, and with `logprobs` its tokens' log probabilities, before the answer's: what
  lm-eval's loglikelihood reads);
- extract: `texts` (a list of strings, or `text`); `stream` and `stop` are refused (rows come whole, ended by
  the model).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chatglm_tune.data.dialogues import DialogueError, from_messages
from chatglm_tune.decoding.sampling import SEED_MAX, SEED_MIN
from chatglm_tune.options import SamplingOptions

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 16  # `n` at most, and the choices of a completion (its prompts times n): each is a row of the batch


class ApiError(Exception):
    """An HTTP error in OpenAI's form: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(frozen=True)
class Call:
    """What a generating request asks for, checked."""

    max_tokens: int | None  # None: up to the context
    sampling: SamplingOptions
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    messages: tuple = ()  # chat
    tools: list | None = None  # chat: ChatGLM3 / GLM-4 tools, put in the system message
    tool_choice: str = "auto"  # chat: "auto", "none", "required", or "function" (a named one: `tool_name`)
    tool_name: str | None = None
    json_schema: dict | None = None  # chat: the JSON schema the answer keeps to (`response_format`), None for text
    template_kwargs: object = None  # chat: `chat_template_kwargs` as sent (the agent GLMs' service checks it)
    reasoning_effort: object = None  # chat: OpenAI's `reasoning_effort` as sent (the service checks it)
    prompts: tuple[str, ...] = ()  # completions: texts, each inside the run's prompt format
    prompt_ids: tuple[tuple[int, ...], ...] = ()  # completions: or token ids, each the whole prompt
    echo: bool = False  # completions of token ids: the prompt comes back before the answer (with its logprobs)
    n: int = 1  # answers a prompt
    logprobs: int | None = None  # alternatives each answer token's log probability comes with (None: none)
    texts: tuple[str, ...] = ()  # extract
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


def parse_call(body: object, *, kind: str, served: str, defaults: SamplingOptions) -> Call:
    """`body` (the decoded JSON) of a `kind` ("chat", "completion", "extract") request as a Call; ApiError 400
    on a bad field. `defaults`: the sampling when the request names none (temperature, top_p, top_k)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(400, f"model {model!r} is not served here; this server serves {served!r}", param="model",
                       code="model_not_found")
    n = _n(body, kind)
    _refuse_unsupported(body, kind)
    logprobs = _logprobs(body, kind)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise bad(max_name, f"must be an integer >= 1, got {max_tokens!r}")
    sampling = _sampling(body, defaults)
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise bad("seed", f"must be an integer from {SEED_MIN} to {SEED_MAX} (-2**63 to 2**64 - 1, what a random "
                          f"generator is seeded with), got {seed!r:.80}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise bad("stream_options", f"must be an object, got {options!r}")
    fields = {}
    if kind == "chat":
        fields["messages"] = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise bad("tools", f"must be a list of tool objects, got {tools!r:.80}")
        fields["tools"] = tools or None
        fields["tool_choice"], fields["tool_name"] = _tool_choice(body.get("tool_choice"))
        fields["json_schema"] = _response_schema(body.get("response_format"))
        fields["template_kwargs"] = body.get("chat_template_kwargs")
        fields["reasoning_effort"] = body.get("reasoning_effort")
        if fields["json_schema"] is not None and fields["tools"] and fields["tool_choice"] != "none":
            raise bad("response_format", "a JSON answer and tools at once: leave one out (or tool_choice \"none\")")
    elif kind == "completion":
        fields["prompts"], fields["prompt_ids"] = _prompts(body.get("prompt"), n)
        fields["echo"] = _echo(body.get("echo"), fields["prompt_ids"])
    else:
        fields["texts"] = _texts(body)
        if stream:
            raise bad("stream", "extraction answers at once: leave stream out")
        if body.get("stop") is not None:
            raise bad("stop", "an extraction answer ends where the model ends it (the rows say so): leave stop out")
    return Call(max_tokens=max_tokens, sampling=sampling, seed=seed, stop=_stop(body.get("stop")), stream=stream,
                include_usage=bool(options.get("include_usage")), n=n, logprobs=logprobs, **fields)


def _n(body: Mapping, kind: str) -> int:
    """The answers asked for each prompt: `n` (1 to MAX_CHOICES; extraction: 1); `best_of`, if given, must equal it
    (answers are not ranked here: the best of n is each of them)."""
    n = body.get("n")
    n = 1 if n is None else n
    if not (_is_int(n) and 1 <= n <= (1 if kind == "extract" else MAX_CHOICES)):
        limit = "1: an extraction row is the model's one answer" if kind == "extract" else f"from 1 to {MAX_CHOICES}"
        raise bad("n", f"must be an integer {limit}, got {body.get('n')!r:.80}")
    if body.get("best_of") not in (None, n):
        raise bad("best_of", f"only best_of = n ({n}) is supported: answers are not ranked here, got "
                             f"{body.get('best_of')!r:.80}")
    return n


MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # as OpenAI: chat's top_logprobs, completions' logprobs


def _logprobs(body: Mapping, kind: str) -> int | None:
    """How many alternatives each answer token's log probability comes with (None: no log probabilities). Chat:
    `logprobs` true and `top_logprobs` (0 to 20); completions: `logprobs` (0 to 5). Streamed, each chunk carries
    those of the tokens it completes (the last, those of tokens that showed no text)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if asked not in (None, True, False):
            raise bad("logprobs", f"must be true or false, got {asked!r:.80}")
        if top is not None and not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS["chat"] and asked):
            raise bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS['chat']}, with logprobs true, "
                                      f"got {top!r:.80}")
        count = (top or 0) if asked else None
    elif asked is not None and not (_is_int(asked) and 0 <= asked <= MAX_TOP_LOGPROBS["completion"]):
        raise bad("logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS['completion']}, got {asked!r:.80}")
    else:
        count = None if kind == "extract" else asked
    return count


def seeds(call: Call) -> list[int | None]:
    """The seed of each of the `n` answers: the request's seed + i, wrapped into SEED_MIN..SEED_MAX (None: none)."""
    if call.seed is None:
        return [None] * call.n
    span = SEED_MAX - SEED_MIN + 1
    return [SEED_MIN + (call.seed + i - SEED_MIN) % span for i in range(call.n)]


def _refuse_unsupported(body: Mapping, kind: str) -> None:
    """400 naming a field that would change the answer and that this server does not do (its default value
    passes): penalties, a logit bias, a response format other than text, suffix."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0):
            raise bad(name, f"penalties are not applied by this server: leave {name} out or 0, got {body.get(name)!r}")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "a logit bias is not applied by this server: leave it out")
    if kind != "chat" and _response_schema(body.get("response_format")) is not None:
        raise bad("response_format", "a JSON answer is asked of chat completions: leave response_format out here")
    if kind == "completion":
        if body.get("suffix") not in (None, ""):
            raise bad("suffix", "insertion (a text after the completion) is not supported: leave suffix out")


def _response_schema(value) -> dict | None:
    """OpenAI's `response_format` as the JSON schema the answer keeps to: None for text (or none given), an object
    of any keys for `json_object`, the schema of `json_schema` (strict or not: the answer keeps to it either way)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise bad("response_format.json_schema", f"must be an object with a \"schema\" object, got {spec!r:.80}")
        return dict(schema)
    raise bad("response_format", f'"type" must be "text", "json_object" or "json_schema", got {value!r:.80}')


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping, name: str, lo: float, hi: float, *, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or value < lo or (lo_open and value == lo):
        raise bad(name, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def _sampling(body: Mapping, defaults: SamplingOptions) -> SamplingOptions:
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise bad("top_k", f"must be an integer >= 0 (0 = off), got {top_k!r}")
    do_sample = defaults.do_sample if temperature is None else temperature > 0
    return SamplingOptions(do_sample=do_sample,
                           temperature=defaults.temperature if temperature is None else temperature,
                           top_p=defaults.top_p if top_p is None else top_p,
                           top_k=defaults.top_k if top_k is None else (top_k or None))


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of them, got {value!r:.80}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return tuple(stops)


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}[{i}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(where, f"must be a string or a list of text parts, got {content!r:.80}")


def _messages(value) -> tuple[dict, ...]:
    """Each message as {"role", "content"} (+ "tools" of a system message, + an assistant's "tool_calls" as
    [{"name", "arguments": dict}]: its content may then be null, as the openai SDK sends it; + an assistant's
    "reasoning_content" where it is not null, as sent)."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise bad(f"messages[{i}]", f"must be an object with role and content, got {message!r:.80}")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role", f"must be a string, got {role!r}")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system message
        calls = _tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls") if role == "assistant" else []
        content = message.get("content")
        content = "" if content is None and calls else _text_content(content, f"messages[{i}].content")
        reasoning = message.get("reasoning_content") if role == "assistant" else None
        messages.append({"role": role, "content": content,
                         **({"tools": message["tools"]} if "tools" in message else {}),
                         **({"tool_calls": calls} if calls else {}),
                         **({"reasoning_content": reasoning} if reasoning is not None else {})})
    return tuple(messages)


def _tool_calls(value, where: str) -> list[dict]:
    """An assistant message's OpenAI `tool_calls` as [{"name", "arguments": the JSON object}]."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(where, f"must be a list of tool calls, got {value!r:.80}")
    calls = []
    for j, item in enumerate(value):
        function = item.get("function") if isinstance(item, Mapping) else None
        if not (isinstance(function, Mapping) and isinstance(function.get("name"), str) and function["name"]):
            raise bad(f"{where}[{j}]", "must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}, "
                                       f"got {item!r:.80}")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad(f"{where}[{j}].function.arguments", f"must be a JSON object in a string, got "
                                                         f"{function.get('arguments')!r:.80}")
        calls.append({"name": function["name"], "arguments": arguments})
    return calls


def _tool_choice(value) -> tuple[str, str | None]:
    """OpenAI's `tool_choice`: (kind, the function's name where one is named)."""
    if value is None:
        return "auto", None
    if value in ("auto", "none", "required"):
        return value, None
    function = value.get("function") if isinstance(value, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("name"), str) and function["name"]:
        return "function", function["name"]
    raise bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
                             f"got {value!r:.80}")


def check_tool_use(messages: Sequence[dict], tools: list | None) -> None:
    """A chat's tools, tool calls and tool results (`_messages`' messages, the request's `tools`) under the rules
    fine-tuning data follows: `dialogues.from_messages` reads them as GLM-4's record (`_tool_record`). So every tool
    names itself, every call names a declared tool, and each tool result answers a call made before it. A break is
    a 400 naming the request's parameter (`tools[j]`, `messages[i].tool_calls[j].function.name`,
    `messages[i].role`, ...), its message and code the rule's (`DialogueError`). A chat with no tools, calls or
    results is not checked."""
    if not tools and not any(m["role"] == "tool" or "tool_calls" in m or "tools" in m for m in messages):
        return
    record, origins = _tool_record(messages, tools)
    try:
        from_messages({"messages": record})
    except DialogueError as err:
        param = _request_param(err.field, origins)
        raise ApiError(400, f"{param}: {err}", param=param, code=err.reason) from None


def _tool_record(messages: Sequence[dict], tools: list | None) -> tuple[list[dict], list[str]]:
    """(GLM-4's record messages of a chat, the request parameter each comes from): the tools a first system
    message's (each as `{"type": "function", "function": ...}`; a system message's own tools too), each of an
    assistant's calls a message whose metadata names the tool and whose content is its arguments, a `tool` message
    an observation. An assistant's calls wait for their results: each `tool` message comes right after the first
    call not yet answered (parallel calls, answered in turn, are a call and its result each, as training data
    writes them); calls left unanswered come before the next other message."""
    record, origins, waiting = [], [], []  # waiting: (a call's message, its parameter), not answered yet

    def add(message: dict, origin: str) -> None:
        record.append(message)
        origins.append(origin)

    if tools:
        add({"role": "system", "content": "", "tools": [_function(tool) for tool in tools]}, "tools")
    for i, message in enumerate(messages):
        if message["role"] == "tool" and waiting:
            add(*waiting.pop(0))
        elif message["role"] != "tool":
            for call in waiting:
                add(*call)
            waiting = []
        calls = message.get("tool_calls", [])
        if not calls or message["content"]:
            own = message.get("tools") if message["role"] == "system" else None
            own = [_function(tool) for tool in own] if isinstance(own, list) else own
            role = "observation" if message["role"] == "tool" else message["role"]
            add({"role": role, "content": message["content"], **({"tools": own} if own is not None else {})},
                f"messages[{i}]")
        waiting += [({"role": "assistant", "metadata": call["name"],
                      "content": json.dumps(call["arguments"], ensure_ascii=False)}, f"messages[{i}].tool_calls[{j}]")
                    for j, call in enumerate(calls)]
    for call in waiting:
        add(*call)
    return record, origins


def _function(tool):
    """A tool as GLM-4 declares one, `{"type": "function", "function": ...}` (ChatGLM3's are the function alone)."""
    return tool if not isinstance(tool, Mapping) or "function" in tool else {"type": "function", "function": tool}


def _request_param(field: str, origins: list[str]) -> str:
    """The request's parameter of a field of `check_tool_use`'s record (`messages[k].metadata`, ...)."""
    match = re.fullmatch(r"messages\[(\d+)\](.*)", field)
    if match is None:
        return "messages"  # the conversation as a whole
    origin, rest = origins[int(match[1])], match[2]
    if origin == "tools":
        return "tools" + rest.removeprefix(".tools")
    if ".tool_calls[" in origin:
        return origin + {".metadata": ".function.name", ".content": ".function.arguments"}.get(rest, rest)
    return origin + rest


def _prompts(value, n: int) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """(texts, token-id prompts) of completions' `prompt`: a string, a list of strings, a list of ids or a list of
    lists of ids; at most MAX_CHOICES choices (prompts times n)."""
    prompts = value if isinstance(value, list) else [value]
    if prompts and all(_is_int(v) for v in prompts):
        prompts = [prompts]
    texts = all(isinstance(v, str) for v in prompts)
    if not prompts or not (texts or all(isinstance(v, list) and v and all(_is_int(i) for i in v) for v in prompts)):
        raise bad("prompt", f"must be a string, a list of strings, a list of token ids or a list of such lists, "
                            f"got {value!r:.80}")
    if len(prompts) * n > MAX_CHOICES:
        raise bad("prompt", f"{len(prompts)} prompts x n {n} are more than the {MAX_CHOICES} choices a request may ask")
    return (tuple(prompts), ()) if texts else ((), tuple(tuple(ids) for ids in prompts))


def _echo(value, prompt_ids: tuple) -> bool:
    if value not in (None, True, False):
        raise bad("echo", f"must be true or false, got {value!r:.80}")
    if value and not prompt_ids:
        raise bad("echo", "the prompt echoed is the one given as token ids (a text prompt goes inside the run's "
                          "prompt format): send the prompt's token ids")
    return bool(value)


def _texts(body: Mapping) -> tuple[str, ...]:
    value = body.get("texts", [body["text"]] if "text" in body else None)
    name = "texts" if "texts" in body else "text"
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t.strip() for t in value):
        raise bad(name, "must be a non-empty list of non-empty strings")
    return tuple(value)


def require_fitting(prompt_tokens: int, max_tokens: int | None, context: int, *, param: str) -> int:
    """The answer budget of a prompt: `max_tokens`, or what the context leaves; 400 when it does not fit."""
    room = context - prompt_tokens
    if room < 1:
        raise bad(param, f"the prompt is {prompt_tokens} tokens; the model's context is {context} tokens")
    if max_tokens is not None and max_tokens > room:
        raise bad("max_tokens", f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the model's context "
                                f"of {context} tokens (at most {room})")
    return room if max_tokens is None else max_tokens


# ----------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_message(content: str, tool_call: dict | None) -> dict:
    if tool_call is None:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": None, "tool_calls": [tool_call]}


Scored = tuple  # a token's (text, log probability, ((text, log probability) of the likeliest, ...)); an echoed
#                prompt's first token: (text, None, None)


def chat_logprobs(scored: list[Scored] | None) -> dict | None:
    """A chat choice's `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}."""
    if scored is None:
        return None

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(text, logprob), "top_logprobs": [entry(*alt) for alt in top]}
                        for text, logprob, top in scored], "refusal": None}


def completion_logprobs(scored: list[Scored] | None, *, start: int = 0) -> dict | None:
    """A completion choice's `logprobs`: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; a top_logprobs
    entry is keyed by text, so of alternatives that decode alike (pieces of one character) it keeps the likeliest. A
    text_offset is `start` plus the lengths of the tokens' texts before it (a piece of a character decodes alone as
    one replacement character)."""
    if scored is None:
        return None
    offsets, at, tops = [], start, []  # start: where the text of these tokens begins (a stream's chunk)
    for text, _, top in scored:
        offsets.append(at)
        at += len(text)
        tops.append(None if top is None else {})  # None: an echoed prompt's first token, which has no context
        for alternative, logprob in top or ():  # ids of one text (a piece of a character): the likeliest's
            tops[-1].setdefault(alternative, logprob)
    return {"tokens": [text for text, _, _ in scored], "token_logprobs": [logprob for _, logprob, _ in scored],
            "top_logprobs": tops, "text_offset": offsets}


def chat_completion(call: Call, served: str, answers: list[tuple[dict, str, dict | None]], use: dict) -> dict:
    """The chat completion of the `answers` ((message, finish reason, logprobs) of each choice, in order)."""
    choices = [{"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}
               for i, (message, finish, logprobs) in enumerate(answers)]
    return {"id": f"chatcmpl-{call.id}", "object": "chat.completion", "created": call.created, "model": served,
            "choices": choices, "usage": use}


def chat_chunk(call: Call, served: str, delta: dict, finish: str | None = None, use: dict | None = None, *,
               index: int = 0, logprobs: dict | None = None) -> dict:
    choices = ([] if use is not None
               else [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}])
    return {"id": f"chatcmpl-{call.id}", "object": "chat.completion.chunk", "created": call.created, "model": served,
            "choices": choices, **({"usage": use} if use is not None else {})}


def completion(call: Call, served: str, answers: list[tuple], use: dict | None = None) -> dict:
    """A completion (or a chunk of a stream) of the `answers` ((choice index, text, finish reason[, logprobs]))."""
    choices = [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs[0] if logprobs else None}
               for i, text, finish, *logprobs in answers]
    body = {"id": f"cmpl-{call.id}", "object": "text_completion", "created": call.created, "model": served,
            "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def tool_call(call: Call, response: dict, index: int = 0) -> dict:
    """A ChatGLM3 / GLM-4 tool call (`{"name", "parameters"}`) as OpenAI's tool_calls entry (of choice `index`)."""
    return {"id": f"call_{call.id}" + (f"_{index}" if index else ""), "type": "function",
            "function": {"name": response["name"], "arguments": json.dumps(response["parameters"], ensure_ascii=False)}}


def read_tool_call(name: str, arguments: dict) -> dict:
    """A call read from an agent GLM's answer as OpenAI's tool_calls entry: a fresh id `call_<24 hex digits>`, its
    arguments as `json.dumps(arguments, ensure_ascii=False)` (vLLM's glm45 / glm47 tool parsers' text)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def agent_message(reasoning: str | None, content: str, tool_calls: list[dict]) -> dict:
    """An agent GLM's answer as OpenAI's message with vLLM's `reasoning_content` (null where the answer has none):
    content null where it is empty and there are calls."""
    return {"role": "assistant", "content": content or (None if tool_calls else ""), "reasoning_content": reasoning,
            **({"tool_calls": tool_calls} if tool_calls else {})}


def tool_call_deltas(entry: dict) -> list[dict]:
    """A tool_calls entry as OpenAI streams it: its id, type and name (arguments empty), then its arguments."""
    function = entry["function"]
    return [{"index": 0, "id": entry["id"], "type": entry["type"],
             "function": {"name": function["name"], "arguments": ""}},
            {"index": 0, "function": {"arguments": function["arguments"]}}]
