"""`kvserve top`: a live terminal view of a model service or a gateway, polled with GetServerStats.

    kvserve top --address 127.0.0.1:50051
    kvserve top --address gateway.example:443 --tls-ca ca.pem --api-key KEY --once

Rates (tokens per second) come from the change in the server's counters between two polls.
On a gateway the generated tokens are those it streamed, and its KV-cache figures are the sums
of its workers' last reports. --once polls twice, --interval apart, prints that one frame and exits (1 if the
server cannot be reached). Imports of grpc and rich happen inside the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.clients.cli_options import add_connection_flags, make_client

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kvserve.clients.inference_client import InferenceClient, KVServeError, ServerStats

DEFAULT_ADDRESS = "127.0.0.1:50051"
POLL_TIMEOUT_S = 5.0   # a hung server shows as an error instead of freezing the view
MAX_INTERVAL_S = 86_400.0   # a day; time.sleep cannot take inf


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "top", help="a live view of a model service's or a gateway's load, tokens/s and cache",
        description="Poll GetServerStats every --interval seconds and show requests running and "
                    "waiting, tokens per second, KV-cache pages and the prefix hit rate; from a "
                    "gateway, its queue and one row per worker. Ctrl-C quits.")
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"the model service or gateway: host:port or unix:///path (default {DEFAULT_ADDRESS})")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between polls (default 1)")
    p.add_argument("--once", action="store_true",
                   help="poll twice, --interval apart, print one frame and exit (1 if unreachable)")
    add_connection_flags(p)
    p.set_defaults(func=run_top)


# --------------------------------------------------------------------------- numbers

@dataclass(frozen=True)
class Sample:
    at: float            # time.monotonic() when the answer came
    stats: ServerStats


def rate(prev: Sample | None, cur: Sample, counter: str) -> float | None:
    """counter's increase per second between two samples; None when it cannot be known."""
    if prev is None or cur.at <= prev.at:
        return None
    delta = getattr(cur.stats, counter) - getattr(prev.stats, counter)
    if delta < 0:   # the server restarted and counts from 0 again
        return None
    return delta / (cur.at - prev.at)


def is_gateway(s: ServerStats) -> bool:
    return s.gateway or bool(s.workers)   # (workers alone: a gateway of before the flag)


