"""The operator on the real control plane, with the local kubelet running real `disagg serve` workers.

The first tests need only the control plane (the CRD's schema, one reconcile
pass run in-process, pods created and gated by the operator process). The
link tests need the PD roles of the workers (LinkInstance on the gRPC port).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import kopf
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.operator.controller import ClusterController, Deps
from disagg.operator.kube import KubeApi
from disagg.operator.link_client import LinkClient
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import pod_view
from disagg.operator.settings import OperatorSettings
from disagg.proto import disagg_pd_pb2, disagg_pd_pb2_grpc
from disagg.testing.cluster import LocalCluster, wait_until
from disagg.workers.local import free_port
from disagg.testing.kubelet import HOSTNAME_LABEL, LocalKubelet
from disagg.testing.operator_process import OperatorProcess, sample
from disagg.testing.rest import Obj
from disagg.testing.pki import write_tls_folder
from disagg.workers.security.control import METADATA_KEY
from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import TLS_SERVER_NAME

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
MODEL_NAME = "tiny-llama"
LINK_METHOD = "/xllm.proto.DisaggPDService/LinkInstance"


def worker_metric(pod: dict[str, Any], name: str) -> float:
    text = httpx.get(f"http://{pod['status']['podIP']}:{m.HTTP_PORT}/metrics", timeout=5).text
    return sample(text, name)


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
    return cast(dict[str, Any], custom.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body, _request_timeout=10))


def read(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    return cast(dict[str, Any], custom.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name, _request_timeout=10))


def pods(core: client.CoreV1Api, namespace: str, role: str | None = None) -> list[dict[str, Any]]:
    selector = m.CLUSTER_LABEL + (f",{m.ROLE_LABEL}={role}" if role else "")
    items = core.api_client.sanitize_for_serialization(
        core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=10).items)
    return list(items)


# ---- the schema ----------------------------------------------------------------

_AUTO: dict[str, Any] = {"prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 2}, "targets": {"ttftP90Ms": 500, "tpotP90Ms": 50}}


@pytest.mark.parametrize("spec, message", [
    ({"prefill": {"replicas": 1}}, "spec.model: Required value"),
    ({"model": {"source": "m"}, "decode": {"replicas": -1}}, "spec.decode.replicas"),
    ({"model": {"source": "m"}, "decode": {"replicas": "two"}}, "spec.decode.replicas"),
    ({"model": {"source": "m"}, "kvTransfer": {"transport": "rdma"}}, 'Unsupported value: "rdma"'),
    ({"model": {"source": "m"}, "engine": {"blockSize": 0}}, "spec.engine.blockSize"),
    # spec.scaling: what its schema refuses at apply (docs/autoscaling.md)
    ({"model": {"source": "m"}, "scaling": {"autoscaler": {**_AUTO, "targets": {"ttftP90Ms": 0, "tpotP90Ms": 50}}}},
     "spec.scaling.autoscaler.targets.ttftP90Ms"),
    ({"model": {"source": "m"}, "scaling": {"autoscaler": {**_AUTO, "scaleDownStabilizationSeconds": 4000}}},
     "spec.scaling.autoscaler.scaleDownStabilizationSeconds"),
    ({"model": {"source": "m"}, "scaling": {"autoscaler": {**_AUTO, "maxStep": 0}}}, "spec.scaling.autoscaler.maxStep"),
    ({"model": {"source": "m"}, "scaling": {"autoscaler": {**_AUTO, "decode": {"minReplicas": -1, "maxReplicas": 2}}}},
     "spec.scaling.autoscaler.decode.minReplicas"),
    ({"model": {"source": "m"}, "scaling": {"ratio": {"minPrefillPerDecode": "half", "maxPrefillPerDecode": "1"}}},
     "spec.scaling.ratio.minPrefillPerDecode"),
    ({"model": {"source": "m"}, "scaling": {"ratio": {"minPrefillPerDecode": "0", "maxPrefillPerDecode": "0"}}},
     "must be above 0 and at most 1000"),
    ({"model": {"source": "m"}, "scaling": {"ratio": {"minPrefillPerDecode": "1", "maxPrefillPerDecode": "5000"}}},
     "must be above 0 and at most 1000"),
    # what only a rule across fields catches
    ({"model": {"source": "m"}, "scaling": {"autoscaler": {**_AUTO, "prefill": {"minReplicas": 5, "maxReplicas": 2}}}},
     "minReplicas must not be above maxReplicas"),
    ({"model": {"source": "m"}, "scaling": {"ratio": {"minPrefillPerDecode": "4", "maxPrefillPerDecode": "1.5"}}},
     "minPrefillPerDecode must not be above maxPrefillPerDecode"),
    # pod fields: refused here, not by every pod creation after the apply
    ({"model": {"source": "m"}, "prefill": {"resources": {"limits": {"cpu": "lots"}}}},
     "spec.prefill.resources.limits.cpu"),
    ({"model": {"source": "m"}, "decode": {"tolerations": [{"key": "gpu", "operator": "Maybe"}]}},
     'Unsupported value: "Maybe"'),
    ({"model": {"source": "m"}, "decode": {"priorityClassName": "Not Valid"}}, "spec.decode.priorityClassName"),
    ({"model": {"source": "m"}, "security": {"apiKeySecretName": "Bad_Name"}}, "spec.security.apiKeySecretName"),
])
def test_invalid_resources_are_refused_by_the_api_server(custom: client.CustomObjectsApi, namespace: str,
                                                         spec: dict[str, Any], message: str) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "bad"}, "spec": spec}
    with pytest.raises(ApiException) as err:
        create(custom, namespace, body)
    assert err.value.status == 422 and err.value.body is not None, "a 422 with the API server's explanation"
    assert message in json.loads(err.value.body)["message"]


@pytest.mark.parametrize("name", ["dotted.name", "9lives", "x" * 48])
def test_names_that_cannot_name_the_service_are_refused(custom: client.CustomObjectsApi, namespace: str,
                                                        name: str) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": {"source": "m"}}}
    with pytest.raises(ApiException) as err:
        create(custom, namespace, body)
    assert err.value.status == 422 and "metadata.name" in json.loads(err.value.body)["message"]
    body["metadata"]["name"] = "x" * 47  # the longest that leaves room for the pods' names
    create(custom, namespace, body)


def test_quantities_and_tolerations_pass_as_in_a_pod(custom: client.CustomObjectsApi, namespace: str) -> None:
    body = cluster_body("typed", "m")
    body["spec"]["decode"] |= {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2}},
                               "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    got = create(custom, namespace, body)["spec"]["decode"]
    assert got["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2}}
    assert got["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_defaults_are_filled_in_by_the_api_server(custom: client.CustomObjectsApi, namespace: str) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "d"},
            "spec": {"model": {"source": "m"}}}
    got = create(custom, namespace, body)["spec"]
    assert got["prefill"]["replicas"] == 1
    assert got["kvTransfer"] == {"mode": "PUSH", "transport": "tcp", "policy": "always", "checksum": "auto"}
    assert got["security"] == {"insecure": False, "allowAnonymousPeers": False, "apiKeySecretKey": "key"}
    assert got["engine"]["blockSize"] == 16 and got["drain"]["timeoutSeconds"] == 60


# ---- one pass, in-process --------------------------------------------------------


def test_a_second_reconcile_writes_nothing(cluster: LocalCluster, custom: client.CustomObjectsApi,
                                          core: client.CoreV1Api, namespace: str) -> None:
    """Idempotence: after one pass has created everything, the next pass over
    the same state makes no API write."""
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
                await controller.reconcile(kopf.Body(cast(kopf.RawBody, read(custom, namespace, "idem"))), views)
                return kube.writes - before

            first = await one_pass()
            second = await one_pass()  # sees the pods the first made: writes the status
            third = await one_pass()
            await deps.links.close()
            await deps.http.aclose()
            return first, second, third

    first, second, third = asyncio.run(passes())
    assert first >= 4  # the Service, three pods, the status
    assert second >= 1  # the status now counts the pods
    assert third == 0, f"the third pass wrote {third} times"
    names = sorted(p["metadata"]["name"] for p in pods(core, namespace))
    assert len(names) == 3, names
    status = read(custom, namespace, "idem")["status"]
    assert status["decodeReady"] == "0/2" and status["links"]["desired"] == 0


# ---- the operator process ---------------------------------------------------------


def test_operator_creates_gated_pods_and_the_service(operator: OperatorProcess, custom: client.CustomObjectsApi,
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
    assert svc.spec is not None and svc.spec.selector == {m.CLUSTER_LABEL: "llm", m.ROLE_LABEL: "prefill"}

    def status() -> dict[str, Any] | None:
        s: dict[str, Any] | None = read(custom, namespace, "llm").get("status")
        return s if s and s.get("observedGeneration") == created["metadata"]["generation"] else None

    s = wait_until(status, WAIT_S, "the operator's status")
    assert s["endpoint"] == f"http://llm.{namespace}.svc:8000/v1"
    assert {c["type"] for c in s["conditions"]} == {"Available", "Progressing", "Degraded", "LinksReady"}
    # A new Service port replaces the old one (merged by port, it would sit beside it and be refused).
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"service": {"port": 9000}}}, _request_timeout=10)
    wait_until(lambda: (read(custom, namespace, "llm").get("status") or {}).get("endpoint", "").endswith(":9000/v1")
               or None, WAIT_S, "the status to name the new port")
    svc = core.read_namespaced_service("llm", namespace, _request_timeout=10)
    assert svc.spec is not None and [(p.port, p.target_port) for p in svc.spec.ports or []] == [(9000, "http")]
    # Scaling down before anything is linked deletes the surplus pod.
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"decode": {"replicas": 0}}}, _request_timeout=10)
    wait_until(lambda: not pods(core, namespace, "decode") or None, WAIT_S, "the decode pod to go")


def test_a_pod_the_api_server_refuses_is_reported_once_not_retried_silently(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str) -> None:
    """A spec field the schema takes as it is (a node selector's key) makes pods the API server
    refuses: the status says why, one Event per generation, and the fixed spec is acted on."""
    body = cluster_body("refused", "m")
    body["spec"]["decode"]["nodeSelector"] = {"bad key!": "x"}
    create(custom, namespace, body)

    def invalid() -> dict[str, Any] | None:
        conditions = (read(custom, namespace, "refused").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "SpecValid" and c["status"] == "False"), None)

    condition = wait_until(invalid, WAIT_S, "the SpecValid condition")
    assert "the API server refused" in condition["message"] and "nodeSelector" in condition["message"], condition
    passes = operator.metric("disagg_operator_reconcile_errors_total", handler="reconcile")
    wait_until(lambda: operator.metric("disagg_operator_reconcile_errors_total", handler="reconcile") >= passes + 2
               or None, WAIT_S, "two more passes refused")
    events = core.list_namespaced_event(namespace, _request_timeout=10).items
    assert [e.reason for e in events if e.involved_object.name == "refused"].count("InvalidSpec") == 1

    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "refused",
                                          {"spec": {"decode": {"nodeSelector": None}}}, _request_timeout=10)
    wait_until(lambda: len(pods(core, namespace, "decode")) == 1 or None, WAIT_S, "the decode pod")
    wait_until(lambda: invalid() is None or None, WAIT_S, "SpecValid gone")


def test_objects_of_the_names_it_would_use_are_not_taken_over(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str) -> None:
    """A Service and a Secret of the names a cluster derives, made by someone else (a chart's
    Service): each is reported and left as it is, and nothing is made until it is gone."""
    theirs = {"selector": {"app": "theirs"}, "ports": [{"name": "metrics", "port": 8080}]}
    core.create_namespaced_service(namespace, {"metadata": {"name": "taken"}, "spec": theirs}, _request_timeout=10)
    core.create_namespaced_secret(namespace, {"metadata": {"name": m.key_secret_name("taken")},
                                              "stringData": {"other": "value"}}, _request_timeout=10)
    create(custom, namespace, cluster_body("taken", "m"))

    def refused(kind: str) -> dict[str, Any] | None:
        conditions = (read(custom, namespace, "taken").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "SpecValid" and c["status"] == "False"
                     and f"{kind} " in c["message"] and "is not this DisaggCluster's" in c["message"]), None)

    wait_until(lambda: refused("Service"), WAIT_S, "the Service reported")
    svc = core.read_namespaced_service("taken", namespace, _request_timeout=10)
    assert svc.spec is not None and svc.spec.selector == {"app": "theirs"} and not svc.metadata.owner_references
    assert [p.port for p in svc.spec.ports or []] == [8080]
    assert not [p for p in pods(core, namespace) if p["metadata"]["labels"][m.CLUSTER_LABEL] == "taken"]

    core.delete_namespaced_service("taken", namespace, _request_timeout=10)
    wait_until(lambda: refused("Secret"), WAIT_S, "then the Secret reported")
    secret = core.read_namespaced_secret(m.key_secret_name("taken"), namespace, _request_timeout=10)
    assert set(secret.data or {}) == {"other"} and not secret.metadata.owner_references

    core.delete_namespaced_secret(m.key_secret_name("taken"), namespace, _request_timeout=10)
    wait_until(lambda: len([p for p in pods(core, namespace) if p["metadata"]["labels"][m.CLUSTER_LABEL] == "taken"])
               == 2 or None, WAIT_S, "the cluster's pods once both names are free")
    svc = core.read_namespaced_service("taken", namespace, _request_timeout=10)
    assert svc.metadata.owner_references and svc.metadata.owner_references[0].controller


# ---- real workers: links, serving, scaling, failures -------------------------------


PROMPT = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 4


def _linked(custom: client.CustomObjectsApi, namespace: str, name: str, prefill: int, decode: int) -> bool:
    s = read(custom, namespace, name).get("status") or {}
    return (s.get("available") == "True" and s.get("prefillReady") == f"{prefill}/{prefill}"
            and s.get("decodeReady") == f"{decode}/{decode}"
            and s.get("links", {}).get("established") == prefill * decode)


def _settled(custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str, prefill: int,
             decode: int) -> bool:
    """Linked as the status says, and exactly these pods left (drained ones deleted)."""
    return (_linked(custom, namespace, "llm", prefill, decode) and len(pods(core, namespace, "prefill")) == prefill
            and len(pods(core, namespace, "decode")) == decode)


def _chat(ip: str, port: int = m.HTTP_PORT, timeout_s: float = 60) -> tuple[str, list[int]]:
    r = httpx.post(f"http://{ip}:{port}/v1/chat/completions", timeout=timeout_s, json={
        "model": MODEL_NAME, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, f"{ip}: {r.status_code} {r.text}"
    choice = r.json()["choices"][0]
    return str(choice["message"]["content"]), list(choice["token_ids"])


def _conditions(pod: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}


def _ready_prefills(core: client.CoreV1Api, namespace: str) -> list[str]:
    """What a Service would route to: Ready prefill pods (Ready needs the linked gate)."""
    return [p["status"]["podIP"] for p in pods(core, namespace, "prefill")
            if _conditions(p).get("Ready") == "True" and not p["metadata"].get("deletionTimestamp")]


def _slice_endpoints(api: client.ApiClient, namespace: str, service: str) -> tuple[list[Obj], list[int]]:
    """Every endpoint of a Service's EndpointSlices, and their ports (what kube-proxy would route to)."""
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}", _request_timeout=10).items
    raw = api.sanitize_for_serialization(slices)
    return ([e for s in raw for e in s.get("endpoints") or []],
            sorted({p["port"] for s in raw for p in s.get("ports") or []}))


