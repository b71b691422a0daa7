"""The HTTP application: OpenAI's routes on a `Service`, as a Starlette app (uvicorn runs it).

    GET  /                      the chat page (chat with streaming, an extraction box); /favicon.ico its icon
    GET  /health                {"status": "ok", "running", "waiting", "steps"}
    GET  /v1/models             the one served model (and /v1/models/{id}: it, or 404)
    POST /v1/chat/completions   the version's chat; "stream": true for server-sent events (the agent GLMs': their
                                reasoning as `reasoning_content`, their XML calls as `tool_calls`: `service`)
    POST /v1/completions        the run's prompt format around "prompt"; streams too
    POST /v1/extract            {"texts": [...]} -> {"results": [{"triples": [[s, p, o]], ...}]}

Errors are OpenAI's error JSON: 400 a bad request (the parameter named), 401 a missing or wrong key when the
server has one (`Authorization: Bearer KEY`; `/`, its icon and `/health` are open), 404 an unknown route or model, 405 a
route's wrong method, 413 a body over `ServingOptions.max_body_mb`, 429 a full queue, 503 while shutting down.
Bodies are parsed and prompts built (tokenized) on worker threads, so a large one stalls neither /health nor the
streams. With `ServingOptions.cors_origins` (serve.py `--cors-origin`), pages of those origins may call it (CORS
headers, preflights answered). A stream is `data: {chunk}` lines ending `data: [DONE]`; a client that
disconnects cancels its request (streaming: at once; otherwise within `service.DISCONNECT_POLL_S`, tokens
coming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chatglm_tune.serve import protocol
from chatglm_tune.serve.protocol import ApiError, parse_call
from chatglm_tune.serve.service import AgentTurn, Delta, Done, Service

log = logging.getLogger("chatglm_tune.serve")

DRAIN_BYTES = 64 * 2 ** 20  # how much of a refused body is read (and dropped) before its 413


def build_app(service: Service, *, api_key: str | None = None) -> Starlette:
    """The app serving `service`; the engine starts with the app and stops when it shuts down."""
    def guard(handler):
        return _guarded(handler, api_key, service)

    async def health(request: Request):
        engine = service.engine
        status = "shutting_down" if service.stopping else "ok"
        return JSONResponse({"status": status, "running": engine.running, "waiting": engine.waiting,
                             "steps": engine.steps}, status_code=503 if service.stopping else 200)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_object(service)]})

    async def model(request: Request):
        return JSONResponse(_model_object(service, request.path_params["model"]))

    limit = int(service.options.max_body_mb * 2 ** 20)

    async def chat(request: Request):
        raw = await _body(request, limit)

        def prepare():  # parsing and tokenizing a large body takes a while: off the event loop
            call = parse_call(_json(raw), kind="chat", served=service.served, defaults=service.chat_sampling)
            return call, service.chat_turn(call)

        call, turn = await asyncio.to_thread(prepare)
        budget = protocol.require_fitting(len(turn.prompt), call.max_tokens, service.context, param="messages")
        streams = service.generate([(turn.prompt, budget)], call, turn.shown, turn.holding, grammar_text=turn.grammar,
                                   disconnected=None if call.stream else request.is_disconnected)
        if call.stream:
            chunks = _agent_chunks if isinstance(turn, AgentTurn) else _chat_chunks
            return _sse(chunks(service, call, turn, streams))

        def body(dones: list[Done]) -> dict:
            answers = [(*_chat_answer(call, turn, done, i),
                        protocol.chat_logprobs(_scored(service, call, done.scored_pairs)))
                       for i, done in enumerate(dones)]
            use = protocol.usage(len(turn.prompt), sum(done.tokens for done in dones))
            return protocol.chat_completion(call, service.served, answers, use)

        return await _answer(streams, body)

    async def completions(request: Request):
        raw = await _body(request, limit)

        def prepare():
            call = parse_call(_json(raw), kind="completion", served=service.served,
                              defaults=service.completion_sampling)
            return call, service.completion_prompts(call)

        call, prompts = await asyncio.to_thread(prepare)
        budgets = [protocol.require_fitting(len(prompt), call.max_tokens, service.context,
                                            param="prompt" if len(prompts) == 1 else f"prompt[{i}]")
                   for i, prompt in enumerate(prompts)]
        echoed = await asyncio.to_thread(_echoed, service, call, prompts) if call.echo else None
        streams = service.generate(list(zip(prompts, budgets)), call, service.completion_render(),
                                   disconnected=None if call.stream else request.is_disconnected)
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        if call.stream:
            return _sse(_completion_chunks(service, call, prompt_tokens, streams, echoed))
        return await _answer(streams, lambda dones: protocol.completion(
            call, service.served, _completion_answers(service, call, dones, echoed),
            protocol.usage(prompt_tokens, sum(done.tokens for done in dones))))

    async def extract(request: Request):
        raw = await _body(request, limit)
        call = await asyncio.to_thread(lambda: parse_call(_json(raw), kind="extract", served=service.served,
                                                          defaults=service.completion_sampling))
        rows, prompt_tokens, new_tokens = await service.extract(call, request.is_disconnected)
        return JSONResponse({"object": "extraction", "model": service.served, "results": rows,
                             "usage": protocol.usage(prompt_tokens, new_tokens)})

    routes = [*_page_routes(), Route("/health", health),
              Route("/v1/models", guard(models)), Route("/v1/models/{model:path}", guard(model)),
              Route("/v1/chat/completions", guard(chat), methods=["POST"]),
              Route("/v1/completions", guard(completions), methods=["POST"]),
              Route("/v1/extract", guard(extract), methods=["POST"])]
    return Starlette(routes=routes, lifespan=_lifespan(service), exception_handlers={HTTPException: _not_found},
                     middleware=_middleware(service.options))


def _page_routes() -> list[Route]:
    """The chat page and its icon (open, as /health is)."""
    files = resources.files("chatglm_tune.serve")
    page, icon = (files.joinpath(name).read_text(encoding="utf-8") for name in ("page.html", "favicon.svg"))

    async def index(request: Request):
        return HTMLResponse(page)

    async def favicon(request: Request):
        return Response(icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    return [Route("/", index), Route("/favicon.ico", favicon)]


def _middleware(options) -> list[Middleware]:
    """CORS for the origins `options.cors_origins` names (none: no CORS headers): a browser page of one may call
    every route, with the API key in its Authorization header; a preflight OPTIONS is answered before the key is
    checked, as browsers send it without one."""
    if not options.cors_origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"], max_age=600)]


def _model_object(service: Service, asked: str | None = None) -> dict:
    """The served model's object; 404 where `asked` names another."""
    if asked is not None and asked != service.served:
        raise ApiError(404, f"model {asked!r} is not served here; this server serves {service.served!r}",
                       param="model", code="model_not_found")
    return {"id": service.served, "object": "model", "created": 0, "owned_by": "chatglm_tune",
            "version": service.format.title, "context_length": service.context}


