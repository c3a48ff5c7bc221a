"""--ffn-weight-dtype at load: the routed experts of the full model and of an expert shard held as
bf16, or block-quantized to FP8 (bytes and scales where the MoE backend computes on FP8, else the
quantized values), identically wherever they are loaded; everything else keeps --dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.stager import load_shard
from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from afd_engine.models import Kernels, load_expert_shard, load_model
from afd_engine.models.quant import fp8_round_trip, quantize_fp8_blocks
from afd_engine.tiny_model import make_tiny_model

LAYER = 2  # a MoE layer of the tiny models


def checkpoint_expert(path: str, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """proj -> the checkpoint's float32 weight of one expert."""
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return {
            proj: f.get_tensor(f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight").float()
            for proj in ("gate_proj", "up_proj", "down_proj")
        }


def stacked(ckpt: dict[str, torch.Tensor], fn=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) of one expert as RoutedExperts stacks them, each projection through `fn`."""
    return torch.cat([fn(ckpt["gate_proj"]), fn(ckpt["up_proj"])]), fn(ckpt["down_proj"])


@pytest.fixture(scope="module")
def wide_bf16(tmp_path_factory) -> str:
    """A bf16 checkpoint whose experts fill whole 128-row blocks (the triton backend keeps FP8)."""
    out = tmp_path_factory.mktemp("wide-bf16")
    return str(make_tiny_model(out, dtype="bfloat16", overrides={"moe_intermediate_size": 128}))


def test_fp8_experts_hold_the_values_of_the_block_quantized_checkpoint_weights(tiny_v3, tiny_model_factory):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    plain = load_model(cfg, tiny_v3, torch.float32)
    model = load_model(cfg, tiny_v3, torch.float32, ffn_weight_dtype="fp8")
    experts = model.routed_experts()[LAYER]
    assert not experts.fp8 and experts.precision == "fp8" and experts.w13.dtype == torch.float32
    for e in range(cfg.n_routed_experts):
        ckpt = checkpoint_expert(tiny_v3, LAYER, e)
        w13, w2 = stacked(ckpt, fp8_round_trip)
        assert torch.equal(experts.w13[e], w13) and torch.equal(experts.w2[e], w2)
        assert not torch.equal(experts.w13[e], stacked(ckpt)[0])  # really quantized
    # the rest of the model keeps the checkpoint's values at --dtype
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        if ".experts." not in name:
            assert torch.equal(p, q), name
    # the same values as the FP8 checkpoint of the same weights (DeepSeek-V3's format), dequantized
    fp8_ckpt = tiny_model_factory("v3-yarn-qlora", fp8=True)
    fp8_cfg = ModelConfig.from_pretrained(fp8_ckpt)
    fp8_model = load_model(fp8_cfg, fp8_ckpt, torch.float32)
    assert torch.equal(fp8_model.routed_experts()[LAYER].w13, experts.w13)
    assert torch.equal(fp8_model.routed_experts()[LAYER].w2, experts.w2)
    # --ffn-weight-dtype fp8 on that FP8 checkpoint: its own FP8, not quantized again
    again = load_model(fp8_cfg, fp8_ckpt, torch.float32, ffn_weight_dtype="fp8")
    assert torch.equal(again.routed_experts()[LAYER].w13, experts.w13)


def test_an_expert_shard_holds_the_full_models_quantized_experts(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    full = load_model(cfg, tiny_v3, torch.float32, ffn_weight_dtype="fp8").routed_experts()[LAYER]
    slots = [5, 3, 5, 0, 15]  # two copies of expert 5, out of order
    shard = load_expert_shard(cfg, tiny_v3, torch.float32, {LAYER: slots}, ffn_weight_dtype="fp8")
    experts = shard.routed_experts()[LAYER]
    assert torch.equal(experts.w13, full.w13[slots]) and torch.equal(experts.w2, full.w2[slots])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_shard_of_an_ffn_rank_or_a_rebalance_is_held_at_the_flags_precision(tiny_v3, precision):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    args = EngineArgs(model_path=tiny_v3, ffn_weight_dtype=precision)
    experts = load_shard(args, cfg, "cpu", {LAYER: [3, 9]}).routed_experts()[LAYER]
    full = load_model(cfg, tiny_v3, torch.float32, ffn_weight_dtype=precision).routed_experts()[LAYER]
    assert experts.precision == precision and experts.w13.dtype == full.w13.dtype
    assert torch.equal(experts.w13, full.w13[[3, 9]]) and torch.equal(experts.w2, full.w2[[3, 9]])


def test_bf16_experts_are_stored_bf16_and_compute_in_bf16_for_fp32_activations(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    model = load_model(cfg, tiny_v3, torch.float32, ffn_weight_dtype="bf16")
    experts = model.routed_experts()[LAYER]
    assert experts.w13.dtype == experts.w2.dtype == torch.bfloat16 and not experts.fp8
    w13, w2 = stacked(checkpoint_expert(tiny_v3, LAYER, 7), lambda t: t.to(torch.bfloat16))
    assert torch.equal(experts.w13[7], w13) and torch.equal(experts.w2[7], w2)
    assert model.model.layers[LAYER].mlp.gate.weight.dtype == torch.float32  # the rest keeps --dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.n_routed_experts, (5, cfg.num_experts_per_tok), generator=gen)
    weights = torch.rand(5, cfg.num_experts_per_tok, generator=gen)
    out = experts(x, ids, weights)
    assert out.dtype == torch.float32
    expected = experts.kernels.fused_moe(x.to(torch.bfloat16), experts.w13, experts.w2, ids, weights).float()
    assert torch.equal(out, expected)
    plain = load_model(cfg, tiny_v3, torch.float32).routed_experts()[LAYER]
    assert not torch.equal(out, plain(x, ids, weights))


def test_fp8_on_a_backend_with_fp8_kernels_keeps_the_quantized_bytes_and_scales(wide_bf16):
    cfg = ModelConfig.from_pretrained(wide_bf16)
    triton = Kernels.named(moe="triton")
    model = load_model(cfg, wide_bf16, torch.float32, kernels=triton, ffn_weight_dtype="fp8")
    experts = model.routed_experts()[LAYER]
    assert experts.fp8 and experts.w13_q.dtype == torch.uint8 and experts.w13_scale.dtype == torch.float32
    ckpt = checkpoint_expert(wide_bf16, LAYER, 4)
    (gate_q, gate_s), (up_q, up_s), (down_q, down_s) = (quantize_fp8_blocks(ckpt[p]) for p in ckpt)
    assert torch.equal(experts.w13_q[4], torch.cat([gate_q, up_q]).view(torch.uint8))
    assert torch.equal(experts.w13_scale[4], torch.cat([gate_s, up_s]))
    assert torch.equal(experts.w2_q[4], down_q.view(torch.uint8)) and torch.equal(experts.w2_scale[4], down_s)
    shard = load_expert_shard(cfg, wide_bf16, torch.float32, {LAYER: [4, 1]}, triton, ffn_weight_dtype="fp8")
    assert torch.equal(shard.routed_experts()[LAYER].w13_q, experts.w13_q[[4, 1]])
    # auto and bf16 hold the bf16 checkpoint unquantized, on the same backend
    for precision in ("auto", "bf16"):
        held = load_model(cfg, wide_bf16, torch.float32, kernels=triton, ffn_weight_dtype=precision)
        assert not held.routed_experts()[LAYER].fp8


def test_fp8_where_gate_and_up_do_not_fill_whole_blocks_holds_the_quantized_values(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)  # moe_intermediate_size 32: not whole 128-row blocks
    model = load_model(cfg, tiny_v3, torch.float32, kernels=Kernels.named(moe="triton"), ffn_weight_dtype="fp8")
    experts = model.routed_experts()[LAYER]
    assert not experts.fp8
    assert torch.equal(experts.w2[2], fp8_round_trip(checkpoint_expert(tiny_v3, LAYER, 2)["down_proj"]))


def test_an_unknown_expert_precision_is_a_config_error(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    with pytest.raises(ConfigError, match=r"--ffn-weight-dtype='fp16': choose one of auto, bf16, fp8"):
        load_model(cfg, tiny_v3, torch.float32, ffn_weight_dtype="fp16")
