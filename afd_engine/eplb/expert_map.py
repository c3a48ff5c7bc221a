"""Logical experts -> physical expert slots, per MoE layer, with redundant copies of hot experts.

A deployment with R redundant experts holds E + R physical slots per MoE layer, (E + R) / ranks on
each expert rank (slot s on rank s // slots_per_rank). The attention side routes with logical ids
(the gate's) and dispatches physical slot ids: every (token, expert) pair goes to one copy of the
expert, the expert's pairs in a batch dealt round-robin over its copies, so copies share an
expert's load evenly and the choice is deterministic (reproducible tests).

`version` counts placements: 0 is the one a deployment starts with (`initial`), every rebalance
installs the next. `dead`: expert ranks lost (AFD fault tolerance); their slots are never routed to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_engine.eplb.placement import Placement, RecoveryImpossible, place, without_ranks


@dataclass(frozen=True)
class ExpertLayout:
    """What a placement is placed on: experts, redundant copies, nodes x ranks, expert groups."""

    num_experts: int
    num_redundant: int
    num_nodes: int
    ranks_per_node: int
    num_groups: int = 1

    @property
    def num_slots(self) -> int:
        return self.num_experts + self.num_redundant

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def place(self, load: torch.Tensor) -> Placement:
        return place(load, self.num_redundant, self.num_nodes, self.ranks_per_node, self.num_groups)

    def initial(self) -> Placement:
        """Before any load is known: experts in order (slot e = expert e) without redundancy, else
        the placement of a uniform load (groups kept on nodes, spare copies to the first experts)."""
        if self.num_redundant == 0:
            return Placement(list(range(self.num_experts)), self.slots_per_rank)
        return self.place(torch.ones(self.num_experts))


class ExpertMap:
    """The current placement of every MoE layer and the tables that route through it."""

    def __init__(
        self,
        layout: ExpertLayout,
        placements: dict[int, Placement],
        version: int = 0,
        dead: frozenset[int] = frozenset(),
    ) -> None:
        self.layout, self.placements, self.version, self.dead = layout, placements, version, frozenset(dead)
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._in_order: set[int] = set()  # layers whose slot s holds expert s: slots are the ids
        spr = layout.slots_per_rank
        for layer, p in placements.items():
            replicas = [[s for s in r if s // spr not in self.dead] for r in p.replicas(layout.num_experts)]
            missing = [e for e, r in enumerate(replicas) if not r]
            if missing or p.num_slots != layout.num_slots:
                raise ValueError(
                    f"layer {layer}: a placement needs {layout.num_slots} slots holding every expert; it has "
                    f"{p.num_slots}"
                    + (f" and expert {missing[0]} has no slot" if missing else "")
                    + (f" on a live rank (lost: {sorted(self.dead)})" if missing and self.dead else "")
                )
            width = max(len(r) for r in replicas)
            table = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64)  # [E, width]
            self._tables[layer] = (table, torch.tensor([len(r) for r in replicas], dtype=torch.int64))
            if p.slot_expert == list(range(layout.num_experts)) and not self.dead:
                self._in_order.add(layer)

    @staticmethod
    def initial(layout: ExpertLayout, moe_layers) -> ExpertMap:
        p = layout.initial()
        return ExpertMap(layout, {layer: p for layer in moe_layers})

    def without_ranks(self, dead: set[int], version: int) -> ExpertMap:
        """This placement with expert ranks `dead` lost as well (placement.without_ranks per layer);
        RecoveryImpossible names the layer that cannot be served."""
        dead = set(dead) | self.dead
        placements = {}
        for layer, p in self.placements.items():
            try:
                placements[layer] = without_ranks(p, dead, self.layout.num_experts)
            except RecoveryImpossible as exc:
                raise RecoveryImpossible(f"MoE layer {layer} without expert ranks {sorted(dead)}: {exc}") from None
        return ExpertMap(self.layout, placements, version, frozenset(dead))

    def rank_slots(self, rank: int) -> dict[int, list[int]]:
        """Per MoE layer, the logical expert of each of `rank`'s slots, in slot order."""
        spr = self.layout.slots_per_rank
        return {layer: p.slot_expert[rank * spr : (rank + 1) * spr] for layer, p in self.placements.items()}

    def to_physical(self, layer: int, topk_ids: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """topk_ids [T, K] logical -> [T, K] physical slots. The i-th pair (in row-major order)
        routed to an expert with c copies goes to copy (i + salt) mod c: copies split each batch's
        pairs evenly, and `salt` rotates which copy takes the odd ones. Where every expert has one
        slot, its own id, these are topk_ids themselves."""
        if layer in self._in_order:
            return topk_ids
        table, copies = self._tables[layer]
        if table.device != topk_ids.device:
            table, copies = table.to(topk_ids.device), copies.to(topk_ids.device)
            self._tables[layer] = (table, copies)
        if table.shape[1] == 1:  # no expert of this layer has a second copy
            return table[topk_ids, 0]
        return spread_over_copies(topk_ids, table, copies, salt)

    def tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s routing tables: [E, width] the slots of each expert's copies (the first
        repeated past its count), [E] each expert's count of copies."""
        return self._tables[layer]

    def rank_loads(self, load: torch.Tensor) -> torch.Tensor:
        """load [layers, E] (MoE layers in order) -> [ranks]: tokens per expert rank, summed over
        layers, each expert's load split evenly over its copies. Layers past the load's rows (the
        MTP draft module's, placed last and not watched) count nothing."""
        out = torch.zeros(self.layout.num_ranks, dtype=torch.float64)
        for i, p in zip(range(len(load)), self.placements.values()):
            out += p.rank_loads(load[i], self.dead)
        return out

    @staticmethod
    def from_description(layout: ExpertLayout, d: dict) -> ExpertMap:
        """The inverse of `describe`."""
        placements = {int(layer): Placement(list(s), layout.slots_per_rank) for layer, s in d["slot_expert"].items()}
        return ExpertMap(layout, placements, d["version"], frozenset(d.get("dead", ())))

    def describe(self) -> dict:
        """JSON-able: version and, per layer, each physical slot's logical expert."""
        return {
            "version": self.version,
            "slots_per_rank": self.layout.slots_per_rank,
            "slot_expert": {str(layer): list(p.slot_expert) for layer, p in self.placements.items()},
            "dead": sorted(self.dead),
        }


def spread_over_copies(
    topk_ids: torch.Tensor, table: torch.Tensor, copies: torch.Tensor, salt: int | torch.Tensor
) -> torch.Tensor:
    """ExpertMap.to_physical's rule over explicit tables (persistent ones, in a CUDA graph): the
    i-th pair routed to an expert goes to its copy (i + salt) mod count; device compute only."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    ones = torch.ones_like(flat)  # index_add, not bincount: no device sync on a GPU
    counts = torch.zeros(table.shape[0], dtype=flat.dtype, device=flat.device).index_add_(0, flat, ones)
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in sorted order
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    return table[flat, (occurrence + salt) % copies[flat]].view_as(topk_ids)
