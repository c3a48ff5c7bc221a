"""--ffn-weight-dtype end to end: an AFD deployment (1 attention rank, 2 FFN ranks, 2 micro-batches)
whose FFN ranks load their shards at the flag's precision gives exactly the greedy tokens of the
single engine with the same flag (the routed experts quantized identically wherever they are
loaded; fp32 activations and wires, so nothing else differs)."""

from __future__ import annotations

import pytest
import torch

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.models.quant import fp8_round_trip
from afd_engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [40] * 12, list(range(100, 121)), [9, 300, 17, 2, 88]]
AFD = dict(mode="afd", dp_size=1, ffn_ranks_per_node=2, micro_batches=2)
LAYER = 1


def greedy(engine) -> list[list[int]]:
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision, storage", [("fp8", "bfloat16"), ("bf16", "float32")])
def test_afd_gives_the_single_engines_tokens_at_the_same_expert_precision(precision, storage, tmp_path):
    path = str(make_tiny_model(tmp_path / "ckpt", dtype=storage))
    with Engine(model_path=path, num_threads=1) as plain:
        plain_tokens = greedy(plain)
        plain_experts = plain.model.routed_experts()[LAYER].w13.clone()
    with Engine(model_path=path, num_threads=1, ffn_weight_dtype=precision) as single:
        expected = greedy(single)
        experts = single.model.routed_experts()[LAYER].w13
    # the flag changes the weights the experts compute with (fp32 activations either way)
    if precision == "fp8":
        assert experts.dtype == torch.float32 and torch.equal(experts[0, :32], fp8_round_trip(plain_experts[0, :32]))
    else:
        assert experts.dtype == torch.bfloat16 and torch.equal(experts, plain_experts.to(torch.bfloat16))
    assert not torch.equal(experts.float(), plain_experts)
    if precision == "fp8":  # the tiny model's seeded weights: quantized experts change some tokens
        assert expected != plain_tokens
    with make_engine(model_path=path, num_threads=1, comm_timeout=30, ffn_weight_dtype=precision, **AFD) as afd:
        assert greedy(afd) == expected
