"""The kvserve command: subcommand registry, --version, --log-level."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pytest

from kvserve.services.cli import main as cli
from kvserve.services.plumbing.logging_setup import configure_logging

DEMO_COMMAND = '''
import argparse

def register(subparsers) -> None:
    sub = subparsers.add_parser("demo", help="a test command")
    sub.add_argument("--code", type=int, default=0)
    sub.add_argument("--fail", choices=["ctrl-c", "ctrl-c-in-a-wait", "runtime"])
    sub.set_defaults(func=run)

def run(args):
    if args.fail == "ctrl-c":
        raise KeyboardInterrupt
    if args.fail == "ctrl-c-in-a-wait":   # what a Ctrl-C inside threading.Condition.wait can become
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("cannot release un-acquired lock")
    if args.fail == "runtime":
        raise RuntimeError("a real bug")
    return args.code
'''


@pytest.fixture
def demo_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "kvserve_demo_cmd.py").write_text(DEMO_COMMAND)
    (tmp_path / "kvserve_broken_cmd.py").write_text("import kvserve_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kvserve_demo_cmd:register"
    for name in ("kvserve_demo_cmd", "kvserve_broken_cmd"):
        sys.modules.pop(name, None)
    configure_logging("warning")  # undo the level main() set


def test_subcommand_exit_code_is_returned(demo_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"demo": demo_module})
    assert cli.main(["demo"]) == 0
    assert cli.main(["demo", "--code", "3"]) == 3


def test_ctrl_c_is_one_line_wherever_it_lands(
    demo_module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"demo": demo_module})
    for where in ("ctrl-c", "ctrl-c-in-a-wait"):
        assert cli.main(["demo", "--fail", where]) == 130
        assert capsys.readouterr().err == "kvserve demo: interrupted\n"
    with pytest.raises(RuntimeError, match="a real bug"):  # other RuntimeErrors are not hidden
        cli.main(["demo", "--fail", "runtime"])


def test_log_level_before_or_after_the_subcommand(demo_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"demo": demo_module})
    cli.main(["--log-level", "debug", "demo"])
    assert logging.getLogger().level == logging.DEBUG
    cli.main(["demo", "--log-level", "error"])
    assert logging.getLogger().level == logging.ERROR


def test_missing_dependency_inside_a_command_is_not_hidden(
    demo_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"broken": "kvserve_broken_cmd:register"})
    with pytest.raises(ModuleNotFoundError, match="kvserve_no_such_dependency"):
        cli.main(["broken"])


def test_version_and_required_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("kvserve ")
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    assert exit_.value.code == 2


def test_unknown_log_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("verbose")


def test_every_subcommand_sets_func() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert sub.get_default("func") is not None, f"kvserve {name} sets no func"
