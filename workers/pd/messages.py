"""The PD roles' own message types: what the gRPC edge (convert.py) turns
protobuf messages into, so that prefill.py and decode.py never see protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from disagg.proto.vocabulary import TransferMode
from disagg.workers.engine.outputs import TokenLogprob
from disagg.workers.engine.sampling_params import SamplingParams

__all__ = ["Admission", "FirstToken", "NewRequest", "Reservation", "TransferMode"]


class Admission(enum.IntEnum):
    """`DisaggResponse.status_code` of AddNewRequests (HTTP-like, as in xLLM)."""

    OK = 200  # blocks allocated; their ids are in the answer
    NO_BLOCKS = 404  # no room right now (no free blocks, draining, link changing): back off, try another decode
    TOO_LARGE = 413  # the prompt can never fit this decode: fail the request
    REFUSED = 500  # the request could not be built (bad parameters, duplicate id)


@dataclass(frozen=True)
class NewRequest:
    """One request a prefill hands to a decode (AddNewRequests)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # without stop strings: the prefill owns the text
    source_addr: str  # where the decode streams tokens: the prefill's gRPC address


@dataclass(frozen=True)
class Reservation:
    """A decode's answer to one NewRequest."""

    req_id: str
    status: Admission
    block_ids: list[int]  # every block of the prompt, in order
    # The leading blocks the decode already holds (its prefix cache): their KV is not sent.
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class FirstToken:
    """FirstGeneration of one request: the token the prefill sampled, and
    where the KV is when the decode must pull it."""

    req_id: str
    token_id: int
    logprob: TokenLogprob | None
    mode: TransferMode
    ttft_s: float = 0.0
    prefill_transfer_address: str = ""  # PULL only
    prefill_block_ids: tuple[int, ...] = ()  # PULL only
