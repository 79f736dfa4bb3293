"""The operator on the real control plane, with the local kubelet running real `disagg serve` workers.

The first tests need only the control plane (the CRD's schema, one reconcile
pass run in-process, pods created and gated by the operator process). The
link tests need the PD roles of the workers (LinkInstance on the gRPC port).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.operator.controller import ClusterController, Deps
from disagg.operator.kube import KubeApi
from disagg.operator.links import LinkClient
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import pod_view
from disagg.operator.settings import OperatorSettings
from disagg.testing.cluster import LocalCluster, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
MODEL_NAME = "tiny-llama"


# ---- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    with config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)) as c:
        yield c


@pytest.fixture(scope="module")
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    """The DisaggCluster CRD, installed from the committed manifest's source, and established."""
    ext = client.ApiextensionsV1Api(api)
    try:
        ext.create_custom_resource_definition(crd.crd(), _request_timeout=10)
    except ApiException as e:
        if e.status != 409:
            raise

    def established() -> bool:
        got = ext.read_custom_resource_definition(f"{crd.PLURAL}.{crd.GROUP}", _request_timeout=10)
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])

    wait_until(established, 30, "the DisaggCluster CRD to be established")
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The builder lives in the engine tests' conftest (test folders are not packages).
    path = ROOT / "tests" / "engine" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_engine_conftest_for_operator", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def worker_path() -> Iterator[None]:
    """The kubelet runs `disagg` from PATH: put this virtualenv's bin first."""
    before = os.environ["PATH"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{before}"
    yield
    os.environ["PATH"] = before


@pytest.fixture
def operator(cluster: LocalCluster, custom: client.CustomObjectsApi, worker_path: None,
             tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`disagg operator` as its own process, standalone, from the admin kubeconfig."""
    log = tmp_path / "operator.log"
    env = {**os.environ, "DISAGG_OPERATOR_METRICS_PORT": "0", "DISAGG_OPERATOR_RESYNC_S": "2",
           "DISAGG_OPERATOR_LINK_TIMEOUT_S": "3"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.operator.main", "--standalone", "--liveness-port", "0",
             "--kubeconfig", str(cluster.admin_kubeconfig)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    sys.stderr.write(log.read_text(errors="replace")[-4000:])


def cluster_body(name: str, model: str, prefill: int = 1, decode: int = 1, **engine: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name},
        "spec": {"model": {"source": model, "servedName": MODEL_NAME}, "image": "local",
                 "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
                 "engine": {"device": "cpu", "dtype": "float32", "blockSize": 4, "numKvBlocks": 256,
                            "maxNumSeqs": 8, **engine},
                 "drain": {"timeoutSeconds": 30}},
    }


def create(custom: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = custom.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body, _request_timeout=10)
    return created


def read(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name,
                                                              _request_timeout=10)
    return got


def pods(core: client.CoreV1Api, namespace: str, role: str | None = None) -> list[dict[str, Any]]:
    selector = m.CLUSTER_LABEL + (f",{m.ROLE_LABEL}={role}" if role else "")
    items = core.api_client.sanitize_for_serialization(
        core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=10).items)
    return list(items)


# ---- the schema ----------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ({"prefill": {"replicas": 1}}, "spec.model: Required value"),
    ({"model": {"source": "m"}, "decode": {"replicas": -1}}, "spec.decode.replicas"),
    ({"model": {"source": "m"}, "decode": {"replicas": "two"}}, "spec.decode.replicas"),
    ({"model": {"source": "m"}, "kvTransfer": {"transport": "rdma"}}, 'Unsupported value: "rdma"'),
    ({"model": {"source": "m"}, "engine": {"blockSize": 0}}, "spec.engine.blockSize"),
])
def test_invalid_resources_are_refused_by_the_api_server(custom: client.CustomObjectsApi, namespace: str,
                                                         spec: dict[str, Any], message: str) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "bad"}, "spec": spec}
    with pytest.raises(ApiException) as err:
        create(custom, namespace, body)
    assert err.value.status == 422
    assert message in json.loads(err.value.body)["message"]


def test_defaults_are_filled_in_by_the_api_server(custom: client.CustomObjectsApi, namespace: str) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "d"},
            "spec": {"model": {"source": "m"}}}
    got = create(custom, namespace, body)["spec"]
    assert got["prefill"]["replicas"] == 1 and got["kvTransfer"] == {"mode": "PUSH", "transport": "tcp"}
    assert got["engine"]["blockSize"] == 16 and got["drain"]["timeoutSeconds"] == 60


# ---- one pass, in-process --------------------------------------------------------


def test_a_second_reconcile_writes_nothing(cluster: LocalCluster, custom: client.CustomObjectsApi,
                                          core: client.CoreV1Api, namespace: str) -> None:
    """Idempotence: after one pass has created everything, the next pass over
    the same state makes no API write."""
    import kopf

    # No worker ever starts (the command does not exist here): the state holds still between passes.
    body = cluster_body("idem", "m", prefill=1, decode=2)
    body["spec"]["decode"]["env"] = [{"name": "PATH", "value": "/nonexistent"}]
    body["spec"]["prefill"]["env"] = [{"name": "PATH", "value": "/nonexistent"}]
    create(custom, namespace, body)
    events: list[tuple[str, str]] = []

    async def passes() -> tuple[int, int, int]:
        with config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)) as api:
            kube = KubeApi(api)
            deps = Deps(settings=OperatorSettings(), kube=kube, links=LinkClient(timeout_s=2.0),
                        http=httpx.AsyncClient(timeout=2.0), metrics=OperatorMetrics(),
                        post_event=lambda _b, kind, reason, _m: events.append((kind, reason)))
            controller = ClusterController(namespace, "idem", deps)

            async def one_pass() -> int:
                before = kube.writes
                views = [pod_view(p) for p in pods(core, namespace)]
                await controller.reconcile(kopf.Body(read(custom, namespace, "idem")), views)
                return kube.writes - before

            first = await one_pass()
            second = await one_pass()  # sees the pods the first made: writes the status
            third = await one_pass()
            await deps.links.close()
            await deps.http.aclose()
            return first, second, third

    first, second, third = asyncio.run(passes())
    assert first >= 4  # the Service, three pods, the status
    assert third == 0, f"the third pass wrote {third} times"
    names = sorted(p["metadata"]["name"] for p in pods(core, namespace))
    assert len(names) == 3, names
    status = read(custom, namespace, "idem")["status"]
    assert status["decodeReady"] == "0/2" and status["links"]["desired"] == 0


# ---- the operator process ---------------------------------------------------------


def test_operator_creates_gated_pods_and_the_service(operator: subprocess.Popen[bytes], custom: client.CustomObjectsApi,
                                                     core: client.CoreV1Api, namespace: str, tiny_model: Path) -> None:
    created = create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: len(pods(core, namespace)) == 2 or None, WAIT_S, "two worker pods")
    for pod in pods(core, namespace):
        assert pod["spec"]["readinessGates"] == [{"conditionType": m.LINKED_GATE}]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        gate = [c for c in pod["status"].get("conditions") or [] if c["type"] == m.LINKED_GATE]
        ready = [c for c in pod["status"].get("conditions") or [] if c["type"] == "Ready"]
        # Nothing is Ready before its links are made.
        assert not (ready and ready[0]["status"] == "True" and not (gate and gate[0]["status"] == "True"))
    svc = core.read_namespaced_service("llm", namespace, _request_timeout=10)
    assert svc.spec.selector == {m.CLUSTER_LABEL: "llm", m.ROLE_LABEL: "prefill"}

    def status() -> dict[str, Any] | None:
        s: dict[str, Any] | None = read(custom, namespace, "llm").get("status")
        return s if s and s.get("observedGeneration") == created["metadata"]["generation"] else None

    s = wait_until(status, WAIT_S, "the operator's status")
    assert s["endpoint"] == f"http://llm.{namespace}.svc:8000/v1"
    assert {c["type"] for c in s["conditions"]} == {"Available", "Progressing", "Degraded", "LinksReady"}
    # Scaling down before anything is linked deletes the surplus pod.
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"decode": {"replicas": 0}}}, _request_timeout=10)
    wait_until(lambda: not pods(core, namespace, "decode") or None, WAIT_S, "the decode pod to go")


# ---- links (need the PD roles of the workers) ---------------------------------------


def _linked(custom: client.CustomObjectsApi, namespace: str, name: str, prefill: int, decode: int) -> bool:
    s = read(custom, namespace, name).get("status") or {}
    return (s.get("available") == "True" and s.get("prefillReady") == f"{prefill}/{prefill}"
            and s.get("decodeReady") == f"{decode}/{decode}"
            and s.get("links", {}).get("established") == prefill * decode)


def _chat(pod_ip: str) -> str:
    r = httpx.post(f"http://{pod_ip}:{m.HTTP_PORT}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def test_cluster_links_serves_and_scales(operator: subprocess.Popen[bytes], custom: client.CustomObjectsApi,
                                         core: client.CoreV1Api, namespace: str, tiny_model: Path) -> None:
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _linked(custom, namespace, "llm", 1, 1), WAIT_S, "one prefill and one decode, linked")
    (prefill,) = pods(core, namespace, "prefill")
    ready = {c["type"]: c["status"] for c in prefill["status"]["conditions"]}
    assert ready["Ready"] == "True" and ready[m.LINKED_GATE] == "True"
    answer = _chat(prefill["status"]["podIP"])
    assert isinstance(answer, str)

    # Decode 1 -> 2: the new decode is linked to the prefill.
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"decode": {"replicas": 2}}}, _request_timeout=10)
    wait_until(lambda: _linked(custom, namespace, "llm", 1, 2), WAIT_S, "two decodes linked")
    assert _chat(prefill["status"]["podIP"]) == answer  # greedy: the same text on either decode

    # Decode 2 -> 1: one is drained and deleted; the prefill keeps serving.
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"decode": {"replicas": 1}}}, _request_timeout=10)
    wait_until(lambda: len(pods(core, namespace, "decode")) == 1 and _linked(custom, namespace, "llm", 1, 1),
               WAIT_S, "back to one decode")
    assert _chat(prefill["status"]["podIP"]) == answer
    reasons = {e.reason for e in core.list_namespaced_event(namespace, _request_timeout=10).items}
    assert {"Draining", "Drained"} <= reasons


def test_layout_mismatch_never_links(operator: subprocess.Popen[bytes], custom: client.CustomObjectsApi,
                                     core: client.CoreV1Api, namespace: str, tiny_model: Path) -> None:
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _linked(custom, namespace, "llm", 1, 1), WAIT_S, "one prefill and one decode, linked")
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"engine": {"blockSize": 8}, "decode": {"replicas": 2}}},
                                          _request_timeout=10)

    def degraded() -> bool:
        s = read(custom, namespace, "llm").get("status") or {}
        return any(c["type"] == "Degraded" and c["reason"] == "LayoutMismatch" for c in s.get("conditions", []))

    wait_until(degraded, WAIT_S, "a LayoutMismatch condition")
    s = read(custom, namespace, "llm")["status"]
    assert s["links"]["established"] == 1  # the old pair only
    reasons = {e.reason for e in core.list_namespaced_event(namespace, _request_timeout=10).items}
    assert "LayoutMismatch" in reasons
