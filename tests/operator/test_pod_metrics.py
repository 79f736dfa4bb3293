"""What the autoscaler reads from the workers (pod_metrics.py, scaler.py), offline: the workers' own
metrics code renders the /metrics text, served to the operator's HTTP client by an in-memory transport."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import generate_latest

from disagg.operator.autoscaler import HOLD_MISSING
from disagg.operator.pod_metrics import MetricsFormatError, MetricsWindow, PodSample, parse_sample, quantile
from disagg.operator.reconcile import PodView
from disagg.operator.scaler import Scaler
from disagg.operator.scaling import parse_scaling
from disagg.workers.engine.async_engine import EngineStats
from disagg.workers.metrics import WorkerMetrics


def _worker(role: str, ttfts: tuple[float, ...] = (), tpot_s: float | None = None, waiting: int = 0, running: int = 0,
            free: int = 100, total: int = 128, prompt_tokens: int = 0) -> WorkerMetrics:
    w = WorkerMetrics(role)
    for ttft in ttfts:
        w.observe_sequence(ttft, ttft + (tpot_s or 0.01) * 10, 11, (tpot_s or 0.01) * 10)
    w.count_prompt_tokens(prompt_tokens)
    w.set_engine_stats(EngineStats(kv_blocks_total=total, kv_blocks_free=free, requests_running=running,
                                   requests_waiting=waiting, num_preemptions=0))
    return w


def _text(w: WorkerMetrics) -> str:
    return generate_latest(w.registry).decode()


def test_a_workers_metrics_parse_into_a_sample() -> None:
    s = parse_sample(_text(_worker("decode", (0.2, 0.3), waiting=3, running=5, free=40, total=128,
                                   prompt_tokens=700)), at=12.0)
    assert (s.at, s.waiting, s.running, s.kv_free, s.kv_total, s.prompt_tokens) == (12.0, 3, 5, 40, 128, 700)
    assert s.generation_tokens == 22 and s.ttft[-1] == (math.inf, 2.0) and s.tpot[-1] == (math.inf, 2.0)


def test_text_that_is_not_a_workers_metrics_is_refused() -> None:
    with pytest.raises(MetricsFormatError, match="disagg_requests_waiting|waiting"):
        parse_sample("# HELP x y\n# TYPE x gauge\nx 1\n", at=0.0)


def test_quantile_interpolates_within_its_bucket() -> None:
    inf = math.inf
    assert quantile(0.9, ((0.1, 0.0), (0.5, 10.0), (inf, 10.0))) == pytest.approx(0.46)
    assert quantile(0.5, ((0.1, 5.0), (0.5, 10.0), (inf, 12.0))) == pytest.approx(0.1 + 0.4 * 1 / 5)
    assert quantile(0.9, ((0.1, 0.0), (inf, 4.0))) == 0.1  # beyond the last bound: the last bound
    assert quantile(0.9, ((0.1, 0.0), (inf, 0.0))) is None


def _sample(at: float, fast: float, slow: float, prompt: float, waiting: float = 0.0) -> PodSample:
    """TTFT buckets: `fast` observations at most 0.1 s, `slow` ones at most 1 s."""
    ttft = ((0.1, fast), (1.0, fast + slow), (math.inf, fast + slow))
    return PodSample(at, ttft, ttft, waiting, 1.0, 10.0, 20.0, prompt, 2 * prompt)


def test_the_window_reads_what_happened_in_it_not_since_start() -> None:
    window = MetricsWindow(window_s=30.0)
    window.add("p", _sample(0.0, fast=1000, slow=0, prompt=5000))  # a long, fast past
    window.add("p", _sample(40.0, fast=1000, slow=0, prompt=5000))
    window.add("p", _sample(50.0, fast=1000, slow=10, prompt=6000, waiting=4))  # ten slow ones, lately
    window.add("d", _sample(50.0, fast=0, slow=0, prompt=0))
    prefill = window.role_metrics("prefill", ["p"], ["p"])
    assert prefill is not None and prefill.ttft_p90_s is not None and prefill.ttft_p90_s > 0.1
    assert prefill.prompt_tokens_per_s == pytest.approx(1000 / 10)  # the sample at 0 s left the window
    assert (prefill.requests_waiting, prefill.pods_reporting, prefill.scraped_at) == (4, 1, 50.0)
    decode = window.role_metrics("decode", ["d"], ["p"])
    assert decode is not None and decode.tpot_p90_s == prefill.ttft_p90_s and decode.ttft_p90_s is None
    assert (decode.kv_blocks_free, decode.kv_blocks_total, decode.generation_tokens_per_s) == (10, 20, 200.0)


def test_a_restarted_worker_counts_from_zero_and_a_gone_one_is_forgotten() -> None:
    window = MetricsWindow(window_s=30.0)
    window.add("p", _sample(0.0, fast=50, slow=50, prompt=9000))
    window.add("p", _sample(10.0, fast=5, slow=0, prompt=100))  # restarted: counters went down
    m = window.role_metrics("prefill", ["p"], ["p"])
    assert m is not None and m.ttft_p90_s is not None and m.ttft_p90_s <= 0.1
    assert m.prompt_tokens_per_s == pytest.approx(10.0)
    window.keep([])
    assert window.role_metrics("prefill", ["p"], ["p"]) is None


def _view(name: str, role: str, ip: str, gate: bool = True) -> PodView:
    return PodView(name=name, uid=name, role=role, layout="", template="", ip=ip, phase="Running", running=True,
                   containers_ready=True, gate=gate, restarts=0, deleting=False, draining_since=None, created="")


def _serve(pods: dict[str, Callable[[], WorkerMetrics]]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        make = pods.get(request.url.host)
        return httpx.Response(503) if make is None else httpx.Response(200, text=_text(make()))
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


AUTO = parse_scaling({"autoscaler": {"prefill": {"minReplicas": 1, "maxReplicas": 3},
                                     "decode": {"minReplicas": 1, "maxReplicas": 3},
                                     "targets": {"ttftP90Ms": 50, "tpotP90Ms": 5},
                                     "scaleUpStabilizationSeconds": 0, "maxStep": 1}}).autoscaler


def test_the_scaler_scales_up_on_what_the_pods_report() -> None:
    """Slow first tokens over the window: the prefill role grows by one step; the status and the
    condition say why."""
    assert AUTO is not None
    load = {"n": 0}

    def prefill() -> WorkerMetrics:
        load["n"] += 5
        return _worker("prefill", (0.4,) * load["n"], tpot_s=0.001, waiting=6, running=2, prompt_tokens=100 * load["n"])

    views = [_view("p0", "prefill", "10.0.0.1"), _view("d0", "decode", "10.0.0.2"),
             _view("d1", "decode", "10.0.0.3", gate=False)]  # not linked: not read

    async def run() -> Scaler:
        scaler = Scaler(window_s=30.0, interval_s=1.0)
        async with _serve({"10.0.0.1": prefill, "10.0.0.2": lambda: _worker("decode", running=1)}) as http:
            for now in (100.0, 101.0):
                await scaler.run(http, AUTO, None, views, {"prefill": 1, "decode": 1},
                                 {"prefill": False, "decode": False}, now)
        return scaler

    scaler = asyncio.run(run())
    assert scaler.decision is not None
    p = scaler.decision.roles["prefill"]
    assert (p.outcome, p.desired) == ("scale-up", 2), p.reason
    assert scaler.role_status("prefill")["lastScaleTime"] != ""
    assert scaler.metrics_condition().ok
    assert scaler.latency_p90_s["prefill"] is not None and scaler.latency_p90_s["prefill"] > 0.05
    assert not scaler.due(101.5) and scaler.due(102.0)


def test_with_no_pod_to_read_the_scaler_holds_and_says_why() -> None:
    assert AUTO is not None

    async def run() -> Scaler:
        scaler = Scaler(window_s=30.0, interval_s=1.0)
        async with _serve({}) as http:  # every pod answers 503
            await scaler.run(http, AUTO, None, [_view("p0", "prefill", "10.0.0.1"), _view("d0", "decode", "10.0.0.2")],
                             {"prefill": 2, "decode": 2}, {"prefill": False, "decode": False}, 0.0)
        return scaler

    scaler = asyncio.run(run())
    assert scaler.decision is not None
    assert {r: (d.desired, d.hold) for r, d in scaler.decision.roles.items()} == {
        "prefill": (2, HOLD_MISSING), "decode": (2, HOLD_MISSING)}
    condition = scaler.metrics_condition()
    assert (condition.ok, condition.reason) == (False, "MetricsMissing")
    assert "prefill" in condition.message and "decode" in condition.message
