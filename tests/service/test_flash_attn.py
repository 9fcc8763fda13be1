"""The flash_attn attention backend through the real service, against the torch backend.

Runs only where CUDA is available and flash-attn imports (flash-attn 2 `flash_attn`, or
flash-attn 4 `flash_attn.cute`); everywhere else the whole module is skipped with the reason.

Both servers run the tiny model in bfloat16 with page_size 256 (flash-attn 2's paged
kernels need a multiple of 256). How agreement is measured:

- position by position under the same context (teacher forcing): where our greedy token
  differs from the reference's, the rest of that sequence is generated again from the prompt
  plus the reference's tokens so far, so one early difference cannot spoil every later
  position, and every position is compared;
- bf16 logits are coarse (an ulp is 1/32 to 1/16 at these magnitudes) and about 3% of this
  model's greedy positions are exact bf16 ties, which two correct kernels may break either way.
  So the 99% bar applies to the decisive positions, those where the reference's top-2 logit
  margin (from its logprobs) is at least TIE_BF16; a broken kernel (wrong mask, wrong page
  table) agrees on almost none.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.attention.flash_attn_backend import why_not_flash
from tests.service.conftest import ModelServerThread
from tests.service.util import assert_pages_free, generate, greedy, request

WHY_NOT = why_not_flash()   # no CUDA, no flash-attn, or one that cannot page on this GPU
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

GPU_CONFIG = dict(device="cuda", dtype="bfloat16", page_size=256, num_pages=64)
NEW_TOKENS = 32
MIN_AGREEMENT = 0.99
TIE_BF16 = 0.125  # top-2 logit margin below which two bf16 kernels may legitimately disagree
_rng = random.Random(31337)
# Mixed lengths: within one page, across page boundaries, several pages.
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)]
           for n in (1, 3, 7, 16, 31, 64, 100, 200, 255, 256, 257, 300, 420, 511, 600, 777)]
SYSTEM = [_rng.randrange(3, 1024) for _ in range(300)]  # one full page, and then some


@dataclass
class Run:
    """Greedy tokens per prompt and, with logprobs, the top-2 logit margin at each position."""

    tokens: list[list[int]]
    margins: list[list[float]] = field(default_factory=list)


def run_all(address: str, prompts: list[list[int]], n: int = NEW_TOKENS, margins: bool = False) -> Run:
    """Greedy (EOS ignored), every prompt at once."""
    extra = {"logprobs": 2} if margins else {}
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: generate(stub, request(token_ids=p, **greedy(n), **extra)), prompts))
    for out in outs:
        assert out.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(out.tokens) == n
    run = Run([out.tokens for out in outs])
    if margins:
        run.margins = [[lp.top[0].logprob - lp.top[1].logprob for lp in out.logprobs] for out in outs]
    return run


@dataclass
class Agreement:
    positions: list[tuple[bool, float]]  # (agrees, the reference's margin there)

    @property
    def decisive(self) -> float:
        d = [agrees for agrees, margin in self.positions if margin >= TIE_BF16]
        return sum(d) / len(d)

    @property
    def overall(self) -> float:
        return sum(a for a, _ in self.positions) / len(self.positions)

    def report(self) -> str:
        bad = [f"{m:.3f}" for a, m in self.positions if not a]
        return (f"{self.overall:.1%} of {len(self.positions)} positions agree, {self.decisive:.1%} of the "
                f"decisive ones; reference margins where they differ: {bad}")


def compare(address: str, prompts: list[list[int]], ours: Run, ref: Run) -> Agreement:
    """Teacher-forced agreement of `ours` (free-running) with `ref` (see the module doc)."""
    positions: list[tuple[bool, float]] = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for i, prompt in enumerate(prompts):
            want, margins, n = ref.tokens[i], ref.margins[i], len(ref.tokens[i])
            got, start = ours.tokens[i], 0
            while start < n:
                k = next((j for j, t in enumerate(got) if t != want[start + j]), None)
                same = len(got) if k is None else k
                positions += [(True, m) for m in margins[start:start + same]]
                if k is None:
                    break
                positions.append((False, margins[start + k]))
                start += k + 1
                if start < n:  # resync: continue from the reference's context
                    got = generate(stub, request(token_ids=prompt + want[:start], **greedy(n - start))).tokens
    assert len(positions) == sum(len(t) for t in ref.tokens)
    return Agreement(positions)


def check(agreement: Agreement, what: str) -> None:
    print(f"{what}: {agreement.report()}")
    assert agreement.decisive >= MIN_AGREEMENT, f"{what}: {agreement.report()}"


@pytest.fixture(scope="module")
def flash_server(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], attention_backend="flash_attn", **GPU_CONFIG)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def torch_server(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], attention_backend="torch", **GPU_CONFIG)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def torch_ref(torch_server) -> Run:
    return run_all(torch_server.address, PROMPTS, margins=True)


def test_model_info_reports_flash_attn(flash_server):
    with grpc.insecure_channel(flash_server.address) as ch:
        info = pb_grpc.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.attention_backend == "flash_attn"
    assert info.dtype == "bfloat16"
    assert info.page_size == 256
    assert info.device.startswith("cuda")
    assert info.vocab_size == 1024


def test_flash_attn_greedy_agrees_with_torch_backend(flash_server, torch_ref):
    flash = run_all(flash_server.address, PROMPTS)
    check(compare(flash_server.address, PROMPTS, flash, torch_ref), "flash_attn vs torch")
    assert_pages_free(flash_server.servicer)


def test_flash_attn_alone_agrees_with_batched(flash_server):
    """A request's tokens do not depend on what else is in its batch (decode-only steps
    take flash-attn 2's with_kvcache path, mixed steps the varlen path)."""
    prompts = PROMPTS[:8]
    batched = run_all(flash_server.address, prompts, margins=True)
    alone = Run([run_all(flash_server.address, [p]).tokens[0] for p in prompts])
    check(compare(flash_server.address, prompts, alone, batched), "flash_attn alone vs batched")


def test_flash_attn_chunked_prefill_and_prefix_hit(tiny_dirs, torch_server):
    """Chunked prefill (a 64-token budget: the varlen kernel with a causal mask aligned to the
    bottom right) and a prefix hit (a whole cached 256-token page) agree with the torch backend."""
    first, second = SYSTEM + [5, 6, 7], SYSTEM + [8, 9, 10, 11]
    prompts = [first, second] + PROMPTS[-6:]
    server = ModelServerThread(tiny_dirs["tiny"], attention_backend="flash_attn", max_num_batched_tokens=64,
                               **GPU_CONFIG)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            a = generate(stub, request(token_ids=first, **greedy(NEW_TOKENS)))
            b = generate(stub, request(token_ids=second, **greedy(NEW_TOKENS)))
        assert a.prefill.cached_tokens == 0
        assert b.prefill.cached_tokens == 256
        ours = Run([a.tokens, b.tokens] + run_all(server.address, PROMPTS[-6:]).tokens)
        ref = run_all(torch_server.address, prompts, margins=True)
        check(compare(server.address, prompts, ours, ref), "chunked/prefix flash_attn vs torch")
        assert_pages_free(server.servicer)
    finally:
        server.stop()
