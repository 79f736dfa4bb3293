"""The few Kubernetes API calls the operator makes, made async.

The official client is synchronous, so each call runs in a worker thread
(`asyncio.to_thread`): handlers never block the event loop. Every call has a
timeout, and create/delete are idempotent (409 on create and 404 on delete
mean "already done"). `calls` and `writes` count requests for the benchmark
and the idempotence test.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.operator.crd import GROUP, PLURAL, VERSION


class KindNotServed(LookupError):
    """The API server serves no such resource: its CRD is not installed."""


class NotOurs(kopf.PermanentError):
    """An object of a name the operator derives exists without this cluster as its controller:
    taking it over would break what it serves (a Service of the chart, a Secret of another)."""


def require_controlled(kind: str, metadata: Mapping[str, Any], owner_uid: str) -> None:
    """NotOurs unless `metadata` lists `owner_uid` as its controller."""
    refs = metadata.get("ownerReferences") or ()
    if not any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs):
        raise NotOurs(f"{kind} {metadata.get('name')} exists and is not this DisaggCluster's: the operator does not "
                      f"take it over; rename the DisaggCluster or delete the {kind}")


def _controller_uid(body: Mapping[str, Any]) -> str:
    return next(ref["uid"] for ref in body["metadata"]["ownerReferences"] if ref.get("controller"))


class KubeApi:
    def __init__(self, api_client: client.ApiClient, timeout_s: float = 30.0) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.timeout = (5.0, timeout_s)
        self.calls = 0
        self.writes = 0

    async def _call(self, write: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.writes += write
        return await asyncio.to_thread(fn, *args, _request_timeout=self.timeout, **kwargs)

    async def create_pod(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create; False when a pod of that name already exists."""
        try:
            await self._call(True, self.core.create_namespaced_pod, namespace, body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            return False
        return True

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete that very pod (a replacement of the same name is left alone)."""
        body = {"preconditions": {"uid": uid}}
        try:
            await self._call(True, self.core.delete_namespaced_pod, name, namespace, body=body,
                             _preload_content=False)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        await self._call(True, self.core.patch_namespaced_pod, name, namespace,
                         {"metadata": {"annotations": dict(annotations)}}, _preload_content=False)

    async def set_pod_condition(self, namespace: str, name: str, condition: Mapping[str, Any]) -> None:
        """Strategic merge: pod conditions merge by type, the kubelet's stay."""
        try:
            await self._call(True, self.core.patch_namespaced_pod_status, name, namespace,
                             {"status": {"conditions": [dict(condition)]}}, _preload_content=False)
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile
                raise

    async def apply_service(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create, or patch when the fields we own differ; True when something was written.
        NotOurs when a Service of that name is not controlled by `body`'s owner."""
        name = body["metadata"]["name"]
        try:
            current = await self._call(False, self.core.read_namespaced_service, name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            await self._call(True, self.core.create_namespaced_service, namespace, body, _preload_content=False)
            return True
        have = client.ApiClient().sanitize_for_serialization(current)
        require_controlled("Service", have["metadata"], _controller_uid(body))
        spec = body["spec"]
        same = (have["spec"].get("type") == spec["type"] and have["spec"].get("selector") == spec["selector"]
                and [(p.get("port"), p.get("targetPort")) for p in have["spec"].get("ports", [])]
                == [(p["port"], p["targetPort"]) for p in spec["ports"]])
        if same:
            return False
        patch = {"metadata": {"labels": body["metadata"]["labels"]}, "spec": spec}
        # A merge patch replaces `ports`; a strategic one merges them by port, so a changed port would
        # sit beside the old one under the same name, which the API server refuses.
        await self._call(True, self.core.patch_namespaced_service, name, namespace, patch, _preload_content=False,
                         _content_type="application/merge-patch+json")
        return True

    async def read_secret(self, namespace: str, name: str, owner_uid: str | None = None,
                          ) -> tuple[dict[str, bytes], dict[str, str]] | None:
        """A Secret's items, decoded, and its annotations; None when there is no such Secret.
        With `owner_uid`, NotOurs when that owner is not the Secret's controller."""
        try:
            secret = await self._call(False, self.core.read_namespaced_secret, name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        if owner_uid is not None:
            require_controlled("Secret", client.ApiClient().sanitize_for_serialization(secret.metadata), owner_uid)
        items = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        return items, dict(secret.metadata.annotations or {})

    async def create_secret(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create; False when a Secret of that name already exists."""
        try:
            await self._call(True, self.core.create_namespaced_secret, namespace, body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            return False
        return True

    async def patch_secret(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self._call(True, self.core.patch_namespaced_secret, name, namespace, dict(patch),
                         _preload_content=False)

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any], plural: str = PLURAL) -> None:
        await self._call(True, self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, plural,
                         name, {"status": dict(status)})

    async def read_object(self, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
        """One of our custom objects; None when it (or its kind) does not exist."""
        try:
            found: dict[str, Any] = await self._call(False, self.custom.get_namespaced_custom_object, GROUP, VERSION,
                                                     namespace, plural, name)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        return found

    async def create_object(self, namespace: str, plural: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create one of our custom objects; None when one of that name exists, KindNotServed without its CRD."""
        try:
            made: dict[str, Any] = await self._call(True, self.custom.create_namespaced_custom_object, GROUP, VERSION,
                                                    namespace, plural, dict(body))
        except ApiException as e:
            if e.status == 404:
                raise KindNotServed(f"{plural}.{GROUP}") from e
            if e.status != 409:
                raise
            return None
        return made

    async def patch_object(self, namespace: str, plural: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A merge patch of one of our custom objects; the object as it is now."""
        patched: dict[str, Any] = await self._call(True, self.custom.patch_namespaced_custom_object, GROUP, VERSION,
                                                   namespace, plural, name, dict(patch))
        return patched
