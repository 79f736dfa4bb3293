"""Secret volumes for the local kubelet: files kept in step with their Secrets.

A pod's process runs on this machine's filesystem, where it cannot mount
anything, so each Secret volume is written into a folder of its own under
the kubelet's work folder, and the container's mount path is rewritten to
that folder wherever it appears in the command line or the environment (the
local kubelet's stand-in for a mount, as a kubeconfig stands in for the
service account token). As a kubelet does, the files follow the Secret: each
sync rewrites a changed item atomically (a new file renamed over the old),
and a Secret that is gone leaves the last files in place.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from disagg.testing.podenv import Obj, PodConfigError, SourceLookup


@dataclass(frozen=True)
class SecretVolume:
    name: str
    secret: str
    folder: Path
    mode: int
    optional: bool


def secret_volumes(pod: Obj, root: Path) -> list[SecretVolume]:
    """The pod's Secret volumes, each with its folder under `root`. Other kinds are not
    mounted (the service account token's projected volume has its kubeconfig instead)."""
    out = []
    for volume in pod["spec"].get("volumes") or []:
        source = volume.get("secret")
        if source is None:
            continue
        if source.get("items"):
            raise PodConfigError(f"volume {volume['name']!r}: secret items are not supported here; mount the whole Secret")
        out.append(SecretVolume(volume["name"], source["secretName"], root / volume["name"],
                                int(source.get("defaultMode", 0o644)), bool(source.get("optional", False))))
    return out


def mount_paths(container: Obj, volumes: list[SecretVolume]) -> dict[str, Path]:
    """The container's mount path of each Secret volume -> the folder that stands in for it."""
    by_name = {v.name: v for v in volumes}
    return {m["mountPath"].rstrip("/"): by_name[m["name"]].folder
            for m in container.get("volumeMounts") or [] if m["name"] in by_name}


def remap(text: str, mounts: Mapping[str, Path]) -> str:
    """`text` with a leading mount path replaced by its folder."""
    for path, folder in mounts.items():
        if text == path or text.startswith(path + "/"):
            return str(folder) + text[len(path):]
    return text


def sync_volume(volume: SecretVolume, namespace: str, lookup: SourceLookup) -> None:
    """Write the Secret's items into the volume's folder, changed ones only, each atomically.
    PodConfigError when the Secret is missing and the folder was never written (the mount cannot happen)."""
    data = lookup("Secret", namespace, volume.secret)
    if data is None:
        if volume.folder.is_dir() or volume.optional:
            volume.folder.mkdir(parents=True, exist_ok=True)
            return
        raise PodConfigError(f"secret {volume.secret!r} not found for volume {volume.name!r}")
    volume.folder.mkdir(parents=True, exist_ok=True)
    for item, encoded in data.items():
        content = base64.b64decode(encoded)
        path = volume.folder / item
        if path.is_file() and path.read_bytes() == content:
            continue
        staged = volume.folder / f".{item}.new"
        staged.write_bytes(content)
        os.chmod(staged, volume.mode)
        os.replace(staged, path)
