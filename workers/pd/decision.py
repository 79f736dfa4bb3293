"""Per request, whether a prefill hands off to a decode or serves the whole request itself.

`always` (the default) hands every request off, as the PD protocol is written,
except one whose sampling extras (a big grammar) pass the metadata bound of a
hand-off (`convert.MAX_EXTRAS_BYTES`, docs/pd-wire.md): no decode could take
it, so the prefill serves it, under either policy.
`auto` serves a request locally, as a mixed worker would, when the hand-off
would cost more than it saves, judged from measured quantities:

1. the prefill's own decode slots are full (`local_max_running` requests it
   serves itself): hand off, whatever the rest says;
2. no linked decode has room (each answered "no free blocks" within the last
   second): serve locally rather than wait for one;
3. the prompt part the prefill's cache does not hold is short
   (`local_max_tokens` or fewer tokens): serve locally. Such a prompt is as
   cheap to compute as a decode step is, so it cannot stall the decodes that
   disaggregation protects, while a hand-off would add two RPCs to its TTFT;
4. the hand-off would more than double its time to first token: the prompt
   is computed here either way, and handing off adds the round trips
   (AddNewRequests + FirstGeneration, measured) and whatever part of the KV
   transfer outlasts the computation it overlaps with (the link's measured
   bytes a second against the prefill's measured prompt tokens a second).
   When that overhead exceeds the computation itself, serve locally. Until
   all three are measured, hand off.

Every choice is counted in `disagg_pd_decision_total{decision}` (and by why in
`disagg_pd_decision_reasons_total{decision,reason}`), and
named in the response (`usage.served_by`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from disagg.proto.vocabulary import PDPolicy

_SMOOTHING = 0.2  # weight of a new observation in each moving average


class Path(str, Enum):
    HANDOFF = "handoff"
    LOCAL = "local"


@dataclass(frozen=True)
class DecisionPolicy:
    mode: PDPolicy = PDPolicy.ALWAYS
    local_max_tokens: int = 32  # uncached prompt tokens that `auto` always serves locally
    local_max_running: int = 8  # requests the prefill serves itself at once under `auto`

    def __post_init__(self) -> None:
        if self.local_max_tokens < 0 or self.local_max_running < 1:
            raise ValueError("local_max_tokens must be >= 0 and local_max_running >= 1")


class Average:
    """An exponentially weighted moving average; None until the first observation."""

    def __init__(self) -> None:
        self.value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else (1 - _SMOOTHING) * self.value + _SMOOTHING * x


class CostModel:
    """The measured quantities `auto` weighs, and the choice."""

    def __init__(self, policy: DecisionPolicy, bytes_per_token: float) -> None:
        self.policy = policy
        self.bytes_per_token = bytes_per_token
        self.transfer_rate = Average()  # KV bytes a second over the links
        self.round_trip_s = Average()  # AddNewRequests + FirstGeneration, seconds
        self.prefill_rate = Average()  # prompt tokens a second computed here

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.transfer_rate.observe(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_rate.observe(tokens / seconds)

    def choose(self, uncached_tokens: int, local_running: int, decode_has_room: bool,
               fits_wire: bool = True) -> tuple[Path, str]:
        """The path of one request, and the reason (a metric label); `fits_wire`: whether its
        extras fit an AddNewRequests call."""
        policy = self.policy
        if not fits_wire:
            return Path.LOCAL, "extras_too_large"
        if policy.mode is PDPolicy.ALWAYS:
            return Path.HANDOFF, "policy"
        if local_running >= policy.local_max_running:
            return Path.HANDOFF, "local_full"
        if not decode_has_room:
            return Path.LOCAL, "decodes_full"
        if uncached_tokens <= policy.local_max_tokens:
            return Path.LOCAL, "short_prompt"
        rate, trips, compute = self.transfer_rate.value, self.round_trip_s.value, self.prefill_rate.value
        if rate is None or trips is None or compute is None:
            return Path.HANDOFF, "unmeasured"
        compute_s = uncached_tokens / compute
        overhead_s = trips + max(0.0, uncached_tokens * self.bytes_per_token / rate - compute_s)
        if overhead_s > compute_s:
            return Path.LOCAL, "handoff_costlier"
        return Path.HANDOFF, "cost"
