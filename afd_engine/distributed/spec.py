"""A deployment's shape, derived from EngineArgs and the checkpoint, validated before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from afd_engine.engine_args import EngineArgs
from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from comm.endpoint import CommConfig
from comm.protocol import dtype_name
from comm.topology import Topology
from comm.wire import WireFormat


@dataclass(frozen=True)
class DeploymentSpec:
    args: EngineArgs
    num_experts: int
    moe_layers: tuple[int, ...]

    @staticmethod
    def of(args: EngineArgs, cfg: ModelConfig) -> DeploymentSpec:
        spec = DeploymentSpec(args, cfg.n_routed_experts, cfg.moe_layers)
        spec.validate()
        return spec

    def validate(self) -> None:
        a = self.args
        ranks = self.num_expert_ranks
        held_by = f"{ranks} FFN ranks" if a.mode == "afd" else f"{ranks} ranks"
        if self.num_experts % ranks:
            fix = "--ffn-nodes x --ffn-ranks-per-node" if a.mode == "afd" else "--dp-size"
            raise ConfigError(
                f"the model has {self.num_experts} routed experts, which do not divide over {held_by}; "
                f"choose {fix} that divides {self.num_experts}"
            )
        if a.ep_size is not None and a.ep_size != ranks:
            how = "--ffn-nodes x --ffn-ranks-per-node" if a.mode == "afd" else "--dp-size"
            raise ConfigError(f"--ep-size={a.ep_size} but {how} gives {held_by}; make them agree")
        if a.mode == "colocated" and a.dp_size % a.ffn_nodes:
            raise ConfigError(f"--dp-size={a.dp_size} ranks do not split evenly over --ffn-nodes={a.ffn_nodes} nodes")

    @property
    def num_attention_ranks(self) -> int:
        return self.args.dp_size

    @property
    def num_expert_ranks(self) -> int:
        a = self.args
        return a.ffn_nodes * a.ffn_ranks_per_node if a.mode == "afd" else a.dp_size

    @property
    def topology(self) -> Topology:
        a = self.args
        if a.mode == "afd":
            return Topology(a.dp_size, a.ffn_nodes, a.ffn_ranks_per_node, self.num_experts)
        return Topology(a.dp_size, a.ffn_nodes, a.dp_size // a.ffn_nodes, self.num_experts, colocated=True)

    def expert_range(self, rank: int) -> tuple[int, int]:
        per = self.num_experts // self.num_expert_ranks
        return rank * per, (rank + 1) * per

    def comm_config(self) -> CommConfig:
        a = self.args
        act = dtype_name(a.torch_dtype)
        wire = WireFormat(dispatch=a.dispatch_dtype, combine=act if a.combine_dtype == "auto" else a.combine_dtype)
        return CommConfig(a.dispatch_mode, wire, a.comm_timeout)
