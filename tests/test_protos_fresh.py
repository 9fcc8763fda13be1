"""The committed *_pb2 stubs are exactly what scripts/gen_protos.py writes today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path) for p in _load_generator().generate(tmp_path)}
    committed = {p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*_pb2*.py*")}
    stale = sorted(
        str(rel) for rel in fresh | committed
        if rel not in fresh or rel not in committed
        or (tmp_path / rel).read_bytes() != (PROTO_ROOT / rel).read_bytes()
    )
    assert not stale, f"generated stubs are out of date ({', '.join(stale)}): run make protos"
