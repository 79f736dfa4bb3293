"""Pure builders of the objects the operator owns: worker pods and the prefill Service.

Objects are the API's JSON dicts (camelCase), ready to create. Nothing here
talks to the cluster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, cast

import kopf

from disagg.operator.crd import GROUP
from disagg.operator.spec import ROLES, ClusterSpec, flag_args
from disagg.proto.vocabulary import ADMIN_PORT, API_KEY_ENV, GRPC_PORT, HTTP_PORT, TRANSFER_PORT

Obj = dict[str, Any]

LINKED_GATE = f"{GROUP}/linked"  # the readiness gate the operator sets once a pod's links are made
CLUSTER_LABEL = f"{GROUP}/cluster"
ROLE_LABEL = f"{GROUP}/role"
LAYOUT_LABEL = f"{GROUP}/kv-layout"
# A hash of the pod spec the pod was made from: pods whose hash differs from the
# current spec's are replaced, one at a time (a rolling update).
TEMPLATE_LABEL = f"{GROUP}/pod-template-hash"
DRAINING_ANNOTATION = f"{GROUP}/draining-since"  # set when scale-down picks a pod; a fact that survives restarts

CONTAINER = "worker"
# The preStop pause keeps a terminating worker serving while the operator
# unlinks it from its peers; endpoints drop it at once, so no new requests come.
PRESTOP_SLEEP_S = 5
# The cluster key (docs/security.md): a Secret per cluster, mounted into every
# worker pod. A mounted Secret follows updates, which is what lets a key rotate
# without restarting a pod.
KEY_ITEM = "key"
KEY_MOUNT_DIR = "/etc/disagg/cluster-key"
KEY_VOLUME = "cluster-key"
KEY_FILE_MODE = 0o440  # owner root, group the pod's fsGroup (the chart sets one): the worker's user reads it
ROTATION_ANNOTATION = f"{GROUP}/key-rotation"  # the step of a rotation in progress ("accept" or "sign")
TLS_MOUNT_DIR = "/etc/disagg/tls"  # spec.security.tlsSecretName's Secret (workers/security/tls.py)
TLS_VOLUME = "tls"


def labels(cluster: str, role: str, spec: ClusterSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "disagg",
        "app.kubernetes.io/instance": cluster,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": "disagg-operator",
        CLUSTER_LABEL: cluster,
        ROLE_LABEL: role,
        LAYOUT_LABEL: spec.kv_layout,
    }


def pod_name(cluster: str, cluster_uid: str, role: str, slot: int) -> str:
    """Deterministic per (cluster, role, slot) so that a retried create meets its
    own pod (409) instead of making a twin; the hash makes it look random and
    keeps names from clusters re-created under the same name apart."""
    suffix = hashlib.sha256(f"{cluster_uid}/{role}/{slot}".encode()).hexdigest()[:5]
    return f"{cluster}-{role}-{suffix}"


def service_name(cluster: str) -> str:
    return cluster


def endpoint(cluster: str, namespace: str, spec: ClusterSpec) -> str:
    return f"http://{service_name(cluster)}.{namespace}.svc:{spec.service.port}/v1"


def worker_args(role: str, spec: ClusterSpec) -> list[str]:
    """`disagg serve`'s arguments: the pod's own, then the spec's (spec.FIELDS
    names their flags), then the role's extra ones; `$(POD_IP)` is expanded
    by the kubelet. Every pod has its own IP, so every pod uses the default ports."""
    args = [
        "--role", role,
        "--host", "$(POD_IP)",
        "--advertise-host", "$(POD_IP)",
        "--http-port", str(HTTP_PORT),
        "--grpc-port", str(GRPC_PORT),
        "--transfer-port", str(TRANSFER_PORT),
    ]
    if not spec.security.insecure:
        args += ["--cluster-key-file", f"{KEY_MOUNT_DIR}/{KEY_ITEM}"]
    if spec.security.tls_secret_name:
        args += ["--tls-dir", TLS_MOUNT_DIR]
    return args + flag_args(spec, role) + list(spec.role(role).args)


def key_secret_name(cluster: str) -> str:
    return f"{cluster}-cluster-key"


def key_secret(owner: Mapping[str, Any], key_text: str, rotation: str | None = None) -> Obj:
    """The cluster's key Secret (one key per line: the first signs, all are accepted),
    owned by the DisaggCluster `owner`; `rotation` marks a rotation's step."""
    cluster = owner["metadata"]["name"]
    secret: Obj = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": key_secret_name(cluster),
                     "labels": {CLUSTER_LABEL: cluster, "app.kubernetes.io/managed-by": "disagg-operator"},
                     "annotations": {ROTATION_ANNOTATION: rotation} if rotation else {}},
        "stringData": {KEY_ITEM: key_text},
    }
    kopf.adopt(secret, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return secret


def _env(role: str, spec: ClusterSpec) -> list[Obj]:
    def field(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    # POD_IP comes first: the user's variables may refer to it as $(POD_IP).
    own = [field("POD_IP", "status.podIP"), field("POD_NAME", "metadata.name"),
           field("POD_NAMESPACE", "metadata.namespace")]
    security = spec.security
    if role == "prefill" and security.api_key_secret_name:  # the prefill serves the clients
        own.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": security.api_key_secret_name, "key": security.api_key_secret_key}}})
    return own + [dict(v) for v in spec.role(role).env]


def worker_pod_spec(role: str, spec: ClusterSpec, pod_security_context: Mapping[str, Any] | None = None,
                    security_context: Mapping[str, Any] | None = None) -> Obj:
    """The pod spec of every worker pod of `role`.

    The security contexts are the operator's defaults for every worker pod
    (the chart's workerPods values), applied as given.
    """
    r = spec.role(role)
    container: Obj = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["disagg", "serve"],
        "args": worker_args(role, spec),
        "env": _env(role, spec),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "transfer", "containerPort": TRANSFER_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "resources": dict(r.resources),
        # /ready: the model is loaded (and, for a prefill, a decode is linked).
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                           "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 2},
        # /health answers as soon as the server is up, long before the model loads.
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                          "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
    }
    if security_context:
        container["securityContext"] = dict(security_context)
    mounts = [{"name": KEY_VOLUME, "mountPath": KEY_MOUNT_DIR, "readOnly": True}] if not spec.security.insecure else []
    if spec.security.tls_secret_name:
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_MOUNT_DIR, "readOnly": True})
    if mounts:  # the key's volume is the cluster's: worker_pod adds it
        container["volumeMounts"] = mounts
    pod_spec: Obj = {
        "containers": [container],
        "restartPolicy": "Always",
        "readinessGates": [{"conditionType": LINKED_GATE}],
        # Draining happens before deletion; the grace period only covers preStop and shutdown.
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + 30,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # a worker never calls the Kubernetes API
    }
    if spec.security.tls_secret_name:
        pod_spec["volumes"] = [{"name": TLS_VOLUME, "secret": {"secretName": spec.security.tls_secret_name,
                                                               "defaultMode": KEY_FILE_MODE}}]
    optional = {"nodeSelector": dict(r.node_selector), "tolerations": [dict(t) for t in r.tolerations],
                "affinity": dict(r.affinity), "priorityClassName": r.priority_class_name,
                "securityContext": dict(pod_security_context or {})}
    pod_spec.update({k: v for k, v in optional.items() if v})
    return pod_spec


