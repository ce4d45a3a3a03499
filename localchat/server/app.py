"""The routes: OpenAI's under /v1, Ollama's under /api, over one Worker.

A chat request is read (at most --max-file-mb), checked, queued (503 with Retry-After when the queue is full), and
answered once its first token (or its error) is known, so a refused prompt gets its 4xx before any body is sent.
A client that goes away, while waiting or while reading the stream, cancels its job.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from localchat import __version__
from localchat.engine.events import Token
from localchat.engine.sampling import GenerationSettings
from localchat.server import ollama, openai
from localchat.server.conversations import Answered, Named, log
from localchat.server.turns import BadRequest, Turn, refusal
from localchat.server.worker import END, Busy, Job, Worker

RETRY_AFTER = 5  # seconds a client told the queue is full waits before trying again
HEADER = "X-Localchat-Conversation"  # the name of the conversation that answered
CACHED = "X-Localchat-Cached-Tokens"  # prompt tokens taken from the conversation's cache, not read again


@dataclass
class State:
    worker: Worker
    model: str
    facts: ollama.Facts
    defaults: GenerationSettings
    max_body: int
    api_key: str | None
    started: int


class Gone(Exception):
    """The client disconnected."""


class Answer:
    """A queued job's items as the request reads them (Token, then Answered or CANCELLED); the client's disconnect
    cancels the job."""

    def __init__(self, job: Job, request: Request):
        self.job = job
        self.name: str | None = None
        self.cached: int | None = None
        self.watch = asyncio.ensure_future(_disconnect(request))

    async def next(self):
        """The next item: a Token, an Answered, CANCELLED or END; raises the BadRequest that refuses the job, or
        Gone."""
        while True:
            get = asyncio.ensure_future(self.job.items.get())
            done, _ = await asyncio.wait({get, self.watch}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                self.close()
                raise Gone
            item = get.result()
            if isinstance(item, Named):
                self.name, self.cached = item.name, item.cached
                continue
            if isinstance(item, BadRequest):
                raise item
            return item

    async def items(self, first) -> AsyncIterator:
        """`first`, then every item up to END; the job is let go of at the end, however the reader stops."""
        try:
            item = first
            while item is not END:
                yield item
                item = await self.next()
        finally:
            self.close()

    def close(self) -> None:
        self.job.cancel.set()  # a job that has ended ignores it
        self.watch.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request, limit: int) -> dict:
    too_big = BadRequest(f"the request body is larger than {limit / 2**20:g} MB (--max-file-mb)", None,
                         "request_too_large", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    data = bytearray()
    try:
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise too_big
    except ClientDisconnect:
        log(f"a client went away while sending its request to {request.url.path}")
        raise Gone from None
    try:
        body = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({str(exc)[:120]})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_json")
    return body


def _guard(request: Request) -> State:
    state: State = request.app.state.server
    if state.api_key is not None:
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), state.api_key.encode()):
            raise BadRequest("a valid API key is required: send it as `Authorization: Bearer KEY`", None,
                             "invalid_api_key", 401)
    return state


async def _start(request: Request, parse) -> tuple[State, Turn, Answer, object]:
    """Read, check and queue a chat request; wait for its first token or its end."""
    state = _guard(request)
    turn = parse(await _body(request, state.max_body), state.defaults)
    job = Job(turn, asyncio.get_running_loop())
    try:
        state.worker.submit(job)
    except Busy:
        raise BadRequest("the server is busy: its queue of requests is full; try again shortly", None,
                         "queue_full", 503) from None
    answer = Answer(job, request)
    try:
        first = await answer.next()
    except BaseException:
        answer.close()
        raise
    return state, turn, answer, first


def _headers(answer: Answer, result: Answered | None = None) -> dict:
    """The conversation's name and the prompt tokens from its cache (the answer's own count once it is done)."""
    cached = result.cached if result is not None else answer.cached
    return {**({HEADER: answer.name} if answer.name else {}), **({CACHED: str(cached)} if cached is not None else {})}


async def _collect(answer: Answer, first) -> tuple[str, Answered | None]:
    """The whole answer's text, and its Answered (None when it was cancelled)."""
    pieces, result = [], None
    async for item in answer.items(first):
        if isinstance(item, Token):
            pieces.append(item.text)
        elif isinstance(item, Answered):
            result = item
    return "".join(pieces), result


def _usage(result: Answered) -> dict:
    done = result.done
    return openai.usage(result.cached + done.prompt_tokens, result.cached, done.new_tokens)


