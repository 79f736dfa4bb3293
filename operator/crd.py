"""The `DisaggCluster` CustomResourceDefinition, built in code.

The committed manifest `deploy/crds/disagg.dev_disaggclusters.yaml` is this
module's output (`python -m disagg.operator.crd > deploy/crds/...`); a test
keeps the two equal. Every scalar field of the spec comes from spec.FIELDS,
the table parse_spec reads, so the schema and the operator's parser cannot
disagree on a default, a bound or a choice.
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


def _obj(description: str, properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _opaque(description: str, kind: str = "object") -> Schema:
    """A Kubernetes-shaped field (resources, affinity, ...) that the API server validates on the pod."""
    if kind == "array":
        return {"type": "array", "description": description,
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _field(f: s.Field, role: str = "") -> Schema:
    """One row of spec.FIELDS as a schema node."""
    types: dict[type, Schema] = {int: {"type": "integer", "format": "int32"}, bool: {"type": "boolean"}}
    node: Schema = dict(types.get(f.kind, {"type": "string"}))
    node["description"] = f.description.replace("{role}", role)
    if f.bounds is not None:
        node["minimum"], node["maximum"] = f.bounds
    if f.choices:
        node["enum"] = list(f.choices)
    if f.nonblank:
        node["pattern"] = r"\S"  # something other than spaces
    if f.default is not None:
        node["default"] = f.default
    return node


def _section(description: str, section: str, role: str = "", **extra: Schema) -> Schema:
    """The table's fields of `section` (then `extra`'s) as an object with a default of {}
    so that nested defaults apply; one with a required field gets no default."""
    rows = s.fields(section)
    required = [f.name for f in rows if f.required]
    properties = {f.name: _field(f, role) for f in rows} | extra
    if required:
        return _obj(description, properties, required=required)
    return _obj(description, properties, default={})


def _role(role: str) -> Schema:
    env_item = {
        "type": "object",
        "required": ["name"],
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"name": _str("Variable name.", minLength=1)},
    }
    return _section(
        f"The {role} worker pods.",
        "role",
        role,
        resources=_opaque("Container resources (requests and limits), as in a pod."),
        nodeSelector={
            "type": "object",
            "description": "Node labels the pods must match.",
            "additionalProperties": {"type": "string"},
        },
        tolerations=_opaque("Pod tolerations.", "array"),
        affinity=_opaque("Pod affinity and anti-affinity."),
        env={"type": "array", "description": "Extra environment variables of the worker container.", "items": env_item},
        args={"type": "array", "description": "Extra `disagg serve` arguments.", "items": {"type": "string"}},
    )


def spec_schema() -> Schema:
    top = _section(
        "The desired state of a prefill/decode disaggregated serving cluster.",
        "",
        model=_section("The model every worker serves.", "model"),
        prefill=_role("prefill"),
        decode=_role("decode"),
        kvTransfer=_section("How KV caches move from prefill to decode.", "kvTransfer"),
        engine=_section(
            "Engine settings shared by every worker. Model, dtype and block size form the KV layout.", "engine"
        ),
        service=_section("The Service in front of the prefill pods (the client endpoint).", "service"),
        drain=_section("Scale-down draining.", "drain"),
        security=_section("Authentication between the cluster's workers and the operator (docs/security.md).",
                          "security"),
    )
    del top["default"]  # the spec itself is required, and so is its model
    return top | {"required": ["model"]}


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
