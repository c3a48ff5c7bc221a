"""Routed-expert weights: one layer's experts stacked per slot (`RoutedExperts`), and the shard of
them an expert rank holds (`ExpertShard`).

A slot holds one logical expert; a rank's slots are its share of the placement (eplb/), copies of
hot experts included. The stacked layout (`w13 [slots, 2I, H]`, `w2 [slots, H, I]`, or FP8 bytes
with block scales) is what the MoE kernels compute on.
"""

from __future__ import annotations

import torch
from torch import nn

from afd_engine.model_config import ModelConfig
from afd_engine.models.experts import ExpertServer, expert_operations
from afd_engine.models.meta import on_meta
from afd_engine.operations.strategy import LayerOps, ModelOps


class RoutedExperts(nn.Module):
    """One layer's routed experts held here, one stacked slot per copy, for grouped compute.

    `slot_expert` is the logical expert of each slot: all experts in order in single mode, a rank's
    share (redundant copies included) elsewhere. The one implementation of routed-expert compute:
    single mode calls it through the local executor, FFN ranks and colocated ranks on the token
    copies they receive (local ids index the slots).
    """

    def __init__(self, cfg: ModelConfig, slot_expert, kernels) -> None:
        super().__init__()
        self.cfg, self.slot_expert, self.count, self.kernels = cfg, list(slot_expert), len(slot_expert), kernels
        count = self.count
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.fp8 = keeps_fp8_experts(cfg, kernels)
        if self.fp8:  # the checkpoint's FP8 bytes (uint8, so that model.to(dtype) leaves them) + block scales
            self.register_buffer("w13_q", torch.empty(count, 2 * inter, hidden, dtype=torch.uint8))
            self.register_buffer("w2_q", torch.empty(count, hidden, inter, dtype=torch.uint8))
            self.register_buffer("w13_scale", torch.empty(count, 2 * inter // 128, -(-hidden // 128)))
            self.register_buffer("w2_scale", torch.empty(count, -(-hidden // 128), inter // 128))
        else:
            self.w13 = nn.Parameter(torch.empty(count, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(count, hidden, inter))

    def keep_fp32(self) -> None:
        """After model.to(dtype): the FP8 block scales stay fp32, as the checkpoint stores them."""
        if self.fp8:
            self.w13_scale, self.w2_scale = self.w13_scale.float(), self.w2_scale.float()

    def adopt(self, other: RoutedExperts) -> None:
        """Takes `other`'s slots and weights (same slot count; no copy): a rebalance's switch."""
        if other.count != self.count or other.fp8 != self.fp8:
            raise ValueError(f"cannot adopt {other.count} slots into {self.count}")
        for name in self._weight_names():
            setattr(self, name, getattr(other, name))
        self.slot_expert = list(other.slot_expert)

    def _weight_names(self) -> tuple[str, ...]:
        return ("w13_q", "w2_q", "w13_scale", "w2_scale") if self.fp8 else ("w13", "w2")

    def gather(self, slot_expert: list[int], sources: list[RoutedExperts]) -> RoutedExperts:
        """A new module holding `slot_expert`, each slot's weights copied from the first of `sources`
        that holds its expert (a rebalance's staging: experts kept here are copied, not re-read)."""
        where = {}
        for src in sources:
            for i, e in enumerate(src.slot_expert):
                where.setdefault(e, (src, i))
        with on_meta():
            out = RoutedExperts(self.cfg, slot_expert, self.kernels)
        for name in self._weight_names():
            stacked = torch.stack([getattr(where[e][0], name)[where[e][1]] for e in slot_expert])
            setattr(out, name, nn.Parameter(stacked, requires_grad=False) if name in ("w13", "w2") else stacked)
        return out

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, K] -> slot indices (single mode: every expert once, in order)."""
        if self.slot_expert != list(range(self.count)):
            raise ValueError("to_local needs every expert once, in order (single mode)")
        return topk_ids

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], local_ids [T, K] int64 (-1: not here), weights [T, K] fp32 -> [T, H], per token
        the weighted sum over the experts held here."""
        if self.fp8:
            f8 = torch.float8_e4m3fn
            return self.kernels.fused_moe_fp8(
                x, self.w13_q.view(f8), self.w13_scale, self.w2_q.view(f8), self.w2_scale, local_ids, weights
            )
        return self.kernels.fused_moe(x, self.w13, self.w2, local_ids, weights)


def keeps_fp8_experts(cfg: ModelConfig, moe_kernels) -> bool:
    """Routed experts stay FP8 (no dequantization at load) when the checkpoint is FP8 with 128x128
    blocks, the MoE backend computes on FP8 weights, and gate and up each fill whole 128-row blocks
    (stacked into w13, their scales then stack too)."""
    return (
        cfg.fp8_block == (128, 128) and hasattr(moe_kernels, "fused_moe_fp8") and cfg.moe_intermediate_size % 128 == 0
    )


def all_experts(cfg: ModelConfig) -> dict[int, list[int]]:
    """Every routed expert once, in order, for every MoE layer (single mode)."""
    return {layer: list(range(cfg.n_routed_experts)) for layer in cfg.moe_layers}


class _Holder(nn.Module):
    """A named level of the module tree, so that expert shards keep the checkpoint's names."""


class ExpertShard(nn.Module):
    """Only routed experts, per MoE layer the slots of `expert_slots`: what an FFN rank loads (and
    what a rebalance stages before switching to it).

    Parameter names are the full model's (`model.layers.3.mlp.experts.w13`), so the same loader
    fills them and skips everything else in the checkpoint.
    """

    def __init__(self, cfg: ModelConfig, expert_slots: dict[int, list[int]], kernels) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Holder()
        self.model.layers = nn.ModuleDict()
        for layer_id, slots in expert_slots.items():
            holder = _Holder()
            holder.mlp = _Holder()
            holder.mlp.experts = RoutedExperts(cfg, slots, kernels.moe)
            self.model.layers[str(layer_id)] = holder

    def routed_experts(self) -> dict[int, RoutedExperts]:
        """layer id -> the routed experts held here."""
        return {int(i): holder.mlp.experts for i, holder in self.model.layers.items()}

    def operations(self, server: ExpertServer) -> ModelOps:
        """The expert side of every MoE layer (post_dispatch, receive, experts, send_combine)."""
        layers = tuple(
            LayerOps(int(i), True, (), expert_operations(int(i), holder.mlp.experts, server))
            for i, holder in self.model.layers.items()
        )
        return ModelOps((), layers, ())

    def prepare(self) -> None:
        """Nothing to derive after loading (the attention model absorbs its decode weights here)."""
