"""Step-3's closed-form budgets: the per-layer stage budget of a pipelined TPOT target, the FFN batch
that keeps 8-bit GEMMs compute-bound, and the sparsest MoE a platform's network can feed.

    budget per stage and layer = TPOT / stages / layers           (50 ms, 3 stages, 61 layers: ~272 us)
    B_dense >= roofline / 2,  B_MoE = B_dense / S                 (8-bit weights: 2 FLOPs per weight byte)
    traffic per layer = 3 * H * B_MoE bytes                       (fp8 dispatch + bf16 combine)
    L * traffic / Net <= TPOT / stages  =>  S >= 3 * L * H * roofline / (2 * Net * TPOT / stages)

Net is the scale-out bandwidth of one 8-accelerator server (8 x 400 Gb/s for H800/H20,
8 x 200 Gb/s for A800/910B), as in the paper's table.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_engine.errors import ConfigError
from afd_engine.planner.hardware import Hardware


def stage_budget_us(tpot_ms: float = 50.0, stages: int = 3, layers: int = 61) -> float:
    if tpot_ms <= 0 or stages < 1 or layers < 1:
        raise ConfigError("TPOT must be > 0, stages and layers >= 1")
    return tpot_ms * 1e3 / stages / layers


@dataclass(frozen=True)
class SparsityBound:
    min_sparsity: float
    roofline: float  # FLOPs per byte
    b_dense: float  # tokens for a compute-bound dense FFN
    network_gbs: float  # one server's scale-out bandwidth, GB/s
    budget_ms: float  # network time allowed per token (TPOT / stages)

    def b_moe(self, sparsity: float) -> float:
        return self.b_dense / sparsity

    def as_dict(self) -> dict:
        return {
            "min_sparsity": self.min_sparsity,
            "roofline": self.roofline,
            "b_dense": self.b_dense,
            "network_gbs": self.network_gbs,
            "budget_ms": self.budget_ms,
        }


def min_sparsity(hw: Hardware, hidden: int, layers: int, tpot_ms: float = 50.0, stages: int = 3) -> SparsityBound:
    if hidden < 1 or layers < 1:
        raise ConfigError("--hidden and --layers must be >= 1")
    budget_s = tpot_ms / stages / 1e3
    net = hw.node_nic_gbps / 8 * 1e9  # bytes/s
    s = 3 * layers * hidden * hw.roofline / (2 * net * budget_s)
    return SparsityBound(s, hw.roofline, hw.roofline / 2, net / 1e9, budget_s * 1e3)
