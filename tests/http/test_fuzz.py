"""Property-based fuzzing of the OpenAI API from the worker's own OpenAPI
document (schemathesis): valid and invalid bodies alike get no 5xx, and a
victim request running meanwhile is answered exactly as without them.

Bounded: a fixed number of examples per operation and a wall-clock budget;
`model` is set to the served one (otherwise nearly every body is a 404 that
stops at the first check) and `max_tokens` is capped so that valid requests
stay quick on a CPU.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

EXAMPLES_PER_OPERATION = 120
BUDGET_S = 60.0
MAX_TOKENS = 4
VICTIM = {"model": "tiny-llama", "prompt": "Hello world! How are", "max_tokens": 48, "temperature": 0,
          "ignore_eos": True}


def _tame(case: Case) -> None:
    if isinstance(case.body, dict):
        case.body["model"] = "tiny-llama"
        max_tokens = case.body.get("max_tokens")
        if isinstance(max_tokens, int):
            case.body["max_tokens"] = min(max_tokens, MAX_TOKENS)
        case.body.pop("max_completion_tokens", None)


def _victim(base_url: str) -> list[int]:
    body = {**VICTIM, "return_token_ids": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_and_leave_a_victim_unaffected(served: Any) -> None:
    schema = schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid document fails here
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    strategy = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                          for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    expected = _victim(served.base_url)
    failures: list[str] = []
    deadline = time.monotonic() + BUDGET_S
    calls = 0

    @settings(max_examples=EXAMPLES_PER_OPERATION * len(operations), deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case: Case) -> None:
        nonlocal calls
        if time.monotonic() > deadline:
            return
        _tame(case)
        response = case.call(base_url=served.base_url, timeout=60)
        calls += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {case.method} {case.path} {case.body!r}: {response.text[:300]}")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        victim = pool.submit(lambda: [_victim(served.base_url) for _ in range(3)])
        fuzz()
        victims = victim.result(timeout=300)
    assert not failures, "\n".join(failures[:10])
    assert calls >= 100, f"only {calls} fuzzed calls ran"
    assert all(tokens == expected for tokens in victims), "a fuzzed request changed a concurrent victim's answer"
    assert _victim(served.base_url) == expected, "the worker no longer serves correctly"
