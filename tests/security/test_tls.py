"""Mutual TLS on real `disagg serve` processes: a keyed PD pair serves through TLS on gRPC
and the TCP KV transfer; plaintext callers and callers with another CA's certificate are
refused, and the pair keeps serving the same tokens."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from disagg.testing.pki import write_tls_folder
from disagg.workers.local import WorkerProcess, link, spawn_worker
from disagg.workers.pd.commands import link_call
from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import TLS_SERVER_NAME, TlsFiles

ENGINE_ARGS = ("--device", "cpu", "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128",
               "--served-model-name", "tiny")
STARTUP_S = 180.0
BODY = {"model": "tiny", "prompt": [5, 9, 13, 17, 21, 25, 29], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def tls_pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[WorkerProcess, WorkerProcess, TlsFiles]]:
    folder = tmp_path_factory.mktemp("tls")
    key_file = folder / "cluster.key"
    ClusterKey.generate().write(key_file)
    tls = write_tls_folder(folder / "certs", [TLS_SERVER_NAME])
    workers = [spawn_worker(role, str(tiny_model_dir), folder / f"{role}.log", ENGINE_ARGS,
                            env={"OMP_NUM_THREADS": "1"}, key_file=key_file, tls_dir=tls)
               for role in ("decode", "prefill")]
    try:
        for worker in workers:
            worker.wait_loaded(STARTUP_S)
        yield workers[0], workers[1], TlsFiles.from_folder(tls)
    finally:
        codes = [w.stop(grace_s=20.0) for w in workers]
        assert codes == [0, 0], [w.log() for w in workers]


def _tokens(prefill: WorkerProcess) -> list[int]:
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=BODY, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def _link(decode: WorkerProcess, prefill: WorkerProcess, tls: TlsFiles | None) -> str | None:
    return link_call(decode.instance_name, prefill.instance_name, prefill.transfer_port, 10.0,
                     decode.cluster_key, tls)


def test_a_pd_pair_serves_through_tls_and_refuses_plaintext_and_strangers(
        tls_pair: tuple[WorkerProcess, WorkerProcess, TlsFiles], tmp_path: Path) -> None:
    decode, prefill, tls = tls_pair
    # The gRPC port speaks only TLS: a plaintext call, or one with another CA's certificate, fails.
    assert _link(decode, prefill, None) is not None
    stranger = TlsFiles.from_folder(write_tls_folder(tmp_path / "other-ca", [TLS_SERVER_NAME]))
    assert _link(decode, prefill, stranger) is not None
    assert decode.metric("disagg_links") == 0
    assert link(decode, prefill) is None  # the decode opens its TLS transfer connections to the prefill
    tokens = _tokens(prefill)
    assert len(tokens) == BODY["max_tokens"]
    assert prefill.metric("disagg_kv_transfer_bytes_total") > 0 or decode.metric("disagg_kv_transfer_bytes_total") > 0
    free = [w.metric("disagg_kv_blocks_free") for w in (decode, prefill)]

    # The transfer port: a plaintext HELLO and a stranger's certificate both fail the TLS handshake.
    before = prefill.metric("disagg_auth_failures_total", path="transfer")
    host, port = prefill.transfer_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        plain.sendall(b"DSGT" + bytes(60))
        try:
            assert plain.recv(64) == b"", "the listener answered a plaintext peer"
        except ConnectionResetError:
            pass
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            with stranger.client_context().wrap_socket(raw, server_hostname=TLS_SERVER_NAME) as wrapped:
                wrapped.recv(1)  # TLS 1.3 reports a refused client certificate on the first read
    assert prefill.metric("disagg_auth_failures_total", path="transfer") == before + 2
    # Nothing was touched: the pair serves the same tokens, its free blocks unchanged.
    assert [w.metric("disagg_kv_blocks_free") for w in (decode, prefill)] == free
    assert _tokens(prefill) == tokens


def test_unusable_tls_files_stop_the_worker_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "cluster.key"
    ClusterKey.generate().write(key_file)
    (tmp_path / "certs").mkdir()
    worker = spawn_worker("decode", str(tiny_model_dir), tmp_path / "decode.log", ENGINE_ARGS, key_file=key_file,
                          tls_dir=tmp_path / "certs")
    assert worker.process.wait(timeout=120) == 2
    assert "tls.crt" in worker.log()
