"""The chart, rendered offline: lint, templates per values file, the schema and the loud failures.

Each test sets a few values and asserts a few paths of the rendered objects
(helm-unittest style). The cluster tests are in test_install.py.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from disagg.operator import crd
from disagg.operator.main import add_arguments
from disagg.operator.settings import PREFIX, OperatorSettings

if TYPE_CHECKING:
    from conftest import Helm, Manifests

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "disagg"
VALUES = Path(__file__).resolve().parent / "values"
VALUES_FILES = sorted(VALUES.glob("*.yaml"))

SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}


def operator_container(objects: Manifests) -> dict[str, Any]:
    (container,) = objects.one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


# ---- lint and render ----------------------------------------------------------


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: v.stem if v else "defaults")
def test_lint_passes_strictly(helm: Helm, values: Path | None) -> None:
    done = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda v: v.stem)
def test_every_values_file_renders_every_object_with_the_standard_labels(helm: Helm, values: Path) -> None:
    for obj in helm.template("-f", str(values)):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", obj["metadata"]["name"]
        assert labels["app.kubernetes.io/part-of"] == "disagg"
        assert SELECTOR_KEYS <= set(labels), f"{obj['kind']} {obj['metadata']['name']} lacks the recommended labels"


def test_a_cluster_older_than_the_worker_pods_need_is_refused_at_install(helm: Helm) -> None:
    """Worker pods use the preStop sleep action (Kubernetes 1.30): helm says so before installing."""
    done = helm("template", "disagg", str(CHART), "--kube-version", "1.29.9", check=False)
    assert done.returncode != 0 and "kubeVersion: >=1.30.0-0" in done.stderr
    assert helm.template("--kube-version", "1.30.0").find("Deployment")


def test_defaults_render_the_operator_and_nothing_optional(helm: Helm) -> None:
    objects = helm.template()
    kinds = sorted(o["kind"] for o in objects)
    # Least privilege by default: a Role in the release namespace, the workers' NetworkPolicy there.
    assert kinds == sorted(["Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                            "Service", "PodDisruptionBudget", "NetworkPolicy"])
    deployment = objects.one("Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    pdb = objects.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    # A budget may be a percentage of the operator's pods, as any PodDisruptionBudget.
    pdb = helm.template("--set-string", "podDisruptionBudget.maxUnavailable=50%").one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == "50%"


def test_selectors_are_name_instance_and_component_only(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "ha.yaml"))
    selectors = [objects.one("Deployment")["spec"]["selector"]["matchLabels"],
                 objects.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                 objects.one("Service")["spec"]["selector"]]
    for selector in selectors:
        assert set(selector) == SELECTOR_KEYS
        assert selector["app.kubernetes.io/component"] == "operator"


def test_operator_pod_is_locked_down(helm: Helm) -> None:
    objects = helm.template()
    pod = objects.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = operator_container(objects)["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert set(operator_container(objects)["resources"]["requests"]) == {"cpu", "memory"}


def test_probes_and_ports_match_the_operator(helm: Helm) -> None:
    """The probes hit kopf's liveness endpoint on the port passed to it, and the
    metrics port is the one the operator's settings read."""
    container = operator_container(helm.template("--set", "operator.healthPort=9091", "--set", "metrics.port=9090"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 9091, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"])  # the operator's own parser accepts the chart's arguments
    assert args.liveness_port == 9091 and args.standalone and args.namespace == ["disagg-system"]
    assert OperatorSettings.from_env(env_of(container)).metrics_port == 9090


def test_every_operator_setting_env_var_parses(helm: Helm) -> None:
    """The DISAGG_OPERATOR_* variables the chart sets are ones the operator reads, with valid values."""
    container = operator_container(helm.template("--set-json", "operator.resyncSeconds=2.5",
                                                 "--set", "operator.linkConcurrency=7"))
    env = env_of(container)
    settings = OperatorSettings.from_env(env)
    assert settings.resync_s == 2.5 and settings.link_concurrency == 7 and settings.peering == ""
    known = {PREFIX + name.upper() for name in OperatorSettings.__dataclass_fields__}
    assert {k for k in env if k.startswith(PREFIX)} - known == set()
    # The worker-pod defaults reach the pods the operator creates (manifests.worker_pod).
    assert settings.worker_security_context["capabilities"] == {"drop": ["ALL"]}
    assert settings.worker_pod_security_context["runAsNonRoot"] is True


# ---- values files -----------------------------------------------------------------


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_namespaced_mode_grants_roles_only_in_the_watched_namespaces(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "namespaced.yaml"))
    roles = objects.find("Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in objects.find("RoleBinding")) == ["team-a", "team-b"]
    (cluster_role,) = objects.find("ClusterRole")
    # Cluster-wide: reads of CRDs and namespaces only; no pod right outside the two namespaces.
    assert _rules(cluster_role) == {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} \
        | {("", "namespaces", v) for v in ("list", "watch")}
    container = operator_container(objects)
    assert [a for a in container["args"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--verbose" in container["args"]


def test_rbac_has_no_wildcards_and_reads_secrets_only_by_name(helm: Helm) -> None:
    """The cluster keys' Secrets are made, read by name and rotated; never listed or watched."""
    for values in [None, *VALUES_FILES]:
        objects = helm.template(*(["-f", str(values)] if values else []))
        for role in objects.find("Role") + objects.find("ClusterRole"):
            for group, resource, verb in _rules(role):
                assert "*" not in (group, resource, verb), f"{role['metadata']['name']}: wildcard in {values}"
                assert resource != "configmaps", f"{role['metadata']['name']} reads configmaps"
                if resource == "secrets":
                    assert verb in ("get", "create", "patch"), f"{role['metadata']['name']} may {verb} secrets"


def test_ha_runs_two_peered_replicas_kept_by_the_budget(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "ha.yaml"))
    assert objects.one("Deployment")["spec"]["replicas"] == 2
    container = operator_container(objects)
    assert "--standalone" not in container["args"]
    assert env_of(container)[PREFIX + "PEERING"] == "disagg-operator"
    assert objects.one("PodDisruptionBudget")["spec"] == {
        "selector": objects.one("PodDisruptionBudget")["spec"]["selector"], "minAvailable": 1}
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in _rules(objects.one("ClusterRole", "disagg-disagg-system"))


def test_service_monitor_scrapes_the_metrics_service_port(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "monitoring.yaml"))
    monitor = objects.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == objects.one("Service")["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    # The operator's own `namespace` label (the cluster's) survives the scrape: the dashboards filter on it.
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitor["spec"]["selector"]["matchLabels"] == objects.one("Service")["spec"]["selector"]


def test_pod_monitor_scrapes_the_pods_without_a_service(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "podmonitor.yaml"))
    assert not objects.find("Service") and not objects.find("ServiceMonitor")
    monitor = objects.one("PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    assert monitor["spec"]["selector"]["matchLabels"] == objects.one("Deployment")["spec"]["selector"]["matchLabels"]


def test_network_policy_keeps_grpc_and_transfer_inside_the_namespace(helm: Helm) -> None:
    from disagg.operator import manifests as m
    from disagg.operator.spec import parse_spec

    objects = helm.template("-f", str(VALUES / "networkpolicy.yaml"))
    policies = objects.find("NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["serving", "staging"]
    peers, operator, http = policies[0]["spec"]["ingress"]
    # The named ports are the ones the operator gives worker containers.
    pod = m.worker_pod({"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggCluster",
                        "metadata": {"name": "c", "uid": "u"}}, "decode", "c-decode-0", parse_spec({"model": {"source": "m"}}))
    worker_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    # Worker pods reach each other on every port: nccl's rendezvous and NCCL's sockets take run-time ports.
    assert peers == {"from": [{"podSelector": {"matchExpressions": [{"key": m.CLUSTER_LABEL, "operator": "Exists"}]}}]}
    assert {p["port"] for p in operator["ports"]} == {"grpc", "transfer", "admin"}
    assert {p["port"] for p in http["ports"]} == {"http"}
    assert {"grpc", "transfer", "admin", "http"} <= worker_ports
    (operator_pods,) = operator["from"]
    assert operator_pods["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert http["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "gateway"}
    assert http["from"][1] == operator_pods, "the operator reads /metrics while draining"


def test_network_policy_defaults_to_the_release_namespace_and_open_http(helm: Helm) -> None:
    (policy,) = helm.template("--set", "workerPods.networkPolicy.enabled=true").find("NetworkPolicy")
    assert policy["metadata"]["namespace"] == "disagg-system"
    assert "from" not in policy["spec"]["ingress"][2]


def test_network_policy_is_on_by_default_and_can_be_turned_off(helm: Helm) -> None:
    (policy,) = helm.template().find("NetworkPolicy")
    assert policy["metadata"]["namespace"] == "disagg-system"
    _, closed, open_ = policy["spec"]["ingress"]
    assert {p["port"] for p in closed["ports"]} == {"grpc", "transfer", "admin"} and "from" in closed
    assert {p["port"] for p in open_["ports"]} == {"http"} and "from" not in open_, "clients reach the OpenAI API"
    assert not helm.template("--set", "workerPods.networkPolicy.enabled=false").find("NetworkPolicy")


def test_one_release_name_in_two_namespaces_claims_distinct_cluster_scoped_objects(helm: Helm) -> None:
    """One operator per namespace, each installed as `disagg`: the second install must not meet the
    first one's ClusterRole (helm refuses to adopt it)."""
    def cluster_scoped(namespace: str) -> set[tuple[str, str]]:
        out = helm("template", "disagg", str(CHART), "--namespace", namespace).stdout
        return {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out)
                if d and d["kind"] in ("ClusterRole", "ClusterRoleBinding")}

    first, second = cluster_scoped("team1"), cluster_scoped("team2")
    assert first and second and not first & second, (first, second)


def test_default_rbac_creates_pods_only_in_the_release_namespace(helm: Helm) -> None:
    objects = helm.template()
    (role,) = objects.find("Role")
    assert role["metadata"]["namespace"] == "disagg-system" and ("", "pods", "create") in _rules(role)
    assert objects.one("RoleBinding")["metadata"]["namespace"] == "disagg-system"
    for cluster_role in objects.find("ClusterRole"):
        assert not {r for _, r, _ in _rules(cluster_role)} & {"pods", "services", "secrets"}, \
            cluster_role["metadata"]["name"]
    assert [a for a in operator_container(objects)["args"] if a.startswith("--namespace")] == [
        "--namespace=disagg-system"]
    wide = helm.template("--set", "operator.watchAllNamespaces=true", "--set", "workerPods.networkPolicy.namespaces[0]=serving")
    assert ("", "pods", "create") in _rules(wide.one("ClusterRole", "disagg-disagg-system-workloads")) and not wide.find("Role")
    # Children set blockOwnerDeletion: with OwnerReferencesPermissionEnforcement (OpenShift) that takes
    # the right to update the owner's finalizers. Every child's owner is the DisaggCluster: no more.
    for rules in (_rules(role), _rules(wide.one("ClusterRole", "disagg-disagg-system-workloads"))):
        assert ("disagg.dev", "disaggclusters/finalizers", "update") in rules
        assert not [r for r in rules if r[1] == "disaggroles/finalizers"]


# ---- the CRD --------------------------------------------------------------------------


def test_chart_crd_is_the_operators_crd() -> None:
    """crds/ holds exactly what `python -m disagg.operator.crd` prints."""
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(crd.FILES)
    for file in crd.FILES:
        assert (CHART / "crds" / file).read_text() == crd.render(file)


def test_managed_crd_is_rendered_from_the_same_file_and_kept_on_uninstall(helm: Helm) -> None:
    objects = helm.template("-f", str(VALUES / "crds-managed.yaml"))
    for build in crd.FILES.values():
        rendered = objects.one("CustomResourceDefinition", build()["metadata"]["name"])
        assert rendered["spec"] == build()["spec"]
        assert rendered["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert objects.one("Deployment")["metadata"]["name"] == "disagg-operator"
    assert re.fullmatch(r"ghcr\.io/disagg/operator@sha256:[0-9a-f]{64}", operator_container(objects)["image"])
    assert not helm.template().find("CustomResourceDefinition"), "off by default: crds/ installs it"


# ---- names ---------------------------------------------------------------------------


def test_names_are_cut_at_63_characters(helm: Helm) -> None:
    # Helm allows 53-character release names; with the name appended that is 74.
    out = helm("template", "r" * 53, str(CHART), "--namespace", "x", "--set", "nameOverride=" + "n" * 20).stdout
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(out) if d]
    assert all(len(n) <= 63 for n in names), [n for n in names if len(n) > 63]
    deployment_name = next(d["metadata"]["name"] for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    assert len(deployment_name) == 63 and not deployment_name.endswith("-")


# ---- the schema and the loud failures --------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--set", "replcaCount=2"], "additional properties 'replcaCount' not allowed"),
    (["--set", "operator.replicas=3"], "/operator/replicas"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["--set", "operator.securityContext.runAsNonroot=true"], "additional properties 'runAsNonroot' not allowed"),
    (["--set", "metrics.serviceMonitor.interval=often"], "/metrics/serviceMonitor/interval"),
    (["--set", "operator.watchNamespaces[0]=Not_A_Namespace"], "/operator/watchNamespaces/0"),
    (["--set", "workerPods.networkPolicy.enable=true"], "additional properties 'enable' not allowed"),
])
def test_schema_rejects_bad_values_with_a_clear_message(helm: Helm, args: list[str], message: str) -> None:
    with pytest.raises(RuntimeError, match="exited with") as err:
        helm.template(*args)
    assert message in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--set", "operator.replicas=2"], "ERROR: operator.replicas > 1 needs peering.enabled=true"),
    (["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true"],
     "ERROR: enable metrics.serviceMonitor or metrics.podMonitor, not both"),
    (["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"],
     "ERROR: metrics.serviceMonitor.enabled needs metrics.service.enabled"),
    (["--set", "serviceAccount.create=false"], "ERROR: serviceAccount.create=false needs serviceAccount.name"),
    (["--set", "metrics.port=8081"], "ERROR: metrics.port and operator.healthPort must differ"),
    (["--set", "operator.autoscalerWindowSeconds=20"],
     "ERROR: operator.autoscalerWindowSeconds must be at least twice operator.autoscalerIntervalSeconds"),
    (["--set", "podDisruptionBudget.minAvailable=1"], "ERROR: podDisruptionBudget.minAvailable must be below"),
    (["--set", "podDisruptionBudget.minAvailable=0", "--set", "podDisruptionBudget.maxUnavailable=1"],
     "ERROR: set podDisruptionBudget.minAvailable or podDisruptionBudget.maxUnavailable, not both"),
    (["--set", "operator.watchAllNamespaces=true", "--set", "operator.watchNamespaces[0]=a"],
     "ERROR: set operator.watchNamespaces or operator.watchAllNamespaces=true, not both"),
    (["--set", "podDisruptionBudget.minAvailable=50%"], "ERROR: podDisruptionBudget.minAvailable must be below"),
    (["--set", "operator.watchAllNamespaces=true"],
     "ERROR: with operator.watchAllNamespaces=true, list the namespaces of your worker pods"),
])
def test_bad_combinations_fail_loudly(helm: Helm, args: list[str], message: str) -> None:
    with pytest.raises(RuntimeError, match="exited with") as err:
        helm.template(*args)
    assert message in str(err.value)


