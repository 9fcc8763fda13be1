"""`kvserve tokenize` and `kvserve detokenize`: a model service's (or a gateway's) tokenizer
from the shell, to count a prompt's tokens or read ids back as text.

    kvserve tokenize "The cache page holds"        # 12 tokens: 1, 450, 7090, ...
    kvserve detokenize 1 450 7090                  # the text, on stdout
    echo "some prompt" | kvserve tokenize --tokens # each token's string too

Results go to stdout, errors to stderr (exit 1 for the server's refusal, 2 for bad flags).
"""

from __future__ import annotations

import argparse
import sys

from kvserve.clients.cli_options import add_connection_flags, make_client, tolerant_stdin, tolerant_stdout

DEFAULT_ADDRESS = "127.0.0.1:50051"


def register_tokenize(subparsers: argparse._SubParsersAction) -> None:
    t = subparsers.add_parser("tokenize", help="the token ids a server makes of a prompt",
                              description="Print the token ids (and with --tokens each token's string) the "
                                          "server's tokenizer makes of TEXT, the count first.")
    t.add_argument("text", nargs="?", default="-", metavar="TEXT", help="the prompt; '-' or nothing: stdin")
    t.add_argument("--tokens", action="store_true", help="also each token's string, one per line")
    t.add_argument("--no-special-tokens", action="store_true",
                   help="without the tokens the tokenizer adds around a prompt (BOS)")
    _add_address(t)
    t.set_defaults(func=run_tokenize)


def register_detokenize(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser("detokenize", help="the text of token ids",
                              description="Print the text the server's tokenizer writes for token IDS.")
    d.add_argument("ids", nargs="*", metavar="IDS", help="token ids, separated by spaces or commas; none: stdin")
    d.add_argument("--skip-special-tokens", action="store_true", help="leave special tokens (BOS, EOS) out")
    _add_address(d)
    d.set_defaults(func=run_detokenize)


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"the model service or gateway: host:port or unix:///path (default {DEFAULT_ADDRESS})")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer")
    add_connection_flags(p)


def run_tokenize(args: argparse.Namespace) -> int:
    tolerant_stdin()
    from kvserve.clients.inference_client import KVServeError

    tolerant_stdout()   # a token's text the terminal's encoding lacks
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        with make_client(args, args.timeout) as client:
            out = client.tokenize(text, add_special_tokens=False if args.no_special_tokens else None)
    except KVServeError as exc:
        print(f"kvserve tokenize: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:   # a TLS file, a key, text the request cannot carry
        print(f"kvserve tokenize: {exc}", file=sys.stderr)
        return 2
    print(f"{len(out.token_ids)} tokens: " + ", ".join(map(str, out.token_ids)))
    if args.tokens:
        for token_id, token in zip(out.token_ids, out.tokens):
            print(f"{token_id}\t{token!r}")
    return 0


def run_detokenize(args: argparse.Namespace) -> int:
    tolerant_stdin()
    from kvserve.clients.inference_client import KVServeError

    tolerant_stdout()
    words = " ".join(args.ids) if args.ids else sys.stdin.read()
    try:
        ids = [int(word) for word in words.replace(",", " ").split()]
    except ValueError:
        print(f"kvserve detokenize: token ids are integers, got {words.strip()[:200]!r}", file=sys.stderr)
        return 2
    try:
        with make_client(args, args.timeout) as client:
            text = client.detokenize(ids, skip_special_tokens=args.skip_special_tokens)
    except KVServeError as exc:
        print(f"kvserve detokenize: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kvserve detokenize: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text + "\n")
    return 0
