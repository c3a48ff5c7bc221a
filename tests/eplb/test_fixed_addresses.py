"""A switch to another expert placement copies the staged experts into the serving weights' storage:
CUDA graphs captured over the expert compute read the weights at fixed addresses, so no weight
tensor of a serving RoutedExperts may move (at any --ffn-weight-dtype: fp32, bf16, FP8 bytes)."""

from __future__ import annotations

import pytest
import torch

from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.placement import Placement
from afd_engine.eplb.stager import ExpertStager
from afd_engine.model_config import ModelConfig
from afd_engine.models import Kernels, load_expert_shard, load_model
from afd_engine.tiny_model import make_tiny_model

LAYOUT = ExpertLayout(num_experts=16, num_redundant=4, num_nodes=1, ranks_per_node=2)
SERVING = list(range(6, 16))  # rank 1's slots before the switch: experts 6..15
# rank 1's slots (10..19 of 20) after it, per MoE layer: copies, experts read from the checkpoint,
# experts it held moved to other slots; one layer keeps its slots
NEW = {1: [10, 11, 12, 13, 14, 15, 7, 7, 5, 3], 2: [15, 14, 13, 12, 11, 10, 9, 8, 0, 0], 3: SERVING}


@pytest.fixture(scope="module")
def wide_bf16(tmp_path_factory) -> str:
    """Experts of whole 128-row blocks: the triton backend holds them as FP8 bytes and scales."""
    out = tmp_path_factory.mktemp("wide-bf16")
    return str(make_tiny_model(out, dtype="bfloat16", overrides={"moe_intermediate_size": 128}))


CASES = {  # name -> (checkpoint fixture, MoE backend, --ffn-weight-dtype, names of the weight tensors)
    "fp32": ("tiny_v3", "cpu", "auto", ("w13", "w2")),
    "bf16 experts": ("tiny_v3", "cpu", "bf16", ("w13", "w2")),
    "fp8 bytes and scales": ("wide_bf16", "triton", "fp8", ("w13_q", "w2_q", "w13_scale", "w2_scale")),
}


def new_map(cfg: ModelConfig) -> ExpertMap:
    placements = {layer: Placement(list(range(10)) + NEW[layer], 10) for layer in cfg.moe_layers}
    return ExpertMap(LAYOUT, placements, version=1)


@pytest.mark.parametrize("case", list(CASES))
def test_a_switch_copies_the_new_placements_experts_into_the_same_storage(case, request):
    fixture, backend, precision, names = CASES[case]
    path = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(path)
    kernels = Kernels.named(moe=backend)
    full = load_model(cfg, path, torch.float32, kernels=kernels, ffn_weight_dtype=precision).routed_experts()

    def shard(slots):
        return load_expert_shard(cfg, path, torch.float32, slots, kernels, ffn_weight_dtype=precision)

    serving = shard({layer: SERVING for layer in cfg.moe_layers}).routed_experts()
    assert sorted(serving[1].state_dict()) == sorted(names)
    addresses = {(layer, n): t.data_ptr() for layer, m in serving.items() for n, t in m.state_dict().items()}
    dtypes = {(layer, n): t.dtype for layer, m in serving.items() for n, t in m.state_dict().items()}
    stager = ExpertStager(shard, 1, serving)
    stager.stage(new_map(cfg))
    stager.switch(1, timeout=60)
    stager.close()
    assert stager.experts_read == 3  # experts 5 and 3 of layer 1, 0 of layer 2 (once for two slots)
    for layer, module in serving.items():
        assert module.slot_expert == NEW[layer]
        for name, tensor in module.state_dict().items():
            assert tensor.data_ptr() == addresses[layer, name], (layer, name)
            assert tensor.dtype == dtypes[layer, name]
            assert torch.equal(tensor, full[layer].state_dict()[name][NEW[layer]]), (layer, name)


def test_adopt_refuses_other_dtypes_or_slot_counts_and_copies_nothing(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    layer = cfg.moe_layers[0]
    serving = load_expert_shard(cfg, tiny_v3, torch.float32, {layer: SERVING}).routed_experts()[layer]
    before = serving.w13.clone()
    bf16 = load_expert_shard(cfg, tiny_v3, torch.float32, {layer: SERVING[::-1]}, ffn_weight_dtype="bf16")
    with pytest.raises(ValueError, match=r"cannot adopt w13 torch.bfloat16 \[10, 64, 64\] on cpu into torch.float32"):
        serving.adopt(bf16.routed_experts()[layer])
    fewer = load_expert_shard(cfg, tiny_v3, torch.float32, {layer: SERVING[:4]})
    with pytest.raises(ValueError, match="cannot adopt 4 slots into 10: a switch copies into the same storage"):
        serving.adopt(fewer.routed_experts()[layer])
    assert torch.equal(serving.w13, before) and serving.slot_expert == SERVING
