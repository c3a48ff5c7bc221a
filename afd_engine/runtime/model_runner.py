"""Runs the model on a scheduled step: builds the batch tensors, forwards, returns logits."""

from __future__ import annotations

import torch

from afd_engine.runtime.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.request import Request
from afd_engine.runtime.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model, self.pool = model, pool

    def run(self, plan: StepPlan) -> tuple[list[Request], torch.Tensor | None]:
        """Forwards the step; returns the requests that sample now and their logits [n, V] fp32."""
        extend = [SeqChunk(r.row, r.num_cached, r.tokens(r.num_cached, r.num_cached + n)) for r, n in plan.extend]
        decode = [SeqChunk(r.row, r.num_cached, r.tokens(r.num_cached, r.num_cached + 1)) for r in plan.decode]
        fb = ForwardBatch.build(extend, decode, self.pool.page_table, self.pool.page_size)
        # A request samples when this step completes its pending tokens: the last token of a
        # finished prefill chunk, and every decode token.
        samplers, rows, offset = [], [], 0
        for req, n in plan.extend:
            offset += n
            if n == req.pending:
                samplers.append(req)
                rows.append(offset - 1)
        samplers += plan.decode
        rows += range(offset, offset + len(plan.decode))
        logits = self.model(fb, self.pool.cache, torch.tensor(rows, dtype=torch.int64))
        for req, n in plan.extend:
            req.num_cached += n
        for req in plan.decode:
            req.num_cached += 1
        return samplers, logits
