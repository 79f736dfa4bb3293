"""What the autoscaler reads from the workers: each pod's /metrics, kept over a
window, and a role's window summarised into `autoscaler.RoleMetrics`.

A sample is one scrape of one pod. A role's latency quantiles come from the
increase of its pods' histograms between the oldest and the newest sample in
the window (Prometheus' `histogram_quantile` over `increase()`, linear within
a bucket), and its token rates from the counters' increase over the same span,
so a window says what happened in it, not since the worker started. The
client-facing figures (TTFT, TPOT, prompt and generation tokens) are recorded
where the client's stream is, on the prefill pods; the decode role reads its
TPOT and rates there, and its queue and KV from its own pods.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.operator.autoscaler import RoleMetrics
from disagg.operator.manifests import HTTP_PORT
from disagg.operator.scaling import Role

TTFT = "disagg_time_to_first_token_seconds"
TPOT = "disagg_time_per_output_token_seconds"
_GAUGES = {"disagg_requests_waiting": "waiting", "disagg_requests_running": "running",
           "disagg_kv_blocks_free": "kv_free", "disagg_kv_blocks_total": "kv_total"}
_COUNTERS = {"disagg_prompt_tokens": "prompt_tokens", "disagg_generation_tokens": "generation_tokens"}
SCRAPE_TIMEOUT_S = 2.0
QUANTILE = 0.9

Buckets = tuple[tuple[float, float], ...]  # cumulative (upper bound, count), +Inf last


@dataclass(frozen=True)
class PodSample:
    """One scrape of one worker's /metrics, at `at` on the operator's monotonic clock."""

    at: float
    ttft: Buckets
    tpot: Buckets
    waiting: float
    running: float
    kv_free: float
    kv_total: float
    prompt_tokens: float
    generation_tokens: float


class MetricsFormatError(ValueError):
    """The text is not a worker's /metrics: a series the autoscaler needs is missing."""


def parse_sample(text: str, at: float) -> PodSample:
    """A worker's /metrics text as a sample; MetricsFormatError when a needed series is absent."""
    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {TTFT: [], TPOT: []}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _GAUGES:
                values[_GAUGES[s.name]] = s.value
            elif s.name.removesuffix("_total") in _COUNTERS and s.name.endswith("_total"):
                values[_COUNTERS[s.name.removesuffix("_total")]] = s.value
            elif s.name.endswith("_bucket") and s.name.removesuffix("_bucket") in buckets:
                buckets[s.name.removesuffix("_bucket")].append((float(s.labels["le"]), s.value))
    missing = [n for n in (*_GAUGES.values(), *_COUNTERS.values()) if n not in values]
    missing += [h for h, b in buckets.items() if not b]
    if missing:
        raise MetricsFormatError(f"no {', '.join(missing)} in the worker's /metrics")
    return PodSample(at, tuple(sorted(buckets[TTFT])), tuple(sorted(buckets[TPOT])), **values)


async def scrape(http: httpx.AsyncClient, ip: str, port: int = HTTP_PORT,
                 clock: Callable[[], float] = time.monotonic) -> PodSample | None:
    """One sample of the worker at `ip`; None when it cannot be read or is not a worker's /metrics."""
    try:
        response = await http.get(f"http://{ip}:{port}/metrics", timeout=SCRAPE_TIMEOUT_S)
        response.raise_for_status()
        return parse_sample(response.text, clock())
    except (httpx.HTTPError, MetricsFormatError, ValueError):
        return None


def _increase(new: Buckets, old: Buckets) -> Buckets:
    """Per-bucket increase; a counter reset (a restarted worker) counts from zero."""
    if len(new) != len(old) or any(n < o for (_, n), (_, o) in zip(new, old)):
        return new
    return tuple((le, n - o) for (le, n), (_, o) in zip(new, old))


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of cumulative buckets, linear within its bucket; None with no observation.
    One that falls in the +Inf bucket reads as the highest finite bound (Prometheus does the same)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def _merge(parts: Iterable[Buckets]) -> Buckets:
    merged: dict[float, float] = {}
    for part in parts:
        for le, count in part:
            merged[le] = merged.get(le, 0.0) + count
    return tuple(sorted(merged.items()))


class MetricsWindow:
    """Each serving pod's samples within the last `window_s` (and always its latest)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[PodSample]] = {}

    def add(self, pod: str, sample: PodSample) -> None:
        samples = self._samples.setdefault(pod, deque())
        samples.append(sample)
        while len(samples) > 1 and samples[0].at < sample.at - self.window_s:
            samples.popleft()

    def keep(self, pods: Iterable[str]) -> None:
        """Forget the pods not named: gone, draining, or no longer linked."""
        wanted = set(pods)
        for pod in [p for p in self._samples if p not in wanted]:
            del self._samples[pod]

    def _spans(self, pods: Sequence[str]) -> list[tuple[PodSample, PodSample]]:
        """(oldest, newest) in the window of each pod with at least two samples."""
        found = (self._samples.get(p) for p in pods)
        return [(s[0], s[-1]) for s in found if s is not None and len(s) > 1]

    def role_metrics(self, role: Role, own: Sequence[str], edge: Sequence[str]) -> RoleMetrics | None:
        """The role's `RoleMetrics` from its own pods (queue, KV) and the client edge's, the
        prefill pods (latency, token rates); None when none of its own pods has a sample."""
        latest = [s[-1] for p in own if (s := self._samples.get(p))]
        if not latest:
            return None
        edge_spans = self._spans(edge)
        latency = "ttft" if role == "prefill" else "tpot"  # the figure the role answers for
        merged = _merge(_increase(getattr(new, latency), getattr(old, latency)) for old, new in edge_spans)

        def rate(name: str) -> float:
            def increase(old: PodSample, new: PodSample) -> float:
                before, after = getattr(old, name), getattr(new, name)
                return after - before if after >= before else after  # a restart counts from zero
            return sum(increase(old, new) / (new.at - old.at) for old, new in edge_spans if new.at > old.at)

        edge_latest = [s[-1] for p in edge if (s := self._samples.get(p))]
        return RoleMetrics(
            scraped_at=min(s.at for s in latest + edge_latest),
            pods_reporting=len(latest),
            ttft_p90_s=quantile(QUANTILE, merged) if role == "prefill" else None,
            tpot_p90_s=quantile(QUANTILE, merged) if role == "decode" else None,
            requests_waiting=int(sum(s.waiting for s in latest)),
            requests_running=int(sum(s.running for s in latest)),
            kv_blocks_free=int(sum(s.kv_free for s in latest)),
            kv_blocks_total=int(sum(s.kv_total for s in latest)),
            prompt_tokens_per_s=rate("prompt_tokens"),
            generation_tokens_per_s=rate("generation_tokens"),
        )

