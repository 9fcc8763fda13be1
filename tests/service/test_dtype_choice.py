"""--dtype auto (model_service/dtype_choice.py): the checkpoint's bfloat16 on a CPU that computes
it natively, float32 otherwise on CPU, bfloat16 on CUDA; named dtypes as named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve.model_service import dtype_choice
from kvserve.model_service.dtype_choice import checkpoint_dtype, pick_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_cpu_follows_the_checkpoint_where_the_cpu_has_bf16(monkeypatch, native) -> None:
    monkeypatch.setattr(dtype_choice, "native_bfloat16", lambda: native)
    assert pick_dtype("auto", CPU, "bfloat16") == (torch.bfloat16 if native else torch.float32)
    for checkpoint in ("float32", "float16", None):
        assert pick_dtype("auto", CPU, checkpoint) == torch.float32
    assert pick_dtype("auto", CUDA, "float32") == torch.bfloat16
    for name in ("float32", "bfloat16", "float16"):
        assert pick_dtype(name, CPU, "bfloat16") == getattr(torch, name)


def test_checkpoint_dtype_reads_either_key(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None


def test_a_built_stack_takes_the_checkpoint_dtype_this_cpu_computes(tiny_dirs, tmp_path) -> None:
    """The real build: a checkpoint marked bfloat16 serves in bfloat16 exactly where this CPU has
    bf16 instructions; the float32 one always in float32."""
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig

    marked = tmp_path / "tiny-bf16"
    shutil.copytree(tiny_dirs["tiny"], marked)
    config = json.loads((marked / "config.json").read_text())
    (marked / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    want = torch.bfloat16 if dtype_choice.native_bfloat16() else torch.float32
    for path, expected in ((marked, want), (tiny_dirs["tiny"], torch.float32)):
        stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cpu"))
        assert stack.dtype == expected
