"""JSON requests to the API server through the official client's connection.

`kubernetes.client` loads the kubeconfig (server, CA, bearer token) and owns
the connection pool; requests and answers stay plain JSON dicts, as written
in manifests, which keeps the harness free of the generated models (and of
their cost: parsing a pod list into them takes milliseconds per pod).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes import config
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]
Timeout = tuple[float, float]  # (connect, read) seconds

_PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


class Kube:
    """One identity's access to the API server (see `ApiException` for errors)."""

    def __init__(self, kubeconfig: Path, timeout: Timeout = (5.0, 30.0)) -> None:
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: Obj | list[Obj] | None = None,
        query: dict[str, str] | None = None,
        patch: str = "strategic",
    ) -> Obj:
        """Send one request; returns the decoded answer, raises ApiException on a non-2xx status."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = _PATCH_TYPES[patch] if method == "PATCH" else "application/json"
        method, url, headers, payload, post = self.api.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers,
            body=body, auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, headers, payload, post, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        answer: Obj = json.loads(data) if data else {}
        return answer

    def get(self, path: str, **query: str) -> Obj:
        return self.request("GET", path, query=query)

    def post(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Obj | list[Obj], patch: str = "strategic") -> Obj:
        return self.request("PATCH", path, body, patch=patch)

    def delete(self, path: str, body: Obj | None = None) -> Obj:
        return self.request("DELETE", path, body)

    def close(self) -> None:
        self.api.close()


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    """/api/v1/namespaces/NS/pods[/NAME[/SUB]]"""
    path = f"/api/v1/namespaces/{namespace}/pods"
    for part in (name, sub):
        if part:
            path += f"/{part}"
    return path
