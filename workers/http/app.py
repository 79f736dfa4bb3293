"""The worker's HTTP app: the OpenAI API, health, readiness, metrics and drain.

The app starts before the model has loaded (so /health answers at once) and
serves requests once the role is attached with `AppState.attach`: its
`Health` (readiness, drain, load) and, if it takes client requests, its
completion `Backend`.

Drain (for scale-down): `POST /drain` makes the worker take no new work (new
client requests and /ready answer 503; a decode answers AddNewRequests with
404) while its requests in flight finish; `DELETE /drain` undoes it; `GET
/drain` reports. Each answers `{"draining": bool, "in_flight": int}`, where
in_flight = disagg_requests_running + disagg_requests_waiting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.workers.http.backend import NO_CLIENT_API, Backend, Health
from disagg.workers.http.errors import APIError, NotReady, install_error_handlers
from disagg.workers.http.fanout import ClientDisconnected
from disagg.workers.http.prepare import prepare_chat, prepare_completion
from disagg.workers.http.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, random_id
from disagg.workers.http.serving import Call, OpenAIServing
from disagg.workers.metrics import CONTENT_TYPE, RequestOutcome, WorkerMetrics

# Answer to a request whose client has gone away (nginx's convention); no one reads it.
_CLIENT_CLOSED = 499


class AppState:
    """What the routes serve from; the role arrives once the model is loaded."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.health: Health | None = None
        self.serving: OpenAIServing | None = None  # a role with a completion backend
        self.not_ready_reason = "the model is loading"
        self.draining = False  # asked before the model loaded, applied on attach
        self.insecure = False  # started with --insecure: said in /health

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

    def require_ready(self) -> Health:
        """The role, if it can take requests now; else a 503."""
        if self.health is None:
            raise NotReady(self.not_ready_reason)
        ready, reason = self.health.ready()
        if not ready:
            raise NotReady(reason)
        return self.health

    def require_serving(self) -> OpenAIServing:
        """The OpenAI serving, if it can take requests now; else a 503 (a 404 for a role without one)."""
        self.require_ready()
        if self.serving is None:
            raise APIError(NO_CLIENT_API, 404, "not_found_error")
        return self.serving


def build_app(state: AppState, client_api: bool = True) -> FastAPI:
    """The app; `client_api=False` (a decode) answers the completion routes with a 404 that says where to go."""
    app = FastAPI(title="disagg worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str | bool]:
        # `loaded`: the model is loaded and the role's servers are up (a prefill
        # is ready only once linked too, so launchers wait on this to link).
        return {"status": "ok", "loaded": state.health is not None, "insecure": state.insecure}

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        state.require_ready()
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.health is not None:
            state.metrics.set_engine_stats(state.health.stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/drain")
    async def start_drain() -> dict[str, bool | int]:
        state.set_draining(True)
        return state.drain_status()

    @app.delete("/drain")
    async def stop_drain() -> dict[str, bool | int]:
        state.set_draining(False)
        return state.drain_status()

    @app.get("/drain")
    async def drain_status() -> dict[str, bool | int]:
        return state.drain_status()

    @app.get("/v1/models")
    async def models() -> ModelList:
        model = state.require_ready().model
        return ModelList(data=[ModelCard(id=model.name, root=model.source, max_model_len=model.max_model_len)])

    if not client_api:

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def no_completions() -> Response:
            raise APIError(NO_CLIENT_API, 404, "not_found_error")

        return app

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(state, body, request)

    return app


async def _answer(state: AppState, body: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
    serving = state.require_serving()
    backend = serving.backend
    is_chat = isinstance(body, ChatCompletionRequest)
    try:
        if isinstance(body, ChatCompletionRequest):
            prepared = prepare_chat(body, backend.model, backend.tokenizer)
        else:
            prepared = prepare_completion(body, backend.model, backend.tokenizer)
    except APIError:
        state.metrics.count_request(RequestOutcome.REJECTED)
        raise
    call = Call(
        "chat" if is_chat else "completion", random_id("chatcmpl" if is_chat else "cmpl"), backend.model.name, prepared,
        body.return_token_ids, include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )  # fmt: skip
    wait_disconnect = _disconnect_waiter(request)
    if body.stream:
        return StreamingResponse(serving.stream(call, wait_disconnect), media_type="text/event-stream")
    try:
        response = await serving.respond(call, wait_disconnect)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    return JSONResponse(response.model_dump())


def _disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns once the client has disconnected.

    The body has been read by then, so the only message left to receive is
    `http.disconnect` (or the server's own end of the response).
    """

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait
