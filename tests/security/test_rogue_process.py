"""Real `disagg serve` processes, keyed, on loopback; a rogue process with no
key, another key or a stale credential gets nothing: every attempt refused
with the right code and counted, and the pair keeps serving with its free
blocks unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from disagg.workers.local import WorkerProcess, link, spawn_worker
from disagg.workers.security.key import ClusterKey

ROGUE = Path(__file__).with_name("rogue.py")
ENGINE_ARGS = ("--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128",
               "--served-model-name", "tiny")
STARTUP_S = 180.0


@pytest.fixture(scope="module")
def keyed_pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, ...]]:
    folder = tmp_path_factory.mktemp("keyed")
    key_file = folder / "cluster.key"
    ClusterKey.generate().write(key_file)
    workers = [spawn_worker(role, str(tiny_model_dir), folder / f"{role}.log", ENGINE_ARGS,
                            env={"OMP_NUM_THREADS": "1"}, key_file=key_file) for role in ("decode", "prefill")]
    try:
        for worker in workers:
            worker.wait_loaded(STARTUP_S)
        assert link(workers[0], workers[1]) is None
        yield tuple(workers)
    finally:
        codes = [w.stop(grace_s=20.0) for w in workers]
        assert codes == [0, 0], [w.log() for w in workers]


def _complete(prefill: WorkerProcess) -> list[int]:
    body = {"model": "tiny", "prompt": [5, 9, 13, 17], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def _rogue(decode: WorkerProcess, prefill: WorkerProcess, *extra: str) -> dict[str, str]:
    command = [sys.executable, str(ROGUE), "--decode", f"127.0.0.1:{decode.grpc_port}",
               "--prefill", f"127.0.0.1:{prefill.grpc_port}", "--prefill-transfer", prefill.transfer_address,
               "--decode-transfer", decode.transfer_address, "--decode-name", decode.instance_name, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_rogue_process_without_the_key_gets_nothing(keyed_pair: tuple[WorkerProcess, ...],
                                                       tmp_path: Path) -> None:
    decode, prefill = keyed_pair
    reference = _complete(prefill)
    free = [w.metric("disagg_kv_blocks_free") for w in keyed_pair]
    wrong = tmp_path / "wrong.key"
    ClusterKey.generate().write(wrong)
    for extra in ((), ("--key-file", str(wrong), "--stale-key-file", str(decode.key_file))):
        results = _rogue(decode, prefill, *extra)
        for attempt in ("link", "add_requests", "big_add_requests", "unlink", "stale_add_requests"):
            assert results.get(attempt, "UNAUTHENTICATED") == "UNAUTHENTICATED", (attempt, results)
        for attempt in ("pull_kv", "push_kv"):
            assert results[attempt].endswith("refused the link: authentication failed"), (attempt, results)
    grpc_failures = sum(w.metric("disagg_auth_failures_total", path="grpc") for w in keyed_pair)
    transfer_failures = sum(w.metric("disagg_auth_failures_total", path="transfer") for w in keyed_pair)
    assert (grpc_failures, transfer_failures) == (4 + 5, 2 + 2)
    assert [w.metric("disagg_kv_blocks_free") for w in keyed_pair] == free
    assert prefill.metric("disagg_links") == 1, "the real link survived"
    assert _complete(prefill) == reference


def test_insecure_is_said_at_start_and_in_health(keyed_pair: tuple[WorkerProcess, ...], tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    assert httpx.get(f"{keyed_pair[0].base_url}/health", timeout=10).json()["insecure"] is False
    worker = spawn_worker("decode", str(tiny_model_dir), tmp_path / "insecure.log", ENGINE_ARGS,
                          env={"OMP_NUM_THREADS": "1"}, key_file=None)
    try:
        worker.wait_loaded(STARTUP_S)
        assert httpx.get(f"{worker.base_url}/health", timeout=10).json()["insecure"] is True
        assert "INSECURE" in worker.log()
    finally:
        assert worker.stop(grace_s=20.0) == 0, worker.log()
