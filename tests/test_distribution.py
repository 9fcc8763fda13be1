"""Installing kvserve adds one top-level import package, `kvserve`, and nothing else."""

from __future__ import annotations

from importlib import metadata


def test_the_distribution_has_one_import_root() -> None:
    dist = metadata.distribution("kvserve")
    assert dist.read_text("top_level.txt").split() == ["kvserve"]


def test_the_command_lives_under_the_import_root() -> None:
    (script,) = [e for e in metadata.distribution("kvserve").entry_points if e.group == "console_scripts"]
    assert script.name == "kvserve"
    assert script.value.split(":")[0].startswith("kvserve.")
