"""The state of one request inside the engine, from arrival to finish."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from disagg.workers.engine.outputs import FinishReason, TokenLogprob

if TYPE_CHECKING:
    from disagg.workers.engine.grammar import Constraint
    from disagg.workers.engine.sampling_params import SamplingParams

# Arrival order across all requests: the scheduler's fairness key.
_arrival_counter = itertools.count()


class Detokenizer(Protocol):
    """Turns one request's output tokens into text, a piece at a time
    (tokenizer.py's IncrementalDetokenizer)."""

    def add(self, token_ids: Iterable[int]) -> str:
        """Return the new text these tokens complete (never a broken UTF-8 tail)."""
        ...

    def flush(self) -> str:
        """Return whatever text is still held back, at the end of the request."""
        ...


class RequestStatus(enum.Enum):
    """Where a live request is; the scheduler's `requests` table owns it in
    every live state, and only WAITING and RUNNING ones are scheduled."""

    WAITING = "waiting"  # queued, or preempted and queued again for recompute
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    RESERVED = "reserved"  # holds blocks for a prompt whose KV is computed elsewhere; not scheduled
    HELD = "held"  # left the batch after its first token; holds its blocks until released
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        return next(s for s, r in _FINISH_REASONS.items() if r is reason)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence: its tokens, its KV blocks and how far the model has read it.

    Token regions of `token_ids`:
        [0, num_computed_tokens)            K/V already in the cache
        [num_computed_tokens, num_tokens)   still to run through the model
        [num_prompt_tokens, num_tokens)     the generated (output) tokens
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        detokenizer: Detokenizer | None = None,
        device: torch.device | str = "cpu",
        hold_after_first_token: bool = False,
        constraint: Constraint | None = None,
    ) -> None:
        assert prompt_token_ids, "a request needs at least one prompt token"
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.arrival = next(_arrival_counter)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Leave the batch after the first sampled token, keeping the blocks
        # (the prompt's KV goes to another worker, which generates the rest).
        self.hold_after_first_token = hold_after_first_token

        # Paged KV: block_table[i] holds tokens [i * block_size, (i + 1) * block_size).
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full blocks of token_ids
        self.num_committed_blocks = 0  # leading blocks published to the prefix cache
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at the first schedule
        self.first_scheduled_at: float | None = None  # time.monotonic() when it first left the queue
        self.num_preemptions = 0

        # Per-request sampling randomness, so that a seed reproduces whatever the batch.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device).manual_seed(sampling_params.seed)

        # Output text: everything detokenized so far, of which the first
        # num_sent_chars went out; the rest is held back (could start a stop string).
        self.detokenizer = detokenizer
        self.output_text = ""
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.pending_logprobs: list[TokenLogprob] = []
        # Asked-for prompt logprobs: entry i is token i's (token 0 has none); filled chunk by chunk.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None])
        self.prompt_logprobs_sent = False
        # Structured outputs: the grammar state, advanced by every appended token.
        self.constraint = constraint

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    # --- counts -------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token of the sequence."""
        return self.num_blocks_for(self.num_tokens)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- tokens -------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_min_tokens_left(self) -> int:
        """Output tokens still to come before the request may stop (`min_tokens`)."""
        return max(0, self.sampling_params.min_tokens - self.num_output_tokens)

    def block_token_ids(self, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return self.token_ids[start : start + self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.advance(token_id)

    # --- state --------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is still to run (a prompt, or a recompute)."""
        return self.num_uncomputed_tokens > 1
