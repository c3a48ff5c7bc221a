"""GLM-4.5/4.6-MoE (`Glm4MoeForCausalLM`) against transformers' own implementation on the same tiny
weights: GQA with q/k/v biases, rope over half of each head, q/k norm on and off, DeepSeek-V3's
routing with groups and the correction bias, a shared expert, a leading dense layer. Greedy tokens
equal in one process and in an AFD deployment."""

from __future__ import annotations

import pytest

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.model_config import ModelConfig
from afd_engine.tiny_model import make_tiny_model
from tests.engine_helpers import engine_logits, random_prompts
from tests.hf_reference import assert_greedy_matches, hf_greedy, hf_logits

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["qk-norm", "no-qk-norm"])
def glm(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("glm4-moe")
    return str(make_tiny_model(out, arch="glm4_moe", seed=3, overrides={"use_qk_norm": request.param}))


def test_the_config_reads_as_glm(glm):
    cfg = ModelConfig.from_pretrained(glm)
    assert (cfg.attention, cfg.attention_bias, cfg.rope_dim, cfg.head_dim) == ("gqa", True, 8, 16)
    assert (cfg.topk_method, cfg.scoring_func, cfg.n_group, cfg.topk_group) == ("noaux_tc", "sigmoid", 4, 2)
    assert cfg.moe_layers == (1, 2, 3) and cfg.n_shared_experts == 1 and not cfg.rope.interleave


def test_logits_and_greedy_tokens_equal_transformers(glm):
    with Engine(model_path=glm, dtype="float32", num_threads=1) as eng:
        prompts = random_prompts(eng.config.vocab_size, (1, 6, 23, 40), seed=5, low=5)
        torch_close = (engine_logits(eng, prompts[2]) - hf_logits(glm, prompts[2])).abs().max().item()
        assert torch_close < 1e-4
        ours = [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    for ids, got in zip(prompts, ours):
        ref, gaps = hf_greedy(glm, ids, NEW)
        assert assert_greedy_matches(got, ref, gaps, f"prompt of {len(ids)}") == NEW


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_afd_deployment_gives_the_single_engines_tokens(glm):
    with Engine(model_path=glm, dtype="float32", num_threads=1) as single:
        prompts = random_prompts(single.config.vocab_size, (3, 17, 30), seed=9, low=5)
        want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    flags = dict(mode="afd", dp_size=2, ffn_nodes=1, ffn_ranks_per_node=2, micro_batches=2, dispatch_dtype="fp32")
    with make_engine(model_path=glm, comm_timeout=30, **flags) as engine:
        got = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == want
