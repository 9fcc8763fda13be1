"""Decode steps replayed from captured CUDA graphs: one launch for every kernel of a step.

Eagerly, a decode step launches a few dozen kernels per layer from Python, and on a GPU the host
time to launch them can exceed the GPU's time to run them (docs/benchmarks.md, "The GPU"). So a
step of decodes only is captured once per batch size at start and replayed after.

A graph replays fixed addresses and fixed shapes, so everything a step varies lives in static
buffers, written before each replay:

- a step of n sequences runs the graph of the smallest captured size b >= n; rows n..b-1 are
  padding: token 0 at position 0, its K/V written into the KV cache's spare page (which no
  sequence's table names), attending over that one slot;
- page tables are (b, W) with W the pages of the longest sequence the model serves, and the
  attention's max_seqlen_k is W * page_size, whatever the step's longest sequence is;
- the logits land in one static (max size, vocab) buffer, read by the sampler before the next step.

Only a backend that reads every per-step value from tensors (its `graph_safe`) can be captured: a
host-side length would be frozen at its capture value. flash_attn is; the torch and cpu
backends loop over host lists and are never captured.

capture=False runs the same static-buffer steps eagerly (a CPU test of everything but the graph).
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.engine.decode_inputs import decode_inputs
from kvserve.model_service.engine.scheduler import Work

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 32 beyond, and max_batch itself: a
    decode step's cost is its weights' bytes, so a few padded rows cost little, and each size is
    one more graph to capture and keep."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    size = 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    return sizes + [max_batch]


def graph_safe(backend) -> bool:
    return bool(getattr(backend, "graph_safe", False))


class DecodeGraphs:
    def __init__(self, model, backend, kv_cache, page_size: int, max_batch: int, max_model_len: int,
                 device: torch.device, capture: bool = True, sizes: list[int] | None = None) -> None:
        """sizes: the batch sizes to capture (default capture_sizes(max_batch)), the largest max_batch."""
        if kv_cache.spare_page is None:
            raise ValueError("decode graphs pad batches into the KV cache's spare page: build it with spare_page=True")
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.page_size, self.device, self.capturing = page_size, device, capture
        self.sizes = sorted(set(sizes)) if sizes else capture_sizes(max_batch)
        if self.sizes[-1] != max_batch or self.sizes[0] <= 0:
            raise ValueError(f"capture sizes {self.sizes} must be positive and end at max_batch {max_batch}")
        self.width = -(-max_model_len // page_size)   # W: page-table columns, the longest sequence's pages
        self.max_len = self.width * page_size
        self.spare = kv_cache.spare_page
        self.replays = 0   # steps served from a graph (or, capture=False, from the static buffers)
        b, vocab = self.sizes[-1], model.lm_head.out_features   # the logits' width (a padded vocab's too)
        with torch.inference_mode():
            self.ids = torch.zeros(b, dtype=torch.int64, device=device)
            self.positions = torch.zeros(b, dtype=torch.int64, device=device)
            self.slots = torch.full((b,), self.spare * page_size, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=device)
            self.tables = torch.full((b, self.width), self.spare, dtype=torch.int32, device=device)
            self.rows = torch.arange(b, dtype=torch.int64, device=device)
            self.logits = torch.zeros(b, vocab, dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, work: list[Work]) -> bool:
        """A step of decodes only (one token each, no draft), no larger than the largest size,
        every sequence within the captured page-table width."""
        return (len(work) <= self.sizes[-1]
                and all(w.count == 1 and not w.draft and w.start < self.max_len for w in work))

    def _size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.ids[:b], positions=self.positions[:b], slot_mapping=self.slots[:b],
            cu_seqlens_q=self.cu_seqlens_q[:b + 1], seq_lens=self.seq_lens[:b], block_tables=self.tables[:b],
            logits_indices=self.rows[:b], num_decodes=b, max_seqlen_q=1, max_seqlen_k=self.max_len,
            query_lens_cpu=[1] * b, seq_lens_cpu=[self.max_len] * b)

    def _forward(self, b: int) -> None:
        batch = self._batch(b)
        meta = self.backend.prepare(batch)
        self.logits[:b].copy_(self.model(batch, self.kv_cache.layers, self.backend, meta))

    @torch.inference_mode()
    def capture(self) -> float:
        """Every size's graph, largest first, in one memory pool (a smaller graph reuses what the
        larger one freed); the buffers hold padding only, so capturing writes the spare page
        alone. -> seconds taken. capture=False: nothing to do."""
        if not self.capturing:
            return 0.0
        start = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):
            for _ in range(2):   # kernels compiled and the allocator grown before capture
                self._forward(b)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, work: list[Work]) -> torch.Tensor:
        """Logits (S, vocab) for the items that sample, as ModelRunner.execute gives them. The rows
        are a view of the static buffer: valid until the next step."""
        n = len(work)
        b = self._size_for(n)
        step = decode_inputs(work, self.page_size, pad=b - n, pad_page=self.spare)
        self.ids[:b].copy_(step.ids(), non_blocking=True)
        self.positions[:b].copy_(step.positions(), non_blocking=True)
        self.slots[:b].copy_(step.slots(), non_blocking=True)
        self.seq_lens[:b].copy_(step.lens(), non_blocking=True)
        self.tables[:b, :step.width].copy_(step.tables(), non_blocking=True)
        if self.capturing:
            self._graphs[b].replay()
        else:
            self._forward(b)
        self.replays += 1
        if all(w.samples for w in work):
            return self.logits[:n]
        return self.logits[[i for i, w in enumerate(work) if w.samples]]
