"""Every kopf registration of the operator: thin, typed, top-level functions.

The work is in controller.py (one reconcile pass) and the pure modules it
calls. A daemon per DisaggCluster runs the level-based reconcile on a period
and is woken at once by pod events and spec changes; pods are indexed by
cluster, so a pass reads no API list.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from disagg.operator.controller import ClusterController, Deps
from disagg.operator.crd import GROUP, PLURAL, ROLE_PLURAL, VERSION
from disagg.operator.http_client import BoundedClient
from disagg.operator.kube import KubeApi
from disagg.operator.link_client import LinkClient
from disagg.operator.manifests import CLUSTER_LABEL
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import PodView, pod_view
from disagg.operator.settings import OperatorSettings, configure
from disagg.operator.spec import parse_spec

CLUSTERS = (GROUP, VERSION, PLURAL)
WORKER_HTTP_TIMEOUT_S = 5.0  # one whole call to a worker's /health, /metrics or /drain
ROLES = (GROUP, VERSION, ROLE_PLURAL)
OF_A_CLUSTER = {CLUSTER_LABEL: kopf.PRESENT}  # the label selector of our worker pods and DisaggRoles


class OperatorState:
    """The operator-wide clients and the controller of each cluster (kept in memo)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.controllers: dict[tuple[str, str], ClusterController] = {}

    def controller(self, namespace: str, name: str) -> ClusterController:
        key = (namespace, name)
        if key not in self.controllers:
            self.controllers[key] = ClusterController(namespace, name, self.deps)
        return self.controllers[key]


def _api_client(kubeconfig: str | None) -> client.ApiClient:
    """A given kubeconfig; else in a pod, its service account; else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except ConfigException:
        return config.new_client_from_config()


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """A kubeconfig given to `disagg operator`, else kopf's own ways (in-cluster, $KUBECONFIG)."""
    kubeconfig = memo.get("kubeconfig")
    if not kubeconfig:
        return kopf.login_via_client(**kwargs)
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization") or ""
    scheme, _, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        scheme=scheme or None, token=token or None,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Idempotent: kopf retries a failed startup, so what is already made is kept,
    and the metrics port is bound last and once."""
    ours: OperatorSettings = memo.settings
    configure(settings, ours, memo.namespaces, standalone=bool(memo.get("standalone")), priority=memo.priority)
    if memo.get("state") is None:
        memo.state = OperatorState(Deps(
            settings=ours,
            kube=KubeApi(_api_client(memo.get("kubeconfig")), ours.api_timeout_s),
            links=LinkClient(ours.link_timeout_s, ours.link_concurrency),
            http=BoundedClient(WORKER_HTTP_TIMEOUT_S),
            metrics=OperatorMetrics(),
        ))
    if ours.metrics_port:
        memo.state.deps.metrics.serve(ours.metrics_port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState | None = memo.get("state")
    if state is None:  # the startup never finished
        return
    await asyncio.gather(*(c.stop() for c in state.controllers.values()))
    await state.deps.links.close()
    await state.deps.http.aclose()


@kopf.on.probe(id="clusters")
def clusters_probe(memo: kopf.Memo, **_: Any) -> int:
    """For the liveness endpoint: the number of clusters being reconciled."""
    return len(memo.state.controllers)


@kopf.index("pods", labels=OF_A_CLUSTER)
def pods_by_cluster(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodView]:
    return {(namespace or "", labels[CLUSTER_LABEL]): pod_view(body)}


@kopf.on.event("pods", labels=OF_A_CLUSTER)
@kopf.on.event(*ROLES, labels=OF_A_CLUSTER)
def member_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A pod that dies or starts terminating is unlinked in the very next pass, and a DisaggRole
    scaled through /scale (HPA, KEDA, kubectl scale) is acted on in it: wake it."""
    controller = memo.state.controllers.get((namespace or "", labels[CLUSTER_LABEL]))
    if controller is not None:
        controller.wake()


# The API server's answers to an object it will never take as it is (Bad Request, Unprocessable).
_REFUSED_AS_INVALID = (400, 422)


def _refusal(e: ApiException) -> str:
    """The API server's reason, from its Status body when it sent one."""
    try:
        message = json.loads(e.body or "")["message"]
    except (TypeError, ValueError, KeyError):
        message = f"{e.status} {e.reason}"
    return f"the API server refused an object made from this spec: {message}"


def _namespace_terminating(e: ApiException) -> bool:
    """The API server's refusal to create anything in a namespace being deleted."""
    return e.status == 403 and "NamespaceTerminating" in str(e.body or "")


@kopf.on.create(*CLUSTERS)
@kopf.on.update(*CLUSTERS, field="spec")
def validate(spec: kopf.Spec, name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Reject what the schema cannot (PermanentError becomes an Event), and reconcile at once."""
    parse_spec(spec)
    memo.state.controller(namespace or "", name).wake()


@kopf.daemon(*CLUSTERS, cancellation_timeout=10.0)
async def reconcile(name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                    logger: kopf.Logger, **kwargs: Any) -> None:
    assert namespace, "DisaggCluster is a namespaced resource"
    # kopf passes each index as a keyword named after its function.
    pods: kopf.Index[tuple[str, str], PodView] = kwargs["pods_by_cluster"]
    state: OperatorState = memo.state
    controller = state.controller(namespace, name)
    metrics = state.deps.metrics
    try:
        while not stopped:
            began = time.monotonic()
            controller.wakeup.clear()
            delay = state.deps.settings.resync_s
            try:
                delay = await controller.reconcile(body, pods.get((namespace, name), []))
            except kopf.PermanentError as e:
                metrics.reconcile_errors.labels("reconcile").inc()
                await controller.report_invalid_spec(body, str(e))
            except ApiException as e:
                if e.status in _REFUSED_AS_INVALID:  # an object made from the spec: the spec must change
                    metrics.reconcile_errors.labels("reconcile").inc()
                    reason = _refusal(e)
                    logger.warning("reconcile of %s/%s: %s", namespace, name, reason)
                    await controller.report_invalid_spec(body, reason)
                elif not _namespace_terminating(e):
                    metrics.reconcile_errors.labels("reconcile").inc()
                    logger.exception("reconcile of %s/%s failed: %s", namespace, name, e)
                # else: the cluster goes with its namespace; nothing can be made there any more
            except Exception as e:  # noqa: BLE001 - one bad pass must not end the loop; the next retries
                metrics.reconcile_errors.labels("reconcile").inc()
                logger.exception("reconcile of %s/%s failed: %s", namespace, name, e)
            metrics.reconcile_seconds.labels("reconcile").observe(time.monotonic() - began)
            woken = asyncio.ensure_future(controller.wakeup.wait())
            halted = asyncio.ensure_future(stopped.wait())
            await asyncio.wait({woken, halted}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            halted.cancel()
    finally:
        await controller.stop()
        state.controllers.pop((namespace, name), None)
        metrics.forget(namespace, name)  # the cluster is gone (or the operator stops)
