"""`disagg serve --vllm-metric-aliases`: the routing and latency series under
vLLM's names, equal to ours at every scrape, under load on a real worker; and
nothing under vLLM's names without the flag."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import MODEL_NAME, ServedWorker

CONCURRENT = 6
ALIASES = {  # vLLM's sample -> ours
    "vllm:num_requests_waiting": "disagg_requests_waiting",
    "vllm:num_requests_running": "disagg_requests_running",
    "vllm:kv_cache_usage_perc": "disagg_kv_cache_usage_ratio",
    "vllm:time_to_first_token_seconds_count": "disagg_time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count": "disagg_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "disagg_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "disagg_e2e_request_latency_seconds_sum",
    "vllm:prompt_tokens_total": "disagg_prompt_tokens_total",
    "vllm:generation_tokens_total": "disagg_generation_tokens_total",
}


def _samples(client: httpx.Client) -> dict[str, tuple[dict[str, str], float]]:
    """Unbucketed samples of one scrape, by name (with their labels)."""
    text = client.get("/metrics").text
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if "le" not in s.labels}


def _chat(base_url: str, tokens: int) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120.0).raise_for_status()


def test_aliases_equal_ours_under_load(worker_launcher: Callable[..., AbstractContextManager[ServedWorker]],
                                       tiny_model_dir: Path, tmp_path: Path) -> None:
    with worker_launcher(str(tiny_model_dir), tmp_path / "worker.log", "--vllm-metric-aliases",
                         "--max-num-seqs", "4", "--block-size", "4") as worker, \
            httpx.Client(base_url=worker.base_url, timeout=30.0) as client:
        load = [threading.Thread(target=_chat, args=(worker.base_url, 48)) for _ in range(CONCURRENT)]
        for t in load:
            t.start()
        busy = []
        while any(t.is_alive() for t in load):
            scrape = _samples(client)
            for alias, ours in ALIASES.items():
                labels, value = scrape[alias]
                assert labels.get("model_name") == MODEL_NAME, (alias, labels)
                assert value == scrape[ours][1], f"{alias} = {value}, {ours} = {scrape[ours][1]}"
            busy.append((scrape["vllm:num_requests_running"][1], scrape["vllm:kv_cache_usage_perc"][1]))
        for t in load:
            t.join(timeout=120.0)
        after = _samples(client)
    assert any(running > 0 and usage > 0 for running, usage in busy), f"no scrape saw the load: {busy}"
    assert max(running for running, _ in busy) <= 4, "running is bounded by --max-num-seqs"
    assert after["vllm:e2e_request_latency_seconds_count"][1] == CONCURRENT
    assert after["vllm:time_to_first_token_seconds_count"][1] == CONCURRENT
    assert after["vllm:num_requests_running"][1] == 0 and after["vllm:kv_cache_usage_perc"][1] == 0


def test_no_vllm_names_without_the_flag(http: httpx.Client) -> None:
    assert "vllm:" not in http.get("/metrics").text
