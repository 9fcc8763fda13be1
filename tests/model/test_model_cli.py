"""`kvserve make-tiny-model`, registered on a plain argparse parser."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvserve.model_service import model_cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve")
    model_cli.register(p.add_subparsers(dest="command", required=True))
    return p


def test_make_tiny_model_writes_a_checkpoint(tmp_path: Path, capsys) -> None:
    args = parser().parse_args(["make-tiny-model", str(tmp_path / "m"), "--preset", "tiny-qwen3",
                                "--seed", "3"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_presets_are_the_choices(capsys) -> None:
    try:
        parser().parse_args(["make-tiny-model", "x", "--preset", "nope"])
    except SystemExit:
        pass
    err = capsys.readouterr().err
    assert "tiny" in err and "bench" in err and "tiny-llama3" in err


def test_registering_does_not_import_torch() -> None:
    code = ("import sys, argparse; from kvserve.model_service import model_cli; "
            "model_cli.register(argparse.ArgumentParser().add_subparsers()); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
