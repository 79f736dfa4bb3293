"""PUSH mode: each layer's KV of a prompt goes to the decode's reserved blocks
as soon as the prefill's forward has written it.

Threads: `add`, `wait` and `cancel` run on the event loop; `layer_hook` and
the callback it returns run on the engine thread, which only appends to a
target's handles or sets its error. A target is added before its request
reaches the engine and removed only after the request left the batch (`wait`
after the hand-off; `cancel` after an engine barrier), so the engine thread
never sees a target vanish mid-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.workers import tracing
from disagg.workers.engine.scheduler import SchedulerOutput
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.errors import DecodeFailed
from disagg.workers.transfer import TransferError, TransferHandle, TransferSession


@dataclass
class _Target:
    """Where one request's KV goes; written on the engine thread."""

    decode: str
    session: TransferSession
    dst_blocks: list[int]
    skip: int  # leading blocks the decode already holds
    handles: list[TransferHandle] = field(default_factory=list)
    error: str | None = None


class KVPusher:
    def __init__(self, metrics: WorkerMetrics, transfer_timeout_s: float) -> None:
        self._metrics = metrics
        self._timeout_s = transfer_timeout_s
        self._targets: dict[str, _Target] = {}  # read by the engine thread

    def add(self, req_id: str, decode: str, session: TransferSession, dst_blocks: list[int], skip: int = 0) -> None:
        """Push the prompt KV of `req_id` into `dst_blocks` of that decode as its forward runs,
        but for the first `skip` blocks, which the decode already holds."""
        self._targets[req_id] = _Target(decode, session, dst_blocks, skip)

    async def wait(self, req_id: str) -> tuple[int, float]:
        """After the hand-off: wait until every pushed byte is stored and checked; the bytes and
        the seconds from the first push (not from `add`: the request may have queued for the
        engine meanwhile, and the cost model reads a link's rate from these). Raises
        DecodeFailed when a push failed."""
        target = self._targets.pop(req_id)
        if target.error is not None:
            raise DecodeFailed(f"pushing the KV of {req_id} failed: {target.error}")
        try:
            await asyncio.to_thread(self._wait_all, target)
        except TransferError as exc:
            raise DecodeFailed(f"pushing the KV of {req_id} failed: {exc}") from exc
        nbytes = sum(h.nbytes for h in target.handles)
        ended = time.monotonic()
        began = target.handles[0].started_at if target.handles else ended
        self._metrics.observe_kv_transfer("sent", target.decode, nbytes, ended - began)
        self._trace(target, nbytes, began, ended)
        return nbytes, ended - began

    @staticmethod
    def _trace(target: _Target, nbytes: int, began: float, ended: float) -> None:
        """The request's transfer as a span, with one child per layer pushed (when tracing is on)."""
        whole = tracing.record("kv_transfer", began, ended, {
            tracing.KV_MODE: "PUSH", tracing.PEER: target.decode, tracing.KV_BYTES: nbytes,
            tracing.KV_BLOCKS: len(target.dst_blocks) - target.skip, tracing.KV_CACHED_BLOCKS: target.skip})
        if whole is None:
            return
        for layer, handle in enumerate(target.handles):  # one push per layer, in layer order
            tracing.record("kv_transfer.layer", handle.started_at, handle.finished_at or ended,
                           {tracing.KV_LAYER: layer, tracing.KV_BYTES: handle.nbytes}, whole)

    def stop(self, req_id: str) -> Callable[[], None] | None:
        """Push no further layer of `req_id`. Returns what waits for the pushes
        already in flight (blocking: run it in a thread after an engine barrier,
        so no push of the request starts after it), or None when it had no target."""
        target = self._targets.pop(req_id, None)
        if target is None:
            return None
        target.error = target.error or "cancelled"

        def drain() -> None:
            with contextlib.suppress(TransferError):
                self._wait_all(target)

        return drain

    def layer_hook(self, scheduled: SchedulerOutput) -> Callable[[int], None] | None:
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
                pushes.append((target, request.block_table[target.skip:], target.dst_blocks[target.skip:]))
        if not pushes:
            return None

        def on_layer(layer: int) -> None:
            for target, src, dst in pushes:
                if target.error is None:
                    try:
                        target.handles.append(target.session.push(layer, src, dst))
                    except (TransferError, ValueError) as exc:  # fail this request, not the step
                        target.error = str(exc)

        return on_layer

    def _wait_all(self, target: _Target) -> None:
        """One bound for all of the request's layers, not one per layer (a decode that answers each
        just inside it would stretch the wait to layers x the bound)."""
        deadline = time.monotonic() + self._timeout_s
        for handle in target.handles:
            handle.wait(max(deadline - time.monotonic(), 0.0))
