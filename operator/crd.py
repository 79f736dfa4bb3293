"""The `DisaggCluster` CustomResourceDefinition, built in code.

The committed manifest `deploy/crds/disagg.dev_disaggclusters.yaml` is this
module's output (`python -m disagg.operator.crd > deploy/crds/...`); a test
keeps the two equal. Defaults and choices come from spec.py, so the schema
and the operator's parser cannot disagree.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from disagg.operator import spec as s

GROUP = "disagg.dev"
VERSION = "v1alpha1"
KIND = "DisaggCluster"
PLURAL = "disaggclusters"
SHORT_NAME = "dc"

Schema = dict[str, Any]


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _int(description: str, lo: int, hi: int, **extra: Any) -> Schema:
    return {"type": "integer", "format": "int32", "minimum": lo, "maximum": hi, "description": description, **extra}


def _obj(description: str, properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _opaque(description: str, kind: str = "object") -> Schema:
    """A Kubernetes-shaped field (resources, affinity, ...) that the API server validates on the pod."""
    if kind == "array":
        return {"type": "array", "description": description,
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _role(role: str) -> Schema:
    return _obj(f"The {role} worker pods.", {
        "replicas": _int(f"Number of {role} pods.", 0, s.MAX_REPLICAS, default=s.DEFAULT_REPLICAS),
        "resources": _opaque("Container resources (requests and limits), as in a pod."),
        "nodeSelector": {"type": "object", "description": "Node labels the pods must match.",
                         "additionalProperties": {"type": "string"}},
        "tolerations": _opaque("Pod tolerations.", "array"),
        "affinity": _opaque("Pod affinity and anti-affinity."),
        "priorityClassName": _str("Pod priority class."),
        "env": {"type": "array", "description": "Extra environment variables of the worker container.",
                "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                          "properties": {"name": _str("Variable name.", minLength=1)}}},
        "args": {"type": "array", "description": "Extra `disagg serve` arguments.", "items": {"type": "string"}},
    }, default={})


def spec_schema() -> Schema:
    return _obj("The desired state of a prefill/decode disaggregated serving cluster.", {
        "model": _obj("The model every worker serves.", {
            "source": _str("A Hugging Face model folder, a GGUF file, or builtin:NAME.", minLength=1),
            "servedName": _str("The model name clients send (default: the source)."),
        }, required=["source"]),
        "image": _str("The worker image.", default=s.DEFAULT_IMAGE, minLength=1),
        "imagePullPolicy": _str("The worker image's pull policy.", enum=list(s.PULL_POLICIES), default="IfNotPresent"),
        "prefill": _role("prefill"),
        "decode": _role("decode"),
        "kvTransfer": _obj("How KV caches move from prefill to decode.", {
            "mode": _str("PUSH: the prefill writes each layer as it computes; PULL: the decode reads.",
                         enum=list(s.KV_TRANSFER_MODES), default=s.DEFAULT_KV_MODE),
            "transport": _str("The KV data path.", enum=list(s.KV_TRANSPORTS), default=s.DEFAULT_KV_TRANSPORT),
            "connections": _int("TCP connections a decode opens per link (default: one per two CPUs of the pod, "
                                "1 to 4).", 1, s.MAX_KV_CONNECTIONS),
        }, default={}),
        "engine": _obj("Engine settings shared by every worker. Model, dtype and block size form the KV layout.", {
            "blockSize": _int("Tokens per KV block.", 1, 1024, default=s.DEFAULT_BLOCK_SIZE),
            "dtype": _str("Weights and KV dtype.", enum=list(s.DTYPES), default=s.DEFAULT_DTYPE),
            "device": _str("Where the model runs.", enum=list(s.DEVICES), default=s.DEFAULT_DEVICE),
            "maxNumSeqs": _int("Sequences in one batch.", 1, 4096, default=s.DEFAULT_MAX_NUM_SEQS),
            "numKvBlocks": _int("KV blocks per worker (default: sized from memory).", 1, 1 << 24),
        }, default={}),
        "service": _obj("The Service in front of the prefill pods (the client endpoint).", {
            "type": _str("Service type.", enum=list(s.SERVICE_TYPES), default=s.DEFAULT_SERVICE_TYPE),
            "port": _int("Service port.", 1, 65535, default=s.DEFAULT_SERVICE_PORT),
        }, default={}),
        "drain": _obj("Scale-down draining.", {
            "timeoutSeconds": _int("How long a removed pod may finish its in-flight requests.",
                                   0, s.MAX_DRAIN_TIMEOUT_S, default=s.DEFAULT_DRAIN_TIMEOUT_S),
        }, default={}),
    }, required=["model"])


def _role_status(role: str) -> Schema:
    n = {"type": "integer", "format": "int32"}
    return _obj(f"The {role} pods.", {"replicas": n, "updated": n, "ready": n, "linked": n, "draining": n})


def status_schema() -> Schema:
    n = {"type": "integer", "format": "int32"}
    condition = _obj("A condition, as in Kubernetes objects.", {
        "type": _str("Available, Progressing, Degraded or LinksReady."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("A CamelCase reason."),
        "message": _str("What is wrong and what to do about it."),
        "lastTransitionTime": _str("When the status last changed.", format="date-time"),
        "observedGeneration": {"type": "integer", "format": "int64"},
    }, required=["type", "status"])
    return _obj("The observed state, written by the operator.", {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "prefill": _role_status("prefill"),
        "decode": _role_status("decode"),
        "links": _obj("Prefill/decode links.", {"desired": n, "established": n, "failed": n}),
        "linksSummary": _str("established/desired, for the printer column."),
        "prefillReady": _str("ready/desired prefill pods, for the printer column."),
        "decodeReady": _str("ready/desired decode pods, for the printer column."),
        "available": _str("The Available condition's status, for the printer column."),
        "endpoint": _str("The URL clients use."),
        "conditions": {"type": "array", "items": condition,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    })


def printer_columns() -> list[Schema]:
    return [
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefillReady", "description": "ready/desired"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decodeReady", "description": "ready/desired"},
        {"name": "Links", "type": "string", "jsonPath": ".status.linksSummary", "description": "established/desired"},
        {"name": "Available", "type": "string", "jsonPath": ".status.available"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> Schema:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": KIND.lower(), "shortNames": [SHORT_NAME]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": printer_columns(),
                "schema": {"openAPIV3Schema": _obj(
                    "A prefill/decode disaggregated LLM serving cluster.",
                    {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                     "metadata": {"type": "object"}, "spec": spec_schema(), "status": status_schema()},
                    required=["spec"],
                )},
            }],
        },
    }


def render() -> str:
    header = "# Generated by `python -m disagg.operator.crd`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
