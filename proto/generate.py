"""Regenerate the Python stubs of the .proto files in this folder.

    python proto/generate.py           # write the stubs beside the .proto files
    python proto/generate.py --check   # exit 1 if the committed stubs are stale

protoc sees this folder as `disagg/proto`, so the generated modules import
each other as `disagg.proto.*` instead of the broken top-level `import
common_pb2` that a bare include path gives.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("common.proto", "disagg_pd.proto", "xllm_service.proto")
# Only files that define a service get a *_pb2_grpc module.
SERVICES = ("disagg_pd.proto", "xllm_service.proto")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into out_dir; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for name in PROTOS:
        args = [
            "protoc",
            f"-I{include}",
            f"-Idisagg/proto={HERE}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
        ]
        if name in SERVICES:
            args.append(f"--grpc_python_out={out_dir}")
        if protoc.main([*args, f"{HERE / name}"]) != 0:
            raise RuntimeError(f"protoc failed on {name}")
    return sorted((out_dir / "disagg" / "proto").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh if not (HERE / f.name).exists() or not filecmp.cmp(f, HERE / f.name, shallow=False)]
        if args.check:
            if stale:
                print(f"stale generated stubs: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
                return 1
            return 0
        for f in fresh:
            (HERE / f.name).write_bytes(f.read_bytes())
        print(f"wrote {len(fresh)} files into {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
