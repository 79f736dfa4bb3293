"""The prefill role: the client's completion Backend, which runs each prompt
here and has a linked decode generate the rest. It composes three parts: the
`DecodeRouter` (which decode), the `KVPusher` (PUSH mode's layer-wise KV
transfer) and the `TokenRelay` (the decode's tokens to the client).

One request (a `_Call`):
1. the router reserves blocks on the least loaded linked decode
   (AddNewRequests; 404: back off and try the others, for a bounded time);
2. the engine runs the prompt and holds its blocks after the first token;
   in PUSH mode the pusher sends each layer's KV to the decode's blocks as
   soon as the forward has written it;
3. the relay streams the first token; once every pushed byte is stored and
   checked, FirstGeneration goes to the decode (PULL: the decode reads the
   held blocks inside it);
4. the relay turns the decode's Generations into the client's stream.
A client that goes away before step 3 ends cancels the reservation; after
it, the next Generations for the request is answered ok=false.

The sampling fields DisaggRequest lacks (seed, min_p, the grammar) go along as
gRPC metadata (`convert.sampling_extras_metadata`), so seeded sampling gives the
mixed role's tokens too; an xLLM decode ignores them. A request whose extras
pass the metadata bound is served here whole (decision.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any
from dataclasses import dataclass, field

from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from disagg.workers import tracing
from disagg.workers.engine.async_engine import AsyncEngine, EngineStats
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.outputs import FinishReason, RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import EngineHealth, ModelInfo
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd import convert
from disagg.workers.pd.clients import PeerClients
from disagg.proto.vocabulary import PDPolicy
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.decision import CostModel, DecisionPolicy, Path
from disagg.workers.pd.errors import (
    DecodeFailed,
    NoDecodeAvailable,
    PeerTimeout,
    PeerUnavailable,
    RequestFailed,
    RequestRefused,
)
from disagg.workers.pd.liveness import LivenessWatch
from disagg.workers.pd.messages import FirstToken, NewRequest, TransferMode
from disagg.workers.pd.pusher import KVPusher
from disagg.workers.pd.relay import SERVED_LOCALLY, Stream, TokenRelay, fail_stream
from disagg.workers.pd.router import NO_DECODE, DecodeRouter, Route
from disagg.workers.pd.service import Handlers
from disagg.workers.transfer import Access, KVTransport, TransferSession, revoke_settled

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One request on its way through this prefill and a decode."""

    req_id: str
    prompt: list[int]
    params: SamplingParams
    stream: Stream
    arrival: float = field(default_factory=time.monotonic)
    route: Route | None = None  # its reservation on a decode
    held: bool = False  # the engine holds its prompt blocks (after the hand-off)
    started_on_decode: bool = False  # FirstGeneration succeeded
    task: asyncio.Task[None] | None = None  # the current attempt (the first, or a migration)
    migrations: int = 0
    moved_because: str = ""  # why its last decode failed it, once it moved
    moved_kind: str = ""  # the same as a disagg_request_migrations_total reason, counted once the move succeeds
    relay_span: Span | None = None  # the relay of its tokens to the client, when tracing


def _route_attributes(route: Route) -> dict[str, AttributeValue]:
    return {tracing.PEER: route.decode, tracing.KV_BLOCKS: len(route.block_ids),
            tracing.KV_CACHED_BLOCKS: route.num_cached_blocks}


def _trace_prefill(req_id: str, submitted: float, hand_off: RequestOutput) -> None:
    """The queue wait and the prompt's forward of a request the engine handed off, as spans."""
    if not tracing.is_enabled():
        return
    scheduled = hand_off.scheduled_at or submitted
    attributes: dict[str, AttributeValue] = {tracing.REQUEST_ID: req_id}
    tracing.record("queue", submitted, scheduled, attributes)
    tracing.record("prefill", scheduled, time.monotonic(), {
        **attributes, tracing.GEN_AI_INPUT_TOKENS: hand_off.num_prompt_tokens,
        "disagg.cached_tokens": hand_off.num_cached_tokens})


