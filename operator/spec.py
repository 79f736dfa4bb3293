"""The `DisaggCluster` spec as frozen dataclasses, and `FIELDS`, its one field table.

Each scalar field is declared once in `FIELDS` (key, type, default, bounds or
choices, description, worker flag): `parse_spec` reads the spec dict by it,
crd.py builds the API server's schema from it, and manifests.worker_args the
worker's command line (`flag_values`). Choices shared with the workers come
from disagg.proto.vocabulary. The schema already rejects most bad specs;
parse_spec re-checks, and raises `kopf.PermanentError`, since retrying an
invalid spec cannot help.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import kopf

from disagg.operator.scaling import ScalingSpec, ScalingSpecError, parse_scaling
from disagg.proto.vocabulary import (
    DEVICES,
    DTYPES,
    HTTP_PORT,
    KV_CHECKSUMS,
    MAX_KV_CONNECTIONS,
    MAX_PORT,
    PD_POLICIES,
    POD_ROLES,
    TRANSFER_MODES,
    TRANSPORTS,
    PDPolicy,
    TransferMode,
    Transport,
)

ROLES = POD_ROLES
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# Who sets a role's pod count (docs/autoscaling.md, "Who owns a role's replica count").
STATIC, EXTERNAL, AUTOSCALER = "static", "external", "autoscaler"
SCALING_MODES = (STATIC, EXTERNAL)  # what spec.<role>.scaling chooses
OWNERS = (*SCALING_MODES, AUTOSCALER)  # the built-in autoscaler owns the roles of a spec.scaling.autoscaler
BLOCK_SIZES = tuple(1 << i for i in range(11))  # the engine takes powers of two; up to 1024

# Defaults, written once: the CRD schema publishes them and parse_spec applies them.
DEFAULT_IMAGE = "ghcr.io/disagg/worker:0.1.0"
DEFAULT_REPLICAS = 1
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DRAIN_TIMEOUT_S = 60
MAX_REPLICAS = 256
MAX_DRAIN_TIMEOUT_S = 3600

# The forms Kubernetes requires of names and Secret keys: refused at apply, not by the API server
# refusing the pods made from them later.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a Service's name (DNS-1035)
# A cluster's name: the Service's (a DNS-1035 label, at most 63 characters) and the prefix of its
# pods' names, with room left for "-prefill-xxxxx". The CRD refuses any other at apply.
MAX_CLUSTER_NAME = 47
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"


@dataclass(frozen=True)
class Field:
    """One scalar field of the spec: what parse_spec, the CRD schema (crd.py)
    and the worker's command line (manifests.worker_args) read from it."""

    section: str  # the spec key that holds it; "" is the spec itself, "role" each of prefill and decode
    name: str  # its camelCase key there
    attr: str  # the attribute it fills in the section's dataclass (ClusterSpec's for "" and "drain")
    kind: type[int] | type[str] | type[bool]
    default: int | str | bool | None  # None: unset unless given
    description: str  # "{role}" is replaced by the role's name
    bounds: tuple[int, int] | None = None
    choices: tuple[int | str, ...] = ()
    flag: str | None = None  # the `disagg serve` flag it becomes; an unset (or false) field passes none
    required: bool = False
    nonblank: bool = False  # a string with something other than spaces
    pattern: str | None = None  # a string's form (an OpenAPI pattern: anchored here), what the pod's API checks


