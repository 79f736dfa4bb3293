"""Continuous batching: which requests run in the next step, and how many of
their tokens.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running
requests (`max_num_seqs`). Running requests go first, decodes before the
remaining chunks of long prompts, so that a long prompt never stalls the
streams already generating; then waiting requests are admitted in arrival
order. A prompt larger than what is left of the budget runs in chunks over
several steps. When blocks run out, the newest running request is preempted:
its blocks are freed and it waits again at the front of the queue, to be
recomputed (its cached full blocks usually come straight back from the
prefix cache).

Two more live states serve workers that split a request's work (PD): a
request may be RESERVED (`reserve`: fresh blocks for a prompt whose KV is
computed elsewhere; `admit_running` then joins it to the batch), and a
running one may be HELD (`hold`: out of the batch, blocks kept until
`release`). `requests` owns every live request, whatever its state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from disagg.workers.engine.block_manager import BlockManager
from disagg.workers.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The requests of one step; request i runs `num_new_tokens[i]` tokens
    starting at its `num_computed_tokens`."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def sample_mask(self) -> list[bool]:
        """Whether each request reaches its last token in this step, and so samples."""
        return [
            r.num_computed_tokens + n == r.num_tokens
            for r, n in zip(self.requests, self.num_new_tokens)
        ]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # lifetime counter, for metrics

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: reserved and held requests wait for other events."""
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self._register(request)
        self.waiting.append(request)

    def can_reserve(self, request: Request, cached_blocks: Sequence[int] = ()) -> bool:
        return self.block_manager.can_allocate(request, list(cached_blocks), self._uncached(request, cached_blocks))

    def reserve(self, request: Request, cached_blocks: Sequence[int] = ()) -> None:
        """Allocate the blocks of a new request's tokens without scheduling it: the shared
        `cached_blocks` (from `BlockManager.match_prefix`) first, then fresh ones.

        NOTE: only the fresh blocks may be written by a transfer; a shared prefix-cache block
        must never be (the caller grants writes on `request.block_table[len(cached_blocks):]`)."""
        self._register(request)
        self.block_manager.allocate(request, list(cached_blocks), self._uncached(request, cached_blocks))
        request.status = RequestStatus.RESERVED

    def _uncached(self, request: Request, cached_blocks: Sequence[int]) -> int:
        return request.num_tokens - len(cached_blocks) * self.block_manager.block_size

    def admit_running(self, request: Request) -> None:
        """A reserved request whose prompt KV is in its blocks joins the batch."""
        assert request.status is RequestStatus.RESERVED, f"{request} is not reserved"
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.commit(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def hold(self, request: Request) -> None:
        """Take a running request out of the batch; its blocks stay until `release`."""
        assert request.status is RequestStatus.RUNNING, f"{request} is not running"
        self.running.remove(request)
        request.status = RequestStatus.HELD

    def release(self, request: Request) -> None:
        """Free a held request's blocks and forget it."""
        assert request.status is RequestStatus.HELD, f"{request} is not held"
        self._retire(request, RequestStatus.FINISHED_STOPPED)

    def schedule(self, max_tokens: int | None = None) -> SchedulerOutput:
        """The next step's batch, within the budget or `max_tokens` if smaller."""
        budget = self.max_num_batched_tokens if max_tokens is None else min(max_tokens, self.max_num_batched_tokens)
        scheduled: dict[Request, int] = {}  # insertion-ordered: the batch order
        preempted: list[Request] = []

        # Running requests: decodes first, then prompt chunks; arrival order within each.
        for request in sorted(self.running, key=lambda r: (r.is_prefill, r.arrival)):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(request, num_new):
                victim = max(self.running, key=lambda r: r.arrival)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self.block_manager.append_slot(request, num_new)
                scheduled[request] = num_new
                budget -= num_new

        # Waiting requests, strictly in order; none while we are short of blocks.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached_blocks = self.block_manager.match_prefix(request)
            num_cached = len(cached_blocks) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.can_allocate(request, cached_blocks, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(request, cached_blocks, num_new)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_at = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new

        return SchedulerOutput(list(scheduled), list(scheduled.values()), preempted)

    def update(self, output: SchedulerOutput) -> None:
        """After the step ran: the scheduled tokens are in the cache."""
        for request, num_new in zip(output.requests, output.num_new_tokens):
            request.num_computed_tokens += num_new
            assert request.num_computed_tokens <= request.num_tokens, f"{request} computed past its end"
            self.block_manager.commit(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a running request and free its blocks."""
        assert status.is_finished, f"{status} is not a finished status"
        self.running.remove(request)
        self._retire(request, status)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request wherever it is; None when it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self._retire(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _register(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request {request.request_id!r}"
        assert request.status is RequestStatus.WAITING, f"{request} is not new"
        self.requests[request.request_id] = request

    def _retire(self, request: Request, status: RequestStatus) -> None:
        self.block_manager.free(request)
        request.status = status
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        # Victims are taken newest first, so the oldest ends up at the front.
        self.waiting.appendleft(request)
