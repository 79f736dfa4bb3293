"""The queue of a connection's sender thread, which merges pushed layers into larger frames.

A push queues one WRITE per layer. When the sender falls behind (the socket
is slower than the forward pass, or a caller pushes every layer at once), the
queued writes of consecutive layers with the same block runs leave as ONE
frame of several layers: one header, one checksum trailer and one ACK instead
of one per layer. Receivers already take multi-layer WRITEs (a frame's
`layer_count`), so the wire does not change. A sender that keeps up still
sends each layer as soon as it is pushed.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

from disagg.workers.transfer.wire import Frame

# A merged frame stops growing here, so that one ACK never waits for much
# more than a few layers of a large request.
MAX_FRAME_BYTES = 32 << 20


@dataclass(frozen=True)
class LayerWrite:
    """One pushed layer: its one-layer WRITE frame and, on a CUDA pool, the event its bytes wait for."""

    frame: Frame
    ready: torch.cuda.Event | None


Job: TypeAlias = Callable[[], None] | LayerWrite


class SendQueue:
    """Jobs for one sender thread, in order; `get` hands out runs of mergeable writes together.

    Thread-safe for any number of producers and ONE consumer (the sender thread).
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._max_frame_bytes = max_frame_bytes
        self._held: list[Job | None] = []  # a job taken while merging that did not fit: next out

    def put(self, job: Job | None) -> None:
        """Queue a job; None tells the consumer to stop."""
        self._jobs.put(job)

    def get(self) -> Callable[[], None] | list[LayerWrite] | None:
        """Block for the next job: a callable, writes of consecutive layers to send as one
        frame (in layer order, the same runs), or None to stop."""
        job = self._held.pop() if self._held else self._jobs.get()
        if not isinstance(job, LayerWrite):
            return job
        writes, size = [job], job.frame.payload_bytes
        while size + job.frame.payload_bytes <= self._max_frame_bytes:
            try:
                follower = self._jobs.get_nowait()
            except queue.Empty:
                break
            if not self._continues(writes[-1], follower):
                self._held.append(follower)
                break
            assert isinstance(follower, LayerWrite), "checked by _continues"
            writes.append(follower)
            size += follower.frame.payload_bytes
        return writes

    @staticmethod
    def _continues(last: LayerWrite, job: Job | None) -> bool:
        return (isinstance(job, LayerWrite) and job.frame.layer == last.frame.layer + 1
                and job.frame.runs == last.frame.runs)
