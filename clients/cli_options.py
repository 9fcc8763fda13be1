"""The flags every client command shares to reach a server (API key, TLS) and the SDK client
they make. No grpc import at module level: `kvserve --help` must stay light."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.clients.inference_client import InferenceClient

API_KEY_ENV = "KVSERVE_API_KEY"


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API key and TLS")
    # The default is read when the command runs, so --help never prints a key.
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"send `authorization: Bearer KEY` with every call (default: ${API_KEY_ENV})")
    g.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's root CAs")
    g.add_argument("--tls-ca", default="", metavar="FILE",
                   help="PEM CA that signed the server's certificate (implies --tls)")
    g.add_argument("--tls-cert", default="", metavar="FILE",
                   help="PEM client certificate, for servers that require mutual TLS (with --tls-key)")
    g.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-server-name", default="", metavar="NAME",
                   help="check the server's certificate against NAME, not the address's host (implies --tls)")


def connection(args: argparse.Namespace) -> dict:
    """InferenceClient's tls= and api_key= from the flags; ValueError with a sentence for a bad
    file or half a certificate pair."""
    from kvserve.services.plumbing.tls import ClientTLS

    tls = ClientTLS.of(args.tls_ca, args.tls_cert, args.tls_key, enabled=args.tls or bool(args.tls_server_name),
                       server_name=args.tls_server_name)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    return {"tls": tls, "api_key": api_key or None}


def make_client(args: argparse.Namespace, timeout: float | None = None) -> InferenceClient:
    from kvserve.clients.inference_client import InferenceClient

    return InferenceClient(args.address, timeout=timeout, **connection(args))


def tolerant_stdout() -> None:
    """Model output may hold characters the terminal's encoding lacks: replace, never crash."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")


def tolerant_stdin() -> None:
    """stdin's bytes that are not UTF-8 read as surrogates, which the prompt's checks then refuse
    with a sentence: under a UTF-8 locale (not C's) Python reads stdin strictly, and such bytes
    were a UnicodeDecodeError's traceback."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