def _guarded(handler, api_key: str | None, service: Service):
    """`handler` behind the API key (when one is set), its errors as OpenAI's error JSON; 503 while shutting down."""
    async def guarded(request: Request):
        try:
            if service.stopping:
                raise ApiError(503, "the server is shutting down; retry on another", code="shutting_down")
            if api_key is not None and not _authorized(request, api_key):
                raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key")
            return await handler(request)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as err:  # a bug: the client gets a 500 in OpenAI's form, the log the traceback
            log.exception("%s %s failed", request.method, request.url.path)
            failure = ApiError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")
            return JSONResponse(failure.body(), status_code=500)

    return guarded


async def _not_found(request: Request, exc: HTTPException):
    code = "method_not_allowed" if exc.status_code == 405 else "not_found"
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return JSONResponse(err.body(), status_code=exc.status_code)


def _lifespan(service: Service):
    """The engine starts with the app and stops when it shuts down."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.close()

    return lifespan


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


async def _body(request: Request, limit: int) -> bytes:
    """The request's body; 413 once it is over `limit` bytes (by its Content-Length, or as it comes). The rest of a
    body refused is read and dropped, up to `DRAIN_BYTES`, so that a client still sending it reads the 413 rather
    than a connection reset."""
    declared = request.headers.get("content-length", "")
    declared_over = declared.isdigit() and int(declared) > limit
    chunks, size, stream = [], 0, request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit or declared_over:
            await _drain(stream, DRAIN_BYTES - size)
            raise ApiError(413, f"the request body is over the server's limit of {limit / 2 ** 20:g} MB (serve.py "
                                "--max-body-mb)", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(stream, budget: int) -> None:
    """Read and drop the chunks of `stream` until it ends or `budget` bytes have passed."""
    while budget > 0:
        chunk = await anext(stream, None)
        if chunk is None:
            return
        budget -= len(chunk)


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, and a number of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


async def _answer(streams, body) -> JSONResponse:
    """The JSON response of a non-streaming request: `body(dones)` of its choices' `Done` events, in order. A choice
    that fails ends the others (their requests cancelled)."""

    async def done_of(events) -> Done:
        async for event in events:
            if isinstance(event, Done):
                return event
        raise ApiError(499, "the client went away")

    tasks = [asyncio.create_task(done_of(events)) for events in streams]
    try:
        dones = await asyncio.gather(*tasks)  # the first error raised, as it comes
    except BaseException:  # a choice failed, or this request was cancelled: the others end before the error goes on
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return JSONResponse(body(dones))


def _scored(service: Service, call, pairs) -> list | None:
    """`Service.scored` of `pairs` where the request asked for log probabilities, else None."""
    return None if call.logprobs is None else service.scored(pairs)


def _echoed(service: Service, call, prompts: list[list[int]]) -> list[tuple[str, list | None]]:
    """(text, scored tokens or None) of each prompt a completion echoes; 400 where the model cannot take it."""
    try:
        return [(service.tokenizer.decode(prompt), None if call.logprobs is None else
                 service.prompt_scored(prompt, call.logprobs)) for prompt in prompts]
    except ValueError as err:  # a prompt the model cannot place (ChatGLM-6B's needs its [gMASK])
        raise protocol.bad("prompt", str(err)) from None


def _completion_answers(service: Service, call, dones: list[Done], echoed) -> list[tuple]:
    """(choice index, text, finish reason, logprobs) of each answer: with `echoed`, its prompt's text and tokens
    first (choice p * n + i answers prompt p)."""
    answers = []
    for i, done in enumerate(dones):
        text, scored = done.text, _scored(service, call, done.scored_pairs)
        if echoed is not None:
            head, prompt_scored = echoed[i // call.n]
            text = head + text
            scored = None if scored is None else prompt_scored + scored
        answers.append((i, text, done.finish, protocol.completion_logprobs(scored)))
    return answers


async def _merged(streams):
    """(choice index, event) of each choice's events as they come; leaving early ends every choice's events."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events) -> None:
        try:
            async for event in events:
                queue.put_nowait((index, event))
        except Exception as err:  # handed to the reader, which raises it
            queue.put_nowait((index, err))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if event is None:
                running -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()


