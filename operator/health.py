"""Whether a worker has loaded its model, asked over its HTTP API.

A worker's `GET /health` answers as soon as its HTTP server is up, long
before the model has loaded, with `{"status": "ok", "loaded": bool}`;
`loaded` turns True once the model is loaded and the role's gRPC server is
up, so link calls can succeed from then on. Its /ready cannot tell this for a
prefill: that waits for a linked decode, which is what the operator is about
to make.
"""

from __future__ import annotations

import httpx

from disagg.operator.manifests import HTTP_PORT

# A loading worker serves /health from its event loop while the model loads
# in a thread, so it answers quickly; a slower answer is just asked again later.
HEALTH_TIMEOUT_S = 2.0


async def model_loaded(http: httpx.AsyncClient, ip: str, port: int = HTTP_PORT,
                       timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the worker at `ip` says its model is loaded; False when it says
    not yet, cannot be reached, or answers something else."""
    try:
        response = await http.get(f"http://{ip}:{port}/health", timeout=timeout_s)
        response.raise_for_status()
        body = response.json()
    except (httpx.HTTPError, ValueError):  # ValueError: not JSON
        return False
    return isinstance(body, dict) and body.get("loaded") is True
