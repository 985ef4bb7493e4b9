"""The OpenAI-compatible HTTP API: its routes, each request run through the coordinator's own
request path (CoordinatorServicer.admitted: check, admission, resolve, Generator.run).

    POST /v1/chat/completions    chat.completion, or its chunks as server-sent events
    POST /v1/completions         text_completion, or its chunks
    GET  /v1/models              the target model
    GET  /health                 200 once the coordinator serves, 503 before
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import grpc
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from coordinator.http.errors import ApiError, api_error, bad_request
from coordinator.http.openai_request import CHAT, COMPLETION, ApiRequest, parse_body
from coordinator.http.openai_response import Completion
from coordinator.http.sse import open_stream, send_done, send_event
from coordinator.output import Finish
from coordinator.request_log import RequestRecord
from coordinator.round_trace import Caller, llm_request
from coordinator.servicer import CoordinatorServicer, caller_request_id
from specd.observability.telemetry import context_from_metadata, trace_id_hex
from specd.serving.drain import DrainGate

# Bodies past this size are parsed on a thread: a large prompt's JSON does not hold the event loop.
_LARGE_BODY_BYTES = 64 * 1024


def http_caller(request: web.Request) -> Caller:
    """An HTTP request as the llm_request span sees it: its `traceparent` header joins the caller's trace."""

    def failure_status(exc: BaseException) -> tuple[dict, str | None]:
        return {}, "the client went away"  # the errors the API maps are told on the span by _record_error

    return Caller(
        parent=context_from_metadata(request.headers.items()),
        attributes={"http.request.method": request.method, "url.path": request.path, "specd.api": "openai"},
        failure_status=failure_status,
    )


@dataclasses.dataclass
class _Exchange:
    """One request's answer so far: its event stream once the 200 has been sent (errors then travel as events)."""

    stream: web.StreamResponse | None = None


def _record_error(span: trace.Span, error: ApiError) -> None:
    if span.is_recording():
        span.set_attribute("http.response.status_code", error.http_status)
        span.set_status(Status(StatusCode.ERROR, error.message))


async def _prepended(first, events):
    """`first` (if not None), then the rest of `events`."""
    if first is not None:
        yield first
    async for event in events:
        yield event