def template_hash(pod_spec: Mapping[str, Any]) -> str:
    """A short, stable hash of a pod spec (a label value)."""
    return hashlib.sha256(json.dumps(pod_spec, sort_keys=True).encode()).hexdigest()[:10]


def current_templates(spec: ClusterSpec, pod_security_context: Mapping[str, Any] | None = None,
                      security_context: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Per role, the `template_hash` new pods get now."""
    return {role: template_hash(worker_pod_spec(role, spec, pod_security_context, security_context))
            for role in ROLES}


def worker_pod(owner: Mapping[str, Any], role: str, name: str, spec: ClusterSpec,
               pod_security_context: Mapping[str, Any] | None = None,
               security_context: Mapping[str, Any] | None = None) -> Obj:
    """One worker pod of `role`, owned by the DisaggCluster `owner` (its body),
    labelled with its spec's `template_hash`."""
    cluster = owner["metadata"]["name"]
    pod_spec = worker_pod_spec(role, spec, pod_security_context, security_context)
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {**labels(cluster, role, spec), TEMPLATE_LABEL: template_hash(pod_spec)}},
        "spec": pod_spec,
    }
    if not spec.security.insecure:
        key_volume = {"name": KEY_VOLUME, "secret": {"secretName": key_secret_name(cluster),
                                                     "defaultMode": KEY_FILE_MODE}}
        pod_spec["volumes"] = [key_volume, *pod_spec.get("volumes", [])]
    kopf.adopt(pod, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return pod


def prefill_service(owner: Mapping[str, Any], spec: ClusterSpec) -> Obj:
    """The client endpoint: only Ready prefill pods, and Ready needs the linked gate."""
    cluster = owner["metadata"]["name"]
    svc: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(cluster), "labels": labels(cluster, "prefill", spec)},
        "spec": {
            "type": spec.service.type,
            "selector": {CLUSTER_LABEL: cluster, ROLE_LABEL: "prefill"},
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    # The layout label would make the Service churn on every engine edit; it selects nothing.
    del svc["metadata"]["labels"][LAYOUT_LABEL]
    kopf.adopt(svc, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return svc
