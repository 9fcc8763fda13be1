"""`kvserve top`: its numbers against what GetServerStats says, from a model service and from a
2-worker gateway; rates from two samples; an unreachable server; the live loop when piped."""

from __future__ import annotations

import dataclasses
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.clients.inference_client import InferenceClient, ServerStats, WorkerStats
from kvserve.clients.top import Sample, generated_rate, rate
from kvserve.services.cli.main import build_parser
from tests.clients.conftest import API_KEY, RPC_TIMEOUT_S
from tests.gateway.conftest import NUM_PAGES, make_fleet

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The cache page holds the key and value vectors of sixteen tokens, and the server keeps every full page"
DEADLINE_S = 30.0


def top(capsys, *argv: str) -> tuple[int, str, str]:
    args = build_parser().parse_args(["top", "--once", "--interval", "0.1", *argv])
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def wait_for(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not reached in {DEADLINE_S}s"
        time.sleep(0.05)
    return value


def line_of(out: str, label: str) -> str:
    return next(line.rstrip() for line in out.splitlines() if line.startswith(label))


# ---------------------------------------------------------------- rates, from made-up samples

def stats(**fields) -> ServerStats:
    zeros = {f.name: 0 for f in dataclasses.fields(ServerStats) if f.default is dataclasses.MISSING}
    return ServerStats(**{**zeros, **fields})


def test_rates_come_from_the_change_between_two_polls() -> None:
    a, b = Sample(10.0, stats(generated_tokens=100, prompt_tokens=40)), Sample(12.0, stats(generated_tokens=150))
    assert rate(a, b, "generated_tokens") == 25.0
    assert rate(None, b, "generated_tokens") is None               # one poll says nothing of a rate
    assert rate(b, Sample(13.0, stats(generated_tokens=3)), "generated_tokens") is None   # restarted server
    assert generated_rate(a, b) == "25.0"


def test_a_gateways_rates_are_of_what_it_streamed() -> None:
    worker = WorkerStats("w:1", "serving", 1, 0, 10, 20, 2, 5, 8, 16, 1, True, 3, 0)
    a = Sample(1.0, stats(workers=(worker,), prompt_tokens=16, generated_tokens=4))
    b = Sample(2.0, stats(workers=(worker,), prompt_tokens=48, generated_tokens=12))
    assert generated_rate(a, b) == "8.0" and rate(a, b, "prompt_tokens") == 32.0


# ---------------------------------------------------------------- a model service

def test_once_against_a_model_service(model_server, client: InferenceClient, capsys) -> None:
    client.complete(PROMPT, max_tokens=4, temperature=0)
    client.complete(PROMPT, max_tokens=4, temperature=0)   # the second finds the first's pages
    s = wait_for(lambda: (s := client.server_stats()).running == 0 and s.kvcache.used_pages == 0 and s,
                 "the server idle")
    rc, out, err = top(capsys, "--address", model_server.address)
    assert rc == 0, err
    assert f"{model_server.address} (model service)" in out
    assert line_of(out, "requests").split(None, 1)[1] == "running 0, waiting 0"
    assert line_of(out, "tokens/s").split(None, 1)[1] == "generated 0.0, prompt 0.0"   # idle between the polls
    kv = s.kvcache
    assert line_of(out, "KV cache").split(None, 2)[2] == (
        f"{kv.used_pages} / {kv.total_pages} pages used ({kv.used_pages / kv.total_pages:.0%}), "
        f"cached {kv.cached_pages}, free {kv.free_pages}")
    assert s.cached_tokens > 0
    assert f"({s.cached_tokens:,} of {s.prompt_tokens:,} prompt tokens)" in line_of(out, "prefix hits")
    assert f"{s.cached_tokens / s.prompt_tokens:.0%}" in line_of(out, "prefix hits")


def test_once_with_an_api_key(keyed_server, capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    rc, out, err = top(capsys, "--address", keyed_server.address)
    assert rc == 1 and out == ""
    assert err.startswith(f"kvserve top: error from {keyed_server.address}: UNAUTHENTICATED: ")
    rc, out, err = top(capsys, "--address", keyed_server.address, "--api-key", API_KEY)
    assert rc == 0, err
    assert "prefix hits" in out


def test_once_with_no_server_exits_1_with_one_line(capsys) -> None:
    rc, out, err = top(capsys, "--address", "127.0.0.1:1")
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvserve top: cannot reach 127.0.0.1:1: UNAVAILABLE: ")


# ---------------------------------------------------------------- a gateway

@pytest.fixture(scope="module")
def fleet(tiny_dirs):
    yield from make_fleet(tiny_dirs["tiny"], 2)


def test_once_against_a_gateway(fleet, capsys) -> None:
    with InferenceClient(fleet.gateway.address, timeout=RPC_TIMEOUT_S) as c:
        c.complete(PROMPT, max_tokens=4, temperature=0)
        c.complete(PROMPT + " again", max_tokens=4, temperature=0)

        def settled():   # both requests counted, and every worker's last report shows it idle since
            s = c.server_stats()
            idle = all(w.running == w.waiting == w.used_pages == 0 and w.free_pages + w.cached_pages == NUM_PAGES
                       and (w.cached_pages > 0) == (w.requests_routed > 0) for w in s.workers)
            return idle and sum(w.requests_routed for w in s.workers) == 2 and s

        def pages(stats):
            return [(w.free_pages, w.cached_pages) for w in stats.workers]

        # A worker reports small page moves late (its load reports count free pages in steps):
        # take top's reading only when the gateway's view did not move while top read it.
        for _ in range(20):
            s = wait_for(settled, "the gateway's workers idle")
            rc, out, err = top(capsys, "--address", fleet.gateway.address)
            if pages(c.server_stats()) == pages(s):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the gateway's view of its workers' pages never held still while top read it")
    assert rc == 0, err
    assert f"{fleet.gateway.address} (gateway, 2 workers)" in out
    assert line_of(out, "requests").split(None, 1)[1] == "running 0, waiting 0, queued at the gateway 0"
    assert line_of(out, "tokens/s").split(None, 1)[1] == "generated 0.0, prompt 0.0"
    cached = sum(w.cached_pages for w in s.workers)
    assert line_of(out, "KV cache").split(None, 2)[2] == (
        f"0 / {2 * NUM_PAGES} pages used (0%), cached {cached}, free {2 * NUM_PAGES - cached}, "
        "summed over 2 workers")
    assert f"({s.cached_tokens:,} of {s.prompt_tokens:,} prompt tokens)" in line_of(out, "prefix hits")
    for w in s.workers:
        row = next(line for line in out.splitlines() if w.address in line)
        cells = [c.strip() for c in re.split(r"[│|]", row) if c.strip()]
        hits = f"{w.hit_tokens / w.prompt_tokens:.0%}" if w.prompt_tokens else "n/a"
        assert cells == [w.address, "serving", "0", "0", f"0 / {w.free_pages} / {w.cached_pages}",
                         str(w.requests_routed), f"{w.hit_tokens} ({hits})"]


# ---------------------------------------------------------------- the live loop, piped

def lines_of(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def read_until(lines: queue.Queue, pattern: str, count: int) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while sum(1 for line in seen if re.search(pattern, line)) < count:
        seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
    return seen


@pytest.mark.parametrize("reachable", [True, False])
def test_live_view_keeps_polling_until_ctrl_c(model_server, reachable: bool) -> None:
    address = model_server.address if reachable else "127.0.0.1:1"
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli.main", "top", "--address", address,
                             "--interval", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        if reachable:   # from the second frame on, rates are known
            seen = read_until(lines_of(proc), r"^tokens/s\s+generated \d", 2)
            assert any("n/a (needs a second poll)" in line for line in seen)
        else:           # one line per failed poll, and it goes on
            seen = read_until(lines_of(proc), rf"^cannot reach {address}: UNAVAILABLE: .* \(retrying every 0.1s\)$", 2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=DEADLINE_S) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_gateway_without_workers_is_shown_as_one_with_its_queue_and_why_it_does_not_serve() -> None:
    """A gateway whose --workers-dns names no ready pod yet: a gateway still (it was shown as a
    model service whose manager is down), with its queue; an IPv6 worker's address is text, not
    markup ("[fd00:...]" was taken for a style)."""
    from rich.console import Console

    from kvserve.clients.top import render

    def shown(s: ServerStats) -> str:
        console = Console(width=200, record=True, file=open("/dev/null", "w"))
        console.print(render("gw:1", Sample(1.0, s), None, "polling"))
        return console.export_text()

    empty = shown(stats(gateway=True, queued=3, serving=False, not_serving="no worker is serving"))
    assert "gw:1 (gateway, 0 workers)" in empty and "queued at the gateway 3" in empty, empty
    assert "NOT SERVING  no worker is serving" in empty and "manager" not in empty, empty
    worker = WorkerStats("[fd00:10:244::5]:50051", "serving", 1, 0, 10, 20, 2, 5, 8, 16, 1, True, 3, 0)
    assert "[fd00:10:244::5]:50051" in shown(stats(gateway=True, workers=(worker,), serving=True))
    other = WorkerStats("w:2", "not serving", 0, 0, 0, 20, 0, 0, 0, 0, 0, True, 0, 0, "another model: it serves q")
    assert "w:2 is not serving: another model: it serves q" in shown(stats(gateway=True, workers=(worker, other),
                                                                           serving=True))


class Answering:
    """A client whose server_stats() gives `answers` in turn."""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def server_stats(self):
        return self.answers.pop(0)


def test_stats_shows_each_workers_whole_address_however_long(monkeypatch, capsys) -> None:
    """Wider than the 200 columns of a pipe, the table cut the worker column: two workers of
    `kvserve up --workers 2` both read `unix:///tmp/kvserve-up-.../worke…`."""
    from kvserve.clients import cli

    folder = "unix:///tmp/kvserve-up-1xchiplf-some-long-private-folder-name"
    workers = tuple(WorkerStats(f"{folder}/worker-{i}.sock", "serving", 0, 0, 0, 20, 0, 0, 0, 0, 0, True, 0, 0)
                    for i in range(2))

    monkeypatch.setattr(cli, "_client", lambda args, command, timeout=None: Answering(
        [stats(gateway=True, workers=workers, serving=True)]))
    args = build_parser().parse_args(["stats"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # the first column's cells, folded over lines, joined back
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert "…" not in out and "".join(cells) == "".join(w.address for w in workers), out


def test_stats_shows_a_gateway_without_workers_and_ipv6_workers_as_they_are(monkeypatch, capsys) -> None:
    from kvserve.clients import cli

    worker = WorkerStats("[fd00:10:244::5]:50051", "down", 0, 0, 0, 0, 0, 0, 0, 0, 0, False, 0, 0,
                         "UNAVAILABLE: failed to connect to all addresses")
    answers = [stats(gateway=True, queued=2, serving=False, not_serving="no worker is serving"),
               stats(gateway=True, workers=(worker,), serving=False, not_serving="no worker is serving")]

    monkeypatch.setattr(cli, "_client", lambda args, command, timeout=None: Answering(answers))
    for _ in range(2):
        args = build_parser().parse_args(["stats"])
        assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "queued at the gateway 2" in out and "manager" not in out, out
    assert "[fd00:10:244::5]:50051" in out, out
    assert "[fd00:10:244::5]:50051 is not serving: UNAVAILABLE: failed to connect to all addresses" in out, out