class PrefillRole(EngineHealth["AsyncEngine[LLMEngine]"]):
    """The prefill's half of PD: the worker's completion `Backend` and its gRPC handlers."""

    def __init__(self, engine: AsyncEngine[LLMEngine], tokenizer: Tokenizer, model: ModelInfo,
                 transport: KVTransport, clients: PeerClients, metrics: WorkerMetrics, config: PDConfig,
                 instance_name: str, transfer_address: str, mode: TransferMode,
                 policy: DecisionPolicy = DecisionPolicy()) -> None:
        super().__init__(engine, tokenizer, model)
        self._transport = transport
        self._clients = clients
        self._metrics = metrics
        self._name = instance_name
        self._transfer_address = transfer_address  # where decodes pull from (PULL)
        self._mode = mode
        self.router = DecodeRouter(clients, metrics, config, instance_name, self._on_decode_lost)
        self.relay = TokenRelay(engine, model.vocab_size)
        self.pusher = KVPusher(metrics, config.transfer_timeout_s)
        self.liveness = LivenessWatch(self.router.peers, self.router.address, clients, self.relay, config)
        self.costs = CostModel(policy, engine.block_bytes / engine.block_size)
        self._local = 0  # requests this prefill serves itself (decision.py), now
        self._config = config
        self._calls: dict[str, _Call] = {}  # by client request id
        self.relay.on_failure = self._stream_failed
        self._tasks: set[asyncio.Task[None]] = set()
        if mode is TransferMode.PUSH:
            engine.set_layer_hook(self.pusher.layer_hook)

    def handlers(self) -> Handlers:
        """A prefill unlinks decodes and takes their tokens; links are made on the decode."""
        return Handlers("prefill", unlink=self.unlink, generations=self.relay.generations)

    # --- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_link(session: TransferSession) -> None:  # a transport thread
            loop.call_soon_threadsafe(self.router.add, session)

        self._transport.on_link = on_link
        self.router.peers.start_watching()
        self.liveness.start()

    async def stop(self) -> None:
        """Unlink every decode (failing their requests) and close the channels."""
        await self.liveness.stop()
        await self.router.peers.close()
        for task in list(self._tasks):
            task.cancel()
        await self._clients.close()

    def close(self) -> None:
        """Stop the engine and the transfer listener."""
        super().close()
        self._transport.close()

    async def unlink(self, name: str) -> None:
        """Stop routing to that decode and fail its in-flight requests. Idempotent."""
        await self.router.peers.remove(name, "unlinked")

    async def _on_decode_lost(self, name: str, reason: str) -> None:
        self.relay.fail_decode(name, "lost", reason)

    # --- Health and Backend -------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Also needs a linked decode; a stopped engine is the first reason given."""
        if self._engine.is_running and not self.router.has_live():
            return False, NO_DECODE
        return super().ready()

    def stats(self) -> EngineStats:
        """The engine's blocks; running counts every request this prefill owns,
        also those decoding on a decode (a drain waits for all of them)."""
        s = super().stats()
        return dataclasses.replace(s, requests_running=max(s.requests_running, len(self.relay) - s.requests_waiting))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Raises ValueError for a request the engine can never run, a
        `RequestFailed` when the PD flow cannot complete it."""
        prompt = list(prompt_token_ids)
        call = _Call(request_id, prompt, params, self.relay.open(request_id, prompt, params))
        self._calls[request_id] = call
        self._attempt(call, self._run(call))
        try:
            async for item in call.stream.outputs():
                yield item
        finally:
            self._calls.pop(request_id, None)
            self.relay.close(request_id)
            tracing.end(call.relay_span, {tracing.GEN_AI_OUTPUT_TOKENS: call.stream.request.num_output_tokens})
            if not call.started_on_decode and call.task is not None:
                call.task.cancel()  # its cleanup frees what the request holds, here and on the decode
            if call.route is not None:
                self.router.done(call.route.decode)

    def _attempt(self, call: _Call, work: Coroutine[Any, Any, None]) -> None:
        call.task = asyncio.create_task(work, name=f"prefill-{call.req_id}")
        self._tasks.add(call.task)
        call.task.add_done_callback(self._tasks.discard)
        call.task.add_done_callback(lambda task: self._ended(call, task))

    def _ended(self, call: _Call, task: asyncio.Task[None]) -> None:
        """An attempt that raised still ends its stream: `_run` turns each failure into the
        stream's error, so this is for what went wrong around it (never a hang)."""
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("request %s: its attempt failed", call.req_id, exc_info=error)
        if not call.stream.closed:
            call.stream.put(DecodeFailed(f"request {call.req_id} failed: {error}"))

    # --- migration ---------------------------------------------------------------

    def _stream_failed(self, stream: Stream, kind: str, message: str) -> None:
        """A stream's decode failed it: continue it on another decode (or here, when none is
        left), or fail it (the relay's hook).

        The continuation is the prompt plus every token the client has, with the rest of the
        token budget; a seeded generator skips the draws already made, so greedy and seeded
        streams go on exactly as if nothing had happened (docs/pd-wire.md). A decode lost
        before it took the request (this prefill still computing or handing off) is the same
        move, once the attempt under way has cleaned up."""
        call = self._calls.get(stream.client_id)
        if call is None:
            fail_stream(stream, kind, message)
            return
        self._begin_move(call, stream, kind, message, None if call.started_on_decode else call.task)

    def _begin_move(self, call: _Call, stream: Stream, kind: str, message: str,
                    under_way: asyncio.Task[None] | None) -> None:
        """Move the stream (or fail it, past --max-migrations), after cancelling the attempt
        `under_way`, which has not handed the request off yet."""
        left = stream.request.sampling_params.max_tokens - stream.request.num_output_tokens
        if call.migrations >= self._config.max_migrations or left <= 0:
            fail_stream(stream, kind, f"{message}; not moved to another decode "
                                      f"(moved {call.migrations} of at most {self._config.max_migrations} times)")
            return
        log.warning("request %s: %s; moving it to another decode after %d tokens", stream.client_id, message,
                    stream.request.num_output_tokens)
        call.migrations += 1
        call.moved_because, call.moved_kind = message, kind
        # At once, so that nothing the failed decode still sends reaches the client.
        self.relay.rebind(stream, f"{stream.client_id}~{call.migrations}")
        if under_way is not None:
            under_way.cancel()  # its cleanup frees what it holds, here and on the decode
        self._attempt(call, self._move(call, stream, under_way))

    async def _move(self, call: _Call, stream: Stream, under_way: asyncio.Task[None] | None) -> None:
        """Continue a failed stream as a new attempt, after the one under way (if any) has
        cleaned up with its own request id, reservation and held blocks."""
        if under_way is not None:
            await asyncio.wait([under_way])  # bounded: its cleanup's calls all have deadlines
        if call.route is not None:
            self.router.done(call.route.decode)
        original = stream.request.sampling_params
        sent = stream.request.num_output_tokens
        call.req_id = stream.wire_id
        call.prompt = list(stream.request.token_ids)  # the prompt, then every token the client has
        # The client has the prompt's logprobs: the continuation's prefill need not compute them again.
        call.params = dataclasses.replace(call.params, max_tokens=original.max_tokens - sent,
                                          min_tokens=max(original.min_tokens - sent, 0),
                                          draws_made=original.draws_made + sent, prompt_logprobs=None)
        call.route, call.held, call.started_on_decode = None, False, False
        await self._run(call, migrated=True)

    async def abort(self, request_id: str) -> None:
        """End a live request's stream with an "abort" output; its generator's exit cleans up."""
        self.relay.abort(request_id)

    # --- one request ---------------------------------------------------------------

    async def _run(self, call: _Call, migrated: bool = False) -> None:
        """One attempt at the request: the first, or a migration's (always handed off: the
        relay follows it token by token, so the client's text goes on where it stopped)."""
        error: Exception | None = None
        try:
            if not migrated:
                path, reason = await self._choose(call)
                self._metrics.count_pd_decision(path.value, reason)
                if path is Path.LOCAL:
                    await self._serve_locally(call)
                    return
            request = NewRequest(call.req_id, call.prompt, dataclasses.replace(call.params, stop=()), self._name)
            began = time.monotonic()
            with tracing.span("route", {tracing.REQUEST_ID: call.req_id}):  # AddNewRequests calls are its children
                try:
                    call.route = await self.router.reserve(request, call.stream.request.num_blocks)
                except NoDecodeAvailable:
                    if not migrated:
                        raise
                    await self._continue_here(call)
                    return
                if tracing.is_enabled():
                    tracing.annotate(_route_attributes(call.route))
            reserve_s = time.monotonic() - began
            call.stream.decode = call.route.decode
            first = await self._prefill(call, call.route)
            began = time.monotonic()
            await self._clients.first_generation(call.route.address, first)
            self.costs.round_trip_s.observe(reserve_s + time.monotonic() - began)
            call.started_on_decode = True
            if migrated:
                self._metrics.migrations.labels(reason=call.moved_kind).inc()
            skipped = call.route.num_cached_blocks
            self._metrics.kv_transfer_skipped_blocks.inc(skipped)
            if self._mode is TransferMode.PULL:
                nbytes = (len(call.route.block_ids) - skipped) * self._engine.block_bytes
                self._metrics.observe_kv_transfer("sent", call.route.decode, nbytes)  # the decode times it
        except asyncio.CancelledError:
            await asyncio.shield(self._cleanup(call))
            raise
        except Exception as exc:  # any failure ends this request with an error, never a hang
            log.warning("request %s failed: %s", call.req_id, exc)
            error = exc
            await asyncio.shield(self._cleanup(call))  # a client gone meanwhile must not cut it short
        finally:
            await asyncio.shield(self._release(call))
        if isinstance(error, (DecodeFailed, PeerUnavailable, PeerTimeout)) and call.route is not None \
                and not call.stream.closed:  # the decode failed the hand-off: as if it went away (done cleaning)
            self._begin_move(call, call.stream, "lost", f"the decode instance {call.route.decode} failed the "
                                                         f"hand-off: {error}", None)
        elif error is not None and migrated:
            call.stream.put(DecodeFailed(f"{call.moved_because}; no other decode could continue it: {error}"))
        elif error is not None:
            call.stream.put(error if isinstance(error, RequestFailed)
                            else DecodeFailed(f"request {call.req_id} failed: {error}"))

    async def _choose(self, call: _Call) -> tuple[Path, str]:
        """Hand off or serve here (decision.py); the prompt's cached part is looked up only when it matters."""
        fits = convert.extras_fit(call.req_id, call.params)
        if self.costs.policy.mode is PDPolicy.ALWAYS or not fits:
            return self.costs.choose(0, self._local, True, fits)
        request = call.stream.request
        cached = await self._engine.call(lambda e: e.num_cached_prompt_tokens(request))
        return self.costs.choose(len(call.prompt) - cached, self._local, self.router.has_room())

    async def _serve_locally(self, call: _Call) -> None:
        """The whole request on this prefill's engine, as a mixed worker serves it."""
        self._local += 1
        try:
            async for out in self._engine.generate(call.req_id, call.prompt, call.params):
                call.stream.put(dataclasses.replace(out, served_by=SERVED_LOCALLY))
        finally:
            self._local -= 1

    async def _continue_here(self, call: _Call) -> None:
        """The rest of a moved stream on this prefill's own engine, when no decode can take it.
        Its tokens go through the relay as a decode's do, so stop strings and usage go on exactly."""
        self._metrics.migrations.labels(reason=call.moved_kind).inc()
        self._local += 1
        try:
            async for out in self._engine.generate(call.req_id, call.prompt, dataclasses.replace(call.params, stop=())):
                if out.finish_reason is FinishReason.ABORT:
                    raise DecodeFailed(f"this prefill's engine aborted request {call.req_id}")
                if not self.relay.forward_own(call.stream, out):
                    return  # the client's request ended here (a stop string): the engine's is aborted
        finally:
            self._local -= 1

    async def _prefill(self, call: _Call, route: Route) -> FirstToken:
        """Run the prompt here (pushing its KV in PUSH mode) and stream the first token."""
        push = self._mode is TransferMode.PUSH
        if push:
            session = self.router.session(route.decode)
            if session is None:
                raise DecodeFailed(f"the data path to decode {route.decode} is closed")
            self.pusher.add(call.req_id, route.decode, session, route.block_ids, route.num_cached_blocks)
        hand_off: RequestOutput | None = None
        began = time.monotonic()
        async for out in self._engine.generate(call.req_id, call.prompt, call.params, hold_after_first_token=True):
            hand_off = out
        assert hand_off is not None and hand_off.finished, "an engine stream ends with a finished output"
        if not hand_off.handed_off:
            raise RequestRefused(f"the prefill engine ended request {call.req_id} ({hand_off.finish_reason})")
        call.held = True
        _trace_prefill(call.req_id, began, hand_off)
        self._metrics.observe_prefix_lookup(len(call.prompt), hand_off.num_cached_tokens)
        self.costs.observe_prefill(len(call.prompt) - hand_off.num_cached_tokens, time.monotonic() - began)
        self.relay.first_token(call.stream, hand_off)
        call.relay_span = call.relay_span or tracing.start("relay", {tracing.REQUEST_ID: call.stream.client_id})
        ttft = time.monotonic() - call.arrival
        token_id = hand_off.new_token_ids[0]
        logprob = hand_off.new_logprobs[0] if hand_off.new_logprobs else None
        # NOTE: nothing here waits on the engine (its calls run between steps, and the
        # next step may be a long prefill): the held blocks are released after the
        # hand-off (_run), and the hand-off output names them.
        if push:
            nbytes, seconds = await self.pusher.wait(call.req_id)
            self.costs.observe_transfer(nbytes, seconds)
            return FirstToken(call.req_id, token_id, logprob, TransferMode.PUSH, ttft)
        blocks = hand_off.held_block_ids
        self._transport.access.allow(route.decode, call.req_id, blocks, Access.READ)  # its pull, until released
        return FirstToken(call.req_id, token_id, logprob, TransferMode.PULL, ttft, self._transfer_address, blocks)

    async def _release(self, call: _Call) -> None:
        """Free the prompt blocks the engine held after the hand-off (of this attempt: what it
        reads of `call` is read first, as a move may start the next attempt meanwhile)."""
        req_id, held = call.req_id, call.held
        call.held = False
        await revoke_settled(self._transport.access, req_id, self._config.transfer_timeout_s)
        if held:
            await self._engine.release(req_id)

    async def _cleanup(self, call: _Call) -> None:
        """After a failure or a cancel before FirstGeneration succeeded: let the
        pushes in flight land, then free the reservation on the decode (of this attempt, as `_release`)."""
        req_id, route, reserved = call.req_id, call.route, not call.started_on_decode
        drain = self.pusher.stop(req_id)
        self._engine.abort(req_id)
        # A barrier: engine calls run between steps, so no push of this request starts after it.
        await self._engine.call(lambda e: None)
        if drain is not None:
            await asyncio.to_thread(drain)
        if route is not None and reserved:
            await self.router.cancel(route, req_id)
