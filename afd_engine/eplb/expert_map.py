"""Logical experts -> physical expert slots, per MoE layer, with redundant copies of hot experts.

A deployment with R redundant experts holds E + R physical slots per MoE layer, (E + R) / ranks on
each expert rank (slot s on rank s // slots_per_rank) until a recovery grows some ranks' storage
(eplb/elastic.py): then rank r holds `sizes[r]` consecutive slots, the same count in every layer.
The attention side routes with logical ids (the gate's) and dispatches physical slot ids: every
(token, expert) pair goes to one copy of the expert, the expert's pairs in a batch dealt
round-robin over its copies, so copies share an expert's load evenly and the choice is
deterministic (reproducible tests).

`version` counts placements: 0 is the one a deployment starts with (`initial`), every rebalance
installs the next. `dead`: expert ranks lost (AFD fault tolerance); their slots are never routed to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_engine.eplb.elastic import grow, grown_sizes
from afd_engine.eplb.placement import Placement, give_up_copies, place


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
        self.sizes = _sizes(layout, placements)
        for layer, p in placements.items():
            owner = p.slot_ranks()
            replicas = [[s for s in r if owner[s] not in self.dead] for r in p.replicas(layout.num_experts)]
            missing = [e for e, r in enumerate(replicas) if not r]
            if missing:
                raise ValueError(
                    f"layer {layer}: expert {missing[0]} has no slot"
                    + (f" on a live rank (lost: {sorted(self.dead)})" if self.dead else "")
                )
            width = max(len(r) for r in replicas)
            table = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64)  # [E, width]
            self._tables[layer] = (table, torch.tensor([len(r) for r in replicas], dtype=torch.int64))
            if p.slot_expert == list(range(layout.num_experts)) and not self.dead:
                self._in_order.add(layer)

    @property
    def num_slots(self) -> int:
        """Physical slots per MoE layer (more than the layout's once a recovery grew a rank)."""
        return sum(self.sizes)

    @property
    def grown(self) -> bool:
        """Whether some rank holds another number of slots than the layout gives each."""
        return any(n != self.layout.slots_per_rank for n in self.sizes)

    @staticmethod
    def initial(layout: ExpertLayout, moe_layers) -> ExpertMap:
        p = layout.initial()
        return ExpertMap(layout, {layer: p for layer in moe_layers})

    def without_ranks(self, dead: set[int], version: int, caps: dict[int, int] | None = None) -> ExpertMap:
        """This placement with expert ranks `dead` lost as well: per layer, spare copies give their
        slots to the experts left without a live one (placement.give_up_copies); the experts still
        without one get new slots on the survivors, each within caps[rank] slots (eplb/elastic.py;
        a rank without a cap does not grow). RecoveryImpossible names the layer that cannot be
        served and the cap flag."""
        dead = set(dead) | self.dead
        shrunk, lost = {}, {}
        for layer, p in self.placements.items():
            shrunk[layer], lost[layer] = give_up_copies(p, dead, self.layout.num_experts)
        first = min(shrunk)  # every layer lacks as many slots (eplb/elastic.py)
        if lost[first]:
            sizes = grown_sizes(self.sizes, dead, caps or {}, len(lost[first]), first)
            shrunk = {layer: grow(p, sizes, lost[layer]) for layer, p in shrunk.items()}
        return ExpertMap(self.layout, shrunk, version, frozenset(dead))

    def rank_slots(self, rank: int) -> dict[int, list[int]]:
        """Per MoE layer, the logical expert of each of `rank`'s slots, in slot order."""
        return {layer: [p.slot_expert[s] for s in p.rank_range(rank)] for layer, p in self.placements.items()}

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
        sizes = tuple(d["sizes"]) if d.get("sizes") else None
        placements = {
            int(layer): Placement(list(s), layout.slots_per_rank, sizes) for layer, s in d["slot_expert"].items()
        }
        return ExpertMap(layout, placements, d["version"], frozenset(d.get("dead", ())))

    def describe(self) -> dict:
        """JSON-able: version and, per layer, each physical slot's logical expert."""
        return {
            "version": self.version,
            "slots_per_rank": self.layout.slots_per_rank,
            "slot_expert": {str(layer): list(p.slot_expert) for layer, p in self.placements.items()},
            "dead": sorted(self.dead),
            "sizes": list(self.sizes) if self.grown else None,  # slots per rank, once a recovery grew some
        }


def _sizes(layout: ExpertLayout, placements: dict[int, Placement]) -> tuple[int, ...]:
    """The slots per rank every layer's placement agrees on (ValueError otherwise: dispatch
    addresses one table of slots for all layers)."""
    sizes = {p.rank_sizes for p in placements.values()} or {(layout.slots_per_rank,) * layout.num_ranks}
    uneven = any(sum(p.rank_sizes) != p.num_slots for p in placements.values())
    if uneven or len(sizes) > 1 or len(next(iter(sizes))) != layout.num_ranks:
        raise ValueError(
            f"a placement needs {layout.num_ranks} ranks with the same slots in every layer; the layers give "
            f"{sorted(map(list, sizes))}"
        )
    return next(iter(sizes))


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
