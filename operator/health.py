"""What a worker's /health says: whether its model is loaded, and which cluster keys it uses.

A worker's `GET /health` answers as soon as its HTTP server is up, long
before the model has loaded, with `{"status": "ok", "loaded": bool}`;
`loaded` turns True once the model is loaded and the role's gRPC server is
up, so link calls can succeed from then on. Its /ready cannot tell this for a
prefill: that waits for a linked decode, which is what the operator is about
to make. `cluster_key` names the keys a keyed worker uses now, so that a key
rotation can wait until every worker has taken each step.
"""

from __future__ import annotations

from typing import Any

import httpx

from disagg.operator.manifests import HTTP_PORT

# A loading worker serves /health from its event loop while the model loads
# in a thread, so it answers quickly; a slower answer is just asked again later.
HEALTH_TIMEOUT_S = 2.0


async def _health(http: httpx.AsyncClient, ip: str, port: int, timeout_s: float) -> dict[str, Any] | None:
    """The worker's /health answer; None when it cannot be reached or answers something else."""
    try:
        response = await http.get(f"http://{ip}:{port}/health", timeout=timeout_s)
        response.raise_for_status()
        body = response.json()
    except (httpx.HTTPError, ValueError):  # ValueError: not JSON
        return None
    return body if isinstance(body, dict) else None


async def model_loaded(http: httpx.AsyncClient, ip: str, port: int = HTTP_PORT,
                       timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the worker at `ip` says its model is loaded; False when it says
    not yet, cannot be reached, or answers something else."""
    body = await _health(http, ip, port, timeout_s)
    return body is not None and body.get("loaded") is True


async def key_fingerprint(http: httpx.AsyncClient, ip: str, port: int = HTTP_PORT,
                          timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """The fingerprint of the cluster keys the worker uses now (`ClusterKey.fingerprint`);
    None when it cannot be reached or holds no key."""
    body = await _health(http, ip, port, timeout_s)
    value = None if body is None else body.get("cluster_key")
    return value if isinstance(value, str) else None
