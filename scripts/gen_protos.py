"""Regenerate the Python stubs for every .proto under protos/.

The stubs (``*_pb2.py``, ``*_pb2_grpc.py``, ``*_pb2.pyi``) are written beside
their .proto so that ``protos/`` is the root of the ``kvserve`` package and
``kvserve.kvcache.v1.kvcache_pb2`` imports the same way from a checkout, an
editable install and a wheel.

Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under ``root``, relative to it, in a stable order."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every .proto under ``root``; return the files written."""
    # Imported here so that `--help` works without grpcio-tools installed.
    import grpc_tools
    from grpc_tools import protoc

    files = proto_files(root)
    if not files:
        raise SystemExit(f"no .proto files under {root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # grpc_tools ships the well-known types (google/protobuf/*.proto).
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see the messages above)")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="output root (default: protos/, beside the sources)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
