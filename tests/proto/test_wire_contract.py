"""Our .proto files are wire-identical to xLLM's DisaggPDService."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from disagg.proto import common_pb2, disagg_pd_pb2, xllm_service_pb2

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT.parent / "shared" / "seed" / "disagg_pd.proto"

# The two items of xLLM's common.proto the seed imports, and the scheduler's
# Generations method, as PROTOCOL.md gives them.
SEED_COMMON = """syntax = "proto3";
package xllm.proto;
message Status { bool ok = 1; }
enum Priority { DEFAULT = 0; HIGH = 1; NORMAL = 2; LOW = 3; }
"""
SEED_XLLM_SERVICE = """syntax = "proto3";
package xllm_service.proto;
import "disagg_pd.proto";
service XllmRpcService {
  rpc Generations(xllm.proto.DisaggStreamGenerations) returns (xllm.proto.StatusSet) {}
}
"""


def ours() -> list[descriptor_pb2.FileDescriptorProto]:
    out = []
    for module in (common_pb2, disagg_pd_pb2, xllm_service_pb2):
        fd = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fd)
        out.append(fd)
    return out


def test_compiled_stubs_match_golden_listing(listing, golden_path: Path) -> None:
    golden = golden_path.read_text().splitlines()
    got = listing(ours())
    missing = sorted(set(golden) - set(got))
    extra = sorted(set(got) - set(golden))
    assert not missing and not extra, f"missing: {missing[:10]}\nextra: {extra[:10]}"


def test_golden_listing_covers_the_whole_contract(golden_path: Path) -> None:
    golden = golden_path.read_text()
    for rpc in ("AddNewRequests", "FirstGeneration", "MultiGenerations", "SendPullSignal", "LinkInstance", "UnlinkInstance"):
        assert f"/xllm.proto.DisaggPDService/{rpc}(" in golden
    assert "rpc /xllm_service.proto.XllmRpcService/Generations(xllm.proto.DisaggStreamGenerations) returns (xllm.proto.StatusSet)" in golden
    assert "field xllm.proto.DisaggRequest.ttlt_slo_ms = 30 proto3_optional int32" in golden
    assert "field xllm.proto.DisaggRequest.priority = 31 proto3_optional enum xllm.proto.Priority" in golden


@pytest.mark.skipif(not SEED.exists(), reason=f"the seed contract is not at {SEED}")
def test_golden_listing_equals_the_seed(listing, golden_path: Path) -> None:
    """Compile the seed itself, so the golden file can never drift from it."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "disagg_pd.proto").write_text(SEED.read_text())
        (d / "common.proto").write_text(SEED_COMMON)
        (d / "xllm_service.proto").write_text(SEED_XLLM_SERVICE)
        out = d / "set.pb"
        rc = protoc.main(["protoc", f"-I{d}", "--include_imports", f"--descriptor_set_out={out}", str(d / "xllm_service.proto")])
        assert rc == 0, "protoc could not compile the seed"
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert listing(fds.file) == golden_path.read_text().splitlines()


def test_generated_stubs_are_fresh() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_stubs_import_inside_the_disagg_namespace() -> None:
    """The classic `import common_pb2` top-level import must not occur."""
    for path in (ROOT / "proto").glob("*_pb2*.py"):
        text = path.read_text()
        assert "\nimport common_pb2" not in text and "\nimport disagg_pd_pb2" not in text, path.name
    from disagg.proto import disagg_pd_pb2_grpc, xllm_service_pb2_grpc

    assert hasattr(disagg_pd_pb2_grpc, "DisaggPDServiceServicer")
    assert hasattr(xllm_service_pb2_grpc, "XllmRpcServiceStub")
