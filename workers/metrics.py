"""The worker's Prometheus metrics. Their names are a contract (DESIGN.md).

Each server owns a `WorkerMetrics` with its own registry, so several servers
can live in one process (tests) without clashing in the global registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from disagg.proto.vocabulary import Role
from disagg.workers.pd.decision import Path

if TYPE_CHECKING:
    from disagg.workers.engine.async_engine import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds; from a tiny model on a GPU to a long prompt on a CPU.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RequestOutcome:
    """Values of the `status` label of disagg_requests_total (not the engine's RequestStatus)."""

    OK = "ok"  # finished by a stop condition or max_tokens
    REJECTED = "rejected"  # refused before it ran: bad input (4xx), over the admission limit, not ready
    ABORTED = "aborted"  # the client went away or the engine aborted it
    ERROR = "error"  # the server failed it


AUTH_PATHS = ("grpc", "http-link", "http-admin", "transfer", "api-key")


MIGRATION_REASONS = ("lost", "hung", "aborted", "idle")


class WorkerMetrics:
    """All metrics of one worker; `role` labels its request counter."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The process's CPU, memory and garbage-collector series, as Prometheus clients export by default.
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.time_to_first_token = Histogram(
            "disagg_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "disagg_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per sequence.",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "disagg_e2e_request_latency_seconds",
            "Time from a request's arrival to its last output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "disagg_kv_transfer_seconds",
            "Time to move one request's KV cache between prefill and decode.",
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "disagg_requests", "Requests by outcome.", ["role", "status"], registry=r
        )
        self.kv_transfer_bytes = Counter(
            "disagg_kv_transfer_bytes",
            "KV cache bytes moved, by direction (sent, received) and peer instance.",
            ["direction", "peer"],
            registry=r,
        )
        self.auth_failures = Counter(
            "disagg_auth_failures",
            "Calls and connections refused for a missing or wrong credential, by path: the cluster "
            "key's (grpc, http-link, http-admin, transfer) and the client API key's (api-key).",
            ["path"],
            registry=r,
        )
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("disagg_generation_tokens", "Output tokens generated.", registry=r)
        self.kv_blocks_total = Gauge("disagg_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_blocks_free = Gauge("disagg_kv_blocks_free", "KV cache blocks free.", registry=r)
        self.requests_running = Gauge("disagg_requests_running", "Requests being computed.", registry=r)
        self.requests_waiting = Gauge("disagg_requests_waiting", "Requests queued.", registry=r)
        # The Gateway API Inference Extension's KVCacheUtilization: used / total blocks, 0 to 1.
        self.kv_cache_usage = Gauge("disagg_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0 to 1).",
                                    registry=r)
        self.links = Gauge("disagg_links", "Prefill/decode links this worker holds.", registry=r)
        self.migrations = Counter(
            "disagg_request_migrations",
            "Streams a prefill moved to another decode when theirs failed them, by why "
            "(lost, hung, aborted, idle).", ["reason"], registry=r)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason=reason)
        # The contract's counter has the decision only (DESIGN.md); why each was made, beside it.
        self.pd_decisions = Counter(
            "disagg_pd_decision",
            "A prefill's choice per request: hand off to a decode, or serve it locally (workers/pd/decision.py).",
            ["decision"], registry=r)
        self.pd_decision_reasons = Counter(
            "disagg_pd_decision_reasons",
            "The prefill's choices per request (disagg_pd_decision_total) by why each was made.",
            ["decision", "reason"], registry=r)
        self.kv_transfer_skipped_blocks = Counter(
            "disagg_kv_transfer_skipped_blocks",
            "Prompt KV blocks not transferred because the decode's prefix cache already held them.", registry=r)
        # vLLM's prefix_cache_queries / prefix_cache_hits: the hit rate is hits / queries.
        self.prefix_cache_queries = Counter(
            "disagg_prefix_cache_queries",
            "Prompt tokens looked up in this worker's prefix cache (a prefill's prompts; a decode's reservations).",
            ["role"], registry=r)
        self.prefix_cache_hits = Counter(
            "disagg_prefix_cache_hits", "Prompt tokens found in this worker's prefix cache.", ["role"], registry=r)
        for family in (self.prefix_cache_queries, self.prefix_cache_hits):
            family.labels(role=role)  # shown as 0 from the start, so rate() works at once
        self.peers_unhealthy = Gauge(
            "disagg_peers_unhealthy",
            "Linked peers that stopped answering health checks (hung): no request goes there until they answer.",
            registry=r)
        self.draining = Gauge("disagg_draining", "1 while the worker drains (POST /drain), else 0.", registry=r)
        # Every outcome shows as 0 from the start, so rate() works at once.
        for status in (RequestOutcome.OK, RequestOutcome.REJECTED, RequestOutcome.ABORTED, RequestOutcome.ERROR):
            self.requests.labels(role=role, status=status)
        for path in AUTH_PATHS:
            self.auth_failures.labels(path=path)
        if role == Role.PREFILL:  # only a prefill chooses
            for decision in Path:
                self.pd_decisions.labels(decision=decision.value)

    def count_pd_decision(self, decision: str, reason: str) -> None:
        self.pd_decisions.labels(decision=decision).inc()
        self.pd_decision_reasons.labels(decision=decision, reason=reason).inc()

    def count_auth_failure(self, path: str) -> None:
        assert path in AUTH_PATHS, f"unknown auth path {path!r}"
        self.auth_failures.labels(path=path).inc()

    def count_request(self, status: str) -> None:
        self.requests.labels(role=self.role, status=status).inc()

    def observe_sequence(
        self,
        ttft_s: float | None,
        e2e_s: float,
        num_output_tokens: int,
        first_to_last_s: float,
    ) -> None:
        """Record one finished sequence (one choice of a request).

        Args:
            ttft_s: arrival to first token; None when no token came out.
            e2e_s: arrival to the end of the sequence.
            num_output_tokens: tokens the sequence generated.
            first_to_last_s: time from its first to its last token.
        """
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        if num_output_tokens > 1:
            self.time_per_output_token.observe(first_to_last_s / (num_output_tokens - 1))
        self.e2e_request_latency.observe(e2e_s)
        self.generation_tokens.inc(num_output_tokens)

    def count_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def observe_kv_transfer(self, direction: str, peer: str, num_bytes: int, seconds: float | None = None) -> None:
        """Count a transfer's bytes; `seconds` from the side that timed it (each transfer is timed once)."""
        assert direction in ("sent", "received"), f"unknown transfer direction {direction!r}"
        self.kv_transfer_bytes.labels(direction=direction, peer=peer).inc(num_bytes)
        if seconds is not None:
            self.kv_transfer_seconds.observe(seconds)

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.requests_running.set(stats.requests_running)
        self.requests_waiting.set(stats.requests_waiting)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        self.kv_cache_usage.set(used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)

    def add_vllm_aliases(self, model_name: str) -> None:
        """Also export the routing and latency series under vLLM's names, with its
        `model_name` label, so KEDA/HPA recipes written for vLLM work unchanged."""
        self.registry.register(VllmAliases({
            "vllm:num_requests_waiting": self.requests_waiting,
            "vllm:num_requests_running": self.requests_running,
            "vllm:kv_cache_usage_perc": self.kv_cache_usage,
            "vllm:time_to_first_token_seconds": self.time_to_first_token,
            "vllm:time_per_output_token_seconds": self.time_per_output_token,
            "vllm:e2e_request_latency_seconds": self.e2e_request_latency,
            "vllm:prompt_tokens": self.prompt_tokens,
            "vllm:generation_tokens": self.generation_tokens,
        }, model_name))

    def observe_prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prefix_cache_queries.labels(role=self.role).inc(prompt_tokens)
        self.prefix_cache_hits.labels(role=self.role).inc(hit_tokens)

    def set_links(self, n: int) -> None:
        self.links.set(n)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)



class VllmAliases(Collector):
    """Copies of our metrics under vLLM's names, read at scrape time from the
    originals, so an alias can never disagree with them."""

    def __init__(self, aliases: dict[str, Collector], model_name: str) -> None:
        self.aliases = aliases  # vLLM's family name -> our metric
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for alias, original in self.aliases.items():
            for family in original.collect():
                copy = Metric(alias, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    copy.add_sample(alias + sample.name[len(family.name):],
                                    {**sample.labels, "model_name": self.model_name},
                                    sample.value, sample.timestamp, sample.exemplar)
                yield copy
