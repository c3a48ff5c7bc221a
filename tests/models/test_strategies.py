"""Every mode arranges the same layer operations; only YieldOperations, serving ops and delays differ."""

from __future__ import annotations

import pytest
import torch

from afd_engine.model_config import ModelConfig
from afd_engine.models import Kernels
from afd_engine.models.deepseek import DeepseekForCausalLM
from afd_engine.models.experts import ExpertExecutor, ExpertServer, LocalExpertExecutor
from afd_engine.models.routed_experts import ExpertShard, RoutedExperts
from afd_engine.operations import split_stages
from afd_engine.operations.strategy import AFD_ATTENTION, AFD_FFN, COLOCATED, SINGLE, describe

MOE = "attention gate dispatch shared_expert"


class NoServer(ExpertServer):
    def post(self, layer_id, micro_batch):
        raise AssertionError("not run")

    receive = send = post


class NoExecutor(ExpertExecutor):
    def dispatch(self, *args):
        raise AssertionError("not run")

    combine = dispatch


@pytest.fixture(scope="module")
def models(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)  # 4 layers: one dense, then three MoE layers
    with torch.device("meta"):
        half = {layer: list(range(8)) for layer in cfg.moe_layers}
        other = {layer: list(range(8, 16)) for layer in cfg.moe_layers}
        return (DeepseekForCausalLM(cfg, half, Kernels.named()), ExpertShard(cfg, other, Kernels.named()))


def test_each_mode_arranges_the_same_operations(models):
    model, shard = models
    ops = model.operations(NoExecutor(), NoServer())
    serve = "post_dispatch receive experts send_combine"
    assert describe(SINGLE.arrange(ops)) == "embed attention mlp " + f"{MOE} combine join " * 3 + "logits"
    assert describe(AFD_ATTENTION.arrange(ops)) == "embed attention mlp " + f"{MOE} | combine join " * 3 + "logits"
    assert describe(COLOCATED.arrange(ops)) == (
        "embed attention mlp " + f"{MOE} | {serve} combine join " * 3 + "logits"
    )
    ffn = AFD_FFN.arrange(shard.operations(NoServer()), 3)
    assert describe(ffn) == " ".join(["post_dispatch | receive experts | send_combine | |"] * 3)
    assert AFD_FFN.delays(3) == [0, 1, 2] and SINGLE.delays(3) == [0, 0, 0]
    assert len(split_stages(ffn)) == 3 * 4 + 1  # N + 1 stages per layer, and the empty tail


def test_ranks_compute_experts_with_the_models_own_module(models):
    """The expert-side ops of a colocated rank and of an FFN rank call RoutedExperts, as single mode does."""
    model, shard = models
    for ops in (model.operations(NoExecutor(), NoServer()), shard.operations(NoServer())):
        owners = [op.fn.__closure__ for layer in ops.layers for op in layer.serve if op.name == "experts"]
        cells = [c.cell_contents for closure in owners for c in closure]
        assert len(owners) == 3 and sum(isinstance(c, RoutedExperts) for c in cells) == 3


def test_local_executor_computes_what_the_experts_module_computes(tiny_v3):
    from afd_engine.models import load_model

    model = load_model(ModelConfig.from_pretrained(tiny_v3), tiny_v3, torch.float32)
    experts = model.routed_experts()[1]
    x = torch.randn(5, model.config.hidden_size)
    ids = torch.tensor([[0, 3, 7, 15]] * 5)
    weights = torch.rand(5, 4)
    executor = LocalExpertExecutor(model.routed_experts())
    routed = executor.combine(executor.dispatch(1, 0, x, ids, weights))
    expected = sum(weights[:, k, None] * experts(x, ids[:, k : k + 1], torch.ones(5, 1)) for k in range(4))
    torch.testing.assert_close(routed, expected, rtol=1e-5, atol=1e-6)


def test_unknown_backends_are_refused_with_the_known_ones(tiny_v3):
    from afd_engine import Engine
    from afd_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--attention-backend='flash': unknown backend; known: cpu, torch, triton"):
        Engine(model_path=tiny_v3, attention_backend="flash")
    with pytest.raises(ConfigError, match=r"--moe-backend='deep_gemm': unknown backend; known: cpu, torch, triton"):
        Engine(model_path=tiny_v3, moe_backend="deep_gemm")


def test_engine_runs_one_process_and_points_to_make_engine(tiny_v3):
    from afd_engine import Engine
    from afd_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--mode=afd: use afd_engine.make_engine"):
        Engine(model_path=tiny_v3, mode="afd")


def test_an_empty_micro_batch_computes_nothing_but_keeps_its_shapes(tiny_v3):
    """A rank stepping in lockstep without tokens runs its layers on [0, H]: embedding, rotary
    table, attention, gate, shared expert, dense MLP, final norm and lm_head are not called (each
    costs ~0.02-0.3 ms of Python even on no rows)."""
    from afd_engine.models import load_model
    from afd_engine.models.forward_batch import ForwardBatch

    def refuse(*args, **kwargs):
        raise AssertionError("computed on no tokens")

    model = load_model(ModelConfig.from_pretrained(tiny_v3), tiny_v3, torch.float32)
    model.prepare()
    for layer in model.model.layers:
        mlp = layer.mlp.gate if layer.is_moe else layer.mlp
        for module in (layer.self_attn, mlp, getattr(layer.mlp, "shared_experts", None)):
            if module is not None:
                module.forward = refuse
    for module in (model.model.embed_tokens, model.model.norm, model.lm_head):
        module.forward = refuse
    model.model.rotary.cos_sin = refuse
    fb = ForwardBatch.build([], [], torch.zeros(1, 4, dtype=torch.int32), 16)
    kv = torch.zeros(model.config.num_layers, 16, model.config.kv_lora_rank + model.config.rope_dim)
    logits = model(fb, kv, torch.empty(0, dtype=torch.int64))
    assert logits.shape == (0, model.config.vocab_size) and logits.dtype == torch.float32
