"""A container's environment, command line and working folder, as a kubelet builds them.

Pure functions over the `kubernetes` client's models, so they are testable
without a cluster. ConfigMaps and Secrets are read through a `SourceLookup`.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping

from kubernetes.client import V1Container, V1Pod

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


def field_ref(pod: V1Pod, path: str, pod_ip: str, host_ip: str) -> str:
    """The value of a downward-API `fieldRef` path."""
    meta, spec = pod.metadata, pod.spec
    simple = {
        "metadata.name": meta.name,
        "metadata.namespace": meta.namespace,
        "metadata.uid": meta.uid,
        "spec.nodeName": spec.node_name,
        "spec.serviceAccountName": spec.service_account_name,
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path] or ""
    m = _LABEL_OR_ANNOTATION.match(path)
    if m:
        source = meta.labels if m.group(1) == "labels" else meta.annotations
        return (source or {}).get(m.group(2), "")
    raise PodConfigError(f"unsupported fieldRef.fieldPath {path!r}")


def _decode(kind: str, value: str) -> str:
    return base64.b64decode(value).decode() if kind == "Secret" else value


def _source(lookup: SourceLookup, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str]:
    data = lookup(kind, namespace, name)
    if data is None:
        if optional:
            return {}
        raise PodConfigError(f"{kind.lower()} {name!r} not found")
    return {k: _decode(kind, v) for k, v in data.items()}


def container_env(
    pod: V1Pod,
    container: V1Container,
    pod_ip: str,
    host_ip: str,
    lookup: SourceLookup,
) -> dict[str, str]:
    """The variables the pod spec defines for `container` (envFrom first, then env, in order)."""
    namespace = pod.metadata.namespace
    env: dict[str, str] = {}
    for src in container.env_from or []:
        prefix = src.prefix or ""
        if src.config_map_ref is not None:
            ref = src.config_map_ref
            data = _source(lookup, "ConfigMap", namespace, ref.name, bool(ref.optional))
        elif src.secret_ref is not None:
            ref = src.secret_ref
            data = _source(lookup, "Secret", namespace, ref.name, bool(ref.optional))
        else:
            raise PodConfigError("envFrom entry names neither a configMapRef nor a secretRef")
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.env or []:
        vf = var.value_from
        if vf is None:
            # Later values may refer to earlier ones, as in the kubelet.
            env[var.name] = expand(var.value or "", env)
        elif vf.field_ref is not None:
            env[var.name] = field_ref(pod, vf.field_ref.field_path, pod_ip, host_ip)
        elif vf.config_map_key_ref is not None or vf.secret_key_ref is not None:
            kind = "ConfigMap" if vf.config_map_key_ref is not None else "Secret"
            ref = vf.config_map_key_ref or vf.secret_key_ref
            data = _source(lookup, kind, namespace, ref.name, bool(ref.optional))
            if ref.key in data:
                env[var.name] = data[ref.key]
            elif not ref.optional:
                raise PodConfigError(f"key {ref.key!r} not in {kind.lower()} {ref.name!r}")
        else:
            raise PodConfigError(f"env {var.name!r}: unsupported valueFrom (only fieldRef, configMapKeyRef, secretKeyRef)")
    return env


def command_line(container: V1Container, env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; the local kubelet has no image entrypoint to fall back on."""
    argv = [expand(a, env) for a in (container.command or []) + (container.args or [])]
    if not container.command:
        raise PodConfigError(
            f"container {container.name!r} has no command: the local kubelet runs the command "
            "on this machine and cannot use an image's entrypoint"
        )
    return argv


def container_port(container: V1Container, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for p in container.ports or []:
        if p.name == port:
            return int(p.container_port)
    raise PodConfigError(f"container {container.name!r} has no port named {port!r}")
