"""Turns a step's work into one packed ForwardBatch and runs the model on it.

Everything is built once per step with a handful of tensor ops; the only
Python loops are over sequences (to gather their token ids and page tables). A step of a few
decodes, where the model has the fused decode step and the backend's decode reads pages
natively, builds no tensor at all: its ints go straight to the model's DirectStep
(kernels/decode_layer.py), the same native call without the step's tensor ops around it. On a GPU
with decode graphs (decode_graphs.py), a step of decodes replays a captured CUDA graph instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.engine.decode_graphs import DecodeGraphs
from kvserve.model_service.engine.decode_inputs import decode_inputs, page_tables
from kvserve.model_service.engine.scheduler import Work


class ModelRunner:
    def __init__(self, model, backend, kv_cache, page_size: int, device: torch.device,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs
        self.backend = backend
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = device
        natively = backend is not None and backend.decodes_natively()
        self.direct = getattr(model, "decode_ints", None) if natively else None   # kernels/decode_layer.DirectStep

    def build(self, work: list[Work]) -> ForwardBatch:
        if all(w.count == 1 for w in work) and not any(w.prompt_rows for w in work):   # decodes only
            return self._build_decodes(work)
        return self._build_general(work)

    def _build_general(self, work: list[Work]) -> ForwardBatch:
        ps = self.page_size
        query_lens = [w.count for w in work]
        seq_lens = [w.start + w.count for w in work]
        ids: list[int] = []
        for w in work:
            if w.draft:   # the sequence's last token, then the draft to verify
                ids.extend(w.request.tokens[w.start:w.start + w.count - len(w.draft)])
                ids.extend(w.draft)
            else:
                ids.extend(w.request.tokens[w.start:w.start + w.count])
        width = max(-(-n // ps) for n in seq_lens)
        tables = [w.request.page_table[:-(-n // ps)] for w, n in zip(work, seq_lens)]
        num_decodes = 0
        while num_decodes < len(work) and query_lens[num_decodes] == 1:
            num_decodes += 1

        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        starts = torch.tensor([w.start for w in work], dtype=torch.int64)
        cu = torch.zeros(len(work) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(work)), q_lens)        # (T,)
        positions = torch.arange(len(ids)) - cu[:-1][seq_of_token] + starts[seq_of_token]  # (T,)
        block_tables = page_tables(tables, width)                                       # (B, width)
        pages = block_tables[seq_of_token, positions // ps].to(torch.int64)             # (T,)
        slot_mapping = pages * ps + positions % ps                                      # (T,)
        if any(w.draft or w.prompt_rows for w in work):
            # a row with a draft is sampled at each of its positions; the positions whose logits
            # give prompt logprobs come before a row's sampled ones
            rows, end = [], 0
            for w in work:
                rows.extend(range(end + w.prompt_rows.start - w.start, end + w.prompt_rows.stop - w.start))
                end += w.count
                if w.samples:
                    rows.extend(range(end - 1 - len(w.draft), end))
            logits_indices = torch.tensor(rows, dtype=torch.int64)                      # (S,)
        else:
            samples = torch.tensor([w.samples for w in work])
            logits_indices = cu[1:][samples] - 1                                        # (S,)

        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            cu_seqlens_q=cu.to(torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            logits_indices=logits_indices.to(dev, non_blocking=True),
            num_decodes=num_decodes,
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    def _build_decodes(self, work: list[Work]) -> ForwardBatch:
        """build() for a step of decodes only (one token each, no draft): the same batch from
        plain lists, without the varlen index arithmetic (a batch-1 step's every op counts), as
        views of two tensors, one int64 and one int32, each made and moved once."""
        step = decode_inputs(work, self.page_size)
        if self.device.type != "cpu":
            step = replace(step, longs=step.longs.to(self.device, non_blocking=True),
                           ints=step.ints.to(self.device, non_blocking=True))
        n = len(work)
        return ForwardBatch(
            input_ids=step.ids(),
            positions=step.positions(),
            slot_mapping=step.slots(),
            cu_seqlens_q=step.cu_seqlens_q(),
            seq_lens=step.lens(),
            block_tables=step.tables(),
            logits_indices=step.sampled(),
            num_decodes=n,
            max_seqlen_q=1,
            max_seqlen_k=max(step.seq_lens),
            query_lens_cpu=[1] * n,
            seq_lens_cpu=step.seq_lens,
        )

    def execute(self, work: list[Work]) -> torch.Tensor:
        """Logits (S, vocab) for the work items that sample, in order: one row each, 1 + len(draft)
        for an item with a draft, each item's prompt_rows before them."""
        if any(w.prompt_rows for w in work):
            return self._execute(work)
        if self.graphs is not None and self.graphs.fits(work):
            return self.graphs.run(work)
        if self.direct is not None and len(work) <= self.direct.max_rows and all(w.count == 1 for w in work):
            logits = self._decode_directly(work)
            if logits is not None:
                return logits
        return self._execute(work)

    def _decode_directly(self, work: list[Work]) -> torch.Tensor | None:
        ps = self.page_size
        positions = [w.start for w in work]
        lens = [p + 1 for p in positions]
        tables = [w.request.page_table[:-(-n // ps)] for w, n in zip(work, lens)]
        slots = [t[p // ps] * ps + p % ps for t, p in zip(tables, positions)]
        logits = self.direct([w.request.tokens[w.start] for w in work], positions, slots, tables, lens,
                             self.kv_cache.layers)
        if logits is None or all(w.samples for w in work):
            return logits
        return logits[[i for i, w in enumerate(work) if w.samples]]

    @torch.inference_mode()
    def _execute(self, work: list[Work]) -> torch.Tensor:
        batch = self.build(work)
        meta = self.backend.prepare(batch)
        return self.model(batch, self.kv_cache.layers, self.backend, meta)