async def chat_completions(request: Request) -> Response:
    state, turn, answer, first = await _start(request, openai.parse)
    if not turn.stream:
        _, result = await _collect(answer, first)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(openai.completion(openai.new_id(), state.model, result.done, _usage(result)),
                            headers=_headers(answer, result))
    return StreamingResponse(_sse(state, turn, answer, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **_headers(answer)})


async def _sse(state: State, turn: Turn, answer: Answer, first) -> AsyncIterator[str]:
    cid, model, usage = openai.new_id(), state.model, turn.usage_in_stream

    def data(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        yield data(openai.chunk(cid, model, {"role": "assistant", "content": ""}, with_usage=usage))
        async for item in answer.items(first):
            if isinstance(item, Token) and item.text:
                yield data(openai.chunk(cid, model, {"content": item.text}, with_usage=usage))
            elif isinstance(item, Answered):
                yield data(openai.chunk(cid, model, {}, openai.FINISH.get(item.done.stop_reason, "stop"),
                                        with_usage=usage))
                if usage:
                    yield data(openai.usage_chunk(cid, model, _usage(item)))
    except BadRequest as exc:
        yield data(openai.error(exc.message, "invalid_request_error", exc.param, exc.code))
    except Gone:  # nobody reads the rest
        return
    yield "data: [DONE]\n\n"


async def ollama_chat(request: Request) -> Response:
    return await _ollama(request, ollama.parse, generate=False)


async def ollama_generate(request: Request) -> Response:
    return await _ollama(request, ollama.parse_generate, generate=True)


async def _ollama(request: Request, parse, generate: bool) -> Response:
    started = time.perf_counter()
    state, turn, answer, first = await _start(request, parse)
    if not turn.stream:
        text, result = await _collect(answer, first)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(ollama.final(state.model, result.done, text, started, generate), headers=_headers(answer, result))
    return StreamingResponse(_ndjson(state, answer, first, started, generate), media_type="application/x-ndjson",
                             headers=_headers(answer))


async def _ndjson(state: State, answer: Answer, first, started: float, generate: bool) -> AsyncIterator[str]:
    try:
        async for item in answer.items(first):
            if isinstance(item, Token) and item.text:
                yield json.dumps(ollama.line(state.model, item.text, generate)) + "\n"
            elif isinstance(item, Answered):
                yield json.dumps(ollama.final(state.model, item.done, "", started, generate)) + "\n"
    except BadRequest as exc:
        yield json.dumps({"error": exc.message}) + "\n"
    except Gone:
        return


async def models(request: Request) -> Response:
    state = _guard(request)
    return JSONResponse(openai.models(state.model, state.started))


async def tags(request: Request) -> Response:
    return JSONResponse(_guard(request).facts.tags())


async def show(request: Request) -> Response:
    state = _guard(request)
    body = await _body(request, state.max_body)
    name = body.get("model", body.get("name"))
    if not isinstance(name, str):
        raise BadRequest("`model` must be a string naming the model", "model", "invalid_type")
    return JSONResponse(state.facts.show())


async def version(request: Request) -> Response:
    _guard(request)
    return JSONResponse({"version": __version__})


async def root(request: Request) -> Response:
    return PlainTextResponse("localchat is running")


async def _refused(request: Request, exc: BadRequest) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER)} if exc.status == 503 else None
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": exc.message}, exc.status, headers=headers)
    kind = {401: "authentication_error", 500: "server_error", 503: "server_busy"}.get(exc.status, "invalid_request_error")
    return JSONResponse(openai.error(exc.message, kind, exc.param, exc.code), exc.status, headers=headers)


async def _gone(request: Request, exc: Gone) -> Response:
    return Response(status_code=499)  # nobody reads it


def _guarded(route):
    """`route`, with whatever it raises answered here in one sentence and logged in one line: an exception that
    reached Starlette's last handler would print its traceback into the server's log."""

    @functools.wraps(route)
    async def guarded(request: Request) -> Response:
        try:
            return await route(request)
        except (BadRequest, Gone):
            raise  # answered by their handlers
        except Exception as exc:  # noqa: BLE001
            refused = refusal(exc)
            log(f"{request.url.path} failed: {refused.message}")
            return await _refused(request, refused)

    return guarded


def build_app(state: State) -> Starlette:
    routes = [
        Route("/", root), Route("/v1/models", models), Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/api/tags", tags), Route("/api/show", show, methods=["POST"]), Route("/api/version", version),
        Route("/api/chat", ollama_chat, methods=["POST"]), Route("/api/generate", ollama_generate, methods=["POST"]),
    ]
    routes = [Route(r.path, _guarded(r.endpoint), methods=r.methods) for r in routes]
    app = Starlette(routes=routes, exception_handlers={BadRequest: _refused, Gone: _gone})
    app.state.server = state
    return app
