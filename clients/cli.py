"""`kvserve generate`, `kvserve chat` and `kvserve stats`: command-line clients of the Inference service.

    kvserve generate "Once upon a time" --max-tokens 64 --temperature 0
    printf 'hi\\nand then?\\n' | kvserve chat --system "You are terse."
    kvserve stats --address gateway.example:443 --tls-ca ca.pem --api-key KEY

The text streams to stdout; summaries and errors go to stderr, so stdout holds
only model output. Imports of grpc and the SDK happen inside the commands, to
keep `kvserve --help` fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, TextIO

from kvserve.clients.cli_options import add_connection_flags, make_client, tolerant_stdin, tolerant_stdout
from kvserve.clients.ctrl_c import CtrlCCancels

if TYPE_CHECKING:
    from kvserve.clients.inference_client import Finished, GenerateStream, InferenceClient, PrefillDone

DEFAULT_ADDRESS = "127.0.0.1:50051"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def register(subparsers: argparse._SubParsersAction) -> None:
    """Both commands."""
    register_generate(subparsers)
    register_chat(subparsers)


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="stream a completion from a model service",
        description="Send one prompt to a model service and stream the text to stdout; a summary "
                    "(tokens, cache hits, latency) goes to stderr. Ctrl-C cancels the request.")
    p.add_argument("text", nargs="?", default="-", metavar="TEXT",
                   help="the prompt; '-' or nothing: read it from stdin. With --token-ids: token ids, "
                        "separated by commas or spaces")
    _add_common(p)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: off; "
                                                          "default: the model's)")
    p.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    p.add_argument("-n", "--n", type=int, default=None, metavar="N",
                   help="sample N sequences from the prompt (computed once); each is printed when all end")
    p.add_argument("--stop", action="append", default=[], metavar="S",
                   help="stop at this string (repeatable); it is not printed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--token-ids", action="store_true", help="TEXT is a list of token ids, not text")
    p.set_defaults(func=run_generate)


def register_stats(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stats", help="a model service's or a gateway's counters (a gateway's: one row per worker)",
        description="Print GetServerStats: queues, tokens, cache hits; from a gateway, its queue and a "
                    "table of its workers (state, load, pages, requests routed, cache hits).")
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"the model service or gateway: host:port or unix:///path (default {DEFAULT_ADDRESS})")
    add_connection_flags(p)
    p.set_defaults(func=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from kvserve.clients.top import is_gateway

    from kvserve.clients.inference_client import KVServeError

    console = Console(width=None if sys.stdout.isatty() else 200)   # piped: never fold a row
    client = _client(args, "stats")
    if client is None:
        return 2
    try:
        with client:
            s = client.server_stats()
    except KVServeError as exc:
        print(f"kvserve stats: {exc}", file=sys.stderr)
        return 1
    hit = f"{s.cached_tokens / s.prompt_tokens:.0%}" if s.prompt_tokens else "-"
    console.print(f"running {s.running}, waiting {s.waiting}, prompt tokens {s.prompt_tokens:,} "
                  f"({hit} from cache)" + (f", queued at the gateway {s.queued}" if is_gateway(s) else ""))
    if not s.serving:
        console.print(f"NOT SERVING: {s.not_serving}", markup=False)
    if not is_gateway(s):
        console.print(f"requests finished {s.requests_finished:,}, aborted {s.requests_aborted:,}, failed "
                      f"{s.requests_failed:,}; manager {'reachable' if s.manager_reachable else 'UNREACHABLE'}")
        return 0
    table = Table("worker", "state", "running", "waiting", "prefill ahead", "pages used / free / cached", "routed",
                  "cache hits", "index pages", "events", "moved off", "hop")
    # whole, on as many lines as it needs: cut to the width, two workers' addresses read alike
    table.columns[0].overflow, table.columns[0].no_wrap = "fold", False
    for w in s.workers:
        hits = f"{w.hit_tokens / w.prompt_tokens:.0%}" if w.prompt_tokens else "-"
        table.add_row(escape(w.address), w.state, str(w.running), str(w.waiting), f"{w.prefill_tokens:,}",
                      f"{w.used_pages} / {w.free_pages} / {w.cached_pages}", str(w.requests_routed), hits,
                      str(w.index_pages), f"epoch {w.epoch}" if w.events_live else "not followed",
                      str(w.migrated_away), "lane" if w.lane else "gRPC")
    console.print(table)
    for w in s.workers:
        if w.not_serving:
            console.print(f"{w.address} is not serving: {w.not_serving}", markup=False)
    return 0


def register_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat", help="a multi-turn chat with a model service (reads turns from stdin)",
        description="Each line read from stdin is a user turn; the whole conversation is sent with "
                    "every turn and rendered by the model's chat template, so each turn finds the "
                    "previous ones in the prefix cache (shown on stderr). /reset clears the "
                    "history, /quit or end of input ends.")
    _add_common(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    p.add_argument("--seed", type=int, default=None, help="seed of every turn's sampling")
    p.set_defaults(func=run_chat)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"the model service (or gateway): host:port or unix:///path (default {DEFAULT_ADDRESS})")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each request, in seconds, under 1e9 (default: none)")
    add_connection_flags(p)


def _client(args: argparse.Namespace, command: str, timeout: float | None = None) -> InferenceClient | None:
    """The SDK client the flags describe; None (after saying why) for a bad TLS file or key."""
    try:
        return make_client(args, timeout)
    except ValueError as exc:
        print(f"kvserve {command}: {exc}", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- generate

def run_generate(args: argparse.Namespace) -> int:
    from kvserve.clients.inference_client import KVServeError

    tolerant_stdin()
    tolerant_stdout()
    text = sys.stdin.read() if args.text == "-" else args.text
    inputs: dict[str, object] = {"prompt": text}
    if args.token_ids:
        try:
            inputs = {"token_ids": [int(t) for t in text.replace(",", " ").split()]}
        except ValueError:
            print(f"kvserve generate: --token-ids wants integers, got {text!r}", file=sys.stderr)
            return 2
    client = _client(args, "generate", args.timeout)
    if client is None:
        return 2
    out = _Output(sys.stdout)
    stream = None
    with client, CtrlCCancels() as ctrl_c:
        try:
            stream = ctrl_c.watch(client.generate(
                **inputs, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n))
            if (args.n or 1) > 1:
                finished = _print_sequences(stream, out)
            else:
                _, finished = _stream_text(stream, out)
        except KVServeError as exc:
            if ctrl_c.pressed:  # the CANCELLED that Ctrl-C asked for
                return _cancelled(out, "[cancelled]")
            out.end_line()
            print(f"kvserve generate: {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        except ValueError as exc:   # a value the request cannot carry: said before anything is sent
            print(f"kvserve generate: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:   # pressed before the call existed, or twice
            if stream is not None:
                stream.cancel()
            return _cancelled(out, "[cancelled]")
        except BrokenPipeError:  # `kvserve generate ... | head`: stop generating, quietly
            if stream is not None:
                stream.cancel()
            _silence_stdout()
            return 1
        if ctrl_c.pressed:  # the stream ended before the cancel reached it; the user still pressed
            return _cancelled(out, "[cancelled]")
    out.end_line()
    print(_generate_summary(finished), file=sys.stderr)
    return 1 if finished.reason == "abort" else 0   # cut short at the server (a Cancel, a drain): not an answer


def _generate_summary(f: Finished) -> str:
    rate = f.completion_tokens / (f.total_ms / 1e3) if f.total_ms > 0 else 0.0
    stop = f" ({f.stop!r})" if f.stop else ""
    return (f"[{f.prompt_tokens} prompt tokens ({f.cached_tokens} cached), {f.completion_tokens} completion "
            f"tokens, ttft {f.ttft_ms:.1f} ms, total {f.total_ms:.1f} ms, {rate:.1f} tokens/s, "
            f"finish {f.reason}{stop}]")


# --------------------------------------------------------------------------- chat

def run_chat(args: argparse.Namespace) -> int:
    tolerant_stdin()
    from kvserve.clients.convert import generate_request
    from kvserve.clients.inference_client import KVServeError

    tolerant_stdout()
    try:   # a value no turn's request can carry: said before the first turn, as generate says it
        generate_request(messages=[{"role": "user", "content": ""}], max_tokens=args.max_tokens,
                         temperature=args.temperature, seed=args.seed)
    except ValueError as exc:
        print(f"kvserve chat: {exc}", file=sys.stderr)
        return 2
    client = _client(args, "chat", args.timeout)
    if client is None:
        return 2
    interactive = sys.stdin.isatty()
    out = _Output(sys.stdout)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    turn, failed = 0, False
    with client:
        while True:
            try:
                line = _read_turn(interactive)
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat
                out.end_line(force=True)
                return EXIT_INTERRUPTED
            if line is None or line.strip() == "/quit":
                break
            if line.strip() == "/reset":
                history, turn = list(opening), 0
                print("[history cleared]", file=sys.stderr)
                continue
            if not line.strip():
                continue
            turn += 1
            history.append({"role": "user", "content": line})
            stream = None
            interrupted = False
            with CtrlCCancels() as ctrl_c:
                try:
                    stream = ctrl_c.watch(client.generate(messages=history, max_tokens=args.max_tokens,
                                                          temperature=args.temperature, seed=args.seed))
                    reply: list[str] = []
                    _, finished = _stream_text(stream, out, collect=reply)
                    interrupted = ctrl_c.pressed  # ended before the cancel reached it
                except (KVServeError, ValueError) as exc:
                    interrupted = ctrl_c.pressed  # the CANCELLED that Ctrl-C asked for
                    if not interrupted:
                        out.end_line()
                        why = f"{exc.code}: {exc.message}" if isinstance(exc, KVServeError) else str(exc)
                        print(f"kvserve chat: {why}", file=sys.stderr)
                        history.pop()  # the turn did not happen; the user may send it again
                        turn -= 1
                        failed = True
                        continue
                except KeyboardInterrupt:  # pressed before the call existed, or twice
                    if stream is not None:
                        stream.cancel()
                    interrupted = True
                except BrokenPipeError:
                    if stream is not None:
                        stream.cancel()
                    _silence_stdout()
                    return 1
            if interrupted:  # Ctrl-C during a reply cancels that reply only
                _cancelled(out, "[reply cancelled]", force=True)
                history.pop()
                turn -= 1
                if not interactive:
                    return EXIT_INTERRUPTED
                continue
            out.end_line(force=True)  # every reply ends with a newline of its own
            history.append({"role": "assistant", "content": "".join(reply)})
            print(_chat_summary(turn, finished), file=sys.stderr, flush=True)
    return 1 if failed else 0


def _read_turn(interactive: bool) -> str | None:
    """The next user line without its newline; None at end of input."""
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line.removesuffix("\n").removesuffix("\r") if line else None


def _chat_summary(turn: int, f: Finished) -> str:
    end = "" if f.reason == "stop" else f", finish {f.reason}"
    return (f"[turn {turn}: {f.prompt_tokens} prompt tokens, {f.cached_tokens} from cache, "
            f"{f.completion_tokens} generated, ttft {f.ttft_ms:.1f} ms{end}]")


# --------------------------------------------------------------------------- shared

class _Output:
    """stdout, remembering whether the last line written is still open."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.open_line = False

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self, force: bool = False) -> None:
        """Finish a partly written line (any line with force) so what follows starts on its own."""
        if force or self.open_line:
            try:
                self.write("\n")
            except (BrokenPipeError, ValueError):
                pass
        self.open_line = False


