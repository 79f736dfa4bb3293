"""Scale-down without losing requests: stop new work, wait until idle, then unlink.

Before a drain starts the reconcile has taken the pod out of routing
(readiness gate False). The drain then

1. waits `grace_s`, so that load balancers and clients that read the
   endpoints a moment ago stop sending (the pod still serves meanwhile);
2. calls the worker's `POST /drain` on its admin port, signed with the cluster key as the
   link calls are: a draining prefill answers new client
   requests and /ready with 503, a draining decode answers AddNewRequests
   with 404 (prefills pick another decode); requests in flight go on;
3. polls the worker's /metrics (the admin port serves them too) until running plus waiting requests reach 0,
   until the wall-clock deadline (draining-since + spec.drain.timeoutSeconds).

The caller then unlinks the pod from its peers and deletes it. Unlinking
comes last because an unlink fails the requests in flight between the pair
(PROTOCOL.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.operator.links import Endpoint
from disagg.operator.manifests import ADMIN_PORT, HTTP_PORT
from disagg.workers.security.control import http_credential_headers
from disagg.workers.security.key import ClusterKey

IN_FLIGHT_METRICS = ("disagg_requests_running", "disagg_requests_waiting")

log = logging.getLogger(__name__)


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


async def stop_new_work(http: httpx.AsyncClient, ip: str, port: int = ADMIN_PORT,
                        key: ClusterKey | None = None) -> bool:
    """`POST /drain` on the worker (idempotent), signed with `key` (None: the workers run
    --insecure); False when it did not take it."""
    try:
        response = await http.post(f"http://{ip}:{port}/drain", headers=http_credential_headers(key, "/drain"))
        response.raise_for_status()
    except httpx.HTTPError as e:
        log.warning("POST /drain on %s failed (%s); waiting for its requests anyway", ip, e)
        return False
    return True


@dataclass(frozen=True)
class DrainOutcome:
    idle: bool  # False: the timeout cut the wait short
    stopped: bool  # the worker accepted POST /drain
    seconds: float


async def drain(pod: Endpoint, http: httpx.AsyncClient, deadline: float, grace_s: float,
                poll_s: float, port: int = ADMIN_PORT, key: ClusterKey | None = None) -> DrainOutcome:
    """Steps 1-3 above for `pod` (its admin port `port`; `POST /drain` signed with `key`);
    `deadline` is wall-clock (epoch seconds)."""
    began = time.monotonic()
    await asyncio.sleep(max(0.0, min(grace_s, deadline - time.time())))
    stopped = await stop_new_work(http, pod.ip, port, key)
    while True:
        count = await in_flight(http, pod.ip, port)
        # An unreadable worker is gone or broken: nothing more will finish there.
        if count is None or count == 0:
            return DrainOutcome(idle=True, stopped=stopped, seconds=time.monotonic() - began)
        if time.time() >= deadline:
            return DrainOutcome(idle=False, stopped=stopped, seconds=time.monotonic() - began)
        await asyncio.sleep(poll_s)
