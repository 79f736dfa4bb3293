"""A container's environment, command line and working folder, as a kubelet builds them.

Pure functions over pods as the API serves them (JSON dicts, camelCase keys),
so they are testable without a cluster. ConfigMaps and Secrets are read
through a `SourceLookup`.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

# A pod or a container as the API serves it.
Obj = dict[str, Any]

# (kind, namespace, name) -> the object's data, or None when it does not exist.
# kind is "ConfigMap" or "Secret"; a Secret's values arrive base64-encoded.
SourceLookup = Callable[[str, str, str], "dict[str, str] | None"]


class PodConfigError(ValueError):
    """The container cannot be started as specified (the kubelet's CreateContainerConfigError)."""


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` escapes a `$`,
    and references to undefined names stay as written."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(repl, text)


_LABEL_OR_ANNOTATION = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    """The value of a downward-API `fieldRef` path."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path] or "")
    m = _LABEL_OR_ANNOTATION.match(path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise PodConfigError(f"unsupported fieldRef.fieldPath {path!r}")


def _decode(kind: str, value: str) -> str:
    return base64.b64decode(value).decode() if kind == "Secret" else value


def _source(lookup: SourceLookup, kind: str, namespace: str, ref: Obj) -> dict[str, str]:
    data = lookup(kind, namespace, ref["name"])
    if data is None:
        if ref.get("optional"):
            return {}
        raise PodConfigError(f"{kind.lower()} {ref['name']!r} not found")
    return {k: _decode(kind, v) for k, v in data.items()}


def container_env(pod: Obj, container: Obj, pod_ip: str, host_ip: str, lookup: SourceLookup) -> dict[str, str]:
    """The variables the pod spec defines for `container` (envFrom first, then env, in order)."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            data = _source(lookup, "ConfigMap", namespace, src["configMapRef"])
        elif "secretRef" in src:
            data = _source(lookup, "Secret", namespace, src["secretRef"])
        else:
            raise PodConfigError("envFrom entry names neither a configMapRef nor a secretRef")
        prefix = src.get("prefix", "")
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env", []):
        name, vf = var["name"], var.get("valueFrom")
        if vf is None:
            # Later values may refer to earlier ones, as in the kubelet.
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            kind = "ConfigMap" if "configMapKeyRef" in vf else "Secret"
            ref = vf["configMapKeyRef"] if kind == "ConfigMap" else vf["secretKeyRef"]
            data = _source(lookup, kind, namespace, ref)
            if ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional"):
                raise PodConfigError(f"key {ref['key']!r} not in {kind.lower()} {ref['name']!r}")
        else:
            raise PodConfigError(f"env {name!r}: unsupported valueFrom (only fieldRef, configMapKeyRef, secretKeyRef)")
    return env


def command_line(container: Obj, env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; the local kubelet has no image entrypoint to fall back on."""
    if not container.get("command"):
        raise PodConfigError(
            f"container {container['name']!r} has no command: the local kubelet runs the command "
            "on this machine and cannot use an image's entrypoint"
        )
    return [expand(a, env) for a in container["command"] + container.get("args", [])]


def container_port(container: Obj, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodConfigError(f"container {container['name']!r} has no port named {port!r}")