def _stream_text(stream: GenerateStream, out: _Output, collect: list[str] | None = None
                 ) -> tuple[PrefillDone | None, Finished]:
    """Write each chunk's text to `out` as it arrives; -> (prefill_done, finished)."""
    from kvserve.clients.inference_client import Chunk, Finished, KVServeError, PrefillDone

    prefill = finished = None
    for event in stream:
        if isinstance(event, Chunk):
            out.write(event.text)
            if collect is not None:
                collect.append(event.text)
        elif isinstance(event, PrefillDone):
            prefill = event
        elif isinstance(event, Finished):
            finished = event
        else:
            _say_queued(event)
    if finished is None:
        raise KVServeError("INTERNAL", "the stream ended without a finished event")
    return prefill, finished


def _print_sequences(stream: GenerateStream, out: _Output) -> Finished:
    """n > 1: each sequence's text once the call ends, under a header naming it; -> the last
    Finished."""
    from kvserve.clients.convert import Collector

    collected = Collector()
    for event in stream:
        collected.add(event)
        _say_queued(event)
    for choice in collected.completion().choices:
        out.write(f"--- sequence {choice.finished.index} ({choice.finished.reason}, "
                  f"{choice.finished.completion_tokens} tokens) ---\n{choice.text}\n")
    ends = collected.finished.values()
    # the request's summary: the last to end, with every sequence's tokens
    return dataclasses.replace(max(ends, key=lambda f: f.total_ms),
                               completion_tokens=sum(f.completion_tokens for f in ends))


def _say_queued(event) -> None:
    """A request waiting for room, told on stderr where it stands (nothing came, it looked hung)."""
    from kvserve.clients.inference_client import Queued

    if isinstance(event, Queued) and event.position:
        eta = f", about {event.eta_ms / 1000:.1f} s" if event.eta_ms else ""
        print(f"[queued: position {event.position}{eta}]", file=sys.stderr, flush=True)


def _cancelled(out: _Output, note: str, force: bool = False) -> int:
    """Say on stderr that Ctrl-C cancelled the stream; -> the exit status a shell expects."""
    out.end_line(force=force)
    print(note, file=sys.stderr)
    return EXIT_INTERRUPTED


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush is quiet."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
