"""The worker's HTTP apps: the client app (the OpenAI API, health, readiness,
metrics) on the client port, and the admin app (drain, and the role's link
routes) on the admin port, so that no client can change a worker's state.

The apps start before the model has loaded (so /health answers at once) and
serve requests once the role is attached with `AppState.attach`: its
`Health` (readiness, drain, load) and, if it takes client requests, its
completion `Backend`.

Drain (for scale-down), on the admin port: `POST /drain` makes the worker take
no new work (new client requests and /ready answer 503; a decode answers
AddNewRequests with 404) while its requests in flight finish; `DELETE /drain`
undoes it; `GET /drain` reports. Each answers `{"draining": bool, "in_flight":
int}`, where in_flight = disagg_requests_running + disagg_requests_waiting.

A completion's body (/v1/completions, /v1/chat/completions, /v1/responses) is
read with a size bound, then parsed, validated and tokenised in a thread: the
loop also serves gRPC and every stream, and a large body must not stall them.
So are the bodies of vLLM's /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from disagg.workers import tracing
from disagg.workers.config import CorsPolicy
from disagg.workers.http.backend import NO_CLIENT_API, Backend, Health, ModelInfo
from disagg.workers.http.edge import Admission, RequestCheck, bearer_check, max_in_flight, parse_body, read_body
from disagg.workers.http.errors import APIError, BadRequest, NoSuchModel, NotReady, install_error_handlers
from disagg.workers.http.fanout import ClientDisconnected
from disagg.workers.http.prepare import Prepared, prepare_chat, prepare_completion
from disagg.workers.http.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    StreamOptions, TokenizeRequest, TokenizeResponse, random_id,
)
from disagg.workers.http.responses import ResponseRun, translate
from disagg.workers.http.responses_protocol import ResponseObject, ResponsesRequest, new_id
from disagg.workers.http.serving import Call, OpenAIServing
from disagg.workers.http.tokenize import detokenize, tokenize
from disagg.workers.metrics import CONTENT_TYPE, RequestOutcome, WorkerMetrics
from disagg.workers.security.key import ClusterKey

log = logging.getLogger(__name__)

# Answer to a request whose client has gone away (nginx's convention); no one reads it.
_CLIENT_CLOSED = 499
DEFAULT_MAX_NUM_SEQS = 64  # EngineConfig's; the server passes the configured admission


class AppState:
    """What the routes serve from; the role arrives once the model is loaded."""

    def __init__(self, metrics: WorkerMetrics, admission: Admission | None = None) -> None:
        self.metrics = metrics
        self.admission = admission or Admission(max_in_flight(DEFAULT_MAX_NUM_SEQS, None))
        self.health: Health | None = None
        self.serving: OpenAIServing | None = None  # a role with a completion backend
        self.not_ready_reason = "the model is loading"
        self.draining = False  # asked before the model loaded, applied on attach
        self.insecure = False  # started with --insecure: said in /health
        self.cluster_key: ClusterKey | None = None  # its fingerprint in /health tells which keys are in use

    def attach(self, health: Health, backend: Backend | None) -> None:
        health.set_draining(self.draining)
        self.health = health
        self.serving = None if backend is None else OpenAIServing(backend, self.metrics)

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self.metrics.draining.set(int(draining))
        if self.health is not None:
            self.health.set_draining(draining)

    def drain_status(self) -> dict[str, bool | int]:
        in_flight = 0
        if self.health is not None:
            stats = self.health.stats()
            in_flight = stats.requests_running + stats.requests_waiting
        return {"draining": self.draining, "in_flight": in_flight}

    def require_loaded(self) -> Health:
        """The role, once its model is loaded (linked or not, draining or not); else a 503."""
        if self.health is None:
            raise NotReady(self.not_ready_reason)
        return self.health

    def require_ready(self) -> Health:
        """The role, if it can take requests now; else a 503."""
        health = self.require_loaded()
        ready, reason = health.ready()
        if not ready:
            raise NotReady(reason)
        return health

    def require_serving(self) -> OpenAIServing:
        """The OpenAI serving, if it can take requests now; else a 503 (a 404 for a role without one)."""
        self.require_ready()
        if self.serving is None:
            raise APIError(NO_CLIENT_API, 404, "not_found_error")
        return self.serving


def build_app(state: AppState, client_api: bool = True, api_key: str | None = None,
              cors: CorsPolicy = CorsPolicy()) -> FastAPI:
    """The client app; `client_api=False` (a decode) answers the completion routes
    with a 404 that says where to go; with `api_key`, /v1 needs it as a bearer token;
    `cors` says which browser pages may call it (a preflight needs no key)."""
    app = FastAPI(title="disagg worker", docs_url=None, redoc_url=None)
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                       allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    install_error_handlers(app)
    tracing.instrument(app, ("/v1/completions", "/v1/chat/completions", "/v1/responses"))
    auth = [Depends(bearer_check(api_key, lambda: state.metrics.count_auth_failure("api-key")))] if api_key else []

    # HEAD too: load balancers' health checks (AWS ALB, HAProxy's option httpchk) may send it.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, str | bool]:
        # `loaded`: the model is loaded and the role's servers are up (a prefill
        # is ready only once linked too, so launchers wait on this to link).
        answer: dict[str, str | bool] = {"status": "ok", "loaded": state.health is not None,
                                         "insecure": state.insecure}
        if state.cluster_key is not None:  # the operator waits on it during a key rotation
            answer["cluster_key"] = state.cluster_key.fingerprint()
        return answer

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> dict[str, str]:
        state.require_ready()
        return {"status": "ready"}

    _add_metrics_route(app, state)

    # What is served is known once the model is loaded: a client or router may ask before the
    # worker is ready (a prefill not linked yet, a draining worker), as it may ask vLLM.
    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state.require_loaded().model)])

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> ModelCard:
        info = state.require_loaded().model
        if model_id != info.name:
            raise NoSuchModel(model_id)
        return _model_card(info)

    if not client_api:

        @app.post("/v1/completions", dependencies=auth)
        @app.post("/v1/chat/completions", dependencies=auth)
        @app.post("/v1/responses", dependencies=auth)
        @app.post("/tokenize", dependencies=auth)
        @app.post("/detokenize", dependencies=auth)
        async def no_completions() -> Response:
            raise APIError(NO_CLIENT_API, 404, "not_found_error")

        return app

    @app.post("/v1/completions", dependencies=auth, openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _answer(state, CompletionRequest, request)

    @app.post("/v1/chat/completions", dependencies=auth, openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _answer(state, ChatCompletionRequest, request)

    @app.post("/v1/responses", dependencies=auth, openapi_extra=_json_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await _answer_responses(state, request)

    @app.post("/tokenize", dependencies=auth, openapi_extra=_json_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> TokenizeResponse:
        backend = state.require_serving().backend
        return await asyncio.to_thread(tokenize, await read_body(request), backend.model, backend.tokenizer)

    @app.post("/detokenize", dependencies=auth, openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> DetokenizeResponse:
        backend = state.require_serving().backend
        return await asyncio.to_thread(detokenize, await read_body(request), backend.model, backend.tokenizer)

    _document_bodies(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                           DetokenizeRequest])
    return app


def build_admin_app(state: AppState, check_change: RequestCheck | None = None) -> FastAPI:
    """The admin app: drain, metrics (what a drain waits on), and the routes a role adds.

    `check_change` runs before each route that changes state (starting or ending a drain): the
    cluster key's check (server.py); None: whoever reaches the port may. The drain's status and
    the metrics stay open to read, as the operator and Prometheus read them.
    """
    app = FastAPI(title="disagg worker admin", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    _add_metrics_route(app, state)
    change = [Depends(check_change)] if check_change else []

    @app.post("/drain", dependencies=change)
    async def start_drain() -> dict[str, bool | int]:
        state.set_draining(True)
        return state.drain_status()

    @app.delete("/drain", dependencies=change)
    async def stop_drain() -> dict[str, bool | int]:
        state.set_draining(False)
        return state.drain_status()

    @app.get("/drain")
    async def drain_status() -> dict[str, bool | int]:
        return state.drain_status()

    return app


def _model_card(model: ModelInfo) -> ModelCard:
    return ModelCard(id=model.name, root=model.source, max_model_len=model.max_model_len)


def _add_metrics_route(app: FastAPI, state: AppState) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        if state.health is not None:
            state.metrics.set_engine_stats(state.health.stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that parses `model` itself (off the loop)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the bodies the routes parse themselves to the app's OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


async def _answer(state: AppState, kind: type[CompletionRequest | ChatCompletionRequest], request: Request) -> Response:
    serving, (body, prepared) = await _parsed(state, request, lambda raw, serving: _parse_and_prepare(kind, raw, serving))
    is_chat = isinstance(body, ChatCompletionRequest)
    stream_options = body.stream_options or StreamOptions()
    call = Call(
        "chat" if is_chat else "completion", random_id("chatcmpl" if is_chat else "cmpl"), serving.backend.model.name,
        prepared, body.return_token_ids, include_usage=stream_options.include_usage,
        continuous_usage=stream_options.include_usage and stream_options.continuous_usage_stats,
        prompt_logprobs=body.prompt_logprobs,
    )
    return await _run(state, request, call, body.stream, lambda wait: serving.stream(call, wait),
                      lambda wait: serving.respond(call, wait))


async def _answer_responses(state: AppState, request: Request) -> Response:
    response_id = new_id("resp")
    serving, (body, prepared, template) = await _parsed(
        state, request, lambda raw, serving: _parse_and_prepare_responses(raw, serving, response_id))
    model = serving.backend.model
    run = ResponseRun(serving, Call("chat", response_id, model.name, prepared, return_token_ids=False,
                                    include_usage=False), template)
    return await _run(state, request, run.call, bool(body.stream), run.stream, run.respond)


_Parsed = TypeVar("_Parsed")


async def _parsed(state: AppState, request: Request, parse: Callable[[bytes, OpenAIServing], _Parsed]
                  ) -> tuple[OpenAIServing, _Parsed]:
    """The serving, and the body read with its size bound, then parsed and prepared by `parse` in
    a thread (JSON parsing and tokenisation of a large body take long)."""
    with _refusals_counted(state):
        serving = state.require_serving()
        state.admission.check_room()
        raw = await read_body(request)
        return serving, await asyncio.to_thread(parse, raw, serving)


@contextlib.contextmanager
def _refusals_counted(state: AppState) -> Iterator[None]:
    """Count each refusal of a request before it runs as rejected: not ready or draining (503),
    over the admission limit (429), too large (413), bad input (400)."""
    try:
        yield
    except (APIError, RequestValidationError):
        state.metrics.count_request(RequestOutcome.REJECTED)
        raise


async def _run(state: AppState, request: Request, call: Call, stream: bool,
               events: Callable[[Callable[[], Awaitable[None]]], AsyncGenerator[str, None]],
               whole: Callable[[Callable[[], Awaitable[None]]], Awaitable[BaseModel]]) -> Response:
    """A prepared call run under admission: streamed by `events`, or answered whole by `whole`."""
    wait_disconnect = _disconnect_waiter(request)
    # Each of n choices of each prompt is a sequence in the engine.
    n, prompts = call.prepared.params.n, len(call.prepared.prompts)
    sequences = n * prompts
    with _refusals_counted(state):
        if sequences > state.admission.limit:  # never admitted: a 429 would have the client retry forever
            raise BadRequest(f"this request is {sequences} sequences ({prompts} prompt(s), n={n}); this server holds "
                             f"at most {state.admission.limit} at once: send fewer prompts or a smaller n",
                             "n" if n > 1 else "prompt")
        state.admission.enter(sequences)
    if stream:
        return AdmittedStream(events(wait_disconnect), lambda: state.admission.leave(sequences))
    try:
        response = await whole(wait_disconnect)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    finally:
        state.admission.leave(sequences)
    return JSONResponse(response.model_dump())


def _parse_and_prepare(
    kind: type[CompletionRequest | ChatCompletionRequest], raw: bytes, serving: OpenAIServing
) -> tuple[CompletionRequest | ChatCompletionRequest, Prepared]:
    body = parse_body(kind, raw)
    backend = serving.backend
    if isinstance(body, ChatCompletionRequest):
        return body, prepare_chat(body, backend.model, backend.tokenizer)
    return body, prepare_completion(body, backend.model, backend.tokenizer)


def _parse_and_prepare_responses(raw: bytes, serving: OpenAIServing, response_id: str
                                 ) -> tuple[ResponsesRequest, Prepared, ResponseObject]:
    body = parse_body(ResponsesRequest, raw)
    backend = serving.backend
    chat, template = translate(body, response_id, backend.model.name)
    return body, prepare_chat(chat, backend.model, backend.tokenizer, {"max_tokens": "max_output_tokens"}), template


STREAM_SEND_TIMEOUT_S = 60.0  # the longest one event of a stream may wait for the client to read


class _StreamStalled(Exception):
    """The client read nothing of its stream for STREAM_SEND_TIMEOUT_S."""


class AdmittedStream(StreamingResponse):
    """A stream that gives its admission slots back when it ends, however it ends
    (a client gone before the first event included, or one that stopped reading)."""

    def __init__(self, events: AsyncGenerator[str, None], release: Callable[[], None],
                 send_timeout_s: float = STREAM_SEND_TIMEOUT_S) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._release = release
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def bounded(message: Any) -> None:
            # A client that keeps its connection but stops reading would hold this send (and the
            # slots, and its request's blocks) forever once the socket's buffers are full.
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _StreamStalled from None  # not an OSError, which starlette reads as a disconnect

        try:
            await super().__call__(scope, receive, bounded)
        except _StreamStalled:
            log.warning("a client read nothing of its stream for %.0f s: it is cut off", self._send_timeout_s)
            await self._events.aclose()  # ends the request: its blocks are freed now, not at collection
        finally:
            self._release()


def _disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns once the client has disconnected.

    The body has been read by then, so the only message left to receive is
    `http.disconnect` (or the server's own end of the response).
    """

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait
