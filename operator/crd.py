"""The CustomResourceDefinitions, built in code: `DisaggCluster` and its per-role child `DisaggRole`.

The committed manifests in `deploy/crds/` (and the chart's `crds/`) are this
module's output (`python -m disagg.operator.crd [FILE]`, one per name in
`FILES`); a test keeps them equal. Every scalar field of the spec comes from spec.FIELDS,
the table parse_spec reads, so the schema and the operator's parser cannot
disagree on a default, a bound or a choice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import yaml

from disagg.operator import spec as s
from disagg.operator.scaling import scaling_schema

GROUP = "disagg.dev"
VERSION = "v1alpha1"
KIND = "DisaggCluster"
PLURAL = "disaggclusters"
SHORT_NAME = "dc"
# The per-role child (operator/roles.py): a CRD exposes `/scale` for one replicas path only,
# so each role of a cluster gets its own object for HPA, KEDA and `kubectl scale`.
ROLE_KIND = "DisaggRole"
ROLE_PLURAL = "disaggroles"
ROLE_SHORT_NAME = "dr"

Schema = dict[str, Any]
# A resource quantity ("500m", "2Gi", "1e3"), as the API server's own schemas give it.
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
MAX_NAME_LENGTH = 253  # of a DNS subdomain, and of a Secret's key


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _obj(description: str, properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _opaque(description: str) -> Schema:
    """A Kubernetes-shaped field (affinity) that the API server validates on the pod."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _resources() -> Schema:
    """A container's resources, typed as the pod's API types them: a bad quantity or a misspelt
    key is refused at apply, not by every pod creation after it."""
    quantities = {"type": "object", "additionalProperties": {
        "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY}}
    claim = _obj("A resource claim the container uses.", {"name": _str("The claim's name.", minLength=1),
                                                           "request": _str("One request of the claim.")},
                 required=["name"])
    return _obj("Container resources (requests and limits), as in a pod.", {
        "limits": quantities | {"description": "Most of each resource the container may use."},
        "requests": quantities | {"description": "What the container is scheduled with."},
        "claims": {"type": "array", "items": claim, "description": "Dynamic resource claims."},
    })


def _tolerations() -> Schema:
    toleration = _obj("A taint the pods tolerate.", {
        "key": _str("The taint key; empty with Exists: every taint."),
        "operator": _str("Equal (the default) or Exists.", enum=["", "Equal", "Exists"]),
        "value": _str("The taint value, with Equal."),
        "effect": _str("The taint effect to match; empty: every effect.",
                       enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": {"type": "integer", "format": "int64",
                              "description": "With NoExecute: how long the pod stays bound after the taint."},
    })
    return {"type": "array", "description": "Pod tolerations.", "items": toleration}


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
    if f.pattern is not None:
        node["pattern"], node["maxLength"] = f.pattern, MAX_NAME_LENGTH
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
        resources=_resources(),
        nodeSelector={
            "type": "object",
            "description": "Node labels the pods must match.",
            "additionalProperties": {"type": "string"},
        },
        tolerations=_tolerations(),
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
        scaling=scaling_schema(),
    )
    del top["default"]  # the spec itself is required, and so is its model
    return top | {"required": ["model"]}


def _role_status(role: str) -> Schema:
    n = {"type": "integer", "format": "int32"}
    return _obj(f"The {role} pods.", {"replicas": n, "updated": n, "ready": n, "linked": n, "draining": n})


def _role_scaling(role: str) -> Schema:
    return _obj(f"Who sets the {role} count, and to what (docs/autoscaling.md).", {
        "owner": _str(f"static (spec.{role}.replicas), external (the DisaggRole <name>-{role}'s spec.replicas) or "
                      "autoscaler (spec.scaling.autoscaler).", enum=list(s.OWNERS)),
        "desired": {"type": "integer", "format": "int32", "description": "The count the operator scales the role to."},
        # The built-in autoscaler's latest decision, while it owns the role (docs/autoscaling.md).
        "outcome": _str("scale-up, scale-down or hold.", enum=["scale-up", "scale-down", "hold"]),
        "hold": _str("Why the role held: steady, metrics-missing, metrics-stale, stabilising, rollout-in-progress; "
                     "empty when it moved."),
        "reason": _str("The signals behind the decision."),
        "lastScaleTime": _str("When the autoscaler last changed the count; empty before it has.",
                              pattern=r"^$|^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"),
    })


def status_schema() -> Schema:
    n = {"type": "integer", "format": "int32"}
    condition = _obj("A condition, as in Kubernetes objects.", {
        "type": _str("Available, Progressing, Degraded, LinksReady; MetricsAvailable (built-in autoscaler); "
                     "SpecValid (False while the spec is invalid in a way the schema cannot refuse)."),
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
        "scaling": _obj("Per role, who sets its count; the P:D ratio band's adjustment.", {
            **{role: _role_scaling(role) for role in s.ROLES},
            "ratio": _str("What the P:D ratio band (spec.scaling.ratio) changed in the owners' counts, and why; "
                          "empty when they were inside it."),
        }),
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


def _definition(kind: str, plural: str, short_name: str, subresources: Schema, columns: list[Schema],
                description: str, spec: Schema, status: Schema, name: Schema | None = None) -> Schema:
    """A namespaced CustomResourceDefinition object (apiextensions.k8s.io/v1) of one version;
    `name`: what the objects' names must be, beyond the API server's own rule."""
    metadata: Schema = {"type": "object"} | ({"properties": {"name": name}} if name else {})
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": kind.lower(), "shortNames": [short_name]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": subresources,
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": _obj(
                    description,
                    {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                     "metadata": metadata, "spec": spec, "status": status},
                    required=["spec"],
                )},
            }],
        },
    }


def crd() -> Schema:
    """The DisaggCluster CustomResourceDefinition."""
    # The name becomes the Service's (a DNS-1035 label) and prefixes the pods' names.
    name = {"type": "string", "pattern": s.DNS_LABEL, "maxLength": s.MAX_CLUSTER_NAME}
    return _definition(KIND, PLURAL, SHORT_NAME, {"status": {}}, printer_columns(),
                       "A prefill/decode disaggregated LLM serving cluster.", spec_schema(), status_schema(), name)


def role_crd() -> Schema:
    """The DisaggRole CustomResourceDefinition: one role of a DisaggCluster, with a `/scale` subresource."""
    n = {"type": "integer", "format": "int32"}
    spec = _obj("The role's pod count, as a scaler sets it.", {
        "replicas": {**n, "minimum": 0, "maximum": s.MAX_REPLICAS, "description":
                     "Pods of the role. The truth only when status.owner is external (HPA, KEDA, kubectl scale); "
                     "otherwise the operator writes it back (docs/autoscaling.md)."},
    }, required=["replicas"])
    status = _obj("The observed state, written by the operator.", {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "replicas": {**n, "description": "Active pods of the role (not draining, not terminating)."},
        "ready": {**n, "description": "Pods serving: ready and linked."},
        "desired": {**n, "description": "The count the operator scales the role to now."},
        "selector": _str("The role's pods, as a label selector string (for the HPA)."),
        "owner": _str("Who sets the count: static (the cluster's spec.<role>.replicas), external (this "
                      "object's spec.replicas) or autoscaler (spec.scaling.autoscaler).", enum=list(s.OWNERS)),
        "message": _str("Why the desired count is what it is."),
    })
    columns = [
        {"name": "Owner", "type": "string", "jsonPath": ".status.owner", "description": "who sets the count"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desired"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.ready"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
             "labelSelectorPath": ".status.selector"}
    return _definition(ROLE_KIND, ROLE_PLURAL, ROLE_SHORT_NAME, {"status": {}, "scale": scale}, columns,
                       "One role (prefill or decode) of a DisaggCluster, made by the operator; its /scale is "
                       "for HPA, KEDA and `kubectl scale`.", spec, status)


# Per committed file name (deploy/crds/ and the chart's crds/), its CRD.
FILES: dict[str, Callable[[], Schema]] = {
    f"{GROUP}_{PLURAL}.yaml": crd,
    f"{GROUP}_{ROLE_PLURAL}.yaml": role_crd,
}


def render(file: str = f"{GROUP}_{PLURAL}.yaml") -> str:
    """The committed YAML of `file` (a name in FILES)."""
    command = "python -m disagg.operator.crd" + ("" if file == f"{GROUP}_{PLURAL}.yaml" else f" {file}")
    header = f"# Generated by `{command}`; do not edit by hand.\n"
    return header + yaml.safe_dump(FILES[file](), sort_keys=False, width=120)


if __name__ == "__main__":
    if len(sys.argv) > 2 or len(sys.argv) == 2 and sys.argv[1] not in FILES:
        sys.exit(f"usage: python -m disagg.operator.crd [{'|'.join(FILES)}]")
    sys.stdout.write(render(*sys.argv[1:]))
