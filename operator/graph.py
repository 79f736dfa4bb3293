"""The link graph: the links the operator has made (which decode with which
prefill) and the failed attempts with their backoff. Pure: no I/O.

It is the operator's memory of what it made, rebuilt by re-asserting links
after an operator restart.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from disagg.operator.links import Endpoint, LinkResult

Pair = tuple[str, str]  # (decode pod name, prefill pod name)
# What the planner saw of a pair's two pods when it tried to link them
# (reconcile.PodView.observed of each): a failed pair whose pods have changed
# since is due again at once, with its backoff started afresh.
Observed = Hashable

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


@dataclass(frozen=True)
class Edge:
    decode: Endpoint
    prefill: Endpoint


@dataclass
class Failure:
    attempts: int  # failures in a row while the pair's pods stayed as `observed`
    next_due: float  # monotonic time of the next attempt
    error: str
    observed: Observed


@dataclass
class LinkGraph:
    """Links the operator has made and link attempts that failed, per (decode, prefill) pair."""

    edges: dict[Pair, Edge] = field(default_factory=dict)
    failures: dict[Pair, Failure] = field(default_factory=dict)

    def established(self, pair: Pair, decode: Endpoint, prefill: Endpoint) -> bool:
        """Linked, and with these incarnations (a restarted worker needs linking again)."""
        return self.edges.get(pair) == Edge(decode, prefill)

    def due(self, pair: Pair, now: float, observed: Observed) -> bool:
        """Never failed, backed off long enough, or its pods changed since the failure
        (a worker that has just loaded its model or restarted deserves a try now)."""
        f = self.failures.get(pair)
        return f is None or now >= f.next_due or f.observed != observed

    def next_due(self) -> float | None:
        return min((f.next_due for f in self.failures.values()), default=None)

    def record_link(self, pair: Pair, result: LinkResult, now: float, observed: Observed) -> None:
        """The outcome of a link attempt made while the pair's pods were as `observed`.

        A failed re-assert of a link made with these same incarnations keeps the
        edge: a timeout or a refusal says nothing about the link the worker holds
        (a restarted worker is a new incarnation, linked afresh), and dropping it
        would take both pods out of routing. It is tried again after the backoff.
        """
        op = result.op
        made = Edge(decode=op.target, prefill=op.payload)
        if result.ok:
            self.edges[pair] = made
            self.failures.pop(pair, None)
            return
        if self.edges.get(pair) != made:
            self.edges.pop(pair, None)
        before = self.failures.get(pair)
        # The backoff grows only while nothing changes; a change starts it again from the base.
        attempts = before.attempts + 1 if before is not None and before.observed == observed else 1
        delay = min(BACKOFF_BASE_S * 2 ** (attempts - 1), BACKOFF_CAP_S)
        self.failures[pair] = Failure(attempts=attempts, next_due=now + delay, error=result.error, observed=observed)

    def forget(self, pairs: Iterable[Pair]) -> None:
        for pair in pairs:
            self.edges.pop(pair, None)
            self.failures.pop(pair, None)

    def peers_of(self, pod: str) -> list[Pair]:
        return [pair for pair in self.edges if pod in pair]
