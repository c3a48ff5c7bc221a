"""Test helpers around the engine: prompts, staggered arrival, logits one level below the public API."""

from __future__ import annotations

import random

import torch

from afd_engine import Engine, SamplingParams
from afd_engine.runtime.forward_batch import ForwardBatch, SeqChunk


def engine_logits(engine: Engine, ids: list[int], cached: int = 0) -> torch.Tensor:
    """Logits of ids[cached:] after ids[:cached] was prefilled; the decode path when one token is left."""
    pool = engine.pool
    row = pool.open_row()
    try:
        assert pool.grow(row, len(ids))
        if cached:
            engine.model(
                ForwardBatch.build([SeqChunk(row, 0, ids[:cached])], [], pool.page_table, pool.page_size),
                pool.cache,
                torch.tensor([cached - 1]),
            )
        new = [SeqChunk(row, cached, ids[cached:])]
        ext, dec = (new, []) if len(ids) - cached > 1 else ([], new)
        fb = ForwardBatch.build(ext, dec, pool.page_table, pool.page_size)
        return engine.model(fb, pool.cache, torch.arange(len(ids) - cached))
    finally:
        pool.release(row)


def random_prompts(vocab: int, lengths, seed: int, low: int = 0) -> list[list[int]]:
    """One prompt of random token ids in [low, vocab) per length, reproducible by seed."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


def run_staggered(engine, batch: list[list[int]], params: SamplingParams, every: int) -> list[list[int]]:
    """Two requests join every `every` steps, so prefills land while others decode; returns each
    prompt's output tokens in prompt order (any engine: single process or a deployment)."""
    todo, index, results, step = list(enumerate(batch)), {}, {}, 0
    while todo or engine.has_unfinished():
        if step % every == 0:
            for i, ids in todo[:2]:
                index[engine.add_request(prompt_token_ids=ids, params=params)] = i
            todo = todo[2:]
        for out in engine.step():
            assert out.error is None, out.error
            results[index[out.request_id]] = out.token_ids
        step += 1
    return [results[i] for i in range(len(batch))]
