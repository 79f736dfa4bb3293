"""Worker pods and the prefill Service, built offline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.spec import ClusterSpec, parse_spec


def test_pod_runs_disagg_serve_with_the_engine_args(spec: ClusterSpec, owner: Callable[..., Any]) -> None:
    pod = m.worker_pod(owner(), "decode", "llm-decode-abcde", spec)
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["disagg", "serve"]
    args = c["args"]
    assert args[args.index("--role") + 1] == "decode"
    assert args[args.index("--model") + 1] == "builtin:smollm2-135m"
    assert args[args.index("--block-size") + 1] == "16"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert "--num-kv-blocks" not in args
    assert "--kv-connections" not in args, "unset: the worker picks a count for its CPUs"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 7777, "transfer": 26000, "admin": 8100}
    assert c["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0


def test_workers_mount_no_token_and_the_admin_port_is_the_worker_default(spec: ClusterSpec) -> None:
    from disagg.workers.config import ServerConfig

    assert m.ADMIN_PORT == ServerConfig.__dataclass_fields__["admin_port"].default, "the pod args do not pass it"
    assert m.worker_pod_spec("decode", spec)["automountServiceAccountToken"] is False


def test_kv_connections_reach_the_worker_args(owner: Callable[..., Any]) -> None:
    spec = parse_spec({"model": {"source": "m"}, "kvTransfer": {"connections": 8}})
    args = m.worker_pod(owner(), "decode", "llm-decode-abcde", spec)["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-connections") + 1] == "8"


def test_template_hash_follows_the_pod_spec_not_the_name(owner: Callable[..., Any]) -> None:
    def spec_with(**decode: Any) -> ClusterSpec:
        return parse_spec({"model": {"source": "m"}, "decode": decode})

    def template(spec: ClusterSpec, name: str = "llm-decode-abcde", **contexts: Any) -> str:
        return str(m.worker_pod(owner(), "decode", name, spec, **contexts)["metadata"]["labels"][m.TEMPLATE_LABEL])

    base = spec_with()
    assert template(base) == template(base, "llm-decode-fghij") == m.current_templates(base)["decode"]
    assert template(base) != template(spec_with(args=["--seed", "7"]))
    assert template(base) != template(spec_with(resources={"limits": {"cpu": "2"}}))
    assert template(base) != template(base, security_context={"runAsNonRoot": True})
    # A prefill-only change leaves the decode template alone.
    prefill_only = parse_spec({"model": {"source": "m"}, "prefill": {"args": ["--seed", "7"]}})
    assert m.current_templates(prefill_only)["decode"] == template(base)
    assert m.current_templates(prefill_only)["prefill"] != m.current_templates(base)["prefill"]


def test_pod_carries_gate_owner_labels_and_scheduling(owner: Callable[..., Any]) -> None:
    spec = parse_spec({"model": {"source": "m"}, "prefill": {
        "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "priorityClassName": "high", "resources": {"limits": {"nvidia.com/gpu": 1}},
        "env": [{"name": "X", "value": "$(POD_IP)"}], "args": ["--seed", "7"]}})
    pod = m.worker_pod(owner(), "prefill", "llm-prefill-abcde", spec)
    assert pod["spec"]["readinessGates"] == [{"conditionType": "disagg.dev/linked"}]
    ref = pod["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("DisaggCluster", "llm", "uid-1", True)
    assert pod["metadata"]["namespace"] == "ns"
    labels = pod["metadata"]["labels"]
    assert labels["disagg.dev/cluster"] == "llm" and labels["disagg.dev/role"] == "prefill"
    assert labels["disagg.dev/kv-layout"] == spec.kv_layout
    assert labels["app.kubernetes.io/component"] == "prefill"
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert pod["spec"]["containers"][0]["env"][-1] == {"name": "X", "value": "$(POD_IP)"}
    assert pod["spec"]["containers"][0]["args"][-2:] == ["--seed", "7"]
    assert "affinity" not in pod["spec"]  # empty fields are left out


def test_pod_names_are_deterministic_per_slot_and_distinct() -> None:
    a = m.pod_name("llm", "uid-1", "decode", 0)
    assert a == m.pod_name("llm", "uid-1", "decode", 0)
    assert a.startswith("llm-decode-") and len(a) == len("llm-decode-") + 5
    names = {m.pod_name("llm", "uid-1", role, slot) for role in ("prefill", "decode") for slot in range(50)}
    assert len(names) == 100
    assert m.pod_name("llm", "uid-2", "decode", 0) != a  # a re-created cluster gets new names


def test_service_selects_only_prefills_of_the_cluster(make_spec: Callable[..., ClusterSpec], owner: Callable[..., Any]) -> None:
    spec = make_spec()
    svc = m.prefill_service(owner(), spec)
    assert svc["metadata"]["name"] == "llm"
    assert svc["spec"]["selector"] == {"disagg.dev/cluster": "llm", "disagg.dev/role": "prefill"}
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert "disagg.dev/kv-layout" not in svc["metadata"]["labels"]
    assert m.endpoint("llm", "ns", spec) == "http://llm.ns.svc:8000/v1"


def test_pod_gets_the_operators_security_contexts(spec: ClusterSpec, owner: Callable[..., Any]) -> None:
    pod_ctx = {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    ctx = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    pod = m.worker_pod(owner(), "prefill", "llm-prefill-abcde", spec, pod_ctx, ctx)
    assert pod["spec"]["securityContext"] == pod_ctx
    assert pod["spec"]["containers"][0]["securityContext"] == ctx
    bare = m.worker_pod(owner(), "prefill", "llm-prefill-abcde", spec)
    assert "securityContext" not in bare["spec"] and "securityContext" not in bare["spec"]["containers"][0]
