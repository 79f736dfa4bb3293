"""Scale-down without losing requests: wait until a worker is idle, unlink it, delete it.

The reconcile has already taken the pod out of routing (readiness gate
False) before a drain starts. Unlinking comes after the wait because an
unlink fails the requests in flight between the pair (PROTOCOL.md); the
drain timeout bounds the wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.operator.links import Endpoint, LinkClient, LinkOp, LinkResult
from disagg.operator.manifests import HTTP_PORT

IN_FLIGHT_METRICS = ("disagg_requests_running", "disagg_requests_waiting")


async def in_flight(http: httpx.AsyncClient, ip: str, port: int = HTTP_PORT) -> float | None:
    """Running plus waiting requests from the worker's /metrics; None when it cannot be read."""
    try:
        response = await http.get(f"http://{ip}:{port}/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        if family.name in IN_FLIGHT_METRICS:
            total += sum(s.value for s in family.samples)
    return total


@dataclass(frozen=True)
class DrainOutcome:
    idle: bool  # False: the timeout cut the wait short
    seconds: float
    unlinked: Sequence[LinkResult]


async def drain(pod: Endpoint, peers: Sequence[Endpoint], http: httpx.AsyncClient, links: LinkClient,
                deadline: float, poll_s: float) -> DrainOutcome:
    """Wait (until the wall-clock `deadline`) for `pod` to have nothing in flight,
    then unlink it from every peer, on both sides. The caller deletes the pod."""
    began = time.monotonic()
    idle = False
    while True:
        count = await in_flight(http, pod.ip)
        # An unreadable worker is gone or broken: nothing more will finish there.
        if count is None or count == 0:
            idle = True
            break
        if time.time() >= deadline:
            break
        await asyncio.sleep(poll_s)
    ops = [op for peer in peers for op in (LinkOp(False, peer, pod), LinkOp(False, pod, peer))]
    results = await links.run(ops)
    return DrainOutcome(idle=idle, seconds=time.monotonic() - began, unlinked=results)