def _percent(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "n/a"


def _per_second(value: float | None, pending: str) -> str:
    return pending if value is None else f"{value:,.1f}"


def generated_rate(prev: Sample | None, cur: Sample) -> str:
    return _per_second(rate(prev, cur, "generated_tokens"), "n/a (needs a second poll)")


def kv_cache(s: ServerStats) -> str:
    if is_gateway(s):
        used = sum(w.used_pages for w in s.workers)
        free = sum(w.free_pages for w in s.workers)
        cached = sum(w.cached_pages for w in s.workers)
        total = used + free + cached
        where = f", summed over {len(s.workers)} workers"
    elif s.kvcache is not None:
        used, free, cached, total = s.kvcache.used_pages, s.kvcache.free_pages, s.kvcache.cached_pages, \
            s.kvcache.total_pages
        where = ""
    else:
        return "n/a (the model service cannot reach its KV-cache manager)"
    return f"{used} / {total} pages used ({_percent(used, total)}), cached {cached}, free {free}{where}"


def prefix_hits(s: ServerStats) -> str:
    if not s.prompt_tokens:
        return "n/a (no prompt tokens yet)"
    return f"{_percent(s.cached_tokens, s.prompt_tokens)} ({s.cached_tokens:,} of {s.prompt_tokens:,} prompt tokens)"


# --------------------------------------------------------------------------- rendering

def render(address: str, cur: Sample, prev: Sample | None, note: str) -> RenderableType:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = cur.stats
    kind = f"gateway, {len(s.workers)} workers" if is_gateway(s) else "model service"
    head = Text.assemble(("kvserve top ", "bold"), f"{address} ({kind}), {note}")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    requests = f"running {s.running}, waiting {s.waiting}"
    if is_gateway(s):
        requests += f", queued at the gateway {s.queued}"
    summary.add_row("requests", requests)
    prompt_rate = _per_second(rate(prev, cur, "prompt_tokens"), "n/a (needs a second poll)")
    summary.add_row("tokens/s", f"generated {generated_rate(prev, cur)}, prompt {prompt_rate}")
    summary.add_row("KV cache", kv_cache(s))
    summary.add_row("prefix hits", prefix_hits(s))
    if not s.serving:
        summary.add_row("NOT SERVING", Text(s.not_serving or "(no reason given)"))
    if not is_gateway(s):
        manager = "reachable" if s.manager_reachable else "UNREACHABLE"
        summary.add_row("ended", f"finished {s.requests_finished:,}, aborted {s.requests_aborted:,}, "
                                 f"failed {s.requests_failed:,}; KV-cache manager {manager}")
        return Group(head, summary)
    workers = Table("worker", "state", "running", "waiting", "pages used / free / cached", "routed",
                    "hit tokens")
    for w in s.workers:
        workers.add_row(Text(w.address), w.state, str(w.running), str(w.waiting),
                        f"{w.used_pages} / {w.free_pages} / {w.cached_pages}", f"{w.requests_routed:,}",
                        f"{w.hit_tokens:,} ({_percent(w.hit_tokens, w.prompt_tokens)})")
    why = [Text(f"{w.address} is not serving: {w.not_serving}") for w in s.workers if w.not_serving]
    return Group(head, summary, workers, *why)


def error_line(address: str, exc: KVServeError) -> str:
    """One line: gRPC's messages may span several."""
    what = "cannot reach" if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "error from"
    return " ".join(f"{what} {address}: {exc.code}: {exc.message}".split())


# --------------------------------------------------------------------------- the command

def _poll(client: InferenceClient) -> Sample:
    stats = client.server_stats()
    return Sample(time.monotonic(), stats)


def run_top(args: argparse.Namespace) -> int:
    from rich.console import Console

    if not 0 < args.interval <= MAX_INTERVAL_S:
        print(f"kvserve top: --interval must be more than 0 seconds and at most {MAX_INTERVAL_S:g}", file=sys.stderr)
        return 2
    try:
        client = make_client(args, timeout=POLL_TIMEOUT_S)
    except ValueError as exc:
        print(f"kvserve top: {exc}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 200)   # piped: never fold a row
    with client:
        if args.once:
            return _once(client, console, args)
        try:
            return _live(client, console, args)
        except KeyboardInterrupt:   # the way to quit
            return 0


def _once(client: InferenceClient, console, args: argparse.Namespace) -> int:
    from kvserve.clients.inference_client import KVServeError

    try:
        first = _poll(client)
        time.sleep(args.interval)
        second = _poll(client)
    except KVServeError as exc:
        print(f"kvserve top: {error_line(args.address, exc)}", file=sys.stderr)
        return 1
    console.print(render(args.address, second, first, f"over {args.interval:g}s"))
    return 0


def _live(client: InferenceClient, console, args: argparse.Namespace) -> int:
    """Redraw in place on a terminal; piped, print one frame after another."""
    from rich.live import Live
    from rich.text import Text

    from kvserve.clients.inference_client import KVServeError

    def frames():
        prev: Sample | None = None
        while True:
            started = time.monotonic()
            try:
                cur = _poll(client)
                yield render(args.address, cur, prev, f"every {args.interval:g}s, Ctrl-C quits")
                prev = cur
            except KVServeError as exc:
                prev = None   # a rate across the gap would mix two lives of the server
                yield Text(f"{error_line(args.address, exc)} (retrying every {args.interval:g}s)")
            time.sleep(max(0.0, started + args.interval - time.monotonic()))

    if not console.is_terminal:
        for view in frames():
            console.print(view)
            console.print()
    else:
        with Live(console=console, auto_refresh=False) as live:
            for view in frames():
                live.update(view, refresh=True)
    return 0
