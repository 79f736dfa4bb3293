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

The sampling fields DisaggRequest lacks (seed, min_p) go along as gRPC
metadata (`convert.sampling_extras_metadata`), so seeded sampling gives the
mixed role's tokens too; an xLLM decode ignores them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from disagg.proto.vocabulary import InstanceInfo
from disagg.workers.engine.async_engine import AsyncEngine, EngineStats
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import EngineHealth, ModelInfo
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.proto.vocabulary import PDPolicy
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.decision import CostModel, DecisionPolicy, Path
from disagg.workers.pd.errors import DecodeFailed, RequestFailed, RequestRefused
from disagg.workers.pd.liveness import LivenessWatch
from disagg.workers.pd.messages import FirstToken, NewRequest, TransferMode
from disagg.workers.pd.pusher import KVPusher
from disagg.workers.pd.relay import SERVED_LOCALLY, Stream, TokenRelay
from disagg.workers.pd.router import NO_DECODE, DecodeRouter, Route
from disagg.workers.pd.service import Handlers
from disagg.workers.transfer import Access, KVTransport, TransferSession

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
        self.relay = TokenRelay(engine)
        self.pusher = KVPusher(metrics, config.transfer_timeout_s)
        self.liveness = LivenessWatch(self.router.peers, self.router.address, clients, self.relay, config)
        self.costs = CostModel(policy, engine.block_bytes / engine.block_size)
        self._local = 0  # requests this prefill serves itself (decision.py), now
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

    async def unlink(self, info: InstanceInfo) -> None:
        """Stop routing to that decode and fail its in-flight requests. Idempotent."""
        await self.router.peers.remove(info.name, "unlinked")

    async def _on_decode_lost(self, name: str, reason: str) -> None:
        self.relay.fail_decode(name, reason)

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
        task = asyncio.create_task(self._run(call), name=f"prefill-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            async for item in call.stream.outputs():
                yield item
        finally:
            self.relay.close(request_id)
            if not call.started_on_decode:
                task.cancel()  # its cleanup frees what the request holds, here and on the decode
            if call.route is not None:
                self.router.done(call.route.decode)

    async def abort(self, request_id: str) -> None:
        """End a live request's stream with an "abort" output; its generator's exit cleans up."""
        self.relay.abort(request_id)

    # --- one request ---------------------------------------------------------------

    async def _run(self, call: _Call) -> None:
        error: Exception | None = None
        try:
            path, reason = await self._choose(call)
            self._metrics.pd_decisions.labels(decision=path.value, reason=reason).inc()
            if path is Path.LOCAL:
                await self._serve_locally(call)
                return
            request = NewRequest(call.req_id, call.prompt, dataclasses.replace(call.params, stop=()), self._name)
            began = time.monotonic()
            call.route = await self.router.reserve(request, call.stream.request.num_blocks)
            reserve_s = time.monotonic() - began
            call.stream.decode = call.route.decode
            first = await self._prefill(call, call.route)
            began = time.monotonic()
            await self._clients.first_generation(call.route.address, first)
            self.costs.round_trip_s.observe(reserve_s + time.monotonic() - began)
            call.started_on_decode = True
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
            await self._cleanup(call)
        finally:
            await asyncio.shield(self._release(call))
        if error is not None:
            call.stream.put(error if isinstance(error, RequestFailed)
                            else DecodeFailed(f"request {call.req_id} failed: {error}"))

    async def _choose(self, call: _Call) -> tuple[Path, str]:
        """Hand off or serve here (decision.py); the prompt's cached part is looked up only when it matters."""
        if self.costs.policy.mode is PDPolicy.ALWAYS:
            return self.costs.choose(0, self._local, True)
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
        self._metrics.observe_prefix_lookup(len(call.prompt), hand_off.num_cached_tokens)
        self.costs.observe_prefill(len(call.prompt) - hand_off.num_cached_tokens, time.monotonic() - began)
        self.relay.first_token(call.stream, hand_off)
        ttft = time.monotonic() - call.arrival
        token_id = hand_off.new_token_ids[0]
        logprob = hand_off.new_logprobs[0] if hand_off.new_logprobs else None
        if push:
            nbytes, seconds = await self.pusher.wait(call.req_id)
            self.costs.observe_transfer(nbytes, seconds)
            await self._release(call)
            return FirstToken(call.req_id, token_id, logprob, TransferMode.PUSH, ttft)
        blocks = await self._engine.block_ids(call.req_id)
        self._transport.access.allow(route.decode, call.req_id, blocks, Access.READ)  # its pull, until released
        return FirstToken(call.req_id, token_id, logprob, TransferMode.PULL, ttft, self._transfer_address,
                          tuple(blocks))

    async def _release(self, call: _Call) -> None:
        """Free the prompt blocks the engine held after the hand-off."""
        self._transport.access.revoke(call.req_id)
        if call.held:
            call.held = False
            await self._engine.release(call.req_id)

    async def _cleanup(self, call: _Call) -> None:
        """After a failure or a cancel before FirstGeneration succeeded: let the
        pushes in flight land, then free the reservation on the decode."""
        drain = self.pusher.stop(call.req_id)
        self._engine.abort(call.req_id)
        # A barrier: engine calls run between steps, so no push of this request starts after it.
        await self._engine.call(lambda e: None)
        if drain is not None:
            await asyncio.to_thread(drain)
        if call.route is not None and not call.started_on_decode:
            await self.router.cancel(call.route, call.req_id)
