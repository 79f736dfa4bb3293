"""The DisaggRole children (operator/roles.py): their manifest and status, their CRD's /scale,
and who owns a role's count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf
import pytest

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.operator.roles import (
    Banded,
    Child,
    apply_ratio,
    child_object,
    child_status,
    decide_count,
    read_child,
    selector,
)
from disagg.operator.snapshot import RoleCounts
from disagg.operator.spec import parse_spec


NOT_ROLLING = {"prefill": False, "decode": False}


def child(replicas: int, owner: str | None, desired: int | None = None, generation: int = 1,
          observed: int | None = 1) -> Child:
    return Child(replicas=replicas, owner=owner, desired=replicas if desired is None else desired,
                 generation=generation, observed=observed)


def test_the_child_is_owned_by_its_cluster_and_selects_the_roles_pods(owner: Callable[..., dict[str, Any]]) -> None:
    body = child_object(owner(), "decode", 3)
    assert (body["kind"], body["metadata"]["name"], body["spec"]) == ("DisaggRole", "llm-decode", {"replicas": 3})
    (ref,) = body["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("DisaggCluster", "llm", "uid-1", True)
    assert body["metadata"]["labels"][m.CLUSTER_LABEL] == "llm"
    assert selector("llm", "decode") == "disagg.dev/cluster=llm,disagg.dev/role=decode"
    # The selector string matches exactly the pods the operator makes for the role.
    pod_labels = m.labels("llm", "decode", parse_spec({"model": {"source": "m"}}))
    assert all(pod_labels[k] == v for k, v in (term.split("=") for term in selector("llm", "decode").split(",")))


def test_the_role_crd_exposes_scale_on_spec_replicas_with_the_selector() -> None:
    doc = crd.role_crd()
    assert doc["metadata"]["name"] == "disaggroles.disagg.dev"
    assert doc["spec"]["names"]["shortNames"] == ["dr"] and doc["spec"]["names"]["kind"] == "DisaggRole"
    (version,) = doc["spec"]["versions"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    assert schema["spec"]["properties"]["replicas"]["minimum"] == 0
    assert schema["status"]["properties"]["owner"]["enum"] == ["static", "external", "autoscaler"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        assert not path.startswith(".status.") or path.removeprefix(".status.") in schema["status"]["properties"]


def test_spec_role_scaling_is_static_by_default_and_refuses_other_values() -> None:
    assert parse_spec({"model": {"source": "m"}}).decode.scaling == "static"
    assert parse_spec({"model": {"source": "m"}, "decode": {"scaling": "external"}}).decode.scaling == "external"
    with pytest.raises(kopf.PermanentError, match="spec.decode.scaling must be one of"):
        parse_spec({"model": {"source": "m"}, "decode": {"scaling": "hpa"}})
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert schema["decode"]["properties"]["scaling"]["enum"] == ["static", "external"]


# ---- who owns the count ----------------------------------------------------------


def test_static_copies_the_cluster_count_into_a_new_child() -> None:
    got = decide_count("llm", "decode", "static", 2, None, rolling=False)
    assert (got.owner, got.desired, got.write, got.event) == ("static", 2, 2, None)


def test_static_sets_a_scaled_child_back_and_says_so() -> None:
    scaled = child(5, "static", desired=2, generation=3, observed=2)  # someone wrote spec.replicas after the operator
    got = decide_count("llm", "decode", "static", 2, scaled, rolling=False)
    assert (got.desired, got.write) == (2, 2)
    assert got.event is not None and got.event[:2] == ("Warning", "ScaleOverridden")
    assert "set spec.decode.scaling: external" in got.event[2]


def test_static_follows_a_cluster_edit_without_an_override_event() -> None:
    got = decide_count("llm", "decode", "static", 3, child(2, "static"), rolling=False)
    assert (got.desired, got.write, got.event) == (3, 3, None)
    settled = decide_count("llm", "decode", "static", 3, child(3, "static"), rolling=False)
    assert (settled.write, settled.event) == (None, None)


def test_external_reads_the_child_and_ignores_the_cluster_count() -> None:
    got = decide_count("llm", "decode", "external", 1, child(4, "external", generation=5, observed=2), rolling=False)
    assert (got.owner, got.desired, got.write, got.event) == ("external", 4, None, None)
    assert "spec.decode.replicas of DisaggCluster llm is ignored" in got.message
    # An external scaler may go to 0 once it owns the role.
    assert decide_count("llm", "decode", "external", 1, child(0, "external"), rolling=False).desired == 0


def test_switching_static_to_external_keeps_the_current_size() -> None:
    got = decide_count("llm", "decode", "external", 3, child(3, "static"), rolling=False)
    assert (got.owner, got.desired, got.write) == ("external", 3, None)
    assert got.event is not None and got.event[1] == "ScalingOwnerChanged" and got.event[2].endswith(": 3 pods")


@pytest.mark.parametrize("existing", [None, child(0, "static")])
def test_a_new_external_scaler_starts_at_one_pod_at_least(existing: Child | None) -> None:
    """An HPA parks a target at 0: a role handed over at 0 starts at 1."""
    got = decide_count("llm", "decode", "external", 0, existing, rolling=False)
    assert (got.desired, got.write) == (1, 1)


def test_the_autoscaler_comes_first_and_sets_back_a_scaled_child() -> None:
    got = decide_count("llm", "prefill", "external", 1, child(2, "external"), rolling=False, recommended=4)
    assert (got.owner, got.desired, got.write) == ("autoscaler", 4, 4)
    assert got.event is not None and got.event[1] == "ScalingOwnerChanged"
    scaled = child(7, "autoscaler", desired=4, generation=9, observed=8)
    again = decide_count("llm", "prefill", "static", 1, scaled, rolling=False, recommended=4)
    assert (again.write, again.event and again.event[1]) == (4, "ScaleOverridden")


@pytest.mark.parametrize("mode, cluster, existing", [("static", 1, child(3, "static")),
                                                     ("external", 1, child(1, "external", desired=3))])
def test_a_rollout_is_never_shrunk_mid_way(mode: str, cluster: int, existing: Child) -> None:
    got = decide_count("llm", "decode", mode, cluster, existing, rolling=True)
    assert got.desired == 3 and "waits for the rollout" in got.message
    done = decide_count("llm", "decode", mode, cluster, existing, rolling=False)
    assert done.desired == 1
    # Growing during a rollout is not held.
    assert decide_count("llm", "decode", "static", 5, existing, rolling=True).desired == 5


def test_the_status_is_what_scale_reads() -> None:
    count = decide_count("llm", "decode", "external", 2, child(2, "external"), rolling=False)
    pods = RoleCounts(replicas=2, updated=2, ready=1, linked=1, draining=1, terminating=0, total=3)
    status = child_status("llm", "decode", count, pods, 4)
    assert status == {"observedGeneration": 4, "replicas": 2, "ready": 1, "desired": 2,
                      "selector": "disagg.dev/cluster=llm,disagg.dev/role=decode", "owner": "external",
                      "message": count.message}
    obj = {"metadata": {"generation": 4}, "spec": {"replicas": 2}, "status": status}
    assert read_child(obj) == Child(replicas=2, owner="external", desired=2, generation=4, observed=4)
    assert not read_child(obj).scaled_by_others


# ---- the P:D ratio band, over whoever's counts ----------------------------------


def _counts(prefill: int, decode: int) -> dict[str, Any]:
    return {"prefill": decide_count("llm", "prefill", "static", prefill, None, rolling=False),
            "decode": decide_count("llm", "decode", "external", decode, child(decode, "external"), rolling=False)}


def _scaling(band: tuple[str, str], autoscaler: dict[str, Any] | None = None) -> Any:
    ratio = {"minPrefillPerDecode": band[0], "maxPrefillPerDecode": band[1]}
    return parse_spec({"model": {"source": "m"}, "scaling": {"ratio": ratio, **(
        {"autoscaler": autoscaler} if autoscaler else {})}}).scaling


def test_no_band_or_counts_inside_it_change_nothing() -> None:
    counts = _counts(1, 2)
    assert apply_ratio(parse_spec({"model": {"source": "m"}}).scaling, counts, NOT_ROLLING) == Banded(counts, None)
    assert apply_ratio(_scaling(("0.5", "1")), counts, NOT_ROLLING) == Banded(counts, None)


def test_an_external_scale_that_breaks_the_band_grows_the_short_side() -> None:
    """An HPA asked for 4 decodes with 1 prefill; at least 0.5 prefill per decode needs 2 prefills."""
    banded = apply_ratio(_scaling(("0.5", "2")), _counts(1, 4), NOT_ROLLING)
    assert (banded.counts["prefill"].desired, banded.counts["decode"].desired) == (2, 4)
    assert banded.reason is not None and "prefill 1->2" in banded.reason and banded.satisfied
    assert "ratio band: prefill 1->2" in banded.counts["prefill"].message
    assert banded.counts["decode"] == _counts(1, 4)["decode"], "the side inside its share is left alone"


def test_the_band_respects_the_autoscalers_maximum_and_a_rollout() -> None:
    auto = {"prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 8},
            "targets": {"ttftP90Ms": 500, "tpotP90Ms": 50}}
    # Prefill cannot grow past 1: the decodes shrink to 2 instead...
    banded = apply_ratio(_scaling(("0.5", "2"), auto), _counts(1, 4), NOT_ROLLING)
    assert (banded.counts["prefill"].desired, banded.counts["decode"].desired) == (1, 2)
    # ...but not while the decodes roll: nothing fits, the owners' counts are kept, and it says so.
    held = apply_ratio(_scaling(("0.5", "2"), auto), _counts(1, 4), {"prefill": False, "decode": True})
    assert (held.counts["decode"].desired, held.satisfied) == (4, False)


def test_a_band_no_counts_satisfy_is_a_permanent_error() -> None:
    auto = {"prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 2},
            "targets": {"ttftP90Ms": 500, "tpotP90Ms": 50}}
    with pytest.raises(kopf.PermanentError, match="no counts satisfy the band"):
        _scaling(("3", "4"), auto)
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert schema["scaling"]["properties"]["ratio"]["required"] == ["minPrefillPerDecode", "maxPrefillPerDecode"]
