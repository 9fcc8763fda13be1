"""The real processes end to end: `kvserve up` (the manager and the model service as two
processes on a Unix socket), and `kvserve model` + `kvserve kvcache` started apart.

Greedy tokens through the processes equal transformers' `generate` while chunked prefill
(a 16-token budget) and a 64-page pool force the engine's hard paths.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.engine.harness import assert_same_tokens, hf_greedy
from tests.service.processes import (alive, children, free_port, kv_stats, kvserve, stop_pids, terminate,
                                     unix_address, wait_serving)
from tests.service.util import generate, greedy, request, wait_until

pytestmark = pytest.mark.slow

NEW_TOKENS = 10
_rng = random.Random(4321)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (3, 9, 17, 30, 41, 55, 64, 70)]
SYSTEM = [_rng.randrange(3, 1024) for _ in range(40)]
PREEMPT_PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (20, 28, 36, 44, 52, 60, 33, 47)]


class Up:
    def __init__(self, proc: subprocess.Popen, address: str, kv_address: str) -> None:
        self.proc, self.address, self.kv_address = proc, address, kv_address
        self.child_pids: list[int] = []


@pytest.fixture(scope="module")
def up(tiny_dirs, tmp_path_factory):
    """`kvserve up` on a free port and a Unix socket, both SERVING."""
    tmp = tmp_path_factory.mktemp("up")
    address = f"127.0.0.1:{free_port()}"
    kv_address = unix_address(tmp)
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen", kv_address,
                   "--page-size", "4", "--num-pages", "64", "--max-num-batched-tokens", "16",
                   "--device", "cpu", "--dtype", "float32", "--log-level", "warning")
    u = Up(proc, address, kv_address)
    try:
        wait_serving(address, proc)
        wait_serving(kv_address, proc)
        u.child_pids = children(proc.pid)
        yield u
    finally:
        terminate(proc, 20)
        stop_pids(u.child_pids)


def test_up_greedy_equals_transformers_under_pressure(up, hf_tiny):
    assert len(up.child_pids) == 2, f"`up` should have two children, has {up.child_pids}"
    with grpc.insecure_channel(up.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.page_size, info.num_pages, info.max_model_len) == (4, 64, 256)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: generate(stub, request(token_ids=p, **greedy(NEW_TOKENS))), PROMPTS))
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert out.finished.usage.prompt_tokens == len(prompt)
        ref, margins = hf_greedy(hf_tiny, prompt, NEW_TOKENS)
        assert_same_tokens(out.tokens, ref, margins, f"`kvserve up`, prompt {i}")
    # every page goes back to the manager (the last releases ride on a later step)
    wait_until(lambda: kv_stats(up.kv_address).used_pages == 0, timeout=10, what="used_pages == 0")
    stats = kv_stats(up.kv_address)
    assert stats.num_sequences == 0 and stats.total_pages == 64 and stats.page_size == 4
    print(f"manager after 8 prompts: preemptions recompute={stats.preemptions_recompute} "
          f"swap={stats.preemptions_swap}, evictions={stats.evictions}")


def test_up_preemption_equals_transformers(up, hf_tiny):
    """Longer outputs than the pool holds at once: running requests are preempted
    (recompute) and resumed, and their tokens still equal transformers'."""
    prompts = PREEMPT_PROMPTS
    n_new = 40  # 8 x (prompt + 40) needs ~150 pages; the pool has 64
    before = kv_stats(up.kv_address).preemptions_recompute
    with grpc.insecure_channel(up.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: generate(stub, request(token_ids=p, **greedy(n_new))), prompts))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.finished.usage.completion_tokens == n_new
        ref, margins = hf_greedy(hf_tiny, prompt, n_new)
        assert_same_tokens(out.tokens, ref, margins, f"`kvserve up` preempted, prompt {i}")
    wait_until(lambda: kv_stats(up.kv_address).used_pages == 0, timeout=10, what="used_pages == 0")
    assert kv_stats(up.kv_address).preemptions_recompute > before, "the small pool forced no preemption"


