"""FP8 checkpoints on the triton MoE backend: routed experts stay FP8 (no dequantization at load)
and the engine's outputs stay within fp8 activation error of the dequantized model."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.tiny_model import make_tiny_model

PROMPTS = [[5, 6, 7], [40] * 30, list(range(100, 150))]
FIRST = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    # experts of 128 rows per projection: whole 128x128 blocks along I, a partial block along H (64)
    return str(
        make_tiny_model(tmp_path_factory.mktemp("fp8-experts"), fp8=True, overrides={"moe_intermediate_size": 128})
    )


def test_experts_keep_the_checkpoints_fp8_bytes(fp8_ckpt):
    with Engine(model_path=fp8_ckpt, moe_backend="triton", num_threads=1) as eng:
        experts = eng.model.routed_experts()[1]
        assert experts.fp8 and experts.w13_q.dtype == torch.uint8 and experts.w13_scale.dtype == torch.float32
        with safe_open(f"{fp8_ckpt}/model.safetensors", framework="pt") as f:
            up = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
            up_scale = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv")
            down_scale = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv")
        assert torch.equal(experts.w13_q[3, 128:], up.view(torch.uint8))
        assert torch.equal(experts.w13_scale[3, 1:], up_scale.float())
        assert torch.equal(experts.w2_scale[3], down_scale.float())
    with Engine(model_path=fp8_ckpt, num_threads=1) as eng:  # the torch backend dequantizes at load
        assert not eng.model.routed_experts()[1].fp8


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode",
    [
        dict(mode="single"),
        pytest.param(dict(mode="afd", dp_size=1, ffn_ranks_per_node=2, micro_batches=2), marks=pytest.mark.slow),
    ],
    ids=["single", "afd"],
)
def test_fp8_experts_stay_within_fp8_error_of_dequantized_weights(fp8_ckpt, mode):
    with Engine(model_path=fp8_ckpt, num_threads=1) as ref_engine:
        ref = ref_engine.generate(prompt_token_ids=PROMPTS, sampling_params=FIRST)
    with make_engine(model_path=fp8_ckpt, moe_backend="triton", num_threads=1, **mode) as engine:
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=FIRST)
    for r, o in zip(ref, outs):
        diff = (torch.tensor(o.logprobs[0].top_logprobs) - torch.tensor(r.logprobs[0].top_logprobs)).abs().max()
        assert diff < 0.05, f"fp8 experts move the top-5 logprobs by {diff:.3f}"
        assert diff > 0  # the activations really went through fp8: not the dequantized path