def _ready_addresses(endpoints: list[Obj]) -> list[str]:
    return sorted(a for e in endpoints if (e.get("conditions") or {}).get("ready") for a in e["addresses"])


def _scale(custom: client.CustomObjectsApi, namespace: str, role: str, replicas: int) -> None:
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {role: {"replicas": replicas}}}, _request_timeout=10)


def _reasons(core: client.CoreV1Api, namespace: str) -> list[str]:
    return [str(e.reason) for e in core.list_namespaced_event(namespace, _request_timeout=10).items]


def _links_of(core: client.CoreV1Api, namespace: str, role: str) -> list[float]:
    return [worker_metric(p, "disagg_links") for p in pods(core, namespace, role)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int]]]:
    """The greedy answer of a `mixed` worker (no disaggregation) with the cluster's engine settings."""
    http, grpc_port, transfer = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("mixed") / "mixed.log"
    spec = cluster_body("ref", str(tiny_model))["spec"]
    engine = spec["engine"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.workers", "serve", "--role", "mixed", "--model", str(tiny_model),
             "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--http-port", str(http),
             "--grpc-port", str(grpc_port), "--transfer-port", str(transfer), "--device", "cpu",
             "--dtype", engine["dtype"], "--block-size", str(engine["blockSize"]),
             "--num-kv-blocks", str(engine["numKvBlocks"]), "--max-num-seqs", str(engine["maxNumSeqs"])],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{http}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, WAIT_S, "the mixed reference worker")
        r = httpx.post(f"http://127.0.0.1:{http}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        yield str(choice["message"]["content"]), list(choice["token_ids"])
    finally:
        proc.terminate()
        proc.wait(timeout=20)


class Load:
    """Chat requests one after another, each to a Ready prefill read from the API
    just before (as a Service would route), until stopped; every failure is kept."""

    def __init__(self, core: client.CoreV1Api, namespace: str, expected: tuple[str, list[int]]) -> None:
        self.core, self.namespace, self.expected = core, namespace, expected
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            targets = _ready_prefills(self.core, self.namespace)
            if not targets:
                self.failures.append("no Ready prefill to send to")
                self._stop.wait(0.2)
                continue
            ip = targets[n % len(targets)]
            n += 1
            try:
                got = _chat(ip)
            except httpx.HTTPError as e:
                detail = e.response.text if isinstance(e, httpx.HTTPStatusError) else ""
                self.failures.append(f"{ip}: {e!r} {detail}")
                continue
            if got != self.expected:
                self.failures.append(f"{ip} answered {got}, not {self.expected}")
            self.done += 1

    def wait_for(self, more: int) -> None:
        """Until `more` further requests have succeeded."""
        target = self.done + more
        wait_until(lambda: self.done >= target or None, WAIT_S, f"{more} more requests")


def test_one_prefill_one_decode_link_then_serve_the_greedy_text(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    seen_ready_unlinked: list[str] = []

    def linked_and_ready() -> bool:
        ready = 0
        for pod in pods(core, namespace):
            c = _conditions(pod)
            if c.get("Ready") == "True":
                ready += 1
                if c.get(m.LINKED_GATE) != "True":
                    seen_ready_unlinked.append(pod["metadata"]["name"])
        # The kubelet turns a pod Ready on its own next sync after the operator opens the gate,
        # so the status may say linked a moment before both pods say Ready.
        return _linked(custom, namespace, "llm", 1, 1) and ready == 2

    wait_until(linked_and_ready, WAIT_S, "one prefill and one decode, linked and Ready")
    assert not seen_ready_unlinked, f"Ready before linked: {seen_ready_unlinked}"
    (prefill,) = pods(core, namespace, "prefill")
    (decode,) = pods(core, namespace, "decode")
    gate = next(c for c in prefill["status"]["conditions"] if c["type"] == m.LINKED_GATE)
    assert gate["status"] == "True" and gate["reason"] == "Linked"
    # The workers hold the link the operator made.
    assert worker_metric(prefill, "disagg_links") == 1 and worker_metric(decode, "disagg_links") == 1
    assert _chat(prefill["status"]["podIP"]) == reference

    # `kubectl get dc`: the CRD's printer columns, evaluated on the object as kubectl does.
    got = core.api_client.sanitize_for_serialization(client.ApiextensionsV1Api(core.api_client)
                                                     .read_custom_resource_definition(f"{crd.PLURAL}.{crd.GROUP}"))
    columns = got["spec"]["versions"][0]["additionalPrinterColumns"]
    obj = read(custom, namespace, "llm")

    def at(path: str) -> Any:
        value: Any = obj
        for key in path.strip(".").split("."):
            value = value[key]
        return value

    shown = {c["name"]: at(c["jsonPath"]) for c in columns if c["name"] != "Age"}
    assert shown == {"Prefill": "1/1", "Decode": "1/1", "Links": "1/1", "Available": "True"}
    conditions = {c["type"]: (c["status"], c["reason"]) for c in obj["status"]["conditions"]}
    assert conditions == {"Available": ("True", "Serving"), "Progressing": ("False", "Converged"),
                          "Degraded": ("False", "AsExpected"), "LinksReady": ("True", "AllLinked")}


def test_scaling_either_role_under_load_loses_no_request(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, cluster: LocalCluster,
        namespace: str, tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    assert cluster.kubelet is not None
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    removed: list[str] = []
    with Load(core, namespace, reference) as load:
        load.wait_for(2)
        for role, other in (("decode", "prefill"), ("prefill", "decode")):
            _scale(custom, namespace, role, 2)
            wait_until(lambda: _settled(custom, core, namespace, 2 if role == "prefill" else 1,
                                        2 if role == "decode" else 1), WAIT_S, f"two {role} pods linked")
            # The new pod is linked to every peer, as the workers themselves say.
            assert _links_of(core, namespace, role) == [1.0, 1.0]
            assert _links_of(core, namespace, other) == [2.0]
            load.wait_for(2)
            before = {p["metadata"]["name"] for p in pods(core, namespace, role)}
            _scale(custom, namespace, role, 1)
            wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, f"back to one {role}")
            (gone,) = before - {p["metadata"]["name"] for p in pods(core, namespace, role)}
            removed.append(gone)
            assert _links_of(core, namespace, other) == [1.0]
            load.wait_for(2)
    assert not load.failures, load.failures
    for name in removed:
        # The removed worker was drained, then unlinked by the operator's RPCs (not by its own shutdown).
        log = cluster.kubelet.pod_log(namespace, name).read_text(errors="replace")
        assert ": unlinked" in log and "this worker is shutting down" not in log, log[-3000:]
    assert _reasons(core, namespace).count("Drained") == 2
    assert operator.metric("disagg_operator_drain_duration_seconds_count") == 2
    assert operator.metric("disagg_operator_drain_timeouts_total") == 0
    assert operator.metric("disagg_operator_link_operations_total", operation="unlink", result="success") >= 4


def test_a_spec_change_rolls_every_pod_under_load_losing_no_request(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    before = {p["metadata"]["name"]: p["metadata"]["labels"][m.TEMPLATE_LABEL] for p in pods(core, namespace)}
    seen: set[str] = set()

    def rolled() -> bool:
        conditions = {c["type"]: c for c in read(custom, namespace, "llm").get("status", {}).get("conditions", [])}
        seen.add(conditions.get("Progressing", {}).get("reason", ""))
        now = pods(core, namespace)
        return _settled(custom, core, namespace, 1, 1) and not {p["metadata"]["name"] for p in now} & set(before)

    with Load(core, namespace, reference) as load:
        load.wait_for(2)
        # Same KV layout, same greedy text, another pod spec for both roles.
        custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                              {"spec": {"engine": {"maxNumSeqs": 4}}}, _request_timeout=10)
        wait_until(rolled, WAIT_S, "every pod replaced from the new spec, linked")
        load.wait_for(2)
    assert not load.failures, load.failures
    assert "RollingUpdate" in seen
    after = pods(core, namespace)
    assert not {p["metadata"]["labels"][m.TEMPLATE_LABEL] for p in after} & set(before.values())
    for pod in after:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "4"
    status = read(custom, namespace, "llm")["status"]
    assert status["prefill"]["updated"] == status["decode"]["updated"] == 1
    assert _reasons(core, namespace).count("Drained") == 2


def test_a_killed_worker_is_replaced_and_an_operator_restart_converges(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, cluster: LocalCluster,
        namespace: str, tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    kubelet = cluster.kubelet
    assert kubelet is not None
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    (decode,) = pods(core, namespace, "decode")
    unlinks = operator.metric("disagg_operator_link_operations_total", operation="unlink")
    pid = kubelet.pod_pid(namespace, decode["metadata"]["name"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # The operator unlinks the dead incarnation from its peer, and the prefill leaves routing.
    wait_until(lambda: operator.metric("disagg_operator_link_operations_total", operation="unlink") > unlinks,
               WAIT_S, "the operator to unlink the killed decode")
    wait_until(lambda: _settled(custom, core, namespace, 1, 1) and pods(core, namespace, "decode")[0]["status"]
               ["containerStatuses"][0]["restartCount"] == 1, WAIT_S, "the restarted decode, linked again")
    (prefill,) = pods(core, namespace, "prefill")
    assert _chat(prefill["status"]["podIP"]) == reference

    # Restart the operator in the middle of a scale-up.
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}},
                                          _request_timeout=10)
    wait_until(lambda: len(pods(core, namespace)) == 4 or None, WAIT_S, "the new pods")
    operator.stop()
    operator.start()
    wait_until(lambda: _settled(custom, core, namespace, 2, 2), WAIT_S, "two by two, linked")
    assert len(pods(core, namespace)) == 4  # no duplicates
    assert _links_of(core, namespace, "decode") == [2.0, 2.0]
    assert _links_of(core, namespace, "prefill") == [2.0, 2.0]
    for ip in _ready_prefills(core, namespace):
        assert _chat(ip) == reference


def test_a_layout_change_rolls_both_roles_never_linking_across_layouts(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    old_layout = pods(core, namespace)[0]["metadata"]["labels"][m.LAYOUT_LABEL]
    custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "llm",
                                          {"spec": {"engine": {"blockSize": 8}}}, _request_timeout=10)

    def rolled() -> bool:
        layouts = {p["metadata"]["labels"][m.LAYOUT_LABEL] for p in pods(core, namespace)}
        return _settled(custom, core, namespace, 1, 1) and old_layout not in layouts

    wait_until(rolled, WAIT_S, "both roles replaced by pods of the new KV layout, linked")
    # While old and new pods ran side by side, the mismatch was reported and never linked.
    assert "LayoutMismatch" in _reasons(core, namespace)
    assert operator.metric("disagg_operator_link_operations_total", operation="link", result="failure") == 0
    assert _links_of(core, namespace, "prefill") == _links_of(core, namespace, "decode") == [1.0]
    (prefill,) = pods(core, namespace, "prefill")
    assert _chat(prefill["status"]["podIP"]) == reference


def test_prefill_service_endpoints_list_only_the_linked_prefill(
        operator: OperatorProcess, api: client.ApiClient, custom: client.CustomObjectsApi, core: client.CoreV1Api,
        namespace: str, tiny_model: Path, reference: tuple[str, list[int]], routable_kubelet: LocalKubelet) -> None:
    """On the routable node (EndpointSlices refuse 127/8): the Service lists the
    prefill only once it is linked, and a chat through that endpoint answers."""
    # No decode at first: the prefill runs but has nothing to link to, a state that holds still.
    body = cluster_body("llm", str(tiny_model), decode=0)
    for role in ("prefill", "decode"):
        body["spec"][role]["nodeSelector"] = {HOSTNAME_LABEL: routable_kubelet.node_name}
    create(custom, namespace, body)
    service = m.service_name("llm")

    def listed_unlinked() -> list[Obj] | None:
        endpoints, _ = _slice_endpoints(api, namespace, service)
        prefills = pods(core, namespace, "prefill")
        unlinked = len(prefills) == 1 and _conditions(prefills[0]).get(m.LINKED_GATE) != "True"
        return endpoints if unlinked and endpoints else None

    endpoints = wait_until(listed_unlinked, WAIT_S, "the unlinked prefill in the Service's EndpointSlice")
    (prefill,) = pods(core, namespace, "prefill")
    assert prefill["spec"]["nodeName"] == routable_kubelet.node_name
    assert [a for e in endpoints for a in e["addresses"]] == [prefill["status"]["podIP"]]
    assert _ready_addresses(endpoints) == [], f"an unlinked prefill is routed to: {endpoints}"

    _scale(custom, namespace, "decode", 1)
    early: list[list[Obj]] = []

    def linked() -> bool:
        # The slice first, then the gate: a ready endpoint seen while the gate
        # is still not True afterwards was routed to before its link.
        endpoints, _ = _slice_endpoints(api, namespace, service)
        gate = _conditions(pods(core, namespace, "prefill")[0]).get(m.LINKED_GATE)
        if _ready_addresses(endpoints) and gate != "True":
            early.append(endpoints)
        return _linked(custom, namespace, "llm", 1, 1)

    wait_until(linked, WAIT_S, "one prefill and one decode, linked")
    assert not early, f"ready in the Service before linked: {early}"
    (prefill,) = pods(core, namespace, "prefill")
    (decode,) = pods(core, namespace, "decode")
    assert decode["spec"]["nodeName"] == routable_kubelet.node_name

    def routed() -> tuple[list[Obj], list[int]] | None:
        endpoints, ports = _slice_endpoints(api, namespace, service)
        return (endpoints, ports) if _ready_addresses(endpoints) else None

    endpoints, ports = wait_until(routed, WAIT_S, "the linked prefill to be ready in the Service's EndpointSlice")
    assert _ready_addresses(endpoints) == [prefill["status"]["podIP"]]
    assert [e["targetRef"]["name"] for e in endpoints] == [prefill["metadata"]["name"]]  # no decode in it
    assert ports == [m.HTTP_PORT]
    (address,) = _ready_addresses(endpoints)
    assert _chat(address, ports[0]) == reference


def _key_secret(core: client.CoreV1Api, namespace: str) -> dict[str, Any] | None:
    try:
        got = core.read_namespaced_secret(m.key_secret_name("llm"), namespace, _request_timeout=10)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    secret: dict[str, Any] = core.api_client.sanitize_for_serialization(got)
    return secret


def _key_text(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][m.KEY_ITEM]).decode()


def _link_status(ip: str, key: ClusterKey | None) -> grpc.StatusCode:
    """The code a LinkInstance call signed with `key` (None: unsigned) gets from the worker at `ip`."""
    metadata = [(METADATA_KEY, key.credential(LINK_METHOD))] if key is not None else []
    with grpc.insecure_channel(f"{ip}:{m.GRPC_PORT}") as channel:
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
        try:
            stub.LinkInstance(disagg_pd_pb2.InstanceClusterInfo(), timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return cast(grpc.StatusCode, e.code())
    return grpc.StatusCode.OK


def test_the_cluster_key_is_made_mounted_and_rotated_without_a_failed_request(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path, reference: tuple[str, list[int]]) -> None:
    created = create(custom, namespace, cluster_body("llm", str(tiny_model)))
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    secret = _key_secret(core, namespace)
    assert secret is not None and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    old = ClusterKey(_key_text(secret).encode())
    workers = pods(core, namespace)
    for pod in workers:
        assert pod["spec"]["volumes"][0]["secret"]["secretName"] == m.key_secret_name("llm")
        assert "--cluster-key-file" in pod["spec"]["containers"][0]["args"]
        health = httpx.get(f"http://{pod['status']['podIP']}:{m.HTTP_PORT}/health", timeout=10).json()
        assert health["insecure"] is False and health["cluster_key"] == old.fingerprint()
    (decode,) = pods(core, namespace, "decode")
    decode_ip = decode["status"]["podIP"]
    # A caller without the key, or with another one, is refused.
    assert _link_status(decode_ip, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _link_status(decode_ip, ClusterKey.generate()) == grpc.StatusCode.UNAUTHENTICATED

    with Load(core, namespace, reference) as load:
        load.wait_for(2)
        core.delete_namespaced_secret(m.key_secret_name("llm"), namespace, _request_timeout=10)

        def rotated() -> str | None:
            s = _key_secret(core, namespace)
            if s is None or (s["metadata"].get("annotations") or {}).get(m.ROTATION_ANNOTATION):
                return None
            text = _key_text(s).strip()
            return text if "\n" not in text and text != _key_text(secret).strip() else None

        new = ClusterKey(wait_until(rotated, WAIT_S, "the three steps of the rotation").encode())
        load.wait_for(3)
    assert not load.failures, load.failures
    assert sorted(r for r in _reasons(core, namespace) if r.startswith("Key")) == [
        "KeyRotated", "KeyRotationSigning", "KeyRotationStarted"]
    # The same pods, never restarted, take the new key alone (the last step reaches them after the
    # kubelet's next volume sync): the old one is refused from then on.
    assert {p["metadata"]["uid"] for p in pods(core, namespace)} == {p["metadata"]["uid"] for p in workers}
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in pods(core, namespace))

    def fingerprints() -> set[str]:
        return {httpx.get(f"http://{p['status']['podIP']}:{m.HTTP_PORT}/health", timeout=10).json()["cluster_key"]
                for p in workers}

    wait_until(lambda: fingerprints() == {new.fingerprint()}, WAIT_S, "every worker on the new key alone")
    assert _link_status(decode_ip, old) == grpc.StatusCode.UNAUTHENTICATED
    assert _link_status(decode_ip, new) != grpc.StatusCode.UNAUTHENTICATED  # the key passes; the empty info does not


def test_workers_link_and_serve_over_mutual_tls_from_a_secret(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path, reference: tuple[str, list[int]], tmp_path: Path) -> None:
    folder = write_tls_folder(tmp_path / "tls", [TLS_SERVER_NAME])  # what cert-manager would put in the Secret
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "llm-tls"}, "type": "kubernetes.io/tls",
        "stringData": {name: (folder / name).read_text() for name in ("tls.crt", "tls.key", "ca.crt")}},
        _request_timeout=10)
    body = cluster_body("llm", str(tiny_model))
    body["spec"]["security"] = {"tlsSecretName": "llm-tls"}
    create(custom, namespace, body)
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked over TLS")
    (prefill,) = pods(core, namespace, "prefill")
    (decode,) = pods(core, namespace, "decode")
    assert "--tls-dir" in decode["spec"]["containers"][0]["args"]
    assert _chat(prefill["status"]["podIP"]) == reference
    # The key alone no longer gets a caller in: the gRPC port speaks only TLS.
    key = ClusterKey(_key_text(cast(dict[str, Any], _key_secret(core, namespace))).encode())
    assert _link_status(decode["status"]["podIP"], key) == grpc.StatusCode.UNAVAILABLE


