"""The single-process engine on the GPU against transformers on the same GPU: tiny DeepSeek-V3,
Qwen3-MoE and DeepSeek-V3.2 (sparse attention) checkpoints, greedy, on the torch and triton
backends (the triton runs replay their decode steps from CUDA graphs). fp32 must give transformers'
tokens exactly; bf16 must stay within a sanity bound of its logprobs."""

from __future__ import annotations

import pytest

from tests.gpu import engines

pytestmark = pytest.mark.gpu

ARCHS, BACKENDS = ("deepseek_v3", "qwen3_moe", "deepseek_v32"), ("torch", "triton")
# bf16: a sanity bound on |engine logprob - transformers logprob| of the same token in the same
# context, not a tolerance (bf16 logits of ~10 are 1/16 apart; a broken kernel is off by nats)
BF16_MAX_LOGPROB_DIFF = 0.5


def judged(single_run, checkpoint, device, tiny, arch: str, dtype: str, backend: str, record_property) -> dict:
    """The run's agreement with transformers (engines.agreement), also recorded as test properties."""
    run = single_run(arch, dtype, backend)
    ref = engines.reference_logprobs(checkpoint(arch), device, dtype, engines.fixed_prompts(tiny), run.tokens)
    result = engines.agreement(ref, run.tokens, run.logprobs)
    for key in ("tokens", "matched", "argmax_agree", "max_logprob_diff"):
        record_property(key, result[key])
    record_property("graph_replays", run.graph_replays)
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_are_transformers(single_run, checkpoint, device, tiny, arch, backend, record_property):
    result = judged(single_run, checkpoint, device, tiny, arch, "float32", backend, record_property)
    assert result["matched"] == result["tokens"], result["prompts"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logprobs_are_near_transformers(single_run, checkpoint, device, tiny, arch, backend, record_property):
    result = judged(single_run, checkpoint, device, tiny, arch, "bfloat16", backend, record_property)
    assert result["max_logprob_diff"] <= BF16_MAX_LOGPROB_DIFF, result["prompts"]
