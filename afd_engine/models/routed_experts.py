"""Routed-expert weights: one layer's experts stacked per slot (`RoutedExperts`), and the shard of
them an expert rank holds (`ExpertShard`).

A slot holds one logical expert; a rank's slots are its share of the placement (eplb/), copies of
hot experts included. The stacked layout (`w13 [slots, 2I, H]`, `w2 [slots, H, I]`, or FP8 bytes
with block scales) is what the MoE kernels compute on, at the precision --ffn-weight-dtype sets
wherever the experts are held. The weight tensors keep their storage for the module's life: a
switch to another placement copies into it (`adopt`), so CUDA graphs captured over the experts
stay valid.
"""

from __future__ import annotations

import torch
from torch import nn

from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from afd_engine.models.experts import ExpertServer, expert_operations
from afd_engine.models.meta import on_meta
from afd_engine.operations.strategy import LayerOps, ModelOps

EXPERT_PRECISIONS = ("auto", "bf16", "fp8")  # --ffn-weight-dtype


class RoutedExperts(nn.Module):
    """One layer's routed experts held here, one stacked slot per copy, for grouped compute.

    `slot_expert` is the logical expert of each slot: all experts in order in single mode, a rank's
    share (redundant copies included) elsewhere. The one implementation of routed-expert compute:
    single mode calls it through the local executor, FFN ranks and colocated ranks on the token
    copies they receive (local ids index the slots). Experts held in another dtype than the
    activations (bf16) compute in theirs: the input is cast to it and the output back.
    """

    def __init__(self, cfg: ModelConfig, slot_expert, kernels, precision: str = "auto") -> None:
        """`precision` (--ffn-weight-dtype): how the weights are held, see `set_precision`."""
        super().__init__()
        self.cfg, self.slot_expert, self.count, self.kernels = cfg, list(slot_expert), len(slot_expert), kernels
        self._allocate(precision)

    def _allocate(self, precision: str) -> None:
        if precision not in EXPERT_PRECISIONS:
            raise ConfigError(f"--ffn-weight-dtype={precision!r}: choose one of {', '.join(EXPERT_PRECISIONS)}")
        for name in ("w13", "w2", "w13_q", "w2_q", "w13_scale", "w2_scale"):
            if hasattr(self, name):
                delattr(self, name)
        count, inter, hidden = self.count, self.cfg.moe_intermediate_size, self.cfg.hidden_size
        self.precision = precision
        self.fp8 = keeps_fp8_experts(self.cfg, self.kernels, precision)
        if self.fp8:  # FP8 bytes (uint8, so that model.to(dtype) leaves them) + block scales
            self.register_buffer("w13_q", torch.empty(count, 2 * inter, hidden, dtype=torch.uint8))
            self.register_buffer("w2_q", torch.empty(count, hidden, inter, dtype=torch.uint8))
            self.register_buffer("w13_scale", torch.empty(count, 2 * inter // 128, -(-hidden // 128)))
            self.register_buffer("w2_scale", torch.empty(count, -(-hidden // 128), inter // 128))
        else:
            self.w13 = nn.Parameter(torch.empty(count, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(count, hidden, inter))

    def set_precision(self, precision: str) -> None:
        """Holds the weights at `precision` from now on: "auto" (the checkpoint's: FP8 kept where
        `keeps_fp8_experts`, else the model's dtype), "bf16", or "fp8" (kept as FP8 bytes where
        `keeps_fp8_experts`, else the values of the block-quantized weights in the model's dtype;
        the loader quantizes them, models/quant.py). Before loading only: the weights are
        allocated again, empty (the model is built on the meta device)."""
        if precision != self.precision:
            self._allocate(precision)

    def keep_storage_dtypes(self) -> None:
        """After model.to(dtype): the FP8 block scales stay fp32, as the checkpoint stores them, and
        bf16 experts stay bf16."""
        if self.fp8:
            self.w13_scale, self.w2_scale = self.w13_scale.float(), self.w2_scale.float()
        elif self.precision == "bf16":
            self.w13 = nn.Parameter(self.w13.to(torch.bfloat16), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.to(torch.bfloat16), requires_grad=False)

    def adopt(self, other: RoutedExperts) -> None:
        """Serves `other`'s slots from now on (a rebalance's or a recovery's switch): its weights
        are copied into this module's storage, so every weight tensor keeps its address (CUDA
        graphs captured over the experts read them there). `other` must hold as many slots in the
        same layout and dtypes; nothing is copied otherwise."""
        names = self.weight_names()
        if other.count != self.count or other.fp8 != self.fp8:
            raise ValueError(
                f"cannot adopt {other.count} slots{' of FP8 weights' if other.fp8 else ''} into "
                f"{self.count}{' of FP8 weights' if self.fp8 else ''}: a switch copies into the same storage"
            )
        for name in names:
            dst, src = getattr(self, name), getattr(other, name)
            if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
                raise ValueError(
                    f"cannot adopt {name} {src.dtype} {list(src.shape)} on {src.device} into {dst.dtype} "
                    f"{list(dst.shape)} on {dst.device}: a switch copies into the same storage"
                )
        # inference mode: the staged weights were made in it, and the serving ones may have been
        with torch.inference_mode():
            for name in names:
                getattr(self, name).copy_(getattr(other, name))
        self.slot_expert = list(other.slot_expert)

    def rebind(self, other: RoutedExperts) -> None:
        """Serves `other`'s slots in `other`'s storage from now on: a switch that changes how many
        slots this rank holds (a recovery that grew it, an admission that shrinks it back) cannot
        copy into the old storage. The weight tensors move: whoever holds their addresses (CUDA
        graphs, the static-decode guard) must take them again."""
        if other.fp8 != self.fp8 or other.precision != self.precision:
            raise ValueError(f"cannot serve {other.precision} experts in place of {self.precision} ones")
        for name in self.weight_names():
            tensor = getattr(other, name)
            setattr(self, name, nn.Parameter(tensor, requires_grad=False) if name in ("w13", "w2") else tensor)
        self.slot_expert, self.count = list(other.slot_expert), other.count

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """The weights of one slot, one tensor per weight (what a peer copy carries)."""
        return [getattr(self, name)[slot] for name in self.weight_names()]

    def weight_names(self) -> tuple[str, ...]:
        """The weight tensors of every slot, by attribute name."""
        return ("w13_q", "w2_q", "w13_scale", "w2_scale") if self.fp8 else ("w13", "w2")

    def gather(self, slot_expert: list[int], sources: list[RoutedExperts]) -> RoutedExperts:
        """A new module holding `slot_expert`, each slot's weights copied from the first of `sources`
        that holds its expert (a rebalance's staging: experts kept here are copied, not re-read).
        A source is anything with `slot_expert` and these weights stacked per slot."""
        where = {}
        for src in sources:
            for i, e in enumerate(src.slot_expert):
                where.setdefault(e, (src, i))
        with on_meta():
            out = RoutedExperts(self.cfg, slot_expert, self.kernels, self.precision)
        for name in self.weight_names():
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
        if self.w13.dtype != x.dtype:  # experts held in another precision (bf16): computed in theirs
            return self.kernels.fused_moe(x.to(self.w13.dtype), self.w13, self.w2, local_ids, weights).to(x.dtype)
        return self.kernels.fused_moe(x, self.w13, self.w2, local_ids, weights)


def keeps_fp8_experts(cfg: ModelConfig, moe_kernels, precision: str = "auto") -> bool:
    """Routed experts are held as FP8 bytes with their block scales (not dequantized) when they are
    FP8 with 128x128 blocks (the checkpoint's, or quantized at load for `precision` "fp8" from a
    checkpoint that is not FP8), the MoE backend computes on FP8 weights, and gate and up each fill
    whole 128-row blocks (stacked into w13, their scales then stack too). "bf16" never keeps FP8."""
    fp8_blocks = cfg.fp8_block == (128, 128) if cfg.fp8_block is not None else precision == "fp8"
    return (
        precision != "bf16"
        and fp8_blocks
        and hasattr(moe_kernels, "fused_moe_fp8")
        and cfg.moe_intermediate_size % 128 == 0
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