def _long_completion(ip: str, max_tokens: int) -> list[int]:
    """A streamed greedy completion; its token ids (an error in band raises)."""
    body = {"model": MODEL_NAME, "prompt": [5, 9, 13, 17, 21], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    with httpx.stream("POST", f"http://{ip}:{m.HTTP_PORT}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk["error"]
                tokens += [t for c in chunk["choices"] for t in c.get("token_ids") or ()]
    return tokens


def test_a_drain_shorter_than_its_streams_moves_them_and_loses_none(
        operator: OperatorProcess, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str,
        tiny_model: Path) -> None:
    """Scale-down with no time to drain: the drained decode is unlinked mid-stream, and its streams move
    to the other decode. Every stream (the same greedy request) ends complete and equal to the others."""
    body = cluster_body("llm", str(tiny_model), decode=2, numKvBlocks=512)
    body["spec"]["drain"] = {"timeoutSeconds": 0}
    create(custom, namespace, body)
    wait_until(lambda: _settled(custom, core, namespace, 1, 2), WAIT_S, "one prefill and two decodes, linked")
    (prefill,) = pods(core, namespace, "prefill")
    ip = prefill["status"]["podIP"]
    length = 480  # of the tiny model's 512 positions; the router spreads the streams over both decodes
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_long_completion, ip, length) for _ in range(4)]

        def running() -> dict[str, float] | None:
            counts = {p["metadata"]["name"]: worker_metric(p, "disagg_requests_running")
                      for p in pods(core, namespace, "decode")}
            return counts if sum(counts.values()) == 4 and min(counts.values()) > 0 else None

        counts = wait_until(running, WAIT_S, "both decodes generate")
        _scale(custom, namespace, "decode", 1)
        outputs = [s.result(timeout=WAIT_S) for s in streams]
    assert len(outputs[0]) == length and all(o == outputs[0] for o in outputs), "moved streams go on exactly"
    wait_until(lambda: _settled(custom, core, namespace, 1, 1), WAIT_S, "down to one decode")
    assert "DrainTimeout" in _reasons(core, namespace)
    (prefill,) = pods(core, namespace, "prefill")
    (kept,) = pods(core, namespace, "decode")
    moved = sum(n for name, n in counts.items() if name != kept["metadata"]["name"])
    assert worker_metric(prefill, "disagg_request_migrations_total") == moved