# ---- values.yaml documents itself --------------------------------------------------------


def _schema_node(schema: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for key in path:
        node = (node or {}).get("properties", {}).get(key)
    return node


def test_every_chart_key_in_values_yaml_has_a_comment_above_it() -> None:
    """Keys the chart defines carry a comment; Kubernetes-shaped values (resources,
    security contexts) are documented by the Kubernetes API and skipped."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    stack: list[tuple[int, str]] = []
    previous = ""
    undocumented = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if m:
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parents = [k for _, k in stack]
            parent = _schema_node(schema, parents)
            kubernetes_shaped = any("$comment" in (_schema_node(schema, parents[:i + 1]) or {})
                                    for i in range(len(parents)))
            if parent is not None and not kubernetes_shaped and not previous.lstrip().startswith("#"):
                undocumented.append(".".join(parents + [m.group(2)]))
            stack.append((indent, m.group(2)))
        if line.strip():
            previous = line
    assert not undocumented, f"keys without a comment line above them: {undocumented}"


def test_every_values_key_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], sub: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            child = sub.get("properties", {}).get(key)
            assert child is not None or sub.get("additionalProperties") not in (False, None), f"{path}{key} not in schema"
            if isinstance(value, dict) and child is not None and "$comment" not in child:
                walk(value, child, f"{path}{key}.")

    walk(values, schema, "")
