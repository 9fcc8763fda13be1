"""The `kvserve` command: one subcommand per service or tool.

Each subcommand lives with its package and is added by a register function,
``register(subparsers) -> None``, which calls ``subparsers.add_parser(...)`` and
sets ``func``: a callable taking the parsed args and returning an exit code.
Register modules must import quickly (no torch at module level) so that
``kvserve --help`` stays fast; heavy imports belong inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from kvserve.services.plumbing.logging_setup import DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS, configure_logging
from kvserve.services.plumbing.open_files import raise_open_files_limit
from kvserve.services.plumbing.version import kvserve_version

# gRPC's own log lines above a command's one-line error (its INFO line for a failed TLS handshake,
# say) say it again in a form meant for gRPC's developers; its errors still show. (Read when gRPC
# is first imported: set before any command's module is.)
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# The subcommands that serve: each keeps a connection (a file descriptor) per client or lane stream.
SERVERS = {"up", "kvcache", "model", "gateway"}

# Subcommand name -> "module:function" of its register function, in --help order.
COMMANDS: dict[str, str] = {
    "up": "kvserve.services.cli.up:register",
    "kvcache": "kvserve.kvcache_service.cli:register",
    "model": "kvserve.model_service.cli:register",
    "gateway": "kvserve.services.gateway.cli:register",
    "make-tiny-model": "kvserve.model_service.model_cli:register",
    "generate": "kvserve.clients.cli:register_generate",
    "chat": "kvserve.clients.cli:register_chat",
    "stats": "kvserve.clients.cli:register_stats",
    "tokenize": "kvserve.clients.tokens_cli:register_tokenize",
    "detokenize": "kvserve.clients.tokens_cli:register_detokenize",
    "top": "kvserve.clients.top:register",
}


def main(argv: Sequence[str] | None = None) -> int:
    from kvserve.services.cli.supervisor import EXIT_CANNOT_LISTEN
    from kvserve.services.plumbing.address import CannotListen
    from kvserve.services.plumbing.config_flags import BadFlags

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format, args.log_source)
    if args.command in SERVERS:
        raise_open_files_limit()
    try:
        return int(args.func(args) or 0)
    except BadFlags as exc:
        print(exc.message, file=sys.stderr)
        return exc.code
    except CannotListen as exc:
        print(f"kvserve {args.command}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LISTEN
    except KeyboardInterrupt:   # Ctrl-C where a command has nothing of its own to clean up
        return _interrupted(args.command)
    except RuntimeError as exc:
        # Ctrl-C that landed inside a lock's wait (grpc's, say) between its release and the code
        # that takes it back: the `with` then fails to release it, and this is what surfaces.
        if isinstance(exc.__context__, KeyboardInterrupt):
            return _interrupted(args.command)
        raise


def _interrupted(command: str) -> int:
    print(f"kvserve {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving over gRPC.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvserve_version()}")
    logging_flags = [("--log-level", dict(choices=LOG_LEVELS, default=DEFAULT_LOG_LEVEL)),
                     ("--log-format", dict(choices=LOG_FORMATS, default="text",
                                           help="text, or one JSON object a line (time in UTC, level, logger, "
                                                "message, source, exception)")),
                     ("--log-source", dict(default="", metavar="NAME",
                                           help="a name each log line carries (kvserve up names its children)"))]
    for flag, spec in logging_flags:
        parser.add_argument(flag, **spec)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for spec in COMMANDS.values():
        _register(subparsers, spec)
    for sub in subparsers.choices.values():
        # Accept `kvserve kvcache --log-level debug` too; SUPPRESS keeps the
        # top-level value when the flag is given before the subcommand.
        for flag, spec in logging_flags:
            if flag not in sub._option_string_actions:
                sub.add_argument(flag, **{**spec, "default": argparse.SUPPRESS})
    return parser


def _register(subparsers: argparse._SubParsersAction, spec: str) -> None:
    module_name, _, func_name = spec.partition(":")
    getattr(importlib.import_module(module_name), func_name)(subparsers)


if __name__ == "__main__":
    sys.exit(main())
