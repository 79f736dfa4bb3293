"""The cluster key offline: the Secret and its mount in every worker pod, and the rotation's steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.cluster_key import ACCEPT, SIGN, every_worker_holds, keys_of, plan_key
from disagg.operator.spec import ClusterSpec, parse_spec
from disagg.workers.security.key import ClusterKey, CredentialVerifier

OLD, NEW = "a" * 64, "b" * 64


def test_every_worker_mounts_the_clusters_secret_and_reads_its_key(spec: ClusterSpec,
                                                                   owner: Callable[..., Any]) -> None:
    for role in ("prefill", "decode"):
        pod = m.worker_pod(owner("llm"), role, f"llm-{role}-abcde", spec)
        (volume,) = pod["spec"]["volumes"]
        assert volume["secret"] == {"secretName": "llm-cluster-key", "defaultMode": 0o440}
        (container,) = pod["spec"]["containers"]
        assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": m.KEY_MOUNT_DIR, "readOnly": True}]
        args = container["args"]
        assert args[args.index("--cluster-key-file") + 1] == f"{m.KEY_MOUNT_DIR}/{m.KEY_ITEM}"
        assert "--insecure" not in args and "--allow-anonymous-peers" not in args


def test_insecure_on_purpose_mounts_nothing(owner: Callable[..., Any]) -> None:
    spec = parse_spec({"model": {"source": "m"}, "security": {"insecure": True, "allowAnonymousPeers": True}})
    pod = m.worker_pod(owner(), "decode", "llm-decode-abcde", spec)
    args = pod["spec"]["containers"][0]["args"]
    assert "--insecure" in args and "--allow-anonymous-peers" in args and "--cluster-key-file" not in args
    assert "volumes" not in pod["spec"] and "volumeMounts" not in pod["spec"]["containers"][0]
    keyed = parse_spec({"model": {"source": "m"}})
    assert m.current_templates(spec) != m.current_templates(keyed), "turning the key on or off rolls the pods"


def test_the_secret_is_owned_by_its_cluster_and_holds_the_key(owner: Callable[..., Any]) -> None:
    secret = m.key_secret(owner("llm", uid="uid-7"), f"{OLD}\n{NEW}", ACCEPT)
    assert secret["metadata"]["name"] == "llm-cluster-key" and secret["type"] == "Opaque"
    (ref,) = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == "uid-7" and ref["kind"] == "DisaggCluster" and ref["controller"] is True
    assert secret["metadata"]["annotations"] == {m.ROTATION_ANNOTATION: ACCEPT}
    assert secret["stringData"] == {m.KEY_ITEM: f"{OLD}\n{NEW}"}
    assert m.key_secret(owner(), OLD)["metadata"]["annotations"] == {}


def test_a_new_cluster_gets_a_fresh_random_key() -> None:
    first, second = plan_key(None, None, None, settled=False), plan_key(None, None, None, settled=False)
    assert first.create and first.rotation is None and first.event and first.event[1] == "ClusterKeyCreated"
    assert first.text and second.text and first.text != second.text
    ClusterKey(first.text.encode())  # a usable key


def test_a_deleted_secret_rotates_through_three_steps_each_after_every_worker() -> None:
    start = plan_key(None, None, OLD, settled=False)
    assert start.create and start.rotation == ACCEPT and keys_of(start.text or "")[0] == OLD
    new = keys_of(start.text or "")[1]
    assert new != OLD
    accept = start.text or ""
    assert plan_key(accept, ACCEPT, accept, settled=False).text is None, "waits for every worker"
    sign = plan_key(accept, ACCEPT, accept, settled=True)
    assert sign.rotation == SIGN and keys_of(sign.text or "") == [new, OLD]
    assert plan_key(sign.text, SIGN, sign.text, settled=False).text is None
    done = plan_key(sign.text, SIGN, sign.text, settled=True)
    assert done.text == new and done.rotation is None and done.event and done.event[1] == "KeyRotated"
    assert plan_key(done.text, None, done.text, settled=True).text is None, "a single key is the resting state"
    # The steps' neighbours understand each other; the first and the last do not.
    steps = [ClusterKey(t.encode()) for t in (OLD, accept, sign.text or "", done.text or "")]
    method = "/xllm.proto.DisaggPDService/LinkInstance"
    for a, b in zip(steps, steps[1:]):
        CredentialVerifier(b).verify(method, a.credential(method))
        CredentialVerifier(a).verify(method, b.credential(method))


def test_a_secret_replaced_by_hand_is_staged_not_applied_at_once() -> None:
    plan = plan_key(NEW, None, OLD, settled=True)
    assert plan.rotation == ACCEPT and keys_of(plan.text or "") == [OLD, NEW] and not plan.create
    # After an operator restart nothing is known: the Secret is taken as it is.
    assert plan_key(NEW, None, None, settled=True).text is None


def test_the_client_api_key_comes_from_the_named_secret_into_the_prefill_only(owner: Callable[..., Any]) -> None:
    spec = parse_spec({"model": {"source": "m"}, "security": {"apiKeySecretName": "llm-api-key"}})
    prefill = m.worker_pod(owner(), "prefill", "llm-prefill-abcde", spec)["spec"]["containers"][0]["env"]
    assert {"name": "DISAGG_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-api-key", "key": "key"}}} in prefill
    decode = m.worker_pod(owner(), "decode", "llm-decode-abcde", spec)["spec"]["containers"][0]["env"]
    assert all(v["name"] != "DISAGG_API_KEY" for v in decode)


def test_a_tls_secret_is_mounted_and_renaming_it_rolls_the_pods(owner: Callable[..., Any]) -> None:
    spec = parse_spec({"model": {"source": "m"}, "security": {"tlsSecretName": "llm-tls"}})
    pod = m.worker_pod(owner("llm"), "decode", "llm-decode-abcde", spec)
    assert [v["secret"]["secretName"] for v in pod["spec"]["volumes"]] == ["llm-cluster-key", "llm-tls"]
    container = pod["spec"]["containers"][0]
    assert {"name": m.TLS_VOLUME, "mountPath": m.TLS_MOUNT_DIR, "readOnly": True} in container["volumeMounts"]
    assert container["args"][container["args"].index("--tls-dir") + 1] == m.TLS_MOUNT_DIR
    other = parse_spec({"model": {"source": "m"}, "security": {"tlsSecretName": "llm-tls-2"}})
    assert m.current_templates(spec) != m.current_templates(other)
    assert "--tls-dir" not in m.worker_args("decode", parse_spec({"model": {"source": "m"}}))


def test_a_worker_that_does_not_answer_holds_the_rotations_step() -> None:
    expected = ClusterKey(f"{OLD}\n{NEW}".encode()).fingerprint()
    assert every_worker_holds(expected, [expected, expected])
    assert every_worker_holds(expected, [])
    assert not every_worker_holds(expected, [expected, None]), "busy past the timeout: it may still be a step behind"
    assert not every_worker_holds(expected, [expected, ClusterKey(OLD.encode()).fingerprint()])
