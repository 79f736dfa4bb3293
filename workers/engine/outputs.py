"""What the engine reports about a request after each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a request finished. A str enum: the HTTP and gRPC edges write its value."""

    STOP = "stop"  # a stop token, end of sequence or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled, or failed


@dataclass(frozen=True)
class TokenLogprob:
    """Log probability of a sampled token and its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first
    rank: int | None = None  # 1 + the number of likelier tokens; given for prompt logprobs


@dataclass
class RequestOutput:
    """The delta of one request since its previous output.

    `new_text` is safe to stream: it never ends in a partial UTF-8 character
    and never contains (the start of) a stop string. `finished` ends the
    stream: with a `finish_reason`, or with `handed_off` (the request left the
    batch after its first token and its blocks are held for another worker).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None  # once finished, unless handed off
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list[TokenLogprob] | None = None
    # Once, with the first token, when asked for: one entry per prompt token (the first is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: int | str | None = field(default=None)  # the stop token id or string that matched
    handed_off: bool = False
    held_block_ids: tuple[int, ...] = ()  # with handed_off: the held blocks, in token order
    served_by: str | None = None  # which workers served it, when not one engine alone (PD: usage.served_by)
    scheduled_at: float | None = None  # time.monotonic() when the engine first scheduled it (its queue wait's end)
