"""The engine computes what transformers computes (DeepSeek-V2/V3 and Qwen3-MoE): logits and greedy
tokens, in every runtime mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_engine import Engine, SamplingParams
from tests.conftest import RESAVED_CONFIGS, TINY_CONFIGS
from tests.engine_helpers import engine_logits, random_prompts
from tests.engine_helpers import run_staggered as staggered
from tests.hf_reference import assert_greedy_matches, hf_greedy, hf_logits

PROMPT_LENS = (1, 2, 9, 33, 64, 100, 157, 200)
NEW_TOKENS = 32
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    return random_prompts(vocab, PROMPT_LENS, seed=1)


def run_staggered(engine: Engine, batch: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Two requests join every third step."""
    return staggered(engine, batch, params, every=3)


@pytest.fixture(scope="module", params=[*TINY_CONFIGS, *RESAVED_CONFIGS])
def case(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    engine = Engine(model_path=path, dtype="float32", num_threads=1)
    batch = prompts(engine.config.vocab_size)
    refs = [hf_greedy(path, ids, NEW_TOKENS) for ids in batch]
    return request.param, path, engine, batch, refs


def check_all(name, outs, batch, refs, label):
    for ids, out, (ref, gaps) in zip(batch, outs, refs):
        assert_greedy_matches(out, ref, gaps, f"{name} {label} prompt len {len(ids)}")


def test_prefill_and_decode_logits_match(case):
    name, path, engine, batch, _ = case
    if name in RESAVED_CONFIGS:  # today's spellings, as transformers wrote them
        cfg = json.loads((Path(path) / "config.json").read_text())
        assert "rope_parameters" in cfg and "rope_theta" not in cfg and "rope_scaling" not in cfg
        assert "num_experts" not in cfg and ("num_local_experts" in cfg) == name.startswith(("qwen3", "minimax"))
    for ids in batch[2:]:
        ref = hf_logits(path, ids)
        assert (engine_logits(engine, ids) - ref).abs().max() <= 1e-4, f"{name} prefill, len {len(ids)}"
        # the absorbed decode form for the last position, after a prefill of the rest
        assert (engine_logits(engine, ids, cached=len(ids) - 1)[0] - ref[-1]).abs().max() <= 1e-4


def test_greedy_batch_submitted_together(case):
    name, _, engine, batch, refs = case
    outs = engine.generate(prompt_token_ids=batch, sampling_params=GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    check_all(name, [o.token_ids for o in outs], batch, refs, "together")


def test_greedy_staggered_arrival(case):
    name, _, engine, batch, refs = case
    check_all(name, run_staggered(engine, batch), batch, refs, "staggered")


def test_greedy_with_small_prefill_chunks(case):
    name, path, _, batch, refs = case
    engine = Engine(model_path=path, dtype="float32", num_threads=1, max_num_batched_tokens=7)
    check_all(name, run_staggered(engine, batch), batch, refs, "chunked")


def test_greedy_with_kv_pool_too_small_for_all(case):
    name, path, _, batch, refs = case
    # 30 pages of 8 tokens: the longest request (200 + 32 tokens) fits alone, but the batch needs
    # about 860 tokens at once, so requests wait and decodes preempt newer requests.
    engine = Engine(model_path=path, dtype="float32", num_threads=1, page_size=8, max_total_tokens=240)
    outs = run_staggered(engine, batch)
    check_all(name, outs, batch, refs, "small pool")
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.used_pages == engine.cache.num_pages
