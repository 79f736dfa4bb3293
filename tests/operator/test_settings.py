"""The operator's settings from DISAGG_OPERATOR_* variables, and an idempotent startup."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
import yaml
from kubernetes.config.config_exception import ConfigException

from disagg.operator import handlers
from disagg.operator.main import add_arguments, run_operator
from disagg.operator.settings import PREFIX, OperatorSettings, configure


def test_every_kind_of_setting_parses() -> None:
    s = OperatorSettings.from_env({
        PREFIX + "NAMESPACE": "team-a, team-b", PREFIX + "PRIORITY": "7", PREFIX + "RESYNC_S": "2.5",
        PREFIX + "WORKER_SECURITY_CONTEXT": '{"capabilities": {"drop": ["ALL"]}}',
        PREFIX + "WORKER_POD_SECURITY_CONTEXT": '{"runAsUser": 65532}',
    })
    assert s.namespace == ("team-a", "team-b") and s.priority == 7 and s.resync_s == 2.5
    assert s.worker_security_context == {"capabilities": {"drop": ["ALL"]}}
    assert s.worker_pod_security_context == {"runAsUser": 65532}


@pytest.mark.parametrize("name, raw, message", [
    ("RESYNC_S", "soon", "DISAGG_OPERATOR_RESYNC_S='soon' is invalid"),
    ("RESYNC_S", "0", "must be positive"),
    ("WORKER_SECURITY_CONTEXT", "[1]", "expected a JSON object"),
    ("WORKER_POD_SECURITY_CONTEXT", "{not json", "DISAGG_OPERATOR_WORKER_POD_SECURITY_CONTEXT"),
    ("PRIORITY", str(2**40), "must fit in 32 bits"),
    ("AUTOSCALER_WINDOW_S", "20", "must be at least twice DISAGG_OPERATOR_AUTOSCALER_INTERVAL_S"),  # 15 s apart
])
def test_bad_settings_name_the_variable(name: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OperatorSettings.from_env({PREFIX + name: raw})


def test_namespace_flags_win_over_the_setting() -> None:
    s = OperatorSettings(namespace=("team-a",))
    assert s.watched(["x", "y"]) == ("x", "y")
    assert s.watched([]) == ("team-a",)
    assert OperatorSettings().watched([]) == ()


def test_replicas_without_a_priority_never_tie() -> None:
    drawn = {OperatorSettings().peering_priority() for _ in range(20)}
    assert len(drawn) > 1 and all(p > 0 for p in drawn)
    assert OperatorSettings(priority=5).peering_priority() == 5


def test_configure_sets_peering_scope_and_priority() -> None:
    k = kopf.OperatorSettings()
    configure(k, OperatorSettings(), ["team-a"], standalone=False, priority=42)
    assert not k.peering.clusterwide and k.peering.priority == 42 and not k.peering.standalone
    assert k.peering.name == "disagg-operator" and k.persistence.finalizer == "disagg.dev/finalizer"
    configure(k, OperatorSettings(peering=""), [], standalone=False, priority=1)
    assert k.peering.clusterwide and k.peering.standalone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_retried_startup_binds_the_metrics_port_once(tmp_path: Path) -> None:
    port = _free_port()
    memo = kopf.Memo(settings=OperatorSettings(metrics_port=port), namespaces=(), standalone=True, priority=1,
                     kubeconfig=str(tmp_path / "missing"))
    # The API client fails first (no kubeconfig yet): nothing is bound, so kopf's retry can succeed.
    with pytest.raises(ConfigException):
        await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
                  "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
                  "users": [{"name": "u", "user": {"token": "t"}}],
                  "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
    (tmp_path / "missing").write_text(yaml.safe_dump(kubeconfig))
    await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
    state = memo.state
    await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)  # a second run changes nothing
    assert memo.state is state
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    assert "disagg_operator_reconcile_duration_seconds" in text
    await handlers.cleanup(memo=memo)


def test_an_unreadable_kubeconfig_or_a_bad_port_stops_the_operator_at_once(tmp_path: Path, capsys: Any) -> None:
    """kopf would retry a missing kubeconfig every minute, for ever."""
    assert run_operator([], kubeconfig=str(tmp_path / "missing")) == 2
    assert "cannot read the kubeconfig" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--liveness-port", "70000"])
    assert parser.parse_args(["--liveness-port", "0"]).liveness_port == 0