def _chat_answer(call, turn, done: Done, index: int = 0) -> tuple[dict, str]:
    """(message, finish_reason) of choice `index`: `chat()`'s response; a tool call as OpenAI's tool_calls. An agent
    GLM's answer: its reasoning, content and calls (`AgentTurn.read`), finish_reason "tool_calls" where it calls."""
    if isinstance(turn, AgentTurn):
        reasoning, content, calls = turn.read(done.text)
        entries = [protocol.read_tool_call(c.name, c.arguments) for c in calls]
        return protocol.agent_message(reasoning, content, entries), "tool_calls" if calls else done.finish
    if done.stop_string:
        return protocol.chat_message(done.text, None), done.finish
    response = turn.response(done.ids)
    if isinstance(response, dict) and "parameters" in response:
        return protocol.chat_message("", protocol.tool_call(call, response, index)), "tool_calls"
    content = response if isinstance(response, str) else response.get("content", "")
    return protocol.chat_message(content, None), done.finish


async def _chat_chunks(service: Service, call, turn, streams):
    """Each choice's chunks: its text as it comes, or, for a tool call, nothing until the answer ends, then the call
    as OpenAI streams one (its id and name, then its arguments); a choice's last chunk carries its finish reason."""
    served, sent, tokens = service.served, [""] * len(streams), 0
    may_call = turn.tool_calls and bool(call.tools)  # content stays null unless text comes, as OpenAI's calls
    for index in range(len(streams)):
        yield protocol.chat_chunk(call, served, {"role": "assistant", "content": None if may_call else ""}, index=index)
    async for index, event in _merged(streams):
        if isinstance(event, Delta):
            sent[index] += event.text
            logprobs = protocol.chat_logprobs(_scored(service, call, event.scored))
            yield protocol.chat_chunk(call, served, {"content": event.text}, index=index, logprobs=logprobs)
            continue
        tokens += event.tokens
        message, finish = _chat_answer(call, turn, event, index)
        if "tool_calls" in message:
            for delta in protocol.tool_call_deltas(message["tool_calls"][0]):
                yield protocol.chat_chunk(call, served, {"tool_calls": [delta]}, index=index)
        elif message["content"].startswith(sent[index]) and (message["content"] != sent[index] or not sent[index]):
            yield protocol.chat_chunk(call, served, {"content": message["content"][len(sent[index]):]}, index=index)
        rest = protocol.chat_logprobs(_scored(service, call, event.scored))
        yield protocol.chat_chunk(call, served, {}, finish, index=index, logprobs=rest)
    if call.include_usage:
        yield protocol.chat_chunk(call, served, {}, use=protocol.usage(len(turn.prompt), tokens))


