"""The decode role: reserves blocks for a prefill's requests, takes in their
KV, generates the rest with continuous batching and streams it back.

One request (an `_Incoming`):
1. AddNewRequests: blocks are reserved (not scheduled) and their ids answered;
2. FirstGeneration: in PULL mode the KV is read from the prefill first; in
   PUSH mode the prefill only calls once every byte was stored and checked.
   Then the first token is appended and the request joins the running batch;
3. every output is streamed to the prefill with Generations; ok=false (the
   client went away) or a failed call cancels the request and frees its blocks.
A reservation whose FirstGeneration never comes is freed after a bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from disagg.proto.vocabulary import InstanceInfo
from disagg.workers import tracing
from disagg.workers.engine.async_engine import AsyncEngine, EngineError, EngineStats
from disagg.workers.engine.llm_engine import LLMEngine, OutOfBlocks, PromptTooLarge
from disagg.workers.engine.outputs import FinishReason, RequestOutput
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import EngineHealth, ModelInfo
from disagg.workers.metrics import RequestOutcome, WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.convert import XLLM_SERVICE
from disagg.workers.pd.errors import InvalidMessage, LinkRefused, PDError, PeerTimeout, PeerUnavailable, UnknownRequest
from disagg.workers.pd.links import PeerTable
from disagg.workers.pd.messages import Admission, FirstToken, NewRequest, Reservation, TransferMode
from disagg.workers.pd.service import Handlers
from disagg.workers.streams import merge_streams
from disagg.workers.transfer import Access, KVTransport, LinkRefusedError, TransferError, TransferTimeout, revoke_settled

log = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 1.0


@dataclass
class _Incoming:
    """A request a prefill handed to us."""

    req: NewRequest
    prefill: str
    block_ids: list[int]
    num_cached: int = 0  # leading blocks shared from our prefix cache: no KV comes for them
    reserved_at: float = field(default_factory=time.monotonic)
    trace_context: Context | None = None  # its AddNewRequests span's, when tracing
    started: bool = False  # FirstGeneration arrived: no longer a bare reservation
    task: asyncio.Task[None] | None = None  # streams its outputs, once admitted


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one delta (sent while a call was in flight)."""
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in (o.new_logprobs or ())]
    return RequestOutput(
        request_id=last.request_id, new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs), finished=last.finished, finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens, new_logprobs=logprobs or None, stop_reason=last.stop_reason,
    )


def _kv_attributes(inc: _Incoming, mode: str, nbytes: int) -> dict[str, AttributeValue]:
    return {tracing.KV_MODE: mode, tracing.PEER: inc.prefill, tracing.KV_BYTES: nbytes,
            tracing.KV_BLOCKS: len(inc.block_ids) - inc.num_cached, tracing.KV_CACHED_BLOCKS: inc.num_cached}


def _relay_attributes(inc: _Incoming, out: RequestOutput) -> dict[str, AttributeValue] | None:
    """A Generations span's attributes (None when tracing is off: not built per token for nothing)."""
    if not tracing.is_enabled():
        return None
    return {**tracing.rpc_attributes(XLLM_SERVICE, "Generations", inc.req.source_addr),
            "disagg.tokens": len(out.new_token_ids)}


