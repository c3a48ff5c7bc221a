"""Test helpers around the engine: prompts, staggered arrival, logits one level below the public API."""

from __future__ import annotations

import random

import torch

from afd_engine import Engine, SamplingParams
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk


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


def run_staggered(
    engine, batch: list[list[int]], params: SamplingParams, every: int, after_step=None
) -> list[list[int]]:
    """Two requests join every `every` steps, so prefills land while others decode; returns each
    prompt's output tokens in prompt order (any engine: single process or a deployment).
    `after_step(tokens)`, if given, is called after every step with the tokens finished so far."""
    todo, index, results, step = list(enumerate(batch)), {}, {}, 0
    while todo or engine.has_unfinished():
        if step % every == 0:
            for i, ids in todo[:2]:
                index[engine.add_request(prompt_token_ids=ids, params=params)] = i
            todo = todo[2:]
        for out in engine.step():
            assert out.error is None, out.error
            results[index[out.request_id]] = out.token_ids
        if after_step is not None:
            after_step(sum(map(len, results.values())))
        step += 1
    return [results[i] for i in range(len(batch))]


def prefix_sharing_rounds(engine, vocab: int, params: SamplingParams, seed: int = 3, low: int = 5):
    """Three rounds of requests whose prompts share prefixes with earlier ones (the prefix cache's
    cases), each round submitted at once after the previous one finished:

    - a system prompt of 37 tokens shared by questions (in the same round and in later ones);
    - a chat that grows: each turn is the previous prompt, its answer and a new user message;
    - a 50-token prompt, then its strict prefixes (30 and 24 tokens), a prompt sharing only its
      first 21 tokens (the shared part ends inside a page), and the same prompt again.

    Returns [(prompt, output tokens, cached prompt tokens)] in submission order."""
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    system, chat, long = rand(37), rand(20), rand(50)
    results = []

    def run(batch):
        outs = engine.generate(prompt_token_ids=batch, sampling_params=params)
        for ids, out in zip(batch, outs):
            assert out.error is None, out.error
            results.append((ids, out.token_ids, out.num_cached_tokens))
        return [o.token_ids for o in outs]

    answer = run([system + rand(5), system + rand(5), chat, long])[2]
    turn2 = chat + answer + rand(6)
    answer = run([turn2, system + rand(5), long[:30], long[:21] + rand(9)])[0]
    run([turn2 + answer + rand(6), long[:24], system + rand(5), long])
    return results


def staggered_reference(path: str, lengths, params: SamplingParams, seed: int, low: int = 0):
    """(prompts, the single engine's staggered tokens), those tokens first held to transformers'
    greedy ones: the reference a deployment test compares with."""
    from tests.hf_reference import assert_greedy_matches, hf_greedy

    with Engine(model_path=path, num_threads=1) as single:
        prompts = random_prompts(single.config.vocab_size, lengths, seed=seed, low=low)
        outs = run_staggered(single, prompts, params, every=2)
    for ids, out in zip(prompts, outs):
        assert_greedy_matches(out, *hf_greedy(path, ids, params.max_new_tokens), f"prompt of {len(ids)} tokens")
    return prompts, outs
