"""Test helpers that reach one level below the public Engine API."""

from __future__ import annotations

import torch

from afd_engine import Engine
from afd_engine.runtime.forward_batch import ForwardBatch, SeqChunk


def engine_logits(engine: Engine, ids: list[int], cached: int = 0) -> torch.Tensor:
    """Logits of ids[cached:] after ids[:cached] was prefilled; the decode path when one token is left."""
    pool = engine.pool
    row = pool.open_row()
    try:
        assert pool.grow(row, len(ids))
        if cached:
            engine.model(ForwardBatch.build([SeqChunk(row, 0, ids[:cached])], [], pool.page_table, pool.page_size),
                         pool.cache, torch.tensor([cached - 1]))
        new = [SeqChunk(row, cached, ids[cached:])]
        ext, dec = (new, []) if len(ids) - cached > 1 else ([], new)
        fb = ForwardBatch.build(ext, dec, pool.page_table, pool.page_size)
        return engine.model(fb, pool.cache, torch.arange(len(ids) - cached))
    finally:
        pool.release(row)