def test_up_prefix_cache_hit_equals_transformers(up, hf_tiny):
    first, second = SYSTEM + [5, 6, 7], SYSTEM + [8, 9, 10, 11]
    with grpc.insecure_channel(up.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        a = generate(stub, request(token_ids=first, **greedy(NEW_TOKENS)))
        b = generate(stub, request(token_ids=second, **greedy(NEW_TOKENS)))
    assert a.prefill.cached_tokens == 0
    assert b.prefill.cached_tokens == 40  # ten full pages of the shared system prompt
    assert b.finished.usage.cached_tokens == 40
    for out, prompt in ((a, first), (b, second)):
        ref, margins = hf_greedy(hf_tiny, prompt, NEW_TOKENS)
        assert_same_tokens(out.tokens, ref, margins, "`kvserve up` prefix hit")
    assert kv_stats(up.kv_address).prefix_hit_tokens >= 40


def test_a_second_up_on_a_busy_port_stops_at_once_saying_so(up):
    """It does not start its child again and again (each restart would fail the same way), and the
    first stack is not disturbed."""
    second = kvserve("up", "--model", "tiny", "--listen", f"127.0.0.1:{free_port()}", "--kvcache-listen",
                     up.kv_address, "--device", "cpu", "--num-pages", "64", "--log-level", "warning",
                     stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = second.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        second.kill()
        pytest.fail("the second up kept trying")
    assert second.returncode == 3   # as `kvserve kvcache` alone exits: never restart
    assert "cannot listen" in stderr and "Traceback" not in stderr and "starting it again" not in stderr
    with grpc.insecure_channel(up.address) as ch:
        assert pb_grpc.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size


def test_up_sigterm_stops_both_children(up):
    """Runs last in this module: SIGTERM to `up` stops the model service and the manager."""
    kids = up.child_pids
    assert len(kids) == 2 and all(alive(p) for p in kids)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(20) == 0
    wait_until(lambda: not any(alive(p) for p in kids), timeout=5, what="both children to exit")


# ---------------------------------------------------------------------- started apart, mismatched


@pytest.fixture(scope="module")
def mismatched(tiny_dirs, tmp_path_factory):
    """`kvserve kvcache --num-pages 32` and `kvserve model --num-pages 64` on its socket:
    -> (the model service's exit code, its stderr)."""
    tmp = tmp_path_factory.mktemp("mismatch")
    kv_address = unix_address(tmp)
    manager = kvserve("kvcache", "--listen", kv_address, "--num-pages", "32", "--page-size", "4",
                      "--log-level", "warning")
    try:
        wait_serving(kv_address, manager)
        model = kvserve("model", "--model", str(tiny_dirs["tiny"]), "--listen", f"127.0.0.1:{free_port()}",
                        "--kvcache", kv_address, "--num-pages", "64", "--page-size", "4", "--device", "cpu",
                        "--log-level", "warning", stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = model.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            model.kill()
            _, stderr = model.communicate()
            pytest.fail(f"the model service hung on a manager that refuses it:\n{stderr}")
        yield model.returncode, stderr
    finally:
        terminate(manager, 20)


def test_mismatched_num_pages_exits_nonzero_naming_num_pages(mismatched):
    code, stderr = mismatched
    assert code != 0
    assert "num_pages 64" in stderr and "32" in stderr, stderr


def test_mismatched_num_pages_is_a_clear_error(mismatched):
    code, stderr = mismatched
    assert code != 0
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve") and "num_pages" in last and "KV-cache manager" in last, last


def test_kill_9_of_up_takes_its_children_with_it(tiny_dirs, tmp_path):
    """`up` killed outright cannot stop its children in order; they must not serve on without it
    (holding its ports and sockets, so that the next `up` fails)."""
    address = f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen",
                   unix_address(tmp_path), "--device", "cpu", "--num-pages", "64", "--log-level", "warning")
    kids: list[int] = []
    try:
        wait_serving(address, proc)
        kids = children(proc.pid)
        assert len(kids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not any(alive(p) for p in kids), timeout=30, what="both children to exit")
    finally:
        terminate(proc)
        stop_pids(kids)



def test_a_model_service_killed_while_loading_is_started_again(tiny_dirs, tmp_path):
    """The OOM killer or a kill -9 during the load is a crash like any other: `up` starts the
    model service again instead of giving up on the stack."""
    address = f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen",
                   unix_address(tmp_path), "--device", "cpu", "--num-pages", "64", "--log-level", "warning",
                   stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        wait_until(lambda: children(proc.pid), timeout=30, what="the model service to start")
        [loading] = children(proc.pid)   # the manager starts only once the pool is sized
        os.kill(loading, signal.SIGKILL)
        wait_serving(address, proc)
        kids = children(proc.pid)
        assert loading not in kids and len(kids) == 2
    finally:
        terminate(proc)
        stop_pids(kids)
    assert "the model service was killed by SIGKILL; starting it again" in proc.stderr.read()


def test_ctrl_c_while_a_model_service_waits_for_its_manager_ends_it_at_once(tiny_dirs):
    """The start ran on asyncio's executor, which is joined before the process may exit: Ctrl-C
    while it waited for a manager did nothing until --kvcache-timeout was over."""
    import time

    proc = kvserve("model", "--model", str(tiny_dirs["tiny"]), "--listen", f"127.0.0.1:{free_port()}",
                   "--kvcache", f"127.0.0.1:{free_port()}", "--kvcache-timeout", "300", "--num-pages", "64",
                   "--device", "cpu", stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:   # the pool is sized and warmed just before the manager is dialled
            if "warm-up step" in line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130   # well inside the 300 s wait
        assert "kvserve model: interrupted" in proc.stderr.read()
    finally:
        terminate(proc)
