"""Model registry: architecture name (config.json `architectures`) -> model class, plus loading.

Kernels are chosen here, by backend name (kernels/registry.py), and handed to the modules: the
rest of the engine never imports `kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from afd_engine.models.deepseek import DeepseekForCausalLM
from afd_engine.models.loader import load_weights
from afd_engine.models.meta import on_meta
from afd_engine.models.routed_experts import ExpertShard, RoutedExperts
from kernels.registry import BackendUnavailableError, attention_backend, moe_backend

MODEL_REGISTRY = {
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "Qwen3MoeForCausalLM": DeepseekForCausalLM,  # the same stack with GQA attention (cfg.attention)
    "Glm4MoeForCausalLM": DeepseekForCausalLM,  # GQA attention, DeepSeek-V3's MoE
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,  # MLA over the indexer's chosen tokens (models/indexer.py)
    "MiniMaxM2ForCausalLM": DeepseekForCausalLM,  # GQA with per-layer q/k norm, sigmoid routing, no shared expert
}


@dataclass(frozen=True)
class Kernels:
    """The backends a model's modules call: `attention` (MLA) and `moe` (routed experts)."""

    attention: object
    moe: object

    @staticmethod
    def named(attention: str = "torch", moe: str = "torch", attention_kind: str = "mla") -> Kernels:
        """The backends by name (attention kernels for `attention_kind`, "mla" or "gqa"); a backend
        that cannot run here is a ConfigError naming its flag."""
        return Kernels(
            _backend(lambda n: attention_backend(n, attention_kind), attention, "attention-backend"),
            _backend(moe_backend, moe, "moe-backend"),
        )


def _backend(make, name: str, flag: str):
    try:
        return make(name)
    except BackendUnavailableError as exc:
        raise ConfigError(f"--{flag}={name}: {exc}") from None


def load_model(
    cfg: ModelConfig,
    model_path: str | Path,
    dtype: torch.dtype,
    expert_slots: dict[int, list[int]] | None = None,
    kernels: Kernels | None = None,
    device: torch.device | str = "cpu",
    ffn_weight_dtype: str = "auto",
    mtp: bool = False,
) -> DeepseekForCausalLM:
    """Builds the model for `cfg.architecture` in `dtype` on `device` and loads its weights from
    `model_path` (read on the host, copied to the device tensor by tensor). Its routed experts are
    held at `ffn_weight_dtype` (--ffn-weight-dtype: auto, bf16 or fp8; RoutedExperts.set_precision).
    With `mtp`, the checkpoint's multi-token prediction module too (models/mtp.py)."""
    with on_meta():  # no random init of weights that the checkpoint overwrites
        model = MODEL_REGISTRY[cfg.architecture](cfg, expert_slots, kernels or Kernels.named())
        if mtp:  # the checkpoint's multi-token prediction module, the draft of speculative decoding
            from afd_engine.models.mtp import attach_mtp

            held = None if expert_slots is None else expert_slots.get(cfg.num_layers, [])
            attach_mtp(model, cfg, (kernels or Kernels.named()), held)
    _hold_experts(model, ffn_weight_dtype)
    model.to(dtype)
    for layer in model.model.layers:  # the router's bias stays fp32, as the checkpoint stores it
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias = gate.e_score_correction_bias.float()
        indexer = getattr(getattr(layer, "self_attn", None), "indexer", None)
        if indexer is not None:
            indexer.keep_fp32()
    _keep_storage_dtypes(model)
    model.to_empty(device=device)
    load_weights(model, model_path)
    return model.eval().requires_grad_(False)


def load_expert_shard(
    cfg: ModelConfig,
    model_path: str | Path,
    dtype: torch.dtype,
    expert_slots: dict[int, list[int]],
    kernels: Kernels | None = None,
    device: torch.device | str = "cpu",
    ffn_weight_dtype: str = "auto",
    read: bool = True,
) -> ExpertShard:
    """Only the routed experts of `expert_slots` (per MoE layer, the logical expert of each slot):
    an FFN rank's weights, or the experts a rebalance stages; held at `ffn_weight_dtype` as in
    `load_model`, so that they equal the full model's experts. Without `read`, the storage only,
    uninitialized (a replacement FFN rank gets its experts when it is admitted)."""
    with on_meta():
        shard = ExpertShard(cfg, expert_slots, kernels or Kernels.named())
    _hold_experts(shard, ffn_weight_dtype)
    shard.to(dtype)
    _keep_storage_dtypes(shard)
    shard.to_empty(device=device)
    if read:
        load_weights(shard, model_path)
    return shard.eval().requires_grad_(False)


def _hold_experts(model: torch.nn.Module, precision: str) -> None:
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.set_precision(precision)


def _keep_storage_dtypes(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.keep_storage_dtypes()
