"""A deployment's shape, derived from EngineArgs and the checkpoint, validated before anything starts."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
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
    num_groups: int = 1  # expert groups of group-limited routing (kept on one node by the placement)

    @staticmethod
    def of(args: EngineArgs, cfg: ModelConfig) -> DeploymentSpec:
        layers = cfg.moe_layers
        if args.spec_steps and cfg.mtp_layers and cfg.is_moe_layer(cfg.num_layers):
            layers += (cfg.num_layers,)  # the MTP draft module's experts are placed like any layer's
        spec = DeploymentSpec(args, cfg.n_routed_experts, layers, cfg.n_group)
        spec.validate()
        return spec

    def validate(self) -> None:
        a = self.args
        if a.init_expert_location is not None:
            read_load_report(a.init_expert_location, self.moe_layers, self.num_experts)
        ranks = self.num_expert_ranks
        held_by = f"{ranks} FFN ranks" if a.mode == "afd" else f"{ranks} ranks"
        slots = self.num_experts + a.ep_num_redundant_experts
        if slots % ranks:
            fix = "--ffn-nodes x --ffn-ranks-per-node" if a.mode == "afd" else "--dp-size"
            what = f"{self.num_experts} routed experts" + (
                f" + {a.ep_num_redundant_experts} redundant copies" if a.ep_num_redundant_experts else ""
            )
            raise ConfigError(
                f"the model has {what}, which do not divide over {held_by}; choose {fix} that divides {slots}"
                + (" or another --ep-num-redundant-experts" if a.ep_num_redundant_experts else "")
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
    def ranks_per_node(self) -> int:
        a = self.args
        return a.ffn_ranks_per_node if a.mode == "afd" else a.dp_size // a.ffn_nodes

    @property
    def layout(self) -> ExpertLayout:
        a = self.args
        return ExpertLayout(
            self.num_experts, a.ep_num_redundant_experts, a.ffn_nodes, self.ranks_per_node, self.num_groups
        )

    @property
    def topology(self) -> Topology:
        """Dispatch addresses physical expert slots (experts + redundant copies), not experts."""
        a, slots = self.args, self.layout.num_slots
        return Topology(a.dp_size, a.ffn_nodes, self.ranks_per_node, slots, colocated=a.mode != "afd")

    def topology_of(self, expert_map: ExpertMap) -> Topology:
        """The topology dispatch uses with `expert_map`: its lost ranks masked, and its slots per
        rank where a recovery grew some (eplb/elastic.py)."""
        topo = dataclasses.replace(self.topology, dead=expert_map.dead)
        if not expert_map.grown:
            return topo
        return dataclasses.replace(topo, num_experts=expert_map.num_slots, rank_sizes=expert_map.sizes)

    def initial_map(self) -> ExpertMap:
        """Experts in order (with copies, the placement of a uniform load), or the placement that
        balances the load report of --init-expert-location."""
        path = self.args.init_expert_location
        if path is None:
            return ExpertMap.initial(self.layout, self.moe_layers)
        load = read_load_report(path, self.moe_layers, self.num_experts)
        return ExpertMap(self.layout, {layer: self.layout.place(load[i]) for i, layer in enumerate(self.moe_layers)})

    def expert_slots(self, rank: int) -> dict[int, list[int]]:
        """Per MoE layer, the logical expert of each slot expert rank `rank` starts with."""
        return self.initial_map().rank_slots(rank)

    def comm_config(self) -> CommConfig:
        a = self.args
        act = dtype_name(a.torch_dtype)
        wire = WireFormat(dispatch=a.dispatch_dtype, combine=act if a.combine_dtype == "auto" else a.combine_dtype)
        return CommConfig(a.dispatch_mode, wire, a.comm_timeout)


def read_load_report(path: str, moe_layers: tuple[int, ...], num_experts: int) -> torch.Tensor:
    """The "load" of an expert load report as [MoE layers, experts] float64; errors name the flag."""
    where = f"--init-expert-location={path!r}"
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read a JSON load report: {exc}") from None
    if not isinstance(report, dict) or "load" not in report:
        raise ConfigError(f'{where}: no "load" in it; save one with afd expert-load --output FILE')
    try:
        load = torch.tensor(report["load"], dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f'{where}: "load" is not a table of numbers: {exc}') from None
    layers = report.get("moe_layers", list(moe_layers))
    if list(layers) != list(moe_layers) or tuple(load.shape) != (len(moe_layers), num_experts):
        raise ConfigError(
            f"{where}: the report covers MoE layers {layers} x {tuple(load.shape)[1:]} experts; this model has "
            f"layers {list(moe_layers)} x {num_experts} experts"
        )
    if bool((load < 0).any()):
        raise ConfigError(f"{where}: loads must not be negative")
    return load