FIELDS: tuple[Field, ...] = (
    Field("model", "source", "source", str, None, "A Hugging Face model folder, a GGUF file, or builtin:NAME.",
          flag="--model", required=True, nonblank=True),
    Field("model", "servedName", "served_name", str, None, "The model name clients send (default: the source).",
          flag="--served-model-name", nonblank=True),
    Field("", "image", "image", str, DEFAULT_IMAGE, "The worker image.", nonblank=True),
    Field("", "imagePullPolicy", "image_pull_policy", str, "IfNotPresent", "The worker image's pull policy.",
          choices=PULL_POLICIES),
    Field("role", "replicas", "replicas", int, DEFAULT_REPLICAS, "Number of {role} pods.", bounds=(0, MAX_REPLICAS)),
    Field("role", "scaling", "scaling", str, STATIC,
          "Who sets the number of {role} pods: static (spec.{role}.replicas) or external (the spec.replicas of the "
          "DisaggRole <cluster>-{role}, through its /scale: HPA, KEDA, kubectl scale).", choices=SCALING_MODES),
    Field("role", "priorityClassName", "priority_class_name", str, None, "Pod priority class.",
          pattern=DNS_SUBDOMAIN),
    Field("kvTransfer", "mode", "mode", str, TransferMode.PUSH.value,
          "PUSH: the prefill writes each layer as it computes; PULL: the decode reads.",
          choices=TRANSFER_MODES, flag="--kv-transfer-mode"),
    Field("kvTransfer", "transport", "transport", str, Transport.TCP.value, "The KV data path.",
          choices=TRANSPORTS, flag="--kv-transport"),
    Field("kvTransfer", "policy", "policy", str, PDPolicy.ALWAYS.value,
          "always: every request is handed to a decode; auto: a prefill serves a request itself when the "
          "hand-off costs more than it saves (short uncached prompts, decodes full).",
          choices=PD_POLICIES, flag="--pd-policy"),
    Field("kvTransfer", "localMaxPromptTokens", "local_max_tokens", int, None,
          "auto: uncached prompt tokens a prefill always serves itself (default: the worker's).",
          bounds=(0, 1 << 20), flag="--pd-local-max-tokens"),
    Field("kvTransfer", "localMaxRunning", "local_max_running", int, None,
          "auto: requests a prefill serves itself at once (default: the worker's).",
          bounds=(1, 4096), flag="--pd-local-max-running"),
    Field("kvTransfer", "checksum", "checksum", str, KV_CHECKSUMS[0],
          "Payload checksum of TCP KV links: auto skips it on loopback and TLS links, where it buys nothing, "
          "and uses xxh3 between hosts in plaintext.", choices=KV_CHECKSUMS, flag="--kv-checksum"),
    Field("kvTransfer", "connections", "connections", int, None,
          "TCP connections a decode opens per link (default: one per two CPUs of the pod, 1 to 4).",
          bounds=(1, MAX_KV_CONNECTIONS), flag="--kv-connections"),
    Field("engine", "blockSize", "block_size", int, DEFAULT_BLOCK_SIZE, "Tokens per KV block (a power of two).",
          bounds=(BLOCK_SIZES[0], BLOCK_SIZES[-1]), choices=BLOCK_SIZES, flag="--block-size"),
    Field("engine", "dtype", "dtype", str, "auto", "Weights and KV dtype.", choices=DTYPES, flag="--dtype"),
    Field("engine", "device", "device", str, "auto", "Where the model runs.", choices=DEVICES, flag="--device"),
    Field("engine", "maxNumSeqs", "max_num_seqs", int, 64, "Sequences in one batch.", bounds=(1, 4096),
          flag="--max-num-seqs"),
    Field("engine", "numKvBlocks", "num_kv_blocks", int, None, "KV blocks per worker (default: sized from memory).",
          bounds=(1, 1 << 24), flag="--num-kv-blocks"),
    Field("service", "type", "type", str, "ClusterIP", "Service type.", choices=SERVICE_TYPES),
    Field("service", "port", "port", int, HTTP_PORT, "Service port.", bounds=(1, MAX_PORT)),
    Field("drain", "timeoutSeconds", "drain_timeout_s", int, DEFAULT_DRAIN_TIMEOUT_S,
          "How long a removed pod may finish its in-flight requests.", bounds=(0, MAX_DRAIN_TIMEOUT_S)),
    Field("security", "insecure", "insecure", bool, False,
          "Run the workers without the cluster key (no authentication of control calls and KV transfer): "
          "only for trusted networks.", flag="--insecure"),
    Field("security", "allowAnonymousPeers", "allow_anonymous_peers", bool, False,
          "Accept control calls that carry no credential at all (an xLLM peer); wrong ones are still refused.",
          flag="--allow-anonymous-peers"),
    Field("security", "tlsSecretName", "tls_secret_name", str, None,
          "A Secret in cert-manager's layout (tls.crt, tls.key, ca.crt) whose certificate names `disagg-worker`: "
          "mutual TLS on the workers' gRPC and TCP KV transfer.", pattern=DNS_SUBDOMAIN),
    Field("security", "apiKeySecretName", "api_key_secret_name", str, None,
          "A Secret in the cluster's namespace holding the client API key: the prefill pods then answer "
          "/v1 only with `Authorization: Bearer <key>`.", pattern=DNS_SUBDOMAIN),
    Field("security", "apiKeySecretKey", "api_key_secret_key", str, "key", "The item of that Secret holding the key.",
          pattern=SECRET_KEY),
)


