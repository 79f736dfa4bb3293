"""The `DisaggCluster` spec as frozen dataclasses.

`parse_spec` is the one place that reads the spec dict. The API server's
schema (crd.py, built from the defaults and choices below) already rejects
most bad specs; this re-checks what the schema cannot express and raises
`kopf.PermanentError`, since retrying an invalid spec cannot help.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

ROLES = ("prefill", "decode")
KV_TRANSFER_MODES = ("PUSH", "PULL")
KV_TRANSPORTS = ("tcp", "cuda_ipc", "nccl")
MAX_KV_CONNECTIONS = 64  # as `disagg serve --kv-connections` accepts
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

# Defaults, written once: the CRD schema publishes them and parse_spec applies them.
DEFAULT_IMAGE = "ghcr.io/disagg/worker:0.1.0"
DEFAULT_REPLICAS = 1
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DTYPE = "auto"
DEFAULT_DEVICE = "auto"
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_KV_MODE = "PUSH"
DEFAULT_KV_TRANSPORT = "tcp"
DEFAULT_SERVICE_TYPE = "ClusterIP"
DEFAULT_SERVICE_PORT = 8000
DEFAULT_DRAIN_TIMEOUT_S = 60
MAX_REPLICAS = 256
MAX_DRAIN_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ModelSpec:
    source: str
    served_name: str  # the name clients send; defaults to the source


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods. Kubernetes-shaped fields are kept as the API's dicts."""

    replicas: int
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    priority_class_name: str
    env: tuple[Mapping[str, Any], ...]
    args: tuple[str, ...]  # extra `disagg serve` arguments


@dataclass(frozen=True)
class KvTransferSpec:
    mode: str
    transport: str
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
class ClusterSpec:
    model: ModelSpec
    image: str
    image_pull_policy: str
    prefill: RoleSpec
    decode: RoleSpec
    kv_transfer: KvTransferSpec
    engine: EngineSpec
    service: ServiceSpec
    drain_timeout_s: int

    def role(self, name: str) -> RoleSpec:
        assert name in ROLES, f"unknown role {name!r}"
        return self.prefill if name == "prefill" else self.decode

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


def _choice(d: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str, where: str) -> str:
    value: str = _get(d, key, str, default, where)
    if value not in choices:
        raise kopf.PermanentError(f"{where}.{key} must be one of {list(choices)}, got {value!r}")
    return value


def _int(d: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int, where: str) -> Any:
    value = _get(d, key, int, default, where)
    if value is not None and not lo <= value <= hi:
        raise kopf.PermanentError(f"{where}.{key} must be between {lo} and {hi}, got {value}")
    return value


def _role(d: Mapping[str, Any], where: str) -> RoleSpec:
    args = _get(d, "args", list, [], where)
    if not all(isinstance(a, str) for a in args):
        raise kopf.PermanentError(f"{where}.args must be a list of strings")
    return RoleSpec(
        replicas=_int(d, "replicas", DEFAULT_REPLICAS, 0, MAX_REPLICAS, where),
        resources=_get(d, "resources", dict, {}, where),
        node_selector=_get(d, "nodeSelector", dict, {}, where),
        tolerations=tuple(_get(d, "tolerations", list, [], where)),
        affinity=_get(d, "affinity", dict, {}, where),
        priority_class_name=_get(d, "priorityClassName", str, "", where),
        env=tuple(_get(d, "env", list, [], where)),
        args=tuple(args),
    )


def parse_spec(spec: Mapping[str, Any]) -> ClusterSpec:
    """The typed spec; kopf.PermanentError names the first invalid field."""
    model = _get(spec, "model", dict, None, "spec")
    if model is None or not model.get("source"):
        raise kopf.PermanentError("spec.model.source is required (a model folder, a GGUF file or builtin:NAME)")
    source: str = _get(model, "source", str, None, "spec.model")
    engine = _get(spec, "engine", dict, {}, "spec")
    kv = _get(spec, "kvTransfer", dict, {}, "spec")
    service = _get(spec, "service", dict, {}, "spec")
    drain = _get(spec, "drain", dict, {}, "spec")
    return ClusterSpec(
        model=ModelSpec(source=source, served_name=_get(model, "servedName", str, source, "spec.model")),
        image=_get(spec, "image", str, DEFAULT_IMAGE, "spec"),
        image_pull_policy=_choice(spec, "imagePullPolicy", PULL_POLICIES, "IfNotPresent", "spec"),
        prefill=_role(_get(spec, "prefill", dict, {}, "spec"), "spec.prefill"),
        decode=_role(_get(spec, "decode", dict, {}, "spec"), "spec.decode"),
        kv_transfer=KvTransferSpec(
            mode=_choice(kv, "mode", KV_TRANSFER_MODES, DEFAULT_KV_MODE, "spec.kvTransfer"),
            transport=_choice(kv, "transport", KV_TRANSPORTS, DEFAULT_KV_TRANSPORT, "spec.kvTransfer"),
            connections=_int(kv, "connections", None, 1, MAX_KV_CONNECTIONS, "spec.kvTransfer"),
        ),
        engine=EngineSpec(
            block_size=_int(engine, "blockSize", DEFAULT_BLOCK_SIZE, 1, 1024, "spec.engine"),
            dtype=_choice(engine, "dtype", DTYPES, DEFAULT_DTYPE, "spec.engine"),
            device=_choice(engine, "device", DEVICES, DEFAULT_DEVICE, "spec.engine"),
            max_num_seqs=_int(engine, "maxNumSeqs", DEFAULT_MAX_NUM_SEQS, 1, 4096, "spec.engine"),
            num_kv_blocks=_int(engine, "numKvBlocks", None, 1, 1 << 24, "spec.engine"),
        ),
        service=ServiceSpec(
            type=_choice(service, "type", SERVICE_TYPES, DEFAULT_SERVICE_TYPE, "spec.service"),
            port=_int(service, "port", DEFAULT_SERVICE_PORT, 1, 65535, "spec.service"),
        ),
        drain_timeout_s=_int(drain, "timeoutSeconds", DEFAULT_DRAIN_TIMEOUT_S, 0, MAX_DRAIN_TIMEOUT_S, "spec.drain"),
    )
