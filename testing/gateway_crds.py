"""The Gateway API Inference Extension's CRDs, for checking our examples against them.

They come from the project's Go module at a pinned version, through `go mod
download` (the module proxy), and stay in Go's module cache: fetched once,
never committed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.1.0"
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


class CrdUnavailable(RuntimeError):
    """go is missing or the module could not be downloaded; the message says which."""


def module_dir(module: str = GIE_MODULE, version: str = GIE_VERSION, timeout_s: float = 300.0) -> Path:
    """The module's folder in Go's module cache, downloaded first when missing."""
    try:
        done = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as e:
        raise CrdUnavailable("go is not on PATH (it fetches the CRDs from the module proxy)") from e
    except subprocess.TimeoutExpired as e:
        raise CrdUnavailable(f"go mod download {module}@{version} ran past {timeout_s:.0f} s") from e
    try:
        info: dict[str, str] = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise CrdUnavailable(f"go mod download {module}@{version}: {done.stderr or done.stdout}") from e
    if info.get("Error") or not info.get("Dir"):
        raise CrdUnavailable(f"go mod download {module}@{version}: {info.get('Error', 'no folder')}")
    return Path(info["Dir"])


def inference_pool_crd() -> dict[str, Any]:
    """The InferencePool CustomResourceDefinition (inference.networking.k8s.io) of GIE_VERSION."""
    crd: dict[str, Any] = yaml.safe_load((module_dir() / INFERENCE_POOL_CRD).read_text())
    assert crd["kind"] == "CustomResourceDefinition", f"{INFERENCE_POOL_CRD} holds a {crd['kind']}"
    return crd
