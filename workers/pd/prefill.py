"""The prefill role: the client's HTTP backend, which runs each prompt here
and has a linked decode generate the rest.

One request (a `_Call`):
1. pick the least loaded linked decode and reserve blocks there
   (AddNewRequests; 404: back off and try the others, for a bounded time);
2. run the prompt; in PUSH mode each layer's KV goes to the decode's blocks
   as soon as the forward has written it (`_layer_pushes`, on the engine
   thread); the engine keeps the blocks after the first token (hand-off);
3. stream the first token, wait until every pushed byte is stored and checked,
   and call FirstGeneration (PULL: the decode reads the blocks inside it);
4. relay the decode's Generations to the client. Text and stop strings are
   computed here (`_TextMirror`): the decode only sends token ids.
A client that goes away before step 3 ends cancels the reservation; after
it, the next Generations for the request is answered ok=false.

The sampling fields DisaggRequest lacks (seed, min_p) go along as gRPC
metadata (`convert.sampling_extras_metadata`), so seeded sampling gives the
mixed role's tokens too; an xLLM decode ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from disagg.proto.vocabulary import InstanceInfo
from disagg.workers.engine.async_engine import EngineStats, outputs_until_finished
from disagg.workers.engine.outputs import RequestOutput, TokenLogprob
from disagg.workers.engine.request import Request, RequestStatus
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.scheduler import SchedulerOutput
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import EngineBackend, ModelInfo
from disagg.workers.http.errors import APIError
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.engine import HANDOFF, PDAsyncEngine, PDEngine
from disagg.workers.pd.errors import PDError, WrongRole
from disagg.workers.pd.links import PeerTable
from disagg.workers.pd.messages import Admission, FirstToken, NewRequest, TransferMode
from disagg.workers.transfer import Access, KVTransport, TransferError, TransferHandle, TransferSession

log = logging.getLogger(__name__)


class PDRequestError(APIError):
    """A request the PD flow could not complete (the decode side failed or went away)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message, status, "service_unavailable" if status == 503 else "server_error")


class _TextMirror:
    """The client-visible text of one request, built from its token ids.

    The engine's own request state and stop checker, fed token by token, so
    text, stop strings and finish reasons are exactly the mixed role's.
    NOTE: runs on the event loop; it reads only the engine's fixed settings.
    """

    def __init__(self, request: Request, engine: PDEngine) -> None:
        self.request = request
        self._engine = engine

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
            decode_finish: str | None = None) -> RequestOutput:
        """The delta after these tokens; `decode_finish` is the decode's finish reason, if it finished."""
        request = self.request
        checker = self._engine.stop_checker
        for i, token in enumerate(token_ids):
            if request.is_finished:
                break  # a stop string ended it here; the decode's later tokens are dropped
            request.append_token(token)
            if logprobs:
                request.pending_logprobs.append(logprobs[i])
            status = checker.check(request)
            if status is not None:
                request.status = status
        if decode_finish is not None and not request.is_finished:
            # The decode stopped for a reason the mirror cannot see (its own context limit).
            if request.detokenizer is not None:
                request.output_text += request.detokenizer.flush()
            request.status = RequestStatus(decode_finish)
        return self._engine.output(request)

    def abort(self) -> RequestOutput:
        self.request.status = RequestStatus.FINISHED_ABORTED
        return self._engine.output(self.request)


@dataclass
class _PushTarget:
    """Where a request's KV goes in PUSH mode; written on the engine thread."""

    session: TransferSession
    dst_blocks: list[int]
    handles: list[TransferHandle] = field(default_factory=list)
    error: str | None = None


@dataclass
class _Call:
    """One request on its way through this prefill and a decode."""

    req_id: str
    prompt: list[int]
    params: SamplingParams
    mirror: _TextMirror
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    decode: str | None = None  # the decode holding its reservation
    decode_blocks: list[int] = field(default_factory=list)
    held: bool = False  # the engine holds its prompt blocks (after the hand-off)
    started_on_decode: bool = False  # FirstGeneration succeeded
    closed: bool = False  # the client side is done: later Generations are refused

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self.queue.put_nowait(error)