def fields(section: str) -> tuple[Field, ...]:
    return tuple(f for f in FIELDS if f.section == section)


@dataclass(frozen=True)
class ModelSpec:
    source: str
    served_name: str  # the name clients send; defaults to the source


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods. Kubernetes-shaped fields are kept as the API's dicts."""

    replicas: int
    scaling: str  # one of SCALING_MODES
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    priority_class_name: str | None
    env: tuple[Mapping[str, Any], ...]
    args: tuple[str, ...]  # extra `disagg serve` arguments


@dataclass(frozen=True)
class KvTransferSpec:
    mode: str
    policy: str
    local_max_tokens: int | None
    local_max_running: int | None
    transport: str
    checksum: str
    connections: int | None  # TCP connections per link; None: the worker's default for its CPUs


@dataclass(frozen=True)
class EngineSpec:
    block_size: int
    dtype: str
    device: str
    max_num_seqs: int
    num_kv_blocks: int | None  # None: the worker sizes its pool from memory


@dataclass(frozen=True)
class ServiceSpec:
    type: str
    port: int


@dataclass(frozen=True)
class SecuritySpec:
    insecure: bool  # no cluster key: the operator makes no Secret and the workers run --insecure
    allow_anonymous_peers: bool
    tls_secret_name: str | None  # mutual TLS between the workers (and the operator's link calls)
    api_key_secret_name: str | None  # the clients' API key, for the prefill pods (the client endpoint)
    api_key_secret_key: str


