"""The typed spec and the CRD schema: defaults, validation, and the committed manifest."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
import yaml

from disagg.operator import crd
from disagg.operator.spec import DEFAULT_BLOCK_SIZE, DEFAULT_DRAIN_TIMEOUT_S, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_applied() -> None:
    s = parse_spec({"model": {"source": "m"}})
    assert (s.prefill.replicas, s.decode.replicas) == (1, 1)
    assert s.engine.block_size == DEFAULT_BLOCK_SIZE
    assert s.drain_timeout_s == DEFAULT_DRAIN_TIMEOUT_S
    assert s.model.served_name == "m"
    assert (s.kv_transfer.mode, s.kv_transfer.transport, s.kv_transfer.connections) == ("PUSH", "tcp", None)


@pytest.mark.parametrize("bad, message", [
    ({}, "spec.model.source is required"),
    ({"model": {"source": "m"}, "prefill": {"replicas": -1}}, "spec.prefill.replicas must be between"),
    ({"model": {"source": "m"}, "decode": {"replicas": "2"}}, "spec.decode.replicas must be a int"),
    ({"model": {"source": "m"}, "decode": {"replicas": True}}, "spec.decode.replicas must be a int"),
    ({"model": {"source": "m"}, "kvTransfer": {"transport": "rdma"}}, "spec.kvTransfer.transport must be one of"),
    ({"model": {"source": "m"}, "kvTransfer": {"connections": 0}}, "spec.kvTransfer.connections must be between"),
    ({"model": {"source": "m"}, "engine": {"blockSize": 0}}, "spec.engine.blockSize must be between"),
    ({"model": {"source": "m"}, "prefill": {"args": ["--x", 1]}}, "spec.prefill.args must be a list of strings"),
])
def test_invalid_specs_are_permanent_errors(bad: dict, message: str) -> None:
    with pytest.raises(kopf.PermanentError, match=message):
        parse_spec(bad)


def test_kv_layout_changes_with_model_dtype_and_block_size_only() -> None:
    base = parse_spec({"model": {"source": "m"}})
    assert parse_spec({"model": {"source": "m"}, "decode": {"replicas": 3}}).kv_layout == base.kv_layout
    for other in ({"model": {"source": "n"}}, {"model": {"source": "m"}, "engine": {"blockSize": 32}},
                  {"model": {"source": "m"}, "engine": {"dtype": "float16"}}):
        assert parse_spec(other).kv_layout != base.kv_layout


@pytest.mark.parametrize("file", sorted(crd.FILES))
def test_committed_crd_manifest_equals_the_code(file: str) -> None:
    committed = (ROOT / "deploy" / "crds" / file).read_text()
    assert committed == crd.render(file), f"regenerate with: python -m disagg.operator.crd {file} > deploy/crds/{file}"
    assert yaml.safe_load(committed) == crd.FILES[file]()
    assert sorted(p.name for p in (ROOT / "deploy" / "crds").glob("*.yaml")) == sorted(crd.FILES)


def test_schema_is_structural_and_publishes_the_spec_defaults() -> None:
    doc = crd.crd()
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["dc"]
    assert version["subresources"] == {"status": {}}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model"]
    assert spec["properties"]["kvTransfer"]["properties"]["transport"]["enum"] == ["tcp", "cuda_ipc", "nccl"]
    assert spec["properties"]["decode"]["properties"]["replicas"]["minimum"] == 0

    def walk(node: dict, path: str) -> None:
        # Structural: every node has a type, or says it keeps unknown fields.
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for path in columns.values():
        if path.startswith(".status."):
            assert path.removeprefix(".status.") in status, path
