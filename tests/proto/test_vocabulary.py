"""One source for each word: every place that offers a vocabulary word takes it from disagg.proto.vocabulary."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from disagg.operator import crd, manifests
from disagg.operator.links import Endpoint
from disagg.operator.spec import parse_spec
from disagg.proto import vocabulary as v
from disagg.workers.args import add_serve_arguments
from disagg.workers.config import ServerConfig
from disagg.workers.pd.commands import add_link_arguments


def serve_choices() -> dict[str, list[str]]:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return {a.option_strings[0]: list(a.choices) for a in p._actions if a.choices is not None}


def crd_spec() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_transport_names_are_the_transfer_registry() -> None:
    from disagg.workers.transfer import TRANSPORTS

    assert set(TRANSPORTS) == set(v.TRANSPORTS), "a transport registered without a vocabulary name, or the reverse"
    assert serve_choices()["--kv-transport"] == list(v.TRANSPORTS)
    assert crd_spec()["kvTransfer"]["properties"]["transport"]["enum"] == list(v.TRANSPORTS)


def test_transfer_modes_are_one_enum_on_the_wire_cli_and_crd() -> None:
    from disagg.workers.pd.messages import TransferMode

    assert TransferMode is v.TransferMode
    assert serve_choices()["--kv-transfer-mode"] == list(v.TRANSFER_MODES) == ["PUSH", "PULL"]
    assert crd_spec()["kvTransfer"]["properties"]["mode"]["enum"] == list(v.TRANSFER_MODES)


@pytest.mark.parametrize("flag, key, words", [("--device", "device", v.DEVICES), ("--dtype", "dtype", v.DTYPES)])
def test_devices_and_dtypes_are_the_same_list_in_the_same_order(flag: str, key: str, words: tuple[str, ...]) -> None:
    from disagg.workers.engine.config import EngineConfig

    assert serve_choices()[flag] == list(words)
    assert crd_spec()["engine"]["properties"][key]["enum"] == list(words)
    for word in words:
        EngineConfig(model="m", **{key: word})  # each word is one the engine accepts
    with pytest.raises(ValueError, match=key):
        EngineConfig(model="m", **{key: "tpu"})


def test_default_ports_are_the_workers_the_pods_and_disagg_links() -> None:
    server = ServerConfig()
    assert (server.http_port, server.grpc_port, server.transfer_port, server.admin_port) == (
        v.HTTP_PORT, v.GRPC_PORT, v.TRANSFER_PORT, v.ADMIN_PORT)
    pod = manifests.worker_pod_spec("decode", parse_spec({"model": {"source": "m"}}))
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"http": v.HTTP_PORT, "grpc": v.GRPC_PORT, "transfer": v.TRANSFER_PORT, "admin": v.ADMIN_PORT}
    link = argparse.ArgumentParser()
    add_link_arguments(link)
    args = link.parse_args(["--decode", "a:1", "--prefill", "b:2"])
    assert args.prefill_transfer_port is None and args.decode_transfer_port is None  # asked of the workers
    assert crd_spec()["service"]["properties"]["port"]["default"] == v.HTTP_PORT


def test_the_connection_bound_is_the_workers_and_the_crds() -> None:
    ServerConfig(kv_connections=v.MAX_KV_CONNECTIONS)
    with pytest.raises(ValueError, match="kv_connections"):
        ServerConfig(kv_connections=v.MAX_KV_CONNECTIONS + 1)
    assert crd_spec()["kvTransfer"]["properties"]["connections"]["maximum"] == v.MAX_KV_CONNECTIONS


def test_the_operators_cluster_info_is_what_a_worker_parses() -> None:
    info = Endpoint(pod="p", incarnation="u/0", ip="10.1.2.3", grpc_port=7000, transfer_port=27000).cluster_info()
    assert info.cluster_ids == [(10 << 56 | 1 << 48 | 2 << 40 | 3 << 32) | 27000]
    parsed = v.InstanceInfo.from_proto(info)
    assert parsed == v.InstanceInfo("10.1.2.3:7000", "10.1.2.3:27000")
    # A peer that sends only the cluster_id (as xLLM may) is decoded to the same address.
    del info.addrs[:]
    assert v.InstanceInfo.from_proto(info) == parsed
    assert v.address_of_cluster_id(v.cluster_id("192.168.0.9:26000")) == "192.168.0.9:26000"
    with pytest.raises(ValueError, match="no valid port"):
        v.address_of_cluster_id(v.cluster_id("10.0.0.1:1") - 1)


def test_metrics_outcomes_and_engine_stats_have_one_name_each() -> None:
    from disagg.workers import metrics
    from disagg.workers.engine.async_engine import EngineStats
    from disagg.workers.engine.request import RequestStatus

    assert not hasattr(metrics, "EngineStats") and not hasattr(metrics, "RequestStatus")
    assert metrics.RequestOutcome is not RequestStatus
    m = metrics.WorkerMetrics("decode")
    m.set_engine_stats(EngineStats(kv_blocks_total=8, kv_blocks_free=3, requests_running=2, requests_waiting=1,
                                   num_preemptions=0))
    text = m.render().decode()
    assert "disagg_kv_blocks_free 3.0" in text and "disagg_requests_waiting 1.0" in text


def _imports_without(blocked: tuple[str, ...], modules: list[str]) -> subprocess.CompletedProcess[str]:
    """Import `modules` in a fresh interpreter in which importing any of `blocked` fails."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {blocked!r}:
            sys.modules[name] = None  # `import name` now raises ImportError
        for name in {modules!r}:
            importlib.import_module(name)
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_vocabulary_imports_neither_torch_nor_grpc_nor_kopf() -> None:
    done = _imports_without(("torch", "grpc", "kopf"), ["disagg.proto.vocabulary"])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
