"""`spec.scaling` of a DisaggCluster: the P:D ratio band and the autoscaler's settings.

Pure: `parse_scaling` reads the `spec.scaling` dict into frozen dataclasses and
`scaling_schema` gives the JSON-schema fragment the CRD plugs in under
`spec.properties.scaling`. The schema rejects what it can at apply time;
`parse_scaling` re-checks everything (a spec may come from an older CRD) and
also what a schema cannot express: min > max, a ratio band that no pair of
counts within the roles' bounds can satisfy. Its errors are `ScalingSpecError`,
a `ValueError` whose message names the field; the operator turns it into a
status condition and an Event (a `kopf.PermanentError`), never a crash loop.

Ratios are decimal strings with at most three decimals ("0.5", "2", "1.25"),
held as integers per mille. Why strings: Kubernetes API conventions keep
floats out of resources (they do not round-trip exactly, and `kubectl` users
read "0.5" more easily than 500); three decimals make per-mille exact, so the
band's arithmetic is integer arithmetic and a count on the boundary is in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

RATIO_PATTERN = r"^[0-9]{1,4}(\.[0-9]{1,3})?$"
MAX_RATIO_PER_MILLE = 1000 * 1000  # "1000": beyond that a band means nothing
MAX_REPLICAS = 256  # as spec.<role>.replicas allows
MAX_STEP = 64
MAX_WINDOW_S = 3600
MAX_TARGET_MS = 600_000
MIN_METRICS_AGE_S, MAX_METRICS_AGE_S = 5, 600

DEFAULT_SCALE_UP_WINDOW_S = 30
DEFAULT_SCALE_DOWN_WINDOW_S = 300  # AIBrix's and HPA's scale-down cooldown
DEFAULT_MAX_STEP = 2
DEFAULT_METRICS_MAX_AGE_S = 60


class ScalingSpecError(ValueError):
    """`spec.scaling` is invalid; the message names the field."""


@dataclass(frozen=True)
class RatioBand:
    """Prefill pods per decode pod, in per mille: min_per_mille * decode <= 1000 * prefill <= max_per_mille * decode."""

    min_per_mille: int
    max_per_mille: int

    def contains(self, prefill: int, decode: int) -> bool:
        return self.min_per_mille * decode <= 1000 * prefill <= self.max_per_mille * decode


@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int
    max_replicas: int
    # The per-pod load a pod of this role carries within the SLO (from
    # benchmarks/profile_roles.py): prompt tokens/s for prefill, running
    # sequences for decode. Optional: without it only latency, queue and KV
    # signals act.
    capacity_per_pod: float | None = None


@dataclass(frozen=True)
class AutoscalerSpec:
    bounds: Mapping[Role, RoleBounds]
    ttft_p90_target_s: float
    tpot_p90_target_s: float
    scale_up_window_s: float = DEFAULT_SCALE_UP_WINDOW_S
    scale_down_window_s: float = DEFAULT_SCALE_DOWN_WINDOW_S
    max_step: int = DEFAULT_MAX_STEP
    metrics_max_age_s: float = DEFAULT_METRICS_MAX_AGE_S

    def target_s(self, role: Role) -> float:
        """The latency target the role answers for: TTFT for prefill, TPOT for decode."""
        return self.ttft_p90_target_s if role == "prefill" else self.tpot_p90_target_s


@dataclass(frozen=True)
class ScalingSpec:
    ratio: RatioBand | None
    autoscaler: AutoscalerSpec | None


# Per role: the capacity field's name in the spec.
CAPACITY_FIELDS: Mapping[Role, str] = {"prefill": "promptTokensPerSecondPerPod", "decode": "sequencesPerPod"}


def parse_ratio(value: Any, where: str) -> int:
    """A decimal string ("0.5") to per mille (500)."""
    if not isinstance(value, str) or not re.match(RATIO_PATTERN, value):
        raise ScalingSpecError(f"{where} must be a decimal string with at most 3 decimals, like \"0.5\"; got {value!r}")
    whole, _, frac = value.partition(".")
    per_mille = int(whole) * 1000 + int(frac.ljust(3, "0") or 0)
    if not 0 < per_mille <= MAX_RATIO_PER_MILLE:
        raise ScalingSpecError(f"{where} must be above 0 and at most 1000, got {value!r}")
    return per_mille


def _number(d: Mapping[str, Any], key: str, where: str, lo: float, hi: float, default: float | None,
            integer: bool = True) -> float | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ScalingSpecError(f"{where}.{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    number = float(value)
    if not lo <= number <= hi:
        raise ScalingSpecError(f"{where}.{key} must be between {lo:g} and {hi:g}, got {value}")
    return number


def _required(d: Mapping[str, Any], key: str, where: str, lo: float, hi: float) -> int:
    if key not in d:
        raise ScalingSpecError(f"{where}.{key} is required")
    value = _number(d, key, where, lo, hi, None)
    assert value is not None
    return int(value)


def _mapping(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any] | None:
    value = d.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ScalingSpecError(f"{where}.{key} must be an object, got {value!r}")
    return value


def _parse_bounds(d: Mapping[str, Any], role: Role, where: str) -> RoleBounds:
    lo = _required(d, "minReplicas", where, 1, MAX_REPLICAS)
    hi = _required(d, "maxReplicas", where, 1, MAX_REPLICAS)
    if lo > hi:
        raise ScalingSpecError(f"{where}.minReplicas ({lo}) is above {where}.maxReplicas ({hi})")
    capacity = _number(d, CAPACITY_FIELDS[role], where, 0.001, 1e9, None, integer=False)
    return RoleBounds(lo, hi, None if capacity is None else float(capacity))


def _parse_autoscaler(d: Mapping[str, Any], where: str) -> AutoscalerSpec:
    bounds: dict[Role, RoleBounds] = {}
    for role in ROLES:
        sub = _mapping(d, role, where)
        if sub is None:
            raise ScalingSpecError(f"{where}.{role} is required (minReplicas, maxReplicas)")
        bounds[role] = _parse_bounds(sub, role, f"{where}.{role}")
    targets = _mapping(d, "targets", where)
    if targets is None:
        raise ScalingSpecError(f"{where}.targets is required (ttftP90Ms, tpotP90Ms)")
    ttft = _required(targets, "ttftP90Ms", f"{where}.targets", 1, MAX_TARGET_MS)
    tpot = _required(targets, "tpotP90Ms", f"{where}.targets", 1, MAX_TARGET_MS)
    up = _number(d, "scaleUpStabilizationSeconds", where, 0, MAX_WINDOW_S, DEFAULT_SCALE_UP_WINDOW_S)
    down = _number(d, "scaleDownStabilizationSeconds", where, 0, MAX_WINDOW_S, DEFAULT_SCALE_DOWN_WINDOW_S)
    step = _number(d, "maxStep", where, 1, MAX_STEP, DEFAULT_MAX_STEP)
    age = _number(d, "metricsMaxAgeSeconds", where, MIN_METRICS_AGE_S, MAX_METRICS_AGE_S,
                  DEFAULT_METRICS_MAX_AGE_S)
    assert up is not None and down is not None and step is not None and age is not None
    return AutoscalerSpec(bounds, ttft / 1000, tpot / 1000, up, down, int(step), age)


def satisfiable(band: RatioBand, prefill: RoleBounds, decode: RoleBounds) -> bool:
    """Whether some counts within both roles' bounds lie in the band."""
    for d in range(decode.min_replicas, decode.max_replicas + 1):
        lowest = max(prefill.min_replicas, -(-band.min_per_mille * d // 1000))  # ceil
        if lowest <= prefill.max_replicas and band.contains(lowest, d):
            return True
    return False


def parse_scaling(scaling: Mapping[str, Any] | None) -> ScalingSpec:
    """`spec.scaling` (absent: no band, no autoscaler) to a ScalingSpec, or ScalingSpecError."""
    where = "spec.scaling"
    if scaling is None:
        return ScalingSpec(None, None)
    if not isinstance(scaling, Mapping):
        raise ScalingSpecError(f"{where} must be an object, got {scaling!r}")
    band = None
    ratio = _mapping(scaling, "ratio", where)
    if ratio is not None:
        lo = parse_ratio(ratio.get("minPrefillPerDecode"), f"{where}.ratio.minPrefillPerDecode")
        hi = parse_ratio(ratio.get("maxPrefillPerDecode"), f"{where}.ratio.maxPrefillPerDecode")
        if lo > hi:
            raise ScalingSpecError(f"{where}.ratio.minPrefillPerDecode ({ratio['minPrefillPerDecode']}) is above "
                                   f"maxPrefillPerDecode ({ratio['maxPrefillPerDecode']})")
        band = RatioBand(lo, hi)
    auto = None
    auto_dict = _mapping(scaling, "autoscaler", where)
    if auto_dict is not None:
        auto = _parse_autoscaler(auto_dict, f"{where}.autoscaler")
    # Without the autoscaler's bounds, a serving cluster's: one pod of each role up to what replicas allow.
    any_count = RoleBounds(1, MAX_REPLICAS)
    p, d = (any_count, any_count) if auto is None else (auto.bounds["prefill"], auto.bounds["decode"])
    if band is not None and not satisfiable(band, p, d):
        raise ScalingSpecError(
            f"{where}.ratio: no counts satisfy the band {ratio!r} with prefill in "
            f"[{p.min_replicas}, {p.max_replicas}] and decode in [{d.min_replicas}, {d.max_replicas}]")
    return ScalingSpec(band, auto)


def _int(lo: int, hi: int, default: int | None = None, description: str = "") -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": hi, "description": description}
    if default is not None:
        schema["default"] = default
    return schema


def scaling_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of `spec.scaling`, for the CRD's `spec.properties.scaling`."""
    limit = MAX_RATIO_PER_MILLE // 1000
    ratio_field = {"type": "string", "pattern": RATIO_PATTERN, "maxLength": 8,  # bounds the CEL rules' cost
                   "description": f"Prefill pods per decode pod, a decimal string with at most 3 decimals, "
                                  f"above 0 and at most {limit}.",
                   "x-kubernetes-validations": [{"rule": f"double(self) > 0.0 && double(self) <= {limit}.0",
                                                 "message": f"must be above 0 and at most {limit}"}]}

    def role(role_name: Role, capacity_doc: str) -> dict[str, Any]:
        return {
            "type": "object", "required": ["minReplicas", "maxReplicas"],
            "x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas",
                                          "message": "minReplicas must not be above maxReplicas"}],
            "properties": {
                "minReplicas": _int(1, MAX_REPLICAS, description="Never fewer pods (at least 1)."),
                "maxReplicas": _int(1, MAX_REPLICAS, description="Never more pods."),
                CAPACITY_FIELDS[role_name]: {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                             "description": capacity_doc},
            },
        }

    return {
        "type": "object",
        "description": "Elastic roles: a P:D ratio band and the built-in SLO autoscaler (docs/autoscaling.md).",
        "properties": {
            "ratio": {
                "type": "object", "required": ["minPrefillPerDecode", "maxPrefillPerDecode"],
                "x-kubernetes-validations": [{
                    "rule": "double(self.minPrefillPerDecode) <= double(self.maxPrefillPerDecode)",
                    "message": "minPrefillPerDecode must not be above maxPrefillPerDecode"}],
                "properties": {"minPrefillPerDecode": ratio_field, "maxPrefillPerDecode": ratio_field},
            },
            "autoscaler": {
                "type": "object", "required": ["prefill", "decode", "targets"],
                "properties": {
                    "prefill": role("prefill", "Prompt tokens/s one prefill pod serves within the TTFT target "
                                               "(benchmarks/profile_roles.py); optional."),
                    "decode": role("decode", "Running sequences one decode pod serves within the TPOT target "
                                             "(benchmarks/profile_roles.py); optional."),
                    "targets": {
                        "type": "object", "required": ["ttftP90Ms", "tpotP90Ms"],
                        "properties": {
                            "ttftP90Ms": _int(1, MAX_TARGET_MS, description="p90 time to first token, ms."),
                            "tpotP90Ms": _int(1, MAX_TARGET_MS, description="p90 time per output token, ms."),
                        },
                    },
                    "scaleUpStabilizationSeconds": _int(0, MAX_WINDOW_S, DEFAULT_SCALE_UP_WINDOW_S,
                                                        "Scale up to the lowest recommendation of this window."),
                    "scaleDownStabilizationSeconds": _int(0, MAX_WINDOW_S, DEFAULT_SCALE_DOWN_WINDOW_S,
                                                          "Scale down to the highest recommendation of this window."),
                    "maxStep": _int(1, MAX_STEP, DEFAULT_MAX_STEP, "Most pods added or removed per decision."),
                    "metricsMaxAgeSeconds": _int(MIN_METRICS_AGE_S, MAX_METRICS_AGE_S, DEFAULT_METRICS_MAX_AGE_S,
                                                 "Older metrics count as missing: the autoscaler holds."),
                },
            },
        },
    }