@dataclass(frozen=True)
class ClusterSpec:
    model: ModelSpec
    image: str
    image_pull_policy: str
    prefill: RoleSpec
    decode: RoleSpec
    kv_transfer: KvTransferSpec
    engine: EngineSpec
    service: ServiceSpec
    security: SecuritySpec
    drain_timeout_s: int
    scaling: ScalingSpec  # spec.scaling: the P:D ratio band and the autoscaler's settings (scaling.py)

    def role(self, name: str) -> RoleSpec:
        assert name in ROLES, f"unknown role {name!r}"
        return self.prefill if name == "prefill" else self.decode

    def with_replicas(self, replicas: Mapping[str, int]) -> ClusterSpec:
        """This spec with the roles' counts as their owners decided (operator/roles.py): what the pass plans with."""
        def count(role: str) -> RoleSpec:
            spec = self.role(role)
            return replace(spec, replicas=replicas.get(role, spec.replicas))

        return replace(self, prefill=count("prefill"), decode=count("decode"))

    @property
    def kv_layout(self) -> str:
        """A short hash of what makes two workers' KV caches compatible: pods
        are only linked when theirs are equal."""
        identity = f"{self.model.source}|{self.engine.dtype}|{self.engine.block_size}"
        return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _get(d: Mapping[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise kopf.PermanentError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


def _value(d: Mapping[str, Any], f: Field, where: str) -> Any:
    value = _get(d, f.name, f.kind, f.default, where)
    if value is None:
        return None
    if f.bounds is not None and not f.bounds[0] <= value <= f.bounds[1]:
        raise kopf.PermanentError(f"{where}.{f.name} must be between {f.bounds[0]} and {f.bounds[1]}, got {value}")
    if f.choices and value not in f.choices:
        raise kopf.PermanentError(f"{where}.{f.name} must be one of {list(f.choices)}, got {value!r}")
    if f.nonblank and not value.strip():
        raise kopf.PermanentError(f"{where}.{f.name} must not be blank")
    if f.pattern is not None and not re.search(f.pattern, value):
        raise kopf.PermanentError(f"{where}.{f.name} must match {f.pattern}, got {value!r}")
    return value


def _values(d: Mapping[str, Any], section: str, where: str) -> dict[str, Any]:
    """The table's fields of `section`, read from its dict `d`, by attribute name."""
    return {f.attr: _value(d, f, where) for f in fields(section)}


def _role(d: Mapping[str, Any], where: str) -> RoleSpec:
    args = _get(d, "args", list, [], where)
    if not all(isinstance(a, str) for a in args):
        raise kopf.PermanentError(f"{where}.args must be a list of strings")
    return RoleSpec(
        **_values(d, "role", where),
        resources=_get(d, "resources", dict, {}, where),
        node_selector=_get(d, "nodeSelector", dict, {}, where),
        tolerations=tuple(_get(d, "tolerations", list, [], where)),
        affinity=_get(d, "affinity", dict, {}, where),
        env=tuple(_get(d, "env", list, [], where)),
        args=tuple(args),
    )


def parse_spec(spec: Mapping[str, Any]) -> ClusterSpec:
    """The typed spec; kopf.PermanentError names the first invalid field."""
    model = _get(spec, "model", dict, None, "spec")
    if model is None or not model.get("source"):
        raise kopf.PermanentError("spec.model.source is required (a model folder, a GGUF file or builtin:NAME)")
    named = _values(model, "model", "spec.model")
    try:
        scaling = parse_scaling(_get(spec, "scaling", dict, None, "spec"))
    except ScalingSpecError as e:  # what the schema cannot refuse: min above max, a band no counts satisfy
        raise kopf.PermanentError(str(e)) from e

    def section(key: str) -> dict[str, Any]:
        return _values(_get(spec, key, dict, {}, "spec"), key, f"spec.{key}")

    return ClusterSpec(
        model=ModelSpec(source=named["source"], served_name=named["served_name"] or named["source"]),
        **_values(spec, "", "spec"),
        prefill=_role(_get(spec, "prefill", dict, {}, "spec"), "spec.prefill"),
        decode=_role(_get(spec, "decode", dict, {}, "spec"), "spec.decode"),
        kv_transfer=KvTransferSpec(**section("kvTransfer")),
        engine=EngineSpec(**section("engine")),
        service=ServiceSpec(**section("service")),
        security=SecuritySpec(**section("security")),
        **section("drain"),
        scaling=scaling,
    )


def flag_args(spec: ClusterSpec, role: str) -> list[str]:
    """The `disagg serve` arguments of every set field that becomes a flag, in table order:
    a boolean's flag alone when true, any other flag followed by its value."""
    holders: dict[str, object] = {"": spec, "drain": spec, "role": spec.role(role), "model": spec.model,
                                  "kvTransfer": spec.kv_transfer, "engine": spec.engine, "service": spec.service,
                                  "security": spec.security}
    out: list[str] = []
    for f in FIELDS:
        value = getattr(holders[f.section], f.attr)
        if f.flag is None or value is None or value is False:
            continue
        out += [f.flag] if value is True else [f.flag, str(value)]
    return out