async def _agent_chunks(service: Service, call, turn: AgentTurn, streams):
    """An agent GLM's chunks, each choice's answer read as it comes (`AgentTurn.stream`): `reasoning_content` deltas,
    then `content` deltas, each call whole as a `tool_calls` entry (its index in the answer, id, type, name and
    arguments) once its `</tool_call>` has come; no tag's text. A delta's log probabilities go with the next chunk
    sent; a choice's last chunk carries its finish reason ("tool_calls" where it called) and the rest of them."""
    served, tokens = service.served, 0
    readers = [turn.stream() for _ in streams]
    called, scored = [0] * len(streams), [[] for _ in streams]  # each choice's calls sent, (id, LogProb) not sent
    for index in range(len(streams)):
        yield protocol.chat_chunk(call, served, {"role": "assistant", "content": None if turn.tools else ""},
                                  index=index)
    async for index, event in _merged(streams):
        scored[index] += event.scored
        reader = readers[index]
        for kind, value in reader.feed(event.text) if isinstance(event, Delta) else reader.finish():
            if kind == "call":
                value = [{"index": called[index], **protocol.read_tool_call(value.name, value.arguments)}]
                called[index] += 1
            delta = {{"reasoning": "reasoning_content", "call": "tool_calls"}.get(kind, kind): value}
            logprobs, scored[index] = protocol.chat_logprobs(_scored(service, call, scored[index])), []
            yield protocol.chat_chunk(call, served, delta, index=index, logprobs=logprobs)
        if isinstance(event, Done):
            tokens += event.tokens
            logprobs, scored[index] = protocol.chat_logprobs(_scored(service, call, scored[index])), []
            yield protocol.chat_chunk(call, served, {}, "tool_calls" if called[index] else event.finish, index=index,
                                      logprobs=logprobs)
    if call.include_usage:
        yield protocol.chat_chunk(call, served, {}, use=protocol.usage(len(turn.prompt), tokens))


async def _completion_chunks(service: Service, call, prompt_tokens: int, streams, echoed=None):
    """Each choice's chunks: with `echoed` (`_echoed`), its prompt's text and tokens first; then its answer's text
    as it comes (with its tokens' log probabilities where asked); a choice's last chunk carries its finish reason."""
    served, tokens = service.served, 0
    offsets = [0] * len(streams)  # of each choice: the length of its scored tokens' texts so far

    def logprobs(index: int, scored: list | None) -> dict | None:
        entries = protocol.completion_logprobs(scored, start=offsets[index])
        offsets[index] += sum(len(text) for text in entries["tokens"]) if entries else 0
        return entries

    for index in range(len(streams) if echoed is not None else 0):
        head, prompt_scored = echoed[index // call.n]
        yield protocol.completion(call, served, [(index, head, None, logprobs(index, prompt_scored))])
    async for index, event in _merged(streams):
        entries = logprobs(index, _scored(service, call, event.scored))  # a Done's: those of ids no delta took
        if isinstance(event, Delta):
            yield protocol.completion(call, served, [(index, event.text, None, entries)])
            continue
        tokens += event.tokens
        yield protocol.completion(call, served, [(index, "", event.finish, entries)])
    if call.include_usage:
        yield protocol.completion(call, served, [], protocol.usage(prompt_tokens, tokens))


def _sse(chunks) -> StreamingResponse:
    """Server-sent events of `chunks`, then `data: [DONE]`; an error after the start is sent as an error event."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except ApiError as err:
            yield f"data: {json.dumps(err.body(), ensure_ascii=False)}\n\n"
        except Exception as err:  # a bug: the client hears it as an error event, the log gets the traceback
            log.exception("a stream failed")
            failure = ApiError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")
            yield f"data: {json.dumps(failure.body(), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
