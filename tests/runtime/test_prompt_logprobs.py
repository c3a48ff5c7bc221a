"""Prompt logprobs: every prompt token's log-probability equals transformers' log-softmax, in one
prefill or in chunks, with or without a prefix-cache hit before the scored part, generating tokens
or none (max_new_tokens=0), in single, colocated and AFD modes."""

from __future__ import annotations

import pytest
import torch

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.errors import InvalidRequestError
from tests.engine_helpers import random_prompts
from tests.hf_reference import hf_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1) as engine:
        vocab = engine.config.vocab_size
    batch = random_prompts(vocab, (2, 17, 40, 75), seed=21, low=5)
    refs = [torch.log_softmax(hf_logits(tiny_v3, ids), dim=-1) for ids in batch]
    return batch, refs


def check(outs, batch, refs, start: int = 0, k: int = 0) -> None:
    for out, ids, ref in zip(outs, batch, refs):
        got = out.prompt_logprobs
        assert len(got) == len(ids) - start, f"{len(got)} prompt logprobs for {len(ids)} tokens from {start}"
        if start == 0:
            assert got[0] is None  # nothing predicts the first token
        for i, entry in zip(range(max(start, 1), len(ids)), got[1 if start == 0 else 0 :]):
            assert abs(entry.logprob - ref[i - 1, ids[i]].item()) <= TOL, f"token {i} of {len(ids)}"
            top = ref[i - 1].topk(k)
            assert entry.top_ids == top.indices.tolist()
            assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=TOL)


@pytest.mark.parametrize("flags", [{}, {"max_num_batched_tokens": 9, "page_size": 4}], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_v3, prompts, flags):
    batch, refs = prompts
    with Engine(model_path=tiny_v3, num_threads=1, **flags) as engine:
        for max_new in (0, 3, 0):  # the second scoring run finds the prompts cached: they must not be used
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, prompt_logprobs=3)
            outs = engine.generate(prompt_token_ids=batch, sampling_params=params)
            check(outs, batch, refs, k=3)
            assert all(len(o.token_ids) == max_new and o.finish_reason == "length" for o in outs)
            assert all(o.num_cached_tokens == 0 for o in outs)
        assert engine.pool.used_pages == engine.cache.num_pages > 0


def test_scoring_from_a_start_position_reuses_the_cache_before_it(tiny_v3, prompts):
    batch, refs = prompts
    ids, ref = batch[3], refs[3]  # 75 tokens
    with Engine(model_path=tiny_v3, num_threads=1, page_size=8) as engine:
        engine.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        params = SamplingParams(max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=30)
        out = engine.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.num_cached_tokens == 24  # token 30 needs position 29's logits: whole pages up to 29
    check([out], [ids], [ref], start=30)


def test_zero_new_tokens_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError, match="max_new_tokens=0: must be at least 1 \\(0 only with prompt"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs_start=-1"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags",
    [
        dict(mode="colocated", dp_size=2, micro_batches=2),
        dict(mode="afd", dp_size=2, ffn_nodes=2, micro_batches=3, max_num_batched_tokens=20),
    ],
    ids=["colocated dp2 mb2", "afd 2A 2x1 mb3 chunked"],
)
@pytest.mark.slow
def test_prompt_logprobs_in_deployments(tiny_v3, prompts, flags):
    batch, refs = prompts
    with make_engine(model_path=tiny_v3, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        for max_new in (0, 2):
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, prompt_logprobs=2)
            check(engine.generate(prompt_token_ids=batch, sampling_params=params), batch, refs, k=2)