class PrefillRole(EngineBackend[PDAsyncEngine]):
    """The prefill's half of PD; also the HTTP `Backend` of the prefill worker."""

    def __init__(self, engine: PDAsyncEngine, tokenizer: Tokenizer, model: ModelInfo, transport: KVTransport,
                 clients: PeerClients, metrics: WorkerMetrics, config: PDConfig, instance_name: str,
                 transfer_address: str, mode: TransferMode) -> None:  # fmt: skip
        super().__init__(engine, tokenizer, model)
        self._transport = transport
        self._clients = clients
        self._metrics = metrics
        self._config = config
        self._name = instance_name
        self._transfer_address = transfer_address  # where decodes pull from (PULL)
        self._mode = mode
        self.peers = PeerTable(metrics, self._on_decode_lost)
        self._decode_addresses: dict[str, str] = {}  # decode name -> its gRPC address
        self._load: dict[str, int] = {}  # decode name -> requests routed there and not done
        self._calls: dict[str, _Call] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._targets: dict[str, _PushTarget] = {}  # read by the engine thread
        self._block_size = engine.engine.config.block_size
        engine.engine.layer_hook = self._layer_pushes

    # --- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_link(session: TransferSession) -> None:  # a transport thread
            loop.call_soon_threadsafe(self._add_decode, session)

        self._transport.on_link = on_link
        self.peers.start_watching()

    def _add_decode(self, session: TransferSession) -> None:
        self._decode_addresses[session.peer.name] = session.peer.grpc_address
        self._load.setdefault(session.peer.name, 0)
        self.peers.add(session.peer.name, session)

    async def stop(self) -> None:
        """Unlink every decode (failing their requests) and close the channels."""
        await self.peers.close()
        for task in list(self._tasks):
            task.cancel()
        await self._clients.close()

    def close(self) -> None:
        """Backend.close: stop the engine and the transfer listener."""
        super().close()
        self._transport.close()

    # --- the PD service ---------------------------------------------------------

    async def link(self, info: InstanceInfo) -> None:
        raise WrongRole("links are made on the decode: call LinkInstance on it with this prefill's info")

    async def unlink(self, info: InstanceInfo) -> None:
        """Stop routing to that decode and fail its in-flight requests. Idempotent."""
        await self.peers.remove(info.name, "unlinked")

    async def add_requests(self, prefill_name: str, reqs: list[NewRequest]) -> list[object]:
        raise WrongRole("this is a prefill instance; AddNewRequests goes to a decode")

    async def first_generation(self, first: FirstToken) -> None:
        raise WrongRole("this is a prefill instance; FirstGeneration goes to a decode")

    async def refuse_first(self, req_id: str, reason: str) -> None:
        raise WrongRole("this is a prefill instance; FirstGeneration goes to a decode")

    async def generations(self, outputs: list[RequestOutput]) -> list[bool]:
        """Relay a decode's tokens to their clients; False for requests no longer tracked."""
        return [self._relay(out) for out in outputs]

    def _relay(self, out: RequestOutput) -> bool:
        call = self._calls.get(out.request_id)
        if call is None or call.closed or call.mirror.request.is_finished:
            return False
        if out.finished and out.finish_reason == RequestStatus.FINISHED_ABORTED.value:
            call.fail(PDRequestError(f"the decode instance {call.decode} aborted request {call.req_id}"))
            return False
        delta = call.mirror.add(out.new_token_ids, out.new_logprobs, out.finish_reason if out.finished else None)
        call.queue.put_nowait(delta)
        return not delta.finished

    # --- the HTTP backend ---------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Also needs a linked decode; a stopped engine is the first reason given."""
        if self._engine.is_running and not any(self.peers.is_live(name) for name in self.peers.names()):
            return False, "no decode instance is linked to this prefill"
        return super().ready()

    def stats(self) -> EngineStats:
        """The engine's blocks; running counts every request this prefill owns,
        also those decoding on a decode (a drain waits for all of them)."""
        s = super().stats()
        return dataclasses.replace(s, requests_running=max(s.requests_running, len(self._calls) - s.requests_waiting))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:  # fmt: skip
        self._engine.engine.check_request(list(prompt_token_ids), params)
        if request_id in self._calls:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = self._tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens)
        mirror = _TextMirror(Request(request_id, list(prompt_token_ids), params, self._block_size, detokenizer),
                             self._engine.engine)  # fmt: skip
        call = _Call(request_id, list(prompt_token_ids), params, mirror)
        self._calls[request_id] = call
        task = asyncio.create_task(self._run(call), name=f"prefill-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            async for item in outputs_until_finished(call.queue):
                yield item
        finally:
            call.closed = True
            self._calls.pop(request_id, None)
            if not call.started_on_decode:
                task.cancel()  # its cleanup frees what the request holds, here and on the decode
            if call.decode is not None and self._load.get(call.decode, 0) > 0:
                self._load[call.decode] -= 1

    async def abort(self, request_id: str) -> None:
        """End a live request's stream with an "abort" output; its generator's exit cleans up."""
        call = self._calls.get(request_id)
        if call is None or call.closed:
            return
        call.queue.put_nowait(call.mirror.abort())

    # --- one request ---------------------------------------------------------------

    async def _run(self, call: _Call) -> None:
        error: Exception | None = None
        try:
            await self._reserve(call)
            first = await self._prefill(call)
            await self._clients.first_generation(self._decode_addresses[call.decode or ""], first)
            call.started_on_decode = True
            if self._mode is TransferMode.PULL:
                self._count_sent(call, len(call.decode_blocks))
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
            call.fail(error if isinstance(error, APIError) else PDRequestError(f"request {call.req_id} failed: {error}"))

    async def _reserve(self, call: _Call) -> None:
        """Blocks on a decode: the least loaded first; 404s back off, bounded in total."""
        request = NewRequest(call.req_id, call.prompt, dataclasses.replace(call.params, stop=()), self._name)
        needed = -(-len(call.prompt) // self._block_size)
        deadline = time.monotonic() + self._config.reserve_timeout_s
        delay = self._config.backoff_initial_s
        reason = "no decode instance is linked to this prefill"
        while True:
            live = [n for n in self.peers.names() if self.peers.is_live(n)]
            if not live:
                raise PDRequestError(reason, 503)
            for name in sorted(live, key=lambda n: self._load.get(n, 0)):
                try:
                    [answer] = await self._clients.add_new_requests(self._decode_addresses[name], self._name, [request])
                except PDError as exc:
                    reason = f"decode {name} failed AddNewRequests: {exc}"
                    continue
                if answer.status is Admission.OK:
                    if len(answer.block_ids) != needed:
                        raise PDRequestError(f"decode {name} reserved {len(answer.block_ids)} blocks, not {needed}")
                    call.decode, call.decode_blocks = name, answer.block_ids
                    self._load[name] = self._load.get(name, 0) + 1
                    return
                if answer.status is Admission.TOO_LARGE:
                    raise APIError(f"the prompt of {len(call.prompt)} tokens can never fit the KV cache of "
                                   f"decode {name}", 413, "invalid_request_error")  # fmt: skip
                if answer.status is Admission.REFUSED:
                    raise PDRequestError(f"decode {name} refused the request (500)", 500)
                reason = f"no decode had free KV blocks within {self._config.reserve_timeout_s:.0f} s"
            if time.monotonic() + delay > deadline:
                raise PDRequestError(reason, 503)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._config.backoff_max_s)

    async def _prefill(self, call: _Call) -> FirstToken:
        """Run the prompt here (pushing its KV in PUSH mode) and stream the first token."""
        assert call.decode is not None, "reserved before the prefill"
        push = self._mode is TransferMode.PUSH
        if push:
            session = self.peers.get(call.decode)
            if session is None or not session.is_open:
                raise PDRequestError(f"the data path to decode {call.decode} is closed")
            self._targets[call.req_id] = _PushTarget(session, call.decode_blocks)
        handoff: RequestOutput | None = None
        started = time.monotonic()
        async for out in self._engine.generate(call.req_id, call.prompt, call.params, hand_off=True):
            handoff = out
        assert handoff is not None and handoff.finished, "an engine stream ends with a finished output"
        if handoff.finish_reason != HANDOFF:
            raise PDRequestError(f"the prefill engine ended request {call.req_id} ({handoff.finish_reason})", 500)
        call.held = True
        logprob = handoff.new_logprobs[0] if handoff.new_logprobs else None
        call.queue.put_nowait(call.mirror.add(handoff.new_token_ids, [logprob] if logprob else None))
        ttft = time.monotonic() - call.arrival
        if push:
            await self._wait_pushes(call, started)
            await self._release(call)
            return FirstToken(call.req_id, handoff.new_token_ids[0], logprob, TransferMode.PUSH, ttft)
        blocks = await self._engine.call(lambda e: e.held_block_ids(call.req_id))
        self._transport.access.allow(call.decode, call.req_id, blocks, Access.READ)  # its pull, until released
        return FirstToken(call.req_id, handoff.new_token_ids[0], logprob, TransferMode.PULL, ttft,
                          self._transfer_address, tuple(blocks))  # fmt: skip

    async def _wait_pushes(self, call: _Call, started: float) -> None:
        target = self._targets.pop(call.req_id)
        if target.error is not None:
            raise PDRequestError(f"pushing the KV of {call.req_id} failed: {target.error}")
        timeout = self._config.transfer_timeout_s

        def wait_all() -> None:
            for handle in target.handles:
                handle.wait(timeout)

        await asyncio.to_thread(wait_all)
        nbytes = sum(h.nbytes for h in target.handles)
        self._metrics.observe_kv_transfer("sent", call.decode or "", nbytes, time.monotonic() - started)

    def _count_sent(self, call: _Call, num_blocks: int) -> None:
        llm = self._engine.engine
        nbytes = num_blocks * llm.kv_cache.spec.block_bytes
        self._metrics.kv_transfer_bytes.labels(direction="sent", peer=call.decode or "").inc(nbytes)

    def _layer_pushes(self, scheduled: SchedulerOutput) -> Callable[[int], None] | None:
        """On the engine thread, before a step: the per-layer callback that pushes the
        prompt blocks of each request whose prompt completes in this step.

        Earlier chunks of a long prompt and its prefix-cache hits are in the
        same blocks, so pushing every prompt block in the final step sends each once.
        """
        pushes = []
        for request, samples in zip(scheduled.requests, scheduled.sample_mask):
            target = self._targets.get(request.request_id)
            if target is not None and samples:
                assert len(request.block_table) == len(target.dst_blocks), "prompt blocks on both sides"
                pushes.append((target, list(request.block_table)))
        if not pushes:
            return None

        def on_layer(layer: int) -> None:
            for target, src in pushes:
                if target.error is None:
                    try:
                        target.handles.append(target.session.push(layer, src, target.dst_blocks))
                    except (TransferError, ValueError) as exc:  # fail this request, not the step
                        target.error = str(exc)

        return on_layer

    async def _release(self, call: _Call) -> None:
        """Free the prompt blocks the engine kept after the hand-off."""
        self._transport.access.revoke(call.req_id)
        if call.held:
            call.held = False
            await self._engine.call(lambda e: e.release(call.req_id))

    async def _cleanup(self, call: _Call) -> None:
        """After a failure or a cancel before FirstGeneration succeeded: let the
        pushes in flight land, then free the reservation on the decode."""
        target = self._targets.pop(call.req_id, None)
        if target is not None:
            target.error = target.error or "cancelled"  # the engine thread pushes no further layer
        self._engine.abort(call.req_id)
        # A barrier: engine calls run between steps, so no push of this request starts after it.
        await self._engine.call(lambda e: None)
        if target is not None:
            with contextlib.suppress(TransferError):
                await asyncio.to_thread(lambda: [h.wait(self._config.transfer_timeout_s) for h in target.handles])
        if call.decode is not None and not call.started_on_decode:
            address = self._decode_addresses.get(call.decode)
            if address is not None:
                try:
                    await self._clients.cancel(address, call.req_id)
                except PDError as exc:
                    log.info("could not cancel %s on %s: %s", call.req_id, call.decode, exc)

    async def _on_decode_lost(self, name: str, reason: str) -> None:
        self._decode_addresses.pop(name, None)
        self._load.pop(name, None)
        for call in [c for c in self._calls.values() if c.decode == name]:
            call.fail(PDRequestError(f"the decode instance {name} went away ({reason})"))