class DecodeRole(EngineHealth["AsyncEngine[LLMEngine]"]):
    """The decode's half of PD: its gRPC handlers, and the worker's health (no
    completion Backend: a decode takes no client requests).

    Ready while its engine runs and it is not draining: the data path listens
    from before the role is built (`worker.build_decode`) until close.
    """

    def __init__(self, engine: AsyncEngine[LLMEngine], tokenizer: Tokenizer, model: ModelInfo, transport: KVTransport,
                 clients: PeerClients, metrics: WorkerMetrics, config: PDConfig) -> None:
        super().__init__(engine, tokenizer, model)
        self._transport = transport
        self._clients = clients
        self._metrics = metrics
        self._config = config
        self.peers = PeerTable(metrics, self._on_prefill_lost)
        self._incoming: dict[str, _Incoming] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def handlers(self) -> Handlers:
        return Handlers("decode", unlink=self.unlink, link=self.link, intake=self)

    # --- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        self.peers.start_watching()
        self._sweeper = asyncio.create_task(self._sweep(), name="reservation-sweep")

    async def stop(self) -> None:
        """Unlink every prefill (dropping their requests) and close the channels."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.peers.close()
        await self._clients.close()

    def close(self) -> None:
        """Stop the engine and the transfer listener."""
        super().close()
        self._transport.close()

    # --- links -------------------------------------------------------------

    async def link(self, info: InstanceInfo) -> None:
        """Open the data path to a prefill and handshake. Idempotent."""
        if self.peers.is_live(info.name):
            return
        try:
            session = await asyncio.to_thread(self._transport.connect, info.transfer_address,
                                              self._config.link_timeout_s, info.name)
        except LinkRefusedError as exc:
            raise LinkRefused(str(exc)) from exc
        except TransferTimeout as exc:
            raise PeerTimeout(f"prefill {info.name} at {info.transfer_address}: {exc}") from exc
        except (TransferError, OSError) as exc:
            raise PeerUnavailable(f"cannot reach prefill {info.name} at {info.transfer_address}: {exc}") from exc
        self._clients.renew(session.peer.grpc_address)
        self.peers.add(info.name, session)

    async def unlink(self, name: str) -> None:
        """Drop that prefill's requests (freeing their blocks) and close the data path. Idempotent."""
        await self.peers.remove(name, "unlinked")

    async def _on_prefill_lost(self, name: str, reason: str) -> None:
        for req_id in [r for r, inc in self._incoming.items() if inc.prefill == name]:
            await self._drop(req_id, f"its prefill {name} went away ({reason})")

    # --- the PD service ---------------------------------------------------------

    async def add_requests(self, prefill_name: str, reqs: list[NewRequest], reuse_prefix: bool = False
                           ) -> list[Reservation]:
        reuse = reuse_prefix and self._config.prefix_reuse
        return [await self._reserve(prefill_name, r, reuse) for r in reqs]

    async def _reserve(self, prefill: str, req: NewRequest, reuse_prefix: bool) -> Reservation:
        if self._draining:
            # 404, as when out of blocks: the prefill tries another decode.
            return Reservation(req.req_id, Admission.NO_BLOCKS, [])
        if not self.peers.is_live(prefill):
            # 404 too: a link is changing (a drain's two unlinks race, one side first), and the prefill
            # that still counts this decode linked must try another, not fail its client's request.
            log.warning("request %s from %s, which is not linked here", req.req_id, prefill)
            return Reservation(req.req_id, Admission.NO_BLOCKS, [])
        if req.req_id in self._incoming:
            return Reservation(req.req_id, Admission.REFUSED, [])
        def reserve(e: LLMEngine) -> tuple[list[int], int]:
            blocks = e.reserve_request(req.req_id, req.prompt_token_ids, req.params, reuse_prefix)
            return blocks, e.reserved_prefix_blocks(req.req_id)

        reservation = asyncio.ensure_future(self._engine.call(reserve))
        try:
            blocks, num_cached = await asyncio.shield(reservation)
        except asyncio.CancelledError:
            # The caller gave up (its deadline) while the engine was busy: the engine still runs the
            # reservation, and nobody would ever free it. Free it behind the call.
            reservation.add_done_callback(lambda done: self._release_abandoned(req.req_id, done))
            raise
        except EngineError:
            self._engine.abort(req.req_id)  # a call that timed out may still run: the abort queues behind it
            raise
        except PromptTooLarge:
            return Reservation(req.req_id, Admission.TOO_LARGE, [])
        except OutOfBlocks:
            return Reservation(req.req_id, Admission.NO_BLOCKS, [])
        except ValueError as exc:
            log.warning("request %s refused: %s", req.req_id, exc)
            return Reservation(req.req_id, Admission.REFUSED, [])
        self._metrics.observe_prefix_lookup(len(req.prompt_token_ids), num_cached * self._engine.block_size)
        self._incoming[req.req_id] = _Incoming(req, prefill, blocks, num_cached, trace_context=tracing.current())
        # Its pushes, until FirstGeneration: into the fresh blocks only, never the shared cached ones.
        self._transport.access.allow(prefill, req.req_id, blocks[num_cached:], Access.WRITE)
        return Reservation(req.req_id, Admission.OK, blocks, num_cached)

    def _release_abandoned(self, req_id: str, reservation: asyncio.Future[tuple[list[int], int]]) -> None:
        if not reservation.cancelled():
            reservation.exception()  # retrieved: nobody else awaits it
            self._engine.abort(req_id)  # what it reserved; a no-op if it reserved nothing

    async def first_generation(self, first: FirstToken) -> None:
        """Take in the KV (PULL) and start generating; on any failure the request is freed."""
        inc = self._incoming.get(first.req_id)
        if inc is None or inc.started:
            raise UnknownRequest(f"no reserved request {first.req_id!r} waits for its first token here")
        if not 0 <= first.token_id < self.model.vocab_size:  # it would fail the next step of every request
            await self.refuse_first(first.req_id, f"first token id {first.token_id} is outside the vocabulary "
                                                  f"[0, {self.model.vocab_size})")
        inc.started = True
        self._transport.access.revoke(first.req_id)
        try:
            if first.mode is TransferMode.PULL:
                await self._pull(inc, first)
            else:
                nbytes = (len(inc.block_ids) - inc.num_cached) * self._engine.block_bytes
                self._metrics.observe_kv_transfer("received", inc.prefill, nbytes)  # the prefill times it
                # Pushed bytes land unseen here: the span is the window they were written in.
                tracing.record("kv_receive", inc.reserved_at, time.monotonic(), _kv_attributes(inc, "PUSH", nbytes),
                               inc.trace_context)
            self._metrics.kv_transfer_skipped_blocks.inc(inc.num_cached)
            inc.task = asyncio.create_task(self._stream(inc, first), name=f"decode-{first.req_id}")
        except (PDError, asyncio.CancelledError) as exc:
            # Cancelled: the caller's deadline ran out mid-pull; nobody else would free the request.
            await self._drop(first.req_id, str(exc) or "its FirstGeneration was cancelled")
            raise

    async def refuse_first(self, req_id: str, reason: str) -> None:
        """A malformed FirstGeneration: free the request it names, then refuse."""
        inc = self._incoming.get(req_id)
        if inc is not None and not inc.started:
            await self._drop(req_id, reason)
        raise InvalidMessage(reason)

    async def _pull(self, inc: _Incoming, first: FirstToken) -> None:
        session = self.peers.get(inc.prefill)
        if session is None or not session.is_open:
            raise PeerUnavailable(f"the data path to prefill {inc.prefill} is closed")
        if len(first.prefill_block_ids) != len(inc.block_ids):
            raise InvalidMessage(f"request {inc.req.req_id}: {len(first.prefill_block_ids)} prefill blocks for "
                                 f"{len(inc.block_ids)} reserved blocks")
        started = time.monotonic()
        skip = inc.num_cached  # held here already: pulled by no one
        try:
            handle = session.pull(list(first.prefill_block_ids[skip:]), inc.block_ids[skip:])
        except ValueError as exc:
            raise InvalidMessage(f"request {inc.req.req_id}: {exc}") from exc
        pulling = asyncio.ensure_future(asyncio.to_thread(handle.wait, self._config.transfer_timeout_s))
        try:
            await asyncio.shield(pulling)
        except asyncio.CancelledError:
            await asyncio.wait([pulling])  # the blocks are freed next: not while the pull still writes them
            raise
        except TransferTimeout as exc:
            # Its DATA may still come, into blocks freed next: only closing the link stops it.
            self._close_link(inc.prefill, f"pulling the KV of {inc.req.req_id} timed out")
            raise PeerTimeout(f"pulling the KV of {inc.req.req_id}: {exc}") from exc
        except TransferError as exc:
            raise PeerUnavailable(f"pulling the KV of {inc.req.req_id}: {exc}") from exc
        ended = time.monotonic()
        self._metrics.observe_kv_transfer("received", inc.prefill, handle.nbytes, ended - started)
        tracing.record("kv_receive", started, ended, _kv_attributes(inc, "PULL", handle.nbytes))

    async def _stream(self, inc: _Incoming, first: FirstToken) -> None:
        """Generate and stream to the prefill until finished, refused or failed;
        what the engine made while a Generations call was out goes in the next one."""
        req_id = inc.req.req_id
        status = RequestOutcome.ERROR
        # One span for the whole decode phase (not one per token), child of FirstGeneration's.
        phase = tracing.start("decode", {tracing.REQUEST_ID: req_id,
                                         tracing.GEN_AI_INPUT_TOKENS: len(inc.req.prompt_token_ids)})
        num_output_tokens = 1  # the prefill's
        try:
            # Closing the merge closes the engine stream: an unfinished request is aborted and freed.
            async with aclosing(merge_streams([self._outputs(inc, first)])) as batches:
                async for batch in batches:
                    out = merge_outputs([o for _, o in batch])
                    num_output_tokens = max(num_output_tokens, out.num_output_tokens)
                    with tracing.span("Generations", _relay_attributes(inc, out), SpanKind.CLIENT,
                                      tracing.context_of(phase)):
                        [tracked] = await self._clients.generations(inc.req.source_addr, [out])
                    if out.finished:  # the prefill tracks it no more either way: it ended
                        status = RequestOutcome.ABORTED if out.finish_reason is FinishReason.ABORT else RequestOutcome.OK
                        break
                    if not tracked:
                        status = RequestOutcome.ABORTED
                        break
        except PDError as exc:
            log.warning("streaming %s to %s failed: %s", req_id, inc.req.source_addr, exc)
        except asyncio.CancelledError:
            status = RequestOutcome.ABORTED  # dropped: an unlink, the prefill's abort, a stop
            raise
        finally:
            self._incoming.pop(req_id, None)
            self._metrics.count_request(status)
            tracing.end(phase, {tracing.GEN_AI_OUTPUT_TOKENS: num_output_tokens, "disagg.outcome": status})

    async def _outputs(self, inc: _Incoming, first: FirstToken) -> AsyncIterator[RequestOutput]:
        """The engine's outputs after the first token; an engine failure ends them
        with an "abort" output (the prefill then fails its client)."""
        try:
            async for out in self._engine.admit(inc.req.req_id, first.token_id):
                yield out
        except Exception as exc:
            log.warning("request %s failed in the engine: %s", inc.req.req_id, exc)
            yield RequestOutput(
                request_id=inc.req.req_id, new_token_ids=[], new_text="", finished=True,
                finish_reason=FinishReason.ABORT, num_prompt_tokens=len(inc.req.prompt_token_ids),
                num_output_tokens=0,
            )

    async def _drop(self, req_id: str, reason: str) -> None:
        inc = self._incoming.pop(req_id, None)
        if inc is None:
            self._transport.access.revoke(req_id)
            return
        log.info("dropping request %s: %s", req_id, reason)
        if inc.task is not None:
            inc.task.cancel()
        try:
            if not await revoke_settled(self._transport.access, req_id, self._config.transfer_timeout_s):
                self._close_link(inc.prefill, f"a frame of {req_id} still wrote its blocks when they were freed")
        finally:
            # Queued at once, even by a cancelled drop, and even for a task cancelled before it ran
            # (it never admitted the request: only the abort frees its reserved blocks).
            self._engine.abort(req_id)
        if self._engine.is_running:
            await self._engine.call(lambda e: None)  # commands run in order: the blocks are free before any answer

    def _close_link(self, prefill: str, reason: str) -> None:
        """Close the data path to `prefill`: its frames stop where they are."""
        session = self.peers.get(prefill)
        if session is not None:
            log.warning("closing the data path to prefill %s: %s", prefill, reason)
            session.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            limit = time.monotonic() - self._config.reservation_ttl_s
            for req_id in [r for r, inc in self._incoming.items() if not inc.started and inc.reserved_at < limit]:
                await self._drop(req_id, f"no FirstGeneration within {self._config.reservation_ttl_s:.0f} s")

    # --- health -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's load; a reservation still waiting for its KV counts as waiting."""
        s = super().stats()
        reserved = sum(1 for inc in self._incoming.values() if inc.task is None)
        return dataclasses.replace(s, requests_waiting=s.requests_waiting + reserved)