class OpenAiApi:
    """The routes, over one coordinator's servicer."""

    def __init__(self, servicer: CoordinatorServicer, max_body_bytes: int, gate: DrainGate | None = None):
        self.servicer = servicer
        self.max_body_bytes = max_body_bytes
        self.gate = gate  # the coordinator's drain: its running requests include these; once closed, 503
        self.started = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completion),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, CHAT)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, COMPLETION)

    async def health(self, request: web.Request) -> web.Response:
        if self.gate is not None and self.gate.closed:
            return web.json_response({"status": "stopping"}, status=503)
        if self.servicer.facts is None:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            facts = self.servicer.ready_facts()
        except Exception as exc:  # noqa: BLE001 - told as OpenAI's error JSON
            return api_error(exc).response()
        model = {"id": facts.model, "object": "model", "created": self.started, "owned_by": "specd",
                 "max_model_len": facts.context_length}
        return web.json_response({"object": "list", "data": [model]})

    async def generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One request under its llm_request span; a failure is told in OpenAI's error shape (as an
        event once a stream has begun). A client that goes away cancels this task, which ends the
        request and its worker sessions as a cancelled gRPC call does."""
        if self.gate is not None and self.gate.closed:  # refused before the service, as the gRPC port's gate refuses
            return ApiError(grpc.StatusCode.UNAVAILABLE, self.gate.refusal).response()
        with self._counted(), llm_request(self.servicer.tracer, http_caller(request)) as span:
            exchange = _Exchange()
            record = RequestRecord(request_id=caller_request_id(request.headers.get("X-Request-Id", "")), trace_id=trace_id_hex(span))
            try:
                return await self._answer(request, kind, record, exchange)
            except (ConnectionError, asyncio.CancelledError) as exc:  # the client went away
                record.failed(self.servicer.metrics, grpc.StatusCode.CANCELLED.name)
                span.set_status(Status(StatusCode.ERROR, "the client went away"))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return exchange.stream or web.Response(status=499)
            except Exception as exc:  # noqa: BLE001 - mapped to an HTTP status at the API's edge
                error = api_error(exc)
                record.failed(self.servicer.metrics, error.code.name)
                _record_error(span, error)
                if exchange.stream is None:
                    return error.response()
                with contextlib.suppress(ConnectionError):
                    await exchange.stream.write(error.sse_event())
                    await send_done(exchange.stream)
                return exchange.stream

    @contextlib.contextmanager
    def _counted(self):
        """The request among the coordinator's running calls, which a stop lets finish."""
        if self.gate is None:
            yield
            return
        self.gate.started()
        try:
            yield
        finally:
            self.gate.ended()

    async def _answer(self, request: web.Request, kind: str, record: RequestRecord, exchange: "_Exchange") -> web.StreamResponse:
        api_request = parse_body(await self._body(request), kind)
        model = self._served_model(api_request.model)
        message = api_request.generate
        message.request_id = request.headers.get("X-Request-Id", "")
        async with self.servicer.admitted(message, None, record) as (resolved, events):
            completion = Completion(kind, model, resolved.request_id, record.trace_id, api_request.include_usage)
            if api_request.stream:
                # The 200 goes once the first round has answered: a failure before it (a target
                # that is down) keeps its own HTTP status instead of arriving as an event.
                first_event = await anext(events, None)
                exchange.stream = await open_stream(request)
                await self._stream(exchange.stream, completion, _prepended(first_event, events), api_request)
                return exchange.stream
            async for event in events:
                if isinstance(event, Finish):
                    texts = await self._token_texts(event.token_ids, message.return_logprobs)
                    return web.json_response(completion.response(event, texts))
        raise RuntimeError("the request ended without its Finish")

    async def _stream(self, stream: web.StreamResponse, completion: Completion, events, api_request: ApiRequest) -> None:
        first = completion.first_chunk()
        if first is not None:
            await send_event(stream, first)
        async for event in events:
            if isinstance(event, Finish):
                await send_event(stream, completion.last_chunk(event))
                if api_request.include_usage:
                    await send_event(stream, completion.usage_chunk(event))
            elif event.text or event.token_ids:
                texts = await self._token_texts(event.token_ids, api_request.generate.return_logprobs)
                await send_event(stream, completion.chunk(event, texts))
        await send_done(stream)

    async def _body(self, request: web.Request):
        """The JSON body (parsed on a thread when large), or a 400 that says what is wrong with it."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise bad_request(f"the request body is {request.content_length} bytes; at most {self.max_body_bytes}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise bad_request(f"the request body is larger than {self.max_body_bytes} bytes") from None
        try:
            if len(raw) > _LARGE_BODY_BYTES:
                return await asyncio.to_thread(json.loads, raw)
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise bad_request(f"the request body is not JSON: {exc}") from None

    def _served_model(self, asked: str | None) -> str:
        """The target model's id, which `model` must name (or leave out); 404 for another."""
        facts = self.servicer.ready_facts()
        if asked and asked != facts.model:
            raise ApiError(
                grpc.StatusCode.NOT_FOUND, f"model {asked!r} is not served here; GET /v1/models lists {facts.model!r}", "model"
            )
        return facts.model

    async def _token_texts(self, token_ids, wanted: bool) -> list[str] | None:
        """Each token's own text, for logprobs (decoded on a thread: it is per token)."""
        if not wanted:
            return None
        tokenizer = self.servicer.ready_facts().tokenizer

        def texts() -> list[str]:
            return [tokenizer.decode([i], skip_special_tokens=False) for i in token_ids]

        # On the coordinator's text threads, where the rounds' own text is made.
        return await asyncio.get_running_loop().run_in_executor(self.servicer.generator.text_pool, texts)
